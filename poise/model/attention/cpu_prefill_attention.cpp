// Prefill attention for CPU: every query of a prompt chunk against its request's keys up to its
// own position (causal), read in place from the paged KV cache through the chunk's block table.
// No gather copy of the context, no dense mask: the cost is the causal pairs, not context^2.
//
// Flash-attention style. A work item is (chunk, block of kQueries queries, kv head g): its rows
// are those queries times the G query heads that share kv head g (GQA, as transformers'
// repeat_kv: query head h uses kv head h / G). Q is held transposed (16 rows per vector) and
// the item walks the keys in blocks of kKeys, each read once for all of its rows:
//   S = Q K^T * scale: each key's elements broadcast against 16 rows' q (bf16 pairs through
//     AVX512-BF16 dpbf16 when the inputs are bf16 and the CPU has it, float FMAs otherwise,
//     plain loops without AVX-512);
//   online softmax, 16 rows per vector: key j is visible to a row iff j <= its position,
//     m' = max(m, max S), P = e^(S - m'), O = O e^(m - m') + P V (bf16 pairs again), l likewise;
// then O / l is written once, rounded to the output dtype. Items run under OpenMP, one kv head
// after the other and within it the most expensive (last query blocks, most keys) first, so
// the causal triangle balances. Before them, every key block of every kv head is read from
// the paged cache once and packed (keys as rows, values as the bf16 pairs P V takes), shared
// by all the items that read it instead of gathered by each.
//
// On CPUs with AMX (checked at run time: cpu_prefill_amx.h) bf16 items run the same walk with
// Q K^T and P V on AMX tiles (the values packed transposed for them, O held transposed).
//
// Numerics: float32 accumulation everywhere (bf16 products are exact in float32); on the bf16
// path P is rounded to bf16 for P V, as flash attention does. Shapes as in
// cpu_paged_attention.cpp; chunk c is the flat tokens query_start[c] .. + query_len[c], at
// positions start_position[c] .., block table row c of `tables`.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_kv_int8.h"
#include "cpu_prefill_amx.h"
#include "cpu_prefill_blocks.h"

namespace {

using namespace poise_attention;
using namespace poise_prefill;

constexpr int kQueries = 32;  // queries per work item

struct Chunks {  // the arguments of poise_paged_prefill
  const void *q, *kv_cache;
  int64_t q_token_stride;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t *query_start, *query_len, *start_position;
  int num_chunks, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  void* out;
  int64_t out_token_stride;
};

struct Item {  // (chunk, first query, kv head); cost: keys its last query sees
  int chunk, first_query, kv_head;
  int64_t cost;
};

// One key block's n keys into the packed form (see Packed), from `slots[j]`: key j's K at
// slots[j] + k_off and its V at slots[j] + v_off. AMX: the values transposed instead,
// [HD][kKeys] bf16, keys past n zero (the tiles multiply whole 32-key chunks).
template <typename T, bool PAIRS, int HD, bool AMX>
void pack_rows(const T* const* slots, int n, int hd, int64_t k_off, int64_t v_off, T* k_dst,
               float* v_dst) {
  for (int j = 0; j < n; ++j)
    std::memcpy(k_dst + static_cast<int64_t>(j) * hd, slots[j] + k_off, sizeof(T) * hd);
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
template <typename T, bool PAIRS, int HD, bool AMX, bool INT8>
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

// `blocks`: the packed blocks of this item's (chunk, kv head), block b at blocks[b]. AMX: the
// products on tiles (cpu_prefill_amx.h; O held transposed), else on vectors.
template <typename T, bool PAIRS, int HD, bool AMX>
void attend_item(const Chunks& p, const Item& it, Scratch& w, const Packed* blocks) {
  const int hd = HD > 0 ? HD : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads, g = it.kv_head;
  const int nq = std::min<int>(kQueries, static_cast<int>(p.query_len[it.chunk]) - it.first_query);
  const int rows = nq * G;
  const int rp = (rows + kRowAlign - 1) / kRowAlign * kRowAlign;
  const int64_t first_pos = p.start_position[it.chunk] + it.first_query;
  const int64_t key_end = first_pos + nq;  // keys 0 .. key_end - 1
  const int64_t token0 = p.query_start[it.chunk] + it.first_query;

  // Row r = (query r / G, head g * G + r % G); rows past `rows` are zero padding (never
  // written out; they see key 0 so their softmax stays finite).
  for (int r = 0; r < rp; ++r) {
    const T* src = r < rows ? static_cast<const T*>(p.q) + (token0 + r / G) * p.q_token_stride +
                                  static_cast<int64_t>(g * G + r % G) * hd
                            : nullptr;
    if constexpr (PAIRS) {
      for (int d = 0; d < hd / 2; ++d) {
        uint32_t pair = 0;
        if (src) std::memcpy(&pair, src + 2 * d, sizeof pair);
        w.qp[d * rp + r] = pair;
      }
    } else {
      for (int d = 0; d < hd; ++d) w.qt[d * rp + r] = src ? to_float(src[d]) : 0.0f;
    }
  }
  std::fill(w.o.begin(), w.o.begin() + static_cast<size_t>(rp) * hd, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rp, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rp, 0.0f);

  if constexpr (AMX) {
#if defined(POISE_PREFILL_AMX)
    amx_walk<HD>(w, blocks, rp, key_end, first_pos, G, p.scale);
#endif
  } else {
    for (int64_t kb = 0; kb < key_end; kb += kKeys) {
      const int n = static_cast<int>(std::min<int64_t>(kKeys, key_end - kb));
      const int n2 = (n + 1) & ~1;
      const Packed& b = blocks[kb / kKeys];
      const bool masked = kb + n - 1 > first_pos;  // some key past the first query: the diagonal
      if (masked)
        for (int r = 0; r < rp; ++r)
          w.pos[r] = static_cast<int32_t>(std::min<int64_t>(first_pos + r / G - kb, kKeys));
      scores<T, PAIRS, HD>(w, b, rp, hd, n, p.scale);
      if (masked)
        softmax_block<PAIRS, true>(w, rp, n, n2);
      else
        softmax_block<PAIRS, false>(w, rp, n, n2);
      accumulate<T, PAIRS, HD>(w, b, rp, hd, n, n2);
    }
  }

  for (int r = 0; r < rows; ++r) {
    T* dst = static_cast<T*>(p.out) + (token0 + r / G) * p.out_token_stride +
             static_cast<int64_t>(g * G + r % G) * hd;
    const float inv = 1.0f / w.l[r];  // > 0: key 0 is visible to every query
    if constexpr (AMX) {  // O^T: [hd][rp]
      for (int d = 0; d < hd; ++d) from_float(w.o[d * rp + r] * inv, dst + d);
    } else {
      for (int d = 0; d < hd; ++d) from_float(w.o[r * hd + d] * inv, dst + d);
    }
  }
}

template <typename T, bool PAIRS, int HD, bool AMX = false, bool INT8 = false>
void run(const Chunks& p, int num_threads) {
  std::vector<Item> items;
  for (int c = 0; c < p.num_chunks; ++c)
    for (int q0 = 0; q0 < p.query_len[c]; q0 += kQueries)
      for (int g = 0; g < p.num_kv_heads; ++g)
        items.push_back({c, q0, g, p.start_position[c] + q0 + kQueries});
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) {
                     return a.kv_head != b.kv_head ? a.kv_head < b.kv_head : a.cost > b.cost;
                   });
  const int G = p.num_heads / p.num_kv_heads;
  const int rp = (kQueries * G + kRowAlign - 1) / kRowAlign * kRowAlign;
  const int num_items = static_cast<int>(items.size());
  const int hd = HD > 0 ? HD : p.head_dim;
  // Every (chunk, kv head, key block), packed once and shared by the items that read it
  // (each block is read by every query block after it: ~context / 64 items).
  std::vector<int64_t> first_block(p.num_chunks + 1, 0);  // chunk c's at [c] + g * count
  for (int c = 0; c < p.num_chunks; ++c) {
    const int64_t count = (p.start_position[c] + p.query_len[c] + kKeys - 1) / kKeys;
    first_block[c + 1] = first_block[c] + count * p.num_kv_heads;
  }
  const int64_t num_blocks = first_block[p.num_chunks];
  const size_t block_room = static_cast<size_t>(kKeys) * hd;  // floats, for K and for V
  // Kept by the calling thread from call to call (each layer's call needs the same room): a
  // fresh allocation of this size is a fresh mapping, page-faulted in again every call. Its
  // size: about twice one layer's K/V of the step's longest contexts, in float32.
  thread_local AlignedVector<float> room;
  if (room.size() < 2 * num_blocks * block_room) room.resize(2 * num_blocks * block_room);
  float* const k_room = room.data();
  float* const v_room = k_room + num_blocks * block_room;
  std::vector<Packed> packed(num_blocks);
  for (int64_t i = 0; i < num_blocks; ++i)
    packed[i] = {k_room + i * block_room, v_room + i * block_room};
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_blocks; ++i) {
      const int c = static_cast<int>(
          std::upper_bound(first_block.begin(), first_block.end(), i) - first_block.begin() - 1);
      const int64_t count = (first_block[c + 1] - first_block[c]) / p.num_kv_heads;
      const int64_t local = i - first_block[c];
      pack_block<T, PAIRS, HD, AMX, INT8>(p, c, static_cast<int>(local / count), local % count,
                               reinterpret_cast<T*>(k_room + i * block_room),
                               v_room + i * block_room);
    }
    Scratch w(rp, p.head_dim);
#if defined(POISE_PREFILL_AMX)
    if constexpr (AMX) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < num_items; ++k) {
      const Item& it = items[k];
      const int64_t count = (first_block[it.chunk + 1] - first_block[it.chunk]) / p.num_kv_heads;
      attend_item<T, PAIRS, HD, AMX>(p, it, w,
                                     packed.data() + first_block[it.chunk] + it.kv_head * count);
    }
#if defined(POISE_PREFILL_AMX)
    if constexpr (AMX) _tile_release();
#endif
  }
}

// Whether bf16 prefills run on AMX tiles: where available (cpu_prefill_amx.h), unless
// poise_prefill_use_amx(0) turned them off (tests compare both paths on one machine).
std::atomic<bool> use_amx{true};

// INT8: the int8 KV cache, on the vector path only (its blocks are dequantized when packed, so
// AMX could take them too, but no machine here has AMX to test that on).
template <typename T, bool PAIRS, bool INT8 = false>
void dispatch_head_dim(const Chunks& p, int num_threads) {
#if defined(POISE_PREFILL_AMX)
  if constexpr (PAIRS && !INT8) {
    if (use_amx.load(std::memory_order_relaxed) && amx_available()) {
      if (p.head_dim == 64) return run<T, PAIRS, 64, true>(p, num_threads);
      if (p.head_dim == 128) return run<T, PAIRS, 128, true>(p, num_threads);
    }
  }
#endif
  switch (p.head_dim) {
    case 64:
      run<T, PAIRS, 64, false, INT8>(p, num_threads);
      break;
    case 128:
      run<T, PAIRS, 128, false, INT8>(p, num_threads);
      break;
    default:
      run<T, false, 0, false, INT8>(p, num_threads);  // the plain loops work in float
  }
}

// kv_int8 0: the cache holds q's dtype; 1: the int8 cache (kv_int8.py), head_dim being q's.
int paged_prefill(int dtype, int kv_int8, const void* q, int64_t q_token_stride,
                  const void* kv_cache, const int64_t* tables, int64_t table_stride,
                  const int64_t* query_start, const int64_t* query_len,
                  const int64_t* start_position, int num_chunks, int num_heads, int num_kv_heads,
                  int head_dim, int block_size, float scale, void* out, int64_t out_token_stride,
                  int num_threads) {
  if (num_chunks <= 0) return 0;
  if (bad_shape(num_heads, num_kv_heads, head_dim, block_size)) return -1;
  const Chunks p{q,          kv_cache,  q_token_stride, tables,     table_stride, query_start,
                 query_len,  start_position, num_chunks, num_heads,  num_kv_heads, head_dim,
                 block_size, scale,     out,            out_token_stride};
  const int threads = std::max(num_threads, 1);
#if defined(__AVX512BF16__)
  constexpr bool kPairs = true;
#else
  constexpr bool kPairs = false;
#endif
  if (dtype == 0) {
    kv_int8 ? dispatch_head_dim<float, false, true>(p, threads)
            : dispatch_head_dim<float, false>(p, threads);
  } else if (dtype == 1) {
    kv_int8 ? dispatch_head_dim<bf16, kPairs, true>(p, threads)
            : dispatch_head_dim<bf16, kPairs>(p, threads);
  } else {
    return -2;
  }
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Returns 0 on success, a negative code on bad arguments.
int poise_paged_prefill(int dtype, const void* q, int64_t q_token_stride, const void* kv_cache,
                        const int64_t* tables, int64_t table_stride, const int64_t* query_start,
                        const int64_t* query_len, const int64_t* start_position, int num_chunks,
                        int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, void* out, int64_t out_token_stride, int num_threads) {
  return paged_prefill(dtype, 0, q, q_token_stride, kv_cache, tables, table_stride, query_start,
                       query_len, start_position, num_chunks, num_heads, num_kv_heads, head_dim,
                       block_size, scale, out, out_token_stride, num_threads);
}

// The same over the int8 KV cache (cache rows of head_dim + 2 bytes, cpu_kv_int8.h).
int poise_paged_prefill_int8(int dtype, const void* q, int64_t q_token_stride,
                             const void* kv_cache, const int64_t* tables, int64_t table_stride,
                             const int64_t* query_start, const int64_t* query_len,
                             const int64_t* start_position, int num_chunks, int num_heads,
                             int num_kv_heads, int head_dim, int block_size, float scale,
                             void* out, int64_t out_token_stride, int num_threads) {
  return paged_prefill(dtype, 1, q, q_token_stride, kv_cache, tables, table_stride, query_start,
                       query_len, start_position, num_chunks, num_heads, num_kv_heads, head_dim,
                       block_size, scale, out, out_token_stride, num_threads);
}

// enable: 1 lets bf16 prefills use AMX tiles where the CPU and the OS allow them (the
// default), 0 keeps them on the AVX512-BF16 vectors, -1 only asks. Returns whether they use
// AMX now.
int poise_prefill_use_amx(int enable) {
  if (enable >= 0) use_amx.store(enable != 0);
#if defined(POISE_PREFILL_AMX)
  return use_amx.load() && amx_available() ? 1 : 0;
#else
  return 0;
#endif
}

}  // extern "C"
