// AVX2 int8 and int4 weights (cpu_linear_avx2.cpp), in the layouts linear_kernel.py packs for
// AVX-512 (cpu_linear_int8.h, cpu_linear_int4.h), so packing does not depend on the CPU.
//
// AVX2 has no VNNI: products are vpmaddwd, 16-bit x 16-bit summed in pairs into int32. Each row
// of x is scaled to 16-bit integers once per call (x ~= s_r * x16, s_r = max|x_r| / 32767, as
// the AVX-512 int8 path does), the weights widened to 16 bits in registers:
// - int8: 16 bytes (4 channels x 4 inputs of a quad) sign-extended, against the row's quad
//   broadcast: each int32 lane sums 2 inputs of one channel; a channel's two lanes are added
//   (hadd) when a chunk of K ends (first_row: at every quad). At most 64 quads per chunk keeps
//   the int32 sums exact (64 x 4 x 127 x 32767 < 2^31); chunks add up in float32, in order.
// - int4: a shift and a mask give one input pair of 8 channels as 16-bit q (the layout's
//   words), against the row's pair broadcast: int32 sums per group of 32 inputs, then
//   w = q * d + m per group in float32: y += d * s_r * sum(x16 q) + m * sum(x).
// Integer sums are exact and the float steps run in one order per row, so a row's output is
// the same bits at any row count (greedy tokens do not depend on the batch).
#pragma once

#include "cpu_linear_avx2.h"

namespace plk2 {

using plk::kGroup;
using plk::kTile;

constexpr int64_t kChunkQuads = 64;  // int8 quads per chunk (the int32 bound above)
constexpr int64_t kChunkGroups = 8;  // int4 groups per chunk (the same 256 inputs)
constexpr int kQuantRows = 2;        // rows per block (16 vector registers)

// Rows [0, m) of x as 16-bit integers and their scales.
inline void int16_activations(const uint16_t* x, int64_t m, int64_t k, int16_t* x16,
                              float* xscale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* xr = x + r * k;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8)
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, bf16x8(xr + i)));
    const float top = hmax8(amax);
    const float s = top > 0.0f ? top / 32767.0f : 1.0f;
    xscale[r] = s;
    const __m256 inv = _mm256_set1_ps(1.0f / s);
    const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
    for (int64_t i = 0; i < k; i += 16) {
      __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(bf16x8(xr + i), inv));  // nearest
      __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(bf16x8(xr + i + 8), inv));
      a = _mm256_max_epi32(_mm256_min_epi32(a, hi), lo);
      b = _mm256_max_epi32(_mm256_min_epi32(b, hi), lo);
      // packs per 128-bit lane: [a0-3, b0-3 | a4-7, b4-7]; the permute restores the order.
      const __m256i v = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + r * k + i), v);
    }
  }
}

// Sum of x over each row and group of 32 inputs: [m, k / 32] (int4's m term).
inline void int4_sums(const uint16_t* x, int64_t m, int64_t k, float* xsum) {
  const int64_t kg = k / kGroup;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t gi = 0; gi < kg; ++gi) {
      const uint16_t* at = x + r * k + gi * kGroup;
      const __m256 a = _mm256_add_ps(bf16x8(at), bf16x8(at + 8));
      const __m256 b = _mm256_add_ps(bf16x8(at + 16), bf16x8(at + 24));
      xsum[r * kg + gi] = hsum8(_mm256_add_ps(a, b));
    }
}

inline __m256i bcast32(const int16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i bcast64(const int16_t* x) {
  int64_t v;
  std::memcpy(&v, x, 8);
  return _mm256_set1_epi64x(v);
}

// s + the pair sums of q x x (16-bit lanes, int32 results).
inline __m256i madd_add(__m256i s, __m256i q, __m256i x) {
  return _mm256_add_epi32(s, _mm256_madd_epi16(q, x));
}

// int4: input pair sh of 8 channels' words as 16-bit q.
inline __m256i int4_q(__m256i words, int sh) {
  return _mm256_and_si256(_mm256_srli_epi32(words, 4 * sh), _mm256_set1_epi32(0x000F000F));
}

// int4: one scale group's int32 sums s (channels 8h .. 8h + 7 of a tile; at: the tile and
// group's 16 d then 16 m) into the float sums, acc + d * s_r * s + m * sum(x): both int4
// kernels fold through here, so a row's bits do not depend on which one ran it.
inline __m256 int4_fold(__m256 acc, const uint16_t* at, int h, float xscale, float xsum,
                        __m256i s) {
  const __m256 ds = _mm256_mul_ps(bf16x8(at + 8 * h), _mm256_set1_ps(xscale));
  acc = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(s), acc);
  return _mm256_fmadd_ps(bf16x8(at + kTile + 8 * h), _mm256_set1_ps(xsum), acc);
}

// int8, rows [r0, r0 + R) x tile t of group g over quads [kq0, kq1): into part[R][2] (float,
// channels in hadd's order 0 1 4 5 2 3 6 7 | 8 9 12 13 10 11 14 15), set when `first`, else
// added to. The weights are in L1 (first_row read them).
template <int R>
void int8_tile(const Problem& p, int64_t g, int t, int64_t r0, int64_t kq0, int64_t kq1,
               __m256* part, bool first) {
  const int64_t stride = p.t * 64;  // bytes per quad of the group (T tiles x 64)
  const uint8_t* w = p.w + g * (p.k / 4) * stride + t * 64;
  __m256i acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
  for (int64_t kq = kq0; kq < kq1; ++kq) {
    const uint8_t* b = w + kq * stride;
    __m256i xq[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xq[r] = bcast64(p.x16 + (r0 + r) * p.k + 4 * kq);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // channels 4j .. 4j + 3
      const __m256i wv =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j)));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = madd_add(acc[r][j], wv, xq[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 f0 = _mm256_cvtepi32_ps(_mm256_hadd_epi32(acc[r][0], acc[r][1]));
    const __m256 f1 = _mm256_cvtepi32_ps(_mm256_hadd_epi32(acc[r][2], acc[r][3]));
    part[2 * r] = first ? f0 : _mm256_add_ps(part[2 * r], f0);
    part[2 * r + 1] = first ? f1 : _mm256_add_ps(part[2 * r + 1], f1);
  }
}

// int4, rows [r0, r0 + R) x tile t of group g over scale groups [gi0, gi1): into part[R][2]
// (float, channels in order), set when `first`, else added to; weights in L1 as int8_tile's.
template <int R>
void int4_tile(const Problem& p, int64_t g, int t, int64_t r0, int64_t gi0, int64_t gi1,
               __m256* part, bool first, const float* xsum) {
  const int64_t stride = p.t * 64, groups = p.k / kGroup;
  const uint8_t* w = p.w + g * (p.k / 8) * stride + t * 64;
  const uint16_t* dm = p.dm + (g * p.t + t) * groups * 2 * kTile;
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) acc[r][h] = first ? _mm256_setzero_ps() : part[2 * r + h];
  for (int64_t gi = gi0; gi < gi1; ++gi) {
    __m256i s[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    for (int64_t kq = gi * 4; kq < gi * 4 + 4; ++kq) {
      const uint8_t* b = w + kq * stride;
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
#pragma GCC unroll 4
      for (int sh = 0; sh < 4; ++sh) {  // input pair sh of the word: inputs 8 kq + 2 sh, + 1
        const __m256i q0 = int4_q(w0, sh), q1 = int4_q(w1, sh);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i xp = bcast32(p.x16 + (r0 + r) * p.k + 8 * kq + 2 * sh);
          s[r][0] = madd_add(s[r][0], q0, xp);
          s[r][1] = madd_add(s[r][1], q1, xp);
        }
      }
    }
    const uint16_t* at = dm + gi * 2 * kTile;  // 16 d, then 16 m
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r][h] = int4_fold(acc[r][h], at, h, p.xscale[r0 + r], xsum[(r0 + r) * groups + gi],
                              s[r][h]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) part[2 * r + h] = acc[r][h];
}

// One row, every tile of group g per quad (the weights in address order: passes of one tile
// each read every T-th line, and ran at half the bandwidth at T = 4): int8 over quads
// [kq0, kq1), each quad's two 8-lane halves added at once (hadd), so 2 T accumulators.
// part: [T][rows][2] from the row's first vector (rows: the block's, as quant_group's).
template <int T>
void int8_row(const Problem& p, int64_t g, int64_t r, int64_t kq0, int64_t kq1, __m256* part,
              int64_t rows, bool first, int64_t ahead) {
  const int64_t stride = T * 64;
  const uint8_t* w = p.w + g * (p.k / 4) * stride;
  __m256i acc[T][2];
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
  for (int64_t kq = kq0; kq < kq1; ++kq) {
    const uint8_t* b = w + kq * stride;
    const __m256i xq = bcast64(p.x16 + r * p.k + 4 * kq);
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      if (ahead != 0) plk::prefetch(b + t * 64 + ahead);
      __m256i v[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        v[j] = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                                     reinterpret_cast<const __m128i*>(b + t * 64 + 16 * j))),
                                 xq);
      acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_hadd_epi32(v[0], v[1]));
      acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_hadd_epi32(v[2], v[3]));
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256* at = part + t * rows * 2 + h;
      const __m256 f = _mm256_cvtepi32_ps(acc[t][h]);
      *at = first ? f : _mm256_add_ps(*at, f);
    }
}

// int4, one row, every tile of group g per input octet, over scale groups [gi0, gi1): int32
// sums per group in registers, folded into part (float, as int4_tile) at each group's end.
template <int T>
void int4_row(const Problem& p, int64_t g, int64_t r, int64_t gi0, int64_t gi1, __m256* part,
              int64_t rows, bool first, int64_t ahead, const float* xsum) {
  const int64_t stride = T * 64, groups = p.k / kGroup;
  const uint8_t* w = p.w + g * (p.k / 8) * stride;
  if (first)
    for (int t = 0; t < T; ++t) part[t * rows * 2] = part[t * rows * 2 + 1] = _mm256_setzero_ps();
  for (int64_t gi = gi0; gi < gi1; ++gi) {
    __m256i s[T][2];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) s[t][0] = s[t][1] = _mm256_setzero_si256();
    for (int64_t kq = gi * 4; kq < gi * 4 + 4; ++kq) {
      const uint8_t* b = w + kq * stride;
      const int16_t* xr = p.x16 + r * p.k + 8 * kq;
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        if (ahead != 0) plk::prefetch(b + t * 64 + ahead);
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + t * 64));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + t * 64 + 32));
#pragma GCC unroll 4
        for (int sh = 0; sh < 4; ++sh) {
          const __m256i xp = bcast32(xr + 2 * sh);
          s[t][0] = madd_add(s[t][0], int4_q(w0, sh), xp);
          s[t][1] = madd_add(s[t][1], int4_q(w1, sh), xp);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const uint16_t* at = p.dm + ((g * T + t) * groups + gi) * 2 * kTile;
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256* acc = part + t * rows * 2 + h;
        *acc = int4_fold(*acc, at, h, p.xscale[r], xsum[r * groups + gi], s[t][h]);
      }
    }
  }
}

// part[2] of a row and tile (int8: hadd's channel order, times the scales) to y's 16 channels.
inline void store_tile(const Problem& p, int64_t r, int64_t c0, const __m256* part) {
  for (int h = 0; h < 2; ++h) {
    __m256 v = part[h];
    if (p.fmt == plk::kInt8) {
      v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(p.scale + c0 + 8 * h),
                                     _mm256_set1_ps(p.xscale[r]));
      v = _mm256_mul_ps(v, s);
    }
    store_bf16x8(p.y + r * p.n + c0 + 8 * h, v);
  }
}

// The first row of a block range: one of the *_row kernels above for the group's T.
template <int T>
void first_row(const Problem& p, int64_t g, int64_t r, int64_t c0, int64_t c1, __m256* part,
               int64_t rows, int64_t ahead, const float* xsum) {
  if (p.fmt == plk::kInt8) int8_row<T>(p, g, r, c0, c1, part, rows, c0 == 0, ahead);
  else int4_row<T>(p, g, r, c0, c1, part, rows, c0 == 0, ahead, xsum);
}

// Rows [r_begin, r_end) of group g: K in chunks whose weights (T x 16 KB at most) every row
// uses before the next chunk. The first row reads them from memory in address order, every
// tile at once, prefetching ahead; the other rows, from L1, in 2-row blocks
// one tile at a time (the registers for 2 rows x 4 tiles are not there). The sums wait in
// part ([T][rows][2] vectors) between chunks.
inline void quant_group(const Problem& p, int64_t g, int64_t r_begin, int64_t r_end,
                        __m256* part, const float* xsum) {
  const bool int8 = p.fmt == plk::kInt8;
  const int64_t steps = int8 ? p.k / 4 : p.k / kGroup;  // quads or scale groups
  const int64_t chunk = int8 ? kChunkQuads : kChunkGroups;
  const int64_t rows = r_end - r_begin;
  for (int64_t c0 = 0; c0 < steps; c0 += chunk) {
    const int64_t c1 = c0 + chunk < steps ? c0 + chunk : steps;
    // Bytes ahead to prefetch in the first row's pass: 1-16 KB measured alike, within the noise.
    const int64_t pf = plk::kPrefetch;
    switch (p.t) {
      case 1: first_row<1>(p, g, r_begin, c0, c1, part, rows, pf, xsum); break;
      case 2: first_row<2>(p, g, r_begin, c0, c1, part, rows, pf, xsum); break;
      default: first_row<4>(p, g, r_begin, c0, c1, part, rows, pf, xsum); break;
    }
    for (int64_t r0 = r_begin + 1; r0 < r_end; r0 += kQuantRows) {
      const bool two = r_end - r0 >= 2;
      for (int t = 0; t < p.t; ++t) {
        __m256* pp = part + (t * rows + r0 - r_begin) * 2;  // [T][rows][2]: a block's rows in a run
        if (int8 && two) int8_tile<2>(p, g, t, r0, c0, c1, pp, c0 == 0);
        else if (int8) int8_tile<1>(p, g, t, r0, c0, c1, pp, c0 == 0);
        else if (two) int4_tile<2>(p, g, t, r0, c0, c1, pp, c0 == 0, xsum);
        else int4_tile<1>(p, g, t, r0, c0, c1, pp, c0 == 0, xsum);
      }
    }
  }
  for (int64_t r = r_begin; r < r_end; ++r)
    for (int t = 0; t < p.t; ++t)
      store_tile(p, r, (g * p.t + t) * kTile, part + (t * rows + r - r_begin) * 2);
}

}  // namespace plk2
