"""``train.jsonl``: one record per step, never truncated, never mixing two runs.

The rank that holds the loss opens the log only once training starts (a refused run never
touches the previous log), holding the folder's lock (:mod:`.lock`), and removes the
temporary files a dead run's rewrite left. A fresh run moves an
existing log aside to ``train.N.jsonl`` (the next free N) and starts a new one. A resumed run
keeps the records of its own run before the checkpoint step and drops those at or after it,
which it is about to train again; the file as it was is moved aside first, so nothing written
is lost. Each step record carries the run id (``"run"``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path

from .atomic import atomic_write_text

LOG_NAME = "train.jsonl"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class RunLogError(OSError):
    """The log cannot be written."""


def rotated_path(folder: Path) -> Path:
    """``train.N.jsonl`` with N one above the highest present."""
    taken = [int(m.group(1)) for p in folder.glob("train.*.jsonl") if (m := re.fullmatch(r"train\.(\d+)\.jsonl", p.name))]
    return folder / f"train.{max(taken, default=0) + 1}.jsonl"


def _parse(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


def _keep(line: str, run_id: str, resume_step: int) -> bool:
    """Whether a line of the old log stays when ``run_id`` resumes at ``resume_step``."""
    rec = _parse(line)
    if rec is None:
        return False                         # a line cut short by a crash
    if rec.get("run") not in (run_id, None):
        return False                         # another run's
    step = rec.get("step")
    return rec.get("summary") is True or not isinstance(step, int) or step < resume_step


class RunLog:
    """The open log: :meth:`write` a record per step."""

    def __init__(self, path: Path, run_id: str):
        self.path, self.run_id = path, run_id
        # Unbuffered bytes: a record is written with one call, and cut back whole if it fails.
        self._f = open(path, "ab", buffering=0)

    def write(self, rec: dict) -> None:
        data = (json.dumps(rec) + "\n").encode("utf-8")
        end = self._f.seek(0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += self._f.write(data[done:])
        except OSError as exc:
            # A full disk leaves no torn last line: the log ends with the last complete record.
            with contextlib.suppress(OSError):
                os.ftruncate(self._f.fileno(), end)
            raise _error(self.path, exc) from None

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as exc:
            raise _error(self.path, exc) from None


def _error(path: Path, exc: OSError) -> RunLogError:
    if exc.errno in NO_SPACE:
        return RunLogError(exc.errno, f"no room to write the training log {path} ({exc.strerror}); free space there "
                                      "or give another --log-dir")
    return RunLogError(exc.errno, f"cannot write the training log {path}: {exc.strerror or exc}")


def open_log(folder: str | os.PathLike, *, run_id: str, resume_step: int | None = None) -> tuple[RunLog, list[str]]:
    """Open ``folder/train.jsonl`` for this run (see the module docstring); returns the log and notes."""
    folder = Path(folder)
    path = folder / LOG_NAME
    notes: list[str] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for tmp in folder.glob(".tmp-*"):     # an interrupted rewrite of a dead run (we hold the lock)
            tmp.unlink(missing_ok=True)
        if path.exists() and path.stat().st_size > 0:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            kept = [x for x in lines if _keep(x, run_id, resume_step)] if resume_step is not None else []
            if kept != lines:
                aside = rotated_path(folder)
                os.replace(path, aside)
                if kept:
                    atomic_write_text(path, "\n".join(kept) + "\n")
                dropped = len(lines) - len(kept)
                if resume_step is None:
                    notes.append(f"moved the log of an earlier run to {aside}")
                else:
                    notes.append(f"{path}: dropped {dropped} line(s) of steps >= {resume_step} or of other runs, "
                                 f"which this resumed run writes again (the old file is {aside})")
        return RunLog(path, run_id), notes
    except OSError as exc:
        raise _error(path, exc) from None
