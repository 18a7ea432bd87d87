"""Built-in model architectures for the CLI recipes, tests and benchmarks (no weights downloaded).

- :mod:`.llama`: Llama (RMSNorm, rotary, SwiGLU, grouped-query attention), presets
  ``llama-tiny`` and ``llama-1b``.
- :mod:`.gpt`: the plain GPT stack of the benchmark workloads.
"""

from .gpt import GPTConfig, GPTStack
from .llama import LLAMA_PRESETS, Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "LLAMA_PRESETS", "GPTConfig", "GPTStack"]
