"""Shared test configuration.

* ``@pytest.mark.cuda`` tests need a CUDA GPU; they are skipped on machines without one and run
  on the GPU machine with ``pytest -m cuda``.
* Every test starts from the same RNG seed.
* ``torchrun`` builds the command that starts a script in several processes (``torch.distributed.run``).
"""

from __future__ import annotations

import socket
import sys
from typing import Callable

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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def torchrun() -> Callable[..., list[str]]:
    """``torchrun(script, *args, nproc=2)``: the command that starts ``script`` with ``args`` in ``nproc``
    processes through ``torch.distributed.run``, rendezvous on 127.0.0.1 at a free port."""

    def command(script, *args, nproc: int = 2) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", str(script), *map(str, args)]

    return command
