"""What the framework callbacks share: their arguments, the transform, the optimizer checks (private)."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..annotate._transform import transform, transforms_in
from ..annotate._settings import resolve
from ..config import _SECTIONS, Config, ModelConfig, OptimizerConfig, _closest, _closest_key
from ..errors import OffloadError
from ..optim import HybridDeviceOptimizer

__all__: list[str] = []


class Offload:
    """A callback's offload arguments, checked at construction (``offload_transform``'s checks, with ``who``
    naming the callback and ``inputs`` what a budget needs besides), and the transform they ask for."""

    def __init__(self, who: str, num_layers: Any, memory_budget: Any, config: Any, fields: dict[str, Any],
                 inputs: str = " with example_inputs=") -> None:
        self.who = who
        self.config, self.optimizer_section = (None, False) if config is None else as_config(config, who)
        try:
            self.settings = resolve(num_layers, self.config, fields, memory_budget, inputs)  # None: cpu_offloading=False
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("offload_transform:", f"{who}:", 1)) from None
        if self.settings is not None and self.settings.num_layers != "auto" and self.settings.num_layers < 0:
            raise ValueError(f"{who}: num_layers={self.settings.num_layers}: pass 0 <= num_layers < L, the model's "
                             "layer count (the first N layers are offloaded; N < L is checked on the model).")
        self.num_layers, self.memory_budget, self.fields = num_layers, memory_budget, fields
        # the model transformed, once; weakly, so that a callback reused across runs keeps none alive
        self._model: Any = lambda: None

    @property
    def model(self) -> nn.Module | None:
        """The model :meth:`transform` transformed last, while it is alive."""
        return self._model()

    @property
    def budget(self) -> bool:
        """Whether the layers are planned for a memory budget (which needs a batch)."""
        return self.settings is not None and self.settings.memory_budget is not None

    def wants(self, model: nn.Module) -> bool:
        """Whether :meth:`transform` is due: offload is on and ``model`` is not transformed by it yet."""
        return self.settings is not None and model is not self.model

    def transform(self, model: nn.Module, example_inputs: Any, opt: HybridDeviceOptimizer | None) -> None:
        """``offload_transform(model, ...)``; with a budget the plan is made for the optimizer as built:
        ``opt``'s ``offload_fraction``, or on the device (``0.0``) without a ``HybridDeviceOptimizer``."""
        if transforms_in(model):
            raise OffloadError(f"{self.who}: {type(model).__name__} is already offloaded by an offload_transform call; "
                               "keep one of the two (this callback or that call), or call remove_offload(model) first.")
        fraction = (0.0 if opt is None else opt.defaults["offload_fraction"]) if self.budget else None
        with warnings.catch_warnings():  # the plan keeps the note; the bytes are measured on the first step
            warnings.filterwarnings("ignore", "offload_transform: example_inputs= could not run the forward")
            transform(model, self.num_layers, self.memory_budget, example_inputs, self.config, None, None,
                      self.fields, fraction)
        self._model = weakref.ref(model)


def as_config(config: Any, who: str) -> tuple[Config, bool]:
    """``config`` as a :class:`Config`, and whether it carries an optimizer section.

    Accepts a ``Config``, a ``ModelConfig``, an ``OptimizerConfig`` or a mapping of sections, as a
    YAML recipe carries it: ``{"model": {"cpu_offloading": True, ...}, "optimizer": {...}}``.

    Raises:
        TypeError: another type; a section that is not a mapping; a field of the wrong type.
        ValueError: an unknown section or field (with the closest valid name); a broken config rule.
    """
    if isinstance(config, Config):
        return config, True
    if isinstance(config, ModelConfig):
        return Config(model=config), False
    if isinstance(config, OptimizerConfig):
        return Config(optimizer=config), True
    if not isinstance(config, Mapping):
        raise TypeError(f"{who}: config must be a Config, ModelConfig, OptimizerConfig or a mapping of sections "
                        f"({{'model': {{...}}, 'optimizer': {{...}}}}), got {type(config).__name__}.")
    sections = {}
    for name, values in config.items():
        if name not in _SECTIONS:
            owner = next((s for s, cls in _SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}), None)
            hint = f"nest it in its section: {{{owner!r}: {{{name!r}: ...}}}}." if owner else _closest(name, _SECTIONS)
            raise ValueError(f"{who}: unknown config section {name!r}; {hint}")
        if not isinstance(values, Mapping):
            raise TypeError(f"{who}: config[{name!r}] must be a mapping of {name}.* fields, got {values!r}.")
        known = {f.name for f in dataclasses.fields(_SECTIONS[name])}
        for key in values:
            if key not in known:
                raise ValueError(f"{who}: unknown config key '{name}.{key}'; {_closest_key(name, key)}")
        sections[name] = _SECTIONS[name](**values)
    return Config(**sections), "optimizer" in config


def hybrid_of(optimizer: Any) -> HybridDeviceOptimizer | None:
    """The ``HybridDeviceOptimizer`` inside a framework's optimizer wrapper (accelerate's ``.optimizer``,
    Lightning's ``._optimizer``), or ``None``."""
    for _ in range(4):
        if isinstance(optimizer, HybridDeviceOptimizer) or optimizer is None:
            return optimizer
        optimizer = getattr(optimizer, "optimizer", getattr(optimizer, "_optimizer", None))
    return None


def check_modes(opt: HybridDeviceOptimizer, who: str, norm: tuple[str, str] | None, accumulate: tuple[str, Any]) -> None:
    """Refuse the optimizer modes that free or step device gradients before the framework reads their norm
    (``norm``: how it does, and the setting that stops it, or ``None``) or accumulates micro-batches
    (``accumulate``: the setting and its value, on when ``> 1``).

    Raises:
        ValueError: naming the mode, the framework setting and the fix.
    """
    fix = "build the optimizer with {}=False (the default mode, exact with clipping and accumulation)"
    if opt.defaults["offload_gradients"] and norm:
        raise ValueError(f"{who}: HybridDeviceOptimizer(offload_gradients=True) frees each host-stepped gradient on the "
                         f"device during backward, but {norm[0]}, whose norm would miss those gradients. Fix: "
                         f"{fix.format('offload_gradients')}{norm[1]}.")
    if not opt.defaults["step_in_backward"]:
        return
    if norm:
        raise ValueError(f"{who}: HybridDeviceOptimizer(step_in_backward=True) steps each host chunk during backward, "
                         f"but {norm[0]}, which rescales gradients after their chunks were stepped. Fix: "
                         f"{fix.format('step_in_backward')}{norm[1]}.")
    setting, value = accumulate
    if value > 1:
        raise ValueError(f"{who}: HybridDeviceOptimizer(step_in_backward=True) steps each host chunk during backward, "
                         f"but {setting}={value!r} accumulates micro-batches, whose gradients would arrive after their "
                         f"chunks were stepped. Fix: {fix.format('step_in_backward')}, or set {setting}=1.")
