// AVX2 + FMA linear kernels (cpu_linear_avx2.cpp) for CPUs without AVX-512 (AMD Zen 2 / 3,
// Intel client cores): the vector helpers and bf16 weights as stored.
//
// bf16 rows: each output channel is a dot product along K in float32, 16 inputs per step: the
// 16 bf16 weights and inputs widened to two float32 vectors each by interleaving with zeros
// (elements 0-3 and 8-11, then 4-7 and 12-15: the same order for both, so products pair up),
// then two FMAs per row. 4 channels x up to 2 rows of accumulators (16 vector registers), one
// horizontal reduction per block, in the same order whatever the block: a row's output is the
// same bits at any row count, as on AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_linear_problem.h"

namespace plk2 {

using plk::Problem;

constexpr int kBf16Channels = 4;  // channels per block
constexpr int kBf16Rows = 2;      // rows per block (register budget: 8 sums, 4 x, 2 weights)

// 8 bf16 to float32.
inline __m256 bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// 16 bf16 as two float32 vectors, elements [0-3, 8-11] and [4-7, 12-15].
inline void bf16x16(const uint16_t* p, __m256* lo, __m256* hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

// 8 floats to bf16 at y, rounded to nearest even (finite values), denormals kept.
inline void store_bf16x8(uint16_t* y, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  // packus works per 128-bit lane ([u0-3, u0-3 | u4-7, u4-7]); the permute gathers u0-7.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(up, up), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_castsi256_si128(packed));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// The 8-lane sums of four vectors as [s0, s1, s2, s3], always in this order.
inline __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// 4 floats to bf16 (the low half of store_bf16x8's result), c of them to y.
inline void store_bf16x4(uint16_t* y, __m128 v, int c) {
  alignas(16) uint16_t out[8];
  store_bf16x8(out, _mm256_castps128_ps256(v));
  std::memcpy(y, out, 2 * c);
}

// Rows [r0, r0 + R) x channels [c0, c0 + C); `ahead`: the next block's weights to prefetch
// (nullptr: none, for the row blocks that read this block again from cache).
template <int R, int C>
void dot_bf16(const uint16_t* x, int64_t k, const uint16_t* w, int64_t n, int64_t c0,
              uint16_t* y, int64_t r0, const uint16_t* ahead) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    __m256 xl[R], xh[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) bf16x16(x + (r0 + r) * k + i, &xl[r], &xh[r]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      if (ahead != nullptr && (i & 31) == 0)  // one line (32 weights) per channel and 32 inputs
        _mm_prefetch(reinterpret_cast<const char*>(ahead + i * C + c * 32), _MM_HINT_T0);
      __m256 wl, wh;
      bf16x16(w + (c0 + c) * k + i, &wl, &wh);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_fmadd_ps(wl, xl[r], acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(wh, xh[r], acc[r][c]);
      }
    }
  }
  const __m256 z = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    // Zeros for the missing channels: adding 0 changes no sum, so a tail channel has the bits
    // it would have in a full block.
    const __m128 s = sum4x8(acc[r][0], C > 1 ? acc[r][C > 1 ? 1 : 0] : z,
                            C > 2 ? acc[r][C > 2 ? 2 : 0] : z, C > 3 ? acc[r][C > 3 ? 3 : 0] : z);
    store_bf16x4(y + (r0 + r) * n + c0, s, C);
  }
}

// Every row, in blocks of 2, against channels [c0, c0 + C).
template <int C>
void dot_bf16_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n,
                   int64_t c0, uint16_t* y, const uint16_t* ahead) {
  for (int64_t r0 = 0; r0 < m; r0 += kBf16Rows) {
    const uint16_t* pf = r0 == 0 ? ahead : nullptr;  // later row blocks read it from cache
    if (m - r0 >= 2) dot_bf16<2, C>(x, k, w, n, c0, y, r0, pf);
    else dot_bf16<1, C>(x, k, w, n, c0, y, r0, pf);
  }
}

// Channels [c0, c0 + 4) (or fewer at the end) for every row.
inline void dot_bf16_block(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w,
                           int64_t n, int64_t c0, uint16_t* y) {
  constexpr int C = kBf16Channels;
  if (c0 + C <= n) {
    const uint16_t* ahead = c0 + 2 * C <= n ? w + (c0 + C) * k : nullptr;
    dot_bf16_rows<C>(x, m, k, w, n, c0, y, ahead);
    return;
  }
  switch (n - c0) {
    case 3: dot_bf16_rows<3>(x, m, k, w, n, c0, y, nullptr); break;
    case 2: dot_bf16_rows<2>(x, m, k, w, n, c0, y, nullptr); break;
    default: dot_bf16_rows<1>(x, m, k, w, n, c0, y, nullptr); break;
  }
}

}  // namespace plk2
