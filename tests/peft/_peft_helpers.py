"""Shared helpers of the PEFT tests (tests/peft has no __init__.py: as a package named `peft` it would
shadow Hugging Face peft): a small LoRA Llama, a spy on the runtime's pack hook, step comparison."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from annotate_offload.models.llama import Llama, LlamaConfig
from annotate_offload.peft import LoRALinear, apply_lora
from annotate_offload.runtime._layer_state import _Packed

L = 4
R = 3  # adapter rank: no other dimension of the test models is 3
HIDDEN = 64  # B*T = 24 in the tests: no weight has a dimension of 24
VOCAB = 96


def llama_config(**changes) -> LlamaConfig:
    kw = dict(hidden_size=HIDDEN, intermediate_size=128, num_layers=L, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_seq_len=64)
    kw.update(changes)
    return LlamaConfig(**kw)


def randomize_b(model: nn.Module) -> None:
    """B starts at zero (so A's gradient is zero); give it values so every gradient is exercised."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0.0, 0.05)


def lora_llama(*, targets=("q_proj", "v_proj"), dropout=0.0, **changes) -> Llama:
    model = Llama(llama_config(**changes), seed=0)
    apply_lora(model, list(targets), r=R, alpha=2 * R, dropout=dropout)
    randomize_b(model)
    return model.train()


def ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def step(model: nn.Module, input_ids: torch.Tensor, *, seed: int = 0, autocast: bool = False, forward=None):
    """One forward/backward; returns the loss and the gradients of the trainable parameters."""
    torch.manual_seed(seed)  # dropout draws the same masks in both runs
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = (forward or model)(input_ids)
        if not isinstance(logits, torch.Tensor):
            logits = logits.logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), input_ids.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


class PackSpy:
    """Records every tensor the runtime's pack hook sees, split into offloaded (packed) and kept."""

    def __init__(self, sync) -> None:
        self.packed: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []
        orig = sync.push_tensor

        def spy(t):
            handle = orig(t)
            (self.packed if type(handle) is _Packed else self.kept).append(t)
            return handle

        sync.push_tensor = spy  # looked up at every enter_layer

    def clear(self) -> None:
        self.packed.clear()
        self.kept.clear()

    def packed_rank_r(self) -> list[torch.Tensor]:
        return [t for t in self.packed if t.dim() and t.shape[-1] == R]

    def packed_sharing_storage(self, tensors) -> list[torch.Tensor]:
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        return [t for t in self.packed if t.untyped_storage().data_ptr() in ptrs]

    def packed_with_shape(self, shapes) -> list[torch.Tensor]:
        shapes = {tuple(s) for s in shapes}
        return [t for t in self.packed if tuple(t.shape) in shapes]


def marked_parameters(model: nn.Module) -> list[str]:
    """Names of parameters that carry an offload mark (the runtime never offloads a parameter)."""
    marks = {"_TE_do_not_offload", "activation_offloading"}
    return [n for n, p in model.named_parameters() if marks & p.__dict__.keys()]


def adapter_weights(model: nn.Module) -> list[torch.Tensor]:
    """``lora_A``/``lora_B`` weights of LoRALinear and of Hugging Face peft LoRA layers."""
    out = []
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            out.append(p)
    return out


def weight_shapes(params) -> set[tuple]:
    shapes = set()
    for p in params:
        shapes.add(tuple(p.shape))
        if p.dim() == 2:
            shapes.add(tuple(p.shape[::-1]))
    return shapes


class OneScope:
    """Runs the whole model inside layer 0's offload scope (layer 1 is a no-op), so the head and
    everything else is subject to offloading; returns the logits."""

    def __init__(self, policy: str) -> None:
        from annotate_offload.runtime import DefaultOffloadSynchronizer

        self.sync = DefaultOffloadSynchronizer(num_layers=2, num_offloaded_layers=1, policy=policy,
                                               min_offload_numel=0, device="cpu", prefetch_layers=1)

    def __call__(self, model: nn.Module):
        def run(input_ids):
            self.sync.enter_layer(0)
            out = model(input_ids)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            self.sync.commit_layer(logits, 0)
            self.sync.enter_layer(1)
            logits = logits * 1.0
            return self.sync.commit_layer(logits, 1)

        return run
