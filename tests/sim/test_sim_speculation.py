"""Speculative decoding in the simulator: verify steps priced by the cost model, drafts kept at
the acceptance rate, the real scheduler's depth rule deciding (issue 34)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from poise.cli import main
from poise.config import EngineConfig
from poise.sim.cost import FixedCostModel
from poise.sim.simulator import SimCell, SimRequest, simulate_cell
from poise.sim.speculation import (
    acceptance_from_counters,
    accepted_drafts,
    draft_rate_from_counts,
    mean_accepted,
)

FIXED = '{"num_speculative_tokens": 4, "adaptive": false}'
ADAPTIVE = '{"num_speculative_tokens": 4}'
# A memory-bound decode: a step costs about the same for 1 or 5 tokens per row at low load.
COST = FixedCostModel(step_s=0.02, per_token_s=2e-4, vocab_size=1000, model_max_len=4096)


def _config(spec: str | None, **kw: object) -> EngineConfig:
    base: dict[str, object] = dict(
        max_num_seqs=64,
        max_num_batched_tokens=256,
        block_size=16,
        num_kv_blocks=4000,
        speculative_config=spec,
    )
    base.update(kw)
    return EngineConfig.from_kwargs(**base)


def _tpot(spec: str | None, concurrency: int, a: float) -> tuple[float, float]:
    """(TPOT p50, output tokens/s) of a closed loop at ``concurrency``."""
    cost = COST if spec is None else FixedCostModel(**{**COST.__dict__, "spec_acceptance_rate": a})
    reqs = [SimRequest(i, 64, 40) for i in range(4 * concurrency)]
    res = simulate_cell(_config(spec), cost, SimCell(reqs, concurrency=concurrency))
    assert all(r.ok and len(r.token_times) == 40 for r in res.requests)
    tpots = [(r.token_times[-1] - r.token_times[0]) / 39 for r in res.requests]
    return statistics.median(tpots), 40 * len(reqs) / res.duration_s


def test_every_draft_kept_at_rate_one() -> None:
    cost = FixedCostModel(step_s=0.01, vocab_size=100, spec_acceptance_rate=1.0)
    res = simulate_cell(_config(FIXED), cost, SimCell([SimRequest(0, 10, 21)], concurrency=1))
    (r,) = res.requests
    assert r.ok and len(r.token_times) == 21
    # A prefill step (token 1), then verify steps of 5 tokens each: 5 steps in all.
    assert res.num_steps == 5


def test_speculation_pays_at_low_load_and_adaptive_holds_throughput_at_high_load() -> None:
    off1, _ = _tpot(None, 1, 0.0)
    on1, _ = _tpot(FIXED, 1, 0.7)
    assert on1 < off1 / 2  # 1 + .7 + .49 + ... ~ 2.8 tokens per step of about the same cost
    _, off_rate = _tpot(None, 48, 0.0)
    _, fixed_rate = _tpot(FIXED, 48, 0.2)
    _, adaptive_rate = _tpot(ADAPTIVE, 48, 0.2)
    assert fixed_rate < 0.9 * off_rate  # full steps: drafts take budget decodes needed
    assert adaptive_rate >= 0.98 * off_rate
    # Alone, adaptive speculates as deep as fixed does.
    assert _tpot(ADAPTIVE, 1, 0.7)[0] == pytest.approx(on1, rel=0.05)


def test_acceptance_draws_and_their_inverse() -> None:
    rng = random.Random(0)
    kept = [accepted_drafts(rng, 0.6, 4) for _ in range(20000)]
    assert statistics.mean(kept) == pytest.approx(mean_accepted(0.6, 4), rel=0.03)
    assert acceptance_from_counters(1000, 1000 * mean_accepted(0.6, 4), 4) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        acceptance_from_counters(0, 0, 4)


def test_speculation_without_an_acceptance_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="^speculative_config: .*acceptance rate"):
        simulate_cell(_config(FIXED), COST, SimCell([SimRequest(0, 10, 5)], concurrency=1))


def _cli_tpot(tmp_path: Path, *extra: str) -> tuple[float, dict[str, Any]]:
    out = tmp_path / f"sim{len(extra)}.yaml"
    rc = main(
        [
            "simulate",
            "--accelerator",
            "a10",
            "--model-shape",
            "SmolLM2-135M-Instruct",
            "--concurrency",
            "1",
            "--max-tokens",
            "32",
            "--num-requests",
            "4",
            "--long-ratio",
            "0",
            "-o",
            str(out),
            *extra,
        ]
    )
    assert rc == 0
    rec = yaml.safe_load(out.read_text())
    return rec["results"][0]["metrics"]["overall"]["tpot_ms"]["p50"], rec


def test_simulate_cli_takes_serves_flag_and_an_acceptance_rate(tmp_path: Path) -> None:
    off, _ = _cli_tpot(tmp_path)
    on, rec = _cli_tpot(tmp_path, "--speculative-config", FIXED, "--spec-acceptance-rate", "0.9")
    assert on < off / 2  # a memory-bound GPU decode verifies 5 tokens for about the cost of 1
    assert rec["provenance"]["cost_model"]["spec_acceptance_rate"] == 0.9
    assert main(["simulate", "--accelerator", "a10", "--speculative-config", FIXED]) == 2


def test_draft_rate_scales_the_gain_and_is_read_from_counters() -> None:
    cost = FixedCostModel(**{**COST.__dict__, "spec_acceptance_rate": 0.7})
    reqs = [SimRequest(i, 64, 40) for i in range(4)]

    def duration(rate: float) -> float:
        model = FixedCostModel(**{**cost.__dict__, "spec_draft_rate": rate})
        return simulate_cell(_config(FIXED), model, SimCell(reqs, concurrency=1)).duration_s

    off = simulate_cell(_config(None), COST, SimCell(reqs, concurrency=1)).duration_s
    assert duration(0.0) == pytest.approx(off)  # no draft ever: speculation off
    assert duration(1.0) < duration(0.5) < off
    # 10 requests of 41 tokens: 10 from prefills, 31 decode steps each, 20 of them verified.
    assert draft_rate_from_counts(200, 100, 410, 10) == pytest.approx(200 / 300)
