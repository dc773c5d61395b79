"""Which rank the launcher blames when several fail at once (runtime/launch.py: summarize).

A rank killed by a signal is the root cause; a peer that then fails to reach it reports a lost
peer, whichever way it noticed: its receiver thread ("lost rank N") or a send that found the
connection closed ("sending to rank N failed, its process is gone"). Both must be classed as
"lost", or the launcher names the survivor and exits 1 instead of 128 + the signal (a race
test_faults.py's killed-rank test lost once in CI).
"""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest

from ftcompile.runtime.launch import summarize
from ftcompile.runtime.transport import TransportError
from ftcompile.runtime.worker import _kind


@pytest.mark.parametrize("message", [
    "rank 1: lost rank 0 (stages [0]): RuntimeError: Connection closed by peer",
    "rank 1: sending to rank 0 failed, its process is gone (Connection closed by peer); see rank 0's error",
])
def test_a_peer_that_is_gone_is_a_lost_peer(message):
    assert _kind(TransportError(message)) == ("lost", 0)


def test_an_own_error_stays_an_error():
    assert _kind(RuntimeError("rank 1: no room for the checkpoint")) == ("error", None)


@pytest.mark.parametrize("message", [
    "rank 1: lost rank 0 (stages [0]): RuntimeError: Connection closed by peer",
    "rank 1: sending to rank 0 failed, its process is gone (Connection closed by peer); see rank 0's error",
])
def test_the_killed_rank_is_named_and_its_signal_is_the_exit_status(tmp_path, message):
    kind, peer = _kind(TransportError(message))
    record = tmp_path / "rank1.json"
    record.write_text(json.dumps({"ftcompile": {"rank": 1, "kind": kind, "peer": peer, "code": 1,
                                                "shown": False, "time": 1.0}}))
    failures = {0: SimpleNamespace(exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"),
                                   message="killed"),
                1: SimpleNamespace(exitcode=1, error_file=str(record), message=message)}
    lines, code = summarize(failures, lambda r: f"rank {r}")
    assert code == 128 + signal.SIGKILL
    assert lines == ["rank 0 was killed by SIGKILL (signal 9)"]


def test_the_agent_kills_a_failed_launchs_survivors_within_the_grace():
    """torch's process context stops the ranks left after one fails with a fixed 30 s before SIGKILL
    (pytorch#119856); a stopped rank ignores the SIGTERM, so the launcher hung those 30 s. Inside
    spawn every close is capped at the launch's grace, and torch's own is back afterwards."""
    import types

    from torch.distributed.elastic.multiprocessing.api import PContext

    from ftcompile.runtime.launch import _stop_within_grace

    seen = []
    fake = types.SimpleNamespace(_close=lambda death_sig, timeout: seen.append(timeout), _tail_logs=[],
                                 filtered_stdout=None, filtered_stderr=None)
    original = PContext.close
    with _stop_within_grace(5):
        PContext.close(fake)                 # SubprocessContext._poll after a rank failed: close()
        PContext.close(fake, None, 30)       # the agent's _stop_workers: _shutdown()'s 30 s
        PContext.close(fake, None, 2)        # a shorter grace stays
    assert seen == [5, 5, 2]
    assert PContext.close is original


def test_of_ranks_all_stopped_by_sigterm_the_first_stopped_is_named(tmp_path):
    """`kill -TERM` of rank 1; the agent then stops rank 0 with SIGTERM before rank 0 noticed its lost
    peer. Both wrote "stopped by SIGTERM": rank 1 first. The launcher named rank 0 (by rank id)."""
    failures = {}
    for rank, when in ((0, 2.5), (1, 1.0)):
        record = tmp_path / f"rank{rank}.json"
        record.write_text(json.dumps({"ftcompile": {"rank": rank, "kind": "signal", "code": 128 + signal.SIGTERM,
                                                    "shown": False, "time": when}}))
        failures[rank] = SimpleNamespace(exitcode=128 + signal.SIGTERM, error_file=str(record), message="stopped")
    lines, code = summarize(failures, lambda r: f"rank {r}")
    assert code == 128 + signal.SIGTERM
    assert lines == ["rank 1 was stopped by SIGTERM (sent from outside ftcompile run)"]
