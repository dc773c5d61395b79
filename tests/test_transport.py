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


def _exchange(rank: int, port: int, backend: str, device: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    from ftcompile.runtime.transport import Launch, TorchTransport

    if device == "cuda":
        torch.cuda.set_device(rank)
    dev = {"cuda": torch.device("cuda", rank), "cuda:0": torch.device("cuda", 0)}.get(device, torch.device("cpu"))
    t = TorchTransport(Launch(rank, 2, rank, "test"), backend=backend, pair_groups=True, device=dev)
    peer = 1 - rank
    n, size = 40, 1 << 18
    got: list = []

    def receive():
        for i in range(n):
            head = t.recv_header(peer)
            buf = torch.empty(size, device=dev)
            got.append((head[1], t.recv_payload(peer, buf).sum().item(), buf[0].item()))

    th = threading.Thread(target=receive)
    th.start()
    handles = []
    for i in range(n):
        payload = torch.full((size,), float(i + 10 * rank), device=dev)
        handles += t.isend(peer, [1, i, 0, 0, 0], payload)
    for h in handles:
        t.wait(h)
    th.join(timeout=120)
    ok = not th.is_alive() and [g[0] for g in got] == list(range(n)) and \
        all(g[2] == float(i + 10 * peer) and g[1] == float(i + 10 * peer) * size for i, g in enumerate(got))
    over_nccl = bool(t.nccl_pairs)
    t.close()
    out.put((rank, (ok, over_nccl)))


def _run(backend: str, device: str) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_exchange, args=(r, port, backend, device, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return res


def test_both_directions_at_once_over_gloo_pair_groups():
    assert _run("gloo", "cpu") == {0: (True, False), 1: (True, False)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_both_directions_at_once_over_nccl():
    assert _run("nccl", "cuda") == {0: (True, True), 1: (True, True)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_ranks_on_one_gpu_under_nccl_go_through_host_memory():
    """NCCL refuses two members on one GPU: the pair's payloads take gloo through pinned host memory."""
    assert _run("nccl", "cuda:0") == {0: (True, False), 1: (True, False)}


def test_groups_sharing_a_gpu_are_not_nccl_groups():
    from ftcompile.runtime.transport import group_backend

    gpu_of = {0: "h:GPU-a", 1: "h:GPU-b", 2: "h:GPU-a", 3: "h:GPU-b", 4: "g:GPU-a", 5: None}
    assert group_backend((0, 1), "nccl", gpu_of) == "nccl"
    assert group_backend((0, 2), "nccl", gpu_of) == "gloo"          # one GPU, two ranks
    assert group_backend((0, 1, 2), "nccl", gpu_of) == "gloo"
    assert group_backend((0, 4), "nccl", gpu_of) == "nccl"          # same UUID text, another host
    assert group_backend((0, 5), "nccl", gpu_of) == "gloo"          # a rank without a GPU
    assert group_backend((0, 1), "gloo", gpu_of) == "gloo"
