"""offload_transform: validation, in-place contract, bit-identical numerics, plans."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn

from annotate_offload.annotate import offload_layer, offload_transform, remove_offload
from annotate_offload.annotate._plan import OffloadPlan
from annotate_offload.config import Config, ModelConfig
from annotate_offload.errors import OffloadError

from ._models import MLPBlock, Stack, assert_same_step, cfg, gpt, run_step, sync_of

L = 4
X = lambda: torch.randn(2, 32, 64)  # noqa: E731


def _transformed(model, n, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload_transform(model, n, config=cfg(), **kw)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("n", [0, 1, L - 1])
@pytest.mark.parametrize("make", [gpt, Stack], ids=["gpt", "mlp"])
def test_loss_and_grads_bit_identical(make, n):
    model = make(L)
    ref = copy.deepcopy(model)
    _transformed(model, n)
    x = X()
    for _ in range(2):  # the second step reuses pinned buffers and a fresh runtime step
        assert_same_step(run_step(model, x), run_step(ref, x))
        stats = sync_of(model).stats
        assert stats.bytes_offloaded_per_layer.keys() == set(range(n))
        assert all(b > 0 for b in stats.bytes_offloaded_per_layer.values())
        assert stats.bytes_reloaded == stats.bytes_offloaded


@pytest.mark.parametrize("n", [1, L - 1])
def test_builtin_llama_bit_identical(n):
    from annotate_offload.models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=L, num_attention_heads=4,
                         num_key_value_heads=2, max_seq_len=64)
    model = Llama(config, seed=0)
    ref = copy.deepcopy(model)
    _transformed(model, n)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (model, ref):
        m(ids).float().square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    assert set(sync_of(model).stats.bytes_offloaded_per_layer) == set(range(n))


def test_autocast_bf16_bit_identical():
    model = gpt(L)
    ref = copy.deepcopy(model)
    _transformed(model, 2)
    x = X()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = run_step(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = run_step(ref, x)
    assert_same_step(a, b)
    stats = sync_of(model).stats
    assert stats.bytes_offloaded > 0 and stats.kept.get("parameter", 0) > 0


def test_bytes_measured_on_first_step_without_example_inputs():
    model = Stack(L)
    _transformed(model, 2)
    assert model.offload_plan.bytes_source == "pending" and model.offload_plan.bytes_per_step is None
    run_step(model, X())
    plan = model.offload_plan
    assert plan.bytes_source == "measured"
    assert [lp.bytes_per_step for lp in plan.layers][:2] == [sync_of(model).stats.bytes_offloaded_per_layer[i] for i in (0, 1)]
    assert "measured" in repr(plan)


def test_plan_says_why_an_offloaded_layer_moved_nothing():
    model = offload_transform(Stack(L), num_layers=2)  # every saved tensor is below the default threshold
    run_step(model, X())
    text = repr(model.offload_plan)
    assert "bytes/step=0 B [measured]" in text
    assert ("offloaded layers 0, 1 moved 0 B: all 10 saved tensors of the offloaded layers (288.00 KiB) are < "
            "min_offload_numel=262144 elements and stay on the device; lower it with min_offload_numel=") in text
    model = offload_transform(Stack(L), num_layers=2, min_offload_numel=5000, offload_policy="opt_in")
    run_step(model, X())  # some small, the rest not selected: not "all" small
    assert ("moved 0 B: 2 saved tensors of the offloaded layers (32.00 KiB) are < min_offload_numel=5000 elements"
            in repr(model.offload_plan)) and "(also kept on the device: not_selected=4, parameter=4)" in repr(model.offload_plan)
    model = offload_transform(Stack(L), num_layers=2, min_offload_numel=0)
    run_step(model, X())
    assert model.offload_plan.bytes_per_step > 0 and "moved 0 B" not in repr(model.offload_plan)


def test_meta_estimate_matches_runtime_on_attention_free_model():
    model = Stack(L)
    _transformed(model, 2, example_inputs=(X(),))
    estimate = {lp.index: lp.bytes_per_step for lp in model.offload_plan.layers}
    run_step(model, X())
    measured = sync_of(model).stats.bytes_offloaded_per_layer
    assert estimate == {0: measured[0], 1: measured[1], 2: 0, 3: 0}
    plan = model.offload_plan
    assert plan.bytes_source == "measured" and [lp.estimated_bytes for lp in plan.layers] == list(estimate.values())
    assert "estimate" in repr(plan).splitlines()[2]  # the table shows both columns


def test_declared_keep_layers_are_skipped_by_num_layers():
    model = Stack(L)
    offload_layer(offload=False)(model.layers[0])
    for blk in model.layers[1:]:
        offload_layer(blk)
    _transformed(model, 2)
    plan = model.offload_plan
    assert [lp.choice for lp in plan.layers] == ["keep", "offload", "offload", "keep"]
    assert plan.layers[0].declared_keep and "keep (declared)" in repr(plan)
    run_step(model, X())
    assert set(sync_of(model).stats.bytes_offloaded_per_layer) == {1, 2}


# --------------------------------------------------------------------------- in place


def test_in_place_contract_and_remove():
    model = gpt(L)
    cls, keys = type(model), list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    sig, layer_sig = inspect.signature(model.forward), inspect.signature(model.layers[0].forward)
    out = _transformed(model, 1)
    assert out is model and type(model) is cls
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert "forward" not in model.__dict__  # the root forward is the user's, untouched
    assert inspect.signature(model.forward) == sig and inspect.signature(model.layers[0].forward) == layer_sig
    assert all("forward" in blk.__dict__ for blk in model.layers)
    assert isinstance(model.offload_plan, OffloadPlan)
    with pytest.raises(OffloadError, match="already transformed.*remove_offload"):
        offload_transform(model, num_layers=1)
    assert remove_offload(model) is model
    assert not hasattr(model, "offload_plan") and not any("forward" in m.__dict__ for m in model.modules())
    assert model.forward.__func__ is cls.forward
    with pytest.raises(OffloadError, match="was not transformed"):
        remove_offload(model)
    with pytest.raises(TypeError, match="remove_offload: model must be the nn.Module"):
        remove_offload("hello")
    _transformed(model, 2)  # transformable again
    remove_offload(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__ for m in model.modules())


def test_eval_forwards_offload_nothing_and_leave_no_state():
    model = gpt(L)
    ref = copy.deepcopy(model)
    _transformed(model, 2)
    sync = sync_of(model)
    x = X()
    with torch.no_grad():
        a = model(x)
    with torch.inference_mode():
        b = model(x)
    assert torch.equal(a, ref(x).detach()) and torch.equal(b, a)
    assert sync.stats.bytes_offloaded == 0 and sync._step is None and sync._scope is None
    assert_same_step(run_step(model, x), run_step(ref, x))


@pytest.mark.parametrize("where", ["inside_a_layer", "between_layers"])
def test_exception_mid_forward_leaves_no_scope_and_next_step_is_clean(where):
    """Inside a layer (a submodule raises) the layer's forward drops the step at once; between
    layers (the layer's own pre-hook raises, before its forward) the next step starts clean."""
    model = Stack(L)
    ref = copy.deepcopy(model)
    _transformed(model, 2)
    calls = {"n": 0}

    def boom(module, args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")

    target = model.layers[1].fc2 if where == "inside_a_layer" else model.layers[2]
    h = target.register_forward_pre_hook(boom)
    x = X()
    with pytest.raises(RuntimeError, match="boom"):
        run_step(model, x)
    sync = sync_of(model)
    assert sync._scope is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no hook left installed
    if where == "inside_a_layer":
        assert sync._step is None
    h.remove()
    for _ in range(2):
        assert_same_step(run_step(model, x), run_step(ref, x))
        assert set(sync.stats.bytes_offloaded_per_layer) == {0, 1}


# --------------------------------------------------------------------------- validation


def test_num_layers_required_and_typed():
    with pytest.raises(ValueError, match="num_layers is required"):
        offload_transform(Stack(L))
    with pytest.raises(TypeError, match="num_layers must be an int or 'auto', got 1.5"):
        offload_transform(Stack(L), num_layers=1.5)
    with pytest.raises(TypeError, match="num_layers must be an int or 'auto', got True"):
        offload_transform(Stack(L), num_layers=True)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        offload_transform("model", num_layers=1)


@pytest.mark.parametrize("n, match", [
    (-1, rf"^offload_transform: num_layers=-1 is negative; pass 0 <= num_layers <= {L - 1} "),
    (L, rf"^offload_transform: CPU offloading can be done only for layers less than {L} \(num_layers={L}\)"),
    (L + 3, rf"^offload_transform: CPU offloading can be done only for layers less than {L} \(num_layers={L + 3}\)")])
def test_num_layers_out_of_range(n, match):
    model = Stack(L)
    before = dict(model.__dict__)
    with pytest.raises(ValueError, match=match):
        offload_transform(model, num_layers=n)
    assert model.__dict__.keys() == before.keys()  # untouched


def test_last_but_one_overlaps_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = offload_transform(Stack(L), num_layers=L - 1)  # the overlap schedule (Note [Default schedule from the link])
    assert (sync_of(model).release_lag, sync_of(model).prefetch_layers) == (1, 1)


def test_options_live_in_the_config_and_bad_values_name_the_field():
    """The schedule, policy, threshold and recompute are config fields, also accepted as keywords
    over the config; any other keyword is refused naming the ones accepted, and a bad value is
    refused (by ModelConfig, or here for a duck-typed config or a keyword) before the model
    changes, naming the field, the value and the fix."""
    model = Stack(L)
    for old in ("policy", "path", "cpu_offloading_num_layers"):
        with pytest.raises(TypeError, match=rf"unexpected keyword '{old}'.*release_lag, prefetch_layers"):
            offload_transform(model, 1, **{old: 1})
    with pytest.raises(ValueError, match=r"config.prefetch_layers must be None or an int >= 1, got 0"):
        offload_transform(model, 1, prefetch_layers=0)
    assert not hasattr(model, "offload_plan")
    with pytest.raises(ValueError, match=r"model\.prefetch_layers=0.*Fix"):
        ModelConfig(cpu_offloading=True, prefetch_layers=0)
    with pytest.raises(TypeError, match=r"model\.recompute must be bool, got 'yes'"):
        ModelConfig(cpu_offloading=True, recompute="yes")

    class Duck:  # a config object that is not a ModelConfig: checked by offload_transform
        cpu_offloading, cpu_offloading_num_layers = True, 1
        release_lag, prefetch_layers, min_offload_numel, offload_policy, recompute = None, None, 0, None, False

    for field, value, exc, match in [
        ("prefetch_layers", 0, ValueError, r"config.prefetch_layers must be None or an int >= 1, got 0; pass e.g."),
        ("release_lag", -1, ValueError, r"config.release_lag must be None or an int >= 0, got -1"),
        ("min_offload_numel", -5, ValueError, r"config.min_offload_numel must be None or an int >= 0, got -5"),
        ("offload_policy", 1, TypeError, r"config.offload_policy must be 'opt_out' or 'opt_in', got 1 \(int\)"),
        ("offload_policy", "all", ValueError, r"config.offload_policy must be 'opt_out' or 'opt_in', got 'all'"),
        ("recompute", "yes", TypeError, r"config.recompute must be a bool, got 'yes'"),
    ]:
        bad = Duck()
        setattr(bad, field, value)
        with pytest.raises(exc, match=match):
            offload_transform(model, config=bad)
    with pytest.raises(TypeError, match=r"(?s)layer_types must be nn.Module subclasses, got MLPBlock.*pass the layer classes"):
        offload_transform(model, num_layers=1, layer_types=MLPBlock())
    assert not any("forward" in m.__dict__ for m in model.modules()) and "offload_plan" not in model.__dict__


def test_numpy_integer_counts_are_accepted():
    np = pytest.importorskip("numpy")
    model = Stack(L)
    offload_transform(model, num_layers=np.int64(2))
    assert model.offload_plan.offloaded_layers == (0, 1)


def test_auto_needs_budget_and_inputs():
    with pytest.raises(ValueError, match="memory_budget=1048576 needs example_inputs="):
        offload_transform(Stack(L), num_layers="auto", memory_budget=1 << 20)


def test_config_gives_num_layers():
    model = Stack(L)
    offload_transform(model, config=cfg(cpu_offloading_num_layers=2))
    assert model.offload_plan.offloaded_layers == (0, 1)
    model = Stack(L)
    offload_transform(model, config=Config(model=ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=1)))
    assert model.offload_plan.offloaded_layers == (0,)


def test_config_and_num_layers_must_agree():
    cfg = ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=2)
    with pytest.raises(ValueError, match=r"num_layers=1 differs from config.cpu_offloading_num_layers=2"):
        offload_transform(Stack(L), num_layers=1, config=cfg)
    offload_transform(Stack(L), num_layers=2, config=cfg)  # equal is fine


def test_config_num_layers_checked_against_model():
    cfg = ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=2, num_layers=8)
    with pytest.raises(ValueError, match=r"config.num_layers=8 but the model has 4 layers"):
        offload_transform(Stack(L), config=cfg)


def test_config_rules_raise_before_the_model_is_touched():
    # The config validates itself: Megatron's text, the field and the fix.
    with pytest.raises(ValueError, match="no support for Pipeline parallelism with CPU offloading"):
        ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=1, pipeline_model_parallel_size=2)

    class Duck:  # a duck-typed config with a validate() that fails
        cpu_offloading = True
        cpu_offloading_num_layers = 1

        def validate(self):
            raise ValueError("CPU offloading does not work when activation recomputation is enabled")

    model = Stack(L)
    with pytest.raises(ValueError, match="activation recomputation is enabled"):
        offload_transform(model, config=Duck())
    assert "forward" not in model.__dict__
    with pytest.raises(TypeError, match="has no activation-offload fields"):
        offload_transform(model, config=object())


def test_config_off_returns_model_unchanged():
    model = Stack(L)
    assert offload_transform(model, config=ModelConfig(cpu_offloading=False)) is model
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError, match="num_layers=2 was given but config.cpu_offloading=False"):
        offload_transform(model, num_layers=2, config=ModelConfig(cpu_offloading=False, prefetch_layers=1))


def test_config_weights_and_double_buffering_warn():
    with pytest.warns(UserWarning, match="cpu_offloading_weights=True has no effect"):
        offload_transform(Stack(L), config=ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=1,
                                                       cpu_offloading_weights=True))
    with pytest.warns(UserWarning, match="cpu_offloading_double_buffering=True has no effect"):
        model = offload_transform(Stack(L), config=ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=1,
                                                               cpu_offloading_double_buffering=True))
    assert any("double_buffering" in n for n in model.offload_plan.notes)
    model = Stack(L)
    with pytest.warns(UserWarning, match="cpu_offloading_weights"):
        offload_transform(model, config=ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=1,
                                                    cpu_offloading_weights=True, cpu_offloading_activations=False))
    assert "forward" not in model.__dict__  # weights only: nothing to do


def test_config_policy_and_threshold_reach_the_runtime():
    model = Stack(L)
    offload_transform(model, config=ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=1,
                                                offload_policy="opt_in", min_offload_numel=7, prefetch_layers=2))
    sync = sync_of(model)
    assert (sync.policy, sync.min_offload_numel, sync.prefetch_layers) == ("opt_in", 7, 2)


def test_plan_repr_is_a_table():
    model = gpt(L)
    _transformed(model, 1)
    text = repr(model.offload_plan)
    assert text.splitlines()[0].startswith("OffloadPlan(layers=4, offloaded=1")
    assert "idx  layer" in text and "layers.0  GPTBlock  offload" in text


def test_meta_estimate_counts_fused_attention_not_the_math_path():
    """Note [Attention on meta]: the meta estimate of a layer with SDPA equals the bytes the CPU run
    (flash kernel) really moves; the math path would add the B x H x S x S probabilities."""
    import torch.nn.functional as F

    from annotate_offload.annotate._estimate import fused_sdpa_on_meta
    from annotate_offload.models.gpt import GPTConfig, GPTStack

    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=64, heads=4, layers=3))
    x = torch.randn(2, 128, 64)
    offload_transform(model, 2, example_inputs=(x,), config=cfg(min_offload_numel=1, prefetch_layers=1))
    est = [lp.bytes_per_step for lp in model.offload_plan.layers]
    model(x).square().mean().backward()
    plan = model.offload_plan
    assert plan.bytes_source == "measured"
    measured = [lp.bytes_per_step for lp in plan.layers]
    assert est == measured and measured[0] > 0
    # the mode itself: meta SDPA saves q, k, v, out and a B x H x S logsumexp, not B x H x S x S
    q = torch.empty(2, 4, 128, 16, device="meta", requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        with fused_sdpa_on_meta():
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert max(saved) == q.numel() and 2 * 4 * 128 in saved


@pytest.mark.parametrize("how", ["autocast_region", "config_bf16"])
def test_meta_estimate_under_bf16_autocast_matches_the_cpu_run(how):
    """Note [Autocast on meta]: with bf16 autocast declared (config.bf16) or active at the call,
    the meta estimate equals what a CPU run under torch.autocast(bfloat16) moves, which is about
    half of the fp32 estimate."""
    from annotate_offload.config import ModelConfig
    from annotate_offload.models.gpt import GPTConfig, GPTStack

    def build():
        torch.manual_seed(0)
        return GPTStack(GPTConfig(hidden=64, heads=4, layers=3))

    x = torch.randn(2, 128, 64)
    fp32 = build()
    offload_transform(fp32, 2, example_inputs=(x,), config=cfg(min_offload_numel=1, prefetch_layers=1))
    fp32_est = [lp.bytes_per_step for lp in fp32.offload_plan.layers]

    model = build()
    if how == "config_bf16":
        config = cfg(cpu_offloading_num_layers=2, bf16=True, min_offload_numel=1, prefetch_layers=1)
        offload_transform(model, config=config, example_inputs=(x,))
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            offload_transform(model, 2, example_inputs=(x,), config=cfg(min_offload_numel=1, prefetch_layers=1))
    est = [lp.bytes_per_step for lp in model.offload_plan.layers]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().mean().backward()
    measured = [lp.bytes_per_step for lp in model.offload_plan.layers]
    assert model.offload_plan.bytes_source == "measured"
    assert est == measured and measured[0] > 0
    assert measured[0] < 0.75 * fp32_est[0]


def test_autocast_on_meta_casts_meta_calls_only():
    import torch.nn.functional as F

    from annotate_offload.annotate._estimate import autocast_on_meta

    w = torch.empty(8, 4, device="meta", requires_grad=True)
    x = torch.empty(2, 4, device="meta")
    with autocast_on_meta(torch.bfloat16):
        assert F.linear(x, w).dtype == torch.bfloat16
        assert F.layer_norm(x.to(torch.bfloat16), (4,)).dtype == torch.float32
        assert (x.to(torch.bfloat16) * x).dtype == torch.float32  # not listed: type promotion
        assert F.linear(torch.ones(2, 4), torch.ones(8, 4)).dtype == torch.float32  # not meta: untouched
        assert F.linear(x.double(), w.double()).dtype == torch.float64  # fp64 is never cast
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float16"):
        autocast_on_meta(torch.float32)


def test_meta_estimate_under_autocast_skips_frozen_weights_casts():
    """A frozen weight's autocast cast has no autograd node; the runtime keeps it by its shape
    (add_frozen_weights), and so must the estimate."""
    from annotate_offload.models.gpt import GPTConfig, GPTStack

    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=64, heads=4, layers=3))
    frozen = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][::2]
    for m in frozen:
        m.requires_grad_(False)
    x = torch.randn(2, 16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        offload_transform(model, 2, example_inputs=(x,), config=cfg(min_offload_numel=1, prefetch_layers=1))
        est = [lp.bytes_per_step for lp in model.offload_plan.layers]
        out = model(x)
    out.float().square().mean().backward()
    assert model.offload_plan.bytes_source == "measured"
    assert est == [lp.bytes_per_step for lp in model.offload_plan.layers] and est[0] > 0


def test_layer_input_is_copied_only_if_saved_under_autocast():
    """Note [Layer input at entry]: a block whose first op is a conv saves only the bf16 cast of its
    input under autocast; the fp32 input must not be copied out and back, so the bytes moved equal
    the meta estimate (the eager copy at layer entry moved twice the saved bytes in layer 1)."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return x + self.c2(torch.relu(self.c1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        offload_transform(model, 2, example_inputs=(x,), config=cfg(min_offload_numel=1, prefetch_layers=1))
        est = [lp.bytes_per_step for lp in model.offload_plan.layers]
        out = model(x)
    out.float().sum().backward()
    stats = model.offload_plan.stats
    assert [lp.bytes_per_step for lp in model.offload_plan.layers] == est and est[0] > 0
    assert stats.bytes_offloaded == sum(est)


def test_bad_example_inputs_and_a_stray_memory_budget_are_refused_before_the_model_changes():
    model = Stack(L)
    before = (dict(model.__dict__), [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()])
    with pytest.raises(TypeError, match=r"example_inputs must be a tensor.*got str.*example_inputs=\(x,\)"):
        offload_transform(model, num_layers=1, example_inputs="hello")
    with pytest.raises(ValueError, match=r"memory_budget=1048576 plans the layers itself, but num_layers=1"):
        offload_transform(model, num_layers=1, memory_budget=1 << 20)
    with pytest.raises(TypeError, match=r"dict with the non-str key 0.*pass positional inputs as a tuple"):
        offload_transform(model, num_layers=1, example_inputs={0: X()})
    with pytest.raises(ValueError, match=r"example_inputs=\(\) is empty"):
        offload_transform(model, num_layers=1, example_inputs=())
    assert (dict(model.__dict__), [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]) == before
    assert "offload_plan" not in model.__dict__


def test_example_inputs_that_cannot_run_the_forward_warn():
    """example_inputs of the wrong shape are not only a plan note."""
    model = Stack(L)
    with pytest.warns(UserWarning, match=r"example_inputs= could not run the forward on meta tensors: no estimate on meta tensors.*check them"):
        offload_transform(model, num_layers=1, example_inputs=(torch.randn(3, 7),))
    assert any("no estimate on meta tensors" in n for n in model.offload_plan.notes)


def test_config_fields_as_keywords_override_the_config():
    """``offload_transform(m, 1, min_offload_numel=0)`` is ``config=ModelConfig(cpu_offloading=True,
    min_offload_numel=0)``: a keyword wins over the config's value, and the plan offloads under it."""
    torch.manual_seed(0)
    x = X()
    for kwargs in ({"min_offload_numel": 0},
                   {"config": ModelConfig(cpu_offloading=True, min_offload_numel=1 << 30), "min_offload_numel": 0}):
        model = Stack(L)
        offload_transform(model, 1, **kwargs)
        model(x).sum().backward()
        assert model.offload_plan.stats.bytes_offloaded > 0, kwargs
