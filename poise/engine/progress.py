"""The offline engine loop: add a batch of requests, step until all finish, build outputs.

A request with ``n`` > 1 runs as ``n`` engine requests sharing its prompt (core/parallel.py);
its ``RequestOutput`` gets one ``CompletionOutput`` per sample, in index order.

Each delta's tokens go through the request's incremental detokenizer (stop strings end the
request in the engine); a finishing delta sets the finish reason, the stop reason and the
latency breakdown. With ``use_tqdm`` a progress bar counts finished requests and shows the
input and output token rates since the call started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from poise.core.outputs import RequestDelta
from poise.core.parallel import fan_out
from poise.core.sampling_params import SamplingParams
from poise.core.timing import derive
from poise.engine.core import EngineCore
from poise.engine.request_output import CompletionOutput, RequestOutput, position_logprobs


def run_requests(
    engine: EngineCore,
    tokenizer: Any,
    ids: list[str],
    texts: list[str | None],
    token_lists: list[list[int]],
    params: list[SamplingParams],
    *,
    use_tqdm: bool = False,
) -> list[RequestOutput]:
    from poise.text.detokenizer import IncrementalDetokenizer

    outputs: dict[str, RequestOutput] = {}
    # Engine request id -> (its RequestOutput, the CompletionOutput it fills, its params):
    # one per request, or one per sample when n > 1 (core/parallel.py's children).
    slots: dict[str, tuple[RequestOutput, CompletionOutput, SamplingParams]] = {}
    detoks: dict[str, IncrementalDetokenizer] = {}
    for tokens, sp in zip(token_lists, params, strict=True):
        engine.validate(tokens, sp)  # refuse a bad request before any of the batch is admitted
    for rid, text, tokens, sp in zip(ids, texts, token_lists, params, strict=True):
        out = outputs[rid] = RequestOutput(rid, text, tokens, [])
        for child in fan_out(rid, sp):
            engine.add_request(
                child.request_id, tokens, child.params, prompt_leader=child.prompt_leader
            )
            completion = CompletionOutput(child.index, "", [])
            if sp.logprobs is not None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            out.outputs.append(completion)
            slots[child.request_id] = (out, completion, child.params)
            if tokenizer is not None:  # a bare checkpoint without tokenizer: ids only
                detoks[child.request_id] = IncrementalDetokenizer(tokenizer, tokens, child.params)
    bar = _Progress(len(ids), sum(len(t) for t in token_lists)) if use_tqdm else None
    pending = set(slots)
    decode = tokenizer_decode(tokenizer)
    try:
        while pending:
            deltas, stats = engine.step()
            wake = engine.wake_time() if stats is None else None
            if wake is not None:  # a dynamic batch still filling: sleep, do not spin
                time.sleep(max(0.0, wake - engine.clock.now()))
            for delta in deltas:
                slot = slots.get(delta.request_id)
                if slot is None:
                    continue
                delta = _apply(engine, *slot, detoks.get(delta.request_id), delta, decode)
                if bar is not None:
                    bar.tokens(len(delta.new_token_ids))
                if delta.finished:
                    pending.discard(delta.request_id)
                    if bar is not None and slot[0].finished:
                        bar.finished()
    finally:
        if pending:  # an exception (KeyboardInterrupt) must not leave requests running
            engine.abort(list(pending))
        if bar is not None:
            bar.close()
    return [outputs[rid] for rid in ids]


def _apply(
    engine: EngineCore,
    out: RequestOutput,
    completion: CompletionOutput,
    sp: SamplingParams,
    detok: Any,
    delta: RequestDelta,
    decode: Callable[[int], str | None],
) -> RequestDelta:
    text = None if detok is None else detok.update(delta.new_token_ids, delta.finished)
    if text is not None and text.kept_tokens is not None:
        delta.keep_first(text.kept_tokens)
    completion.token_ids.extend(delta.new_token_ids)
    _apply_logprobs(out, completion, delta, decode)
    if text is not None:
        completion.text += text.text
        if text.stopped:
            completion.stop_reason = text.stop_str
            if not delta.finished:
                finished = engine.finish(delta.request_id)  # finish_reason "stop"
                if finished is not None:
                    delta = finished
    if delta.finished:
        completion.finish_reason = delta.finish_reason
        # vLLM's stop_reason: the stop string or stop token id; None for EOS and length.
        if completion.stop_reason is None and delta.stop_reason in sp.stop_token_ids:
            completion.stop_reason = delta.stop_reason
        # The request is finished with its last sample; its metrics are that sample's (for
        # n > 1 the latest to finish), its preemptions those of all samples.
        out.finished = all(c.finish_reason is not None for c in out.outputs)
        out.error_message = out.error_message or delta.error_message
        out.num_preemptions += delta.num_preemptions
        out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
        out.metrics = derive(delta.times) if delta.times else None
    return delta


def tokenizer_decode(tokenizer: Any) -> Callable[[int], str | None]:
    """A token id's text (vLLM's ``decoded_token``), or None without a tokenizer."""
    if tokenizer is None:
        return lambda tid: None
    return lambda tid: str(tokenizer.decode([tid]))


def _apply_logprobs(
    out: RequestOutput,
    completion: CompletionOutput,
    delta: RequestDelta,
    decode: Callable[[int], str | None],
) -> None:
    if delta.prompt_logprobs is not None and out.prompt_logprobs is None:  # n > 1: once
        out.prompt_logprobs = [
            None if lp is None else position_logprobs(lp, decode) for lp in delta.prompt_logprobs
        ]
    if delta.new_logprobs and completion.logprobs is not None:
        completion.logprobs.extend(position_logprobs(lp, decode) for lp in delta.new_logprobs)
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
            lp.logprob for lp in delta.new_logprobs
        )


class _Progress:
    """tqdm over finished requests, with input/output tokens per second in its postfix."""

    def __init__(self, total: int, prompt_tokens: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self._start = time.monotonic()
        self._prompt_tokens = prompt_tokens
        self._output_tokens = 0
        self._done = 0

    def tokens(self, n: int) -> None:
        self._output_tokens += n

    def finished(self) -> None:
        self._done += 1
        elapsed = max(time.monotonic() - self._start, 1e-9)
        # Input tokens count once their request finished (a prompt is processed in full by
        # then); output tokens as they are generated.
        share = self._done / max(1, self._bar.total or 1)
        self._bar.set_postfix_str(
            f"input: {self._prompt_tokens * share / elapsed:.1f} tok/s, "
            f"output: {self._output_tokens / elapsed:.1f} tok/s",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
