"""The seven answers, each written from a `poise lab` run's own numbers (``seven_data``).

An answer is two or three sentences whose claims follow the signs of the measured differences
(never folklore: when the run contradicts the textbook, the text says what the run shows), the
numbers behind them, and whether the run could answer at all (cells missing, too few
requests). Plots are drawn by ``seven_plots`` from the same cells. Answers 1 to 4 are here,
5 to 7 (and ``ANSWERS``, all seven in order) in ``seven_answers_late``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.lab.cell_metrics import CellMetrics, fmt_ms
from poise.lab.seven_data import FEW_REQUESTS, Cell, LabData, mean, percentile


@dataclass
class Section:
    question: int
    answered: bool
    lines: list[str] = field(default_factory=list)
    why_not: str = ""
    plot: str | None = None  # plot key (seven_plots.PLOTS)


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} tok/s"


def _x(a: float | None, b: float | None) -> str:
    return "?" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _few(cells: list[Cell]) -> list[str]:
    n = min(c.n for c in cells)
    if n >= FEW_REQUESTS:
        return []
    return [
        f"_Caveat: {n} measured requests per cell; a p95 of so few is close to the "
        "maximum, so differences under about 20 % are within noise._"
    ]


def _missing(q: int, what: str) -> Section:
    return Section(q, False, [f"Not answered by this run: {what}."], why_not=what)


def q1_batching(d: LabData) -> Section:
    modes = ["continuous", "static", "dynamic"]
    cells = {m: d.get("batching", m) for m in modes}
    if any(c is None for c in cells.values()):
        gone = [m for m, c in cells.items() if c is None]
        return _missing(1, f"batching cells missing or too small ({', '.join(gone)})")
    c, s, y = (cells[m].metrics for m in modes)  # type: ignore[union-attr]
    delay = d.configs("batching").get("dynamic", {}).get("max_batch_delay_ms")
    lines = ["| mode | output tok/s | TTFT p50 | TTFT p95 | E2E p95 |", "|---|---|---|---|---|"]
    for m in modes:
        k = cells[m].metrics  # type: ignore[union-attr]
        lines.append(
            f"| {m} | {_tps(k.output_tokens_per_s)} | {fmt_ms(k.ttft_p50_ms)} | "
            f"{fmt_ms(k.ttft_p95_ms)} | {fmt_ms(k.e2e_p95_ms)} |"
        )
    better_thr = (c.output_tokens_per_s or 0) > (s.output_tokens_per_s or 0)
    better_ttft = (c.ttft_p95_ms or 0) < (s.ttft_p95_ms or 0)
    if better_thr and better_ttft:
        verdict = (
            f"Continuous batching served {_x(c.output_tokens_per_s, s.output_tokens_per_s)} "
            f"static batching's throughput at {_x(c.ttft_p95_ms, s.ttft_p95_ms)} its TTFT "
            "p95: static admits a new batch only when the whole previous one is done, so "
            "finished requests leave their slots empty and newcomers wait for the longest "
            "output in front of them; continuous batching refills the slots every step."
        )
    else:
        verdict = (
            f"Here continuous batching did not beat static on both counts (throughput "
            f"{_x(c.output_tokens_per_s, s.output_tokens_per_s)}, TTFT p95 "
            f"{_x(c.ttft_p95_ms, s.ttft_p95_ms)} of static's): with outputs this similar "
            "or this little load, a batch barely waits for its longest member."
        )
    dyn = _dynamic_text(y, s, delay)
    return Section(
        1,
        True,
        [verdict, dyn, "", *lines, "", *_open_loop(d), *_few(list(cells.values()))],  # type: ignore[arg-type]
        plot="batching",
    )


def _open_loop(d: LabData) -> list[str]:
    """The open-loop cells of ``batching-open``, when the run has them."""
    modes = ["continuous", "static", "dynamic"]
    cells = {m: d.get("batching-open", m) for m in modes}
    if any(c is None for c in cells.values()):
        return ["(No open-loop cells in this run: `--only batching-open` adds them.)", ""]
    c, s, y = (cells[m].metrics for m in modes)  # type: ignore[union-attr]
    note = d.group("batching-open").get("note", "open loop")
    c95, s95, y95 = (k.ttft_p95_ms or 0.0 for k in (c, s, y))
    ttfts = (
        f"TTFT p95 was {fmt_ms(c95)} (continuous), {fmt_ms(s95)} (static) and "
        f"{fmt_ms(y95)} (dynamic); p50 {fmt_ms(c.ttft_p50_ms)}, {fmt_ms(s.ttft_p50_ms)}, "
        f"{fmt_ms(y.ttft_p50_ms)}"
    )
    if y95 > s95 > c95:
        text = (
            f"With arrivals spaced out ({note}) {ttfts}: a request that arrives while a "
            "static batch runs waits for all of it, and dynamic batching adds its delay to "
            "the first request of every batch, a bet that fuller batches repay only under "
            "load; continuous batching admits each request at the next step."
        )
    else:
        text = (
            f"With arrivals spaced out ({note}) {ttfts}: this run does not separate the "
            "three as expected (continuous first, dynamic last by about its delay), so at "
            "this load and sample size the open-loop cells support no claim."
        )
    rows = [
        "| mode (open loop) | output tok/s | TTFT p50 | TTFT p95 | E2E p95 |",
        "|---|---|---|---|---|",
    ]
    for m in modes:
        k = cells[m].metrics  # type: ignore[union-attr]
        rows.append(
            f"| {m} | {_tps(k.output_tokens_per_s)} | {fmt_ms(k.ttft_p50_ms)} | "
            f"{fmt_ms(k.ttft_p95_ms)} | {fmt_ms(k.e2e_p95_ms)} |"
        )
    return [text, "", *rows, ""]


def _dynamic_text(y: CellMetrics, s: CellMetrics, delay: float | None) -> str:
    thr, ttft = y.output_tokens_per_s or 0.0, y.ttft_p95_ms or 0.0
    same = (
        abs(thr - (s.output_tokens_per_s or 0.0)) <= 0.02 * thr
        and abs(ttft - (s.ttft_p95_ms or 0.0)) <= 0.02 * ttft
    )
    head = f"Dynamic batching (an idle engine waits up to {delay or 0:g} ms for a full batch)"
    if same:
        return (
            f"{head} measured the same as static here: in a saturated closed loop every "
            "request has waited longer than the delay by the time the engine is free, so "
            "batches start at once; the delay only matters when requests trickle into an "
            "idle engine, where it trades latency for fuller batches."
        )
    return (
        f"{head} reached {_x(y.output_tokens_per_s, s.output_tokens_per_s)} static's "
        f"throughput at {_x(y.ttft_p95_ms, s.ttft_p95_ms)} its TTFT p95: the delay trades "
        "latency for fuller batches."
    )


def q2_averages(d: LabData) -> Section:
    cell = d.get("mix", "decode-first", last=True)
    if cell is None:
        return _missing(2, "the mixed cell of the decode-first config is missing")
    p50, p95, avg = (percentile(cell.ttft_ms, 50), percentile(cell.ttft_ms, 95), mean(cell.ttft_ms))
    tp50, tp95 = percentile(cell.tpot_ms, 50), percentile(cell.tpot_ms, 95)
    short = cell.class_ttft_ms.get("short", [])
    long = cell.class_ttft_ms.get("long", [])
    gap = (avg - p50) / p50 if avg is not None and p50 else None
    s50, l50 = percentile(short, 50), percentile(long, 50)
    classes = ""
    if s50 and l50 and max(s50, l50) > 1.3 * min(s50, l50):
        classes = f", nor that short prompts waited {fmt_ms(s50)} (p50) and long ones {fmt_ms(l50)}"
    lines = [
        f"In this run's mixed cell ({cell.label}, {cell.n} requests) TTFT p50 was {fmt_ms(p50)}, "
        f"the mean {fmt_ms(avg)} ({'?' if gap is None else f'{gap * 100:+.0f} %'} from the "
        f"median) and p95 {fmt_ms(p95)} ({_x(p95, p50)} the median): an average of "
        f"{fmt_ms(avg)} says nothing about the one request in twenty that waited "
        f"{fmt_ms(p95)} or more{classes}, and the tail is where users give up.",
        f"TTFT is the silence before the first token (queue + prefill: the user waits for the "
        f"answer to start); TPOT is the pace after it (p50 {fmt_ms(tp50)}, p95 {fmt_ms(tp95)} "
        "per token here: whether the stream reads smoothly). Both need percentiles, per class.",
        "",
        "| | p50 | mean | p95 |",
        "|---|---|---|---|",
        f"| TTFT, all | {fmt_ms(p50)} | {fmt_ms(avg)} | {fmt_ms(p95)} |",
        f"| TTFT, short | {fmt_ms(percentile(short, 50))} | {fmt_ms(mean(short))} | "
        f"{fmt_ms(percentile(short, 95))} |",
        f"| TTFT, long | {fmt_ms(percentile(long, 50))} | {fmt_ms(mean(long))} | "
        f"{fmt_ms(percentile(long, 95))} |",
        f"| TPOT | {fmt_ms(tp50)} | {fmt_ms(mean(cell.tpot_ms))} | {fmt_ms(tp95)} |",
        "",
        *_few([cell]),
    ]
    return Section(2, True, lines, plot="averages")


def q3_policies(d: LabData) -> Section:
    a = d.get("mix", "decode-first", last=True)
    b = d.get("mix", "prefill-first", last=True)
    if a is None or b is None:
        return _missing(3, "the mixed cells of decode-first and prefill-first")
    rows = []
    for name, c in (("decode-first (fifo)", a), ("prefill-first", b)):
        rows.append(
            f"| {name} | {fmt_ms(percentile(c.class_ttft_ms.get('short', []), 95))} | "
            f"{fmt_ms(percentile(c.class_ttft_ms.get('long', []), 95))} | "
            f"{fmt_ms(percentile(c.tpot_ms, 50))} | {fmt_ms(percentile(c.tpot_ms, 95))} "
            f"| {_tps(c.metrics.output_tokens_per_s)} |"
        )
    ttft_a, ttft_b = percentile(a.ttft_ms, 95), percentile(b.ttft_ms, 95)
    tpot_a, tpot_b = percentile(a.tpot_ms, 95), percentile(b.tpot_ms, 95)
    trade = (
        f"TTFT p95 {fmt_ms(ttft_a)} -> {fmt_ms(ttft_b)}, TPOT p95 {fmt_ms(tpot_a)} -> "
        f"{fmt_ms(tpot_b)} from decode-first to prefill-first"
    )
    principle = (
        "In principle prefill-first sacrifices TPOT (decodes skip steps while "
        "prefills take the budget) and decode-first TTFT (waiting prompts get the "
        "budget only after every running decode)."
    )
    if _down(ttft_b, ttft_a) and _up(tpot_b, tpot_a):
        verdict = (
            f"Prefill-first bought first tokens with the running streams' smoothness "
            f"({trade}). {principle}"
        )
    elif _up(ttft_b, ttft_a) and _up(tpot_b, tpot_a):
        verdict = (
            f"Prefill-first did not buy first tokens here ({trade}): it sacrificed "
            "TTFT and TPOT alike at this load (the policy benchmark in "
            "docs/scheduling.md saw the same whenever long prompts queue). Decode-first "
            "keeps running streams steady and makes new prompts wait for the decodes."
        )
    elif not any(f(x, y) for f in (_up, _down) for x, y in ((ttft_b, ttft_a), (tpot_b, tpot_a))):
        verdict = (
            f"The two policies measured alike here ({trade}): the queue was not "
            f"prefill-bound at this load. {principle}"
        )
    else:
        verdict = (
            f"This run does not show the textbook trade ({trade}). {principle} "
            f"With {min(a.n, b.n)} requests per cell the tails are single requests, "
            "so a run with more requests (or the simulator) is needed to separate them."
        )
    table = [
        "| policy | short TTFT p95 | long TTFT p95 | TPOT p50 | TPOT p95 | out tok/s |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    return Section(
        3, True, [verdict, "", f"Cell: {a.label}.", "", *table, "", *_few([a, b])], plot="policies"
    )


def _up(new: float | None, old: float | None) -> bool:
    return (new or 0.0) > 1.05 * (old or 0.0)


def _down(new: float | None, old: float | None) -> bool:
    return (new or 0.0) < 0.95 * (old or 0.0)


def q4_long_prompts(d: LabData) -> Section:
    cells = d.cells.get("mix", {}).get("decode-first", [])
    base = next((c for c in cells if c.long_ratio == 0.0), None)
    mixed = next((c for c in reversed(cells) if (c.long_ratio or 0) > 0), None)
    if base is None or mixed is None:
        return _missing(4, "decode-first cells with and without long prompts")
    s0 = base.class_ttft_ms.get("short", [])
    s1 = mixed.class_ttft_ms.get("short", [])
    if not s0 or not s1:
        return _missing(4, "short requests in both cells")
    p50_0, p95_0, p50_1, p95_1 = (
        percentile(s0, 50),
        percentile(s0, 95),
        percentile(s1, 50),
        percentile(s1, 95),
    )
    slower = (p95_1 or 0) > 1.1 * (p95_0 or 0)
    if slower:
        verdict = (
            f"With long prompts at ratio {mixed.long_ratio:g} short prompts' TTFT p95 went "
            f"from {fmt_ms(p95_0)} to {fmt_ms(p95_1)} ({_x(p95_1, p95_0)}; p50 "
            f"{fmt_ms(p50_0)} -> {fmt_ms(p50_1)}): a short prompt that arrives behind a "
            "long prefill waits for it (or for its chunks, which share each step's token "
            "budget), and long requests also hold slots and KV for longer."
        )
    else:
        verdict = (
            f"Here long prompts did not measurably slow short ones (TTFT p95 "
            f"{fmt_ms(p95_0)} -> {fmt_ms(p95_1)}): the token budget absorbed the long "
            "prefills at this load."
        )
    fix = (
        "Bounds: chunked prefill with a smaller token budget or `--long-prefill-token-"
        "threshold`, the `slo` policy with traffic classes, or separate pools."
    )
    return Section(4, True, [verdict, fix, "", *_few([base, mixed])], plot="long_prompts")
