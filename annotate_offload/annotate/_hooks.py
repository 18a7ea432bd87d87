"""The hook path, for models fx cannot trace (Hugging Face models): the same two boundary calls
made by forward pre/post hooks on the layers.

A layer that runs inside ``torch.utils.checkpoint`` (a checkpoint *around* the layer call, as
older Hugging Face versions' ``gradient_checkpointing_enable()`` did) cannot be offloaded from
module hooks: the checkpoint saves its inputs before the layer's pre-hook runs, and a scope opened
inside the checkpoint would replace the checkpoint's own saved-tensor hooks. Such a layer is
refused with an ``OffloadError`` when it is meant to be offloaded (and left alone when it is
kept), never silently offloaded for nothing. Checkpoints *inside* a layer's call are fine: the
recompute ``offload_transform`` itself installs, and current transformers'
``GradientCheckpointingLayer``, which checkpoints inside ``__call__`` after the hooks ran, so the
checkpoint's saved inputs are what is offloaded (tests/annotate/test_hf_llama.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from annotate_offload.errors import OffloadError

from annotate_offload.runtime._context import inside_checkpoint

from ._boundary import LayerBoundary, deepcopy_fields, in_backward, refuse_pickle
from ._discover import LayerRef

__all__ = ["install_hooks"]


class _LayerHooks:
    """Pre/post forward hooks of one layer (a small object, not closures, so it has a readable repr)."""

    __slots__ = ("boundary", "index", "ref", "state")
    __reduce_ex__ = refuse_pickle
    __deepcopy__ = deepcopy_fields

    def __init__(self, boundary: LayerBoundary, index: int, ref: LayerRef, state: "HookState") -> None:
        self.boundary, self.index, self.ref, self.state = boundary, index, ref, state

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.state.pre_calls += 1  # Note [Hooks skipped by torch.compile] in _forwards.py
        if in_backward():
            return  # checkpoint recompute in backward: never a new layer scope
        offloaded = self.index in self.boundary.offloaded
        if not torch.is_grad_enabled():
            if self.state.forward_grad and offloaded:
                self._refuse("runs with autograd disabled inside a training forward, as "
                             "torch.utils.checkpoint(use_reentrant=True) runs it")
            return
        if inside_checkpoint():
            if offloaded:
                self._refuse("runs inside torch.utils.checkpoint(use_reentrant=False)")
            return
        x = args[0] if args else next(iter(kwargs.values()), None)
        self.boundary.enter(self.index, x)

    def post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self.boundary.commit(output, self.index)

    def _refuse(self, what: str) -> None:
        raise OffloadError(
            f"offload_transform (hook path): layer {self.index} ({self.ref.fqn}) {what}; its checkpoint "
            "saves the layer input before the layer's hooks run, so nothing would be offloaded. Fix: remove "
            "the checkpoint around the layer (for Hugging Face: model.gradient_checkpointing_disable()) "
            "and pass recompute=True to offload_transform, which checkpoints the layers itself and "
            "offloads what the checkpoint saves; or make the model fx-traceable."
        )

    def __repr__(self) -> str:
        return f"_LayerHooks(index={self.index}, fqn={self.ref.fqn!r})"


class HookState:
    """Whether the current model forward started with autograd enabled (set by the forward wrapper)."""

    __slots__ = ("forward_grad", "pre_calls", "hooked", "warned")

    def __init__(self) -> None:
        self.forward_grad = False
        self.pre_calls = 0  # layer pre-hooks run so far (Note [Hooks skipped by torch.compile])
        self.hooked = False  # the hook path installed hooks for this model
        self.warned = False


def install_hooks(layers: list[LayerRef], boundary: LayerBoundary, state: HookState) -> list[Any]:
    """Register the pre/post hooks on each layer (layer ``i`` is ``layers[i]``); returns the handles."""
    handles = []
    state.hooked = bool(layers)
    for i, ref in enumerate(layers):
        h = _LayerHooks(boundary, i, ref, state)
        handles.append(ref.module.register_forward_pre_hook(h.pre, with_kwargs=True))
        handles.append(ref.module.register_forward_hook(h.post))
    return handles
