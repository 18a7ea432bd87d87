"""Timing, memory and copy-bandwidth measurement for the benchmarks.

On CUDA a step is timed with CUDA events: ``start`` is recorded on the current stream, the step
runs, the device is synchronized (so work the step left on side streams is counted too), then
``end`` is recorded and waited for. A forward/backward split uses a third event recorded between
them. On CPU (``--tiny``) the same code uses ``time.perf_counter``; those numbers carry no claim.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["StepTimes", "time_steps", "copy_bandwidth", "Bandwidth", "free_memory", "median"]

GiB = 1024**3


def median(values) -> float:
    """Median of a non-empty sequence (``statistics.median``); ``nan`` when empty."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


class _Clock:
    """Marks points of a step; elapsed times in ms between consecutive marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self, *, sync: bool = False) -> None:
        if self.cuda:
            if sync:
                torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def elapsed_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


@dataclass
class StepTimes:
    """Per-step timings (ms) and memory (bytes) of one method, after warm-up.

    Attributes:
        fwd_ms, bwd_ms, step_ms (list[float]): per measured step; ``step = fwd + bwd``
            where ``bwd`` runs until the device is idle.
        peak_bytes (int | None): max over measured steps of (peak allocated during the step
            minus allocated before it): the activation memory; ``None`` on CPU (no allocator
            statistics).
        peak_total_bytes (int | None): max allocated during the measured steps (weights,
            grads and activations); ``None`` on CPU.
    """

    fwd_ms: list
    bwd_ms: list
    step_ms: list
    peak_bytes: int | None
    peak_total_bytes: int | None = None

    @property
    def step(self) -> float:
        """Median step time (ms)."""
        return median(self.step_ms)

    @property
    def fwd(self) -> float:
        """Median forward time (ms)."""
        return median(self.fwd_ms)

    @property
    def bwd(self) -> float:
        """Median backward time (ms), until the device is idle."""
        return median(self.bwd_ms)


def time_steps(
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    *,
    device: torch.device,
    warmup: int,
    steps: int,
) -> StepTimes:
    """Run ``warmup`` untimed then ``steps`` timed forward+backward steps.

    Args:
        forward: runs the forward, returns the output.
        backward: runs the backward from that output.
        device (torch.device): where the step runs; CUDA events on ``cuda``.
        warmup (int): untimed steps first (allocator, pinned pools, cuBLAS/cuDNN autotune).
        steps (int): timed steps, at least 1.

    Returns:
        StepTimes: per-step lists and the peak extra memory.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}.")
    cuda = device.type == "cuda"
    for _ in range(warmup):
        backward(forward())
    fwd, bwd, total, peak, peak_total = [], [], [], None, None
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        clock = _Clock(device)
        clock.mark()
        out = forward()
        clock.mark()
        backward(out)
        del out
        clock.mark(sync=True)
        f, b = clock.elapsed_ms()
        fwd.append(f)
        bwd.append(b)
        total.append(f + b)
        if cuda:
            extra = torch.cuda.max_memory_allocated() - before
            peak = extra if peak is None else max(peak, extra)
            peak_total = max(peak_total or 0, torch.cuda.max_memory_allocated())
    return StepTimes(fwd, bwd, total, peak, peak_total)


@dataclass(frozen=True)
class Bandwidth:
    """Pinned host<->device copy bandwidth.

    Attributes:
        d2h_gbps, h2d_gbps (float): GB/s (1e9 bytes/s), median of the repeats.
        nbytes (int): bytes per copy.
        pinned (bool): host buffer was pinned (False on CPU, where both are host copies).
    """

    d2h_gbps: float
    h2d_gbps: float
    nbytes: int
    pinned: bool

    def d2h_ms(self, nbytes: int) -> float:
        """Time (ms) to move ``nbytes`` device->host at the measured rate."""
        return nbytes / (self.d2h_gbps * 1e9) * 1e3

    def h2d_ms(self, nbytes: int) -> float:
        """Time (ms) to move ``nbytes`` host->device at the measured rate."""
        return nbytes / (self.h2d_gbps * 1e9) * 1e3


def copy_bandwidth(device: torch.device, *, nbytes: int = GiB, repeats: int = 5) -> Bandwidth:
    """Measure D2H and H2D copy bandwidth with one ``nbytes`` buffer each way.

    On CUDA: a pinned host buffer and a device buffer, ``copy_(non_blocking=True)`` on the
    current stream, timed with CUDA events, one warm-up copy each way, median of ``repeats``.
    On CPU: plain host-to-host copies (no claim; keeps ``--tiny`` running the same code).

    Args:
        device (torch.device): the accelerator.
        nbytes (int): bytes per copy. Default: 1 GiB (issue 7).
        repeats (int): timed copies per direction. Default: ``5``.

    Returns:
        Bandwidth: GB/s each way.
    """
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.fill_(2)

    def timed(dst, src) -> float:
        dst.copy_(src, non_blocking=True)  # warm-up
        times = []
        for _ in range(repeats):
            clock = _Clock(device)
            clock.mark(sync=True)
            dst.copy_(src, non_blocking=True)
            clock.mark()
            times.append(clock.elapsed_ms()[0])
        return nbytes / (median(times) * 1e-3) / 1e9

    d2h = timed(host, dev)
    h2d = timed(dev, host)
    del host, dev
    free_memory(device)
    return Bandwidth(d2h, h2d, nbytes, cuda)


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached device blocks so the next method starts clean (CUDA
    only: on CPU there is no allocator cache to reset, and ``gc.collect`` costs ~0.5 s a call
    once torch._dynamo is imported)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
