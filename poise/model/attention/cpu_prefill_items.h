// One work item of the prefill kernel (cpu_prefill_attention.cpp): a block of up to kQueries
// queries of one chunk and one kv head walking its keys, or a stacked item walking a group's
// shared blocks (cpu_prefill_share.h); and the running thread's scratch for them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_prefill_amx.h"
#include "cpu_prefill_blocks.h"
#include "cpu_prefill_share.h"

namespace poise_prefill {

using namespace poise_attention;

constexpr int kQueries = 32;  // queries per work item

struct Item {  // (chunk, first query, kv head); cost: keys its last query sees
  int chunk, first_query, kv_head;
  int64_t cost;
};

// `blocks`: the packed blocks of this item's (chunk, kv head), block b at blocks[b]; on the
// vector path read through block_at(b), which may pack it just then instead. AMX: the products
// on tiles (cpu_prefill_amx.h; O held transposed), else on vectors. state: where its chunk's
// group walked key blocks 0 .. kb_from / kKeys - 1 for it (cpu_prefill_share.h), its rows'
// state after them; null (kb_from 0) to walk every block.
template <typename T, bool PAIRS, int HD, bool AMX, typename BlockAt, typename Chunks>
void attend_item(const Chunks& p, const Item& it, Scratch& w, const Packed* blocks,
                 BlockAt&& block_at, int64_t kb_from, const float* state) {
  const int hd = HD > 0 ? HD : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads, g = it.kv_head;
  const int nq = std::min<int>(kQueries, static_cast<int>(p.query_len[it.chunk]) - it.first_query);
  const int rows = nq * G;
  const int rp = padded_rows(rows, AMX);
  const int64_t first_pos = p.start_position[it.chunk] + it.first_query;
  const int64_t key_end = first_pos + nq;  // keys 0 .. key_end - 1
  const int64_t token0 = p.query_start[it.chunk] + it.first_query;

  // Row r = (query r / G, head g * G + r % G); rows past `rows` are zero padding (never
  // written out; they see key 0, or the diagonal block's keys, so their softmax stays finite).
  load_q<T, PAIRS>(w, rp, hd, [&](int r) -> const T* {
    return r < rows ? static_cast<const T*>(p.q) + (token0 + r / G) * p.q_token_stride +
                          static_cast<int64_t>(g * G + r % G) * hd
                    : nullptr;
  });
  load_state(w, rp, rows, hd, state);

  if constexpr (AMX) {
#if defined(POISE_PREFILL_AMX)
    amx_walk<HD>(w, blocks, rp, key_end, first_pos, G, p.scale);  // kb_from is 0 (no groups)
#endif
  } else {
    (void)blocks;
    walk_vector<T, PAIRS, HD>(w, block_at, kb_from, key_end, first_pos, rp, hd, G, p.scale);
  }

  for (int r = 0; r < rows; ++r) {
    T* dst = static_cast<T*>(p.out) + (token0 + r / G) * p.out_token_stride +
             static_cast<int64_t>(g * G + r % G) * hd;
    const float inv = 1.0f / w.l[r];  // > 0: every row has seen some key
    if constexpr (AMX) {  // O^T: [hd][rp]
      for (int d = 0; d < hd; ++d) from_float(w.o[d * rp + r] * inv, dst + d);
    } else {
      for (int d = 0; d < hd; ++d) from_float(w.o[r * hd + d] * inv, dst + d);
    }
  }
}

struct StackedItem {  // rows first_row .. + num_rows of a group, kv head g: the shared blocks
  int group, kv_head;
  int64_t first_row, num_rows;
};

// A stacked item (cpu_prefill_share.h): its rows, from any of the group's members, walk the
// group's shared key blocks (before every member's queries: no mask) through `blocks` (the
// shared copies), and leave each row's state in the state buffer for the members' own items.
template <typename T, bool PAIRS, int HD, typename Chunks>
void attend_stacked(const Chunks& p, const ShareGroup& grp, const StackedItem& it, Scratch& w,
                    const Packed* blocks, float* state) {
  const int hd = HD > 0 ? HD : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads;
  const int rows = static_cast<int>(it.num_rows);
  const int rp = padded_rows(rows, false);
  load_q<T, PAIRS>(w, rp, hd, [&](int r) -> const T* {
    if (r >= rows) return nullptr;
    const int64_t row = it.first_row + r;
    const size_t i = static_cast<size_t>(
        std::upper_bound(grp.row_start.begin(), grp.row_start.end(), row) -
        grp.row_start.begin() - 1);
    const int64_t local = row - grp.row_start[i];
    const int64_t token = p.query_start[grp.members[i]] + local / G;
    return static_cast<const T*>(p.q) + token * p.q_token_stride +
           static_cast<int64_t>(it.kv_head * G + local % G) * hd;
  });
  load_state(w, rp, rows, hd, nullptr);
  const int64_t shared_keys = grp.shared_blocks * kKeys;
  walk_vector<T, PAIRS, HD>(w, [blocks](int64_t b) -> const Packed& { return blocks[b]; }, 0,
                            shared_keys, shared_keys, rp, hd, G, p.scale);
  for (int r = 0; r < rows; ++r) {
    float* dst = row_state(state, grp, it.kv_head, it.first_row + r, hd);
    std::memcpy(dst, &w.o[static_cast<size_t>(r) * hd], sizeof(float) * hd);
    dst[hd] = w.m[r];
    dst[hd + 1] = w.l[r];
  }
}

// The running thread's scratch for items of rp rows (kept from call to call: every layer's
// call has the same shape).
inline Scratch& thread_scratch(int rp, int hd) {
  thread_local std::unique_ptr<Scratch> mine;
  thread_local int mine_rp = -1, mine_hd = -1;
  if (!mine || mine_rp != rp || mine_hd != hd) {
    mine = std::make_unique<Scratch>(rp, hd);
    mine_rp = rp;
    mine_hd = hd;
  }
  return *mine;
}

}  // namespace poise_prefill
