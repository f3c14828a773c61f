"""The FastAPI app: OpenAI routes, health/readiness, metrics, and error mapping.

``create_app(state)`` builds one app around one ServingState (engine, tokenizer, metrics); the
app owns no globals, so tests can run several in one process. The AsyncEngine thread starts
and stops with the app's lifespan.

A request body goes through ``body.BodySizeLimit`` (413 before anything is read) and strict
JSON parsing (``body.OpenAIRoute``); every error is answered in OpenAI's shape (http_errors.py).
The published schema (``/openapi.json``) is the request models' constraints, with the error
answers the server really gives (400 with OpenAI's error model, never FastAPI's 422).
Statuses: validation and InvalidRequestError -> 400, unknown model -> 404 model_not_found,
OverloadedError -> 429 + Retry-After, EngineDeadError and ShuttingDownError -> 503,
GenerationFailed -> 500. /docs, /redoc and /openapi.json exist only with ``enable_api_docs``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.convertors import PathConvertor, register_url_convertor

from poise.serving import streams
from poise.serving.async_engine import AsyncEngine
from poise.serving.body import BodySizeLimit, OpenAIRoute
from poise.serving.completions import CompletionRequest
from poise.serving.dashboard import add_dashboard_routes
from poise.serving.generation import Generator
from poise.serving.http_errors import error_response, install_error_handlers, map_exception
from poise.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from poise.serving.settings import RequestLimitsConfig
from poise.serving.tracing import RequestTrace, RequestTracer

logger = logging.getLogger(__name__)
VERSION = "0.1.0"

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `param` names the field."},
    401: {"model": ErrorResponse, "description": "With --api-key: the key is missing or wrong."},
    404: {"model": ErrorResponse, "description": "`model` is not a served model name."},
    413: {"model": ErrorResponse, "description": "Body over --max-request-body-bytes."},
    429: {"model": ErrorResponse, "description": "Queue full; see the Retry-After header."},
    500: {"model": ErrorResponse, "description": "The engine failed this request."},
    503: {"model": ErrorResponse, "description": "The engine is dead or shutting down."},
}


def _generated(model: type) -> dict[int | str, dict[str, Any]]:
    ok = {
        "model": model,
        "content": {"text/event-stream": {}},
        "description": "The completion; with `stream`, SSE chunks then `data: [DONE]`.",
    }
    return {200: ok, **ERRORS}


@dataclass
class ServingState:
    engine: AsyncEngine
    generator: Generator
    served_model_names: list[str]
    max_model_len: int
    limits: RequestLimitsConfig = field(default_factory=RequestLimitsConfig)
    version: str = VERSION
    # The server's self-description (poise.serving.info.describe), for GET /server_info.
    info: dict[str, Any] = field(default_factory=dict)
    enable_per_request_metrics: bool = False  # --enable-per-request-metrics
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint
    # The traffic class names a request's ``class`` may take (--traffic-classes).
    traffic_classes: tuple[str, ...] = ("default",)

    @property
    def metrics(self) -> Any:
        return self.engine.metrics


def create_app(state: ServingState, *, enable_api_docs: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.stop()
            state.generator.close()
            if state.tracer is not None:
                state.tracer.shutdown()  # the spans still queued go out

    on = enable_api_docs
    app = FastAPI(
        title="poise",
        version=state.version,
        lifespan=lifespan,
        docs_url="/docs" if on else None,
        redoc_url="/redoc" if on else None,
        openapi_url="/openapi.json" if on else None,
    )
    app.router.route_class = OpenAIRoute
    app.state.serving = state
    app.add_middleware(BodySizeLimit, max_bytes=state.limits.max_request_body_bytes)
    install_error_handlers(app, state.metrics)
    _add_info_routes(app, state)
    add_dashboard_routes(app, state)

    @app.post("/v1/chat/completions", responses=_generated(ChatCompletionResponse))
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await _generate(state, req, raw, chat=True)

    @app.post("/v1/completions", responses=_generated(CompletionResponse))
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await _generate(state, req, raw, chat=False)

    app.openapi = lambda: _openapi(app, state)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI, state: ServingState) -> dict[str, Any]:
    """FastAPI's schema without the 422 it adds to every route with a body (this server answers
    validation errors with 400 and OpenAI's error model, documented per route), and with this
    server's configured limits on the fields they bound."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        models = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            _document_limits(models[name]["properties"], state)
        _document_vocabulary(models, state.generator.vocab_size)
        _document_models(models, state.served_model_names)
        app.openapi_schema = schema
    return app.openapi_schema


def _variants(prop: dict[str, Any], json_type: str) -> list[dict[str, Any]]:
    return [v for v in prop.get("anyOf", [prop]) if v.get("type") == json_type]


def _document_limits(props: dict[str, Any], state: ServingState) -> None:
    limits = state.limits
    for v in _variants(props["stop"], "string"):
        v["maxLength"] = limits.max_stop_sequence_chars
    for v in _variants(props["stop"], "array"):
        v["maxItems"] = limits.max_stop_sequences
        v["items"]["maxLength"] = limits.max_stop_sequence_chars
    for v in _variants(props["stop_token_ids"], "array"):
        v["maxItems"] = limits.max_stop_token_ids
    for v in _variants(props["n"], "integer"):
        v["maximum"] = limits.max_n
    for v in _variants(props["logit_bias"], "object"):
        v["maxProperties"] = limits.max_logit_bias
    for name in ("max_tokens", "max_completion_tokens"):
        for v in _variants(props.get(name, {}), "integer"):
            v["maximum"] = state.max_model_len - 1  # and the prompt must fit next to it
    for v in _variants(props.get("class", {}), "string"):
        v["enum"] = list(state.traffic_classes)
    if not state.enable_per_request_metrics and "include_metrics" in props:
        props["include_metrics"]["enum"] = [False]  # true is a 400 naming the flag


def _document_models(models: dict[str, Any], names: list[str]) -> None:
    """``model``, where a request may name one, is a served name (else 404)."""
    for model in models.values():
        for v in _variants(model.get("properties", {}).get("model", {}), "string"):
            v["enum"] = list(names)


def _document_vocabulary(models: dict[str, Any], vocab_size: int | None) -> None:
    """Token ids (a prompt, stop_token_ids, /detokenize's tokens) are below the vocabulary size."""
    if vocab_size is None:
        return

    def bound(schema: dict[str, Any]) -> None:
        if schema.get("type") == "integer" and schema.get("minimum") == 0:
            schema["maximum"] = vocab_size - 1
        for key in ("items", "anyOf"):
            parts = schema.get(key)
            for part in parts if isinstance(parts, list) else [parts] if parts else []:
                bound(part)

    fields = {
        "CompletionRequest": ("prompt", "stop_token_ids"),
        "ChatCompletionRequest": ("stop_token_ids",),
        "DetokenizeRequest": ("tokens",),
    }
    for model, names in fields.items():
        for name in names:
            if model in models and name in models[model]["properties"]:
                bound(models[model]["properties"][name])


class _AnyPathConvertor(PathConvertor):
    """Starlette's ``:path``, newlines included: its ``.*`` stops at one, so a model id holding
    a newline got the unknown-route 404 instead of ``model_not_found`` (the API fuzzer's large
    run found it)."""

    regex = "(?s:.*)"


register_url_convertor("anypath", _AnyPathConvertor())


def _add_info_routes(app: FastAPI, state: ServingState) -> None:
    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [
            ModelCard(id=n, max_model_len=state.max_model_len) for n in state.served_model_names
        ]
        return ModelList(data=cards)

    # A path: a served name may hold slashes (a Hub id such as Qwen/Qwen2.5-7B-Instruct).
    @app.get(
        "/v1/models/{model_id:anypath}",
        responses={
            404: ERRORS[400] | {"description": "Not a served model name (model_not_found)."}
        },
    )
    async def model(model_id: str) -> Response:
        if model_id not in state.served_model_names:
            return error_response(
                404,
                f"The model `{model_id}` does not exist; this server "
                f"serves {state.served_model_names}",
                param="model",
                code="model_not_found",
            )
        card = ModelCard(id=model_id, max_model_len=state.max_model_len)
        return JSONResponse(card.model_dump())

    @app.get("/health")
    async def health() -> Response:
        engine = state.engine
        if engine.alive:
            # Alive; a step that failed (and failed its requests) is reported, not fatal.
            return JSONResponse(
                {
                    "status": "ok",
                    "failed_steps": engine.num_failed_steps,
                    "last_error": engine.last_error,
                }
            )
        msg = state.engine.error or "engine is not running"
        return error_response(503, msg, err_type="engine_dead", code=503)

    @app.get("/ready")
    async def ready() -> Response:
        if state.engine.can_accept():
            return JSONResponse({"status": "ready"})
        return error_response(
            503, "not ready: engine dead, stopping, or queue full", err_type="not_ready", code=503
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": state.version}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return state.info


async def _generate(
    state: ServingState, req: ChatCompletionRequest | CompletionRequest, raw: Request, *, chat: bool
) -> Response:
    arrival = state.engine.core.clock.now()
    if req.model is not None and req.model not in state.served_model_names:
        state.metrics.rejected("invalid")
        return error_response(  # 404 as OpenAI and vLLM answer an unknown model
            404,
            f"The model `{req.model}` does not exist; this server serves "
            f"{state.served_model_names}",
            param="model",
            code="model_not_found",
        )
    if req.include_metrics and not state.enable_per_request_metrics:
        state.metrics.rejected("invalid")
        return error_response(
            400,
            "include_metrics: per-request metrics are off on this "
            "server; start it with --enable-per-request-metrics",
            param="include_metrics",
        )
    header_class = raw.headers.get("x-poise-class")
    if req.traffic_class is None and header_class:
        req.traffic_class = header_class.strip()  # the body's "class" wins over the header
    gen = state.generator
    model = req.model or state.served_model_names[0]
    trace = _trace(state, req, raw, model, chat, arrival)
    try:
        if isinstance(req, ChatCompletionRequest):
            preps = [await gen.prepare_chat(req, arrival)]
        else:
            # A list of prompts: each its own engine request, answered as indexed choices.
            preps = [await gen.prepare_completion(req, arrival, p) for p in req.prompts()]
        pieces = await gen.generate(preps)
        if preps[0].tools is not None:  # the reply's tool calls, out of its text (chat only)
            pieces = preps[0].tools.pieces(pieces)
    except Exception as exc:  # noqa: BLE001 - map_exception re-raises what it does not know
        if trace is not None:
            trace.refused(exc)
        return map_exception(exc, state.metrics)
    if trace is not None:
        trace.admitted(preps)
        pieces = trace.watch(pieces)
    n_prompt = sum(len(p.prompt_token_ids) for p in preps)
    rid = preps[0].request_id
    formatters = streams.Formatters(gen.tokenizer)
    if req.stream:
        body = streams.sse(
            pieces,
            rid,
            model,
            n_prompt,
            chat=chat,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            n=req.n * len(preps),
            formatters=formatters,
        )
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        results = await streams.collect_until_disconnect(pieces, raw)
    except Exception as exc:  # noqa: BLE001
        return map_exception(exc, state.metrics)
    if results is None:  # client left; nobody reads this
        return Response(status_code=499)
    resp = streams.full_response(results, rid, model, n_prompt, chat=chat, formatters=formatters)
    return Response(json.dumps(resp), media_type="application/json")


def _trace(
    state: ServingState,
    req: ChatCompletionRequest | CompletionRequest,
    raw: Request,
    model: str,
    chat: bool,
    arrival: float,
) -> RequestTrace | None:
    """The request's trace (--otlp-traces-endpoint), its parent from ``traceparent``."""
    if state.tracer is None:
        return None
    attrs = {"poise.class": req.traffic_class or "default", "poise.priority": req.priority}
    return state.tracer.start(
        raw.headers, "chat" if chat else "text_completion", model, arrival, attrs
    )
