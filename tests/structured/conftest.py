from __future__ import annotations

from tests.serving.conftest import smol_tokenizer_dir, tiny_model_dir  # noqa: F401
