"""Real ranks for tests: W spawned processes on this host, linked over gloo, each with a RankEngine.

:func:`run_ranks` starts one process per rank; each builds the transport, the package, its
:class:`~ftcompile.runtime.layout.RankLayout` and :class:`~ftcompile.runtime.engine.RankEngine`
(with AvgPipe's elastic averaging when asked) and the synthetic data of every replica's
micro-batches, then hands a :class:`RankRun` to the test's ``body``, a module-level function (spawn
pickles it by name) whose return value comes back to the test. A rank that raises sends its
traceback instead, and the test fails with it.
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankRun:
    """What a rank's ``body`` works with."""

    rank: int
    world: int
    cfg: Any                   # TrainConfig
    package: Any
    layout: Any                # RankLayout
    engine: Any                # RankEngine
    averaging: Any             # ElasticAveraging or None
    data: Any                  # iterator of batches: every replica's micro-batches per step

    @property
    def logs(self) -> bool:
        """This rank writes the loss (the engine's log rank)."""
        return self.rank == self.engine.log_rank


def to_numpy(state: dict[int, dict]) -> dict[int, dict[str, Any]]:
    """The weights of ``RankEngine.state()`` as numpy copies: they pickle by value, so the queue does not hand over
    shared memory of a process that exits."""
    return {sid: {n: t.detach().cpu().numpy().copy() for n, t in s["weights"].items()} for sid, s in state.items()}


def to_torch(weights: dict[int, dict[str, Any]]) -> dict[int, dict[str, torch.Tensor]]:
    return {sid: {n: torch.from_numpy(a) for n, a in w.items()} for sid, w in weights.items()}


def _main(body: Callable, rank: int, world: int, port: int, pkg: str, cfg, replicas: int, order: str, alpha,
          args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        from ftcompile.runtime import load_package
        from ftcompile.runtime.avgpipe import ElasticAveraging
        from ftcompile.runtime.data import load_dataset
        from ftcompile.runtime.engine import RankEngine
        from ftcompile.runtime.layout import RankLayout
        from ftcompile.runtime.transport import Launch, TorchTransport

        transport = TorchTransport(Launch(rank, world, rank, "test"))
        package = load_package(pkg)
        layout = RankLayout(world, replicas, rank, order)
        averaging = None if alpha is None else ElasticAveraging(replicas, None if alpha == "default" else alpha)
        engine = RankEngine(package, cfg, rank=rank, world_size=world, transport=transport, layout=layout,
                            averaging=averaging)
        data = iter(load_dataset("synthetic", package.manifest, micro_batches=replicas * cfg.micro_batches,
                                 seed=cfg.seed))
        result = body(RankRun(rank, world, cfg, package, layout, engine, averaging, data), *args)
        transport.close()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, False, traceback.format_exc()))


def run_ranks(body: Callable, pkg: Path, cfg, *, world: int, replicas: int, order: str = "pipeline-major",
              alpha=None, args: tuple = (), timeout: float = 900) -> list:
    """Run ``body(RankRun, *args)`` on ``world`` spawned ranks training ``replicas`` copies of the package's pipeline
    (``order``: the rank order); ``alpha``: None for no elastic averaging (plain replicas, or one pipeline), else
    AvgPipe's coefficient, ``"default"`` for 1/N. Returns every rank's result, in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_main, args=(body, r, world, port, str(pkg), cfg, replicas, order, alpha, args, out))
             for r in range(world)]
    for p in procs:
        p.start()
    res = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    failed = [f"rank {rank}:\n{result}" for rank, ok, result in sorted(res, key=lambda x: x[0]) if not ok]
    assert not failed, failed[0]
    return [result for _, _, result in sorted(res, key=lambda x: x[0])]
