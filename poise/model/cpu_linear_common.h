// Shared parts of the AVX-512 linear-layer kernels (cpu_linear.cpp): AMX tile set-up and the
// small vector helpers every path uses (the problem and the formats: cpu_linear_problem.h).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_linear_problem.h"

// The tiled path needs AMX (int8 and bf16 tiles) from the compiler's -march=native: built only
// where the build machine has it, so the same sources compile on AVX-512 CPUs without AMX (AMD
// Zen 4), where poise_linear_init() reports no AMX and every call takes the streamed path.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define PLK_AMX 1
#endif

namespace plk {

inline __m512bh bcast_pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

inline __m512i bcast_quad(const uint8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// d and m of one tile and int4 group as float32 (dm: [2][16] bf16).
inline void load_dm(const uint16_t* dm, __m512* d, __m512* m) {
  *d = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
  *m = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 16)));
}

inline void store_row(uint16_t* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

#if defined(PLK_AMX)
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Eight tiles of 64 bytes per row: 0-3 accumulators, 4-5 A (rows of x), 6-7 B (weights), 16
// rows each; `rows` < 16: the accumulators and A tiles that many (a call with fewer rows of x
// loads and stores only those; each output row is computed from its own A row either way).
inline void configure_tiles(int rows = 16) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = i < 6 ? rows : 16;
  }
  _tile_loadconfig(&c);
}

#endif  // PLK_AMX

}  // namespace plk
