"""Faults and lifecycle (issue 16, items 3 and 4): the engine thread dying with requests in
flight, a disconnect storm, clients that stop reading, a chat template error, and a drain.
Overload and the soak are in test_load.py.

The real app, AsyncEngine and SmolLM2 tokenizer around the scheduler tests' fake executor
(slowed so that requests overlap), in this process (fake_engine_server.py); the drain's exit
code is a real ``poise serve`` (tiny random Llama) receiving SIGTERM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.conftest import InProcessServer, ServerProcess, metric_value
from tests.serving.fake_engine_server import (
    assert_left_nothing,
    fake_server,
    gauge,
    rss_bytes,
    tasks,
    wait,
)

CHAT = [{"role": "user", "content": "hello"}]


# ---- the engine thread dies with requests in flight ------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_thread_death_ends_every_request_with_503(smol_tokenizer: Any) -> None:
    server, executor = fake_server(smol_tokenizer)
    with server:
        base = server.base_url
        lines: list[str] = []
        posted: list[httpx.Response] = []

        def stream() -> None:
            body = {"messages": CHAT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
                lines.extend(x for x in r.iter_lines() if x.startswith("data: "))

        def post() -> None:
            body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True}
            posted.append(httpx.post(base + "/v1/completions", json=body, timeout=30))

        threads = [threading.Thread(target=stream), threading.Thread(target=post)]
        for t in threads:
            t.start()
        wait(lambda: gauge(server, "poise:num_requests_running") == 2)
        killed = time.monotonic()
        executor.kill = True
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a request hung after the engine died"
        assert time.monotonic() - killed < 10
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: ") :])["error"]
        assert error["code"] == 503 and "engine" in error["message"], error
        assert posted[0].status_code == 503, posted[0].text
        assert posted[0].json()["error"]["type"] == "engine_dead"
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and "ThreadKilled" in health.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503


# ---- a disconnect storm ----------------------------------------------------------------------

STORM = 100  # streams; -m slow runs STORM_LARGE


def _storm(server: InProcessServer, n: int, seed: int = 0) -> int:
    """``n`` streams at once, each cut after a random number of events (0: before the first);
    returns how many events were read in all."""
    rng = random.Random(seed)
    cuts = [rng.randint(0, 30) for _ in range(n)]

    async def one(client: httpx.AsyncClient, cut: int, i: int) -> int:
        body = {
            "prompt": [5, 6, i % 500 + 10],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        read = 0
        async with client.stream("POST", server.base_url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if read >= cut:
                    break  # leaving the block closes the connection mid-stream
                read += line.startswith("data: ")
        return read

    async def all_of_them() -> int:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return sum(await asyncio.gather(*(one(client, c, i) for i, c in enumerate(cuts))))

    return asyncio.run(all_of_them())


def test_a_disconnect_storm_leaves_no_blocks_tasks_or_threads(smol_tokenizer: Any) -> None:
    server, executor = fake_server(smol_tokenizer, max_num_seqs=64)
    # 10 ms steps: 200 tokens take 2 s, far longer than any cut stream's 30 events take to be
    # read and dropped. At 2 ms a slower CPU (Zen 3) read 30 events more slowly than the fake
    # engine made 200 tokens, and the 64 running requests finished before their disconnects
    # were seen (40-50 of 100 aborted): a race of the test, not of the server.
    executor.delay_s = 0.01
    with server:
        _storm(server, 4)  # warm: the tokenizer thread and the connection machinery exist
        wait(lambda: server.state.engine.num_in_flight == 0)
        threads, num_tasks = threading.active_count(), tasks(server)
        read = _storm(server, STORM, seed=1)
        assert read > 0
        assert_left_nothing(server, threads, num_tasks)
        aborted = metric_value(
            httpx.get(server.base_url + "/metrics").text,
            "poise:request_success_total",
            finished_reason="abort",
        )
        assert aborted >= STORM * 0.9, aborted  # the cut ones were aborted, not run to the end


def test_streams_whose_client_left_before_the_response_started_are_aborted(
    smol_tokenizer: Any,
) -> None:
    """A client that sends a streaming request and closes its connection at once is gone before
    its response starts (here: while the engine is in a slow step and has not admitted it).
    Starlette then cancels the response before its body is iterated, so nothing that closes the
    body ran: each such request used to be generated to its end. They are aborted now."""
    import socket

    server, executor = fake_server(smol_tokenizer, max_num_seqs=64)
    body = json.dumps(
        {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    busy = {"prompt": [9, 9], "max_tokens": 4, "ignore_eos": True}
    with server:
        executor.delay_s = 0.3  # slow steps: new requests wait for the engine to admit them
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                httpx.post, server.base_url + "/v1/completions", json=busy, timeout=30
            )
            wait(lambda: server.state.engine.core.scheduler.num_running == 1)
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", server.port)) as sock:
                    sock.sendall(head + body)
            assert running.result().status_code == 200
        executor.delay_s = 0.002  # 500 tokens each would take > 1 s from here
        wait(lambda: server.state.engine.num_in_flight == 0, timeout=30)
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        assert metric_value(text, "poise:request_success_total", finished_reason="abort") == 5
        assert metric_value(text, "poise:request_success_total", finished_reason="length") == 1
        assert server.state.engine.core.scheduler.kv_cache_usage == 0


@pytest.mark.slow
def test_a_large_disconnect_storm(smol_tokenizer: Any) -> None:
    server, _ = fake_server(smol_tokenizer, max_num_seqs=64)
    with server:
        _storm(server, 4)
        wait(lambda: server.state.engine.num_in_flight == 0)
        threads, num_tasks = threading.active_count(), tasks(server)
        for round_ in range(5):
            _storm(server, 400, seed=round_)
        assert_left_nothing(server, threads, num_tasks)


# ---- a drain: SIGTERM with requests in flight -------------------------------------------------


def test_sigterm_lets_requests_in_flight_finish_and_exits_0(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = [
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        "8MiB",
        "--shutdown-grace-period",
        "60",
    ]
    server = ServerProcess(args, tmp_path / "server.log").wait_ready()
    try:
        results: list[httpx.Response] = []

        def post(i: int) -> None:
            body = {"prompt": f"request {i}", "max_tokens": 300, "ignore_eos": True}
            results.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        wait(
            lambda: (
                metric_value(
                    httpx.get(server.base_url + "/metrics").text, "poise:num_requests_running"
                )
                == 3
            ),
            timeout=60,
        )
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # the listening socket is closed: no new requests
            httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"}, timeout=5)
        for t in threads:
            t.join(timeout=120)
        assert [r.status_code for r in results] == [200, 200, 200], [r.text for r in results]
        assert all(r.json()["usage"]["completion_tokens"] == 300 for r in results)
        assert server.proc.wait(timeout=60) == 0
        assert time.monotonic() - sent < 60
    finally:
        server.stop()


# ---- a slow client that stops reading its stream ------------------------------------------------


def test_clients_that_stop_reading_hold_no_engine_resources_and_bounded_memory(
    smol_tokenizer: Any,
) -> None:
    """10 streams of 300 tokens whose clients read the response head and then nothing: the
    engine finishes them all the same (KV free, nothing running), and what waits for the
    sockets is bounded by the tokens asked for (measured: the process's RSS)."""
    import socket

    server, executor = fake_server(smol_tokenizer, max_num_seqs=32)
    executor.delay_s = 0.0
    with server:
        wait(lambda: gauge(server, "poise:num_requests_running") == 0)
        rss = rss_bytes()
        socks = []
        body = json.dumps(
            {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
        ).encode()
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up early
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            assert s.recv(64).startswith(b"HTTP/1.1 200")
            socks.append(s)
        core = server.state.engine.core
        wait(lambda: gauge(server, "poise:num_requests_running") == 0, timeout=60)
        assert core.scheduler.kv_cache_usage == 0 and not core.has_unfinished_requests()
        held = rss_bytes() - rss
        for s in socks:
            s.close()
        wait(lambda: server.state.engine.num_in_flight == 0)
        # 3,000 tokens wait for their readers: a few hundred bytes each at most.
        assert held < 64 * 2**20, held
        print(f"10 stalled streams x 300 tokens: RSS +{held / 2**20:.1f} MiB while they wait")
        r = httpx.post(
            server.base_url + "/v1/completions",
            timeout=30,
            json={"prompt": [5], "max_tokens": 2, "ignore_eos": True},
        )
        assert r.status_code == 200


def test_a_request_reaching_admission_during_shutdown_gets_503(smol_tokenizer: Any) -> None:
    """Not 429: a draining server will not take it later either (the client should go
    elsewhere, and clients retry a 429 against the same server)."""
    server, _ = fake_server(smol_tokenizer)
    with server:
        server.state.engine.accepting = False  # what the first SIGTERM does
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_shutting_down"


def test_a_chat_template_error_fails_only_that_request(smol_tokenizer: Any) -> None:
    import copy

    tokenizer = copy.copy(smol_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom here') }}"
        "{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    )
    server, _ = fake_server(tokenizer)
    with server:
        url = server.base_url + "/v1/chat/completions"
        bad = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 2}
        good = {"messages": CHAT, "max_tokens": 2, "ignore_eos": True}
        for body in (bad, {**bad, "stream": True}):
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages" and "no boom here" in err["message"]
        r = httpx.post(url, json=good, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
