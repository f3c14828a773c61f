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
- Each new piece of text is searched for every stop string, starting far enough back to catch
  a stop string that spans the previous piece. The earliest match wins; the output is cut
  before it (or after it with ``include_stop_str_in_output``) and ``stopped`` is reported.
- A tail of the text that is a proper prefix of some stop string (at most max stop length - 1
  characters) is held back from the stream until it is disambiguated, and flushed at finish.
  So streamed text never has to be retracted.
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


class StopChecker:
    """Finds stop strings across text pieces and holds back possible stop prefixes."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in stop if s]
        self._include = include_stop_str_in_output
        self._text = ""
        self._num_streamed = 0
        self.stopped = False
        self.stop_str: str | None = None

    @property
    def text(self) -> str:
        """All text so far, cut at the stop string if one matched."""
        return self._text

    def append(self, new_text: str, finished: bool = False) -> TextDelta:
        """Add text; return what may be streamed now."""
        if self.stopped:
            return TextDelta("", True, self.stop_str)
        old_len = len(self._text)
        self._text += new_text
        match = self._find_stop(old_len)
        if match is not None:
            index, stop = match
            self._text = self._text[: index + len(stop) if self._include else index]
            self.stopped, self.stop_str = True, stop
            return TextDelta(self._take(len(self._text)), True, stop)
        end = len(self._text) if finished else len(self._text) - self._holdback()
        return TextDelta(self._take(end))

    def _take(self, end: int) -> str:
        # Streamed text is never retracted: a stop match cannot start inside it (held back).
        out = self._text[self._num_streamed : end]
        self._num_streamed = max(self._num_streamed, end)
        return out

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """Earliest stop string occurrence that ends in the newly added text."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _holdback(self) -> int:
        """Length of the longest text tail that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


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
        piece = self._decoder.update(new_token_ids, flush=finished)
        return self._stop.append(piece, finished=finished)
