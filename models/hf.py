"""HuggingFace transformer families of the zoo: GPT-2, BERT, T5, ViT, Llama, Mistral, Qwen2 and Qwen3.

Configs are written here in code (no hub access). ``transformers`` is imported only
inside the builders because importing it costs about a second.

Every model is built without a KV cache, with ``return_dict=True`` and with labels
among its inputs, so that its first output is the scalar training loss. Attention is
torch's fused ``scaled_dot_product_attention`` (``sdpa``, what transformers runs by
default and what users train with) wherever the architecture supports it;
``ModelOptions.attention="eager"`` (``--attention eager``) builds the explicit
``softmax(q k^T) v`` instead, which materialises the ``s x s`` attention matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .base import BuiltModel, ModelOptions, ZooEntry, ZooError
from .common import assemble, input_generator, resolve_options, seeded
from .pretrained import check_checkpoint, load_config, load_weights

# Inputs maker: (config, resolved options) -> (args, kwargs) as float32 CPU tensors.
InputMaker = Callable[[Any, ModelOptions], tuple[tuple, dict]]


@dataclass(frozen=True)
class HFSize:
    """One size of a family: its zoo name and what differs from the family's base config."""

    name: str
    config: dict[str, Any]
    defaults: ModelOptions
    approx_parameters: int
    description: str


@dataclass(frozen=True)
class HFFamily:
    """A transformers architecture and how to feed it.

    Attributes:
        family: the zoo family, equal to the transformers ``model_type``.
        config_class, model_class: transformers class names, resolved lazily.
        base_config: config keyword arguments shared by every size.
        config_defaults: attributes set on any config (also a pretrained one) where they
            are missing or ``None``, because the models need them.
        loss_type: set on the model where transformers cannot infer it from the class name.
        basic_blocks: the repeated layer class, the natural partitioning unit.
        lengths: the length options the family takes.
        length_note: why other length options are rejected.
        length_limits: maximum value of each length option for a given config.
        make_inputs: builds example inputs for a config and resolved options.
        sizes: the zoo entries of the family.
    """

    family: str
    config_class: str
    model_class: str
    base_config: dict[str, Any]
    config_defaults: dict[str, Any]
    loss_type: str | None
    basic_blocks: tuple[str, ...]
    lengths: tuple[str, ...]
    length_note: str
    length_limits: Callable[[Any], dict[str, int]]
    make_inputs: InputMaker
    sizes: tuple[HFSize, ...]


# --------------------------------------------------------------------------- inputs


def _random_ids(gen: torch.Generator, vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=gen)


def _gpt2_inputs(config, opts: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(opts.seed)
    ids = _random_ids(gen, config.vocab_size, opts.batch_size, opts.seq_len)
    # labels equal the ids (the model shifts them); a separate tensor so that the
    # traced graph never sees one tensor aliased by two inputs.
    return (ids,), {"labels": ids.clone(), "use_cache": False}


def _bert_inputs(config, opts: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(opts.seed)
    b, s = opts.batch_size, opts.seq_len
    ids = _random_ids(gen, config.vocab_size, b, s)
    # A question/context pair: segment 0 then segment 1, no padding.
    token_type_ids = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous()
    start = torch.randint(0, s, (b,), generator=gen)
    end = torch.clamp(start + torch.randint(0, 8, (b,), generator=gen), max=s - 1)
    return (ids,), {
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "token_type_ids": token_type_ids,
        "start_positions": start,
        "end_positions": end,
    }


def _t5_inputs(config, opts: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(opts.seed)
    b = opts.batch_size
    ids = _random_ids(gen, config.vocab_size, b, opts.encoder_len)
    # decoder_input_ids are derived by the model from labels (shift right).
    labels = _random_ids(gen, config.vocab_size, b, opts.decoder_len)
    return (ids,), {
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        "use_cache": False,
    }


def _causal_lm_inputs(config, opts: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(opts.seed)
    ids = _random_ids(gen, config.vocab_size, opts.batch_size, opts.seq_len)
    # labels equal the ids (the model shifts them), as a separate tensor
    return (ids,), {"labels": ids.clone(), "use_cache": False}


def _vit_inputs(config, opts: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(opts.seed)
    b, size = opts.batch_size, config.image_size
    pixels = torch.randn(b, config.num_channels, size, size, generator=gen)
    labels = torch.randint(0, config.num_labels, (b,), generator=gen)
    return (pixels,), {"labels": labels}


# --------------------------------------------------------------------------- families


def _opts(batch_size: int, **lengths: int) -> ModelOptions:
    return ModelOptions(batch_size=batch_size, **lengths)


def _gpt2_size(name: str, layers: int, width: int, heads: int, params: int, label: str) -> HFSize:
    return HFSize(
        name=name,
        config=dict(n_layer=layers, n_embd=width, n_head=heads),
        defaults=_opts(1, seq_len=1024),
        approx_parameters=params,
        description=f"GPT-2 {label}: GPT2LMHeadModel, {layers} layers, d={width}, {heads} heads, "
        "vocab 50257, tied lm_head",
    )


GPT2 = HFFamily(
    family="gpt2",
    config_class="GPT2Config",
    model_class="GPT2LMHeadModel",
    base_config=dict(vocab_size=50257, n_positions=1024),
    config_defaults={},
    # transformers 5.x infers the loss from the class name; "GPT2LMHeadModel" matches
    # nothing, so it warns and falls back to this same causal-LM loss.
    loss_type="ForCausalLM",
    basic_blocks=("GPT2Block",),
    lengths=("seq_len",),
    length_note="GPT-2 is decoder-only",
    length_limits=lambda c: {"seq_len": c.n_positions},
    make_inputs=_gpt2_inputs,
    sizes=(
        HFSize(
            name="gpt2-tiny",
            # bos/eos must lie inside the small vocabulary (GPT-2 uses its last id).
            config=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256,
                        bos_token_id=999, eos_token_id=999),
            defaults=_opts(2, seq_len=32),
            approx_parameters=180_480,
            description="GPT-2 tiny (test size): 2 layers, d=64, 4 heads, vocab 1000, 256 positions",
        ),
        _gpt2_size("gpt2-small", 12, 768, 12, 124_439_808, "small"),
        _gpt2_size("gpt2-medium", 24, 1024, 16, 354_823_168, "medium"),
        _gpt2_size("gpt2-large", 36, 1280, 20, 774_030_080, "large"),
        _gpt2_size("gpt2-xl", 48, 1600, 25, 1_557_611_200, "XL"),
    ),
)


def _bert_size(name: str, layers: int, width: int, heads: int, ff: int, params: int,
               defaults: ModelOptions, label: str) -> HFSize:
    return HFSize(
        name=name,
        config=dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                    intermediate_size=ff),
        defaults=defaults,
        approx_parameters=params,
        description=f"BERT {label}: BertForQuestionAnswering (no pooler), {layers} layers, "
        f"d={width}, {heads} heads, ff {ff}",
    )


BERT = HFFamily(
    family="bert",
    config_class="BertConfig",
    model_class="BertForQuestionAnswering",
    base_config=dict(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2),
    config_defaults={},
    loss_type=None,
    basic_blocks=("BertLayer",),
    lengths=("seq_len",),
    length_note="BERT is encoder-only",
    length_limits=lambda c: {"seq_len": c.max_position_embeddings},
    make_inputs=_bert_inputs,
    sizes=(
        _bert_size("bert-tiny", 2, 128, 2, 512, 4_369_666, _opts(2, seq_len=32),
                   "tiny (as google/bert_uncased_L-2_H-128_A-2)"),
        _bert_size("bert-base", 12, 768, 12, 3072, 108_893_186, _opts(1, seq_len=384), "base"),
        _bert_size("bert-large", 24, 1024, 16, 4096, 334_094_338, _opts(1, seq_len=384), "large"),
    ),
)


def _t5_size(name: str, d_model: int, d_ff: int, layers: int, heads: int, d_kv: int,
             params: int, label: str) -> HFSize:
    return HFSize(
        name=name,
        config=dict(d_model=d_model, d_ff=d_ff, num_layers=layers, num_heads=heads, d_kv=d_kv),
        defaults=_opts(4, encoder_len=512, decoder_len=4),  # FTPipe's T5 setting
        approx_parameters=params,
        description=f"T5 {label}: T5ForConditionalGeneration, {layers}+{layers} layers, "
        f"d={d_model}, ff {d_ff}, {heads} heads x {d_kv}, vocab 32128, tied embeddings",
    )


T5 = HFFamily(
    family="t5",
    config_class="T5Config",
    model_class="T5ForConditionalGeneration",
    # The original T5 (v1.0): ReLU feed-forward, one embedding shared by encoder,
    # decoder and lm_head.
    base_config=dict(vocab_size=32128, feed_forward_proj="relu", tie_word_embeddings=True),
    # transformers 5.x T5Config has no default decoder_start_token_id, yet the model
    # needs it to derive decoder inputs from labels; T5 starts decoding with pad (0).
    config_defaults=dict(decoder_start_token_id=0, pad_token_id=0),
    loss_type=None,
    basic_blocks=("T5Block",),
    lengths=("encoder_len", "decoder_len"),
    length_note="T5 is an encoder-decoder; use encoder_len and decoder_len",
    length_limits=lambda c: {},  # relative position buckets: no hard limit
    make_inputs=_t5_inputs,
    sizes=(
        HFSize(
            name="t5-tiny",
            config=dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=1000),
            defaults=_opts(2, encoder_len=32, decoder_len=8),
            approx_parameters=228_864,
            description="T5 tiny (test size): 2+2 layers, d=64, ff 128, 4 heads x 16, vocab 1000",
        ),
        _t5_size("t5-small", 512, 2048, 6, 8, 64, 60_506_624, "small"),
        _t5_size("t5-base", 768, 3072, 12, 12, 64, 222_903_552, "base"),
        _t5_size("t5-large", 1024, 4096, 24, 16, 64, 737_668_096, "large"),
        _t5_size("t5-3b", 1024, 16384, 24, 32, 128, 2_851_598_336, "3B"),
        _t5_size("t5-11b", 1024, 65536, 24, 128, 128, 11_307_321_344, "11B"),
    ),
)


def _vit_size(name: str, layers: int, width: int, heads: int, ff: int, params: int,
              label: str) -> HFSize:
    return HFSize(
        name=name,
        config=dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                    intermediate_size=ff),
        defaults=_opts(1),
        approx_parameters=params,
        description=f"ViT {label}: ViTForImageClassification 224x224, patch 16, {layers} layers, "
        f"d={width}, {heads} heads, mlp {ff}, 1000 classes",
    )


VIT = HFFamily(
    family="vit",
    config_class="ViTConfig",
    model_class="ViTForImageClassification",
    base_config=dict(image_size=224, patch_size=16, num_labels=1000),
    # Fixed up front: otherwise the model infers it from the labels' dtype on the first
    # forward and writes it into the config, a side effect inside the traced call.
    config_defaults=dict(problem_type="single_label_classification"),
    loss_type=None,
    basic_blocks=("ViTLayer",),
    lengths=(),
    length_note="ViT's sequence length is fixed by the config's image_size and patch_size",
    length_limits=lambda c: {},
    make_inputs=_vit_inputs,
    sizes=(
        HFSize(
            name="vit-tiny",
            # ViT-Ti widths, shrunk in depth and image size so tests run fast on a CPU.
            config=dict(num_hidden_layers=2, hidden_size=192, num_attention_heads=3,
                        intermediate_size=768, image_size=32, patch_size=8),
            defaults=_opts(2),
            approx_parameters=1_123_624,
            description="ViT tiny (test size): ViT-Ti widths (d=192, 3 heads, mlp 768) but only "
            "2 layers and 32x32 images with patch 8, 1000 classes",
        ),
        _vit_size("vit-base", 12, 768, 12, 3072, 86_567_656, "base (ViT-B/16)"),
        _vit_size("vit-large", 24, 1024, 16, 4096, 304_326_632, "large (ViT-L/16)"),
    ),
)

# ---- decoder-only LLMs with rotary positions, RMSNorm, gated MLPs (and grouped-query attention)

_TINY_DECODER = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)


def _llm_size(name: str, config: dict, params: int, description: str) -> HFSize:
    return HFSize(name=name, config=config, defaults=_opts(1, seq_len=1024), approx_parameters=params,
                  description=description)


def _tiny(name: str, params: int, description: str, **extra) -> HFSize:
    return HFSize(name=name, config={**_TINY_DECODER, **extra}, defaults=_opts(2, seq_len=32),
                  approx_parameters=params, description=description)


def _decoder_family(family: str, prefix: str, sizes: tuple[HFSize, ...], base: dict | None = None) -> HFFamily:
    return HFFamily(
        family=family,
        config_class=f"{prefix}Config",
        model_class=f"{prefix}ForCausalLM",
        base_config=dict(base or {}),
        config_defaults={},
        loss_type=None,
        basic_blocks=(f"{prefix}DecoderLayer",),
        lengths=("seq_len",),
        length_note=f"{prefix} is decoder-only",
        length_limits=lambda c: {"seq_len": c.max_position_embeddings},
        make_inputs=_causal_lm_inputs,
        sizes=sizes,
    )


LLAMA = _decoder_family("llama", "Llama", (
    _tiny("llama-tiny", 220_480, "Llama tiny (test size): 2 layers, d=64, 4 heads (2 key/value), "
          "ff 176, vocab 1000"),
    _llm_size("llama-1b", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                               bos_token_id=128000, eos_token_id=128001),
              1_235_814_400, "Llama 3.2 1B: 16 layers, d=2048, 32 heads (8 key/value), ff 8192, "
              "vocab 128256, tied embeddings"),
    _llm_size("llama-7b", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                               max_position_embeddings=4096),
              6_738_415_616, "Llama 2 7B: 32 layers, d=4096, 32 heads, ff 11008, vocab 32000"),
    _llm_size("llama-8b", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=8192, rope_theta=500000.0,
                               bos_token_id=128000, eos_token_id=128001),
              8_030_261_248, "Llama 3 8B: 32 layers, d=4096, 32 heads (8 key/value), ff 14336, vocab 128256"),
    _llm_size("llama-13b", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                                max_position_embeddings=4096),
              13_015_864_320, "Llama 2 13B: 40 layers, d=5120, 40 heads, ff 13824, vocab 32000"),
))

MISTRAL = _decoder_family("mistral", "Mistral", (
    _tiny("mistral-tiny", 220_480, "Mistral tiny (test size): 2 layers, d=64, 4 heads (2 key/value), "
          "ff 176, vocab 1000, sliding window 16", sliding_window=16),
    _llm_size("mistral-7b", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                 max_position_embeddings=32768, sliding_window=4096),
              7_241_732_096, "Mistral 7B v0.1: 32 layers, d=4096, 32 heads (8 key/value), ff 14336, "
              "vocab 32000, sliding window 4096"),
))

QWEN2 = _decoder_family("qwen2", "Qwen2", (
    _tiny("qwen2-tiny", 220_736, "Qwen2 tiny (test size): 2 layers, d=64, 4 heads (2 key/value), ff 176, "
          "vocab 1000, biased q/k/v"),
    _llm_size("qwen2-0.5b", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
              494_032_768, "Qwen2 0.5B: 24 layers, d=896, 14 heads (2 key/value), ff 4864, vocab 151936, "
              "tied embeddings"),
    _llm_size("qwen2-1.5b", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
              1_543_714_304, "Qwen2 1.5B: 28 layers, d=1536, 12 heads (2 key/value), ff 8960, vocab 151936, "
              "tied embeddings"),
    _llm_size("qwen2-7b", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                               max_position_embeddings=32768, rope_theta=1000000.0),
              7_615_616_512, "Qwen2 7B: 28 layers, d=3584, 28 heads (4 key/value), ff 18944, vocab 152064"),
))

QWEN3 = _decoder_family("qwen3", "Qwen3", (
    _tiny("qwen3-tiny", 220_544, "Qwen3 tiny (test size): 2 layers, d=64, 4 heads (2 key/value) of 16, "
          "ff 176, vocab 1000, q/k norms", head_dim=16),
    _llm_size("qwen3-0.6b", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True),
              596_049_920, "Qwen3 0.6B: 28 layers, d=1024, 16 heads (8 key/value) of 128, ff 3072, "
              "vocab 151936, tied embeddings"),
    _llm_size("qwen3-8b", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               max_position_embeddings=40960, rope_theta=1000000.0),
              8_190_735_360, "Qwen3 8B: 36 layers, d=4096, 32 heads (8 key/value) of 128, ff 12288, "
              "vocab 151936"),
))

FAMILIES: tuple[HFFamily, ...] = (GPT2, BERT, T5, VIT, LLAMA, MISTRAL, QWEN2, QWEN3)


# --------------------------------------------------------------------------- building


def _transformers_class(name: str):
    import transformers  # heavy: imported on first build only

    return getattr(transformers, name)


def _new_config(family: HFFamily, size: HFSize):
    config_cls = _transformers_class(family.config_class)
    return config_cls(**{**family.base_config, **size.config})


def resolve_attention(name: str, family: HFFamily, requested: str | None) -> str:
    """``sdpa`` where the architecture supports it (or was asked for), else ``eager``."""
    supports = bool(getattr(_transformers_class(family.model_class), "_supports_sdpa", False))
    if requested == "sdpa" and not supports:
        raise ZooError(f"{name}: {family.model_class} has no SDPA attention in this transformers version; "
                       "use --attention eager")
    return requested or ("sdpa" if supports else "eager")


def _prepare_config(family: HFFamily, config, attention: str = "eager") -> None:
    """Make any config (ours or a checkpoint's) traceable and loss-producing."""
    # The private attribute is transformers' own switch (what attn_implementation= sets);
    # a checkpoint's config cannot take the constructor argument after loading.
    config._attn_implementation = attention
    config.return_dict = True
    if hasattr(config, "use_cache"):
        config.use_cache = False
    for key, value in family.config_defaults.items():
        if getattr(config, key, None) is None:
            setattr(config, key, value)


def _fit_lengths(name: str, family: HFFamily, config, requested: ModelOptions,
                 options: ModelOptions) -> ModelOptions:
    """Check lengths against the config's limits.

    A length the caller asked for must fit; a default that does not fit a smaller
    pretrained config is clamped to the limit instead.
    """
    clamped = {}
    for field, limit in family.length_limits(config).items():
        value = getattr(options, field)
        if value is None or value <= limit:
            continue
        if getattr(requested, field) is not None:
            raise ZooError(f"{name}: {field}={value} exceeds the model's maximum of {limit}")
        clamped[field] = limit
    return dataclasses.replace(options, **clamped)


def build_hf(family: HFFamily, entry: ZooEntry, options: ModelOptions) -> BuiltModel:
    """Build one size of a HuggingFace family; see :func:`ftcompile.models.build_model`."""
    resolved = resolve_options(entry.name, options, entry.default_options, family.lengths,
                               entry.approx_parameters, family.length_note)
    size = next(s for s in family.sizes if s.name == entry.name)
    if resolved.pretrained is not None:
        config = load_config(resolved.pretrained, family.family)
    else:
        config = _new_config(family, size)
    attention = resolve_attention(entry.name, family, resolved.attention)
    resolved = dataclasses.replace(resolved, attention=attention)
    _prepare_config(family, config, attention)
    resolved = _fit_lengths(entry.name, family, config, options, resolved)

    model_cls = _transformers_class(family.model_class)
    with seeded(resolved.seed, resolved.device):
        if resolved.pretrained is None:
            with torch.device(resolved.device):
                model = model_cls(config)
        else:
            # Check shapes on a free meta skeleton first, so that a mismatch names the
            # tensor instead of surfacing as transformers' generic load failure.
            with torch.device("meta"):
                model = model_cls(config)
            check_checkpoint(resolved.pretrained, model)
            if resolved.device != "meta":
                model = load_weights(resolved.pretrained, model_cls, config, resolved)
    if family.loss_type is not None:
        model.loss_type = family.loss_type
    return assemble(entry.name, model, resolved, family.basic_blocks,
                    lambda: family.make_inputs(config, resolved))


def hf_entries() -> list[tuple[ZooEntry, Callable[[ModelOptions], BuiltModel]]]:
    """Zoo entries of all HuggingFace families, each with its builder."""
    out = []
    for family in FAMILIES:
        for size in family.sizes:
            entry = ZooEntry(size.name, family.family, size.description,
                             size.approx_parameters, size.defaults)
            out.append((entry, lambda opts, f=family, e=entry: build_hf(f, e, opts)))
    return out
