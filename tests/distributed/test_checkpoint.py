"""``torch.distributed.checkpoint`` round trips of model + HybridDeviceOptimizer across world sizes,
parallelisms and offload fractions; every resumed run equals the uninterrupted reference bit for bit.

    1 process, f=1.0, steps 0-1 --save A--> FSDP2 x2, f=0.5,  steps 2-3
    FSDP2 x2, f=0.5, steps 0-1   --save B--> DDP x2,   f=0.25, steps 2-3
                                 --save B--> 1 process, f=0.0, steps 2-3
"""

from __future__ import annotations


import pytest
import torch

from _dist_harness import LR, assert_bitwise, make_model, run_ranks, train_single
from _dist_workers import _offload, checkpoint_suite

from annotate_offload.distributed import load_checkpoint, save_checkpoint
from annotate_offload.optim import HybridDeviceOptimizer

HALF, STEPS = 2, 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("dcp")
    a, b, c = str(d / "single"), str(d / "fsdp"), str(d / "ddp")
    model = _offload(make_model())
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=LR)
    train_single(model, opt, 0, HALF)
    save_checkpoint(model, opt, a)
    ranks = run_ranks(checkpoint_suite, ckpt_single=a, ckpt_fsdp=b, half=HALF, steps=STEPS, ckpt_ddp=c)
    # back in one process, from the 2-rank FSDP2 checkpoint, with every parameter on the "GPU" side
    model = _offload(make_model())
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.0, lr=LR)
    load_checkpoint(model, opt, b)
    train_single(model, opt, HALF, STEPS)
    single_from_fsdp = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # one process from the sharded-DDP checkpoint (each rank wrote its own chunks' host state)
    model = _offload(make_model())
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=LR)
    load_checkpoint(model, opt, c)
    train_single(model, opt, HALF, STEPS)
    return {"ranks": ranks, "single_from_fsdp": single_from_fsdp, "dir": b, "ddp_dir": c,
            "single_from_ddp": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.slow
def test_fsdp_resumes_single_process_checkpoint_at_another_fraction(ref, runs):
    for r in runs["ranks"]:
        assert_bitwise(r["fsdp_from_single"]["weights"], ref)


@pytest.mark.slow
def test_ddp_resumes_fsdp_checkpoint_at_another_fraction(ref, runs):
    for r in runs["ranks"]:
        assert_bitwise(r["ddp_from_fsdp"]["weights"], ref)


@pytest.mark.slow
def test_single_process_resumes_fsdp_checkpoint_with_nothing_offloaded(ref, runs):
    assert_bitwise(runs["single_from_fsdp"], ref)


@pytest.mark.slow
def test_single_process_resumes_sharded_ddp_checkpoint(ref, runs):
    """Note [Host-step sharding]: each DDP rank saved the state of the chunks it steps; together they
    hold every parameter's state, and one process resumes it bit for bit."""
    import torch.distributed.checkpoint as dcp

    o0, o1 = (r["ddp_save"]["owned"] for r in runs["ranks"])
    assert o0 and o1 and set(o0).isdisjoint(o1)
    keys = set(dcp.FileSystemReader(runs["ddp_dir"]).read_metadata().state_dict_metadata)
    names = [k for k, _ in make_model().named_parameters()]
    for n in names:
        assert {f"optim.state.{n}.exp_avg", f"optim.state.{n}.exp_avg_sq", f"optim.state.{n}.step"} <= keys, n
    assert_bitwise(runs["single_from_ddp"], ref)


@pytest.mark.slow
def test_checkpoint_has_fraction_independent_keys(runs):
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(runs["dir"]).read_metadata().state_dict_metadata)
    assert "optim.param_groups" in keys
    assert {"optim.state.inp.weight.exp_avg", "optim.state.inp.weight.exp_avg_sq", "optim.state.inp.weight.step"} <= keys
    # fp32 model: masters equal the weights and are not written twice
    assert not any(k.endswith(".master_param") for k in keys)
    assert "model.head.weight" in keys


def test_bf16_fp32_masters_round_trip_across_fractions(tmp_path):
    # bf16 weights with fp32 masters: the masters carry information the weights do not, so they are
    # written, and land in the new optimizer's masters whichever side steps them now.
    model = make_model(torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=LR, param_update_in_fp32=True)
    train_single(model, opt, 0, 1)
    save_checkpoint(model, opt, str(tmp_path))
    want = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
    assert all("master_param" in st and st["master_param"].dtype == torch.float32 for st in want.values())

    model2 = make_model(torch.bfloat16)
    opt2 = HybridDeviceOptimizer(model2.parameters(), offload_fraction=1.0, lr=LR, param_update_in_fp32=True)
    load_checkpoint(model2, opt2, str(tmp_path))
    for i, p in enumerate(model2.parameters()):
        got = opt2.state[p]
        assert set(got) == set(want[i])
        for k in want[i]:
            torch.testing.assert_close(got[k], want[i][k], rtol=0, atol=0, check_device=False)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    # and the two continue identically
    train_single(model, opt, 1, 2)
    train_single(model2, opt2, 1, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_load_rejects_a_model_with_other_parameters(tmp_path):
    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=LR)
    train_single(model, opt, 0, 1)
    save_checkpoint(model, opt, str(tmp_path))
    model2 = make_model()
    groups = [{"params": list(model2.layers.parameters())}, {"params": [*model2.inp.parameters(), *model2.head.parameters()]}]
    opt2 = HybridDeviceOptimizer(groups, offload_fraction=0.5, lr=LR)
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match="param groups"):
        load_checkpoint(model2, opt2, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))  # nothing was loaded


def test_load_of_a_checkpoint_without_an_optimizer_part_changes_no_weight(tmp_path):
    import torch.distributed.checkpoint as dcp

    from annotate_offload.errors import OffloadError

    dcp.save({"model": make_model().state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OffloadError, match="param_groups"):
        load_checkpoint(model, HybridDeviceOptimizer(model.parameters(), lr=LR), str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_load_into_other_shapes_names_them_and_loads_nothing(tmp_path):
    from torch import nn

    saved = nn.Sequential(nn.Linear(16, 33))
    save_checkpoint(saved, HybridDeviceOptimizer(saved.parameters(), lr=LR), str(tmp_path))
    other = nn.Sequential(nn.Linear(16, 40))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match=r"holds another model: 0.weight: \(33, 16\) there, \(40, 16\) here"):
        load_checkpoint(other, HybridDeviceOptimizer(other.parameters(), lr=LR), str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


def test_load_into_another_architecture_names_the_keys_and_loads_nothing(tmp_path):
    from torch import nn

    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=LR)
    save_checkpoint(model, opt, str(tmp_path))
    other = nn.Sequential(nn.Linear(8, 16))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match=r"holds another model: missing \['0.bias', '0.weight'\]"):
        load_checkpoint(other, HybridDeviceOptimizer(other.parameters(), lr=LR), str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
