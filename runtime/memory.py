"""What a rank holds in memory, measured by the rank itself.

On a GPU the CUDA caching allocator counts every byte (``torch.cuda.max_memory_allocated``).
On the CPU nothing does, so :class:`MemoryMeter` keeps its own account: every tensor
storage the rank creates while it runs tasks (a dispatch mode sees each operator's
outputs), every buffer its receiver threads allocate, and the weights and optimizer
state it starts with, each counted once by storage and dropped when the storage is
freed (a weak-reference finalizer). Its peak is the most bytes of tensor storage the
rank held at once: weights, gradients, optimizer state, weight versions, activations
kept for backward, receive and send buffers, recomputation buffers and the
activation gradients of a backward. That is what a plan's memory model must bound
(``tests/test_memory.py`` checks it does); interpreter, library and allocator
overheads are outside it, as they are outside the plan's per-GPU figures (which
keep a reserve for them).
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class MemoryMeter:
    """Live bytes of the tensor storages a rank holds, and the most it held at once."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._seen: set[int] = set()
        self.live = 0
        self.peak = 0
        self.enabled = True
        self.label = ""           # what the rank was doing (set by the engine), kept with the peak
        self.peak_label = ""

    def track(self, t) -> None:
        """Count ``t``'s storage (once, however many tensors view it) until it is freed."""
        if not isinstance(t, torch.Tensor) or t.is_meta or not self.enabled:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # tensor subclasses without storage
            return
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
                self.peak_label = self.label
        weakref.finalize(storage, self._free, key, nbytes)

    def track_all(self, tensors: Iterable) -> None:
        for t in tensors:
            self.track(t)

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if key in self._seen:
                self._seen.discard(key)
                self.live -= nbytes

    def take_peak(self) -> int:
        """The peak since the last call; the next period starts from what is live now."""
        with self._lock:
            peak, self.peak = self.peak, self.live
            return peak

    def tracking(self) -> "_Tracking":
        """A context in which every operator output on this thread is counted."""
        return _Tracking(self)


class _Tracking(TorchDispatchMode):
    def __init__(self, meter: MemoryMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.meter.track(t)
        return out


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """The tensors an optimizer keeps (momentum, Adam's moments, step counts)."""
    out = []
    for state in getattr(opt, "state", {}).values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out
