"""The host half of :class:`HybridDeviceOptimizer`: split, host memory, streams, threads, slots, chunks (private).

Note [Host step lifecycle] (one host-stepped parameter, overlap on):

1. backward: its post-accumulate-grad hook records a *ready* event on the compute stream; the D2H
   stream waits on it and copies the gradient into the slot's pinned buffer, recording which gradient
   tensor and version it copied (EMPTY/CONSUMED -> COPIED).
2. ``step()``: a gradient never copied, or changed since (clipping, unscaling), is copied again. The
   device half is queued first; then each chunk, in the order its gradients landed, waits for its D2H,
   is stepped by its host optimizer (COPIED -> SUBMITTED -> STEPPED), writes the bf16 staging copy of a
   bf16 model, and enqueues its H2D on the H2D stream, which waited for the compute stream at entry.
3. ``step()`` returns once the compute stream waits on the last H2D, so no forward reads a stale
   weight; the gradients are consumed (-> CONSUMED, Note [Consumed gradients]).

Note [Failed steps]: a unit of work (the device optimizer, one host chunk) completes or leaves its
parameters untouched. After an exception ``step()`` keeps what it did (``device_done``, STEPPED
slots) and the gradients of the rest (SUBMITTED -> COPIED), so a retried ``step()`` steps each
untouched parameter once. A gradient buffer is multiplied once per gradient: a chunk empties the
pending clip coefficients it applied and marks GradScaler's unscale (``Slot.unscaled``), so a retry
does not apply them again. In delayed mode a chunk of step ``t`` runs during step ``t + 1``; a failed
one keeps its arguments, and the next ``step()`` or ``flush()`` runs it again first.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch.profiler import record_function

from ..errors import OffloadError

__all__: list[str] = []


def local_tensor(p: Optional[torch.Tensor]) -> Any:
    """The tensor this rank stores for ``p`` (``p`` itself, or a DTensor's local shard)."""
    return p.to_local() if type(p).__name__ == "DTensor" and hasattr(p, "to_local") else p


def local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The local part of ``p.grad`` (``None`` when there is no gradient)."""
    return local_tensor(p.grad)


class Placement(NamedTuple):
    """Where one parameter is stepped (``HybridDeviceOptimizer.placements``)."""

    group: int  # index in param_groups
    index: int  # index in that group's params
    shape: tuple  # local shape
    numel: int  # local element count
    side: str  # "cpu" (host optimizer) or "gpu" (device optimizer)
    chunk: int  # host chunk (and index in cpu_optimizers), -1 on the device side


def choose_offloaded(params: list[torch.Tensor], fraction: float,
                     on_device: Callable[[torch.Tensor], bool]) -> list[bool]:
    """Per parameter, in param-group order: ``True`` where it is stepped on the host.

    Split rule (Megatron-Core's): whole tensors; the budget is ``fraction`` times the numel of the
    trainable device-resident parameters; walk the param groups in order, each group in order, and
    offload a parameter while the numel offloaded so far is below the budget (the last one may overshoot
    by one tensor). Parameters already on the host always go to the host side and do not count; frozen
    ones are never offloaded. A DTensor (FSDP2 shard) counts and is stepped through its local shard
    (:func:`local_tensor`), so each rank offloads its own shards.
    """
    budget = fraction * sum(local_tensor(p).numel() for p in params if p.requires_grad and on_device(p))
    done, out = 0, []
    for p in params:
        out.append(p.requires_grad and (not on_device(p) or done < budget))
        if out[-1] and on_device(p):
            done += local_tensor(p).numel()
    return out


def make_chunks(sizes_bytes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Group consecutive items (in step order) into chunks of about ``chunk_bytes``; tensors are never
    split. An item that would overflow the current chunk starts a new one only if the current one is at
    least half full, so a bias in front of a chunk-sized weight joins it (each chunk costs a host
    optimizer call and a thread fork/join)."""
    chunks: list[list[int]] = []
    used = 0  # bytes in the last chunk
    for i, b in enumerate(sizes_bytes):
        if not chunks or used + b > chunk_bytes and 2 * used >= chunk_bytes:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += b
    return chunks


# Note [Serial small tensors]: torch's fused CPU AdamW runs one OpenMP parallel region per tensor,
# whatever its size, so a 2048-element norm weight wakes the whole thread team, and one descheduled
# thread stalls the region for a scheduler slice. Tensors under ``SERIAL_NUMEL`` elements are
# stepped in chunks of their own with one thread.
SERIAL_NUMEL = 1 << 16
SERIAL_CHUNK_BYTES = 1 << 20


def split_serial(groups: list[list[int]], numels: list[int], sizes_bytes: list[int],
                 chunk_bytes: int) -> list[tuple[list[int], bool]]:
    """Split the chunks of :func:`make_chunks` into ``(indices, serial)`` chunks, order preserved: each
    chunk's large tensors stay one chunk; its small ones collect, across chunks, into serial chunks that
    close at ``min(chunk_bytes, SERIAL_CHUNK_BYTES)`` (Note [Serial small tensors])."""
    out: list[tuple[list[int], bool]] = []
    small: list[int] = []
    small_bytes = 0
    for g in groups:
        if big := [i for i in g if numels[i] >= SERIAL_NUMEL]:
            out.append((big, False))
        for i in g:
            if numels[i] < SERIAL_NUMEL:
                small.append(i)
                small_bytes += sizes_bytes[i]
        if small and small_bytes >= min(chunk_bytes, SERIAL_CHUNK_BYTES):
            out.append((small, True))
            small, small_bytes = [], 0
    return out + [(small, True)] if small else out


# Note [Host slabs]: torch's caching host allocator rounds each pinned allocation up to a power of
# two, so :func:`carve` packs the views (64-byte aligned) into power-of-two slabs of at least
# ``MIN_SLAB_BYTES`` and sizes only the last slab to what it holds.
MIN_SLAB_BYTES = 64 << 20


class Side:
    """Streams and events of the parameters' (one) device. Without CUDA the "device" parameters are CPU
    tensors and every stream and event is ``None``: waits are no-ops, copies are synchronous, and splitting,
    hooks, chunks, state and all numerics run as on a GPU. Nothing touches CUDA at import."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        devices = {p.device for p in params if p.device.type == "cuda"}
        other = next((p.device for p in params if p.device.type not in ("cpu", "cuda", "meta")), None)
        if other is not None or len(devices) > 1:
            raise ValueError(f"HybridDeviceOptimizer: parameters on {other or sorted(map(str, devices))}: pass CUDA "
                             "parameters of one device (build one optimizer per device) or CPU parameters.")
        self.can_pin = self.cuda = bool(devices)
        self.device = devices.pop() if devices else torch.device("cpu")

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device) if self.cuda else None

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def bind_thread(self, stream: Any) -> None:
        """Make this thread use the device, and ``stream`` (one of :meth:`new_stream`) as its current stream."""
        if self.cuda:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(stream)

    @staticmethod
    def use(stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def record(stream: Any) -> Any:
        return stream.record_event() if stream is not None else None

    @staticmethod
    def wait_event(stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def synchronize(event: Any) -> None:
        if event is not None:
            event.synchronize()


def carve(numels: list[int], dtypes: list[torch.dtype], *, pin: bool, what: str) -> list[torch.Tensor]:
    """1-D host views of ``numels[i]`` elements of ``dtypes[i]`` (Note [Host slabs]); a pinning failure
    falls back to pageable memory with one ``ResourceWarning``."""
    out: list[Any] = [None] * len(numels)
    unpinned = False
    pow2 = lambda n: 1 << max(0, (n - 1).bit_length())  # noqa: E731
    for dtype in dict.fromkeys(dtypes):
        idx = [i for i, d in enumerate(dtypes) if d == dtype]
        esize = torch.empty((), dtype=dtype).element_size()
        align = max(1, 64 // esize)
        slab = max(MIN_SLAB_BYTES, pow2(max(numels[i] * esize for i in idx))) // esize
        places, used = [], []  # (slab, offset) per view; elements used per slab
        for i in idx:
            if not used or used[-1] + numels[i] > slab:
                used.append(0)
            places.append((len(used) - 1, used[-1]))
            used[-1] += -(-numels[i] // align) * align
        slabs = []
        for k, u in enumerate(used):
            size = slab if k < len(used) - 1 else max(align, pow2(u * esize) // esize)
            try:
                slabs.append(torch.empty(size, dtype=dtype, pin_memory=pin))
            except RuntimeError:  # e.g. the locked-memory limit
                slabs.append(torch.empty(size, dtype=dtype))
                unpinned = True
        for i, (k, off) in zip(idx, places):
            out[i] = slabs[k].narrow(0, off, numels[i])
    if unpinned:
        warnings.warn(f"HybridDeviceOptimizer: could not pin host memory for {what}; using pageable memory, so its "
                      "copies are staged and synchronous. Raise the locked-memory limit (ulimit -l) or pass "
                      "pin_cpu_params=False / pin_cpu_grads=False.", ResourceWarning, stacklevel=4)
    return out


# Note [Thread budget]: the host step parallelises over the intra-op pool, and ``torchrun`` sets
# ``OMP_NUM_THREADS=1`` with several processes per node, so the budget ignores it: ``cpu_threads`` if
# given, else ``usable CPUs // LOCAL_WORLD_SIZE``, less one core (from four up) for the training thread
# beside a worker (``step_in_backward``, ``delayed_param_update``). Thread counts are per thread: the
# worker sets its own, the default mode sets it around the host step.
def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_budget(cpu_threads: Optional[int] = None, *, beside_training: bool = True) -> int:
    """Threads for the host optimizer step (Note [Thread budget]); ``cpu_threads`` must be ``None`` or
    an int in ``[1, usable CPUs]`` (``TypeError``/``ValueError``)."""
    limit = usable_cpus()
    if cpu_threads is not None:
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or not 1 <= cpu_threads <= limit:
            raise (ValueError if isinstance(cpu_threads, int) else TypeError)(
                f"HybridDeviceOptimizer: cpu_threads={cpu_threads!r}: pass None or an int in [1, {limit}]; this "
                f"process may run on {limit} CPUs (os.sched_getaffinity).")
        return cpu_threads
    env = os.environ.get("LOCAL_WORLD_SIZE", "1")
    per_rank = max(1, limit // max(1, int(env) if env.isdigit() else 1))
    return per_rank - 1 if per_rank >= 4 and beside_training else per_rank


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(n)`` and restore the previous value."""
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if old != n:
            torch.set_num_threads(old)


class CpuWorker:
    """One thread (``hdo-cpu-step``) running submitted callables in order with its own thread budget;
    ``drain`` re-raises the first exception a task raised (the tasks after it are skipped)."""

    def __init__(self, threads: int, bind: Callable[[], None]) -> None:
        caller = torch.get_num_threads()  # initialises this thread's own count first
        self._pool = ThreadPoolExecutor(1, "hdo-cpu-step", initializer=self._start, initargs=(threads, bind))
        self._pool.submit(int).result()  # the thread exists and has applied its budget
        torch.set_num_threads(caller)
        self._futures: list[Future] = []
        self._failed = False

    @staticmethod
    def _start(threads: int, bind: Callable[[], None]) -> None:
        bind()
        torch.set_grad_enabled(False)  # the host steps write masters and weights in place
        torch.set_num_threads(threads)
        torch.get_num_threads()  # ATen initialises this thread's pool now, with this count

    def _run(self, fn: Callable[[], None]) -> None:
        if not self._failed:
            try:
                fn()
            except BaseException:
                self._failed = True
                raise

    def submit(self, fn: Callable[[], None]) -> None:
        self._futures.append(self._pool.submit(self._run, fn))

    def drain(self) -> None:
        futures, self._futures = self._futures, []
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        self._failed = False
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop the thread after the queued tasks (idempotent; from the worker itself, without waiting)."""
        self._pool.shutdown(wait=not threading.current_thread().name.startswith("hdo-cpu-step"))


IMPL_KEYS = ("foreach", "capturable", "differentiable", "fused")
# HybridDeviceOptimizer's own options: kept in ``defaults`` (Megatron's DistributedOptimizer rebuilds
# it as ``cls(groups, **opt.defaults)``), never pushed into sub-optimizers nor taken from a load.
STRUCTURAL_KEYS = ("offload_fraction", "param_update_in_fp32", "pin_cpu_grads", "pin_cpu_params",
                   "overlap_cpu_optimizer_d2h_h2d", "offload_gradients", "step_in_backward", "delayed_param_update",
                   "use_torch_optimizer_for_cpu_offload", "cpu_threads", "chunk_bytes")
# Note [Tiny gradients at step()]: host parameters under BATCHED_NUMEL elements (torchao's
# ``minimal_size``) get no gradient hook; ``step()`` copies them in one batch under one event.
BATCHED_NUMEL = 4096
# Note [One D2H stream]: every gradient copy is enqueued on one stream (the D2H stream; without overlap
# the compute stream, synchronised before the host step), so the event of a chunk's last copy covers
# all of its copies: one wait per chunk.
_NULL = contextlib.nullcontext()


def _label(name: str) -> Any:
    """A profiler range, only while a profiler runs (a ``record_function`` costs two op calls even without one)."""
    return record_function(name) if torch.autograd._profiler_enabled() else _NULL


class SlotState(enum.Enum):
    EMPTY = "empty"  # the host buffer holds no gradient of this step
    COPIED = "copied"  # the D2H of this step's gradient is enqueued
    SUBMITTED = "submitted"  # its chunk's host step is queued or running
    STEPPED = "stepped"  # its chunk's host step ran in this step
    CONSUMED = "consumed"  # a finished step used the gradient the buffer holds


S = SlotState


class Slot:
    """One parameter of the optimizer: what steps it and, when the host does, its pipeline state."""

    __slots__ = ("param", "flat", "group", "index", "local", "host", "inner", "master", "opt", "sub_group", "bufs",
                 "staging", "scratch", "chunk", "grad_ref", "grad_ver", "grad_ptr", "d2h_ev", "ready_ev", "scales",
                 "p_ver", "seq", "state", "st", "unscaled")

    def __init__(self, param: torch.Tensor, flat: int, group: int, index: int, host: bool, fp32: bool) -> None:
        self.param, self.flat, self.group, self.index, self.host = param, flat, group, index, host
        self.local = loc = local_tensor(param)  # the tensor the model reads (its local shard for a DTensor)
        wide = not host and fp32 and loc.is_floating_point() and loc.dtype != torch.float32
        # inner: the tensor its sub-optimizer steps; master: a separate copy of it (host or fp32), else None
        self.inner = loc.detach().float() if wide else param if loc is param else loc.detach()
        self.master: Optional[torch.Tensor] = self.inner if wide else None
        self.opt: Any = None  # its sub-optimizer and group there (set when they are built)
        self.sub_group: dict = {}
        self.st: Optional[dict] = None  # its state dict as last placed in the sub-optimizer
        self.bufs: list[torch.Tensor] = []  # host gradient buffers (two in delayed mode)
        self.staging: Optional[torch.Tensor] = None  # model-dtype pinned copy for the H2D
        self.scratch: Optional[torch.Tensor] = None  # landing buffer for accumulation (lazy)
        self.chunk = self.grad_ver = self.grad_ptr = self.seq = -1
        self.p_ver = param._version  # the weights' version its master holds
        self.grad_ref: Optional[weakref.ref] = None
        self.d2h_ev = self.ready_ev = None
        self.scales: list[tuple[torch.Tensor, Any]] = []  # clip coefficients pending for the buffer
        self.unscaled = [False, False]  # per buffer: it holds GradScaler's unscale already (Note [Failed steps]);
        # one flag per buffer, as the worker sets the one of step t while the training thread clears step t + 1's
        self.state = S.EMPTY

    def copied(self, g: torch.Tensor) -> bool:
        """True if the buffer holds the local gradient ``g`` as it is now: same ``param.grad`` object
        (stable for DTensor gradients, whose ``to_local()`` is a new view per call), storage and version."""
        return (self.state in (S.COPIED, S.SUBMITTED, S.STEPPED) and self.grad_ref is not None
                and self.grad_ref() is self.param.grad and self.grad_ptr == g.data_ptr()
                and g._version == self.grad_ver)


class Chunk:
    """A run of host slots stepped by one host optimizer instance: the unit of pipelining."""

    __slots__ = ("slots", "opt", "serial", "trainable", "landed", "h2d_ev", "pending")

    def __init__(self, slots: list[Slot], opt: torch.optim.Optimizer, serial: bool) -> None:
        self.slots, self.opt, self.serial, self.h2d_ev = slots, opt, serial, None
        self.trainable, self.landed = sum(s.param.requires_grad for s in slots), 0  # landed: step_in_backward
        self.pending: list[Slot] = []  # delayed mode: stepped, H2D not yet issued


class AmpStep(NamedTuple):
    """What GradScaler asked of one ``step()`` (Note [GradScaler] in ``_hybrid.py``)."""

    skip: bool  # inf/NaN found: step nothing
    scale: Optional[torch.Tensor] = None  # the scaler's scale and found_inf (their device); None: no unscaling
    found: Optional[torch.Tensor] = None
    host_scale: Optional[torch.Tensor] = None  # CPU copies for the host half (the scaler changes its own
    host_found: Optional[torch.Tensor] = None  # in place, maybe before a delayed host step runs)
    host_inv: Optional[torch.Tensor] = None  # 1 / host_scale, for host classes that take no scale


def takes_scale(opt: torch.optim.Optimizer, amp: Optional[AmpStep]) -> Optional[bool]:
    """Who unscales ``opt``'s gradients in this step: ``None`` nobody (no scale to undo), ``True``
    ``opt.step()`` itself (:func:`amp_step`), ``False`` the caller first (GradScaler's ``unscale_``)."""
    return None if amp is None or amp.scale is None else bool(getattr(opt, "_step_supports_amp_scaling", False))


def amp_step(opt: torch.optim.Optimizer, amp: Optional[AmpStep], *, host: bool) -> None:
    """``opt.step()``, given GradScaler's scale as torch's fused optimizers are if it takes it (:func:`takes_scale`)."""
    if not takes_scale(opt, amp):
        return opt.step()
    opt.grad_scale, opt.found_inf = (amp.host_scale, amp.host_found) if host else (amp.scale, amp.found)
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf


def impl_for(cls: type, impl: dict[str, Any], *, host: bool) -> tuple[dict[str, Any], bool]:
    """A sub-optimizer's constructor switches, and whether complex parameters need their own group.

    Note [Complex parameters]: Adam(W) gets ``fused=True`` unless ``foreach`` or ``differentiable`` is
    given; fused kernels refuse complex tensors, so when that default is ours they get ``fused=None``.
    """
    impl = dict(impl)
    if cls not in (torch.optim.Adam, torch.optim.AdamW) or "foreach" in impl or impl.get("differentiable"):
        return impl, False
    split = "fused" not in impl
    impl.setdefault("fused", True)
    if host:
        impl.pop("capturable", None)
    return impl, split


def sub_optimizer(cls: type, hdo_groups: list[dict[str, Any]], slots: list[Slot], impl: dict[str, Any],
                  split_complex: bool) -> torch.optim.Optimizer:
    """One ``cls`` over ``slots`` (a group per HDO group); sets each slot's ``opt`` and ``sub_group``."""
    parts: dict[tuple[int, bool], list[Slot]] = {}  # (HDO group, complex in a group of its own) -> slots
    for s in slots:
        parts.setdefault((s.group, split_complex and s.inner.is_complex()), []).append(s)
    keys = sorted(parts)  # in HDO group order, a group's complex parameters after the others
    subs = [{**{k: v for k, v in hdo_groups[gi].items() if k != "params" and k not in STRUCTURAL_KEYS},
             **({"fused": None} if cplx else {}), "params": [s.inner for s in parts[gi, cplx]]} for gi, cplx in keys]
    opt = cls(subs, **impl)
    for sub, key in zip(opt.param_groups, keys):
        for s in parts[key]:
            s.opt, s.sub_group = opt, sub
    return opt


# Note [One optimizer per parameter]: the newest pipeline over a parameter owns its hook (an older,
# still referenced one copies at its own step()); building over a live, unclosed one's warns.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (param, owning pipeline)


def _owner(p: torch.Tensor) -> Any:
    e = _OWNERS.get(id(p))
    return e[1]() if e is not None and e[0]() is p else None


def _on_grad(ref: weakref.ref, param: torch.Tensor) -> None:
    """A host parameter's post-accumulate-grad hook (holds its pipeline weakly: no cycle through C++)."""
    if (pl := ref()) is not None and _owner(param) is pl:
        pl.grad_ready(param)


def _sparse(s: Slot, g: torch.Tensor) -> TypeError:
    return TypeError(
        f"HybridDeviceOptimizer: parameter {s.index} of param group {s.group} (shape {tuple(s.local.shape)}) has a "
        f"sparse gradient (layout={g.layout}); the host step copies gradients into dense buffers. Use a dense "
        "embedding (nn.Embedding(..., sparse=False), the default), or step it with torch.optim.SparseAdam outside "
        "this optimizer.")


class HostPipeline:
    """The host half of a :class:`HybridDeviceOptimizer` (Note [Host step lifecycle]); its public
    attributes and methods are the protocol the rest of the package uses."""

    def __init__(self, slots: list[Slot], groups: list[dict[str, Any]], cls: type, impl: dict[str, Any],
                 opts: dict[str, Any], *, side: Any, threads: int, begin: Callable[[], None]) -> None:
        self.side, self.threads = side, threads  # opts: the optimizer's defaults (its constructor's options)
        self.overlap, self.offload_grads = opts["overlap_cpu_optimizer_d2h_h2d"], opts["offload_gradients"]
        self.in_backward, self.delayed = opts["step_in_backward"], opts["delayed_param_update"]
        self._begin = weakref.WeakMethod(begin)  # the optimizer's once-per-step preparation
        fp32, chunk_bytes, overlap = opts["param_update_in_fp32"], opts["chunk_bytes"], self.overlap
        slots = self.slots = slots[::-1]  # backward lands the last ones first; those stepped here (set_owner)
        self._slot = {id(s.param): s for s in slots}
        self.params = [s.param for s in slots]  # the host-stepped parameters, in step order
        mdt = [torch.float32 if fp32 and s.local.is_floating_point() else s.local.dtype for s in slots]
        numels = [s.local.numel() for s in slots]
        self.pin_grads = opts["pin_cpu_grads"] and side.can_pin
        staged = [i for i, s in enumerate(slots) if mdt[i] != s.local.dtype]  # bf16 staging of fp32 masters
        masters = carve(numels + [numels[i] for i in staged], mdt + [slots[i].local.dtype for i in staged],
                        pin=opts["pin_cpu_params"] and side.can_pin, what="host masters")
        bufs = [carve(numels, mdt, pin=self.pin_grads, what="gradient buffers") for _ in range(1 + self.delayed)]
        with torch.no_grad():
            for i, s in enumerate(slots):
                s.inner = s.master = masters[i].view(s.local.shape)
                s.bufs = [b[i].view(s.local.shape) for b in bufs]
                s.master.copy_(s.local)
            for j, i in enumerate(staged):
                slots[i].staging = masters[len(slots) + j].view(slots[i].local.shape)
        impl, split = impl_for(cls, impl, host=True)
        sizes = [s.master.numel() * s.master.element_size() for s in slots]
        self.chunks: list[Chunk] = []
        for ci, (idx, serial) in enumerate(split_serial(make_chunks(sizes, chunk_bytes), numels, sizes, chunk_bytes)):
            for i in idx:
                slots[i].chunk = ci
            opt = sub_optimizer(cls, groups, [slots[i] for i in idx], impl, split)
            self.chunks.append(Chunk([slots[i] for i in idx], opt, serial))
        self.d2h, self.h2d = (side.new_stream(), side.new_stream()) if overlap else (None, None)
        self.closed = self.device_done = self.sharded = False  # device_done: Note [Failed steps]
        self._owned = [True] * len(self.chunks)  # per chunk: this process steps it (set_owner)
        self._buf = self._seq = 0
        self._begun = self._applying = self._retry = False
        self._jobs: dict[int, tuple] = {}  # delayed mode: _run's arguments of chunks submitted, not finished
        self._applied: set[int] = set()  # delayed mode: parameters whose weights this call wrote
        self._lock = threading.Lock()  # delayed mode: the worker and step() on Chunk.pending, _applying
        self._skip: frozenset = frozenset()  # delayed mode: slots whose weights the user replaced
        taken = [s for s in slots if (o := _owner(s.param)) is not None and not o.closed]
        for k in [k for k, (p, _) in _OWNERS.items() if p() is None]:
            del _OWNERS[k]
        _OWNERS.update((id(s.param), (weakref.ref(s.param), weakref.ref(self))) for s in slots)
        if taken:
            warnings.warn(f"HybridDeviceOptimizer: {len(taken)} of its host-stepped parameters belong to another "
                          "HybridDeviceOptimizer that is still alive and not closed. This one takes over their "
                          "gradient hooks; the older one copies their gradients at its own step() from now on. When "
                          "an optimizer replaces another, call old.close().", UserWarning, stacklevel=3)
        self._hooks = [s.param.register_post_accumulate_grad_hook(functools.partial(_on_grad, weakref.ref(self)))
                       for s in slots if overlap and s.param.requires_grad and not self.batched(s.param)]
        self._worker: Optional[CpuWorker] = None
        if overlap and (self.in_backward or self.delayed):
            self._worker = CpuWorker(threads, functools.partial(side.bind_thread, self.h2d))
            weakref.finalize(self, CpuWorker.close, self._worker)

    # ------------------------------------------------------------------ lookups and sharding
    def is_host(self, p: torch.Tensor) -> bool:
        return id(p) in self._slot

    def chunk_tensors(self) -> list[list[torch.Tensor]]:
        """The model's tensors of each host chunk, in chunk order."""
        return [[s.local for s in c.slots] for c in self.chunks]

    def batched(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is copied at ``step()`` with the tiny ones (Note [Tiny gradients at step()])."""
        return not self.in_backward and self._slot[id(p)].local.numel() < BATCHED_NUMEL

    def set_owner(self, owned: list[bool]) -> None:
        """Step here only the chunks marked ``True`` (another process steps the rest); ``slots`` keeps theirs."""
        if self.sharded:
            raise OffloadError("HybridDeviceOptimizer: its host step is already sharded (attach the optimizer once).")
        self.sharded, self._owned = True, list(owned)
        self.slots = [s for s in self.slots if self._owned[s.chunk]]

    def steps_here(self, p: torch.Tensor) -> bool:
        """True when this process steps host parameter ``p``."""
        return self._owned[self._slot[id(p)].chunk]

    # ------------------------------------------------------------------ gradients
    def remove_grad_hooks(self) -> None:
        """Remove the gradient hooks; gradients are then copied at ``step()`` or by :meth:`grad_ready`."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def grad_ready(self, p: torch.Tensor) -> bool:
        """Start the D2H of host parameter ``p``'s current gradient (what its hook does in backward);
        False when there is none or another process steps ``p``."""
        s = self._slot[id(p)]
        g = local_grad(p)
        if g is None or not self.steps_here(p):
            return False
        if g.layout is not torch.strided:  # raised in backward, not in the worker
            raise _sparse(s, g)
        with torch.no_grad():
            if self.in_backward:
                if s.state is S.SUBMITTED or s.state is S.STEPPED:
                    raise OffloadError(
                        f"HybridDeviceOptimizer: step_in_backward=True saw a second gradient for parameter {s.index} "
                        f"of param group {s.group} after its chunk was stepped (accumulation, tied weights, or no "
                        "step() since the last backward). Use step_in_backward=False for this training loop.")
                self._prepare()
            s.ready_ev = self.side.record(self.side.current_stream())
            self.side.wait_event(self.d2h, s.ready_ev)
            self._copy([(s, g)], self.d2h)
            if self.in_backward:
                c = self.chunks[s.chunk]
                c.landed += 1
                if c.landed == c.trainable:
                    self._submit(s.chunk, None)
        return True

    def uncopied(self, skip_batched: bool = False) -> int:
        """How many host gradients of this process ``step()`` would copy now (``skip_batched``: not the tiny ones)."""
        return sum(1 for s in self.slots if s.param.grad is not None and not (skip_batched and self.batched(s.param))
                   and not s.copied(local_grad(s.param)))

    def forget_copy(self, p: Optional[torch.Tensor] = None) -> None:
        """Make ``step()`` copy ``p``'s gradient (all: ``None``) again: it changed where versions do not
        show (``GradScaler.unscale_``, ``torch._foreach_*`` on DTensors)."""
        for s in (self._slot[id(p)],) if p is not None else self.slots:
            if s.state is S.COPIED and local_grad(s.param) is not None:
                s.grad_ref = None

    def _copy(self, todo: list[tuple[Slot, torch.Tensor]], stream: Any) -> None:
        """Enqueue the D2H of each gradient into its slot's buffer on ``stream``, under one event; refused,
        before any buffer changes, for a slot whose chunk is submitted or stepped."""
        for s, _ in todo:
            if s.state is S.SUBMITTED or s.state is S.STEPPED:  # stepped in backward, or by a step() that raised
                what = f"HybridDeviceOptimizer: the gradient of parameter {s.index} of param group {s.group} was"
                raise OffloadError(
                    f"{what} modified (clipping, unscaling) after step_in_backward=True stepped it in backward, which "
                    "is not undone. Use the default mode for a loop that transforms gradients." if self.in_backward
                    else f"{what} changed after the step() that raised had stepped it (see that error's "
                    "untouched_params). Retry step() before the next backward, or call zero_grad() to leave the "
                    "failed step unfinished.")
        side = self.side
        with side.use(stream):
            for s, g in todo:
                buf = s.bufs[self._buf]
                if self.offload_grads and s.state is S.COPIED:  # the buffer holds earlier micro-batches: add
                    if s.scratch is None:
                        s.scratch = torch.empty(g.shape, dtype=g.dtype, pin_memory=self.pin_grads)
                    s.scratch.copy_(g, non_blocking=True)
                    side.synchronize(side.record(stream))  # also the earlier copy (Note [One D2H stream])
                    self._apply_scales(s, buf, s.scales)  # each micro-batch keeps its own clip coefficient: c*g0 + g1
                    buf.add_(s.scratch) if buf.dtype == g.dtype else buf.copy_(buf.to(g.dtype).add_(s.scratch))
                else:
                    buf.copy_(g, non_blocking=True)
                    s.scales = []  # the buffer holds g alone: coefficients already in g are not applied again
            ev = side.record(stream)
        for s, g in todo:
            s.state = S.COPIED
            s.unscaled[self._buf] = False
            s.d2h_ev, s.seq, self._seq = ev, self._seq, self._seq + 1
            s.grad_ref = weakref.ref(s.param.grad)
            s.grad_ver, s.grad_ptr = g._version, g.data_ptr()
            if self.offload_grads:
                # Note [Gradient residency]: the copy may be in flight when g is freed here; record_stream keeps
                # the allocator from reusing its block, and nothing blocks the backward thread. A gradient left
                # on the device is read again only after step() waited for its copy (a new or changed one is
                # copied again), so it needs none.
                if stream is not None:
                    g.record_stream(stream)
                s.param.grad = None

    def _apply_scales(self, s: Slot, buf: torch.Tensor, coefs: list) -> None:
        """Multiply ``buf`` by each of ``coefs`` (after its event) as the device would a grad of ``s``'s dtype."""
        for coef, ev in coefs:
            self.side.synchronize(ev)
            buf.mul_(coef) if buf.dtype == s.local.dtype else buf.copy_(buf.to(s.local.dtype).mul_(coef))
        coefs.clear()  # applied once: the slot's pending list is emptied

    def _collect(self, stream: Any) -> list[int]:
        """At ``step()``: copy the gradients the hooks did not copy or that changed since; return the chunks
        with gradients to step, in the order their last D2H was issued (Note [Host chunk order]: chunks are
        independent, so any order gives the same bits)."""
        todo, last = [], {}
        for s in self.slots:
            g = local_grad(s.param)
            if s.state is S.SUBMITTED or s.state is S.STEPPED:  # stepped; a changed gradient: _copy refuses it
                if g is not None and not s.copied(g):
                    todo.append((s, g))
            elif g is None:
                if s.state is S.COPIED and not self.offload_grads:
                    s.state = S.EMPTY  # p.grad was dropped after the copy
            elif g.layout is not torch.strided:
                raise _sparse(s, g)
            elif not s.copied(g):
                todo.append((s, g))
            if s.state is S.COPIED:
                last[s.chunk] = max(last.get(s.chunk, -1), s.seq)
        if todo:  # Note [Tiny gradients at step()]: one stream switch and one event for all
            self._copy(todo, stream)
            last.update((s.chunk, s.seq) for s, _ in todo)  # the newest copies, in increasing order
        return sorted(last, key=last.__getitem__)

    # ------------------------------------------------------------------ the step
    def step(self, device_step: Callable[[Optional[AmpStep]], None], amp_begin: Callable[[], Any]) -> None:
        """One step of both halves; ``device_step(amp)`` steps the device half (Note [Host step lifecycle])."""
        side = self.side
        cur = side.current_stream()
        self._applied.clear()
        try:
            start = side.record(cur) if self.overlap else None
            side.wait_event(self.d2h, start)
            side.wait_event(self.h2d, start)
            if self.delayed:
                self._apply_previous()
            amp = amp_begin()
            self._prepare()
            if amp is None or not amp.skip:  # Note [GradScaler]: an inf/NaN step steps nothing
                with _label("HybridDeviceOptimizer.d2h"):
                    order = self._collect(self.d2h if self.overlap else cur)
                if not self.device_done:
                    with _label("HybridDeviceOptimizer.device_step"):
                        device_step(amp)
                    self.device_done = True
                if self._worker is not None:
                    for ci in order:
                        self._submit(ci, amp)
                    if not self.delayed:
                        self._drain()
                else:
                    if not self.overlap:
                        side.synchronize(side.record(cur))
                    with num_threads(self.threads), side.use(self.h2d):  # Note [H2D ordering]
                        for ci in order:
                            self._run(ci, self._plan(ci), self._buf, amp)
        except BaseException:
            self._end(cur, failed=True)
            raise
        self._end(cur, failed=False)

    def _prepare(self) -> None:
        if not self._begun:  # once per step: the optimizer syncs hyper-parameters, state and masters
            self._begun = True
            self._begin()()

    def _drain(self) -> None:
        """Wait for the worker; on a failure the chunks it did not step keep their gradients."""
        try:
            if self._worker is not None:
                self._worker.drain()
        finally:
            for s in self.slots:
                if s.state is S.SUBMITTED:
                    s.state = S.COPIED  # its chunk did not step: the gradient stays for a retry

    # Note [Consumed gradients]: with offload_gradients model.zero_grad() cannot reach the host copy,
    # so step() consumes it and the next backward starts from zero.
    def _end(self, cur: Any, *, failed: bool) -> None:
        if failed and not self.delayed:
            with contextlib.suppress(BaseException):  # the error raised is the first one
                self._drain()  # first: the worker's last H2Ds are enqueued before the event below
        self.side.wait_event(cur, self.side.record(self.h2d))  # also the H2D of chunks that did step
        if not failed:
            for s in self.slots:
                if s.state is not S.EMPTY:
                    s.state, s.grad_ref, s.scales = S.CONSUMED, None, []
            self.device_done = False
            self._buf ^= self.delayed
        for c in self.chunks:  # step_in_backward's count of landed gradients
            c.landed = 0
        self._begun = False

    def _plan(self, ci: int) -> tuple[list[Slot], Any, list]:
        """What chunk ``ci`` steps, captured now: its slots with a gradient, the D2H event of the last one
        copied (Note [One D2H stream]), and the clip coefficients pending per slot."""
        slots = [s for s in self.chunks[ci].slots if s.state is S.COPIED]  # one at least: why ci is stepped
        for s in slots:
            s.state = S.SUBMITTED
        return slots, max(slots, key=lambda s: s.seq).d2h_ev, [(s, s.scales) for s in slots if s.scales]

    def _submit(self, ci: int, amp: Optional[AmpStep]) -> None:
        args = (ci, self._plan(ci), self._buf, amp)
        if self.delayed:
            self._jobs[ci] = args
        self._worker.submit(functools.partial(self._run, *args))

    def _run(self, ci: int, plan: tuple[list[Slot], Any, list], buf: int, amp: Optional[AmpStep]) -> None:
        """Host step of chunk ``ci`` with gradient buffer ``buf``, grad mode off and the H2D stream current
        (the training thread in the default mode, else the worker)."""
        side, c = self.side, self.chunks[ci]
        slots, ev, scales = plan
        side.synchronize(c.h2d_ev)  # delayed mode: the last update's H2D reads the masters and staging
        side.synchronize(ev)
        if len(slots) != len(c.slots):  # torch steps the tensors that have a .grad
            for s in c.slots:
                s.master.grad = None
        for s in slots:  # the buffer stays the master's .grad between steps: set only when it changes
            if s.master.grad is not s.bufs[buf]:
                s.master.grad = s.bufs[buf]
        for s, coefs in scales:  # the slot's pending list as _plan saw it: emptied once in the buffer
            self._apply_scales(s, s.bufs[buf], coefs)
        if takes_scale(c.opt, amp) is False:
            for s in slots:
                if not s.unscaled[buf]:
                    self._apply_scales(s, s.bufs[buf], [(amp.host_inv, None)])  # Note [GradScaler]: unscale_
                    s.unscaled[buf] = True
        with _label("HybridDeviceOptimizer.host_chunk"), num_threads(1) if c.serial else _NULL:
            amp_step(c.opt, amp, host=True)
        for s in slots:
            if s.staging is not None:
                s.staging.copy_(s.master)
        if not self.delayed:
            for s in slots:
                s.state = S.STEPPED  # from SUBMITTED: nothing else moves a slot while its chunk is submitted
            return self._h2d(c, slots)
        self._jobs.pop(ci, None)
        with self._lock:
            if self._applying:  # step() has begun (backward is over): the weights may change now
                self._h2d(c, slots)
            else:
                c.pending = slots

    def _h2d(self, c: Chunk, slots: list[Slot]) -> None:
        """Enqueue the H2D of ``slots`` on the current stream, the H2D stream (Note [H2D ordering]: an H2D must
        follow the parameter's last use: step() makes the H2D stream wait at its entry; with step_in_backward,
        whose chunks may step during backward, it also waits on each gradient-ready event)."""
        slots = [s for s in slots if s not in self._skip]
        for s in slots:
            if self.in_backward:
                self.side.wait_event(self.h2d, s.ready_ev)
            s.local.copy_(s.staging if s.staging is not None else s.master, non_blocking=True)
            s.p_ver = s.param._version
        if self.delayed:
            self._applied.update(s.flat for s in slots)
            c.h2d_ev = self.side.record(self.h2d)

    def _apply_previous(self, skip_written: bool = True) -> None:
        """Delayed mode: put the previous step's host update into the model (finished chunks now, the
        others as the worker steps them); weights written since the last step win."""
        if skip_written:
            self._skip = frozenset(s for s in self.slots if s.param._version != s.p_ver)
        with self._lock, torch.no_grad(), self.side.use(self.h2d):
            self._applying = True
            for c in self.chunks:
                if c.pending:
                    self._h2d(c, c.pending)
                    c.pending = []
            if self._retry:  # Note [Failed steps]: a failed chunk runs again, first
                self._retry = False
                for args in list(self._jobs.values()):
                    self._worker.submit(functools.partial(self._run, *args))
        try:
            self._worker.drain()
        except BaseException:
            self._retry = True
            raise
        finally:
            with self._lock:
                self._applying = False
            self._skip = frozenset()

    def untouched(self) -> list[int]:
        """Flat indices of the host parameters the failed call has not updated (delayed mode: whose
        weights it has not written)."""
        if self.delayed:
            return [s.flat for s in self._slot.values() if s.flat not in self._applied]
        return [s.flat for s in self._slot.values() if s.state is not S.STEPPED]

    def flush(self) -> None:
        """Finish host work in flight; in delayed mode also put the pending update into the model."""
        if not self.delayed:
            return self._drain()
        side, cur = self.side, self.side.current_stream()
        self._applied.clear()
        side.wait_event(self.h2d, side.record(cur))
        try:
            self._apply_previous(skip_written=False)
        finally:
            side.wait_event(cur, side.record(self.h2d))

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop the host copies (with ``offload_gradients`` and ``set_to_none=False`` a held gradient
        becomes zero, as torch keeps a zero ``p.grad``)."""
        if self.in_backward and any(s.state is S.SUBMITTED or s.state is S.STEPPED for s in self.slots):
            raise OffloadError("HybridDeviceOptimizer.zero_grad: step_in_backward=True stepped host chunks in the last "
                               "backward, so this step cannot be skipped. Call step() to finish it, or use "
                               "step_in_backward=False in a loop that skips steps.")
        self.device_done = False
        for c in self.chunks:
            c.landed = 0
        keep = self.offload_grads and not set_to_none
        for s in self.slots:
            if keep and s.state is not S.EMPTY and local_grad(s.param) is None:
                self.side.synchronize(s.d2h_ev)
                s.bufs[self._buf].zero_()
                s.state = S.COPIED
                s.unscaled[self._buf] = False
            else:
                s.state = S.EMPTY
            s.grad_ref, s.scales = None, []

    # ------------------------------------------------------------------ clipping
    def held_grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The host-held gradient of ``p`` (``offload_gradients``, no device gradient), clip
        coefficients applied; ``None`` when the device holds it or there is none."""
        s = self._slot.get(id(p))
        if s is None or s.state is not S.COPIED or local_grad(p) is not None or not self.offload_grads:
            return None
        self.side.synchronize(s.d2h_ev)
        self._apply_scales(s, s.bufs[self._buf], s.scales)
        return s.bufs[self._buf]

    @contextlib.contextmanager
    def scaling(self, coef: torch.Tensor) -> Iterator[None]:
        """Around the in-place multiply of the device gradients by ``coef``: their host copies (and the
        host-held gradients) get the same fp32 multiply before their step."""
        side = self.side
        live = [s for s in self.slots if s.state is S.COPIED]
        copied = [s for s in live if (g := local_grad(s.param)) is not None and s.copied(g)]
        held = [s for s in live if local_grad(s.param) is None and self.offload_grads]
        if copied or held:
            host = torch.empty((), dtype=coef.dtype, pin_memory=side.can_pin)
            host.copy_(coef, non_blocking=True)
            ev = side.record(side.current_stream())
            for s in (*copied, *held):
                s.scales.append((host, ev))
        if self.d2h is not None:  # the multiply must not race a D2H of the same gradient still in flight
            side.current_stream().wait_stream(self.d2h)
        yield
        for s in copied:
            s.grad_ver = local_grad(s.param)._version  # the copy and its coefficient equal the new gradient

    # ------------------------------------------------------------------ masters
    def note_written(self) -> None:
        """The current values of the host parameters are no user's load (e.g. broadcast from their owner):
        their masters are not re-seeded from them."""
        for s in self.slots:
            s.p_ver = s.param._version

    def push_masters(self) -> None:
        """Delayed mode: write every host master into the model now (after a load)."""
        with torch.no_grad():
            for ci, c in enumerate(self.chunks):
                c.pending = list(c.slots) if self._owned[ci] else []
                for s in c.pending:
                    if s.staging is not None:
                        s.staging.copy_(s.master)
        self.flush()

    def close(self) -> None:
        """Remove the hooks and stop the worker (idempotent)."""
        self.closed = True
        self.remove_grad_hooks()
        if self._worker is not None:
            self._worker.close()
