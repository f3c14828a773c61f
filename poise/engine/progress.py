"""The offline engine loop: add a batch of requests, step until all finish, build outputs.

Each delta's tokens go through the request's incremental detokenizer (stop strings end the
request in the engine); a finishing delta sets the finish reason, the stop reason and the
latency breakdown. With ``use_tqdm`` a progress bar counts finished requests and shows the
input and output token rates since the call started.
"""

from __future__ import annotations

import time
from typing import Any

from poise.core.outputs import RequestDelta
from poise.core.sampling_params import SamplingParams
from poise.core.timing import derive
from poise.engine.core import EngineCore
from poise.engine.outputs import CompletionOutput, RequestOutput


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
    detoks: dict[str, IncrementalDetokenizer] = {}
    for tokens, sp in zip(token_lists, params, strict=True):
        engine.validate(tokens, sp)  # refuse a bad request before any of the batch is admitted
    for rid, text, tokens, sp in zip(ids, texts, token_lists, params, strict=True):
        engine.add_request(rid, tokens, sp)
        outputs[rid] = RequestOutput(rid, text, tokens, [CompletionOutput(0, "", [])])
        if tokenizer is not None:  # a bare checkpoint without tokenizer: ids only
            detoks[rid] = IncrementalDetokenizer(tokenizer, tokens, sp)
    by_id = dict(zip(ids, params, strict=True))
    bar = _Progress(len(ids), sum(len(t) for t in token_lists)) if use_tqdm else None
    pending = set(ids)
    try:
        while pending:
            deltas, _ = engine.step()
            for delta in deltas:
                out = outputs.get(delta.request_id)
                if out is None:
                    continue
                delta = _apply(
                    engine, out, detoks.get(delta.request_id), delta, by_id[out.request_id]
                )
                if bar is not None:
                    bar.tokens(len(delta.new_token_ids))
                if delta.finished:
                    pending.discard(delta.request_id)
                    if bar is not None:
                        bar.finished()
    finally:
        if pending:  # an exception (KeyboardInterrupt) must not leave requests running
            engine.abort(list(pending))
        if bar is not None:
            bar.close()
    return [outputs[rid] for rid in ids]


def _apply(
    engine: EngineCore, out: RequestOutput, detok: Any, delta: RequestDelta, sp: SamplingParams
) -> RequestDelta:
    completion = out.outputs[0]
    completion.token_ids.extend(delta.new_token_ids)
    if detok is not None:
        text = detok.update(delta.new_token_ids, delta.finished)
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
        out.finished = True
        out.error_message = delta.error_message
        out.num_preemptions = delta.num_preemptions
        out.num_cached_tokens = delta.num_cached_tokens
        out.metrics = derive(delta.times) if delta.times else None
    return delta


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
