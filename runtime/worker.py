"""One rank of a training run: ``python -m ftcompile.runtime PACKAGE [options]``.

Started by ``ftcompile run --nproc N`` (which spawns the ranks on this host),
by ``torchrun --nproc-per-node N -m ftcompile.runtime PACKAGE`` or by
``mpirun -np N python -m ftcompile.runtime PACKAGE``; the rank and world size
come from the launcher's environment (:func:`~ftcompile.runtime.transport.detect_launcher`).

Each rank loads only its own stages' weights, builds the same data iterator
(every rank takes the graph inputs its stages read), trains in segments
between checkpoints, and the rank holding the loss writes ``train.jsonl`` and
the progress bar. On any failure a rank prints one line naming itself and its
stages and exits non-zero, so the launcher stops the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from .checkpoint import CheckpointError, commit, latest, load_shards, save_shards
from .engine import PipelineError, RankEngine, TrainConfig, stage_ranks
from .optim import LR_SCHEDULES, OPTIMIZERS
from .package import PackageError, load_package
from .schedules import SCHEDULES, ScheduleError
from .transport import TransportError, detect_launcher, make_transport


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The training options, shared by ``ftcompile run`` and ``python -m ftcompile.runtime``."""
    p.add_argument("package", metavar="PACKAGE", help="a package folder written by `ftcompile compile -o`")
    g = p.add_argument_group("schedule")
    g.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (default: the one the plan was compiled for)")
    g.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="micro-batches per step; one optimizer update per step (default: the plan's)")
    g.add_argument("--steps", type=int, default=10, metavar="K", help="optimizer steps to run (default 10)")
    g.add_argument("--recompute", action="store_true",
                   help="gpipe/1f1b/2bw/2gw: recompute activations in backward (async always recomputes)")
    g.add_argument("--weight-prediction", action="store_true",
                   help="async: forward with weights predicted to the backward's version (FTPipe §4.2; "
                        "momentum, adam, adamw)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    g.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    g.add_argument("--momentum", type=float, default=0.9, help="for --optimizer momentum (default 0.9)")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant")
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip the global gradient norm (all stages together) to X")
    g = p.add_argument_group("data and devices")
    g.add_argument("--data", default="synthetic", metavar="SPEC",
                   help="synthetic (random inputs of the right shapes), text (the Python standard library's "
                        "source as bytes: language models), text:DIR, or file.py:function")
    g.add_argument("--seed", type=int, default=0, help="data order and dropout seed (default 0)")
    g.add_argument("--no-dropout", action="store_true", help="train with dropout off")
    g.add_argument("--device", default="cpu", help="cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    g.add_argument("--transport", choices=("auto", "gloo", "nccl", "mpi"), default="auto",
                   help="auto: mpi under mpirun, nccl on cuda, else gloo")
    g.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="give up when nothing arrives for S seconds, naming the rank waited for (default 300)")
    g = p.add_argument_group("logs and checkpoints")
    g.add_argument("--log-dir", default=None, metavar="DIR",
                   help="where train.jsonl goes (default PACKAGE/runs/SCHEDULE)")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="write checkpoints here")
    g.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="checkpoint every N steps (each segment fills and drains the pipeline)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    g.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on the loss rank's stderr (auto: when it is a terminal)")


def worker_argv(args) -> list[str]:
    """The command line that gives a rank the same options as ``args`` (from :func:`add_train_arguments`)."""
    out = [str(args.package)]
    for flag, value in (("--schedule", args.schedule), ("--micro-batches", args.micro_batches),
                        ("--steps", args.steps), ("--optimizer", args.optimizer), ("--lr", args.lr),
                        ("--momentum", args.momentum), ("--weight-decay", args.weight_decay),
                        ("--lr-schedule", args.lr_schedule), ("--warmup-steps", args.warmup_steps),
                        ("--clip-grad-norm", args.clip_grad_norm), ("--data", args.data), ("--seed", args.seed),
                        ("--device", args.device), ("--transport", args.transport), ("--timeout", args.timeout),
                        ("--log-dir", args.log_dir), ("--checkpoint-dir", args.checkpoint_dir),
                        ("--checkpoint-every", args.checkpoint_every), ("--progress", args.progress)):
        if value is not None:
            out += [flag, repr(value) if isinstance(value, float) else str(value)]
    for flag, on in (("--recompute", args.recompute), ("--weight-prediction", args.weight_prediction),
                     ("--no-dropout", args.no_dropout), ("--resume", args.resume)):
        if on:
            out.append(flag)
    return out


def check_train_args(args) -> None:
    """Refuse training options that make no sense, before any rank starts (``ValueError``)."""
    for flag, value in (("--steps", args.steps), ("--micro-batches", args.micro_batches),
                        ("--checkpoint-every", args.checkpoint_every)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    _device(args.device, 0)


def config_from_args(args, manifest) -> TrainConfig:
    schedule = args.schedule or (manifest.schedule if manifest.schedule in SCHEDULES else "1f1b")
    M = args.micro_batches if args.micro_batches is not None else (manifest.micro_batches or 4)
    return TrainConfig(schedule=schedule, micro_batches=M, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                       momentum=args.momentum, weight_decay=args.weight_decay, lr_schedule=args.lr_schedule,
                       warmup_steps=args.warmup_steps, clip_grad_norm=args.clip_grad_norm,
                       recompute=args.recompute, weight_prediction=args.weight_prediction, seed=args.seed,
                       dropout=not args.no_dropout, timeout_s=args.timeout, total_steps=args.steps)


def _device(spec: str, local_rank: int) -> torch.device:
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda (each rank takes cuda:LOCAL_RANK) or cuda:N; got {spec!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError("--device cuda but torch sees no GPU; use --device cpu")
        if device.index is None:
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def run(args) -> int:
    launch = detect_launcher()
    rank = launch.rank
    check_train_args(args)
    package = load_package(args.package)
    m = package.manifest
    cfg = config_from_args(args, m)
    device = _device(args.device, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    transport = None
    if launch.world_size > 1:
        transport = make_transport(args.transport, launch, device=device, timeout_s=args.timeout)
        rank = transport.rank
    ranks = stage_ranks(m, launch.world_size)
    engine = RankEngine(package, cfg, rank=rank, world_size=launch.world_size, transport=transport,
                        device=device, ranks=ranks)
    start = 0
    if args.resume:
        found = latest(args.checkpoint_dir)
        if found is None:
            raise CheckpointError(f"--resume: no checkpoint in {args.checkpoint_dir} (no 'latest' file)")
        start, folder, meta = found
        if meta.get("package") != m.generator.get("graph_hash"):
            raise CheckpointError(f"{folder} was written by another package (graph {meta.get('package')}); "
                                  "resume with the package it was trained with")
        engine.load_state(load_shards(folder, sorted(engine.modules), device))
    from .data import load_dataset

    batches = iter(load_dataset(args.data, m, micro_batches=cfg.micro_batches, seed=args.seed))
    for _ in range(start):
        next(batches)
    log_dir = Path(args.log_dir or Path(args.package) / "runs" / cfg.schedule)
    is_logger = rank == engine.log_rank
    log = None
    bar = None
    if is_logger:
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / "train.jsonl", "a" if args.resume else "w", encoding="utf-8")
        show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
        if show:
            from tqdm import tqdm
            bar = tqdm(total=args.steps, initial=start, desc=f"{cfg.schedule} x{launch.world_size}", unit="step",
                       file=sys.stderr)

    def on_step(rec: dict) -> None:
        rec = {"schedule": cfg.schedule, "micro_batches": cfg.micro_batches, "world_size": launch.world_size,
               **rec}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if bar is not None:
            bar.update(1)
            if rec.get("loss") is not None:
                bar.set_postfix(loss=f"{rec['loss']:.4f}", sps=f"{rec.get('samples_per_s') or 0:.1f}")

    t0 = time.perf_counter()
    every = args.checkpoint_every or args.steps
    step = start
    engine.start()
    while step < args.steps:
        n = min(every, args.steps - step)
        engine.run(batches, n, on_step=on_step if is_logger else None, step_offset=step)
        step += n
        if args.checkpoint_dir and (args.checkpoint_every or step == args.steps):
            save_shards(args.checkpoint_dir, step, rank, engine.state())
            if is_logger:
                commit(args.checkpoint_dir, step, launch.world_size,
                       {"package": m.generator.get("graph_hash"), "schedule": cfg.schedule,
                        "micro_batches": cfg.micro_batches, "world_size": launch.world_size},
                       timeout_s=args.timeout)
    engine.finish()
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if is_logger:
        summary = {"summary": True, "steps": args.steps - start, "seconds": seconds, "schedule": cfg.schedule,
                   "samples_per_s": (args.steps - start) * cfg.micro_batches * m.micro_batch_size / seconds}
        log.write(json.dumps(summary) + "\n")
        log.close()
        print(f"ftcompile run: {args.steps - start} steps of {cfg.schedule} on {launch.world_size} rank(s) in "
              f"{seconds:.1f} s ({summary['samples_per_s']:.1f} samples/s); log: {log_dir / 'train.jsonl'}",
              file=sys.stderr)
    if transport is not None:
        transport.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftcompile.runtime",
                                description="Train a generated package; one process per rank (see `ftcompile run`).")
    add_train_arguments(p)
    args = p.parse_args(argv)
    launch = detect_launcher()
    try:
        return run(args)
    except (PipelineError, PackageError, CheckpointError, ScheduleError, TransportError, ValueError,
            OSError) as exc:
        msg = str(exc)
        if not msg.startswith("rank "):
            msg = f"rank {launch.rank}: {msg}"
        print(f"ftcompile run: error: {msg}", file=sys.stderr, flush=True)
        # Receiver threads may sit in a blocking receive from a dead peer: leave at once.
        os._exit(1)
    except KeyboardInterrupt:
        os._exit(130)
