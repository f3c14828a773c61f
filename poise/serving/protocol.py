"""The OpenAI HTTP schema (the subset poise serves) as pydantic models.

Requests accept unknown fields (clients send many optional ones) but reject values poise cannot
honour (``suffix``, ...) with a 400 that names the field, rather than ignoring them
silently. Extensions follow vLLM's spelling: ``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``.

Ranges are pydantic constraints (``Field(ge=..)``, ``min_length``, ``Literal``), so the published
OpenAPI schema and the validation are one thing. Numbers must be finite (JSON parsers accept
NaN and Infinity). ``temperature`` is 0 (greedy) or at least ``MIN_TEMPERATURE``: the sampler
divides float32 logits by it, and below about 1e-38 that division overflows to inf and NaN
(vLLM treats temperatures under the same 1e-5 as greedy; poise refuses them rather than
silently changing the request).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from poise.core.logprobs import MAX_LOGPROBS
from poise.core.sampling_params import SamplingParams
from poise.errors import InvalidRequestError
from poise.serving.logprobs import ChatLogprobs, CompletionLogprobs
from poise.serving.messages import ChatMessage
from poise.serving.structured import StructuredOutputFields
from poise.serving.tool_calls import ChatTemplateFields


class _Lenient(BaseModel):
    # Unknown fields are allowed (clients send many optional ones); known ones are strict, as
    # the schema publishes them: "1" is not 1, true is not 1, 1.0 is not an integer.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries the usage so far.
    continuous_usage_stats: bool = False


MIN_TEMPERATURE = 1e-5
TOKEN_ID_KEY = re.compile(r"^\s*[0-9]+\s*$")  # a logit_bias key
NonEmptyStr = Annotated[str, Field(min_length=1)]


_STOP_DOC = (
    "Up to --max-stop-sequences strings (default 16) of at most --max-stop-sequence-chars "
    "characters (default 256)."
)


class _SamplingRequest(StructuredOutputFields, _Lenient):
    """Fields chat and completions share."""

    model_config = ConfigDict(
        extra="allow", strict=True, populate_by_name=True, allow_inf_nan=False
    )

    model: str | None = None
    max_tokens: int | None = Field(
        None, ge=1, description="At most max_model_len minus the prompt's tokens."
    )
    temperature: float | None = Field(
        None,
        ge=0.0,
        description=f"0 (greedy) or at least {MIN_TEMPERATURE}.",
        json_schema_extra={
            "not": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}
        },
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disable it.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(None, description=_STOP_DOC)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Up to --max-stop-token-ids ids (default 256)."
    )
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = Field(
        1, ge=1, description="Samples of the one prompt (sharing its KV); up to --max-n."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        None, gt=0.0, description="vLLM's: > 1 discourages tokens of the prompt and output."
    )
    min_tokens: int = Field(0, ge=0, description="EOS and stop tokens are held back until then.")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None,
        description="Token id (as a string) -> bias in [-100, 100]; up to --max-logit-bias.",
        json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_KEY.pattern}},
    )
    user: str | None = None
    # Scheduling inputs (vLLM's ``priority``: lower first; poise's traffic class and per-request
    # SLO overrides, in ms). The class may also come in the ``X-Poise-Class`` header.
    priority: int = 0
    traffic_class: str | None = Field(default=None, alias="class")
    ttft_slo_ms: float | None = Field(None, gt=0)
    tpot_slo_ms: float | None = Field(None, gt=0)
    # vLLM's per-request metrics: timing in the response (needs --enable-per-request-metrics).
    include_metrics: bool = False

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, v: float | None) -> float | None:
        if v is not None and 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            # ASCII digits only: str.isdigit() also takes "²", which int() then refuses (a 500
            # the fuzz found), and "١", which int() reads as 1.
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
        return v

    def check_fields(self) -> None:
        """Rules across fields, as InvalidRequestError naming the field."""
        if self.stream_options is not None and not self.stream:
            # vLLM and OpenAI refuse them without a stream rather than ignoring them.
            raise InvalidRequestError(
                "stream_options: only allowed when stream is true", "stream_options"
            )
        opts = self.stream_options
        if opts is not None and opts.continuous_usage_stats and not opts.include_usage:
            # vLLM reads it only with include_usage; alone it would be silently ignored.
            raise InvalidRequestError(
                "stream_options: continuous_usage_stats needs include_usage", "stream_options"
            )

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self._max_tokens()

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(
        self, default_max_tokens: int, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """SamplingParams; fields the request leaves out come from ``defaults`` (the model's
        generation config, ``--generation-config``), else OpenAI's (temperature 1, top_p 1).
        ``default_max_tokens`` (what the context leaves) caps a default max_tokens. Validated."""
        d = defaults or {}
        stop = self.stop_list()
        max_tokens = self._max_tokens()
        if max_tokens is None:
            max_tokens = min(default_max_tokens, d.get("max_tokens", default_max_tokens))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=d.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", 0) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                d.get("repetition_penalty", 1.0)
                if self.repetition_penalty is None
                else self.repetition_penalty
            ),
            min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            priority=self.priority,
            traffic_class=self.traffic_class,
            ttft_slo_ms=self.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms,
            logprobs=self.sampled_logprobs(),
            prompt_logprobs=self.prompt_logprobs(),
            structured_outputs=self.structured_outputs_params(),
        )
        params.validate()
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM: ``continuous_usage_stats`` with ``include_usage``)."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def sampled_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per generated token, None for no logprobs."""
        return None

    def prompt_logprobs(self) -> int | None:
        return None


class ChatCompletionRequest(ChatTemplateFields, _SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        None, ge=1, description="OpenAI's newer name for max_tokens; both, if given, must agree."
    )
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampled_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_fields(self) -> None:
        super().check_fields()
        # max_tokens is OpenAI's deprecated name; two different limits is a client bug that
        # no precedence rule answers well, so it is refused rather than one silently dropped.
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequestError(
                f"max_completion_tokens ({self.max_completion_tokens}) and max_tokens "
                f"({self.max_tokens}) differ; give one (max_tokens is the deprecated name)",
                "max_completion_tokens",
            )

    def _max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ---- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class _Envelope(BaseModel):
    """What every completion response and stream chunk carries around its choices, in OpenAI's
    order; each kind narrows ``object`` and ``choices`` (a redeclared field keeps its place)."""

    id: str
    object: str
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None
    metrics: dict[str, Any] | None = None  # include_metrics; left out when None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


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
