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
//     8-row AVX2 vectors on float keys without AVX-512: cpu_prefill_avx2.h);
//   online softmax, 16 rows per vector: key j is visible to a row iff j <= its position,
//     m' = max(m, max S), P = e^(S - m'), O = O e^(m - m') + P V (bf16 pairs again), l likewise;
// then O / l is written once, rounded to the output dtype (one item: cpu_prefill_items.h).
// Items run on the pool (cpu_pool.h; OpenMP on AMX), one kv head after the other and within it the most expensive (last query blocks, most keys) first, so
// the causal triangle balances. Before them, every key block of every kv head is read from
// the paged cache once and packed (keys as rows, values as the bf16 pairs P V takes), shared
// by all the items that read it instead of gathered by each, and by every chunk whose block
// table begins with the same blocks; on the vector path such chunks' rows walk those blocks
// together first (stacked items, cpu_prefill_share.h), then each item goes on from its rows'
// state. An item's rows are padded to 16 on the vector path, to 32 on AMX.
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
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_kv_int8.h"
#include "cpu_prefill_amx.h"
#include "cpu_prefill_blocks.h"
#include "cpu_prefill_items.h"
#include "cpu_prefill_pack.h"
#include "cpu_prefill_share.h"
#include "../cpu_pool.h"

namespace {

using namespace poise_attention;
using namespace poise_prefill;

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

template <typename T, bool PAIRS, int HD, bool AMX = false, bool INT8 = false>
void run(const Chunks& p, int num_threads) {
  const int G = p.num_heads / p.num_kv_heads;
  const int rp = padded_rows(kQueries * G, true);  // room for either path's largest item
  const int hd = HD > 0 ? HD : p.head_dim;
  std::vector<int64_t> first_block(p.num_chunks + 1, 0);  // chunk c's at [c] + g * count
  for (int c = 0; c < p.num_chunks; ++c) {
    const int64_t count = (p.start_position[c] + p.query_len[c] + kKeys - 1) / kKeys;
    first_block[c + 1] = first_block[c] + count * p.num_kv_heads;
  }
  auto count = [&](int c) { return (first_block[c + 1] - first_block[c]) / p.num_kv_heads; };
  // Key blocks the chunks share, and groups that walk them together (no AMX variant of the
  // stacked walk: there they are only packed once).
  const Sharing share = find_sharing(p, first_block, kKeys, !AMX, G, hd);
  std::vector<float> state(share.state_floats);

  std::vector<StackedItem> stacked;
  for (size_t gi = 0; gi < share.groups.size(); ++gi)
    for (int g = 0; g < p.num_kv_heads; ++g)
      for (int64_t r0 = 0; r0 < share.groups[gi].row_start.back(); r0 += kQueries * G)
        stacked.push_back({static_cast<int>(gi), g, r0,
                           std::min<int64_t>(kQueries * G, share.groups[gi].row_start.back() - r0)});
  std::vector<Item> items;
  for (int c = 0; c < p.num_chunks; ++c) {
    const int gi = share.group_of[c];
    const int64_t skipped = gi < 0 ? 0 : share.groups[gi].shared_blocks * kKeys;
    for (int q0 = 0; q0 < p.query_len[c]; q0 += kQueries)
      for (int g = 0; g < p.num_kv_heads; ++g)
        items.push_back({c, q0, g, p.start_position[c] + q0 + kQueries - skipped});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) {
                     return a.kv_head != b.kv_head ? a.kv_head < b.kv_head : a.cost > b.cost;
                   });
  const int num_items = static_cast<int>(items.size());
  const int num_stacked = static_cast<int>(stacked.size());
  auto chunk_of = [&](int64_t i) {
    return static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), i) -
                            first_block.begin() - 1);
  };
  // Chunks of one query block that share no key block with another chunk (a lone prompt tail
  // after its cached context): each of their blocks is read by one item only, so that item
  // packs it as it walks, into its thread's one-block buffer, which stays in L1. Packed ahead,
  // the tail wrote its whole context's K and V out and read them back: 3 queries after 3,360
  // cached tokens cost 24.9 ms per 30-layer step against 19.2 as decode rows (one thread),
  // 22.4 packed as they walk. The same packing either way, so the same bits. Not on AMX (its
  // walk takes the array).
  std::vector<char> lazy(p.num_chunks, 0);
  if constexpr (!AMX) {
    std::vector<char> shares(p.num_chunks, 0);
    for (int64_t i = 0; i < first_block[p.num_chunks]; ++i)
      if (share.origin[i] != i) shares[chunk_of(i)] = shares[chunk_of(share.origin[i])] = 1;
    for (int c = 0; c < p.num_chunks; ++c)
      lazy[c] = !shares[c] && share.group_of[c] < 0 && p.query_len[c] <= kQueries;
  }
  // Every other distinct (chunk, kv head, key block), packed once and shared by the items that
  // read it (each block is read by every query block after it: ~context / 64 items).
  std::vector<int64_t> unique;
  for (int64_t i = 0; i < first_block[p.num_chunks]; ++i)
    if (share.origin[i] == i && !lazy[chunk_of(i)]) unique.push_back(i);
  const int64_t num_unique = static_cast<int64_t>(unique.size());
  const size_t block_room = static_cast<size_t>(kKeys) * hd;  // floats, for K and for V
  // Kept by the calling thread from call to call (each layer's call needs the same room): a
  // fresh allocation of this size is a fresh mapping, page-faulted in again every call. Its
  // size: about twice one layer's K/V of the step's longest contexts, in float32.
  thread_local AlignedVector<float> room;
  if (room.size() < 2 * num_unique * block_room) room.resize(2 * num_unique * block_room);
  float* const k_room = room.data();
  float* const v_room = k_room + num_unique * block_room;
  std::vector<Packed> packed(first_block[p.num_chunks]);
  for (int64_t u = 0; u < num_unique; ++u)
    packed[unique[u]] = {k_room + u * block_room, v_room + u * block_room};
  for (size_t i = 0; i < packed.size(); ++i) packed[i] = packed[share.origin[i]];
  auto blocks_of = [&](int c, int g) { return packed.data() + first_block[c] + g * count(c); };
  auto pack_unique = [&](int64_t u) {
    const int64_t i = unique[u];
    const int c = chunk_of(i);
    const int64_t local = i - first_block[c];
    pack_block<T, PAIRS, HD, AMX, INT8>(p, c, static_cast<int>(local / count(c)),
                                        local % count(c),
                                        reinterpret_cast<T*>(k_room + u * block_room),
                                        v_room + u * block_room);
  };
  // Item k on the running thread (w: its scratch; own: its one-block buffer for lazy chunks).
  auto attend_one = [&](int64_t k, Scratch& w, AlignedVector<float>& own) {
    if (own.size() < 2 * block_room) own.resize(2 * block_room);
    const Packed own_block{own.data(), own.data() + block_room};
    const Item& it = items[k];
    const int gi = share.group_of[it.chunk];
    int64_t kb_from = 0;
    const float* from = nullptr;
    if (gi >= 0) {
      const ShareGroup& grp = share.groups[gi];
      kb_from = grp.shared_blocks * kKeys;
      from = row_state(state.data(), grp, it.kv_head,
                       share.group_row[it.chunk] + static_cast<int64_t>(it.first_query) * G, hd);
    }
    const Packed* blocks = blocks_of(it.chunk, it.kv_head);
    if (lazy[it.chunk]) {
      auto pack_now = [&](int64_t b) -> const Packed& {
        pack_block<T, PAIRS, HD, AMX, INT8>(p, it.chunk, it.kv_head, b,
                                            reinterpret_cast<T*>(own.data()),
                                            own.data() + block_room);
        return own_block;
      };
      attend_item<T, PAIRS, HD, AMX>(p, it, w, blocks, pack_now, kb_from, from);
    } else {
      auto packed_at = [blocks](int64_t b) -> const Packed& { return blocks[b]; };
      attend_item<T, PAIRS, HD, AMX>(p, it, w, blocks, packed_at, kb_from, from);
    }
  };
  if constexpr (AMX) {
    // An OpenMP region: each thread configures its tiles once for all its items.
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
      for (int64_t u = 0; u < num_unique; ++u) pack_unique(u);
      Scratch w(rp, p.head_dim);
      thread_local AlignedVector<float> own;
#if defined(POISE_PREFILL_AMX)
      amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
      for (int k = 0; k < num_items; ++k) attend_one(k, w, own);
#if defined(POISE_PREFILL_AMX)
      _tile_release();
#endif
    }
  } else {
    // On the pool (cpu_pool.h): a prompt tail's call is short, and a passive OpenMP region
    // with its two inner barriers slept and woke up to three times per layer.
    ppool::parallel_for(num_unique, num_threads, pack_unique);
    ppool::parallel_for(num_stacked, num_threads, [&](int64_t k) {
      const StackedItem& it = stacked[k];
      const ShareGroup& grp = share.groups[it.group];
      attend_stacked<T, PAIRS, HD>(p, grp, it, thread_scratch(rp, p.head_dim),
                                   blocks_of(grp.members[0], it.kv_head), state.data());
    });
    ppool::parallel_for(num_items, num_threads, [&](int64_t k) {
      thread_local AlignedVector<float> own;
      attend_one(k, thread_scratch(rp, p.head_dim), own);
    });
  }
}

// Whether bf16 prefills run on AMX tiles: where available (cpu_prefill_amx.h), unless
// poise_prefill_use_amx(0) turned them off (tests compare both paths on one machine).
std::atomic<bool> use_amx{true};

// INT8: the int8 KV cache, its blocks dequantized to bf16 as they are packed, so the same block
// math runs after (on AMX tiles too: a cold 3,363-token prefill's attention on the embedded
// model: RESULTS.md "The decode linears on the pool, int8 KV prefill and decode attention on
// AMX").
template <typename T, bool PAIRS, bool INT8 = false>
void dispatch_head_dim(const Chunks& p, int num_threads) {
#if defined(POISE_PREFILL_AMX)
  if constexpr (PAIRS) {
    if (use_amx.load(std::memory_order_relaxed) && amx_available()) {
      if (p.head_dim == 64) return run<T, PAIRS, 64, true, INT8>(p, num_threads);
      if (p.head_dim == 128) return run<T, PAIRS, 128, true, INT8>(p, num_threads);
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
