"""One layer's saved tensors in one step: storage units, their host copies and reloads.

Note [Offload lifetime]. A layer state is owned by the step that created it (until the synchronizer
releases the step) *and* by every pack handle autograd holds. Device memory is released by the
schedule (forward bytes once their D2H is done; a unit's reload once each of its handles was
unpacked, at the latest when its layer's backward is done); host buffers go back to the pool only
when the layer state dies, i.e. when autograd has freed its saved tensors. So ``retain_graph=True``,
several backward passes per step and graphs whose backward never runs cannot corrupt the next step:
a later unpack reloads from the host copy. Dropping a served reload frees nothing backward needs:
each unpacked tensor is a view that keeps the buffer alive, and the compute stream already waited
for its H2D. A handle unpacked again after the drop (``ctx.saved_tensors`` read twice) reloads its
unit alone.

Note [Version check]. Saved-tensor hooks switch off autograd's check that a saved tensor was not
modified in place, so the runtime does it: each handle records the tensor's version at save; each
unit watches the tensors saved from it (held with its device bytes, at no cost) and, after their
release, a counter alias of each (``_counter``: no storage, the same version counter), so an
in-place edit after the release, even through a tensor object that has died, is seen. An unpack
raises autograd's error if a watched version differs from the handle's. Handles and layers hold a
saved tensor that has a ``grad_fn`` as a detached alias: the tensor's node holds its handle, so
holding the tensor would close a cycle through autograd's C++ nodes that gc cannot see, keeping
the graph (and the parameters) of a forward whose backward never runs alive. A compiled graph's
layers (``track=False``) watch nothing after the release: the graph reuses released buffers for
later values and never edits a saved tensor in place.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..errors import OffloadError
from ._tensor_group import TensorGroup, TensorGroupProcessor, _holds, _rebuild, _unit_range

__all__: list[str] = []

# TransformerEngine's default threshold: 256K logical elements.
DEFAULT_MIN_OFFLOAD_NUMEL = 256 * 1024

_CAST_NODES = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "AliasBackward0",
        "UnsafeViewBackward0",
    }
)


def _is_param_alias(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or a cast/view chain of a trainable parameter (autocast)."""
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return True
    node = t.grad_fn
    for _ in range(4):
        if node is None or type(node).__name__ not in _CAST_NODES:
            return False
        nxt = [fn for fn, _ in node.next_functions if fn is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
        variable = getattr(node, "variable", None)
        if variable is not None:
            return isinstance(variable, torch.nn.Parameter)
    return False


def frozen_shapes(weights) -> set:
    """The shapes :func:`_is_frozen_weight_copy` matches for these frozen weights (2-D ones also transposed)."""
    shapes = {tuple(p.shape) for p in weights}
    return shapes | {shape[::-1] for shape in shapes if len(shape) == 2}


def _is_frozen_weight_copy(t: torch.Tensor, shapes: set) -> bool:
    """A fresh cast of a frozen weight (autocast), or the ``.t()`` view ``F.linear`` saves of it.

    A frozen weight's cast records no autograd node, so :func:`_is_param_alias` cannot see it;
    ``shapes`` are those of the model's frozen weights (:func:`frozen_shapes`). Activations of
    layer 0 in a frozen-embedding model have no ``grad_fn`` either, and a view of a ``(B*T, H)``
    activation can match a weight's shape by chance: a view needs its base to match too.
    """
    if t.grad_fn is not None or t.requires_grad:
        return False
    return tuple(t.shape) in shapes and (t._base is None or tuple(t._base.shape) in shapes)


def _is_weight(t: torch.Tensor, frozen: set) -> bool:
    """A weight or a cast/view of one: trainable ones by their autograd chain
    (:func:`_is_param_alias`), frozen ones by their shape (``frozen``: :func:`frozen_shapes` of the
    model's frozen weights). The rule the meta estimate and the plan count by; the runtime applies
    the same two checks in ``_keep_reason``."""
    return _is_param_alias(t) or bool(frozen and _is_frozen_weight_copy(t, frozen))


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ in ("FakeTensor", "FunctionalTensor")


class _Pacer:
    """Bytes one layer holds for backward, how many backward has used, and what to start once half
    are used (Note [Paced prefetch] in ``_synchronizer.py``)."""

    __slots__ = ("total", "used", "then")

    def __init__(self) -> None:
        self.total = self.used = 0
        self.then: Any = None

    def use(self, nbytes: int) -> None:
        self.used += nbytes
        if self.then is not None and 2 * self.used >= self.total:
            then, self.then = self.then, None
            then()


def _no_graph(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its detached alias where ``t`` has a ``grad_fn`` (Note [Version check])."""
    return t if t.grad_fn is None else t.detach()


def _counter(t: torch.Tensor) -> torch.Tensor:
    """A tensor of no storage sharing ``t``'s version counter (Note [Version check]); ``t``'s version stays."""
    alias = torch.Tensor._make_subclass(torch.Tensor, t)  # a detached alias whose storage may be replaced
    with torch.autograd._unsafe_preserve_version_counter(alias):
        alias.set_()
    return alias


class _Kept:
    """Pack handle for a tensor left on the device; keeps autograd's in-place check alive. In a
    layer that paces a reload its bytes count for that layer's pacer, once."""

    __slots__ = ("tensor", "version", "pacer", "nbytes")

    def __init__(self, tensor: torch.Tensor, pacer: Optional[_Pacer] = None):
        self.tensor, self.version, self.pacer = _no_graph(tensor), tensor._version, pacer
        self.nbytes = tensor.nbytes if tensor.layout is torch.strided else 0  # paced bytes (a sparse one has none)
        if pacer is not None:
            pacer.total += self.nbytes

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise _version_error(self.tensor._version, self.version, self.tensor)
        pacer, self.pacer = self.pacer, None
        if pacer is not None:
            pacer.use(self.nbytes)
        return self.tensor


class _Packed(int):
    """Pack handle of an offloaded tensor. As TransformerEngine's, an ``int``: the tensor's position
    in its layer's group; it also carries that layer and the tensor's version at save."""

    def __new__(cls, layer: "_LayerState", pos: int, t: torch.Tensor) -> "_Packed":
        self = super().__new__(cls, pos)
        self.layer, self.version = layer, t._version
        return self


def _version_error(found: int, expected: int, t: Optional[torch.Tensor] = None, meta: Any = None) -> OffloadError:
    """Autograd's message for a saved tensor changed in place; ``meta``: the saved view, where ``t`` is its base."""
    if t is not None:
        kind, shape = (t.type(), t.shape) if meta is None else (t.new_empty(0, dtype=meta.dtype).type(), meta.shape)
    what = "a saved tensor" if t is None else f"[{kind} {list(shape)}]"
    return OffloadError(
        "offload runtime: one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what} is at version {found}; expected version {expected} instead. It was "
        "saved for backward before the in-place change. Fix: clone the tensor before "
        "modifying it, or make the operation out-of-place."
    )


class _LayerState:
    """Saved tensors of one layer in one step (Notes [Offload lifetime], [Version check]).

    As TransformerEngine's per-layer state, three :class:`TensorGroup` s indexed by storage unit:
    ``fwd_gpu_tensor_group`` (each unit's device bytes, ``None`` once released, and its ready event;
    its ``aux`` is :class:`TensorGroupProcessor`'s, so ``tensor_group_process_after_reload`` rebuilds
    every saved tensor), ``cpu_tensor_group`` (host copies) and ``bwd_gpu_tensor_group`` (reloads
    and their H2D events). A unit whose bytes an earlier layer of the step already copied (a
    layer's output saved again by the next layer) is borrowed from that layer, not copied again.

    States (checked by the manual synchronizer): ``not_offloaded`` -> ``offload_started`` ->
    ``offload_finished`` (device bytes released) -> ``reload_started``.
    """

    __slots__ = (
        "index", "backend", "pool", "stats", "eager_d2h", "shared", "state", "d2h_done",
        "fwd_gpu_tensor_group", "cpu_tensor_group", "bwd_gpu_tensor_group",
        "watch", "track", "borrowed", "users", "pending", "pacer", "__weakref__",
    )

    def __init__(self, index: int, sync: Any, shared: Optional[dict], track: bool = True):
        self.index, self.track = index, track
        self.backend, self.pool, self.stats = sync.backend, sync.pool, sync.stats
        self.eager_d2h = not sync._manual  # copy at save time (default) or at start_offload (manual)
        # storage id -> [(weak references to a saved tensor and its owner, unit)] of the step's
        # copied units; the step clears it when its forward can no longer borrow
        self.shared = shared
        self.state = "not_offloaded"
        self.d2h_done: Any = None
        self.fwd_gpu_tensor_group = TensorGroup(aux=TensorGroupProcessor._new_aux())
        self.cpu_tensor_group = TensorGroup()
        self.bwd_gpu_tensor_group = TensorGroup()
        self.watch: list = []  # per unit: the saved tensors, held with its device bytes, then their counters
        self.borrowed: list[tuple[_LayerState, int]] = []
        self.users: list[list[int]] = []  # per unit: the handles (positions) that rebuild from it
        # per unit: the handles its reload has not served yet (empty: all served and the reload
        # dropped, Note [Offload lifetime]); None: no reload since the layer's last release
        self.pending: list[Optional[set]] = []
        self.pacer = _Pacer()  # bytes reloaded for this layer and bytes backward used up

    # -- forward ----------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, ready: Any = None) -> Any:
        """Record ``t`` (already judged eligible) and return its handle (``t`` if it stays)."""
        rng = _unit_range(t, bool(getattr(t, "offload_base_tensor", False)))
        if rng is None:
            self.stats._keep("unsupported", t.numel() * t.element_size())
            return t
        owner, unit = self.unit_for(t, rng, ready)
        self.stats.tensors_offloaded += 1
        pos = TensorGroupProcessor._add_view(owner.fwd_gpu_tensor_group, t, unit)
        owner.users[unit].append(pos)
        return _Packed(owner, pos, t)

    def unit_for(self, t: torch.Tensor, rng: tuple[int, int], ready: Any) -> tuple["_LayerState", int]:
        """The unit holding ``t``'s bytes: this layer's, an earlier layer's, or a new one."""
        group = self.fwd_gpu_tensor_group
        unit = TensorGroupProcessor._find(group, t, rng)
        if unit is not None:
            self.stats.tensors_deduplicated += 1
            if ready is not None and self.cpu_tensor_group.tensor_list[unit] is None:
                group.events[unit] = ready  # an aliased unit waits for its latest ready event
            self._watch(unit, t)
            return self, unit
        borrowed = self._borrow(t, rng)
        if borrowed is not None:
            self.stats.tensors_deduplicated += 1
            return borrowed
        if ready is None:
            ready = self.backend.record(self.backend.current_stream())  # the compute stream's position now
        unit = TensorGroupProcessor._add_unit(group, t, rng, ready)
        for per_unit in (self.cpu_tensor_group.tensor_list, self.bwd_gpu_tensor_group.tensor_list,
                         self.bwd_gpu_tensor_group.events, self.pending):
            per_unit.append(None)
        self.watch.append([_no_graph(t)])
        self.users.append([])
        if self.shared is not None:
            self.shared.setdefault(t.untyped_storage()._cdata, []).append((weakref.ref(t), weakref.ref(self), unit))
        self.stats._resident(rng[1] - rng[0])
        if self.eager_d2h:
            self._d2h(unit)
            self.state = "offload_started"
        return self, unit

    def _watch(self, unit: int, t: torch.Tensor) -> None:
        watched = self.watch[unit]
        if watched is not None:  # a released unit watches the counter only: its bytes are gone
            watched.append(_no_graph(t) if self.fwd_gpu_tensor_group.tensor_list[unit] is not None else _counter(t))

    def _borrow(self, t: torch.Tensor, rng: tuple[int, int]) -> Optional[tuple["_LayerState", int]]:
        """An earlier layer's copied unit with the same bytes (same live storage, same version)."""
        sid = t.untyped_storage()._cdata
        for ref, owner_ref, unit in (self.shared or {}).get(sid, ()):
            alive, owner = ref(), owner_ref()
            if alive is None or owner is None:
                continue
            _, lo, hi, version = owner.fwd_gpu_tensor_group.aux["units"][unit]
            if (
                alive.untyped_storage()._cdata == sid  # not a reused storage id
                and owner.cpu_tensor_group.tensor_list[unit] is not None
                and version == t._version
                and _holds(lo, hi, rng, t)
            ):
                if owner is not self and (owner, unit) not in self.borrowed:
                    self.borrowed.append((owner, unit))
                owner._watch(unit, t)
                return owner, unit
        return None

    def _d2h(self, unit: int) -> None:
        group, backend = self.fwd_gpu_tensor_group, self.backend
        src, ready = group.tensor_list[unit], group.events[unit]
        host, last_use = self.pool.acquire(src.numel())
        d2h = backend.d2h_stream
        d2h.wait_event(ready)
        if last_use is not None:
            d2h.wait_event(last_use)
        with backend.stream_ctx(d2h):
            host.copy_(src, non_blocking=True)
        self.cpu_tensor_group.tensor_list[unit] = host
        group.events[unit] = None
        stats = self.stats
        stats.bytes_offloaded += src.numel()
        stats.bytes_offloaded_per_layer[self.index] = stats.bytes_offloaded_per_layer.get(self.index, 0) + src.numel()
        stats.pinned_bytes = self.pool.cached_bytes
        stats.peak_pinned_bytes = max(stats.peak_pinned_bytes, self.pool.peak_bytes)

    def start_offload(self) -> None:
        """Enqueue the D2H of every unit not yet copied (manual mode)."""
        for unit, src in enumerate(self.fwd_gpu_tensor_group.tensor_list):
            if src is not None and self.cpu_tensor_group.tensor_list[unit] is None:
                self._d2h(unit)
        self.state = "offload_started"

    def finish_forward(self) -> None:
        """Record the event that marks the end of this layer's D2H copies."""
        if any(h is not None for h in self.cpu_tensor_group.tensor_list):
            self.d2h_done = self.backend.record(self.backend.d2h_stream)

    def d2h_complete(self) -> bool:
        return self.d2h_done is None or self.backend.is_done(self.d2h_done)

    def _drop(self, unit: int) -> None:
        """Drop unit's device bytes; its saved tensors are then watched through their counters."""
        self.watch[unit] = [_counter(t) for t in self.watch[unit]] if self.track else None
        src, self.fwd_gpu_tensor_group.tensor_list[unit] = self.fwd_gpu_tensor_group.tensor_list[unit], None
        self.stats._resident(-src.numel())

    def release_forward(self) -> None:
        """Drop the device bytes of copied units after the compute stream waited for their D2H."""
        cpu = self.cpu_tensor_group.tensor_list
        held = [u for u, src in enumerate(self.fwd_gpu_tensor_group.tensor_list) if src is not None and cpu[u] is not None]
        if not held:
            return
        if self.d2h_done is None:
            self.finish_forward()
        self.backend.current_stream().wait_event(self.d2h_done)
        for unit in held:
            self._drop(unit)
        self.state = "offload_finished"

    # -- backward ---------------------------------------------------------------------------
    def start_reload(self) -> None:
        """Enqueue the H2D of every released unit, its own and borrowed, not reloaded since the
        layer's last release. Last saved first: backward consumes a layer's tensors in reverse order."""
        units = [(self, u) for u in reversed(range(len(self.watch)))] + self.borrowed
        self.state = "reload_started"
        self._reload([(s, u) for s, u in units if s.fwd_gpu_tensor_group.tensor_list[u] is None
                      and s.pending[u] is None and s.cpu_tensor_group.tensor_list[u] is not None])

    def _reload(self, todo: list) -> None:
        """Enqueue the H2D of these ``(layer, unit)`` (buffers allocated on the compute stream)."""
        if not todo:
            return
        backend = self.backend
        compute = backend.current_stream()
        hosts = [s.cpu_tensor_group.tensor_list[u] for s, u in todo]
        buffers = [torch.empty(h.numel(), dtype=torch.uint8, device=backend.device) for h in hosts]
        h2d = backend.h2d_stream
        h2d.wait_stream(compute)
        h2d.wait_stream(backend.d2h_stream)
        with backend.stream_ctx(h2d):
            for (s, u), host, buf in zip(todo, hosts, buffers):
                buf.copy_(host, non_blocking=True)
                s.bwd_gpu_tensor_group.tensor_list[u] = buf
                s.bwd_gpu_tensor_group.events[u] = backend.record(h2d)
                s.pending[u] = set(s.users[u])
                s.pacer.total += buf.numel()
                self.stats.bytes_reloaded += buf.numel()
                self.stats._resident(buf.numel())

    def release_reloaded(self) -> None:
        """Drop this layer's reloads (the compute stream first waits for their H2D)."""
        group, compute = self.bwd_gpu_tensor_group, self.backend.current_stream()
        for unit, buf in enumerate(group.tensor_list):
            if buf is not None:
                compute.wait_event(group.events[unit])
                group.tensor_list[unit] = None
                self.stats._resident(-buf.numel())
        self.pending = [None] * len(self.pending)
        self.pacer = _Pacer()

    def release_all(self) -> None:
        """Release every device byte this layer holds (TransformerEngine's ``release_all_memory``)."""
        self.release_forward()
        self.release_reloaded()
        for unit, src in enumerate(self.fwd_gpu_tensor_group.tensor_list):
            if src is not None:  # never copied (manual mode without start_offload_layer)
                self._drop(unit)

    def unpack(self, handle: _Packed, allow_on_demand: bool = True, wait: bool = True) -> torch.Tensor:
        aux = self.fwd_gpu_tensor_group.aux
        unit, meta = aux["unit_index"][handle], aux["metas"][handle]
        for t in self.watch[unit] or ():
            if t._version != handle.version:
                raise _version_error(t._version, handle.version, t, meta)
        flat = self.fwd_gpu_tensor_group.tensor_list[unit]
        if flat is None:
            bwd, pending = self.bwd_gpu_tensor_group, self.pending[unit]
            if bwd.tensor_list[unit] is None:
                if not allow_on_demand and pending is None:
                    raise OffloadError(
                        f"offload runtime: layer {self.index}'s saved tensors are in host memory (state "
                        f"{self.state!r}) but were not reloaded; call start_reload_layer({self.index}) before "
                        "its backward runs"
                    )
                if self.cpu_tensor_group.tensor_list[unit] is None:
                    raise OffloadError(
                        f"offload runtime: a saved tensor of layer {self.index} was released before it was "
                        "copied to host memory; call start_offload_layer before "
                        "release_activation_forward_gpu_memory"
                    )
                self.stats.on_demand_reloads += 1
                if pending is None:
                    self.start_reload()
                else:  # a handle served before is unpacked again: only its unit
                    self._reload([(self, unit)])
                pending = self.pending[unit]
            if wait:
                self.backend.current_stream().wait_event(bwd.events[unit])
            flat = bwd.tensor_list[unit]
            pending.discard(handle)
            if not pending:
                # every handle was served: autograd holds what it still needs, and frees it after use
                bwd.tensor_list[unit] = None
                self.stats._resident(-flat.numel())
                if wait:
                    self.pacer.use(flat.numel())
        return _rebuild(flat, meta)

    def wait(self, handle: _Packed) -> None:
        """The compute stream waits for the H2D of ``handle``'s unit, taken with ``unpack(wait=False)``."""
        event = self.bwd_gpu_tensor_group.events[self.fwd_gpu_tensor_group.aux["unit_index"][handle]]
        if event is not None:
            self.backend.current_stream().wait_event(event)

    def served(self, handle: _Packed) -> bool:
        """Whether this layer no longer holds any device bytes of ``handle``'s unit (a reload of it
        handed out every tensor it held)."""
        unit = self.fwd_gpu_tensor_group.aux["unit_index"][handle]
        return all(group.tensor_list[unit] is None for group in (self.fwd_gpu_tensor_group, self.bwd_gpu_tensor_group))

    def __del__(self) -> None:
        try:
            if any(s is not None for s in self.fwd_gpu_tensor_group.tensor_list):
                # device bytes dropped without the schedule: never before their D2H is done
                if self.d2h_done is None:
                    self.finish_forward()
                if self.d2h_done is not None:
                    self.backend.current_stream().wait_event(self.d2h_done)
            for unit, host in enumerate(self.cpu_tensor_group.tensor_list):
                if host is not None:
                    self.pool.release(host, self.bwd_gpu_tensor_group.events[unit] or self.d2h_done)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def __repr__(self) -> str:
        return (
            f"_LayerState(index={self.index}, state={self.state!r}, units={len(self.watch)}, "
            f"offloaded_bytes={sum(h.numel() for h in self.cpu_tensor_group.tensor_list if h is not None)})"
        )
