// The prefill kernel's block math on AVX2 + FMA (no AVX-512), 8 rows per vector: Q K^T, the
// online softmax step and P V of cpu_prefill_blocks.h, which calls these where the build has
// AVX2 but not AVX-512 and head_dim is 64 or 128 (templates over its Scratch and Packed).
// Keys are packed as float there (pack_rows), so a key element is one broadcast load; on the
// plain loops (every accumulator in memory) the embedded model's cold 3,363-token prompt spent
// 11.2 of its 18.9 s in attention on a Zen 3.
#pragma once

#include "cpu_attention_common.h"

#if defined(POISE_ATTENTION_AVX2)
#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace poise_prefill_avx2 {

using namespace poise_attention;

// Keys per Q K^T tile (x 2 vectors of 8 rows: 8 accumulators, 2 q vectors, a broadcast), rows
// per P V tile (x 4 vectors of head dims: 8 accumulators, 4 values, 2 broadcasts).
constexpr int kQkKeys = 4;
constexpr int kPvRows = 2;
constexpr int kPvVectors = 4;

// st[j][r] = scale * q_r . k_j for NJ keys from j0 and 16 rows from r0: qt [hd][rp] (float),
// k [n][HD] float (packed so).
template <int HD, int NJ, typename W>
inline void qk_tile(W& w, const float* k, int rp, int r0, int j0, float scale) {
  const float* qsrc = w.qt.data() + r0;
  k += j0 * HD;
  __m256 acc[NJ][2];
  for (int t = 0; t < NJ; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int d = 0; d < HD; ++d) {
    const __m256 q0 = _mm256_loadu_ps(qsrc + d * rp), q1 = _mm256_loadu_ps(qsrc + d * rp + 8);
    for (int t = 0; t < NJ; ++t) {
      const __m256 b = _mm256_broadcast_ss(k + t * HD + d);
      acc[t][0] = _mm256_fmadd_ps(b, q0, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(b, q1, acc[t][1]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int t = 0; t < NJ; ++t)
    for (int v = 0; v < 2; ++v)
      _mm256_storeu_ps(&w.st[(j0 + t) * rp + r0 + 8 * v], _mm256_mul_ps(acc[t][v], sc));
}

// Every row (rp: a multiple of 16) against the block's n keys.
template <int HD, typename W>
void scores(W& w, const float* k, int rp, int n, float scale) {
  for (int r = 0; r < rp; r += 16) {
    int j = 0;
    for (; j + kQkKeys <= n; j += kQkKeys) qk_tile<HD, kQkKeys>(w, k, rp, r, j, scale);
    for (; j < n; ++j) qk_tile<HD, 1>(w, k, rp, r, j, scale);
  }
}

// All lanes where key j is visible to the 8 rows at pos (j < n, and j <= pos where MASKED).
template <bool MASKED>
inline __m256 visible(__m256i pos, int j, int n) {
  if (j >= n) return _mm256_setzero_ps();
  if constexpr (MASKED)
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, _mm256_set1_epi32(j - 1)));
  return _mm256_castsi256_ps(_mm256_set1_epi32(-1));
}

// cpu_prefill_blocks.h's softmax_block on 8 rows per vector.
template <bool MASKED, typename W>
void softmax_block(W& w, int rp, int n, int n2) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < rp; r += 8) {
    const __m256i pos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&w.pos[r]));
    __m256 mx0 = ninf, mx1 = ninf;
    for (int j = 0; j < n2; j += 2) {
      mx0 = _mm256_max_ps(mx0, _mm256_blendv_ps(ninf, _mm256_loadu_ps(&w.st[j * rp + r]),
                                                visible<MASKED>(pos, j, n)));
      mx1 = _mm256_max_ps(mx1, _mm256_blendv_ps(ninf, _mm256_loadu_ps(&w.st[(j + 1) * rp + r]),
                                                visible<MASKED>(pos, j + 1, n)));
    }
    const __m256 m_old = _mm256_loadu_ps(&w.m[r]);
    const __m256 m_new = _mm256_max_ps(m_old, _mm256_max_ps(mx0, mx1));  // key 0: visible
    const __m256 corr = exp_nonpositive8(_mm256_sub_ps(m_old, m_new));
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < n2; ++j) {
      float* s = &w.st[j * rp + r];
      const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s), m_new)),
                                     visible<MASKED>(pos, j, n));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(s, e);
    }
    _mm256_storeu_ps(&w.m[r], m_new);
    _mm256_storeu_ps(&w.l[r], _mm256_fmadd_ps(_mm256_loadu_ps(&w.l[r]), corr, sum));
    _mm256_storeu_ps(&w.corr[r], corr);
  }
}

// O[r] = O[r] * corr[r] + sum_j P[j][r] V[j] for kPvRows rows from r0, head dims in chunks of
// kPvVectors vectors; V [n][HD] float.
template <int HD, typename W>
inline void pv_rows(W& w, const float* v, int rp, int r0, int n) {
  constexpr int C = kPvVectors;
  static_assert(HD % (8 * C) == 0);
  for (int c0 = 0; c0 < HD; c0 += 8 * C) {
    __m256 acc[kPvRows][C];
    for (int i = 0; i < kPvRows; ++i) {
      const __m256 c = _mm256_set1_ps(w.corr[r0 + i]);
      for (int u = 0; u < C; ++u)
        acc[i][u] = _mm256_mul_ps(_mm256_loadu_ps(&w.o[(r0 + i) * HD + c0 + 8 * u]), c);
    }
    for (int j = 0; j < n; ++j) {
      __m256 vv[C];
      for (int u = 0; u < C; ++u) vv[u] = _mm256_loadu_ps(v + j * HD + c0 + 8 * u);
      for (int i = 0; i < kPvRows; ++i) {
        const __m256 p = _mm256_broadcast_ss(&w.st[j * rp + r0 + i]);
        for (int u = 0; u < C; ++u) acc[i][u] = _mm256_fmadd_ps(p, vv[u], acc[i][u]);
      }
    }
    for (int i = 0; i < kPvRows; ++i)
      for (int u = 0; u < C; ++u) _mm256_storeu_ps(&w.o[(r0 + i) * HD + c0 + 8 * u], acc[i][u]);
  }
}

// ROUND (bf16 inputs): P rounded to bf16 first, as P V takes it (like_t); l has the floats.
template <int HD, bool ROUND, typename W>
void accumulate(W& w, const float* v, int rp, int n) {
  if constexpr (ROUND)
    for (int j = 0; j < n; ++j)
      for (int r = 0; r < rp; r += 8) {
        float* s = &w.st[j * rp + r];
        _mm256_storeu_ps(s, round_bf16_8(_mm256_loadu_ps(s)));
      }
  for (int r0 = 0; r0 < rp; r0 += kPvRows) pv_rows<HD>(w, v, rp, r0, n);
}

}  // namespace poise_prefill_avx2

#endif
