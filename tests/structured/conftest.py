from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai

from tests.serving.conftest import ServerProcess, smol_tokenizer_dir, tiny_model_dir  # noqa: F401


def serve(args: list[str], log: Path) -> Iterator[ServerProcess]:
    """``poise serve ARGS`` (float32, the served name ``m``) for a module; stopped after it."""
    proc = ServerProcess(
        [
            *args,
            "--dtype",
            "float32",
            "--kv-cache-memory-bytes",
            "32MiB",
            "--served-model-name",
            "m",
        ],
        log,
    ).wait_ready()
    yield proc
    assert proc.stop() == 0, log.read_text()[-3000:]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
