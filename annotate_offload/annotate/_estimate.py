"""Estimate the bytes each layer moves per step by running the example inputs on the meta device.

The model's forward itself runs (its layer forwards included) on meta tensors of the parameters',
buffers' and inputs' shapes, with the runtime swapped for a counter that applies the runtime's
selection rules to what autograd saves in each offloaded layer's scope.

Note [Attention on meta]: on the meta device ``F.scaled_dot_product_attention`` can only take the
math path, which saves the ``B x H x S x S`` attention probabilities; the fused kernels training
runs save ``q, k, v, out`` and a ``B x H x S`` logsumexp. :func:`fused_sdpa_on_meta` routes meta
SDPA calls to the CPU flash kernel's meta function, whose saved set is the fused kernels'.

Note [Autocast on meta]: ``torch.autocast`` has no meta device. :class:`autocast_on_meta` applies
CUDA autocast's casting rule (torch.amp docs, "CUDA Ops that can autocast to float16 / float32") at
the torch-function level, on meta tensors only: the matmul family, convolutions and SDPA get their
floating inputs (fp64 excepted) cast to the autocast dtype, the fp32 ops (norms, softmax,
exp/log/pow/rsqrt, sum, losses) to fp32, everything else runs in the dtypes it is given. Each
``.to()`` is a real cast node, so a parameter's cast is recognised and not counted, as in the
runtime. Not emulated: ``torch.autocast(enabled=False)`` regions, and matmuls that library code runs
below the torch-function level (``torch.einsum``, ``nn.MultiheadAttention``'s fused path).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from annotate_offload._example_inputs import split

# The runtime's own unit and parameter rules (private helpers of one package), so the estimate
# counts what the runtime would move.
from annotate_offload.runtime._layer_state import _is_weight, frozen_shapes
from annotate_offload.runtime._tensor_group import _unit_range

__all__ = ["autocast_on_meta", "estimate_bytes", "fused_sdpa_on_meta"]


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class fused_sdpa_on_meta(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch's modes
    """Within it, ``F.scaled_dot_product_attention`` on meta tensors saves what a fused kernel saves
    (Note [Attention on meta]); other calls, and meta calls it cannot map (GQA with unequal heads,
    a backend-specific signature), run unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            try:
                q, k, v, mask, p, causal, scale, gqa = _sdpa_args(*args, **kwargs)
            except TypeError:
                return func(*args, **kwargs)
            if q.device.type == "meta" and q.dim() == 4 and k.shape[1] == q.shape[1] and v.shape[1] == q.shape[1]:
                kw: dict[str, Any] = {"scale": scale}
                if mask is not None:
                    kw["attn_mask"] = mask
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, p, causal, **kw)[0]
        return func(*args, **kwargs)


def _autocast_lists() -> tuple[frozenset, frozenset]:
    T = torch.Tensor
    low = {F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
           F.conv_transpose3d, F.prelu, F.scaled_dot_product_attention, torch.matmul, T.matmul, T.__matmul__,
           T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm, torch.mv, T.mv, torch.addmm, T.addmm, torch.baddbmm,
           T.baddbmm, torch.addbmm, T.addbmm, torch.addmv, T.addmv, torch.addr, T.addr, torch.chain_matmul}
    fp32 = {F.layer_norm, F.group_norm, F.softmax, F.log_softmax, F.softmin, F.softplus, F.normalize,
            F.cosine_similarity, F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.kl_div,
            F.binary_cross_entropy_with_logits, torch.softmax, T.softmax, torch.log_softmax, T.log_softmax,
            torch.exp, T.exp, torch.expm1, T.expm1, torch.log, T.log, torch.log1p, T.log1p, torch.log2, T.log2,
            torch.log10, T.log10, torch.pow, T.pow, T.__pow__, T.__rpow__, torch.rsqrt, T.rsqrt,
            torch.reciprocal, T.reciprocal, torch.sum, T.sum, torch.prod, T.prod, torch.cumsum, T.cumsum,
            torch.cumprod, T.cumprod, torch.norm, T.norm, torch.cdist, torch.erfinv, T.erfinv, torch.acos,
            torch.asin, torch.cosh, torch.sinh, torch.tan}
    return frozenset(low), frozenset(fp32)


class autocast_on_meta(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch's modes
    """Within it, calls on meta tensors see the casts ``torch.autocast(dtype=dtype)`` would make
    (Note [Autocast on meta]); calls without a meta tensor argument run unchanged.

    Args:
        dtype (torch.dtype): the autocast dtype (``torch.bfloat16`` or ``torch.float16``).

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype below fp32.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_on_meta: dtype must be torch.bfloat16 or torch.float16, got {dtype}.")
        self.dtype = dtype
        self._low, self._fp32 = _autocast_lists()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self.dtype if func in self._low else torch.float32 if func in self._fp32 else None
        if target is not None and _any_meta(args, kwargs):
            args = tuple(_cast(a, target) for a in args)
            kwargs = {k: _cast(v, target) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _any_meta(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in (*args, *kwargs.values()))


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype not in (dtype, torch.float64):
        return x.to(dtype)
    return x


def autocast_dtype_of(config: Any = None) -> "torch.dtype | None":
    """The autocast dtype a meta estimate should emulate: bf16 when ``config`` (a ``ModelConfig``
    or a ``Config`` holding one) says ``bf16=True``, else the dtype of an autocast region the caller
    is in (CUDA, then CPU), else ``None`` (no autocast)."""
    model_cfg = getattr(config, "model", config)
    if getattr(model_cfg, "bf16", False) is True:
        return torch.bfloat16
    for dev in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(dev):
                return torch.get_autocast_dtype(dev)
        except (TypeError, RuntimeError, AttributeError):  # pragma: no cover - very old torch
            continue
    return None


class _CountingSync:
    """Stands in for the synchronizer during the estimate: counts the bytes an offload would move."""

    def __init__(self, offloaded: frozenset[int], min_numel: int, policy: str, frozen: set) -> None:
        self.offloaded, self.min_numel, self.policy = offloaded, min_numel, policy
        self.frozen = frozen  # shapes of the model's frozen weights, as the runtime registers them
        self.bytes: dict[int, int] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._units: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges, this layer

    def enter_layer(self, i: int) -> None:
        self._units = {}
        self.bytes.setdefault(i, 0)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(i, t), lambda t: t)
        self._hooks.__enter__()

    def commit_layer(self, out: Any, i: int) -> Any:
        self.abort()
        return out

    def abort(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _pack(self, i: int, t: torch.Tensor) -> torch.Tensor:
        if i in self.offloaded and self._eligible(t):
            rng = _unit_range(t, bool(getattr(t, "offload_base_tensor", False)))
            if rng is not None:
                # Storage units as the runtime forms them: a view covering at least half its storage
                # moves the whole storage; every byte moves once per layer (union of ranges).
                key = t.untyped_storage()._cdata
                ranges = self._units.setdefault(key, [])
                before = _union(ranges)
                ranges.append(rng)
                self.bytes[i] += _union(ranges) - before
        # A detached alias, not ``t``: an op that saves its own output would otherwise hold that output,
        # and through its grad_fn itself, a cycle through autograd that gc cannot see. With no backward
        # to release it, the meta graph, and through checkpoint frames the real layers, would stay alive.
        return t.detach()

    def _eligible(self, t: torch.Tensor) -> bool:
        if _is_weight(t, self.frozen):
            return False
        if t.numel() == 0 or t.numel() < self.min_numel:
            return False
        if getattr(t, "_TE_do_not_offload", False) or getattr(t, "_do_not_offload", False):
            return False
        if self.policy == "opt_in" and not getattr(t, "activation_offloading", False):
            return False
        return True


def _union(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for lo, hi in sorted(ranges):
        lo = max(lo, end)
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def estimate_bytes(
    model: nn.Module, offload: Any, example_inputs: Any, *, min_numel: int, policy: str,
    autocast_dtype: "torch.dtype | None" = None,
) -> dict[int, int]:
    """Per offloaded layer index, the bytes its saved activations would move per step (meta run),
    under an emulation of ``torch.autocast(dtype=autocast_dtype)`` when given (Note [Autocast on meta]).

    ``offload`` is the model's ``OffloadState``; its runtime is swapped for a counter during the run.

    Raises:
        OffloadError: a layer ran twice in the forward (it cannot be one offload unit), or before a
            layer registered ahead of it.
        Exception: whatever the model's forward raises on meta tensors (the caller records it).
    """
    state = {n: nn.Parameter(_to_meta(p.detach()), requires_grad=p.requires_grad) for n, p in model.named_parameters()}
    state.update({n: _to_meta(b) for n, b in model.named_buffers()})
    args, kwargs = split(example_inputs, "offload_transform")
    args, kwargs = _to_meta(args), _to_meta(kwargs)
    # offload_transform's frozen-weight marks register these with the runtime (peft/_apply.py)
    frozen = frozen_shapes(p for p in model.parameters() if not p.requires_grad)
    counter = _CountingSync(offload.offloaded, min_numel, policy, frozen)
    real, offload.sync = offload.sync, counter
    offload.estimating = set()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            # the mode entered last sees a call first: autocast casts SDPA's inputs, then the
            # fused-attention mode maps the call
            stack.enter_context(fused_sdpa_on_meta())
            if autocast_dtype is not None:
                stack.enter_context(autocast_on_meta(autocast_dtype))
            functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
    finally:
        counter.abort()
        offload.sync = real
        offload.estimating = None
        offload.open_layer = offload.owner = None
        offload.last_entered = -1
    return {i: counter.bytes.get(i, 0) for i in offload.offloaded}
