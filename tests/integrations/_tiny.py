"""A tiny Hugging Face Llama (from a config, no download) and its data, shared by the framework tests."""

from __future__ import annotations

import pytest
import torch

from annotate_offload import HybridDeviceOptimizer

transformers = pytest.importorskip("transformers")  # the importing test module is skipped without it

LAYERS = 4
# min_offload_numel=0: the runtime offloads this model's small activations too
OFFLOAD = dict(num_layers=2, min_offload_numel=0)
# (optimizer class, kwargs): the baseline, and the optimizer the offloaded runs use
ADAMW = (torch.optim.AdamW, {"lr": 1e-3, "fused": True})
HYBRID = (HybridDeviceOptimizer, {"lr": 1e-3, "offload_fraction": 0.5})


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def tokens(n: int = 16, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (n, seq), generator=torch.Generator().manual_seed(0))


class Tokens(torch.utils.data.Dataset):
    """Causal-LM samples ``{"input_ids", "labels"}`` for Trainer's default collator."""

    def __init__(self, n: int = 16, seq: int = 16) -> None:
        self.ids = tokens(n, seq)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def same(a: list, b: list) -> None:
    """``torch.equal`` on every logged value (losses, gradient norms), with the same count (NaN where NaN)."""
    assert len(a) == len(b) > 0, (a, b)
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert torch.equal(ta.isnan(), tb.isnan()) and torch.equal(ta[~ta.isnan()], tb[~tb.isnan()]), (a, b)
