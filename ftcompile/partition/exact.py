"""Exact partitioning by mixed-integer programming (HiGHS), with a proven bound.

:func:`partition_exact` solves, for small graphs, the assignment of op nodes (or
of contiguous blocks of them) to GPUs that minimises the largest GPU load, and
reports the solver's proven lower bound, so that users can see how far the
heuristic partitioners are from optimal.

Model (``B`` blocks, ``P`` GPUs)::

    x[b,g] in {0,1}                  block b runs on GPU g;  sum_g x[b,g] = 1
    C_g = sum_b (c_b + r_b) x[b,g] - saved_g     compute, recomputation included
    saved_g <= sum_b r_b x[b,g],  saved_g <= R x[loss,g]    the last stage skips recomputation
    mixed: saved_g <= sum_b r_b u[b,g], u[b,g] <= x[b,g], x[loss,g];  sum_{b,g} c_b u[b,g] <= T
    w[v,g,h] >= x[p(v),g] + x[c,h] - 1           value v crosses from GPU g to GPU h (c reads v)
    S_g = sum_{v,h} bytes_v / bw(g,h) w[v,g,h],  R_h = sum_{v,g} float_bytes_v / bw(g,h) w[v,g,h]
    y[q,g] >= x[b,g] (b reads q);  sum_q mem_q y[q,g] + A_g <= memory   parameters once per GPU
    T >= C_g, T >= S_g, T >= R_g;   minimise T

``space="seq"`` adds contiguity: the GPU index is non-decreasing along the
topological order and grows by at most one per block, so GPU ``g`` holds stage
``g`` (one stage per GPU, the used GPUs a prefix). ``space="mixed"`` lets each
GPU take any blocks; its blocks become stages by :func:`plan_from_assignment`.

What the MIP objective means. A stage's Eq. 1 period
``C + max(0, S - C) + max(0, R - C)`` is at least ``max(C, S, R)``, and a GPU's
load (the sum of its stages' periods) is at least the max of the sums. The MIP
uses those maxima, counts only inter-GPU traffic, lets the GPU of the loss
node skip the recomputation of as many of its blocks as fit in ``T`` (all of
them in ``seq`` space, where the GPU is the last stage) and checks memory for
weights, gradients and optimizer state plus ``A_g``, activations every plan
must hold (one micro-batch's, of the whole stage in ``seq`` space, of each
block alone in ``mixed``); so its optimum is a **lower bound** on the
Eq. 1 objective of every plan in the space (whose blocks are whole), and equal
to it for a Seq-pipe in which no stage has both its send and receive time
above its compute and the loss is in the last stage. The returned plan is
priced by :func:`~ftcompile.plan.evaluate`, as are the solutions the solver
improved on (and, in ``mixed`` space, the ``seq`` optimum it starts from); the
best that fits is returned. If none fits once all activations are counted,
they are cut off and the MIP solved again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import networkx as nx
import numpy as np

from ..plan import Plan, Problem, Stage, _in_flight, evaluate, stage_graph
from ..units import format_bytes
from .base import Infeasible
from .seq import OpSequence, op_sequence

SPACES = ("seq", "mixed")


@dataclass
class Blocks:
    """Op nodes grouped into contiguous blocks of the topological order."""

    members: list[list[int]]                 # node ids per block
    compute_ms: np.ndarray                   # forward + backward
    recompute_ms: np.ndarray
    params: list[list[int]]                  # param indices read by each block
    param_total: np.ndarray
    activation_bytes: np.ndarray             # kept for backward, one micro-batch
    values: list[tuple[int, list[int], int, bool]]   # (producer block, consumer blocks != it, bytes, floating)
    loss: int | None

    @property
    def n(self) -> int:
        return len(self.members)


def coarsen(seq: OpSequence, max_blocks: int, recompute: bool) -> Blocks:
    """Group the op sequence into at most ``max_blocks`` contiguous blocks of near-equal compute.

    Block ``k`` ends at the first position where the running compute (with
    recomputation when ``recompute``) reaches ``(k + 1) / max_blocks`` of the
    total, so no block is empty and every block is contiguous; a graph with at
    most ``max_blocks`` op nodes keeps one node per block.
    """
    N = seq.n
    if N <= max_blocks:
        starts = list(range(N))
    else:
        load = seq.compute_ms + (seq.recompute_ms if recompute else 0.0)
        cum = np.cumsum(load)
        total = cum[-1] if N else 0.0
        starts = [0]
        for k in range(1, max_blocks):
            pos = int(np.searchsorted(cum, total * k / max_blocks, side="left")) + 1
            pos = max(pos, starts[-1] + 1)
            if pos >= N - (max_blocks - 1 - k):      # leave one node for each block still to come
                pos = max(starts[-1] + 1, N - (max_blocks - k))
            starts.append(pos)
    bounds = starts + [N]
    block_of = np.zeros(N, dtype=np.int64)
    for b in range(len(starts)):
        block_of[bounds[b]:bounds[b + 1]] = b
    members = [seq.ids[bounds[b]:bounds[b + 1]] for b in range(len(starts))]
    comp = np.array([seq.compute_ms[bounds[b]:bounds[b + 1]].sum() for b in range(len(starts))])
    rec = np.array([seq.recompute_ms[bounds[b]:bounds[b + 1]].sum() for b in range(len(starts))])
    params = [sorted({q for i in range(bounds[b], bounds[b + 1]) for q in seq.node_params[i]})
              for b in range(len(starts))]
    values = []
    for p, cs, nbytes, fl in seq.values:
        pb = int(block_of[p])
        cb = sorted({int(block_of[c]) for c in cs} - {pb})
        if cb:
            values.append((pb, cb, nbytes, fl))
    act = np.array([int(seq.activation_bytes[bounds[b]:bounds[b + 1]].sum()) for b in range(len(starts))])
    loss = int(block_of[seq.loss_pos]) if seq.loss_pos is not None else None
    return Blocks(members, comp, rec, params, seq.param_total, act, values, loss)


def plan_from_assignment(problem: Problem, members: list[list[int]], gpu_of_block: list[int],
                         strategy: str = "exact", info: dict | None = None, merge: bool = True) -> Plan:
    """A plan placing block ``b`` (``members[b]``, blocks in topological order) on ``gpu_of_block[b]``.

    Each maximal run of consecutive blocks on one GPU is a stage. With
    ``merge``, a run joins the GPU's most recent stage when the stage graph
    stays acyclic, so a GPU's blocks form as few stages as this greedy pass
    finds (fewer stages, less staleness; but a recomputing stage rebuilds all
    its activations at once, so unmerged runs need less memory). Runs in
    topological order always give an acyclic stage graph, so the result is a
    valid plan.
    """
    runs: list[tuple[int, list[int]]] = []
    for nodes, g in zip(members, gpu_of_block):
        if runs and runs[-1][0] == g:
            runs[-1][1].extend(nodes)
        else:
            runs.append((g, list(nodes)))
    stages: list[Stage] = []
    last_on: dict[int, Stage] = {}
    for g, nodes in runs:
        s = last_on.get(g) if merge else None
        if s is not None:
            s.nodes.extend(nodes)
            if nx.is_directed_acyclic_graph(stage_graph(problem.graph, Plan(strategy, problem.num_gpus, stages))):
                continue
            del s.nodes[-len(nodes):]
        # A new stage has no successors yet, so it cannot close a cycle.
        last_on[g] = Stage(len(stages), g, nodes)
        stages.append(last_on[g])
    for i, s in enumerate(stages):
        s.id = i
    return Plan(strategy, problem.num_gpus, stages, dict(info or {}))


def partition_exact(problem: Problem, *, max_nodes: int = 60, time_limit: float = 60.0, space: str = "seq",
                    comm: bool = True, mip_rel_gap: float = 1e-6, max_rounds: int = 20,
                    warm_start: bool = True, max_candidates: int = 20) -> Plan:
    """The plan minimising the largest GPU load, by MIP (HiGHS), with the solver's proven bound.

    Parameters
    ----------
    max_nodes:
        Graphs with more op nodes are coarsened into ``max_nodes`` contiguous
        blocks of near-equal compute (:func:`coarsen`); the result is then
        optimal, and the bound valid, for plans whose blocks are whole only.
    time_limit:
        Seconds for all MIP solves together; on expiry the best plan found so
        far is returned with its gap.
    space:
        ``"seq"``: contiguous stages, one per GPU. ``"mixed"``: each block on any
        GPU, stages formed by :func:`plan_from_assignment`.
    comm:
        Model inter-GPU communication (``T >= send, receive time``); without it
        the model is smaller and the bound weaker.
    max_candidates:
        How many of the solutions the solver improved on are priced with
        :func:`~ftcompile.plan.evaluate` besides its incumbent (the MIP's objective
        is a relaxation of Eq. 1, so the incumbent need not be the best plan).
    warm_start:
        In ``mixed`` space, first solve ``seq`` space (a quarter of the time) and
        start from its plan, which also stands in if no better plan found fits.

    ``Plan.info`` reports ``mip_objective_ms`` (the MIP value of the plan found),
    ``mip_bound_ms`` (the proven lower bound on the MIP objective, hence on the
    Eq. 1 objective of any plan in the space), ``optimal``, ``gap`` and
    ``objective_ms`` (the returned plan's :func:`~ftcompile.plan.evaluate` value).

    Raises
    ------
    Infeasible
        If highspy is missing, no plan fits memory, or none was found in time.
    """
    try:
        import highspy
    except ImportError as exc:                               # pragma: no cover
        raise Infeasible(f"exact partitioning needs highspy: {exc}") from None
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; choose one of {', '.join(SPACES)}")
    t0 = time.perf_counter()
    seq = op_sequence(problem)
    if seq.n == 0:
        raise Infeasible("the graph has no op nodes")
    rec_mid, rec_last = problem.recomputes(False), problem.recomputes(True)
    blocks = coarsen(seq, max_nodes, rec_mid)
    B = blocks.n
    P = min(problem.num_gpus, B)
    cluster = problem.cluster
    limit = cluster.gpu_memory

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", mip_rel_gap)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_improving_solution_save", True)
    x = [[h.addBinary() for _g in range(P)] for _b in range(B)]
    x_index = np.array([v.index for row in x for v in row])
    T = h.addVariable(lb=0.0)
    for b in range(B):
        h.addConstr(h.qsum(x[b]) == 1)

    homogeneous = len({cluster.bandwidth(g, k) for g in range(P) for k in range(P) if g != k}) <= 1
    if space == "seq":
        # GPU index non-decreasing along the order, by at most one per block: stage g on GPU g.
        h.addConstr(x[0][0] == 1)
        for b in range(B - 1):
            sb = h.qsum([g * x[b][g] for g in range(1, P)]) if P > 1 else None
            sn = h.qsum([g * x[b + 1][g] for g in range(1, P)]) if P > 1 else None
            if P > 1:
                h.addConstr(sn - sb >= 0)
                h.addConstr(sn - sb <= 1)
    elif homogeneous:
        # Interchangeable GPUs: GPU g is used only if GPU g-1 holds an earlier block.
        h.addConstr(x[0][0] == 1)
        for b in range(1, B):
            for g in range(1, P):
                if g > b:
                    h.addConstr(x[b][g] == 0)
                else:
                    h.addConstr(x[b][g] - h.qsum([x[a][g - 1] for a in range(b)]) <= 0)

    # Compute per GPU; recomputation is skipped by the last stage, which holds the loss.
    rec = blocks.recompute_ms if rec_mid else np.zeros(B)
    last_stage_work = []           # compute of the last stage's share of blocks, over all GPUs
    for g in range(P):
        load = h.qsum([float(blocks.compute_ms[b] + rec[b]) * x[b][g] for b in range(B)])
        if rec_mid and not rec_last:
            saved = h.addVariable(lb=0.0)
            h.addConstr(saved - h.qsum([float(rec[b]) * x[b][g] for b in range(B)]) <= 0)
            if blocks.loss is not None:
                h.addConstr(saved - float(rec.sum()) * x[blocks.loss][g] <= 0)
            if space == "mixed" and blocks.loss is not None:
                # Only the last stage skips recomputation, and its own compute fits in its
                # period: u[b] (the share of block b in it) is a fractional knapsack of size T.
                u = [h.addVariable(lb=0.0, ub=1.0) for _b in range(B)]
                for b in range(B):
                    h.addConstr(u[b] - x[b][g] <= 0)
                    h.addConstr(u[b] - x[blocks.loss][g] <= 0)
                last_stage_work += [float(blocks.compute_ms[b]) * u[b] for b in range(B)]
                h.addConstr(saved - h.qsum([float(rec[b]) * u[b] for b in range(B)]) <= 0)
            load = load - saved
        h.addConstr(T - load >= 0)
    if last_stage_work:
        # One last stage in all (only the loss GPU has u > 0 in an integer solution); summing
        # over GPUs keeps the LP relaxation from splitting the loss to save more.
        h.addConstr(T - h.qsum(last_stage_work) >= 0)

    # Communication between GPUs.
    if comm and P > 1:
        send = [[] for _ in range(P)]
        recv = [[] for _ in range(P)]
        for p, cs, nbytes, fl in blocks.values:
            if nbytes == 0:
                continue
            for g in range(P):
                for k in range(P):
                    if g == k or (space == "seq" and k < g):
                        continue
                    w = h.addVariable(lb=0.0, ub=1.0)
                    for c in cs:
                        h.addConstr(w - x[p][g] - x[c][k] >= -1)
                    ms = 1e3 / cluster.bandwidth(g, k)
                    send[g].append(nbytes * ms * w)
                    if fl:
                        recv[k].append(nbytes * ms * w)
        for g in range(P):
            if send[g]:
                h.addConstr(T - h.qsum(send[g]) >= 0)
            if recv[g]:
                h.addConstr(T - h.qsum(recv[g]) >= 0)

    # Weights, gradients and optimizer state, each tensor once per GPU that reads it, plus the
    # activations any plan must hold: a stage that does not recompute keeps at least one
    # micro-batch's full activations, one that does rebuilds them (when it has work to redo).
    k_min = min(_in_flight(problem.schedule, 0, problem.micro_batches, g0) for g0 in (False, True))
    act_coef = 1 if rec_mid else k_min
    act_ok = [not rec_mid or blocks.recompute_ms[b] > 0 for b in range(B)]
    readers: dict[int, list[int]] = {}
    for b, qs in enumerate(blocks.params):
        for q in qs:
            readers.setdefault(q, []).append(b)
    for g in range(P):
        terms = []
        for q, bs in readers.items():
            if blocks.param_total[q] == 0:
                continue
            y = h.addVariable(lb=0.0, ub=1.0)
            for b in bs:
                h.addConstr(y - x[b][g] >= 0)
            terms.append(float(blocks.param_total[q]) * y)
        if space == "seq":
            # One stage per GPU: it holds (or rebuilds) the activations of all its blocks; those
            # of blocks with nothing to recompute count only if the stage has other work to redo.
            terms += [float(act_coef * blocks.activation_bytes[b]) * x[b][g] for b in range(B) if act_ok[b]]
            if terms:
                h.addConstr(h.qsum(terms) <= float(limit))
        elif terms:
            params = h.qsum(terms)
            for b in range(B):
                if act_ok[b] and blocks.activation_bytes[b] > 0:
                    h.addConstr(params + float(act_coef * blocks.activation_bytes[b]) * x[b][g] <= float(limit))
                else:
                    h.addConstr(params <= float(limit))

    h.setObjective(T)
    h.setMinimize()
    warm = None
    if space == "mixed" and warm_start and P > 1:
        # A Seq-pipe is a Mixed-pipe: the seq optimum is a good incumbent that fits memory.
        try:
            sp = partition_exact(problem, max_nodes=max_nodes, time_limit=time_limit / 4, space="seq",
                                 comm=comm, mip_rel_gap=mip_rel_gap, max_rounds=max_rounds, warm_start=False)
        except Infeasible:
            sp = None
        if sp is not None:
            gpu_of_node = {n: s.gpu for s in sp.stages for n in s.nodes}
            warm_gpu = [gpu_of_node[m[0]] for m in blocks.members]
            idx = np.array([x[b][warm_gpu[b]].index for b in range(B)], dtype=np.int32)
            h.setSolution(len(idx), idx, np.ones(len(idx)))
            warm = (sp, evaluate(problem, sp), sp.info["mip_objective_ms"])
    rounds, cut_off = 0, 0
    best = None
    while True:
        rounds += 1
        h.setOptionValue("time_limit", max(1.0, time_limit - (time.perf_counter() - t0)))
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        has_solution = info.primal_solution_status == 2   # kSolutionStatusFeasible
        if not has_solution:
            if status == highspy.HighsModelStatus.kInfeasible:
                why = ("no assignment fits weights, gradients and optimizer state in "
                       f"{format_bytes(limit)} per GPU" if cut_off == 0 else
                       f"every assignment that fits its weights ran out of memory once activations "
                       f"were counted ({cut_off} cut off)")
                raise Infeasible(f"exact ({space}): {why}")
            raise Infeasible(f"exact ({space}): no plan found in {time_limit:.0f} s "
                             f"(HiGHS: {h.modelStatusToString(status)})")
        mip_obj, bound = info.objective_function_value, info.mip_dual_bound
        # The incumbent may not fit once activations are counted; so may the solutions the
        # solver improved on, but one of them may, and it is the best plan HiGHS saw.
        candidates = [np.array(h.vals([x[b][g] for b in range(B) for g in range(P)]))]
        saved = sorted(h.getSavedMipSolutions(), key=lambda s: s.objective)[:max_candidates]
        candidates += [np.array(s.col_value)[x_index] for s in saved]
        tried = set()
        for mip_value, xv in zip([mip_obj] + [s.objective for s in saved], candidates):
            gpu_of = tuple(int(np.argmax(xv.reshape(B, P)[b])) for b in range(B))
            if gpu_of in tried:
                continue
            tried.add(gpu_of)
            for merge in ((True, False) if space == "mixed" else (True,)):
                plan = plan_from_assignment(problem, blocks.members, list(gpu_of), "exact", merge=merge)
                cost = evaluate(problem, plan)
                if cost.feasible and (best is None or cost.objective_ms < best[1].objective_ms):
                    best = (plan, cost, mip_value, "mip")
        if warm is not None and (best is None or warm[1].objective_ms < best[1].objective_ms):
            plan, cost, mip_value = warm
            best = (Plan("exact", plan.num_gpus, plan.stages), cost, mip_value, "seq warm start")
        if best is not None:
            break
        # Cut these assignments off: in each, at least one block must move.
        for gpu_of in tried:
            cut_off += 1
            h.addConstr(h.qsum([x[b][gpu_of[b]] for b in range(B)]) <= B - 1)
        if rounds >= max_rounds or time.perf_counter() - t0 > time_limit:
            raise Infeasible(f"exact ({space}): the {cut_off} best assignments the solver found do not "
                             f"fit once all activations are counted ({cost.reason})")
    plan, cost, plan_mip, source = best
    optimal = status == highspy.HighsModelStatus.kOptimal
    plan.info = {
        "space": space,
        "mip_objective_ms": mip_obj,
        "mip_bound_ms": bound,
        "optimal": optimal,
        "gap": (mip_obj - bound) / mip_obj if mip_obj > 0 else 0.0,
        # The MIP ranks plans by a relaxation of Eq. 1, so the plan returned is the best by
        # evaluate() among those it found: its incumbent, improved-on solutions, the warm start.
        "plan_source": source,
        "plan_mip_objective_ms": plan_mip,
        # evaluate's own bound holds for every plan; the MIP's only for whole blocks when coarsened
        "lower_bound_ms": cost.lower_bound_ms,
        "objective_ms": cost.objective_ms,
        "status": h.modelStatusToString(status),
        "blocks": B,
        "coarsened": B < seq.n,
        "comm": comm,
        "rounds": rounds,
        "seconds": round(time.perf_counter() - t0, 3),
        "bound_note": ("lower bound on the Eq. 1 objective of every plan of the space"
                       + (f" whose {B} contiguous blocks stay whole (graph coarsened from {seq.n} op nodes;"
                          " optimal for the coarsened graph only)" if B < seq.n else "")
                       + ("; assignments cut off for activation memory are excluded" if cut_off else "")),
    }
    return plan
