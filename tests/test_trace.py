"""Tracing the zoo into OpGraphs: faithfulness, tied weights, granularity, failures."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from ftcompile.execute import run_instrs
from ftcompile.ir import OpGraph
from ftcompile.models import ModelOptions, build_model
from ftcompile.profile import graph_input_values, host_params
from ftcompile.trace import TraceError, trace

TINY = ["gpt2-tiny", "bert-tiny", "t5-tiny", "vit-tiny", "mlp", "skipnet", "encdec"]


@functools.lru_cache(maxsize=None)
def built(name: str):
    return build_model(name, ModelOptions(device="cpu"))


@functools.lru_cache(maxsize=None)
def traced(name: str, blocks: tuple[str, ...] = (), mode: str = "eval") -> OpGraph:
    b = built(name)
    b.model.train(mode == "train")
    return trace(b.model, b.args, b.kwargs, basic_blocks=blocks, source={"model": name})


def first_output(out):
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.loss if hasattr(out, "loss") else out


def run_graph(graph: OpGraph, model: nn.Module, args, kwargs) -> dict:
    """Execute ``graph`` node by node on CPU with the model's real weights."""
    env = dict(graph_input_values(graph, args, kwargs))
    params = host_params(graph, model)
    for node in graph.nodes:
        if node.kind == "op":
            # a node sees only what edges bring it
            local = {e.value: env[e.value] for e in graph.in_edges(node.id)}
            run_instrs(node.instrs, local, params, "cpu")
            for v in node.outputs:
                env[v] = local[v]
    return env


def unique_parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())   # parameters() skips tied duplicates


# --------------------------------------------------------------------------- every tiny zoo model

@pytest.mark.parametrize("name", TINY)
def test_tiny_model_traces_and_validates(name):
    g = traced(name)
    g.validate()
    assert g.granularity == "op"
    assert g.source["tracer"] == "torch.export"
    assert g.loss is not None, "the loss (first scalar floating output) was not found"
    loss_node = g.node(g.producer(g.loss))
    assert loss_node.is_loss
    assert loss_node.outputs[g.loss].tensor.shape == ()
    assert g.outputs[0] == g.loss
    assert sum(1 for _ in g.op_nodes()) > 5
    assert all(n.kind == "op" and len(n.instrs) == 1 for n in g.nodes[len([i for i in g.inputs if i["node"] is not None]):-1])
    # every input of the example call is accounted for
    b = built(name)
    tensor_inputs = [i for i in g.inputs if i["node"] is not None]
    assert len(tensor_inputs) == sum(isinstance(a, torch.Tensor) for a in [*b.args, *b.kwargs.values()])


@pytest.mark.parametrize("name", TINY)
def test_graph_reproduces_model_loss_exactly(name):
    b = built(name)
    g = traced(name, mode="eval")
    b.model.eval()
    env = run_graph(g, b.model, b.args, b.kwargs)
    with torch.no_grad():
        ref = first_output(b.model(*b.args, **b.kwargs))
    assert torch.equal(env[g.loss], ref), (env[g.loss].item(), ref.item())


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny"])
def test_graph_reproduces_training_mode_loss_with_same_seed(name):
    """With dropout active, the same seed gives the same masks in the graph and the model."""
    b = built(name)
    g = traced(name, mode="train")
    b.model.train()
    torch.manual_seed(123)
    env = run_graph(g, b.model, b.args, b.kwargs)
    torch.manual_seed(123)
    with torch.no_grad():
        ref = first_output(b.model(*b.args, **b.kwargs))
    assert torch.equal(env[g.loss], ref)
    b.model.eval()


@pytest.mark.parametrize("name", TINY)
def test_parameter_count_matches_model(name):
    b = built(name)
    g = traced(name)
    assert g.num_parameters == unique_parameter_count(b.model) == b.num_parameters
    # every trainable tensor of the model appears once, under one of its names
    names = {n for p in g.params.values() for n in [p.name, *p.aliases]}
    assert {n for n, _ in b.model.named_parameters(remove_duplicate=False)} <= names


def test_gpt2_tied_weights_recorded_once():
    g = traced("gpt2-tiny")
    infos = [p for p in g.params.values() if "lm_head.weight" in [p.name, *p.aliases]]
    assert len(infos) == 1
    tied = infos[0]
    assert {tied.name, *tied.aliases} == {"transformer.wte.weight", "lm_head.weight"}
    assert "lm_head.weight" not in g.params or "transformer.wte.weight" not in g.params
    # both the embedding lookup and the LM head read the one tensor
    ops = {g.node(u).op for u in tied.users}
    assert "aten.embedding.default" in ops and "aten.linear.default" in ops
    assert g.summary()["tied_parameters"] == 1


def test_t5_tied_weights_recorded_once():
    g = traced("t5-tiny")
    b = built("t5-tiny")
    shared = [p for p in g.params.values() if "shared.weight" in [p.name, *p.aliases]]
    assert len(shared) == 1
    names = {shared[0].name, *shared[0].aliases}
    assert {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} <= names
    if b.model.config.tie_word_embeddings:
        assert "lm_head.weight" in names
    all_names = [n for p in g.params.values() for n in [p.name, *p.aliases]]
    assert len(all_names) == len(set(all_names))


def test_non_tensor_inputs_are_recorded_as_constants():
    g = traced("gpt2-tiny")
    consts = [i for i in g.inputs if i["node"] is None]
    assert consts and consts[0]["path"] == "kwargs['use_cache']" and consts[0]["constant"] is False


# --------------------------------------------------------------------------- layer granularity

def test_layer_granularity_gpt2():
    b = built("gpt2-tiny")
    ops = traced("gpt2-tiny")
    layers = traced("gpt2-tiny", ("GPT2Block",))
    layers.validate()
    assert layers.granularity == "layer" and layers.basic_blocks == ["GPT2Block"]
    assert len(layers.nodes) < len(ops.nodes)
    blocks = [n for n in layers.nodes if n.op == "block:GPT2Block"]
    n_layer = b.model.config.n_layer
    assert len(blocks) == n_layer
    assert [n.scope for n in blocks] == [f"transformer.h.{i}" for i in range(n_layer)]
    assert all(len(n.instrs) > 1 and n.scope_class == "GPT2Block" for n in blocks)
    # nothing outside a block is merged
    assert all(len(n.instrs) == 1 for n in layers.op_nodes() if n.op != "block:GPT2Block")
    # same parameters, same users' coverage
    assert layers.params.keys() == ops.params.keys()
    assert layers.num_parameters == ops.num_parameters
    for p in blocks[0].params:
        assert p.startswith("transformer.h.0.")
    # block nodes chain one after the other
    assert blocks[0].id in layers.predecessors(blocks[1].id)
    # and it still computes the same loss
    b.model.eval()
    env = run_graph(layers, b.model, b.args, b.kwargs)
    with torch.no_grad():
        ref = first_output(b.model(*b.args, **b.kwargs))
    assert torch.equal(env[layers.loss], ref)


@pytest.mark.parametrize("name", ["t5-tiny", "mlp", "skipnet"])
def test_layer_granularity_zoo_blocks(name):
    b = built(name)
    g = traced(name, tuple(b.basic_blocks))
    ops = traced(name)
    assert len(g.nodes) < len(ops.nodes)
    assert any(n.op.startswith("block:") for n in g.nodes)
    assert g.num_parameters == ops.num_parameters
    b.model.eval()
    env = run_graph(g, b.model, b.args, b.kwargs)
    with torch.no_grad():
        ref = first_output(b.model(*b.args, **b.kwargs))
    assert torch.equal(env[g.loss], ref)


def test_unknown_basic_block_lists_module_classes():
    b = built("gpt2-tiny")
    with pytest.raises(TraceError) as ei:
        trace(b.model, b.args, b.kwargs, basic_blocks=["NoSuchBlock"])
    msg = str(ei.value)
    assert "NoSuchBlock" in msg
    assert "GPT2Block" in msg and "GPT2Attention" in msg and "GPT2MLP" in msg


def test_basic_blocks_list_may_name_classes_the_model_lacks():
    """One --basic-blocks list serves several models: absent classes are skipped and noted."""
    b = built("gpt2-tiny")
    g = traced("gpt2-tiny", ("T5Block", "GPT2Block"))
    only = traced("gpt2-tiny", ("GPT2Block",))
    assert g.granularity == "layer" and g.basic_blocks == ["GPT2Block"]
    assert g.source["absent_basic_blocks"] == ["T5Block"]
    assert sum(1 for n in g.nodes if n.op == "block:GPT2Block") == b.model.config.n_layer
    assert g.content_hash() == only.content_hash()       # the same graph, so the same cached profiles
    assert "absent_basic_blocks" not in only.source


# --------------------------------------------------------------------------- failures

class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:          # data-dependent Python control flow
            return h * 2
        return -h


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.inp(x)).pow(2).mean()


def test_untraceable_model_gives_actionable_error():
    with pytest.raises(TraceError) as ei:
        trace(GatedNet(), (torch.randn(2, 8),))
    msg = str(ei.value)
    assert "gate (Gate)" in msg                       # names the module
    assert "if h.sum() > 0" in msg                    # and the line of the model
    assert "torch.where" in msg                       # suggests what to do
    assert "Traceback" not in msg and len(msg) < 3000


def test_untraceable_model_on_meta_gives_actionable_error():
    with torch.device("meta"):
        model = GatedNet()
    with pytest.raises(TraceError, match="gate \\(Gate\\)"):
        trace(model, (torch.randn(2, 8, device="meta"),))


def test_trace_reports_progress_and_timings():
    seen = []
    b = built("mlp")
    g = trace(b.model, b.args, b.kwargs, progress=seen.append, source={"model": "mlp"})
    assert seen[0] == "export" and "convert" in seen
    assert g.source["model"] == "mlp" and set(g.source["timings_s"]) == {"export", "functionalize", "convert"}


def test_in_place_ops_are_functionalized():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            y = h * 1
            y.add_(1.0)
            y.relu_()
            return (y + h).sum()

    m = InPlace()
    x = torch.randn(3, 4)
    g = trace(m, (x,))
    targets = [ins.target for n in g.op_nodes() for ins in n.instrs]
    assert not any(t.split(".")[1].endswith("_") for t in targets if t.startswith("aten."))
    env = run_graph(g, m, (x,), {})
    assert torch.equal(env[g.loss], m(x))


# --------------------------------------------------------------------------- full sizes, on meta

@pytest.mark.slow
def test_t5_3b_on_meta():
    b = build_model("t5-3b", ModelOptions(device="meta"))
    g = trace(b.model, b.args, b.kwargs)
    g.validate()
    op_nodes = sum(1 for _ in g.op_nodes())
    assert 1000 < op_nodes < 20000
    assert abs(g.num_parameters - 2.85e9) / 2.85e9 < 0.01
    assert g.num_parameters == b.num_parameters
    assert g.loss is not None
    shared = next(p for p in g.params.values() if "shared.weight" in [p.name, *p.aliases])
    assert "encoder.embed_tokens.weight" in [shared.name, *shared.aliases]


@pytest.mark.slow
@pytest.mark.parametrize("name,approx", [("gpt2-xl", 1.56e9), ("bert-large", 3.35e8)])
def test_other_full_sizes_on_meta_layer_granularity(name, approx):
    b = build_model(name, ModelOptions(device="meta"))
    g = trace(b.model, b.args, b.kwargs, basic_blocks=b.basic_blocks)
    g.validate()
    assert abs(g.num_parameters - approx) / approx < 0.02
    assert g.num_parameters == b.num_parameters
    assert sum(1 for n in g.nodes if n.op.startswith("block:")) >= 24


# --------------------------------------------------------------------------- functionalization

class WritesThroughViews(nn.Module):
    """In-place writes on a tensor the model makes, through slice/select views and directly;
    ``row`` is a view taken before the writes and read after them (it must see them)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        z = h.new_zeros(h.shape)
        row = z[:, 1:]
        z[:, 1:] = h[:, :-1]          # copy_ through a slice
        z[:, 0] = 2.0                 # fill_ through a select
        z[1:][:, 2] = 3.0             # through a slice of a slice's select
        z.masked_fill_(z > 2.5, -1.0)
        w = z.add_(h)                 # the in-place result, read below
        return (w * row.sum()).sum() + row.mean() + z[0, 0]


class WritesThroughTranspose(nn.Module):
    """A write through a transpose: no scatter inverse, so torch's own pass must run."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        z = h * 1
        z.t().mul_(2)
        return (z + h).sum()


@pytest.mark.parametrize("cls,how", [(WritesThroughViews, "local"), (WritesThroughTranspose, "run_decompositions")])
def test_in_place_writes_through_views_are_functionalized(cls, how):
    torch.manual_seed(0)
    m = cls()
    x = torch.randn(3, 6)
    g = trace(m, (x,))
    assert g.source["functionalized"] == how
    targets = [ins.target for n in g.op_nodes() for ins in n.instrs]
    assert not any(t.split(".")[1].endswith("_") for t in targets if t.startswith("aten."))
    env = run_graph(g, m, (x,), {})
    with torch.no_grad():
        assert torch.equal(env[g.loss], m(x))


def test_t5_is_functionalized_without_retracing():
    """T5 mutates only tensors it makes (_shift_right, position buckets): the local pass suffices."""
    g = traced("t5-tiny")
    assert g.source["functionalized"] == "local"
    targets = {ins.target for n in g.op_nodes() for ins in n.instrs}
    assert {"aten.slice_scatter.default", "aten.select_scatter.default"} <= targets


# --------------------------------------------------------------------------- quiet tracing

class _ClampNothing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.clamp(self.lin(x), None, None).sum()


def test_tracing_is_quiet_and_leaves_logging_and_warnings_as_they_were(capfd):
    import logging
    import warnings

    name = "torch.fx.experimental.symbolic_shapes"
    level = logging.getLogger(name).level
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inner = list(warnings.filters)
        with pytest.raises(TraceError):
            trace(GatedNet(), (torch.randn(2, 8),))     # export fails on a data-dependent branch
        b = built("t5-tiny")
        trace(b.model, b.args, b.kwargs)               # export's pytree helpers warn on every call
        assert list(warnings.filters) == inner
    err = capfd.readouterr().err
    assert "symbolic_shapes" not in err and "Unable to find user code" not in err and "def forward" not in err
    assert not [w for w in caught if issubclass(w.category, (UserWarning, FutureWarning, DeprecationWarning))]
    assert logging.getLogger(name).level == level
    assert list(warnings.filters) == filters


def test_an_operator_failing_under_fake_tensors_is_one_line():
    """torch's fake-tensor dispatcher logs the failing operator's whole traceback at ERROR level to
    its own handler (pytest's capture does not see it: a fresh process does)."""
    import subprocess
    import sys

    code = ("import sys, torch; sys.path.insert(0, 'tests'); from test_trace import _ClampNothing; "
            "from ftcompile.trace import trace, TraceError\n"
            "try:\n    trace(_ClampNothing(), (torch.randn(2, 8),))\n"
            "except TraceError as e:\n    print('TraceError', str(e).splitlines()[0][:200])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.stdout.startswith("TraceError") and "clamp" in p.stdout, p.stdout + p.stderr
    assert "fake_tensor" not in p.stderr and "Traceback" not in p.stderr, p.stderr[:2000]


def test_verbose_tracing_lets_torch_logs_through(capfd, caplog):
    import logging

    with caplog.at_level(logging.WARNING), pytest.raises(TraceError):
        trace(GatedNet(), (torch.randn(2, 8),), verbose=True)
    text = capfd.readouterr().err + caplog.text
    assert "Unable to find user code" in text or "symbolic_shapes" in text
