"""StopChecker: the same answers as a brute-force search, at a per-piece cost that does not grow
with the text generated before (issue 20, item 2).

The cost is measured as bytes allocated by one ``append`` (tracemalloc), a deterministic proxy
for the text copied or searched: a checker that kept and re-joined the whole text would
allocate its full length on every piece.
"""

from __future__ import annotations

import random
import tracemalloc

from poise.text import StopChecker


def _reference(stops: list[str], pieces: list[str], include: bool) -> tuple[str, str | None]:
    """Text and stop string by brute force: after each piece, the earliest-starting
    occurrence of any stop in the whole text so far (the first piece that completes one)."""
    text = ""
    for piece in pieces:
        text += piece
        found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        if found:
            index, first = min(found)  # ties: the stop listed first
            stop = stops[first]
            return (text[: index + len(stop)] if include else text[:index]), stop
    return text, None


def test_matches_brute_force_on_random_texts_and_stops() -> None:
    rng = random.Random(20)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abc "
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))
        ]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        include = rng.random() < 0.3
        checker = StopChecker(stops, include_stop_str_in_output=include)
        streamed = ""
        for i, piece in enumerate(pieces):
            delta = checker.append(piece, finished=i == len(pieces) - 1)
            streamed += delta.text
            # Never streams text that a later stop could still claim: every tail of the text
            # that begins some stop string is still held back.
            so_far = "".join(pieces[: i + 1])
            if not delta.stopped and i < len(pieces) - 1:
                for s in stops:
                    for k in range(1, len(s)):
                        if so_far.endswith(s[:k]):
                            assert len(so_far) - k >= len(streamed), (stops, pieces, streamed)
            if delta.stopped:
                break
        want_text, want_stop = _reference(stops, pieces, include)
        assert (checker.text, checker.stop_str) == (want_text, want_stop), (stops, pieces)
        assert streamed == want_text, (stops, pieces)


def _bytes_allocated(checker: StopChecker, pieces: list[str]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for piece in pieces:
            checker.append(piece)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_cost_of_a_piece_does_not_grow_with_the_text_before_it() -> None:
    stops = ["</answer>", "\n\nUser:", "x" * 200 + "y"]
    short, long = StopChecker(stops), StopChecker(stops)
    long.append("some generated words " * 100_000)  # 2 MB of text already generated
    pieces = ["tok" + str(i) + " " for i in range(200)] + ["x" * 150]
    small = _bytes_allocated(short, pieces)
    big = _bytes_allocated(long, pieces)
    # The same pieces cost the same after 2 MB of text as after none (a few KB of windows);
    # keeping and copying the whole text would cost megabytes per piece.
    assert big < 64 * 1024, big
    assert big <= 2 * small + 4096, (small, big)
    assert not long.stopped and long.append("x" * 50 + "y").stopped
