"""The partitioner interface and the helpers partitioners share.

Every strategy is ``partition(problem, **options) -> Plan``. Options every strategy
takes (through :func:`run_strategy`):

* ``max_stages`` -- at most this many pipeline stages in all (FTPipe §5.3 found 16
  stages best for T5-3B under asynchronous training: more stages, more staleness).

:class:`MemoryModel` is the one place where partitioners estimate memory. It mirrors
:func:`ftcompile.plan.evaluate` term for term, so that when the cost model counts
more (issue 11: buffers, reserves) only this class changes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable

from ..plan import Plan, Problem, _extra_weight_versions, _in_flight

#: strategy name -> "module:function" (imported on first use, so a missing optional
#: dependency such as pymetis only disables its own strategy).
STRATEGIES: dict[str, str] = {
    "seq": "ftcompile.partition.seq:partition_seq",
    "uniform": "ftcompile.partition.seq:partition_uniform",
    "params": "ftcompile.partition.seq:partition_params",
    "mixed": "ftcompile.partition.mixed:partition_mixed",
    "acyclic": "ftcompile.partition.acyclic:partition_acyclic",
    "metis": "ftcompile.partition.metis:partition_metis",
    "exact": "ftcompile.partition.exact:partition_exact",
}


class Infeasible(Exception):
    """A strategy cannot produce a plan; ``reason`` says why (memory, size, missing library)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def get_strategy(name: str) -> Callable[..., Plan]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} or auto")
    module, func = STRATEGIES[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise Infeasible(f"strategy {name} needs a library that is not installed: {exc}") from None
    return getattr(mod, func)


def run_strategy(name: str, problem: Problem, **options) -> Plan:
    """Run one strategy; the plan comes back with stages in topological order.

    ``options`` go to the strategy's function; ``max_stages=None`` is dropped, and a
    plan with more stages than ``max_stages`` is refused (:class:`Infeasible`).
    """
    from ..plan import check_plan, ordered

    if options.get("max_stages") is None:
        options.pop("max_stages", None)
    elif int(options["max_stages"]) < 1:
        raise ValueError(f"max_stages must be at least 1, got {options['max_stages']}")
    plan = get_strategy(name)(problem, **options)
    plan = ordered(plan, problem.graph)
    check_plan(problem.graph, plan)
    cap = options.get("max_stages")
    if cap is not None and len(plan.stages) > cap:
        raise Infeasible(f"{name} made {len(plan.stages)} stages, more than --max-stages {cap}")
    return plan


def stage_cap(problem: Problem, max_stages: int | None) -> int:
    """The most stages a plan may have: ``max_stages`` if given, else unbounded (a large number)."""
    return max(1, int(max_stages)) if max_stages is not None else 1 << 30


# --------------------------------------------------------------------------- memory

@dataclass(frozen=True)
class MemoryModel:
    """Per-GPU memory as :func:`ftcompile.plan.evaluate` counts it, in pieces partitioners can sum.

    A GPU holds, for the parameters its stages read (each tensor once):
    weights + gradients + optimizer state (``ParamCost.total``), plus the extra
    weight versions the schedule keeps (:meth:`extra_versions` times the weight
    bytes, the most any stage on the GPU needs); per stage, the activations of the
    micro-batches in flight (:meth:`held`); and once per GPU the largest
    recomputation buffer among its recomputing stages (:meth:`transient`).

    Every method works on plain numbers and on numpy arrays alike (the Seq-pipe DP
    evaluates whole rows of candidate stages at once).
    """

    schedule: str
    micro_batches: int
    limit: int

    @staticmethod
    def of(problem: Problem) -> "MemoryModel":
        return MemoryModel(problem.schedule, problem.micro_batches, problem.cluster.gpu_memory)

    def in_flight(self, depth: int, group0: bool = True) -> int:
        """Micro-batches a stage of ``depth`` holds (2GW: ``group0`` says which group it is in)."""
        return _in_flight(self.schedule, depth, self.micro_batches, group0)

    def extra_versions(self, depth: int, group0: bool = True) -> int:
        """Weight versions beyond the first a stage of ``depth`` keeps (PipeDream, 2BW, 2GW)."""
        return _extra_weight_versions(self.schedule, depth, group0)

    def held(self, depth: int, recomputes, act_full, act_in, group0: bool = True):
        """Activations a stage keeps for its micro-batches in flight.

        ``act_full``: the activations one micro-batch keeps for backward; ``act_in``:
        the stage's inputs for one micro-batch (values received, once each, plus the
        graph inputs it reads, once per edge). A recomputing stage keeps only its inputs.
        """
        k = self.in_flight(depth, group0)
        if isinstance(recomputes, bool):
            return k * (act_in if recomputes else act_full)
        import numpy as np

        return k * np.where(recomputes, act_in, act_full)

    @staticmethod
    def transient(recomputes, act_full, recompute_ms):
        """The recomputation buffer: one micro-batch's full activations, for a stage that
        recomputes and has something to recompute (``recompute_ms > 0``), else 0."""
        if isinstance(recomputes, bool) and not hasattr(recompute_ms, "shape"):
            return act_full if recomputes and recompute_ms > 0 else 0
        import numpy as np

        return np.where(np.logical_and(recomputes, np.asarray(recompute_ms) > 0), act_full, 0)

    def stage_alone(self, params_total, weight_bytes, depth: int, recomputes, act_full, act_in,
                    recompute_ms, group0: bool = True):
        """Memory of a GPU that holds just this stage (``params_total``: weights, gradients and
        optimizer state of the parameters it reads; ``weight_bytes``: their weights alone;
        ``recompute_ms``: the stage's recomputation time, which decides whether it needs a
        recomputation buffer)."""
        extra = self.extra_versions(depth, group0)
        return (params_total + (weight_bytes * extra if extra else 0)
                + self.held(depth, recomputes, act_full, act_in, group0)
                + self.transient(recomputes, act_full, recompute_ms))

    def gpu(self, params_total: int, version_bytes: int, held: Iterable[int], transients: Iterable[int]) -> int:
        """A GPU's total from its parts: parameters (once each), extra weight versions, the held
        activations of each stage and the largest recomputation buffer."""
        return int(params_total + version_bytes + sum(held) + max(transients, default=0))

    def fits(self, nbytes) -> bool:
        return nbytes <= self.limit

    def lower_bound(self, params_total, act_full, recompute_ms, recomputes: bool):
        """The least memory any stage holding these nodes needs, whatever its depth and inputs:
        its parameters and one micro-batch's activations (kept, or rebuilt by recomputation
        when it has any to redo). Monotone in the set of nodes."""
        if recomputes:
            return params_total + (act_full if recompute_ms > 0 else 0)
        return params_total + min(self.in_flight(0, g) for g in (False, True)) * act_full


# --------------------------------------------------------------------------- staleness

def staleness_updates(schedule: str, depth: int, micro_batches: int) -> float:
    """How many optimizer updates old the weights are that a stage of ``depth`` computes with.

    A stage of depth ``d`` runs its forward ``d`` micro-batches ahead of its backward.
    Under ``async`` (FTPipe) and ``pipedream`` no flush holds the others back, so by
    the time its gradient is applied, ``d / M`` updates (``M`` micro-batches each)
    have happened since the weights its micro-batch saw: 29 stages deep at ``M = 4``
    is about 7 updates. ``gpipe`` and ``1f1b`` flush every update (0); ``2bw`` uses
    the previous version (1); ``2gw`` one version behind for its group G0 (1).
    """
    if schedule in ("async", "pipedream"):
        return depth / max(1, micro_batches)
    if schedule in ("2bw", "2gw"):
        return 1.0
    return 0.0
