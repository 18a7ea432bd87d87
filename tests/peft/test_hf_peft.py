"""Hugging Face peft interop: LoRA on LlamaForCausalLM (small config, no download) with offload marks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from annotate_offload.annotate import offload_transform  # noqa: E402
from annotate_offload.config import ModelConfig  # noqa: E402
from annotate_offload.peft import apply_offload_marks, remove_offload_marks  # noqa: E402
from annotate_offload.peft._apply import find_lm_head, unwrap_model  # noqa: E402

from _peft_helpers import (HIDDEN, L, R, VOCAB, OneScope, PackSpy, adapter_weights, assert_same, ids,  # noqa: E402
                           marked_parameters, step, weight_shapes)


def _llama(*, tie=False):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=L,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _lora(model, *, targets=("q_proj", "v_proj"), dropout=0.0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns about LoRA on a tied head
        # init_lora_weights=False: B is random, so every adapter gradient is non-zero
        cfg = peft.LoraConfig(r=R, lora_alpha=2 * R, target_modules=list(targets), lora_dropout=dropout,
                              init_lora_weights=False)
        return peft.get_peft_model(model, cfg).train()


def _hf(*, tie=False, targets=("q_proj", "v_proj"), dropout=0.0):
    return _lora(_llama(tie=tie), targets=targets, dropout=dropout)


def _sync_of(model):
    return model.offload_plan.runtime


def _config(policy, **kw):
    return ModelConfig(cpu_offloading=True, offload_policy=policy, min_offload_numel=0, **kw)


def _transform(model, policy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(model, L - 1, config=_config(policy, prefetch_layers=1))
    assert [lp.fqn for lp in model.offload_plan.layers] == [f"base_model.model.model.layers.{i}" for i in range(L)]
    return PackSpy(_sync_of(model))


def test_head_found_through_wrappers_and_tied_embeddings():
    pm = _hf(tie=True)
    llama = pm.base_model.model
    assert type(unwrap_model(pm)) is transformers.LlamaForCausalLM
    assert find_lm_head(pm) is llama.lm_head and llama.lm_head.weight is llama.model.embed_tokens.weight
    assert find_lm_head(pm.base_model) is llama.lm_head and find_lm_head(llama) is llama.lm_head
    marks = apply_offload_marks(pm)
    assert marks.lm_head is llama.lm_head and marks.peft_lora_layers == 2 * L
    # marks live on the unwrapped model: applying through another wrapper level is the same call
    assert apply_offload_marks(pm.base_model) is marks
    assert remove_offload_marks(pm) and not remove_offload_marks(pm)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", ["opt_out", "opt_in"])
def test_peft_grads_bit_identical_and_marks_on_no_parameter(policy, dropout):
    model = _hf(dropout=dropout)
    ref = copy.deepcopy(model)
    apply_offload_marks(model)
    spy = _transform(model, policy)
    for s in range(2):
        spy.clear()
        assert_same(step(model, ids(), seed=s), step(ref, ids(), seed=s))
    assert spy.packed
    assert spy.packed_sharing_storage(adapter_weights(model)) == []
    assert spy.packed_with_shape(weight_shapes(adapter_weights(model))) == []
    assert marked_parameters(model) == []
    bt = ids().numel()
    if policy == "opt_out":
        assert spy.packed_rank_r() == []
        assert _sync_of(model).stats.kept["marked"] >= 2 * (L - 1)
    else:
        shapes = sorted(tuple(t.shape) for t in spy.packed)
        assert shapes == sorted([(bt, HIDDEN)] * 2 * (L - 1) + [(bt, R)] * 2 * (L - 1))


def test_peft_without_marks_offloads_rank_r():
    """Negative control: without the marks (offload_transform installs them; removed here),
    peft's rank-r hidden is offloaded in opt-out mode."""
    model = _hf()
    spy = _transform(model, "opt_out")
    assert remove_offload_marks(model)
    step(model, ids())
    assert len(spy.packed_rank_r()) == 2 * (L - 1)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("policy", ["opt_out", "opt_in"])
def test_peft_head_tied_and_lora_adapted_never_offloaded(policy, autocast):
    """The whole PeftModel runs inside one offloaded scope; the tied head carries a LoRA adapter,
    so it saves its input: none of it is offloaded, nor any frozen-weight cast."""
    model = _hf(tie=True, targets=("q_proj", "v_proj", "lm_head"))
    ref = copy.deepcopy(model)
    marks = apply_offload_marks(model)
    head = marks.lm_head
    assert head is model.base_model.model.lm_head and hasattr(head, "lora_A")
    one = OneScope(policy)
    spy = PackSpy(one.sync)
    counts = []
    head.register_forward_pre_hook(lambda m, a: counts.append(len(spy.packed)))
    head.register_forward_hook(lambda m, a, o: counts.append(len(spy.packed)))
    assert_same(step(model, ids(), autocast=autocast, forward=one(model)), step(ref, ids(), autocast=autocast))
    assert spy.packed and counts[1] == counts[0]
    frozen = weight_shapes(p for p in model.parameters() if not p.requires_grad)
    assert [t for t in spy.packed_with_shape(frozen) if t.grad_fn is None] == []
    assert spy.packed_sharing_storage(adapter_weights(model)) == []
    if policy == "opt_out":
        assert spy.packed_rank_r() == []


def test_peft_without_marks_head_would_move():
    model = _hf(tie=True, targets=("q_proj", "v_proj", "lm_head"))
    one = OneScope("opt_out")
    spy = PackSpy(one.sync)
    counts = []
    head = model.base_model.model.lm_head
    head.register_forward_pre_hook(lambda m, a: counts.append(len(spy.packed)))
    head.register_forward_hook(lambda m, a, o: counts.append(len(spy.packed)))
    step(model, ids(), autocast=True, forward=one(model))
    assert counts[1] > counts[0]
    frozen = weight_shapes(p for p in model.parameters() if not p.requires_grad)
    assert [t for t in spy.packed_with_shape(frozen) if t.grad_fn is None]


def test_offload_transform_applies_the_marks():
    model = _hf()
    spy = _transform(model, "opt_out")
    step(model, ids())
    assert spy.packed_rank_r() == []


def test_auto_plan_of_a_peft_model_profiles_without_the_kv_cache():
    # PeftModel.forward(*args, **kwargs) hides use_cache from the signature: profiling must still
    # turn the cache off (with it on: "backward through the graph a second time")
    model = _hf()
    ref = copy.deepcopy(model)
    x = ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(model, num_layers="auto", memory_budget=1 << 20, example_inputs={"input_ids": x})
    assert len(model.offload_plan.layers) == L
    assert_same(step(model, x), step(ref, x))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("policy", ["opt_out", "opt_in"])
def test_peft_with_gradient_checkpointing_is_exact(policy, when):
    """A peft model with gradient_checkpointing_enable(): the adapters' marking scopes stand aside
    inside the checkpoint, whose saved-tensor hooks they would replace ("CheckpointError: ...
    different metadata" in backward; Note [A checkpoint around the layer])."""
    model, ref = _hf(), _hf()
    ref.gradient_checkpointing_enable()
    if when == "before":
        model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(model, L - 1, config=_config(policy))
    if when == "after":
        model.gradient_checkpointing_enable()
    x = ids()
    for seed in range(2):
        assert_same(step(model, x, seed=seed), step(ref, x, seed=seed))
    if policy == "opt_out":  # the checkpoints' inputs moved (opt-in moves only tagged tensors: the
        assert _sync_of(model).stats.bytes_offloaded_per_layer  # adapters' stay inside the checkpoint)


@pytest.mark.parametrize("policy", ["opt_out", "opt_in"])
def test_get_peft_model_after_the_transform_marks_the_adapters_as_before(policy):
    """The marks follow the model (Note [Following the model]): wrapping with peft after
    offload_transform (TRL's SFTTrainer(peft_config=...)) keeps and moves exactly what the other
    order does."""
    before = _hf()
    ref = copy.deepcopy(before)
    spy_before = _transform(before, policy)
    after = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(after, L - 1, config=_config(policy, prefetch_layers=1))
    after = _lora(after)
    spy_after = PackSpy(_sync_of(after.base_model.model))
    for s in range(2):
        spy_before.clear(), spy_after.clear()
        a, b = step(after, ids(), seed=s), step(before, ids(), seed=s)
        assert_same(a, b)
        assert_same(a, step(ref, ids(), seed=s))
        assert [t.shape for t in spy_after.packed] == [t.shape for t in spy_before.packed] and spy_after.packed
    assert _sync_of(after.base_model.model).stats.kept == _sync_of(before).stats.kept
    if policy == "opt_out":
        assert spy_after.packed_rank_r() == [] and _sync_of(before).stats.kept["marked"] >= 2 * (L - 1)


def test_lora_with_checkpointing_and_input_require_grads_offloads_the_first_layer():
    """TRL's SFT default: LoRA, gradient checkpointing and enable_input_require_grads(). The first
    layer's checkpointed input is a leaf that requires grad, not a parameter: it is offloaded like
    every other layer's (only real parameters and their aliases and casts stay)."""
    model, ref = _hf(), _hf()
    for m in (model, ref):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(model, L - 1, config=_config("opt_out"))
    x = ids()
    for seed in range(2):
        assert_same(step(model, x, seed=seed), step(ref, x, seed=seed))
    per_layer = _sync_of(model).stats.bytes_offloaded_per_layer
    bt_hidden = x.numel() * HIDDEN * 4  # the checkpoint's saved (B, T, H) fp32 input
    assert per_layer == {i: bt_hidden for i in range(L - 1)}


def _wrapped_layers(model):
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("where", ["base_before_peft", "merged_after_peft"])
def test_remove_offload_finds_the_transform_across_the_peft_wrapper(where):
    from annotate_offload.annotate import remove_offload

    if where == "base_before_peft":  # the transform sits on a module inside the model passed
        base = _llama()
        offload_transform(base, L - 1, config=_config("opt_out"))
        model = target = _lora(base)
    else:  # the transform sits on a model around the one passed, whose layers it holds
        model = _hf()
        offload_transform(model, L - 1, config=_config("opt_out"))
        target = model.merge_and_unload().requires_grad_(True)  # the merged weights train in full
    assert _wrapped_layers(target)
    assert remove_offload(target) is target
    assert _wrapped_layers(target) == [] and not hasattr(model, "offload_plan")
    assert all("offload_plan" not in m.__dict__ for m in model.modules())
    ref = copy.deepcopy(target)
    assert_same(step(target, ids()), step(ref, ids()))
    offload_transform(target, L - 1, config=_config("opt_out"))  # it can be transformed again
