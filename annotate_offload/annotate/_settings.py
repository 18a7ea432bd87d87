"""Settings of ``offload_transform``: ``num_layers`` and a Megatron Bridge style config, validated."""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any

from annotate_offload.config import parse_memory_budget

__all__ = ["Settings", "resolve", "check_count"]


@dataclass
class Settings:
    num_layers: int | str
    policy: str | None = None  # None: the runtime's default (NVTE_CPU_OFFLOAD_V1)
    min_offload_numel: int | None = None
    release_lag: int | None = None
    prefetch_layers: int | None = None
    recompute: bool = False
    memory_budget: Any = None  # the budget (keyword or config.memory_budget); with it num_layers is "auto"
    config_layers: int | None = None  # config.num_layers, checked against the model
    notes: list[str] = field(default_factory=list)


def _model_section(config: Any) -> Any:
    """``Config`` holds the activation fields in ``.model``; a ``ModelConfig`` (or look-alike) has them itself."""
    for section in (config, getattr(config, "model", None)):
        if hasattr(section, "cpu_offloading") or hasattr(section, "cpu_offloading_num_layers"):
            return section
    raise TypeError(
        f"offload_transform: config={type(config).__name__} has no activation-offload fields; pass an "
        "annotate_offload.config.ModelConfig or Config (or an object with Megatron Bridge names: "
        "cpu_offloading, cpu_offloading_num_layers, ...)."
    )


# The config fields ``offload_transform`` also takes as keywords, and the Settings field each sets.
FIELDS = {"release_lag": "release_lag", "prefetch_layers": "prefetch_layers",
          "min_offload_numel": "min_offload_numel", "recompute": "recompute", "offload_policy": "policy"}


def resolve(num_layers: Any, config: Any, fields: dict[str, Any] | None = None, memory_budget: Any = None,
            inputs: str = " with example_inputs=") -> Settings | None:
    """``num_layers``, ``memory_budget``, the config's fields and keyword ``fields`` over them, checked;
    ``None`` means the config turns offloading off. ``inputs``: what a budget needs besides, for hints."""
    unknown = sorted(set(fields or ()) - set(FIELDS))
    if unknown:
        raise TypeError(
            f"offload_transform: unexpected keyword {unknown[0]!r}; the config fields it also takes as "
            f"keywords are {', '.join(FIELDS)} (other settings go in config=ModelConfig(...))."
        )
    s = Settings(num_layers=num_layers, memory_budget=memory_budget)
    if config is not None:
        validate = getattr(config, "validate", None)
        if callable(validate):
            validate()  # dataclass configs validate in __post_init__; duck-typed ones may offer this
        cfg = _model_section(config)
        if getattr(cfg, "cpu_offloading", True) is False:
            if num_layers is not None or memory_budget is not None:
                given = f"num_layers={num_layers!r}" if num_layers is not None else f"memory_budget={memory_budget!r}"
                raise ValueError(
                    f"offload_transform: {given} was given but config.cpu_offloading=False; "
                    "set cpu_offloading=True in the config (ModelConfig(cpu_offloading=True, ...)), or drop it."
                )
            return None
        for name, why, note in (
            ("cpu_offloading_weights", ": weights are never offloaded (as in TransformerEngine), only activations. "
             "Use optimizer offload (HybridDeviceOptimizer) to move optimizer state off the GPU.",
             "ignored: weights are never offloaded"),
            ("cpu_offloading_double_buffering", " (as in TransformerEngine's current runtime); reload look-ahead is "
             "set with prefetch_layers.", "has no effect"),
        ):
            if getattr(cfg, name, False):
                warnings.warn(f"offload_transform: config.{name}=True has no effect{why}", UserWarning, stacklevel=4)
                s.notes.append(f"{name}=True {note}")
        if not getattr(cfg, "cpu_offloading_activations", True):
            return None  # nothing to offload (weights-only is a no-op, warned above)
        cfg_n = getattr(cfg, "cpu_offloading_num_layers", None)
        if num_layers is None:
            s.num_layers = cfg_n
        elif cfg_n is not None and cfg_n != num_layers:
            raise ValueError(
                f"offload_transform: num_layers={num_layers!r} differs from config.cpu_offloading_num_layers="
                f"{cfg_n!r}; give the count once (drop num_layers=, or make them equal)."
            )
        for name in ("release_lag", "prefetch_layers", "min_offload_numel", "recompute"):
            setattr(s, name, getattr(cfg, name, getattr(s, name)))
        budget = getattr(cfg, "memory_budget", None)
        if budget is not None and memory_budget is not None and budget != memory_budget:
            raise ValueError(
                f"offload_transform: memory_budget={memory_budget!r} differs from config.memory_budget={budget!r}; "
                "give the budget once (drop memory_budget=, or make them equal)."
            )
        s.memory_budget = budget if memory_budget is None else memory_budget
        p = getattr(cfg, "offload_policy", None)
        s.policy = getattr(p, "value", p)
        s.config_layers = getattr(cfg, "num_layers", None)
    for name, value in (fields or {}).items():
        setattr(s, FIELDS[name], getattr(value, "value", value))
    if s.memory_budget is not None:
        parse_memory_budget(s.memory_budget, "offload_transform")  # before the layers are looked for or measured
    if s.num_layers is None and s.memory_budget is not None:
        s.num_layers = "auto"
    if s.num_layers is None:
        raise ValueError(
            "offload_transform: num_layers is required (None given, no memory_budget and no config with "
            "cpu_offloading_num_layers); pass num_layers=N to offload the first N layers, or "
            f"memory_budget='20GiB' (the step's peak device memory){inputs} to plan for it."
        )
    if s.num_layers == "auto" and s.memory_budget is None:
        raise ValueError(
            "offload_transform: num_layers='auto' requires memory_budget= (the training step's peak device "
            f"memory, bytes or e.g. '20GiB'); pass it{inputs}, or pass num_layers=N."
        )
    if s.num_layers != "auto" and s.memory_budget is not None:
        raise ValueError(
            f"offload_transform: memory_budget={s.memory_budget!r} plans the layers itself, but num_layers="
            f"{s.num_layers!r} was given; drop num_layers= (or cpu_offloading_num_layers in the config) to plan "
            "for the budget, or drop memory_budget= to offload the first N layers."
        )
    if s.memory_budget is not None and s.recompute is True:  # a non-bool is refused below
        raise ValueError(
            "offload_transform: config.recompute=True with memory_budget=; the planner chooses recompute per "
            "layer. Set recompute=False in the config, or pass num_layers=N to recompute every layer."
        )
    n = s.num_layers
    if n != "auto":
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(
                f"offload_transform: num_layers must be an int or 'auto', got {n!r} ({type(n).__name__}); "
                "pass e.g. num_layers=4."
            )
        s.num_layers = int(n)  # numpy integers from a config or a sweep
    for name, low in (("release_lag", 0), ("prefetch_layers", 1), ("min_offload_numel", 0)):
        v = getattr(s, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise TypeError(f"offload_transform: config.{name} must be None or an int >= {low}, got {v!r} "
                            f"({type(v).__name__}); pass e.g. {name}={low} in the config.")
        if v is not None and v < low:
            raise ValueError(f"offload_transform: config.{name} must be None or an int >= {low}, got {v!r}; "
                             f"pass e.g. {name}={low} in the config.")
        if v is not None:
            setattr(s, name, int(v))
    if s.policy not in (None, "opt_out", "opt_in"):
        err = ValueError if isinstance(s.policy, str) else TypeError
        raise err(f"offload_transform: config.offload_policy must be 'opt_out' or 'opt_in', got {s.policy!r} "
                  f"({type(s.policy).__name__}).")
    if not isinstance(s.recompute, bool):
        raise TypeError(f"offload_transform: config.recompute must be a bool, got {s.recompute!r} "
                        f"({type(s.recompute).__name__}); pass recompute=True or False in the config.")
    return s


def check_count(n: int, eligible: int, total: int, how: str) -> None:
    """``num_layers=n`` against the ``eligible`` offloadable of ``total`` layers, found as ``how`` says."""
    if n < 0 and eligible:
        raise ValueError(f"offload_transform: num_layers={n} is negative; pass 0 <= num_layers <= {eligible - 1} "
                         f"(the first N of the model's {eligible} offloadable layers are offloaded; 0 offloads none).")
    if not 0 <= n < eligible:
        kept = f" ({total - eligible} declared @offload_layer(offload=False))" if total != eligible else ""
        fix = (f"choose 0 <= num_layers <= {eligible - 1} (the first N of the {eligible} offloadable layers{kept} "
               "are offloaded; the last one never is)") if eligible else "declare at least two offloadable layers"
        raise ValueError(
            f"offload_transform: CPU offloading can be done only for layers less than {eligible} (num_layers={n}). "
            f"Fix: {fix}. Layers: {how}."
        )
