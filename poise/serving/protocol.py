"""The OpenAI HTTP schema (the subset poise serves) as pydantic models.

Requests accept unknown fields (clients send many optional ones) but reject values poise cannot
honour (n > 1, logprobs, penalties) with a 400 that names the field, rather than ignoring them
silently. Extensions follow vLLM's spelling: ``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from poise.core.sampling_params import SamplingParams
from poise.errors import InvalidRequestError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatMessage(_Lenient):
    role: str
    # A string, a list of content parts ({"type": "text", "text": ...}) or None (assistant
    # messages that only carry tool calls).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _SamplingRequest(_Lenient):
    """Fields chat and completions share."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Scheduling inputs (vLLM's ``priority``: lower first; poise's traffic class and per-request
    # SLO overrides, in ms). The class may also come in the ``X-Poise-Class`` header.
    priority: int = 0
    traffic_class: str | None = Field(default=None, alias="class")
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported (only 0)")
        return v

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(
        self, default_max_tokens: int, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """SamplingParams; fields the request leaves out come from ``defaults`` (the model's
        generation config, ``--generation-config``), else OpenAI's (temperature 1, top_p 1).
        ``default_max_tokens`` (what the context leaves) caps a default max_tokens. Validated."""
        d = defaults or {}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self._max_tokens()
        if max_tokens is None:
            max_tokens = min(default_max_tokens, d.get("max_tokens", default_max_tokens))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=d.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", 0) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            priority=self.priority,
            traffic_class=self.traffic_class,
            ttft_slo_ms=self.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms,
        )
        params.validate()
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    def _max_tokens(self) -> int | None:
        # The newer name wins; the old one is deprecated by OpenAI but still common.
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )  # fmt: skip


class CompletionRequest(_SamplingRequest):
    # A string, a list with one string, a list of token ids, or a list with one such list.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); batched prompts are a 400."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) != 1:
            raise InvalidRequestError(
                f"only one prompt per request is supported, got {len(p)}", "prompt"
            )
        first = p[0]
        if isinstance(first, str):
            return first
        return [int(t) for t in first]  # type: ignore[union-attr]


# ---- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "poise"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
