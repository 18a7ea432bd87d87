"""Planner: choose keep, offload or recompute per layer for a memory budget, from measurements.

``plan_offload(model, memory_budget=..., example_inputs=...)`` profiles each layer and the host link,
predicts step time and peak activation memory of candidate plans with a small cost model
(``_cost_model``), and returns the fastest plan that fits (``_search``) as a :class:`PlannerResult`.
``offload_transform(model, num_layers="auto", ...)`` calls it. Importing this package does not
initialise CUDA.
"""

from ._plan import PlannerResult, plan_offload

__all__ = ["plan_offload", "PlannerResult"]
