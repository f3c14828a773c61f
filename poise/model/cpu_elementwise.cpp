// Fused elementwise ops of the decoder layer for bfloat16 on CPU (model/elementwise.py):
//   RMSNorm, optionally after the residual add:  x = x + delta; out = norm(x) * weight
//   SiLU and multiply of the fused gate/up output: out = silu(gate) * up
//   RoPE of the q and k heads, in place in the qkv output
// Why: in torch each is 2-6 passes over [T, hidden] or [T, intermediate] (the float copy, the
// square, the mean, the scale, the bf16 copy, the weight; SiLU on a strided view, then the
// product), ~10 % of a long prefill's time; here each is one pass over rows that stay in L1.
//
// Roundings are transformers' (and torch's bf16 ops'): the residual sum rounded to bf16; the
// norm in float32 (mean of squares, times 1/sqrt(var + eps)), rounded to bf16, THEN times the
// bf16 weight and rounded again; SiLU in float32 rounded to bf16, then the product rounded;
// RoPE's two products each rounded, then their sum (bit-identical to torch's ops).
// Not bit-identical to torch: the mean's summation order, and exp (Cephes' polynomial here,
// torch's own vectorised one there), can move a value across a bf16 rounding boundary (one ulp).
//
// Rows are split over cpu_pool.h's pool in chunks of at least kChunkElements: its caller starts
// at once and a helper joins when awake. Until now an OpenMP region from 64k elements on: with
// OMP_WAIT_POLICY=PASSIVE (poise/__init__.py) waking torch's sleeping worker cost more than the
// work up to ~128 rows of SmolLM2-135M (SiLU x up at 64 rows: 106 us on two threads, 65 on one;
// the norm at 128 rows: 100 against 44 us), and below 64k elements one thread did it all.
// Shapes: row r of x at x + r * x_stride (elements); other tensors likewise with their strides.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention/cpu_attention_common.h"  // bf16 conversions, load16, exp16
#include "cpu_pool.h"

namespace {

using poise_attention::bf16;

// Elements per work item of the pool (a few microseconds of work): smaller calls run on the
// calling thread alone.
constexpr int64_t kChunkElements = 1 << 13;

// f(r) for every row, in chunks of rows on up to num_threads threads (the caller among them).
template <class F>
void for_rows(int64_t rows, int64_t row_elements, int num_threads, F&& f) {
  const int64_t per = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(row_elements, 1));
  const int64_t chunks = (rows + per - 1) / per;
  ppool::parallel_for(chunks, num_threads, [&](int64_t c) {
    const int64_t end = std::min(rows, (c + 1) * per);
    for (int64_t r = c * per; r < end; ++r) f(r);
  });
}
using poise_attention::to_float;

inline bf16 to_bf16(float x) {
  bf16 b;
  poise_attention::from_float(x, &b);
  return b;
}

inline float round_bf16(float x) { return to_float(to_bf16(x)); }

#if defined(__AVX512F__)
using poise_attention::exp16;
using poise_attention::load16;

// 16 floats -> bf16, round to nearest even (NaN inputs do not occur here: finite activations).
inline __m256i to_bf16_16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline __m512 round_bf16_16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(x)), 16));
}
#elif defined(POISE_ATTENTION_AVX2)  // AVX2 + FMA, no AVX-512 (cpu_attention_avx2.h)
// AVX2 (no AVX-512): the norm's vector loop with 8 floats per vector, two vectors per 16
// elements, so that each float lane sums what the AVX-512 loop's lane does and the reduction
// is _mm512_reduce_add_ps's order: the same bits on both builds (with the scalar loop's order,
// torch's result was 1.6 ulps away on one of 172,800 values).
using poise_attention::exp8;
using poise_attention::load8;
using poise_attention::round_bf16_8;
using poise_attention::to_bf16_8;

inline void store8(bf16* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_8(x));
}

// _mm512_reduce_add_ps of the 16 lanes (lo, hi), in its order.
inline float reduce16(__m256 lo, __m256 hi) {
  const __m256 a = _mm256_add_ps(hi, lo);
  const __m128 b = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  const __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}
#endif

// One row: x (+ delta, written back to x when delta is given) -> out.
void norm_row(bf16* x, const bf16* delta, const bf16* weight, bf16* out, int64_t dim,
              float eps) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= dim; i += 16) {
    __m512 v = load16(x + i);
    if (delta) {
      v = round_bf16_16(_mm512_add_ps(v, load16(delta + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), to_bf16_16(v));
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(POISE_ATTENTION_AVX2)
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; i + 16 <= dim; i += 16)
    for (int h = 0; h < 2; ++h) {
      __m256 v = load8(x + i + 8 * h);
      if (delta) {
        v = round_bf16_8(_mm256_add_ps(v, load8(delta + i + 8 * h)));
        store8(x + i + 8 * h, v);
      }
      acc[h] = _mm256_fmadd_ps(v, v, acc[h]);
    }
  sum = reduce16(acc[0], acc[1]);
#endif
  for (; i < dim; ++i) {
    float v = to_float(x[i]);
    if (delta) {
      v = round_bf16(v + to_float(delta[i]));
      x[i] = to_bf16(v);
    }
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(inv);
  for (; i + 16 <= dim; i += 16) {
    const __m512 normed = round_bf16_16(_mm512_mul_ps(load16(x + i), s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        to_bf16_16(_mm512_mul_ps(normed, load16(weight + i))));
  }
#elif defined(POISE_ATTENTION_AVX2)
  const __m256 s = _mm256_set1_ps(inv);
  for (; i + 8 <= dim; i += 8)
    store8(out + i, _mm256_mul_ps(round_bf16_8(_mm256_mul_ps(load8(x + i), s)), load8(weight + i)));
#endif
  for (; i < dim; ++i) out[i] = to_bf16(round_bf16(to_float(x[i]) * inv) * to_float(weight[i]));
}

void silu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round_bf16_16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        to_bf16_16(_mm512_mul_ps(silu, load16(up + i))));
  }
#elif defined(POISE_ATTENTION_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = round_bf16_8(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    store8(out + i, _mm256_mul_ps(silu, load8(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = to_float(gate[i]);
    out[i] = to_bf16(round_bf16(g / (1.0f + std::exp(-g))) * to_float(up[i]));
  }
}

// RoPE (HF rotate_half) on bf16 q/k heads in place: x = x * cos + rotate_half(x) * sin, each
// product rounded to bf16, then the sum (torch's three bf16 ops on the tables of
// model/rope.py: cos = [c, c], sin = [-s, s], so rotate_half's sign is in the table).
void rope_row(bf16* x, const bf16* cos, const bf16* sin, int heads, int64_t head_stride, int hd) {
  const int half = hd / 2;
  for (int h = 0; h < heads; ++h) {
    bf16* v = x + h * head_stride;
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= half; i += 16) {
      const __m512 a = load16(v + i), b = load16(v + half + i);
      const __m512 lo = _mm512_add_ps(round_bf16_16(_mm512_mul_ps(a, load16(cos + i))),
                                      round_bf16_16(_mm512_mul_ps(b, load16(sin + i))));
      const __m512 hi =
          _mm512_add_ps(round_bf16_16(_mm512_mul_ps(b, load16(cos + half + i))),
                        round_bf16_16(_mm512_mul_ps(a, load16(sin + half + i))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), to_bf16_16(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + half + i), to_bf16_16(hi));
    }
#elif defined(POISE_ATTENTION_AVX2)
    for (; i + 8 <= half; i += 8) {
      const __m256 a = load8(v + i), b = load8(v + half + i);
      const __m256 lo = _mm256_add_ps(round_bf16_8(_mm256_mul_ps(a, load8(cos + i))),
                                      round_bf16_8(_mm256_mul_ps(b, load8(sin + i))));
      const __m256 hi =
          _mm256_add_ps(round_bf16_8(_mm256_mul_ps(b, load8(cos + half + i))),
                        round_bf16_8(_mm256_mul_ps(a, load8(sin + half + i))));
      store8(v + i, lo);
      store8(v + half + i, hi);
    }
#endif
    for (; i < half; ++i) {
      const float a = to_float(v[i]), b = to_float(v[half + i]);
      const float lo = round_bf16(a * to_float(cos[i])) + round_bf16(b * to_float(sin[i]));
      const float hi =
          round_bf16(b * to_float(cos[half + i])) + round_bf16(a * to_float(sin[half + i]));
      v[i] = to_bf16(lo);
      v[half + i] = to_bf16(hi);
    }
  }
}

}  // namespace

extern "C" {

// x [rows, dim] (stride x_stride), delta [rows, dim] or null (stride delta_stride): with
// delta, x += delta first (in place). out [rows, dim] (stride out_stride) = norm(x) * weight.
int poise_rms_norm_bf16(void* x, int64_t x_stride, const void* delta, int64_t delta_stride,
                        const void* weight, void* out, int64_t out_stride, int64_t rows,
                        int64_t dim, float eps, int num_threads) {
  if (rows < 0 || dim <= 0) return -1;
  for_rows(rows, dim, num_threads, [&](int64_t r) {
    norm_row(static_cast<bf16*>(x) + r * x_stride,
             delta ? static_cast<const bf16*>(delta) + r * delta_stride : nullptr,
             static_cast<const bf16*>(weight), static_cast<bf16*>(out) + r * out_stride, dim,
             eps);
  });
  return 0;
}

// gate_up [rows, 2 * n] (stride in_stride; gate then up) -> out [rows, n] (stride out_stride).
int poise_silu_mul_bf16(const void* gate_up, int64_t in_stride, void* out, int64_t out_stride,
                        int64_t rows, int64_t n, int num_threads) {
  if (rows < 0 || n <= 0) return -1;
  for_rows(rows, 2 * n, num_threads, [&](int64_t r) {
    const bf16* row = static_cast<const bf16*>(gate_up) + r * in_stride;
    silu_mul_row(row, row + n, static_cast<bf16*>(out) + r * out_stride, n);
  });
  return 0;
}

// x: T tokens of `heads` heads of hd values (token stride x_stride, head stride head_stride),
// rotated in place; cos / sin: [T, hd] tables of each token's position (row stride table_stride).
int poise_rope_bf16(void* x, int64_t x_stride, int64_t head_stride, int heads, int hd,
                    const void* cos, const void* sin, int64_t table_stride, int64_t tokens,
                    int num_threads) {
  if (tokens < 0 || heads <= 0 || hd <= 0 || hd % 2 != 0) return -1;
  for_rows(tokens, static_cast<int64_t>(heads) * hd, num_threads, [&](int64_t t) {
    rope_row(static_cast<bf16*>(x) + t * x_stride,
             static_cast<const bf16*>(cos) + t * table_stride,
             static_cast<const bf16*>(sin) + t * table_stride, heads, head_stride, hd);
  });
  return 0;
}

}  // extern "C"
