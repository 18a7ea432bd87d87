"""Construction helpers of :class:`HybridDeviceOptimizer`: checks, host buffers, sub-optimizers (private).

Each host chunk gets its own instance of the host optimizer class over the chunk's masters (one
fused multi-tensor call per chunk, not one optimizer per parameter); the device side gets one
instance over all GPU-stepped tensors. Sub-optimizer groups copy the hyper-parameters of the
HybridDeviceOptimizer group they come from; ``_links`` records which keys to push down each step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from ._host import carve
from ._slots import Chunk, DevSlot, HostSlot
from ._split import make_chunks, split_serial

__all__: list[str] = []

# Implementation switches of torch optimizers: passed to the constructors, never kept in param_groups.
_IMPL_KEYS = ("foreach", "capturable", "differentiable", "fused")
# Our own constructor options; they live in ``defaults`` (so ``cls(params, **opt.defaults)`` rebuilds
# the optimizer) but are never pushed into the sub-optimizers nor taken from a loaded state dict.
_STRUCTURAL_KEYS = (
    "offload_fraction", "param_update_in_fp32", "pin_cpu_grads", "pin_cpu_params",
    "overlap_cpu_optimizer_d2h_h2d", "offload_gradients", "step_in_backward",
    "delayed_param_update", "use_torch_optimizer_for_cpu_offload", "cpu_threads", "chunk_bytes",
)
# Known accelerator-only optimizer implementations: they do not run on host tensors (and TE's
# FusedAdam silently corrupts them, NVIDIA-NeMo/RL #3544).
_GPU_ONLY_MODULES = ("apex", "transformer_engine", "deepspeed.ops.adam.fused_adam", "deepspeed.ops.lamb")


def _hyper_defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, prm in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "params") or name in _IMPL_KEYS or prm.default is inspect.Parameter.empty:
            continue
        if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
            continue
        out[name] = prm.default
    return out


def _check_cls(cls: Any, name: str, *, host: bool) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"HybridDeviceOptimizer: {name} must be a torch.optim.Optimizer subclass, got {cls!r}; "
            "pass e.g. torch.optim.AdamW."
        )
    if host and (cls.__module__.startswith(_GPU_ONLY_MODULES) or (cls.__name__.startswith("Fused") and not cls.__module__.startswith("torch."))):
        raise TypeError(
            f"HybridDeviceOptimizer: {name}={cls.__module__}.{cls.__name__} only runs on the GPU, but it would step "
            "host (CPU) tensors here (TE FusedAdam does so silently and corrupts the state, NVIDIA-NeMo/RL #3544). "
            "Use torch.optim.AdamW/Adam (fused on CPU) or torch.optim.SGD for the host part."
        )
    if host and issubclass(cls, torch.optim.SparseAdam):
        raise TypeError(
            f"HybridDeviceOptimizer: {name}=torch.optim.SparseAdam needs sparse gradients, but the host part copies "
            "gradients into dense pinned buffers (its first step() would fail with 'SparseAdam does not support dense "
            "gradients'). Step sparse embeddings with torch.optim.SparseAdam outside this optimizer, and give this one "
            "the dense parameters (torch.optim.AdamW, the default)."
        )
    if _needs_closure(cls):
        raise TypeError(
            f"HybridDeviceOptimizer: {name}={cls.__module__}.{cls.__name__} needs a closure in step(), but "
            "HybridDeviceOptimizer calls the closure once itself and steps its sub-optimizers without one (the host part "
            "per chunk of parameters). Use a closure-free class: torch.optim.AdamW (default), "
            "torch.optim.Adam or torch.optim.SGD."
        )


def _needs_closure(cls: type) -> bool:
    """True when ``cls.step`` has a ``closure`` parameter without a default (``torch.optim.LBFGS``)."""
    try:
        prm = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):  # no introspectable signature: let the class be
        return False
    return prm is not None and prm.default is inspect.Parameter.empty and prm.kind not in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"HybridDeviceOptimizer: {name} must be a bool, got {value!r}.")
    return value



def _master_of(s: HostSlot) -> torch.Tensor:
    return s.master


def _inner_of(s: DevSlot) -> torch.Tensor:
    return s.inner


class BuildMixin:
    """The construction half of :class:`HybridDeviceOptimizer` (state it sets: ``_chunks``, ``_gpu_opt``, links)."""

    def _build_host(self, host: list[HostSlot], impl: dict[str, Any]) -> None:
        pin_p = self.defaults["pin_cpu_params"] and self._side.can_pin
        pin_g = self.defaults["pin_cpu_grads"] and self._side.can_pin
        mdt = [torch.float32 if (self._fp32 and s.local.is_floating_point()) else s.local.dtype for s in host]
        numels = [s.local.numel() for s in host]
        masters, self._masters_pinned = self._carve_mixed(numels, mdt, pin_p)
        nbuf = 2 if self._delayed else 1
        bufs = [self._carve_mixed(numels, mdt, pin_g)[0] for _ in range(nbuf)]
        staged = [i for i, s in enumerate(host) if mdt[i] != s.local.dtype]
        stage_views, _ = self._carve_mixed([numels[i] for i in staged], [host[i].local.dtype for i in staged], pin_p)
        for i, s in enumerate(host):
            shape = s.local.shape
            s.master = masters[i].view(shape)
            s.grad_bufs = [b[i].view(shape) for b in bufs]
        for j, i in enumerate(staged):
            host[i].staging = stage_views[j].view(host[i].local.shape)
        with torch.no_grad():
            for s in host:
                s.master.copy_(s.local)
                s.p_ver = s.param._version
        host_impl = dict(impl)
        split = False
        if self._cpu_cls in (torch.optim.Adam, torch.optim.AdamW) and not host_impl.get("foreach") and not host_impl.get("differentiable"):
            split = "fused" not in host_impl  # fused=True is our default, not the user's: Note [Complex parameters]
            host_impl.setdefault("fused", True)
            host_impl.pop("capturable", None)
        sizes = [s.master.numel() * s.master.element_size() for s in host]
        order = split_serial(make_chunks(sizes, self.defaults["chunk_bytes"]), [s.master.numel() for s in host], sizes,
                             self.defaults["chunk_bytes"])
        self._chunks: list[Chunk] = []
        for ci, (idx, serial) in enumerate(order):
            slots = [host[i] for i in idx]
            by_group: dict[int, list[HostSlot]] = {}
            for s in slots:
                s.chunk = ci
                by_group.setdefault(s.group, []).append(s)
            opt, links = self._sub_opt(self._cpu_cls, by_group, _master_of, host_impl, split)
            self._chunks.append(Chunk(slots, opt, links, serial=serial))

    def _carve_mixed(self, numels: list[int], dtypes: list[torch.dtype], pin: bool) -> tuple[list[torch.Tensor], bool]:
        out: list[Optional[torch.Tensor]] = [None] * len(numels)
        ok = True
        for dt in dict.fromkeys(dtypes):
            idx = [i for i, d in enumerate(dtypes) if d == dt]
            views, pinned = carve([numels[i] for i in idx], dt, pin=pin, what=f"{dt} host buffers")
            ok &= pinned or not pin
            for i, v in zip(idx, views):
                out[i] = v
        return out, ok  # type: ignore[return-value]

    def _build_dev(self, impl: dict[str, Any]) -> None:
        dev_impl = dict(impl)
        split = False
        if self._gpu_cls in (torch.optim.Adam, torch.optim.AdamW) and "foreach" not in dev_impl and not dev_impl.get("differentiable"):
            split = "fused" not in dev_impl
            dev_impl.setdefault("fused", True)
        by_group: dict[int, list[DevSlot]] = {}
        for s in self._dev_slots:
            by_group.setdefault(s.group, []).append(s)
        self._gpu_opt: Optional[torch.optim.Optimizer] = None
        self._gpu_links: list[tuple[dict, dict, tuple]] = []
        if not by_group:
            return
        self._gpu_opt, self._gpu_links = self._sub_opt(self._gpu_cls, by_group, _inner_of, dev_impl, split)
        for s in self._dev_slots:
            s.p_ver = s.param._version

    def _sub_opt(self, cls: type, by_group: dict[int, list[Any]], inner: Callable[[Any], torch.Tensor],
                 impl: dict[str, Any], split_complex: bool) -> tuple[torch.optim.Optimizer, list[tuple[dict, dict, tuple]]]:
        """One sub-optimizer over the slots of ``by_group`` (HDO group index -> slots), stepping ``inner(slot)``.

        Sets each slot's ``sub_group`` and ``self.state[param]``. Note [Complex parameters]: torch's
        fused Adam(W) refuses complex tensors, which plain ``torch.optim.AdamW()`` (``fused=None``)
        steps with its for-loop/foreach path. With ``split_complex`` (``fused=True`` is our default,
        not the user's) the complex tensors of a group get a sub-group of their own with
        ``fused=None``: torch's default path for exactly those tensors, while the real ones keep the
        fused kernel (a model without complex parameters gets the same sub-groups as before).
        """
        parts: list[tuple[int, list[Any], dict[str, Any]]] = []
        for gi, ss in by_group.items():
            cplx = [s for s in ss if inner(s).is_complex()] if split_complex else []
            real = [s for s in ss if not inner(s).is_complex()] if cplx else ss
            if real:
                parts.append((gi, real, self._sub_group(gi, [inner(s) for s in real])))
            if cplx:
                d = self._sub_group(gi, [inner(s) for s in cplx])
                d.setdefault("fused", None)  # a group's own "fused" is the user's choice
                parts.append((gi, cplx, d))
        opt = cls([d for _, _, d in parts], **impl)
        links = self._links(opt, [gi for gi, _, _ in parts])
        for (_, part, _), sub in zip(parts, opt.param_groups):
            for s in part:
                s.sub_group = sub
                self.state[s.param] = opt.state[inner(s)]
        return opt, links

    def _sub_group(self, gi: int, tensors: list[torch.Tensor]) -> dict[str, Any]:
        g = self.param_groups[gi]
        d = {k: v for k, v in g.items() if k != "params" and k not in _STRUCTURAL_KEYS}
        d["params"] = tensors
        return d

    def _links(self, opt: torch.optim.Optimizer, gis: list[int]) -> list[tuple[dict, dict, tuple]]:
        out = []
        for sub, gi in zip(opt.param_groups, gis):
            g = self.param_groups[gi]
            keys = tuple(k for k in sub if k != "params" and k in g and k not in _STRUCTURAL_KEYS)
            out.append((sub, g, keys))
        return out

