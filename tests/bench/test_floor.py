"""benchmarks/floor.py end to end on a tiny dummy model with tiny buffers (``--tiny``), so the
script cannot rot: every figure it prints comes out, in the JSON, consistent with the others.
Its numbers mean nothing at these sizes, so nothing here is about speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Divisible as int4 needs (in % 32, out % 16), GQA, tied embeddings, q/k/v bias (qwen2).
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def test_floor_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "floor.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "floor.py"),
        "--tiny",
        "--model",
        f"dummy:{model}",
        "--batches",
        "1,4",
        "--json",
        str(out),
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "=== tiny" in run.stdout and "x floor" in run.stdout

    figures = json.loads(out.read_text())
    hw = figures["hardware"]
    assert len(hw["read_samples"]) == 2  # at the start and at the end
    assert hw["read_bytes_per_s"] == max(hw["read_samples"]) > 0
    assert hw["bf16_flops"] == max(hw["bf16_samples"]) > 0
    assert hw["int8_ops"] == max(max(v) for v in hw["int8_samples"].values()) > 0

    formats = figures["models"]["tiny"]["formats"]
    assert set(formats) == {"bf16", "int8", "int4"}
    # Quantized layers hold fewer bytes than bf16 ones: the floors differ as the formats do.
    assert formats["int8"]["weight_bytes"] < formats["bf16"]["weight_bytes"]
    assert formats["int4"]["weight_bytes"] < formats["bf16"]["weight_bytes"]
    for r in formats.values():
        assert set(r["bytes_by_kind"]) == {
            "qkv_proj",
            "o_proj",
            "gate_up_proj",
            "down_proj",
            "lm_head",
        }
        assert sum(r["bytes_by_kind"].values()) == r["weight_bytes"]
        assert math.isclose(r["decode_floor_s"], r["weight_bytes"] / hw["read_bytes_per_s"])
        for b in ("1", "4"):
            d = r["decode"][b]
            assert d["seconds"] > 0 and math.isclose(
                d["x_floor"], d["seconds"] / r["decode_floor_s"]
            )
            # The peer read of the same tensors: a figure of its own, and the ratio to it.
            assert d["stream_seconds"] > 0
            assert math.isclose(d["x_stream"], d["seconds"] / d["stream_seconds"])
            kinds = d["by_kind"]
            assert math.isclose(sum(k["seconds"] for k in kinds.values()), d["seconds"])
            step = r["steps"][b]
            assert math.isclose(sum(step["parts"].values()), step["seconds"], rel_tol=1e-9)
            assert step["parts"]["linears"] > 0 and step["parts"]["lm_head"] > 0
            assert step["parts"]["attention"] > 0 and step["plain_seconds"] > 0
        p = r["prefill"]
        # Every projection of both layers at 32 rows: 2 x rows x in x out each.
        qkv = 64 * (64 + 2 * 32)
        per_layer = 2 * 32 * (qkv + 64 * 64 + 64 * 256 + 128 * 64)
        assert p["layers"] == 2 and p["flops"] == 2 * per_layer
        assert p["x_bf16_floor"] > 0 and p["x_int8_floor"] > 0
