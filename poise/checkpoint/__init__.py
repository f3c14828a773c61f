"""What a model is, without torch: its architecture (from config.json or GGUF metadata), its
tokenizer files, and where the embedded default lives.

The torch loaders (``model/``), the KV pool sizing (``runner/``), the simulator's model shapes
(``sim/``) and the tokenizer loader (``text/``) all read models through this package, so a
``--model`` string and a config.json mean the same thing to each of them. Imports numpy and
``gguf`` at most; ``tokenizers``/``transformers`` only inside ``gguf_tokenizer``'s functions.
"""

from __future__ import annotations

from poise.checkpoint.arch import ArchConfig, RopeConfig, arch_from_hf_config
from poise.checkpoint.embedded import EMBEDDED_GGUF_NAME, embedded_gguf_path
from poise.checkpoint.source import ModelSource, describe, resolve_model

__all__ = [
    "EMBEDDED_GGUF_NAME",
    "ArchConfig",
    "ModelSource",
    "RopeConfig",
    "arch_from_hf_config",
    "describe",
    "embedded_gguf_path",
    "resolve_model",
]
