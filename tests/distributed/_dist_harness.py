"""Shared pieces of the distributed tests: a tiny layered model, a 2-process gloo launcher, the reference.

Processes are started with ``torch.multiprocessing`` (spawn) on 127.0.0.1 and a free port; each
rank writes its results with ``torch.save`` to a file the test reads back, and an exception in a
rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

D_IN, D, D_OUT, LAYERS = 8, 16, 5, 3
LR = 1e-2


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """``D_IN -> D``, ``LAYERS`` residual MLP blocks in a ModuleList (the offload layers), ``D -> D_OUT``.

    ``D_OUT = 5`` makes the head's shards uneven over 2 ranks (3 and 2 rows).
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.layers = nn.ModuleList(Block(D) for _ in range(LAYERS))
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_model(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def batches(steps: int, world: int, rows: int = 4, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """``steps x world`` inputs, the same on every process (seeded generator)."""
    g = torch.Generator().manual_seed(1234)
    return [[torch.randn(rows, D_IN, generator=g).to(dtype) for _ in range(world)] for _ in range(steps)]


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def reference(steps: int, world: int, device: "torch.device | str" = "cpu") -> dict[str, torch.Tensor]:
    """Single process on ``device``: each rank's micro-batch grads computed separately, averaged as
    DDP/FSDP do (``sum / world``), stepped by ``torch.optim.AdamW(fused=True)`` (:func:`train_single`).
    Returns the final weights, on the CPU."""
    model = make_model().to(device)
    train_single(model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True), 0, steps, world)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str, kwargs: dict[str, Any], backend: str) -> None:
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), LOCAL_WORLD_SIZE=str(world), WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
    )
    torch.set_num_threads(1)
    extra: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120), **extra,
    )
    try:
        result = fn(rank, world, out_dir=out_dir, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # A failure above raised to the spawn wrapper; a success exits here, without finalizing
    # (Note [Exit without finalizing] in benchmarks/distributed.py).
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int = 2, out_dir: "str | None" = None, backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world, out_dir=..., **kwargs)`` in ``world`` processes (gloo; ``"nccl"``: one GPU
    each); return each rank's result."""
    own = out_dir is None
    tmp = tempfile.TemporaryDirectory() if own else None
    d = tmp.name if tmp is not None else out_dir
    try:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), d, kwargs, backend), nprocs=world, join=False,
                                 start_method="spawn")
        try:
            while not ctx.join():  # a failed rank raises here, after the others were terminated
                pass
        finally:  # interrupted (a timeout, Ctrl-C): no rank outlives the test
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    finally:
        if tmp is not None:
            tmp.cleanup()


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a (possibly DTensor) tensor."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def train_single(model: nn.Module, opt: Any, first: int, steps: int, world: int = 2) -> None:
    """One process doing what ``world`` DDP/FSDP ranks do: per-rank micro-batch grads, averaged, one step
    (inputs on the model's device, in its dtype)."""
    data = batches(steps, world)
    p0 = next(model.parameters())
    for s in range(first, steps):
        grads = []
        for x in data[s]:
            model.zero_grad(set_to_none=True)
            loss_fn(model(x.to(p0.device, p0.dtype))).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            acc = gs[0].clone()
            for g in gs[1:]:
                acc += g
            p.grad = acc / world
        opt.step()
        opt.zero_grad(set_to_none=True)
