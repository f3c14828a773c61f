"""`poise lab`: which cells answer each of the seed lab's seven questions (doc 004).

Six groups of configs x cells, each one workload held fixed while one knob moves:

- ``batching`` (Q1): continuous (fifo) vs ``static`` vs ``dynamic`` batching, closed loop,
  the seed's SHORT prompt with output lengths spread over 10 %..100 % of max_tokens (with equal
  outputs static batching loses little; spread outputs are what it waits for);
  ``batching-open``: the same in open loop (Poisson) at a quarter of the requests per second
  continuous batching served closed loop, so the engine idles between arrivals (where
  ``dynamic``'s delay shows; in a saturated closed loop it measures like ``static``).
- ``mix`` (Q2, Q3, Q4): decode-first (fifo) vs prefill-first on the seed mix, long ratio 0
  and 0.5: the TTFT distribution (Q2), the policy trade (Q3), short TTFT with and without long
  prompts (Q4).
- ``waiting`` (Q5): the lab's config C and three variants each short of one thing (request
  cap, KV cache, token budget) at the highest concurrency: which limit holds ``waiting`` up.
- ``prefix`` (Q6): documents asked the same question in turn (identical prompts per
  document, round robin), a queue (more clients than ``max_num_seqs``) and a KV pool that holds
  only two documents beside the running ones (half of them): prefix cache off, on (fifo), on
  (lpm); ``prefix-burst`` (Q6): eight identical cold long prompts sent at once (simultaneous
  arrival), prefix cache off and on: with in-flight sharing the burst costs about one
  prefill (the followers wait for the first one's blocks instead of computing them).
- ``tune`` (Q7): ``poise tune``'s procedure for a chat SLO, both answers.
- ``speculation`` (Q8, issue 34): speculation off, ngram adaptive and ngram with a fixed k=4
  on the seed mix at concurrency 1, 32 and 64 (scaled): where drafts pay and where adaptive
  stops them costing throughput.

Sizes: the seed's on a GPU and in the simulator; on CPU every size / ``scale`` (8), as
``presets`` scales the lab's configs, so the whole CPU run takes minutes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from poise import workload as wl
from poise.bench.bench_config import WorkloadSpec
from poise.lab.presets import DEFAULT_KV_BASE_BYTES, LAB_C, scaled_args

QUESTIONS: dict[int, str] = {
    1: "What separates static, dynamic and continuous batching?",
    2: "Why not average latency? Which part of the user's wait are TTFT and TPOT?",
    3: "What do prefill-first and decode-first each sacrifice?",
    4: "How does one long prompt move short prompts' TTFT?",
    5: "When `waiting` stays high, which parameters come first?",
    6: "Why does a prefix cache (RadixAttention) change scheduling, not just caching?",
    7: "Throughput-first and latency-first configs for a chat SLO?",
    8: "When does speculative decoding pay, and when does it cost throughput?",
}
# Q8's configs (``--speculative-config``), and the acceptance rate the simulator assumes when
# its cost model has none: about what prompt lookup keeps on text copied from the prompt.
SPEC_ADAPTIVE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
SPEC_FIXED = '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'
SIM_ACCEPTANCE_RATE = 0.7
# Tokens per repeat of the seed's long log line (3363 tokens for 220 repeats with SmolLM2's
# template): sizes the KV pools below.
_TOKENS_PER_LONG_REPEAT = 15.3
_BLOCK = 16  # poise's default block size
BURST = 8  # requests of Q6's simultaneous-arrival cell


@dataclass(frozen=True)
class Group:
    name: str
    questions: tuple[int, ...]
    workload: WorkloadSpec
    configs: dict[str, dict[str, Any]]  # config name -> engine args (poise serve's names)
    note: str = ""
    # Simulated: the drafts' acceptance rate where the cost model has none (Q8).
    sim_acceptance_rate: float | None = None


@dataclass(frozen=True)
class TunePlan:
    workload: WorkloadSpec
    slo_ttft_p95_ms: float
    slo_tpot_p50_ms: float
    budgets: tuple[int, ...]
    seqs: tuple[int, ...]
    max_probes: int
    base_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LabPlan:
    target: str  # "cpu", "cuda..." (live) or "simulated"
    scale: int
    groups: tuple[Group, ...]
    tune: TunePlan


def _div(x: int, scale: int, floor: int = 1) -> int:
    return max(floor, x // scale)


def plan(
    target: str,
    *,
    scale: int | None = None,
    out_dir: str | Path = ".",
    kv_base_bytes: int = DEFAULT_KV_BASE_BYTES,
    delay_ms: float | None = None,
    slo_ttft_p95_ms: float | None = None,
    slo_tpot_p50_ms: float | None = None,
    max_probes: int | None = None,
) -> LabPlan:
    """The lab's cells for ``target`` (``cpu``, ``cuda``, or ``simulated``: the GPU's sizes
    without a device)."""
    gpu_sizes = target != "cpu"
    s = scale or (1 if gpu_sizes else 8)
    device = "cpu" if target in ("cpu", "simulated") else target
    base = scaled_args(LAB_C, "cuda" if gpu_sizes else device, s, kv_base_bytes)
    if target == "simulated":
        base.pop("device", None)
    conc, hi_conc = _div(32, s), _div(64, s)
    max_tokens = _div(wl.DEFAULT_MAX_TOKENS, s, 8)
    repeat = _div(wl.SEED_LONG_REPEAT, s)
    n_req = None if gpu_sizes else 16
    # A salt per request: the seed's prompts are identical texts, and with the prefix cache on
    # every long prompt after the first would cost nothing (Q6 measures the cache on purpose).
    seed_mix = WorkloadSpec(
        concurrency=(conc,),
        long_ratio=(0.0, 0.5),
        max_tokens=max_tokens,
        long_repeat=repeat,
        num_requests=n_req,
        salt_scope="request",
        warmup=None if gpu_sizes else 2,
    )
    chat = wl.RequestClass(
        "chat",
        prompt=wl.SHORT_PROMPT,
        output_tokens=wl.LengthDist(
            "uniform", 0.55 * max_tokens, 0.45 * max_tokens, low=1, high=max_tokens
        ),
    )
    batching = replace(
        seed_mix, classes=(chat,), long_ratio=(0.0,), num_requests=None if gpu_sizes else 16
    )
    delay = delay_ms if delay_ms is not None else (50.0 if gpu_sizes else 250.0)
    modes = {
        "continuous": {**base, "scheduling_policy": "fifo"},
        "static": {**base, "scheduling_policy": "static"},
        "dynamic": {**base, "scheduling_policy": "dynamic", "max_batch_delay_ms": delay},
    }
    groups = [
        Group("batching", (1,), batching, modes),
        # The same traffic in open loop, at a rate ``seven_run`` sets from the closed-loop run.
        Group("batching-open", (1,), replace(batching, concurrency=()), dict(modes)),
        Group(
            "mix",
            (2, 3, 4),
            seed_mix,
            {
                "decode-first": {**base, "scheduling_policy": "fifo"},
                "prefill-first": {**base, "scheduling_policy": "prefill_first"},
            },
        ),
        _waiting_group(base, seed_mix, hi_conc, repeat, max_tokens, s),
        _prefix_group(base, conc, max_tokens, s, gpu_sizes, Path(out_dir)),
        _burst_group(base, max_tokens, repeat),
        Group(
            "speculation",
            (8,),
            replace(seed_mix, concurrency=(1, conc, hi_conc), long_ratio=(0.25,)),
            {
                "off": dict(base),
                "ngram-adaptive": {**base, "speculative_config": SPEC_ADAPTIVE},
                "ngram-fixed": {**base, "speculative_config": SPEC_FIXED},
            },
            note=f"simulated drafts kept at {SIM_ACCEPTANCE_RATE} each unless the cost model "
            "says otherwise (`poise simulate --spec-acceptance-rate`); live: prompt lookup on "
            "the seed's prompts",
            sim_acceptance_rate=SIM_ACCEPTANCE_RATE,
        ),
    ]
    tune_wl = replace(seed_mix, long_ratio=(0.25,))
    tune = TunePlan(
        tune_wl,
        slo_ttft_p95_ms or (2000.0 if gpu_sizes else 4000.0),
        slo_tpot_p50_ms or (100.0 if gpu_sizes else 250.0),
        budgets=(512, 1024, 2048, 4096, 8192) if gpu_sizes else (256, 512, 1024),
        seqs=(4, 8, 16, 32) if gpu_sizes else (1, 2, 4),
        max_probes=max_probes or (20 if gpu_sizes else 6),
        base_args={
            k: v for k, v in base.items() if k not in ("max_num_seqs", "max_num_batched_tokens")
        },
    )
    return LabPlan(target, s, tuple(groups), tune)


def _waiting_group(
    base: dict[str, Any], mix: WorkloadSpec, conc: int, repeat: int, max_tokens: int, s: int
) -> Group:
    long_tokens = int(repeat * _TOKENS_PER_LONG_REPEAT) + 60
    # Room for about three long requests: far fewer than the clients want at once.
    kv_blocks = 3 * (long_tokens + max_tokens) // _BLOCK + 1
    workload = replace(mix, concurrency=(conc,), long_ratio=(0.25,))
    return Group(
        "waiting",
        (5,),
        workload,
        {
            "C": dict(base),
            "cap": {**base, "max_num_seqs": max(1, conc // 4)},
            "kv": {**base, "num_kv_blocks": kv_blocks},
            "budget": {**base, "max_num_batched_tokens": _div(512, s, 64)},
        },
        note=f"KV variant: {kv_blocks} blocks of {_BLOCK} tokens (about three long requests)",
    )


def _cache_off_on(args: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Q6's two configs: the same engine with the prefix cache off and on."""
    return {
        f"{prefix}cache-off": {**args, "enable_prefix_caching": False},
        f"{prefix}cache-on": {**args, "enable_prefix_caching": True},
    }


def _burst_group(base: dict[str, Any], max_tokens: int, repeat: int) -> Group:
    """Q6's simultaneous-arrival cell: ``BURST`` copies of one cold long prompt at once."""
    workload = WorkloadSpec(
        concurrency=(BURST,),
        long_ratio=(1.0,),
        long_repeat=repeat,
        max_tokens=max_tokens,
        num_requests=BURST,
        warmup=0,
        salt_scope="cell",  # identical within the cell, cold for each config
    )
    return Group(
        "prefix-burst",
        (6,),
        workload,
        _cache_off_on(base, "burst-"),
        note=f"{BURST} identical cold long prompts sent at once",
    )


def doc_prompts(n_docs: int, doc_words: int, question: str = wl.SHORT_PROMPT) -> list[str]:
    """One prompt per document: the document, then the same question (deterministic)."""
    filler = wl.RequestClass("doc", prompt_tokens=wl.LengthDist("fixed", doc_words))
    return [
        f"Document {k}: {filler.make_prompt(random.Random(1000 + k))}\n\n{question}"
        for k in range(n_docs)
    ]


def _prefix_group(
    base: dict[str, Any], conc: int, max_tokens: int, s: int, gpu_sizes: bool, out_dir: Path
) -> Group:
    doc_words = _div(1600, s, 64)
    seqs = max(2, conc // 4)
    # The pool holds the running requests' documents plus two more, half the documents, so in
    # arrival order LRU evicts each one before it comes back; enough clients that the queue
    # holds every document (more than once) for a cache-aware order to choose from.
    docs = 2 * (seqs + 2)
    clients = max(2 * conc, 2 * docs)
    path = out_dir / "prefix" / "documents.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": p, "class": "doc"}) for p in doc_prompts(docs, doc_words)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    per_request = doc_words + 60 + max_tokens  # words ~ tokens, plus the template and question
    kv_blocks = (seqs + 2) * (-(-per_request // _BLOCK) + 1)
    workload = WorkloadSpec(
        concurrency=(clients,),
        jsonl=str(path),
        max_tokens=max_tokens,
        num_requests=None if gpu_sizes else 32,
        warmup=None if gpu_sizes else 4,
    )
    args = {**base, "max_num_seqs": seqs, "num_kv_blocks": kv_blocks}
    note = (
        f"{docs} documents of {doc_words} words asked in turn, {clients} clients, "
        f"max_num_seqs {seqs}, {kv_blocks} KV blocks (the running documents and about two "
        "more)"
    )
    return Group(
        "prefix",
        (6,),
        workload,
        {
            **_cache_off_on(args),
            "cache-on-lpm": {**args, "enable_prefix_caching": True, "scheduling_policy": "lpm"},
        },
        note=note,
    )
