"""`poise serve [MODEL]`: the OpenAI-compatible HTTP server; wiring only.

Every option is declared once in the flag registry (poise/cli/serve_flags.py; the engine's
come from the config dataclasses, spelled like vLLM's), so the seed lab's
``vllm serve MODEL --max-num-seqs 16 ...`` runs as ``poise serve MODEL --max-num-seqs 16 ...``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from poise.cli.flags import add_flags, refused_with_replicas, server_args, settings_kwargs
from poise.cli.options import config_from_args, engine_config_from_args
from poise.cli.router_options import router_from_args
from poise.cli.serve_flags import LIMIT_FLAGS, add_serve_flags, serve_flags
from poise.serving.settings import RequestLimitsConfig

HELP = "Serve a model over the OpenAI HTTP API."
DESCRIPTION = """
Serve a model over the OpenAI HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
/tokenize, /detokenize, /health, /ready, /metrics, /version). MODEL: a HF directory, a Hub id in
the local HF cache, a .gguf file; without it, the embedded SmolLM2-135M-Instruct.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_serve_flags(parser)


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
    from poise.serving.server import build_state_from_config, serve
    from poise.serving.settings import ServerSettings

    try:
        prior = step_cost_prior(args.profile) if args.profile else {}
        config = engine_config_from_args(args, **prior)
        limits = config_from_args(RequestLimitsConfig, args)
    except (ValueError, OSError) as exc:
        print(f"poise serve: error: {exc}", file=sys.stderr)
        return 2
    flags = serve_flags()
    try:
        settings = ServerSettings(
            **settings_kwargs(flags, args),
            limits=limits,
            server_args={**server_args(flags, args), "model": config.model.model},
        )
    except ValueError as exc:  # e.g. --metrics-access key without a key, a bad chat template
        print(f"poise serve: error: {exc}", file=sys.stderr)
        return 2
    if args.replicas > 1:
        given = refused_with_replicas(flags, args)
        if given:  # refused rather than ignored: the replicas do not take them yet
            message = f"{', '.join(given)} not supported with --replicas yet"
            print(f"poise serve: error: {message}", file=sys.stderr)
            return 2
        return _serve_replicas(args, config)
    try:
        state = build_state_from_config(config, settings)
    except Exception as exc:  # noqa: BLE001 - one clear line, not a traceback (issue 13)
        model = config.model.model or "the embedded model"
        print(
            f"poise serve: error: cannot load {model}: {type(exc).__name__}: {exc}", file=sys.stderr
        )
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
        print(
            "poise serve: error: --replicas needs Ray Serve: pip install 'poise[scale]'",
            file=sys.stderr,
        )
        return 2
    try:
        router = router_from_args(args, config.cache.block_size)
    except ValueError as exc:
        print(f"poise serve: error: {exc}", file=sys.stderr)
        return 2
    names = list(args.served_model_name or [])
    spec = DeploySpec(
        config,
        router["replicas"],
        router["router_config"],
        router["pools"],
        served_model_names=names,
    )
    return serve_replicas(spec, args.host, args.port)


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, LIMIT_FLAGS)
