"""AvgPipe's elastic averaging (Chen et al., PPoPP 2023, §3.2): N parallel pipelines and a reference model.

N parallel pipelines of the same package train side by side, each on its own batch (its share
of the step's global batch, as replicas do), each with its own optimizer (any: SGD, Adam,
Adafactor). Unlike replicas they never average gradients: each takes its own local step and is
then pulled toward the reference model, the average of the N parallel models.

The update of parallel model ``i`` at step ``j`` (``v_i`` the weights after its local optimizer
step, ``w_i(j)`` after the pull, ``ref(j) = mean_i w_i(j)``)::

    w_i(j) = v_i(j) + alpha * (ref(j-1) - w_i(j-1))          alpha = 1/N by default

That is the issue's ``w_i <- (1 - alpha) w_i + alpha w_ref`` with the displacement from the
reference measured one step late, at the weights the reference was averaged from. Two reasons
for that choice over pulling the current weights toward a one-step-old reference:

* **The reference stays the exact average.** Summing the update over ``i`` gives
  ``mean w(j) = mean w(j-1) + mean (v_i - w_i(j-1))``: the average moves by the mean local
  update (what the paper's reference process applies) and the elastic terms cancel. Pulling
  ``(1 - alpha) v_i + alpha ref(j-1)`` instead drags every model back by ``alpha`` times its own
  step: at N = 1, alpha = 1 it would not train at all, at N = 2 it halves the learning rate.
* **It is off the critical path.** ``ref(j-1) - w_i(j-1)`` needs only step ``j-1``'s weights: a
  background thread per stage copies them when the step is taken and all-reduces the copy over
  the stage's N ranks while the pipeline runs step ``j``'s forwards and backwards; the pull at
  ``U(j)`` waits only when a whole step of compute did not cover one all-reduce.

With N = 1 the displacement is always zero: AvgPipe is 1F1B with advance forward propagation,
bit for bit (no communication at all). The reference model is never materialised during
training; :meth:`ElasticAveraging.reference` computes it (one extra all-reduce) for checkpoints,
which save it, and every parallel model resumes from it (a resumed run is a run whose N models
start equal, as a fresh one does).

Memory: per parallel model and stage, one weight-sized buffer (the pending displacement) and one
all-reduce bucket in flight, in place of the paper's reference model per GPU.
"""

from __future__ import annotations

import math
import queue
import re
import threading
from dataclasses import dataclass, field

import torch

from .allreduce import buckets


class AvgPipeError(ValueError):
    """AvgPipe cannot run with these settings; the message says which to change."""


def default_alpha(parallel: int) -> float:
    """The paper's ``alpha = 1/N`` (§3.2, after Crossbow)."""
    return 1.0 / parallel


def check(parallel: int, alpha: float | None) -> float:
    """The elastic coefficient to use for ``parallel`` pipelines; refuses nonsense."""
    if parallel < 1:
        raise AvgPipeError(f"--parallel-pipelines must be at least 1, got {parallel}")
    a = default_alpha(parallel) if alpha is None else float(alpha)
    if not 0.0 <= a <= 1.0:
        raise AvgPipeError(f"--elastic-alpha must lie in [0, 1] (0: independent models, 1: reset to the "
                           f"reference every step), got {a}")
    return a


def _mean_in_place(flat: torch.Tensor, parallel: int, allreduce) -> None:
    """``flat`` <- the mean of every member's ``flat``. With three or more members the sum runs in
    float64: a stage's copy of a tied weight is averaged in another group (another bucket layout,
    so possibly another summation order) than the other holders' copies, and must come out the
    same bits. Two members sum ``a + b = b + a`` exactly."""
    if parallel < 3 or flat.dtype == torch.float64:
        allreduce(flat)
        flat.div_(parallel)
        return
    wide = flat.double()
    allreduce(wide)
    flat.copy_(wide.div_(parallel))


class _StageAverager:
    """One stage's background thread: all-reduce a snapshot, leave ``alpha * (mean - snapshot)``."""

    def __init__(self, stage: int, parallel: int, alpha: float, allreduce, notify):
        self.stage, self.parallel, self.alpha = stage, parallel, alpha
        self._allreduce, self._notify = allreduce, notify
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: dict[int, object] = {}        # step -> displacement list, or the error
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"avgpipe-{stage}")
        self._thread.start()

    def submit(self, key, tensors: list[torch.Tensor], kind: str, done=None) -> None:
        self._jobs.put((key, tensors, kind, done))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            stored = self._run(*job)
            # Drop the job before telling the engine: kept while this thread waits, its tensors
            # would hold the displacement past its application, a second weight-sized buffer.
            del job
            if stored:
                self._notify()

    def _run(self, key, tensors: list[torch.Tensor], kind: str, done) -> bool:
        try:
            out = self._pull(tensors) if kind == "pull" else self._mean(tensors)
        except BaseException as exc:  # noqa: BLE001 - handed to the engine, which names the stage
            out = exc
        if done is not None:
            done(out)
            return False
        with self._lock:
            self.results[key] = out
        return True

    def _pull(self, snapshot: list[torch.Tensor]) -> list[torch.Tensor]:
        # Bucket by bucket: the snapshot becomes the displacement in place, so the thread holds one
        # weight-sized buffer plus one bucket.
        for idx in buckets(snapshot):
            parts = [snapshot[i] for i in idx]
            flat = torch.cat([p.reshape(-1) for p in parts])
            _mean_in_place(flat, self.parallel, self._allreduce)
            off = 0
            for p in parts:
                n = p.numel()
                p.neg_().add_(flat[off:off + n].view_as(p)).mul_(self.alpha)
                off += n
        return snapshot

    def _mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for idx in buckets(tensors):
            parts = [tensors[i] for i in idx]
            flat = torch.cat([p.detach().reshape(-1) for p in parts])
            _mean_in_place(flat, self.parallel, self._allreduce)
            off = 0
            for p in parts:
                n = p.numel()
                # to the host, where the checkpoint writes from: a device copy of every weight and
                # optimizer state beside the training state is memory no plan counts
                out.append(flat[off:off + n].view_as(p).to("cpu", copy=True))
                off += n
        return out

    def take(self, step: int):
        with self._lock:
            return self.results.pop(step, None)

    def has(self, step: int) -> bool:
        with self._lock:
            return step in self.results

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)


def _apply(stage: int, step: int, tensors: list[torch.Tensor], disp) -> None:
    if isinstance(disp, BaseException):
        raise AvgPipeError(f"averaging stage {stage} over the parallel pipelines at step {step} failed: {disp}")
    for p, d in zip(tensors, disp):
        p.add_(d)


class ElasticAveraging:
    """The ``averaging`` object of :class:`~ftcompile.runtime.engine.RankEngine` for AvgPipe.

    The engine runs N parallel pipelines as N replicas (:class:`~ftcompile.runtime.layout.RankLayout`
    with ``replicas=N``) and, given this object, skips its gradient averaging and calls
    :meth:`attach` with each local stage's all-reduce over its N copies, :meth:`ready` before
    ``U(j)`` and :meth:`after_step` right after each stage's optimizer step.
    """

    def __init__(self, parallel: int, alpha: float | None = None):
        self.parallel = parallel
        self.alpha = check(parallel, alpha)
        self._stages: dict[int, _StageAverager] = {}
        self._pending: dict[int, int] = {}          # stage -> the step whose displacement U(step + 1) applies
        self._poke = None

    # ---- engine hooks
    def attach(self, engine, allreduce: dict[int, object]) -> None:
        """Called by the engine once its local stages exist: ``allreduce[stage](flat)`` sums over the stage's N
        ranks (one per parallel pipeline)."""
        if engine.replicas != self.parallel:
            raise AvgPipeError(f"{self.parallel} parallel pipelines need a layout of {self.parallel} replicas, "
                               f"the engine has {engine.replicas}")
        self._poke = engine.poke
        if self.parallel < 2:
            return
        for sid in sorted(engine.modules):
            self._stages[sid] = _StageAverager(sid, self.parallel, self.alpha, allreduce[sid], self._notify)

    def _notify(self) -> None:
        if self._poke is not None:
            self._poke()

    def ready(self, stage: int, step: int) -> str | None:
        prev = self._pending.get(stage)
        if prev is None or stage not in self._stages or self._stages[stage].has(prev):
            return None
        return (f"the reference model of step {prev} (the average of stage {stage} over the {self.parallel} "
                "parallel pipelines, on its background all-reduce)")

    @torch.no_grad()
    def after_step(self, stage: int, step: int, params: dict[str, torch.Tensor]) -> None:
        avg = self._stages.get(stage)
        if avg is None:
            return
        tensors = list(params.values())
        prev = self._pending.pop(stage, None)
        if prev is not None:
            # in a call of its own, so that the displacement is freed before the snapshot below is
            # taken: one weight-sized buffer per stage at a time, as ftcompile.avgpipe counts
            _apply(stage, prev, tensors, avg.take(prev))
        avg.submit(step, [p.detach().clone() for p in tensors], "pull")
        self._pending[stage] = step

    # ---- the reference model
    @torch.no_grad()
    def reference(self, state: dict[int, dict]) -> dict[int, dict]:
        """The reference model in the layout of :meth:`RankEngine.state`: every floating tensor of each local
        stage's weights and optimizer state averaged over the N parallel pipelines (a collective: every rank
        calls it at the same point). Every pipeline gets the same bits, so a checkpoint keeps one copy."""
        if not self._stages:
            return state
        out = {}
        for sid, st in state.items():
            avg = self._stages[sid]
            keys, tensors = [], []
            for n, t in st["weights"].items():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    keys.append(("weights", n, None))
                    tensors.append(t)
            for n, d in st.get("optimizer", {}).items():
                for k, t in d.items():
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        keys.append(("optimizer", n, k))
                        tensors.append(t)
            box: queue.SimpleQueue = queue.SimpleQueue()
            # Through the stage's own thread: its all-reduces stay in one order on every member.
            avg.submit(None, tensors, "mean", box.put)
            means = box.get()
            if isinstance(means, BaseException):
                raise AvgPipeError(f"averaging stage {sid}'s reference model failed: {means}")
            new = {"weights": dict(st["weights"]),
                   "optimizer": {n: dict(d) for n, d in st.get("optimizer", {}).items()}}
            for (part, n, k), m in zip(keys, means):
                if part == "weights":
                    new["weights"][n] = m
                else:
                    new["optimizer"][n][k] = m
            out[sid] = new
        return out

    def close(self) -> None:
        for avg in self._stages.values():
            avg.close()
        self._stages.clear()


# --------------------------------------------------------------------------- options

#: ``--advance adapt``: a step must be faster than the last by more than this share to raise K again.
ADAPT_TOLERANCE = 0.02
#: ``--advance adapt`` on a GPU without a limit: this share of the device's memory (the rest is the CUDA
#: context's and the caching allocator's).
ADAPT_GPU_SHARE = 0.9

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


@dataclass(frozen=True)
class Adapt:
    """``--advance adapt[:LIMIT]``: Algorithm 1 at run time (see :class:`AdvanceTuner`). ``limit``: peak bytes per
    rank, None for the default (the GPU's memory on CUDA, none on the CPU)."""

    limit: int | None = None
    text: str = "adapt"


def _bytes(text: str, flag: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise AvgPipeError(f"{flag}: cannot read the memory limit {text!r}; write it like 6GiB, 800MB or 2e9 "
                           "(bytes per rank)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise AvgPipeError(f"{flag}: the memory limit must be a positive size, got {text!r}")
    return int(value)


def parse_advance(text):
    """``--advance``: a whole number >= 0, ``"auto"`` (the plan's tuned value), an :class:`Adapt`
    (``adapt`` or ``adapt:LIMIT``), or None when not given."""
    if isinstance(text, Adapt):
        return text
    if isinstance(text, str) and (text == "adapt" or text.startswith("adapt:")):
        limit = text[len("adapt:"):] if ":" in text else None
        if limit is not None and not limit.strip():
            raise AvgPipeError("--advance adapt: takes a memory limit after the colon (adapt:6GiB), or none "
                               "(adapt)")
        return Adapt(None if limit is None else _bytes(limit, "--advance adapt:LIMIT"), text)
    try:
        return _count("--advance", text, 0)
    except AvgPipeError as exc:
        if "must be" in str(exc):
            raise AvgPipeError(f"--advance must be 0 or more (or 'auto', or 'adapt[:LIMIT]'), got {text}") from None
        raise AvgPipeError(f"--advance takes a whole number >= 0, 'auto' (the plan's tuned value) or "
                           f"'adapt[:LIMIT]' (Algorithm 1 while training, e.g. adapt:6GiB), got {text!r}") from None


def _count(flag: str, text, low: int):
    """``text`` as an int >= ``low``, ``"auto"``, or None when not given."""
    if text is None or text == "auto":
        return text
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise AvgPipeError(f"{flag} takes a whole number or 'auto', got {text!r}") from None
    if n < low:
        raise AvgPipeError(f"{flag} must be {'0 or more' if low == 0 else f'at least {low}'} (or 'auto'), got {n}")
    return n


def check_options(args) -> list[str]:
    """Refuse AvgPipe options that make no sense (:class:`AvgPipeError`); warnings for pointless ones."""
    n = _count("--parallel-pipelines", getattr(args, "parallel_pipelines", None), 1)
    k = parse_advance(getattr(args, "advance", None))
    alpha = getattr(args, "elastic_alpha", None)
    if alpha is not None:
        check(n if isinstance(n, int) else 2, alpha)
    given = [f for f, v in (("--parallel-pipelines", n), ("--elastic-alpha", alpha)) if v is not None]
    if given and args.schedule not in (None, "avgpipe"):
        raise AvgPipeError(f"{', '.join(given)} belong to --schedule avgpipe, not {args.schedule}; add "
                           "--schedule avgpipe or drop them")
    if isinstance(k, Adapt) and args.schedule not in (None, "avgpipe"):
        raise AvgPipeError(f"--advance {k.text} adapts the schedule avgpipe while it trains, not "
                           f"{args.schedule}; add --schedule avgpipe or drop it")
    if getattr(args, "advance", None) not in (None, 0, "0") and args.schedule not in (None, "avgpipe"):
        return [f"--advance does nothing under --schedule {args.schedule}: it is for --schedule avgpipe"]
    return []


def resolved(args) -> tuple[int, int, float | None]:
    """``(parallel pipelines, advance, alpha)`` of a rank's options; 'auto' must have been resolved by the
    launcher (``ftcompile run``), which can consult the compiler. ``adapt`` starts at 0 (1F1B)."""
    n = _count("--parallel-pipelines", getattr(args, "parallel_pipelines", None), 1)
    k = parse_advance(getattr(args, "advance", None))
    if n == "auto" or k == "auto":
        raise AvgPipeError("--parallel-pipelines auto and --advance auto are chosen by `ftcompile run` from the "
                           "package's plan; started directly, give numbers")
    return (n or 1), (0 if isinstance(k, Adapt) else (k or 0)), getattr(args, "elastic_alpha", None)


def adaptive(args) -> Adapt | None:
    """The :class:`Adapt` of ``--advance adapt[:LIMIT]`` under ``--schedule avgpipe``, else None."""
    k = parse_advance(getattr(args, "advance", None))
    return k if isinstance(k, Adapt) and getattr(args, "schedule", None) == "avgpipe" else None


def as_replicas(args, schedule: str | None) -> None:
    """Under ``avgpipe`` the parallel pipelines are the run's replicas: set ``args.replicas`` to N (refusing a
    ``--replicas`` that says otherwise)."""
    if schedule != "avgpipe":
        return
    n = resolved(args)[0]
    given = getattr(args, "replicas", None)
    if given is not None and given != n:
        raise AvgPipeError(f"--replicas {given} with --schedule avgpipe: its parallel pipelines are the replicas; "
                           f"give --parallel-pipelines {given} instead (now {n})")
    args.replicas = n


# --------------------------------------------------------------------------- Algorithm 1 at run time

class AdvanceTuner:
    """AvgPipe's Algorithm 1 while training (``--advance adapt[:LIMIT]``): start as 1F1B, raise the micro-batches
    forwarded in advance by one per step while the step gets faster and memory stays under the limit.

    The launcher (:mod:`~ftcompile.runtime.worker`) runs one step per segment while adapting and, between two
    steps, every rank hands :meth:`figures` to an all-gather; :meth:`observe` turns the gathered list into the next
    step's advance. Its input is the same list on every rank and it is a pure function of that list and of the
    tuner's state (which every rank updated from the same lists before), so every rank runs the same advance in
    every step; a rank that ran another one is refused as a bug. The rule, per step with advance ``K``:

    1. The process's first step (a fresh run or a resumed one) is a warm-up: it runs ``K`` and is not compared
       (it pays for first-touch allocations and connections).
    2. A rank whose measured peak exceeded its limit: back to ``K - 1`` (0 stays 0) and settle.
    3. Not faster than the step with ``K - 1`` by more than :data:`ADAPT_TOLERANCE` (the slowest rank's step
       time, what a step costs): back to ``K - 1`` and settle. Algorithm 1 keeps the ``K`` it stopped at; the last
       ``K`` that did make a step faster is as fast within the tolerance and holds less.
    4. ``K = M`` (all forwards first, GPipe's order): settle.
    5. ``K + 1`` predicted over a rank's limit: settle at ``K``. The prediction adds to each rank's measured peak
       the bytes of the micro-batches ``K + 1`` keeps in flight beyond ``K`` (from the schedule's own
       :attr:`~ftcompile.runtime.schedules.StageProgram.in_flight`), at the bytes per micro-batch the last raise
       measured on that rank, or before any raise ``(peak - held between steps) / micro-batches in flight``: an
       upper bound, since the peak holds every micro-batch in flight beside what is held between steps (and
       gradients and a backward's transients on top), so it may keep ``K`` lower than would fit; AvgPipe is
       conservative with memory. A measured peak over the limit (rule 2) catches a prediction that fell short.
    6. Else raise to ``K + 1``.

    Once settled the advance stays for the rest of the run (and across ``--resume``: the checkpoint keeps it).

    Memory figures are each rank's per-step peak: CUDA's allocator on a GPU, the tensor meter
    (:mod:`~ftcompile.runtime.memory`, turned on by a limit) on the CPU, where the resident set is a lifetime peak
    that cannot tell one step from the next. Without a limit on the CPU only speed decides.
    """

    def __init__(self, spec: Adapt, micro_batches: int, *, tolerance: float = ADAPT_TOLERANCE):
        self.spec, self.micro_batches, self.tolerance = spec, micro_batches, tolerance
        self.advance = 0
        self.settled = False
        self.reason = "starting as 1F1B (advance 0)"
        self._warm = False
        self._best_s: float | None = None
        self._last: dict[int, tuple[int, int]] | None = None     # rank -> (peak, in flight) at the last raise
        self._growth: dict[int, float] = {}                        # rank -> bytes per micro-batch in flight

    @property
    def adapting(self) -> bool:
        return not self.settled

    # ---- checkpoints
    def to_json(self) -> dict:
        return {"spec": self.spec.text, "advance": self.advance, "settled": self.settled, "reason": self.reason}

    def resume(self, saved: dict | None) -> str | None:
        """Take the state a checkpoint saved (:meth:`to_json`) when it adapted the same way; returns a note."""
        if not saved or saved.get("spec") != self.spec.text:
            return None
        self.advance = min(int(saved.get("advance", 0)), self.micro_batches)
        self.settled = bool(saved.get("settled"))
        self.reason = str(saved.get("reason", ""))
        if self.settled:
            return f"--advance {self.spec.text}: keeping the checkpoint's advance {self.advance} ({self.reason})"
        return (f"--advance {self.spec.text}: adapting on from the checkpoint's advance {self.advance} (one warm-up "
                "step, then the comparison starts afresh)")

    # ---- one step
    def limit_for(self, device) -> int | None:
        """This rank's limit: the one given, else on a GPU :data:`ADAPT_GPU_SHARE` of its memory."""
        if self.spec.limit is not None:
            return self.spec.limit
        if getattr(device, "type", None) == "cuda":
            return int(ADAPT_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory)
        return None

    def figures(self, engine, record: dict | None) -> dict:
        """What this rank hands to the all-gather after a step: the advance its stages ran (read from their
        programs), its step time and peak, the bytes it holds between steps, and its micro-batches in flight at
        this advance and the next."""
        from .schedules import stage_program

        stages = list(engine.stages.values())
        ran = sorted({st.program.advance for st in stages})
        M = engine.cfg.micro_batches

        def in_flight(k: int) -> int:
            return sum(stage_program("avgpipe", st.id, depth=st.program.depth, micro_batches=M, steps=1,
                                     advance=k).in_flight for st in stages)

        if engine.meter is not None:
            live, measured = engine.meter.live, "tensors"
        elif engine.device.type == "cuda":
            live, measured = int(torch.cuda.memory_allocated(engine.device)), "cuda allocator"
        else:
            live, measured = None, "process peak resident set (not compared)"
        return {"rank": engine.rank, "advance": ran[0] if len(ran) == 1 else (ran or None),
                "seconds": float(record["seconds"]) if record else 0.0,
                "peak_bytes": int(record.get("memory_bytes") or 0) if record else 0, "live_bytes": live,
                "limit_bytes": self.limit_for(engine.device) if live is not None else None, "memory": measured,
                "in_flight": in_flight(self.advance), "in_flight_next": in_flight(self.advance + 1)}

    def observe(self, figures: list[dict], step: int) -> dict:
        """Decide the next step's advance from every rank's :meth:`figures` of ``step`` (the same list on every
        rank); returns the decision with its numbers, for the step's log record."""
        K, tol = self.advance, self.tolerance
        figs = sorted(figures, key=lambda f: f["rank"])
        ran = {f["rank"]: f["advance"] for f in figs if f["advance"] is not None}
        if any(k != K for k in ran.values()):
            raise AvgPipeError(f"step {step}: the ranks ran advances {ran}, but all should have run {K} (a bug: "
                               "the ranks must agree on the advance of every step)")
        T = max((f["seconds"] for f in figs), default=0.0)
        peak = {f["rank"]: f["peak_bytes"] for f in figs}
        limit = {f["rank"]: f["limit_bytes"] for f in figs}
        out = {"step": step, "advance": K, "step_s": T, "best_step_s": self._best_s, "tolerance": tol,
               "advance_by_rank": {str(r): k for r, k in ran.items()},
               "peak_bytes": {str(r): p for r, p in peak.items()},
               "limit_bytes": {str(r): x for r, x in limit.items() if x is not None} or None,
               "memory": sorted({f["memory"] for f in figs})}
        if self.settled:
            return self._decide(out, K, "hold", self.reason)
        if not self._warm:
            self._warm = True
            return self._decide(out, K, "hold", "warm-up: the process's first step is not compared")
        over = [r for r in peak if limit[r] is not None and peak[r] > limit[r]]
        if over:
            r = over[0]
            if K == 0:
                return self._settle(out, 0, f"memory: 1F1B itself peaked at {peak[r]} bytes > the limit {limit[r]} "
                                            f"on rank {r}; the advance stays 0")
            return self._settle(out, K - 1, f"memory: rank {r} peaked at {peak[r]} bytes > its limit {limit[r]} with "
                                            f"advance {K}; back to {K - 1}")
        if self._best_s is not None and T > self._best_s * (1 - tol):
            return self._settle(out, K - 1, f"not faster: {T:.4f} s with advance {K} against {self._best_s:.4f} s "
                                            f"with {K - 1} (a raise needs under {self._best_s * (1 - tol):.4f} s); "
                                            f"back to {K - 1}")
        # Faster, or the first step measured: learn the bytes a micro-batch in flight costs, consider K + 1.
        for f in figs:
            r, n = f["rank"], f["in_flight"]
            last = self._last.get(r) if self._last else None
            if last is not None and n > last[1] and peak[r] > last[0]:
                self._growth[r] = (peak[r] - last[0]) / (n - last[1])
            elif r not in self._growth and f["live_bytes"] is not None and n > 0:
                self._growth[r] = max(peak[r] - f["live_bytes"], 0) / n
        self._best_s = T
        self._last = {f["rank"]: (peak[f["rank"]], f["in_flight"]) for f in figs}
        if K >= self.micro_batches:
            return self._settle(out, K, f"all forwards first (advance {K} = M): nothing further to raise")
        predicted = {f["rank"]: int(peak[f["rank"]] + self._growth.get(f["rank"], 0.0) *
                                    (f["in_flight_next"] - f["in_flight"])) for f in figs}
        out["predicted_next_peak_bytes"] = {str(r): p for r, p in predicted.items()}
        too = [r for r in predicted if limit[r] is not None and predicted[r] > limit[r]]
        if too:
            r = too[0]
            return self._settle(out, K, f"memory: advance {K + 1} would peak at about {predicted[r]} bytes on rank "
                                        f"{r}, over its limit {limit[r]}; staying at {K}")
        return self._decide(out, K + 1, "raise", f"{'faster' if K else 'measured'}: {T:.4f} s with advance {K}; "
                                                 f"trying {K + 1}")

    def _settle(self, out: dict, k: int, reason: str) -> dict:
        self.settled, self.reason = True, reason
        return self._decide(out, k, "settle", reason)

    def _decide(self, out: dict, k: int, action: str, reason: str) -> dict:
        self.advance = k
        out.update(next_advance=k, action=action, reason=reason)
        return out


def adapt_segment(tuner: AdvanceTuner, engine, control, batches, step: int, on_step=None) -> dict:
    """Train step ``step`` alone with the tuner's advance, let the ranks agree on the next one (a collective over
    ``control``: every rank calls it), and hand the step's log record to ``on_step`` with the decision in it."""
    engine.cfg.advance = tuner.advance
    held: list[dict] = []
    records = engine.run(batches, 1, on_step=held.append if on_step is not None else None, step_offset=step)
    mine = tuner.figures(engine, records[-1] if records else None)
    figures = control.all_gather(mine) if control is not None else [mine]
    decision = tuner.observe(figures, step)
    engine.cfg.advance = tuner.advance
    for rec in held:
        on_step({**rec, "advance": decision["advance"], "advance_tuning": decision})
    return decision
