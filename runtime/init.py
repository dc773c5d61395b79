"""Create a stage's weights from init recipes, without the model's source.

A model traced on the ``meta`` device (t5-3b, gpt2-xl...) has no values to
store, so its package records, per tensor, the initialisation calls the model
would have made (``normal_(mean=0, std=0.02)``, ``fill_(1.0)``, ``copy_(arange)``)
and each process replays them for its own stages only: the whole model never
exists in one process. A recipe is a list of steps::

    {"api": "init", "fn": "normal_", "args": [], "kwargs": {"mean": 0.0, "std": 0.02}}
    {"api": "tensor", "fn": "fill_", "args": [1.0], "kwargs": {}}
    {"api": "tensor", "fn": "copy_", "args": [{"tensor": [[0, 1, 2]], "dtype": "int64"}], "kwargs": {}}

``api`` ``init`` names a function of :mod:`torch.nn.init`, ``tensor`` an
in-place tensor method. Random steps draw from a generator seeded by the run's
seed and the tensor's name, so every process creates the same values for a
tensor however the model is partitioned.
"""

from __future__ import annotations

import inspect
import zlib

import torch

from .ops import mix_seed

_RANDOM_METHODS = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_"}


class InitError(ValueError):
    """A recipe names an unknown function or does not fit its tensor."""


def _decode(a):
    if isinstance(a, dict) and "tensor" in a:
        return torch.tensor(a["tensor"], dtype=getattr(torch, a.get("dtype", "float32")))
    if isinstance(a, dict) and "float" in a:
        return float(a["float"])
    if isinstance(a, list):
        return [_decode(x) for x in a]
    return a


def name_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` for run seed ``seed``."""
    return mix_seed(seed, zlib.crc32(name.encode()))


def apply_recipe(tensor: torch.Tensor, recipe: list, *, seed: int, name: str) -> torch.Tensor:
    """Fill ``tensor`` in place by replaying ``recipe``; returns it."""
    gen = torch.Generator(device=tensor.device)
    gen.manual_seed(name_seed(seed, name))
    with torch.no_grad():
        for step in recipe:
            fn_name = step.get("fn")
            args = [_decode(a) for a in step.get("args", [])]
            kwargs = {k: _decode(v) for k, v in step.get("kwargs", {}).items()}
            kwargs.pop("generator", None)
            args = [a.to(tensor.device) if isinstance(a, torch.Tensor) else a for a in args]
            if step.get("api") == "init":
                fn = getattr(torch.nn.init, str(fn_name), None)
                if fn is None or not callable(fn):
                    raise InitError(f"{name}: unknown torch.nn.init function {fn_name!r} in its init recipe")
                if "generator" in inspect.signature(fn).parameters:
                    kwargs["generator"] = gen
                fn(tensor, *args, **kwargs)
            elif step.get("api") == "tensor":
                fn = getattr(tensor, str(fn_name), None)
                if fn is None or not str(fn_name).endswith("_"):
                    raise InitError(f"{name}: {fn_name!r} is not an in-place tensor method")
                if fn_name in _RANDOM_METHODS:
                    kwargs["generator"] = gen
                fn(*args, **kwargs)
            else:
                raise InitError(f"{name}: init recipe step {step!r} has no api 'init' or 'tensor'")
    return tensor
