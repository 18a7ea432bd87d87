"""One rank of ``test_frameworks_ddp.py``, started by torchrun (2 CPU processes, gloo): ``_ddp_worker.py hf|lightning OUT``.

Trains the tiny Llama through the framework's DDP three times: AdamW(fused=True) without offload, with
OffloadCallback and HybridDeviceOptimizer (saving a checkpoint halfway), and resumed from that checkpoint.
Rank 0 writes the logged losses and gradient norms, the final weights and the DDP comm hooks to ``OUT``.
"""

from __future__ import annotations

import os
import sys

import torch

from _tiny import ADAMW, HYBRID, OFFLOAD, Tokens, llama, tokens


def hf(out: str) -> dict:
    import transformers

    from annotate_offload.integrations.transformers import OffloadCallback

    def run(optimizer, callbacks, name, resume=None):
        args = transformers.TrainingArguments(
            os.path.join(out, name), max_steps=4, per_device_train_batch_size=2, logging_steps=1, report_to=[],
            save_strategy="steps", save_steps=2, use_cpu=True, ddp_backend="gloo", learning_rate=1e-3,
            weight_decay=0.1, disable_tqdm=True)
        tr = transformers.Trainer(model=llama(), args=args, train_dataset=Tokens(32), callbacks=callbacks,
                                  optimizer_cls_and_kwargs=optimizer)
        tr.train(resume_from_checkpoint=resume)
        logs = [h for h in tr.state.log_history if "loss" in h]
        plan = getattr(tr.model, "offload_plan", None)
        return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
                "weights": [p.detach().clone() for p in tr.model.parameters()],
                "hooks": len(tr.model_wrapped._comm_hooks), "bytes": plan and plan.bytes_per_step}

    return {"base": run(ADAMW, [], "base"), "ours": run(HYBRID, [OffloadCallback(**OFFLOAD)], "ours"),
            "resumed": run(HYBRID, [OffloadCallback(**OFFLOAD)], "resumed",
                           resume=os.path.join(out, "ours", "checkpoint-2"))}


def lightning(out: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from annotate_offload.integrations.lightning import OffloadCallback

    class Lit(pl.LightningModule):
        def __init__(self, optimizer) -> None:
            super().__init__()
            self.model, self.optimizer, self.losses, self.norms = llama(), optimizer, [], []

        def on_train_start(self):  # the DDP wrapper exists during fit only
            self.hooks = len(self.trainer.strategy.model._comm_hooks)

        def training_step(self, batch, i):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item())

        def configure_optimizers(self):
            return self.optimizer[0](self.parameters(), **self.optimizer[1])

    def run(optimizer, callbacks, ckpt_path=None):
        lit = Lit(optimizer)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, callbacks=callbacks,
                             logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out, gradient_clip_val=1.0)
        trainer.fit(lit, torch.utils.data.DataLoader(tokens(32, 16), batch_size=4), ckpt_path=ckpt_path)
        plan = getattr(lit, "offload_plan", None)
        return {"loss": lit.losses, "grad_norm": lit.norms, "weights": [p.detach().clone() for p in lit.parameters()],
                "hooks": lit.hooks, "bytes": plan and plan.bytes_per_step}

    def callbacks():
        return [OffloadCallback(**OFFLOAD), ModelCheckpoint(out, save_top_k=-1, every_n_epochs=1)]

    return {"base": run(ADAMW, []), "ours": run(HYBRID, callbacks()),
            "resumed": run(HYBRID, callbacks(), ckpt_path=os.path.join(out, "epoch=0-step=4.ckpt"))}


if __name__ == "__main__":
    framework, out = sys.argv[1], sys.argv[2]
    results = {"hf": hf, "lightning": lightning}[framework](out)
    if int(os.environ["RANK"]) == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # Note [Exit without finalizing] in benchmarks/distributed.py
