"""Offload under torch.distributed, one process per device (DDP, FSDP2 ``fully_shard``), launched with torchrun.

* optimizer wiring: :func:`attach_optimizer` (DDP: reduced gradients, each bucket's D2H after its
  all-reduce, the host step sharded across ranks; FSDP2: local shards), :func:`clip_grad_norm_`
  (global norm over FSDP2 shards, seen by the host step);
* host threads: :func:`local_thread_budget` (cores / local ranks, NUMA-aware), :func:`bind_to_budget`;
* checkpoints through ``torch.distributed.checkpoint`` at any world size and offload fraction:
  :func:`save_checkpoint`, :func:`load_checkpoint`.

Activation offload needs nothing extra: ``offload_transform`` works per rank, and FSDP2's
unsharded parameters (and their bf16 all-gathers or autocast casts) are parameters, so the runtime
never offloads them, and resharding frees nothing a saved tensor still needs. Apply
``offload_transform`` *before* ``fully_shard`` (like activation checkpointing in torchtitan).

Usage (one process per GPU, under torchrun)::

    offload_transform(model, num_layers=8)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)                      # or: model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=3e-4,
                                cpu_threads=local_thread_budget().threads)
    attach_optimizer(model, opt)
    ...
    save_checkpoint(model, opt, "ckpt/step1000")     # loadable at any world size / fraction

Importing this module does not initialise CUDA or a process group.
"""

from ._attach import attach_optimizer
from ._checkpoint import load_checkpoint, save_checkpoint
from ._clip import clip_grad_norm_
from ._threads import bind_to_budget, local_thread_budget

__all__ = [
    "attach_optimizer",  # DDP (comm hook, sharded host step) or FSDP2
    "clip_grad_norm_",  # global norm over FSDP2 shards, seen by the host step
    "local_thread_budget",  # host threads of one local rank, NUMA-aware
    "bind_to_budget",
    "save_checkpoint",  # torch.distributed.checkpoint, any world size and fraction
    "load_checkpoint",
]
