"""Bit-exact parity with torch's fused AdamW/Adam on the CPU backend."""

from __future__ import annotations

import copy

import pytest
import torch

from annotate_offload.optim import _hybrid

from _hdo_util import assert_same, loss_of, pair, train
from annotate_offload.optim import HybridDeviceOptimizer

FRACTIONS = [0.0, 0.25, 0.5, 1.0]


def _xs(n=20):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 8, generator=g) for _ in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("f", FRACTIONS)
def test_twenty_steps_two_groups_bit_identical(f, cls, overlap):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, cpu_optimizer_cls=cls,
                                overlap_cpu_optimizer_d2h_h2d=overlap, lr=1e-2, weight_decay=0.05)
    ref = cls(r.groups(), lr=1e-2, weight_decay=0.05, fused=True)
    xs = _xs()
    train(m, opt, xs)
    train(r, ref, xs)
    assert_same(m, r)
    for p, q in zip(m.parameters(), r.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], ref.state[q][k]), k


@pytest.mark.parametrize("f", FRACTIONS)
def test_bf16_params_with_fp32_masters(f):
    m, _ = pair(dtype=torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in m.parameters()]
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, param_update_in_fp32=True, lr=1e-2)
    ref = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    for x in _xs(10):
        loss_of(m, x).backward()
        for p, q in zip(m.parameters(), masters):
            q.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        ref.step()
        for p, q in zip(m.parameters(), masters):
            assert torch.equal(p, q.detach().to(torch.bfloat16))
    for p, q in zip(m.parameters(), masters):
        assert opt.state[p]["master_param"].dtype == torch.float32
        assert torch.equal(opt.state[p]["master_param"], q.detach())
        assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_bf16_params_without_fp32_update_step_in_bf16(f):
    m, r = pair(dtype=torch.bfloat16)
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, lr=1e-2)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    xs = _xs(5)
    train(m, opt, xs)
    train(r, ref, xs)
    assert_same(m, r)


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", ["opt", "torch"])
@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_clipping(f, clip, offload_gradients):
    if clip == "torch" and offload_gradients:
        pytest.skip("torch's clip_grad_norm_ cannot see gradients that were freed on the device (documented)")
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, offload_gradients=offload_gradients, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    xs = _xs(8)
    for x in xs:
        loss_of(m, x).backward()
        loss_of(r, x).backward()
        # the optimizer's norm runs over param_groups order, so the reference does too (stack order)
        n_ref = torch.nn.utils.clip_grad_norm_([p for g in r.groups() for p in g["params"]], 0.05)
        m_params = [p for g in opt.param_groups for p in g["params"]]
        n = opt.clip_grad_norm_(0.05) if clip == "opt" else torch.nn.utils.clip_grad_norm_(m_params, 0.05)
        assert torch.equal(n, n_ref)
        assert n_ref > 0.05  # clipping is active
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(m, r)


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_gradient_accumulation(f, offload_gradients):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, offload_gradients=offload_gradients, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    xs = _xs(6)
    for x in xs:
        for k in range(3):
            loss_of(m, x * (k + 1)).backward()
            loss_of(r, x * (k + 1)).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(m, r)


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_offload_gradients_frees_host_stepped_grads(f, monkeypatch):
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)  # tiny test tensors: the per-gradient hook path
    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, offload_gradients=True, lr=1e-2)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    x = _xs(1)[0]
    loss_of(m, x).backward()
    host = {(pl.group, pl.index) for pl in opt.placements if pl.side == "cpu"}
    for i, p in enumerate(m.parameters()):
        assert (p.grad is None) == ((0, i) in host)
    opt.step()
    loss_of(r, x).backward()
    ref.step()
    assert_same(m, r)


def test_no_zero_grad_between_steps_and_repeated_step():
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    xs = _xs(4)
    for model, o in ((m, opt), (r, ref)):
        for x in xs:
            loss_of(model, x).backward()
            o.step()
            o.step()  # back to back, same gradients, no backward in between
    assert_same(m, r)


def test_closure_called_once():
    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, lr=1e-2)
    calls = []
    x = _xs(1)[0]

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = loss_of(m, x)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and torch.is_tensor(loss)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    loss_of(r, x).backward()
    ref.step()
    assert_same(m, r)


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_loss_scaler_skips_inf_steps(f):
    """GradScaler (unscale in place, skip on inf) works: in-place unscaling is seen by the version check."""
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    s1, s2 = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i, x in enumerate(_xs(6)):
        for model, o, sc in ((m, opt, s1), (r, ref, s2)):
            sc.scale(loss_of(model, x)).backward()
            if i == 2:
                model.l1.weight.grad[0, 0] = float("inf")  # an overflow: this step must be skipped
            sc.unscale_(o)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            sc.step(o)
            sc.update()
            o.zero_grad()
    assert s1.get_scale() == s2.get_scale() < 1024.0
    assert_same(m, r)
    assert opt.state[m.l1.weight]["step"] == 5


class _WithComplex(torch.nn.Module):
    """A Linear and two complex parameters (one with a gradient hook, one batched at step()) in one group."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.lin = torch.nn.Linear(8, 4)
        self.c = torch.nn.Parameter(torch.randn(64, 80, dtype=torch.complex64, generator=g))
        self.c_small = torch.nn.Parameter(torch.randn(6, dtype=torch.complex64, generator=g))

    def forward(self, x):
        return (self.lin(x).square().mean() + torch.view_as_real(self.c).sin().mean()
                + torch.view_as_real(self.c_small).cos().sum())


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("f", FRACTIONS)
def test_complex_parameters_step_like_plain_adamw(f, overlap):
    """Complex parameters do not get our fused=True default, which torch refuses with "`fused=True` requires all
    the params to be floating point". They get torch's default path (what plain torch.optim.AdamW() gives
    them), bit for bit, while the real parameters stay on the fused kernel."""
    import copy

    m = _WithComplex()
    r = copy.deepcopy(m)
    params = [m.lin.weight, m.c, m.lin.bias, m.c_small]
    opt = HybridDeviceOptimizer([{"params": params}], offload_fraction=f, overlap_cpu_optimizer_d2h_h2d=overlap, lr=1e-2)
    ref_real = torch.optim.AdamW([r.lin.weight, r.lin.bias], lr=1e-2, fused=True)
    ref_cplx = torch.optim.AdamW([r.c, r.c_small], lr=1e-2)  # torch's default for complex tensors
    for x in _xs(6):
        m(x).backward()
        r(x).backward()
        opt.step()
        ref_real.step()
        ref_cplx.step()
        opt.zero_grad()
        ref_real.zero_grad()
        ref_cplx.zero_grad()
    assert_same(m, r)
    refs = {**ref_real.state, **ref_cplx.state}
    for p, q in zip(m.parameters(), r.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], refs[q][k]), k
        assert opt.state[p]["step"].device == refs[q]["step"].device
    # the real parameters really are on the fused kernel, the complex ones on torch's default
    for sub in opt.sub_optimizers:
        for g in sub.param_groups:
            assert g["fused"] is (None if g["params"][0].is_complex() else True)
    # the state (step placement per group) survives a checkpoint into another split
    opt2 = HybridDeviceOptimizer([{"params": params}], offload_fraction=1.0 - f, lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    opt.close()
    for x in _xs(2):
        m(x).backward()
        r(x).backward()
        for o in (opt2, ref_real, ref_cplx):
            o.step()
            o.zero_grad()
    assert_same(m, r)


@pytest.mark.parametrize("hooks", [True, False], ids=["hook-per-gradient", "batched-tiny"])
@pytest.mark.parametrize("f", [0.5, 1.0])
def test_offloaded_gradients_are_consumed_by_step_so_model_zero_grad_suffices(f, hooks, monkeypatch):
    # Note [Consumed gradients] (optim/_hybrid.py): HF Trainer zeroes with model.zero_grad(),
    # which cannot reach the host copy (p.grad is None); the next step added onto the last one's
    if hooks:
        monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, offload_gradients=True, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    for x in _xs(4):
        for model, o in ((m, opt), (r, ref)):
            loss_of(model, x).backward()
            o.step()
            model.zero_grad()
    assert_same(m, r)


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_clipping_each_micro_batch_with_offloaded_gradients(f, monkeypatch):
    # a pending clip coefficient applies to the micro-batches clipped, not to the next one added
    # (c*g0 + g1, not c*(g0 + g1)); the norms returned match torch's too
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, offload_gradients=True, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    for x in _xs(3):
        for k in range(3):
            loss_of(m, x * (k + 1)).backward()
            loss_of(r, x * (k + 1)).backward()
            n_opt = opt.clip_grad_norm_(0.05)
            n_ref = torch.nn.utils.clip_grad_norm_([q for g in r.groups() for q in g["params"]], 0.05)  # opt's order
            assert torch.equal(n_opt, n_ref)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert_same(m, r)


def test_zero_grad_keeping_tensors_steps_a_parameter_no_backward_reached(monkeypatch):
    # torch keeps a zero p.grad after zero_grad(set_to_none=False) and AdamW steps it (momentum,
    # weight decay: an MoE expert not routed); the consumed host gradient must do the same
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)

    def run(make):
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
        opt, x = make([a, b]), torch.randn(64)
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            ((b @ x).sum() + ((a @ x).sum() if step == 0 else 0)).backward()
            opt.step()
        return a.detach(), b.detach()

    ref = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    for og in (True, False):
        got = run(lambda ps: HybridDeviceOptimizer(ps, offload_fraction=1.0, lr=1e-2, offload_gradients=og))
        assert all(torch.equal(g, r) for g, r in zip(got, ref)), og


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_a_value_the_class_reads_at_construction_reaches_every_half(f):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, cpu_optimizer_cls=torch.optim.Adagrad, lr=0.1,
                                initial_accumulator_value=1.0)
    ref = torch.optim.Adagrad(r.parameters(), lr=0.1, initial_accumulator_value=1.0)
    train(m, opt, _xs(4))
    train(r, ref, _xs(4))
    assert_same(m, r)


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_offloaded_bf16_gradients_with_fp32_masters_clip_with_torchs_norm(f):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)  # hooked sizes
    r = copy.deepcopy(m)
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, param_update_in_fp32=True,
                                offload_gradients=True, lr=1e-2)
    for _ in range(3):
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        m(x).float().square().mean().backward()
        r(x).float().square().mean().backward()
        assert any(p.grad is None for p in m.parameters())  # held on the host
        assert torch.equal(opt.clip_grad_norm_(0.01), torch.nn.utils.clip_grad_norm_(list(r.parameters()), 0.01))
        opt.step()
        opt.zero_grad()
        r.zero_grad()
        r.load_state_dict(m.state_dict())


def test_delayed_mode_steps_with_the_tensor_lr_of_its_step_while_a_scheduler_moves_it():
    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, delayed_param_update=True,
                                lr=torch.tensor(0.01), chunk_bytes=4096)
    ref = torch.optim.AdamW(r.parameters(), lr=torch.tensor(0.01), fused=True)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (opt, ref)]
    for x in _xs(5):  # the lag is the mode's: the reference sees the same gradients, computed on its own weights
        loss_of(r, x).backward()
        for p, q in zip(m.parameters(), r.parameters()):
            p.grad = q.grad.clone()
        for o, s in zip((opt, ref), scheds):
            o.step()
            o.zero_grad()
            s.step()  # writes the tensor lr in place while the host step of this step may still run
    opt.flush()
    assert_same(m, r)
