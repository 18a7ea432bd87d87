"""``LoRALinear`` (a frozen ``nn.Linear`` plus a trainable low-rank update) and ``apply_lora``.

LoRA as in Hu et al. 2021 (arXiv:2106.09685) with Hugging Face peft's defaults: ``A``
Kaiming-uniform, ``B`` zero (a fresh adapter changes nothing), ``scaling = alpha / r``.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn

from ._policy import active_policy, mark_adapter_hidden, mark_adapter_input, marked_saves, register_frozen

__all__ = ["LoRALinear", "apply_lora"]

Targets = Union[str, Sequence[str], Callable[[nn.Module, str], bool]]


def _check_hparams(r: object, alpha: object, dropout: object, where: str) -> None:
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"{where}: r must be an int (the adapter rank), got {r!r}; pass e.g. r=8.")
    if r < 1:
        raise ValueError(f"{where}: r must be >= 1 (the adapter rank), got r={r}; pass e.g. r=8.")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{where}: alpha must be a number (scaling = alpha / r), got {alpha!r}; pass e.g. alpha=16.")
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"{where}: alpha must be a finite number > 0 (scaling = alpha / r), got alpha={alpha!r}.")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"{where}: dropout must be a float in [0, 1), got {dropout!r}; pass e.g. dropout=0.05.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(
            f"{where}: dropout must be in [0, 1) (probability of zeroing an adapter input), got dropout={dropout!r}."
        )


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-``r`` update: ``y = base(x) + B(A(drop(x))) * alpha / r``.

    The base layer's parameters are frozen (``requires_grad=False``) in place; ``lora_A``
    (``in_features -> r``) and ``lora_B`` (``r -> out_features``) are bias-free ``nn.Linear``
    layers on the base weight's device and dtype. While an offload scope is open the forward marks
    its tensors for the active selection policy and registers the frozen base weights (Note [Adapter
    marks] in ``_policy.py``); the output is bit-identical with and without offloading.

    Args:
        base (nn.Linear): the layer to adapt (kept as ``self.base``; same object).
        r (int): adapter rank, ``>= 1``. Default: ``8``.
        alpha (float): scale numerator, ``> 0`` (``scaling = alpha / r``). Default: ``16``.
        dropout (float): dropout probability on the adapter input, in ``[0, 1)``. Default: ``0.0``.

    Shapes:
        ``x``: ``(..., in_features)`` → ``(..., out_features)``, in the base layer's dtype (or the
        autocast dtype).

    Raises:
        TypeError: ``base`` is not an ``nn.Linear``; ``r``/``alpha``/``dropout`` of the wrong type.
        ValueError: ``r < 1``, ``alpha <= 0``, ``dropout`` outside ``[0, 1)``.
    """

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0, dropout: float = 0.0) -> None:
        if not isinstance(base, nn.Linear):
            raise TypeError(
                f"LoRALinear: base must be an nn.Linear, got {type(base).__name__}; wrap the linear layer "
                "itself (apply_lora(model, target_modules=[...]) finds them by name)."
            )
        _check_hparams(r, alpha, dropout, "LoRALinear")
        super().__init__()
        self.base = base
        self.r = r
        self.alpha = float(alpha)
        self.scaling = float(alpha) / r
        kw = {"device": base.weight.device, "dtype": base.weight.dtype, "bias": False}
        self.lora_A = nn.Linear(base.in_features, r, **kw)
        self.lora_B = nn.Linear(r, base.out_features, **kw)
        self.lora_dropout: nn.Module = nn.Dropout(p=float(dropout)) if dropout > 0 else nn.Identity()
        for p in base.parameters():
            p.requires_grad_(False)
        self.reset_lora_parameters()

    @property
    def in_features(self) -> int:
        """``base.in_features``."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """``base.out_features``."""
        return self.base.out_features

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """``A`` Kaiming-uniform (``a = sqrt(5)``, peft's default), ``B`` zero: the update starts at zero."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        policy = active_policy()
        if policy is not None:
            register_frozen(self.base.parameters())
        out = self.base(x)
        h = self.lora_dropout(x)
        mark_adapter_input(policy, x, h)
        with marked_saves(policy, "input"):  # the (B*T, in) view / autocast cast lora_A saves
            a = self.lora_A(h)
        mark_adapter_hidden(policy, a)
        with marked_saves(policy, "hidden"):  # the rank-r view lora_B saves
            b = self.lora_B(a)
        return out + b * self.scaling

    def extra_repr(self) -> str:
        p = getattr(self.lora_dropout, "p", 0.0)
        return f"r={self.r}, alpha={self.alpha:g}, scaling={self.scaling:g}, dropout={p:g}"


# --------------------------------------------------------------------------- apply_lora


def _matcher(target_modules: Targets) -> tuple[Callable[[nn.Module, str], bool], str]:
    if callable(target_modules) and not isinstance(target_modules, str):
        return (lambda m, fqn: bool(target_modules(m, fqn))), getattr(target_modules, "__qualname__", "<callable>")
    if isinstance(target_modules, str):
        names: tuple = (target_modules,)
    elif isinstance(target_modules, Sequence) and target_modules and all(isinstance(n, str) for n in target_modules):
        names = tuple(target_modules)
    else:
        raise TypeError(
            f"apply_lora: target_modules must be a module name, a non-empty list of names (matched against the "
            f"end of each module's qualified name, as peft does), 'all-linear', or a callable (module, fqn) -> bool; "
            f"got {target_modules!r}."
        )
    if names == ("all-linear",):
        return (lambda m, fqn: isinstance(m, nn.Linear)), "all-linear"
    return (lambda m, fqn: any(fqn == n or fqn.endswith("." + n) for n in names)), repr(list(names))


def apply_lora(
    model: nn.Module,
    target_modules: Targets = ("q_proj", "v_proj"),
    *,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
) -> nn.Module:
    """Replace the targeted ``nn.Linear`` layers of ``model`` by :class:`LoRALinear`, in place.

    Every parameter of the model is then frozen except the adapters' ``lora_A``/``lora_B``
    weights (as ``peft.get_peft_model`` does). ``state_dict`` keys of a replaced layer move under
    ``<name>.base.`` and gain ``<name>.lora_A.weight``/``<name>.lora_B.weight``. With
    ``"all-linear"`` the language-model head (see :func:`find_lm_head`) is left alone, as in peft.
    For offloading, :func:`apply_offload_marks` (or ``offload_transform``) adds the model-wide marks.

    Args:
        model (nn.Module): the model.
        target_modules (str | Sequence[str] | Callable[[nn.Module, str], bool]): names matched against
            the end of each module's qualified name (``"q_proj"`` matches ``layers.0.self_attn.q_proj``),
            ``"all-linear"``, or ``fn(module, fqn)``. Only ``nn.Linear`` modules can be targeted.
            Default: ``("q_proj", "v_proj")``.
        r (int): adapter rank, ``>= 1``. Default: ``8``.
        alpha (float): update scale numerator (``scaling = alpha / r``). Default: ``16``.
        dropout (float): adapter-input dropout in ``[0, 1)``. Default: ``0.0``.

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        TypeError: ``model`` not an ``nn.Module``; bad ``target_modules``/``r``/``alpha``/``dropout`` types.
        ValueError: nothing matched (the message lists the model's linear layers); a match that is
            not an ``nn.Linear`` or is already a ``LoRALinear``; ``r``/``alpha``/``dropout`` out of range.
            Raised before the model is changed.

    Example::

        model = Llama(LlamaConfig.from_preset("llama-tiny"))
        apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], r=8, alpha=16)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_lora: model must be an nn.Module, got {type(model).__name__}.")
    _check_hparams(r, alpha, dropout, "apply_lora")
    match, described = _matcher(target_modules)
    from ._apply import find_lm_head  # local: _apply imports this module

    head = find_lm_head(model) if described == "all-linear" else None
    targets: list[tuple[str, nn.Linear]] = []
    inside_lora: list[str] = []
    for fqn, module in model.named_modules():
        if isinstance(module, LoRALinear):
            inside_lora.append(fqn + ".")
        if module is model or module is head or not match(module, fqn):
            continue
        if any(fqn.startswith(p) for p in inside_lora):
            continue  # the base/lora_A/lora_B of an existing adapter
        if isinstance(module, LoRALinear):
            raise ValueError(
                f"apply_lora: {fqn} is already a LoRALinear (target_modules={described}); apply LoRA once, or "
                "exclude it from target_modules."
            )
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"apply_lora: target {fqn} is a {type(module).__name__}, not an nn.Linear "
                f"(target_modules={described}); name the linear layers inside it instead."
            )
        targets.append((fqn, module))
    if not targets:
        linears = [f for f, m in model.named_modules() if isinstance(m, nn.Linear) and not any(
            f.startswith(p) for p in inside_lora)]
        shown = ", ".join(linears[:8]) + (", ..." if len(linears) > 8 else "")
        raise ValueError(
            f"apply_lora: target_modules={described} matched no nn.Linear in {type(model).__name__}; "
            f"its linear layers are: {shown or 'none'}. Pass names that end those qualified names."
        )
    for fqn, linear in targets:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, r=r, alpha=alpha, dropout=dropout))
    adapter = {id(p) for m in model.modules() if isinstance(m, LoRALinear)
               for p in (*m.lora_A.parameters(), *m.lora_B.parameters())}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapter)
    return model
