"""``get_cpu_offload_context``: the TransformerEngine-compatible entry point.

Port TE code by changing one import::

    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=N, model_layers=L)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync(x)
    loss_fn(x).backward()

Same signature, positional order, returns and validation as TransformerEngine's; additions: the
D2H copies start at save time, keyword-only ``prefetch_layers``, ``policy``, ``min_offload_numel`` and
``device``, and with grad disabled (eval passes) the context passes straight through.

Note [Nesting]. Several offload contexts may live in one process, each with its own synchronizer,
sharing the side streams and the host buffer pool. Only the innermost ``saved_tensors_hooks`` pair
is active: a user's own hooks entered *inside* a layer's scope see every tensor saved there (nothing
is offloaded); hooks entered *around* the context see only what is saved outside the layer scopes.
A ``torch.utils.checkpoint`` inside a layer saves its inputs through the runtime's hooks.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import OffloadError
from ._layer_state import _counter, _version_error
from ._synchronizer import (DefaultOffloadSynchronizer, ManualOffloadSynchronizer, OffloadSynchronizer,
                            _active_synchronizer, _check_int, _identity, _recording)

__all__ = ["get_cpu_offload_context", "is_cpu_offload_enabled", "active_offload_policy"]


def inside_checkpoint() -> bool:
    """True while the innermost saved-tensor hooks are a non-reentrant ``torch.utils.checkpoint``'s
    (its forward or its recompute in backward), or :func:`checked_saves` over them.

    Note [A checkpoint around the layer]: such a checkpoint keeps only its inputs and recomputes the
    rest in backward. A layer scope opened inside it stays correct (Note [Scopes inside a
    checkpoint]) but would offload what the checkpoint means to recompute, so layer wrappers and
    adapter marks use this to stand aside there.
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    pack = top[0]
    return getattr(pack, "__module__", "") == "torch.utils.checkpoint" or getattr(pack, "func", None) is _checked_pack


@contextlib.contextmanager
def checked_saves(inner: Any) -> Iterator[None]:
    """``inner`` inside saved-tensor hooks that version-check what a non-reentrant checkpoint's forward saves.

    Note [Versions inside a checkpoint]: the checkpoint's recompute refills placeholders, so autograd
    never compares a saved tensor's version with the one it had at save, and a forward that changed a
    saved tensor in place afterwards (``y = sigmoid(h); y.mul_(h)``) would train on silently where the
    run without the checkpoint raises. These hooks, entered inside the checkpoint's, pass each tensor to
    its pack and record its version counter (``_counter``) and version; their unpack raises autograd's
    error where the version moved. They are partials of module functions, holding nothing that refers
    back to them, so a graph never run backward is freed by reference counting.
    """
    pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(_checked_pack, pack),
                                                  functools.partial(_checked_unpack, unpack)), inner:
        yield


def _checked_pack(pack: Callable[[torch.Tensor], Any], t: torch.Tensor) -> tuple:
    return pack(t), _counter(t), t._version


def _checked_unpack(unpack: Callable[[Any], torch.Tensor], packed: tuple) -> torch.Tensor:
    held, counter, version = packed
    if counter._version != version:
        raise _version_error(counter._version, version)
    return unpack(held)


def is_cpu_offload_enabled() -> bool:
    """True while a layer's offload scope is open on this thread (modules sample it in forward)."""
    return _active_synchronizer() is not None


def active_offload_policy() -> Optional[str]:
    """Selection policy of the open offload scope: ``"opt_out"``, ``"opt_in"``, or ``None``.

    Modules that mark their tensors (LoRA adapters) read it in forward: under ``"opt_in"`` they tag
    what should move (``activation_offloading=True``), under ``"opt_out"`` what should stay.
    """
    sync = _active_synchronizer()
    return None if sync is None else sync.policy


class _CpuOffloadContext(contextlib.ContextDecorator):
    """Reusable per-layer context: entered once per layer, followed by the sync function.

    Attributes:
        offload_synchronizer (OffloadSynchronizer): the synchronizer driving the copies.
        inside_context (bool): True between ``__enter__`` and ``__exit__`` (Megatron reads it).
        current_layer (int | None): index of the layer last entered with grad enabled.
    """

    def __init__(self, synchronizer: OffloadSynchronizer) -> None:
        self.offload_synchronizer = synchronizer
        self.inside_context = False
        self.current_layer: Optional[int] = None
        self._uncommitted = False  # a layer ran with grad and its sync_fn has not been called yet

    def __enter__(self) -> "_CpuOffloadContext":
        if self.inside_context:
            raise OffloadError(
                "get_cpu_offload_context: the offload context was entered again while inside it; "
                "use one `with ctx:` per layer, not nested"
            )
        sync = self.offload_synchronizer
        if self._uncommitted and _recording():
            # the previous layer never reached sync_fn: its forward was abandoned (an exception
            # between the layer and sync_fn). Drop that step; this entry starts a new one.
            sync.abort()
        index = sync._enter(None)
        if index is not None:
            self.current_layer, self._uncommitted = index, True
        self.inside_context = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.inside_context = False
        sync = self.offload_synchronizer
        if exc_type is not None and sync._scope is not None:
            sync.abort()
            self.current_layer, self._uncommitted = None, False
        else:
            sync.exit_layer()

    def synchronization_function(self, tensor: torch.Tensor) -> torch.Tensor:
        """The layer-boundary commit: call on each layer's output, outside the context.

        Returns ``tensor`` itself. With grad disabled, and in a checkpoint's recompute, it returns
        its input and does nothing. An output without a ``grad_fn`` (a frozen layer's) ends the layer
        with no backward to track: whatever it saved reloads when backward unpacks it.

        Raises:
            OffloadError: if called inside the context, or before any layer was entered.
            TypeError: if ``tensor`` is not a tensor.
        """
        if not _recording():
            return tensor
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"synchronization function: expected the layer's output tensor, got {type(tensor).__name__}"
            )
        if self.inside_context:
            raise OffloadError(
                "synchronization function called inside the offload context; call it after the "
                "`with ctx:` block: `with ctx: x = layer(x)` then `x = sync_fn(x)`"
            )
        if self.current_layer is None:
            raise OffloadError(
                "synchronization function called before any layer ran inside the offload "
                "context; enter the context for a layer first (`with ctx: x = layer(x)` then "
                "`x = sync_fn(x)`). A layer run with autograd off does not count: "
                "torch.utils.checkpoint(use_reentrant=True) runs its function under no_grad, so "
                "call sync_fn inside the checkpointed function too (nothing is offloaded there), "
                "or use use_reentrant=False"
            )
        self.offload_synchronizer._mark_boundary(tensor, self.current_layer)
        self._uncommitted = False
        return tensor

    def __repr__(self) -> str:
        return (
            f"_CpuOffloadContext(inside_context={self.inside_context}, "
            f"current_layer={self.current_layer}, offload_synchronizer={self.offload_synchronizer!r})"
        )


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: Optional[int] = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: Optional[Any] = None,
    *,
    prefetch_layers: Optional[int] = None,
    policy: Optional[str] = None,
    min_offload_numel: Optional[int] = None,
    device: Any = None,
) -> tuple:
    """Activation offloading context and sync function, drop-in for TransformerEngine's.

    Args:
        enabled (bool): ``False`` returns ``(nullcontext(), identity)`` (plus ``None`` in manual mode)
            without validating the other arguments. Default: ``False``.
        num_layers (int): layers to offload, ``0 <= num_layers <= model_layers - 1`` (the first
            ``num_layers`` layers; ignored in manual mode). Default: ``1``.
        model_layers (int): layer scopes per forward (number of ``with ctx:`` entries).
        offload_activations (bool): offload activations saved for backward. Default: ``True``.
        offload_weights (bool): deprecated, as in TE: warns and offloads no weights.
        double_buffering (bool): accepted for compatibility; it has no effect (as in TE V2).
        manual_synchronization (bool): return a :class:`ManualOffloadSynchronizer` as third item;
            the user calls its ``start_offload_layer`` / ``release_activation_forward_gpu_memory``
            / ``start_reload_layer``.
        retain_pinned_cpu_buffers (bool): see :class:`OffloadSynchronizer`.
        offload_stream: a CUDA stream for the copies; manual mode only (as in TE).
        prefetch_layers (int): the schedule's look-ahead ``k >= 1`` both ways (``release_lag`` and
            ``prefetch_layers`` of :class:`DefaultOffloadSynchronizer`); ``None``: TE's. Default: ``None``.
        policy (str): ``"opt_out"`` (default) or ``"opt_in"``; ``None`` follows
            ``NVTE_CPU_OFFLOAD_V1``.
        min_offload_numel (int): size threshold in logical elements. Default: 262144.
        device: ``"cuda"``, ``"cpu"`` (CPU backend, for machines without a GPU) or ``None``.

    Returns:
        ``(context, sync_fn)``, or ``(context, sync_fn, synchronizer)`` in manual mode.

    Raises:
        ValueError: nothing selected to offload; ``num_layers > model_layers - 1``;
            ``offload_stream`` without manual mode; values out of range.
        TypeError: arguments of the wrong type (the flags must be ``bool``).

    Warns:
        UserWarning: ``num_layers == model_layers - 1`` (TE's schedule cannot overlap copies with
            compute then; pass ``prefetch_layers=1`` to overlap anyway).
        DeprecationWarning: ``offload_weights=True``.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r}: expected a bool (True or False)")
    null = (contextlib.nullcontext(), _identity) + ((None,) if manual_synchronization else ())
    if not enabled:
        return null
    flags = dict(offload_activations=offload_activations, offload_weights=offload_weights,
                 double_buffering=double_buffering, manual_synchronization=manual_synchronization,
                 retain_pinned_cpu_buffers=retain_pinned_cpu_buffers)
    for name, value in flags.items():
        if not isinstance(value, bool):  # a string such as "no" is truthy: it would do the opposite of what it says
            raise TypeError(f"{name}={value!r}: expected a bool (True or False)")
    if not offload_activations and not offload_weights:
        raise ValueError(
            "CPU Offloading is enabled while it is not mentioned what to offload (weights/"
            "activations): offload_activations=False and offload_weights=False; pass "
            "offload_activations=True or enabled=False"
        )
    if offload_weights:
        warnings.warn(
            "Offloading weights is deprecated. Using offload_weights=True does not have any effect.",
            DeprecationWarning,
            stacklevel=2,
        )
        if not offload_activations:
            return null
    _check_int("model_layers", model_layers, 1)
    if offload_stream is not None and not manual_synchronization:
        raise ValueError(
            "offload_stream is only supported with manual_synchronization=True; drop "
            "offload_stream or pass manual_synchronization=True"
        )
    common = dict(policy=policy, min_offload_numel=min_offload_numel, device=device)
    if manual_synchronization:
        sync: OffloadSynchronizer = ManualOffloadSynchronizer(
            model_layers, retain_pinned_cpu_buffers, offload_stream, **common
        )
    else:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int):
            raise TypeError(f"num_layers={num_layers!r}: expected an int")
        if num_layers < 0:
            raise ValueError(f"num_layers={num_layers}: must be >= 0 (the first num_layers layers are offloaded; 0 offloads none)")
        if num_layers > model_layers - 1:
            raise ValueError(
                f"Cannot offload {num_layers} layers of {model_layers}: the last layer is not "
                f"offloaded. num_layers={num_layers} must be <= model_layers - 1 = "
                f"{model_layers - 1}"
            )
        if num_layers == model_layers - 1 and num_layers > 0 and prefetch_layers is None:
            warnings.warn(
                f"Offloading num_layers={num_layers} of model_layers={model_layers}: with "
                "TransformerEngine's schedule no overlap of copies and compute is possible; "
                "pass prefetch_layers=1 to overlap anyway.",
                UserWarning,
                stacklevel=2,
            )
        sync = DefaultOffloadSynchronizer(
            model_layers,
            num_layers,
            retain_pinned_cpu_buffers,
            None,
            release_lag=prefetch_layers,
            prefetch_layers=prefetch_layers,
            **common,
        )
    ctx = _CpuOffloadContext(sync)
    if manual_synchronization:
        return ctx, ctx.synchronization_function, sync
    return ctx, ctx.synchronization_function
