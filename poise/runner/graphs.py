"""Decode steps replayed from captured graphs: the batch-size buckets, the padding and the
static input buffers, independent of the device that captures.

Why: a decode step of a small model on a GPU is mostly kernel-launch overhead; a CUDA graph
replays the whole forward's launches at once. A graph replays fixed shapes reading fixed
addresses, so (as vLLM does):

- batch sizes are rounded up to a bucket (``capture_sizes``: 1, 2, 4, 8, then steps of 8, as
  vLLM's default ``cudagraph_capture_sizes``); a step with more decodes than the largest bucket,
  or any prefill chunk, runs eagerly;
- the step's inputs are copied into static buffers (``StaticDecodeInputs``) sized for the
  largest bucket, and the graph of a bucket reads their first ``bucket`` rows;
- padded rows (``bucket - D`` of them) are requests of their own that own ONE block: the pad
  block, an extra block of the KV pool that the KV manager never hands out. A padded row
  writes its K/V there and its block table holds only that block with one visible key, so
  it never reads or writes a block a real request owns, and real rows (each query attends
  only its own table) are not changed by it.

What captures is a ``GraphDevice``: ``CudaGraphDevice`` (torch.cuda.CUDAGraph, a shared
memory pool) on CUDA; tests use an eager stand-in that re-runs the captured function, which
reads nothing but the static buffers, so staging and padding are checked on the CPU.
``--enforce-eager`` (vLLM's flag) turns graphs off. The attention backend's ``prepare`` runs
inside the capture, so only backends whose decode ``prepare`` is pure tensor work on its
inputs (``decode_capturable = True``: ``torch`` and ``flex``) are captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from poise.model.attention import AttentionMetadata

# The largest batch vLLM captures by default.
MAX_CAPTURE_SIZE = 512
# Longest context a captured decode step holds: graphs attend every row at the buffers' full
# table width (the torch backend gathers all of it), so longer contexts run eagerly.
MAX_CAPTURE_CONTEXT = 4096

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Buckets 1, 2, 4, 8, 16, 24, ... up to the first one >= min(max_num_seqs, 512)."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    return (*(s for s in sizes if s < limit), next(s for s in sizes if s >= limit))


def bucket_for(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``batch`` rows; None when it exceeds every bucket."""
    return next((s for s in sizes if s >= batch), None)


class GraphDevice(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record ``fn`` (which reads only static buffers); the result replays it and returns
        the same output tensor each time."""
        ...


class CudaGraphDevice:
    """CUDA graphs: warm up on a side stream, capture into one pool shared by all buckets."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()  # warm-up: allocator, lazy kernel init and compiles happen outside capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@dataclass
class StaticDecodeInputs:
    """The buffers every decode graph reads (rows: the largest bucket; width: the longest
    block table a request may have)."""

    input_ids: torch.Tensor  # [M] int64
    positions: torch.Tensor  # [M] int64
    slot_mapping: torch.Tensor  # [M] int64
    block_tables: torch.Tensor  # [M, W] int64
    context_lens: torch.Tensor  # [M] int64
    block_size: int
    pad_block: int

    @classmethod
    def allocate(
        cls, rows: int, width: int, block_size: int, pad_block: int, device: torch.device
    ) -> StaticDecodeInputs:
        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        return cls(
            ints(rows), ints(rows), ints(rows), ints(rows, width), ints(rows), block_size, pad_block
        )

    def stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: int
    ) -> None:
        """Copy a decode-only step (D rows) into rows 0..D-1 and pad rows D..rows-1."""
        d = meta.num_decodes
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:d].copy_(input_ids)
        self.positions[:d].copy_(positions)
        self.slot_mapping[:d].copy_(meta.slot_mapping)
        self.block_tables[:d, :width].copy_(meta.decode_block_tables)
        # A real row's entries past its table point at the pad block (never visible to it:
        # its context length masks them), never at a block another request owns.
        self.block_tables[:d, width:].fill_(self.pad_block)
        self.context_lens[:d].copy_(meta.decode_context_lens)
        self.input_ids[d:rows].fill_(0)
        self.positions[d:rows].fill_(0)
        self.slot_mapping[d:rows].fill_(self.pad_block * self.block_size)
        self.block_tables[d:rows].fill_(self.pad_block)
        self.context_lens[d:rows].fill_(1)

    def meta(self, rows: int) -> AttentionMetadata:
        """The metadata of a ``rows``-row decode step over views of the buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            block_size=self.block_size,
            num_decodes=rows,
            decode_block_tables=self.block_tables[:rows],
            decode_context_lens=self.context_lens[:rows],
        )


class DecodeGraphs:
    """Decode-only steps through one captured graph per bucket (captured on first use)."""

    def __init__(
        self,
        forward: Forward,
        static: StaticDecodeInputs,
        sizes: tuple[int, ...],
        device: GraphDevice,
    ) -> None:
        if sizes[-1] > static.input_ids.shape[0]:
            raise ValueError("decode graphs: the largest bucket exceeds the static buffers")
        self.forward = forward
        self.static = static
        self.sizes = sizes
        self.device = device
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def handles(self, meta: AttentionMetadata) -> bool:
        """A decode-only step that fits a bucket and the buffers' table width."""
        tables = meta.decode_block_tables
        return (
            not meta.prefills
            and 0 < meta.num_decodes <= self.sizes[-1]
            and tables is not None
            and tables.shape[1] <= self.static.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """hidden [D, hidden_size] of a step ``handles`` accepted."""
        rows = bucket_for(meta.num_decodes, self.sizes)
        assert rows is not None
        self.static.stage(input_ids, positions, meta, rows)
        replay = self.graphs.get(rows)
        if replay is None:
            replay = self.graphs[rows] = self.device.capture(self._body(rows))
        return replay()[: meta.num_decodes]

    def _body(self, rows: int) -> Callable[[], torch.Tensor]:
        static = self.static
        ids, pos, meta = static.input_ids[:rows], static.positions[:rows], static.meta(rows)
        return lambda: self.forward(ids, pos, meta)


def decode_graphs_for(
    forward: Forward,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    pad_block: int,
    device: torch.device,
    graph_device: GraphDevice,
) -> DecodeGraphs:
    """Buckets for ``max_num_seqs``, buffers for tables of up to ``max_model_len`` tokens
    (``MAX_CAPTURE_CONTEXT`` at most)."""
    sizes = capture_sizes(max_num_seqs)
    width = -(-min(max_model_len, MAX_CAPTURE_CONTEXT) // block_size)
    static = StaticDecodeInputs.allocate(sizes[-1], width, block_size, pad_block, device)
    return DecodeGraphs(forward, static, sizes, graph_device)
