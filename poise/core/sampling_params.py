"""Per-request generation parameters (sampling and stopping), separate from scheduling config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from poise.core.logprobs import MAX_LOGPROBS
from poise.core.structured import StructuredOutputsParams
from poise.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """What to generate. ``temperature == 0`` means greedy.

    ``top_k <= 0`` disables top-k; ``top_p == 1`` and ``min_p == 0`` disable theirs. A ``seed``
    makes sampling reproducible whatever else is in the batch (the runner derives each token's
    random stream from the seed and the token's index).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Scheduling inputs (used by the scheduler, not the sampler); vLLM's semantics for
    # priority: lower values are served first. ``traffic_class`` names a configured class (None:
    # assigned by the class rules); the SLO targets override the class's, in milliseconds.
    priority: int = 0
    traffic_class: str | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # vLLM's: the logprob of each sampled token / of each prompt token (from the second), each
    # with this many most likely alternatives (0: none), from the raw logits (core/logprobs.py).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrained decoding (vLLM's name): a JSON schema, regex, choice or grammar; a dict in
    # vLLM's form is accepted too (core/structured.py).
    structured_outputs: StructuredOutputsParams | None = None

    # vLLM's sampling fields (runner/penalties.py applies the logit ones). ``n`` samples share
    # the prompt (core/parallel.py); child ``i`` of a seeded request uses ``seed + i``.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[object] | None = None
    truncate_prompt_tokens: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the request's past tokens (any of the three penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the field; ``vocab_size`` checks stop token ids."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens"
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0 and self.top_k != -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}", "top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidRequestError(
                f"priority must be an integer, got {self.priority!r}", "priority"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (
                not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS
            ):
                raise InvalidRequestError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {k!r}", name
                )
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name} must be > 0, got {value}", name)
        self._validate_logit_fields(vocab_size)
        for name, off in NOT_IMPLEMENTED.items():
            if getattr(self, name) not in off:
                raise InvalidRequestError(
                    f"{name}={getattr(self, name)!r} is not supported by poise yet (only "
                    f"{off[0]!r}); it is refused rather than ignored",
                    name,
                )
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            self.structured_outputs.spec()  # the field types; the grammar compiles on admission
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not 0 <= tid < vocab_size:
                    raise InvalidRequestError(
                        f"stop_token_ids: {tid} is outside the vocabulary [0, {vocab_size})",
                        "stop_token_ids",
                    )

    def _validate_logit_fields(self, vocab_size: int | None) -> None:
        """n, penalties, min_tokens and logit_bias: vLLM's ranges (logit_bias: OpenAI's)."""
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n!r}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                "min_tokens",
            )
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
                within = f" [0, {vocab_size})" if vocab_size is not None else ""
                raise InvalidRequestError(
                    f"logit_bias: token id {token!r} is outside the vocabulary{within}",
                    "logit_bias",
                )
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}",
                    "logit_bias",
                )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Field -> the values that mean "off" (the first is the default), for vLLM's fields not yet
# implemented. An empty dict or list counts as off.
NOT_IMPLEMENTED: dict[str, tuple[object, ...]] = {
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
}
