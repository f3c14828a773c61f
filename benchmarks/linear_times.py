"""Time a model's linear layers as its forward runs them, and what they must at least cost.

``decode_linears``: every projection of every layer, in forward order, then the lm_head
(``compute_logits``, as the runner calls it), at a batch of a few rows. The weights of a whole
model are far larger than any cache, so each pass reads them from DRAM as a decode step does;
its floor is the bytes the layers hold (weights, scales and zeros, biases) over the DRAM read
bandwidth. ``prefill_linears``: the projections (no lm_head: a prefill samples one row per
prompt) at many rows, of a few layers or all, whose floor is their FLOPs over the matmul peak.

Each call is timed on its own inside the pass (a perf_counter pair, ~0.1 us against the
0.05-10 ms of a call), so a pass also splits by kind (qkv_proj, o_proj, gate_up_proj,
down_proj, lm_head); a kind's time is its share of the best pass, which sums to the pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from engine_steps import (
    head_bytes,
    in_features,
    out_features,
    projections,
    random_inputs,
    tensor_bytes,
)
from hardware import read_spans
from torch import nn

from poise.model.llama import LlamaForCausalLM

HEAD = "lm_head"


def kind(name: str) -> str:
    """``layers.3.self_attn.qkv_proj`` -> ``qkv_proj``."""
    return name.rpartition(".")[2]


@dataclass
class LinearTimes:
    rows: int
    seconds: float  # the best pass, all layers
    by_kind: dict[str, float] = field(default_factory=dict)  # that pass, split
    # decode_linears: the best streaming read of the same tensors, one call per layer as the
    # pass makes, interleaved with the passes (nan where not measured).
    stream_seconds: float = float("nan")


def _best_pass(
    calls: list[tuple[str, Callable[[], object]]],
    repeats: int,
    warmup: int,
    budget: float = float("inf"),
) -> tuple[float, dict[str, float]]:
    """The fastest of ``repeats`` passes (after ``warmup``), and its split by kind; no more
    passes once those run took ``budget`` seconds (there is always one)."""
    best: tuple[float, dict[str, float]] = (float("inf"), {})
    spent = 0.0
    with torch.inference_mode():
        for rep in range(warmup + repeats):
            if rep > warmup and spent > budget:
                break
            split: dict[str, float] = {}
            for name, call in calls:
                start = time.perf_counter()
                call()
                split[name] = split.get(name, 0.0) + time.perf_counter() - start
            total = sum(split.values())
            spent += total if rep >= warmup else 0.0
            if rep >= warmup and total < best[0]:
                best = (total, split)
    return best


def _projection_calls(
    model: LlamaForCausalLM, rows: int, layers: list[tuple[str, nn.Module]] | None = None
) -> list[tuple[str, Callable[[], object]]]:
    layers = projections(model) if layers is None else layers
    dtype = model.model.embed_tokens.weight.dtype
    inputs = random_inputs({in_features(m) for _, m in layers}, rows, dtype)
    return [(kind(name), partial(m, inputs[in_features(m)])) for name, m in layers]


def _stream_calls(model: LlamaForCausalLM) -> list[tuple[str, Callable[[], object]]]:
    """Per projection (and the lm_head), in forward order: one call that streams every tensor
    it holds (hardware.py's kernel, all threads, one parallel region as a layer's kernel call
    has), nothing computed."""
    threads = torch.get_num_threads()
    head = model.lm_head if model.lm_head is not None else model.tied_head
    modules = [*projections(model), (HEAD, head if head is not None else model.model.embed_tokens)]
    calls: list[tuple[str, Callable[[], object]]] = []
    for name, m in modules:
        tensors = {t.data_ptr(): t for t in (*m.parameters(), *m.buffers())}.values()
        spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        calls.append((kind(name), read_spans(spans, threads)))
    return calls


def decode_linears(model: LlamaForCausalLM, batch: int, repeats: int) -> LinearTimes:
    """Best of ``repeats`` passes (after one that touches every weight) at ``batch`` rows, and
    the best of as many streaming reads of the same tensors, each right after a pass (the
    peer that tells the kernels' cost from the machine's read rate at that moment)."""
    calls = _projection_calls(model, batch)
    hidden = random_inputs({model.arch.hidden_size}, batch, model.model.embed_tokens.weight.dtype)
    calls.append((HEAD, lambda: model.compute_logits(hidden[model.arch.hidden_size])))
    streams = _stream_calls(model)
    _best_pass(calls, 0, warmup=1)
    best: tuple[float, dict[str, float]] = (float("inf"), {})
    stream = float("inf")
    for _ in range(repeats):
        one = _best_pass(calls, 1, warmup=0)
        best = min(best, one, key=lambda r: r[0])
        stream = min(stream, _best_pass(streams, 1, warmup=0)[0])
    return LinearTimes(batch, best[0], best[1], stream)


def prefill_layers(model: LlamaForCausalLM, count: int) -> list[tuple[str, nn.Module]]:
    """The projections of the first ``count`` decoder layers (0: all)."""
    layers = projections(model)
    if count <= 0 or count >= model.arch.num_layers:
        return layers
    return layers[: len(layers) // model.arch.num_layers * count]


def prefill_linears(
    model: LlamaForCausalLM, rows: int, layers: int, repeats: int, budget: float
) -> LinearTimes:
    """Best of ``repeats`` passes (within ``budget`` seconds) at ``rows`` rows over the first
    ``layers`` layers (0: all), after one layer's calls as a warm-up. At hundreds of rows a
    matmul reuses each weight byte that many times, so whether the weights come from DRAM
    or cache hardly matters: a few layers give the ratio to the floor of them all."""
    calls = _projection_calls(model, rows, prefill_layers(model, layers))
    per_layer = len(projections(model)) // max(1, model.arch.num_layers)
    _best_pass(calls[:per_layer], 1, warmup=0)  # oneDNN builds its kernels for these shapes
    total, split = _best_pass(calls, repeats, warmup=0, budget=budget)
    return LinearTimes(rows, total, split)


def bytes_by_kind(model: LlamaForCausalLM) -> dict[str, int]:
    """Bytes a decode step's linears read, per kind (the lm_head included)."""
    out: dict[str, int] = {}
    for name, m in projections(model):
        out[kind(name)] = out.get(kind(name), 0) + tensor_bytes(m)
    out[HEAD] = head_bytes(model)
    return out


def flops_by_kind(
    model: LlamaForCausalLM, rows: int, layers: list[tuple[str, nn.Module]] | None = None
) -> dict[str, int]:
    """Multiply-adds x 2 of the projections (or of ``layers``) at ``rows`` rows, per kind."""
    out: dict[str, int] = {}
    for name, m in projections(model) if layers is None else layers:
        out[kind(name)] = out.get(kind(name), 0) + 2 * rows * in_features(m) * out_features(m)
    return out
