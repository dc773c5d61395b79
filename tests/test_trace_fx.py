"""The torch.fx.symbolic_trace fallback (ftcompile.trace_fx)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ftcompile.execute import run_instrs
from ftcompile.hardware import PRESETS
from ftcompile.models import ModelOptions, build_model
from ftcompile.profile import analytic_profile, graph_input_values, host_params, measured_profile
from ftcompile.trace import DataDependentError, TraceError, trace
from ftcompile.trace_fx import index, trace_fx

VOCAB = 50


# --------------------------------------------------------------------------- a model torch.export rejects

@torch.fx.wrap
def check_token_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fail early on out-of-range token ids (an embedding would fail obscurely, or not at all on GPU).

    The check reads the ids' values, so torch.export (which traces with fake tensors) cannot
    capture it; torch.fx.wrap keeps it a single call for symbolic tracing. On ``meta`` there
    are no values to check.
    """
    if ids.device.type != "meta" and bool(((ids < 0) | (ids >= vocab)).any()):
        raise IndexError(f"token id out of range [0, {vocab})")
    return ids


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.proj(self.act(self.fc(self.norm(x)))))
        x += h                    # fx records this as an out-of-place add
        return x


class CheckedLM(nn.Module):
    """A tiny LM whose forward validates its token ids: torch.export fails, symbolic_trace works."""

    def __init__(self, vocab: int = VOCAB, d: int = 16, layers: int = 2):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight          # tied
        self.register_buffer("scale", torch.tensor(d ** 0.5), persistent=False)

    def forward(self, ids, labels, reduction: str = "mean"):
        h = self.embed(check_token_ids(ids, self.vocab)) * self.scale
        for block in self.blocks:
            h = block(h)
        b, t, d = h.shape                              # shapes specialise into constants
        logits = self.head(h)
        loss = F.cross_entropy(logits.view(b * t, -1), labels.view(-1), reduction=reduction)
        return loss, logits


class Tricky(nn.Module):
    """Python-level constructs the converter must get right."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.flat = nn.Flatten(1)
        self.ident = nn.Identity()
        self.fc = nn.Linear(4 * 8 * 8, 12)
        self.sm = nn.Softmax(dim=-1)

    def forward(self, x):
        h = self.relu(self.bn(self.conv(x)))          # in-place ReLU, result replaces the value
        h = self.ident(self.flat(h))
        y = self.fc(h)
        a, b = y.chunk(2, dim=-1)                      # tuple result, unpacked
        both = torch.cat(y.chunk(2, dim=-1)[::-1], dim=-1)   # tuple used whole, and sliced
        m = y.max(dim=-1)                              # torch.return_types: a field by name
        first = y[:, 0]                                # tuple index on a tensor
        last = y[..., -1:]                             # Ellipsis
        z = (a * b).sum(-1) + m.values + first + last.squeeze(-1) + both.mean(-1)
        z = z + torch.tensor([1.0, 2.0])               # a tensor constant made in forward
        z = z.add_(1.0)                                # in-place whose result replaces the value
        return self.sm(z.unsqueeze(0)).sum() + y.size(0) * 0.0


@torch.fx.wrap
def strict_check_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Like check_token_ids, but without a meta escape: it cannot run on meta at all."""
    if bool((ids >= vocab).any()):
        raise IndexError("token id out of range")
    return ids


class StrictLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 10)

    def forward(self, ids):
        h = self.embed(strict_check_ids(ids, 10))
        b, t = ids.shape
        return F.cross_entropy(self.fc(h).view(b * t, 10), ids.view(-1))


# --------------------------------------------------------------------------- helpers

def run_graph(graph, model, args, kwargs):
    env = dict(graph_input_values(graph, args, kwargs))
    params = host_params(graph, model)
    for node in graph.nodes:
        if node.kind == "op":
            local = {e.value: env[e.value] for e in graph.in_edges(node.id)}
            run_instrs(node.instrs, local, params, "cpu")
            for v in node.outputs:
                env[v] = local[v]
    return env


def checked_lm():
    torch.manual_seed(0)
    m = CheckedLM()
    ids = torch.randint(0, VOCAB, (2, 6))
    labels = torch.randint(0, VOCAB, (2, 6))
    return m, (ids,), {"labels": labels}


# --------------------------------------------------------------------------- the fallback path of trace()

def test_export_rejects_but_fallback_traces():
    m, args, kwargs = checked_lm()
    with pytest.raises(Exception):
        torch.export.export(m, args, kwargs, strict=False)
    m.eval()
    g = trace(m, args, kwargs, source={"model": "checked-lm"})
    g.validate()
    assert g.source["tracer"] == "torch.fx.symbolic_trace"
    assert g.source["model"] == "checked-lm"
    assert "branches on the value of a tensor" in g.source["export_error"]     # why export refused
    ops = [n.op for n in g.op_nodes()]
    assert ops[0].endswith("check_token_ids")           # the wrapped function is one node
    assert "torch.nn.functional.linear" in ops and "torch.nn.functional.layer_norm" in ops
    assert "method:view" in ops
    assert g.loss is not None and g.outputs[0] == g.loss
    assert [i["path"] for i in g.inputs] == ["args[0]", "kwargs['labels']"]
    # scopes: module path of the call
    linear = next(n for n in g.op_nodes() if n.op == "torch.nn.functional.linear")
    assert linear.scope == "blocks.0.fc" and linear.scope_class == "Linear"
    add = next(n for n in g.op_nodes() if n.op == "operator.add")
    assert add.scope == "blocks.0" and add.scope_class == "Block"


def test_fallback_graph_reproduces_the_model():
    m, args, kwargs = checked_lm()
    m.eval()
    g = trace(m, args, kwargs)
    env = run_graph(g, m, args, kwargs)
    with torch.no_grad():
        loss, logits = m(*args, **kwargs)
    assert torch.equal(env[g.loss], loss)
    assert torch.equal(env[g.outputs[1]], logits)
    # training mode: dropout masks agree under the same seed
    m.train()
    g = trace(m, args, kwargs)
    torch.manual_seed(7)
    env = run_graph(g, m, args, kwargs)
    torch.manual_seed(7)
    with torch.no_grad():
        loss, _ = m(*args, **kwargs)
    assert torch.equal(env[g.loss], loss)


def test_fallback_records_tied_weights_and_buffers_once():
    m, args, kwargs = checked_lm()
    g = trace(m, args, kwargs)
    tied = g.params["embed.weight"]
    assert tied.aliases == ["head.weight"] and "head.weight" not in g.params
    assert len(tied.users) == 2
    assert g.num_parameters == sum(p.numel() for p in m.parameters())
    scale = g.params["scale"]
    assert scale.kind == "buffer" and not scale.persistent and not scale.trainable


def test_fallback_graph_profiles():
    m, args, kwargs = checked_lm()
    g = trace(m, args, kwargs)
    a = analytic_profile(g, PRESETS["cpu"])
    assert a.totals()["flops_forward"] > 0 and a.totals()["flops_backward"] > 0
    p = measured_profile(g, host_params(g, m), graph_input_values(g, args, kwargs), repeats=2)
    for n in g.op_nodes():
        if n.op == "torch.nn.functional.linear":
            assert p.nodes[n.id].forward_ms > 0 and p.nodes[n.id].backward_ms > 0
            assert a.nodes[n.id].flops_backward == pytest.approx(2 * a.nodes[n.id].flops_forward)
    assert p.totals()["activation_bytes"] == a.totals()["activation_bytes"] > 0


def test_fallback_layer_granularity():
    m, args, kwargs = checked_lm()
    m.eval()
    ops = trace(m, args, kwargs)
    g = trace(m, args, kwargs, basic_blocks=["Block"])
    blocks = [n for n in g.nodes if n.op == "block:Block"]
    assert [n.scope for n in blocks] == ["blocks.0", "blocks.1"]
    assert len(g.nodes) < len(ops.nodes)
    env = run_graph(g, m, args, kwargs)
    with torch.no_grad():
        assert torch.equal(env[g.loss], m(*args, **kwargs)[0])
    with pytest.raises(TraceError, match="Block"):
        trace(m, args, kwargs, basic_blocks=["NoSuchBlock"])


def test_fallback_basic_blocks_list_may_name_classes_the_model_lacks():
    m, args, kwargs = checked_lm()
    m.eval()
    g = trace(m, args, kwargs, basic_blocks=["T5Block", "Block"])
    assert g.source["tracer"] == "torch.fx.symbolic_trace"
    assert g.granularity == "layer" and g.basic_blocks == ["Block"]
    assert g.source["absent_basic_blocks"] == ["T5Block"]
    assert [n.scope for n in g.nodes if n.op == "block:Block"] == ["blocks.0", "blocks.1"]
    direct = trace_fx(m, args, kwargs, basic_blocks=["Block", "GPT2Block"])
    assert direct.basic_blocks == ["Block"] and direct.content_hash() == g.content_hash()


def test_fallback_non_tensor_arguments_are_specialised():
    m, args, kwargs = checked_lm()
    m.eval()
    g = trace_fx(m, args, {**kwargs, "reduction": "sum"})
    assert [i["path"] for i in g.inputs] == ["args[0]", "kwargs['labels']", "kwargs['reduction']"]
    assert g.inputs[2]["node"] is None and g.inputs[2]["constant"] == "sum"
    env = run_graph(g, m, args, {**kwargs, "reduction": "sum"})
    with torch.no_grad():
        assert torch.equal(env[g.loss], m(*args, **kwargs, reduction="sum")[0])


def test_fallback_on_meta():
    with torch.device("meta"):
        m = CheckedLM()
    ids = torch.zeros(2, 6, dtype=torch.long, device="meta")
    # (on meta the check skips itself, so torch.export would manage too; call the fallback directly)
    g = trace_fx(m, (ids,), {"labels": ids})
    assert g.num_parameters == sum(p.numel() for p in m.parameters())
    assert analytic_profile(g, PRESETS["a100-80gb"]).totals()["flops_forward"] > 0


def test_shapes_propagate_on_real_tensors_when_meta_cannot_run():
    from ftcompile.profile import ProfileError

    torch.manual_seed(0)
    m = StrictLM()
    ids = torch.randint(0, 10, (2, 3))
    g = trace(m, (ids,))
    assert g.source["tracer"] == "torch.fx.symbolic_trace"
    env = run_graph(g, m, (ids,), {})
    with torch.no_grad():
        assert torch.equal(env[g.loss], m(ids))
    p = measured_profile(g, host_params(g, m), graph_input_values(g, (ids,), {}), repeats=1)
    assert p.totals()["forward_ms"] > 0
    with pytest.raises(ProfileError, match="strict_check_ids"):   # the analytic model runs on meta
        analytic_profile(g, PRESETS["cpu"])
    with torch.device("meta"):
        meta_model = StrictLM()
    with pytest.raises(TraceError, match="cannot run on the meta device.*--device cpu"):
        trace_fx(meta_model, (torch.zeros(2, 3, dtype=torch.long, device="meta"),))


# --------------------------------------------------------------------------- trace_fx on the zoo

@pytest.mark.parametrize("name", ["mlp", "skipnet"])
def test_trace_fx_on_zoo_matches_model_and_export(name):
    b = build_model(name, ModelOptions(device="cpu"))
    b.model.eval()
    g = trace_fx(b.model, b.args, b.kwargs)
    g.validate()
    env = run_graph(g, b.model, b.args, b.kwargs)
    with torch.no_grad():
        ref = b.model(*b.args, **b.kwargs)
    assert len(g.outputs) == len(ref)
    for v, r in zip(g.outputs, ref):
        assert torch.equal(env[v], r)
    exported = trace(b.model, b.args, b.kwargs)
    assert g.params.keys() == exported.params.keys()
    assert g.num_parameters == exported.num_parameters == b.num_parameters
    assert [i["path"] for i in g.inputs] == [i["path"] for i in exported.inputs]
    # the same computation costs the same FLOPs whichever tracer recorded it
    hw = PRESETS["a100-80gb"]
    fx_t, ex_t = analytic_profile(g, hw).totals(), analytic_profile(exported, hw).totals()
    assert fx_t["flops_forward"] == ex_t["flops_forward"]
    assert fx_t["flops_backward"] == ex_t["flops_backward"]
    # and layer granularity works the same way
    lg = trace_fx(b.model, b.args, b.kwargs, basic_blocks=b.basic_blocks)
    assert sum(1 for n in lg.nodes if n.op.startswith("block:")) == len(b.model.blocks)


def test_trace_fx_python_constructs():
    torch.manual_seed(0)
    m = Tricky().eval()
    x = torch.randn(2, 3, 8, 8)
    attrs_before = set(vars(m))
    g = trace_fx(m, (x,))
    assert set(vars(m)) == attrs_before          # fx's lifted constants do not stay on the model
    ops = [n.op for n in g.op_nodes()]
    assert "torch.conv2d" in ops and "torch.nn.functional.batch_norm" in ops   # F.conv2d is torch.conv2d
    assert f"{index.__module__}.index" in ops
    assert not any(op.startswith("method:") and op.endswith("_") for op in ops)
    consts = [p for p in g.params.values() if p.kind == "constant"]
    assert len(consts) == 1 and consts[0].value == [1.0, 2.0]
    assert {"bn.running_mean", "bn.running_var"} <= {p.name for p in g.params.values() if p.kind == "buffer"}
    env = run_graph(g, m, (x,), {})
    with torch.no_grad():
        assert torch.equal(env[g.loss], m(x.clone()))
    analytic_profile(g, PRESETS["cpu"])
    measured_profile(g, host_params(g, m), graph_input_values(g, (x,), {}), repeats=1)


# --------------------------------------------------------------------------- refusals

class WithAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0].sum()


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x)).sum()


class ReadsAfterInPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        z = y.relu_()
        return (z + y).sum()


class SetItem(nn.Module):
    def forward(self, x):
        y = x * 2
        y[:, 0] = 0.0
        return y.sum()


class ListInput(nn.Module):
    def forward(self, xs):
        return (xs[0] + xs[1]).sum()


def test_unsupported_leaf_module_is_named():
    with pytest.raises(TraceError) as ei:
        trace_fx(WithAttention(), (torch.randn(2, 3, 8),))
    assert "attn" in str(ei.value) and "MultiheadAttention" in str(ei.value)


def test_control_flow_names_module():
    with pytest.raises(TraceError) as ei:
        trace_fx(Gated(), (torch.randn(2, 4),))
    msg = str(ei.value)
    assert "gate (Gate)" in msg and "Remedies" in msg


def test_in_place_on_value_read_later_is_refused():
    with pytest.raises(TraceError, match="reads afterwards"):
        trace_fx(ReadsAfterInPlace(), (torch.randn(2, 4),))
    with pytest.raises(TraceError, match="item assignment"):
        trace_fx(SetItem(), (torch.randn(2, 4),))


def test_tensors_nested_in_inputs_are_refused():
    with pytest.raises(TraceError, match="direct arguments"):
        trace_fx(ListInput(), ([torch.randn(2), torch.randn(2)],))


def test_both_tracers_failing_reports_both():
    with pytest.raises(TraceError) as ei:
        trace(Gated(), (torch.randn(2, 4),))
    msg = str(ei.value)
    # export refuses the branch on data (and says how to rewrite it), the fallback fails too
    assert isinstance(ei.value, DataDependentError)
    assert "branches on the value of a tensor" in msg and "torch.where" in msg
    assert "symbolic_trace fallback failed too" in msg
    assert "gate (Gate)" in msg
