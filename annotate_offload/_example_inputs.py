"""``example_inputs`` of ``offload_transform`` and the planner: one training step's inputs (private).

The meta-device estimate and the planner's profiling run ``model(*args, **kwargs)`` with them: the
profiling without a key/value cache (Note [No key/value cache while profiling] in
``planner/_measure.py``), the estimate once in the model's own settings (a cache there is empty, and
without one Llama's mask code calls ``.item()``, which meta tensors refuse).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__: list[str] = []

_FIX = "pass one training step's inputs, e.g. example_inputs=(x,) or example_inputs={'input_ids': ids}."


def split(example_inputs: Any, who: str) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``.

    Args:
        example_inputs: a tensor, a tuple/list of positional inputs, or a dict of keyword inputs.
        who: the public function named in the error.

    Raises:
        TypeError: anything else (a string, a number, ``None``), or a dict with a non-str key.
        ValueError: an empty tuple, list or dict.
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list, dict)) and len(example_inputs) == 0:
        raise ValueError(f"{who}: example_inputs={example_inputs!r} is empty; {_FIX}")
    if isinstance(example_inputs, dict):
        bad = next((k for k in example_inputs if not isinstance(k, str)), None)
        if bad is not None:
            raise TypeError(
                f"{who}: example_inputs is a dict with the non-str key {bad!r}; a dict gives keyword inputs "
                "(model(**example_inputs)), so its keys must be the forward's argument names, e.g. "
                "{'input_ids': ids}; pass positional inputs as a tuple, e.g. (x,)."
            )
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(f"{who}: example_inputs must be a tensor, a tuple/list of positional inputs or a dict of keyword "
                    f"inputs (str keys), got {type(example_inputs).__name__}; {_FIX}")


def cache_configs(model: nn.Module) -> list:
    """The distinct ``config`` objects of ``model``'s modules that have ``use_cache``, Hugging Face's switch
    for the key/value cache."""
    return list({id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "use_cache")}.values())


def cache_off(configs: list) -> list:
    """Set ``use_cache=False`` on the ``configs`` where it is ``True``; returns those, for the caller to put back."""
    on = [c for c in configs if c.use_cache is True]
    for c in on:
        c.use_cache = False
    return on
