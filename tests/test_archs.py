"""The models people fine-tune today, given as user files: each compiles, verifies and trains.

``tests/archs/hf_models.py`` holds tiny transformers 5.x architectures (the real classes, random
weights, ``use_cache=False``; causal LMs called as users call them, ``labels=input_ids`` with the
very same tensor), ``tests/archs/plain_models.py`` plain PyTorch nets (ResNet with BatchNorm,
MobileNetV2 with in-place ReLU6 and dropout, LSTM/GRU). Every one is traced, profiled,
partitioned for three workers, generated and verified against its eager self within 1e-6.

Training tests run each construct under 1f1b, async and 2bw on real processes over gloo
(``ftcompile run``) and compare the losses with a plain PyTorch loop on the original model
(same data, same dropout masks through :func:`~ftcompile.runtime.ops.keyed_random_mode`):
every step for 1f1b, and for 2bw with the weights one step behind, as 2bw trains. Async's
stale weights differ per stage, which a loop over the unsplit model cannot express: its first
step (all stages on the initial weights) is compared with the plain loop, later steps with the
single-process reference of the schedule (:func:`~ftcompile.runtime.reference.reference_train`).
BatchNorm's running statistics are compared after training too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import pytest
import torch

from ftcompile.cluster import load_cluster
from ftcompile.codegen import example_input_ranges, generate, rebuild_model, write_package
from ftcompile.compile import compile_plan, plan_document
from ftcompile.hardware import load_hardware
from ftcompile.models import ModelOptions, build_model
from ftcompile.plan import Problem
from ftcompile.profile import analytic_profile
from ftcompile.runtime import load_package
from ftcompile.runtime.data import load_dataset, split_micro_batches
from ftcompile.runtime.engine import TrainConfig, micro_batch_seed
from ftcompile.runtime.ops import keyed_random_mode
from ftcompile.runtime.reference import reference_train
from ftcompile.trace import trace
from ftcompile.verify import verify_package
from ftcompile.weights import weight_source

from test_runtime import call_of, cli_args, final_weights, losses, run_cli

ARCHS = Path(__file__).parent / "archs"
HF = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v2", "gemma", "gemma2", "phi3", "phi", "gpt_neox", "falcon", "bloom",
      "gpt2", "gpt_neo", "opt", "marian", "pegasus", "mbart", "bart", "m2m100", "t5", "bert", "albert", "roberta",
      "electra", "distilbert", "deberta_v2", "vit_mae", "gpt2_autocast",
      # with torch's fused attention (dropout inside it keyed like any other)
      "llama_sdpa", "gpt2_sdpa", "bert_sdpa", "bart_sdpa", "t5_sdpa", "qwen3_sdpa",
      # more of today's families (slow): sliding and full layers, MoE with shared experts, no attention, speech
      "gemma3", "cohere2", "olmo2", "granite", "starcoder2", "smollm3", "glm4", "gptj", "qwen2_moe", "olmoe",
      "gpt_oss", "modernbert", "mamba2", "whisper"]
PLAIN = ["resnet", "mobilenet_v2", "lstm_gru", "lstm_dropout", "random_masking", "slice_copy"]
# In every run of the suite (CI's 20-minute budget): a rotary decoder with a no-grad region and
# grouped-query attention, shared weights, BatchNorm statistics, aliased inputs and an
# encoder-decoder, LSTM/GRU; `make test-slow` (pytest -m slow) runs the rest. Autocast, no-grad
# and in-place ops also have small-model tests in test_trace_regions.py, SDPA's pricing in
# test_profile.py; random_masking draws torch.rand in forward as vit_mae does.
QUICK = {"llama", "albert", "resnet", "bloom", "m2m100", "lstm_gru", "random_masking", "mixtral", "deepseek_v3",
         "slice_copy", "deepseek_v2"}
QUICK_TRAINING = {("albert", "async"),     # several holders of one tensor per rank (2 ranks, 3 GPUs planned)
                  ("mixtral", "1f1b"),     # ranks import the module registering the experts' custom operator
                  ("deepseek_v2", "1f1b")}  # complex64 activations (rotary) and their gradients between ranks
VERIFY_TOL = 1e-6


def spec(name: str) -> str:
    return f"{ARCHS / ('plain_models.py' if name in PLAIN else 'hf_models.py')}:{name}"


@functools.lru_cache(maxsize=None)
def _traced(name: str):
    built = build_model(spec(name), ModelOptions())
    graph = trace(built.model, built.args, built.kwargs,
                  source={"model": built.name, "options": dataclasses.asdict(built.options)})
    return built, graph


@functools.lru_cache(maxsize=None)
def compiled(name: str, root: Path, gpus: int = 3) -> Path:
    """The package of ``name`` for ``gpus`` CPU workers (Mixed-pipe, async), written under ``root``."""
    built, graph = _traced(name)
    prof = analytic_profile(graph, load_hardware("cpu"))
    cluster = load_cluster("2xcpu").with_overrides(gpus=gpus)
    result = compile_plan(Problem(graph, prof, cluster, schedule="async", micro_batches=4), "mixed", jobs=1)
    assert result.chosen is not None, [(r.name, r.reason) for r in result.results]
    doc = plan_document(result, model=graph.source)
    out = root / f"{name}-{gpus}"
    write_package(generate(graph, doc, weight_source(built.model, graph), input_ranges=example_input_ranges(built)),
                  doc, out)
    return out


@pytest.fixture(scope="session")
def pkg_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("archs")


def _marks(name: str):
    return () if name in QUICK else (pytest.mark.slow,)


# --------------------------------------------------------------------------- compile and verify

@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in HF + PLAIN])
def test_compiles_and_verifies(name, pkg_root):
    path = compiled(name, pkg_root)
    report = verify_package(str(path), tolerance=VERIFY_TOL)
    assert report.ok, [d.row() for d in report.failures[:5]] + report.notes
    worst = max((d.error for d in report.worst if d.kind != "recompute"), default=0.0)
    assert worst <= VERIFY_TOL
    assert report.compared["loss"] == 1 and report.compared["gradient"] > 0
    # dropout on, both sides drew the same masks; other random draws (torch.rand) keyed alike
    assert report.random_calls["model"] == report.random_calls["package"]
    assert report.random_calls["model_other"] == report.random_calls["package_other"]
    m = load_package(path).manifest
    if name.endswith("_sdpa"):
        ops = [ins.target for n in _traced(name)[1].nodes for ins in n.instrs]
        assert "aten.scaled_dot_product_attention.default" in ops
    if name in ("resnet", "mobilenet_v2"):
        assert report.compared["buffer"] >= 3 and any(s.mutates_buffers for s in m.stages)
    if name in ("vit_mae", "random_masking"):
        assert report.random_calls["package_other"] >= 1          # the masking noise is drawn in forward
        assert not report.notes                                  # keyed alike: no advice to pass it in
    if name == "mixtral":      # the experts' custom operator, called through torch.ops by a stage importing its module
        assert _traced(name)[1].source["custom_ops"] == {"transformers.grouped_mm_fallback.default":
                                                          "transformers.integrations.moe"}
        assert any("import transformers.integrations.moe" in p.read_text() for p in path.glob("stage_*.py"))
    if name == "slice_copy":   # copy_ written out of place by a twin that passes the gradient on
        ops = [ins.target for n in _traced(name)[1].nodes for ins in n.instrs]
        assert "ftcompile.runtime.ops.copy_into" in ops and "aten.copy.default" not in ops
    if name in ("lstm_gru",):
        assert m.random_ops == 0                                 # no dropout between LSTM layers: not random
    if name == "lstm_dropout":
        assert m.random_ops == 1 and m.dropout_ops == 0          # keyed apart from dropout


@pytest.mark.parametrize("name", ["resnet", "llama"])
def test_work_no_value_links_to_the_loss_is_paced_by_the_pipeline(name):
    """Work that exchanges no value with the rest: a BatchNorm's ``num_batches_tracked += 1``
    (ResNet: 20 of them), dead code (Llama: ``arange`` feeding unused ``unsqueeze``). Mixed-pipe and
    exact used to give it stages of its own beside real ones, a part of the stage graph no edge
    linked to the loss's, which nothing paces: ResNet on 4 GPUs had eleven such stages and its
    simulated run held 101 steps of input on GPU 0 (20 MB against evaluate's 2.6 MB); exact's
    Llama plan on 4 GPUs put the dead code on GPUs 0 and 2 (69 x evaluate's data on GPU 0). Now
    every plan ties such parts to the pipeline where they share a GPU with it, and its simulated
    data stays within evaluate's."""
    import networkx as nx

    from ftcompile.plan import evaluate, stage_graph
    from ftcompile.simulate import simulation_of

    _, graph = _traced(name)
    if name == "resnet":
        ops = {n.id for n in graph.op_nodes()}
        linked = {x for e in graph.edges if e.src in ops and e.dst in ops for x in (e.src, e.dst)}
        assert len(ops - linked) >= 10          # the counters
    prof = analytic_profile(graph, load_hardware("cpu"))
    problem = Problem(graph, prof, load_cluster("2xcpu").with_overrides(gpus=4), schedule="async", micro_batches=4)
    result = compile_plan(problem, ["mixed", "exact"], jobs=1, time_limit=4)
    plans = [r.plan for r in result.results if r.plan is not None]
    assert len(plans) >= 2
    loss = next(n.id for n in graph.op_nodes() if n.is_loss)
    for plan in plans:
        sg = stage_graph(graph, plan)
        lead = next(c for c in nx.weakly_connected_components(sg) if plan.stage_of()[loss] in c)
        lead_gpus = {s.gpu for s in plan.stages if s.id in lead}
        assert all(s.gpu not in lead_gpus for s in plan.stages if s.id not in lead), plan.strategy
        sim, cost = simulation_of(problem, plan), evaluate(problem, plan)
        for g in cost.gpus:
            assert sim.gpu_peak_breakdown[g.gpu].get("data", 0) <= g.data_bytes, (plan.strategy, g.gpu)
            assert sim.gpu_peak_memory[g.gpu] <= g.memory_bytes, (plan.strategy, g.gpu)


def test_rotary_decoder_in_basic_blocks_verifies(tmp_path):
    """Issue 10's first failure: a rotary decoder traced by layers, naming the rotary class itself as
    a block (the no-grad region inside a block node) compiles and verifies like the operator graph."""
    built = build_model(spec("llama"), ModelOptions())
    graph = trace(built.model, built.args, built.kwargs, basic_blocks=("LlamaDecoderLayer", "LlamaRotaryEmbedding"),
                  source={"model": built.name, "options": dataclasses.asdict(built.options)})
    blocks = [n.op for n in graph.op_nodes() if n.op.startswith("block:")]
    assert blocks.count("block:LlamaRotaryEmbedding") == 1 and blocks.count("block:LlamaDecoderLayer") >= 2
    prof = analytic_profile(graph, load_hardware("cpu"))
    cluster = load_cluster("2xcpu").with_overrides(gpus=2)
    result = compile_plan(Problem(graph, prof, cluster, schedule="1f1b", micro_batches=4), "seq", jobs=1)
    assert result.chosen is not None, [(r.name, r.reason) for r in result.results]
    doc = plan_document(result, model=graph.source)
    write_package(generate(graph, doc, weight_source(built.model, graph), input_ranges=example_input_ranges(built)),
                  doc, tmp_path / "pkg")
    report = verify_package(str(tmp_path / "pkg"), tolerance=VERIFY_TOL)
    assert report.ok, [d.row() for d in report.failures[:5]] + report.notes
    assert report.compared["gradient"] > 0


def test_a_custom_operator_no_other_process_can_import_is_refused_before_planning(tmp_path, capsys):
    """A torch.library operator defined in the model's own file: ranks could not call it, so compile
    says what to do before it plans anything, and writes nothing."""
    from ftcompile.cli import main

    out = tmp_path / "o"
    assert main(["compile", f"{ARCHS / 'custom_op_model.py'}:build", "--gpus", "2", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "custom operator ftctest::scaled_tanh, which no importable module registers" in err
    assert "define it with torch.library in a module on the Python path" in err
    assert not out.exists()


LAZY_OPS = """
import torch

lib = torch.library.Library("ftclazy", "DEF")
lib.define("twice(Tensor x) -> Tensor")
lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
torch.library.register_fake("ftclazy::twice")(lambda x: torch.empty_like(x))
"""

LAZY_MODEL = """
import torch
from torch import nn

import ftclazy.ops  # noqa: F401 - registers ftclazy::twice


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.ops.ftclazy.twice(self.a(x))).pow(2).mean()


def build():
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 8),)
"""


@pytest.mark.parametrize("registers_on_import", [False, True])
def test_a_custom_operator_its_package_does_not_register_on_import_is_refused(tmp_path, capsys, monkeypatch,
                                                                              registers_on_import):
    """An operator a torch.library.Library defines in a submodule (ftclazy.ops) is recorded under its
    namespace's package (ftclazy): if importing that package does not register it, a rank could not
    call it, which compile finds in a fresh process before planning; if it does, compile goes on."""
    from ftcompile.cli import main

    pkg = tmp_path / "site" / "ftclazy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import ops  # noqa: F401\n" if registers_on_import else "")
    (pkg / "ops.py").write_text(LAZY_OPS)
    (tmp_path / "model.py").write_text(LAZY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    out = tmp_path / "o"
    rc = main(["compile", f"{tmp_path / 'model.py'}:build", "--gpus", "2", "--strategy", "seq", "-q",
               "-o", str(out)])
    err = capsys.readouterr().err
    if registers_on_import:
        assert rc == 0, err
        assert "import ftclazy" in "\n".join(p.read_text() for p in out.glob("stage_*.py"))
    else:
        assert rc == 2
        assert "custom operator ftclazy::twice; the generated stages import ftclazy for it, but in a fresh " \
               "process that import does not register it" in err, err
        assert not out.exists()


# --------------------------------------------------------------------------- training

def _cfg(schedule: str) -> TrainConfig:
    # SGD with momentum (as test_runtime): Adam would blow rounding noise in gradients that
    # are zero in exact arithmetic up to full-size steps.
    return TrainConfig(schedule=schedule, micro_batches=4, steps=3, optimizer="momentum", lr=0.05, seed=3)


def eager_training(package: Path, cfg: TrainConfig, *, delay: int = 0):
    """A plain PyTorch loop on the original model: per step the mean micro-batch loss, and the
    model's final parameters and buffers. ``delay=1`` computes step ``j``'s gradients on the
    weights of step ``max(j - 1, 0)`` and applies them to the newest (PipeDream-2BW). Where the
    schedule lags the tensors several stages share (no flush: ``lags_shared``), step ``j`` applies
    their gradient of step ``j - 1`` (none at step 0)."""
    from ftcompile.runtime import optim
    from ftcompile.runtime.engine import lags_shared

    m = load_package(package).manifest
    model = rebuild_model({"model": m.model["name"], "options": m.model["options"]}).model
    model.train(cfg.dropout)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = optim.build(params, optim.OptimConfig(cfg.optimizer, cfg.lr, cfg.momentum, cfg.betas, cfg.eps,
                                                   cfg.weight_decay, cfg.lr_schedule, cfg.warmup_steps, cfg.steps))
    lagged = {id(p) for n, p in model.named_parameters() if n in m.shared_params()} if lags_shared(cfg) else set()
    pending: dict[int, torch.Tensor | None] = {}
    batches = load_dataset("synthetic", m, micro_batches=cfg.micro_batches, seed=cfg.seed)
    live = [p.detach().clone() for p in params]
    previous = [t.clone() for t in live]
    step_losses = []
    for j in range(cfg.steps):
        used = previous if delay else live
        with torch.no_grad():
            for p, w in zip(params, used):
                p.copy_(w)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(split_micro_batches(next(batches), m, cfg.micro_batches)):
            args, kwargs = call_of(m, mb)
            with keyed_random_mode(micro_batch_seed(cfg.seed, j, i), enabled=cfg.dropout):
                loss = model(*args, **kwargs)
            loss = loss[0] if isinstance(loss, (tuple, list)) else (loss["loss"] if isinstance(loss, dict)
                                                                   else getattr(loss, "loss", loss))
            total += float(loss.detach())
            (loss / cfg.micro_batches).backward()
        step_losses.append(total / cfg.micro_batches)
        grads = [p.grad for p in params]
        for i, p in enumerate(params):
            if id(p) in lagged:
                grads[i], pending[id(p)] = pending.get(id(p)), grads[i]
        previous = [t.clone() for t in live]
        with torch.no_grad():
            for p, w, g in zip(params, live, grads):
                p.copy_(w)
                p.grad = g
        optim.step(opt)            # (a lagged tensor's first gradient comes a step after the others')
        live = [p.detach().clone() for p in params]
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return step_losses, buffers


def _close(a: float, b: float, tol: float = 2e-5) -> bool:
    return math.isfinite(a) and abs(a - b) <= tol * max(1.0, abs(b))


# one architecture per construct of issue 10
CONSTRUCTS = {
    "llama": "rotary decoder, grouped-query attention, labels=input_ids (one tensor)",
    "m2m100": "@torch.no_grad() sinusoidal positions (a no-grad region)",
    "gpt2_autocast": "autocast(bfloat16) around the model, an autocast-disabled region inside",
    "resnet": "BatchNorm running statistics",
    "mobilenet_v2": "in-place ReLU6 and Dropout(inplace=True)",
    "lstm_gru": "LSTM and GRU",
    "vit_mae": "torch.rand inside forward (masking noise)",
    "albert": "one layer's weights shared by every layer",
    "mixtral": "mixture of experts through a torch.library custom operator (transformers::grouped_mm_fallback)",
    "deepseek_v2": "complex64 rotary activations crossing ranks, with their gradients",
}


@pytest.mark.parametrize("name, schedule", [
    pytest.param(n, s, marks=() if (n, s) in QUICK_TRAINING else (pytest.mark.slow,))
    for n in CONSTRUCTS for s in ("1f1b", "2bw", "async")])
def test_trains_like_the_eager_model(name, schedule, pkg_root, tmp_path):
    pkg = compiled(name, pkg_root)
    cfg = _cfg(schedule)
    if schedule == "2bw":   # two weight versions need at least as many micro-batches as stages deep
        depth = 1 + max(s.depth for s in load_package(pkg).manifest.stages)
        cfg = dataclasses.replace(cfg, micro_batches=max(cfg.micro_batches, depth))
    nproc = 3 if schedule == "1f1b" else 2          # 2: fewer ranks than planned GPUs, stages share ranks
    r = run_cli(*cli_args(cfg, pkg, tmp_path, nproc=nproc), timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    got = losses(tmp_path / "log")
    assert len(got) == cfg.steps
    want, buffers = eager_training(pkg, cfg, delay=1 if schedule == "2bw" else 0)
    if schedule == "async":
        assert _close(got[0], want[0]), (got, want)
        ref = reference_train(load_package(pkg), iter(load_dataset("synthetic", load_package(pkg).manifest,
                                                                   micro_batches=cfg.micro_batches, seed=cfg.seed)),
                              cfg, cfg.steps)
        assert all(_close(a, b) for a, b in zip(got, ref.losses)), (got, ref.losses)
        return
    assert all(_close(a, b) for a, b in zip(got, want)), (got, want)
    if any(n.endswith("running_mean") for n in buffers):
        # each micro-batch updated the running statistics once, in order, as the eager loop did
        held = final_weights(tmp_path / "ckpt")              # by canonical name, buffers included
        for n, b in buffers.items():
            assert n in held, n
            got_b = held[n].to(b.dtype)
            if not b.is_floating_point():
                assert torch.equal(got_b, b), n                  # num_batches_tracked: one per micro-batch
                continue
            # statistics of activations of weights that differ in the last bits (summation order
            # differs between processes); a mean that is zero in exact arithmetic (a convolution of
            # normalised inputs, ~1e-9) is measured against 1e-3, not against its own noise
            err = float((got_b - b).abs().max() / b.abs().max().clamp_min(1e-3))
            assert err < 1e-4, (n, err)


@pytest.mark.slow
def test_compile_plans_a_real_7b_llama(tmp_path):
    """`ftcompile compile llama-7b` traces Llama 2 7B on meta (no weights) and plans it for 8 GPUs."""
    import json
    import subprocess
    import sys

    out = tmp_path / "llama7b"
    r = subprocess.run([sys.executable, "-m", "ftcompile", "compile", "llama-7b", "--gpus", "8", "--gpu-memory",
                        "40GB", "--hardware", "a100-80gb", "--strategy", "seq", "-q", "-o", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((out / "plan.json").read_text())
    m = doc["package"]
    # every GPU used: one pipeline of 8, or replicas of shorter pipelines (compile picks R)
    assert m["weights"] == "init" and m["num_gpus"] * m.get("replicas", 1) == 8
    graph = json.loads((out / "graph.json").read_text())
    params = sum(int(math.prod(p["shape"])) for p in graph["params"] if p["kind"] == "parameter")
    assert params == 6_738_415_616
    assert any(n["op"] == "aten.scaled_dot_product_attention.default" for n in graph["nodes"])


def test_verify_compares_complex_values_whole():
    """verify's error of complex values counts their imaginary parts (a .double() would drop them)."""
    from ftcompile.verify import _error

    a, b = torch.tensor([1 + 2j, 3 + 0j]), torch.tensor([1 + 2.5j, 3 + 0j])
    rel, diff = _error(a, b)
    assert diff == pytest.approx(0.5) and rel == pytest.approx(0.5 / 3)
    assert _error(a, a) == (0.0, 0.0)
