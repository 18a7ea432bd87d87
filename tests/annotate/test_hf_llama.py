"""Hugging Face LlamaForCausalLM (built from a small config, no download): exact, generate, checkpointing, peft."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from annotate_offload.annotate import offload_transform, remove_offload  # noqa: E402
from annotate_offload.errors import OffloadError  # noqa: E402

from ._models import cfg, sync_of  # noqa: E402

L = 4


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _ids():
    return torch.randint(0, 128, (2, 16))


@pytest.mark.parametrize("n", [0, 1, L - 1])
def test_hf_llama_bit_identical(n):
    model = _llama()
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert offload_transform(model, n, config=cfg()) is model
    plan = model.offload_plan
    assert [lp.fqn for lp in plan.layers] == [f"model.layers.{i}" for i in range(L)]
    assert type(model) is transformers.LlamaForCausalLM and list(model.state_dict()) == keys
    ids = _ids()
    for _ in range(2):
        _same(_step(model, ids), _step(ref, ids))
        assert set(sync_of(model).stats.bytes_offloaded_per_layer) == set(range(n))


def test_generate_and_eval_after_transform():
    model = _llama()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, config=cfg(), example_inputs={"input_ids": _ids()})
    assert model.offload_plan.bytes_source == "estimate" and model.offload_plan.bytes_per_step > 0
    ids = _ids()
    model.eval(), ref.eval()
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    gen = dict(max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids[:, :4]), pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :4], **gen), ref.generate(ids[:, :4], **gen))
    sync = sync_of(model)
    assert sync.stats.bytes_offloaded == 0 and sync._step is None
    remove_offload(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_hf_activation_checkpointing_offloads_the_checkpoint_inputs():
    model, ref = _llama(), _llama()
    for m in (model, ref):
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable()
    offload_transform(model, 2, config=cfg())
    ids = _ids()
    _same(_step(model, ids), _step(ref, ids))
    # Only the checkpoint's saved input (the hidden states, 2 x 16 x 64 fp32) leaves per layer.
    assert sync_of(model).stats.bytes_offloaded_per_layer == {0: 2 * 16 * 64 * 4, 1: 2 * 16 * 64 * 4}


def test_peft_lora_model_is_exact():
    peft = pytest.importorskip("peft")
    if not hasattr(peft, "get_peft_model"):
        pytest.skip(f"`import peft` found {peft.__file__}, not Hugging Face peft (a tests/peft package shadows it)")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ref = copy.deepcopy(model)
    offload_transform(model, 2, config=cfg())
    assert model.offload_plan.layers[0].fqn == "base_model.model.model.layers.0"
    ids = _ids()
    a, b = _step(model, ids), _step(ref, ids)
    assert a[1] and all("lora_" in k for k in a[1])  # only the adapters train
    _same(a, b)
    assert set(model.offload_plan.stats.bytes_offloaded_per_layer) == {0, 1}


def test_auto_plan_on_a_cache_using_model_profiles_without_the_cache():
    # Hugging Face's use_cache=True hands all layers one key/value cache: profiling a layer twice
    # would append to it, and the second backward would reach a freed graph
    model = _llama()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(model, num_layers="auto", memory_budget=1 << 30, example_inputs={"input_ids": _ids()})
    assert len(model.offload_plan.layers) == L
    ids = _ids()
    _same(_step(model, ids), _step(ref, ids))


def test_auto_plan_through_a_wrapper_that_leaves_use_cache_unset_profiles_without_the_cache():
    # the wrapper's forward (a LightningModule's, typically) passes no use_cache: the model reads
    # config.use_cache, so profiling turns the config off, at any depth, and puts it back
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama()

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, labels=input_ids).loss

    model = Wrapper()
    ref = copy.deepcopy(model)
    assert model.model.config.use_cache is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(model, num_layers="auto", memory_budget=1 << 30, example_inputs=(_ids(),))
    assert model.model.config.use_cache is True
    ids = _ids()
    for m in (model, ref):
        m(ids).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def test_recomputed_layers_of_a_cache_using_model_train_exactly_and_keep_its_config():
    # the rerun in backward would append to the key/value cache a second time: a shape error under a mask
    model = _llama()
    model.config._attn_implementation = "eager"
    ref = copy.deepcopy(model)
    assert model.config.use_cache is True
    offload_transform(model, 2, config=cfg(recompute=True))
    ids = _ids()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    for m in (model, ref):
        m(**batch).loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    assert model.config.use_cache is True
    with torch.no_grad():
        assert model(**batch).past_key_values is not None  # outside training the cache is the model's
    remove_offload(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not model._forward_pre_hooks_with_kwargs


def test_recomputed_layers_are_estimated_on_meta_tensors_with_the_models_own_cache_setting():
    # without the cache, Llama's mask code calls .item(), which meta tensors refuse: no estimate, a warning
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload_transform(model, 2, config=cfg(recompute=True), example_inputs={"input_ids": _ids()})
    assert [lp.estimated_bytes for lp in model.offload_plan.layers][:2] == [2 * 16 * 64 * 4] * 2
    assert model.config.use_cache is True


def test_recomputed_layers_train_exactly_under_an_explicit_use_cache_and_a_padding_mask():
    model = _llama()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, config=cfg(recompute=True))
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    for m in (model, ref):
        m(input_ids=ids, labels=ids, attention_mask=mask, use_cache=True).loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("name", ["past_key_values", "cache"])  # cache: transformers' newer keyword
def test_a_cache_passed_to_recomputed_layers_in_training_is_refused_before_anything_runs(name):
    model = _llama()
    offload_transform(model, 2, config=cfg(recompute=True))
    ids = _ids()
    with torch.no_grad():
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
    with pytest.raises(OffloadError, match="past_key_values.*recompute=False"):
        model(input_ids=ids[:, 4:], labels=ids[:, 4:], **{name: cache})
    assert model.config.use_cache is True and all(p.grad is None for p in model.parameters())


def test_recomputed_layers_keep_the_cache_in_eval_mode_with_grad_enabled():
    model = _llama().eval()
    ref = copy.deepcopy(model)
    offload_transform(model, 2, config=cfg(recompute=True))
    ids = _ids()
    outs = [m(input_ids=ids[:, :4], use_cache=True) for m in (model, ref)]  # as Hugging Face's checkpointing
    assert type(outs[0].past_key_values) is type(outs[1].past_key_values) and outs[0].past_key_values is not None
    nxt = [m(input_ids=ids[:, 4:], past_key_values=o.past_key_values).logits for m, o in zip((model, ref), outs)]
    assert torch.equal(*nxt)

