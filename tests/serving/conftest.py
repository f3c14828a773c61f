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

import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _cached_tokenizer_dir() -> Path:
    import transformers

    from poise.checkpoint import embedded_gguf_path

    cache = Path(tempfile.gettempdir()) / f"poise-test-smollm2-tokenizer-{transformers.__version__}"
    if (cache / "tokenizer.json").is_file():
        return cache
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
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


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def write_tiny_llama(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """config.json + model.safetensors for a tiny random Llama whose vocab is the tokenizer's,
    plus the tokenizer files. Written directly (no transformers model object: it is faster)."""
    import json

    import torch
    from safetensors.torch import save_file

    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    tok_cfg = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = len(tok_cfg["model"]["vocab"]) + sum(
        1 for t in tok_cfg.get("added_tokens", []) if t["id"] >= len(tok_cfg["model"]["vocab"])
    )
    h, i, layers = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"]
    kv = TINY["num_key_value_heads"] * h // TINY["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **TINY,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for n in range(layers):
        pre = f"model.layers.{n}."
        shapes |= {
            pre + "self_attn.q_proj.weight": (h, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, h),
            pre + "mlp.gate_proj.weight": (i, h),
            pre + "mlp.up_proj.weight": (i, h),
            pre + "mlp.down_proj.weight": (h, i),
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
        }
    # Spread wider than HF's init, so greedy text varies instead of repeating one token.
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: (1.0 + 0.1 * torch.randn(shape, generator=gen))
        if name.endswith("norm.weight")
        else 0.08 * torch.randn(shape, generator=gen)
        for name, shape in shapes.items()
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer_dir: Path) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-smol"), smol_tokenizer_dir)


class InProcessServer:
    """uvicorn on 127.0.0.1:<free port> in a daemon thread, around one ServingState, configured
    as ``poise serve`` configures it (``settings``: its limits, Host check, docs flag)."""

    def __init__(self, state: Any, settings: Any = None) -> None:
        import dataclasses

        from poise.serving.server import ServerSettings, free_port, uvicorn_config
        from poise.serving.shutdown import PoiseServer

        self.state = state
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        settings = dataclasses.replace(
            settings or ServerSettings(), host="127.0.0.1", port=self.port
        )
        config = uvicorn_config(state, settings)
        self.server = PoiseServer(config, state.engine, settings.shutdown_grace_s)
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
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )

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


@contextlib.contextmanager
def tiny_server(model_dir: Path, log_dir: Path, *args: str) -> Iterator[ServerProcess]:
    """``poise serve MODEL_DIR`` as ``tiny`` in float32 (plus ``args``), ready; on exit it is
    stopped and must have exited cleanly (the log's tail otherwise)."""
    log = log_dir / "server.log"
    base = [str(model_dir), "--served-model-name", "tiny", "--dtype", "float32"]
    proc = ServerProcess([*base, *args], log).wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    """The official openai client on the module's ``server`` fixture (no retries)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    """transformers' float32 model on ``tiny_model_dir``: the reference for the server's."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def post_all_at_once(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """POST every body to ``url`` from its own thread, all released together by a barrier (a
    burst that reaches the server at once), and return the responses in ``bodies`` order."""
    start = threading.Barrier(len(bodies))

    def one(body: dict[str, Any]) -> httpx.Response:
        start.wait()
        return httpx.post(url, json=body, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


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
