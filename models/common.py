"""Helpers shared by the zoo's builders: option checking and resolution, seeding,
input placement and the final assembly of a :class:`BuiltModel`."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from .base import BuiltModel, ModelOptions, ZooError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# ModelOptions.device="auto" puts models this large on "meta": materialising them on
# a CPU just to trace would take minutes and tens of GB (t5-11b is 45 GB in float32).
META_THRESHOLD = 500_000_000

LENGTH_FIELDS = ("seq_len", "encoder_len", "decoder_len")

# attention implementations a HuggingFace model can be built with (None: the zoo's choice)
ATTENTIONS = (None, "sdpa", "eager")


def refuse_attention(name: str, options: ModelOptions, why: str) -> None:
    """A model that has no choice of attention refuses the option instead of ignoring it."""
    if options.attention is not None:
        raise ZooError(f"{name} does not take an attention implementation ({why}); leave --attention out")

# Produces example inputs on the CPU in float32; device and dtype are applied afterwards
# so that every device sees the same values.
InputFactory = Callable[[], tuple[tuple, dict]]


def check_options(options: ModelOptions) -> None:
    """Reject malformed option values, independently of the model."""
    if not isinstance(options, ModelOptions):
        raise ZooError(f"options must be a ModelOptions, not {type(options).__name__}")
    if options.dtype is not None and options.dtype not in DTYPES:
        raise ZooError(f"dtype must be one of {', '.join(DTYPES)}; got {options.dtype!r}")
    for field in ("batch_size", *LENGTH_FIELDS):
        value = getattr(options, field)
        # bool is an int subclass; True as a batch size is certainly a mistake.
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ZooError(f"{field} must be a positive integer; got {value!r}")
    if not isinstance(options.seed, int):
        raise ZooError(f"seed must be an integer; got {options.seed!r}")
    if options.attention not in ATTENTIONS:
        raise ZooError(f"attention must be one of {', '.join(a for a in ATTENTIONS if a)}; got {options.attention!r}")
    _check_device(options.device)


def _check_device(device: str) -> None:
    if device in ("auto", "cpu", "meta"):
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type != "cuda":
        raise ZooError(f"device must be 'auto', 'cpu', 'meta', 'cuda' or 'cuda:N'; got {device!r}")
    if not torch.cuda.is_available():
        raise ZooError(f"device {device!r} requested but CUDA is not available")


def resolve_device(device: str, parameters: int, pretrained: str | None) -> str:
    """Turn ``"auto"`` into a concrete device.

    A pretrained checkpoint always resolves to ``"cpu"``: the caller asked for its
    weights, which a meta tensor cannot hold.
    """
    if device != "auto":
        return device
    if pretrained is None and parameters >= META_THRESHOLD:
        return "meta"
    return "cpu"


def resolve_options(
    name: str,
    options: ModelOptions,
    defaults: ModelOptions,
    lengths: tuple[str, ...],
    parameters: int,
    length_note: str = "",
) -> ModelOptions:
    """Check ``options`` for model ``name`` and fill them in from ``defaults``.

    Args:
        lengths: the length fields the model takes; any other length given is an error.
        parameters: approximate size, for resolving ``device="auto"``.
        length_note: appended to the error for a length the model does not take.
    """
    check_options(options)
    for field in LENGTH_FIELDS:
        if field not in lengths and getattr(options, field) is not None:
            takes = f"it takes {', '.join(lengths)}" if lengths else "it takes no length option"
            note = f" ({length_note})" if length_note else ""
            raise ZooError(f"{name} does not take {field}; {takes}{note}")
    filled = {
        field: getattr(defaults, field)
        for field in ("batch_size", *lengths)
        if getattr(options, field) is None
    }
    if options.dtype is None:
        filled["dtype"] = "float32"
    device = resolve_device(options.device, parameters, options.pretrained)
    return dataclasses.replace(options, device=device, **filled)


@contextlib.contextmanager
def seeded(seed: int, device: str) -> Iterator[None]:
    """Seed the global RNGs for model construction, restoring the caller's state after.

    Weight initialisation draws from the global generator, so seeding it is the only
    way to make ``build_model`` reproducible; forking keeps that from leaking into
    the caller's random stream.
    """
    dev = torch.device(device)
    cuda_devices = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield


def input_generator(seed: int) -> torch.Generator:
    """A private CPU generator for example inputs (independent of weight init)."""
    return torch.Generator(device="cpu").manual_seed(seed)


def place_inputs(args: tuple, kwargs: dict, device: str, dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """Move every tensor in ``args``/``kwargs`` to ``device``, casting floating ones to ``dtype``
    (None: each keeps its own).

    Integer tensors (token ids, labels) keep their dtype.
    """
    target = torch.device(device)

    def place(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_meta and target.type != "meta":
            raise ZooError(f"example inputs are meta tensors; cannot produce real values on {device!r}")
        if x.is_floating_point() and dtype is not None:
            return x.to(device=target, dtype=dtype)
        return x.to(device=target)

    return pytree.tree_map(place, (tuple(args), dict(kwargs)))


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameter elements; ``parameters()`` already yields a tied tensor once."""
    return sum(p.numel() for p in model.parameters())


def assemble(
    name: str,
    model: torch.nn.Module,
    options: ModelOptions,
    basic_blocks: tuple[str, ...],
    cpu_inputs: InputFactory,
) -> BuiltModel:
    """Cast ``model`` to ``options.dtype`` and package it with example inputs.

    Args:
        options: already resolved; ``options.device`` is where the example inputs go;
            ``options.dtype`` None (a user model without --dtype) casts nothing.
        cpu_inputs: makes the CPU inputs; called afresh by every ``make_inputs``.
    """
    dtype = DTYPES[options.dtype] if options.dtype is not None else None
    if dtype is not None:
        model = model.to(dtype=dtype)  # only floating-point parameters and buffers change

    def make_inputs(device: str) -> tuple[tuple, dict]:
        args, kwargs = cpu_inputs()
        return place_inputs(args, kwargs, device, dtype)

    args, kwargs = make_inputs(options.device)
    return BuiltModel(
        name=name,
        model=model,
        args=args,
        kwargs=kwargs,
        options=options,
        basic_blocks=tuple(basic_blocks),
        make_inputs=make_inputs,
        num_parameters=count_parameters(model),
    )
