"""Load (issue 16, item 4): overload at 10x capacity, open loop, and a soak at saturation.

The default suite runs both against the app, AsyncEngine and SmolLM2 tokenizer around the fake
executor in this process (fake_engine_server.py), the overload for 0.5 s; ``-m slow`` runs the
overload as ``benchmarks/overload.py`` against a real ``poise serve`` on the embedded model with
the client in its own process (an in-process client at 400 requests/s shares the server's GIL:
it sent 8,000 requests in 55 s instead of 20 and measured itself), and the soak.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from poise.engine.core import EngineCore
from poise.serving.settings import ServerSettings
from tests.serving.conftest import InProcessServer
from tests.serving.fake_engine_server import assert_left_nothing, fake_server, rss_bytes

ROOT = Path(__file__).resolve().parents[2]


# ---- overload: 10x capacity, open loop --------------------------------------------------------

TTFT_TARGET_MS = 400.0
MARGIN = 0.25


def _overload(
    server: InProcessServer, rate: float, seconds: float
) -> tuple[list[int], list[float], list[str]]:
    """Open loop: a stream every 1/rate s for ``seconds``, whatever the answers; returns the
    statuses, the TTFTs (s) of those served and the Retry-After headers of those refused."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float | None, str | None]:
        body = {
            "prompt": [5, 6, i % 500 + 10],
            "max_tokens": 20,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.monotonic()
        try:
            async with client.stream("POST", server.base_url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, None, r.headers.get("retry-after")
                ttft = None
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data: {"):
                        ttft = time.monotonic() - sent
                return 200, ttft, None
        except httpx.TransportError:
            return 0, None, None  # no answer at all: the test fails on it

    async def run() -> list[tuple[int, float | None, str | None]]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as c:
            tasks = []
            start = time.monotonic()
            for i in range(int(rate * seconds)):
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                tasks.append(asyncio.create_task(one(c, i)))
            return list(await asyncio.gather(*tasks))

    results = asyncio.run(run())
    return (
        [s for s, _, _ in results],
        [t for _, t, _ in results if t is not None],
        [h for _, _, h in results if h is not None],
    )


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def test_overload_at_ten_times_capacity_is_refused_with_retry_after(smol_tokenizer: Any) -> None:
    """Capacity: 8 slots x 20 steps of ~10 ms = ~40 requests/s; offered: 400/s, open loop.
    Predictive admission (a 400 ms TTFT target, margin 0.25, the step-cost prior an operator
    gives with --profile) refuses the excess with 429 + Retry-After; the engine's TTFT of the
    accepted stays near the bound (docs/reliability.md has the measured figures)."""
    classes = f"chat:ttft_p95_ms={TTFT_TARGET_MS:g}"
    # Connections beyond the cap would be refused with 503 (a limit of its own, tested
    # elsewhere); this measures admission alone.
    server, executor = fake_server(
        smol_tokenizer,
        ServerSettings(max_connections=20_000),
        max_num_seqs=8,
        traffic_classes=classes,
        admission_control="predictive",
        admission_margin=MARGIN,
        step_cost_const_s=0.012,
        step_cost_per_token_s=1e-5,
    )
    executor.delay_s = 0.01
    core = server.state.engine.core
    first_tokens = _record_first_tokens(core)
    rss = rss_bytes()
    with server:
        start = time.monotonic()
        codes, ttfts, retry_after = _overload(server, rate=400, seconds=0.5)
        offered_s = time.monotonic() - start
        kv_left = core.scheduler.kv_cache_usage
    grown = rss_bytes() - rss
    # The engine's TTFT of every accepted request: arrival (the handler's first line) to the
    # end of the step that sampled its first token, on the engine clock (what the histogram
    # counts, exactly instead of by bucket).
    engine_ttfts = [
        t.first_token - t.arrival for t in first_tokens.values() if t.first_token is not None
    ]
    assert len(engine_ttfts) == codes.count(200)
    engine_p95 = _p95(engine_ttfts)
    assert set(codes) <= {200, 429}, sorted(set(codes))
    # The excess is refused and the engine serves the rest. (How many of each depends on how
    # fast this client really sends on a busy machine: the open loop may fall behind.)
    assert codes.count(429) >= 1 and codes.count(200) >= 10 and kv_left == 0, codes
    assert all(int(h) >= 1 for h in retry_after) and len(retry_after) == codes.count(429)
    bound = TTFT_TARGET_MS / 1000 * (1 + MARGIN)
    print(
        f"overload 0.5 s at 400/s (sent in {offered_s:.1f} s): {codes.count(200)} "
        f"served, {codes.count(429)} refused, engine TTFT p95 {engine_p95 * 1000:.0f} ms "
        f"(bound {bound * 1000:.0f}), client TTFT p95 {_p95(ttfts) * 1000:.0f} ms, "
        f"RSS +{grown / 2**20:.0f} MiB"
    )
    # The client shares this process and its GIL with the server, so this is a check that
    # admission works, not a measurement of the bound (test_overload_against_a_real_server is):
    # 419-462 ms against 500 in three quiet runs; 2x the bound still fails an admission that
    # does not work (admitting everything, the p95 would wait ~4.5 s for the 200 ahead of it).
    assert engine_p95 <= 2 * bound, (engine_p95, bound)
    assert grown < 200 * 2**20, grown  # memory bounded: the refused cost nothing lasting


def _record_first_tokens(core: EngineCore) -> dict[str, Any]:
    """Request id -> RequestTimes of every request the engine produced a token for, as the
    engine steps (a test probe around ``core.step``)."""
    seen: dict[str, Any] = {}
    step = core.step

    def recording_step() -> Any:
        deltas, stats = step()
        for d in deltas:
            if d.times is not None:
                seen.setdefault(d.request_id, d.times)
        return deltas, stats

    core.step = recording_step  # type: ignore[method-assign]
    return seen


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_overload_against_a_real_server(tmp_path: Path) -> None:
    """``benchmarks/overload.py`` as run for the figures in docs/reliability.md: the embedded
    SmolLM2-135M behind ``poise serve`` (8 slots, one class with a 1 s TTFT target, margin
    0.25), capacity measured, then 10x that offered open loop for 20 s. The accepted requests'
    engine TTFT p95 within the bound, every other request a 429 with Retry-After, at least half
    of what the engine can serve accepted, and the server's memory bounded."""
    out = tmp_path / "overload.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overload.py"), "--json", str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=840,
    )
    result = json.loads(out.read_text())
    over, bound = result["overload"], result["bound_s"]
    p95 = over["engine_ttft_s"]["95"]
    print(
        f"overload against poise serve: {over['accepted']} accepted, {over['refused_429']} "
        f"refused, engine TTFT p95 {p95 * 1000:.0f} ms (bound {bound * 1000:.0f})"
    )
    assert set(over["statuses"]) == {"200", "429"}, over["statuses"]
    assert over["refused_with_retry_after"] == over["refused_429"]
    assert over["num_engine_ttft"] == over["accepted"]
    assert over["accepted"] >= 0.5 * result["capacity_rps"] * over["send_span_s"]
    assert p95 <= bound, (p95, bound)
    rss = result["rss_mib"]
    assert rss["max_sampled"] - rss["before"] < 200, rss


# ---- a soak at saturation -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_a_soak_at_saturation(smol_tokenizer: Any) -> None:
    """POISE_SOAK_S seconds (default 120) of 24 closed-loop clients against 8 sequence slots
    and a bounded queue: streams and plain requests of random lengths, a tenth cut mid-stream.
    No 5xx, no RSS growth trend after the warm-up, and at the end no block, task or thread
    left."""
    duration = float(os.environ.get("POISE_SOAK_S", "120"))
    server, executor = fake_server(smol_tokenizer, max_num_seqs=8, max_num_queued_requests=8)
    executor.delay_s = 0.003
    statuses: dict[int, int] = {}
    samples: list[tuple[float, int]] = []

    async def client(c: httpx.AsyncClient, seed: int, end: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            body = {
                "prompt": [rng.randrange(10, 40000) for _ in range(rng.randint(1, 60))],
                "max_tokens": rng.randint(1, 80),
                "stream": rng.random() < 0.5,
            }
            url = server.base_url + "/v1/completions"
            if body["stream"]:
                async with c.stream("POST", url, json=body) as r:
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    cut = rng.random() < 0.1
                    async for _ in r.aiter_lines():
                        if cut:
                            break
            else:
                r = await c.post(url, json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if statuses.get(429):
                await asyncio.sleep(0.05)

    async def sample(end: float) -> None:
        while time.monotonic() < end:
            samples.append((time.monotonic(), rss_bytes()))
            await asyncio.sleep(2.0)

    async def run() -> None:
        end = time.monotonic() + duration
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            await asyncio.gather(sample(end), *(client(c, i, end) for i in range(24)))

    with server:
        threads = threading.active_count()
        asyncio.run(run())
        assert_left_nothing(server, threads + 1, 10**6)
    assert set(statuses) <= {200, 429}, statuses
    warm = [rss for t, rss in samples if t >= samples[0][0] + min(30.0, duration / 4)]
    half = len(warm) // 2
    first, second = sum(warm[:half]) / half, sum(warm[half:]) / (len(warm) - half)
    quarters = [warm[i * len(warm) // 4 : (i + 1) * len(warm) // 4] for i in range(4)]
    trend = " -> ".join(f"{sum(q) / len(q) / 2**20:.0f}" for q in quarters if q)
    print(
        f"soak {duration:g} s: {statuses}, RSS {first / 2**20:.0f} -> {second / 2**20:.0f} MiB"
        f" (quarters after warm-up: {trend} MiB)"
    )
    assert second - first < 32 * 2**20, (first, second)  # no growth trend between the halves
