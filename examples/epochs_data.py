"""A finite dataset of ``n`` fixed samples, visited in a fresh order every epoch: ``--data FILE.py:epochs``.

What AutoCache needs to reuse activations, and the smallest dataset that gives it: the same samples
come back epoch after epoch, each named by its index. Use it as any user dataset::

    ftcompile run PACKAGE --data examples/epochs_data.py:epochs --freeze alpha=1/3,every=4,cache=on

:func:`epochs` yields one training step's batch at a time, endlessly. The ``n`` samples are drawn
once, from the package's synthetic recipe (:func:`ftcompile.runtime.data.synthetic_batches` with
``seed + 1000``: the traced shapes, dtypes and value ranges); each epoch is a permutation of them
(``torch.randperm`` seeded by ``seed``), and a step takes the next ``micro_batches x b`` indices
of the running permutation, where ``b`` is the package's micro-batch size, continuing into the
next epoch's permutation when one runs out. A batch holds every tensor input of the model and,
under :data:`~ftcompile.runtime.data.SAMPLE_INDEX`, each row's index in ``0 .. n-1``. The same
``seed`` gives the same batches on every rank, so replicas agree with no message.

``n`` (default 8) is the ``n`` argument when called from Python; under ``--data`` the loader calls
``epochs(manifest=..., micro_batches=..., seed=...)`` only, so ``n`` is read there from the
environment variable ``EPOCHS_DATA_SAMPLES`` of the process that loads the data (``ftcompile
run`` passes its environment to every rank). It must be a positive multiple of ``b``. Keep it the
same over a whole run: it decides which samples exist, and a freeze run's phases (whose ``b`` may
change) must see the same ones. With ``n`` equal to a step's global batch (``R x M x b``) every
step is one epoch: a phase's first step misses (or advances) the cache and its later steps hit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from ftcompile.runtime.data import SAMPLE_INDEX, synthetic_batches

SAMPLES_VARIABLE = "EPOCHS_DATA_SAMPLES"
"""The environment variable giving ``n`` when :func:`epochs` is called without it (``--data``)."""

DEFAULT_SAMPLES = 8


def samples(manifest, n: int | None = None) -> int:
    """The dataset's size: ``n`` if given, else ``$EPOCHS_DATA_SAMPLES``, else 8; checked against ``b``."""
    where = "n"
    if n is None:
        text = os.environ.get(SAMPLES_VARIABLE)
        n, where = (DEFAULT_SAMPLES, "the default") if text is None else (text, f"{SAMPLES_VARIABLE}={text!r}")
    b = manifest.micro_batch_size
    try:
        n = int(n)
    except ValueError:
        n = 0
    if n <= 0 or n % b:
        raise ValueError(f"{where}: the dataset's size must be a positive multiple of the package's micro-batch "
                         f"size {b}; set {SAMPLES_VARIABLE} to one (say {max(b, DEFAULT_SAMPLES // b * b)})")
    return n


def epochs(manifest, micro_batches: int, seed: int = 0, n: int | None = None) -> Iterator[dict]:
    """Endless steps over ``n`` fixed samples (see the module's docstring), each epoch in a fresh order.

    Not a generator itself, so that a bad ``n`` is refused when the loader calls it, before any step."""
    n = samples(manifest, n)
    rows = micro_batches * manifest.micro_batch_size
    table = next(synthetic_batches(manifest, micro_batches=n // manifest.micro_batch_size, seed=seed + 1000))
    return _visit(table, n, rows, seed)


def _visit(table: dict, n: int, rows: int, seed: int) -> Iterator[dict]:
    g = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.int64)
    while True:
        while len(order) < rows:
            order = torch.cat([order, torch.randperm(n, generator=g)])
        take, order = order[:rows], order[rows:]
        yield {**{k: v[take] for k, v in table.items()}, SAMPLE_INDEX: take.clone()}
