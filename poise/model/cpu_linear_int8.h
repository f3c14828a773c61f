// int8 weights with 16-bit integer activations on VNNI (cpu_linear.cpp).
//
// Each row of x is scaled to 16-bit integers (x ~= s_r * x16, s_r = max|x_r| / 32767: finer
// than bf16 for the row's large values) and split into two unsigned bytes, lo = x16 & 255 and
// hi = (x16 >> 8) + 128, so that with q in [-127, 127]:
//   sum_k x_k q_k = s_r * (256 * (sum_k hi_k q_k - 128 * sum_k q_k) + sum_k lo_k q_k).
// Both sums are u8 x s8 dot products in int32 (vpdpbusd, AMX tdpbusd) and the weights are
// used as stored: no decode at all, unlike converting them to bf16 (5-6 vector ops per 32
// weights, which made int8 compute-bound at 16 rows: as slow as bf16). sum_k q_k is stored per
// channel at load. int32 holds the sums for k <= 16384 (255 * 127 * 16384 < 2^31).
// Layout: [N / 16T][K / 4][T][16][4]: per input quad, each tile's 16 channels x 4 inputs (64
// bytes), what vpdpbusd multiplies against a broadcast quad and an AMX B tile's row.
#pragma once

#include "cpu_linear_common.h"

namespace plk {

// Rows [0, m) of x into lo / hi bytes and scales; rows [m, m_pad) as zeros.
inline void int8_activations(const uint16_t* x, int64_t m, int64_t m_pad, int64_t k,
                             uint8_t* lo, uint8_t* hi, float* xscale) {
  for (int64_t r = 0; r < m_pad; ++r) {
    if (r >= m) {
      std::memset(lo + r * k, 0, k);
      std::memset(hi + r * k, 128, k);
      xscale[r] = 0.0f;
      continue;
    }
    const uint16_t* xr = x + r * k;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16)
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_cvtpbh_ps(
          (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + i)))));
    const float top = _mm512_reduce_max_ps(amax);
    const float s = top > 0.0f ? top / 32767.0f : 1.0f;
    xscale[r] = s;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    for (int64_t i = 0; i < k; i += 16) {
      __m512 v = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(xr + i)));
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // round to nearest
      q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)),
                           _mm512_set1_epi32(-32767));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + r * k + i),
                       _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + r * k + i),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_srai_epi32(q, 8),
                                                             _mm512_set1_epi32(128))));
    }
  }
}

// y[r, c0..c0+15] from the two int32 sums of row r.
inline void int8_store(const Problem& p, int64_t r, int64_t c0, __m512i lo, __m512i hi) {
  const __m512i corr = _mm512_slli_epi32(
      _mm512_loadu_si512(reinterpret_cast<const void*>(p.rowsum + c0)), 7);
  const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, corr)),
                                   _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(lo));
  const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(p.scale + c0), _mm512_set1_ps(p.xscale[r]));
  store_row(p.y + r * p.n + c0, _mm512_mul_ps(v, s));
}

// R rows x T tiles of group g over input quads [kq0, kq1) (two accumulators per row and tile).
// part: null when [kq0, kq1) is all of K; else R x T x 2 partial sums kept between calls,
// read when kq0 > 0 and written unless kq1 ends K (then y is written instead).
template <int R, int T>
void int8_rows(const Problem& p, int64_t g, int64_t r0, int64_t kq0, int64_t kq1, __m512i* part) {
  const int64_t kq_count = p.k / 4;
  const uint8_t* w = p.w + g * kq_count * T * 64;
  __m512i lo[R][T], hi[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const bool resume = part != nullptr && kq0 > 0;
      lo[r][t] = resume ? _mm512_loadu_si512(part + (r * T + t) * 2) : _mm512_setzero_si512();
      hi[r][t] = resume ? _mm512_loadu_si512(part + (r * T + t) * 2 + 1) : _mm512_setzero_si512();
    }
  for (int64_t kq = kq0; kq < kq1; ++kq) {
    const uint8_t* row = w + kq * T * 64;
    __m512i wv[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      prefetch(row + kPrefetch + t * 64);
      wv[t] = _mm512_loadu_si512(row + t * 64);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i bl = bcast_quad(p.xlo + (r0 + r) * p.k + 4 * kq);
      const __m512i bh = bcast_quad(p.xhi + (r0 + r) * p.k + 4 * kq);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        lo[r][t] = _mm512_dpbusd_epi32(lo[r][t], bl, wv[t]);
        hi[r][t] = _mm512_dpbusd_epi32(hi[r][t], bh, wv[t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      if (kq1 == kq_count) {
        int8_store(p, r0 + r, (g * T + t) * kTile, lo[r][t], hi[r][t]);
      } else {
        _mm512_storeu_si512(part + (r * T + t) * 2, lo[r][t]);
        _mm512_storeu_si512(part + (r * T + t) * 2 + 1, hi[r][t]);
      }
    }
}

// Rows [r_begin, r_end) of group g over quads [kq0, kq1), in blocks of at most 3 rows
// (2 x 3 x 4 accumulators + 4 weights + 2 broadcasts fit the 32 vector registers); part: as
// int8_rows, 2T vectors per row from r_begin, or null for all of K.
template <int T>
void int8_row_blocks(const Problem& p, int64_t g, int64_t r_begin, int64_t r_end, int64_t kq0,
                     int64_t kq1, __m512i* part) {
  for (int64_t r0 = r_begin; r0 < r_end;) {
    __m512i* pp = part ? part + (r0 - r_begin) * T * 2 : nullptr;
    switch (r_end - r0) {
      case 1: int8_rows<1, T>(p, g, r0, kq0, kq1, pp); r0 += 1; break;
      case 2: int8_rows<2, T>(p, g, r0, kq0, kq1, pp); r0 += 2; break;
      default: int8_rows<3, T>(p, g, r0, kq0, kq1, pp); r0 += 3; break;
    }
  }
}

// Streamed (1-3 rows): each row block over all of K, the weights read once from memory.
template <int T>
void stream_int8_group(const Problem& p, int64_t g) {
  int8_row_blocks<T>(p, g, 0, p.m, 0, p.k / 4, nullptr);
}

// Quads of one blocked chunk: T x 16 channels x 4 inputs x 64 = 16 KB of weights at T = 4,
// which stay in L1 while every row block of the chunk passes over them.
constexpr int64_t kChunkQuads = 64;

// Blocked (more rows, no AMX): rows [r_begin, r_end) of group g, K in chunks of kChunkQuads
// quads, each chunk's weights used by every 3-row block before the next chunk; the blocks'
// partial sums wait in part (2T vectors per row) between chunks. Streaming all of K per row
// block instead re-reads the group's weights (128 KB at K = 2048, T = 4) from L2 for every
// block.
template <int T>
void blocked_int8_group(const Problem& p, int64_t g, int64_t r_begin, int64_t r_end,
                        __m512i* part) {
  const int64_t kq_count = p.k / 4;
  for (int64_t kq0 = 0; kq0 < kq_count; kq0 += kChunkQuads) {
    const int64_t kq1 = kq0 + kChunkQuads < kq_count ? kq0 + kChunkQuads : kq_count;
    int8_row_blocks<T>(p, g, r_begin, r_end, kq0, kq1, part);
  }
}

#if defined(PLK_AMX)
// Tiled (AMX): rows [r_begin, r_end) of group g, 16 rows x 2 tiles per pass, B tiles read in
// place.
inline void tiled_int8_group(const Problem& p, int64_t g, int64_t r_begin, int64_t r_end,
                             int32_t* cbuf) {
  const int T = p.t;
  const int64_t kq_count = p.k / 4, kb_count = p.k / kQuadBlock;
  const uint8_t* w = p.w + g * kq_count * T * 64;
  for (int t0 = 0; t0 < T; t0 += 2) {
    const bool two = t0 + 1 < T;
    for (int64_t r0 = r_begin; r0 < r_end; r0 += 16) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        _tile_loadd(4, p.xlo + r0 * p.k + kb * kQuadBlock, p.k);
        _tile_loadd(5, p.xhi + r0 * p.k + kb * kQuadBlock, p.k);
        const uint8_t* b = w + (kb * 16 * T + t0) * 64;
        _tile_loadd(6, b, T * 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(2, 5, 6);
        if (two) {
          _tile_loadd(7, b + 64, T * 64);
          _tile_dpbusd(1, 4, 7);
          _tile_dpbusd(3, 5, 7);
        }
      }
      // cbuf: [16 rows][lo 32 | hi 32] int32.
      _tile_stored(0, cbuf, 256);
      _tile_stored(2, cbuf + 32, 256);
      if (two) {
        _tile_stored(1, cbuf + 16, 256);
        _tile_stored(3, cbuf + 48, 256);
      }
      for (int64_t r = r0; r < r0 + 16 && r < p.m; ++r)
        for (int tt = 0; tt < (two ? 2 : 1); ++tt) {
          const int32_t* c = cbuf + (r - r0) * 64 + tt * 16;
          int8_store(p, r, (g * T + t0 + tt) * kTile, _mm512_loadu_si512(c),
                     _mm512_loadu_si512(c + 32));
        }
    }
  }
}

#endif  // PLK_AMX

}  // namespace plk
