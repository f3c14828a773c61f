"""Writes the stored calibration fixtures of tests/sim/test_calibrate.py (run it again only to
change them; the tests read the files, not this script).

Two `poise bench` records of the shape a real run writes (YAML + per-request JSONL, built by
the bench's own ``build_cell`` and ``ExperimentRecord.save``), a `poise serve --step-trace`
file and a one-term profile, with known values to recover against a profile predicting 10 ms
for every step:

- round0.yaml: a concurrency-1 cell of four measured requests (prompt 20, 40, 60, 80 tokens;
  header latency 15 ms + 50 us per prompt token) and a warm-up with a 500 ms header (never
  counted), then a concurrency-4 cell with wild numbers (never read). It links steps.jsonl:
  the c=1 cell's ten steps take 10.8 and 13.2 ms in turn (time scale 1.2, jitter CV 0.1), the
  c=4 cell's five take 50 ms;
- round1.yaml: one concurrency-1 cell, the same requests, no trace: each request's tokens
  come 13, 12, 14, 12, 14 ms apart (TPOT 13 ms: time scale 1.3; the gaps after the first two
  tokens have a CV of 1/13).

    .venv/bin/python tests/sim/records/make_records.py
"""

from __future__ import annotations

import json
from pathlib import Path

from poise.bench.record import ExperimentRecord, build_cell
from poise.bench.stats import RequestRecord
from poise.lab.calibration import link_step_trace
from poise.sim.calibrate import decode_shape
from poise.sim.trace import StepTraceWriter

HERE = Path(__file__).resolve().parent
PROMPTS = (20, 40, 60, 80)
GAPS = (0.013, 0.012, 0.014, 0.012, 0.014)


def request(
    i: int, start: float, prompt: int, header: float, warmup: bool = False
) -> RequestRecord:
    times = [start + header + 0.010]
    for g in GAPS:
        times.append(times[-1] + g)
    return RequestRecord(
        i,
        "short",
        start,
        intended=start,
        header=start + header,
        events=times,
        event_tokens=[1] * len(times),
        event_chars=[4] * len(times),
        end=times[-1],
        usage_completion_tokens=len(times),
        usage_prompt_tokens=prompt,
        max_tokens=len(times),
        warmup=warmup,
        finish_reason="length",
    )


def c1_cell() -> object:
    recs = [request(0, 0.0, 20, 0.5, warmup=True)]
    t = 1.0
    for i, prompt in enumerate(PROMPTS, start=1):
        recs.append(request(i, t, prompt, 0.015 + 50e-6 * prompt))
        t += 1.0
    load = {
        "label": "c1",
        "mode": "closed",
        "concurrency": 1,
        "request_rate": None,
        "burstiness": None,
        "long_prompt_ratio": 0.0,
        "salt": "fixture-0",
    }
    return build_cell(load, recs)


def c4_cell() -> object:
    recs = [request(i, 0.1 * i, 300, 2.0) for i in range(4)]
    load = {
        "label": "c4",
        "mode": "closed",
        "concurrency": 4,
        "request_rate": None,
        "burstiness": None,
        "long_prompt_ratio": 0.0,
        "salt": "fixture-1",
    }
    return build_cell(load, recs)


def record(cells: list[object]) -> ExperimentRecord:
    return ExperimentRecord(
        experiment={
            "model": "fixture",
            "gpu": "unknown",
            "engine": "poise",
            "version": "0",
            "workload": {},
            "server_args": {},
        },
        cells=cells,  # type: ignore[arg-type]
        provenance={"tool_version": "fixture", "complete": True},
    )


def main() -> None:
    writer = StepTraceWriter(HERE / "steps.jsonl", fixture=True)
    writer.note_origin(0.0)
    t = 0.0
    for k in range(10):
        wall = 0.0108 if k % 2 == 0 else 0.0132
        writer.write(t, wall, wall, decode_shape(30 + k))
        t += wall
    for k in range(5):
        writer.write(t, 0.050, 0.050, decode_shape(300 + k))
        t += 0.050
    writer.close()
    r0 = record([c1_cell(), c4_cell()])
    link_step_trace(r0, "steps.jsonl", [(0, 10), (10, 15)])
    r0.save(HERE / "round0.yaml")
    record([c1_cell()]).save(HERE / "round1.yaml")
    profile = {
        "kind": "poise-step-profile",
        "version": 1,
        "model": "fixture",
        "vocab_size": 1000,
        "max_model_len": 4096,
        "kv_bytes_per_token": 1024,
        "kv_budget_bytes": 1 << 24,
        "eos_token_ids": [],
        "features": ["const"],
        "coefficients": {"const": 0.010},
        "decode_padded_knee": None,
        "fit": {"n": 0},
        "request_overhead_s": 0.0,
        "step_overhead_s": 0.0,
        "provenance": {"fixture": True},
        "samples": [],
    }
    (HERE / "profile.json").write_text(json.dumps(profile, indent=1) + "\n")


if __name__ == "__main__":
    main()
