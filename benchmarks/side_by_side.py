"""Two versions of the package side by side: each case in a fresh process, rounds in rotated order.

    git worktree add /tmp/old <commit>
    python benchmarks/side_by_side.py --old /tmp/old --cases W1,W2,W3-exact,W3-og --rounds 3

Cases: ``W1`` (8 x h4096 bf16 GPT blocks, 2 x 4096 tokens, 7 layers offloaded with
``release_lag=1, prefetch_layers=1``), ``W2`` (8 x h8192, 1 x 4096 tokens, 2 layers offloaded),
``W3-<mode>`` (24 x h2048 fp32 blocks under bf16 autocast, 4 x 1024 tokens, AdamW state fully on
the host; mode ``exact``, ``og`` = ``offload_gradients``, ``sib`` = ``step_in_backward``,
``delayed`` = ``delayed_param_update``; ``torchao`` and ``torchao-og``: torchao's ``CPUOffloadOptimizer``
over fused AdamW without and with ``offload_gradients``, run once per round, needing no ``--old``).
Each process prints the median step (CUDA events) and the peak of ``torch.cuda.max_memory_allocated``
over the timed steps; the table gives every round and the medians. Needs a CUDA GPU; both versions must take the calls above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

W3_MODES = {"exact": {}, "og": {"offload_gradients": True},
            "sib": {"offload_gradients": True, "step_in_backward": True},
            "delayed": {"offload_gradients": True, "delayed_param_update": True}}
PEER_MODES = {"torchao": False, "torchao-og": True}  # torchao's CPUOffloadOptimizer: offload_gradients


def run_case(case: str, warmup: int, steps: int) -> dict:
    import torch

    from annotate_offload import HybridDeviceOptimizer, offload_transform
    from annotate_offload.models import GPTConfig, GPTStack

    torch.manual_seed(0)
    if case in ("W1", "W2"):
        hidden, heads, batch, n = (4096, 32, 2, 7) if case == "W1" else (8192, 64, 1, 2)
        model = GPTStack(GPTConfig(hidden=hidden, heads=heads, layers=8), device="cuda", dtype=torch.bfloat16)
        x = torch.randn(batch, 4096, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        offload_transform(model, n, **(dict(release_lag=1, prefetch_layers=1) if case == "W1" else {}))

        def step():
            model(x).float().square().mean().backward()
            model.zero_grad(set_to_none=True)
            x.grad = None
    else:
        model = GPTStack(GPTConfig(hidden=2048, heads=16, layers=24), device="cuda", dtype=torch.float32)
        x = torch.randn(4, 1024, 2048, device="cuda")
        mode = case.split("-", 1)[1]
        if mode in PEER_MODES:
            from _peers import make_torchao_cpu_offload_optimizer

            opt = make_torchao_cpu_offload_optimizer(model.parameters(), lr=1e-4, offload_gradients=PEER_MODES[mode])
            if opt is None:
                raise RuntimeError("torchao does not import")
        else:
            opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=1e-4, **W3_MODES[mode])

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"step_ms": statistics.median(times), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", help="checkout of the other version (its annotate_offload is imported)")
    p.add_argument("--new", default=os.path.dirname(HERE),
                   help="checkout of this version (default: this one)")
    p.add_argument("--cases", default="W1,W2,W3-exact,W3-og")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--time-limit", type=float, metavar="S",
                   help="start no round that would end after S seconds (by the mean process so far); print what ran")
    p.add_argument("--one", nargs=2, metavar=("CHECKOUT", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        sys.path.insert(0, os.path.abspath(args.one[0]))
        print(json.dumps(run_case(args.one[1], args.warmup, args.steps)))
        return
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in ("W1", "W2") and c.removeprefix("W3-") not in {**W3_MODES, **PEER_MODES}]
    if bad or args.rounds < 1 or (args.time_limit is not None and args.time_limit <= 0):
        p.error(f"unknown case {bad[0]!r}" if bad else "--rounds must be >= 1" if args.rounds < 1
                else "--time-limit must be > 0 (seconds)")
    versions = ("new",) if args.old is None else ("old", "new")
    items = []  # (version, case); a peer case runs once per round, with this checkout on the path
    for c in cases:
        items += [("peer", c)] if c.removeprefix("W3-") in PEER_MODES else [(v, c) for v in versions]
    rows: dict = {}
    start, runs = time.monotonic(), 0
    for version, case in (v for r in range(args.rounds) for v in items[r % len(items):] + items[:r % len(items)]):
        spent = time.monotonic() - start  # whole rounds only: stop where the next round would not end in time
        if args.time_limit is not None and runs and runs % len(items) == 0 \
                and spent * (runs + len(items)) / runs > args.time_limit:
            print(f"time limit: {runs // len(items)} of {args.rounds} rounds ran", file=sys.stderr)
            break
        runs += 1
        checkout = os.path.abspath(args.new if version == "peer" else getattr(args, version))
        out = subprocess.run([sys.executable, __file__, "--one", checkout, case,
                              "--warmup", str(args.warmup), "--steps", str(args.steps)],
                             capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([checkout, HERE, os.environ.get("PYTHONPATH", "")])})
        lines = out.stdout.strip().splitlines()
        rows.setdefault((case, version), []).append(json.loads(lines[-1]) if out.returncode == 0 and lines
                                                    else {"error": out.stderr.strip().splitlines()[-1:]})
        print(case, version, rows[(case, version)][-1], file=sys.stderr, flush=True)
    print("| case | version | rounds: step ms / peak GiB | median step ms | max peak GiB |\n|---|---|---|---:|---:|")
    for (case, version), got in rows.items():
        ok = [g for g in got if "step_ms" in g]
        cells = ", ".join(f"{g['step_ms']:.1f} / {g['peak_gib']:.2f}" if "step_ms" in g else "failed" for g in got)
        med = f"{statistics.median(g['step_ms'] for g in ok):.1f}" if ok else "-"
        peak = f"{max(g['peak_gib'] for g in ok):.2f}" if ok else "-"
        print(f"| {case} | {version} | {cells} | {med} | {peak} |")


if __name__ == "__main__":
    main()
