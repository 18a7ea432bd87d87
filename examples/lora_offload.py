"""LoRA fine-tuning with activation offloading, on the built-in Llama (no download).

    python examples/lora_offload.py              # after `pip install -e .`; CUDA if available, else CPU
    python examples/lora_offload.py --steps 20

1. build a Llama from a preset and put LoRA adapters on its projections (only they train);
2. offload the saved activations of the first N decoder layers; the transform also installs the
   PEFT offload marks: adapters keep their rank-r tensors on the GPU (opt-out policy), the LM
   head's input stays, frozen-weight casts are never offloaded;
3. train a few steps and compare the loss with the same run without offloading (bit-identical).

With Hugging Face peft the same call applies to ``peft.get_peft_model(model, LoraConfig(...))``,
before or after ``get_peft_model``.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from annotate_offload.annotate import offload_transform
from annotate_offload.config import ModelConfig
from annotate_offload.models.llama import Llama, LlamaConfig
from annotate_offload.peft import apply_lora


def train(model, batches, steps: int) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers whose activations are offloaded")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model = Llama(LlamaConfig.from_preset("llama-tiny"), seed=0, device=device)
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], r=8, alpha=16, dropout=0.05)
    baseline = copy.deepcopy(model)  # same weights, no offloading

    # reload one layer ahead; on the CPU move even the tiny model's tensors
    config = ModelConfig(cpu_offloading=True, prefetch_layers=1, **({"min_offload_numel": 0} if device == "cpu" else {}))
    offload_transform(model, args.num_layers, config=config)
    print(model.offload_plan)

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 128), generator=gen).to(device) for _ in range(4)]
    torch.manual_seed(0)
    with_offload = train(model, batches, args.steps)
    torch.manual_seed(0)
    without = train(baseline, batches, args.steps)
    for i, (a, b) in enumerate(zip(with_offload, without)):
        print(f"step {i}: loss {a:.6f} (offload) {b:.6f} (none) {'same' if a == b else 'DIFFERENT'}")
    stats = getattr(model.offload_plan, "stats", None)
    if stats is not None:
        print(stats)
    if with_offload != without:
        raise SystemExit("offloaded run differs from the baseline")


if __name__ == "__main__":
    main()
