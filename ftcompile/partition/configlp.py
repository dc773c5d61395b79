"""A lower bound on every plan's objective from the configuration LP (column generation).

The MIP of :mod:`~ftcompile.partition.exact` bounds the objective by its LP relaxation, which
sees none of the integrality of whole blocks: on GNMT's layer graph on 6 GPUs its bound stays
at total/P (112.04 after 600 s) while the best plan is 118.697. The configuration LP (Gilmore
and Gomory's for bin packing) keeps each GPU's set of nodes whole: for a load ``T`` it asks how
many GPUs' worth of node sets, each within ``T`` and the GPU's memory, cover every node. When
that LP needs more than ``P`` GPUs, no plan has a largest GPU load of ``T`` or less.

What :func:`configuration_bound` relaxes, so that it stays below every plan (mixed or convex):

* a GPU's load is the sum of its nodes' forward, backward and recomputation times and their
  optimizer steps' share per micro-batch (:meth:`~ftcompile.plan.Problem.update_ms`, additive
  over parameters), a parameter read by several nodes split evenly among them; links cost
  nothing (every transfer only adds to Eq. 1's period);
* a GPU's memory is its nodes' weights, gradients and optimizer state, a shared parameter split
  evenly among its readers; activations and buffers count nothing;
* one GPU (a "loss" column) may skip the recomputation of a set of its nodes closed under
  consumers (the last stage, a sink of the stage graph, is such a set), where the schedule has
  the last stage skip it.

Columns are priced by a knapsack MIP (HiGHS) with those two rows (and, for the loss column,
the closure rows), until no column improves the LP: its optimum, not an estimate. ``T`` is then
bisected. Measured on the held-out layer graphs (benchmarks/README): GNMT on 6 GPUs 118.696,
BERT-24 on 6 GPUs at 1.2 x 59.368 and at 1.1 x 71.251, each within 1e-3 ms of the best plan
found, in 10 to 20 s.
"""

from __future__ import annotations

from ..plan import Problem

#: Tolerances: a column must improve the LP by more than this; ``T`` needs more than ``P + EPS`` GPUs.
EPS = 1e-7


def _highs():
    import highspy

    from .exact import _option, _quiet_fd1

    with _quiet_fd1():
        h = highspy.Highs()                 # (its banner, printed before any option applies)
    h.setOptionValue("output_flag", False)
    _option(h, "threads", 1)
    return h


class _Columns:
    """The nodes' times and memory as the LP prices them, and its pricing problems."""

    def __init__(self, problem: Problem):
        g = problem.graph
        self.problem = problem
        nodes = [n.id for n in g.op_nodes()]
        readers: dict[str, int] = {}
        for n in nodes:
            for q in g.node(n).params:
                readers[q] = readers.get(q, 0) + 1
        self.skip = problem.recomputes(False) and not problem.recomputes(True)
        self.w, self.rec, self.mem = {}, {}, {}
        for n in nodes:
            c = problem.profile.nodes[n]
            params = g.node(n).params
            upd = sum(problem.update_ms({q}) / readers[q] for q in params) / problem.micro_batches
            self.rec[n] = c.recompute_ms if problem.recomputes(False) else 0.0
            self.w[n] = c.forward_ms + c.backward_ms + self.rec[n] + upd
            self.mem[n] = sum(problem.profile.params[q].total / readers[q] for q in params)
        self.nodes = nodes
        self.items = [n for n in nodes if self.w[n] > 0 or self.mem[n] > 0]
        self.edges = [(e.src, e.dst) for e in g.edges if e.src in self.w and e.dst in self.w]
        self.limit = problem.cluster.gpu_memory

    def price(self, pi: list[float], T: float, loss: bool) -> tuple[float, frozenset[int]]:
        """The node set of largest dual value within ``T`` and memory: (its value, item indices)."""
        h = _highs()
        items = self.items
        x = [h.addBinary() for _ in items]
        load = h.qsum([self.w[n] * x[i] for i, n in enumerate(items)])
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
        xv = h.vals(x)
        return h.getInfo().objective_function_value, frozenset(i for i in range(len(items)) if xv[i] > 0.5)

    def gpus_needed(self, T: float) -> float:
        """The configuration LP's optimum at load ``T``: GPUs' worth of node sets covering every
        node (inf where some node fits no GPU alone)."""
        items = self.items
        cols = [(k, frozenset([i])) for k in (0, 1) for i, n in enumerate(items)
                if self.mem[n] <= self.limit and self.w[n] - (self.rec[n] if k and self.skip else 0.0) <= T]
        if len({i for _k, s in cols for i in s}) < len(items):
            return float("inf")
        while True:
            h = _highs()
            lam = [h.addVariable(lb=0.0) for _ in cols]
            covering: list[list] = [[] for _ in items]      # the columns holding each item
            for j, (_k, s) in enumerate(cols):
                for i in s:
                    covering[i].append(lam[j])
            for i in range(len(items)):
                h.addConstr(h.qsum(covering[i]) >= 1)
            h.addConstr(h.qsum([lam[j] for j, (k, _s) in enumerate(cols) if k == 1]) <= 1)
            h.setObjective(h.qsum(lam))
            h.setMinimize()
            h.run()
            duals = h.getSolution().row_dual
            pi = [max(0.0, d) for d in duals[:len(items)]]
            sigma = min(0.0, duals[len(items)])
            added = False
            for k in (0, 1):
                value, s = self.price(pi, T, loss=bool(k))
                if value + (sigma if k else 0.0) > 1 + EPS:
                    cols.append((k, s))
                    added = True
            if not added:
                return h.getInfo().objective_function_value


def configuration_bound(problem: Problem, low: float, high: float, *, tol_ms: float = 1e-3) -> float:
    """A lower bound (ms) on the Eq. 1 objective of every plan of ``problem`` that fits, found by
    bisecting ``[low, high]`` to ``tol_ms``: the largest ``T`` probed at which the configuration
    LP needs more than ``P`` GPUs, else ``low``, which must itself be a bound (0 is). ``high`` is
    best a plan's objective; where even it needs more GPUs (no plan that fits does), ``high``.
    """
    cols = _Columns(problem)
    P = problem.num_gpus
    if cols.gpus_needed(high) > P + EPS:
        return high
    while high - low > tol_ms:
        mid = (low + high) / 2
        if cols.gpus_needed(mid) > P + EPS:
            low = mid
        else:
            high = mid
    return low
