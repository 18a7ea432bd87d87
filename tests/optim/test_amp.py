"""HybridDeviceOptimizer under torch.amp.GradScaler (Note [GradScaler] in annotate_offload/optim/_hybrid.py).

GradScaler's unscale_ rescales p.grad in place without bumping its version, so the hooks' host
copies must not be stepped still scaled. On the CPU test backend every result must equal the same
torch optimizer class under its own GradScaler, bit for bit, including a skipped inf step and a
step retried after a host chunk failed.
"""

from __future__ import annotations

import pytest
import torch

from annotate_offload.errors import OffloadError
from annotate_offload.optim import HybridDeviceOptimizer, _hybrid

from _hdo_util import FailsOnce, assert_same, loss_of, pair


@pytest.fixture(autouse=True)
def _hook_every_gradient(monkeypatch):
    # the Tiny model's tensors are all under 4096 elements, which are copied at step() (after any
    # unscale_); with a hook each, every host copy is made in backward, where the bug was
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)


def _xs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=g) for _ in range(n)]


def _run(model, opt, xs, *, inf_at=(), unscale_and_clip=None):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    for i, x in enumerate(xs):
        loss = loss_of(model, x)
        if i in inf_at:
            loss = loss * float("inf")  # inf/NaN gradients: the scaler skips the step and backs off
        scaler.scale(loss).backward()
        if unscale_and_clip is not None:
            scaler.unscale_(opt)
            unscale_and_clip(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler.get_scale()


CLASSES = [
    pytest.param(torch.optim.AdamW, {}, {"fused": True}, id="AdamW-fused"),  # unscaled inside the fused kernel
    pytest.param(torch.optim.SGD, {"momentum": 0.9}, {"momentum": 0.9}, id="SGD"),  # GradScaler's unscale_ path
]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("f", [0.5, 1.0])
@pytest.mark.parametrize("cls, kw, ref_kw", CLASSES)
def test_gradscaler_steps_like_torch(f, overlap, cls, kw, ref_kw):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, overlap_cpu_optimizer_d2h_h2d=overlap,
                                cpu_optimizer_cls=cls, lr=1e-2, **kw)
    ref = cls(r.groups(), lr=1e-2, **ref_kw)
    xs = _xs(6)
    before = [p.detach().clone() for p in m.parameters()]
    s_ours = _run(m, opt, xs, inf_at=(2,))
    s_ref = _run(r, ref, xs, inf_at=(2,))
    assert s_ours == s_ref
    assert_same(m, r)
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    for p, q in zip(m.parameters(), r.parameters()):
        for k, v in ref.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    opt.close()


def test_gradscaler_inf_step_changes_nothing():
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, lr=1e-2)
    _run(m, opt, _xs(1))
    state = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    weights = [p.detach().clone() for p in m.parameters()]
    _run(m, opt, _xs(1, seed=1), inf_at=(0,))
    assert all(torch.equal(a, b) for a, b in zip(weights, m.parameters()))
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(v, state[p][k]), k
    opt.close()


@pytest.mark.parametrize("clip", ["opt", "torch"])
def test_gradscaler_unscale_then_clip_recopies_the_gradients(clip):
    """scaler.unscale_(opt) then clipping: step() sees grad_scale=None and copies every gradient again."""
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=1.0, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    in_order = lambda model: [p for g in model.groups() for p in g["params"]]  # noqa: E731 - the norm's summation order
    xs = _xs(5)
    if clip == "opt":
        _run(m, opt, xs, unscale_and_clip=lambda o: o.clip_grad_norm_(0.05))
    else:
        _run(m, opt, xs, unscale_and_clip=lambda o: torch.nn.utils.clip_grad_norm_(in_order(m), 0.05))
    _run(r, ref, xs, unscale_and_clip=lambda o: torch.nn.utils.clip_grad_norm_(in_order(r), 0.05))
    assert_same(m, r)
    opt.close()


def test_gradscaler_with_delayed_update_equals_no_scaler():
    """fp32 model, power-of-two scale: scaling and unscaling are exact, so the delayed mode under
    GradScaler must train exactly as it does without one."""
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=1.0, delayed_param_update=True, lr=1e-2)
    twin = HybridDeviceOptimizer(r.groups(), offload_fraction=1.0, delayed_param_update=True, lr=1e-2)
    xs = _xs(5)
    _run(m, opt, xs)
    for x in xs:
        loss_of(r, x).backward()
        twin.step()
        twin.zero_grad()
    opt.flush()
    twin.flush()
    assert_same(m, r)
    opt.close()
    twin.close()


@pytest.mark.parametrize("mode, match", [({"offload_gradients": True}, "offload_gradients"),
                                         ({"step_in_backward": True}, "step_in_backward")])
def test_gradscaler_refused_where_it_cannot_be_exact(mode, match):
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=1.0, lr=1e-2, **mode)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(m, _xs(1)[0])).backward()
    with pytest.raises(OffloadError, match=match):
        scaler.step(opt)
    opt.close()


def test_gradscaler_with_no_device_gradient_steps_the_host_half():
    """A device half whose parameters got no gradient has nothing for GradScaler's unscale to group."""
    used, unused = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
    ref = used.detach().clone().requires_grad_()
    opt = HybridDeviceOptimizer([used, unused], offload_fraction=0.5, cpu_optimizer_cls=torch.optim.SGD, lr=0.1)
    assert [p.side for p in opt.placements] == ["cpu", "gpu"]
    ref_opt = torch.optim.SGD([ref], lr=0.1)
    before = unused.detach().clone()
    for p, o in ((used, opt), (ref, ref_opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        scaler.scale(p.square().sum()).backward()
        scaler.step(o)
    assert torch.equal(used, ref) and torch.equal(unused, before)
    opt.close()


class _FailOnceSGD(FailsOnce, torch.optim.SGD):
    """SGD (unscaled by the caller, GradScaler's unscale_ path) that fails once when marked."""


@pytest.mark.parametrize("delayed", [False, True], ids=["", "delayed"])
def test_gradscaler_step_retried_after_a_failed_chunk_unscales_once(delayed):
    m, r = pair()
    kw = dict(offload_fraction=1.0, chunk_bytes=128, lr=1e-2, momentum=0.9, delayed_param_update=delayed)
    opt = HybridDeviceOptimizer(m.groups(), cpu_optimizer_cls=_FailOnceSGD, **kw)
    twin = HybridDeviceOptimizer(r.groups(), cpu_optimizer_cls=torch.optim.SGD, **kw)
    assert len(opt.cpu_optimizers) >= 3
    failed = []
    for model, o in ((m, opt), (r, twin)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        for i, x in enumerate(_xs(4)):
            scaler.scale(loss_of(model, x)).backward()
            if i == 1:
                o.flush()  # delayed mode: step 0's chunks are done, so the one marked below is step 1's
                if o is opt:
                    opt.cpu_optimizers[-1].fail_next = True  # the last chunk: others have unscaled their buffers
            try:
                scaler.step(o)
            except RuntimeError as err:  # delayed mode reports step t's chunk in step t + 1
                assert "host chunk failed" in str(err)
                failed.append(i)
                scaler.step(o)  # GradScaler stays READY after a raise: the retry hands the scale again
            scaler.update()
            o.zero_grad()
        o.flush()
    assert failed == [2 if delayed else 1]
    assert_same(m, r)
    opt.close()
    twin.close()

