// bf16 weights on AMX tiles for every row count (cpu_linear.cpp; packed by linear_kernel.py's
// pack_bf16), where the CPU has AMX.
//
// Why one path for every row count: a row's output is then the same bits whatever else is in
// the step. Each output element is one tile accumulator summed over K in the same order
// (K blocks of 32 in turn, one tdpbf16ps each), and an AMX product computes every element from
// its own row of A alone, so a request decoded alone, in a batch of 16, as a speculative verify
// row or as part of a prefill chunk gets identical logits. Two kernels chosen by row count
// (the dot-product one for decode, torch's GEMM for more rows) sum in two orders, and greedy
// answers then depended on the batch (benchmarks/RESULTS.md, "In-flight prefix sharing").
//
// Not emulated on vectors for decode: a tile adds a K block's 32 products to the float32 sum
// with one rounding (matched bit for bit by an exact sum of the 32, then one rounding; never
// by vdpbf16ps's pair-by-pair roundings, which differed in ~1 output in 7,000), so vectors at
// one row and tiles at more would sum differently again. Measured against the kernels they
// replace (benchmarks/RESULTS.md, "bf16 on AMX for every row count"): SmolLM2-1.7B's decode
// step 0.84x at batch 1 and 16; the 135M model's 1.1x slower at batch 1, 1.3x faster at 16.
//
// Layout: output channels in groups of 32 (two 16-channel tiles; 16 where N is not a multiple
// of 32), each group one sequential stream over K: per K block of 32, per tile, the B tile in
// VNNI order [16 input pairs][16 channels][2] (1 KB). Rows of x in blocks of 16 (an A tile;
// the last block from a zero-padded copy; fewer than 16 rows in all: tiles of that many rows),
// two row blocks x two channel tiles per pass (four accumulators), rows in chunks of
// kAmxRowChunk that stay in L2 while the groups pass by. Decode (16 rows or fewer) reads each
// weight byte once, prefetched ahead of the tile loads.
#pragma once

#include "cpu_linear_common.h"

#if defined(PLK_AMX)

namespace plk {

constexpr int64_t kAmxRowChunk = 128;
constexpr int64_t kAmxPrefetch = 2048;  // bytes ahead (8 KB and 16 KB: no faster)

// Rows [lo, hi) of one pass's accumulators (cbuf: [32 rows][32 channels] float32, rows from
// r0) written to y as bf16.
template <int T, bool Stream>
inline void write_rows(const float* cbuf, int64_t r0, int64_t lo, int64_t hi, int64_t n,
                       int64_t g, uint16_t* y) {
  for (int64_t r = lo; r < hi; ++r) {
    const float* c = cbuf + (r - r0) * 32;
    if constexpr (Stream && T == 2) {
      // The row's 32 channels are one 64-byte line of y (n % 32 == 0: aligned), written past
      // the caches: no read for ownership of an output larger than the caches.
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + 16), _mm512_loadu_ps(c));
      _mm512_stream_si512(reinterpret_cast<__m512i*>(y + r * n + g * 32), (__m512i)v);
    } else {
      for (int t = 0; t < T; ++t)
        store_row(y + r * n + (g * T + t) * kTile, _mm512_loadu_ps(c + t * 16));
    }
  }
}

// Channels [g * 16T, (g + 1) * 16T) of rows [r_begin, r_end) (multiples of 16: the row blocks
// of x, the last one, when m % 16 != 0, from `tail`, a zero-padded copy of its rows). w: the
// group's packed stream, T tiles per K block. cbuf: two [32][32] float32 buffers. Stream: y
// written past the caches (write_rows).
//
// A pass's results are written to y during the next pass's K loop, a few rows per K block:
// written after the loop, the core converted while the tiles sat idle (1.1x at K = 576, 2,048
// rows). Tried and slower at 2,048 rows: x copied into contiguous A tiles first (the copy cost
// more than the strided tile loads), prefetching the next A tiles into L1 (1.1x), K in slices
// of 8 blocks with the accumulators kept in memory between slices (1.1x).
template <int T, bool Stream>
void amx_bf16_group(const uint16_t* x, const uint16_t* tail, int64_t k, const uint16_t* w,
                    int64_t n, int64_t g, int64_t m, int64_t r_begin, int64_t r_end, uint16_t* y,
                    float* cbuf) {
  const int64_t kb_count = k / kGroup;
  constexpr int64_t kTileElems = 16 * 32;  // one B tile: 16 input pairs x 16 channels x 2
  const bool stream = r_end - r_begin <= 32;  // decode: the weights come from DRAM once
  const int64_t full_blocks = m < 16 ? 1 : m / 16;  // fewer rows: one block of m-row tiles
  // Row block rb's K block kb.
  auto a_tile = [&](int64_t rb, int64_t kb) -> const uint16_t* {
    return (rb < full_blocks ? x + rb * 16 * k : tail) + kb * kGroup;
  };
  // The previous pass, still to write: its buffer, first row, and rows [done, end).
  const float* prev = nullptr;
  int64_t prev_r0 = 0, done = 0, prev_end = 0;
  const int64_t per_kb = (32 + kb_count - 1) / kb_count;
  for (int64_t r0 = r_begin, pass = 0; r0 < r_end; r0 += 32, ++pass) {
    const bool rows2 = r0 + 16 < r_end;
    float* out = cbuf + (pass & 1) * 32 * 32;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const uint16_t* b = w + kb * T * kTileElems;
      if (stream)
        for (int line = 0; line < T * 16; ++line)  // 1 KB per tile: 16 lines, 1 KB ahead
          prefetch(reinterpret_cast<const char*>(b) + kAmxPrefetch + line * 64);
      _tile_loadd(4, a_tile(r0 / 16, kb), k * 2);
      _tile_loadd(6, b, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (T == 2) {
        _tile_loadd(7, b + kTileElems, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (rows2) {
        _tile_loadd(5, a_tile(r0 / 16 + 1, kb), k * 2);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (T == 2) _tile_dpbf16ps(3, 5, 7);
      }
      if (prev != nullptr && done < prev_end) {
        const int64_t hi = done + per_kb < prev_end ? done + per_kb : prev_end;
        write_rows<T, Stream>(prev, prev_r0, done, hi, n, g, y);
        done = hi;
      }
    }
    if (prev != nullptr) write_rows<T, Stream>(prev, prev_r0, done, prev_end, n, g, y);
    _tile_stored(0, out, 128);
    if constexpr (T == 2) _tile_stored(1, out + 16, 128);
    if (rows2) {
      _tile_stored(2, out + 16 * 32, 128);
      if constexpr (T == 2) _tile_stored(3, out + 16 * 32 + 16, 128);
    }
    prev = out;
    prev_r0 = done = r0;
    prev_end = r0 + 32 < m ? r0 + 32 : m;
  }
  if (prev != nullptr) write_rows<T, Stream>(prev, prev_r0, done, prev_end, n, g, y);
}

}  // namespace plk

#endif  // PLK_AMX
