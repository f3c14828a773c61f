// Numerics shared by the CPU attention kernels (cpu_paged_attention.cpp: decode rows,
// cpu_prefill_attention.cpp: blocked prefill): bfloat16 <-> float and exp on the softmax's
// non-positive arguments, scalar and on 16 AVX-512 lanes. Header-only: the build
// (cpu_kernel.py) compiles both .cpp files into one library.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "cpu_attention_avx2.h"  // the AVX2 vectors where there is no AVX-512

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace poise_attention {

using bf16 = uint16_t;

inline float to_float(float x) { return x; }

// A decode call's arguments (poise_paged_attention, poise_paged_attention_int8): KV is the
// cache's element type as the kernel reads it.
template <typename KV>
struct DecodeProblem {
  const void* q;
  int64_t q_token_stride;
  const KV* kv_cache;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* row_table;
  const int64_t* row_token;
  const int64_t* context_len;
  int num_rows, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  void* out;
  int64_t out_token_stride;
  int partition_size;
};

// Query-key products (keys x heads x head dims) from which a decode call is split over the
// threads. Below it the call is ~50 us or less and a worker woken for it (OMP_WAIT_POLICY=
// PASSIVE) starts late enough to lose the gain: SmolLM2-1.7B at batch 1, context 64, spent
// 7.0 ms of a step in attention over 2 threads, 3.6 ms on one.
constexpr int64_t kParallelWork = int64_t(1) << 19;

// Threads for a decode call over rows of these context lengths, split into `units` work items:
// one for short work (a few rows of short contexts: tens of microseconds), where waking a
// sleeping worker costs more than it saves, and never more than there are items (one row of
// 256 keys is one item: a second thread only waits for it, 197 against 100 us per call at
// SmolLM2-1.7B's shape).
inline int decode_threads(const int64_t* context_len, int num_rows, int64_t head_values,
                          int num_threads, int units) {
  int64_t keys = 0;
  for (int r = 0; r < num_rows; ++r) keys += context_len[r];
  if (keys * head_values < kParallelWork) return 1;
  return std::max(1, std::min(num_threads, units));
}

// Whether the AVX-512 decode kernels take NQ query heads of head_dim HD at once: their
// accumulators (NQ x HD / 16 vectors), one row of values and NQ weights fit the 32 registers
// (with two to spare); otherwise those heads take the plain loops.
template <int HD, int NQ>
constexpr bool fits_registers() {
  return HD > 0 && HD % 16 == 0 && (HD / 16) * (NQ + 1) + NQ <= 30;
}

// Query heads per group for head_dim HD: up to 4, as many as fits_registers allows (head_dim
// 128: 2), so that GQA with more heads per kv head (Qwen2.5-1.5B: 6 of head_dim 128) runs in
// groups the vectors take rather than a group of 4 in plain loops (its 16-row, 1,024-key step
// took 5.4x its KV read, now 4.1x).
template <int HD>
constexpr int heads_per_group() {
#if defined(POISE_ATTENTION_AVX2)
  if constexpr (avx2_heads<HD, 4>()) return 4;  // the AVX2 kernels (with 16 registers)
#endif
  if constexpr (HD == 0) return 4;
  else if constexpr (fits_registers<HD, 4>()) return 4;
  else if constexpr (fits_registers<HD, 3>()) return 3;
  else if constexpr (fits_registers<HD, 2>()) return 2;
  else return 1;
}

// Up to kMaxHeads query heads of one kv head at a time (the fixed-count kernels keep their
// scores and accumulators in registers): for heads [first, first + count) of kv head g, in
// order, f(first, std::integral_constant<int, count>{}) fills scores[count * n...] with the
// heads' (max, sum) pairs (softmax_rows), copied here to m_out / l_out. A head's results do not
// depend on the group it is in (each head's sums are its own).
// f(std::integral_constant<int, count>{}) for count in 1 .. 4: a head group's size as the
// compile-time count the fixed-count kernels take.
template <typename F>
inline void with_count(int count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{});
  }
}

template <int kMaxHeads = 4, typename F>
void for_head_groups(int g, int G, int n, const float* scores, float* m_out, float* l_out, F&& f) {
  static_assert(kMaxHeads >= 1 && kMaxHeads <= 4);
  for (int i = 0; i < G; i += kMaxHeads) {
    const int h = g * G + i;
    const int count = std::min(kMaxHeads, G - i);
    with_count(count, [&](auto nq) { f(h, nq); });
    const float* stats = scores + count * n;
    for (int c = 0; c < count; ++c) {
      m_out[h + c] = stats[2 * c];
      l_out[h + c] = stats[2 * c + 1];
    }
  }
}

// Arguments every kernel entry point refuses (-1): heads not a multiple of the kv heads, or a
// non-positive kv head count, head size or block size.
inline bool bad_shape(int num_heads, int num_kv_heads, int head_dim, int block_size) {
  return num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0;
}

// f(T{}, std::integral_constant<int, HD>{}) with T the element type of dtype 0 (float) or 1
// (bf16) and HD 64 or 128 where head_dim is one of them (the unrolled paths), else 0 (any):
// returns -2 for another dtype, 0 after f.
template <typename F>
int dispatch_dtype_head_dim(int dtype, int head_dim, F&& f) {
  auto with_head_dim = [&](auto t) {
    switch (head_dim) {
      case 64: f(t, std::integral_constant<int, 64>{}); break;
      case 128: f(t, std::integral_constant<int, 128>{}); break;
      default: f(t, std::integral_constant<int, 0>{});
    }
  };
  if (dtype == 0) with_head_dim(float{});
  else if (dtype == 1) with_head_dim(bf16{});
  else return -2;
  return 0;
}

inline float to_float(int8_t x) { return static_cast<float>(x); }

inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void from_float(float x, float* dst) { *dst = x; }

inline void from_float(float x, bf16* dst) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    *dst = static_cast<bf16>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  *dst = static_cast<bf16>(bits >> 16);
}

// exp(x) for x <= 0 (scores minus their max), Cephes-style: 2^n * p(r), r in [-ln2/2, ln2/2].
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
// e^x on 16 lanes, the polynomial of exp_nonpositive (the scalar loop does not vectorise by
// itself); overflows to +inf and underflows to 0 through scalef. Also cpu_elementwise.cpp's.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  // p * 2^n in one instruction (the same IEEE product as building 2^n's bits and multiplying).
  return _mm512_scalef_ps(p, n);
}

// exp_nonpositive on 16 lanes (the same clamp, so the same values).
inline __m512 exp_nonpositive16(__m512 x) {
  return exp16(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
}

// 16 values widened to float (bf16: the bits shifted into a float's high half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const bf16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// 16 int8 values widened to float (exact).
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// acc[i] (NQ query heads x NV * 16 values) = sum over keys j of weights[i * weights_stride + j]
// * v_scale(j) * the value row at slots[j] + v_offset, widened to float (v_scale: 1 for float
// and bf16 caches, the key's scale for int8 ones). Unnormalised: the partition merge divides.
// From key j0 (default 0) to n: with `more`, acc already holds the sums of the keys before j0
// and these are added to them in order (so keys in blocks, one call each, sum as one call).
template <typename T, int NV, int NQ, typename VScale>
void pv_avx512(const float* weights, int weights_stride, const T* const* slots, int n,
               int64_t v_offset, VScale v_scale, float* acc, int j0 = 0, bool more = false) {
  __m512 a[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NV; ++v)
      a[i][v] = more ? _mm512_loadu_ps(acc + (i * NV + v) * 16) : _mm512_setzero_ps();
  for (int j = j0; j < n; ++j) {
    const T* vrow = slots[j] + v_offset;
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load16(vrow + v * 16);
    for (int i = 0; i < NQ; ++i) {
      const __m512 w = _mm512_set1_ps(weights[i * weights_stride + j] * v_scale(j));
      for (int v = 0; v < NV; ++v) a[i][v] = _mm512_fmadd_ps(w, vv[v], a[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (i * NV + v) * 16, a[i][v]);
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums for the price of about one and
// a half (interleave, add, then fold the four 128-bit lanes).
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // Per 128-bit lane: [a0_0 + a0_2, a1_0 + a1_2, a0_1 + a0_3, a1_1 + a1_3], same for a2, a3.
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
  // Per 128-bit lane: [a0, a1, a2, a3] summed over that lane.
  const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#endif

// (After every to_float: the calls below are looked up where the templates are defined.)
// Scores and weighted values of NQ query heads that share one kv head, over n key slots:
// plain loops the compiler vectorises over the head dimension (any head_dim). k_scale(j) /
// v_scale(j): the key's int8 scales, 1 for float and bf16 caches (exact).
template <typename T, int NQ, typename KScale>
void qk_generic(const float* q_f, int hd, const T* const* slots, int n, int64_t k_offset,
                KScale k_scale, float* scores, int scores_stride) {
  for (int j = 0; j < n; ++j) {
    const T* k = slots[j] + k_offset;
    for (int i = 0; i < NQ; ++i) {
      const float* qh = q_f + i * hd;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int d = 0; d < hd; ++d) s += qh[d] * to_float(k[d]);
      scores[i * scores_stride + j] = s * k_scale(j);
    }
  }
}

template <typename T, int NQ, typename VScale>
void pv_generic(const float* weights, int weights_stride, int hd, const T* const* slots, int n,
                int64_t v_offset, VScale v_scale, float* acc) {
  std::fill(acc, acc + NQ * hd, 0.0f);
  for (int j = 0; j < n; ++j) {
    const T* v = slots[j] + v_offset;
    for (int i = 0; i < NQ; ++i) {
      const float w = weights[i * weights_stride + j] * v_scale(j);
      float* a = acc + i * hd;
#pragma omp simd
      for (int d = 0; d < hd; ++d) a[d] += w * to_float(v[d]);
    }
  }
}

// In place: each of `rows` rows of n scores -> exp(s - max); the row max and the sum of the
// exps are appended after the rows (at scores[rows * n + 2 * r] and [... + 1]).
inline void softmax_rows(float* scores, int rows, int n) {
  float* stats = scores + rows * n;
  for (int r = 0; r < rows; ++r) {
    float* s = scores + r * n;
    float m = -std::numeric_limits<float>::infinity();
    float l = 0.0f;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(m);
    for (int j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + j));
    }
    m = _mm512_reduce_max_ps(mv);
    const __m512 mb = _mm512_set1_ps(m);
    __m512 lv = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mb));
      _mm512_mask_storeu_ps(s + j, k, e);
      lv = _mm512_mask_add_ps(lv, k, lv, e);
    }
    l = _mm512_reduce_add_ps(lv);
#elif defined(POISE_ATTENTION_AVX2)
    const __m256 ninf = _mm256_set1_ps(m);
    __m256 mv = ninf;
    for (int j = 0; j < n; j += 8) {
      const __m256i k = tail_mask8(n - j);
      mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + j, k),
                                              _mm256_castsi256_ps(k)));
    }
    m = hmax8(mv);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 lv = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
      const __m256i k = tail_mask8(n - j);
      const __m256 e = _mm256_and_ps(
          exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(s + j, k), mb)),
          _mm256_castsi256_ps(k));
      _mm256_maskstore_ps(s + j, k, e);
      lv = _mm256_add_ps(lv, e);
    }
    l = hsum8(lv);
#else
    for (int j = 0; j < n; ++j) m = std::max(m, s[j]);
    for (int j = 0; j < n; ++j) {
      s[j] = exp_nonpositive(s[j] - m);
      l += s[j];
    }
#endif
    stats[2 * r] = m;
    stats[2 * r + 1] = l;
  }
}

// The prefill kernel's bf16 pairs (cpu_prefill_attention.cpp).
#if defined(__AVX512BF16__)
// Two rows of 16 bf16 (x: key 2jp, y: key 2jp+1) -> 16 pairs (x_i low, y_i high), in order.
inline void store_pairs(const __m256i x, const __m256i y, void* dst) {
  const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
  __m256i* out = static_cast<__m256i*>(dst);
  _mm256_storeu_si256(out, _mm256_permute2x128_si256(lo, hi, 0x20));
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(lo, hi, 0x31));
}
#endif

// A probability as P V uses it: rounded to bf16 when the inputs are bf16 (as torch's CPU flash
// attention, so both round alike); a float, or a bf16 pair on the PAIRS path, as it is.
template <typename T, bool PAIRS>
inline float like_t(float p) {
  if constexpr (PAIRS || !std::is_same_v<T, bf16>) return p;
  bf16 b;
  from_float(p, &b);
  return to_float(b);
}

// One decode row's output from its partitions' partials (both decode kernels) (items [first, last): acc [H, hd], stats m [H], l [H]
// per item): out_h = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i. o: [hd] scratch.
template <typename T>
void merge_partials(const float* stats, const float* acc, int first, int last, int H, int hd,
                    float* o, T* out) {
  for (int h = 0; h < H; ++h) {
    float M = -std::numeric_limits<float>::infinity();
    for (int it = first; it < last; ++it)
      M = std::max(M, stats[static_cast<size_t>(it) * H * 2 + h]);
    float denom = 0.0f;
    std::fill(o, o + hd, 0.0f);
    for (int it = first; it < last; ++it) {
      const float* st = stats + static_cast<size_t>(it) * H * 2;
      const float w = std::exp(st[h] - M);
      denom += w * st[H + h];
      const float* a = acc + (static_cast<size_t>(it) * H + h) * hd;
#pragma omp simd
      for (int d = 0; d < hd; ++d) o[d] += w * a[d];
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    for (int d = 0; d < hd; ++d) from_float(o[d] * inv, out + h * hd + d);
  }
}

}  // namespace poise_attention
