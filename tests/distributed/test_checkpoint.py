"""``torch.distributed.checkpoint`` round trips of model + HybridDeviceOptimizer across world sizes,
parallelisms and offload fractions; every resumed run equals the uninterrupted reference bit for bit.

    1 process, f=1.0, steps 0-1 --save A--> FSDP2 x2, f=0.5,  steps 2-3
    FSDP2 x2, f=0.5, steps 0-1   --save B--> DDP x2,   f=0.25, steps 2-3
                                 --save B--> 1 process, f=0.0, steps 2-3
"""

from __future__ import annotations

import os

import pytest
import torch

from _dist_harness import LR, assert_bitwise, make_model, reference, run_ranks, train_single
from _dist_workers import _offload, checkpoint_suite

from annotate_offload.distributed import load_checkpoint, save_checkpoint
from annotate_offload.optim import HybridDeviceOptimizer

HALF, STEPS = 2, 4


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return reference(STEPS, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("dcp")
    a, b = str(d / "single"), str(d / "fsdp")
    model = _offload(make_model())
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=LR)
    train_single(model, opt, 0, HALF)
    save_checkpoint(model, opt, a)
    ranks = run_ranks(checkpoint_suite, ckpt_single=a, ckpt_fsdp=b, half=HALF, steps=STEPS)
    # back in one process, from the 2-rank FSDP2 checkpoint, with every parameter on the "GPU" side
    model = _offload(make_model())
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.0, lr=LR)
    load_checkpoint(model, opt, b)
    train_single(model, opt, HALF, STEPS)
    return {"ranks": ranks, "single_from_fsdp": {k: v.detach().clone() for k, v in model.state_dict().items()}, "dir": b}


def test_fsdp_resumes_single_process_checkpoint_at_another_fraction(ref, runs):
    for r in runs["ranks"]:
        assert_bitwise(r["fsdp_from_single"]["weights"], ref)


def test_ddp_resumes_fsdp_checkpoint_at_another_fraction(ref, runs):
    for r in runs["ranks"]:
        assert_bitwise(r["ddp_from_fsdp"]["weights"], ref)


def test_single_process_resumes_fsdp_checkpoint_with_nothing_offloaded(ref, runs):
    assert_bitwise(runs["single_from_fsdp"], ref)


def test_checkpoint_has_fraction_independent_keys(runs):
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(runs["dir"]).read_metadata().state_dict_metadata)
    assert "optim.param_groups" in keys
    assert {"optim.state.inp.weight.exp_avg", "optim.state.inp.weight.exp_avg_sq", "optim.state.inp.weight.step"} <= keys
    # fp32 model: masters equal the weights and are not written twice
    assert not any(k.endswith(".master_param") for k in keys)
    assert "model.head.weight" in keys
