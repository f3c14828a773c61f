"""Measured vs simulated policy rankings, and the issue-12 targets, from slo_scheduling JSONs.

``benchmarks/slo_scheduling.py --json`` writes one file per run (measured on this machine, or
``--simulate``). This reads a measured file and a simulated one of the same cells and, per long
ratio and loop (closed / open), ranks the policies by SHORT TTFT p95 (lower first) and by
goodput (higher first), and says whether the two rankings agree.

Agreement is pairwise and up to ties: two policies whose values are within ``--tie`` of each
other (relative) are tied, and the rankings disagree only where one orders a pair strictly and
the other strictly the other way. The default tie, 15 %, is the spread between two quiet runs
of the same measured cell (fifo, closed loop at c=32, long ratio 0.25, 128 requests: SHORT
TTFT p95 2,791 vs 3,157 ms, goodput 0.430 vs 0.377 req/s; benchmarks/RESULTS.md): a smaller
difference is not a measured order.

It also prints, per measured cell, the targets: ``slo``'s SHORT TTFT p95 over the better of
fifo / prefill_first (target <= 1/3), its output tok/s over that baseline's (>= 95 %), and its
goodput over the better baseline goodput (>= 1.5x).

    .venv/bin/python benchmarks/compare_ranking.py measured.json simulated.json [--tie 0.15]
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

Row = dict[str, Any]
METRICS = (("short_ttft_p95_ms", False), ("goodput_req_s", True))  # (key, higher is better)


def loop(row: Row) -> str:
    return "closed" if "closed" in row["mode"] else "open"


def cells(path: str) -> dict[tuple[float, str], dict[str, Row]]:
    with open(path) as f:
        rows = json.load(f)["rows"]
    out: dict[tuple[float, str], dict[str, Row]] = {}
    for row in rows:
        out.setdefault((row["long_ratio"], loop(row)), {})[row["policy"]] = row
    return out


def before(a: float, b: float, higher: bool, tie: float) -> bool:
    """Whether ``a`` ranks strictly ahead of ``b`` (beyond the tie band)."""
    if higher:
        return a > b * (1 + tie)
    return a * (1 + tie) < b


def ranking(rows: dict[str, Row], key: str, higher: bool, tie: float) -> str:
    """The policies best first (``<`` / ``>``: strictly lower / higher than the next; ``~``:
    tied with it)."""
    order = sorted(rows, key=lambda p: rows[p][key], reverse=higher)
    text = order[0]
    for prev, cur in itertools.pairwise(order):
        strict = before(rows[prev][key], rows[cur][key], higher, tie)
        text += ((" > " if higher else " < ") if strict else " ~ ") + cur
    return text


def contradictions(
    measured: dict[str, Row], simulated: dict[str, Row], key: str, higher: bool, tie: float
) -> list[tuple[str, str]]:
    """Pairs ordered strictly one way measured and strictly the other way simulated."""
    common = sorted(set(measured) & set(simulated))
    bad = []
    for a, b in itertools.combinations(common, 2):
        ma, mb = measured[a][key], measured[b][key]
        sa, sb = simulated[a][key], simulated[b][key]
        if (before(ma, mb, higher, tie) and before(sb, sa, higher, tie)) or (
            before(mb, ma, higher, tie) and before(sa, sb, higher, tie)
        ):
            bad.append((a, b))
    return bad


def targets(rows: dict[str, Row], policy: str = "slo") -> str:
    base = [rows[p] for p in ("fifo", "prefill_first") if p in rows]
    if policy not in rows or not base:
        return "(no slo / baseline rows)"
    best = min(base, key=lambda r: r["short_ttft_p95_ms"])
    ours = rows[policy]
    ratio = ours["short_ttft_p95_ms"] / best["short_ttft_p95_ms"]
    tput = ours["output_tok_s"] / best["output_tok_s"]
    good = ours["goodput_req_s"] / max(r["goodput_req_s"] for r in base)
    ok = lambda c: "ok" if c else "MISSED"  # noqa: E731
    return (
        f"{policy}: SHORT p95 {ratio:.2f}x {best['policy']} ({ok(ratio <= 1 / 3)}), "
        f"tok/s {tput:.1%} ({ok(tput >= 0.95)}), goodput {good:.2f}x ({ok(good >= 1.5)})"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("measured")
    p.add_argument("simulated")
    p.add_argument("--tie", type=float, default=0.15)
    args = p.parse_args()
    measured, simulated = cells(args.measured), cells(args.simulated)
    disagreements = 0
    for cell in sorted(measured):
        m = measured[cell]
        print(f"== long ratio {cell[0]}, {cell[1]} loop")
        for policy in ("slo", "slo+controller"):
            print("  measured  " + targets(m, policy))
        s = simulated.get(cell)
        if s is None:
            print("  (no simulated cell)")
            continue
        for key, higher in METRICS:
            bad = contradictions(m, s, key, higher, args.tie)
            disagreements += len(bad)
            print(f"  {key}:")
            print(f"    measured  {ranking(m, key, higher, args.tie)}")
            print(f"    simulated {ranking(s, key, higher, args.tie)}")
            print(f"    {'agree' if not bad else 'DISAGREE on ' + ', '.join(map(str, bad))}")
    print(f"pairs ordered the other way: {disagreements} (tie band {args.tie:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
