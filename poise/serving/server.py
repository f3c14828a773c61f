"""Wiring: EngineConfig -> EngineCore + tokenizer -> AsyncEngine -> FastAPI app -> uvicorn.

``build_state`` takes an already-built EngineCore (tests pass one with a fake executor);
``build_state_from_config`` builds the real one. ``uvicorn_config`` puts the app behind the
Host check (poise.serving.hosts) and the read deadlines and connection cap
(poise.serving.connections); ``serve`` runs it in the calling thread and returns 0 after a
graceful shutdown.

Shutdown (SIGTERM or SIGINT, poise.serving.shutdown): uvicorn stops accepting connections,
in-flight requests may finish for up to ``shutdown_grace_s`` seconds, then (or at a second
signal) they are cut with an error event or a 503, and the app's lifespan joins the engine
thread. uvicorn re-raises the captured signal after it returns; our own handler turns that
into a no-op so the process exits 0.
"""

from __future__ import annotations

import copy
import logging
import signal
import socket
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.middleware.cors import CORSMiddleware

from poise.config import EngineConfig
from poise.engine.observer import EngineObserver
from poise.serving.app import VERSION, ServingState, create_app
from poise.serving.async_engine import AsyncEngine
from poise.serving.auth import ApiKeyMiddleware, LoopbackOnlyMiddleware, open_paths
from poise.serving.connections import ConnectionLimits, protocol_class
from poise.serving.generation import Generator
from poise.serving.hosts import AllowedHostsMiddleware, allowed_host_names
from poise.serving.info import ConfigInfoCollector, describe
from poise.serving.metrics import ServingMetrics
from poise.serving.settings import ServerSettings
from poise.serving.shutdown import PoiseServer, backstop_timeout_s
from poise.serving.tokenize import add_tokenize_routes
from poise.serving.tracing import RequestTracer

if TYPE_CHECKING:  # the engine is imported lazily (it is built only by build_state_from_config)
    from poise.engine.core import EngineCore

__all__ = ["ServerSettings", "build_state", "build_state_from_config", "serve", "uvicorn_config"]

logger = logging.getLogger(__name__)


def build_state(
    core: EngineCore,
    tokenizer: Any,
    *,
    model_name: str,
    vocab_size: int | None = None,
    settings: ServerSettings | None = None,
    dtype: str | None = None,
    device: str | None = None,
    num_kv_blocks: int | None = None,
    default_sampling: dict[str, Any] | None = None,
) -> ServingState:
    """The server's state around ``core``; what the model load found (vocabulary, dtype,
    device, KV blocks, generation-config defaults) is given apart from the ``settings``."""
    settings = settings or ServerSettings()
    names = settings.served_model_names or [model_name]
    metrics = ServingMetrics(names[0], log_requests=settings.enable_log_requests)
    engine = AsyncEngine(core, metrics, log_interval_s=settings.log_interval_s)
    max_len = int(core.max_model_len)
    generator = Generator(
        engine,
        tokenizer,
        max_model_len=max_len,
        vocab_size=vocab_size,
        default_sampling=default_sampling,
        limits=settings.limits,
        tool_parser=settings.auto_tool_parser,
        grammars=core.grammars,
    )
    info = describe(
        core.config,
        model=names[0],
        version=VERSION,
        max_model_len=max_len,
        dtype=dtype,
        device=device,
        num_kv_blocks=num_kv_blocks,
        server_args=settings.server_args,
    )
    metrics.registry.register(ConfigInfoCollector(info))
    tracer = None
    if settings.otlp_traces_endpoint is not None:
        policy = core.config.scheduler.scheduling_policy
        tracer = RequestTracer(settings.otlp_traces_endpoint, policy=policy, clock=core.clock.now)
        logger.info("request traces: OTLP/HTTP to %s", tracer.endpoint)
    return ServingState(
        engine,
        generator,
        names,
        max_len,
        limits=settings.limits,
        info=info,
        enable_per_request_metrics=settings.enable_per_request_metrics,
        tracer=tracer,
        traffic_classes=_traffic_class_names(core),
    )


def _traffic_class_names(core: EngineCore) -> tuple[str, ...]:
    """The names a request's ``class`` may take (the scheduler's classes, loaded once)."""
    return tuple(core.scheduler.steer.classes.names)


def build_state_from_config(config: EngineConfig, settings: ServerSettings) -> ServingState:
    from poise.engine.builder import build_engine  # lazy: imports torch

    def observers(info: Any) -> list[EngineObserver]:  # a runner.factory.ModelInfo
        if not settings.step_trace:
            return []
        return [
            step_tracer(
                settings.step_trace,
                model=info.model_name,
                dtype=str(info.dtype),
                device=str(info.device),
                num_threads=config.model.num_threads,
            )
        ]

    core, info = build_engine(config, observers=observers)
    # vLLM's default served name: the model argument as typed (the embedded model: its name).
    name = config.model.model or info.model_name
    tokenizer = info.tokenizer
    if settings.chat_template is not None:
        if tokenizer is None:
            raise ValueError("chat_template: this model has no tokenizer to apply it with")
        tokenizer = copy.copy(tokenizer)  # load_tokenizer's object is cached and shared
        tokenizer.chat_template = settings.chat_template
    logger.info(
        "model %s: vocab %d, max_model_len %d, %d KV blocks of %d tokens, %s on %s",
        name,
        info.vocab_size,
        core.max_model_len,
        info.num_kv_blocks,
        info.block_size,
        info.dtype,
        info.device,
    )
    return build_state(
        core,
        tokenizer,
        model_name=name,
        vocab_size=info.vocab_size,
        settings=settings,
        dtype=str(info.dtype),
        device=str(info.device),
        num_kv_blocks=info.num_kv_blocks,
        default_sampling=info.default_sampling,
    )


def step_tracer(path: str, **provenance: Any) -> EngineObserver:
    """An engine observer that writes every step to ``path`` (a step trace)."""
    from poise.sim.trace import StepTracer, StepTraceWriter

    logger.info("step trace: writing every engine step to %s", path)
    return StepTracer(StepTraceWriter(path, source="poise serve", **provenance))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def asgi_app(state: ServingState, settings: ServerSettings) -> Any:
    """The FastAPI app, behind the Host check when the bind address calls for one."""
    app: Any = create_app(state, enable_api_docs=settings.enable_api_docs)
    add_tokenize_routes(app, state)
    if settings.api_key is not None:
        app = ApiKeyMiddleware(app, settings.api_key, open_paths(settings.metrics_access))
    if settings.metrics_access == "localhost":
        app = LoopbackOnlyMiddleware(app)
    if settings.allowed_origins:  # CORS only when asked (vLLM's --allowed-origins); outside
        # the key check, since a browser's preflight carries no Authorization header
        app = CORSMiddleware(
            app, allow_origins=settings.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    allowed = allowed_host_names(settings.host, settings.allowed_hosts)
    return app if allowed is None else AllowedHostsMiddleware(app, allowed)


def uvicorn_config(state: ServingState, settings: ServerSettings) -> uvicorn.Config:
    limits = ConnectionLimits(
        settings.header_read_timeout_s, settings.body_read_timeout_s, settings.max_connections
    )
    return uvicorn.Config(
        asgi_app(state, settings),
        host=settings.host,
        port=settings.port,
        http=protocol_class(limits),
        log_level=settings.uvicorn_log_level,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        timeout_graceful_shutdown=backstop_timeout_s(settings.shutdown_grace_s),
        access_log=False,
    )


def serve(state: ServingState, settings: ServerSettings) -> int:
    server = PoiseServer(uvicorn_config(state, settings), state.engine, settings.shutdown_grace_s)

    def _after_shutdown(signum: int, _frame: Any) -> None:
        logger.info("signal %d handled: shut down gracefully", signum)

    # uvicorn replaces these while it runs and re-raises the signal afterwards; with these
    # in place the re-raise is harmless and serve() returns normally.
    signal.signal(signal.SIGTERM, _after_shutdown)
    signal.signal(signal.SIGINT, _after_shutdown)
    logger.info(
        "serving %s on http://%s:%d", state.served_model_names, settings.host, settings.port
    )
    server.run()
    return 0
