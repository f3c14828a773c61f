"""What eval harnesses and SDKs send, through the official openai client on a live `poise serve`
(tiny random float32 Llama, real SmolLM2 tokenizer): logprobs equal log_softmax of transformers'
logits, in OpenAI's completions and chat shapes, streaming and not; lm-eval's loglikelihood
request (echo + logprobs, max_tokens 0 or 1); lists of prompts answered as indexed choices; the
routes and shapes SDKs rely on (models.retrieve, OpenAI's error shape on 404 / 405, the
developer role, cached_tokens, max_tokens beyond the context, /tokenizer_info)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.serving.conftest import ServerProcess, metric_value, tiny_server

TOL = 1e-4
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with tiny_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("eval-api"),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-batched-tokens",
        "16",
        "--kv-cache-memory-bytes",
        "16MiB",
        "--block-size",
        "16",
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(hf: Any) -> Any:
    def logprobs(ids: list[int]) -> torch.Tensor:  # row i predicts token i + 1
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _text(tok: Any, tid: int) -> str:
    return str(tok.decode([tid]))


def test_echo_max_tokens_1_as_lm_eval_sends_it(
    client: openai.OpenAI, reference: Any, smol_tokenizer: Any
) -> None:
    """lm-eval's local-completions: echo, logprobs 1, max_tokens 1; it reads [ctxlen:-1]."""
    ids = smol_tokenizer.encode("Question: is the sky blue? Answer: yes")
    r = client.completions.create(
        model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + 1 and r.usage.completion_tokens == 1  # type: ignore[union-attr]
    ref = reference(ids)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(
        [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))], abs=TOL
    )
    generated = lp.token_logprobs[-1]
    assert generated is not None and math.isclose(generated, float(ref[-1].max()), abs_tol=TOL)
    assert r.choices[0].text.startswith(smol_tokenizer.decode(ids))
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top is not None and 1 <= len(top) <= 2 and value in top.values()


def test_echo_max_tokens_0_scores_the_prompt(
    client: openai.OpenAI, reference: Any, smol_tokenizer: Any
) -> None:
    """lm-eval's loglikelihood request; a 40-token prompt runs in chunks of 16."""
    prompt = "The capital of France is Paris, and the capital of Italy is Rome. " * 3
    ids = smol_tokenizer.encode(prompt)
    assert len(ids) > 32
    r = client.completions.create(
        model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == smol_tokenizer.decode(ids) and choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp is not None and lp.tokens == [_text(smol_tokenizer, t) for t in ids]
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(ids)
    for i in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[i], float(ref[i - 1, ids[i]]), abs_tol=TOL)
        top = ref[i - 1].topk(2)
        got = lp.top_logprobs[i]
        for tid, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert math.isclose(got[_text(smol_tokenizer, tid)], value, abs_tol=TOL)
    offsets = lp.text_offset
    assert offsets is not None and offsets[0] == 0
    assert all(offsets[i + 1] - offsets[i] == len(lp.tokens[i]) for i in range(len(ids) - 1))


def test_completion_logprobs_stream_and_not(
    client: openai.OpenAI, reference: Any, smol_tokenizer: Any
) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 6
    ids = smol_tokenizer.encode("Once upon a time")
    out_ids = smol_tokenizer.encode(r.choices[0].text, add_special_tokens=False)
    ref = reference(ids + out_ids)
    for j, value in enumerate(lp.token_logprobs):
        assert math.isclose(value, float(ref[len(ids) + j - 1].max()), abs_tol=TOL)  # greedy
        assert lp.top_logprobs is not None and len(lp.top_logprobs[j]) <= 4
    # Streamed: the same numbers, spread over the chunks.
    streamed: list[float] = []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.token_logprobs or [])
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_shape_and_values(
    client: openai.OpenAI, reference: Any, smol_tokenizer: Any
) -> None:
    from poise.text import apply_chat_template

    msgs = [{"role": "user", "content": "Say something."}]
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=msgs,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    prompt_ids = apply_chat_template(smol_tokenizer, msgs)
    ref_ids = list(prompt_ids)
    for j, entry in enumerate(content):
        row = reference(ref_ids)[-1]
        best = int(row.argmax())
        assert entry.token == _text(smol_tokenizer, best)
        assert math.isclose(entry.logprob, float(row[best]), abs_tol=TOL)
        assert entry.bytes == list(entry.token.encode())
        assert [t.token for t in entry.top_logprobs] == [
            _text(smol_tokenizer, t) for t in row.topk(2).indices.tolist()
        ], j
        ref_ids.append(best)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = []
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed.extend(ch.choices[0].logprobs.content or [])
    assert [c.token for c in streamed] == [c.token for c in content]
    # No logprobs asked: none sent.
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_batched_prompts_are_indexed_choices(client: openai.OpenAI, smol_tokenizer: Any) -> None:
    prompts = ["The first prompt", "A second, longer prompt than the first", "Third"]
    kw: dict[str, Any] = dict(
        model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == singles
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == sum(len(smol_tokenizer.encode(p)) for p in prompts)
    # Token-id lists, streamed: each choice's pieces carry its index.
    id_lists = [smol_tokenizer.encode(p) for p in prompts]
    texts = ["", "", ""]
    for chunk in client.completions.create(prompt=id_lists, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == singles


def test_batched_echo_scores_every_prompt(
    client: openai.OpenAI, reference: Any, smol_tokenizer: Any
) -> None:
    prompts = ["Question: two plus two? Answer: four", "Question: the sky? Answer: blue"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=0)
    for choice, p in zip(r.choices, prompts, strict=True):
        ids = smol_tokenizer.encode(p)
        ref = reference(ids)
        got = choice.logprobs.token_logprobs  # type: ignore[union-attr]
        assert choice.text == p and got is not None and len(got) == len(ids)
        want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert got[1:] == pytest.approx(want, abs=TOL)


def test_disconnect_aborts_every_prompt_of_a_batch(server: ServerProcess) -> None:
    """Leaving after the first chunk aborts all four requests (each would run 240 tokens)."""
    import time

    def aborted() -> float:
        text = httpx.get(server.base_url + "/metrics").text
        return metric_value(text, "poise:request_success_total", finished_reason="abort")

    before = aborted()
    body = {
        "model": "tiny",
        "prompt": ["one", "two", "three", "four"],
        "max_tokens": 240,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first piece is out; leave with the other requests running
    deadline = time.monotonic() + 10
    while aborted() < before + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted() == before + 4
    text = httpx.get(server.base_url + "/metrics").text
    assert metric_value(text, "poise:num_requests_running") == 0
    assert metric_value(text, "poise:kv_cache_usage_perc") == 0


def test_cached_tokens_in_usage(client: openai.OpenAI) -> None:
    prompt = "a shared prefix that fills more than one block of sixteen tokens " * 2
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    details = r.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= 16 and details.cached_tokens % 16 == 0
    # Scoring the prompt reads no cache (every position's logits are needed).
    scored = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    assert scored.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    chunks = chunks + list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 needs echo
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}, None),
    ],
)
def test_completions_refusals(client: openai.OpenAI, body: dict[str, Any], param: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", **body)
    assert info.value.status_code == 400
    if param:
        assert param in str(info.value)


def test_chat_refusals(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "x"}]
    for extra in (
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 21},
        {"stream_options": {"include_usage": True}},
    ):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, **extra)


def test_models_retrieve(client: openai.OpenAI) -> None:
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("not-served")
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"


def test_unknown_route_and_wrong_method_have_openai_error_shape(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.get("/nope", cast_to=object)
    assert isinstance(nf.value.body, dict) and nf.value.body["type"] == "invalid_request_error"
    r = httpx.get(server.base_url + "/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) >= {"message", "type", "code"}
    with pytest.raises(openai.APIStatusError) as na:
        client.get("/completions", cast_to=object)
    assert na.value.status_code == 405 and isinstance(na.value.body, dict)
    assert "message" in na.value.body


def test_developer_role_is_system(client: openai.OpenAI) -> None:
    def run(role: str) -> Any:
        return client.chat.completions.create(
            model="tiny",
            max_tokens=4,
            temperature=0,
            messages=[{"role": role, "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        )

    dev, system = run("developer"), run("system")
    assert dev.usage is not None and system.usage is not None
    assert dev.usage.prompt_tokens == system.usage.prompt_tokens
    assert dev.choices[0].message.content == system.choices[0].message.content


def test_max_tokens_beyond_the_context_names_both_numbers(
    client: openai.OpenAI, smol_tokenizer: Any
) -> None:
    prompt = "count the tokens of this prompt"
    n = len(smol_tokenizer.encode(prompt))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_MODEL_LEN)
    msg = str(info.value)
    assert str(n) in msg and str(MAX_MODEL_LEN - n) in msg and str(MAX_MODEL_LEN) in msg


def test_tokenizer_info_lets_lm_eval_use_the_servers_tokenizer(
    server: ServerProcess, smol_tokenizer: Any
) -> None:
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert info["eos_token"] == smol_tokenizer.eos_token
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["chat_template"] == smol_tokenizer.chat_template


def test_batched_prompts_with_n_number_choices_prompt_times_n_plus_sample(
    client: openai.OpenAI,
) -> None:
    prompts = ["The first prompt", "Second"]
    kw: dict[str, Any] = dict(
        model="tiny", max_tokens=3, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
    )
    singles = [client.completions.create(prompt=p, **kw).choices[0] for p in prompts]
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # greedy: both samples of a prompt are that prompt's completion
        single = singles[c.index // 2]
        assert c.text == single.text
        assert c.logprobs is not None and single.logprobs is not None
        assert c.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs)
    assert r.usage is not None and r.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError) as info:  # only one sample feeds the prompt
        client.completions.create(
            prompt=prompts, n=2, echo=True, model="tiny", max_tokens=1, logprobs=0
        )
    assert "n = 1" in str(info.value)
