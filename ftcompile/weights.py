"""Where a package's weights come from: a model's tensors, or init recipes of a ``meta`` model.

A model built with real tensors gives every stage its values directly. A model
built on ``meta`` (the giant sizes) has none; :func:`record_init_recipes` runs
its initialisation again under a :class:`~torch.overrides.TorchFunctionMode`
that records, per tensor, the ``torch.nn.init`` calls and in-place tensor
methods applied to it, which :mod:`ftcompile.runtime.init` replays per stage at
run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .ir import OpGraph, ParamInfo

# Steps that overwrite the whole tensor: a recipe starts at the last of them.
_OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "copy_", "trunc_normal_", "kaiming_uniform_",
               "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "constant_", "ones_", "zeros_",
               "eye_", "orthogonal_", "dirac_"}
_MAX_RECORDED_ELEMENTS = 1 << 20


class WeightsError(ValueError):
    """The package's weights cannot be produced (missing values, no init recipe)."""


class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.steps = WeakIdKeyDictionary()
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth == 0:
            self._record(func, args, kwargs)
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1

    def _record(self, func, args, kwargs) -> None:
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")
        if not isinstance(target, torch.Tensor) or not name.endswith("_") or name.startswith("_"):
            return
        if func is getattr(torch.Tensor, name, None):
            api = "tensor"
        elif callable(getattr(torch.nn.init, name, None)):
            # torch.nn.init.normal_ or a library's wrapper of the same name (transformers.initialization)
            api = "init"
        else:
            return
        rest = list(args[1:])
        kw = {k: v for k, v in kwargs.items() if k not in ("tensor", "generator")}
        try:
            step = {"api": api, "fn": name, "args": [_encode(a) for a in rest],
                    "kwargs": {k: _encode(v) for k, v in kw.items()}}
        except TypeError as exc:
            step = {"api": api, "fn": name, "error": str(exc)}
        if name in _OVERWRITES:
            self.steps[target] = [step]
        else:
            self.steps.setdefault(target, []).append(step)


def _encode(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        if a.is_meta:
            raise TypeError("the value is a meta tensor")
        if a.numel() > _MAX_RECORDED_ELEMENTS:
            raise TypeError(f"the value is a tensor of {a.numel()} elements")
        return {"tensor": a.detach().cpu().tolist(), "dtype": str(a.dtype).removeprefix("torch.")}
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": repr(a)}
    if isinstance(a, (bool, int, float, str)) or a is None:
        return a
    if isinstance(a, (list, tuple)):
        return [_encode(x) for x in a]
    raise TypeError(f"cannot record an argument of type {type(a).__name__}")


def record_init_recipes(model: torch.nn.Module) -> dict[str, list]:
    """Init recipe of every parameter and buffer of ``model`` (any device, ``meta`` included).

    Runs each module's ``reset_parameters`` and then, for HuggingFace models, the
    model's own ``initialize_weights`` (which overrides what it covers), and
    returns ``{name: steps}`` for every tensor name the model lists (tied names
    share their recipe). A tensor no step touched is missing from the result.
    """
    rec = _Recorder()
    with rec, torch.no_grad():
        for m in model.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and any(True for _ in m.parameters(recurse=False)):
                reset()
        init_hf = getattr(model, "initialize_weights", None)
        if callable(init_hf):
            init_hf()
    out: dict[str, list] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        steps = rec.steps.get(t)
        if steps:
            out[name] = steps
    return out


@dataclass
class WeightSource:
    """Values for a graph's parameters, buffers and constants.

    ``tensors`` maps canonical names to real tensors (a model built on a real
    device); otherwise ``recipes`` maps them to init recipes. Constants always
    come from the graph, which stores their values.
    """

    tensors: dict[str, torch.Tensor] | None = None
    recipes: dict[str, list] = field(default_factory=dict)

    @property
    def stored(self) -> bool:
        return self.tensors is not None

    def value(self, p: ParamInfo) -> torch.Tensor:
        """The real tensor for ``p`` (stored weights only)."""
        if p.kind == "constant" and p.value is not None:
            return torch.tensor(p.value, dtype=getattr(torch, p.meta.dtype)).reshape(p.meta.shape)
        assert self.tensors is not None
        t = self.tensors.get(p.name)
        if t is None:
            for alias in p.aliases:
                t = self.tensors.get(alias)
                if t is not None:
                    break
        if t is None:
            raise WeightsError(f"the model has no tensor {p.name!r} that the graph reads; was the graph "
                               "traced from another model? Re-run `ftcompile compile` on the model")
        if tuple(t.shape) != tuple(p.meta.shape):
            raise WeightsError(f"{p.name}: the model's tensor has shape {list(t.shape)} but the graph "
                               f"expects {list(p.meta.shape)}; re-trace the model")
        return t.detach()

    def recipe(self, p: ParamInfo) -> list:
        """The init recipe of ``p`` (``meta`` models)."""
        if p.kind == "constant" and p.value is not None:
            return [{"api": "tensor", "fn": "copy_", "args": [{"tensor": p.value, "dtype": p.meta.dtype}],
                     "kwargs": {}}]
        for n in (p.name, *p.aliases):
            steps = self.recipes.get(n)
            if steps:
                bad = [s for s in steps if "error" in s]
                if bad:
                    raise WeightsError(f"{p.name}: its initialisation ({bad[0]['fn']}) cannot be recorded "
                                       f"({bad[0]['error']}); build the model on the CPU (--device cpu) or "
                                       "use --pretrained DIR so that the package stores real weights")
                return steps
        raise WeightsError(f"{p.name}: the model was built on 'meta' and nothing initialises this tensor in "
                           "a way ftcompile can record; build it on the CPU (--device cpu) or use "
                           "--pretrained DIR so that the package stores real weights")


def weight_source(model: torch.nn.Module | None, graph: OpGraph) -> WeightSource:
    """Weights for ``graph`` from ``model``: its tensors, or init recipes when it lives on ``meta``."""
    if model is None:
        raise WeightsError("no model to take weights from; compile from the model (zoo name or file.py:fn), "
                           "or keep the model name in the graph's source")
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    if any(t.is_meta for t in tensors.values()):
        return WeightSource(tensors=None, recipes=record_init_recipes(model))
    return WeightSource(tensors=tensors)
