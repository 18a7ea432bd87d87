"""The built-in Llama: shapes, seeded init, GQA against a from-scratch reference, rotary, fx tracing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from annotate_offload.models import Llama, LlamaConfig
from annotate_offload.models.llama import LLAMA_PRESETS
from annotate_offload.models.llama import LlamaDecoderLayer, RMSNorm, apply_rotary, rotary_tables

SMALL = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_seq_len=64)


def test_shapes_and_parameter_count():
    model = Llama(SMALL, seed=0)
    ids = torch.randint(0, 256, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == SMALL.num_parameters()
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 3
    assert all(type(layer) is LlamaDecoderLayer for layer in model.layers)
    assert model.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)  # 2 KV heads of dim 8


def test_presets():
    tiny = LlamaConfig.from_preset("llama-tiny")
    assert tiny.vocab_size == 256 and tiny.num_key_value_heads < tiny.num_attention_heads
    assert tiny.num_parameters() < 2_000_000
    big = LlamaConfig.from_preset("llama-1b")
    assert 0.9e9 < big.num_parameters() < 1.1e9 and big.tie_word_embeddings
    assert LlamaConfig.from_preset("llama-tiny", num_layers=2).num_layers == 2
    with pytest.raises(ValueError, match=r"unknown preset 'llama-7b'; valid: llama-1b, llama-tiny"):
        LlamaConfig.from_preset("llama-7b")
    assert set(LLAMA_PRESETS) == {"llama-tiny", "llama-1b"}


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"hidden_size": 30}, r"hidden_size=30 is not divisible by num_attention_heads=4"),
        ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not divisible by num_key_value_heads=3"),
        ({"hidden_size": 36, "num_attention_heads": 12, "num_key_value_heads": 12}, r"head dim .*=3 must be even"),
        ({"num_layers": 0}, r"num_layers must be a positive int, got 0"),
        ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be > 0"),
    ],
)
def test_config_errors(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        LlamaConfig.from_preset("llama-tiny", **{"max_seq_len": 64, **changes})


def test_seeded_init_is_deterministic():
    a, b, c = Llama(SMALL, seed=7), Llama(SMALL, seed=7), Llama(SMALL, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.self_attn.q_proj.weight"], sc["layers.0.self_attn.q_proj.weight"])
    # norms start at one; output projections use the smaller 1/sqrt(2L) std
    assert torch.equal(sa["layers.1.input_layernorm.weight"], torch.ones(32))
    big = Llama(LlamaConfig.from_preset("llama-tiny", max_seq_len=16), seed=0)
    q_std = big.layers[0].self_attn.q_proj.weight.std().item()
    o_std = big.layers[0].self_attn.o_proj.weight.std().item()
    assert q_std == pytest.approx(0.02, rel=0.05) and o_std == pytest.approx(0.02 / math.sqrt(8), rel=0.05)


def test_reset_parameters_reproduces_init():
    model = Llama(SMALL, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.reset_parameters(3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tied_head_shares_the_embedding():
    cfg = LlamaConfig.from_preset("llama-tiny", max_seq_len=16, tie_word_embeddings=True)
    model = Llama(cfg, seed=0, dtype=torch.float64)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    assert model.rope_cos.dtype == torch.float32  # tables stay fp32 whatever the parameter dtype


def test_rmsnorm_matches_definition():
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    expected = norm.weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm.double()(x), expected)


def test_rotary_is_a_rotation_with_relative_positions():
    cos, sin = rotary_tables(8, 32, 10000.0)
    assert cos.shape == (32, 8) and torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    c64, s64 = cos.double(), sin.double()

    def at(x, pos):
        return apply_rotary(x, c64[pos:pos + 1], s64[pos:pos + 1])

    # a rotation keeps the norm
    torch.testing.assert_close(at(q, 5).norm(), q.norm())
    # the score depends only on the distance m - n
    s1 = (at(q, 9) * at(k, 4)).sum()
    s2 = (at(q, 20) * at(k, 15)).sum()
    s3 = (at(q, 20) * at(k, 14)).sum()
    torch.testing.assert_close(s1, s2)
    assert not torch.allclose(s1, s3)


def _reference_forward(model: Llama, ids: torch.Tensor) -> torch.Tensor:
    """From-scratch float64 Llama forward: explicit per-head loops, softmax with a causal mask."""
    cfg = model.config
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    T = ids.shape[1]
    cos, sin = rotary_tables(hd, T, cfg.rope_theta)
    cos, sin = cos.double(), sin.double()

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rot(x):  # x: (T, hd)
        half = hd // 2
        return x * cos + torch.cat((-x[:, half:], x[:, :half]), -1) * sin

    x = model.embed_tokens.weight.double()[ids]
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for layer in model.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight.double())
        q = h @ a.q_proj.weight.double().T
        k = h @ a.k_proj.weight.double().T
        v = h @ a.v_proj.weight.double().T
        out = torch.zeros_like(q)
        for b in range(ids.shape[0]):
            for head in range(nh):
                kv = head // (nh // nkv)  # query head -> its shared key/value head
                qh = rot(q[b, :, head * hd:(head + 1) * hd])
                kh = rot(k[b, :, kv * hd:(kv + 1) * hd])
                vh = v[b, :, kv * hd:(kv + 1) * hd]
                p = torch.softmax(qh @ kh.T / math.sqrt(hd) + mask, dim=-1)
                out[b, :, head * hd:(head + 1) * hd] = p @ vh
        x = x + out @ a.o_proj.weight.double().T
        m = layer.mlp
        h = rms(x, layer.post_attention_layernorm.weight.double())
        g = h @ m.gate_proj.weight.double().T
        x = x + (F.silu(g) * (h @ m.up_proj.weight.double().T)) @ m.down_proj.weight.double().T
    return rms(x, model.norm.weight.double()) @ model.lm_head.weight.double().T


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_forward_matches_reference(kv_heads):
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_seq_len=32, init_std=0.2)
    model = Llama(cfg, seed=1, dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids), _reference_forward(model, ids), rtol=1e-9, atol=1e-9)


def test_causal():
    model = Llama(SMALL, seed=0)
    ids = torch.randint(0, 256, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


class _LayersAsLeaves(torch.fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, LlamaDecoderLayer) or super().is_leaf_module(m, qualname)


def test_fx_traces_with_layers_as_leaves():
    model = Llama(SMALL, seed=0)
    graph = _LayersAsLeaves().trace(model)
    gm = torch.fx.GraphModule(model, graph)
    layer_nodes = [n.target for n in graph.nodes if n.op == "call_module" and n.target.startswith("layers.")]
    assert layer_nodes == ["layers.0", "layers.1", "layers.2"]
    ids = torch.randint(0, 256, (2, 10))
    assert torch.equal(gm(ids), model(ids))
    assert torch.equal(gm(ids[:, :5]), model(ids[:, :5]))  # sequence length stays symbolic
    full = torch.fx.symbolic_trace(model)  # also traceable all the way down
    assert torch.equal(full(ids), model(ids))


def test_hooks_see_each_layer_once_and_backward_runs():
    model = Llama(SMALL, seed=0)
    seen = []
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: seen.append(i)) for i, layer in enumerate(model.layers)]
    ids = torch.randint(0, 256, (2, 10))
    logits = model(ids)
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert seen == [0, 1, 2]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    for h in handles:
        h.remove()


def test_bf16_autocast_forward_backward():
    model = Llama(SMALL, seed=0)
    ids = torch.randint(0, 256, (2, 10))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
    assert model.layers[0].self_attn.q_proj.weight.grad.dtype == torch.float32


def test_wrong_config_type():
    with pytest.raises(TypeError, match="config must be a LlamaConfig"):
        Llama({"hidden_size": 8})  # type: ignore[arg-type]
