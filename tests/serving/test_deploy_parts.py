"""The Ray-free parts of poise.deploy: the in-process ASGI call and the merged metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from poise.deploy import asgi_bridge
from poise.deploy.merged_metrics import exposition
from poise.router import ReplicaState, Router, RouterConfig, RouteRequest


def _app(events: list[str]) -> Starlette:
    async def stream(request: Request) -> StreamingResponse:
        body = await request.json()

        async def gen() -> AsyncIterator[bytes]:
            try:
                for i in range(body["n"]):
                    yield f"chunk{i};".encode()
                    await asyncio.sleep(0.01)
            finally:
                events.append("closed")

        return StreamingResponse(gen(), headers={"x-test": "1"})

    return Starlette(routes=[Route("/s", stream, methods=["POST"])])


def test_call_streams_start_then_chunks() -> None:
    events: list[str] = []

    async def go() -> list[object]:
        return [item async for item in asgi_bridge.call(_app(events), "POST", "/s", b'{"n": 3}')]

    items = asyncio.run(go())
    start = items[0]
    assert isinstance(start, dict) and start["status"] == 200
    assert ("x-test", "1") in start["headers"]
    assert b"".join(i for i in items[1:] if isinstance(i, bytes)) == b"chunk0;chunk1;chunk2;"


def test_leaving_early_ends_the_apps_stream() -> None:
    events: list[str] = []

    async def go() -> None:
        gen = asgi_bridge.call(_app(events), "POST", "/s", b'{"n": 1000}')
        await gen.__anext__()  # start
        await gen.__anext__()  # first chunk
        await gen.aclose()  # the client left

    asyncio.run(go())
    assert events == ["closed"]


def test_metrics_carry_each_replica_and_the_router() -> None:
    router = Router(
        [ReplicaState("engine-0"), ReplicaState("engine-1")], RouterConfig(policy="prefix_affinity")
    )
    router.route(RouteRequest("a", list(range(40)), 4))
    router.route(RouteRequest("b", list(range(40)), 4))
    text = 'poise:num_requests_running{model_name="m"} 2.0\n'
    texts = {
        "engine-0": "# TYPE poise:num_requests_running gauge\n" + text,
        "engine-1": "# TYPE poise:num_requests_running gauge\n" + text.replace("2.0", "5.0"),
    }
    out = exposition(texts, router).decode()
    assert 'poise:num_requests_running{model_name="m",replica="engine-0"} 2.0' in out
    assert 'poise:num_requests_running{model_name="m",replica="engine-1"} 5.0' in out
    assert 'poise_router_decisions_total{policy="prefix_affinity",reason="affinity_hit"} 1.0' in out
    assert "poise_router_prefix_affinity_hit_rate 0.5" in out
    assert 'poise_router_in_flight{replica="engine-0"} 2.0' in out


def test_bench_reads_the_replica_count_and_averages_kv_usage_over_replicas() -> None:
    from poise.bench.prom import ADAPTERS, map_scrape

    router = Router([ReplicaState("engine-0"), ReplicaState("engine-1")])
    gauge = '# TYPE poise:kv_cache_usage_perc gauge\npoise:kv_cache_usage_perc{model_name="m"} '
    texts = {"engine-0": gauge + "0.2\n", "engine-1": gauge + "0.6\n"}
    scrape = map_scrape(0.0, exposition(texts, router).decode(), ADAPTERS["poise"])
    assert scrape.replicas == 2
    assert scrape.kv_usage == pytest.approx(0.4)


def test_the_router_hears_of_output_at_the_first_token_not_the_role_chunk() -> None:
    from poise.deploy.ingress import carries_output

    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    token = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    done = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
    answer = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}]}'
    assert not carries_output(role)
    assert not carries_output(b": keep-alive\n\n")
    assert carries_output(token) and carries_output(done) and carries_output(answer)
    assert carries_output(role + token)  # two events in one chunk
