"""What the host offers the cost model, measured once per device and cached for the process: the link's
pinned D2H and H2D bandwidth (copies timed on a side stream) and fused AdamW's time per element on the
host and on the device (the first pinned allocation of a size is slow: ``cudaHostAlloc``). On a CPU
there is no host link; a host memcpy stands in and is labelled as such.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ._cost_model import LinkBandwidth

__all__ = ["measure_bandwidth", "measure_adamw"]

_BANDWIDTH_CACHE: dict[str, LinkBandwidth] = {}
_ADAMW_CACHE: dict[str, tuple[float, float]] = {}


def _device_key(device: Any) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"measure_bandwidth: device={device!r} is not a torch device; pass e.g. 'cuda:0'.") from exc
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"measure_bandwidth: device={device!r} is not supported; pass a 'cuda' or 'cpu' device.")
    return dev


def _time_copies(dst: torch.Tensor, src: torch.Tensor, repeats: int, stream) -> float:
    """Median ms of ``dst.copy_(src)`` over ``repeats`` after one warm-up copy."""
    times = []
    if stream is None:
        dst.copy_(src)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            stop.record(stream)
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _measure_link(dev: torch.device, nbytes: int, repeats: int) -> LinkBandwidth:
    if dev.type == "cpu":
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        ms = _time_copies(b, a, repeats, None)
        gbps = nbytes / (ms * 1e6)
        return LinkBandwidth(gbps, gbps, source=f"cpu memcpy of {nbytes >> 20} MiB (no host link; stands in for D2H/H2D)")
    stream = torch.cuda.Stream(dev)
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.current_stream(dev).synchronize()
    d2h = _time_copies(host, gpu, repeats, stream)
    h2d = _time_copies(gpu, host, repeats, stream)
    return LinkBandwidth(
        nbytes / (d2h * 1e6), nbytes / (h2d * 1e6), source=f"measured {dev} pinned, {nbytes >> 20} MiB, side stream"
    )


def measure_bandwidth(device: Any = None, *, nbytes: int | None = None, repeats: int = 5) -> LinkBandwidth:
    """Pinned D2H and H2D bandwidth of ``device``'s host link, GB/s, measured once per device.

    Args:
        device: a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device``) or ``"cpu"``; ``None`` means
            the current CUDA device if there is one, else CPU. On CPU the figure is a host memcpy,
            labelled as such in ``source``.
        nbytes (int | None): bytes per copy. Default: 256 MiB on CUDA, 64 MiB on CPU.
        repeats (int): timed copies per direction; the median is kept. Default: ``5``.

    Returns:
        LinkBandwidth: the measured bandwidths; later calls for the same device return the same object.

    Raises:
        ValueError: an unsupported device, ``nbytes < 1`` or ``repeats < 1``.
    """
    dev = _device_key(device)
    cached = _BANDWIDTH_CACHE.get(str(dev))
    if cached is not None:
        return cached
    if nbytes is None:
        nbytes = 256 << 20 if dev.type == "cuda" else 64 << 20
    for name, value in (("nbytes", nbytes), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"measure_bandwidth: {name} must be an int >= 1, got {value!r}.")
    result = _measure_link(dev, nbytes, repeats)
    _BANDWIDTH_CACHE[str(dev)] = result
    return result


def _adamw_ms(device: torch.device, numel: int) -> float:
    """Median ms of one fused AdamW step over ``numel`` fp32 elements on ``device`` (3 after a warm-up)."""
    param = torch.zeros(numel, device=device, requires_grad=True)
    param.grad = torch.ones_like(param)
    opt = torch.optim.AdamW([param], fused=True)
    times = []
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def measure_adamw(device: Any = None, *, numel: int | None = None) -> tuple[float, float]:
    """``(device ms, host ms)`` of torch's fused AdamW per 1e9 fp32 elements, measured once per device.

    The host figure uses the threads ``HybridDeviceOptimizer`` gives its host step by default (the usable
    CPUs divided by ``LOCAL_WORLD_SIZE``); on a CPU device both figures are the host's.

    Args:
        device: as for :func:`measure_bandwidth`.
        numel (int | None): elements per timed step. Default: ``2**25`` on CUDA, ``2**22`` on CPU.

    Raises:
        ValueError: an unsupported device.
    """
    from ..optim._hybrid import num_threads, thread_budget

    dev = _device_key(device)
    if str(dev) not in _ADAMW_CACHE:
        numel = numel or (1 << 25 if dev.type == "cuda" else 1 << 22)
        with num_threads(thread_budget(beside_training=False)):  # the default mode's host step
            host = _adamw_ms(torch.device("cpu"), numel) * 1e9 / numel
        on_device = host if dev.type == "cpu" else _adamw_ms(dev, numel) * 1e9 / numel
        _ADAMW_CACHE[str(dev)] = (on_device, host)
    return _ADAMW_CACHE[str(dev)]
