"""The live `poise serve` that test_live.py and test_live_load.py each start once for their
module: the tiny random Llama with the real SmolLM2 tokenizer (conftest.tiny_server), room for
64 streams in a small KV pool, a step trace next to its log; and how the tests read it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.serving.conftest import ServerProcess, tiny_server

MAX_MODEL_LEN = 512
ARGS = (
    f"--max-model-len {MAX_MODEL_LEN} --max-num-seqs 64 --max-num-batched-tokens 1024 "
    "--kv-cache-memory-bytes 32MiB --log-interval 1"
).split()


@contextlib.contextmanager
def live_server(model_dir: Path, log_dir: Path) -> Iterator[ServerProcess]:
    """The server, ready, its log and step trace (steps.jsonl) in ``log_dir``; on exit it is
    stopped and must have exited cleanly."""
    steps = log_dir / "steps.jsonl"
    with tiny_server(model_dir, log_dir, *ARGS, "--step-trace", str(steps)) as proc:
        yield proc


def metrics_text(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/metrics").text
