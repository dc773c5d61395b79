"""Code generation and `ftcompile verify`: packages compute exactly what their models compute."""

from __future__ import annotations

import json
import math
import os
import py_compile
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from ftcompile.cluster import load_cluster
from ftcompile.codegen import generate, random_keys, value_names, write_package
from ftcompile.compile import compile_plan, plan_document
from ftcompile.hardware import load_hardware
from ftcompile.models import ModelOptions, build_model
from ftcompile.plan import Plan, Problem, Stage, ordered
from ftcompile.profile import analytic_profile
from ftcompile.runtime import PackageError, load_package
from ftcompile.runtime.local import LocalPipeline
from ftcompile.trace import trace
from ftcompile.verify import VerifyError, verify_package
from ftcompile.weights import weight_source

TINY = ["gpt2-tiny", "bert-tiny", "t5-tiny", "vit-tiny", "mlp", "skipnet", "encdec"]
REPO = Path(__file__).resolve().parents[1]

_traced: dict = {}


def traced(name: str, **options):
    """(built model, graph, analytic profile), made once per model and options per test process."""
    key = (name, tuple(sorted(options.items())))
    if key not in _traced:
        built = build_model(name, ModelOptions(**options))
        graph = trace(built.model, built.args, built.kwargs,
                      source={"model": built.name, "options": asdict(built.options)})
        prof = analytic_profile(graph, load_hardware("cpu"), optimizer="adam")
        _traced[key] = (built, graph, prof)
    return _traced[key]


def package_for(tmp: Path, name: str, strategy: str, gpus: int = 3, schedule: str = "async",
                gpu_memory: str | None = None, simulate: bool = True, time_limit: float = 4, **options) -> Path:
    """Compile ``name`` with ``strategy`` for ``gpus`` CPU workers and write its package into ``tmp``
    (``simulate=False``: the plan of lowest objective, not the fastest in simulation).
    ``time_limit``: seconds per search (these tests read the package, not the plan's quality;
    the default 20 s went to searches that cannot finish on T5's graph)."""
    built, graph, prof = traced(name, **options)
    cluster = load_cluster("2xcpu").with_overrides(gpus=gpus, gpu_memory=gpu_memory)
    result = compile_plan(Problem(graph, prof, cluster, schedule=schedule, micro_batches=4), strategy, jobs=1,
                          simulate_plans=simulate, time_limit=time_limit)
    assert result.chosen is not None, [(r.name, r.reason) for r in result.results]
    doc = plan_document(result, model=graph.source)
    write_package(generate(graph, doc, weight_source(built.model, graph)), doc, tmp)
    return tmp


def package_for_plan(tmp: Path, name: str, plan: Plan, **options) -> Path:
    """Write the package of a given plan (stages placed by the test, not by a partitioner)."""
    built, graph, prof = traced(name, **options)
    cluster = load_cluster("2xcpu").with_overrides(gpus=plan.num_gpus)
    from ftcompile.plan import evaluate

    plan = ordered(plan, graph)
    problem = Problem(graph, prof, cluster, schedule="async", micro_batches=4)
    cost = evaluate(problem, plan)
    doc = {"format": "ftcompile.plan", "version": 1, "model": graph.source, "graph_hash": graph.content_hash(),
           "schedule": "async", "micro_batches": 4, "recompute": None, "chosen": "by-hand",
           "plan": plan.to_json(), "profile": {"optimizer": "adam"},
           "stages": [{"id": c.id, "forward_ms": c.forward_ms, "backward_ms": c.backward_ms} for c in cost.stages]}
    write_package(generate(graph, doc, weight_source(built.model, graph)), doc, tmp)
    return tmp


def interleaved_plan(graph, stages: int, gpus: int) -> Plan:
    """Contiguous chunks of the op nodes in graph order, stage i on GPU i mod ``gpus``: every GPU
    hosts non-adjacent stages, and the first and last stages (embedding, tied lm_head) sit on
    different GPUs."""
    ops = [n.id for n in graph.op_nodes()]
    size = -(-len(ops) // stages)
    chunks = [ops[i:i + size] for i in range(0, len(ops), size)]
    return Plan("by-hand", gpus, [Stage(i, i % gpus, c) for i, c in enumerate(chunks)])


def assert_verified(path: Path, **kw):
    report = verify_package(str(path), **kw)
    assert report.ok, [d.row() for d in report.failures[:5]] + report.notes
    assert report.compared.get("gradient", 0) > 0 and report.compared.get("loss") == 1
    return report


# --------------------------------------------------------------------------- correctness

# In every run: one plan per kind of model and strategy; `make test-slow` runs every pair.
QUICK_VERIFY = {("gpt2-tiny", "mixed"), ("t5-tiny", "seq"), ("encdec", "mixed"), ("vit-tiny", "seq"),
                ("mlp", "auto"), ("skipnet", "mixed")}


@pytest.mark.parametrize("name, strategy", [
    pytest.param(n, s, marks=() if (n, s) in QUICK_VERIFY else (pytest.mark.slow,))
    for n in TINY for s in ("mixed", "seq", "auto")])
def test_every_tiny_model_verifies(tmp_path, name, strategy):
    path = package_for(tmp_path, name, strategy)
    report = assert_verified(path)
    # dropout was on and both sides drew the same masks
    assert report.random_calls["model"] == report.random_calls["package"]
    # each stage's recomputation repeated its forward exactly
    assert report.compared["recompute"] >= 1
    assert all(d.max_abs == 0.0 for d in report.worst if d.kind == "recompute")


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny"])
def test_non_adjacent_stages_per_gpu_and_tied_weights_across_gpus(tmp_path, name):
    _built, graph, _prof = traced(name)
    plan = interleaved_plan(graph, stages=6, gpus=3)
    path = package_for_plan(tmp_path, name, plan)
    pkg = load_package(path)
    m = pkg.manifest
    for gpu in range(3):
        ids = sorted(s.id for s in m.stages_on(gpu))
        assert len(ids) == 2 and ids[1] - ids[0] > 1          # two stages, not adjacent
    shared = m.shared_params()
    tied = "transformer.wte.weight" if name == "gpt2-tiny" else "shared.weight"
    assert tied in shared and len({m.stage(h).gpu for h in shared[tied]}) > 1
    # values flow to stages other than the next one (dataflow, not a chain)
    assert any(c - v.producer > 1 for v in m.values.values() if v.producer is not None for c in v.consumers)
    assert_verified(path)


def test_mixed_strategy_gives_non_adjacent_stages_somewhere(tmp_path):
    # Mixed-pipe's plan of lowest objective on 3 GPUs: 4 stages, the first and the last (the tied
    # embedding and lm_head) on one GPU. (On 4 GPUs its best is the convex split, one stage each.)
    path = package_for(tmp_path, "gpt2-tiny", "mixed", gpus=3, attention="eager", simulate=False)
    m = load_package(path).manifest
    per_gpu = [sorted(s.id for s in m.stages_on(g)) for g in range(m.num_gpus)]
    assert any(len(ids) > 1 and any(b - a > 1 for a, b in zip(ids, ids[1:])) for ids in per_gpu), per_gpu
    assert_verified(path)


def test_shared_weight_copies_take_the_same_gradient(tmp_path):
    _built, graph, _prof = traced("gpt2-tiny")
    path = package_for_plan(tmp_path, "gpt2-tiny", interleaved_plan(graph, 4, 2))
    pkg = load_package(path)
    pipe = LocalPipeline.build(pkg).train()
    built = traced("gpt2-tiny")[0]
    values, runs = pipe.forward(pkg.inputs_from_call(*built.make_inputs("cpu")), seed=3)
    pipe.backward(runs)
    holders = pkg.manifest.shared_params()["transformer.wte.weight"]
    copies = [dict(pipe.modules[h].named_parameters())["transformer.wte.weight"] for h in holders]
    assert len(copies) == 2 and not torch.equal(copies[0].grad, copies[1].grad)   # each copy's own part
    pipe.sum_shared_grads()
    assert torch.equal(copies[0].grad, copies[1].grad)


def test_recomputation_draws_the_same_dropout_masks(tmp_path):
    path = package_for(tmp_path, "gpt2-tiny", "seq", gpus=2)
    pkg = load_package(path)
    stage = next(s for s in pkg.manifest.stages if s.random_ops > 0)
    module = pkg.build_stage(stage.id).train()
    args = []
    for v in stage.inputs:
        spec = pkg.manifest.values[v]
        args.append(torch.randn(spec.shape) if spec.is_floating else torch.randint(0, 100, spec.shape))
    a = module(*args, seed=7)
    b = module(*args, seed=7)
    c = module(*args, seed=8)
    floats = [i for i, t in enumerate(a) if t.is_floating_point() and t.dim() > 0]
    assert all(torch.equal(a[i], b[i]) for i in floats)
    assert any(not torch.equal(a[i], c[i]) for i in floats)
    module.eval()    # no dropout in eval mode: seeds no longer matter
    d, e = module(*args, seed=7), module(*args, seed=8)
    assert all(torch.equal(d[i], e[i]) for i in floats)


def test_dropout_off_on_both_sides(tmp_path):
    path = package_for(tmp_path, "bert-tiny", "seq", gpus=2)
    report = assert_verified(path, dropout=False)
    assert report.dropout is False


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [
    ("gpt2-small", {"seq_len": 64}),
    ("t5-small", {"encoder_len": 64, "decoder_len": 8, "batch_size": 2}),
    ("bert-base", {"seq_len": 64}),
    ("vit-base", {}),
])
def test_small_sizes_verify(tmp_path, name, options):
    path = package_for(tmp_path, name, "mixed", gpus=4, **options)
    assert_verified(path)


# --------------------------------------------------------------------------- the generated code

def test_generated_code_compiles_and_reads(tmp_path):
    path = package_for(tmp_path, "gpt2-tiny", "mixed", gpus=3)
    m = load_package(path).manifest
    texts = {}
    for s in m.stages:
        file = path / f"{s.module}.py"
        py_compile.compile(str(file), cfile=str(tmp_path / f"{s.module}.pyc"), doraise=True)
        texts[s.id] = file.read_text()
    every = "\n".join(texts.values())
    # parameters keep their original names and read as attribute paths
    assert "self.transformer.h[0].attn.c_attn.weight" in every
    assert "'transformer.h.0.attn.c_attn.weight'" in every
    # variables are named after module scopes, not fx's anonymous names
    assert "h0_attn_c_attn_addmm" in every or "h0_attn_c_attn_linear" in every
    # only torch and the runtime are imported
    imports = {line.split()[1] for t in texts.values() for line in t.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"torch", "torch.nn.functional", "operator", "math", "ftcompile.runtime"}, imports
    # every stage says what comes in and goes out, and dropout is keyed
    for s in m.stages:
        assert f"Stage {s.id}:" in texts[s.id] and "Inputs:" in texts[s.id] and "Outputs:" in texts[s.id]
    assert "rt.dropout(" in every and "seed," in every
    assert (path / "README.md").read_text().count("| ") > 10
    init = (path / "__init__.py").read_text()
    assert "STAGES = {" in init and "def load(" in init


def test_value_names_are_unique_identifiers():
    _b, graph, _p = traced("t5-tiny")
    names = value_names(graph)
    assert len(set(names.values())) == len(names)
    assert all(n.isidentifier() for n in names.values())
    assert names["input_ids"] == "input_ids"
    assert any(n.startswith("encoder_block0_layer0_SelfAttention_q") for n in names.values())


def test_dropout_keys_follow_the_models_call_order():
    _b, graph, _p = traced("t5-tiny")
    keys = random_keys(graph)
    ordered_keys = [keys[i.name] for n in graph.nodes for i in n.instrs if i.name in keys]
    assert ordered_keys == list(range(len(ordered_keys))) and len(ordered_keys) == 24


def test_in_place_write_to_a_stage_input_never_reaches_the_producer(tmp_path):
    """A graph with an in-place op on a value that crosses a stage boundary: the consumer mutates
    its own copy, and the producer's tensor (which a stage on the same rank may still read) is intact."""
    import copy

    from ftcompile.ir import Instr

    _b, graph, _p = traced("mlp")
    graph = copy.deepcopy(graph)
    plan = interleaved_plan(graph, 2, 2)
    second = set(plan.stages[1].nodes)
    # first node of stage 1 that reads a tensor from stage 0: make it relu_ (in place) on that tensor
    target = next(n for n in graph.op_nodes() if n.id in second
                  and any(e.src not in second and graph.node(e.src).kind == "op" for e in graph.in_edges(n.id)))
    edge = next(e for e in graph.in_edges(target.id) if e.src not in second and graph.node(e.src).kind == "op")
    bump = Instr(name="bumped", target="aten.mul_.Scalar", args=[{"ref": edge.value}, 3.0],
                 out=graph.node(edge.src).outputs[edge.value], scope=target.scope)
    target.instrs.insert(0, bump)
    graph._index()
    built = traced("mlp")[0]
    doc = {"format": "ftcompile.plan", "version": 1, "model": graph.source, "schedule": "async",
           "micro_batches": 4, "chosen": "by-hand", "plan": ordered(plan, graph).to_json(), "stages": []}
    write_package(generate(graph, doc, weight_source(built.model, graph)), doc, tmp_path)
    code = (tmp_path / "stage_1.py").read_text()
    assert ".clone()  # written in place below" in code
    pkg = load_package(tmp_path)
    stage1 = pkg.build_stage(1)
    spec = pkg.manifest.stage(1)
    args = [torch.randn(pkg.manifest.values[v].shape) if pkg.manifest.values[v].is_floating
            else torch.randint(0, 10, pkg.manifest.values[v].shape) for v in spec.inputs]
    before = [a.clone() for a in args]
    stage1(*args)
    assert all(torch.equal(a, b) for a, b in zip(args, before))


# --------------------------------------------------------------------------- damaged packages

@pytest.fixture
def good_package(tmp_path):
    return package_for(tmp_path / "pkg", "gpt2-tiny", "seq", gpus=2)


def _rewrite_sums(path: Path, rel: str) -> None:
    from ftcompile.runtime.package import sha256_file

    lines = (path / "SHA256SUMS").read_text().splitlines()
    out = [f"{sha256_file(path / rel)}  {rel}" if line.endswith(f"  {rel}") else line for line in lines]
    (path / "SHA256SUMS").write_text("\n".join(out) + "\n")


def test_altered_weight_is_refused_then_fails_verification(good_package):
    from safetensors.torch import load_file, save_file

    file = good_package / "weights" / "stage_1.safetensors"
    tensors = load_file(str(file))
    name = next(n for n in tensors if n.endswith("mlp.c_fc.weight"))
    tensors[name] = tensors[name] + 0.05 * torch.randn_like(tensors[name])
    save_file(tensors, str(file))
    with pytest.raises(PackageError, match=r"stage_1\.safetensors: checksum mismatch"):
        LocalPipeline.build(load_package(good_package))
    report = verify_package(str(good_package), checksums=False)
    assert not report.ok
    assert any(d.name == name and d.kind == "gradient" for d in report.failures)
    assert any(d.kind == "loss" for d in report.failures)


def test_missing_file_is_named(good_package):
    os.unlink(good_package / "stage_1.py")
    with pytest.raises(PackageError, match=r"stage_1\.py is missing"):
        load_package(good_package)


def test_edited_plan_is_refused(good_package):
    doc = json.loads((good_package / "plan.json").read_text())
    doc["package"]["stages"][0]["gpu"] = 1 - doc["package"]["stages"][0]["gpu"]
    (good_package / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PackageError, match=r"plan\.json: checksum mismatch \(the plan was edited"):
        load_package(good_package)


def test_wrong_weight_shape_is_named(good_package):
    from safetensors.torch import load_file, save_file

    file = good_package / "weights" / "stage_0.safetensors"
    tensors = load_file(str(file))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 5)
    save_file(tensors, str(file))
    _rewrite_sums(good_package, "weights/stage_0.safetensors")
    with pytest.raises(PackageError, match=rf"{name} has shape \[3, 5\], but stage 0 expects"):
        load_package(good_package)


def test_other_manifest_version_is_refused(good_package):
    doc = json.loads((good_package / "plan.json").read_text())
    doc["package"]["version"] = 99
    (good_package / "plan.json").write_text(json.dumps(doc))
    _rewrite_sums(good_package, "plan.json")
    with pytest.raises(PackageError, match="version 99.*regenerate"):
        load_package(good_package)


def test_manifest_of_the_wrong_shape_is_refused(good_package):
    doc = json.loads((good_package / "plan.json").read_text())
    doc["package"]["stages"][0]["inputs"] = [["input_ids"]]       # a list where a value name belongs
    (good_package / "plan.json").write_text(json.dumps(doc))
    _rewrite_sums(good_package, "plan.json")
    with pytest.raises(PackageError, match="manifest is corrupt.*regenerate"):
        load_package(good_package)
    (good_package / "SHA256SUMS").write_bytes(b"\xff\xfe not text")
    with pytest.raises(PackageError, match="SHA256SUMS cannot be read"):
        load_package(good_package)


def test_not_a_package(tmp_path):
    with pytest.raises(PackageError, match="SHA256SUMS is missing"):
        load_package(tmp_path)
    with pytest.raises(PackageError, match="no package folder"):
        load_package(tmp_path / "absent")


def test_regenerating_into_the_same_folder_removes_stale_stages(tmp_path):
    package_for(tmp_path, "gpt2-tiny", "seq", gpus=3)
    (tmp_path / "notes.txt").write_text("mine")
    package_for(tmp_path, "gpt2-tiny", "seq", gpus=2)
    m = load_package(tmp_path).manifest
    files = sorted(p.name for p in tmp_path.glob("stage_*.py"))
    assert files == sorted(f"{s.module}.py" for s in m.stages)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.rglob(".tmp-*"))


# --------------------------------------------------------------------------- without the compiler

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        # only ftcompile.runtime may be imported: not the compiler, not the model zoo, not transformers
        def find_spec(self, name, path, target=None):
            top = name.split(".")[0]
            if top == "transformers" or (top == "ftcompile" and name != "ftcompile"
                                         and not name.startswith("ftcompile.runtime")):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
""")


def test_package_runs_in_a_process_without_the_compiler(tmp_path):
    path = package_for(tmp_path / "pkg", "t5-tiny", "mixed")
    built = traced("t5-tiny")[0]
    inputs = load_package(path).inputs_from_call(*built.make_inputs("cpu"))
    torch.save(inputs, tmp_path / "inputs.pt")
    # the expected loss, from the original model with the same dropout masks
    from ftcompile.runtime.ops import keyed_random_mode

    with keyed_random_mode(5):
        expected = float(built.model(*built.make_inputs("cpu")[0], **built.make_inputs("cpu")[1])[0])
    script = BLOCKER + textwrap.dedent(f"""
        import torch
        from ftcompile.runtime import load_package
        from ftcompile.runtime.local import LocalPipeline
        pkg = load_package({str(path)!r})
        pipe = LocalPipeline.build(pkg).train()
        values, runs = pipe.forward(torch.load({str(tmp_path / 'inputs.pt')!r}), seed=5)
        pipe.backward(runs)
        grads = pipe.parameter_grads()
        assert all(g is not None for g in grads.values())
        for blocked in ("ftcompile.codegen", "ftcompile.models", "transformers"):
            try:
                __import__(blocked)
            except ImportError:
                pass
            else:
                raise SystemExit(blocked + " could be imported")
        assert not any(m.startswith(("transformers", "ftcompile.models", "ftcompile.trace")) for m in sys.modules)
        print(float(values[pkg.manifest.loss]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert abs(float(out.stdout.strip().splitlines()[-1]) - expected) <= 1e-6 * abs(expected)


def test_package_folder_imports_as_a_python_package(tmp_path):
    package_for(tmp_path / "gpt2_pkg", "gpt2-tiny", "seq", gpus=2)
    script = BLOCKER + textwrap.dedent("""
        import gpt2_pkg
        pkg = gpt2_pkg.load()
        assert sorted(gpt2_pkg.STAGES) == [s.id for s in pkg.manifest.stages]
        print(type(pkg.build_stage(0)).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "Stage0"


# --------------------------------------------------------------------------- models traced on meta

def test_meta_model_package_creates_weights_per_stage_from_recipes(tmp_path):
    path = package_for(tmp_path, "gpt2-tiny", "seq", gpus=2, device="meta")
    assert not list((tmp_path / "weights").glob("*.safetensors"))
    pkg = load_package(path, seed=1)
    m = pkg.manifest
    assert m.weights == "init" and all(p.init for p in m.params.values())
    stages = {s.id: pkg.build_stage(s.id) for s in m.stages}
    params = {n: t for mod in stages.values() for n, t in mod.named_parameters()}
    assert torch.all(params["transformer.h.0.ln_1.weight"] == 1)
    assert torch.all(params["transformer.h.0.ln_1.bias"] == 0)
    std = float(params["transformer.h.0.attn.c_attn.weight"].std())
    assert 0.015 < std < 0.025                      # GPT-2's initializer_range 0.02
    # the same seed gives the same values in any process; another seed others
    again = load_package(path, seed=1).build_stage(0)
    other = load_package(path, seed=2).build_stage(0)
    name = next(n for n, _ in again.named_parameters() if n.endswith("wte.weight"))
    assert torch.equal(dict(again.named_parameters())[name], dict(stages[0].named_parameters())[name])
    assert not torch.equal(dict(other.named_parameters())[name], dict(again.named_parameters())[name])
    # and the package trains: a forward and backward pass run
    pipe = LocalPipeline(pkg, torch.device("cpu"), stages).train()
    built = build_model("gpt2-tiny", ModelOptions())
    values, runs = pipe.forward(pkg.inputs_from_call(*built.make_inputs("cpu")), seed=0)
    pipe.backward(runs)
    assert 6.0 < float(values[m.loss]) < 8.0        # about ln(1000) for a fresh model
    with pytest.raises(VerifyError, match="stores no weights"):
        verify_package(str(path))


@pytest.mark.slow
def test_giant_t5_package_on_meta(tmp_path):
    """t5-3b at the paper's shapes: traced on meta, its package writes no weights and its
    stages build from recipes without the rest of the model."""
    # T5-3B at batch 4 x 512 keeps about 21 GB of activations per micro-batch: 32 GB workers
    path = package_for(tmp_path, "t5-3b", "seq", gpus=8, gpu_memory="32GB", batch_size=4, encoder_len=512,
                       decoder_len=4)
    pkg = load_package(path)
    m = pkg.manifest
    assert m.weights == "init" and len(m.stages) >= 8
    total = sum(math.prod(p.shape) for p in m.params.values() if p.kind == "parameter")
    assert abs(total - 2.85e9) < 0.01 * 2.85e9        # every parameter of t5-3b, the tied embedding once
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert size < 200e6
    # build the smallest stage: its parameters only
    small = min(m.stages, key=lambda s: sum(torch.Size(m.params[p].shape).numel() for p in s.params))
    module = pkg.build_stage(small.id)
    assert {n for n, _ in module.named_parameters()} == {p for p in small.params if m.params[p].kind == "parameter"}


# --------------------------------------------------------------------------- command line

def test_compile_then_verify_on_the_command_line(tmp_path, capsys):
    from ftcompile.cli import main

    out = tmp_path / "out"
    assert main(["compile", "gpt2-tiny", "--cluster", "2xcpu", "--strategy", "mixed", "-q", "-o", str(out),
                 "--cache-dir", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["compared"]["gradient"] > 0
    assert main(["verify", str(out), "-q"]) == 0
    assert "OK: the package computes what the model computes" in capsys.readouterr().out
    os.unlink(out / "weights" / "stage_0.safetensors")
    assert main(["verify", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ftcompile: error: ") and "stage_0.safetensors is missing" in err
    assert len(err.strip().splitlines()) == 1


def test_examples_package_verifies():
    """The committed example (gpt2-tiny, Mixed-pipe) is a valid package that still verifies."""
    example = REPO / "examples" / "gpt2-tiny-mixed"
    assert (example / "SHA256SUMS").is_file(), "examples/gpt2-tiny-mixed is missing: run `make example`"
    pkg = load_package(example)
    per_gpu = [sorted(s.id for s in pkg.manifest.stages_on(g)) for g in range(pkg.manifest.num_gpus)]
    assert any(len(ids) > 1 for ids in per_gpu)
    assert_verified(example)


def test_attention_dropout_given_by_keyword_is_keyed(tmp_path):
    """torch.fx keeps `dropout_p=` as written: the attention call must still be keyed by the
    micro-batch seed (so recomputation repeats its mask) and run without dropout in eval mode."""
    import torch.nn as nn
    import torch.nn.functional as F

    from ftcompile.trace_fx import trace_fx

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return (F.scaled_dot_product_attention(q, k, v, dropout_p=0.25).sum(),)

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 8, 16)
    graph = trace_fx(model, (x,), {})
    assert list(random_keys(graph).values()) == [0]
    prof = analytic_profile(graph, load_hardware("cpu"), optimizer="adam")
    result = compile_plan(Problem(graph, prof, load_cluster("2xcpu").with_overrides(gpus=1), schedule="gpipe",
                                  micro_batches=1), "seq", jobs=1)
    doc = plan_document(result, model=graph.source)
    write_package(generate(graph, doc, weight_source(model, graph)), doc, tmp_path)
    assert "dropout_p=0.25 if self.training else 0.0" in (tmp_path / "stage_0.py").read_text()
    stage = load_package(tmp_path).build_stage(0)
    run = lambda seed: stage(x, seed=seed)[0]  # noqa: E731
    stage.train()
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))
    stage.eval()
    assert torch.equal(run(1), run(2))


def test_feature_dropout_edges():
    """p = 1 drops everything (no 0/0), and unbatched dropout1d masks whole channels as torch does."""
    import torch.nn.functional as F

    from ftcompile.runtime import ops

    x = torch.ones(2, 3, 5)
    out = ops.feature_dropout(x, 1.0, True, 0, 0)
    assert torch.equal(out, torch.zeros_like(x))
    with ops.keyed_random_mode(7):
        y = F.dropout1d(torch.ones(64, 10), 0.5, True)       # (C, L): one draw per channel
    assert all(len(set(row.tolist())) == 1 for row in y)
    assert set(y[:, 0].tolist()) == {0.0, 2.0}
