// bf16 weights as the checkpoint stores them, [N, K] row-major (cpu_linear.cpp), for few rows
// of x: each output channel is a dot product along K, 32 inputs per vdpbf16ps, C channels x R
// rows of accumulators reduced at the end. No packed copy: at more rows torch's GEMM (oneDNN,
// AMX here) runs on the same tensor, so the weights are held once.
#pragma once

#include "cpu_linear_common.h"

namespace plk {

template <int R, int C>
void dot_bf16(const uint16_t* x, int64_t k, const uint16_t* w, int64_t n, int64_t c0,
              uint16_t* y, int64_t r0) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m512bh wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const uint16_t* row = w + (c0 + c) * k + i;
      prefetch(row + kPrefetch / 2);
      wv[c] = (__m512bh)_mm512_loadu_si512(row);
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

// Channels [c0, c0 + 8) (or fewer at the end) for every row, in blocks of up to 4 rows.
inline void dot_bf16_block(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w,
                           int64_t n, int64_t c0, uint16_t* y) {
  const bool full = c0 + 8 <= n;
  for (int64_t r0 = 0; r0 < m;) {
    const int64_t rows = m - r0 >= 2 ? 2 : 1;
    if (full) {
      if (rows == 2) dot_bf16<2, 8>(x, k, w, n, c0, y, r0);
      else dot_bf16<1, 8>(x, k, w, n, c0, y, r0);
    } else {
      for (int64_t c = c0; c < n; ++c) {
        if (rows == 2) dot_bf16<2, 1>(x, k, w, n, c, y, r0);
        else dot_bf16<1, 1>(x, k, w, n, c, y, r0);
      }
    }
    r0 += rows;
  }
}

}  // namespace plk
