"""FSDP2 ``fully_shard`` (gloo, 2 processes, CPU): HybridDeviceOptimizer on DTensor shards + activation offload.

Each rank steps its own local shard; the result equals the single-process reference bit for bit.
One pair of processes runs every scenario (``fsdp_suite``).
"""

from __future__ import annotations

import pytest
import torch

from _dist_harness import LR, assert_bitwise, batches, loss_fn, make_model, run_ranks
from _dist_workers import fsdp_suite

from annotate_offload.config import ModelConfig

pytestmark = pytest.mark.slow  # two processes (spawn) per module
STEPS = 3
_CONFIG = ModelConfig(cpu_offloading=True, min_offload_numel=1, prefetch_layers=1)  # tiny activations move too


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(fsdp_suite, steps=STEPS)


def test_fsdp_half_offload_matches_reference(ref, runs):
    r0, r1 = (r["half"] for r in runs)
    assert_bitwise(r0["weights"], ref)
    assert_bitwise(r1["weights"], ref)
    # each rank offloads its own shard: local shapes, uneven for the 5-row head (3 + 2 rows)
    p0 = {(p.group, p.index): p for p in r0["placements"]}
    p1 = {(p.group, p.index): p for p in r1["placements"]}
    assert p0[(0, 0)].shape == p1[(0, 0)].shape == (8, 8)  # inp.weight 16x8 split in rows
    head_w = max(p0)[0], max(p0)[1] - 1
    assert (p0[head_w].shape, p1[head_w].shape) == ((3, 16), (2, 16))
    assert {p.side for p in r0["placements"]} == {"cpu", "gpu"}
    # FSDP2 runs the optimizer's hooks after the reduce-scatter: every host D2H started in backward
    assert r0["copied_at_step"] == r1["copied_at_step"] == 0


def test_fsdp_full_offload_with_offloaded_gradients_matches_reference(ref, runs):
    for r in runs:
        assert_bitwise(r["all_offload_grads"]["weights"], ref)
        assert {p.side for p in r["all_offload_grads"]["placements"]} == {"cpu"}


def test_fsdp_step_in_backward_matches_reference(ref, runs):
    # FSDP2 runs the shard's post-accumulate-grad hooks after the reduce-scatter, so chunks stepped
    # in backward see reduced gradients
    for r in runs:
        assert_bitwise(r["step_in_backward"]["weights"], ref)


def test_fsdp_unsharded_parameters_are_never_offloaded(runs):
    # FSDP2 registers the all-gathered (unsharded) weights as the layer's parameters during
    # forward; the runtime keeps them (they are parameters) and frees nothing FSDP reshards.
    # The bytes moved per step equal those of the same model without FSDP: activations only.
    from annotate_offload.annotate import offload_transform

    model = offload_transform(make_model(), 2, config=_CONFIG)
    loss_fn(model(batches(1, 2)[0][0])).backward()
    want = model.offload_plan.bytes_per_step
    assert want > 0
    for r in runs:
        assert r["half"]["bytes_per_step"] == want


@pytest.mark.parametrize("kind", ["mp", "autocast"])
def test_fsdp_low_precision_weights_are_never_offloaded(runs, kind):
    # mp: MixedPrecisionPolicy(param_dtype=bf16) all-gathers bf16 unsharded weights; autocast: fp32
    # unsharded weights cast to bf16 per op. Either way the saved weights (and their casts) stay:
    # offloading changes no bit, and moves exactly the bytes the same computation moves in one
    # process, where no parameter is ever offloaded.
    from annotate_offload.annotate import offload_transform

    for r in runs:
        assert_bitwise(r[kind]["weights"], r[f"{kind}_plain"]["weights"])
        assert r[kind]["losses"] == r[f"{kind}_plain"]["losses"]
    single = offload_transform(make_model(torch.bfloat16 if kind == "mp" else torch.float32), 2, config=_CONFIG)
    x = batches(1, 2)[0][0]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
        out = single(x.to(torch.bfloat16) if kind == "mp" else x)
    loss_fn(out).backward()
    assert runs[0][kind]["bytes_per_step"] == single.offload_plan.bytes_per_step > 0


def test_fsdp_global_clip_matches_reference(runs):
    # annotate_offload.distributed.clip_grad_norm_ uses the global norm over the DTensor shards and
    # multiplies each gradient in place, so the optimizer re-copies the clipped gradients at step()
    # (torch's foreach multiply leaves no version trace on DTensor gradients and the host would step
    # the unclipped copy). Reference: clip the averaged full gradients, then step.
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for xs in batches(STEPS, 2):
        grads = []
        for x in xs:
            model.zero_grad(set_to_none=True)
            loss_fn(model(x)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    want = {k: v.detach() for k, v in model.state_dict().items()}
    for r in runs:
        got = r["clipped"]["weights"]
        # the norm is reduced across ranks (a different summation order than one process): not bitwise
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        # every clipped host-stepped gradient was copied again at step(), none in the unclipped run
        n_host = sum(p.side == "cpu" for p in r["clipped"]["placements"])
        assert r["clipped"]["recopied"] == r["clipped"]["copied_at_step"] == STEPS * n_host
        assert r["half"]["recopied"] == 0


def test_fsdp_refuses_the_optimizers_shard_local_clip(runs):
    msg = runs[0]["half"]["clip_refused"]
    assert "only this rank's shard" in msg and "annotate_offload.distributed.clip_grad_norm_" in msg


def test_fsdp_refuses_a_second_attachment(runs):
    assert "attached to an FSDP2 model already" in runs[0]["half"]["attached_twice"]


@pytest.mark.parametrize("case", ["replaced", "replaced_fp32_master"])
def test_fsdp_replaced_local_shard_is_an_error(runs, case):
    # replaced: a host-stepped parameter; replaced_fp32_master: one the device half steps through an
    # fp32 master (param_update_in_fp32=True) and copies back into the local shard
    msg = runs[0][case]
    assert "'inp.weight'" in msg and "other storage" in msg
