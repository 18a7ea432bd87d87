"""PEFT adapters and offloading: a LoRA adapter that marks its own tensors, and Hugging Face peft interop.

* :class:`LoRALinear` / :func:`apply_lora`: a frozen ``nn.Linear`` plus a trainable rank-``r``
  update, whose forward marks its tensors for the runtime's selection policy while offloading is
  active (opt-in: tag the adapter input and hidden for offload, as Megatron Bridge's adapters do;
  opt-out: keep the rank-``r`` hidden and the adapter weights on the device).
* :func:`apply_offload_marks`: the same marks for a ``peft.get_peft_model(...)`` model, plus the
  model-wide ones: the language-model head's input is never offloaded, and frozen weights (and
  their autocast casts) are never offloaded as activations.

No dependency on peft or transformers: peft's LoRA layers are recognised by their structure.
Importing this package does not initialise CUDA.
"""

from ._apply import (
    OffloadMarks,
    apply_offload_marks,
    find_lm_head,
    has_offload_marks,
    remove_offload_marks,
    unwrap_model,
)
from ._lora import LoRALinear, apply_lora

__all__ = [
    # adapters
    "LoRALinear",
    "apply_lora",
    # offload marks (own adapters, Hugging Face peft, LM head, frozen weights)
    "apply_offload_marks",
    "remove_offload_marks",
    "has_offload_marks",
    "OffloadMarks",
    # helpers
    "find_lm_head",
    "unwrap_model",
]
