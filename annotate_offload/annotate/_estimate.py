"""Estimate the bytes each layer moves per step by running the example inputs on the meta device.

The transformed forward itself runs, with the runtime swapped for a counter that applies the
runtime's selection rules (see ``runtime/_stats.py`` KEEP_REASONS) to what autograd saves in each
offloaded layer's scope. Nothing is computed and no device memory is touched: parameters, buffers
and inputs are replaced by meta tensors of the same shapes.

Note [Attention on meta]: on the meta device ``F.scaled_dot_product_attention`` can only take the
math path, which saves the ``B x H x S x S`` attention probabilities; the fused kernels training
actually runs (flash / memory-efficient on CUDA, flash on CPU) save ``q, k, v, out`` and a
``B x H x S`` logsumexp. Counting the math path over-estimated a 4 x 4096-token Llama layer ~10x
(fresh-user report, second pass). :func:`fused_sdpa_on_meta` routes meta SDPA calls to the CPU
flash kernel's meta function, whose saved set is the fused kernels'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

# The runtime's own unit and parameter rules (private helpers of one package), so the estimate
# counts what the runtime would move.
from annotate_offload.runtime._layer_state import _is_param_alias
from annotate_offload.runtime._tensor_group import _unit_range

__all__ = ["estimate_bytes", "fused_sdpa_on_meta"]


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


class _CountingSync:
    """Stands in for the synchronizer during the estimate: counts the bytes an offload would move."""

    def __init__(self, offloaded: frozenset[int], min_numel: int, policy: str) -> None:
        self.offloaded, self.min_numel, self.policy = offloaded, min_numel, policy
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
        return t

    def _eligible(self, t: torch.Tensor) -> bool:
        if _is_param_alias(t):
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
    model: nn.Module, boundary: Any, example_inputs: Any, *, min_numel: int, policy: str
) -> dict[int, int]:
    """Per offloaded layer index, the bytes its saved activations would move per step (meta run).

    Raises:
        Exception: whatever the model's forward raises on meta tensors (the caller records it).
    """
    state = {n: nn.Parameter(_to_meta(p.detach()), requires_grad=p.requires_grad) for n, p in model.named_parameters()}
    state.update({n: _to_meta(b) for n, b in model.named_buffers()})
    if isinstance(example_inputs, dict):
        args, kwargs = (), _to_meta(example_inputs)
    else:
        args = _to_meta(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,))
        kwargs = {}
    counter = _CountingSync(boundary.offloaded, min_numel, policy)
    real, boundary.sync = boundary.sync, counter
    boundary.estimating = True
    try:
        with torch.enable_grad(), fused_sdpa_on_meta():
            functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
    finally:
        counter.abort()
        boundary.sync = real
        boundary.estimating = False
        boundary.open_layer = None
        boundary.last_entered = -1
    return {i: counter.bytes.get(i, 0) for i in boundary.offloaded}
