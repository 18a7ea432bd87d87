"""Timing, memory and copy-bandwidth helpers shared by the benchmark scripts.

On CUDA a region is timed with CUDA events recorded on the current stream; the device is
synchronized before the end event, so work left on side streams (offload copies, the host
optimizer's H2D) is counted. On the CPU (``--tiny``) the same code reads ``time.perf_counter``;
those numbers carry no claim.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

GiB = 1 << 30

# The scripts run from a checkout: make `import annotate_offload` find the checkout's package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def median(values) -> float:
    """Median of ``values``; ``nan`` when empty."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on CUDA, else ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached blocks, so the next method's peak starts clean (CUDA only:
    on the CPU there is no allocator cache, and ``gc.collect`` is slow once torch._dynamo is imported)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Clock:
    """Marks points in time; :meth:`elapsed_ms` gives the ms between consecutive marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self, *, sync: bool = False) -> None:
        if not self.cuda:
            self.marks.append(time.perf_counter())
            return
        if sync:
            torch.cuda.synchronize()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append(event)

    def elapsed_ms(self) -> list[float]:
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]


def mean_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Mean wall time of ``fn`` over ``repeats`` back-to-back calls, one synchronize at each end
    (work a call leaves in flight is counted in the next one)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / repeats


@dataclass
class StepTimes:
    """Per-step times (ms) and memory (bytes) of one method, after warm-up.

    Attributes:
        fwd_ms, bwd_ms, step_ms (list[float]): per timed step; ``bwd`` runs until the device is idle.
        peak_bytes (int | None): max over the timed steps of (peak allocated during the step minus
            allocated before it): the step's activation memory. ``None`` on the CPU.
        peak_total_bytes (int | None): max allocated during the timed steps. ``None`` on the CPU.
    """

    fwd_ms: list
    bwd_ms: list
    step_ms: list
    peak_bytes: int | None
    peak_total_bytes: int | None = None

    @property
    def step(self) -> float:
        return median(self.step_ms)

    @property
    def fwd(self) -> float:
        return median(self.fwd_ms)

    @property
    def bwd(self) -> float:
        return median(self.bwd_ms)


def time_steps(forward: Callable[[], object], backward: Callable[[object], None], *, device: torch.device,
               warmup: int, steps: int) -> StepTimes:
    """``warmup`` untimed, then ``steps`` timed ``backward(forward())`` steps (medians in :class:`StepTimes`)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}.")
    cuda = device.type == "cuda"
    for _ in range(warmup):
        backward(forward())
    fwd, bwd, peak, peak_total = [], [], None, None
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        clock = Clock(device)
        clock.mark()
        out = forward()
        clock.mark()
        backward(out)
        del out
        clock.mark(sync=True)
        f, b = clock.elapsed_ms()
        fwd.append(f)
        bwd.append(b)
        if cuda:
            high = torch.cuda.max_memory_allocated()
            peak = max(peak or 0, high - before)
            peak_total = max(peak_total or 0, high)
    return StepTimes(fwd, bwd, [f + b for f, b in zip(fwd, bwd)], peak, peak_total)


@dataclass(frozen=True)
class Bandwidth:
    """Pinned host<->device copy bandwidth, GB/s (1e9 bytes/s), median of the repeats."""

    d2h_gbps: float
    h2d_gbps: float
    nbytes: int
    pinned: bool

    def d2h_ms(self, nbytes: int) -> float:
        return nbytes / (self.d2h_gbps * 1e9) * 1e3

    def h2d_ms(self, nbytes: int) -> float:
        return nbytes / (self.h2d_gbps * 1e9) * 1e3


def copy_bandwidth(device: torch.device, *, nbytes: int = GiB, repeats: int = 5) -> Bandwidth:
    """D2H and H2D bandwidth of one ``nbytes`` copy each way (pinned host buffer on CUDA, one
    warm-up copy, median of ``repeats``); on the CPU, host-to-host copies that carry no claim."""
    cuda = device.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def gbps(dst, src) -> float:
        dst.copy_(src, non_blocking=True)
        times = []
        for _ in range(repeats):
            clock = Clock(device)
            clock.mark(sync=True)
            dst.copy_(src, non_blocking=True)
            clock.mark()
            times.append(clock.elapsed_ms()[0])
        return nbytes / (median(times) * 1e-3) / 1e9

    d2h, h2d = gbps(host, dev), gbps(dev, host)
    del host, dev
    free_memory(device)
    return Bandwidth(d2h, h2d, nbytes, cuda)


def bit_exact_context(device: torch.device):
    """A bit-reproducible attention backend for exactness steps (speed steps keep the default)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":
        return sdpa_kernel(SDPBackend.MATH)
    from annotate_offload.testing import bit_reproducible

    return bit_reproducible()


def fmt_bytes(n) -> str:
    """``"2.14 GiB"``, ``"12.3 MiB"`` below 0.1 GiB, ``"-"`` for ``None``."""
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 2**20:.1f} MiB"
