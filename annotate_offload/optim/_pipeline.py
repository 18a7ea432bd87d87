"""The per-step pipeline of :class:`HybridDeviceOptimizer`: hooks, D2H, host chunks, H2D (private).

See Note [Host step lifecycle] in ``_slots.py``.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..errors import OffloadError
from . import _amp
from ._clip import _host_scale
from ._phases import StepPhases
from ._slots import Chunk, HostSlot
from ._split import local_grad
from ._threads import num_threads

if TYPE_CHECKING:  # pragma: no cover
    from ._hybrid import HybridDeviceOptimizer

__all__: list[str] = []


# Note [One optimizer per parameter]: an optimizer that is replaced but still referenced (an LR
# finder's, one a scheduler or a closure keeps) kept its gradient hooks, and with
# offload_gradients its hook freed p.grad under the new optimizer (fresh-user report, seventh
# session: weights 0.031 off after 3 steps; with step_in_backward the new one raised a misleading
# "second gradient" error). The newest optimizer built over a parameter owns it: older ones' hooks
# stand aside (they still step correctly, copying the gradient at their own step()), and building
# over parameters a live, unclosed optimizer owns warns, naming close().
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (param, owning optimizer)


def claim(params: list[torch.Tensor], opt: "HybridDeviceOptimizer") -> list[int]:
    """Make ``opt`` the owner of ``params``; the positions of those a live, unclosed optimizer owned."""
    for k in [k for k, (p, _) in _OWNERS.items() if p() is None]:
        del _OWNERS[k]
    taken = []
    for i, p in enumerate(params):
        prev = _OWNERS.get(id(p))
        if prev is not None and prev[0]() is p:
            o = prev[1]()
            if o is not None and o is not opt and not o._closed:
                taken.append(i)
        _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(opt))
    return taken


def _owns(param: torch.Tensor, opt: "HybridDeviceOptimizer") -> bool:
    e = _OWNERS.get(id(param))
    return e is not None and e[1]() is opt and e[0]() is param


class _GradHook:
    """Post-accumulate-grad hook of one host slot; holds the optimizer weakly (no cycle through C++)."""

    __slots__ = ("opt", "slot")

    def __init__(self, opt: "HybridDeviceOptimizer", slot: HostSlot) -> None:
        self.opt = weakref.ref(opt)
        self.slot = slot

    def __call__(self, param: torch.Tensor) -> None:
        opt = self.opt()
        if opt is not None and _owns(param, opt):  # Note [One optimizer per parameter]
            opt._on_grad(self.slot)


class _VersionHook:
    """Post-accumulate-grad hook of a parameter whose gradient stays on the device under
    ``offload_gradients``: records the gradient's version, so ``step()`` can tell that code after
    backward changed device gradients in place (Note [Gradient transforms that miss host gradients])."""

    __slots__ = ("opt",)

    def __init__(self, opt: "HybridDeviceOptimizer") -> None:
        self.opt = weakref.ref(opt)

    def __call__(self, param: torch.Tensor) -> None:
        opt = self.opt()
        g = local_grad(param)
        if opt is not None and g is not None:
            opt._grad_vers[id(param)] = (param, id(g), g._version)


# Note [Gradient transforms that miss host gradients]: with offload_gradients, host-held gradients
# have p.grad None on the device, so code that edits p.grad after backward cannot reach them.
# torch.nn.utils.clip_grad_norm_ is such code, and HF Trainer (max_grad_norm, default 1.0, and its
# grad_norm logging even at 0) and accelerate's clip_grad_norm_ call it: it clipped only the
# gradients still on the device and returned their norm alone (fresh-user trial, eighth session:
# logged grad_norm 0.03 against torch's 1.93, weights 1.6e-2 off after 6 steps). Parameters whose
# gradients stay on the device get a hook that records their version; step() warns once when one
# changed while host-held gradients exist and this optimizer's own clip_grad_norm_ was not called.
# Such a hook only stores a tuple (no event, no stream switch, no copy: Note [Tiny gradients at
# step()]'s costs); on W3 its backward cost was not measurable (benchmarks/NOTES.md, G1 of
# session 9: backward() 77-94 ms with the hooks, 81-91 ms without).
def _unseen_transform(opt: "HybridDeviceOptimizer") -> "str | None":
    """The warning for Note [Gradient transforms that miss host gradients], or ``None``."""
    if opt._warned_unseen or opt._clipped or not opt._grad_vers:
        return None
    held = sum(1 for s in opt._host_slots if s.valid and local_grad(s.param) is None)
    if not held:
        return None
    changed = 0
    for param, gid, ver in opt._grad_vers.values():
        g = local_grad(param)
        if g is not None and (id(g) != gid or g._version != ver):
            changed += 1
    if not changed:
        return None
    opt._warned_unseen = True
    return (
        f"HybridDeviceOptimizer(offload_gradients=True): after backward, code changed {changed} gradients in place, "
        f"but {held} host-held gradients were not changed: their p.grad is None on the device, so that code cannot "
        "see them. torch.nn.utils.clip_grad_norm_ is such code (HF Trainer calls it for max_grad_norm and for its "
        "grad_norm log, accelerate's clip_grad_norm_ too): it clipped only the device gradients and its norm left the "
        "host ones out. Clip with opt.clip_grad_norm_(max_norm), or build the optimizer with offload_gradients=False "
        "under HF Trainer/accelerate. Warned once."
    )


# Note [Tiny gradients at step()]: each gradient hook costs the backward thread two events, a
# stream switch and a copy launch (~40-70 us on the H200 host). W3's GPT has 288 parameters, 144
# of them under 4096 elements (LayerNorm weights and biases, small biases: 0.05% of the bytes);
# with a hook each, the exact-mode backward was CPU-bound (S7 traces: autograd thread 75.4 ms vs
# a 66.5 ms compute stream; torchao, which keeps such tensors on the GPU, 60.5 ms). Host
# parameters under BATCHED_NUMEL elements (torchao's ``minimal_size``) get no hook: ``step()``
# copies their gradients in one batch, one stream switch and one event for all. Not with
# ``step_in_backward`` (its chunks start in backward when every gradient has landed).
BATCHED_NUMEL = 4096


def _sparse_grad(s: HostSlot, g: torch.Tensor) -> TypeError:
    """The error for a non-strided (sparse) gradient of a host-stepped parameter."""
    return TypeError(
        f"HybridDeviceOptimizer: parameter {s.index} of param group {s.group} (shape {tuple(s.local.shape)}) has a sparse "
        f"gradient (layout={g.layout}), but its host step copies gradients into dense host buffers and steps them with a "
        "dense optimizer. Use a dense embedding (nn.Embedding(..., sparse=False), the default), or step this parameter "
        "with torch.optim.SparseAdam outside this optimizer (leave it out of its params)."
    )


class PipelineMixin:
    """The step half of :class:`HybridDeviceOptimizer`."""

    def _batched(self, s: HostSlot) -> bool:
        """True when ``s``'s gradient is copied at ``step()`` with the other tiny ones (no hook)."""
        return not self._in_backward and s.local.numel() < BATCHED_NUMEL

    def _copy_grad(self, s: HostSlot, g: torch.Tensor, stream: Any, *, accumulate: bool) -> None:
        side = self._side
        buf = s.grad_bufs[self._buf]
        with side.use(stream):
            if accumulate:
                if s.scratch is None:
                    s.scratch = torch.empty(g.shape, dtype=g.dtype, pin_memory=side.can_pin and self.defaults["pin_cpu_grads"])
                s.scratch.copy_(g, non_blocking=True)
                side.synchronize(side.record(stream))
                side.synchronize(s.d2h_ev)
                # clip coefficients pending for what the buffer holds apply to it alone, before the
                # new micro-batch is added (clipping each micro-batch: c*g0 + g1, not c*(g0 + g1);
                # fresh-user report, eighth session)
                for coef, ev in s.scales:
                    side.synchronize(ev)
                    _host_scale(buf, s.local.dtype, coef)
                s.scales = []
                if buf.dtype == g.dtype:
                    buf.add_(s.scratch)
                else:
                    buf.copy_(buf.to(g.dtype).add_(s.scratch))
                s.d2h_ev = None
            else:
                buf.copy_(g, non_blocking=True)
                s.d2h_ev = side.record(stream, self._timing)
                self._last_d2h_ev = s.d2h_ev
        self._copied(s, g, stream, replaced=not accumulate)

    def _copied(self, s: HostSlot, g: torch.Tensor, stream: Any, *, replaced: bool = True) -> None:
        """Bookkeeping once ``g``'s D2H into ``s``'s host buffer is enqueued on ``stream``.

        ``replaced``: the buffer now holds ``g`` alone, so coefficients still pending for its old
        contents (``clip_grad_norm_``'s, already applied to the GPU gradient in place) are dropped;
        keeping them clipped a gradient changed after clipping twice (found reading the seventh
        session's change).
        """
        if replaced:
            s.scales = []
        side = self._side
        s.seq = self._seq
        self._seq += 1
        s.grad_ref = weakref.ref(s.param.grad) if s.param.grad is not None else None
        s.grad_ver = g._version
        s.grad_ptr = g.data_ptr()
        s.valid = True
        # Note [Gradient residency]: the copy may still be in flight when the last reference to
        # ``g`` goes (here with offload_gradients, or at zero_grad). ``record_stream`` keeps the
        # allocator from handing its block out again before the D2H stream is past the copy; the
        # caching allocator counts the block as free at once (``memory_allocated`` drops now) and,
        # should an allocation not fit, synchronizes such pending events before it gives up
        # (``release_cached_blocks``). Nothing here ever blocks the backward thread: an earlier
        # version waited on the oldest copy once a chunk's worth was in flight, which stalled
        # the launch of backward kernels at PCIe speed (the 1.2 B W3 model: 4.8 GB of fp32
        # gradients, ~87 ms at 55 GB/s, against a 53 ms backward) and bought no memory.
        side.record_stream(g, stream)
        if self._offload_grads:
            s.param.grad = None

    def _on_grad(self, s: HostSlot) -> None:
        g = local_grad(s.param)
        if g is None or not self._steps_here(s.chunk):
            return
        if g.layout is not torch.strided:  # raised here, in backward(), not in the worker
            raise _sparse_grad(s, g)
        with torch.no_grad():
            if self._in_backward:
                if s.submitted:
                    raise OffloadError(
                        "HybridDeviceOptimizer: step_in_backward=True saw a second gradient for a host-stepped "
                        f"parameter {tuple(s.local.shape)} after its chunk was already stepped (gradient accumulation, "
                        "e.g. HF Trainer's gradient_accumulation_steps > 1, whose next forward may already have read "
                        "weights this step was writing; a parameter used twice such as tied embeddings; or a backward "
                        "without step() since the last "
                        "one: a step cannot be skipped in this mode, backward has already applied it to the host "
                        "half). Use step_in_backward=False for this training loop."
                    )
                self._begin()
            side = self._side
            ready = side.record(side.current_stream())
            side.wait_event(self._d2h, ready)
            self._copy_grad(s, g, self._d2h, accumulate=self._offload_grads and s.valid)
            s.ready_ev = ready
            if self._in_backward:
                s.use = True
                c = self._chunks[s.chunk]
                c.landed += 1
                if c.landed == c.trainable:
                    self._submit(s.chunk, in_backward=True)

    def _collect(self, stream: Any) -> None:
        """Decide, per host slot, whether it steps now; copy gradients the hooks did not (or that changed)."""
        if self._amp is not None and self._amp.skip:  # GradScaler found inf/NaN: step nothing (Note [GradScaler])
            for s in self._host_slots:
                s.use = False
            return
        batch: list = []
        for s in self._host_slots:
            if not self._steps_here(s.chunk):
                s.use = s.valid = False  # another rank steps it (Note [Host-step sharding])
                continue
            if s.submitted:
                g = local_grad(s.param)
                if g is not None and not s.copied(g):
                    raise OffloadError(
                        "HybridDeviceOptimizer: a gradient was modified (clipping, unscaling, accumulation) after "
                        "step_in_backward=True had already stepped its parameter in backward. The host chunks stepped in "
                        "backward used the gradients as they were and are not undone (their update reaches the model "
                        "with the next flush() or step()): restore from a checkpoint. step_in_backward does not support "
                        "cross-parameter gradient transforms, and HF Trainer and accelerate make one at every step "
                        "(torch.nn.utils.clip_grad_norm_, which rescales every gradient in place, by 1.0 for the grad_norm "
                        "log even at max_grad_norm=0); use the default mode for this training loop."
                    )
                continue
            g = local_grad(s.param)
            if g is None:
                s.use = s.valid and self._offload_grads
                if not s.use:
                    s.valid = False
                continue
            if g.layout is not torch.strided:
                raise _sparse_grad(s, g)
            if not s.copied(g):
                accumulate = self._offload_grads and s.valid
                if self._batched(s) and not accumulate:
                    batch.append((s, g))
                else:
                    self._copy_grad(s, g, stream, accumulate=accumulate)
            s.use = True
        if batch:
            self._copy_batch(batch, stream)

    def _copy_batch(self, batch: list, stream: Any) -> None:
        """Note [Tiny gradients at step()]: the D2H of many small gradients under one stream switch
        and one event."""
        side = self._side
        with side.use(stream):
            for s, g in batch:
                s.grad_bufs[self._buf].copy_(g, non_blocking=True)
            ev = side.record(stream, self._timing)
        self._last_d2h_ev = ev
        for s, g in batch:
            s.d2h_ev = ev
            self._copied(s, g, stream)

    def _landing_order(self) -> list[int]:
        """Chunks not yet submitted, in the order their last gradient D2H was issued.

        Note [Host chunk order]: backward produces gradients last layer first, and the D2H stream
        copies them in that order; parameter order would step layer 0's chunk first, whose
        gradients are the last to land (the 1.2 B W3 model: 4.8 GB of fp32 gradients take ~87 ms
        at 55 GB/s against a ~53 ms backward, so the worker idled ~35 ms at ``step()``). Stepping
        chunks in landing order starts with gradients that are already on the host; chunks
        are independent (elementwise update), so the order changes no bit.
        """
        todo = [ci for ci, c in enumerate(self._chunks) if not c.slots[0].submitted and self._steps_here(ci)]
        return sorted(todo, key=lambda ci: max((s.seq for s in self._chunks[ci].slots if s.use), default=-1))

    def _plan(self, ci: int) -> list[tuple[HostSlot, Any, list]]:
        """What one chunk steps, captured now: the worker may run after the slots move on."""
        return [(s, s.d2h_ev, list(s.scales)) for s in self._chunks[ci].slots if s.use]

    def _submit(self, ci: int, *, in_backward: bool = False) -> None:
        """Queue chunk ``ci``'s host step on the worker; ``in_backward``: submitted by a gradient hook
        (``step_in_backward``), before step() ordered the H2D stream after the backward."""
        for s in self._chunks[ci].slots:
            s.submitted = True
        assert self._worker is not None
        self._worker.submit(functools.partial(self._run_chunk, ci, self._plan(ci), self._buf, self._h2d, not self._delayed, self._ph,
                                              self._amp, in_backward))

    def _run_chunk(self, ci: int, plan: list[tuple[HostSlot, Any, list]], bi: int, stream: Any, copy_back: bool,
                   ph: StepPhases, amp: "_amp.AmpStep | None" = None, in_backward: bool = False) -> None:
        """Host step of one chunk (the training thread in the default mode and on the serial path; the
        worker thread with ``step_in_backward`` or ``delayed_param_update``).

        ``in_backward``: submitted by a gradient hook (``step_in_backward``); its H2D then waits for
        the compute stream past each parameter's last use (Note [H2D ordering])."""
        side = self._side
        c = self._chunks[ci]
        t_in = time.perf_counter()
        with torch.no_grad():
            if self._delayed:
                side.synchronize(c.h2d_ev)  # the previous update's H2D reads masters/staging we overwrite
            for s in c.slots:
                s.master.grad = None
            for s, d2h_ev, scales in plan:
                side.synchronize(d2h_ev)
                buf = s.grad_bufs[bi]
                for coef, ev in scales:
                    side.synchronize(ev)
                    _host_scale(buf, s.local.dtype, coef)
                s.master.grad = buf
            if plan and amp is not None and amp.scale is not None and not _amp.supports(c.opt):
                for s, _, _ in plan:  # Note [GradScaler]: what GradScaler.unscale_ does, for a class without the support
                    _host_scale(s.grad_bufs[bi], s.local.dtype, amp.host_inv)
            t0 = time.perf_counter()
            if plan:
                with _amp.handed_over(c.opt, amp, host=True):
                    if c.serial:
                        with num_threads(1):
                            c.opt.step()
                    else:
                        c.opt.step()
            stepped = [s for s, _, _ in plan]
            for s in stepped:
                s.master.grad = None
                if s.staging is not None:
                    s.staging.copy_(s.master)
            t1 = time.perf_counter()
            self._ran.add(ci)
            self._host_s += t1 - t0
            if copy_back:
                self._h2d_chunk(c, stepped, stream, in_backward=in_backward)
            else:
                # delayed mode: once step() has opened the apply window (backward is over), the
                # worker issues each chunk's H2D itself, overlapping the host steps still to come
                with self._lock:
                    if self._applying:
                        self._h2d_chunk(c, stepped, stream)
                    else:
                        c.pending = stepped
        ph.chunk_done(t0, t1, time.perf_counter(), t0 - t_in, sum(s.master.numel() for s in stepped))

    def _steps_here(self, ci: int) -> bool:
        """True when this process runs host chunk ``ci`` (all of them, unless the host step is
        sharded across DDP ranks: Note [Host-step sharding] in annotate_offload/distributed)."""
        return self._shard is None or self._shard.owns(ci)

    def _run_chunks_here(self, order: list[int], bi: int, stream: Any) -> None:
        """Host step of the chunks ``order`` on this thread (the default mode, the serial path),
        each chunk's H2D on ``stream`` as soon as it is stepped."""
        with num_threads(self._threads):
            for ci in order:
                self._run_chunk(ci, self._plan(ci), bi, stream, True, self._ph, self._amp)

    def _h2d_chunk(self, c: Chunk, slots: list[HostSlot], stream: Any, *, in_backward: bool = False) -> None:
        # Note [H2D ordering]: an H2D overwrites a GPU parameter, so it must follow the parameter's
        # last use on the compute stream. Everything issued from step() on is ordered by the one
        # wait step() puts on the H2D stream at its entry (after the whole backward), and delayed
        # mode and flush() issue theirs after such a wait too. Only a chunk stepped in backward
        # (step_in_backward) is issued before it: its H2D waits on each parameter's gradient-ready
        # event instead. The per-parameter waits used to run for every chunk. Dropping them from
        # the others is less driver work, not a measured speed-up: the W3 exact step's H2D issue
        # stayed at 11-16 ms per step (F3, F4 in benchmarks/NOTES.md).
        side = self._side
        with torch.no_grad(), side.use(stream):
            skip = self._h2d_skip
            for s in slots:
                if s in skip:
                    continue
                if in_backward:
                    side.wait_event(stream, s.ready_ev)
                s.local.copy_(s.staging if s.staging is not None else s.master, non_blocking=True)
                s.p_ver = s.param._version
            c.h2d_ev = side.record(stream)

    def _gpu_step(self) -> None:
        amp = self._amp
        if self._gpu_opt is None or (amp is not None and amp.skip):
            return
        if amp is not None and amp.scale is not None and not _amp.supports(self._gpu_opt):
            grads = [g for g in (local_grad(d.param) for d in self._dev_slots) if g is not None]
            _amp.unscale_device_grads(grads, amp.scale)  # Note [GradScaler]: what GradScaler.unscale_ does
        masters = [d for d in self._dev_slots if d.inner is not d.param]
        for d in masters:
            g = local_grad(d.param)
            d.inner.grad = None if g is None else g.to(d.inner.dtype)
        with _amp.handed_over(self._gpu_opt, amp, host=False):
            self._gpu_opt.step()
        for d in masters:
            if d.inner.grad is not None:
                d.inner.grad = None
                if d.has_master:
                    d.local.copy_(d.inner)
                d.p_ver = d.param._version

    def _end_step(self, failed: bool = False) -> None:
        self._grad_vers.clear()
        self._clipped = False
        # Note [Offloaded gradients are consumed by step()]: with offload_gradients, p.grad is None
        # after backward, so model.zero_grad() (HF Trainer's call) or p.grad = None cannot reach
        # the host copy; had it stayed valid, the next backward added onto the last step's
        # gradient (fresh-user report, eighth session). So step() consumes it, as if zero_grad()
        # followed: the next backward starts from zero. zero_grad(set_to_none=False) turns a
        # consumed buffer into a valid zero gradient, as torch keeps a zero p.grad that steps a
        # parameter no backward reached (momentum, weight decay: an MoE expert not routed).
        # Only a loop that never zeroes gradients between steps differs from torch, and the
        # docstring says so.
        # A step() that raised (the device half's optimizer, a host chunk's) keeps the gradients of
        # the chunks it did not step, so a retried step() steps them once (review of the session-9
        # change: the device half now runs first, and its error used to consume the host gradients
        # of offload_gradients, which p.grad no longer holds). Delayed mode steps after step().
        keep = failed and not self._delayed
        for s in self._host_slots:
            s.reset_step(keep=keep and s.chunk not in self._ran)
            s.d2h_ev = None
        self._ran.clear()
        for c in self._chunks:
            c.landed = 0
        self._begun = False
        self._amp = None
        self._last_ph, self._ph = self._ph, StepPhases()
        for s in self._host_slots:
            st = self.state[s.param]
            if st and "master_param" not in st:
                st["master_param"] = s.master
        for d in self._dev_slots:
            st = self.state[d.param]
            if d.has_master and st and "master_param" not in st:
                st["master_param"] = d.inner

    def _serial_step(self, cur: Any) -> None:
        side = self._side
        skip = self._amp is not None and self._amp.skip  # Note [GradScaler]: inf/NaN, step nothing
        for s in self._host_slots:
            g = local_grad(s.param)
            s.use = g is not None and self._steps_here(s.chunk) and not skip
            if s.use:
                if g.layout is not torch.strided:
                    raise _sparse_grad(s, g)
                with side.use(cur):
                    s.grad_bufs[0].copy_(g, non_blocking=True)
        self._gpu_step()
        side.synchronize(side.record(cur))
        self._run_chunks_here([ci for ci in range(len(self._chunks)) if self._steps_here(ci)], 0, cur)

