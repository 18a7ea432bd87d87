"""Device backends: the stream/event layer under the offload runtime.

Two backends implement one small interface:

* ``_CudaBackend``: real CUDA streams and events. One D2H and one H2D side stream per device,
  shared by every synchronizer of the process (one runtime, not one stream set per context).
* ``_CpuBackend``: for machines without a GPU (developers, CI). Streams and events are no-ops that
  are always complete, but the "device" tensors are real CPU tensors and the "host copies" are
  real, separate CPU tensors, so every state machine, the deduplication, the view rebuilding and
  the numerics run exactly as on a GPU. Only the concurrency is missing.

Note [Offload ordering]: D2H waits for the tensor's ready point on the
compute stream; the compute stream waits for the D2H before the last GPU reference is dropped;
H2D waits for the D2H that filled its host buffer; an unpack waits for its own H2D event; reload
buffers are allocated on the compute stream (the caching allocator's pools are per stream: a block
allocated on a side stream is never reused by the compute stream's own allocations).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any

import torch

__all__: list[str] = []


class _NullStream:
    """A stream (and its events) whose work is always complete (CPU backend)."""

    __slots__ = ()

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "_NullStream()"


_NULL_STREAM = _NullStream()


class _Backend:
    """What the CPU and CUDA backends share: ``device``, ``d2h_stream``/``h2d_stream``, ``current_stream()``,
    ``stream_ctx(stream)``, ``record(stream)`` (a new event) and ``is_done(event)``."""

    device_type: str = "cpu"
    device: torch.device

    def is_done(self, event: Any) -> bool:
        return bool(event.query())


class _CpuBackend(_Backend):
    """Streams and events are no-ops; tensors are CPU tensors (see module docstring)."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.d2h_stream = _NULL_STREAM
        self.h2d_stream = _NULL_STREAM

    def current_stream(self) -> Any:
        return _NULL_STREAM

    def stream_ctx(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        return _NULL_STREAM

    def is_done(self, event: Any) -> bool:
        return True

    def __repr__(self) -> str:
        return "_CpuBackend()"


class _CudaBackend(_Backend):
    """CUDA streams and events for one device; the side streams are created lazily."""

    device_type = "cuda"

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)

    @functools.cached_property
    def d2h_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    @functools.cached_property
    def h2d_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream_ctx(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def __repr__(self) -> str:
        return f"_CudaBackend({self.device})"


_BACKENDS: dict[str, _Backend] = {}
_LOCK = threading.Lock()


def get_backend(device: "str | torch.device | None" = None) -> _Backend:
    """Return the process-wide backend for ``device``.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``. ``None`` picks CUDA
            (the current device) when ``torch.cuda.is_available()``, else the CPU backend. The
            environment variable ``ANNOTATE_OFFLOAD_DEVICE`` overrides the automatic choice.

    Raises:
        ValueError: for a device type other than ``cpu`` or ``cuda``, or ``cuda`` without CUDA.
    """
    if device is None:
        env = os.environ.get("ANNOTATE_OFFLOAD_DEVICE")
        if env:
            device = env
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={str(device)!r} is not a device torch knows ({exc}); use 'cuda' or 'cpu'"
        ) from None
    if dev.type == "cpu":
        key = "cpu"
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}: CUDA is not available on this machine; "
                "pass device='cpu' to run the offload runtime on the CPU backend"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        key = f"cuda:{index}"
    else:
        raise ValueError(
            f"device={str(device)!r}: the offload runtime supports 'cuda' and 'cpu' devices only"
        )
    with _LOCK:
        backend = _BACKENDS.get(key)
        if backend is None:
            backend = _CpuBackend() if key == "cpu" else _CudaBackend(int(key.split(":")[1]))
            _BACKENDS[key] = backend
    return backend
