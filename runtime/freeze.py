"""The runtime's side of elastic freeze training: Eq. 1, gradient norms per layer.

The compiler side (:mod:`ftcompile.freeze`) decides which layers freeze and plans each phase;
this module holds what the ranks compute while training and what both sides need, so the
runtime never imports the compiler:

* :func:`frozen_layers` (PipeTransformer's Eq. 1), one definition used by the controller;
* :class:`GradNorms`: the gradient norm of every layer at chosen steps, measured on the
  gradients the optimizer steps with (averaged over replicas, shared tensors summed), written
  by each rank for the controller to add up.

AutoCache (the frozen prefix's output per sample, in host memory with a spill to disk, keyed by
sample index, advanced through newly frozen layers) is :mod:`ftcompile.runtime.cache`.
"""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Sequence

import torch

from .atomic import atomic_write_text


class FreezeError(ValueError):
    """A freeze option or schedule cannot be used; the message says what to give instead."""


# --------------------------------------------------------------------------- Eq. 1

def frozen_layers(frozen: int, norms: Sequence[float], alpha: float) -> int:
    """PipeTransformer's Eq. 1: how many leading layers are frozen after this check.

    Parameters
    ----------
    frozen : int
        ``L_frozen^(T-1)``, the layers frozen so far.
    norms : sequence of float
        The gradient norm of every *active* layer, ``norms[i]`` of layer ``frozen + i``
        (so ``L = frozen + len(norms)``).
    alpha : float
        In (0, 1): at most ``floor(alpha (L - frozen))`` more layers freeze at once.

    Returns
    -------
    int
        ``min(frozen + floor(alpha (L - frozen)), l* + 1)``, where ``l*`` is the first active layer
        of the smallest gradient norm: freezing stops at, and includes, the layer that converged
        most. Never fewer than ``frozen``; never all ``L`` layers (``alpha < 1``).
    """
    if not 0 < alpha < 1:
        raise FreezeError(f"alpha must lie strictly between 0 and 1, got {alpha}; the paper uses 1/3")
    if frozen < 0:
        raise FreezeError(f"the frozen layer count cannot be negative, got {frozen}")
    if not norms:
        return frozen
    if any(not math.isfinite(float(g)) or float(g) < 0 for g in norms):
        raise FreezeError(f"gradient norms must be finite and non-negative, got {list(norms)}")
    active = len(norms)
    # A fraction: alpha = 1/3 of 3 active layers is exactly 1 (in floating point, 0.999...).
    a = Fraction(alpha).limit_denominator(10_000)
    bound = frozen + math.floor(a * active)
    best = min(range(active), key=lambda i: (float(norms[i]), i))
    return max(frozen, min(bound, frozen + best + 1))


# --------------------------------------------------------------------------- gradient norms

class GradNorms:
    """Sums of squared gradients per layer at the steps asked for, from one rank's stages.

    ``layers`` are module-path prefixes (``encoder.layer.3``); a parameter belongs to the layer
    whose prefix its name starts with. Only replica 0 measures (replicas hold the same averaged
    gradients), and a tensor shared by several stages counts once (its lowest holder).
    Use as the engine's ``grad_hook``.
    """

    def __init__(self, layers: Sequence[str], steps: set[int], *, shared: dict[str, tuple[int, ...]] | None = None,
                 replica: int = 0):
        self.layers = list(layers)
        self.steps = set(steps)
        self.shared = shared or {}
        self.replica = replica
        self.sq: dict[int, list[float]] = {}

    def layer_of(self, name: str) -> int | None:
        for i, prefix in enumerate(self.layers):
            if name == prefix or name.startswith(prefix + "."):
                return i
        return None

    def __call__(self, stage: int, step: int, params: dict[str, torch.Tensor]) -> None:
        if self.replica != 0 or step not in self.steps:
            return
        row = self.sq.setdefault(step, [0.0] * len(self.layers))
        for name, p in params.items():
            if p.grad is None or (name in self.shared and min(self.shared[name]) != stage):
                continue
            i = self.layer_of(name)
            if i is not None:
                row[i] += float(p.grad.detach().double().pow(2).sum())

    def write(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, json.dumps({"layers": self.layers,
                                            "squares": {str(s): v for s, v in sorted(self.sq.items())}}))


def read_norms(paths: Sequence[str | os.PathLike]) -> dict[int, list[float]]:
    """Step -> gradient norm per layer, adding up the rank files :meth:`GradNorms.write` wrote."""
    total: dict[int, list[float]] = {}
    for path in paths:
        d = json.loads(Path(path).read_text())
        for s, row in d["squares"].items():
            acc = total.setdefault(int(s), [0.0] * len(row))
            for i, v in enumerate(row):
                acc[i] += v
    return {s: [math.sqrt(v) for v in row] for s, row in total.items()}


# --------------------------------------------------------------------------- the ranks' helpers

def grad_norms_hook(args, manifest, layout) -> GradNorms | None:
    """The engine's ``grad_hook`` when ``--grad-norms-at`` asks for gradient norms (else None)."""
    if not getattr(args, "grad_norms_at", None):
        return None
    steps = {int(s) for s in str(args.grad_norms_at).split(",") if s.strip()}
    layers = [p for p in str(args.grad_norms_layers or "").split(",") if p]
    if not layers:
        raise FreezeError("--grad-norms-at needs --grad-norms-layers (the layers' module paths)")
    return GradNorms(layers, steps, shared=manifest.shared_params(),
                     replica=layout.replica if layout is not None else 0)


def phase_record(manifest, layout, cfg, args=None) -> dict:
    """The step log's phase fields: frozen layers, pipeline length P, replicas R, micro-batches M per
    replica and their size b (R x M x b samples a step; in a freeze run: a package with frozen layers,
    or a phase measuring gradient norms)."""
    freeze = (manifest.model or {}).get("freeze")
    if not freeze and not getattr(args, "grad_norms_layers", None):
        return {}
    return {"phase": {"frozen_layers": int((freeze or {}).get("layers", 0)),
                      "layers": (freeze or {}).get("of"),
                      "P": manifest.num_gpus, "R": layout.replicas if layout is not None else 1,
                      "M": cfg.micro_batches, "b": manifest.micro_batch_size}}
