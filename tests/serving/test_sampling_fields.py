"""Sampling fields over HTTP with the official openai client, on a live `poise serve` of a tiny
random Llama (float32), both endpoints, streaming and not: penalties, logit_bias and min_tokens
change exactly the tokens a reference computed here from transformers' logits says; n samples
are distinct with a seed, reproducible, and streamed under their own choice index; usage
(include_usage, continuous_usage_stats) counts every sample."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from poise.core.sampling_params import SamplingParams
from poise.serving.protocol import ChatCompletionRequest
from tests.sampling_reference import greedy_reference
from tests.serving.conftest import ServerProcess, metric_value, tiny_server

N = 10
PROMPT = [1, 520, 33, 980, 33, 4051, 77, 33, 12, 9000, 77, 33]
MSG = [{"role": "user", "content": "Say something about paged attention."}]


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with tiny_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("sampling"),
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        "16MiB",
    ) as proc:
        yield proc


def _reference(hf: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    return greedy_reference(hf, prompt, n, **kw)


def _complete(client: openai.OpenAI, stream: bool, **kw: Any) -> str:
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0} | kw
    kw["extra_body"] = {"ignore_eos": True} | kw.get("extra_body", {})
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices
    )


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_and_logit_bias_change_exactly_the_reference_tokens(
    client: openai.OpenAI, hf: Any, smol_tokenizer: Any, stream: bool
) -> None:
    def text(ids: list[int]) -> str:
        return str(smol_tokenizer.decode(ids, skip_special_tokens=True))

    plain = _reference(hf, PROMPT, N)
    assert _complete(client, stream) == text(plain)  # no field set: greedy unchanged
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"freq": 1.5, "pres": 0.5}),
        ({"extra_body": {"repetition_penalty": 1.8}}, {"rep": 1.8}),
        ({"logit_bias": {str(plain[0]): -100, "4242": 6}}, {"bias": {plain[0]: -100.0, 4242: 6.0}}),
    ]
    for body, ref in cases:
        want = _reference(hf, PROMPT, N, **ref)
        assert want != plain, body  # the field changes the output...
        assert _complete(client, stream, **body) == text(want), body  # ...exactly as it should


def test_min_tokens_over_http(client: openai.OpenAI, hf: Any, smol_tokenizer: Any) -> None:
    plain = _reference(hf, PROMPT, N)
    stop = plain[1]
    extra = {"stop_token_ids": [stop], "min_tokens": 5}
    got = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True} | extra,
    )
    want = _reference(hf, PROMPT, N, min_tokens=5, stops=(stop,))
    cut = want.index(stop, 5) + 1 if stop in want[5:] else N
    assert got.choices[0].text == smol_tokenizer.decode(want[:cut], skip_special_tokens=True)
    assert got.usage is not None and got.usage.completion_tokens == cut >= 5


def test_n_chat_distinct_reproducible_and_streamed_by_index(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": MSG,
        "max_completion_tokens": 8,
        "temperature": 1.0,
        "seed": 99,
        "n": 3,
        "extra_body": {"ignore_eos": True},
    }
    first = client.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # distinct
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == texts
    assert first.usage is not None and first.usage.completion_tokens == 3 * 8
    streamed = ["", "", ""]
    roles = []
    usage_chunks: list[Any] = []
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw
    ):  # type: ignore[call-overload]
        usage_chunks.append((chunk.usage, chunk.choices))
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
    assert streamed == texts and sorted(roles) == [0, 1, 2]
    # continuous_usage_stats: every chunk has the usage so far; the last one all of it.
    assert all(u is not None for u, _ in usage_chunks)
    counts = [u.completion_tokens for u, _ in usage_chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 24
    assert usage_chunks[-1][1] == []  # include_usage's own final chunk, no choices


def test_n_completions_stream_and_not_agree(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "tiny",
        "prompt": "Once upon",
        "max_tokens": 6,
        "temperature": 0.9,
        "seed": 5,
        "n": 2,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kw)
    got = ["", ""]
    last_usage = None
    for chunk in client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        for choice in chunk.choices:
            got[choice.index] += choice.text
        last_usage = chunk.usage or last_usage
    assert got == [c.text for c in full.choices] and got[0] != got[1]
    assert last_usage is not None and last_usage.completion_tokens == 12


def test_generation_config_repetition_penalty_is_a_default() -> None:
    req = ChatCompletionRequest(messages=MSG)  # type: ignore[arg-type]
    params = req.to_sampling_params(100, {"repetition_penalty": 1.2, "temperature": 0.5})
    assert (params.repetition_penalty, params.temperature) == (1.2, 0.5)
    given = ChatCompletionRequest(messages=MSG, repetition_penalty=1.0)  # type: ignore[arg-type]
    assert given.to_sampling_params(100, {"repetition_penalty": 1.2}).repetition_penalty == 1.0
    assert SamplingParams().repetition_penalty == 1.0


def test_leaving_an_n_stream_aborts_every_sample_and_frees_the_kv(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    def metric(name: str, **labels: str) -> float:
        return metric_value(httpx.get(server.base_url + "/metrics").text, name, **labels)

    aborts = metric("poise:request_success_total", finished_reason="abort")
    body = {
        "model": "tiny",
        "prompt": "a long tale " * 20,
        "max_tokens": 300,
        "n": 4,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 8:
                break  # leaving closes the connection mid-generation
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            metric("poise:num_requests_running") == 0
            and metric("poise:kv_cache_usage_perc") == 0
            and metric("poise:request_success_total", finished_reason="abort") >= aborts + 1
        ):
            break
        time.sleep(0.1)
    # Every sample aborted (nothing runs, no block held), counted as the one request it is.
    assert metric("poise:request_success_total", finished_reason="abort") == aborts + 1
    assert metric("poise:num_requests_running") == 0 and metric("poise:kv_cache_usage_perc") == 0
    out = client.completions.create(model="tiny", prompt="still there?", max_tokens=3, n=2)
    assert [c.index for c in out.choices] == [0, 1]
