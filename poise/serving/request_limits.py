"""Per-request limits checked before any expensive work (docs/reliability.md lists them).

- ``check_stop_limits``: the number and length of stop strings and the number of stop token
  ids (``RequestLimitsConfig``); 400 naming the limit and its flag. ``check_sampling_limits``:
  ``n`` and the number of ``logit_bias`` entries, likewise.
- ``PromptCharBound``: a prompt that cannot fit in ``max_model_len`` judged from its length in
  characters, before it is tokenized. No token of the tokenizer decodes to more characters than
  its longest vocabulary entry (``L``, 81 for SmolLM2: byte-level BPE entries spell one
  character per byte, SentencePiece entries one per character, and added tokens are matched
  literally), so a prompt of more than ``max_model_len * L`` characters has more than
  ``max_model_len`` tokens. This assumes the tokenizer's normalizer never deletes characters
  (true of byte-level BPE and SentencePiece models; a BERT-style normalizer that strips accents
  could, and there such a prompt is refused even if it would have fit).
- ``TokenizerQueue``: the characters of prompt text waiting for or in tokenization (one worker
  thread); beyond ``max_tokenizer_queue_chars`` a request gets 429 + Retry-After rather than
  queueing behind seconds of someone else's tokenizer work. A request alone always gets in.
"""

from __future__ import annotations

from typing import Any

from poise.errors import InvalidRequestError, OverloadedError
from poise.serving.settings import RequestLimitsConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_stop_limits(
    stop: list[str], stop_token_ids: list[int], limits: RequestLimitsConfig
) -> None:
    if len(stop) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"stop: {len(stop)} stop strings, more than the {limits.max_stop_sequences} this "
            f"server accepts ({_flag('max_stop_sequences')})",
            "stop",
        )
    longest = max(stop, key=len, default="")
    if len(longest) > limits.max_stop_sequence_chars:
        raise InvalidRequestError(
            f"stop: a stop string of {len(longest)} characters, longer than the "
            f"{limits.max_stop_sequence_chars} this server accepts "
            f"({_flag('max_stop_sequence_chars')})",
            "stop",
        )
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError(
            f"stop_token_ids: {len(stop_token_ids)} ids, more than the "
            f"{limits.max_stop_token_ids} this server accepts ({_flag('max_stop_token_ids')})",
            "stop_token_ids",
        )


def check_sampling_limits(
    n: int, logit_bias: dict[str, float] | None, limits: RequestLimitsConfig
) -> None:
    if n > limits.max_n:
        raise InvalidRequestError(
            f"n: {n} samples, more than the {limits.max_n} this server accepts ({_flag('max_n')})",
            "n",
        )
    if logit_bias and len(logit_bias) > limits.max_logit_bias:
        raise InvalidRequestError(
            f"logit_bias: {len(logit_bias)} entries, more than the {limits.max_logit_bias} this "
            f"server accepts ({_flag('max_logit_bias')})",
            "logit_bias",
        )


def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the tokenizer's longest vocabulary entry (None when it has no vocab)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return max((len(t) for t in vocab), default=None)


class PromptCharBound:
    def __init__(self, max_model_len: int, chars_per_token: int | None) -> None:
        self.max_model_len = max_model_len
        self.chars_per_token = chars_per_token
        self.max_chars = None if chars_per_token is None else max_model_len * chars_per_token

    def check(self, num_chars: int, param: str) -> None:
        if self.max_chars is not None and num_chars > self.max_chars:
            raise InvalidRequestError(
                f"the prompt has {num_chars} characters, more than max_model_len "
                f"({self.max_model_len}) tokens can hold: no token of this tokenizer is longer "
                f"than {self.chars_per_token} characters, so at most {self.max_chars} fit",
                param,
                reason="too_long",
            )


class TokenizerQueue:
    """Characters of prompt text waiting for or in tokenization. Event-loop thread only.

    A reservation is released when the tokenizer work itself ends (``release``, called from the
    worker's completion), not when the waiting request does: a client that disconnects does not
    free room while its prompt is still being tokenized. Retry-After is the queued characters
    over the tokenizer's measured speed (characters per second of its recent work)."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.pending_chars = 0
        self._chars_per_s: float | None = None

    def admit(self, num_chars: int) -> None:
        if self.pending_chars and self.pending_chars + num_chars > self.max_chars:
            wait = self.pending_chars / self._chars_per_s if self._chars_per_s else 1.0
            raise OverloadedError(
                f"tokenizer queue is full ({self.pending_chars} characters of prompt text "
                f"ahead, max_tokenizer_queue_chars={self.max_chars}); retry later",
                retry_after_s=wait,
                reason="tokenizer_queue_full",
            )
        self.pending_chars += num_chars

    def release(self, num_chars: int, seconds: float) -> None:
        self.pending_chars -= num_chars
        if num_chars >= 1000 and seconds > 0:  # short prompts measure call overhead, not speed
            speed = num_chars / seconds
            old = self._chars_per_s
            self._chars_per_s = speed if old is None else 0.8 * old + 0.2 * speed
