"""The live page in a real headless browser: Debian's Chromium driven by Playwright.

The session fixture finds a system Chromium, installs Debian's package when missing (root with
apt-get), and skips, saying why, only where neither works. Playwright drives that binary
(``executable_path``); its own browser download is never used. The server is the real app
around the deterministic fake executor, slowed per step, under a ``poise bench`` run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.test_observability import slow_server

REPO = Path(__file__).resolve().parents[2]
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="session")
def chromium() -> str:
    path = _find_chromium()
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
            subprocess.run(cmd, env=env, capture_output=True, timeout=900, check=False)
        path = _find_chromium()
    if path is None:
        pytest.skip("no Chromium: none on PATH and Debian's package could not be installed")
    return path


@pytest.fixture()
def browser(chromium: str) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _bench(base_url: str, done: threading.Event) -> None:
    from poise.bench.bench_config import BenchConfig
    from poise.bench.runner import run_matrix

    cfg = BenchConfig(
        base_url=base_url + "/v1",
        concurrency=(4,),
        long_ratio=(0.0,),
        max_tokens=24,
        num_requests=60,
        warmup=0,
        scrape=False,
        timeout_s=60,
    )
    try:
        asyncio.run(run_matrix(cfg))
    finally:
        done.set()


def test_live_page_updates_under_bench_load_without_console_errors(
    browser: Any, smol_tokenizer: Any, tmp_path: Path
) -> None:
    errors: list[str] = []
    with slow_server(smol_tokenizer, delay_s=0.01, max_model_len=8192) as server:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.base_url + "/dashboard")
        page.wait_for_function("window.poiseDash && window.poiseDash.config !== null")
        assert page.text_content("#model") == "fake"
        assert "max_num_batched_tokens" in (page.text_content("#config-table") or "")
        done = threading.Event()
        load = threading.Thread(target=_bench, args=(server.base_url, done), daemon=True)
        load.start()
        page.wait_for_function(
            "window.poiseDash.points.some(p => p.first_tokens > 0)", timeout=30_000
        )
        draws = page.evaluate("window.poiseDash.draws")
        time.sleep(2.5)
        # Still drawing while the run goes on, with tokens and TTFT parts in its points.
        assert page.evaluate("window.poiseDash.draws") > draws
        busy = page.evaluate("window.poiseDash.points.filter(p => p.decode_tokens_per_s > 0)")
        assert busy and any(p["ttft_mean"] > 0 for p in busy)
        assert any(p["running"] > 0 for p in page.evaluate("window.poiseDash.points"))
        shot = Path(os.environ.get("POISE_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        done.wait(timeout=90)
        load.join(timeout=5)
        page.close()
    assert not errors, errors


def test_feed_sends_config_then_points(smol_tokenizer: Any) -> None:
    with slow_server(smol_tokenizer) as server:
        with httpx.stream("GET", server.base_url + "/dashboard/feed", timeout=10) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = []
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
                if events.count("point") >= 2:
                    break
        assert events[0] == "config" and events[1:3] == ["point", "point"]
        html = httpx.get(server.base_url + "/dashboard").text
        assert "<canvas" in html and "http" not in html.split("<script>")[1]  # nothing external
