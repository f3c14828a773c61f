"""Presets (the lab's A/B/C scaled to CPU or kept for GPU) and the report's answers to the
seed's questions, computed from a synthetic grid of cell metrics."""

from __future__ import annotations

from pathlib import Path

from poise import workload as wl
from poise.bench.bench_config import WorkloadSpec
from poise.config import EngineConfig
from poise.lab.cell_metrics import CellMetrics
from poise.lab.managed_server import ServerSpec
from poise.lab.presets import DEFAULT_KV_BASE_BYTES, plan
from poise.lab.sweep import SweepResult, spec_from_dict
from poise.lab.sweep_questions import answer_questions, policy_pairs
from poise.workload import long_prompt


def test_seed_long_prompt_is_verbatim() -> None:
    assert long_prompt(220) == wl.LONG_PROMPT


def test_lab_preset_on_gpu_keeps_the_lab_numbers() -> None:
    p = plan("lab", device="cuda")
    a, b, c = (d["args"] for d in p.configs)
    assert (
        a["max_num_seqs"],
        a["max_num_batched_tokens"],
        a["max_model_len"],
        a["gpu_memory_utilization"],
    ) == (16, 4096, 4096, 0.85)
    assert (b["max_num_seqs"], b["max_num_batched_tokens"], b["gpu_memory_utilization"]) == (
        64,
        8192,
        0.90,
    )
    assert (
        c["max_model_len"],
        c["max_num_seqs"],
        c["max_num_batched_tokens"],
        c["enable_chunked_prefill"],
    ) == (8192, 64, 8192, True)
    assert p.workload.concurrency == (8, 16, 32, 64) and p.workload.long_ratio == (0.0, 0.25, 0.5)
    assert p.workload.max_tokens == 160 and p.workload.long_repeat == 220


def test_lab_preset_on_cpu_is_scaled_and_valid() -> None:
    p = plan("lab", device="cpu")
    a, b, c = (d["args"] for d in p.configs)
    # KV byte budget proportional to the memory fraction: the engine's CPU rule sizes it.
    budgets = [EngineConfig.from_kwargs(**args).cache.cpu_kv_budget_bytes() for args in (a, b)]
    assert budgets == [int(0.85 * DEFAULT_KV_BASE_BYTES), int(0.90 * DEFAULT_KV_BASE_BYTES)]
    assert (
        a["max_num_seqs"] < b["max_num_seqs"]
        and a["max_num_batched_tokens"] < b["max_num_batched_tokens"]
    )
    assert c["max_model_len"] > a["max_model_len"] and c["enable_chunked_prefill"]
    for args in (a, b):  # without chunking a whole prompt must fit one step
        assert not args["enable_chunked_prefill"]
        assert args["max_num_batched_tokens"] >= args["max_model_len"]
    assert max(p.workload.concurrency) <= 8 and p.workload.long_repeat < 220
    for d in p.configs:  # every scaled config passes the engine's validation
        spec_from_dict(d, d["name"])


def test_policy_preset_is_a_policy_pair() -> None:
    p = plan("policy")
    specs = [spec_from_dict(d, d["name"]) for d in p.configs]
    res = SweepResult(Path("."), specs, p.workload, [])
    assert policy_pairs(res) == [("C-long-prompts", "C-prefill-first")]


def _m(ttft: float, tpot: float, short: float, thr: float = 100.0) -> CellMetrics:
    return CellMetrics(
        ttft_p95_ms=ttft,
        tpot_p50_ms=tpot,
        output_tokens_per_s=thr,
        num_requests=8,
        class_ttft_p95_ms={"short": short},
    )


def test_questions_answered_from_numbers() -> None:
    specs = [
        ServerSpec("f", args={"max_num_seqs": 4}),
        ServerSpec("p", args={"max_num_seqs": 4, "scheduling_policy": "prefill_first"}),
    ]
    work = WorkloadSpec(concurrency=(4,), long_ratio=(0.0, 0.5))
    grid = {
        "f": {"c4-long0": _m(100, 20, 100), "c4-long0.5": _m(900, 20, 400)},
        "p": {"c4-long0": _m(80, 30, 80), "c4-long0.5": _m(500, 30, 160)},
    }
    text = "\n".join(answer_questions(SweepResult(Path("."), specs, work, []), grid))
    assert "f, concurrency 4: short TTFT p95 100 ms (long 0) -> 400 ms (long 0.5): x4.0" in text
    assert "by x2.0 (p at concurrency 4) to x4.0 (f at concurrency 4)" in text
    assert "prefill-first bought first tokens" in text and "TPOT p50 +50 %" in text
    # Reverse the signs: prefill-first only costs.
    grid["p"] = {"c4-long0": _m(120, 30, 100), "c4-long0.5": _m(950, 30, 410)}
    text = "\n".join(answer_questions(SweepResult(Path("."), specs, work, []), grid))
    assert "prefill-first did not pay" in text


def test_mixed_long_ratio_effect_is_called_mixed() -> None:
    specs = [ServerSpec("f", args={"max_num_seqs": 4})]
    work = WorkloadSpec(concurrency=(2, 4), long_ratio=(0.0, 0.5))
    grid = {
        "f": {
            "c2-long0": _m(100, 20, 100),
            "c2-long0.5": _m(90, 20, 60),
            "c4-long0": _m(100, 20, 100),
            "c4-long0.5": _m(300, 20, 300),
        }
    }
    text = "\n".join(answer_questions(SweepResult(Path("."), specs, work, []), grid))
    assert "Mixed: short requests' TTFT p95 moved by x0.6" in text and "x3.0" in text


def test_policy_gain_on_both_sides_is_flagged() -> None:
    specs = [ServerSpec("f", args={}), ServerSpec("p", args={"scheduling_policy": "prefill_first"})]
    work = WorkloadSpec(concurrency=(4,), long_ratio=(0.0,))
    grid = {"f": {"c4-long0": _m(100, 40, 100)}, "p": {"c4-long0": _m(60, 20, 60)}}
    text = "\n".join(answer_questions(SweepResult(Path("."), specs, work, []), grid))
    assert "improved TTFT p95 (-40 %) and TPOT p50 (-50 %) alike" in text
