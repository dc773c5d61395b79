"""The partitioner interface and the helpers partitioners share."""

from __future__ import annotations

import importlib
from typing import Callable

from ..plan import Plan, Problem

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
    """Run one strategy; the plan comes back with stages in topological order."""
    from ..plan import check_plan, ordered

    plan = get_strategy(name)(problem, **options)
    plan = ordered(plan, problem.graph)
    check_plan(problem.graph, plan)
    return plan
