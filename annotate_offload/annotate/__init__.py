"""Declarative offloading: ``@offload_layer`` marks and ``offload_transform(model, num_layers=N)``.

The transform traces the model with ``torch.fx`` (layers as leaves) and inserts the runtime's
layer-boundary calls into the graph; models that cannot be traced get the same calls from module
hooks. See :func:`offload_transform`.
"""

from ._decorators import offload_layer
from ._plan import LayerPlan, OffloadPlan
from ._transform import offload_transform, remove_offload

__all__ = [
    # declare
    "offload_layer",
    # apply / undo
    "offload_transform",
    "remove_offload",
    # inspect
    "OffloadPlan",
    "LayerPlan",
]
