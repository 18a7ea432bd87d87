"""Declarative offloading: ``@offload_layer`` marks and ``offload_transform(model, num_layers=N)``.

The transform wraps each declared layer's own ``forward`` on the instance; the wrapper opens the
layer's offload scope, runs the layer unchanged and commits its output. See :func:`offload_transform`.
"""

from ._decorators import offload_layer
from ._transform import offload_transform, remove_offload

__all__ = [
    "offload_layer",  # declare
    "offload_transform",  # apply
    "remove_offload",  # undo
]
