"""Tuning AvgPipe's parallelism degrees (M, N) and advance, with our simulator (AvgPipe §5.2).

AvgPipe runs ``N`` parallel pipelines of one plan on the same ``P`` GPUs, each on its own batch
of ``M`` micro-batches per step, under the ``avgpipe`` schedule (1F1B with ``advance``
micro-batches forwarded early; :mod:`ftcompile.runtime.schedules`). For every setting this
module reports:

* **simulated**: our simulator replays one pipeline's programs (:func:`ftcompile.simulate.simulate`)
  to its steady state, giving the step time ``T1`` with the pipeline's bubbles and the busy
  time ``b_g`` of every GPU per step. ``N`` pipelines share each GPU, so a step of all ``N`` takes
  ``max(T1, N * max_g b_g)``: the pipelines' work interleaves into each other's bubbles, never
  faster than one GPU's serial compute. That is a model of a GPU that runs one kernel at a
  time at its profiled speed (an analytic profile is a roofline: kernels at their bound), so
  the gain it predicts is bubble filling only, not the higher kernel utilisation of concurrent
  small kernels the paper also measured on V100s (§2).
* **predicted (Eqs. 1-8)**: the paper's equations from one profiled setting ``(m, n = 1)``: GPU
  time (Eq. 2, with the utilisation our roofline profile implies, 100 % during compute),
  blocking communication (Eq. 4), bubbles from the recursions (Eqs. 5-7) and memory (Eq. 8).
* **memory**: per GPU, ``N`` times each pipeline's model footprint (weights, gradients,
  optimizer state and versions, from :func:`ftcompile.plan.evaluate`) plus, when ``N > 1``, per
  pipeline the pending pull (a copy of the trainable weights) and its all-reduce bucket
  (:func:`pull_bytes`, :mod:`ftcompile.runtime.avgpipe`), plus ``N`` times
  its data footprint (activations in flight at this ``M`` and advance, buffers, inputs), plus
  ``N`` times the GPU's reserve: the runtime runs each pipeline's stage in a process of its own
  (``ftcompile.runtime``: N processes per GPU), and each has its own CUDA context, library
  workspaces and caching allocator, which the reserve stands for. So the fullest GPU holds
  ``N`` times what one pipeline's plan gives it, plus ``N`` pull buffers. (The paper's Eq. 8
  in :func:`predict` keeps its own model: one process, reserve once.)

The micro-batch size stays the profiled one, so ``M`` also sets each pipeline's batch
(``M x`` micro-batch). The choice is the highest simulated throughput among the settings
that fit every GPU's memory; ties go to fewer pipelines, then fewer forwards in advance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .ir import DTYPE_BYTES
from .plan import Plan, Problem, _stage_params, evaluate
from .runtime.allreduce import BUCKET_BYTES as AVERAGE_BUCKET_BYTES
from .simulate import simulate


class TuneError(ValueError):
    """No AvgPipe setting can be tuned as asked; the message says what to change."""


@dataclass
class Setting:
    micro_batches: int
    parallel: int
    advance: int
    step_ms: float                   # simulated: one step of all N pipelines
    throughput: float                # simulated samples/s of all N pipelines
    memory_bytes: int                # the fullest GPU, N pipelines
    memory_limit: int
    predicted_step_ms: float = 0.0   # the paper's Eqs. 1-7 from the profiled setting
    predicted_memory_bytes: int = 0  # the paper's Eq. 8
    bubble_fraction: float = 0.0     # one pipeline's idle share (simulated)
    gpu_memory: list = field(default_factory=list)   # per GPU (counted, reserve) bytes, N pipelines

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit

    def row(self) -> list[str]:
        return [str(self.micro_batches), str(self.parallel), str(self.advance), f"{self.step_ms:.1f}",
                f"{self.predicted_step_ms:.1f}", f"{self.throughput:.1f}", f"{self.memory_bytes / 2**30:.2f}",
                f"{self.predicted_memory_bytes / 2**30:.2f}", "yes" if self.fits else "no"]


HEADER = ["M", "N", "advance", "step ms (sim)", "step ms (Eqs.)", "samples/s (sim)", "GiB (ours)",
          "GiB (Eq. 8)", "fits"]


@dataclass
class Tuning:
    settings: list[Setting]
    chosen: Setting | None
    profiled: tuple[int, int] = (0, 1)            # (m, n) the equations start from
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"settings": [asdict(s) | {"fits": s.fits} for s in self.settings],
                "chosen": None if self.chosen is None else {"micro_batches": self.chosen.micro_batches,
                                                           "parallel_pipelines": self.chosen.parallel,
                                                           "advance": self.chosen.advance},
                "profiled": list(self.profiled), "notes": self.notes}


def _pipeline(problem: Problem, plan: Plan, M: int, advance: int):
    pb = replace(problem, schedule="avgpipe", micro_batches=M, advance=advance, replicas=1)
    return pb, evaluate(pb, plan), simulate(pb, plan)


def pull_bytes(problem: Problem, plan: Plan, gpu: int, N: int) -> int:
    """What one pipeline's averaging holds on ``gpu`` beyond its plan (``ftcompile.runtime.avgpipe``):
    per stage, the pending displacement (a copy of its trainable weights) and the bucket its
    background all-reduce fills meanwhile (a flat copy of up to ``BUCKET_BYTES`` of weights, or of
    one larger tensor; with three or more pipelines also its float64 sum: twice that for float32
    weights, four times for 16-bit ones). One pipeline never pulls. (The reference model a
    checkpoint saves goes to the host bucket by bucket: nothing more on the GPU.)"""
    if N < 2:
        return 0
    total = 0
    for st in plan.stages:
        if st.gpu != gpu:
            continue
        names = _stage_params(problem, st.nodes)[4]
        trainable = [n for n in names if problem.profile.params[n].grad_bytes]
        sizes = [problem.profile.params[n].bytes for n in trainable]
        bucket = min(sum(sizes), max([AVERAGE_BUCKET_BYTES, *sizes]))
        factor = 1.0
        if N >= 3:     # the float64 sum, for the narrowest dtype among the weights
            item = [DTYPE_BYTES.get(problem.graph.params[n].meta.dtype, 4) for n in trainable]
            factor += max((8 / b for b in item if b < 8), default=0.0)
        total += sum(sizes) + int(bucket * factor)
    return total


def gpu_memory(problem: Problem, plan: Plan, cost, N: int) -> list[tuple[int, int]]:
    """Each GPU's (counted bytes, reserve bytes) with ``N`` parallel pipelines (see the module
    docstring): N copies of what one pipeline's plan gives it and of its pull buffers, and N
    processes' reserves."""
    return [(N * (g.memory_bytes - g.reserve_bytes + pull_bytes(problem, plan, g.gpu, N)), N * g.reserve_bytes)
            for g in cost.gpus]


def setting(problem: Problem, plan: Plan, M: int, N: int, advance: int) -> Setting:
    """One setting, simulated (see the module docstring)."""
    pb, cost, sim = _pipeline(problem, plan, M, advance)
    busy = max((u * sim.minibatch_ms for u in sim.gpu_utilisation), default=0.0)
    step = max(sim.minibatch_ms, N * busy)
    limit = min((g.memory_limit for g in cost.gpus), default=0)
    per_gpu = gpu_memory(pb, plan, cost, N)
    fullest = max((counted + reserve for counted, reserve in per_gpu), default=0)   # reserves included
    return Setting(M, N, advance, step, N * M * sim.micro_batch_size / (step / 1e3) if step > 0 else 0.0,
                   fullest, limit, bubble_fraction=sim.bubble_fraction, gpu_memory=per_gpu)


def predict(problem: Problem, plan: Plan, m: int, settings: list[Setting]) -> None:
    """Fill each setting's ``predicted_*`` with the paper's Eqs. 1-8 from one profiled setting ``(m, n = 1)``
    (AFAB-based, as §5.2.2 assumes): with a micro-batch of the profiled size, M* micro-batches of N* pipelines
    are ``N* M* / m`` times the profiled GPU time (utilisation 100 % while computing: Eq. 2's overused case)."""
    _, cost, sim = _pipeline(problem, plan, m, m)
    K = len(cost.gpus)
    T_gpu = [u * sim.minibatch_ms for u in sim.gpu_utilisation]   # per profiled batch
    T_all = [g.comm_ms * m for g in cost.gpus]                     # all communication per batch
    for s in settings:
        ms, ns = s.micro_batches, s.parallel
        gpu = [ns * ms / m * t for t in T_gpu]                                             # Eq. 2
        comm_all = [ns * ms / m * t for t in T_all]
        com = [c / ms + (ms - 1) / ms * max(c - g, 0.0) for c, g in zip(comm_all, gpu)]    # Eq. 4
        up = [0.0] * K
        for k in range(1, K):
            up[k] = up[k - 1] + (comm_all[k - 1] + gpu[k - 1]) / ms                       # Eq. 6
        down = [0.0] * K
        for k in range(K - 2, -1, -1):
            down[k] = down[k + 1] + (comm_all[k + 1] + gpu[k + 1]) / ms                   # Eq. 7
        s.predicted_step_ms = max((gpu[k] + com[k] + up[k] + down[k] for k in range(K)), default=0.0)  # Eqs. 1, 5
        # Eq. 8 from the profiled footprints: model part times N*/n, data part times M*/m (same micro-batch size:
        # AFAB holds all M micro-batches) and N*/n.
        worst = 0
        for g in cost.gpus:
            model = g.param_bytes + g.weight_version_bytes + g.grad_bytes + g.optimizer_bytes
            data = g.memory_bytes - model - g.reserve_bytes
            worst = max(worst, int(ns * model + ns * ms / m * data + g.reserve_bytes))
        s.predicted_memory_bytes = worst


def tune(problem: Problem, plan: Plan, *, micro_batches=(1, 2, 4, 8, 16), parallel=(1, 2, 3, 4),
         advances: str | tuple[int, ...] = "auto", profiled_m: int | None = None) -> Tuning:
    """Every (M, N, advance) setting simulated and predicted; the fastest that fits is chosen.

    ``advances="auto"`` tries 0 (1F1B), each power of two below M, and M (AFAB): Algorithm 1's
    search, done in simulation.
    """
    Ms = sorted({int(m) for m in micro_batches})
    Ns = sorted({int(n) for n in parallel})
    if not Ms or Ms[0] < 1 or not Ns or Ns[0] < 1:
        raise TuneError("give micro-batch counts and parallel pipeline counts of at least 1")
    out = []
    for M in Ms:
        ks = sorted({0, M} | {2 ** i for i in range(8) if 2 ** i < M}) if advances == "auto" else \
            sorted({min(int(k), M) for k in advances})
        for N in Ns:
            for k in ks:
                out.append(setting(problem, plan, M, N, k))
    m = profiled_m or max(Ms)
    predict(problem, plan, m, out)
    fit = [s for s in out if s.fits]
    chosen = max(fit, key=lambda s: (s.throughput, -s.parallel, -s.advance)) if fit else None
    notes = [] if fit else ["no setting fits the GPUs' memory: try fewer parallel pipelines, fewer micro-batches "
                            "or a plan over more GPUs"]
    return Tuning(out, chosen, (m, 1), notes)


def best_advance(problem: Problem, plan: Plan, M: int, N: int) -> int:
    """Algorithm 1 in simulation: raise the forwards in advance from 0 while the step gets faster and memory fits."""
    best = setting(problem, plan, M, N, 0)
    for k in range(1, M + 1):
        s = setting(problem, plan, M, N, k)
        if not s.fits or s.step_ms >= best.step_ms * (1 - 1e-9):
            break
        best = s
    return best.advance


# --------------------------------------------------------------------------- ftcompile run

def launch_settings(args, package) -> int:
    """Resolve ``--parallel-pipelines auto`` / ``--advance auto`` of ``ftcompile run`` from the tuning recorded in the
    package's plan (``ftcompile compile --schedule avgpipe``); returns the number of parallel pipelines."""
    import json

    from .runtime.avgpipe import _count, parse_advance

    n = _count("--parallel-pipelines", getattr(args, "parallel_pipelines", None), 1)
    k = parse_advance(getattr(args, "advance", None))       # adapt[:LIMIT]: the ranks adapt it (runtime.avgpipe)
    schedule = args.schedule or package.manifest.schedule
    if schedule != "avgpipe":
        return 1
    if n == "auto" or k == "auto":
        plan_file = package.path / "plan.json"
        tuned = json.loads(plan_file.read_text()).get("avgpipe") if plan_file.exists() else None
        if not tuned or not tuned.get("chosen"):
            raise TuneError("--parallel-pipelines auto / --advance auto take the (M, N, advance) that `ftcompile "
                            "compile --schedule avgpipe` tuned, and this package's plan has none; compile it with "
                            "--schedule avgpipe, or give numbers")
        ch = tuned["chosen"]
        if n == "auto":
            args.parallel_pipelines = n = int(ch["parallel_pipelines"])
            if getattr(args, "micro_batches", None) is None:     # the tuned pair (M, N), unless M was given
                args.micro_batches = int(ch["micro_batches"])
        if k == "auto":
            args.advance = k = int(ch["advance"])
    return int(n or 1)


# --------------------------------------------------------------------------- ftcompile compile / simulate

def add_arguments(group, *, auto: bool = True) -> None:
    """``--parallel-pipelines`` and ``--advance`` for ``compile`` (``auto``: tune) and ``simulate``."""
    what = "N|auto" if auto else "N"
    group.add_argument("--parallel-pipelines", default=None, metavar=what,
                       help="avgpipe: N parallel pipelines on the same GPUs (default 1" +
                            ("; auto: tune (M, N, advance) in simulation and record the choice in plan.json)"
                             if auto else ")"))
    group.add_argument("--advance", default=None, metavar="K|auto" if auto else "K",
                       help="avgpipe: micro-batches forwarded in advance of 1F1B's warm-up (default 0" +
                            ("; auto: the fastest that fits, in simulation)" if auto else ")"))


def problem_advance(args) -> int:
    """The advance a Problem prices (0 when not a number)."""
    from .runtime.avgpipe import _count

    if str(getattr(args, "advance", None) or "").startswith("adapt"):
        raise TuneError(f"--advance {args.advance} adapts the advance while training: it is for `ftcompile run`; "
                        "compile and simulate price one advance (give a number, or auto to tune it)")
    k = _count("--advance", getattr(args, "advance", None), 0)
    _count("--parallel-pipelines", getattr(args, "parallel_pipelines", None), 1)
    if (k is not None or getattr(args, "parallel_pipelines", None) is not None) and args.schedule not in (None, "avgpipe"):
        raise TuneError("--parallel-pipelines and --advance belong to --schedule avgpipe; add it or drop them")
    return k if isinstance(k, int) else 0


def tune_for_compile(args, problem: Problem, plan: Plan) -> Tuning:
    """The tuning ``ftcompile compile --schedule avgpipe`` records: what was given is fixed, the rest searched."""
    from .runtime.avgpipe import _count

    n = _count("--parallel-pipelines", getattr(args, "parallel_pipelines", None), 1)
    k = _count("--advance", getattr(args, "advance", None), 0)
    searching = n == "auto" or k == "auto"
    Ms = tuple(sorted({1, 2, 4, 8, 16, problem.micro_batches})) if n == "auto" else (problem.micro_batches,)
    Ns = (1, 2, 3, 4) if n == "auto" else (n or 1,)
    ks = "auto" if (k == "auto" or (searching and k is None)) else (k or 0,)
    return tune(problem, plan, micro_batches=Ms, parallel=Ns, advances=ks)


def format_tuning(t: Tuning) -> str:
    from .cli import format_table

    rows = [s.row() for s in t.settings]
    out = [f"AvgPipe settings (simulated; Eqs. from the profiled M={t.profiled[0]}, N=1):",
           format_table(HEADER, rows, right=tuple(range(len(HEADER))))]
    c = t.chosen
    out.append("chosen: none fits" if c is None else
               f"chosen: M={c.micro_batches}, N={c.parallel}, advance={c.advance}: {c.throughput:.1f} samples/s "
               f"(simulated), {c.memory_bytes / 2**30:.2f} GiB on the fullest GPU")
    out += [f"note: {n}" for n in t.notes]
    return "\n".join(out)
