from __future__ import annotations

from tests.model.conftest import tiny_checkpoints, tiny_llama_dir  # noqa: F401
from tests.serving.conftest import smol_tokenizer_dir, tiny_model_dir  # noqa: F401
