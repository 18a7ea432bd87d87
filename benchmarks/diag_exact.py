"""Diagnostic: which schedules give gradients bit-identical to no offload on W1-like shapes.

Run on a GPU: python benchmarks/diag_exact.py [--layers 8] [--hidden 4096] [--tokens 4096]
Pins SDPBackend.EFFICIENT_ATTENTION (bit-reproducible backward) and reports, per config, whether
the output and every gradient match the baseline, which layers differ, and runtime stats.
Variants with a device synchronize around every reload separate ordering races from logic bugs.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from annotate_offload.models.gpt import GPTConfig, GPTStack
from annotate_offload.testing import bit_reproducible
from annotate_offload.runtime import DefaultOffloadSynchronizer
from annotate_offload.runtime import _layer_state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(hidden=args.hidden, heads=args.heads, layers=args.layers)
    model = GPTStack(cfg).cuda().to(torch.bfloat16)
    x = torch.randn(args.batch, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    L = args.layers

    def step(sync):
        for p in model.parameters():
            p.grad = None
        with bit_reproducible():
            h = x
            for i, layer in enumerate(model.layers):
                if sync:
                    sync.enter_layer(i)
                h = layer(h)
                if sync:
                    h = sync.commit_layer(h, i)
            h.backward(g)
        torch.cuda.synchronize()
        return h.detach(), [p.grad.clone() for p in model.parameters()]

    ref_out, ref_grads = step(None)
    again_out, again_grads = step(None)
    same = torch.equal(ref_out, again_out) and all(map(torch.equal, ref_grads, again_grads))
    print(f"baseline reproducible: {same}")
    names = [n for n, _ in model.named_parameters()]
    orig_reload = _layer_state._LayerState.start_reload

    def synced_reload(self):
        torch.cuda.synchronize()
        orig_reload(self)
        torch.cuda.synchronize()

    rows = []
    for lag in (0, 1):
        for k in (0, 1, 2):
            for synced in (False, True):
                _layer_state._LayerState.start_reload = synced_reload if synced else orig_reload
                results = []
                for rep in range(3):
                    sync = DefaultOffloadSynchronizer(L, L - 1, release_lag=lag, prefetch_layers=k)
                    out, grads = step(sync)
                    bad = sorted({names[i].split(".")[1] for i, (a, b) in enumerate(zip(grads, ref_grads)) if not torch.equal(a, b)})
                    results.append((torch.equal(out, ref_out), bad, sync.stats.on_demand_reloads))
                rows.append((lag, k, synced, results))
                print(f"lag={lag} prefetch={k} synced={synced}: " + "; ".join(
                    f"out_eq={o} bad_layers={b} on_demand={d}" for o, b, d in results), flush=True)
    _layer_state._LayerState.start_reload = orig_reload


if __name__ == "__main__":
    main()
