"""The offload runtime: saved-tensor hooks, schedules, storage units, host buffers, streams.

Everything above this package (the annotation layer, the planner, the CLI) feeds these names.
"""

from ._context import active_offload_policy, get_cpu_offload_context, is_cpu_offload_enabled
from ._marks import mark_activation_offload, mark_not_offload, start_offload
from ._pinned_pool import PinnedBufferPool
from ._stats import OffloadStats
from ._synchronizer import (
    DefaultOffloadSynchronizer,
    ManualOffloadSynchronizer,
    OffloadSynchronizer,
)
from ._tensor_group import TensorGroup, TensorGroupProcessor

__all__ = [
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "active_offload_policy",
    "mark_activation_offload",
    "mark_not_offload",
    "start_offload",
    "OffloadSynchronizer",
    "DefaultOffloadSynchronizer",
    "ManualOffloadSynchronizer",
    "TensorGroup",
    "TensorGroupProcessor",
    "OffloadStats",
    "PinnedBufferPool",
]
