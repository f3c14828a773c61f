"""Step traces (poise.sim.trace): a traced engine decides exactly as an untraced one, every step
is written with its shape and duration, and a cost model can be scored against the trace.
The live server's ``--step-trace`` is tested in tests/serving/test_live.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from poise.config import EngineConfig
from poise.engine.clock import VirtualClock
from poise.engine.core import EngineCore
from poise.sim.cost import FixedCostModel
from poise.sim.executor import DecisionRecorder, SimExecutor
from poise.sim.simulator import SimCell, SimRequest, drive, simulate_cell
from poise.sim.trace import (
    StepTracer,
    StepTraceWriter,
    in_window,
    predicted_vs_measured,
    read_trace,
)

COST = FixedCostModel(step_s=0.01, per_token_s=0.001, vocab_size=100, model_max_len=256)


def _cell() -> SimCell:
    reqs = [SimRequest(i, 10 + (i * 7) % 30, 4 + i % 5, prompt_key=f"p{i}") for i in range(9)]
    return SimCell(reqs, concurrency=3)


def _config() -> EngineConfig:
    return EngineConfig.from_kwargs(
        model="none", num_kv_blocks=64, block_size=4, max_num_batched_tokens=24, max_num_seqs=3
    )


def _traced_run(path: Path) -> DecisionRecorder:
    clock = VirtualClock(0.0)
    recorder = DecisionRecorder()
    writer = StepTraceWriter(path, source="test")
    tracer = StepTracer(writer, clock=clock.now, cpu_clock=None)
    engine = EngineCore(
        _config(),
        SimExecutor(COST, clock),
        num_kv_blocks=64,
        max_model_len=256,
        vocab_size=100,
        eos_token_ids=(),
        observers=[recorder, tracer],
    )
    drive(engine, clock, _cell())
    writer.close()
    return recorder


def test_trace_has_every_step_and_does_not_change_decisions(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    recorder = _traced_run(path)
    untraced = simulate_cell(_config(), COST, _cell(), record_decisions=True)
    assert recorder.decisions == untraced.decisions

    header, steps = read_trace(path)
    assert header["source"] == "test" and header["clock_origin_s"] == 0.0
    assert len(steps) == len(recorder.decisions) > 10
    for step, decision in zip(steps, recorder.decisions, strict=True):
        assert step.shape.num_tokens == sum(n for _, _, n in decision.scheduled)
        assert step.shape.num_seqs == len(decision.scheduled)
        # The virtual clock moved by exactly the modelled time of that shape.
        assert step.wall_s == pytest.approx(COST.step_time(step.shape), abs=1e-6)
        assert step.cpu_s is None
    assert [s.start_s for s in steps] == sorted(s.start_s for s in steps)


def test_predicted_vs_measured_scores_a_model(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    _traced_run(path)
    _, steps = read_trace(path)
    same = predicted_vs_measured(COST, steps)
    assert same.ratio == pytest.approx(1.0, rel=1e-4)
    assert same.cpu_ratio is None
    half = FixedCostModel(step_s=0.005, per_token_s=0.0005, vocab_size=100, model_max_len=256)
    assert predicted_vs_measured(half, steps).ratio == pytest.approx(2.0, rel=1e-4)
    mid = steps[len(steps) // 2].start_s
    first, second = in_window(steps, 0.0, mid), in_window(steps, mid, float("inf"))
    assert len(first) + len(second) == len(steps) and first and second


def test_read_trace_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"kind": "something-else"}\n')
    with pytest.raises(ValueError, match="poise-step-trace"):
        read_trace(bad)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_trace(empty)
