"""Pieces -> OpenAI bodies: SSE chunks for streams, one JSON object otherwise.

Stream shape (chat): a first chunk with ``delta.role``, one chunk per text piece, a last chunk
with ``finish_reason``, then (``stream_options.include_usage``) a chunk with empty ``choices``
and the usage, then ``data: [DONE]``. With ``continuous_usage_stats`` too (vLLM's extension),
every chunk also carries the usage so far. Per-request timing (``include_metrics``) rides on the
last chunk before ``[DONE]``, and on the body of a response that is not streamed (with several
choices: the timing of the one that finished last). Choices: ``n`` samples of each prompt of a
list (completions), choice ``index`` = prompt * n + sample; each chunk carries one choice, with
its logprobs (serving/logprobs.py) when asked. An error after the stream started becomes one
``data: {"error": ...}`` event (the openai client raises it as APIError), then ``[DONE]``.

Invariant: leaving a stream early (client disconnect cancels the response task) closes the
pieces iterator, whose ``finally`` aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from poise.errors import EngineDeadError, InvalidRequestError, ShuttingDownError
from poise.serving.generation import Piece
from poise.serving.http_errors import GenerationFailed
from poise.serving.logprobs import ChatLogprobs, CompletionLogprobs, LogprobEntry, LogprobFormatter
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
from poise.serving.tool_calls import merge_deltas


def _event(payload: str) -> str:
    return f"data: {payload}\n\n"


_Body = ChatCompletionResponse | ChatCompletionChunk | CompletionResponse


def _no_metrics(body: _Body) -> set[str] | None:
    # ``metrics`` appears only where a request asked for it (include_metrics).
    return {"metrics"} if body.metrics is None else None


def _json(body: _Body) -> str:
    return body.model_dump_json(exclude=_no_metrics(body))


class Formatters:
    """One LogprobFormatter per choice (a completions choice keeps its text offset across
    chunks), made on first use."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._by_index: dict[int, LogprobFormatter] = {}

    def shape(
        self, index: int, entries: list[LogprobEntry] | None, chat: bool
    ) -> ChatLogprobs | CompletionLogprobs | None:
        if entries is None:
            return None
        fmt = self._by_index.get(index)
        if fmt is None:
            fmt = self._by_index[index] = LogprobFormatter(self._tokenizer)
        return fmt.chat(entries) if chat else fmt.completion(entries)


def _chunk(
    rid: str,
    model: str,
    created: int,
    chat: bool,
    text: str | None,
    finish: str | None,
    role: str | None = None,
    usage: UsageInfo | None = None,
    index: int = 0,
    metrics: dict[str, Any] | None = None,
    logprobs: ChatLogprobs | CompletionLogprobs | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> str:
    if chat:
        assert logprobs is None or isinstance(logprobs, ChatLogprobs)
        if tool_calls and not text:
            text = None  # OpenAI: a tool-call delta has no content
        delta = DeltaMessage(role=role, content=text, tool_calls=tool_calls)
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return _json(
            ChatCompletionChunk(
                id=rid, created=created, model=model, choices=[choice], usage=usage, metrics=metrics
            )
        )
    assert logprobs is None or isinstance(logprobs, CompletionLogprobs)
    c = CompletionChoice(index=index, text=text or "", finish_reason=finish, logprobs=logprobs)
    return _json(
        CompletionResponse(
            id=rid, created=created, model=model, choices=[c], usage=usage, metrics=metrics
        )
    )


def _usage_chunk(
    rid: str, model: str, created: int, chat: bool, usage: UsageInfo, metrics: dict[str, Any] | None
) -> str:
    if chat:
        return _json(
            ChatCompletionChunk(
                id=rid, created=created, model=model, choices=[], usage=usage, metrics=metrics
            )
        )
    return _json(
        CompletionResponse(
            id=rid, created=created, model=model, choices=[], usage=usage, metrics=metrics
        )
    )


def _error_event(exc: Exception) -> str:
    status, kind, param = 500, "internal_error", None
    if isinstance(exc, InvalidRequestError):
        status, kind, param = 400, "invalid_request_error", exc.param
    elif isinstance(exc, ShuttingDownError):
        status, kind = 503, "service_unavailable"
    elif isinstance(exc, EngineDeadError):
        status, kind = 503, "engine_dead"
    body = ErrorResponse(error=ErrorInfo(message=str(exc), type=kind, param=param, code=status))
    return _event(body.model_dump_json())


async def sse(
    pieces: AsyncIterator[Piece],
    rid: str,
    model: str,
    num_prompt_tokens: int,
    *,
    chat: bool,
    include_usage: bool,
    continuous_usage: bool = False,
    n: int = 1,
    formatters: Formatters,
) -> AsyncIterator[str]:
    """``n`` choices: each has its own ``index`` (chat: its own role chunk first); completion
    tokens in the usage are those of all choices, cached tokens those of each prompt once."""
    created = now_s()
    counts = [0] * n  # output tokens so far, per choice
    cached = [0] * n
    finished = 0
    metrics = None  # per-request timing (include_metrics): on the last chunk before [DONE]

    def usage() -> UsageInfo:
        return UsageInfo.of(num_prompt_tokens, sum(counts), sum(cached))

    def so_far() -> UsageInfo | None:  # vLLM's continuous_usage_stats: usage on every chunk
        return usage() if continuous_usage else None

    # Every chunk of this stream names the same request, model, creation time and kind.
    chunk = functools.partial(_chunk, rid, model, created, chat)
    try:
        if chat:
            for i in range(n):
                yield _event(chunk("", None, role="assistant", usage=so_far(), index=i))
        async for piece in pieces:
            i = piece.index
            counts[i] = piece.num_tokens
            cached[i] = piece.num_cached_tokens or cached[i]
            lp = formatters.shape(i, piece.logprobs, chat)
            last = None
            if piece.finish_reason is not None:
                finished += 1
                metrics = piece.metrics  # the choice finishing last gives the request's timing
                last = None if include_usage or finished < n else metrics
            yield _event(
                chunk(
                    piece.text,
                    piece.finish_reason,
                    usage=so_far(),
                    index=i,
                    metrics=last,
                    logprobs=lp,
                    tool_calls=piece.tool_calls,
                )
            )
        if include_usage:
            yield _event(_usage_chunk(rid, model, created, chat, usage(), metrics))
    except (GenerationFailed, InvalidRequestError, ShuttingDownError, EngineDeadError) as exc:
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
    finish_order: int = 0  # among the request's choices
    logprobs: list[LogprobEntry] | None = None
    num_cached_tokens: int = 0
    tool_calls: list[dict[str, Any]] | None = None


async def _collect(pieces: AsyncIterator[Piece]) -> list[Result]:
    """One Result per choice, by index."""
    parts: dict[int, list[str]] = {}
    deltas: dict[int, list[dict[str, Any]]] = {}
    last: dict[int, Piece] = {}
    lps: dict[int, list[LogprobEntry]] = {}
    cached: dict[int, int] = {}
    order: list[int] = []  # choice indices as they finished
    async for piece in pieces:
        parts.setdefault(piece.index, []).append(piece.text)
        deltas.setdefault(piece.index, []).extend(piece.tool_calls or [])
        last[piece.index] = piece
        cached[piece.index] = piece.num_cached_tokens or cached.get(piece.index, 0)
        if piece.logprobs is not None:
            lps.setdefault(piece.index, []).extend(piece.logprobs)
        if piece.finish_reason is not None:
            order.append(piece.index)
    return [
        Result(
            "".join(parts[i]),
            last[i].num_tokens,
            last[i].finish_reason,
            last[i].metrics,
            order.index(i) if i in order else -1,
            lps.get(i),
            cached[i],
            merge_deltas(deltas[i]) or None,
        )
        for i in sorted(last)
    ]


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_until_disconnect(
    pieces: AsyncIterator[Piece], raw: Request
) -> list[Result] | None:
    """Run a non-streaming request to the end (a Result per sample); None (and aborted) if the
    client leaves first."""
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


def _message(result: Result) -> ChatResponseMessage:
    content = None if result.tool_calls and not result.text.strip() else result.text
    return ChatResponseMessage(content=content, tool_calls=result.tool_calls)


def full_response(
    results: list[Result],
    rid: str,
    model: str,
    n_prompt: int,
    *,
    chat: bool,
    formatters: Formatters,
) -> Any:
    usage = UsageInfo.of(
        n_prompt, sum(r.num_tokens for r in results), sum(r.num_cached_tokens for r in results)
    )
    # The request's timing is that of the sample that finished last (n > 1).
    metrics = max(results, key=lambda r: r.finish_order).metrics
    body: _Body
    if chat:
        choices = [
            ChatChoice(
                index=i,
                message=_message(r),
                finish_reason=r.finish_reason,
                logprobs=formatters.shape(i, r.logprobs, chat),  # type: ignore[arg-type]
            )
            for i, r in enumerate(results)
        ]
        body = ChatCompletionResponse(
            id=rid, model=model, choices=choices, usage=usage, metrics=metrics
        )
    else:
        cs = [
            CompletionChoice(
                index=i,
                text=r.text,
                finish_reason=r.finish_reason,
                logprobs=formatters.shape(i, r.logprobs, chat),  # type: ignore[arg-type]
            )
            for i, r in enumerate(results)
        ]
        body = CompletionResponse(id=rid, model=model, choices=cs, usage=usage, metrics=metrics)
    return body.model_dump(exclude=_no_metrics(body))
