"""Text output of ``poise tune``: the decisions, the evidence table, the two answers and a
ready command line for each (or "no config meets the SLO" with the closest miss)."""

from __future__ import annotations

from collections.abc import Callable

from poise.lab.cell_metrics import fmt_ms, fmt_pct
from poise.lab.probe import Candidate
from poise.lab.tune_result import Evidence, TuneResult

CommandFn = Callable[[Candidate], str]

HEADER = (
    "#",
    "phase",
    "budget",
    "seqs",
    "policy",
    "TTFT p50",
    "TTFT p95",
    "TPOT p50",
    "E2E p95",
    "out tok/s",
    "KV peak",
    "preempt",
    "SLO",
)


def evidence_rows(result: TuneResult) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for e in result.evidence:
        c, m = e.candidate, e.metrics
        marks = []
        if e is result.throughput_first:
            marks.append("T")
        if e is result.latency_first:
            marks.append("L")
        slo = ("yes" if e.meets_slo else "no") + (f" [{','.join(marks)}]" if marks else "")
        knobs = (
            str(e.index),
            e.phase,
            str(c.max_num_batched_tokens),
            str(c.max_num_seqs),
            c.scheduling_policy,
        )
        if m is None:  # the probe failed: its row says so and leaves the measurements blank
            measured = ("error", "", "", "", "", "", "")
        else:
            measured = (
                fmt_ms(m.ttft_p50_ms),
                fmt_ms(m.ttft_p95_ms),
                fmt_ms(m.tpot_p50_ms),
                fmt_ms(m.e2e_p95_ms),
                "-" if m.output_tokens_per_s is None else f"{m.output_tokens_per_s:.1f}",
                fmt_pct(m.kv_usage_peak),
                "-" if m.preemptions is None else str(m.preemptions),
            )
        rows.append((*knobs, *measured, slo))
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A Markdown table (readable as plain text too)."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _answer(title: str, e: Evidence, command: CommandFn) -> list[str]:
    m = e.metrics
    assert m is not None
    tps = "-" if m.output_tokens_per_s is None else f"{m.output_tokens_per_s:.1f} tok/s"
    return [
        f"{title}: {e.candidate.label} (probe #{e.index}): {tps}, TTFT p95 "
        f"{fmt_ms(m.ttft_p95_ms)}, TPOT p50 {fmt_ms(m.tpot_p50_ms)}",
        f"  {command(e.candidate)}",
    ]


def format_result(result: TuneResult, command: CommandFn) -> str:
    s = result.settings
    slo = f"TTFT p95 <= {fmt_ms(s.slo_ttft_p95_ms)}"
    if s.slo_tpot_p50_ms is not None:
        slo += f", TPOT p50 <= {fmt_ms(s.slo_tpot_p50_ms)}"
    out = [f"SLO: {slo}", "", "Decisions:"]
    out += [f"  {i}. {d}" for i, d in enumerate(result.decisions, 1)]
    out += ["", "Evidence (T = throughput-first, L = latency-first):", ""]
    out += [table(HEADER, evidence_rows(result)), ""]
    if result.throughput_first is not None and result.latency_first is not None:
        out += _answer("Throughput-first", result.throughput_first, command)
        if result.latency_first is result.throughput_first:
            out.append(
                "Latency-first: the same config: no probed config has a lower TTFT p95 "
                "within the SLO, so nothing is traded here."
            )
        else:
            out += _answer("Latency-first", result.latency_first, command)
    else:
        out.append(f"No config meets the SLO ({slo}) among {len(result.evidence)} probes.")
        if result.closest is not None:
            m = result.closest.metrics
            assert m is not None
            out.append(
                f"Closest: {result.closest.candidate.label} (probe #{result.closest.index}), "
                f"TTFT p95 {fmt_ms(m.ttft_p95_ms)}. Lower the load, relax the SLO, or give "
                "short interactive requests their own pool (seed 000)."
            )
            out.append(f"  {command(result.closest.candidate)}")
    return "\n".join(out)
