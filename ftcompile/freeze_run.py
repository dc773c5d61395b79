"""``ftcompile run PKG --freeze ...``: the controller of elastic freeze training.

The runtime cannot plan (it never imports the compiler), so a freeze run is a sequence of
*phases*, each an ordinary ``ftcompile run`` of one package on ``P x R`` ranks, and this
controller, on the compiler side, stands between them:

1. the phase trains up to the next freeze check and checkpoints at that step boundary (weights
   and optimizer state by parameter name), its ranks measuring every layer's gradient norm on
   the check's last step (:class:`ftcompile.runtime.freeze.GradNorms`);
2. the controller adds the ranks' norms up and applies Eq. 1 (or the manual schedule), and logs
   the decision with the norms behind it in ``freeze.jsonl`` beside ``train.jsonl``;
3. when more layers freeze, it re-plans (:func:`ftcompile.freeze.plan_phase`: the frozen graph
   re-profiled and re-partitioned, ``P`` halved while it fits and gains, ``R = G / P``
   replicas, ``M = global / R``) and writes the next phase's package;
4. the next phase's ranks start with the new layout and resume from the checkpoint by name:
   no step is lost or repeated, and the data stream continues where it was (every step draws
   the same global batch of ``R x M`` micro-batches, split among the replicas).

Each transition's cost (planning, plus the launch's start-up and checkpoint load: its wall time
less its training time) is measured and logged, and counts in the run's samples/s.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from .freeze import FreezeError, find_layers, frozen_layers, parse_alpha, plan_phase, write_phase_package
from .runtime.atomic import atomic_write_text


@dataclass
class FreezeSpec:
    """What ``--freeze`` asked for: Eq. 1 (``alpha``, ``every``) or a manual schedule (``at``)."""

    alpha: float | None = None
    every: int | None = None
    at: list[tuple[int, int, int | None]] = field(default_factory=list)    # (step, frozen layers, P or None)
    layers: list[str] = field(default_factory=list)
    strategy: str = "auto"
    cluster: str | None = None

    @property
    def manual(self) -> bool:
        return bool(self.at)


USAGE = ("give --freeze alpha=1/3,every=K (Eq. 1 every K steps) or --freeze at=STEP:LAYERS[@PxR]+... "
         "(freeze LAYERS layers at STEP, optionally on P-GPU pipelines x R replicas), with optional "
         "layers=CLASS+CLASS (block classes or module path prefixes), strategy=NAME, cluster=NAME")


def parse_freeze(text: str) -> FreezeSpec:
    """``alpha=1/3,every=50`` or ``at=20:1@2x2+40:2`` (plus ``layers=``, ``strategy=``, ``cluster=``)."""
    spec = FreezeSpec()
    for part in [p for p in text.split(",") if p.strip()]:
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise FreezeError(f"--freeze {text!r}: {part!r} is not KEY=VALUE; {USAGE}")
        if key == "alpha":
            spec.alpha = parse_alpha(value)
        elif key == "every":
            if not value.isdigit() or int(value) < 1:
                raise FreezeError(f"--freeze every={value}: give a positive number of steps")
            spec.every = int(value)
        elif key == "at":
            for item in value.split("+"):
                what, _, layout = item.partition("@")
                step, colon, n = what.partition(":")
                if not (colon and step.strip().isdigit() and n.strip().isdigit()):
                    raise FreezeError(f"--freeze at={value}: {item!r} is not STEP:LAYERS[@PxR]; {USAGE}")
                P = None
                if layout:
                    p, x, r = layout.partition("x")
                    if not (x and p.isdigit() and r.isdigit()):
                        raise FreezeError(f"--freeze at={value}: layout {layout!r} is not PxR (e.g. 2x2)")
                    P = int(p)
                spec.at.append((int(step), int(n), P))
            spec.at.sort()
            steps = [s for s, _, _ in spec.at]
            counts = [n for _, n, _ in spec.at]
            if len(set(steps)) != len(steps) or counts != sorted(counts) or min(steps) < 1:
                raise FreezeError(f"--freeze at={value}: steps must be distinct and at least 1, and frozen layer "
                                  "counts must not decrease (a frozen layer stays frozen)")
        elif key == "layers":
            spec.layers = [x for x in value.split("+") if x]
        elif key == "strategy":
            spec.strategy = value
        elif key == "cluster":
            spec.cluster = value
        else:
            raise FreezeError(f"--freeze: unknown key {key!r}; {USAGE}")
    if spec.manual and (spec.alpha is not None or spec.every is not None):
        raise FreezeError(f"--freeze: give either at= (a manual schedule) or alpha= and every=, not both; {USAGE}")
    if not spec.manual and (spec.alpha is None or spec.every is None):
        raise FreezeError(f"--freeze {text!r}: Eq. 1 needs both alpha= and every=; {USAGE}")
    return spec


def _trace_package_model(m):
    """The package's model rebuilt and traced as it was compiled (its graph hash must match)."""
    from .codegen import rebuild_model
    from .trace import trace

    built = rebuild_model(m.model | {"model": m.model["name"]})
    graph = trace(built.model, built.args, built.kwargs, basic_blocks=tuple(m.model.get("basic_blocks") or ()),
                  source={"model": built.name, "options": asdict(built.options)})
    want = m.generator.get("graph_hash")
    if want and graph.content_hash() != want:
        raise FreezeError(f"the package's model {m.model['name']} traces to graph {graph.content_hash()}, the "
                          f"package was compiled from {want}; recompile the package with this ftcompile before "
                          "freeze training it")
    return built, graph


def _phase_seconds(log: Path, first: int, end: int) -> tuple[float, int]:
    """Training seconds and steps of steps [first, end) in ``train.jsonl`` (the log rank's records)."""
    total, steps = 0.0, 0
    if not log.exists():
        return 0.0, 0
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in rec and first <= int(rec["step"]) < end and rec.get("seconds"):
            total += float(rec["seconds"])
            steps += 1
    return total, steps


def run_freeze(args, spec: FreezeSpec) -> int:
    """Train ``args.package`` through its freeze phases (see the module docstring); returns the exit status."""
    from .cluster import ClusterSpec, load_cluster
    from .runtime import load_package
    from .runtime.freeze import read_norms
    from .runtime.launch import spawn
    from .runtime.options import new_run_id, worker_argv

    pkg0 = load_package(args.package)
    m0 = pkg0.manifest
    if (m0.model or {}).get("freeze"):
        raise FreezeError(f"{args.package} is a freeze phase's package; give the package of the whole model")
    P = m0.num_gpus
    G = args.nproc if args.nproc is not None else P * max(m0.replicas, 1)
    if G < P or G % P:
        raise FreezeError(f"--freeze starts from the package's {P}-GPU pipeline: give --nproc a multiple of {P} "
                          f"(e.g. {P * max(m0.replicas, 1)}: its planned replicas)")
    R0 = G // P
    steps = args.steps or 10
    schedule = args.schedule or m0.schedule
    if schedule not in ("gpipe", "1f1b"):
        raise FreezeError(f"--freeze trains synchronous pipelines (gpipe, 1f1b), not {schedule}: give --schedule "
                          "1f1b")
    M = args.micro_batches or m0.micro_batches
    global_mb = M * R0          # every step's micro-batches, all replicas together, fixed over the run
    optimizer = args.optimizer or m0.optimizer
    doc = json.loads((pkg0.path / "plan.json").read_text())
    cluster = load_cluster(spec.cluster) if spec.cluster else ClusterSpec.from_json(doc["cluster"])
    cluster = cluster.with_overrides(gpus=G)
    built, graph = _trace_package_model(m0)
    layer_paths = find_layers(graph, spec.layers or None)
    L = len(layer_paths)
    if spec.manual and max(n for _, n, _ in spec.at) > L:
        raise FreezeError(f"--freeze at=: the model has {L} layers ({layer_paths[0]} ... {layer_paths[-1]})")
    log_dir = Path(args.log_dir or pkg0.path / "runs" / schedule)
    ck_dir = Path(args.checkpoint_dir or log_dir / "checkpoints")
    work = log_dir / "freeze"
    work.mkdir(parents=True, exist_ok=True)
    decisions: list[dict] = []
    phases: list[dict] = []

    def note(text: str) -> None:
        print(f"ftcompile run --freeze: {text}", file=sys.stderr)

    def save_log() -> None:
        atomic_write_text(log_dir / "freeze.jsonl", "".join(json.dumps(d) + "\n" for d in decisions + phases))

    step, frozen, R, package, plan_s = 0, 0, R0, str(args.package), 0.0
    note(f"{L} layers ({layer_paths[0]} ... {layer_paths[-1]}); phase 0: P={P} R={R} M={M}")
    while step < steps:
        if spec.manual:
            end = next((s for s, _, _ in spec.at if s > step), steps)
        elif math.floor(Fraction(spec.alpha).limit_denominator(10_000) * (L - frozen)) == 0:
            end = steps         # Eq. 1 can freeze no more: train to the end without checks
        else:
            end = min(step + spec.every, steps)
        end = min(end, steps)
        norms_file = work / f"norms-{end}"
        w = copy.copy(args)
        w.package, w.steps, w.micro_batches, w.schedule = package, end, M, schedule
        w.log_dir, w.checkpoint_dir, w.checkpoint_every = str(log_dir), str(ck_dir), None
        w.replicas, w.rank_order = R, None      # the phase package's layout
        w.resume = step > 0
        w.overwrite_checkpoints = bool(args.overwrite_checkpoints) and step == 0
        w.reset_optimizer = False
        w.grad_norms_at, w.grad_norms_layers, w.grad_norms_file = str(end - 1), ",".join(layer_paths), str(norms_file)
        argv = worker_argv(w)
        if getattr(args, "quiet", False) and "--progress" in argv:
            argv[argv.index("--progress") + 1] = "off"
        t0 = time.perf_counter()
        code = spawn(argv, P * R, run_id=new_run_id(), max_restarts=0, debug=bool(getattr(args, "debug", False)))
        wall = time.perf_counter() - t0
        if code:
            return code
        train_s, n = _phase_seconds(log_dir / "train.jsonl", step, end)
        samples = n * R * M * m0.micro_batch_size
        phases.append({"phase": len(phases), "steps": [step, end], "frozen_layers": frozen, "P": P, "R": R, "M": M,
                       "package": package, "train_s": round(train_s, 4), "launch_s": round(wall, 4),
                       "transition_s": round(plan_s + max(wall - train_s, 0.0), 4),
                       "samples_per_s": round(samples / train_s, 3) if train_s else None,
                       "samples_per_s_with_transition": round(samples / (wall + plan_s), 3) if wall else None})
        note(f"phase {len(phases) - 1}: steps {step}-{end - 1}, {frozen} frozen, P={P} R={R} M={M}: "
             f"{phases[-1]['samples_per_s']} samples/s training, transition {phases[-1]['transition_s']:.1f} s")
        step = end
        save_log()
        if step >= steps:
            break
        files = sorted(work.glob(f"norms-{end}.rank*.json"))
        norms = read_norms(files).get(end - 1)
        if norms is None:
            raise FreezeError(f"the ranks wrote no gradient norms for step {end - 1} into {work}")
        if spec.manual:
            new = next(n for s, n, _ in spec.at if s == end)
            forced = next(p for s, _, p in spec.at if s == end)
            rule = "manual"
        else:
            new = frozen_layers(frozen, norms[frozen:], spec.alpha)
            forced, rule = None, f"eq1 alpha={spec.alpha:.4g}"
        decision = {"decision": True, "step": end, "rule": rule, "frozen_before": frozen, "frozen_after": new,
                    "grad_norms": {layer_paths[i]: norms[i] for i in range(L)},
                    "active_argmin": (layer_paths[frozen + min(range(L - frozen), key=lambda i: norms[frozen + i])]
                                      if frozen < L else None)}
        plan_s = 0.0
        if new != frozen or (forced is not None and forced != P):
            t1 = time.perf_counter()
            ph = plan_phase(graph, layer_paths, new, cluster, global_micro_batches=global_mb, schedule=schedule,
                            optimizer=optimizer, start_pipeline=P, pipeline_gpus=forced, strategies=spec.strategy)
            package = write_phase_package(ph, built, layer_paths, work / f"phase-{len(phases)}-frozen-{new}")
            plan_s = time.perf_counter() - t1
            P, R, M, frozen = ph.pipeline_gpus, ph.replicas, ph.micro_batches, new
            decision["plan"] = ph.row()
            decision["plan_s"] = round(plan_s, 3)
        decisions.append(decision)
        note(f"step {end}: {decision['frozen_before']} -> {new} frozen layers ({rule}); next phase P={P} R={R} "
             f"M={M}")
        save_log()
    total_train = sum(p["train_s"] for p in phases)
    total_wall = sum(p["launch_s"] for p in phases) + sum(d.get("plan_s", 0.0) for d in decisions)
    note(f"{steps} steps in {len(phases)} phase(s): {total_train:.1f} s training, {total_wall:.1f} s with "
         f"transitions; log {log_dir / 'freeze.jsonl'}")
    return 0
