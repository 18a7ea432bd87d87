"""tests/bench: run CPU math on one thread (tiny shapes; the 2-core CI box is shared by parallel
jobs, and OpenMP spinning under oversubscription makes tiny steps 10x slower)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
