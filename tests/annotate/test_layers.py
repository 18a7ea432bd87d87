"""The layer forwards run the user's own code (Note [Layer forwards] in annotate/_layers.py):
instance-level forwards, optional arguments, per-module training flags and Python flags, framework
wrappers, a device chosen after the transform, and one model on two threads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn

from annotate_offload.annotate import offload_transform
from annotate_offload.errors import OffloadError

from ._models import MLPBlock, Stack, assert_same_step, cfg, run_step, sync_of

X = torch.randn(2, 32, 64)


def _offloads(model, n=2):
    assert set(sync_of(model).stats.bytes_offloaded_per_layer) == set(range(n))


def test_an_instance_forward_set_before_the_transform_is_what_runs():
    model = Stack(4)
    ref = copy.deepcopy(model)
    for m in (model, ref):
        orig = m.forward
        m.forward = lambda *a, _orig=orig, **k: _orig(*a, **k) * 2
    offload_transform(model, 2, config=cfg())
    assert_same_step(run_step(model, X), run_step(ref, X))
    _offloads(model)


class OptionalArgs(nn.Module):
    """A root forward with optional arguments, used or not."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock() for _ in range(3)])

    def forward(self, x, mask=None, bias=None):
        if mask is not None:
            x = x * mask
        for layer in self.layers:
            x = layer(x)
        return x if bias is None else x + bias


def test_a_root_forward_with_optional_arguments_takes_them_all():
    model = OptionalArgs()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, config=cfg())
    mask, bias = (torch.rand(2, 32, 64) > 0.5).float(), torch.randn(64)
    assert torch.equal(model(X), ref(X))
    assert torch.equal(model(X, mask, bias=bias), ref(X, mask, bias=bias))
    _offloads(model)


class FlagBranches(nn.Module):
    """A non-layer module that branches on its own ``training`` flag, and a Python flag on the root."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Dropout(0.5)
        self.layers = nn.ModuleList([MLPBlock() for _ in range(3)])
        self.scale_output = False

    def forward(self, x):
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x)
        return x * 3 if self.scale_output else x


@pytest.mark.parametrize("emb_training", [False, True])
def test_each_module_training_flag_and_python_flags_are_honoured(emb_training):
    model = FlagBranches()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, config=cfg())
    for m in (model, ref):
        m.train(not emb_training)
        m.emb.train(emb_training)
        m.scale_output = True  # set after the transform
    for seed in range(2):
        torch.manual_seed(seed)
        a = run_step(model, X)
        torch.manual_seed(seed)
        assert_same_step(a, run_step(ref, X))
    _offloads(model)


@pytest.fixture
def accelerator():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    yield acc
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("order", ["transform_then_prepare", "prepare_then_transform"])
def test_accelerate_bf16_autocast_wrapper_is_kept_in_either_order(accelerator, order):
    model = Stack(4)
    ref = accelerator.prepare(copy.deepcopy(model))
    if order == "transform_then_prepare":
        model = accelerator.prepare(offload_transform(model, 2, config=cfg()))
    else:
        model = offload_transform(accelerator.prepare(model), 2, config=cfg())
    assert_same_step(run_step(model, X), run_step(ref, X))
    with torch.no_grad():
        assert model(X).dtype == torch.float32 and torch.equal(model(X), ref(X))
    stats = sync_of(model).stats
    assert set(stats.bytes_offloaded_per_layer) == {0, 1} and stats.kept.get("parameter", 0) > 0  # bf16 casts


def test_the_runtime_binds_its_device_at_the_first_training_forward():
    """Transform a model that has no device yet (built on meta, as FSDP and torchtitan do), then
    materialise it: the runtime takes its backend from the first training step's tensors."""
    ref = Stack(4)
    with torch.device("meta"):
        model = Stack(4)
    offload_transform(model, 2, config=cfg())
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    assert_same_step(run_step(model, X), run_step(ref, X))
    sync = sync_of(model)
    assert sync.backend.device_type == "cpu" and sync.stats.bytes_offloaded > 0
    _offloads(model)


def test_one_model_on_two_threads_says_it_is_in_use_on_another_thread():
    model = Stack(4)
    ref = copy.deepcopy(model)
    offload_transform(model, 2, config=cfg())
    inside, release = threading.Event(), threading.Event()

    def wait(module, args):
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            release.wait(10)

    handle = model.layers[0].fc1.register_forward_pre_hook(wait)  # inside layer 0's scope
    result = {}
    worker = threading.Thread(target=lambda: result.update(step=run_step(model, X)))
    worker.start()
    assert inside.wait(10)
    try:
        with pytest.raises(OffloadError, match=r"model is in use on another thread.*copy.deepcopy"):
            model(X)
    finally:
        release.set()
        worker.join(10)
    handle.remove()
    assert_same_step(result["step"], run_step(ref, X))  # the other thread's step was not disturbed
    assert_same_step(run_step(model, X), run_step(ref, X))
