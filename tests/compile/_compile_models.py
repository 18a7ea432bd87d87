"""Tiny models and the step helpers of the compile tests (CPU-sized, nothing downloaded)."""

from __future__ import annotations

import torch
import torch.nn as nn

from annotate_offload import mark_not_offload
from annotate_offload.models import GPTConfig, GPTStack
from annotate_offload.models.llama import Llama, LlamaConfig

H = 64  # the MLP stack's width: a block saves its input (8, H) and its relu output (8, 2H)


class Block(nn.Module):
    """``x + b(relu(a(x)))``; ``keep_hidden`` marks the relu output ``mark_not_offload``."""

    def __init__(self, keep_hidden: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.keep_hidden = keep_hidden

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.keep_hidden:
            mark_not_offload(h)
        return x + self.b(h)


class Stack(nn.Module):
    def __init__(self, n: int = 4, keep_hidden: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(keep_hidden) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def gpt() -> tuple:
    return GPTStack(GPTConfig(hidden=32, heads=2, layers=3)), (torch.randn(2, 16, 32),)


def llama() -> tuple:
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, max_seq_len=32)
    return Llama(cfg, seed=0), (torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)),)


def hf_lora() -> tuple:
    import peft
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg).train(),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero, which would leave A's gradient zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model, (torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)),)


def step(model: nn.Module, run, inputs: tuple) -> tuple:
    """One forward/backward through ``run`` (the compiled model); returns (loss, {name: grad})."""
    inputs = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    out = run(*inputs)
    loss = (out if isinstance(out, torch.Tensor) else out.logits).float().square().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same(a: tuple, b: tuple) -> None:
    """Losses and every gradient bit-identical (rtol=atol=0)."""
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name
