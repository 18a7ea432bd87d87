"""Framework integrations (optional extras): import the framework's module, not this package.

* ``annotate_offload.integrations.transformers`` (extra ``[hf]``; TRL: ``[trl]``): ``OffloadCallback``,
  a ``TrainerCallback`` for Hugging Face ``Trainer`` and TRL's trainers, and ``optimizer_cls_and_kwargs``
  for ``Trainer(optimizer_cls_and_kwargs=...)``.
* ``annotate_offload.integrations.lightning`` (extra ``[lightning]``): ``OffloadCallback``, a Lightning
  ``Callback``.

accelerate needs no integration (under DDP, ``attach_optimizer(ddp_model, optimizer, shard_host_step=False)``
keeps ``save_state``/``load_state`` free of collectives). Importing this package imports no framework.
"""

__all__: list[str] = []
