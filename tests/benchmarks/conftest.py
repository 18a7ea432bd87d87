"""tests/benchmarks: the scripts of ``benchmarks/`` (not installed) are imported from the checkout.

CPU math runs on one thread: the shapes are tiny, and OpenMP spinning on a loaded 2-core machine
makes a millisecond step take a hundred times longer.
"""

import os
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
