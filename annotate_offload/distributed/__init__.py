"""Offload under torch.distributed, one process per device (DDP, FSDP2 ``fully_shard``), launched with torchrun.

Activation offload needs nothing extra: ``offload_transform`` works per rank (apply it *before*
``fully_shard``), and FSDP2's unsharded parameters are parameters, which the runtime never offloads.

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
