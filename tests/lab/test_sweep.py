"""``poise sweep``: configs x cells, report and plots, resume without re-measuring, configs
that fail leave no process behind; and the acceptance run on a real poise server (tiny model)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from poise.bench.bench_config import WorkloadSpec
from poise.lab.bench_adapter import run_cells
from poise.lab.managed_server import ServerSpec
from poise.lab.sweep import load_specs, run_sweep
from tests.lab.conftest import MOCK_TEMPLATE, pid_gone


def mock_specs() -> list[ServerSpec]:
    return [
        ServerSpec(
            name,
            command=MOCK_TEMPLATE,
            args={"max_num_batched_tokens": b, "max_num_seqs": 4},
            startup_timeout_s=30,
            grace_s=2,
        )
        for name, b in (("small", 512), ("big", 1024))
    ]


@pytest.fixture
def two_cells() -> WorkloadSpec:
    return WorkloadSpec(
        concurrency=(2,),
        long_ratio=(0.0, 0.5),
        max_tokens=16,
        num_requests=4,
        warmup=1,
        long_repeat=5,
        timeout_s=30,
    )


def test_sweep_report_plots_and_resume(tmp_path: Path, two_cells: WorkloadSpec) -> None:
    calls: list[list[str]] = []

    def counting(base_url: str, wl: WorkloadSpec, cells: list[Any], *a: Any, **kw: Any) -> Any:
        calls.append([c.label for c in cells])
        return run_cells(base_url, wl, cells, *a, **kw)

    res = run_sweep(mock_specs(), two_cells, tmp_path, slo_ttft_ms=110.0, runner=counting)
    assert [o.measured for o in res.outcomes] == [["c2-long0", "c2-long0.5"]] * 2
    assert all(o.error is None and o.server_pid and pid_gone(o.server_pid) for o in res.outcomes)
    report = (tmp_path / "report.md").read_text()
    assert "### c2-long0.5" in report and "| small" in report and "| big" in report
    assert "How do long prompts move short requests' TTFT?" in report
    # 512 -> ~40 ms TTFT, 1024 -> >= 113 ms (a sleep): only "small" meets a 110 ms SLO.
    assert "Throughput-first within TTFT p95 <= 110 ms: **small**" in report
    assert (tmp_path / "records" / "small.yaml").is_file()
    assert res.plots and all(p.is_file() for p in res.plots.values())
    assert (tmp_path / "plots" / "ttft_vs_throughput.png").stat().st_size > 1000

    again = run_sweep(mock_specs(), two_cells, tmp_path, runner=counting, plots=False)
    assert len(calls) == 2  # no server started, no cell measured the second time
    assert [o.reused for o in again.outcomes] == [["c2-long0", "c2-long0.5"]] * 2
    assert all(o.measured == [] and o.server_pid is None for o in again.outcomes)
    assert "### c2-long0.5" in (tmp_path / "report.md").read_text()


def test_changed_config_is_measured_again(tmp_path: Path, two_cells: WorkloadSpec) -> None:
    one = WorkloadSpec(**{**two_cells.__dict__, "long_ratio": (0.0,)})
    run_sweep(mock_specs()[:1], one, tmp_path, plots=False)
    changed = ServerSpec(
        "small", command=MOCK_TEMPLATE, args={"max_num_batched_tokens": 1024, "max_num_seqs": 4}
    )
    res = run_sweep([changed], one, tmp_path, plots=False)
    assert res.outcomes[0].measured == ["c2-long0"]


def test_failing_cell_stops_server_and_sweep_goes_on(
    tmp_path: Path, two_cells: WorkloadSpec
) -> None:
    def failing(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("cell exploded")

    res = run_sweep(mock_specs(), two_cells, tmp_path, runner=failing, plots=False)
    for o in res.outcomes:
        assert o.error and "cell exploded" in o.error
        assert o.server_pid is not None and pid_gone(o.server_pid)
    assert "FAILED: RuntimeError: cell exploded" in (tmp_path / "report.md").read_text()


def test_config_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        yaml.safe_dump({"max_num_seqs": 8, "max-num-batched-tokens": 1024})
    )
    (tmp_path / "multi.yaml").write_text(
        yaml.safe_dump(
            {
                "configs": [
                    {
                        "name": "vllm-b",
                        "command": "vllm serve M --port {port}",
                        "base_url": "http://127.0.0.1:{port}/v1",
                    },
                    {"name": "p", "args": {"scheduling_policy": "prefill-first"}},
                ]
            }
        )
    )
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"max_num_seqs": 0}))
    (a,) = load_specs(tmp_path / "a.yaml")
    assert a.name == "a" and a.args == {"max_num_seqs": 8, "max_num_batched_tokens": 1024}
    v, p = load_specs(tmp_path / "multi.yaml")
    assert v.engine == "vllm" and v.argv(9)[:4] == ["vllm", "serve", "M", "--port"]
    assert p.command is None and "--scheduling-policy" in p.argv(9)
    with pytest.raises(ValueError, match="'bad'.*max_num_seqs"):
        load_specs(tmp_path / "bad.yaml")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama beside the SmolLM2 tokenizer (as tests/serving builds it)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.serving.conftest import _cached_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(_cached_tokenizer_dir()), local_files_only=True)
    path = tmp_path_factory.mktemp("lab-tiny-llama")
    tok.save_pretrained(path)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(path, safe_serialization=True)
    return path


def test_acceptance_two_poise_configs_two_cells(
    tmp_path: Path, tiny_llama: Path, two_cells: WorkloadSpec
) -> None:
    common = {
        "max_model_len": 512,
        "num_kv_blocks": 128,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 256,
    }
    specs = [
        ServerSpec(
            "fifo",
            model=str(tiny_llama),
            args=dict(common),
            env={"OMP_NUM_THREADS": "1"},
            startup_timeout_s=120,
        ),
        ServerSpec(
            "prefill-first",
            model=str(tiny_llama),
            args={**common, "scheduling_policy": "prefill_first"},
            env={"OMP_NUM_THREADS": "1"},
            startup_timeout_s=120,
        ),
    ]
    res = run_sweep(specs, two_cells, tmp_path, slo_ttft_ms=5000.0)
    for o in res.outcomes:
        assert o.error is None, o.error
        assert o.measured == ["c2-long0", "c2-long0.5"]
        assert o.server_pid is not None and pid_gone(o.server_pid)
    report = (tmp_path / "report.md").read_text()
    assert "prefill-first (prefill-first) vs FIFO (fifo)" in report
    assert (tmp_path / "plots" / "ttft_vs_throughput.png").is_file()
    again = run_sweep(specs, two_cells, tmp_path, plots=False)
    assert all(o.measured == [] and o.server_pid is None for o in again.outcomes)
    assert all(len(o.reused) == 2 for o in again.outcomes)


def test_cli_sweep_help_runs() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "poise", "sweep", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=60,
    )
    assert out.returncode == 0 and "--preset" in out.stdout
