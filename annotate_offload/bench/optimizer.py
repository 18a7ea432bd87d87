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
end (work a step leaves in flight is counted in the next). ``--tiny`` runs a 2-layer, hidden-64
model on the CPU backend in seconds (CI: it cannot rot; its numbers carry no claim).

Run: ``python -m annotate_offload.bench.optimizer [--tiny] [--steps N] [--fractions 0,0.5,1]``.
"""

from __future__ import annotations

import argparse
import gc
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


def _reference(model, x, device, steps, warmup, threads) -> dict[str, Any]:
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
    # fused CPU AdamW over all parameters with the optimizer's thread budget, in 64 MiB pieces
    piece = 16 << 20  # 64 MiB of fp32, like the optimizer's chunks
    host = [torch.zeros(min(piece, n - i)) for i in range(0, n, piece)]
    for t in host:
        t.grad = torch.randn(t.numel())
    cpu_opt = torch.optim.AdamW(host, lr=1e-5, fused=True)
    with num_threads(threads):
        cpu_opt.step()
        t0 = time.perf_counter()
        reps = max(1, min(3, steps))
        for _ in range(reps):
            cpu_opt.step()
        t_cpu = (time.perf_counter() - t0) * 1e3 / reps
    del cpu_opt, host
    return {"name": "reference", "numel": n, "t_fwd_ms": fwd, "t_bwd_ms": bwd, "t_adamw_gpu_ms": t_gpu,
            "t_gpu_step_ms": fwd + bwd + t_gpu,
            "t_cpu_ms": t_cpu, "cpu_gparams_s": n / t_cpu / 1e6, "threads": threads}


def _measure(name, model, x, device, steps, warmup, *, bound_ms=None, **opt_kw) -> dict[str, Any]:
    _free(device)
    clock = _Clock(device)
    opt = HybridDeviceOptimizer(model.parameters(), lr=1e-5, **opt_kw)

    def step():
        _loss(model, x, device).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    _peak_reset(device)
    ms = clock.time(step, steps)
    opt.flush()
    host_s = opt.host_step_seconds
    row = {"name": name, "fraction": opt_kw.get("offload_fraction", 0.5), "step_ms": ms, "peak_bytes": _peak(device),
           "offloaded_numel": opt.offloaded_numel, "host_step_ms": host_s * 1e3,
           "cpu_gparams_s": (opt.offloaded_numel / host_s / 1e9) if host_s > 0 and not opt_kw.get("delayed_param_update") else float("nan"),
           "bound_ms": bound_ms, "threads": opt.thread_budget, "offload_gradients": opt_kw.get("offload_gradients", False)}
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
    row = {"name": name, "fraction": 1.0, "step_ms": ms, "peak_bytes": _peak(device),
           "offloaded_numel": 0, "host_step_ms": float("nan"), "cpu_gparams_s": float("nan"),
           "bound_ms": None, "peer": True}
    del opt
    model.zero_grad(set_to_none=True)
    _free(device)
    return row


def _peer_rows(model, x, device, steps, warmup, say) -> list[dict[str, Any]]:
    """W3 peers at f=1 when importable: torchao's CPUOffloadOptimizer and Megatron's HDO."""
    if device.type != "cuda":
        return []
    from . import _peers

    peers = [
        ("torchao CPUOffloadOptimizer (offload_gradients)",
         lambda ps: _peers.make_torchao_cpu_offload_optimizer(ps, lr=1e-5, offload_gradients=True)),
        ("Megatron HybridDeviceOptimizer f=1 (fused CPU AdamW)",
         lambda ps: _peers.make_megatron_hybrid_device_optimizer(ps, lr=1e-5, cpu_optimizer="fused")),
        ("Megatron HybridDeviceOptimizer f=1 (default CPU AdamW)",
         lambda ps: _peers.make_megatron_hybrid_device_optimizer(ps, lr=1e-5, cpu_optimizer="default")),
    ]
    rows = []
    for name, make in peers:
        say(name)
        rows.append(_measure_peer(name, make, model, x, device, steps, warmup))
    return rows


def run(*, tiny: bool = False, device: Optional[torch.device] = None, fractions: Sequence[float] = (0.0, 0.25, 0.5, 1.0),
        modes: bool = True, steps: Optional[int] = None, warmup: Optional[int] = None,
        log: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """Measure the table; returns one dict per row (times in ms, memory in bytes, throughput in G params/s).

    Args:
        tiny (bool): 2-layer hidden-64 model, few steps (CI). Default: ``False``.
        device (torch.device | None): default CUDA if available, else CPU (the CPU backend).
        fractions (sequence of float): offload fractions of the fraction table.
        modes (bool): also run W3's modes at f = 1.
        steps, warmup (int | None): timed and warm-up steps (default 10/3, tiny 2/1).
        log (callable | None): progress lines (default: stderr).

    Raises:
        ValueError: a fraction outside ``[0, 1]`` (from the optimizer).
    """
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = _TINY if tiny else _FULL
    steps = steps or (2 if tiny else 10)
    warmup = warmup if warmup is not None else (1 if tiny else 3)
    torch.manual_seed(0)
    model = GPTStack(spec["config"], device=device)
    x = torch.randn(spec["batch"], spec["seq"], spec["config"].hidden, device=device)
    threads = thread_budget()
    say(f"reference: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} G params on {device}, {threads} host threads")
    ref = _reference(model, x, device, steps, warmup, threads)
    rows = [ref]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for f in fractions:
        say(f"fraction {f}")
        rows.append(_measure(f"fraction {f}", model, x, device, steps, warmup, offload_fraction=f))
    if modes:
        fb, t_cpu = ref["t_fwd_ms"] + ref["t_bwd_ms"], ref["t_cpu_ms"]
        cases = [
            ("W3 exact (offload_gradients)", {}, 1.10 * (fb + t_cpu)),
            ("W3 step_in_backward", {"step_in_backward": True}, 1.10 * (ref["t_fwd_ms"] + max(ref["t_bwd_ms"], t_cpu))),
            ("W3 delayed_param_update", {"delayed_param_update": True}, 1.05 * max(ref["t_gpu_step_ms"], t_cpu)),
            ("W3 overlap off", {"overlap_cpu_optimizer_d2h_h2d": False}, None),
        ]
        for name, kw, bound in cases:
            say(name)
            og = kw.get("overlap_cpu_optimizer_d2h_h2d", True)
            row = _measure(name, model, x, device, steps, warmup, bound_ms=bound, offload_fraction=1.0, offload_gradients=og, **kw)
            row["mem_bound_bytes"] = weights + GiB  # + activations: see format_table
            rows.append(row)
        rows += _peer_rows(model, x, device, steps, warmup, say)
    for r in rows:
        r.setdefault("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        r.setdefault("weights_bytes", weights)
    return rows


def format_table(rows: list[dict[str, Any]], command: str = "") -> str:
    """Markdown table of :func:`run`'s rows (ratios vs bounds first, absolute values as context)."""
    ref = next(r for r in rows if r["name"] == "reference")
    base = next((r for r in rows if r["name"] == "fraction 0.0"), None)
    lines = [
        f"Optimizer offload on {ref.get('device', '?')}, torch {torch.__version__}, {ref['numel'] / 1e9:.3f} G params, "
        f"{ref['threads']} host threads" + (f"; `{command}`" if command else ""),
        "",
        f"Reference: T_fwd {ref['t_fwd_ms']:.1f} ms, T_bwd {ref['t_bwd_ms']:.1f} ms, GPU fused AdamW {ref['t_adamw_gpu_ms']:.1f} ms "
        f"(T_gpu_step {ref['t_gpu_step_ms']:.1f} ms), "
        f"CPU fused AdamW {ref['t_cpu_ms']:.1f} ms ({ref['cpu_gparams_s']:.2f} G params/s).",
        "",
        "| run | step / bound | step ms | bound ms | peak GPU GiB | expected peak GiB | peak / expected | host AdamW G params/s | host step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["name"] == "reference":
            continue
        if r.get("skip"):
            lines.append(f"| {r['name']} | - | - | - | - | - | - | - | - |")
            continue
        if r.get("peer"):
            lines.append(f"| {r['name']} | - | {r['step_ms']:.1f} | - | {r['peak_bytes'] / GiB:.2f} | - | - | - | - |")
            continue
        bound = r.get("bound_ms")
        ratio = f"{r['step_ms'] / bound:.2f}x" if bound else "-"
        # expected: the f=0 peak minus what leaves the GPU per offloaded element (fp32 params: exp_avg +
        # exp_avg_sq = 8 B, + the 4 B fp32 gradient with offload_gradients), issue 4 item 6
        per = 12 if r.get("offload_gradients") else 8
        exp = base["peak_bytes"] - per * r["offloaded_numel"] if base and base["peak_bytes"] else 0
        vs = f"{r['peak_bytes'] / exp:.3f}" if exp > 0 else "-"
        exps = f"{exp / GiB:.2f}" if exp > 0 else "-"
        tp = r["cpu_gparams_s"]
        tps = "-" if tp != tp else f"{tp:.2f}"
        bounds = f"{bound:.1f}" if bound else "-"
        lines.append(f"| {r['name']} | {ratio} | {r['step_ms']:.1f} | {bounds} | {r['peak_bytes'] / GiB:.2f} | {exps} | {vs} | "
                     f"{tps} | {r['host_step_ms']:.1f} |")
    lines.append("")
    lines.append(f"Weights {ref.get('weights_bytes', 0) / GiB:.2f} GiB; W3 memory target: peak <= weights + activations + 1 GiB "
                 "(activations = the f=0 peak minus weights, grads and optimizer state).")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; prints the markdown table to stdout. Returns the exit status."""
    ap = argparse.ArgumentParser(prog="annotate-offload bench optimizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU backend (CI)")
    ap.add_argument("--fractions", default="0,0.25,0.5,1", help="comma-separated offload fractions")
    ap.add_argument("--no-modes", action="store_true", help="skip W3's modes at f=1")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    args = ap.parse_args(argv)
    try:
        fractions = [float(v) for v in args.fractions.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--fractions must be comma-separated numbers, got {args.fractions!r}")
    rows = run(tiny=args.tiny, device=torch.device(args.device) if args.device else None, fractions=fractions,
               modes=not args.no_modes, steps=args.steps, warmup=args.warmup)
    cmd = "python -m annotate_offload.bench.optimizer " + " ".join(argv if argv is not None else sys.argv[1:])
    print(format_table(rows, cmd.strip()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
