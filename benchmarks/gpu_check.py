"""One-shot check of poise on a GPU: greedy equality, decode step times against the
weight-read floor, one YAML record.

    .venv/bin/python benchmarks/gpu_check.py [--out gpu_check.yaml]      # on a CUDA machine
    .venv/bin/python benchmarks/gpu_check.py --dry-run --out /tmp/x.yaml # same code, CPU, tiny

What it runs, in order (on one GPU, well under 8 minutes):

1. ``equality``: a small random Llama checkpoint written by transformers, greedy decoded by
   transformers (float32, CPU) and by poise on the device (float32, the device's default
   attention backend: flex on CUDA; ``--dry-run`` runs flex on the CPU), several prompts
   batched together. ``match`` is whether every token agrees.
2. ``copy_gb_per_s``: device memory bandwidth from a copy of a large buffer (bytes read +
   written / best time): the speed weights can be read at.
3. ``decode``: a decode step at batch 1 / 8 / 32 of a Qwen2.5-7B-shaped model with dummy
   weights (no download; ``--dry-run``: the small checkpoint) in bf16 (dry run: float32),
   timed end to end through ``ModelRunner.execute`` (best of ``--steps``), next to the
   weight-read floor ``weight bytes / copy bandwidth`` and their ratio.

4. ``lab``: the seed lab's configs A / B / C (one poise server each, on the same
   Qwen2.5-7B-shaped dummy model; dry run: a tiny one) at concurrency 1 / 8 / 16 / 32 with the
   seed's SHORT/LONG mix (benchmarks/gpu_check_lab.py); each config's bench record is saved
   beside the check's record as ``lab-<config>.yaml``.
5. ``calibration``: a concurrency-1 record of config A (``calibration-A-conservative.yaml``)
   through what ``poise simulate --calibrate-from`` does, against the roofline model of the
   GPU (``--accelerator``, default: matched from the device name; dry run: h200): the
   simulator's GPU step-cost model. Simulate with it: ``poise simulate --model-shape
   <lab_model> --accelerator A --calibrate-from calibration-A-conservative.yaml``.

The record's fields are the same with and without ``--dry-run`` (``RECORD_FIELDS``); the test
suite runs the dry run (``--skip-lab`` leaves 4 and 5 out, their fields null).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from poise.config import EngineConfig
from poise.core.outputs import ScheduledRequest, SchedulerOutput
from poise.core.sampling_params import SamplingParams
from poise.runner.factory import create_model_runner
from poise.runner.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_lab  # noqa: E402

RECORD_FIELDS = (
    "dry_run",
    "device",
    "device_name",
    "torch",
    "equality",
    "copy_gb_per_s",
    "decode_model",
    "decode_dtype",
    "attention_backend",
    "decode",
    "lab_model",
    "lab",
    "calibration",
    "wall_s",
)
BATCHES = (1, 8, 32)
SHAPES = Path(__file__).resolve().parents[1] / "poise" / "sim" / "model_shapes"
BLOCK = 16
MAX_NEW = 8


SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def accelerator_for(device_name: str) -> str:
    """The simulator's accelerator whose name the device's contains (h200 when none does)."""
    from poise.sim.accelerators import ACCELERATORS

    name = device_name.lower()
    found = [a for a in ACCELERATORS if a.split("-")[0] in name]
    return max(found, key=len) if found else "h200"


def write_small_checkpoint(path: Path) -> Path:
    """A random 2-layer Llama (GQA) saved by transformers: the equality oracle's model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMALL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def equality(model_dir: Path, device: str, backend: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from poise.engine.llm import LLM

    prompts = [[(13 * i + 7 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((1, 5, 17, 40))]
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = ref_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        want.append(out[0, len(p) :].tolist())
    llm = LLM(
        model=str(model_dir),
        device=device,
        dtype="float32",
        num_kv_blocks=64,
        attention_backend=backend,
        max_num_batched_tokens=32,
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return {"prompts": len(prompts), "max_new_tokens": MAX_NEW, "match": got == want}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int, repeats: int = 5) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written over the best time)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def decode_step_s(runner: ModelRunner, batch: int, steps: int, device: str) -> float:
    """Best seconds per decode step of ``batch`` requests (16-token prompts)."""
    prompt_len = 16
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 2)
    per = -(-(prompt_len + steps + 3) // BLOCK)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    reqs = [
        ScheduledRequest(
            f"r{i}",
            [(5 * i + j) % 400 + 3 for j in range(prompt_len)],
            0,
            tables[i],
            True,
            sp,
            0,
            prompt_len,
        )
        for i in range(batch)
    ]
    last = runner.execute(SchedulerOutput(step_id=0, scheduled=reqs)).sampled_token_ids
    best = float("inf")
    for s in range(steps + 1):  # the first decode step (a first-seen shape) is not counted
        reqs = [
            ScheduledRequest(
                f"r{i}", [last[f"r{i}"]], prompt_len + s, tables[i], True, sp, s + 1, prompt_len
            )
            for i in range(batch)
        ]
        _sync(device)
        start = time.perf_counter()
        last = runner.execute(SchedulerOutput(step_id=s + 1, scheduled=reqs)).sampled_token_ids
        _sync(device)
        if s:
            best = min(best, time.perf_counter() - start)
    return best


def decode(
    model: str, device: str, dtype: str, backend: str, gb_per_s: float, steps: int
) -> tuple[str, list[dict[str, Any]]]:
    blocks = max(BATCHES) * -(-(16 + steps + 3) // BLOCK) + 1
    config = EngineConfig.from_kwargs(
        model=model,
        device=device,
        dtype=dtype,
        attention_backend=backend,
        num_kv_blocks=blocks,
        block_size=BLOCK,
        max_num_seqs=max(BATCHES),
    )
    runner, info = create_model_runner(config)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    floor_s = weight_bytes / (gb_per_s * 1e9)
    rows = []
    for batch in BATCHES:
        step = decode_step_s(runner, batch, steps, device)
        rows.append(
            {
                "batch": batch,
                "step_ms": round(step * 1e3, 3),
                "weight_read_floor_ms": round(floor_s * 1e3, 3),
                "ratio_to_floor": round(step / floor_s, 2),
            }
        )
    return info.attention_backend, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, same record")
    ap.add_argument("--out", default="gpu_check.yaml", help="where the YAML record goes")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per batch")
    ap.add_argument("--skip-lab", action="store_true", help="leave out the lab configs")
    ap.add_argument(
        "--accelerator",
        default=None,
        help="the simulator's accelerator to calibrate (default: from the device)",
    )
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (use --dry-run to run the check on the CPU)", file=sys.stderr
        )
        return 2
    device = "cpu" if args.dry_run else "cuda"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The device's default backend on CUDA (flex); on the CPU the dry run forces flex, so the
    # code path the GPU runs is the one exercised.
    backend = "flex" if args.dry_run else "auto"
    with tempfile.TemporaryDirectory() as tmp:
        small = write_small_checkpoint(Path(tmp) / "small-llama")
        eq = equality(small, device, backend)
        gb_per_s = copy_bandwidth(device, (64 << 20) if args.dry_run else (2 << 30))
        if args.dry_run:
            model, dtype = str(small), "float32"
        else:
            model, dtype = f"dummy:{SHAPES / 'Qwen2.5-7B-Instruct.json'}", "bfloat16"
        used, rows = decode(model, device, dtype, backend, gb_per_s, args.steps)
        shape_file = (
            SMALL if args.dry_run else json.loads((SHAPES / "Qwen2.5-7B-Instruct.json").read_text())
        )
        lab_model = gpu_check_lab.dummy_config(shape_file, out.parent / "gpu_check_lab_model.json")
        lab, calibration = None, None
        if not args.skip_lab:
            lab, c1 = gpu_check_lab.run_lab(
                lab_model, device, out.parent, args.dry_run, device_name
            )
            accelerator = args.accelerator or accelerator_for(device_name)
            calibration = gpu_check_lab.calibrate(c1, lab_model, accelerator)
    record = {
        "dry_run": args.dry_run,
        "device": device,
        "device_name": device_name,
        "torch": str(torch.__version__),
        "equality": eq,
        "copy_gb_per_s": round(gb_per_s, 2),
        "decode_model": "small-llama" if args.dry_run else "Qwen2.5-7B-shaped (dummy weights)",
        "decode_dtype": dtype,
        "attention_backend": used,
        "decode": rows,
        "lab_model": lab_model,
        "lab": lab,
        "calibration": calibration,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    assert tuple(record) == RECORD_FIELDS
    out.write_text(yaml.safe_dump(record, sort_keys=False))
    print(yaml.safe_dump(record, sort_keys=False))
    return 0 if eq["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
