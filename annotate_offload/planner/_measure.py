"""Measurements the planner's cost model needs: per-layer time and bytes, and the rest of the step.

:func:`measure` runs the model twice without autograd to capture every layer's inputs and time the
forward outside the layers, then runs each layer's forward and backward alone, timing them (CUDA
events on GPU, ``time.perf_counter`` on CPU), counting the unique storages it saves for backward through
``torch.autograd.graph.saved_tensors_hooks`` and, on CUDA, reading the allocator's peaks.
Backward uses ``torch.autograd.grad``, which returns gradients instead of accumulating them into
``.grad``. The model is left as found: every module's training flag, every buffer (e.g. BatchNorm's
running statistics and ``num_batches_tracked``), every parameter's ``.grad`` object and the CPU and CUDA
RNG states are saved before and restored after, also when profiling raises.

Note [A busy device's clock]: a GPU held at its power cap by a step's sustained work runs at a lower clock
than a phase timed alone between idle waits gets, so a matmul-bound phase is faster alone than in a step.
The layers' forwards are therefore also timed inside one pass of the whole model, right after a warm-up
pass, and every phase time is scaled by that pass's layer time over the sum of the forwards timed alone
(never below one): a phase costs what it costs on a busy device.

Note [No key/value cache while profiling]: a Hugging Face model whose ``use_cache`` is not passed reads
``config.use_cache`` (``True`` by default) and hands every decoder layer one shared key/value cache. Each
layer is profiled several times on the inputs captured from one forward, so it would append to that
cache on every run: later runs attend to earlier runs' keys, and their backward reaches a freed graph.
A training step keeps no cache (Hugging Face's Trainer turns it off under gradient checkpointing), so
every ``config.use_cache`` in the model's modules is ``False`` while profiling, however deep the model
sits in the caller's wrappers (PEFT, a ``LightningModule``), and put back after.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import warnings
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from annotate_offload._example_inputs import cache_configs, cache_off, split
from annotate_offload.annotate._discover import find_layers
from annotate_offload.annotate._layers import _checkpointed
from annotate_offload.annotate._transform import transforms_in

# the runtime's rule for what it never offloads (weights and their casts), so the plan counts as it moves
from annotate_offload.runtime._layer_state import _is_weight, frozen_shapes

from ._bandwidth import measure_adamw
from ._cost_model import LayerMeasurement, StepMeasurement

__all__ = ["measure", "measure_layers"]


class _ModelState:
    """Everything profiling may change, saved so it can be put back (see the module docstring)."""

    __slots__ = ("model", "training", "buffers", "grads", "cpu_rng", "cuda_rng", "caching", "aside")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.training = [(m, m.training) for m in model.modules()]
        self.caching = cache_off(cache_configs(model))  # Note [No key/value cache while profiling]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        # a transformed model is profiled as its own code; last, so nothing above fails with it set aside
        self.aside = contextlib.ExitStack()
        for state in transforms_in(model):
            self.aside.enter_context(state.aside())

    def restore(self) -> None:
        self.aside.close()
        for module, flag in self.training:
            module.training = flag
        for c in self.caching:
            c.use_cache = True
        with torch.no_grad():
            for buf, saved in self.buffers:
                buf.copy_(saved)
        for param, grad in self.grads:
            param.grad = grad
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _capture_inputs(model: nn.Module, layers: Sequence[nn.Module], args: tuple, kwargs: dict, device) -> tuple:
    """Every layer's inputs from one forward without autograd, and the forward time outside and inside the
    layers (ms, from a second forward right after the first, which warms up)."""
    captured: list = [None] * len(layers)
    marks: list = []

    def pre(index: int):
        def hook(_module, hook_args, hook_kwargs):
            if captured[index] is None:
                detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
                captured[index] = (tree_map(detach, hook_args), tree_map(detach, hook_kwargs))
            marks.append(_Timer(device).__enter__())

        return hook

    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(lambda *_: marks[-1].__exit__()) for layer in layers]
    try:
        with torch.no_grad():
            for _ in range(2):
                marks.clear()
                with _Timer(device) as whole:
                    model(*args, **kwargs)
    except Exception as e:
        # a wrong shape or count surfaces as the model's own error, with no word of example_inputs;
        # the error keeps its type (it may be a real bug of the model) and gains a note (Python >= 3.11
        # prints it under the traceback)
        if hasattr(e, "add_note"):
            e.add_note("annotate_offload: raised by model(*example_inputs) while profiling the layers (plan_offload / "
                       "memory_budget=); check that example_inputs= is what the forward takes, e.g. (x,) "
                       "or {'input_ids': ids}.")
        raise
    finally:
        for h in handles:
            h.remove()
    missing = [i for i, c in enumerate(captured) if c is None]
    if missing:
        raise ValueError(
            f"plan_offload: layers {missing} were not called by model(*example_inputs); pass layers= with only the "
            "blocks the forward runs, or example_inputs that reach them."
        )
    inside = sum(m.ms() for m in marks)
    return captured, max(0.0, whole.ms() - inside), inside


def _unique_storage_bytes(tensors, skip: set) -> int:
    seen: set = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() in skip or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class _Timer:
    """Milliseconds of a phase: on a CPU by the clock; on CUDA by events, and after ``wait_ms`` as a step of a
    busy device sees them.

    Note [Timing with the host ahead]: in a step that keeps the device busy the host queues a layer's
    kernels while the device still runs earlier ones, so a layer costs its device time, or the host's time
    to queue it if that is longer. A phase timed alone from an idle device also pays the host's launch
    latency, which for a layer run through a Python dispatch mode (a selective recompute, Note [Selective
    recompute] in ``annotate/_layers.py``) is most of what separates it from a full recompute. So the
    profile times each phase behind a device-side wait (``torch.cuda._sleep``) a little longer than the
    host took to queue that phase in the previous run (``wait_ms``; the first, untimed run waits for
    nothing): the host queues the phase while the device waits, and the phase costs the larger of its
    device time and the host's. A host that took longer than the wait (a synchronising op in the phase)
    gets the time from its start to the device's end, less the wait: the phase timed alone.
    """

    __slots__ = ("cuda", "wait_ms", "events", "t0", "t1")

    def __init__(self, device: torch.device, wait_ms: float = 0.0) -> None:
        self.cuda, self.wait_ms = device.type == "cuda", wait_ms if device.type == "cuda" else 0.0
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def __enter__(self):
        if self.wait_ms:
            self.events[0].record()
            torch.cuda._sleep(int(self.wait_ms * _cycles_per_ms()))
        if self.cuda:
            self.events[1].record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.t1 = time.perf_counter()
        if self.cuda:
            self.events[2].record()

    def host_ms(self) -> float:
        return (self.t1 - self.t0) * 1e3

    def ms(self) -> float:
        if not self.cuda:
            return self.host_ms()
        start, begin, stop = self.events
        stop.synchronize()
        if not self.wait_ms:
            return begin.elapsed_time(stop)
        if self.host_ms() < self.wait_ms:
            return max(begin.elapsed_time(stop), self.host_ms())
        return max(start.elapsed_time(stop) - self.wait_ms, 0.0)


@functools.cache
def _cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on the current device."""
    cycles = 10_000_000
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # the first launch pays for loading the kernel
    start.record()
    torch.cuda._sleep(cycles)
    stop.record()
    stop.synchronize()
    return cycles / max(start.elapsed_time(stop), 1e-3)


def _unmoved_bytes(saved: list, skip: set, min_numel: int, frozen: set = frozenset()) -> int:
    """Bytes of the storages only tensors the runtime keeps on the device saved, even when their layer
    is offloaded: those under ``min_numel`` elements (reason ``too_small``) and weights' autocast casts."""
    def stays(t: torch.Tensor) -> bool:
        return t.numel() < min_numel or _is_weight(t, frozen)

    tensors = [t for t in saved if isinstance(t, torch.Tensor)]
    moved = {(t.device, t.untyped_storage().data_ptr()) for t in tensors if not stays(t)}
    return _unique_storage_bytes([t for t in tensors if stays(t) and (t.device, t.untyped_storage().data_ptr())
                                  not in moved], skip)


def _profile_layer(layer: nn.Module, captured, param_ptrs: set, device: torch.device, min_numel: int,
                   frozen: set, grad_flags: list | None, waits: dict) -> tuple:
    """``(forward ms, backward ms, saved, input, unmoved, unmoved input, F+, B+, casts, recompute ms, R+, s,
    selective ms, S+, unmoved s)`` of one run of ``layer`` (each phase timed after ``waits[phase]`` ms, which it
    sets for the next run: Note [Timing with the host ahead]), one under non-reentrant ``torch.utils.checkpoint``
    and one under it selectively (bytes; ``F+``, ``B+``, ``R+``, ``s``, ``S+`` as in Note [Planner memory
    model]: from the CUDA allocator's peak; on a CPU the new saved tensors and output, the input gradients,
    ``max(F+, saved - saved input + B+)`` and that less ``s``, at least ``B+``; ``s``: the outputs the
    selective checkpoint keeps, which it saves through the saved-tensor hooks around it). Autocast's cache of
    weight casts is cleared before each forward: a step's forward casts each weight anew.

    An input that needs a gradient in the model's own forward (``grad_flags``, per tensor input in
    pytree order; unknown: every floating-point input) is a fresh leaf that requires one; the others are
    passed as captured, so a tensor of the static memory (an example input, a buffer's view) stays
    outside the layer's bytes, and an op with a constant operand saves what it saves in the model."""
    leaves, spec = tree_flatten(captured)
    flags = iter(grad_flags if grad_flags is not None else [])

    def fresh(x):
        if not isinstance(x, torch.Tensor):
            return x
        grad = next(flags, x.is_floating_point()) and x.is_floating_point()
        return x.detach().clone().requires_grad_(True) if grad else x

    args, kwargs = tree_unflatten([fresh(x) for x in leaves], spec)
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    ckpt_bytes = _unique_storage_bytes(inputs, param_ptrs)
    ckpt_unmoved = _unmoved_bytes(inputs, param_ptrs, min_numel)
    wrt = [x for x in inputs if x.requires_grad] + [p for p in layer.parameters() if p.requires_grad]
    saved: list[torch.Tensor] = []
    cuda = device.type == "cuda"

    def pack(t):
        saved.append(t)
        return t

    torch.clear_autocast_cache()
    before = _allocated(device)
    record = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    timers = {phase: _Timer(device, waits.get(phase, 0.0)) for phase in ("f", "b", "r", "sf", "s")}
    with timers["f"] as fwd, torch.enable_grad(), record:
        out = layer(*args, **kwargs)
    outs = _grad_outputs(out)
    known = param_ptrs | {x.untyped_storage().data_ptr() for x in inputs}
    fwd_peak = (_peak(device) - before) if cuda else _unique_storage_bytes(saved + outs, known)
    saved_bytes = _unique_storage_bytes(saved, param_ptrs)
    unmoved = _unmoved_bytes(saved, param_ptrs, min_numel, frozen)
    casts = _unique_storage_bytes([t for t in saved if _is_weight(t, frozen)], param_ptrs)
    input_ptrs = {x.untyped_storage().data_ptr() for x in inputs}
    input_saved = _unique_storage_bytes([t for t in saved if isinstance(t, torch.Tensor)
                                         and t.untyped_storage().data_ptr() in input_ptrs], param_ptrs)
    saved.clear()
    bwd_ms, bwd_peak = _backward(outs, wrt, inputs, device, timers["b"])
    del out, outs
    torch.clear_autocast_cache()
    with torch.enable_grad():
        out = _checkpointed(layer, layer)(*args, **kwargs)
    torch.clear_autocast_cache()  # a step frees the forward's casts when autocast exits; the cache would keep them
    rec_ms, rec_peak = _backward(_grad_outputs(out), wrt, inputs, device, timers["r"])
    del out
    torch.clear_autocast_cache()
    with timers["sf"] as sel_fwd, torch.enable_grad(), record:
        out = _checkpointed(layer, layer, selective=True)(*args, **kwargs)
    torch.clear_autocast_cache()
    sel_bytes, sel_unmoved = _unique_storage_bytes(saved, known), _unmoved_bytes(saved, known, min_numel)
    saved.clear()
    sel_ms, sel_peak = _backward(_grad_outputs(out), wrt, inputs, device, timers["s"])
    if not cuda:
        rec_peak = max(fwd_peak, saved_bytes - input_saved + bwd_peak)
        sel_peak = max(rec_peak - sel_bytes, bwd_peak)
    waits.update({phase: 1.25 * t.host_ms() + 0.1 for phase, t in timers.items()})  # for the next run
    return (fwd.ms(), bwd_ms, saved_bytes, ckpt_bytes, unmoved, ckpt_unmoved, max(fwd_peak, 0), bwd_peak, casts,
            rec_ms, rec_peak, sel_bytes, sel_fwd.ms() - fwd.ms() + sel_ms, sel_peak, sel_unmoved)


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]


class _OutputGradient(torch.autograd.Function):
    """Identity whose backward makes the output's gradient (ones, in the output's layout). A step's output
    gradient is made when its backward reaches the layer and freed once used; one the caller passed in
    would stay held to the end, above a backward whose peak comes after it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.layout = (x.size(), x.stride())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(*ctx.layout, dtype=grad.dtype, device=grad.device).fill_(1)


def _backward(outs: list, wrt: list, inputs: list, device: torch.device, timer: _Timer) -> tuple[float, int]:
    """``(ms, peak)`` of a backward from output gradients of ones: the allocator's peak beyond what was
    allocated before, less the output gradients and the parameter gradients (both counted apart, as
    ``c_{j+1}`` and ``LayerMeasurement.grad_bytes``); on a CPU the input gradients."""
    with torch.enable_grad():  # also when planning runs under no_grad
        roots = [_OutputGradient.apply(o).sum() for o in outs]
    ones = [torch.ones_like(r) for r in roots]  # made before the peak is reset, like the roots
    before = _allocated(device)
    with timer:
        got = torch.autograd.grad(roots, wrt, ones, allow_unused=True) if outs else ()
    if device.type != "cuda":
        return timer.ms(), _unique_storage_bytes([x for x in inputs if x.requires_grad], set())
    params = got[sum(x.requires_grad for x in inputs):]
    return timer.ms(), _peak(device) - before - _bytes(outs) - _bytes(g for g in params if g is not None)


class _HeadDone(Exception):
    """Raised by the hook on the last layer's output gradient: the head's backward is measured."""


def _measure_head(model: nn.Module, layers: Sequence[nn.Module], args: tuple, kwargs: dict, device: torch.device,
                  param_ptrs: set, outside: list, grad_flags: list) -> dict:
    """The head's terms of Note [Planner memory model] (``StepMeasurement`` keywords), from one forward of
    the model with every layer under non-reentrant ``torch.utils.checkpoint`` (the least memory any plan
    needs) and its backward from a gradient of ones, stopped once the last layer's output gradient is ready.
    The same forward fills ``grad_flags[i]``: which tensor inputs of layer ``i`` require a gradient.

    On CUDA from the allocator: what is allocated after the forward beyond what was before the last layer's
    outputs (the outputs, the head's saved tensors: a final norm's input is the last layer's output), the
    forward's peak beyond that, and the backward's peak up to
    that gradient beyond it (the outside parameters' gradients made by then excluded). On a CPU from
    saved-tensor hooks: the unique storages saved after the last layer, the outputs, and the outputs'
    gradients as the backward's transient (the CPU convention of ``_profile_layer``).
    """
    try:
        return _head_terms(model, layers, args, kwargs, device, param_ptrs, outside, grad_flags)
    except Exception as exc:  # a forward that cannot run its layers under checkpoint: plan without the head
        warnings.warn(f"plan_offload: could not measure the memory after the last layer ({type(exc).__name__}: "
                      f"{(str(exc).splitlines() or [''])[0][:160]}); the prediction leaves the head out.",
                      UserWarning, stacklevel=3)
        return {}


def _head_terms(model, layers, args, kwargs, device, param_ptrs, outside, grad_flags) -> dict:
    cuda = device.type == "cuda"
    state: dict = {"after_last": False, "at_last": 0, "grad_ready": None}
    saved_after: list = []
    last = layers[-1]

    def pack(t):  # a detached alias: this backward stops early, so no saved output may hold its own node
        if state["after_last"] and isinstance(t, torch.Tensor):
            saved_after.append(t)
        return t.detach()

    def post_last(_module, _args, out):
        state["after_last"] = True
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        state["at_last"] = _allocated(device) - _unique_storage_bytes(outs, param_ptrs)  # the head may save them
        y = next(iter(outs), None)
        if y is not None and y.requires_grad:
            y.register_hook(_stop)

    def _stop(_grad):
        state["grad_ready"] = (_peak(device) if cuda else 0,
                               _bytes(p.grad for p in outside if p.grad is not None))
        raise _HeadDone

    def flags(i):
        def hook(_module, a, k):
            if grad_flags[i] is None:
                grad_flags[i] = [t.requires_grad for t in tree_flatten((a, k))[0] if isinstance(t, torch.Tensor)]
        return hook

    originals = {}
    for layer in layers:
        originals[layer] = layer.__dict__.get("forward")
        layer.forward = _checkpointed(layer.forward)
    handles = [last.register_forward_hook(post_last)]
    handles += [layer.register_forward_pre_hook(flags(i), with_kwargs=True) for i, layer in enumerate(layers)]
    for p in model.parameters():  # backward must not add into them; measure's _ModelState puts them back
        p.grad = None
    try:
        torch.clear_autocast_cache()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        out_bytes = _unique_storage_bytes(outs, param_ptrs)
        fwd_peak = _peak(device) if cuda else 0  # since the last layer's output
        after = _allocated(device)  # also resets the peak: what follows is the backward's
        live = [o for o in outs if o.requires_grad]
        out_ptrs = {o.untyped_storage().data_ptr() for o in outs}
        if cuda:
            held = max(after - state["at_last"], 0)
            head_saved = max(held - out_bytes, 0)
        else:
            head_saved = _unique_storage_bytes(saved_after, param_ptrs | out_ptrs)
        saved_after.clear()
        fwd_transient = max(fwd_peak - after, 0) if cuda else 0
        bwd_transient = 0
        if live:
            grads = [torch.ones_like(o) for o in live]
            try:
                torch.autograd.backward(live, grads)
            except _HeadDone:
                pass
            if state["grad_ready"] is not None:
                peak, outside_grads = state["grad_ready"]
                bwd_transient = (max(peak - after - outside_grads, 0) if cuda
                                 else _unique_storage_bytes(grads, set()))
            del grads
        del out, outs, live
    finally:
        for handle in handles:
            handle.remove()
        for layer, fwd in originals.items():
            if fwd is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = fwd
        for p in model.parameters():  # the head's gradients: not held while the layers are profiled
            p.grad = None
    return {"output_bytes": out_bytes, "head_saved_bytes": head_saved, "head_forward_peak_bytes": fwd_transient,
            "head_backward_peak_bytes": bwd_transient}


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def _device_of(layer: nn.Module, captured) -> torch.device:
    for x in tree_flatten(captured)[0]:
        if isinstance(x, torch.Tensor):
            return x.device
    for p in layer.parameters():
        return p.device
    return torch.device("cpu")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@torch.inference_mode(False)  # profiling records for backward, also when planning runs under inference_mode
def measure(
    model: nn.Module,
    layers: Sequence[nn.Module] | None,
    example_inputs: Any,
    *,
    warmup: int = 1,
    repeats: int = 3,
    min_offload_numel: int = 0,
    optimizer: bool = True,
) -> tuple[tuple[LayerMeasurement, ...], StepMeasurement]:
    """Profile one forward and backward of each layer, in training mode, and the rest of the step,
    leaving the model as found.

    On CUDA the device's peak memory statistics are reset (``torch.cuda.reset_peak_memory_stats``).

    Args:
        model (nn.Module): the model; ``model(*example_inputs)`` must run every layer once.
        layers (Sequence[nn.Module] | None): the layers to plan, in forward order; ``None``: the layers
            ``offload_transform`` finds (``@offload_layer`` marks, else the repeated blocks).
        example_inputs: a tensor, a tuple/list of positional inputs or a dict of keyword inputs, at the
            shapes of a training step (their batch and sequence decide the bytes).
        warmup (int): untimed runs per layer before timing. Default: ``1``.
        repeats (int): timed runs per layer; the median is kept. Default: ``3``.
        min_offload_numel (int): the runtime's threshold: saved tensors under it (and weights' casts)
            stay on the device when their layer is offloaded (``LayerMeasurement.unmoved_bytes``). Default: ``0``.
        optimizer (bool): the step ends with AdamW over ``model.parameters()`` (their state and time are
            in the :class:`StepMeasurement`). Default: ``True``.

    Returns:
        (tuple[LayerMeasurement, ...], StepMeasurement): per layer, forward/backward ms (medians, at a busy
        device's clock: Note [A busy device's clock]), saved bytes (unique storages saved for backward,
        parameters and buffers excluded), checkpoint-input bytes, peaks and gradient bytes; and the rest
        of the step (static bytes: on CUDA everything allocated before or after profiling, whichever is
        more, but gradients; on a CPU the parameters and buffers).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or bad ``example_inputs``.
        ValueError: a layer is not a submodule of ``model`` or is not called by the forward;
            ``warmup < 0`` or ``repeats < 1``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"measure_layers: model must be an nn.Module, got {type(model).__name__}.")
    for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1), ("min_offload_numel", min_offload_numel, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"measure_layers: {name} must be an int >= {low}, got {value!r}.")
    names = {id(m): n for n, m in model.named_modules()}
    if layers is None:
        try:
            named = [(ref.fqn, ref.module) for ref in find_layers(model)[0]]
        except ValueError:
            raise ValueError(f"plan_offload: found no layers in {type(model).__name__} (no @offload_layer marks, no "
                             "nn.ModuleList or nn.Sequential of two or more children of one class); pass layers=[...] "
                             "with the blocks to plan.") from None
    else:
        layers = list(layers)
        if not layers:
            raise ValueError("measure_layers: layers is empty; pass the model's blocks or None to discover them.")
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module) or id(layer) not in names:
                raise ValueError(
                    f"measure_layers: layers[{i}] ({type(layer).__name__}) is not a submodule of the model; pass "
                    "modules from model.modules()."
                )
        named = [(names[id(layer)], layer) for layer in layers]
    args, kwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t,
                            split(example_inputs, "plan_offload"))
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    in_layers = {id(p) for _, layer in named for p in layer.parameters()}
    device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)),
                  params[0].device if params else torch.device("cpu"))
    if device.type == "cuda":  # everything on the device now, but gradients (a step starts without them)
        static = torch.cuda.memory_allocated(device) - _bytes(p.grad for p in params if p.grad is not None)
    else:
        static = _bytes([*params, *model.buffers()])
    # parameters, buffers and the example inputs stay on the GPU whatever the plan: not activation memory
    param_ptrs = {t.untyped_storage().data_ptr() for t in (*params, *model.buffers(), *tree_flatten((args, kwargs))[0])
                  if isinstance(t, torch.Tensor)}
    frozen = frozen_shapes(p for p in params if not p.requires_grad)
    state = _ModelState(model)
    try:
        model.train()
        captured, other_fwd_ms, in_model_ms = _capture_inputs(model, [m for _, m in named], args, kwargs, device)
        grad_flags: list = [None] * len(named)
        head = _measure_head(model, [m for _, m in named], args, kwargs, device, param_ptrs,
                             [p for p in trainable if id(p) not in in_layers], grad_flags)
        profiles = []
        for (_, layer), inputs, flags in zip(named, captured, grad_flags):
            dev, waits = _device_of(layer, inputs), {}  # waits: Note [Timing with the host ahead]
            profiles.append([_profile_layer(layer, inputs, param_ptrs, dev, min_offload_numel, frozen, flags, waits)
                             for _ in range(warmup + repeats)][warmup:])
        # Note [A busy device's clock]
        alone = sum(statistics.median(r[0] for r in runs) for runs in profiles)
        clock = max(1.0, in_model_ms / alone) if alone > 0 else 1.0
        result = []
        for (name, layer), runs in zip(named, profiles):
            backward_ms = statistics.median(r[1] for r in runs)  # no rerun is timed below the plain backward
            result.append(
                LayerMeasurement(
                    forward_ms=clock * statistics.median(r[0] for r in runs),
                    backward_ms=clock * backward_ms,
                    saved_bytes=max(r[2] for r in runs),
                    checkpoint_input_bytes=runs[0][3],
                    unmoved_bytes=min(max(r[4] for r in runs), max(r[2] for r in runs)),
                    unmoved_input_bytes=min(runs[0][5], runs[0][3]),
                    forward_peak_bytes=max(r[6] for r in runs),
                    backward_peak_bytes=max(r[7] for r in runs),
                    grad_bytes=_bytes(p for p in layer.parameters() if p.requires_grad),
                    cast_bytes=max(r[8] for r in runs),
                    recompute_ms=clock * max(statistics.median(r[9] for r in runs), backward_ms),
                    recompute_peak_bytes=max(r[10] for r in runs),
                    selective_bytes=max(r[11] for r in runs),
                    unmoved_selective_bytes=min(max(r[14] for r in runs), max(r[11] for r in runs)),
                    selective_ms=clock * max(statistics.median(r[12] for r in runs), backward_ms),
                    selective_peak_bytes=max(r[13] for r in runs),
                    name=name,
                )
            )
    finally:
        state.restore()
    del captured, inputs, state  # what stays allocated once the model has run (e.g. BLAS workspaces) is static
    if device.type == "cuda":
        static = max(static, _allocated(device) - _bytes(p.grad for p in params if p.grad is not None))
    device_ms, host_ms = measure_adamw(device) if optimizer and trainable else (0.0, 0.0)
    step = StepMeasurement(
        static_bytes=max(static, 0), other_grad_bytes=_bytes(p for p in trainable if id(p) not in in_layers),
        other_ms=3 * other_fwd_ms,  # backward ~ twice the forward
        param_numels=tuple(p.numel() for p in trainable) if optimizer else (),
        param_state_bytes=tuple(2 * p.numel() * p.element_size() for p in trainable) if optimizer else (),
        device_ms=device_ms, host_ms=host_ms, **head)
    return tuple(result), step


def measure_layers(model: nn.Module, layers: Sequence[nn.Module] | None, example_inputs: Any,
                   **kwargs: Any) -> tuple[LayerMeasurement, ...]:
    """The per-layer half of :func:`measure` (same arguments, without ``optimizer``)."""
    return measure(model, layers, example_inputs, optimizer=False, **kwargs)[0]
