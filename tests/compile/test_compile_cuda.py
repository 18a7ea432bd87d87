"""GPU: torch.compile (default backend, inductor) of a transformed model saves what it offloads, exactly.

Two bf16 ``GPTStack`` workloads shaped like the benchmarks' W1 and W2, smaller. The memory and
exactness test uses 4 layers: a cold inductor compile of the whole stack costs seconds per layer,
and the pass does per layer what 4 layers already show, so more layers only cost time:

* W1-like: hidden 1024, 8 heads, 1 x 4096 tokens, 2 layers offloaded with
  ``prefetch_layers=1, release_lag=1``;
* W2-like: hidden 2048, 16 heads, 1 x 1024 tokens, 1 layer offloaded with the default schedule
  (chosen from the link, at most TransformerEngine's gap L - N - 1 = 2).

The step-time test keeps the 8-layer shapes (W1: hidden 2048, 16 heads, 4096 tokens, 6 offloaded;
W2: hidden 4096, 32 heads, 2048 tokens, 2 offloaded), where a step time means something; it is
``slow``.

For each: the peak over a step of the compiled model with offload is below the compiled model's
without it by at least 90% of the bytes the runtime offloads per step, and the gradients are
bit-identical to the compiled baseline's, whose two runs are bit-identical too (SDPA pinned to the
efficient backend with deterministic algorithms: ``annotate_offload.testing.bit_reproducible``).
The compiled step is no slower than the eager transformed model's with the same plan (default SDPA,
median of 5 steps). Gradient buffers exist before the runs, so peaks measure activations.

Run on the GPU machine: ``python3 -m pytest -q -s -m cuda tests/compile/test_compile_cuda.py``
"""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch

from annotate_offload.annotate import offload_transform
from annotate_offload.compile import compiled_offloads
from annotate_offload.models import GPTConfig, GPTStack
from annotate_offload.testing import bit_reproducible

pytestmark = [
    pytest.mark.cuda,
    # strict: once the eager branch is lifted these pass, and XPASS fails the run until this mark goes
    pytest.mark.xfail(strict=True,
                      reason="layers called with CUDA tensors run eagerly under torch.compile until the pass's "
                             "stream ordering has run on a GPU: remove that branch of LayerForward.__call__ "
                             "(Note [Traced layers]) and run this file on the GPU machine"),
]

WORKLOADS = {  # the memory and exactness test
    "W1": dict(layers=4, hidden=1024, heads=8, tokens=4096, n=2, schedule=dict(prefetch_layers=1, release_lag=1)),
    "W2": dict(layers=4, hidden=2048, heads=16, tokens=1024, n=1, schedule={}),
}
TIMED = {  # the step-time test (slow)
    "W1": dict(layers=8, hidden=2048, heads=16, tokens=4096, n=6, schedule=dict(prefetch_layers=1, release_lag=1)),
    "W2": dict(layers=8, hidden=4096, heads=32, tokens=2048, n=2, schedule={}),
}


def _model_and_input(w: dict):
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=w["hidden"], heads=w["heads"], layers=w["layers"]), device="cuda",
                     dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, torch.randn(1, w["tokens"], w["hidden"], device="cuda", dtype=torch.bfloat16)


def _step(model, run, x):
    """One exact fwd/bwd through ``run``; returns (peak bytes above the start, grads)."""
    for p in model.parameters():
        p.grad.zero_()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with bit_reproducible():
        run(x).float().square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, [p.grad.clone() for p in model.parameters()]


def _step_ms(run, x, steps: int = 5) -> float:
    times = []
    for _ in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(x).float().square().mean().backward()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_compiled_offload_lowers_the_peak_by_the_offloaded_bytes_exactly(name):
    w = WORKLOADS[name]
    model, x = _model_and_input(w)
    ref = copy.deepcopy(model)
    compiled_ref = torch.compile(ref)
    _step(ref, compiled_ref, x)  # compile
    base_peak, ref_grads = _step(ref, compiled_ref, x)
    reproducible = all(torch.equal(a, b) for a, b in zip(_step(ref, compiled_ref, x)[1], ref_grads))
    del ref, compiled_ref
    offload_transform(model, w["n"], **w["schedule"])
    compiled = torch.compile(model)
    _step(model, compiled, x)  # compile; pinned host buffers are allocated on the first step
    peak, grads = _step(model, compiled, x)
    stats = model.offload_plan.runtime.stats
    (report,) = compiled_offloads(model)
    print(f"{name}: compiled peak {base_peak / 2**30:.2f} -> {peak / 2**30:.2f} GiB (saved "
          f"{(base_peak - peak) / 2**30:.2f}, offloaded {stats.bytes_offloaded / 2**30:.2f} GiB/step, reported "
          f"{report.offloaded_bytes / 2**30:.2f}); baseline bit-reproducible: {reproducible}; {stats}")
    assert stats.bytes_offloaded == report.offloaded_bytes > 0
    assert set(stats.bytes_offloaded_per_layer) == set(range(w["n"]))
    assert base_peak - peak >= 0.9 * stats.bytes_offloaded
    assert reproducible  # bit_reproducible() pins SDPA and deterministic algorithms
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


@pytest.mark.slow  # a throughput check at the benchmark's scale (8 layers, cold compiles)
@pytest.mark.parametrize("name", list(TIMED))
def test_compiled_offload_step_is_no_slower_than_eager_offload(name):
    w = TIMED[name]
    model, x = _model_and_input(w)
    offload_transform(model, w["n"], **w["schedule"])
    eager_ms = _step_ms(model, x)
    compiled_ms = _step_ms(torch.compile(model), x)
    print(f"{name}: step {eager_ms:.1f} ms eager offload, {compiled_ms:.1f} ms compiled offload; "
          f"{model.offload_plan.runtime.stats}")
    # while the layers run eagerly both steps are the eager one and the comparison below is a coin
    # toss (a strict xfail would XPASS half the time): fail here, deterministically, until they compile
    assert any(r.offloaded_bytes for r in compiled_offloads(model)), "no offload was compiled: both steps are eager"
    assert compiled_ms <= eager_ms
