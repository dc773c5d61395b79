"""Which stages the pipeline paces, and which stage paces the others.

A stage is paced through the tensors it exchanges: its forward waits for its producers' values, and
flow control holds it back until its readers take what it sent. A weakly connected part of the stage
graph that no tensor links to the loss's stage is paced by nothing: a statistic of the batch the model
returns beside its loss, dead code, a BatchNorm's step counter. Left alone, the rank running it takes
its forwards as fast as it can and draws the data of every step it reaches, holding it until the rest
of the rank catches up (measured: a statistic's stage on 2 ranks, async, 12 steps: every step's batch
drawn before the first update, where the pipeline draws at most one step ahead).

The compiler ties each such part to the pipeline where they share a GPU
(:func:`ftcompile.plan.join_unpaced_stages`, which counts every value a part exchanges, sizes and
flags too, and joins one stage of it to a host of the stage's freeze level); the runtime paces the
parts it still gets (packages of hand-written plans, older packages, several GPUs' stages folded onto
one rank, a part linked to the pipeline only by a size or flag, which is never sent) by a stage of
the lead part on the same rank (:func:`pacers`), whatever its level; the simulator does as the
engine does with one rank per GPU. All three read the parts, the lead part and the choice of the
pacing stage from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def parts(stages: Iterable[int], links: Iterable[tuple[int, int]]) -> list[list[int]]:
    """The weakly connected parts of the graph on ``stages`` whose edges are ``links`` (pairs of
    stages; a pair naming a stage twice, or a stage not in ``stages``, is skipped), each part sorted,
    the parts in order of their first stage. One pass over ``links`` (union-find)."""
    parent = {s: s for s in stages}

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in links:
        if a != b and a in parent and b in parent:
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[ra] = rb
    groups: dict[int, list[int]] = {}
    for s in sorted(parent):
        groups.setdefault(root(s), []).append(s)
    return sorted(groups.values(), key=lambda p: p[0])


def lead_part(groups: list[list[int]], loss_stage: int | None, size: Mapping[int, int]) -> int:
    """The index in ``groups`` of the part the pipeline is: the one holding ``loss_stage``; without a
    loss, the part of the most op nodes (``size``: stage -> op nodes), ties to the first."""
    if loss_stage is not None:
        return next(i for i, p in enumerate(groups) if loss_stage in p)
    return max(range(len(groups)), key=lambda i: (sum(size[s] for s in groups[i]), -groups[i][0]))


def pacer(candidates: Iterable[int], depth: Mapping[int, int]) -> int | None:
    """The stage of ``candidates`` (stages of the lead part beside an unpaced stage) that paces it:
    the one nearest the end of the pipeline (lowest depth), then the lowest id; None if none."""
    return min(candidates, key=lambda s: (depth[s], s), default=None)


def pacers(stages: Mapping[int, int], links: Iterable[tuple[int, int]], depth: Mapping[int, int],
           loss_stage: int | None, size: Mapping[int, int]) -> dict[int, int]:
    """Per stage outside the lead part (:func:`lead_part`): the stage of the lead part on its rank
    that paces it (:func:`pacer`), where one is there. ``stages``: stage -> rank; ``links``: the
    stage pairs a tensor crosses between.

    How a paced stage waits for its pacer: :func:`pace`.
    """
    groups = parts(stages, links)
    if len(groups) < 2:
        return {}
    lead = set(groups[lead_part(groups, loss_stage, size)])
    out: dict[int, int] = {}
    for s, rank in stages.items():
        if s not in lead:
            p = pacer((h for h in lead if stages[h] == rank), depth)
            if p is not None:
                out[s] = p
    return out


def pace(pacer_of: Mapping[int, int], programs: Mapping[int, object]) -> dict[int, tuple[int, int]]:
    """Per paced stage (``pacer_of``: paced stage -> its pacer, :func:`pacers`): ``(pacer, ahead)``.
    The stage may run the forward of micro-batch ``k`` once its pacer has run that of ``k - ahead``
    (or has no forward left); the engine and the simulator both hold it to that.

    ``ahead`` is how many more forwards the stage's program runs before a backward than its pacer's
    does (``programs``: stage -> its :class:`~ftcompile.runtime.schedules.StageProgram`, whose
    ``in_flight`` is the most micro-batches in flight; read for paced stages and pacers only). No
    tensor links the two, so what the pacer runs waits for the paced stage only at an update: clipping's global norm
    and skipping non-finite steps wait for every stage, tied weights for every holder of the tensor
    (of the step, or of the step before under the lag), replicas and AvgPipe for the stage's own
    copies. Forward for forward, a stage deeper in its own part than its pacer would need forwards
    of the next step before its last backward of this one, which its pacer's update waits for: a
    hang (measured: async on 2 ranks with clipping). With the slack, the pacer's forwards before
    each update cover the paced stage's (checked over every schedule's programs). So the part draws
    no data ahead of its pacer beyond what its own depth needs over the pacer's.
    """
    return {s: (p, max(0, programs[s].in_flight - programs[p].in_flight)) for s, p in pacer_of.items()}


def stage_priority(stage: int, group: int, paced: Mapping[int, object]) -> tuple[int, int, int]:
    """Where ``stage`` comes among its rank's when several could start a task (backwards and updates
    before forwards, then this): the engine's order, which the simulator follows. Paced stages
    (``paced``: :func:`pace`'s keys) first, among backwards and updates too: a paced stage's work
    stands for work joined to its pacer's, so it runs as soon as the pacer's has; behind the pacer
    in id order, it would wait on a busy rank until the pacer ran out of forwards, holding the data
    of every step meanwhile (simulated: 400 steps' inputs on the branchy DAG's GPU 0). Then 2gw's
    group, then the id."""
    return (stage not in paced, group, stage)
