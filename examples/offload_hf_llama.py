"""Offload a Hugging Face Llama's decoder layers, transformed on the CPU and moved afterwards.

Built from a small LlamaConfig, nothing downloaded. Needs ``pip install transformers``. The
transform may come before or after ``.to(device)`` (as with Trainer or accelerate): the runtime
binds its device at the first training forward.

    python3 examples/offload_hf_llama.py
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from annotate_offload.annotate import offload_transform


def main(argv: list[str] | None = None) -> torch.nn.Module:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(512, args.seq))
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, args.seq))

    offload_transform(model, num_layers=2, example_inputs={"input_ids": ids, "labels": ids})
    print(model.offload_plan)  # the meta-device estimate of the bytes each layer moves
    model.to(device)
    ids = ids.to(device)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    model.eval()
    print(model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False, pad_token_id=0))  # generate still works
    return model


if __name__ == "__main__":
    main()
