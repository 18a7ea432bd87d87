"""Offload the first layers' activations of a GPT stack with one call, then train as usual.

    python3 examples/offload_gpt.py                       # small, CPU backend
    python3 examples/offload_gpt.py --hidden 4096 --layers 8 --tokens 8192 --offload 4   # H200, bf16
"""

from __future__ import annotations

import argparse

import torch

from annotate_offload.annotate import offload_transform
from annotate_offload.models import GPTConfig, GPTStack


def main(argv: list[str] | None = None) -> torch.nn.Module:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--offload", type=int, default=2, help="offload the first N layers (0 <= N < layers)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = GPTStack(GPTConfig(hidden=args.hidden, heads=max(1, args.hidden // 128), layers=args.layers),
                     device=device, dtype=dtype)
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype)

    # The one line this package is about: same model object, its layers 0..N-1 now offload.
    offload_transform(model, num_layers=args.offload, example_inputs=(x,))
    print(model.offload_plan)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.5f}")
    print(model.offload_plan)  # the bytes estimate sits next to what the runtime moved
    return model


if __name__ == "__main__":
    main()
