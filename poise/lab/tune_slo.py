"""The SLO-aware scheduling phase of ``poise tune``: policy ``slo`` with traffic classes, the
classes' shares, and the token-budget controller's TPOT target, at the best config found.

Why a phase of its own: these knobs rarely raise throughput; what they buy is a lower TTFT tail
at the same throughput (short prompts no longer wait behind long prefills). So a move is kept
when it raises throughput within the SLO (the tuner's own rule) or when it meets the SLO, keeps
throughput within ``min_gain`` and cuts TTFT p95 by more than ``min_gain``. The answers are
still picked over every probe (throughput-first, latency-first), so nothing here can hide a
better config found earlier.

Order (one knob at a time, every probe and decision recorded like the other phases):
1. ``scheduling_policy=slo`` with the class set (the fixed ``--traffic-classes``, else poise's
   ``default`` chat classes: short vs long prompts);
2. the first shared class's share of the token budget and request slots along
   ``TuneSettings.class_shares`` (the others split the rest in their current proportions);
3. with a TPOT SLO: the token-budget controller holding ``controller_targets`` x that SLO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poise.lab.cell_metrics import rel_change
from poise.sched.classes import ClassSet, TrafficClass, load_classes, to_inline

if TYPE_CHECKING:
    from poise.lab.tune import Evidence, Tuner


def with_share(classes: ClassSet, share: float) -> ClassSet | None:
    """``classes`` with the first class that has a share set to ``share``, the others scaled to
    fill the rest; None when the set has no shares to move."""
    if not classes.has_shares:
        return None
    first = next(c for c in classes.classes if c.share > 0)
    rest = [c for c in classes.classes if c is not first]
    total = sum(c.share for c in rest)
    out: list[TrafficClass] = []
    for c in classes.classes:
        if c is first:
            new = share
        elif total > 0:
            new = (1.0 - share) * c.share / total
        else:
            new = (1.0 - share) / len(rest)
        out.append(
            TrafficClass(
                c.name,
                c.ttft_ms,
                c.tpot_ms,
                round(new, 4),
                c.min_prompt_tokens,
                c.max_prompt_tokens,
            )
        )
    return ClassSet(tuple(out))


def _balance(t: Tuner, cur: Evidence, new: Evidence) -> tuple[bool, str, str]:
    ok, facts, verdict = t.judge(cur, new)
    if ok or new.metrics is None or cur.metrics is None:
        return ok, facts, verdict
    gain = rel_change(new.metrics.output_tokens_per_s, cur.metrics.output_tokens_per_s)
    cut = rel_change(new.metrics.ttft_p95_ms, cur.metrics.ttft_p95_ms)
    steady = gain is not None and gain >= -t.s.min_gain
    if cut is None or cut >= -t.s.min_gain:
        return False, facts, verdict
    if new.meets_slo and t.kv_ok(new.metrics)[0] and steady:
        return True, f"{facts}, TTFT p95 {cut * 100:+.0f} %", "lower tail, same throughput: keep"
    return False, facts, verdict


def _try(t: Tuner, cur: Evidence, cand: Any, what: str) -> Evidence:
    new = t.measure(cand, "slo")
    if new is None:
        return cur
    ok, facts, verdict = _balance(t, cur, new)
    t.say(f"{what}: {facts}: {verdict}", new)
    return new if ok else cur


def phase_slo(t: Tuner, cur: Evidence, fixed_classes: str | None) -> Evidence:
    spec = fixed_classes if fixed_classes not in (None, "", "none", "off") else "default"
    classes = load_classes(spec)
    c = cur.candidate
    start = c.with_(scheduling_policy="slo", traffic_classes=to_inline(classes))
    t.say(f"SLO scheduling from {c.label}: policy slo with classes {spec}")
    cur = _try(t, cur, start, f"policy {c.scheduling_policy} -> slo, classes {spec}")
    base = cur.candidate if cur.candidate.scheduling_policy == "slo" else start
    base_classes = load_classes(base.traffic_classes)
    for share in t.s.class_shares:
        moved = with_share(base_classes, share)
        if moved is None:
            break
        if to_inline(moved) == base.traffic_classes:
            continue
        cand = base.with_(traffic_classes=to_inline(moved))
        cur = _try(t, cur, cand, f"first class share -> {share:g}")
    tpot = t.s.slo_tpot_p50_ms
    if tpot is not None:
        best = cur.candidate if cur.candidate.scheduling_policy == "slo" else base
        for frac in t.s.controller_targets:
            target = round(frac * tpot, 1)
            cand = best.with_(token_budget_controller=True, target_tpot_ms=target)
            cur = _try(t, cur, cand, f"token budget controller at TPOT {target:g} ms")
    return cur
