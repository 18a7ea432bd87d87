"""Offload under torch.distributed, one process per device (DDP, FSDP2 ``fully_shard``), launched with torchrun.

* optimizer wiring: :func:`attach_optimizer` (DDP or FSDP2), :func:`register_offload_comm_hook`
  (DDP: reduced gradients, each bucket's D2H after its all-reduce), :func:`clip_grad_norm_`
  (global norm over FSDP2 shards, seen by the host step);
* host threads: :func:`local_thread_budget` (cores / local ranks, NUMA-aware), :class:`ThreadBudget`,
  :func:`bind_to_budget`;
* shards: :func:`local_shard` (a DTensor parameter -> this rank's tensor);
* checkpoints through ``torch.distributed.checkpoint`` at any world size and offload fraction:
  :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`optimizer_state_dict`,
  :func:`set_optimizer_state_dict`.

Activation offload needs nothing extra: ``offload_transform`` works per rank, and FSDP2's
unsharded parameters (and their bf16 all-gathers or autocast casts) are parameters, so the runtime
never offloads them, and resharding frees nothing a saved tensor still needs. Apply
``offload_transform`` *before* ``fully_shard`` (like activation checkpointing in torchtitan), or pass
``path="hooks"`` afterwards: torch.fx tracing calls the FSDP modules' pre-forward hooks and leaves
FSDP's lazy-init state broken when tracing falls back.

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

from ._attach import ShardedAttachment, attach_optimizer
from ._clip import clip_grad_norm_
from ._checkpoint import load_checkpoint, optimizer_state_dict, save_checkpoint, set_optimizer_state_dict
from ._ddp import OffloadCommHook, register_offload_comm_hook
from ._shards import local_shard
from ._threads import ThreadBudget, bind_to_budget, local_thread_budget

__all__ = [
    # optimizer wiring
    "attach_optimizer",
    "register_offload_comm_hook",
    "OffloadCommHook",
    "ShardedAttachment",
    "clip_grad_norm_",
    # host threads and shards
    "local_thread_budget",
    "bind_to_budget",
    "ThreadBudget",
    "local_shard",
    # checkpoints (torch.distributed.checkpoint)
    "save_checkpoint",
    "load_checkpoint",
    "optimizer_state_dict",
    "set_optimizer_state_dict",
]
