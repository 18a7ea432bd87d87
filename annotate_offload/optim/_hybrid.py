"""``HybridDeviceOptimizer``: a fraction of the parameters is stepped on the host (private module).

The optimizer, a ``torch.optim.Optimizer``, is a device sub-optimizer plus a :class:`HostPipeline`, the host half.

Note [Host step lifecycle] (one host-stepped parameter, overlap on):

1. backward: its post-accumulate-grad hook records a *ready* event on the compute stream; the D2H stream waits on it
   and copies the gradient into the slot's pinned buffer, noting tensor and version (EMPTY/CONSUMED -> COPIED).
2. ``step()`` copies a gradient never copied, or changed since (clipping, unscaling), and queues the device half; then
   each chunk, in the order its gradients landed, waits for its D2H, is stepped by its host optimizer (COPIED ->
   SUBMITTED -> STEPPED), fills the bf16 staging of a bf16 model and enqueues its H2D on the H2D stream.
3. ``step()`` returns once the compute stream waits on the last H2D (at entry the H2D stream waited for the compute
   stream), so no forward reads a stale weight; the gradients are consumed (-> CONSUMED, Note [Consumed gradients]).

Note [Failed steps]: a unit of work (the device optimizer, a host chunk) completes or leaves its parameters untouched.
After an error ``step()`` keeps what it did (``device_done``, STEPPED slots) and the others' gradients (SUBMITTED ->
COPIED): a retry steps each untouched parameter once. A buffer is scaled once per gradient: a chunk empties the clip
coefficients it applied and marks GradScaler's unscale (``Slot.unscaled``). A delayed-mode chunk of step ``t`` runs
during step ``t + 1``; a failed one keeps its arguments, and the next ``step()`` or ``flush()`` runs it first.

Note [GradScaler]: ``GradScaler.unscale_`` rescales ``p.grad`` in place without bumping its version, so a host copy
would look current while still scaled. The optimizer therefore declares ``_step_supports_amp_scaling`` (torch's fused
optimizers' contract): ``GradScaler.step`` sets ``grad_scale`` and ``found_inf`` instead. A step with ``found_inf``
steps nothing; otherwise each sub-optimizer gets the scale as torch's fused optimizers do, or GradScaler's own unscale
first when its class lacks the support: bit-identical to the same class under GradScaler. After ``scaler.unscale_``
every host copy is made again. ``offload_gradients`` and ``step_in_backward`` miss the inf check: refused.

Note [Validated loads]: torch's ``Optimizer.load_state_dict`` checks only counts, and a moment of the wrong shape
reaches the fused kernel, which reads or writes out of bounds. ``_check_load`` checks everything against what
the class itself creates (:func:`_probe`) and builds the converted state aside: a refused load changes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import inspect
import math
import operator
import os
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import torch
from torch.profiler import record_function
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import OffloadError

__all__ = ["HybridDeviceOptimizer"]


def local_tensor(p: Optional[torch.Tensor]) -> Any:
    """The tensor this rank stores for ``p`` (``p`` itself, ``None`` included, or a DTensor's local shard)."""
    return p.to_local() if type(p).__name__ == "DTensor" and hasattr(p, "to_local") else p


class Placement(NamedTuple):
    """Where one parameter is stepped (``HybridDeviceOptimizer.placements``)."""

    group: int  # index in param_groups
    index: int  # index in that group's params
    shape: tuple  # local shape
    numel: int  # local element count
    side: str  # "cpu" (host optimizer) or "gpu" (device optimizer)
    chunk: int  # host chunk (and index in cpu_optimizers), -1 on the device side


def choose_offloaded(params: list[torch.Tensor], fraction: float, cuda: bool) -> list[bool]:
    """Per parameter, in param-group order: ``True`` where it is stepped on the host.

    Split rule (Megatron-Core's): whole tensors; the budget is ``fraction`` times the numel of the trainable
    device-resident parameters (all of them without ``cuda``); walk the parameters in param-group order and offload
    one while the numel offloaded so far is below the budget (the last one may overshoot by one tensor). Parameters
    already on the host always go to the host side and do not count; frozen ones are never offloaded. A DTensor (FSDP2
    shard) counts and is stepped through its local shard (:func:`local_tensor`), so each rank offloads its own shards.
    """
    on_device = [not cuda or local_tensor(p).is_cuda for p in params]
    budget = fraction * sum(local_tensor(p).numel() for p, d in zip(params, on_device) if p.requires_grad and d)
    done, out = 0, []
    for p, d in zip(params, on_device):
        out.append(p.requires_grad and (not d or done < budget))
        if out[-1] and d:
            done += local_tensor(p).numel()
    return out


def make_chunks(sizes_bytes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Group consecutive items (in step order) into chunks of about ``chunk_bytes``; tensors are never split. An item
    that would overflow the current chunk starts a new one only if the current one is at least half full, so a bias in
    front of a chunk-sized weight joins it (each chunk costs a host optimizer call and a thread fork/join)."""
    chunks: list[list[int]] = []
    used = 0  # bytes in the last chunk
    for i, b in enumerate(sizes_bytes):
        if not chunks or used + b > chunk_bytes and 2 * used >= chunk_bytes:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += b
    return chunks


# Note [Serial small tensors]: torch's fused CPU AdamW runs one OpenMP parallel region per tensor, whatever its size,
# so a 2048-element norm weight wakes the whole thread team, and one descheduled thread stalls the region for a
# scheduler slice. Tensors under ``SERIAL_NUMEL`` elements are stepped in chunks of their own with one thread.
SERIAL_NUMEL = 1 << 16
SERIAL_CHUNK_BYTES = 1 << 20


def split_serial(groups: list[list[int]], numels: list[int], sizes_bytes: list[int],
                 chunk_bytes: int) -> list[tuple[list[int], bool]]:
    """Split the chunks of :func:`make_chunks` into ``(indices, serial)`` chunks, order preserved: each
    chunk's large tensors stay one chunk; its small ones collect, across chunks, into serial chunks that
    close at ``min(chunk_bytes, SERIAL_CHUNK_BYTES)`` (Note [Serial small tensors])."""
    out: list[tuple[list[int], bool]] = []
    small: list[int] = []
    for g in groups:
        if big := [i for i in g if numels[i] >= SERIAL_NUMEL]:
            out.append((big, False))
        small += [i for i in g if numels[i] < SERIAL_NUMEL]
        if small and sum(sizes_bytes[i] for i in small) >= min(chunk_bytes, SERIAL_CHUNK_BYTES):
            out.append((small, True))
            small = []
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

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def bind_thread(self, stream: Any) -> None:
        """Make this thread use the device, and ``stream`` (a stream of that device) as its current stream."""
        if self.cuda:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(stream)

    @staticmethod
    def use(stream: Any) -> Any:  # ops run on their tensors' device: set only the stream (torch.cuda.stream: slower)
        return _NULL if stream is None else swapped(lambda: torch.cuda.current_stream(stream.device),
                                                    torch.cuda.set_stream, stream)

    record = staticmethod(lambda stream: stream.record_event() if stream is not None else None)
    wait_event = staticmethod(lambda stream, event: stream is None or event is None or stream.wait_event(event))
    synchronize = staticmethod(lambda event: event is None or event.synchronize())


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


# Note [Thread budget]: the host step uses the intra-op thread pool, and ``torchrun`` sets ``OMP_NUM_THREADS=1``
# with several processes per node, so the budget ignores it: ``cpu_threads`` if given, else usable CPUs //
# LOCAL_WORLD_SIZE, less one core (from four up) for the training thread beside a worker (step_in_backward,
# delayed_param_update). Counts are per thread: the worker sets its own, the default mode sets one for the host step.
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
def swapped(get: Callable[[], Any], put: Callable[[Any], Any], value: Any) -> Iterator[None]:
    """Run the body with ``put(value)`` in effect, then put back what ``get()`` returned."""
    old = get()
    put(value)
    try:
        yield
    finally:
        put(old)


num_threads = functools.partial(swapped, torch.get_num_threads, torch.set_num_threads)  # (n): n threads in the body


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
# Note [One D2H stream]: every gradient copy goes to one stream (the D2H stream; without overlap the compute stream,
# synchronised before the host step), so the event of a chunk's last copy covers all its copies: one wait per chunk.
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
                 "p_ver", "seq", "state", "st", "seen", "unscaled")

    def __init__(self, param: torch.Tensor, flat: int, group: int, index: int, host: bool, fp32: bool) -> None:
        self.param, self.flat, self.group, self.index, self.host = param, flat, group, index, host
        self.local = loc = local_tensor(param)  # the tensor the model reads (its local shard for a DTensor)
        wide = not host and fp32 and loc.is_floating_point() and loc.dtype != torch.float32
        # inner: the tensor its sub-optimizer steps; master: a separate copy of it (host or fp32), else None
        self.inner = loc.detach().float() if wide else param if loc is param else loc.detach()
        self.master: Optional[torch.Tensor] = self.inner if wide else None
        self.opt, self.sub_group = None, {}  # its sub-optimizer and group there (set when they are built)
        self.st, self.seen = None, ()  # its state dict as last placed in the sub-optimizer; its values at the last sync
        self.bufs: list[torch.Tensor] = []  # host gradient buffers (two in delayed mode)
        self.staging: Optional[torch.Tensor] = None  # model-dtype pinned copy for the H2D
        self.scratch: Optional[torch.Tensor] = None  # landing buffer for accumulation (lazy)
        self.chunk = self.grad_ver = self.grad_ptr = self.seq = -1
        self.p_ver = param._version  # the weights' version its master holds
        self.grad_ref: Optional[weakref.ref] = None
        self.d2h_ev = self.ready_ev = None
        self.scales: list[tuple[torch.Tensor, Any]] = []  # clip coefficients pending for the buffer
        self.unscaled = [False, False]  # per buffer (the worker sets step t's, step t + 1 clears its own): unscaled
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
    """What GradScaler asked of one ``step()`` (Note [GradScaler])."""

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
                  split_complex: bool, defaults: dict[str, Any]) -> torch.optim.Optimizer:
    """One ``cls`` over ``slots`` (a group per HDO group), given the HDO's constructor values it takes (Adagrad reads
    ``initial_accumulator_value`` there); sets each slot's ``opt`` and ``sub_group``."""
    parts: dict[tuple[int, bool], list[Slot]] = {}  # (HDO group, complex in a group of its own) -> slots
    for s in slots:
        parts.setdefault((s.group, split_complex and s.inner.is_complex()), []).append(s)
    keys = sorted(parts)  # in HDO group order, a group's complex parameters after the others
    subs = [{**{k: v for k, v in hdo_groups[gi].items() if k != "params" and k not in STRUCTURAL_KEYS},
             **({"fused": None} if cplx else {}), "params": [s.inner for s in parts[gi, cplx]]} for gi, cplx in keys]
    opt = cls(subs, **{k: v for k, v in defaults.items() if k in _signature(cls)[0]}, **impl)
    for sub, key in zip(opt.param_groups, keys):
        for s in parts[key]:
            s.opt, s.sub_group = opt, sub
    return opt


# Note [One optimizer per parameter]: the newest pipeline over a parameter takes its hook from an older one, which
# copies at its step() (refused while the newer frees or steps gradients in backward); building over a live one warns.
_OWNERS = WeakIdKeyDictionary()  # param -> weakref to its owning pipeline; an entry dies with its param


def _on_grad(ref: weakref.ref, param: torch.Tensor) -> None:
    """A host parameter's post-accumulate-grad hook (holds its pipeline weakly: no cycle through C++)."""
    if (pl := ref()) is not None:
        pl.grad_ready(param)


def _sparse(s: Slot, g: torch.Tensor) -> TypeError:
    return TypeError(
        f"HybridDeviceOptimizer: parameter {s.index} of param group {s.group} (shape {tuple(s.local.shape)}) has a "
        f"sparse gradient (layout={g.layout}); host gradient buffers are dense. Use a dense embedding "
        "(nn.Embedding(..., sparse=False), the default), or torch.optim.SparseAdam outside this optimizer.")


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
            opt = sub_optimizer(cls, groups, [slots[i] for i in idx], impl, split, opts)
            self.chunks.append(Chunk([slots[i] for i in idx], opt, serial))
        self.d2h, self.h2d = [torch.cuda.Stream(side.device) if overlap and side.cuda else None for _ in range(2)]
        self.closed = self.device_done = self.sharded = False  # device_done: Note [Failed steps]
        self._owned = [True] * len(self.chunks)  # per chunk: this process steps it (set_owner)
        self._buf = self._seq = 0
        self._begun = self._applying = self._retry = self.raised = False  # raised: the last step() raised
        self._jobs: dict[int, tuple] = {}  # delayed mode: _run's arguments of chunks submitted, not finished
        self._applied: set[int] = set()  # delayed mode: parameters whose weights this call wrote
        self._lock = threading.Lock()  # delayed mode: the worker and step() on Chunk.pending, _applying
        self._skip: frozenset = frozenset()  # delayed mode: slots whose weights the user replaced
        self.taken_by: Callable[[], Any] = lambda: None  # weakly, the newer pipeline that took hooks over
        taken = [(s, o) for s in slots if (r := _OWNERS.get(s.param)) is not None and (o := r()) is not None
                 and not o.closed]
        for s, o in taken:  # Note [One optimizer per parameter]
            o.taken_by = weakref.ref(self)
            if h := o._hooks.pop(id(s.param), None):
                h.remove()
        _OWNERS.update((s.param, weakref.ref(self)) for s in slots)
        if taken:
            warnings.warn(f"HybridDeviceOptimizer: {len(taken)} of its host-stepped parameters belong to another "
                          "HybridDeviceOptimizer that is still alive and not closed; this one takes over their hooks "
                          "(the older one copies at its step()). Call old.close().", UserWarning, stacklevel=3)
        self._hooks = {id(s.param): s.param.register_post_accumulate_grad_hook(
            functools.partial(_on_grad, weakref.ref(self)))
            for s in slots if overlap and s.param.requires_grad and not self.batched(s.param)}
        self._worker: Optional[CpuWorker] = None
        if overlap and (self.in_backward or self.delayed):
            self._worker = CpuWorker(threads, functools.partial(side.bind_thread, self.h2d))
            weakref.finalize(self, CpuWorker.close, self._worker)

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

    def remove_grad_hooks(self) -> None:
        """Remove the gradient hooks; gradients are then copied at ``step()`` or by :meth:`grad_ready`."""
        for h in self._hooks.values():
            h.remove()
        self._hooks = {}

    def grad_ready(self, p: torch.Tensor) -> bool:
        """Start the D2H of ``p``'s gradient, as its hook does; False when there is none or another process steps it."""
        s = self._slot[id(p)]
        g = local_tensor(p.grad)
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
                   and not s.copied(local_tensor(s.param.grad)))

    def forget_copy(self, p: Optional[torch.Tensor] = None) -> None:
        """Make ``step()`` copy ``p``'s gradient (all: ``None``) again: it changed where versions do not
        show (``GradScaler.unscale_``, ``torch._foreach_*`` on DTensors)."""
        for s in (self._slot[id(p)],) if p is not None else self.slots:
            if s.state is S.COPIED and s.param.grad is not None:
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
        with self.side.use(stream):
            plain = [(s.bufs[self._buf], g) for s, g in todo if not (self.offload_grads and s.state is S.COPIED)]
            if len(plain) == 1:  # a gradient hook's
                plain[0][0].copy_(plain[0][1], non_blocking=True)
            elif plain:  # one call: the copies are looped in C++
                torch._foreach_copy_(*map(list, zip(*plain)), non_blocking=True)
            for s, g in todo:
                buf = s.bufs[self._buf]
                if self.offload_grads and s.state is S.COPIED:  # the buffer holds earlier micro-batches: add
                    if s.scratch is None:
                        s.scratch = torch.empty(g.shape, dtype=g.dtype, pin_memory=self.pin_grads)
                    s.scratch.copy_(g, non_blocking=True)
                    self.side.synchronize(self.side.record(stream))  # also the earlier copy (Note [One D2H stream])
                    self._apply_scales(s, buf, s.scales)  # each micro-batch keeps its own clip coefficient: c*g0 + g1
                    buf.add_(s.scratch) if buf.dtype == g.dtype else buf.copy_(buf.to(g.dtype).add_(s.scratch))
                else:
                    s.scales = []  # the buffer holds g alone: coefficients already in g are not applied again
            ev = self.side.record(stream)
        for s, g in todo:
            s.state = S.COPIED
            s.unscaled[self._buf] = False
            s.d2h_ev, s.seq, self._seq = ev, self._seq, self._seq + 1
            s.grad_ref = weakref.ref(s.param.grad)
            s.grad_ver, s.grad_ptr = g._version, g.data_ptr()
            if self.offload_grads:
                # Note [Gradient residency]: the copy may be in flight when g is freed here; record_stream keeps the
                # allocator from reusing its block, without blocking the backward thread. A gradient left on the device
                # is read again only after step() waited for its copy (a new or changed one is recopied): it needs none.
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
            g = local_tensor(s.param.grad)
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

    def step(self, device_step: Callable[[Optional[AmpStep]], None], amp_begin: Callable[[], Any]) -> None:
        """One step of both halves; ``device_step(amp)`` steps the device half (Note [Host step lifecycle])."""
        side = self.side
        cur = side.current_stream()
        self._applied.clear()
        failed = True
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
            failed = False
        finally:
            if failed and not self.delayed:
                with contextlib.suppress(BaseException):  # the error raised is the first one
                    self._drain()  # first: the worker's last H2Ds are enqueued before the event below
            side.wait_event(cur, side.record(self.h2d))  # also the H2D of chunks that did step
            # Note [Consumed gradients]: with offload_gradients model.zero_grad() cannot reach the host copy, so
            # step() consumes it and the next backward starts from zero.
            if not failed:
                for s in self.slots:
                    if s.state is not S.EMPTY:
                        s.state, s.grad_ref, s.scales = S.CONSUMED, None, []
                self.device_done = False
                self._buf ^= self.delayed
            for c in self.chunks:  # step_in_backward's count of landed gradients
                c.landed = 0
            self._begun, self.raised = False, failed

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
        for s in slots if self.in_backward else ():
            self.side.wait_event(self.h2d, s.ready_ev)
        if slots:  # one call: the copies are looped in C++
            torch._foreach_copy_([s.local for s in slots], [s.master if s.staging is None else s.staging
                                                            for s in slots], non_blocking=True)
        for s in slots:
            s.p_ver = s.param._version
        if self.delayed:
            self._applied.update(s.flat for s in slots)
            c.h2d_ev = self.side.record(self.h2d)

    def _apply_previous(self) -> None:
        """Delayed mode: put the previous step's host update into the model (finished chunks now, the
        others as the worker steps them); weights written since the last step win."""
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
        """Flat indices of host parameters the failed call left untouched (delayed mode: weights not written)."""
        return [s.flat for s in self._slot.values()
                if (s.flat not in self._applied if self.delayed else s.state is not S.STEPPED)]

    def flush(self) -> None:
        """Finish host work in flight; in delayed mode also put the pending update into the model."""
        if not self.delayed:
            return self._drain()
        side, cur = self.side, self.side.current_stream()
        self._applied.clear()
        side.wait_event(self.h2d, side.record(cur))
        try:
            self._apply_previous()
        finally:
            side.wait_event(cur, side.record(self.h2d))

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop the host copies (with ``offload_gradients`` and ``set_to_none=False`` a held gradient
        becomes zero, as torch keeps a zero ``p.grad``)."""
        unfinished = [s for s in self.slots if s.state is S.SUBMITTED or s.state is S.STEPPED and not self.raised]
        if self.in_backward and unfinished:
            raise OffloadError("HybridDeviceOptimizer.zero_grad: step_in_backward=True stepped chunks in backward, so "
                               "this step cannot be skipped. Call step(), or skip steps with step_in_backward=False.")
        self.device_done = self.raised = False
        for c in self.chunks:
            c.landed = 0
        keep = self.offload_grads and not set_to_none
        for s in self.slots:
            if keep and s.state is not S.EMPTY and s.param.grad is None:
                self.side.synchronize(s.d2h_ev)
                s.bufs[self._buf].zero_()
                s.state = S.COPIED
                s.unscaled[self._buf] = False
            else:
                s.state = S.EMPTY
            s.grad_ref, s.scales = None, []

    def held_grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """``p``'s host-held gradient (``offload_gradients``) in its dtype, clip coefficients applied; else None."""
        s = self._slot.get(id(p))
        if s is None or s.state is not S.COPIED or p.grad is not None or not self.offload_grads:
            return None
        self.side.synchronize(s.d2h_ev)
        self._apply_scales(s, buf := s.bufs[self._buf], s.scales)
        return buf if buf.dtype == s.local.dtype else buf.to(s.local.dtype)  # fp32 masters: the gradient's dtype

    @contextlib.contextmanager
    def scaling(self, coef: torch.Tensor) -> Iterator[None]:
        """Around the in-place multiply of the device gradients by ``coef``: their host copies (and the
        host-held gradients) get the same fp32 multiply before their step."""
        live = [s for s in self.slots if s.state is S.COPIED]
        copied = [s for s in live if (g := local_tensor(s.param.grad)) is not None and s.copied(g)]
        held = [s for s in live if s.param.grad is None and self.offload_grads]
        if copied or held:
            host = torch.empty((), dtype=coef.dtype, pin_memory=self.side.can_pin).copy_(coef, non_blocking=True)
            ev = self.side.record(self.side.current_stream())
            for s in (*copied, *held):
                s.scales.append((host, ev))
        if self.d2h is not None:  # the multiply must not race a D2H of the same gradient still in flight
            self.side.current_stream().wait_stream(self.d2h)
        yield
        for s in copied:
            s.grad_ver = local_tensor(s.param.grad)._version  # the copy and its coefficient equal the new gradient

    def note_written(self) -> None:
        """The host parameters' current values are no user's load (a broadcast from their owner): no re-seed."""
        for s in self.slots:
            s.p_ver = s.param._version

    def push_masters(self) -> None:
        """Delayed mode: write every host master into the model now (after a load)."""
        for ci, c in enumerate(self.chunks):  # masters and staging need no grad mode
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


_CLASS_KEYS = ("cpu_optimizer_cls", "gpu_optimizer_cls")
# accelerator-only implementations: they do not run on host tensors (TE's FusedAdam corrupts them silently)
_GPU_ONLY = ("apex", "transformer_engine", "deepspeed.ops.adam.fused_adam", "deepspeed.ops.lamb")


def _name(cls: type) -> str:
    mod = "torch.optim" if cls.__module__.startswith("torch.optim.") else cls.__module__
    return f"{mod}.{cls.__qualname__}"


def _signature(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """The keyword parameters of ``cls.__init__`` and whether it takes ``**kwargs``."""
    prms = inspect.signature(cls.__init__).parameters.items()
    named = {k: p for k, p in prms if k not in ("self", "params") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named, any(p.kind is p.VAR_KEYWORD for _, p in prms)


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Adam(W)/SGD with a fraction of the parameters stepped on the host, pipelined with the GPU.

    Megatron-Core's ``HybridDeviceOptimizer``, same signature and meaning: the first ``offload_fraction`` of the
    trainable parameters (numel, whole tensors, param-group order: ``placements``) are stepped by
    ``cpu_optimizer_cls`` on host masters (one instance per chunk of about ``chunk_bytes``: ``cpu_optimizers``), the
    rest by ``gpu_optimizer_cls`` (``gpu_optimizer``). Results are the sub-optimizer classes' on the same inputs:
    bit-identical to ``torch.optim.AdamW(params, fused=True)`` on a CPU-only machine.

    Args:
        params (iterable): parameters or param groups; CUDA parameters of one device, CPU ones (stepped
            on the host), DTensors (FSDP2) through their local shards.
        offload_fraction (float): host share of the trainable device numel, in ``[0, 1]``. Default: ``0.5``.
        cpu_optimizer_cls (type | None): host class. Default: ``torch.optim.AdamW``.
        gpu_optimizer_cls (type | None): device class. Default: the host class.
        param_update_in_fp32 (bool): fp32 masters for non-fp32 parameters. Default: ``False``.
        pin_cpu_grads (bool): page-lock host gradient buffers. Default: ``True``.
        pin_cpu_params (bool): page-lock host masters and the bf16 staging. Default: ``True``.
        overlap_cpu_optimizer_d2h_h2d (bool): D2H in backward hooks, H2D of each chunk while the next is
            stepped; ``False`` copies everything at ``step()`` and syncs. Default: ``True``.
        offload_gradients (bool): free each host-stepped gradient on the device once its D2H is enqueued;
            ``clip_grad_norm_`` of this optimizer (not torch's) sees it. Default: ``False``.
        step_in_backward (bool): step each host chunk in a worker thread once its gradients landed in
            backward; one backward per step, no clipping. Default: ``False``.
        delayed_param_update (bool): ZeRO-Offload's one-step-delayed host update, run in a worker during
            the next forward and backward (changes numerics; :meth:`flush` lands it). Default: ``False``.
        use_torch_optimizer_for_cpu_offload (bool): the host class for the GPU part too. Default: ``False``.
        cpu_threads (int | None): host step threads, at most the usable CPUs. Default: Note [Thread budget].
        chunk_bytes (int | None): host master bytes per chunk. Default: 128 MiB (256 MiB delayed).
        **kwargs: hyper-parameters and switches (``fused``, ``foreach``, ...) of both classes; Adam(W)
            gets ``fused=True`` unless ``foreach`` or ``differentiable`` is given.

    Raises:
        TypeError: an option of the wrong type, a keyword neither class takes, a class that cannot step
            its part (GPU-only on the host, sparse- or closure-only).
        ValueError: an option out of range or modes that do not combine, a value the class refuses (its
            message follows), a non-finite ``lr``, a parameter listed twice, several devices.

    ``state[p]`` *is* the sub-optimizer's state of ``p`` (``master_param`` where a separate master exists), empty
    before the first step. After an exception in ``step()`` each parameter is stepped or untouched; the exception's
    ``untouched_params`` (list[int]) holds the untouched ones' indices in ``param_groups`` order, and ``step()`` again
    steps exactly those, once.

    Example::

        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=3e-4)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    _step_supports_amp_scaling = True  # Note [GradScaler]

    def __init__(self, params: Iterable[Any], offload_fraction: float = 0.5, cpu_optimizer_cls: Optional[type] = None,
                 gpu_optimizer_cls: Optional[type] = None, param_update_in_fp32: bool = False,
                 pin_cpu_grads: bool = True, pin_cpu_params: bool = True, overlap_cpu_optimizer_d2h_h2d: bool = True, *,
                 offload_gradients: bool = False, step_in_backward: bool = False, delayed_param_update: bool = False,
                 use_torch_optimizer_for_cpu_offload: bool = False, cpu_threads: Optional[int] = None,
                 chunk_bytes: Optional[int] = None, **kwargs: Any) -> None:
        # ---- validate everything before touching the model
        number = isinstance(offload_fraction, (int, float)) and not isinstance(offload_fraction, bool)
        if not number or not 0 <= offload_fraction <= 1:
            raise (ValueError if number else TypeError)(
                f"HybridDeviceOptimizer: offload_fraction={offload_fraction!r}: pass the host's share, in [0, 1].")
        flags = dict(param_update_in_fp32=param_update_in_fp32, pin_cpu_grads=pin_cpu_grads,
                     pin_cpu_params=pin_cpu_params, overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
                     offload_gradients=offload_gradients, step_in_backward=step_in_backward,
                     delayed_param_update=delayed_param_update,
                     use_torch_optimizer_for_cpu_offload=use_torch_optimizer_for_cpu_offload)
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise TypeError(f"HybridDeviceOptimizer: {k}={v!r}: pass True or False.")
            if v and k in ("offload_gradients", "step_in_backward", "delayed_param_update") \
                    and not overlap_cpu_optimizer_d2h_h2d:
                raise ValueError(f"HybridDeviceOptimizer: {k}=True: pass overlap_cpu_optimizer_d2h_h2d=True too (it "
                                 "works through the hooks of the overlapped path).")
        if step_in_backward and delayed_param_update:
            raise ValueError("HybridDeviceOptimizer: step_in_backward=True, delayed_param_update=True: pick one; they "
                             "are exclusive.")
        threads = thread_budget(cpu_threads, beside_training=step_in_backward or delayed_param_update)
        if chunk_bytes is None:  # a chunk costs a host optimizer call; the last chunk's H2D follows the host step
            chunk_bytes = (256 if delayed_param_update else 128) << 20
        elif type(chunk_bytes) is not int or chunk_bytes < 1:
            raise (ValueError if type(chunk_bytes) is int else TypeError)(
                f"HybridDeviceOptimizer: chunk_bytes={chunk_bytes!r}: pass None or a positive int.")
        cpu_cls = torch.optim.AdamW if cpu_optimizer_cls is None else cpu_optimizer_cls
        gpu_cls = cpu_cls if use_torch_optimizer_for_cpu_offload or gpu_optimizer_cls is None else gpu_optimizer_cls
        for name, cls in (("cpu_optimizer_cls", cpu_cls), ("gpu_optimizer_cls", gpu_cls)):
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise TypeError(f"HybridDeviceOptimizer: {name}={cls!r}: pass a torch.optim.Optimizer subclass, e.g. "
                                "torch.optim.AdamW.")
        if cpu_cls.__module__.startswith(_GPU_ONLY):
            raise TypeError(f"HybridDeviceOptimizer: cpu_optimizer_cls={_name(cpu_cls)} only runs on the GPU, but it "
                            "would step the host part: pass torch.optim.AdamW/Adam (fused on CPU) or torch.optim.SGD.")
        self._classes = (cpu_cls, gpu_cls)
        sigs = [_signature(c) for c in self._classes]
        for k, v in kwargs.items():
            if not any(var_kw or k in sig for sig, var_kw in sigs):
                raise TypeError(f"HybridDeviceOptimizer: {k}={v!r}: remove it or use a keyword of {_name(cpu_cls)} "
                                f"({', '.join(sigs[0][0])}).")
        self._impl = {k: kwargs.pop(k) for k in IMPL_KEYS if k in kwargs}
        defaults = {k: p.default for k, p in sigs[0][0].items() if k not in IMPL_KEYS and p.default is not p.empty}
        defaults.update(kwargs, **flags, offload_fraction=float(offload_fraction), cpu_threads=cpu_threads,
                        chunk_bytes=chunk_bytes, cpu_optimizer_cls=cpu_optimizer_cls,
                        gpu_optimizer_cls=gpu_optimizer_cls)
        super().__init__(params, defaults)  # add_param_group checks each group

        # ---- split, host pipeline, device optimizer: one slot per parameter, both sides built from them
        flat = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])]
        side = Side([local_tensor(p) for _, _, p in flat])
        host = choose_offloaded([p for _, _, p in flat], float(offload_fraction), side.cuda)
        self._slots = [Slot(p, i, gi, pi, host[i], param_update_in_fp32) for i, (gi, pi, p) in enumerate(flat)]
        self.pipeline = HostPipeline([s for s in self._slots if s.host], self.param_groups, cpu_cls, self._impl,
                                     self.defaults, side=side, threads=threads, begin=self._begin)
        self.cpu_optimizers = [c.opt for c in self.pipeline.chunks]
        self.gpu_optimizer: Optional[torch.optim.Optimizer] = None
        if dev := [s for s in self._slots if not s.host]:
            self.gpu_optimizer = sub_optimizer(gpu_cls, self.param_groups, dev,
                                               *impl_for(gpu_cls, self._impl, host=False), self.defaults)
        subs = {id(s.sub_group): s for s in self._slots}.values()  # a slot per sub-optimizer group
        self._links = [[(s.sub_group, tuple(k for k in s.sub_group if k != "params" and k in g
                                            and k not in STRUCTURAL_KEYS)) for s in subs if s.group == gi]
                       for gi, g in enumerate(self.param_groups)]  # per group: what _sync_hyper copies down
        self._seen: list[list] = [[] for _ in self.param_groups]  # the group values last pushed down
        self._masters = [s for s in self._slots if not s.host and s.inner is not s.param]  # device half
        self._fresh = list(self._slots)  # slots whose state is not in self.state yet
        self._by_id = {id(s.param): s for s in self._slots}
        # Megatron-Core's maps (its DistributedOptimizer and tests read them)
        self.param_to_inner_param = {s.param: s.inner for s in self._slots}
        self.inner_param_to_orig_param = {s.inner: s.param for s in self._slots}
        self.param_to_fp32_param = {s.param: s.inner for s in self._slots if s.master is not None
                                    and s.inner.dtype == torch.float32 != s.local.dtype}
        self.gpu_params_map_cpu_copy = {s.param: s.inner for s in self._slots if s.host}
        self.cpu_copys_map_gpu_param = {s.inner: s.param for s in self._slots if s.host}
        # the tensor each parameter's update is written into (Note [Local shards] in distributed/_shards.py)
        self.param_to_local = {s.param: s.local for s in self._slots}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Used by the constructor for each group; refused afterwards (``OffloadError``: the split is fixed)."""
        if hasattr(self, "pipeline"):  # the constructor's groups are in: the split is fixed
            raise OffloadError("HybridDeviceOptimizer: add_param_group after construction is not supported (the "
                               "host/GPU split and buffers are fixed); build a new optimizer with all groups.")
        where = f" in param group {len(self.param_groups)}"
        for k in (*STRUCTURAL_KEYS, *_CLASS_KEYS) if isinstance(param_group, dict) else ():
            if k in param_group and not _same(param_group[k], self.defaults[k]):
                raise ValueError(f"HybridDeviceOptimizer: {k}={param_group[k]!r}{where}: pass it to the constructor "
                                 "and remove it from the group; it is per optimizer (this one's: "
                                 f"{self.defaults[k]!r}).")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        for k in _CLASS_KEYS:
            g.pop(k, None)
        try:
            if len({id(p) for p in g["params"]}) < len(g["params"]):
                raise ValueError(f"HybridDeviceOptimizer: param group {len(self.param_groups) - 1} lists a parameter "
                                 "twice (its host copy would be stepped twice); list each parameter once.")
            self._check_group(g["params"], g, where)
        except (TypeError, ValueError):
            self.param_groups.pop()  # nothing half-applied
            raise

    def _check_group(self, params: list[torch.Tensor], hyper: dict[str, Any], where: str) -> None:
        """Let each torch class judge its hyper-parameters: step it once (:func:`_probe`) over tensors like those it
        steps for ``params`` (host masters; device parameters or masters) and re-raise its refusal naming value and
        fix. Refused here, though torch takes them: a non-bool switch, a non-finite ``lr``."""
        lr = hyper.get("lr")
        if (type(lr) in (int, float) or torch.is_tensor(lr) and lr.numel() == 1) and not math.isfinite(float(lr)):
            raise ValueError(f"HybridDeviceOptimizer: lr={lr!r}{where}: pass a finite learning rate.")
        fp32 = self.defaults["param_update_in_fp32"]
        like = sorted({(torch.float32 if fp32 and t.is_floating_point() else t.dtype, t.device, t.dim())
                       for t in map(local_tensor, params)} or {(torch.float32, torch.device("cpu"), 1)}, key=str)
        # the host class's switches without the fused=True default, which is ours (Note [Complex parameters])
        host_impl = {k: v for k, v in impl_for(self._classes[0], self._impl, host=True)[0].items() if k in self._impl}
        for role, cls, on, impl in (("cpu_optimizer_cls", self._classes[0], sorted({(d, "cpu", n) for d, _, n in like},
                                     key=str), host_impl), ("gpu_optimizer_cls", self._classes[1], like, self._impl)):
            sig, var_kw = _signature(cls)
            kw = {k: v for k, v in {**hyper, **impl}.items()
                  if (var_kw or k in sig) and k not in ("params", "param_names", *STRUCTURAL_KEYS)}
            for k, v in kw.items():
                if not isinstance(v, bool) and (isinstance(getattr(sig.get(k), "default", None), bool) or
                                                (k in IMPL_KEYS and v is not None)):
                    raise TypeError(f"HybridDeviceOptimizer: {k}={v!r}{where}: pass True or False"
                                    f"{' or None' if k in IMPL_KEYS else ''}; {_name(cls)} takes a bool.")
            if (err := _probe(cls, kw, on)[1]) is None:
                continue
            if (base := _probe(cls, {}, on)[1]) is not None:
                raise TypeError(f"HybridDeviceOptimizer: {role}={_name(cls)}: pass a class that can step these "
                                f"parameters with step() and no closure, as this optimizer does ({base}).") from None
            k = next((k for k in kw if _probe(cls, {j: v for j, v in kw.items() if j != k}, on)[1] is None), None)
            what = f"{k}={kw[k]!r}" if k is not None else ", ".join(f"{k}={v!r}" for k, v in kw.items())
            raise (TypeError if isinstance(err, TypeError) else ValueError)(
                f"HybridDeviceOptimizer: {what}{where}: pass a value that {_name(cls)} accepts ({err}).") from None

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host optimizers (one per chunk), then the device optimizer if any (Megatron's order)."""
        return self.cpu_optimizers + ([self.gpu_optimizer] if self.gpu_optimizer is not None else [])

    @property
    def placements(self) -> list[Placement]:
        """Where each parameter is stepped, in ``param_groups`` order (see :class:`Placement`)."""
        return [Placement(s.group, s.index, tuple(s.local.shape), s.local.numel(), "cpu" if s.host else "gpu",
                          s.chunk) for s in self._slots]

    @property
    def offloaded_numel(self) -> int:
        """Elements stepped on the host."""
        return sum(s.local.numel() for s in self._slots if s.host)

    @property
    def thread_budget(self) -> int:
        """Threads of the host step (Note [Thread budget])."""
        return self.pipeline.threads

    def __repr__(self) -> str:
        n = len(self.gpu_params_map_cpu_copy)
        return (f"HybridDeviceOptimizer(offload_fraction={self.defaults['offload_fraction']}, host_params={n}, "
                f"host_numel={self.offloaded_numel}, gpu_params={len(self._slots) - n}, "
                f"chunks={len(self.cpu_optimizers)}, threads={self.thread_budget})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError("HybridDeviceOptimizer cannot be pickled or copied (torch.save(opt), copy.deepcopy(opt)): "
                           "it owns pinned buffers and hooks. Save opt.state_dict() and load it into a new one.")

    def _sync_hyper(self) -> None:
        """Push the groups' hyper-parameters (LR schedulers write ``param_groups``) into the sub-optimizers'
        groups. They share the value objects, so a group none of whose values was replaced is current."""
        own = self.defaults["delayed_param_update"]  # its host step runs after step() returns: values of its own
        for gi, g in enumerate(self.param_groups):
            vals, seen = list(g.values()), self._seen[gi]
            if (own and any(map(torch.is_tensor, vals)) or len(vals) != len(seen)
                    or not all(map(operator.is_, vals, seen))):
                if k := next((k for k in STRUCTURAL_KEYS if k in g and not _same(g[k], self.defaults[k])), None):
                    raise ValueError(f"HybridDeviceOptimizer: param_groups[{gi}][{k!r}]={g[k]!r}: it is fixed when the "
                                     f"optimizer is built ({self.defaults[k]!r}); build a new one to change it.")
                self._seen[gi] = vals
                for sub, keys in self._links[gi]:  # (a scheduler writes a tensor lr in place)
                    sub.update((k, g[k].clone() if own and torch.is_tensor(g[k]) else g[k]) for k in keys)

    def _begin(self) -> None:
        """Once per step, before anything is stepped."""
        self._sync_hyper()
        self._sync_hdo_state_to_sub_optimizers(adopt=False)
        self._reseed()

    def _reseed(self, everything: bool = False) -> None:
        """Copy the weights written into the model since the last step (``everything``: all of them, after a
        flush) into the masters of both halves (host: of the chunks this process steps)."""
        if everything:
            self.pipeline.flush()
        for s in (*self._masters, *self.pipeline.slots):
            if s.host and s.local.dtype != (built := (s.master if s.staging is None else s.staging).dtype):
                raise OffloadError(f"HybridDeviceOptimizer: parameter {s.index} of param group {s.group} is now "
                                   f"{s.local.dtype}; its host copy was built for {built}. Convert the model "
                                   "(model.to(dtype)) before building the optimizer.")
            if s.master is not None and (everything or s.param._version != s.p_ver):
                s.master.copy_(s.local.detach())
                s.p_ver = s.param._version

    def _sync_hdo_state_to_sub_optimizers(self, adopt: bool = True) -> None:
        """Make ``state[p]`` the sub-optimizer's state again after user code replaced or moved it (Megatron's
        DistributedOptimizer writes a checkpoint into ``state[p][key]``, then calls this), its tensors where
        ``p`` is stepped; a replaced ``master_param`` is copied into the master (``adopt``: weights loaded
        before it do not re-seed it). Every step runs it: no ``.device``, no ``.to()`` when all is in place."""
        for p, st in self.state.items():  # no tensor-keyed lookups: they hash through Python
            if not st or (s := self._by_id.get(id(p))) is None:
                continue
            if s.st is st and len(st) == len(s.seen) and all(map(operator.is_, st.values(), s.seen)):
                continue  # nothing replaced since the last call (in-place changes need nothing)
            if adopt and s.master is not None and st.get("master_param", s.master) is not s.master:
                s.p_ver = s.param._version
            if s.st is not st:
                s.opt.state[s.inner] = s.st = st
            dev = s.inner.get_device()
            for k, v in [(k, v) for k, v in st.items() if isinstance(v, torch.Tensor)]:
                if k == "master_param":
                    if s.master is None:
                        del st[k]
                    elif v is not s.master:
                        st[k] = s.master.copy_(v.detach())
                elif k == "step":
                    st[k] = _step(v, s)  # v itself when in place
                elif v.get_device() != dev:
                    st[k] = v.to(s.inner.device)
            s.seen = tuple(st.values())

    def _amp_begin(self) -> Optional[AmpStep]:
        """What a GradScaler set on this optimizer for this ``step()``, or ``None`` (Note [GradScaler])."""
        if (found := getattr(self, "found_inf", None)) is None:
            return None
        for flag in ("offload_gradients", "step_in_backward"):
            if self.defaults[flag]:
                raise OffloadError(f"HybridDeviceOptimizer: GradScaler with {flag}=True is not supported "
                                   "(Note [GradScaler]): the host gradients miss the scaler's inf/NaN check. Build "
                                   f"the optimizer with {flag}=False to train with GradScaler (fp16).")
        if bool(found.item()):
            return AmpStep(True)
        if (scale := getattr(self, "grad_scale", None)) is None:  # unscale_ ran: p.grad changed, its version not
            self.pipeline.forget_copy()
            return AmpStep(False)
        host = scale.detach().to("cpu", torch.float32, copy=True)
        inv = host.double().reciprocal().float()  # 1 / scale as GradScaler.unscale_ computes it
        return AmpStep(False, scale, found, host, torch.zeros((), dtype=torch.float32), inv)

    def _device_step(self, amp: Optional[AmpStep]) -> None:
        if (opt := self.gpu_optimizer) is None:
            return
        if takes_scale(opt, amp) is False:  # Note [GradScaler]: GradScaler.unscale_, per device and dtype
            grads = [g for s in self._slots if not s.host and (g := local_tensor(s.param.grad)) is not None]
            for (dev, _), ([gs], _) in (_group_tensors_by_device_and_dtype([grads]) if grads else {}).items():
                inv = amp.scale.double().reciprocal().float().to(dev)  # as GradScaler.unscale_ computes it
                torch._amp_foreach_non_finite_check_and_unscale_(gs, torch.zeros((), device=dev), inv)
        for s in self._masters:
            s.inner.grad = None if s.param.grad is None else local_tensor(s.param.grad).to(s.inner.dtype)
        amp_step(opt, amp, host=False)  # fused classes skip the version bump other optimizers' masters check
        torch.autograd.graph.increment_version([p for g in opt.param_groups for p in g["params"] if p.grad is not None])
        for s in self._masters:
            if s.inner.grad is not None:
                s.inner.grad = None
                if s.master is not None:
                    s.local.copy_(s.inner)
                    s.p_ver = s.param._version

    def _outcome(self, call: Callable[..., None], *args: Any) -> None:
        """``call(*args)``, a pipeline call: ``state[p]`` gets the state created, and an exception the
        parameters it left untouched (Note [Failed steps])."""
        try:
            call(*args)
        except BaseException as exc:
            dev = [] if self.pipeline.device_done else [s.flat for s in self._slots if not s.host]
            exc.untouched_params = idx = sorted({*dev, *self.pipeline.untouched()})  # type: ignore[attr-defined]
            exc.add_note(f"HybridDeviceOptimizer: {len(idx)} of {len(self._slots)} parameters were not updated "
                         "(untouched_params: their indices in param_groups order), the others were. Call step() again "
                         "to step exactly those, once, or zero_grad() to drop them.")
            for name in ("grad_scale", "found_inf"):  # GradScaler's hand-over, deleted only after a step that
                self.__dict__.pop(name, None)  # returned: left here, its retry would multiply the scale in twice
            raise
        finally:  # state[p] becomes the state its sub-optimizer created in its first step
            for s in self._fresh:
                if st := s.opt.state.get(s.inner):
                    self.state[s.param] = s.st = st
                    if s.master is not None:
                        st.setdefault("master_param", s.master)
            self._fresh = [s for s in self._fresh if s.param not in self.state]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of both halves (Note [GradScaler] under a scaler); returns the closure's loss or ``None``.

        Raises:
            OffloadError: closed, or a newer optimizer over its parameters takes their gradients; a gradient
                changed after ``step_in_backward`` stepped it; GradScaler with ``offload_gradients`` or
                ``step_in_backward``. Any exception carries ``untouched_params``.
            ValueError: an option fixed at construction (``offload_fraction``, a mode) changed in ``param_groups``.
        """
        if (o := self.pipeline.taken_by()) is not None and not o.closed and (o.offload_grads or o.in_backward):
            raise OffloadError("HybridDeviceOptimizer.step: a newer HybridDeviceOptimizer over these parameters, not "
                               "closed, takes their gradients in backward; call its close() before stepping this one.")
        if self.pipeline.closed:
            raise OffloadError("HybridDeviceOptimizer.step: this optimizer was closed (close() stopped its worker and "
                               "removed its hooks); build a new HybridDeviceOptimizer to keep training.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._outcome(self.pipeline.step, self._device_step, self._amp_begin)
        return loss

    def flush(self) -> None:
        """Finish host work in flight; in delayed mode also write the pending update into the model, so
        that the weights equal the host masters (cast to the model dtype)."""
        self._outcome(self.pipeline.flush)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient, host-held ones included; with ``step_in_backward`` a step whose chunks
        were stepped in backward cannot be skipped (``OffloadError``) unless its ``step()`` raised."""
        self.pipeline.zero_grad(set_to_none)
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters wherever their gradients
        live; returns the total norm on the first parameter's device. Not with ``step_in_backward``."""
        if self.defaults["step_in_backward"]:
            raise OffloadError("HybridDeviceOptimizer.clip_grad_norm_: not supported with step_in_backward=True, whose "
                               "host chunks are stepped before the global norm exists; use the default mode to clip.")
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            grads = [local_tensor(p.grad) if p.grad is not None else self.pipeline.held_grad(p) for p in params]
            if not (grads := [g for g in grads if g is not None]):
                return torch.tensor(0.0)
            total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            dev = [local_tensor(p.grad) for p in params if p.grad is not None]
            with self.pipeline.scaling(coef):
                for (d, _), ([gs], _) in (_group_tensors_by_device_and_dtype([dev]) if dev else {}).items():
                    torch._foreach_mul_(gs, coef.to(d))
        return total.to(params[0].device)

    def reload_model_params(self) -> None:
        """Re-seed every master (host and GPU) from the model's weights: call after writes the version counter misses
        (``p.data.copy_``, torch's fused optimizers); ``model.load_state_dict`` is seen by itself."""
        self._reseed(everything=True)

    update_fp32_param_by_new_param = reload_model_params  # Megatron's name

    def dummy_step(self) -> None:
        """Megatron's ``dummy_step``: create the state (for a checkpoint loaded into it in place) without
        changing a weight: a step on zero gradients at ``lr=0``, then the state zeroed but the masters."""
        lrs = [g["lr"] for g in self.param_groups]
        for p in (p for g in self.param_groups for p in g["params"] if p.requires_grad):
            p.grad = torch.zeros_like(p)
        try:
            for g in self.param_groups:
                g["lr"] = 0.0
            self.step()
            self.flush()
        finally:
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr
            self.zero_grad()
        for v in (v for st in self.state.values() for k, v in st.items() if k != "master_param" and torch.is_tensor(v)):
            v.zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, masters included, ``weights_only``-loadable; each group also
        records the switches (``fused``, ...) its sub-optimizers agree on. Flushes first."""
        if self.pipeline.sharded:
            raise OffloadError("HybridDeviceOptimizer.state_dict: the host step is sharded across DDP ranks "
                               "(attach_optimizer(..., shard_host_step=True)), so each rank holds the host state of "
                               "its own chunks only. Save with annotate_offload.distributed.save_checkpoint(model, "
                               "opt, path) on every rank, or attach with shard_host_step=False.")
        self.flush()
        sd = super().state_dict()
        # a view of a larger storage (a pinned slab) is cloned, so that torch.save writes it, not its slab
        sd["state"] = {i: {k: v.clone() if torch.is_tensor(v) and v.untyped_storage().nbytes() > v.nbytes else v
                           for k, v in st.items()} for i, st in sd["state"].items()}
        for packed, links in zip(sd["param_groups"], self._links):
            for k in IMPL_KEYS:
                vals = [sub.get(k, KeyError) for sub, _ in links]
                if vals and all(_same(v, vals[0]) for v in vals) and vals[0] is not KeyError:
                    packed[k] = vals[0]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state dict of a ``HybridDeviceOptimizer`` (any fraction) or torch optimizer of the same class.

        Everything is checked first (Note [Validated loads]): a refused load (``ValueError``/``TypeError`` naming
        parameter, key, expected and found) changes nothing. Note [Loading masters]: a ``master_param`` wider than its
        parameter is loaded and reaches the model at the next step; one of the model's dtype is re-seeded from the
        model, so loading an optimizer state alone never changes weights (delayed mode loads every host master, one
        update ahead, and writes them into the model: load the model first). This optimizer's own options stay.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        self.flush()
        self._sync_hyper()  # a per-optimizer option changed in param_groups is refused before anything changes
        hypers, states = _check_load(self, state_dict)
        delayed = self.defaults["delayed_param_update"]
        for g, h in zip(self.param_groups, hypers):
            g.update(h)
        with torch.no_grad():
            for s in self._slots:
                st = states.get(s.flat, {})
                saved = st.pop("master_param", None)
                if s.master is not None:
                    wide = s.master.dtype != s.local.dtype or (delayed and s.host)
                    s.master.copy_(saved if wide and saved is not None else s.local)
                    if st:
                        st["master_param"] = s.master
                if st:
                    self.state[s.param] = s.opt.state[s.inner] = s.st = st
                else:
                    self.state.pop(s.param, None)
                    s.opt.state.pop(s.inner, None)
                s.p_ver, s.seen = s.param._version, ()  # no reference to the replaced state
        self._fresh = [s for s in self._slots if s.param not in self.state]
        self._sync_hyper()
        if delayed:
            self.pipeline.push_masters()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def close(self) -> None:
        """Finish pending work, then remove the backward hooks and stop the worker thread (idempotent); the
        clean-up always runs, and an error of the pending work is raised after it. ``step()`` then raises."""
        if not self.pipeline.closed:
            try:
                self.flush()
            finally:
                self.pipeline.close()


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # e.g. a multi-element tensor
        return False


def _check_load(opt: HybridDeviceOptimizer, sd: Any) -> tuple[list[dict[str, Any]], dict[int, dict]]:
    """Validate ``sd`` against ``opt`` and convert it (Note [Validated loads]); applies nothing.
    Returns ``(hyper-parameters per group, non-empty state per flat index)``."""
    def bad(what: str) -> ValueError:
        return ValueError(f"HybridDeviceOptimizer.load_state_dict: {what}; nothing was loaded. Load a state dict "
                          "saved by an optimizer over this model, with the same param groups.")

    if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(sd.get("param_groups"), list)):
        raise bad(f"expected an optimizer state_dict() (a 'state' dict and a 'param_groups' list), found {_desc(sd)}")
    saved = sd["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise bad(f"the state dict has {len(saved)} param groups, this optimizer {len(opt.param_groups)}")
    hypers = []
    for gi, (sg, g) in enumerate(zip(saved, opt.param_groups)):
        ids = sg.get("params") if isinstance(sg, dict) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(g["params"]):
            raise bad(f"param group {gi} holds {len(ids) if isinstance(ids, (list, tuple)) else _desc(sg)} parameters "
                      f"in the state dict and {len(g['params'])} here")
        hypers.append({k: copy.deepcopy(v) for k, v in sg.items() if k not in ("params", *STRUCTURAL_KEYS, *IMPL_KEYS)})
        opt._check_group(g["params"], hypers[-1], f" in param group {gi} of the state dict")
    cache: dict = {}
    states: dict[int, dict] = {}
    for e in opt._slots:
        sg = saved[e.group]
        names = sg.get("param_names") or ()
        where = (f"parameter {e.flat}{f' {names[e.index]!r}' if len(names) > e.index else ''} (param group {e.group}, "
                 f"index {e.index}, shape {tuple(e.local.shape)})")
        try:
            st = sd["state"].get(sg["params"][e.index], {})
        except TypeError:  # an unhashable id
            st = None
        if not isinstance(st, dict):
            raise bad(f"{where}: expected a dict of state tensors, found {_desc(st)}")
        if st:  # what the class creates, with the loaded hyper-parameters
            kw = {k: hypers[e.group].get(k, v) for k, v in e.sub_group.items() if k != "params"}
            key = (type(e.opt), repr(sorted(kw.items())), e.inner.dtype, e.inner.device, e.inner.dim())
            if key not in cache:
                cache[key] = _probe(type(e.opt), kw, [key[2:]], group=True)[0] or {}
            tmpl = cache[key]
            if missing := [k for k in tmpl if k not in st]:
                raise bad(f"{where}, state {missing[0]!r}: expected the keys {sorted(tmpl)}, found {sorted(st)}")
            states[e.flat] = {k: _convert(e, k, v, e.master if k == "master_param" else tmpl.get(k), lambda want, k=k,
                                          v=v: bad(f"{where}, state {k!r}: expected {want}, found {_desc(v)}"))
                              for k, v in st.items()}
    return hypers, states


def _step(v: torch.Tensor, e: Slot) -> torch.Tensor:
    """``step`` where torch keeps it: fp32 on the parameter's device for fused/capturable groups, else the CPU."""
    if e.sub_group.get("fused") or e.sub_group.get("capturable"):
        in_place = v.dtype == torch.float32 and v.get_device() == e.inner.get_device()
        return v if in_place else v.to(e.inner.device, torch.float32)
    return v if v.get_device() < 0 else v.to("cpu")


def _probe(cls: type, kw: dict[str, Any], like: list[tuple[torch.dtype, Any, int]], *,
           group: bool = False) -> tuple[Optional[dict[str, Any]], Optional[Exception]]:
    """Step ``cls`` once, on zero gradients, over one tensor of side 2 per ``(dtype, device, ndim)`` of
    ``like``, with ``kw`` as constructor keywords (checked by the constructor) or as the group's values
    (``group``). Returns the state it created for the first tensor, or the error it raised."""
    try:
        ps = [torch.zeros((2,) * n, dtype=d, device=dev) for d, dev, n in like]
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt = cls([{**kw, "params": ps}]) if group else cls(ps, **kw)
        opt.step()
        return dict(opt.state.get(ps[0], {})), None
    except (TypeError, ValueError, RuntimeError, NotImplementedError, AssertionError, IndexError) as err:
        return None, err


def _desc(v: Any) -> str:
    return (f"a tensor of shape {tuple(v.shape)} and dtype {v.dtype}" if torch.is_tensor(v)
            else f"{type(v).__name__} {v!r:.80}")


def _convert(e: Slot, k: str, v: Any, t: Any, bad: Callable[[str], ValueError]) -> Any:
    """``v`` loaded as state ``k`` of ``e``, cast and moved as torch does; ``t``: what the class creates."""
    if not torch.is_tensor(t):  # a key the class does not create: kept, cast and moved as torch keeps it
        if torch.is_tensor(v) and k != "master_param":
            return v.to(e.inner.device, e.inner.dtype if v.is_floating_point() else v.dtype, copy=True)
        return copy.deepcopy(v)
    like_param = k == "master_param" or t.shape == (2,) * e.inner.dim()  # the probe's tensors have side 2
    shape = () if t.dim() == 0 else tuple(e.local.shape) if like_param else None
    kind = "complex" if t.is_complex() else "floating-point" if t.is_floating_point() else str(t.dtype)
    if not torch.is_tensor(v) and shape == () and type(v) in (int, float) and math.isfinite(v):
        v = torch.tensor(float(v))
    if (not torch.is_tensor(v) or (shape == () and v.numel() != 1) or (shape and tuple(v.shape) != shape)
            or (shape != () and (v.is_complex(), v.is_floating_point()) != (t.is_complex(), t.is_floating_point()))):
        raise bad(f"a {kind} tensor" + (f" of shape {shape}" if shape is not None else ""))
    if k in ("master_param", "step"):
        return v if k == "master_param" else _step(v.detach().reshape(()).clone(), e)
    return v.to(e.inner.device, e.inner.dtype if v.is_floating_point() else v.dtype, copy=True)
