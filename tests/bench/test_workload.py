"""poise.workload: the seed prompts byte for byte, exact mixes, arrivals, JSONL, salt."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from poise import workload as wl

SEED_DOC = Path("/work/shared/seeds/004_eaf74e7163df3415.txt")
# sha256 of the seed's SHORT and LONG strings (computed from the document itself).
SHORT_SHA = "85d5026c7a59fa250dc28abff6f476cf8be5690f904133d23ed93fba33c7627e"
LONG_SHA = "3e4ff3d5ad0a3a3e9d5aa6f9b55df9a9ed3c88fcdb08ff7216dd4189c6075dcb"


def test_seed_prompts_match_hashes() -> None:
    assert hashlib.sha256(wl.SHORT_PROMPT.encode()).hexdigest() == SHORT_SHA
    assert hashlib.sha256(wl.LONG_PROMPT.encode()).hexdigest() == LONG_SHA
    assert wl.LONG_PROMPT.count(" waiting=12 running=48 kv=82%; ") == 220


@pytest.mark.skipif(not SEED_DOC.exists(), reason="seed document not on this machine")
def test_seed_prompts_byte_identical_to_document() -> None:
    ns: dict[str, object] = {}
    for line in SEED_DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith(("SHORT =", "LONG =")):
            exec(line, ns)  # the document's own two assignment lines
    assert ns["SHORT"] == wl.SHORT_PROMPT
    assert ns["LONG"] == wl.LONG_PROMPT


def test_default_mix_sends_seed_prompts_unchanged() -> None:
    short, long = wl.seed_classes(160)
    reqs = wl.ratio_mix(8, 0.25, short, long)
    assert {r.prompt for r in reqs} == {wl.SHORT_PROMPT, wl.LONG_PROMPT}
    assert all(r.max_tokens == 160 for r in reqs)


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0, 0.3])
def test_long_ratio_exact_in_every_prefix(ratio: float) -> None:
    flags = wl.long_positions(64, ratio)
    for n in range(1, 65):
        assert sum(flags[:n]) == math.floor(n * ratio)


def test_weighted_mix_follows_weights_and_is_deterministic() -> None:
    classes = [
        wl.RequestClass("a", prompt_tokens=wl.LengthDist("fixed", 5), weight=3),
        wl.RequestClass("b", prompt_tokens=wl.LengthDist("uniform", 50, 10), weight=1),
    ]
    reqs = wl.weighted_mix(40, classes, seed=3)
    assert sum(r.class_name == "a" for r in reqs) == 30
    assert reqs == wl.weighted_mix(40, classes, seed=3)
    assert all(40 <= len(r.prompt.split()) <= 60 for r in reqs if r.class_name == "b")


def test_length_dist_parse_and_bounds() -> None:
    import random

    d = wl.LengthDist.parse("normal:100:30")
    rng = random.Random(0)
    xs = [d.sample(rng) for _ in range(2000)]
    assert min(xs) >= 1 and abs(statistics.mean(xs) - 100) < 5
    ln = wl.LengthDist.parse("lognormal:200:100")
    ys = [ln.sample(rng) for _ in range(4000)]
    assert abs(statistics.mean(ys) - 200) < 15
    assert wl.LengthDist.parse("64") == wl.LengthDist("fixed", 64)
    with pytest.raises(ValueError):
        wl.LengthDist("zipf", 3)


def test_poisson_and_gamma_arrivals() -> None:
    t = wl.arrival_times(4000, rate=10.0, seed=1)
    gaps = [b - a for a, b in zip([0.0, *t], t, strict=False)]
    assert abs(statistics.mean(gaps) - 0.1) < 0.01
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert abs(cv - 1.0) < 0.1  # exponential gaps
    bursty = wl.arrival_times(4000, rate=10.0, burstiness=0.25, seed=1)
    bg = [b - a for a, b in zip([0.0, *bursty], bursty, strict=False)]
    assert statistics.pstdev(bg) / statistics.mean(bg) > 1.6  # cv = 1/sqrt(0.25) = 2
    assert wl.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert all(b >= a for a, b in zip(t, t[1:], strict=False))


def test_jsonl_prompts(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "hello", "max_tokens": 7, "class": "tiny"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    entries = wl.load_jsonl(path, default_max_tokens=33)
    reqs = wl.cycle_jsonl(5, entries)
    assert [r.prompt for r in reqs] == ["hello", "q?", "hello", "q?", "hello"]
    assert [r.max_tokens for r in reqs[:2]] == [7, 33]
    assert reqs[0].class_name == "tiny" and reqs[1].class_name == "jsonl"


def test_salt_is_a_prefix() -> None:
    assert wl.salted("abc", "r1") == "[r1] abc"
    assert wl.salted("abc", None) == "abc"
    a, b = wl.salted(wl.LONG_PROMPT, "x"), wl.salted(wl.LONG_PROMPT, "y")
    assert a[:3] != b[:3]  # they differ from the first characters on


def test_workload_imports_stdlib_only() -> None:
    code = "import sys, poise.workload; print(sorted(m for m in ('torch','aiohttp','httpx','numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_metric_and_record_modules_need_no_http_client_or_torch() -> None:
    code = (
        "import sys, poise.bench.stats, poise.bench.record, poise.bench.bench_config; "
        "print(sorted(m for m in ('torch','aiohttp','httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
