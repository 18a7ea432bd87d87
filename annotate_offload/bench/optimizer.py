"""Optimizer-offload benchmark (issue 4's fraction table and issue 7's workload W3).

Model: :class:`annotate_offload.models.gpt.GPTStack` with 24 layers, hidden 2048, 16 heads, no
vocabulary (hidden states in, hidden states out: 1.21 G parameters), fp32 master weights, forward
under ``torch.autocast(bfloat16)``, batch 4 x 1024 tokens, loss ``mean(out.float()**2)``.

Rows:

* ``reference``: forward and backward times of the model alone, the GPU fused AdamW step, the
  GPU-only training step ``T_gpu_step`` = fwd + bwd + GPU AdamW, and torch's fused CPU AdamW over
  all parameters with the optimizer's thread budget (``T_cpu``; throughput = numel / ``T_cpu``).
* ``fraction f``: ``HybridDeviceOptimizer(offload_fraction=f)``, default exact mode, for
  f in 0, 0.25, 0.5, 1: step time, peak GPU memory, host AdamW throughput inside the pipeline.
* W3 modes at f = 1 with ``offload_gradients=True``: default exact, ``step_in_backward``,
  ``delayed_param_update``, overlap off; each with its issue-7 bound
  (exact: ``1.10 x (T_fwd+bwd + T_cpu)``; step_in_backward: ``1.10 x (T_fwd + max(T_bwd, T_cpu))``;
  delayed: ``1.05 x max(T_gpu_step, T_cpu)``; memory: weights + activations + 1 GiB).

Step time is the mean over ``steps`` steps after ``warmup`` steps, one device synchronize at the
end (work a step leaves in flight is counted in the next). Each optimizer row then runs one more
step, synchronized before ``step()``, for the GPU memory allocated after backward and the step's
phases (``HybridDeviceOptimizer.last_step_phases``: D2H/host/H2D completion from the ``step()``
call, host busy and wait time, per-chunk throughput). The reference also times the host AdamW
variants that separate the pipeline's costs: pinned buffers, one ``step()`` per 64 MiB piece on a
worker thread, and the same with D2H+H2D traffic running (``--no-diagnostics`` skips them).
The activation bytes (forward peak minus weights) give W3's memory bound. ``--tiny`` runs a 2-layer, hidden-64
model on the CPU backend in seconds (CI: it cannot rot; its numbers carry no claim).

Run: ``python -m annotate_offload.bench.optimizer [--tiny] [--steps N] [--fractions 0,0.5,1]
[--cpu-threads N] [--chunk-mib M] [--no-modes] [--no-diagnostics] [--rounds R] [--mode-fractions 0.5,1]``.
With ``--rounds R`` the judged W3 rows run R times in rotated order and a last table gives each
row's median ratio; ``--mode-fractions`` runs each mode at more offload fractions (peaks only).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..models.gpt import GPTConfig, GPTStack
from ..optim import HybridDeviceOptimizer
from ..optim._threads import num_threads, thread_budget

__all__ = ["run", "format_table", "main"]

GiB = 1024**3
_FULL = dict(config=GPTConfig(hidden=2048, heads=16, layers=24), batch=4, seq=1024)
_TINY = dict(config=GPTConfig(hidden=64, heads=4, layers=2), batch=2, seq=16)


class _Clock:
    """CUDA-event or perf_counter timing of a region (ms)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], repeats: int) -> float:
        self.sync()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        self.sync()
        return (time.perf_counter() - t) * 1e3 / repeats


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _free(device: torch.device) -> None:
    if device.type == "cuda":  # the previous run's tensors must be gone before the next peak; on CPU gc costs seconds
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _loss(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(x)
    return out.float().square().mean()


def _activation_bytes(model, x, device) -> int:
    """Peak bytes a forward adds on top of what is allocated before it (activations, autocast casts)."""
    if device.type != "cuda":
        return 0
    model.zero_grad(set_to_none=True)
    _free(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = _loss(model, x, device)
    torch.cuda.synchronize()
    act = torch.cuda.max_memory_allocated(device) - before
    del loss
    _free(device)
    return act


class _HostBuffers:
    """fp32 host tensors for the AdamW diagnostics: pageable, pinned (``cudaHostAlloc``) or registered.

    ``registered``: pageable memory advised to use transparent huge pages (``madvise(MADV_HUGEPAGE)``,
    2 MiB aligned, touched) and then page-locked with ``cudaHostRegister``; it tells whether the
    page size of pinned memory (not the pinning itself) slows the bandwidth-bound CPU kernel.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode if torch.cuda.is_available() else "pageable"
        self.registered: list[int] = []
        self.keep: list[torch.Tensor] = []  # registered memory must outlive cudaHostUnregister
        self.failed = 0

    def empty(self, numel: int) -> torch.Tensor:
        if self.mode == "pinned":
            return torch.empty(numel, pin_memory=True)
        if self.mode != "registered":
            return torch.empty(numel)
        import ctypes

        huge = 2 << 20
        raw = torch.empty(numel + huge // 4)
        off = (-raw.data_ptr()) % huge // 4
        t = raw.narrow(0, off, numel)
        nbytes = numel * 4
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes - nbytes % 4096), 14)  # MADV_HUGEPAGE
        t.zero_()  # fault the pages in (as huge pages where the kernel allows)
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(rc) == 0:
            self.registered.append(t.data_ptr())
            self.keep.append(raw)
        else:
            self.failed += 1
        return t

    def close(self) -> None:
        if self.failed:
            print(f"optimizer bench: cudaHostRegister failed for {self.failed} buffers (they stayed pageable)", file=sys.stderr)
        for ptr in self.registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.registered = []
        self.keep = []


class _HostProbe:
    """Fused CPU AdamW over ``n`` fp32 params in 64 MiB pieces, allocated once and timed on demand.

    ``pinned``: params and grads page-locked (``True``/``"pinned"``: as the optimizer's masters and
    gradient buffers; ``"registered"``: huge-page pageable memory registered with CUDA, see
    :class:`_HostBuffers`); ``per_piece``: one optimizer instance and ``step()`` per piece (the
    pipeline's chunk calls); ``worker``: stepped from a :class:`CpuWorker` thread (its own OpenMP team)
    instead of this thread; ``numels``: step tensors of these sizes (the model's own) instead of
    64 MiB pieces of ``n``; ``kernel="add"``: ``param.add_(grad, alpha=1e-6)`` instead of AdamW, a pure
    host-memory kernel (12 B per element: two fp32 reads, one write) whose GB/s is the host memory
    roofline. The constructor runs one untimed step (state allocation, first touch).
    """

    def __init__(self, n: int, threads: int, *, pinned: Any = False, per_piece: bool, worker: bool,
                 numels: Optional[Sequence[int]] = None, kernel: str = "adamw") -> None:
        from ..optim._threads import CpuWorker

        piece = 16 << 20  # 64 MiB of fp32, like the optimizer's chunks
        self.n, self.threads, self.kernel = n, threads, kernel
        self.bufs = _HostBuffers("pinned" if pinned is True else (pinned or "pageable"))
        sizes = list(numels) if numels is not None else [min(piece, n - i) for i in range(0, n, piece)]
        self.host = [self.bufs.empty(k).zero_() for k in sizes]
        for t in self.host:
            t.grad = self.bufs.empty(t.numel()).normal_()
        self.opts = ([torch.optim.AdamW([t], lr=1e-5, fused=True) for t in self.host] if per_piece
                     else [torch.optim.AdamW(self.host, lr=1e-5, fused=True)])
        self.worker = CpuWorker(threads, lambda: None) if worker else None
        self._timed()

    def _one(self) -> None:
        if self.kernel == "add":
            for t in self.host:
                t.add_(t.grad, alpha=1e-6)
            return
        for o in self.opts:
            o.step()

    def _timed(self) -> float:
        t0 = time.perf_counter()
        if self.worker is not None:
            self.worker.submit(self._one)
            self.worker.drain()
        else:
            with num_threads(self.threads):
                self._one()
        return time.perf_counter() - t0

    def ms(self, reps: int, dma: Any = False) -> float:
        """ms per step, mean of ``reps``. ``dma``: pinned D2H and H2D copies run on side streams
        throughout (the pipeline's PCIe traffic), or ``"step"``: exactly one step's copies,
        ``4 x n`` bytes each way (fp32 gradients down, fp32 weights up) at link speed from the start
        of the host step: what an overlapped host update shares host memory with; ``"h2d"``: only
        the weights' ``4 x n`` bytes up (what the exact mode's host step overlaps: its gradients came
        down during backward). No copies without CUDA. The copies' GPU buffers (1 GiB) are freed
        before returning, so they never count in a later row's peak."""
        nb = 128 << 20  # 512 MiB fp32 each way; enqueue enough to cover every timed step
        copies = None
        if dma and torch.cuda.is_available():
            copies = (torch.empty(nb, device="cuda"), torch.empty(nb, device="cuda"), torch.empty(nb, pin_memory=True),
                      torch.empty(nb, pin_memory=True), torch.cuda.Stream(), torch.cuda.Stream())
        total = 0.0
        for _ in range(reps):
            if copies is not None:
                dev_a, dev_b, h_a, h_b, s1, s2 = copies
                torch.cuda.synchronize()
                if dma in ("step", "h2d"):
                    pieces = [min(nb, self.n - i) for i in range(0, self.n, nb)]
                else:
                    pieces = [nb] * 60  # ~60 x 9.8 ms at 55 GB/s each way: longer than one host step
                for k in pieces:
                    if dma != "h2d":
                        with torch.cuda.stream(s1):
                            h_a[:k].copy_(dev_a[:k], non_blocking=True)
                    with torch.cuda.stream(s2):
                        dev_b[:k].copy_(h_b[:k], non_blocking=True)
            total += self._timed()
        if copies is not None:
            torch.cuda.synchronize()
        return total * 1e3 / reps

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.opts = []
        for t in self.host:
            t.grad = None
        self.host = []
        self.bufs.close()


def _cpu_adamw_ms(n: int, threads: int, reps: int, *, pinned: Any = False, per_piece: bool, worker: bool, dma: Any,
                  numels: Optional[Sequence[int]] = None, kernel: str = "adamw") -> float:
    """One :class:`_HostProbe` configuration timed once: ms per step, mean of ``reps`` (see
    :meth:`_HostProbe.ms` for ``dma``)."""
    probe = _HostProbe(n, threads, pinned=pinned, per_piece=per_piece, worker=worker, numels=numels, kernel=kernel)
    try:
        return probe.ms(reps, dma)
    finally:
        probe.close()


_CPU_VARIANTS = (  # (key, label, kwargs) of the host AdamW diagnostics (benchmarks/NOTES.md, "W3 optimizer")
    ("t_cpu_pinned_ms", "pinned", dict(pinned=True, per_piece=False, worker=False, dma=False)),
    ("t_cpu_registered_ms", "huge-page registered", dict(pinned="registered", per_piece=False, worker=False, dma=False)),
    ("t_cpu_chunked_ms", "pinned, one step() per piece, worker thread", dict(pinned=True, per_piece=True, worker=True, dma=False)),
    ("t_cpu_dma_ms", "pinned, per piece, worker, with D2H+H2D running", dict(pinned=True, per_piece=True, worker=True, dma=True)),
    ("t_cpu_stepdma_ms", "pinned, per piece, worker, with one step's D2H+H2D (4 B/param each way)",
     dict(pinned=True, per_piece=True, worker=True, dma="step")),
    ("t_cpu_tensors_ms", "pinned, the model's own tensors in one step(), worker",
     dict(pinned=True, per_piece=False, worker=True, dma=False, numels="model")),
    # Host memory roofline (Note [Host memory roofline])
    ("t_add_ms", "in-place add (12 B/elem), per piece, worker", dict(pinned=True, per_piece=True, worker=True, dma=False, kernel="add")),
    ("t_add_stepdma_ms", "in-place add, per piece, worker, with one step's D2H+H2D",
     dict(pinned=True, per_piece=True, worker=True, dma="step", kernel="add")),
)


def _reference(model, x, device, steps, warmup, threads, *, diagnostics: bool = True) -> dict[str, Any]:
    clock = _Clock(device)
    n = sum(p.numel() for p in model.parameters())
    for _ in range(warmup):
        _loss(model, x, device).backward()
        model.zero_grad()
    fwd = bwd = 0.0
    for _ in range(steps):
        clock.sync()
        t0 = time.perf_counter()
        loss = _loss(model, x, device)
        clock.sync()
        t1 = time.perf_counter()
        loss.backward()
        clock.sync()
        t2 = time.perf_counter()
        fwd += (t1 - t0) * 1e3 / steps
        bwd += (t2 - t1) * 1e3 / steps
    # GPU fused AdamW step alone (grads kept from the last backward)
    gpu_opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gpu_opt.step()
    t_gpu = clock.time(gpu_opt.step, max(1, steps))
    del gpu_opt
    model.zero_grad()
    _free(device)
    act = _activation_bytes(model, x, device)
    reps = max(1, min(3, steps))
    # T_cpu (issue 7's definition): fused CPU AdamW over all parameters alone, pageable, one step() call
    t_cpu = _cpu_adamw_ms(n, threads, reps, pinned=False, per_piece=False, worker=False, dma=False)
    row = {"name": "reference", "numel": n, "t_fwd_ms": fwd, "t_bwd_ms": bwd, "t_adamw_gpu_ms": t_gpu,
           "t_gpu_step_ms": fwd + bwd + t_gpu, "activation_bytes": act,
           "t_cpu_ms": t_cpu, "cpu_gparams_s": n / t_cpu / 1e6, "threads": threads}
    if diagnostics:
        shapes = [p.numel() for p in model.parameters()]
        for key, _, kw in _CPU_VARIANTS:
            kw = dict(kw, numels=shapes) if kw.get("numels") == "model" else kw
            row[key] = _cpu_adamw_ms(n, threads, reps, **kw)
    return row


def _instrumented_step(opt, model, x, device) -> dict[str, Any]:
    """One extra step, synchronized before ``step()``: GPU memory after backward and the step's phases.

    The device is idle when ``step()`` is called, so host and device clocks start together at the
    end of backward (the exact mode's bound assumes that order too); CUDA timing events are on.
    """
    cuda = device.type == "cuda"
    opt._timing = True
    try:
        loss = _loss(model, x, device)
        bwd_ev = None
        if cuda:
            torch.cuda.synchronize()
            bwd_ev = torch.cuda.Event(enable_timing=True)
            bwd_ev.record()
        loss.backward()
        del loss
        if cuda:
            torch.cuda.synchronize()
        after_bwd = torch.cuda.memory_allocated(device) if cuda else 0
        ph = opt._ph
        ph.bwd_start_ev = bwd_ev
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        opt.flush()
        if cuda:
            torch.cuda.synchronize()
        phases = opt.last_step_phases
        opt.zero_grad()
    finally:
        opt._timing = False
    return {"after_bwd_bytes": after_bwd, "phases": phases}


def _measure(name, model, x, device, steps, warmup, **opt_kw) -> dict[str, Any]:
    _free(device)
    clock = _Clock(device)
    opt = HybridDeviceOptimizer(model.parameters(), lr=1e-5, **opt_kw)
    records: list = []

    def step():
        _loss(model, x, device).backward()
        opt.step()
        records.append(opt._last_ph)
        opt.zero_grad()

    for _ in range(warmup):
        step()
    records.clear()
    _peak_reset(device)
    ms = clock.time(step, steps)
    opt.flush()
    peak = _peak(device)
    timed = [r.summary() for r in records]
    keys = ("return_ms", "first_chunk_ms", "last_chunk_ms", "host_busy_ms", "d2h_wait_ms", "host_gparams_s")
    timed_phases = {k: sum(t[k] for t in timed) / len(timed) for k in keys} if timed else {}
    host_s = opt.host_step_seconds
    gpu_state = sum(sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t) and t.device.type == "cuda")
                    for st in opt.state.values())
    extra = _instrumented_step(opt, model, x, device)
    row = {"name": name, "fraction": opt_kw.get("offload_fraction", 0.5), "step_ms": ms, "peak_bytes": peak,
           "offloaded_numel": opt.offloaded_numel, "host_step_ms": host_s * 1e3,
           "cpu_gparams_s": (opt.offloaded_numel / host_s / 1e9) if host_s > 0 and not opt_kw.get("delayed_param_update") else float("nan"),
           "bound_ms": None, "threads": opt.thread_budget, "offload_gradients": opt_kw.get("offload_gradients", False),
           "gpu_state_bytes": gpu_state, "timed_phases": timed_phases, **extra}
    opt.close()
    del opt
    model.zero_grad(set_to_none=True)
    _free(device)
    return row


def _measure_peer(name, make, model, x, device, steps, warmup) -> Optional[dict[str, Any]]:
    """Time a peer optimizer built by ``make(params)``; ``None`` when it cannot be imported or built."""
    _free(device)
    try:
        opt = make(model.parameters())
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not raised
        return {"name": f"{name} (not run: {type(exc).__name__}: {str(exc)[:80]})", "skip": True}
    if opt is None:
        return {"name": f"{name} (not importable)", "skip": True}
    clock = _Clock(device)

    def step():
        _loss(model, x, device).backward()
        opt.step()
        opt.zero_grad()

    params = [p for p in model.parameters() if p.requires_grad]
    probe = [params[0], params[len(params) // 2], params[-1]] if params else []
    before = [p.detach().clone() for p in probe]
    try:
        for _ in range(warmup):
            step()
        _peak_reset(device)
        ms = clock.time(step, steps)
    except Exception as exc:  # noqa: BLE001
        del opt
        model.zero_grad(set_to_none=True)
        _free(device)
        return {"name": f"{name} (failed: {type(exc).__name__}: {str(exc)[:80]})", "skip": True}
    if hasattr(opt, "flush"):
        opt.flush()
    clock.sync()
    # a peer whose weights did not move did not step (its time then means nothing)
    moved = all(not torch.equal(b, p.detach()) for b, p in zip(before, probe))
    row = {"name": name if moved else f"{name} (weights unchanged: not stepping)", "fraction": 1.0, "step_ms": ms,
           "peak_bytes": _peak(device), "offloaded_numel": 0, "host_step_ms": float("nan"), "cpu_gparams_s": float("nan"),
           "bound_ms": None, "peer": True, "stepped": moved}
    if hasattr(opt, "close"):  # torchao's gradient hooks and ~20 GB of host state go now, not at gc
        opt.close()
    del opt
    model.zero_grad(set_to_none=True)
    _free(device)
    return row


def _judge(row: dict[str, Any], ref: dict[str, Any], rule: Callable[[dict[str, Any], float], float],
           target: Optional[float], before: Optional[tuple], after: Optional[tuple], *, copies: int) -> None:
    """Set a row's floor (``bound_ms``, ``target``) from T_cpu timed around it when ``before`` and
    ``after`` are :meth:`_AroundProbes.measure` results, else from the reference's T_cpu; with them
    also ``floor_copies_ms`` from probe ``copies`` (1: beside one step's D2H+H2D, 2: its H2D only)."""
    t_cpu = ref["t_cpu_ms"]
    if before is not None and after is not None:
        row["t_cpu_around_ms"] = (before[0], after[0])
        row["t_cpu_copies_around_ms"] = (before[1], after[1])
        row["t_cpu_h2d_around_ms"] = (before[2], after[2])
        t_cpu = (before[0] + after[0]) / 2
        row["floor_copies_ms"] = rule(ref, (before[copies] + after[copies]) / 2)
    row["bound_ms"], row["target"] = rule(ref, t_cpu), target


def _peer_specs() -> list[tuple[str, Callable[[Any], Any]]]:
    """W3's peers at f=1, ``(name, make(params))``: torchao's CPUOffloadOptimizer and Megatron's HDO
    (``make`` returns ``None`` when the peer is not importable)."""
    from . import _peers

    return [
        ("torchao CPUOffloadOptimizer (offload_gradients)",
         lambda ps: _peers.make_torchao_cpu_offload_optimizer(ps, lr=1e-5, offload_gradients=True)),
        ("Megatron HybridDeviceOptimizer f=1 (fused CPU AdamW)",
         lambda ps: _peers.make_megatron_hybrid_device_optimizer(ps, lr=1e-5, cpu_optimizer="fused")),
        ("Megatron HybridDeviceOptimizer f=1 (torch's unfused CPU AdamW)",
         lambda ps: _peers.make_megatron_hybrid_device_optimizer(ps, lr=1e-5, cpu_optimizer="default")),
    ]


def _peer_row(name, make, model, x, device, steps, warmup, *, around: Optional["_AroundProbes"] = None,
              ref: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One W3 peer row.

    Note [Peers against the same floor]: a peer's step is as host-bound as our exact mode's, and
    the host's memory bandwidth drifts within a run (G7 of session 9: torchao at 351.3 ms, below
    our exact floor, in the last minutes of a run whose probes had measured 3.5-4.0 G params/s).
    So with ``around`` each peer row is bracketed by the same T_cpu probes as our rows and gets the
    exact mode's floor, T_fwd + T_bwd + T_cpu (both peers step the host after backward, as exact
    mode does), without a target: the ratio is what compares with our exact row's.
    """
    rule = _W3_FLOORS["W3 exact (offload_gradients)"][1]
    before = around.measure() if around is not None and ref is not None else None
    row = _measure_peer(name, make, model, x, device, steps, warmup)
    if ref is not None and not row.get("skip"):
        _judge(row, ref, rule, None, before, around.measure() if before else None, copies=2)
    return row


def _mode_row(name: str, kw: dict[str, Any], model, x, device, steps: int, warmup: int, common: dict[str, Any],
              ref: dict[str, Any], around: Optional["_AroundProbes"], fraction: float = 1.0) -> dict[str, Any]:
    """One W3 mode row, judged against its issue-7 floor at f=1 (Note [T_cpu around each row]); at
    another ``fraction`` it is named ``"<mode>, f=<fraction>"`` and only its peak is judged (against
    the fraction table's f=0 row: issue 7's "peak memory falls linearly with f in every mode")."""
    _, rule, target = _W3_FLOORS.get(name, (None, None, None)) if fraction == 1.0 else (None, None, None)
    if fraction != 1.0:
        name = f"{name}, f={fraction:g}"
    og = kw.get("overlap_cpu_optimizer_d2h_h2d", True)
    before = around.measure() if around and rule else None
    # the delayed mode's pipeline is two steps deep: with fewer warm-up steps its first
    # timed step still waits for a whole host update (D8 of session 6: 637 vs ~340 ms)
    w = max(warmup, 2) if kw.get("delayed_param_update") else warmup
    row = _measure(name, model, x, device, steps, w, offload_fraction=fraction, offload_gradients=og, **kw, **common)
    if rule is not None:
        # the copies each mode's host step must overlap to hide them: the overlapped modes both
        # directions, the exact mode the weights' H2D (its D2H ran in backward)
        _judge(row, ref, rule, target, before, around.measure() if before else None, copies=1 if kw else 2)
    return row


def _checked_args(fractions: Sequence[float], mode_fractions: Sequence[float], modes: bool, rounds: int) -> list[float]:
    """:func:`run`'s argument checks, before any timing (``main`` turns their errors into usage
    errors); returns ``mode_fractions`` without repeats."""
    if isinstance(rounds, bool) or not isinstance(rounds, int):
        raise TypeError(f"run(rounds=...) must be an int >= 1, got {type(rounds).__name__} ({rounds!r})")
    if rounds < 1:
        raise ValueError(f"run(rounds=...) must be >= 1, got {rounds}; 1 runs each row once")
    for arg, values in (("fractions", fractions), ("mode_fractions", mode_fractions)):
        bad = [f for f in values if not 0.0 <= f <= 1.0]
        if bad:  # refused before minutes of reference timing, not by the optimizer afterwards
            raise ValueError(f"run({arg}=...) must lie in [0, 1], got {bad[0]!r}; 1.0 offloads every parameter")
    mode_fractions = list(dict.fromkeys(float(f) for f in mode_fractions))  # (1, 1.0) is one fraction
    if modes and not mode_fractions:
        raise ValueError("run(mode_fractions=...) is empty with modes=True; give at least one fraction "
                         "(1.0 is the one W3 judges), or pass modes=False (--no-modes) to skip the modes")
    if modes and rounds > 1 and 1.0 not in mode_fractions:
        raise ValueError(f"run(rounds={rounds}) repeats the W3 rows judged at f=1, but mode_fractions="
                         f"{mode_fractions} has no 1.0; add 1.0 or use rounds=1")
    return mode_fractions


def run(*, tiny: bool = False, device: Optional[torch.device] = None, fractions: Sequence[float] = (0.0, 0.25, 0.5, 1.0),
        modes: bool = True, steps: Optional[int] = None, warmup: Optional[int] = None,
        log: Optional[Callable[[str], None]] = None, cpu_threads: Optional[int] = None,
        chunk_bytes: Optional[int] = None, diagnostics: bool = True, adjacent: Optional[bool] = None,
        rounds: int = 1, mode_fractions: Sequence[float] = (1.0,)) -> list[dict[str, Any]]:
    """Measure the table; returns one dict per row (times in ms, memory in bytes, throughput in G params/s).

    Args:
        tiny (bool): 2-layer hidden-64 model, few steps (CI). Default: ``False``.
        device (torch.device | None): default CUDA if available, else CPU (the CPU backend).
        fractions (sequence of float): offload fractions of the fraction table.
        modes (bool): also run W3's modes at f = 1.
        steps, warmup (int | None): timed and warm-up steps (default 10/3, tiny 2/1).
        log (callable | None): progress lines (default: stderr).
        cpu_threads (int | None): the optimizer's host thread budget (default: its own rule).
        chunk_bytes (int | None): the optimizer's chunk size in bytes (default: its own, 64 MiB).
        diagnostics (bool): also time the host AdamW variants (pinned, per chunk, with DMA).
        adjacent (bool | None): time T_cpu (and T_cpu beside one step's copies) right before and right
            after each W3 mode row and judge the row against the mean of the two (Note [T_cpu around
            each row]). Default: with ``diagnostics`` on the full model.
        rounds (int): run the judged W3 rows (the three modes with a target, and torchao) this many
            times, each round in an order rotated by one row, and summarise each row's ratios by their
            median (Note [Rounds]). The W3 mode and peer rows of a multi-round run carry ``mode``
            (the row's name without the round), ``round`` (1-based) and ``judged``. Needs 1.0 in
            ``mode_fractions``. Default: 1.
        mode_fractions (sequence of float): offload fractions at which each W3 mode runs (first
            round only). Times are judged at f = 1 only; rows at other fractions are named
            ``"<mode>, f=<f>"`` and give the peak against the expected one (from the ``fraction 0.0``
            row, when ``fractions`` has 0). Default: ``(1.0,)``.

    Every optimizer row also carries ``after_bwd_bytes`` (GPU memory allocated right after
    backward, device idle) and ``phases`` (``HybridDeviceOptimizer.last_step_phases`` of one
    extra step synchronized before ``step()``).

    Raises:
        ValueError: a fraction (``fractions``, ``mode_fractions``) outside ``[0, 1]``, ``rounds`` < 1,
            an empty ``mode_fractions`` with ``modes``, or ``rounds`` > 1 without 1.0 in it.
        TypeError: ``rounds`` not an int.
    """
    mode_fractions = _checked_args(fractions, mode_fractions, modes, rounds)
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = _TINY if tiny else _FULL
    steps = steps or (2 if tiny else 10)
    warmup = warmup if warmup is not None else (1 if tiny else 3)
    torch.manual_seed(0)
    model = GPTStack(spec["config"], device=device)
    x = torch.randn(spec["batch"], spec["seq"], spec["config"].hidden, device=device)
    threads = thread_budget(cpu_threads, beside_training=False)  # T_cpu: the host's every core (Note [Thread budget])
    common: dict[str, Any] = {}
    if cpu_threads is not None:
        common["cpu_threads"] = cpu_threads
    if chunk_bytes is not None:
        common["chunk_bytes"] = chunk_bytes
    say(f"reference: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} G params on {device}, {threads} host threads")
    ref = _reference(model, x, device, steps, warmup, threads, diagnostics=diagnostics and not tiny)
    rows = [ref]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for f in fractions:
        say(f"fraction {f}")
        rows.append(_measure(f"fraction {f}", model, x, device, steps, warmup, offload_fraction=f, **common))
    if modes:
        cases = [
            ("W3 exact (offload_gradients)", {}),
            ("W3 step_in_backward", {"step_in_backward": True}),
            ("W3 delayed_param_update", {"delayed_param_update": True}),
            ("W3 overlap off", {"overlap_cpu_optimizer_d2h_h2d": False}),
        ]
        around = None
        if adjacent if adjacent is not None else diagnostics and not tiny:
            around = _AroundProbes.fit(ref["numel"], threads, max(1, min(3, steps)), say)
        jobs = [("mode", name, (kw, f)) for f in mode_fractions for name, kw in cases]
        jobs += [("peer", name, make) for name, make in (_peer_specs() if device.type == "cuda" else [])]
        # Note [Rounds]: later rounds repeat only the judged rows (the three modes with a target and
        # torchao, the peer that runs at their speed), each round starting one row later
        judged = [j for j in jobs if (j[1] in _W3_FLOORS and j[2][1] == 1.0) or j[1].startswith("torchao")]
        try:
            for k in range(rounds):
                order = jobs if k == 0 else judged[k % len(judged):] + judged[:k % len(judged)]
                for kind, name, what in order:
                    say(name if rounds == 1 else f"{name} (round {k + 1} of {rounds})")
                    if kind == "peer":
                        row = _peer_row(name, what, model, x, device, steps, warmup, around=around, ref=ref)
                    else:
                        row = _mode_row(name, what[0], model, x, device, steps, warmup, common, ref, around, what[1])
                    if rounds > 1:  # ``mode``: the job's name (a peer's row name may say it failed)
                        base = name if kind == "peer" else row["name"]
                        row.update(mode=base, round=k + 1, name=f"{row['name']}, round {k + 1}",
                                   judged=(kind, name, what) in judged)
                    rows.append(row)
        finally:
            if around is not None:
                around.close()
    for r in rows:
        r.setdefault("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        r.setdefault("weights_bytes", weights)
        r.setdefault("activation_bytes", ref.get("activation_bytes", 0))
    return rows


# Note [T_cpu around each row]: the W3 floors are built from T_cpu, fused CPU AdamW over every
# parameter measured alone, but this host's memory bandwidth drifts by 10-30% within one run (D1 of
# session 6: T_cpu 247.8 ms pageable, then 319.0 ms pinned a minute later; the same buffers 2.98-3.91
# G params/s in three alternated rounds of diag_host_memory.py). A floor measured once, minutes
# before a row, then judges the row partly by the host's drift. Each mode row is therefore
# bracketed: T_cpu alone (pageable, one step(), this thread: issue 7's definition), and T_cpu beside
# one step's D2H+H2D and beside its H2D only (pinned, per 64 MiB piece, worker thread: the
# pipeline's situation) are timed right before and right after it, on buffers allocated once, and
# the row's floors use the means.
class _AroundProbes:
    """The two host AdamW probes of Note [T_cpu around each row], allocated once."""

    def __init__(self, n: int, threads: int, reps: int) -> None:
        self.reps = reps
        self.alone = _HostProbe(n, threads, pinned=False, per_piece=False, worker=False)
        self.copies = _HostProbe(n, threads, pinned=True, per_piece=True, worker=True)

    @classmethod
    def fit(cls, n: int, threads: int, reps: int, say: Callable[[str], None]) -> Optional["_AroundProbes"]:
        """The probes, or ``None`` (with a message) when free host memory cannot hold them: they keep
        2 x 16 B per parameter (params, grads, two moments), ~39 GB for W3's 1.2 G parameters."""
        need = 2 * 16 * n + (2 << 30)
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            avail = need
        # Only what the probes themselves need: MemAvailable does not count the pinned blocks torch's
        # host allocator caches after the diagnostics and earlier rows, which the probes reuse.
        if avail < need:
            say(f"T_cpu around each row skipped: the probes need {need / GiB:.1f} GiB of host memory and "
                f"{avail / GiB:.1f} GiB is free; the rows use the reference T_cpu")
            return None
        return cls(n, threads, reps)

    def measure(self) -> tuple[float, float, float]:
        """``(T_cpu alone, T_cpu beside one step's D2H+H2D, T_cpu beside its H2D only)`` in ms."""
        return self.alone.ms(self.reps), self.copies.ms(self.reps, "step"), self.copies.ms(self.reps, "h2d")

    def close(self) -> None:
        self.alone.close()
        self.copies.close()


# Note [Rounds]: one pass of W3 times each row once, a minute or more after the one before, and
# the host's memory bandwidth moves by 10-40% within minutes (H1 of session 10: T_cpu timed around
# the rows 301-640 ms in one run). Each row is already judged against T_cpu timed around it (Note
# [T_cpu around each row]), but a drift *during* a row still lands in its ratio. ``rounds`` repeats
# the judged rows, each round starting one row later so no row is always first or last, and the
# verdict is each row's median ratio over the rounds: the repeat-and-take-the-median rule for
# timing on a shared machine (the device README's METHOD.md). The rows that are not judged (overlap
# off, Megatron's two rows) run in the first round only.
def _rounds_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The table of per-round ratios and their medians (Note [Rounds]); ``[]`` for a one-round run."""
    groups: dict[str, list[dict[str, Any]]] = {}
    rounds = max((r.get("round", 0) for r in rows), default=0)
    for r in rows:  # rows of the judged jobs that produced a time worth judging
        if r.get("judged") and r.get("bound_ms") and not r.get("skip") and r.get("stepped", True):
            groups.setdefault(r["mode"], []).append(r)
    if rounds < 2 or not groups:
        return []
    around = all(r.get("t_cpu_around_ms") for g in groups.values() for r in g)
    lines = [
        "",
        f"Rounds (Note [Rounds]): the judged rows ran in {rounds} rounds in rotated order, each time against "
        + ("T_cpu timed around it" if around else "the reference's T_cpu (no probes around the rows: the medians do "
           "not correct for the host's drift)")
        + "; the verdict is the median over the rounds that produced a time.",
        "",
        "| run | rounds | step / floor, median (target) | per round | step / floor with copies, median (target) | "
        "per round | step ms, median | per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, g in groups.items():
        ratios = [r["step_ms"] / r["bound_ms"] for r in g]
        target = g[0].get("target")
        verdict = _verdict(statistics.median(ratios), target)
        copies = [r["step_ms"] / r["floor_copies_ms"] for r in g if r.get("floor_copies_ms")]
        # the same target against the floor whose host term ran beside the mode's own copies
        cmed = _verdict(statistics.median(copies), target) if copies else "-"
        steps = [r["step_ms"] for r in g]
        lines.append(f"| {mode} | {len(g)} | {verdict} | {' / '.join(f'{v:.2f}' for v in ratios)} | {cmed} | "
                     f"{' / '.join(f'{v:.2f}' for v in copies) or '-'} | {statistics.median(steps):.1f} | "
                     f"{' / '.join(f'{v:.1f}' for v in steps)} |")
    return lines


def _expected_peak(r: dict[str, Any], base: Optional[dict[str, Any]]) -> int:
    """Issue 4 item 6's expected peak for row ``r`` from the f=0 row (0 when unknown).

    Offloading removes 8 B per host-stepped fp32 element of optimizer state (exp_avg, exp_avg_sq)
    from every moment of the step, so the f=0 peak falls by that much. The 4 B gradient leaves only
    where gradients were part of the peak: with ``offload_gradients`` the peak is at least
    weights + GPU state + activations (the end of forward, where no gradient exists yet) and at
    most the f=0 peak minus 12 B per element.
    """
    if not base or not base["peak_bytes"]:
        return 0
    n = r["offloaded_numel"]
    exp = base["peak_bytes"] - 8 * n
    if r.get("offload_gradients"):
        floor = r["weights_bytes"] + r.get("gpu_state_bytes", 0) + r.get("activation_bytes", 0)
        exp = max(exp - 4 * n, floor)
    return exp


# Note [Host memory roofline]: torch's fused CPU AdamW over fp32 reads the parameter, its gradient
# and both moments and writes the parameter and both moments back: 28 B of host memory traffic per
# parameter for a handful of flops, so on a many-core host it runs at the memory bandwidth, not
# the cores' speed. An in-place ``add_`` (12 B per element, no arithmetic to speak of) measures
# the bandwidth the host step can get, alone and while one step's D2H+H2D (4 B per parameter each
# way, which also cross host memory) run; 28 B x numel / that bandwidth is the least time any
# host AdamW can take beside those copies, whoever implements the offload.
ADAMW_HOST_BYTES = 28
ADD_HOST_BYTES = 12


def _roofline(ref: dict[str, Any]) -> list[str]:
    """The host memory roofline line (diagnostics only; Note [Host memory roofline])."""
    n, alone, dma = ref["numel"], ref.get("t_add_ms"), ref.get("t_add_stepdma_ms")
    if alone is None or dma is None:
        return []
    bw = ADD_HOST_BYTES * n / alone / 1e6  # GB/s
    bw_dma = ADD_HOST_BYTES * n / dma / 1e6
    adamw = ADAMW_HOST_BYTES * n / ref["t_cpu_ms"] / 1e6
    return [
        f"Host memory roofline: in-place add {bw:.1f} GB/s alone, {bw_dma:.1f} GB/s with one step's D2H+H2D running; "
        f"fused AdamW moves {ADAMW_HOST_BYTES} B/param = {adamw:.1f} GB/s measured alone ({adamw / bw:.0%} of the add's), "
        f"so it needs at least {ADAMW_HOST_BYTES * n / bw / 1e6:.1f} ms alone and "
        f"{ADAMW_HOST_BYTES * n / bw_dma / 1e6:.1f} ms beside the copies."
    ]


# Issue 7's W3 rules, per mode row: (floor formula, floor in ms from the reference row and a T_cpu
# in ms, target ratio of step time to floor)
_W3_FLOORS: dict[str, tuple[str, Callable[[dict[str, Any], float], float], float]] = {
    "W3 exact (offload_gradients)": ("T_fwd + T_bwd + T_cpu", lambda ref, t: ref["t_fwd_ms"] + ref["t_bwd_ms"] + t, 1.10),
    "W3 step_in_backward": ("T_fwd + max(T_bwd, T_cpu)", lambda ref, t: ref["t_fwd_ms"] + max(ref["t_bwd_ms"], t), 1.10),
    "W3 delayed_param_update": ("max(T_gpu_step, T_cpu)", lambda ref, t: max(ref["t_gpu_step_ms"], t), 1.05),
}


def _floors_with_copies(ref: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Lines judging the two overlapped modes against floors whose host term is measured with the
    step's own copies running: the row's ``floor_copies_ms`` where T_cpu was timed around it (Note
    [T_cpu around each row]), else the reference's ``t_cpu_stepdma_ms`` (4 B per parameter each way).

    Issue 7's bounds use the host AdamW time measured alone, but both modes must run it while the
    gradients' D2H and the weights' H2D of the same step cross host memory: ``delayed_param_update``
    while the next forward/backward runs, ``step_in_backward`` while backward produces the
    gradients. On the H200 host that copy traffic alone slowed the host step from 299.0 to
    345.2 ms (benchmarks/NOTES.md, run B4), so ``1.05 x T_cpu`` alone is not reachable there.
    """
    if any(r.get("round") for r in rows):
        return []  # several rounds: the rounds table judges each mode against its floors with copies
    named = {r.get("name"): r for r in rows}
    t_dma = ref.get("t_cpu_stepdma_ms")
    out = []
    for name, label in (("W3 delayed_param_update", "Delayed-mode"), ("W3 step_in_backward", "step_in_backward")):
        formula, rule, target = _W3_FLOORS[name]
        formula = formula.replace("T_cpu", "T_cpu with copies")
        row = named.get(name)
        floor, where = (row["floor_copies_ms"], " (timed around the row)") if row and "floor_copies_ms" in row else (
            (rule(ref, t_dma), "") if t_dma is not None else (None, ""))
        if floor is None:
            continue
        tail = f": {name[3:]} {_judged(row['step_ms'], floor, target)} of it" if row is not None else ""
        out.append(f"{label} floor with the step's own copies sharing host memory{where}: {formula} = {floor:.1f} ms{tail}.")
    return out


def _verdict(ratio: float, target: Optional[float]) -> str:
    """``"1.04x (within 1.10x)"``, or ``"1.04x"`` without a target."""
    return f"{ratio:.2f}x" + (f" ({'within' if ratio <= target else 'above'} {target:.2f}x)" if target else "")


def _judged(step_ms: float, floor: Optional[float], target: Optional[float]) -> str:
    """``"1.04x (within 1.10x)"``: a row's step time over its floor, against its target ratio."""
    return _verdict(step_ms / floor, target) if floor else "-"


def format_table(rows: list[dict[str, Any]], command: str = "") -> str:
    """Markdown tables of :func:`run`'s rows (ratios vs bounds first, absolute values as context; then phases)."""
    ref = next(r for r in rows if r["name"] == "reference")
    base = next((r for r in rows if r["name"] == "fraction 0.0"), None)
    act = ref.get("activation_bytes", 0)
    smoke = ["**CPU backend: a smoke run; its times and within/above verdicts carry no claim.**", ""] if (
        ref.get("device") == "cpu") else []
    lines = smoke + [
        f"Optimizer offload on {ref.get('device', '?')}, torch {torch.__version__}, {ref['numel'] / 1e9:.3f} G params, "
        f"{ref['threads']} host threads" + (f"; `{command}`" if command else ""),
        "",
        f"Reference: T_fwd {ref['t_fwd_ms']:.1f} ms, T_bwd {ref['t_bwd_ms']:.1f} ms, GPU fused AdamW {ref['t_adamw_gpu_ms']:.1f} ms "
        f"(T_gpu_step {ref['t_gpu_step_ms']:.1f} ms), "
        f"CPU fused AdamW {ref['t_cpu_ms']:.1f} ms ({ref['cpu_gparams_s']:.2f} G params/s, pageable, measured alone); "
        f"weights {ref.get('weights_bytes', 0) / GiB:.2f} GiB, activations {act / GiB:.2f} GiB (forward peak minus weights).",
    ]
    diag = [(label, ref[key]) for key, label, _ in _CPU_VARIANTS if key in ref]
    if diag:
        lines.append("Host AdamW alone, same threads: " + "; ".join(
            f"{label} {ms:.1f} ms ({ref['numel'] / ms / 1e6:.2f} G params/s)" for label, ms in diag) + ".")
    lines += _roofline(ref) + _floors_with_copies(ref, rows)
    lines += [
        "",
        "| run | step / floor (target) | step ms | floor ms | T_cpu around ms | step / floor with copies | peak GPU GiB | "
        "expected peak GiB | peak / expected | W3 memory bound GiB | GPU after bwd GiB | host AdamW G params/s | host step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["name"] == "reference":
            continue
        if r.get("skip"):
            lines.append(f"| {r['name']} |" + " - |" * 12)
            continue
        bound = r.get("bound_ms")
        ratio = _judged(r["step_ms"], bound, r.get("target"))
        around = r.get("t_cpu_around_ms")
        arounds = f"{around[0]:.1f} / {around[1]:.1f}" if around else "-"
        fc = r.get("floor_copies_ms")
        fcs = f"{r['step_ms'] / fc:.2f}x of {fc:.1f}" if fc else "-"
        bounds = f"{bound:.1f}" if bound else "-"
        if r.get("peer"):  # Note [Peers against the same floor]: the exact mode's floor, no target
            lines.append(f"| {r['name']} | {ratio} | {r['step_ms']:.1f} | {bounds} | {arounds} | {fcs} | "
                         f"{r['peak_bytes'] / GiB:.2f} |" + " - |" * 6)
            continue
        exp = _expected_peak(r, base)
        vs = f"{r['peak_bytes'] / exp:.3f}" if exp > 0 else "-"
        exps = f"{exp / GiB:.2f}" if exp > 0 else "-"
        # W3: peak <= weights + activations + 1 GiB when gradients are offloaded (+ any GPU-side state)
        mb = r["weights_bytes"] + r.get("gpu_state_bytes", 0) + act + GiB if (r.get("offload_gradients") and act) else 0
        mbs = f"{mb / GiB:.2f}" + (" ok" if r["peak_bytes"] <= mb else " OVER") if mb else "-"
        ab = r.get("after_bwd_bytes", 0)
        abs_ = f"{ab / GiB:.2f}" if ab else "-"
        tp = r["cpu_gparams_s"]
        tps = "-" if tp != tp else f"{tp:.2f}"
        lines.append(f"| {r['name']} | {ratio} | {r['step_ms']:.1f} | {bounds} | {arounds} | {fcs} | {r['peak_bytes'] / GiB:.2f} | "
                     f"{exps} | {vs} | "
                     f"{mbs} | {abs_} | {tps} | {r['host_step_ms']:.1f} |")
    lines += _rounds_summary(rows)
    lines.append("")
    rules = "; ".join(f"{name[3:]} {formula}, target {target:.2f}x" for name, (formula, _, target) in _W3_FLOORS.items())
    lines.append(f"Floors (issue 7): {rules}. T_cpu around: fused CPU AdamW alone timed just before / after the row (Note [T_cpu around each row]; the floor uses their mean; '-': the reference's). "
                 "Peers: the exact mode's floor, with T_cpu timed around each peer row, and no target (Note [Peers against the "
                 "same floor]): their ratio compares with the exact row's. "
                 "Floor with copies: the same formula with T_cpu timed beside the copies the mode's host step overlaps (one "
                 "step's D2H+H2D for the overlapped modes, its H2D for the exact mode).")
    lines.append("GPU after bwd: allocated right after backward (device idle) = weights + GPU state + gradients still on "
                 "the GPU; with offload_gradients at f=1 it should be about the weights.")
    ph_rows = [r for r in rows if r.get("phases")]
    if ph_rows:
        lines += [
            "",
            "Phases of one extra step per row, synchronized before step() (ms from the step() call = end of backward; "
            "D2H/H2D done from CUDA events; negative = before step()):",
            "",
            "| run | return | last D2H done | first chunk | last chunk | last H2D done | host busy | D2H wait | chunks | "
            "host G/s | chunk G/s min / med / max |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        f1 = lambda v: "-" if v != v else f"{v:.1f}"  # noqa: E731
        f2 = lambda v: "-" if v != v else f"{v:.2f}"  # noqa: E731
        for r in ph_rows:
            p = r["phases"]
            lines.append(
                f"| {r['name']} | {f1(p['return_ms'])} | {f1(p['d2h_done_ms'])} | {f1(p['first_chunk_ms'])} | "
                f"{f1(p['last_chunk_ms'])} | {f1(p['h2d_done_ms'])} | {f1(p['host_busy_ms'])} | {f1(p['d2h_wait_ms'])} | "
                f"{int(p['chunks'])} | {f2(p['host_gparams_s'])} | {f2(p['chunk_gparams_min'])} / "
                f"{f2(p['chunk_gparams_median'])} / {f2(p['chunk_gparams_max'])} |")
        lines += [
            "",
            "Timed steps (not synchronized; means; ms from the step() call; step() is called when the host has "
            "launched backward, the GPU may still be running it; outside = step ms - step() wall):",
            "",
            "| run | step ms | step() wall | outside step() | first chunk | last chunk | host busy | D2H wait | host G/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in ph_rows:
            t = r.get("timed_phases") or {}
            if not t:
                continue
            lines.append(
                f"| {r['name']} | {r['step_ms']:.1f} | {f1(t['return_ms'])} | {f1(r['step_ms'] - t['return_ms'])} | "
                f"{f1(t['first_chunk_ms'])} | {f1(t['last_chunk_ms'])} | {f1(t['host_busy_ms'])} | {f1(t['d2h_wait_ms'])} | "
                f"{f2(t['host_gparams_s'])} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; prints the markdown table to stdout. Returns the exit status."""
    ap = argparse.ArgumentParser(prog="annotate-offload bench optimizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU backend (CI)")
    ap.add_argument("--fractions", default="0,0.25,0.5,1", help="comma-separated offload fractions")
    ap.add_argument("--no-modes", action="store_true", help="skip W3's mode rows (every --mode-fractions) and the peers")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--cpu-threads", type=int, default=None, help="host thread budget of the optimizer (default: its rule)")
    ap.add_argument("--chunk-mib", type=int, default=None, help="host chunk size in MiB (default: the optimizer's 64)")
    ap.add_argument("--no-diagnostics", action="store_true", help="skip the host AdamW variants (pinned, per chunk, DMA)")
    ap.add_argument("--mode-fractions", default="1",
                    help="comma-separated offload fractions at which each W3 mode runs (times judged at 1 only)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the judged W3 rows this many times in rotated order; verdict = median (default 1)")
    args = ap.parse_args(argv)
    try:
        fractions = [float(v) for v in args.fractions.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--fractions must be comma-separated numbers, got {args.fractions!r}")
    try:
        mode_fractions = [float(v) for v in args.mode_fractions.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--mode-fractions must be comma-separated numbers, got {args.mode_fractions!r}")
    try:
        _checked_args(fractions, mode_fractions, not args.no_modes, args.rounds)
    except (TypeError, ValueError) as exc:
        ap.error(f"{exc} (--fractions, --mode-fractions, --rounds, --no-modes)")
    for name in ("cpu_threads", "chunk_mib"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be a positive int, got {v}")
    rows = run(tiny=args.tiny, device=torch.device(args.device) if args.device else None, fractions=fractions,
               modes=not args.no_modes, steps=args.steps, warmup=args.warmup, cpu_threads=args.cpu_threads,
               chunk_bytes=args.chunk_mib << 20 if args.chunk_mib else None, diagnostics=not args.no_diagnostics,
               rounds=args.rounds, mode_fractions=mode_fractions)
    cmd = "python -m annotate_offload.bench.optimizer " + " ".join(argv if argv is not None else sys.argv[1:])
    print(format_table(rows, cmd.strip()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
