"""annotate_offload.models.gpt: the GPT stack of the benchmark workloads (tiny shapes, CPU)."""

import pytest
import torch
import torch.fx as fx

from annotate_offload.models.gpt import GPTBlock, GPTConfig, GPTStack


class _LayerLeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, GPTBlock) or super().is_leaf_module(m, qualname)


def test_block_structure():
    cfg = GPTConfig(hidden=32, heads=4, layers=2)
    block = GPTStack(cfg).layers[0]
    assert block.qkv.in_features == 32 and block.qkv.out_features == 96  # fused QKV
    assert block.proj.out_features == 32
    assert block.fc1.out_features == 4 * 32 and block.fc2.in_features == 4 * 32
    assert isinstance(block.ln1, torch.nn.LayerNorm) and isinstance(block.ln2, torch.nn.LayerNorm)


def test_forward_matches_manual_reference():
    torch.manual_seed(0)
    cfg = GPTConfig(hidden=16, heads=2, layers=1)
    model = GPTStack(cfg, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    b = model.layers[0]
    h = b.ln1(x)
    q, k, v = b.qkv(h).split(16, dim=-1)
    q, k, v = (t.view(2, 5, 2, 8).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / 8**0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 16)
    y = x + b.proj(att)
    y = y + b.fc2(torch.nn.functional.gelu(b.fc1(b.ln2(y))))
    torch.testing.assert_close(model(x), y)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=16, heads=2, layers=2))
    x = torch.randn(1, 6, 16)
    x2 = x.clone()
    x2[:, 4:] += 1.0
    y, y2 = model(x), model(x2)
    assert torch.equal(y[:, :4], y2[:, :4])
    assert not torch.equal(y[:, 4:], y2[:, 4:])


def test_fx_layers_are_call_module_nodes_and_trace_is_exact():
    model = GPTStack(GPTConfig(hidden=16, heads=2, layers=3))
    graph = _LayerLeafTracer().trace(model)
    targets = [n.target for n in graph.nodes if n.op == "call_module"]
    assert targets == ["layers.0", "layers.1", "layers.2"]
    x = torch.randn(2, 4, 16)
    assert torch.equal(fx.GraphModule(model, graph)(x), model(x))
    assert torch.equal(fx.symbolic_trace(model)(x), model(x))  # the blocks trace too


def test_lm_variant_traces_and_counts_parameters():
    cfg = GPTConfig(hidden=16, heads=2, layers=2, vocab=50, max_seq=8)
    model = GPTStack(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    tokens = torch.randint(0, 50, (3, 8))
    logits = model(tokens)
    assert logits.shape == (3, 8, 50)
    assert torch.equal(fx.GraphModule(model, _LayerLeafTracer().trace(model))(tokens), logits)


def test_lm_variant_learns():
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=32, heads=4, layers=2, vocab=16, max_seq=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.arange(16).repeat(4, 1)  # predictable next token
    losses = []
    for _ in range(30):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


def test_bf16_forward_backward():
    model = GPTStack(GPTConfig(hidden=32, heads=4, layers=2), dtype=torch.bfloat16)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    y = model(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    y.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden": 30, "heads": 4, "layers": 1}, "hidden=30 is not divisible by heads=4"),
        ({"hidden": 32, "heads": 0, "layers": 1}, "heads must be a positive int"),
        ({"hidden": 32, "heads": 4, "layers": 1.5}, "layers must be a positive int"),
        ({"hidden": 32, "heads": 4, "layers": 1, "vocab": 0}, "vocab must be None or a positive int"),
    ],
)
def test_config_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_stack_rejects_non_config():
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPTStack({"hidden": 32})
