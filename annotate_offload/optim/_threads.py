"""CPU thread budget and the worker thread that runs host optimizer steps (private).

Note [Thread budget]: torch's fused CPU AdamW parallelises over elements with the intra-op thread
pool, and ``torchrun`` sets ``OMP_NUM_THREADS=1`` whenever it starts more than one process per
node, which would make every rank's host step single-threaded. The budget therefore ignores
``OMP_NUM_THREADS``:

    budget = cpu_threads if given, else
             max(1, usable_cpus // local_ranks - (1 if that is >= 4 and beside_training else 0))

``usable_cpus`` is ``len(os.sched_getaffinity(0))`` (it honours taskset/numactl binding) and
``local_ranks`` is ``LOCAL_WORLD_SIZE`` (torchrun) or 1. When a worker thread steps the host beside
the training thread (``step_in_backward``, ``delayed_param_update``), one core is left to the
Python thread that launches GPU work meanwhile; the default mode steps on the training thread,
which launches nothing during the host step, and takes every core.

OpenMP thread counts are per calling thread, so the worker applies its budget inside its own
thread and the training thread's setting is untouched; the default mode applies it with
:func:`num_threads` around the host step and restores the previous value. ``torch.set_num_threads``
also stores a process-wide value that a thread adopts on its first parallel op, so the worker
puts the caller's value back once it has applied its own.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any, Callable, Iterator, Optional

import torch

__all__: list[str] = []


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def thread_budget(cpu_threads: Optional[int] = None, *, beside_training: bool = True) -> int:
    """Threads for the host optimizer step (Note [Thread budget]).

    Raises:
        TypeError: ``cpu_threads`` is not ``None`` or an int.
        ValueError: ``cpu_threads`` below 1 or above the CPUs this process may run on.
    """
    limit = usable_cpus()
    if cpu_threads is not None:
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int):
            raise TypeError(f"HybridDeviceOptimizer: cpu_threads={cpu_threads!r}: pass None or an int in [1, {limit}].")
        if not 1 <= cpu_threads <= limit:
            raise ValueError(f"HybridDeviceOptimizer: cpu_threads={cpu_threads}: pass None or an int in [1, {limit}]; "
                             f"this process may run on {limit} CPUs (os.sched_getaffinity).")
        return cpu_threads
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    per_rank = max(1, limit // local)
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
    """One daemon thread running submitted callables in FIFO order with its own thread budget.

    ``submit`` never blocks; ``drain`` waits until everything submitted so far has run and
    re-raises the first exception a task raised (the tasks after it, until the drain, are skipped).
    """

    __slots__ = ("_q", "_thread", "_threads", "_bind", "_error", "_pending", "_cv", "__weakref__")

    def __init__(self, threads: int, bind: Callable[[], None]) -> None:
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._threads, self._bind = threads, bind
        self._error: Optional[BaseException] = None
        self._pending = 0
        self._cv = threading.Condition()
        ready = threading.Event()
        caller = torch.get_num_threads()  # initialises this thread's own value first (Note [Thread budget])
        self._thread = threading.Thread(target=self._loop, args=(ready,), name="hdo-cpu-step", daemon=True)
        self._thread.start()
        ready.wait(timeout=30)
        if threads != caller:
            torch.set_num_threads(caller)

    def _loop(self, ready: threading.Event) -> None:
        try:
            self._bind()
            torch.set_num_threads(self._threads)
            torch.get_num_threads()
        finally:
            ready.set()
        while (fn := self._q.get()) is not None:
            try:
                if self._error is None:
                    fn()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread at drain()
                self._error = e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._pending += 1
        self._q.put(fn)

    def drain(self) -> None:
        with self._cv:
            while self._pending:
                self._cv.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        """Stop the thread after the queued tasks (idempotent)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=30)

    def __repr__(self) -> str:
        return f"CpuWorker(threads={self._threads}, pending={self._pending})"
