from __future__ import annotations

from tests.model.conftest import tiny_checkpoints, tiny_llama_dir  # noqa: F401
