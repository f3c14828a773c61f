"""The /v1/completions request: one prompt or a list (text or token ids), ``echo`` and
``logprobs`` (OpenAI's completions fields), on top of the fields chat shares (protocol.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from poise.core.logprobs import MAX_LOGPROBS
from poise.serving.protocol import NonEmptyStr, _SamplingRequest


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of such lists: each prompt of
    # a list is its own request, answered as the choice with its index.
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
            Field(min_length=1),
        ]
    )
    # 0 only with echo: score the prompt, generate nothing (lm-eval's loglikelihood requests).
    max_tokens: int | None = Field(
        None, ge=0, description="At most max_model_len minus the prompt's tokens; 0 needs echo."
    )
    echo: bool = Field(False, description="Return the prompt before the completion.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Logprobs of each token and this many alternatives (of the prompt's "
        "tokens too with echo).",
    )
    # Refused, not ignored: text after the insertion needs a fill-in-the-middle model. The
    # schema says so (at most 0 characters) and the message names the reason.
    suffix: str | None = Field(None, max_length=0, description="Not supported: empty or null.")

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, v: Any) -> Any:
        if isinstance(v, str) and v:
            raise ValueError("suffix is not supported")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: only allowed with echo")
        if self.echo and self.logprobs is not None and self.n > 1:
            # Only the first sample feeds the shared prompt (core/parallel.py), so only it could
            # score it; refused rather than answered with the prompt's logprobs on one choice.
            raise ValueError("echo with logprobs needs n = 1")
        return self

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the engine runs the prompt (sampling one token, dropped)."""
        return self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def sampled_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]
