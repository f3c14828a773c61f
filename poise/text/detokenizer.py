"""Incremental detokenization and stop strings, one object per request.

Usage::

    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, sampling_params)
    for delta in request_deltas:                       # RequestDelta from the engine
        out = detok.update(delta.new_token_ids, finished=delta.finished)
        stream(out.text)                               # safe to send now
        if out.stopped:                                # a stop string matched:
            abort_or_finish(request, "stop")           # the caller ends the request
            break
    final_text = detok.output_text

Token ids -> text (``TokenWindowDecoder``), the prefix-offset / read-offset technique:
- ``ids[prefix_offset:read_offset]`` were already turned into text; ``ids[read_offset:]`` not
  yet. Each update decodes two short windows, ``ids[prefix_offset:read_offset]`` and
  ``ids[prefix_offset:]``, and emits the difference, then slides both offsets forward. Cost per
  token is O(1): the windows hold a few tokens, never the whole sequence.
- Decoding a window that starts a few tokens back (instead of at ``read_offset``) keeps
  context-dependent rendering right, e.g. the leading-space handling of SentencePiece tokens.
  The window starts in the prompt's last tokens for the first output tokens.
- Byte-level BPE can split one UTF-8 character over several tokens; the partial character
  decodes to U+FFFD. While the decoded window *ends* with U+FFFD the offsets do not move and
  nothing is emitted; once the character is complete it is emitted whole. At ``finished`` the
  pending text is flushed as is (a character that never completed stays U+FFFD, as it does in
  ``tokenizer.decode`` of the whole sequence).
- Invariant: the concatenation of all emitted text equals ``tokenizer.decode(output_ids)`` for
  byte-level tokenizers (tests check it on the real SmolLM2 tokenizer).

Text -> stream (``StopChecker``):
- Each stop string keeps a Knuth-Morris-Pratt state: the length of the longest tail of the text
  so far that is a prefix of it. Each new character advances every state in amortized O(1), so
  the cost of a token is O(number of stops x its new characters), whatever the length of the
  text generated before it (the text is never searched again). A state reaching the stop's
  length is a match; the earliest-starting match in the new piece wins, and the output is cut
  before it (or after it with ``include_stop_str_in_output``) and ``stopped`` is reported.
- The largest state is exactly the tail that may still become a stop string (at most max stop
  length - 1 characters): it is held back from the stream until it is disambiguated, and
  flushed at finish. So streamed text never has to be retracted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poise.core.sampling_params import SamplingParams
from poise.text.tokenizer import Tokenizer

# Prompt tokens kept as decoding context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class TextDelta:
    """The result of one update: ``text`` is safe to stream now."""

    text: str
    # A stop string matched: the caller must finish the request with finish_reason "stop".
    stopped: bool = False
    stop_str: str | None = None
    # A stop string matched before the update's last token (speculative decoding delivers
    # several at once): how many of its tokens the output keeps, up to the one that completed
    # it. None: all of them.
    kept_tokens: int | None = None


class TokenWindowDecoder:
    """Token ids -> text deltas with two small decode windows (see module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Only the prompt's tail matters as context; the output ids follow it.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def update(self, new_token_ids: Sequence[int], flush: bool = False) -> str:
        """Append ids; return the newly completed text (everything pending when ``flush``)."""
        self._ids.extend(new_token_ids)
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if not flush and (
            len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        ):
            # Nothing visible yet (e.g. a special token), or a character is still incomplete.
            if len(new_text) <= len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                # Tokens that render to nothing: consume them so the window stays small.
                self._read_offset = len(self._ids)
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


class _StopState:
    """One stop string and its KMP state (the longest text tail that is a prefix of it)."""

    __slots__ = ("stop", "_fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        # _fail[i]: length of the longest proper prefix of stop[: i + 1] that is also its suffix.
        fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self._fail = fail
        self.state = 0

    def feed(self, text: str) -> int:
        """Advance over ``text``; the index in ``text`` just past the first match, or -1."""
        stop, fail, k, n = self.stop, self._fail, self.state, len(self.stop)
        for i, ch in enumerate(text):
            while k and stop[k] != ch:
                k = fail[k - 1]
            if stop[k] == ch:
                k += 1
                if k == n:
                    self.state = k
                    return i + 1
        self.state = k
        return -1

    def skip(self, text: str) -> None:
        """Advance over ``text`` ignoring matches (stop strings not checked yet: min_tokens)."""
        while (end := self.feed(text)) >= 0:
            self.state = self._fail[-1]
            text = text[end:]


class StopChecker:
    """Finds stop strings across text pieces and holds back possible stop prefixes."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [_StopState(s) for s in dict.fromkeys(stop) if s]
        self._include = include_stop_str_in_output
        self._streamed: list[str] = []  # text already returned
        self._pending = ""  # text held back: a tail that may still become a stop string
        self.stopped = False
        self.stop_str: str | None = None

    @property
    def active(self) -> bool:
        """There are stop strings to watch for."""
        return bool(self._stops)

    @property
    def text(self) -> str:
        """All text so far, cut at the stop string if one matched."""
        return "".join(self._streamed) + self._pending

    def append(self, new_text: str, finished: bool = False, check: bool = True) -> TextDelta:
        """Add text; return what may be streamed now. ``check=False``: no stop string may end
        in this text (vLLM's ``min_tokens`` rule), but it still counts for later matches."""
        if self.stopped:
            return TextDelta("", True, self.stop_str)
        base = len(self._pending)
        self._pending += new_text
        best: tuple[int, str] | None = None
        for state in self._stops if check else ():
            end = state.feed(new_text)
            if end >= 0:
                # A match starts at or after the held-back tail: its part in the old text was a
                # prefix of the stop, hence no longer than that stop's state, hence held back.
                start = base + end - len(state.stop)
                if best is None or start < best[0]:
                    best = (start, state.stop)
        if best is not None:
            start, stop = best
            self.stopped, self.stop_str = True, stop
            return TextDelta(self._take(start + len(stop) if self._include else start), True, stop)
        if not check:
            for state in self._stops:
                state.skip(new_text)
        hold = 0 if finished else max((s.state for s in self._stops), default=0)
        return TextDelta(self._take(len(self._pending) - hold))

    def _take(self, end: int) -> str:
        """Stream ``_pending[:end]``; keep the rest held back (dropped once stopped)."""
        out, self._pending = self._pending[:end], "" if self.stopped else self._pending[end:]
        self._streamed.append(out)
        return out


class IncrementalDetokenizer:
    """Per-request token ids -> streamable text, with stop strings (see module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = TokenWindowDecoder(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = StopChecker(params.stop, params.include_stop_str_in_output)
        self._min_tokens = params.min_tokens

    @property
    def output_text(self) -> str:
        """All text decoded so far (including held-back text), cut at a matched stop string."""
        return self._stop.text

    @property
    def output_token_ids(self) -> list[int]:
        return self._decoder.output_token_ids

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> TextDelta:
        """Feed the request's new token ids; ``finished`` flushes held-back text.

        After a stop string matched, further updates return empty text with ``stopped`` set.
        """
        if self._stop.stopped:
            return TextDelta("", True, self._stop.stop_str)
        if len(new_token_ids) > 1 and self._stop.active:
            return self._update_each(new_token_ids, finished)
        piece = self._decoder.update(new_token_ids, flush=finished)
        # vLLM: stop strings count only once more than min_tokens tokens were generated.
        check = len(self._decoder.output_token_ids) > self._min_tokens
        return self._stop.append(piece, finished=finished, check=check)

    def _update_each(self, new_token_ids: Sequence[int], finished: bool) -> TextDelta:
        """Several tokens with stop strings to watch: one at a time, so that the output ends
        at the token that completed a stop string, as it does one token per step."""
        text = []
        for i, token in enumerate(new_token_ids):
            last = i == len(new_token_ids) - 1
            out = self.update([token], finished=finished and last)
            text.append(out.text)
            if out.stopped:
                kept = None if last else i + 1
                return TextDelta("".join(text), True, out.stop_str, kept_tokens=kept)
        return TextDelta("".join(text))
