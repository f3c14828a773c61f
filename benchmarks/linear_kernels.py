"""Linear-layer kernels per weight format and row count: which path is fastest (the crossovers
in poise/model/linear_kernel.py come from here).

For each format (bf16, int8, int4) and row count it times one decode-like pass over
``--layers`` layers of a model's projections (default SmolLM2-1.7B's: q/k/v 2048 -> 6144, o
2048 -> 2048, gate/up 2048 -> 16384, down 8192 -> 2048), each layer's own weights, so the
weights come from DRAM as in a real step (many layers; one matrix re-read would sit in the
480 MB L3 this CPU reports), through every path that can run it:

- bf16: torch's ``F.linear`` (oneDNN) and ours (``bf16_linear``'s dot-product kernel);
- int8 / int4: ours streamed and ours tiled (AMX), and torch's weight-only kernels
  (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) as the baseline.

Figures: ms per pass (best of ``--repeats``) and the weight bytes read per second.

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,2,4,8,16,32] [--layers 8]
        [--threads 2] [--cpu-time]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from poise.model import linear_kernel as lk  # noqa: E402
from poise.model.quant import quantize_int4, quantize_int8  # noqa: E402

# (in, out) per layer: SmolLM2-1.7B's fused projections, and SmolLM2-135M's (q, k, v, o, gate,
# up, down: 576-wide rows, where short weight rows test the prefetch rather than the stream).
MODEL_SHAPES = {
    "1.7b": [(2048, 6144), (2048, 2048), (2048, 16384), (8192, 2048)],
    "135m": [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)],
    "135m-fused": [(576, 960), (576, 576), (576, 3072), (1536, 576)],  # as llama.py runs them
}
SHAPES = MODEL_SHAPES["1.7b"]
BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5}


def build(layers: int, formats: set[str]) -> list[dict[str, object]]:
    """Per layer and shape: the bf16 weight, and (if asked for) our packed int8 / int4 and
    torch's int8 / int4."""
    out: list[dict[str, object]] = []
    torch.manual_seed(0)
    for _ in range(layers):
        for k, n in SHAPES:
            w = (torch.randn(n, k) * 0.02).bfloat16()
            layer: dict[str, object] = {"k": k, "bf16": w}
            if "int8" in formats:
                q8, s8 = quantize_int8(w)
                layer.update({"int8": lk.pack_int8(q8, s8), "torch int8": (q8, s8.bfloat16())})
            if "int4" in formats:
                q4, d4, m4 = quantize_int4(w)
                zeros = torch.stack((d4, m4 + 8 * d4), -1).transpose(0, 1).bfloat16().contiguous()
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 1)
                layer.update({"int4": lk.pack_int4(q4, d4, m4), "torch int4": (packed, zeros)})
            out.append(layer)
    return out


def time_pass(
    layers: list[dict[str, object]],
    run: Callable[[dict[str, object], torch.Tensor], object],
    rows: int,
    repeats: int,
    cpu: bool,
) -> float:
    xs = {int(layer["k"]): torch.randn(rows, int(layer["k"])).bfloat16() for layer in layers}
    clock = time.process_time if cpu else time.perf_counter
    best = float("inf")
    for _ in range(repeats + 1):
        start = clock()
        for layer in layers:
            run(layer, xs[int(layer["k"])])  # type: ignore[call-overload]
        best = min(best, clock() - start)
    return best


def paths() -> dict[str, tuple[str, Callable[[dict[str, object], torch.Tensor], object]]]:
    def ours(fmt: str, tiled: bool) -> Callable[[dict[str, object], torch.Tensor], object]:
        def run(layer: dict[str, object], x: torch.Tensor) -> object:
            lk.TILED_FROM_ROWS[fmt] = 1 if tiled else 1 << 30
            return layer[fmt](x)  # type: ignore[operator]

        return run

    def torch8(layer: dict[str, object], x: torch.Tensor) -> object:
        q, s = layer["torch int8"]  # type: ignore[misc]
        return torch.ops.aten._weight_int8pack_mm(x, q, s)

    def torch4(layer: dict[str, object], x: torch.Tensor) -> object:
        w, z = layer["torch int4"]  # type: ignore[misc]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, z)

    def bf16_ours(layer: dict[str, object], x: torch.Tensor) -> object:
        lk.BF16_ROWS = 1 << 30  # ours at every row count with AMX too (without: always)
        return lk.bf16_linear(x, layer["bf16"], None)  # type: ignore[arg-type]

    return {
        "bf16 torch": ("bf16", lambda layer, x: F.linear(x, layer["bf16"])),  # type: ignore[arg-type]
        "bf16 ours": ("bf16", bf16_ours),
        "int8 torch": ("int8", torch8),
        "int8 streamed": ("int8", ours("int8", False)),
        "int8 tiled": ("int8", ours("int8", True)),
        "int4 torch": ("int4", torch4),
        "int4 streamed": ("int4", ours("int4", False)),
        "int4 tiled": ("int4", ours("int4", True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall")
    parser.add_argument("--shapes", choices=sorted(MODEL_SHAPES), default="1.7b")
    parser.add_argument("--formats", default="bf16,int8,int4", help="comma-separated subset")
    args = parser.parse_args()
    global SHAPES
    SHAPES = MODEL_SHAPES[args.shapes]
    if args.threads:
        torch.set_num_threads(args.threads)
    if lk.load_linear_kernel() is None:
        raise SystemExit("linear kernel unavailable (needs AVX512-BF16 and VNNI, and g++)")
    formats = set(args.formats.split(","))
    layers = build(args.layers, formats)
    params = sum(k * n for k, n in SHAPES) * args.layers
    clock = "CPU" if args.cpu_time else "wall"
    print(
        f"{args.layers} layers x {len(SHAPES)} projections, {params / 1e6:.0f} M weights, "
        f"threads {torch.get_num_threads()}, AMX {lk.amx_available()}, {clock} ms "
        f"(weight GB/s), load {os.getloadavg()[0]:.1f}"
    )
    table = {name: path for name, path in paths().items() if path[0] in formats}
    print(f"{'rows':>5} " + " ".join(f"{name:>18}" for name in table))
    saved = dict(lk.TILED_FROM_ROWS), lk.BF16_ROWS
    for rows in (int(r) for r in args.rows.split(",")):
        cells = []
        for fmt, run in table.values():
            t = time_pass(layers, run, rows, args.repeats, args.cpu_time)
            cells.append(f"{t * 1e3:8.1f} ({params * BYTES[fmt] / t / 1e9:5.1f})")
        lk.TILED_FROM_ROWS.update(saved[0])
        lk.BF16_ROWS = saved[1]
        print(f"{rows:>5} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
