"""`poise serve` flags vLLM users already type, against one live server whose model is a Hub id
in a temporary Hugging Face cache (HF_HOME pointed at a tmp dir; nothing is downloaded), through
the official openai client: --api-key (401 in OpenAI's shape, probes open), --chat-template,
--generation-config DIR, --uvicorn-log-level, --enable-log-requests (ids and lengths, never
the prompt), the served name as typed, /tokenize and /detokenize, unknown model 404, and a
model that cannot be loaded: one line, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving.conftest import REPO, ServerProcess

HUB_ID = "poise-test/tiny-llama"
KEY = "s3cret-key"
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
SECRET_PROMPT = "the-launch-code-is-4711"


def hf_cache_with(model_dir: Path, home: Path, repo_id: str) -> Path:
    """A Hugging Face cache layout under ``home`` holding ``model_dir`` as ``repo_id``."""
    commit = "0" * 40
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return home


@pytest.fixture(scope="module")
def hf_home(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_cache_with(tiny_model_dir, tmp_path_factory.mktemp("hf_home"), HUB_ID)


@pytest.fixture(scope="module")
def server(hf_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("dropin")
    gen_dir = tmp / "gen"
    gen_dir.mkdir()
    (gen_dir / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    args = [
        HUB_ID,
        "--api-key",
        KEY,
        "--chat-template",
        TEMPLATE,
        "--generation-config",
        str(gen_dir),
        "--uvicorn-log-level",
        "info",
        "--enable-log-requests",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        "16MiB",
    ]
    old = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = str(hf_home)  # the subprocess's cache; restored below
    try:
        proc = ServerProcess(args, tmp / "server.log").wait_ready()
    finally:
        if old is None:
            os.environ.pop("HF_HOME")
        else:
            os.environ["HF_HOME"] = old
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def _client(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_api_key(server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        _client(server, "wrong").models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    body = httpx.get(server.base_url + "/v1/models").json()  # no Authorization at all
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/metrics", "/ready", "/version"):  # probes stay open
        assert httpx.get(server.base_url + path).status_code == 200
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401
    # The served name defaults to the model argument as typed (the Hub id).
    assert [m.id for m in _client(server).models.list().data] == [HUB_ID]


def test_unknown_model_is_404(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _client(server).completions.create(model="gpt-5", prompt="hi", max_tokens=1)
    assert info.value.code == "model_not_found"
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "model"


def test_generation_config_dir_sets_default_max_tokens(server: ServerProcess) -> None:
    out = _client(server).completions.create(
        model=HUB_ID, prompt="Hello", extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    # A request's own value wins over the generation config.
    out = _client(server).completions.create(
        model=HUB_ID, prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_chat_template_and_tokenize(server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(
        server.base_url + "/tokenize", headers=auth, json={"model": HUB_ID, "messages": msgs}
    ).json()
    plain = httpx.post(
        server.base_url + "/tokenize",
        headers=auth,
        json={
            "prompt": "[user]hi[assistant]",
            "add_special_tokens": False,
            "return_token_strs": True,
        },
    ).json()
    assert chat["tokens"] == plain["tokens"] and chat["count"] == len(chat["tokens"])
    assert chat["max_model_len"] == 256 and len(plain["token_strs"]) == plain["count"]
    back = httpx.post(
        server.base_url + "/detokenize", headers=auth, json={"tokens": plain["tokens"]}
    ).json()
    assert back == {"prompt": "[user]hi[assistant]"}
    # The chat endpoint renders with the same template: its prompt token count matches.
    out = _client(server).chat.completions.create(model=HUB_ID, messages=msgs, max_tokens=1)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.prompt_tokens == chat["count"]
    bad = httpx.post(
        server.base_url + "/tokenize", headers=auth, json={"model": "nope", "prompt": "x"}
    )
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    assert (
        httpx.post(server.base_url + "/detokenize", headers=auth, json={"tokens": [-1]}).status_code
        == 400
    )


def test_request_log_has_ids_and_lengths_not_prompts(server: ServerProcess) -> None:
    out = _client(server).completions.create(model=HUB_ID, prompt=SECRET_PROMPT, max_tokens=2)
    log = server.log_path.read_text()
    assert f'"id": "{out.id}"' in log and '"output_tokens": 2' in log
    assert SECRET_PROMPT not in log
    assert "Uvicorn running on" in log  # --uvicorn-log-level info


def _serve_fails(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "poise", "serve", *args, "--port", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_load_failures_are_one_line(tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path / "empty_home"), "HF_HUB_OFFLINE": "1"}
    line = _serve_fails(["someone/not-cached-model"], env)
    assert "not in the local Hugging Face cache" in line and "someone/not-cached-model" in line
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    line = _serve_fails([str(broken)], env)
    assert line.startswith("poise serve: error: cannot load") and str(broken) in line


def test_api_key_env_and_chat_template_argument(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from poise.cli.serve import read_chat_template
    from poise.serving.auth import api_key_from_env

    monkeypatch.delenv("POISE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key_from_env() is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_key_from_env() == "from-vllm"
    monkeypatch.setenv("POISE_API_KEY", "from-poise")
    assert api_key_from_env() == "from-poise"
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="chat_template"):
        read_chat_template("no/such/file.jinja")


def test_replicas_refuse_the_flags_they_do_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    from poise.cli import main

    assert main(["serve", "--replicas", "2", "--api-key", "k", "--enable-log-requests"]) == 2
    err = capsys.readouterr().err
    assert "--api-key, --enable-log-requests not supported with --replicas" in err
    assert main(["serve", "--replicas", "2", "--max-stop-sequences", "4"]) == 2
    assert "--max-stop-sequences not supported with --replicas" in capsys.readouterr().err
