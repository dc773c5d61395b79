"""Checkpoints keyed by parameter name, written collectively with ``torch.distributed.checkpoint``.

Layout of a checkpoint folder ``DIR``::

    DIR/latest                               {"folder": "step-00000020", "step": 20, "run_id": ...}
    DIR/step-00000020/meta.json              step, run id, package (graph hash), optimizer, settings
    DIR/step-00000020/shard-0000R-model-00001-of-00001.safetensors   what rank R-1 wrote
    DIR/.ftcompile-lock                      held by the run writing here (:mod:`.lock`)

**Content.** Every weight under its canonical name (``transformer.h.0.attn.c_attn.weight``),
every piece of per-parameter optimizer state as ``optimizer/NAME/KEY`` (``exp_avg``,
``momentum_buffer``...). Nothing is keyed by stage, rank or an optimizer's integer index, so a
checkpoint loads into another plan of the same model, another stage layout, another number
of ranks or replicas: each rank reads the names its stages hold. The learning-rate schedule
is a function of the step (:func:`~ftcompile.runtime.optim.set_position`), and the settings
the run trained with are in ``meta.json``.

**Writing** (:func:`save`, called by every rank at the same step) is
``torch.distributed.checkpoint.save`` with its Hugging Face safetensors writer, one file per
rank: the planner writes a tensor that several ranks hold (a tied weight, a stage replicated
across pipelines) once, and a write failure on any rank reaches every rank. The files go into a
staging folder ``DIR/.tmp-step-00000020-SAVEID`` of this save alone; once every rank's write has
succeeded, the coordinator writes ``meta.json``, renames the staging folder to
``step-00000020`` and then moves ``latest``. A crash at any moment leaves the previous
checkpoint as ``latest`` and, at worst, a staging folder that the next run removes
(:func:`remove_stale`); no file of one save or one run can be mixed into another.

**Runs.** ``meta.json`` and ``latest`` carry the run id; a fresh run refuses a folder that
holds checkpoints (:func:`prepare_folder`) unless told to overwrite them, and ``--resume``
continues the run of ``latest`` (tied to its package by the graph hash).

Ranks on several hosts need ``DIR`` on a shared file system.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from .atomic import atomic_write_text

FORMAT = "ftcompile.checkpoint"
VERSION = 2
LATEST = "latest"
META = "meta.json"
OPTIMIZER_PREFIX = "optimizer/"
STAGING_PREFIX = ".tmp-step-"
#: Errors that mean the file system has no room (or the process may not grow a file).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointError(ValueError):
    """A checkpoint cannot be read, written, or does not belong to this run or package.

    ``every_rank``: every rank of the run raised this same error (a collective save failed), so
    one of them is enough to report it.
    """

    every_rank = False


def _everyone(exc: CheckpointError) -> CheckpointError:
    exc.every_rank = True
    return exc


class CheckpointSpaceError(CheckpointError):
    """The checkpoint folder has no room for the next checkpoint."""


class CheckpointPeerLost(RuntimeError):
    """A collective of the save failed: a peer rank is gone (its connection closed)."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its step, folder and ``meta.json``."""

    step: int
    folder: Path
    meta: dict
    note: str | None = None     # how it was found, where not through ``latest`` (said when resuming)

    @property
    def run_id(self) -> str | None:
        return self.meta.get("run_id")

    @property
    def optimizer(self) -> str | None:
        return (self.meta.get("config") or {}).get("optimizer")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# --------------------------------------------------------------------------- content

def entries(stages: dict[int, dict]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One rank's checkpoint entries from its stages' states (``RankEngine.state()``).

    ``stages`` maps a stage id to ``{"weights": {name: tensor}, "optimizer": {name: {key: value}}}``.
    Returns the flat ``{key: tensor}`` that :func:`save` writes (a name several local stages hold
    appears once; their copies must be equal, else CheckpointError) and the Python type of optimizer-state values that were numbers (``{"step":
    "int"}``), which are stored as 0-dim tensors and turned back on load.
    """
    out: dict[str, torch.Tensor] = {}
    scalars: dict[str, str] = {}
    holder: dict[str, int] = {}

    def put(k: str, t: torch.Tensor, sid: int) -> None:
        if k not in out:
            out[k], holder[k] = t.detach(), sid
        elif not torch.equal(out[k], t.detach()):
            raise CheckpointError(f"stages {holder[k]} and {sid} hold different copies of {k}, which they share: "
                                  "their training diverged (a bug); this checkpoint would keep only one of them")

    for sid in sorted(stages):
        s = stages[sid]
        for name, t in s.get("weights", {}).items():
            put(name, t, sid)
        for name, state in (s.get("optimizer") or {}).items():
            for key, value in state.items():
                k = f"{OPTIMIZER_PREFIX}{name}/{key}"
                if isinstance(value, torch.Tensor):
                    put(k, value, sid)
                elif isinstance(value, (bool, int, float)):
                    kind = "bool" if isinstance(value, bool) else type(value).__name__
                    scalars[key] = kind
                    put(k, torch.tensor(value, dtype=torch.float64 if kind == "float" else torch.int64), sid)
    return out, scalars


def entry_bytes(flat: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: t.numel() * t.element_size() for k, t in flat.items()}


# --------------------------------------------------------------------------- finding checkpoints

def _read_meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {META}: it is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"{folder / META} is damaged ({exc}); resume from an older step folder by "
                              f"writing its name into {folder.parent / LATEST}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not an ftcompile checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{folder} is an ftcompile checkpoint of format version {meta.get('version')}, "
                              f"this version reads {VERSION}: resume it with the ftcompile that wrote it, or "
                              "start afresh")
    return meta


def latest(root: str | os.PathLike) -> Checkpoint | None:
    """The checkpoint ``root/latest`` names, or None if there is none (CheckpointError if damaged)."""
    root = Path(root)
    try:
        text = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise CheckpointError(f"{root / LATEST} cannot be read ({exc})") from None
    if not text:
        # A run that died between committing its first step folder and writing `latest`, or a
        # `latest` lost since: the newest complete step folder is where it stood.
        return _newest_complete(root)
    run_id = None
    try:
        doc = json.loads(text)
        name, run_id = doc["folder"], doc.get("run_id")
    except (json.JSONDecodeError, TypeError, KeyError):
        name = text          # a folder name written by hand: "step-00000010"
    folder = root / name
    if not folder.is_dir():
        raise CheckpointError(f"{root / LATEST} names {name}, which does not exist; write the name of a step "
                              f"folder of {root} into it, or start afresh")
    meta = _read_meta(folder)
    if run_id is not None and meta.get("run_id") != run_id:
        raise CheckpointError(f"{root / LATEST} belongs to run {run_id} but {folder} to run {meta.get('run_id')}: "
                              "the folder mixes two runs; write the name of the step folder to resume into "
                              f"{root / LATEST}")
    return Checkpoint(int(meta["step"]), folder, meta)


def _newest_complete(root: Path) -> Checkpoint | None:
    """The step folder of ``root`` with the highest step whose ``meta.json`` reads, or None."""
    folders = sorted((p for p in committed(root) if p.name != LATEST), key=lambda p: p.name, reverse=True)
    for folder in folders:
        try:
            meta = _read_meta(folder)
        except CheckpointError:
            continue
        return Checkpoint(int(meta["step"]), folder, meta,
                          note=f"{root / LATEST} is missing or empty: resuming from the newest complete step "
                               f"folder, {folder.name}")
    return None


def committed(root: str | os.PathLike) -> list[Path]:
    """Every checkpoint-like entry of ``root``: step folders and ``latest`` (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name == LATEST or (p.name.startswith("step-") and p.is_dir()))


def describe(root: str | os.PathLike) -> str:
    """A line about the checkpoints in ``root`` (which run, up to which step), for messages."""
    try:
        ck = latest(root)
    except CheckpointError as exc:
        return f"damaged checkpoints ({exc})"
    if ck is None:
        steps = [p.name for p in committed(root) if p.name != LATEST]
        return (f"{len(steps)} step folder(s), none complete (no readable meta.json)" if steps
                else "no checkpoint")
    when = ck.meta.get("written")
    return (f"checkpoints of run {ck.run_id} up to step {ck.step}"
            + (f" (written {when})" if when else ""))


def stale_temporaries(root: str | os.PathLike) -> list[Path]:
    """Temporary files and staging folders under ``root`` (top level and step folders)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    for d in root.iterdir():
        if d.name.startswith("step-") and d.is_dir():
            out += [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    return out


def _size(p: Path) -> int:
    if p.is_dir() and not p.is_symlink():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    with contextlib.suppress(OSError):
        return p.lstat().st_size
    return 0


def remove_stale(root: str | os.PathLike) -> tuple[int, int]:
    """Remove the temporaries a dead run left in ``root``; returns ``(entries, bytes)``.

    Only call it while holding ``root``'s lock (:mod:`.lock`): then no live run writes there.
    """
    n = size = 0
    for p in stale_temporaries(root):
        size += _size(p)
        n += 1
        _remove(p)
    return n, size


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def prepare_folder(root: str | os.PathLike, *, resume: bool, overwrite: bool) -> list[str]:
    """Make ``root`` ready for a run (call it holding ``root``'s lock); returns notes for the user.

    Removes what dead runs left half-written. A fresh run (not ``resume``) into a folder holding
    checkpoints is refused, unless ``overwrite``, which deletes them.
    """
    root = Path(root)
    notes = []
    n, size = remove_stale(root)
    if n:
        notes.append(f"removed {n} temporary file(s) and folder(s) ({human_bytes(size)}) that a run which "
                     f"died left in {root}")
    old = committed(root)
    if resume or not old:
        return notes
    check_fresh(root, overwrite=overwrite)
    for p in old:
        _remove(p)
    notes.append(f"deleted the checkpoints in {root} (--overwrite-checkpoints)")
    return notes


def check_fresh(root: str | os.PathLike, *, overwrite: bool) -> None:
    """Refuse a new run into ``root`` when it holds checkpoints, unless they are to be overwritten."""
    if committed(root) and not overwrite:
        raise CheckpointError(f"{root} holds {describe(root)}; a new run would mix with them. Continue that run "
                              "with --resume, choose another --checkpoint-dir, or pass --overwrite-checkpoints "
                              "to delete them")


def check_resumable(root: str | os.PathLike, *, package: str | None, steps: int) -> Checkpoint:
    """The checkpoint ``--resume`` continues from, refusing one of another package or past ``steps``."""
    ck = latest(root)
    if ck is None:
        raise CheckpointError(f"--resume: no checkpoint in {root} (no '{LATEST}' file and no complete step "
                              "folder); drop --resume to start afresh")
    if package is not None and ck.meta.get("package") != package:
        raise CheckpointError(f"{ck.folder} was written by another package (graph {ck.meta.get('package')}, this "
                              f"package's is {package}); resume with a package of the model it was trained with")
    if steps < ck.step:
        raise CheckpointError(f"--steps {steps} is below the checkpoint's step {ck.step} ({ck.folder}): --steps "
                              f"counts every step of the run, those already done included; give --steps N with "
                              f"N > {ck.step} to train N - {ck.step} more")
    return ck


# --------------------------------------------------------------------------- writing

def _dist_failure(exc: BaseException) -> tuple[dict[int, BaseException], str]:
    failures = {}
    for rank, pair in getattr(exc, "failures", {}).items():
        failures[rank] = pair[0] if isinstance(pair, tuple) else pair
    first = next(iter(failures.values()), exc)
    line = str(first).splitlines()[0] if str(first) else type(first).__name__
    return failures, line


def free_bytes(path: Path) -> int:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def space_message(root: Path, step: int, needed: int, free: int | None, previous: int | None) -> str:
    have = f", {human_bytes(free)} free" if free is not None else ""
    keep = (f"; the checkpoint of step {previous} is intact (resume from it with --resume)" if previous is not None
            else "")
    return (f"no room for the checkpoint of step {step} in {root}: it needs {human_bytes(needed)}{have}{keep}. "
            "Free space there, or give another --checkpoint-dir")


def save(root: str | os.PathLike, step: int, stages: dict[int, dict], *, meta: dict, control=None,
         previous: int | None = None, write: bool = True, keep: int | None = None, history: int | None = None,
         saved: Iterable[int] = (), pending: list[threading.Thread] | None = None) -> Path:
    """Write the checkpoint after ``step`` steps; every rank calls it with its stages' states.

    ``stages`` is ``RankEngine.state()``; ``meta`` goes into ``meta.json`` (run id, package,
    settings); ``control`` (:class:`~ftcompile.runtime.control.Control`) links the ranks, None for
    a single rank. ``previous`` is the step of the last checkpoint, named when this one fails. Every
    rank returns the committed folder, or raises the same :class:`CheckpointError`.

    ``write=False``: this rank holds copies that another rank writes (a replica other than 0 of
    a replicated pipeline): it takes part in the collective and its copies are compared with the
    written ones (digests), but it writes nothing, so a checkpoint holds each stage once.

    ``keep``: once committed, the step folders of steps before ``step`` beyond the ``keep - 1``
    newest of them are deleted (:func:`prune`, with ``history``, the steps this run ``saved`` and
    ``pending``, which collects the background deletions to join); None or 0 keeps all.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(root)
    rank = control.rank if control is not None else 0
    world = control.world_size if control is not None else 1
    flat, scalars = entries(stages)
    sizes = entry_bytes(flat)
    written = flat if write else {}
    if world > 1:
        save_id, all_sizes = control.broadcast(uuid.uuid4().hex[:12]), control.all_gather(sizes)
    else:
        save_id, all_sizes = uuid.uuid4().hex[:12], [sizes]
    unique: dict[str, int] = {}
    for s in all_sizes:
        unique.update(s)
    if world > 1:
        writes = control.all_gather(bool(write))
        if not any(writes):
            raise _everyone(CheckpointError("no rank writes the checkpoint (a bug: replica 0's ranks must)"))
        missing = sorted(set(unique) - {k for s, w in zip(all_sizes, writes) if w for k in s})
        if missing:
            raise _everyone(CheckpointError(f"no writing rank holds {missing[0]} (and {len(missing) - 1} more); "
                                            "the checkpoint would lack it (a bug)"))
    # A digest of every tensor written, kept in meta.json: load() checks what it reads against it,
    # so a damaged file is refused instead of training on (safetensors checks only its header).
    # The same digests show whether the copies several ranks hold are equal (_check_copies).
    shared = _shared_keys(all_sizes)
    digests = {k: _digest(t) for k, t in flat.items() if write or k in shared}
    if world > 1:
        gathered = control.all_gather(digests)
        _check_copies(gathered, shared, step)
        if rank == 0:                 # only rank 0 writes meta.json
            for d in gathered:
                digests.update(d)
    needed = sum(unique.values()) + 64 * 1024 * world    # headers and meta.json
    staging = root / f"{STAGING_PREFIX}{step:08d}-{save_id}"
    # One rank decides for all: on a shared file system every host sees the same free space.
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            free = free_bytes(root)
            if free < needed:
                problem = space_message(root, step, needed, free, previous)
        except OSError as exc:
            problem = f"cannot create the checkpoint folder {root}: {exc.strerror or exc}"
    if world > 1:
        problem = control.broadcast(problem)
    if problem:
        raise _everyone(CheckpointSpaceError(problem) if "no room" in problem else CheckpointError(problem))

    writer = HuggingFaceStorageWriter(str(staging), save_distributed=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "assuming the intent is to save in a single process"
            dcp.save(written, storage_writer=writer, process_group=control.group if control is not None else None,
                     no_dist=world == 1)
    except (CheckpointException, OSError, RuntimeError) as exc:
        if rank == 0:
            _remove(staging)
        failures, line = _dist_failure(exc)
        if isinstance(exc, OSError):
            failures = {rank: exc}
        if isinstance(exc, RuntimeError) or any(type(e) is RuntimeError for e in failures.values()):
            # gloo: "Connection closed by peer" and the like; the transport's receivers say who.
            raise CheckpointPeerLost(f"the collective save of step {step} failed: {line}") from None
        full = [e for e in failures.values() if isinstance(e, OSError) and e.errno in NO_SPACE]
        if full and full[0].errno == errno.EFBIG:
            keep = (f"; the checkpoint of step {previous} is intact (resume from it with --resume)"
                    if previous is not None else "")
            raise _everyone(CheckpointSpaceError(
                f"cannot write the checkpoint of step {step} into {root}: {full[0].strerror} (a file would exceed "
                f"this process's file-size limit, see `ulimit -f`){keep}")) from None
        if full:
            free = None
            with contextlib.suppress(OSError):
                free = free_bytes(root)
            raise _everyone(CheckpointSpaceError(space_message(root, step, needed, free, previous))) from None
        who = f"rank(s) {sorted(failures)}" if failures else f"rank {rank}"
        err = CheckpointError(f"writing the checkpoint of step {step} into {root} failed on {who}: {line}")
        raise (_everyone(err) if isinstance(exc, CheckpointException) else err) from None

    error = None
    if rank == 0:
        try:
            doc = {"format": FORMAT, "version": VERSION, "step": step, **meta, "scalars": scalars,
                   "bytes": sum(unique.values()), "tensors": len(unique),
                   "written": time.strftime("%Y-%m-%d %H:%M:%S"), "digests": digests}
            atomic_write_text(staging / META, json.dumps(doc, indent=1))
            _commit(root, staging, step, meta.get("run_id"))
        except OSError as exc:
            _remove(staging)
            error = (space_message(root, step, needed, None, previous) if exc.errno in NO_SPACE
                     else f"committing the checkpoint of step {step} in {root} failed: {exc.strerror or exc}")
    if world > 1:
        error = control.broadcast(error)
    if error:
        raise _everyone(CheckpointSpaceError(error) if "no room" in error else CheckpointError(error))
    if keep and rank == 0:
        try:
            prune(root, step, keep, history=history, written=saved, pending=pending)
        except OSError as exc:       # the new checkpoint stands: an old one left is no reason to stop
            print(f"ftcompile: warning: could not delete checkpoints older than the {keep} newest in {root}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
    return step_dir(root, step)


def _digest(t: torch.Tensor) -> str:
    import hashlib

    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()     # no second host copy


def _shared_keys(all_keys: list[dict]) -> set[str]:
    """Entries that several ranks hold (tied weights, replicated stages)."""
    held: dict[str, int] = {}
    for keys in all_keys:
        for k in keys:
            held[k] = held.get(k, 0) + 1
    return {k for k, n in held.items() if n > 1}


def _check_copies(digests: list[dict[str, str]], shared: set[str], step: int) -> None:
    """Tensors several ranks hold must be equal (``digests``: every rank's): the save keeps one copy."""
    for k in sorted(shared):
        seen = {r: d[k] for r, d in enumerate(digests) if k in d}
        if len(set(seen.values())) > 1:
            raise _everyone(CheckpointError(
                f"ranks {sorted(seen)} hold different copies of {k}, which they share, at step {step}: their "
                "training diverged (a bug); the checkpoint would keep only one of them, so it is not written"))


def _commit(root: Path, staging: Path, step: int, run_id: str | None) -> None:
    """Make a fully written staging folder the checkpoint of ``step``, then point ``latest`` at it."""
    final = step_dir(root, step)
    old = None
    if final.exists():
        # The same step of this run, committed by an attempt that died before moving 'latest'.
        old = root / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(root)
    atomic_write_text(root / LATEST, json.dumps({"folder": final.name, "step": step, "run_id": run_id}) + "\n")
    if old is not None:
        _remove(old)


def prune(root: str | os.PathLike, step: int, keep: int, *, history: int | None = None,
          written: Iterable[int] = (), pending: list[threading.Thread] | None = None) -> list[Path]:
    """Delete the step folders of ``root`` for steps before ``step`` beyond the ``keep - 1`` newest
    of them; returns those deleted.

    Only this run's line counts: steps up to ``history`` (where it resumed; None: every step
    before ``step``) and the steps it ``written`` itself. Folders of other steps (a continuation
    the user rolled back from by pointing ``latest`` at an older step) are neither counted nor
    deleted: the run overwrites them as it passes. Each folder goes by renaming it to a temporary
    first, so one half deleted is never taken for a checkpoint (:func:`remove_stale` finishes
    it). With ``pending`` the renamed folders are deleted in a background thread appended to it (a
    large checkpoint on a network file system can take minutes, while the other ranks train on);
    the caller joins it before its process leaves (a rank leaves through ``os._exit``, which would
    cut the deletion short and leave the renamed folder behind). Without, they are deleted at once."""
    root = Path(root)
    written = set(written)
    older = []
    for p in committed(root):
        if p.name == LATEST:
            continue
        try:
            n = int(p.name[len("step-"):])
        except ValueError:
            continue
        if n < step and (history is None or n <= history or n in written):
            older.append((n, p))
    older.sort(reverse=True)
    gone, doomed = [], []
    for _, p in older[max(keep - 1, 0):]:
        tmp = root / f".tmp-old-{p.name}-{uuid.uuid4().hex[:8]}"
        os.replace(p, tmp)
        doomed.append(tmp)
        gone.append(p)
    if doomed and pending is not None:
        t = threading.Thread(target=lambda: [_remove(d) for d in doomed], name="ftcompile-prune")
        t.start()
        pending.append(t)
    else:
        for d in doomed:
            _remove(d)
    return gone


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- reading

def keys(ck: Checkpoint) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every entry of a checkpoint: key -> (shape, dtype), from the safetensors headers."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import _getdtype

    out = {}
    files = sorted(ck.folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ck.folder} holds no tensor file; resume from an older step folder by writing its "
                              f"name into {ck.folder.parent / LATEST}")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    sl = fh.get_slice(k)
                    out[k] = (tuple(sl.get_shape()), _getdtype(sl.get_dtype()))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{f} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                  f"resume from an older step folder by writing its name into "
                                  f"{ck.folder.parent / LATEST}") from None
    return out


def load(ck: Checkpoint, names: Iterable[str], device: str | torch.device = "cpu", *,
         optimizer: bool = True) -> dict:
    """The weights and optimizer state of the parameters ``names`` from checkpoint ``ck``.

    Returns ``{"step", "weights": {name: tensor}, "optimizer": {name: {key: value}}}`` with
    tensors on ``device``: what ``RankEngine.load_state`` takes. Each rank reads only the
    entries it asks for, from whichever files hold them (``torch.distributed.checkpoint.load``
    without collectives). A name the checkpoint lacks is a CheckpointError.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    names = list(dict.fromkeys(names))
    available = keys(ck)
    missing = [n for n in names if n not in available]
    if missing:
        raise CheckpointError(f"{ck.folder} lacks {len(missing)} of the tensors this rank holds ({', '.join(missing[:3])}"
                              f"{'...' if len(missing) > 3 else ''}): it was written for another model")
    wanted = set(names)
    template: dict[str, torch.Tensor] = {n: torch.empty(available[n][0], dtype=available[n][1]) for n in names}
    if optimizer:
        for k, (shape, dtype) in available.items():
            if k.startswith(OPTIMIZER_PREFIX) and k[len(OPTIMIZER_PREFIX):].rsplit("/", 1)[0] in wanted:
                template[k] = torch.empty(shape, dtype=dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(template, storage_reader=HuggingFaceStorageReader(str(ck.folder)), no_dist=True)
    except Exception as exc:  # noqa: BLE001 - torch and safetensors raise many kinds on a damaged file
        raise CheckpointError(f"{ck.folder} cannot be read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); resume from an older step folder "
                              f"by writing its name into {ck.folder.parent / LATEST}") from None
    digests = ck.meta.get("digests") or {}     # none in checkpoints written before they were recorded
    damaged = [k for k, t in template.items() if k in digests and _digest(t) != digests[k]]
    if damaged:
        raise CheckpointError(f"{ck.folder} is damaged: {len(damaged)} tensor(s) read back differ from what was "
                              f"written ({', '.join(damaged[:3])}{'...' if len(damaged) > 3 else ''}; their digests in "
                              f"{META} do not match); resume from an older step folder by writing its name into "
                              f"{ck.folder.parent / LATEST}")
    scalars = ck.meta.get("scalars", {})
    out: dict = {"step": ck.step, "weights": {}, "optimizer": {}}
    for k, t in template.items():
        if not k.startswith(OPTIMIZER_PREFIX):
            out["weights"][k] = t.to(device)
            continue
        name, key = k[len(OPTIMIZER_PREFIX):].rsplit("/", 1)
        kind = scalars.get(key)
        value = {"int": int, "float": float, "bool": bool}[kind](t.item()) if kind else t.to(device)
        out["optimizer"].setdefault(name, {})[key] = value
    return out


def other_package(ck: Checkpoint, manifest) -> str | None:
    """Why checkpoint ``ck`` was not trained with the package of ``manifest`` (graphs differ), or
    None when it was or either does not say."""
    saved = ck.meta.get("package")
    own = manifest.generator.get("base_graph_hash") or manifest.generator.get("graph_hash")
    if saved and own and saved != own:
        return f"{ck.folder} was trained with another package (graph {saved[:12]}, this one {own[:12]})"
    return None


def load_weights(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """Every weight of a checkpoint by canonical name (no optimizer state), on the CPU."""
    names = [k for k in keys(ck) if not k.startswith(OPTIMIZER_PREFIX)]
    return load(ck, names, optimizer=False)["weights"]
