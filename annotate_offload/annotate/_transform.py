"""``offload_transform`` and ``remove_offload``: validate, choose the layers, apply fx or hooks, attach a plan."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.nn as nn
import torch.utils.checkpoint as _cp

from annotate_offload._example_inputs import split as split_inputs
from annotate_offload.errors import OffloadError

from ._boundary import LayerBoundary
from ._discover import LayerRef, find_layers
from ._estimate import autocast_dtype_of, estimate_bytes
from ._forwards import ByMode, LayerContainers, OffloadedForward, RecomputeForward
from ._fx_pass import BOUNDARY_ATTR, FxTraceError, SharedLayerError, insert_boundaries, ordered_layers, trace_layers
from ._hooks import HookState, install_hooks
from ._plan import LayerPlan, OffloadPlan
from ._settings import check_count, resolve

__all__ = ["offload_transform", "remove_offload"]

_STATE = "_annotate_offload_state"
_ORIG_CHECKPOINT = _cp.checkpoint
_PATHS = ("auto", "fx", "hooks")


@dataclass
class _Applied:
    """What offload_transform changed, so remove_offload can undo exactly that."""

    boundary: LayerBoundary
    handles: list[Any]
    prev_forward: Any  # the instance-level forward before us (usually absent: _MISSING)
    recompute_layers: list[tuple[nn.Module, Any]]
    root_attrs: list[str]
    graph_module: Any  # the transformed graph (train mode, or both modes when they are the same)
    graph_module_eval: Any = None  # the eval-mode graph when it differs
    peft_marks: Any = None  # adapter / LM-head / frozen-weight marks this transform installed


class _Missing:
    """No instance-level forward before the transform; the same object in a deep copy of the model."""

    def __deepcopy__(self, memo: dict) -> "_Missing":
        return self

    def __repr__(self) -> str:
        return "<no instance forward>"


_MISSING = _Missing()


# --------------------------------------------------------------------------- public API


def offload_transform(
    model: nn.Module,
    num_layers: int | str | None = None,
    *,
    config: Any = None,
    example_inputs: Any = None,
    layer_types: type | Sequence[type] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    release_lag: int | None = None,
    prefetch_layers: int | None = None,
    memory_budget: int | None = None,
    recompute: bool = False,
    policy: str | None = None,
    min_offload_numel: int | None = None,
    path: str = "auto",
) -> nn.Module:
    """Offload the saved activations of a model's first ``num_layers`` layers to host memory, in place.

    Finds the layers (``@offload_layer`` marks, ``layer_types=``/``filter_fn=``, or the repeated
    blocks of an ``nn.ModuleList``/``nn.Sequential``), traces the forward with ``torch.fx`` with
    the layers as leaves, and inserts around each layer call the two runtime calls that open its
    offload scope and commit its output (``enter_layer(i)``/``commit_layer(out, i)``, see
    docs/runtime_api.md). The layer index is a constant in the graph, so eval forwards, skipped
    layers and repeated forwards cannot desynchronise it. When tracing fails (Hugging Face models),
    forward pre/post hooks on the layers make the same calls (``plan.path == "hooks"``).

    Like any ``torch.fx`` trace, the fx path fixes Python control flow at transform time; flow on
    ``self.training`` is handled (both graphs are kept and ``model.training`` picks one), other
    Python flags are not: after changing such a flag call ``remove_offload`` and transform again,
    or pass ``path="hooks"``. ``torch.utils.checkpoint`` around a layer stays in the graph, so the
    checkpoint's saved inputs are offloaded; on the hook path a checkpoint around an offloaded
    layer's call is refused (``OffloadError``), use ``recompute=True`` instead. Current
    transformers' ``gradient_checkpointing_enable()`` checkpoints inside the layer's call, after
    its hooks, and works on both paths: the checkpoint's saved inputs are offloaded. Only the fx path marks
    tensors the forward also returns with ``mark_not_offload``.

    The model object is changed in place, like torchao's ``quantize_``: same object, class,
    methods (``generate``), parameters and ``state_dict`` keys; its instance-level ``forward``
    runs the transformed graph. ``model.offload_plan`` (:class:`OffloadPlan`) shows per layer
    the choice and the bytes moved per step. ``remove_offload(model)`` undoes it.

    Args:
        model (nn.Module): the model; its parameters' device picks the runtime backend.
        num_layers (int | "auto" | None): offload the first ``N`` of the ``L`` offloadable layers,
            ``0 <= N < L`` (Megatron Bridge's ``cpu_offloading_num_layers``). ``"auto"`` lets
            ``annotate_offload.planner.plan_offload`` choose keep/offload/recompute per layer for
            ``memory_budget``. Required unless ``config`` gives ``cpu_offloading_num_layers``.
        config (ModelConfig | Config | None): activation-offload settings with Megatron Bridge
            names; ``cpu_offloading=False`` (or ``cpu_offloading_activations=False``) returns the
            model unchanged. Default: ``None``.
        example_inputs (Tensor | tuple | dict | None): one training step's inputs; used to
            estimate bytes per layer on the meta device (and to profile with ``"auto"``, which adds
            ``use_cache=False`` for models whose forward takes it: a training step uses no
            key/value cache; see ``annotate_offload/_example_inputs.py``). Without
            them the bytes are measured on the first training step. The estimate emulates bf16
            autocast when ``config`` says ``bf16=True`` or the call runs inside ``torch.autocast``
            (its dtype; Note [Autocast on meta] in ``_estimate.py``). Default: ``None``.
        layer_types (type | tuple[type, ...] | None): classes whose outermost instances are the layers.
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` picks the layers.
        release_lag (int | None): runtime release schedule, ``None`` = TransformerEngine's bound.
        prefetch_layers (int | None): reload look-ahead in layers, ``None`` = TransformerEngine's distance.
        memory_budget (int | None): bytes of saved activations allowed on the GPU, for ``"auto"``.
        recompute (bool): checkpoint every layer (non-reentrant ``torch.utils.checkpoint``);
            offloaded layers then offload the checkpoint's saved inputs. Default: ``False``.
        policy (str | None): ``"opt_out"`` or ``"opt_in"``; ``None`` = config or runtime default.
        min_offload_numel (int | None): smaller saved tensors stay on the device; ``None`` = 256K.
        path (str): ``"auto"`` (fx, else hooks), ``"fx"`` (fail if tracing fails) or ``"hooks"``.
            Default: ``"auto"``.

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``num_layers`` not an int or ``"auto"``; a
            bad ``layer_types``/``filter_fn``/``config``; ``example_inputs`` not a tensor,
            tuple/list or dict with str keys.
        ValueError: ``num_layers`` missing, out of ``[0, L)``, or different from the config's;
            no layers found; ``"auto"`` without ``memory_budget``/``example_inputs``, or
            ``memory_budget`` without ``"auto"``; empty ``example_inputs``; a config rule (raised by the config before the
            model is touched); bad ``path``.
        OffloadError: the model was already transformed; ``path="fx"`` and tracing failed.

    Warns:
        UserWarning: ``num_layers == L - 1`` with TransformerEngine's schedule (no overlap is
            possible; ``prefetch_layers=``/``release_lag=`` can overlap there);
            ``cpu_offloading_weights``/``cpu_offloading_double_buffering`` (no effect).

    Example::

        model = GPTStack(GPTConfig(hidden=4096, heads=32, layers=8), device="cuda")
        offload_transform(model, num_layers=4)
        print(model.offload_plan)
        model(x).sum().backward()
    """
    # ---- validate everything before touching the model
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_transform: model must be an nn.Module, got {type(model).__name__}.")
    if _STATE in model.__dict__:
        raise OffloadError(
            f"offload_transform: {type(model).__name__} is already transformed (path="
            f"{model.offload_plan.path}); call remove_offload(model) first to change the plan."
        )
    if path not in _PATHS:
        raise ValueError(f"offload_transform: path must be one of {_PATHS}, got {path!r}.")
    if not isinstance(recompute, bool):
        raise TypeError(f"offload_transform: recompute must be a bool, got {recompute!r}.")
    if example_inputs is not None:
        split_inputs(example_inputs, "offload_transform")  # a TypeError now, not a note in the plan
    settings = resolve(num_layers, config, release_lag, prefetch_layers, policy, min_offload_numel)
    if settings is None:
        return model
    refs, how = find_layers(model, layer_types=layer_types, filter_fn=filter_fn)
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
    else:
        if memory_budget is not None:
            raise ValueError(
                f"offload_transform: memory_budget={memory_budget!r} is used only by num_layers='auto' (got "
                f"num_layers={settings.num_layers!r}); drop memory_budget=, or pass num_layers='auto' with "
                "example_inputs= to let the planner fit the budget."
            )
        check_count(settings.num_layers, eligible, len(refs))  # type: ignore[arg-type]

    # ---- trace (fx) or fall back (hooks)
    gm, gm_eval, fx_failure, added = None, None, None, []
    fsdp = _fsdp_managed(model)
    if fsdp is not None:
        if path == "fx":
            raise OffloadError(
                f"offload_transform(path='fx'): {fsdp} is managed by FSDP2 (fully_shard); tracing it "
                "would run FSDP's lazy initialisation. Use path='auto' or 'hooks', or transform before "
                "fully_shard."
            )
        # Tracing would call FSDP2's forward hooks and initialise its state on proxies; the hook
        # path needs no tracing and composes with FSDP's own hooks.
        fx_failure = f"{fsdp} is managed by FSDP2 (fully_shard): not traced"
    elif path != "hooks":
        try:
            # Python control flow on `self.training` is fixed at trace time: trace both modes and,
            # when the graphs differ, run the one matching model.training at call time.
            gm = trace_layers(model, refs, training=True)
            added += gm.meta["root_attrs_added"]
            gm_eval = trace_layers(model, refs, training=False)
            added += gm_eval.meta["root_attrs_added"]
            order = ordered_layers(gm, refs)
            if [r.fqn for r in ordered_layers(gm_eval, refs)] != [r.fqn for r in order]:
                raise FxTraceError("the train and eval graphs call the layers in different orders")
            if gm_eval.code == gm.code:
                gm_eval = None
            refs = order
            if not any(n.op in ("call_module", "call_function") and _calls_layer(n, refs) for n in gm.graph.nodes):
                raise FxTraceError("the traced graph calls none of the layers")
        except FxTraceError as e:
            _drop_attrs(model, added)
            gm, gm_eval, fx_failure, added = None, None, str(e), []
            if path == "fx":
                raise OffloadError(f"offload_transform(path='fx'): tracing failed: {fx_failure}") from e
            if isinstance(e, SharedLayerError):
                # the hook path would accept the model and then refuse every training forward (a layer
                # entered twice): say so now (fresh-user report, seventh session, second pass, item 3)
                raise OffloadError(
                    f"offload_transform: {fx_failure}. Neither path can offload it: choose layers with "
                    "filter_fn= (or layer_types=) that leave the shared module out, or give each position its "
                    "own module."
                ) from e
    chosen_path = "fx" if gm is not None else "hooks"

    # ---- choose per layer
    declared_keep = [not r.offload for r in refs]
    notes = list(settings.notes)
    if auto:
        from annotate_offload.planner import plan_offload

        kwargs = {k: v for k, v in (("release_lag", settings.release_lag), ("prefetch_layers", settings.prefetch_layers))
                  if v is not None}
        try:
            result = plan_offload(model, memory_budget=memory_budget, example_inputs=example_inputs,
                                  layers=[r.module for r in refs], min_offload_numel=_min_numel(settings.min_offload_numel),
                                  **kwargs)
        except BaseException:
            _drop_attrs(model, added)
            raise
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
        if recompute:
            choices = ["recompute_offload" if c == "offload" else "recompute" for c in choices]
        if n == eligible - 1 and n > 0 and settings.release_lag is None and settings.prefetch_layers is None:
            msg = (f"offload_transform: num_layers={n} offloads all but the last of {eligible} layers; with "
                   "TransformerEngine's schedule no overlap of copies and compute is possible there. Pass "
                   "prefetch_layers=1 (reload one layer ahead) and/or release_lag=1 to overlap, or offload fewer layers.")
            warnings.warn(msg, UserWarning, stacklevel=2)
            notes.append(f"num_layers=L-1={n}: no overlap with TE's schedule (see prefetch_layers/release_lag)")
    offloaded = frozenset(i for i, c in enumerate(choices) if c in ("offload", "recompute_offload"))

    # ---- build the runtime and the plan (still nothing on the model changed, except fx constants)
    from annotate_offload.runtime import DefaultOffloadSynchronizer

    device = next((p.device.type for p in model.parameters()), None)
    sync = DefaultOffloadSynchronizer(
        num_layers=len(refs), num_offloaded_layers=len(offloaded), offloaded_layers=sorted(offloaded),
        release_lag=settings.release_lag, prefetch_layers=settings.prefetch_layers, policy=settings.policy,
        min_offload_numel=settings.min_offload_numel, device=device,
    )
    plan = OffloadPlan(
        layers=tuple(LayerPlan(i, r.fqn, type(r.module).__name__, c, declared_keep[i], reason=why)  # type: ignore[arg-type]
                     for i, (r, c, why) in enumerate(zip(refs, choices, reasons))),
        path=chosen_path, fx_failure=fx_failure, layer_source=how, notes=tuple(notes), runtime=sync,
    )
    boundary = LayerBoundary(sync, offloaded, plan)
    hook_state = HookState()

    # ---- apply
    prev_forward = model.__dict__.get("forward", _MISSING)
    wrapped = model.forward
    handles: list[Any] = []
    containers = None
    if gm is not None:
        containers = LayerContainers(model, [r.fqn.rpartition(".")[0] for r in refs])
        # The generated code runs with `self` = the live model, so it always sees the model's
        # current submodules, parameters and buffers (after .to(), load_state_dict(assign=True), ...).
        insert_boundaries(gm, refs, boundary, offloaded)
        model.__dict__[BOUNDARY_ATTR] = boundary  # what the generated code calls (self = the live model)
        added.append(BOUNDARY_ATTR)
        fn = functools.partial(type(gm).forward, model)
        if gm_eval is not None:
            insert_boundaries(gm_eval, refs, boundary, offloaded)
            fn = ByMode(model, fn, functools.partial(type(gm_eval).forward, model))
    else:
        handles = install_hooks(refs, boundary, hook_state)
        fn = wrapped
    recompute_layers = []
    for r, c in zip(refs, choices):
        if c in ("recompute", "recompute_offload"):
            recompute_layers.append((r.module, r.module.__dict__.get("forward", _MISSING)))
            r.module.forward = RecomputeForward(r.module.forward)
    # Offload marks for LoRA adapters (Hugging Face peft or ours), the LM head's input and frozen
    # weights' autocast casts (issue 5). They act only while an offload scope is open, so outputs
    # and gradients are unchanged; a user's own apply_offload_marks call is left alone.
    from annotate_offload.peft import apply_offload_marks, has_offload_marks

    peft_marks = None if has_offload_marks(model) else apply_offload_marks(model, warn=False)
    model.forward = OffloadedForward(fn, boundary, hook_state, wrapped, containers)
    model.__dict__[_STATE] = _Applied(
        boundary, handles, prev_forward, recompute_layers, added, gm, gm_eval, peft_marks
    )
    model.offload_plan = plan

    if example_inputs is not None:
        try:
            per_layer = estimate_bytes(model, boundary, example_inputs,
                                       min_numel=_min_numel(settings.min_offload_numel),
                                       policy=settings.policy or _default_policy(),
                                       autocast_dtype=autocast_dtype_of(config))
            plan._with_bytes(per_layer, "estimate")
        except Exception as e:  # a forward that cannot run on meta tensors (data-dependent code)
            first = (str(e).splitlines() or [""])[0][:160]
            note = f"meta estimate failed ({type(e).__name__}: {first}); bytes measured on the first step"
            plan.notes = plan.notes + (note,)
            # example_inputs= was passed for these numbers: a wrong shape or count must not pass quietly
            # (fresh-user report, seventh session, second pass)
            warnings.warn(f"offload_transform: example_inputs= could not run the forward: {note}. Check that "
                          "example_inputs matches model(*example_inputs).", UserWarning, stacklevel=2)
    return model


def remove_offload(model: nn.Module) -> nn.Module:
    """Undo :func:`offload_transform`: restore the original forward, remove hooks, plan and runtime state.

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
    applied = model.__dict__.get(_STATE)
    if applied is None:
        raise OffloadError(
            f"remove_offload: {type(model).__name__} was not transformed by offload_transform (or was restored "
            "already); nothing to remove."
        )
    applied.boundary.abort()
    for h in applied.handles:
        h.remove()
    if applied.peft_marks is not None:
        applied.peft_marks.remove()
    for module, prev in applied.recompute_layers:
        _restore_forward(module, prev)
    _restore_forward(model, applied.prev_forward)
    _drop_attrs(model, applied.root_attrs)
    del model.__dict__[_STATE]
    model.__dict__.pop("offload_plan", None)
    return model


# --------------------------------------------------------------------------- helpers


def _fsdp_managed(model: nn.Module) -> str | None:
    """Name of the first module managed by FSDP2's ``fully_shard`` in ``model``, or ``None``."""
    for name, module in model.named_modules():
        if any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
            return f"module {name or type(model).__name__!r}"
    return None


def _restore_forward(module: nn.Module, prev: Any) -> None:
    if prev is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = prev


def _drop_attrs(model: nn.Module, names: list[str]) -> None:
    for name in names:
        model.__dict__.pop(name, None)


def _calls_layer(node: Any, refs: list[LayerRef]) -> bool:
    fqns = {r.fqn for r in refs}
    if node.op == "call_module":
        return node.target in fqns
    return node.target is _ORIG_CHECKPOINT and getattr(node.args[0], "target", None) in fqns


def _min_numel(v: int | None) -> int:
    return 256 * 1024 if v is None else v


def _default_policy() -> str:
    from annotate_offload.runtime._marks import default_policy

    return default_policy()
