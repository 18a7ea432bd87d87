"""A bit-reproducible baseline on CUDA, for exactness checks.

Offloading is a copy, so outputs and gradients must equal the run without it bit for bit, and that
can only be checked against a baseline that is itself bit-reproducible from run to run. The flash and
cuDNN SDPA backward kernels are not, even under ``torch.use_deterministic_algorithms(True)``; the
memory-efficient backward is only with deterministic algorithms on (otherwise, at long sequence
lengths, it splits the key dimension and accumulates ``dq`` with atomics).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

__all__ = ["bit_reproducible"]


@contextlib.contextmanager
def bit_reproducible() -> Iterator[None]:
    """Pin a bit-reproducible SDPA backend and deterministic algorithms for the block.

    On CUDA: ``SDPBackend.EFFICIENT_ATTENTION`` (``MATH`` where it does not apply, e.g. ``enable_gqa=True``),
    ``torch.use_deterministic_algorithms(True, warn_only=False)`` (an op without a deterministic kernel
    raises) and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` if unset; the previous settings are restored on exit.
    On CPU the block runs unchanged. Speed benchmarks should not use this: it selects slower kernels.
    """
    if not torch.cuda.is_available():
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
