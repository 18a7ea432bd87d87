"""DDP (gloo, 2 processes): HybridDeviceOptimizer + activation offload match the single-process reference bit for bit.

One pair of processes runs every scenario (``ddp_suite``): starting processes costs more than the
scenarios themselves on a 2-core machine.
"""

from __future__ import annotations

import pytest
import torch

from _dist_harness import assert_bitwise, reference, run_ranks
from _dist_workers import ddp_suite

STEPS = 3


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return reference(STEPS, 2)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(ddp_suite, steps=STEPS)


def test_ddp_bucket_view_matches_reference_and_copies_in_backward(ref, runs):
    r0, r1 = (r["bucket_view"] for r in runs)
    assert_bitwise(r0["weights"], ref)
    assert_bitwise(r1["weights"], ref)
    assert r0["losses"] != r1["losses"]  # the ranks saw different data
    assert r0["host_params"] > 0
    # every host-stepped gradient was copied in a bucket callback, after its all-reduce; none at step()
    assert r0["copied_in_hook"] == STEPS * r0["host_params"]
    assert r0["copied_at_step"] == 0
    assert r0["warnings"] == []
    assert r0["bytes_per_step"] > 0  # activations were offloaded
    # torchrun's OMP_NUM_THREADS=1 does not shrink the host step below the rank's share
    assert r0["threads"] == r0["budget"]


def test_ddp_without_bucket_view_warns_and_copies_at_step(ref, runs):
    r0, r1 = (r["no_bucket_view"] for r in runs)
    assert_bitwise(r0["weights"], ref)
    assert_bitwise(r1["weights"], ref)
    assert any("gradient_as_bucket_view=True" in w for w in r0["warnings"])
    assert r0["copied_in_hook"] == 0
    assert r0["copied_at_step"] == STEPS * r0["host_params"]


def test_ddp_unattached_optimizer_copies_everything_at_step(ref, runs):
    # Why the comm hook exists: the optimizer's own post-accumulate-grad hooks fire before DDP's
    # all-reduce, so their copies hold this rank's local gradient. DDP then replaces or rescales
    # p.grad, step() notices and copies every host gradient again, after backward: still the right
    # numbers, but none of the D2H overlaps backward.
    r0, r1 = (r["unattached"] for r in runs)
    assert_bitwise(r0["weights"], ref)
    assert r0["copied_at_step"] == STEPS * r0["host_params"]


def test_ddp_step_in_backward_steps_reduced_gradients(ref, runs):
    for r in runs:
        got = r["step_in_backward"]
        assert_bitwise(got["weights"], ref)
        assert got["copied_in_hook"] == STEPS * got["host_params"] and got["copied_at_step"] == 0


def test_ddp_refusals(runs):
    out = runs[0]["refusals"]
    assert out["not_hdo"].startswith("TypeError") and "HybridDeviceOptimizer" in out["not_hdo"]
    assert out["offload_gradients"].startswith("ValueError") and "offload_gradients=True" in out["offload_gradients"]
    assert out["foreign"].startswith("ValueError") and "does not own" in out["foreign"]
