"""Pipeline schedules as per-stage programs with explicit weight versions.

A schedule is, for every stage, a fixed sequence of tasks: ``F(k)`` (forward
of micro-batch ``k``), ``B(k)`` (its backward) and ``U(j)`` (the optimizer
update closing step ``j``). A rank runs each of its stages' programs in order
and switches between its stages as data arrives (dataflow), so the *order*
within a stage is fixed while the interleaving of stages is not.

What each schedule means for training is which **weight version** every
forward and backward uses: version ``t`` is a stage's weights after ``t``
updates. :func:`stage_program` states both explicitly, so the multi-process
engine and the single-process reference (:mod:`~ftcompile.runtime.reference`)
implement the same semantics from the same table:

========== ============================ ============================ ===========
schedule   forward of step ``j`` uses    backward uses                recomputes
========== ============================ ============================ ===========
gpipe      ``j``                         ``j``                        optional
1f1b       ``j``                         ``j``                        optional
async      the newest when it runs       the newest when it runs      all but the last stage
pipedream  the newest when it runs       the forward's (stashed)      no
2bw        ``max(j-1, 0)``               ``max(j-1, 0)``              optional
2gw        G0: ``max(j-1, 0)``, G1: ``j`` same as forward               optional
========== ============================ ============================ ===========

Versions count from the start of a run segment (a run, or the stretch between
two checkpoints), every segment starts with a filled-and-drained pipeline, and
every stage updates once per step: gradients of a step's ``M`` micro-batches
are accumulated (the loss of each is scaled by ``1/M``). ``async`` with
``M = 1`` is FTPipe's update per micro-batch.

Orders: ``gpipe`` all forwards then all backwards per step; ``1f1b``
PipeDream-flush (``depth`` warm-up forwards, then one forward one backward,
a flush per step); ``async``, ``pipedream`` and ``2bw`` the same one-forward-
one-backward order without flushes (FTPipe Fig. 5; PipeDream; PipeDream-2BW);
``2gw`` (WPipe §3.2) runs G1 stages like ``1f1b`` and moves G0's forwards of
step ``j+1`` ahead of its backwards of step ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "async", "pipedream", "2bw", "2gw")
SYNCHRONOUS = ("gpipe", "1f1b")


class ScheduleError(ValueError):
    """A schedule cannot run with these settings; the message says which to change."""


@dataclass(frozen=True)
class Task:
    kind: str       # "F", "B" or "U"
    index: int      # micro-batch for F and B (0-based within the segment), step for U

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


@dataclass
class StageProgram:
    """One stage's tasks in order, and the weight version each forward and backward uses."""

    stage: int
    schedule: str
    tasks: list[Task]
    forward_version: dict[int, int]
    backward_version: dict[int, int]
    recompute: bool                   # forward keeps no activations; backward runs it again
    group: int = 0                    # 2gw: 0 or 1
    version_uses: dict[int, int] = field(init=False)      # version -> tasks that use it
    spans_update: frozenset[int] = field(init=False)      # micro-batches with an update between F and B

    def __post_init__(self):
        uses: dict[int, int] = {}
        updates, updates_at_forward, spans = 0, {}, set()
        for t in self.tasks:
            if t.kind == "U":
                updates += 1
                continue
            if t.kind == "F":
                v = self.forward_version[t.index]
                updates_at_forward[t.index] = updates
            else:
                v = self.backward_version[t.index]
                if updates > updates_at_forward.get(t.index, updates):
                    spans.add(t.index)
            uses[v] = uses.get(v, 0) + 1
        self.version_uses = uses
        self.spans_update = frozenset(spans)

    def staleness(self, k: int) -> int:
        """Updates between micro-batch ``k``'s forward weights and its backward weights."""
        return self.backward_version[k] - self.forward_version[k]


def _order_flush(kind: str, depth: int, micro_batches: int, steps: int) -> list[Task]:
    tasks: list[Task] = []
    M = micro_batches
    for j in range(steps):
        ks = list(range(j * M, (j + 1) * M))
        if kind == "gpipe":
            tasks += [Task("F", k) for k in ks] + [Task("B", k) for k in ks]
        else:   # 1f1b: PipeDream-flush
            warm = min(depth, M)
            tasks += [Task("F", k) for k in ks[:warm]]
            for i, k in enumerate(ks):
                if warm + i < M:
                    tasks.append(Task("F", ks[warm + i]))
                tasks.append(Task("B", k))
        tasks.append(Task("U", j))
    return tasks


def _order_continuous(depth: int, micro_batches: int, steps: int) -> list[Task]:
    # depth + 1 forwards fill the pipeline, then one backward and one forward
    # alternate; the update of step j follows the backward of its last micro-batch.
    n = micro_batches * steps
    warm = min(depth + 1, n)
    tasks = [Task("F", k) for k in range(warm)]
    for k in range(n):
        tasks.append(Task("B", k))
        if (k + 1) % micro_batches == 0:
            tasks.append(Task("U", k // micro_batches))
        if k + warm < n:
            tasks.append(Task("F", k + warm))
    return tasks


def _order_2gw_g0(depth: int, micro_batches: int, steps: int) -> list[Task]:
    # WPipe Fig. 4b: the forwards of step j+1 run before the backwards of step j.
    M = micro_batches
    tasks = [Task("F", k) for k in range(M)]
    for j in range(steps):
        if j + 1 < steps:
            tasks += [Task("F", k) for k in range((j + 1) * M, (j + 2) * M)]
        tasks += [Task("B", k) for k in range(j * M, (j + 1) * M)]
        tasks.append(Task("U", j))
    return tasks


def _scan_versions(tasks: list[Task]) -> tuple[dict[int, int], dict[int, int]]:
    """The newest version at each task: the number of updates before it in the program."""
    fv, bv, done = {}, {}, 0
    for t in tasks:
        if t.kind == "U":
            done += 1
        elif t.kind == "F":
            fv[t.index] = done
        else:
            bv[t.index] = done
    return fv, bv


def groups_2gw(depths: dict[int, int]) -> dict[int, int]:
    """WPipe groups by stage: the upstream half of the pipeline (larger depth) is G0, the rest G1.

    A producer is always deeper than its consumers, so data flows from G0 to G1,
    never back.
    """
    top = max(depths.values(), default=0)
    return {s: 0 if 2 * d > top else 1 for s, d in depths.items()}


def stage_program(schedule: str, stage: int, *, depth: int, micro_batches: int, steps: int,
                  last: bool = False, recompute: bool | None = None, group: int = 0,
                  pipeline_depth: int | None = None) -> StageProgram:
    """The program of one stage.

    Args:
        schedule: one of :data:`SCHEDULES`.
        stage: the stage id (for messages only).
        depth: the stage's distance in stages to the end of the pipeline (0: last).
        micro_batches: ``M``, micro-batches per step (per update).
        steps: steps in this segment.
        last: the stage computes the loss (``async`` never recomputes it).
        recompute: recompute in backward instead of keeping activations, for the
            schedules where it is optional; ``None`` is no. Ignored by ``async``
            (always, but the last stage) and ``pipedream`` (never).
        group: the 2gw group (see :func:`groups_2gw`).
        pipeline_depth: the deepest stage's depth, to check that ``2bw`` and ``2gw``
            can keep to two weight versions.

    Raises:
        ScheduleError: unknown schedule, or ``M`` too small for ``2bw``/``2gw``.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if micro_batches < 1 or steps < 1:
        raise ScheduleError(f"need at least one micro-batch and one step (got M={micro_batches}, steps={steps})")
    M = micro_batches
    deepest = depth if pipeline_depth is None else pipeline_depth
    if schedule in ("2bw", "2gw") and deepest > M:
        raise ScheduleError(f"{schedule} keeps two weight versions only when the micro-batches per step "
                            f"(M={M}) are at least the pipeline depth ({deepest}); raise --micro-batches "
                            f"to {deepest} or more")
    step_of = lambda k: k // M  # noqa: E731
    if schedule in SYNCHRONOUS:
        tasks = _order_flush(schedule, depth, M, steps)
        fv = bv = {k: step_of(k) for k in range(M * steps)}
        rc = bool(recompute)
    elif schedule == "async":
        tasks = _order_continuous(depth, M, steps)
        fv, bv = _scan_versions(tasks)
        rc = not last
    elif schedule == "pipedream":
        tasks = _order_continuous(depth, M, steps)
        fv, _ = _scan_versions(tasks)
        bv = dict(fv)
        rc = False
    elif schedule == "2bw":
        tasks = _order_continuous(depth, M, steps)
        fv = bv = {k: max(step_of(k) - 1, 0) for k in range(M * steps)}
        rc = bool(recompute)
    else:   # 2gw
        if group == 0:
            tasks = _order_2gw_g0(depth, M, steps)
            fv = bv = {k: max(step_of(k) - 1, 0) for k in range(M * steps)}
        else:
            tasks = _order_flush("1f1b", depth, M, steps)
            fv = bv = {k: step_of(k) for k in range(M * steps)}
        rc = bool(recompute)
    prog = StageProgram(stage, schedule, tasks, dict(fv), dict(bv), rc, group)
    check_program(prog)
    return prog


def check_program(prog: StageProgram) -> None:
    """Every version a task uses exists when the task runs (no weights from the future)."""
    done = 0
    for t in prog.tasks:
        if t.kind == "U":
            done += 1
            continue
        v = prog.forward_version[t.index] if t.kind == "F" else prog.backward_version[t.index]
        if v > done:
            raise ScheduleError(f"stage {prog.stage}: {t} would need weight version {v} after only {done} "
                                f"updates under {prog.schedule}")

