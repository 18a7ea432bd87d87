"""Measurement: saved/checkpoint bytes, the model left as found, layer discovery, bandwidth cache."""

import copy
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from annotate_offload import offload_transform
from annotate_offload.config import ModelConfig
from annotate_offload.planner._bandwidth import measure_adamw, measure_bandwidth
from annotate_offload.planner._cost_model import LinkBandwidth
from annotate_offload.planner._measure import measure, measure_layers
from annotate_offload.planner import _bandwidth
from annotate_offload.annotate._discover import find_layers


class Block(nn.Module):
    """Linear (saves its input) -> BatchNorm (running stats) -> Dropout (RNG) -> ReLU (saves its output)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return torch.relu(self.drop(self.bn(self.lin(x))))


class Net(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class ThreeViews(nn.Module):
    """Saves one storage three times (as x, x.t() and x[:2]) plus its weight-free product."""

    def forward(self, x):
        return (x * x).sum() + (x.t() * x.t()).sum() + (x[:2] * x[:2]).sum()


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ThreeViews(), ThreeViews()])

    def forward(self, x):
        return self.layers[1](self.layers[0](x) * torch.ones_like(x))


def test_the_planner_plans_the_layers_the_transform_finds():
    net, x = Net(depth=3), torch.randn(8, 16)
    assert [m.name for m in measure_layers(net, None, (x,), warmup=0, repeats=1)] == ["blocks.0", "blocks.1",
                                                                                         "blocks.2"]
    # two repeated containers: the one with more parameters (the transform's rule), not the one with more children
    seq = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), nn.ReLU(),
                        nn.Sequential(*(nn.Identity() for _ in range(3))))
    assert [m.name for m in measure_layers(seq, None, (x,), warmup=0, repeats=1)] == ["0.0", "0.1"]
    assert [ref.fqn for ref in find_layers(seq)[0]] == ["0.0", "0.1"]
    with pytest.raises(ValueError, match="plan_offload: found no layers in Linear.*pass layers="):
        measure_layers(nn.Linear(2, 2), None, (torch.randn(2, 2),))


def test_saved_bytes_count_unique_storages_without_parameters():
    width, batch = 16, 8
    net = Net(width, depth=2)
    x = torch.randn(batch, width)
    m = measure_layers(net, None, (x,), warmup=0, repeats=1)
    act = batch * width * 4  # one float32 activation
    assert [q.name for q in m] == ["blocks.0", "blocks.1"]
    assert m[0].checkpoint_input_bytes == act
    # Linear saves its input; BatchNorm its input and 2 per-channel batch stats; dropout its mask (float32
    # on CPU) and relu its output. The weight (a parameter) and the running stats (buffers) are not counted.
    bn_stats = 2 * width * 4
    assert m[0].saved_bytes == act + act + bn_stats + act + act
    assert m[0].forward_ms > 0 and m[0].backward_ms > 0
    # a selective recompute keeps the Linear's output (the one matrix multiply) and reruns the rest
    assert m[0].selective_bytes == act and m[0].selective_ms >= m[0].backward_ms
    assert m[0].unmoved_selective_bytes == 0
    small = measure_layers(net, None, (x,), warmup=0, repeats=1, min_offload_numel=batch * width + 1)
    assert small[0].unmoved_selective_bytes == act  # under the runtime's threshold it would stay


def test_phases_are_scaled_to_the_layers_time_inside_one_pass_of_the_model(monkeypatch):
    from annotate_offload.planner import _measure

    capture = _measure._capture_inputs
    inside = {}

    def timed_inside(*args):
        captured, other, _ = capture(*args)
        return captured, other, inside["ms"]

    monkeypatch.setattr(_measure, "_capture_inputs", timed_inside)
    net, x = Net(16, depth=2), torch.randn(8, 16)
    inside["ms"] = 1e6  # the layers ran far slower inside the pass (a throttled clock): every phase scales up
    slow = measure_layers(net, None, (x,), warmup=0, repeats=1)
    assert sum(m.forward_ms for m in slow) == pytest.approx(1e6)
    for m in slow:  # one factor for every phase (a CPU backward of this net takes well under a second)
        assert m.backward_ms > 1e3 and m.recompute_ms >= m.backward_ms and m.selective_ms >= m.backward_ms
    inside["ms"] = 0.0  # faster inside the pass than alone: never scaled down
    fast = measure_layers(net, None, (x,), warmup=0, repeats=1)
    assert sum(m.forward_ms for m in fast) < 1e3


def test_the_step_measurement_counts_weights_gradients_peaks_and_the_optimizer(monkeypatch):
    monkeypatch.setattr(_bandwidth, "_ADAMW_CACHE", {"cpu": (100.0, 100.0)})
    width, batch = 16, 8
    net = Net(width, depth=2)
    x = torch.randn(batch, width)
    layers, step = measure(net, None, (x,), warmup=0, repeats=1)
    act, block_params = batch * width * 4, width * width * 4 + 2 * width * 4  # linear weight; norm weight, bias
    outside = (width * width + width + width + 1) * 4  # inp, head
    assert step.static_bytes == sum(t.numel() * t.element_size() for t in (*net.parameters(), *net.buffers()))
    assert step.other_grad_bytes == outside and [q.grad_bytes for q in layers] == [block_params] * 2
    assert step.param_numels == tuple(p.numel() for p in net.parameters())
    assert step.param_state_bytes == tuple(8 * p.numel() for p in net.parameters())
    assert (step.device_ms, step.host_ms) == (100.0, 100.0) and step.other_ms >= 0
    # on a CPU: F+ = the new saved tensors and the output (here relu's saved result; the input is the
    # caller's), B+ = the input gradient
    assert layers[0].forward_peak_bytes == layers[0].saved_bytes - act
    assert layers[0].backward_peak_bytes == act
    assert measure(net, None, (x,), warmup=0, repeats=1, optimizer=False)[1].param_numels == ()


def test_weights_autocast_casts_are_counted_as_staying_on_the_device():
    net = Net(width=64, depth=2)
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = measure_layers(net, None, (x,), warmup=0, repeats=1)
    cast = 64 * 64 * 2  # the bf16 copy of each block's Linear weight, saved for its backward
    assert all(q.cast_bytes == cast and q.unmoved_bytes >= cast for q in m)
    assert measure_layers(net, None, (x,), warmup=0, repeats=1)[0].cast_bytes == 0


def test_adamw_speed_is_measured_once_per_device(monkeypatch):
    monkeypatch.setattr(_bandwidth, "_ADAMW_CACHE", {})
    first = measure_adamw("cpu", numel=1 << 12)
    assert first[0] == first[1] > 0 and measure_adamw("cpu") is first


def test_views_of_one_storage_count_once():
    w = Wrapper()
    x = torch.randn(4, 64, requires_grad=True)  # an input the model differentiates: not static memory
    m = measure_layers(w, None, (x,), warmup=0, repeats=1)
    assert m[0].saved_bytes == 4 * 64 * 4  # x, x.t() and x[:2] share one storage


def test_measurement_leaves_the_model_as_found():
    net = Net(depth=3)
    net.eval()
    net.blocks[1].train()  # a mixed training state must survive
    x = torch.randn(8, 16)
    net.train()
    net(x).sum().backward()  # running stats moved away from their init, grads present
    net.eval()
    net.blocks[1].train()
    net.head.weight.grad = None  # a None grad must stay None
    grads = {n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in net.named_parameters()}
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    modes = {n: m.training for n, m in net.named_modules()}
    rng = torch.get_rng_state()

    measure_layers(net, list(net.blocks), (x,), warmup=1, repeats=2)

    for n, p in net.named_parameters():
        obj, value = grads[n]
        assert p.grad is obj
        if value is not None:
            assert torch.equal(p.grad, value)
    for n, b in net.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert {n: m.training for n, m in net.named_modules()} == modes
    assert torch.equal(torch.get_rng_state(), rng)


def test_state_is_restored_when_profiling_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    net = Net(depth=2)
    net.blocks.append(Block(16))
    net.unused = Block(16)
    x = torch.randn(4, 16)
    rng = torch.get_rng_state()
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    net.eval()
    with pytest.raises(ValueError, match=r"layers \[1\] were not called"):
        measure_layers(net, [net.blocks[0], net.unused], (x,))
    net.blocks[2].forward = Boom().forward
    with pytest.raises(RuntimeError, match="boom"):
        measure_layers(net, None, (x,))
    assert not any(m.training for m in net.modules())
    assert torch.equal(torch.get_rng_state(), rng)
    for n, b in net.named_buffers():
        assert torch.equal(b, buffers[n])


def test_bad_arguments():
    net = Net(depth=2)
    with pytest.raises(ValueError, match=r"layers\[0\] \(Linear\) is not a submodule"):
        measure_layers(net, [nn.Linear(16, 16)], (torch.randn(2, 16),))
    with pytest.raises(TypeError, match="example_inputs must be a tensor"):
        measure_layers(net, None, 3)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        measure_layers(net, None, (torch.randn(2, 16),), repeats=0)
    with pytest.raises(ValueError, match="layers is empty"):
        measure_layers(net, [], (torch.randn(2, 16),))


def test_bandwidth_is_measured_once_per_device(monkeypatch):
    monkeypatch.setattr(_bandwidth, "_BANDWIDTH_CACHE", {})
    calls = []
    real = _bandwidth._measure_link

    def counting(dev, nbytes, repeats):
        calls.append(str(dev))
        return real(dev, nbytes, repeats)

    monkeypatch.setattr(_bandwidth, "_measure_link", counting)
    first = measure_bandwidth("cpu", nbytes=1 << 20, repeats=2)
    assert isinstance(first, LinkBandwidth) and first.d2h_gbps > 0
    assert "cpu memcpy" in first.source
    assert measure_bandwidth(torch.device("cpu")) is first
    assert calls == ["cpu"]
    with pytest.raises(ValueError, match="device='nonsense' is not a torch device"):
        measure_bandwidth("nonsense")


def test_importing_the_planner_does_not_initialise_cuda(run_group):
    code = "import torch, annotate_offload.planner; print(torch.cuda.is_initialized())"
    out = run_group([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, *, debug=None, use_reentrant=None):  # names torch.utils.checkpoint also takes
        assert debug is False and use_reentrant is True
        return self.lin(x).relu()


class _KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Keywords() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, debug=False, use_reentrant=True)
        return x


def test_layers_whose_keywords_share_checkpoints_names_are_measured_with_their_own_values():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the head too: no "could not measure" warning
        layers, step = measure(_KeywordNet(), None, (torch.randn(8, 16),), warmup=0, repeats=1, optimizer=False)
    assert len(layers) == 2 and all(m.recompute_ms >= m.backward_ms for m in layers)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_measuring_under_no_grad_or_inference_mode_measures_as_with_grad(mode):
    net, x = Net(width=16, depth=2), torch.randn(8, 16)
    with mode():
        quiet = measure_layers(net, None, (x.clone(),), warmup=0, repeats=1)  # an inference tensor there
    loud = measure_layers(net, None, (x,), warmup=0, repeats=1)
    fields = ("saved_bytes", "checkpoint_input_bytes", "backward_peak_bytes", "recompute_peak_bytes")
    assert [[getattr(m, f) for f in fields] for m in quiet] == [[getattr(m, f) for f in fields] for m in loud]


@pytest.mark.parametrize("recompute", [False, True])
def test_a_transformed_model_is_measured_as_its_own_code_and_stays_transformed(recompute):
    torch.manual_seed(0)
    net, x = Net(width=16, depth=3), torch.randn(8, 16)
    plain = copy.deepcopy(net)
    offload_transform(net, num_layers=2, config=ModelConfig(cpu_offloading=True, recompute=recompute))
    wrappers, tuner = [b.__dict__["forward"] for b in net.blocks], dict(net._forward_pre_hooks)
    fields = ("saved_bytes", "checkpoint_input_bytes", "backward_peak_bytes", "recompute_peak_bytes")
    got = measure_layers(net, None, (x,), warmup=0, repeats=1)
    want = measure_layers(plain, None, (x,), warmup=0, repeats=1)
    assert [[getattr(m, f) for f in fields] for m in got] == [[getattr(m, f) for f in fields] for m in want]
    assert all(b.__dict__["forward"] is w for b, w in zip(net.blocks, wrappers))  # the same wrappers back
    assert net._forward_pre_hooks.keys() == tuner.keys()  # the schedule is still tuned at the first step
    for model in (net, plain):
        torch.manual_seed(1)
        model(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), plain.parameters()))


@pytest.mark.cuda
def test_cuda_measurement_restores_cuda_rng_and_times_with_events():
    net = Net(depth=2).cuda()
    x = torch.randn(64, 16, device="cuda")
    cuda_rng = torch.cuda.get_rng_state_all()
    m = measure_layers(net, None, (x,))
    assert all(q.forward_ms > 0 and q.backward_ms > 0 for q in m)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda_rng))


@pytest.mark.cuda
def test_cuda_step_measurement_reads_the_allocator():
    net = Net(width=256, depth=2).cuda()
    x = torch.randn(4096, 256, device="cuda")
    layers, step = measure(net, None, (x,))
    assert step.static_bytes == torch.cuda.memory_allocated()  # weights, buffers and x; no gradients
    assert all(q.forward_peak_bytes >= q.saved_bytes - 4096 * 256 * 4 > 0 and q.backward_peak_bytes > 0 for q in layers)
    assert step.host_ms > step.device_ms > 0


@pytest.mark.cuda
def test_cuda_predicted_peaks_of_keep_and_full_recompute_are_the_measured_ones():
    from annotate_offload.models import GPTConfig, GPTStack
    from annotate_offload.planner._cost_model import predict

    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=1024, heads=8, layers=4), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    layers, step = measure(model, None, (x,), optimizer=False)
    for choice in ("keep", "recompute"):
        for layer in model.layers:
            if choice == "recompute":
                layer.forward = (lambda f: lambda h: checkpoint(f, h, use_reentrant=False))(layer.forward)
        for _ in range(2):  # the second step is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = model(x)
            out.backward(torch.ones_like(out))  # the output held, its gradient made by the step (as a loss's)
            del out
        measured, static = torch.cuda.max_memory_allocated(), step.static_bytes
        predicted = predict(layers, [choice] * 4, LinkBandwidth(50.0, 50.0), step).peak_bytes
        assert abs(predicted - measured) <= 0.02 * (measured - static) + 2**21, (choice, predicted, measured, static)


@pytest.mark.cuda
def test_cuda_bandwidth_is_pinned_and_cached(monkeypatch):
    monkeypatch.setattr(_bandwidth, "_BANDWIDTH_CACHE", {})
    bw = measure_bandwidth("cuda")
    assert bw.d2h_gbps > 1 and bw.h2d_gbps > 1 and "pinned" in bw.source
    assert measure_bandwidth(f"cuda:{torch.cuda.current_device()}") is bw


def test_unmoved_bytes_are_the_saved_tensors_under_the_threshold():
    net = Net(width=16)
    x = torch.randn(64, 16)
    every = measure_layers(net, None, (x,), warmup=0, repeats=1)
    none = measure_layers(net, None, (x,), warmup=0, repeats=1, min_offload_numel=64 * 16 + 1)
    some = measure_layers(net, None, (x,), warmup=0, repeats=1, min_offload_numel=1)
    for a, b, c in zip(every, none, some):
        assert a.unmoved_bytes == 0 and c.unmoved_bytes == 0
        assert b.unmoved_bytes == b.saved_bytes > 0  # every saved tensor is 64 x 16: all stay
        assert b.unmoved_input_bytes == b.checkpoint_input_bytes > 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_a_forward_that_fails_on_the_example_inputs_says_so():
    """A wrong example_inputs shape raises the model's own error, which keeps its type and gains a
    note naming example_inputs."""
    net = Net(depth=2)
    with pytest.raises(RuntimeError) as info:
        measure_layers(net, None, (torch.randn(4, 7),))
    assert any("check that example_inputs= is what the forward takes" in n for n in getattr(info.value, "__notes__", []))


def test_the_head_after_the_last_layer_is_measured_and_the_model_left_as_found():
    from annotate_offload.models import GPTConfig, GPTStack

    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=32, heads=2, layers=3, vocab=1000, max_seq=64))
    x = torch.randint(0, 1000, (4, 64))
    layers, step = measure(model, None, (x,))
    logits = 4 * 64 * 1000 * 4
    assert step.output_bytes == logits
    # the final LayerNorm and the head save (at least) the last hidden states twice
    assert step.head_saved_bytes >= 2 * 4 * 64 * 32 * 4
    assert step.head_backward_peak_bytes == logits  # on a CPU: the outputs' gradient
    assert all(p.grad is None for p in model.parameters())
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    # a GPT block's first op (LayerNorm) saves its input: on a CPU a rerun counts it once, as its input
    assert all(m.checkpoint_input_bytes == 4 * 64 * 32 * 4 for m in layers)
    assert all(m.recompute_peak_bytes == max(m.forward_peak_bytes, m.saved_bytes - m.checkpoint_input_bytes
                                             + m.backward_peak_bytes) for m in layers)
    # a rerun timed faster than the plain backward (noise on a tiny layer) counts as the plain backward
    assert all(m.recompute_ms >= m.backward_ms for m in layers)


class _Scale(nn.Module):
    def forward(self, x, table):
        return x * table


class _TableModel(nn.Module):
    """A layer that multiplies by a buffer: in the model's forward only the buffer is saved."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("table", torch.randn(64))
        self.scale = _Scale()

    def forward(self, x):
        return self.scale(self.lin(x), self.table)


def test_a_layer_input_without_gradient_in_the_model_is_profiled_without_one():
    model = _TableModel()
    m = measure_layers(model, [model.scale], (torch.randn(32, 64),), warmup=0, repeats=1)[0]
    # x * table saves table (a buffer: static) and not x, whose gradient is table alone
    assert m.saved_bytes == 0
    assert m.checkpoint_input_bytes == 32 * 64 * 4  # lin's output; the buffer is static memory


class _TanhBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _Gated(nn.Module):
    """A gate between layers 0 and 1, outside every layer: sigmoid saves its own output."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_TanhBlock() for _ in range(3)])
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0:
                x = x * torch.sigmoid(self.gate(x))
        return x


def test_measuring_leaves_no_reference_to_the_model():
    import gc
    import weakref

    model = _Gated()
    weight = weakref.ref(model.layers[0].lin.weight)
    # the head's backward stops at the last layer's output gradient: the gate's saves are never used
    measure(model, list(model.layers), (torch.randn(4, 16),), warmup=0, repeats=1)
    del model
    gc.collect()
    assert weight() is None
