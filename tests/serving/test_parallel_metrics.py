"""``n > 1`` is one request with n samples in the metrics (issue 38, as in vLLM): one
``request_success_total``, one TTFT and e2e observation and one prompt, every sample's tokens;
streamed and not, around the deterministic fake executor. Then the sample groups' rules on
their own: the worst reason names the request, a sample never admitted does not hold it open."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poise.core.outputs import RequestDelta
from poise.serving.sample_groups import SampleGroups
from tests.serving.conftest import InProcessServer
from tests.serving.test_request_metrics import _server


@pytest.fixture(scope="module")
def server(smol_tokenizer: Any) -> Any:
    with _server(smol_tokenizer, enabled=True) as s:
        yield s


def _scrape(server: InProcessServer) -> dict[str, float]:
    """Every sample of /metrics, summed over labels (one model, one class here)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


KEYS = (
    "poise:request_success_total",
    "poise:generation_tokens_total",
    "poise:prompt_tokens_total",
    "poise:time_to_first_token_seconds_count",
    "poise:e2e_request_latency_seconds_count",
    "poise:request_queue_time_seconds_count",
)


@pytest.mark.parametrize("stream", [False, True])
def test_n3_is_one_request_with_three_samples_tokens(server: InProcessServer, stream: bool) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    before = _scrape(server)
    kw: dict[str, Any] = {
        "model": "fake",
        "prompt": "one two three four",
        "n": 3,
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        )
        usage = chunks[-1].usage
        assert {c.index for ch in chunks for c in ch.choices} == {0, 1, 2}
    else:
        resp = client.completions.create(**kw)
        usage = resp.usage
        assert len(resp.choices) == 3
    assert usage is not None and usage.completion_tokens == 15
    after = _scrape(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in KEYS}
    assert delta == {
        "poise:request_success_total": 1,
        "poise:generation_tokens_total": 15,  # three sequences' tokens
        "poise:prompt_tokens_total": usage.prompt_tokens,  # one prompt, as usage says
        "poise:time_to_first_token_seconds_count": 1,
        "poise:e2e_request_latency_seconds_count": 1,
        "poise:request_queue_time_seconds_count": 1,
    }


def _end(rid: str, reason: str) -> RequestDelta:
    return RequestDelta(rid, [7], finished=True, finish_reason=reason)


def test_groups_count_once_with_the_worst_reason() -> None:
    groups = SampleGroups()
    groups.add(["0_r", "1_r", "2_r"])
    assert [groups.first_token(r) for r in ("1_r", "0_r", "2_r")] == [True, False, False]
    for rid in ("0_r", "1_r", "2_r"):
        groups.tokens(RequestDelta(rid, [1, 2]))
    assert groups.finished(_end("0_r", "stop")) is None
    assert groups.finished(_end("1_r", "abort")) is None
    end = groups.finished(_end("2_r", "length"))
    assert end is not None and end.reason == "abort" and end.num_output_tokens == 6
    assert len(groups) == 0  # nothing kept once the request ended
    single = groups.finished(_end("solo", "stop"))  # n == 1: never added, its own request
    assert single is not None and single.reason == "stop" and single.num_output_tokens is None


def test_a_sample_never_admitted_does_not_hold_the_request_open() -> None:
    groups = SampleGroups()
    groups.add(["0_q", "1_q"])
    assert groups.finished(_end("0_q", "abort")) is None  # aborted: its sibling was refused
    ends = groups.drop(["1_q"])
    assert [e.reason for e in ends] == ["abort"] and len(groups) == 0
    groups.add(["0_p", "1_p"])
    assert groups.drop(["1_p"]) == []  # refused before the admitted one ended
    end = groups.finished(_end("0_p", "abort"))
    assert end is not None and end.reason == "abort" and len(groups) == 0


def test_no_group_outlives_its_request(server: InProcessServer) -> None:
    """Cancelled n > 1 streams and finished ones alike leave nothing in the sample groups."""
    import time

    body = {
        "model": "fake",
        "prompt": "a b c",
        "n": 3,
        "max_tokens": 40,
        "stream": True,
        "ignore_eos": True,
    }
    for _ in range(3):
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leaving mid-stream aborts the three samples
    httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
    groups = server.state.engine.metrics.groups
    deadline = time.monotonic() + 10
    while len(groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(groups) == 0
