"""CPU thread budget and the worker thread that runs host optimizer steps (private).

Note [Thread budget]: the host step parallelises over the intra-op pool, and ``torchrun`` sets
``OMP_NUM_THREADS=1`` with several processes per node, so the budget ignores it:
``cpu_threads`` if given, else ``usable CPUs // LOCAL_WORLD_SIZE``, less one core (from four up) for
the training thread beside a worker (``step_in_backward``, ``delayed_param_update``). Thread counts
are per thread: the worker sets its own, the default mode sets it around the host step.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import torch

__all__: list[str] = []


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_budget(cpu_threads: Optional[int] = None, *, beside_training: bool = True) -> int:
    """Threads for the host optimizer step (Note [Thread budget]); ``cpu_threads`` must be ``None`` or
    an int in ``[1, usable CPUs]`` (``TypeError``/``ValueError``)."""
    limit = usable_cpus()
    if cpu_threads is not None:
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or not 1 <= cpu_threads <= limit:
            raise (ValueError if isinstance(cpu_threads, int) else TypeError)(
                f"HybridDeviceOptimizer: cpu_threads={cpu_threads!r}: pass None or an int in [1, {limit}]; this process "
                f"may run on {limit} CPUs (os.sched_getaffinity).")
        return cpu_threads
    env = os.environ.get("LOCAL_WORLD_SIZE", "1")
    per_rank = max(1, limit // max(1, int(env) if env.isdigit() else 1))
    return per_rank - 1 if per_rank >= 4 and beside_training else per_rank


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(n)`` and restore the previous value."""
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if old != n:
            torch.set_num_threads(old)


class CpuWorker:
    """One thread (``hdo-cpu-step``) running submitted callables in order with its own thread budget;
    ``drain`` re-raises the first exception a task raised (the tasks after it are skipped)."""

    def __init__(self, threads: int, bind: Callable[[], None]) -> None:
        caller = torch.get_num_threads()  # initialises this thread's own count first
        self._pool = ThreadPoolExecutor(1, "hdo-cpu-step", initializer=self._start, initargs=(threads, bind))
        self._pool.submit(int).result()  # the thread exists and has applied its budget
        torch.set_num_threads(caller)
        self._futures: list[Future] = []
        self._failed = False

    @staticmethod
    def _start(threads: int, bind: Callable[[], None]) -> None:
        bind()
        torch.set_grad_enabled(False)  # the host steps write masters and weights in place
        torch.set_num_threads(threads)
        torch.get_num_threads()  # ATen initialises this thread's pool now, with this count

    def _run(self, fn: Callable[[], None]) -> None:
        if not self._failed:
            try:
                fn()
            except BaseException:
                self._failed = True
                raise

    def submit(self, fn: Callable[[], None]) -> None:
        self._futures.append(self._pool.submit(self._run, fn))

    def drain(self) -> None:
        futures, self._futures = self._futures, []
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        self._failed = False
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop the thread after the queued tasks (idempotent; from the worker itself, without waiting)."""
        self._pool.shutdown(wait=not threading.current_thread().name.startswith("hdo-cpu-step"))
