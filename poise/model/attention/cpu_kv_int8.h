// The int8 KV cache in the CPU kernels (layout and quantization rule: kv_int8.py). Each
// (token slot, head) row: head_dim int8 values, then the row's scale as a bf16 (2 bytes, not
// aligned). Shared by the writer (cpu_kv_write.cpp), the decode kernel
// (cpu_paged_attention_int8.cpp) and the prefill kernel's packing (cpu_prefill_attention.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_attention_common.h"

namespace poise_attention {

constexpr int kInt8ScaleBytes = 2;

// The scale stored after a row of hd values.
inline float row_scale(const int8_t* row, int hd) {
  bf16 s;
  std::memcpy(&s, row + hd, sizeof s);
  return to_float(s);
}

#if defined(__AVX512F__)
// 16 int8 values widened to float (exact).
inline __m512 load16_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// s = max|x| / 127 rounded up to a bf16 (its bits: the float's high half, plus one where any
// low bit is set); NaN anywhere makes it NaN, an inf makes it inf.
inline float int8_scale(float amax, bool nan) {
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  float s = amax / 127.0f;
  uint32_t bits;
  std::memcpy(&bits, &s, sizeof bits);
  bits = (bits + 0xFFFFu) & 0xFFFF0000u;
  std::memcpy(&s, &bits, sizeof s);
  return s;
}

// One row of hd values (float or bf16) -> hd int8 values and the bf16 scale at dst + hd:
// round half to even of x / s, clamped to +-127 (the same bits as kv_int8.quantize_rows).
template <typename T>
inline void quantize_row(const T* x, int hd, int8_t* dst) {
  float amax = 0.0f;
  bool nan = false;
  for (int d = 0; d < hd; ++d) {
    const float a = std::fabs(to_float(x[d]));
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  const float s = int8_scale(amax, nan);
  bf16 sb;
  from_float(s, &sb);  // exact: s is a bf16 (or NaN, which stays NaN)
  std::memcpy(dst + hd, &sb, sizeof sb);
  if (!(s > 0.0f) || nan) {  // zeros (or a NaN row: its scale already says so)
    std::memset(dst, 0, hd);
    return;
  }
  int d = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (; d + 16 <= hd; d += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load16(x + d), sv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtsepi32_epi8(q));
  }
#endif
  for (; d < hd; ++d) {
    const float r = std::nearbyint(to_float(x[d]) / s);
    dst[d] = static_cast<int8_t>(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
  }
}

// One int8 row -> hd values of T: int8 * scale (exact in float), rounded once to T.
template <typename T>
inline void dequantize_row(const int8_t* row, int hd, T* dst) {
  const float s = row_scale(row, hd);
  for (int d = 0; d < hd; ++d) from_float(static_cast<float>(row[d]) * s, dst + d);
}

}  // namespace poise_attention
