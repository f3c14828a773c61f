// Shared parts of the linear-layer kernels (cpu_linear.cpp): the problem, the formats, AMX
// tile set-up, and the small vector helpers every path uses.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// The tiled path needs AMX (int8 and bf16 tiles) from the compiler's -march=native: built only
// where the build machine has it, so the same sources compile on AVX-512 CPUs without AMX (AMD
// Zen 4), where poise_linear_init() reports no AMX and every call takes the streamed path.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define PLK_AMX 1
#endif

namespace plk {

constexpr int kTile = 16;   // output channels per vector / AMX tile column block
constexpr int kGroup = 32;  // int4 inputs per scale group (= a bf16 AMX K block)
constexpr int kQuadBlock = 64;  // int8 inputs per AMX K block (16 rows of 4)
// Bytes ahead of the streamed weights to prefetch: one sequential stream per group, and the
// hardware prefetcher alone keeps too few lines in flight (int8 from DRAM on one core:
// 8 GB/s without, 13 GB/s with).
constexpr int64_t kPrefetch = 2048;
enum Format { kInt8 = 1, kInt4 = 2 };  // linear_kernel.FORMATS

struct Problem {
  const uint16_t* x;  // [m, k] bf16
  int64_t m, k, n;
  const uint8_t* w;    // packed (cpu_linear.cpp's header comment)
  int fmt, t;          // format, tiles per group
  const float* scale;   // int8: [n]
  const uint16_t* dm;   // int4: d and m in bf16, [n / 16][k / 32][2][16]
  const int32_t* rowsum;  // int8: sum of q over each output channel [n]
  uint16_t* y;            // [m, n] bf16
  // int8 activations, made per call: x = xscale[r] * (256 * (hi - 128) + lo), [m_pad, k] u8.
  const uint8_t* xlo;
  const uint8_t* xhi;
  const float* xscale;
};

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

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
