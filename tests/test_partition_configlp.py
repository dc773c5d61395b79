"""partition/configlp.py: the configuration LP's bound, against brute force and a formula."""

from __future__ import annotations

import random

import pytest

from ftcompile.partition.configlp import configuration_bound
from ftcompile.partition.exact import partition_exact
from ftcompile.plan import evaluate

from test_partition_exact import brute_force, synthetic_problem


@pytest.mark.parametrize("seed", [101, 103, 108, 112, 116, 129])
def test_the_bound_never_exceeds_the_best_plan_brute_force_finds(seed):
    # every assignment of 5 to 7 nodes to 2 or 3 GPUs, priced by evaluate(), free links; memory
    # at 80 to 100 % of the peak of exact's unconstrained plan, so that it binds in most cases
    rng = random.Random(seed)
    n, gpus = rng.choice([5, 6, 7]), rng.choice([2, 3])
    fan = rng.random() < 0.3
    free = synthetic_problem(n, gpus, seed=seed, bandwidth=1e30, fanout=fan)
    peak = evaluate(free, partition_exact(free, time_limit=5, simulate_top=0)).max_memory_bytes
    problem = synthetic_problem(n, gpus, seed=seed, bandwidth=1e30, fanout=fan,
                                gpu_memory=int(rng.choice([0.8, 0.9, 1.0]) * peak))
    best = brute_force(problem, "mixed")
    assert best < float("inf")
    bound = configuration_bound(problem, 0.0, best * 1.5)
    assert 0.0 < bound <= best * (1 + 1e-9)


def test_whole_nodes_raise_the_bound_above_total_over_gpus():
    # three nodes of equal time on two GPUs, nothing to skip (the last node is the loss, of no
    # cost): one GPU holds two of them, so the best plan is 2/3 of the total, not 1/2
    problem = synthetic_problem(4, 2, seed=0, bandwidth=1e30)
    costs = problem.profile.nodes
    for i in (1, 2, 3):
        costs[i].forward_ms, costs[i].backward_ms, costs[i].recompute_ms = 10.0, 20.0, 0.0
    costs[4].forward_ms = costs[4].backward_ms = costs[4].recompute_ms = 0.0
    for p in problem.profile.params.values():          # no optimizer step to share out
        p.grad_bytes = 0
    total = 3 * 30.0
    bound = configuration_bound(problem, 0.0, total)
    assert bound == pytest.approx(60.0, abs=2e-3) and bound > total / 2
