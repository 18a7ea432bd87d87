"""Diagnostic for the illegal memory access seen once after the W2 offload_transform row.

Run on a GPU: python benchmarks/diag_illegal.py [--blocking]
Replays the benchmark's sequence for W2 (hidden 8192, 64 heads, 8 layers, 1 x 4096 tokens, bf16,
offload 2, release_lag=1, prefetch_layers=2): an exactness step under bit_reproducible(), timed
steps with a device synchronize after each, remove_offload, gc, synchronize, empty_cache; then the
same through DefaultOffloadSynchronizer with start_offload on layer inputs. Prints where it fails.
"""

from __future__ import annotations

import gc
import sys

import torch

from annotate_offload.annotate import offload_transform, remove_offload
from annotate_offload.models.gpt import GPTConfig, GPTStack
from annotate_offload.runtime import DefaultOffloadSynchronizer, start_offload
from annotate_offload.testing import bit_reproducible


def stage(name, fn):
    try:
        fn()
        torch.cuda.synchronize()
        print(f"ok: {name}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"FAILED at {name}: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        sys.exit(1)


def main() -> None:
    hidden, heads, layers, tokens = 8192, 64, 8, 4096
    if "--small" in sys.argv:
        hidden, heads, tokens = 2048, 16, 2048
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=hidden, heads=heads, layers=layers)).cuda().to(torch.bfloat16)
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)

    def step(fwd):
        y = fwd(x)
        torch.autograd.backward(y, g)

    offload_transform(model, num_layers=2, release_lag=1, prefetch_layers=2)

    def exact():
        with bit_reproducible():
            step(model)

    stage("transform exactness step", exact)
    for i in range(5):
        stage(f"transform step {i}", lambda: step(model))
    stage("remove_offload", lambda: remove_offload(model))
    stage("gc", gc.collect)
    stage("empty_cache", torch.cuda.empty_cache)

    sync = DefaultOffloadSynchronizer(layers, 2, release_lag=1, prefetch_layers=2)

    def fwd(h):
        for i, layer in enumerate(model.layers):
            sync.enter_layer(i)
            if i < 2 and h.requires_grad:
                start_offload(h)
            h = sync.commit_layer(layer(h), i)
        return h

    for i in range(5):
        stage(f"sync+start_offload step {i}", lambda: step(fwd))
    del sync
    stage("gc 2", gc.collect)
    stage("empty_cache 2", torch.cuda.empty_cache)
    print("no fault", flush=True)


if __name__ == "__main__":
    main()
