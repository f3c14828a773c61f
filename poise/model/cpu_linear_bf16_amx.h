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
// Layout: output channels in groups of 32 (two 16-channel tiles; 16 where N is not a multiple
// of 32), each group one sequential stream over K: per K block of 32, per tile, the B tile in
// VNNI order [16 input pairs][16 channels][2] (1 KB). Rows of x in blocks of 16 (an A tile;
// the last block from a zero-padded copy), two row blocks x two channel tiles per pass (four
// accumulators), rows in chunks of kAmxRowChunk that stay in L2 while the groups pass by.
// Decode (16 rows or fewer) reads each weight byte once, prefetched ahead of the tile loads.
#pragma once

#include "cpu_linear_common.h"

#if defined(PLK_AMX)

namespace plk {

constexpr int64_t kAmxRowChunk = 128;

// Channels [g * 16T, (g + 1) * 16T) of rows [r_begin, r_end) (multiples of 16 of the padded x).
// w: the group's packed stream, T tiles per K block.
template <int T>
void amx_bf16_group(const uint16_t* x, int64_t k, const uint16_t* w, int64_t n, int64_t g,
                    int64_t m, int64_t r_begin, int64_t r_end, uint16_t* y, float* cbuf) {
  const int64_t kb_count = k / kGroup;
  constexpr int64_t kTileElems = 16 * 32;  // one B tile: 16 input pairs x 16 channels x 2
  const bool stream = r_end - r_begin <= 32;  // decode: the weights come from DRAM once
  for (int64_t r0 = r_begin; r0 < r_end; r0 += 32) {
    const bool rows2 = r0 + 16 < r_end;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const uint16_t* b = w + kb * T * kTileElems;
      if (stream)
        for (int line = 0; line < T * 16; ++line)  // 1 KB per tile: 16 lines, 1 KB ahead
          prefetch(reinterpret_cast<const char*>(b) + kPrefetch + line * 64);
      const uint16_t* a = x + r0 * k + kb * kGroup;
      _tile_loadd(4, a, k * 2);
      _tile_loadd(6, b, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (T == 2) {
        _tile_loadd(7, b + kTileElems, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (rows2) {
        _tile_loadd(5, a + 16 * k, k * 2);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (T == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    // cbuf: [32 rows][32 channels] float32.
    _tile_stored(0, cbuf, 128);
    if constexpr (T == 2) _tile_stored(1, cbuf + 16, 128);
    if (rows2) {
      _tile_stored(2, cbuf + 16 * 32, 128);
      if constexpr (T == 2) _tile_stored(3, cbuf + 16 * 32 + 16, 128);
    }
    for (int t = 0; t < T; ++t) {
      const int64_t c0 = (g * T + t) * kTile;
      for (int64_t r = r0; r < r0 + 32 && r < m; ++r)
        store_row(y + r * n + c0, _mm512_loadu_ps(cbuf + (r - r0) * 32 + t * 16));
    }
  }
}

}  // namespace plk

#endif  // PLK_AMX
