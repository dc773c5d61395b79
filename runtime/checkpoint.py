"""Checkpoints: one shard per stage, written atomically, resumed by any plan-compatible run.

Layout of a checkpoint folder::

    DIR/latest                         the name of the newest complete checkpoint
    DIR/step-00000020/stage_3.safetensors   a stage's weights (canonical names)
    DIR/step-00000020/stage_3.state.pt      its optimizer and LR-scheduler state
    DIR/step-00000020/rank_1.done           rank 1 wrote all its shards
    DIR/step-00000020/meta.json             step, schedule, package, written last

Every file goes through a temporary file and a rename; ``meta.json`` is written
(by the logging rank, once every rank's ``.done`` marker is there) before
``latest`` moves, so a crash at any moment leaves the previous checkpoint
usable. Ranks on several hosts need ``DIR`` on a shared file system.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .atomic import atomic_path, atomic_write_text

FORMAT = "ftcompile.checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not belong to this package."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_shards(root: str | os.PathLike, step: int, rank: int, state: dict[int, dict]) -> None:
    """Write this rank's stages (``RankEngine.state()``) for the checkpoint after ``step`` steps."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    for sid, s in state.items():
        with atomic_path(d / f"stage_{sid}.safetensors") as tmp:
            save_file({n: t.detach().to("cpu").contiguous() for n, t in s["weights"].items()}, str(tmp))
        with atomic_path(d / f"stage_{sid}.state.pt") as tmp:
            torch.save({"optimizer": s["optimizer"], "scheduler": s["scheduler"]}, tmp)
    atomic_write_text(d / f"rank_{rank}.done", json.dumps(sorted(state)))


def commit(root: str | os.PathLike, step: int, ranks: int, meta: dict, *, timeout_s: float = 300.0) -> Path:
    """Wait for every rank's shards, then write ``meta.json`` and point ``latest`` at this checkpoint."""
    d = step_dir(root, step)
    deadline = time.monotonic() + timeout_s
    while not all((d / f"rank_{r}.done").exists() for r in range(ranks)):
        if time.monotonic() > deadline:
            missing = [r for r in range(ranks) if not (d / f"rank_{r}.done").exists()]
            raise CheckpointError(f"{d}: ranks {missing} did not write their shards within {timeout_s:.0f} s")
        time.sleep(0.05)
    atomic_write_text(d / "meta.json", json.dumps({"format": FORMAT, "version": VERSION, "step": step, **meta},
                                                  indent=1))
    atomic_write_text(Path(root) / "latest", d.name + "\n")
    return d


def latest(root: str | os.PathLike) -> tuple[int, Path, dict] | None:
    """The newest complete checkpoint under ``root``: ``(step, folder, meta)``, or None if there is none."""
    root = Path(root)
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    d = root / name
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{d}: meta.json is missing or damaged ({exc}); resume from an older step folder "
                              f"by writing its name into {root / 'latest'}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{d} is not an ftcompile checkpoint of version {VERSION}")
    return int(meta["step"]), d, meta


def load_shards(folder: Path, stages: list[int], device: torch.device) -> dict[int, dict]:
    """The states of ``stages`` from one checkpoint folder (see :func:`save_shards`)."""
    out = {}
    for sid in stages:
        w, s = folder / f"stage_{sid}.safetensors", folder / f"stage_{sid}.state.pt"
        if not w.exists() or not s.exists():
            raise CheckpointError(f"{folder} has no shard for stage {sid}: the checkpoint was written for another "
                                  "plan; resume with the package it was trained with")
        try:
            extra = torch.load(s, map_location=device, weights_only=False)
            out[sid] = {"weights": load_file(str(w), device=str(device)), **extra}
        except Exception as exc:  # noqa: BLE001 - torch and safetensors raise many kinds on a damaged file
            raise CheckpointError(f"{folder}: the shard of stage {sid} cannot be read ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}); resume from an older step "
                                  f"folder by writing its name into {folder.parent / 'latest'}") from None
    return out
