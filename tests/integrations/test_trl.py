"""TRL's SFTTrainer (a Trainer) with OffloadCallback: the same run as without it."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from annotate_offload import HybridDeviceOptimizer  # noqa: E402
from annotate_offload.integrations.transformers import OffloadCallback  # noqa: E402

from ._tiny import ADAMW, HYBRID, OFFLOAD, llama, same, tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tmp")  # SFTConfig's output_dir


def sft(optimizer, callbacks=(), **kwargs) -> "trl.SFTTrainer":
    vocab = {f"t{i}": i for i in range(128)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  pad_token="t1", eos_token="t2")
    data = datasets.Dataset.from_dict({"input_ids": tokens(16, 16).tolist()})  # tokenized: used as is
    args = trl.SFTConfig("out", max_steps=4, per_device_train_batch_size=2, logging_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, bf16=False, learning_rate=1e-3, disable_tqdm=True, **kwargs)
    return trl.SFTTrainer(model=llama(), args=args, train_dataset=data, processing_class=tok,
                          callbacks=list(callbacks), optimizer_cls_and_kwargs=optimizer)


def test_sft_trainer_equals_adamw():
    logs = []
    for optimizer, callbacks in ((ADAMW, []), (HYBRID, [OffloadCallback(**OFFLOAD)])):
        tr = sft(optimizer, callbacks)
        tr.train()
        logs.append([h for h in tr.state.log_history if "loss" in h])
    for key in ("loss", "grad_norm"):
        same([h[key] for h in logs[0]], [h[key] for h in logs[1]])
    assert tr.model.offload_plan.bytes_per_step > 0


def test_sft_trainer_refuses_its_own_activation_offloading_too():
    tr = sft((HybridDeviceOptimizer, {"lr": 1e-3}), [OffloadCallback(**OFFLOAD)])
    tr.args.activation_offloading = True  # SFTTrainer builds TRL's offload context only with an accelerator
    with pytest.raises(ValueError, match=r"SFTConfig\(activation_offloading=True\) offloads activations with TRL's own "
                                         r"hooks as well; pass activation_offloading=False"):
        tr.train()
    assert tr.state.global_step == 0
