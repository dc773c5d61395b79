"""Start the ranks of a training run on this host and watch them (``ftcompile run --nproc N``).

Each rank is ``python -m ftcompile.runtime PACKAGE ...`` with torchrun's
environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``). When one rank fails, the others get a few
seconds to notice on their own (they report the lost peer), then are stopped;
the first failure's exit status is returned.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker_args: list[str], nproc: int, *, grace_s: float = 10.0, env: dict | None = None,
          threads_per_rank: int | None = None) -> int:
    """Run ``nproc`` ranks with ``worker_args`` (the package and training options); returns the exit status."""
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                FTCOMPILE_LAUNCHER="ftcompile")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    # Ranks sharing a host's cores must not each start a thread per core.
    base.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    procs = []
    for r in range(nproc):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc))
        procs.append(subprocess.Popen([sys.executable, "-m", "ftcompile.runtime", *worker_args], env=e))
    status = 0
    failed_at = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad and failed_at is None:
                failed_at = time.monotonic()
                status = bad[0]
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        print(f"ftcompile run: stopping rank {r} after another rank failed", file=sys.stderr)
                        p.terminate()
                for p in procs:
                    try:
                        p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        p.kill()
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        return 130
    return status
