"""benchmarks/_peers.py: a missing peer is reported, never raised; present peers are found where they live."""

import gc
import sys
import textwrap
import weakref

import pytest
import torch

import _peers


@pytest.fixture
def clean_modules(monkeypatch):
    """Let a test install fake peer packages on sys.path without leaking them."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("trl", "torchtune", "torchao", "megatron")}
    yield monkeypatch
    for k in [k for k in sys.modules if k.split(".")[0] in ("trl", "torchtune", "torchao", "megatron")]:
        del sys.modules[k]
    sys.modules.pop("_benchmarks_megatron_hdo", None)
    sys.modules.update(saved)


def _write(root, rel, text=""):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_missing_peers_are_reported_not_raised(clean_modules, tmp_path):
    # Shadow any installed peer with packages that fail to import.
    for pkg in ("trl", "torchtune", "torchao", "megatron"):
        _write(tmp_path, f"{pkg}/__init__.py", "raise ImportError('shadowed by the test')\n")
    clean_modules.syspath_prepend(str(tmp_path))
    for k in [k for k in sys.modules if k.split(".")[0] in ("trl", "torchtune", "torchao", "megatron")]:
        del sys.modules[k]
    info, offload_cls, _ = _peers.load_offload_activations()
    assert not info.available and offload_cls is None
    assert "trl:" in info.detail and "torchtune:" in info.detail and "not importable" in info.describe()
    info, cls = _peers.load_torchao_cpu_offload_optimizer()
    assert not info.available and cls is None and "shadowed" in info.detail
    info, cls = _peers.load_megatron_hybrid_device_optimizer()
    assert not info.available and cls is None
    assert _peers.make_torchao_cpu_offload_optimizer([torch.zeros(2, requires_grad=True)]) is None


def test_trl_offload_activations_is_found(clean_modules, tmp_path):
    _write(tmp_path, "trl/__init__.py")
    _write(tmp_path, "trl/models/__init__.py")
    _write(
        tmp_path,
        "trl/models/activation_offloading.py",
        """
        class OffloadActivations:
            pass
        class NoOpManager:
            pass
        """,
    )
    clean_modules.syspath_prepend(str(tmp_path))
    for k in [k for k in sys.modules if k.split(".")[0] == "trl"]:
        del sys.modules[k]
    info, offload_cls, noop_cls = _peers.load_offload_activations()
    assert info.available and info.detail == "trl.models.activation_offloading"
    assert offload_cls.__name__ == "OffloadActivations" and noop_cls.__name__ == "NoOpManager"


# The constructor signature of megatron-core 0.19.2's HybridDeviceOptimizer; step() does nothing
# (the real one needs CUDA streams), which is what the adapter's gradient check must not hide.
_FAKE_HDO = """
import torch
class HybridDeviceOptimizer(torch.optim.Optimizer):
    def __init__(self, params, offload_fraction=0.5, cpu_optimizer_cls=None, gpu_optimizer_cls=None,
                 param_update_in_fp32=False, pin_cpu_grads=True, pin_cpu_params=True,
                 overlap_cpu_optimizer_d2h_h2d=True, **kwargs):
        super().__init__(params, defaults=dict(offload_fraction=offload_fraction, cpu_optimizer_cls=cpu_optimizer_cls,
                         gpu_optimizer_cls=gpu_optimizer_cls, param_update_in_fp32=param_update_in_fp32, **kwargs))
        self.cpu_optimizer_cls = cpu_optimizer_cls
        self.gpu_optimizer_cls = gpu_optimizer_cls
        self.param_update_in_fp32 = param_update_in_fp32
        self.steps = 0
    def step(self, closure=None):
        self.steps += 1
"""


@pytest.fixture
def fake_megatron(clean_modules, tmp_path):
    """megatron is a namespace package; megatron.core's __init__ needs triton & co. on real installs."""
    _write(tmp_path, "megatron/core/__init__.py", "raise ModuleNotFoundError(\"No module named 'triton'\")\n")
    _write(tmp_path, "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py", _FAKE_HDO)
    clean_modules.syspath_prepend(str(tmp_path))
    for k in [k for k in sys.modules if k.split(".")[0] == "megatron"]:
        del sys.modules[k]
    sys.modules.pop("_benchmarks_megatron_hdo", None)
    return clean_modules


def test_megatron_hdo_is_loaded_alone_when_megatron_core_does_not_import(fake_megatron):
    info, cls = _peers.load_megatron_hybrid_device_optimizer()
    assert info.available, info.detail
    assert "loaded alone" in info.detail
    p = torch.nn.Parameter(torch.zeros(4))
    opt = _peers.make_megatron_hybrid_device_optimizer([p], offload_fraction=1.0, lr=0.5)
    assert isinstance(opt, cls) and opt.param_groups[0]["lr"] == 0.5


def test_megatron_is_built_as_get_megatron_optimizer_builds_it(fake_megatron):
    # megatron/core/optimizer/__init__.py 502-541: torch AdamW on the host, fused=True in the defaults
    # (copied into every sub-optimizer's param group), param_update_in_fp32=True.
    p = torch.nn.Parameter(torch.zeros(4))
    fused = _peers.make_megatron_hybrid_device_optimizer([p], cpu_optimizer="fused", weight_decay=0.1)
    assert fused.cpu_optimizer_cls is torch.optim.AdamW and fused.gpu_optimizer_cls is torch.optim.AdamW
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["weight_decay"] == 0.1
    assert fused.param_update_in_fp32 is True
    default = _peers.make_megatron_hybrid_device_optimizer([p], cpu_optimizer="default")
    assert "fused" not in default.param_groups[0]


def test_a_group_carrying_fused_steps_with_the_fused_kernel():
    # How HDO builds each host sub-optimizer (build_cpu_optimizer_list): cpu_optimizer_cls([group copy]),
    # the group holding the HDO defaults. torch AdamW must then step exactly as AdamW(fused=True).
    a = torch.nn.Parameter(torch.linspace(-2, 2, 37))
    b = torch.nn.Parameter(torch.linspace(-2, 2, 37))
    group = {"params": [a], "lr": 0.1, "fused": True, "offload_fraction": 1.0, "cpu_optimizer_cls": torch.optim.AdamW,
             "param_update_in_fp32": True}
    opt_a = torch.optim.AdamW([group])
    opt_b = torch.optim.AdamW([b], lr=0.1, fused=True)
    for i in range(3):
        a.grad = torch.linspace(-1, 1, 37) * (i + 1) ** 0.5
        b.grad = a.grad.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b) and not torch.equal(a, torch.linspace(-2, 2, 37))


def test_megatron_step_refuses_parameters_without_gradients(fake_megatron):
    w = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    opt = _peers.make_megatron_hybrid_device_optimizer([w, b, frozen])
    w.grad = torch.ones(3)  # b has none: Megatron's HDO would skip it silently
    with pytest.raises(RuntimeError, match=r"1 of 2 trainable parameters have no gradient at step\(\)"):
        opt.step()
    assert opt.steps == 0
    b.decoupled_grad = torch.ones(3)  # Megatron's precision-aware gradient counts; frozen params are ignored
    opt.step()
    assert opt.steps == 1
    with pytest.raises(ValueError, match="cpu_optimizer must be 'fused' or 'default', got 'apex'"):
        _peers.make_megatron_hybrid_device_optimizer([w], cpu_optimizer="apex")


# torchao 0.18's CPUOffloadOptimizer hook handling (torchao/optim/cpu_offload.py 65-105), CPU-only:
# a closure over self registered per large parameter, handle dropped, p.grad = None with
# offload_gradients.
_FAKE_TORCHAO = """
import torch
class CPUOffloadOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, offload_gradients=False, minimal_size=4, **kwargs):
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_d2h_map, self.optim_dict, self.copied = {}, {}, 0
        def backward_hook(p_device):
            if p_device.grad is not None:
                self.param_d2h_map[p_device].grad.copy_(p_device.grad)
                self.copied += 1
                if offload_gradients:
                    p_device.grad = None
        for group in groups:
            for p in group.pop("params"):
                if p.numel() < minimal_size:
                    continue
                host = p.detach().clone()
                host.grad = torch.zeros_like(host)
                self.param_d2h_map[p] = host
                p.register_post_accumulate_grad_hook(backward_hook)
                self.optim_dict[p] = optimizer_class([{"params": host, **group}], **kwargs)
    def step(self, closure=None):
        for p, opt in self.optim_dict.items():
            opt.step()
            p.data.copy_(self.param_d2h_map[p])
    def zero_grad(self, set_to_none=True):
        for p in self.param_d2h_map:
            p.grad = None
"""


@pytest.fixture
def fake_torchao(clean_modules, tmp_path):
    _write(tmp_path, "torchao/__init__.py")
    _write(tmp_path, "torchao/optim/__init__.py", _FAKE_TORCHAO)
    clean_modules.syspath_prepend(str(tmp_path))
    for k in [k for k in sys.modules if k.split(".")[0] == "torchao"]:
        del sys.modules[k]
    return clean_modules


def _backward(w, b):
    (torch.arange(1.0, 9.0) @ w + b).square().sum().backward()


def test_torchao_steps_and_close_removes_its_gradient_hooks(fake_torchao):
    w, b = torch.nn.Parameter(torch.ones(8, 8)), torch.nn.Parameter(torch.ones(8))
    other = []
    w.register_post_accumulate_grad_hook(lambda p: other.append(1))  # the user's own hook stays
    opt = _peers.make_torchao_cpu_offload_optimizer([w, b], lr=0.1, offload_gradients=True)
    _backward(w, b)
    assert w.grad is None and b.grad is None and opt.copied == 2  # offloaded by torchao's hook
    opt.step()
    assert torch.all(w < 1) and torch.all(b < 1)
    opt.close()
    opt.close()  # idempotent
    _backward(w, b)
    assert w.grad is not None and b.grad is not None and opt.copied == 2  # hooks gone
    assert len(other) == 2


def test_dropping_the_torchao_optimizer_removes_its_hooks(fake_torchao):
    # benchmarks/optimizer.py's order: torchao (offload_gradients) is dropped, then Megatron needs the gradients
    w, b = torch.nn.Parameter(torch.ones(8, 8)), torch.nn.Parameter(torch.ones(8))
    opt = _peers.make_torchao_cpu_offload_optimizer((p for p in (w, b)), lr=0.1, offload_gradients=True)
    _backward(w, b)
    opt.step()
    opt.zero_grad()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None  # torchao's closure no longer keeps it (and its host copies) alive
    assert not w._post_accumulate_grad_hooks and not b._post_accumulate_grad_hooks
    _backward(w, b)
    assert w.grad is not None and b.grad is not None
