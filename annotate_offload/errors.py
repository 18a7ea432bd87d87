"""The package's one exception type for runtime misuse (bad input is ``ValueError``/``TypeError``)."""

from __future__ import annotations

__all__ = ["OffloadError"]


class OffloadError(RuntimeError):
    """Raised when offloading is used in an order or state the runtime cannot honour.

    Messages name the subsystem, what was observed versus expected, and the fix.
    Subclasses ``RuntimeError`` so code written for TransformerEngine, which raises
    ``RuntimeError`` for the same situations, keeps working.
    """
