"""Trace a model into an :class:`~ftcompile.ir.OpGraph` (FTPipe §4 "Tracing execution").

The model is captured with ``torch.export.export(..., strict=False)``, which
works on the ``meta`` device, so giant models are traced without their weights.
Where the graph mutates tensors in place it is functionalized first, so that
every edge of the OpGraph is a true dataflow dependency and partitions can be
reordered safely. Models that ``torch.export`` cannot capture fall back to
``torch.fx.symbolic_trace`` (see :mod:`ftcompile.trace_fx`).

Granularity is the operator by default; ``basic_blocks`` names module classes
(``T5Block``, ``GPT2Block``) whose calls become single nodes (FTPipe §5.6).
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

from .functionalize import (
    NeedsFullFunctionalization, Refused, functionalize_locally, needs_functionalization,
)
from .ir import (
    Edge, GraphError, Instr, Node, OpGraph, ParamInfo, TensorMeta, ValueMeta,
    encode_literal, iter_params, iter_refs,
)
from .regions import RegionError, has_regions, inline_regions


class TraceError(RuntimeError):
    """The model could not be traced; the message names where and suggests a remedy."""


class DataDependentError(TraceError):
    """Shapes or control flow depend on tensor values: no tracer can make a static pipeline of it."""


# Uninitialised tensors get zeros: their contents are undefined, so zeros are one valid choice, and
# a stage then sends and recomputes the same bits every time (verify compares a stage's recomputed
# outputs with its first ones; a scratch tensor filled by copy_ may cross a stage boundary).
_ZEROED_TARGETS = {"aten.new_empty.default": "aten.new_zeros.default",
                   "aten.empty_like.default": "aten.zeros_like.default",
                   "aten.empty.memory_format": "aten.zeros.default",
                   # no zeros twin keeps the strides: the runtime's (empty, then zeroed)
                   "aten.empty_strided.default": "ftcompile.runtime.ops.zeros_strided",
                   "aten.new_empty_strided.default": "ftcompile.runtime.ops.new_zeros_strided"}

# Operators that only check metadata at trace time; they carry no data and would
# pin otherwise movable nodes, so the OpGraph drops them.
_DROPPED_TARGETS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
}

# --basic-blocks is no remedy: it groups operators after tracing, so the tracer still enters
# every module.
REMEDIES = (
    "Remedies: call the model with use_cache=False; build HuggingFace models with "
    "attn_implementation='eager'; or move data-dependent Python control flow (if tensor.item() ...) "
    "out of forward."
)


# Loggers that torch.export and its symbolic-shape machinery write to on every trace
# (guards, "Unable to find user code", whole graph dumps when tracing fails). The
# TraceError we raise already says what went wrong; these are for torch developers.
_NOISY_LOGGERS = (
    "torch.fx.experimental.symbolic_shapes", "torch.fx.experimental.recording", "torch.export",
    "torch._export", "torch._dynamo", "torch._subclasses.fake_tensor", "torch._functorch",
    "torch._guards", "torch.fx._symbolic_trace",
)


@contextlib.contextmanager
def quiet_tracing(enabled: bool = True) -> Iterator[None]:
    """Silence torch's tracing chatter (symbolic-shape logs, User/Future/Deprecation warnings).

    Scoped: logger levels and warning filters are restored on exit, so a caller that
    wants the noise (``ftcompile --debug``) passes ``enabled=False``, and nothing is
    left behind for code that runs after the trace.
    """
    if not enabled:
        yield
        return
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        # CRITICAL: the fake-tensor dispatcher logs a failing operator's whole traceback at ERROR,
        # which the TraceError already sums up in one line.
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            for category in (UserWarning, FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass
class TraceStats:
    """How tracing went: which tracer, how long each phase took."""

    tracer: str
    export_s: float
    functionalize_s: float
    convert_s: float


def target_name(target: Any) -> str:
    """A stable, importable name for an fx call target (``aten.linear.default``, ``operator.getitem``)."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        raise TraceError(
            f"the graph contains the higher-order operator {target.name()} (control flow or a "
            f"grad/autocast region inside forward), which ftcompile cannot partition. " + REMEDIES)
    if target is operator.getitem:
        return "operator.getitem"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    short = getattr(target, "__name__", None)
    if "." in name and short and getattr(sys.modules.get(mod), short, None) is target:
        # torch.cat's qualname is "_VariableFunctionsClass.cat", but it is importable as torch.cat
        name = short
    if mod.startswith("torch._C") and short and getattr(torch.nn.functional, short, None) is target:
        # F.linear is the builtin torch._C._nn.linear; name it by its public path
        return f"torch.nn.functional.{short}"
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if mod.startswith("torch") or mod in ("math", "builtins"):
        return f"{mod}.{name}"
    return f"{mod}.{name}"


def value_meta(val: Any) -> ValueMeta:
    """Metadata for the ``meta['val']`` of an fx node (a FakeTensor, a number, None...).

    Sizes must be static: :func:`refuse_data_dependent` turns unbacked ones into a
    :class:`DataDependentError` naming the operator before this is reached.
    """
    if isinstance(val, torch.Tensor):
        return ValueMeta(tensor=TensorMeta(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch.")))
    if isinstance(val, torch.SymInt):
        return ValueMeta(literal=int(val))
    try:
        return ValueMeta(literal=encode_literal(val))
    except TypeError:
        return ValueMeta(literal=None)


def _module_scopes(node: torch.fx.Node) -> list[list[str]]:
    stack = node.meta.get("nn_module_stack") or {}
    return [[path, cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"]
            for path, cls in stack.values()]


def _block_key(node: torch.fx.Node, blocks: set[str]) -> tuple[str, str, str] | None:
    """The outermost module call in ``node``'s stack whose class is a basic block."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, (path, cls) in stack.items():
        cls_name = cls if isinstance(cls, str) else cls.__qualname__
        short = cls_name.rsplit(".", 1)[-1]
        if short in blocks or cls_name in blocks:
            return key, path, short
    return None


# --------------------------------------------------------------------------- capture

def _export(model: torch.nn.Module, args: tuple, kwargs: dict, quiet: bool = False) -> torch.export.ExportedProgram:
    """``torch.export`` in non-strict mode, turning failures into a TraceError naming the module.

    With ``quiet``, the partial graph torch.export prints to stderr when it fails is
    dropped (the TraceError says where it failed); anything else written to stderr
    meanwhile (the model's own prints) still gets there.
    """
    active: list[str] = []
    names = {id(m): (n or "<root>", type(m).__name__) for n, m in model.named_modules()}
    handles = []

    def pre(mod, _inp):
        path, cls = names.get(id(mod), ("?", type(mod).__name__))
        active.append(f"{path} ({cls})")

    def post(mod, _inp, _out):
        if active:
            active.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    held = io.StringIO()
    partial = None
    try:
        with contextlib.redirect_stderr(held) if quiet else contextlib.nullcontext():
            return torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception as exc:  # noqa: BLE001 - any tracer failure becomes a user-facing message
        partial = getattr(exc, "partial_fx_graph", None)
        where = active[-1] if active else "the model's forward"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if _is_data_dependent(exc):
            code = _user_code_line(str(exc))
            raise DataDependentError(
                f"module {where} branches on the value of a tensor ({code or first[:200]}): Python control flow "
                "that depends on data (if tensor ..., tensor.item(), int(tensor)) takes one path at trace time, so "
                "a static pipeline cannot hold it. Compute both branches and select with torch.where, make the "
                "condition a Python constant (a config flag), or move it out of forward (e.g. set layerdrop=0)"
            ) from exc
        raise TraceError(f"torch.export could not trace the model in module {where}: "
                         f"{type(exc).__name__}: {first[:400]}. " + REMEDIES) from exc
    finally:
        for h in handles:
            h.remove()
        text = held.getvalue()
        if partial is not None:
            text = text.replace(f"{partial}\n", "")
        if text:
            sys.stderr.write(text)


def _is_data_dependent(exc: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, GuardOnDataDependentSymNode):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _user_code_line(text: str) -> str | None:
    """The model's line in torch's "The following call raised this error" trailer, as ``file:line: code``."""
    import re

    m = re.search(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', text.split("The following call raised")[-1])
    if not m:
        return None
    return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)} in {m.group(3)}: {m.group(4).strip()}"


def _node_where(n: torch.fx.Node) -> str:
    """Where an fx node comes from: its module (path and class) and the model's source line."""
    stack = n.meta.get("nn_module_stack") or {}
    parts = []
    if stack:
        path, cls = list(stack.values())[-1]
        cls_name = cls if isinstance(cls, str) else cls.__qualname__
        parts.append(f"module {path or '<root>'} ({cls_name.rsplit('.', 1)[-1]})")
    trace_text = n.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace_text.strip().splitlines() if ln.strip()]
    if len(lines) >= 2 and lines[-2].startswith("File "):
        loc = lines[-2].replace("File ", "").split(",")
        parts.append(f"{loc[0].strip().strip(chr(34)).rsplit('/', 1)[-1]}:{loc[1].strip().removeprefix('line ')}: "
                     f"{lines[-1]}")
    return ", ".join(parts) or "the model's forward"


def refuse_data_dependent(gm: torch.fx.GraphModule) -> None:
    """Raise :class:`DataDependentError` at the first operator whose output size depends on data.

    ``x[mask]``, ``nonzero``, ``unique``, ``masked_select``, ``.item()`` used as a size:
    export represents their sizes by unbacked symbols, and a pipeline stage, whose
    receive buffers are shaped before the data arrives, cannot hold them.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for mod in gm.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            if n.op not in ("call_function", "call_method"):
                continue
            val = n.meta.get("val")
            if val is None:
                continue
            try:
                unbacked = free_unbacked_symbols(val)
            except Exception:  # noqa: BLE001 - a value it cannot walk has no symbols we know of
                continue
            if unbacked:
                what = "a number read from a tensor" if not isinstance(val, torch.Tensor) else \
                    "a tensor whose shape depends on the values of its inputs"
                raise DataDependentError(
                    f"{target_label(n)} in {_node_where(n)} makes {what} (as x[mask], nonzero, unique, "
                    "masked_select or .item() do); a pipeline stage needs static shapes. Keep the shape fixed "
                    "(torch.where(mask, x, 0), masked_fill, multiply by the mask) or move this out of the model")


def target_label(n: torch.fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[1]}"
    return str(getattr(t, "__name__", t))


def _param_table(model: torch.nn.Module, ep: torch.export.ExportedProgram):
    """Map placeholder names to (canonical name, kind), and canonical names to ParamInfo."""
    from torch.export.graph_signature import InputKind

    aliases: dict[int, list[str]] = defaultdict(list)
    requires_grad: dict[int, bool] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases[id(p)].append(name)
        requires_grad[id(p)] = p.requires_grad
    for name, b in model.named_buffers(remove_duplicate=False):
        aliases[id(b)].append(name)
    by_name: dict[str, int] = {n: k for k, ns in aliases.items() for n in ns}

    placeholder_to_param: dict[str, str] = {}
    infos: dict[str, ParamInfo] = {}
    user_inputs: list[tuple[str, Any]] = []  # (placeholder name, ConstantArgument value or None)
    kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
             InputKind.CONSTANT_TENSOR: "constant"}
    phs = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in ep.graph_signature.input_specs:
        arg_name = getattr(spec.arg, "name", None)
        if spec.kind in kinds:
            # Tied weights reach the graph as one placeholder per name; all map to one
            # canonical entry (the name the model lists first).
            names = aliases.get(by_name.get(spec.target, -1), [spec.target])
            canonical = names[0]
            placeholder_to_param[arg_name] = canonical
            if canonical in infos:
                continue
            val = phs[arg_name].meta.get("val")
            infos[canonical] = ParamInfo(
                name=canonical, kind=kinds[spec.kind], meta=value_meta(val).tensor,
                aliases=[n for n in names if n != canonical],
                requires_grad=requires_grad.get(by_name.get(canonical, -1), spec.kind == InputKind.PARAMETER),
                persistent=spec.persistent if spec.persistent is not None else True,
            )
            if spec.kind == InputKind.CONSTANT_TENSOR:
                # Lifted constants (torch.tensor(...) inside forward) exist only in the
                # exported program; keep their values so the graph runs without it.
                const = ep.constants.get(spec.target)
                if isinstance(const, torch.Tensor) and not const.is_meta:
                    if const.numel() > 65536:
                        raise TraceError(f"forward creates a large constant tensor {spec.target} "
                                         f"{tuple(const.shape)}; register it as a buffer instead")
                    infos[canonical].value = const.detach().cpu().tolist()
                    infos[canonical].requires_grad = False
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append((arg_name, getattr(spec.arg, "value", None)))
        else:
            raise TraceError(f"unsupported graph input kind {spec.kind.name} for {arg_name}. " + REMEDIES)
    return placeholder_to_param, infos, user_inputs


def _input_paths(args: tuple, kwargs: dict) -> list[str]:
    from .runtime.manifest import call_leaves

    return [path for path, _leaf in call_leaves(args, kwargs)]


# --------------------------------------------------------------------------- conversion

def _placeholder_kinds(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """Placeholder name -> ``parameter``, ``buffer``, ``constant`` or ``input``."""
    from torch.export.graph_signature import InputKind

    kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant",
             InputKind.USER_INPUT: "input"}
    return {spec.arg.name: kinds.get(spec.kind, "other") for spec in ep.graph_signature.input_specs
            if hasattr(spec.arg, "name")}


def _signature_writes(ep: torch.export.ExportedProgram, graph: torch.fx.Graph) -> None:
    """Mark the buffer mutations a program states in its signature (after ``run_decompositions``).

    The value written into a buffer gets ``meta["ftc_writes"]`` as the local pass
    marks it; a parameter written in forward is refused.
    """
    from torch.export.graph_signature import InputKind, OutputKind

    buffer_ph = {spec.target: spec.arg.name for spec in ep.graph_signature.input_specs
                 if spec.kind == InputKind.BUFFER}
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],)
    for a, spec in zip(flat, ep.graph_signature.output_specs):
        if spec.kind == OutputKind.PARAMETER_MUTATION:
            raise TraceError(f"forward writes parameter {spec.target} in place; a pipeline changes parameters "
                             "only through the optimizer: compute the new value out of place, or make it a buffer")
        if spec.kind == OutputKind.BUFFER_MUTATION and isinstance(a, torch.fx.Node):
            a.meta.setdefault("ftc_writes", []).append(buffer_ph[spec.target])


def _convert(ep: torch.export.ExportedProgram, model: torch.nn.Module, args: tuple, kwargs: dict,
             basic_blocks: Sequence[str], graph: torch.fx.Graph | None = None) -> OpGraph:
    """OpGraph of ``ep``, or of ``graph`` (``ep.graph`` rewritten with the same placeholders)."""
    from torch.export.graph_signature import OutputKind

    graph = ep.graph if graph is None else graph
    placeholder_to_param, params, user_inputs = _param_table(model, ep)
    paths = _input_paths(args, kwargs)
    if len(paths) != len(user_inputs):
        paths = [f"input[{i}]" for i in range(len(user_inputs))]
    # The output node's arguments line up with the signature's output specs; read the
    # names from the node, since a rewritten graph may have renamed an output value.
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],)
    specs = ep.graph_signature.output_specs
    if len(flat) == len(specs):
        user_outputs = [a.name for a, s in zip(flat, specs)
                        if s.kind == OutputKind.USER_OUTPUT and isinstance(a, torch.fx.Node)]
    else:
        user_outputs = [s.arg.name for s in specs if s.kind == OutputKind.USER_OUTPUT and hasattr(s.arg, "name")]
    return build_opgraph(list(graph.nodes), placeholder_to_param, params,
                         [(ph, const, paths[i]) for i, (ph, const) in enumerate(user_inputs)],
                         user_outputs, basic_blocks)


def instr_target(node: torch.fx.Node) -> str:
    """The instruction target of a computing fx node (``call_function`` or ``call_method``)."""
    if node.op == "call_method":
        return f"method:{node.target}"
    return target_name(node.target)


def build_opgraph(fx_nodes: Sequence[torch.fx.Node], placeholder_to_param: dict[str, str],
                  params: dict[str, ParamInfo], user_inputs: Sequence[tuple[str, Any, str]],
                  user_outputs: Sequence[str], basic_blocks: Sequence[str]) -> OpGraph:
    """Turn an fx graph whose nodes carry ``meta['val']`` into an OpGraph.

    Shared by the torch.export path (:func:`_convert`) and the torch.fx fallback
    (:mod:`ftcompile.trace_fx`). ``fx_nodes`` are in graph order; every
    ``call_function``/``call_method`` node becomes an instruction. Nodes named in
    ``placeholder_to_param`` (placeholders of lifted parameters, ``get_attr``
    nodes) are read as ``{"param": canonical name}``; ``params`` is updated with
    the users of each. ``user_inputs`` are ``(placeholder name, constant value or
    None, call path)`` in call order, ``user_outputs`` the names of the flattened
    outputs.
    """
    user_outputs = list(user_outputs)
    # A getitem on a multi-output operator is folded into that operator's instruction.
    folded: dict[str, tuple[str, int]] = {}
    for n in fx_nodes:
        if (n.op == "call_function" and n.target is operator.getitem
                and isinstance(n.args[0], torch.fx.Node)
                and isinstance(n.args[0].meta.get("val"), (tuple, list))
                and isinstance(n.args[1], int)):
            folded[n.name] = (n.args[0].name, int(n.args[1]))

    def enc(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a.name in placeholder_to_param:
                return {"param": placeholder_to_param[a.name]}
            return {"ref": a.name}
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        if isinstance(a, dict):
            return {"dict": {str(k): enc(v) for k, v in a.items()}}
        return encode_literal(a)

    # ---- instructions, one per fx node that computes something
    instrs: dict[str, Instr] = {}
    order: list[str] = []
    scopes: dict[str, list[list[str]]] = {}
    blocks = set(basic_blocks)
    group_of: dict[str, tuple] = {}
    found_blocks: set[str] = set()
    all_classes: set[str] = set()
    for n in fx_nodes:
        if n.op not in ("call_function", "call_method") or n.name in folded:
            continue
        tname = instr_target(n)
        if tname in _DROPPED_TARGETS:
            continue
        val = n.meta.get("val")
        kwargs = dict(n.kwargs)
        if tname in _ZEROED_TARGETS and (tname != "aten.empty.memory_format"
                                         or kwargs.get("memory_format") in (None, torch.contiguous_format)):
            tname = _ZEROED_TARGETS[tname]
            if tname == "aten.zeros.default":
                kwargs.pop("memory_format", None)       # zeros are contiguous
        ins = Instr(name=n.name, target=tname, args=enc(list(n.args)),
                    kwargs={k: enc(v) for k, v in kwargs.items()})
        if isinstance(val, (tuple, list)):
            ins.out = None
        else:
            ins.out = value_meta(val)
        for ph in n.meta.get("ftc_writes", ()):
            ins.writes[n.name] = placeholder_to_param[ph]
        sc = _module_scopes(n)
        ins.scope = sc[-1][0] if sc else ""
        scopes[n.name] = sc
        for _path, cls in sc:
            all_classes.add(cls.rsplit(".", 1)[-1])
        instrs[n.name] = ins
        order.append(n.name)
        bk = _block_key(n, blocks) if blocks else None
        if bk is not None:
            found_blocks.add(bk[2])
            group_of[n.name] = ("block",) + bk
        else:
            group_of[n.name] = ("op", n.name)
    by_name = {x.name: x for x in fx_nodes}
    for name, (src, idx) in folded.items():
        if src in instrs:
            instrs[src].unpack[idx] = name
            instrs[src].unpack_meta[idx] = value_meta(by_name[name].meta.get("val"))
            for ph in by_name[name].meta.get("ftc_writes", ()):
                instrs[src].writes[name] = placeholder_to_param[ph]

    # One list of block classes serves several models (T5Block,GPT2Block): classes this
    # model never calls are skipped and reported; only a list that matches nothing is an error.
    absent = [b for b in basic_blocks if b not in found_blocks]
    if blocks and not found_blocks:
        raise TraceError(
            f"--basic-blocks names module class(es) {sorted(blocks)} that the model never calls; "
            f"module classes in this model: {', '.join(sorted(all_classes))}")
    used_blocks = [b for b in dict.fromkeys(basic_blocks) if b in found_blocks]

    # ---- value -> instruction that makes it
    made_by: dict[str, str] = {}
    for name, ins in instrs.items():
        for v in ins.produced():
            made_by[v] = name

    # ---- groups (nodes) and their order: a quotient graph, sorted topologically
    groups: dict[tuple, list[str]] = {}
    for name in order:
        groups.setdefault(group_of[name], []).append(name)

    import networkx as nx

    q = nx.DiGraph()
    first_index = {}
    for gi, (key, members) in enumerate(groups.items()):
        q.add_node(key)
        first_index[key] = gi
    for key, members in groups.items():
        for m in members:
            for ref in iter_refs(instrs[m].args, instrs[m].kwargs):
                src = made_by.get(ref)
                if src is not None and group_of[src] != key:
                    q.add_edge(group_of[src], key)
    try:
        topo = list(nx.lexicographical_topological_sort(q, key=lambda k: first_index[k]))
    except nx.NetworkXUnfeasible:
        cyc = nx.find_cycle(q)
        raise TraceError(
            "merging basic blocks creates a cycle between "
            + " and ".join(sorted({str(k[2]) if k[0] == 'block' else k[1] for e in cyc for k in e[:2]}))
            + "; choose a coarser or finer --basic-blocks class") from None

    # ---- build nodes
    nodes: list[Node] = []
    node_of_value: dict[str, int] = {}
    consumed_by_outputs = set(user_outputs)

    inputs_meta = []
    ph_nodes = {n.name: n for n in fx_nodes if n.op == "placeholder"}
    for ph, const, path in user_inputs:
        val = ph_nodes[ph].meta.get("val") if ph in ph_nodes else None
        if not isinstance(val, torch.Tensor):
            # A non-tensor input (use_cache=False) was specialised into the graph.
            inputs_meta.append({"node": None, "value": ph, "path": path,
                                "constant": encode_literal(const) if const is not None else None})
            continue
        nid = len(nodes)
        nodes.append(Node(id=nid, name=ph, kind="input", outputs={ph: value_meta(val)}))
        node_of_value[ph] = nid
        inputs_meta.append({"node": nid, "value": ph, "path": path})

    # which values leave each group
    reads_outside: dict[str, set[tuple]] = defaultdict(set)
    for key, members in groups.items():
        for m in members:
            for ref in iter_refs(instrs[m].args, instrs[m].kwargs):
                reads_outside[ref].add(key)

    for key in topo:
        members = groups[key]
        nid = len(nodes)
        first = members[0]
        if key[0] == "block":
            _, _stack_key, path, cls = key
            sc = scopes[first]
            depth = next((i for i, (p, _c) in enumerate(sc) if p == path), len(sc) - 1)
            node_scopes = sc[: depth + 1]
            name = path.replace(".", "_") or cls
            scope, scope_class = path, cls
        else:
            node_scopes = scopes[first]
            name = first
            scope = node_scopes[-1][0] if node_scopes else ""
            scope_class = node_scopes[-1][1].rsplit(".", 1)[-1] if node_scopes else ""
        node_instrs = [instrs[m] for m in members]
        outputs: dict[str, ValueMeta] = {}
        for ins in node_instrs:
            for v, meta in ins.produced().items():
                if (reads_outside.get(v, set()) - {key}) or v in consumed_by_outputs:
                    outputs[v] = meta if meta is not None else ValueMeta(literal=None)
        # a node holds what it reads and the buffers it writes (the stage that runs it updates them)
        used = sorted({p for ins in node_instrs for p in [*iter_params(ins.args, ins.kwargs), *ins.writes.values()]})
        node = Node(id=nid, name=name, kind="op", instrs=node_instrs, scope=scope,
                    scope_class=scope_class, scopes=node_scopes, params=used, outputs=outputs)
        nodes.append(node)
        for v in outputs:
            node_of_value[v] = nid
        for p in used:
            params[p].users.append(nid)

    out_id = len(nodes)
    out_node = Node(id=out_id, name="output", kind="output")
    nodes.append(out_node)

    # ---- edges
    edges: list[Edge] = []
    seen: set[tuple[int, int, str]] = set()
    for node in nodes:
        if node.kind == "op":
            refs = [r for ins in node.instrs for r in iter_refs(ins.args, ins.kwargs)]
            local = {v for ins in node.instrs for v in [ins.name, *ins.unpack.values()]}
            refs = [r for r in refs if r not in local]
        elif node.kind == "output":
            refs = [r for r in user_outputs if r in node_of_value]
        else:
            refs = []
        for r in refs:
            src = node_of_value.get(r)
            if src is None:
                raise GraphError(f"value {r!r} read by {node.name} has no producer")
            k = (src, node.id, r)
            if k not in seen:
                seen.add(k)
                edges.append(Edge(src, node.id, r, nodes[src].outputs[r]))

    # ---- loss: the first scalar floating-point output
    loss = None
    for v in user_outputs:
        nid = node_of_value.get(v)
        if nid is None:
            continue
        meta = nodes[nid].outputs[v]
        if meta.tensor is not None and meta.tensor.shape == () and meta.tensor.is_floating:
            loss = v
            nodes[nid].is_loss = True
            break

    # Parameters no node reads (e.g. a pooler skipped by the forward) stay listed: they are
    # still part of the model's state, but have no users.
    graph = OpGraph(nodes=nodes, edges=edges, params=params, inputs=inputs_meta,
                    outputs=user_outputs, loss=loss,
                    granularity="layer" if used_blocks else "op", basic_blocks=used_blocks)
    if absent:
        graph.source["absent_basic_blocks"] = absent
    return graph


def trace(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *,
          basic_blocks: Sequence[str] = (), source: dict | None = None,
          progress: Callable[[str], None] | None = None, verbose: bool = False) -> OpGraph:
    """Trace ``model(*args, **kwargs)`` into a validated OpGraph.

    Parameters
    ----------
    model, args, kwargs:
        The model and example inputs; all may live on the ``meta`` device.
    basic_blocks:
        Module class names whose calls become single nodes (layer granularity).
        Classes the model never calls are skipped (and listed in
        ``graph.source["absent_basic_blocks"]``); none matching is an error.
    source:
        Free-form provenance (model name, options) stored in the graph.
    progress:
        Called with a short phase name as tracing advances.
    verbose:
        Let torch's tracing chatter through (``ftcompile --debug``): symbolic-shape
        logs, User/Future/Deprecation warnings and the partial graph torch.export
        prints when it fails. By default they are silenced for the duration of the call.
    """
    with quiet_tracing(not verbose):
        args, kwargs, aliased = separate_aliased_inputs(tuple(args), dict(kwargs or {}))
        graph = _trace(model, args, kwargs, basic_blocks, source, progress or (lambda _s: None),
                       quiet=not verbose, aliased=aliased)
    if aliased:
        graph.source["aliased_inputs"] = aliased
        graph.source.setdefault("notes", []).append(
            "inputs " + "; ".join(" and ".join(group) for group in aliased) + " were one tensor in the example "
            "call; they were traced as separate inputs, so the package reads each from its own path")
    return graph


def separate_aliased_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[list[str]]]:
    """The call with every input that shares memory with an earlier one replaced by a copy.

    ``model(input_ids=ids, labels=ids)`` hands one tensor to two inputs; traced as it
    is, the graph reads one placeholder for both (the embedding would read
    ``labels``), and a package fed different tensors per input computes something
    else than the model. Separate copies trace each input where the model reads it.
    Returns the new call and the groups of aliased input paths.
    """
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from .runtime.manifest import call_leaves

    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    paths = [p for p, _ in call_leaves(args, kwargs)]
    first: dict[Any, int] = {}
    groups: dict[int, list[str]] = {}
    out = list(leaves)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            continue
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            continue
        if key in first:
            j = first[key]
            groups.setdefault(j, [paths[j]]).append(paths[i])
            out[i] = t.clone()
        else:
            first[key] = i
    if not groups:
        return args, kwargs, []
    new_args, new_kwargs = tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs), [g for _, g in sorted(groups.items())]


def _trace(model: torch.nn.Module, args: tuple, kwargs: dict, basic_blocks: Sequence[str],
           source: dict | None, note: Callable[[str], None], quiet: bool,
           aliased: list[list[str]] | None = None) -> OpGraph:
    t0 = time.perf_counter()
    tracer = "torch.export"
    note("export")
    try:
        ep = _export(model, args, kwargs, quiet=quiet)
    except TraceError as export_error:
        # The fallback keeps functions wrapped with torch.fx.wrap (a data-dependent input check)
        # as opaque nodes, so a model export refuses for a branch on data may still trace.
        note("symbolic_trace")
        from .trace_fx import trace_fx

        try:
            graph = trace_fx(model, args, kwargs, basic_blocks=basic_blocks)
        except TraceError as fx_error:
            cls = DataDependentError if isinstance(export_error, DataDependentError) else TraceError
            raise cls(f"{export_error}\n(torch.fx.symbolic_trace fallback failed too: {fx_error})") from None
        graph.source = {**(source or {}), **graph.source, "tracer": "torch.fx.symbolic_trace",
                        "export_error": str(export_error).splitlines()[0][:300]}
        graph.validate()
        return graph
    t1 = time.perf_counter()
    refuse_data_dependent(ep.graph_module)
    fx_graph = ep.graph
    notes: list[str] = []
    regions = has_regions(fx_graph)
    if regions:
        # no_grad / autocast regions (rotary and sinusoidal position code, mixed precision)
        note("regions")
        try:
            fx_graph, notes = inline_regions(ep.graph_module, _trace_device(model, args, kwargs))
        except RegionError as exc:
            raise TraceError(str(exc)) from None
    functionalized = None
    if needs_functionalization(fx_graph):
        # In-place ops would hide dependencies (a later reader of x depends on x.add_());
        # functionalization rewrites them into pure ops. The local pass handles what models
        # do and costs nothing; torch's pass re-traces the whole program.
        note("functionalize")
        kinds = _placeholder_kinds(ep)
        placeholder_to_param, _params, _inputs = _param_table(model, ep)
        aliased_paths = {p for group in (aliased or []) for p in group}
        paths = _input_paths(args, kwargs)
        for i, (ph, _const) in enumerate(_inputs):
            if i < len(paths) and paths[i] in aliased_paths:
                kinds[ph] = "aliased input"
        try:
            fx_graph = functionalize_locally(fx_graph, kinds, {**placeholder_to_param,
                                                               **{ph: paths[i] for i, (ph, _c) in enumerate(_inputs)
                                                                  if i < len(paths)}})
            functionalized = "local"
        except Refused as exc:
            raise TraceError(str(exc)) from None
        except NeedsFullFunctionalization as exc:
            if regions:
                # torch's pass would re-trace the program and lose the no-grad regions' meaning
                raise TraceError(f"the model mutates a tensor in a way ftcompile cannot rewrite ({exc}) and has "
                                 "no_grad/autocast regions, which torch's own functionalization would drop; "
                                 "write that operation out of place. " + REMEDIES) from None
            ep = ep.run_decompositions({})
            fx_graph = ep.graph
            _signature_writes(ep, fx_graph)
            functionalized = "run_decompositions"
    t2 = time.perf_counter()
    note("convert")
    graph = _convert(ep, model, args, kwargs, basic_blocks, fx_graph)
    t3 = time.perf_counter()
    graph.source = {**(source or {}), **graph.source, "tracer": tracer,
                    "timings_s": {"export": round(t1 - t0, 3), "functionalize": round(t2 - t1, 3),
                                  "convert": round(t3 - t2, 3)}}
    if functionalized:
        graph.source["functionalized"] = functionalized
    if notes:
        graph.source.setdefault("notes", []).extend(notes)
    ops = custom_ops(graph)
    if ops:
        graph.source["custom_ops"] = ops
    graph.validate()
    return graph


def custom_ops(graph: OpGraph) -> dict[str, str | None]:
    """Target name -> the module registering it, for every operator ``graph`` calls outside PyTorch's
    own namespaces (:func:`~ftcompile.execute.custom_op`). Generated stages import those modules, and
    a process reading the graph from a file imports them before running it
    (:func:`~ftcompile.execute.import_custom_ops`); None: no importable module registers it."""
    from .execute import custom_op, registering_module

    out: dict[str, str | None] = {}
    for node in graph.nodes:
        for ins in node.instrs:
            if ins.target not in out:
                op = custom_op(ins.target)
                if op is not None:
                    out[ins.target] = registering_module(op)
    return out


def _trace_device(model: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """The device type the model was traced on (its first tensor's)."""
    from torch.utils._pytree import tree_leaves

    for t in [*model.parameters(), *model.buffers(), *tree_leaves((args, kwargs))]:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"
