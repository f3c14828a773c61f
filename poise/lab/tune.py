"""The seed's tuning procedure as code: probe, compare, decide, explain.

Procedure (seed 000, "tuning order"), with the workload and client concurrency fixed by the
probe:
1. baseline: the conservative end of the token-budget ladder at the starting request cap;
2. budget: raise ``max_num_batched_tokens`` one ladder step at a time while TTFT p95 (and TPOT
   p50, if given) stays within the SLO and throughput still rises; back off on a breach, or
   when the tail worsens for no throughput;
3. concurrency: raise ``max_num_seqs`` one step at a time only while the KV cache keeps
   headroom (peak usage under ``kv_headroom``, no preemptions) and the SLO holds;
4. trade: when step 3 stopped on the SLO, try one budget step down with one seqs step up
   (fewer prefill tokens per step, more decodes in flight) and keep it if it pays;
5. policy: at the best config, try the other scheduling policy (one variable, one probe);
6. SLO scheduling (lab/tune_slo.py): at the best config, policy ``slo`` with traffic classes,
   their shares, and the token-budget controller's TPOT target; kept where they lower the
   TTFT tail at the same throughput.
Every probe is recorded (``Evidence``), every decision explained in one line. Answers are
picked over ALL probes: throughput-first = highest output tokens/s meeting the SLO;
latency-first = lowest TTFT p95 meeting the SLO (ties: higher throughput).

Invariants: no candidate is probed twice; at most ``max_probes`` probes; a probe that fails
(exception) is recorded as an error row and treated as missing the SLO.
"""

from __future__ import annotations

import logging
from typing import Any

from poise.lab.cell_metrics import CellMetrics, fmt_ms, fmt_pct, rel_change
from poise.lab.probe import Candidate, Probe
from poise.lab.tune_result import DEFAULT_BUDGETS, DEFAULT_SEQS, Evidence, TuneResult, TuneSettings
from poise.lab.tune_slo import phase_slo

__all__ = ["DEFAULT_BUDGETS", "DEFAULT_SEQS", "Evidence", "TuneResult", "TuneSettings", "Tuner"]

logger = logging.getLogger(__name__)

# knob -> (phase, how decisions name it, its ladder in TuneSettings)
_PHASES = {
    "max_num_batched_tokens": ("budget", "budget", "budgets"),
    "max_num_seqs": ("concurrency", "max_num_seqs", "seqs"),
}


class Tuner:
    def __init__(self, probe: Probe, settings: TuneSettings, fixed: dict[str, Any] | None = None):
        self.probe = probe
        self.s = settings
        self.fixed = tuple(sorted((fixed or {}).items()))
        self.result = TuneResult(settings)
        self._seen: dict[Candidate, Evidence] = {}
        self._stop = False
        self._judged: set[tuple[Candidate, Candidate]] = set()

    # -- probing -----------------------------------------------------------------------------

    def slo_ok(self, m: CellMetrics | None) -> bool:
        if m is None or m.ttft_p95_ms is None or m.num_requests == 0:
            return False
        if m.num_errors > 0 or m.ttft_p95_ms > self.s.slo_ttft_p95_ms:
            return False
        slo_tpot = self.s.slo_tpot_p50_ms
        return slo_tpot is None or (m.tpot_p50_ms is not None and m.tpot_p50_ms <= slo_tpot)

    def measure(self, cand: Candidate, phase: str) -> Evidence | None:
        """Probe once (memoised); None when the probe budget is spent."""
        if cand in self._seen:
            return self._seen[cand]
        if len(self.result.evidence) >= self.s.max_probes:
            self.say(f"probe budget ({self.s.max_probes}) spent: stop exploring")
            return None
        logger.info("probe %d (%s): %s", len(self.result.evidence) + 1, phase, cand.label)
        metrics: CellMetrics | None
        try:
            metrics, error = self.probe.measure(cand), None
        except Exception as exc:  # a failed probe is evidence too, never a crash of the tuner
            logger.warning("probe %s failed: %s", cand.label, exc)
            metrics, error = None, f"{type(exc).__name__}: {exc}"
        ev = Evidence(len(self.result.evidence) + 1, phase, cand, metrics, self.slo_ok(metrics))
        ev.error = error
        self.result.evidence.append(ev)
        self._seen[cand] = ev
        return ev

    def say(self, line: str, ev: Evidence | None = None) -> None:
        self.result.decisions.append(line)
        if ev is not None and not ev.decision:
            ev.decision = line
        logger.info("%s", line)

    # -- judging -----------------------------------------------------------------------------

    def _slo_text(self, m: CellMetrics | None) -> str:
        if m is None:
            return "probe failed"
        if m.num_errors:
            return f"{m.num_errors} failed requests"
        ttft, slo = m.ttft_p95_ms, self.s.slo_ttft_p95_ms
        if ttft is None or ttft > slo:
            return f"TTFT p95 {fmt_ms(ttft)} > SLO {fmt_ms(slo)}"
        tslo = self.s.slo_tpot_p50_ms
        if tslo is not None and (m.tpot_p50_ms is None or m.tpot_p50_ms > tslo):
            return f"TPOT p50 {fmt_ms(m.tpot_p50_ms)} > SLO {fmt_ms(tslo)}"
        return f"TTFT p95 {fmt_ms(ttft)} <= SLO {fmt_ms(slo)}"

    def judge(self, cur: Evidence, new: Evidence) -> tuple[bool, str, str]:
        """Should we move from ``cur`` to ``new``? (accept, facts, verdict)."""
        m0, m1 = cur.metrics, new.metrics
        if m1 is None:
            return False, f"probe failed ({new.error})", "back off"
        assert m0 is not None
        gain = rel_change(m1.output_tokens_per_s, m0.output_tokens_per_s)
        tail = rel_change(m1.ttft_p95_ms, m0.ttft_p95_ms)
        facts = f"throughput {_signed(gain)}, {self._slo_text(m1)}"
        if not new.meets_slo:
            if cur.meets_slo:
                return False, facts, "back off"
            # Both miss: move only if the tail comes down (towards the SLO).
            if tail is not None and tail < -self.s.tail_tolerance:
                return True, f"{facts}, TTFT p95 {_signed(tail)}", "closer to the SLO, keep"
            return False, f"{facts}, TTFT p95 {_signed(tail)}", "not closer to the SLO, back off"
        if not cur.meets_slo:
            return True, facts, "now meets the SLO, keep"
        if gain is None or gain < self.s.min_gain:
            if tail is not None and tail > self.s.tail_tolerance:
                return (
                    False,
                    f"{facts}, TTFT p95 {_signed(tail)}",
                    "tail worse for no gain, back off",
                )
            return (
                False,
                facts,
                f"no throughput gain (needs +{fmt_pct(self.s.min_gain)}), keep the previous",
            )
        return True, facts, "keep"

    def kv_ok(self, m: CellMetrics | None) -> tuple[bool, str]:
        if m is None:
            return False, "probe failed"
        if m.preemptions:
            return False, f"{m.preemptions} preemptions: KV cache out of headroom"
        if m.kv_usage_peak is not None and m.kv_usage_peak >= self.s.kv_headroom:
            return False, (
                f"KV peak {fmt_pct(m.kv_usage_peak)} >= {fmt_pct(self.s.kv_headroom)}: no headroom"
            )
        peak = "unknown" if m.kv_usage_peak is None else fmt_pct(m.kv_usage_peak)
        return True, f"KV peak {peak}"

    # -- phases ------------------------------------------------------------------------------

    def step(self, cur: Evidence, cand: Candidate, phase: str, what: str, kv: bool) -> Evidence:
        """Probe ``cand``; return the evidence to continue from (new if accepted, else cur).
        Sets ``self._stop`` when the phase should end."""
        new = self.measure(cand, phase)
        if new is None:
            self._stop = True
            return cur
        ok, facts, verdict = self.judge(cur, new)
        if (cur.candidate, cand) in self._judged:
            quiet = True  # the same move from the same place, already explained
        else:
            quiet = False
            self._judged.add((cur.candidate, cand))
        if ok and kv:
            kv_fine, kv_why = self.kv_ok(new.metrics)
            facts = f"{facts}, {kv_why}"
            if not kv_fine:
                ok, verdict = False, "back off"
        if not quiet:
            self.say(f"{what}: {facts}: {verdict}", new)
        if not ok:
            self._stop = True
            return cur
        return new

    def climb(self, cur: Evidence, knob: str) -> Evidence:
        """Raise one knob (``max_num_batched_tokens``: the budget phase; ``max_num_seqs``: the
        concurrency phase, which also needs KV headroom) one ladder step at a time while
        ``step`` accepts the move."""
        phase, name, ladder = _PHASES[knob][0], _PHASES[knob][1], getattr(self.s, _PHASES[knob][2])
        self._stop = False
        i = ladder.index(getattr(cur.candidate, knob))
        while not self._stop and i + 1 < len(ladder):
            cand = cur.candidate.with_(**{knob: ladder[i + 1]})
            what = f"{name} {ladder[i]} -> {ladder[i + 1]}"
            cur = self.step(cur, cand, phase, what, kv=knob == "max_num_seqs")
            i += 1
        return cur

    def phase_trade(self, cur: Evidence) -> Evidence:
        """Budget one step down, seqs one step up, while that pays (and then seqs again)."""
        while True:
            c = cur.candidate
            bi, si = (
                self.s.budgets.index(c.max_num_batched_tokens),
                self.s.seqs.index(c.max_num_seqs),
            )
            if bi == 0 or si + 1 >= len(self.s.seqs):
                return cur
            cand = c.with_(
                max_num_batched_tokens=self.s.budgets[bi - 1], max_num_seqs=self.s.seqs[si + 1]
            )
            what = f"trade budget for concurrency ({c.label} -> {cand.label})"
            self._stop = False
            nxt = self.step(cur, cand, "trade", what, kv=True)
            if nxt is cur:
                return cur
            cur = self.climb(nxt, "max_num_seqs")

    def coordinate(self, cur: Evidence) -> Evidence:
        """Budget, then seqs, then trade, repeated until a whole round changes nothing: a
        larger request cap can make a larger budget affordable, and the reverse. Each round
        only raises (seqs, budget) in lexicographic order, so the loop ends."""
        while True:
            before = cur.candidate
            cur = self.climb(self.climb(cur, "max_num_batched_tokens"), "max_num_seqs")
            if self.s.trade:
                cur = self.phase_trade(cur)
            if cur.candidate == before:
                return cur
            if self._can_rise(cur.candidate):
                self.say(f"round ends at {cur.candidate.label}: try the budget again from here")

    def _can_rise(self, c: Candidate) -> bool:
        """Is there a ladder step above c left (budget or seqs)?"""
        return c.max_num_batched_tokens != self.s.budgets[-1] or c.max_num_seqs != self.s.seqs[-1]

    def phase_policy(self, cur: Evidence) -> None:
        """Flip the scheduling policy at the best config; if the flipped config is stable and
        meets the SLO (it may cost throughput here yet leave TTFT room for a bigger budget),
        explore budget and seqs again under it. Answers are picked over all probes."""
        c = cur.candidate
        other = "prefill_first" if c.scheduling_policy == "fifo" else "fifo"
        self._stop = False
        what = f"policy {c.scheduling_policy} -> {other}"
        nxt = self.step(cur, c.with_(scheduling_policy=other), "policy", what, kv=False)
        flipped = self._seen.get(c.with_(scheduling_policy=other))
        if (
            nxt is cur
            and flipped is not None
            and flipped.meets_slo
            and self.kv_ok(flipped.metrics)[0]
        ):
            self.say(f"explore budget and seqs under {other} from {flipped.candidate.label}")
            self.coordinate(flipped)
        elif nxt is not cur:
            self.coordinate(nxt)

    def neighbours(self, c: Candidate) -> list[tuple[str, Candidate]]:
        """One-knob moves from c, cheapest-to-latency first."""
        out = []
        other = "prefill_first" if c.scheduling_policy == "fifo" else "fifo"
        if self.s.try_policies:
            out.append(
                (f"policy {c.scheduling_policy} -> {other}", c.with_(scheduling_policy=other))
            )
        for attr, (_, name, ladder_name) in _PHASES.items():
            ladder = getattr(self.s, ladder_name)
            i = ladder.index(getattr(c, attr))
            for j in (i - 1, i + 1):
                if 0 <= j < len(ladder):
                    out.append((f"{name} {ladder[i]} -> {ladder[j]}", c.with_(**{attr: ladder[j]})))
        return out

    def phase_latency(self) -> None:
        """Latency-first: descend on TTFT p95 from the lowest-TTFT stable config that meets
        the SLO, one knob at a time, while a move cuts TTFT p95 by more than ``min_gain``."""
        ok = self.eligible()
        if not ok:
            return
        cur = min(ok, key=lambda e: (_ttft(e), -_thr(e)))
        self.say(f"latency-first search starts at {cur.candidate.label}")
        moved = True
        while moved:
            moved = False
            for what, cand in self.neighbours(cur.candidate):
                new = self.measure(cand, "latency")
                if new is None:
                    return
                if not (new.meets_slo and self.kv_ok(new.metrics)[0]):
                    continue
                cut = rel_change(_ttft(new), _ttft(cur))
                if cut is not None and cut < -self.s.min_gain:
                    self.say(f"latency: {what}: TTFT p95 {_signed(cut)}: move", new)
                    cur, moved = new, True
                    break
        self.say(
            f"latency-first search ends at {cur.candidate.label}: no one-knob move cuts "
            f"TTFT p95 by more than {fmt_pct(self.s.min_gain)}"
        )

    def eligible(self) -> list[Evidence]:
        """Probes that may be answers: SLO met and KV headroom kept (a config that preempts is
        not stable, even if this sample happened to meet the SLO)."""
        return [e for e in self.result.evidence if e.meets_slo and self.kv_ok(e.metrics)[0]]

    def run(self) -> TuneResult:
        s = self.s
        base = Candidate(s.budgets[0], s.seqs[0], s.policy, self.fixed)
        cur = self.measure(base, "baseline")
        assert cur is not None
        self.say(f"baseline {base.label}: {self._describe(cur)}", cur)
        if cur.metrics is not None:
            cur = self.coordinate(cur)
            if s.try_policies:
                self.phase_policy(cur)
            if s.slo_scheduling:
                best = max(self.eligible(), key=lambda e: (_thr(e), -_ttft(e)), default=cur)
                phase_slo(self, best, dict(self.fixed).get("traffic_classes"))
            if s.latency_search:
                self.phase_latency()
        self.pick()
        return self.result

    def _describe(self, ev: Evidence) -> str:
        m = ev.metrics
        if m is None:
            return f"probe failed ({ev.error})"
        return f"throughput {_tps(m.output_tokens_per_s)}, {self._slo_text(m)}"

    def pick(self) -> None:
        r = self.result
        ok = self.eligible()
        measured = [e for e in r.evidence if e.metrics and e.metrics.ttft_p95_ms is not None]
        if ok:
            r.throughput_first = max(ok, key=lambda e: (_thr(e), -_ttft(e)))
            r.latency_first = min(ok, key=lambda e: (_ttft(e), -_thr(e)))
        elif measured:
            r.closest = min(measured, key=lambda e: _ttft(e))


def _thr(e: Evidence) -> float:
    return (e.metrics.output_tokens_per_s if e.metrics else None) or 0.0


def _ttft(e: Evidence) -> float:
    v = e.metrics.ttft_p95_ms if e.metrics else None
    return float("inf") if v is None else v


def _signed(x: float | None) -> str:
    return "?" if x is None else f"{x * 100:+.0f} %"


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} tok/s"
