"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams)`` and ``chat``.

Runs the engine loop in the caller's thread until every request of the call is finished.
Text handling (chat template, incremental detokenization, stop strings) comes from
``poise.text``, the same code the server uses.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from poise.config import EngineConfig
from poise.core.sampling_params import SamplingParams
from poise.core.timing import RequestMetrics, derive
from poise.engine.builder import build_engine

Prompt = str | list[int]
Messages = list[dict[str, Any]]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics | None
    num_preemptions: int = 0
    error_message: str | None = None


class LLM:
    """Offline batch generation with the same engine the server runs."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self.engine, self.model_info = build_engine(self.config)
        self.tokenizer = self.model_info.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many (text, or token ids); outputs in prompt order."""
        batch: Sequence[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = prompts  # type: ignore[assignment]
        token_lists = [self.encode(p) for p in batch]
        params = _broadcast(sampling_params, len(token_lists))
        return self._run(token_lists, params)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        from poise.text.tokenizer import apply_chat_template

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [apply_chat_template(self.tokenizer, conv) for conv in conversations]
        return self.generate(token_lists, sampling_params)

    def _run(
        self, token_lists: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        from poise.text.detokenizer import IncrementalDetokenizer

        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        outputs: dict[str, RequestOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        for rid, tokens, sp in zip(ids, token_lists, params, strict=True):
            engine.add_request(rid, tokens, sp)
            outputs[rid] = RequestOutput(rid, tokens, [], "", None, None)
            if self.tokenizer is not None:  # a bare checkpoint without tokenizer: ids only
                detoks[rid] = IncrementalDetokenizer(self.tokenizer, tokens, sp)
            elif sp.stop:
                raise ValueError("stop: stop strings need a tokenizer; this model has none")
        pending = set(ids)
        while pending:
            deltas, _ = engine.step()
            for delta in deltas:
                out = outputs.get(delta.request_id)
                if out is None:
                    continue
                out.output_token_ids.extend(delta.new_token_ids)
                detok = detoks.get(delta.request_id)
                stopped = False
                if detok is not None:
                    text = detok.update(delta.new_token_ids, delta.finished)
                    out.text += text.text
                    stopped = text.stopped
                if stopped and not delta.finished:
                    finished = engine.finish(delta.request_id)
                    if finished is not None:
                        delta = finished
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    out.error_message = delta.error_message
                    out.num_preemptions = delta.num_preemptions
                    out.metrics = derive(delta.times) if delta.times else None
                    pending.discard(delta.request_id)
        return [outputs[rid] for rid in ids]


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)
