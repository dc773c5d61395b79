"""A checkpoint's weights as the original model's: what a user loads back after training.

A checkpoint holds weights and optimizer state by canonical name across stage files
(:mod:`.checkpoint`). :func:`model_state` gives the weights alone, keyed as the original model
names them (``model.state_dict()``'s keys), and :func:`write_weights` writes them as one
``model.safetensors``, the file ``transformers``' ``from_pretrained`` reads beside a
``config.json``. A tensor the model ties under several names (an embedding and its head) is
written once, under its canonical name, as ``save_pretrained`` does: ``from_pretrained`` ties
it again, and ``load_state_dict(..., strict=False)`` fills every name that shares it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .package import Package

__all__ = ["ExportError", "check_new_folder", "exported", "model_state", "write_weights", "WEIGHTS_FILE"]

WEIGHTS_FILE = "model.safetensors"
# What transformers reads beside the weights; copied from the --pretrained folder the package
# was compiled from, where it still exists.
CONFIG_FILES = ("config.json", "generation_config.json")


class ExportError(ValueError):
    """The checkpoint is not this package's, or the output folder cannot be written."""


def exported(manifest) -> list[str]:
    """The names export writes: the model's parameters and the buffers of its ``state_dict``; not
    its non-persistent buffers (rotary tables, BERT's position ids) nor the constants its forward
    makes (``lifted_tensor_0``), which a package holds but the model's ``state_dict`` does not."""
    return [n for n, s in manifest.params.items()
            if s.kind == "parameter" or (s.kind == "buffer" and s.persistent)]


def model_state(package: Package, ck: ckpt.Checkpoint) -> dict[str, torch.Tensor]:
    """The parameters and buffers of checkpoint ``ck`` (under AvgPipe its reference model) by the
    original model's names, on the CPU, each checked against the digest the checkpoint recorded.

    Raises :class:`ExportError` when ``ck`` was trained with another package, or lacks or
    reshapes one of the package's tensors."""
    other = ckpt.other_package(ck, package.manifest)
    if other:
        raise ExportError(f"{other}: export it with the package it was trained with")
    specs = package.manifest.params
    names = exported(package.manifest)
    weights = ckpt.load(ck, names, optimizer=False)["weights"]
    out = {}
    for name in names:
        spec, t = specs[name], weights[name]       # load() refuses a checkpoint lacking one
        if tuple(t.shape) != tuple(spec.shape):
            raise ExportError(f"{ck.folder}: {name} has shape {list(t.shape)}, the package's is {list(spec.shape)}; "
                              "export it with the package it was trained with")
        out[name] = t.contiguous()
    return out


def check_new_folder(out: str | os.PathLike) -> Path:
    """``out`` as a folder export may create: it must not exist (export never overwrites) and its
    parent must. Ask before reading a checkpoint; :func:`write_weights` asks again."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} exists; give a new folder (-o), export never overwrites")
    if not out.parent.is_dir():
        raise ExportError(f"the folder {out.parent} does not exist; create it, or give -o inside an existing folder")
    return out


def write_weights(state: dict[str, torch.Tensor], out: str | os.PathLike, *, config_from: str | None = None,
                  metadata: dict[str, str] | None = None) -> list[Path]:
    """Write ``state`` into the new folder ``out`` as :data:`WEIGHTS_FILE`, with the
    :data:`CONFIG_FILES` of ``config_from`` (a HuggingFace folder) where it has them; returns the
    files written. The folder appears whole or not at all (written beside it, then renamed), and
    an existing ``out`` is refused, never overwritten."""
    from safetensors.torch import save_file

    out = check_new_folder(out)
    tmp = out.parent / f".tmp-export-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp / WEIGHTS_FILE, 0o666 & ~mask)       # safetensors writes 0600
        if config_from is not None:
            for name in CONFIG_FILES:
                if (Path(config_from) / name).is_file():
                    shutil.copyfile(Path(config_from) / name, tmp / name)
        os.rename(tmp, out)
    except Exception as exc:  # noqa: BLE001 - safetensors reports I/O errors as SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0] if str(exc) else ""
        raise ExportError(f"cannot write {out}: {type(exc).__name__}: {why}") from None
    return sorted(out.iterdir())
