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

// Lane i = the sum of v[i]'s 16 floats: pairs within 128-bit lanes, then across lanes, about 45
// instructions for 16 sums where 16 _mm512_reduce_add_ps take ~130 (a block's sums were ~30 %
// of its instructions at K = 576).
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v0 e0+e2, v1 e0+e2, v0 e1+e3, v1 e1+e3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum of 4 vectors, in order
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // lanes 0+1 and 2+3 of two groups of 4
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// sum16's first 4 lanes for 4 vectors, adding in the same order (so a row alone has the bits it
// has in a 16-sum block).
inline __m512 sum4(const __m512* v) {
  const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_ps(a0, a1, 0x44), _mm512_shuffle_ps(a0, a1, 0xEE));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b, b, 0x88), _mm512_shuffle_f32x4(b, b, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c, c, 0x88), _mm512_shuffle_f32x4(c, c, 0xDD));
}

// 16 floats to bf16, rounded to nearest even (finite values) as vcvtneps2bf16 does, but keeping
// denormals (the instruction flushes them).
inline __m256i round_bf16(__m512 s) {
  const __m512i bits = _mm512_castps_si512(s);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16));
}

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
        _mm_prefetch(reinterpret_cast<const char*>(ahead + i * C + c * 32),
                     static_cast<_mm_hint>(Hint));
      wv[c] = (__m512bh)_mm512_loadu_si512(w + (c0 + c) * k + i);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r0 + r) * k + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  // One transposed reduction for the block's R x C sums (zeros for the unused slots: adding
  // 0 changes no sum, so a row's bits are the same in a block of any size).
  constexpr int kSums = R * C <= 4 ? 4 : 16;
  __m512 v[kSums];
#pragma GCC unroll 16
  for (int i = 0; i < kSums; ++i) v[i] = i < R * C ? acc[i / C][i % C] : _mm512_setzero_ps();
  alignas(32) uint16_t out[16];
  __m512 sums;
  if constexpr (kSums == 4) sums = sum4(v);
  else sums = sum16(v);
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), round_bf16(sums));
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 4) {  // a row's 4 channels: one 8-byte store
      std::memcpy(y + (r0 + r) * n + c0, out + r * 4, 8);
    } else {
      for (int c = 0; c < C; ++c) y[(r0 + r) * n + c0 + c] = out[r * C + c];
    }
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
