"""The seed lab's questions, answered with a sweep's own numbers where the sweep measured them:

- how the long-prompt ratio moves short requests' TTFT (per config and concurrency);
- what prefill-first and FIFO each sacrifice (configs that differ only in the policy);
- what holds the queue when ``waiting`` stays high (KV headroom vs request cap / budget).

A question the sweep cannot answer says so and names the configs or cells that would.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from poise.bench.bench_config import CellSpec
from poise.lab.cell_metrics import CellMetrics, fmt_ms, fmt_pct, rel_change

if TYPE_CHECKING:
    from poise.lab.sweep import SweepResult

Grid = dict[str, dict[str, CellMetrics]]


def answer_questions(result: SweepResult, grid: Grid) -> list[str]:
    out = ["## The lab's questions, with this run's numbers", ""]
    out += long_ratio_answer(result, grid)
    out += policy_answer(result, grid)
    out += waiting_answer(result, grid)
    return out


def long_ratio_answer(result: SweepResult, grid: Grid) -> list[str]:
    out = ["### How do long prompts move short requests' TTFT?", ""]
    w = result.workload
    ratios = sorted(w.long_ratio)
    if not w.mixes_by_ratio or len(ratios) < 2 or ratios[0] != 0.0:
        return out + [
            "Not measured: sweep the seed mix with long ratios including 0 and one above it.",
            "",
        ]
    loads = list(dict.fromkeys(CellSpec(c.concurrency, c.request_rate) for c in w.cells()))
    growth: list[tuple[float, str]] = []
    for spec in result.specs:
        cells = grid.get(spec.name, {})
        for load in loads:
            pts = []
            for r in ratios:
                m = cells.get(dataclasses.replace(load, long_ratio=r).label)
                v = m.class_ttft_p95_ms.get("short") if m else None
                pts.append((r, v))
            if pts[0][1] is None or all(v is None for _, v in pts[1:]):
                continue
            trail = " -> ".join(f"{fmt_ms(v)} (long {r:g})" for r, v in pts)
            last = [v for _, v in pts if v is not None][-1]
            k = last / pts[0][1] if pts[0][1] else None
            ratio_txt = "" if k is None else f": x{k:.1f}"
            out.append(f"- {spec.name}, {load.describe}: short TTFT p95 {trail}{ratio_txt}")
            if k is not None:
                growth.append((k, f"{spec.name} at {load.describe}"))
    if not growth:
        return out + ["No short-request TTFT was measured in both ratios.", ""]
    best, worst = min(growth), max(growth)
    span = f"x{best[0]:.1f} ({best[1]}) to x{worst[0]:.1f} ({worst[1]})"
    if best[0] < 0.9 and worst[0] > 1.1:
        verdict = (
            f"Mixed: short requests' TTFT p95 moved by {span}. Where it rose, short "
            "prompts waited behind long prefills sharing the token budget; where it fell, "
            "the difference is within this sample's noise (few requests per cell: raise "
            "--num-requests to separate the two)."
        )
    elif worst[0] < 1.1:
        verdict = (
            f"Here long prompts did not measurably slow short ones ({span}): at this load "
            "the token budget absorbed the long prefills."
        )
    else:
        verdict = (
            f"Here long prompts multiply short requests' TTFT p95 by {span}: short "
            "prompts wait behind long prefills that share the token budget. Smaller "
            "budgets, long_prefill_token_threshold or chunked prefill bound that wait; "
            "separate pools remove it."
        )
    return out + ["", verdict, ""]


def policy_pairs(result: SweepResult) -> list[tuple[str, str]]:
    """(fifo config, prefill_first config) pairs that differ only in the policy."""
    from poise.config import normalize_policy

    def key(args: dict[str, object]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, str(v)) for k, v in args.items() if k != "scheduling_policy"))

    poise_specs = [s for s in result.specs if s.command is None]
    pairs = []
    for a in poise_specs:
        for b in poise_specs:
            pa = normalize_policy(str(a.args.get("scheduling_policy", "fifo")))
            pb = normalize_policy(str(b.args.get("scheduling_policy", "fifo")))
            if (
                pa == "fifo"
                and pb == "prefill_first"
                and key(a.args) == key(b.args)
                and a.model == b.model
            ):
                pairs.append((a.name, b.name))
    return pairs


def policy_answer(result: SweepResult, grid: Grid) -> list[str]:
    out = ["### What do prefill-first and FIFO each sacrifice here?", ""]
    pairs = policy_pairs(result)
    if not pairs:
        return out + [
            "Not measured: no two configs differ only in scheduling_policy "
            "(`poise sweep --preset policy` has such a pair).",
            "",
        ]
    for fifo, pf in pairs:
        for cell in result.workload.cells():
            a, b = grid.get(fifo, {}).get(cell.label), grid.get(pf, {}).get(cell.label)
            if a is None or b is None:
                continue
            out.append(
                f"- {cell.label}: prefill-first ({pf}) vs FIFO ({fifo}): TTFT p95 "
                f"{_pct(rel_change(b.ttft_p95_ms, a.ttft_p95_ms))} ({fmt_ms(a.ttft_p95_ms)} -> "
                f"{fmt_ms(b.ttft_p95_ms)}), TPOT p50 {_pct(rel_change(b.tpot_p50_ms, a.tpot_p50_ms))}"
                f" ({fmt_ms(a.tpot_p50_ms)} -> {fmt_ms(b.tpot_p50_ms)}), throughput "
                f"{_pct(rel_change(b.output_tokens_per_s, a.output_tokens_per_s))}"
            )
    out += ["", _policy_verdict(result, grid, pairs), ""]
    return out


def _policy_verdict(result: SweepResult, grid: Grid, pairs: list[tuple[str, str]]) -> str:
    """One sentence from the signs of the measured changes, not from folklore."""
    ttft, tpot = [], []
    for fifo, pf in pairs:
        for cell in result.workload.cells():
            a, b = grid.get(fifo, {}).get(cell.label), grid.get(pf, {}).get(cell.label)
            if a is None or b is None:
                continue
            if (x := rel_change(b.ttft_p95_ms, a.ttft_p95_ms)) is not None:
                ttft.append(x)
            if (y := rel_change(b.tpot_p50_ms, a.tpot_p50_ms)) is not None:
                tpot.append(y)
    if not ttft or not tpot:
        return "No cell measured both policies."
    dt, dp = sum(ttft) / len(ttft), sum(tpot) / len(tpot)
    if dt < -0.05 and dp > 0.05:
        return (
            f"Here prefill-first bought first tokens (TTFT p95 {_pct(dt)} on average) with "
            f"decode smoothness (TPOT p50 {_pct(dp)}); FIFO keeps TPOT steady and makes "
            "queued prompts wait."
        )
    if dt < -0.05 and dp < -0.05:
        return (
            f"Here prefill-first improved TTFT p95 ({_pct(dt)}) and TPOT p50 ({_pct(dp)}) "
            "alike. A policy trades one for the other, so a gain on both sides points to a "
            "difference in machine load between the two configs' runs (they run one after "
            "the other); re-measure them back to back, with more requests per cell."
        )
    if dt < -0.05:
        return f"Here prefill-first cut TTFT p95 ({_pct(dt)}) at little TPOT cost ({_pct(dp)})."
    return (
        f"Here prefill-first did not pay (TTFT p95 {_pct(dt)}, TPOT p50 {_pct(dp)} on "
        "average): the queue was not prefill-bound at this load, so FIFO (decode-first) "
        "sacrifices nothing; raise the load or the long ratio to see the trade."
    )


def waiting_answer(result: SweepResult, grid: Grid) -> list[str]:
    out = ["### When `waiting` stays high, what is the limit?", ""]
    rows = []
    for spec in result.specs:
        for label, m in grid.get(spec.name, {}).items():
            if m.waiting_mean is None or m.waiting_mean < 1.0:
                continue
            if m.preemptions or (m.kv_usage_peak is not None and m.kv_usage_peak >= 0.9):
                why = (
                    f"KV cache (peak {fmt_pct(m.kv_usage_peak)}, {m.preemptions or 0} preemptions)"
                )
            else:
                why = (
                    f"request cap or token budget (KV peak {fmt_pct(m.kv_usage_peak)}: "
                    "headroom left)"
                )
            rows.append(
                f"- {spec.name} {label}: waiting {m.waiting_mean:.1f} on average; limit: {why}"
            )
    if not rows:
        return out + [
            "No cell kept requests waiting (mean waiting < 1), or the server exposes "
            "no waiting gauge.",
            "",
        ]
    return out + rows + [""]


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x * 100:+.0f} %"
