"""Simulator parity: the same closed-loop workload through the real model runner (tiny random
Llama, ignore_eos) and through the simulator with a fixed cost yields the identical sequence of
scheduler decisions: per step, which requests run from which position with how many tokens,
and which are preempted. Also: `poise profile`'s measuring code runs on the real runner."""

from __future__ import annotations

from pathlib import Path

import pytest

from poise.config import EngineConfig
from poise.engine.clock import VirtualClock
from poise.engine.core import EngineCore
from poise.sim.cost import FixedCostModel, StepShape
from poise.sim.executor import DecisionRecorder
from poise.sim.simulator import SimCell, SimRequest, drive, simulate_cell

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("sim_tiny"))


def _cell() -> SimCell:
    reqs = [
        SimRequest(i, 9 + (i * 7) % 40, 6 + (i * 5) % 11, prompt_key=f"p{i % 3}-{i}")
        for i in range(14)
    ]
    return SimCell(reqs, concurrency=5)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_real_runner_and_simulator_decide_identically(tiny_dir: Path, policy: str) -> None:
    from poise.runner.factory import create_model_runner

    torch.set_num_threads(1)
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_dir),
        dtype="float32",
        num_kv_blocks=22,  # 88 tokens for 5 streams: forces preemptions
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=5,
        scheduling_policy=policy,
    )
    runner, info = create_model_runner(cfg)
    clock = VirtualClock()
    real = DecisionRecorder()
    engine = EngineCore.for_model(cfg, runner, info, clock=clock, observers=[real])
    real_results, _, _ = drive(engine, clock, _cell())

    cost = FixedCostModel(
        step_s=0.01,
        vocab_size=info.vocab_size,
        model_max_len=info.max_model_len,
        eos_token_ids=tuple(info.eos_token_ids),
    )
    sim = simulate_cell(cfg, cost, _cell(), record_decisions=True)

    assert len(real.decisions) > 20
    assert sim.decisions == real.decisions
    assert any(d.preempted for d in real.decisions), "the pool should force preemptions"
    assert [r.finish_reason for r in sim.requests] == [r.finish_reason for r in real_results]
    assert [len(r.token_times) for r in sim.requests] == [r.max_tokens for r in sim.requests]


def test_profiling_grid_runs_on_the_real_runner(tiny_dir: Path) -> None:
    from poise.engine.overhead import measure_engine_overhead
    from poise.runner.factory import create_model_runner
    from poise.runner.profiling import build_grid, measure_grid

    torch.set_num_threads(1)
    cfg = EngineConfig.from_kwargs(model=str(tiny_dir), dtype="float32", num_kv_blocks=64)
    runner, info = create_model_runner(cfg)
    points = build_grid(
        "quick", max_tokens=256, max_seqs=64, capacity_tokens=64 * 16, max_len=info.max_model_len
    )
    assert points and all(p.prefill + p.batch <= 256 for p in points)
    measured = measure_grid(
        runner.execute, points, block_size=16, num_blocks=64, warmup=0, repeats=1
    )
    assert len(measured) == len(points)
    for out, t in measured:
        shape = StepShape.from_output(out)
        assert t > 0 and shape.num_tokens == out.num_prefill_tokens + out.num_decode_tokens
        assert all(max(sr.block_ids) < 64 for sr in out.scheduled)
    # Shared-prefix points exist, and their decodes really share blocks.
    shared = [StepShape.from_output(o) for o, _ in measured if o.scheduled[0].request_id == "d0"]
    assert any(s.decode_unique_ctx_tokens < s.decode_ctx_tokens for s in shared)
    # Bursts of prefix-cache hits: several chunks after cached tokens in one step.
    bursts = [o for o, _ in measured if sum(len(r.token_ids) > 1 for r in o.scheduled) > 1]
    assert bursts and all(r.start_position > 0 for r in bursts[0].scheduled if r.token_ids[1:])
    # ...which end their prompts, so they sample, as a new wave's hits do on the server.
    assert all(r.sample for o in bursts for r in o.scheduled)
    # A long prompt's later chunk (alone, after its first chunk) does not sample.
    later = [o.scheduled[0] for o, _ in measured if len(o.scheduled) == 1]
    assert any(s.start_position > 0 and len(s.token_ids) > 1 and not s.sample for s in later)
    # A lone short chunk after a cached block (a chat prompt whose system prompt is cached).
    lone = [o.scheduled for o, _ in measured if len(o.scheduled) == 1]
    assert any(0 < s[0].start_position <= 32 and len(s[0].token_ids) > 1 for s in lone)
    assert measure_engine_overhead(cfg, runner, info, num_requests=3, max_tokens=3) >= 0
