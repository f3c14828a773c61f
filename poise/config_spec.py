"""SpeculativeConfig: speculative decoding's settings, in vLLM's ``--speculative-config`` shape.

``poise serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}'``, ``{"method": "draft_model", "model": PATH}``
or ``LLM(speculative_config={...})``. A module of its own (config.py's size); config.py holds it
as ``SchedulerConfig.speculative_config`` because the scheduler decides each step's depth.
Torch-free: the simulator reads it too.

Every key is checked: an unknown method or field, or a value out of range, is a ``ValueError``
naming ``speculative_config.<field>`` (never a field accepted and ignored).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from poise.config_model import _require

SPEC_METHODS: tuple[str, ...] = ("ngram", "draft_model")
# The most draft tokens a row may verify per step: each costs a query row, and past ~16 the
# chance that all are accepted is too small to pay for them on any workload we measured.
MAX_SPECULATIVE_TOKENS = 16
_FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    # vLLM's default method when only a count is given is ngram (prompt lookup) here: it needs
    # no second model.
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # n-gram sizes the prompt lookup tries, longest first (vLLM's names).
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # draft_model: the draft checkpoint (anything ``--model`` takes), sharing the tokenizer.
    model: str | None = None
    # True: the scheduler picks each request's depth per step (0..num_speculative_tokens) from
    # its acceptance so far, the step's cost and its class's TPOT slack; False: always k.
    adaptive: bool = True

    def __post_init__(self) -> None:
        f = _FIELD
        _require(
            self.method in SPEC_METHODS,
            f"{f}.method",
            f"unknown method {self.method!r}; choose from {', '.join(SPEC_METHODS)}",
        )
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
            f"{f}.num_speculative_tokens",
            f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
        )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{f}.{name}",
                f"must be an integer >= 1, got {value!r}",
            )
        _require(
            lo <= hi,
            f"{f}.prompt_lookup_min",
            f"must be <= prompt_lookup_max ({hi}), got {lo}",
        )
        _require(isinstance(self.adaptive, bool), f"{f}.adaptive", "must be true or false")
        if self.method == "draft_model":
            _require(
                isinstance(self.model, str) and bool(self.model),
                f"{f}.model",
                "draft_model needs the draft checkpoint's path",
            )
        else:
            _require(
                self.model is None, f"{f}.model", f"is only for draft_model, not {self.method}"
            )

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """From an instance, vLLM's dict, its JSON text, or None / "" (speculation off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{_FIELD}: not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"{_FIELD}: must be a JSON object, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"{_FIELD}.{unknown[0]}: unknown field; known: {', '.join(sorted(names))}"
            )
        return cls(**value)
