"""Which model inputs index a table, and how large the table is.

Token ids index an embedding's rows and labels index a loss's classes. A value out of range is
an error in the data, but PyTorch reports it late and badly: on the CPU as an ``IndexError``
inside whichever stage reads it, on a GPU as a device-side assert that surfaces at some later
synchronisation and leaves the CUDA context unusable. :func:`index_ranges` finds, at compile
time, every integer input whose values reach such an operator, and what they may be, so the
runtime can check each micro-batch on the host before it enters the pipeline
(``ftcompile.runtime.data.check_index_ranges``).

An input is followed through the operators that pass its values on unchanged (views, copies,
casts into an integer dtype that holds all of its values, slices, padding) to the operators that
index with it:

* ``aten.embedding``: ``0 <= id < rows`` of the weight;
* the losses taking class targets (``cross_entropy_loss``, ``nll_loss`` and its forms):
  ``0 <= label < classes``, or the loss's ``ignore_index``;
* ``index_select``, ``gather``: ``0 <= index < size`` of the indexed dimension;
* ``one_hot`` with a given number of classes.

A check must never refuse data the model accepts, so a path the rules cannot follow exactly
is not checked: an operator that computes new values from the input (arithmetic, comparisons,
``clamp``, a narrowing cast, one to float or bool) or replaces some (``masked_fill``, ``where``:
a model may mask out positions whose values it never uses), a slice with a step, or a slice
after a reshape or a transpose (which positions of the input it keeps is no longer known; a
transpose moves values even between dimensions of one size). Slices and padding before any of
those are followed: a constraint covers only the positions of the input that reach the
operator (HF's causal-LM loss pads the labels and drops their first column, which therefore is
not checked).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import OpGraph
from .runtime.manifest import IndexRange

#: Operators whose output holds the input's values at the same positions (and shape).
_SAME = {"aten.contiguous.default", "aten.clone.default", "aten.detach.default", "aten.alias.default",
         "aten.lift_fresh_copy.default", "aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout",
         "aten.to.device", "aten.to.other", "aten.type_as.default"}
#: Operators that rearrange the input's values; where the shape stays the same they are the identity.
_RESHAPE = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.flatten.using_ints",
            "aten.unflatten.int", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.default",
            "aten.squeeze.dim", "aten.squeeze.dims", "aten.repeat.default", "aten.expand_as.default",
            "aten.view_as.default", "aten.reshape_as.default"}
#: Operators that move values between positions even where the shape stays (square transposes).
_PERMUTE = {"aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.swapaxes.default",
            "aten.swapdims.default", "aten.movedim.int"}
#: The values each integer dtype holds: a cast is followed only into a dtype holding all of its input's.
_INT_RANGE = {"uint8": (0, 2 ** 8 - 1), "int8": (-2 ** 7, 2 ** 7 - 1), "int16": (-2 ** 15, 2 ** 15 - 1),
              "int32": (-2 ** 31, 2 ** 31 - 1), "int64": (-2 ** 63, 2 ** 63 - 1)}
#: Class-target losses: (target argument, ignore_index argument or None).
_LOSSES = {"aten.cross_entropy_loss.default", "aten.nll_loss.default", "aten.nll_loss_forward.default",
           "aten.nll_loss2d_forward.default", "aten.nll_loss_nd.default", "aten.nll_loss2d.default"}


@dataclass(frozen=True)
class _Track:
    """An input's values inside the graph: which input, which of its positions (``window``, in the
    input's coordinates) and, while no reshape has scrambled them, how the value's dimensions map to
    the input's (``dims[k]``: the input dimension of dimension ``k``; ``shift[k]``: input coordinate
    minus this value's)."""

    input: str
    window: tuple[tuple[int, int], ...]
    dims: tuple[int, ...] | None
    shift: tuple[int, ...] | None


def _schema_args(target: str, args: list, kwargs: dict) -> dict | None:
    """``target``'s arguments by name, with the schema's defaults."""
    import torch

    ns, _, rest = target.partition(".")
    name, _, overload = rest.partition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
        schema = op._schema
    except (AttributeError, RuntimeError):
        return None
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _ref(x) -> str | None:
    return x["ref"] if isinstance(x, dict) and set(x) == {"ref"} else None


def index_ranges(graph: OpGraph) -> dict[str, list[IndexRange]]:
    """Graph input value -> the ranges its values must lie in, one per indexing operator a path of
    value-preserving operators leads it to (see the module docstring); inputs that reach none are
    left out."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for n in graph.nodes:
        metas = list(n.outputs.items()) + [kv for ins in n.instrs for kv in ins.produced().items()]
        for v, m in metas:
            if m is not None and m.tensor is not None:
                shapes[v], dtypes[v] = tuple(m.tensor.shape), m.tensor.dtype
    tracks: dict[str, _Track] = {}
    for inp in graph.inputs:
        if inp.get("node") is None:
            continue
        m = graph.node(inp["node"]).outputs.get(inp["value"])
        if m is None or m.tensor is None or m.tensor.dtype not in _INT_RANGE:
            continue
        shape = tuple(m.tensor.shape)
        tracks[inp["value"]] = _Track(inp["value"], tuple((0, s) for s in shape), tuple(range(len(shape))),
                                      (0,) * len(shape))
    out: dict[str, list[IndexRange]] = {}
    if not tracks:
        return out

    params = {a: info for info in graph.params.values() for a in (info.name, *info.aliases)}

    def shape_of(x) -> tuple[int, ...] | None:
        p = x.get("param") if isinstance(x, dict) and set(x) == {"param"} else None
        return tuple(params[p].meta.shape) if p in params else shapes.get(_ref(x))

    for node in sorted(graph.op_nodes(), key=lambda n: n.id):
        for ins in node.instrs:
            named = None
            for pos, a in enumerate(list(ins.args) + list(ins.kwargs.values())):
                t = tracks.get(_ref(a))
                if t is None:
                    continue
                named = named if named is not None else _schema_args(ins.target, ins.args, ins.kwargs)
                if named is None:
                    break
                if dtypes.get(_ref(a)) not in _INT_RANGE:
                    continue        # a float target is a loss's probabilities, not class indices
                rule = _consume(ins.target, named, a, t, shape_of)
                if rule is not None:
                    out.setdefault(t.input, [])
                    if rule not in out[t.input]:
                        out[t.input].append(rule)
                    continue
                if not _holds(dtypes.get(ins.name), dtypes.get(_ref(a))):
                    continue        # a narrowing cast (or one to float or bool) changes values
                nxt = _pass(ins.target, named, a, t, shapes.get(_ref(a)), shapes.get(ins.name))
                if nxt is not None and not ins.unpack:
                    tracks[ins.name] = nxt
    return out


def _holds(out: str | None, into: str | None) -> bool:
    """Whether integer dtype ``out`` holds every value of integer dtype ``into``."""
    if out not in _INT_RANGE or into not in _INT_RANGE:
        return False
    (lo, hi), (a, b) = _INT_RANGE[out], _INT_RANGE[into]
    return lo <= a and b <= hi


def _consume(target: str, named: dict, arg, t: _Track, shape_of) -> IndexRange | None:
    """The range ``target`` imposes on the tracked ``arg``, or None if it does not index with it."""
    def size(x, dim: int) -> int | None:
        shape = shape_of(x)
        return int(shape[dim % len(shape)]) if shape else None

    if target == "aten.embedding.default" and named.get("indices") is arg:
        rows, w = size(named["weight"], 0), named["weight"]
        name = w.get("param") if isinstance(w, dict) and "param" in w else None
        return None if rows is None else IndexRange(rows, None, t.window,
                                                    f"the embedding {name + ' ' if name else ''}of {rows} rows")
    if target in _LOSSES and named.get("target") is arg:
        logits = shape_of(named.get("self"))
        if not logits:
            return None
        classes = int(logits[1] if len(logits) >= 2 else logits[0])
        ignore = named.get("ignore_index")
        return IndexRange(classes, None if ignore is None else int(ignore), t.window, f"the loss's {classes} classes")
    if target in ("aten.index_select.default", "aten.gather.default") and named.get("index") is arg:
        n = size(named.get("self"), int(named.get("dim") or 0))
        return None if n is None else IndexRange(n, None, t.window, f"{target.split('.')[1]} over {n} positions")
    if target == "aten.one_hot.default" and named.get("self") is arg and int(named.get("num_classes", -1)) > 0:
        return IndexRange(int(named["num_classes"]), None, t.window, f"one_hot of {named['num_classes']} classes")
    return None


def _pass(target: str, named: dict, arg, t: _Track, shape_in, shape_out) -> _Track | None:
    """The tracked value ``target`` makes from ``arg`` (its ``self``), or None where its values or
    their positions can no longer be told (see the module docstring)."""
    if named.get("self") is not arg:
        return None
    if target in _SAME:
        return t
    if target in _RESHAPE:
        if shape_in is not None and shape_in == shape_out:
            return t
        return _Track(t.input, t.window, None, None)
    if target in _PERMUTE:
        return _Track(t.input, t.window, None, None)
    if t.dims is None or shape_in is None:
        return None
    if target in ("aten.slice.Tensor", "aten.narrow.default", "aten.select.int"):
        k = int(named.get("dim") or 0) % len(shape_in)
        n = shape_in[k]
        if target == "aten.select.int":
            i = int(named["index"])
            start, stop, step = (i + n if i < 0 else i), (i + n if i < 0 else i) + 1, 1
        elif target == "aten.narrow.default":
            s = int(named["start"])
            start = s + n if s < 0 else s
            stop, step = start + int(named["length"]), 1
        else:
            start, stop, step = named.get("start"), named.get("end"), int(named.get("step") or 1)
            start, stop, _ = slice(start, stop).indices(n)
        if step != 1:
            return None
        d, sh = t.dims[k], t.shift[k]
        lo, hi = t.window[d]
        window = list(t.window)
        window[d] = (max(lo, start + sh), max(max(lo, start + sh), min(hi, stop + sh)))
        dims, shift = list(t.dims), list(t.shift)
        if target == "aten.select.int":
            del dims[k], shift[k]
        else:
            shift[k] = sh + start
        return _Track(t.input, tuple(window), tuple(dims), tuple(shift))
    if target in ("aten.pad.default", "aten.constant_pad_nd.default"):
        if named.get("mode", "constant") != "constant":
            return None
        pad = [int(p) for p in named["pad"]]
        if any(p < 0 for p in pad):
            return None
        shift = list(t.shift)
        for j in range(len(pad) // 2):
            k = len(shape_in) - 1 - j
            shift[k] -= pad[2 * j]
        return _Track(t.input, t.window, t.dims, tuple(shift))
    return None
