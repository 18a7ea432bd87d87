"""GPU: the W3 peer optimizers really step the model, as torch AdamW on the GPU does.

Megatron-Core's ``HybridDeviceOptimizer`` and torchao's ``CPUOffloadOptimizer`` come from the
wheels in ``.whl/`` (benchmarks/README.md). With ``PYTHONPATH=/tmp/site`` after
``pip install --target /tmp/site .whl/*.whl`` they import directly; otherwise the module fixture
installs the two wheels the same way (``--no-index --no-deps``) into a temporary folder and puts
it on ``sys.path``. A test is skipped when its peer still does not import.

Tolerance: each run makes 3 AdamW steps at lr 1e-3 (every weight moves by up to ~3e-3); host
(fused or per-tensor CPU AdamW) and GPU AdamW differ only in rounding order, ~1e-7 per step, so
``atol=1e-5, rtol=0`` passes them and fails a peer that skips a step or a parameter (off by ~1e-3).
"""

import copy
import gc
import glob
import os
import sys

import pytest
import torch

import _peers

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
LR, STEPS, ATOL = 1e-3, 3, 1e-5


@pytest.fixture(scope="module", autouse=True)
def _peer_wheels(tmp_path_factory, run_group):
    """Install .whl/megatron_core-*.whl and .whl/torchao-*.whl when they do not import yet."""
    need = [
        pattern
        for pattern, (info, _) in (
            ("megatron_core-*.whl", _peers.load_megatron_hybrid_device_optimizer()),
            ("torchao-*.whl", _peers.load_torchao_cpu_offload_optimizer()),
        )
        if not info.available
    ]
    wheels = [w for p in need for w in glob.glob(os.path.join(ROOT, ".whl", p))]
    if not wheels:
        yield
        return
    site = str(tmp_path_factory.mktemp("site"))
    run_group(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", site,
         *wheels],
        check=False, capture_output=True,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(site)
        for k in [k for k in sys.modules if k.split(".")[0] in ("megatron", "torchao")]:
            del sys.modules[k]
        yield


def _megatron():
    info, cls = _peers.load_megatron_hybrid_device_optimizer()
    if cls is None:
        pytest.skip(f"Megatron HybridDeviceOptimizer not importable: {info.detail}")


def _torchao():
    info, cls = _peers.load_torchao_cpu_offload_optimizer()
    if cls is None:
        pytest.skip(f"torchao CPUOffloadOptimizer not importable: {info.detail}")


def _model() -> torch.nn.Module:
    # 64x256 and 256x64 weights (torchao steps them on the host), biases and LayerNorm under
    # torchao's 4096-element minimum (stepped on the GPU there); fp32 as W3's master weights.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    ).cuda()


def _train(model, opt, x, steps=STEPS):
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()


def _check_against_gpu_adamw(model, start, x):
    """``model`` was trained from ``start`` (a copy of its initial weights); every weight moved and
    matches torch AdamW on the GPU from the same start."""
    ref = copy.deepcopy(start)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=LR), x)
    for (name, p), p0, r in zip(model.named_parameters(), start.parameters(), ref.parameters()):
        assert not torch.equal(p, p0), f"{name} did not move: the peer did not step it"
        torch.testing.assert_close(p, r, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("cpu_optimizer", ["fused", "default"])
def test_megatron_hdo_steps_like_gpu_adamw(cpu_optimizer, fraction):
    _megatron()
    model = _model()
    start = copy.deepcopy(model)
    x = torch.randn(32, 64, device="cuda")
    opt = _peers.make_megatron_hybrid_device_optimizer(
        model.parameters(), offload_fraction=fraction, lr=LR, cpu_optimizer=cpu_optimizer
    )
    on_host = sum(p.numel() for p in opt.gpu_params_map_cpu_copy)
    assert on_host >= fraction * sum(p.numel() for p in model.parameters())
    _train(model, opt, x)
    _check_against_gpu_adamw(model, start, x)


def test_torchao_steps_like_gpu_adamw_and_its_hooks_end_with_it():
    _torchao()
    model = _model()
    start = copy.deepcopy(model)
    x = torch.randn(32, 64, device="cuda")
    opt = _peers.make_torchao_cpu_offload_optimizer(model.parameters(), lr=LR, offload_gradients=True)
    _train(model, opt, x)
    _check_against_gpu_adamw(model, start, x)
    opt.close()
    model(x).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters()), "torchao's hook still deletes gradients"


def test_megatron_after_torchao_on_the_same_model_still_steps():
    # benchmarks/optimizer.py's order (Note [Peer hooks outlive the peer] in _peers.py): torchao with
    # offload_gradients, dropped without close(), then Megatron on the same parameters.
    _megatron()
    _torchao()
    model = _model()
    x = torch.randn(32, 64, device="cuda")
    opt = _peers.make_torchao_cpu_offload_optimizer(model.parameters(), lr=LR, offload_gradients=True)
    _train(model, opt, x, steps=1)
    del opt
    gc.collect()
    start = copy.deepcopy(model)
    hdo = _peers.make_megatron_hybrid_device_optimizer(model.parameters(), lr=LR, cpu_optimizer="fused")
    _train(model, hdo, x)
    _check_against_gpu_adamw(model, start, x)
