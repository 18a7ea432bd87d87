"""Import-guarded adapters for the peers the benchmark compares against (issue 7).

Every loader returns a :class:`PeerInfo` and never raises for a missing or broken peer: a
benchmark row then says "not importable: <why>". Peers and where they live:

- TRL ``trl.models.activation_offloading.OffloadActivations`` (+ ``NoOpManager``), else
  torchtune ``torchtune.training.OffloadActivations``: activation offload (W1, W2).
- torchao ``torchao.optim.CPUOffloadOptimizer``: optimizer offload (W3).
- Megatron-Core ``megatron.core.optimizer.cpu_offloading.HybridDeviceOptimizer`` (W3). Its
  module only needs torch, but ``megatron.core`` imports triton and more at package import, so
  when the package import fails the file is loaded on its own from the installed wheel.

None of these is a dependency of annotate_offload; on the GPU machine they come from carried
wheels (benchmarks/NOTES.md).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "PeerInfo",
    "ActivationPeer",
    "load_offload_activations",
    "load_torchao_cpu_offload_optimizer",
    "load_megatron_hybrid_device_optimizer",
    "make_torchao_cpu_offload_optimizer",
    "make_megatron_hybrid_device_optimizer",
]


@dataclass(frozen=True)
class PeerInfo:
    """Whether a peer could be imported, and from where.

    Attributes:
        name (str): display name, e.g. ``"trl OffloadActivations"``.
        available (bool): the import worked.
        version (str | None): distribution version (``importlib.metadata``), if known.
        detail (str): the module the peer came from, or why it is not importable.
    """

    name: str
    available: bool
    version: str | None
    detail: str

    def describe(self) -> str:
        """One line for report headers: ``name version (detail)`` or ``name: not importable (why)``."""
        if self.available:
            return f"{self.name} {self.version or '?'} ({self.detail})"
        return f"{self.name}: not importable ({self.detail})"


@dataclass(frozen=True)
class ActivationPeer:
    """TRL's / torchtune's activation offloader.

    Attributes:
        info (PeerInfo): import status.
        offload_cls (type | None): ``OffloadActivations`` (a ``saved_tensors_hooks``);
            ``offload_cls(use_pin_memory=True, use_streams=True)`` is the default config.
        noop_cls (type | None): ``NoOpManager``, entered around modules that must keep their
            activations (the innermost hooks win).
    """

    info: PeerInfo
    offload_cls: type | None = None
    noop_cls: type | None = None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:160]


def load_offload_activations() -> ActivationPeer:
    """Find ``OffloadActivations``: TRL first, then torchtune.

    Returns:
        ActivationPeer: ``info.available`` is False (with both import errors in ``detail``)
        when neither imports.
    """
    candidates = (
        ("trl", "trl.models.activation_offloading", "trl OffloadActivations"),
        ("torchtune", "torchtune.training._activation_offloading", "torchtune OffloadActivations"),
    )
    errors = []
    for dist, module_name, display in candidates:
        try:
            module = importlib.import_module(module_name)
            offload_cls = module.OffloadActivations
            noop_cls = module.NoOpManager
        except Exception as exc:  # ImportError, or a peer broken against this torch
            errors.append(f"{dist}: {_why(exc)}")
            continue
        return ActivationPeer(PeerInfo(display, True, _version(dist), module_name), offload_cls, noop_cls)
    return ActivationPeer(PeerInfo("trl/torchtune OffloadActivations", False, None, "; ".join(errors)))


def load_torchao_cpu_offload_optimizer() -> tuple[PeerInfo, type | None]:
    """Import ``torchao.optim.CPUOffloadOptimizer``.

    Returns:
        tuple[PeerInfo, type | None]: the class, or ``None`` with the reason in ``info.detail``.
    """
    # CPUOffloadOptimizer is pure Python; torchao's compiled kernels are built against one torch
    # release and only produce load warnings (or worse) elsewhere, so the benchmark skips them
    # unless the caller decided otherwise.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception as exc:
        return PeerInfo("torchao CPUOffloadOptimizer", False, None, _why(exc)), None
    return PeerInfo("torchao CPUOffloadOptimizer", True, _version("torchao"), "torchao.optim"), CPUOffloadOptimizer


_HDO_MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
_HDO_ALONE = "_annotate_offload_megatron_hdo"


def load_megatron_hybrid_device_optimizer() -> tuple[PeerInfo, type | None]:
    """Import Megatron-Core's ``HybridDeviceOptimizer``.

    Tries the package import; if ``megatron.core`` fails to import (it pulls in triton,
    transformer-engine probes, ...), loads ``hybrid_optimizer.py`` alone from the installed
    distribution (it only imports torch).

    Returns:
        tuple[PeerInfo, type | None]: the class, or ``None`` with the reason in ``info.detail``.
    """
    name, version = "Megatron-Core HybridDeviceOptimizer", _version("megatron-core")
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed" x5
            warnings.simplefilter("ignore")
            module = importlib.import_module(_HDO_MODULE)
        return PeerInfo(name, True, version, _HDO_MODULE), module.HybridDeviceOptimizer
    except Exception as exc:
        package_error = _why(exc)
    path = _find_megatron_file("core/optimizer/cpu_offloading/hybrid_optimizer.py")
    if path is None:
        return PeerInfo(name, False, version, package_error), None
    module = sys.modules.get(_HDO_ALONE)
    if module is None or getattr(module, "__file__", None) != path:  # load once: one class object
        try:
            spec = importlib.util.spec_from_file_location(_HDO_ALONE, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(_HDO_ALONE, None)
            return PeerInfo(name, False, version, f"{package_error}; file load: {_why(exc)}"), None
    detail = f"{path} loaded alone (package import failed: {package_error})"
    return PeerInfo(name, True, version, detail), module.HybridDeviceOptimizer


def _find_megatron_file(relative: str) -> str | None:
    # ``megatron`` is a namespace package (no __init__.py), so find_spec("megatron") does not
    # execute megatron.core's heavy __init__.
    try:
        spec = importlib.util.find_spec("megatron")
    except Exception:
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    for root in spec.submodule_search_locations:
        candidate = os.path.join(root, relative)
        if os.path.isfile(candidate):
            return candidate
    return None


class _FusedCPUAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` as a class, for APIs that take an optimizer class and
    later test ``isinstance`` against it (Megatron's HDO does)."""

    def __init__(self, params, **kwargs: Any) -> None:
        kwargs.setdefault("fused", True)
        super().__init__(params, **kwargs)


def make_torchao_cpu_offload_optimizer(
    params, *, lr: float = 1e-4, offload_gradients: bool = False, fused: bool = True, **adamw_kwargs: Any
):
    """torchao's ``CPUOffloadOptimizer`` over ``torch.optim.AdamW`` (W3 peer).

    Args:
        params: parameters or param groups (CUDA tensors).
        lr (float): learning rate. Default: ``1e-4``.
        offload_gradients (bool): torchao's gradient offload (lower GPU memory, needs no grad
            accumulation). Default: ``False``.
        fused (bool): torch's fused CPU AdamW kernel. Default: ``True``.
        **adamw_kwargs: forwarded to ``torch.optim.AdamW``.

    Returns:
        torch.optim.Optimizer, or ``None`` when torchao is not importable.

    Raises:
        AssertionError: from torchao, when the parameters are not on CUDA/XPU (it supports no
            CPU-only run).
    """
    info, cls = load_torchao_cpu_offload_optimizer()
    if cls is None:
        return None
    return cls(params, torch.optim.AdamW, offload_gradients=offload_gradients, fused=fused, lr=lr, **adamw_kwargs)


def make_megatron_hybrid_device_optimizer(
    params,
    *,
    offload_fraction: float = 1.0,
    lr: float = 1e-4,
    cpu_optimizer: str = "fused",
    overlap_cpu_optimizer_d2h_h2d: bool = True,
    param_update_in_fp32: bool = False,
    **adamw_kwargs: Any,
):
    """Megatron-Core's ``HybridDeviceOptimizer`` with torch AdamW on both sides (W3 peer).

    Args:
        params: parameters or param groups (CUDA tensors).
        offload_fraction (float): fraction of parameter elements stepped on the CPU, in [0, 1].
            Default: ``1.0``.
        lr (float): learning rate. Default: ``1e-4``.
        cpu_optimizer (str): ``"fused"`` (torch's fused CPU AdamW; issue 7 measured 449 ms at
            f=1.0) or ``"default"`` (torch's default for-each CPU AdamW, Megatron's default,
            1962 ms there). Default: ``"fused"``.
        overlap_cpu_optimizer_d2h_h2d (bool): Megatron's per-parameter overlap. Default: ``True``.
        param_update_in_fp32 (bool): keep fp32 copies of non-fp32 params. Default: ``False``
            (the W3 model already holds fp32 master weights).
        **adamw_kwargs: forwarded to both sub-optimizers through the param groups.

    Returns:
        torch.optim.Optimizer, or ``None`` when megatron-core is not importable.

    Raises:
        ValueError: ``cpu_optimizer`` not in ``("fused", "default")`` or ``offload_fraction``
            outside [0, 1].
    """
    if cpu_optimizer not in ("fused", "default"):
        raise ValueError(f"cpu_optimizer must be 'fused' or 'default', got {cpu_optimizer!r}.")
    if not 0.0 <= float(offload_fraction) <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction!r}.")
    info, cls = load_megatron_hybrid_device_optimizer()
    if cls is None:
        return None
    cpu_cls: Callable = _FusedCPUAdamW if cpu_optimizer == "fused" else torch.optim.AdamW
    return cls(
        params,
        offload_fraction=offload_fraction,
        cpu_optimizer_cls=cpu_cls,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=param_update_in_fp32,
        overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
        lr=lr,
        **adamw_kwargs,
    )
