"""Speculative decoding's counters on /metrics (vLLM's spec_decode_* names under poise:), on
the live feed, and absent when speculation is off (issue 34)."""

from __future__ import annotations

from poise.bench.prom import ADAPTERS, map_scrape, summarize_window
from poise.config import EngineConfig
from poise.core import SamplingParams
from poise.engine import EngineCore, VirtualClock
from poise.serving.live_page import LiveFeed
from poise.serving.metrics import ServingMetrics
from tests.serving.conftest import metric_value
from tests.unit.fake_executor import FakeExecutor

PERIOD = 5


class CyclingExecutor(FakeExecutor):
    """A model that repeats its context with period 5: prompt lookup guesses it exactly once
    the cycle has been seen, except where a draft would run past the context it saw."""

    def next_token(self, context: list[int]) -> int:
        return context[-PERIOD]


class HalfExecutor(FakeExecutor):
    """Repeats the cycle except at every 3rd position, where it says 0: drafts get cut."""

    def next_token(self, context: list[int]) -> int:
        return 0 if len(context) % 3 == 0 else context[-PERIOD]


def _engine(executor: FakeExecutor, spec: str | None) -> EngineCore:
    cfg = EngineConfig.from_kwargs(block_size=4, speculative_config=spec)
    return EngineCore(
        cfg, executor, num_kv_blocks=64, max_model_len=256, vocab_size=100, clock=VirtualClock()
    )


def _run(engine: EngineCore, n: int = 2) -> int:
    for i in range(n):
        engine.add_request(f"r{i}", [1, 2, 3, 4, 5] * 2, SamplingParams(max_tokens=40))
    tokens = 0
    while engine.has_unfinished_requests():
        deltas, _ = engine.step()
        tokens += sum(len(d.new_token_ids) for d in deltas)
    return tokens


def _scrape(engine: EngineCore) -> str:
    metrics = ServingMetrics("m")
    metrics.track_engine_state(engine.snapshot)
    return metrics.render().decode()


def _value(text: str, name: str, **labels: str) -> float:
    return metric_value(text, f"poise:{name}", model_name="m", **labels)


def test_counters_are_vllms_names_and_add_up() -> None:
    engine = _engine(
        HalfExecutor(vocab_size=100), '{"num_speculative_tokens": 4, "adaptive": false}'
    )
    assert _run(engine) == 80
    stats = engine.scheduler.spec.stats  # type: ignore[union-attr]
    text = _scrape(engine)
    drafts = _value(text, "spec_decode_num_drafts_total")
    drafted = _value(text, "spec_decode_num_draft_tokens_total")
    accepted = _value(text, "spec_decode_num_accepted_tokens_total")
    per_pos = [
        _value(text, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(4)
    ]
    assert (drafts, drafted, accepted) == (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    assert drafts > 0 and 0 < accepted < drafted <= 4 * drafts
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a later position needs all before it
    assert per_pos[0] <= drafts


def test_all_drafts_accepted_on_a_copying_model() -> None:
    engine = _engine(
        CyclingExecutor(vocab_size=100), '{"num_speculative_tokens": 4, "adaptive": false}'
    )
    _run(engine, n=1)
    text = _scrape(engine)
    drafted = _value(text, "spec_decode_num_draft_tokens_total")
    assert drafted > 0
    assert _value(text, "spec_decode_num_accepted_tokens_total") == drafted


def test_no_spec_series_without_speculation() -> None:
    engine = _engine(HalfExecutor(vocab_size=100), None)
    _run(engine)
    assert "spec_decode" not in _scrape(engine)


def test_live_feed_shows_acceptance_per_second() -> None:
    engine = _engine(
        HalfExecutor(vocab_size=100), '{"num_speculative_tokens": 4, "adaptive": false}'
    )
    feed = LiveFeed()
    feed.tick(0.0, engine.snapshot())
    _run(engine)
    feed.tick(2.0, engine.snapshot())
    stats = engine.scheduler.spec.stats  # type: ignore[union-attr]
    first, point = feed.points
    assert first["spec_acceptance_rate"] is None  # nothing drafted yet
    assert point["spec_draft_tokens_per_s"] == stats.num_draft_tokens / 2
    assert point["spec_acceptance_rate"] == stats.acceptance_rate
    off = _engine(HalfExecutor(vocab_size=100), None)
    feed.tick(4.0, off.snapshot())
    assert "spec_acceptance_rate" not in feed.points[-1]


def test_bench_record_summarises_the_window() -> None:
    engine = _engine(
        HalfExecutor(vocab_size=100), '{"num_speculative_tokens": 4, "adaptive": false}'
    )
    before = map_scrape(0.0, _scrape(engine), ADAPTERS["poise"])
    _run(engine)
    after = map_scrape(1.0, _scrape(engine), ADAPTERS["poise"])
    stats = engine.scheduler.spec.stats  # type: ignore[union-attr]
    spec = summarize_window([before, after], 0.0, 1.0)["spec_decode"]
    assert spec["num_drafts"] == stats.num_drafts > 0
    assert spec["num_accepted_tokens"] == stats.num_accepted_tokens
    assert spec["acceptance_rate"] == stats.acceptance_rate
    assert spec["mean_accepted_length"] == 1 + stats.num_accepted_tokens / stats.num_drafts
    off = map_scrape(0.0, _scrape(_engine(HalfExecutor(vocab_size=100), None)), ADAPTERS["poise"])
    assert summarize_window([off, off], 0.0, 1.0)["spec_decode"] is None
