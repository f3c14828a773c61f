// bf16 weights as the checkpoint stores them, [N, K] row-major (cpu_linear.cpp), for up to a
// few dozen rows of x (decode; where torch's GEMM has AMX, 1-2 rows): each output channel is a
// dot product along K, 32 inputs per vdpbf16ps, 4 channels x up to 4 rows of accumulators
// reduced at the end. No packed copy: at more rows torch's GEMM runs on the same tensor, so the
// weights are held once.
//
// Four channels' rows are one contiguous run of [N, K]; the next block's run is prefetched
// while this one is read, one line per weight load. The hardware prefetcher alone does not
// keep short rows in flight: SmolLM2-135M's layers (K = 576, 1.1 KB rows) on one core read at
// 13 GB/s with 8 channels and a prefetch inside each row, 24 GB/s this way (the core's
// streaming read: 25.5 GB/s; RESULTS.md "bf16 rows kernel").
#pragma once

#include "cpu_linear_common.h"

namespace plk {

constexpr int kBf16Channels = 4;  // channels per block
constexpr int kBf16Rows = 4;      // rows per block

// Rows [r0, r0 + R) x channels [c0, c0 + C); `ahead`: the next block's weights to prefetch
// (nullptr: none, for the passes that read this block again from cache), into L1 (Hint T0) or
// L2 (T1).
template <int R, int C, int Hint>
void dot_bf16(const uint16_t* x, int64_t k, const uint16_t* w, int64_t n, int64_t c0,
              uint16_t* y, int64_t r0, const uint16_t* ahead) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m512bh wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      if (ahead != nullptr)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + i * C + c * 32), static_cast<_mm_hint>(Hint));
      wv[c] = (__m512bh)_mm512_loadu_si512(w + (c0 + c) * k + i);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r0 + r) * k + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float v = _mm512_reduce_add_ps(acc[r][c]);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      // Round to nearest even, as vcvtneps2bf16 does (finite values).
      y[(r0 + r) * n + c0 + c] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
}

// Every row, in blocks of 4. Blocks of 1-3 rows prefetch into L1; 4-row blocks into L2: a
// 4-row pass keeps more lines in flight, and into L1 it ran at half the speed (one core,
// SmolLM2-135M's layers, 4 rows: 21.7 ms T0, 13.6 ms T1; 1 row: 9.4 ms T0, 12-18 ms T1).
template <int C>
void dot_bf16_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n,
                   int64_t c0, uint16_t* y, const uint16_t* ahead) {
  for (int64_t r0 = 0; r0 < m; r0 += kBf16Rows) {
    const uint16_t* pf = r0 == 0 ? ahead : nullptr;  // later row blocks read it from cache
    switch (m - r0 >= kBf16Rows ? kBf16Rows : m - r0) {
      case 4: dot_bf16<4, C, _MM_HINT_T1>(x, k, w, n, c0, y, r0, pf); break;
      case 3: dot_bf16<3, C, _MM_HINT_T0>(x, k, w, n, c0, y, r0, pf); break;
      case 2: dot_bf16<2, C, _MM_HINT_T0>(x, k, w, n, c0, y, r0, pf); break;
      default: dot_bf16<1, C, _MM_HINT_T0>(x, k, w, n, c0, y, r0, pf); break;
    }
  }
}

// Channels [c0, c0 + 4) (or fewer at the end) for every row.
inline void dot_bf16_block(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w,
                           int64_t n, int64_t c0, uint16_t* y) {
  constexpr int C = kBf16Channels;
  if (c0 + C <= n) {
    const uint16_t* ahead = c0 + 2 * C <= n ? w + (c0 + C) * k : nullptr;
    dot_bf16_rows<C>(x, m, k, w, n, c0, y, ahead);
  } else {
    for (int64_t c = c0; c < n; ++c) dot_bf16_rows<1>(x, m, k, w, n, c, y, nullptr);
  }
}

}  // namespace plk
