// The work plan of one decode-kernel call (cpu_paged_attention.cpp), with shared-prefix
// ("cascade") groups: rows whose block tables begin with the same blocks (prefix-cache hits,
// n > 1 siblings, the queries of one kernel-run chunk) attend to those shared keys together,
// one work unit per partition for all the group's queries, so a shared KV block is read from
// memory once per call instead of once per row. Each row then attends to its own keys. A
// group unit writes, for every row of the group, the same (max, sum, unnormalised values)
// partials a per-row partition writes, so the kernel's log-sum-exp merge of a row's
// partitions combines shared and own keys exactly as it combines partitions of one row.
//
// Finding the groups (per call, from the tables; microseconds for a few hundred rows): rows
// sorted by their visible block ids, lexicographically, so rows sharing a prefix are
// adjacent and the keys two rows share is the common prefix of neighbours (lcp). A run of
// sorted rows shares min(lcp over the run) keys; a group of M rows sharing S keys saves
// (M - 1) * S key reads. Runs are chosen by splitting at the smallest lcp recursively, keeping
// a run whole when that saves at least as much as its best split (so 8 rows sharing 3.4k
// tokens are not merged, at one block, with rows that share only a chat template's first
// block with them).
//
// Also here, for the kernel's file size: the slot walk through a block table and the merge.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_attention_common.h"

namespace poise_attention {

struct DecodeUnit {
  int begin, end;             // keys [begin, end) of every row in the unit
  int rows_begin, rows_end;   // the unit's rows: DecodePlan::unit_rows[rows_begin, rows_end)
  int item;                   // the partial's index within each row's items
};

struct DecodePlan {
  std::vector<int> row_first_item;  // [R + 1]: row r's partials are items [first[r], first[r+1])
  std::vector<DecodeUnit> units;    // in run order
  std::vector<int> unit_rows;
  int num_items = 0;
  int max_unit_rows = 1;
  int num_groups = 0;
  std::vector<int> row_shared;  // [R]: keys row r attends in its group's units (0: alone)
};

namespace cascade_detail {

struct RowKeys {
  const int64_t* table;
  int context;
  int blocks;  // visible blocks: ceil(context / block_size)
};

// Keys rows a and b both see through the same blocks.
inline int shared_keys(const RowKeys& a, const RowKeys& b, int block_size) {
  const int n = std::min(a.blocks, b.blocks);
  int same = 0;
  while (same < n && a.table[same] == b.table[same]) ++same;
  return std::min({same * block_size, a.context, b.context});
}

// Groups over sorted rows [a, b] (lcp[i]: keys rows i and i + 1 share): appends (first, last,
// shared keys) of each chosen group and returns the key reads they save.
inline int64_t choose(const std::vector<int>& lcp, int a, int b, int min_shared,
                      std::vector<int>& out) {
  if (a >= b) return 0;
  const int m = *std::min_element(lcp.begin() + a, lcp.begin() + b);
  std::vector<int> split;
  int64_t split_saves = 0;
  for (int s = a; s <= b;) {
    int e = s;
    while (e < b && lcp[e] != m) ++e;
    split_saves += choose(lcp, s, e, min_shared, split);
    s = e + 1;
  }
  const int64_t keep_saves = m >= min_shared ? static_cast<int64_t>(m) * (b - a) : 0;
  if (keep_saves > 0 && keep_saves >= split_saves) {
    out.insert(out.end(), {a, b, m});
    return keep_saves;
  }
  out.insert(out.end(), split.begin(), split.end());
  return split_saves;
}

}  // namespace cascade_detail

// Partitions of `part` keys (a multiple of block_size), at multiples of `part` in every row;
// cascade off: every row alone.
inline DecodePlan plan_decode(const int64_t* tables, int64_t table_stride,
                              const int64_t* row_table, const int64_t* context_len, int num_rows,
                              int block_size, int part, bool cascade) {
  using namespace cascade_detail;
  DecodePlan plan;
  std::vector<int> group_shared(num_rows, 0);
  std::vector<int> order;  // grouped rows, sorted, group by group
  std::vector<int> chosen;  // (first, last, shared) over `order`
  if (cascade && num_rows > 1) {
    std::vector<RowKeys> keys(num_rows);
    for (int r = 0; r < num_rows; ++r) {
      const int ctx = static_cast<int>(context_len[r]);
      keys[r] = {tables + row_table[r] * table_stride, ctx, (ctx + block_size - 1) / block_size};
      if (ctx >= block_size) order.push_back(r);
    }
    std::sort(order.begin(), order.end(), [&](int x, int y) {
      const RowKeys &a = keys[x], &b = keys[y];
      if (a.table != b.table) {
        const int n = std::min(a.blocks, b.blocks);
        const auto diff = std::mismatch(a.table, a.table + n, b.table);
        if (diff.first != a.table + n) return *diff.first < *diff.second;
      }
      return a.context != b.context ? a.context < b.context : x < y;
    });
    // Shared keys in whole partitions: a row's partitions then start at multiples of `part`
    // whether it is grouped or alone, each computed by the same code, and its merge adds the
    // same partials in the same order, so grouping changes no bit of a row's output (a row
    // decoded alone and in a group of siblings gets the same tokens; speculative verify rows,
    // one group, the same as plain decode).
    std::vector<int> lcp(order.size(), 0);
    for (size_t i = 0; i + 1 < order.size(); ++i)
      lcp[i] = shared_keys(keys[order[i]], keys[order[i + 1]], block_size) / part * part;
    if (!order.empty()) choose(lcp, 0, static_cast<int>(order.size()) - 1, part, chosen);
  }
  auto parts = [part](int keys) { return (keys + part - 1) / part; };
  // Group units first (each is a group's worth of work: the big items start first), then the
  // rows' own partitions, partition-major (rows' k-th partitions together, as before cascade).
  for (size_t g = 0; g < chosen.size(); g += 3) {
    const int first = chosen[g], last = chosen[g + 1], shared = chosen[g + 2];
    const int rows_begin = static_cast<int>(plan.unit_rows.size());
    for (int i = first; i <= last; ++i) {
      plan.unit_rows.push_back(order[i]);
      group_shared[order[i]] = shared;
    }
    const int rows_end = static_cast<int>(plan.unit_rows.size());
    plan.max_unit_rows = std::max(plan.max_unit_rows, rows_end - rows_begin);
    for (int k = 0; k < parts(shared); ++k)
      plan.units.push_back({k * part, std::min((k + 1) * part, shared), rows_begin, rows_end, k});
  }
  plan.num_groups = static_cast<int>(chosen.size() / 3);
  plan.row_first_item.assign(num_rows + 1, 0);
  std::vector<int> own_first(num_rows);  // item index of the row's first own partition
  for (int r = 0; r < num_rows; ++r) {
    plan.row_first_item[r] = plan.num_items;
    own_first[r] = parts(group_shared[r]);
    plan.num_items += own_first[r] + parts(static_cast<int>(context_len[r]) - group_shared[r]);
  }
  plan.row_first_item[num_rows] = plan.num_items;
  plan.row_shared = group_shared;
  for (int k = 0, added = 1; added; ++k) {
    added = 0;
    for (int r = 0; r < num_rows; ++r) {
      const int begin = group_shared[r] + k * part;
      if (begin >= context_len[r]) continue;
      const int end = std::min<int>(begin + part, static_cast<int>(context_len[r]));
      const int at = static_cast<int>(plan.unit_rows.size());
      plan.unit_rows.push_back(r);
      plan.units.push_back({begin, end, at, at + 1, own_first[r] + k});
      added = 1;
    }
  }
  return plan;
}

// Slot pointers of keys [begin, end) through a block table, block by block (no division per
// key): slots[j] is key begin + j's row of 2 * Hkv heads (slot_stride elements).
template <typename T>
void fill_slots(const T* cache, const int64_t* table, int block_size, int begin, int end,
                int64_t slot_stride, const T** slots) {
  for (int pos = begin, j = 0; pos < end;) {
    const int block = pos / block_size;
    const int stop = std::min(end, (block + 1) * block_size);
    const T* base = cache + table[block] * block_size * slot_stride;
    for (int off = pos - block * block_size; pos < stop; ++pos, ++off, ++j)
      slots[j] = base + off * slot_stride;
  }
}

// Every line of keys [0, n) of `slots` (filled from a block boundary, as a partition's keys
// are) towards L2, block by block: a block's slots are one contiguous run of
// block_size * slot_bytes, so the cache reads them as a few sequential streams before the
// kernel walks one head's rows at the slot's stride. Used by the int8 decode kernel (66-byte
// rows, slots not a multiple of a line). Measured on Zen 4, two threads, with and without in
// one process, the all-unique seed mix at concurrency 32 (RESULTS.md, "Decode P V on
// AVX512-BF16"): 1.95 -> 1.57 ms a layer with the blocks scattered over the pool, 1.49 -> 1.40
// in order. In the bf16 kernel's units it was at most 5 % faster with scattered blocks and
// 5-10 % slower with blocks in order (the seed mix's layout), so not there.
// Not on AVX2 builds (not measured there: their kernels prefetch each key's rows a few keys
// ahead, cpu_attention_avx2.h), nor for partitions over kPrefetchUnitBytes (not measured: L2
// is 1-2 MB a core, and the next partition's lines must fit beside it; SmolLM2-135M's is 99 KB).
constexpr int64_t kPrefetchUnitBytes = 256 << 10;

// One line towards L2. An asm statement, not _mm_prefetch: GCC (12, -O3) deleted a loop of
// prefetch_slots' shape, prefetches and all, when it held nothing else (a prefetch has no
// effect the compiler must keep), without a warning.
inline void prefetch_line_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

template <typename T>
void prefetch_slots(const T* const* slots, int n, int block_size, int64_t slot_bytes) {
#if !defined(POISE_ATTENTION_AVX2)
  if (n * slot_bytes > kPrefetchUnitBytes) return;
  for (int j = 0; j < n; j += block_size) {
    const char* base = reinterpret_cast<const char*>(slots[j]);
    const int64_t bytes = std::min(block_size, n - j) * slot_bytes;
    for (int64_t off = 0; off < bytes; off += 64) prefetch_line_l2(base + off);
  }
#else
  (void)slots;
  (void)n;
  (void)block_size;
  (void)slot_bytes;
#endif
}

}  // namespace poise_attention
