"""torch.compile of a transformed model: the traced layers and the fx pass (annotate_offload.compile).

* compiled + transformed equals the compiled baseline bit for bit (losses and gradients), on the
  built-in GPT and Llama and a tiny Hugging Face Llama with LoRA (``aot_eager``), and with inductor;
* the transform adds no graph: the compiled model has as many graphs and graph breaks as the
  compiled untransformed one;
* the pass reports the saved activations of the partitioned graph with the reason each one stays,
  its offloaded bytes are what the eligibility rules leave, and the runtime copies exactly those;
* graphs without the package's layers come out of the partitioner unchanged.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from annotate_offload.annotate import offload_transform
from annotate_offload.compile import compiled_offloads
from annotate_offload.compile._pass import _tag
from annotate_offload.config import ModelConfig
from annotate_offload.models import GPTConfig, GPTStack

from _compile_models import H, Stack, assert_same, gpt, hf_lora, llama, step  # noqa: E402

dynamo = pytest.importorskip("torch._dynamo")
import torch._functorch.config  # noqa: E402
import torch._inductor.config  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _offloaded(report) -> list:
    return [s for s in report.saved if s.kept is None]


def _check_runtime_agrees(model) -> None:
    """The runtime copied per step exactly what the pass reported for the model's one graph."""
    (report,) = compiled_offloads(model)
    stats = model.offload_plan.runtime.stats
    assert stats.bytes_offloaded == report.offloaded_bytes > 0
    assert stats.bytes_reloaded == stats.bytes_offloaded and stats.on_demand_reloads == 0
    assert stats.tensors_offloaded == len(_offloaded(report))
    assert set(stats.bytes_offloaded_per_layer) == {s.layer for s in _offloaded(report)}
    assert stats.resident_bytes == 0  # the end of backward released every device copy


@pytest.mark.parametrize("make", [gpt, llama, hf_lora], ids=["gpt", "llama", "hf_lora"])
def test_compiled_transformed_model_equals_compiled_baseline(make):
    if make is hf_lora:
        pytest.importorskip("transformers"), pytest.importorskip("peft")
    model, inputs = make()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, min_offload_numel=16, prefetch_layers=1)
    counts = {name: CompileCounterWithBackend("aot_eager") for name in ("baseline", "transformed")}
    compiled_ref = torch.compile(ref, backend=counts["baseline"])
    base = [step(ref, compiled_ref, inputs) for _ in range(2)]
    base_breaks = sum(counters["graph_break"].values())
    compiled = torch.compile(model, backend=counts["transformed"])
    for want in base:
        assert_same(step(model, compiled, inputs), want)
        _check_runtime_agrees(model)
    assert counts["transformed"].frame_count == counts["baseline"].frame_count == 1
    assert sum(counters["graph_break"].values()) - base_breaks == base_breaks == 0
    assert {s.layer for s in _offloaded(compiled_offloads(model)[0])} == {0, 1}


@pytest.mark.parametrize("make", [gpt, llama], ids=["gpt", "llama"])
def test_inductor_equals_compiled_baseline(make):
    """Inductor may lay a saved tensor out otherwise than its graph says (Llama's rotated q: contiguous, not
    transposed); the reload is laid out as the backward reads it."""
    model, inputs = make()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, min_offload_numel=16, prefetch_layers=1, release_lag=0)
    # graph caches off, so the pass runs on this compile; compiled kernels may come from the cache
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        compiled, compiled_ref = torch.compile(model), torch.compile(ref)
        for _ in range(2):
            assert_same(step(model, compiled, inputs), step(ref, compiled_ref, inputs))
            _check_runtime_agrees(model)


def _report(model, x) -> list:
    compiled = torch.compile(model, backend="aot_eager")
    step(model, compiled, (x,))
    (report,) = compiled_offloads(model)
    return report


def test_offloaded_bytes_are_the_eligible_saved_activations_of_offloaded_layers():
    """Block i saves its input (8, H) and its relu output (8, 2H) (fp32) for backward, and its two
    weights. With layers 0 and 1 offloaded the pass offloads relu_0, relu_1 and block 1's input (the
    output of block 0); block 0's input is the compiled function's input and stays, like the weights.
    Eager mode offloads that input too: 8 * H * 4 bytes more."""
    x = torch.randn(8, H)
    model = Stack()
    offload_transform(model, 2, min_offload_numel=16)
    report = _report(model, x)
    moved = [(s.layer, s.shape) for s in _offloaded(report)]
    assert sorted(moved) == [(0, (8, 2 * H)), (1, (8, H)), (1, (8, 2 * H))]
    assert report.offloaded_bytes == 8 * (2 * H + H + 2 * H) * 4
    kept = {(s.layer, s.shape): s.kept for s in report.saved if s.kept is not None}
    assert kept[(0, (8, H))] == "input"  # the model input, saved by block 0's first Linear
    assert {kept[(i, (2 * H, H))] for i in (0, 1)} == {kept[(i, (H, 2 * H))] for i in (0, 1)} == {"input"}
    assert {why for (layer, _), why in kept.items() if layer in (2, 3)} == {"layer_not_offloaded"}

    eager = Stack()
    eager.load_state_dict(model.state_dict())
    offload_transform(eager, 2, min_offload_numel=16)
    step(eager, eager, (x,))
    assert eager.offload_plan.runtime.stats.bytes_offloaded == report.offloaded_bytes + 8 * H * 4


def test_a_compiled_selective_offload_layer_offloads_what_it_keeps_and_stays_exact(plan_choices):
    """Traced, a selective layer runs under torch's selective checkpoint: the partitioned graph saves
    block 0's first Linear output (8, 2H), kept for the rerun, which the pass offloads; the relu is
    rerun from it. Block 0's input is the compiled function's input and stays."""
    x = torch.randn(8, H)
    model = Stack()
    ref = copy.deepcopy(model)
    plan_choices(["selective_offload", "selective", "keep", "keep"])
    offload_transform(model, memory_budget="1MiB", example_inputs=(x,),
                      config=ModelConfig(cpu_offloading=True, min_offload_numel=16))
    assert_same(step(model, torch.compile(model, backend="aot_eager"), (x,)), step(ref, ref, (x,)))
    (report,) = compiled_offloads(model)
    assert [(s.layer, s.shape) for s in _offloaded(report)] == [(0, (8, 2 * H))]
    assert model.offload_plan.runtime.stats.bytes_offloaded_per_layer == {0: 8 * 2 * H * 4}


def test_small_and_marked_activations_stay():
    x = torch.randn(8, H)
    model = Stack()
    offload_transform(model, 2, min_offload_numel=8 * H + 1)  # between a block input and a relu output
    report = _report(model, x)
    assert {s.shape for s in _offloaded(report)} == {(8, 2 * H)}
    assert [s.kept for s in report.saved if s.layer == 1 and s.shape == (8, H)] == ["too_small"]

    marked = Stack(keep_hidden=True)  # mark_not_offload on every relu output
    offload_transform(marked, 2, min_offload_numel=16)
    report = _report(marked, x)
    assert [(s.layer, s.shape) for s in _offloaded(report)] == [(1, (8, H))]
    assert {s.kept for s in report.saved if s.shape == (8, 2 * H) and s.layer in (0, 1)} == {"marked"}


def test_two_forwards_before_backward_and_retained_graph_stay_exact():
    x1, x2 = torch.randn(8, H), torch.randn(8, H)
    model = Stack()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, min_offload_numel=16)
    runs = {}
    for name, m in (("ref", ref), ("offload", model)):
        compiled = torch.compile(m, backend="aot_eager")
        a, b = compiled(x1.clone().requires_grad_()), compiled(x2.clone().requires_grad_())
        a.square().mean().backward(retain_graph=True)
        a.square().mean().backward()  # the retained graph reloads from its host copies again
        b.square().mean().backward()
        runs[name] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for name, grad in runs["ref"].items():
        assert torch.equal(runs["offload"][name], grad), name


def test_graphs_without_layers_are_unchanged():
    """After a transformed model's compile has installed the pass, an untransformed model's forward
    and backward graphs are what the partitioner makes with torch's activation-offloading hook off."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    transformed = Stack()
    offload_transform(transformed, 2, min_offload_numel=16)
    step(transformed, torch.compile(transformed, backend="aot_eager"), (torch.randn(8, H),))

    def capture(codes):
        def compiler(gm, example_inputs):
            codes.append(gm.code)
            return make_boxed_func(gm.forward)

        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)

    plain, x = Stack(), torch.randn(8, H)
    results = []
    for hook in (True, False):
        torch._dynamo.reset()
        codes: list = []
        with torch._functorch.config.patch(enable_activation_offloading=hook):
            out = step(plain, torch.compile(plain, backend=capture(codes)), (x,))
        results.append((codes, out))
    (with_pass, out_a), (without, out_b) = results
    assert len(with_pass) == 2 and with_pass == without
    assert not any("annotate_offload" in code for code in with_pass)
    assert_same(out_a, out_b)


def test_eager_training_imports_no_compiler(run_group):
    code = (
        "import sys, torch\n"
        "from annotate_offload.annotate import offload_transform\n"
        "from annotate_offload.models import GPTConfig, GPTStack\n"
        "m = GPTStack(GPTConfig(hidden=32, heads=2, layers=4))\n"
        "offload_transform(m, 2, min_offload_numel=16)\n"
        "m(torch.randn(2, 8, 32)).sum().backward()\n"
        "assert m.offload_plan.runtime.stats.bytes_offloaded > 0\n"
        "print(sorted(k for k in ('torch._dynamo', 'torch._inductor') if k in sys.modules))\n"
    )
    out = run_group([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _partitioned(model, x) -> list:
    """The forward and backward graphs of ``model``'s compile as the pass leaves them (min-cut
    partitioner, as inductor and ``aot_eager``)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: list = []

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)
    step(model, torch.compile(model, backend=backend), (x,))
    return graphs


def _gpt4():
    model = GPTStack(GPTConfig(hidden=32, heads=2, layers=4))
    offload_transform(model, 3, min_offload_numel=16, release_lag=0, prefetch_layers=1)
    return model, torch.randn(2, 16, 32)


def test_each_layer_is_released_before_the_layer_after_its_release_point():
    """The min-cut partitioner hands an op's saved output (SDPA's) to the backward through detach nodes
    at the end of the forward; its save, hence its layer's release, must not move there with them.
    With release_lag=0 layer i is released once layer i + 1 saves: before any node of layer i + 2."""
    fw, _ = _partitioned(*_gpt4())
    nodes = list(fw.nodes)
    for i in (0, 1):
        (release,) = [k for k, n in enumerate(nodes) if n.name == f"offload_release_{i}"]
        assert not [n.name for n in nodes[:release] if _tag(n) is not None and _tag(n)[1] > i + 1]


def test_the_backward_loads_each_storage_unit_once_and_takes_views_of_the_reload(monkeypatch):
    """q, k and v are views of one fused qkv buffer, one storage unit (Note [Storage units]). The backward
    loads every unit once, as the reload itself (no copy), and takes the saved tensors as views of it:
    a load per tensor had the runtime copy the unit from each tensor's offset on, about three units."""
    from annotate_offload.runtime._layer_state import _LayerState
    from annotate_offload.runtime._synchronizer import OffloadSynchronizer

    reloads, handed = [], []  # held, so that no address is reused within the step
    reload, unpack = _LayerState._reload, OffloadSynchronizer.graph_unpack

    def spy_reload(self, todo):
        reload(self, todo)
        reloads.extend(s.bwd_gpu_tensor_group.tensor_list[u] for s, u in todo)

    def spy_unpack(self, *args):
        handed.append(unpack(self, *args))
        return handed[-1]

    monkeypatch.setattr(_LayerState, "_reload", spy_reload)
    monkeypatch.setattr(OffloadSynchronizer, "graph_unpack", spy_unpack)
    model, x = _gpt4()
    _, bw = _partitioned(model, x)
    loads = list(bw.find_nodes(op="call_function", target=torch.ops.annotate_offload.load.default))
    tokens = [t for load in loads for t in load.args[0]]
    assert len(tokens) == len(set(tokens)) == len(_offloaded(compiled_offloads(model)[0]))
    assert sorted(len(load.args[0]) for load in loads).count(3) == 3  # q, k, v of each offloaded layer
    for load in loads:  # its views and the wait before them
        assert {u.target for u in load.users} == {torch.ops.aten.as_strided.default,
                                                  torch.ops.annotate_offload.ready.default}
    assert len(handed) == len(loads) and {t.data_ptr() for t in handed} == {t.data_ptr() for t in reloads}


def _step_peak(model, run, x) -> int:
    """Peak bytes of the CPU allocator above the start of one fwd/bwd step through ``run``."""
    from torch._C._profiler import _EventType

    for p in model.parameters():
        p.grad.zero_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run(x).float().square().mean().backward()
    sizes, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        if event.typed[0] == _EventType.Allocation:
            sizes.append((event.start_time_ns, event.typed[1].alloc_size))
        todo.extend(event.children)
    live = peak = 0
    for _, size in sorted(sizes, key=lambda s: s[0]):
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("n", [1, 3], ids=["W2", "W1"])
def test_inductor_sees_reloads_where_the_runtime_allocates_them(n):
    """The runtime allocates a layer's reloads where its schedule starts them (layer 0's when the backward
    reaches layer 1, or half of layer 1's reloads are used), and inductor plans its buffers by the memory
    it sees alive: it keeps a dead buffer for a later one of its size while that stays below the graph's
    peak. With a load at its unit's first use, inductor would not see layer 0's reloads during layer 1's
    backward and would keep a dead (tokens x 4 hidden) buffer of layer 1's MLP there for layer 0, above
    the compiled baseline's peak."""
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=512, heads=8, layers=4), dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(1, 256, 512, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    offload_transform(model, n, min_offload_numel=1024, prefetch_layers=1, release_lag=1)
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        compiled, compiled_ref = torch.compile(model), torch.compile(ref)
        for _ in range(2):
            _step_peak(ref, compiled_ref, x), _step_peak(model, compiled, x)
        base, peak = _step_peak(ref, compiled_ref, x), _step_peak(model, compiled, x)
    _check_runtime_agrees(model)
    assert peak <= base, (peak, base)


class _UseBeforeGradient(torch.nn.Module):
    """``x + silu(lin(x))``: the backward recomputes the sigmoid from the saved input before the layer's gradient
    arrives, so a unit of layer ``m`` is used before ``m`` is reached."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.lin(x))


def test_a_saved_tensor_used_before_its_layers_gradient_compiles_and_stays_exact():
    model = Stack(3)
    model.layers = torch.nn.ModuleList(_UseBeforeGradient() for _ in range(3))
    ref = copy.deepcopy(model)
    offload_transform(model, 2, prefetch_layers=1, min_offload_numel=0)
    inputs = (torch.randn(2, 16, H),)  # Linear on 3-D input: the recompute of the sigmoid reads the saved view
    compiled, compiled_ref = torch.compile(model, backend="aot_eager"), torch.compile(ref, backend="aot_eager")
    for _ in range(2):
        assert_same(step(model, compiled, inputs), step(ref, compiled_ref, inputs))
