"""Planner: the fastest plan that fits a training step into a peak device memory budget, from measurements.

``plan_offload(model, memory_budget="20GiB", example_inputs=...)`` measures each layer, the rest of the
step, the host link and fused AdamW on both sides, predicts step time and peak memory (weights,
gradients, optimizer state, activations) of candidate plans with a small cost model (``_cost_model``)
and returns the fastest that fits (``_search``) as a :class:`PlannerResult`: per layer keep, offload,
recompute or both, the runtime schedule and ``HybridDeviceOptimizer``'s ``offload_fraction``.
``offload_transform(model, memory_budget=...)`` calls it. Importing this package does not initialise CUDA.
"""

from ._plan import PlannerResult, plan_offload

__all__ = ["plan_offload", "PlannerResult"]
