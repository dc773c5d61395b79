"""One rank of a training run: ``python -m ftcompile.runtime PACKAGE [options]``.

Started by ``ftcompile run --nproc N`` (torch's elastic agent, on this host), by
``torchrun --nproc-per-node N -m ftcompile.runtime PACKAGE`` or by
``mpirun -np N python -m ftcompile.runtime PACKAGE``; the rank and world size come from the
launcher's environment (:func:`~ftcompile.runtime.transport.detect_launcher`).

A rank, in order:

1. checks the options (:mod:`.options`), the package and, with ``--resume``, the checkpoint;
   an error found by every rank alike is printed by rank 0 only;
2. joins the transport and the control plane (:mod:`.control`), agrees on the run id and
   starts its heartbeat;
3. the rank holding the loss stage locks the log and checkpoint folders (:mod:`.lock`),
   removes what dead runs left there and refuses a folder of another run's checkpoints;
   every rank learns the outcome before any of them goes on;
4. loads its stages, and with ``--resume`` their weights and optimizer state by name;
5. trains in segments between checkpoints (:mod:`.checkpoint`), the loss rank writing
   ``train.jsonl`` (:mod:`.runlog`), opened only now.

On a failure a rank prints one line naming itself and its stages, records it for an elastic
agent (``TORCHELASTIC_ERROR_FILE``) and exits non-zero: 2 for a refusal (bad options,
damaged package or checkpoint, busy folder), 1 for a failed run, 128 + N when stopped by
signal N. Started by an elastic agent, a rank dies with it (parent-death signal).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from . import avgpipe as _avgpipe
from . import checkpoint as ckpt
from .atomic import atomic_write_text
from .cache import CacheError, open_cache
from .checkpoint import CheckpointError
from .engine import PipelineError, PipelineHang, RankEngine, TrainConfig
from .layout import RankLayout
from .lock import FolderBusy, acquire
from .options import (NothingToDo, OptionError, add_train_arguments, check, new_run_id, recorded_config,
                      replicas_for, resolve, worker_argv)
from .package import PackageError, load_package
from .runlog import NO_SPACE, RunLogError, open_log
from .schedules import ScheduleError
from .transport import TransportError, detect_launcher, make_transport

__all__ = ["add_train_arguments", "check_train_args", "config_from_args", "main", "run", "worker_argv"]

#: Errors a user can cause or fix: exit status 2.
REFUSALS = (OptionError, CheckpointError, FolderBusy, PackageError, ScheduleError, ValueError)


def check_train_args(args) -> list[str]:
    """Refuse option values that make no sense (``ValueError``); returns warnings (see :func:`.options.check`)."""
    warnings = check(args)
    _device(args.device, 0)
    return warnings


def config_from_args(args, manifest) -> TrainConfig:
    """The engine's configuration from resolved options (:func:`.options.resolve`)."""
    return TrainConfig(schedule=args.schedule, micro_batches=args.micro_batches, steps=args.steps,
                       optimizer=args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                       lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                       clip_grad_norm=args.clip_grad_norm or None, recompute=bool(args.recompute),
                       tied_lag=bool(args.tied_lag), in_flight_scale=int(getattr(args, "in_flight_scale", None) or 1),
                       weight_prediction=bool(args.weight_prediction), seed=args.seed,
                       dropout=not args.no_dropout, timeout_s=args.timeout, total_steps=args.steps,
                       nonfinite=args.on_nonfinite or "stop", advance=_avgpipe.resolved(args)[1] if args.schedule == "avgpipe" else 0,
                       measure_memory=bool(getattr(args, "measure_memory", False)))


def describe_rank(manifest, layout: RankLayout, r: int) -> str:
    """``rank 3 (replica 1, stages [2, 3])``: what rank ``r`` of ``layout`` runs."""
    for rep in range(layout.replicas):
        stages = sorted(s for s, x in layout.stage_ranks(manifest, rep).items() if x == r)
        if stages:
            return f"rank {r} ({f'replica {rep}, ' if layout.replicas > 1 else ''}stages {stages})"
    return f"rank {r} (no stage)"


def _device(spec: str, local_rank: int) -> torch.device:
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise OptionError(f"--device must be cpu, cuda (each rank takes cuda:LOCAL_RANK) or cuda:N; got {spec!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError("--device cuda but torch sees no GPU; use --device cpu")
        if device.index is None:
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if device.index >= torch.cuda.device_count():
            raise OptionError(f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


# --------------------------------------------------------------------------- reporting

class Stopped(BaseException):
    """A signal asked this rank to stop."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Agreed(Exception):
    """Another rank refused to go on; it has said why."""

    def __init__(self, rank: int, code: int):
        super().__init__(f"rank {rank} refused")
        self.rank, self.code = rank, code


class Refusal(Exception):
    """This rank is the first to fail a start-up step every rank agreed on: it says why."""

    def __init__(self, exc: BaseException, code: int):
        super().__init__(str(exc))
        self.exc, self.code = exc, code


class Reporter:
    """Says once why this rank stops: a line on stderr and a record for the elastic agent."""

    def __init__(self, rank: int, under_ftcompile: bool):
        self.rank, self.under_ftcompile = rank, under_ftcompile
        self._lock = threading.Lock()
        self.done = False
        # Until the ranks are linked, every rank checks the same options and files alike:
        # an error then is the same on every rank, and rank 0 alone prints it.
        self.alike = True

    def __call__(self, message: str, *, kind: str, code: int, peer: int | None = None, show: bool = True) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
        if not message.startswith("rank "):
            message = f"rank {self.rank}: {message}"
        # The launcher may be stopping the other ranks (SIGTERM) while this one reports: a stop
        # signal raised here would print a traceback after the line and leave the record half
        # written, which the elastic agent cannot parse. This rank is stopping anyway.
        held = _hold_stop_signals()
        try:
            if show:
                print(f"ftcompile run: error: {message}", file=sys.stderr, flush=True)
            path = os.environ.get("TORCHELASTIC_ERROR_FILE")
            if path:
                # The elastic agent reads "message" and "timestamp"; "ftcompile" tells our launcher
                # whether this rank failed itself or saw a peer fail, and whether it already spoke.
                record = {"message": message, "timestamp": int(time.time()),
                          "ftcompile": {"rank": self.rank, "kind": kind, "peer": peer, "code": code,
                                        "shown": show, "time": time.time()}}
                try:
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(path, json.dumps(record))     # whole or absent, never torn
                except OSError:
                    pass
        finally:
            _release_stop_signals(held)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _hold_stop_signals() -> dict | None:
    """Ignore stop signals for a moment (main thread only, where Python runs handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS}


def _release_stop_signals(held: dict | None) -> None:
    for s, handler in (held or {}).items():
        if handler is not None:         # None: a handler not set from Python, which cannot be restored
            signal.signal(s, handler)


def _kind(exc: BaseException) -> tuple[str, int | None]:
    """How a failure relates to the peers: (``error`` | ``lost`` | ``hang``, the peer it names)."""
    text = str(exc)
    if isinstance(exc, PipelineHang):
        m = re.search(r"\(rank (\d+)\)", text)
        return "hang", int(m.group(1)) if m else None
    m = re.search(r"lost rank (\d+)", text) or re.search(r"sending to rank (\d+) failed, its process is gone", text)
    if m:
        return "lost", int(m.group(1))
    if "lost a peer" in text:
        return "lost", None
    m = re.search(r"rank (\d+) \(stages [^)]*\) sent no heartbeat", text)
    if m:
        return "hang", int(m.group(1))
    if "heartbeat store" in text:
        m = re.search(r": rank (\d+) \(stages", text)
        return "hang", int(m.group(1)) if m else None
    return "error", None


def _die_with_parent() -> None:
    """Started by an elastic agent (``ftcompile run``, torchrun): die if it dies, even by ``kill -9``."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = int(os.environ.get("FTCOMPILE_LAUNCHER_PID", 0)) or os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:      # it died before the signal was set
        os._exit(128 + signal.SIGKILL)


def _on_signal(signum, frame) -> None:
    raise Stopped(signum)


# --------------------------------------------------------------------------- the run

def _agree(control, exc: BaseException | None, rank: int) -> None:
    """Every rank learns whether any rank failed a start-up step; only the first failing rank reports it."""
    if control is None:
        if exc is not None:
            raise Refusal(exc, 2 if isinstance(exc, REFUSALS) else 1)
        return
    code = 0 if exc is None else (2 if isinstance(exc, REFUSALS) else 1)
    try:
        outcomes = control.all_gather(code)
    except RuntimeError as err:     # gloo: a peer died while the ranks were starting
        raise PipelineError(f"rank {rank}: lost a peer while the ranks were starting "
                            f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    first = next((r for r, c in enumerate(outcomes) if c), None)
    if first is None:
        return
    if first == rank and exc is not None:
        raise Refusal(exc, code)
    raise Agreed(first, outcomes[first])


def _wait_for_failure(engine, seconds: float) -> str | None:
    """The engine's report of a lost peer, waiting a little for its receivers to notice."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        failure = getattr(engine, "failure", None)
        if failure:
            return failure
        time.sleep(0.05)
    return None


def _abort(engine, message: str) -> None:
    """Make a rank's engine stop at its next wait with ``message`` (from the heartbeat thread)."""
    abort = getattr(engine, "abort", None)
    if callable(abort):
        abort(message)
        return
    cv = getattr(engine, "cv", None)
    if cv is not None:
        with cv:
            if getattr(engine, "failure", None) is None:
                engine.failure = message
            cv.notify_all()


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _launch_run_id() -> str | None:
    """The run id the launcher gave (``ftcompile run``, or torchrun's ``--rdzv-id``), if any."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    return os.environ.get("FTCOMPILE_RUN_ID") or (elastic if elastic not in (None, "", "none") else None)


class RankRun:
    """One rank's run, in the order of the module docstring: :meth:`execute` it."""

    def __init__(self, args, report: Reporter | None = None):
        self.launch = detect_launcher()
        self.rank = self.launch.rank
        self.report = report or Reporter(self.rank, self.launch.launcher == "ftcompile")
        self.args = args
        self.transport = self.control = self.heartbeat = self.engine = self.norms = self.layout = self.cache = None
        self.locks: list = []
        self.log = self.bar = None
        self._deleting: list[threading.Thread] = []   # deletions of older checkpoints, joined in close()

    def execute(self) -> int:
        self.check()
        self.link()
        self.take_folders()
        self.load()
        self.train()
        self.close()
        return 0

    # ------------------------------------------------------------------ 1. checks
    def check(self) -> None:
        from .engine import programs

        check_train_args(self.args)
        self.package = load_package(self.args.package)
        m = self.m = self.package.manifest
        world = self.launch.world_size
        _avgpipe.as_replicas(self.args, self.args.schedule or m.schedule)     # AvgPipe: N pipelines = N replicas
        self.replicas = replicas_for(m, world, self.args.replicas)
        self.layout = RankLayout(world, self.replicas, self.rank, self.args.rank_order or m.rank_order)
        says = self.rank == 0 and self.launch.launcher != "ftcompile"     # else the launcher said it
        self.res = resolve(self.args, m, restart_run_id=_launch_run_id(), replicas=self.replicas, check_data=says)
        args = self.args = self.res.args
        self.cfg = config_from_args(args, m)
        programs(m, self.cfg, 1)                 # a schedule that cannot run is refused here
        if says:
            for w in self.res.warnings:
                print(f"ftcompile run: warning: {w}", file=sys.stderr)
            for n in self.res.notes:
                print(f"ftcompile run: {n}", file=sys.stderr)
        self.device = _device(args.device, self.launch.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # AvgPipe --advance adapt: Algorithm 1 while training (runtime/avgpipe.py, AdvanceTuner).
        self.tuner = None
        spec = _avgpipe.adaptive(args)
        if spec is not None:
            self.tuner = _avgpipe.AdvanceTuner(spec, self.cfg.micro_batches)
            if self.res.checkpoint is not None:
                note = self.tuner.resume(self.res.checkpoint.meta.get("avgpipe_advance"))
                if note and self.rank == 0:
                    print(f"ftcompile run: {note}", file=sys.stderr)
            self.cfg.advance = self.tuner.advance
            if self.device.type == "cpu" and self.tuner.limit_for(self.device) is not None:
                self.cfg.measure_memory = True     # per-step peaks: the resident set cannot tell steps apart
        self.ranks = self.layout.stage_ranks(m)
        # Replica 0's loss rank writes the log and holds the folders' locks.
        first = self.layout.stage_ranks(m, 0)
        self.owner = first[m.loss_stage] if m.loss_stage is not None else min(first.values())
        # AvgPipe: the N parallel pipelines are the N replicas, pulled toward their average instead of
        # averaging gradients (runtime/avgpipe.py).
        self.averaging = None
        if self.cfg.schedule == "avgpipe":
            self.averaging = _avgpipe.ElasticAveraging(self.replicas, _avgpipe.resolved(args)[2])
        self.log_dir = Path(args.log_dir or Path(args.package) / "runs" / args.schedule)

    def describe(self, r: int) -> str:
        return describe_rank(self.m, self.layout, r)

    # ------------------------------------------------------------------ 2. linking the ranks
    def link(self) -> None:
        args, launch = self.args, self.launch
        run_id = (self.res.checkpoint.run_id if self.res.checkpoint is not None else None) or _launch_run_id()
        if launch.world_size > 1:
            from .control import Control, Heartbeat

            try:
                self.transport = make_transport(args.transport, launch, device=self.device, timeout_s=args.timeout)
                self.rank = self.transport.rank
                self.control = Control.connect(launch, self.transport, timeout_s=args.timeout)
                run_id = self.control.broadcast(run_id or new_run_id())
            except TransportError:
                raise
            except RuntimeError as err:     # a peer died before the ranks were linked
                raise TransportError(f"rank {self.rank}: could not link with the other ranks, lost a peer while "
                                     f"starting ({_first_line(err)})") from None
            self.heartbeat = Heartbeat(self.control, timeout_s=args.heartbeat_timeout, describe=self.describe,
                                       on_failure=self._peer_silent).start()
        self.report.alike = False
        self.run_id = run_id or new_run_id()

    def _peer_silent(self, message: str, peer: int | None) -> None:
        self.report(message, kind="hang", code=1, peer=peer)
        _abort(self.engine, message)

    def phase(self, text: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.phase = text

    # ------------------------------------------------------------------ 3. the folders
    def take_folders(self) -> None:
        """The loss rank locks the folders for the whole run; nothing is written before every rank agrees."""
        args, failure = self.args, None
        if self.rank == self.owner:
            try:
                self.locks.append(acquire(self.log_dir, self.run_id, what="logs"))
                if args.checkpoint_dir:
                    if Path(args.checkpoint_dir).resolve() != self.log_dir.resolve():
                        self.locks.append(acquire(args.checkpoint_dir, self.run_id, what="checkpoints"))
                    for note in ckpt.prepare_folder(args.checkpoint_dir, resume=self.res.checkpoint is not None,
                                                    overwrite=args.overwrite_checkpoints):
                        print(f"ftcompile run: {note}", file=sys.stderr)
            except (FolderBusy, CheckpointError, OSError) as exc:
                failure = exc
        _agree(self.control, failure, self.rank)

    # ------------------------------------------------------------------ 4. stages and checkpoint
    def load(self) -> None:
        self.phase("loading its stages")
        failure, ck = None, self.res.checkpoint
        try:
            from .freeze import grad_norms_hook

            self.norms = grad_norms_hook(self.args, self.m, self.layout)
            if getattr(self.args, "autocache", None):
                self.cache = open_cache(self.args.autocache, self.m)
            self.engine = RankEngine(self.package, self.cfg, rank=self.rank, world_size=self.launch.world_size,
                                     transport=self.transport, device=self.device, layout=self.layout,
                                     averaging=self.averaging, grad_hook=self.norms, cache=self.cache)
            if ck is not None:
                self.phase(f"loading the checkpoint of step {ck.step}")
                names = [n for mod in self.engine.modules.values() for n in mod.state_dict()]
                self.engine.load_state(ckpt.load(ck, names, self.device, optimizer=not self.args.reset_optimizer))
        except (PipelineError, CheckpointError, PackageError, CacheError, OSError) as exc:
            failure = exc
        _agree(self.control, failure, self.rank)
        self.start = ck.step if ck is not None else 0
        self._written: list[int] = []     # the steps this run checkpointed (--keep-checkpoints)

    # ------------------------------------------------------------------ 5. training
    def _open_log(self) -> None:
        args = self.args
        if self.rank != self.engine.log_rank:
            return
        resumed = self.start if self.res.checkpoint is not None else None
        self.log, notes = open_log(self.log_dir, run_id=self.run_id, resume_step=resumed)
        for note in notes:
            print(f"ftcompile run: {note}", file=sys.stderr)
        if args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty()):
            from tqdm import tqdm
            self.bar = tqdm(total=args.steps, initial=self.start, unit="step", file=sys.stderr,
                            desc=f"{self.cfg.schedule} x{self.launch.world_size}" +
                            (f" ({self.replicas} replicas)" if self.replicas > 1 else ""))

    def _on_step(self, rec: dict) -> None:
        from .freeze import phase_record

        rec = {"run": self.run_id, "schedule": self.cfg.schedule, "micro_batches": self.cfg.micro_batches,
               "world_size": self.launch.world_size, "replicas": self.replicas,
               **phase_record(self.m, self.layout, self.cfg, self.args), **rec}
        if self.averaging is not None:
            rec["parallel_pipelines"] = self.replicas
            rec.setdefault("advance", self.cfg.advance)
        loss = rec.get("loss")
        if loss is not None and not math.isfinite(loss):
            # train.jsonl stays strict JSON (no NaN / Infinity literals)
            rec["loss"], rec["loss_not_finite"] = None, repr(float(loss))
        if self.cfg.measure_memory:
            rec["memory_measured"] = "tensors each rank holds (runtime.memory)"
        self.log.write(rec)
        if self.bar is not None:
            self.bar.update(1)
            if rec.get("loss") is not None:
                self.bar.set_postfix(loss=f"{rec['loss']:.4f}", sps=f"{rec.get('samples_per_s') or 0:.1f}")

    def _data_fingerprint(self) -> str | None:
        if not hasattr(self, "_fingerprint"):      # once a run: hashing a corpus is not free
            from .data import data_fingerprint

            self._fingerprint = data_fingerprint(self.args.data)
        return self._fingerprint

    def _save(self, step: int, previous: int | None) -> None:
        args, m = self.args, self.m
        meta = {"run_id": self.run_id, "package": m.generator.get("base_graph_hash") or m.generator.get("graph_hash"),
                "model": m.model.get("name"), "micro_batch_size": m.micro_batch_size,
                "world_size": self.launch.world_size, "replicas": self.replicas, "rank_order": self.layout.order,
                "log_dir": str(self.log_dir.resolve()), "config": recorded_config(args),
                # rank 0 writes meta.json: the others need not hash the data
                "data_fingerprint": self._data_fingerprint() if self.rank == 0 else None}
        if self.tuner is not None:
            meta["avgpipe_advance"] = self.tuner.to_json()
        self.phase(f"in the checkpoint of step {step}")
        try:
            # Once per stage: replica 0's ranks write; the others' copies are only compared with
            # theirs (gradients are averaged across replicas under every schedule, so all hold the
            # same weights and optimizer state; a difference is refused as a bug).
            # AvgPipe's parallel pipelines differ: they save the reference model (their average, the
            # same bits on every pipeline), from which all N resume.
            state = self.engine.state()
            if self.averaging is not None:
                state = self.averaging.reference(state)
            # --keep-checkpoints counts this run's line only: the steps up to where it resumed and
            # those it wrote, not a continuation the user rolled back from.
            ckpt.save(args.checkpoint_dir, step, state, meta=meta, control=self.control,
                      previous=previous, write=self.layout.replica == 0, keep=getattr(args, "keep_checkpoints", None),
                      history=self.start if self.res.checkpoint is not None else None, saved=self._written,
                      pending=self._deleting)
            self._written.append(step)
        except (ckpt.CheckpointPeerLost, RuntimeError) as exc:
            # A peer that died mid-save fails the collective; the transport's receivers say which.
            lost = _wait_for_failure(self.engine, seconds=5)
            raise PipelineError(f"{lost} (during the checkpoint of step {step})" if lost else
                                f"rank {self.rank}: lost a peer during the checkpoint of step {step}: {exc}") from None

    def train(self) -> None:
        from .data import load_dataset

        args, cfg, engine = self.args, self.cfg, self.engine
        # Each step's batch holds every replica's micro-batches; the engine takes this replica's share.
        batches = iter(load_dataset(args.data, self.m, micro_batches=self.replicas * cfg.micro_batches,
                                    seed=args.seed))
        for _ in range(self.start):
            next(batches)
        self._open_log()
        t0 = time.perf_counter()
        every = args.checkpoint_every or args.steps
        step, previous = self.start, (self.start if self.res.checkpoint is not None else None)
        engine.start()
        on_step = self._on_step if self.log is not None else None
        while step < args.steps:
            n = min(every, args.steps - step)
            self.phase(f"training steps {step}-{step + n - 1}")
            end = step + n
            # --advance adapt: one step per segment while adapting, the ranks agreeing on the next advance between
            # two steps (AvgPipe flushes every step anyway); the rest of the segment in one go once settled.
            while self.tuner is not None and self.tuner.adapting and step < end:
                _avgpipe.adapt_segment(self.tuner, engine, self.control, batches, step, on_step)
                step += 1
            if step < end:
                engine.run(batches, end - step, on_step=on_step, step_offset=step)
                step = end
            if args.checkpoint_dir and (args.checkpoint_every or step == args.steps):
                self._save(step, previous)
                previous = step
        self.phase("finishing")
        engine.finish()
        self.seconds = time.perf_counter() - t0
        if self.norms is not None and args.grad_norms_file:
            self.norms.write(f"{args.grad_norms_file}.rank{self.rank}.json")
        if self.cache is not None and self.rank == self.owner and self.cache.cfg.index_out:
            # every rank decided alike; after finish() every rank's writes are done
            self.cache.index().save(self.cache.cfg.index_out)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            done, cfg = self.args.steps - self.start, self.cfg
            sps = done * self.replicas * cfg.micro_batches * self.m.micro_batch_size / self.seconds
            self.log.write({"run": self.run_id, "summary": True, "steps": done, "seconds": self.seconds,
                            "schedule": cfg.schedule, "samples_per_s": sps})
            self.log.close()
            reps = f" ({self.replicas} replicas)" if self.replicas > 1 else ""
            print(f"ftcompile run: {done} steps of {cfg.schedule} on {self.launch.world_size} rank(s){reps} in "
                  f"{self.seconds:.1f} s ({sps:.1f} samples/s); log: {self.log_dir / 'train.jsonl'}", file=sys.stderr)
        if self.control is not None:
            self.control.close()
        if self.transport is not None:
            self.transport.close()
        # Before the checkpoint folder's lock goes: the rank leaves through os._exit, which would cut
        # a deletion short and leave its renamed folder behind.
        for t in self._deleting:
            t.join()
        for lk in self.locks:
            lk.release()


def run(args, report: Reporter | None = None) -> int:
    """Train as one rank (see the module docstring); returns 0, or raises what stopped it."""
    return RankRun(args, report).execute()


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: where every thread is
    _die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    p = argparse.ArgumentParser(prog="python -m ftcompile.runtime",
                                description="Train a generated package; one process per rank (see `ftcompile run`).")
    add_train_arguments(p)
    args = p.parse_args(argv)
    launch = detect_launcher()
    report = Reporter(launch.rank, launch.launcher == "ftcompile")
    code = 0
    try:
        code = run(args, report)
    except Stopped as exc:
        name = signal.Signals(exc.signum).name
        # Under ftcompile run the launcher says why it stopped the ranks.
        report(f"stopped by {name}", kind="signal", code=128 + exc.signum,
               show=launch.launcher != "ftcompile")
        code = 128 + exc.signum
    except KeyboardInterrupt:
        report("interrupted", kind="signal", code=130, show=False)
        code = 130
    except NothingToDo as exc:
        if launch.rank == 0:
            print(f"ftcompile run: {exc}", file=sys.stderr)
        code = 0
    except Refusal as exc:
        kind, peer = _kind(exc.exc)
        report(str(exc.exc), kind=kind, code=exc.code, peer=peer)
        code = exc.code
    except Agreed as exc:
        report(f"stopped: rank {exc.rank} refused to go on", kind="agreed", code=exc.code, show=False)
        code = exc.code
    except (PipelineError, TransportError, RunLogError, OSError) as exc:
        kind, peer = _kind(exc)
        # A lost peer is a consequence: under ftcompile run the launcher names the root cause (the
        # peer's own error, or its signal) and prints this line only when it has nothing better.
        # No room for the log is the user's to mend (free space, another --log-dir), as for checkpoints.
        code = 2 if isinstance(exc, RunLogError) and exc.errno in NO_SPACE else 1
        report(str(exc) if not isinstance(exc, OSError) or isinstance(exc, RunLogError) else
               f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", kind=kind, code=code, peer=peer,
               show=not (kind == "lost" and launch.launcher == "ftcompile"))
    except REFUSALS as exc:
        alike = report.alike or getattr(exc, "every_rank", False)
        report(str(exc), kind="error", code=2, show=launch.rank == 0 or not alike)
        code = 2
    except Exception as exc:  # noqa: BLE001 - a bug: say so in one line, the traceback on request
        if os.environ.get("FTCOMPILE_DEBUG"):
            import traceback
            traceback.print_exc()
        report(f"internal error: {type(exc).__name__}: {exc} (this is a bug; FTCOMPILE_DEBUG=1 shows the "
               "traceback)", kind="error", code=1)
        code = 1
    sys.stderr.flush()
    sys.stdout.flush()
    if code == 0:
        # Finalize MPI ourselves: leaving through os._exit skips the interpreter's teardown, where
        # C++ threads of torch's stores and groups may still run and abort the process.
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    # Receiver and heartbeat threads may sit in blocking calls: leave at once.
    os._exit(code)
