"""LoRALinear / apply_lora: validation, math, and offload marks under both selection policies."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from annotate_offload.annotate import offload_transform
from annotate_offload.config import ModelConfig
from annotate_offload.models.llama import Llama
from annotate_offload.peft import LoRALinear, apply_lora, apply_offload_marks
from annotate_offload.peft._apply import has_offload_marks

import _peft_helpers as h
from _peft_helpers import L, R, OneScope, PackSpy, adapter_weights, assert_same, ids, lora_llama, step, weight_shapes


def _sync_of(model):
    return model.offload_plan.runtime


def _config(policy, **kw):
    return ModelConfig(cpu_offloading=True, offload_policy=policy, min_offload_numel=0, **kw)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(r=0), ValueError, r"r must be >= 1.*r=0"),
        (dict(r=True), TypeError, r"r must be an int"),
        (dict(r=2.0), TypeError, r"r must be an int"),
        (dict(alpha=0), ValueError, r"alpha must be a finite number > 0.*alpha=0"),
        (dict(alpha=float("inf")), ValueError, r"alpha must be a finite number > 0"),
        (dict(alpha="16"), TypeError, r"alpha must be a number"),
        (dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\).*dropout=1.0"),
        (dict(dropout=-0.1), ValueError, r"dropout must be in \[0, 1\)"),
        (dict(dropout=None), TypeError, r"dropout must be a float"),
    ],
)
def test_lora_linear_rejects_bad_hyperparameters(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LoRALinear(nn.Linear(8, 8), **kwargs)


def test_lora_linear_rejects_non_linear():
    with pytest.raises(TypeError, match=r"base must be an nn.Linear, got Conv1d"):
        LoRALinear(nn.Conv1d(4, 4, 1))


def test_apply_lora_validates_before_mutating():
    model = Llama(h.llama_config(), seed=0)
    before = {n: (type(m), [p.requires_grad for p in m.parameters(recurse=False)]) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"matched no nn.Linear.*q_proj"):
        apply_lora(model, ["nope"])
    with pytest.raises(ValueError, match=r"r must be >= 1"):
        apply_lora(model, ["q_proj"], r=0)
    with pytest.raises(ValueError, match=r"layers.0.self_attn is a LlamaAttention, not an nn.Linear"):
        apply_lora(model, ["self_attn"])
    with pytest.raises(TypeError, match=r"target_modules must be"):
        apply_lora(model, [1, 2])
    with pytest.raises(TypeError, match=r"model must be an nn.Module"):
        apply_lora("model", ["q_proj"])
    after = {n: (type(m), [p.requires_grad for p in m.parameters(recurse=False)]) for n, m in model.named_modules()}
    assert after == before


def test_apply_lora_twice_is_refused():
    model = lora_llama()
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj is already a LoRALinear"):
        apply_lora(model, ["q_proj"])


def test_apply_lora_structure_and_trainable_set():
    model = Llama(h.llama_config(), seed=0)
    keys = set(model.state_dict())
    apply_lora(model, ["q_proj", "v_proj"], r=R, alpha=6, dropout=0.1)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"layers.{i}.self_attn.{t}.lora_{ab}.weight" for i in range(L)
                               for t in ("q_proj", "v_proj") for ab in "AB")
    new = set(model.state_dict())
    moved = {k for k in keys if ".q_proj." in k or ".v_proj." in k}
    assert keys - moved <= new
    assert {k.replace(".weight", ".base.weight") for k in moved} <= new
    q = model.layers[0].self_attn.q_proj
    assert q.scaling == 2.0 and q.lora_A.weight.shape == (R, h.HIDDEN) and isinstance(q.lora_dropout, nn.Dropout)
    assert "r=3, alpha=6, scaling=2, dropout=0.1" in repr(q)


def test_all_linear_skips_the_head_and_callable_targets():
    model = Llama(h.llama_config(), seed=0)
    apply_lora(model, "all-linear", r=2)
    assert type(model.lm_head) is nn.Linear
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 7 * L
    other = Llama(h.llama_config(), seed=0)
    apply_lora(other, lambda m, fqn: fqn.endswith("down_proj") and ".0." in fqn, r=2)
    assert [n for n, m in other.named_modules() if isinstance(m, LoRALinear)] == ["layers.0.mlp.down_proj"]


def test_lora_linear_math():
    base = nn.Linear(16, 8)
    layer = LoRALinear(base, r=4, alpha=8)
    x = torch.randn(2, 5, 16)
    assert torch.equal(layer(x), base(x))  # B starts at zero
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    expected = base(x) + (x @ layer.lora_A.weight.t() @ layer.lora_B.weight.t()) * 2.0
    torch.testing.assert_close(layer(x), expected)
    assert not base.weight.requires_grad and not base.bias.requires_grad
    assert layer.lora_A.weight.requires_grad and layer.lora_B.weight.requires_grad
    assert math.isclose(layer.scaling, 2.0) and layer.in_features == 16 and layer.out_features == 8


# --------------------------------------------------------------------------- offload


def _transformed(policy, **kw):
    model = lora_llama(**kw)
    ref = copy.deepcopy(model)
    apply_offload_marks(model)
    offload_transform(model, L - 1, config=_config(policy, prefetch_layers=1))
    return model, ref, PackSpy(_sync_of(model))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("policy", ["opt_out", "opt_in"])
def test_grads_bit_identical_with_offload_and_no_parameter_marked(policy, dropout):
    model, ref, spy = _transformed(policy, dropout=dropout)
    for s in range(2):
        assert_same(step(model, ids(), seed=s), step(ref, ids(), seed=s))
    assert spy.packed, "nothing was offloaded: the test would prove nothing"
    assert h.marked_parameters(model) == []


def test_opt_out_keeps_rank_r_and_adapter_weights():
    model, ref, spy = _transformed("opt_out", dropout=0.2)
    step(model, ids())
    sync = _sync_of(model)
    assert spy.packed_rank_r() == []
    assert spy.packed_with_shape(weight_shapes(adapter_weights(model))) == []
    assert spy.packed_sharing_storage(adapter_weights(model)) == []
    # q_proj and v_proj in each of the L-1 offloaded layers: the rank-r view lora_B saves
    assert sync.stats.kept["marked"] == 2 * (L - 1)
    assert any(t.shape[-1] == h.HIDDEN for t in spy.packed)  # the big adapter input does move


def test_opt_out_without_marks_would_offload_rank_r(monkeypatch):
    """The check above can fail: with the adapter's marks switched off, rank-r tensors move."""
    import annotate_offload.peft._lora as lora_mod

    monkeypatch.setattr(lora_mod, "active_policy", lambda: None)
    model, ref, spy = _transformed("opt_out")
    step(model, ids())
    assert len(spy.packed_rank_r()) == 2 * (L - 1)


def test_opt_in_moves_exactly_the_adapter_input_and_hidden():
    model, ref, spy = _transformed("opt_in")
    step(model, ids())
    # per offloaded layer and adapter: lora_A's saved input (B*T, H) and lora_B's rank-r hidden
    shapes = sorted(tuple(t.shape) for t in spy.packed)
    bt = ids().numel()
    assert shapes == sorted([(bt, h.HIDDEN)] * 2 * (L - 1) + [(bt, R)] * 2 * (L - 1))
    assert all(getattr(t, "activation_offloading", False) for t in spy.packed)
    assert spy.packed_sharing_storage(adapter_weights(model)) == []


def test_opt_in_without_tags_moves_nothing(monkeypatch):
    import annotate_offload.peft._lora as lora_mod

    monkeypatch.setattr(lora_mod, "active_policy", lambda: None)
    model, ref, spy = _transformed("opt_in")
    step(model, ids())
    assert spy.packed == [] and _sync_of(model).stats.kept["not_selected"] > 0


def test_no_marks_and_no_state_without_offload():
    model = lora_llama()
    x = torch.randn(2, 4, h.HIDDEN, requires_grad=True)
    q = model.layers[0].self_attn.q_proj
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q(x).sum().backward()
    assert saved and not any(hasattr(t, "_TE_do_not_offload") or hasattr(t, "activation_offloading") for t in saved)


# --------------------------------------------------------------------------- head, frozen casts, autocast


def _head_counter(model, spy):
    """Packed-tensor count before and after the head runs (registered after the marks' hooks)."""
    counts = []
    model.lm_head.register_forward_pre_hook(lambda m, a: counts.append(len(spy.packed)))
    model.lm_head.register_forward_hook(lambda m, a, o: counts.append(len(spy.packed)))
    return counts


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("policy", ["opt_out", "opt_in"])
def test_head_input_and_frozen_casts_never_offloaded(policy, autocast):
    """Everything runs inside one offloaded scope, the head included (LoRA on the head, so it saves its input)."""
    model = lora_llama(targets=("q_proj", "v_proj", "lm_head"))
    ref = copy.deepcopy(model)
    marks = apply_offload_marks(model)
    assert marks.lm_head is model.lm_head and marks.lora_linear_layers == 2 * L + 1
    one = OneScope(policy)
    spy = PackSpy(one.sync)
    counts = _head_counter(model, spy)
    assert_same(step(model, ids(), autocast=autocast, forward=one(model)), step(ref, ids(), autocast=autocast))
    assert spy.packed and counts[1] == counts[0], "the head's saved tensors were offloaded"
    frozen = weight_shapes(p for p in model.parameters() if not p.requires_grad)
    assert [t for t in spy.packed_with_shape(frozen) if t.grad_fn is None] == []
    assert spy.packed_sharing_storage(adapter_weights(model)) == []
    if policy == "opt_out":
        assert spy.packed_rank_r() == []


def test_without_marks_head_and_frozen_casts_would_move():
    """Negative control of the test above: no apply_offload_marks, so the head's input and the
    autocast casts of the frozen weights the adapters do not own are offloaded."""
    model = lora_llama(targets=("q_proj", "v_proj", "lm_head"))
    one = OneScope("opt_out")
    spy = PackSpy(one.sync)
    counts = _head_counter(model, spy)
    step(model, ids(), autocast=True, forward=one(model))
    assert counts[1] > counts[0]
    frozen = weight_shapes(p for p in model.parameters() if not p.requires_grad)
    assert [t for t in spy.packed_with_shape(frozen) if t.grad_fn is None]


def test_tied_trainable_head_input_kept():
    model = lora_llama(tie_word_embeddings=True)
    model.lm_head.weight.requires_grad_(True)  # tied: the embedding trains too, and the head saves its input
    assert model.lm_head.weight is model.embed_tokens.weight
    ref = copy.deepcopy(model)
    apply_offload_marks(model)
    one = OneScope("opt_out")
    spy = PackSpy(one.sync)
    counts = _head_counter(model, spy)
    assert_same(step(model, ids(), forward=one(model)), step(ref, ids()))
    assert counts[1] == counts[0] and one.sync.stats.kept["marked"] >= 1


# --------------------------------------------------------------------------- apply_offload_marks API


def test_apply_offload_marks_handle():
    model = lora_llama()
    assert not has_offload_marks(model)
    marks = apply_offload_marks(model)
    assert apply_offload_marks(model) is marks and marks.active and has_offload_marks(model)
    assert "lm_head=Linear" in repr(marks) and "lora_linear_layers=8" in repr(marks)
    with pytest.raises(ValueError, match=r"lm_head=Linear is not a submodule"):
        apply_offload_marks(model, lm_head=nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"lm_head must be 'auto', None or an nn.Module, got 'head'"):
        apply_offload_marks(model, lm_head="head")
    from annotate_offload.errors import OffloadError

    with pytest.raises(OffloadError, match=r"already applied.*remove_offload_marks"):
        apply_offload_marks(model, lm_head=None)
    n_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    assert n_hooks > 0
    marks.remove()
    assert not marks.active and not has_offload_marks(model)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0


def test_apply_offload_marks_warns_without_head():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"found no language-model head.*lm_head=None"):
        marks = apply_offload_marks(model)
    assert marks.lm_head is None
    marks.remove()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_offload_marks(model, warn=False).remove()
    with pytest.raises(TypeError, match=r"model must be an nn.Module"):
        apply_offload_marks(object())


def test_lean_import(run_group):
    import sys

    code = ("import sys, torch, annotate_offload.peft, annotate_offload.annotate; "
            "assert not torch.cuda.is_initialized(); "
            "assert 'peft' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    run_group([sys.executable, "-c", code], check=True)


def test_deepcopy_of_a_transformed_lora_model_carries_its_own_marks():
    # the copy's marks follow the copy: with the original gone, the copy's frozen-weight casts
    # are still recognised (a weak reference to the original would offload them)
    import gc
    import warnings

    from annotate_offload.annotate import remove_offload
    from annotate_offload.models.llama import LlamaConfig

    def make():
        m = Llama(LlamaConfig.from_preset("llama-tiny"), seed=0, device="cpu")
        apply_lora(m, ["q_proj", "k_proj", "v_proj", "o_proj"], r=8, alpha=16, dropout=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return offload_transform(m, 2, config=_config("opt_out"))

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def moved(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(m(ids).float().flatten(0, 1), ids.flatten()).backward()
        return m.offload_plan.runtime.stats.bytes_offloaded

    expected = moved(make())
    model = make()
    dup = copy.deepcopy(model)
    marks = dup.__dict__["_annotate_offload_peft_marks"]
    assert marks.active and marks is not model.__dict__["_annotate_offload_peft_marks"]
    del model
    gc.collect()
    assert moved(dup) == expected
    remove_offload(dup)
    assert not has_offload_marks(dup)


# --------------------------------------------------------------------------- checkpoints around adapters


@pytest.mark.parametrize("num_layers", [0, 2])
@pytest.mark.parametrize("policy", ["opt_out", "opt_in"])
def test_lora_under_recompute_is_exact(policy, num_layers):
    """LoRA under config.recompute: the adapters' marking scopes stand aside inside the checkpoint,
    whose saved-tensor hooks they would replace ("CheckpointError: ... different metadata" in
    backward; Note [A checkpoint around the layer])."""
    model = lora_llama()
    ref = copy.deepcopy(model)
    offload_transform(model, num_layers, config=_config(policy, recompute=True))
    x = ids()
    for seed in range(2):
        assert_same(step(model, x, seed=seed), step(ref, x, seed=seed))


def test_in_place_change_of_a_tensor_kept_by_adapter_marks_raises_like_autograd():
    """A tensor the adapter's marked scope keeps on the device goes through the runtime's own pack
    hook, so an in-place change after it was saved raises autograd's error in backward."""
    from annotate_offload import get_cpu_offload_context
    from annotate_offload.peft._policy import keep_saves

    x = torch.randn(8, 512, requires_grad=True)
    ctx, sync_fn = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, min_offload_numel=0)
    with ctx:
        h = x * 2
        with keep_saves():
            y = h.sin()
        h.mul_(3)
    y = sync_fn(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
