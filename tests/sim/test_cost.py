"""Cost models: step shapes from scheduler outputs, roofline numbers, KV sizing."""

from __future__ import annotations

import pytest

from poise.config import EngineConfig
from poise.core import SamplingParams, ScheduledRequest, SchedulerOutput
from poise.sim.accelerators import ACCELERATORS, get_accelerator
from poise.sim.cost import FEATURES, FixedCostModel, StepShape
from poise.sim.roofline import RooflineCostModel
from poise.sim.shapes import builtin_shapes, load_shape


def _sr(
    rid: str, n: int, start: int, sample: bool = True, blocks: list[int] | None = None
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=[5] * n,
        start_position=start,
        block_ids=blocks if blocks is not None else [0],
        sample=sample,
        sampling_params=SamplingParams(),
        output_index=0,
        num_prompt_tokens=max(start + n, 1),
    )


def test_step_shape_from_output() -> None:
    out = SchedulerOutput(
        step_id=0,
        scheduled=[_sr("a", 1, 99), _sr("b", 1, 9), _sr("c", 100, 10, sample=False)],
    )
    s = StepShape.from_output(out)
    assert (s.num_tokens, s.num_seqs, s.num_sampled) == (102, 3, 2)
    assert s.num_decode_seqs == 2 and s.decode_ctx_tokens == 100 + 10
    assert s.num_prefill_tokens == 100
    assert s.prefill_attn_pairs == 100 * 10 + 100 * 101 // 2
    assert s.kv_tokens == 100 + 10 + 110
    feats = dict(zip(FEATURES, s.features(), strict=True))
    assert s.decode_max_ctx == 100 and feats["decode_padded"] == 2 * 100
    assert feats["decode_padded_excess"] == 0.0
    assert dict(zip(FEATURES, s.features(knee=150), strict=True))["decode_padded_excess"] == 50
    assert feats["prefill_chunks"] == 1  # the one multi-token chunk


def test_step_shape_counts_shared_decode_blocks_once() -> None:
    # Three decodes at context 64 (4 blocks of 16): two share their first 3 blocks (a cached
    # prefix), one has its own. 12 block reads, 9 distinct blocks.
    out = SchedulerOutput(
        step_id=0,
        scheduled=[
            _sr("a", 1, 63, blocks=[1, 2, 3, 10]),
            _sr("b", 1, 63, blocks=[1, 2, 3, 11]),
            _sr("c", 1, 63, blocks=[20, 21, 22, 23]),
            _sr("p", 8, 0, blocks=[1, 2, 3]),  # a prefill chunk does not count
        ],
    )
    s = StepShape.from_output(out)
    assert s.decode_ctx_tokens == 3 * 64
    assert s.decode_unique_ctx_tokens == 3 * 64 * 9 // 12
    assert StepShape.from_dict(s.to_dict()) == s
    # Profiles written before the feature: every decode token counted as its own.
    old = {k: v for k, v in s.to_dict().items() if k != "decode_unique_ctx_tokens"}
    assert StepShape.from_dict(old).decode_unique_ctx_tokens == 3 * 64


def test_shipped_shapes_have_known_sizes() -> None:
    assert set(builtin_shapes()) >= {
        "Qwen2.5-7B-Instruct",
        "Llama-3.1-8B-Instruct",
        "SmolLM2-135M-Instruct",
    }
    # Published parameter counts: 7.62B, 8.03B, 135M.
    assert load_shape("Qwen/Qwen2.5-7B-Instruct").num_params / 1e9 == pytest.approx(7.62, abs=0.01)
    assert load_shape("llama-3.1-8b-instruct").num_params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert load_shape("SmolLM2-135M-Instruct").num_params / 1e6 == pytest.approx(134.5, abs=0.5)
    # GQA KV: 28 layers * 4 kv heads * 128 dims * 2 (K,V) * 2 bytes.
    assert load_shape("Qwen2.5-7B-Instruct").kv_bytes_per_token(2) == 57344


def test_load_shape_from_config_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,'
        ' "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}'
    )
    s = load_shape(tmp_path)
    assert s.head_dim == 16 and s.num_kv_heads == 2
    with pytest.raises(ValueError, match="model shape"):
        load_shape("no-such-model")


def test_named_accelerators() -> None:
    for name in ("a10", "l40s", "a100", "h100", "h200"):
        assert name in ACCELERATORS
    assert get_accelerator("H100_80GB").memory_bandwidth == pytest.approx(3.35e12)
    with pytest.raises(ValueError, match="accelerator"):
        get_accelerator("tpu")


def _decode(batch: int, ctx: int) -> StepShape:
    return StepShape(
        num_tokens=batch,
        num_seqs=batch,
        num_sampled=batch,
        num_decode_seqs=batch,
        decode_ctx_tokens=batch * ctx,
        kv_tokens=batch * ctx,
    )


def _prefill(n: int) -> StepShape:
    return StepShape(
        num_tokens=n,
        num_seqs=1,
        num_sampled=1,
        num_prefill_tokens=n,
        prefill_attn_pairs=n * (n + 1) // 2,
        kv_tokens=n,
    )


def test_roofline_decode_is_bandwidth_bound() -> None:
    m = RooflineCostModel.build("Llama-3.1-8B-Instruct", "h100", overhead_s=0.0, per_seq_s=0.0)
    # One decode token reads all bf16 weights but the input embedding (a gather), ~15.0 GB,
    # plus 100 tokens of KV: ~15.0e9 / (3.35e12 * 0.8) = 5.6 ms.
    t = m.step_time(_decode(1, 100))
    assert t == pytest.approx((8.03e9 - 128256 * 4096) * 2 / (3.35e12 * 0.8), rel=0.01)
    # More KV to read costs more; a faster memory system costs less.
    assert m.step_time(_decode(32, 4000)) > m.step_time(_decode(32, 100))
    h200 = RooflineCostModel.build("Llama-3.1-8B-Instruct", "h200", overhead_s=0.0, per_seq_s=0.0)
    assert h200.step_time(_decode(1, 100)) < t


def test_roofline_prefill_is_compute_bound() -> None:
    m = RooflineCostModel.build("Qwen2.5-7B-Instruct", "a100", overhead_s=0.0, per_seq_s=0.0)
    s = _prefill(4096)
    shape = load_shape("Qwen2.5-7B-Instruct")
    flops = (
        shape.flops_per_token * 4096
        + shape.lm_head_flops
        + shape.attention_flops_per_pair * s.prefill_attn_pairs
    )
    assert m.step_time(s) == pytest.approx(flops / (312e12 * 0.5), rel=1e-9)
    # Doubling efficiency halves a compute-bound step.
    fast = RooflineCostModel.build(
        "Qwen2.5-7B-Instruct", "a100", overhead_s=0.0, per_seq_s=0.0, compute_efficiency=1.0
    )
    assert fast.step_time(s) == pytest.approx(m.step_time(s) / 2)


def test_roofline_kv_capacity_follows_memory_knob() -> None:
    m = RooflineCostModel.build("Qwen2.5-7B-Instruct", "a100")
    lo = m.num_kv_blocks(EngineConfig.from_kwargs(gpu_memory_utilization=0.5))
    hi = m.num_kv_blocks(EngineConfig.from_kwargs(gpu_memory_utilization=0.9))
    # 0.4 * 80 GB more memory, all of it KV: / (16 tokens * 57344 B).
    assert hi - lo == pytest.approx(0.4 * 80e9 / (16 * 57344), rel=0.001)
    assert m.num_kv_blocks(EngineConfig.from_kwargs(num_kv_blocks=123)) == 123
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        RooflineCostModel.build("Qwen2.5-7B-Instruct", "a10").num_kv_blocks(
            EngineConfig.from_kwargs(gpu_memory_utilization=0.3)
        )
    assert m.max_model_len(EngineConfig.from_kwargs(max_model_len=4096)) == 4096
    assert m.max_model_len(EngineConfig()) == 32768


def test_fixed_cost_model() -> None:
    m = FixedCostModel(step_s=0.01, per_token_s=0.001)
    assert m.step_time(_prefill(10)) == pytest.approx(0.02)
    assert m.num_kv_blocks(EngineConfig.from_kwargs(kv_cache_memory_bytes=16 * 1024 * 10)) == 10


def test_short_chunk_after_cached_tokens_counts_as_decode_work() -> None:
    from poise.sim.cost import CACHED_CHUNK_ROWS_MAX

    # A 15-token prefix-cache hit on a 3360-token context: 15 queries, each reading the
    # context (3361 .. 3375 keys), its 211 blocks read once.
    hit = _sr("hit", 15, 3360, blocks=list(range(211)))
    fresh = _sr("fresh", 100, 0, blocks=list(range(300, 307)))
    s = StepShape.from_output(SchedulerOutput(step_id=0, scheduled=[hit, fresh]))
    pairs = 15 * 3360 + 15 * 16 // 2
    assert s.decode_ctx_tokens == pairs and s.num_decode_seqs == 0
    assert s.decode_unique_ctx_tokens == round(pairs / 15)
    assert s.prefill_attn_pairs == 100 * 101 // 2 and s.num_prefill_tokens == 115
    # A longer chunk after cached tokens is a blocked prefill again.
    big = _sr("big", CACHED_CHUNK_ROWS_MAX + 1, 3360, blocks=list(range(215)))
    s = StepShape.from_output(SchedulerOutput(step_id=0, scheduled=[big]))
    assert s.decode_ctx_tokens == 0 and s.prefill_attn_pairs > 0


@pytest.mark.parametrize(
    "field_value",
    [("step_overhead_s", -0.001), ("step_jitter_cv", -0.1), ("time_scale", 0.0)],
)
def test_cost_model_refuses_negative_step_terms(field_value: tuple[str, float]) -> None:
    name, value = field_value
    with pytest.raises(ValueError, match=name):
        FixedCostModel(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field_value",
    [
        ("request_overhead_s", -0.001),
        ("request_overhead_cv", -1.0),
        ("way_in_workers", -1),
        ("way_in_s_per_token", -1e-6),
    ],
)
def test_arrival_model_refuses_negative_client_terms(field_value: tuple[str, float]) -> None:
    from poise.sim.arrival import ArrivalModel

    name, value = field_value
    with pytest.raises(ValueError, match=name):
        ArrivalModel(**{name: value})  # type: ignore[arg-type]


def test_simulate_cli_rejects_a_negative_way_in(capsys: pytest.CaptureFixture[str]) -> None:
    from poise.cli import main

    rc = main(
        [
            "simulate",
            "--accelerator",
            "h100",
            "--model-shape",
            "Qwen2.5-7B-Instruct",
            "--concurrency",
            "2",
            "--num-requests",
            "2",
            "--way-in-us-per-token",
            "-5",
        ]
    )
    assert rc == 2
    assert "way_in_s_per_token must be >= 0" in capsys.readouterr().err
