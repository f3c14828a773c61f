"""The engine's seam: observers given at build time, StepFailedError, the state snapshot, and
one decode rule that the scheduler's counts and the cost model share."""

from __future__ import annotations

import pytest

from poise.core import ModelRunnerOutput, SchedulerOutput
from poise.engine import EngineCore
from poise.engine.observer import EngineObserver, StepTimer
from poise.errors import StepFailedError
from poise.sim.cost import StepShape
from tests.unit.fake_executor import FakeExecutor
from tests.unit.test_scheduler import greedy, make_engine, run_all


class _Log(EngineObserver):
    def __init__(self, name: str, events: list[tuple[str, str, int]]) -> None:
        self.name, self.events = name, events

    def on_step_start(self, output: SchedulerOutput) -> None:
        self.events.append((self.name, "start", output.step_id))

    def on_step_end(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        self.events.append((self.name, "end", output.step_id))

    def on_step_failed(self, output: SchedulerOutput, error: BaseException) -> None:
        self.events.append((self.name, f"failed:{error}", output.step_id))


class _Failing(FakeExecutor):
    def __init__(self, fail_on_step: int) -> None:
        super().__init__()
        self.fail_on_step = fail_on_step

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.step_id == self.fail_on_step:
            raise RuntimeError("boom")
        return super().execute(scheduler_output)


def _engine_with(executor: FakeExecutor, observers: list[EngineObserver]) -> EngineCore:
    base, _ = make_engine(max_num_batched_tokens=16)
    return EngineCore(
        base.config,
        executor,
        num_kv_blocks=256,
        max_model_len=4096,
        vocab_size=1000,
        clock=base.clock,
        observers=observers,
    )


def test_observers_run_in_order_around_each_executed_step_and_change_nothing() -> None:
    events: list[tuple[str, str, int]] = []
    engine = _engine_with(FakeExecutor(), [_Log("a", events), _Log("b", events)])
    plain, _ = make_engine(max_num_batched_tokens=16)
    for e in (engine, plain):
        e.add_request("x", list(range(40)), greedy(3))
    assert run_all(engine) == run_all(plain)
    steps = sorted({step for _, _, step in events})
    assert len(steps) == 5  # 3 prefill chunks, then 2 decodes
    expected = [(n, what, s) for s in steps for what in ("start", "end") for n in ("a", "b")]
    assert sorted(events, key=lambda e: (e[2], e[1] != "start", e[0])) == expected
    assert [e[2] for e in events] == sorted(e[2] for e in events)


def test_a_failing_step_raises_with_the_ids_it_scheduled() -> None:
    events: list[tuple[str, str, int]] = []
    engine = _engine_with(_Failing(fail_on_step=2), [_Log("a", events)])
    engine.add_request("x", list(range(40)), greedy(3))
    engine.add_request("y", [1, 2, 3], greedy(3))
    engine.step()
    with pytest.raises(StepFailedError) as info:
        engine.step()
    err = info.value
    assert err.step_id == 2 and sorted(err.request_ids) == ["x"]
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == "boom"
    assert ("a", "failed:boom", 2) in events and ("a", "end", 2) not in events
    # The caller fails exactly those; the others go on, and no block leaks.
    deltas = engine.fail(err.request_ids, "step failed")
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("x", "error")]
    out = run_all(engine)
    assert len(out["y"]) == 3
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_snapshot_reports_counts_usage_and_preemption_totals() -> None:
    engine, _ = make_engine(num_kv_blocks=24, safety_margin=0.0, max_num_queued_requests=100)
    state = engine.snapshot()
    assert (state.num_running, state.num_waiting, state.kv_cache_usage) == (0, 0, 0.0)
    assert not state.queue_full
    for i in range(8):
        engine.add_request(str(i), [i + 1] * 20, greedy(30))
    assert engine.snapshot().num_waiting == 8
    preemptions = 0
    while engine.has_unfinished_requests():
        _, stats = engine.step()
        engine.clock.advance(0.01)  # type: ignore[attr-defined]
        preemptions += stats.num_preemptions if stats else 0
        state = engine.snapshot()
        assert state.num_running == engine.scheduler.num_running
        assert state.kv_cache_usage == engine.kv.usage
        assert state.num_preemptions == preemptions  # the engine's own total, per step stats
    assert preemptions > 0
    # Short prompts: all in the default chat set's first class.
    assert dict(state.preemptions_by_class) == {"interactive": preemptions}
    with pytest.raises(TypeError):
        state.preemptions_by_class["default"] = 0  # type: ignore[index]


def test_one_token_left_after_a_prefix_hit_is_a_decode_everywhere() -> None:
    """The metrics and the cost model once disagreed on exactly this chunk."""
    engine, executor = make_engine(enable_prefix_caching=True)
    shared = list(range(50, 90))  # 10 blocks of 4
    engine.add_request("a", shared + [1], greedy(1))
    run_all(engine)
    engine.add_request("b", shared + [1], greedy(2))  # all but its last token cached
    _, stats = engine.step()
    first = executor.steps[-1]
    (chunk,) = first.scheduled
    assert (chunk.start_position, chunk.num_tokens, chunk.sample) == (40, 1, True)
    assert chunk.is_decode
    assert (first.num_decode_tokens, first.num_prefill_tokens) == (1, 0)
    assert stats is not None and (stats.num_decode_tokens, stats.num_prefill_tokens) == (1, 0)
    assert stats.num_prefix_cache_hit_tokens == 40
    assert StepShape.from_output(first).num_decode_seqs == 1


def test_prefix_cache_hit_tokens_count_admissions_only() -> None:
    engine, _ = make_engine(enable_prefix_caching=True, max_num_batched_tokens=8)
    engine.add_request("a", list(range(20)), greedy(2))
    hits = []
    while engine.has_unfinished_requests():
        _, stats = engine.step()
        hits.append(stats.num_prefix_cache_hit_tokens if stats else 0)
    assert hits == [0] * len(hits)  # nothing cached yet
    engine.add_request("b", list(range(20)) + [7, 7], greedy(2))
    _, stats = engine.step()
    assert stats is not None and stats.num_prefix_cache_hit_tokens == 20
    _, stats = engine.step()
    assert stats is not None and stats.num_prefix_cache_hit_tokens == 0  # no new admission


def test_step_timer_times_the_execution_only() -> None:
    ticks = iter(range(100))
    timer = StepTimer(lambda: float(next(ticks)))
    engine = _engine_with(FakeExecutor(), [timer])
    engine.add_request("x", [1, 2, 3], greedy(2))
    run_all(engine)
    assert timer.durations == [1.0, 1.0]  # one tick before and one after each execute
