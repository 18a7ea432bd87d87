"""Hyper-parameter checks of :class:`HybridDeviceOptimizer`, run before anything is split (private).

``**kwargs`` of ``HybridDeviceOptimizer`` go to ``cpu_optimizer_cls``/``gpu_optimizer_cls``, so the
valid names are those of their constructors; a typo (``lrr``) or a foreign option (``optimizer="sgd"``)
would otherwise sit unused in ``defaults`` while training ran with the default value. Value ranges
mirror torch's own constructor checks (``torch/optim/adamw.py``, ``adam.py``, ``sgd.py``): the
sub-optimizers are built only after host buffers are carved, so we check up front. Param groups get
the same value checks and a key check (``check_group_keys``): typos of valid names and our own
per-optimizer options are refused, other extra keys are kept as torch keeps them.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Iterable

import torch

__all__: list[str] = []

# Keyword that users coming from Megatron's OptimizerConfig (``optimizer="adam"``) try; it picks the
# algorithm there, here the classes do.
_ALGO_HINT = (
    "the algorithm is chosen by class here: pass cpu_optimizer_cls=torch.optim.AdamW (default), "
    "torch.optim.Adam or torch.optim.SGD (gpu_optimizer_cls defaults to the same class)"
)


def _ctor_names(cls: type) -> tuple[set[str], bool]:
    """Keyword names ``cls.__init__`` accepts (minus ``self``/``params``) and whether it takes ``**kwargs``."""
    names: set[str] = set()
    var_kw = False
    for name, prm in inspect.signature(cls.__init__).parameters.items():
        if prm.kind is prm.VAR_KEYWORD:
            var_kw = True
        elif prm.kind is not prm.VAR_POSITIONAL and name not in ("self", "params"):
            names.add(name)
    return names, var_kw


def _valid_names(classes: Iterable[type]) -> "set[str] | None":
    """Union of the constructor keywords of ``classes``; ``None`` when one of them takes ``**kwargs``."""
    valid: set[str] = set()
    for cls in dict.fromkeys(classes):
        names, var_kw = _ctor_names(cls)
        if var_kw:
            return None
        valid |= names
    return valid


def check_kwargs(kwargs: dict[str, Any], classes: Iterable[type], own: Iterable[str]) -> None:
    """Raise ``TypeError`` for a keyword no sub-optimizer class (nor ``HybridDeviceOptimizer``) accepts.

    Args:
        kwargs: the ``**kwargs`` given to ``HybridDeviceOptimizer``.
        classes: ``cpu_optimizer_cls`` and the class used for the GPU part.
        own: ``HybridDeviceOptimizer``'s own keyword names (listed in the message, for typos of them).

    Raises:
        TypeError: an unknown keyword, with the closest valid name (``difflib``) and the valid ones.
    """
    valid = _valid_names(classes)
    if valid is None:  # a class takes anything: it is the judge
        return
    for key in kwargs:
        if key in valid:
            continue
        everything = sorted(valid | set(own))
        close = difflib.get_close_matches(key, everything, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        if key == "optimizer":
            hint = f"{_ALGO_HINT}. "
        names = ", ".join(c.__name__ for c in dict.fromkeys(classes))
        raise TypeError(
            f"HybridDeviceOptimizer: unexpected keyword argument {key!r}; {hint}"
            f"valid optimizer keywords ({names}): {', '.join(sorted(valid))}; "
            f"HybridDeviceOptimizer's own: {', '.join(sorted(own))}."
        )


def _number(name: str, value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"HybridDeviceOptimizer: {name} must be a number{where}, got {value!r}.")
    return float(value)


def _at_least_zero(name: str, value: Any, where: str) -> None:
    v = _number(name, value, where)
    if not 0.0 <= v:  # NaN fails too, as in torch
        raise ValueError(f"HybridDeviceOptimizer: invalid {name}={value!r}{where}; valid range: {name} >= 0.")


def check_values(hyper: dict[str, Any], where: str = "") -> None:
    """Check the hyper-parameters present in ``hyper`` against torch's Adam/AdamW/SGD ranges.

    ``lr >= 0``, ``eps >= 0``, ``weight_decay >= 0``, ``momentum >= 0`` and ``betas`` two numbers in
    ``[0, 1)``; NaN is refused. Keys not present (or other keys) are left alone.

    Args:
        hyper: constructor defaults or one param group.
        where: context for the message, e.g. ``" in param group 1"``.

    Raises:
        TypeError: a value that is not a number (or a one-element tensor), ``betas`` not a pair, a
            flag (``amsgrad``, ``maximize``, ``nesterov``, ``fused``, ...) that is not a bool (or ``None``
            for the implementation flags).
        ValueError: a value out of range, naming the parameter, the value and the valid range.
    """
    for name in ("lr", "eps", "weight_decay", "momentum"):
        if name in hyper:
            _at_least_zero(name, hyper[name], where)
    for name in _BOOL_KEYS:
        v = hyper.get(name)
        if name in hyper and not isinstance(v, bool) and not (v is None and name in _IMPL_BOOL_KEYS):
            allowed = "True, False or None" if name in _IMPL_BOOL_KEYS else "True or False"
            raise TypeError(
                f"HybridDeviceOptimizer: {name} must be {allowed}{where}, got {v!r} ({type(v).__name__}); torch's fused "
                f"kernels take it as a bool (e.g. {name}=True)."
            )
    if "betas" in hyper:
        betas = hyper["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"HybridDeviceOptimizer: betas must be a pair (beta1, beta2){where}, got {betas!r}.")
        for i, b in enumerate(betas):
            v = _number(f"betas[{i}]", b, where)
            if not 0.0 <= v < 1.0 or math.isnan(v):
                raise ValueError(
                    f"HybridDeviceOptimizer: invalid betas[{i}]={b!r} (betas={tuple(betas)!r}){where}; "
                    f"valid range: 0 <= betas[{i}] < 1."
                )


# Flags of torch's Adam/AdamW/SGD: checked as bools at construction (a string or an int reached the fused
# kernel as an "invalid combination of arguments" at the first step: fresh-user report, seventh session).
_IMPL_BOOL_KEYS = ("foreach", "fused", "capturable", "differentiable")
_BOOL_KEYS = ("amsgrad", "maximize", "nesterov", "decoupled_weight_decay", *_IMPL_BOOL_KEYS)


# Keys torch's ``add_param_group`` itself writes into a group (named parameters), besides ``params``.
_TORCH_GROUP_KEYS = ("params", "param_names")


def check_with_torch(group: dict[str, Any], classes: Iterable[type], where: str,
                     tensors: "list[torch.Tensor] | None" = None) -> None:
    """Let each torch class check the group's hyper-parameters the way its own constructor does.

    The sub-optimizers are built from per-group values that their constructors never see as
    defaults, so ranges only the class knows (SGD's nesterov needs momentum > 0 and dampening 0,
    RMSprop's alpha >= 0, Adagrad's lr_decay >= 0) went unchecked until NaN weights (fresh-user
    report, eighth session). The class is built over ``tensors`` (the group's parameters, detached
    local tensors: classes such as Muon check shapes) or, for an empty group, one dummy tensor,
    with the group's values for the keywords it takes; implementation switches are checked
    elsewhere and left out. Constructors allocate no state, so this costs ~1 ms per group.

    Raises:
        ValueError: the class refused a value; its message, with the group and the class named.
    """
    for cls in dict.fromkeys(classes):
        names, _ = _ctor_names(cls)
        hyper = {k: v for k, v in group.items() if k in names and k not in _IMPL_BOOL_KEYS}
        try:
            cls(tensors or [torch.zeros(1, requires_grad=True)], **hyper)
        except ValueError as e:
            raise ValueError(
                f"HybridDeviceOptimizer: {cls.__name__} refuses the hyper-parameters{where}: {e}. torch.optim."
                f"{cls.__name__} would refuse them too; change that value."
            ) from None


def _typo_of(key: str, valid: Iterable[str]) -> "str | None":
    """The valid name ``key`` is a near miss of (``lrr``, ``weight_decy``, ``betas1``), if any.

    Stricter than ``check_kwargs``' hint (ratio >= 0.75, length within 2) because a group may also
    carry metadata keys that merely resemble a hyper-parameter (``weight_decay_mult``, ``layer_decay``).
    """
    for name in difflib.get_close_matches(key, sorted(valid), n=3, cutoff=0.75):
        if abs(len(name) - len(key)) <= 2:
            return name
    return None


def check_group_keys(group: dict[str, Any], where: str, classes: Iterable[type], per_optimizer: dict[str, Any]) -> None:
    """Check the keys of one param group, as ``check_kwargs`` does for keywords.

    A group may hold ``params``, any constructor keyword of ``classes`` (torch reads those per
    group), and, as in torch, other keys, which are kept and never read (Megatron's ``wd_mult``,
    ``lr_mult``, ``is_expert_parallel``; a name). ``HybridDeviceOptimizer``'s own options are per
    optimizer: a group may repeat the optimizer's value (``HybridDeviceOptimizer(old.param_groups,
    **old.defaults)`` rebuilds) but not set its own.

    Args:
        group: one param group dict, as given.
        where: context for the message, e.g. ``" in param group 1"``.
        classes: ``cpu_optimizer_cls`` and the class used for the GPU part.
        per_optimizer: ``HybridDeviceOptimizer``'s own options and their values for this optimizer
            (``offload_fraction``, ...); ``cpu_optimizer_cls``/``gpu_optimizer_cls`` are never valid in a group.

    Raises:
        ValueError: a per-optimizer option with another value than the optimizer's (or an
            optimizer class), naming it, the value and the constructor's value.
        TypeError: a key that is a near miss of a valid one (a typo such as ``lrr``), with the
            closest valid name and the valid ones.
    """
    valid = _valid_names(classes)
    for key, value in group.items():
        if not isinstance(key, str) or key in _TORCH_GROUP_KEYS or (valid is not None and key in valid):
            continue
        if key in per_optimizer or key in ("cpu_optimizer_cls", "gpu_optimizer_cls"):
            if key in per_optimizer and _equal(value, per_optimizer[key]):
                continue
            mine = f"this optimizer's: {key}={per_optimizer[key]!r}" if key in per_optimizer else "not a group option"
            raise ValueError(
                f"HybridDeviceOptimizer: {key}={value!r}{where}; {key} is per optimizer, not per param group "
                f"({mine}). Pass it to the HybridDeviceOptimizer constructor and remove it from the group."
            )
        if valid is None:  # a class takes anything: it is the judge, as for keywords
            continue
        close = _typo_of(key, valid | set(per_optimizer))
        if close is not None:
            names = ", ".join(c.__name__ for c in dict.fromkeys(classes))
            raise TypeError(
                f"HybridDeviceOptimizer: unexpected key {key!r}{where}; did you mean {close!r}? valid group keys "
                f"({names}): params, {', '.join(sorted(valid))}. A key this close to a valid one is taken for a typo; "
                "other extra keys (e.g. Megatron's wd_mult) are kept unread, as torch does."
            )


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. a multi-element tensor
        return False
