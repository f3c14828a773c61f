// int4 weights (cpu_linear.cpp): q in [0, 15], w = q * d + m per channel and group of 32.
//
// Layout: [N / 16T][K / 8][T][16] 32-bit words: for input pairs 4j..4j+3 of a channel, the
// nibble at bit 4s is pair s's first input, at bit 16 + 4s its second, so a shift and a mask
// give one pair's 16 channels x 2 inputs as 16-bit integers.
//
// d and m are bf16 (as GGUF's Q4_1 keeps them in fp16): 4 bytes per 32 weights, not 8.
// Streamed: a 4-bit q becomes the bf16 number 128 + q by OR-ing 0x4300 into it (exact: bf16
// counts in steps of 1 from 128 to 256), so per group of 32 inputs
//   sum_k x_k w_k = d * sum_k x_k (128 + q_k) + (m - 128 d) * sum_k x_k,
// the first sum in vdpbf16ps (products exact in float32; 3 vector ops per 32 weights), the
// sums of x per row and group made once per call.
// Tiled: each K block (one group) is decoded to bf16 w = q * d + m for AMX tdpbf16ps.
#pragma once

#include "cpu_linear_common.h"

namespace plk {

// One int4 pair (s in 0..3 of a word) as 16-bit q per lane.
inline __m512i int4_pair(__m512i words, int s) {
  return _mm512_and_si512(_mm512_srli_epi32(words, 4 * s), _mm512_set1_epi32(0x000F000F));
}

// Sum of x over each row and group of 32 inputs: [m, k / 32].
inline void int4_sums(const uint16_t* x, int64_t m, int64_t k, float* xsum) {
  const int64_t kg = k / kGroup;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t gi = 0; gi < kg; ++gi) {
      const uint16_t* at = x + r * k + gi * kGroup;
      __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      __m512 b = _mm512_cvtpbh_ps(
          (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 16)));
      xsum[r * kg + gi] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

template <int R, int T>
void stream_int4(const Problem& p, int64_t g, int64_t r0, const float* xsum) {
  const int64_t kq_count = p.k / 8, groups = p.k / kGroup;
  const uint8_t* w = p.w + g * kq_count * T * 64;
  const uint16_t* x = p.x + r0 * p.k;
  const __m512i magic = _mm512_set1_epi32(0x43004300), mask = _mm512_set1_epi32(0x000F000F);
  __m512 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 part[R][T];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) part[r][t] = _mm512_setzero_ps();
    for (int64_t kq = gi * 4; kq < gi * 4 + 4; ++kq) {
      __m512i words[T];
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        prefetch(w + (kq * T + t) * 64 + kPrefetch);
        words[t] = _mm512_loadu_si512(w + (kq * T + t) * 64);
      }
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        __m512bh wv[T];
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t)  // (q & 0xF) | 0x4300 per 16-bit lane: bf16 128 + q
          wv[t] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(words[t], 4 * s), mask,
                                                      magic, 0xEA);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m512bh xr = bcast_pair(x + r * p.k + 8 * kq + 2 * s);
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t) part[r][t] = _mm512_dpbf16_ps(part[r][t], xr, wv[t]);
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      __m512 d, m;
      load_dm(p.dm + ((g * T + t) * groups + gi) * 2 * kTile, &d, &m);
      const __m512 c = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m);  // m - 128 d
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(part[r][t], d, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(c, _mm512_set1_ps(xsum[(r0 + r) * groups + gi]), acc[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store_row(p.y + (r0 + r) * p.n + (g * T + t) * kTile, acc[r][t]);
}

template <int T>
void stream_int4_group(const Problem& p, int64_t g, const float* xsum) {
  // Two accumulator sets (per group and total): 2 rows x 4 tiles at most.
  for (int64_t r0 = 0; r0 < p.m;) {
    if (p.m - r0 >= 2) {
      stream_int4<2, T>(p, g, r0, xsum);
      r0 += 2;
    } else {
      stream_int4<1, T>(p, g, r0, xsum);
      r0 += 1;
    }
  }
}

#if defined(PLK_AMX)
// K block kb (one group: 16 input pairs) of tile t of group g as bf16 w = q * d + m into dst:
// 16 rows of 64 bytes, one AMX B tile. Lanes 2j and 2j + 1 are channel j, so the scales are
// spread the same way for the low and the high 16 lanes.
inline void int4_decode_block(const Problem& p, int64_t g, int t, int64_t kb, uint16_t* dst) {
  const int64_t T = p.t, groups = p.k / kGroup;
  const __m512i spread_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i spread_hi = _mm512_add_epi32(spread_lo, _mm512_set1_epi32(8));
  __m512 d, m;
  load_dm(p.dm + ((g * T + t) * groups + kb) * 2 * kTile, &d, &m);
  const __m512 dlo = _mm512_permutexvar_ps(spread_lo, d), dhi = _mm512_permutexvar_ps(spread_hi, d);
  const __m512 mlo = _mm512_permutexvar_ps(spread_lo, m), mhi = _mm512_permutexvar_ps(spread_hi, m);
  const uint8_t* w = p.w + (g * (p.k / 8) + kb * 4) * T * 64 + t * 64;
  for (int j = 0; j < 4; ++j) {
    __m512i words = _mm512_loadu_si512(w + j * T * 64);
    for (int s = 0; s < 4; ++s) {
      __m512i q = int4_pair(words, s);
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
      lo = _mm512_fmadd_ps(lo, dlo, mlo);
      hi = _mm512_fmadd_ps(hi, dhi, mhi);
      _mm512_storeu_si512(dst + (j * 4 + s) * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// Tiled, few rows (one 16-row block): per group of 32 inputs one AMX product per tile on the
// weights as bf16 128 + q (two vector ops per input pair instead of nine for w = q * d + m),
// scaled per channel into float32 accumulators, acc += d * C + (m - 128 d) * sum(x). Cheaper
// than decoding while each decoded block would serve one row block; the next group's blocks
// are decoded while the AMX unit works on this one's (a tile load right after the stores
// that wrote its data waits for them).
inline void tiled_int4_rows16(const Problem& p, int64_t g, const uint16_t* x, int64_t r0,
                              const float* xsum, float* cbuf, float* acc) {
  const int T = p.t;
  const int64_t groups = p.k / kGroup, width = T * kTile;
  const uint8_t* w = p.w + g * (p.k / 8) * T * 64;
  const __m512i magic = _mm512_set1_epi32(0x43004300), mask = _mm512_set1_epi32(0x000F000F);
  alignas(64) uint16_t blocks[2][4][16 * 32];
  auto decode = [&](int64_t gi, uint16_t (*dst)[16 * 32]) {
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < 4; ++j) {
        const __m512i words = _mm512_loadu_si512(w + ((gi * 4 + j) * T + t) * 64);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s)
          _mm512_storeu_si512(dst[t] + (j * 4 + s) * 32,
                              _mm512_ternarylogic_epi32(_mm512_srli_epi32(words, 4 * s), mask,
                                                        magic, 0xEA));
      }
  };
  std::memset(acc, 0, 16 * width * sizeof(float));
  const int64_t rows = p.m - r0 < 16 ? p.m - r0 : 16;
  decode(0, blocks[0]);
  for (int64_t gi = 0; gi < groups; ++gi) {
    // Tile numbers are immediates: one line per tile (T <= 4).
    _tile_loadd(4, x + r0 * p.k + gi * kGroup, p.k * 2);
    uint16_t (*b)[16 * 32] = blocks[gi & 1];
    _tile_zero(0); _tile_loadd(6, b[0], 64); _tile_dpbf16ps(0, 4, 6);
    if (T > 1) { _tile_zero(1); _tile_loadd(7, b[1], 64); _tile_dpbf16ps(1, 4, 7); }
    if (T > 2) { _tile_zero(2); _tile_loadd(6, b[2], 64); _tile_dpbf16ps(2, 4, 6); }
    if (T > 3) { _tile_zero(3); _tile_loadd(7, b[3], 64); _tile_dpbf16ps(3, 4, 7); }
    if (gi + 1 < groups) decode(gi + 1, blocks[(gi + 1) & 1]);
    _tile_stored(0, cbuf, width * 4);
    if (T > 1) _tile_stored(1, cbuf + kTile, width * 4);
    if (T > 2) _tile_stored(2, cbuf + 2 * kTile, width * 4);
    if (T > 3) _tile_stored(3, cbuf + 3 * kTile, width * 4);
    for (int t = 0; t < T; ++t) {
      __m512 d, m;
      load_dm(p.dm + ((g * T + t) * groups + gi) * 2 * kTile, &d, &m);
      const __m512 c = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m);  // m - 128 d
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc + r * width + t * kTile;
        __m512 v = _mm512_fmadd_ps(c, _mm512_set1_ps(xsum[(r0 + r) * groups + gi]),
                                   _mm512_loadu_ps(a));
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(cbuf + r * width + t * kTile), d, v));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int t = 0; t < T; ++t)
      store_row(p.y + (r0 + r) * p.n + (g * T + t) * kTile,
                _mm512_loadu_ps(acc + r * width + t * kTile));
}

#endif  // PLK_AMX

}  // namespace plk
