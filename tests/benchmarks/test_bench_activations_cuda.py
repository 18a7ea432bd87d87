"""benchmarks/activations.py on a GPU (``pytest -m cuda`` on the GPU machine): a small W1 offloads exactly."""

from types import SimpleNamespace

import pytest
import torch

import activations as bench
from _timing import copy_bandwidth

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Big enough that the runtime's default min_offload_numel (256K) applies, small enough for seconds.
_SMALL = bench.Workload("W1", "PCIe-bound (small)", 4, 1024, 8, 2, 1024, 3)


def test_pinned_copy_bandwidth_is_measured_each_way():
    bw = copy_bandwidth(torch.device("cuda"), nbytes=256 << 20, repeats=3)
    assert bw.pinned and bw.d2h_gbps > 1 and bw.h2d_gbps > 1


def test_small_w1_on_gpu_offloads_exactly_and_saves_memory():
    args = SimpleNamespace(tiny=False, warmup=1, steps=3, release_lag=[1], prefetch_layers=[1], budget=[0.05],
                           profile=None)
    rep = bench.run_workload(_SMALL, args, torch.device("cuda"))
    base = rep.baseline
    assert base.exact == "yes"  # the reference is reproducible under the pinned SDPA backend
    ours = [r for r in rep.rows if r.kind == "ours"]
    assert ours and all(r.error is None for r in ours), [r.error for r in ours]
    for r in ours:
        assert r.exact == "yes", r.name  # offloading is a copy: bit-identical output and grads
        assert 0 < r.offloaded_bytes <= rep.saved_bytes
        assert r.times.peak_bytes < 0.9 * base.times.peak_bytes, (r.name, r.times.peak_bytes, base.times.peak_bytes)
    for name in ("save_on_cpu", "checkpoint (3 layers)"):  # measured; their exactness is reported, not required
        row = next(r for r in rep.rows if r.name == name)
        assert row.error is None and row.exact.split()[0] in ("yes", "no"), (name, row.error)
    assert rep.floor_ms > 0 and rep.device == torch.cuda.get_device_name()


@pytest.mark.xfail(strict=True, reason="the memory model over-predicts this stack's smallest feasible peak by about "
                   "1% (673.9 MB against full recompute's measured 665.5 MB on an H200), so it refuses the budget")
def test_small_w1_budget_plan_stays_near_the_reference_peak():
    args = SimpleNamespace(tiny=False, warmup=1, steps=3, budget=["ref"], rounds=1)
    rep = bench.run_budgets(_SMALL, args, torch.device("cuda"))
    reference, plan = rep.rows[1], rep.rows[2]
    assert plan.times and plan.predicted.prediction.peak_bytes <= reference.peak, plan.error
    assert plan.peak <= 1.10 * reference.peak  # Note [Planner memory model]'s error bars
    print(bench.format_budgets(rep, "test"))
