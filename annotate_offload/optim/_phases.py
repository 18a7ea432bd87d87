"""Per-step phase stamps of :class:`HybridDeviceOptimizer` (private; read by the benchmark).

Note [Step phases]: where the time of one ``step()`` goes, so a GPU run can tell a slow host
kernel from a copy that is not hidden. Host stamps are ``time.perf_counter`` seconds taken by the
thread that did the work; device stamps are CUDA events, timed only when ``timing`` is on (timing
events cost a little more to record, so they are off unless the benchmark asks). The thread
that steps a chunk (the training thread in the default mode, the worker in the others) writes the
host fields of the record captured when the chunk was submitted (in delayed mode that is the
previous step's record); the training thread reads them after a drain.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

__all__: list[str] = []


class StepPhases:
    """Stamps of one step (times in seconds from ``time.perf_counter``; events may be ``None``)."""

    __slots__ = (
        "t_call", "t_return", "t_first_chunk", "t_last_chunk", "busy_s", "wait_s", "chunks", "numel",
        "chunk_rates", "entry_ev", "d2h_ev", "h2d_ev", "bwd_start_ev", "_lock",
    )

    def __init__(self) -> None:
        self.t_call = time.perf_counter()
        self.t_return: Optional[float] = None
        self.t_first_chunk: Optional[float] = None  # host step of the first chunk began (after its D2H wait)
        self.t_last_chunk: Optional[float] = None  # host step (and H2D issue) of the last chunk ended
        self.busy_s = 0.0  # host optimizer compute, summed over chunks
        self.wait_s = 0.0  # host step blocked on D2H events, summed
        self.chunks = 0
        self.numel = 0
        self.chunk_rates: list[float] = []  # params/s of each chunk's host step
        self.entry_ev: Any = None  # compute stream at step() entry (timing event)
        self.d2h_ev: Any = None  # the last gradient D2H of this step
        self.h2d_ev: Any = None  # the last H2D of this step (what the compute stream waits on)
        self.bwd_start_ev: Any = None  # set by the caller (benchmark): compute stream before backward
        self._lock = threading.Lock()

    def chunk_done(self, t_start: float, t_compute_end: float, t_end: float, wait_s: float, numel: int) -> None:
        with self._lock:
            if self.t_first_chunk is None or t_start < self.t_first_chunk:
                self.t_first_chunk = t_start
            if self.t_last_chunk is None or t_end > self.t_last_chunk:
                self.t_last_chunk = t_end
            busy = t_compute_end - t_start
            self.busy_s += busy
            self.wait_s += wait_s
            self.chunks += 1
            self.numel += numel
            if busy > 0 and numel:
                self.chunk_rates.append(numel / busy)

    def summary(self) -> dict[str, float]:
        """Milliseconds from the ``step()`` call (host clock) or from step entry on the compute stream (events).

        Keys: ``return_ms`` (``step()`` returned), ``first_chunk_ms``/``last_chunk_ms`` (host step of the
        first chunk began / last chunk finished, H2D issued), ``host_busy_ms``, ``d2h_wait_ms``,
        ``chunks``, ``host_gparams_s`` (numel / busy), ``chunk_gparams_min``/``_median``/``_max``;
        with timing events also ``d2h_done_ms`` (last gradient D2H finished, relative to the step
        entry on the compute stream; negative: before it) and ``h2d_done_ms`` (last H2D finished).
        Call after the device is synchronized.
        """
        nan = float("nan")
        rel = lambda t: (t - self.t_call) * 1e3 if t is not None else nan  # noqa: E731
        rates = sorted(self.chunk_rates)
        out = {
            "return_ms": rel(self.t_return), "first_chunk_ms": rel(self.t_first_chunk), "last_chunk_ms": rel(self.t_last_chunk),
            "host_busy_ms": self.busy_s * 1e3, "d2h_wait_ms": self.wait_s * 1e3, "chunks": float(self.chunks),
            "host_gparams_s": self.numel / self.busy_s / 1e9 if self.busy_s > 0 else nan,
            "chunk_gparams_min": rates[0] / 1e9 if rates else nan,
            "chunk_gparams_median": rates[len(rates) // 2] / 1e9 if rates else nan,
            "chunk_gparams_max": rates[-1] / 1e9 if rates else nan,
            "d2h_done_ms": nan, "h2d_done_ms": nan,
        }
        ent = self.entry_ev
        if ent is not None and hasattr(ent, "elapsed_time"):
            out["h2d_done_ms"] = _elapsed(ent, self.h2d_ev)
            base = self.bwd_start_ev
            if base is not None:  # both intervals positive: robust to events recorded before the entry
                out["d2h_done_ms"] = _elapsed(base, self.d2h_ev) - _elapsed(base, ent)
            else:
                out["d2h_done_ms"] = _elapsed(ent, self.d2h_ev)
        return out


def _elapsed(a: Any, b: Any) -> float:
    """``a.elapsed_time(b)`` in ms, NaN when either event is missing, untimed or not yet complete."""
    if a is None or b is None:
        return float("nan")
    try:
        return float(a.elapsed_time(b))
    except (RuntimeError, ValueError):  # untimed event (torch 2.11 raises ValueError) or not finished
        return float("nan")
