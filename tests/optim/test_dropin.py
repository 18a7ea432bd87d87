"""Megatron-Core drop-in names and meanings, and the validated, atomic load_state_dict (Note [Validated loads])."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from _hdo_util import Tiny, assert_same, inputs, loss_of, pair, train
from annotate_offload.optim import HybridDeviceOptimizer


# ---------------------------------------------------------------- Megatron-Core names
def test_state_is_empty_before_the_first_step():
    """Megatron's tests assert ``len(opt.state_dict()["state"]) == 0`` before the first step, as torch's optimizers have it."""
    m = Tiny()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, lr=1e-2)
    assert opt.state_dict()["state"] == {} and len(opt.state) == 0
    train(m, opt, inputs(1, 11))
    assert set(opt.state) == set(m.parameters())
    opt.close()


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_megatron_names_have_megatron_meanings(f):
    m = Tiny(dtype=torch.bfloat16)
    m.norm.float()  # a parameter kept in fp32: it gets no fp32 master
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, param_update_in_fp32=True, lr=1e-2,
                                cpu_optimizer_cls=torch.optim.Adam, gpu_optimizer_cls=torch.optim.AdamW)
    params = list(m.parameters())
    host = {id(p) for p, pl in zip(params, opt.placements) if pl.side == "cpu"}
    assert opt.sub_optimizers == opt.cpu_optimizers + ([opt.gpu_optimizer] if opt.gpu_optimizer is not None else [])
    assert all(type(o) is torch.optim.Adam for o in opt.cpu_optimizers)
    assert (opt.gpu_optimizer is None) == (f == 1.0) and (f == 1.0 or type(opt.gpu_optimizer) is torch.optim.AdamW)
    stepped_by = {id(t): o for o in opt.sub_optimizers for g in o.param_groups for t in g["params"]}
    for p in params:
        inner = opt.param_to_inner_param[p]
        assert opt.inner_param_to_orig_param[inner] is p
        assert stepped_by[id(inner)] in (opt.cpu_optimizers if id(p) in host else [opt.gpu_optimizer])
        wide = p.dtype != torch.float32
        assert (p in opt.param_to_fp32_param) == wide
        if wide:
            assert opt.param_to_fp32_param[p] is inner and inner.dtype == torch.float32
    assert {id(p) for p in opt.gpu_params_map_cpu_copy} == host
    for p, copy_ in opt.gpu_params_map_cpu_copy.items():
        assert copy_.device.type == "cpu" and opt.cpu_copys_map_gpu_param[copy_] is p and copy_ is opt.param_to_inner_param[p]
    opt.close()


def test_update_fp32_param_by_new_param_reseeds_the_masters():
    m = Tiny(dtype=torch.bfloat16)
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, param_update_in_fp32=True, lr=1e-2)
    new = Tiny(dtype=torch.bfloat16)
    for p, q in zip(m.parameters(), new.parameters()):
        p.data.copy_(q.data)  # bypasses the version counter: the masters cannot see it
    opt.update_fp32_param_by_new_param()
    for p, master in opt.param_to_fp32_param.items():
        assert torch.equal(master, p.detach().float().to(master.device))
    opt.close()


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_dummy_step_creates_state_without_changing_anything_a_step_would(f):
    """Megatron's DistributedOptimizer calls dummy_step() to create the state it then loads into in place."""
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    opt.dummy_step()
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(before, m.parameters()))
    assert set(opt.state) == set(m.parameters())
    for st in opt.state.values():
        assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, weight_decay=0.1, fused=True)
    train(m, opt, inputs(3, 11))
    train(r, ref, inputs(3, 11))
    assert_same(m, r)
    opt.close()


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_state_written_into_hdo_state_reaches_the_sub_optimizers(f):
    """Megatron's DistributedOptimizer loads a checkpoint by assigning into ``hdo.state[p][key]`` (CPU
    tensors) and then calls ``_sync_hdo_state_to_sub_optimizers()``."""
    m, r = pair(dtype=torch.bfloat16)
    kw = dict(offload_fraction=f, param_update_in_fp32=True, lr=1e-2)
    src = HybridDeviceOptimizer(r.parameters(), **kw)
    train(r, src, inputs(2, 11))
    opt = HybridDeviceOptimizer(m.parameters(), **kw)
    opt.dummy_step()
    m.load_state_dict(r.state_dict())
    pairs = list(zip(m.parameters(), r.parameters()))
    for p, q in pairs:
        for k, v in src.state[q].items():
            opt.state[p][k] = v.detach().to("cpu", copy=True)
    opt._sync_hdo_state_to_sub_optimizers()
    for p, q in pairs:  # the fp32 masters hold the loaded values, not the bf16 weights
        assert torch.equal(opt.param_to_fp32_param[p].cpu(), src.state[q]["master_param"].cpu())
    train(m, opt, inputs(2, 3))
    train(r, src, inputs(2, 3))
    assert_same(m, r)
    opt.close()
    src.close()


@pytest.mark.parametrize("f", [0.0, 1.0])
def test_a_state_value_replaced_between_steps_is_adopted_by_the_next_step(f):
    """A value assigned into ``state[p]`` between steps, with no sync call, is put where the class keeps it
    (an int64 ``step`` becomes the fused class's fp32 one) before the next step, after steps that replaced nothing."""
    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, lr=1e-2)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    train(m, opt, inputs(2, 11))
    train(r, ref, inputs(2, 11))
    for p, q in zip(m.parameters(), r.parameters()):
        opt.state[p]["step"] = torch.tensor(7)
        ref.state[q]["step"] = torch.tensor(7.0)
    train(m, opt, inputs(2, 3))
    train(r, ref, inputs(2, 3))
    assert_same(m, r)
    assert all(opt.state[p]["step"].dtype == torch.float32 for p in m.parameters())
    opt.close()


def test_rebuild_from_defaults_keeps_the_classes():
    """Megatron's DistributedOptimizer rebuilds the optimizer as ``HybridDeviceOptimizer(groups, **old.defaults)``."""
    m = Tiny()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, cpu_optimizer_cls=torch.optim.SGD, lr=0.1, momentum=0.9)
    groups = [{**g, "params": list(g["params"])} for g in opt.param_groups]
    opt.close()
    again = HybridDeviceOptimizer(groups, **opt.defaults)
    assert all(type(o) is torch.optim.SGD for o in again.sub_optimizers)
    assert all("cpu_optimizer_cls" not in g for g in again.state_dict()["param_groups"])
    again.close()


# ---------------------------------------------------------------- validated, atomic loads
def _trained(f, dtype=torch.float32):
    m = Tiny(dtype=dtype)
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, lr=1e-2, param_update_in_fp32=dtype != torch.float32)
    train(m, opt, inputs(2, 11))
    return m, opt


def _snapshot(m, opt):
    return ([p.detach().clone() for p in m.parameters()], copy.deepcopy(opt.state_dict()))


def _same_snapshot(a, b):
    (wa, sa), (wb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for key, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][key]), (k, key)


def _corrupt(case, sd):
    st = sd["state"]
    if case == "non-tensor":
        st[0]["exp_avg"] = [1.0, 2.0]
    elif case == "int-moment":
        st[0]["exp_avg"] = st[0]["exp_avg"].long()
    elif case == "transposed":
        st[0]["exp_avg"] = st[0]["exp_avg"].t().contiguous()
    elif case == "missing-key":
        del st[1]["exp_avg_sq"]
    elif case == "step-str":
        st[2]["step"] = "abc"
    elif case == "lr-nan":
        sd["param_groups"][1]["lr"] = float("nan")
    elif case == "betas":
        sd["param_groups"][0]["betas"] = (2.0, 0.9)
    elif case == "groups":
        sd["param_groups"].pop()
    elif case == "params":
        sd["param_groups"][1]["params"].pop()
    elif case == "not-a-dict":
        st[3] = torch.zeros(3)
    elif case == "wrong-model":
        other = torch.nn.Linear(8, 8)
        o = torch.optim.AdamW([{"params": [other.weight, torch.zeros(7, 7, requires_grad=True), other.bias]},
                               {"params": [torch.zeros(5, requires_grad=True) for _ in range(5)]}])
        for g in o.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        o.step()
        return o.state_dict()
    return sd


CASES = ["non-tensor", "int-moment", "transposed", "missing-key", "step-str", "lr-nan", "betas", "groups", "params",
         "not-a-dict", "wrong-model"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_a_load_torch_could_not_use_is_refused_and_changes_nothing(f, case):
    m, opt = _trained(f)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.123  # applied only if the whole load is
    bad = _corrupt(case, sd)
    before = _snapshot(m, opt)
    with pytest.raises((ValueError, TypeError), match=r"HybridDeviceOptimizer(\.load_state_dict)?: .*") as info:
        opt.load_state_dict(bad)
    msg = str(info.value)
    if case in ("non-tensor", "int-moment", "transposed", "missing-key", "step-str"):
        assert "parameter" in msg and "expected" in msg and "found" in msg and "nothing was loaded" in msg
    _same_snapshot(before, _snapshot(m, opt))
    train(m, opt, inputs(1, 11))  # and the optimizer still steps
    opt.close()


def test_the_message_names_the_parameter_key_and_values():
    m, opt = _trained(0.5)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"][:1]
    with pytest.raises(ValueError, match=r"parameter 0 \(param group 0, index 0, shape \(32, 8\)\), state 'exp_avg': "
                                         r"expected a floating-point tensor of shape \(32, 8\), found a tensor of shape "
                                         r"\(1, 8\) and dtype torch.float32; nothing was loaded"):
        opt.load_state_dict(sd)
    opt.close()


@pytest.mark.parametrize("f", [0.0, 0.5, 1.0])
def test_loads_cast_and_move_as_torch_does(f):
    """torchao's test reads the checkpoint with ``map_location="cpu"``: state is moved to where each
    parameter is stepped and cast to its dtype, as ``torch.optim.Optimizer.load_state_dict`` does."""
    m, opt = _trained(f)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["exp_avg"] = st["exp_avg"].double()
        st["step"] = st["step"].long()
    r = copy.deepcopy(m)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.load_state_dict(sd)
    for st in opt.state.values():
        assert st["exp_avg"].dtype == torch.float32 and st["step"].dtype == torch.float32
    train(m, opt, inputs(2, 5))
    train(r, ref, inputs(2, 5))
    assert_same(m, r)
    opt.close()


_FUZZ = r"""
import copy, sys, torch
sys.path.insert(0, {here!r})
from _hdo_util import Tiny, train
from annotate_offload.optim import HybridDeviceOptimizer
g = torch.Generator().manual_seed(0)
for f in (0.0, 0.5, 1.0):
    for case in ("truncated", "longer", "one-element", "empty"):
        m = Tiny()
        opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, lr=1e-2)
        train(m, opt, [torch.randn(5, 8, generator=g)])
        sd = copy.deepcopy(opt.state_dict())
        for st in sd["state"].values():
            v = st["exp_avg"]
            st["exp_avg"] = {{"truncated": v.flatten()[:1], "longer": torch.cat([v.flatten(), v.flatten()]),
                              "one-element": v.flatten()[:1].reshape(()), "empty": v.flatten()[:0]}}[case]
        try:
            opt.load_state_dict(sd)
            print("accepted", f, case)
        except (ValueError, TypeError):
            pass
        train(m, opt, [torch.randn(5, 8, generator=g)])
        assert all(torch.isfinite(p).all() for p in m.parameters()), (f, case)
        opt.close()
print("done")
"""


def test_fuzzed_loads_never_crash_the_process(run_group):
    """Moments cut to one row (or longer, 0-dim, empty) must be refused before they reach the fused
    kernel, where they give NaN weights, then ``free(): invalid size`` (exit 134). Run in a fresh process
    so that a crash is a test failure."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = run_group([sys.executable, "-c", _FUZZ.format(here=here)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["done"], out.stdout
