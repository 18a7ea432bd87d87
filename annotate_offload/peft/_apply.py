"""``apply_offload_marks``: the adapter marks for Hugging Face peft models, the head's input, frozen weights.

Hugging Face peft's LoRA layers (a ``base_layer`` plus ``lora_A``/``lora_B`` ``ModuleDict``s keyed by
adapter name) cannot be edited, so the marks :class:`LoRALinear` sets itself (Note [Adapter marks] in
``_policy.py``) come from forward hooks: a pre-hook on the LoRA layer (opt-in: tag its input), and pre/post hooks
that run each ``lora_A[name]`` and ``lora_B[name]`` inside ``marked_saves`` and mark ``lora_A``'s
output, the rank-``r`` hidden. Two model-wide marks
complete them:

* The language-model head's input is never offloaded: a small GEMM over a huge vocabulary hides no
  copy, and backward needs the input right away. Hooks mark it ``mark_not_offload`` and run the head
  inside ``keep_saves``, so whatever it saves stays on the device. The head module is hooked (with
  tied embeddings its weight is the embedding matrix), found through DDP and peft's wrappers.
* Frozen weights: a pre-hook on every module that owns frozen parameters registers all of the
  model's with the open scope's synchronizer (``add_frozen_weights``), once per synchronizer.

Every hook returns at once when no offload scope is open.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annotate_offload.errors import OffloadError
from annotate_offload.runtime import is_cpu_offload_enabled, mark_not_offload
from annotate_offload.runtime._synchronizer import _active_synchronizer

from ._lora import LoRALinear
from ._policy import active_policy, keep_saves, mark_adapter_hidden, mark_adapter_input, marked_saves

__all__ = ["apply_offload_marks", "remove_offload_marks"]

_STATE = "_annotate_offload_peft_marks"
_HEAD_NAMES = ("lm_head", "output", "output_layer", "head")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside ``DistributedDataParallel``/``DataParallel``, ``PeftModel`` and peft's tuner.

    ``PeftModel.base_model`` is peft's tuner (e.g. ``LoraModel``) and the tuner's ``.model`` is
    the user's model; ``.module`` unwraps DDP. Any other model is returned as is.
    """
    seen: set[int] = set()
    m = model
    while id(m) not in seen:
        seen.add(id(m))
        inner = None
        if isinstance(m, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = m.module
        elif type(m).__module__.split(".")[0] == "peft":
            # registered children only: peft's and HF's __getattr__ fall through to the wrapped
            # model (HF's own `base_model` property is the decoder body, one level too deep)
            inner = m._modules.get("base_model")
            if inner is None:
                inner = m._modules.get("model")
        if not isinstance(inner, nn.Module):
            break
        m = inner
    return m


def find_lm_head(model: nn.Module) -> Optional[nn.Module]:
    """The language-model head (output projection) of ``model``, or ``None`` if there is none.

    Looks through wrappers (:func:`unwrap_model`), then asks Hugging Face's
    ``get_output_embeddings()``, then tries the attributes ``lm_head``, ``output``,
    ``output_layer`` and ``head``. With tied embeddings this is the head module (whose weight is
    the embedding matrix), not the embedding.
    """
    inner = unwrap_model(model)
    getter = getattr(inner, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Module):
            return head
    for name in _HEAD_NAMES:
        head = getattr(inner, name, None)
        if isinstance(head, nn.Module) and not isinstance(head, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return head
    return None


def _is_peft_lora(module: nn.Module) -> bool:
    """A peft LoRA layer: ``base_layer`` plus ``lora_A``/``lora_B`` ``ModuleDict``s (duck-typed: no peft import)."""
    return (
        isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
        and isinstance(getattr(module, "base_layer", None), nn.Module)
    )


# --------------------------------------------------------------------------- hook objects


def _peft_layer_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook of a peft LoRA layer: opt-in tags its input."""
    policy = active_policy()
    if policy == "opt_in":
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        mark_adapter_input(policy, first)


class _SaveScope:
    """Forward pre/post hooks that run a module inside a marking saved-tensors scope while offload is on.

    ``role`` ``"input"``/``"hidden"``: :func:`marked_saves` for ``lora_A``/``lora_B`` (the post-hook of
    ``"input"`` also marks ``lora_A``'s output, the rank-``r`` hidden); ``"keep"``: :func:`keep_saves`
    for the LM head, whose input is also marked ``mark_not_offload`` directly.
    """

    __slots__ = ("role", "open")

    def __init__(self, role: str) -> None:
        self.role = role
        self.open: list[Any] = []  # contexts entered by pre(), innermost last (None: nothing entered)

    def pre(self, module: nn.Module, args: tuple) -> None:
        policy = active_policy()
        ctx = None
        if policy is not None:
            if self.role == "keep":
                mark_not_offload(*[a for a in args if isinstance(a, torch.Tensor)])
                ctx = keep_saves()
            else:
                ctx = marked_saves(policy, self.role)
            ctx.__enter__()
        self.open.append(ctx)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        ctx = self.open.pop() if self.open else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if self.role == "input":
            mark_adapter_hidden(active_policy(), output)

    def install(self, module: nn.Module, handles: list) -> None:
        handles.append(module.register_forward_pre_hook(self.pre))
        handles.append(module.register_forward_hook(self.post, always_call=True))

    def __repr__(self) -> str:
        return f"_SaveScope(role={self.role!r})"


class _FrozenRegistry:
    """Pre-hook shared by the modules owning frozen parameters: registers the model's frozen weights once per synchronizer."""

    __slots__ = ("model", "done", "__weakref__")

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)
        self.done: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not is_cpu_offload_enabled():
            return None
        sync = _active_synchronizer()
        model = self.model()
        if sync is None or model is None or sync in self.done:
            return None
        frozen = [p for p in model.parameters() if not p.requires_grad]
        if frozen:
            sync.add_frozen_weights(frozen)
        self.done.add(sync)

    def __deepcopy__(self, memo: dict) -> "_FrozenRegistry":
        # a deep copy of the model (Note [Copying a synchronizer]) registers its own frozen weights
        # with its own runtime: the weak reference follows the model into the copy
        new = _FrozenRegistry.__new__(_FrozenRegistry)
        memo[id(self)] = new
        model = self.model()
        new.model = weakref.ref(memo.get(id(model), model)) if model is not None else self.model
        new.done = weakref.WeakSet()
        return new

    def __repr__(self) -> str:
        return f"_FrozenRegistry(synchronizers={len(self.done)})"


# --------------------------------------------------------------------------- public API


class OffloadMarks:
    """What :func:`apply_offload_marks` installed on a model; ``refresh()`` follows the model,
    ``remove()`` undoes it.

    Attributes:
        lm_head (nn.Module | None): the head whose input is kept on the device.
        peft_lora_layers (int): Hugging Face peft LoRA layers hooked.
        lora_linear_layers (int): :class:`LoRALinear` layers (they mark themselves).
        frozen_modules (int): modules whose pre-hook registers the frozen weights.
    """

    __slots__ = ("lm_head", "peft_lora_layers", "lora_linear_layers", "frozen_modules", "_handles", "_model",
                 "_auto_head")

    def __init__(self, model: nn.Module, lm_head: Optional[nn.Module], auto_head: bool) -> None:
        self._model = weakref.ref(model)
        self.lm_head = lm_head
        self._auto_head = auto_head  # find the head again at refresh()
        self._handles: list[Any] = []
        self._install(model)

    def _install(self, model: nn.Module) -> None:
        self.peft_lora_layers = self.lora_linear_layers = self.frozen_modules = 0
        handles = self._handles
        for module in model.modules():
            if _is_peft_lora(module):
                self.peft_lora_layers += 1
                handles.append(module.register_forward_pre_hook(_peft_layer_pre, with_kwargs=True))
                for a in module.lora_A.values():
                    _SaveScope("input").install(a, handles)
                for b in module.lora_B.values():
                    _SaveScope("hidden").install(b, handles)
            elif isinstance(module, LoRALinear):
                self.lora_linear_layers += 1
        registry = _FrozenRegistry(model)
        for module in model.modules():
            if any(not p.requires_grad for p in module.parameters(recurse=False)):
                self.frozen_modules += 1
                handles.append(module.register_forward_pre_hook(registry))
        if self.lm_head is not None:
            _SaveScope("keep").install(self.lm_head, handles)

    def refresh(self) -> None:
        """Install the hooks again on the model as it is now: adapters added since (peft's
        ``get_peft_model`` after ``offload_transform``), parameters frozen since. Same handle."""
        model = self._model()
        if model is None or model.__dict__.get(_STATE) is not self:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._auto_head:
            self.lm_head = find_lm_head(model)
        self._install(model)

    def __deepcopy__(self, memo: dict) -> "OffloadMarks":
        # the marks of a deep-copied model are the copy's: its hooks, head and model (the weak
        # reference would otherwise keep pointing at the original)
        new = OffloadMarks.__new__(OffloadMarks)
        memo[id(self)] = new
        model = self._model()
        new._model = weakref.ref(memo.get(id(model), model)) if model is not None else self._model
        new.lm_head = copy.deepcopy(self.lm_head, memo)
        new.peft_lora_layers, new.lora_linear_layers = self.peft_lora_layers, self.lora_linear_layers
        new.frozen_modules, new._auto_head = self.frozen_modules, self._auto_head
        new._handles = copy.deepcopy(self._handles, memo)
        return new

    @property
    def active(self) -> bool:
        """True until :meth:`remove` has run."""
        model = self._model()
        return model is not None and model.__dict__.get(_STATE) is self

    def remove(self) -> None:
        """Remove every hook this call installed (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        model = self._model()
        if model is not None and model.__dict__.get(_STATE) is self:
            del model.__dict__[_STATE]

    def __repr__(self) -> str:
        head = type(self.lm_head).__name__ if self.lm_head is not None else None
        return (
            f"OffloadMarks(lm_head={head}, peft_lora_layers={self.peft_lora_layers}, "
            f"lora_linear_layers={self.lora_linear_layers}, frozen_modules={self.frozen_modules}, "
            f"active={self.active})"
        )


_AUTO = "auto"


def apply_offload_marks(
    model: nn.Module, *, lm_head: Union[str, nn.Module, None] = _AUTO, warn: bool = True
) -> OffloadMarks:
    """Install the PEFT offload marks on ``model`` (a peft ``PeftModel``, a model with :class:`LoRALinear`, any model):
    the adapter marks of peft LoRA layers, the language-model head's input kept on the device, frozen weights
    registered with the synchronizer (module docstring).

    ``offload_transform`` calls it, and refreshes the marks when modules are registered later
    (``get_peft_model`` after the transform), so calling it yourself is needed only for
    ``get_cpu_offload_context`` users or to name the head. Outputs and gradients are bit-identical with
    and without the hooks. Calling it again on the same model (or on a wrapper of it: marks live on the
    innermost model, unwrapped through DDP, ``PeftModel`` and peft's tuner) returns the same handle.

    Args:
        model (nn.Module): the model, e.g. ``peft.get_peft_model(model, LoraConfig(...))``.
        lm_head ("auto" | nn.Module | None): ``"auto"`` finds the head (:func:`find_lm_head`) and warns
            when there is none; a module names it; ``None`` installs no head hook. Default: ``"auto"``.
        warn (bool): warn when ``"auto"`` finds no head. Default: ``True``.

    Returns:
        OffloadMarks: the handle (``.remove()`` uninstalls the hooks, ``.refresh()`` re-installs them
        on the model as it is now).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``lm_head`` is not ``"auto"``, ``None`` or an
            ``nn.Module``.
        ValueError: ``lm_head`` is a module that is not part of ``model``.
        OffloadError: marks were already applied with a different ``lm_head``.

    Warns:
        UserWarning: ``lm_head="auto"`` and no head was found.

    Example::

        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        marks = apply_offload_marks(peft_model)
        ctx, sync = get_cpu_offload_context(True, num_layers=12, model_layers=16)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_offload_marks: model must be an nn.Module, got {type(model).__name__}.")
    if not (lm_head is None or isinstance(lm_head, nn.Module) or (isinstance(lm_head, str) and lm_head == _AUTO)):
        raise TypeError(
            f"apply_offload_marks: lm_head must be 'auto', None or an nn.Module, got {lm_head!r}; pass the "
            "output projection module (e.g. model.lm_head) or None for a model without one."
        )
    inner = unwrap_model(model)
    if isinstance(lm_head, nn.Module) and not any(m is lm_head for m in model.modules()):
        raise ValueError(
            f"apply_offload_marks: lm_head={type(lm_head).__name__} is not a submodule of {type(model).__name__}; "
            "pass a module of this model (e.g. model.lm_head), 'auto' or None."
        )
    existing: Optional[OffloadMarks] = inner.__dict__.get(_STATE)
    if existing is not None:
        if lm_head == _AUTO or lm_head is existing.lm_head:
            return existing
        raise OffloadError(
            f"apply_offload_marks: marks are already applied to {type(inner).__name__} with "
            f"lm_head={type(existing.lm_head).__name__ if existing.lm_head is not None else None}; call "
            "remove_offload_marks(model) first to change the head."
        )
    auto = isinstance(lm_head, str)
    head = find_lm_head(model) if auto else lm_head
    if auto and head is None and warn:
        warnings.warn(
            f"apply_offload_marks: found no language-model head in {type(inner).__name__} (looked for "
            f"get_output_embeddings() and {', '.join(_HEAD_NAMES)}); pass lm_head=<module> to keep its input on the "
            "device, or lm_head=None if the model has none.",
            UserWarning,
            stacklevel=2,
        )
    marks = OffloadMarks(inner, head, auto)
    inner.__dict__[_STATE] = marks
    return marks


def has_offload_marks(model: nn.Module) -> bool:
    """Whether :func:`apply_offload_marks` hooks are installed on ``model`` (or the model it wraps)."""
    return isinstance(model, nn.Module) and _STATE in unwrap_model(model).__dict__


def remove_offload_marks(model: nn.Module) -> bool:
    """Remove the hooks :func:`apply_offload_marks` installed on ``model`` (or the model it wraps).

    Returns:
        bool: whether there were any.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remove_offload_marks: model must be an nn.Module, got {type(model).__name__}.")
    marks = unwrap_model(model).__dict__.get(_STATE)
    if marks is None:
        return False
    marks.remove()
    return True
