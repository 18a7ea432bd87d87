"""The instance-level forwards ``offload_transform`` installs (on the model and on recomputed layers)."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint as _cp

from annotate_offload.errors import OffloadError

from ._boundary import LayerBoundary, deepcopy_fields, in_backward, refuse_pickle
from ._hooks import HookState

__all__ = ["OffloadedForward", "ByMode", "RecomputeForward", "LayerContainers"]

_ORIG_CHECKPOINT = _cp.checkpoint



class LayerContainers:
    """The fx path's check that the ``nn.ModuleList``/``nn.Sequential`` holding the layers still has
    the children the forward was traced with: the generated code calls ``layers.0`` .. ``layers.{L-1}`` by name, so a layer
    appended after the transform would never run (and a removed one fails deep inside the graph).
    Replacing a layer in place is fine (the code looks it up on the live model)."""

    __deepcopy__ = deepcopy_fields
    __reduce_ex__ = refuse_pickle

    def __init__(self, model: nn.Module, fqns: list[str]) -> None:
        self.model = model
        # only the ordered containers layers are appended to; other parents (the root itself, a
        # block holding named sub-blocks) gain unrelated submodules legitimately
        self.counts = {
            fqn: len(m._modules) for fqn in dict.fromkeys(fqns)
            if isinstance(m := model.get_submodule(fqn), (nn.ModuleList, nn.Sequential))
        }

    def check(self) -> None:
        for fqn, n in self.counts.items():
            try:
                now = len(self.model.get_submodule(fqn)._modules)
            except AttributeError:
                now = None
            if now != n:
                where = fqn or type(self.model).__name__
                has = "is gone" if now is None else f"has {now} modules"
                raise OffloadError(
                    f"offload_transform (fx path): {where} {has}, but had {n} when the forward was traced; "
                    "the traced forward calls the layers it saw by name, so it would skip or miss the change. "
                    "Call remove_offload(model) and offload_transform(model, ...) again after changing the "
                    "layers, or use path='hooks', which follows the model's own forward."
                )


class OffloadedForward:
    """The model's instance-level forward: runs the transformed graph (fx) or the original forward
    (hooks), records whether the forward trains, and drops the step's offload state on an exception."""

    __reduce_ex__ = refuse_pickle
    __deepcopy__ = deepcopy_fields

    def __init__(self, fn: Callable[..., Any], boundary: LayerBoundary, hook_state: HookState, wrapped: Any,
                 containers: "LayerContainers | None" = None) -> None:
        self.fn, self.boundary, self.hook_state, self.containers = fn, boundary, hook_state, containers
        functools.update_wrapper(self, wrapped)  # inspect.signature(model.forward) still works

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.containers is not None:
            self.containers.check()
        training = torch.is_grad_enabled() and not in_backward()
        b = self.boundary
        prev, self.hook_state.forward_grad = self.hook_state.forward_grad, training
        prev_in, prev_last, b.in_forward, b.forward_last = b.in_forward, b.forward_last, True, -1
        pre_calls = self.hook_state.pre_calls
        try:
            out = self.fn(*args, **kwargs)
        except BaseException:
            if training:
                b.abort()
            raise
        finally:
            self.hook_state.forward_grad = prev
            b.in_forward, b.forward_last = prev_in, prev_last
        if training:
            self.boundary.forward_done()
            if self.hook_state.hooked and self.hook_state.pre_calls == pre_calls:
                self._no_hooks_ran()
        return out

    def _no_hooks_ran(self) -> None:
        """Note [Hooks skipped by torch.compile]: Dynamo does not guard on module hooks by default
        (``torch._dynamo.config.skip_nnmodule_hook_guards``), so code it compiled for a layer class
        before ``offload_transform`` (a baseline of the same class, compiled first in the same
        process) keeps running without our pre/post hooks: the step trains exactly but offloads
        nothing (fresh-user report, seventh session). A training forward in which no layer hook ran
        says so, once per model."""
        hs = self.hook_state
        if hs.warned:
            return
        hs.warned = True
        warnings.warn(
            "offload_transform (hook path): a training forward ran without any layer's forward hooks, so nothing "
            "was offloaded. torch.compile reuses code it compiled for these layer classes before the hooks existed "
            "(Dynamo does not guard on module hooks: torch._dynamo.config.skip_nnmodule_hook_guards). Fix: call "
            "torch._dynamo.reset() after offload_transform (or compile only after it, in a process that has not "
            "compiled these classes), set torch._dynamo.config.skip_nnmodule_hook_guards = False, or use "
            "path='fx' if the model traces.",
            UserWarning,
            stacklevel=3,
        )

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", type(self.__wrapped__).__name__)
        return f"<offloaded forward of {name}>"


class ByMode:
    """Runs the train-mode or the eval-mode transformed graph, following ``model.training``."""

    def __init__(self, model: nn.Module, train_fn: Callable[..., Any], eval_fn: Callable[..., Any]) -> None:
        self.model, self.train_fn, self.eval_fn = model, train_fn, eval_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.train_fn if self.model.training else self.eval_fn)(*args, **kwargs)


class RecomputeForward:
    """A layer's instance-level forward for ``recompute``/``recompute_offload``: non-reentrant checkpoint."""

    def __init__(self, fwd: Callable[..., Any]) -> None:
        self.fwd = fwd
        functools.update_wrapper(self, fwd)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.fwd(*args, **kwargs)
        return _ORIG_CHECKPOINT(self.fwd, *args, use_reentrant=False, **kwargs)
