"""lm-eval (the `eval` extra) against `poise serve` scores what it scores with its own `hf` model
on the same tiny random float32 weights: a multiple-choice task (loglikelihoods per item within
1e-3, identical accuracy) and a generate_until task at batch size 4 (identical generations).
Both tasks are local JSONL files (tests/serving/lm_eval_tasks; no hub download). The server is
driven through lm-eval's `local-completions` model with the server's own tokenizer (picked
through /tokenizer_info) and through `local-chat-completions` on a handful of items."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serving.conftest import REPO, ServerProcess, tiny_server

pytestmark = pytest.mark.slow
TASKS = REPO / "tests" / "serving" / "lm_eval_tasks"


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with tiny_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("lm-eval"),
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "64",
    ) as proc:
        yield proc


def _evaluate(
    model: str, model_args: str, task: str, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> dict[str, Any]:
    pytest.importorskip("lm_eval", reason="lm-eval is in the `eval` extra (make test-all)")
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)  # the tasks' data_files are relative to the repository
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS)),
        random_seed=0,
        **kw,
    )
    assert out is not None
    return out


def _by_doc(out: dict[str, Any], task: str) -> dict[int, Any]:
    return {s["doc_id"]: s for s in out["samples"][task]}


def _served_and_hf(
    server: ServerProcess, model_dir: Path, task: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The task through local-completions against the server, then through lm-eval's hf model
    on the same weights, both at batch size 4."""
    url = f"{server.base_url}/v1/completions"
    served = _evaluate(
        "local-completions",
        f"model=tiny,base_url={url},num_concurrent=1,max_retries=1",
        task,
        monkeypatch,
        batch_size=4,
    )
    hf = _evaluate(
        "hf", f"pretrained={model_dir},dtype=float32", task, monkeypatch, batch_size=4, device="cpu"
    )
    return served, hf


def test_multiple_choice_loglikelihoods_match_hf(
    server: ServerProcess, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served, hf = _served_and_hf(server, tiny_model_dir, "poise_mc", monkeypatch)
    got, want = _by_doc(served, "poise_mc"), _by_doc(hf, "poise_mc")
    assert sorted(got) == sorted(want) and len(got) == 12
    for doc_id, sample in got.items():
        ours = [r[0][0] for r in sample["resps"]]  # one (loglikelihood, is_greedy) per choice
        ref = [r[0][0] for r in want[doc_id]["resps"]]
        assert ours == pytest.approx(ref, abs=1e-3), doc_id
        assert all(x < 0 for x in ours)  # real scores, not a placeholder
    acc = served["results"]["poise_mc"]["acc,none"]
    assert acc == hf["results"]["poise_mc"]["acc,none"]


def test_generate_until_batch_4_matches_hf(
    server: ServerProcess, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served, hf = _served_and_hf(server, tiny_model_dir, "poise_gen", monkeypatch)
    got, want = _by_doc(served, "poise_gen"), _by_doc(hf, "poise_gen")
    assert len(got) == 8
    generations = {d: s["resps"][0][0] for d, s in got.items()}
    assert generations == {d: s["resps"][0][0] for d, s in want.items()}
    assert any(generations.values())  # something was generated
    assert (
        served["results"]["poise_gen"]["exact_match,none"]
        == hf["results"]["poise_gen"]["exact_match,none"]
    )


def test_local_chat_completions_runs(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    out = _evaluate(
        "local-chat-completions",
        f"model=tiny,base_url={url},num_concurrent=1,max_retries=1",
        "poise_gen",
        monkeypatch,
        apply_chat_template=True,
        limit=4,
    )
    samples = out["samples"]["poise_gen"]
    assert len(samples) == 4 and all(isinstance(s["resps"][0][0], str) for s in samples)
    assert "exact_match,none" in out["results"]["poise_gen"]
