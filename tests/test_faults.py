"""Faults of a training run, as real processes and real signals.

Every test starts ``ftcompile run`` (torch's elastic agent and two ranks over gloo on loopback)
on a gpt2-tiny package compiled for two GPUs, and hurts it from outside: ``kill -9`` of a rank
during start-up, during a step and during a checkpoint commit; SIGTERM and ``kill -9`` of the
launcher; SIGSTOP of a rank; a second run into the folders of a running one; a checkpoint folder
too small for the next checkpoint. Nothing waits a fixed time: tests poll for files, log lines and
processes, with generous limits, and assert behaviour, never durations.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ftcompile.runtime import checkpoint as ckpt

from test_runtime import compiled

LIMIT = 240          # seconds any one wait may take on a loaded 2-core machine


@pytest.fixture(scope="module")
def pkg(tmp_path_factory) -> Path:
    return compiled(tmp_path_factory.mktemp("faults") / "seq", "gpt2-tiny", "seq", 2)


# --------------------------------------------------------------------------- processes

class Run:
    """``ftcompile run`` in the background; its stderr goes to a file (a pipe could fill up)."""

    def __init__(self, args: list[str], tmp: Path, name: str = "run", prefix: list[str] | None = None,
                 preexec=None):
        self.err_path = tmp / f"{name}.stderr"
        self._err = open(self.err_path, "w")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "ftcompile", "run", *args],
                                     stdout=subprocess.DEVNULL, stderr=self._err, env=env, preexec_fn=preexec)
        self.seen: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ranks(self) -> dict[int, int]:
        """Rank -> pid of the launcher's rank processes (read from their environment)."""
        out = {}
        for pid in descendants(self.pid):
            rank = _env(pid).get("RANK")
            if rank is not None and "ftcompile.runtime" in _cmdline(pid):
                out[int(rank)] = pid
        self.seen |= set(out.values())
        return out

    def wait(self, timeout: float = LIMIT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._err.flush()

    @property
    def stderr(self) -> str:
        self._err.flush()
        return self.err_path.read_text()

    def cleanup(self) -> None:
        for pid in [self.pid, *self.seen]:
            _kill(pid)
        self._err.close()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _env(pid: int) -> dict[str, str]:
    out = {}
    for item in _read(f"/proc/{pid}/environ").split(b"\0"):
        k, _, v = item.partition(b"=")
        out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def _cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")


def descendants(pid: int) -> list[int]:
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            stat = _read(f"/proc/{d}/stat").decode(errors="replace")
            if ")" in stat:
                parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _kill(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return


def wait_until(cond, what: str, timeout: float = LIMIT, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def log_records(log: Path) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not rec.get("summary"):
            out.append(rec)
    return out


def train_args(pkg: Path, tmp: Path, *extra: str, steps: int = 100000) -> list[str]:
    return [str(pkg), "--nproc", "2", "--schedule", "1f1b", "--optimizer", "momentum", "--lr", "0.05",
            "--seed", "3", "--steps", str(steps), "--log-dir", str(tmp / "log"), "--progress", "off",
            "--timeout", "120", *extra]


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for r in started:
        r.cleanup()


def start(runs: list, args: list[str], tmp: Path, **kw) -> Run:
    r = Run(args, tmp, name=f"run{len(runs)}", **kw)
    runs.append(r)
    return r


def assert_all_gone(pids) -> None:
    wait_until(lambda: not any(alive(p) for p in pids), f"the ranks {sorted(pids)} to end")


# --------------------------------------------------------------------------- a rank dies

def test_rank_killed_during_start_up_is_named_with_its_signal(pkg, tmp_path, runs):
    run = start(runs, train_args(pkg, tmp_path), tmp_path)
    ranks = wait_until(lambda: len(run.ranks()) == 2 and run.ranks(), "two ranks", every=0.01)
    os.kill(ranks[1], signal.SIGKILL)
    rc = run.wait()
    err = run.stderr
    assert not (tmp_path / "log" / "train.jsonl").exists(), "rank 1 died before training began"
    assert "rank 1 (stages [1]) was killed by SIGKILL (signal 9)" in err, err
    assert rc == 128 + signal.SIGKILL, err
    assert "Traceback" not in err
    assert_all_gone(ranks.values())


def test_rank_killed_during_a_step_is_named_and_the_others_stop(pkg, tmp_path, runs):
    run = start(runs, train_args(pkg, tmp_path), tmp_path)
    wait_until(lambda: len(log_records(tmp_path / "log" / "train.jsonl")) >= 3, "three steps")
    ranks = run.ranks()
    os.kill(ranks[0], signal.SIGKILL)
    rc = run.wait()
    err = run.stderr
    assert rc == 128 + signal.SIGKILL, err
    assert "rank 0 (stages [0]) was killed by SIGKILL (signal 9)" in err, err
    assert "Traceback" not in err
    assert_all_gone(ranks.values())


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_stopped_by_sigterm_from_outside_is_named_not_its_peers_lost_link(pkg, tmp_path, runs, victim):
    """`kill -TERM` of one rank: the message names it and its signal (exit 143), not the gloo error its
    peer met on the closed connection."""
    run = start(runs, train_args(pkg, tmp_path), tmp_path)
    wait_until(lambda: len(log_records(tmp_path / "log" / "train.jsonl")) >= 3, "three steps")
    ranks = run.ranks()
    os.kill(ranks[victim], signal.SIGTERM)
    rc = run.wait()
    err = run.stderr
    assert rc == 128 + signal.SIGTERM, err
    assert f"rank {victim} (stages [{victim}]) was stopped by SIGTERM (sent from outside ftcompile run)" in err, err
    assert "Connection closed by peer" not in err and "Traceback" not in err
    assert_all_gone(ranks.values())


def _staging(ck: Path) -> bool:
    """A checkpoint is being written: temporary files or folders are there."""
    try:
        return any(p.name.startswith(".tmp-") or (p.name.startswith("step-") and p.is_dir() and
                                                  any(q.name.startswith(".tmp-") for q in os.scandir(p)))
                   for p in os.scandir(ck))
    except FileNotFoundError:
        return False


def test_rank_killed_during_a_checkpoint_commit(pkg, tmp_path, runs):
    """The survivor sits in the collective checkpoint save: the run stops at once, naming the dead rank;
    the folder keeps its last complete checkpoint, and resuming from it ends as an uninterrupted run."""
    ck = tmp_path / "ckpt"
    run = start(runs, train_args(pkg, tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1"), tmp_path)
    wait_until(lambda: len(log_records(tmp_path / "log" / "train.jsonl")) >= 2 and _staging(ck),
               "a checkpoint being written", every=0.002)
    ranks = run.ranks()
    os.kill(ranks[1], signal.SIGKILL)
    rc = run.wait()
    err = run.stderr
    assert rc == 128 + signal.SIGKILL, err
    assert "rank 1 (stages [1]) was killed by SIGKILL (signal 9)" in err, err
    assert "Traceback" not in err
    assert_all_gone(ranks.values())
    last = ckpt.latest(ck)
    assert last is not None and last.step >= 1
    total = last.step + 2
    resumed = start(runs, train_args(pkg, tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                                     "--resume", steps=total), tmp_path)
    assert resumed.wait() == 0, resumed.stderr
    assert not ckpt.stale_temporaries(ck), ckpt.stale_temporaries(ck)
    assert [r["step"] for r in log_records(tmp_path / "log" / "train.jsonl")] == list(range(total))
    whole = tmp_path / "whole"
    ref = start(runs, train_args(pkg, whole, "--checkpoint-dir", str(whole / "ckpt"), "--checkpoint-every", "1",
                                 steps=total), tmp_path)
    assert ref.wait() == 0, ref.stderr
    a, b = ckpt.load_weights(ckpt.latest(ck)), ckpt.load_weights(ckpt.latest(whole / "ckpt"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
def test_restarted_ranks_resume_and_end_as_an_uninterrupted_run(pkg, tmp_path, runs):
    """``--max-restarts``: the elastic agent restarts the ranks, which resume from the run's checkpoint."""
    ck = tmp_path / "ckpt"
    total = 40
    run = start(runs, train_args(pkg, tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                                 "--max-restarts", "1", steps=total), tmp_path)
    wait_until(lambda: ckpt.latest(ck) is not None and len(log_records(tmp_path / "log" / "train.jsonl")) >= 3,
               "a checkpoint")
    os.kill(run.ranks()[1], signal.SIGKILL)
    assert run.wait() == 0, run.stderr
    assert [r["step"] for r in log_records(tmp_path / "log" / "train.jsonl")] == list(range(total))
    whole = tmp_path / "whole"
    ref = start(runs, train_args(pkg, whole, "--checkpoint-dir", str(whole / "ckpt"), "--checkpoint-every", "2",
                                 steps=total), tmp_path)
    assert ref.wait() == 0, ref.stderr
    a, b = ckpt.load_weights(ckpt.latest(ck)), ckpt.load_weights(ckpt.latest(whole / "ckpt"))
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
def test_a_stopped_rank_is_reported_by_its_heartbeat_long_before_the_timeout(pkg, tmp_path, runs):
    run = start(runs, train_args(pkg, tmp_path, "--heartbeat-timeout", "10", "--timeout", "3600"), tmp_path)
    wait_until(lambda: len(log_records(tmp_path / "log" / "train.jsonl")) >= 3, "three steps")
    ranks = run.ranks()
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        rc = run.wait(timeout=LIMIT)      # far below --timeout: only the heartbeat can end it
    finally:
        _kill(ranks[1])
    err = run.stderr
    assert rc != 0
    assert "rank 0 (training steps" in err and "rank 1 (stages [1]) sent no heartbeat for" in err, err
    assert "rank 1 (stages [1]) stopped responding" in err, err
    assert_all_gone(ranks.values())


# --------------------------------------------------------------------------- the launcher dies

def test_sigterm_to_the_launcher_stops_every_rank(pkg, tmp_path, runs):
    run = start(runs, train_args(pkg, tmp_path), tmp_path)
    wait_until(lambda: len(log_records(tmp_path / "log" / "train.jsonl")) >= 2, "two steps")
    ranks = run.ranks()
    os.kill(run.pid, signal.SIGTERM)
    rc = run.wait()
    assert rc == 128 + signal.SIGTERM, run.stderr
    assert "stopped by SIGTERM" in run.stderr
    assert "Traceback" not in run.stderr
    assert_all_gone(ranks.values())


def test_ranks_die_with_a_launcher_killed_by_sigkill(pkg, tmp_path, runs):
    run = start(runs, train_args(pkg, tmp_path), tmp_path)
    wait_until(lambda: len(log_records(tmp_path / "log" / "train.jsonl")) >= 2, "two steps")
    ranks = run.ranks()
    assert len(ranks) == 2
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    assert_all_gone(ranks.values())


# --------------------------------------------------------------------------- two runs, one folder

def test_a_second_run_into_the_folders_of_a_live_one_is_refused_by_name(pkg, tmp_path, runs):
    ck = tmp_path / "ckpt"
    first = start(runs, train_args(pkg, tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1000"),
                  tmp_path)
    log = tmp_path / "log" / "train.jsonl"
    wait_until(lambda: len(log_records(log)) >= 2, "two steps")
    run_id = log_records(log)[0].get("run")
    for extra in (["--log-dir", str(tmp_path / "log")], ["--checkpoint-dir", str(ck), "--log-dir", str(tmp_path / "b")]):
        args = train_args(pkg, tmp_path / "second", steps=2)
        args = args[:args.index("--log-dir")] + args[args.index("--log-dir") + 2:] + extra
        second = start(runs, args, tmp_path)
        assert second.wait() == 2, second.stderr
        assert f"is in use by run {run_id}" in second.stderr, second.stderr
        assert f"launcher pid {first.pid}" in second.stderr, second.stderr
    # A rank started by hand (torchrun, mpirun) refuses as well: the lock is the ranks', not the launcher's.
    from ftcompile.runtime.launch import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
               LOCAL_RANK="0", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "ftcompile.runtime", str(pkg), "--steps", "2", "--log-dir",
                        str(tmp_path / "log"), "--progress", "off"], capture_output=True, text=True, env=env,
                       timeout=LIMIT)
    assert r.returncode == 2 and f"is in use by run {run_id}" in r.stderr, r.stderr
    # the first run is untouched: its log grows and is the only one
    n = len(log_records(log))
    wait_until(lambda: len(log_records(log)) > n, "the first run to go on")
    assert {x["run"] for x in log_records(log)} == {run_id}
    assert not list((tmp_path / "log").glob("train.*.jsonl"))
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait() == 128 + signal.SIGTERM


# --------------------------------------------------------------------------- disk full

def _small_disk(tmp: Path, size_kb: int) -> tuple[Path, list[str] | None, object, callable]:
    """A folder where only ``size_kb`` KB fit: a tmpfs mounted there (as root, or in a user namespace),
    else a file-size limit on the run's processes. Returns (folder, command prefix, preexec, cleanup)."""
    d = tmp / "small"
    d.mkdir()
    if os.geteuid() == 0 and shutil.which("mount"):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(d)],
                           capture_output=True)
        if r.returncode == 0:
            return d, None, None, lambda: subprocess.run(["umount", "-l", str(d)], capture_output=True)
    if shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0:
        prefix = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={size_kb}k tmpfs "{d}" && exec "$@"', "sh"]
        return d, prefix, None, lambda: None

    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (size_kb * 1024 // 6, size_kb * 1024 // 6))
    return d, None, limit, lambda: None


def test_a_full_disk_gives_one_message_and_keeps_the_last_checkpoint(pkg, tmp_path, runs):
    # one checkpoint (weights and Adam's two moments) fits, two do not
    probe = tmp_path / "probe"
    r = start(runs, train_args(pkg, probe, "--checkpoint-dir", str(probe / "ckpt"), "--optimizer", "adam",
                               "--lr", "1e-3", steps=1), tmp_path)
    assert r.wait() == 0, r.stderr
    one = sum(f.stat().st_size for f in (probe / "ckpt").rglob("*") if f.is_file())
    small, prefix, preexec, cleanup = _small_disk(tmp_path, int(one * 1.5) // 1024)
    try:
        ck = small / "ckpt"
        run = start(runs, train_args(pkg, tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                                     "--optimizer", "adam", "--lr", "1e-3", steps=6), tmp_path, prefix=prefix,
                    preexec=preexec)
        rc = run.wait()
        err = run.stderr
        assert rc == 2, err
        assert "Traceback" not in err and "terminate called" not in err and "SafetensorError" not in err, err
        assert err.count("error:") == 1, err
        if preexec is None:     # a real small file system: the message has the figures
            assert f"no room for the checkpoint of step 4 in {ck}: it needs" in err, err
            assert "MB" in err and "the checkpoint of step 2 is intact" in err, err
            if prefix is None:      # (a user namespace's tmpfs is gone with the run)
                assert ckpt.latest(ck).step == 2
                assert ckpt.load_weights(ckpt.latest(ck))
                assert not ckpt.stale_temporaries(ck)
        else:
            assert f"the checkpoint of step 2 into {ck}" in err and "File too large" in err, err
    finally:
        cleanup()
