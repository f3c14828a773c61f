"""Real model sizes through ``poise serve``: decode TPOT and throughput per weight format,
against the time it takes to read the weights once.

For a model shape (``--config``: a config.json; random weights through ``dummy:``, with the
embedded SmolLM2's tokenizer copied beside it) and each ``--quantization`` (none = the
``--dtype``, int8, int4), a fresh ``poise serve`` is started and ``poise bench`` drives short
prompts, ``--max-tokens`` output tokens with ignore_eos, streaming, in a closed loop at each
``--concurrency``. Reported per cell: TPOT p50, output tok/s, and at concurrency 1 the weight
bytes one decode step reads (every projection and the lm_head, as the server holds them) over
TPOT, i.e. the rate the step reads its weights at, next to the DRAM read rate measured in the
same run (``--floor-gbs`` to give one instead): TPOT / (bytes / DRAM rate) is the ratio to
the weight-read floor.

    .venv/bin/python benchmarks/model_sizes.py --config benchmarks/shapes/smollm2-1.7b/config.json
        [--quantizations none,int8,int4] [--concurrency 1,4,16] [--port 18310]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

BIN = Path(sys.executable).parent


def weight_bytes(config: dict[str, Any], quantization: str) -> float:
    """Bytes of weights one decode step reads: the decoder projections in the format, the
    lm_head in int8 when quantized (llama.py) and in the dtype otherwise; norms and embedding
    rows are negligible."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    hd = config.get("head_dim") or h // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    kv = kv or heads
    per_layer = h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * inter
    per_weight = {"none": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}[quantization]  # int4: d, m
    head = vocab * h * (2.0 if quantization == "none" else 1.0)
    return layers * per_layer * per_weight + head


def dummy_dir(config_path: Path) -> Path:
    from poise.text.tokenizer import load_tokenizer

    out = Path(tempfile.mkdtemp(prefix="poise-shape-"))
    shutil.copy(config_path, out / "config.json")
    load_tokenizer(None).save_pretrained(str(out))
    return out


def serve(model: Path, quantization: str, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [
        str(BIN / "poise"),
        "serve",
        "--model",
        f"dummy:{model}",
        "--dtype",
        args.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
    ]
    if quantization != "none":
        cmd += ["--quantization", quantization]
    log = open(args.server_log, "ab")  # noqa: SIM115  (the server's, closed with it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"poise serve exited ({proc.returncode}); see {args.server_log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise SystemExit("poise serve did not start in 600 s")


def bench(args: argparse.Namespace, record: Path) -> list[dict[str, Any]]:
    cmd = [
        str(BIN / "poise"),
        "bench",
        "--base-url",
        f"http://127.0.0.1:{args.port}",
        "--concurrency",
        args.concurrency,
        "--max-tokens",
        str(args.max_tokens),
        "--ignore-eos",
        "--no-progress",
        "--no-plots",
        "-o",
        str(record),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = yaml.safe_load(record.read_text())
    return list(data["experiment"]["metrics"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a config.json")
    parser.add_argument("--quantizations", default="none,int8,int4")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=18310)
    parser.add_argument("--floor-gbs", type=float, default=None, help="DRAM read GB/s to use")
    parser.add_argument("--server-log", default="/tmp/poise-model-sizes.log")
    parser.add_argument("--json", type=Path, default=None, help="write the cells here")
    args = parser.parse_args()
    config = json.loads(args.config.read_text())
    floor = args.floor_gbs
    if floor is None:
        from hardware import read_bandwidth  # benchmarks/hardware.py, beside this script

        floor = read_bandwidth() / 1e9
    model = dummy_dir(args.config)
    rows = []
    try:
        for quantization in args.quantizations.split(","):
            proc = serve(model, quantization, args)
            try:
                cells = bench(args, model / f"bench-{quantization}.yaml")
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
            gb = weight_bytes(config, quantization) / 1e9
            for cell in cells:
                tpot = cell["p50_tpot_ms"] / 1e3
                rows.append(
                    {
                        "quantization": quantization,
                        "concurrency": cell["concurrency"],
                        "tpot_p50_ms": tpot * 1e3,
                        "output_tok_s": cell["output_tokens_per_s"],
                        "weights_gb": gb,
                        "read_floor_ms": gb / floor * 1e3,
                        "tpot_over_floor": tpot / (gb / floor),
                    }
                )
    finally:
        shutil.rmtree(model, ignore_errors=True)
    print(f"{args.config}: DRAM read {floor:.1f} GB/s, load {os.getloadavg()[0]:.1f}")
    print(
        f"{'format':>7} {'c':>3} {'TPOT p50':>9} {'tok/s':>7} {'weights':>8} {'floor':>7} {'x floor':>8}"
    )
    for r in rows:
        print(
            f"{r['quantization']:>7} {r['concurrency']:>3} {r['tpot_p50_ms']:8.1f}m "
            f"{r['output_tok_s']:7.1f} {r['weights_gb']:7.2f}G {r['read_floor_ms']:6.1f}m "
            f"{r['tpot_over_floor']:8.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
