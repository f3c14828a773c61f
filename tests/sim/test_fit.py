"""The profile fit recovers known step-cost coefficients from synthetic measurements."""

from __future__ import annotations

import random

import pytest

from poise.config import EngineConfig
from poise.sim.cost import FEATURES, StepShape
from poise.sim.fit import (
    fit_step_costs,
    fit_with_knee,
    least_squares,
    load_profile,
    merge_profiles,
    profile_arrival,
    profile_record,
    save_profile,
    solve,
)

TRUE = {
    "const": 0.004,
    "tokens": 2.5e-4,
    "seqs": 3e-4,
    "sampled": 6e-5,
    "prefill_attn": 2e-8,
    "decode_ctx": 4e-7,
    "decode_unique_ctx": 1.5e-7,
    "decode_padded": 1e-7,
    "decode_padded_excess": 0.0,
    "prefill_chunks": 2e-3,
}


def _grid() -> list[StepShape]:
    """Prefill chunks, decode batches and mixed steps, as `poise profile` measures them."""
    shapes = []
    for prefill in (0, 16, 64, 256, 1024):
        for batch in (0, 1, 4, 16, 32):
            for ctx in (32, 256, 1024, -1):  # -1: one request at 2048, the others at 32
                if prefill == 0 and batch == 0:
                    continue
                longest = 2048 if ctx < 0 else ctx
                total = (batch - 1) * 33 + 2049 if ctx < 0 and batch else batch * (ctx + 1)
                ctx = max(ctx, 32)
                start = ctx if prefill and batch % 2 else 0
                pairs = prefill * start + prefill * (prefill + 1) // 2 if prefill else 0
                # Decodes with distinct contexts, and (long contexts) sharing one prefix.
                uniques = [total] + ([longest + 16 * batch] if ctx >= 256 and batch >= 4 else [])
                shapes += [
                    StepShape(
                        num_tokens=prefill + batch,
                        num_seqs=batch + (1 if prefill else 0),
                        num_sampled=batch + (1 if prefill and start == 0 else 0),
                        num_prefill_tokens=prefill,
                        num_decode_seqs=batch,
                        prefill_attn_pairs=pairs,
                        decode_ctx_tokens=total,
                        kv_tokens=total + start + prefill,
                        decode_max_ctx=longest + 1 if batch else 0,
                        decode_unique_ctx_tokens=unique,
                    )
                    for unique in uniques
                ]
    # Bursts of prefix-cache hits beside decodes: k short chunks after 48 cached tokens.
    for k in (2, 4, 8, 24):
        for batch in (4, 16):
            ctx = batch * 257 + k * 16 * 56
            shapes.append(
                StepShape(
                    num_tokens=16 * k + batch,
                    num_seqs=k + batch,
                    num_sampled=batch + (k if batch == 4 else 0),
                    num_prefill_tokens=16 * k,
                    num_decode_seqs=batch,
                    decode_ctx_tokens=ctx,
                    kv_tokens=ctx,
                    decode_max_ctx=257,
                    decode_unique_ctx_tokens=ctx,
                )
            )
    return shapes


def _truth(s: StepShape) -> float:
    return sum(TRUE[f] * x for f, x in zip(FEATURES, s.features(), strict=True))


def test_solve_small_system() -> None:
    x = solve([[2.0, 1.0], [1.0, 3.0]], [5.0, 10.0])
    assert x == pytest.approx([1.0, 3.0])


def test_least_squares_exact_line() -> None:
    rows = [[1.0, float(i)] for i in range(10)]
    y = [3.0 + 0.5 * i for i in range(10)]
    assert least_squares(rows, y) == pytest.approx([3.0, 0.5])


def test_fit_recovers_exact_coefficients() -> None:
    samples = [(s, _truth(s)) for s in _grid()]
    coef, q = fit_step_costs(samples)
    for f in FEATURES:
        assert coef[f] == pytest.approx(TRUE[f], rel=1e-6), f
    assert q.max_rel_error < 1e-6
    assert q.r2 > 0.999999


def test_fit_recovers_coefficients_under_noise() -> None:
    rng = random.Random(7)
    samples = [(s, _truth(s) * (1 + rng.gauss(0, 0.02))) for s in _grid() for _ in range(3)]
    coef, q = fit_step_costs(samples)
    # The big terms are well determined; small ones within a looser band.
    assert coef["const"] == pytest.approx(TRUE["const"], rel=0.05)
    assert coef["tokens"] == pytest.approx(TRUE["tokens"], rel=0.05)
    # seqs and sampled move together in most steps; their sum is what is determined.
    both = coef["seqs"] + coef["sampled"]
    assert both == pytest.approx(TRUE["seqs"] + TRUE["sampled"], rel=0.15)
    assert coef["decode_padded"] == pytest.approx(TRUE["decode_padded"], rel=0.2)
    assert coef["prefill_attn"] == pytest.approx(TRUE["prefill_attn"], rel=0.15)
    # Arithmetic (every context token) and traffic (shared blocks once) come apart.
    assert coef["decode_ctx"] == pytest.approx(TRUE["decode_ctx"], rel=0.15)
    assert coef["decode_unique_ctx"] == pytest.approx(TRUE["decode_unique_ctx"], rel=0.3)
    # A chunk's own cost, apart from its tokens and its request: the bursts pin it.
    assert coef["prefill_chunks"] == pytest.approx(TRUE["prefill_chunks"], rel=0.15)
    assert q.mape < 0.03


def test_fit_finds_the_knee_of_big_decode_gathers() -> None:
    def truth(s: StepShape) -> float:
        padded = s.num_decode_seqs * s.decode_max_ctx
        return _truth(s) + 6e-7 * max(0, padded - 16384)

    samples = [(s, truth(s)) for s in _grid()]
    coef, q, knee = fit_with_knee(samples)
    assert knee == 16384
    assert coef["decode_padded_excess"] == pytest.approx(6e-7, rel=1e-4)
    assert q.max_rel_error < 1e-4
    # Without the knee the same data fits worse.
    _, q_linear = fit_step_costs(samples)
    assert q_linear.mape > 10 * q.mape


def test_fit_never_returns_negative_coefficients() -> None:
    # Time does not depend on seqs at all, and noise would push its slope below zero.
    rng = random.Random(1)
    samples = []
    for s in _grid():
        t = 0.01 + 1e-4 * s.num_tokens - 1e-6 * s.num_seqs
        samples.append((s, t * (1 + rng.gauss(0, 0.01))))
    coef, _ = fit_step_costs(samples)
    assert all(v >= 0 for v in coef.values())
    assert coef["tokens"] == pytest.approx(1e-4, rel=0.05)


def test_profile_file_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    samples = [(s, _truth(s)) for s in _grid()]
    coef, q = fit_step_costs(samples)
    rec = profile_record(
        model="tiny",
        coefficients=coef,
        fit=q,
        samples=samples,
        vocab_size=1000,
        max_model_len=2048,
        kv_bytes_per_token=4096,
        eos_token_ids=[2],
        kv_budget_bytes=1 << 24,
        provenance={"host": "test"},
    )
    path = save_profile(rec, tmp_path / "p.json")
    model = load_profile(path)
    for s in _grid():
        assert model.step_time(s) == pytest.approx(_truth(s), rel=1e-6)
    assert profile_arrival(path, request_overhead_s=0.003).request_overhead_s == 0.003
    assert profile_arrival(path).request_overhead_s == 0.0
    config = EngineConfig.from_kwargs(block_size=16)
    assert model.num_kv_blocks(config) == (1 << 24) // (16 * 4096)
    assert model.max_model_len(EngineConfig.from_kwargs(max_model_len=4096)) == 2048
    assert model.eos_token_ids == (2,)


def _record(samples: list[tuple[StepShape, float]], created: str) -> dict[str, object]:
    coef, q = fit_step_costs(samples)
    return profile_record(
        model="tiny",
        coefficients=coef,
        fit=q,
        samples=samples,
        vocab_size=1000,
        max_model_len=2048,
        kv_bytes_per_token=4096,
        provenance={"created": created},
    )


def test_merge_takes_the_median_time_of_each_shape_and_refits() -> None:
    rng = random.Random(7)
    grid = list(dict.fromkeys(_grid()))  # distinct shapes
    # Three profiles of a drifting machine: 0.8x, 1.0x and 1.5x slow, each with noise; one of
    # them also misses a shape. The merge is the 1.0x machine, within the noise.
    records = [
        _record([(s, _truth(s) * f * rng.uniform(0.99, 1.01)) for s in grid[k:]], f"t{k}")
        for k, f in ((0, 0.8), (1, 1.0), (0, 1.5))
    ]
    merged = merge_profiles(records)
    assert len(merged["samples"]) == len(grid)
    times = {StepShape.from_dict(d): d["time_s"] for d in merged["samples"]}
    assert times[grid[5]] == pytest.approx(_truth(grid[5]), rel=0.02)
    # The shape only two profiles measured: the mean of its two times (0.8x and 1.5x).
    assert times[grid[0]] == pytest.approx(_truth(grid[0]) * 1.15, rel=0.02)
    assert merged["fit"]["mape"] < 0.05
    assert merged["provenance"]["merged_from"] == ["t0", "t1", "t0"]
    for s in grid[1::7]:
        pred = sum(
            merged["coefficients"][f] * x for f, x in zip(FEATURES, s.features(), strict=True)
        )
        assert pred == pytest.approx(_truth(s), rel=0.1)


def test_merge_refuses_profiles_of_different_models() -> None:
    a = _record([(s, _truth(s)) for s in _grid()], "a")
    b = {**a, "kv_bytes_per_token": 8192}
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        merge_profiles([a, b])


def test_serve_profile_seeds_the_step_cost_estimate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from poise.cli.serve import step_cost_prior
    from poise.kv.manager import KVCacheManager
    from poise.sched.scheduler import Scheduler

    samples = [(s, _truth(s)) for s in _grid()]
    coef, q = fit_step_costs(samples)
    rec = profile_record(
        model="tiny",
        coefficients=coef,
        fit=q,
        samples=samples,
        vocab_size=1000,
        max_model_len=2048,
        kv_bytes_per_token=4096,
        eos_token_ids=[2],
        kv_budget_bytes=1 << 24,
        provenance={},
    )
    prior = step_cost_prior(str(save_profile(rec, tmp_path / "p.json")))
    assert prior["step_cost_per_token_s"] == pytest.approx(coef["tokens"])
    kv = KVCacheManager(64, 16, True)
    est = Scheduler(EngineConfig.from_kwargs(**prior).scheduler, kv, 1024).estimator
    assert est.per_token_s == pytest.approx(coef["tokens"])
    assert est.const_s == pytest.approx(coef["const"])
