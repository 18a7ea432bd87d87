"""The offload runtime: saved-tensor hooks, schedules, storage units, host buffers, streams.

The public names are TransformerEngine's ``cpu_offload`` module's, plus
``active_offload_policy`` for modules that mark their own tensors. The statistics
(``sync.stats``) and the host buffer pool are reached through a synchronizer.
"""

from ._context import active_offload_policy, get_cpu_offload_context, is_cpu_offload_enabled
from ._marks import mark_activation_offload, mark_not_offload, start_offload
from ._synchronizer import DefaultOffloadSynchronizer, ManualOffloadSynchronizer, OffloadSynchronizer
from ._tensor_group import TensorGroup, TensorGroupProcessor

__all__ = [
    # TransformerEngine's names
    "get_cpu_offload_context", "is_cpu_offload_enabled", "mark_activation_offload", "mark_not_offload",
    "start_offload", "OffloadSynchronizer", "DefaultOffloadSynchronizer", "ManualOffloadSynchronizer",
    "TensorGroup", "TensorGroupProcessor",
    # for modules that mark their own tensors (LoRA adapters)
    "active_offload_policy",
]
