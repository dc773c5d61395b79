"""What the tracer keeps of a model's meaning: no-grad and autocast regions, in-place operations,
buffer updates, aliased inputs, and the clear refusal of data-dependent shapes.

Each construct is compared with eager PyTorch: the gradients the package computes (through
``ftcompile verify``, which runs the generated stages beside the eager model), or the values
and dtypes the graph holds.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ftcompile.cluster import load_cluster
from ftcompile.codegen import CodegenError, generate, write_package
from ftcompile.hardware import load_hardware
from ftcompile.plan import Plan, Problem, Stage, evaluate, ordered
from ftcompile.profile import analytic_profile
from ftcompile.runtime import load_package
from ftcompile.trace import DataDependentError, TraceError, trace
from ftcompile.verify import verify_package
from ftcompile.weights import weight_source

HERE = Path(__file__).parent


def _module_file(tmp_path: Path, body: str) -> Path:
    """A user-model file (the compiler rebuilds user models by path for verify)."""
    path = tmp_path / "model.py"
    path.write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n" + body)
    return path


def _package(tmp_path: Path, spec: str, stages: int = 2) -> tuple[Path, object]:
    """Trace ``spec`` (file.py:fn), cut its op nodes into ``stages`` contiguous stages on as many GPUs."""
    from ftcompile.models import ModelOptions, build_model

    built = build_model(spec, ModelOptions())
    graph = trace(built.model, built.args, built.kwargs,
                  source={"model": built.name, "options": dataclasses.asdict(built.options)})
    ops = [n.id for n in graph.op_nodes()]
    size = -(-len(ops) // stages)
    plan = ordered(Plan("by-hand", stages, [Stage(i, i, ops[i * size:(i + 1) * size]) for i in range(stages)]),
                   graph)
    prof = analytic_profile(graph, load_hardware("cpu"))
    cost = evaluate(Problem(graph, prof, load_cluster("2xcpu").with_overrides(gpus=stages)), plan)
    doc = {"format": "ftcompile.plan", "version": 1, "model": graph.source, "graph_hash": graph.content_hash(),
           "schedule": "1f1b", "micro_batches": 2, "recompute": None, "chosen": "by-hand", "plan": plan.to_json(),
           "profile": {"optimizer": "adam"},
           "stages": [{"id": c.id, "forward_ms": c.forward_ms, "backward_ms": c.backward_ms} for c in cost.stages]}
    out = tmp_path / "pkg"
    write_package(generate(graph, doc, weight_source(built.model, graph)), doc, out)
    return out, graph


def _targets(graph) -> list[str]:
    return [ins.target for n in graph.nodes for ins in n.instrs]


# --------------------------------------------------------------------------- no-grad regions

NO_GRAD = '''
class Branches(nn.Module):
    """Two paths from one hidden state: one trained, one under no_grad (a stop-gradient)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            g = torch.tanh(self.b(h))           # b gets no gradient, nor does a through g
            with torch.enable_grad():
                e = self.c(h)                   # but this nested region trains c (and a through it)
        return (h * g).sum() + e.pow(2).mean() + g.sum()


def build():
    torch.manual_seed(0)
    return Branches(), (torch.randn(4, 8),)
'''


def test_no_grad_region_is_a_stop_gradient_as_in_eager(tmp_path):
    spec = f"{_module_file(tmp_path, NO_GRAD)}:build"
    pkg, graph = _package(tmp_path, spec)
    assert "aten.detach.default" in _targets(graph)
    assert not any("wrap_with" in t for t in _targets(graph))
    assert any("aten.detach.default(" in (pkg / f"stage_{i}.py").read_text() for i in range(2))
    # eager PyTorch: b gets no gradient, a and c do
    from ftcompile.models import ModelOptions, build_model

    built = build_model(spec, ModelOptions())
    built.model(*built.args).backward()
    assert built.model.b.weight.grad is None and built.model.c.weight.grad is not None
    report = verify_package(str(pkg), tolerance=1e-6)
    assert report.ok, [d.row() for d in report.failures]
    # the package's gradients: none for b, as eager, and the same for a and c
    from ftcompile.runtime.local import LocalPipeline

    pipe = LocalPipeline.build(load_package(pkg))
    values, runs = pipe.forward(load_package(pkg).inputs_from_call(built.args, {}))
    pipe.backward(runs)
    grads = pipe.parameter_grads()
    assert grads.get("b.weight") is None and grads.get("b.bias") is None
    assert torch.allclose(grads["a.weight"], built.model.a.weight.grad, rtol=1e-6, atol=1e-7)


def test_run_decompositions_would_have_trained_the_stop_gradient_branch():
    """The alternative the issue rules out, shown: torch's decomposition drops the region's meaning."""
    ns: dict = {"torch": torch, "nn": nn, "F": F}
    exec(NO_GRAD, ns)
    model, args = ns["build"]()
    ep = torch.export.export(model, args, strict=False).run_decompositions()
    graph = ep.graph_module
    # re-run the decomposed program with b's weights requiring grad: a gradient reaches b
    params = {n: p.detach().requires_grad_(True) for n, p in model.named_parameters()}
    out = torch.func.functional_call(ep.module(), params, args)
    grads = torch.autograd.grad(out[0] if isinstance(out, tuple) else out, [params["b.weight"]], allow_unused=True)
    assert grads[0] is not None and graph is not None


# --------------------------------------------------------------------------- autocast regions

AUTOCAST = '''
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.gelu(self.a(x))                 # linear in bfloat16
            with torch.autocast("cpu", enabled=False):
                s = h.float().softmax(-1)         # float32 again
            logits = self.b(h * s)
        return F.cross_entropy(logits.float(), y)


def build():
    torch.manual_seed(0)
    return Mixed(), (torch.randn(8, 16), torch.randint(0, 4, (8,)))

'''


def test_autocast_region_computes_in_autocasts_dtypes(tmp_path):
    spec = f"{_module_file(tmp_path, AUTOCAST)}:build"
    pkg, graph = _package(tmp_path, spec)
    linears = [ins for n in graph.nodes for ins in n.instrs if ins.target == "aten.linear.default"]
    assert [ins.out.tensor.dtype for ins in linears] == ["bfloat16", "bfloat16"]
    casts = [ins for n in graph.nodes for ins in n.instrs if ins.target == "aten._to_copy.default"]
    assert casts and all(c.kwargs["dtype"] == {"dtype": "bfloat16"} for c in casts)
    code = "".join((pkg / f"stage_{i}.py").read_text() for i in range(2))
    assert "torch.autocast" not in code and "dtype=torch.bfloat16" in code
    report = verify_package(str(pkg), tolerance=1e-6)     # eager runs the model under its autocast
    assert report.ok, [d.row() for d in report.failures]


def test_autocast_for_another_device_is_inert_and_said(tmp_path):
    """Traced on meta (giant models), a CPU autocast region changed no dtype: neither does the package."""
    from ftcompile.models import ModelOptions, build_model

    built = build_model(f"{_module_file(tmp_path, AUTOCAST)}:build", ModelOptions())
    model = built.model.to("meta")
    args = tuple(a.to("meta") for a in built.args)
    graph = trace(model, args)
    assert all(ins.out is None or ins.out.tensor is None or ins.out.tensor.dtype in ("float32", "int64")
               for n in graph.nodes for ins in n.instrs)
    assert "aten._to_copy.default" not in _targets(graph)
    assert any("autocast region(s) for cpu had no effect when tracing on meta" in s
               for s in graph.source.get("notes", []))


def test_control_flow_operators_are_refused_by_name(tmp_path):
    class Cond(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,)).sum()

    with pytest.raises(TraceError, match="cond.*torch.where"):
        trace(Cond(), (torch.randn(3),))


# --------------------------------------------------------------------------- in-place operations

def test_every_in_place_op_maps_to_its_out_of_place_form():
    from ftcompile.functionalize import out_of_place

    aten = torch.ops.aten
    assert out_of_place(aten.dropout_.default) == (aten.dropout.default, {"self": "input"})
    assert out_of_place(aten.relu_.default)[0] is aten.relu.default
    assert out_of_place(aten.hardtanh_.default)[0] is aten.hardtanh.default       # ReLU6(inplace=True)
    assert out_of_place(aten.bernoulli_.float)[0] is aten.bernoulli.p             # another overload name
    assert out_of_place(aten.masked_fill_.Scalar)[0] is aten.masked_fill.Scalar
    # aten.copy has no derivative: copy_ becomes the runtime's copy_into, which passes the gradient on
    from ftcompile.runtime.ops import copy_into

    assert out_of_place(aten.copy_.default) == (copy_into, {"self": "dst"})
    dst, src = torch.zeros(2, 3, dtype=torch.float64), torch.randn(3, requires_grad=True)
    out = copy_into(dst, src)
    assert out.dtype == torch.float64 and out.shape == (2, 3) and torch.equal(out[1], src.detach().double())
    out.sum().backward()
    assert torch.equal(src.grad, torch.full((3,), 2.0))          # broadcast over two rows: two ones each


def test_mobilenet_in_place_dropout_stays_dropout():
    """In-place dropout on a view (the classifier's Dropout(inplace=True) on x.flatten(1)) is
    rewritten locally; before, the whole program went through run_decompositions and dropout
    became bernoulli arithmetic."""
    from ftcompile.models import ModelOptions, build_model

    built = build_model(f"{HERE / 'archs' / 'plain_models.py'}:mobilenet_v2", ModelOptions())
    graph = trace(built.model, built.args)
    targets = _targets(graph)
    assert graph.source["functionalized"] == "local"
    assert "aten.dropout.default" in targets and not any("bernoulli" in t for t in targets)
    assert not any(t.endswith("_.default") for t in targets)
    analytic_profile(graph, load_hardware("cpu"))      # every node differentiates


def test_parameter_written_in_place_is_refused():
    class Clamp(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            with torch.no_grad():
                self.w.clamp_(max=0.5)
            return (x * self.w).sum()

    with pytest.raises(TraceError, match="writes parameter w in place"):
        trace(Clamp(), (torch.randn(4),))


# --------------------------------------------------------------------------- buffer updates

BUFFERS = '''
class Counter(nn.Module):
    """A buffer written twice in forward (read before, updated after), and a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        self.seen.add_(x.shape[0])
        h = self.bn(self.fc(x))
        self.seen.mul_(2.0)
        return self.head(torch.relu(h)).pow(2).mean()


def build():
    torch.manual_seed(0)
    return Counter(), (torch.randn(8, 6),)
'''


def test_buffer_updates_are_generated_and_verified(tmp_path):
    spec = f"{_module_file(tmp_path, BUFFERS)}:build"
    pkg, graph = _package(tmp_path, spec, stages=1)
    writes = graph.buffer_writes()
    assert set(writes) == {"seen", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    m = load_package(pkg).manifest
    assert m.stages[0].mutates_buffers
    report = verify_package(str(pkg), tolerance=1e-6)
    assert report.ok and report.compared["buffer"] == 4, [d.row() for d in report.failures]

    # update_buffers=False: the same outputs, no buffer written
    stage = load_package(pkg).build_stage(0)
    before = {n: b.clone() for n, b in stage.named_buffers()}
    x = torch.randn(8, 6)
    out_a = stage(x, seed=0, update_buffers=False)
    assert all(torch.equal(b, before[n]) for n, b in stage.named_buffers())
    out_b = stage(x, seed=0)
    assert torch.equal(out_a[0], out_b[0])
    assert float(stage.seen) == 16.0 and int(stage.bn.num_batches_tracked) == 1
    assert not torch.equal(stage.bn.running_mean, before["bn.running_mean"])


def test_verify_catches_a_package_that_drops_buffer_updates(tmp_path):
    spec = f"{_module_file(tmp_path, BUFFERS)}:build"
    pkg, _graph = _package(tmp_path, spec, stages=1)
    code = (pkg / "stage_0.py").read_text()
    (pkg / "stage_0.py").write_text(code.replace("if update_buffers:", "if False:"))
    report = verify_package(str(pkg), checksums=False)
    assert not report.ok
    assert {d.name for d in report.failures} >= {"seen", "bn.running_mean", "bn.running_var"}


def test_a_buffer_written_by_one_stage_and_read_by_another_is_refused(tmp_path):
    spec = f"{_module_file(tmp_path, BUFFERS)}:build"
    with pytest.raises(CodegenError, match="buffer seen is updated in forward by stage"):
        _package(tmp_path, spec, stages=3)


# --------------------------------------------------------------------------- aliased inputs

ALIASED = '''
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 20)

    def forward(self, input_ids, labels):
        logits = self.out(self.emb(input_ids))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def build():
    ids = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    return LM(), (), {"input_ids": ids, "labels": ids}
'''


def test_aliased_inputs_are_traced_apart(tmp_path):
    spec = f"{_module_file(tmp_path, ALIASED)}:build"
    pkg, graph = _package(tmp_path, spec)
    assert graph.source["aliased_inputs"] == [["kwargs['input_ids']", "kwargs['labels']"]]
    emb = next(ins for n in graph.nodes for ins in n.instrs if ins.target == "aten.embedding.default")
    assert emb.args[1] == {"ref": "input_ids"}               # not the labels placeholder
    report = verify_package(str(pkg), tolerance=1e-6)
    assert report.ok, [d.row() for d in report.failures]
    assert any("kwargs['labels']" in n and "other values" in n for n in report.notes)


def test_verify_is_not_fooled_by_aliased_example_inputs(tmp_path):
    """A package traced the old way (one placeholder read for both inputs) computes the model's loss on
    the aliased example call; verify gives the inputs distinct values and catches it."""
    from ftcompile import trace as trace_module
    from ftcompile.models import ModelOptions, build_model

    spec = f"{_module_file(tmp_path, ALIASED)}:build"
    built = build_model(spec, ModelOptions())
    wrong = trace_module._trace(built.model, built.args, built.kwargs, (),
                                {"model": built.name, "options": dataclasses.asdict(built.options)},
                                lambda _s: None, quiet=True)
    emb = next(ins for n in wrong.nodes for ins in n.instrs if ins.target == "aten.embedding.default")
    assert emb.args[1] == {"ref": "labels"}                  # what export does with one tensor for two inputs
    plan = ordered(Plan("by-hand", 1, [Stage(0, 0, [n.id for n in wrong.op_nodes()])]), wrong)
    doc = {"format": "ftcompile.plan", "version": 1, "model": wrong.source, "graph_hash": wrong.content_hash(),
           "schedule": "1f1b", "micro_batches": 2, "recompute": None, "chosen": "by-hand", "plan": plan.to_json(),
           "profile": {"optimizer": "adam"}, "stages": [{"id": 0}]}
    write_package(generate(wrong, doc, weight_source(built.model, wrong)), doc, tmp_path / "wrong")
    report = verify_package(str(tmp_path / "wrong"))
    assert not report.ok and any(d.kind == "loss" for d in report.failures)


def test_an_aliased_input_written_in_place_is_refused(tmp_path):
    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 4)

        def forward(self, input_ids, labels):
            labels[:, 0] = 0                      # the caller's input_ids change too
            return self.emb(input_ids).sum() + labels.float().sum()

    ids = torch.randint(0, 20, (2, 5))
    with pytest.raises(TraceError, match="labels.*pass separate tensors"):
        trace(Shift(), (), {"input_ids": ids, "labels": ids})


# --------------------------------------------------------------------------- data-dependent shapes

def test_data_dependent_shape_is_refused_with_the_operation_and_module():
    sys.path.insert(0, str(HERE / "archs"))
    try:
        import plain_models
    finally:
        sys.path.pop(0)
    model, args = plain_models.masked()
    with pytest.raises(DataDependentError) as ei:
        trace(model, args)
    msg = str(ei.value)
    assert "aten.index" in msg and "module pool (MaskedMean)" in msg and "h[h > 0]" in msg
    assert "torch.where" in msg and "Traceback" not in msg


@pytest.mark.parametrize("target, words", [
    ("plain_models.py:masked", ["aten.index", "MaskedMean"]),
    pytest.param("hf_models.py:m2m100_layerdrop", ["branches on the value of a tensor", "layerdrop"],
                 marks=pytest.mark.slow),
])
def test_cli_refuses_data_dependent_models_with_exit_2(target, words, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ftcompile", "compile", str(HERE / "archs" / target), "--gpus", "2",
                        "--cluster", "2xcpu", "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip()
    assert err.startswith("ftcompile: error: ") and "Traceback" not in err and len(err.splitlines()) == 1
    assert all(w in err for w in words), err


# --------------------------------------------------------------------------- memory a model never writes

STRIDED = '''
class Strided(nn.Module):
    """Reads memory it never wrote: uninitialised strided buffers, partly filled."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.empty_strided((2, 4), (1, 2))          # column-major: no zeros twin keeps it
        y[:, :2] = x[:, :2]
        z = x.new_empty_strided((2, 4), (4, 1))
        z[:, 2:] = 1.0
        return self.lin(y + z).pow(2).sum()


def build():
    torch.manual_seed(0)
    return Strided(), (torch.randn(2, 4),)
'''


def test_uninitialised_strided_memory_is_traced_as_zeros(tmp_path):
    """empty_strided and new_empty_strided become the runtime's zero-filled twins (strides kept): the
    package computes what the model computes with zeros where it never wrote, every time (a
    recomputed stage sends the bits it sent the first time)."""
    from ftcompile.runtime.local import LocalPipeline
    from ftcompile.runtime.ops import new_zeros_strided, zeros_strided

    from ftcompile.models import ModelOptions, build_model

    spec = f"{_module_file(tmp_path, STRIDED)}:build"
    pkg, graph = _package(tmp_path, spec)
    targets = _targets(graph)
    assert "aten.empty_strided.default" not in targets and "aten.new_empty_strided.default" not in targets
    assert {"ftcompile.runtime.ops.zeros_strided", "ftcompile.runtime.ops.new_zeros_strided"} <= set(targets)
    assert zeros_strided((2, 3), (1, 2)).stride() == (1, 2)
    assert new_zeros_strided(torch.ones(1), (2, 3), (1, 2)).stride() == (1, 2)
    package = load_package(pkg)
    x = torch.randn(2, 4)
    lin = build_model(spec, ModelOptions()).model.lin        # the weights the package was made from
    y = torch.zeros(2, 4)
    y[:, :2] = x[:, :2]
    z = torch.zeros(2, 4)
    z[:, 2:] = 1.0
    want = lin(y + z).pow(2).sum()
    pipe = LocalPipeline.build(package, "cpu").train(False)
    for _ in range(2):
        values, _ = pipe.forward({package.manifest.inputs[0].value: x}, grad=False, update_buffers=False)
        assert torch.allclose(values[package.manifest.loss], want, rtol=1e-6, atol=1e-6)

