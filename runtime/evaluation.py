"""The loss of a package's model on data it does not train on: held-out evaluation of weights or a checkpoint.

A checkpoint keeps the model a user evaluates (under AvgPipe the reference model, the average
of the parallel pipelines; see :mod:`~ftcompile.runtime.avgpipe`). :func:`evaluate_checkpoint`
puts its weights into every stage of the package and runs the stages one after another in one
process (:class:`~ftcompile.runtime.local.LocalPipeline`), in eval mode (dropout off), without
gradients and without touching any buffer, over the batches given: the model's own loss output,
averaged over the micro-batches. No rank, no process group: it runs wherever the package and the
checkpoint folder can be read, during training (on a finished step folder) or after it.

Held-out data is the caller's: e.g. :func:`~ftcompile.runtime.data.text_batches` over a corpus
the run did not train on (``root=``), cut to a fixed number of batches with
:func:`itertools.islice` so that every checkpoint sees the same samples.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from . import checkpoint as ckpt
from .data import SAMPLE_INDEX, Batch, check_index_ranges, split_micro_batches
from .local import LocalPipeline
from .package import Package

__all__ = ["Evaluation", "EvaluationError", "evaluate", "evaluate_checkpoint", "open_checkpoint"]


class EvaluationError(ValueError):
    """The weights or data cannot be evaluated with this package; the message says what to change."""


@dataclass(frozen=True)
class Evaluation:
    """The mean loss of a model over some batches.

    ``loss``: the model's loss output averaged over the micro-batches (each micro-batch's loss is the
    model's own reduction, e.g. the mean over its tokens; with micro-batches of equal shape this is
    the loss of the whole set); ``micro_batches`` and ``samples`` (rows) evaluated; ``step``: the
    checkpoint's step, None for weights given directly."""

    loss: float
    micro_batches: int
    samples: int
    step: int | None = None


def open_checkpoint(path: str | os.PathLike) -> ckpt.Checkpoint:
    """A checkpoint from a ``--checkpoint-dir`` folder (its ``latest``) or one of its ``step-N`` folders."""
    path = Path(path)
    if (path / ckpt.META).is_file():
        meta = ckpt._read_meta(path)
        return ckpt.Checkpoint(int(meta["step"]), path, meta)
    found = ckpt.latest(path) if path.is_dir() else None
    if found is None:
        raise EvaluationError(f"{path} is neither a checkpoint folder (--checkpoint-dir, with a 'latest') nor one "
                              "of its step folders (step-00000020, with a meta.json): give one of those")
    return found


def _load_weights(pipe: LocalPipeline, weights: Mapping[str, torch.Tensor], where: str) -> None:
    """Copy ``weights`` (canonical name -> tensor) into every stage; a tied tensor goes to each holder."""
    with torch.no_grad():
        for sid, mod in pipe.modules.items():
            own = {n: t for n, t in mod.state_dict().items() if n != "_anchor"}
            missing = sorted(n for n in own if n not in weights)
            if missing:
                raise EvaluationError(f"{where} lacks {missing[0]} (and {len(missing) - 1} more) of stage {sid}: it "
                                      "holds another model's weights; evaluate it with the package it was trained with")
            for n, t in own.items():
                w = weights[n]
                if tuple(w.shape) != tuple(t.shape):
                    raise EvaluationError(f"{where}: {n} has shape {list(w.shape)}, stage {sid} takes {list(t.shape)}; "
                                          "evaluate it with the package it was trained with")
                t.copy_(w)


@torch.no_grad()
def evaluate(package: Package, batches: Iterable[Batch], *, micro_batches: int,
             weights: Mapping[str, torch.Tensor] | None = None, device: str | torch.device = "cpu",
             step: int | None = None) -> Evaluation:
    """The model's mean loss over ``batches`` with ``weights`` (default: the package's own).

    Parameters
    ----------
    package : Package
        The package (:func:`~ftcompile.runtime.load_package`).
    batches : iterable of Batch
        Each of ``micro_batches`` micro-batches (:mod:`~ftcompile.runtime.data`'s layout); a finite
        iterable: every batch is evaluated.
    micro_batches : int
        Micro-batches per batch.
    weights : mapping, optional
        Canonical name -> tensor for every weight and persistent buffer of the package (a
        checkpoint's :func:`~ftcompile.runtime.checkpoint.load_weights`).
    device : str or torch.device
        Where the stages run.

    Raises
    ------
    EvaluationError
        If ``weights`` lack a tensor of the package or have another shape, if no batch was given,
        or if the loss is not finite.
    """
    manifest = package.manifest
    if manifest.loss is None:
        raise EvaluationError("the package's model returns no loss; held-out evaluation needs a model that "
                              "computes its loss (give it labels)")
    pipe = LocalPipeline.build(package, device).train(False)
    if weights is not None:
        _load_weights(pipe, weights, "the weights given" if step is None else f"the checkpoint of step {step}")
    total, n, rows = 0.0, 0, 0
    for i, batch in enumerate(batches):
        mbs = split_micro_batches({k: v for k, v in batch.items() if k != SAMPLE_INDEX}, manifest, micro_batches)
        check_index_ranges(mbs, manifest, f"held-out batch {i}")
        for mb in mbs:
            values, _ = pipe.forward(mb, grad=False, update_buffers=False)
            total += float(values[manifest.loss])
            n += 1
            rows += manifest.micro_batch_size
    if n == 0:
        raise EvaluationError("no batch to evaluate: give at least one held-out batch")
    loss = total / n
    if not math.isfinite(loss):
        raise EvaluationError(f"the held-out loss is {loss}: the weights{'' if step is None else f' of step {step}'} "
                              "have diverged")
    return Evaluation(loss, n, rows, step)


def evaluate_checkpoint(package: Package, checkpoint: str | os.PathLike | ckpt.Checkpoint, batches: Iterable[Batch],
                        *, micro_batches: int, device: str | torch.device = "cpu") -> Evaluation:
    """:func:`evaluate` with the weights of a checkpoint (a ``--checkpoint-dir`` folder: its latest; or a step
    folder): under AvgPipe the reference model. A checkpoint of another model is an :class:`EvaluationError`."""
    ck = checkpoint if isinstance(checkpoint, ckpt.Checkpoint) else open_checkpoint(checkpoint)
    other = ckpt.other_package(ck, package.manifest)
    if other:
        raise EvaluationError(f"{other}: evaluate it with the package it was trained with")
    return evaluate(package, batches, micro_batches=micro_batches, weights=ckpt.load_weights(ck), device=device,
                    step=ck.step)
