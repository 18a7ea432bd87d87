"""The ways a GPT stack's forward is run in the activation benchmark.

Each ``make_*`` takes the model and the number ``n`` of leading layers to treat (offload or
recompute) and returns a :class:`Runner`, or raises :class:`Unavailable` with the reason (the
row then reports it instead of a number). Forwards loop over ``model.layers`` themselves, the
way TransformerEngine/Megatron users wrap each layer call.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from annotate_offload.bench._peers import load_offload_activations

__all__ = [
    "Runner",
    "Unavailable",
    "make_baseline",
    "make_te_context",
    "make_synchronizer",
    "make_transform",
    "make_save_on_cpu",
    "make_checkpoint",
    "make_offload_activations",
    "saved_activation_bytes",
]


class Unavailable(Exception):
    """The method cannot run here (peer not importable, runtime not landed, ...)."""


@dataclass
class Runner:
    """A method ready to run.

    Attributes:
        forward (Callable[[Tensor], Tensor]): ``(B, S, H) -> (B, S, H)`` under the method.
        offloaded_bytes (Callable[[], int | None]): D2H bytes of the last step, if the method
            reports them (our runtime's ``OffloadStats.bytes_offloaded``).
        detail (str): configuration shown in the table.
        stats (Callable[[], object] | None): the runtime's last ``OffloadStats``, if any.
        close (Callable[[], None]): undo what the method did to the model (called once, after
            its measurements, also after a failure).
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    offloaded_bytes: Callable[[], int | None] = field(default=lambda: None)
    detail: str = ""
    stats: Callable[[], object] | None = None
    close: Callable[[], None] = field(default=lambda: None)


def make_baseline(model, n: int, **_) -> Runner:
    """No offload, no recompute."""

    def forward(x):
        for layer in model.layers:
            x = layer(x)
        return x

    return Runner(forward, detail="no offload")


def _runtime():
    try:
        import annotate_offload.runtime as runtime

        return runtime
    except Exception as exc:
        raise Unavailable(f"annotate_offload.runtime not importable ({type(exc).__name__}: {exc})") from None


def make_te_context(model, n: int, *, min_offload_numel=None) -> Runner:
    """annotate_offload through the TransformerEngine-compatible entry point::

        ctx, sync_fn = get_cpu_offload_context(enabled=True, num_layers=n, model_layers=L)
        with ctx: x = layer(x)
        x = sync_fn(x)
    """
    runtime = _runtime()
    get_ctx = getattr(runtime, "get_cpu_offload_context", None)
    if get_ctx is None:
        raise Unavailable("annotate_offload.runtime has no get_cpu_offload_context yet")
    extra = {} if min_offload_numel is None else {"min_offload_numel": min_offload_numel}
    with warnings.catch_warnings():  # the runtime warns that TE's schedule cannot overlap at n = L-1: known, measured here
        warnings.simplefilter("ignore", UserWarning)
        ctx, sync_fn = get_ctx(enabled=True, num_layers=n, model_layers=len(model.layers), **extra)

    def forward(x):
        for layer in model.layers:
            with ctx:
                x = layer(x)
            x = sync_fn(x)
        return x

    def stats():
        return getattr(ctx, "offload_synchronizer", None) and ctx.offload_synchronizer.stats

    return Runner(
        forward,
        offloaded_bytes=lambda: getattr(stats(), "bytes_offloaded", None),
        detail=f"get_cpu_offload_context(num_layers={n}), TE schedule",
        stats=stats,
    )


def make_synchronizer(model, n: int, *, release_lag=None, prefetch_layers=None, min_offload_numel=None) -> Runner:
    """annotate_offload's engine with its tuning knobs (docs/runtime_api.md)::

        sync = DefaultOffloadSynchronizer(num_layers=L, num_offloaded_layers=n,
                                          release_lag=k, prefetch_layers=p)
        sync.enter_layer(i); x = layer(x); x = sync.commit_layer(x, i)
    """
    runtime = _runtime()
    cls = getattr(runtime, "DefaultOffloadSynchronizer", None)
    if cls is None:
        raise Unavailable("annotate_offload.runtime has no DefaultOffloadSynchronizer yet")
    sync = cls(
        num_layers=len(model.layers),
        num_offloaded_layers=n,
        release_lag=release_lag,
        prefetch_layers=prefetch_layers,
        min_offload_numel=min_offload_numel,
    )

    def forward(x):
        try:
            for i, layer in enumerate(model.layers):
                sync.enter_layer(i)
                x = layer(x)
                x = sync.commit_layer(x, i)
        except BaseException:
            sync.abort()
            raise
        return x

    return Runner(
        forward,
        offloaded_bytes=lambda: sync.stats.bytes_offloaded,
        detail=f"release_lag={release_lag}, prefetch_layers={prefetch_layers}",
        stats=lambda: sync.stats,
    )


def make_transform(model, n: int, *, release_lag=None, prefetch_layers=None, min_offload_numel=None) -> Runner:
    """annotate_offload's declarative path: ``offload_transform(model, num_layers=n, ...)`` then
    plain ``model(x)`` (torch.fx pass over ``model.layers``); ``remove_offload`` on close."""
    try:
        from annotate_offload.annotate import offload_transform, remove_offload
    except Exception as exc:
        raise Unavailable(f"annotate_offload.annotate not importable ({type(exc).__name__}: {exc})") from None
    with warnings.catch_warnings():  # TE-schedule warning when both knobs are None at n = L-1
        warnings.simplefilter("ignore", UserWarning)
        offload_transform(
            model,
            num_layers=n,
            release_lag=release_lag,
            prefetch_layers=prefetch_layers,
            min_offload_numel=min_offload_numel,
        )
    plan = model.offload_plan

    return Runner(
        model,
        offloaded_bytes=lambda: plan.bytes_per_step if plan.bytes_source == "measured" else None,
        detail=f"offload_transform(num_layers={n}, release_lag={release_lag}, prefetch_layers={prefetch_layers}), path={plan.path}",
        close=lambda: remove_offload(model),
    )


def make_save_on_cpu(model, n: int, **_) -> Runner:
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around each of the first n layers."""
    pin = torch.cuda.is_available()

    def forward(x):
        for i, layer in enumerate(model.layers):
            cm = torch.autograd.graph.save_on_cpu(pin_memory=pin) if i < n else contextlib.nullcontext()
            with cm:
                x = layer(x)
        return x

    return Runner(forward, detail=f"pin_memory={pin}, first {n} layers")


def make_checkpoint(model, n: int, **_) -> Runner:
    """Full recompute: ``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)``."""

    def forward(x):
        for i, layer in enumerate(model.layers):
            x = checkpoint(layer, x, use_reentrant=False) if i < n else layer(x)
        return x

    return Runner(forward, detail=f"non-reentrant, first {n} layers")


def make_offload_activations(model, n: int, **_) -> Runner:
    """TRL's (or torchtune's) ``OffloadActivations`` as they use it: one context around the
    forward, ``NoOpManager`` around the layers that keep their activations (layers n..L-1)."""
    peer = load_offload_activations()
    if not peer.info.available:
        raise Unavailable(peer.info.detail)
    if next(model.parameters()).device.type == "cpu":
        # It reads torch.accelerator.current_accelerator().type at construction.
        raise Unavailable(f"{peer.info.name} {peer.info.version} is importable but needs an accelerator (CPU run)")
    streams = torch.cuda.is_available()
    offloader = peer.offload_cls(use_pin_memory=streams, use_streams=streams)

    def forward(x):
        with offloader:
            for i, layer in enumerate(model.layers):
                if i < n:
                    x = layer(x)
                else:
                    with peer.noop_cls():
                        x = layer(x)
        return x

    version = peer.info.version or "?"
    return Runner(forward, detail=f"{peer.info.name} {version}, use_streams={streams}")


def saved_activation_bytes(model, x: torch.Tensor, n: int, *, split: bool = False):
    """Bytes autograd saves in layers ``0..n-1`` (each storage once, parameters excluded).

    An independent count of what an offloader has to move, measured with a
    ``saved_tensors_hooks`` that only records (no copy). It counts every saved tensor; the
    runtime skips small ones (``min_offload_numel``), so its ``bytes_offloaded`` may be lower.

    Args:
        model: the GPT stack (``model.layers``).
        x (Tensor): its input ``(B, S, H)``.
        n (int): leading layers to count.
        split (bool): also return the bytes of the saved storage that is ``x``'s own: the caller
            holds it, so offloading it frees no GPU memory.

    Returns:
        int: bytes; with ``split``, ``(bytes, bytes of x's storage among them)``.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if t.device == x.device and ptr not in param_storages:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    out = x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers[:n]:
            out = layer(out)  # keeps every saved tensor alive, so no pointer is reused
    del out
    total = sum(seen.values())
    return (total, seen.get(x.untyped_storage().data_ptr(), 0)) if split else total
