"""PEFT adapters and offloading: a LoRA adapter that marks its own tensors, and Hugging Face peft interop.

* :class:`LoRALinear` / :func:`apply_lora`: a frozen ``nn.Linear`` plus a trainable rank-``r``
  update, whose forward marks its tensors for the runtime's selection policy (Note [Adapter marks]).
* :func:`apply_offload_marks` / :func:`remove_offload_marks`: the same marks for a
  ``peft.get_peft_model(...)`` model, plus the model-wide ones (the head's input, frozen weights);
  ``offload_transform`` applies them itself, before or after ``get_peft_model``.

No dependency on peft or transformers: peft's LoRA layers are recognised by their structure.
Importing this package does not initialise CUDA.
"""

from ._apply import apply_offload_marks, remove_offload_marks
from ._lora import LoRALinear, apply_lora

__all__ = [
    "LoRALinear",  # adapters
    "apply_lora",
    "apply_offload_marks",  # offload marks (own adapters, Hugging Face peft, LM head, frozen weights)
    "remove_offload_marks",
]
