"""The convex-split MIP (exact in ``seq`` space) is a relaxation of every convex split, and
Seq-pipe reaches the convex optimum through it when its DP keeps side nodes attached.

The reference enumerates every convex split (every chain of ideals, :func:`dags.convex_splits`)
and prices each with evaluate() on unlimited memory once; a split fits a memory limit when its
largest GPU fits, so the optimum at any limit, and the least memory any split needs, follow
without the code under test. The limits tried sit at that least memory (where the MIP's memory
model must not cut the one split that fits) and just below it (where nothing fits).
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from ftcompile.partition.base import Infeasible
from ftcompile.partition.exact import partition_exact
from ftcompile.partition.seq import partition_seq
from ftcompile.plan import Plan, Stage, evaluate

sys.path.insert(0, os.path.dirname(__file__))
from dags import branchy_problem, convex_splits, with_memory  # noqa: E402


def _priced_splits(problem):
    """(objective, largest GPU memory) of every convex split, memory unlimited."""
    free = with_memory(problem, 1 << 60)
    out = []
    for stages in convex_splits(free):
        cost = evaluate(free, Plan("bf", free.num_gpus, [Stage(k, k, s) for k, s in enumerate(stages)]))
        out.append((cost.objective_ms, cost.max_memory_bytes))
    return out


def _optimum(priced, limit) -> float:
    return min((obj for obj, mem in priced if mem <= limit), default=float("inf"))


def _limits(priced) -> list[int]:
    least = min(mem for _obj, mem in priced)
    # the least memory of any split, a little above it, halfway to the unconstrained optimum's, and
    # just below the least (nothing fits)
    free_best = min(priced)[1]
    return [least, int(least * 1.01), (least + free_best) // 2, least - 1]


def _cases(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        blocks, gpus = rng.choice([(1, 3), (1, 4), (2, 3), (2, 2)])
        yield branchy_problem(rng.randrange(10**6), blocks=blocks, gpus=gpus,
                              schedule=rng.choice(["async", "async", "1f1b", "gpipe", "pipedream", "2bw"]),
                              bandwidth=rng.choice([1e30, 1e30, 2e9]), heads=rng.random() < 0.8,
                              mask=rng.random() < 0.8, side=rng.random() < 0.5, tied=rng.random() < 0.3)


def _check_mip(problem, priced):
    for limit in _limits(priced):
        p = with_memory(problem, limit)
        reference = _optimum(priced, limit)
        try:
            plan = partition_exact(p, space="seq", time_limit=30, simulate_top=0)
        except Infeasible as exc:
            # a proof that nothing fits must be true; "found none" is allowed only where the MIP's
            # relaxed candidates all ran out of memory
            assert not (exc.proven and reference < float("inf")), (limit, reference, exc.reason)
            continue
        cost = evaluate(p, plan)
        assert cost.feasible
        assert reference < float("inf")
        assert cost.objective_ms >= reference * (1 - 1e-9)
        # the first solve's bound is a lower bound of every convex split that fits
        assert plan.info["space_bound_ms"] <= reference * (1 + 1e-9), (limit, plan.info, reference)
        if plan.info["optimal"]:
            assert cost.objective_ms == pytest.approx(reference, rel=1e-9)


def test_convex_mip_bound_holds_at_the_least_memory_and_proves_nothing_fits_below():
    for problem in _cases(3, 0):
        _check_mip(problem, _priced_splits(problem))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 5))
def test_convex_mip_bound_holds_on_random_dags(seed):
    for problem in _cases(8, seed):
        _check_mip(problem, _priced_splits(problem))


@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3)])
def test_seq_reaches_the_convex_optimum_when_its_dp_keeps_side_nodes_attached(seed):
    """Too many upsets to list on every node (forced here by a tiny cap): the DP runs with the
    side nodes attached and the MIP over every node closes what that costs, under tight
    memory: halfway between the least memory any split needs and what the unconstrained
    optimum needs, the bound it reports holds and "optimal" is true where it says so (there the
    MIP prices buffers it does not model only after solving, so it need not reach the optimum
    in its rounds)."""
    rng = random.Random(seed)
    problem = branchy_problem(rng.randrange(10**6), blocks=2, gpus=3, side=True,
                              schedule=rng.choice(["async", "1f1b", "gpipe"]))
    priced = _priced_splits(problem)
    least, _near, half, _below = _limits(priced)
    for limit in (1 << 60, half):
        p = with_memory(problem, limit)
        reference = _optimum(priced, limit)
        try:
            plan = partition_seq(p, max_upsets=50, time_limit=5)
        except Infeasible as exc:
            # allowed under memory, but then it must not claim that none exists
            assert limit != 1 << 60
            assert exc.reason.startswith("found no convex split") and "so one may exist" in exc.reason
            assert not exc.proven
            continue
        info = plan.info
        assert any(s.get("attached") for s in info["searches"]), info["searches"]
        if limit == 1 << 60:
            assert info["best_objective_ms"] == pytest.approx(reference, rel=1e-9)
        assert info["best_objective_ms"] >= reference * (1 - 1e-9)
        assert info["bound_ms"] <= reference * (1 + 1e-9)
        if info["best_objective_gap"] <= 1e-9:
            assert info["best_objective_ms"] == pytest.approx(reference, rel=1e-9)
        assert info["bound_covers"] == "every convex split"


def test_seq_says_no_convex_split_fits_when_the_mip_proves_it():
    # Every tensor is held somewhere, so some GPU holds a third of them: half of that cannot fit
    # (the reference: no convex split fits, by brute force).
    problem = branchy_problem(3, blocks=2, gpus=3, side=True)
    static = sum(c.total for c in problem.profile.params.values())
    p = with_memory(problem, problem.memory_reserve + static // 6)
    assert _optimum(_priced_splits(problem), p.cluster.gpu_memory) == float("inf")
    with pytest.raises(Infeasible) as exc:
        partition_seq(p, max_upsets=50, time_limit=5)
    assert exc.value.reason.startswith("no convex split"), exc.value.reason
    assert exc.value.proven           # what compile's table and the benchmark read
