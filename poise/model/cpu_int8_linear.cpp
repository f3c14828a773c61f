// Weight-only int8 linear layer for CPU (AVX512-BF16): y[M,N] = (x[M,K] . q[N,K]^T) * scale[N],
// x and y bf16, q int8, the dot products in float32 (vdpbf16ps). Built by quant_kernel.py.
//
// Why: torch's _weight_int8pack_mm is 2-3x faster than a bf16 matmul at batch 1 but 2x slower
// at batch 32 (it converts the weights again for every row); here each weight is converted
// to bf16 once per call and reused by every row, and the weights travel at one byte each.
//
// Layout (quant_kernel.pack_int8): q as [N/16][K/2][16][2], so the 32 bytes of one input pair
// of 16 output channels convert to one bf16 vector ordered as vdpbf16ps wants it, multiplied
// by the broadcast pair (x[r, 2kp], x[r, 2kp + 1]).
//
// Work split: groups of output channels (vectors of 16) over the OpenMP threads. Per group:
// - up to kInlineRows rows (decode at small batch): kStreamTiles vectors per group, weights
//   converted in registers as they stream in;
// - more rows: kTiles vectors per group, whose weights are converted once into a per-thread
//   buffer, then register blocks of kRows rows x kTiles vectors (24 float32 accumulators)
//   walk it, while the next group's weights are prefetched (the conversion pass is otherwise
//   a memory stall). 8 x 3 beat 6 x 4 by 6 % at 32 rows and 16 % at 8 (whole blocks).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 16;        // output channels per vector
constexpr int kStreamTiles = 4;  // vectors of channels per group, streamed rows
constexpr int kTiles = 3;        // vectors of channels per group and register block, buffered
constexpr int kRows = 8;         // rows of x per register block, buffered
constexpr int kInlineRows = 4;   // up to this many rows, no conversion buffer

// 32 packed int8 (16 channels x 2 inputs) -> one bf16 vector in the same order (exact: |q| <=
// 127 fits bf16's 8-bit significand).
inline __m512bh convert(const int8_t* w) {
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lo fills the low half
}

inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// R rows x T channel vectors of y. weights(kp, t): the bf16 vector of vector t at input pair kp.
template <int R, int T, typename Weights>
inline void block(const uint16_t* x, int64_t ldx, int64_t kp_count, Weights weights,
                  const float* scale, uint16_t* y, int64_t ldy, const int8_t* prefetch) {
  __m512 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    if (prefetch != nullptr) {  // the next group: T * 32 bytes per input pair
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + kp * T * 32), _MM_HINT_T1);
      if (T > 2)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + kp * T * 32 + 64), _MM_HINT_T1);
    }
    __m512bh w[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) w[t] = weights(kp, t);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512bh xr = broadcast_pair(x + r * ldx + 2 * kp);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xr, w[t]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) {
    __m512 s = _mm512_loadu_ps(scale + t * kTile);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][t], s));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + t * kTile), (__m256i)o);
    }
  }
}

struct Problem {
  const uint16_t* x;
  int64_t m, k;
  const int8_t* w;
  const float* scale;
  int64_t n;
  uint16_t* y;
};

// Rows [r0, r0 + rows) of y for one group; rows <= kRows.
template <int T, typename Weights>
inline void rows_block(const Problem& p, int64_t r0, int64_t rows, Weights weights,
                       const float* scale, uint16_t* y, const int8_t* prefetch) {
  const uint16_t* x = p.x + r0 * p.k;
  uint16_t* yr = y + r0 * p.n;
  const int64_t kp = p.k / 2;
  switch (rows) {
    case 1: block<1, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
    case 2: block<2, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
    case 3: block<3, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
    case 4: block<4, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
    case 5: block<5, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
    case 6: block<6, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
    case 7: block<7, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
    default: block<8, T>(x, p.k, kp, weights, scale, yr, p.n, prefetch); break;
  }
}

// Every row of y for the T channel vectors starting at vector t0.
template <int T>
void group(const Problem& p, int64_t t0, uint16_t* buf) {
  const int64_t kp_count = p.k / 2;
  const int8_t* w = p.w + t0 * kp_count * 32;  // T consecutive vectors: [T][K/2][32]
  const float* scale = p.scale + t0 * kTile;
  uint16_t* y = p.y + t0 * kTile;
  if (p.m <= kInlineRows) {
    auto streamed = [&](int64_t kp, int t) { return convert(w + (t * kp_count + kp) * 32); };
    rows_block<T>(p, 0, p.m, streamed, scale, y, nullptr);
    return;
  }
  for (int64_t kp = 0; kp < kp_count; ++kp)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_si512(buf + (kp * T + t) * 32,
                          (__m512i)convert(w + (t * kp_count + kp) * 32));
  auto buffered = [&](int64_t kp, int t) {
    return (__m512bh)_mm512_loadu_si512(buf + (kp * T + t) * 32);
  };
  const bool has_next = t0 + 2 * T <= p.n / kTile;
  const int8_t* next = has_next ? w + T * kp_count * 32 : nullptr;
  for (int64_t r0 = 0; r0 < p.m; r0 += kRows) {
    const int64_t rows = p.m - r0 < kRows ? p.m - r0 : kRows;
    rows_block<T>(p, r0, rows, buffered, scale, y, r0 == 0 ? next : nullptr);
  }
}

}  // namespace

// x [m, k] bf16 rows, w packed [n/16][k/2][16][2] int8, scale [n] float32, y [m, n] bf16.
// Returns nonzero (and writes nothing) when n % 16 or k % 2.
extern "C" int poise_int8_linear(const uint16_t* x, int64_t m, int64_t k, const int8_t* w,
                                 const float* scale, int64_t n, uint16_t* y, int threads) {
  if (n % kTile || k % 2) return 1;
  const Problem p{x, m, k, w, scale, n, y};
  // Streamed rows: 4 vectors per group (more weight streams in flight); buffered: 3 vectors x
  // 8 rows of accumulators.
  const int64_t per_group = m <= kInlineRows ? kStreamTiles : kTiles;
  const int64_t vectors = n / kTile, groups = (vectors + per_group - 1) / per_group;
#pragma omp parallel num_threads(threads)
  {
    // Sized for the widest group (a buffered group has at most kTiles vectors).
    std::vector<uint16_t> buf(m > kInlineRows ? (k / 2) * kStreamTiles * 32 : 0);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t t0 = g * per_group;
      switch (vectors - t0 < per_group ? vectors - t0 : per_group) {
        case 1: group<1>(p, t0, buf.data()); break;
        case 2: group<2>(p, t0, buf.data()); break;
        case 3: group<3>(p, t0, buf.data()); break;
        default: group<4>(p, t0, buf.data()); break;
      }
    }
  }
  return 0;
}
