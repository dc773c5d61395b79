"""Transports: every message arrives, in order, whatever both ends send at the same time.

Two real ranks send each other many payloads at once, each receiving on a thread of its own
while its main thread sends: the pattern the engine uses, and the one that deadlocks NCCL when
both directions share a communicator. The CPU test runs it over gloo with the per-direction
payload groups the NCCL path uses; the ``cuda`` test runs it over NCCL on two GPUs.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Replica groups whose members have joined different numbers of groups before: a rank's own count
# of groups must not enter a group's name (it did, with torch's locally synchronised groups: hang).
REPLICA_GROUPS = {2: {0: [0, 1]}, 4: {0: [0, 2], 1: [1, 2, 3], 2: [0, 1], 3: [0, 1, 2, 3]}}


def _exchange(rank: int, world: int, port: int, backend: str, device: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from ftcompile.runtime.transport import Launch, TorchTransport

    if device == "cuda":
        torch.cuda.set_device(rank)
    dev = {"cuda": torch.device("cuda", rank), "cuda:0": torch.device("cuda", 0)}.get(device, torch.device("cpu"))
    t = TorchTransport(Launch(rank, world, rank, "test"), backend=backend, pair_groups=True, device=dev)
    peers = [p for p in range(world) if p != rank]
    n, size = 40, 1 << 16
    got: dict[int, list] = {p: [] for p in peers}

    def receive(peer):
        for i in range(n):
            head = t.recv_header(peer)
            buf = torch.empty(size, device=dev)
            got[peer].append((head[1], t.recv_payload(peer, buf).sum().item(), buf[0].item()))

    threads = [threading.Thread(target=receive, args=(p,)) for p in peers]
    for th in threads:
        th.start()
    handles = []
    for i in range(n):          # every peer at once, interleaved, while every peer sends to us
        for p in peers:
            payload = torch.full((size,), float(i + 10 * rank), device=dev)
            handles += t.isend(p, [1, i, 0, 0, 0], payload)
    for h in handles:
        t.wait(h)
    for th in threads:
        th.join(timeout=120)
    ok = not any(th.is_alive() for th in threads) and all(
        [g[0] for g in got[p]] == list(range(n)) and
        all(g[2] == float(i + 10 * p) and g[1] == float(i + 10 * p) * size for i, g in enumerate(got[p]))
        for p in peers)
    groups = REPLICA_GROUPS[world]
    sums = {}
    for sid, fn in t.replica_groups(groups).items():
        x = torch.full((8,), float(rank + 1), device=dev)
        fn(x)
        sums[sid] = x[0].item()
    ok = ok and sums == {sid: float(sum(m + 1 for m in members))
                         for sid, members in groups.items() if rank in members}
    over_nccl = bool(t.nccl_pairs)
    t.close()
    out.put((rank, (ok, over_nccl)))


def _run(backend: str, device: str, world: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_exchange, args=(r, world, port, backend, device, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = dict(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_every_direction_at_once_over_gloo_pair_groups(world):
    """Per-direction groups (forced on gloo) between every pair of ranks, then replica groups whose
    members joined different numbers of groups before: every rank names every group alike."""
    assert _run("gloo", "cpu", world) == {r: (True, False) for r in range(world)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_both_directions_at_once_over_nccl():
    assert _run("nccl", "cuda") == {0: (True, True), 1: (True, True)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_one_gpu_under_nccl_go_through_host_memory(world):
    """NCCL refuses two members on one GPU: those pairs' payloads and groups take gloo through pinned
    host memory."""
    assert _run("nccl", "cuda:0", world) == {r: (True, False) for r in range(world)}


def test_groups_sharing_a_gpu_are_not_nccl_groups():
    from ftcompile.runtime.transport import group_backend

    gpu_of = {0: "h:GPU-a", 1: "h:GPU-b", 2: "h:GPU-a", 3: "h:GPU-b", 4: "g:GPU-a", 5: None}
    assert group_backend((0, 1), "nccl", gpu_of) == "nccl"
    assert group_backend((0, 2), "nccl", gpu_of) == "gloo"          # one GPU, two ranks
    assert group_backend((0, 1, 2), "nccl", gpu_of) == "gloo"
    assert group_backend((0, 4), "nccl", gpu_of) == "nccl"          # same UUID text, another host
    assert group_backend((0, 5), "nccl", gpu_of) == "gloo"          # a rank without a GPU
    assert group_backend((0, 1), "gloo", gpu_of) == "gloo"
