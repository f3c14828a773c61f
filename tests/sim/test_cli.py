"""`poise simulate` and `poise profile` end to end, and prompt-length accounting."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from poise import workload as wl
from poise.cli import main
from poise.sim.tokens import PromptLengths, estimate_text_tokens, to_sim_requests


def test_prompt_lengths_use_measured_seed_counts() -> None:
    lengths = PromptLengths()
    assert lengths(wl.SHORT_PROMPT) == 45
    assert lengths(wl.LONG_PROMPT) == 3363
    assert lengths(wl.LONG_PROMPT, "abcd1234-0") == 3363 + 12
    assert estimate_text_tokens("token budget decode") == 3
    assert lengths("token " * 100) == 30 + 106
    counted = PromptLengths(count=len)
    assert counted("abc", "s") == len(wl.salted("abc", "s"))


def test_to_sim_requests_marks_warmup_and_keys_prompts() -> None:
    short, long = wl.seed_classes(20)
    reqs = wl.ratio_mix(8, 0.25, short, long, seed=0)
    sims = to_sim_requests(reqs, PromptLengths(), salt="x-0", num_warmup=2)
    assert [s.warmup for s in sims] == [True, True] + [False] * 6
    assert sum(s.class_name == "long" for s in sims) == 2
    assert {s.prompt_len for s in sims} == {45 + 12, 3363 + 12}
    assert len({s.prompt_key for s in sims}) == 2  # identical prompts stay identical


def test_simulate_cli_writes_a_simulated_record(tmp_path: Path) -> None:
    out = tmp_path / "sim.yaml"
    rc = main(
        [
            "simulate",
            "--accelerator",
            "a10",
            "--model-shape",
            "SmolLM2-135M-Instruct",
            "--concurrency",
            "4,8",
            "--long-ratio",
            "0.25",
            "--max-tokens",
            "16",
            "--num-requests",
            "24",
            "--max-num-seqs",
            "8",
            "--request-overhead-ms",
            "2",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    rec = yaml.safe_load(out.read_text())
    assert rec["kind"] == "simulated"
    assert rec["experiment"]["server_args"]["max_num_seqs"] == 8
    cells = rec["results"]
    assert [c["load"]["concurrency"] for c in cells] == [4, 8]
    for c in cells:
        ov = c["metrics"]["overall"]
        assert ov["num_ok"] == 24 and ov["ttft_ms"]["p50"] > 2.0
        assert c["server"]["sim"]["steps"] > 0
    assert rec["provenance"]["simulated_requests"] == (4 + 24) + (8 + 24)  # warmup = concurrency
    # Each simulated request carries a header time (when the engine took it, as poise serve
    # sends headers): after the send plus the request overhead, no later than its first token.
    import json

    lines = (tmp_path / "sim.requests.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert recs and all(r["start"] + 0.002 - 1e-9 <= r["header"] <= r["events"][0] for r in recs)


def test_simulate_cli_needs_a_cost_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--concurrency", "2"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_profile_cli_fits_and_simulate_uses_it(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.model.tiny_models import build_tiny_checkpoint

    model = build_tiny_checkpoint("llama", tmp_path / "tiny")
    prof = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            str(model),
            "--grid",
            "quick",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--clock",
            "cpu",
            "--num-kv-blocks",
            "128",
            "--dtype",
            "float32",
            "-o",
            str(prof),
        ]
    )
    assert rc == 0
    from poise.sim.fit import load_profile

    cost = load_profile(prof)
    assert cost.vocab_size == 512 and cost.model_max_len == 256
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 kv heads, d16, fp32
    assert cost.provenance["torch_threads"] == 1 and cost.provenance["clock"] == "cpu"
    # The sim sizes the pool by the runner's rule, not by the pool the profile ran with.
    from poise.config import EngineConfig

    assert cost.num_kv_blocks(EngineConfig()) == (1 << 30) // (16 * cost.kv_bytes_per_token)
    assert cost.num_kv_blocks(EngineConfig.from_kwargs(num_kv_blocks=77)) == 77
    # Refitting the stored samples reproduces the fit without measuring.
    assert main(["profile", "--refit", str(prof), "-o", str(tmp_path / "r.json")]) == 0
    again = load_profile(tmp_path / "r.json")
    assert again.coefficients == pytest.approx(cost.coefficients)
    out = tmp_path / "s.yaml"
    rc = main(
        [
            "simulate",
            "--profile",
            str(prof),
            "--concurrency",
            "2",
            "--max-tokens",
            "8",
            "--num-requests",
            "6",
            "--class",
            "c:1:20:8",
            "--num-kv-blocks",
            "128",
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    rec = yaml.safe_load(out.read_text())
    assert rec["results"][0]["metrics"]["overall"]["num_ok"] == 6
