"""Host-link bandwidth for the cost model: pinned D2H and H2D copies timed on a side stream, per device.

Measured once per device and cached for the process (the first pinned allocation of a size is slow:
``cudaHostAlloc``). On CPU there is no host link; a host memcpy stands in and is labelled as such.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ._cost_model import LinkBandwidth

__all__ = ["measure_bandwidth"]

_BANDWIDTH_CACHE: dict[str, LinkBandwidth] = {}


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
