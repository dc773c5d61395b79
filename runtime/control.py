"""The ranks' control plane: small collectives and heartbeats, beside the data transport.

* :class:`Control` holds a gloo process group of all ranks for what is not pipeline data:
  agreeing that every rank may start, the run id, and the collective checkpoint save
  (``torch.distributed.checkpoint`` needs a torch process group). Under ``torch.distributed``
  transports it is a group of its own (checkpoint collectives never queue behind, or beside,
  the receiver threads' point-to-point traffic on the default group); under MPI, where no
  torch process group exists, rank 0 serves a ``TCPStore`` whose address the ranks learn
  through MPI, and a gloo group is built on it.
* :class:`Heartbeat` tells a dead or stopped peer from a slow one: each rank bumps a counter
  in a store every few seconds from a thread of its own, and watches everyone else's. A peer
  whose counter stops for ``--heartbeat-timeout`` seconds (its process stopped, frozen, or its
  host unreachable) is reported at once; a slow peer keeps beating and is waited for up to
  ``--timeout``. The store is the elastic agent's when ``torchrun`` or ``ftcompile run``
  started the ranks (it lives in the launcher, so a stopped rank cannot stall it), else rank 0's.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Callable

HEARTBEAT_TIMEOUT_S = 60.0


def reachable_address(peer: str | None) -> str:
    """This host's address as a peer sees it: the interface that routes to ``peer``."""
    if not peer or peer in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))             # UDP connect sends nothing; it picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Control:
    """A gloo group of all ranks, a store, and object collectives on them (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, group, store, prefix: str, *, owns_default_group: bool,
                 hosts_store: bool):
        self.rank, self.world_size = rank, world_size
        self.group, self.store, self.prefix = group, store, prefix
        self._owns_default_group, self.hosts_store = owns_default_group, hosts_store

    @classmethod
    def connect(cls, launch, transport, *, timeout_s: float) -> "Control":
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        rank, world = launch.rank, launch.world_size
        env = os.environ
        if dist.is_initialized():
            group = dist.new_group(backend="gloo", timeout=timeout)
            owns, hosts = False, False
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env:
                store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
                prefix = f"ftcompile/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
            else:
                store, hosts = cls._rank0_store(rank, world, timeout,
                                                lambda obj: _broadcast(dist, obj, group),
                                                reachable_address(env.get("MASTER_ADDR")))
                prefix = "ftcompile"
        else:                                # MPI: bootstrap a gloo group through MPI
            comm = transport.comm
            names = comm.allgather(socket.gethostname())
            addr = "127.0.0.1" if len(set(names)) == 1 else env.get("FTCOMPILE_CONTROL_ADDR") or \
                reachable_address("8.8.8.8")
            store, hosts = cls._rank0_store(rank, world, timeout, lambda obj: comm.bcast(obj, root=0), addr)
            dist.init_process_group("gloo", store=dist.PrefixStore("ftcompile-control", store), rank=rank,
                                    world_size=world, timeout=timeout)
            group, owns, prefix = None, True, "ftcompile"
        return cls(rank, world, group, store, prefix, owns_default_group=owns, hosts_store=hosts)

    @staticmethod
    def _rank0_store(rank: int, world: int, timeout, broadcast: Callable, address: str):
        import torch.distributed as dist

        if rank == 0:
            store = dist.TCPStore("0.0.0.0", 0, world, True, timeout=timeout, wait_for_workers=False)
            broadcast((address, store.port))
            return store, True
        addr, port = broadcast(None)
        return dist.TCPStore(addr, port, world, False, timeout=timeout), False

    # ------------------------------------------------------------------ collectives
    def broadcast(self, obj, src: int = 0):
        import torch.distributed as dist

        return _broadcast(dist, obj, self.group, src)

    def all_gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        """Leave; the rank serving the store waits (bounded) until every rank has left."""
        import torch.distributed as dist

        try:
            left = self.store.add(f"{self.prefix}/left", 1)
            if self.hosts_store:
                deadline = time.monotonic() + 30
                while left < self.world_size and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = self.store.add(f"{self.prefix}/left", 0)
        except Exception:  # noqa: BLE001 - leaving: a peer's store may already be gone
            pass
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()


def _broadcast(dist, obj, group, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class Heartbeat:
    """Beats for this rank and watches the others' beats (see the module docstring).

    ``describe(rank)`` names a rank in messages (``"rank 1 (stages [1])"``); ``on_failure(message, peer)``
    is called once, from a background thread, when a peer stops beating (``peer``: its rank, or
    None when the store's host is the launcher); if the process has
    not ended ``grace_s`` later (its main thread blocked in a collective), it exits with status 1.
    """

    def __init__(self, control: Control, *, timeout_s: float, describe: Callable[[int], str],
                 on_failure: Callable[[str, int | None], None], grace_s: float = 5.0):
        self.c, self.timeout_s, self.describe, self.on_failure = control, timeout_s, describe, on_failure
        self.interval = max(0.2, min(5.0, timeout_s / 6))
        self.grace_s = grace_s
        self.phase = "starting"
        self._stop = threading.Event()
        self._failed = threading.Event()
        self._lock = threading.Lock()
        peers = [r for r in range(control.world_size) if r != control.rank]
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in peers}      # counter, when it last changed
        self._done: set[int] = set()
        self._store_ok = now
        self._store = None
        self._threads: list[threading.Thread] = []

    def _key(self, what: str, rank: int) -> str:
        return f"{self.c.prefix}/{what}/{rank}"

    def start(self) -> "Heartbeat":
        import torch.distributed as dist

        # A store client of our own: the control's is used by the main thread.
        st = self.c.store
        self._store = dist.TCPStore(st.host, st.port, is_master=False,
                                    timeout=datetime.timedelta(seconds=max(self.timeout_s, 30)))
        for target, name in ((self._beat, "heartbeat"), (self._watch, "heartbeat-watch")):
            t = threading.Thread(target=target, daemon=True, name=name)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """This rank is done: peers stop watching it, and it stops watching them."""
        self._stop.set()
        try:
            if self._store is not None:
                self._store.add(self._key("done", self.c.rank), 1)
        except Exception:  # noqa: BLE001 - the store's host may have left already
            pass
        for t in self._threads:
            t.join(timeout=2 * self.interval)

    def _beat(self) -> None:
        store = self._store
        while not self._stop.is_set():
            try:
                store.add(self._key("hb", self.c.rank), 1)
                now_counts = {}
                for r in list(self._seen):
                    if r in self._done:
                        continue
                    if store.add(self._key("done", r), 0):
                        self._done.add(r)
                        continue
                    now_counts[r] = store.add(self._key("hb", r), 0)
                now = time.monotonic()
                with self._lock:
                    self._store_ok = now
                    for r, n in now_counts.items():
                        if n != self._seen[r][0]:
                            self._seen[r] = (n, now)
            except Exception as exc:  # noqa: BLE001 - the store's host is gone
                if not self._stop.is_set():
                    self._fail(f"rank {self.c.rank} ({self.phase}): lost the heartbeat store "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                               f"{self._store_host()} has stopped or its host is unreachable", self._store_rank())
                return
            self._stop.wait(self.interval)

    def _store_rank(self) -> int | None:
        return None if self.c.prefix.startswith("ftcompile/") else 0

    def _store_host(self) -> str:
        return "the launcher" if self._store_rank() is None else self.describe(0)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            with self._lock:
                stale_store = now - self._store_ok
                late = [(r, now - t) for r, (_, t) in self._seen.items() if r not in self._done]
            if self._failed.is_set():
                return
            if stale_store > self.timeout_s:
                self._fail(f"rank {self.c.rank} ({self.phase}): the heartbeat store has not answered for "
                           f"{stale_store:.0f} s: {self._store_host()} is stopped or frozen, or its host is "
                           "unreachable", self._store_rank())
                return
            for r, age in sorted(late, key=lambda x: -x[1]):
                if age > self.timeout_s:
                    self._fail(f"rank {self.c.rank} ({self.phase}): {self.describe(r)} sent no heartbeat for "
                               f"{age:.0f} s: its process is stopped or frozen, or its host is unreachable "
                               "(a slow rank keeps its heartbeat; --heartbeat-timeout sets the limit)", r)
                    return

    def _fail(self, message: str, peer: int | None) -> None:
        if self._failed.is_set() or self._stop.is_set():
            return
        self._failed.set()
        try:
            self.on_failure(message, peer)
        finally:
            # The main thread may sit in a collective that only a timeout would end.
            timer = threading.Timer(self.grace_s, lambda: os._exit(1))
            timer.daemon = True
            timer.start()
