"""The model zoo: named models with example inputs, ready for the compiler.

>>> from ftcompile.models import build_model, ModelOptions
>>> built = build_model("gpt2-tiny", ModelOptions(batch_size=2))
>>> loss = built.model(*built.args, **built.kwargs)[0]

Families: GPT-2, BERT (question answering), T5 and ViT from ``transformers`` with
configs written in code, plus small synthetic nets (``mlp``, ``skipnet``,
``encdec``). A user model is named ``"path/to/file.py:function"``.
"""

from .base import BuiltModel, ModelOptions, ZooEntry, ZooError
from .registry import build_model, get_entry, list_models

__all__ = [
    "BuiltModel",
    "ModelOptions",
    "ZooEntry",
    "ZooError",
    "build_model",
    "get_entry",
    "list_models",
]
