"""``offload_transform`` and ``remove_offload``: validate, choose the layers, wrap them, attach a plan."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch.nn as nn

from annotate_offload._example_inputs import split as split_inputs
from annotate_offload.errors import OffloadError

from ._discover import LayerRef, find_layers
from ._estimate import autocast_dtype_of, estimate_bytes
from ._layers import LayerForward, OffloadState
from ._plan import LayerPlan, OffloadPlan
from ._settings import check_count, resolve

__all__ = ["offload_transform", "remove_offload"]

_STATE = "_annotate_offload_state"


def offload_transform(
    model: nn.Module,
    num_layers: int | str | None = None,
    *,
    memory_budget: int | None = None,
    example_inputs: Any = None,
    config: Any = None,
    layer_types: type | Sequence[type] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    **config_fields: Any,
) -> nn.Module:
    """Offload the saved activations of a model's first ``num_layers`` layers to host memory, in place.

    Finds the layers (``@offload_layer`` marks, ``layer_types=``/``filter_fn=``, or the repeated
    blocks of an ``nn.ModuleList``/``nn.Sequential``) and wraps each layer's own ``forward`` on the
    instance: the wrapper opens the layer's offload scope, runs the layer's forward unchanged and
    commits its output (Note [Layer forwards] in ``_layers.py``). Nothing else of the model is
    traced or replaced, so the root forward, its optional arguments, every module's ``training``
    flag and instance-level forwards behave as without offload. The runtime binds its device at
    the first training forward, so the transform may come before or after ``.to(device)``,
    ``peft.get_peft_model`` (adapter marks follow the model) and framework wrapping (Trainer,
    accelerate, Lightning). Outputs and gradients are bit-identical to the untransformed model's.

    The model object is changed in place, like torchao's ``quantize_``: same object, class,
    methods (``generate``), parameters and ``state_dict`` keys. ``model.offload_plan``
    (:class:`~annotate_offload.annotate._plan.OffloadPlan`) shows per layer the choice and the bytes
    moved per step. ``remove_offload(model)`` undoes it; ``copy.deepcopy(model)`` is an independent
    transformed model; ``torch.save(model)`` is refused (save the ``state_dict``).

    Layers are numbered in module registration order and should run in that order once per
    forward. ``torch.utils.checkpoint`` inside a layer (Hugging Face's gradient checkpointing) is
    supported: the checkpoint's saved inputs are what is offloaded. A checkpoint around an offloaded
    layer's call is refused (use ``recompute=True`` in the config instead).

    Args:
        model (nn.Module): the model, on any device (the runtime binds at the first training forward).
        num_layers (int | "auto" | None): offload the first ``N`` of the ``L`` offloadable layers,
            ``0 <= N < L`` (Megatron Bridge's ``cpu_offloading_num_layers``). ``"auto"`` lets
            ``annotate_offload.planner.plan_offload`` choose keep/offload/recompute per layer for
            ``memory_budget``. Required unless ``config`` gives ``cpu_offloading_num_layers``.
        memory_budget (int | None): bytes of saved activations allowed on the GPU; only with
            ``num_layers="auto"``. Default: ``None``.
        example_inputs (Tensor | tuple | dict | None): one training step's inputs; used to estimate
            bytes per layer on the meta device (and to profile with ``"auto"``, which adds
            ``use_cache=False`` for models whose forward takes it) and to refuse a layer that runs
            twice per forward. Without them bytes are measured on the first training step. The
            estimate emulates bf16 autocast when ``config`` says ``bf16=True`` or the call runs
            inside ``torch.autocast`` (Note [Autocast on meta] in ``_estimate.py``). Default: ``None``.
        config (ModelConfig | Config | None): the offload settings, Megatron Bridge names:
            ``cpu_offloading`` (``False`` returns the model unchanged), ``cpu_offloading_num_layers``,
            the schedule ``release_lag`` (``None``: TransformerEngine's bound) and ``prefetch_layers``
            (``None``: TE's distance), ``offload_policy`` (``"opt_out"``/``"opt_in"``),
            ``min_offload_numel`` (smaller saved tensors stay on the device) and ``recompute`` (run
            every layer under non-reentrant ``torch.utils.checkpoint``; offloaded layers then move the
            checkpoint's saved inputs). Without a config: TE's schedule, the runtime's default policy,
            256K elements, no recompute. Default: ``None``.
        layer_types (type | tuple[type, ...] | None): classes whose outermost instances are the layers.
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` picks the layers.
        **config_fields: the config fields ``release_lag``, ``prefetch_layers``, ``min_offload_numel``,
            ``recompute`` and ``offload_policy`` as keywords, over ``config``'s values:
            ``offload_transform(m, 2, min_offload_numel=256)``. Any other keyword is a ``TypeError``.

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``num_layers`` not an int or ``"auto"``; a
            bad ``layer_types``/``filter_fn``/``config``; ``example_inputs`` not a tensor,
            tuple/list or dict with str keys.
        ValueError: ``num_layers`` missing, out of ``[0, L)``, or different from the config's;
            no layers found; ``"auto"`` without ``memory_budget``/``example_inputs``, or with
            ``config.recompute``; ``memory_budget`` without ``"auto"``; empty ``example_inputs``;
            a config rule (raised by the config before the model is touched).
        OffloadError: the model was already transformed; a layer is registered at two positions
            or belongs to another transformed model; with ``example_inputs``, a layer runs twice in
            one forward. All raised before the model changes.

    Warns:
        UserWarning: ``num_layers == L - 1`` with TransformerEngine's schedule (no overlap is
            possible; ``prefetch_layers``/``release_lag`` in the config can overlap there);
            ``cpu_offloading_weights``/``cpu_offloading_double_buffering`` (no effect);
            ``example_inputs`` that cannot run the forward.

    Example::

        model = GPTStack(GPTConfig(hidden=4096, heads=32, layers=8))
        offload_transform(model, num_layers=4)
        model.to("cuda")  # before or after the transform
        model(x).sum().backward()
        print(model.offload_plan)
    """
    # ---- validate everything before touching the model
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_transform: model must be an nn.Module, got {type(model).__name__}.")
    if _STATE in model.__dict__:
        raise OffloadError(
            f"offload_transform: {type(model).__name__} is already transformed; call remove_offload(model) "
            "first to change the plan."
        )
    if example_inputs is not None:
        split_inputs(example_inputs, "offload_transform")  # a TypeError now, not a note in the plan
    settings = resolve(num_layers, config, config_fields)
    if settings is None:
        return model
    refs, how = find_layers(model, layer_types=layer_types, filter_fn=filter_fn)
    _check_positions(model, refs)
    eligible = sum(r.offload for r in refs)
    if settings.config_layers is not None and settings.config_layers != len(refs):
        raise ValueError(
            f"offload_transform: config.num_layers={settings.config_layers} but the model has {len(refs)} "
            f"layers ({how}); set model.num_layers={len(refs)} (or None), or select the layers with layer_types=."
        )
    auto = settings.num_layers == "auto"
    if auto:
        if memory_budget is None or example_inputs is None:
            raise ValueError(
                f"offload_transform: num_layers='auto' needs memory_budget= (bytes) and example_inputs= "
                f"(got memory_budget={memory_budget!r}, example_inputs={'None' if example_inputs is None else 'given'}); "
                "pass both, e.g. memory_budget=4 * 2**30, example_inputs=(x,)."
            )
        if settings.recompute:
            raise ValueError(
                "offload_transform: config.recompute=True with num_layers='auto'; the planner chooses recompute per "
                "layer. Set recompute=False in the config, or pass num_layers=N to recompute every layer."
            )
    else:
        if memory_budget is not None:
            raise ValueError(
                f"offload_transform: memory_budget={memory_budget!r} is used only by num_layers='auto' (got "
                f"num_layers={settings.num_layers!r}); drop memory_budget=, or pass num_layers='auto' with "
                "example_inputs= to let the planner fit the budget."
            )
        check_count(settings.num_layers, eligible, len(refs))  # type: ignore[arg-type]

    # ---- choose per layer
    declared_keep = [not r.offload for r in refs]
    notes = list(settings.notes)
    if auto:
        from annotate_offload.planner import plan_offload

        kwargs = {k: v for k, v in (("release_lag", settings.release_lag), ("prefetch_layers", settings.prefetch_layers))
                  if v is not None}
        result = plan_offload(model, memory_budget=memory_budget, example_inputs=example_inputs,
                              layers=[r.module for r in refs], min_offload_numel=_min_numel(settings.min_offload_numel),
                              **kwargs)
        if len(result.choices) != len(refs):
            raise OffloadError(
                f"offload_transform: the planner returned {len(result.choices)} choices for {len(refs)} layers; "
                "this is a bug in annotate_offload.planner, please report it."
            )
        choices = list(result.choices)
        reasons = list(getattr(result, "reasons", ())) or [""] * len(choices)
        for i, keep in enumerate(declared_keep):
            if keep and choices[i] in ("offload", "recompute_offload"):
                choices[i] = "keep" if choices[i] == "offload" else "recompute"
                notes.append(f"layer {i}: planner chose offload but it is declared offload=False")
        settings.release_lag = result.release_lag if settings.release_lag is None else settings.release_lag
        settings.prefetch_layers = result.prefetch_layers if settings.prefetch_layers is None else settings.prefetch_layers
        notes.append(f"auto: predicted {result.predicted_step_ms:.2f} ms/step, peak {result.predicted_peak_bytes} B "
                     f"for budget {result.memory_budget} B")
    else:
        reasons = [""] * len(refs)
        n = settings.num_layers
        eligible_idx = [i for i, r in enumerate(refs) if r.offload][:n]  # type: ignore[misc]
        choices = ["offload" if i in eligible_idx else "keep" for i in range(len(refs))]
        if settings.recompute:
            choices = ["recompute_offload" if c == "offload" else "recompute" for c in choices]
        if n == eligible - 1 and n > 0 and settings.release_lag is None and settings.prefetch_layers is None:
            msg = (f"offload_transform: num_layers={n} offloads all but the last of {eligible} layers; with "
                   "TransformerEngine's schedule no overlap of copies and compute is possible there. Set "
                   "prefetch_layers=1 (reload one layer ahead) and/or release_lag=1 in the config to overlap, "
                   "or offload fewer layers.")
            warnings.warn(msg, UserWarning, stacklevel=2)
            notes.append(f"num_layers=L-1={n}: no overlap with TE's schedule (see prefetch_layers/release_lag)")
    offloaded = frozenset(i for i, c in enumerate(choices) if c in ("offload", "recompute_offload"))

    # ---- build the runtime, the plan and the state (the model is still untouched)
    from annotate_offload.runtime import DefaultOffloadSynchronizer

    sync = DefaultOffloadSynchronizer(
        num_layers=len(refs), num_offloaded_layers=len(offloaded), offloaded_layers=sorted(offloaded),
        release_lag=settings.release_lag, prefetch_layers=settings.prefetch_layers, policy=settings.policy,
        min_offload_numel=settings.min_offload_numel,
    )  # no device: bound at the first training forward (Note [Device binding], runtime/_synchronizer.py)
    plan = OffloadPlan(
        layers=tuple(LayerPlan(i, r.fqn, type(r.module).__name__, c, declared_keep[i], reason=why)  # type: ignore[arg-type]
                     for i, (r, c, why) in enumerate(zip(refs, choices, reasons))),
        layer_source=how, notes=tuple(notes), runtime=sync,
    )
    recompute = frozenset(i for i, c in enumerate(choices) if c in ("recompute", "recompute_offload"))
    state = OffloadState(model, [r.fqn for r in refs], [r.module for r in refs], sync, plan, recompute)

    # ---- apply
    # Offload marks for LoRA adapters (Hugging Face peft or ours), the LM head's input and frozen
    # weights' autocast casts. They act only while an offload scope is open, so outputs and
    # gradients are unchanged; marks the user applied are kept and refreshed, not replaced.
    from annotate_offload.peft._apply import apply_offload_marks, has_offload_marks

    state.own_marks = not has_offload_marks(model)
    state.marks = apply_offload_marks(model, warn=False)
    for i in range(len(refs)):
        state.wrap(i)
    model.__dict__[_STATE] = state
    model.offload_plan = plan

    if example_inputs is not None:
        try:
            per_layer = estimate_bytes(model, state, example_inputs,
                                       min_numel=_min_numel(settings.min_offload_numel),
                                       policy=settings.policy or _default_policy(),
                                       autocast_dtype=autocast_dtype_of(config))
            plan._with_bytes(per_layer, "estimate")
        except OffloadError:  # a layer that runs twice per forward: nothing stays applied
            remove_offload(model)
            raise
        except Exception as e:  # a forward that cannot run on meta tensors (data-dependent code)
            first = (str(e).splitlines() or [""])[0][:160]
            note = f"meta estimate failed ({type(e).__name__}: {first}); bytes measured on the first step"
            plan.notes = plan.notes + (note,)
            warnings.warn(f"offload_transform: example_inputs= could not run the forward: {note}. Check that "
                          "example_inputs matches model(*example_inputs).", UserWarning, stacklevel=2)
    return model


def remove_offload(model: nn.Module) -> nn.Module:
    """Undo :func:`offload_transform`: restore the layers' forwards, remove the marks it installed,
    the plan and the runtime state.

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        OffloadError: ``model`` was not transformed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"remove_offload: model must be the nn.Module passed to offload_transform, got "
            f"{type(model).__name__}"
        )
    state = model.__dict__.get(_STATE)
    if state is None:
        raise OffloadError(
            f"remove_offload: {type(model).__name__} was not transformed by offload_transform (or was restored "
            "already); nothing to remove."
        )
    state.remove()
    del model.__dict__[_STATE]
    model.__dict__.pop("offload_plan", None)
    return model


def _check_positions(model: nn.Module, refs: list[LayerRef]) -> None:
    """Each layer is one module at one position of the model, and a layer of no other transformed model."""
    where: dict[int, list[str]] = {id(r.module): [] for r in refs}
    for fqn, module in model.named_modules(remove_duplicate=False):
        if id(module) in where:
            where[id(module)].append(fqn)
    for r in refs:
        fqns = where[id(r.module)]
        if len(fqns) > 1:
            raise OffloadError(
                f"offload_transform: layer {fqns[0]} is also registered as {fqns[1]} (one module at two positions, "
                "so it runs twice per forward); a shared layer cannot be one offload unit. Give each position its "
                "own module, or leave it out of the layers (filter_fn=, layer_types=)."
            )
        if isinstance(r.module.__dict__.get("forward"), LayerForward):
            raise OffloadError(
                f"offload_transform: {r.fqn} is already a layer of another transformed model; call "
                "remove_offload on that model first (or transform only one of the two)."
            )


def _min_numel(v: int | None) -> int:
    return 256 * 1024 if v is None else v


def _default_policy() -> str:
    from annotate_offload.runtime._marks import default_policy

    return default_policy()
