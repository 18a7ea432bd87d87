"""Configuration: frozen dataclasses with Megatron Bridge field names, their rules, dotted overrides.

:class:`Config` holds three sections, as Megatron Bridge's ``ConfigContainer`` does: :class:`ModelConfig`
(``model.*``), :class:`OptimizerConfig` (``optimizer.*``) and :class:`TrainConfig` (``train.*``). Every
section validates itself in ``__post_init__``, so an invalid object never exists and nothing downstream
(a model, an optimizer) is touched first.
Each rule that mirrors Megatron raises a ``ValueError`` whose text starts with Megatron's own
message (users search for it), then names the field, its value and the fix.

:func:`from_overrides` parses ``section.field=value`` strings, the form a CLI receives
(``model.cpu_offloading=True optimizer.optimizer_offload_fraction=0.5``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

__all__ = [
    "OffloadPolicy",
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "Config",
    "from_overrides",
    "check_offload_num_layers",
    "parse_memory_budget",
]


class OffloadPolicy(str, enum.Enum):
    """Which saved tensors the runtime offloads.

    ``OPT_OUT`` (default): every eligible tensor unless ``mark_not_offload``.
    ``OPT_IN``: only tensors carrying ``activation_offloading=True`` (TE's legacy semantics).
    """

    OPT_OUT = "opt_out"
    OPT_IN = "opt_in"


_RECOMPUTE_CHOICES = (None, "full", "selective")
_CUDA_GRAPH_CHOICES = ("none", "local", "transformer_engine")
_OPTIMIZER_CHOICES = ("adam",)


# --------------------------------------------------------------------------- type checks


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    """True when ``value`` is an instance of the annotation ``tp`` (bool is not an int here)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp in (int, float):  # an int is a float here, as in Python's numeric tower
        return isinstance(value, (int, tp)) and not isinstance(value, bool)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or value in {m.value for m in tp}
    return isinstance(value, tp)


def _check_types(obj: Any, section: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _matches(value, hints[f.name]):
            raise TypeError(
                f"{section}.{f.name} must be {_type_name(hints[f.name])}, got {value!r} "
                f"({type(value).__name__}); pass e.g. {section}.{f.name}={f.default!r}."
            )


def _fail(original: str, field_name: str, value: Any, fix: str) -> ValueError:
    """A ValueError in the house format: Megatron's text, then field, value and fix."""
    return ValueError(f"{original} ({field_name}={value!r}). Fix: {fix}")


def check_offload_num_layers(cpu_offloading_num_layers: int, num_layers: Optional[int]) -> None:
    """Megatron's layer-count rule ``0 <= cpu_offloading_num_layers < num_layers`` (``num_layers=None``:
    only ``>= 0``), for callers that learn ``num_layers`` from the model.

    Raises:
        ValueError: ``N`` outside ``[0, L)``; the text starts with Megatron's
            "CPU offloading can be done only for layers less than L".
    """
    if 0 <= cpu_offloading_num_layers and (num_layers is None or cpu_offloading_num_layers < num_layers):
        return
    bound = "num_layers" if num_layers is None else num_layers
    fix = ("choose 0 <= model.cpu_offloading_num_layers < num_layers (the first N layers are offloaded)."
           if num_layers is None else f"choose 0 <= model.cpu_offloading_num_layers <= {num_layers - 1} "
           f"(the first N of the {num_layers} layers are offloaded; the last one never is).")
    raise _fail(f"CPU offloading can be done only for layers less than {bound}", "model.cpu_offloading_num_layers",
                cpu_offloading_num_layers, fix)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_budget(value: Any, who: str = "") -> int:
    """A memory budget in bytes: an int, a whole float (``4e9``) or a string such as ``"20GiB"``,
    ``"1.5 GB"`` or ``"500MiB"`` (units ``B``, ``KB``/``MB``/``GB``/``TB`` in powers of 1000,
    ``KiB``/``MiB``/``GiB``/``TiB`` in powers of 1024, any case). ``who`` prefixes the messages.

    Raises:
        TypeError: not an int, float or str.
        ValueError: a string that is not a size, a fraction of a byte, or a size that is not positive.
    """
    name = f"{who}: memory_budget" if who else "memory_budget"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{name} must be bytes (an int) or a string such as '20GiB', got {value!r} "
                        f"({type(value).__name__}).")
    fix = "pass bytes (an int) or a string such as '20GiB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    number, unit = value, 1
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a memory size; {fix}.")
        number, unit = float(match.group(1)), _UNITS[match.group(2).lower()]
    if not math.isfinite(number) or unit == 1 and number != int(number):
        raise ValueError(f"{name}={value!r} is not a whole number of bytes; {fix}.")
    if number <= 0:
        raise ValueError(f"{name}={value!r} must be positive; {fix}.")
    return int(round(number * unit))


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Activation offload settings (``model.*``), with Megatron Bridge names and rules.

    Attributes:
        cpu_offloading (bool): offload activations saved for backward. Default: ``False``.
        cpu_offloading_num_layers (int | None): offload the first ``N`` layers, ``0 <= N < num_layers``.
            ``None``: not given here (``offload_transform`` then needs ``num_layers=``).
            Default: ``None``.
        cpu_offloading_activations (bool): offload activations. Default: ``True``.
        cpu_offloading_weights (bool): accepted for compatibility; weights are never offloaded
            (``offload_transform`` warns, as TransformerEngine does). Default: ``False``.
        cpu_offloading_double_buffering (bool): accepted; no effect (as in current TE). Default: ``False``.
        cpu_offloading_retain_pinned_cpu_buffers (bool): keep pinned buffers between steps.
            Default: ``False``.
        num_layers (int | None): transformer layers ``L`` of the model; ``None`` means "the
            model's own count" (checked by ``offload_transform``). Default: ``None``.
        pipeline_model_parallel_size (int): must be ``1`` with activation offload. Default: ``1``.
        recompute_granularity (str | None): Megatron's own recompute, ``None``/``"full"``/
            ``"selective"``; must be ``None`` with activation offload (``torch.utils.checkpoint``
            inside the model is a different thing and is supported). Default: ``None``.
        cuda_graph_impl (str): ``"none"``/``"local"``/``"transformer_engine"``; must be
            ``"none"`` with activation offload. Default: ``"none"``.
        fine_grained_activation_offloading (bool): Megatron's per-module offload; exclusive with
            ``cpu_offloading``. Default: ``False``.
        offload_policy (OffloadPolicy | str): ``"opt_out"`` or ``"opt_in"``. Default: ``"opt_out"``.
        min_offload_numel (int): tensors with fewer logical elements stay on the device.
            Default: ``262144`` (TE's 256K).
        release_lag (int | None): runtime release schedule in layers (``>= 0``). ``None``: tuned from
            the link (Note [Default schedule from the link] in ``annotate/_transform.py``), or chosen by
            the planner with ``memory_budget``. Default: ``None``.
        prefetch_layers (int | None): reload look-ahead in layers (``>= 1``); ``None`` as for
            ``release_lag``. Default: ``None``.
        memory_budget (int | str | None): the training step's peak device memory
            (``torch.cuda.max_memory_allocated``), bytes or a string such as ``"20GiB"``
            (:func:`parse_memory_budget`), which the planner fits (``offload_transform``). An extension
            of Megatron Bridge's names; exclusive with ``cpu_offloading_num_layers`` and ``recompute``.
            Default: ``None``.
        recompute (bool): run every declared layer under non-reentrant ``torch.utils.checkpoint``
            inside its offload scope (offloaded layers move the checkpoint's saved inputs); unlike
            ``recompute_granularity`` it combines with ``cpu_offloading``. Default: ``False``.
        seq_length (int): tokens per sample (used by the CLI recipes). Default: ``128``.
        bf16 (bool): run forward/backward under ``torch.autocast(bfloat16)`` (CLI). Default: ``False``.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a rule below is broken (Megatron's message, then field, value and fix).
    """

    cpu_offloading: bool = False
    cpu_offloading_num_layers: Optional[int] = None
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    num_layers: Optional[int] = None
    pipeline_model_parallel_size: int = 1
    recompute_granularity: Optional[str] = None
    cuda_graph_impl: str = "none"
    fine_grained_activation_offloading: bool = False
    offload_policy: OffloadPolicy = OffloadPolicy.OPT_OUT
    min_offload_numel: int = 256 * 1024
    release_lag: Optional[int] = None
    prefetch_layers: Optional[int] = None
    memory_budget: Optional[Union[int, str]] = None
    recompute: bool = False
    seq_length: int = 128
    bf16: bool = False

    def __post_init__(self) -> None:
        _check_types(self, "model")
        object.__setattr__(self, "offload_policy", OffloadPolicy(self.offload_policy))
        if self.num_layers is not None and self.num_layers < 1:
            raise _fail("num_layers must be positive", "model.num_layers", self.num_layers,
                        "set model.num_layers to the model's layer count, or None to take it from the model.")
        if self.pipeline_model_parallel_size < 1:
            raise _fail("pipeline_model_parallel_size must be positive", "model.pipeline_model_parallel_size",
                        self.pipeline_model_parallel_size, "set model.pipeline_model_parallel_size=1.")
        if self.recompute_granularity not in _RECOMPUTE_CHOICES:
            raise _fail(
                f'When using recompute_granularity: {self.recompute_granularity} must be "full" or "selective".',
                "model.recompute_granularity", self.recompute_granularity,
                "use None (no Megatron recompute), 'full' or 'selective'.")
        if self.cuda_graph_impl not in _CUDA_GRAPH_CHOICES:
            raise _fail(f"Invalid cuda graph implementation: {self.cuda_graph_impl}",
                        "model.cuda_graph_impl", self.cuda_graph_impl, f"use one of {list(_CUDA_GRAPH_CHOICES)}.")
        if self.min_offload_numel < 0:
            raise _fail("min_offload_numel must be >= 0", "model.min_offload_numel", self.min_offload_numel,
                        "use 0 to offload every eligible tensor, or the default 262144 (TE's threshold).")
        for name, low, use in (("release_lag", 0, "a lag k >= 0 in layers"),
                               ("prefetch_layers", 1, "k >= 1 layers of look-ahead")):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise _fail(f"{name} must be None or >= {low}", f"model.{name}", getattr(self, name),
                            f"use None (start at 1, tuned from the link at the first CUDA step) or {use}.")
        if self.seq_length < 1:
            raise _fail("seq_length must be positive", "model.seq_length", self.seq_length,
                        "use e.g. model.seq_length=128.")
        if self.memory_budget is not None:
            try:
                parse_memory_budget(self.memory_budget)
            except ValueError as exc:
                raise _fail("memory_budget must be a positive size", "model.memory_budget", self.memory_budget,
                            str(exc).split("; ", 1)[-1].rstrip(".") + ", or None.") from None
            for name, unset in (("cpu_offloading_num_layers", None), ("recompute", False)):
                if getattr(self, name) is not unset:  # a count of 0 too
                    raise _fail("memory_budget lets the planner choose the layers", f"model.{name}",
                                getattr(self, name), f"set model.{name}={unset} with a memory budget, or "
                                "model.memory_budget=None for a fixed plan.")
        n = self.cpu_offloading_num_layers
        if n is not None and (self.cpu_offloading or n < 0):
            # Megatron checks this only with cpu_offloading on; a negative count is never meaningful.
            check_offload_num_layers(n, self.num_layers)
        if not self.cpu_offloading:
            return
        if self.pipeline_model_parallel_size > 1:
            raise _fail(
                "Currently there is no support for Pipeline parallelism with CPU offloading",
                "model.pipeline_model_parallel_size", self.pipeline_model_parallel_size,
                "set model.pipeline_model_parallel_size=1, or use optimizer offload "
                "(optimizer.optimizer_cpu_offload=True), which works with pipeline parallelism.")
        if self.recompute_granularity is not None:
            raise _fail(
                "CPU offloading does not work when activation recomputation is enabled",
                "model.recompute_granularity", self.recompute_granularity,
                "set model.recompute_granularity=None (torch.utils.checkpoint inside the model is "
                "supported), or model.cpu_offloading=False.")
        if self.cuda_graph_impl != "none":
            raise _fail(
                "CUDA graphs not supported with CPU offloading.",
                "model.cuda_graph_impl", self.cuda_graph_impl,
                "set model.cuda_graph_impl='none', or model.cpu_offloading=False.")
        if self.fine_grained_activation_offloading:
            raise _fail(
                "fine_grained_activation_offloading cannot be enabled with cpu_offloading.",
                "model.fine_grained_activation_offloading", True,
                "enable only one of model.cpu_offloading and model.fine_grained_activation_offloading.")
        if not (self.cpu_offloading_activations or self.cpu_offloading_weights):
            raise _fail(
                "CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)",
                "model.cpu_offloading_activations", False,
                "set model.cpu_offloading_activations=True, or model.cpu_offloading=False.")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optimizer and optimizer-offload settings (``optimizer.*``), Megatron Bridge names.

    Attributes:
        optimizer (str): ``"adam"`` (AdamW mode, as Megatron's offload requires). Default: ``"adam"``.
        lr (float): learning rate. Default: ``3e-4``.
        weight_decay (float): decoupled weight decay. Default: ``0.01``.
        adam_beta1, adam_beta2 (float): Adam betas in ``[0, 1)``. Default: ``0.9``, ``0.95``.
        adam_eps (float): Adam epsilon, ``> 0``. Default: ``1e-8``.
        clip_grad (float): global gradient-norm clip, ``0`` disables. Default: ``1.0``.
        optimizer_cpu_offload (bool): step a fraction of the parameters on the CPU
            (``HybridDeviceOptimizer``). Default: ``False``.
        optimizer_offload_fraction (float): that fraction of parameter elements, in ``[0, 1]``.
            Default: ``1.0`` (Megatron's CLI default; its dataclass default ``0.0`` offloads
            nothing while paying the overheads, so ``0.0`` with offload on warns here).
        overlap_cpu_optimizer_d2h_h2d (bool): pipeline D2H grads, CPU step and H2D params.
            Default: ``False``.
        use_torch_optimizer_for_cpu_offload (bool): CPU sub-optimizer is torch's AdamW. Default: ``False``.
        pin_cpu_grads, pin_cpu_params (bool): pinned host buffers. Default: ``True``.
        use_distributed_optimizer (bool): must be ``True`` with optimizer offload
            (``HybridDeviceOptimizer`` is that optimizer at world size 1). Default: ``True``.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a rule is broken (field, value and fix in the message).
    """

    optimizer: str = "adam"
    lr: float = 3e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_torch_optimizer_for_cpu_offload: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        _check_types(self, "optimizer")
        if self.optimizer not in _OPTIMIZER_CHOICES:
            raise _fail("Unsupported optimizer", "optimizer.optimizer", self.optimizer,
                        f"use one of {list(_OPTIMIZER_CHOICES)} (AdamW mode, as Megatron's CPU offload requires).")
        if not self.lr > 0:
            raise _fail("learning rate must be positive", "optimizer.lr", self.lr, "use e.g. optimizer.lr=3e-4.")
        if self.weight_decay < 0:
            raise _fail("weight_decay must be >= 0", "optimizer.weight_decay", self.weight_decay,
                        "use e.g. optimizer.weight_decay=0.01.")
        for name in ("adam_beta1", "adam_beta2"):
            beta = getattr(self, name)
            if not 0.0 <= beta < 1.0:
                raise _fail(f"{name} must be in [0, 1)", f"optimizer.{name}", beta, f"use e.g. optimizer.{name}=0.9.")
        if not self.adam_eps > 0:
            raise _fail("adam_eps must be positive", "optimizer.adam_eps", self.adam_eps,
                        "use e.g. optimizer.adam_eps=1e-8.")
        if self.clip_grad < 0:
            raise _fail("clip_grad must be >= 0", "optimizer.clip_grad", self.clip_grad,
                        "use 0 to disable clipping or e.g. optimizer.clip_grad=1.0.")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise _fail("optimizer_offload_fraction must be in [0, 1]", "optimizer.optimizer_offload_fraction",
                        self.optimizer_offload_fraction,
                        "use 0 <= optimizer.optimizer_offload_fraction <= 1 (the share of parameter elements "
                        "stepped on the CPU).")
        if not self.optimizer_cpu_offload:
            return
        if not self.use_distributed_optimizer:
            raise _fail(
                "CPU offloading of the optimizer requires the distributed optimizer",
                "optimizer.use_distributed_optimizer", False,
                "set optimizer.use_distributed_optimizer=True (HybridDeviceOptimizer is the distributed "
                "optimizer at world size 1), or optimizer.optimizer_cpu_offload=False.")
        if self.optimizer_offload_fraction == 0.0:
            warnings.warn(
                "optimizer.optimizer_cpu_offload=True with optimizer.optimizer_offload_fraction=0.0 offloads "
                "nothing but still pays the hybrid optimizer's overheads; set a fraction in (0, 1].",
                UserWarning, stacklevel=3)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Training loop settings of ``annotate-offload train`` (``train.*``), Megatron Bridge names.

    Attributes:
        train_iters (int): optimizer steps, ``>= 1``. Default: ``100``.
        micro_batch_size (int): samples per step, ``>= 1``. Default: ``8``.
        seed (int): seed for weights and data order, ``>= 0``. Default: ``1234`` (Megatron's).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a value out of range (field, value and fix in the message).
    """

    train_iters: int = 100
    micro_batch_size: int = 8
    seed: int = 1234

    def __post_init__(self) -> None:
        _check_types(self, "train")
        for name in ("train_iters", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise _fail(f"{name} must be positive", f"train.{name}", getattr(self, name), f"use e.g. train.{name}=8.")
        if self.seed < 0:
            raise _fail("seed must be >= 0", "train.seed", self.seed, "use e.g. train.seed=1234.")


_SECTIONS: dict[str, type] = {"model": ModelConfig, "optimizer": OptimizerConfig, "train": TrainConfig}


@dataclass(frozen=True, kw_only=True)
class Config:
    """All sections, like Megatron Bridge's ``ConfigContainer``.

    Attributes:
        model (ModelConfig): activation offload and model context.
        optimizer (OptimizerConfig): optimizer and optimizer offload.
        train (TrainConfig): iterations, batch size, seed.

    Example::

        cfg = from_overrides(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
                              "model.num_layers=4", "optimizer.optimizer_cpu_offload=True"])
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"Config.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}.")


# --------------------------------------------------------------------------- overrides

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", "~"}


def _parse_scalar(text: str, tp: Any, key: str) -> Any:
    """Parse the string ``text`` as annotation ``tp``; ValueError naming ``key`` otherwise."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and text.strip().lower() in _NONE:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _parse_scalar(text, arg, key)
            except ValueError:
                pass
        raise ValueError(f"override {key}={text!r}: expected {_type_name(tp)}.")
    s = text.strip()
    if tp is bool:
        if s.lower() in _TRUE | _FALSE:
            return s.lower() in _TRUE
        raise ValueError(f"override {key}={text!r}: expected a bool (True/False).")
    if tp is int:
        with contextlib.suppress(ValueError):
            return int(s, 10)
        with contextlib.suppress(ValueError):
            if "e" in s.lower() and float(s).is_integer():
                return int(float(s))  # 1e3 is a common way to write 1000
        raise ValueError(f"override {key}={text!r}: expected an int.")
    if tp is float:
        with contextlib.suppress(ValueError):
            return float(s)
        raise ValueError(f"override {key}={text!r}: expected a float.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        choices = [m.value for m in tp]
        if s not in choices:
            raise ValueError(f"override {key}={text!r}: expected one of {choices}.")
        return tp(s)
    if tp is str:
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
            s = s[1:-1]
        return s
    raise ValueError(f"override {key}: cannot parse values of type {_type_name(tp)}.")  # pragma: no cover


def _example(key: str, tp: Any, current: Any) -> str:
    """``e.g. key=value`` for a type error, from the current value when it fits (``""`` for enums/str)."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    values = []
    for arg in args:
        if arg is bool:
            values += ["True", "False"]
        elif arg in (int, float):
            values.append(str(current) if type(current) is arg else {int: "2", float: "0.5"}[arg])
    if not values:
        return ""
    if type(None) in args:
        values.append("None")
    return "e.g. " + " or ".join(f"{key}={v}" for v in values)


def _closest(name: str, valid: Iterable[str]) -> str:
    valid = sorted(valid)
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"did you mean {match[0]!r}?" if match else f"valid: {', '.join(valid)}."


def _closest_key(section: str, name: str) -> str:
    """Suggest the nearest ``section.field``: same section first, then a field of another section."""
    for other, cls in _SECTIONS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return f"did you mean '{other}.{name}'?"
    own = {f.name: f"{section}.{f.name}" for f in dataclasses.fields(_SECTIONS[section])}
    others = {f.name: f"{s}.{f.name}" for s, cls in _SECTIONS.items() if s != section for f in dataclasses.fields(cls)}
    for keys in (own, others):
        match = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.6)
        if match:
            return f"did you mean '{keys[match[0]]}'?"
    return f"valid {section} keys: {', '.join(sorted(own))}."


def from_overrides(overrides: Iterable[str], *, base: Optional[Config] = None) -> Config:
    """Build a :class:`Config` from ``section.field=value`` strings applied on top of ``base``.

    Values are parsed by the field's type: bools accept ``True/False/true/false/1/0/yes/no``,
    optional fields accept ``None``/``null``, enums their string values. All overrides of a
    section are applied at once (the order does not matter, a later duplicate wins), then its rules
    run. ``model.memory_budget`` clears the base's layer count and recompute unless set here too.

    Args:
        overrides (Iterable[str]): e.g. ``["model.cpu_offloading=True",
            "optimizer.optimizer_offload_fraction=0.5"]``.
        base (Config | None): starting point (a recipe). Default: ``Config()``.

    Returns:
        Config: a new validated config; ``base`` is unchanged.

    Raises:
        ValueError: malformed override (no ``=``), unknown section or field (with the closest
            valid name), a value that does not parse as the field's type, or a broken rule.
        TypeError: ``overrides`` is a single string instead of a list of strings.
    """
    if isinstance(overrides, str):
        raise TypeError(f"from_overrides: overrides must be a list of 'section.field=value' strings, "
                        f"got the single string {overrides!r}; wrap it in a list.")
    base = Config() if base is None else base
    updates: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for item in overrides:
        if not isinstance(item, str):
            raise TypeError(f"from_overrides: each override must be a str, got {item!r}.")
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or "." not in key:
            raise ValueError(f"override {item!r} is not of the form section.field=value "
                             f"(e.g. model.cpu_offloading=True).")
        section, _, name = key.partition(".")
        if section not in _SECTIONS:
            raise ValueError(f"override {item!r}: unknown section {section!r}; {_closest(section, _SECTIONS)}")
        hints = typing.get_type_hints(_SECTIONS[section])
        if name not in hints:
            raise ValueError(f"override {item!r}: unknown key {key!r}; {_closest_key(section, name)}")
        try:
            updates[section][name] = _parse_scalar(text, hints[name], key)
        except ValueError as exc:
            example = _example(key, hints[name], getattr(getattr(base, section), name))
            if not example:
                raise
            raise ValueError(f"{str(exc).rstrip('.')}; {example}.") from None
    if updates["model"].get("memory_budget") is not None:  # a budget replaces the base's fixed plan, unless set here
        updates["model"] = {"cpu_offloading_num_layers": None, "recompute": False, **updates["model"]}
    return Config(**{name: dataclasses.replace(getattr(base, name), **updates[name]) if updates[name]
                     else getattr(base, name) for name in _SECTIONS})

