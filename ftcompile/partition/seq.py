"""Seq-pipe partitioners: contiguous splits of the op nodes in topological order.

A *Seq-pipe* (FTPipe §4 "GPU assignment") cuts the op nodes, taken in the
graph's topological order, into ``S <= P`` contiguous ranges and puts range
``k`` on GPU ``k``. Any such split has an acyclic stage graph, since every
edge goes from a lower position to a higher one.

Three strategies live here:

* :func:`partition_seq` -- the optimal contiguous split by dynamic programming,
  as PipeDream's optimizer does for a straight pipeline, on the stage period of
  FTPipe Eq. 1 under per-GPU memory limits;
* :func:`partition_uniform` -- the same number of layers per stage (PiPPy split
  points, DeepSpeed ``partition_method="uniform"``);
* :func:`partition_params` -- contiguous stages balancing parameter bytes
  (DeepSpeed's default ``partition_method="parameters"``).

The two baselines ignore time and memory when choosing the split; they raise
:class:`~ftcompile.partition.base.Infeasible` when their split does not fit.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import numpy as np

from ..ir import OpGraph
from ..plan import Plan, Problem, Stage, evaluate
from ..units import format_bytes
from .base import SIMULATION_SHARE, Infeasible, MemoryModel, simulated_choice, with_alternative, working_set_bounds

#: Module classes that are one "layer" (basic block) of the usual model families.
LAYER_CLASSES = frozenset({
    "T5Block", "GPT2Block", "BertLayer", "RobertaLayer", "ViTLayer", "LlamaDecoderLayer",
    "MistralDecoderLayer", "OPTDecoderLayer", "BloomBlock", "GPTNeoXLayer", "GPTJBlock",
    "BartEncoderLayer", "BartDecoderLayer", "TransformerEncoderLayer", "TransformerDecoderLayer",
})
#: Module paths of an entry of a repeated module list: ``encoder.block.3``, ``transformer.h.11``...
_LAYER_PATH = re.compile(r"(^|\.)(block|blocks|h|layer|layers)\.\d+$")

_INF = float("inf")


# --------------------------------------------------------------------------- the sequence

@dataclass
class OpSequence:
    """The op nodes of a graph in topological order, with the arrays the DP sweeps over.

    Positions ``0..N-1`` index ``ids``. Per-node arrays are float64 (times) or
    int64 (bytes, so that the incremental sums of :func:`partition_seq` stay exact).
    """

    ids: list[int]
    compute_ms: np.ndarray         # forward + backward
    recompute_ms: np.ndarray
    activation_bytes: np.ndarray   # kept for backward, one micro-batch
    input_bytes: np.ndarray        # bytes of edges from graph-input nodes (as evaluate counts them)
    values: list[tuple[int, list[int], int, bool]]   # (producer pos, sorted consumer positions, bytes, floating)
    node_params: list[list[int]]   # param indices each node reads
    param_total: np.ndarray        # weights + grads + optimizer state, per param index
    param_bytes: np.ndarray        # weights only (extra weight versions)
    loss_pos: int | None
    param_names: list[str] = field(default_factory=list)   # per param index
    param_update_ms: np.ndarray | None = None                # the optimizer step of each param (additive)

    @property
    def n(self) -> int:
        return len(self.ids)


def op_sequence(problem: Problem) -> OpSequence:
    """Flatten ``problem`` into an :class:`OpSequence` (values between op nodes only)."""
    graph, prof = problem.graph, problem.profile
    ops = list(graph.op_nodes())
    pos = {n.id: i for i, n in enumerate(ops)}
    comp = np.array([prof.nodes[n.id].forward_ms + prof.nodes[n.id].backward_ms for n in ops], dtype=float)
    rec = np.array([prof.nodes[n.id].recompute_ms for n in ops], dtype=float)
    act = np.array([prof.nodes[n.id].activation_bytes for n in ops], dtype=np.int64)
    inb = np.array([sum(e.bytes for e in graph.in_edges(n.id) if graph.node(e.src).kind == "input")
                    for n in ops], dtype=np.int64)
    consumers: dict[str, set[int]] = {}
    for e in graph.edges:
        if e.src in pos and e.dst in pos:
            consumers.setdefault(e.value, set()).add(pos[e.dst])
    values = []
    for v, cs in consumers.items():
        src = graph.producer(v)
        t = graph.node(src).outputs[v].tensor
        values.append((pos[src], sorted(cs), t.bytes if t is not None else 0, bool(t is not None and t.is_floating)))
    pindex: dict[str, int] = {}
    node_params = []
    for n in ops:
        node_params.append([pindex.setdefault(p, len(pindex)) for p in dict.fromkeys(n.params)])
    names = sorted(pindex, key=pindex.get)
    ptot = np.array([prof.params[p].total for p in names], dtype=np.int64)
    pb = np.array([prof.params[p].bytes for p in names], dtype=np.int64)
    loss = next((pos[n.id] for n in ops if n.is_loss), None)
    upd = np.array([problem.update_ms([p]) for p in names], dtype=float)
    return OpSequence([n.id for n in ops], comp, rec, act, inb, values, node_params, ptot, pb, loss, names, upd)


def _plan_from_cuts(strategy: str, problem: Problem, seq: OpSequence, starts: list[int], info: dict) -> Plan:
    """Stage k holds positions ``starts[k]..starts[k+1]-1`` and runs on GPU k."""
    bounds = list(starts) + [seq.n]
    stages = [Stage(k, k, seq.ids[bounds[k]:bounds[k + 1]]) for k in range(len(starts))]
    return Plan(strategy, problem.num_gpus, stages, info)


# --------------------------------------------------------------------------- optimal (DP)

#: The share of seq's time the upset DP may use before the convex MIP runs, and the share when
#: the DP can only run with side nodes attached (too many upsets on the whole graph).
DP_SHARE, DP_SHARE_ATTACHED = 0.6, 0.3


def partition_seq(problem: Problem, *, max_stages: int | None = None, stages: int | None = None,
                  time_limit: float = 20.0, max_upsets: int = 200_000, attach_share: float = 0.02,
                  simulate_top: int = 4, mip: bool = True, mip_max_nodes: int = 1000) -> Plan:
    """The best Seq-pipe: convex stages of the DAG, one per GPU (a chain of ideals).

    Two searches, the second started from the first:

    1. :func:`order_split`: the best split of *one* topological order into
       contiguous ranges (PipeDream's DP), fast on any graph; a good plan, but a
       fixed order interleaves parallel branches (attention's Q/K/V, heads off the
       trunk), so it can miss the convex optimum;
    2. :func:`~ftcompile.partition.convex.convex_split`: a DP over the DAG's
       upsets, which considers every convex split and proves a lower bound for
       them. When the DAG has too many upsets (side nodes multiply them), side
       nodes are attached to their only neighbour and the DP runs on what is left;
       its result and bound then hold for the splits that keep them attached;
    3. when the DP did not prove its plan optimal over every convex split (side nodes
       attached, or stopped), :func:`~ftcompile.partition.exact.partition_exact` in
       ``seq`` space (a MIP whose constraints are exactly convexity, started from the
       best split so far) spends the rest of ``time_limit`` on every op node, side nodes
       included (at least 40% of it, :data:`DP_SHARE`; 70% when the DP had to attach side
       nodes, :data:`DP_SHARE_ATTACHED`, as only the MIP can then prove anything of every
       split); its bound holds for every convex split that fits. Graphs of more than
       ``mip_max_nodes`` op nodes skip it (``mip=False``: always).

    Every candidate is priced by :func:`~ftcompile.plan.evaluate`, and the plan returned is
    the lowest objective found (among splits within
    :data:`~ftcompile.partition.base.OBJECTIVE_TIE` of it, the fastest in simulation), the one
    the bound proves optimal; ``info["best_objective_ms"]`` is its objective. The
    ``simulate_top`` best by objective are simulated (:func:`~ftcompile.partition.base.simulated_choice`);
    when another of them simulates faster it is noted as ``info["simulated_alternative"]``,
    which :func:`~ftcompile.compile.compile_plan` makes the row ``seq-sim``
    (``simulate_top=0``: no simulation).
    ``info`` says what was proven: ``space`` (the splits the bound covers),
    ``optimal`` (the plan meets the bound), ``bound_ms`` and ``gap`` (absent when
    no search finished within ``time_limit`` seconds or ``max_upsets`` upsets).

    ``max_stages``: at most that many stages; ``stages``: exactly that many.

    Raises
    ------
    Infeasible
        When no convex split into at most ``P`` stages fits in memory.
    """
    from .convex import all_upsets_of, attach_side_nodes, build_units, plan_from_stages

    t0 = time.perf_counter()
    seq = op_sequence(problem)
    N = seq.n
    if N == 0:
        raise Infeasible("the graph has no op nodes to place")
    if stages is not None and not 1 <= stages <= min(problem.num_gpus, N):
        raise Infeasible(f"cannot make {stages} stages from {N} op nodes on {problem.num_gpus} GPUs")
    found = order_split(problem, seq, max_stages=max_stages, stages=stages)
    order_seconds = time.perf_counter() - t0
    feasible = [r for r in found if r[0] < _INF]
    if stages is None:
        # The multilevel acyclic partitioner makes convex splits too, and sometimes better ones
        # than a single order allows: a tighter cap for the search below.
        from .acyclic import partition_acyclic

        try:
            ap = partition_acyclic(problem, seeds=3, max_stages=max_stages)
            ap.strategy = "seq"
            cost = evaluate(problem, ap)
            if cost.feasible:
                feasible.append((cost.objective_ms, len(ap.stages), ap, cost, None, "acyclic"))
        except Infeasible:
            pass
    incumbent = min(feasible, key=lambda r: (r[0], r[1])) if feasible else None

    searches = []
    convex_plan = None
    proven: dict | None = None
    use_mip = mip and stages is None and problem.num_gpus > 1 and 1 < N <= mip_max_nodes
    # The MIP needs time of its own: the DP stops at 60% when it would run.
    dp_limit = time_limit * (DP_SHARE if use_mip else 1.0)
    for attach in (False, True):
        left = dp_limit - (time.perf_counter() - t0)
        if left <= 0:
            searches.append({"result": "stopped", "stopped": "time limit"})
            break
        groups, side = attach_side_nodes(problem, attach_share) if attach else (None, None)
        if attach and len(groups) == N:
            break                                  # nothing to attach: the same search again
        units = build_units(problem, groups, side)
        if all_upsets_of(units, max_upsets) is None:
            # Too many upsets to list: growing stages from each of them would not finish either.
            searches.append({"units": units.n, "attached": units.attached,
                             "result": f"more than {max_upsets} upsets"})
            if use_mip and not attach:
                # The DP with side nodes attached proves nothing about every convex split; only
                # the MIP can, so it gets the larger share (BERT-12's operator graph, 457 op
                # nodes, 6 GPUs: the MIP proves the optimum in about 7 s, 4.6 % below the best
                # split the attached DP reached in 6 s).
                dp_limit = time_limit * DP_SHARE_ATTACHED
            continue
        r = _probe(problem, units, incumbent[0] if incumbent else None, t0 + dp_limit,
                   max_stages=max_stages, stages=stages, max_upsets=max_upsets)
        if r is None:
            searches.append({"units": units.n, "attached": units.attached, "result": "no split fits"})
            break
        searches.append({"units": r.units, "attached": r.attached, "method": r.method, "states": r.states,
                         "candidate_stages": r.transitions, "seconds": round(r.seconds, 3),
                         "probes": r.info.get("probes"),
                         **({"stopped": r.info.get("stopped")} if not r.complete else {})})
        for cand in ([r.stages] if r.stages else []) + r.info.get("alternatives", []):
            plan = plan_from_stages("seq", problem, cand, {})
            cost = evaluate(problem, plan)
            if cost.feasible and (convex_plan is None or cost.objective_ms < convex_plan[0]):
                convex_plan = (cost.objective_ms, len(plan.stages), plan, cost, r.dp_objective_ms, "convex")
        if r.complete or r.bound_ms > 0:
            proven = {"bound_ms": r.bound_ms, "attached": r.attached, "complete": r.complete}
        if r.complete:
            break
    options = feasible + ([convex_plan] if convex_plan else [])
    best_so_far = min(options, key=lambda r: (r[0], r[1])) if options else None
    # (a DP that kept side nodes attached proves nothing about the splits that move them)
    dp_proved_none = any(x.get("result") == "no split fits" and not x.get("attached") for x in searches)
    exhaustive = dp_proved_none or (
        proven is not None and proven["complete"] and not proven["attached"]
        and best_so_far is not None and best_so_far[0] <= proven["bound_ms"] * (1 + 1e-9))
    if use_mip and not exhaustive:
        found_mip = _convex_mip(problem, best_so_far[2] if best_so_far else None,
                                time_limit - (time.perf_counter() - t0), max_stages, searches)
        if found_mip is not None:
            mplan, mcost, mbound = found_mip
            if mcost is not None:
                options.append((mcost.objective_ms, len(mplan.stages), mplan, mcost, None, "convex MIP"))
            if mbound is not None and (proven is None or mbound > proven["bound_ms"]):
                proven = {"bound_ms": mbound, "attached": 0, "complete": True, "by": "MIP"}
    if not options:
        gb = format_bytes(problem.cluster.gpu_memory)
        S = stages or min(problem.num_gpus, max_stages or problem.num_gpus, N)
        params = format_bytes(int(seq.param_total.sum()))
        acts = format_bytes(int(seq.activation_bytes.sum()))
        k_in = MemoryModel.of(problem).in_flight_max(min(S - 1, problem.micro_batches // problem.in_flight_scale
                                                         if problem.schedule == "2bw" else problem.micro_batches))
        # the DP on every node, or the MIP, proved it
        proven_none = dp_proved_none or any(x.get("method") == "MIP" and x.get("result") == "no split fits"
                                            for x in searches)
        lead = "no" if proven_none else "found no"
        why = "" if proven_none else (
            f"; {_unfinished(searches, time_limit, max_upsets)}, so one may exist"
            + (f" (the best contiguous split: {found[0][3].reason})" if found else ""))
        raise Infeasible(f"{lead} convex split of {N} op nodes into at most {S} stages fits {gb} "
                         f"per GPU under the {problem.schedule} schedule (weights, gradients and optimizer "
                         f"state are {params} in all; activations {acts} per micro-batch, "
                         f"of which the first stage keeps up to {k_in} micro-batches"
                         f"{' as inputs only (recomputation)' if problem.recomputes(False) else ''}){why}",
                         proven=proven_none)
    obj, S, plan, cost, dp_obj, source = min(options, key=lambda r: (r[0], r[1]))
    # Single-node moves between neighbouring stages: side nodes the search kept attached, and
    # whatever a fixed order could not reach.
    from .acyclic import refine_convex

    moved = refine_convex(problem, [st.nodes for st in plan.stages])
    if all(moved):
        rplan = plan_from_stages("seq", problem, moved, {})
        rcost = evaluate(problem, rplan)
        if rcost.feasible and rcost.objective_ms < obj * (1 - 1e-12):
            options.append((rcost.objective_ms, len(rplan.stages), rplan, rcost, dp_obj, source + "+refined"))
            obj, plan, cost, source = rcost.objective_ms, rplan, rcost, source + "+refined"
    best_obj = obj
    fastest = None
    if simulate_top:
        # The plan returned is the lowest objective (near-ties decided by simulation): the split the
        # bound proves optimal. The objective ignores the waits the schedule's dependencies impose,
        # so the few best are simulated too, and the fastest goes with it as its alternative.
        by_plan = {id(r[2]): r for r in options}
        chosen, fastest = simulated_choice(problem, [(r[0], r[2]) for r in options], simulate_top,
                                           time_limit=max(1.0, SIMULATION_SHARE * time_limit))
        obj, S, plan, cost, dp_obj, source = by_plan[id(chosen)]
    by_stages: dict[str, float | None] = {}
    for r in found:
        key, v = str(r[1]), (r[0] if r[0] < _INF else None)
        if key not in by_stages or (v is not None and (by_stages[key] is None or v < by_stages[key])):
            by_stages[key] = v
    sim_info = {k: plan.info[k] for k in ("simulated_period_ms", "simulated_memory_fits", "simulated_candidates")
                if k in plan.info}
    info = {
        **sim_info, "best_objective_ms": best_obj,
        "stages": S, "dp_objective_ms": dp_obj, "objective_ms": obj, "source": source,
        "send_model": "once" if source == "convex" else found_model(found, plan),
        "objective_by_stages": by_stages, "nodes": N, "searches": searches,
        "order_dp_seconds": round(order_seconds, 3),
    }
    info["space"] = "convex splits (chains of ideals), one stage per GPU"
    if proven is not None:
        # The bound deletes the side nodes the search kept attached: it holds for every convex split.
        bound = min(proven["bound_ms"], best_obj)
        info["bound_ms"] = bound
        info["bound_covers"] = "every convex split"
        # the gap of the plan returned (chosen by simulation), and of the best objective found
        info["gap"] = (obj - bound) / obj if obj > 0 else 0.0
        info["best_objective_gap"] = (best_obj - bound) / best_obj if best_obj > 0 else 0.0
        info["optimal"] = info["gap"] <= 1e-9
        info["search"] = (
            "the convex-split MIP's bound (every op node)" if proven.get("by") == "MIP" else
            ("exhaustive" if proven["complete"] else "stopped at the time limit")
            + (f", {proven['attached']} side nodes attached" if proven["attached"] else ""))
    else:
        info["optimal"] = False
        stopped = any("stopped" in x for x in searches)
        info["search"] = ("stopped at the time limit" if stopped else f"not run: more than {max_upsets} upsets") + \
            "; best of one topological order, the acyclic partitioner and single-node moves"
    info["seconds"] = round(time.perf_counter() - t0, 3)
    plan.info = info
    if fastest is not None:
        with_alternative(plan, fastest)
    return plan


def _convex_mip(problem: Problem, warm: Plan | None, seconds: float, max_stages: int | None,
                searches: list) -> tuple[Plan, object, float | None] | None:
    """Exact's MIP over convex splits (``space="seq"``), warm-started from ``warm``: the best
    plan it found that fits (and its cost, None when none fits) and its bound over every convex
    split that fits (None when it has none). None when it found no plan (``searches`` says
    whether it proved that none fits). Appends what it did to ``searches``."""
    from .convex import plan_from_stages
    from .exact import partition_exact

    if seconds < 0.5:
        searches.append({"method": "MIP", "result": "no time left"})
        return None
    t = time.perf_counter()
    try:
        plan = partition_exact(problem, space="seq", time_limit=seconds, max_nodes=10**9,
                               warm_plan=warm, simulate_top=0, max_stages=max_stages,
                               max_rounds=50)       # lazy memory cuts (each round prices ~20 splits)
    except Infeasible as exc:
        searches.append({"method": "MIP", "result": "no split fits" if exc.proven else str(exc),
                         **({"why": exc.reason} if exc.proven else {}),
                         "seconds": round(time.perf_counter() - t, 3)})
        return None
    info = plan.info
    bound = info.get("space_bound_ms") if not info.get("coarsened") else None
    searches.append({"method": "MIP", "status": info.get("status"), "bound_ms": bound,
                     "objective_ms": info.get("objective_ms"), "seconds": round(time.perf_counter() - t, 3)})
    # In seq space GPU g holds the chain's g-th stage: stages in that order, as the DP gives them.
    plan = plan_from_stages("seq", problem, [st.nodes for st in sorted(plan.stages, key=lambda st: st.gpu)], {})
    cost = evaluate(problem, plan)
    return plan, (cost if cost.feasible else None), bound


def _unfinished(searches: list[dict], time_limit: float, max_upsets: int) -> str:
    """Why the searches over convex splits (``searches``, as :func:`partition_seq` records them)
    proved nothing, in words."""
    why = []
    if any("stopped" in x for x in searches):
        why.append(f"the search over convex splits stopped at the time limit ({time_limit:g} s)")
    if any(str(x.get("result", "")).startswith("more than") for x in searches):
        why.append(f"the DP could not search every convex split (more than {max_upsets} upsets to list)")
    if any(x.get("attached") and x.get("result") == "no split fits" for x in searches):
        why.append("the DP found none only with side nodes attached to their neighbours, which says nothing of "
                   "the splits that move them")
    if not any(x.get("method") == "MIP" for x in searches):
        why.append("the convex-split MIP did not run")
    elif not any(x.get("method") == "MIP" and x.get("result") == "no split fits" for x in searches):
        why.append("the convex-split MIP did not finish")
    return "; ".join(why) or "no search over convex splits finished"


def _probe(problem: Problem, units, upper: float | None, deadline: float, **options):
    """:func:`~ftcompile.partition.convex.convex_split` under rising caps, up to ``upper``.

    A search under cap ``T`` visits only stages and splits that stay within ``T``, so
    it is much cheaper below the optimum than at it. Each search that finishes
    without a split proves the optimum lies above its cap; the first that finds one
    has found the optimum. So even when the last search runs out of time, the
    result carries a proven bound (``bound_ms``) and ``complete=False``.
    """
    import dataclasses

    from ..plan import lower_bound
    from .convex import convex_split, plan_from_stages

    if upper is None:
        return convex_split(problem, units=units, time_limit=max(0.0, deadline - time.perf_counter()), **options)
    lo = lower_bound(problem)
    caps = [lo + f * (upper - lo) for f in (0.25, 0.5, 0.75, 0.9, 0.97)] if upper > lo * (1 + 1e-6) else []
    caps = [c for c in caps if c < upper] + [upper]
    proven, probes, spent = 0.0, [], {"states": 0, "transitions": 0}
    r = None
    found_at = None
    while caps:
        cap = caps.pop(0)
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        r = convex_split(problem, units=units, upper_bound_ms=cap, time_limit=left, **options)
        if r is None:
            return None
        probes.append({"cap_ms": cap, "complete": r.complete, "found": bool(r.stages),
                       "seconds": round(r.seconds, 3)})
        spent["states"] += r.states
        spent["transitions"] += r.transitions
        if not r.complete:
            break
        if not r.stages:
            proven = max(proven, r.bound_ms)
            continue
        if found_at is not None:
            break
        # The search prices a value read by several later stages once (its lower bound); the
        # plan found may cost more once evaluated. One more search, capped at that cost, lets
        # the pessimistic pricing find the plans within it.
        best = min(evaluate(problem, plan_from_stages("seq", problem, st, {})).objective_ms
                   for st in [r.stages] + r.info.get("alternatives", []))
        found_at = cap
        if best > cap * (1 + 1e-9):
            caps = [min(best, upper)]
        else:
            break
    if r is None:
        return None
    bound = r.bound_ms if r.complete else proven
    return dataclasses.replace(r, bound_ms=bound, states=spent["states"], transitions=spent["transitions"],
                               seconds=sum(p["seconds"] for p in probes), info={**r.info, "probes": probes})


def found_model(found: list, plan: Plan) -> str | None:
    """The send model of the order-DP result that produced ``plan``."""
    for r in found:
        if r[2] is plan:
            return r[5]
    return None


def order_split(problem: Problem, seq: OpSequence, *, max_stages: int | None = None,
                stages: int | None = None) -> list[tuple]:
    """The best splits of the graph's topological order into contiguous ranges, range k on GPU k.

    For every stage count ``S`` in ``1..P`` (or just ``stages``; at most
    ``max_stages``), a DP over the order finds the split into ``S`` non-empty
    ranges that minimises the largest stage period of FTPipe Eq. 1 subject to
    every GPU's memory limit, under two send models (:data:`SEND_MODELS`: a value
    read by several later stages sent once, a lower bound, or once per later stage
    that may read it, an upper bound; both exact for values with one reader).
    Stage ``k`` of ``S`` is taken to have depth ``S - 1 - k`` (the most it can
    have). Memory is checked twice (:data:`MEMORY_MODELS`): with
    :meth:`~ftcompile.partition.base.MemoryModel.stage_upper`, a proven upper bound of
    what evaluate charges the stage's GPU (so these splits fit), and with
    :meth:`~ftcompile.partition.base.MemoryModel.stage_lower`, a proven lower bound (so
    no split that fits is pruned, and a split it finds that evaluate accepts is the best
    split of the order). The sweep keeps the bytes crossing
    each cut, received by each range and the distinct parameters each range reads
    as incremental int64 arrays: ``O(N^2 P^2)`` vectorised work (about 4 s for a
    4,900-node graph on 8 GPUs).

    Returns ``(objective or inf, S, plan, cost, dp objective, send model)`` per
    distinct plan, priced by :func:`~ftcompile.plan.evaluate`.
    """
    N = seq.n
    P = min(problem.num_gpus, max_stages or problem.num_gpus, N)
    counts = [stages] if stages else list(range(1, P + 1))
    if len(counts) > 16:
        # Each count costs a DP of its own: past 16 of them, every count up to 8 and then a
        # geometric ladder up to P (fewer stages only ever win on memory or communication).
        ladder = set(range(1, 9)) | {P}
        x = 8.0
        while x < P:
            x *= 1.25
            ladder.add(min(P, int(round(x))))
        counts = sorted(ladder)
    best, arg = _seq_dp(problem, seq, counts)
    results, seen = [], set()
    for key in best:
        model, S = key[0], key[-1]
        if best[key] == _INF:
            continue
        starts = [0] * S
        j = N
        for k in range(S - 1, -1, -1):
            i = int(arg[key][k][j]) if k > 0 else 0
            starts[k] = i
            j = i
        if tuple(starts) in seen:
            continue
        seen.add(tuple(starts))
        plan = _plan_from_cuts("seq", problem, seq, starts, {})
        cost = evaluate(problem, plan)
        results.append((cost.objective_ms if cost.feasible else _INF, S, plan, cost, best[key], model))
    return results


#: How the DP checks memory: a proven upper bound (what it accepts fits) or a proven lower bound
#: (what fits is never pruned).
MEMORY_MODELS = ("upper", "lower")

#: How the DP prices a value read by several later stages: sent once (a lower bound on what
#: evaluate counts), or once per later stage that may read it (an upper bound).
SEND_MODELS = ("once", "fanout")


def _seq_dp(problem: Problem, seq: OpSequence, counts: list[int]):
    """DP tables for every stage count in ``counts`` and every send model in :data:`SEND_MODELS`.

    ``arg[m, S][k][j]`` is the best start of stage ``k`` (of ``S``) when it ends
    just before position ``j``; ``best[m, S]`` the DP objective of the best
    ``S``-split under send model ``m``. Under ``fanout`` a value crossing the end
    of stage ``k`` is sent ``min(r, S - 1 - k)`` times, ``r`` its readers after
    the cut.
    """
    from ..runtime.schedules import ScheduleError

    N = seq.n
    mm = MemoryModel.of(problem)
    cluster = problem.cluster

    def possible(S):
        try:
            mm.in_flight(S - 1)
            return True
        except ScheduleError:               # 2bw/2gw: a pipeline deeper than M
            return False
    counts = [S for S in counts if possible(S)]
    if not counts:
        return {}, {}
    cmp = np.concatenate([[0.0], np.cumsum(seq.compute_ms)])
    crc = np.concatenate([[0.0], np.cumsum(seq.recompute_ms)])
    cact = np.concatenate([[0], np.cumsum(seq.activation_bytes)])
    cinb = np.concatenate([[0], np.cumsum(seq.input_bytes)])
    rec_mid = problem.recomputes(False)
    rec_lastloss = problem.recomputes(True)

    # Sweep bookkeeping. Values that cross cut j (before position j): produced < j, read >= j.
    produced_at: list[list[int]] = [[] for _ in range(N)]                # pos -> value indices made there
    read_by: list[list[int]] = [[] for _ in range(N)]                    # pos -> value indices read
    for vi, (p, cs, b, _fl) in enumerate(seq.values):
        produced_at[p].append(vi)
        for c in cs:
            read_by[c].append(vi)
    Mx = max(counts)
    # send_w[m, p]: bytes made at p still read at or after j, each value counted min(readers left, m)
    # times (row 1: once); rows are the later-stage counts a stage can have.
    send_w = np.zeros((max(Mx, 2), N), dtype=np.int64)
    left = [len(cs) for _p, cs, _b, _f in seq.values]
    ms = np.arange(1, max(Mx, 2))
    recv_d = np.zeros(N + 1, dtype=np.int64)    # difference array over i: bytes received by [i, j)
    recvf_d = np.zeros(N + 1, dtype=np.int64)   # the same, floating values only (gradients come back)
    last_c = [-1] * len(seq.values)             # last consumer position < j, per value
    par_w = np.zeros(N, dtype=np.int64)         # by last reading position < j: param total bytes
    parb_w = np.zeros(N, dtype=np.int64)        # the same, weight bytes only
    last_p = [-1] * len(seq.param_total)

    bw_send = [cluster.bandwidth(k, k + 1) if k + 1 < problem.num_gpus else 1.0 for k in range(max(counts))]
    bw_recv = [cluster.bandwidth(k - 1, k) if k > 0 else 1.0 for k in range(max(counts))]
    limit = mm.limit

    # (send model, memory model, S): the upper memory bound under both send models (plans
    # that fit), the lower one with values sent once (the order's optimum is no lower).
    keys = [(m, mem, S) for m, mem in (("once", "upper"), ("fanout", "upper"), ("once", "lower")) for S in counts]
    best_tab = {key: [np.full(N + 1, _INF) for _ in range(key[2])] for key in keys}
    arg = {key: [np.full(N + 1, -1, dtype=np.int64) for _ in range(key[2])] for key in keys}
    best: dict[tuple[str, str, int], float] = {}
    wsf, wsb = working_set_bounds(problem, seq.ids)
    graph, prof = problem.graph, problem.profile
    readers: dict[str, set[int]] = {}
    for n in seq.ids:
        for prm in graph.node(n).params:
            readers.setdefault(prm, set()).add(n)
    upd_w = np.zeros(N)                          # by last reading position < j: update ms / M
    upd_ms = (seq.param_update_ms if seq.param_update_ms is not None else np.zeros(len(seq.param_total))) \
        / problem.micro_batches
    # Tied tensors: a stage holding some but not all of a tensor's readers sums the other holders'
    # gradient parts before its update; charged as if every other reader were in another stage
    # (exact for a tensor read by two nodes, an upper bound otherwise).
    from ..plan import _shared_sum_ms, shared_gradient_copies

    tied = []
    npos = {n: i for i, n in enumerate(seq.ids)}
    for prm, r in readers.items():
        if len(r) > 1 and prof.params[prm].grad_bytes:
            rp = sorted(npos[n] for n in r)
            tied.append((rp, {S: _shared_sum_ms(problem, [prm], {prm: min(S, len(r))}) / problem.micro_batches
                              for S in counts},
                         # memory: the other holders' gradients waiting (at most min(S, readers) - 1)
                         # and the update's sum and stand-in (shared_gradient_receive and
                         # shared_update_transient, with every other reader in another stage)
                         {S: (shared_gradient_copies(min(S, len(r)) - 1, 1, problem.shared_lag) + 2)
                          * prof.params[prm].grad_bytes for S in counts}))
    trainable_w = np.zeros(N, dtype=np.int64)   # by last reading position < j: trainable weight bytes
    trainable = np.array([prof.params[nm].bytes if prof.params[nm].grad_bytes else 0
                          for nm in seq.param_names], dtype=np.int64)

    for j in range(1, N + 1):
        q = j - 1                              # the node that joins ranges ending at j
        for vi in produced_at[q]:
            send_w[1:, q] += seq.values[vi][2] * np.minimum(left[vi], ms)
        for vi in read_by[q]:
            p, _cs, b, fl = seq.values[vi]
            send_w[left[vi]:, p] -= b          # min(left, m) drops by one where m >= left
            left[vi] -= 1
            old = last_c[vi]
            if old < 0:
                recv_d[p + 1] += b
                recvf_d[p + 1] += b if fl else 0
            else:
                recv_d[old + 1] += b
                recvf_d[old + 1] += b if fl else 0
            recv_d[q + 1] -= b
            recvf_d[q + 1] -= b if fl else 0
            last_c[vi] = q
        for pi in seq.node_params[q]:
            old = last_p[pi]
            if old >= 0:
                par_w[old] -= seq.param_total[pi]
                parb_w[old] -= seq.param_bytes[pi]
                trainable_w[old] -= trainable[pi]
                upd_w[old] -= upd_ms[pi]
            par_w[q] += seq.param_total[pi]
            parb_w[q] += seq.param_bytes[pi]
            trainable_w[q] += trainable[pi]
            upd_w[q] += upd_ms[pi]
            last_p[pi] = q

        # Vectors over the range start i in [0, j).
        send_rows: dict[int, np.ndarray] = {}

        def send_b(m):
            if m not in send_rows:
                send_rows[m] = np.cumsum(send_w[m, :j][::-1])[::-1]
            return send_rows[m]
        recv_b = np.cumsum(recv_d[:j])
        recvf_b = np.cumsum(recvf_d[:j])
        params = np.cumsum(par_w[:j][::-1])[::-1]
        weights = np.cumsum(trainable_w[:j][::-1])[::-1]
        # the optimizer step's share U / M
        comp = cmp[j] - cmp[:j] + np.cumsum(upd_w[:j][::-1])[::-1]
        rcmp = crc[j] - crc[:j]
        act_full = cact[j] - cact[:j]
        inputs = cinb[j] - cinb[:j]
        ws_f = np.maximum.accumulate(wsf[:j][::-1])[::-1]
        ws_b = np.maximum.accumulate(wsb[:j][::-1])[::-1]
        sent = send_b(1) if j < N else np.zeros(j, dtype=np.int64)

        tied_now = []
        if tied:
            starts = np.arange(j)
            for rp, cost, nbytes in tied:
                below = [r for r in rp if r < j]
                if not below:
                    continue
                some = starts <= below[-1]
                every = (starts <= rp[0]) & (rp[-1] < j)
                tied_now.append((some & ~every, cost, nbytes))

        def period(rec, k, m, S):
            c = comp + rcmp * rec
            for mask, cost, _b in tied_now:
                c = c + mask * cost[S]
            s = send_b(m) * (1e3 / bw_send[k]) if j < N else 0.0
            r = recvf_b * (1e3 / bw_recv[k])
            return c + np.maximum(0.0, s - c) + np.maximum(0.0, r - c)

        def fits(rec, depth, S, mem):
            # rec: whether each candidate stage recomputes (a bool, or one per range start)
            kw = dict(depth=depth, params_total=params, trainable=weights, recomputes=rec, act_full=act_full,
                      recv=recv_b, inputs=inputs)
            if mem == "lower":
                return mm.stage_lower(**kw) <= limit
            shared = sum((mask * nbytes[S] for mask, _c, nbytes in tied_now), np.zeros(j, dtype=np.int64))
            return mm.stage_upper(**kw, deepest=S - 1, grads_back=sent, send=sent, ws_fwd=ws_f, ws_bwd=ws_b,
                                  shared_extra=shared) <= limit

        per_cache: dict = {}
        fit_cache: dict = {}
        for model, mem, S in keys:
            for k in range(min(S, j)):
                last = k == S - 1
                if last and j != N:
                    continue
                depth = S - 1 - k
                m = 1 if model == "once" else max(1, depth)
                if last:
                    rec = np.array([rec_lastloss if (seq.loss_pos is None or i <= seq.loss_pos) else rec_mid
                                    for i in range(j)]) if rec_lastloss != rec_mid else rec_mid
                    per = period(rec, k, m, S)
                    ok = fits(rec, depth, S, mem)
                else:
                    pkey = (bw_send[k], bw_recv[k], m, S if tied_now else 0)
                    if pkey not in per_cache:
                        per_cache[pkey] = period(rec_mid, k, m, S)
                    fkey = (depth, S, mem)
                    if fkey not in fit_cache:
                        fit_cache[fkey] = fits(rec_mid, depth, S, mem)
                    per, ok = per_cache[pkey], fit_cache[fkey]
                key = (model, mem, S)
                tab, at = best_tab[key], arg[key]
                if k == 0:
                    tab[0][j] = per[0] if ok[0] else _INF
                    at[0][j] = 0
                else:
                    cand = np.where(ok, np.maximum(tab[k - 1][:j], per), _INF)
                    i = int(np.argmin(cand))
                    tab[k][j] = cand[i]
                    at[k][j] = i
                if last:
                    best[key] = float(tab[k][N])
    return best, arg


# --------------------------------------------------------------------------- baselines

def layer_keys(graph: OpGraph) -> list[str | None]:
    """For each op node (topological order), the path of the layer it belongs to, or None.

    A layer is the outermost module in a node's stack whose class is in
    :data:`LAYER_CLASSES` or whose path is an entry of a repeated module list
    (``*.block.N``, ``*.h.N``, ``*.layer.N``, ``*.layers.N``).
    """
    keys: list[str | None] = []
    for n in graph.op_nodes():
        key = None
        for path, cls in n.scopes:
            if cls.rsplit(".", 1)[-1] in LAYER_CLASSES or _LAYER_PATH.search(path):
                key = path
                break
        if key is None and n.scope_class in LAYER_CLASSES:   # layer granularity: the node is the block
            key = n.scope
        keys.append(key)
    return keys


def _runs(keys: list[str | None]) -> list[tuple[int, str | None]]:
    """Start positions and keys of maximal runs of equal keys."""
    out: list[tuple[int, str | None]] = []
    for i, k in enumerate(keys):
        if not out or out[-1][1] != k:
            out.append((i, k))
    return out


def _checked(problem: Problem, plan: Plan, what: str) -> Plan:
    cost = evaluate(problem, plan)
    if not cost.feasible:
        raise Infeasible(f"{what} does not fit memory: {cost.reason}")
    plan.info["objective_ms"] = cost.objective_ms
    return plan


def partition_uniform(problem: Problem) -> Plan:
    """``P`` contiguous stages with equal numbers of layers (PiPPy / DeepSpeed ``uniform``).

    Layers are found by :func:`layer_keys`; op nodes outside any layer (embeddings,
    heads, masks) join the layer before them, or the first layer if they come
    first. ``L`` layers on ``P`` GPUs give the first ``L mod P`` stages one layer
    more. With fewer layers than GPUs, one layer per stage. A graph without
    recognisable layers is split into equal numbers of op nodes (``info`` says so).

    Raises
    ------
    Infeasible
        When the split does not fit memory.
    """
    seq_ids = [n.id for n in problem.graph.op_nodes()]
    N = len(seq_ids)
    keys = layer_keys(problem.graph)
    info: dict = {}
    # A layer starts where its key first appears; later reappearances (rare) stay put.
    starts, seen = [], set()
    for i, k in enumerate(keys):
        if k is not None and k not in seen:
            seen.add(k)
            starts.append(i)
    if starts:
        starts[0] = 0                          # leading non-layer nodes join the first layer
        info["layers"] = len(starts)
    else:
        starts = list(range(N))
        info["layers"] = 0
        info["note"] = "no layers recognised: equal numbers of op nodes per stage"
    L = len(starts)
    S = min(problem.num_gpus, L)
    q, r = divmod(L, S)
    cuts, layer = [], 0
    for k in range(S):
        cuts.append(starts[layer])
        layer += q + (1 if k < r else 0)
    info["layers_per_stage"] = [q + (1 if k < r else 0) for k in range(S)]
    stages = [Stage(k, k, seq_ids[cuts[k]:(cuts[k + 1] if k + 1 < S else N)]) for k in range(S)]
    return _checked(problem, Plan("uniform", problem.num_gpus, stages, info), "the uniform split")


def partition_params(problem: Problem) -> Plan:
    """Contiguous stages balancing parameter bytes (DeepSpeed ``partition_method="parameters"``).

    The units are runs of op nodes in one layer (:func:`layer_keys`) and runs of
    nodes outside layers (embeddings, head), so cuts fall between layers as in
    DeepSpeed. A unit weighs the bytes of the parameters it is first to read
    (each tensor once, tied weights where first used). The split into at most
    ``P`` non-empty stages minimising the heaviest stage is found as DeepSpeed's
    ``partition_balanced`` does (bisection on the bottleneck, greedy packing).

    Raises
    ------
    Infeasible
        When the split does not fit memory.
    """
    graph, prof = problem.graph, problem.profile
    seq_ids = [n.id for n in graph.op_nodes()]
    N = len(seq_ids)
    runs = _runs(layer_keys(graph))
    unit_start = [s for s, _k in runs]
    seen: set[str] = set()
    node_w = []
    for nid in seq_ids:
        w = 0
        for p in graph.node(nid).params:
            if p not in seen:
                seen.add(p)
                w += prof.params[p].bytes
        node_w.append(w)
    if len(runs) == 1 and runs[0][1] is None:
        unit_start = list(range(N))            # no layers: every op node is a unit
    bounds = unit_start + [N]
    w = [sum(node_w[bounds[u]:bounds[u + 1]]) for u in range(len(unit_start))]
    U = len(w)
    S = min(problem.num_gpus, U)
    cw = np.concatenate([[0], np.cumsum(w)]).astype(np.int64)
    cuts = _balanced_cuts(w, S)
    S = len(cuts)
    stages = [Stage(k, k, seq_ids[bounds[cuts[k]]:(bounds[cuts[k + 1]] if k + 1 < S else N)]) for k in range(S)]
    info = {"units": U, "param_bytes_per_stage": [int(cw[(cuts[k + 1] if k + 1 < S else U)] - cw[cuts[k]])
                                                  for k in range(S)]}
    return _checked(problem, Plan("params", problem.num_gpus, stages, info), "the parameter-balanced split")


def _balanced_cuts(w: list[int], S: int) -> list[int]:
    """Start units of ``S`` non-empty contiguous parts of ``w`` minimising the heaviest part.

    Bisection on the bottleneck ``B`` with greedy left-to-right packing (which
    needs the fewest parts for a given ``B``); parts are then split at their
    middle unit, largest part first, until there are ``S`` (splitting never
    raises the bottleneck).
    """
    def pack(B: int) -> list[int] | None:
        starts, acc = [0], 0
        for u, x in enumerate(w):
            if x > B:
                return None
            if acc + x > B:
                starts.append(u)
                acc = 0
            acc += x
        return starts if len(starts) <= S else None

    lo, hi = max(w, default=0), sum(w)
    while lo < hi:
        mid = (lo + hi) // 2
        if pack(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    starts = pack(lo) or [0]
    while len(starts) < S:
        ends = starts[1:] + [len(w)]
        k = max(range(len(starts)), key=lambda k: ends[k] - starts[k])
        if ends[k] - starts[k] < 2:
            break
        starts.insert(k + 1, (starts[k] + ends[k] + 1) // 2)
    return starts
