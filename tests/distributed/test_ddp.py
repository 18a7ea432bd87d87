"""DDP (gloo, 2 processes): HybridDeviceOptimizer + activation offload match the single-process reference bit for bit.

One pair of processes runs every scenario (``ddp_suite``): starting processes costs more than the
scenarios themselves on a 2-core machine.
"""

from __future__ import annotations

import pytest
import torch

from _dist_harness import assert_bitwise, run_ranks
from _dist_workers import ddp_suite

pytestmark = pytest.mark.slow  # two processes (spawn) per module
STEPS = 3


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(ddp_suite, steps=STEPS)


def test_ddp_bucket_view_matches_reference_and_copies_in_backward(ref, runs):
    r0, r1 = (r["bucket_view"] for r in runs)
    assert_bitwise(r0["weights"], ref)
    assert_bitwise(r1["weights"], ref)
    assert r0["losses"] != r1["losses"]  # the ranks saw different data
    assert r0["host_params"] > 0
    # every gradient this rank steps on the host was copied in a bucket callback, after its
    # all-reduce; none at step()
    assert r0["copied_in_hook"] == STEPS * r0["owned_host_params"]
    assert r1["copied_in_hook"] == STEPS * r1["owned_host_params"]
    assert r0["copied_at_step"] == r1["copied_at_step"] == 0
    assert r0["warnings"] == []
    assert r0["bytes_per_step"] > 0  # activations were offloaded
    # torchrun's OMP_NUM_THREADS=1 does not shrink the host step below the rank's share
    assert r0["threads"] == r0["budget"]


def test_ddp_host_step_is_sharded_across_ranks(ref, runs):
    """Note [Host-step sharding]: each rank runs the host step of its own chunks only, the two
    shares are disjoint and cover every chunk, the weights are broadcast from their owners (both
    ranks equal the reference bit for bit, above), and the optimizer's own state_dict refuses."""
    r0, r1 = (r["bucket_view"] for r in runs)
    assert r0["chunks"] >= 4
    assert r0["stepped_chunks"] == r0["owned_chunks"] and r1["stepped_chunks"] == r1["owned_chunks"]
    assert set(r0["owned_chunks"]).isdisjoint(r1["owned_chunks"])
    assert sorted(r0["owned_chunks"] + r1["owned_chunks"]) == list(range(r0["chunks"]))
    assert 0 < r0["owned_host_params"] < r0["host_params"]
    assert r0["owned_host_params"] + r1["owned_host_params"] == r0["host_params"]
    assert r0["broadcasts"] == STEPS * r0["host_params"]
    assert r0["state_dict"].startswith("OffloadError") and "save_checkpoint" in r0["state_dict"]
    # the serial path (overlap off) shards the same way
    for r in runs:
        assert_bitwise(r["serial"]["weights"], ref)
        assert r["serial"]["stepped_chunks"] == r["serial"]["owned_chunks"]


def test_ddp_replicated_host_step_when_asked(ref, runs):
    for r in runs:
        got = r["replicated"]
        assert_bitwise(got["weights"], ref)
        assert got["stepped_chunks"] == list(range(got["chunks"])) and got["owned_chunks"] is None
        assert got["state_dict"] == "ok"


def test_ddp_without_bucket_view_warns_and_copies_at_step(ref, runs):
    r0, r1 = (r["no_bucket_view"] for r in runs)
    assert_bitwise(r0["weights"], ref)
    assert_bitwise(r1["weights"], ref)
    assert any("gradient_as_bucket_view=True" in w for w in r0["warnings"])
    assert r0["copied_in_hook"] == 0
    assert r0["copied_at_step"] == STEPS * r0["owned_host_params"]


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
        assert got["copied_in_hook"] == STEPS * got["owned_host_params"] and got["copied_at_step"] == 0
        assert got["stepped_chunks"] == got["owned_chunks"]


def test_ddp_refusals(runs):
    out = runs[0]["refusals"]
    assert out["not_hdo"].startswith("TypeError") and "HybridDeviceOptimizer" in out["not_hdo"]
    assert out["offload_gradients"].startswith("ValueError") and "offload_gradients=True" in out["offload_gradients"]
    assert out["foreign"].startswith("ValueError") and "does not own" in out["foreign"]
    assert out["delayed_sharded"].startswith("ValueError") and "shard_host_step=False" in out["delayed_sharded"]
    assert out["twice"].startswith("OffloadError") and "once per DDP model" in out["twice"]
