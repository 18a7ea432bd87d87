"""One layer's saved tensors in one step: storage units, their host copies and reloads.

Note [Offload lifetime]. A layer state is owned by the step that created it (until the
synchronizer releases the step) *and* by every pack handle autograd holds. Device memory is
released explicitly by the schedule (forward copies once their D2H is done, reloaded buffers once
their layer's backward is done); host buffers go back to the pool only when the last handle dies,
i.e. when autograd frees the saved tensors (after backward without ``retain_graph``, or when the
graph is garbage-collected). So ``retain_graph=True`` and graphs whose backward never runs cannot
corrupt the next step: a later unpack reloads from the host copy on demand.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..errors import OffloadError
from ._device import _Backend
from ._pinned_pool import PinnedBufferPool, _HostBuffer
from ._stats import OffloadStats
from ._tensor_group import _flat_bytes, _rebuild, _unit_range, _view_meta, _ViewMeta

__all__: list[str] = []

# TE's default threshold: 256K logical elements (te_offload.md §1.4, TE PR #2535).
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
    if isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    if base is not None and isinstance(base, torch.nn.Parameter):
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
    out: set = set()
    for p in weights:
        shape = tuple(p.shape)
        out.add(shape)
        if len(shape) == 2:
            out.add(shape[::-1])
    return out


def _is_frozen_weight_copy(t: torch.Tensor, shapes: set) -> bool:
    """A fresh cast of a frozen weight (autocast), or the ``.t()`` view ``F.linear`` saves of it.

    A frozen weight's cast records no autograd node, so :func:`_is_param_alias` cannot see it;
    ``shapes`` are those of the model's frozen weights (:func:`frozen_shapes`). Activations of
    layer 0 in a frozen-embedding model have no ``grad_fn`` either, and a view of a ``(B*T, H)``
    activation can match a weight's shape by chance: a view needs its base to match too.
    """
    if t.grad_fn is not None or t.requires_grad:
        return False
    base = t._base
    if base is None:
        return tuple(t.shape) in shapes
    return tuple(base.shape) in shapes and tuple(t.shape) in shapes


def _is_weight(t: torch.Tensor, frozen: set) -> bool:
    """A weight or a cast/view of one: trainable ones by their autograd chain
    (:func:`_is_param_alias`), frozen ones by their shape (``frozen``: :func:`frozen_shapes` of the
    model's frozen weights). The rule the meta estimate and the plan count by; the runtime applies
    the same two checks in ``_keep_reason``."""
    return _is_param_alias(t) or bool(frozen and _is_frozen_weight_copy(t, frozen))


def _is_fake(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    name = type(t).__name__
    return name in ("FakeTensor", "FunctionalTensor")


class _Entry:
    """One storage unit: device bytes ``[lo, lo+nbytes)``, its host copy and its reload.

    An entry may be shared by several layers of one step (a layer's output saved again by the
    next layer): it is copied to host memory once, owned by the layer that saved it first, and
    borrowed by the others. Its host buffer goes back to the pool when the entry itself dies.
    """

    __slots__ = (
        "src", "key", "nbytes", "version", "host", "d2h_queued", "ready", "reloaded",
        "h2d_event", "pool", "handles", "unpacks_left",
    )

    def __init__(self, src: torch.Tensor, key: tuple, nbytes: int, version: int, pool):
        self.src: Optional[torch.Tensor] = src  # flat uint8 alias of the device storage
        self.key = key
        self.nbytes = nbytes
        self.version = version
        self.host: Optional[_HostBuffer] = None
        self.d2h_queued = False
        self.ready: Any = None  # ready event parked until start_offload (manual mode)
        self.reloaded: Optional[torch.Tensor] = None
        self.h2d_event: Any = None
        self.pool = pool
        self.handles = 0  # pack handles that point here
        self.unpacks_left = 0  # unpacks still expected for the current reload

    def __del__(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            try:
                self.pool.release(host, self.h2d_event)
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass


class _Kept:
    """Pack handle for a tensor left on the device; keeps autograd's in-place check alive."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.version = tensor._version


class _Packed:
    """Pack handle for an offloaded tensor: its layer, unit and how to rebuild it."""

    __slots__ = ("layer", "entry", "meta", "version", "ref", "base_ref", "__weakref__")

    def __init__(self, layer: "_LayerState", entry: _Entry, meta: _ViewMeta, t: torch.Tensor):
        self.layer = layer
        self.entry = entry
        entry.handles += 1
        self.meta = meta
        self.version = t._version
        self.ref = weakref.ref(t)
        base = t._base
        self.base_ref = weakref.ref(base) if base is not None else None


def _version_error(t: torch.Tensor, expected: int) -> OffloadError:
    return OffloadError(
        "annotate_offload: one of the variables needed for gradient computation has been "
        f"modified by an inplace operation: [{t.type()} {list(t.shape)}] is at version "
        f"{t._version}; expected version {expected} instead. The tensor was saved for backward "
        "(and offloaded to host memory) before the in-place change. Fix: clone the tensor before "
        "modifying it, or make the operation out-of-place."
    )


def check_kept_version(handle: _Kept) -> torch.Tensor:
    t = handle.tensor
    if t._version != handle.version:
        raise _version_error(t, handle.version)
    return t


def check_packed_version(handle: _Packed) -> None:
    for ref in (handle.ref, handle.base_ref):
        obj = ref() if ref is not None else None
        if obj is not None and obj._version != handle.version:
            raise _version_error(obj, handle.version)


class HalfPacer:
    """Bytes a layer holds for backward, how many backward has consumed, and the callback to run
    once half are consumed: the deferred prefetch of the next layer (Note [Half-layer prefetch] in
    ``_synchronizer.py`` for an offloaded layer's reload, Note [Kept-layer paced prefetch] for a
    kept layer's saved tensors)."""

    __slots__ = ("total_bytes", "consumed_bytes", "on_half_consumed")

    def __init__(self) -> None:
        self.total_bytes = 0
        self.consumed_bytes = 0
        self.on_half_consumed: Any = None

    def before_half(self) -> bool:
        """True while less than half of a non-empty total has been consumed."""
        return self.total_bytes > 0 and 2 * self.consumed_bytes < self.total_bytes

    def consume(self, nbytes: int) -> None:
        self.consumed_bytes += nbytes
        callback = self.on_half_consumed
        if callback is not None and 2 * self.consumed_bytes >= self.total_bytes:
            self.on_half_consumed = None
            callback()


class _LayerState:
    """Saved tensors of one layer in one step (see Note [Offload lifetime]).

    States (checked by the manual synchronizer): ``not_offloaded`` -> ``offload_started`` ->
    ``offload_finished`` (device copies released) -> ``reload_started``.
    """

    __slots__ = (
        "index",
        "backend",
        "pool",
        "stats",
        "eager_d2h",
        "entries",
        "borrowed",
        "by_storage",
        "shared",
        "state",
        "d2h_done",
        "pacer",
        "__weakref__",
    )

    def __init__(
        self,
        index: int,
        backend: _Backend,
        pool: PinnedBufferPool,
        stats: OffloadStats,
        eager_d2h: bool,
        shared: Optional[dict] = None,
    ):
        self.index = index
        self.backend = backend
        self.pool = pool
        self.stats = stats
        self.eager_d2h = eager_d2h
        self.entries: list[_Entry] = []  # owned: copied by this layer
        self.borrowed: list[_Entry] = []  # owned by an earlier layer of the same step
        self.by_storage: dict[int, list[_Entry]] = {}
        # storage id -> [(weakref to the saved tensor, entry)] for the whole step (default mode)
        self.shared = shared
        self.state = "not_offloaded"
        self.d2h_done: Any = None
        # bytes of the last reload batch, and of those the units whose every handle was unpacked
        self.pacer = HalfPacer()

    # -- forward ----------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, ready_event: Any = None) -> Any:
        """Record ``t`` (already judged eligible) and return its pack handle."""
        whole = bool(getattr(t, "offload_base_tensor", False))
        rng = _unit_range(t, whole)
        if rng is None:
            self.stats._keep("unsupported", t.numel() * t.element_size())
            return _Kept(t)
        entry = self._entry_for(t, rng, ready_event)
        self.stats.tensors_offloaded += 1
        return _Packed(self, entry, _view_meta(t, entry.key[1]), t)

    def _entry_for(self, t: torch.Tensor, rng: tuple, ready_event: Any) -> _Entry:
        storage = t.untyped_storage()
        sid = storage._cdata
        lo, hi = rng
        version = t._version
        for e in self.by_storage.get(sid, ()):
            elo, ehi = e.key[1], e.key[1] + e.nbytes
            if elo <= lo and hi <= ehi and e.version == version:
                self.stats.tensors_deduplicated += 1
                if not e.d2h_queued and ready_event is not None:
                    e.ready = ready_event  # an aliased unit waits for its latest ready event
                return e
        borrowed = self._borrow(t, sid, lo, hi, version)
        if borrowed is not None:
            return borrowed
        entry = _Entry(_flat_bytes(t, lo, hi), (sid, lo), hi - lo, version, self.pool)
        self.entries.append(entry)
        self.by_storage.setdefault(sid, []).append(entry)
        if self.shared is not None:
            self.shared.setdefault(sid, []).append((weakref.ref(t), entry))
        self.stats._resident(entry.nbytes)
        if self.eager_d2h:
            self._enqueue_d2h(entry, ready_event)
            self.state = "offload_started"
        else:
            entry.ready = ready_event if ready_event is not None else self._ready_now()
        return entry

    def _borrow(self, t: torch.Tensor, sid: int, lo: int, hi: int, version: int):
        """An earlier layer's entry for the same bytes (same storage, still alive, same version)."""
        if self.shared is None:
            return None
        for ref, e in self.shared.get(sid, ()):
            owner_tensor = ref()
            if owner_tensor is None or not e.d2h_queued or e.version != version:
                continue
            if owner_tensor.untyped_storage()._cdata != sid:
                continue  # the storage id was reused by a new allocation
            if e.key[1] <= lo and hi <= e.key[1] + e.nbytes:
                if not any(b is e for b in self.borrowed) and not any(o is e for o in self.entries):
                    self.borrowed.append(e)
                self.stats.tensors_deduplicated += 1
                return e
        return None

    def _ready_now(self) -> Any:
        return self.backend.record(self.backend.current_stream())

    def _enqueue_d2h(self, entry: _Entry, ready_event: Any) -> None:
        backend = self.backend
        host = self.pool.acquire(entry.nbytes)
        d2h = backend.d2h_stream
        if ready_event is not None:
            d2h.wait_event(ready_event)
        else:
            d2h.wait_stream(backend.current_stream())
        if host.last_read_event is not None:
            d2h.wait_event(host.last_read_event)
            host.last_read_event = None
        with backend.stream_ctx(d2h):
            host.tensor.copy_(entry.src, non_blocking=host.pinned)
        entry.host = host
        entry.d2h_queued = True
        self.stats.bytes_offloaded += entry.nbytes
        per_layer = self.stats.bytes_offloaded_per_layer
        per_layer[self.index] = per_layer.get(self.index, 0) + entry.nbytes
        self.stats.pinned_bytes = self.pool.cached_bytes
        self.stats.peak_pinned_bytes = max(self.stats.peak_pinned_bytes, self.pool.peak_bytes)

    def start_offload(self) -> None:
        """Enqueue the D2H of every unit not yet copied (manual mode, or units added late)."""
        for e in self.entries:
            if not e.d2h_queued and e.src is not None:
                ready, e.ready = e.ready, None
                self._enqueue_d2h(e, ready)
        self.state = "offload_started"

    def finish_forward(self) -> None:
        """Record the event that marks the end of this layer's D2H copies."""
        if any(e.d2h_queued for e in self.entries):
            self.d2h_done = self.backend.record(self.backend.d2h_stream)

    def d2h_complete(self) -> bool:
        if self.d2h_done is None:
            return not any(e.d2h_queued and e.src is not None for e in self.entries)
        return self.backend.is_done(self.d2h_done)

    def release_forward(self) -> None:
        """Drop the device copies after the compute stream has waited for their D2H."""
        held = [e for e in self.entries if e.src is not None and e.d2h_queued]
        if not held:
            return
        if self.d2h_done is None:
            self.finish_forward()
        self.backend.current_stream().wait_event(self.d2h_done)
        for e in held:
            e.src = None
            self.stats._resident(-e.nbytes)
        self.state = "offload_finished"

    # -- backward ---------------------------------------------------------------------------
    def start_reload(self) -> None:
        """Enqueue the H2D of every released unit (buffers allocated on the compute stream)."""
        # Last saved first: backward consumes a layer's tensors in reverse order of their saves,
        # so its first node can start while the rest of the layer is still crossing the link.
        todo = [
            e
            for e in reversed(self.entries + self.borrowed)
            if e.src is None and e.reloaded is None and e.host
        ]
        self.state = "reload_started"
        if not todo:
            return
        self.pacer.total_bytes = sum(e.nbytes for e in todo)
        self.pacer.consumed_bytes = 0
        backend = self.backend
        compute = backend.current_stream()
        buffers = [torch.empty(e.nbytes, dtype=torch.uint8, device=backend.device) for e in todo]
        h2d = backend.h2d_stream
        h2d.wait_stream(compute)
        h2d.wait_stream(backend.d2h_stream)
        with backend.stream_ctx(h2d):
            for e, buf in zip(todo, buffers):
                buf.copy_(e.host.tensor, non_blocking=e.host.pinned)
                e.reloaded = buf
                e.unpacks_left = e.handles
                e.h2d_event = backend.record(h2d)
                self.stats.bytes_reloaded += e.nbytes
                self.stats._resident(e.nbytes)

    def release_reloaded(self) -> None:
        """Drop reloaded device buffers (the compute stream first waits for their H2D)."""
        compute = self.backend.current_stream()
        for e in self.entries:
            if e.reloaded is not None:
                compute.wait_event(e.h2d_event)
                e.reloaded = None
                self.stats._resident(-e.nbytes)

    def release_all(self) -> None:
        self.release_forward()
        self.release_reloaded()
        # units recorded but never copied (manual mode without start_offload_layer): drop refs
        for e in self.entries:
            if e.src is not None:
                e.src = None
                self.stats._resident(-e.nbytes)

    def unpack(self, handle: _Packed, allow_on_demand: bool = True) -> torch.Tensor:
        check_packed_version(handle)
        e = handle.entry
        flat = e.src
        if flat is None:
            if e.reloaded is None:
                if not allow_on_demand:
                    raise OffloadError(
                        f"annotate_offload: layer {self.index}'s saved tensors are in host memory "
                        f"(state {self.state!r}) but were not reloaded; call "
                        f"start_reload_layer({self.index}) before its backward runs"
                    )
                if e.host is None:
                    raise OffloadError(
                        f"annotate_offload: a saved tensor of layer {self.index} was released "
                        "before it was copied to host memory; call start_offload_layer before "
                        "release_activation_forward_gpu_memory"
                    )
                self.stats.on_demand_reloads += 1
                self.start_reload()
            self.backend.current_stream().wait_event(e.h2d_event)
            flat = e.reloaded
            e.unpacks_left -= 1
            if e.unpacks_left <= 0:
                # Every handle of this unit has been served: drop our reference now, so the
                # buffer is freed as soon as autograd is done with it (the compute stream has
                # already waited for its H2D above).
                e.reloaded = None
                self.stats._resident(-e.nbytes)
                self.pacer.consume(e.nbytes)
        return _rebuild(flat, handle.meta)

    def offloaded_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.d2h_queued)

    def __del__(self) -> None:
        try:
            if self.d2h_done is not None and any(
                e.src is not None and e.d2h_queued for e in self.entries
            ):
                # device copies dropped without the schedule: never before their D2H is done
                self.backend.current_stream().wait_event(self.d2h_done)
            for e in self.entries:
                e.src = None
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def __repr__(self) -> str:
        return (
            f"_LayerState(index={self.index}, state={self.state!r}, units={len(self.entries)}, "
            f"offloaded_bytes={self.offloaded_bytes()})"
        )
