"""`poise serve [MODEL]`: the OpenAI-compatible HTTP server; wiring only.

Engine flags come from poise.cli.options (vLLM's spelling), so the seed lab's
``vllm serve MODEL --max-num-seqs 16 ...`` runs as ``poise serve MODEL --max-num-seqs 16 ...``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from poise.cli.options import (
    add_config_group,
    add_engine_args,
    config_from_args,
    engine_config_from_args,
)
from poise.cli.router_options import add_router_args, router_from_args
from poise.serving.settings import UVICORN_LOG_LEVELS, RequestLimitsConfig
from poise.text.tool_calls import TOOL_PARSERS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over the OpenAI HTTP API.",
        description="Serve a model over the OpenAI HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /tokenize, /detokenize, /health, /ready, /metrics, "
        "/version). MODEL: a HF directory, a Hub id in the local HF cache, a .gguf file; "
        "without it, the embedded SmolLM2-135M-Instruct.",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address to bind. (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="Port to bind. (default: 8000)")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Model name(s) clients use in 'model'; the first one is reported. "
        "(default: MODEL as typed; the embedded model's name without MODEL)",
    )
    server.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="Seconds between 'engine busy' log lines (tokens/s, running, waiting, KV, "
        "preemptions); 0 turns them off. (default: 10)",
    )
    server.add_argument(
        "--shutdown-grace-period",
        type=_non_negative,
        default=30.0,
        metavar="SECONDS",
        help="On SIGTERM/SIGINT, how long in-flight requests may run (fractions allowed); "
        "then, or at a second signal, they are cut: streams get an error event and "
        "[DONE], other requests a 503. (default: 30)",
    )
    limits = parser.add_argument_group(
        "connections", "Limits on slow and surplus clients (docs/reliability.md)."
    )
    limits.add_argument(
        "--header-read-timeout",
        type=_positive,
        default=10.0,
        metavar="SECONDS",
        help="A request's headers must arrive within this time of the connection (or of its "
        "first byte on a kept-alive one); else 408 and the connection is closed. (default: 10)",
    )
    limits.add_argument(
        "--body-read-timeout",
        type=_positive,
        default=60.0,
        metavar="SECONDS",
        help="A request's body must arrive within this time of its headers; else 408 and the "
        "connection is closed. (default: 60)",
    )
    limits.add_argument(
        "--timeout-keep-alive",
        type=_positive_int,
        default=5,
        metavar="SECONDS",
        help="Close a kept-alive connection idle this long between requests (uvicorn's "
        "option). (default: 5)",
    )
    limits.add_argument(
        "--max-connections",
        type=_positive_int,
        default=1000,
        metavar="N",
        help="Open connections beyond N are answered 503 (Retry-After: 1) and closed. "
        "(default: 1000)",
    )
    exposure = parser.add_argument_group("exposure")
    exposure.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="Host header values accepted besides localhost, 127.0.0.1, [::1] and --host. "
        "Bound to a loopback address, other Hosts get 421 (a DNS-rebinding defence); "
        "bound elsewhere, the check applies only when this is given. '*' turns it off.",
    )
    exposure.add_argument(
        "--enable-api-docs",
        action="store_true",
        help="Serve /docs, /redoc and /openapi.json. (default: off)",
    )
    exposure.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health, /ready, /version "
        "and /metrics (see --metrics-access) (401 otherwise). Default: $POISE_API_KEY, else "
        "$VLLM_API_KEY, else off.",
    )
    exposure.add_argument(
        "--metrics-access",
        default="open",
        choices=("open", "key", "localhost"),
        help="Who may read /metrics, the live page /dashboard and /server_info: open (/metrics "
        "open, the rest behind --api-key when given), key (all behind --api-key) or localhost "
        "(clients on a loopback address only; 403 for others). (default: open)",
    )
    exposure.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="Origins a browser may call the API from (CORS headers); '*' for any. "
        "(default: none, no CORS headers)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEXT",
        help="Jinja chat template replacing the tokenizer's own: a file, or the template text "
        "itself. (default: the model's)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default when a request has tools): parse the model\'s '
        "tool calls with --tool-call-parser. Without it such requests are a 400. (default: off)",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="How the model writes tool calls: hermes = <tool_call>{json}</tool_call>. "
        "(default: none)",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's own log level. (default: warning)",
    )
    server.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log one JSON line per finished request: id, class, prompt/cached/output tokens, "
        "way in, queue, prefill, TTFT, TPOT, e2e (ms), preemptions, finish reason. Prompts "
        "and generated text are never logged. (default: off)",
    )
    server.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help='Let a request ask for its own timing with "include_metrics": true: a '
        "'metrics' object (TTFT, queue, way in, prefill, ITL, tok/s) on the response or the "
        "last streamed chunk, as vLLM's flag. (default: off)",
    )
    server.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="Export one OpenTelemetry trace span per request (its way in, queue, prefill, "
        "first-token scheduling and decode as child spans; gen_ai.* attributes) to this "
        "OTLP/HTTP endpoint, e.g. http://localhost:4318 (/v1/traces is added when the URL has "
        "no path). A request's traceparent header joins the client's trace. vLLM's flag; "
        "needs the otel extra (pip install 'poise[otel]'). (default: off)",
    )
    server.add_argument(
        "--step-trace",
        default=None,
        metavar="FILE",
        help="Write every engine step (its batch shape, wall and CPU time of the forward) to "
        "FILE as JSON lines: to check a `poise profile` cost model against real traffic. "
        "(default: off)",
    )
    server.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="A `poise profile` cost model of this machine: seeds the scheduler's online "
        "step-cost estimate (TTFT forecasts, predictive admission, the budget controller) with "
        "its per-step and per-token terms. (default: a rough CPU guess, refined as steps run)",
    )
    add_request_limit_args(parser)
    add_engine_args(parser, positional_model=True)
    add_router_args(parser)
    parser.set_defaults(func=run)


def step_cost_prior(profile: str) -> dict[str, float]:
    """The estimator's prior (seconds per step, per token) from a profile's linear fit."""
    from poise.sim.fit import load_profile

    model = load_profile(profile)
    const = model.coefficients.get("const", 0.0) + model.step_overhead_s
    per_token = model.coefficients.get("tokens", 0.0)
    if const <= 0 or per_token <= 0:
        raise ValueError(f"profile: {profile} has no positive const / tokens coefficients")
    return {"step_cost_const_s": const, "step_cost_per_token_s": per_token}


def run(args: argparse.Namespace) -> int:
    from poise.serving.auth import api_key_from_env
    from poise.serving.server import build_state_from_config, serve
    from poise.serving.settings import ServerSettings

    try:
        prior = step_cost_prior(args.profile) if args.profile else {}
        config = engine_config_from_args(args, **prior)
        chat_template = read_chat_template(args.chat_template)
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        limits = config_from_args(RequestLimitsConfig, args)
    except (ValueError, OSError) as exc:
        print(f"poise serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        settings = ServerSettings(
            host=args.host,
            port=args.port,
            served_model_names=list(args.served_model_name or []),
            log_interval_s=args.log_interval,
            shutdown_grace_s=args.shutdown_grace_period,
            header_read_timeout_s=args.header_read_timeout,
            body_read_timeout_s=args.body_read_timeout,
            keep_alive_timeout_s=args.timeout_keep_alive,
            max_connections=args.max_connections,
            allowed_hosts=list(args.allowed_hosts),
            enable_api_docs=args.enable_api_docs,
            enable_log_requests=args.enable_log_requests,
            enable_per_request_metrics=args.enable_per_request_metrics,
            step_trace=args.step_trace,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            api_key=args.api_key or api_key_from_env(),
            metrics_access=args.metrics_access,
            allowed_origins=list(args.allowed_origins),
            chat_template=chat_template,
            uvicorn_log_level=args.uvicorn_log_level,
            limits=limits,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
        )
    except ValueError as exc:  # e.g. --metrics-access key without a key
        print(f"poise serve: error: {exc}", file=sys.stderr)
        return 2
    if args.replicas > 1:
        given = [flag for flag, value in (("--api-key", settings.api_key),
                 ("--metrics-access", settings.metrics_access != "open"),
                 ("--allowed-origins", settings.allowed_origins),
                 ("--chat-template", chat_template), ("--enable-log-requests",
                 args.enable_log_requests), ("--enable-per-request-metrics",
                 args.enable_per_request_metrics), ("--enable-auto-tool-choice",
                 args.enable_auto_tool_choice), ("--otlp-traces-endpoint",
                 args.otlp_traces_endpoint), ("request limit flags (--max-request-body-bytes, "
                 "--max-stop-*, --max-tokenizer-queue-chars)", limits != RequestLimitsConfig()))
                 if value]  # fmt: skip
        if given:  # refused rather than ignored: the replicas do not take them yet
            print(f"poise serve: error: {', '.join(given)} not supported with --replicas yet",
                  file=sys.stderr)  # fmt: skip
            return 2
        return _serve_replicas(args, config)
    try:
        state = build_state_from_config(config, settings)
    except Exception as exc:  # noqa: BLE001 - one clear line, not a traceback (issue 13)
        model = config.model.model or "the embedded model"
        print(f"poise serve: error: cannot load {model}: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    return serve(state, settings)


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's content, or the text itself when it looks like Jinja."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def _serve_replicas(args: argparse.Namespace, config: Any) -> int:
    """N engine replicas on a local Ray Serve instance behind poise's router."""
    try:
        import ray  # noqa: F401  (the optional extra: say so before anything starts)

        from poise.deploy.app import DeploySpec
        from poise.deploy.launch import serve_replicas
    except ImportError:
        print("poise serve: error: --replicas needs Ray Serve: pip install 'poise[scale]'",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        router = router_from_args(args, config.cache.block_size)
    except ValueError as exc:
        print(f"poise serve: error: {exc}", file=sys.stderr)
        return 2
    spec = DeploySpec(config, router["replicas"], router["router_config"], router["pools"],
                      served_model_names=list(args.served_model_name or []))  # fmt: skip
    return serve_replicas(spec, args.host, args.port)


def _number(text: str, kind: type, ok: Any, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def _positive(text: str) -> float:
    return float(_number(text, float, lambda v: v > 0, "> 0"))


def _non_negative(text: str) -> float:
    return float(_number(text, float, lambda v: v >= 0, ">= 0"))


def _positive_int(text: str) -> int:
    return int(_number(text, int, lambda v: v > 0, "a whole number > 0"))


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    add_config_group(
        parser,
        "request limits",
        "What one HTTP request may ask of the server; beyond a limit the answer is a 4xx that "
        "names it.",
        RequestLimitsConfig,
    )
