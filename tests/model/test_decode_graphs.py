"""Decode graphs (runner/graphs.py) on the CPU through an eager stand-in for CUDA graphs:
buckets, padding and input staging, with the model's real forward and the paged cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from poise.core.outputs import ScheduledRequest
from poise.core.sampling_params import SamplingParams
from poise.model.attention import FlexAttentionBackend, TorchAttentionBackend
from poise.runner.graphs import DecodeGraphs, bucket_for, capture_sizes, decode_graphs_for
from poise.runner.model_runner import ModelRunner
from tests.model.harness import PagedHarness, load_ours
from tests.model.test_runner import PROMPTS, MiniScheduler, hf_greedy, make_runner

PAD = 40  # the pad block: one past the blocks requests get


class EagerGraphDevice:
    """Stands in for CUDA graphs: a capture records the function, a replay re-runs it. The
    function reads only the static buffers, so a replay sees whatever was staged; the
    buffers' addresses are checked to be the captured ones, as a real graph needs."""

    def __init__(self) -> None:
        self.graphs: DecodeGraphs | None = None
        self.captures = 0

    def _addresses(self) -> list[int]:
        assert self.graphs is not None
        static = vars(self.graphs.static).values()
        return [t.data_ptr() for t in static if isinstance(t, torch.Tensor)]

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        captured = self._addresses()
        self.captures += 1

        def replay() -> torch.Tensor:
            assert self._addresses() == captured, "a graph input moved after capture"
            return fn()

        return replay


def eager_graphs(forward: Any, max_num_seqs: int, block_size: int) -> DecodeGraphs:
    device = EagerGraphDevice()
    graphs = decode_graphs_for(
        forward, max_num_seqs, 64, block_size, PAD, torch.device("cpu"), device
    )
    device.graphs = graphs
    return graphs


def test_buckets_are_vllms_default_capture_sizes() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(10_000)[-1] == 512
    sizes = capture_sizes(32)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 32, 33)] == [1, 4, 8, 16, 32, None]


def _decode(h: PagedHarness, lengths: dict[str, int], token: int) -> list[ScheduledRequest]:
    """One decode token for each request in ``lengths`` (its tokens so far)."""
    return [
        ScheduledRequest(
            rid, [token], n, list(h._blocks(rid, n + 1)), True, SamplingParams(), 0, n + 1
        )
        for rid, n in lengths.items()
    ]


@pytest.mark.parametrize("backend", [TorchAttentionBackend, FlexAttentionBackend])
def test_padded_rows_change_no_real_row_and_touch_only_the_pad_block(
    tiny_checkpoints: dict[str, Path], backend: Any
) -> None:
    from poise.runner.inputs import build_step_inputs

    h = PagedHarness(
        load_ours(str(tiny_checkpoints["llama"])), num_blocks=PAD + 1, attention=backend()
    )
    h._free.remove(PAD)  # the pad block is never handed to a request
    prompts = {f"r{i}": list(range(3 + i, 9 + 3 * i)) for i in range(5)}
    h.step([(rid, p, 0) for rid, p in prompts.items()])
    lengths = {rid: len(p) for rid, p in prompts.items()}

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        return h.model(ids, pos, h.caches, meta, h.attention)

    graphs = eager_graphs(forward, 8, h.block_size)
    for step, live in enumerate((["r0", "r1", "r2"], list(prompts), ["r1", "r3"])):
        inputs = build_step_inputs(
            _decode(h, {r: lengths[r] for r in live}, 7 + step), h.block_size, h.device
        )
        assert graphs.handles(inputs.meta)
        eager_caches = [c.clone() for c in h.caches]
        before = [c.clone() for c in h.caches]
        with torch.inference_mode():
            want = h.model(
                inputs.input_ids, inputs.positions, eager_caches, inputs.meta, h.attention
            )
            got = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        # Real rows: the eager step's hidden states (3 rows padded to 4, 5 to 8, 2 exact).
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        written = inputs.meta.slot_mapping
        for cache, eager, old in zip(h.caches, eager_caches, before, strict=True):
            slots, eager_slots, old_slots = (c.flatten(0, 1) for c in (cache, eager, old))
            # The real rows wrote the eager step's K/V into their own slots (up to the
            # matmul's rounding at another batch size) ...
            torch.testing.assert_close(slots[written], eager_slots[written], atol=1e-5, rtol=1e-5)
            # ... and no other slot outside the pad block changed.
            untouched = torch.ones(PAD * h.block_size, dtype=torch.bool)
            untouched[written] = False
            assert torch.equal(
                slots[: PAD * h.block_size][untouched], old_slots[: PAD * h.block_size][untouched]
            )
            # Padded rows wrote into the pad block's first slot only (the last step has none).
            assert step > 0 or not torch.equal(cache[PAD, 0], old[PAD, 0])
            assert step < 2 or torch.equal(cache[PAD], old[PAD])
            assert torch.equal(cache[PAD, 1:], old[PAD, 1:])
        for rid in live:
            lengths[rid] += 1
    assert graphs.device.captures == 3  # type: ignore[attr-defined]  # buckets 4, 8, 2


def test_graphs_take_decode_only_steps_that_fit(tiny_checkpoints: dict[str, Path]) -> None:
    from poise.runner.inputs import build_step_inputs

    h = PagedHarness(load_ours(str(tiny_checkpoints["llama"])), num_blocks=PAD + 1)
    graphs = eager_graphs(lambda *a: torch.empty(0), 4, h.block_size)
    prefill = build_step_inputs(
        _decode(h, {"a": 3}, 1)[:0]
        + [
            ScheduledRequest(
                "p", [1, 2, 3], 0, list(h._blocks("p", 3)), True, SamplingParams(), 0, 3
            )
        ],
        h.block_size,
        h.device,
    )
    assert not graphs.handles(prefill.meta)
    five = build_step_inputs(_decode(h, {f"d{i}": 2 for i in range(5)}, 1), h.block_size, h.device)
    assert not graphs.handles(five.meta)  # more rows than the largest bucket (4)
    long = build_step_inputs(_decode(h, {"x": 70}, 1), h.block_size, h.device)
    assert not graphs.handles(long.meta)  # a table wider than the buffers (64 tokens)


def test_runner_with_decode_graphs_equals_transformers(tiny_checkpoints: dict[str, Path]) -> None:
    """The whole runner, decode steps through the graphs, against transformers' greedy."""
    eager, _ = make_runner(tiny_checkpoints["llama"], num_kv_blocks=PAD + 1)
    caches = eager.kv_caches

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        return eager.model(ids, pos, caches, meta, eager.attention)

    graphs = eager_graphs(forward, 8, 4)
    runner = ModelRunner(
        eager.model, eager.attention, caches, 4, torch.device("cpu"), decode_graphs=graphs
    )
    assert runner.num_kv_blocks == PAD  # the pad block is not the KV manager's
    sched = MiniScheduler(block_size=4, num_blocks=PAD, chunk=5)
    for rid, p in PROMPTS.items():
        sched.add(rid, p, max_tokens=6)
    got = sched.run(runner)
    assert graphs.device.captures >= 1  # type: ignore[attr-defined]
    for rid, p in PROMPTS.items():
        assert got[rid] == hf_greedy("llama", p, 6), rid
