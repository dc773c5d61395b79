"""Loading a local HuggingFace checkpoint directory (``config.json`` + ``*.safetensors``).

Only local files are read (``local_files_only=True``); nothing is downloaded. Every
failure is reported as a :class:`ZooError` that names the directory and, for a shape
mismatch, the offending tensors.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from .base import ModelOptions, ZooError
from .common import DTYPES

_MAX_LISTED = 5  # mismatching tensors quoted in one error message


def checkpoint_files(directory: str) -> list[Path]:
    """The checkpoint's safetensors files, after checking the directory is usable."""
    path = Path(directory)
    if not path.is_dir():
        raise ZooError(f"pretrained directory {directory!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ZooError(f"pretrained directory {directory!r} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ZooError(
            f"pretrained directory {directory!r} has no *.safetensors weights "
            "(only safetensors is supported; re-save with save_pretrained(..., safe_serialization=True))"
        )
    return files


def load_config(directory: str, family: str):
    """The transformers config of ``directory``, which must belong to ``family``."""
    checkpoint_files(directory)
    from transformers import AutoConfig  # heavy: imported on first use only

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # malformed JSON, unknown model_type, ...
        raise ZooError(f"cannot read config.json in {directory!r}: {exc}") from exc
    if config.model_type != family:
        raise ZooError(
            f"pretrained directory {directory!r} holds a {config.model_type!r} model, "
            f"but the zoo entry is a {family!r} model"
        )
    return config


def _checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from the safetensors headers, without reading any tensor data."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as exc:
            raise ZooError(f"cannot read safetensors file {str(file)!r}: {exc}") from exc
    return shapes


def _model_key(key: str, expected: dict[str, tuple[int, ...]], prefix: str) -> str | None:
    """The model's name for checkpoint tensor ``key``, if any.

    Checkpoints of a bare base model (e.g. GPT2Model) omit the head's prefix
    (``transformer.``), and head checkpoints may carry it where our model does not.
    """
    candidates = [key]
    if prefix:
        candidates.append(f"{prefix}.{key}")
        if key.startswith(prefix + "."):
            candidates.append(key[len(prefix) + 1:])
    return next((c for c in candidates if c in expected), None)


def check_checkpoint(directory: str, model: torch.nn.Module) -> None:
    """Raise a ZooError unless the checkpoint's tensors fit ``model`` (may be on meta).

    Checkpoint tensors with no counterpart are left to transformers, which knows the
    legacy renamings; this check only insists on at least one match and on equal
    shapes wherever names match.
    """
    shapes = _checkpoint_shapes(checkpoint_files(directory))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", "")
    matched, mismatched = 0, []
    for key, shape in shapes.items():
        name = _model_key(key, expected, prefix)
        if name is None:
            continue
        matched += 1
        if expected[name] != shape:
            mismatched.append(f"{key}: checkpoint {list(shape)} vs model {list(expected[name])}")
    cls = type(model).__name__
    if shapes and not matched:
        example = next(iter(shapes))
        raise ZooError(
            f"no tensor in {directory!r} matches a {cls} parameter (e.g. {example!r}); "
            "is it a checkpoint of this family?"
        )
    if mismatched:
        more = len(mismatched) - _MAX_LISTED
        listed = "; ".join(mismatched[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
        raise ZooError(f"checkpoint {directory!r} does not fit {cls}: shape mismatch in {listed}")


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' "Loading weights" bar off for the duration, then back as it was.

    ftcompile draws its own progress (and none with --quiet or --json); a second bar
    from inside the library would interleave with it on stderr.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    except ImportError:  # pragma: no cover - transformers always brings huggingface_hub
        are_progress_bars_disabled = disable_progress_bars = None
    hub_was_disabled = are_progress_bars_disabled() if are_progress_bars_disabled else None
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()   # also re-enables the hub's bars...
            if hub_was_disabled and disable_progress_bars is not None:
                disable_progress_bars()        # ...which someone had switched off on their own


def load_weights(directory: str, model_cls, config, options: ModelOptions) -> torch.nn.Module:
    """Load the checkpoint into a fresh ``model_cls`` on ``options.device``, in training mode."""
    try:
        with no_progress_bars():
            model = model_cls.from_pretrained(
                directory, config=config, local_files_only=True, dtype=DTYPES[options.dtype]
            )
    except Exception as exc:
        raise ZooError(f"cannot load pretrained weights from {directory!r}: {exc}") from exc
    # from_pretrained returns the model in eval mode; the compiler traces training.
    model.train()
    return model.to(options.device)
