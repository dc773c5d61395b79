"""Per-stage task programs and weight-version semantics of the pipeline schedules.

A stage runs a fixed *program*: a list of :class:`Task` ``F(k)`` (forward of
micro-batch ``k``), ``B(k)`` (backward, preceded by a recomputation when the
stage recomputes) and ``U(j)`` (optimizer step closing mini-batch ``j``). The
orders are those of :func:`ftcompile.simulate.stage_program` (ported here: the
runtime never imports the compiler), with the update tasks made explicit.

Because every stage follows a fixed program and updates at fixed places in it,
the weight version each task uses is a property of the schedule, not of timing.
:func:`stage_schedule` returns it as two tables ``version_f[k]`` and
``version_b[k]`` (``v`` = the weights after ``v`` updates), which the engine
obeys and :mod:`ftcompile.runtime.reference` replays in one process:

=============  ===========================  ==============================  ============
schedule       forward of mini-batch ``j``  backward                        recompute
=============  ===========================  ==============================  ============
gpipe, 1f1b    ``j``                        ``j``                           optional
async (FTPipe) updates before ``F(k)``      ``j`` (current; Table 1)        all but last
pipedream      updates before ``F(k)``      same as forward (stashed)       optional
2bw            ``max(0, j - 1)``            same (two versions)             optional
2gw  G0        ``max(0, j - 1)``            same (two versions)             optional
2gw  G1        ``j``                        ``j`` (flush per mini-batch)    optional
=============  ===========================  ==============================  ============

A stage that does not recompute keeps the forward's autograd graph, so its
backward necessarily uses the forward's version; for ``async`` that is the last
stage, whose ``F(k)``/``B(k)`` are adjacent anyway (depth 0, one in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "async", "pipedream", "2bw", "2gw")
FLUSHING = ("gpipe", "1f1b")


class ScheduleError(ValueError):
    """The schedule cannot run this pipeline (unknown name, or too few micro-batches)."""


@dataclass(frozen=True)
class Task:
    kind: str   # "F" | "B" | "U"
    index: int  # micro-batch for F/B (global: step * M + i), mini-batch for U


@dataclass
class StageSchedule:
    """What one stage runs and with which weights."""

    stage: int
    program: list[Task]
    recompute: bool                 # B(k) reruns the forward (F(k) keeps no activations)
    version_f: dict[int, int]       # micro-batch -> weight version its forward uses
    version_b: dict[int, int]       # micro-batch -> weight version its backward uses
    group: int = 0                  # 2gw: 0 or 1
    extra: dict = field(default_factory=dict)


def task_order(schedule: str, depth: int, micro_batches: int, steps: int, *,
               group0: bool = False) -> list[tuple[str, int]]:
    """``(kind, micro-batch)`` order of one stage's forwards and backwards.

    Same orders as :func:`ftcompile.simulate.stage_program` (see its docstring),
    except ``2gw``'s G0 stages warm up with exactly ``M`` forwards (WPipe: G0
    holds ``M`` micro-batches in flight), which keeps G0 at two weight versions
    at any G0 depth.
    """
    M = micro_batches
    total = M * steps

    def one_f_one_b(ks: list[int], warm: int) -> list[tuple[str, int]]:
        warm = min(warm, len(ks))
        out = [("F", k) for k in ks[:warm]]
        for i, k in enumerate(ks):
            out.append(("B", k))
            if warm + i < len(ks):
                out.append(("F", ks[warm + i]))
        return out

    if schedule == "gpipe":
        prog = []
        for s in range(steps):
            ks = list(range(s * M, (s + 1) * M))
            prog += [("F", k) for k in ks] + [("B", k) for k in ks]
        return prog
    if schedule == "1f1b" or (schedule == "2gw" and not group0):
        prog = []
        for s in range(steps):
            prog += one_f_one_b(list(range(s * M, (s + 1) * M)), depth + 1)
        return prog
    if schedule in ("async", "pipedream", "2bw"):
        return one_f_one_b(list(range(total)), depth + 1)
    if schedule == "2gw":
        return one_f_one_b(list(range(total)), M)
    raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def with_updates(order: list[tuple[str, int]], micro_batches: int) -> list[Task]:
    """Insert ``U(j)`` right after the last backward of mini-batch ``j``."""
    M = micro_batches
    left: dict[int, int] = {}
    for kind, k in order:
        if kind == "B":
            left[k // M] = left.get(k // M, 0) + 1
    prog: list[Task] = []
    for kind, k in order:
        prog.append(Task(kind, k))
        if kind == "B":
            left[k // M] -= 1
            if left[k // M] == 0:
                prog.append(Task("U", k // M))
    return prog


def stage_schedule(schedule: str, stage: int, depth: int, micro_batches: int, steps: int, *,
                   is_last: bool, recompute: bool | None = None, group: int = 0) -> StageSchedule:
    """Program and weight-version tables of one stage (see the module table).

    ``is_last``: the stage computes the loss at depth 0 (it never recomputes under
    ``async``). ``recompute``: user choice for the other schedules (default off).
    Raises :class:`ScheduleError` where a schedule's version rule cannot hold
    (``2bw``: needs ``M >= depth + 1``).
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    M = micro_batches
    if schedule == "async":
        rec = not is_last
    else:
        rec = bool(recompute) and not is_last
    order = task_order(schedule, depth, M, steps, group0=(group == 0))
    prog = with_updates(order, M)
    done = 0
    at_f: dict[int, int] = {}
    at_b: dict[int, int] = {}
    for t in prog:
        if t.kind == "U":
            done += 1
        elif t.kind == "F":
            at_f[t.index] = done
        else:
            at_b[t.index] = done
    vf: dict[int, int] = {}
    vb: dict[int, int] = {}
    for k in at_f:
        j = k // M
        if schedule in FLUSHING or (schedule == "2gw" and group == 1):
            vf[k] = vb[k] = j
        elif schedule == "async":
            vf[k] = at_f[k]
            vb[k] = at_b[k] if rec else at_f[k]
        elif schedule == "pipedream":
            vf[k] = vb[k] = at_f[k]
        else:  # 2bw, 2gw G0: one delay term, uniform within a mini-batch
            vf[k] = vb[k] = max(0, j - 1)
            if vf[k] > at_f[k]:
                raise ScheduleError(
                    f"{schedule}: stage {stage} (depth {depth}) needs at least depth + 1 = {depth + 1} "
                    f"micro-batches per mini-batch for two weight versions, got {M}")
    return StageSchedule(stage, prog, rec, vf, vb, group)


def groups_2gw(stage_ids: list[int]) -> dict[int, int]:
    """WPipe grouping: the first half of the stages in topological order is G0, the rest G1.

    Stage ids of a package are topologically numbered, so sorting them is a
    topological order; same rule as :func:`ftcompile.plan.evaluate`.
    """
    ids = sorted(stage_ids)
    return {s: 0 if i < (len(ids) + 1) // 2 else 1 for i, s in enumerate(ids)}


def pipeline_schedules(schedule: str, stages: list[dict], micro_batches: int, steps: int, *,
                       loss_stage: int, recompute: bool | None = None) -> dict[int, StageSchedule]:
    """:func:`stage_schedule` for every stage; ``stages`` are manifest entries (``id``, ``depth``)."""
    grp = groups_2gw([s["id"] for s in stages])
    return {s["id"]: stage_schedule(schedule, s["id"], int(s["depth"]), micro_batches, steps,
                                    is_last=(s["id"] == loss_stage and int(s["depth"]) == 0),
                                    recompute=recompute, group=grp[s["id"]] if schedule == "2gw" else 0)
            for s in stages}


def priority(schedule: str, task: Task, depth: int, stage: int) -> tuple:
    """Which ready task a rank runs first (same rule as the simulator).

    Backward before forward, then the oldest micro-batch, then the stage nearer
    the end; GPipe takes the oldest micro-batch first. Updates go first: they
    only become ready when their stage's program reaches them.
    """
    if task.kind == "U":
        return (-1, task.index, depth, stage)
    rank = 0 if task.kind == "B" else 1
    if schedule == "gpipe":
        return (task.index, rank, depth, stage)
    return (rank, task.index, depth, stage)
