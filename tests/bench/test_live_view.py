"""``poise bench --live``: the server's live feed drawn in the terminal while the bench runs.

The view's text from fixed points; the feed followed from a real poise app (the deterministic
fake executor, slowed per step); a server without the feed; and the whole CLI with ``--live``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from poise.bench.live_view import FeedReader, render, sparkline


def _point(**over: Any) -> dict[str, Any]:
    point = {
        "t": 1.0,
        "running": 3,
        "waiting": 7,
        "kv_usage": 0.42,
        "token_budget": 512,
        "preemptions": 2,
        "prefix_cache_hit_rate": 0.25,
        "steps_per_s": 9.5,
        "prefill_tokens_per_s": 1200.0,
        "decode_tokens_per_s": 30.0,
        "prefill_requests_per_step": 0.5,
        "decode_requests_per_step": 3.0,
        "budget_utilisation": 0.8,
        "first_tokens": 4,
        "ttft_mean": 0.25,
        "ttft_max": 0.9,
        "ttft_parts_mean": {
            "ingress": 0.01,
            "queue": 0.14,
            "prefill_compute": 0.08,
            "first_token_sched": 0.02,
        },
        "slo_ttft_attainment": {"interactive": 0.93},
    }
    return point | over


def _text(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_the_view_shows_the_latest_point_and_the_history() -> None:
    reader = FeedReader("http://127.0.0.1:1")
    reader.config = {
        "model": "m",
        "dtype": "bfloat16",
        "device": "cpu",
        "engine_config": {"max_num_batched_tokens": 512, "max_num_seqs": 8},
    }
    reader.points.extend([_point(waiting=1, preemptions=1), _point()])
    text = _text(render(reader))
    assert "m · bfloat16 · cpu" in text and "max_num_batched_tokens=512" in text
    assert "3 / 7" in text and "42%" in text and "25%" in text  # running/waiting, KV, hits
    assert "prefill 1200, decode 30" in text and "used 80%" in text
    assert "3 in the last 2 s" in text  # preemptions summed over the window
    assert "mean 250 ms, max 900 ms (4 first tokens)" in text
    assert "queue 140 ms" in text and "prefill 80 ms" in text
    assert "SLO interactive" in text and "93%" in text
    quiet = _text(render(_with(reader, first_tokens=0)))
    assert "no first token this second" in quiet and "TTFT parts" not in quiet


def _with(reader: FeedReader, **over: Any) -> FeedReader:
    reader.points.append(_point(**over))
    return reader


def test_sparkline_scales_to_the_window_and_marks_gaps() -> None:
    assert sparkline([0.0, 1.0, 2.0, None, 4.0]) == "▁▃▅ █"
    assert sparkline([0.0, 0.0]) == "▁▁"


def test_a_server_without_a_feed_is_said_plainly(mock: Any) -> None:
    srv = mock()
    reader = FeedReader(srv.base_url)
    asyncio.run(reader.run())
    assert reader.unavailable is not None and "HTTP 404" in reader.unavailable
    assert "no live feed" in _text(render(reader))


def _poise_server(delay_s: float) -> Any:
    from transformers import AutoTokenizer

    from tests.serving.conftest import _cached_tokenizer_dir
    from tests.serving.test_observability import slow_server

    tok = AutoTokenizer.from_pretrained(str(_cached_tokenizer_dir()), local_files_only=True)
    return slow_server(tok, delay_s=delay_s)


def test_the_feed_is_followed_from_a_poise_server() -> None:
    import httpx

    with _poise_server(0.02) as server:

        async def follow() -> FeedReader:
            reader = FeedReader(server.base_url + "/v1")
            task = asyncio.create_task(reader.run())
            body = {"model": "fake", "prompt": [5, 6, 7, 8], "max_tokens": 40}
            async with httpx.AsyncClient(base_url=server.base_url) as client:
                for _ in range(3):  # keep it busy across at least two feed seconds
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                while len(reader.points) < 2:
                    await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return reader

        reader = asyncio.run(asyncio.wait_for(follow(), 30))
    assert reader.config is not None and reader.config["model"] == "fake"
    assert sum(p["decode_tokens_per_s"] for p in reader.points) > 0
    assert "running / waiting" in _text(render(reader))


def test_bench_cli_live_draws_the_server_view(tmp_path: Path, capsys: Any) -> None:
    from poise.cli import main

    out = tmp_path / "live.yaml"
    with _poise_server(0.05) as server:
        argv = [
            "bench",
            "--base-url",
            server.base_url,
            "--concurrency",
            "2",
            "--num-requests",
            "6",
            "--warmup",
            "0",
            "--max-tokens",
            "16",
            "--live",
            "-o",
            str(out),
        ]
        assert main(argv) == 0
    err = capsys.readouterr().err
    assert "running / waiting" in err and "decode" in err  # the server's view, drawn
    assert yaml.safe_load(out.read_text())["results"][0]["metrics"]["overall"]["num_ok"] == 6
