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
           u[b,g] in {0,1} (b in a sink stage on g),  u[p,g] <= u[c,g] (c reads p)
           interchangeable GPUs: x[loss,0] = 1 (the others: HiGHS's own symmetry detection)
    w[v,g,h] >= x[p(v),g] + x[c,h] - 1           value v crosses from GPU g to GPU h (c reads v)
    S_g = sum_{v,h} bytes_v / bw(g,h) w[v,g,h],  R_h = sum_{v,g} float_bytes_v / bw(g,h) w[v,g,h]
    y[q,g] >= x[b,g] (b reads q);  sum_q mem_q y[q,g] + A_g <= memory   parameters once per GPU
    T >= C_g, T >= S_g, T >= R_g;   minimise T

``space="seq"`` adds convexity: every value flows to the same GPU or a later one
(``sum_g g x[p,g] <= sum_g g x[c,g]`` for a value from block ``p`` to block ``c``),
so GPU ``g`` holds stage ``g`` and the stages form a chain of ideals (a Seq-pipe:
one convex stage per GPU). ``space="mixed"`` lets each GPU take any blocks; its
blocks become stages by :func:`plan_from_assignment`.

What the MIP objective means. A stage's Eq. 1 period
``C + max(0, S - C) + max(0, R - C)`` is at least ``max(C, S, R)``, and a GPU's
load (the sum of its stages' periods) is at least the max of the sums. The MIP
uses those maxima, counts only inter-GPU traffic, lets the GPU of the loss
node skip the recomputation of as many of its blocks as fit in ``T`` (all of
them in ``seq`` space, where the GPU is the last stage) and checks memory for
weights, gradients and optimizer state plus ``A_g``, activations every plan
must hold (in ``seq`` space the whole stage's, at its depth's micro-batches in
flight; in ``mixed`` space, where no stage recomputes, every block on the GPU at
the fewest micro-batches any stage keeps, each saved value once, else each block
alone); so its optimum is a **lower bound** on the
Eq. 1 objective of every plan in the space (whose blocks are whole), and equal
to it for a Seq-pipe in which no stage has both its send and receive time
above its compute and the loss is in the last stage. The returned plan is
priced by :func:`~ftcompile.plan.evaluate`, as are the solutions the solver
improved on (in ``mixed`` space each assignment in the :data:`STAGINGS`, and the
``seq`` optimum it starts from); the best that fits is returned. Assignments
that do not fit once all memory is counted are cut off and the MIP solved
again (lazy cuts): in ``seq`` space until its bound meets the best split that
fits; in ``mixed`` space while the solver's best assignments include one that
fits in none of its stagings and the bound is below the best plan that fits,
until the time limit. The bound reported over every plan is the first solve's;
a later one (``bound_uncut_ms``) leaves out the other stagings of the
assignments cut off. In ``mixed`` space a second solve then keeps ``T`` at most
the best plan's value and minimises the block edges between GPUs
(:func:`_fewer_stages`): the same MIP value in, usually, fewer stages. Further
solves let ``T`` rise a little (:data:`RELAXED_SLACKS`) and minimise the runs
of consecutive blocks on one GPU (the stages) instead, beside the runs a
greedy pass merges within that value (:func:`_merge_runs`): plans of a slightly
higher objective and far fewer stages, which often run faster than the optimum,
whose stages wait on one another (BERT-6's operator graph on 6 GPUs at 1.2 x
memory: the optimum, 43.15 ms in 156 stages, simulates at 1.136 of it, 1.072
with 3 x the micro-batches in flight; 5 % of slack gave 45.07 in 20 stages,
1.000 in simulation). They are candidates for the fastest plan in simulation
only (compile's row ``exact-sim``): what exact returns, its bound and
"optimal" speak of its lowest objective.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass

import networkx as nx
import numpy as np

from ..plan import (Plan, Problem, Stage, evaluate, join_unpaced_stages, ordered, shared_gradient_copies,
                    stage_graph)
from ..units import format_bytes
from .base import SIMULATION_SHARE, Infeasible, MemoryModel, plan_key, simulated_choice, with_alternative
from .seq import OpSequence, op_sequence

SPACES = ("seq", "mixed")
#: How a mixed-space assignment is staged for pricing (:func:`plan_from_assignment`'s ``merge``):
#: runs of consecutive blocks merged, runs unmerged, Mixed-pipe's merging, and connected components.
STAGINGS = (True, False, "all", "components")
#: Share of exact's mixed-space time left to its solves for fewer stages (:func:`_fewer_stages`).
FEWER_CUTS_SHARE = 0.4
#: How far above the best plan's MIP value the relaxed solves for fewer stages let it rise (shares
#: of it). A plan of many stages per GPU simulates 3 to 10 % above its objective
#: (benchmarks/README.md), so one a few per cent above it in few stages can be the faster.
RELAXED_SLACKS = (0.02, 0.05)
#: Share of :data:`FEWER_CUTS_SHARE`'s time the solve at the best plan's own value takes; the
#: relaxed solves split the rest.
TIGHT_SHARE = 1 / 3
#: Stagings of each relaxed solve's assignment kept as candidates (those of fewest stages).
RELAXED_KEEP = 2
#: Seconds below which a solve for fewer stages is not started.
MIN_SOLVE_S = 0.25
#: Share of each relaxed solve's time the greedy run merging beside it may take (:func:`_merge_runs`).
MERGE_SHARE = 0.5
#: Mixed space: per solve, the assignments that fit in none of their stagings, lowest MIP value
#: first, that single-node moves off their over-full GPUs may repair (:func:`_repaired`); and the
#: share of the time limit that may take, all solves together.
REPAIR_TOP, REPAIR_SHARE = 3, 0.05
#: HiGHS's ``mip_heuristic_effort`` (its default 0.05): the share of branch-and-bound work its
#: primal heuristics (RINS, RENS, feasibility jump) may take. Under tight memory the MIP's best
#: assignments are hard to find and the tree rarely proves them, so more of the time goes to
#: finding them. Measured on the held-out graphs (benchmarks/README, 10 s each): the same bounds
#: and proofs on all 45 cases, wall time within 2 s, and better plans where memory binds:
#: BERT-6's operator graph on 6 GPUs at 1.1 x 43.355 -> 43.158 (exact), 45.010 -> 43.383
#: (Mixed-pipe, whose MIP starts from its own plan), GNMT's layer graph on 6 GPUs 119.028 ->
#: 118.697; at most 0.05 % worse elsewhere. The zoo's traced graphs in test_archs take as long.
HEURISTIC_EFFORT = 0.5


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


def coarsen(seq: OpSequence, max_blocks: int, recompute: bool, memory: MemoryModel | None = None) -> Blocks:
    """Group the op sequence into contiguous blocks of near-equal compute that fit memory.

    Block ``k`` ends at the first position where the running compute (with
    recomputation when ``recompute``) reaches ``(k + 1) / max_blocks`` of the
    total, so no block is empty and every block is contiguous; a graph with at
    most ``max_blocks`` op nodes keeps one node per block. With ``memory``, a
    block also ends before the node that would take it past the least memory any
    stage holding it needs (:meth:`MemoryModel.lower_bound`: its parameters and one
    micro-batch of activations), so every block fits a GPU whenever its nodes do;
    there may then be more than ``max_blocks`` blocks.
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
        if memory is not None:
            starts = _split_for_memory(seq, starts, recompute, memory)
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


def _split_for_memory(seq: OpSequence, starts: list[int], recompute: bool, memory: MemoryModel) -> list[int]:
    """``starts`` with extra block starts wherever a block would outgrow one GPU's memory."""
    out: list[int] = []
    bounds = starts + [seq.n]
    for b in range(len(starts)):
        out.append(bounds[b])
        params: set[int] = set()
        ptot = act = 0
        rec = 0.0
        for i in range(bounds[b], bounds[b + 1]):
            new = [q for q in seq.node_params[i] if q not in params]
            p2 = ptot + int(sum(seq.param_total[q] for q in new))
            a2 = act + int(seq.activation_bytes[i])
            r2 = rec + float(seq.recompute_ms[i])
            if i > out[-1] and memory.lower_bound(p2, a2, r2, recompute) > memory.limit:
                out.append(i)                    # start a new block at this node
                params, ptot, act, rec = set(), 0, 0, 0.0
                new = list(dict.fromkeys(seq.node_params[i]))
                p2 = int(sum(seq.param_total[q] for q in new))
                a2 = int(seq.activation_bytes[i])
                r2 = float(seq.recompute_ms[i])
            params.update(new)
            ptot, act, rec = p2, a2, r2
    return out


def _loss_tail(problem: Problem, members: list[list[int]], gpu_of_block: list[int]) -> set[int]:
    """Blocks on the GPU of the loss whose every descendant is on that GPU too (an upset)."""
    graph = problem.graph
    block_of = {n: b for b, nodes in enumerate(members) for n in nodes}
    loss = next((block_of[n.id] for n in graph.nodes if n.is_loss and n.id in block_of), None)
    if loss is None:
        return set()
    g = gpu_of_block[loss]
    succ: dict[int, set[int]] = {b: set() for b in range(len(members))}
    for e in graph.edges:
        a, c = block_of.get(e.src), block_of.get(e.dst)
        if a is not None and c is not None and a != c:
            succ[a].add(c)
    ok: set[int] = set()
    for b in reversed(range(len(members))):       # blocks are in topological order
        if gpu_of_block[b] == g and all(c in ok for c in succ[b]):
            ok.add(b)
    return ok


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
    tail = _loss_tail(problem, members, gpu_of_block)
    runs: list[tuple[int, list[int]]] = []
    for b, (nodes, g) in enumerate(zip(members, gpu_of_block)):
        if b in tail:
            continue
        if runs and runs[-1][0] == g:
            runs[-1][1].extend(nodes)
        else:
            runs.append((g, list(nodes)))
    if tail:
        # The blocks on the loss's GPU that feed only that GPU's blocks form one sink stage:
        # the last stage, which skips recomputation (FTPipe §4.3). It goes last.
        runs.append((gpu_of_block[min(tail)], [n for b in sorted(tail) for n in members[b]]))
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
    # (unmerged, a run of blocks that exchange nothing with the rest, a counter, would be a
    # stage nothing paces: priced as it will run)
    return join_unpaced_stages(Plan(strategy, problem.num_gpus, stages, dict(info or {})), problem.graph)


def partition_exact(problem: Problem, *, max_nodes: int = 1000, time_limit: float = 20.0, space: str = "mixed",
                    comm: bool = True, mip_rel_gap: float = 1e-6, max_rounds: int = 20,
                    warm_start: bool = True, max_candidates: int = 20, max_stages: int | None = None,
                    simulate_top: int = 4, max_variables: int = 300_000, warm_plan: Plan | None = None,
                    fewer_cuts: bool = True, relaxed_slacks: tuple[float, ...] = RELAXED_SLACKS,
                    relaxed_out: list | None = None) -> Plan:
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
        In ``mixed`` space, start from the best convex split (``warm_plan``, else
        :func:`~ftcompile.partition.seq.partition_seq` in a quarter of the time), which
        also stands in if no better plan found fits. In ``seq`` space, ``warm_plan`` (a convex
        split, stage ``k`` on GPU ``k``) is the starting incumbent when given.
    max_stages:
        Only plans with at most this many stages are returned.
    simulate_top:
        The best candidate plans by objective simulated: the plan returned is the lowest
        objective whose simulated run fits (ties to rounding by period), and the fastest of them,
        where another, is noted as ``info["simulated_alternative"]`` (compile's row ``exact-sim``).
        The returned plan is always simulated; the others, by stage count, get
        :data:`~ftcompile.partition.base.SIMULATION_SHARE` of ``time_limit`` after it.
    fewer_cuts:
        In ``mixed`` space, a second solve (a third of the last :data:`FEWER_CUTS_SHARE` of
        ``time_limit``) keeps the MIP's value at most the best plan's and minimises the block
        edges between GPUs, which usually leaves fewer stages (:func:`_fewer_stages`; on a tie the
        plan with fewer crossings wins). Then, with the value allowed to rise by each of
        ``relaxed_slacks`` (shares of it), solves for fewest runs of blocks on one GPU (stages),
        and a greedy pass merges runs within each (:func:`_merge_runs`): those plans are simulated
        beside the best few (``simulate_top``) as candidates for the fastest only.
    relaxed_slacks:
        See ``fewer_cuts`` (:data:`RELAXED_SLACKS`; ``()``: none).
    relaxed_out:
        When given, the relaxed plans are appended to it as ``(plan, source)`` (``source``:
        ``"fewer stages +2%"``...) and not simulated here: the caller simulates them among its
        own candidates (Mixed-pipe does).
    max_variables:
        A model larger than this is refused (:class:`Infeasible`) before it is built.

    ``Plan.info`` reports ``mip_objective_ms`` (the MIP value of the solver's incumbent; in
    ``mixed`` space of the first solve's), ``mip_bound_ms`` (the proven lower bound on the
    MIP objective, hence on the Eq. 1 objective of any plan in the space: in ``seq`` space of
    every split that fits, the last solve's bound or the best priced split cut off before it
    where lower; in ``mixed`` space the first solve's, before any cut; ``bound_uncut_ms`` is
    the last solve's there),
    ``space_bound_ms`` (a bound over every plan of ``space_bound_covers``: in ``seq`` space
    every convex split that fits, since each assignment cut off was priced; in ``mixed``
    space every plan, from the first solve, before any cut), ``optimal``, ``gap`` and
    ``objective_ms`` (the returned plan's :func:`~ftcompile.plan.evaluate` value).

    Raises
    ------
    Infeasible
        If highspy is missing, no plan fits memory, or none was found in time.
    """
    import highspy

    t0 = time.perf_counter()
    seq, blocks, P = _prepare(problem, space, max_nodes)
    B = blocks.n
    cluster = problem.cluster

    # A model too large to build in reasonable time (many GPUs: P^2 transfer variables per value)
    fastest_link = max((cluster.bandwidth(g, k) for g in range(P) for k in range(P) if g != k), default=1.0)
    size = B * P + (sum(1 for v in blocks.values if v[2] * 1e3 / fastest_link >= 1e-7) * P * P
                    if comm and P > 1 else 0)
    if size > max_variables:
        raise Infeasible(f"exact ({space}): the MIP would have about {size:,} variables ({B} blocks on {P} GPUs"
                         f"{', with transfers' if comm else ''}), more than {max_variables:,}; use fewer GPUs, "
                         f"fewer nodes (layer granularity) or another strategy")
    mip = _build_mip(problem, seq, blocks, P, space, comm, mip_rel_gap)
    h, x, x_index, limit = mip.h, mip.x, mip.x_index, mip.limit
    warm = _warm_start(problem, mip, blocks, P, space, warm_plan, search=warm_start, max_stages=max_stages,
                       time_limit=time_limit / 4, max_nodes=max_nodes, comm=comm, mip_rel_gap=mip_rel_gap,
                       max_rounds=max_rounds)
    rounds, cut_off = 0, 0
    best = None
    # Simulating the best few after the search: a share of the time limit on top of it (plans of
    # hundreds of stages take a minute each to simulate).
    sim_limit = SIMULATION_SHARE * time_limit
    # In seq space an assignment is one plan, so cutting it off loses nothing once it is priced:
    # the fitting ones are kept, and the search goes on below the best of them until the MIP's
    # bound meets it (lazy memory cuts). Its bound then holds for every convex split that fits.
    lazy = space == "seq"
    # In mixed space an assignment is several plans (its stagings), of which three are priced;
    # the MIP checks activation memory only as a relaxation, so under tight memory its optima
    # may not fit once priced. Those are cut off too and the search goes on below the best plan
    # that fits, while time lasts: its bound then covers every plan but the other stagings of
    # the assignments cut off (info["bound_space"] says so).
    kept: list[tuple] = []
    relaxed: list[tuple] = []       # plans a little above the best, in fewer stages (_fewer_stages)
    repair_left = REPAIR_SHARE * time_limit     # seconds left to repair near misses, all solves together
    if warm is not None:
        plan, cost, mip_value = warm
        if cost.feasible:
            kept.append((Plan("exact", plan.num_gpus, plan.stages), cost, mip_value, "warm start"))
    space_bound = mip_obj = bound = first_obj = None
    fit_bound = best_bound = None
    # (in mixed space the first solve leaves the second its share of the time)
    phase1 = time_limit * (1.0 - FEWER_CUTS_SHARE) if space == "mixed" and fewer_cuts else time_limit
    while True:
        rounds += 1
        h.setOptionValue("time_limit", max(1.0, phase1 - (time.perf_counter() - t0)))
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        has_solution = info.primal_solution_status == 2   # kSolutionStatusFeasible
        if not has_solution:
            if kept:
                if lazy and status == highspy.HighsModelStatus.kInfeasible:
                    fit_bound = min(f[1].objective_ms for f in kept)   # nothing else is left
                best, fastest = _pick(problem, kept, simulate_top, sim_limit)
                break
            if status == highspy.HighsModelStatus.kInfeasible:
                what = ("weights, gradients and optimizer state, and the activations and working memory "
                        "every plan keeps (in-flight micro-batches at each stage's depth)" if space == "seq" else
                        "weights, gradients and optimizer state, and the activations of the blocks each GPU "
                        "holds (each block's alone where stages recompute)")
                why = (f"no assignment fits {what} in {format_bytes(limit)} per GPU (besides the reserve)"
                       + ("" if B == seq.n else f", with the graph coarsened into {B} blocks")
                       if cut_off == 0 else
                       f"every assignment that fits its weights ran out of memory once activations "
                       f"were counted ({cut_off} cut off)")
                # in seq space every assignment cut off was priced and did not fit: still a proof
                raise Infeasible(f"exact ({space}): {why}", proven=(cut_off == 0 or lazy) and B == seq.n)
            raise Infeasible(f"exact ({space}): no plan found in {time_limit:.0f} s "
                             f"(HiGHS: {h.modelStatusToString(status)})")
        mip_obj, bound = info.objective_function_value, info.mip_dual_bound
        if rounds == 1:
            space_bound = bound         # before any assignment is cut off: it covers the whole space
            first_obj = mip_obj
        # The incumbent may not fit once activations are counted; so may the solutions the
        # solver improved on, but one of them may, and it is the best plan HiGHS saw.
        candidates = [np.array(h.vals([x[b][g] for b in range(B) for g in range(P)]))]
        saved = sorted(h.getSavedMipSolutions(), key=lambda s: s.objective)[:max_candidates]
        candidates += [np.array(s.col_value)[x_index] for s in saved]
        tried = set()
        found = []
        misfit = False              # some assignment fits in none of its stagings
        misfit_reason = None        # why the last staging priced did not fit
        over: list[tuple[float, int, Plan]] = []    # (MIP value, bytes over, a staging) of those
        for mip_value, xv in zip([mip_obj] + [s.objective for s in saved], candidates):
            gpu_of = tuple(int(np.argmax(xv.reshape(B, P)[b])) for b in range(B))
            if gpu_of in tried:
                continue
            tried.add(gpu_of)
            fits = len(found)
            misfits: list[tuple[int, Plan]] = []     # (only mixed space repairs them)
            priced, why = _priced_stagings(problem, blocks, list(gpu_of),
                                           STAGINGS if space == "mixed" else (True,), max_stages,
                                           misfits if space == "mixed" else None)
            found += [(plan, cost, mip_value, "mip") for plan, cost in priced]
            misfit_reason = why or misfit_reason
            if len(found) == fits:
                misfit = True
                if misfits:
                    # (the staging of fewest stages: the simulation and the run like few)
                    nbytes, plan = min(misfits, key=lambda m: (len(m[1].stages), m[0]))
                    over.append((mip_value, nbytes, plan))
        if space == "mixed" and over and repair_left > 0:
            t_repair = time.perf_counter()
            found += _repair_round(problem, over, kept + found, repair_left, max_stages)
            repair_left -= time.perf_counter() - t_repair
        # only the best few can be returned (_pick simulates at most simulate_top), and tight
        # memory can take hundreds of rounds: the rest are dropped as they come
        kept = _best_few(kept + found, max(simulate_top, 1))
        found = list(kept)
        # Mixed space cuts off up to 1 + max_candidates assignments a round, and tight memory can
        # need many rounds of them: only time stops it there (a round is one warm re-solve).
        out_of_time = rounds >= (max_rounds if lazy else 50 * max_rounds) or time.perf_counter() - t0 > time_limit
        if found:
            best_fit = min(f[1].objective_ms for f in found)
            if lazy:
                # a fitting split never cut is above every round's bound; one cut off is kept
                best_bound = bound if best_bound is None else max(best_bound, bound)
                fit_bound = min(best_bound, best_fit)
            # In mixed space the search goes on only while memory is what kept the solver's best
            # assignments out; a relaxation gap alone (communication, recomputation) is priced.
            if (bound >= best_fit * (1 - 1e-9) or out_of_time or status != highspy.HighsModelStatus.kOptimal
                    or not (lazy or misfit)):
                if space == "mixed" and fewer_cuts and P > 1:
                    left = time_limit - (time.perf_counter() - t0)
                    tight, relaxed = _fewer_stages(problem, mip, blocks, found, left, max_stages, relaxed_slacks)
                    # (first: on a tie with the plan it started from, the one with fewer crossings)
                    found = _best_few(tight + found, max(simulate_top, 1))
                best, fastest = _pick(problem, found, simulate_top, sim_limit,
                                      extra=relaxed if relaxed_out is None else ())
                break
        # Cut these assignments off: in each, at least one block must move.
        for gpu_of in tried:
            cut_off += 1
            h.addConstr(h.qsum([x[b][gpu_of[b]] for b in range(B)]) <= B - 1)
        if out_of_time:
            raise Infeasible(f"exact ({space}): the {cut_off} best assignments the solver found do not "
                             f"fit once all activations are counted ({misfit_reason or 'or have too many stages'})")
    plan, cost, plan_mip, source = best
    # (what the simulation said of the plan returned; where it was the fastest, also every
    # candidate simulated and how many were skipped, as the other strategies' plans carry it)
    simulated = {k: plan.info[k] for k in ("simulated_period_ms", "simulated_memory_fits", "simulated_candidates",
                                           "simulated_skipped") if k in plan.info}
    solved = status == highspy.HighsModelStatus.kOptimal
    what = {"seq": "convex splits with one stage per GPU", "mixed": "plans"}[space]
    if B < seq.n:
        covers = f"{what} that keep each of its {B} blocks (contiguous runs of the graph's order) whole in one stage"
    else:
        covers = "every plan" if space == "mixed" else "every convex split with one stage per GPU"
    # In mixed space a later solve's bound skips the assignments cut off before it (whose other
    # stagings were not priced): only the first solve's bound covers every plan.
    # In seq space the last solve's bound skips the assignments cut off, each priced: the best of
    # those that fit (fit_bound) keeps it a bound over every split that fits, never above the plan.
    valid, valid_obj = ((fit_bound if fit_bound is not None else bound), mip_obj) if lazy else (space_bound, first_obj)
    if valid is None:
        # No solve finished with a solution (a plan found before it, e.g. the warm start, is
        # returned): evaluate's own bound is the one that holds for every plan.
        valid = cost.lower_bound_ms
    plan.info = {
        "space": space,
        "bound_space": covers,
        "mip_objective_ms": valid_obj,
        "mip_bound_ms": valid,
        # A bound over all of `covers` that fit: in seq space, the last solve's bound (or the best
        # plan priced, every cut assignment having been priced); else the first solve's, before
        # any assignment was cut off.
        "space_bound_ms": fit_bound if lazy and fit_bound is not None else space_bound,
        "space_bound_covers": covers + (" that fit" if lazy else ""),
        "mip_solved": solved,
        # the plan meets the proven bound: optimal over the space the bound covers
        "optimal": (cost.objective_ms <= fit_bound * (1 + 1e-9) if lazy and fit_bound is not None
                    else valid is not None and cost.objective_ms <= valid * (1 + 1e-9)),
        "mip_gap": (valid_obj - valid) / valid_obj if valid_obj else None,
        "gap": (cost.objective_ms - valid) / cost.objective_ms if cost.objective_ms > 0 and valid is not None
        else 0.0,
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
        "bound_note": ("lower bound on the Eq. 1 objective of " + covers
                       + (f" (graph coarsened from {seq.n} op nodes: optimal for the coarsened graph only)"
                          if B < seq.n else "")
                       ),
    }
    if cut_off and not lazy:
        # what the last solve proved: every plan except other stagings of the assignments cut off
        # the cut assignments' priced stagings are kept: the best of them bounds those
        plan.info["bound_uncut_ms"] = min(([bound] if bound is not None else [])
                                          + [f[1].objective_ms for f in kept])
        plan.info["bound_uncut_covers"] = (f"{covers} except other stagings of the {cut_off} assignments cut "
                                           f"off (each priced in {len(STAGINGS)} stagings)")
    plan.info.update(simulated)
    if fastest is not None:
        with_alternative(plan, fastest)
    if relaxed_out is not None:
        relaxed_out.extend((p, src) for p, _c, _v, src in _best_few(relaxed, len(relaxed)))
    return plan


def relaxed_objective(problem: Problem, plan: Plan, *, space: str = "mixed", comm: bool = True,
                      max_nodes: int = 1000, time_limit: float = 60.0) -> float | None:
    """What :func:`partition_exact`'s MIP makes of ``plan``: its optimum with every block fixed
    to the plan's GPU, or ``None`` where its rows rule that assignment out.

    The MIP is a relaxation of every plan of its space whose blocks are whole, so for a plan
    that fits memory (:func:`~ftcompile.plan.evaluate` says so) the value is at most the plan's
    Eq. 1 objective, and never ``None``. That is what this function is for: to see why exact
    did not return a plan a user knows of, and to test that the MIP's second statement of
    evaluate's time and memory rules stays below the first.

    Interchangeable GPUs are renumbered as the MIP's symmetry row asks (:func:`_canonical`;
    ``seq`` space: by the stage graph's order); on other clusters a ``seq``-space plan must have
    its ``k``-th stage on GPU ``k``.

    Raises
    ------
    ValueError
        If a block (the graph coarsened above ``max_nodes`` op nodes) spans two GPUs, or in
        ``seq`` space the plan is not a convex split with one stage per GPU.
    Infeasible
        If highspy is missing or the solve does not finish in ``time_limit`` seconds.
    """
    import highspy

    seq, blocks, P = _prepare(problem, space, max_nodes)
    gpu_of_node = {n: st.gpu for st in plan.stages for n in st.nodes}
    gpu_of: list[int] = []
    for b, m in enumerate(blocks.members):
        gs = {gpu_of_node.get(n) for n in m}
        if len(gs) != 1 or None in gs:
            raise ValueError(f"block {b} (nodes {m[0]}..{m[-1]}) is not on one GPU in the plan")
        gpu_of.append(gs.pop())
    mip = _build_mip(problem, seq, blocks, P, space, comm, 0.0)
    if space == "seq":
        order = list(nx.topological_sort(stage_graph(problem.graph, plan)))
        if len(order) > P or len({st.gpu for st in plan.stages}) != len(plan.stages):
            raise ValueError("a seq-space plan has one stage per GPU and at most as many stages as GPUs")
        stage_gpu = {st.id: st.gpu for st in plan.stages}
        rank = {stage_gpu[sid]: k for k, sid in enumerate(order)}     # GPU -> its stage's place
        if not mip.homogeneous and any(g != k for g, k in rank.items()):
            raise ValueError("on this cluster a seq-space plan has its k-th stage on GPU k")
        gpu_of = [rank[g] for g in gpu_of]
    elif mip.homogeneous:
        gpu_of, _ = _canonical(gpu_of, blocks)
    if max(gpu_of) >= P:
        raise ValueError(f"the plan uses GPU {max(gpu_of)}; the MIP has {P}")
    h = mip.h
    for b, g in enumerate(gpu_of):
        i = mip.x[b][g].index
        h.changeColBounds(i, 1.0, 1.0)
    h.setOptionValue("time_limit", float(time_limit))
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    if status != highspy.HighsModelStatus.kOptimal:
        raise Infeasible(f"exact: the fixed assignment did not solve in {time_limit:.0f} s "
                         f"(HiGHS: {h.modelStatusToString(status)})")
    return float(h.getInfo().objective_function_value)


def _prepare(problem: Problem, space: str, max_nodes: int) -> tuple[OpSequence, Blocks, int]:
    """What every MIP of ``problem`` starts from: its op sequence, the blocks (coarsened above
    ``max_nodes`` op nodes) and how many GPUs the MIP places them on. Checks what can be checked
    before any work: highspy present, a known space, op nodes to place."""
    try:
        importlib.import_module("highspy")
    except ImportError as exc:                               # pragma: no cover
        raise Infeasible(f"exact partitioning needs highspy: {exc}") from None
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; choose one of {', '.join(SPACES)}")
    seq = op_sequence(problem)
    if seq.n == 0:
        raise Infeasible("the graph has no op nodes")
    blocks = coarsen(seq, max_nodes, problem.recomputes(False), MemoryModel.of(problem))
    return seq, blocks, min(problem.num_gpus, blocks.n)


def _canonical(gpus: list[int], blocks: Blocks) -> tuple[list[int], dict[int, int]]:
    """GPUs of a block assignment renumbered as the MIP's symmetry row asks of interchangeable
    GPUs: the loss's GPU first, then the others by first use along the block order; and the
    renumbering."""
    lead = gpus[blocks.loss] if blocks.loss is not None else None
    order = [lead] if lead is not None else []
    for g in gpus:
        if g not in order:
            order.append(g)
    relabel = {g: k for k, g in enumerate(order)}
    return [relabel[g] for g in gpus], relabel


def _splits_blocks(plan: Plan, blocks: Blocks) -> bool:
    """Whether some block's nodes lie on two or more GPUs of ``plan``."""
    gpu_of_node = {n: st.gpu for st in plan.stages for n in st.nodes}
    return any(len({gpu_of_node[n] for n in m}) > 1 for m in blocks.members)


def _warm_start(problem: Problem, mip: "_Mip", blocks: Blocks, P: int, space: str, warm_plan: Plan | None, *,
                search: bool, max_stages: int | None, time_limit: float, max_nodes: int, comm: bool,
                mip_rel_gap: float, max_rounds: int) -> tuple | None:
    """Give the solver a starting incumbent; returns (plan, its cost, its MIP value) or None.

    In ``seq`` space ``warm_plan`` (stage ``k`` on GPU ``k``) when given. In ``mixed`` space
    (with ``search``) ``warm_plan`` where it keeps every block on one GPU, else the best convex
    split, found by Seq-pipe and, where its stages split a block, by exact in ``seq`` space,
    each in ``time_limit``.
    """
    h, x, B = mip.h, mip.x, blocks.n
    warm = None
    if space == "seq" and warm_plan is not None and P > 1:
        # A convex split found by other means (Seq-pipe's DP): its stage k on GPU k.
        order = sorted(warm_plan.stages, key=lambda st: st.id)
        k_of = {n: k for k, st in enumerate(order) for n in st.nodes}
        ks = [{k_of.get(n) for n in m} for m in blocks.members]
        if len(order) <= P and all(len(k) == 1 and None not in k for k in ks):
            idx = np.array([x[b][next(iter(ks[b]))].index for b in range(B)], dtype=np.int32)
            h.setSolution(len(idx), idx, np.ones(len(idx)))
            warm = (warm_plan, evaluate(problem, warm_plan), warm_plan.info.get("mip_objective_ms"))
    if space == "mixed" and search and P > 1:
        # A Seq-pipe is a Mixed-pipe: the best convex split is a good incumbent that fits memory.
        # (a given plan that splits a block cannot be the MIP's start: Seq-pipe's split then)
        sp = warm_plan
        if sp is None or _splits_blocks(sp, blocks):
            sp = None
            try:
                from .seq import partition_seq

                # (its objective's best alone: seq's simulation of its best few would be spent here)
                sp = partition_seq(problem, max_stages=max_stages, time_limit=time_limit, simulate_top=0)
            except Infeasible:
                pass
        gpu_of_node = {n: st.gpu for st in sp.stages for n in st.nodes} if sp is not None else {}
        if sp is None or _splits_blocks(sp, blocks):
            try:
                sp = partition_exact(problem, max_nodes=max_nodes, time_limit=time_limit, space="seq",
                                     comm=comm, mip_rel_gap=mip_rel_gap, max_rounds=max_rounds, warm_start=False,
                                     simulate_top=0)
                gpu_of_node = {n: st.gpu for st in sp.stages for n in st.nodes}
            except Infeasible:
                sp = None
        if sp is not None:
            warm_gpu = [gpu_of_node[m[0]] for m in blocks.members]
            if mip.homogeneous:
                warm_gpu, relabel = _canonical(warm_gpu, blocks)
                sp = Plan(sp.strategy, sp.num_gpus, [Stage(st.id, relabel[st.gpu], st.nodes) for st in sp.stages],
                          sp.info)
            if max(warm_gpu) < P:
                idx = np.array([x[b][warm_gpu[b]].index for b in range(B)], dtype=np.int32)
                h.setSolution(len(idx), idx, np.ones(len(idx)))
                warm = (sp, evaluate(problem, sp), sp.info.get("mip_objective_ms"))
    return warm


@dataclass
class _Links:
    """How blocks connect, built once per MIP and shared by its rows."""

    edge_pairs: list[tuple[int, int]]        # (producer block, consumer block), sorted
    succ: dict[int, list[int]]               # block -> the blocks reading its values
    readers: dict[int, list[int]]            # parameter -> the blocks reading it, in order

    @staticmethod
    def of(blocks: Blocks) -> "_Links":
        edge_pairs = sorted({(p, c) for p, cs, _nbytes, _fl in blocks.values for c in cs})
        succ: dict[int, list[int]] = {}
        for p, c in edge_pairs:
            succ.setdefault(p, []).append(c)
        readers: dict[int, list[int]] = {}
        for b, qs in enumerate(blocks.params):
            for q in qs:
                readers.setdefault(q, []).append(b)
        return _Links(edge_pairs, succ, readers)


@dataclass
class _Mip:
    """The model :func:`partition_exact` solves: ``x[b][g]`` (block ``b`` on GPU ``g``)."""

    h: object                                # highspy.Highs, objective T set
    x: list[list]
    x_index: np.ndarray                      # column of x[b][g] at b * P + g
    limit: float                             # memory per GPU less the reserve
    homogeneous: bool                        # GPUs interchangeable: numbered by _canonical
    T: object                                # the objective's column
    edge_pairs: list[tuple[int, int]]        # (producer block, consumer block)


def _build_mip(problem: Problem, seq: OpSequence, blocks: Blocks, P: int, space: str, comm: bool,
               mip_rel_gap: float) -> _Mip:
    """The MIP of the module docstring for ``blocks`` on ``P`` GPUs, objective set."""
    import highspy

    B = blocks.n
    cluster = problem.cluster
    with _quiet_fd1():
        h = highspy.Highs()                 # prints a banner on descriptor 1 before any option applies
    h.setOptionValue("output_flag", False)
    for name, value in (("mip_rel_gap", mip_rel_gap), ("threads", 1), ("mip_improving_solution_save", True),
                        ("mip_heuristic_effort", HEURISTIC_EFFORT)):
        _option(h, name, value)
    x = [[h.addBinary() for _g in range(P)] for _b in range(B)]
    x_index = np.array([v.index for row in x for v in row])
    T = h.addVariable(lb=0.0)
    for b in range(B):
        h.addConstr(h.qsum(x[b]) == 1)
    homogeneous = len({cluster.bandwidth(g, k) for g in range(P) for k in range(P) if g != k}) <= 1
    links = _Links.of(blocks)
    _placement_rows(h, blocks, x, P, space, homogeneous, links.edge_pairs)
    y = _held_params(h, seq, blocks, x, P, links.readers)
    _time_rows(h, problem, seq, blocks, x, y, T, P, space, comm, links)
    limit = _memory_rows(h, problem, seq, blocks, x, y, P, space, links)
    h.setObjective(T)
    h.setMinimize()
    return _Mip(h, x, x_index, float(limit), homogeneous, T, links.edge_pairs)


def _option(h, name: str, value) -> None:
    """Set a HiGHS option; HiGHS answers an unknown name or a bad value with a status, not an
    error, and would solve on with its default: say so instead."""
    import highspy

    if h.setOptionValue(name, value) != highspy.HighsStatus.kOk:
        raise RuntimeError(f"HiGHS refused option {name}={value!r}; the exact partitioner needs a highspy "
                           "that has it (pip install -U highspy)")


def _update_ms(seq: OpSequence) -> np.ndarray:
    """Each parameter's optimizer step (zero where the sequence has none)."""
    return seq.param_update_ms if seq.param_update_ms is not None else np.zeros(len(seq.param_total))


def _placement_rows(h, blocks: Blocks, x, P: int, space: str, homogeneous: bool,
                    edge_pairs: list[tuple[int, int]]) -> None:
    """Convexity in ``seq`` space; symmetry rows for interchangeable GPUs."""
    B = blocks.n
    if space == "seq":
        # Convex stages, stage g on GPU g: every value flows to the same or a later GPU.
        if P > 1:
            pos = [h.qsum([g * x[b][g] for g in range(1, P)]) for b in range(B)]
            for p, c in edge_pairs:
                h.addConstr(pos[c] - pos[p] >= 0)
            if homogeneous:
                # interchangeable GPUs: the used ones are a prefix (shifting stages down costs nothing)
                for g in range(1, P):
                    h.addConstr(h.qsum([x[b][g] for b in range(B)]) - B * h.qsum([x[b][g - 1] for b in range(B)]) <= 0)
    elif homogeneous and blocks.loss is not None:
        # Interchangeable GPUs: the loss's GPU is GPU 0; the others are left to HiGHS's own
        # symmetry detection, which finds them as an orbitope and fixes by orbits. Rows of our
        # own that order the others broke that symmetry in the formulation and did worse: by
        # first use along the block order, B x P rows of up to B terms (BERT-12's operator
        # graph on 6 GPUs: no root in 10 s); by blocks held, worse plans on 4 of the 23 held-out
        # operator cases and better on 15 (10 s each, benchmarks/README); by compute, HiGHS's
        # presolve of its heuristics' sub-MIPs, which does not watch the time limit, spent
        # minutes strengthening them on ALBERT's graph.
        h.addConstr(x[blocks.loss][0] == 1)


def _held_params(h, seq: OpSequence, blocks: Blocks, x, P: int, readers: dict[int, list[int]]) -> dict:
    """``y[q, g]``: GPU ``g`` holds parameter ``q`` (some block on g reads it): its memory, and
    its optimizer step's share U / M of every micro-batch. Parameters with neither have none."""
    upd_ms = _update_ms(seq)
    y: dict[tuple[int, int], object] = {}
    for q, bs in readers.items():
        if blocks.param_total[q] == 0 and not upd_ms[q] > 0:
            continue
        for g in range(P):
            y[q, g] = v = h.addVariable(lb=0.0, ub=1.0)
            for b in bs:
                h.addConstr(v - x[b][g] >= 0)
    return y


def _time_rows(h, problem: Problem, seq: OpSequence, blocks: Blocks, x, y, T, P: int, space: str, comm: bool,
               links: _Links) -> None:
    """``T`` at least every GPU's compute (recomputation, updates and tied-gradient sums in it),
    and, with ``comm``, its inter-GPU sends and receives."""
    B = blocks.n
    cluster = problem.cluster
    readers, edge_pairs = links.readers, links.edge_pairs
    rec_mid, rec_last = problem.recomputes(False), problem.recomputes(True)
    upd_ms = _update_ms(seq)
    M = problem.micro_batches
    # Tied tensors: a GPU holding one that another GPU also holds sums that holder's gradient part
    # before its update (w[q, g, k] >= y[q, g] + y[q, k] - 1); stages sharing one GPU are not seen
    # here, so this is a lower bound, exact when each GPU runs one stage.
    from ..plan import _shared_sum_ms

    tied_terms: list[list] = [[] for _ in range(P)]
    if P > 1 and seq.param_names:
        for q, bs in readers.items():
            name = seq.param_names[q]
            if len(bs) < 2 or not problem.profile.params[name].grad_bytes:
                continue
            c = _shared_sum_ms(problem, [name], {name: 2}) / M
            if c <= 0:
                continue
            for g in range(P):
                for k in range(P):
                    if k != g:
                        w = h.addVariable(lb=0.0, ub=1.0)
                        h.addConstr(w - y[q, g] - y[q, k] >= -1)
                        tied_terms[g].append(c * w)

    # Compute per GPU; recomputation is skipped by the stages at depth 0: the last stage, which
    # holds the loss, and any other sink of the stage graph, which holds only blocks with no path
    # to the loss ("dead": a side output, a counter nobody reads). Problem.feeds_loss's rule, stated
    # here over the blocks' graph: a block holding no node of it is still live where it feeds a
    # block that does (a stage holding it holds that block too), so over blocks fewer are dead.
    rec = blocks.recompute_ms if rec_mid else np.zeros(B)
    dead = [False] * B
    if blocks.loss is not None:
        reach = [False] * B
        reach[blocks.loss] = True
        for b in range(B - 1, -1, -1):         # blocks are in topological order
            reach[b] = reach[b] or any(reach[c] for c in links.succ.get(b, ()))
        dead = [not r for r in reach]
    rec_live = float(sum(rec[b] for b in range(B) if not dead[b]))
    last_stage_work = []           # compute of the last stage's share of blocks, over all GPUs
    for g in range(P):
        load = h.qsum([float(blocks.compute_ms[b] + rec[b]) * x[b][g] for b in range(B)]
                      + [float(upd_ms[q] / M) * y[q, g] for q in readers if (q, g) in y and upd_ms[q] > 0]
                      + tied_terms[g])
        if rec_mid and not rec_last:
            saved = h.addVariable(lb=0.0)
            h.addConstr(saved - h.qsum([float(rec[b]) * x[b][g] for b in range(B)]) <= 0)
            if blocks.loss is not None:
                h.addConstr(saved - rec_live * x[blocks.loss][g]
                            - h.qsum([float(rec[b]) * x[b][g] for b in range(B) if dead[b] and rec[b] > 0]) <= 0)
            if space == "mixed" and blocks.loss is not None:
                # Only sink stages skip recomputation; the last one's own compute fits in its
                # period: u[b] (block b in a sink stage on g) is, over the blocks with a path to
                # the loss, a knapsack of size T closed under successors.
                # (binary, though integer x make any optimum's u integer: branching on them
                # finds plans the solver otherwise does not, 43.12 against 44.71 on BERT-6's
                # operator graph on 6 GPUs at 1.2 x total / P in 30 s)
                u = [h.addBinary() for _b in range(B)]
                for b in range(B):
                    h.addConstr(u[b] - x[b][g] <= 0)
                    if not dead[b]:
                        h.addConstr(u[b] - x[blocks.loss][g] <= 0)
                # A sink stage has no successor: whatever its blocks feed is in it.
                for p_, c_ in edge_pairs:
                    h.addConstr(u[p_] - u[c_] <= 0)
                last_stage_work += [float(blocks.compute_ms[b]) * u[b] for b in range(B) if not dead[b]]
                h.addConstr(saved - h.qsum([float(rec[b]) * u[b] for b in range(B)]) <= 0)
            load = load - saved
        h.addConstr(T - load >= 0)
    if last_stage_work:
        # One last stage in all (only the loss GPU has u > 0 on blocks with a path to the loss in an
        # integer solution); summing over GPUs keeps the LP relaxation from splitting the loss to
        # save more.
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
                    if nbytes * 1e3 / cluster.bandwidth(g, k) < 1e-7:
                        continue      # a transfer of under 0.1 ns: leaving it out only weakens the bound
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


def _memory_rows(h, problem: Problem, seq: OpSequence, blocks: Blocks, x, y, P: int, space: str,
                 links: _Links) -> float:
    """Memory per GPU (see :func:`_held_memory` and :func:`_depth_memory`); returns the limit
    the rows use, the GPU's memory less the reserve."""
    B = blocks.n
    readers = links.readers
    rec_mid = problem.recomputes(False)
    # Weights, gradients and optimizer state, each tensor once per GPU that reads it, plus the
    # activations any plan must hold: a stage that does not recompute keeps at least one
    # micro-batch's full activations, one that does rebuilds them (when it has work to redo).
    k_min = min(MemoryModel.of(problem).in_flight(0, g0) for g0 in (False, True))
    act_coef = 1 if rec_mid else k_min
    act_ok = [not rec_mid or blocks.recompute_ms[b] > 0 for b in range(B)]
    limit = problem.cluster.gpu_memory - problem.memory_reserve
    own_max: list = [None] * P
    # A task's transient holds at least the working memory of the node it runs (evaluate's
    # working sets add each node's own activations), on top of the rebuilt activations when
    # the stage recomputes and of what it keeps otherwise: own_max[g] >= that of g's nodes.
    # Without recomputation (and in seq space, one stage per GPU) the transient is at least the
    # working set of a stage holding the node alone, the values it reads and writes with its own
    # activations (plan.working_sets of the node: walking a larger stage meets them all live at
    # the node). Recomputing stages in mixed space sum it with another stage's activations below,
    # which holds for the node's activations only.
    if space == "mixed" and rec_mid:
        own = [float(max(problem.profile.nodes[n].activation_bytes for n in m)) for m in blocks.members]
    else:
        ws = problem.node_working_sets
        own = [float(max(max(ws[n]) for n in m)) for m in blocks.members]
    own_top = max(own, default=0.0)
    for g in range(P):
        own_max[g] = h.addVariable(lb=0.0)
        for b in range(B):
            if own[b] > 0:
                h.addConstr(own_max[g] - own[b] * x[b][g] >= 0)
    for g in range(P):
        # (in mixed space the largest node may sit in another stage than a block's activations;
        # for single-node blocks the sum still holds, as either stage's transient is at least
        # twice its node's activations, but not for coarsened blocks)
        terms = [own_max[g]] if space == "seq" or B == seq.n else []
        for q in readers:
            if blocks.param_total[q] == 0:
                continue
            terms.append(float(blocks.param_total[q]) * y[q, g])
        if space == "seq":
            # One stage per GPU: it holds (or rebuilds) the activations of all its blocks; those
            # of blocks with nothing to recompute count only if the stage has other work to redo.
            terms += [float(act_coef * blocks.activation_bytes[b]) * x[b][g] for b in range(B) if act_ok[b]]
            if terms:
                h.addConstr(h.qsum(terms) <= float(limit))
        elif terms:
            # Any one block's activations on top of the GPU's parameters: one row with the
            # largest of them (a variable at least each), the same polytope as a row per block
            # (which, B rows as long as the parameter list, was most of the model's size).
            acts = [(b, float(act_coef * blocks.activation_bytes[b])) for b in range(B)
                    if act_ok[b] and blocks.activation_bytes[b] > 0]
            if acts:
                top = h.addVariable(lb=0.0)
                for b, a in acts:
                    h.addConstr(top - a * x[b][g] >= 0)
                terms.append(top)
            h.addConstr(h.qsum(terms) <= float(limit))
    if space == "mixed" and np.isfinite(limit):
        _held_memory(h, problem, blocks, x, y, own_max, own_top, P, float(limit), k_min, links,
                     depth=B == seq.n, recompute=rec_mid, param_names=seq.param_names)

    if space == "seq" and P > 1 and np.isfinite(limit):
        _depth_memory(h, problem, seq, blocks, x, y, own_max, own_top, P, float(limit), rec_mid, act_ok,
                      links.edge_pairs)
    return limit


def _held_memory(h, problem: Problem, blocks: Blocks, x, y, own_max, own_top: float, P: int, limit: float,
                 k_min: int, links: _Links, depth: bool = True, recompute: bool = False,
                 param_names: list[str] | None = None) -> None:
    """Memory of every stage a GPU holds at once, for ``mixed`` space.

    With ``recompute`` (the schedule's stages rebuild their activations, which the transient of
    one stage at a time holds) the rows are, per block on the GPU, the block's activations plus
    what the GPU keeps whatever its stages: weights, receive buffers and graph inputs below.
    Without it, evaluate charges each stage ``in_flight(depth) >= k_min`` micro-batches of its activations
    (:func:`~ftcompile.profile.held_activation_bytes`: each node's own saved tensors, and each
    input value some node of the stage saves, once per stage), summed over the stages of a GPU.
    Counting every saved input value once per GPU (``z[v, g] >= x[b, g]`` for each block ``b``
    that saves ``v``) and every stage at ``k_min`` is a lower bound of that sum whatever the
    staging; with ``depth`` (blocks of one node, which no staging splits) a block counts at
    ``in_flight`` of the number of GPU changes on its longest path of blocks (each change is a
    stage boundary, so the stage's depth is at least that; linear in the depth where
    ``in_flight`` is, else its chord) and at ``in_flight(1)`` once a descendant is on another GPU.
    To it come the receive buffers of the values a GPU reads from another (one flow-control
    window each, gpipe's at least ``k_min``), the gradients of the values another GPU reads
    from it (``in_flight(1)`` each), one gradient of each tied tensor it holds that another GPU
    also holds, a second copy of the weights, gradients and state of a tensor two of its blocks
    read when a path between them leaves the GPU (they are then in two stages), and the graph
    inputs it reads, as evaluate keeps them. So the MIP stays a relaxation of every plan
    (``tests/test_partition_exact_relaxation.py`` checks it on random plans); without these rows
    it checks one block's activations at a time and, under tight memory, its optima rarely fit
    once priced.
    """
    prof = problem.profile
    own = [float(sum(prof.nodes[n].activation_bytes - prof.nodes[n].first_saved_bytes for n in m))
           for m in blocks.members]
    saved: dict[str, tuple[int, set[int]]] = {}
    for b, m in enumerate(blocks.members):
        for n in m:
            for v, nbytes in prof.nodes[n].saved_inputs.items():
                saved.setdefault(v, (int(nbytes), set()))[1].add(b)
    ptot = {q: float(blocks.param_total[q]) for q in {q for (q, _g) in y}}
    # Receive buffers: a value made on another GPU waits in at least one flow-control window on
    # the reader's GPU (gpipe's windows are the producer's in-flight count, never below k_min).
    window = k_min if problem.schedule == "gpipe" else 1
    # Graph inputs a GPU reads: evaluate keeps (ceil(ahead / M) + 1) * M micro-batches of them.
    graph = problem.graph
    inputs: dict[str, tuple[int, set[int]]] = {}
    for b, m in enumerate(blocks.members):
        for n in m:
            for e in graph.in_edges(n):
                if graph.node(e.src).kind == "input" and e.bytes > 0:
                    inputs.setdefault(e.value, (int(e.bytes), set()))[1].add(b)
    M = problem.micro_batches
    data_steps = (-(-k_min // M) + 1) * M
    # A block with a descendant on another GPU is in a stage with a successor: depth >= 1, so
    # it keeps at least in_flight(1) micro-batches (1f1b: 2 where the last stage keeps 1).
    from ..runtime.schedules import ScheduleError

    mm = MemoryModel.of(problem)
    try:
        k_1 = min(mm.in_flight(1, g0) for g0 in (False, True))
    except ScheduleError:
        k_1 = k_min
    if not depth:
        k_1 = k_min
    # Deeper still: a stage's depth (its longest path to a sink of the stage graph) is at least
    # the number of GPU changes along any path of blocks from one of its blocks, each change being
    # a stage boundary on an acyclic stage graph. s[b] >= s[c] + (p and c apart) gives that count;
    # in_flight(d) >= k_min + slope * d on the longest path's range (exact where in_flight is
    # linear in the depth: async, pipedream, 2bw, 2gw), so a block keeps at least
    # own[b] * (k_min + slope * s[b]) micro-batches' activations.
    B = blocks.n
    edge_pairs, succ = links.edge_pairs, links.succ
    longest = [0] * B                   # edges on the longest path of blocks from b
    for b in range(B - 1, -1, -1):      # blocks are in topological order
        longest[b] = max((longest[c] + 1 for c in succ.get(b, ())), default=0)
    deepest = max(longest, default=0)
    slope, f_max = 0.0, max(k_min, k_1)
    # (stages that recompute keep one micro-batch's inputs, not activations per depth: no slope)
    if depth and P > 1 and deepest > 0 and not recompute:
        try:
            f = [min(mm.in_flight(d, g0) for g0 in (False, True)) for d in range(deepest + 1)]
            slope = max(0.0, min((f[d] - k_min) / d for d in range(1, deepest + 1)))
            f_max = max(f_max, f[-1])
        except ScheduleError:
            pass
    sw = None
    if slope > 0 and not recompute:
        sw = [h.addVariable(lb=0.0, ub=float(longest[b])) for b in range(B)]
        for p, c in edge_pairs:
            apart = h.addVariable(lb=0.0, ub=1.0)
            for g in range(P):
                h.addConstr(apart - x[p][g] + x[c][g] >= 0)
            h.addConstr(sw[p] - sw[c] - apart >= 0)
    # A tensor read by two blocks with a path between them through another GPU is in two stages
    # (stages are convex, their graph being acyclic), so that GPU holds two copies: evaluate
    # counts weights, gradients and state per stage holding them (tied embeddings, shared layers).
    split_pairs = _split_pairs(B, links, ptot)
    # Gradients coming back: a stage whose output another GPU reads waits for that value's
    # gradient for each micro-batch it holds in flight (evaluate's grads_back), so the maker's
    # GPU keeps at least k_1 of them (k_min for coarsened blocks).
    block_of = {n: b for b, m in enumerate(blocks.members) for n in m}
    grads = problem.grad_values
    grads_back: list[tuple[int, set[int], int]] = []
    for n, b in block_of.items():
        out: dict[str, tuple[int, set[int]]] = {}
        for e in graph.out_edges(n):
            if e.value in grads and e.bytes and e.dst in block_of and block_of[e.dst] != b:
                out.setdefault(e.value, (int(e.bytes), set()))[1].add(block_of[e.dst])
        grads_back += [(b, cs, nbytes) for nbytes, cs in out.values()]
    kept = (window * sum(nb for _p, cs, nb, _fl in blocks.values if cs and nb > 0)
            + data_steps * sum(nb for nb, _ in inputs.values()))
    # Tied tensors held on several GPUs: each holder's gradient waits on the others' GPUs
    # (plan.shared_gradient_receive), one at least per GPU holding it with a holder elsewhere;
    # where the schedule lags them, two, and the GPU's own holder keeps its part a step
    # (plan.shared_gradient_copies with one remote and one local holder).
    shared_grad: dict[int, float] = {}
    if P > 1 and param_names:
        copies = shared_gradient_copies(1, 1, problem.shared_lag)
        for q, bs in links.readers.items():
            nb = float(prof.params[param_names[q]].grad_bytes)
            if len(bs) > 1 and nb > 0 and (q, 0) in y:
                shared_grad[q] = copies * nb
    kept += (sum(ptot[q] for q in split_pairs) + k_1 * sum(nb for _b, _cs, nb in grads_back)
             + sum(shared_grad.values()))
    if recompute:
        need = sum(ptot.values()) + kept + max(float(a) for a in blocks.activation_bytes) + own_top * depth
    else:
        need = (sum(ptot.values()) + f_max * sum(own) + k_min * sum(nb for nb, _ in saved.values())
                + kept + own_top)
    if need <= limit:
        return                              # nothing can exceed the memory: no constraint binds
    for g in range(P):
        terms = [ptot[q] * v for (q, gg), v in y.items() if gg == g and ptot[q] > 0]
        for q, pairs_q in split_pairs.items():
            extra = h.addVariable(lb=0.0, ub=1.0)        # a second copy of q on g
            for b1, b2, between in pairs_q:
                for c in between:
                    h.addConstr(extra - x[b1][g] - x[b2][g] + x[c][g] >= -1)
            terms.append(ptot[q] * extra)
        for q, nb in shared_grad.items():
            sr = h.addVariable(lb=0.0, ub=1.0)          # >= 1 when g and another GPU hold q
            for k in range(P):
                if k != g:
                    h.addConstr(sr - y[q, g] - y[q, k] >= -1)
            terms.append(nb * sr)
        for b, cs, nbytes in grads_back:
            r = h.addVariable(lb=0.0, ub=1.0)          # >= 1 when b is on g and a reader is not
            for c in cs:
                h.addConstr(r - x[b][g] + x[c][g] >= 0)
            terms.append(k_1 * nbytes * r)
        if not recompute or depth:          # (depth: single-node blocks, see partition_exact's rows)
            terms.append(own_max[g])
        if not recompute:
            terms += [k_min * own[b] * x[b][g] for b in range(blocks.n) if own[b] > 0]
        if not recompute and depth and P > 1 and (k_1 > k_min or sw is not None):
            # the micro-batches beyond k_min a block keeps on g: the larger of the two bounds
            e = None
            if k_1 > k_min:
                e = [h.addVariable(lb=0.0, ub=1.0) for _b in range(B)]
                for p, c in edge_pairs:
                    h.addConstr(e[p] - x[p][g] + x[c][g] >= 0)          # c on another GPU
                    h.addConstr(e[p] - e[c] - x[p][g] >= -1)            # c on g, with a descendant elsewhere
            for b in range(B):
                if own[b] <= 0 or longest[b] == 0:
                    continue
                a = h.addVariable(lb=0.0)
                if e is not None:
                    h.addConstr(a - (k_1 - k_min) * own[b] * e[b] >= 0)
                if sw is not None:
                    big = slope * own[b] * longest[b]      # off g (x = 0) the row is void
                    h.addConstr(a - slope * own[b] * sw[b] - big * x[b][g] >= -big)
                terms.append(a)
        for v, (nbytes, bs) in saved.items():
            if nbytes <= 0 or recompute:
                continue
            z = h.addVariable(lb=0.0, ub=1.0)
            for b in bs:
                h.addConstr(z - x[b][g] >= 0)
            terms.append(k_min * nbytes * z)
        for p, cs, nbytes, _fl in blocks.values:
            if nbytes <= 0 or not cs:
                continue
            r = h.addVariable(lb=0.0, ub=1.0)          # >= 1 when a reader is on g and the maker is not
            for c in cs:
                h.addConstr(r - x[c][g] + x[p][g] >= 0)
            terms.append(window * nbytes * r)
        for nbytes, bs in inputs.values():
            d = h.addVariable(lb=0.0, ub=1.0)
            for b in bs:
                h.addConstr(d - x[b][g] >= 0)
            terms.append(data_steps * nbytes * d)
        if not recompute:
            h.addConstr(h.qsum(terms) <= limit)
            continue
        # one variable for what the GPU keeps whatever its stages, so each block's row stays short
        base = h.addVariable(lb=0.0)
        h.addConstr(base - h.qsum(terms) >= 0)
        for b in range(blocks.n):
            if blocks.activation_bytes[b] > 0 and blocks.recompute_ms[b] > 0:
                h.addConstr(base + float(blocks.activation_bytes[b]) * x[b][g] <= limit)


def _split_pairs(B: int, links: _Links, ptot: dict[int, float]) -> dict[int, list[tuple[int, int, list[int]]]]:
    """Per parameter read by several of the ``B`` blocks (with memory): each pair of its readers
    with a path between them, and the blocks strictly between (on some path from one to the other)."""
    succ = links.succ
    readers = {q: bs for q, bs in links.readers.items() if len(bs) > 1 and ptot.get(q, 0.0) > 0}
    if not readers:
        return {}
    below = [0] * B                     # bit c set: c is reachable from b (b excluded)
    for b in range(B - 1, -1, -1):      # blocks are in topological order
        for c in succ.get(b, ()):
            below[b] |= below[c] | (1 << c)
    above = [0] * B                     # bit a set: b is reachable from a
    for b in range(B):
        for c in succ.get(b, ()):
            above[c] |= above[b] | (1 << b)
    out: dict[int, list[tuple[int, int, list[int]]]] = {}
    for q, bs in readers.items():
        for i, b1 in enumerate(bs):
            for b2 in bs[i + 1:]:
                lo, hi = min(b1, b2), max(b1, b2)
                mid = below[lo] & above[hi]
                if mid:
                    out.setdefault(q, []).append((lo, hi, [c for c in range(B) if mid >> c & 1]))
    return out


def _depth_memory(h, problem: Problem, seq: OpSequence, blocks: Blocks, x, y, own_max, own_top: float, P: int,
                  limit: float, rec_mid: bool, act_ok: list[bool], edge_pairs: list[tuple[int, int]]) -> None:
    """Memory at each stage's depth, for ``seq`` space (stage g on GPU g).

    A stage at depth ``d`` (its longest path to a sink of the stage graph) keeps
    ``in_flight(d)`` micro-batches of what it needs for backward (its received values and
    graph inputs when it recomputes, else its activations) and ``extra_versions(d)`` more
    copies of its weights: :meth:`~ftcompile.partition.base.MemoryModel.stage_lower`, a proven
    lower bound of what evaluate charges. The depth is modelled exactly: ``f[g, h]`` marks a
    value flowing from GPU g to GPU h, ``depth_g >= depth_h + 1`` where it does, and
    ``delta[g, d]`` (depth_g >= d) switches on the bound for depth d. Stages at depth 0 keep
    the constraint above (the last stage may skip recomputation). So the MIP stays a
    relaxation of every convex split, now tight where in-flight activations bind.
    """
    from ..runtime.schedules import ScheduleError

    mm = MemoryModel.of(problem)
    ks: list[int] = []
    xs: list[int] = []
    for d in range(P):
        try:
            ks.append(min(mm.in_flight(d, g0) for g0 in (False, True)))
            xs.append(min(mm.extra_versions(d, g0) for g0 in (False, True)))
        except ScheduleError:               # no pipeline this deep (2bw: depth < M): the deepest holds
            ks.append(ks[-1])
            xs.append(xs[-1])
    if ks[-1] <= ks[0] and xs[-1] <= xs[0]:
        return                              # depth changes nothing the d = 0 constraint misses
    B = blocks.n
    pos = {n: i for i, n in enumerate(seq.ids)}
    inputs = [float(sum(int(seq.input_bytes[pos[n]]) for n in m)) for m in blocks.members]
    act = [float(blocks.activation_bytes[b]) for b in range(B)]
    # received values: rv[v, g] >= 1 when a block on g reads v and v is made on an earlier GPU
    recv: list[list] = [[] for _ in range(P)]
    recv_all = 0.0
    for p, cs, nbytes, _fl in blocks.values:
        if nbytes == 0 or not cs:
            continue
        recv_all += nbytes
        for g in range(1, P):
            rv = h.addVariable(lb=0.0, ub=1.0)
            before = h.qsum([x[p][k] for k in range(g)])
            for c in cs:
                h.addConstr(rv - x[c][g] - before >= -1)
            recv[g].append(float(nbytes) * rv)
    f = {}
    for g in range(P):
        for k in range(g + 1, P):
            f[g, k] = h.addVariable(lb=0.0, ub=1.0)
            for p, c in edge_pairs:
                h.addConstr(f[g, k] - x[p][g] - x[c][k] >= -1)
    depth = [h.addVariable(lb=0.0, ub=float(P - 1 - g)) for g in range(P)]
    for (g, k), fv in f.items():
        h.addConstr(depth[g] - depth[k] - P * fv >= 1 - P)
    ptot = {q: float(blocks.param_total[q]) for q in {q for (q, _g) in y}}
    # extra weight versions copy the trainable tensors only (evaluate's trainable_bytes)
    prof = problem.profile
    pw = {q: (float(seq.param_bytes[q]) if not seq.param_names or prof.params[seq.param_names[q]].grad_bytes
              else 0.0) for q in ptot}
    big = (sum(ptot.values()) + max(xs) * sum(pw.values())
           + (ks[-1] + 1) * (recv_all + sum(inputs) + sum(act))
           + own_top)
    if big <= limit:
        return                              # nothing can exceed the memory: no constraint binds
    for g in range(P - 1):
        params = [ptot[q] * v for (q, gg), v in y.items() if gg == g and ptot[q] > 0]
        for d in range(1, P - g):
            delta = h.addBinary()
            h.addConstr(depth[g] - P * delta <= d - 1)
            terms = list(params) + [own_max[g]]
            if xs[d]:
                terms += [xs[d] * pw[q] * v for (q, gg), v in y.items() if gg == g and pw[q] > 0]
            if rec_mid:
                terms += [(ks[d] + 1) * t for t in recv[g]]
                terms += [ks[d] * inputs[b] * x[b][g] for b in range(B) if inputs[b] > 0]
                terms += [act[b] * x[b][g] for b in range(B) if act_ok[b] and act[b] > 0]
            else:
                terms += list(recv[g])
                terms += [ks[d] * act[b] * x[b][g] for b in range(B) if act[b] > 0]
            h.addConstr(h.qsum(terms) + big * delta <= limit + big)


def _fewest_stages(problem: Problem, members: list[list[int]], gpu_of_block: list[int]) -> Plan:
    """The assignment staged by Mixed-pipe's merging (any two blocks on one GPU merge while the
    stage graph stays acyclic, neighbours first): fewer stages per GPU than consecutive runs
    give, so fewer waits between stages sharing a GPU."""
    from .coarsen import Quotient
    from .mixed import stages_per_gpu

    q = Quotient(problem.graph, problem.profile)
    where: dict[int, int] = {}
    for nodes, g in zip(members, gpu_of_block):
        keep = q.merge(nodes) if len(nodes) > 1 else nodes[0]
        if keep is None:                      # not convex on its own: leave the nodes apart
            for n in nodes:
                where[n] = g
        else:
            where[keep] = g
    for b in q.members:
        if b not in where:
            where[b] = next(g for nodes, g in zip(members, gpu_of_block) if b in nodes)
    stages = stages_per_gpu(q, where)
    return Plan("exact", problem.num_gpus, [Stage(i, g, nodes) for i, (g, nodes) in enumerate(stages)])


def _components(problem: Problem, members: list[list[int]], gpu_of_block: list[int]) -> Plan | None:
    """The assignment staged by connectivity: each GPU's op nodes split into the weakly connected
    components of the subgraph they induce (None if that stage graph has a cycle). Unrelated
    work sharing a GPU (an attention mask beside the embedding) then keeps separate stages,
    whose transients do not add up and whose depths may be lower than one merged stage's."""
    graph = problem.graph
    gpu_of = {n: g for nodes, g in zip(members, gpu_of_block) for n in nodes}
    und = nx.Graph()
    und.add_nodes_from(gpu_of)
    und.add_edges_from((e.src, e.dst) for e in graph.edges
                       if e.src in gpu_of and e.dst in gpu_of and gpu_of[e.src] == gpu_of[e.dst])
    comps = [set(c) for c in nx.connected_components(und)]
    # (a component that exchanges no value with any other, dead code such as a position index
    # nobody reads, is joined to another stage on its GPU by ordered(): see join_unpaced_stages)
    stages = [Stage(i, gpu_of[min(c)], sorted(c)) for i, c in enumerate(comps)]
    plan = Plan("exact", problem.num_gpus, stages)
    if not nx.is_directed_acyclic_graph(stage_graph(graph, plan)):
        return None
    return ordered(plan, graph)


def _quiet_fd1():
    from ..compile import quiet_native_stdout

    return quiet_native_stdout()


def _fewer_stages(problem: Problem, mip: _Mip, blocks: Blocks, found: list[tuple], time_limit: float,
                  max_stages: int | None, slacks: tuple[float, ...] = RELAXED_SLACKS) -> tuple[list, list]:
    """Plans as good as the best plan of ``found`` by the MIP's measure, with fewer stages; and
    plans at most ``slacks`` above it, with fewer still.

    Many assignments share the MIP's optimum: only the busiest GPU's load is tight, and the
    solver's choice among the others scatters blocks over GPUs, so that the assignment makes
    hundreds of stages (each run of blocks on one GPU in the order is one), which the simulator
    shows waiting on one another (BERT-12's operator graph on 6 GPUs: 285 stages). This second
    solve keeps the MIP's value at most that plan's (``T <= its value``, or its objective for a
    plan from elsewhere, the warm start: the MIP is a relaxation of it) and minimises the
    number of block edges between GPUs instead, from that plan; its solutions are priced and
    staged as the first solve's are.

    Even then the optimum may need many stages per GPU, and their waits cost more than a
    slightly worse balance would. Each further solve lets ``T`` rise to ``(1 + slack)`` times
    the value and minimises the runs of consecutive blocks on one GPU (``r[b] >= x[b][g] -
    x[b-1][g]``: block ``b`` starts a run), which is the stage count of the merged staging,
    from the previous solve's assignment (which meets the looser row); from that assignment
    too, :func:`_merge_runs` merges runs greedily within the cap (at most :data:`MERGE_SHARE` of
    the solve's time), a candidate of its own. Runs, not edges: edges cut are a proxy the
    solver lowers without merging stages (BERT-6's operator graph on 3 GPUs at 1.2 x memory,
    3 % of slack: 70 stages minimising edges, 11 minimising runs). :data:`TIGHT_SHARE` of ``time_limit`` goes to the
    first solve, the rest is split among the slacks; a solve with less than
    :data:`MIN_SOLVE_S` is skipped.

    Returns ``(tight, relaxed)``: ``(plan, cost, mip value, source)`` for each staging that fits
    of the first solve's assignment, and for the :data:`RELAXED_KEEP` stagings of fewest stages
    of each relaxed one's (source ``"fewer stages +2%"``...); both empty when time is short or a
    solve finds nothing. Leaves the model changed.
    """
    if not found or time_limit < MIN_SOLVE_S:
        return [], []
    t0 = time.perf_counter()
    plan, cost, value, _src = min(found, key=_rank)
    # (the MIP's value of a plan is at most its objective: a warm start has no value of its own)
    value = cost.objective_ms if value is None else min(value, cost.objective_ms)
    h, x, B, P = mip.h, mip.x, blocks.n, len(mip.x[0])
    gpu_of_node = {n: st.gpu for st in plan.stages for n in st.nodes}
    gpu_of = [gpu_of_node[m[0]] for m in blocks.members]
    if mip.homogeneous:
        gpu_of, _ = _canonical(gpu_of, blocks)
    if max(gpu_of) >= P:                    # (a plan from elsewhere on GPUs the MIP does not have)
        return [], []
    t_col = mip.T.index
    cuts = _minimise_edges(mip, P)
    tight, relaxed = [], []
    for i, slack in enumerate((0.0,) + tuple(slacks)):
        left = time_limit - (time.perf_counter() - t0)
        share = left * TIGHT_SHARE if i == 0 else left / (len(slacks) - i + 1)
        if share < MIN_SOLVE_S:
            break
        if i == 1:
            _minimise_runs(mip, B, P, cuts)
        cap = float(value) * (1 + slack)
        merged = None
        if slack > 0:
            # Runs merged greedily within the cap: a candidate beside the solver's. (Not its start:
            # from there the solver settled in other plans than from the previous solution, and
            # slower ones, on BERT-6's operator graph on 6 GPUs at 1.2 x: 24 stages simulated at
            # 1.062 of their objective, against 20 at 1.000.)
            t_merge = time.perf_counter()
            merged = _merge_runs(problem, blocks, gpu_of, cap, t_merge + share * MERGE_SHARE, max_stages)[1]
            share -= time.perf_counter() - t_merge
        h.changeColBounds(t_col, 0.0, cap * (1 + 1e-9))
        idx = np.array([x[b][gpu_of[b]].index for b in range(B)], dtype=np.int32)
        h.setSolution(len(idx), idx, np.ones(len(idx)))
        h.setOptionValue("time_limit", float(max(share, MIN_SOLVE_S)))
        h.run()
        if h.getInfo().primal_solution_status != 2:
            if merged is not None:
                relaxed.append((*merged, value, f"fewer stages +{slack:.0%}"))
            break
        xv = np.array(h.vals([x[b][g] for b in range(B) for g in range(P)])).reshape(B, P)
        gpu_of = [int(np.argmax(xv[b])) for b in range(B)]
        priced = _priced_stagings(problem, blocks, gpu_of, STAGINGS, max_stages)[0]
        if slack == 0:
            tight += [(p2, c2, value, "fewer cuts") for p2, c2 in priced]
            continue
        source = f"fewer stages +{slack:.0%}"
        keep = sorted(priced, key=lambda pc: len(pc[0].stages))[:RELAXED_KEEP] + ([merged] if merged else [])
        for p2, c2 in keep:
            p2.info["plan_source"] = source        # (said by compile's row if it is the fastest)
            relaxed.append((p2, c2, value, source))
    return tight, relaxed


def _minimise_edges(mip: _Mip, P: int) -> list:
    """Set the MIP's objective to the block edges between GPUs (``T`` bounded by the caller):
    ``z >= x[p][g] - x[c][g]`` for each edge ``p -> c``; returns the ``z`` columns."""
    h, x = mip.h, mip.x
    cuts = []
    for p, c in mip.edge_pairs:
        z = h.addVariable(lb=0.0, ub=1.0)
        for g in range(P):
            h.addConstr(z - x[p][g] + x[c][g] >= 0)
        cuts.append(z)
    h.changeColCost(mip.T.index, 0.0)
    for z in cuts:
        h.changeColCost(z.index, 1.0)
    return cuts


def _minimise_runs(mip: _Mip, B: int, P: int, cuts: list) -> None:
    """Set the MIP's objective, from edges (``cuts``), to the runs of consecutive blocks on one
    GPU, the stages of the merged staging: ``r[b] >= x[b][g] - x[b-1][g]`` (block ``b`` starts a
    run)."""
    h, x = mip.h, mip.x
    for z in cuts:
        h.changeColCost(z.index, 0.0)
    for b in range(1, B):
        r = h.addVariable(lb=0.0, ub=1.0)
        for g in range(P):
            h.addConstr(r - x[b][g] + x[b - 1][g] >= 0)
        h.changeColCost(r.index, 1.0)


def _merge_runs(problem: Problem, blocks: Blocks, gpu_of: list[int], cap: float, deadline: float,
                max_stages: int | None = None) -> tuple[list[int], tuple[Plan, object] | None]:
    """``gpu_of`` with runs of consecutive blocks on one GPU moved onto the GPU of the run before
    or after them while the merged staging (:func:`plan_from_assignment`) still fits and its
    objective stays at most ``cap``; and that staging with its cost (None if no move was made).

    A candidate beside the relaxed solves of :func:`_fewer_stages`: on operator graphs of 150 to
    460 blocks the solver barely leaves the optimum's runs in its time.
    Each round proposes moves (:meth:`_RunTally.propose`), smallest runs first, that keep every
    GPU's compute (recomputation included: the MIP's load but for the loss GPU's saving) within
    ``cap`` and its parameters
    (with gradients and optimizer state) within the memory the last priced plan left it, no two
    touching the same run, and never the loss's run; they are priced together by
    :func:`~ftcompile.plan.evaluate`, and on a misfit (activations, the loss GPU's recomputation)
    halved until they pass, a single move that does not pass being dropped for good. The MIP is
    a relaxation of every plan that fits, so a result of objective at most ``cap`` meets
    ``T <= cap``. A plan the schedule cannot run (2bw deeper than its micro-batches allow) is a
    misfit too, and one of more than ``max_stages`` stages is never returned (moves only end
    stages, so the search goes on from it). Stops at ``deadline`` (``time.perf_counter()``) or
    when no move is left: a local optimum, often still tens of stages (BERT-3's operator graph on
    6 GPUs at 1.2 x memory, exact alone at 10 s: the optimum's 98 runs to 50 within 2 %, then 34
    within 5 %, in 0.10 s and 0.04 s).
    """
    from ..runtime.schedules import ScheduleError

    rec = blocks.recompute_ms if problem.recomputes(False) else 0.0
    load_b = np.asarray(blocks.compute_ms + rec, dtype=float)
    gpu_of = list(gpu_of)

    def price(assignment: list[int]) -> tuple[Plan, object | None]:
        plan = plan_from_assignment(problem, blocks.members, assignment, "exact")
        try:
            return plan, evaluate(problem, plan)
        except ScheduleError:
            return plan, None

    best = None
    cost = price(gpu_of)[1]
    if cost is None:
        return gpu_of, None
    refused: set[tuple] = set()                       # groups of (first block, last block + 1, GPU)
    while time.perf_counter() < deadline:
        groups = _RunTally(blocks, load_b, gpu_of, cost, cap).propose(refused)
        if not groups:
            break
        n = len(groups)
        while n and time.perf_counter() < deadline:
            trial = list(gpu_of)
            for group in groups[:n]:
                for a, e, t in group:
                    trial[a:e] = [t] * (e - a)
            plan, priced = price(trial)
            if priced is not None and priced.feasible and priced.objective_ms <= cap * (1 + 1e-9):
                gpu_of, cost = trial, priced
                if max_stages is None or len(plan.stages) <= max_stages:
                    best = (plan, priced)
                break
            if n == 1:
                refused.add(groups[0])
            n //= 2
    return gpu_of, best


class _RunTally:
    """One round of :func:`_merge_runs`: a block assignment's runs (maximal sequences of
    consecutive blocks on one GPU) with each GPU's compute and the memory its parameters leave
    it, kept up to date as runs are moved in trial; and the moves proposed from them."""

    def __init__(self, blocks: Blocks, load_b: np.ndarray, gpu_of: list[int], cost, cap: float):
        self.blocks, self.load_b, self.gpu_of, self.cap = blocks, load_b, gpu_of, cap
        P = max(gpu_of) + 1
        self.load = np.zeros(P)
        np.add.at(self.load, gpu_of, load_b)
        # memory left per GPU, as last priced; a move changes it by the parameters (with their
        # gradients and optimizer state) the GPU gains or loses, its activations being small
        self.room = [gc.memory_limit - gc.memory_bytes for gc in cost.gpus[:P]]
        self.readers: list[dict[int, int]] = [dict() for _ in range(P)]   # GPU -> parameter -> blocks
        for b, g in enumerate(gpu_of):
            for q in blocks.params[b]:
                self.readers[g][q] = self.readers[g].get(q, 0) + 1
        self.runs: list[tuple[int, int]] = []            # [start, end) of each run
        for b in range(len(gpu_of)):
            if self.runs and gpu_of[self.runs[-1][0]] == gpu_of[b]:
                self.runs[-1] = (self.runs[-1][0], b + 1)
            else:
                self.runs.append((b, b + 1))
        self.run_of = {a: i for i, (a, _e) in enumerate(self.runs)}      # first block -> run
        self.size = [float(load_b[a:e].sum()) for a, e in self.runs]
        loss = blocks.loss
        self.loss_run = next((i for i, (a, e) in enumerate(self.runs) if loss is not None and a <= loss < e), None)

    def gpu(self, i: int) -> int:
        return self.gpu_of[self.runs[i][0]]

    def shift(self, i: int, src: int, dst: int) -> None:
        """Run ``i``'s compute and parameters from GPU ``src`` to ``dst`` in the tallies."""
        self.load[dst] += self.size[i]
        self.load[src] -= self.size[i]
        used: dict[int, int] = {}
        for b in range(*self.runs[i]):
            for q in self.blocks.params[b]:
                used[q] = used.get(q, 0) + 1
        for q, k in used.items():
            if q not in self.readers[dst]:
                self.room[dst] -= int(self.blocks.param_total[q])
            self.readers[dst][q] = self.readers[dst].get(q, 0) + k
            self.readers[src][q] -= k
            if not self.readers[src][q]:
                del self.readers[src][q]
                self.room[src] += int(self.blocks.param_total[q])

    def ok(self, g: int) -> bool:
        return self.load[g] <= self.cap * (1 + 1e-9) and self.room[g] >= 0

    def near(self, i: int) -> list[int]:
        """The GPUs of run ``i``'s neighbours: a GPU on both sides first (two runs end)."""
        gs = [self.gpu(j) for j in (i - 1, i + 1) if 0 <= j < len(self.runs)]
        return sorted(set(gs), key=lambda t: (-gs.count(t), self.load[t]))

    def propose(self, refused: set[tuple]) -> list[tuple[tuple[int, int, int], ...]]:
        """Groups of moves ``((first block, end, GPU), ...)``, smallest runs first, each keeping
        the GPUs it touches within the cap and their parameters within memory (the tallies keep
        every group accepted so far), no two touching the same run or its neighbours, none the
        loss's run or in ``refused``. A group is one run moved onto a neighbour's GPU, or, where
        that GPU is over, with a run of that GPU moved on to its own neighbour's."""
        groups: list[tuple[tuple[int, int, int], ...]] = []
        taken: set[int] = set()
        for i in sorted(range(len(self.runs)), key=self.size.__getitem__):
            if {i - 1, i, i + 1} & taken or i == self.loss_run:
                continue
            group = self._move(i, taken, refused)
            if group is not None:
                groups.append(group)
                taken.update(self.run_of[a] for a, _e, _t in group)
        return groups

    def _move(self, i: int, taken: set[int], refused: set[tuple]) -> tuple | None:
        """Run ``i``'s move, alone or paired (see :meth:`propose`), left in the tallies; or None."""
        src = self.gpu(i)
        for t in self.near(i):
            self.shift(i, src, t)
            group = ((*self.runs[i], t),)
            if group not in refused and self.ok(t):
                return group
            # t is over: another run of t moves on to its own neighbour's GPU (two runs end)
            for j in sorted(range(len(self.runs)), key=self.size.__getitem__):
                if (self.gpu(j) != t or abs(j - i) <= 1 or {j - 1, j, j + 1} & taken or j == self.loss_run):
                    continue
                for u in self.near(j):
                    if u == t:
                        continue
                    self.shift(j, t, u)
                    group = ((*self.runs[i], t), (*self.runs[j], u))
                    if group not in refused and self.ok(t) and self.ok(u):
                        return group
                    self.shift(j, u, t)
            self.shift(i, t, src)
        return None


def _priced_stagings(problem: Problem, blocks: Blocks, gpu_of: list[int], stagings, max_stages: int | None,
                     misfits: list | None = None) -> tuple[list[tuple[Plan, object]], str | None]:
    """``(plan, cost)`` of each of ``stagings`` (:data:`STAGINGS`' entries) of a block assignment
    that fits, within ``max_stages`` stages and runnable by the schedule (2bw's pipeline no deeper
    than its micro-batches); and why the last one that does not fit does not (None if all do).
    ``misfits``, when given, gets ``(bytes over, plan)`` of each staging over memory."""
    from ..runtime.schedules import ScheduleError

    out, why = [], None
    for merge in stagings:
        if merge == "all":
            plan = _fewest_stages(problem, blocks.members, gpu_of)
        elif merge == "components":
            plan = _components(problem, blocks.members, gpu_of)
            if plan is None:
                continue
        else:
            plan = plan_from_assignment(problem, blocks.members, gpu_of, "exact", merge=merge)
        if max_stages is not None and len(plan.stages) > max_stages:
            why = f"{len(plan.stages)} stages, more than {max_stages}"
            continue
        try:
            cost = evaluate(problem, plan)
        except ScheduleError as exc:
            why = str(exc)
            continue
        if cost.feasible:
            out.append((plan, cost))
        else:
            why = cost.reason
            if misfits is not None and cost.overflow_bytes > 0:
                misfits.append((cost.overflow_bytes, plan))
    return out, why


def _repair_round(problem: Problem, over: list[tuple[float, int, Plan]], found: list[tuple], seconds: float,
                  max_stages: int | None) -> list[tuple]:
    """Candidates (as the solve loop keeps them, source "mip, repaired") from the best
    :data:`REPAIR_TOP` of ``over`` (MIP value, bytes over, its staging of fewest stages) whose MIP
    value is below every plan in ``found``, repaired by :func:`_repaired` within ``seconds``."""
    best = min((f[1].objective_ms for f in found), default=float("inf"))
    deadline = time.perf_counter() + seconds
    out = []
    for mip_value, _nbytes, plan in sorted(over, key=lambda o: (o[0], o[1]))[:REPAIR_TOP]:
        left = deadline - time.perf_counter()
        if left <= 0 or mip_value >= best * (1 - 1e-9):
            break
        fixed = _repaired(problem, plan, left)
        if fixed is not None and (max_stages is None or len(fixed[0].stages) <= max_stages):
            out.append((*fixed, mip_value, "mip, repaired"))
    return out


def _repaired(problem: Problem, plan: Plan, seconds: float) -> tuple[Plan, object] | None:
    """``plan`` (over memory) after Mixed-pipe's single-node moves off its over-full GPUs
    (:meth:`~ftcompile.partition.refine.Refiner.relieve`), with its cost, if it then fits; else None.

    The MIP counts activations only as a relaxation, so under tight memory its best assignments
    can miss a fit by kilobytes (BERT-6's operator graph on 6 GPUs at 1.1 x: 44 KB over on one
    GPU at a MIP value of 45.04, against 50.72 for the best plan that fit) and be cut off, while
    one node moved makes them fit at the same objective. Moves keep the stage graph acyclic and
    no stage empty; evaluate decides the fit."""
    from ..runtime.schedules import ScheduleError
    from .refine import Refiner

    r = Refiner.of_stages(problem, [(st.gpu, st.nodes) for st in plan.stages])
    try:
        if not r.relieve(max_seconds=seconds):
            return None
    except ScheduleError:           # a move deepened a 2bw pipeline past its micro-batches
        return None
    fixed = ordered(Plan("exact", plan.num_gpus, [Stage(k, g, sorted(ns)) for k, (g, ns) in enumerate(r.stages())
                                                  if ns]), problem.graph)
    try:
        cost = evaluate(problem, fixed)
    except ScheduleError:
        return None
    return (fixed, cost) if cost.feasible else None


def _rank(f: tuple) -> tuple[float, int]:
    """How candidates ``(plan, cost, ...)`` are ordered: objective (equal to 9 significant digits,
    float sums in another order being the same plan's objective), then fewer stages; the sort
    is stable, so a tie goes to the one listed first."""
    return float(f"{f[1].objective_ms:.9g}"), len(f[0].stages)


def _best_few(found: list[tuple], n: int) -> list[tuple]:
    """The ``n`` best distinct plans of ``found`` in :func:`_pick`'s order."""
    seen, best = set(), []
    for f in sorted(found, key=_rank):
        key = plan_key(f[0])
        if key not in seen:
            seen.add(key)
            best.append(f)
            if len(best) == n:
                break
    return best


def _pick(problem: Problem, found: list[tuple], simulate_top: int,
          time_limit: float | None = None, extra: list[tuple] = ()) -> tuple[tuple, Plan | None]:
    """The candidate (``(plan, cost, mip value, source)``) of lowest objective, ties and plans whose
    simulated run does not fit decided by simulation, as every strategy returns its plan
    (:func:`~ftcompile.partition.base.simulated_choice`), and the fastest plan in simulation
    (None without simulation), which the returned plan notes for compile's row ``exact-sim``.
    ``extra`` (the relaxed fewer-cuts plans) are simulated too, for the fastest."""
    found = sorted(found, key=_rank)
    extra = _best_few(list(extra), len(extra))        # (distinct plans)
    if simulate_top <= 0 or (not extra and (simulate_top == 1 or len(found) == 1)):
        return found[0], None
    by_plan = {id(f[0]): f for f in found + extra}
    lowest, fastest = simulated_choice(problem, [(f[1].objective_ms, f[0]) for f in found], simulate_top,
                                       time_limit=time_limit, extra=[(f[1].objective_ms, f[0]) for f in extra])
    return by_plan[id(lowest)], fastest
