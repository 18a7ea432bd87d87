"""Built-in model architectures for the CLI recipes, tests and benchmarks (no weights downloaded).

- :class:`Llama` (RMSNorm, rotary, SwiGLU, grouped-query attention) with :class:`LlamaConfig`, whose
  ``from_preset`` gives ``llama-tiny`` and ``llama-1b``;
- :class:`GPTStack` with :class:`GPTConfig`: the plain GPT stack of the benchmark workloads.
"""

from .gpt import GPTConfig, GPTStack
from .llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "GPTConfig", "GPTStack"]
