"""Averaging gradients across the replicas of a stage (data x pipeline parallelism).

Each stage's trainable gradients are packed into buckets of at most :data:`BUCKET_BYTES`,
summed across the replicas with one all-reduce per bucket on the stage's replica group,
and divided by the number of replicas. Every member ends with the same bits (an
all-reduce gives all members one result), so replicas that start equal stay equal.
"""

from __future__ import annotations

import torch

#: The largest flat buffer one all-reduce carries; the memory model counts one bucket per update.
BUCKET_BYTES = 32 * 2**20


def buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` grouped into consecutive buckets of one dtype and device, each at most
    ``limit`` bytes (a tensor larger than ``limit`` gets a bucket of its own)."""
    out: list[list[int]] = []
    size = 0
    key = None
    for i, t in enumerate(tensors):
        nb = t.numel() * t.element_size()
        k = (t.dtype, t.device)
        if out and k == key and size + nb <= limit:
            out[-1].append(i)
            size += nb
        else:
            out.append([i])
            size, key = nb, k
    return out


def average(grads: list[torch.Tensor], replicas: int, allreduce) -> None:
    """Average ``grads`` (in place) over ``replicas`` members; ``allreduce(flat)`` sums a flat tensor
    across the members in place and returns when every member's result is in ``flat``."""
    if replicas < 2 or not grads:
        return
    for idx in buckets(grads):
        parts = [grads[i] for i in idx]
        flat = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1).clone()
        allreduce(flat)
        flat.div_(replicas)
        off = 0
        for p in parts:
            n = p.numel()
            p.copy_(flat[off:off + n].view_as(p))
            off += n


class ReplicaGroup:
    """The replicas of one stage: averages its gradients on a thread of its own, so the rank keeps
    running its other stages meanwhile (each stage's all-reduces are issued in step order, which is
    the same on every member)."""

    def __init__(self, stage: int, replicas: int, allreduce, notify):
        import queue
        import threading

        self.stage, self.replicas, self._allreduce, self._notify = stage, replicas, allreduce, notify
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: dict[int, BaseException | None] = {}      # step -> None when done, or its error
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"allreduce-{stage}")
        self._thread.start()

    def submit(self, step: int, grads: list[torch.Tensor]) -> None:
        self._jobs.put((step, grads))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, grads = job
            try:
                average(grads, self.replicas, self._allreduce)
                err = None
            except BaseException as exc:  # noqa: BLE001 - handed to the engine, which names the stage
                err = exc
            self._notify(self, step, err)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
