// The vector Q K^T and P V of the decode kernel (cpu_paged_attention.cpp) over float and bf16
// caches: AVX-512 (16 lanes; AVX512-BF16 dot products on bf16 where the CPU has them) or, on
// CPUs without AVX-512, AVX2 (cpu_attention_avx2.h), behind one qk_vec / pv_vec per build.
// Included by that one file only (a header to keep each file short).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_attention_common.h"

namespace poise_attention {

#if defined(__AVX512F__)
// AVX-512 version for head_dim = 16 * NV: the NQ query rows and the accumulators stay in
// registers for the whole loop over keys (NQ * NV + NV + NQ <= 32 zmm registers).
//
// Dot products of NQ query rows with one key: NQ vectors of 16 partial sums each.
// float keys (or bf16 widened to float): NV fused multiply-adds per query row. With AVX512-BF16
// and bf16 keys: NV / 2 dpbf16 instructions on the raw bf16 q and k (no widening), the scale
// applied to the summed score instead of to q.
template <typename T, int NV, int NQ>
struct QKRows {
#if defined(__AVX512BF16__)
  static constexpr bool kNativeBf16 = std::is_same_v<T, bf16> && NV % 2 == 0;
#else
  static constexpr bool kNativeBf16 = false;
#endif
  static constexpr int kRegs = kNativeBf16 ? NV / 2 : NV;
  __m512 q[NQ][kRegs];
  float post_scale;

  QKRows(const float* q_f, const T* q_raw, float scale) {
    if constexpr (kNativeBf16) {
      for (int i = 0; i < NQ; ++i)
        for (int v = 0; v < kRegs; ++v)
          q[i][v] = _mm512_castsi512_ps(_mm512_loadu_si512(q_raw + (i * NV + 2 * v) * 16));
      post_scale = scale;
    } else {
      (void)q_raw;
      for (int i = 0; i < NQ; ++i)
        for (int v = 0; v < NV; ++v) q[i][v] = _mm512_loadu_ps(q_f + (i * NV + v) * 16);
      post_scale = 1.0f;  // q_f is pre-scaled
    }
  }

  inline void partials(const T* k, __m512* out) const {
    if constexpr (kNativeBf16) {
#if defined(__AVX512BF16__)
      __m512bh kv[kRegs];
      for (int v = 0; v < kRegs; ++v)
        kv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + v * 32));
      for (int i = 0; i < NQ; ++i) {
        __m512 a = _mm512_setzero_ps();
        for (int v = 0; v < kRegs; ++v)
          a = _mm512_dpbf16_ps(a, reinterpret_cast<__m512bh>(q[i][v]), kv[v]);
        out[i] = a;
      }
#endif
    } else {
      __m512 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load16(k + v * 16);
      for (int i = 0; i < NQ; ++i) {
        __m512 a = _mm512_mul_ps(q[i][0], kv[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(q[i][v], kv[v], a);
        out[i] = a;
      }
    }
  }
};

// Scores of keys j0 .. n - 1 (j0 a multiple of 4: keys go in fours from the first, the last
// n % 4 of the row one by one, so a row's scores are the same bits in one call or in blocks).
template <typename T, int NV, int NQ>
void qk_avx512(const float* q_f, const T* q_raw, float scale, const T* const* slots, int n,
               int64_t k_offset, float* scores, int scores_stride, int j0 = 0) {
  const QKRows<T, NV, NQ> rows(q_f, q_raw, scale);
  const __m128 post = _mm_set1_ps(rows.post_scale);
  int j = j0;
  for (; j + 4 <= n; j += 4) {
    __m512 a[4][NQ];
    for (int t = 0; t < 4; ++t) rows.partials(slots[j + t] + k_offset, a[t]);
    for (int i = 0; i < NQ; ++i)
      _mm_storeu_ps(scores + i * scores_stride + j,
                    _mm_mul_ps(hsum4(a[0][i], a[1][i], a[2][i], a[3][i]), post));
  }
  for (; j < n; ++j) {
    __m512 a[NQ];
    rows.partials(slots[j] + k_offset, a);
    for (int i = 0; i < NQ; ++i)
      scores[i * scores_stride + j] = _mm512_reduce_add_ps(a[i]) * rows.post_scale;
  }
}

#if defined(__AVX512BF16__)
// P V on bf16 values with AVX512-BF16: two keys per vdpbf16ps, as the prefill kernel's PAIRS
// path does, instead of widening every value to float for one multiply-add per key. P is
// rounded to bf16 first (as torch's flash attention and transformers' eager attention round the
// probabilities to the values' dtype); the sums stay float. Key pairs start at j0 (a partition
// or block start: even), a lone last key paired with a zero weight and a zero row, so a row's
// sums do not depend on how its keys were grouped. Measured (Zen 4, the seed mix's 135M shape
// at concurrency 32): P V was 13 % of a decode step, half of it in the widening loads; the
// step's decode attention went from 20.5-22.2 to 17.6-19.1 ms (RESULTS.md).
//
// Lanes: a value chunk of 32 dims from keys x and y, interleaved per 128-bit lane by
// unpacklo / unpackhi_epi16, gives pair vectors whose lane t holds dim 8 (t / 4) + t % 4 (lo)
// or that + 4 (hi); acc is kept in that order inside the loop and in dim order in memory.
template <int NV, int NQ>
void pv_bf16_pairs(const float* weights, int weights_stride, const bf16* const* slots, int n,
                   int64_t v_offset, float* acc, int j0, bool more) {
  static_assert(NV % 2 == 0, "whole 32-dim chunks");
  constexpr int NC = NV / 2;
  alignas(64) static const bf16 zeros[NV * 16] = {};
  // [dims 0-15 | dims 16-31] of a chunk <-> [lo | hi] pair lanes (permutex2var indices).
  const __m512i to_lo =
      _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i to_hi =
      _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i from_0 =
      _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i from_1 =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  __m512 a[NQ][NV];  // [i][2c]: chunk c's lo lanes, [i][2c + 1]: its hi lanes
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NC; ++c) {
      if (more) {
        const __m512 d0 = _mm512_loadu_ps(acc + (i * NV + 2 * c) * 16);
        const __m512 d1 = _mm512_loadu_ps(acc + (i * NV + 2 * c + 1) * 16);
        a[i][2 * c] = _mm512_permutex2var_ps(d0, to_lo, d1);
        a[i][2 * c + 1] = _mm512_permutex2var_ps(d0, to_hi, d1);
      } else {
        a[i][2 * c] = a[i][2 * c + 1] = _mm512_setzero_ps();
      }
    }
  alignas(64) uint32_t pairs[NQ][16];  // per head, keys (2t, 2t + 1) of the chunk as bf16
  for (int j = j0; j < n; j += 32) {
    const int m = std::min(32, n - j);
    const __mmask16 k0 = m >= 16 ? __mmask16(0xffff) : __mmask16((1u << m) - 1);
    const __mmask16 k1 =
        m >= 32 ? __mmask16(0xffff) : m > 16 ? __mmask16((1u << (m - 16)) - 1) : __mmask16(0);
    for (int i = 0; i < NQ; ++i) {
      const float* w = weights + i * weights_stride + j;
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(k1, w + 16),
                                             _mm512_maskz_loadu_ps(k0, w));
      _mm512_store_si512(pairs[i], reinterpret_cast<__m512i>(b));
    }
    for (int t = 0; 2 * t < m; ++t) {
      const bf16* x = slots[j + 2 * t] + v_offset;
      const bf16* y = 2 * t + 1 < m ? slots[j + 2 * t + 1] + v_offset : zeros;
      __m512i lo[NC], hi[NC];
      for (int c = 0; c < NC; ++c) {
        const __m512i xv = _mm512_loadu_si512(x + 32 * c), yv = _mm512_loadu_si512(y + 32 * c);
        lo[c] = _mm512_unpacklo_epi16(xv, yv);
        hi[c] = _mm512_unpackhi_epi16(xv, yv);
      }
      for (int i = 0; i < NQ; ++i) {
        const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairs[i][t]));
        for (int c = 0; c < NC; ++c) {
          a[i][2 * c] = _mm512_dpbf16_ps(a[i][2 * c], w, reinterpret_cast<__m512bh>(lo[c]));
          a[i][2 * c + 1] =
              _mm512_dpbf16_ps(a[i][2 * c + 1], w, reinterpret_cast<__m512bh>(hi[c]));
        }
      }
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NC; ++c) {
      _mm512_storeu_ps(acc + (i * NV + 2 * c) * 16,
                       _mm512_permutex2var_ps(a[i][2 * c], from_0, a[i][2 * c + 1]));
      _mm512_storeu_ps(acc + (i * NV + 2 * c + 1) * 16,
                       _mm512_permutex2var_ps(a[i][2 * c], from_1, a[i][2 * c + 1]));
    }
}
#endif

#endif

#if defined(__AVX512F__) || defined(POISE_ATTENTION_AVX2)
#define POISE_DECODE_VECTORS 1
// The vector kernels of this build, AVX-512 (16 lanes) or AVX2 (8 lanes), for NQ heads of
// head_dim HD, and whether they take NQ heads at once.
template <int HD, int NQ>
constexpr bool vector_heads() {
#if defined(__AVX512F__)
  return fits_registers<HD, NQ>();
#else
  return avx2_heads<HD, NQ>();
#endif
}

template <typename T, int HD, int NQ>
inline void qk_vec(const float* q_f, const T* q_raw, float scale, const T* const* slots, int n,
                   int64_t k_offset, float* scores, int scores_stride, int j0 = 0) {
#if defined(__AVX512F__)
  qk_avx512<T, HD / 16, NQ>(q_f, q_raw, scale, slots, n, k_offset, scores, scores_stride, j0);
#else
  (void)q_raw;
  (void)scale;  // q_f is pre-scaled
  qk_avx2<T, HD, NQ>(q_f, slots, n, k_offset, [](int) { return 1.0f; }, scores, scores_stride,
                     j0);
#endif
}

template <typename T, int HD, int NQ>
inline void pv_vec(const float* weights, int weights_stride, const T* const* slots, int n,
                   int64_t v_offset, float* acc, int j0 = 0, bool more = false) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && HD % 32 == 0) {
    pv_bf16_pairs<HD / 16, NQ>(weights, weights_stride, slots, n, v_offset, acc, j0, more);
    return;
  }
#endif
  pv_avx512<T, HD / 16, NQ>(weights, weights_stride, slots, n, v_offset,
                            [](int) { return 1.0f; }, acc, j0, more);
#else
  pv_avx2<T, HD, NQ>(weights, weights_stride, slots, n, v_offset, [](int) { return 1.0f; }, acc,
                     j0, more);
#endif
}
#endif

}  // namespace poise_attention
