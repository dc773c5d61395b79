"""Grad-mode and autocast regions of an exported program, inlined with their meaning kept.

``torch.export`` captures ``with torch.no_grad():`` (and ``@torch.no_grad()`` on a
method: transformers' rotary and sinusoidal position embeddings) as the higher-order
operator ``wrap_with_set_grad_enabled``, and ``with torch.autocast(...)`` as
``wrap_with_autocast``: each calls a sub-graph. The OpGraph is straight-line ATen, so
:func:`inline_regions` copies every sub-graph into its caller and makes what the
region meant explicit in the operators themselves:

* **No-grad region.** Every floating-point tensor the region computes under
  ``no_grad`` and hands out gets an ``aten.detach`` (a stop-gradient): no gradient
  flows back through it, in the graph, in the profile and in the generated code,
  exactly as in eager PyTorch. (``ExportedProgram.run_decompositions`` also removes
  the operator, but drops the no-grad meaning: the branch would get gradients.)
* **Autocast region.** Autocast decides at dispatch time which inputs of an operator
  it casts (``linear`` and ``matmul`` to the lower precision, ``softmax`` to float32
  on some devices...). Each operator of an active region is run once on fake tensors
  under the same ``torch.autocast`` to observe the casts it makes, and those casts
  become explicit ``aten._to_copy`` operators before it. The package then computes
  in the dtypes autocast chose when the model was traced, on any device, without an
  autocast context. A region for another device type than the traced tensors' (an
  ``autocast("cuda")`` while tracing on the CPU or on ``meta``) had no effect on the
  trace, so it has none in the package either; the returned notes say so.

Other higher-order operators (``torch.cond``, ``while_loop``, ``map``) are data-
dependent control flow, which a pipeline stage cannot hold: they are refused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

_SET_GRAD = "wrap_with_set_grad_enabled"
_AUTOCAST = "wrap_with_autocast"


class RegionError(Exception):
    """A region cannot be inlined; the message names the operator and says why."""


def is_higher_order(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def has_regions(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` calls any higher-order operator."""
    return any(n.op == "call_function" and is_higher_order(n.target) for n in graph.nodes)


@dataclass(frozen=True)
class _State:
    grad: bool = True                   # grad mode of the operators being copied
    autocast: tuple | None = None       # (device type, dtype) of an active autocast region


class _CastRecorder(TorchDispatchMode):
    """Records, for each tensor the observed call received, the dtype autocast cast it to."""

    def __init__(self, watched: dict[int, Any]):
        super().__init__()
        self.watched = watched
        self.casts: dict[int, torch.dtype] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and args and id(args[0]) in self.watched \
                and isinstance(out, torch.Tensor) and id(args[0]) not in self.casts:
            self.casts[id(args[0])] = out.dtype
        return out


def _fake_like(val: torch.Tensor, device_type: str) -> torch.Tensor:
    shape = [int(s) for s in val.shape]
    try:
        stride = [int(s) for s in val.stride()]
        return torch.empty_strided(shape, stride, dtype=val.dtype, device=device_type)
    except (RuntimeError, TypeError):
        return torch.empty(shape, dtype=val.dtype, device=device_type)


def observe_autocast(target: torch._ops.OpOverload, args: tuple, kwargs: dict, device_type: str,
                     dtype: torch.dtype) -> tuple[dict[int, torch.dtype], Any]:
    """Run ``target`` once on fake tensors under ``torch.autocast(device_type, dtype)``.

    ``args``/``kwargs`` hold fx Nodes (whose ``meta['val']`` gives shape and dtype) and
    literals. Returns ``({id(node): dtype it is cast to}, fake output)``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    node_of: dict[int, torch.fx.Node] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        def fake(a):
            if isinstance(a, torch.fx.Node):
                val = a.meta.get("val")
                if isinstance(val, torch.Tensor):
                    t = _fake_like(val, device_type)
                    node_of[id(t)] = a
                    return t
                return val
            return a

        fargs = torch.fx.node.map_aggregate(args, fake)
        fkwargs = torch.fx.node.map_aggregate(kwargs, fake)
        rec = _CastRecorder(node_of)
        with torch.autocast(device_type, dtype=dtype), rec:
            out = target(*fargs, **fkwargs)
    return {id(node_of[k]): dt for k, dt in rec.casts.items()}, out


def inline_regions(gm: torch.fx.GraphModule, trace_device: str) -> tuple[torch.fx.Graph, list[str]]:
    """A copy of ``gm.graph`` with every grad-mode and autocast region inlined (see the module docstring).

    ``trace_device`` is the device type of the tensors the model was traced with
    (``cpu``, ``cuda``, ``meta``): an autocast region for another device type had
    no effect on the trace and is dropped. Returns the new graph and notes for the
    user. Raises :class:`RegionError` for other higher-order operators.
    """
    new = torch.fx.Graph()
    notes: list[str] = []
    inert: set[str] = set()
    grad_of: dict[torch.fx.Node, bool] = {}      # new node -> grad mode it was computed in

    def copy(graph: torch.fx.Graph, owner: torch.nn.Module, env: dict, state: _State, hop: torch.fx.Node | None):
        casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        for n in graph.nodes:
            if n.op == "placeholder":
                if hop is None:
                    env[n] = new.placeholder(n.name, type_expr=n.type)
                    env[n].meta = dict(n.meta)
                continue            # a region's placeholders are bound by the caller
            if n.op == "output":
                outs = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
                if hop is None:
                    new.output(outs)
                return outs
            if n.op == "get_attr" and isinstance(_attr(owner, n.target), torch.fx.GraphModule):
                env[n] = _attr(owner, n.target)
                continue
            if n.op == "call_function" and is_higher_order(n.target):
                env[n] = region(n, owner, env, state)
                continue
            if (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)
                    and isinstance(env.get(n.args[0]), tuple)):
                env[n] = env[n.args[0]][n.args[1]]
                continue
            mapped = lambda a: env[a]  # noqa: E731
            if state.autocast is not None and isinstance(n.target, torch._ops.OpOverload):
                out = _copy_autocast(n, env, state.autocast, casts)
            else:
                out = new.node_copy(n, mapped)
            _inherit_scope(out, n, hop)
            env[n] = out
            grad_of[out] = state.grad
        raise RegionError("a graph without an output node")  # pragma: no cover - fx graphs always have one

    def _copy_autocast(n, env, ac, casts) -> torch.fx.Node:
        device_type, dtype = ac
        try:
            seen, fake_out = observe_autocast(n.target, n.args, n.kwargs, device_type, dtype)
        except Exception as exc:  # noqa: BLE001 - an operator fake mode cannot run: say which
            raise RegionError(f"cannot tell which dtypes autocast({device_type!r}, {dtype}) gives "
                              f"{n.target} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None

        def cast(a):
            if not isinstance(a, torch.fx.Node):
                return a
            src = env[a]
            to = seen.get(id(a))
            if to is None or to == a.meta["val"].dtype:
                return src
            key = (src, to)
            if key not in casts:
                c = new.call_function(torch.ops.aten._to_copy.default, (src,), {"dtype": to})
                c.meta = {k: v for k, v in n.meta.items() if k in ("nn_module_stack", "stack_trace")}
                c.meta["val"] = _cast_val(a.meta["val"], to)
                grad_of[c] = True
                casts[key] = c
            return casts[key]

        args = torch.fx.node.map_aggregate(n.args, cast)
        kwargs = torch.fx.node.map_aggregate(n.kwargs, cast)
        out = new.create_node(n.op, n.target, tuple(args), dict(kwargs), name=n.name)
        out.meta = dict(n.meta)
        want, got = _dtypes(n.meta.get("val")), _dtypes(fake_out)
        if want and got and want != got:
            raise RegionError(f"{n.target} inside autocast({device_type!r}, {dtype}) computes in {got} when its "
                              f"inputs are cast as autocast casts them, but in {want} when traced: autocast "
                              "changes its inner operators, which cannot be made explicit")
        return out

    def region(n: torch.fx.Node, owner: torch.nn.Module, env: dict, state: _State) -> tuple:
        name = n.target.name() if hasattr(n.target, "name") else str(n.target)
        if name == _SET_GRAD:
            enable, sub, *args = n.args
            inner = _State(grad=bool(enable), autocast=state.autocast)
        elif name == _AUTOCAST:
            device_type, dtype, enabled, _cache, sub, *args = n.args
            if not enabled:
                inner = _State(grad=state.grad, autocast=None)
            elif str(device_type) != trace_device:
                inert.add(str(device_type))
                inner = _State(grad=state.grad, autocast=None)
            else:
                dt = dtype if dtype is not None else torch.get_autocast_dtype(str(device_type))
                inner = _State(grad=state.grad, autocast=(str(device_type), dt))
        else:
            where = _scope_text(n)
            raise RegionError(f"the graph calls the higher-order operator {name}{where}: data-dependent control "
                              "flow (torch.cond, while_loop, map) or a compiled region, which a pipeline stage "
                              "cannot hold; compute both branches and select with torch.where, or move the "
                              "control flow out of forward")
        sub_gm = env[sub] if isinstance(env.get(sub), torch.nn.Module) else _attr(owner, sub.target)
        sub_env: dict = {}
        phs = [p for p in sub_gm.graph.nodes if p.op == "placeholder"]
        if len(phs) != len(args):
            raise RegionError(f"{name} passes {len(args)} arguments to a region that takes {len(phs)}")
        for p, a in zip(phs, args):
            sub_env[p] = env[a] if isinstance(a, torch.fx.Node) else a
        outs = copy(sub_gm.graph, sub_gm, sub_env, inner, n)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if state.grad and not inner.grad:
            # What the region computed under no_grad leaves it without a gradient; an input
            # handed straight through (or a value of a nested enable_grad region) keeps its own.
            outs = [_stop_gradient(o) if (isinstance(o, torch.fx.Node) and grad_of.get(o) is False) else o
                    for o in outs]
        return tuple(outs)

    def _stop_gradient(o: torch.fx.Node) -> torch.fx.Node:
        val = o.meta.get("val")
        if not (isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())):
            return o
        d = new.call_function(torch.ops.aten.detach.default, (o,))
        d.meta = {k: v for k, v in o.meta.items() if k in ("nn_module_stack", "stack_trace", "val")}
        grad_of[d] = True
        return d

    copy(gm.graph, gm, {}, _State(), None)
    if inert:
        notes.append(f"autocast region(s) for {', '.join(sorted(inert))} had no effect when tracing on "
                     f"{trace_device}, so the package computes in the traced dtypes there (trace on that device, "
                     "or choose the dtype with --dtype)")
    new.lint()
    return new, notes


def _attr(owner: torch.nn.Module, target: str) -> Any:
    obj: Any = owner
    for part in str(target).split("."):
        obj = getattr(obj, part)
    return obj


def _inherit_scope(out: torch.fx.Node, n: torch.fx.Node, hop: torch.fx.Node | None) -> None:
    # Region bodies may lack module stacks: they belong to the module that opened the region.
    if hop is not None and not out.meta.get("nn_module_stack") and hop.meta.get("nn_module_stack"):
        out.meta["nn_module_stack"] = hop.meta["nn_module_stack"]
    if hop is not None and not out.meta.get("stack_trace") and hop.meta.get("stack_trace"):
        out.meta["stack_trace"] = hop.meta["stack_trace"]


def _cast_val(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty([int(s) for s in val.shape], dtype=dtype, device=val.device)


def _dtypes(val: Any) -> list:
    if isinstance(val, torch.Tensor):
        return [val.dtype]
    if isinstance(val, (tuple, list)):
        return [v.dtype if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _scope_text(n: torch.fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else cls.__name__
    return f" in module {path or '<root>'} ({cls_name.rsplit('.', 1)[-1]})"
