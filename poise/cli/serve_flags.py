"""The flag registry of ``poise serve``: every option, declared once.

The engine's options are the config dataclasses' fields (poise/cli/options.py turns each into
a ``Flag``); the request limits are ``RequestLimitsConfig``'s fields; the rest are declared
below. Adding an option is one entry here (or one field in a config dataclass): the CLI, the
``ServerSettings`` it builds (``setting=``), ``/server_info``'s ``server_args`` and the tables
of docs/flags.md all follow from it.

``python -m poise.cli.serve_flags`` prints docs/flags.md.
"""

from __future__ import annotations

import argparse
import dataclasses

from poise.cli.flags import (
    GROUPS,
    Flag,
    add_flags,
    markdown_table,
    non_negative,
    positive,
    positive_int,
)
from poise.cli.options import config_flags, engine_flags, model_positional
from poise.cli.router_options import SCALE_OUT_FLAGS
from poise.serving.settings import UVICORN_LOG_LEVELS, RequestLimitsConfig
from poise.text.tool_calls import TOOL_PARSERS


def _names(value: list[str] | None) -> list[str]:
    return list(value or [])


def _api_key(value: str | None) -> str | None:
    from poise.serving.auth import api_key_from_env  # lazy: the auth module loads FastAPI

    return value or api_key_from_env()


def _chat_template(value: str | None) -> str | None:
    from poise.cli.serve import read_chat_template

    return read_chat_template(value)


SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("host", "server", "Address to bind.", "127.0.0.1", setting="host", vllm="--host"),
    Flag("port", "server", "Port to bind.", 8000, type=int, setting="port", vllm="--port"),
    Flag(
        "served_model_name",
        "server",
        "Model name(s) clients use in 'model'; the first one is reported.",
        nargs="+",
        metavar="NAME",
        setting="served_model_names",
        convert=_names,
        default_text="MODEL as typed; the embedded model's name without MODEL",
        vllm="--served-model-name",
    ),
    Flag(
        "shutdown_grace_period",
        "server",
        "On SIGTERM/SIGINT, how long in-flight requests may run (fractions allowed); then, or "
        "at a second signal, they are cut: streams get an error event and [DONE], other "
        "requests a 503.",
        30.0,
        type=non_negative,
        metavar="SECONDS",
        setting="shutdown_grace_s",
    ),
    Flag(
        "chat_template",
        "server",
        "Jinja chat template replacing the tokenizer's own: a file, or the template text itself.",
        metavar="FILE_OR_TEXT",
        setting="chat_template",
        convert=_chat_template,
        default_text="the model's",
        replicas=False,
        vllm="--chat-template",
    ),
    Flag(
        "enable_auto_tool_choice",
        "server",
        'tool_choice "auto" (the default when a request has tools): parse the model\'s tool '
        "calls with --tool-call-parser. Without it such requests are a 400.",
        False,
        action="store_true",
        setting="enable_auto_tool_choice",
        replicas=False,
        vllm="--enable-auto-tool-choice",
    ),
    Flag(
        "tool_call_parser",
        "server",
        "How the model writes tool calls: hermes = <tool_call>{json}</tool_call>.",
        choices=sorted(TOOL_PARSERS),
        setting="tool_call_parser",
        default_text="none",
        vllm="--tool-call-parser",
    ),
    Flag(
        "header_read_timeout",
        "server",
        "A request's headers must arrive within this time of the connection (or of its first "
        "byte on a kept-alive one); else 408 and the connection is closed.",
        10.0,
        type=positive,
        metavar="SECONDS",
        setting="header_read_timeout_s",
    ),
    Flag(
        "body_read_timeout",
        "server",
        "A request's body must arrive within this time of its headers; else 408 and the "
        "connection is closed.",
        60.0,
        type=positive,
        metavar="SECONDS",
        setting="body_read_timeout_s",
    ),
    Flag(
        "timeout_keep_alive",
        "server",
        "Close a kept-alive connection idle this long between requests (uvicorn's option).",
        5,
        type=positive_int,
        metavar="SECONDS",
        setting="keep_alive_timeout_s",
    ),
    Flag(
        "max_connections",
        "server",
        "Open connections beyond N are answered 503 (Retry-After: 1) and closed.",
        1000,
        type=positive_int,
        metavar="N",
        setting="max_connections",
    ),
    Flag(
        "allowed_hosts",
        "server",
        "Host header values accepted besides localhost, 127.0.0.1, [::1] and --host. Bound to "
        "a loopback address, other Hosts get 421 (a DNS-rebinding defence); bound elsewhere, "
        "the check applies only when this is given. '*' turns it off.",
        [],
        nargs="+",
        metavar="HOST",
        setting="allowed_hosts",
        convert=list,
    ),
    Flag(
        "enable_api_docs",
        "server",
        "Serve /docs, /redoc and /openapi.json.",
        False,
        action="store_true",
        setting="enable_api_docs",
    ),
    Flag(
        "api_key",
        "server",
        "Require 'Authorization: Bearer KEY' on every route but /health, /ready, /version and "
        "/metrics (see --metrics-access) (401 otherwise).",
        metavar="KEY",
        setting="api_key",
        convert=_api_key,
        default_text="$POISE_API_KEY, else $VLLM_API_KEY, else off",
        secret=True,
        replicas=False,
        vllm="--api-key",
    ),
    Flag(
        "metrics_access",
        "server",
        "Who may read /metrics, the live page /dashboard and /server_info: open (/metrics "
        "open, the rest behind --api-key when given), key (all behind --api-key) or localhost "
        "(clients on a loopback address only; 403 for others).",
        "open",
        choices=("open", "key", "localhost"),
        setting="metrics_access",
        replicas=False,
    ),
    Flag(
        "allowed_origins",
        "server",
        "Origins a browser may call the API from (CORS headers); '*' for any.",
        [],
        nargs="+",
        metavar="ORIGIN",
        setting="allowed_origins",
        convert=list,
        default_text="none, no CORS headers",
        replicas=False,
        vllm="--allowed-origins",
    ),
    Flag(
        "log_interval",
        "observability",
        "Seconds between 'engine busy' log lines (tokens/s, running, waiting, KV, "
        "preemptions); 0 turns them off.",
        10.0,
        type=float,
        metavar="SECONDS",
        setting="log_interval_s",
    ),
    Flag(
        "uvicorn_log_level",
        "observability",
        "uvicorn's own log level.",
        "warning",
        choices=UVICORN_LOG_LEVELS,
        setting="uvicorn_log_level",
        vllm="--uvicorn-log-level",
    ),
    Flag(
        "enable_log_requests",
        "observability",
        "Log one JSON line per finished request: id, class, prompt/cached/output tokens, way "
        "in, queue, prefill, TTFT, TPOT, e2e (ms), preemptions, finish reason. Prompts and "
        "generated text are never logged.",
        False,
        action="store_true",
        setting="enable_log_requests",
        replicas=False,
        vllm="--enable-log-requests",
    ),
    Flag(
        "enable_per_request_metrics",
        "observability",
        "Let a request ask for its own timing with \"include_metrics\": true: a 'metrics' "
        "object (TTFT, queue, way in, prefill, ITL, tok/s) on the response or the last "
        "streamed chunk, as vLLM's flag.",
        False,
        action="store_true",
        setting="enable_per_request_metrics",
        replicas=False,
        vllm="--enable-per-request-metrics",
    ),
    Flag(
        "otlp_traces_endpoint",
        "observability",
        "Export one OpenTelemetry trace span per request (its way in, queue, prefill, "
        "first-token scheduling and decode as child spans; gen_ai.* attributes) to this "
        "OTLP/HTTP endpoint, e.g. http://localhost:4318 (/v1/traces is added when the URL has "
        "no path). A request's traceparent header joins the client's trace. Needs the otel "
        "extra (pip install 'poise[otel]').",
        metavar="URL",
        setting="otlp_traces_endpoint",
        default_text="off",
        replicas=False,
        vllm="--otlp-traces-endpoint",
    ),
    Flag(
        "step_trace",
        "observability",
        "Write every engine step (its batch shape, wall and CPU time of the forward) to FILE "
        "as JSON lines: to check a `poise profile` cost model against real traffic.",
        metavar="FILE",
        setting="step_trace",
        default_text="off",
    ),
    Flag(
        "profile",
        "scheduler",
        "A `poise profile` cost model of this machine: seeds the scheduler's online step-cost "
        "estimate (TTFT forecasts, predictive admission, the budget controller) with its "
        "per-step and per-token terms.",
        metavar="FILE",
        default_text="a rough CPU guess, refined as steps run",
    ),
)

# Request limits: RequestLimitsConfig's fields; none reaches the replicas yet.
LIMIT_FLAGS: tuple[Flag, ...] = tuple(
    dataclasses.replace(f, replicas=False)
    for f in config_flags(RequestLimitsConfig, "request limits")
)


# The page's "Adding a flag" note, with a worked example (a flag poise does not have).
ADDING_A_FLAG = (
    "## Adding a flag",
    "",
    "A server option is one declaration, a `Flag` in `SERVER_FLAGS` (poise/cli/serve_flags.py); "
    "its spelling, type, default, help, group, vLLM and other spellings are there and nowhere "
    "else:",
    "",
    "```python",
    "Flag(",
    '    "max_log_len",  # --max-log-len; the argparse dest',
    '    "observability",  # the --help group and this page\'s table',
    '    "Characters of a prompt that a request log line shows.",',
    "    None,  # the default",
    "    type=positive_int,",
    '    metavar="N",',
    '    setting="max_log_len",  # the ServerSettings field it fills',
    '    vllm="--max-log-len",  # vLLM\'s spelling, taken as is',
    "),",
    "```",
    "",
    "The argparse option, the `ServerSettings` keyword, `/server_info`'s `server_args`, "
    "`poise bench`'s record and this page follow from it: cli/serve.py names no flag. The "
    "server reads the value from the `ServerSettings` field `setting=` names (declared beside "
    "the code that uses it). An engine "
    "option is likewise one field with `_help(...)` in a config dataclass (poise/config.py): "
    "its flag is generated. Then regenerate this page.",
)


def serve_flags() -> list[Flag]:
    """Every option of ``poise serve`` except the positional MODEL, in --help order."""
    flags = [*engine_flags(), *SERVER_FLAGS, *LIMIT_FLAGS, *SCALE_OUT_FLAGS]
    order = {title: i for i, (title, _) in enumerate(GROUPS)}
    return sorted(flags, key=lambda f: order[f.group])


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every option of ``poise serve``, grouped as in ``GROUPS``, MODEL a positional."""
    flags = serve_flags()
    add_flags(parser, flags, first=model_positional(flags))


def flags_page() -> str:
    """docs/flags.md: one table per group, generated from the registry."""
    flags = serve_flags()
    parts = [
        "# `poise serve` flags",
        "",
        "Generated from the flag registry (poise/cli/serve_flags.py) by "
        "`python -m poise.cli.serve_flags > docs/flags.md`; tests/serving/test_flag_registry.py "
        "fails when this page and the registry disagree. Other spellings (the seed's and other "
        "engines' names) are accepted too; the vLLM column names vLLM's flag where poise "
        "takes the same one.",
        "",
        *ADDING_A_FLAG,
    ]
    for title, description in GROUPS:
        mine = [f for f in flags if f.group == title]
        parts += ["", f"## {title}", "", description, "", markdown_table(mine)]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(flags_page(), end="")
