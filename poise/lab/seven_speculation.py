"""Q8 of `poise lab` (issue 34): when speculative decoding pays, read from the ``speculation``
group's cells (off, ngram adaptive, ngram fixed k=4; one cell per concurrency)."""

from __future__ import annotations

from poise.lab.cell_metrics import fmt_ms
from poise.lab.seven_answers import Section, _missing, _tps
from poise.lab.seven_data import Cell, LabData, percentile

CONFIGS = ("off", "ngram-adaptive", "ngram-fixed")


def _tpot(c: Cell) -> float | None:
    return percentile(c.tpot_ms, 50)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _value(ratio: str) -> float:
    return float(ratio.rstrip("x")) if ratio != "-" else float("nan")


def _above(ratio: str) -> bool:
    return _value(ratio) > 1.0


def q8_speculation(d: LabData) -> Section:
    cells = {n: d.cells.get("speculation", {}).get(n, []) for n in CONFIGS}
    if any(not cs for cs in cells.values()) or len({len(cs) for cs in cells.values()}) != 1:
        return _missing(8, "the speculation group's cells")
    rows, gains, costs = [], [], []
    for off, ada, fix in zip(*(cells[n] for n in CONFIGS), strict=True):
        base_tps = off.metrics.output_tokens_per_s
        for name, c in (("off", off), ("ngram-adaptive", ada), ("ngram-fixed", fix)):
            tps = c.metrics.output_tokens_per_s
            rows.append(
                f"| {off.label} | {name} | {fmt_ms(_tpot(c))} | {_tps(tps)} | "
                f"{_ratio(_tpot(off), _tpot(c))} | {_ratio(tps, base_tps)} | "
                f"{fmt_ms(c.metrics.ttft_p95_ms)} |"
            )
        gains.append((off.label, _ratio(_tpot(off), _tpot(ada))))
        costs.append(
            (
                off.label,
                _ratio(fix.metrics.output_tokens_per_s, base_tps),
                _ratio(ada.metrics.output_tokens_per_s, base_tps),
            )
        )
    low, high = gains[0], costs[-1]
    text = (
        f"At the lowest load ({low[0]}) adaptive speculation's TPOT p50 was {low[1]} that of "
        "speculation off divided by its own (TPOT off / on): "
        + ("it paid" if _above(low[1]) else "it did not pay")
        + f". At the highest ({high[0]}) a fixed k=4 gave {high[1]} the output tokens/s of "
        f"speculation off and adaptive {high[2]}: "
        + (
            "drafts still paid at this load (the step had spare compute for them)."
            if _above(high[1])
            else "the step is compute-bound there, every draft costs about what a decode "
            "earns, and a fixed k keeps paying for rejected drafts"
            + (
                "; the scheduler's depth rule (the k that maximises the step's predicted "
                "tokens per second, docs/speculation.md) drafts less and lost less."
                if _value(high[2]) > _value(high[1])
                else "."
            )
        )
    )
    note = d.group("speculation").get("note", "")
    table = [
        "| cell | config | TPOT p50 | out tok/s | TPOT off / this | tok/s this / off | TTFT p95 |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    return Section(8, True, [text, "", f"Workload: the seed mix; {note}.", "", *table])
