// The AVX2 + FMA vectors of the CPU kernels (no AVX-512: Zen 2 / 3, Intel client cores, many
// cloud instances), 8 float lanes: loads widened to float, e^x by exp_nonpositive's polynomial,
// horizontal sums. Included by cpu_attention_common.h where __AVX512F__ is not defined; the
// attention kernels (decode, prefill) and cpu_elementwise.cpp use them.
//
// Why not the plain loops the compiler vectorises: they keep every accumulator in memory (a
// load and a store per multiply-add) and take one horizontal sum per key and head; on Zen 3
// the decode attention of SmolLM2-1.7B at 16 rows ran at several times its KV read there.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define POISE_ATTENTION_AVX2 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace poise_attention {

// 8 values widened to float (bf16: the bits shifted into a float's high half; int8: exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 floats -> bf16, round to nearest even (finite values).
inline __m128i to_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(up, up), 0xD8);
  return _mm256_castsi256_si128(packed);
}

// x rounded to bf16 (nearest even), as a float: to_bf16_8's value, widened back.
inline __m256 round_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

// The polynomial of exp_nonpositive for r = x - n ln2 (n = round(x / ln2)), before 2^n.
inline __m256 exp_poly8(__m256 x, __m256& n) {
  n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  return _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
}

// 2^n for integral n in [-126, 127], as float bits.
inline __m256 pow2_8(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

// exp_nonpositive on 8 lanes: the same clamp (so n >= -126) and the same values.
inline __m256 exp_nonpositive8(__m256 x) {
  __m256 n;
  const __m256 p = exp_poly8(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), n);
  return _mm256_mul_ps(p, pow2_8(n));
}

// e^x on 8 lanes, the same values as the AVX-512 exp16 wherever 1 + e^x is what is used (SiLU):
// below -87 both are under 2^-24 (1 + e^x = 1); up to n = 128, p * 2^(n-1) * 2 is scalef's
// exact product (or its overflow), and from n = 129 on the result is +inf, as there.
inline __m256 exp8(__m256 x) {
  __m256 n;
  const __m256 p = exp_poly8(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), n);
  const __m256 half_scale = pow2_8(_mm256_sub_ps(_mm256_min_ps(n, _mm256_set1_ps(128.0f)),
                                                 _mm256_set1_ps(1.0f)));
  const __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, half_scale), _mm256_set1_ps(2.0f));
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  return _mm256_blendv_ps(e, inf, _mm256_cmp_ps(n, _mm256_set1_ps(128.0f), _CMP_GT_OQ));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)] of four 8-lane vectors.
inline __m128 hsum4_8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s01 = _mm256_hadd_ps(a0, a1);  // per 128-bit half: a0 pairs, a1 pairs
  const __m256 s23 = _mm256_hadd_ps(a2, a3);
  const __m256 s = _mm256_hadd_ps(s01, s23);  // per half: [a0, a1, a2, a3] partial sums
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// sum(a) in hsum4_8's order, so that a key's score is the same bits alone or in a four.
inline float hsum8(__m256 a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, a), a);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

inline float hmax8(__m256 a) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// Lanes [0, count) set, count in [0, 8]: the tail of a row of floats.
inline __m256i tail_mask8(int count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes);
}

// Keys ahead whose rows the decode kernels below prefetch: a key's row of one head is 2-4 cache
// lines at a slot stride of 1-8 KB, in scattered blocks, which the hardware prefetcher does not
// follow; without it Q K^T waited on each key's first load (most of its samples there).
constexpr int kPrefetchKeys = 8;

template <typename T, int HD>
inline void prefetch_row(const T* row) {
  constexpr int kLines = (HD * static_cast<int>(sizeof(T)) + 63) / 64;
  for (int l = 0; l < kLines; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(row) + 64 * l, _MM_HINT_T0);
}

// Whether the vector decode kernels below take NQ query heads of head_dim HD at once: their
// accumulators (8, 8 or 6 for Q K^T, NQ heads x 8 / NQ vectors of values for P V), a key's or
// value's vector and the broadcasts fit the 16 registers.
template <int HD, int NQ>
constexpr bool avx2_heads() {
  return HD > 0 && HD % 8 == 0 && NQ >= 1 && NQ <= 4;
}

// pv_avx512's sums on 8 lanes, head dims in chunks of 8 / NQ vectors (one pass over the keys
// per chunk): every output element is the same chain of multiply-adds over the keys in order,
// so the bits are pv_avx512's for the same weights.
template <typename T, int HD, int NQ, typename VScale>
void pv_avx2(const float* weights, int weights_stride, const T* const* slots, int n,
             int64_t v_offset, VScale v_scale, float* acc, int j0 = 0, bool more = false) {
  constexpr int NV = HD / 8, C = NV < 8 / NQ ? NV : 8 / NQ;
  static_assert(NV % C == 0);
  for (int c0 = 0; c0 < NV; c0 += C) {
    __m256 a[NQ][C];
    for (int i = 0; i < NQ; ++i)
      for (int v = 0; v < C; ++v)
        a[i][v] = more ? _mm256_loadu_ps(acc + i * HD + (c0 + v) * 8) : _mm256_setzero_ps();
    for (int j = j0; j < n; ++j) {
      if (c0 == 0 && j + kPrefetchKeys < n) prefetch_row<T, HD>(slots[j + kPrefetchKeys] + v_offset);
      const T* vrow = slots[j] + v_offset + c0 * 8;
      __m256 w[NQ];
      for (int i = 0; i < NQ; ++i)
        w[i] = _mm256_set1_ps(weights[i * weights_stride + j] * v_scale(j));
      for (int v = 0; v < C; ++v) {
        const __m256 vv = load8(vrow + v * 8);
        for (int i = 0; i < NQ; ++i) a[i][v] = _mm256_fmadd_ps(w[i], vv, a[i][v]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int v = 0; v < C; ++v) _mm256_storeu_ps(acc + i * HD + (c0 + v) * 8, a[i][v]);
  }
}

// Scores of NQ query heads (q_f: pre-scaled float rows) against keys j0 .. n - 1, KEYS keys
// at a time (8 or 6 independent sums in flight), the rest one by one: every key's score is the
// same bits in any grouping (one chain per lane over the head dims, then hsum4_8's order).
// More heads per call read a key's vectors fewer times (their widening costs as much as the
// multiply-adds). k_scale(j): the key's int8 scale, 1 for float and bf16 caches.
template <typename T, int HD, int NQ, typename KScale>
void qk_avx2(const float* q_f, const T* const* slots, int n, int64_t k_offset, KScale k_scale,
             float* scores, int scores_stride, int j0 = 0) {
  constexpr int NV = HD / 8, KEYS = NQ == 1 ? 8 : NQ == 2 ? 4 : 2;
  int j = j0;
  for (int t = j; t < std::min(n, j + kPrefetchKeys); ++t)
    prefetch_row<T, HD>(slots[t] + k_offset);
  for (; j + KEYS <= n; j += KEYS) {
    for (int t = j + kPrefetchKeys; t < std::min(n, j + kPrefetchKeys + KEYS); ++t)
      prefetch_row<T, HD>(slots[t] + k_offset);
    __m256 a[KEYS][NQ];
    for (int t = 0; t < KEYS; ++t)
      for (int i = 0; i < NQ; ++i) a[t][i] = _mm256_setzero_ps();
    for (int v = 0; v < NV; ++v)
      for (int t = 0; t < KEYS; ++t) {
        const __m256 k = load8(slots[j + t] + k_offset + v * 8);
        for (int i = 0; i < NQ; ++i)
          a[t][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q_f + i * HD + v * 8), k, a[t][i]);
      }
    if constexpr (KEYS >= 4) {  // four keys of one head per sum
      for (int i = 0; i < NQ; ++i)
        for (int t = 0; t < KEYS; t += 4) {
          const __m128 s = hsum4_8(a[t][i], a[t + 1][i], a[t + 2][i], a[t + 3][i]);
          const __m128 ks = _mm_setr_ps(k_scale(j + t), k_scale(j + t + 1), k_scale(j + t + 2),
                                        k_scale(j + t + 3));
          _mm_storeu_ps(scores + i * scores_stride + j + t, _mm_mul_ps(s, ks));
        }
    } else {  // up to four heads of one key per sum
      for (int t = 0; t < KEYS; ++t) {
        alignas(16) float s[4];
        _mm_store_ps(s, hsum4_8(a[t][0], a[t][std::min(1, NQ - 1)], a[t][std::min(2, NQ - 1)],
                                a[t][std::min(3, NQ - 1)]));
        for (int i = 0; i < NQ; ++i) scores[i * scores_stride + j + t] = s[i] * k_scale(j + t);
      }
    }
  }
  for (; j < n; ++j) {
    __m256 a[NQ];
    for (int i = 0; i < NQ; ++i) a[i] = _mm256_setzero_ps();
    for (int v = 0; v < NV; ++v) {
      const __m256 k = load8(slots[j] + k_offset + v * 8);
      for (int i = 0; i < NQ; ++i)
        a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q_f + i * HD + v * 8), k, a[i]);
    }
    for (int i = 0; i < NQ; ++i) scores[i * scores_stride + j] = hsum8(a[i]) * k_scale(j);
  }
}

}  // namespace poise_attention

#endif
