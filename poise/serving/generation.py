"""From an OpenAI request to a stream of text pieces: tokenize, admit, detokenize, stop.

``Generator`` is shared by the chat and completions handlers. Before any tokenizer work it
checks what is cheap to check (stop-string limits, the prompt's length in characters against
``max_model_len``: limits.py); it tokenizes off the event loop (one worker thread, so the
tokenizer is never used from two threads at once, behind a bounded queue of prompt
characters), refuses ``max_tokens`` that cannot fit next to the prompt, admits the
request into the AsyncEngine, and turns RequestDeltas into ``Piece``s: new text, the number of
tokens generated so far and, on the last piece, the finish reason. A matched stop string ends
the request in the engine (``AsyncEngine.finish``), and a handler that stops iterating early
(client gone) aborts it.

Errors: InvalidRequestError (400), OverloadedError (429), EngineDeadError (503) at admission;
``GenerationFailed`` (500) when the engine fails the request after it started, unless the
failure names a field of the request (a grammar the vocabulary cannot complete): then a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from poise.core.outputs import RequestDelta
from poise.core.parallel import Child, fan_out
from poise.core.request import RequestTimes
from poise.core.sampling_params import SamplingParams
from poise.core.structured import GrammarCompiler
from poise.errors import EngineDeadError, InvalidRequestError, ShuttingDownError
from poise.serving.async_engine import AsyncEngine
from poise.serving.completions import CompletionRequest
from poise.serving.http_errors import GenerationFailed
from poise.serving.logprobs import LogprobEntry
from poise.serving.protocol import ChatCompletionRequest
from poise.serving.request_limits import (
    PromptCharBound,
    TokenizerQueue,
    check_sampling_limits,
    check_stop_limits,
    longest_token_chars,
)
from poise.serving.request_metrics import response_metrics
from poise.serving.settings import RequestLimitsConfig
from poise.serving.tool_calls import ToolPlan, plan_tools, template_kwargs
from poise.text import IncrementalDetokenizer, apply_chat_template, encode_prompt
from poise.text.tokenizer import normalize_messages

__all__ = ["GenerationFailed", "Generator", "Piece", "Prepared"]


@dataclass
class Piece:
    text: str
    num_tokens: int  # this sample's output tokens so far (its share of usage.completion_tokens)
    finish_reason: str | None = None
    # On the last piece of a request that asked for it: request_metrics.response_metrics.
    metrics: dict[str, Any] | None = None
    index: int = 0  # the choice it belongs to: prompt * n + sample
    # The tokens this piece covers, with their logprobs (None: the prompt's first token, which
    # nothing predicts), when the request asked for them; with echo the prompt's come first.
    logprobs: list[LogprobEntry] | None = None
    # Prompt tokens the prefix cache served (usage.prompt_tokens_details), on the last piece.
    num_cached_tokens: int = 0
    # OpenAI tool-call deltas (each with its "index"), from serving/tool_calls.py.
    tool_calls: list[dict[str, Any]] | None = None
    # On the last piece: the sample's timestamps, up to the tokens the client got (traces).
    times: RequestTimes | None = None


@dataclass
class Prepared:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    include_metrics: bool = False  # the response carries per-request timing
    # Completions' echo: the prompt text goes before the output (and its logprobs, if asked,
    # before the output's); echo_only (max_tokens 0): the one sampled token is dropped.
    echo_text: str | None = None
    echo_only: bool = False
    tools: ToolPlan | None = None  # chat with tools: how the reply's calls are read


class Generator:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        *,
        max_model_len: int,
        vocab_size: int | None,
        default_sampling: dict[str, Any] | None = None,
        limits: RequestLimitsConfig | None = None,
        tool_parser: str | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.engine = engine
        # The engine's structured-output compiler (EngineCore.grammars; None: no grammars).
        self.grammars = grammars
        # --tool-call-parser when --enable-auto-tool-choice is on: tool_choice "auto" parses.
        self.tool_parser = tool_parser
        # Defaults for fields a request leaves out (the model's generation config).
        self.default_sampling = dict(default_sampling or {})
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = limits or RequestLimitsConfig()
        self.prompt_bound = PromptCharBound(max_model_len, longest_token_chars(tokenizer))
        self.tokenizer_queue = TokenizerQueue(self.limits.max_tokenizer_queue_chars)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poise-tokenizer")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _tokenize(self, num_chars: int, param: str, fn: Any, *args: Any) -> list[int]:
        self.prompt_bound.check(num_chars, param)
        queue = self.tokenizer_queue
        queue.admit(num_chars)
        loop = asyncio.get_running_loop()

        started: list[float] = []

        def timed() -> Any:
            started.append(time.perf_counter())
            return fn(*args)

        def release(_: Any) -> None:  # in the worker when done, or where it was cancelled
            seconds = time.perf_counter() - started[0] if started else 0.0
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                loop.call_soon_threadsafe(queue.release, num_chars, seconds)

        try:
            work = self._pool.submit(timed)
        except BaseException:
            queue.release(num_chars, 0.0)
            raise
        work.add_done_callback(release)
        return list(await asyncio.wrap_future(work))

    async def call_tokenizer(self, fn: Any) -> Any:
        """``fn()`` on the tokenizer's thread (never two threads in the tokenizer at once); the
        body-size limit bounds its input (/tokenize and /detokenize)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    # ---- preparing ----------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest, arrival: float) -> Prepared:
        self._check_cheap(req)
        tools = plan_tools(req, self.tool_parser)
        messages = normalize_messages([m.model_dump(exclude_none=True) for m in req.messages])
        chars = sum(len(m["content"]) for m in messages) + len(req.chat_template or "")
        render = functools.partial(apply_chat_template, **template_kwargs(req))
        ids = await self._tokenize(chars, "messages", render, self.tokenizer, messages)
        prep = self._prepared("chatcmpl", ids, req, arrival)
        prep.tools = tools
        if tools is not None and tools.structured is not None:
            if prep.params.structured_outputs is not None:
                raise InvalidRequestError(
                    f"tool_choice {tools.mode!r} is enforced by structured output; it cannot be "
                    f"combined with {prep.params.structured_outputs.source_field}",
                    "tool_choice",
                )
            prep.params.structured_outputs = tools.structured
        return await self._compiled(prep)

    async def prepare_completion(
        self, req: CompletionRequest, arrival: float, prompt: str | list[int]
    ) -> Prepared:
        """One prompt of the request (``CompletionRequest.prompts``): each is its own request."""
        self._check_cheap(req)
        if isinstance(prompt, str):
            ids = await self._tokenize(len(prompt), "prompt", encode_prompt, self.tokenizer, prompt)
        else:
            ids = prompt
        prep = self._prepared("cmpl", ids, req, arrival)
        if req.echo:
            prep.echo_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            prep.echo_only = req.echo_only
        return await self._compiled(prep)

    async def _compiled(self, prep: Prepared) -> Prepared:
        """Compile the request's structured-output grammar on the tokenizer thread (a 400 naming
        the field if it is invalid), so the engine thread only copies the cached result."""
        spec = prep.params.structured_outputs
        grammars = self.grammars
        if spec is not None and grammars is not None:
            await self.call_tokenizer(lambda: grammars.new_state(spec))
        return prep

    def _check_cheap(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """Limits that need no tokenizer, so a bad request costs no tokenizer time."""
        req.check_fields()
        check_stop_limits(req.stop_list(), list(req.stop_token_ids or []), self.limits)
        check_sampling_limits(req.n, req.logit_bias, self.limits)

    def _prepared(
        self,
        prefix: str,
        ids: list[int],
        req: ChatCompletionRequest | CompletionRequest,
        arrival: float,
    ) -> Prepared:
        # EngineCore.validate only reads immutable limits, so calling it from the event loop
        # is safe; it raises the 400s that name the limit (max_model_len, KV pool, vocab).
        self.engine.core.validate(ids, SamplingParams(max_tokens=1))
        room = self.max_model_len - len(ids)
        asked = req.requested_max_tokens()
        if asked is not None and asked > room:
            # vLLM's rule, rather than a silent cap: the prompt and the output must both fit.
            raise InvalidRequestError(
                f"{req.max_tokens_field()} is {asked}, but the prompt has {len(ids)} tokens and "
                f"max_model_len is {self.max_model_len}: at most {room} tokens can be generated",
                req.max_tokens_field(),
                reason="too_long",
            )
        params = req.to_sampling_params(max(1, room), self.default_sampling)
        params.validate(self.vocab_size)
        return Prepared(f"{prefix}-{uuid.uuid4().hex}", ids, params, arrival, req.include_metrics)

    # ---- generating ---------------------------------------------------------------------

    async def generate(self, preps: list[Prepared]) -> AsyncIterator[Piece]:
        """Admit and stream. Raises at admission before the first yield, with nothing of the
        request left in the engine. Each prompt (a list of prompts on completions) and, with
        n > 1, each sample is its own engine request (samples share the prompt:
        core/parallel.py); the pieces of all come interleaved, tagged with their choice
        ``index``: prompt * n + sample, as OpenAI and vLLM number them."""
        admitted: list[tuple[Prepared, Child, int, Any]] = []
        children = [fan_out(prep.request_id, prep.params) for prep in preps]
        groups = self.engine.metrics.groups
        for samples in children:  # one request each, to the metrics
            groups.add([c.request_id for c in samples])
        try:
            for p, prep in enumerate(preps):
                for child in children[p]:
                    stream = await self.engine.add_request(
                        child.request_id,
                        prep.prompt_token_ids,
                        child.params,
                        prep.arrival_time,
                        prompt_leader=child.prompt_leader,
                    )
                    admitted.append((prep, child, p * prep.params.n + child.index, stream))
        except BaseException:
            for _, child, _, _ in admitted:  # all or none
                self.engine.abort(child.request_id)
            ran = {child.request_id for _, child, _, _ in admitted}
            self.engine.metrics.samples_not_admitted(
                [c.request_id for samples in children for c in samples if c.request_id not in ran]
            )
            raise
        pieces = [self._pieces(prep, c, index, stream) for prep, c, index, stream in admitted]
        return pieces[0] if len(pieces) == 1 else _merged(pieces)

    async def _pieces(
        self, prep: Prepared, child: Child, index: int, stream: Any
    ) -> AsyncIterator[Piece]:
        detok = IncrementalDetokenizer(self.tokenizer, prep.prompt_token_ids, child.params)
        rid = child.request_id
        want_logprobs = child.params.logprobs is not None
        echo = prep.echo_text or ""  # goes out with the first piece
        lps: list[LogprobEntry] = []  # logprobs not yet sent
        n_tokens = cached = 0
        done = False
        try:
            async for delta in stream:
                if child.index == 0:  # samples share one prompt: its cache hit counts once
                    cached = delta.num_cached_tokens or cached
                if delta.finish_reason == "error":
                    done = True
                    if self.engine.error is not None:  # the engine died: 503, as new requests
                        raise EngineDeadError(delta.error_message or self.engine.error)
                    if delta.error_param is not None:  # the request's own fault (its grammar)
                        raise InvalidRequestError(delta.error_message or "", delta.error_param)
                    raise GenerationFailed(delta.error_message or "the engine failed")
                if delta.finish_reason == "abort":  # only a shutdown aborts a request still read
                    done = True
                    raise ShuttingDownError(self.engine.shutdown_message)
                if delta.finish_reason == "rejected":
                    done = True
                    # Only a prompt over a limit finishes as rejected (Scheduler.add_request).
                    raise InvalidRequestError(
                        delta.error_message or "request rejected", "prompt", reason="too_long"
                    )
                if delta.prompt_logprobs is not None and prep.echo_text is not None:
                    lps.extend(zip(prep.prompt_token_ids, delta.prompt_logprobs, strict=True))
                if prep.echo_only:  # max_tokens 0: the prompt alone, the sampled token dropped
                    done = True
                    yield Piece(
                        echo,
                        0,
                        "length",
                        self._metrics(prep, delta, 0),
                        index,
                        lps if want_logprobs else None,
                        cached,
                        times=_times(delta, 0),
                    )
                    return
                out = detok.update(delta.new_token_ids, delta.finished)
                if out.kept_tokens is not None:  # a stop string inside a speculative delta
                    delta.keep_first(out.kept_tokens)
                n_tokens += len(delta.new_token_ids)
                if delta.new_logprobs:
                    lps.extend(zip(delta.new_token_ids, delta.new_logprobs, strict=True))
                text, echo = echo + out.text, ""
                sent, lps = (lps if want_logprobs else None), []
                if out.stopped or delta.finished:
                    if not delta.finished:
                        # A stop string matched: the engine may already be computing more
                        # tokens for this request; end it there and report "stop" now.
                        self.engine.finish(rid)
                    done = True
                    reason = "stop" if out.stopped else delta.finish_reason
                    yield Piece(
                        text,
                        n_tokens,
                        reason,
                        self._metrics(prep, delta, n_tokens),
                        index,
                        sent,
                        cached,
                        times=_times(delta, n_tokens),
                    )
                    return
                if text or sent:
                    yield Piece(text, n_tokens, index=index, logprobs=sent)
        finally:
            if not done:
                self.engine.abort(rid)

    @staticmethod
    def _metrics(prep: Prepared, delta: RequestDelta, n_tokens: int) -> dict[str, Any] | None:
        return response_metrics(delta, n_tokens) if prep.include_metrics else None


def _times(delta: RequestDelta, num_output_tokens: int) -> RequestTimes | None:
    """A copy of the request's timestamps as the client saw them: the engine thread may still
    append a token after a stop string ended the request here."""
    if delta.times is None:
        return None
    tokens = delta.times.token_times[:num_output_tokens]
    return dataclasses.replace(delta.times, token_times=tokens)


async def _merged(sources: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """The pieces of several samples in the order they arrive. Closing this (client gone)
    closes every source, whose ``finally`` aborts its engine request."""
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(source: AsyncIterator[Piece]) -> None:
        try:
            async for piece in source:
                await queue.put(piece)
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            with contextlib.suppress(Exception):
                await source.aclose()  # type: ignore[attr-defined]
