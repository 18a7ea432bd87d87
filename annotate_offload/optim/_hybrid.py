"""``HybridDeviceOptimizer``: a fraction of the parameters is stepped on the host (private module).

See Note [Host step lifecycle] in ``_slots.py`` for the per-parameter pipeline, Note [Host slabs]
in ``_host.py`` for pinned memory and Note [Thread budget] in ``_threads.py`` for CPU threads.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch

from ..errors import OffloadError
from . import _amp, _state
from ._build import _IMPL_KEYS, _STRUCTURAL_KEYS, BuildMixin, _check_cls, _flag, _hyper_defaults
from ._clip import clip_hybrid
from ._device import pick_side
from ._phases import StepPhases
from ._pipeline import PipelineMixin, _GradHook, _unseen_transform, _VersionHook, claim
from ._slots import DevSlot, HostSlot
from ._split import Placement, choose_offloaded, local_grad, local_tensor
from ._threads import CpuWorker, thread_budget
from ._validate import check_group_keys, check_kwargs, check_values, check_with_torch

__all__ = ["HybridDeviceOptimizer"]


def _refuse_complex_fused(groups: list[dict[str, Any]]) -> None:
    """An explicit ``fused=True`` with a trainable complex parameter: torch's fused kernels refuse it at the first step."""
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            loc = local_tensor(p)
            if p.requires_grad and loc.is_complex():
                raise TypeError(
                    f"HybridDeviceOptimizer: fused=True was given, but parameter {pi} of param group {gi} (shape "
                    f"{tuple(loc.shape)}) is {loc.dtype}; torch's fused optimizer kernels take floating-point parameters "
                    "only. Omit fused (complex parameters then get torch's default non-fused path and the others stay "
                    "fused) or pass fused=False."
                )


# torch optimizers whose step accepts sparse gradients (their docs; the others raise at step())
_SPARSE_CAPABLE = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


class HybridDeviceOptimizer(BuildMixin, PipelineMixin, torch.optim.Optimizer):
    """Adam(W)/SGD with a fraction of the parameters stepped on the host, pipelined with the GPU.

    Megatron-Core's ``HybridDeviceOptimizer`` signature and meaning. The first ``offload_fraction``
    of the trainable parameters (by numel, whole tensors, param-group order; see ``placements``)
    get host masters, host gradient buffers and host optimizer state, and are stepped by
    ``cpu_optimizer_cls`` (torch's fused CPU AdamW by default); the rest are stepped on the GPU by
    ``gpu_optimizer_cls`` (fused AdamW by default), concurrently. With the default overlap, the
    gradient D2H of each host-stepped parameter starts in backward (post-accumulate-grad hook),
    the host step runs per chunk (``chunk_bytes`` of masters), and each chunk's updated weights go
    back H2D in the model's dtype while later chunks are stepped. The default (exact) mode steps
    the host chunks on the calling thread, as the GPU has nothing to run meanwhile;
    ``step_in_backward`` and ``delayed_param_update`` step them in a worker thread, beside the
    forward/backward that the training thread launches. ``step()`` returns once the compute
    stream waits on the last H2D, so the next forward reads new weights.

    Numerics are those of ``cpu_optimizer_cls``/``gpu_optimizer_cls`` on the same inputs: on a
    CPU-only machine both halves run torch's fused CPU kernel and results are bit-identical to
    ``torch.optim.AdamW(params, fused=True)``; on a GPU the CPU and CUDA kernels differ in the
    last bits (GPU tests use ``rtol=1e-5, atol=1e-5`` on fp32 weights after 10-20 steps).

    Args:
        params (iterable): parameters or param-group dicts, as for any torch optimizer. CUDA
            parameters (one device) are split; CPU parameters are always stepped on the host. On a
            machine without CUDA the "GPU side" is CPU tensors (the test backend).
        offload_fraction (float): share of the trainable device numel stepped on the host,
            ``0 <= f <= 1``. Default: ``0.5``.
        cpu_optimizer_cls (type | None): host optimizer class. Default: ``torch.optim.AdamW``
            (``fused=True`` unless ``fused`` is passed). Accelerator-only classes are refused.
        gpu_optimizer_cls (type | None): device optimizer class. Default: the host class
            (``fused=True`` for Adam/AdamW).
        param_update_in_fp32 (bool): keep fp32 masters for non-fp32 params (on the host for
            offloaded ones, on the GPU otherwise); weights go back in the model dtype (bf16
            H2D: half the bytes, same rounding). Default: ``False``.
        pin_cpu_grads (bool): page-lock host gradient buffers. Default: ``True``.
        pin_cpu_params (bool): page-lock host masters (also when created from bf16 params) and
            the bf16 staging. Default: ``True``.
        overlap_cpu_optimizer_d2h_h2d (bool): the pipelined path described above. ``False`` is a
            true serial path for A/B runs: all D2H at ``step()`` on the compute stream, a host
            sync, the host step, all H2D on the compute stream. Default: ``True``. With overlap,
            host parameters under 4096 elements (norm weights, small biases) get no gradient hook:
            ``step()`` copies their gradients in one batch (Note [Tiny gradients at step()] in
            ``_pipeline.py``), except with ``step_in_backward``.
        offload_gradients (bool): drop each host-stepped parameter's GPU gradient in its backward
            hook (the tiny ones at ``step()``), right after its D2H is enqueued (the allocator reuses the memory once the copy
            has run; the backward thread never waits for it). GPU memory falls by their gradient
            bytes wherever gradients are part of the peak; when the peak is the end of forward
            (weights + activations, e.g. issue 7's W3 model) it stays there. The gradient then lives
            on the host until ``step()`` or ``zero_grad()``: accumulation over micro-batches adds on the
            host (exact, but not hidden), and ``clip_grad_norm_`` of this optimizer sees it. ``step()``
            consumes it, as if ``zero_grad()`` followed (so ``model.zero_grad()``, which cannot reach
            the host copy, is enough between steps); a loop that never zeroes gradients between steps,
            so that each backward adds onto the last step's gradient, is not supported. Tools that read
            ``p.grad`` directly do not: ``torch.nn.utils.clip_grad_norm_`` misses it (HF Trainer and
            accelerate clip with it; ``step()`` warns once when device gradients were changed in
            place while host-held ones were not: Note [Gradient transforms that miss host
            gradients] in ``_pipeline.py``), and
            ``GradScaler`` (whose inf/NaN check would miss it) is refused at ``step()`` with an
            ``OffloadError``. Needs overlap on. Default: ``False``.
        step_in_backward (bool): start each chunk's host step as soon as its gradients land in
            backward. Limits: one backward per step (no accumulation, no tied/shared parameters
            among host-stepped ones), no gradient clipping or unscaling across parameters (a
            gradient modified after its chunk was stepped raises ``OffloadError`` at ``step()``);
            the learning rate used is the one set before backward. Default: ``False``.
        delayed_param_update (bool): ZeRO-Offload's one-step-delayed update of the host part: the
            host step of step ``t`` runs during forward/backward of ``t+1`` and its weights are
            applied at ``step()`` ``t+1``, so the model trains on weights one update stale (changes
            numerics; the GPU part is not delayed). Host gradients are not carried past ``step()``.
            ``flush()`` applies the pending update. Default: ``False``.
        use_torch_optimizer_for_cpu_offload (bool): use the host (torch) class for the GPU part
            too, ignoring ``gpu_optimizer_cls`` (Megatron's meaning). Default: ``False``.
        cpu_threads (int | None): threads for the host step; default per Note [Thread budget]
            (usable cores / ``LOCAL_WORLD_SIZE``, minus one when >= 4 and a worker thread steps
            beside the training thread: ``step_in_backward``, ``delayed_param_update``),
            independent of ``OMP_NUM_THREADS``.
        chunk_bytes (int | None): host master bytes per pipelined chunk. Default (``None``): 64 MiB,
            or 256 MiB with ``delayed_param_update`` (its H2D is off the critical path, and fewer,
            larger chunks step faster: W3 on the H200, delayed mode 407 -> 344 ms per step,
            benchmarks/NOTES.md).
        **kwargs: hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``, ...) for both
            halves; ``fused``/``foreach``/``capturable``/``differentiable`` go to the constructors (Adam/AdamW
            default to ``fused=True`` on both sides unless ``foreach=True`` or ``differentiable=True``
            is given; complex parameters, which torch's fused kernels refuse, then get torch's default
            non-fused path, as in ``torch.optim.AdamW()``, and the real ones stay fused).

    Raises:
        TypeError: ``offload_fraction``, ``cpu_threads`` or ``chunk_bytes`` of the wrong type.
        ValueError: a fraction outside ``[0, 1]``, conflicting modes, a bad ``chunk_bytes`` or
            ``cpu_threads``, parameters on several devices, or a hyper-parameter out of torch's
            range (``lr``, ``eps``, ``weight_decay``, ``momentum`` >= 0, ``0 <= betas[i] < 1``),
            in ``**kwargs`` or in a param group; a param group setting one of this optimizer's
            own options (``offload_fraction``, ...: per optimizer) to another value;
            ``fused=True`` with ``foreach=True`` or ``differentiable=True``; ``differentiable=True``
            with parameters the GPU half would step in place (leaves that require grad, which
            torch's differentiable optimizers refuse).
        TypeError: a non-bool flag (ours, or torch's ``amsgrad``/``maximize``/``nesterov``/``fused``/...,
            in ``**kwargs`` or a param group), a class that is not a torch optimizer, an
            accelerator-only class for the host part, a class whose ``step`` requires a closure
            (``torch.optim.LBFGS``: sub-optimizers are stepped without one), or a keyword that
            neither optimizer class accepts (e.g. ``lrr``, ``optimizer``; the message names the
            closest valid one), or a param group key that is a near miss of a valid one (``lrr``;
            other extra group keys, e.g. Megatron's ``wd_mult``, are kept unread as in torch), or an
            explicit ``fused=True`` with a complex parameter.

    ``defaults`` holds only plain values (no classes), so ``state_dict()`` loads with
    ``torch.load(weights_only=True)``. ``state[p]`` holds ``exp_avg``, ``exp_avg_sq``, ``step``
    and, where a separate master exists, ``master_param``; it *is* the sub-optimizer's state
    (one structure), and tensors moved elsewhere by the user are moved back before the next step.

    Example::

        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=3e-4,
                                    offload_gradients=True)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    # Note [GradScaler] in _amp.py: GradScaler.step hands over grad_scale/found_inf instead of unscaling p.grad
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Optional[type] = None,
        gpu_optimizer_cls: Optional[type] = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        *,
        offload_gradients: bool = False,
        step_in_backward: bool = False,
        delayed_param_update: bool = False,
        use_torch_optimizer_for_cpu_offload: bool = False,
        cpu_threads: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        # ---- validate everything before touching the model --------------------------------
        if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)):
            raise TypeError(
                f"HybridDeviceOptimizer: offload_fraction must be a number in [0, 1], got {offload_fraction!r} "
                f"({type(offload_fraction).__name__}); e.g. offload_fraction=0.5."
            )
        if not 0 <= offload_fraction <= 1:
            raise ValueError(
                f"HybridDeviceOptimizer: offload_fraction must be a number in [0, 1], got {offload_fraction!r}; "
                "0 keeps every parameter on the GPU, 1 steps all of them on the host."
            )
        flags = dict(
            param_update_in_fp32=param_update_in_fp32, pin_cpu_grads=pin_cpu_grads, pin_cpu_params=pin_cpu_params,
            overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d, offload_gradients=offload_gradients,
            step_in_backward=step_in_backward, delayed_param_update=delayed_param_update,
            use_torch_optimizer_for_cpu_offload=use_torch_optimizer_for_cpu_offload,
        )
        for k, v in flags.items():
            _flag(k, v)
        if not overlap_cpu_optimizer_d2h_h2d:
            for k in ("offload_gradients", "step_in_backward", "delayed_param_update"):
                if flags[k]:
                    raise ValueError(
                        f"HybridDeviceOptimizer: {k}=True needs overlap_cpu_optimizer_d2h_h2d=True (it works through the "
                        "backward hooks and the worker thread of the overlapped path); got overlap_cpu_optimizer_d2h_h2d=False."
                    )
        if step_in_backward and delayed_param_update:
            raise ValueError(
                "HybridDeviceOptimizer: step_in_backward=True and delayed_param_update=True are exclusive; pick one "
                "(delayed_param_update already hides the whole host step)."
            )
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)):
            raise TypeError(f"HybridDeviceOptimizer: cpu_threads must be None or a positive int, got {cpu_threads!r} "
                            f"({type(cpu_threads).__name__}).")
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"HybridDeviceOptimizer: cpu_threads must be None or a positive int, got {cpu_threads!r}.")
        if chunk_bytes is None:
            chunk_bytes = (256 << 20) if delayed_param_update else (64 << 20)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
            raise TypeError(f"HybridDeviceOptimizer: chunk_bytes must be None or a positive int (bytes), got {chunk_bytes!r} "
                            f"({type(chunk_bytes).__name__}); default 64 MiB (256 MiB with delayed_param_update).")
        if chunk_bytes < 1:
            raise ValueError(f"HybridDeviceOptimizer: chunk_bytes must be None or a positive int (bytes), got {chunk_bytes!r}; "
                             "default 64 MiB (256 MiB with delayed_param_update).")
        cpu_cls = torch.optim.AdamW if cpu_optimizer_cls is None else cpu_optimizer_cls
        _check_cls(cpu_cls, "cpu_optimizer_cls", host=True)
        if use_torch_optimizer_for_cpu_offload or gpu_optimizer_cls is None:
            gpu_cls = cpu_cls
        else:
            gpu_cls = gpu_optimizer_cls
            _check_cls(gpu_cls, "gpu_optimizer_cls", host=False)
        check_kwargs(kwargs, (cpu_cls, gpu_cls), (*_STRUCTURAL_KEYS, "cpu_optimizer_cls", "gpu_optimizer_cls"))
        if kwargs.get("foreach") and kwargs.get("fused"):
            raise ValueError(
                "HybridDeviceOptimizer: fused=True and foreach=True were both given; torch's optimizers take one "
                "implementation. Omit foreach (both halves then use the fused kernels) or pass fused=False."
            )
        if kwargs.get("fused") and kwargs.get("differentiable"):
            raise ValueError(
                "HybridDeviceOptimizer: fused=True and differentiable=True were both given; torch's fused kernels do not "
                "support differentiable=True. Omit fused (differentiable=True then uses torch's non-fused path on both "
                "halves) or pass differentiable=False."
            )
        check_values(kwargs)
        if 0.0 < float(offload_fraction) < 0.01 and "lr" not in kwargs:
            warnings.warn(
                f"HybridDeviceOptimizer: offload_fraction={offload_fraction!r} and no lr=. Its second positional "
                "parameter is offload_fraction (Megatron-Core's signature), not torch.optim.AdamW's lr: pass the "
                f"learning rate by keyword (lr={offload_fraction!r}). A fraction this small is meant only with an "
                "explicit lr= (which silences this).",
                UserWarning,
                stacklevel=2,
            )
        impl = {k: kwargs.pop(k) for k in _IMPL_KEYS if k in kwargs}
        defaults = _hyper_defaults(cpu_cls)
        defaults.update(kwargs)
        defaults.update(flags, offload_fraction=float(offload_fraction), cpu_threads=cpu_threads, chunk_bytes=chunk_bytes)

        self._built = False
        self._cpu_cls, self._gpu_cls = cpu_cls, gpu_cls  # add_param_group checks group keys against them
        super().__init__(params, defaults)
        self._built = True
        self.state = defaultdict(dict)
        self._fraction = float(offload_fraction)
        self._overlap = overlap_cpu_optimizer_d2h_h2d
        self._fp32 = param_update_in_fp32
        self._offload_grads = offload_gradients
        self._in_backward = step_in_backward
        self._delayed = delayed_param_update
        self._threads = thread_budget(cpu_threads, beside_training=step_in_backward or delayed_param_update)
        all_params = [p for g in self.param_groups for p in g["params"]]
        if impl.get("fused"):
            _refuse_complex_fused(self.param_groups)
        self._side = pick_side([local_tensor(p) for p in all_params])

        # ---- split ---------------------------------------------------------------------------
        side = self._side
        on_dev = lambda p: side.owns(local_tensor(p))  # noqa: E731
        chosen = choose_offloaded([g["params"] for g in self.param_groups], self._fraction, on_dev)
        host: list[HostSlot] = []
        self._dev_slots: list[DevSlot] = []
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                loc = local_tensor(p)
                if chosen[gi][pi]:
                    host.append(HostSlot(p, gi, pi, loc))
                else:
                    needs_master = self._fp32 and loc.dtype != torch.float32 and loc.is_floating_point()
                    inner = loc.detach().float() if needs_master else (p if loc is p else loc.detach())
                    self._dev_slots.append(DevSlot(p, gi, pi, loc, inner))
        if impl.get("differentiable"):
            leaves = [(d.group, d.index) for d in self._dev_slots if d.inner is d.param and d.param.requires_grad]
            if leaves:
                gi, pi = leaves[0]
                raise ValueError(
                    f"HybridDeviceOptimizer: differentiable=True, but the GPU half would step {len(leaves)} parameters in "
                    f"place (the first: parameter {pi} of param group {gi}), leaf tensors that require grad, which torch's "
                    "differentiable optimizers refuse (RuntimeError at the first step(), after the host half had already "
                    "stepped). Use offload_fraction=1.0 (the host steps plain copies), param_update_in_fp32=True for "
                    "non-fp32 parameters, or differentiable=False."
                )
        host.reverse()  # backward produces the last parameters' gradients first
        self._host_slots = host
        self._build_host(host, impl)
        self._build_dev(impl)
        self._slot_of: dict[int, Any] = {id(s.param): s for s in (*host, *self._dev_slots)}

        # ---- streams, hooks, worker ----------------------------------------------------------
        self._d2h = side.new_stream() if self._overlap else None
        self._h2d = side.new_stream() if self._overlap else None
        self._host_s = 0.0  # host optimizer compute of the current/last step, seconds
        self._timing = False  # CUDA timing events for Note [Step phases] (the benchmark turns it on)
        self._ph = StepPhases()  # stamps of the step in progress (Note [Step phases])
        self._last_ph: Optional[StepPhases] = None
        self._last_d2h_ev: Any = None
        self._lock = threading.Lock()  # delayed mode: worker vs step() on ``Chunk.pending`` / ``_applying``
        self._applying = False  # delayed mode: step() has begun, finished chunks go H2D at once
        # Note [Host-step sharding]: under DDP, annotate_offload.distributed gives each rank the host
        # chunks it steps (``owns(ci)``) and broadcasts the updated weights (``after_h2d()``); None: all.
        self._shard: Any = None
        self._h2d_skip: frozenset = frozenset()  # host slots whose weights the user replaced (no H2D)
        self._buf = 0  # which gradient buffer this step's D2H fills (two in delayed mode)
        self._seq = 0  # D2H issue counter: host chunks are stepped in the order their gradients landed
        self._begun = False
        self._closed = False
        self._amp: Optional[_amp.AmpStep] = None  # what a GradScaler asked of the step in progress
        self._hooks: list[Any] = []
        taken = claim([s.param for s in host], self)  # Note [One optimizer per parameter] in _pipeline.py
        if taken:
            first = host[taken[0]]
            warnings.warn(
                f"HybridDeviceOptimizer: {len(taken)} of its host-stepped parameters (e.g. parameter {first.index} of param "
                f"group {first.group}, shape {tuple(first.local.shape)}) belong to another HybridDeviceOptimizer that is "
                "still alive and not closed. This one takes over their gradient hooks; the older one copies their "
                "gradients at its own step() from now on. When an optimizer replaces another, call old.close().",
                UserWarning,
                stacklevel=2,
            )
        self._grad_vers: dict[int, tuple[torch.Tensor, int, int]] = {}  # Note [Gradient transforms that miss host gradients]
        self._clipped = False  # this optimizer's clip_grad_norm_ ran in the step in progress
        self._ran: set[int] = set()  # host chunks stepped in the step in progress (a failed step keeps the rest)
        self._warned_unseen = False
        if self._overlap:
            hooked: set[int] = set()
            for s in host:
                if s.param.requires_grad and not self._batched(s):
                    self._hooks.append(s.param.register_post_accumulate_grad_hook(_GradHook(self, s)))
                    hooked.add(id(s.param))
            if offload_gradients:  # the gradients left on the device (Note [Gradient transforms that miss host gradients])
                for p in (s.param for s in (*host, *self._dev_slots)):
                    if p.requires_grad and id(p) not in hooked:
                        self._hooks.append(p.register_post_accumulate_grad_hook(_VersionHook(self)))
        self._worker: Optional[CpuWorker] = None
        if self._overlap and (step_in_backward or delayed_param_update):
            self._worker = CpuWorker(self._threads, side.bind_thread)
            weakref.finalize(self, CpuWorker.close, self._worker)

    # ------------------------------------------------------------------ construction helpers
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Used by the constructor for each group; refused afterwards.

        Raises:
            OffloadError: called after construction (the split is fixed then).
            ValueError: a hyper-parameter out of range in the group, or a per-optimizer option
                (``offload_fraction``, ...) set to another value than the optimizer's.
            TypeError: a group key that is a near miss of a valid one (``lrr``), or a non-number value.
        """
        if getattr(self, "_built", False):
            raise OffloadError(
                "HybridDeviceOptimizer: add_param_group after construction is not supported (the host/GPU split, "
                "pinned buffers and hooks are fixed at construction); build a new HybridDeviceOptimizer with all groups."
            )
        if isinstance(param_group, dict):  # anything else: torch's own error
            where = f" in param group {len(self.param_groups)}"
            check_group_keys(param_group, where, (self._cpu_cls, self._gpu_cls),
                             {k: self.defaults[k] for k in _STRUCTURAL_KEYS})
            check_values(param_group, where)
        super().add_param_group(param_group)
        if isinstance(param_group, dict):
            group = self.param_groups[-1]
            try:
                seen: dict[int, int] = {}
                for j, p in enumerate(group["params"]):
                    if id(p) in seen:  # torch only warns; the host split stepped such a parameter twice
                        raise ValueError(
                            f"HybridDeviceOptimizer: param group {len(self.param_groups) - 1} lists the same parameter "
                            f"twice (positions {seen[id(p)]} and {j}, shape {tuple(p.shape)}); torch.optim warns that this "
                            "will be an error. List each parameter once."
                        )
                    seen[id(p)] = j
                check_with_torch(group, (self._cpu_cls, self._gpu_cls), where,
                                 [local_tensor(p).detach() for p in group["params"]])
            except ValueError:
                self.param_groups.pop()  # nothing half-applied
                raise

    # ------------------------------------------------------------------ introspection
    @property
    def placements(self) -> list[Placement]:
        """Where each parameter is stepped, in ``param_groups`` order (see :class:`Placement`)."""
        rows = [Placement(s.group, s.index, tuple(s.local.shape), s.local.numel(), "cpu", s.chunk) for s in self._host_slots]
        rows += [Placement(s.group, s.index, tuple(s.local.shape), s.local.numel(), "gpu", -1) for s in self._dev_slots]
        return sorted(rows, key=lambda r: (r.group, r.index))

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host optimizers (one per chunk) then the device optimizer, if any."""
        return [c.opt for c in self._chunks] + ([self._gpu_opt] if self._gpu_opt is not None else [])

    @property
    def offloaded_numel(self) -> int:
        """Elements stepped on the host."""
        return sum(s.local.numel() for s in self._host_slots)

    @property
    def host_step_seconds(self) -> float:
        """Host optimizer compute (the fused CPU kernel and the bf16 cast) of the last step, in seconds.

        Summed over chunks; in delayed mode it belongs to the step whose update is in flight.
        ``offloaded_numel / host_step_seconds`` is the host throughput in params/s.
        """
        return self._host_s

    @property
    def last_step_phases(self) -> dict[str, float]:
        """Where the last ``step()`` spent its time (Note [Step phases] in ``_phases.py``), in ms.

        Host times count from the ``step()`` call: ``return_ms``, ``first_chunk_ms`` /
        ``last_chunk_ms`` (host step of the first chunk began after its D2H wait / last chunk
        finished and its H2D was issued; negative when ``step_in_backward`` ran it during backward),
        ``host_busy_ms`` (optimizer compute summed over chunks), ``d2h_wait_ms`` (host step blocked on
        gradient copies), ``chunks``, ``host_gparams_s`` and the min/median/max per-chunk throughput
        in G params/s. ``d2h_done_ms``/``h2d_done_ms`` (last gradient D2H / last H2D finished,
        relative to the step entry on the compute stream) are NaN unless CUDA timing events were on
        (the benchmark's ``--phases``). In delayed mode the host fields describe the host work that
        this step submitted: call :meth:`flush` first. Empty before the first step.
        """
        return self._last_ph.summary() if self._last_ph is not None else {}

    @property
    def thread_budget(self) -> int:
        """Threads used by the host step (Note [Thread budget] in ``_threads.py``)."""
        return self._threads

    def __repr__(self) -> str:
        return (
            f"HybridDeviceOptimizer(offload_fraction={self._fraction}, host_params={len(self._host_slots)}, "
            f"host_numel={self.offloaded_numel}, gpu_params={len(self._dev_slots)}, chunks={len(self._chunks)}, "
            f"overlap={self._overlap}, threads={self._threads}, side={self._side!r})"
        )

    # ------------------------------------------------------------------ per-step bookkeeping
    def _sync_hyper(self) -> None:
        for c in self._chunks:
            for sub, g, keys in c.links:
                for k in keys:
                    sub[k] = g[k]
        for sub, g, keys in self._gpu_links:
            for k in keys:
                sub[k] = g[k]

    def _begin(self) -> None:
        """Once per step, before any host step: hyper-params, state placement, external weight loads."""
        if self._begun:
            return
        self._begun = True
        self._host_s = 0.0
        self._sync_hyper()
        self.move_state_to_right_device()
        self._resync_changed()

    def _resync_changed(self) -> None:
        # O03: weights written into the model after construction (load_state_dict copies in place and
        # bumps the version) re-seed the masters instead of being overwritten by stale copies.
        with torch.no_grad():
            for s in self._host_slots:
                if not self._steps_here(s.chunk):
                    continue  # its master is not used here; the owner re-seeds its own
                if s.param._version != s.p_ver:
                    s.master.copy_(s.local)
                    s.p_ver = s.param._version
                    c = self._chunks[s.chunk]
                    if s in c.pending:
                        c.pending.remove(s)
            for d in self._dev_slots:
                if d.has_master and d.param._version != d.p_ver:
                    d.inner.copy_(d.local)
                    d.p_ver = d.param._version

    def move_state_to_right_device(self) -> None:
        """Re-attach and re-place optimizer state after user code moved or replaced it.

        RL frameworks move ``opt.state`` tensors to the host and back between rollouts; tensors found
        on the wrong device are moved back (host-stepped params: CPU; others: their GPU), a replaced
        ``state[p]`` dict becomes the sub-optimizer's state again, and a replaced ``master_param`` is
        copied into the pinned master. Called automatically at every step.
        """
        for s in self._host_slots:
            opt = self._chunks[s.chunk].opt
            self._adopt(s.param, s.master, opt, s.master, s.sub_group)
        for d in self._dev_slots:
            assert self._gpu_opt is not None
            self._adopt(d.param, d.inner, self._gpu_opt, d.inner if d.has_master else None, d.sub_group)

    def _adopt(self, p: torch.Tensor, inner: torch.Tensor, opt: torch.optim.Optimizer, master: Optional[torch.Tensor],
               group: dict[str, Any]) -> None:
        st = self.state[p]
        if opt.state.get(inner) is not st:
            opt.state[inner] = st
        _state.place(st, inner, master, fused=_state.wants_device_step(group))

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step of both halves. Returns the closure's loss (called once) or ``None``.

        Under ``torch.amp.GradScaler`` (``scaler.step(opt)``) the scale and the inf/NaN check come
        from the scaler (Note [GradScaler] in ``_amp.py``): an inf/NaN step changes nothing, and
        results are bit-identical to the same optimizer class under GradScaler without offload.

        Raises:
            OffloadError: with ``step_in_backward=True``, a gradient changed after its chunk was
                stepped in backward; GradScaler with ``offload_gradients=True`` or
                ``step_in_backward=True``.
        """
        if self._closed:
            raise OffloadError(
                "HybridDeviceOptimizer.step: this optimizer was closed (close() stopped its host worker and removed its "
                "hooks); build a new HybridDeviceOptimizer to keep training."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        side = self._side
        ph = self._ph
        ph.t_call = time.perf_counter()
        if self._worker is not None and not self._in_backward and not self._delayed:
            self._worker.drain()  # nothing should be in flight; re-raise a failure of the last step's host work
        failed = True
        try:
            self._amp = _amp.begin(self)  # Note [GradScaler] in _amp.py; raises before anything is stepped
            cur = side.current_stream()
            if not self._overlap:
                self._begin()
                self._serial_step(cur)
            else:
                self._overlapped_step(cur)
            if self._shard is not None:
                self._shard.after_h2d()
            failed = False
            return loss
        finally:
            ph.t_return = time.perf_counter()
            self._end_step(failed)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle, torch.save(opt) and copy.deepcopy used to succeed, and the copy failed at its first
        # step() with an AttributeError (fresh-user report, eighth session)
        raise OffloadError(
            "HybridDeviceOptimizer cannot be pickled or copied (torch.save(opt), copy.deepcopy(opt)): it owns pinned "
            "host buffers, backward hooks on the model's parameters and, with step_in_backward or delayed_param_update, "
            "a worker thread, none of which outlive the process. Save opt.state_dict() instead and load it into a new "
            "HybridDeviceOptimizer built over the model (load_state_dict)."
        )

    def _check_device_half(self) -> bool:
        """Refuse, before any host chunk is stepped, what the device optimizer would refuse after
        the host half had stepped: a sparse gradient for a class without sparse support (torch's
        own error came from ``_gpu_step`` with the host chunks already stepped; fresh-user report,
        eighth session; the default mode now steps the device half first, the other modes still
        after their host chunks were submitted). Returns True when a class that takes sparse
        gradients (SGD, Adagrad) gets one: its configuration may still refuse it (weight decay,
        ``fused=True``), so ``step()`` then runs the device half first."""
        for d in self._dev_slots:
            g = local_grad(d.param)
            if g is None or g.layout is torch.strided:
                continue
            if issubclass(self._gpu_cls, _SPARSE_CAPABLE):
                return True
            raise TypeError(
                f"HybridDeviceOptimizer: parameter {d.index} of param group {d.group} (shape {tuple(d.local.shape)}), "
                f"stepped on the device, has a sparse gradient (layout={g.layout}), which "
                f"{self._gpu_cls.__name__} does not support; nothing was stepped. Use a dense embedding "
                "(nn.Embedding(..., sparse=False), the default), or step this parameter with torch.optim.SparseAdam "
                "outside this optimizer (leave it out of its params)."
            )
        return False

    def _overlapped_step(self, cur: Any) -> None:
        """``step()`` with overlap on; returns once the compute stream waits for this rank's H2D."""
        device_first = self._check_device_half()
        if self._offload_grads:
            msg = _unseen_transform(self)
            if msg is not None:
                warnings.warn(msg, UserWarning, stacklevel=3)
        side, ph = self._side, self._ph
        start = side.record(cur, self._timing)
        ph.entry_ev = start
        side.wait_event(self._d2h, start)
        side.wait_event(self._h2d, start)
        if self._delayed:
            self._apply_previous()
        self._begin()
        if device_first:  # a sparse gradient its configuration refuses raises before any host work
            self._gpu_step()
        self._collect(self._d2h)
        ph.d2h_ev = self._last_d2h_ev
        # Note [Exact mode steps on the training thread]: in the default mode nothing overlaps the
        # host step but the H2D copies (the GPU waits for the new weights), so a hand-off to a
        # worker thread bought nothing and cost a second Python thread during step(): a GIL
        # hand-off per chunk and a condition-variable wait. torchao's CPUOffloadOptimizer steps on
        # the training thread too. W3 on the H200 (benchmarks/NOTES.md, G2, six rotated rounds):
        # 407.1 ms median against 415.7 with the worker, faster in 4 of 6 pairs, D2H waits 2.2-2.7
        # against 3.3-4.8 ms per step. The GPU half is queued first so it runs during the host step.
        if self._worker is None:
            if not device_first:
                self._gpu_step()  # queued on the GPU first, so it runs while the host steps
            self._run_chunks_here(self._landing_order(), self._buf, self._h2d)
        else:
            for ci in self._landing_order():
                self._submit(ci)
            if not device_first:
                self._gpu_step()
        if self._delayed:
            self._buf ^= 1
        elif self._worker is not None:
            self._worker.drain()
        ph.h2d_ev = side.record(self._h2d, self._timing)
        side.wait_event(cur, ph.h2d_ev)

    def _apply_previous(self) -> None:
        """Delayed mode, at ``step()``: put the previous step's host update into the model.

        Backward is over, so the weights may change: chunks the worker already finished go H2D now,
        and the worker issues the H2D of each remaining chunk as soon as it finishes it (instead of
        all of them after the last one), so only the last chunk's copy is left after the host step.
        """
        assert self._worker is not None
        # weights written into the model since the last step (O03: load_state_dict) win over the pending
        # update: their H2D is skipped here and in the worker, and _resync_changed re-seeds their masters
        self._h2d_skip = frozenset(s for s in self._host_slots if s.param._version != s.p_ver)
        with self._lock:
            self._applying = True
            for c in self._chunks:
                if c.pending:
                    self._h2d_chunk(c, c.pending, self._h2d)
                    c.pending = []
        try:
            self._worker.drain()
        finally:
            with self._lock:
                self._applying = False
            self._h2d_skip = frozenset()

    def flush(self) -> None:
        """Finish host work in flight; in delayed mode also apply the pending update to the model.

        After it returns the model weights equal the host masters (cast to the model dtype).
        """
        if self._worker is not None:
            self._worker.drain()
        if self._delayed:
            side = self._side
            cur = side.current_stream()
            side.wait_event(self._h2d, side.record(cur))
            for c in self._chunks:
                if c.pending:
                    self._h2d_chunk(c, c.pending, self._h2d)
                    c.pending = []
            side.wait_event(cur, side.record(self._h2d))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients of every parameter, including the host-held ones of ``offload_gradients``.

        Raises:
            OffloadError: with ``step_in_backward=True``, after a backward whose host chunks were
                already stepped and no ``step()`` since (a skipped step): backward has applied it to
                the host half, and dropping the gradients now would leave the GPU half unstepped.
        """
        if self._in_backward and any(s.submitted for s in self._host_slots):
            raise OffloadError(
                "HybridDeviceOptimizer.zero_grad: step_in_backward=True already stepped host chunks in the last "
                "backward, and step() has not run since. A step cannot be skipped in this mode (for example on a "
                "non-finite loss): backward applied it to the host half. Call step() to finish it, or use "
                "step_in_backward=False in a loop that skips steps."
            )
        super().zero_grad(set_to_none=set_to_none)
        for c in self._chunks:  # step_in_backward: gradients that landed in a skipped step are dropped
            c.landed = 0
        for s in self._host_slots:
            s.use = False
            if (s.valid or s.consumed) and self._offload_grads and not set_to_none and local_grad(s.param) is None:
                # torch keeps a zero p.grad here; the host buffer is that gradient (Note [Offloaded
                # gradients are consumed by step()] in _pipeline.py)
                self._side.synchronize(s.d2h_ev)
                s.grad_bufs[self._buf].zero_()
                s.grad_ref = None
                s.valid, s.consumed = True, False
                continue
            s.valid = s.consumed = False
            s.grad_ref = None
            s.scales = []

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the gradients of all parameters of this optimizer, wherever they live.

        Same computation as ``torch.nn.utils.clip_grad_norm_`` over the parameters in
        ``param_groups`` order. Gradients already copied to the host (and, with
        ``offload_gradients``, freed on the GPU) are included: their norms are computed on the host
        and the coefficient is applied to the host copy (the fp32 product equals the GPU's).

        Returns:
            torch.Tensor: the total norm (0-dim, on the device of the first gradient).

        Raises:
            OffloadError: with ``step_in_backward=True`` (chunks are already stepped in backward).
        """
        if self._in_backward:
            raise OffloadError(
                "HybridDeviceOptimizer.clip_grad_norm_: not supported with step_in_backward=True, whose host chunks "
                "are stepped before the global norm exists; use the default mode to clip."
            )
        self._clipped = True
        return clip_hybrid(self, max_norm, norm_type, error_if_nonfinite, foreach)

    def reload_model_params(self) -> None:
        """Re-seed every master (host and GPU) from the model's current weights.

        Call after writing weights in a way that bypasses the version counter (``p.data.copy_``);
        ``model.load_state_dict`` is detected automatically at the next step.
        """
        self.flush()
        with torch.no_grad():
            for s in self._host_slots:
                s.master.copy_(s.local)
                s.p_ver = s.param._version
            for d in self._dev_slots:
                if d.has_master:
                    d.inner.copy_(d.local)
                    d.p_ver = d.param._version

    update_fp32_param_by_new_param = reload_model_params

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (masters included as separate tensors); ``weights_only``-loadable.

        Each param group also records the implementation switches (``fused``, ``foreach``,
        ``capturable``, ``differentiable``) its sub-optimizers actually use, where all of them agree
        (a group split between a fused and a non-fused path records none), so a plain
        ``torch.optim.AdamW`` that loads it keeps stepping like this optimizer (torch takes them from
        the loaded groups). ``param_groups`` itself does not hold them (they are constructor choices).

        With ``delayed_param_update=True`` it calls :meth:`flush` first, so the checkpoint holds the
        weights the masters hold: the pending host update goes into the model now rather than at the
        next ``step()``. A run that saves a checkpoint therefore differs from one that does not, in the
        one step of staleness the mode has (fresh-user report, seventh session: 3 steps, save, 3 more
        steps vs 6 uninterrupted steps); resuming from it matches the run that saved it, also when the
        model's own state dict was saved before this call (it then lacks the pending update, which
        :meth:`load_state_dict` writes back from the masters), provided the model is loaded first.

        Raises:
            OffloadError: the host step is sharded across DDP ranks (each rank holds the host state of
                its own chunks only; Note [Host-step sharding]).
        """
        if self._shard is not None:
            raise OffloadError(
                "HybridDeviceOptimizer.state_dict: under DDP this optimizer's host step is sharded across ranks "
                "(attach_optimizer(..., shard_host_step=True)), so each rank holds the host state of its own chunks only. "
                "Save with annotate_offload.distributed.save_checkpoint(model, opt, path) (or optimizer_state_dict) on every "
                "rank, or attach with shard_host_step=False to keep a full replica per rank."
            )
        self.flush()
        sd = super().state_dict()
        sd["state"] = {k: _state.detach_views(v) for k, v in sd["state"].items()}
        for packed, impl in zip(sd["param_groups"], self._impl_in_use()):
            packed.update(impl)  # packed groups are copies: param_groups is not touched
        return sd

    def _impl_in_use(self) -> list[dict[str, Any]]:
        """Per group, the ``_IMPL_KEYS`` values on which all of its sub-optimizer groups agree."""
        subs: dict[int, list[dict[str, Any]]] = {}
        for links in (*(c.links for c in self._chunks), self._gpu_links):
            for sub, g, _ in links:
                subs.setdefault(id(g), []).append(sub)
        out = []
        for g in self.param_groups:
            ss = subs.get(id(g), [])
            impl = {}
            for k in _IMPL_KEYS:
                vals = [sub[k] for sub in ss if k in sub]
                if vals and len(vals) == len(ss) and all(v is vals[0] or v == vals[0] for v in vals):
                    impl[k] = vals[0]
            out.append(impl)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from any ``HybridDeviceOptimizer`` (any fraction) or a torch Adam(W).

        State tensors are placed where this optimizer steps each parameter, in the inner dtype
        (fp32 masters and moments are never down-cast to the model dtype). A ``master_param``
        wider than its parameter (fp32 for a bf16 model) is copied into the existing (pinned)
        master, and the next ``step()`` writes it into the model, as Megatron's masters do: load
        the model and the optimizer from the same checkpoint. A master of the parameter's own dtype
        is taken from the model instead, so loading an optimizer state alone never changes the
        weights, as with torch's optimizers. With ``delayed_param_update`` every host master is
        loaded and written into the model before this returns (the masters run one update ahead,
        and a model file saved before ``state_dict()`` lacks that update): load the model first,
        then the optimizer. Hyper-parameters come from the state dict,
        structural options (fraction, modes) and implementation switches (``fused``, ``foreach``,
        ``capturable``, ``differentiable``: chosen at construction) stay this optimizer's.

        Raises:
            ValueError: the number of groups or of parameters per group differs.
        """
        self.flush()
        _state.load(self, state_dict, (*_STRUCTURAL_KEYS, *_IMPL_KEYS))
        if self._delayed:  # Note [Loading masters] in _state.py: the loaded masters become the weights
            with torch.no_grad():
                for ci, c in enumerate(self._chunks):
                    c.pending = list(c.slots) if self._steps_here(ci) else []
                    for s in c.pending:
                        if s.staging is not None:
                            s.staging.copy_(s.master)
            self.flush()

    def close(self) -> None:
        """Finish pending work, remove the backward hooks and stop the worker thread (idempotent).

        ``step()`` afterwards raises ``OffloadError``.
        """
        if self._closed:
            return
        self.flush()
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._worker.close()
