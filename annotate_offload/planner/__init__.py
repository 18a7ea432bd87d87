"""Planner: choose keep, offload or recompute per layer for a memory budget, from measurements.

``plan_offload(model, memory_budget=..., example_inputs=...)`` profiles each layer and the host link,
predicts step time and peak activation memory of candidate plans with a small cost model
(``_cost_model``), and returns the fastest plan that fits (``_search``). Importing this package does not
initialise CUDA.
"""

from ._cost_model import CHOICES, LayerMeasurement, LinkBandwidth, Prediction, predict
from ._bandwidth import measure_bandwidth
from ._measure import measure_layers
from ._plan import PlannerResult, plan_offload

__all__ = [
    # planning
    "plan_offload",
    "PlannerResult",
    # measurements
    "measure_layers",
    "measure_bandwidth",
    "LayerMeasurement",
    "LinkBandwidth",
    # cost model
    "CHOICES",
    "Prediction",
    "predict",
]
