"""Scheduling policies on the seed mix: SHORT TTFT vs throughput vs goodput, in one run.

The seed workload (``poise.workload``: the SHORT and LONG chat prompts, LONG at ``--long-ratio``,
evenly spread), every prompt salted with its own prefix so no LONG prompt shares a cached
prefix with another (no prefix-cache shortcut), ``max_tokens`` output tokens with
``ignore_eos``, greedy. For each policy the same requests go through the engine in this process
(``EngineCore`` on the real clock, the embedded SmolLM2 in bfloat16 unless ``--model``):

- closed loop at ``--concurrency`` (each finish sends the next request), and/or
- open loop (Poisson arrivals) at ``--load`` x the capacity measured by the first policy's
  closed loop (requests/s), with the same seeded arrival times for every policy.

Policies: ``fifo`` and ``prefill_first`` as before (``traffic_classes none``), ``fifo+classes``
(fifo with the classes below: what the engine does out of the box), ``priority`` (SHORT priority
0, LONG 1; the only cell that sets priorities), ``slo`` (classes short / long with the targets
below and shares 0.7 / 0.3) and ``slo+controller`` (``slo`` with the token-budget controller
holding the SHORT TPOT target, unless ``--controller-tpot-ms``). The targets default to the
engine's default chat classes (SHORT TTFT 1 s / TPOT 200 ms, LONG 15 s / 400 ms). Reported per
cell: SHORT TTFT p50/p95, LONG TTFT p95, TPOT p50, output tok/s, goodput (requests meeting
every target of their class, per second), attainment per class, and the engine's totals (steps,
prompt tokens computed, preemptions: why two cells of the same requests did different work).

The in-process engine leaves HTTP out on purpose: the policies are the engine's, and on a
shared 2-core machine the server's own CPU would add noise to every cell. Cells of one round
run back to back, policy after policy, so they share the machine's load; ``--rounds`` repeats.

    .venv/bin/python benchmarks/slo_scheduling.py --long-ratio 0.25 --concurrency 32 \
        --requests 64 --max-tokens 160 --open-loop --json out.json

``--simulate ACCELERATOR:MODEL_SHAPE`` (e.g. ``h100:Qwen2.5-7B-Instruct``, a roofline) or
``--simulate profile:FILE`` (a ``poise profile`` of this machine) runs the same cells through
the simulator instead (``poise.sim.simulate_cell``, what ``poise simulate`` runs: the same
scheduler code in virtual time), with the same prompts' lengths (chat template + salt).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from slo_scheduling_sim import Done, cost_model, sim_cell

from poise.core.sampling_params import SamplingParams
from poise.core.timing import derive, percentile
from poise.errors import OverloadedError
from poise.workload import long_positions, salted, seed_classes

POLICIES = ("fifo", "prefill_first", "fifo+classes", "priority", "slo", "slo+controller")
# Also runnable: "slo+predictive", "slo+controller+predictive" (predictive admission: a request
# whose predicted TTFT misses its class target is refused with 429 at arrival).


@dataclass
class CellResult:
    policy: str
    mode: str  # closed-<c> | open-<rate>
    long_ratio: float
    seconds: float
    load_avg: float
    done: list[Done] = field(default_factory=list)
    warmup: int = 0
    # Engine-side totals: why two cells with the same requests did different amounts of work.
    steps: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Rates (tok/s, goodput) count every request of the cell over its wall time; latency
        # percentiles and attainment leave out the warm-up, like poise bench (a closed loop's
        # first wave is a burst at t=0 that no steady state has).
        self.all_done = self.done
        self.done = [d for d in self.done if d.index >= self.warmup]

    def _vals(self, cls: str | None, attr: str) -> list[float]:
        return [
            getattr(d, attr)
            for d in self.done
            if (cls is None or d.cls == cls) and getattr(d, attr) is not None
        ]

    def summary(self, targets: dict[str, tuple[float, float]]) -> dict[str, Any]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(1000 * v, 1)

        def meets(d: Done) -> bool:
            ttft_t, tpot_t = targets[d.cls]
            return (
                not d.rejected
                and d.ttft is not None
                and d.ttft <= ttft_t
                and (d.tpot is None or d.tpot <= tpot_t)
            )

        out: dict[str, Any] = {
            "policy": self.policy,
            "mode": self.mode,
            "long_ratio": self.long_ratio,
            "short_ttft_p50_ms": ms(percentile(self._vals("short", "ttft"), 50)),
            "short_ttft_p95_ms": ms(percentile(self._vals("short", "ttft"), 95)),
            "long_ttft_p95_ms": ms(percentile(self._vals("long", "ttft"), 95)),
            "tpot_p50_ms": ms(percentile(self._vals(None, "tpot"), 50)),
            "output_tok_s": round(sum(d.output_tokens for d in self.all_done) / self.seconds, 2),
            "goodput_req_s": round(sum(map(meets, self.all_done)) / self.seconds, 3),
            "rejected": sum(d.rejected for d in self.done),
            "seconds": round(self.seconds, 1),
            "load_avg": round(self.load_avg, 1),
            **self.steps,
        }
        for cls in ("short", "long"):
            mine = [d for d in self.done if d.cls == cls]
            out[f"attain_{cls}"] = round(sum(map(meets, mine)) / len(mine), 3) if mine else None
        return out


def engine_kwargs(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        scheduling_policy=policy.split("+")[0],
        traffic_classes="none",
    )
    if policy.split("+")[0] in ("priority", "slo") or policy == "fifo+classes":
        kw["traffic_classes"] = (
            f"short:ttft_p95_ms={args.short_ttft_ms},tpot_p50_ms={args.tpot_ms},share=0.7;"
            f"long:prompt_tokens>=1024,ttft_p95_ms={args.long_ttft_ms},"
            f"tpot_p50_ms={args.long_tpot_ms},share=0.3"
        )
    if "+controller" in policy:
        # None: the tightest class TPOT target, the engine's own default.
        kw.update(token_budget_controller=True, target_tpot_ms=args.controller_tpot_ms)
    if "+predictive" in policy:
        kw["admission_control"] = "predictive"
    return kw


def make_requests(tok: Any, n: int, long_ratio: float, max_tokens: int, run_salt: str) -> list[Any]:
    from poise.text import apply_chat_template

    short, long = seed_classes(max_tokens)
    reqs = []
    for i, is_long in enumerate(long_positions(n, long_ratio)):
        c = long if is_long else short
        text = salted(c.prompt or "", f"{run_salt}-{i}")  # unique: no shared cached prefix
        ids = apply_chat_template(tok, [{"role": "user", "content": text}])
        reqs.append((c.name, ids, 1 if is_long else 0))
    return reqs


def run_cell(
    core: Any,
    reqs: list[Any],
    max_tokens: int,
    *,
    concurrency: int | None,
    arrivals: list[float] | None,
    steps: dict[str, float] | None = None,
    use_priority: bool = False,
) -> tuple[list[Done], float]:
    """Closed loop (``concurrency``) or open loop (``arrivals``, seconds from the start)."""
    clock = core.clock
    done: list[Done] = []
    classes: dict[str, tuple[int, str]] = {}
    next_i = in_flight = 0
    start = clock.now()

    def add(i: int, arrival: float) -> None:
        nonlocal in_flight
        cls, ids, prio = reqs[i]
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            priority=prio if use_priority else 0,
        )
        rid = f"r{i}-{start:.3f}"
        try:
            core.add_request(rid, ids, params, arrival_time=arrival)
        except OverloadedError:
            done.append(Done(i, cls, None, None, 0, rejected=True))
            return
        classes[rid] = (i, cls)
        in_flight += 1

    while next_i < len(reqs) or in_flight:
        now = clock.now()
        if arrivals is None:
            while in_flight < (concurrency or 1) and next_i < len(reqs):
                add(next_i, now)
                next_i += 1
        else:
            while next_i < len(reqs) and start + arrivals[next_i] <= now:
                add(next_i, start + arrivals[next_i])
                next_i += 1
            if not in_flight and next_i < len(reqs):
                time.sleep(max(0.0, start + arrivals[next_i] - clock.now()))
                continue
        deltas, stats = core.step()
        if stats is not None and steps is not None:
            steps["steps"] = steps.get("steps", 0) + 1
            steps["prefill_tokens"] = steps.get("prefill_tokens", 0) + stats.num_prefill_tokens
            steps["preemptions"] = steps.get("preemptions", 0) + stats.num_preemptions
            steps["step_s"] = steps.get("step_s", 0.0) + stats.step_duration
        for d in deltas:
            if d.finished and d.request_id in classes:
                in_flight -= 1
                m = derive(d.times) if d.times else None
                i, cls = classes.pop(d.request_id)
                done.append(
                    Done(i, cls, m and m.ttft, m and m.tpot, m.num_output_tokens if m else 0)
                )
    return done, clock.now() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--long-ratio", type=float, nargs="+", default=[0.25])
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[32],
        help="Closed loops, one cell each (with several: each runs the first 2 x c requests, at "
        "least 16).",
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--open-loop", action="store_true", help="Also the Poisson open loop.")
    p.add_argument("--closed-loop", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--load",
        type=float,
        nargs="+",
        default=[0.8],
        help="Open-loop rates / the capacity the first policy's closed loops measured (their best).",
    )
    p.add_argument("--burst", action="store_true", help="Also every request at once (t = 0), cold.")
    p.add_argument(
        "--open-rate",
        type=float,
        default=None,
        help="Open-loop rate (req/s) instead of --load x the measured capacity.",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--open-warmup", type=int, default=4, help="Open loop: requests not counted.")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    # Defaults: the engine's default chat classes (poise.sched.classes.DEFAULT_CHAT_CLASSES).
    p.add_argument("--short-ttft-ms", type=float, default=1000)
    p.add_argument("--long-ttft-ms", type=float, default=15000)
    p.add_argument("--tpot-ms", type=float, default=200, help="SHORT TPOT target.")
    p.add_argument("--long-tpot-ms", type=float, default=400)
    p.add_argument("--controller-tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", default=None, metavar="ACCEL:SHAPE | profile:FILE")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from poise.config import EngineConfig
    from poise.engine.llm import LLM
    from poise.text.tokenizer import load_tokenizer

    targets = {
        "short": (args.short_ttft_ms / 1e3, args.tpot_ms / 1e3),
        "long": (args.long_ttft_ms / 1e3, args.long_tpot_ms / 1e3),
    }
    policies = args.policies.split(",")
    configs = {pol: EngineConfig.from_kwargs(**engine_kwargs(pol, args)) for pol in policies}
    cost = cost_model(args.simulate, args.dtype) if args.simulate else None
    tok = load_tokenizer(args.model)
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for lr in args.long_ratio:
            reqs = make_requests(
                tok, args.requests, lr, args.max_tokens, f"{time.time():.0f}-{rnd}"
            )
            capacity = None
            modes: list[tuple[str, int | None, float | None]] = []
            if args.closed_loop:
                modes += [(f"closed-{c}", c, None) for c in args.concurrency]
            if args.open_loop:
                modes += [("open", None, load) for load in args.load]
            if args.burst:
                modes.append(("burst", None, None))
            for mode, conc, load in modes:
                cell_reqs = reqs
                if conc is not None and len(args.concurrency) > 1:
                    cell_reqs = reqs[: max(2 * conc, 16)]
                arrivals: list[float] | None = None
                if mode == "open":
                    assert capacity or args.open_rate, "the open loop needs a capacity first"
                    rate = args.open_rate or (load or 0.0) * (capacity or 0.0)
                    rng = random.Random(args.seed)
                    t, arrivals = 0.0, []
                    for _ in reqs:
                        arrivals.append(t)
                        t += rng.expovariate(rate)
                    mode = f"open-{rate:.2f}rps" + (f"-{load:g}x" if load else "")
                elif mode == "burst":
                    arrivals = [0.0] * len(reqs)
                for pol in policies:
                    steps: dict[str, float] = {}
                    if args.simulate:
                        done, secs = sim_cell(
                            configs[pol],
                            cost,
                            cell_reqs,
                            args.max_tokens,
                            concurrency=conc,
                            arrivals=arrivals,
                            use_priority=pol == "priority",
                        )
                        mode = f"sim-{mode}" if not mode.startswith("sim-") else mode
                    else:
                        # One engine at a time: five KV pools at once would not fit beside
                        # the other processes of a shared machine.
                        core = LLM(args.model, **engine_kwargs(pol, args)).engine
                        done, secs = run_cell(
                            core,
                            cell_reqs,
                            args.max_tokens,
                            concurrency=conc,
                            arrivals=arrivals,
                            steps=steps,
                            use_priority=pol == "priority",
                        )
                        assert not core.has_unfinished_requests()
                        assert core.kv.num_free_blocks == core.kv.num_blocks  # no leak
                        del core
                        gc.collect()
                    warm = (conc or 0) if arrivals is None else args.open_warmup
                    if mode == "burst":
                        warm = 0  # the burst is the measurement
                    cell = CellResult(pol, mode, lr, secs, os.getloadavg()[0], done, warm)
                    if steps:
                        cell.steps = {k: round(v, 1) for k, v in steps.items()}
                    row = cell.summary(targets)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if arrivals is None and pol == policies[0]:
                        capacity = max(capacity or 0.0, len(cell_reqs) / secs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "targets": targets, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
