"""Import-guarded loaders for the peers the benchmarks time annotate_offload against.

A loader never raises for a missing or broken peer: it returns a :class:`PeerInfo` saying why, and
the benchmark row reports that instead of a number. None of the peers is a dependency:

- activation offload (``activations.py``): TRL's ``OffloadActivations`` (+ ``NoOpManager``), else
  torchtune's;
- optimizer offload (``optimizer.py``): torchao's ``CPUOffloadOptimizer`` and Megatron-Core's
  ``HybridDeviceOptimizer``. ``megatron.core`` imports triton and more at package import; its
  ``hybrid_optimizer.py`` needs only torch, so when the package import fails that file is loaded alone.

Note [Peer hooks outlive the peer]: torchao's ``CPUOffloadOptimizer`` registers a post-accumulate-
grad hook on every parameter it offloads and drops the handle; the hook closes over the optimizer,
so ``del opt`` frees nothing, and every later backward on that model still copies each gradient to
the dead optimizer's buffers and, with ``offload_gradients=True``, sets ``p.grad = None``. An
optimizer timed after it on the same model (Megatron's HDO skips a parameter without a gradient
silently) would then time a step that does nothing. :func:`make_torchao_cpu_offload_optimizer`
therefore ties the hooks to the optimizer (``close()``, or collecting it, removes them), and
:func:`make_megatron_hybrid_device_optimizer` refuses to step a trainable parameter without a gradient.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PeerInfo:
    """``name``, whether it imported, its distribution version, and where from (or why not)."""

    name: str
    available: bool
    version: str | None
    detail: str

    def describe(self) -> str:
        if self.available:
            return f"{self.name} {self.version or '?'} ({self.detail})"
        return f"{self.name}: not importable ({self.detail})"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:160]


def load_offload_activations() -> tuple[PeerInfo, type | None, type | None]:
    """``(info, OffloadActivations, NoOpManager)`` from TRL, else torchtune; classes ``None`` when neither imports."""
    errors = []
    for dist, module_name in (("trl", "trl.models.activation_offloading"),
                              ("torchtune", "torchtune.training._activation_offloading")):
        try:
            module = importlib.import_module(module_name)
            return (PeerInfo(f"{dist} OffloadActivations", True, _version(dist), module_name),
                    module.OffloadActivations, module.NoOpManager)
        except Exception as exc:  # ImportError, or a peer broken against this torch
            errors.append(f"{dist}: {_why(exc)}")
    return PeerInfo("trl/torchtune OffloadActivations", False, None, "; ".join(errors)), None, None


def load_torchao_cpu_offload_optimizer() -> tuple[PeerInfo, type | None]:
    """``(info, torchao.optim.CPUOffloadOptimizer)``; the class is ``None`` when torchao does not import."""
    # CPUOffloadOptimizer is pure Python; torchao's compiled kernels are built for one torch release
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception as exc:
        return PeerInfo("torchao CPUOffloadOptimizer", False, None, _why(exc)), None
    return PeerInfo("torchao CPUOffloadOptimizer", True, _version("torchao"), "torchao.optim"), CPUOffloadOptimizer


_HDO_MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
_HDO_ALONE = "_benchmarks_megatron_hdo"


def load_megatron_hybrid_device_optimizer() -> tuple[PeerInfo, type | None]:
    """``(info, HybridDeviceOptimizer)`` of Megatron-Core: the package import, else its file alone."""
    name, version = "Megatron-Core HybridDeviceOptimizer", _version("megatron-core")
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
            warnings.simplefilter("ignore")
            return PeerInfo(name, True, version, _HDO_MODULE), importlib.import_module(_HDO_MODULE).HybridDeviceOptimizer
    except Exception as exc:
        package_error = _why(exc)
    try:
        spec = importlib.util.find_spec("megatron")  # a namespace package: megatron.core does not run
        roots = list(spec.submodule_search_locations or []) if spec else []
    except Exception:
        roots = []
    path = next((p for p in (os.path.join(r, "core/optimizer/cpu_offloading/hybrid_optimizer.py") for r in roots)
                 if os.path.isfile(p)), None)
    if path is None:
        return PeerInfo(name, False, version, package_error), None
    module = sys.modules.get(_HDO_ALONE)
    if module is None:  # load once: one class object per process
        try:
            spec = importlib.util.spec_from_file_location(_HDO_ALONE, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[_HDO_ALONE] = module
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(_HDO_ALONE, None)
            return PeerInfo(name, False, version, f"{package_error}; file load: {_why(exc)}"), None
    return PeerInfo(name, True, version, f"{path} loaded alone"), module.HybridDeviceOptimizer


def _remove(entries: list) -> None:
    for hooks, key in entries:
        hooks.pop(key, None)


class _WeakHook:
    """Calls a hook through a weak reference: the parameter no longer keeps the hook's owner alive."""

    __slots__ = ("_ref",)

    def __init__(self, fn) -> None:
        self._ref = weakref.ref(fn)

    def __call__(self, param: torch.Tensor) -> None:
        fn = self._ref()
        if fn is not None:
            fn(param)


def make_torchao_cpu_offload_optimizer(params, *, lr: float = 1e-4, offload_gradients: bool = False, **adamw):
    """torchao's ``CPUOffloadOptimizer`` over fused ``torch.optim.AdamW``, with removable gradient hooks
    (Note [Peer hooks outlive the peer]); ``None`` when torchao does not import.

    ``params`` are CUDA parameters (torchao refuses CPU ones). The result's ``close()`` removes the
    hooks; dropping the last reference and ``gc.collect()`` removes them too.
    """
    _, cls = load_torchao_cpu_offload_optimizer()
    if cls is None:
        return None
    params = list(params)
    before = {id(p): set(getattr(p, "_post_accumulate_grad_hooks", None) or ()) for p in params}
    opt = cls(params, torch.optim.AdamW, offload_gradients=offload_gradients, fused=True, lr=lr, **adamw)
    entries, keep = [], []
    for p in {id(p): p for p in params}.values():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        for key in [k for k in hooks if k not in before[id(p)]]:
            keep.append(hooks[key])
            hooks[key] = _WeakHook(hooks[key])
            entries.append((hooks, key))
    opt._benchmark_hooks = keep  # opt -> hook -> opt: a cycle that gc.collect() frees
    opt.close = weakref.finalize(opt, _remove, entries)
    return opt


def _require_grads(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook: every trainable parameter has ``.grad`` (or Megatron's ``.decoupled_grad``)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    missing = sum(1 for p in params if p.grad is None and getattr(p, "decoupled_grad", None) is None)
    if missing:
        raise RuntimeError(f"Megatron HybridDeviceOptimizer: {missing} of {len(params)} trainable parameters have no "
                           "gradient at step(); it would skip them silently and the timed step would do nothing. "
                           "Is a hook clearing p.grad (a torchao optimizer still alive on this model: close() it)?")


def make_megatron_hybrid_device_optimizer(params, *, offload_fraction: float = 1.0, lr: float = 1e-4,
                                          cpu_optimizer: str = "fused", **adamw):
    """Megatron-Core's ``HybridDeviceOptimizer`` as ``get_megatron_optimizer`` builds it for ``--optimizer adam
    --optimizer-cpu-offload``: torch AdamW on both sides, ``fused=True`` for the host one unless
    ``cpu_optimizer="default"`` (torch AdamW's per-tensor loop), fp32 updates, copies overlapped.
    ``None`` when megatron-core does not import.

    Raises:
        ValueError: ``cpu_optimizer`` is not ``"fused"`` or ``"default"``.
    """
    if cpu_optimizer not in ("fused", "default"):
        raise ValueError(f"cpu_optimizer must be 'fused' or 'default', got {cpu_optimizer!r}.")
    _, cls = load_megatron_hybrid_device_optimizer()
    if cls is None:
        return None
    if cpu_optimizer == "fused":
        adamw["fused"] = True
    opt = cls(params, offload_fraction=offload_fraction, cpu_optimizer_cls=torch.optim.AdamW,
              gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True, overlap_cpu_optimizer_d2h_h2d=True,
              lr=lr, **adamw)
    opt.register_step_pre_hook(_require_grads)
    return opt
