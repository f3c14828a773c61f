"""`poise serve [MODEL]`: the OpenAI-compatible HTTP server; wiring only.

Engine flags come from poise.cli.options (vLLM's spelling), so the seed lab's
``vllm serve MODEL --max-num-seqs 16 ...`` runs as ``poise serve MODEL --max-num-seqs 16 ...``.
"""

from __future__ import annotations

import argparse
import sys

from poise.cli.options import add_engine_args, engine_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over the OpenAI HTTP API.",
        description="Serve a model over the OpenAI HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /ready, /metrics, /version). Without MODEL, "
        "serves the embedded SmolLM2-135M-Instruct.",
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
        "(default: the model's own name)",
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
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="On SIGTERM, how long in-flight requests may run before they are aborted. "
        "(default: 30)",
    )
    server.add_argument(
        "--step-trace",
        default=None,
        metavar="FILE",
        help="Write every engine step (its batch shape, wall and CPU time of the forward) to "
        "FILE as JSON lines: to check a `poise profile` cost model against real traffic. "
        "(default: off)",
    )
    add_engine_args(parser, positional_model=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from poise.serving.server import ServerSettings, build_state_from_config, serve

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"poise serve: error: {exc}", file=sys.stderr)
        return 2
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=list(args.served_model_name or []),
        log_interval_s=args.log_interval,
        shutdown_grace_s=args.shutdown_grace_period,
        step_trace=args.step_trace,
    )
    state = build_state_from_config(config, settings)
    return serve(state, settings)
