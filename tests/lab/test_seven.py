"""`poise lab`: the seven-question run (through the simulator, small) and its report: every
section present, every number read from the run's records (perturbing one changes the text),
and the manifest saying which questions the run answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from poise.lab.seven_plan import QUESTIONS, doc_prompts, plan
from poise.lab.seven_report import write_report
from poise.lab.seven_run import SimTarget, run_lab
from poise.sim.cost import FixedCostModel
from poise.sim.tokens import PromptLengths

COST = FixedCostModel(step_s=0.004, per_token_s=2e-5, vocab_size=1000, model_max_len=8192)


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lab")
    lab = plan("simulated", scale=8, out_dir=out, max_probes=4)
    run_lab(lab, out, sim=SimTarget(COST, PromptLengths()), say=lambda _: None)
    write_report(out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_every_question_has_a_section_answer_and_plot(lab_run: Path) -> None:
    text = (lab_run / "report.md").read_text(encoding="utf-8")
    for k, q in QUESTIONS.items():
        assert f"## Q{k}. {q}" in text
    sections = text.split("\n## Q")[1:]
    assert len(sections) == len(QUESTIONS) == 8
    for s in sections:
        assert "Not answered" not in s, s
        assert any(ch.isdigit() for ch in s.split("\n", 1)[1])  # numbers from the run
    q1 = text.split("## Q1.")[1].split("## Q2.")[0]
    assert "| mode (open loop) |" in q1 and "req/s" in q1  # the open-loop cells ran at a rate
    q6 = text.split("## Q6.")[1].split("## Q7.")[0]
    assert "Simultaneous arrival (8 identical cold long prompts sent at once)" in q6
    assert "| burst-cache-on |" in q6 and "| burst-cache-off |" in q6
    manifest = yaml.safe_load((lab_run / "lab.yaml").read_text(encoding="utf-8"))
    assert manifest["answers"] == {f"Q{k}": {"answered": True} for k in QUESTIONS}
    assert manifest["simulated"] and manifest["groups"]["prefix"]["records"]
    q8 = text.split("## Q8.")[1]
    assert q8.count("| ngram-fixed |") == 3  # one row per concurrency and config
    for key in ("batching", "averages", "policies", "long_prompts", "waiting", "prefix", "tune"):
        assert (lab_run / "plots" / f"{key}.png").stat().st_size > 1000
        assert f"plots/{key}.png" in text


def test_a_perturbed_record_changes_the_text(lab_run: Path, tmp_path: Path) -> None:
    out = _copy(lab_run, tmp_path / "run")
    before = (out / "report.md").read_text(encoding="utf-8")
    # The summary of a cell (YAML): continuous batching's throughput, doubled.
    rec_path = out / "batching" / "records" / "continuous.yaml"
    rec = yaml.safe_load(rec_path.read_text(encoding="utf-8"))
    overall = rec["results"][0]["metrics"]["overall"]
    overall["output_tokens_per_s"] = round(overall["output_tokens_per_s"] * 2 + 1234.5, 1)
    rec_path.write_text(yaml.safe_dump(rec, sort_keys=False), encoding="utf-8")
    # The per-request records (JSONL): every TTFT of the mixed decode-first cell 7 s later.
    jl = out / "mix" / "records" / "decode-first.requests.jsonl"
    rows = [json.loads(line) for line in jl.read_text(encoding="utf-8").splitlines()]
    last = max(r["cell"] for r in rows)
    for r in rows:
        if r["cell"] == last:
            r["events"] = [t + 7.0 for t in r["events"]]
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    after = write_report(out).read_text(encoding="utf-8")
    assert after != before
    q1 = after.split("## Q1.")[1].split("## Q2.")[0]
    assert f"{overall['output_tokens_per_s']:.1f} tok/s" in q1
    q2_before = before.split("## Q2.")[1].split("## Q3.")[0]
    q2 = after.split("## Q2.")[1].split("## Q3.")[0]
    assert q2 != q2_before and " s" in q2.split("p95")[1][:12]  # TTFTs now in seconds


def test_missing_cells_are_said_and_recorded(lab_run: Path, tmp_path: Path) -> None:
    out = _copy(lab_run, tmp_path / "run")
    (out / "prefix" / "records" / "cache-on-lpm.yaml").unlink()
    (out / "tune" / "tune.json").unlink()
    text = write_report(out).read_text(encoding="utf-8")
    q6 = text.split("## Q6.")[1].split("## Q7.")[0]
    assert "Not answered by this run" in q6
    assert "Records missing: prefix/cache-on-lpm" in text
    answers = yaml.safe_load((out / "lab.yaml").read_text(encoding="utf-8"))["answers"]
    assert answers["Q6"]["answered"] is False and "prefix" in answers["Q6"]["why_not"]
    assert answers["Q7"]["answered"] is False
    assert answers["Q1"] == {"answered": True}


def test_plan_sizes_and_documents() -> None:
    cpu, gpu = (
        plan("cpu", out_dir="/tmp/unused-lab-plan"),
        plan("cuda", out_dir="/tmp/unused-lab-plan"),
    )
    names = [g.name for g in cpu.groups]
    assert names == [
        "batching",
        "batching-open",
        "mix",
        "waiting",
        "prefix",
        "prefix-burst",
        "speculation",
    ]
    assert cpu.scale == 8 and gpu.scale == 1
    mix = {g.name: g for g in gpu.groups}["mix"]
    assert mix.workload.concurrency == (32,) and mix.workload.max_tokens == 160
    assert mix.workload.salt_scope == "request"  # identical seed prompts would hit the cache
    batching = {g.name: g for g in cpu.groups}["batching"].configs
    assert [a["scheduling_policy"] for a in batching.values()] == ["fifo", "static", "dynamic"]
    docs = doc_prompts(3, 50)
    assert len(set(docs)) == 3 and docs == doc_prompts(3, 50)
    assert all(d.endswith(docs[0].split("\n\n")[1]) for d in docs)  # the same question


def test_cli_redraws_and_refuses(
    lab_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from poise.cli import main

    out = _copy(lab_run, tmp_path / "run")
    (out / "report.md").unlink()
    assert main(["lab", "--report-only", "--no-plots", "-o", str(out)]) == 0
    assert "## Q7." in (out / "report.md").read_text(encoding="utf-8")
    assert main(["lab", "--report-only"]) == 2
    assert main(["lab", "--only", "nonsense", "-o", str(tmp_path / "x")]) == 2
    assert "groups are batching" in capsys.readouterr().err
