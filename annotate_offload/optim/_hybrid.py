"""``HybridDeviceOptimizer``: a fraction of the parameters is stepped on the host (private module).

The optimizer is a ``torch.optim.Optimizer`` made of a device sub-optimizer and a
:class:`~._pipeline.HostPipeline`, the host half (Note [Host step lifecycle] in ``_pipeline.py``).

Note [GradScaler]: ``GradScaler.unscale_`` rescales ``p.grad`` in place without bumping its version,
so a host copy would look current while still scaled. The optimizer therefore declares
``_step_supports_amp_scaling`` (torch's fused optimizers' contract): ``GradScaler.step`` sets
``grad_scale`` and ``found_inf`` instead. A step with ``found_inf`` steps nothing; otherwise each
sub-optimizer gets the scale as torch's fused optimizers do, or GradScaler's own unscale first when its
class lacks the support: bit-identical to the same class under GradScaler. After ``scaler.unscale_``
every host copy is made again. ``offload_gradients`` and ``step_in_backward`` miss the inf check: refused.

Note [Validated loads]: torch's ``Optimizer.load_state_dict`` checks only counts, and a moment of the
wrong shape reaches the fused kernel, which reads or writes out of bounds. ``_check_load`` checks
everything against what the class itself creates (:func:`_probe`) and builds the converted state
aside, so a refused load changes nothing.
"""

from __future__ import annotations

import copy
import inspect
import math
import operator
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ..errors import OffloadError
from ._pipeline import (IMPL_KEYS, STRUCTURAL_KEYS, AmpStep, HostPipeline, Placement, Side, Slot, amp_step,
                        choose_offloaded, impl_for, local_grad, local_tensor, sub_optimizer, takes_scale, thread_budget)

__all__ = ["HybridDeviceOptimizer"]

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

    Megatron-Core's ``HybridDeviceOptimizer``, same signature and meaning: the first
    ``offload_fraction`` of the trainable parameters (numel, whole tensors, param-group order:
    ``placements``) are stepped by ``cpu_optimizer_cls`` on host masters (one instance per chunk of
    about ``chunk_bytes``: ``cpu_optimizers``), the rest by ``gpu_optimizer_cls`` (``gpu_optimizer``).
    Results are the sub-optimizer classes' on the same inputs: bit-identical to
    ``torch.optim.AdamW(params, fused=True)`` on a CPU-only machine.

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
        chunk_bytes (int | None): host master bytes per chunk. Default: 64 MiB (256 MiB delayed).
        **kwargs: hyper-parameters and switches (``fused``, ``foreach``, ...) of both classes; Adam(W)
            gets ``fused=True`` unless ``foreach`` or ``differentiable`` is given.

    Raises:
        TypeError: an option of the wrong type, a keyword neither class takes, a class that cannot step
            its part (GPU-only on the host, sparse- or closure-only).
        ValueError: an option out of range or modes that do not combine, a value the class refuses (its
            message follows), a non-finite ``lr``, a parameter listed twice, several devices.

    ``state[p]`` *is* the sub-optimizer's state of ``p`` (``master_param`` where a separate master
    exists), empty before the first step. After an exception in ``step()`` each parameter is stepped
    or untouched: ``exc.untouched_params`` lists the untouched (``param_groups`` order), and
    ``step()`` again steps exactly those, once.

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
                f"HybridDeviceOptimizer: offload_fraction={offload_fraction!r}: pass a number in [0, 1] (the host's "
                "share of the numel).")
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
        if chunk_bytes is None:
            chunk_bytes = (256 if delayed_param_update else 64) << 20
        elif isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"HybridDeviceOptimizer: chunk_bytes={chunk_bytes!r}: pass None or a positive int.")
        cpu_cls = torch.optim.AdamW if cpu_optimizer_cls is None else cpu_optimizer_cls
        gpu_cls = cpu_cls if use_torch_optimizer_for_cpu_offload or gpu_optimizer_cls is None else gpu_optimizer_cls
        for name, cls in (("cpu_optimizer_cls", cpu_cls), ("gpu_optimizer_cls", gpu_cls)):
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise TypeError(f"HybridDeviceOptimizer: {name}={cls!r}: pass a torch.optim.Optimizer subclass, e.g. "
                                "torch.optim.AdamW.")
        if cpu_cls.__module__.startswith(_GPU_ONLY):
            raise TypeError(f"HybridDeviceOptimizer: cpu_optimizer_cls={_name(cpu_cls)} only runs on the GPU, but "
                            "it would step the host part: pass torch.optim.AdamW/Adam (fused on the CPU) or "
                            "torch.optim.SGD.")
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
        host = choose_offloaded([p for _, _, p in flat], float(offload_fraction),
                                lambda p: not side.cuda or local_tensor(p).is_cuda)
        self._slots = [Slot(p, i, gi, pi, host[i], param_update_in_fp32) for i, (gi, pi, p) in enumerate(flat)]
        self.pipeline = HostPipeline([s for s in self._slots if s.host], self.param_groups, cpu_cls, self._impl,
                                     self.defaults, side=side, threads=threads, begin=self._begin)
        self.cpu_optimizers = [c.opt for c in self.pipeline.chunks]
        self.gpu_optimizer: Optional[torch.optim.Optimizer] = None
        if dev := [s for s in self._slots if not s.host]:
            self.gpu_optimizer = sub_optimizer(gpu_cls, self.param_groups, dev,
                                               *impl_for(gpu_cls, self._impl, host=False))
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
                               "host/GPU split and host buffers are fixed then); build a new HybridDeviceOptimizer "
                               "with all groups.")
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
        """Let each torch class judge the hyper-parameters it takes: build it over tensors like those it would
        step for ``params`` (host masters; device parameters or masters) and step it once (:func:`_probe`);
        its refusal is re-raised naming the value and the fix first. Refused here, though torch takes them: a
        non-bool switch, a non-finite ``lr``."""
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
                                "parameters with step() and no closure, as HybridDeviceOptimizer steps it "
                                f"({base}).") from None
            k = next((k for k in kw if _probe(cls, {j: v for j, v in kw.items() if j != k}, on)[1] is None), None)
            what = f"{k}={kw[k]!r}" if k is not None else ", ".join(f"{k}={v!r}" for k, v in kw.items())
            raise (TypeError if isinstance(err, TypeError) else ValueError)(
                f"HybridDeviceOptimizer: {what}{where}: pass a value that {_name(cls)} accepts ({err}).") from None

    # ------------------------------------------------------------------ introspection
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
        """Threads of the host step (Note [Thread budget] in ``_pipeline.py``)."""
        return self.pipeline.threads

    def __repr__(self) -> str:
        n = len(self.gpu_params_map_cpu_copy)
        return (f"HybridDeviceOptimizer(offload_fraction={self.defaults['offload_fraction']}, host_params={n}, "
                f"host_numel={self.offloaded_numel}, gpu_params={len(self._slots) - n}, "
                f"chunks={len(self.cpu_optimizers)}, threads={self.thread_budget})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError("HybridDeviceOptimizer cannot be pickled or copied (torch.save(opt), copy.deepcopy(opt)): "
                           "it owns pinned host buffers, backward hooks and possibly a worker thread. Save "
                           "opt.state_dict() and load it into a new HybridDeviceOptimizer.")

    # ------------------------------------------------------------------ per step
    def _sync_hyper(self) -> None:
        """Push the groups' hyper-parameters (LR schedulers write ``param_groups``) into the sub-optimizers'
        groups. They share the value objects, so a group none of whose values was replaced is current."""
        for gi, g in enumerate(self.param_groups):
            vals, seen = list(g.values()), self._seen[gi]
            if len(vals) != len(seen) or not all(map(operator.is_, vals, seen)):
                self._seen[gi] = vals
                for sub, keys in self._links[gi]:
                    sub.update((k, g[k]) for k in keys)

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
        with torch.no_grad():
            for s in (*self._masters, *self.pipeline.slots):
                if s.master is not None and (everything or s.param._version != s.p_ver):
                    s.master.copy_(s.local)
                    s.p_ver = s.param._version

    def _sync_hdo_state_to_sub_optimizers(self, adopt: bool = True) -> None:
        """Make ``state[p]`` the sub-optimizer's state again after user code replaced or moved it (Megatron's
        DistributedOptimizer writes a checkpoint into ``state[p][key]``, then calls this), its tensors where
        ``p`` is stepped; a replaced ``master_param`` is copied into the master (``adopt``: weights loaded
        before it do not re-seed it). Every step runs it: no ``.device``, no ``.to()`` when all is in place."""
        for p, st in self.state.items():  # no tensor-keyed lookups: they hash through Python
            if not st or (s := self._by_id.get(id(p))) is None:
                continue
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
                        with torch.no_grad():
                            s.master.copy_(v)
                        st[k] = s.master
                elif k == "step":
                    st[k] = _step(v, s)  # v itself when in place
                elif v.get_device() != dev:
                    st[k] = v.to(s.inner.device)

    def _amp_begin(self) -> Optional[AmpStep]:
        """What a GradScaler set on this optimizer for this ``step()``, or ``None`` (Note [GradScaler])."""
        if (found := getattr(self, "found_inf", None)) is None:
            return None
        for flag in ("offload_gradients", "step_in_backward"):
            if self.defaults[flag]:
                raise OffloadError(f"HybridDeviceOptimizer: GradScaler with {flag}=True is not supported (Note "
                                   "[GradScaler]): the host gradients miss the scaler's inf/NaN check. Build the "
                                   f"optimizer with {flag}=False to train with GradScaler (fp16).")
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
            grads = [g for s in self._slots if not s.host and (g := local_grad(s.param)) is not None]
            for (dev, _), ([gs], _) in (_group_tensors_by_device_and_dtype([grads]) if grads else {}).items():
                inv = amp.scale.double().reciprocal().float().to(dev)  # as GradScaler.unscale_ computes it
                torch._amp_foreach_non_finite_check_and_unscale_(gs, torch.zeros((), device=dev), inv)
        for s in self._masters:
            g = local_grad(s.param)
            s.inner.grad = None if g is None else g.to(s.inner.dtype)
        amp_step(opt, amp, host=False)
        for s in self._masters:
            if s.inner.grad is not None:
                s.inner.grad = None
                if s.master is not None:
                    s.local.copy_(s.inner)
                    s.p_ver = s.param._version

    def _outcome(self, call: Callable[..., None], *args: Any) -> None:
        """``call(*args)``, a pipeline call: ``state[p]`` gets the state created, and an exception the
        parameters it left untouched (Note [Failed steps] in ``_pipeline.py``)."""
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

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of both halves (Note [GradScaler] under a scaler); returns the closure's loss or ``None``.

        Raises:
            OffloadError: closed; a gradient changed after ``step_in_backward`` stepped it; GradScaler with
                ``offload_gradients`` or ``step_in_backward``. Any exception carries ``untouched_params``.
        """
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
        were stepped in backward cannot be skipped (``OffloadError``)."""
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
            grads = [local_grad(p) if p.grad is not None else self.pipeline.held_grad(p) for p in params]
            if not (grads := [g for g in grads if g is not None]):
                return torch.tensor(0.0)
            total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            dev = [local_grad(p) for p in params if p.grad is not None]
            with self.pipeline.scaling(coef):
                for (d, _), ([gs], _) in (_group_tensors_by_device_and_dtype([dev]) if dev else {}).items():
                    torch._foreach_mul_(gs, coef.to(d))
        return total.to(params[0].device)

    def reload_model_params(self) -> None:
        """Re-seed every master (host and GPU) from the model's weights: call after writing weights in a
        way that bypasses the version counter (``p.data.copy_``); ``model.load_state_dict`` is seen by itself."""
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

        Everything is checked first (Note [Validated loads]): a refused load
        (``ValueError``/``TypeError`` naming parameter, key, expected and found) changes nothing.
        Note [Loading masters]: a ``master_param`` wider than its parameter is loaded and reaches the
        model at the next step; one of the model's dtype is re-seeded from the model, so loading an
        optimizer state alone never changes weights (delayed mode loads every host master, one update
        ahead, and writes them into the model: load the model first). This optimizer's own options stay.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        self.flush()
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
                s.p_ver = s.param._version
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
    except (TypeError, ValueError, RuntimeError, NotImplementedError, AssertionError) as err:
        return None, err


def _desc(v: Any) -> str:
    if torch.is_tensor(v):
        return f"a tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    return f"{type(v).__name__} {v!r:.80}"


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
