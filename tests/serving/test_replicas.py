"""Two engine replicas on a local Ray Serve instance behind poise's router (slow; needs the
``scale`` extra: ``make test-all`` installs it)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip(
    "ray", reason="Ray Serve replicas need the scale extra: pip install 'poise[scale]'"
)
pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. " * 12  # several KV blocks of a shared system prompt


def _engine_config(model_dir: Path) -> Any:
    from poise.config import EngineConfig

    return EngineConfig.from_kwargs(
        model=str(model_dir), num_threads=1, max_num_seqs=8, max_num_batched_tokens=512
    )


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[str]:
    from poise.deploy.app import DeploySpec
    from poise.deploy.launch import start_local, stop_local
    from poise.router import RouterConfig
    from poise.serving.server import free_port

    config = _engine_config(tiny_model_dir)
    spec = DeploySpec(
        config,
        2,
        RouterConfig(policy="prefix_affinity", block_size=config.cache.block_size),
        served_model_names=["m"],
    )
    port = free_port()
    try:
        start_local(spec, "127.0.0.1", port, num_cpus=2)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_local()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Iterator[str]:
    """One engine, served as ``poise serve`` serves it."""
    from poise.serving.server import ServerSettings, build_state_from_config
    from tests.serving.conftest import InProcessServer

    state = build_state_from_config(
        _engine_config(tiny_model_dir), ServerSettings(served_model_names=["m"])
    )
    with InProcessServer(state) as server:
        yield server.base_url


def _chat(base: str, question: str, **kw: Any) -> httpx.Response:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 12,
        "temperature": 0,
        **kw,
    }
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def _user(base: str, content: str) -> httpx.Response:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_outputs_equal_one_engine_and_prefixes_stick_to_one_replica(
    cluster: str, reference: str
) -> None:
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(5)]
    got = [_chat(cluster, q) for q in questions]
    want = [_chat(reference, q) for q in questions]
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    texts = [r.json()["choices"][0]["message"]["content"] for r in got]
    assert texts == [r.json()["choices"][0]["message"]["content"] for r in want]
    # One after another with a shared system prompt: every request on the same replica.
    assert len({r.headers["x-poise-replica"] for r in got}) == 1
    # Streaming passes through: the same text, chunk by chunk.
    with httpx.stream(
        "POST",
        cluster + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "m",
            "messages": [{"role": "user", "content": questions[0]}],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        },
    ) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3
    # A bad request gets the replica's OpenAI error, not a router failure.
    bad = httpx.post(cluster + "/v1/chat/completions", json={"model": "m"}, timeout=60)
    assert bad.status_code == 400 and "error" in bad.json()
    # Spread two different prompts at once: both replicas serve, and both show in /metrics.
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _chat(cluster, f"other {i}", max_tokens=40), range(4)))
    metrics = httpx.get(cluster + "/metrics", timeout=60).text
    for name in ("engine-0", "engine-1"):
        assert f'replica="{name}"' in metrics
    assert _metric(metrics, "poise_router_decisions_total", reason="affinity_hit") >= 4
    assert _metric(metrics, "poise_router_prefix_affinity_hit_rate") > 0


def _replica_pid(name: str) -> int:
    from ray import serve

    return int(serve.get_deployment_handle(name, app_name="poise").pid.remote().result())


def test_a_killed_replica_loses_no_unstarted_request_and_hangs_no_stream(cluster: str) -> None:
    # The others share the stream's opening blocks: prefix affinity sends them to its replica.
    story = "Tell me a long story about the sea and the ships on it. " * 8
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": story}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", cluster + "/v1/chat/completions", json=body, timeout=120) as resp:
        victim = resp.headers["x-poise-replica"]
        lines = resp.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))  # started
        with cf.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(_user, cluster, story + f"Part {i}.") for i in range(6)]
            # Kill once all six are placed (on the stream's replica, by affinity).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                text = httpx.get(cluster + "/metrics", timeout=30).text
                if _metric(text, "poise_router_in_flight", replica=victim) >= 7:
                    break
                time.sleep(0.05)
            os.kill(_replica_pid(victim), signal.SIGKILL)
            t0 = time.monotonic()
            rest = [ln for ln in lines if ln.startswith("data: ")]
            assert time.monotonic() - t0 < 60
            results = [f.result(timeout=120) for f in futs]
    # The started stream ends with an error naming the replica (or finished before the kill).
    if rest[-1] != "data: [DONE]":
        err = json.loads(rest[-1].removeprefix("data: "))["error"]
        assert err["type"] == "replica_failed" and victim in err["message"]
    # Not one of the others is lost: each answered by a live replica.
    assert [r.status_code for r in results] == [200] * 6, [r.text for r in results]
    # Those the victim held had not started (no byte reached their client): sent again.
    metrics = httpx.get(cluster + "/metrics", timeout=60).text
    assert _metric(metrics, "poise_router_retries_total") >= 1
    # Ray Serve restarts the replica and it rejoins the rotation.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        health = httpx.get(cluster + "/health", timeout=30).json()
        if victim in health["replicas_healthy"]:
            break
        time.sleep(1)
    assert victim in health["replicas_healthy"]
    assert _chat(cluster, "after").status_code == 200
