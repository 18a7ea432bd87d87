"""Optimizer-state offload: :class:`HybridDeviceOptimizer` steps a fraction of the parameters on the host."""

from ._hybrid import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
