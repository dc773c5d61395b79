"""The ``torch.fx.symbolic_trace`` fallback of :func:`ftcompile.trace.trace`.

Used when ``torch.export`` cannot capture a model, e.g. when ``forward`` calls a
function registered with :func:`torch.fx.wrap` that ``torch.export`` would have to
trace into (data-dependent input checks and the like). ``symbolic_trace`` records
Python-level calls instead of ATen operators, so the resulting OpGraph holds
``torch.nn.functional.linear``, ``operator.add``, ``method:view`` and similar
instructions; otherwise it is the same IR as the export path produces and goes
through the same builder (:func:`ftcompile.trace.build_opgraph`).

Steps:

1. symbolic tracing, with every non-tensor argument of ``forward`` (given or
   default) made concrete and only tensor arguments left as placeholders;
2. standard leaf modules (``nn.Linear``, ``nn.LayerNorm``, ...) are rewritten into
   their ``torch.nn.functional`` calls reading the module's parameters; any other
   leaf module is refused;
3. in-place operations are rewritten out of place where nothing reads the
   overwritten value afterwards (otherwise refused), so that every edge is a true
   dependency;
4. shape propagation on ``meta`` copies of the inputs and weights (on the real
   tensors when a node cannot run on ``meta`` and the model has real weights);
5. non-tensor values (``x.shape``, ``x.size(0)``) are specialised into constants,
   as ``torch.export`` does with static shapes, and tuple values are unpacked.
"""

from __future__ import annotations

import inspect
import operator
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.node import map_arg

from .execute import resolve_target
from .ir import OpGraph, ParamInfo, encode_literal
from .trace import TraceError, build_opgraph, instr_target, value_meta

__all__ = ["trace_fx", "index"]

FX_REMEDIES = (
    "Remedies: make the failing code traceable by torch.export (preferred), register helper "
    "functions that cannot be traced with torch.fx.wrap at module level, or keep tensor inputs as "
    "direct arguments of forward."
)


def index(x: Any, *idx: Any) -> Any:
    """``x[idx]`` with a tuple index; the string ``"..."`` stands for ``Ellipsis``.

    Instructions encode tuples as lists, and ``x[(0, 1)]`` differs from ``x[[0, 1]]``
    for tensors, so multi-dimensional indexing goes through this helper.
    """
    return x[tuple(Ellipsis if (isinstance(i, str) and i == "...") else i for i in idx)]


# --------------------------------------------------------------------------- leaf modules

def _module_rule(m: nn.Module) -> Callable | None:
    """How a standard leaf module call becomes a functional call.

    A rule takes ``(module, x, param)`` where ``param(attr)`` returns a ``get_attr``
    node for a tensor attribute of the module (or None when it is None), and returns
    ``(function, args, kwargs)``, or the string ``"identity"``.
    """
    t = type(m)
    if t is nn.Linear:
        return lambda m, x, p: (F.linear, (x, p("weight"), p("bias")), {})
    if t in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        fn = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}[t]

        def conv(m, x, p):
            if m.padding_mode != "zeros":
                raise TraceError(f"{t.__name__} with padding_mode={m.padding_mode!r} is not supported by the "
                                 "torch.fx fallback")
            return fn, (x, p("weight"), p("bias"), m.stride, m.padding, m.dilation, m.groups), {}
        return conv
    if t is nn.LayerNorm:
        return lambda m, x, p: (F.layer_norm, (x, tuple(m.normalized_shape), p("weight"), p("bias"), m.eps), {})
    if t is nn.GroupNorm:
        return lambda m, x, p: (F.group_norm, (x, m.num_groups, p("weight"), p("bias"), m.eps), {})
    if t is nn.Embedding:
        return lambda m, x, p: (F.embedding, (x, p("weight"), m.padding_idx, m.max_norm, m.norm_type,
                                              m.scale_grad_by_freq, m.sparse), {})
    if t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        def bn(m, x, p):
            if m.training and m.track_running_stats:
                raise TraceError(f"{t.__name__} in training mode updates its running statistics in place, "
                                 "which the torch.fx fallback cannot express; trace in eval mode or use LayerNorm")
            use_batch_stats = m.training or m.running_mean is None
            return F.batch_norm, (x, p("running_mean"), p("running_var"), p("weight"), p("bias"),
                                  use_batch_stats, 0.0 if m.momentum is None else m.momentum, m.eps), {}
        return bn
    if t in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout):
        fn = {nn.Dropout: F.dropout, nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d,
              nn.Dropout3d: F.dropout3d, nn.AlphaDropout: F.alpha_dropout}[t]
        return lambda m, x, p: (fn, (x, m.p, m.training), {"inplace": m.inplace} if m.inplace else {})
    if t is nn.ReLU:
        return lambda m, x, p: (F.relu, (x,), {"inplace": True} if m.inplace else {})
    if t is nn.ReLU6:
        return lambda m, x, p: (F.relu6, (x,), {"inplace": True} if m.inplace else {})
    if t is nn.LeakyReLU:
        return lambda m, x, p: (F.leaky_relu, (x, m.negative_slope), {"inplace": True} if m.inplace else {})
    if t is nn.SiLU:
        return lambda m, x, p: (F.silu, (x,), {"inplace": True} if m.inplace else {})
    if t is nn.GELU:
        return lambda m, x, p: (F.gelu, (x,), {"approximate": m.approximate})
    if t is nn.Tanh:
        return lambda m, x, p: (torch.tanh, (x,), {})
    if t is nn.Sigmoid:
        return lambda m, x, p: (torch.sigmoid, (x,), {})
    if t is nn.Softmax:
        return lambda m, x, p: (F.softmax, (x, m.dim), {})
    if t is nn.LogSoftmax:
        return lambda m, x, p: (F.log_softmax, (x, m.dim), {})
    if t is nn.Flatten:
        return lambda m, x, p: (torch.flatten, (x, m.start_dim, m.end_dim), {})
    if t is nn.Identity:
        return lambda m, x, p: "identity"
    return None


class _Tracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that treats the modules it can rewrite as leaves and remembers where it failed."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _module_rule(m) is not None or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        try:
            path = self.path_of_module(m)
        except NameError:
            path = "?"
        self.stack.append((path or "<root>", type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.stack[-1]
            raise
        finally:
            self.stack.pop()


# --------------------------------------------------------------------------- inputs

def _split_inputs(model: nn.Module, args: tuple, kwargs: dict):
    """Decide which forward arguments become placeholders (tensors) and which are concrete."""
    from torch.utils._pytree import tree_flatten_with_path

    from .runtime.manifest import input_path

    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"the example inputs do not match {type(model).__name__}.forward: {exc}") from None
    tensor_args: dict[str, torch.Tensor] = {}
    concrete: dict[str, Any] = {}
    for name, param in sig.parameters.items():
        given = name in bound.arguments
        value = bound.arguments.get(name)
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TraceError(f"{type(model).__name__}.forward takes *{name}, which the torch.fx fallback "
                                 "cannot trace; pass the inputs as named arguments. " + FX_REMEDIES)
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            if value:
                raise TraceError(f"inputs {sorted(value)} reach {type(model).__name__}.forward through **{name}, "
                                 "which the torch.fx fallback cannot trace. " + FX_REMEDIES)
            continue
        if given and isinstance(value, torch.Tensor):
            tensor_args[name] = value
        elif given:
            leaves = [x for x in tree_flatten_with_path(value)[0] if isinstance(x[1], torch.Tensor)]
            if leaves:
                raise TraceError(f"input {name!r} holds tensors inside a {type(value).__name__}; the torch.fx "
                                 "fallback takes tensors only as direct arguments of forward. " + FX_REMEDIES)
            concrete[name] = value
        elif param.default is not inspect.Parameter.empty:
            concrete[name] = param.default

    # User inputs in the order and with the paths the export path uses.
    positional = [n for n, p in sig.parameters.items()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    user_inputs: list[tuple[str, Any, str]] = []
    for path, leaf in tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        p = input_path(path)
        if isinstance(leaf, torch.Tensor):
            top = path[1]
            name = positional[top.idx] if hasattr(top, "idx") else top.key
            user_inputs.append((name, None, p))
        else:
            vname = "".join(c if c.isalnum() else "_" for c in p.split("[", 1)[-1]).strip("_") or "const"
            user_inputs.append((f"const_{vname}", leaf, p))
    return tensor_args, concrete, user_inputs


# --------------------------------------------------------------------------- graph passes

def _scope_of(n: torch.fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _where(n: torch.fx.Node) -> str:
    scope = _scope_of(n)
    return f"node {n.name} ({n.op} {n.target})" + (f" in module {scope}" if scope else "")


def _remove_concrete_placeholders(graph: torch.fx.Graph, tensor_names: set[str]) -> None:
    """Drop the placeholders of specialised (concrete) arguments and the guards fx adds for them."""
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n.target not in tensor_names]:
        doomed: list[torch.fx.Node] = []
        todo = [ph]
        while todo:
            n = todo.pop()
            if n in doomed:
                continue
            doomed.append(n)
            todo.extend(n.users)
        for n in doomed:
            if n is not ph and n.op == "output":
                raise TraceError(f"forward returns its argument {ph.target!r}, which is not a tensor")
        bad = [n for n in doomed if n is not ph and n.target not in (
            torch._assert, torch.fx._symbolic_trace._assert_is_none, operator.eq)]
        if bad:
            raise TraceError(f"forward reads argument {str(ph.target).lstrip('*')!r} symbolically ({_where(bad[0])}) "
                             "but it has no tensor value; pass it as a tensor. " + FX_REMEDIES)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(doomed, key=lambda n: -order[n]):
            graph.erase_node(n)


def _rewrite_leaf_modules(graph: torch.fx.Graph, model: nn.Module) -> None:
    for n in list(graph.nodes):
        if n.op != "call_module":
            continue
        m = model.get_submodule(n.target)
        rule = _module_rule(m)
        if rule is None:
            raise TraceError(
                f"module {n.target} ({type(m).__module__}.{type(m).__qualname__}) is a leaf that the torch.fx "
                "fallback cannot rewrite into functional calls. " + FX_REMEDIES)
        if len(n.args) != 1 or n.kwargs:
            raise TraceError(f"module {n.target} ({type(m).__name__}) is called with {len(n.args)} positional and "
                             f"{len(n.kwargs)} keyword arguments; the torch.fx fallback handles one input")
        x = n.args[0]
        with graph.inserting_before(n):
            def param(attr: str, _path=n.target, _m=m, _n=n):
                if getattr(_m, attr, None) is None:
                    return None
                g = graph.get_attr(f"{_path}.{attr}")
                g.meta["nn_module_stack"] = dict(_n.meta.get("nn_module_stack") or {})
                return g

            made = rule(m, x, param)
            if made == "identity":
                n.replace_all_uses_with(x)
                graph.erase_node(n)
                continue
            fn, args, kwargs = made
            new = graph.call_function(fn, tuple(args), dict(kwargs))
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)


def _out_of_place(n: torch.fx.Node) -> tuple[str, Any] | None:
    """For an in-place operation, the out-of-place replacement ``(op, target)``; None if not in place."""
    if n.op == "call_method":
        name = str(n.target)
        if name in ("__setitem__",):
            raise TraceError(f"item assignment x[...] = v at {_where(n)} mutates a tensor in place, which the "
                             "torch.fx fallback cannot functionalize; use torch.where / masked_fill. " + FX_REMEDIES)
        if name.endswith("_") and not name.endswith("__"):
            if name == "requires_grad_":
                return None
            base = name[:-1]
            if not hasattr(torch.Tensor, base):
                raise TraceError(f"in-place Tensor.{name} at {_where(n)} has no out-of-place form; "
                                 "rewrite it without in-place operations. " + FX_REMEDIES)
            return ("call_method", base)
        return None
    if n.op == "call_function":
        if n.target is operator.setitem:
            raise TraceError(f"item assignment x[...] = v at {_where(n)} mutates a tensor in place, which the "
                             "torch.fx fallback cannot functionalize; use torch.where / masked_fill. " + FX_REMEDIES)
        if n.kwargs.get("inplace") is True:
            return ("call_function", n.target)
        name = getattr(n.target, "__name__", "")
        mod = getattr(n.target, "__module__", "") or ""
        if (name.endswith("_") and not name.endswith("__") and mod.startswith("torch")
                and isinstance(n.args[0] if n.args else None, torch.fx.Node)):
            for ns in (torch, F, torch.special):
                base = getattr(ns, name[:-1], None)
                if base is not None and getattr(ns, name, None) is n.target:
                    return ("call_function", base)
    return None


_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
    "expand_as", "narrow", "select", "flatten", "unflatten", "contiguous", "unfold", "split", "chunk",
    "unbind", "movedim", "swapaxes", "detach", "as_strided", "diagonal", "__getitem__", "to", "type_as",
}


def _functionalize(graph: torch.fx.Graph) -> None:
    """Rewrite in-place operations out of place; refuse those whose overwritten value is read later."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    # alias groups: a node and the views taken of it share storage
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(x):
        while parent.get(x, x) is not x:
            x = parent[x]
        return x

    for n in graph.nodes:
        is_view = ((n.op == "call_method" and n.target in _VIEW_METHODS)
                   or (n.op == "call_function" and n.target in (operator.getitem, torch.flatten, torch.reshape,
                                                                torch.transpose, torch.squeeze, torch.unsqueeze,
                                                                torch.split, torch.chunk)))
        if is_view and n.args and isinstance(n.args[0], torch.fx.Node):
            parent[find(n)] = find(n.args[0])
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        groups[find(n)].append(n)

    for n in list(graph.nodes):
        repl = _out_of_place(n)
        if repl is None:
            continue
        target = n.args[0] if n.args else None
        if not isinstance(target, torch.fx.Node):
            continue
        if target.op == "get_attr":
            raise TraceError(f"{_where(n)} changes parameter/buffer {target.target} in place, which the torch.fx "
                             "fallback cannot express. " + FX_REMEDIES)
        for alias in groups[find(target)]:
            later = [u for u in alias.users if u is not n and order[u] > order[n]]
            if later:
                raise TraceError(
                    f"in-place {n.target} at {_where(n)} overwrites a value that {later[0].name} reads afterwards; "
                    "the torch.fx fallback can only rewrite in-place operations whose result replaces the old "
                    "value (x = x.add_(y), x += y, ReLU(inplace=True)); use the out-of-place form. " + FX_REMEDIES)
        op, tgt = repl
        n.op, n.target = op, tgt
        if "inplace" in n.kwargs:
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "inplace"}


def _materialize(x: Any, to: str | None) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.to("meta") if to == "meta" else x
    return x


def _propagate(graph: torch.fx.Graph, attrs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
               on_meta: bool) -> None:
    """Run the graph once, storing every node's result in ``meta['val']``."""
    env: dict[torch.fx.Node, Any] = {}
    dev = "meta" if on_meta else None

    def load(a):
        return map_arg(a, lambda x: env[x])

    with torch.no_grad():
        for n in graph.nodes:
            if n.op == "placeholder":
                v = _materialize(inputs[n.target], dev)
            elif n.op == "get_attr":
                v = _materialize(attrs[n.target], dev)
            elif n.op == "call_function":
                v = n.target(*load(n.args), **load(n.kwargs))
            elif n.op == "call_method":
                self_, *rest = load(n.args)
                v = getattr(self_, n.target)(*rest, **load(n.kwargs))
            elif n.op == "output":
                continue
            else:
                raise TraceError(f"unexpected fx node kind {n.op} at {_where(n)}")
            env[n] = v
            n.meta["val"] = v


def _has_tensor(x: Any) -> bool:
    from torch.utils._pytree import tree_flatten

    try:
        return any(isinstance(t, torch.Tensor) for t in tree_flatten(x)[0])
    except Exception:  # noqa: BLE001
        return True


def _replace_uses(n: torch.fx.Node, value: Any) -> None:
    for u in list(n.users):
        u.args = map_arg(u.args, lambda a: value if a is n else a)
        u.kwargs = map_arg(u.kwargs, lambda a: value if a is n else a)


def _swap_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.device) and x.type == "meta":
        return device
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_swap_device(v, device) for v in x) if not isinstance(x, torch.Size) else x
    return x


def _restructure(graph: torch.fx.Graph, fold_constants: bool, device: torch.device) -> None:
    """Specialise non-tensor values into constants, unpack tuple values, route tuple indexing through :func:`index`."""
    for n in list(graph.nodes):
        if n.op not in ("call_function", "call_method"):
            continue
        val = n.meta.get("val")
        if fold_constants and not n.meta.get("is_wrapped") and not _has_tensor(val):
            lit = _swap_device(val, device)
            try:
                encode_literal(lit)
            except TypeError:
                pass
            else:
                _replace_uses(n, lit)
                graph.erase_node(n)
                continue
        # t[(i, j)] / t[..., k]: a tuple index on a tensor
        if (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)
                and isinstance(n.args[0].meta.get("val"), torch.Tensor) and isinstance(n.args[1], tuple)):
            idx = tuple("..." if i is Ellipsis else i for i in n.args[1])
            n.target = index
            n.args = (n.args[0], *idx)
        elif (n.op == "call_function" and n.target is operator.getitem and n.args[1] is Ellipsis):
            n.target = index
            n.args = (n.args[0], "...")
        if isinstance(val, (tuple, list)):
            others = []
            for u in list(n.users):
                if u.op == "call_function" and u.target is operator.getitem and u.args[0] is n \
                        and isinstance(u.args[1], int):
                    continue
                if (u.op == "call_function" and u.target is getattr and u.args[0] is n
                        and isinstance(u.args[1], str)):
                    # a named field of a namedtuple / torch.return_types value: an index into it
                    item = getattr(val, u.args[1], None)
                    pos = next((i for i, v in enumerate(val) if v is item), None) if item is not None else None
                    if pos is not None:
                        u.target, u.args = operator.getitem, (n, pos)
                        continue
                others.append(u)
            if others:
                items = []
                with graph.inserting_after(n):
                    for i in reversed(range(len(val))):
                        g = graph.call_function(operator.getitem, (n, i))
                        g.meta["val"] = val[i]
                        if "nn_module_stack" in n.meta:
                            g.meta["nn_module_stack"] = n.meta["nn_module_stack"]
                        items.append(g)
                items.reverse()
                packed = tuple(items) if isinstance(val, tuple) else list(items)
                for u in others:
                    u.args = map_arg(u.args, lambda a: packed if a is n else a)
                    u.kwargs = map_arg(u.kwargs, lambda a: packed if a is n else a)


# --------------------------------------------------------------------------- parameters

def _param_infos(model: nn.Module, graph: torch.fx.Graph):
    """Canonical ParamInfo for every parameter, buffer and tensor constant; map get_attr nodes to them."""
    aliases: dict[int, list[str]] = defaultdict(list)
    kind_of: dict[int, str] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases[id(p)].append(name)
        kind_of.setdefault(id(p), "parameter")
        tensors[id(p)] = p
    non_persistent = {f"{mn}.{b}" if mn else b for mn, m in model.named_modules(remove_duplicate=False)
                      for b in getattr(m, "_non_persistent_buffers_set", ())}
    for name, b in model.named_buffers(remove_duplicate=False):
        aliases[id(b)].append(name)
        kind_of.setdefault(id(b), "buffer")
        tensors[id(b)] = b
    infos: dict[str, ParamInfo] = {}
    by_name: dict[str, str] = {}
    for key, names in aliases.items():
        canonical = names[0]
        t = tensors[key]
        for nm in names:
            by_name[nm] = canonical
        infos[canonical] = ParamInfo(
            name=canonical, kind=kind_of[key], meta=value_meta(t).tensor,
            aliases=[nm for nm in names if nm != canonical],
            requires_grad=bool(t.requires_grad) if kind_of[key] == "parameter" else False,
            persistent=canonical not in non_persistent,
        )
    attrs: dict[str, torch.Tensor] = {}
    get_attr_to_param: dict[str, str] = {}
    for n in graph.nodes:
        if n.op != "get_attr":
            continue
        t = _fetch_attr(model, n.target)
        if not isinstance(t, torch.Tensor):
            raise TraceError(f"forward reads attribute {n.target} of type {type(t).__name__} as a graph value")
        attrs[n.target] = t
        canonical = by_name.get(n.target)
        if canonical is None:
            # A plain tensor attribute, or a tensor constant fx lifted out of forward.
            canonical = by_name[n.target] = n.target
            info = ParamInfo(name=canonical, kind="constant", meta=value_meta(t).tensor, requires_grad=False)
            if not t.is_meta:
                if t.numel() > 65536:
                    raise TraceError(f"forward uses a large tensor constant {n.target} {tuple(t.shape)}; "
                                     "register it as a buffer instead")
                info.value = t.detach().cpu().tolist()
            infos[canonical] = info
        get_attr_to_param[n.name] = canonical
    return infos, get_attr_to_param, attrs


def _fetch_attr(model: nn.Module, qualname: str) -> Any:
    obj: Any = model
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- entry point

def trace_fx(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *,
             basic_blocks: Sequence[str] = ()) -> OpGraph:
    """Trace ``model(*args, **kwargs)`` with ``torch.fx.symbolic_trace`` into a validated OpGraph.

    Raises :class:`~ftcompile.trace.TraceError` naming the module or node where
    tracing fails, with remedies.
    """
    try:
        return _trace_fx(model, args, dict(kwargs or {}), basic_blocks)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever breaks, the caller gets a TraceError
        first = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ""
        raise TraceError(f"the torch.fx fallback failed on {type(model).__name__}: {type(exc).__name__}: "
                         f"{first}. " + FX_REMEDIES) from exc


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict, basic_blocks: Sequence[str]) -> OpGraph:
    tensor_args, concrete, user_inputs = _split_inputs(model, args, kwargs)

    tracer = _Tracer()
    added_before = set(vars(model))
    try:
        graph = tracer.trace(model, concrete_args=concrete)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tracer failure becomes a user-facing message
        where = "{} ({})".format(*tracer.failed_in) if tracer.failed_in else \
            f"<root> ({type(model).__name__}) forward"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"torch.fx.symbolic_trace could not trace the model in module {where}: "
                         f"{type(exc).__name__}: {first[:400]}. " + FX_REMEDIES) from None

    try:
        _remove_concrete_placeholders(graph, set(tensor_args))
        _rewrite_leaf_modules(graph, model)
        _functionalize(graph)
        graph.eliminate_dead_code()
        graph.lint()
        params, get_attr_to_param, attrs = _param_infos(model, graph)
    finally:
        # fx stores tensor constants it meets in forward as attributes of the model; take them back off.
        for k in set(vars(model)) - added_before:
            if k.startswith("_tensor_constant"):
                delattr(model, k)

    # ---- shape propagation: on meta (cheap, works for giant models), else on the real tensors
    real = all(not t.is_meta for t in [*attrs.values(), *tensor_args.values()])
    on_meta = True
    try:
        _propagate(graph, attrs, tensor_args, on_meta=True)
    except TraceError:
        raise
    except Exception as meta_exc:  # noqa: BLE001
        failed = next((n for n in graph.nodes if n.op != "output" and "val" not in n.meta), None)
        if not real:
            raise TraceError(f"torch.fx fallback: {_where(failed) if failed else 'a node'} cannot run on the meta "
                             f"device ({type(meta_exc).__name__}: {str(meta_exc).splitlines()[0][:300]}); build the "
                             "model with real weights (--device cpu) or make the code meta-friendly. "
                             + FX_REMEDIES) from None
        on_meta = False
        for n in graph.nodes:
            n.meta.pop("val", None)
        try:
            _propagate(graph, attrs, tensor_args, on_meta=False)
        except Exception as exc:  # noqa: BLE001
            failed = next((n for n in graph.nodes if n.op != "output" and "val" not in n.meta), None)
            raise TraceError(f"torch.fx fallback: {_where(failed) if failed else 'a node'} failed when run: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}. " + FX_REMEDIES) from None

    device = next((t.device for t in [*tensor_args.values(), *attrs.values()] if not t.is_meta),
                  torch.device("meta"))
    _restructure(graph, fold_constants=on_meta, device=device)
    graph.eliminate_dead_code()
    graph.lint()

    # ---- every target must be importable by name, so the graph runs without the model
    for n in graph.nodes:
        if n.op == "call_function":
            name = instr_target(n)
            try:
                ok = resolve_target(name) is n.target
            except (ValueError, TraceError):
                ok = False
            if not ok:
                raise TraceError(f"{_where(n)} calls {n.target!r}, which cannot be imported as {name!r}; define "
                                 "helper functions at module level (not as lambdas or closures). " + FX_REMEDIES)

    out_node = next(n for n in graph.nodes if n.op == "output")
    out_values: list[torch.fx.Node] = []
    map_arg(out_node.args, lambda x: out_values.append(x))
    user_outputs = [n.name for n in out_values if n.op != "get_attr"]
    user_outputs = list(dict.fromkeys(user_outputs))

    # get_attr nodes may have been duplicated for one tensor; all map to its canonical name
    try:
        g = build_opgraph(list(graph.nodes), get_attr_to_param, params, user_inputs, user_outputs, basic_blocks)
    except TypeError as exc:
        raise TraceError(f"torch.fx fallback: an argument cannot be recorded in the graph ({exc}). "
                         + FX_REMEDIES) from None
    g.validate()
    return g
