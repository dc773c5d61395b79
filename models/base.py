"""Public types of the model zoo: options, zoo entries, built models and the error type.

These are plain data holders; the logic that fills and checks them lives in
:mod:`ftcompile.models.common`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


class ZooError(ValueError):
    """Every user-facing failure of the zoo.

    Raised for an unknown model name (the message lists the whole zoo), an option the
    model does not take or cannot honour, an unusable pretrained checkpoint directory,
    and a user model file that is missing, lacks the function, or returns the wrong thing.
    Subclasses ``ValueError`` so callers that only know "bad argument" still catch it.
    """


@dataclass(frozen=True)
class ModelOptions:
    """How to build a model; ``None`` means "the zoo entry's default".

    Attributes:
        batch_size: examples per batch of the example inputs.
        seq_len: sequence length for GPT-2, BERT and the token-based synthetic nets.
            ViT, T5, ``encdec`` and ``mlp`` reject it.
        encoder_len: encoder (source) length; T5 and ``encdec`` only.
        decoder_len: decoder (target) length; T5 and ``encdec`` only.
        device: ``"auto"`` builds models of at least 500M parameters on ``"meta"`` and
            smaller ones on ``"cpu"``; otherwise ``"cpu"``, ``"meta"``, ``"cuda"`` or
            ``"cuda:N"``.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``; applied to the parameters
            and to floating-point inputs. ``None``: float32 for a zoo model; a user model
            keeps the dtypes its function built (a bfloat16 base with float32 adapters
            stays so).
        pretrained: a local HuggingFace checkpoint directory (``config.json`` plus
            ``*.safetensors``); its config replaces the entry's size.
        seed: seeds the random weights and the example inputs.
        attention: HuggingFace models only: ``"sdpa"`` (torch's fused
            ``scaled_dot_product_attention``, what transformers runs by default) or
            ``"eager"`` (the explicit ``softmax(q k^T) v`` that materialises the
            ``s x s`` attention matrix); ``None`` is SDPA where the architecture
            supports it, eager otherwise.
    """

    batch_size: int | None = None
    seq_len: int | None = None
    encoder_len: int | None = None
    decoder_len: int | None = None
    device: str = "auto"
    dtype: str | None = None
    pretrained: str | None = None
    seed: int = 0
    attention: str | None = None


@dataclass(frozen=True)
class ZooEntry:
    """One named model of the zoo, as listed by :func:`list_models`.

    Attributes:
        name: the zoo name, e.g. ``"gpt2-xl"``.
        family: ``"gpt2"``, ``"bert"``, ``"t5"``, ``"vit"`` or ``"synthetic"``.
        description: one line for listings (architecture, dimensions, caveats).
        approx_parameters: unique parameter count of the default build.
        default_options: the options used where the caller leaves a field ``None``;
            length fields that do not apply to the model stay ``None``.
    """

    name: str
    family: str
    description: str
    approx_parameters: int
    default_options: ModelOptions


@dataclass
class BuiltModel:
    """A constructed model with example inputs, ready to trace.

    ``model(*args, **kwargs)`` returns the scalar training loss as its first output.
    The model is left in training mode (dropout active) because the compiler
    partitions a training step.

    Attributes:
        name: the zoo name, or ``"path/file.py:fn"`` for a user model.
        model: the module, on ``options.device`` in ``options.dtype``.
        args: example positional inputs on the model's device.
        kwargs: example keyword inputs (labels, ``use_cache=False``, ...).
        options: the resolved options: applicable lengths and batch size filled in,
            device resolved to a concrete device (never ``"auto"``).
        basic_blocks: class names suggested as layer granularity for partitioning.
        make_inputs: ``make_inputs(device) -> (args, kwargs)`` with real values seeded by
            ``options.seed``, of the same shapes and dtypes as ``args``/``kwargs``.
        num_parameters: unique parameters (tied weights counted once).
    """

    name: str
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    options: ModelOptions
    basic_blocks: tuple[str, ...]
    make_inputs: Callable[[str], tuple[tuple, dict]]
    num_parameters: int
