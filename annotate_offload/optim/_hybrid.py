"""``HybridDeviceOptimizer``: a fraction of the parameters is stepped on the host (private module).

The optimizer is a ``torch.optim.Optimizer`` made of a device sub-optimizer and a
:class:`~._pipeline.HostPipeline` (the host half: Note [Host step lifecycle] in ``_pipeline.py``).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from ..errors import OffloadError
from . import _amp
from ._device import pick_side
from ._pipeline import IMPL_KEYS, STRUCTURAL_KEYS, HostPipeline, impl_for, sub_optimizer
from ._split import Placement, choose_offloaded, local_grad, local_tensor
from ._state import Entry, check_load, detach_views, place, probe
from ._threads import thread_budget

__all__ = ["HybridDeviceOptimizer"]

_CLASS_KEYS = ("cpu_optimizer_cls", "gpu_optimizer_cls")
# accelerator-only implementations: they do not run on host tensors (TE's FusedAdam corrupts them silently)
_GPU_ONLY = ("apex", "transformer_engine", "deepspeed.ops.adam.fused_adam", "deepspeed.ops.lamb")


def _name(cls: type) -> str:
    return f"torch.optim.{cls.__qualname__}" if cls.__module__.startswith("torch.optim.") else f"{cls.__module__}.{cls.__qualname__}"


def _check_cls(cls: Any, name: str, *, host: bool) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"HybridDeviceOptimizer: {name}={cls!r}: pass a torch.optim.Optimizer subclass, e.g. "
                        "torch.optim.AdamW.")
    if host and cls.__module__.startswith(_GPU_ONLY):
        raise TypeError(f"HybridDeviceOptimizer: {name}={_name(cls)} only runs on the GPU, but it would step the host "
                        "part. Use torch.optim.AdamW/Adam (fused on the CPU) or torch.optim.SGD for the host part.")


def _signature(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    prms = dict(inspect.signature(cls.__init__).parameters)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in prms.values())
    return {k: p for k, p in prms.items() if k not in ("self", "params") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}, var_kw


def _check_hyper(checks: list[tuple[str, type, list, dict]], hyper: dict[str, Any], where: str) -> None:
    """Let each torch class judge the hyper-parameters it takes: ``checks`` holds ``(name, class, like,
    switches)``; the class is built with them and stepped once on tensors ``like`` the ones it will step
    (:func:`~._state.probe`), so what its constructor or its first step would refuse is refused now.

    Raises:
        TypeError, ValueError: ``HybridDeviceOptimizer: <name>=<value><where>: <the fix> (<the class's
            message>)``; also for a flag that is not a bool and a non-finite ``lr``, which torch takes.
    """
    if "lr" in hyper and isinstance(hyper["lr"], (int, float)) and not math.isfinite(hyper["lr"]):
        raise ValueError(f"HybridDeviceOptimizer: lr={hyper['lr']!r}{where}: pass a finite learning rate.")
    for role, cls, like, impl in checks:
        sig, var_kw = _signature(cls)
        kw = {k: v for k, v in {**hyper, **impl}.items() if var_kw or k in sig}
        for k, v in kw.items():
            d = sig[k].default if k in sig else None
            if not isinstance(v, bool) and (isinstance(d, bool) or (k in IMPL_KEYS and v is not None)):
                raise TypeError(f"HybridDeviceOptimizer: {k}={v!r}{where}: pass True or False"
                                f"{' or None' if k in IMPL_KEYS else ''}; {_name(cls)} takes a bool.")
        err = probe(cls, kw, like)[1]
        if err is None:
            continue
        base = probe(cls, {}, like)[1]
        if base is not None:
            raise TypeError(f"HybridDeviceOptimizer: {role}={_name(cls)}: pass a class that can step these parameters "
                            f"with step() and no closure, as HybridDeviceOptimizer steps it ({base}).") from None
        k = next((k for k in kw if probe(cls, {k: kw[k]}, like)[1] is not None), None)
        if k is None:  # a combination: the first value whose removal is accepted
            k = next((k for k in kw if probe(cls, {j: v for j, v in kw.items() if j != k}, like)[1] is None), None)
        what = f"{k}={kw[k]!r}" if k is not None else ", ".join(f"{k}={v!r}" for k, v in kw.items())
        raise (TypeError if isinstance(err, TypeError) else ValueError)(
            f"HybridDeviceOptimizer: {what}{where}: pass a value that {_name(cls)} accepts ({err}).") from None


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Adam(W)/SGD with a fraction of the parameters stepped on the host, pipelined with the GPU.

    Megatron-Core's ``HybridDeviceOptimizer`` signature and meaning. The first ``offload_fraction``
    of the trainable parameters (by numel, whole tensors, param-group order: ``placements``) get host
    masters, host gradient buffers and host optimizer state and are stepped by ``cpu_optimizer_cls``
    (torch's fused CPU AdamW by default), one instance per chunk of about ``chunk_bytes`` of masters
    (``cpu_optimizers``); the rest are stepped on the GPU by ``gpu_optimizer_cls`` (``gpu_optimizer``).
    With overlap (the default) each host-stepped gradient goes D2H from its post-accumulate-grad hook
    during backward; ``step()`` queues the GPU half, steps the host chunks in the order their
    gradients landed, and sends each chunk's new weights back H2D (in the model's dtype) while the next
    is stepped. ``step()`` returns once the compute stream waits on the last H2D.

    Numerics are those of the sub-optimizer classes on the same inputs: on a CPU-only machine both
    halves run torch's fused CPU kernel and results are bit-identical to
    ``torch.optim.AdamW(params, fused=True)``; on a GPU the CPU and CUDA kernels differ in the last bits.

    Args:
        params (iterable): parameters or param-group dicts. CUDA parameters (one device) are split;
            CPU parameters are always stepped on the host (on a machine without CUDA the "GPU side" is
            CPU tensors). DTensors (FSDP2) are stepped through their local shards.
        offload_fraction (float): share of the trainable device numel stepped on the host, in
            ``[0, 1]``. Default: ``0.5``.
        cpu_optimizer_cls (type | None): host optimizer class. Default: ``torch.optim.AdamW``.
        gpu_optimizer_cls (type | None): device optimizer class. Default: the host class.
        param_update_in_fp32 (bool): fp32 masters for non-fp32 parameters (on the host for offloaded
            ones, on the GPU otherwise); weights go back in the model dtype. Default: ``False``.
        pin_cpu_grads (bool): page-lock the host gradient buffers. Default: ``True``.
        pin_cpu_params (bool): page-lock the host masters and the bf16 staging. Default: ``True``.
        overlap_cpu_optimizer_d2h_h2d (bool): the pipelined path above; ``False`` is a serial path
            (all D2H at ``step()`` on the compute stream, a sync, the host step, all H2D). Host
            parameters under 4096 elements get no hook; ``step()`` copies their gradients in one batch.
            Default: ``True``.
        offload_gradients (bool): free each host-stepped parameter's device gradient once its D2H is
            enqueued (``p.grad`` becomes ``None``); the gradient lives on the host until ``step()``
            consumes it, micro-batches accumulate there, and this optimizer's ``clip_grad_norm_`` sees
            it (``torch.nn.utils.clip_grad_norm_`` does not: ``step()`` warns once). Not with
            GradScaler. Needs overlap. Default: ``False``.
        step_in_backward (bool): step each host chunk in a worker thread as soon as its gradients
            landed in backward: one backward per step, no clipping or unscaling across parameters
            (a gradient changed after its chunk was stepped raises ``OffloadError`` at ``step()``).
            Needs overlap. Default: ``False``.
        delayed_param_update (bool): ZeRO-Offload's one-step-delayed update of the host part: the
            host step of step ``t`` runs in a worker thread during forward/backward of ``t + 1`` and
            its weights are applied at ``step()`` ``t + 1`` (changes numerics). :meth:`flush` applies
            the pending update. Needs overlap. Default: ``False``.
        use_torch_optimizer_for_cpu_offload (bool): use the host class for the GPU part too
            (Megatron's meaning). Default: ``False``.
        cpu_threads (int | None): threads for the host step, at most ``len(os.sched_getaffinity(0))``.
            Default: usable CPUs / ``LOCAL_WORLD_SIZE``, minus one with a worker thread (Note [Thread
            budget] in ``_threads.py``), whatever ``OMP_NUM_THREADS`` says.
        chunk_bytes (int | None): host master bytes per chunk. Default: 64 MiB, 256 MiB with
            ``delayed_param_update``.
        **kwargs: hyper-parameters for both classes (``lr``, ``betas``, ``eps``, ``weight_decay``, ...)
            and their implementation switches (``fused``, ``foreach``, ``capturable``,
            ``differentiable``). Adam(W) gets ``fused=True`` unless ``foreach`` or
            ``differentiable`` is given (complex parameters then get torch's default path).

    Raises:
        TypeError: an option of the wrong type, a keyword neither class takes, a class that is not a
            torch optimizer or cannot step the host part (GPU-only, sparse-only, closure-only).
        ValueError: a fraction outside ``[0, 1]``, conflicting modes, ``chunk_bytes < 1``,
            ``cpu_threads`` outside ``[1, usable CPUs]``, parameters on several devices, a
            hyper-parameter the torch class refuses (its message follows ours) or a non-finite ``lr``,
            a param group that lists a parameter twice or sets a per-optimizer option.

    ``state[p]`` *is* the sub-optimizer's state for ``p`` (``exp_avg``, ``exp_avg_sq``, ``step``, and
    ``master_param`` where a separate master exists); it holds nothing before the first step.
    ``state_dict()`` loads with ``torch.load(weights_only=True)``. After an exception in ``step()``
    every parameter is either stepped or untouched; the exception's ``untouched_params`` lists the
    untouched ones (indices in ``param_groups`` order) and calling ``step()`` again steps exactly those.

    Example::

        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=3e-4)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    _step_supports_amp_scaling = True  # Note [GradScaler] in _amp.py

    def __init__(self, params: Iterable[Any], offload_fraction: float = 0.5, cpu_optimizer_cls: Optional[type] = None,
                 gpu_optimizer_cls: Optional[type] = None, param_update_in_fp32: bool = False, pin_cpu_grads: bool = True,
                 pin_cpu_params: bool = True, overlap_cpu_optimizer_d2h_h2d: bool = True, *, offload_gradients: bool = False,
                 step_in_backward: bool = False, delayed_param_update: bool = False,
                 use_torch_optimizer_for_cpu_offload: bool = False, cpu_threads: Optional[int] = None,
                 chunk_bytes: Optional[int] = None, **kwargs: Any) -> None:
        # ---- validate everything before touching the model
        if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)):
            raise TypeError(f"HybridDeviceOptimizer: offload_fraction={offload_fraction!r}: pass a number in [0, 1].")
        if not 0 <= offload_fraction <= 1:
            raise ValueError(f"HybridDeviceOptimizer: offload_fraction={offload_fraction!r}: pass a number in [0, 1] "
                             "(0 keeps every parameter on the GPU, 1 steps all of them on the host).")
        flags = dict(param_update_in_fp32=param_update_in_fp32, pin_cpu_grads=pin_cpu_grads, pin_cpu_params=pin_cpu_params,
                     overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d, offload_gradients=offload_gradients,
                     step_in_backward=step_in_backward, delayed_param_update=delayed_param_update,
                     use_torch_optimizer_for_cpu_offload=use_torch_optimizer_for_cpu_offload)
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise TypeError(f"HybridDeviceOptimizer: {k}={v!r}: pass True or False.")
        for k in ("offload_gradients", "step_in_backward", "delayed_param_update"):
            if flags[k] and not overlap_cpu_optimizer_d2h_h2d:
                raise ValueError(f"HybridDeviceOptimizer: {k}=True: pass overlap_cpu_optimizer_d2h_h2d=True too (it works "
                                 "through the backward hooks of the overlapped path).")
        if step_in_backward and delayed_param_update:
            raise ValueError("HybridDeviceOptimizer: step_in_backward=True, delayed_param_update=True: pick one; they "
                             "are exclusive.")
        threads = thread_budget(cpu_threads, beside_training=step_in_backward or delayed_param_update)
        if chunk_bytes is None:
            chunk_bytes = (256 if delayed_param_update else 64) << 20
        elif isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"HybridDeviceOptimizer: chunk_bytes={chunk_bytes!r}: pass None or a positive int (bytes).")
        cpu_cls = torch.optim.AdamW if cpu_optimizer_cls is None else cpu_optimizer_cls
        _check_cls(cpu_cls, "cpu_optimizer_cls", host=True)
        gpu_cls = cpu_cls if use_torch_optimizer_for_cpu_offload or gpu_optimizer_cls is None else gpu_optimizer_cls
        _check_cls(gpu_cls, "gpu_optimizer_cls", host=False)
        self._classes = (cpu_cls, gpu_cls)
        sigs = [_signature(c) for c in self._classes]
        for k, v in kwargs.items():
            if not any(var_kw or k in sig for sig, var_kw in sigs):
                err = probe(cpu_cls, {k: v}, [(torch.float32, "cpu", 1)])[1]
                raise TypeError(f"HybridDeviceOptimizer: {k}={v!r}: remove it or use a keyword of {_name(cpu_cls)} "
                                f"({', '.join(sigs[0][0])}) ({err}).")
        if 0.0 < offload_fraction < 0.01 and "lr" not in kwargs:
            warnings.warn(f"HybridDeviceOptimizer: offload_fraction={offload_fraction!r} and no lr=. The second positional "
                          "parameter is offload_fraction (Megatron-Core's signature), not torch.optim.AdamW's lr: pass the "
                          f"learning rate by keyword (lr={offload_fraction!r}).", UserWarning, stacklevel=2)
        self._impl = {k: kwargs.pop(k) for k in IMPL_KEYS if k in kwargs}
        self._fp32 = param_update_in_fp32
        defaults = {k: p.default for k, p in sigs[0][0].items() if k not in IMPL_KEYS and p.default is not p.empty}
        defaults.update(kwargs, **flags, offload_fraction=float(offload_fraction), cpu_threads=cpu_threads,
                        chunk_bytes=chunk_bytes, cpu_optimizer_cls=cpu_optimizer_cls, gpu_optimizer_cls=gpu_optimizer_cls)
        self._built = False
        super().__init__(params, defaults)  # add_param_group checks each group
        self._closed, self._built = False, True

        # ---- split, host pipeline, device optimizer
        flat_params = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])]
        side = pick_side([local_tensor(p) for _, _, p in flat_params])
        chosen = choose_offloaded([g["params"] for g in self.param_groups], float(offload_fraction),
                                  lambda p: side.owns(local_tensor(p)))
        host = [(p, i, gi, pi, local_tensor(p)) for i, (gi, pi, p) in enumerate(flat_params) if chosen[gi][pi]]
        self.pipeline = HostPipeline(
            host, self.param_groups, cpu_cls, self._impl, side=side, fp32=param_update_in_fp32,
            pin_params=pin_cpu_params, pin_grads=pin_cpu_grads, chunk_bytes=chunk_bytes, overlap=overlap_cpu_optimizer_d2h_h2d,
            offload_grads=offload_gradients, in_backward=step_in_backward, delayed=delayed_param_update, threads=threads,
            others=[p for gi, pi, p in flat_params if not chosen[gi][pi]], begin=self._begin)
        inner: dict[int, torch.Tensor] = {}
        parts: dict[int, list[torch.Tensor]] = {}
        for i, (gi, pi, p) in enumerate(flat_params):
            if not chosen[gi][pi]:
                loc = local_tensor(p)
                master = param_update_in_fp32 and loc.is_floating_point() and loc.dtype != torch.float32
                inner[i] = loc.detach().float() if master else p if loc is p else loc.detach()
                parts.setdefault(gi, []).append(inner[i])
        self.gpu_optimizer: Optional[torch.optim.Optimizer] = None
        self._dev_links: list = []
        if parts:
            self.gpu_optimizer, self._dev_links = sub_optimizer(
                gpu_cls, [(self.param_groups[gi], ts) for gi, ts in parts.items()], *impl_for(gpu_cls, self._impl, host=False))
        self.cpu_optimizers = self.pipeline.optimizers
        sub_group = {id(t): g for o in self.sub_optimizers for g in o.param_groups for t in g["params"]}
        self._entries: list[Entry] = []
        for i, (gi, pi, p) in enumerate(flat_params):
            loc = local_tensor(p)
            if chosen[gi][pi]:
                t = self.pipeline.master(p)
                opt = self.cpu_optimizers[self.pipeline.chunk_of(p)]
                self._entries.append(Entry(p, i, gi, pi, loc, t, opt, sub_group[id(t)], t, True))
            else:
                t = inner[i]
                self._entries.append(Entry(p, i, gi, pi, loc, t, self.gpu_optimizer, sub_group[id(t)],  # type: ignore[arg-type]
                                           t if t is not loc and t.dtype != loc.dtype else None, False))
        self._masters = [e for e in self._entries if not e.host and e.inner is not e.param]  # device half
        self._ver = {e.flat: e.param._version for e in self._masters}
        # Megatron-Core's maps (its DistributedOptimizer and tests read them)
        self.param_to_inner_param = {e.param: e.inner for e in self._entries}
        self.inner_param_to_orig_param = {e.inner: e.param for e in self._entries}
        self.param_to_fp32_param = {e.param: e.inner for e in self._entries
                                    if e.inner.dtype == torch.float32 and e.local.dtype != torch.float32 and e.master is not None}
        self.gpu_params_map_cpu_copy = {e.param: e.inner for e in self._entries if e.host}
        self.cpu_copys_map_gpu_param = {e.inner: e.param for e in self._entries if e.host}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Used by the constructor for each group; refused afterwards.

        Raises:
            OffloadError: called after construction (the split is fixed then).
            ValueError: a hyper-parameter the torch class refuses, a parameter listed twice, or a
                per-optimizer option (``offload_fraction``, ...) set to another value than the optimizer's.
            TypeError: a hyper-parameter of the wrong type.
        """
        if getattr(self, "_built", False):
            raise OffloadError("HybridDeviceOptimizer: add_param_group after construction is not supported (the host/GPU "
                               "split and host buffers are fixed then); build a new HybridDeviceOptimizer with all groups.")
        where = f" in param group {len(self.param_groups)}"
        if isinstance(param_group, dict):
            for k in (*STRUCTURAL_KEYS, *_CLASS_KEYS):
                if k in param_group and not _same(param_group[k], self.defaults[k]):
                    raise ValueError(f"HybridDeviceOptimizer: {k}={param_group[k]!r}{where}: pass it to the constructor "
                                     f"and remove it from the group; it is per optimizer (this one's: {self.defaults[k]!r}).")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        for k in _CLASS_KEYS:
            g.pop(k, None)
        try:
            seen: dict[int, int] = {}
            for j, p in enumerate(g["params"]):
                if id(p) in seen:
                    raise ValueError(f"HybridDeviceOptimizer: param group {len(self.param_groups) - 1} lists the same "
                                     f"parameter twice (positions {seen[id(p)]} and {j}, shape {tuple(p.shape)}); list it once.")
                seen[id(p)] = j
            _check_hyper(self._checks(g["params"]), self._hyper(g), where)
        except (TypeError, ValueError):
            self.param_groups.pop()  # nothing half-applied
            raise

    def _checks(self, params: list[torch.Tensor]) -> list[tuple[str, type, list, dict]]:
        """What :func:`_check_hyper` probes: each class with the user's switches, on tensors like those it
        would step for ``params`` (host class: host masters; device class: parameters or fp32 masters)."""
        like = {(t.dtype, t.device, t.dim()) for t in (local_tensor(p) for p in params)} or {(torch.float32, "cpu", 1)}
        fp32 = {(torch.float32 if self._fp32 and d.is_floating_point else d, v, n) for d, v, n in like}
        host_impl = impl_for(self._classes[0], self._impl, host=True)[0]
        if "fused" not in self._impl:
            host_impl.pop("fused", None)  # ours, not the user's: Note [Complex parameters]
        return [("cpu_optimizer_cls", self._classes[0], sorted({(d, "cpu", n) for d, _, n in fp32}, key=str), host_impl),
                ("gpu_optimizer_cls", self._classes[1], sorted(fp32, key=str), self._impl)]

    @staticmethod
    def _hyper(g: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in g.items() if k not in ("params", "param_names") and k not in STRUCTURAL_KEYS}

    # ------------------------------------------------------------------ introspection
    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host optimizers (one per chunk), then the device optimizer if any (Megatron's order)."""
        return self.cpu_optimizers + ([self.gpu_optimizer] if self.gpu_optimizer is not None else [])

    @property
    def placements(self) -> list[Placement]:
        """Where each parameter is stepped, in ``param_groups`` order (see :class:`Placement`)."""
        return [Placement(e.group, e.index, tuple(e.local.shape), e.local.numel(), "cpu" if e.host else "gpu",
                          self.pipeline.chunk_of(e.param) if e.host else -1) for e in self._entries]

    @property
    def offloaded_numel(self) -> int:
        """Elements stepped on the host."""
        return sum(e.local.numel() for e in self._entries if e.host)

    @property
    def thread_budget(self) -> int:
        """Threads used by the host step (Note [Thread budget] in ``_threads.py``)."""
        return self.pipeline.threads

    def __repr__(self) -> str:
        n = sum(e.host for e in self._entries)
        return (f"HybridDeviceOptimizer(offload_fraction={self.defaults['offload_fraction']}, host_params={n}, "
                f"host_numel={self.offloaded_numel}, gpu_params={len(self._entries) - n}, "
                f"chunks={len(self.cpu_optimizers)}, threads={self.thread_budget})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError("HybridDeviceOptimizer cannot be pickled or copied (torch.save(opt), copy.deepcopy(opt)): it "
                           "owns pinned host buffers, backward hooks and possibly a worker thread. Save opt.state_dict() "
                           "and load it into a new HybridDeviceOptimizer (load_state_dict).")

    # ------------------------------------------------------------------ per step
    def _sync_hyper(self) -> None:
        for sub, g, keys in (*self.pipeline.links, *self._dev_links):
            for k in keys:
                sub[k] = g[k]

    def _begin(self) -> None:
        """Once per step, before anything is stepped: hyper-parameters (LR schedulers write
        ``param_groups``), state placement, and masters of weights loaded since the last step."""
        self._sync_hyper()
        self._place_state()
        self.pipeline.resync()
        with torch.no_grad():
            for e in self._masters:
                if e.master is not None and e.param._version != self._ver[e.flat]:
                    e.inner.copy_(e.local)
                    self._ver[e.flat] = e.param._version

    def _place_state(self) -> list[Entry]:
        """Make ``state[p]`` the sub-optimizer's state again after user code replaced or moved it (moved
        tensors go back where ``p`` is stepped; a replaced ``master_param`` is copied into the master).
        Runs at every step; returns the entries whose master was replaced."""
        out = []
        for e in self._entries:
            st = self.state.get(e.param)
            if st:
                if e.master is not None and st.get("master_param", e.master) is not e.master:
                    out.append(e)
                place(e, st)
        return out

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """Megatron's DistributedOptimizer calls this after writing a checkpoint into ``state[p][key]``:
        the state reaches the sub-optimizers, and a written ``master_param`` is the master from now on
        (the weights loaded before it do not re-seed it)."""
        written = self._place_state()
        self.pipeline.note_written([e.param for e in written if e.host])
        for e in written:
            if not e.host:
                self._ver[e.flat] = e.param._version

    def _publish_state(self) -> None:
        for e in self._entries:
            st = e.opt.state.get(e.inner)
            if st:
                if self.state.get(e.param) is not st:
                    self.state[e.param] = st
                if e.master is not None and "master_param" not in st:
                    st["master_param"] = e.master

    def _device_step(self, amp: Optional[_amp.AmpStep]) -> None:
        opt = self.gpu_optimizer
        if opt is None:
            return
        if amp is not None and amp.scale is not None and not _amp.supports(opt):  # Note [GradScaler]
            grads = [g for e in self._entries if not e.host and (g := local_grad(e.param)) is not None]
            _amp.unscale_(grads, _amp.inverse(amp.scale))
        for e in self._masters:
            g = local_grad(e.param)
            e.inner.grad = None if g is None else g.to(e.inner.dtype)
        with _amp.handed_over(opt, amp, host=False):
            opt.step()
        for e in self._masters:
            if e.inner.grad is not None:
                e.inner.grad = None
                if e.master is not None:
                    e.local.copy_(e.inner)
                    self._ver[e.flat] = e.param._version

    def _failed(self, exc: BaseException, host: list[int]) -> None:
        dev = [] if self.pipeline.device_done else [e.flat for e in self._entries if not e.host]
        exc.untouched_params = idx = sorted({*dev, *host})  # type: ignore[attr-defined]
        exc.add_note(f"HybridDeviceOptimizer: {len(idx)} of {len(self._entries)} parameters were not updated "
                     "(untouched_params: their indices in param_groups order); the others were. Call step() again to "
                     "step exactly those, once, or zero_grad() to drop them.")

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of both halves; returns the closure's loss (called once) or ``None``.

        Under ``torch.amp.GradScaler`` (``scaler.step(opt)``) the scale and the inf/NaN check come
        from the scaler (Note [GradScaler]); results are bit-identical to the same classes under
        GradScaler without offload.

        Raises:
            OffloadError: the optimizer was closed; with ``step_in_backward=True`` a gradient changed
                after its chunk was stepped in backward; GradScaler with ``offload_gradients`` or
                ``step_in_backward``. Any exception carries ``untouched_params`` (see the class docs).
        """
        if self._closed:
            raise OffloadError("HybridDeviceOptimizer.step: this optimizer was closed (close() stopped its worker and "
                               "removed its hooks); build a new HybridDeviceOptimizer to keep training.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self.pipeline.step(self._device_step, lambda: _amp.begin(self))
        except BaseException as e:
            self._failed(e, self.pipeline.untouched())
            raise
        finally:
            self._publish_state()
        return loss

    def flush(self) -> None:
        """Finish host work in flight; in delayed mode also write the pending update into the model, so
        the weights equal the host masters (cast to the model dtype)."""
        try:
            self.pipeline.flush()
        except BaseException as e:
            self._failed(e, self.pipeline.untouched())
            raise
        finally:
            self._publish_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter, the host-held ones of ``offload_gradients`` included.

        Raises:
            OffloadError: with ``step_in_backward=True``, after a backward that stepped host chunks and
                no ``step()`` since (a step cannot be skipped in that mode).
        """
        self.pipeline.zero_grad(set_to_none)
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters (``param_groups`` order),
        wherever their gradients live: host-held ones (``offload_gradients``) are included and get the
        same fp32 multiply on the host.

        Returns:
            torch.Tensor: the total norm (0-dim, on the first parameter's device).

        Raises:
            OffloadError: with ``step_in_backward=True`` (chunks are stepped before the norm exists).
        """
        if self.defaults["step_in_backward"]:
            raise OffloadError("HybridDeviceOptimizer.clip_grad_norm_: not supported with step_in_backward=True, whose "
                               "host chunks are stepped before the global norm exists; use the default mode to clip.")
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            grads = [g for p in params if (g := local_grad(p) if p.grad is not None else self.pipeline.held_grad(p)) is not None]
            if not grads:
                return torch.tensor(0.0)
            total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            by_dev: dict[torch.device, list[torch.Tensor]] = {}
            for p in params:
                if (g := local_grad(p)) is not None:
                    by_dev.setdefault(g.device, []).append(g)
            with self.pipeline.scaling(coef):
                for d, gs in by_dev.items():
                    torch._foreach_mul_(gs, coef.to(d))
        return total.to(params[0].device)

    def reload_model_params(self) -> None:
        """Re-seed every master (host and GPU) from the model's current weights.

        Call after writing weights in a way that bypasses the version counter (``p.data.copy_``);
        ``model.load_state_dict`` is seen at the next step.
        """
        self.pipeline.reseed()
        with torch.no_grad():
            for e in self._masters:
                if e.master is not None:
                    e.inner.copy_(e.local)
                    self._ver[e.flat] = e.param._version

    update_fp32_param_by_new_param = reload_model_params  # Megatron's name

    def dummy_step(self) -> None:
        """Megatron's ``dummy_step``: create the optimizer state (so a checkpoint can be loaded into it in
        place) without changing any weight: one step on zero gradients at ``lr=0``, then every state
        tensor but the masters set to zero, as before a first step."""
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        lrs = [g["lr"] for g in self.param_groups]
        for p in params:
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
        with torch.no_grad():
            for st in self.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and k != "master_param":
                        v.zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, masters included; ``weights_only``-loadable.

        Each group also records the implementation switches (``fused``, ``foreach``, ``capturable``,
        ``differentiable``) its sub-optimizers use where they all agree, so a plain torch optimizer
        that loads it steps the same way. With ``delayed_param_update`` it calls :meth:`flush` first.

        Raises:
            OffloadError: the host step is sharded across DDP ranks (each holds its own chunks' state:
                save with ``annotate_offload.distributed.save_checkpoint``).
        """
        if self.pipeline.sharded:
            raise OffloadError("HybridDeviceOptimizer.state_dict: the host step is sharded across DDP ranks "
                               "(attach_optimizer(..., shard_host_step=True)), so each rank holds the host state of its "
                               "own chunks only. Save with annotate_offload.distributed.save_checkpoint(model, opt, path) "
                               "on every rank, or attach with shard_host_step=False.")
        self.flush()
        sd = super().state_dict()
        sd["state"] = {k: detach_views(v) for k, v in sd["state"].items()}
        subs: dict[int, list[dict]] = {}
        for sub, g, _ in (*self.pipeline.links, *self._dev_links):
            subs.setdefault(id(g), []).append(sub)
        for packed, g in zip(sd["param_groups"], self.param_groups):
            ss = subs.get(id(g), [])
            for k in IMPL_KEYS:
                vals = [s[k] for s in ss if k in s]
                if vals and len(vals) == len(ss) and all(_same(v, vals[0]) for v in vals):
                    packed[k] = vals[0]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of any ``HybridDeviceOptimizer`` (any fraction) or torch optimizer of the same class.

        Everything is checked before anything is applied (Note [Validated loads] in ``_state.py``), so
        a refused load changes nothing. State tensors are cast and moved as torch does, to where this
        optimizer steps each parameter (the inner dtype: fp32 moments are never down-cast). A
        ``master_param`` wider than its parameter (fp32 for a bf16 model) is copied into the master and
        reaches the model at the next step, as Megatron's do: load the model and the optimizer from the
        same checkpoint. A master of the parameter's own dtype is re-seeded from the model instead, so an
        optimizer state loaded alone never changes the weights (in delayed mode every host master is
        loaded and written into the model: load the model first). Hyper-parameters come from the state
        dict; this optimizer's own options and implementation switches stay.

        Raises:
            ValueError: a state dict that does not fit this optimizer (another number of groups or
                parameters, a state tensor of another shape, a non-floating moment, a non-tensor where a
                tensor belongs, a hyper-parameter the class refuses, a non-finite ``lr``): the message
                names the parameter, the key, and what was expected and found.
            TypeError: a hyper-parameter of the wrong type.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        self.flush()

        def check(gi: int, hyper: dict[str, Any]) -> None:
            _check_hyper(self._checks(self.param_groups[gi]["params"]), self._hyper(hyper),
                         f" in param group {gi} of the state dict")

        hypers, states = check_load(state_dict, self._entries, self.param_groups, check)
        delayed = self.defaults["delayed_param_update"]
        for g, h in zip(self.param_groups, hypers):
            g.update(h)
        with torch.no_grad():
            for e in self._entries:
                st = states[e.flat]
                saved = st.pop("master_param", None)
                if e.master is not None:
                    # Note [Loading masters]: a master of the model's own dtype is the weight, and the
                    # model is its authority; a wider one holds bits the model does not, so it is loaded
                    # (every host master in delayed mode, where the masters run one update ahead)
                    wide = e.master.dtype != e.local.dtype or (delayed and e.host)
                    e.master.copy_(saved if wide and saved is not None else e.local)
                    if st:
                        st["master_param"] = e.master
                if st:
                    self.state[e.param] = e.opt.state[e.inner] = st
                else:
                    self.state.pop(e.param, None)
                    e.opt.state.pop(e.inner, None)
        self.pipeline.note_written()
        self._ver = {e.flat: e.param._version for e in self._masters}
        self._sync_hyper()
        if delayed:
            self.pipeline.push_masters()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def close(self) -> None:
        """Finish pending work, then remove the backward hooks and stop the worker thread (idempotent).

        The clean-up always runs; an error of the pending work is raised after it. ``step()`` afterwards
        raises ``OffloadError``.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self.pipeline.close()


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # e.g. a multi-element tensor
        return False
