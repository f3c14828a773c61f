"""Fixtures for serving tests: a real tokenizer, a tiny random Llama that speaks it, servers.

- ``smol_tokenizer_dir``: the SmolLM2 GGUF's tokenizer saved as a Hugging Face directory.
  Converting the GGUF vocabulary takes ~10 s, so the result is cached under the system temp
  dir (keyed by the transformers version) and reused by later sessions.
- ``tiny_model_dir``: that tokenizer next to a tiny random LlamaForCausalLM (hidden 64, 2
  layers, vocab = len(tokenizer)), so a server serves real text fast.
- ``InProcessServer``: uvicorn in a background thread around a ServingState (tests that inject
  a fake or failing executor); ``ServerProcess``: ``python -m poise serve`` as a subprocess.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _cached_tokenizer_dir() -> Path:
    import transformers

    from poise.text import default_gguf_path

    cache = Path(tempfile.gettempdir()) / f"poise-test-smollm2-tokenizer-{transformers.__version__}"
    if (cache / "tokenizer.json").is_file():
        return cache
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    tmp = Path(tempfile.mkdtemp(prefix="poise-tok-"))
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, cache)  # atomic: a concurrent session may have won; then use theirs
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


@pytest.fixture(scope="session")
def smol_tokenizer_dir() -> Path:
    return _cached_tokenizer_dir()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Any) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-smol")
    smol_tokenizer.save_pretrained(path)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(smol_tokenizer),
        max_position_embeddings=2048,
        bos_token_id=smol_tokenizer.bos_token_id,
        eos_token_id=smol_tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


class InProcessServer:
    """uvicorn on 127.0.0.1:<free port> in a daemon thread, around one ServingState."""

    def __init__(self, state: Any) -> None:
        import uvicorn

        from poise.serving.app import create_app
        from poise.serving.server import free_port

        self.state = state
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(state), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServerProcess:
    """``python -m poise serve ARGS`` on a free port; stopped by PID."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        from poise.serving.server import free_port

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "poise", "serve", *args, "--port", str(self.port)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)  # fmt: skip

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not healthy:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
