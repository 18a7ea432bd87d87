"""Offload synchronizers: when each layer's saved tensors move, and the saved-tensor hooks.

Note [Default schedule]. With ``L`` model layers of which the set ``O`` is offloaded (TE: layers
``0..N-1``, never the last):

* forward: every eligible tensor saved in an offloaded layer starts its D2H copy *at save time*,
  on the D2H stream, behind its ready event (from :func:`start_offload`, or the compute stream's
  position at save).
* release: layer ``i``'s device bytes are dropped (after the compute stream waits for its D2H) at
  the entry of layer ``i + 1 + lag`` at the latest, or at the end of forward. ``release_lag=None``
  is TransformerEngine's bound ``lag = L - N - 1``. At every layer entry, layers whose D2H has
  already finished are released early without any wait.
* prefetch: when backward reaches layer ``m``, the reloads of offloaded layers ``m - k .. m`` start
  on the H2D stream (``prefetch_layers=None`` is TE's ``k = L - N - 1``; a given ``k >= 1`` keeps a
  reload in flight even at ``N = L - 1``, where TE serialises). With ``k = 1`` the reload of
  ``m - 1`` waits for half of layer ``m`` (Note [Paced prefetch]).
* a unit's reload is dropped once each of its handles has been unpacked (Note [Offload lifetime]),
  so a layer's reloads shrink while its backward runs.
* when backward reaches layer ``m``, the layers above ``m`` that it passed are released, and the end
  of a backward pass releases the layers it passed. A layer it did not reach (another output's
  graph, manual reloads) keeps its state until its own backward, or until the next step.

Peak offloaded activations on the device: ``lag + 1`` offloaded layers in forward (plus the kept
layers), at most ``k + 1`` in backward (about 1.5 with ``k = 1``).

Note [Paced prefetch]. With a look-ahead of one layer, the reload of layer ``m - 1`` starts once
half of the bytes layer ``m`` holds for backward have been used: its reloaded units (counted when
each is dropped; in a compiled graph at its ``ready``) or, for a kept layer ``m`` above an offloaded
one, its saved activations (counted at their first unpack). That keeps about 1.5 layers on the
device instead of two while the H2D still runs ahead of compute. If the half is never reached, the
pre-hook of ``m - 1`` (or its first unpack) starts the reload; reaching another layer disarms it.

Note [Scopes inside a checkpoint]. A layer scope opened while autograd runs a backward (the
recompute of a ``torch.utils.checkpoint`` around it) installs pass-through saved-tensor hooks, so
exactly the saves that went to the runtime in forward stay away from the checkpoint's hooks in the
recompute, and the checkpoint pairs its saved tensors by position with the same ones. The runtime's
state is not touched: what the recompute saves inside the scope belongs to a graph that is never
run.

Note [Errors leave nothing behind]. An exception inside a scope (the context's ``__exit__``), a
refused entry, or an error while the runtime enters a layer closes the hooks and drops the step
(host copies stay valid for a graph still alive, so this never changes a result). An exception
between a layer and its ``sync_fn`` leaves the layer uncommitted: the context's next entry drops
that step and counts from layer 0.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
import weakref
from typing import Any, Iterable, Optional

import torch
from torch.utils._pytree import tree_leaves

from ..errors import OffloadError
from ._device import _Backend, get_backend
from ._layer_state import (DEFAULT_MIN_OFFLOAD_NUMEL, _is_fake, _is_frozen_weight_copy, _is_param_alias, _Kept,
                           _LayerState, _Packed, _Pacer, frozen_shapes)
from ._marks import check_policy
from ._pinned_pool import get_pool
from ._stats import OffloadStats
from ._tensor_group import _unit_range

__all__ = ["OffloadSynchronizer", "DefaultOffloadSynchronizer", "ManualOffloadSynchronizer"]


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list = []  # the synchronizers whose layer scope is open on this thread, innermost last


_SCOPES = _Scopes()


def _active_stack() -> list:
    """The synchronizers whose layer scope is open on this thread, innermost last."""
    return _SCOPES.stack


def _active_synchronizer() -> Optional["OffloadSynchronizer"]:
    """The synchronizer whose layer scope is open on this thread, if any. None in code that
    ``torch.compile`` traces, which opens no scope (Note [Traced layers] in ``annotate/_layers.py``)."""
    if torch.compiler.is_compiling():
        return None
    stack = _active_stack()
    return stack[-1] if stack else None


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (e.g. a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


def _in_func_transform() -> bool:
    """True inside a ``torch.func`` transform (``grad``, ``jvp``, ``vmap``): its tensors are wrappers that
    saved-tensor hooks may not see, so layers run there as without offload."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _recording() -> bool:
    """True while a forward records for backward: grad enabled, not inside a backward or a ``torch.func`` transform."""
    return torch.is_grad_enabled() and not _in_backward() and not _in_func_transform()


def _check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an int")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value}: must be {rng}")
    return value


def _identity(t: Any) -> Any:
    """Pass-through saved-tensor hooks, and the sync function of a disabled offload context."""
    return t


class _Step:
    """One forward's layer states and its backward bookkeeping."""

    __slots__ = ("layers", "kept", "armed", "shared", "bwd_active", "bwd_seen", "ended")

    def __init__(self) -> None:
        self.layers: Any = {}  # dict[int, _LayerState]; weak values once a backward ended
        self.kept: dict[int, _Pacer] = {}  # kept layers that pace a reload (Note [Paced prefetch])
        self.armed: Optional[_Pacer] = None  # the pacer holding a deferred reload
        self.shared: dict = {}  # storage units copied in this step, for cross-layer dedup
        self.bwd_active = False  # a backward pass is running through this step's boundaries
        self.bwd_seen: set[int] = set()  # layers that backward pass has reached
        self.ended = False  # a backward pass ended: the next layer entry starts a new step

    def disarm(self) -> None:
        """Drop the reload a pacer deferred, if any (Note [Paced prefetch])."""
        if self.armed is not None:
            self.armed.then = self.armed = None


class _StreamOverride:
    """A backend whose D2H and H2D streams are a user-given stream (TE's ``offload_stream``)."""

    def __init__(self, backend: _Backend, stream: Any):
        self._backend = backend
        self.d2h_stream = stream
        self.h2d_stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class OffloadSynchronizer:
    """Base class: saved-tensor hooks, layer scopes, steps and eligibility.

    Driven TransformerEngine's way (:meth:`fwd_step` per layer, counted modulo ``num_layers``,
    :meth:`push_tensor` / :meth:`pop_tensor`, :meth:`bwd_step`, :meth:`finish_part_of_bwd`) or by
    layer index, as the layer wrappers do (:meth:`enter_layer`, :meth:`commit_layer`, :meth:`abort`).

    Args:
        num_layers (int): model layers, i.e. layer scopes per forward (TE's ``model_layers``).
        retain_pinned_cpu_buffers (bool): accepted for TransformerEngine compatibility: host buffers
            are always pooled and reused across steps (:meth:`release_pinned_buffers` frees the unused
            ones). Default: ``False``.
        offload_stream: a CUDA stream for both D2H and H2D instead of the shared side streams (TE's
            manual-mode option). Default: ``None``.
        policy (str): ``"opt_out"`` or ``"opt_in"``; ``None`` uses ``NVTE_CPU_OFFLOAD_V1``.
        min_offload_numel (int): tensors with fewer logical elements stay on the device.
            Default: 262144 (256K, TransformerEngine's threshold).
        device: ``"cuda"``, ``"cpu"`` (the CPU backend), or ``None``: bound per step from the
            first tensor an offloaded layer saves (Note [Device binding]). Default: ``None``.

    Raises:
        TypeError, ValueError: for arguments of the wrong type or out of range.
    """

    _manual = False

    def __init__(
        self,
        num_layers: int,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: Any = None,
        *,
        policy: Optional[str] = None,
        min_offload_numel: Optional[int] = None,
        device: Any = None,
    ) -> None:
        self.num_layers = _check_int("num_layers", num_layers, 1)
        self.retain_pinned_cpu_buffers = bool(retain_pinned_cpu_buffers)
        self.policy = check_policy(policy)
        self.min_offload_numel = (
            DEFAULT_MIN_OFFLOAD_NUMEL
            if min_offload_numel is None
            else _check_int("min_offload_numel", min_offload_numel, 0)
        )
        # Note [Device binding]: without a device (and no ANNOTATE_OFFLOAD_DEVICE), each step starts on the
        # CPU backend and is bound to the device of the first CUDA tensor an offloaded layer saves, so a
        # model moved after the transform offloads on the device it trains on. A CPU tensor saved first
        # (the empty tensor a non-reentrant checkpoint saves) does not bind the step.
        self._offload_stream = offload_stream
        self._lazy_device = device is None and not os.environ.get("ANNOTATE_OFFLOAD_DEVICE")
        self._bind(get_backend("cpu" if self._lazy_device else device))
        self._frozen_shapes: set[tuple] = set()
        self._reset()

    def _reset(self) -> None:
        """The per-step state of a runtime that has not run a step yet."""
        self.stats = OffloadStats()
        self._step: Optional[_Step] = None
        self._bound_step: Optional[_Step] = None  # the step the backend was bound for (Note [Device binding])
        self._steps = 0
        self._scope: Any = None  # the saved_tensors_hooks of the open layer scope
        self._cur: Optional[_LayerState] = None  # the current layer's state (None: kept layer)
        self._cur_index: Optional[int] = None  # the current layer (between its entry and its end)
        self._last_entered = -1
        self._num_of_fwds: Optional[int] = None  # TransformerEngine's layer counter (fwd_step)
        self.current_layer_id = 0  # the layer backward reached last (bwd_step)
        self._warned_count = False

    def _bind(self, backend: _Backend) -> None:
        self.backend: Any = backend if self._offload_stream is None else _StreamOverride(backend, self._offload_stream)
        self.pool = get_pool(backend.device_type)

    def _bind_to(self, t: torch.Tensor) -> None:
        """Bind this step to CUDA tensor ``t``'s device (Note [Device binding]); its layers that saved
        nothing yet take the backend."""
        self._bound_step = self._step
        self._bind(get_backend(t.device))
        for state in self._step.layers.values():
            if not state.fwd_gpu_tensor_group.tensor_list:
                state.backend, state.pool = self.backend, self.pool

    def _maybe_bind(self, t: torch.Tensor, step: Optional[_Step]) -> None:
        """Bind the step to ``t``'s device if ``t`` is the first CUDA tensor saved in it, and ``step``
        is the current step (Note [Device binding])."""
        if self._lazy_device and self._bound_step is not step and step is self._step and t.is_cuda:
            self._bind_to(t)

    # Note [Copying a synchronizer]: ``copy.deepcopy`` of a model that drives a synchronizer (an
    # EMA copy, ``torch.optim.swa_utils.AveragedModel``, a frozen reference model) gives a fresh
    # runtime with the same configuration: the per-step state belongs to the original's autograd
    # graph, and the process-wide backend (CUDA side streams) and host pool are shared. Pickling is
    # refused: streams and host buffers do not outlive the process.
    def __deepcopy__(self, memo: dict) -> "OffloadSynchronizer":
        new = memo[id(self)] = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._frozen_shapes = set(self._frozen_shapes)
        new._reset()
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError(
            f"{type(self).__name__} cannot be pickled: it holds CUDA side streams and the host buffers of "
            "saved tensors in flight, which do not outlive the process. Create a new one after loading "
            "(copy.deepcopy works and gives a fresh runtime with the same configuration)."
        )

    # -- what is offloaded -------------------------------------------------------------------
    def _layer_offloaded(self, index: int) -> bool:
        raise NotImplementedError

    def _paces(self, index: int) -> bool:
        """Kept layer ``index`` paces the reload below it (Note [Paced prefetch])."""
        return False

    def add_frozen_weights(self, params: Iterable[torch.Tensor]) -> None:
        """Register frozen weights whose autocast casts must never be offloaded: kept on the device with
        reason ``parameter``, recognised by shape (``_is_frozen_weight_copy`` in ``_layer_state.py``)."""
        params = list(params)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"add_frozen_weights: expected tensors, got {type(p).__name__}")
        self._frozen_shapes |= frozen_shapes(params)

    def _keep_reason(self, t: torch.Tensor) -> Optional[str]:
        if t.device.type != self.backend.device_type:
            return "not_on_device"
        numel = t.numel()
        if numel == 0:
            return "zero_size"
        if numel < self.min_offload_numel:
            return "too_small"
        if _is_fake(t):
            return "fake"
        if _is_param_alias(t):
            return "parameter"  # a weight, its views and casts: copying frees nothing
        base = t._base
        if _marked(t) or (base is not None and _marked(base)):
            return "marked"  # a view of a marked tensor (Linear on 3-D input saves a view)
        if self.policy == "opt_in" and not (
            getattr(t, "activation_offloading", False)
            or (base is not None and getattr(base, "activation_offloading", False))
        ):
            return "not_selected"
        if t.layout != torch.strided or t.is_quantized or (
            type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)
        ):
            return "unsupported"
        if self._frozen_shapes and _is_frozen_weight_copy(t, self._frozen_shapes):
            return "parameter"
        return None

    # -- saved tensors -----------------------------------------------------------------------
    def push_tensor(self, tensor: torch.Tensor) -> Any:
        """Record ``tensor`` in the current layer (TransformerEngine's pack).

        Returns:
            ``tensor`` itself if it stays on the device, else an ``int`` handle (the tensor's
            position in its layer's group, as in TransformerEngine) for :meth:`pop_tensor`.
        """
        state = self._cur
        if state is not None:
            self._maybe_bind(tensor, self._step)
        reason = "layer_not_offloaded" if state is None else self._keep_reason(tensor)
        if reason is not None:
            self.stats._keep(reason, tensor.numel() * tensor.element_size())
            return tensor
        return state.pack(tensor, self._ready_event(tensor))

    def pop_tensor(self, handle: Any) -> torch.Tensor:
        """The tensor of a :meth:`push_tensor` handle (TransformerEngine's unpack), waiting for its
        reload where needed.

        Raises:
            RuntimeError: autograd's error if the tensor was modified in place after it was saved.
            OffloadError: manual mode, if its layer was released but not reloaded.
            TypeError: for anything :meth:`push_tensor` did not return.
        """
        if type(handle) is _Packed:
            return handle.layer.unpack(handle, allow_on_demand=not self._manual)
        if isinstance(handle, torch.Tensor):
            return handle
        raise TypeError(f"pop_tensor: expected a handle returned by push_tensor, got {type(handle).__name__}")

    def _pack(self, tensor: torch.Tensor) -> Any:
        """Pack hook: :meth:`push_tensor`, with a kept tensor's version checked at unpack (and its
        bytes counted by its layer's pacer, Note [Paced prefetch])."""
        handle = self.push_tensor(tensor)
        if handle is not tensor:
            return handle
        pacer = self._step.kept.get(self._cur_index) if self._cur is None and self._step is not None else None
        return _Kept(tensor, None if pacer is None or _is_param_alias(tensor) else pacer)

    def _unpack(self, handle: Any) -> torch.Tensor:
        return handle.unpack() if type(handle) is _Kept else self.pop_tensor(handle)

    # -- compiled graphs: the calls of the fx pass's ops (Note [Compiled offload ops]) -------
    def graph_begin(self, first: int, last: int) -> Any:
        """A compiled forward of layers ``first..last`` starts; returns its step: a new one unless the graph
        continues the current forward (``first`` past the last layer entered, as in :meth:`enter_layer`)."""
        return self._step_for(first, last)

    def graph_pack(self, step: Any, index: int, t: torch.Tensor) -> tuple:
        """Start the D2H of ``t``, saved by layer ``index`` in ``step``; returns the record that
        :meth:`graph_release`, :meth:`graph_unpack` and :meth:`graph_reach` take."""
        self._maybe_bind(t, step)
        state = step.layers.get(index)
        if state is None:
            # the layers before it are done saving (in save order, not necessarily in graph order):
            # mark the end of their D2H so that their release waits for those copies, not this layer's
            for other in step.layers.values():
                if other.index < index and other.d2h_done is None and other.state == "offload_started":
                    other.finish_forward()
            # no units shared across layers: once a layer is released, a compiled graph may reuse its
            # buffers (same storage, same version) for new values of a later layer; so no version
            # check after the release either (Note [Version check])
            state = step.layers[index] = _LayerState(index, self, None, track=False)
        state.d2h_done = None  # a copy enqueued after the end was marked moves the end (release marks it again)
        return state.pack(t), step

    def graph_release(self, records: Iterable[tuple]) -> None:
        """Drop the device bytes of the records' layers, each layer once (the compute stream waits for their D2H)."""
        released: set = set()
        for handle, _ in records:
            if type(handle) is _Packed and handle.layer not in released:
                released.add(handle.layer)
                handle.layer.release_forward()

    def graph_unpack(self, records: list, offsets: list, strides: list, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One storage unit of a compiled backward, reloaded on the compute stream, whose H2D may still run
        until :meth:`graph_ready`: ``numel`` elements of ``dtype`` holding the records' tensors at ``offsets``
        with ``strides`` (concatenated) as the graph views them (the compiler may have laid a tensor out
        otherwise). The graph may write into it and takes it for 16-byte aligned: the reload itself when it is
        exactly this unit so laid out and fully handed out, else a new tensor with the tensors' values."""
        views = [h.layer.unpack(h, not self._manual, wait=False) if type(h) is _Packed else h for h, _ in records]
        it = iter(strides)  # each view's strides, then its offset: the layout the graph reads
        layouts = [(tuple(next(it) for _ in range(v.dim())), o) for v, o in zip(views, offsets)]
        first, storage = views[0], views[0].untyped_storage()
        own = all(type(h) is _Packed and h.layer.served(h) for h, _ in records) and storage.data_ptr() % 16 == 0
        if own and storage.nbytes() == numel * first.element_size() and all(
            v.untyped_storage()._cdata == storage._cdata and (v.stride(), v.storage_offset()) == layout
            for v, layout in zip(views, layouts)
        ):
            return first.as_strided((numel,), (1,), 0)
        self.graph_ready(records, 0)  # the copy reads the reload
        unit = torch.empty(numel, dtype=dtype, device=first.device)
        for view, (stride, offset) in zip(views, layouts):
            unit.as_strided(view.shape, stride, offset).copy_(view)
        return unit

    def graph_ready(self, records: list, nbytes: int) -> None:
        """The compute stream waits for the H2D of the unit :meth:`graph_unpack` returned for these records
        (all of one layer); its ``nbytes`` count as used (Note [Paced prefetch])."""
        packed = [h for h, _ in records if type(h) is _Packed]
        for h in packed:
            h.layer.wait(h)
        if packed:
            packed[0].layer.pacer.use(nbytes)

    def graph_reach(self, record: tuple, index: int) -> None:
        """A compiled backward reached layer ``index`` of the step ``record`` belongs to."""
        self._on_backward_layer(record[1], index)

    @staticmethod
    def _ready_event(t: torch.Tensor) -> Any:
        event = getattr(t, "start_reload_event", None)
        if event is not None and getattr(t, "_ao_ready_version", -1) == t._version:
            return event
        return None

    def _start_offload_now(self, t: torch.Tensor) -> None:
        """``start_offload`` inside an open scope: enqueue the copy before autograd saves ``t``."""
        state = self._cur
        if state is not None:
            self._maybe_bind(t, self._step)
        if state is None or not state.eager_d2h or self._keep_reason(t) is not None:
            return
        rng = _unit_range(t, bool(getattr(t, "offload_base_tensor", False)))
        if rng is not None:
            state.unit_for(t, rng, self._ready_event(t))

    # -- layers ------------------------------------------------------------------------------
    def fwd_step(self) -> int:
        """Start the next layer, counting entries modulo ``num_layers`` (TransformerEngine's
        semantics), and return its index. The layer in progress, if any, ends here."""
        n = self._num_of_fwds
        index = 0 if n is None or n >= self.num_layers - 1 else n + 1
        self._begin(index)
        self._num_of_fwds = index
        return index

    def _begin(self, index: int) -> None:
        try:
            self._end()
            step = self._step_for(index, index)
            self._on_layer_entry(index)
            state = None
            if self._manual or self._layer_offloaded(index):
                state = step.layers[index] = _LayerState(index, self, None if self._manual else step.shared)
            elif self._paces(index):
                step.kept[index] = _Pacer()
            self._cur, self._cur_index = state, index
        except BaseException:
            self.abort()
            raise

    def _end(self) -> None:
        """The current layer's forward is over: mark the end of its D2H copies."""
        if _in_backward():
            return  # a pass-through scope (Note [Scopes inside a checkpoint])
        index, state = self._cur_index, self._cur
        self._cur = self._cur_index = None
        if state is not None and state.eager_d2h:
            state.finish_forward()
        if index == self.num_layers - 1:
            self._on_layer_entry(self.num_layers)  # end of forward: everything due is released

    def _enter(self, index: Optional[int]) -> Optional[int]:
        """Open a layer scope: ``index``, or the next one by TE's count (``None``). Returns the
        layer index, or ``None`` without grad and in a recompute (Note [Scopes inside a checkpoint])."""
        if not torch.is_grad_enabled() or _in_func_transform():
            return None
        if self._scope is not None:
            still_open = self._cur_index
            self.abort()
            raise OffloadError(
                f"offload runtime: a layer was entered while layer {still_open}'s offload scope is still open; "
                "this step's offload state was dropped. Close each layer (sync_fn after `with ctx:`, or "
                "commit_layer) before entering the next one."
            )
        if _in_backward():
            hooks = torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
        else:
            if index is None:
                index = self.fwd_step()
            else:
                self._begin(index)
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._scope = hooks
        _active_stack().append(self)
        return index

    def enter_layer(self, index: int) -> bool:
        """Open layer ``index``'s saved-tensor scope; ``False`` (no-op) without grad. Inside a backward its
        hooks pass through (Note [Scopes inside a checkpoint]). An index not above the last one entered
        starts a new step.

        Raises:
            OffloadError: if a scope is already open (it is closed and the step dropped first).
            ValueError: if ``index`` is out of ``[0, num_layers)``.
        """
        return self._enter(_check_int("layer index", index, 0, self.num_layers - 1)) is not None

    def exit_layer(self) -> None:
        """Close the open scope (if any) and end its layer's forward."""
        if self._close_scope():
            self._end()

    def _close_scope(self) -> bool:
        """Exit the open scope's hooks; ``False`` when no scope is open."""
        scope, self._scope = self._scope, None
        if scope is None:
            return False
        stack = _active_stack()
        if self in stack:
            stack.remove(self)
        scope.__exit__(None, None, None)
        return True

    def commit_layer(self, output: Any, index: int) -> Any:
        """Close layer ``index``'s scope and mark the layer boundary on ``output``.

        Registers a backward pre-hook on the ``grad_fn`` of every tensor in ``output`` (a tensor
        or a pytree of them): when backward reaches the layer, its reloads are prefetched and the
        layers above it are released. Returns ``output`` unchanged. No-op without grad.

        Raises:
            OffloadError: if the open scope belongs to another layer (the step is dropped).
        """
        if self._scope is not None and self._cur_index not in (None, index):
            still_open = self._cur_index
            self.abort()
            raise OffloadError(
                f"offload runtime: commit_layer(..., {index}) while layer {still_open}'s scope is open; "
                "commit the layer that was entered (this step's offload state was dropped)"
            )
        self.exit_layer()
        if _recording():
            self._mark_boundary(output, index)
        return output

    def _mark_boundary(self, output: Any, index: int) -> None:
        step = self._step
        if step is None:
            return
        hook = functools.partial(self._on_backward_layer, step, index)
        nodes = {t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for node in nodes:
            node.register_prehook(hook)

    def abort(self) -> None:
        """Recover from an exception: close the scope, release this step (Note [Errors leave nothing behind])."""
        with contextlib.suppress(Exception):
            self._close_scope()
        self._cur = self._cur_index = None
        step, self._step = self._step, None
        if step is not None:
            self._release_step(step)
        self._last_entered = -1
        self._num_of_fwds = None

    # -- steps -------------------------------------------------------------------------------
    def _new_step(self) -> None:
        if self._step is not None:
            self._release_step(self._step)
        self.stats = OffloadStats(step=self._steps)
        self._steps += 1
        self._step = _Step()
        if self._lazy_device:
            self._bind(get_backend("cpu"))  # until the step's first CUDA tensor (Note [Device binding])

    def _step_for(self, first: int, last: int) -> _Step:
        """The step of a forward that enters layers ``first..last`` next: a new one unless it continues
        the current step's forward (``first`` past the last layer entered)."""
        step = self._step
        if step is None or step.ended or first <= self._last_entered:
            self._new_step()
        self._last_entered = last
        return self._step

    def _release_step(self, step: _Step) -> None:
        step.shared.clear()  # borrowing happens only within a step's forward
        for state in list(step.layers.values()):
            state.release_all()
        self.stats.pinned_bytes = self.pool.cached_bytes

    def _on_layer_entry(self, index: int) -> None:
        """Schedule hook: release what is due at the entry of ``index`` (``num_layers``: end of forward)."""

    def _prefetch(self, step: _Step, index: int) -> None:
        """Schedule hook: start reloads when backward reaches layer ``index``."""

    def _on_backward_layer(self, step: _Step, index: int, grad_outputs: Any = None) -> None:
        if not step.bwd_active and _in_backward():
            step.bwd_active = True
            if self._num_of_fwds is not None and self._num_of_fwds != self.num_layers - 1:
                self._warn_layer_count()
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._on_backward_end, step)
            )
        if index in step.bwd_seen:
            return
        step.bwd_seen.add(index)
        self.current_layer_id = index
        step.disarm()  # the reload it deferred is due by now (Note [Paced prefetch])
        for j in list(step.bwd_seen):
            state = step.layers.get(j)
            if j > index and state is not None:
                state.release_all()  # backward has moved below it
        self._prefetch(step, index)

    def _on_backward_end(self, step: _Step) -> None:
        """End of a backward pass: release the layers it reached, keep the others."""
        for j in step.bwd_seen:
            state = step.layers.get(j)
            if state is not None:
                state.release_all()
        step.bwd_seen = set()
        step.bwd_active = False
        step.ended = True
        step.disarm()
        step.shared.clear()
        if not isinstance(step.layers, weakref.WeakValueDictionary):
            # From now on only autograd's handles keep the layer states (and their host buffers)
            # alive: a graph freed by this backward returns its buffers to the pool at once, and
            # a retained graph, or another output's, can still be reloaded in its own backward.
            step.layers = weakref.WeakValueDictionary(step.layers)
        if step is self._step and self._scope is None:
            self._num_of_fwds = None
        self.stats.pinned_bytes = self.pool.cached_bytes

    # -- TransformerEngine-compatible counting API -------------------------------------------
    def _warn_layer_count(self) -> None:
        """TE-counted scopes (``fwd_step``) whose last forward did not end at layer ``L - 1``."""
        if self._warned_count:
            return
        self._warned_count = True
        warnings.warn(
            f"get_cpu_offload_context: backward began after the offload context counted layer "
            f"{self._num_of_fwds} of model_layers={self.num_layers} (expected {self.num_layers - 1}): the "
            "forward ran the context a different number of times than model_layers. Scopes are counted modulo "
            "model_layers (TransformerEngine's semantics), so extra layers start a new step and missing ones "
            "shift the schedule; gradients stay exact, but the offload schedule and stats no longer match the "
            "model. Pass model_layers equal to the number of `with ctx:` blocks per forward.",
            UserWarning,
            stacklevel=3,
        )

    def bwd_step(self, layer_num: int) -> None:
        """Backward reached layer ``layer_num``: release the layers above it that backward passed,
        start the reloads due. Called by the layer boundaries; callable outside a backward too."""
        if self._step is not None:
            self._on_backward_layer(self._step, layer_num)

    def finish_part_of_bwd(self) -> None:
        """End of a backward pass (TE name): release the layers it reached."""
        if self._step is not None:
            self._on_backward_end(self._step)

    def get_offloaded_total_size_mb(self) -> float:
        """Host bytes written by D2H copies in the current (or last) step, in MiB."""
        return self.stats.bytes_offloaded / (1 << 20)

    def release_pinned_buffers(self) -> int:
        """Free the cached host buffers not in use (returns bytes freed)."""
        return self.pool.trim()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_layers={self.num_layers}, policy={self.policy!r}, "
            f"backend={self.backend!r})"
        )


def _marked(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_TE_do_not_offload", False) or getattr(t, "_do_not_offload", False))


class DefaultOffloadSynchronizer(OffloadSynchronizer):
    """The automatic schedule (see Note [Default schedule] in this module).

    Args:
        num_layers (int): model layers ``L``.
        num_offloaded_layers (int): ``N``, offload layers ``0..N-1`` (``0 <= N <= L-1``).
            ``None``: ``L - 1``, unless ``offloaded_layers`` is given.
        offloaded_layers (Iterable[int]): explicit layer indices to offload instead of a prefix;
            the last layer cannot be offloaded (its backward runs first).
        release_lag (int), prefetch_layers (int): the schedule's ``lag >= 0`` and ``k >= 1`` (Note
            [Default schedule]); ``None``: TransformerEngine's ``L - N - 1``. Default: ``None``.
        retain_pinned_cpu_buffers, offload_stream, policy, min_offload_numel, device: see
            :class:`OffloadSynchronizer`.

    Raises:
        TypeError, ValueError: for arguments of the wrong type or out of range.
    """

    def __init__(
        self,
        num_layers: int,
        num_offloaded_layers: Optional[int] = None,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: Any = None,
        *,
        offloaded_layers: Optional[Iterable[int]] = None,
        release_lag: Optional[int] = None,
        prefetch_layers: Optional[int] = None,
        policy: Optional[str] = None,
        min_offload_numel: Optional[int] = None,
        device: Any = None,
    ) -> None:
        super().__init__(
            num_layers,
            retain_pinned_cpu_buffers,
            offload_stream,
            policy=policy,
            min_offload_numel=min_offload_numel,
            device=device,
        )
        L = self.num_layers
        if offloaded_layers is not None:
            layers = [_check_int("offloaded_layers item", i, 0, L - 1) for i in offloaded_layers]
            if L - 1 in layers:
                raise ValueError(
                    f"offloaded_layers={sorted(set(layers))}: the last layer ({L - 1}) cannot be "
                    "offloaded, its backward runs first; drop it from the list"
                )
            offloaded = frozenset(layers)
        else:
            n = L - 1 if num_offloaded_layers is None else num_offloaded_layers
            offloaded = frozenset(range(_check_int("num_offloaded_layers", n, 0, L - 1)))
        self.offloaded_layers = offloaded
        default_gap = max(L - len(offloaded) - 1, 0)
        self.prefetch_layers = (
            default_gap if prefetch_layers is None else _check_int("prefetch_layers", prefetch_layers, 1)
        )
        self.release_lag = default_gap if release_lag is None else _check_int("release_lag", release_lag, 0)

    def _layer_offloaded(self, index: int) -> bool:
        return index in self.offloaded_layers

    def _paces(self, index: int) -> bool:
        return self.prefetch_layers == 1 and index - 1 in self.offloaded_layers

    def release_point(self, index: int) -> int:
        """Entry index at which layer ``index`` is released at the latest (``L``: end of forward)."""
        return min(index + 1 + self.release_lag, self.num_layers)

    def _on_layer_entry(self, index: int) -> None:
        for j, state in list(self._step.layers.items() if self._step is not None else ()):
            if j >= index or state.state == "offload_finished":
                continue  # not entered before, or released already (release_forward would do nothing)
            if self.release_point(j) <= index or state.d2h_complete():
                state.release_forward()

    def _prefetch(self, step: _Step, index: int) -> None:
        current = step.layers.get(index)
        pacer = current.pacer if current is not None else step.kept.get(index)
        for j in sorted(step.layers.keys(), reverse=True):  # the layer reached first, then below
            state = step.layers.get(j)
            if state is None or not index - self.prefetch_layers <= j <= index:
                continue
            if j < index and self.prefetch_layers == 1 and pacer is not None and 2 * pacer.used < pacer.total:
                pacer.then, step.armed = state.start_reload, pacer  # Note [Paced prefetch]
            else:
                state.start_reload()


class ManualOffloadSynchronizer(OffloadSynchronizer):
    """The user drives the copies by layer index (TransformerEngine's manual mode), in this order per
    layer: :meth:`start_offload_layer`, :meth:`release_activation_forward_gpu_memory`,
    :meth:`start_reload_layer`; any other order raises :class:`OffloadError`. A layer never offloaded
    keeps its tensors on the device; each backward pass releases only the layers it reached."""

    _manual = True

    def _layer_offloaded(self, index: int) -> bool:
        return True

    def _state(self, layer_id: int, expected: str, action: str) -> _LayerState:
        _check_int("layer_id", layer_id, 0, self.num_layers - 1)
        step = self._step
        state = step.layers.get(layer_id) if step is not None else None
        if state is None:
            raise OffloadError(
                f"ManualOffloadSynchronizer.{action}({layer_id}): layer {layer_id} has not run a "
                "forward in this step; call it after the layer's forward"
            )
        if state.state != expected:
            raise OffloadError(
                f"ManualOffloadSynchronizer.{action}({layer_id}): layer {layer_id} is in state "
                f"{state.state!r}, expected {expected!r}. Order per layer: start_offload_layer -> "
                "release_activation_forward_gpu_memory -> start_reload_layer"
            )
        return state

    def start_offload_layer(self, layer_id: int) -> None:
        """Enqueue the D2H copies of layer ``layer_id`` (state ``not_offloaded``)."""
        self._state(layer_id, "not_offloaded", "start_offload_layer").start_offload()

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Make the compute stream wait for the D2H and drop the device bytes."""
        state = self._state(layer_id, "offload_started", "release_activation_forward_gpu_memory")
        state.finish_forward()
        state.release_forward()
        state.state = "offload_finished"

    def start_reload_layer(self, layer_id: int) -> None:
        """Enqueue the H2D copies of layer ``layer_id`` (state ``offload_finished``)."""
        self._state(layer_id, "offload_finished", "start_reload_layer").start_reload()
