"""Tests of the model zoo (ftcompile.models): building, inputs, sizes, errors, user models,
pretrained checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ftcompile.models import (
    BuiltModel,
    ModelOptions,
    ZooEntry,
    ZooError,
    build_model,
    get_entry,
    list_models,
)

SMALL = ["gpt2-tiny", "bert-tiny", "t5-tiny", "vit-tiny", "mlp", "skipnet", "encdec"]
META = ModelOptions(device="meta")


def _loss(built: BuiltModel) -> torch.Tensor:
    return built.model(*built.args, **built.kwargs)[0]


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    values = [*args, *kwargs.values()]
    return [v for v in values if isinstance(v, torch.Tensor)]


# --------------------------------------------------------------------------- listing


def test_zoo_lists_every_family():
    names = [e.name for e in list_models()]
    assert len(names) == len(set(names))
    for name in ["gpt2-tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl",
                 "bert-tiny", "bert-base", "bert-large",
                 "t5-tiny", "t5-small", "t5-base", "t5-large", "t5-3b", "t5-11b",
                 "vit-tiny", "vit-base", "vit-large", "mlp", "skipnet", "encdec"]:
        entry = get_entry(name)
        assert isinstance(entry, ZooEntry) and entry.name == name
        assert entry.family in {"gpt2", "bert", "t5", "vit", "synthetic"}
    for family, sizes in {"llama": ["llama-tiny", "llama-1b", "llama-7b", "llama-8b", "llama-13b"],
                          "mistral": ["mistral-tiny", "mistral-7b"],
                          "qwen2": ["qwen2-tiny", "qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"],
                          "qwen3": ["qwen3-tiny", "qwen3-0.6b", "qwen3-8b"]}.items():
        assert [get_entry(n).family for n in sizes] == [family] * len(sizes)
        assert entry.description and entry.default_options.batch_size


def test_import_does_not_load_transformers():
    # transformers costs ~1 s to import; the zoo must defer it to the first build.
    code = "import sys, ftcompile.models; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- small builds


@pytest.mark.parametrize("name", SMALL)
def test_small_model_trains(name):
    built = build_model(name)
    assert built.name == name and built.options.device == "cpu"
    assert built.model.training  # the compiler traces a training step
    assert all(t.device.type == "cpu" for t in _tensors(built.args, built.kwargs))
    loss = _loss(built)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in built.model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads[:3])
    assert built.num_parameters == get_entry(name).approx_parameters


@pytest.mark.parametrize("name", SMALL)
def test_make_inputs_is_seeded_and_matches_examples(name):
    built = build_model(name, ModelOptions(seed=3))
    args, kwargs = built.make_inputs("cpu")
    again_args, again_kwargs = built.make_inputs("cpu")
    assert kwargs.keys() == built.kwargs.keys()
    for a, b, c in zip(_tensors(args, kwargs), _tensors(again_args, again_kwargs),
                       _tensors(built.args, built.kwargs)):
        assert torch.equal(a, b) and torch.equal(a, c)
        assert a.shape == c.shape and a.dtype == c.dtype


def test_options_resolved_and_applied():
    built = build_model("gpt2-tiny", ModelOptions(batch_size=3, seq_len=17))
    assert built.options.batch_size == 3 and built.options.seq_len == 17
    assert built.options.encoder_len is None
    (ids,), kwargs = built.args, built.kwargs
    assert ids.shape == (3, 17) and int(ids.max()) < 1000
    assert torch.equal(kwargs["labels"], ids) and kwargs["use_cache"] is False

    t5 = build_model("t5-tiny", ModelOptions(encoder_len=10, decoder_len=3))
    assert t5.args[0].shape == (2, 10) and t5.kwargs["labels"].shape == (2, 3)
    assert _loss(t5).dim() == 0

    bert = build_model("bert-tiny", ModelOptions(seq_len=20))
    assert bert.args[0].shape == (2, 20)
    assert int(bert.kwargs["end_positions"].max()) < 20

    enc = build_model("encdec", ModelOptions(encoder_len=12, decoder_len=5, batch_size=1))
    assert [a.shape for a in enc.args] == [(1, 12), (1, 5), (1, 5)]


def test_same_seed_same_weights():
    a = build_model("t5-tiny", ModelOptions(seed=1)).model.state_dict()
    b = build_model("t5-tiny", ModelOptions(seed=1)).model.state_dict()
    c = build_model("t5-tiny", ModelOptions(seed=2)).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["shared.weight"], c["shared.weight"])


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("mlp")
    assert torch.equal(torch.rand(3), expected)


def test_dtype_casts_model_and_float_inputs():
    built = build_model("vit-tiny", ModelOptions(dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in built.model.parameters())
    assert built.args[0].dtype == torch.bfloat16
    assert built.kwargs["labels"].dtype == torch.long
    assert built.make_inputs("cpu")[0][0].dtype == torch.bfloat16
    assert torch.isfinite(_loss(built).float())


# --------------------------------------------------------------------------- sizes (meta)


@pytest.mark.parametrize("name, expected", [
    ("gpt2-small", 124e6),
    ("gpt2-xl", 1.56e9),
    ("bert-large", 335e6),
    ("t5-small", 60.5e6),
    ("t5-3b", 2.85e9),
    ("vit-base", 86e6),
])
def test_parameter_counts(name, expected):
    built = build_model(name, META)
    assert abs(built.num_parameters - expected) / expected < 0.01


def test_t5_11b_parameter_count():
    # Fast on meta (well under a second), so not marked slow.
    built = build_model("t5-11b")
    assert built.options.device == "meta"
    assert abs(built.num_parameters - 11.3e9) / 11.3e9 < 0.01


def test_every_entry_reports_its_built_size():
    for entry in list_models():
        assert build_model(entry.name, META).num_parameters == entry.approx_parameters, entry.name


def test_meta_build_allocates_nothing():
    built = build_model("t5-3b")  # auto: >= 500M parameters -> meta
    assert built.options.device == "meta"
    assert all(p.is_meta for p in built.model.parameters())
    assert all(b.is_meta for b in built.model.buffers())
    assert all(t.is_meta for t in _tensors(built.args, built.kwargs))
    args, kwargs = built.make_inputs("cpu")
    assert all(not t.is_meta for t in _tensors(args, kwargs))
    assert args[0].shape == (4, 512) and kwargs["labels"].shape == (4, 4)
    assert int(args[0].max()) < 32128


def test_auto_device_keeps_small_models_on_cpu():
    assert build_model("bert-tiny").options.device == "cpu"
    assert build_model("gpt2-xl").options.device == "meta"


# --------------------------------------------------------------------------- tying


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-xl"])
def test_gpt2_lm_head_tied(name):
    model = build_model(name, META).model
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("name", ["t5-tiny", "t5-3b"])
def test_t5_embeddings_tied(name):
    model = build_model(name, META).model
    shared = model.shared.weight
    assert model.encoder.embed_tokens.weight is shared
    assert model.decoder.embed_tokens.weight is shared
    assert model.lm_head.weight is shared


def test_skipnet_output_projection_is_the_embedding():
    built = build_model("skipnet")
    _loss(built).backward()
    # One parameter, gradient from both its uses.
    names = [n for n, _ in built.model.named_parameters()]
    assert "embed.weight" in names and built.model.embed.weight.grad is not None


# --------------------------------------------------------------------------- errors


def test_unknown_name_lists_zoo():
    with pytest.raises(ZooError) as err:
        build_model("gpt3")
    for name in ["gpt2-xl", "t5-11b", "vit-tiny", "encdec"]:
        assert name in str(err.value)
    with pytest.raises(ZooError, match="gpt2-tiny"):
        get_entry("nope")


@pytest.mark.parametrize("name, options, match", [
    ("gpt2-tiny", ModelOptions(encoder_len=8), "does not take encoder_len"),
    ("t5-tiny", ModelOptions(seq_len=8), "encoder_len"),
    ("vit-tiny", ModelOptions(seq_len=8), "image_size and patch_size"),
    ("mlp", ModelOptions(seq_len=8), "does not take seq_len"),
    ("gpt2-tiny", ModelOptions(seq_len=257), "maximum of 256"),
    ("bert-tiny", ModelOptions(seq_len=513), "maximum of 512"),
    ("encdec", ModelOptions(encoder_len=600), "maximum of 512"),
    ("gpt2-tiny", ModelOptions(batch_size=0), "batch_size"),
    ("gpt2-tiny", ModelOptions(dtype="float64"), "dtype"),
    ("gpt2-tiny", ModelOptions(device="tpu"), "device"),
    ("mlp", ModelOptions(pretrained="/nonexistent"), "HuggingFace"),
])
def test_bad_options(name, options, match):
    with pytest.raises(ZooError, match=match):
        build_model(name, options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_unavailable():
    with pytest.raises(ZooError, match="CUDA"):
        build_model("mlp", ModelOptions(device="cuda"))


def test_zoo_error_is_value_error():
    assert issubclass(ZooError, ValueError)


# --------------------------------------------------------------------------- pretrained


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    source = build_model("gpt2-tiny", ModelOptions(seed=7)).model
    directory = tmp_path_factory.mktemp("gpt2ckpt")
    source.save_pretrained(directory)  # safetensors by default
    return directory, source


def test_pretrained_round_trip(gpt2_checkpoint):
    directory, source = gpt2_checkpoint
    built = build_model("gpt2-tiny", ModelOptions(pretrained=str(directory)))
    model = built.model
    assert built.options.device == "cpu"
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, source.transformer.h[1].mlp.c_fc.weight)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.training  # from_pretrained returns eval mode; the zoo undoes that
    assert torch.isfinite(_loss(built))


def test_pretrained_load_draws_no_progress_bar(gpt2_checkpoint, capfd):
    from transformers.utils import logging as hf_logging

    directory, _source = gpt2_checkpoint
    assert hf_logging.is_progress_bar_enabled()
    capfd.readouterr()
    build_model("gpt2-tiny", ModelOptions(pretrained=str(directory)))
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err
    assert hf_logging.is_progress_bar_enabled()          # the bar is back for everyone else
    hf_logging.disable_progress_bar()                    # and off stays off
    try:
        build_model("gpt2-tiny", ModelOptions(pretrained=str(directory)))
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_pretrained_t5_keeps_tying(tmp_path):
    source = build_model("t5-tiny", ModelOptions(seed=5)).model
    source.save_pretrained(tmp_path)
    model = build_model("t5-tiny", ModelOptions(pretrained=str(tmp_path))).model
    assert torch.equal(model.shared.weight, source.shared.weight)
    assert model.lm_head.weight is model.shared.weight
    assert model.decoder.embed_tokens.weight is model.shared.weight


def test_pretrained_config_decides_size(gpt2_checkpoint):
    # The entry picks the family; the checkpoint's config.json decides the dimensions.
    directory, _ = gpt2_checkpoint
    built = build_model("gpt2-xl", ModelOptions(pretrained=str(directory), device="meta"))
    assert built.num_parameters == get_entry("gpt2-tiny").approx_parameters
    assert built.options.seq_len == 256  # default 1024 clamped to the config's n_positions


def test_pretrained_errors(tmp_path, gpt2_checkpoint):
    directory, _ = gpt2_checkpoint
    with pytest.raises(ZooError, match="does not exist"):
        build_model("gpt2-tiny", ModelOptions(pretrained=str(tmp_path / "missing")))
    with pytest.raises(ZooError, match="no config.json"):
        build_model("gpt2-tiny", ModelOptions(pretrained=str(tmp_path)))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ZooError, match="safetensors"):
        build_model("gpt2-tiny", ModelOptions(pretrained=str(tmp_path)))
    with pytest.raises(ZooError, match="'gpt2' model, but the zoo entry is a 'bert'"):
        build_model("bert-tiny", ModelOptions(pretrained=str(directory)))


def test_pretrained_shape_mismatch_names_tensor(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256,
                        n_inner=128, bos_token_id=999, eos_token_id=999)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    # A config that disagrees with the weights: the default inner size is 4 * 64.
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["n_inner"] = None
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ZooError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight: checkpoint \[64, 128\]"):
        build_model("gpt2-tiny", ModelOptions(pretrained=str(tmp_path)))


# --------------------------------------------------------------------------- user models


USER_MODEL = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, target):
        out = self.fc(x)
        return nn.functional.mse_loss(out, target), out

def build():
    return Net(), (torch.randn(3, 4),), {"target": torch.zeros(3, 2)}

def build_pair():
    return Net(), (torch.randn(3, 4), torch.zeros(3, 2))

def not_a_tuple():
    return Net()

def args_as_tensor():
    return Net(), torch.randn(3, 4)

def broken():
    raise RuntimeError("boom")
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(USER_MODEL))
    return path


def test_user_model(user_file):
    spec = f"{user_file}:build"
    built = build_model(spec)
    assert built.name == spec and built.basic_blocks == ()
    assert built.options.device == "cpu"
    loss = _loss(built)
    assert loss.dim() == 0
    loss.backward()
    args, kwargs = built.make_inputs("cpu")
    assert torch.equal(args[0], built.args[0]) and set(kwargs) == {"target"}
    assert built.num_parameters == 10

    pair = build_model(f"{user_file}:build_pair")
    assert pair.kwargs == {} and len(pair.args) == 2
    assert torch.equal(pair.model.fc.weight, built.model.fc.weight)  # seeded alike

    on_meta = build_model(spec, META)
    assert all(p.is_meta for p in on_meta.model.parameters())


MIXED_PRECISION_MODEL = """
import torch
from torch import nn

class Adapted(nn.Module):
    # a frozen bfloat16 base and a trainable float32 adapter, as parameter-efficient fine-tuning builds it
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.adapter = nn.Linear(8, 8)

    def forward(self, x, target):
        h = self.base(x.to(torch.bfloat16)).float() + self.adapter(x)
        return nn.functional.mse_loss(h, target)

def build():
    return Adapted(), (torch.randn(4, 8), torch.randn(4, 8)), {}
"""


def test_a_user_model_keeps_the_dtypes_it_was_built_with(tmp_path):
    """Without --dtype a user model is compiled, packaged and verified as its function built it: a
    bfloat16 base stays bfloat16 beside float32 adapters (it was all cast to float32, silently, and
    verify agreed because it rebuilt the model with the same cast). --dtype still casts all."""
    from ftcompile.cli import main
    from ftcompile.runtime import load_package

    path = tmp_path / "adapted.py"
    path.write_text(textwrap.dedent(MIXED_PRECISION_MODEL))
    spec = f"{path}:build"
    built = build_model(spec)
    assert (built.model.base.weight.dtype, built.model.adapter.weight.dtype) == (torch.bfloat16, torch.float32)
    assert built.options.dtype is None and built.args[0].dtype == torch.float32
    cast = build_model(spec, ModelOptions(dtype="float32"))
    assert cast.model.base.weight.dtype == torch.float32
    out = tmp_path / "pkg"
    assert main(["compile", spec, "--gpus", "2", "--strategy", "seq", "--replicas", "1", "--jobs", "1", "-q",
                 "-o", str(out)]) == 0
    m = load_package(out).manifest
    assert m.dtype == "bfloat16"          # its least precise parameters name it (verify's tolerance)
    assert {n: s.dtype for n, s in m.params.items() if s.kind == "parameter"} == {
        "base.weight": "bfloat16", "base.bias": "bfloat16", "adapter.weight": "float32", "adapter.bias": "float32"}
    assert main(["verify", str(out), "-q"]) == 0


@pytest.mark.parametrize("fn, match", [
    ("missing", "has no function 'missing'; it defines: .*build"),
    ("not_a_tuple", "returned Net; it must return \\(model, args\\)"),
    ("args_as_tensor", "wrap a single tensor"),
    ("broken", "raised RuntimeError: boom"),
])
def test_user_model_errors(user_file, fn, match):
    with pytest.raises(ZooError, match=match):
        build_model(f"{user_file}:{fn}")


def test_user_model_missing_file(tmp_path):
    with pytest.raises(ZooError, match="does not exist"):
        build_model(f"{tmp_path}/nope.py:build")


def test_user_model_rejects_size_options(user_file):
    with pytest.raises(ZooError, match="batch_size"):
        build_model(f"{user_file}:build", ModelOptions(batch_size=2))


def test_user_model_import_error(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def build(:\n")
    with pytest.raises(ZooError, match="importing .*bad.py.* failed: SyntaxError"):
        build_model(f"{path}:build")


# --------------------------------------------------------------------------- LLM families, attention

LLMS = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny"]


@pytest.mark.parametrize("name", LLMS)
def test_llm_families_build_train_and_use_sdpa(name):
    built = build_model(name)
    assert type(built.model).__name__.endswith("ForCausalLM") and built.options.attention == "sdpa"
    assert built.model.config._attn_implementation == "sdpa"
    loss = _loss(built)
    loss.backward()
    assert torch.isfinite(loss) and built.num_parameters == get_entry(name).approx_parameters
    assert built.kwargs["labels"].data_ptr() != built.args[0].data_ptr()     # separate tensors


@pytest.mark.parametrize("name, layers, width, kv", [
    ("llama-7b", 32, 4096, 32), ("llama-8b", 32, 4096, 8), ("mistral-7b", 32, 4096, 8),
    ("qwen2-7b", 28, 3584, 4), ("qwen3-8b", 36, 4096, 8),
])
def test_giant_llms_are_the_real_configurations_on_meta(name, layers, width, kv):
    built = build_model(name)
    c = built.model.config
    assert built.options.device == "meta" and built.num_parameters > 6.5e9
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads) == (layers, width, kv)
    assert built.args[0].shape == (1, 1024)


def test_attention_option():
    assert build_model("gpt2-tiny").model.config._attn_implementation == "sdpa"
    eager = build_model("gpt2-tiny", ModelOptions(attention="eager"))
    assert eager.model.config._attn_implementation == "eager" and eager.options.attention == "eager"
    with pytest.raises(ZooError, match="attention must be one of sdpa, eager"):
        build_model("gpt2-tiny", ModelOptions(attention="flash"))
    with pytest.raises(ZooError, match="mlp does not take an attention implementation"):
        build_model("mlp", ModelOptions(attention="sdpa"))


def test_attention_option_is_refused_for_user_models(user_file):
    with pytest.raises(ZooError, match="does not take an attention implementation.*_attn_implementation"):
        build_model(f"{user_file}:build", ModelOptions(attention="eager"))
