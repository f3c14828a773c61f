"""Acceptance tests against one live `poise serve` subprocess (tiny random Llama, real SmolLM2
tokenizer), through the official openai client: info endpoints, the step trace, schemas, usage,
stop strings, seeds, ignore_eos, errors. Concurrency, disconnects, metrics and shutdown are in
test_live_load.py, against a server of its own (live_server.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from poise.text import apply_chat_template
from tests.serving.conftest import ServerProcess
from tests.serving.live_server import MAX_MODEL_LEN, live_server, metrics_text

MSG = [{"role": "user", "content": "Explain continuous batching in three sentences."}]


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with live_server(tiny_model_dir, tmp_path_factory.mktemp("live")) as proc:
        yield proc


def test_info_endpoints(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for path in ("/health", "/ready", "/version"):
        assert httpx.get(server.base_url + path).status_code == 200
    assert "poise:num_requests_running" in metrics_text(server)


def test_step_trace_records_each_step_of_a_request(
    server: ServerProcess, client: openai.OpenAI, smol_tokenizer: Any
) -> None:
    from poise.sim.trace import read_trace

    path = server.log_path.parent / "steps.jsonl"
    _, before = read_trace(path)
    client.completions.create(
        model="tiny",
        prompt="step trace " * 7,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    n_prompt = len(smol_tokenizer.encode("step trace " * 7))
    header, after = read_trace(path)
    new = after[len(before) :]
    assert header["source"] == "poise serve" and header["model"]
    # One prefill step that samples the first token, then one decode step per further token.
    assert [(s.shape.num_prefill_tokens, s.shape.num_decode_seqs) for s in new] == [
        (n_prompt, 0),
        (0, 1),
        (0, 1),
        (0, 1),
        (0, 1),
    ]
    assert [s.shape.decode_ctx_tokens for s in new[1:]] == [n_prompt + i for i in range(1, 5)]
    assert all(s.cpu_s is not None and 0 < s.cpu_s <= s.wall_s + 0.002 for s in new)
    assert all(a.start_s < b.start_s for a, b in zip(new, new[1:], strict=False))


def test_chat_stream_and_non_stream_agree_and_usage_is_real(
    client: openai.OpenAI, smol_tokenizer: Any
) -> None:
    n_prompt = len(apply_chat_template(smol_tokenizer, MSG))
    full = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_completion_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.object == "chat.completion" and full.choices[0].finish_reason == "length"
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 12)
    content = full.choices[0].message.content or ""
    assert content and content == smol_tokenizer.decode(
        smol_tokenizer.encode(content, add_special_tokens=False)
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == n_prompt + 12


def test_completions_text_and_token_ids(client: openai.OpenAI, smol_tokenizer: Any) -> None:
    prompt = "The scheduler decides"
    ids = smol_tokenizer.encode(prompt)
    by_text = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(ids)
    assert by_text.choices[0].text == by_ids.choices[0].text
    streamed = client.completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[: text.index(stop)]
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=stream,
        )
        if stream:
            parts = list(client.completions.create(**kwargs))
            got = "".join(p.choices[0].text for p in parts if p.choices)
            reason = [p.choices[0].finish_reason for p in parts if p.choices][-1]
        else:
            out = client.completions.create(**kwargs)
            got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (got, reason) == (cut, "stop")


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=16,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            extra_body={"top_k": 50, "ignore_eos": True},
        )
        return out.choices[0].message.content or ""

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9))


def test_ignore_eos_gives_exactly_max_tokens(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=40,
        temperature=0.8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_p": 0.01},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
    ],
)
def test_invalid_requests_are_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MSG, "max_tokens": 4}
    kwargs.update(body)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs)
    err = info.value.body
    assert isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}
    if param == "messages" and body["messages"]:
        assert str(MAX_MODEL_LEN) in err["message"] and "prompt has" in err["message"]
    else:
        assert err["param"] == param


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    # OpenAI's and vLLM's answer (it was 400 until issue 13).
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=MSG, max_tokens=4)  # type: ignore[arg-type]
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-4" in err["message"] and "tiny" in err["message"]


def test_malformed_json_is_400(server: ServerProcess) -> None:
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
