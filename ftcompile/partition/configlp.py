"""A lower bound on every plan's objective from the configuration LP (column generation).

The MIP of :mod:`~ftcompile.partition.exact` bounds the objective by its LP relaxation, which
sees none of the integrality of whole blocks: on GNMT's layer graph on 6 GPUs its bound stays
at total/P (112.04 after 600 s) while the best plan is 118.697. The configuration LP (Gilmore
and Gomory's for bin packing) keeps each GPU's set of nodes whole: for a load ``T`` it asks how
many GPUs' worth of node sets, each within ``T`` and the GPU's memory, cover every node. When
that LP needs more than ``P`` GPUs, no plan has a largest GPU load of ``T`` or less.

What :func:`configuration_bound` relaxes, so that it stays below every plan (mixed or convex):

* a GPU's load is the sum of its nodes' forward, backward and recomputation times (the last only
  where every stage inside the pipeline recomputes, in either 2gw group) and their
  optimizer steps' share per micro-batch (:meth:`~ftcompile.plan.Problem.update_ms`, additive
  over parameters), a parameter read by several nodes split evenly among them; links cost
  nothing (every transfer only adds to Eq. 1's period);
* a GPU's memory is its nodes' weights, gradients and optimizer state, a shared parameter split
  evenly among its readers; activations and buffers count nothing;
* a node with no path to the loss (a side output; what follows the loss) is charged no
  recomputation: a sink stage of its own skips it on any GPU;
* one GPU (a "loss" column) may skip the recomputation of a set of the other nodes closed under
  consumers (the last stage, a sink of the stage graph holding the loss, is such a set), where
  the schedule has the end of the pipeline skip it.

Columns come from column generation: greedy fills by dual value, and every ``MIP_EVERY`` rounds
(or when those find none) a knapsack MIP (HiGHS) with those two rows (and, for the loss column,
the closure rows). A load ``T`` is decided as soon as the restricted LP covers every node with
``P`` GPUs or fewer (its value bounds the LP's from above) or Farley's bound exceeds ``P`` (the
duals divided by the pricing MIP's dual bound on any column's value: a bound from below, also
where a MIP stopped at its time limit). Columns are kept from one ``T`` to the next, and ``T`` is
bisected. Measured on the held-out layer graphs (benchmarks/README): GNMT on 6 GPUs 118.696,
BERT-24 on 6 GPUs at 1.2 x 59.368 and at 1.1 x 71.251, each within 1e-3 ms of the best plan
found, in 0.3 to 0.6 s. Near its threshold on graphs of many small nodes (operator graphs), a
load can take thousands of rounds: column generation's tailing off, hence the time limits.
"""

from __future__ import annotations

import time

import numpy as np

from ..plan import Problem

#: Tolerances: a column must improve the LP by more than this; ``T`` needs more than ``P + EPS`` GPUs.
EPS = 1e-7
#: Greedy columns tried before the pricing MIP, per round (orders of the items by dual value).
GREEDY_ORDERS = 3
#: Rounds of greedy columns between two rounds of the pricing MIPs: greedy columns are cheap but
#: tail off (on operator graphs, thousands of rounds a tenth of a percent each); the MIP's are
#: the best columns and give Farley's bound.
MIP_EVERY = 10
#: Cost of an artificial column, per GPU of the cluster (see :meth:`ConfigurationLP.exceeds`).
ARTIFICIAL = 1e3


def _highs():
    import highspy

    from .exact import _option, _quiet_fd1

    with _quiet_fd1():
        h = highspy.Highs()                 # (its banner, printed before any option applies)
    h.setOptionValue("output_flag", False)
    _option(h, "threads", 1)
    return h


class ConfigurationLP:
    """The nodes' times and memory as the LP prices them, the columns found so far (kept from
    one load ``T`` to the next: a node set within ``T`` stays within any larger one), and the
    pricing problems.

    A column is ``(kind, items)``: kind 0 an ordinary GPU, kind 1 the one GPU that may skip
    the recomputation of a node set closed under consumers; its load is kept beside it.
    """

    def __init__(self, problem: Problem):
        g = problem.graph
        self.problem = problem
        nodes = [n.id for n in g.op_nodes()]
        readers: dict[str, int] = {}
        for n in nodes:
            for q in g.node(n).params:
                readers[q] = readers.get(q, 0) + 1
        # Which stages recompute (Problem.recomputes): the interior, and the end of the pipeline
        # may skip it. Stages at depth 0 skip: the last stage, holding the loss and every node it
        # runs with a path to the loss ("live", Problem.feeds_loss), and any other sink of the
        # stage graph, which holds only nodes without one ("dead": a side output; after the
        # loss). A dead node may so skip on any GPU: it is charged no recomputation. With no
        # loss node every node is dead.
        recompute_all = problem.recomputes(False)
        end_skips = recompute_all and not problem.recomputes(True)
        live = set(nodes) if not end_skips else problem.feeds_loss
        self.skip = end_skips and bool(live)
        self.w, self.rec, self.mem = {}, {}, {}
        for n in nodes:
            c = problem.profile.nodes[n]
            params = g.node(n).params
            upd = sum(problem.update_ms({q}) / readers[q] for q in params) / problem.micro_batches
            self.rec[n] = c.recompute_ms if recompute_all and n in live else 0.0
            self.w[n] = c.forward_ms + c.backward_ms + self.rec[n] + upd
            self.mem[n] = sum(problem.profile.params[q].total / readers[q] for q in params)
        self.nodes = nodes
        self.items = [n for n in nodes if self.w[n] > 0 or self.mem[n] > 0]
        self.edges = [(e.src, e.dst) for e in g.edges if e.src in self.w and e.dst in self.w]
        self.limit = problem.cluster.gpu_memory
        self.gpus = problem.num_gpus
        # every column found, with its load: (kind, item indices) -> load ms
        self.columns: dict[tuple[int, frozenset[int]], float] = {}
        # (a loss column of one node is a configuration only where the node feeds no other item:
        # the pricing MIP finds loss columns, closed under consumers)
        for i, n in enumerate(self.items):
            if self.mem[n] <= self.limit:
                self.columns[(0, frozenset([i]))] = self.w[n]
        self.stats = {"probes": 0, "rounds": 0, "pricing_mips": 0}

    # -- pricing ----------------------------------------------------------------------------

    def _greedy(self, pi: list[float], T: float) -> list[frozenset[int]]:
        """Ordinary node sets within ``T`` and memory, filled greedily by dual value per share of
        the two capacities, in a few orders: candidate columns without a MIP."""
        items, w, mem = self.items, self.w, self.mem
        cap = self.limit if self.limit > 0 else float("inf")
        pos = [i for i in range(len(items)) if pi[i] > EPS]
        keys = [lambda i: pi[i] / max(w[items[i]] / T, mem[items[i]] / cap, 1e-12),
                lambda i: pi[i] / max(w[items[i]] / T + mem[items[i]] / cap, 1e-12),
                lambda i: pi[i]][:GREEDY_ORDERS]
        out = []
        for key in keys:
            load = used = 0.0
            chosen = []
            for i in sorted(pos, key=key, reverse=True):
                n = items[i]
                if load + w[n] <= T and used + mem[n] <= self.limit:
                    load += w[n]
                    used += mem[n]
                    chosen.append(i)
            out.append(frozenset(chosen))
        return out

    def _price(self, pi: list[float], T: float, loss: bool, seconds: float) -> tuple[float, float, frozenset[int], float]:
        """The node set of largest dual value within ``T`` and memory, by a knapsack MIP:
        ``(its value, an upper bound on any set's value, item indices, its load)``. The bound
        is the MIP's dual bound, so it holds also where the time ran out first."""
        from .exact import _option

        h = _highs()
        _option(h, "time_limit", max(seconds, 0.01))
        _option(h, "mip_rel_gap", 1e-6)
        items = self.items
        x = [h.addBinary() for _ in items]
        w = [self.w[n] for n in items]
        load = h.qsum([w[i] * x[i] for i in range(len(items))])
        u = {}
        if loss and self.skip:
            at = {n: i for i, n in enumerate(items)}
            u = {n: h.addBinary() for n in self.nodes}     # n in the set that skips recomputation
            for n in self.nodes:
                if n in at:
                    h.addConstr(u[n] - x[at[n]] <= 0)
                # (a node of no time and no memory may join it at no cost: left free)
            for a, b in self.edges:
                h.addConstr(u[a] - u[b] <= 0)
            load = load - h.qsum([self.rec[n] * u[n] for n in self.nodes])
        h.addConstr(load <= T)
        h.addConstr(h.qsum([self.mem[n] * x[i] for i, n in enumerate(items)]) <= self.limit)
        h.setObjective(h.qsum([pi[i] * x[i] for i in range(len(items))]))
        h.setMaximize()
        h.run()
        self.stats["pricing_mips"] += 1
        info = h.getInfo()
        upper = max(info.mip_dual_bound, info.objective_function_value)
        if info.primal_solution_status != 2:         # (no feasible set found in the time)
            return 0.0, upper, frozenset(), 0.0
        xv = h.vals(x)
        chosen = frozenset(i for i in range(len(items)) if xv[i] > 0.5)
        skipped = sum(self.rec[n] for n, v in zip(u, h.vals(list(u.values()))) if v > 0.5) if u else 0.0
        return info.objective_function_value, upper, chosen, sum(w[i] for i in chosen) - skipped

    # -- the LP at one load -----------------------------------------------------------------

    def exceeds(self, T: float, deadline: float | None = None) -> bool | None:
        """Whether the configuration LP at load ``T`` needs more than ``P`` GPUs: True (proven:
        no plan has a largest load of ``T`` or less), False (a combination of known columns
        covers every node with ``P`` GPUs or fewer), None (``deadline``, a ``perf_counter``
        time, passed first).

        Column generation stops as soon as either is shown: the restricted LP's value is an
        upper bound on the LP's, and Farley's bound (the restricted LP's duals scaled by the
        best column's priced value, the pricing MIP's dual bound) a lower one.
        """
        import highspy

        self.stats["probes"] += 1
        items, P = self.items, self.gpus
        if any((0, frozenset([i])) not in self.columns for i in range(len(items))):
            return True                     # (a node whose weights alone exceed a GPU)
        if any(self.w[n] - self.rec[n] > T for n in items):
            return True                     # (a node alone above T on any GPU)
        inf = highspy.kHighsInf
        lp = _highs()
        for _ in items:
            lp.addRow(1.0, inf, 0, np.array([], dtype=np.int32), np.array([], dtype=np.float64))
        lp.addRow(-inf, 1.0, 0, np.array([], dtype=np.int32), np.array([], dtype=np.float64))
        loss_row = len(items)
        in_lp: set[tuple[int, frozenset[int]]] = set()

        def add(key: tuple[int, frozenset[int]]) -> None:
            k, s = key
            idx = sorted(s) + ([loss_row] if k else [])
            lp.addCol(1.0, 0.0, inf, len(idx), np.array(idx, dtype=np.int32), np.ones(len(idx)))
            in_lp.add(key)

        for key, load in self.columns.items():
            if load <= T:
                add(key)
        # A node above T except where it skips recomputation can only go with the loss column:
        # an artificial column at a cost no cover of P GPUs reaches keeps the restricted LP
        # feasible until the column generation finds those (its duals stay valid for Farley's).
        artificial = [i for i in range(len(items)) if self.columns[(0, frozenset([i]))] > T]
        for i in artificial:
            lp.addCol(ARTIFICIAL * (P + 1), 0.0, inf, 1, np.array([i], dtype=np.int32), np.ones(1))
        greedy_rounds = 0               # rounds of greedy columns since the MIPs last priced
        while True:
            if deadline is not None and time.perf_counter() > deadline:
                return None
            self.stats["rounds"] += 1
            lp.run()
            z = lp.getInfo().objective_function_value
            if z <= P + EPS:        # (False claims no bound: the safe side, artificial columns or not)
                return False
            duals = lp.getSolution().row_dual
            pi = [max(0.0, d) for d in duals[:len(items)]]
            mu = max(0.0, -duals[loss_row])
            added = False
            for s in {s for s in self._greedy(pi, T) if sum(pi[i] for i in s) > 1 + EPS and (0, s) not in in_lp}:
                self.columns[(0, s)] = sum(self.w[items[i]] for i in s)
                add((0, s))
                added = True
            greedy_rounds = 0 if not added else greedy_rounds + 1
            if added and greedy_rounds < MIP_EVERY:
                continue
            greedy_rounds, bound_value = 0, 1.0
            for k in ((0, 1) if self.skip else (0,)):
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    return None
                value, upper, s, load = self._price(pi, T, bool(k), 1e9 if left is None else left)
                bound_value = max(bound_value, upper - (mu if k else 0.0))
                if value - (mu if k else 0.0) > 1 + EPS and (k, s) not in in_lp:
                    self.columns[(k, s)] = load
                    add((k, s))
                    added = True
            # (pi, mu) / bound_value is feasible for the dual of the whole LP: a lower bound
            if (sum(pi) - mu) / bound_value > P + EPS:
                return True
            if not added:
                return None if bound_value > 1 + EPS else True


def configuration_bound(problem: Problem, low: float, high: float, *, tol_ms: float = 1e-3,
                        time_limit: float | None = None, probe_limit: float | None = None,
                        lp: ConfigurationLP | None = None) -> float:
    """A lower bound (ms) on the Eq. 1 objective of every plan of ``problem`` that fits: the
    largest load ``T`` at which the configuration LP was shown to need more than ``P`` GPUs,
    found by bisecting ``[low, high]`` to ``tol_ms``, else ``low``, which must itself be a bound
    (0 is). ``high``: best a plan's objective (no plan is below it).

    ``time_limit`` (seconds): the bisection stops there with the bound proven so far.
    ``probe_limit`` (seconds): a load not decided in that time is treated as not proven (the
    bisection goes on below it), so that a load at the edge, where column generation tails off
    (operator graphs: thousands of rounds), does not take the whole time. ``lp``: a
    :class:`ConfigurationLP` of ``problem`` whose columns to start from.
    """
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + time_limit
    lp = lp or ConfigurationLP(problem)
    while high - low > tol_ms:
        now = time.perf_counter()
        if deadline is not None and now >= deadline:
            break
        ends = [d for d in (deadline, None if probe_limit is None else now + probe_limit) if d is not None]
        mid = (low + high) / 2
        if lp.exceeds(mid, min(ends) if ends else None):
            low = mid
        else:                   # (False or undecided: no bound is claimed at or above mid)
            high = mid
    return low
