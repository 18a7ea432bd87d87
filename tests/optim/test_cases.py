"""User-reported cases O03-O08 (../shared/cases/README.md) on the CPU backend; O01/O02 are in test_cuda.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from _hdo_util import Tiny, assert_same, inputs, loss_of, pair, train
from annotate_offload.optim import HybridDeviceOptimizer


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_o03_weights_loaded_after_construction(f):
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, param_update_in_fp32=True, lr=1e-2)
    ckpt = Tiny()  # other weights, e.g. a pretrained checkpoint without optimizer state
    m.load_state_dict(ckpt.state_dict())
    ref = torch.optim.AdamW(ckpt.parameters(), lr=1e-2, fused=True)
    xs = inputs(3, 2)
    train(m, opt, xs)
    train(ckpt, ref, xs)
    assert_same(m, ckpt)


def test_o03_reload_model_params_after_data_copy():
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, lr=1e-2)
    ckpt = Tiny()
    for p, q in zip(m.parameters(), ckpt.parameters()):
        p.data.copy_(q.data)  # bypasses the version counter: needs the explicit call
    opt.reload_model_params()
    ref = torch.optim.AdamW(ckpt.parameters(), lr=1e-2, fused=True)
    train(m, opt, inputs(2, 2))
    train(ckpt, ref, inputs(2, 2))
    assert_same(m, ckpt)


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_o04_bf16_model_with_fp32_norm(f):
    m = Tiny(dtype=torch.bfloat16)
    m.norm.float()  # a norm kept in fp32
    masters = [p.detach().float().requires_grad_() for p in m.parameters()]
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, param_update_in_fp32=True, lr=1e-2)
    ref = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    for x in inputs(5, 2):
        h = torch.relu(m.l2(torch.relu(m.l1(x.bfloat16()))))
        out = m.l3(m.norm(h.float()).bfloat16())
        out.float().square().mean().backward()
        for p, q in zip(m.parameters(), masters):
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        opt.zero_grad()
    for p, q in zip(m.parameters(), masters):
        assert p.dtype in (torch.bfloat16, torch.float32)
        assert torch.equal(p, q.detach().to(p.dtype))


@pytest.mark.parametrize("f_load", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("f_save", [0.5, 1.0])
def test_o05_checkpoint_round_trip_weights_only(f_save, f_load):
    m, r = pair(dtype=torch.bfloat16)
    kw = dict(param_update_in_fp32=True, lr=1e-2)
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f_save, **kw)
    ref = HybridDeviceOptimizer(r.groups(), offload_fraction=f_save, **kw)
    xs = inputs(8, 2)
    train(m, opt, xs[:3])
    train(r, ref, xs[:3])
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, buf)
    assert buf.tell() < 200_000  # masters saved as their own tensors, not as whole pinned slabs
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = Tiny(dtype=torch.bfloat16)
    m2.load_state_dict(ck["model"])
    opt2 = HybridDeviceOptimizer(m2.groups(), offload_fraction=f_load, **kw)
    opt2.load_state_dict(ck["optim"])
    train(m2, opt2, xs[3:])
    train(r, ref, xs[3:])
    assert_same(m2, r)
    for p, q in zip(m2.parameters(), r.parameters()):
        assert torch.equal(opt2.state[p]["step"], ref.state[q]["step"])
        assert torch.equal(opt2.state[p]["master_param"], ref.state[q]["master_param"])


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_loading_an_optimizer_state_alone_leaves_the_weights(f):
    # Note [Loading masters]: a same-dtype master is the weight; the model stays the authority
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    xs = inputs(8, 2)
    train(m, opt, xs[:3])
    train(r, ref, xs[:3])
    sd, sd_ref = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())
    train(m, opt, xs[3:6])
    train(r, ref, xs[3:6])
    opt.load_state_dict(sd)
    ref.load_state_dict(sd_ref)
    assert_same(m, r)
    train(m, opt, xs[6:])
    train(r, ref, xs[6:])
    assert_same(m, r)


def test_o05_param_groups_hold_only_plain_values():
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, cpu_optimizer_cls=torch.optim.AdamW, lr=1e-2)
    for g in opt.state_dict()["param_groups"]:
        for k, v in g.items():
            assert not isinstance(v, type), k
    # Megatron's rebuild idiom works
    HybridDeviceOptimizer(m.groups(), **opt.defaults).close()


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_o06_moving_state_and_back(f):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    xs = inputs(6, 2)
    train(m, opt, xs[:3])
    train(r, ref, xs[:3])
    # what RL frameworks do between rollouts: replace every state tensor (and dict) by a moved copy
    for p in list(opt.state):
        opt.state[p] = {k: (v.to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
    train(m, opt, xs[3:])
    train(r, ref, xs[3:])
    assert_same(m, r)
    for p, master in opt.gpu_params_map_cpu_copy.items():
        assert opt.state[p]["master_param"] is master  # re-attached to the pinned host master


def test_o06_step_counter_placement():
    """The fused kernels want ``step`` as fp32 on the parameter's device: a counter restored in
    another dtype is re-cast before the next step, and one already right is kept as is (no copy per
    step)."""
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=1.0, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    xs = inputs(4, 2)
    train(m, opt, xs[:2])
    train(r, ref, xs[:2])
    for st in opt.state.values():
        st["step"] = st["step"].to(torch.float64)  # e.g. a checkpoint written by other code
    train(m, opt, xs[2:3])
    assert all(st["step"].dtype == torch.float32 for st in opt.state.values())
    kept = {p: st["step"] for p, st in opt.state.items()}
    train(m, opt, xs[3:])
    train(r, ref, xs[2:])
    assert_same(m, r)
    assert all(torch.equal(opt.state[p]["step"], ref.state[q]["step"]) for p, q in zip(m.parameters(), r.parameters()))
    assert all(opt.state[p]["step"] is kept[p] for p in kept)  # updated in place, never re-created


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("kind", ["lambda", "onecycle"])
def test_o07_lr_schedulers(kind, overlap):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=overlap, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)

    def sched(o):
        if kind == "lambda":
            return torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[2e-2, 1e-2], total_steps=20)

    s1, s2 = sched(opt), sched(ref)
    for x in inputs(6, 2):
        loss_of(m, x).backward()
        loss_of(r, x).backward()
        opt.step()
        ref.step()
        # lr (and betas for OneCycle) of every sub-optimizer group equal the HDO group's and plain AdamW's
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for sub in opt.sub_optimizers:
            for sg in sub.param_groups:
                g = group_of[id(opt.inner_param_to_orig_param[sg["params"][0]])]
                assert sg["lr"] == g["lr"] and sg["betas"] == g["betas"]
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
        s1.step()
        s2.step()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(m, r)


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("f", [0.5, 1.0])
def test_o08_frozen_and_gradless_params(f, offload_gradients):
    m, r = pair()
    m.l1.bias.requires_grad_(False)
    r.l1.bias.requires_grad_(False)
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, offload_gradients=offload_gradients, lr=1e-2)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    assert all(pl.side == "gpu" for pl in opt.placements if pl.index == 1)  # frozen: never offloaded
    frozen_before = m.l1.bias.detach().clone()
    for i, x in enumerate(inputs(6, 2)):
        for model, o in ((m, opt), (r, ref)):
            h = torch.relu(model.l1(x))
            if i % 2 == 0:  # odd steps skip l2: its params get no gradient at all
                h = torch.relu(model.l2(h))
            model.l3(model.norm(h)).square().mean().backward()
            o.step()
            o.zero_grad()
    assert_same(m, r)
    assert torch.equal(m.l1.bias, frozen_before)
    assert opt.state[m.l2.weight]["step"] == 3


@pytest.mark.parametrize("kw, fused, foreach", [({}, True, None), ({"foreach": True}, None, True)])
def test_state_dict_records_the_implementation_used(kw, fused, foreach):
    """state_dict() records the fused/foreach the sub-optimizers use: torch takes fused/foreach from the loaded
    groups, so without them loading it into torch.optim.AdamW(fused=True) would reset its fused to None and
    the next steps would run another kernel."""
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, lr=1e-2, **kw)
    xs = inputs(6, 2)
    train(m, opt, xs[:3])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # through a file: a loaded state dict must not share tensors with opt
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    for g in sd["param_groups"]:
        assert (g["fused"], g["foreach"], g["capturable"], g["differentiable"]) == (fused, foreach, False, False)
    assert all("fused" not in g for g in opt.param_groups)  # the live groups are not touched
    r.load_state_dict(m.state_dict())
    plain = torch.optim.AdamW(r.groups(), lr=1e-2, **({"fused": True} if fused else kw))
    plain.load_state_dict(sd)
    assert [(g["fused"], g["foreach"]) for g in plain.param_groups] == [(fused, foreach)] * 2
    train(m, opt, xs[3:])
    train(r, plain, xs[3:])
    assert_same(m, r)
    # loading does not switch our implementation: a plain fused AdamW's state dict into a foreach optimizer
    m2 = Tiny()
    m2.load_state_dict(r.state_dict())
    opt2 = HybridDeviceOptimizer(m2.groups(), offload_fraction=0.5, lr=1e-2, foreach=True)
    opt2.load_state_dict(torch.optim.AdamW(Tiny().groups(), lr=1e-2, fused=True).state_dict())
    assert all("fused" not in g and "foreach" not in g for g in opt2.param_groups)
    assert [(g["fused"], g["foreach"]) for g in opt2.state_dict()["param_groups"]] == [(None, True)] * 2


def test_gradient_changed_after_clip_grad_norm_is_clipped_once(monkeypatch):
    """A gradient modified in place after this optimizer's clip_grad_norm_ is copied again at step() and
    clipped once: the clip coefficient is already in the GPU gradient, and applying it to the new copy a
    second time would put the weights 8.7e-3 off torch after one step."""
    from annotate_offload.optim import _hybrid

    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)  # hooked copies, made in backward
    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, lr=1e-2)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    for x in inputs(3, 2):
        for model in (m, r):
            loss_of(model, x).backward()
        opt.clip_grad_norm_(0.01)
        torch.nn.utils.clip_grad_norm_(list(r.parameters()), 0.01)
        for p in (*m.parameters(), *r.parameters()):
            p.grad.mul_(1.0)  # an in-place change after clipping: new version, same values
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(m, r)
    opt.close()
