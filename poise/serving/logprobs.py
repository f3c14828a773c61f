"""Logprobs in OpenAI's two response shapes, from the engine's ``TokenLogprob``s.

Completions (``logprobs: k``): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
(a dict token text -> logprob holding the position's own token and its k most likely
alternatives, as vLLM fills it) and ``text_offset`` (where each token's text starts in the
choice's text, echoed prompt included). The prompt's first token has no logprob: ``None`` in
both ``token_logprobs`` and ``top_logprobs``.

Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{token, logprob, bytes,
top_logprobs: [k alternatives]}]}``.

A token's text is ``tokenizer.decode([id])`` (a byte-level token that is part of a character
decodes to U+FFFD, as in vLLM). JSON has no -inf: a logprob below -9999 is sent as -9999, as
vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from poise.core.logprobs import TokenLogprob

LogprobEntry = tuple[int, TokenLogprob | None]
_FLOOR = -9999.0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


def _value(x: float) -> float:
    return max(x, _FLOOR)


class LogprobFormatter:
    """Turns one choice's logprob entries into a response shape; keeps the text offset of a
    completions choice across stream chunks (one formatter per choice)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.offset = 0

    def text(self, token_id: int) -> str:
        t = self._texts.get(token_id)
        if t is None:
            t = self._texts[token_id] = str(self._tokenizer.decode([token_id]))
        return t

    def completion(self, entries: Sequence[LogprobEntry]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for tid, lp in entries:
            text = self.text(tid)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_value(lp.logprob))
            top = {
                self.text(t): _value(v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            }
            top.setdefault(text, _value(lp.logprob))
            out.top_logprobs.append(top)
        return out

    def chat(self, entries: Sequence[LogprobEntry]) -> ChatLogprobs:
        content = []
        for tid, lp in entries:
            if lp is None:
                continue
            top = [self._top(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
            first = self._top(tid, lp.logprob)
            content.append(ChatTokenLogprob(**first.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        text = self.text(token_id)
        return ChatTopLogprob(token=text, logprob=_value(logprob), bytes=list(text.encode()))
