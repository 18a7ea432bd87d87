"""CPU thread budget and the worker thread that runs host optimizer steps (private).

Note [Thread budget]: torch's fused CPU AdamW parallelises over elements with the intra-op
thread pool, and ``torchrun`` sets ``OMP_NUM_THREADS=1`` whenever it starts more than one
process per node, which silently makes every rank's host step single-threaded
(reference/optimizer_offload.md §4, §8). The budget therefore ignores ``OMP_NUM_THREADS``:

    budget = cpu_threads if given, else
             max(1, usable_cpus // local_ranks - (1 if that is >= 4 and beside_training else 0))

``usable_cpus`` is ``len(os.sched_getaffinity(0))`` (it honours ``taskset``/``numactl`` binding),
``local_ranks`` is ``LOCAL_WORLD_SIZE`` (set by torchrun) or 1. When a worker thread steps the host
beside the training thread (``step_in_backward``, ``delayed_param_update``), one core is left to
the Python thread that launches GPU work meanwhile, when there are at least 4. The default mode
steps on the training thread itself (Note [Exact mode steps on the training thread] in
``_hybrid.py``), which launches nothing during the host step, so it takes every core: W3 on the
H200 ran 407.1 vs 407.7 ms median with 16 and 15 threads (benchmarks/NOTES.md, G2).

The worker applies its budget with ``torch.set_num_threads`` *inside its own thread* (OpenMP
thread counts are per calling thread), so the training thread's own setting is untouched; the
default mode and the serial path apply it with :func:`num_threads` around the host step and
restore the previous value (no call at all when the training thread already uses that count).
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
    """Threads for the host optimizer step (Note [Thread budget]); ``beside_training``: a worker
    thread steps while the training thread launches GPU work."""
    if cpu_threads is not None:
        return cpu_threads
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    per_rank = max(1, usable_cpus() // local)
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
    re-raises the first exception a task raised (later tasks of that batch are skipped).
    """

    __slots__ = ("_q", "_thread", "_threads", "_bind", "_error", "_pending", "_cv", "_ready", "__weakref__")

    def __init__(self, threads: int, bind: Callable[[], None]) -> None:
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._threads = threads
        self._bind = bind
        self._error: Optional[BaseException] = None
        self._pending = 0
        self._cv = threading.Condition()
        self._ready = threading.Event()
        # Note [Thread budget], continued: torch.set_num_threads also stores a process-wide value
        # that every thread not yet using OpenMP adopts on its first parallel op (ATen's lazy
        # per-thread init), so the worker's budget leaked into a training thread that had not run
        # one yet (OMP_NUM_THREADS=1 read back as the budget; fresh-user trial, session 5). The
        # caller's value is read first (which initialises its own) and put back once the worker
        # has applied its budget to itself.
        caller = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="hdo-cpu-step", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if threads != caller:
            torch.set_num_threads(caller)

    def _loop(self) -> None:
        try:
            self._bind()
            torch.set_num_threads(self._threads)
            torch.get_num_threads()  # ATen's lazy per-thread init, now: it adopts the process-wide value
        finally:
            self._ready.set()
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                if self._error is None:
                    fn()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def submit(self, fn: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("CpuWorker.submit: the worker thread has stopped (close() was called)")
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

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def close(self) -> None:
        """Stop the thread after the queued tasks (idempotent)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=30)

    def __repr__(self) -> str:
        return f"CpuWorker(threads={self._threads}, pending={self._pending})"
