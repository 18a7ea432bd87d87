"""Shared test configuration.

* ``@pytest.mark.cuda`` tests need a CUDA GPU; they are skipped on machines without one and run
  on the GPU machine with ``pytest -m cuda``.
* Every test starts from the same RNG seed.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """Run a test on the CPU backend and, on GPU machines, on CUDA."""
    return request.param
