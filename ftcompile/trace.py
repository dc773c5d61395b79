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

import operator
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .ir import (
    Edge, GraphError, Instr, Node, OpGraph, ParamInfo, TensorMeta, ValueMeta,
    encode_literal, iter_params, iter_refs,
)


class TraceError(RuntimeError):
    """The model could not be traced; the message names where and suggests a remedy."""


# Operators that only check metadata at trace time; they carry no data and would
# pin otherwise movable nodes, so the OpGraph drops them.
_DROPPED_TARGETS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
}

REMEDIES = (
    "Remedies: call the model with use_cache=False; build HuggingFace models with "
    "attn_implementation='eager'; keep the failing module whole with --basic-blocks CLASS; "
    "or move data-dependent Python control flow (if tensor.item() ...) out of forward."
)


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
    """Metadata for the ``meta['val']`` of an fx node (a FakeTensor, a number, None...)."""
    if isinstance(val, torch.Tensor):
        return ValueMeta(tensor=TensorMeta(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch.")))
    if isinstance(val, torch.SymInt):
        return ValueMeta(literal=int(val))
    try:
        return ValueMeta(literal=encode_literal(val))
    except TypeError:
        return ValueMeta(literal=None)


def _is_mutating(node: torch.fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


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

def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """``torch.export`` in non-strict mode, turning failures into a TraceError naming the module."""
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
    try:
        return torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception as exc:  # noqa: BLE001 - any tracer failure becomes a user-facing message
        where = active[-1] if active else "the model's forward"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"torch.export could not trace the model in module {where}: "
                         f"{type(exc).__name__}: {first[:400]}. " + REMEDIES) from exc
    finally:
        for h in handles:
            h.remove()


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
    from torch.utils._pytree import keystr, tree_flatten_with_path

    leaves, _ = tree_flatten_with_path((tuple(args), dict(kwargs)))
    out = []
    for path, _leaf in leaves:
        s = keystr(path)  # e.g. "[0][1]" or "[1]['input_ids']"
        if s.startswith("[0]"):
            out.append("args" + s[3:])
        elif s.startswith("[1]"):
            out.append("kwargs" + s[3:])
        else:
            out.append(s)
    return out


# --------------------------------------------------------------------------- conversion

def _convert(ep: torch.export.ExportedProgram, model: torch.nn.Module, args: tuple, kwargs: dict,
             basic_blocks: Sequence[str]) -> OpGraph:
    from torch.export.graph_signature import OutputKind

    placeholder_to_param, params, user_inputs = _param_table(model, ep)
    paths = _input_paths(args, kwargs)
    if len(paths) != len(user_inputs):
        paths = [f"input[{i}]" for i in range(len(user_inputs))]
    user_outputs = [s.arg.name for s in ep.graph_signature.output_specs
                    if s.kind == OutputKind.USER_OUTPUT and hasattr(s.arg, "name")]
    return build_opgraph(list(ep.graph.nodes), placeholder_to_param, params,
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
        ins = Instr(name=n.name, target=tname, args=enc(list(n.args)),
                    kwargs={k: enc(v) for k, v in n.kwargs.items()})
        if isinstance(val, (tuple, list)):
            ins.out = None
        else:
            ins.out = value_meta(val)
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
    for name, (src, idx) in folded.items():
        if src in instrs:
            fxn = next(x for x in fx_nodes if x.name == name)
            instrs[src].unpack[idx] = name
            instrs[src].unpack_meta[idx] = value_meta(fxn.meta.get("val"))

    missing = blocks - found_blocks
    if missing:
        raise TraceError(
            f"--basic-blocks names module class(es) {sorted(missing)} that the model never calls; "
            f"module classes in this model: {', '.join(sorted(all_classes))}")

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
        used = sorted({p for ins in node_instrs for p in iter_params(ins.args, ins.kwargs)})
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
    return OpGraph(nodes=nodes, edges=edges, params=params, inputs=inputs_meta,
                   outputs=user_outputs, loss=loss,
                   granularity="layer" if basic_blocks else "op", basic_blocks=list(basic_blocks))


def trace(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *,
          basic_blocks: Sequence[str] = (), source: dict | None = None,
          progress: Callable[[str], None] | None = None) -> OpGraph:
    """Trace ``model(*args, **kwargs)`` into a validated OpGraph.

    Parameters
    ----------
    model, args, kwargs:
        The model and example inputs; all may live on the ``meta`` device.
    basic_blocks:
        Module class names whose calls become single nodes (layer granularity).
    source:
        Free-form provenance (model name, options) stored in the graph.
    progress:
        Called with a short phase name as tracing advances.
    """
    kwargs = dict(kwargs or {})
    note = progress or (lambda _s: None)
    t0 = time.perf_counter()
    tracer = "torch.export"
    note("export")
    try:
        ep = _export(model, args, kwargs)
    except TraceError as export_error:
        note("symbolic_trace")
        from .trace_fx import trace_fx

        try:
            graph = trace_fx(model, args, kwargs, basic_blocks=basic_blocks)
        except TraceError as fx_error:
            raise TraceError(f"{export_error}\n(torch.fx.symbolic_trace fallback failed too: {fx_error})") from None
        graph.source = {**(source or {}), "tracer": "torch.fx.symbolic_trace",
                        "export_error": str(export_error).splitlines()[0][:300]}
        graph.validate()
        return graph
    t1 = time.perf_counter()
    if any(_is_mutating(n) for n in ep.graph.nodes if n.op == "call_function"):
        # In-place ops would hide dependencies (a later reader of x depends on x.add_());
        # functionalization rewrites them into pure ops.
        note("functionalize")
        ep = ep.run_decompositions({})
    t2 = time.perf_counter()
    note("convert")
    graph = _convert(ep, model, args, kwargs, basic_blocks)
    t3 = time.perf_counter()
    graph.source = {**(source or {}), "tracer": tracer,
                    "timings_s": {"export": round(t1 - t0, 3), "functionalize": round(t2 - t1, 3),
                                  "convert": round(t3 - t2, 3)}}
    graph.validate()
    return graph
