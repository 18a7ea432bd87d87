"""annotate_offload: declarative activation and optimizer-state offloading for PyTorch training.

The runtime is a drop-in for TransformerEngine's ``cpu_offload`` (:mod:`annotate_offload.runtime`); the
Megatron-Bridge-named config dataclasses are in :mod:`annotate_offload.config`. Importing the package
does not initialise CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import OffloadError
from .runtime import (DefaultOffloadSynchronizer, ManualOffloadSynchronizer, OffloadSynchronizer, TensorGroup,
                      TensorGroupProcessor, get_cpu_offload_context, is_cpu_offload_enabled, mark_activation_offload,
                      mark_not_offload, start_offload)

__version__ = "0.1.0"

# Names served lazily, so that `import annotate_offload` stays light (no torch.fx / optimizer
# import cost) and each layer of the package can be imported on its own.
_LAZY = {
    "offload_layer": "annotate_offload.annotate",
    "offload_transform": "annotate_offload.annotate",
    "remove_offload": "annotate_offload.annotate",
    "OffloadPlan": "annotate_offload.annotate._plan",
    "HybridDeviceOptimizer": "annotate_offload.optim",
    "plan_offload": "annotate_offload.planner",
}

__all__ = [
    # runtime (TransformerEngine-compatible)
    "get_cpu_offload_context", "is_cpu_offload_enabled", "mark_activation_offload", "mark_not_offload",
    "start_offload", "TensorGroup", "TensorGroupProcessor", "OffloadSynchronizer", "DefaultOffloadSynchronizer",
    "ManualOffloadSynchronizer",
    # annotations
    "offload_layer", "offload_transform", "remove_offload", "plan_offload",
    # optimizer; errors
    "HybridDeviceOptimizer", "OffloadError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'annotate_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
