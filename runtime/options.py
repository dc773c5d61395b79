"""Training options: their definitions, their checks, and what a resumed run takes from its checkpoint.

Shared by ``ftcompile run`` (which checks everything before any rank starts) and every rank
(``python -m ftcompile.runtime``, started by ``ftcompile run``, torchrun or mpirun, which checks
again, so that a rank started by hand is as safe). :func:`check` refuses values that make no
sense with a :class:`OptionError` saying what to give instead, and returns warnings for options
that are pointless. :func:`resolve` reconciles the options with the checkpoint of ``--resume``:
an option not given takes the checkpoint's value; one given explicitly applies (the lr, the
schedule...) when that is meaningful, and is refused when it is not (another optimizer's state).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
import uuid
from dataclasses import dataclass, field

from .checkpoint import Checkpoint, CheckpointError, check_resumable, latest
from .control import HEARTBEAT_TIMEOUT_S
from .layout import ORDERS
from .optim import LR_SCHEDULES, OPTIMIZERS, PREDICTS, resume_change
from .schedules import CONTINUOUS, SCHEDULES, SYNCHRONOUS

#: Defaults of the options a resumed run otherwise takes from its checkpoint.
DEFAULTS = {"steps": 10, "optimizer": "adam", "lr": 1e-3, "momentum": 0.9, "weight_decay": 0.0,
            "lr_schedule": "constant", "warmup_steps": 0, "seed": 0, "data": "synthetic", "recompute": False,
            "weight_prediction": False, "no_dropout": False, "clip_grad_norm": None, "on_nonfinite": "stop",
            "advance": 0, "tied_lag": True, "in_flight_scale": 1}
#: Recorded in every checkpoint's ``meta.json`` (``config``), and inherited by ``--resume``.
RECORDED = ("schedule", "micro_batches", "steps", "optimizer", "lr", "momentum", "weight_decay", "lr_schedule",
            "warmup_steps", "clip_grad_norm", "seed", "data", "recompute", "weight_prediction", "no_dropout",
            "on_nonfinite", "advance", "tied_lag", "checkpoint_every", "keep_checkpoints")
# (Not the in-flight scale: it belongs to the plan's stages, so a resumed run, perhaps of a re-planned
# package, takes its plan's unless given.)


class OptionError(ValueError):
    """An option value that makes no sense; the message says what to give."""


class NothingToDo(Exception):
    """``--resume`` found the run already at its last step."""


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The training options, shared by ``ftcompile run`` and ``python -m ftcompile.runtime``."""
    p.add_argument("package", metavar="PACKAGE", help="a package folder written by `ftcompile compile -o`")
    g = p.add_argument_group("schedule")
    g.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (default: the one the plan was compiled for)")
    g.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="micro-batches per step; one optimizer update per step (default: the plan's)")
    g.add_argument("--steps", type=int, default=None, metavar="K",
                   help="steps of the whole run, those a resumed run already did included (default 10; with "
                        "--resume: the checkpoint's)")
    g.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="gpipe/1f1b/2bw/2gw: recompute activations in backward (async always recomputes; "
                        "default: the plan's)")
    g.add_argument("--weight-prediction", action=argparse.BooleanOptionalAction, default=None,
                   help="async: forward with weights predicted to the backward's version (FTPipe §4.2; "
                        "momentum, adam, adamw; default: the plan's)")
    g.add_argument("--parallel-pipelines", default=None, metavar="N|auto",
                   help="avgpipe: N parallel pipelines with elastic averaging, each on its own batch (they are the run's "
                        "replicas: --nproc counts the ranks of all N; default 1; auto: the plan's tuned choice)")
    g.add_argument("--advance", default=None, metavar="K|auto|adapt[:LIMIT]",
                   help="avgpipe: micro-batches forwarded in advance of 1F1B's warm-up (0: 1F1B, M: all forwards "
                        "first; default 0; auto: the plan's tuned choice; adapt: AvgPipe's Algorithm 1 while "
                        "training, from 0 up by one per step while steps get faster and each rank's peak stays "
                        "under LIMIT, e.g. adapt:6GiB (default: 90%% of the GPU's memory; none on the CPU))")
    g.add_argument("--elastic-alpha", type=float, default=None, metavar="A",
                   help="avgpipe: how far each parallel model is pulled toward their average per step (default 1/N)")
    g.add_argument("--tied-lag", action=argparse.BooleanOptionalAction, default=None,
                   help="async/pipedream/2bw/2gw: a tensor several stages share (tied embedding) applies the "
                        "previous step's summed gradient, so no update waits for it; --no-tied-lag: each step's "
                        "own, at a wait per update and less memory (default: the plan's, else on)")
    g.add_argument("--in-flight-scale", type=int, default=None, metavar="K",
                   help="async/pipedream/2bw: every stage runs K x its depth + 1 forwards before its first backward "
                        "(1: FTPipe's and PipeDream's depth + 1; more keeps a plan whose GPUs hold many stages busy, "
                        "at the cost of memory and, under async and pipedream, staler weights; default: the plan's)")
    g.add_argument("--on-nonfinite", choices=("stop", "skip"), default=None,
                   help="a loss that is NaN or infinite: stop the run naming the step and stage, or skip that "
                        "step's update on every stage and go on (default: the plan's, else stop)")
    g = p.add_argument_group("optimizer (with --resume, an option not given keeps the checkpoint's value)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="default: the one the plan priced (adam unless compiled with another)")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3)")
    g.add_argument("--momentum", type=float, default=None, help="for --optimizer momentum, in [0, 1) (default 0.9)")
    g.add_argument("--weight-decay", type=float, default=None, help="default 0")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None, help="default constant")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default 0)")
    g.add_argument("--clip-grad-norm", type=clip_arg, default=None, metavar="X|none",
                   help="clip the global gradient norm (all stages together) to X > 0; none: do not clip "
                        "(default: the plan's, else none)")
    g = p.add_argument_group("data and devices")
    g.add_argument("--data", default=None, metavar="SPEC",
                   help="synthetic (default: random inputs of the right shapes), text (the Python standard "
                        "library's source as bytes: language models), text:DIR, or file.py:function")
    g.add_argument("--seed", type=int, default=None, help="data order and dropout seed (default 0)")
    g.add_argument("--no-dropout", action="store_true", default=None, help="train with dropout off")
    g.add_argument("--device", default="cpu", help="cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    g.add_argument("--replicas", type=int, default=None, metavar="R",
                   help="train R replicas of the pipeline on the ranks, each on its share of every step's R x M "
                        "micro-batches, gradients averaged across replicas (default: the ranks over the plan's "
                        "GPUs per pipeline, e.g. 4 ranks of a 2-GPU plan: 2 replicas)")
    g.add_argument("--rank-order", choices=ORDERS, default=None,
                   help="pipeline-major: a replica's ranks are consecutive (a pipeline on one host); replica-major: "
                        "one stage's replicas are consecutive (its all-reduce on one host) (default: the plan's)")
    g.add_argument("--measure-memory", action="store_true", default=None,
                   help="count every tensor each rank holds and log each rank's peak per step (CPU; slower)")
    g.add_argument("--transport", choices=("auto", "gloo", "nccl", "mpi"), default="auto",
                   help="auto: mpi under mpirun, nccl on cuda, else gloo")
    g.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="give up when nothing arrives for S seconds, naming the rank waited for (default 300)")
    g.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S, metavar="S",
                   help="report a rank whose process has stopped beating for S seconds (stopped, frozen, "
                        f"unreachable), however long --timeout is (default {HEARTBEAT_TIMEOUT_S:.0f})")
    g = p.add_argument_group("logs and checkpoints")
    g.add_argument("--log-dir", default=None, metavar="DIR",
                   help="where train.jsonl goes (default PACKAGE/runs/SCHEDULE); an earlier run's log is moved "
                        "aside to train.N.jsonl")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="write checkpoints here")
    g.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="checkpoint every N steps (each segment fills and drains the pipeline); 0: only at the "
                        "end (turns off the interval a resumed run takes from its checkpoint)")
    g.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                   help="after each checkpoint, delete the older step folders beyond the K newest (default, or "
                        "0: keep all; a resumed run takes its checkpoint's K)")
    g.add_argument("--resume", action="store_true", help="continue the run of the latest checkpoint in --checkpoint-dir")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="a fresh run into a --checkpoint-dir that holds checkpoints deletes them (else refused)")
    g.add_argument("--reset-optimizer", action="store_true",
                   help="with --resume: take the checkpoint's weights and step, but start the optimizer state "
                        "afresh (to change to an optimizer that cannot use the checkpoint's state)")
    g.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on the loss rank's stderr (auto: when it is a terminal)")
    # Freeze training: what `ftcompile run --freeze` asks each phase's ranks to measure.
    g = p.add_argument_group("freeze training (set by `ftcompile run --freeze`)")
    g.add_argument("--grad-norms-at", default=None, metavar="STEPS",
                   help="comma-separated steps at which to measure every layer's gradient norm")
    g.add_argument("--grad-norms-layers", default=None, metavar="PREFIXES",
                   help="comma-separated module paths of the layers whose gradient norms to measure")
    g.add_argument("--grad-norms-file", default=None, metavar="PATH",
                   help="each rank writes its sums of squared gradients per layer to PATH.rankN.json")
    g.add_argument("--autocache", default=None, metavar="FILE",
                   help="AutoCache: the phase's activation cache (folders, budget, what to read and write), a JSON "
                        "file written by the controller")


_VALUED = ("schedule", "micro_batches", "steps", "optimizer", "lr", "momentum", "weight_decay", "lr_schedule",
           "warmup_steps", "clip_grad_norm", "data", "seed", "device", "transport", "timeout", "heartbeat_timeout",
           "log_dir", "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "progress", "advance", "on_nonfinite", "replicas",
           "in_flight_scale",
           "rank_order", "parallel_pipelines", "elastic_alpha", "grad_norms_at", "grad_norms_layers", "grad_norms_file",
           "autocache")
#: Flags whose default is the plan's, so that ``--no-FLAG`` means something.
_NEGATABLE = ("recompute", "weight_prediction", "tied_lag")
_FLAGS = ("recompute", "weight_prediction", "tied_lag", "no_dropout", "resume", "overwrite_checkpoints", "reset_optimizer",
          "measure_memory")


def worker_argv(args) -> list[str]:
    """The command line that gives a rank the same options as ``args`` (options not given stay unset)."""
    out = [str(args.package)]
    for name in _VALUED:
        value = getattr(args, name, None)
        if value is not None:
            out += ["--" + name.replace("_", "-"), repr(value) if isinstance(value, float) else str(value)]
    for name in _FLAGS:
        value = getattr(args, name, None)
        if value:
            out.append("--" + name.replace("_", "-"))
        elif value is False and name in _NEGATABLE:       # --no-recompute: against the plan's default
            out.append("--no-" + name.replace("_", "-"))
    return out


def clip_arg(text: str) -> float:
    """``--clip-grad-norm``: a number, or ``none`` (0.0: no clipping, also against the plan's)."""
    if text.strip().lower() in ("none", "off"):
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None


def _finite(flag: str, value: float | None, *, low: float | None = None, low_open: bool = False,
            high_open: float | None = None, must: str = "") -> None:
    if value is None:
        return
    bad = not math.isfinite(value)
    if not bad and low is not None:
        bad = value <= low if low_open else value < low
    if not bad and high_open is not None:
        bad = value >= high_open
    if bad:
        raise OptionError(f"{flag} must be {must}, got {value!r}")


def check(args) -> list[str]:
    """Refuse option values that make no sense (OptionError); return warnings for pointless ones."""
    for flag, value in (("--steps", args.steps), ("--micro-batches", args.micro_batches)):
        if value is not None and value < 1:
            raise OptionError(f"{flag} must be at least 1, got {value}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise OptionError(f"--checkpoint-every must be 0 (only at the end) or more, got {args.checkpoint_every}")
    if getattr(args, "replicas", None) is not None and args.replicas < 1:
        raise OptionError(f"--replicas must be at least 1, got {args.replicas}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise OptionError(f"--warmup-steps must be 0 or more, got {args.warmup_steps}")
    _finite("--lr", args.lr, low=0.0, must="a finite learning rate >= 0 (e.g. 1e-3)")
    _finite("--momentum", args.momentum, low=0.0, high_open=1.0, must="in [0, 1) (e.g. 0.9)")
    _finite("--weight-decay", args.weight_decay, low=0.0, must="a finite number >= 0 (e.g. 0.01)")
    if args.clip_grad_norm != 0.0:      # 0.0 is `none`: no clipping, whatever the plan was priced for
        _finite("--clip-grad-norm", args.clip_grad_norm, low=0.0, low_open=True,
                must="the largest gradient norm, a finite number > 0, or none not to clip")
    _finite("--timeout", args.timeout, low=0.0, low_open=True, must="a positive number of seconds")
    _finite("--heartbeat-timeout", args.heartbeat_timeout, low=0.0, low_open=True,
            must="a positive number of seconds")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        raise OptionError("--checkpoint-every needs --checkpoint-dir")
    if getattr(args, "keep_checkpoints", None) is not None:
        if args.keep_checkpoints < 0:
            raise OptionError(f"--keep-checkpoints must be at least 1 (the newest), or 0 to keep all, got "
                              f"{args.keep_checkpoints}")
        if not args.checkpoint_dir:
            raise OptionError("--keep-checkpoints needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        raise OptionError("--resume needs --checkpoint-dir")
    if args.overwrite_checkpoints and not args.checkpoint_dir:
        raise OptionError("--overwrite-checkpoints needs --checkpoint-dir")
    if args.overwrite_checkpoints and args.resume:
        raise OptionError("--overwrite-checkpoints deletes the checkpoints --resume continues from; give one of them")
    if args.reset_optimizer and not args.resume:
        raise OptionError("--reset-optimizer needs --resume (a fresh run starts its optimizer afresh anyway)")
    from .avgpipe import check_options as _avgpipe_options

    warnings = _avgpipe_options(args)
    if args.lr == 0:
        warnings.append("--lr 0: no weight will change")
    if args.momentum is not None and args.optimizer not in (None, "momentum"):
        warnings.append(f"--momentum is ignored by --optimizer {args.optimizer} (it is for --optimizer momentum)")
    if args.weight_prediction and args.optimizer is not None and args.optimizer not in PREDICTS:
        warnings.append(f"--weight-prediction does nothing with --optimizer {args.optimizer}: weights are "
                        f"predicted from momentum or Adam's moments ({', '.join(PREDICTS)})")
    if args.weight_prediction and args.schedule not in (None, "async"):
        warnings.append(f"--weight-prediction does nothing under --schedule {args.schedule}: only async forwards "
                        "run on weights older than their backward's")
    if args.recompute and args.schedule == "async":
        warnings.append("--recompute is implied by --schedule async (every stage but the last recomputes)")
    k = getattr(args, "in_flight_scale", None)
    if k is not None and k < 1:
        raise OptionError(f"--in-flight-scale must be at least 1 (1: depth + 1 forwards before the first backward), got {k}")
    if k is not None and k > 1 and args.schedule is not None and args.schedule not in CONTINUOUS:
        warnings.append(f"--in-flight-scale does nothing under --schedule {args.schedule}: it stretches the warm-up "
                        f"of {', '.join(CONTINUOUS)}")
    if getattr(args, "tied_lag", None) is False and args.schedule in SYNCHRONOUS:
        warnings.append(f"--no-tied-lag does nothing under --schedule {args.schedule}: a schedule with a flush "
                        "sums tied gradients within the step anyway")
    if args.warmup_steps and args.steps is not None and args.warmup_steps >= args.steps:
        warnings.append(f"--warmup-steps {args.warmup_steps} >= --steps {args.steps}: the whole run is warm-up")
    if args.checkpoint_every and args.steps is not None and args.checkpoint_every >= args.steps:
        warnings.append(f"--checkpoint-every {args.checkpoint_every} >= --steps {args.steps}: only the final "
                        "checkpoint is written")
    return warnings


@dataclass
class Resolved:
    """Options with every default filled, the checkpoint to resume from, and what to tell the user."""

    args: argparse.Namespace
    checkpoint: Checkpoint | None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _fmt(v) -> str:
    return "off" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))


def replicas_for(manifest, world_size: int, replicas: int | None = None) -> int:
    """How many replicas of the pipeline ``world_size`` ranks train (``--replicas``, else the default).

    The default keeps the plan's pipeline: one rank per planned GPU, so ``world_size / num_gpus``
    replicas (the manifest's ``replicas`` when the run has the planned ``num_gpus x replicas``
    ranks); fewer ranks than planned GPUs make one replica whose ranks share the GPUs' stages.
    """
    N = max(manifest.num_gpus, 1)
    if world_size < 1:
        raise OptionError(f"--nproc must be at least 1, got {world_size}")
    if replicas is not None:
        if replicas < 1 or world_size % replicas:
            options = [r for r in range(1, world_size + 1) if world_size % r == 0 and world_size // r <= N]
            raise OptionError(f"--replicas {replicas} does not divide {world_size} ranks into pipelines; choose "
                              f"--replicas among {options}")
        if world_size // replicas > N:
            raise OptionError(f"--replicas {replicas} on {world_size} ranks makes pipelines of {world_size // replicas} "
                              f"ranks, but the plan has {N} GPU(s), so ranks beyond {N} per pipeline would hold no "
                              f"stage; give --replicas {-(-world_size // N)} or more (dividing {world_size})")
        return replicas
    if world_size <= N:
        return 1
    if world_size % N:
        raise OptionError(f"{world_size} ranks do not make whole pipelines of the plan's {N} GPU(s): give a multiple "
                          f"of {N} ranks ({N * (world_size // N)} makes {world_size // N} replicas), or --replicas R "
                          f"with R dividing {world_size} and at most {N} ranks per pipeline")
    return world_size // N


def resolve(args, manifest, *, restart_run_id: str | None = None, replicas: int = 1,
            check_data: bool = True) -> Resolved:
    """Fill the options' defaults, reconciled with the checkpoint of ``--resume`` (see the module docstring).

    ``restart_run_id``: when the elastic agent restarts the ranks of a run, a checkpoint of that
    run is resumed even without ``--resume``. ``replicas``: of this run; a resume into another
    number of replicas keeps the checkpoint's global batch (replicas x micro-batches) when
    ``--micro-batches`` is not given and the batch divides, so training goes on as it would have.
    ``check_data``: compare the data with the checkpoint's fingerprint (hashing a corpus is not
    free: only the process that prints the warning asks).
    """
    cli = args
    args = copy.copy(args)
    warnings = check(args)
    notes: list[str] = []
    ck = None
    from_checkpoint: set[str] = set()
    # The phases of a freeze run are packages of one model (frozen graphs record the base graph's hash).
    package = manifest.generator.get("base_graph_hash") or manifest.generator.get("graph_hash")
    if (not args.resume and restart_run_id and args.checkpoint_dir and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                                        "0") != "0"):
        found = latest(args.checkpoint_dir)
        if found is not None and found.run_id == restart_run_id:
            args.resume = True
            notes.append(f"restarted by the launcher: resuming from step {found.step}")
    if args.resume:
        ck = check_resumable(args.checkpoint_dir, package=package,
                             steps=args.steps if args.steps is not None else 2 ** 62)
        if ck.note:
            notes.append(ck.note)
        was = ck.meta.get("config") or {}
        changed = []
        for name in RECORDED:
            given = getattr(args, name, None)
            old = was.get(name)
            if given is None:
                if name in was:
                    setattr(args, name, old)
                    from_checkpoint.add(name)
            elif name in was and given != old and name != "steps":
                changed.append((name, old, given))
        if check_data and ck.meta.get("data_fingerprint") and args.data == was.get("data"):
            from .data import data_fingerprint

            now = data_fingerprint(args.data)
            if now is not None and now != ck.meta["data_fingerprint"]:
                warnings.append(f"the data of --data {args.data} changed since the checkpoint of step {ck.step} "
                                "(its files differ): the resumed run does not see the data an uninterrupted run "
                                "would")
        if args.log_dir is None and ck.meta.get("log_dir") and os.path.isdir(ck.meta["log_dir"]):
            # the run's train.jsonl goes on in one file, not split between two folders (a folder
            # that is gone, e.g. a checkpoint copied from another machine, leaves the default)
            args.log_dir = ck.meta["log_dir"]
            notes.append(f"logging into the resumed run's log folder {args.log_dir}")
        new_opt, old_opt = args.optimizer or DEFAULTS["optimizer"], was.get("optimizer")
        if old_opt and new_opt != old_opt:
            why = resume_change(old_opt, new_opt)
            if why and not args.reset_optimizer:
                raise CheckpointError(f"--resume --optimizer {new_opt}: {why}. Resume with --optimizer {old_opt}, or "
                                      "pass --reset-optimizer to keep the weights and start the optimizer state "
                                      "afresh")
        was_r = int(ck.meta.get("replicas") or 1)
        # a freeze run's phases may change the micro-batch size: the same samples per step is the same batch
        was_b, b = int(ck.meta.get("micro_batch_size") or manifest.micro_batch_size), manifest.micro_batch_size
        if was_b != b and cli.micro_batches is not None and was.get("micro_batches") and \
                was_r * int(was["micro_batches"]) * was_b == replicas * cli.micro_batches * b:
            changed = [c for c in changed if c[0] != "micro_batches"]
            notes.append(f"{was_r} x {was['micro_batches']} micro-batches of {was_b} -> {replicas} x "
                         f"{cli.micro_batches} of {b}: the same {replicas * cli.micro_batches * b} samples per step")
        elif was_r != replicas and cli.micro_batches is None and was.get("micro_batches"):
            total = was_r * int(was["micro_batches"])
            if total % replicas == 0:
                args.micro_batches = total // replicas
                notes.append(f"{was_r} -> {replicas} replicas: {args.micro_batches} micro-batches per replica keep "
                             f"the checkpoint's {total} micro-batches per step")
            else:
                warnings.append(f"the checkpoint's step of {was_r} x {was['micro_batches']} micro-batches does not "
                                f"split among {replicas} replicas: each takes {was['micro_batches']}, so a step "
                                "trains on another batch than before")
        elif was_r != replicas and cli.micro_batches is not None and was.get("micro_batches") and \
                was_r * int(was["micro_batches"]) != replicas * cli.micro_batches:
            total = was_r * int(was["micro_batches"])
            keep = f"; give --micro-batches {total // replicas} to keep it" if total % replicas == 0 else ""
            warnings.append(f"the checkpoint trained on {was_r} x {was['micro_batches']} micro-batches per step; "
                            f"{replicas} x {cli.micro_batches} is another batch{keep}")
        if args.steps is None:
            args.steps = int(was.get("steps") or ck.step)
        if args.steps == ck.step:
            raise NothingToDo(f"the run in {args.checkpoint_dir} is at step {ck.step} of {args.steps} already; give "
                              f"--steps N with N > {ck.step} to train further")
        what = f"resuming run {ck.run_id} from step {ck.step} ({ck.folder}) to step {args.steps}"
        if changed:
            what += "; changed: " + ", ".join(f"{n.replace('_', '-')} {_fmt(o)} -> {_fmt(g)}" for n, o, g in changed)
        notes.append(what)
        for name, old, given in changed:
            if name == "micro_batches" and was_r * old == replicas * given:
                continue    # the same global batch, shared among another number of replicas
            if name in ("micro_batches", "seed", "data"):
                warnings.append(f"--{name.replace('_', '-')} differs from the checkpoint's ({_fmt(old)}): the resumed "
                                "run skips the steps done in its own data order, so it does not see the data an "
                                "uninterrupted run would")
        if args.reset_optimizer:
            notes.append("--reset-optimizer: the optimizer state starts afresh")
    # A run trains as its plan was priced unless told otherwise (an option given, or the resumed
    # checkpoint's, wins): otherwise a plan made for recomputation, SGD or clipping would run
    # without them and hold memory, or wait, that its figures never counted.
    taken = []
    for name, planned in planned_settings(manifest).items():
        if getattr(args, name, None) is None and name not in from_checkpoint and planned is not None:
            setattr(args, name, planned)
            if planned != DEFAULTS.get(name):
                taken.append(f"{name.replace('_', '-')} " + ({True: "on", False: "off"}.get(planned, str(planned))
                                                              if isinstance(planned, bool) else str(planned)))
    if taken:
        notes.append("as the plan was priced: " + ", ".join(taken))
    for name, default in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    schedule = args.schedule or (manifest.schedule if manifest.schedule in SCHEDULES else "1f1b")
    args.schedule = schedule
    if args.micro_batches is None:
        args.micro_batches = manifest.micro_batches or 4
    # Pointless combinations of what was given with what the plan or the checkpoint decided.
    if cli.weight_prediction:
        if args.optimizer not in PREDICTS and cli.optimizer is None:
            warnings.append(f"--weight-prediction does nothing with --optimizer {args.optimizer}: weights are "
                            f"predicted from momentum or Adam's moments ({', '.join(PREDICTS)})")
        if schedule != "async" and cli.schedule is None:
            warnings.append(f"--weight-prediction does nothing under --schedule {schedule}: only async forwards "
                            "run on weights older than their backward's")
    if cli.recompute and schedule == "async" and cli.schedule is None:
        warnings.append("--recompute is implied by --schedule async (every stage but the last recomputes)")
    return Resolved(args, ck, notes, warnings)


def planned_settings(manifest) -> dict:
    """The run settings the package's plan was priced with, by option name (None: the default)."""
    return {"recompute": manifest.recompute, "optimizer": manifest.optimizer,
            "weight_prediction": manifest.weight_prediction, "clip_grad_norm": manifest.clip_grad_norm,
            "on_nonfinite": manifest.on_nonfinite, "tied_lag": manifest.tied_lag,
            "in_flight_scale": manifest.in_flight_scale}


def recorded_config(args) -> dict:
    """The settings a checkpoint records (``meta.json``'s ``config``)."""
    return {name: getattr(args, name) for name in RECORDED}


def new_run_id() -> str:
    """A run id that sorts by start time and never repeats: ``20240102-030405-1a2b3c``."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
