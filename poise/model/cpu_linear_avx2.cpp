// Linear layers for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 / 3, Intel client cores):
// the same entry points and packed layouts as cpu_linear.cpp, built by linear_kernel.py in its
// place where the CPU lacks AVX512-BF16 / VNNI. Without it those CPUs ran torch's kernels
// (RESULTS.md "Linear layers on AVX2").
//
// - bf16 as stored: dot products in float32 for every row count (cpu_linear_avx2.h);
// - int8 and int4: 16-bit integer activations against the packed weights widened in registers
//   (cpu_linear_avx2_quant.h), every row count through the same blocks. No tiled path.
// Work goes to cpu_pool.h's pool as on AVX-512: channel blocks (bf16) or channel groups.
#include <vector>

#include "cpu_linear_avx2.h"
#include "cpu_linear_avx2_quant.h"
#include "cpu_linear_bf16_split.h"
#include "cpu_linear_problem.h"
#include "cpu_pool.h"

using plk::Problem;

namespace {
// Rows per pass over the weights: their activations and sums stay in L2 while every group's
// weights pass by.
constexpr int64_t kRowChunk = 128;
}  // namespace

extern "C" int poise_linear_bf16_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w,
                                      int64_t n, uint16_t* y, int threads) {
  if (k % 32) return 1;
  plk::bf16_rows_split(x, m, k, w, n, y, threads, plk2::kBf16Rows, plk2::dot_bf16_block);
  return 0;
}

// No AMX in this build (poise_linear_init() says so): nothing packs for it.
extern "C" int poise_linear_bf16_amx(const uint16_t*, int64_t, int64_t, const uint16_t*, int,
                                     int64_t, uint16_t*, int) {
  return 1;
}

extern "C" void poise_linear_threading(int openmp, int spin_us) {
  ppool::use_openmp().store(openmp != 0);
  ppool::Pool::instance().set_spin_us(spin_us);
}

extern "C" int poise_linear_init() { return 0; }

// y = x . W^T for packed W (cpu_linear.cpp's poise_linear; rowsum unused: the 16-bit
// activations are signed). tiled must be 0. Returns nonzero, writing nothing, when the shape
// does not fit (also k % 16, which linear_kernel.py's packing always meets).
extern "C" int poise_linear(const uint16_t* x, int64_t m, int64_t k, const void* w, int fmt,
                            int t, const float* scale, const uint16_t* dm, const int32_t* rowsum,
                            int64_t n, uint16_t* y, int tiled, int threads) {
  (void)rowsum;
  if (tiled || k % 16 || !plk::shape_fits(k, n, fmt, t, false)) return 1;
  static thread_local std::vector<int16_t> x16;
  static thread_local std::vector<float> xscale, xsum;
  x16.resize(m * k);
  xscale.resize(m);
  plk2::int16_activations(x, m, k, x16.data(), xscale.data());
  if (fmt == plk::kInt4) {
    xsum.resize(m * (k / plk::kGroup));
    plk2::int4_sums(x, m, k, xsum.data());
  }
  Problem p{x, m, k, n, static_cast<const uint8_t*>(w), fmt, t, scale, dm, nullptr, y,
            nullptr, nullptr, xscale.data(), x16.data()};
  const float* sums = xsum.data();
  const int64_t groups = n / (plk::kTile * t);
  for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
    const int64_t c1 = c0 + kRowChunk < m ? c0 + kRowChunk : m;
    ppool::parallel_for(groups, threads, [&](int64_t g) {
      static thread_local std::vector<__m256> part;  // the running thread's
      if (part.size() < size_t(kRowChunk * 4 * 2)) part.resize(kRowChunk * 4 * 2);
      plk2::quant_group(p, g, c0, c1, part.data(), sums);
    });
  }
  return 0;
}
