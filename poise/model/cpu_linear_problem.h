// The problem every linear-layer kernel solves (cpu_linear.cpp for AVX-512, cpu_linear_avx2.cpp
// for AVX2): the packed formats' constants, the call's arguments, and which shapes a packing
// takes. No vector types here: both builds include it.
#pragma once

#include <immintrin.h>

#include <cstdint>

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
  // AVX2 (cpu_linear_avx2.cpp): x as 16-bit integers, x = xscale[r] * x16, [m, k].
  const int16_t* x16 = nullptr;
};

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// int32 holds the int8 sums for k <= 16384 (cpu_linear_int8.h).
constexpr int64_t kInt8MaxK = 16384;

inline bool shape_fits(int64_t k, int64_t n, int fmt, int t, bool tiled) {
  if ((t != 1 && t != 2 && t != 4) || n % (kTile * t)) return false;
  if (fmt == kInt8) return k % (tiled ? kQuadBlock : 4) == 0 && k <= kInt8MaxK;
  return fmt == kInt4 && k % kGroup == 0;
}

}  // namespace plk
