"""Point-to-point transports between ranks, and launcher detection.

A transport moves *messages* between two ranks: a small header (eight int64:
kind, indices, byte count) followed by a payload tensor. Messages between a
pair of ranks arrive in the order they were sent; the engine runs one receiver
thread per peer that reads a header, receives the payload into a buffer shaped
from the manifest, and hands it over. Sends are non-blocking.

* :class:`TorchTransport`: ``torch.distributed`` with gloo (CPU tensors; a CUDA
  tensor is staged through host memory) or NCCL (CUDA tensors, headers over a
  gloo group).
* :class:`MPITransport`: MPI through ``mpi4py`` (needs ``MPI_THREAD_MULTIPLE``;
  CPU buffers, or device buffers when the MPI build is CUDA-aware).

:func:`detect_launcher` reads the environment torchrun, mpirun or
``ftcompile run`` set up, so that nothing assumes one host.
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass

import torch

HEADER = 8          # int64 words
TAG = 7


class TransportError(RuntimeError):
    """A peer is unreachable or a message was lost."""


@dataclass(frozen=True)
class Launch:
    """Who this process is: rank, world size, local rank, and what started it."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str          # "torchrun", "mpirun", "ftcompile", "single"


def detect_launcher(env: dict | None = None) -> Launch:
    """Rank and world size from torchrun (``RANK``), Open MPI / MPICH / Slurm-PMI, or nothing (one rank)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        who = "ftcompile" if env.get("FTCOMPILE_LAUNCHER") == "ftcompile" else "torchrun"
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), who)
    for rank, size, local in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
                              ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK")):
        if rank in env and size in env:
            return Launch(int(env[rank]), int(env[size]), int(env.get(local, 0)), "mpirun")
    return Launch(0, 1, 0, "single")


class TorchTransport:
    """``torch.distributed`` point-to-point: gloo on CPU, NCCL for CUDA payloads."""

    def __init__(self, launch: Launch, *, backend: str = "gloo", timeout_s: float = 300.0):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = launch.rank, launch.world_size
        self.backend = backend
        # A receive waits as long as it takes: a peer may have nothing to send for a long
        # time (it feeds other ranks). Hangs are the engine's to detect, with its own timeout;
        # a dead peer still fails a receive at once (its connection closes).
        timeout = datetime.timedelta(days=365)
        if not dist.is_initialized():
            if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
                raise TransportError("torch.distributed needs MASTER_ADDR and MASTER_PORT: start the ranks with "
                                     "`ftcompile run --nproc N` or torchrun, or use --transport mpi under mpirun")
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, timeout=timeout)
        # Headers always go over gloo; NCCL, when asked for, carries only CUDA payloads.
        self.payload_group = dist.new_group(backend="nccl", timeout=timeout) if backend == "nccl" else None
        self._locks = {r: threading.Lock() for r in range(self.world_size)}

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" or self.payload_group is not None else t.to("cpu")

    def isend(self, dst: int, header: list[int], payload: torch.Tensor | None) -> list:
        """Send a header and its payload to ``dst`` without waiting; returns handles to keep until done."""
        head = torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64)
        works = []
        with self._locks[dst]:
            works.append((self.dist.isend(head, dst, tag=TAG), head))
            if payload is not None:
                p = self._host(payload.contiguous())
                group = self.payload_group if p.device.type == "cuda" else None
                works.append((self.dist.isend(p, dst, group=group, tag=TAG), p))
        return works

    def recv_header(self, src: int) -> list[int]:
        head = torch.empty(HEADER, dtype=torch.int64)
        self.dist.recv(head, src, tag=TAG)
        return head.tolist()

    def recv_payload(self, src: int, buffer: torch.Tensor) -> torch.Tensor:
        if buffer.device.type == "cuda" and self.payload_group is not None:
            self.dist.recv(buffer, src, group=self.payload_group, tag=TAG)
            return buffer
        host = buffer if buffer.device.type == "cpu" else torch.empty_like(buffer, device="cpu")
        self.dist.recv(host, src, tag=TAG)
        return host if host is buffer else buffer.copy_(host, non_blocking=False)

    @staticmethod
    def done(handle) -> bool:
        return handle[0].is_completed()

    @staticmethod
    def wait(handle) -> None:
        handle[0].wait()

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class MPITransport:
    """MPI point-to-point through mpi4py (one communicator; headers and payloads share a tag)."""

    def __init__(self, launch: Launch | None = None, *, timeout_s: float = 300.0):
        try:
            import mpi4py
            mpi4py.rc.thread_level = "multiple"
            from mpi4py import MPI
        except ImportError as exc:
            raise TransportError(f"--transport mpi needs mpi4py ({exc}); install Open MPI "
                                 "(apt install openmpi-bin libopenmpi-dev) and `pip install mpi4py`") from None
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise TransportError("this MPI library does not provide MPI_THREAD_MULTIPLE, which the runtime's "
                                 "receiver threads need; use an MPI build with thread support or --transport gloo")
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self._locks = {r: threading.Lock() for r in range(self.world_size)}

    @staticmethod
    def _bytes(t: torch.Tensor):
        # MPI sees raw bytes: bfloat16 and bool have no numpy/MPI type of their own.
        return t.view(torch.uint8).numpy() if t.dtype != torch.bool else t.view(torch.uint8).numpy()

    def isend(self, dst: int, header: list[int], payload: torch.Tensor | None) -> list:
        head = torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64)
        works = []
        with self._locks[dst]:
            works.append((self.comm.Isend(head.numpy(), dest=dst, tag=TAG), head))
            if payload is not None:
                p = payload.detach().contiguous().to("cpu").reshape(-1)
                works.append((self.comm.Isend(self._bytes(p), dest=dst, tag=TAG), p))
        return works

    def recv_header(self, src: int) -> list[int]:
        head = torch.empty(HEADER, dtype=torch.int64)
        self.comm.Recv(head.numpy(), source=src, tag=TAG)
        return head.tolist()

    def recv_payload(self, src: int, buffer: torch.Tensor) -> torch.Tensor:
        host = buffer if buffer.device.type == "cpu" else torch.empty_like(buffer, device="cpu")
        flat = host.reshape(-1)
        self.comm.Recv(self._bytes(flat), source=src, tag=TAG)
        return host if host is buffer else buffer.copy_(host)

    @staticmethod
    def done(handle) -> bool:
        return handle[0].Test()

    @staticmethod
    def wait(handle) -> None:
        handle[0].Wait()

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


def make_transport(kind: str, launch: Launch, *, device: torch.device, timeout_s: float = 300.0):
    """``kind``: ``auto`` (MPI under mpirun, else gloo, NCCL payloads on CUDA), ``gloo``, ``nccl`` or ``mpi``."""
    if kind == "auto":
        kind = "mpi" if launch.launcher == "mpirun" else ("nccl" if device.type == "cuda" else "gloo")
    if kind == "mpi":
        return MPITransport(launch, timeout_s=timeout_s)
    if kind in ("gloo", "nccl"):
        if kind == "nccl" and device.type != "cuda":
            raise TransportError("--transport nccl needs --device cuda; use gloo on the CPU")
        return TorchTransport(launch, backend=kind, timeout_s=timeout_s)
    raise TransportError(f"unknown transport {kind!r}; choose auto, gloo, nccl or mpi")
