"""Pipeline schedules: the one definition of every stage's task order, weight versions and memory.

A schedule is, for every stage, a fixed sequence of tasks: ``F(k)`` (forward
of micro-batch ``k``), ``B(k)`` (its backward; a stage that recomputes runs
its forward again inside this task) and ``U(j)`` (the optimizer update closing
step ``j``). A rank runs each of its stages' programs in order and switches
between its stages as data arrives (dataflow), so the *order* within a stage
is fixed while the interleaving of stages is not.

This module is the only place that says what a schedule does. The
multi-process engine (:mod:`~ftcompile.runtime.engine`) runs these programs,
the single-process reference (:mod:`~ftcompile.runtime.reference`) trains with
their weight versions, and the compiler's cost model and simulator
(``ftcompile.plan``, ``ftcompile.simulate``) replay them and take from them
what a stage holds: micro-batches in flight, extra weight versions, whether it
recomputes.

What each schedule means for training is which **weight version** every
forward and backward uses: version ``t`` is a stage's weights after ``t``
updates.

========== ============================ ============================ ===========
schedule   forward of step ``j`` uses    backward uses                recomputes
========== ============================ ============================ ===========
gpipe      ``j``                         ``j``                        optional
1f1b       ``j``                         ``j``                        optional
async      the newest when it runs       the newest when it runs      yes
pipedream  the newest when it runs       the forward's (stashed)      no
2bw        ``max(j-1, 0)``               ``max(j-1, 0)``              optional
2gw        G0: ``max(j-1, 0)``, G1: ``j`` same as forward               optional
========== ============================ ============================ ===========

A stage whose every ``B(k)`` directly follows its ``F(k)`` (the end of a
1F1B-ordered pipeline: FTPipe's last stage) never recomputes: it holds one
micro-batch's activations only, and no update falls between its forward and
backward. That is the one rule for "the last stage" (:func:`stage_program`).

Versions count from the start of a run segment (a run, or the stretch between
two checkpoints); every segment starts with a filled-and-drained pipeline, and
every stage updates once per step: gradients of a step's ``M`` micro-batches
are accumulated (the loss of each is scaled by ``1/M``). ``async`` with
``M = 1`` is FTPipe's update per micro-batch.

Orders: ``gpipe`` all forwards then all backwards per step; ``1f1b``
PipeDream-flush (``depth`` warm-up forwards, then one forward one backward,
a flush per step); ``async``, ``pipedream`` and ``2bw`` the same one-forward-
one-backward order without flushes (FTPipe Fig. 5; PipeDream; PipeDream-2BW),
whose ``depth + 1`` warm-up forwards an in-flight scale ``s`` stretches to
``s * depth + 1`` (for plans whose GPUs hold many stages; more memory for
inputs or stashes, and in ``async`` and ``pipedream`` staler weights);
``2gw`` (WPipe §3.2) runs G1 stages like ``1f1b`` and moves G0's forwards of
step ``j+1`` ahead of its backwards of step ``j``.

Shared (tied) tensors: every stage holding one sums all holders' gradients
before its update, so the copies stay equal. With a flush per step that costs
nothing; without one, the holder deepest in the pipeline (a language model's
head, tied to the embedding) would idle at every ``U(j)`` until the step's
last backward reached the first holder. So the schedules without a flush
**lag** shared tensors by one step (:func:`shared_lag`): every holder applies
at ``U(j)`` the summed gradient of step ``j - 1`` (none at the first update of
a run), and keeps the sum of the segment's last step for the next segment
(checkpoints carry it), so the trajectory does not depend on where segments
end. Clipping or skipping non-finite steps exchanges the global gradient norm
at every update, a wait of its own, so no lag then.

Programs are generated lazily: a stage's program for a million steps costs
no more memory than for one. Weight versions come from closed forms.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterator

SCHEDULES = ("gpipe", "1f1b", "async", "pipedream", "2bw", "2gw", "avgpipe")
#: Schedules with a flush per step: every forward and backward of step j uses version j.
SYNCHRONOUS = ("gpipe", "1f1b", "avgpipe")
#: Schedules in the one-forward-one-backward order without flushes, whose warm-up the in-flight
#: scale stretches (:attr:`StageProgram.in_flight_scale`).
CONTINUOUS = ("async", "pipedream", "2bw")
#: Schedules where recomputation is the user's choice (``--recompute``).
OPTIONAL_RECOMPUTE = ("gpipe", "1f1b", "2bw", "2gw", "avgpipe")


def exchanges_norms(clip_grad_norm: float | None, on_nonfinite: str) -> bool:
    """Whether every update first waits for a value of all stages: the global gradient norm
    (clipping) or every stage's finite check (``on_nonfinite="skip"``). The engine, the reference
    and the compiler's cost model (:attr:`ftcompile.plan.Problem.exchanges_norms`) all ask here."""
    return bool(clip_grad_norm) or on_nonfinite == "skip"


def shared_lag(schedule: str, exchanges_norms: bool = False, tied_lag: bool = True) -> int:
    """Steps by which every holder of a shared tensor applies its summed gradient late: 1 for the
    schedules without a flush per step (see the module docstring), 0 with a flush, when each
    update exchanges the global gradient norm anyway (``exchanges_norms``: clipping, skipping
    non-finite steps), which waits for every stage, or when the lag is turned off (``tied_lag``
    False: ``--no-tied-lag``, for a plan that cannot hold the lag's extra gradients)."""
    return 0 if schedule in SYNCHRONOUS or exchanges_norms or not tied_lag else 1


class ScheduleError(ValueError):
    """A schedule cannot run with these settings; the message says which to change."""


@dataclass(frozen=True)
class Task:
    kind: str       # "F", "B" or "U"
    index: int      # micro-batch for F and B (0-based within the segment), step for U

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


# --------------------------------------------------------------------------- orders

def _order_flush(kind: str, depth: int, M: int, steps: int, advance=0) -> Iterator[Task]:
    for j in range(steps):
        ks = range(j * M, (j + 1) * M)
        if kind == "gpipe":
            for k in ks:
                yield Task("F", k)
            for k in ks:
                yield Task("B", k)
        else:   # 1f1b: PipeDream-flush; avgpipe: ``advance`` more forwards before the first backward
            a = advance(j) if callable(advance) else advance
            warm = min(depth + a, M)
            for k in ks[:warm]:
                yield Task("F", k)
            for i, k in enumerate(ks):
                if warm + i < M:
                    yield Task("F", ks[warm + i])
                yield Task("B", k)
        yield Task("U", j)


def _warm(depth: int, M: int, steps: int, scale: int = 1) -> int:
    """Forwards before the first backward in the continuous order: ``scale * depth + 1`` (see
    :attr:`StageProgram.in_flight_scale`), at most the segment's micro-batches."""
    return min(scale * depth + 1, M * steps)


def _order_continuous(depth: int, M: int, steps: int, scale: int = 1) -> Iterator[Task]:
    # depth + 1 forwards (scale * depth + 1) fill the pipeline, then one backward and one forward
    # alternate; the update of step j follows the backward of its last micro-batch.
    n = M * steps
    warm = _warm(depth, M, steps, scale)
    for k in range(warm):
        yield Task("F", k)
    for k in range(n):
        yield Task("B", k)
        if (k + 1) % M == 0:
            yield Task("U", k // M)
        if k + warm < n:
            yield Task("F", k + warm)


def _order_2gw_g0(M: int, steps: int) -> Iterator[Task]:
    # WPipe Fig. 4b: the forwards of step j+1 run before the backwards of step j.
    for k in range(M):
        yield Task("F", k)
    for j in range(steps):
        if j + 1 < steps:
            for k in range((j + 1) * M, (j + 2) * M):
                yield Task("F", k)
        for k in range(j * M, (j + 1) * M):
            yield Task("B", k)
        yield Task("U", j)


def groups_2gw(depths: dict[int, int]) -> dict[int, int]:
    """WPipe groups by stage: the upstream half of the pipeline (larger depth) is G0, the rest G1.

    A producer is always deeper than its consumers, so data flows from G0 to G1,
    never back.
    """
    top = max(depths.values(), default=0)
    return {s: 0 if 2 * d > top else 1 for s, d in depths.items()}


# --------------------------------------------------------------------------- programs

@dataclass(frozen=True)
class StageProgram:
    """One stage's tasks in order, the weight version each forward and backward uses, and what the
    stage holds because of them.

    ``tasks()`` generates the order lazily. ``forward_version(k)`` /
    ``backward_version(k)`` are the weight versions micro-batch ``k`` uses;
    ``updates_before_forward(k)`` / ``updates_before_backward(k)`` count the
    updates the program has run when ``F(k)`` / ``B(k)`` start (the newest
    version then).
    """

    stage: int
    schedule: str
    depth: int
    micro_batches: int
    steps: int
    group: int = 0                    # 2gw: 0 or 1
    recompute_option: bool = False    # --recompute, for the schedules where it is optional
    # avgpipe: micro-batches forwarded in advance of 1F1B's warm-up (AvgPipe Algorithm 1): 0 is
    # 1F1B, M or more is all-forward-all-backward. A callable gives it per step (tuned as it runs);
    # memory figures then assume ``advance_max``.
    advance: int = 0
    advance_fn: object = field(default=None, compare=False, hash=False, repr=False)
    # async, pipedream, 2bw: ``in_flight_scale * depth + 1`` forwards before the first backward (1:
    # FTPipe's and PipeDream's depth + 1). A plan whose GPUs hold many stages each needs more: every
    # hop of a micro-batch's round trip waits behind the other stages on its GPU, and the pipeline
    # runs at its balance only when the micro-batches in flight cover that round trip (Little's law).
    in_flight_scale: int = 1

    # ---- order
    def tasks(self) -> Iterator[Task]:
        s, d, M, n = self.schedule, self.depth, self.micro_batches, self.steps
        if s == "avgpipe":
            return _order_flush("1f1b", d, M, n, self.advance_fn or self.advance)
        if s in SYNCHRONOUS:
            return _order_flush(s, d, M, n)
        if s == "2gw":
            return _order_2gw_g0(M, n) if self.group == 0 else _order_flush("1f1b", d, M, n)
        return _order_continuous(d, M, n, self.in_flight_scale)

    def __iter__(self) -> Iterator[Task]:
        return self.tasks()

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches * self.steps

    # ---- versions (closed forms of the orders above; tests check them against the orders)
    def updates_before_forward(self, k: int) -> int:
        M, j = self.micro_batches, k // self.micro_batches
        if self._continuous:
            return max(0, k - _warm(self.depth, M, self.steps, self.in_flight_scale) + 1) // M
        if self._g0:
            return max(0, j - 1)
        return j

    def updates_before_backward(self, k: int) -> int:
        return k // self.micro_batches

    def forward_version(self, k: int) -> int:
        s, j = self.schedule, k // self.micro_batches
        if s in ("async", "pipedream"):
            return self.updates_before_forward(k)
        if s == "2bw" or self._g0:
            return max(j - 1, 0)
        return j

    def backward_version(self, k: int) -> int:
        s = self.schedule
        if s == "async":
            return self.updates_before_backward(k)
        return self.forward_version(k)

    def staleness(self, k: int) -> int:
        """Updates between micro-batch ``k``'s forward weights and its backward weights."""
        return self.backward_version(k) - self.forward_version(k)

    def spans_update(self, k: int) -> bool:
        """An update runs between ``F(k)`` and ``B(k)``."""
        return self.updates_before_backward(k) > self.updates_before_forward(k)

    @property
    def _continuous(self) -> bool:
        return self.schedule in CONTINUOUS

    @property
    def _g0(self) -> bool:
        return self.schedule == "2gw" and self.group == 0

    # ---- what the stage holds
    @property
    def adjacent(self) -> bool:
        """Every ``B(k)`` directly follows ``F(k)``: the end of a 1F1B pipeline."""
        return _shape(self.schedule, self.depth, self.micro_batches, self.group, None, self.advance,
                      self.in_flight_scale)[0]

    @property
    def recompute(self) -> bool:
        """Whether the forward keeps only its inputs and the backward runs it again.

        ``async`` always recomputes (FTPipe §4.3: the backward uses the newest weights),
        ``pipedream`` never (it stashes), the others when asked; a stage whose backward
        directly follows its forward never does: it would only repeat work.
        """
        if self.adjacent:
            return False
        if self.schedule == "async":
            return True
        return self.schedule in OPTIONAL_RECOMPUTE and self.recompute_option

    @property
    def in_flight(self) -> int:
        """The most micro-batches whose forward has run and whose backward has not."""
        return _shape(self.schedule, self.depth, self.micro_batches, self.group, None, self.advance,
                      self.in_flight_scale)[1]

    @property
    def extra_weight_versions(self) -> int:
        """The most weight copies the stage keeps beside its live weights (stashes, and the copies a
        forward kept across an update runs on); see :func:`needs_version`."""
        return _shape(self.schedule, self.depth, self.micro_batches, self.group, self.recompute, self.advance,
                      self.in_flight_scale)[2]


def needs_version(prog: StageProgram, version: int, next_forward: int | None, oldest_pending: int | None) -> bool:
    """Whether a stage still needs weight version ``version``: the next forward to run
    (``next_forward``, a micro-batch, or None when none is left) or the oldest micro-batch whose
    backward has not run (``oldest_pending``) uses it or an older one.

    Versions grow with the micro-batch index for forwards and for backwards, so no later task
    needs ``version`` once both have passed it. The engine drops a stash by this rule, and
    :attr:`StageProgram.extra_weight_versions` counts copies by it.
    """
    if next_forward is not None and prog.forward_version(next_forward) <= version:
        return True
    return oldest_pending is not None and prog.backward_version(oldest_pending) <= version


@functools.lru_cache(maxsize=4096)
def _shape(schedule: str, depth: int, M: int, group: int, recompute: bool | None = None,
           advance: int = 0, scale: int = 1) -> tuple[bool, int, int]:
    """``(adjacent, in_flight, extra weight versions)`` of a stage, by replaying its program over enough
    steps to pass the warm-up (the programs are periodic after it)."""
    # Every micro-batch in flight can carry its own version once 2 (scale * depth + 1) micro-batches ran.
    steps = (2 * scale * depth + 2) // M + 4
    prog = StageProgram(-1, schedule, depth, M, steps, group, advance=advance, in_flight_scale=scale)
    rc = recompute if recompute is not None else False
    adjacent, last_f = True, None
    pending: list[int] = []           # micro-batches between F and B, oldest first
    in_flight = 0
    live = 0
    stash: set[int] = set()           # versions with a copy, as the engine keeps them (see needs_version)
    extra = 0
    next_f = 0
    n = prog.num_micro_batches
    for t in prog.tasks():
        if t.kind == "F":
            if last_f is not None:
                adjacent = False      # two forwards in a row (or a forward after a pending one)
            last_f = t.index
            pending.append(t.index)
            in_flight = max(in_flight, len(pending))
            next_f = t.index + 1
            if not rc and prog.spans_update(t.index) and prog.forward_version(t.index) == live:
                stash.add(live)       # runs on a copy so the update cannot change what B reads
        elif t.kind == "B":
            if last_f != t.index:
                adjacent = False
            last_f = None
            pending.remove(t.index)
        else:
            if needs_version(prog, live, next_f if next_f < n else None, pending[0] if pending else None):
                stash.add(live)
            live += 1
        extra = max(extra, len(stash))
        # drop what no later task needs
        for v in [v for v in stash if not needs_version(prog, v, next_f if next_f < n else None,
                                                         pending[0] if pending else None)]:
            stash.discard(v)
    if recompute is None:
        return adjacent, in_flight, 0
    return adjacent, in_flight, extra


def stage_program(schedule: str, stage: int, *, depth: int, micro_batches: int, steps: int,
                  recompute: bool | None = None, group: int = 0,
                  pipeline_depth: int | None = None, advance: int = 0, advance_fn=None,
                  in_flight_scale: int = 1) -> StageProgram:
    """The program of one stage.

    Args:
        schedule: one of :data:`SCHEDULES`.
        stage: the stage id (for messages only).
        depth: the stage's distance in stages to the end of the pipeline (0: a sink).
        micro_batches: ``M``, micro-batches per step (per update).
        steps: steps in this segment.
        recompute: recompute in backward instead of keeping activations, for the
            schedules where it is optional; ``None`` is no. ``async`` always
            recomputes and ``pipedream`` never; see :attr:`StageProgram.recompute`.
        group: the 2gw group (see :func:`groups_2gw`).
        pipeline_depth: the deepest stage's depth, to check that ``2bw`` and ``2gw``
            can keep to two weight versions.
        advance: ``avgpipe``: forwards run in advance of 1F1B's warm-up (the most, when
            ``advance_fn(step)`` chooses it per step).
        in_flight_scale: ``async``, ``pipedream``, ``2bw``: forwards before the first backward
            are ``in_flight_scale * depth + 1`` (see :attr:`StageProgram.in_flight_scale`); the
            other schedules ignore it.

    Raises:
        ScheduleError: unknown schedule, or ``M`` too small for ``2bw``/``2gw``.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if micro_batches < 1 or steps < 1:
        raise ScheduleError(f"need at least one micro-batch and one step (got M={micro_batches}, steps={steps})")
    if isinstance(in_flight_scale, bool) or not isinstance(in_flight_scale, int) or in_flight_scale < 1:
        raise ScheduleError(f"the in-flight scale must be a whole number of at least 1, got {in_flight_scale!r}")
    scale = in_flight_scale if schedule in CONTINUOUS else 1
    deepest = scale * (depth if pipeline_depth is None else pipeline_depth)
    if schedule in ("2bw", "2gw") and deepest > micro_batches:
        more = f" times the in-flight scale {scale}" if scale > 1 else ""
        raise ScheduleError(f"{schedule} keeps two weight versions only when the micro-batches per step "
                            f"(M={micro_batches}) are at least the pipeline depth{more} ({deepest}); raise "
                            f"--micro-batches to {deepest} or more" + (" or lower --in-flight-scale" if scale > 1 else ""))
    if advance < 0:
        raise ScheduleError(f"the micro-batches forwarded in advance must be at least 0, got {advance}")
    return StageProgram(stage, schedule, depth, micro_batches, steps, group if schedule == "2gw" else 0,
                        bool(recompute), advance if schedule == "avgpipe" else 0,
                        advance_fn if schedule == "avgpipe" else None, scale)


def stage_programs(schedule: str, depths: dict[int, int], *, micro_batches: int, steps: int,
                   recompute: bool | None = None, advance: int = 0, advance_fn=None,
                   in_flight_scale: int = 1) -> dict[int, StageProgram]:
    """Every stage's program, from the stages' depths (stage id -> depth)."""
    groups = groups_2gw(depths)
    deepest = max(depths.values(), default=0)
    return {s: stage_program(schedule, s, depth=d, micro_batches=micro_batches, steps=steps, recompute=recompute,
                             group=groups[s], pipeline_depth=deepest, advance=advance, advance_fn=advance_fn,
                             in_flight_scale=in_flight_scale)
            for s, d in depths.items()}


def flow_window(producer: StageProgram, reader_depth: int) -> int:
    """The most micro-batches of a producer's values a reader at ``reader_depth`` may hold unconsumed.

    In the one-forward-one-backward orders (1f1b, async, pipedream, 2bw, 2gw's G1) a reader
    ``d = depth(p) - depth(c)`` stages downstream takes micro-batch ``k - d`` right after its
    backward of ``k - depth(p) - 1``, which precedes the producer's backward of that micro-batch
    and so the producer's ``F(k)``: ``d + 1`` never holds the producer back in steady state.
    With an in-flight scale ``s`` the reader takes ``k - s d`` by then, so the window is
    ``s d + 1``. A narrower one would throttle the producer, and that can deadlock: a holder of
    a tied tensor waits at its update for the producer's backwards, which wait behind the
    throttled forward, which waits for a reader downstream of that holder (GPT-2's embedding
    feeding every block; found in simulation).
    Orders that run a whole step's forwards ahead (gpipe, 2gw's G0) get the producer's own
    in-flight count, which its schedule keeps anyway.
    """
    if producer.schedule == "gpipe" or producer._g0:
        return producer.in_flight
    # avgpipe's forwards in advance run that much further ahead of the reader
    scale = producer.in_flight_scale
    return min(producer.in_flight, max(1, scale * (producer.depth - reader_depth) + 1 + producer.advance))


def flow_control(edges: dict[tuple[int, int], bool], in_flight: dict[int, int],
                 windows: dict[tuple[int, int], int] | None = None) -> dict[tuple[int, int], tuple[int, bool]]:
    """The flow control of a pipeline: per edge ``(producer, reader)`` that carries tensors, ``(W, credits)``.

    A producer runs ``F(k)`` only when the reader has taken micro-batch ``k - W``, so at most
    ``W`` micro-batches of the edge's values wait for the reader. ``W`` is ``windows[edge]``
    when given (a plan may ask for less), else the micro-batches the producer keeps in flight
    (``in_flight[producer]``). ``edges[edge]`` says whether gradients come back over the edge;
    ``credits`` whether the reader must tell the producer what it took. It need not when
    gradients come back and ``W`` is no tighter than the producer's own schedule keeps it: the
    producer's ``F(k)`` follows its ``B(k - W)``, which waits for the reader's ``B(k - W)``,
    which follows the reader's ``F(k - W)``. Where no gradient comes back (masks and positions
    made from the input), nothing else would stop a producer from running ahead.
    """
    out = {}
    for (p, c), returns in edges.items():
        own = in_flight[p]
        w = max(1, (windows or {}).get((p, c), own))
        out[(p, c)] = (w, not (returns and w >= own))
    return out


def check_program(prog: StageProgram) -> None:
    """Every version a task uses exists when the task runs (no weights from the future), and the
    closed-form version counts agree with the order."""
    done = 0
    for t in prog.tasks():
        if t.kind == "U":
            if t.index != done:
                raise ScheduleError(f"stage {prog.stage}: U{t.index} out of order under {prog.schedule}")
            done += 1
            continue
        v = prog.forward_version(t.index) if t.kind == "F" else prog.backward_version(t.index)
        newest = prog.updates_before_forward(t.index) if t.kind == "F" else prog.updates_before_backward(t.index)
        if newest != done:
            raise ScheduleError(f"stage {prog.stage}: {t} runs after {done} updates under {prog.schedule}, "
                                f"but the closed form says {newest} (a schedule bug)")
        if v > done:
            raise ScheduleError(f"stage {prog.stage}: {t} would need weight version {v} after only {done} "
                                f"updates under {prog.schedule}")
