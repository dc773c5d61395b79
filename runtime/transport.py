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
  CPU buffers, or device buffers when the MPI build is CUDA-aware, which Open
  MPI's ``MPIX_Query_cuda_support`` tells).

A CUDA payload that goes through host memory (gloo, MPI) is copied on a stream
of its own into pinned memory, so copies do not queue behind the compute stream's
kernels; NCCL runs its transfers on its own streams already.

NCCL refuses a communicator with two members on one GPU, and ranks do share GPUs: AvgPipe's
N parallel pipelines on P GPUs put stage s of every pipeline on GPU s, and a run may start
more ranks than the host has GPUs. Under ``--transport nccl`` every group whose members
share a GPU (:func:`group_backend`) goes over gloo through host memory instead; the others
keep NCCL.

:func:`detect_launcher` reads the environment torchrun, mpirun or
``ftcompile run`` set up, so that nothing assumes one host.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
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


def gpu_key(device: torch.device) -> str | None:
    """The physical GPU behind ``device``: host name and the GPU's UUID (its index where torch
    gives no UUID), the same in every process whatever ``CUDA_VISIBLE_DEVICES`` numbers it. None
    for the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{socket.gethostname()}:{uuid if uuid is not None else index}"


def _new_group(dist, members, backend: str, timeout: datetime.timedelta):
    """A process group over ``members``, created by every rank, members or not, in one order.

    Not ``use_local_synchronization``: torch names such a group from its ranks and the number
    of groups the calling process already has, so two members that joined different numbers of
    groups before (rank 0 of pairs (0, 1), (0, 2); rank 2 of (0, 2) alone) wait under different
    names for ever. A group every rank creates is named by a count all ranks share.
    """
    return dist.new_group(ranks=sorted(members), backend=backend, timeout=timeout)


def group_backend(members, backend: str, gpu_of: dict[int, str | None]) -> str:
    """The backend of a process group over ``members``: NCCL when the transport's backend is NCCL
    and no two members share a GPU (``gpu_of``: rank -> :func:`gpu_key`), which NCCL refuses;
    gloo otherwise."""
    if backend != "nccl":
        return "gloo"
    keys = [gpu_of.get(r) for r in members]
    return "gloo" if any(k is None for k in keys) or len(set(keys)) < len(keys) else "nccl"


class _HostStaging:
    """Device <-> pinned host copies on a dedicated CUDA stream per device."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            idx = device.index if device.index is not None else torch.cuda.current_device()
            if idx not in self._streams:
                self._streams[idx] = torch.cuda.Stream(device=idx)
            return self._streams[idx]

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t
        s = self._stream(t.device)
        # The copy must see the compute that produced t; only this thread waits for it.
        s.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(s):
            host.copy_(t, non_blocking=True)
        s.synchronize()
        return host

    def host_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        if buffer.device.type != "cuda":
            return buffer
        return torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)

    def to_device(self, host: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        if host is buffer:
            return buffer
        s = self._stream(buffer.device)
        # The buffer belongs to the compute stream: kernels queued there may still read it (a reused
        # receive buffer) or the memory's previous owner (the caching allocator hands freed blocks on
        # at once). Writing before they finish corrupted received activations when 4 ranks shared a GPU.
        s.wait_stream(torch.cuda.current_stream(buffer.device))
        with torch.cuda.stream(s):
            buffer.copy_(host, non_blocking=True)
        # Done before the buffer is handed to a stage, which runs on the compute stream.
        s.synchronize()
        return buffer


class _Send:
    """One message in flight: its works, the tensors they read, and when they are done."""

    __slots__ = ("works", "keep", "finished", "error")

    def __init__(self, works: list, keep: list):
        self.works, self.keep = works, keep
        self.finished = threading.Event()
        self.error: BaseException | None = None


def _wait_all(works: list) -> None:
    for w in works:
        w.wait()


class _SendReaper:
    """Waits on sends in the order they were posted, on a thread of its own."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="send-waiter")
        self._thread.start()

    def track(self, works: list, keep: list) -> _Send:
        send = _Send(works, keep)
        self._queue.put(send)
        return send

    def _loop(self) -> None:
        while True:
            send = self._queue.get()
            if send is None:
                return
            finished = send.finished
            try:
                _wait_all(send.works)
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits on this send
                send.error = TransportError(f"a send failed: {exc}")
            # Free the payload now, and hold no gloo work past the process group's end.
            send.works = send.keep = None
            send = None
            finished.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)


class TorchTransport:
    """``torch.distributed`` point-to-point: gloo on CPU, NCCL for CUDA payloads.

    Headers always travel over gloo. With NCCL, payloads travel on one communicator per
    *direction* between two ranks (a two-member group used only for sends from one to the
    other): a receiver thread's blocking ``recv`` from a peer and the main thread's ``isend``
    to that same peer then never share an NCCL communicator, whose operations run in issue
    order on one stream and would wait for each other in both processes at once. Each group
    is used by one thread per process (the sender's main thread, the receiver's thread for
    that peer). ``pair_groups`` forces these per-direction groups on gloo as well (tests).
    """

    def __init__(self, launch: Launch, *, backend: str = "gloo", timeout_s: float = 300.0,
                 pairs: list[tuple[int, int]] | None = None, pair_groups: bool | None = None,
                 device: torch.device | None = None):
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
        # Which GPU every rank uses: groups of ranks that share one cannot be NCCL groups.
        self._gpu_of: dict[int, str | None] = {}
        if backend == "nccl":
            keys: list = [None] * self.world_size
            dist.all_gather_object(keys, gpu_key(device) if device is not None else None)
            self._gpu_of = dict(enumerate(keys))
        self.nccl_pairs: set[tuple[int, int]] = set()     # (src, dst) whose payloads go over NCCL
        # Payload groups per direction (src, dst), for the pairs NCCL serves (pairs that share a GPU
        # send over the default gloo group, as the gloo transport does). ``pairs`` (the directions
        # the plan uses) keeps their number down; ``pair_groups`` forces them on gloo too (tests).
        use_pairs = backend == "nccl" if pair_groups is None else pair_groups
        self._pair_group: dict[tuple[int, int], object] = {}
        if use_pairs:
            wanted = sorted(set(pairs) if pairs is not None else
                            {(a, b) for a in range(self.world_size) for b in range(self.world_size) if a != b})
            for a, b in wanted:
                pair_backend = group_backend((a, b), backend, self._gpu_of)
                if pair_backend != "nccl" and not pair_groups:
                    continue
                g = _new_group(dist, (a, b), pair_backend, timeout)
                if self.rank in (a, b):
                    self._pair_group[(a, b)] = g
                    if pair_backend == "nccl":
                        self.nccl_pairs.add((a, b))
        self._locks = {r: threading.Lock() for r in range(self.world_size)}
        self._staging = _HostStaging()
        # gloo marks a send complete only inside wait(), so polling is_completed() never frees
        # a payload: a thread per peer waits on its sends in order and flags each one done.
        self._reapers = {r: _SendReaper() for r in range(self.world_size) if r != self.rank}

    def _payload_group(self, src: int, dst: int):
        return self._pair_group.get((src, dst))

    def _host(self, t: torch.Tensor, dst: int) -> torch.Tensor:
        # NCCL moves device memory itself; gloo needs host memory.
        return t if t.device.type == "cpu" or (self.rank, dst) in self.nccl_pairs else self._staging.to_host(t)

    def isend(self, dst: int, header: list[int], payload: torch.Tensor | None) -> list:
        """Send a header and its payload to ``dst`` without waiting; returns handles to keep until done."""
        head = torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64)
        works = []
        with self._locks[dst]:
            try:
                works.append(self.dist.isend(head, dst, tag=TAG))
                keep = [head]
                if payload is not None:
                    p = self._host(payload.contiguous(), dst)
                    group = self._payload_group(self.rank, dst)
                    if group is None and p.device.type == "cuda":
                        raise TransportError(f"rank {self.rank}: no NCCL group for sends to rank {dst}; the "
                                             "transport was built for other rank pairs (a bug)")
                    works.append(self.dist.isend(p, dst, group=group, tag=TAG))
                    keep.append(p)
            except RuntimeError as exc:     # gloo: the connection to dst is gone
                raise TransportError(f"rank {self.rank}: sending to rank {dst} failed, its process is gone "
                                     f"({str(exc).splitlines()[0][:200]}); see rank {dst}'s error") from None
        return [self._reapers[dst].track(works, keep)]

    def recv_header(self, src: int) -> list[int]:
        head = torch.empty(HEADER, dtype=torch.int64)
        self.dist.recv(head, src, tag=TAG)
        return head.tolist()

    def recv_payload(self, src: int, buffer: torch.Tensor) -> torch.Tensor:
        group = self._payload_group(src, self.rank)
        if buffer.device.type == "cuda" and (src, self.rank) in self.nccl_pairs:
            # blocking: the calling thread's current stream waits for the transfer
            self.dist.recv(buffer, src, group=group, tag=TAG)
            return buffer
        host = self._staging.host_buffer(buffer)
        self.dist.recv(host, src, group=group, tag=TAG)
        return self._staging.to_device(host, buffer)

    @staticmethod
    def done(handle) -> bool:
        return handle.finished.is_set()

    @staticmethod
    def wait(handle) -> None:
        handle.finished.wait()
        if handle.error is not None:
            raise handle.error

    def barrier(self) -> None:
        self.dist.barrier()

    def replica_groups(self, groups: dict[int, list[int]]) -> dict[int, object]:
        """One process group per stage over the ranks that run it (one per replica), for the ones this
        rank is in: stage id -> ``allreduce(tensor)``, summing a tensor across the group in place.
        Collective: every rank calls it with the same ``groups`` and creates every group, in stage
        order (see :func:`_new_group`)."""
        out = {}
        for sid in sorted(groups):
            members = sorted(groups[sid])
            backend = group_backend(members, self.backend, self._gpu_of)
            g = _new_group(self.dist, members, backend, datetime.timedelta(days=365))
            if self.rank not in members:
                continue

            def allreduce(t: torch.Tensor, _g=g, _staged=backend != "nccl") -> None:
                if t.device.type == "cuda" and _staged:
                    host = self._staging.to_host(t)
                    self.dist.all_reduce(host, group=_g)
                    t.copy_(host)
                else:
                    self.dist.all_reduce(t, group=_g)
            out[sid] = allreduce
        return out

    def close(self) -> None:
        for reaper in self._reapers.values():
            reaper.stop()
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
        self._staging = _HostStaging()
        self.cuda_aware = mpi_cuda_aware()

    @staticmethod
    def _bytes(t: torch.Tensor):
        # MPI sees raw bytes: bfloat16 and bool have no numpy/MPI type of their own.
        return t.view(torch.uint8).numpy() if t.dtype != torch.bool else t.view(torch.uint8).numpy()

    def _device_bytes(self, t: torch.Tensor):
        # A CUDA-aware MPI reads device memory through __cuda_array_interface__; it knows no
        # CUDA streams, so the kernels that wrote the tensor must have finished.
        torch.cuda.current_stream(t.device).synchronize()
        return t.reshape(-1).view(torch.uint8)

    def isend(self, dst: int, header: list[int], payload: torch.Tensor | None) -> list:
        head = torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64)
        works = []
        with self._locks[dst]:
            works.append((self.comm.Isend(head.numpy(), dest=dst, tag=TAG), head))
            if payload is not None:
                p = payload.detach().contiguous()
                if p.device.type == "cuda" and self.cuda_aware:
                    buf = self._device_bytes(p)
                    works.append((self.comm.Isend(buf, dest=dst, tag=TAG), p))
                else:
                    p = self._staging.to_host(p).reshape(-1)
                    works.append((self.comm.Isend(self._bytes(p), dest=dst, tag=TAG), p))
        return works

    def recv_header(self, src: int) -> list[int]:
        head = torch.empty(HEADER, dtype=torch.int64)
        self.comm.Recv(head.numpy(), source=src, tag=TAG)
        return head.tolist()

    def recv_payload(self, src: int, buffer: torch.Tensor) -> torch.Tensor:
        if buffer.device.type == "cuda" and self.cuda_aware:
            self.comm.Recv(self._device_bytes(buffer), source=src, tag=TAG)
            return buffer
        host = self._staging.host_buffer(buffer)
        flat = host.reshape(-1)
        self.comm.Recv(self._bytes(flat), source=src, tag=TAG)
        return self._staging.to_device(host, buffer)

    @staticmethod
    def done(handle) -> bool:
        return handle[0].Test()

    @staticmethod
    def wait(handle) -> None:
        handle[0].Wait()

    def barrier(self) -> None:
        self.comm.Barrier()

    def replica_groups(self, groups: dict[int, list[int]]) -> dict[int, object]:
        """As :meth:`TorchTransport.replica_groups`, with a communicator split per stage (every rank
        takes part in every split, in stage order, as MPI requires)."""
        MPI = self.MPI
        out = {}
        for sid in sorted(groups):
            members = sorted(groups[sid])
            member = self.rank in members
            comm = self.comm.Split(0 if member else MPI.UNDEFINED, members.index(self.rank) if member else 0)
            if not member:
                continue

            def allreduce(t: torch.Tensor, _c=comm) -> None:
                if t.device.type == "cuda" and self.cuda_aware:
                    _c.Allreduce(MPI.IN_PLACE, self._device_bytes_as(t), op=MPI.SUM)
                    return
                host = self._staging.to_host(t).contiguous()
                buf = host.numpy() if host.dtype not in (torch.bfloat16, torch.float16) else None
                if buf is None:
                    work = host.float()
                    _c.Allreduce(MPI.IN_PLACE, work.numpy(), op=MPI.SUM)
                    host.copy_(work)
                else:
                    _c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                if host is not t:
                    t.copy_(host)
            out[sid] = allreduce
        return out

    def _device_bytes_as(self, t: torch.Tensor):
        torch.cuda.current_stream(t.device).synchronize()
        return t

    def close(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


def mpi_cuda_aware() -> bool:
    """Whether the MPI library mpi4py loaded moves CUDA buffers itself (Open MPI's extension query).

    False for MPI libraries without the query (MPICH, Intel MPI), where CUDA payloads
    go through pinned host memory instead; ``FTCOMPILE_MPI_CUDA_AWARE=0|1`` overrides.
    """
    forced = os.environ.get("FTCOMPILE_MPI_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1"
    import ctypes

    try:
        from mpi4py import MPI

        libs = [ctypes.CDLL(None)]
        path = getattr(MPI, "__file__", None)
        if path:
            libs.append(ctypes.CDLL(path))
        for lib in libs:
            query = getattr(lib, "MPIX_Query_cuda_support", None)
            if query is not None:
                query.restype = ctypes.c_int
                return bool(query())
    except (ImportError, OSError):
        pass
    return False


def make_transport(kind: str, launch: Launch, *, device: torch.device, timeout_s: float = 300.0):
    """``kind``: ``auto`` (MPI under mpirun, else gloo, NCCL payloads on CUDA), ``gloo``, ``nccl`` or ``mpi``."""
    if kind == "auto":
        kind = "mpi" if launch.launcher == "mpirun" else ("nccl" if device.type == "cuda" else "gloo")
    if kind == "mpi":
        return MPITransport(launch, timeout_s=timeout_s)
    if kind in ("gloo", "nccl"):
        if kind == "nccl" and device.type != "cuda":
            raise TransportError("--transport nccl needs --device cuda; use gloo on the CPU")
        return TorchTransport(launch, backend=kind, timeout_s=timeout_s, device=device)
    raise TransportError(f"unknown transport {kind!r}; choose auto, gloo, nccl or mpi")
