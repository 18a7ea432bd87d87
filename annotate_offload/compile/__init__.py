"""``torch.compile`` of a transformed model: an fx pass offloads the saved activations of its layers.

Nothing to call: ``offload_transform(model, ...)`` then ``torch.compile(model)``;
``compiled_offloads(model)`` shows per compiled graph what it saves and what it offloads. The layer wrappers are
traced (Note [Traced layers] in ``annotate/_layers.py``), and at AOTAutograd's partition an fx pass
(``_pass.py``) inserts this package's ops at the D2H-at-save and reload points of the saved activations
of offloaded layers (Note [Compiled offload ops] in ``_ops.py``), which feed the eager runtime.
"""

from __future__ import annotations

from ._pass import GraphOffloads, compiled_offloads

__all__ = ["compiled_offloads", "GraphOffloads"]
