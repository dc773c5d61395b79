"""The zoo's public entry points: :func:`list_models`, :func:`get_entry`, :func:`build_model`."""

from __future__ import annotations

import functools
from typing import Callable

from .base import BuiltModel, ModelOptions, ZooEntry, ZooError
from .hf import hf_entries
from .synthetic import synthetic_entries
from .user import build_user_model, is_user_spec

Builder = Callable[[ModelOptions], BuiltModel]


@functools.cache
def _zoo() -> dict[str, tuple[ZooEntry, Builder]]:
    entries = [*hf_entries(), *synthetic_entries()]
    zoo = {entry.name: (entry, build) for entry, build in entries}
    assert len(zoo) == len(entries), "duplicate zoo name"
    return zoo


def list_models() -> list[ZooEntry]:
    """Every zoo entry, grouped by family and ordered by size within a family."""
    return [entry for entry, _ in _zoo().values()]


def get_entry(name: str) -> ZooEntry:
    """The zoo entry called ``name``; a ZooError listing the zoo if there is none."""
    try:
        return _zoo()[name][0]
    except KeyError:
        raise ZooError(
            f"unknown model {name!r}; the zoo has: {', '.join(_zoo())} "
            "(or give a user model as 'path/to/file.py:function')"
        ) from None


def build_model(name: str, options: ModelOptions = ModelOptions()) -> BuiltModel:
    """Build a zoo model, or a user model given as ``"path/to/file.py:function"``.

    The model is in training mode on ``options.device`` (``"auto"``: models of 500M
    parameters or more go to ``"meta"``, where no weight memory is allocated), with
    weights seeded by ``options.seed``. Its first output on the returned example inputs
    is the scalar training loss.

    Raises:
        ZooError: unknown name, an option the model does not take, an unusable
            pretrained directory, or a broken user model file.
    """
    if name not in _zoo() and is_user_spec(name):
        return build_user_model(name, options)
    get_entry(name)  # raises the listing error for an unknown name
    return _zoo()[name][1](options)
