"""Per-request generation parameters (sampling and stopping), separate from scheduling config."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    # vLLM's fields that poise does not implement yet, at their "off" value. Any other value is
    # refused by ``validate`` with a message naming the field, never silently ignored.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: object | None = None
    logits_processors: list[object] | None = None
    truncate_prompt_tokens: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name} must be > 0, got {value}", name)
        for name, off in NOT_IMPLEMENTED.items():
            if getattr(self, name) not in off:
                raise InvalidRequestError(
                    f"{name}={getattr(self, name)!r} is not supported by poise yet (only "
                    f"{off[0]!r}); it is refused rather than ignored",
                    name,
                )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not 0 <= tid < vocab_size:
                    raise InvalidRequestError(
                        f"stop_token_ids: {tid} is outside the vocabulary [0, {vocab_size})",
                        "stop_token_ids",
                    )


# Field -> the values that mean "off" (the first is the default), for vLLM's fields not yet
# implemented. An empty dict or list counts as off.
NOT_IMPLEMENTED: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_tokens": (0,),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
}
