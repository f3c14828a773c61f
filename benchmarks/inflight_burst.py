"""Cold bursts with one opening, against a real ``poise serve`` (issue 35: in-flight sharing).

One server process (the embedded SmolLM2-135M, no flags but the port unless given after
``--``), four measurements in one run, each a ratio against a peer measured in the same run:

1. one cold LONG prompt alone (the seed's LONG prompt through the chat template, 3,363
   tokens): its TTFT and the prompt tokens the engine computed (``poise:step_prefill_tokens``'s
   sum from /metrics, before and after);
2. 8 copies of another cold LONG prompt sent at once: computed tokens / (1)'s, slowest TTFT /
   (1)'s TTFT;
3. one request alone: a cold 3,000-token document and a 30-token question (completions, token
   ids): TTFT and computed tokens;
4. 8 requests on another cold document, 8 different 30-token questions, at once: computed /
   (3)'s, slowest TTFT / (3)'s; then each of the 8 sent alone (sequentially, the document now
   cached): every burst answer must equal its lone twin's (greedy, 16 tokens); and, as a
   control, the same 8 at once again with the document cached (no follower), against the same
   twins: what batching alone does to bf16 answers.

``--rounds R`` (default 3): all four R times in turn, each time with prompts no earlier one
shares; per cell the median of the slowest burst TTFTs over the median single TTFT (the
ratio's peer: one cold prompt's TTFT moves by up to ~1.5x from one request to the next on this
shared machine), the worst round's ratio, and the answers over every round.

"Cold": each cell's prompt differs from every earlier one in its first block (one token of the
default system prompt / of the document replaced), so the prefix cache has nothing of it
beyond the chat template's first tokens, and the lengths stay exact.

    .venv/bin/python benchmarks/inflight_burst.py [--port 18400] [--rounds 3] [--json out.json]
        [-- serve args]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from poise import workload as wl
from poise.lab.managed_server import ManagedServer, ServerSpec

MAX_TOKENS = 16
N = 8


def prefill_tokens(base: str) -> float:
    """The engine's computed prompt tokens since start (the step histogram's sum)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("poise:step_prefill_tokens_sum"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("poise:step_prefill_tokens_sum not in /metrics")


def stream(base: str, prompt: list[int], out: dict[str, Any]) -> None:
    """One streamed completion: client-side TTFT (send to first text chunk) and the text."""
    body = {
        "model": out["model"],
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    text: list[str] = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            piece = json.loads(line[6:])["choices"][0].get("text", "")
            if piece and "ttft_s" not in out:
                out["ttft_s"] = time.perf_counter() - t0
            text.append(piece)
    out["text"] = "".join(text)


def burst(base: str, model: str, prompts: list[list[int]]) -> tuple[list[dict[str, Any]], float]:
    """Send all at once (threads released together); the results and computed tokens."""
    before = prefill_tokens(base)
    outs: list[dict[str, Any]] = [{"model": model} for _ in prompts]
    go = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        go.wait()
        stream(base, prompts[i], outs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)  # the last step's metrics
    return outs, prefill_tokens(base) - before


def tokenize(base: str, model: str, **body: Any) -> list[int]:
    r = httpx.post(base + "/tokenize", json={"model": model, **body}, timeout=60)
    r.raise_for_status()
    return list(r.json()["tokens"])


def salted(ids: list[int], position: int, token: int) -> list[int]:
    out = list(ids)
    out[position] = token
    return out


def measure(base: str, model: str, rounds: int) -> dict[str, Any]:
    long_ids = tokenize(
        base,
        model,
        messages=[{"role": "user", "content": wl.LONG_PROMPT}],
        add_generation_prompt=True,
    )
    pos = 5  # inside the default system prompt: the first block, after <|im_start|>system
    filler = " ".join(wl._FILLER_WORDS[i % len(wl._FILLER_WORDS)] for i in range(4000))
    doc = tokenize(base, model, prompt=filler, add_special_tokens=False)[:3000]
    # One token per cold prompt, each unlike the one it replaces (1 + 4 x rounds of them).
    salts = iter(t for t in range(1000, 2000) if t not in (long_ids[pos], doc[0]))
    questions = [
        (
            tokenize(
                base,
                model,
                prompt=f"\n\nQuestion {q}: which of the words above comes "
                "up most often, and how many times does it appear in the whole document? "
                "Answer briefly, please, with the word and its count only.",
                add_special_tokens=False,
            )
            + [13] * 30
        )[:30]
        for q in range(N)
    ]
    # Warm-up: kernels built, caches touched (a different LONG prompt, and a short one).
    burst(base, model, [salted(long_ids, pos, next(salts))])
    res: dict[str, Any] = {
        "long_prompt_tokens": len(long_ids),
        "doc_tokens": len(doc),
        "question_tokens": len(questions[0]),
        "rounds": rounds,
    }
    identical: list[dict[str, Any]] = []
    document: list[dict[str, Any]] = []
    for _ in range(rounds):  # single and burst alternate: drift hits both
        one, c1 = burst(base, model, [salted(long_ids, pos, next(salts))])
        eight, c8 = burst(base, model, [salted(long_ids, pos, next(salts))] * N)
        identical.append(
            {
                "single_ttft_s": one[0]["ttft_s"],
                "single_computed": c1,
                "burst_ttfts_s": sorted(o["ttft_s"] for o in eight),
                "burst_computed": c8,
                "computed_ratio": c8 / c1,
                "slowest_ttft_ratio": max(o["ttft_s"] for o in eight) / one[0]["ttft_s"],
                "answers_equal": len({o["text"] for o in eight}) == 1,
            }
        )
        document.append(document_round(base, model, doc, questions, salts))
    res["identical"] = {"rounds": identical, **summary(identical)}
    res["document"] = {"rounds": document, **summary(document)}
    return res


def document_round(
    base: str, model: str, doc: list[int], questions: list[list[int]], salts: Iterator[int]
) -> dict[str, Any]:
    """One request on a cold document alone, then 8 on another cold document at once, each
    burst answer against its twin sent alone with that document cached."""
    d0, d1 = salted(doc, 0, next(salts)), salted(doc, 0, next(salts))
    alone, ca = burst(base, model, [d0 + questions[0]])
    shared, cs = burst(base, model, [d1 + q for q in questions])
    twins = [burst(base, model, [d1 + q])[0][0]["text"] for q in questions]
    # Control: the same 8 at once with the document cached (nobody follows anybody): what
    # batching alone does to the answers (bf16 sums in another order at another batch shape).
    control, _ = burst(base, model, [d1 + q for q in questions])
    return {
        "single_ttft_s": alone[0]["ttft_s"],
        "single_computed": ca,
        "burst_ttfts_s": [o["ttft_s"] for o in shared],
        "burst_computed": cs,
        "computed_ratio": cs / ca,
        "slowest_ttft_ratio": max(o["ttft_s"] for o in shared) / alone[0]["ttft_s"],
        "answers_equal_alone": [o["text"] == t for o, t in zip(shared, twins, strict=True)],
        "distinct_answers": len({o["text"] for o in shared}),
        "control_equal_alone": [o["text"] == t for o, t in zip(control, twins, strict=True)],
        "burst_equal_control": [
            o["text"] == c["text"] for o, c in zip(shared, control, strict=True)
        ],
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the rounds: the median slowest burst TTFT / the median single TTFT (one cold
    prompt's TTFT on this shared machine moves by up to ~1.5x from one request to the next, so
    one sample each made the ratio swing 0.83-1.45x), the worst round's ratio and computed
    tokens, and whether every answer equalled its twin in every round."""
    single = statistics.median(r["single_ttft_s"] for r in rounds)
    slowest = statistics.median(max(r["burst_ttfts_s"]) for r in rounds)
    out: dict[str, Any] = {
        "median_single_ttft_s": single,
        "median_slowest_ttft_s": slowest,
        "slowest_ttft_ratio_of_medians": slowest / single,
        "worst_round_ttft_ratio": max(r["slowest_ttft_ratio"] for r in rounds),
        "worst_computed_ratio": max(r["computed_ratio"] for r in rounds),
    }
    if "answers_equal_alone" in rounds[0]:
        out["answers_equal_alone"] = sum(sum(r["answers_equal_alone"]) for r in rounds)
        out["answers"] = N * len(rounds)
    else:
        out["all_answers_equal"] = all(r["answers_equal"] for r in rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--rounds", type=int, default=3, help="each measurement this many times, fresh prompts"
    )
    args = p.parse_args(argv)
    extra: dict[str, Any] = {}
    for flag in serve_extra:  # --name=value or --name (boolean)
        name, _, value = flag.lstrip("-").partition("=")
        extra[name.replace("-", "_")] = value if value else True
    spec = ServerSpec("poise", args=extra)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"inflight_burst_{args.port}.log"
    with ManagedServer(spec, log, port=args.port) as server:
        server.wait_ready()
        base = f"http://127.0.0.1:{args.port}"
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        res = measure(base, model, args.rounds)
    res["uptime"] = os.popen("uptime").read().strip()
    res["serve_args"] = serve_extra
    print(json.dumps(res, indent=2))
    for cell in ("identical", "document"):
        summary_line = {k: v for k, v in res[cell].items() if k != "rounds"}
        print(cell, json.dumps(summary_line), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
