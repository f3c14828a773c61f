"""Pieces -> OpenAI bodies: SSE chunks for streams, one JSON object otherwise.

Stream shape (chat): a first chunk with ``delta.role``, one chunk per text piece, a last chunk
with ``finish_reason``, then (``stream_options.include_usage``) a chunk with empty ``choices``
and the usage, then ``data: [DONE]``. Per-request timing (``include_metrics``) rides on the last
chunk before ``[DONE]``, and on the body of a response that is not streamed. An error after the stream started becomes one
``data: {"error": ...}`` event (the openai client raises it as APIError), then ``[DONE]``.

Invariant: leaving a stream early (client disconnect cancels the response task) closes the
pieces iterator, whose ``finally`` aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from poise.errors import InvalidRequestError, ShuttingDownError
from poise.serving.errors import GenerationFailed
from poise.serving.generation import Piece
from poise.serving.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
    now_s,
)


def _event(payload: str) -> str:
    return f"data: {payload}\n\n"


_Body = ChatCompletionResponse | ChatCompletionChunk | CompletionResponse


def _no_metrics(body: _Body) -> set[str] | None:
    # ``metrics`` appears only where a request asked for it (include_metrics).
    return {"metrics"} if body.metrics is None else None


def _json(body: _Body) -> str:
    return body.model_dump_json(exclude=_no_metrics(body))


def _chunk(rid: str, model: str, created: int, chat: bool, text: str | None,
           finish: str | None, role: str | None = None,
           metrics: dict[str, Any] | None = None) -> str:  # fmt: skip
    if chat:
        choice = ChatChunkChoice(delta=DeltaMessage(role=role, content=text), finish_reason=finish)
        return _json(ChatCompletionChunk(
            id=rid, created=created, model=model, choices=[choice], metrics=metrics
        ))  # fmt: skip
    c = CompletionChoice(text=text or "", finish_reason=finish)
    return _json(
        CompletionResponse(id=rid, created=created, model=model, choices=[c], metrics=metrics)
    )


def _usage_chunk(rid: str, model: str, created: int, chat: bool, usage: UsageInfo,
                 metrics: dict[str, Any] | None) -> str:  # fmt: skip
    if chat:
        return _json(ChatCompletionChunk(
            id=rid, created=created, model=model, choices=[], usage=usage, metrics=metrics
        ))  # fmt: skip
    return _json(CompletionResponse(
        id=rid, created=created, model=model, choices=[], usage=usage, metrics=metrics
    ))  # fmt: skip


def _error_event(exc: Exception) -> str:
    status, kind = 500, "internal_error"
    if isinstance(exc, InvalidRequestError):
        status, kind = 400, "invalid_request_error"
    elif isinstance(exc, ShuttingDownError):
        status, kind = 503, "service_unavailable"
    body = ErrorResponse(error=ErrorInfo(message=str(exc), type=kind, code=status))
    return _event(body.model_dump_json())


async def sse(
    pieces: AsyncIterator[Piece],
    rid: str,
    model: str,
    num_prompt_tokens: int,
    *,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = now_s()
    n_tokens = 0
    metrics = None  # per-request timing (include_metrics): on the last chunk before [DONE]
    try:
        if chat:
            yield _event(_chunk(rid, model, created, chat, "", None, role="assistant"))
        async for piece in pieces:
            n_tokens = piece.num_tokens
            if piece.finish_reason is None:
                yield _event(_chunk(rid, model, created, chat, piece.text, None))
                continue
            metrics = piece.metrics
            last = None if include_usage else metrics
            yield _event(_chunk(rid, model, created, chat, piece.text, piece.finish_reason,
                                metrics=last))  # fmt: skip
        if include_usage:
            usage = UsageInfo.of(num_prompt_tokens, n_tokens)
            yield _event(_usage_chunk(rid, model, created, chat, usage, metrics))
    except (GenerationFailed, InvalidRequestError, ShuttingDownError) as exc:
        yield _error_event(exc)
    finally:
        # Cancelled (client gone) or done: close the pieces iterator now, so its finally
        # aborts the request in the engine without waiting for garbage collection.
        with contextlib.suppress(Exception):
            await pieces.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"


@dataclass
class Result:
    text: str
    num_tokens: int
    finish_reason: str | None
    metrics: dict[str, Any] | None = None


async def _collect(pieces: AsyncIterator[Piece]) -> Result:
    parts: list[str] = []
    last = Piece("", 0)
    async for piece in pieces:
        parts.append(piece.text)
        last = piece
    return Result("".join(parts), last.num_tokens, last.finish_reason, last.metrics)


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_until_disconnect(pieces: AsyncIterator[Piece], raw: Request) -> Result | None:
    """Run a non-streaming request to the end; None (and aborted) if the client leaves first."""
    work = asyncio.ensure_future(_collect(pieces))
    gone = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            with contextlib.suppress(Exception):
                await pieces.aclose()  # type: ignore[attr-defined]
    if work.cancelled():
        return None
    return work.result()


def full_response(result: Result, rid: str, model: str, n_prompt: int, *, chat: bool) -> Any:
    usage = UsageInfo.of(n_prompt, result.num_tokens)
    body: _Body
    if chat:
        msg = ChatResponseMessage(content=result.text)
        choice = ChatChoice(message=msg, finish_reason=result.finish_reason)
        body = ChatCompletionResponse(
            id=rid, model=model, choices=[choice], usage=usage, metrics=result.metrics
        )
    else:
        c = CompletionChoice(text=result.text, finish_reason=result.finish_reason)
        body = CompletionResponse(
            id=rid, model=model, choices=[c], usage=usage, metrics=result.metrics
        )
    return body.model_dump(exclude=_no_metrics(body))
