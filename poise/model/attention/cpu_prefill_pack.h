// Packing the prefill kernel's key blocks (cpu_prefill_attention.cpp): each (chunk, kv head,
// key block) read once from the paged cache into the layout its products take. Included by
// that one file only (a header to keep each file short).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_kv_int8.h"
#include "cpu_prefill_blocks.h"

namespace poise_prefill {

using namespace poise_attention;

// One key block's n keys into the packed form (see Packed), from `slots[j]`: key j's K at
// slots[j] + k_off and its V at slots[j] + v_off. AMX: the values transposed instead,
// [HD][kKeys] bf16, keys past n zero (the tiles multiply whole 32-key chunks).
template <typename T, bool PAIRS, int HD, bool AMX>
void pack_rows(const T* const* slots, int n, int hd, int64_t k_off, int64_t v_off, T* k_dst,
               float* v_dst) {
  if constexpr (float_keys<HD, AMX>()) {  // the buffers have kKeys * hd floats of room
    float* kf = reinterpret_cast<float*>(k_dst);
    for (int j = 0; j < n; ++j)
      for (int d = 0; d < HD; ++d) kf[j * HD + d] = to_float(slots[j][k_off + d]);
  } else {
    for (int j = 0; j < n; ++j)
      std::memcpy(k_dst + static_cast<int64_t>(j) * hd, slots[j] + k_off, sizeof(T) * hd);
  }
  if constexpr (AMX) {
    bf16* vt = reinterpret_cast<bf16*>(v_dst);
    for (int d = 0; d < HD; ++d) {
      for (int j = 0; j < n; ++j) vt[d * kKeys + j] = slots[j][v_off + d];
      for (int j = n; j < kKeys; ++j) vt[d * kKeys + j] = 0;
    }
  } else if constexpr (PAIRS) {
#if defined(__AVX512BF16__)
    static const bf16 zeros[HD] = {};
    bf16* vp = reinterpret_cast<bf16*>(v_dst);
    for (int jp = 0; jp < (n + 1) / 2; ++jp) {  // vp[jp][d] = (v_2jp[d], v_2jp+1[d])
      const bf16* lo = slots[2 * jp] + v_off;
      const bf16* hi = 2 * jp + 1 < n ? slots[2 * jp + 1] + v_off : zeros;
      for (int d = 0; d < HD; d += 16)
        store_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + d)),
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + d)),
                    &vp[(jp * HD + d) * 2]);
    }
#endif
  } else {
    for (int j = 0; j < n; ++j)
      for (int d = 0; d < hd; ++d) v_dst[j * hd + d] = to_float(slots[j][v_off + d]);
  }
}

// Key block b of kv head g of chunk c, read from the paged cache once per call and packed.
// INT8 (the int8 cache, cpu_kv_int8.h): each key's K and V rows dequantized to T first (the
// values the float reference reads, kv_int8.dequantize_rows), then packed as T's are.
template <typename T, bool PAIRS, int HD, bool AMX, bool INT8, typename Chunks>
void pack_block(const Chunks& p, int c, int g, int64_t b, T* k_dst, float* v_dst) {
  const int hd = HD > 0 ? HD : p.head_dim;
  const int64_t kb = b * kKeys;
  const int n = static_cast<int>(
      std::min<int64_t>(kKeys, p.start_position[c] + p.query_len[c] - kb));
  const int64_t* table = p.tables + c * p.table_stride;
  const int64_t row = INT8 ? hd + kInt8ScaleBytes : hd;  // elements of one head's row
  const int64_t slot_stride = 2 * p.num_kv_heads * row;
  const int64_t k_off = g * row, v_off = (p.num_kv_heads + g) * row;
  const T* slots[kKeys];
  int64_t block = kb / p.block_size, in_block = kb % p.block_size;
  if constexpr (INT8) {
    thread_local std::vector<T> rows;  // [n][K row, V row] in T
    rows.resize(static_cast<size_t>(kKeys) * 2 * hd);
    const int8_t* cache = static_cast<const int8_t*>(p.kv_cache);
    for (int j = 0; j < n; ++j) {
      const int8_t* slot = cache + (table[block] * p.block_size + in_block) * slot_stride;
      T* dst = rows.data() + static_cast<int64_t>(j) * 2 * hd;
      dequantize_row(slot + k_off, hd, dst);
      dequantize_row(slot + v_off, hd, dst + hd);
      slots[j] = dst;
      if (++in_block == p.block_size) in_block = 0, ++block;
    }
    pack_rows<T, PAIRS, HD, AMX>(slots, n, hd, 0, hd, k_dst, v_dst);
  } else {
    const T* cache = static_cast<const T*>(p.kv_cache);
    for (int j = 0; j < n; ++j) {
      slots[j] = cache + (table[block] * p.block_size + in_block) * slot_stride;
      if (++in_block == p.block_size) in_block = 0, ++block;
    }
    pack_rows<T, PAIRS, HD, AMX>(slots, n, hd, k_off, v_off, k_dst, v_dst);
  }
}

}  // namespace poise_prefill
