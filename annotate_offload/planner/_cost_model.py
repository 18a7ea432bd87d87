"""The planner's cost model: predicted step time and peak activation memory of a per-layer plan.

A plan assigns each of the ``L`` layers (in forward order ``0..L-1``) one of :data:`CHOICES`:

``keep``
    saved activations stay on the GPU from the layer's forward to its backward.
``offload``
    saved activations are copied to host (D2H) on a side stream after the layer's forward and
    released; they are prefetched back (H2D) during the backward of a later layer.
``recompute``
    the layer runs under ``torch.utils.checkpoint``: only its input (the checkpoint input) is kept;
    backward reruns the layer's forward, then its backward.
``recompute_offload``
    ``recompute``, with the checkpoint input offloaded and prefetched like ``offload``.

Inputs (all measured, see :func:`~annotate_offload.planner._measure.measure_layers` and
:func:`~annotate_offload.planner._bandwidth.measure_bandwidth`): per layer ``i`` forward time ``f_i`` and backward
time ``b_i`` (ms), saved-activation bytes ``a_i`` and checkpoint-input bytes ``c_i``; the link's D2H and
H2D bandwidth (GB/s, 1 GB = 1e9 bytes), so a copy of ``n`` bytes takes ``n / (GB/s * 1e6)`` ms.

Schedule (the runtime's: ``DefaultOffloadSynchronizer(offloaded_layers=..., release_lag=k,
prefetch_layers=p)``). Defaults ``k = 1``, ``p = 1``: a layer's copy may hide behind the
forward of the one layer after it, and its reload behind the backward of the one layer after it.

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
            if j recomputed: t += f_j                              # recompute adds the layer's forward
            t += b_j
        step_ms = t

    with ``bytes_j = a_j`` for ``offload`` and ``c_j`` for ``recompute_offload``. The runtime starts each
    D2H when the tensor is saved; the model takes the saved bytes as produced evenly over the layer's
    forward, so a layer's D2H ends when its forward ends if the link keeps up, else ``bytes / D2H`` after
    it could start. A copy therefore hides behind compute (its own layer's and the next ones') and
    delays the step only by what the compute stream waits for: a D2H that cannot hide delays the
    forward at the release point, a late H2D delays the backward.

Note [Planner memory model]
    Saved-for-backward bytes resident at the end of forward of layer ``j`` (``F_j``) and during the
    backward of layer ``j`` (``B_j``); the predicted peak is the largest of these ``2L`` sums::

        F_j = sum_{i<=j} fwd(i, j)    fwd(i, j) = a_i (keep), c_i (recompute),
                                                  a_i or c_i while j <= i + k, else 0 (offloaded: released
                                                  at the entry of layer i + 1 + k)
        B_j = sum_{i<j} (kept(i) + prefetched(i, j)) + own(j)
              kept(i)  = a_i (keep), c_i (recompute), 0 (offloaded: released in forward)
              prefetched(i, j) = a_i or c_i if i is offloaded and j <= min(i + p, L-1)
              own(j)   = a_j (keep, offload), a_j + c_j (recompute, recompute_offload)

    An offloaded layer must be released before the last layer's forward (``i + 1 + k <= L-1``), else its
    copy frees nothing at the forward/backward turn where the peak is; such layers may only be kept or
    recomputed (:func:`allowed_choices`).

Assumptions (what the model leaves out, so its error bars): saved bytes are produced evenly over a
layer's forward; the runtime also releases a layer early when its D2H is done, which only lowers the
real peak below the predicted one; copies do not slow
compute (they use copy engines, but also HBM bandwidth); activation gradients, temporaries and
workspace are not activation memory here (only saved-for-backward bytes); the checkpoint input is
counted apart from the recomputed activations (an upper bound when the layer also saves its input);
every byte of an offloaded layer moves (the runtime keeps tensors below ``min_offload_numel``);
everything outside the layers (embedding, head, loss, optimizer) adds the same time to every plan.
The streams are simulated rather than each offloaded layer charged a flat cost because the cost of a
copy depends on what it can hide behind: a few offloaded layers cost little, while offloading nearly
every layer makes the step as long as the copies, far more than the sum of per-layer costs suggests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["CHOICES", "LayerMeasurement", "LinkBandwidth", "Prediction", "allowed_choices", "predict"]

#: The per-layer choices, in the order used for tie-breaking (least intrusive first).
CHOICES: tuple[str, ...] = ("keep", "offload", "recompute", "recompute_offload")
_OFFLOADED = frozenset({"offload", "recompute_offload"})
_RECOMPUTED = frozenset({"recompute", "recompute_offload"})


def _check_number(owner: str, name: str, value: object, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{owner}: {name} must be a finite number, got {value!r}.")
    if value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
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
        unmoved_bytes (int): the part of ``saved_bytes`` that ``offload`` leaves on the GPU: saved
            tensors under the runtime's ``min_offload_numel`` (their storages not also saved by a
            larger tensor). Default: ``0``.
        unmoved_input_bytes (int): the part of ``checkpoint_input_bytes`` that ``recompute_offload``
            leaves on the GPU (inputs under ``min_offload_numel``). Default: ``0``.

    Raises:
        TypeError, ValueError: a field that is not a finite non-negative number.
    """

    forward_ms: float
    backward_ms: float
    saved_bytes: int
    checkpoint_input_bytes: int
    name: str = ""
    unmoved_bytes: int = 0
    unmoved_input_bytes: int = 0

    def __post_init__(self) -> None:
        for field in ("forward_ms", "backward_ms", "saved_bytes", "checkpoint_input_bytes", "unmoved_bytes",
                      "unmoved_input_bytes"):
            _check_number("LayerMeasurement", field, getattr(self, field))
        for part, whole in (("unmoved_bytes", "saved_bytes"), ("unmoved_input_bytes", "checkpoint_input_bytes")):
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(
                    f"LayerMeasurement: {part}={getattr(self, part)} exceeds {whole}={getattr(self, whole)}; it is "
                    "the part of those bytes that an offloaded layer leaves on the GPU."
                )
        if not isinstance(self.name, str):
            raise TypeError(f"LayerMeasurement: name must be a str, got {type(self.name).__name__}.")

    def moved_bytes(self, recompute: bool) -> int:
        """Bytes offloading this layer copies out and back: its saved tensors (``offload``) or its
        checkpoint inputs (``recompute_offload``, ``recompute=True``), less what stays on the GPU."""
        if recompute:
            return self.checkpoint_input_bytes - self.unmoved_input_bytes
        return self.saved_bytes - self.unmoved_bytes


@dataclass(frozen=True)
class LinkBandwidth:
    """Host link bandwidth, GB/s (1 GB = 1e9 bytes).

    Attributes:
        d2h_gbps (float): device-to-host copy bandwidth into pinned memory, GB/s.
        h2d_gbps (float): host-to-device copy bandwidth from pinned memory, GB/s.
        source (str): how the figures were obtained (e.g. ``"measured cuda:0 pinned, 256 MiB"``).
            Default: ``"given"``.

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
        step_ms (float): predicted time of the layers' forward plus backward, ms.
        peak_bytes (int): predicted peak of saved-for-backward bytes on the GPU.
        d2h_stall_ms (tuple[float, ...]): per layer, how long forward waited for its D2H, ms.
        h2d_stall_ms (tuple[float, ...]): per layer, how long backward waited for its H2D, ms.
        copy_ms (tuple[float, ...]): per layer, D2H plus H2D time of its copies, ms (0 if not offloaded).
    """

    step_ms: float
    peak_bytes: int
    d2h_stall_ms: tuple[float, ...]
    h2d_stall_ms: tuple[float, ...]
    copy_ms: tuple[float, ...]


def allowed_choices(layer: int, num_layers: int, release_lag: int) -> tuple[str, ...]:
    """The choices layer ``layer`` of ``num_layers`` may take (see Note [Planner memory model]).

    Offloading needs the release point ``layer + 1 + release_lag`` to be at most the last layer.
    """
    if layer + 1 + release_lag <= num_layers - 1:
        return CHOICES
    return ("keep", "recompute")


def check_schedule(who: str, release_lag: Any, prefetch_layers: Any) -> None:
    """``release_lag`` an int >= 0 and ``prefetch_layers`` an int >= 1, else ``ValueError`` naming ``who``."""
    if isinstance(release_lag, bool) or not isinstance(release_lag, int) or release_lag < 0:
        raise ValueError(f"{who}: release_lag must be an int >= 0, got {release_lag!r}.")
    if isinstance(prefetch_layers, bool) or not isinstance(prefetch_layers, int) or prefetch_layers < 1:
        raise ValueError(f"{who}: prefetch_layers must be an int >= 1, got {prefetch_layers!r}.")


def _validate(layers: Sequence[LayerMeasurement], choices: Sequence[str], release_lag: int, prefetch_layers: int):
    if len(choices) != len(layers):
        raise ValueError(f"predict: choices has {len(choices)} entries for {len(layers)} layers; give one per layer.")
    check_schedule("predict", release_lag, prefetch_layers)
    for i, c in enumerate(choices):
        if c not in CHOICES:
            raise ValueError(f"predict: choices[{i}]={c!r} is not one of {CHOICES}.")
        if c in _OFFLOADED and c not in allowed_choices(i, len(layers), release_lag):
            raise ValueError(
                f"predict: choices[{i}]={c!r} but layer {i} of {len(layers)} cannot be released before the last "
                f"layer's forward with release_lag={release_lag}; keep or recompute it."
            )


def predict(
    layers: Sequence[LayerMeasurement],
    choices: Sequence[str],
    bandwidth: LinkBandwidth,
    *,
    release_lag: int = 1,
    prefetch_layers: int = 1,
    _validated: bool = False,
) -> Prediction:
    """Predict step time and peak activation memory of a plan (Notes [Planner time/memory model]).

    Args:
        layers (Sequence[LayerMeasurement]): per layer, in forward order.
        choices (Sequence[str]): per layer, one of :data:`CHOICES`.
        bandwidth (LinkBandwidth): the host link.
        release_lag (int): the runtime's ``release_lag`` ``k``: an offloaded layer ``i`` is released at
            the entry of layer ``i + 1 + k``. Default: ``1``.
        prefetch_layers (int): the runtime's ``prefetch_layers`` ``p``: layer ``i`` is reloaded when
            backward enters layer ``i + p``. Default: ``1``.

    Returns:
        Prediction: step time (ms), peak saved bytes and per-layer stalls.

    Raises:
        ValueError: choices of the wrong length or value, an offload the schedule cannot release,
            ``release_lag < 0`` or ``prefetch_layers < 1``.
    """
    if not _validated:
        _validate(layers, choices, release_lag, prefetch_layers)
    n = len(layers)
    off = [c in _OFFLOADED for c in choices]
    rec = [c in _RECOMPUTED for c in choices]
    # what an offloaded layer still holds on the GPU: its saved tensors under min_offload_numel
    stays = [(m.unmoved_input_bytes if rec[i] else m.unmoved_bytes) if off[i] else 0 for i, m in enumerate(layers)]
    moved = [m.moved_bytes(rec[i]) if off[i] else 0 for i, m in enumerate(layers)]
    fwd_bytes = [m.checkpoint_input_bytes if rec[i] else m.saved_bytes for i, m in enumerate(layers)]

    # --- time (Note [Planner time model]) ---
    t = 0.0
    d2h_free = h2d_free = 0.0
    d2h_end = [0.0] * n
    h2d_end = [0.0] * n
    d2h_stall = [0.0] * n
    h2d_stall = [0.0] * n
    for j in range(n):
        i = j - 1 - release_lag
        if i >= 0 and off[i] and d2h_end[i] > t:
            d2h_stall[i] = d2h_end[i] - t
            t = d2h_end[i]
        start = t
        t += layers[j].forward_ms
        if off[j]:
            d2h_free = max(t, max(start, d2h_free) + bandwidth.d2h_ms(moved[j]))
            d2h_end[j] = d2h_free
    reload_at: dict[int, list[int]] = {}
    for i in range(n - 1, -1, -1):
        if off[i]:
            reload_at.setdefault(min(i + prefetch_layers, n - 1), []).append(i)
    for j in range(n - 1, -1, -1):
        for i in reload_at.get(j, ()):
            h2d_free = max(t, h2d_free, d2h_end[i]) + bandwidth.h2d_ms(moved[i])
            h2d_end[i] = h2d_free
        if off[j] and h2d_end[j] > t:
            h2d_stall[j] = h2d_end[j] - t
            t = h2d_end[j]
        if rec[j]:
            t += layers[j].forward_ms
        t += layers[j].backward_ms

    # --- memory (Note [Planner memory model]) ---
    kept = [stays[i] if off[i] else fwd_bytes[i] for i in range(n)]
    prefix = [0] * (n + 1)  # prefix[j] = sum over i < j of kept(i)
    for i in range(n):
        prefix[i + 1] = prefix[i] + kept[i]
    peak = 0
    for j in range(n):
        in_flight = sum(moved[i] for i in range(max(0, j - release_lag), j + 1))
        peak = max(peak, prefix[j + 1] + in_flight)
    for j in range(n):
        total = prefix[j]
        for i in range(max(0, j - prefetch_layers), j):
            if off[i] and j <= min(i + prefetch_layers, n - 1):
                total += moved[i]
        m = layers[j]
        total += m.saved_bytes + (m.checkpoint_input_bytes if rec[j] else 0)
        peak = max(peak, total)

    copy_ms = tuple(bandwidth.d2h_ms(moved[i]) + bandwidth.h2d_ms(moved[i]) if off[i] else 0.0 for i in range(n))
    return Prediction(
        step_ms=t,
        peak_bytes=int(peak),
        d2h_stall_ms=tuple(d2h_stall),
        h2d_stall_ms=tuple(h2d_stall),
        copy_ms=copy_ms,
    )
