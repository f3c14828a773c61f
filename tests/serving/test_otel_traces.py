"""OpenTelemetry request traces (``--otlp-traces-endpoint``, issue 38) against a real OTLP/HTTP
receiver this test starts: an HTTP server that takes ``POST /v1/traces``, decodes the
protobuf ``ExportTraceServiceRequest`` with OpenTelemetry's own message classes and answers as
a collector does. The server is the real app with the SDK's exporter, around the deterministic
fake executor (10 ms steps)."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http",
    reason="the otel extra (pip install 'poise[otel]'; `make setup` installs it) is absent",
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: E402

from poise.config import EngineConfig  # noqa: E402
from poise.engine.core import EngineCore  # noqa: E402
from poise.serving.server import build_state  # noqa: E402
from poise.serving.settings import ServerSettings  # noqa: E402
from poise.serving.tracing import traces_url  # noqa: E402
from poise.text import eos_token_ids  # noqa: E402
from tests.serving.conftest import InProcessServer  # noqa: E402
from tests.serving.test_observability import SlowExecutor  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PARTS = ["ingress", "queue", "prefill", "first_token_scheduling"]


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.content_types: set[str] = set()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.content_types.add(self.headers.get("Content-Type", ""))
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(smol_tokenizer: Any, receiver: Receiver) -> Iterator[InProcessServer]:
    vocab = len(smol_tokenizer)
    cfg = EngineConfig.from_kwargs(block_size=16, scheduling_policy="priority")
    core = EngineCore(
        cfg,
        SlowExecutor(vocab, 16, 0.01),
        num_kv_blocks=256,
        max_model_len=1024,
        vocab_size=vocab,
        eos_token_ids=eos_token_ids(smol_tokenizer),
    )
    settings = ServerSettings(enable_per_request_metrics=True, otlp_traces_endpoint=receiver.url)
    state = build_state(
        core, smol_tokenizer, model_name="fake", vocab_size=vocab, settings=settings
    )
    with InProcessServer(state) as s:
        s.state = state  # type: ignore[attr-defined]
        yield s


def _attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
            if (kind == "array_value")
            else getattr(v, kind)
        )
    return out


def _tree(server: Any, receiver: Receiver, trace_id: str, n_spans: int) -> list[trace_pb2.Span]:
    assert server.state.tracer.flush()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = [s for s in receiver.spans if s.trace_id.hex() == trace_id]
        if len(spans) >= n_spans:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"{len(spans)} spans of trace {trace_id} received")


def _ms(span: trace_pb2.Span) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6


def test_a_request_is_one_span_tree_in_the_clients_trace(server: Any, receiver: Receiver) -> None:
    body = {
        "model": "fake",
        "prompt": "one two three four five",
        "max_tokens": 6,
        "ignore_eos": True,
        "include_metrics": True,
        "priority": 2,
        "class": "long",
    }
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    spans = _tree(server, receiver, TRACE_ID, 6)
    assert receiver.content_types == {"application/x-protobuf"}
    (root,) = [s for s in spans if s.parent_span_id.hex() == CLIENT_SPAN]
    assert root.name == "text_completion fake" and root.kind == trace_pb2.Span.SPAN_KIND_SERVER
    attrs = _attrs(root)
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "fake"
    assert attrs["gen_ai.response.id"] == out["id"]
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.usage.input_tokens"] == out["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == out["usage"]["completion_tokens"] == 6
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert (attrs["poise.class"], attrs["poise.priority"], attrs["poise.policy"]) == (
        "long",
        2,
        "priority",
    )
    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert sorted(children) == sorted([*PARTS, "decode"])
    ttft_ms = out["metrics"]["time_to_first_token_ms"]
    assert ttft_ms > 0
    assert sum(_ms(children[p]) for p in PARTS) == pytest.approx(ttft_ms, abs=5.0)
    assert attrs["poise.latency.ttft_s"] * 1000 == pytest.approx(ttft_ms, abs=0.01)
    # The parts follow one another from arrival, and the tree lies inside its root.
    chain = [children[p] for p in [*PARTS, "decode"]]
    assert chain[0].start_time_unix_nano == root.start_time_unix_nano
    for a, b in zip(chain, chain[1:], strict=False):
        assert abs(b.start_time_unix_nano - a.end_time_unix_nano) < 1_000_000  # < 1 ms
    assert chain[-1].end_time_unix_nano <= root.end_time_unix_nano
    assert _ms(children["decode"]) == pytest.approx(out["metrics"]["decode_time_ms"], abs=1.0)


def test_without_traceparent_a_trace_of_its_own_and_refusals_are_errors(
    server: Any, receiver: Receiver
) -> None:
    before = {s.trace_id for s in receiver.spans}
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        json={
            "model": "fake",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        assert r.status_code == 200 and list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
    bad = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "fake", "prompt": "x", "max_tokens": 100_000},
    )
    assert bad.status_code == 400
    assert server.state.tracer.flush()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        roots = [s for s in receiver.spans if s.trace_id not in before and not s.parent_span_id]
        if len(roots) >= 2:
            break
        time.sleep(0.05)
    chat = [s for s in roots if s.name == "chat fake"]
    refused = [s for s in roots if s.name == "text_completion fake"]
    assert len(chat) == 1 and len(refused) == 1
    attrs = _attrs(chat[0])
    assert attrs["gen_ai.request.choice.count"] == 2
    assert attrs["gen_ai.usage.output_tokens"] == 6  # both samples' tokens
    assert attrs["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert refused[0].status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert _attrs(refused[0])["error.type"] == "InvalidRequestError"


def test_the_endpoint_url() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        traces_url("collector:4317")


def test_a_bad_endpoint_is_refused_before_a_model_loads() -> None:
    from poise.serving.settings import ServerSettings

    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerSettings(otlp_traces_endpoint="localhost:4317")
    assert ServerSettings(otlp_traces_endpoint="http://127.0.0.1:4318").otlp_traces_endpoint
