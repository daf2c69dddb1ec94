"""elbowroom.plan: state a memory budget; elbowroom profiles the model, decides, predicts and applies.

Data flows one way: model + sample batch -> :class:`~elbowroom.plan.types.Profile` (``elbowroom.plan.profile``)
-> cost model (:mod:`elbowroom.plan.cost`) and search (:func:`plan_for`) -> :class:`Plan` (plain data: printed,
saved as TOML/JSON, edited, loaded) -> :func:`apply` (the mechanisms wired to the model). :func:`fit` does all
of it in one call. Importing this package initialises no device.
"""

from elbowroom.plan.apply import apply
from elbowroom.plan.fit import fit, parse_budget
from elbowroom.plan.plan import BlockPlan, Plan
from elbowroom.plan.search import BudgetError, plan_for

__all__ = ["BlockPlan", "BudgetError", "Plan", "apply", "fit", "parse_budget", "plan_for"]
