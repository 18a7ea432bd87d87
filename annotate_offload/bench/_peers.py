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

Note [Peer hooks outlive the peer]: torchao's ``CPUOffloadOptimizer`` registers a
post-accumulate-grad hook on every parameter of at least ``minimal_size`` elements and drops the
handle (torchao 0.18 ``torchao/optim/cpu_offload.py`` lines 65-105). The hook closes over the
optimizer, so ``del opt`` frees nothing: on every later backward it still copies each gradient to
its pinned buffer and, with ``offload_gradients=True``, sets ``p.grad = None`` (lines 82-84).
Megatron's ``HybridDeviceOptimizer`` then finds no gradient and skips the parameter without a word
(megatron-core 0.19.2 ``cpu_offloading/hybrid_optimizer.py`` lines 101-105: ``grad is None`` ->
``continue``; the per-parameter CPU AdamW then has no ``.grad`` and does nothing). The W3 benchmark
ran torchao before Megatron on the same model, so Megatron's rows timed forward + backward +
torchao's stray D2H copies (~200 ms instead of ~450 ms) and left the weights unchanged.
:func:`make_torchao_cpu_offload_optimizer` therefore ties torchao's hooks to the optimizer
(``close()``, or dropping the last reference and a ``gc.collect()``, removes them), and
:func:`make_megatron_hybrid_device_optimizer` refuses to step when a trainable parameter has no
gradient instead of silently skipping it.
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
from typing import Any, Callable, Iterable

import torch

from ..errors import OffloadError

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


def _materialize(params) -> tuple[list, list[torch.Tensor]]:
    """``params`` (tensors or param-group dicts, any iterable) as a list the caller's dicts are not
    mutated through (torchao pops ``"params"``), plus the flat list of its tensors."""
    items = list(params)
    if items and isinstance(items[0], dict):
        groups = []
        for g in items:
            g = dict(g)
            g["params"] = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            groups.append(g)
        return groups, [p for g in groups for p in g["params"]]
    return items, [p for p in items if isinstance(p, torch.Tensor)]


def _grad_hook_keys(tensors: Iterable[torch.Tensor]) -> dict[int, set]:
    # ``Tensor.register_post_accumulate_grad_hook`` stores hooks in ``_post_accumulate_grad_hooks``
    # (an OrderedDict keyed by handle id, None until the first hook; torch >= 2.1).
    return {id(p): set(getattr(p, "_post_accumulate_grad_hooks", None) or ()) for p in tensors}


class _WeakGradHook:
    """Calls a hook through a weak reference, so the parameter does not keep the hook's owner alive
    (Note [Peer hooks outlive the peer]); does nothing once the owner is gone."""

    __slots__ = ("_ref",)

    def __init__(self, fn: Callable) -> None:
        self._ref = weakref.ref(fn)

    def __call__(self, param: torch.Tensor) -> None:
        fn = self._ref()
        if fn is not None:
            fn(param)


def _remove_hooks(entries: list) -> None:
    for hooks, key in entries:
        hooks.pop(key, None)


def _adopt_grad_hooks(opt: Any, tensors: list[torch.Tensor], before: dict[int, set]) -> int:
    """Tie the post-accumulate-grad hooks registered on ``tensors`` since ``before`` to ``opt``.

    The parameters then hold the hooks weakly, ``opt`` holds them strongly, and ``opt.close()`` (or
    ``opt`` being collected) removes them. Returns the number of hooks adopted.
    """
    entries, keep = [], []
    for p in {id(p): p for p in tensors}.values():  # a tensor listed twice is adopted once
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if not hooks:
            continue
        for key in [k for k in hooks if k not in before.get(id(p), ())]:
            fn = hooks[key]
            try:
                hooks[key] = _WeakGradHook(fn)
            except TypeError:  # not weak-referenceable: stays strong, close() still removes it
                pass
            keep.append(fn)
            entries.append((hooks, key))
    opt._annotate_offload_grad_hooks = keep  # opt -> hook -> opt is a cycle: gc.collect() frees it
    # The finalizer holds the hook dicts and keys, never ``opt``; calling it runs it once.
    opt.close = weakref.finalize(opt, _remove_hooks, entries)
    return len(entries)


def make_torchao_cpu_offload_optimizer(
    params, *, lr: float = 1e-4, offload_gradients: bool = False, fused: bool = True, **adamw_kwargs: Any
):
    """torchao's ``CPUOffloadOptimizer`` over ``torch.optim.AdamW`` (W3 peer), with removable hooks.

    torchao's gradient hooks would otherwise outlive the optimizer and keep copying (and, with
    ``offload_gradients``, deleting) every gradient of the model for the rest of the process (Note
    [Peer hooks outlive the peer]). The returned optimizer has a ``close()`` that removes them
    (idempotent); dropping the last reference and running ``gc.collect()`` removes them too.

    Args:
        params: parameters or param groups (CUDA tensors); the caller's group dicts are not mutated.
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
    params, tensors = _materialize(params)
    before = _grad_hook_keys(tensors)
    opt = cls(params, torch.optim.AdamW, offload_gradients=offload_gradients, fused=fused, lr=lr, **adamw_kwargs)
    _adopt_grad_hooks(opt, tensors, before)
    return opt


def _require_grads(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook: every trainable parameter must have ``.grad`` (or Megatron's ``.decoupled_grad``).

    Megatron's HDO skips a parameter without one silently (hybrid_optimizer.py lines 101-105), which
    makes a benchmark time an optimizer that does nothing (Note [Peer hooks outlive the peer]).
    """
    missing = total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            total += 1
            if p.grad is None and getattr(p, "decoupled_grad", None) is None:
                missing += 1
    if missing:
        raise OffloadError(
            f"Megatron HybridDeviceOptimizer adapter: {missing} of {total} trainable parameters have no gradient at "
            "step(); Megatron's HDO would skip them silently and the step would time nothing. Expected a gradient on "
            "every parameter after backward. Look for a hook that clears p.grad (e.g. a torchao CPUOffloadOptimizer "
            "with offload_gradients=True still alive on the same model: close() it), or pass require_grads=False "
            "when some parameters are legitimately unused."
        )


def make_megatron_hybrid_device_optimizer(
    params,
    *,
    offload_fraction: float = 1.0,
    lr: float = 1e-4,
    cpu_optimizer: str = "fused",
    overlap_cpu_optimizer_d2h_h2d: bool = True,
    param_update_in_fp32: bool = True,
    require_grads: bool = True,
    **adamw_kwargs: Any,
):
    """Megatron-Core's ``HybridDeviceOptimizer`` with torch AdamW on both sides (W3 peer).

    Built as megatron-core 0.19.2's ``get_megatron_optimizer`` builds it for ``--optimizer adam
    --optimizer-cpu-offload`` (``megatron/core/optimizer/__init__.py`` lines 502-541):
    ``cpu_optimizer_cls=torch.optim.AdamW`` and ``fused=True`` in the defaults, which
    ``HybridDeviceOptimizer`` copies into every sub-optimizer's param group (torch AdamW reads
    ``group["fused"]`` at each step), and ``param_update_in_fp32=True``. The GPU side is
    ``torch.optim.AdamW`` (Megatron's fallback without TransformerEngine/Apex). Megatron drives it
    with the gradient in each parameter's ``.grad`` (``distrib_optimizer.py`` line 2782), as a plain
    training loop does; ``step()`` copies the host results back into the parameters itself (a step
    post-hook per host sub-optimizer).

    Args:
        params: parameters or param groups (CUDA tensors).
        offload_fraction (float): fraction of parameter elements stepped on the CPU, in [0, 1].
            Default: ``1.0``.
        lr (float): learning rate. Default: ``1e-4``.
        cpu_optimizer (str): ``"fused"`` (torch's fused CPU AdamW, what Megatron passes; issue 7
            measured 449 ms at f=1.0) or ``"default"`` (torch AdamW's own default, a per-tensor loop
            on the CPU; 1962 ms there). Default: ``"fused"``.
        overlap_cpu_optimizer_d2h_h2d (bool): one host sub-optimizer per parameter, copies on side
            streams. Default: ``True`` (Megatron's config defaults to ``False``; overlap is its
            faster setting).
        param_update_in_fp32 (bool): fp32 masters of non-fp32 params (a no-op for fp32 params, as
            in W3). Default: ``True``, as Megatron.
        require_grads (bool): raise :class:`~annotate_offload.errors.OffloadError` from ``step()``
            when a trainable parameter has no gradient (Megatron would skip it silently).
            Default: ``True``.
        **adamw_kwargs: forwarded to both sub-optimizers through the param groups (``betas``,
            ``eps``, ``weight_decay``, ...).

    Returns:
        torch.optim.Optimizer, or ``None`` when megatron-core is not importable.

    Raises:
        ValueError: ``cpu_optimizer`` not in ``("fused", "default")``, ``offload_fraction``
            outside [0, 1], or ``fused`` in ``adamw_kwargs`` (choose it with ``cpu_optimizer``).
    """
    if cpu_optimizer not in ("fused", "default"):
        raise ValueError(f"cpu_optimizer must be 'fused' or 'default', got {cpu_optimizer!r}.")
    if not 0.0 <= float(offload_fraction) <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction!r}.")
    if "fused" in adamw_kwargs:
        raise ValueError(
            f"fused={adamw_kwargs['fused']!r} is set by cpu_optimizer for Megatron's HybridDeviceOptimizer; "
            "pass cpu_optimizer='fused' or 'default' instead."
        )
    info, cls = load_megatron_hybrid_device_optimizer()
    if cls is None:
        return None
    if cpu_optimizer == "fused":
        adamw_kwargs["fused"] = True
    opt = cls(
        params,
        offload_fraction=offload_fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=param_update_in_fp32,
        overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
        lr=lr,
        **adamw_kwargs,
    )
    if require_grads:
        opt.register_step_pre_hook(_require_grads)
    return opt
