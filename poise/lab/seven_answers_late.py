"""Answers 5 to 7 of `poise lab` (the waiting queue, the prefix cache, the tuned config), and
``ANSWERS``, all seven in order; written like answers 1 to 4 (``seven_answers``)."""

from __future__ import annotations

from poise.lab.cell_metrics import fmt_ms, fmt_pct
from poise.lab.seven_answers import (
    Section,
    _few,
    _missing,
    _tps,
    _x,
    q1_batching,
    q2_averages,
    q3_policies,
    q4_long_prompts,
)
from poise.lab.seven_data import Cell, LabData
from poise.lab.seven_speculation import q8_speculation


def q5_waiting(d: LabData) -> Section:
    configs = d.configs("waiting")
    rows, found = [], []
    for name, args in configs.items():
        c = d.get("waiting", name)
        if c is None:
            continue
        cap = int(args.get("max_num_seqs", 0) or 0)
        why, flag = diagnose(c, cap)
        found.append((name, why, flag))
        rows.append(
            f"| {name} | {_f(c.server_mean('waiting'))} | {_f(c.server_mean('running'))} "
            f"/ {cap} | {fmt_pct(c.metrics.kv_usage_peak)} | {c.metrics.preemptions} | "
            f"{fmt_ms(c.metrics.ttft_p95_ms)} | {why} | `{flag}` |"
        )
    if not found:
        return _missing(5, "the waiting group's cells")
    named = "; ".join(f"{n}: {w}" for n, w, _ in found)
    lines = [
        "Check in this order: is the request cap full (running = `--max-num-seqs`)? is the KV "
        "cache full or preempting (`--gpu-memory-utilization`, `--max-model-len`, "
        "`--num-kv-blocks`)? else the token budget (`--max-num-batched-tokens`, chunked "
        f"prefill) or the device itself. This run's variants, diagnosed from their own gauges: "
        f"{named}.",
        "",
        "| config | waiting (mean) | running (mean) / cap | KV peak | preemptions | TTFT p95 | "
        "limit | flag |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    return Section(5, True, lines, plot="waiting")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def diagnose(c: Cell, cap: int) -> tuple[str, str]:
    """(what held the queue, the flag to change) from a cell's gauges."""
    waiting, running = c.server_mean("waiting"), c.server_mean("running")
    kv, pre = c.metrics.kv_usage_peak, c.metrics.preemptions or 0
    if waiting is None:
        return "unknown (no waiting gauge)", "-"
    if waiting < 1.0:
        return "no queue", "-"
    if pre > 0 or (kv is not None and kv >= 0.9):
        return "KV cache", "--gpu-memory-utilization / --num-kv-blocks"
    # The cap holds the queue when slots are (nearly) all taken, or when more requests wait than
    # there are free slots on average (gauges are sampled: a mean under the cap is not proof
    # of a free slot while the queue stood).
    if cap and running is not None and (running >= 0.9 * cap or waiting > cap - running):
        return "request cap", "--max-num-seqs"
    return "token budget / compute", "--max-num-batched-tokens"


def q6_prefix(d: LabData) -> Section:
    names = ["cache-off", "cache-on", "cache-on-lpm"]
    cells = {n: d.get("prefix", n) for n in names}
    if any(c is None for c in cells.values()):
        return _missing(6, "the prefix group's cells")
    off, on, lpm = (cells[n] for n in names)
    assert off is not None and on is not None and lpm is not None
    rows = [
        f"| {n} | {fmt_pct(c.hit_rate)} | {fmt_ms(c.metrics.ttft_p50_ms)} | "
        f"{fmt_ms(c.metrics.ttft_p95_ms)} | {_tps(c.metrics.output_tokens_per_s)} |"
        for n, c in cells.items()
        if c is not None
    ]
    verdict = _lpm_text(on, lpm)
    why = (
        "So a prefix cache changes what a request costs (only its uncached suffix), and "
        "whether that saving happens depends on the order of the queue and on what is "
        "evicted: the scheduler has to read the cache (SGLang's RadixAttention with "
        f"longest-prefix-match scheduling). Cache off for reference: TTFT p95 "
        f"{fmt_ms(off.metrics.ttft_p95_ms)}, {_tps(off.metrics.output_tokens_per_s)}."
    )
    note = d.group("prefix").get("note", "")
    table = [
        "| config | prefix hit rate | TTFT p50 | TTFT p95 | out tok/s |",
        "|---|---|---|---|---|",
        *rows,
    ]
    return Section(
        6,
        True,
        [
            verdict,
            why,
            "",
            f"Workload: {note}.",
            "",
            *table,
            "",
            *_few([off, on, lpm]),
            "",
            *_burst_text(d),
        ],
        plot="prefix",
    )


def _burst_text(d: LabData) -> list[str]:
    """The simultaneous-arrival cell: requests that arrive together, before anything is
    cached, share one prefill in flight (or each compute it, cache off)."""
    off, on = d.get("prefix-burst", "burst-cache-off"), d.get("prefix-burst", "burst-cache-on")
    if off is None or on is None:
        return ["Simultaneous arrival: not in this run (the prefix-burst cells are missing)."]
    slow_off, slow_on = max(off.ttft_ms), max(on.ttft_ms)
    return [
        f"Simultaneous arrival ({d.group('prefix-burst').get('note', 'a cold burst')}): the "
        "cache holds nothing when they arrive, so what it changes is scheduling again: the "
        "requests after the first wait for the blocks its prefill is writing (in-flight "
        f"sharing) instead of computing them. {fmt_pct(on.hit_rate)} of prompt tokens came "
        f"from the cache; slowest TTFT {fmt_ms(slow_off)} (cache off) -> {fmt_ms(slow_on)} "
        f"(cache on), {_x(slow_on, slow_off)}.",
        "",
        "| config | prefix hit rate | TTFT p50 | slowest TTFT |",
        "|---|---|---|---|",
        *(
            f"| {n} | {fmt_pct(c.hit_rate)} | {fmt_ms(c.metrics.ttft_p50_ms)} | "
            f"{fmt_ms(max(c.ttft_ms))} |"
            for n, c in (("burst-cache-off", off), ("burst-cache-on", on))
        ),
    ]


def _lpm_text(on: Cell, lpm: Cell) -> str:
    a, b = on.metrics, lpm.metrics
    head = (
        f"With the cache on in arrival order {fmt_pct(on.hit_rate)} of prompt tokens came "
        f"from the cache; ordering the queue by cached prefix (lpm) made it "
        f"{fmt_pct(lpm.hit_rate)}, TTFT p50 {fmt_ms(a.ttft_p50_ms)} -> "
        f"{fmt_ms(b.ttft_p50_ms)}, p95 {fmt_ms(a.ttft_p95_ms)} -> {fmt_ms(b.ttft_p95_ms)}, "
        f"throughput {_x(b.output_tokens_per_s, a.output_tokens_per_s)}."
    )
    if (lpm.hit_rate or 0) <= (on.hit_rate or 0) + 0.05:
        return head + (
            " The order barely changed what was reused: the pool held the "
            "documents anyway, or the queue was too short to choose from."
        )
    tail = ""
    if (b.ttft_p95_ms or 0) > (a.ttft_p95_ms or 0):
        tail = (
            " The tail paid for it: a request whose document is not cached keeps being "
            "passed by ones that are (bounded by `--priority-aging-s`)."
        )
    return (
        head
        + (
            " In arrival order each document comes back after the others have evicted "
            "it; lpm serves the documents that are in the cache first."
        )
        + tail
    )


def q7_tune(d: LabData) -> Section:
    t = d.tune
    if not t or not t.get("evidence"):
        return _missing(7, "the tuning record (tune/tune.json)")
    slo = t.get("slo", {})
    target = (
        f"TTFT p95 <= {fmt_ms(slo.get('ttft_p95_ms'))}, TPOT p50 <= "
        f"{fmt_ms(slo.get('tpot_p50_ms'))}"
    )
    probes = len(t["evidence"])
    thr, lat = t.get("throughput_first"), t.get("latency_first")
    if not thr or not lat:
        close = t.get("closest") or {}
        return Section(
            7,
            True,
            [
                f"No config among the {probes} probed met the chat SLO ({target}) on this "
                f"hardware; the closest was {_args(close.get('args') or {})} with TTFT p95 "
                f"{fmt_ms((close.get('metrics') or {}).get('ttft_p95_ms'))}. Relax the SLO or "
                "give the engine a faster device: a config cannot buy what the device lacks."
            ],
            plot="tune",
        )
    tm, lm = thr.get("metrics") or {}, lat.get("metrics") or {}
    lines = [
        f"For the chat SLO ({target}), {probes} probes following the seed's tuning order "
        f"(budget up while the tail holds, then `--max-num-seqs` while KV has headroom, then "
        f"the other policy): throughput-first is {_args(thr['args'])} "
        f"({_tps(tm.get('output_tokens_per_s'))}, TTFT p95 {fmt_ms(tm.get('ttft_p95_ms'))}); "
        f"latency-first is {_args(lat['args'])} ({_tps(lm.get('output_tokens_per_s'))}, TTFT "
        f"p95 {fmt_ms(lm.get('ttft_p95_ms'))}).",
        "Throughput-first takes the biggest batches the SLO tolerates; latency-first the "
        "smallest TTFT tail that still meets it"
        + (
            ": here they are the same config, since no probe that met the SLO had a lower TTFT "
            "p95 (a smaller budget or cap only queued the requests longer)."
            if thr["args"] == lat["args"]
            else f", paying {_x(lm.get('output_tokens_per_s'), tm.get('output_tokens_per_s'))} the "
            "throughput."
        ),
        "",
    ]
    return Section(7, True, lines, plot="tune")


def _args(a: dict[str, object]) -> str:
    keys = ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy")
    return "`" + " ".join(f"--{k.replace('_', '-')} {a[k]}" for k in keys if k in a) + "`"


ANSWERS = (
    q1_batching,
    q2_averages,
    q3_policies,
    q4_long_prompts,
    q5_waiting,
    q6_prefix,
    q7_tune,
    q8_speculation,
)
