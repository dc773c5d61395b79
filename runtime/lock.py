"""One run at a time per folder: an advisory lock that names its holder.

A run holds the lock of its log folder and of its checkpoint folder for as long as it
lives (the rank that writes the log takes both). The lock is ``flock`` on
``FOLDER/.ftcompile-lock``: the kernel drops it when the holder dies, even by ``kill -9``,
so a dead run never blocks the next one, and the file names the holder (host, pid, run id,
start time, command) so a refused run can say who is there. Linux NFS clients implement
``flock`` with NFS locks, so this works for a checkpoint folder shared by several hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".ftcompile-lock"


class FolderBusy(ValueError):
    """Another live run holds the folder."""


def holder_info(run_id: str | None) -> dict:
    """Who holds a lock: this process, and the launcher and command that started it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
            "launcher_pid": int(os.environ.get("FTCOMPILE_LAUNCHER_PID", 0)) or None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": (os.environ.get("FTCOMPILE_COMMAND") or " ".join(sys.argv))[:300]}


def describe_holder(info: dict | None) -> str:
    if not info:
        return "another run (it has not said who it is yet)"
    pid = (f"launcher pid {info['launcher_pid']}, rank pid {info.get('pid')}" if info.get("launcher_pid")
           else f"pid {info.get('pid')}")
    return (f"run {info.get('run_id') or '?'} ({pid} on {info.get('host')}, since {info.get('started')}: "
            f"{info.get('command') or '?'})")


def _busy(folder: Path, info: dict | None, what: str) -> FolderBusy:
    return FolderBusy(f"{folder} is in use by {describe_holder(info)}; two runs there would mix their {what}. Wait "
                      f"for it to end, stop it, or choose another folder")


def _read(fd: int) -> dict | None:
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 1 << 16)
        return json.loads(data.decode()) if data.strip() else None
    return None


@dataclass
class FolderLock:
    """A held lock; :meth:`release` it, or let the process end."""

    folder: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
            self.fd = None


def acquire(folder: str | os.PathLike, run_id: str | None, *, what: str = "files") -> FolderLock:
    """Lock ``folder`` (created if missing) for this process, or raise FolderBusy naming the holder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        info = _read(fd)
        os.close(fd)
        raise _busy(folder, info, what) from None
    # Written in place, not renamed: the lock belongs to this inode.
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder_info(run_id)).encode())
    return FolderLock(folder, fd)


def check_free(folder: str | os.PathLike, *, what: str = "files") -> None:
    """Raise FolderBusy if a live run holds ``folder``; leaves no lock and creates nothing."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(Path(folder), _read(fd), what) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
