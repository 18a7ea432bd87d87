"""Shared setup of the distributed tests: the single-process reference run.

Each test module sets ``STEPS``; ``ref`` is the weights after that many steps of one process doing
what two DDP/FSDP ranks do (per-rank micro-batch gradients averaged, torch's fused AdamW).
"""

from __future__ import annotations

import pytest
import torch

from _dist_harness import reference


@pytest.fixture(scope="module")
def ref(request) -> dict[str, torch.Tensor]:
    return reference(request.module.STEPS, 2)
