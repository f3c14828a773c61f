"""NaN / inf logits fail only their request (issue 16, item 3), offline and over HTTP.

A real tiny Llama, the real runner, engine and server; the fault is injected by wrapping the
runner's ``execute`` (to learn which logits row belongs to the target request this step) and
its model's ``compute_logits`` (to write a NaN or an inf into that row): what a model whose
arithmetic overflows for one request produces. Everything else is the real stack.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from poise import LLM, SamplingParams
from poise.core.outputs import ModelRunnerOutput, SchedulerOutput
from poise.engine.core import EngineCore
from poise.serving.server import build_state
from tests.serving.conftest import InProcessServer, metric_value

NEIGHBOURS = [[5, 6, 7, 8], [300, 301], [42, 43, 44, 45, 46, 47]]
TARGET = [900, 901, 902]


class PoisonLogits:
    """Writes ``value`` into the logits row of requests whose prompt is ``prompt`` when they
    sample their output token number ``at`` (0: the prefill's token)."""

    def __init__(self, engine: EngineCore, prompt: list[int], at: int, value: float) -> None:
        self.engine, self.prompt, self.at, self.value = engine, prompt, at, value
        self.runner: Any = engine._executor
        self.rows: list[int] = []
        self.num_sampled = 0
        self.injected = 0

    def __enter__(self) -> PoisonLogits:
        execute, logits = self.runner.execute, self.runner.model.compute_logits

        def poisoned_execute(out: SchedulerOutput) -> ModelRunnerOutput:
            sampled = [s for s in out.scheduled if s.sample]
            requests = self.engine.scheduler.requests
            self.num_sampled = len(sampled)
            self.rows = [
                i
                for i, s in enumerate(sampled)
                if s.output_index == self.at
                and requests[s.request_id].prompt_token_ids == self.prompt
            ]
            return execute(out)  # type: ignore[no-any-return]

        def poisoned_logits(hidden: Any) -> Any:
            out = logits(hidden)
            if out.shape[0] == self.num_sampled:  # the sampled rows, not prompt logprobs
                for row in self.rows:
                    out[row, 7] = self.value
                    self.injected += 1
            return out

        self.runner.execute, self.runner.model.compute_logits = poisoned_execute, poisoned_logits
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.runner.execute, self.runner.model.compute_logits  # the class's methods again


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64)


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    return [greedy, seeded, greedy]


@pytest.mark.parametrize(
    ("at", "value", "target"),
    [
        (3, math.nan, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        # the prefill's row, sampled: torch.multinomial would raise on it and fail the whole step
        (0, math.inf, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)),
    ],
)
def test_offline_only_the_poisoned_request_fails(
    llm: LLM, at: int, value: float, target: SamplingParams
) -> None:
    prompts: list[Any] = [{"prompt_token_ids": p} for p in [*NEIGHBOURS, TARGET]]
    params = [*_params(), target]
    clean = llm.generate(prompts, params, use_tqdm=False)
    with PoisonLogits(llm.engine, TARGET, at, value) as poison:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert poison.injected == 1
    failed = outs[-1].outputs[0]
    assert failed.finish_reason == "error", failed
    assert outs[-1].error_message is not None and "non-finite" in outs[-1].error_message
    # The tokens before the poisoned step stand; none is sampled from the bad row.
    assert failed.token_ids == clean[-1].outputs[0].token_ids[:at]
    for before, after in zip(clean[:-1], outs[:-1], strict=True):
        assert after.outputs[0].finish_reason == "length"
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert llm.engine.kv.usage == 0 and not llm.engine.has_unfinished_requests()
    assert not any(llm.engine.kv.pool.ref_counts)  # every block released


def test_over_http_the_poisoned_request_gets_a_500_and_the_others_are_served(llm: LLM) -> None:
    import concurrent.futures

    clean = llm.generate(
        [{"prompt_token_ids": p} for p in NEIGHBOURS], _params()[0], use_tqdm=False
    )
    vocab = llm.model_info.vocab_size
    state = build_state(llm.engine, llm.tokenizer, model_name="tiny", vocab_size=vocab)
    base = {"model": "tiny", "max_tokens": 8, "ignore_eos": True, "temperature": 0}

    def complete(prompt: list[int], stream: bool) -> tuple[int, Any]:
        body = {**base, "prompt": prompt, "stream": stream}
        if not stream:
            r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
            return r.status_code, r.json()
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        return r.status_code, lines

    with InProcessServer(state) as server, PoisonLogits(llm.engine, TARGET, 2, math.nan):
        jobs = [(p, False) for p in NEIGHBOURS] + [(TARGET, False), (TARGET, True)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: complete(*job), jobs))
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        after = complete(NEIGHBOURS[0], False)
    for (status, body), before in zip(answers, clean, strict=False):
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"] == before.outputs[0].text  # the same detokenizer
    status, body = answers[len(NEIGHBOURS)]
    assert status == 500 and body["error"]["type"] == "internal_error", body
    assert "non-finite" in body["error"]["message"]
    status, events = answers[-1]
    assert status == 200 and events[-1] == "[DONE]", events  # the stream had started
    error = json.loads(events[-2])
    assert "non-finite" in error["error"]["message"] and error["error"]["code"] == 500, error
    assert not any(json.loads(e)["choices"][0].get("finish_reason") for e in events[:-2])
    assert metric_value(text, "poise:request_success_total", finished_reason="error") == 2
    assert metric_value(text, "poise:kv_cache_usage_perc") == 0
    assert after[0] == 200 and after[1]["choices"][0]["text"] == clean[0].outputs[0].text
    assert not any(llm.engine.kv.pool.ref_counts)  # every block released


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_fault_inside_the_model_fails_only_its_rows(tiny_model_dir: Path, backend: str) -> None:
    """NaN made inside the model (the embedding of one token, as an fp16 overflow would),
    so it reaches the hidden states and the KV cache, not only the logits: the request whose
    rows it is, all n of its samples, ends with the error; the rest of the batch is token for
    token a clean run's; and later requests, on the blocks the failed one freed, are clean."""
    # 10 blocks: the second wave below (12 requests of one block each) uses every one of them.
    llm = LLM(
        model=str(tiny_model_dir), dtype="float32", num_kv_blocks=10, attention_backend=backend
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    three = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=8, ignore_eos=True)
    prompts: list[Any] = [{"prompt_token_ids": p} for p in [*NEIGHBOURS, TARGET * 7]]
    params = [greedy] * len(NEIGHBOURS) + [three]
    clean = llm.generate(prompts, params, use_tqdm=False)
    embed = llm.engine._executor.model.model.embed_tokens

    def poison(_: Any, inputs: tuple[Any, ...], out: Any) -> Any:
        out = out.clone()
        out[inputs[0] == TARGET[0]] = math.nan
        return out

    hook = embed.register_forward_hook(poison)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        hook.remove()
    assert [c.finish_reason for c in outs[-1].outputs] == ["error"] * 3
    assert outs[-1].error_message is not None and "non-finite" in outs[-1].error_message
    for before, after in zip(clean[:-1], outs[:-1], strict=True):
        assert after.outputs[0].finish_reason == "length"
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert llm.engine.kv.usage == 0 and not any(llm.engine.kv.pool.ref_counts)
    # The freed blocks held NaN keys and values; whoever gets them next computes over them.
    again = llm.generate(prompts[:-1] * 4, greedy, use_tqdm=False)
    for before, after in zip(clean[:-1] * 4, again, strict=True):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
