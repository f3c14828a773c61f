"""The seven answers, each written from a `poise lab` run's own numbers (``seven_data``).

An answer is two or three sentences whose claims follow the signs of the measured differences
(never folklore: when the run contradicts the textbook, the text says what the run shows), the
numbers behind them, and whether the run could answer at all (cells missing, too few
requests). Plots are drawn by ``seven_plots`` from the same cells.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.lab.metrics import CellMetrics, fmt_ms, fmt_pct
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
    return [f"_Caveat: {n} measured requests per cell; a p95 of so few is close to the "
            "maximum, so differences under about 20 % are within noise._"]  # fmt: skip


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
        lines.append(f"| {m} | {_tps(k.output_tokens_per_s)} | {fmt_ms(k.ttft_p50_ms)} | "
                     f"{fmt_ms(k.ttft_p95_ms)} | {fmt_ms(k.e2e_p95_ms)} |")  # fmt: skip
    better_thr = (c.output_tokens_per_s or 0) > (s.output_tokens_per_s or 0)
    better_ttft = (c.ttft_p95_ms or 0) < (s.ttft_p95_ms or 0)
    if better_thr and better_ttft:
        verdict = (f"Continuous batching served {_x(c.output_tokens_per_s, s.output_tokens_per_s)} "
                   f"static batching's throughput at {_x(c.ttft_p95_ms, s.ttft_p95_ms)} its TTFT "
                   "p95: static admits a new batch only when the whole previous one is done, so "
                   "finished requests leave their slots empty and newcomers wait for the longest "
                   "output in front of them; continuous batching refills the slots every step.")  # fmt: skip
    else:
        verdict = (f"Here continuous batching did not beat static on both counts (throughput "
                   f"{_x(c.output_tokens_per_s, s.output_tokens_per_s)}, TTFT p95 "
                   f"{_x(c.ttft_p95_ms, s.ttft_p95_ms)} of static's): with outputs this similar "
                   "or this little load, a batch barely waits for its longest member.")  # fmt: skip
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
    ttfts = (f"TTFT p95 was {fmt_ms(c95)} (continuous), {fmt_ms(s95)} (static) and "
             f"{fmt_ms(y95)} (dynamic); p50 {fmt_ms(c.ttft_p50_ms)}, {fmt_ms(s.ttft_p50_ms)}, "
             f"{fmt_ms(y.ttft_p50_ms)}")  # fmt: skip
    if y95 > s95 > c95:
        text = (f"With arrivals spaced out ({note}) {ttfts}: a request that arrives while a "
                "static batch runs waits for all of it, and dynamic batching adds its delay to "
                "the first request of every batch, a bet that fuller batches repay only under "
                "load; continuous batching admits each request at the next step.")  # fmt: skip
    else:
        text = (f"With arrivals spaced out ({note}) {ttfts}: this run does not separate the "
                "three as expected (continuous first, dynamic last by about its delay), so at "
                "this load and sample size the open-loop cells support no claim.")  # fmt: skip
    rows = ["| mode (open loop) | output tok/s | TTFT p50 | TTFT p95 | E2E p95 |",
            "|---|---|---|---|---|"]  # fmt: skip
    for m in modes:
        k = cells[m].metrics  # type: ignore[union-attr]
        rows.append(f"| {m} | {_tps(k.output_tokens_per_s)} | {fmt_ms(k.ttft_p50_ms)} | "
                    f"{fmt_ms(k.ttft_p95_ms)} | {fmt_ms(k.e2e_p95_ms)} |")  # fmt: skip
    return [text, "", *rows, ""]


def _dynamic_text(y: CellMetrics, s: CellMetrics, delay: float | None) -> str:
    thr, ttft = y.output_tokens_per_s or 0.0, y.ttft_p95_ms or 0.0
    same = abs(thr - (s.output_tokens_per_s or 0.0)) <= 0.02 * thr and abs(
        ttft - (s.ttft_p95_ms or 0.0)) <= 0.02 * ttft  # fmt: skip
    head = f"Dynamic batching (an idle engine waits up to {delay or 0:g} ms for a full batch)"
    if same:
        return (f"{head} measured the same as static here: in a saturated closed loop every "
                "request has waited longer than the delay by the time the engine is free, so "
                "batches start at once; the delay only matters when requests trickle into an "
                "idle engine, where it trades latency for fuller batches.")  # fmt: skip
    return (f"{head} reached {_x(y.output_tokens_per_s, s.output_tokens_per_s)} static's "
            f"throughput at {_x(y.ttft_p95_ms, s.ttft_p95_ms)} its TTFT p95: the delay trades "
            "latency for fuller batches.")  # fmt: skip


def q2_averages(d: LabData) -> Section:
    cell = d.get("mix", "decode-first", last=True)
    if cell is None:
        return _missing(2, "the mixed cell of the decode-first config is missing")
    p50, p95, avg = (percentile(cell.ttft_ms, 50), percentile(cell.ttft_ms, 95),
                     mean(cell.ttft_ms))  # fmt: skip
    tp50, tp95 = percentile(cell.tpot_ms, 50), percentile(cell.tpot_ms, 95)
    short = cell.class_ttft_ms.get("short", [])
    long = cell.class_ttft_ms.get("long", [])
    gap = (avg - p50) / p50 if avg is not None and p50 else None
    s50, l50 = percentile(short, 50), percentile(long, 50)
    classes = ""
    if s50 and l50 and max(s50, l50) > 1.3 * min(s50, l50):
        classes = (f", nor that short prompts waited {fmt_ms(s50)} (p50) and long ones "
                   f"{fmt_ms(l50)}")  # fmt: skip
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
        rows.append(f"| {name} | {fmt_ms(percentile(c.class_ttft_ms.get('short', []), 95))} | "
                    f"{fmt_ms(percentile(c.class_ttft_ms.get('long', []), 95))} | "
                    f"{fmt_ms(percentile(c.tpot_ms, 50))} | {fmt_ms(percentile(c.tpot_ms, 95))} "
                    f"| {_tps(c.metrics.output_tokens_per_s)} |")  # fmt: skip
    ttft_a, ttft_b = percentile(a.ttft_ms, 95), percentile(b.ttft_ms, 95)
    tpot_a, tpot_b = percentile(a.tpot_ms, 95), percentile(b.tpot_ms, 95)
    trade = (f"TTFT p95 {fmt_ms(ttft_a)} -> {fmt_ms(ttft_b)}, TPOT p95 {fmt_ms(tpot_a)} -> "
             f"{fmt_ms(tpot_b)} from decode-first to prefill-first")  # fmt: skip
    principle = ("In principle prefill-first sacrifices TPOT (decodes skip steps while "
                 "prefills take the budget) and decode-first TTFT (waiting prompts get the "
                 "budget only after every running decode).")  # fmt: skip
    if _down(ttft_b, ttft_a) and _up(tpot_b, tpot_a):
        verdict = (f"Prefill-first bought first tokens with the running streams' smoothness "
                   f"({trade}). {principle}")  # fmt: skip
    elif _up(ttft_b, ttft_a) and _up(tpot_b, tpot_a):
        verdict = (f"Prefill-first did not buy first tokens here ({trade}): it sacrificed "
                   "TTFT and TPOT alike at this load (the policy benchmark in "
                   "docs/scheduling.md saw the same whenever long prompts queue). Decode-first "
                   "keeps running streams steady and makes new prompts wait for the decodes.")  # fmt: skip
    elif not any(f(x, y) for f in (_up, _down) for x, y in ((ttft_b, ttft_a), (tpot_b, tpot_a))):
        verdict = (f"The two policies measured alike here ({trade}): the queue was not "
                   f"prefill-bound at this load. {principle}")  # fmt: skip
    else:
        verdict = (f"This run does not show the textbook trade ({trade}). {principle} "
                   f"With {min(a.n, b.n)} requests per cell the tails are single requests, "
                   "so a run with more requests (or the simulator) is needed to separate them.")  # fmt: skip
    table = ["| policy | short TTFT p95 | long TTFT p95 | TPOT p50 | TPOT p95 | out tok/s |",
             "|---|---|---|---|---|---|", *rows]  # fmt: skip
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
    p50_0, p95_0, p50_1, p95_1 = (percentile(s0, 50), percentile(s0, 95), percentile(s1, 50),
                                  percentile(s1, 95))  # fmt: skip
    slower = (p95_1 or 0) > 1.1 * (p95_0 or 0)
    if slower:
        verdict = (f"With long prompts at ratio {mixed.long_ratio:g} short prompts' TTFT p95 went "
                   f"from {fmt_ms(p95_0)} to {fmt_ms(p95_1)} ({_x(p95_1, p95_0)}; p50 "
                   f"{fmt_ms(p50_0)} -> {fmt_ms(p50_1)}): a short prompt that arrives behind a "
                   "long prefill waits for it (or for its chunks, which share each step's token "
                   "budget), and long requests also hold slots and KV for longer.")  # fmt: skip
    else:
        verdict = (f"Here long prompts did not measurably slow short ones (TTFT p95 "
                   f"{fmt_ms(p95_0)} -> {fmt_ms(p95_1)}): the token budget absorbed the long "
                   "prefills at this load.")  # fmt: skip
    fix = (
        "Bounds: chunked prefill with a smaller token budget or `--long-prefill-token-"
        "threshold`, the `slo` policy with traffic classes, or separate pools."
    )
    return Section(4, True, [verdict, fix, "", *_few([base, mixed])], plot="long_prompts")


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
        rows.append(f"| {name} | {_f(c.server_mean('waiting'))} | {_f(c.server_mean('running'))} "
                    f"/ {cap} | {fmt_pct(c.metrics.kv_usage_peak)} | {c.metrics.preemptions} | "
                    f"{fmt_ms(c.metrics.ttft_p95_ms)} | {why} | `{flag}` |")  # fmt: skip
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
    rows = [f"| {n} | {fmt_pct(c.hit_rate)} | {fmt_ms(c.metrics.ttft_p50_ms)} | "
            f"{fmt_ms(c.metrics.ttft_p95_ms)} | {_tps(c.metrics.output_tokens_per_s)} |"
            for n, c in cells.items() if c is not None]  # fmt: skip
    verdict = _lpm_text(on, lpm)
    why = ("So a prefix cache changes what a request costs (only its uncached suffix), and "
           "whether that saving happens depends on the order of the queue and on what is "
           "evicted: the scheduler has to read the cache (SGLang's RadixAttention with "
           f"longest-prefix-match scheduling). Cache off for reference: TTFT p95 "
           f"{fmt_ms(off.metrics.ttft_p95_ms)}, {_tps(off.metrics.output_tokens_per_s)}.")  # fmt: skip
    note = d.group("prefix").get("note", "")
    table = ["| config | prefix hit rate | TTFT p50 | TTFT p95 | out tok/s |",
             "|---|---|---|---|---|", *rows]  # fmt: skip
    return Section(6, True, [verdict, why, "", f"Workload: {note}.", "", *table, "",
                             *_few([off, on, lpm])], plot="prefix")  # fmt: skip


def _lpm_text(on: Cell, lpm: Cell) -> str:
    a, b = on.metrics, lpm.metrics
    head = (f"With the cache on in arrival order {fmt_pct(on.hit_rate)} of prompt tokens came "
            f"from the cache; ordering the queue by cached prefix (lpm) made it "
            f"{fmt_pct(lpm.hit_rate)}, TTFT p50 {fmt_ms(a.ttft_p50_ms)} -> "
            f"{fmt_ms(b.ttft_p50_ms)}, p95 {fmt_ms(a.ttft_p95_ms)} -> {fmt_ms(b.ttft_p95_ms)}, "
            f"throughput {_x(b.output_tokens_per_s, a.output_tokens_per_s)}.")  # fmt: skip
    if (lpm.hit_rate or 0) <= (on.hit_rate or 0) + 0.05:
        return head + (" The order barely changed what was reused: the pool held the "
                       "documents anyway, or the queue was too short to choose from.")  # fmt: skip
    tail = ""
    if (b.ttft_p95_ms or 0) > (a.ttft_p95_ms or 0):
        tail = (" The tail paid for it: a request whose document is not cached keeps being "
                "passed by ones that are (bounded by `--priority-aging-s`).")  # fmt: skip
    return head + (" In arrival order each document comes back after the others have evicted "
                   "it; lpm serves the documents that are in the cache first.") + tail  # fmt: skip


def q7_tune(d: LabData) -> Section:
    t = d.tune
    if not t or not t.get("evidence"):
        return _missing(7, "the tuning record (tune/tune.json)")
    slo = t.get("slo", {})
    target = (f"TTFT p95 <= {fmt_ms(slo.get('ttft_p95_ms'))}, TPOT p50 <= "
              f"{fmt_ms(slo.get('tpot_p50_ms'))}")  # fmt: skip
    probes = len(t["evidence"])
    thr, lat = t.get("throughput_first"), t.get("latency_first")
    if not thr or not lat:
        close = t.get("closest") or {}
        return Section(7, True, [
            f"No config among the {probes} probed met the chat SLO ({target}) on this "
            f"hardware; the closest was {_args(close.get('args') or {})} with TTFT p95 "
            f"{fmt_ms((close.get('metrics') or {}).get('ttft_p95_ms'))}. Relax the SLO or "
            "give the engine a faster device: a config cannot buy what the device lacks."],
            plot="tune")  # fmt: skip
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


ANSWERS = (q1_batching, q2_averages, q3_policies, q4_long_prompts, q5_waiting, q6_prefix,
           q7_tune)  # fmt: skip
