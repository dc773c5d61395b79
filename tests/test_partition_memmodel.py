"""The partitioners' memory model (partition/base.py MemoryModel) against plan.evaluate.

Exact figures: for random plans (random convex or scattered stages, several stages per GPU,
tied weights) over real traced models and every schedule family (recompute, 2bw, async,
pipedream, gpipe, 2gw), MemoryModel's per-GPU bytes equal evaluate's ``GpuCost.memory_bytes``.
Bounds: for contiguous splits of the topological order, ``stage_upper`` is at least and
``stage_lower`` at most what evaluate charges the stage's GPU.
"""

from __future__ import annotations

import random
from dataclasses import replace

import networkx as nx
import numpy as np
import pytest

from ftcompile.partition.base import MemoryModel, working_set_bounds
from ftcompile.plan import Plan, Stage, evaluate, ordered, stage_depths, stage_graph

from test_partition_mixed import _problem

SETTINGS = [("async", None), ("1f1b", True), ("2bw", None), ("pipedream", None), ("gpipe", False),
            ("2gw", None), ("1f1b", False)]


def _random_plan(problem, rng: random.Random, stages: int, scattered: bool) -> Plan:
    ids = [n.id for n in problem.graph.op_nodes()]
    P = problem.num_gpus
    if scattered:
        # stages of a random topological order's ranges, randomly placed: several per GPU
        cuts = sorted(rng.sample(range(1, len(ids)), stages - 1))
        bounds = [0] + cuts + [len(ids)]
        st = [Stage(k, rng.randrange(P), ids[bounds[k]:bounds[k + 1]]) for k in range(stages)]
    else:
        cuts = sorted(rng.sample(range(1, len(ids)), min(P, stages) - 1))
        bounds = [0] + cuts + [len(ids)]
        st = [Stage(k, k, ids[bounds[k]:bounds[k + 1]]) for k in range(len(bounds) - 1)]
    return ordered(Plan("random", P, st), problem.graph)


@pytest.mark.parametrize("name", ["t5-tiny", "gpt2-tiny", "bert-tiny"])
@pytest.mark.parametrize("schedule,recompute", SETTINGS)
def test_memory_model_equals_evaluate_on_random_plans(name, schedule, recompute):
    base = _problem(name, 4)
    rng = random.Random(hash((name, schedule, recompute)) & 0xFFFF)
    for trial in range(4):
        problem = replace(base, schedule=schedule, recompute=recompute, micro_batches=rng.choice([8, 12] if schedule in ("2bw", "2gw") else [1, 3, 4, 8]),
                          weight_prediction=(schedule == "async" and trial % 2 == 0),
                          replicas=1 + trial % 2)
        plan = _random_plan(problem, rng, stages=rng.randint(2, 9), scattered=trial % 2 == 1)
        want = [g.memory_bytes for g in evaluate(problem, plan).gpus]
        assert MemoryModel.of(problem).gpus(plan) == want, (trial, plan.stages)


@pytest.mark.parametrize("name", ["t5-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("schedule,recompute", SETTINGS)
def test_stage_bounds_bracket_evaluate_on_contiguous_splits(name, schedule, recompute):
    problem = replace(_problem(name, 5), schedule=schedule, recompute=recompute, micro_batches=6)
    graph, prof = problem.graph, problem.profile
    ids = [n.id for n in graph.op_nodes()]
    pos = {n: i for i, n in enumerate(ids)}
    wsf, wsb = working_set_bounds(problem, ids)
    mm = MemoryModel.of(problem)
    rng = random.Random(7)
    # a tied tensor's parts from the other holders, at most one per other GPU, two where the schedule
    # lags it, and its own part kept a step (plan.shared_gradient_copies)
    shared = sum(prof.params[p].bytes * problem.num_gpus * (1 + problem.shared_lag) for p in graph.params
                 if sum(p in graph.node(n).params for n in ids) > 1)
    for _ in range(6):
        plan = _random_plan(problem, rng, stages=rng.randint(2, 5), scattered=False)
        cost = evaluate(problem, plan)
        sg = stage_graph(graph, plan)
        deepest = max(stage_depths(sg).values())
        for sc, st in zip(cost.stages, plan.stages):
            nodes = set(st.nodes)
            names = {p for n in nodes for p in graph.node(n).params}
            ptot = sum(prof.params[p].total for p in names)
            tb = sum(prof.params[p].bytes for p in names if prof.params[p].grad_bytes)
            send = sum({v: b for t in sg.successors(st.id) for v, b in sg.edges[st.id, t]["values"].items()}.values())
            ginp = sum(e.bytes for n in nodes for e in graph.in_edges(n) if graph.node(e.src).kind == "input")
            lo_i, hi_i = min(pos[n] for n in nodes), max(pos[n] for n in nodes) + 1
            kw = dict(depth=sc.depth, params_total=ptot, trainable=tb, recomputes=sc.recomputes,
                      act_full=sc.activation_bytes, recv=sc.recv_bytes, inputs=ginp)
            gpu = cost.gpus[st.gpu].memory_bytes
            assert mm.stage_lower(**kw) <= gpu
            up = mm.stage_upper(**kw, deepest=deepest, grads_back=send, send=send,
                                ws_fwd=int(wsf[lo_i:hi_i].max()), ws_bwd=int(wsb[lo_i:hi_i].max()),
                                shared_extra=shared)
            assert up >= gpu, (schedule, st.id, up, gpu)
