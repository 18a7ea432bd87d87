"""Activation-offload benchmark of issue 7 (W1 PCIe-bound, W2 compute-bound), all in one run.

For each workload it measures, in this order and in one process: pinned D2H/H2D bandwidth
(1 GiB copies), the baseline (T_fwd, T_bwd, step time, activation memory), annotate_offload
through ``get_cpu_offload_context`` and through ``DefaultOffloadSynchronizer`` with each
``release_lag`` x ``prefetch_layers`` setting, through ``offload_transform`` (the declarative
path, with the leanest knobs within 5% of the fastest of that grid), ``save_on_cpu(pin_memory=True)``, full
recompute (``torch.utils.checkpoint``, non-reentrant) of the same layers, and TRL's/torchtune's
``OffloadActivations`` when importable. Then it computes the copy floor::

    floor = max(T_fwd, bytes / BW_d2h) + max(T_bwd, bytes / BW_h2d)

with ``bytes`` = the runtime's ``OffloadStats.bytes_offloaded`` (or, before the runtime lands,
the saved-tensor bytes of the offloaded layers) and reports ratios first. Step times are CUDA
event medians after warm-up; activation memory is the peak allocated during a step minus the
allocation before it. Each method's forward output and gradients are also compared bit for bit
with the baseline's (one extra step, with a bit-reproducible SDPA backend on CUDA).

Run: ``annotate-offload bench activations [--tiny] [--out DIR] [--profile]``.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import os
import shutil
from dataclasses import dataclass, field

import torch

from annotate_offload.bench import _methods
from annotate_offload.bench._peers import (
    load_megatron_hybrid_device_optimizer,
    load_offload_activations,
    load_torchao_cpu_offload_optimizer,
)
from annotate_offload.bench._timing import GiB, Bandwidth, StepTimes, copy_bandwidth, free_memory, time_steps
from annotate_offload.bench._workloads import (
    TINY_WORKLOADS, W1_FLOOR_RATIO, W1_TRL_SPEEDUP, W2_BASELINE_RATIO, WORKLOADS, Workload, build,
)

__all__ = ["MethodResult", "WorkloadReport", "run_workload", "device_name"]


@dataclass
class MethodResult:
    """One row of the table.

    Attributes:
        name (str): method name.
        kind (str): ``"baseline"``, ``"ours"`` or ``"peer"``.
        detail (str): its configuration, or why it did not run.
        times (StepTimes | None): measurements; ``None`` when it did not run.
        offloaded_bytes (int | None): D2H bytes per step reported by the method (ours only).
        exact (str): ``"yes"``/``"no"``: output and grads bit-identical to the baseline's.
        error (str | None): ``"not run: ..."`` (peer not importable, no accelerator) or ``"failed: ..."``.
    """

    name: str
    kind: str
    detail: str = ""
    times: StepTimes | None = None
    offloaded_bytes: int | None = None
    exact: str = "-"
    error: str | None = None
    make: object = field(default=None, repr=False)


@dataclass
class WorkloadReport:
    """Everything one workload's run measured (see :mod:`annotate_offload.bench._report`).

    Attributes:
        workload (Workload): what ran.
        device (str): GPU name, or ``"cpu"``.
        torch_version (str): ``torch.__version__``.
        command (str): the command line that produced it.
        tiny (bool): ``--tiny`` (no timing claims).
        bandwidth (Bandwidth): copy bandwidth measured in this run.
        saved_bytes (int): saved-tensor bytes of the offloaded layers (hook count).
        held_bytes (int): the part of ``saved_bytes`` that is the workload's input, which the caller
            holds through the step: no activation offload frees it.
        floor_bytes (int): bytes used in the floor; ``floor_bytes_source`` says whose.
        results (list[MethodResult]): baseline first.
        peers (list[str]): import status of every peer (W3 peers included).
        profile_files (list[str]): files written by ``--profile``.
    """

    workload: Workload
    device: str
    torch_version: str
    command: str
    tiny: bool
    bandwidth: Bandwidth
    saved_bytes: int
    floor_bytes: int
    floor_bytes_source: str
    results: list
    peers: list
    profile_files: list = field(default_factory=list)
    held_bytes: int = 0

    @property
    def baseline(self) -> MethodResult:
        """The baseline row."""
        return self.results[0]

    def floor_terms(self) -> tuple[float, float, float, float]:
        """``(T_fwd, bytes/BW_d2h, T_bwd, bytes/BW_h2d)`` in ms."""
        base = self.baseline.times
        return (
            base.fwd,
            self.bandwidth.d2h_ms(self.floor_bytes),
            base.bwd,
            self.bandwidth.h2d_ms(self.floor_bytes),
        )

    @property
    def floor_ms(self) -> float:
        """Copy floor in ms: ``max(T_fwd, bytes/BW_d2h) + max(T_bwd, bytes/BW_h2d)``."""
        f, d2h, b, h2d = self.floor_terms()
        return max(f, d2h) + max(b, h2d)

    def ran(self, kind: str | None = None) -> list:
        """Rows that produced measurements (optionally of one kind)."""
        return [r for r in self.results if r.times is not None and (kind is None or r.kind == kind)]

    @property
    def best_ours(self) -> MethodResult | None:
        """The annotate_offload row the targets are judged on, or ``None`` if none ran.

        Issue 7 asks one configuration to meet the whole target: among the rows within the
        workload's time target (W1: 1.10 x the copy floor; W2: 1.02 x the baseline), and for W1
        also at least 1.4x faster than TRL's ``OffloadActivations`` with no more activation
        memory (when that peer ran), the one with the least activation memory (then the
        fastest). Without such a row: the least-memory row within the time target, else the
        fastest row. (F6, session 8: the TE-API row sat at 1.10x of the floor with the least
        memory, so it was judged, and failed "1.4x faster than TRL" at 1.31x while two other
        rows met all three parts.)
        """
        ours = self.ran("ours")
        if not ours:
            return None
        fastest = min(ours, key=lambda r: r.times.step)
        base = self.baseline
        try:
            limit = W1_FLOOR_RATIO * self.floor_ms if self.workload.name == "W1" else (
                W2_BASELINE_RATIO * base.times.step if base is not None and base.times is not None else None)
        except Exception:  # noqa: BLE001 - no bandwidth measured (tiny runs): no limit
            limit = None
        within = [r for r in ours if limit is not None and r.times.step <= limit and r.times.peak_bytes is not None]
        if not within:
            return fastest
        lean = lambda r: (r.times.peak_bytes, r.times.step)  # noqa: E731
        trl = self.peer("OffloadActivations") if self.workload.name == "W1" else None
        if trl is not None and trl.times.peak_bytes is not None:
            whole = [r for r in within
                     if trl.times.step >= W1_TRL_SPEEDUP * r.times.step and r.times.peak_bytes <= trl.times.peak_bytes]
            if whole:
                return min(whole, key=lean)
        return min(within, key=lean)

    def peer(self, prefix: str) -> MethodResult | None:
        """The measured peer row whose name starts with ``prefix``."""
        return next((r for r in self.ran("peer") if r.name.startswith(prefix)), None)


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on CUDA, else ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _exact_sdpa(device: torch.device):
    # Default SDPA backward (flash/cuDNN) is not bit-reproducible on the H200, and the
    # memory-efficient one only with deterministic algorithms (annotate_offload.testing).
    if device.type != "cuda":
        return contextlib.nullcontext()
    from ..testing import bit_reproducible

    return bit_reproducible()


def _one_step_grads(model, forward, x, grad, device):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    with _exact_sdpa(device):
        out = forward(x)
        torch.autograd.backward(out, grad)
    return out.detach()


_TRANSFORM = object()  # placeholder: resolved once the knob grid has been measured


def _transform_with_best_knobs(results) -> functools.partial:
    """Knobs for the offload_transform row: the leanest (least activation memory, then fastest)
    grid setting within 5% of the fastest one's step time."""
    grid = [r for r in results if r.times is not None and isinstance(r.make, functools.partial)]
    knobs: dict = {}
    if grid:
        fastest = min(r.times.step for r in grid)
        near = [r for r in grid if r.times.step <= 1.05 * fastest]
        knobs = min(near, key=lambda r: (r.times.peak_bytes if r.times.peak_bytes is not None else 0, r.times.step)).make.keywords
    return functools.partial(_methods.make_transform, **knobs)


def _method_list(n: int, release_lags, prefetch_layers):
    methods = [
        ("baseline", "baseline", _methods.make_baseline),
        ("annotate_offload (TE API)", "ours", _methods.make_te_context),
    ]
    for lag in release_lags:
        for pre in prefetch_layers:
            make = functools.partial(_methods.make_synchronizer, release_lag=lag, prefetch_layers=pre)
            methods.append((f"annotate_offload lag={lag} prefetch={pre}", "ours", make))
    methods += [
        ("annotate_offload offload_transform", "ours", _TRANSFORM),  # knobs of the leanest near-fastest row above
        ("save_on_cpu", "peer", _methods.make_save_on_cpu),
        (f"checkpoint ({n} layers)", "peer", _methods.make_checkpoint),
        ("OffloadActivations", "peer", _methods.make_offload_activations),
    ]
    return methods


def _run_method(name, kind, make, model, workload, x, grad, ref, *, device, warmup, steps, log):
    result = MethodResult(name, kind, make=make)
    free_memory(device)
    try:
        runner = make(model, workload.offload, min_offload_numel=workload.min_offload_numel)
    except _methods.Unavailable as exc:
        result.error = f"not run: {exc}"
        return result
    except Exception as exc:
        result.error = f"failed to set up: {type(exc).__name__}: {exc}"
        return result
    result.detail = runner.detail
    try:
        out = _one_step_grads(model, runner.forward, x, grad, device)
        if ref is not None:
            ref_out, ref_grads = ref
            same = torch.equal(out, ref_out) and all(
                torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads)
            )
            result.exact = "yes" if same else "no"
        del out
        result.times = time_steps(
            lambda: runner.forward(x),
            lambda y: torch.autograd.backward(y, grad),
            device=device,
            warmup=warmup,
            steps=steps,
        )
        result.offloaded_bytes = runner.offloaded_bytes()
    except Exception as exc:  # an OOM or a runtime bug must not hide the other rows
        result.error = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        result.times = None
    finally:
        try:
            runner.close()
        except Exception as exc:
            result.error = result.error or f"failed to clean up: {type(exc).__name__}: {exc}"
        del runner
        free_memory(device)
    if log:
        log(f"  {name}: " + (f"{result.times.step:.2f} ms" if result.times else result.error))
    return result


def run_workload(
    workload: Workload,
    *,
    device: torch.device,
    tiny: bool,
    command: str,
    warmup: int = 3,
    steps: int = 10,
    release_lags=(0, 1),
    prefetch_layers=(1, 2),
    bandwidth: Bandwidth | None = None,
    profile_dir: str | None = None,
    log=print,
) -> WorkloadReport:
    """Measure every method on one workload (see the module docstring).

    Args:
        workload (Workload): ``WORKLOADS["W1"]`` etc.
        device (torch.device): ``cuda`` (real run) or ``cpu`` (``--tiny``).
        tiny (bool): marks the report as carrying no timing claims.
        command (str): shown in the report.
        warmup, steps (int): untimed and timed steps per method.
        release_lags, prefetch_layers: the knob grid for ``DefaultOffloadSynchronizer``
            (``None`` = the TE schedule).
        bandwidth (Bandwidth | None): reuse a measurement from this run (W1 and W2 share it).
        profile_dir (str | None): write a torch.profiler table and trace of one step of the
            fastest annotate_offload configuration there.
        log: progress printer (``None`` for silence).

    Returns:
        WorkloadReport: the measurements.
    """
    if log:
        log(f"{workload.describe()} on {device_name(device)}")
    if bandwidth is None:
        bandwidth = copy_bandwidth(device, nbytes=16 * 1024**2 if tiny else GiB)
    model, x, grad = build(workload, device)
    ref_out = _one_step_grads(model, _methods.make_baseline(model, 0).forward, x, grad, device)
    ref = (ref_out, [p.grad.clone() for p in model.parameters()])
    saved_bytes, held_bytes = _methods.saved_activation_bytes(model, x, workload.offload, split=True)
    results = []
    for name, kind, make in _method_list(workload.offload, release_lags, prefetch_layers):
        if make is _TRANSFORM:
            make = _transform_with_best_knobs(results)
        results.append(
            _run_method(name, kind, make, model, workload, x, grad, ref, device=device, warmup=warmup, steps=steps, log=log)
        )
        if kind == "baseline" and results[0].times is None:
            raise RuntimeError(f"bench {workload.name}: the baseline failed ({results[0].error}); nothing to compare.")
    del ref
    ours_bytes = next((r.offloaded_bytes for r in results if r.kind == "ours" and r.offloaded_bytes), None)
    peers = [load_offload_activations().info.describe()]
    peers += [load_torchao_cpu_offload_optimizer()[0].describe(), load_megatron_hybrid_device_optimizer()[0].describe()]
    report = WorkloadReport(
        workload=workload,
        device=device_name(device),
        torch_version=torch.__version__,
        command=command,
        tiny=tiny,
        bandwidth=bandwidth,
        saved_bytes=saved_bytes,
        held_bytes=held_bytes,
        floor_bytes=ours_bytes if ours_bytes else saved_bytes,
        floor_bytes_source="annotate_offload OffloadStats.bytes_offloaded" if ours_bytes else "saved-tensor hook count",
        results=results,
        peers=peers,
    )
    if profile_dir is not None:
        report.profile_files = _profile(report, model, x, grad, device, profile_dir)
    del model, x, grad
    free_memory(device)
    return report


def _profile(report: WorkloadReport, model, x, grad, device, out_dir: str) -> list:
    best = report.best_ours
    if best is None:
        return []
    from torch.profiler import ProfilerActivity, profile

    runner = best.make(model, report.workload.offload, min_offload_numel=report.workload.min_offload_numel)
    try:
        torch.autograd.backward(runner.forward(x), grad)  # warm-up
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            torch.autograd.backward(runner.forward(x), grad)
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        runner.close()
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{report.workload.name}_profile")
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(stem + ".txt", "w") as f:
        f.write(f"# {report.workload.describe()}: one step of {best.name} ({best.detail})\n")
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40))
    prof.export_chrome_trace(stem + "_trace.json")
    with open(stem + "_trace.json", "rb") as src, gzip.open(stem + "_trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(stem + "_trace.json")
    return [stem + ".txt", stem + "_trace.json.gz"]


def workloads_for(names, tiny: bool) -> list:
    """``Workload`` objects for names like ``["W1", "W2"]``.

    Raises:
        ValueError: an unknown name (lists the valid ones).
    """
    table = TINY_WORKLOADS if tiny else WORKLOADS
    out = []
    for name in names:
        key = name.strip().upper()
        if key not in table:
            raise ValueError(f"bench: unknown workload {name!r}; choose from {', '.join(table)}.")
        out.append(table[key])
    return out
