"""The FastAPI app: OpenAI routes, health/readiness, metrics, and error mapping.

``create_app(state)`` builds one app around one ServingState (engine, tokenizer, metrics); the
app owns no globals, so tests can run several in one process. The AsyncEngine thread starts
and stops with the app's lifespan.

Error mapping (OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}``):
pydantic validation and InvalidRequestError -> 400, unknown model -> 404 model_not_found,
OverloadedError -> 429 + Retry-After, EngineDeadError and ShuttingDownError -> 503,
GenerationFailed -> 500. /docs, /redoc and /openapi.json exist only with ``enable_api_docs``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from poise.errors import EngineDeadError, InvalidRequestError, OverloadedError, ShuttingDownError
from poise.serving import streams
from poise.serving.async_engine import AsyncEngine
from poise.serving.dashboard import add_dashboard_routes
from poise.serving.generation import GenerationFailed, Generator
from poise.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


@dataclass
class ServingState:
    engine: AsyncEngine
    generator: Generator
    served_model_names: list[str]
    max_model_len: int
    version: str = VERSION
    # The server's self-description (poise.serving.info.describe), for GET /server_info.
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def metrics(self) -> Any:
        return self.engine.metrics


def error_response(
    status: int,
    message: str,
    *,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: int | str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=err_type, param=param, code=code or status)
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    msg = str(first.get("msg", "invalid request"))
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON: {msg}", param=None)
    if not loc and first.get("type") == "model_attributes_type":
        return error_response(400, "the request body must be a JSON object", param=None)
    where = ".".join(loc) if loc else "body"
    return error_response(400, f"{where}: {msg}", param=param)


def map_exception(exc: Exception, metrics: Any) -> JSONResponse:
    """The HTTP answer for an exception raised before a response started."""
    if isinstance(exc, InvalidRequestError):
        metrics.rejected(exc.reason)
        return error_response(400, exc.message, param=exc.param)
    if isinstance(exc, OverloadedError):
        metrics.rejected(exc.reason)
        # The header counts whole seconds: the engine's predicted wait, rounded up.
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return error_response(
            429, exc.message, err_type="rate_limit_error", code=exc.reason,
            headers={"Retry-After": retry},
        )  # fmt: skip
    if isinstance(exc, EngineDeadError):
        metrics.rejected("engine_dead")
        return error_response(503, str(exc), err_type="engine_dead", code=503)
    if isinstance(exc, ShuttingDownError):
        return error_response(503, str(exc), err_type="service_unavailable",
                              code="server_shutting_down")  # fmt: skip
    if isinstance(exc, GenerationFailed):
        return error_response(500, str(exc), err_type="internal_error", code=500)
    raise exc


def create_app(state: ServingState, *, enable_api_docs: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.stop()
            state.generator.close()

    on = enable_api_docs
    app = FastAPI(title="poise", version=state.version, lifespan=lifespan,
                  docs_url="/docs" if on else None, redoc_url="/redoc" if on else None,
                  openapi_url="/openapi.json" if on else None)  # fmt: skip
    app.state.serving = state

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        state.metrics.rejected("invalid")
        return _validation_error(exc)

    _add_info_routes(app, state)
    add_dashboard_routes(app, state)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await _generate(state, req, raw, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await _generate(state, req, raw, chat=False)

    return app


def _add_info_routes(app: FastAPI, state: ServingState) -> None:
    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [
            ModelCard(id=n, max_model_len=state.max_model_len) for n in state.served_model_names
        ]
        return ModelList(data=cards)

    @app.get("/health")
    async def health() -> Response:
        engine = state.engine
        if engine.alive:
            # Alive; a step that failed (and failed its requests) is reported, not fatal.
            return JSONResponse(
                {"status": "ok", "failed_steps": engine.num_failed_steps,
                 "last_error": engine.last_error}
            )  # fmt: skip
        msg = state.engine.error or "engine is not running"
        return error_response(503, msg, err_type="engine_dead", code=503)

    @app.get("/ready")
    async def ready() -> Response:
        if state.engine.can_accept():
            return JSONResponse({"status": "ready"})
        return error_response(503, "not ready: engine dead, stopping, or queue full",
                              err_type="not_ready", code=503)  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

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
            404, f"The model `{req.model}` does not exist; this server serves "
            f"{state.served_model_names}", param="model",
            code="model_not_found",
        )  # fmt: skip
    header_class = raw.headers.get("x-poise-class")
    if req.traffic_class is None and header_class:
        req.traffic_class = header_class.strip()  # the body's "class" wins over the header
    gen = state.generator
    model = req.model or state.served_model_names[0]
    try:
        if isinstance(req, ChatCompletionRequest):
            prep = await gen.prepare_chat(req, arrival)
        else:
            prep = await gen.prepare_completion(req, arrival)
        pieces = await gen.generate(prep)
    except Exception as exc:  # noqa: BLE001 - map_exception re-raises what it does not know
        return map_exception(exc, state.metrics)
    n_prompt = len(prep.prompt_token_ids)
    if req.stream:
        body = streams.sse(pieces, prep.request_id, model, n_prompt, chat=chat,
                           include_usage=req.include_usage)  # fmt: skip
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        result = await streams.collect_until_disconnect(pieces, raw)
    except Exception as exc:  # noqa: BLE001
        return map_exception(exc, state.metrics)
    if result is None:  # client left; nobody reads this
        return Response(status_code=499)
    resp = streams.full_response(result, prep.request_id, model, n_prompt, chat=chat)
    return Response(json.dumps(resp), media_type="application/json")
