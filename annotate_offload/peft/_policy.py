"""Which marks an adapter's tensors get under the active selection policy.

Note [Adapter marks]. A LoRA adapter next to a frozen ``nn.Linear`` saves, per call: the adapter
input after dropout (``x``-sized, saved by ``lora_A`` for its weight gradient), the dropout mask,
the rank-``r`` hidden ``a = lora_A(x)`` (saved by ``lora_B``) and the two small weights. What the
runtime should do with them depends on its selection policy:

* ``"opt_in"`` (TransformerEngine V1 / ``NVTE_CPU_OFFLOAD_V1=1``): nothing moves unless tagged, so
  the adapter tags its input and its hidden ``activation_offloading = True``, as Megatron Bridge's
  ``ParallelLinearAdapter`` does.
* ``"opt_out"`` (the default): everything eligible moves unless marked, so the adapter marks the
  rank-``r`` hidden with ``mark_not_offload``: it is tiny, and a PCIe round trip per adapter and
  step buys nothing. The large input (or its dropout output) is offloaded. The weights are
  parameters, which the runtime never offloads: they get no mark, so the user's objects are left
  as they were.

Marks are attributes of tensor *objects*, and the object autograd saves is often not the one the
module sees: ``F.linear`` on a ``(B, T, H)`` input saves the ``(B*T, H)`` view that ``matmul``
folds it into, and under autocast it saves the cast. So besides marking the tensors themselves,
the adapter runs ``lora_A`` (opt-in) and ``lora_B`` (both policies) inside :func:`marked_saves`,
a ``saved_tensors_hooks`` scope that sets the mark on exactly what autograd saves (parameters
aside) and hands it to the open synchronizer's own pack/unpack hooks (``_pack``/``_unpack``).
Nothing is computed differently: outputs and gradients are bit-identical with and without
offloading.

Frozen base weights are parameters (never offloaded), but autocast does not cache the casts of
parameters that do not require grad, so each step the bf16 copy of a frozen weight is a fresh
tensor that the runtime can only recognise by shape: it is registered with
``OffloadSynchronizer.add_frozen_weights`` while a scope is open. Marks are set only while an
offload scope is open (``is_cpu_offload_enabled()``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Optional

import torch

from annotate_offload.runtime import active_offload_policy, mark_activation_offload, mark_not_offload
from annotate_offload.runtime._context import inside_checkpoint
from annotate_offload.runtime._synchronizer import _active_synchronizer

__all__ = [
    "active_policy",
    "marked_saves",
    "keep_saves",
    "mark_adapter_input",
    "mark_adapter_hidden",
    "register_frozen",
]


active_policy = active_offload_policy  # the open scope's selection policy, or None


_NOT_OFFLOAD = "_TE_do_not_offload"  # the attribute mark_not_offload sets (TE's name)
_OFFLOAD = "activation_offloading"  # the attribute mark_activation_offload sets


_TLS = threading.local()


class _MarkedSaves(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that set one mark on every saved tensor, then defer to the synchronizer's hooks.

    Only the innermost saved-tensor hooks run, so a scope opened inside another one of these (a
    LoRA-adapted LM head: the head's ``keep`` scope around the adapter's ``input`` scope) hands each
    tensor to the enclosing scope, which adds its own mark: ``mark_not_offload`` wins over
    ``activation_offloading`` in the runtime, so the head's tensors stay on the device.
    """

    def __init__(self, sync: Any, attr: str) -> None:
        self.sync, self.attr = sync, attr
        self.outer: Optional[_MarkedSaves] = None
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "_MarkedSaves":
        stack = _TLS.__dict__.setdefault("stack", [])
        top = stack[-1] if stack else None
        self.outer = top if top is not None and top.sync is self.sync else None
        stack.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        stack = _TLS.__dict__.get("stack", [])
        if stack and stack[-1] is self:
            stack.pop()
        self.outer = None

    def _pack(self, t: torch.Tensor) -> Any:
        if not isinstance(t, torch.nn.Parameter):  # a parameter is never offloaded; the user's object stays unmarked
            setattr(t, self.attr, True)
        outer = self.outer
        return outer._pack(t) if outer is not None else self.sync._pack(t)

    def _unpack(self, handle: Any) -> torch.Tensor:
        return self.sync._unpack(handle)


def marked_saves(policy: Optional[str], role: str) -> Any:
    """A context in which every tensor autograd saves gets the mark ``role`` has under ``policy``.

    ``role`` is ``"input"`` (code that saves the adapter input: ``lora_A``) or ``"hidden"`` (code
    that saves the rank-``r`` hidden: ``lora_B``). Opt-in tags both for offload; opt-out marks the
    hidden ``mark_not_offload`` and leaves the input alone. Without an open offload scope, or when
    the role needs no mark, it is a ``nullcontext``.
    """
    sync = _marking_sync() if policy is not None else None
    if sync is None:
        return contextlib.nullcontext()
    if policy == "opt_in":
        return _MarkedSaves(sync, _OFFLOAD)
    if policy == "opt_out" and role == "hidden":
        return _MarkedSaves(sync, _NOT_OFFLOAD)
    return contextlib.nullcontext()


def keep_saves() -> Any:
    """A context in which every tensor autograd saves is marked ``mark_not_offload`` (any policy),
    while an offload scope is open; otherwise a ``nullcontext``."""
    sync = _marking_sync()
    return contextlib.nullcontext() if sync is None else _MarkedSaves(sync, _NOT_OFFLOAD)


def _marking_sync() -> Any:
    """The open synchronizer adapter saves should go to, or ``None``: none open, or inside a
    non-reentrant checkpoint (Note [A checkpoint around the layer] in runtime/_context.py: the
    checkpoint keeps only its inputs, and a scope here would replace its hooks, so its recompute
    would fail with "CheckpointError: ... different metadata")."""
    if inside_checkpoint():
        return None
    return _active_synchronizer()


def mark_adapter_input(policy: Optional[str], *tensors: torch.Tensor) -> None:
    """Opt-in: tag the adapter's input tensors ``activation_offloading = True``; otherwise nothing."""
    if policy == "opt_in":
        mark_activation_offload(*[t for t in tensors if isinstance(t, torch.Tensor)])


def mark_adapter_hidden(policy: Optional[str], hidden: torch.Tensor) -> None:
    """The rank-``r`` hidden: tagged for offload in opt-in mode, ``mark_not_offload`` in opt-out mode."""
    if not isinstance(hidden, torch.Tensor):
        return
    if policy == "opt_in":
        mark_activation_offload(hidden)
    elif policy == "opt_out":
        mark_not_offload(hidden)


def register_frozen(params: Iterable[torch.Tensor]) -> None:
    """Register frozen weights with the open scope's synchronizer (``add_frozen_weights``), if any."""
    sync = _active_synchronizer()
    if sync is None:
        return
    frozen = [p for p in params if isinstance(p, torch.Tensor) and not p.requires_grad]
    if frozen:
        sync.add_frozen_weights(frozen)
