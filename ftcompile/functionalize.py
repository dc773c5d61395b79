"""In-place operations of an exported graph rewritten out of place (functionalization).

An in-place operation hides a dependency: a later reader of ``x`` depends on
``x.add_(y)``, but no edge says so. Partitions may reorder nodes, so every edge of
the OpGraph must be a true dataflow dependency. :func:`functionalize_locally`
rewrites the mutations models make where they are, without re-tracing:

* ``x.add_(y)`` becomes ``x' = add(x, y)`` and every later read of ``x`` (or of a
  view of it) reads ``x'``. Every in-place ATen operator is paired with its
  out-of-place form by argument *types*, not names (``dropout_(self, p, train)`` is
  ``dropout(input, p, train)``; ``bernoulli_.float`` is ``bernoulli.p``).
* A write through a ``slice``/``select`` view becomes ``slice_scatter`` /
  ``select_scatter`` of the base.
* **Buffers** may be written (BatchNorm's ``num_batches_tracked.add_(1)``, a cache of
  statistics): the last value of a written buffer is marked with
  ``meta["ftc_writes"]`` (the buffer's placeholder names), which the OpGraph keeps as
  :attr:`~ftcompile.ir.Instr.writes` and generated code copies back into the buffer.
  ``aten.batch_norm`` in training mode updates its running statistics without saying
  so in its schema; it becomes ``_native_batch_norm_legit_functional``, which returns
  the new statistics, written back the same way.
* A user input written in place is local to the call (the package reads it fresh
  per micro-batch); a **parameter** written in place is refused: a pipeline trains
  parameters only through the optimizer.

``ExportedProgram.run_decompositions`` functionalizes anything but re-traces the
whole program and decomposes it (dropout becomes ``bernoulli`` arithmetic, no-grad
regions lose their meaning), so this pass must cover what models do; what it
cannot rewrite raises :class:`NeedsFullFunctionalization` and the caller decides.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx

aten = torch.ops.aten


class NeedsFullFunctionalization(Exception):
    """The local pass meets a mutation it cannot rewrite; torch's own pass must run."""


class Refused(Exception):
    """The graph does something a pipeline cannot hold (a parameter written in forward)."""


# View operators whose in-place update has an out-of-place inverse: writing ``src`` into
# ``slice(base, ...)`` is ``slice_scatter(base, src, ...)``. Same trailing arguments.
_SCATTER_OF_VIEW = {
    "aten.slice.Tensor": aten.slice_scatter.default,
    "aten.select.int": aten.select_scatter.default,
}
# Operators whose schema says "may alias" but which copy when they must (x.to(dtype),
# x.reshape(...)): whether a later mutation of the input shows through is unknown here.
_MAYBE_ALIAS = {"to", "reshape", "reshape_as", "contiguous", "flatten", "type_as", "_autocast_to_reduced_precision",
                "_autocast_to_full_precision"}


def returns_alias(target: Any) -> bool:
    return (isinstance(target, torch._ops.OpOverload) and bool(target._schema.returns)
            and target._schema.returns[0].alias_info is not None and not is_mutating_target(target))


def is_mutating_target(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def hides_mutation(n: torch.fx.Node) -> bool:
    """Whether ``n`` writes tensors its schema does not mark as written (batch_norm's running statistics)."""
    if n.op != "call_function" or n.target is not aten.batch_norm.default:
        return False
    args = _bn_args(n)
    return bool(args["training"]) and isinstance(args["running_mean"], torch.fx.Node)


def needs_functionalization(graph: torch.fx.Graph) -> bool:
    return any(n.op == "call_function" and (is_mutating_target(n.target) or hides_mutation(n)) for n in graph.nodes)


def _arg_sig(a) -> tuple[str, bool]:
    return (str(a.type), bool(a.kwarg_only))


def out_of_place(target: torch._ops.OpOverload) -> tuple[Callable, dict[str, str]]:
    """The out-of-place twin of an in-place ATen operator, and how keyword names map onto it.

    ``aten.copy_`` -> :func:`ftcompile.runtime.ops.copy_into` (``aten.copy`` has no derivative).

    ``aten.add_.Tensor`` -> ``aten.add.Tensor``; ``aten.dropout_.default`` ->
    ``aten.dropout.default`` (its first argument is ``input``, not ``self``). Only an
    operator writing exactly its first argument and returning it qualifies; the twin
    is the overload of the name without ``_`` whose argument types and keyword-only
    flags are the same (the same overload name first).
    """
    if target is torch.ops.aten.copy_.default:
        # aten.copy has no derivative: its twin would stop the gradient to the source.
        from .runtime.ops import copy_into

        return copy_into, {"self": "dst"}
    schema = target._schema
    args = schema.arguments
    writes = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    if (not args or len(writes) != 1 or writes[0] is not args[0] or len(schema.returns) != 1
            or target.namespace != "aten"):
        raise NeedsFullFunctionalization(str(target))
    packet = schema.name.split("::")[1]
    if not packet.endswith("_") or packet.endswith("__"):
        raise NeedsFullFunctionalization(str(target))
    base = getattr(torch.ops.aten, packet[:-1], None)
    if base is None:
        raise NeedsFullFunctionalization(str(target))
    want = [_arg_sig(a) for a in args]
    names = [target._overloadname] + [o for o in base.overloads() if o != target._overloadname]
    for name in names:
        twin = getattr(base, name, None)
        if twin is None or len(twin._schema.returns) != 1 or twin._schema.is_mutable:
            continue
        if [_arg_sig(a) for a in twin._schema.arguments] == want:
            rename = {a.name: b.name for a, b in zip(args, twin._schema.arguments) if a.name != b.name}
            return twin, rename
    raise NeedsFullFunctionalization(str(target))


_BN_NAMES = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
             "cudnn_enabled")
_BN_DEFAULTS = {"weight": None, "bias": None, "running_mean": None, "running_var": None}


def _bn_args(n: torch.fx.Node) -> dict[str, Any]:
    d = dict(_BN_DEFAULTS)
    d.update(zip(_BN_NAMES, n.args))
    d.update(n.kwargs)
    return d


def functionalize_locally(graph: torch.fx.Graph, kinds: dict[str, str] | None = None,
                          names: dict[str, str] | None = None) -> torch.fx.Graph:
    """A copy of ``graph`` with its in-place operations rewritten out of place (module docstring).

    ``kinds`` maps placeholder names to ``parameter``, ``buffer``, ``constant`` or
    ``input``; ``names`` maps placeholders to the names the user knows (for messages).
    A placeholder of unknown kind may not be written. Raises
    :class:`NeedsFullFunctionalization` for what this pass cannot rewrite and
    :class:`Refused` for a parameter written in place.
    """
    kinds = kinds or {}
    names = names or {}
    new = torch.fx.Graph()
    taken = {n.name for n in graph.nodes}
    env: dict[torch.fx.Node, Any] = {}                      # old node -> new node, as first made
    base: dict[torch.fx.Node, torch.fx.Node] = {}           # old node -> old node owning its storage
    chain: dict[torch.fx.Node, list | None] = {}            # views from base to node; None: not replayable
    born: dict[torch.fx.Node, int] = {}                     # version of the base when node was made
    version: dict[torch.fx.Node, int] = defaultdict(int)    # mutations of each base so far
    current: dict[torch.fx.Node, torch.fx.Node] = {}        # mutated base -> new node with its value
    refreshed: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
    written: list[torch.fx.Node] = []                       # buffer placeholders written, in order
    made: list[torch.fx.Node] = []

    def fresh_name(stem: str) -> str:
        i, name = 0, f"{stem}_functional"
        while name in taken:
            i += 1
            name = f"{stem}_functional_{i}"
        taken.add(name)
        return name

    def emit(target, args, kwargs, like: torch.fx.Node, val: Any) -> torch.fx.Node:
        n = new.create_node("call_function", target, tuple(args), dict(kwargs), name=fresh_name(like.name))
        n.meta = {k: v for k, v in like.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        n.meta["val"] = val
        made.append(n)
        return n

    def value_of(a: torch.fx.Node) -> torch.fx.Node:
        b = base.get(a, a)
        if version[b] == born.get(a, 0):
            return env[a]
        if a is b or chain.get(a) == []:
            return current[b]
        views = chain.get(a)
        if views is None:
            raise NeedsFullFunctionalization(f"{a.name} reads a mutated tensor through a view")
        key = (a, version[b])
        if key not in refreshed:
            x = current[b]
            for v in views:
                x = emit(v.target, (x, *mapped(v.args[1:])), mapped(v.kwargs), v, v.meta.get("val"))
            refreshed[key] = x
        return refreshed[key]

    def mapped(tree: Any) -> Any:
        return torch.fx.node.map_arg(tree, value_of)

    def value_of_plain(a: torch.fx.Node) -> torch.fx.Node:
        return env[a]

    # where each node sits, the last position that reads it, and the nodes sharing each base
    position = {x: i for i, x in enumerate(graph.nodes)}
    last_read = {x: max((position[u] for u in x.users), default=-1) for x in graph.nodes}
    group: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)

    def check_writable(b: torch.fx.Node, op: str) -> None:
        if b.op == "call_function":
            return
        kind = kinds.get(b.name) if b.op == "placeholder" else None
        if kind == "parameter":
            raise Refused(f"forward writes parameter {names.get(b.name, b.name)} in place ({op}); a pipeline "
                          "changes parameters only through the optimizer: compute the new value out of place, "
                          "or make the tensor a buffer")
        if kind == "buffer":
            if b not in written:
                written.append(b)
            return
        if kind == "input":
            return
        if kind == "aliased input":
            raise Refused(f"forward writes input {names.get(b.name, b.name)} in place ({op}), and the example "
                          "call passed the same tensor as another input too, so the other input would see the "
                          "change; pass separate tensors (e.g. labels=input_ids.clone())")
        raise NeedsFullFunctionalization(f"{op} mutates {b.name}")

    def write(b: torch.fx.Node, val: torch.fx.Node) -> None:
        current[b] = val
        version[b] += 1

    for n in graph.nodes:
        if n.op == "output":
            new.output(mapped(n.args[0]))
            continue
        if hides_mutation(n):
            env[n] = _functional_batch_norm(n, value_of, emit, base, chain, check_writable, write)
            continue
        if n.op == "call_function" and is_mutating_target(n.target):
            oop, rename = out_of_place(n.target)
            target = n.args[0] if n.args else None
            if not isinstance(target, torch.fx.Node):
                raise NeedsFullFunctionalization(n.name)
            b = base.get(target, target)
            views = chain.get(target, [])
            if views is None or any(str(v.target) not in _SCATTER_OF_VIEW for v in views):
                # A write through a view that has no scatter inverse (flatten, transpose...): fine
                # when nothing reads the base or another view of it afterwards (the classifier's
                # Dropout(inplace=True) on x.flatten(1)); the view then becomes a base of its own.
                if b.op != "call_function" or any(last_read[x] > position[n] for x in group[b]
                                                  if x is not target and x is not n):
                    raise NeedsFullFunctionalization(f"{n.name} mutates {b.name} through a view")
                if version[b] != born.get(target, 0):
                    raise NeedsFullFunctionalization(f"{n.name} mutates a stale view of {b.name}")
                base[target], chain[target], born[target] = target, [], version[target]
                env[target] = value_of_plain(target)
                b, views = target, []
            check_writable(b, str(n.target))
            # the values of the base and each view on the way down, as they are now
            levels = [current.get(b, env[b])]
            for v in views:
                levels.append(emit(v.target, (levels[-1], *mapped(v.args[1:])), mapped(v.kwargs), v,
                                   v.meta.get("val")))
            kwargs = {rename.get(k, k): v for k, v in mapped(n.kwargs).items()}
            val = emit(oop, (levels[-1], *mapped(n.args[1:])), kwargs, n, n.meta.get("val"))
            for i in reversed(range(len(views))):
                v = views[i]
                parent_val = (views[i - 1] if i else b).meta.get("val")
                val = emit(_SCATTER_OF_VIEW[str(v.target)], (levels[i], val, *mapped(v.args[1:])),
                           mapped(v.kwargs), n, parent_val)
            write(b, val)
            # the in-place op's own result is the mutated tensor: later reads are refreshed
            base[n], chain[n], born[n] = b, views, version[b] - 1
            continue
        env[n] = new.node_copy(n, value_of)
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if src is not None and n.op == "call_function" and returns_alias(n.target):
            b = base.get(src, src)
            base[n], born[n] = b, version[b]
            packet = n.target._schema.name.split("::")[1]
            single = len(n.target._schema.returns) == 1 and str(n.target._schema.returns[0].type) == "Tensor"
            up = chain.get(src, [])
            chain[n] = up + [n] if (up is not None and single and packet not in _MAYBE_ALIAS) else None
            group[b].append(n)
        elif src is not None and n.target is operator.getitem and src in base and chain.get(src) is None:
            b = base[src]
            base[n], chain[n], born[n] = b, None, version[b]
            group[b].append(n)
        if n not in group:
            group[n].append(n)

    # The last value of every written buffer is copied back into it after forward.
    marked: set[torch.fx.Node] = set()
    for b in written:
        val = current[b]
        if val in marked or val.op == "placeholder":
            # one value for two buffers (or a buffer set to an input): give each its own copy
            val = emit(aten.clone.default, (val,), {}, val if val.op != "placeholder" else b, val.meta.get("val"))
            out_node = next(iter(n for n in new.nodes if n.op == "output"))
            out_node.prepend(val)
        val.meta.setdefault("ftc_writes", []).append(b.name)
        marked.add(val)

    # views taken on the way down to a write but never read again
    for n in reversed(made):
        if not n.users and not n.meta.get("ftc_writes"):
            new.erase_node(n)
    return new


def _functional_batch_norm(n, value_of, emit, base, chain, check_writable, write) -> torch.fx.Node:
    """``batch_norm(training=True)`` as ``_native_batch_norm_legit_functional`` plus writes of its statistics."""
    a = _bn_args(n)
    stats = [a["running_mean"], a["running_var"]]
    if not all(isinstance(s, torch.fx.Node) for s in stats):
        raise NeedsFullFunctionalization(f"{n.name}: batch_norm with only one running statistic")
    owners = []
    for s in stats:
        if chain.get(s, []) != []:
            raise NeedsFullFunctionalization(f"{n.name}: batch_norm statistics through a view")
        b = base.get(s, s)
        check_writable(b, "batch_norm (running statistics)")
        owners.append(b)
    x, w, bias = (value_of(v) if isinstance(v, torch.fx.Node) else v for v in (a["input"], a["weight"], a["bias"]))
    rm, rv = (value_of(s) for s in stats)
    out_val = n.meta.get("val")
    stat_vals = [s.meta.get("val") for s in stats]
    tup = emit(aten._native_batch_norm_legit_functional.default,
               (x, w, bias, rm, rv, True, float(a["momentum"]), float(a["eps"])), {}, n,
               (out_val, stat_vals[0], stat_vals[1], stat_vals[0], stat_vals[1]))
    parts = [emit(operator.getitem, (tup, i), {}, n, v)
             for i, v in ((0, out_val), (3, stat_vals[0]), (4, stat_vals[1]))]
    for b, new_stat in zip(owners, parts[1:]):
        write(b, new_stat)
    return parts[0]
