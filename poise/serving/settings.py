"""ServerSettings: what `poise serve` needs beyond the engine config (address, limits, shutdown).

Validation raises ``ValueError`` naming the field, like poise.config, so the CLI can print it.
Every limit and timeout here is listed with its flag and default in docs/reliability.md,
"Limits and timeouts".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from poise.config import _help, _require

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class RequestLimitsConfig:
    """What one HTTP request may ask of ``poise serve``; beyond each limit the answer is a 4xx
    that names the limit (docs/reliability.md lists them)."""

    max_request_body_bytes: int = _help(
        "Largest request body; a bigger one is answered 413 before it is read or parsed "
        "(Content-Length checked first, chunked bodies counted as they arrive).",
        default=4 * 1024 * 1024,
    )
    max_stop_sequences: int = _help(
        "Most stop strings one request may give (TGI's name); more is a 400.", default=16
    )
    max_stop_sequence_chars: int = _help(
        "Longest stop string, in characters; longer is a 400. Streamed text is held back by at "
        "most this many characters minus one while it may still become a stop string.",
        default=256,
    )
    max_stop_token_ids: int = _help(
        "Most stop_token_ids one request may give; more is a 400 (the engine checks them for "
        "every generated token).",
        default=256,
    )
    max_n: int = _help(
        "Largest n (samples per request); more is a 400. Each sample is a running sequence.",
        default=128,
    )
    max_logit_bias: int = _help(
        "Most logit_bias entries one request may give; more is a 400 (each entry is work in "
        "every step that samples the request).",
        default=300,
    )
    max_tokenizer_queue_chars: int = _help(
        "Characters of prompt text waiting for or in tokenization, all requests together; a "
        "request that would go beyond gets 429 + Retry-After instead of queueing behind "
        "seconds of tokenizer work (a request alone is always taken).",
        default=4_000_000,
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _require(value > 0, f.name, f"must be > 0, got {value}")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)
    log_interval_s: float = 10.0
    # SIGTERM/SIGINT: how long in-flight requests may run before they are cut (with an error
    # event or a 503); a second signal cuts them at once.
    shutdown_grace_s: float = 30.0
    uvicorn_log_level: str = "warning"
    # A JSON-lines step trace (poise.sim.trace): each engine step's shape and duration.
    step_trace: str | None = None
    # Slow clients: a request's headers must arrive within header_read_timeout_s of the
    # connection (or of its first byte on a kept-alive one), its body within
    # body_read_timeout_s of the headers; an idle kept-alive connection closes after
    # keep_alive_timeout_s. Connections beyond max_connections are answered 503.
    header_read_timeout_s: float = 10.0
    body_read_timeout_s: float = 60.0
    keep_alive_timeout_s: int = 5  # uvicorn's timeout_keep_alive, whole seconds
    max_connections: int = 1000
    # DNS-rebinding defence: when bound to a loopback address, the Host header must name
    # localhost, 127.0.0.1, [::1], the bound host or one of these; "*" turns the check off.
    allowed_hosts: list[str] = field(default_factory=list)
    # /docs, /redoc and /openapi.json; off by default (they describe the whole API to anyone).
    enable_api_docs: bool = False
    # Bearer key for every route but /health, /ready, /version and (by default) /metrics
    # (serving/auth.py).
    api_key: str | None = None
    # The operator's view (/metrics, /dashboard, /server_info): "open" (/metrics open, the rest
    # behind the key), "key" (all behind the key) or "localhost" (loopback clients only).
    metrics_access: str = "open"
    # Origins a browser may call the API from (CORS); none: no CORS headers at all.
    allowed_origins: list[str] = field(default_factory=list)
    # A Jinja chat template (the text; the CLI reads a file) replacing the tokenizer's own.
    chat_template: str | None = None
    # One structured log line per finished request (serving/request_log.py): ids, lengths,
    # timings, finish reason; never prompts or generated text.
    enable_log_requests: bool = False
    # vLLM's --enable-per-request-metrics: a request with "include_metrics": true gets its own
    # timing (serving/request_metrics.py) in the response body.
    enable_per_request_metrics: bool = False
    # vLLM's --otlp-traces-endpoint: one OpenTelemetry span per request (serving/tracing.py).
    otlp_traces_endpoint: str | None = None
    # What one request may ask (body size, stop strings, tokenizer queue): poise.config.
    limits: RequestLimitsConfig = field(default_factory=RequestLimitsConfig)
    # vLLM's --enable-auto-tool-choice / --tool-call-parser: tool_choice "auto" (the default
    # with tools) parses the model's calls with this parser (text/tool_calls.py).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Every `poise serve` option as given or defaulted (poise/cli/serve_flags.py), reported by
    # /server_info so a benchmark record names the whole server configuration.
    server_args: dict[str, Any] = field(default_factory=dict)

    @property
    def auto_tool_parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def __post_init__(self) -> None:
        for name in ("header_read_timeout_s", "body_read_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {value}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s: must be >= 0 seconds, got {self.shutdown_grace_s}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser (--tool-call-parser)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty")
        if self.metrics_access not in ("open", "key", "localhost"):
            raise ValueError(
                f"metrics_access: must be open, key or localhost, got {self.metrics_access!r}"
            )
        if self.metrics_access == "key" and self.api_key is None:
            raise ValueError("metrics_access: 'key' needs an API key (--api-key)")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(
                f"uvicorn_log_level: must be one of {UVICORN_LOG_LEVELS}, "
                f"got {self.uvicorn_log_level!r}"
            )
        if self.otlp_traces_endpoint is not None:
            from poise.serving.tracing import check_available

            check_available(self.otlp_traces_endpoint)
        if self.max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {self.max_connections}")
