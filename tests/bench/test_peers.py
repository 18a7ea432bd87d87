"""Peer adapters: a missing peer is reported, never raised; present peers are found where they live."""

import sys
import textwrap

import pytest
import torch

from annotate_offload.bench import _peers


@pytest.fixture
def clean_modules(monkeypatch):
    """Let a test install fake peer packages on sys.path without leaking them."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("trl", "torchtune", "torchao", "megatron")}
    yield monkeypatch
    for k in [k for k in sys.modules if k.split(".")[0] in ("trl", "torchtune", "torchao", "megatron")]:
        del sys.modules[k]
    sys.modules.pop("_annotate_offload_megatron_hdo", None)
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
    act = _peers.load_offload_activations()
    assert not act.info.available and act.offload_cls is None
    assert "trl:" in act.info.detail and "torchtune:" in act.info.detail
    assert "not importable" in act.info.describe()
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
    peer = _peers.load_offload_activations()
    assert peer.info.available and peer.info.detail == "trl.models.activation_offloading"
    assert peer.offload_cls.__name__ == "OffloadActivations" and peer.noop_cls.__name__ == "NoOpManager"


def test_megatron_hdo_is_loaded_alone_when_megatron_core_does_not_import(clean_modules, tmp_path):
    # megatron is a namespace package; megatron.core's __init__ needs triton & co. on real installs.
    _write(tmp_path, "megatron/core/__init__.py", "raise ModuleNotFoundError(\"No module named 'triton'\")\n")
    _write(
        tmp_path,
        "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py",
        """
        import torch
        class HybridDeviceOptimizer(torch.optim.Optimizer):
            def __init__(self, params, offload_fraction=0.5, cpu_optimizer_cls=None, gpu_optimizer_cls=None,
                         param_update_in_fp32=False, overlap_cpu_optimizer_d2h_h2d=True, **kwargs):
                super().__init__(params, defaults=dict(offload_fraction=offload_fraction, **kwargs))
                self.cpu_optimizer_cls = cpu_optimizer_cls
                self.gpu_optimizer_cls = gpu_optimizer_cls
        """,
    )
    clean_modules.syspath_prepend(str(tmp_path))
    for k in [k for k in sys.modules if k.split(".")[0] == "megatron"]:
        del sys.modules[k]
    info, cls = _peers.load_megatron_hybrid_device_optimizer()
    assert info.available, info.detail
    assert "loaded alone" in info.detail and "triton" in info.detail
    p = torch.nn.Parameter(torch.zeros(4))
    opt = _peers.make_megatron_hybrid_device_optimizer([p], offload_fraction=1.0, lr=0.5)
    assert isinstance(opt, cls) and opt.param_groups[0]["lr"] == 0.5
    fused = opt.cpu_optimizer_cls([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    default = _peers.make_megatron_hybrid_device_optimizer([p], cpu_optimizer="default")
    assert default.cpu_optimizer_cls is torch.optim.AdamW


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cpu_optimizer": "apex"}, "cpu_optimizer must be 'fused' or 'default', got 'apex'"),
     ({"offload_fraction": 1.5}, r"offload_fraction must be in \[0, 1\], got 1.5")],
)
def test_megatron_adapter_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _peers.make_megatron_hybrid_device_optimizer([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_fused_cpu_adamw_steps_like_torch_fused_adamw():
    a = torch.nn.Parameter(torch.arange(6.0))
    b = torch.nn.Parameter(torch.arange(6.0))
    opt_a = _peers._FusedCPUAdamW([a], lr=0.1)
    opt_b = torch.optim.AdamW([b], lr=0.1, fused=True)
    for _ in range(3):
        a.grad = torch.linspace(-1, 1, 6)
        b.grad = torch.linspace(-1, 1, 6)
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)
