"""Speculative decoding on this CPU (issue 34): ngram speculation against none, in one run.

Two workloads on the embedded SmolLM2-135M (bfloat16, greedy), each config in its own engine,
one after the other, rounds alternating the configs so a drift in the shared machine's load
hits them alike:

- ``grounded``: prompts asking the model to repeat, quote or lightly edit a passage of 300-800
  tokens (paragraphs of this repo's docs), ``max_tokens`` 128, ``ignore_eos``; closed loop at
  concurrency 1 and 4; off vs ngram k=4 adaptive. Reported: TPOT p50 (per request, decode time
  / (tokens - 1)) and its off / on ratio, the acceptance counters.
- ``seed``: the seed mix (25 % LONG, 160 tokens, closed loop) at concurrency 32: off vs
  adaptive vs fixed k=4. Reported: output tokens/s and TTFT p95, ratios to off.

Each measured cell is then simulated (``poise.sim``, the same scheduler) with a step-cost
profile of this machine (``--profile``, from ``poise profile --threads 1``), the acceptance
rate the cell measured (``acceptance_from_counters``) and the share of its decode steps that
had a draft (``draft_rate_from_counts``), and the simulator's gain (TPOT off / on
at low load, tok/s on / off at c=32) is put next to the measured one.

    .venv/bin/python benchmarks/speculation.py --profile P.json [--rounds 2] [--only grounded]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poise.config import EngineConfig
from poise.core.sampling_params import SamplingParams
from poise.core.timing import derive, percentile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from serving import workload as seed_workload  # noqa: E402

OFF, ADAPTIVE = "off", "ngram k=4 adaptive"
FIXED = "ngram k=4 fixed"
SPECS: dict[str, dict[str, Any] | None] = {
    OFF: None,
    ADAPTIVE: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
    FIXED: {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "adaptive": False,
    },
}
ENGINE = dict(dtype="bfloat16", num_threads=1, max_num_seqs=64, max_num_batched_tokens=2048)
INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word:\n\n{p}",
    'Quote the passage below verbatim, then stop.\n\n"""\n{p}\n"""',
    "Rewrite the passage below with only light edits: fix any typos and keep every sentence "
    "in order.\n\n{p}",
)
DOCS = ("docs/scheduling.md", "docs/simulator.md", "docs/serving.md", "docs/ARCHITECTURE.md")


@dataclass
class Cell:
    workload: str
    config: str
    concurrency: int
    seconds: float = 0.0
    output_tokens: int = 0
    tpot: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    spec: dict[str, float] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> tokens

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def p(self, name: str, q: float) -> float:
        v = percentile(getattr(self, name), q)
        assert v is not None
        return v


def passages(tok: Any, n: int) -> list[str]:
    """``n`` passages of 300-800 tokens: runs of whole paragraphs of the docs, prose only."""
    out: list[str] = []
    for doc in DOCS:
        paras = [p for p in (REPO / doc).read_text().split("\n\n") if p and p[0].isalpha()]
        run: list[str] = []
        for para in paras:
            run.append(para)
            size = len(tok.encode("\n\n".join(run)))
            if size > 800:
                run = [para] if len(tok.encode(para)) <= 800 else []
            elif size >= 300:
                out.append("\n\n".join(run))
                run = []
            if len(out) == n:
                return out
    raise SystemExit(f"only {len(out)} passages of 300-800 tokens in {DOCS}")


def grounded_prompts(tok: Any, n: int) -> list[list[int]]:
    from poise.text import apply_chat_template

    texts = passages(tok, n)
    return [
        apply_chat_template(tok, [{"role": "user", "content": INSTRUCTIONS[i % 3].format(p=t)}])
        for i, t in enumerate(texts)
    ]


def seed_prompts(tok: Any, n: int) -> list[list[int]]:
    from poise.text import apply_chat_template

    return [
        apply_chat_template(tok, [{"role": "user", "content": p}])
        for _, p in seed_workload(n, 160, 0.25)
    ]


def closed_loop(llm: Any, prompts: list[list[int]], c: int, max_tokens: int, cell: Cell) -> None:
    core = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = _spec_counts(core)
    nxt = in_flight = 0
    index: dict[str, int] = {}
    start = time.perf_counter()
    while nxt < len(prompts) or in_flight:
        while in_flight < c and nxt < len(prompts):
            rid = f"{cell.config}-{c}-{nxt}-{time.monotonic_ns()}"
            index[rid] = nxt
            core.add_request(rid, prompts[nxt], params)
            nxt, in_flight = nxt + 1, in_flight + 1
        deltas, _ = core.step()
        for d in deltas:
            cell.output_tokens += len(d.new_token_ids)
            cell.outputs.setdefault(index[d.request_id], []).extend(d.new_token_ids)
            if d.finished:
                in_flight -= 1
                m = derive(d.times) if d.times else None
                if m is not None and m.tpot is not None and m.ttft is not None:
                    cell.tpot.append(m.tpot)
                    cell.ttft.append(m.ttft)
    cell.seconds = time.perf_counter() - start
    after = _spec_counts(core)
    cell.spec = {k: after[k] - before[k] for k in after}


def _spec_counts(core: Any) -> dict[str, float]:
    spec = core.scheduler.spec
    if spec is None:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    st = spec.stats
    return {
        "drafts": st.num_drafts,
        "draft_tokens": st.num_draft_tokens,
        "accepted": st.num_accepted_tokens,
    }


def simulate(cell: Cell, prompts: list[list[int]], max_tokens: int, profile: str) -> Cell:
    """The same cell through the simulator at the acceptance rate it measured."""
    from poise.sim.fit import load_profile
    from poise.sim.simulator import SimCell, SimRequest, simulate_cell
    from poise.sim.speculation import acceptance_from_counters, draft_rate_from_counts

    spec = SPECS[cell.config]
    cost = load_profile(profile)
    if spec is not None:
        # No drafts measured (adaptive judged none paid): the simulator's rule decides alone.
        d, a = cell.spec["drafts"], cell.spec["accepted"]
        rate = acceptance_from_counters(d, a, 4) if d else 0.0
        # ignore_eos: every request emits exactly max_tokens.
        drafted = draft_rate_from_counts(d, a, len(prompts) * max_tokens, len(prompts))
        cost = dataclasses.replace(cost, spec_acceptance_rate=rate, spec_draft_rate=drafted)
    cfg = EngineConfig.from_kwargs(**ENGINE, speculative_config=spec)
    c = cell.concurrency
    # The measured engine ran a warmup wave first (the first c prompts, 8 tokens): the same
    # here, so the prefix cache starts as warm.
    warm = [
        SimRequest(i, len(p), 8, token_ids=tuple(p), warmup=True) for i, p in enumerate(prompts[:c])
    ]
    reqs = [
        SimRequest(c + i, len(p), max_tokens, token_ids=tuple(p)) for i, p in enumerate(prompts)
    ]
    res = simulate_cell(cfg, cost, SimCell(warm + reqs, concurrency=c))
    measured = [r for r in res.requests if not r.warmup]
    first = min(r.sent for r in measured)
    last = max(r.finished or r.sent for r in measured)
    out = Cell(cell.workload, cell.config, c, seconds=last - first)
    for r in measured:
        out.output_tokens += len(r.token_times)
        out.tpot.append((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1))
        out.ttft.append(r.token_times[0] - r.sent)
    return out


def plan_cells(
    args: argparse.Namespace,
) -> list[tuple[str, list[list[int]], int, int, tuple[str, ...]]]:
    from poise.text.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    plan: list[tuple[str, list[list[int]], int, int, tuple[str, ...]]] = []
    if args.only in (None, "grounded"):
        g = grounded_prompts(tok, 8)
        plan += [
            ("grounded", g[:4], 1, 128, (OFF, ADAPTIVE)),
            ("grounded", g, 4, 128, (OFF, ADAPTIVE)),
        ]
    if args.only in (None, "seed"):
        plan.append(
            ("seed", seed_prompts(tok, args.seed_requests), 32, 160, (OFF, ADAPTIVE, FIXED))
        )
    return plan


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from poise.engine.llm import LLM

    rows: list[dict[str, Any]] = []
    plan = plan_cells(args)
    greedy_off: dict[tuple[str, int], dict[int, list[int]]] = {}
    for rnd in range(args.rounds):
        for name, prompts, c, max_tokens, configs in plan:
            order = configs if rnd % 2 == 0 else tuple(reversed(configs))
            for config in order:
                llm = LLM(speculative_config=SPECS[config], **ENGINE)
                closed_loop(llm, prompts[: min(len(prompts), c)], c, 8, Cell(name, config, c))
                cell = Cell(name, config, c)
                closed_loop(llm, prompts, c, max_tokens, cell)
                sim = simulate(cell, prompts, max_tokens, args.profile) if args.profile else None
                rows.append({"round": rnd, **summary(cell, sim)})
                # Greedy: the same tokens with speculation as without (off ran first in
                # round 0; later rounds compare with it too).
                if config == OFF:
                    greedy_off.setdefault((name, c), cell.outputs)
                ref = greedy_off.get((name, c))
                if ref is not None:
                    same = sum(ref.get(i) == toks for i, toks in cell.outputs.items())
                    rows[-1]["greedy_identical"] = f"{same}/{len(cell.outputs)}"
                print(json.dumps(rows[-1]), flush=True)
                del llm
    return rows


def resimulate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The measured rows of an earlier run's log (its JSON lines), simulated again with
    ``--profile`` at the acceptance each row measured."""
    plan = {
        (name, c): (prompts, max_tokens) for name, prompts, c, max_tokens, _ in plan_cells(args)
    }
    rows = []
    for line in Path(args.from_log).read_text().splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if (row["workload"], row["c"]) not in plan:
            continue
        prompts, max_tokens = plan[(row["workload"], row["c"])]
        cell = Cell(row["workload"], row["config"], row["c"])
        cell.spec = {k: row[k] for k in ("drafts", "draft_tokens", "accepted")}
        sim = simulate(cell, prompts, max_tokens, args.profile)
        row.update(summary(cell, sim, measured=False))
        rows.append(row)
    return rows


def summary(cell: Cell, sim: Cell | None, measured: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {"workload": cell.workload, "config": cell.config, "c": cell.concurrency}
    if measured:
        d.update(
            tpot_p50_ms=1000 * cell.p("tpot", 50),
            ttft_p95_ms=1000 * cell.p("ttft", 95),
            tok_s=cell.tok_s,
            **cell.spec,
        )
    if sim is not None:
        d.update(
            sim_tpot_p50_ms=1000 * sim.p("tpot", 50),
            sim_tok_s=sim.tok_s,
            sim_ttft_p95_ms=1000 * sim.p("ttft", 95),
        )
    return d


def _ratio(
    pairs: list[tuple[dict[str, Any], dict[str, Any]]], key: str, inverse: bool, fmt: str
) -> str:
    have = [(o, r) for o, r in pairs if key in o and key in r]
    if not have:
        return "-"
    v = statistics.median(o[key] / r[key] if inverse else r[key] / o[key] for o, r in have)
    return format(v, fmt)


def report(rows: list[dict[str, Any]]) -> str:
    """Per (workload, c): each config's medians over rounds, and same-round ratios to off
    (measured, simulated), their median."""
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["c"]), {}).setdefault(r["config"], []).append(r)
    med = statistics.median
    lines = [
        "| workload | c | config | TPOT p50 ms | tok/s | TTFT p95 ms | accepted / drafted "
        "| TPOT off/on | tok/s on/off | TTFT p95 on/off | sim TPOT off/on | sim tok/s on/off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, c), by in groups.items():
        off = {r["round"]: r for r in by[OFF]}
        for config, runs in by.items():
            pairs = [(off[r["round"]], r) for r in runs if r["round"] in off]

            def ratio(key: str, inverse: bool = False, fmt: str = ".2f") -> str:
                return _ratio(pairs, key, inverse, fmt)  # noqa: B023 (called in this pass)

            lines.append(
                f"| {name} | {c} | {config} | {med(r['tpot_p50_ms'] for r in runs):.1f} "
                f"| {med(r['tok_s'] for r in runs):.1f} "
                f"| {med(r['ttft_p95_ms'] for r in runs):.0f} "
                f"| {int(sum(r['accepted'] for r in runs))} / "
                f"{int(sum(r['draft_tokens'] for r in runs))} "
                f"| {ratio('tpot_p50_ms', True)} | {ratio('tok_s', fmt='.3f')} "
                f"| {ratio('ttft_p95_ms', fmt='.3f')} | {ratio('sim_tpot_p50_ms', True)} "
                f"| {ratio('sim_tok_s', fmt='.3f')} |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="Step-cost profile of this machine (poise profile).")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=("grounded", "seed"), default=None)
    ap.add_argument("--seed-requests", type=int, default=64)
    ap.add_argument(
        "--from-log",
        help="Measure nothing: simulate again (with --profile) the rows of an earlier run's log.",
    )
    args = ap.parse_args()
    rows = resimulate(args) if args.from_log else run(args)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
