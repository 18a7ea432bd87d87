"""Hyper-parameter checks of :class:`HybridDeviceOptimizer`, run before anything is split (private).

``**kwargs`` of ``HybridDeviceOptimizer`` go to ``cpu_optimizer_cls``/``gpu_optimizer_cls``, so the
valid names are those of their constructors; a typo (``lrr``) or a foreign option (``optimizer="sgd"``)
would otherwise sit unused in ``defaults`` while training ran with the default value. Value ranges
mirror torch's own constructor checks (``torch/optim/adamw.py``, ``adam.py``, ``sgd.py``): the
sub-optimizers are built only after host buffers are carved, so we check up front.
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


def check_kwargs(kwargs: dict[str, Any], classes: Iterable[type], own: Iterable[str]) -> None:
    """Raise ``TypeError`` for a keyword no sub-optimizer class (nor ``HybridDeviceOptimizer``) accepts.

    Args:
        kwargs: the ``**kwargs`` given to ``HybridDeviceOptimizer``.
        classes: ``cpu_optimizer_cls`` and the class used for the GPU part.
        own: ``HybridDeviceOptimizer``'s own keyword names (listed in the message, for typos of them).

    Raises:
        TypeError: an unknown keyword, with the closest valid name (``difflib``) and the valid ones.
    """
    valid: set[str] = set()
    for cls in dict.fromkeys(classes):
        names, var_kw = _ctor_names(cls)
        if var_kw:  # the class takes anything: it is the judge
            return
        valid |= names
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
        TypeError: a value that is not a number (or a one-element tensor), ``betas`` not a pair.
        ValueError: a value out of range, naming the parameter, the value and the valid range.
    """
    for name in ("lr", "eps", "weight_decay", "momentum"):
        if name in hyper:
            _at_least_zero(name, hyper[name], where)
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
