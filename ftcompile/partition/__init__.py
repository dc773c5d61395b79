"""Partitioners: each turns a :class:`~ftcompile.plan.Problem` into a :class:`~ftcompile.plan.Plan`.

Every strategy is a function ``partition(problem, **options) -> Plan`` that raises
:class:`Infeasible` with a reason when it cannot produce a plan that fits. They
compete in :func:`ftcompile.compile.compile_plan` (``--strategy auto``).
"""

from .base import STRATEGIES, Infeasible, get_strategy, run_strategy

__all__ = ["STRATEGIES", "Infeasible", "get_strategy", "run_strategy"]
