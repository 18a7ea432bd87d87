"""Shared test configuration.

* ``@pytest.mark.cuda`` tests need a CUDA GPU; they are skipped on machines without one and run
  on the GPU machine with ``pytest -m cuda``.
* Every test starts from the same RNG seed.
* ``torchrun`` builds the command that starts a script in several processes (``torch.distributed.run``).
* ``run_group`` runs a child process (a script, the CLI, ``torchrun``) in a session of its own and
  kills its whole process group when the test ends, times out or fails: no orphan outlives the test
  or keeps the runner's pipes open.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any, Callable, Sequence

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


@pytest.fixture
def plan_choices(monkeypatch) -> Callable[..., None]:
    """``plan_choices(choices, seen=None)``: ``offload_transform(memory_budget=...)`` applies ``choices`` (one
    per layer of a four-layer model; release lag 1, prefetch 1) instead of planning; ``seen`` (a dict) gets
    the arguments the planner was called with."""
    import dataclasses

    import annotate_offload.planner as planner
    from annotate_offload.planner._cost_model import LayerMeasurement, LinkBandwidth, StepMeasurement

    real = planner.plan_offload(None, memory_budget="1TiB", measurements=[LayerMeasurement(1.0, 2.0, 10**9, 10**9)] * 4,
                                step=StepMeasurement(), bandwidth=LinkBandwidth(10.0, 10.0))

    def use(choices, seen: dict | None = None) -> None:
        def plan_offload(model, *, memory_budget, example_inputs, layers, keep, **kw):
            if seen is not None:
                seen.update(layers=layers, budget=memory_budget, keep=keep, **kw)
            return dataclasses.replace(real, choices=tuple(choices), release_lag=1, prefetch_layers=1, memory_budget=1)

        monkeypatch.setattr(planner, "plan_offload", plan_offload)

    return use


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


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when no process is left in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _end_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the child's group (``torchrun``'s agent then stops its workers, which run in sessions of
    their own), SIGKILL to what is left after ``grace`` seconds."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)


def run_group(cmd: Sequence[Any], *, timeout: float = 240.0, check: bool = False, grace: float = 10.0,
              **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, check=check, **kwargs)`` with the child in a new session.

    On a timeout, a failure or an interrupt its whole process group is stopped (:func:`_end_group`)
    before the exception propagates; after a normal exit whatever the child left in its group is
    killed. The default ``timeout`` (240 s) stays under the per-test ``timeout`` of pytest-timeout
    (300 s, pyproject.toml), so this cleanup runs before pytest-timeout ends the process.
    """
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                _end_group(proc, grace)
                try:  # what it printed, for the failure message; a grandchild may still hold the pipes
                    exc.stdout, exc.stderr = proc.communicate(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
                raise
            except BaseException:
                _end_group(proc, grace)
                raise
        finally:
            _signal_group(proc.pid, signal.SIGKILL)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


@pytest.fixture(name="run_group", scope="session")
def _run_group_fixture() -> Callable[..., subprocess.CompletedProcess]:
    """:func:`run_group`: run a child process that cannot outlive the test (a fixture, as ``conftest``
    is not importable by name from every test folder)."""
    return run_group
