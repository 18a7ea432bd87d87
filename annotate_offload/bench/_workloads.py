"""The activation-offload workloads of issue 7 (W1, W2) and their ``--tiny`` CPU versions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from annotate_offload.models.gpt import GPTConfig, GPTStack

__all__ = ["Workload", "WORKLOADS", "TINY_WORKLOADS", "build"]


@dataclass(frozen=True)
class Workload:
    """One activation benchmark: a GPT stack, its input and how many layers to offload.

    Attributes:
        name (str): ``"W1"`` or ``"W2"``.
        title (str): what bounds it (``"PCIe-bound"``, ``"compute-bound"``).
        layers, hidden, heads (int): :class:`~annotate_offload.models.gpt.GPTConfig` sizes.
        batch, seq (int): input ``(batch, seq, hidden)`` hidden states.
        offload (int): ``N``: layers ``0..N-1`` are offloaded (TE's ``num_layers``).
        target (str): the issue-7 target, printed under the table.
        min_offload_numel (int | None): passed to the runtime; ``None`` keeps its default
            (256K elements). The tiny workloads lower it so tiny tensors are really offloaded.
    """

    name: str
    title: str
    layers: int
    hidden: int
    heads: int
    batch: int
    seq: int
    offload: int
    target: str
    min_offload_numel: int | None = None

    def describe(self) -> str:
        """``W1 PCIe-bound: 8 layers, hidden 4096, 32 heads, batch 2 x 4096 tokens, offload 7 of 8``."""
        return (
            f"{self.name} {self.title}: {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
            f"batch {self.batch} x {self.seq} tokens, offload {self.offload} of {self.layers}"
        )


# Issue 7's time targets, read by the verdict row's choice (activations.WorkloadReport.best_ours)
# and by the checks (_report.targets), so the two cannot drift apart.
W1_FLOOR_RATIO = 1.10  # W1 step <= this x the copy floor
W1_TRL_SPEEDUP = 1.4  # W1 step at least this much faster than TRL's OffloadActivations
W2_BASELINE_RATIO = 1.02  # W2 step <= this x the no-offload baseline

_W1_TARGET = (f"step <= {W1_FLOOR_RATIO:.2f} x copy floor, >= {W1_TRL_SPEEDUP}x faster than TRL, "
              "activation memory <= TRL's")
_W2_TARGET = f"step <= {W2_BASELINE_RATIO:.2f} x baseline, activation memory saved >= 0.9 x 2/8 of the baseline's"

WORKLOADS = {
    "W1": Workload("W1", "PCIe-bound", 8, 4096, 32, 2, 4096, 7, _W1_TARGET),
    "W2": Workload("W2", "compute-bound", 8, 8192, 64, 1, 4096, 2, _W2_TARGET),
}

# Same structure, CPU-sized (a step takes milliseconds); min_offload_numel is lowered below the
# layer input (4*64*32 = 8K elements) so the runtime really offloads every activation.
TINY_WORKLOADS = {
    "W1": Workload("W1", "PCIe-bound (tiny)", 4, 32, 2, 4, 64, 3, _W1_TARGET, min_offload_numel=1024),
    "W2": Workload("W2", "compute-bound (tiny)", 4, 32, 2, 4, 64, 1, _W2_TARGET, min_offload_numel=1024),
}


def build(workload: Workload, device: torch.device, *, seed: int = 0):
    """Model, input and output gradient for ``workload``.

    bf16 on CUDA (issue 7), fp32 on CPU (``--tiny``: fast and exactly reproducible).

    Returns:
        tuple[GPTStack, torch.Tensor, torch.Tensor]: the model, the input ``(B, S, H)`` (no
        grad) and the gradient fed to ``backward`` (``(B, S, H)``, same dtype).
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    config = GPTConfig(hidden=workload.hidden, heads=workload.heads, layers=workload.layers)
    model = GPTStack(config, device=device, dtype=dtype)
    shape = (workload.batch, workload.seq, workload.hidden)
    x = torch.randn(shape, device=device, dtype=dtype)
    grad = torch.randn(shape, device=device, dtype=dtype) * 1e-3
    return model, x, grad
