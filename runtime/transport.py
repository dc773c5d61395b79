"""Point-to-point transports: torch.distributed (gloo on CPU, NCCL on GPU) and MPI.

The engine needs four operations, the same for every backend:

* ``isend(tensor, dst, tag) -> handle`` (non-blocking; ``handle.wait()``),
* ``recv(tensor, src, tag)`` (blocking, used by one receiver thread per peer),
* ``barrier()`` and ``close()``.

Why blocking receives in threads rather than polled ``irecv``: gloo's ``irecv``
only reports completion from ``wait()`` (``is_completed()`` stays false until
then) and a timed-out wait closes the connection, so arrival cannot be polled.
Each peer's sends are therefore announced by a small header on a per-pair
sequence tag (FIFO), followed by the payload on its own tag, which encodes
(kind, micro-batch, value) uniquely (:func:`payload_tag`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

HEADER_BASE = 1 << 30     # header tags live above every payload tag
TAG_SPACE = 1 << 30


def payload_tag(kind: int, index: int, item: int, num_items: int) -> int:
    """Tag of a payload: ``kind`` (0 activation, 1 gradient, 2 shared grad, 3 norm), micro/mini-batch ``index``, ``item``.

    Unique while fewer than ``TAG_SPACE // (4 * num_items)`` indices are in
    flight between a pair of ranks (indices wrap modulo that).
    """
    wrap = max(1, TAG_SPACE // (4 * max(1, num_items)))
    return ((index % wrap) * max(1, num_items) + item) * 4 + kind


def header_tag(seq: int) -> int:
    return HEADER_BASE + (seq % (1 << 29))


@dataclass
class _Done:
    def wait(self):
        return None


class TorchTransport:
    """torch.distributed point-to-point on an initialised default process group."""

    name = "torch"

    def __init__(self, backend: str | None = None, *, timeout_s: float = 120.0, init: bool = True):
        import torch.distributed as dist
        self.dist = dist
        if init and not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        self.backend = dist.get_backend()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        return self.dist.isend(tensor.contiguous(), dst, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self.dist.recv(tensor, src, tag=tag)

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class MPITransport:
    """MPI through mpi4py (CUDA-aware when the MPI build is; host buffers otherwise)."""

    name = "mpi"

    def __init__(self):
        from mpi4py import MPI  # noqa: F401  (ImportError: the caller reports it)
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.backend = "mpi"
        self.device = torch.device("cpu")

    @staticmethod
    def _buf(t: torch.Tensor):
        # mpi4py takes buffer-protocol objects; bytes view avoids dtype mapping (bf16 etc.)
        return t.detach().contiguous().view(torch.uint8).numpy()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        t = tensor.detach().contiguous().cpu()
        req = self.comm.Isend(self._buf(t), dest=dst, tag=tag % (1 << 30))

        class _H:
            def wait(self_inner, _t=t):   # keeps the buffer alive until sent
                req.Wait()
        return _H()

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        host = tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        self.comm.Recv(self._buf(host), source=src, tag=tag % (1 << 30))
        if host is not tensor:
            tensor.copy_(host)

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass


def detect_launcher(env: dict | None = None) -> dict:
    """Rank/world size/master address from torchrun's or mpirun's environment.

    Returns ``{"launcher": "torchrun"|"mpirun"|"none", "rank", "world_size", "local_rank"}``.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"launcher": "torchrun", "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", env["RANK"]))}
    if "OMPI_COMM_WORLD_RANK" in env:
        return {"launcher": "mpirun", "rank": int(env["OMPI_COMM_WORLD_RANK"]),
                "world_size": int(env["OMPI_COMM_WORLD_SIZE"]),
                "local_rank": int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", env["OMPI_COMM_WORLD_RANK"]))}
    if "PMI_RANK" in env:
        return {"launcher": "mpirun", "rank": int(env["PMI_RANK"]), "world_size": int(env["PMI_SIZE"]),
                "local_rank": int(env.get("MPI_LOCALRANKID", env["PMI_RANK"]))}
    return {"launcher": "none", "rank": 0, "world_size": 1, "local_rank": 0}


def make_transport(kind: str = "auto", *, timeout_s: float = 120.0):
    """Open the transport: ``torch`` (gloo/nccl), ``mpi``, or ``auto`` (mpi under mpirun without MASTER_ADDR)."""
    info = detect_launcher()
    if kind == "auto":
        kind = "mpi" if info["launcher"] == "mpirun" and "MASTER_ADDR" not in os.environ else "torch"
    if kind == "mpi":
        return MPITransport()
    if info["launcher"] == "mpirun":
        os.environ.setdefault("RANK", str(info["rank"]))
        os.environ.setdefault("WORLD_SIZE", str(info["world_size"]))
    return TorchTransport(timeout_s=timeout_s)
