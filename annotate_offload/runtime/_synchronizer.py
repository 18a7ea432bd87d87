"""Offload synchronizers: when each layer's saved tensors move, and the saved-tensor hooks.

Note [Default schedule]. With ``L`` model layers of which the set ``O`` is offloaded (TE: layers
``0..N-1``, never the last):

* forward: every eligible tensor saved in an offloaded layer starts its D2H copy *at save time*,
  on the D2H stream, behind its ready event (from :func:`start_offload`, or the compute stream's
  position at save). The copy stream never idles while the layer computes.
* release: layer ``i``'s device copies are dropped (after the compute stream waits for its D2H) at
  the entry of layer ``i + 1 + lag`` at the latest, or at the end of forward when that layer does
  not exist. ``release_lag=None`` is TransformerEngine's bound ``lag = L - N - 1`` (release at the
  entry of ``L - N + i``). At every layer entry, layers whose D2H has already finished are released
  early without any wait.
* prefetch: when backward reaches layer ``m``, the reloads of offloaded layers ``m - k .. m`` start
  on the H2D stream (``prefetch_layers=None`` is TE's distance ``k = L - N - 1``; a given ``k >= 1`` keeps
  a reload in flight behind compute even at ``N = L - 1``, where TE serialises).
* when backward reaches layer ``m``, the device memory of layers above ``m`` is released; the end
  of backward releases the rest, and the runtime then holds no device tensors.

Peak offloaded activations on the device: ``lag + 1`` offloaded layers in forward (plus the kept
layers), ``k + 1`` in backward; :meth:`DefaultOffloadSynchronizer.schedule` reports the numbers.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
import warnings
import weakref
from typing import Any, Iterable, Optional

import torch

from ..errors import OffloadError
from ._device import _Backend, get_backend
from ._layer_state import (
    DEFAULT_MIN_OFFLOAD_NUMEL,
    _is_fake,
    _is_frozen_weight_copy,
    _is_param_alias,
    HalfPacer,
    _Kept,
    _LayerState,
    _Packed,
    check_kept_version,
    frozen_shapes,
)
from ._marks import check_policy
from ._pinned_pool import get_pool
from ._stats import OffloadStats
from ._tensor_group import _flat_bytes, _rebuild, _unit_range, _view_meta

__all__ = ["OffloadSynchronizer", "DefaultOffloadSynchronizer", "ManualOffloadSynchronizer"]

_TLS = threading.local()


def _active_stack() -> list:
    stack = getattr(_TLS, "stack", None)
    if stack is None:
        stack = _TLS.stack = []
    return stack


def _active_synchronizer() -> Optional["OffloadSynchronizer"]:
    """The synchronizer whose layer scope is open on this thread, if any. None in code that
    ``torch.compile`` traces, which opens no scope (Note [Traced layers] in ``annotate/_layers.py``)."""
    if torch.compiler.is_compiling():
        return None
    stack = _active_stack()
    return stack[-1] if stack else None


def _check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an int")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value}: must be {rng}")
    return value


class _Step:
    """Per-step state: layer states of one forward, and backward bookkeeping."""

    __slots__ = ("index", "layers", "kept", "shared", "bwd_active", "bwd_seen", "__weakref__")

    def __init__(self, index: int):
        self.index = index
        self.layers: Any = {}  # dict[int, _LayerState]; weak values once backward ended
        self.kept: dict[int, HalfPacer] = {}  # kept layers whose consumption paces a prefetch
        self.shared: dict = {}  # storage units copied in this step, for cross-layer dedup
        self.bwd_active = False
        self.bwd_seen: set[int] = set()


# Note [Kept-layer paced prefetch]: at the start of backward the last layer is usually kept
# (N = L-1) and its saved tensors are all on the device; starting the reload of the offloaded layer
# below it at that layer's first backward node puts both on the device at once (W1: 1.07 + 1.00 GiB,
# the activation peak). With a look-ahead of one layer that reload starts once half of the kept
# layer's saved bytes have been unpacked (autograd frees each after its node ran), like the
# half-layer prefetch between two offloaded layers: the kept layer gets a HalfPacer of its own.


class _KeptCounted(_Kept):
    """A kept tensor of a paced kept layer: its first unpack counts as consumed."""

    __slots__ = ("layer", "nbytes")

    def __init__(self, tensor: torch.Tensor, layer: HalfPacer):
        super().__init__(tensor)
        self.layer = layer
        self.nbytes = tensor.numel() * tensor.element_size()
        layer.total_bytes += self.nbytes


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

    Args:
        num_layers (int): model layers, i.e. layer scopes per forward (TE's ``model_layers``).
        retain_pinned_cpu_buffers (bool): accepted for TransformerEngine compatibility. Host
            buffers are always kept in an exact-size pool and reused across steps (TE reuses
            them only with this flag); :meth:`release_pinned_buffers` gives the unused ones
            back. Default: ``False``.
        offload_stream: a CUDA stream to use for both D2H and H2D instead of the runtime's shared
            side streams (TE's manual-mode option). Default: ``None``.
        policy (str): ``"opt_out"`` or ``"opt_in"``; ``None`` uses ``NVTE_CPU_OFFLOAD_V1``.
        min_offload_numel (int): tensors with fewer logical elements stay on the device.
            Default: 262144 (256K, TransformerEngine's threshold).
        device: ``"cuda"``, ``"cpu"`` (the CPU backend), or ``None``: bound per step from the
            first tensor an offloaded layer saves (Note [Device binding]). Default: ``None``.

    Raises:
        TypeError, ValueError: for arguments of the wrong type or out of range.
    """

    _eager_d2h = True
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
        # Note [Device binding]: without a device (and no ANNOTATE_OFFLOAD_DEVICE), the backend is
        # bound per step from the first tensor an offloaded layer saves, not here: a model that is
        # transformed and then moved (.to("cuda"), Trainer, accelerate) offloads on the device it
        # trains on. Until then the CPU backend stands in (no stream, no CUDA initialisation).
        self._offload_stream = offload_stream
        self._lazy_device = device is None and not os.environ.get("ANNOTATE_OFFLOAD_DEVICE")
        self._bind(get_backend("cpu" if self._lazy_device else device))
        self._frozen_shapes: set[tuple] = set()
        self.__dict__.update(self._fresh_state())
        self._warned_count = False  # a forward whose context count did not match num_layers

    # -- copies ------------------------------------------------------------------------------
    # Note [Copying a synchronizer]: ``copy.deepcopy`` of a model after ``offload_transform`` (an
    # EMA copy, ``torch.optim.swa_utils.AveragedModel``, a frozen reference model) reaches the
    # runtime through the model's forward. The copy is a fresh runtime with the same configuration:
    # the per-step state (saved tensors in flight, their host buffers, the statistics) belongs to
    # the original's autograd graph, and the process-wide backend (CUDA side streams) and pinned
    # pool are shared, never duplicated. Pickling is refused: streams and host buffers do not
    # survive a process, and a model is saved through its ``state_dict``.
    def _fresh_state(self) -> dict[str, Any]:
        """The per-step attributes of a runtime that has not run a step yet (``__init__`` and copies)."""
        return {
            "stats": OffloadStats(),
            "_step": None,  # Optional[_Step]
            "_bound_step": None,  # the step the backend was bound for (Note [Device binding])
            "_steps": 0,
            "_scope": None,
            "_scope_index": -1,
            "_cur": None,  # Optional[_LayerState]: the open layer scope's state
            "_cur_kept": None,  # Optional[HalfPacer]
            "_last_entered": -1,
            "_num_of_fwds": None,  # TE-compatible counter for fwd_step()
            "current_layer_id": 0,
        }

    def _bind(self, backend: _Backend) -> None:
        self.backend: Any = backend if self._offload_stream is None else _StreamOverride(backend, self._offload_stream)
        self.pool = get_pool(backend.device_type)

    def _bind_to(self, t: torch.Tensor) -> None:
        """Bind this step to ``t``'s device (Note [Device binding]); states of the step get the backend."""
        self._bound_step = self._step
        if t.device.type not in ("cpu", "cuda"):
            return  # meta and other devices: kept on the device (reason not_on_device)
        self._bind(get_backend(t.device))
        for state in self._step.layers.values():
            if not state.entries:
                state.backend, state.pool = self.backend, self.pool

    def __deepcopy__(self, memo: dict) -> "OffloadSynchronizer":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        fresh = self._fresh_state()
        for key, value in self.__dict__.items():
            if key in fresh:
                continue
            new.__dict__[key] = value if key in ("backend", "pool", "_offload_stream") else copy.deepcopy(value, memo)
        new.__dict__.update(fresh)
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

    def _paces_prefetch(self, index: int) -> bool:
        """True if kept layer ``index``'s consumption starts a reload (Note [Kept-layer paced prefetch])."""
        return False

    def add_frozen_weights(self, params: Iterable[torch.Tensor]) -> None:
        """Register frozen weights whose casts (autocast copies) must never be offloaded.

        Autocast does not cache casts of parameters that do not require grad, so the bf16 copy of
        a frozen weight is a fresh tensor without ``grad_fn``. A saved tensor that has no
        ``grad_fn``, does not require grad and has the shape of a registered weight (or of its
        transpose) is kept on the device, with reason ``parameter``.
        """
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

    # -- saved-tensor hooks (TE names) -------------------------------------------------------
    def push_tensor(self, tensor: torch.Tensor) -> Any:
        """Pack hook: keep ``tensor`` on the device or record it for offload; returns a handle."""
        state = self._cur
        if state is None:
            self.stats._keep("layer_not_offloaded", tensor.numel() * tensor.element_size())
            kept = self._cur_kept
            return _Kept(tensor) if kept is None else _KeptCounted(tensor, kept)
        if self._lazy_device and self._bound_step is not self._step:
            self._bind_to(tensor)
        reason = self._keep_reason(tensor)
        if reason is not None:
            self.stats._keep(reason, tensor.numel() * tensor.element_size())
            return _Kept(tensor)
        return state.pack(tensor, self._ready_event(tensor))

    def pop_tensor(self, handle: Any) -> torch.Tensor:
        """Unpack hook: return the saved tensor (waiting for its reload where needed)."""
        if type(handle) is _Kept:
            return check_kept_version(handle)
        if type(handle) is _KeptCounted:
            t = check_kept_version(handle)
            if handle.nbytes:
                handle.layer.consume(handle.nbytes)
                handle.nbytes = 0  # count each tensor once (a retained graph unpacks it again)
            return t
        if type(handle) is _Packed:
            return handle.layer.unpack(handle, allow_on_demand=not self._manual)
        return handle

    # -- compiled graphs (annotate_offload/compile, Note [Compiled offload ops]) --------------
    # In a compiled graph the fx pass decided which saved activations move and where each layer's
    # device copies are released; these calls feed them to the same storage units, host buffers,
    # prefetch schedule and statistics as the hooks above.
    def graph_begin(self, first: int, last: int) -> Any:
        """A compiled forward that runs layers ``first..last`` starts; returns its step. A new step
        starts unless the graph continues the forward of the current one (``first`` past the last
        layer entered, as in :meth:`enter_layer`)."""
        if self._step is None or first <= self._last_entered:
            self._new_step()
        self._last_entered = last
        return self._step

    def graph_pack(self, step: Any, index: int, t: torch.Tensor) -> tuple:
        """Start the D2H of ``t``, saved by layer ``index`` in ``step``; returns the record that
        :meth:`graph_release`, :meth:`graph_unpack` and :meth:`graph_reach` take."""
        if self._lazy_device and self._bound_step is not step and step is self._step:
            self._bind_to(t)
        state = step.layers.get(index)
        if state is None:
            # no sharing of storage units across layers: once a layer is released, a compiled graph
            # may reuse its buffers (same storage, same version) for new values of a later layer
            state = step.layers[index] = _LayerState(index, self.backend, self.pool, self.stats, self._eager_d2h)
        handle = state.pack(t)
        if type(handle) is _Packed:
            # a graph never changes a saved tensor in place, but it may reuse the tensor object for a
            # later buffer once it is dead: no version check on the original
            handle.ref = handle.base_ref = None
        return handle, step

    def graph_release(self, record: tuple) -> None:
        """Drop the device copies of the record's layer (the compute stream waits for their D2H)."""
        if type(record[0]) is _Packed:
            record[0].layer.release_forward()

    def graph_unpack(self, record: tuple) -> torch.Tensor:
        """The tensor of ``record``, reloaded (or waited for) on the compute stream. A compiled graph
        may write into what an op returns, so a storage unit that several saved tensors share is
        handed out as a copy of its bytes."""
        handle = record[0]
        t = self.pop_tensor(handle)
        if type(handle) is _Packed and handle.entry.handles > 1:
            lo, hi = _unit_range(t, False)
            t = _rebuild(_flat_bytes(t, lo, hi).clone(), _view_meta(t, lo))
        return t

    def graph_reach(self, record: tuple, index: int) -> None:
        """A compiled backward reached layer ``index`` of the step ``record`` belongs to."""
        self._on_backward_layer(record[1], index, None)

    @staticmethod
    def _ready_event(t: torch.Tensor) -> Any:
        event = getattr(t, "start_reload_event", None)
        if event is not None and getattr(t, "_ao_ready_version", -1) == t._version:
            return event
        return None

    def _start_offload_now(self, t: torch.Tensor) -> None:
        """``start_offload`` inside an open scope: enqueue the copy before autograd saves ``t``."""
        state = self._cur
        if state is not None and self._lazy_device and self._bound_step is not self._step:
            self._bind_to(t)
        if state is None or not state.eager_d2h or self._keep_reason(t) is not None:
            return
        from ._tensor_group import _unit_range

        rng = _unit_range(t, bool(getattr(t, "offload_base_tensor", False)))
        if rng is not None:
            state._entry_for(t, rng, self._ready_event(t))

    # -- layer scopes (the engine API used by the annotation layer) --------------------------
    @staticmethod
    def is_recomputing() -> bool:
        """True while autograd runs a backward (e.g. an activation-checkpoint recompute)."""
        return torch._C._current_graph_task_id() != -1

    def _scope_ready(self) -> bool:
        return torch.is_grad_enabled() and not self.is_recomputing()

    def enter_layer(self, index: int) -> bool:
        """Open layer ``index``'s saved-tensor scope. Returns ``False`` (no-op) without grad.

        Entering a layer whose index is not larger than the last one entered starts a new step:
        the previous step's device memory is released (its host copies stay available to a graph
        that is still alive).

        Raises:
            OffloadError: if a scope is already open (a layer entered without exit/commit).
            ValueError: if ``index`` is out of ``[0, num_layers)``.
        """
        if not self._scope_ready():
            return False
        if self._scope is not None:
            raise OffloadError(
                f"annotate_offload: layer {index} entered while layer {self._scope_index}'s "
                "offload scope is still open. Call the synchronization function (or "
                "commit_layer) after each layer and before entering the next one."
            )
        index = _check_int("layer index", index, 0, self.num_layers - 1)
        if self._step is None or index <= self._last_entered:
            self._new_step()
        self._last_entered = index
        step = self._step
        self._on_layer_entry(index)
        state = step.layers.get(index)
        if state is None and (self._manual or self._layer_offloaded(index)):
            state = step.layers[index] = _LayerState(
                index,
                self.backend,
                self.pool,
                self.stats,
                self._eager_d2h,
                step.shared if self._eager_d2h else None,
            )
        self._cur = state
        self._cur_kept = None
        if state is None and self._paces_prefetch(index):
            self._cur_kept = step.kept[index] = HalfPacer()
        self._scope_index = index
        scope = torch.autograd.graph.saved_tensors_hooks(self.push_tensor, self.pop_tensor)
        scope.__enter__()
        self._scope = scope
        _active_stack().append(self)
        return True

    def exit_layer(self) -> None:
        """Close the open scope (if any) and mark the end of its D2H copies."""
        scope = self._scope
        if scope is None:
            return
        self._scope = None
        stack = _active_stack()
        if stack and stack[-1] is self:
            stack.pop()
        scope.__exit__(None, None, None)
        state, self._cur = self._cur, None
        self._cur_kept = None
        if state is not None and self._eager_d2h:
            state.finish_forward()
        if self._scope_index == self.num_layers - 1:
            self._on_forward_end()

    def commit_layer(self, output: Any, index: int) -> Any:
        """Close layer ``index``'s scope and mark the layer boundary on ``output``.

        Registers a backward pre-hook on the ``grad_fn`` of every tensor in ``output`` (a tensor
        or a nested tuple/list/dict): when backward reaches the layer, its reloads are prefetched
        and the layers above it are released. Returns ``output`` unchanged. No-op without grad.

        Raises:
            OffloadError: if the open scope belongs to another layer.
        """
        if not self._scope_ready():
            return output
        if self._scope is not None:
            if self._scope_index != index:
                raise OffloadError(
                    f"annotate_offload: commit_layer(..., {index}) while layer "
                    f"{self._scope_index}'s scope is open; commit the layer that was entered"
                )
            self.exit_layer()
        self._mark_boundary(output, index)
        return output

    def _mark_boundary(self, output: Any, index: int) -> int:
        step = self._step
        if step is None:
            return 0
        hook = functools.partial(self._on_backward_layer, step, index)
        seen: set[int] = set()
        for t in _iter_tensors(output):
            node = t.grad_fn
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            node.register_prehook(hook)
        return len(seen)

    def abort(self) -> None:
        """Recover from an exception in forward: close the scope, release this step."""
        if self._scope is not None:
            scope, self._scope = self._scope, None
            stack = _active_stack()
            if self in stack:
                stack.remove(self)
            try:
                scope.__exit__(None, None, None)
            except Exception:  # noqa: BLE001
                pass
        self._cur = None
        self._cur_kept = None
        if self._step is not None:
            self._release_step(self._step)
            self._step = None
        self._last_entered = -1
        self._num_of_fwds = None

    # -- steps -------------------------------------------------------------------------------
    def _new_step(self) -> None:
        if self._step is not None:
            self._release_step(self._step)
        self.stats = OffloadStats(step=self._steps)
        self._steps += 1
        self._step = _Step(self.stats.step)

    def _release_step(self, step: _Step) -> None:
        step.shared = {}  # borrowing happens only within a step's forward
        for state in list(step.layers.values()):
            state.release_all()
        self.stats.pinned_bytes = self.pool.cached_bytes

    def _on_layer_entry(self, index: int) -> None:
        """Schedule hook: release layers due at the entry of ``index``."""

    def _on_forward_end(self) -> None:
        """Schedule hook: the last layer's scope has closed."""

    def _on_backward_layer(self, step: _Step, index: int, grad_outputs: Any) -> None:
        if not step.bwd_active:
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
        for j, state in list(step.layers.items()):
            if j > index and j in step.bwd_seen:
                state.release_all()
        self._prefetch(step, index)

    def _prefetch(self, step: _Step, index: int) -> None:
        """Schedule hook: start reloads when backward reaches layer ``index``."""

    def _on_backward_end(self, step: _Step) -> None:
        for state in list(step.layers.values()):
            state.release_all()
        for kept in step.kept.values():
            kept.on_half_consumed = None  # not reached: the layer's own pre-hook reloaded it
        # From now on only autograd's handles keep the layer states (and their host buffers)
        # alive: a graph freed by this backward returns its buffers to the pool at once, and a
        # retained graph can still be prefetched in its next backward.
        step.layers = weakref.WeakValueDictionary(step.layers)
        step.shared = {}
        step.bwd_active = False
        step.bwd_seen.clear()
        if step is self._step and self._scope is None:
            self._step = None
            self._last_entered = -1
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

    def fwd_step(self) -> int:
        """Open the next layer's scope by counting entries modulo ``num_layers`` (TE semantics)."""
        if self._num_of_fwds is None or self._num_of_fwds >= self.num_layers - 1:
            self._num_of_fwds = 0
        else:
            self._num_of_fwds += 1
        self.enter_layer(self._num_of_fwds)
        return self._num_of_fwds

    def bwd_step(self, layer_num: int) -> None:
        """Backward reached ``layer_num`` (TE name; normally called by the boundary pre-hook)."""
        if self._step is not None:
            self._on_backward_layer(self._step, layer_num, None)

    def finish_part_of_bwd(self) -> None:
        """End of a backward pass (TE name): release everything still on the device."""
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


def _iter_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _iter_tensors(x)
    elif hasattr(obj, "to_tuple") and callable(obj.to_tuple):  # HF ModelOutput
        yield from _iter_tensors(obj.to_tuple())


class DefaultOffloadSynchronizer(OffloadSynchronizer):
    """The automatic schedule (see Note [Default schedule] in this module).

    Args:
        num_layers (int): model layers ``L``.
        num_offloaded_layers (int): ``N``, offload layers ``0..N-1`` (``0 <= N <= L-1``).
            ``None``: ``L - 1``, unless ``offloaded_layers`` is given.
        retain_pinned_cpu_buffers, offload_stream: see :class:`OffloadSynchronizer`.
        offloaded_layers (Iterable[int]): explicit layer indices to offload instead of a prefix;
            the last layer cannot be offloaded (its backward runs first).
        release_lag (int): release layer ``i`` by the entry of layer ``i + 1 + release_lag``.
            ``None``: TransformerEngine's bound, ``L - N - 1``. Default: ``None``.
        prefetch_layers (int): reload layer ``j`` when backward reaches layer ``j + k``, ``k >= 1``.
            ``None``: TransformerEngine's distance ``L - N - 1``. Default: ``None``.
        policy, min_offload_numel, device: see :class:`OffloadSynchronizer`.

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
            layers = []
            for i in offloaded_layers:
                layers.append(_check_int("offloaded_layers item", i, 0, L - 1))
            if L - 1 in layers:
                raise ValueError(
                    f"offloaded_layers={sorted(set(layers))}: the last layer ({L - 1}) cannot be "
                    "offloaded, its backward runs first; drop it from the list"
                )
            offloaded = frozenset(layers)
        else:
            n = L - 1 if num_offloaded_layers is None else num_offloaded_layers
            _check_int("num_offloaded_layers", n, 0, L - 1)
            offloaded = frozenset(range(n))
        self.offloaded_layers = offloaded
        n = len(offloaded)
        default_gap = max(L - n - 1, 0)
        self.release_lag = (
            default_gap if release_lag is None else _check_int("release_lag", release_lag, 0)
        )
        self.prefetch_layers = (
            default_gap
            if prefetch_layers is None
            else _check_int("prefetch_layers", prefetch_layers, 1)  # as offload_transform and the config
        )

    def _layer_offloaded(self, index: int) -> bool:
        return index in self.offloaded_layers

    def _paces_prefetch(self, index: int) -> bool:
        return self.prefetch_layers == 1 and index - 1 in self.offloaded_layers

    def release_point(self, index: int) -> int:
        """Entry index at which layer ``index`` is released at the latest (``L``: end of forward)."""
        return min(index + 1 + self.release_lag, self.num_layers)

    def _fresh_state(self) -> dict[str, Any]:
        # _pending: offloaded layers of this step whose copies are held
        return {**super()._fresh_state(), "_pending": []}

    def _new_step(self) -> None:
        super()._new_step()
        self._pending = []

    def _release_due(self, point: int) -> None:
        step = self._step
        if step is None:
            return
        keep = []
        for j in self._pending:
            state = step.layers.get(j)
            if state is None:
                continue
            if self.release_point(j) <= point or state.d2h_complete():
                state.release_forward()
            else:
                keep.append(j)
        self._pending = keep

    def _on_layer_entry(self, index: int) -> None:
        self._release_due(index)
        if index in self.offloaded_layers:
            self._pending.append(index)

    def _on_forward_end(self) -> None:
        self._release_due(self.num_layers)

    def _prefetch(self, step: _Step, index: int) -> None:
        low = index - self.prefetch_layers
        current = step.layers.get(index)
        if current is not None:
            current.start_reload()  # normally prefetched already; reload it now if it was not
        # the layer whose consumption paces the next reload: the current offloaded layer's reload,
        # or a kept layer's saved tensors (Note [Kept-layer paced prefetch])
        pacer = current.pacer if current is not None else step.kept.get(index)
        for j in sorted(step.layers.keys(), reverse=True):
            state = step.layers.get(j)
            if state is None or not low <= j < index:
                continue
            if self.prefetch_layers == 1 and pacer is not None and pacer.before_half():
                # Note [Half-layer prefetch]: with a look-ahead of one layer, start layer j's
                # reload once half of the current layer's reloaded bytes have been consumed
                # rather than at its first node. The H2D stream is still fed (the current
                # layer's second half is in flight then), but only ~1.5 offloaded layers are
                # on the device in backward instead of 2. If that point is never reached the
                # pre-hook of layer j (or its first unpack) reloads it.
                pacer.on_half_consumed = state.start_reload
            else:
                state.start_reload()

    def schedule(self) -> dict:
        """The schedule's arithmetic: per layer when it is released and reloaded, and the bound.

        Returns:
            dict with ``layers`` (list of per-layer dicts: ``offloaded``, ``release_at_entry_of``
            (a layer index, or ``"end of forward"``), ``reload_when_backward_reaches``),
            ``max_offloaded_layers_on_device_forward`` and ``..._backward``.
        """
        L = self.num_layers
        rows = []
        for i in range(L):
            off = i in self.offloaded_layers
            rp = self.release_point(i)
            rows.append(
                {
                    "layer": i,
                    "offloaded": off,
                    "release_at_entry_of": (rp if rp < L else "end of forward") if off else None,
                    "reload_when_backward_reaches": min(i + self.prefetch_layers, L - 1)
                    if off
                    else None,
                }
            )
        fwd = 0
        for e in range(L + 1):
            held = sum(1 for i in self.offloaded_layers if i < e < self.release_point(i) + (e == L))
            held += 1 if e < L and e in self.offloaded_layers else 0
            fwd = max(fwd, held)
        bwd = min(self.prefetch_layers + 1, len(self.offloaded_layers))
        return {
            "layers": rows,
            "max_offloaded_layers_on_device_forward": fwd,
            "max_offloaded_layers_on_device_backward": bwd,
            "release_lag": self.release_lag,
            "prefetch_layers": self.prefetch_layers,
        }


class ManualOffloadSynchronizer(OffloadSynchronizer):
    """The user drives the copies by layer index (TransformerEngine's manual mode).

    Every eligible tensor of every layer is recorded and held on the device until the user calls,
    in this order per layer: :meth:`start_offload_layer` (enqueue D2H),
    :meth:`release_activation_forward_gpu_memory` (compute waits for the D2H, device copies are
    dropped), :meth:`start_reload_layer` (enqueue H2D; unpack waits per tensor). A layer never
    offloaded keeps its tensors on the device. Any other order raises ``RuntimeError``
    (:class:`~annotate_offload.errors.OffloadError`).
    """

    _eager_d2h = False
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
        """Make the compute stream wait for the D2H and drop the device copies."""
        state = self._state(layer_id, "offload_started", "release_activation_forward_gpu_memory")
        state.finish_forward()
        state.release_forward()
        state.state = "offload_finished"

    def start_reload_layer(self, layer_id: int) -> None:
        """Enqueue the H2D copies of layer ``layer_id`` (state ``offload_finished``)."""
        self._state(layer_id, "offload_finished", "start_reload_layer").start_reload()
