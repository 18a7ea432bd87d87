"""The planner's cost model: predicted step time and peak device memory of a plan.

A plan is, per layer ``0..L-1`` (forward order), one of :data:`CHOICES`; the runtime schedule
(``release_lag`` ``k``, ``prefetch_layers`` ``p``); and the optimizer split: the first ``m`` trainable
parameter tensors are stepped on the host by ``HybridDeviceOptimizer`` (``offload_fraction`` = their
share of the trainable numel, Megatron's split rule, which takes whole tensors in order).

``keep``
    saved activations stay on the GPU from the layer's forward to its backward.
``offload``
    saved activations are copied to host (D2H) on a side stream as they are saved and released at the
    entry of layer ``i + 1 + k``; they are prefetched back (H2D) when backward enters layer ``i + p``.
``recompute``
    the layer runs under ``torch.utils.checkpoint``: only its input (the checkpoint input) is kept;
    backward reruns the layer's forward, then its backward.
``recompute_offload``
    ``recompute``, with the checkpoint input offloaded and prefetched like ``offload``.
``selective``
    ``recompute`` that keeps, besides the input, the outputs of matrix multiplies and attention and
    reruns only the rest (Note [Selective recompute] in ``annotate/_layers.py``).
``selective_offload``
    ``selective``, with the input and the kept outputs offloaded and prefetched like ``offload``.

Per layer ``i`` (:class:`LayerMeasurement`): forward and backward time ``f_i``, ``b_i`` (ms); saved bytes
``a_i``, checkpoint-input bytes ``c_i``; ``F+_i``, ``B+_i`` and ``R+_i``, the device bytes its forward, its
backward and its backward when recomputed allocate at their peak beyond what existed before (the backward's
without its parameter gradients ``g_i``, so negative when the peak comes after it freed saved tensors);
``r_i``, its backward time when recomputed (the forward rerun, then the backward); ``s_i``, ``sr_i`` and ``S+_i``
the bytes a selective recompute keeps beyond the input, its backward time and peak.
For the step (:class:`StepMeasurement`): ``static`` bytes on the device before a step (weights, buffers,
inputs), gradient bytes of parameters outside the layers, time outside the layers, and per trainable
parameter its numel and Adam state bytes. The link (:class:`LinkBandwidth`) copies ``n`` bytes in
``n / (GB/s * 1e6)`` ms.

Note [Planner time model]
    One compute stream, one D2H stream and one H2D stream (the runtime's side streams), each in order::

        forward, j = 0..L-1:
            entry of j: for each offloaded i with i + 1 + k == j:   t = max(t, d2h_end[i])   # release waits
            s = t;  t += f_j                                       # checkpointed forward costs f_j too
            if j offloaded: d2h_end[j] = max(t, max(s, d2h_free) + bytes_j / D2H);  d2h_free = d2h_end[j]
        backward, j = L-1..0:
            entry of j: for each offloaded i with min(i + p, L-1) == j, from the highest i:
                h2d_end[i] = max(t, h2d_free, d2h_end[i]) + bytes_i / H2D;  h2d_free = h2d_end[i]
            if j offloaded: t = max(t, h2d_end[j])                 # reload must have landed
            t += r_j if j recomputed, sr_j if selective (or selective_offload), else b_j
        step_ms = t + other_ms + optimizer_ms
        optimizer_ms = (numel stepped on the device * device_ms + numel stepped on the host * host_ms) / 1e9

    with ``bytes_j`` what an offloaded layer moves (``a_j``, ``c_j`` for ``recompute_offload``, ``c_j + s_j`` for
    ``selective_offload``, less the tensors under ``min_offload_numel``). The runtime starts each D2H when the
    tensor is saved; the model takes the bytes as produced evenly over the layer's forward, so a layer's D2H
    ends when its forward ends if the link keeps up, else ``bytes / D2H`` after it could start. A copy hides
    behind compute (its own layer's and the next ones') and delays the step only by what the compute stream
    waits for.
    ``device_ms`` and ``host_ms`` are fused AdamW's time per 1e9 elements on each side; the exact mode
    steps the host part after backward, and the sum is an upper bound of the two running side by side.
    The streams are simulated, rather than each layer charged a flat cost, because the cost of a copy
    depends on what it can hide behind: a few spaced offloads cost nothing, while offloading nearly every
    layer makes the step as long as the copies.

Note [Planner memory model]
    Device memory is what ``torch.cuda.max_memory_allocated`` reports over a step; the peak is the
    largest of these ``2L + 3`` sums::

        base     = static + Adam state of the parameters stepped on the device (2 x the parameter's bytes)
        fwd_j    = base + sum_{i<j} (held_f(i, j) + w_i if i recomputed) + c_j + F+_j
        fwd_head = base + sum_i (held_b(i, L) + w_i if i recomputed) + out + h + H+f
        bwd_head = base + other_grads + sum_i held_b(i, L) + out + h + H+b
        bwd_j    = base + other_grads + sum_{i>=j} g_i + sum_{i<j} held_b(i, j) + c_{j+1} + act_j + out
        opt      = base + other_grads + sum_i g_i
        held_f(i, j) = a_i (keep), c_i (recompute), c_i + s_i (selective),
                       moved_i + unmoved_i while j <= i + k else unmoved_i
                       (offloaded: released at the entry of layer i + 1 + k)
        held_b(i, j) = held_f(i, L) (keep, recompute, selective), unmoved_i + (moved_i while j <= min(i + p, L-1))
        act_j  = a_j + B+_j (keep, offload);  c_j + R+_j (recompute, recompute_offload);
                 c_j + s_j + S+_j (selective, selective_offload)

    ``c_j``: the layer's tensor inputs that are not static memory (parameters, buffers and the example
    inputs are static), and ``c_{j+1}`` in ``bwd_j`` the gradient of its output (the next layer's input;
    ``c_{L-1}`` for the last layer). ``w_i``: a recomputed layer's weight casts, which
    autocast's cache holds to the end of the forward. ``R+_j`` is measured under non-reentrant
    ``torch.utils.checkpoint``, not derived from ``F+_j`` and ``B+_j``: a rerun holds the layer's input once,
    and its peak is not the plain backward's. Gradients exist only between their backward and the optimizer
    step (``zero_grad(set_to_none=True)``), so in backward only those of layers ``>= j`` and, an upper bound,
    of everything outside the layers. An offloaded layer must be released
    before the last layer's forward (``i + 1 + k <= L-1``), else its copy frees nothing where the peak is:
    such layers may only be kept or recomputed (:func:`allowed_choices`).

    The head (everything the forward runs after the last layer: final norm, LM head) is measured on the
    device in one forward and backward of the model with every layer recomputed (``_measure.py``): ``out``
    the model's outputs, which the training loop holds to the end of the backward; ``h`` what the head
    saves for backward; ``H+f``/``H+b`` its forward transient and the start of the backward's (the output
    gradient, the head's backward) beyond those. With a large vocabulary these are the step's largest
    tensors, and the keep-everything peak sits at ``bwd_head``, not in a layer.

Assumptions (the error bars): saved bytes are produced evenly over a layer's forward; the runtime
also releases a layer early when its D2H is done and paces a one-layer prefetch by half a layer, which
only lowers the real peak; copies do not slow compute (they use copy engines, but also HBM bandwidth);
a layer measured alone, with the host ahead of the device (Note [Timing with the host ahead] in
``_measure.py``), behaves as in the model; the loss is not the planner's to run: the head is
measured with a gradient of ones for the outputs, so a loss's own temporaries (a float32 copy of the
logits, its softmax) are not counted; the embedding before the first layer saves nothing beyond the
first layer's input; optimizer transients are not counted (torch's fused AdamW steps in place).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence, get_args

from annotate_offload.annotate._plan import OFFLOADED, RECOMPUTED, SELECTIVE, Choice

__all__ = ["CHOICES", "LayerMeasurement", "StepMeasurement", "LinkBandwidth", "Prediction", "allowed_choices",
           "predict"]

#: The per-layer choices, in the order used for tie-breaking (least intrusive first: ``Choice``'s order).
CHOICES: tuple[str, ...] = get_args(Choice)
ON_DEVICE: tuple[str, ...] = tuple(c for c in CHOICES if c not in OFFLOADED)  # the choices without copies


def _check_number(owner: str, name: str, value: object, *, positive: bool = False, low: float = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{owner}: {name} must be a finite number, got {value!r}.")
    if value < low or (positive and value == 0):
        bound = "> 0" if positive else f">= {low}"
        raise ValueError(f"{owner}: {name} must be {bound}, got {value!r}; pass the measured value.")


@dataclass(frozen=True)
class LayerMeasurement:
    """What one layer costs, measured once (or written by hand in tests).

    Attributes:
        forward_ms (float): forward time of the layer, ms.
        backward_ms (float): backward time of the layer (without recompute), ms.
        saved_bytes (int): bytes of the unique storages the layer saves for backward (parameters
            excluded), i.e. what ``keep`` holds on the GPU and ``offload`` copies.
        checkpoint_input_bytes (int): bytes of the layer's tensor inputs, i.e. what ``recompute``
            holds and ``recompute_offload`` copies.
        name (str): the layer's qualified name, for the plan table. Default: ``""``.
        unmoved_bytes (int): the part of ``saved_bytes`` that ``offload`` leaves on the GPU (saved
            tensors under the runtime's ``min_offload_numel``). Default: ``0``.
        unmoved_input_bytes (int): the part of ``checkpoint_input_bytes`` that ``recompute_offload``
            leaves on the GPU. Default: ``0``.
        unmoved_selective_bytes (int): the part of ``selective_bytes`` that ``selective_offload`` leaves
            on the GPU. Default: ``0``.
        forward_peak_bytes (int): ``F+``: device bytes the forward allocates at its peak (its saved
            tensors, output and temporaries), beyond its inputs. Default: ``0``.
        backward_peak_bytes (int): ``B+``: device bytes the backward allocates at its peak beyond its
            saved tensors and output gradient, its parameter gradients excluded (at least ``-grad_bytes``:
            negative when the peak comes after it freed saved tensors). Default: ``0``.
        grad_bytes (int): ``g``: bytes of the layer's parameter gradients. Default: ``0``.
        cast_bytes (int): ``w``: the part of ``saved_bytes`` that is autocast's casts of weights: the
            runtime never offloads them (they are in ``unmoved_bytes``), and autocast's cache holds them
            to the end of the forward even when the layer is recomputed. Default: ``0``.
        recompute_ms (float | None): the backward time when recomputed (its forward rerun, then its
            backward), ms, at least ``backward_ms``. Default: ``None``, ``forward_ms + backward_ms``.
        recompute_peak_bytes (int | None): ``R+``: as ``backward_peak_bytes``, for that backward under
            non-reentrant ``torch.utils.checkpoint``, beyond the checkpoint input and output gradient.
            Default: ``None``, ``max(forward_peak_bytes, saved_bytes + backward_peak_bytes)``.
        selective_bytes (int | None): ``s``: what a selective recompute keeps beyond the checkpoint input
            (the outputs of matrix multiplies and attention). Default: ``None``, ``saved_bytes``.
        selective_ms (float | None): the backward time when recomputed selectively, plus what its forward
            takes beyond ``forward_ms``, ms, at least ``backward_ms``. Default: ``None``, ``recompute_ms``.
        selective_peak_bytes (int | None): ``S+``: as ``recompute_peak_bytes``, beyond the checkpoint input,
            ``s`` and the output gradient. Default: ``None``, ``recompute_peak_bytes``.

    Raises:
        TypeError, ValueError: a field that is not a finite number, or one below its bound (0; for the
            backward peaks ``-grad_bytes``; for ``recompute_ms`` and ``selective_ms``, ``backward_ms``).
    """

    forward_ms: float
    backward_ms: float
    saved_bytes: int
    checkpoint_input_bytes: int
    name: str = ""
    unmoved_bytes: int = 0
    unmoved_input_bytes: int = 0
    unmoved_selective_bytes: int = 0
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    grad_bytes: int = 0
    cast_bytes: int = 0
    recompute_ms: float | None = None
    recompute_peak_bytes: int | None = None
    selective_bytes: int | None = None
    selective_ms: float | None = None
    selective_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in ("forward_ms", "backward_ms", "saved_bytes", "checkpoint_input_bytes", "unmoved_bytes",
                      "unmoved_input_bytes", "unmoved_selective_bytes", "forward_peak_bytes", "grad_bytes",
                      "cast_bytes"):
            _check_number("LayerMeasurement", field, getattr(self, field))
        _check_number("LayerMeasurement", "backward_peak_bytes", self.backward_peak_bytes, low=-self.grad_bytes)
        if self.recompute_ms is None:
            object.__setattr__(self, "recompute_ms", self.forward_ms + self.backward_ms)
        if self.recompute_peak_bytes is None:
            object.__setattr__(self, "recompute_peak_bytes",
                               max(self.forward_peak_bytes, self.saved_bytes + self.backward_peak_bytes))
        for field, default in (("selective_bytes", self.saved_bytes), ("selective_ms", self.recompute_ms),
                               ("selective_peak_bytes", self.recompute_peak_bytes)):
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        _check_number("LayerMeasurement", "selective_bytes", self.selective_bytes)
        for field in ("recompute_ms", "selective_ms"):
            _check_number("LayerMeasurement", field, getattr(self, field), low=self.backward_ms)
        for field in ("recompute_peak_bytes", "selective_peak_bytes"):
            _check_number("LayerMeasurement", field, getattr(self, field), low=-self.grad_bytes)
        for part, whole in (("unmoved_bytes", "saved_bytes"), ("unmoved_input_bytes", "checkpoint_input_bytes"),
                            ("unmoved_selective_bytes", "selective_bytes")):
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(
                    f"LayerMeasurement: {part}={getattr(self, part)} exceeds {whole}={getattr(self, whole)}; it is "
                    "the part of those bytes that an offloaded layer leaves on the GPU."
                )
        if not isinstance(self.name, str):
            raise TypeError(f"LayerMeasurement: name must be a str, got {type(self.name).__name__}.")

    def terms(self, choice: str) -> tuple[int, float, int]:
        """``(bytes held from its forward to its backward, backward ms, backward peak beyond them)`` under
        ``choice``, before any offload (Note [Planner memory model]: ``a, b, B+``; ``c, r, R+``; ``c + s, sr, S+``)."""
        if choice in SELECTIVE:
            return self.checkpoint_input_bytes + self.selective_bytes, self.selective_ms, self.selective_peak_bytes
        if choice in RECOMPUTED:
            return self.checkpoint_input_bytes, self.recompute_ms, self.recompute_peak_bytes
        return self.saved_bytes, self.backward_ms, self.backward_peak_bytes

    def moved_bytes(self, choice: str) -> int:
        """Bytes ``choice`` (one of ``OFFLOADED``) copies out and back: the saved tensors (``offload``), the
        checkpoint inputs (``recompute_offload``), and what a selective recompute keeps (``selective_offload``),
        less what stays on the GPU."""
        if choice == "offload":
            return self.saved_bytes - self.unmoved_bytes
        moved = self.checkpoint_input_bytes - self.unmoved_input_bytes
        return moved + self.selective_bytes - self.unmoved_selective_bytes if choice in SELECTIVE else moved


@dataclass(frozen=True)
class StepMeasurement:
    """What the step costs outside the layers' choices (all defaults: nothing).

    Attributes:
        static_bytes (int): device bytes before a step: weights, buffers, inputs (not gradients).
        other_grad_bytes (int): bytes of the gradients of trainable parameters outside the layers.
        other_ms (float): forward plus backward time outside the layers, ms.
        param_numels (tuple[int, ...]): the optimizer's trainable parameters, in the order its split
            takes them (``model.parameters()``); empty: no optimizer.
        param_state_bytes (tuple[int, ...]): per parameter, its Adam state bytes (two moments).
        device_ms (float): fused AdamW on the device, ms per 1e9 elements.
        host_ms (float): fused AdamW on the host, ms per 1e9 elements.
        output_bytes (int): the model's outputs (e.g. logits): made at the end of the forward and held,
            by the training loop's reference, to the end of the backward.
        head_saved_bytes (int): what the forward after the last layer (final norm, LM head; the "head")
            saves for backward, parameters and outputs excluded; freed by the head's backward.
        head_forward_peak_bytes (int): the head's forward transient: its peak beyond what it leaves held.
        head_backward_peak_bytes (int): the start of the backward, up to the last layer's output gradient:
            its peak beyond the head's saved tensors and the outputs (the output gradient, the head's
            backward temporaries), gradients of parameters outside the layers excluded.

    Raises:
        TypeError, ValueError: a negative or non-finite number, or tuples of different lengths.
    """

    static_bytes: int = 0
    other_grad_bytes: int = 0
    other_ms: float = 0.0
    param_numels: tuple = ()
    param_state_bytes: tuple = ()
    device_ms: float = 0.0
    host_ms: float = 0.0
    output_bytes: int = 0
    head_saved_bytes: int = 0
    head_forward_peak_bytes: int = 0
    head_backward_peak_bytes: int = 0

    def __post_init__(self) -> None:
        for field in ("static_bytes", "other_grad_bytes", "other_ms", "device_ms", "host_ms", "output_bytes",
                      "head_saved_bytes", "head_forward_peak_bytes", "head_backward_peak_bytes"):
            _check_number("StepMeasurement", field, getattr(self, field))
        if len(self.param_numels) != len(self.param_state_bytes):
            raise ValueError("StepMeasurement: param_numels and param_state_bytes need one entry per parameter.")
        object.__setattr__(self, "param_numels", tuple(self.param_numels))
        object.__setattr__(self, "param_state_bytes", tuple(self.param_state_bytes))

    def host_tensors(self, offload_fraction: float) -> int:
        """How many leading parameters ``HybridDeviceOptimizer(offload_fraction=f)`` steps on the host:
        it takes them while the numel taken so far is below ``f`` x the total."""
        budget, done = offload_fraction * sum(self.param_numels), 0
        for m, n in enumerate(self.param_numels):
            if done >= budget:
                return m
            done += n
        return len(self.param_numels)

    def fraction(self, host_tensors: int) -> float:
        """An ``offload_fraction`` that steps exactly the first ``host_tensors`` parameters on the host: halfway
        between the shares with one fewer and with these, so that rounding cannot take one more."""
        if host_tensors == 0 or host_tensors == len(self.param_numels):
            return float(host_tensors > 0)
        low, high = sum(self.param_numels[:host_tensors - 1]), sum(self.param_numels[:host_tensors])
        return (low + high) / 2 / sum(self.param_numels)

    def optimizer(self, host_tensors: int) -> tuple[int, float]:
        """``(Adam state bytes left on the device, optimizer ms)`` with the first ``host_tensors`` on the host."""
        host = sum(self.param_numels[:host_tensors])
        device = sum(self.param_numels) - host
        return sum(self.param_state_bytes[host_tensors:]), (device * self.device_ms + host * self.host_ms) / 1e9

    def fewest_host_tensors(self, excess: int) -> int | None:
        """The fewest leading parameters whose state moved to the host frees ``excess`` bytes (``None``: none do)."""
        if excess <= 0:
            return 0
        cumulative = list(itertools.accumulate(self.param_state_bytes, initial=0))
        m = bisect.bisect_left(cumulative, excess)
        return m if m < len(cumulative) else None


@dataclass(frozen=True)
class LinkBandwidth:
    """Host link bandwidth, GB/s (1 GB = 1e9 bytes).

    Attributes:
        d2h_gbps (float): device-to-host copy bandwidth into pinned memory, GB/s.
        h2d_gbps (float): host-to-device copy bandwidth from pinned memory, GB/s.
        source (str): how the figures were obtained. Default: ``"given"``.

    Raises:
        TypeError, ValueError: a bandwidth that is not a finite positive number.
    """

    d2h_gbps: float
    h2d_gbps: float
    source: str = "given"

    def __post_init__(self) -> None:
        _check_number("LinkBandwidth", "d2h_gbps", self.d2h_gbps, positive=True)
        _check_number("LinkBandwidth", "h2d_gbps", self.h2d_gbps, positive=True)

    def d2h_ms(self, nbytes: float) -> float:
        """Milliseconds to copy ``nbytes`` bytes device to host."""
        return nbytes / (self.d2h_gbps * 1e6)

    def h2d_ms(self, nbytes: float) -> float:
        """Milliseconds to copy ``nbytes`` bytes host to device."""
        return nbytes / (self.h2d_gbps * 1e6)


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` returns.

    Attributes:
        step_ms (float): predicted step time (layers, the rest, the optimizer), ms.
        peak_bytes (int): predicted peak device memory, bytes.
        layer_ms (tuple[float, ...]): per layer, its forward plus backward time with waits and recompute, ms.
        layer_peak_bytes (tuple[int, ...]): per layer, the peak device memory during its forward or backward.
        optimizer_ms (float): the optimizer's part of ``step_ms``, ms.
        offload_fraction (float): the optimizer split, ``HybridDeviceOptimizer``'s ``offload_fraction``.
    """

    step_ms: float
    peak_bytes: int
    layer_ms: tuple
    layer_peak_bytes: tuple
    optimizer_ms: float = 0.0
    offload_fraction: float = 0.0


def allowed_choices(layer: int, num_layers: int, release_lag: int) -> tuple[str, ...]:
    """The choices layer ``layer`` of ``num_layers`` may take (see Note [Planner memory model]).

    Offloading needs the release point ``layer + 1 + release_lag`` to be at most the last layer.
    """
    return CHOICES if layer + 1 + release_lag <= num_layers - 1 else ON_DEVICE


def check_schedule(who: str, release_lag: Any, prefetch_layers: Any) -> None:
    """``release_lag`` None or an int >= 0, ``prefetch_layers`` None or an int >= 1, else ``ValueError``."""
    for name, value, low in (("release_lag", release_lag, 0), ("prefetch_layers", prefetch_layers, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{who}: {name} must be None or an int >= {low}, got {value!r}.")


def validate(layers: Sequence[LayerMeasurement], choices: Sequence[str], release_lag: int, prefetch_layers: int):
    if len(choices) != len(layers):
        raise ValueError(f"predict: choices has {len(choices)} entries for {len(layers)} layers; give one per layer.")
    check_schedule("predict", release_lag, prefetch_layers)
    for i, c in enumerate(choices):
        if c not in CHOICES:
            raise ValueError(f"predict: choices[{i}]={c!r} is not one of {CHOICES}.")
        if c in OFFLOADED and c not in allowed_choices(i, len(layers), release_lag):
            raise ValueError(
                f"predict: choices[{i}]={c!r} but layer {i} of {len(layers)} cannot be released before the last "
                f"layer's forward with release_lag={release_lag}; keep or recompute it (one of {ON_DEVICE})."
            )


def simulate(layers, choices, bandwidth, step, release_lag, prefetch_layers):
    """``(layers' ms, peak bytes without the device's Adam state, per-layer ms, per-layer peaks without it)``:
    the two Notes above, with the optimizer's part left to :func:`with_optimizer`."""
    n, k, p = len(layers), release_lag, prefetch_layers
    off = [c in OFFLOADED for c in choices]
    rec = [c in RECOMPUTED for c in choices]
    moved = [m.moved_bytes(c) if o else 0 for m, c, o in zip(layers, choices, off)]
    whole, backward_ms, backward_peak = zip(*(m.terms(c) for m, c in zip(layers, choices)))
    kept = [w - moved[i] for i, w in enumerate(whole)]  # what a layer holds once released (all, if not offloaded)
    cached = [m.cast_bytes if rec[i] else 0 for i, m in enumerate(layers)]  # autocast's casts, to the end of forward

    # --- time (Note [Planner time model]) ---
    t = d2h_free = h2d_free = 0.0
    d2h_end, h2d_end, layer_ms = [0.0] * n, [0.0] * n, [0.0] * n
    for j in range(n):
        start = t
        i = j - 1 - k
        if i >= 0 and off[i]:
            t = max(t, d2h_end[i])
        begin = t
        t += layers[j].forward_ms
        if off[j]:
            d2h_free = d2h_end[j] = max(t, max(begin, d2h_free) + bandwidth.d2h_ms(moved[j]))
        layer_ms[j] = t - start
    reload_at: dict[int, list[int]] = {}
    for i in range(n - 1, -1, -1):
        if off[i]:
            reload_at.setdefault(min(i + p, n - 1), []).append(i)
    for j in range(n - 1, -1, -1):
        start = t
        for i in reload_at.get(j, ()):
            h2d_free = h2d_end[i] = max(t, h2d_free, d2h_end[i]) + bandwidth.h2d_ms(moved[i])
        if off[j]:
            t = max(t, h2d_end[j])
        t += backward_ms[j]
        layer_ms[j] += t - start

    # --- memory (Note [Planner memory model]) ---
    # grads_above[j] = sum of g_i over i >= j
    grads_above = list(itertools.accumulate((m.grad_bytes for m in reversed(layers)), initial=0))[::-1]
    held_before = cached_before = 0  # sums over i < j of what layer i holds once released, and of casts
    peaks = []
    for j, m in enumerate(layers):
        in_flight_f = sum(moved[i] for i in range(max(0, j - k), j))
        fwd = held_before + cached_before + in_flight_f + m.checkpoint_input_bytes + m.forward_peak_bytes
        in_flight_b = sum(moved[i] for i in range(max(0, j - p), j))  # reloads started at the entry of i + p
        act = whole[j] + backward_peak[j]
        grad_out = layers[min(j + 1, n - 1)].checkpoint_input_bytes  # the next layer's input
        bwd = step.other_grad_bytes + grads_above[j] + held_before + in_flight_b + grad_out + act + step.output_bytes
        peaks.append(step.static_bytes + max(fwd, bwd))
        held_before += kept[j]
        cached_before += cached[j]
    head = step.output_bytes + step.head_saved_bytes
    head_fwd = held_before + cached_before + head + step.head_forward_peak_bytes
    head_bwd = held_before + step.other_grad_bytes + head + step.head_backward_peak_bytes
    opt = step.static_bytes + step.other_grad_bytes + grads_above[0]
    return (t + step.other_ms, max(peaks + [opt, step.static_bytes + max(head_fwd, head_bwd)]), tuple(layer_ms),
            tuple(peaks))


def with_optimizer(sim, step: StepMeasurement, host_tensors: int) -> Prediction:
    """The :class:`Prediction` of a simulated plan with the first ``host_tensors`` parameters on the host."""
    layers_ms, peak, layer_ms, layer_peaks = sim
    state, opt_ms = step.optimizer(host_tensors)
    return Prediction(step_ms=layers_ms + opt_ms, peak_bytes=int(peak + state), layer_ms=layer_ms,
                      layer_peak_bytes=tuple(int(b + state) for b in layer_peaks), optimizer_ms=opt_ms,
                      offload_fraction=step.fraction(host_tensors))


def predict(
    layers: Sequence[LayerMeasurement],
    choices: Sequence[str],
    bandwidth: LinkBandwidth,
    step: StepMeasurement | None = None,
    *,
    release_lag: int = 1,
    prefetch_layers: int = 1,
    offload_fraction: float = 0.0,
) -> Prediction:
    """Predict step time and peak device memory of a plan (Notes [Planner time/memory model]).

    Args:
        layers (Sequence[LayerMeasurement]): per layer, in forward order.
        choices (Sequence[str]): per layer, one of :data:`CHOICES`.
        bandwidth (LinkBandwidth): the host link.
        step (StepMeasurement | None): the rest of the step. Default: ``None`` (nothing: layers only).
        release_lag (int): an offloaded layer ``i`` is released at the entry of layer ``i + 1 + k``. Default: ``1``.
        prefetch_layers (int): layer ``i`` is reloaded when backward enters layer ``i + p``. Default: ``1``.
        offload_fraction (float): ``HybridDeviceOptimizer``'s split, in ``[0, 1]``. Default: ``0.0``.

    Returns:
        Prediction: step time (ms), peak bytes, per layer time and peak.

    Raises:
        ValueError: choices of the wrong length or value, an offload the schedule cannot release,
            ``release_lag < 0``, ``prefetch_layers < 1`` or a fraction outside ``[0, 1]``.
    """
    validate(layers, choices, release_lag, prefetch_layers)
    if not 0 <= offload_fraction <= 1:
        raise ValueError(f"predict: offload_fraction must be in [0, 1], got {offload_fraction!r}.")
    step = StepMeasurement() if step is None else step
    sim = simulate(tuple(layers), tuple(choices), bandwidth, step, release_lag, prefetch_layers)
    return with_optimizer(sim, step, step.host_tensors(offload_fraction))
