"""The commands that work on a generated package: ``verify`` (and, with the runtime, ``run``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import cli as base


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "verify", help="check a generated package against the original model", formatter_class=base._Formatter,
        description=(
            "Run the package in OUT (from `ftcompile compile`) stage after stage on one device,\n"
            "each stage cut from the others as in a real pipeline, and the original model (rebuilt\n"
            "by name, same weights, same inputs, same dropout masks) beside it. Compares every\n"
            "model output, the loss, every parameter's gradient (copies of a tied weight summed)\n"
            "and each stage's recomputed forward with its first forward. The error of a tensor is\n"
            "max|package - model| / max|model|; above the tolerance (float32: 1e-5) the command\n"
            "prints the differences and exits with status 1.\n\n"
            "The package's files are checked against its SHA256SUMS first; a damaged package\n"
            "is refused with a message naming the file."),
        epilog=(
            "examples:\n"
            "  ftcompile compile gpt2-tiny --gpus 2 --cluster 2xcpu -o out/gpt2 && ftcompile verify out/gpt2\n"
            "  ftcompile verify out/t5 --device cuda --json"))
    base._add_common(p, top=False)
    p.add_argument("package", metavar="OUT", help="a package folder written by `ftcompile compile -o OUT`")
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="cpu, cuda or cuda:N; auto: cuda when present, else cpu (default: auto)")
    p.add_argument("--tolerance", type=float, metavar="REL",
                   help="largest relative error accepted (default: 1e-5 for float32, 1e-2 for float16)")
    p.add_argument("--seed", type=int, default=0, help="the micro-batch seed both sides draw dropout masks from")
    p.add_argument("--no-dropout", dest="dropout", action="store_false",
                   help="turn dropout off on both sides instead of drawing the same masks")
    p.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="skip checking that each stage's recomputation repeats its forward")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="do not check SHA256SUMS (compare a deliberately edited package numerically)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_verify)

    from .runtime.worker import add_train_arguments

    p = sub.add_parser(
        "run", help="train a generated package across processes", formatter_class=base._Formatter,
        description=(
            "Train the package in PACKAGE (from `ftcompile compile -o`) with one process per rank,\n"
            "each hosting every stage the plan gives its GPU (GPU g of G goes to rank g*N//G, so\n"
            "fewer ranks than planned GPUs share them out). Stages run as soon as their inputs\n"
            "arrive from any stage (dataflow); outputs go straight to every consumer.\n\n"
            "Schedules: gpipe and 1f1b (synchronous: the same weights as single-process training with\n"
            "gradient accumulation), async (FTPipe: no flush, forward without activations, backward\n"
            "recomputes with the newest weights, the last stage does not recompute), pipedream\n"
            "(weight stashing), 2bw (double-buffered weights, one step of delay) and 2gw (WPipe: the\n"
            "upstream half of the stages, G0, one step delayed and double-buffered, G1 not).\n\n"
            "--nproc N spawns the ranks on this host. N a multiple of the plan's P GPUs trains N/P\n"
            "replicas of the pipeline (data x pipeline parallelism: each replica takes its share of\n"
            "every step's batch, gradients averaged per stage; --replicas R, --rank-order). On several\n"
            "hosts start the ranks through torchrun (`torchrun --nnodes 2 --nproc-per-node N\n"
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT -m ftcompile.runtime PACKAGE ...` on each)\n"
            "or mpirun (`mpirun -np N python -m ftcompile.runtime PACKAGE ...`).\n\n"
            "The rank holding the loss writes LOG_DIR/train.jsonl: per step the loss, samples/s,\n"
            "learning rate, each stage's forward/backward/recompute/update seconds, and each rank's\n"
            "waiting time and peak memory.\n\n"
            "Options are checked before any rank starts. A rank that fails, dies or stops responding\n"
            "stops the run, named with its signal; SIGTERM, Ctrl-C or kill -9 of this command stop\n"
            "every rank. Exit status: 0 done, 2 refused, 1 failed, 128+N a signal N."),
        epilog=(
            "examples:\n"
            "  ftcompile run out/gpt2 --nproc 2 --schedule 1f1b --steps 20 --data text\n"
            "  ftcompile run out/gpt2 --nproc 2 --schedule async --micro-batches 4 --optimizer momentum\n"
            "  ftcompile run out/gpt2 --nproc 2 --steps 100 --checkpoint-dir ckpt --checkpoint-every 5\n"
            "  ftcompile run out/gpt2 --nproc 2 --checkpoint-dir ckpt --resume     # after a crash\n"
            "  ftcompile run out/gpt2 --nproc 4 --micro-batches 2                  # 2 replicas x 2 GPUs"))
    base._add_common(p, top=False)
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks to start on this host (default: the plan's GPU count)")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="memory of each GPU this run uses, e.g. 80GB, when it differs from the cluster the plan "
                        "was compiled for: a run whose settings differ from the plan's is priced against it")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart every rank up to K times after a failure; with --checkpoint-dir the restarted "
                        "ranks resume from the run's latest checkpoint (default 0)")
    p.add_argument("--freeze", default=None, metavar="SPEC",
                   help="elastic freeze training (PipeTransformer): alpha=1/3,every=K freezes layers by Eq. 1 "
                        "every K steps, re-planning P and R as they freeze; at=STEP:LAYERS[@PxR]+... is a manual "
                        "schedule; add cache=auto|on|off, cache_mb=N, spill_mb=N for AutoCache (the frozen "
                        "layers' output cached per sample); see README 'Freeze training'")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "evaluate", help="the loss of a checkpoint's model on held-out data", formatter_class=base._Formatter,
        description=(
            "Load the weights of CHECKPOINT (a --checkpoint-dir folder: its latest step; or one of\n"
            "its step folders) into every stage of PACKAGE, run the stages one after another in one\n"
            "process in eval mode (dropout off, no gradients, no buffer updates) over --batches\n"
            "batches of --data, and print the model's own loss averaged over the micro-batches.\n"
            "Under AvgPipe the checkpoint holds the reference model (the average of the parallel\n"
            "pipelines), the one this evaluates. Give data the run did not train on (e.g. --data\n"
            "text:DIR with another folder); every evaluation with the same --data, --batches and\n"
            "--seed sees the same samples, so checkpoints compare."),
        epilog=(
            "examples:\n"
            "  ftcompile evaluate out/gpt2 runs/ckpt --data text:heldout/ --batches 16\n"
            "  ftcompile evaluate out/gpt2 runs/ckpt/step-00000100 --data text:heldout/ --json"))
    base._add_common(p, top=False)
    p.add_argument("package", metavar="PACKAGE", help="a package folder written by `ftcompile compile -o`")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a --checkpoint-dir folder or one of its step folders")
    p.add_argument("--data", default="synthetic", metavar="SPEC",
                   help="synthetic, text, text:DIR or FILE.py:function, as for `ftcompile run` (default: synthetic)")
    p.add_argument("--batches", type=base._positive_int, default=8,
                   metavar="N", help="batches to evaluate (default 8)")
    p.add_argument("--micro-batches", type=base._positive_int, default=None, metavar="M",
                   help="micro-batches per batch (default: the package's)")
    p.add_argument("--seed", type=int, default=0, help="the data order's seed (default 0)")
    p.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_evaluate)
    add_export_parser(sub)


def cmd_evaluate(args: argparse.Namespace) -> int:
    import itertools
    import json
    from pathlib import Path

    from .runtime import load_package
    from .runtime.data import load_dataset
    from .runtime.evaluation import evaluate_checkpoint, open_checkpoint

    if not Path(args.package).is_dir():
        raise base.UsageError(f"no package folder at {args.package}; make one with `ftcompile compile MODEL -o DIR`")
    device = _device(args.device)
    package = load_package(args.package)
    ck = open_checkpoint(args.checkpoint)          # refused clearly before any data is read
    M = args.micro_batches or package.manifest.micro_batches
    batches = itertools.islice(load_dataset(args.data, package.manifest, micro_batches=M, seed=args.seed),
                               args.batches)
    result = evaluate_checkpoint(package, ck, batches, micro_batches=M, device=device)
    out = {"package": str(args.package), "checkpoint": str(ck.folder), "step": result.step, "loss": result.loss,
           "micro_batches": result.micro_batches, "samples": result.samples, "data": args.data, "seed": args.seed}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"step {result.step}: held-out loss {result.loss:.6f} over {result.samples} samples "
              f"({result.micro_batches} micro-batches of --data {args.data}, seed {args.seed})")
    return 0


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="a checkpoint's weights as the original model's, for from_pretrained or load_state_dict",
        formatter_class=base._Formatter,
        description=(
            "Write the weights of CHECKPOINT (a --checkpoint-dir folder: its latest step; or one of\n"
            "its step folders; under AvgPipe the reference model) into the new folder -o as one\n"
            "model.safetensors keyed as the original model names its parameters and buffers\n"
            "(model.state_dict()), without optimizer state. A model compiled with --pretrained DIR\n"
            "gets DIR's config.json beside it, so transformers' from_pretrained(OUT) loads the\n"
            "trained model. A tensor the model ties under several names is written once, under the\n"
            "first, as save_pretrained does."),
        epilog=(
            "examples:\n"
            "  ftcompile export out/llama runs/ckpt -o llama-finetuned\n"
            "  python -c \"import transformers; transformers.AutoModelForCausalLM.from_pretrained('llama-finetuned')\"\n"
            "  model.load_state_dict(safetensors.torch.load_file('OUT/model.safetensors'), strict=False)"))
    base._add_common(p, top=False)
    p.add_argument("package", metavar="PACKAGE", help="the package folder the checkpoint was trained with")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a --checkpoint-dir folder or one of its step folders")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="a new folder to write (never overwritten)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from .runtime import load_package
    from .runtime.checkpoint import human_bytes
    from .runtime.evaluation import open_checkpoint
    from .runtime.export import check_new_folder, model_state, write_weights

    if not Path(args.package).is_dir():
        raise base.UsageError(f"no package folder at {args.package}; give the one the checkpoint was trained with")
    check_new_folder(args.output)          # before any checkpoint is read
    package = load_package(args.package)
    ck = open_checkpoint(args.checkpoint)
    state = model_state(package, ck)
    pretrained = ((package.manifest.model or {}).get("options") or {}).get("pretrained")
    if pretrained is not None and not Path(pretrained).is_dir():
        print(f"ftcompile export: warning: the package was compiled from {pretrained}, which no longer exists: "
              "no config.json is written beside the weights", file=sys.stderr)
        pretrained = None
    files = write_weights(state, args.output, config_from=pretrained,
                          metadata={"ftcompile_step": str(ck.step), "ftcompile_checkpoint": str(ck.folder)})
    aliases = sum(len(s.aliases) for s in package.manifest.params.values())
    size = sum(f.stat().st_size for f in files if f.is_file())
    print(f"ftcompile export: step {ck.step}: {len(state)} tensors ({human_bytes(size)}) in {args.output}: "
          f"{', '.join(f.name for f in files)}" + (f"; {aliases} tied name(s) share a tensor written once" if aliases
                                                   else ""), file=sys.stderr)
    return 0


def _device(text: str) -> str:
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = base._parse_device(text)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise base.UsageError(f"--device {text}: CUDA is not available on this machine")
    return str(dev)


def cmd_verify(args: argparse.Namespace) -> int:
    import math

    from .verify import verify_package

    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise base.UsageError(f"--tolerance {args.tolerance!r} makes no sense: give the largest relative error to "
                              "accept, a number >= 0 (default 1e-5 for float32, 1e-2 for float16)")
    ui = base._Ui(args)
    device = _device(args.device)
    phases = ["load package", "rebuild the model", "run the model", "run the package", "recompute every stage"]
    with base._stdout_for(args), ui.phases(f"verify {args.package}", phases) as note:
        report = verify_package(args.package, device=device, tolerance=args.tolerance, dropout=args.dropout,
                                recompute=args.recompute, checksums=args.checksums, seed=args.seed,
                                progress=note)
    if args.json:
        base._emit_json(report.to_json())
        return 0 if report.ok else 1
    counts = ", ".join(f"{n} {k}{'s' if n != 1 and not k.endswith('s') else ''}" for k, n in report.compared.items())
    print(f"verified {report.package} ({report.model}, {report.stages} stages) against the model on "
          f"{report.device}, {report.dtype}, dropout {'on (same masks)' if report.dropout else 'off'}:")
    print(f"  compared {counts}; tolerance {report.tolerance:g} (max |package - model| / max |model|)")
    for note_text in report.notes:
        print(f"  note: {note_text}")
    rows = [d.row() for d in (report.failures[:20] if report.failures else report.worst)]
    if rows:
        title = "differences above the tolerance" if report.failures else "largest differences"
        print(f"\n{title}:")
        print(base.format_table(["kind", "name", "error", "max abs", "shape", ""], rows, right=(2, 3)))
    if report.ok:
        print(f"\nOK: the package computes what the model computes ({report.seconds:.1f} s)")
        return 0
    print(f"\nFAILED: {len(report.failures)} tensor(s) differ by more than {report.tolerance:g}", file=sys.stderr)
    return 1


def _check_weights(package) -> None:
    """Every stage's weights against SHA256SUMS, before any rank starts (a rank checks only its own)."""
    from .runtime.package import _check_file

    for s in package.manifest.stages:
        if s.weights and package.verify:
            _check_file(package.path, s.weights, package.checksums[s.weights])


def _usable_folder(path: str, option: str) -> None:
    """Refuse, before any rank starts, a folder the run could not write into: a file, or a path that
    cannot be created or written. Nothing is created here (the ranks create it), so a run refused by
    a later check leaves no empty folder behind."""
    p = Path(path).absolute()
    if p.is_symlink() and not p.exists():
        raise base.UsageError(f"{option} {path} is a symbolic link to nothing ({os.readlink(p)}); give a folder")
    if p.exists() and not p.is_dir():
        raise base.UsageError(f"{option} {path} is a file, not a folder; give a folder (it is created if missing)")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise base.UsageError(f"{option} {path} cannot be created: Not a directory ({existing}); give a folder "
                              "this user can create")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise base.UsageError(f"{option} {path} " + ("is not writable by this user; give a folder it can write into"
                                                      if existing == p else
                                                      f"cannot be created: {existing} is not writable by this user; "
                                                      "give a folder this user can create"))


def _preflight(args: argparse.Namespace):
    """Everything that can refuse a run, checked before any rank starts; returns (package, resolved, nproc)."""
    from .runtime import checkpoint as ckpt
    from .runtime import load_package
    from .runtime.lock import check_free
    from .runtime.options import replicas_for, resolve
    from .runtime.worker import check_train_args

    ui = base._Ui(args)
    try:
        check_train_args(args)
    except ValueError as exc:
        raise base.UsageError(str(exc)) from None
    if args.nproc is not None and args.nproc < 1:
        raise base.UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise base.UsageError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    package = load_package(args.package)    # a damaged package: code and plan here, weights below
    m = package.manifest
    from .avgpipe import launch_settings
    from .runtime.avgpipe import as_replicas

    try:   # avgpipe: 'auto' from the plan's tuning; its N parallel pipelines are the run's N replicas
        parallel = launch_settings(args, package)
        as_replicas(args, args.schedule or m.schedule)
    except ValueError as exc:
        raise base.UsageError(str(exc)) from None
    default_replicas = parallel if (args.schedule or m.schedule) == "avgpipe" else max(m.replicas, 1)
    nproc = args.nproc if args.nproc is not None else m.num_gpus * default_replicas
    if (args.schedule or m.schedule) == "avgpipe" and nproc % parallel:
        raise base.UsageError(f"--nproc {nproc} does not split into {parallel} parallel pipelines; give a multiple "
                              f"of {parallel} (e.g. --nproc {parallel * m.num_gpus})")
    if nproc > m.num_gpus and args.replicas is None and nproc % m.num_gpus:
        raise base.UsageError(f"--nproc {nproc}: the plan has {m.num_gpus} GPU(s) per pipeline, so {nproc} ranks "
                              f"make no whole number of pipelines; give --nproc {m.num_gpus} or fewer (several "
                              f"GPUs' stages then share a rank), a multiple of {m.num_gpus} (one replica of the "
                              "pipeline per multiple), or --replicas R")
    try:
        replicas = replicas_for(m, nproc, args.replicas)
    except ValueError as exc:
        raise base.UsageError(str(exc)) from None
    res = resolve(args, m, replicas=replicas)
    for w in res.warnings:
        print(f"{base.PROG}: warning: {w}", file=sys.stderr)
    for n in res.notes:
        ui.note(n)
    log_dir = res.args.log_dir or str(package.path / "runs" / res.args.schedule)
    _usable_folder(log_dir, "--log-dir")
    check_free(log_dir, what="logs")
    if args.checkpoint_dir:
        _usable_folder(args.checkpoint_dir, "--checkpoint-dir")
        check_free(args.checkpoint_dir, what="checkpoints")
        if res.checkpoint is None:
            ckpt.check_fresh(args.checkpoint_dir, overwrite=args.overwrite_checkpoints)
    from .runtime.data import load_dataset
    from .runtime.engine import programs
    from .runtime.worker import config_from_args

    programs(m, config_from_args(res.args, m), 1)      # ScheduleError: e.g. 2bw with too few micro-batches
    _check_planned(package, res.args, ui, args, res.checkpoint,
                   ranks=(nproc, replicas, args.rank_order or m.rank_order))
    step_micro_batches = replicas * res.args.micro_batches      # every replica's share of a step, as the ranks draw
    _check_first_batch(load_dataset(res.args.data, m, micro_batches=step_micro_batches, seed=res.args.seed),
                       res.args, m, step_micro_batches)
    _check_weights(package)
    if replicas > 1:
        ui.note(f"{nproc} ranks: {replicas} replicas of a {nproc // replicas}-rank pipeline, "
                f"{res.args.rank_order or m.rank_order}")
    return package, res, (nproc, replicas)


def _check_first_batch(batches, args, manifest, micro_batches: int) -> None:
    """A user's data function: draw its first batch here, so that a function yielding nothing, or a
    first batch of the wrong shape or with a token id beyond the model, is refused before any rank
    starts (each rank calls the function again; the built-in sources are checked as they are built).
    A function failing here by itself (one reading RANK, or wanting a GPU) is only warned about."""
    from .runtime.data import DataError, check_index_ranges, is_user_data, split_micro_batches

    if not is_user_data(args.data):
        return
    try:
        first = next(iter(batches))
    except StopIteration:
        raise DataError(f"dataset function {args.data} yielded no batches; the run needs {args.steps or 'its'} "
                        "step(s), one batch each") from None
    except DataError:
        raise                    # the batch does not fit the model (a missing input, another shape)
    except Exception as exc:     # noqa: BLE001 - the function may need what only a rank has (RANK, a GPU)
        print(f"{base.PROG}: warning: could not draw the first batch of {args.data} in the launcher "
              f"({type(exc).__name__}: {exc}); the ranks check their own", file=sys.stderr)
        return
    check_index_ranges(split_micro_batches(first, manifest, micro_batches), manifest, f"{args.data}: batch 0")


def _check_planned(package, args, ui, cli=None, checkpoint=None, ranks=None) -> None:
    """Price the plan again when the run's settings are not those it was planned with: a note with
    the new figures, or, when the plan no longer fits its GPUs, a refusal on ``cuda`` (a warning
    on the CPU, where the plan's GPUs are not the ones used). ``ranks``: the job's
    ``(nproc, replicas, rank order)``; None: the plan's own."""
    from .reprice import LABELS, SOURCES, of_run, planned, reprice
    from .cluster import parse_size
    from .units import format_bytes

    gpu_memory = None
    if getattr(cli, "gpu_memory", None):
        try:
            gpu_memory = parse_size(cli.gpu_memory)
        except ValueError as exc:
            raise base.UsageError(f"--gpu-memory: {exc}") from None

    if args.schedule == "avgpipe":
        return      # N parallel models per GPU: priced by the AvgPipe tuning (ftcompile.avgpipe), not here
    try:
        plan_settings = planned(package.manifest)
        if ranks is None:
            run = of_run(args, replicas=plan_settings.replicas, rank_order=plan_settings.rank_order)
        else:
            nproc, replicas, order = ranks
            run = of_run(args, replicas=replicas, rank_order=order, pipeline_ranks=nproc // replicas)
        r = reprice(package.path, plan_settings, run, gpu_memory=gpu_memory)
    except Exception as exc:  # noqa: BLE001 - advisory: a package that trains must not be refused for it
        print(f"{base.PROG}: warning: the plan could not be priced for this run's settings "
              f"({type(exc).__name__}: {exc}); its figures are for the settings it was compiled with",
              file=sys.stderr)
        return
    if r is None:
        return
    was = ((checkpoint.meta.get("config") or {}) if checkpoint is not None else {})

    def source(name: str) -> str:
        opts = SOURCES.get(name, (name,))
        if cli is not None and any(getattr(cli, o, None) is not None for o in opts):
            return ""
        return ", the checkpoint's" if any(o in was for o in opts) else ""

    what = ", ".join(f"{LABELS.get(name, name)} {_setting(old)} -> {_setting(new)}{source(name)}"
                     for name, old, new in r.changed)
    if r.fits:
        was = f" (planned: {r.planned_period_ms:.3f})" if r.planned_period_ms else ""
        ui.note(f"this run is not the one the plan was priced for ({what}); priced again for it: "
                f"{r.period_ms:.3f} ms per micro-batch simulated{was}; busiest GPU's simulated peak "
                f"{format_bytes(max(r.gpu_peak))} (reserve and buffers included) of its "
                f"{format_bytes(r.gpu_memory)}")
        return
    msg = (f"the plan does not fit this run's settings ({what}): {r.reason}. Run with the plan's settings, "
           "or compile a plan for these (or, if this run's GPUs have more memory than the plan's, "
           "say so with --gpu-memory SIZE) "
           "(`ftcompile compile` takes --schedule, --micro-batches, --recompute, --optimizer, "
           "--weight-prediction, --clip-grad-norm, --on-nonfinite, and --gpus, --replicas and --rank-order "
           "for the ranks)")
    if str(args.device).startswith("cuda"):
        raise base.UsageError(msg)
    print(f"{base.PROG}: warning: {msg}; on the CPU the run goes on", file=sys.stderr)


def _setting(v) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def cmd_run(args: argparse.Namespace) -> int:
    from .runtime.launch import spawn
    from .runtime.layout import RankLayout
    from .runtime.worker import describe_rank
    from .runtime.options import NothingToDo, new_run_id, worker_argv

    if getattr(args, "freeze", None):
        from .freeze import FreezeError
        from .freeze_run import parse_freeze, run_freeze

        try:
            return run_freeze(args, parse_freeze(args.freeze))
        except FreezeError as exc:
            raise base.UsageError(str(exc)) from None
    try:
        package, res, (nproc, replicas) = _preflight(args)
    except NothingToDo as exc:
        print(f"{base.PROG} run: {exc}", file=sys.stderr)
        return 0
    layout = RankLayout(nproc, replicas, 0, args.rank_order or package.manifest.rank_order)

    def describe(r: int) -> str:
        return describe_rank(package.manifest, layout, r)

    worker = worker_argv(args)
    if getattr(args, "quiet", False) and args.progress == "auto":
        worker[worker.index("--progress") + 1] = "off"
    return spawn(worker, nproc, run_id=new_run_id(), describe=describe, max_restarts=args.max_restarts,
                 debug=bool(getattr(args, "debug", False)))
