"""Incremental detokenizer and stop strings, on the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from poise.core.sampling_params import SamplingParams
from poise.text import IncrementalDetokenizer, StopChecker, TextDelta, load_tokenizer
from poise.text.tokenizer import Tokenizer

SHORT = "用三句话解释 continuous batching。"
LONG = "请阅读以下模拟日志并总结调度瓶颈。" + " waiting=12 running=48 kv=82%; " * 20
MIXED = "Emoji 🚀🎉👩‍💻 mixed with 中文、日本語のテキスト and ünïcödé — done.\n\tTabs  and  spaces"
PROMPT = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return load_tokenizer()


def _stream(
    tok: Tokenizer,
    ids: list[int],
    params: SamplingParams | None = None,
    chunks: list[int] | None = None,
) -> tuple[list[TextDelta], IncrementalDetokenizer]:
    """Feed ids in chunks (default one at a time), finishing with the last chunk."""
    detok = IncrementalDetokenizer(tok, PROMPT, params or SamplingParams())
    sizes = chunks or [1] * len(ids)
    deltas, pos = [], 0
    for i, n in enumerate(sizes):
        deltas.append(detok.update(ids[pos : pos + n], finished=i == len(sizes) - 1))
        pos += n
        if deltas[-1].stopped:
            break
    return deltas, detok


@pytest.mark.parametrize("text", [SHORT, LONG, MIXED])
def test_one_token_at_a_time_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas, detok = _stream(tok, ids)
    assert "".join(d.text for d in deltas) == tok.decode(ids) == text
    assert detok.output_text == text
    # A character split over tokens is never streamed half-done as U+FFFD.
    assert all("\ufffd" not in d.text for d in deltas)
    if text != SHORT:
        return
    # Multi-byte characters do span tokens here, so some updates must have been held back.
    assert any(d.text == "" for d in deltas)


def test_split_emoji_is_emitted_once_complete(tok: Tokenizer) -> None:
    ids = tok.encode(" 🚀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's 4 bytes span tokens in this vocabulary
    detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams())
    pieces = [detok.update([i]).text for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == " 🚀"


def test_random_ids_and_chunks_equal_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    text_ids = tok.encode(MIXED + SHORT, add_special_tokens=False)
    for trial in range(30):
        if trial % 2:
            ids = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 60))]
        else:  # real text with random special tokens (skipped) mixed in
            ids = list(text_ids)
            for _ in range(3):
                ids.insert(rng.randrange(len(ids)), rng.choice([0, 1, 2]))
        chunks: list[int] = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randrange(1, 5), len(ids) - sum(chunks)))
        deltas, _ = _stream(tok, ids, chunks=chunks)
        assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_kept_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("hi", add_special_tokens=False) + [2]
    detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams(), skip_special_tokens=False)
    text = "".join(detok.update([i], finished=i == 2).text for i in ids)
    assert text == "hi<|im_end|>"


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    text = "The answer is 42. END OF ANSWER and then more words"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "END OF ANSWER"
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop string spans tokens
    deltas, detok = _stream(tok, ids, SamplingParams(stop=[stop]))
    assert deltas[-1].stopped and deltas[-1].stop_str == stop
    assert "".join(d.text for d in deltas) == detok.output_text == "The answer is 42. "
    # Stopped before the end of the ids: the caller finishes the request there.
    assert len(detok.output_token_ids) < len(ids)
    assert detok.update(ids[-1:]) == TextDelta("", True, stop)


def test_stop_string_inside_a_multi_token_update(tok: Tokenizer) -> None:
    """Speculative decoding delivers several tokens at once: the output still ends at the token
    that completed the stop string, as when they come one per step."""
    text = "The answer is 42. END OF ANSWER and then more words"
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["END OF ANSWER"])
    one_by_one, single = _stream(tok, ids, params)
    kept = len(single.output_token_ids)
    assert kept < len(ids) - 2
    deltas, detok = _stream(tok, ids, params, chunks=[kept - 3, len(ids) - kept + 3])
    assert deltas[-1].stopped and deltas[-1].kept_tokens == 3
    assert "".join(d.text for d in deltas) == "".join(d.text for d in one_by_one)
    assert detok.output_token_ids == single.output_token_ids


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    text = "用三句话解释。第二句。第三句。"
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["第二句"], include_stop_str_in_output=True)
    deltas, detok = _stream(tok, ids, params)
    assert "".join(d.text for d in deltas) == detok.output_text == "用三句话解释。第二句"


def test_holds_back_partial_stop_prefix() -> None:
    checker = StopChecker(["STOP", "</s>"])
    assert checker.append("abc ST").text == "abc "  # "ST" may begin "STOP"
    assert checker.append("O").text == ""  # "STO" still may
    assert checker.append("x <").text == "STOx "  # disambiguated; "<" may begin "</s>"
    d = checker.append("/s> tail")
    assert (d.text, d.stopped, d.stop_str) == ("", True, "</s>")
    assert checker.text == "abc STOx "


def test_held_back_text_is_flushed_at_finish() -> None:
    checker = StopChecker(["STOP"])
    assert checker.append("the end ST").text == "the end "
    assert checker.append("", finished=True).text == "ST"
    assert checker.text == "the end ST" and not checker.stopped


def test_earliest_stop_wins_and_no_stops_streams_everything() -> None:
    checker = StopChecker(["world", "lo w"])
    d = checker.append("hello world")
    assert d.stopped and d.stop_str == "lo w" and checker.text == "hel"
    free = StopChecker([])
    assert free.append("a").text == "a" and free.append("b").text == "b"


def test_stop_found_across_many_small_pieces() -> None:
    checker = StopChecker(["\n\nUser:"], include_stop_str_in_output=False)
    out = [checker.append(c) for c in "Reply.\n\nUser: next"]
    assert "".join(d.text for d in out) == "Reply."
    assert sum(d.stopped for d in out) >= 1 and checker.text == "Reply."


def test_stop_strings_count_only_after_min_tokens(tok: Tokenizer) -> None:
    # vLLM: a stop string may end the text only once more than min_tokens tokens exist.
    ids = tok.encode(" ab ab ab cd", add_special_tokens=False)
    plain, _ = _stream(tok, ids, SamplingParams(stop=["ab"]))
    assert plain[-1].stopped and "".join(d.text for d in plain) == " "
    late = SamplingParams(stop=["ab"], min_tokens=2)
    deltas, detok = _stream(tok, ids, late)
    # " ab" is one token: the matches ending in tokens 1 and 2 are skipped, the third stops.
    assert [tok.decode([i]) for i in ids[:3]] == [" ab"] * 3
    assert deltas[-1].stopped and detok.output_text == " ab ab "
    # A stop string started before min_tokens and ending after it still counts.
    checker = StopChecker(["xyz"])
    assert not checker.append("abxy", check=False).stopped
    assert checker.append("z!").stopped and checker.text == "ab"
