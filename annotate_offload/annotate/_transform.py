"""``offload_transform`` and ``remove_offload``: validate, choose the layers, wrap them, attach a plan."""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from annotate_offload._example_inputs import cache_configs, cache_off, split as split_inputs
from annotate_offload.errors import OffloadError

from ._discover import LayerRef, find_layers
from ._estimate import autocast_dtype_of, estimate_bytes
from ._layers import LayerForward, OffloadState, _refuse_pickle
from ._plan import OFFLOADED, RECOMPUTED, SELECTIVE, LayerPlan, OffloadPlan
from ._settings import check_count, resolve

__all__ = ["offload_transform", "remove_offload"]

_STATE = "_annotate_offload_state"


def offload_transform(
    model: nn.Module,
    num_layers: int | str | None = None,
    *,
    memory_budget: int | str | None = None,
    example_inputs: Any = None,
    config: Any = None,
    layer_types: type | Sequence[type] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    **config_fields: Any,
) -> nn.Module:
    """Offload the saved activations of a model's first ``num_layers`` layers to host memory, or plan
    keep / offload / recompute per layer to fit a ``memory_budget``, in place.

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
    moved per step; with a budget also the predicted time and peak (and, after
    ``model.offload_plan.measure(step)``, the measured ones), and
    ``HybridDeviceOptimizer(model.parameters(), **model.offload_plan.optimizer_kwargs())`` takes the
    optimizer split the plan assumed (a ``Config`` whose ``optimizer.optimizer_cpu_offload`` is
    ``False`` keeps it on the device). ``remove_offload(model)`` undoes it; ``copy.deepcopy(model)`` is
    an independent transformed model; ``torch.save(model)`` is refused (save the ``state_dict``).

    Layers are numbered in module registration order and should run in that order once per
    forward. ``torch.utils.checkpoint`` inside a layer (Hugging Face's gradient checkpointing) is
    supported: the checkpoint's saved inputs are what is offloaded. A checkpoint around an offloaded
    layer's call is refused (use ``recompute=True`` in the config instead).

    Args:
        model (nn.Module): the model, on any device (the runtime binds at the first training forward).
        num_layers (int | "auto" | None): offload the first ``N`` of the ``L`` offloadable layers,
            ``0 <= N < L`` (Megatron Bridge's ``cpu_offloading_num_layers``), with the overlap schedule
            tuned from the measured link (Note [Default schedule from the link]) unless the config
            sets ``release_lag``/``prefetch_layers``. ``"auto"`` (or ``None`` with a budget) plans
            for ``memory_budget``. Required unless a budget or ``cpu_offloading_num_layers`` is given.
        memory_budget (int | str | None): the training step's peak device memory
            (``torch.cuda.max_memory_allocated``: weights, gradients, optimizer state on the device,
            activations), bytes or a string such as ``"20GiB"``. ``annotate_offload.planner.plan_offload``
            measures the layers on their device and chooses per layer keep, offload, recompute (of the
            whole layer or selective, each also with what it keeps offloaded), the schedule and the optimizer
            split, the fastest predicted plan that fits; a model that fits keeps everything (with a one-line warning).
            Default: ``None`` (the config's ``memory_budget``).
        example_inputs (Tensor | tuple | dict | None): one training step's inputs, to estimate bytes per layer on
            the meta device (and to profile with a budget, every ``config.use_cache`` off) and to refuse a layer
            that runs twice per forward; these forwards run the model's Python code, whose own state (a step
            counter) moves as in a step, while tensors, RNG and gradients are restored. Without them bytes are
            measured on the first training step. The estimate emulates bf16 autocast under ``bf16=True`` or
            ``torch.autocast`` (Note [Autocast on meta] in ``_estimate.py``). Default: ``None``.
        config (ModelConfig | Config | None): the offload settings, Megatron Bridge names:
            ``cpu_offloading`` (``False`` returns the model unchanged), ``cpu_offloading_num_layers``,
            ``memory_budget``, the schedule ``release_lag`` and ``prefetch_layers`` (``None``: chosen
            from the link, or by the planner), ``offload_policy`` (``"opt_out"``/``"opt_in"``),
            ``min_offload_numel`` (smaller saved tensors stay on the device) and ``recompute`` (run
            every layer under non-reentrant ``torch.utils.checkpoint``; offloaded layers then move the
            checkpoint's saved inputs; not with a budget). Without a config: the schedule from the
            link, the runtime's default policy, 256K elements, no recompute. Default: ``None``.
        layer_types (type | tuple[type, ...] | None): classes whose outermost instances are the layers.
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` picks the layers.
        **config_fields: the config fields ``release_lag``, ``prefetch_layers``, ``min_offload_numel``,
            ``recompute`` and ``offload_policy`` as keywords, over ``config``'s values:
            ``offload_transform(m, 2, min_offload_numel=256)``. Any other keyword is a ``TypeError``.

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``num_layers`` not an int or ``"auto"``;
            ``memory_budget`` not an int, float or str; a bad ``layer_types``/``filter_fn``/``config``;
            ``example_inputs`` not a tensor, tuple/list or dict with str keys.
        ValueError: ``num_layers`` missing, out of ``[0, L)``, or different from the config's;
            no layers found; ``"auto"`` without ``memory_budget``; a budget without
            ``example_inputs``, with ``num_layers=N`` or with ``config.recompute``; a budget that is
            not a size (``"abc"``) or not positive (before anything else), or below what any plan needs
            (after measuring, naming the smallest feasible budget); empty ``example_inputs``; a config rule.
        OffloadError: the model was already transformed; a layer is registered at two positions
            or belongs to another transformed model; with ``example_inputs``, a layer runs twice in
            one forward or before one registered ahead of it. All raised before the model changes.
        Exception: with a budget, what ``model(*example_inputs)`` raises while profiling (its own type, a
            model's bug may raise it too), with a note naming ``example_inputs``; the model is unchanged.

    Warns:
        UserWarning: a model that fits its budget (nothing planned);
            ``cpu_offloading_weights``/``cpu_offloading_double_buffering`` (no effect);
            ``example_inputs`` that cannot run the forward.

    Example::

        model = GPTStack(GPTConfig(hidden=4096, heads=32, layers=8))
        offload_transform(model, num_layers=4)
        model.to("cuda")  # before or after the transform
        model(x).sum().backward()
        print(model.offload_plan)

        offload_transform(model, memory_budget="20GiB", example_inputs=(x,))  # on the training device
        opt = HybridDeviceOptimizer(model.parameters(), **model.offload_plan.optimizer_kwargs())
    """
    return transform(model, num_layers, memory_budget, example_inputs, config, layer_types, filter_fn, config_fields)


def transform(model: nn.Module, num_layers: Any, memory_budget: Any, example_inputs: Any, config: Any,
              layer_types: Any, filter_fn: Any, config_fields: dict[str, Any],
              offload_fraction: float | None = None) -> nn.Module:
    """:func:`offload_transform`; with a budget, ``offload_fraction`` is the split of the optimizer the user
    already has (the framework callbacks know it), which the plan is made for instead of choosing one."""
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
    settings = resolve(num_layers, config, config_fields, memory_budget)
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
    if not auto:
        check_count(settings.num_layers, eligible, len(refs), how)  # type: ignore[arg-type]
    elif example_inputs is None:
        raise ValueError(
            f"offload_transform: memory_budget={settings.memory_budget!r} needs example_inputs= (one training "
            "step's inputs, on the device it trains on) so the planner can measure the layers; pass e.g. "
            "example_inputs=(x,)."
        )

    # ---- choose per layer
    declared_keep = [not r.offload for r in refs]
    notes = list(settings.notes)
    planned = None
    if auto:
        planned = _plan(model, refs, settings, example_inputs, config, declared_keep, offload_fraction)
        choices = list(planned.choices)
        settings.release_lag, settings.prefetch_layers = planned.release_lag, planned.prefetch_layers
        if planned.fits:  # the plan's text shows the planner's summary
            warnings.warn(f"offload_transform: {planned.summary()}.", UserWarning, stacklevel=3)
    else:
        n = settings.num_layers
        eligible_idx = [i for i, r in enumerate(refs) if r.offload][:n]  # type: ignore[misc]
        choices = ["offload" if i in eligible_idx else "keep" for i in range(len(refs))]
        if settings.recompute:
            choices = ["recompute_offload" if c == "offload" else "recompute" for c in choices]
    offloaded = frozenset(i for i, c in enumerate(choices) if c in OFFLOADED)
    # Note [Default schedule from the link]: the overlap schedule, tuned at the first training forward
    tune = tuple(k for k in ("release_lag", "prefetch_layers") if getattr(settings, k) is None) if offloaded else ()
    for k in tune:
        setattr(settings, k, 1)

    # ---- build the runtime, the plan and the state (the model is still untouched)
    from annotate_offload.runtime import DefaultOffloadSynchronizer
    from annotate_offload.runtime._marks import default_policy

    sync = DefaultOffloadSynchronizer(
        num_layers=len(refs), num_offloaded_layers=len(offloaded), offloaded_layers=sorted(offloaded),
        release_lag=settings.release_lag, prefetch_layers=settings.prefetch_layers, policy=settings.policy,
        min_offload_numel=settings.min_offload_numel,
    )  # no device: bound at the first training forward (Note [Device binding], runtime/_synchronizer.py)
    plan = OffloadPlan(
        layers=tuple(LayerPlan(i, r.fqn, type(r.module).__name__, c, declared_keep[i])  # type: ignore[arg-type]
                     for i, (r, c) in enumerate(zip(refs, choices))),
        layer_source=how, notes=tuple(notes), runtime=sync, planner=planned, model=weakref.ref(model),
    )
    recompute = {i: c in SELECTIVE for i, c in enumerate(choices) if c in RECOMPUTED}
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
    if tune:
        _TuneSchedule(model, tune)
    if recompute:
        _NoCacheWhileRecomputing.install(model)

    if example_inputs is not None:
        try:
            per_layer = estimate_bytes(model, state, example_inputs,
                                       min_numel=_min_numel(settings.min_offload_numel),
                                       policy=settings.policy or default_policy(),
                                       autocast_dtype=autocast_dtype_of(config))
            plan._with_bytes(per_layer, "estimate")
        except OffloadError:  # a layer that runs twice per forward: nothing stays applied
            remove_offload(model)
            raise
        except Exception as e:  # a forward that cannot run on meta tensors (data-dependent code)
            first = (str(e).splitlines() or [""])[0][:160]
            note = f"no estimate on meta tensors ({type(e).__name__}: {first}); bytes measured on the first step"
            plan.notes = plan.notes + (note,)
            warnings.warn(f"offload_transform: example_inputs= could not run the forward on meta tensors: {note}. If "
                          "the model runs on example_inputs, nothing is wrong (the forward has code meta tensors "
                          "refuse, e.g. .item()); otherwise check them: (x,) or {'input_ids': ids}, as the forward "
                          "takes.",
                          UserWarning, stacklevel=3)
    return model


def remove_offload(model: nn.Module) -> nn.Module:
    """Undo :func:`offload_transform` on ``model``: restore the layers' forwards, remove the marks it
    installed, the plan and the runtime state. Found through ``model``'s modules, so the transformed
    model may also be one inside ``model`` (transformed before ``peft.get_peft_model``) or one around
    it whose layers it holds (``merge_and_unload()`` of a transformed ``PeftModel``).

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        OffloadError: nothing in ``model`` was transformed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"remove_offload: model must be the nn.Module passed to offload_transform, got "
            f"{type(model).__name__}"
        )
    if not (states := transforms_in(model)):
        raise OffloadError(
            f"remove_offload: {type(model).__name__} was not transformed by offload_transform (or was restored "
            "already); nothing to remove."
        )
    for state in states:
        state.remove()
        state.plan.model = None  # OffloadPlan.measure refuses from now on
        if (owner := state.model()) is not None:
            for hooks in (owner._forward_pre_hooks, owner._forward_hooks):
                for key in [k for k, h in hooks.items() if isinstance(h, (_TuneSchedule, _NoCacheWhileRecomputing))]:
                    del hooks[key]
                    owner._forward_hooks_always_called.pop(key, None)
                    owner._forward_pre_hooks_with_kwargs.pop(key, None)
            owner.__dict__.pop(_STATE, None)
            owner.__dict__.pop("offload_plan", None)
    return model


def transforms_in(model: nn.Module) -> list[OffloadState]:
    """The transforms whose layers are in ``model``: its own, one of a module inside it, one of a model around it."""
    states = {id(st): st for m in model.modules() if (st := m.__dict__.get(_STATE)) is not None}
    for m in model.modules():  # a transform of a model around this one: its layers' wrappers know it
        if isinstance(w := m.__dict__.get("forward"), LayerForward) and (st := w.state()) is not None:
            states.setdefault(id(st), st)
    return list(states.values())


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
        if isinstance(w := r.module.__dict__.get("forward"), LayerForward) and w.state() is not None:
            raise OffloadError(
                f"offload_transform: {r.fqn} is already a layer of another transformed model; call "
                "remove_offload on that model first (or transform only one of the two)."
            )


def _plan(model: nn.Module, refs: list[LayerRef], settings: Any, example_inputs: Any, config: Any,
          declared_keep: list[bool], offload_fraction: float | None) -> Any:
    """The planner's result for the budget, measured under the autocast the step runs in."""
    from annotate_offload.planner import plan_offload

    dtype = autocast_dtype_of(config)
    leaf = next((t for t in tree_leaves(split_inputs(example_inputs, "offload_transform")) if isinstance(t, torch.Tensor)),
                None)
    device_type = leaf.device.type if leaf is not None else "cpu"
    region = (torch.autocast(device_type, dtype=dtype) if dtype is not None and not torch.is_autocast_enabled(device_type)
              else contextlib.nullcontext())
    section = getattr(config, "optimizer", None)  # a Config's OptimizerConfig: may the optimizer offload?
    optimizer = "device" if getattr(section, "optimizer_cpu_offload", True) is False else "hybrid"
    with region:
        return plan_offload(model, memory_budget=settings.memory_budget, example_inputs=example_inputs,
                            optimizer="hybrid" if offload_fraction is not None else optimizer,
                            offload_fraction=offload_fraction,
                            layers=[r.module for r in refs], min_offload_numel=_min_numel(settings.min_offload_numel),
                            release_lag=settings.release_lag, prefetch_layers=settings.prefetch_layers,
                            keep=[i for i, k in enumerate(declared_keep) if k])


class _NoCacheWhileRecomputing:
    """Note [No key/value cache under recompute]: a recomputed layer reruns its forward in backward, appending to a
    Hugging Face cache twice. As with HF's gradient checkpointing, layers recompute in training mode only, and a
    training forward with grad enabled runs with each ``config.use_cache`` off (put back after) and ``use_cache=True``
    passed as ``False``; a cache passed in (``past_key_values``, ``cache``) is refused (dropping it changes results)."""

    def __init__(self, configs: list, off: list, before: bool) -> None:
        self.configs, self.off, self.before = configs, off, before  # off: the configs turned off, shared

    @classmethod
    def install(cls, model: nn.Module) -> None:
        if configs := cache_configs(model):
            model.register_forward_pre_hook(cls(configs, (off := []), True), with_kwargs=True)
            model.register_forward_hook(cls(configs, off, False), always_call=True)

    def __call__(self, module: nn.Module, args: tuple, kwargs_or_out: Any) -> Any:
        if not self.before:
            for c in self.off:
                c.use_cache = True
            return self.off.clear()
        state = module.__dict__.get(_STATE)
        if not torch.is_grad_enabled() or not module.training or (state is not None and state.estimating is not None):
            return None  # the meta estimate runs once, without backward, in the model's settings (_example_inputs.py)
        with contextlib.suppress(TypeError):  # as the forward binds them (a wrapper's **kwargs too); else it raises
            named = inspect.signature(module.forward).bind_partial(*args, **kwargs_or_out).arguments
            if any({**named.get("kwargs", {}), **named}.get(k) is not None for k in ("past_key_values", "cache")):
                raise OffloadError(f"{type(module).__name__}: a training forward got past_key_values (or cache), but "
                                   "its layers are recomputed in backward, which would append to the cache twice. "
                                   "Pass no past_key_values in training, or transform with recompute=False.")
        self.off[:] = cache_off(self.configs)
        return (args, {**kwargs_or_out, "use_cache": False}) if kwargs_or_out.get("use_cache") else None


class _TuneSchedule:
    """Note [Default schedule from the link]. With ``num_layers=N`` and no schedule in the config, the
    runtime starts with ``release_lag = prefetch_layers = 1``. At the first training forward on CUDA the
    link (once per process), the layers' forward times and each offloaded layer's bytes are measured,
    and the cost model (Note [Planner time model], backward taken as twice the forward) picks the fastest
    schedule up to TransformerEngine's gap ``L - N - 1`` (at least 1), the smallest on ties. This root
    pre-hook removes itself at the first training forward (on a CPU without measuring)."""

    __reduce_ex__ = _refuse_pickle

    def __init__(self, model: nn.Module, tune: tuple[str, ...]) -> None:
        self.tune = tune
        self.id = model.register_forward_pre_hook(self, with_kwargs=True).id

    def __deepcopy__(self, memo: dict) -> "_TuneSchedule":  # a model's copy tunes its own runtime
        new = _TuneSchedule.__new__(_TuneSchedule)
        new.tune, new.id = self.tune, self.id
        return new

    def __call__(self, root: nn.Module, args: tuple, kwargs: dict) -> None:
        state = root.__dict__.get(_STATE)
        waiting = state is not None and (not torch.is_grad_enabled() or state.standing_aside)
        if waiting or torch.compiler.is_compiling():
            return  # wait for a training forward that runs eagerly (Note [Traced layers] in _layers.py)
        root._forward_pre_hooks.pop(self.id, None)
        root._forward_pre_hooks_with_kwargs.pop(self.id, None)
        leaf = next((t for t in tree_leaves((args, kwargs, list(root.parameters()))) if isinstance(t, torch.Tensor)),
                    None)
        if state is None or leaf is None or leaf.device.type != "cuda":
            return
        from annotate_offload.planner._bandwidth import measure_bandwidth

        bandwidth = measure_bandwidth(leaf.device)
        events, hooks = [], []
        for layer in state.layers:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events.append((start, end))
            hooks.append(layer.register_forward_pre_hook(lambda *_, e=start: e.record()))
            hooks.append(layer.register_forward_hook(lambda *_, e=end: e.record()))
        hooks.append(state.layers[-1].register_forward_hook(lambda *_: self.choose(state, bandwidth, events, hooks)))

    def choose(self, state: Any, bandwidth: Any, events: list, hooks: list) -> None:
        from annotate_offload.planner._search import choose_schedule

        for h in hooks:
            h.remove()
        events[-1][1].synchronize()
        fwd = [start.elapsed_time(end) for start, end in events]
        chosen = choose_schedule(fwd, dict(state.sync.stats.bytes_offloaded_per_layer), bandwidth,
                                 max(1, len(fwd) - len(state.offloaded) - 1))
        for name, value in zip(("release_lag", "prefetch_layers"), chosen):
            if name in self.tune:
                setattr(state.sync, name, value)
        state.plan.notes += (f"schedule from the link ({bandwidth.d2h_gbps:.1f} / {bandwidth.h2d_gbps:.1f} GB/s): "
                             f"release_lag={state.sync.release_lag}, prefetch_layers={state.sync.prefetch_layers}",)


def _min_numel(v: int | None) -> int:
    return 256 * 1024 if v is None else v
