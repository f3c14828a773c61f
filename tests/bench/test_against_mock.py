"""Acceptance tests: the load client against a scripted SSE server with known timings.

Lower bounds are exact (a sleep never ends early); upper bounds are loose because the test
machine is shared. Script: first token at ttft, then k tokens every k*tpot (so TPOT = tpot).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from poise.bench.bench_config import BenchConfig
from poise.bench.record import ExperimentRecord
from poise.bench.runner import run_matrix

# TPOT large enough that sleep overshoot on a loaded machine (a few ms) stays small next to it.
TTFT, TPOT = 0.15, 0.04


def run(srv: Any, **kw: Any) -> ExperimentRecord:
    base = dict(
        base_url=srv.base_url,
        concurrency=(4,),
        max_tokens=17,
        num_requests=8,
        warmup=0,
        scrape_interval=0.2,
    )
    base.update(kw)
    return asyncio.run(run_matrix(BenchConfig(**base)))


def overall(rec: ExperimentRecord, i: int = 0) -> dict[str, Any]:
    return rec.cells[i].metrics["overall"]


@pytest.mark.parametrize("k", [1, 4])
def test_ttft_tpot_itl_match_script(mock: Any, k: int) -> None:
    srv = mock(ttft=TTFT, tpot=TPOT, k=k)
    rec = run(srv)
    ov = overall(rec)
    assert ov["num_ok"] == 8 and ov["n_out_sources"] == {"usage": 8}
    body = srv.state.bodies[-1]
    assert body["max_tokens"] == 17 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream"] and body["stream_options"]["include_usage"]
    assert TTFT * 1000 <= ov["ttft_ms"]["p50"] < TTFT * 1000 + 100
    assert TPOT * 1000 <= ov["tpot_ms"]["p50"] < TPOT * 1000 * 1.5
    assert TPOT * 1000 * 0.9 <= ov["itl_ms"]["p50"] < TPOT * 1000 * 1.5
    assert ov["itl_ms"]["n"] == 8 * 16  # one sample per token after the first
    assert ov["icl_ms"]["p50"] >= TPOT * 1000 * k  # raw chunk gaps do scale with k
    assert ov["tokens_per_event_mean"] == pytest.approx(17 / (1 + 16 / k))
    assert ov["itl_sources"] == {"event_usage": 8}  # the mock honours continuous usage


def test_tpot_does_not_change_with_tokens_per_chunk(mock: Any) -> None:
    one = overall(run(mock(ttft=TTFT, tpot=TPOT, k=1)))["tpot_ms"]["p50"]
    four = overall(run(mock(ttft=TTFT, tpot=TPOT, k=4)))["tpot_ms"]["p50"]
    assert 0.75 < four / one < 1.25  # counting chunks as tokens would give 0.25 or 4


def test_role_chunk_and_usage_chunk_do_not_move_ttft_or_e2e(mock: Any) -> None:
    rec = run(mock(ttft=TTFT, tpot=TPOT, k=4, role_chunk=True, usage_delay=0.3))
    ov = overall(rec)
    assert ov["ttft_ms"]["p50"] >= TTFT * 1000  # the role chunk at stream open is not a token
    e2e_script = (TTFT + 16 * TPOT) * 1000
    assert e2e_script <= ov["e2e_ms"]["p50"] < e2e_script + 300
    # The usage chunk left 300 ms after the last token; the client clocks both on arrival, so
    # a last token delivered a little late (a loaded machine) shortens the gap by that much.
    assert ov["e2e_stream_ms"]["p50"] >= ov["e2e_ms"]["p50"] + 290  # usage chunk came later
    assert ov["n_out_sources"] == {"usage": 8}


def test_strict_server_fallbacks_and_shortfall(mock: Any) -> None:
    srv = mock(ttft=0.01, tpot=0.001, strict=True, eos_at=5)
    rec = run(srv, concurrency=(2,), num_requests=4)
    caps = rec.capabilities
    assert caps["ok"] and not caps["ignore_eos"] and not caps["include_usage"]
    ov = overall(rec)
    assert ov["n_out_sources"] == {"events": 4}  # no usage: counted events, and said so
    assert ov["shortfall"]["num_short"] == 4
    assert all("ignore_eos" not in b for b in srv.state.bodies[-4:])


def test_server_metrics_on_the_same_timeline(mock: Any) -> None:
    rec = run(mock(ttft=TTFT, tpot=TPOT, k=4))
    cell = rec.cells[0]
    assert rec.experiment["engine"] == "poise"
    assert cell.server["preemptions"] == 8  # the mock counts one per request
    assert cell.server["kv_usage"]["peak"] > 0
    assert cell.server["running"]["max"] >= 1
    srv_ttft = cell.server["server_ttft_ms"]
    assert srv_ttft["n"] == 8 and 100 <= srv_ttft["p50"] <= 250  # inside the mock's bucket
    ts = cell.server_timeseries
    assert len(ts["t"]) >= 3 and len(ts["kv_usage"]) == len(ts["t"])
    tpl = cell.template()
    assert tpl["preemption_count"] == 8


def test_matrix_yaml_record_and_jsonl(mock: Any, tmp_path: Path) -> None:
    srv = mock(ttft=0.02, tpot=0.002, k=2)
    rec = run(srv, concurrency=(2, 4), long_ratio=(0.0, 0.5), warmup=2, slo_ttft_ms=500)
    assert [c.label for c in rec.cells] == ["c2-long0", "c2-long0.5", "c4-long0", "c4-long0.5"]
    path = rec.save(tmp_path / "r.yaml")
    back = ExperimentRecord.load(path)
    metrics = back.to_dict()["experiment"]["metrics"]
    assert len(metrics) == 4
    for m in metrics:
        for key in (
            "p50_ttft_ms",
            "p95_ttft_ms",
            "p50_tpot_ms",
            "p95_e2e_ms",
            "output_tokens_per_s",
        ):
            assert m[key] is not None and m[key] > 0
        assert m["kv_cache_usage"]["peak"] is not None and m["preemption_count"] is not None
    half = back.cells[1]
    assert set(half.metrics["classes"]) == {"short", "long"}
    assert half.metrics["classes"]["long"]["num_requests"] == 4
    assert sum(r.warmup for r in half.records) == 2 and len(half.records) == 10
    assert half.metrics["overall"]["goodput"]["slo_attainment"] == 1.0
    # The salt goes first in every prompt; cells get different salts; prompts otherwise seed's.
    prompts = [b["messages"][0]["content"] for b in srv.state.bodies[1:]]
    assert all(p.startswith("[") for p in prompts)
    assert len({p.split("]")[0] for p in prompts}) == 4
    lines = (tmp_path / "r.requests.jsonl").read_text().splitlines()
    assert len(lines) == 4 * 10 and "events" in json.loads(lines[0])
    assert back.provenance["tool_version"] and back.provenance["started_at"]


def test_open_loop_follows_schedule(mock: Any) -> None:
    rec = run(
        mock(ttft=0.01, tpot=0.001), concurrency=(), request_rate=(50.0,), num_requests=10, warmup=0
    )
    cell = rec.cells[0]
    assert cell.load["mode"] == "open" and cell.label == "r50-long0"
    from poise.workload import arrival_times

    sched = arrival_times(10, 50.0, 1.0, 0)
    intended = sorted(r.intended for r in cell.records if r.intended is not None)
    assert intended == pytest.approx(sched, abs=1e-6)
    assert all(r.start >= (r.intended or 0) for r in cell.records)


def test_timeouts_counted_and_optionally_infinite(mock: Any) -> None:
    rec = run(
        mock(ttft=1.0, tpot=0.01),
        concurrency=(2,),
        num_requests=2,
        timeout_s=0.3,
        include_failures=True,
    )
    ov = overall(rec)
    assert ov["num_timeouts"] == 2 and ov["num_ok"] == 0
    assert ov["ttft_ms"]["p50"] == math.inf
    assert ov["errors"] == {"timeout": 2}


def test_named_classes_and_duration(mock: Any) -> None:
    from poise.bench.bench_config import parse_class

    classes = (parse_class("chat:3:fixed/20:8", 16), parse_class("doc:1:seed-long:4", 16))
    rec = run(mock(ttft=0.01, tpot=0.002), classes=classes, num_requests=None, duration=0.5)
    cell = rec.cells[0]
    assert cell.label == "c4" and set(cell.metrics["classes"]) == {"chat", "doc"}
    chat = cell.metrics["classes"]["chat"]
    assert chat["output_tokens"] == 8 * chat["num_ok"]
    assert cell.metrics["window_s"] < 2.0


def test_run_cell_alone_for_sweeps(mock: Any) -> None:
    from poise.bench.bench_config import CellSpec
    from poise.bench.runner import run_cell

    srv = mock(ttft=0.01, tpot=0.001)
    cfg = BenchConfig(base_url=srv.base_url, max_tokens=5, num_requests=3, warmup=0, scrape=False)
    cell = asyncio.run(run_cell(cfg, CellSpec(concurrency=3, long_ratio=1.0)))
    assert cell.metrics["overall"]["num_ok"] == 3 and set(cell.metrics["classes"]) == {"long"}
    assert cell.server == {}  # not scraped: no invented server numbers


def test_stream_timer_edge_events() -> None:
    from poise.bench.client import StreamTimer
    from poise.bench.stats import RequestRecord

    rec = RequestRecord(0, "short", 0.0)
    timer = StreamTimer(rec)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    reasoning = {"choices": [{"delta": {"reasoning_content": "hmm"}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    for t, obj in enumerate([role, reasoning, usage], 1):
        timer.feed(b"data: " + json.dumps(obj).encode(), float(t))
    timer.feed(b": keep-alive comment", 4.0)
    timer.feed(b"data: [DONE]", 5.0)
    assert rec.events == [2.0] and rec.usage_completion_tokens == 2 and timer.done
    assert rec.usage_prompt_tokens == 3 and rec.ok
    timer.feed(b'data: {"error": {"message": "boom"}}', 6.0)
    assert not rec.ok and rec.error == "stream_error"


def test_duration_closed_loop_cycles_a_bounded_sample(mock: Any) -> None:
    from poise.bench import runner

    old = runner.CLOSED_LOOP_SAMPLE
    runner.CLOSED_LOOP_SAMPLE = 3  # force wrap-around within the short cell
    try:
        rec = run(
            mock(ttft=0.005, tpot=0.001),
            concurrency=(2,),
            max_tokens=3,
            num_requests=None,
            duration=0.6,
            warmup=1,
            long_ratio=(0.5,),
        )
    finally:
        runner.CLOSED_LOOP_SAMPLE = old
    cell = rec.cells[0]
    indices = sorted(r.index for r in cell.records)
    assert len(indices) > 4 and indices == list(range(len(indices)))  # renumbered, unique
    assert sum(r.warmup for r in cell.records) == 1
    assert rec.provenance["git_sha"] is None or len(rec.provenance["git_sha"]) == 40


def test_checkpoint_keeps_finished_cells_when_interrupted(mock: Any, tmp_path: Path) -> None:
    from poise.bench import runner

    srv = mock(ttft=0.005, tpot=0.001)
    real = runner.run_cell
    calls = []

    async def flaky(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user gives up during the second cell
        return await real(*args, **kw)

    cfg = BenchConfig(
        base_url=srv.base_url,
        concurrency=(1, 2),
        max_tokens=3,
        num_requests=2,
        warmup=0,
        scrape=False,
    )
    path = tmp_path / "partial.yaml"
    runner.run_cell = flaky  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(run_matrix(cfg, checkpoint=path))
    finally:
        runner.run_cell = real  # type: ignore[assignment]
    saved = ExperimentRecord.load(path)
    assert [c.label for c in saved.cells] == ["c1-long0"] and len(saved.cells[0].records) == 2
    assert saved.provenance["complete"] is False
    done = asyncio.run(run_matrix(cfg, checkpoint=path))
    assert (
        done.provenance["complete"] is True
        and ExperimentRecord.load(path).cells[1].label == "c2-long0"
    )


def test_unsalted_wire_prompts_are_the_seeds_bytes(mock: Any) -> None:
    from poise.workload import LONG_PROMPT, SHORT_PROMPT

    srv = mock(ttft=0.001, tpot=0.001)
    run(srv, concurrency=(2,), long_ratio=(0.5,), max_tokens=2, num_requests=4, salt=None)
    sent = [b["messages"][0]["content"] for b in srv.state.bodies[1:]]  # [0] is the probe
    assert sorted(set(sent)) == sorted({SHORT_PROMPT, LONG_PROMPT})
    assert sent.count(LONG_PROMPT) == 2
    assert all(b["temperature"] == 0.0 and b["stream"] is True for b in srv.state.bodies)
