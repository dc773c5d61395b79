"""User models given as ``"path/to/file.py:function"``.

The file is imported as a fresh module and ``function()`` is called with no
arguments; it must return ``(model, args)`` or ``(model, args, kwargs)`` where
``model`` is an ``nn.Module``, ``args`` a tuple and ``kwargs`` a dict, and
``model(*args, **kwargs)`` returns the training loss as its first output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import _pytree as pytree

from ..runtime.userfile import UserFileError, import_user_file
from .base import BuiltModel, ModelOptions, ZooError
from .common import LENGTH_FIELDS, assemble, check_options, refuse_attention, seeded

_CONTRACT = (
    "it must return (model, args) or (model, args, kwargs) with model a torch.nn.Module, "
    "args a tuple and kwargs a dict"
)


def is_user_spec(name: str) -> bool:
    """Whether ``name`` looks like ``path.py:function`` rather than a zoo name."""
    path, sep, fn = name.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(fn)


def _import_file(path: Path) -> ModuleType:
    try:
        return import_user_file(path, "ftcompile_user")
    except UserFileError as exc:
        raise ZooError(str(exc)) from exc.__cause__


def _call_user_function(spec: str, seed: int, device: str) -> tuple[torch.nn.Module, tuple, dict]:
    path_text, _, fn_name = spec.rpartition(":")
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ZooError(f"user model file {path_text!r} does not exist")
    module = _import_file(path)
    fn = getattr(module, fn_name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and getattr(v, "__module__", None) == module.__name__)
        raise ZooError(f"{path_text!r} has no function {fn_name!r}; it defines: "
                       f"{', '.join(defined) or 'nothing callable'}")
    if not callable(fn):
        raise ZooError(f"{path_text}:{fn_name} is a {type(fn).__name__}, not a function")
    # The user's weight init draws from the global RNG; seed it like the zoo does.
    with seeded(seed, device):
        try:
            result = fn()
        except Exception as exc:
            raise ZooError(f"{spec} raised {type(exc).__name__}: {exc}") from exc
    return _unpack(spec, result)


def _unpack(spec: str, result) -> tuple[torch.nn.Module, tuple, dict]:
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ZooError(f"{spec} returned {type(result).__name__}; {_CONTRACT}")
    model, args, *rest = result
    kwargs = rest[0] if rest else {}
    if not isinstance(model, torch.nn.Module):
        raise ZooError(f"{spec} returned a {type(model).__name__} as model; {_CONTRACT}")
    if not isinstance(args, tuple):
        hint = " (wrap a single tensor as (x,))" if isinstance(args, torch.Tensor) else ""
        raise ZooError(f"{spec} returned a {type(args).__name__} as args{hint}; {_CONTRACT}")
    if not isinstance(kwargs, dict):
        raise ZooError(f"{spec} returned a {type(kwargs).__name__} as kwargs; {_CONTRACT}")
    return model, args, kwargs


def _current_device(model: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """Where the user put things: the first parameter's device, else the first input's."""
    tensors = [*model.parameters(), *model.buffers(),
               *(x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))]
    return str(tensors[0].device) if tensors else "cpu"


def build_user_model(spec: str, options: ModelOptions) -> BuiltModel:
    """Build the model returned by ``function()`` in ``path.py``; see ``build_model``."""
    check_options(options)
    given = [f for f in ("batch_size", *LENGTH_FIELDS) if getattr(options, f) is not None]
    if given:
        raise ZooError(f"{', '.join(given)} do not apply to a user model: "
                       "its function returns the example inputs, so size them there")
    if options.pretrained is not None:
        raise ZooError("pretrained checkpoints apply to HuggingFace zoo models only, not user models")
    refuse_attention(spec, options, "a user model's attention is what its code builds; for a transformers "
                     "model set config._attn_implementation = 'sdpa' or 'eager' in the function")

    # Construct on the CPU (or where the user chooses); an explicit device moves it after.
    seed_device = options.device if options.device.startswith("cuda") else "cpu"
    model, args, kwargs = _call_user_function(spec, options.seed, seed_device)
    device = options.device
    if device == "auto":
        device = _current_device(model, args, kwargs)
    else:
        on_meta = any(p.is_meta for p in [*model.parameters(), *model.buffers()])
        if on_meta and device != "meta":
            raise ZooError(f"{spec} built its model on the meta device; it cannot be moved to {device!r}")
        model = model.to(device)
    resolved = dataclasses.replace(options, device=device)
    return assemble(spec, model, resolved, (), lambda: (args, kwargs))
