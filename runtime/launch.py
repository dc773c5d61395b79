"""Start the ranks of a training run on this host and watch them (``ftcompile run --nproc N``).

The ranks are started by torch's elastic agent (``torch.distributed.launcher.api.elastic_launch``,
what ``torchrun`` runs), so a run started here behaves as one started by ``torchrun``: the same
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, the
agent's store), restarts (``--max-restarts``), and the agent's handling of failures and signals:

* a rank that exits non-zero or dies by a signal is seen within 0.1 s; the agent stops the others
  (SIGTERM, SIGKILL ``shutdown_timeout`` seconds later) and this module names the rank that
  failed first, with its signal (:func:`summarize`);
* SIGTERM, SIGINT, SIGHUP or SIGQUIT to the launcher is forwarded to every rank, and the launcher
  exits with 128 + the signal's number;
* ``kill -9`` of the launcher cannot be forwarded: every rank set a parent-death signal when it
  started (:func:`~ftcompile.runtime.worker.main`), so the kernel kills it with its launcher.

Exit status: 0 when every rank finished; the failing rank's status otherwise (2: it refused the
options, package, checkpoint or folders; 1: the run failed); 128 + N when a rank died by signal N
or the launcher was stopped by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
from typing import Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record(failure) -> dict:
    """What a rank wrote about its failure (``worker.Reporter``), or {} if it could not."""
    path = getattr(failure, "error_file", None)
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f).get("ftcompile") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _stopped_from_outside(who: str, sig: int) -> tuple[list[str], int]:
    return [f"{who} was stopped by {_signal_name(sig)} (sent from outside ftcompile run)"], 128 + sig


def summarize(failures: dict, describe: Callable[[int], str]) -> tuple[list[str], int]:
    """The lines to print about failed ranks, and the exit status (see the module docstring).

    ``failures`` maps a rank to its ``ProcessFailure`` (``exitcode``: negative for a signal;
    ``error_file``: the record the rank wrote). The root cause is, in order: a rank that failed
    by itself (it printed why); a rank killed by a signal other than the agent's SIGTERM; a rank
    stopped by a signal from outside before any peer was missed; a rank that reported a lost or
    silent peer; a rank stopped by SIGTERM from outside.
    """
    records = {r: _record(f) for r, f in failures.items()}
    # A rank that printed its error comes first: the error every rank met is printed by one of them.
    own = sorted((not rec.get("shown"), rec.get("time", 0), r) for r, rec in records.items()
                 if rec.get("kind") == "error")
    if own:
        r = own[0][2]
        rec = records[r]
        return ([] if rec.get("shown") else [f"{describe(r)} failed: see its message above"],
                int(rec.get("code") or failures[r].exitcode or 1))
    blamed = {rec.get("peer") for rec in records.values() if rec.get("kind") == "hang"}
    killed = sorted((r for r, f in failures.items() if f.exitcode < 0 and not records[r]
                     and -f.exitcode != signal.SIGTERM), key=lambda r: r)
    if killed:
        lines = []
        for r in killed:
            sig = -failures[r].exitcode
            if r in blamed:
                lines.append(f"{describe(r)} stopped responding and was killed ({_signal_name(sig)})")
            else:
                lines.append(f"{describe(r)} was killed by {_signal_name(sig)} (signal {sig})")
        return lines, 128 + -failures[killed[0]].exitcode
    peers = sorted((rec.get("time", 0), r) for r, rec in records.items() if rec.get("kind") in ("lost", "hang"))
    stopped = sorted((rec.get("time", 0), r) for r, rec in records.items() if rec.get("kind") == "signal")
    if peers and stopped and stopped[0][0] <= peers[0][0]:
        # A rank stopped by a signal from outside before any peer was missed: the others lost it.
        r = stopped[0][1]
        sig = int(records[r].get("code") or 0) - 128
        if sig > 0:
            return _stopped_from_outside(describe(r), sig)
    if peers:
        r = peers[0][1]
        return ([] if records[r].get("shown") else [f"{describe(r)}: {failures[r].message}"],
                int(records[r].get("code") or 1))
    # Only ranks stopped by signals (SIGTERM from outside, then the agent's to the others): name
    # the one stopped first, by the times they wrote. The agent stops the others only once the
    # first has exited, after writing its record; by rank id, a `kill -TERM` of rank 1 read as
    # rank 0's whenever rank 0 was stopped before it noticed its lost peer (1 run in 8).
    if stopped:
        r = stopped[0][1]
        sig = int(records[r].get("code") or 0) - 128
        if sig > 0:
            return _stopped_from_outside(describe(r), sig)
    for r in sorted(failures):
        f, rec = failures[r], records[r]
        sig = -f.exitcode if f.exitcode < 0 else (rec.get("code", 0) - 128 if rec.get("kind") == "signal" else 0)
        if sig > 0:
            return _stopped_from_outside(describe(r), sig)
    r = min(failures)
    code = int(records[r].get("code") or failures[r].exitcode or 1)
    return ([] if records[r].get("shown") else [f"{describe(r)} exited with status {failures[r].exitcode}"]), code


@contextlib.contextmanager
def _quiet_agent(debug: bool):
    """The agent logs every stop and failure at WARNING/ERROR; we print one summary instead."""
    saved = {}
    if not debug:
        import torch.distributed.elastic  # noqa: F401 - creates the loggers

        for name in list(logging.Logger.manager.loggerDict):
            if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
                lg = logging.getLogger(name)
                saved[name] = lg.level
                lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _stop_within_grace(grace_s: int):
    """Make the agent kill the surviving ranks of a failed launch ``grace_s`` seconds after SIGTERM.

    torch honours ``LaunchConfig.shutdown_timeout`` only when the agent itself gets a signal: when
    a rank fails, the process context stops the others with ``close()``'s fixed 30 s
    (``SubprocessContext._poll``; ``_stop_workers`` likewise, pytorch/pytorch#119856, a fix
    pending in #192815). A rank that is stopped (SIGSTOP) or frozen cannot act on SIGTERM, so the
    launcher waited those 30 s for SIGKILL after its peers had already named it. Every close of
    this launch is capped at the grace; scoped to the launch."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.__dict__.get("close")
    if original is None:
        yield
        return

    def close(self, death_sig=None, timeout: int = 30) -> None:
        return original(self, death_sig, min(timeout, grace_s))

    PContext.close = close
    try:
        yield
    finally:
        PContext.close = original


@contextlib.contextmanager
def _environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(worker_args: list[str], nproc: int, *, run_id: str, describe: Callable[[int], str] | None = None,
          max_restarts: int = 0, threads_per_rank: int | None = None, shutdown_timeout_s: int = 5,
          debug: bool = False) -> int:
    """Run ``nproc`` ranks of ``python -m ftcompile.runtime WORKER_ARGS``; returns the exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    describe = describe or (lambda r: f"rank {r}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    logs = tempfile.mkdtemp(prefix="ftcompile-run-")
    # LaunchConfig.shutdown_timeout (the grace between SIGTERM and SIGKILL) is newer than the torch
    # versions we support (torch 2.11 has none): older agents keep their own default grace.
    grace = ({"shutdown_timeout": shutdown_timeout_s}
             if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {})
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id, rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.1, logs_specs=DefaultLogsSpecs(log_dir=logs), **grace)
    # Ranks sharing a host's cores must not each start a thread per core.
    env = {"FTCOMPILE_LAUNCHER": "ftcompile", "FTCOMPILE_RUN_ID": run_id,
           # A restart must not read the keys of the attempt before (pytorch#135712): rank 0 of each
           # attempt serves a store of its own instead of sharing the agent's.
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "FTCOMPILE_LAUNCHER_PID": str(os.getpid()), "FTCOMPILE_COMMAND": shlex.join(["ftcompile", *sys.argv[1:]]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_rank))}
    try:
        with _environ(**env), _quiet_agent(debug), _stop_within_grace(shutdown_timeout_s):
            elastic_launch(config, sys.executable)("-m", "ftcompile.runtime", *worker_args)
        return 0
    except ChildFailedError as exc:
        lines, code = summarize(exc.failures, describe)
        others = [r for r in range(nproc) if r not in exc.failures]
        for line in lines:
            print(f"ftcompile run: {line}", file=sys.stderr)
        if lines and len(exc.failures) + len(others) > 1:
            print("ftcompile run: stopped the other ranks", file=sys.stderr)
        return code
    except SignalException as exc:
        name = _signal_name(exc.sigval)
        print(f"ftcompile run: stopped by {name}; every rank was sent {name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
