"""GuideLLM (the `eval` extra) drives `poise serve` unchanged: a synchronous and a concurrent
run of synthetic chat requests, every request successful, token counts as asked. The one thing
it needs from the user is a tokenizer for its synthetic prompts: the served checkpoint's
directory (docs/evaluation.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving.conftest import ServerProcess, tiny_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with tiny_server(
        tiny_model_dir, tmp_path_factory.mktemp("guidellm"), "--max-model-len", "512"
    ) as proc:
        yield proc


@pytest.mark.parametrize("profile", ["kind=synchronous", "kind=concurrent,streams=4"])
def test_guidellm_run(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path, profile: str
) -> None:
    exe = shutil.which("guidellm", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("guidellm is in the `eval` extra (make test-all)")
    out = tmp_path / "report.json"
    cmd = [
        exe,
        "run",
        "--backend",
        f"kind=openai_http,target={server.base_url},model=tiny",
        "--profile",
        profile,
        "--constraint",
        "kind=max_requests,count=8",
        "--data",
        "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--tokenizer",
        f"kind=huggingface_auto,model={tiny_model_dir}",
        "--output",
        f"kind=json,path={out}",
        "--disable-progress",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    state = bench["scheduler_state"]
    assert state["successful_requests"] == 8 and state["errored_requests"] == 0
    totals = bench["metrics"]["output_token_count"]["successful"]
    assert totals["count"] == 8 and totals["mean"] == 8  # 8 tokens each, as asked
