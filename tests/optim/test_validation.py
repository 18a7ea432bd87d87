"""Hyper-parameter validation of HybridDeviceOptimizer at construction (fresh-user report, bug 1)."""

from __future__ import annotations

import re

import pytest
import torch

from _hdo_util import Tiny
from annotate_offload.errors import OffloadError
from annotate_offload.optim import HybridDeviceOptimizer


def _hooks(params):
    return [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"lrr": 1e-3}, r"'lrr'.*did you mean 'lr'\?.*valid optimizer keywords \(AdamW\): .*\blr\b"),
        ({"weight_decy": 0.1}, r"'weight_decy'.*did you mean 'weight_decay'"),
        ({"offload_fractio": 0.5}, r"'offload_fractio'.*did you mean 'offload_fraction'"),
        ({"momentum": 0.9}, r"'momentum'.*valid optimizer keywords \(AdamW\)"),
        ({"optimizer": "sgd"}, r"'optimizer'.*cpu_optimizer_cls=torch.optim.AdamW.*torch.optim.SGD"),
    ],
)
def test_unknown_keyword_is_type_error(kw, match):
    m = Tiny()
    with pytest.raises(TypeError, match=match):
        HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, **kw)
    assert _hooks(m.parameters()) == [0] * 8  # nothing registered on the model


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"lr": -1}, r"invalid lr=-1; valid range: lr >= 0"),
        ({"lr": float("nan")}, r"invalid lr=nan"),
        ({"lr": torch.tensor(-0.5)}, r"invalid lr=tensor\(-0.5000\)"),
        ({"eps": -1}, r"invalid eps=-1; valid range: eps >= 0"),
        ({"weight_decay": -1}, r"invalid weight_decay=-1; valid range: weight_decay >= 0"),
        ({"betas": (1.5, 0.9)}, r"invalid betas\[0\]=1.5 .*valid range: 0 <= betas\[0\] < 1"),
        ({"betas": (0.9, 1.0)}, r"invalid betas\[1\]=1.0 .*valid range: 0 <= betas\[1\] < 1"),
        ({"betas": (0.9, -0.1)}, r"invalid betas\[1\]=-0.1"),
    ],
)
def test_out_of_range_is_value_error(kw, match):
    m = Tiny()
    with pytest.raises(ValueError, match=match):
        HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, **kw)
    assert _hooks(m.parameters()) == [0] * 8


@pytest.mark.parametrize(
    "kw, match",
    [({"lr": "1e-3"}, r"lr must be a number, got '1e-3'"), ({"betas": 0.9}, r"betas must be a pair"),
     ({"betas": (0.9, None)}, r"betas\[1\] must be a number")],
)
def test_wrong_type_is_type_error(kw, match):
    with pytest.raises(TypeError, match=match):
        HybridDeviceOptimizer(Tiny().parameters(), **kw)


def test_torch_adamw_rejects_the_same_values():
    """Our ranges are torch's: each value refused here is refused by torch.optim.AdamW too."""
    for kw in ({"lr": -1}, {"eps": -1}, {"weight_decay": -1}, {"betas": (1.5, 0.9)}, {"betas": (0.9, 1.0)}):
        with pytest.raises(ValueError):
            torch.optim.AdamW(Tiny().parameters(), **kw)
        with pytest.raises(ValueError):
            HybridDeviceOptimizer(Tiny().parameters(), **kw)


@pytest.mark.parametrize(
    "group, match",
    [
        ({"lr": -0.1}, r"invalid lr=-0.1 in param group 1; valid range: lr >= 0"),
        ({"weight_decay": -1.0}, r"invalid weight_decay=-1.0 in param group 1"),
        ({"eps": -1e-8}, r"invalid eps=-1e-08 in param group 1"),
        ({"betas": (0.9, 1.5)}, r"invalid betas\[1\]=1.5 .*in param group 1"),
    ],
)
def test_param_group_values_checked(group, match):
    m = Tiny()
    groups = m.groups()
    groups[1].update(group)
    with pytest.raises(ValueError, match=match):
        HybridDeviceOptimizer(groups, offload_fraction=0.5, lr=1e-2)
    assert _hooks(m.parameters()) == [0] * 8


def test_valid_keywords_still_accepted():
    """Megatron-Core's call (hyper-parameters + its flags), impl switches, extra group keys, SGD keywords."""
    m = Tiny()
    groups = m.groups()
    groups[0].update(wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False)  # Megatron group keys are kept
    opt = HybridDeviceOptimizer(
        groups, offload_fraction=0.5, cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True, pin_cpu_grads=True, pin_cpu_params=True, overlap_cpu_optimizer_d2h_h2d=True,
        lr=torch.tensor(1e-3), betas=[0.9, 0.95], eps=0.0, weight_decay=0.0, amsgrad=False, maximize=False, fused=True,
    )
    opt.close()
    sgd = HybridDeviceOptimizer(Tiny().parameters(), cpu_optimizer_cls=torch.optim.SGD, lr=0.1, momentum=0.9,
                                nesterov=True, dampening=0.0)
    sgd.close()
    with pytest.raises(ValueError, match=r"invalid momentum=-0.5; valid range: momentum >= 0"):
        HybridDeviceOptimizer(Tiny().parameters(), cpu_optimizer_cls=torch.optim.SGD, lr=0.1, momentum=-0.5)


def test_mixed_classes_accept_union_and_var_kwargs_class_is_judge():
    opt = HybridDeviceOptimizer(Tiny().parameters(), cpu_optimizer_cls=torch.optim.Adam,
                                gpu_optimizer_cls=torch.optim.SGD, lr=1e-2, momentum=0.0)
    opt.close()

    class Loose(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            kwargs.pop("custom", None)
            super().__init__(params, **kwargs)

    HybridDeviceOptimizer(Tiny().parameters(), cpu_optimizer_cls=Loose, lr=1e-2, custom=3).close()


def test_step_after_close_raises_instead_of_waiting_forever():
    """Fresh-user report (second pass) item 1: close() stopped the worker and step() then waited on it."""
    from _hdo_util import Tiny, loss_of

    m = Tiny()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, lr=1e-2)
    loss_of(m, torch.randn(5, 8)).backward()
    opt.step()
    opt.close()
    opt.close()  # idempotent
    loss_of(m, torch.randn(5, 8)).backward()
    with pytest.raises(OffloadError, match="closed"):
        opt.step()


def test_foreach_selects_the_foreach_kernels_on_both_halves():
    from _hdo_util import assert_same, pair, train

    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, lr=1e-2, foreach=True)
    assert all(c.opt.defaults.get("foreach") and not c.opt.defaults.get("fused") for c in opt._chunks)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(5, 8, generator=g) for _ in range(4)]
    train(m, opt, xs)
    train(r, ref, xs)
    assert_same(m, r)
    with pytest.raises(ValueError, match="fused=True and foreach=True"):
        HybridDeviceOptimizer(m.parameters(), fused=True, foreach=True)


@pytest.mark.parametrize("which", ["cpu_optimizer_cls", "gpu_optimizer_cls"])
def test_closure_only_class_refused(which):
    """Fresh-user report (third pass) item 1: LBFGS was accepted, then every step() raised
    'LBFGS.step() missing 1 required positional argument: closure'."""
    m = Tiny()
    with pytest.raises(TypeError, match=rf"{which}=torch.optim.lbfgs.LBFGS needs a closure in step\(\).*"
                                         r"torch.optim.AdamW \(default\), torch.optim.Adam or torch.optim.SGD"):
        HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, **{which: torch.optim.LBFGS})
    assert _hooks(m.parameters()) == [0] * 8

    class OptionalClosure(torch.optim.SGD):  # a closure parameter with a default is fine
        def step(self, closure=None):
            return super().step(closure)

    HybridDeviceOptimizer(m.parameters(), **{which: OptionalClosure}, lr=0.1).close()


def test_sparse_adam_refused_for_the_host_part():
    """Fresh-user report (seventh session) item 8: SparseAdam was accepted, then step() failed with
    torch's 'SparseAdam does not support dense gradients' (host gradient buffers are dense)."""
    m = Tiny()
    with pytest.raises(TypeError, match=r"cpu_optimizer_cls=torch.optim.SparseAdam needs sparse gradients.*outside this optimizer"):
        HybridDeviceOptimizer(m.parameters(), cpu_optimizer_cls=torch.optim.SparseAdam)
    assert _hooks(m.parameters()) == [0] * 8


@pytest.mark.parametrize(
    "group, match",
    [
        ({"lrr": 1e-3}, r"unexpected key 'lrr' in param group 1; did you mean 'lr'\? valid group keys \(AdamW\): params, .*\blr\b"),
        ({"weight_decy": 0.1}, r"unexpected key 'weight_decy' in param group 1; did you mean 'weight_decay'"),
        ({"betas1": 0.9}, r"unexpected key 'betas1' in param group 1; did you mean 'betas'"),
        ({"lr": "1e-3"}, r"lr must be a number in param group 1, got '1e-3'"),
    ],
)
def test_param_group_keys_checked_like_keywords(group, match):
    """Fresh-user report (third pass) item 2: {"params": ..., "lrr": 1e-3} was accepted silently
    while lrr= as a keyword was refused."""
    m = Tiny()
    groups = m.groups()
    groups[1].update(group)
    with pytest.raises(TypeError, match=match):
        HybridDeviceOptimizer(groups, offload_fraction=0.5, lr=1e-2)
    assert _hooks(m.parameters()) == [0] * 8


@pytest.mark.parametrize(
    "group, match",
    [
        ({"offload_fraction": 2.0}, r"offload_fraction=2.0 in param group 0; offload_fraction is per optimizer, not per "
                                    r"param group \(this optimizer's: offload_fraction=0.5\)\. Pass it to the "
                                    r"HybridDeviceOptimizer constructor"),
        ({"offload_fraction": 1.0}, r"offload_fraction=1.0 in param group 0; offload_fraction is per optimizer"),
        ({"step_in_backward": True}, r"step_in_backward=True in param group 0; step_in_backward is per optimizer"),
        ({"cpu_optimizer_cls": torch.optim.SGD}, r"cpu_optimizer_cls=<class 'torch.optim.sgd.SGD'> in param group 0; "
                                                 r"cpu_optimizer_cls is per optimizer, not per param group \(not a group option\)"),
    ],
)
def test_param_group_cannot_set_per_optimizer_options(group, match):
    """offload_fraction (like every HybridDeviceOptimizer option) is per optimizer: the split reads the
    constructor's value only, so a group's own value was silently ignored."""
    m = Tiny()
    with pytest.raises(ValueError, match=match):
        HybridDeviceOptimizer([{"params": list(m.parameters()), **group}], offload_fraction=0.5)
    assert _hooks(m.parameters()) == [0] * 8


def test_param_group_metadata_and_rebuild_still_accepted():
    """Extra keys that are not near misses stay (torch keeps them; Megatron relies on it), and a group
    repeating the optimizer's own values (rebuilt from another optimizer's param_groups) is fine."""
    m = Tiny()
    groups = m.groups()
    groups[0].update(name="weights", wd_mult=1.0, lr_mult=1.0, weight_decay_mult=1.0, layer_decay=0.9, max_lr=1e-2)
    opt = HybridDeviceOptimizer(groups, offload_fraction=0.5, lr=1e-2)
    assert opt.param_groups[0]["name"] == "weights" and opt.param_groups[0]["layer_decay"] == 0.9
    rebuilt_groups = [dict(g) for g in opt.param_groups]
    opt.close()
    HybridDeviceOptimizer(rebuilt_groups, **opt.defaults).close()


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_differentiable_does_not_get_the_fused_default(f):
    """Fresh-user report (third pass) item 3: differentiable=True failed with "`fused` does not support
    `differentiable`", a fused=True the user never asked for. It now gets torch's non-fused path, like
    torch.optim.AdamW(differentiable=True), on the host (masters) and on the device (the parameters
    themselves, where torch's own differentiable step refuses leaves that require grad, as plain AdamW does).
    Fresh-user report (seventh session) item 4: that refusal came at the first step(), after the host
    half had already stepped (a half-applied step on every retry); it is now a ValueError at
    construction."""
    from _hdo_util import loss_of

    m = Tiny()
    if f < 1.0:
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(ValueError, match=r"differentiable=True, but the GPU half would step \d+ parameters in place"):
            HybridDeviceOptimizer(m.parameters(), offload_fraction=f, lr=1e-2, differentiable=True)
        assert all(torch.equal(a, b) and b.grad is None for a, b in zip(before, m.parameters()))
        loss_of(m, torch.randn(5, 8)).backward()
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):  # what plain torch does
            torch.optim.AdamW(m.parameters(), lr=1e-2, differentiable=True).step()
        return
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, lr=1e-2, differentiable=True)
    assert all(not g["fused"] and g["differentiable"] for sub in opt.sub_optimizers for g in sub.param_groups)
    masters = [p.detach().clone() for p in m.parameters()]  # what the host steps: plain tensors
    ref = torch.optim.AdamW(masters, lr=1e-2, differentiable=True)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        loss_of(m, torch.randn(5, 8, generator=g)).backward()
        for p, q in zip(m.parameters(), masters):
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        for p, q in zip(m.parameters(), masters):
            assert torch.equal(p, q)


def test_explicit_fused_with_unsupported_options_is_a_clear_error():
    m = Tiny()
    with pytest.raises(ValueError, match=r"fused=True and differentiable=True were both given"):
        HybridDeviceOptimizer(m.parameters(), fused=True, differentiable=True)
    c = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"fused=True was given, but parameter 1 of param group 0 \(shape \(3,\)\) is "
                                        r"torch.complex64; .*Omit fused"):
        HybridDeviceOptimizer([m.l1.weight, c], fused=True)
    assert _hooks(m.parameters()) == [0] * 8


@pytest.mark.parametrize(
    "rows, mode, raised_in",
    [
        (100, {}, "backward"),  # 6400 elements: gradient hook
        (10, {}, "step"),  # 80 elements: copied at step() (Note [Tiny gradients at step()])
        (100, {"overlap_cpu_optimizer_d2h_h2d": False}, "step"),  # the serial path
        (100, {"step_in_backward": True}, "backward"),
        (100, {"delayed_param_update": True}, "backward"),
    ],
)
def test_sparse_gradient_is_a_type_error(rows, mode, raised_in):
    """Fresh-user report (third pass) item 4: nn.Embedding(sparse=True) failed with an internal
    "copy_() between dense and sparse Tensors is not implemented" from the D2H copy."""
    emb = torch.nn.Embedding(rows, 64, sparse=True)
    opt = HybridDeviceOptimizer(emb.parameters(), offload_fraction=1.0, **mode)
    match = (rf"parameter 0 of param group 0 \(shape \({rows}, 64\)\) has a sparse gradient \(layout=torch.sparse_coo\).*"
             r"nn.Embedding\(..., sparse=False\).*torch.optim.SparseAdam outside this optimizer")
    before = emb.weight.detach().clone()
    with pytest.raises(TypeError, match=match):
        emb(torch.randint(0, rows, (4,))).sum().backward()
        assert raised_in == "step"
        opt.step()
    assert torch.equal(emb.weight, before)
    opt.close()


@pytest.mark.parametrize("gpu_cls, kw, refused", [(torch.optim.AdamW, {}, "ours"), (torch.optim.SGD, {}, None),
                                                   (torch.optim.SGD, {"weight_decay": 0.01}, "torch"),
                                                   (torch.optim.Adagrad, {"weight_decay": 0.01}, "torch")])
def test_sparse_gradient_of_the_device_half_is_refused_before_the_host_steps(gpu_cls, kw, refused):
    """Fresh-user report (eighth session) item 6: the host chunks were submitted before the device
    optimizer raised torch's own error, so the host half was stepped and the device half not."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.emb = torch.nn.Embedding(100, 64, sparse=True)

        def forward(self, i):
            return self.lin(self.emb(i)).square().mean()

    m = M()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.3, lr=1e-2, cpu_optimizer_cls=gpu_cls, **kw)
    sides = [p.side for p in opt.placements]
    assert sides[0] == "cpu" and sides[2] == "gpu"  # lin.weight on the host, the embedding on the device
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.randint(0, 100, (8,))).backward()
    if refused == "torch":  # SGD/Adagrad take sparse gradients, but not with weight decay: the device half runs first
        with pytest.raises(RuntimeError):
            opt.step()
        opt.flush()
        assert torch.equal(m.lin.weight, before[0])  # the host half did not step (torch's class may have begun its own)
    elif refused:
        with pytest.raises(TypeError, match=r"parameter 2 of param group 0 \(shape \(100, 64\)\), stepped on the device, "
                                             r"has a sparse gradient.*AdamW does not support; nothing was stepped"):
            opt.step()
        opt.flush()
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    else:
        opt.step()  # SGD steps sparse gradients
        assert not torch.equal(m.emb.weight, before[2])
    opt.close()


@pytest.mark.parametrize("key, value", [("amsgrad", "yes"), ("maximize", 1), ("nesterov", None), ("fused", "true"),
                                        ("foreach", 0)])
def test_flags_must_be_bools(key, value):
    """Fresh-user report (seventh session) item 5: amsgrad="yes" or maximize=1 built, then the first
    step() failed inside torch's fused kernel ("invalid combination of arguments")."""
    m = Tiny()
    kw = {"momentum": 0.9} if key == "nesterov" else {}
    cls = {"cpu_optimizer_cls": torch.optim.SGD} if key == "nesterov" else {}
    with pytest.raises(TypeError, match=rf"{key} must be True(, False)? or (False|None), got {re.escape(repr(value))}"):
        HybridDeviceOptimizer(m.parameters(), lr=1e-2, **{key: value}, **kw, **cls)
    with pytest.raises(TypeError, match=rf"{key} must be .* in param group 0"):
        HybridDeviceOptimizer([{"params": list(m.parameters()), key: value}], lr=1e-2, **kw, **cls)


def test_a_learning_rate_passed_as_the_fraction_warns():
    """Fresh-user report (seventh session) item 7: HybridDeviceOptimizer(params, 3e-4) (AdamW's
    positional lr) silently meant offload_fraction=3e-4 with the default lr."""
    m = Tiny()
    with pytest.warns(UserWarning, match=r"offload_fraction=0.0003 and no lr=.*lr=0.0003"):
        HybridDeviceOptimizer(m.parameters(), 3e-4).close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HybridDeviceOptimizer(m.parameters(), 3e-4, lr=1e-3).close()  # explicit: meant
        HybridDeviceOptimizer(m.parameters(), 0.5).close()


@pytest.mark.parametrize("form", ["defaults", "group"])
@pytest.mark.parametrize(
    "cls, kw, match",
    [
        (torch.optim.SGD, {"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
        (torch.optim.SGD, {"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "Nesterov momentum requires"),
        (torch.optim.RMSprop, {"alpha": -1.0}, "Invalid alpha value"),
        (torch.optim.Adagrad, {"lr_decay": -1.0}, "Invalid lr_decay value"),
    ],
)
def test_hyper_parameters_torch_refuses_are_refused_here(cls, kw, match, form):
    """Fresh-user report (eighth session) item 7: values a torch class refuses in its constructor
    reached the sub-optimizers through the groups unchecked (RMSprop alpha=-1: NaN weights)."""
    m = Tiny()
    full = rf"{cls.__name__} refuses the hyper-parameters in param group 0: {match}.*change that value"
    with pytest.raises(ValueError, match=full):
        if form == "defaults":
            HybridDeviceOptimizer(m.parameters(), lr=1e-2, cpu_optimizer_cls=cls, **kw)
        else:
            HybridDeviceOptimizer([{"params": list(m.parameters()), **kw}], lr=1e-2, cpu_optimizer_cls=cls)


def test_a_parameter_listed_twice_in_a_group_is_refused():
    m = Tiny()
    with pytest.warns(UserWarning, match="duplicate parameters"), \
            pytest.raises(ValueError, match=r"param group 0 lists the same parameter twice \(positions 0 and 2"):
        HybridDeviceOptimizer([m.l1.weight, m.l1.bias, m.l1.weight], lr=1e-2)


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_the_optimizer_refuses_to_be_pickled_or_copied(how):
    """Fresh-user report (eighth session) item 7: the copy built, then failed at step() with an
    AttributeError."""
    import copy
    import io
    import pickle

    opt = HybridDeviceOptimizer(Tiny().parameters(), lr=1e-2)
    do = {"pickle": lambda: pickle.dumps(opt), "deepcopy": lambda: copy.deepcopy(opt),
          "torch.save": lambda: torch.save(opt, io.BytesIO())}[how]
    with pytest.raises(OffloadError, match=r"cannot be pickled or copied.*opt.state_dict\(\)"):
        do()
    opt.close()


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is newer than this torch")
def test_a_class_that_checks_parameter_shapes_still_builds():
    """Review (eighth session): the constructor checks ran over a 1-element dummy, which Muon (2-D
    parameters only) refused as a bad hyper-parameter."""
    w = torch.nn.Parameter(torch.randn(16, 16))
    opt = HybridDeviceOptimizer([w], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.Muon, lr=0.02)
    w.grad = torch.randn(16, 16)
    opt.step()
    opt.close()
