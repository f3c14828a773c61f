// Paged attention for CPU: each query row reads its keys and values straight from the paged KV
// cache through its block table. No gather copy, no padding to the longest row.
//
// Built at first use by cpu_kernel.py (g++ -O3 -march=native -fopenmp) and called through
// ctypes with raw pointers, so it needs no torch headers and compiles in about a second. It
// links the process's libgomp (the one torch loaded), so it shares torch's OpenMP threads.
//
// Shapes (elements, row-major):
//   q         [T, H, HD]   token stride q_token_stride, heads contiguous (a view of qkv)
//   kv_cache  [num_blocks, block_size, 2 * Hkv, HD]: per slot K heads then V heads
//   tables    [num_tables, table_stride] int64 block ids
//   rows: R query rows. Row r is the query of flat token row_token[r]; it uses block table
//         row_table[r] and sees keys at positions 0 .. context_len[r] - 1 (causal: a decode
//         token's context, or one query of a prefill chunk whose earlier part is cached).
//   out       [T, H, HD]   token stride out_token_stride; only the rows' tokens are written.
// GQA: query head h uses kv head h / (H / Hkv), as transformers' repeat_kv.
//
// Work split (flash-decoding): each row's context is cut into partitions of `partition_size`
// keys; (row, partition) items run in parallel and each keeps a running max, sum and weighted
// value sum per head; a merge pass combines a row's partitions. So one long row does not leave
// the other thread idle, and short rows cost one item each. Rows sharing prefix blocks attend
// to the shared partitions together, one unit per partition for the whole group (cascade:
// cpu_decode_cascade.h); their partials merge with the rows' own ones the same way.
//
// Numerics: sums in float32 (bfloat16 inputs are widened, or multiplied in pairs by vdpbf16ps
// where the CPU has AVX512-BF16; there P V takes P rounded to bf16, as torch's flash attention
// does), the output rounded once to nearest even, softmax with the max subtracted, exp by a
// polynomial accurate to ~2 ulp.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_decode_amx.h"
#include "cpu_decode_cascade.h"
#include "cpu_decode_vectors.h"
#include "../cpu_pool.h"

namespace {

using namespace poise_attention;

using Problem = DecodeProblem<void>;

// Query heads [first, first + count) of one kv head, count <= 4: the fixed-count kernels.
// q_f: the NQ query rows in float, pre-scaled; q_raw: the same rows as stored (unscaled).
template <typename T, int HD_FIXED, int NQ>
void attend_heads_fixed(const float* q_f, const T* q_raw, float scale, int hd,
                        const T* const* slots, int n, int64_t k_offset, int64_t v_offset,
                        float* scores, float* acc) {
#if defined(POISE_DECODE_VECTORS)
  if constexpr (vector_heads<HD_FIXED, NQ>()) {
    qk_vec<T, HD_FIXED, NQ>(q_f, q_raw, scale, slots, n, k_offset, scores, n);
    softmax_rows(scores, NQ, n);
    pv_vec<T, HD_FIXED, NQ>(scores, n, slots, n, v_offset, acc);
    return;
  }
#endif
  (void)q_raw;
  (void)scale;
  qk_generic<T, NQ>(q_f, hd, slots, n, k_offset, [](int) { return 1.0f; }, scores, n);
  softmax_rows(scores, NQ, n);
  pv_generic<T, NQ>(scores, n, hd, slots, n, v_offset, [](int) { return 1.0f; }, acc);
}

// One row's query heads of kv head g over n keys. q: the row's query as stored, q_f: the same
// pre-scaled in float. Writes per head h: the running max m_out[h], the sum of exps l_out[h]
// and acc[h] = sum_j exp(s_j - m) v_j (unnormalised).
template <typename T, int HD_FIXED>
void attend_kv_head(const Problem& p, int g, const T* q, const float* q_f, const T* const* slots,
                    int n, float* scores, float* acc, float* m_out, float* l_out) {
  const int hd = HD_FIXED > 0 ? HD_FIXED : p.head_dim;
  const int Hkv = p.num_kv_heads, G = p.num_heads / Hkv;
  const int64_t k_offset = static_cast<int64_t>(g) * hd;
  const int64_t v_offset = static_cast<int64_t>(Hkv + g) * hd;
  constexpr int kHeads = heads_per_group<HD_FIXED>();
  for_head_groups<kHeads>(g, G, n, scores, m_out, l_out, [&](int h, auto nq) {
    attend_heads_fixed<T, HD_FIXED, decltype(nq)::value>(q_f + h * hd, q + h * hd, p.scale, hd,
                                                         slots, n, k_offset, v_offset, scores,
                                                         acc + h * hd);
  });
}

#if defined(POISE_DECODE_VECTORS)
constexpr int kWalkKeys = 16;  // keys per step of attend_unit_blocks (a cache block's, at 16)
// Slots (every kv head's K and V of one key) from this size on take attend_unit_blocks. Measured
// in bf16 (benchmarks/decode_attention.py, cascade_attention.py): at 1-8 KB (Qwen2.5-1.5B,
// Llama-3.2-1B, SmolLM2-1.7B) the block walk took 0.69-0.87x the time head by head at 1,024
// keys; at SmolLM2-135M's 768 bytes it took 1.05-1.4x (a head's walk at that stride is one the
// hardware prefetcher follows).
constexpr int64_t kWalkSlotBytes = 1024;

// attend_unit's walk on the vector kernels (AVX-512 or AVX2), with the same sums in the same
// order, but a block of kWalkKeys keys at a time with every kv head's rows inside it (the
// threshold above was measured on AVX-512 and is kept for AVX2): a head's row is 128 bytes of
// a slot that holds every head's K and V, so walking one head over the whole unit strided by a
// slot (2-8 KB) over every key's page, while a block's heads in turn read each page's lines in
// order (a plain read in this order: 20 GB/s on one core at 32 kv heads, against 13 GB/s head
// by head). Q K^T for every row and head first (scores [row][head][n + 2]: rows at stride n,
// each head group's softmax stats after its rows), then the softmax, then P V block by block,
// the accumulators carried in `acc` between blocks.
template <typename T, int HD>
void attend_unit_blocks(const Problem& p, const DecodePlan& plan, const DecodeUnit& unit,
                        const float* q_f, const T* const* slots, float* acc, float* stats) {
  constexpr int kHeads = heads_per_group<HD>();
  const int H = p.num_heads, Hkv = p.num_kv_heads, G = H / Hkv;
  const int n = unit.end - unit.begin;
  const int* rows = plan.unit_rows.data() + unit.rows_begin;
  const int num = unit.rows_end - unit.rows_begin;
  const size_t row_floats = static_cast<size_t>(H) * (n + 2);
  thread_local std::vector<float> scores;  // grows to the largest unit; kept from call to call
  if (scores.size() < num * row_floats) scores.resize(num * row_floats);
  auto item = [&](int m) { return static_cast<size_t>(plan.row_first_item[rows[m]] + unit.item); };
  // f(m, first head, count, kv head) for every kv head, row and head group.
  auto each_group = [&](auto&& f) {
    for (int g = 0; g < Hkv; ++g)
      for (int m = 0; m < num; ++m)
        for (int i = 0; i < G; i += kHeads)
          with_count(std::min(kHeads, G - i), [&](auto nq) { f(m, g * G + i, nq, g); });
  };
  auto group_scores = [&](int m, int h) { return scores.data() + m * row_floats + h * (n + 2); };
  for (int b0 = 0; b0 < n; b0 += kWalkKeys) {
    const int b1 = std::min(n, b0 + kWalkKeys);
    each_group([&](int m, int h, auto nq, int g) {
      const T* q = static_cast<const T*>(p.q) + p.row_token[rows[m]] * p.q_token_stride;
      qk_vec<T, HD, decltype(nq)::value>(q_f + (static_cast<size_t>(m) * H + h) * HD,
                                         q + h * HD, p.scale, slots, b1,
                                         static_cast<int64_t>(g) * HD, group_scores(m, h), n, b0);
    });
  }
  each_group([&](int m, int h, auto nq, int) {
    constexpr int count = decltype(nq)::value;
    float* s = group_scores(m, h);
    softmax_rows(s, count, n);
    float* st = stats + item(m) * H * 2;
    for (int c = 0; c < count; ++c) {
      st[h + c] = s[count * n + 2 * c];
      st[H + h + c] = s[count * n + 2 * c + 1];
    }
  });
  for (int b0 = 0; b0 < n; b0 += kWalkKeys) {
    const int b1 = std::min(n, b0 + kWalkKeys);
    each_group([&](int m, int h, auto nq, int g) {
      pv_vec<T, HD, decltype(nq)::value>(group_scores(m, h), n, slots, b1,
                                         static_cast<int64_t>(Hkv + g) * HD,
                                         acc + item(m) * H * HD + h * HD, b0, b0 > 0);
    });
  }
}
#endif

// One unit of the plan (cpu_decode_cascade.h): keys [begin, end) for each of its rows, which
// see those keys through the same blocks. Per kv head, every row's queries in turn, so that
// head's keys and values come from memory once and from cache for the other rows. Each row's
// partial goes to its item `unit.item`: acc [H, hd] and stats (m [H], l [H]).
template <typename T, int HD_FIXED>
void attend_unit(const Problem& p, const DecodePlan& plan, const DecodeUnit& unit, float* scores,
                 float* q_f, const T** slots, float* acc, float* stats) {
  const int hd = HD_FIXED > 0 ? HD_FIXED : p.head_dim;
  const int H = p.num_heads, Hkv = p.num_kv_heads;
  const int n = unit.end - unit.begin;
  const int* rows = plan.unit_rows.data() + unit.rows_begin;
  const int num = unit.rows_end - unit.rows_begin;
  const int64_t slot_stride = static_cast<int64_t>(2 * Hkv) * hd;
  const int64_t* table = p.tables + p.row_table[rows[0]] * p.table_stride;
  fill_slots(static_cast<const T*>(p.kv_cache), table, p.block_size, unit.begin, unit.end,
             slot_stride, slots);
  for (int m = 0; m < num; ++m) {
    const T* q = static_cast<const T*>(p.q) + p.row_token[rows[m]] * p.q_token_stride;
    float* qf = q_f + static_cast<size_t>(m) * H * hd;
    for (int i = 0; i < H * hd; ++i) qf[i] = to_float(q[i]) * p.scale;
  }
#if defined(POISE_DECODE_VECTORS)
  if constexpr (HD_FIXED > 0 && vector_heads<HD_FIXED, heads_per_group<HD_FIXED>()>()) {
    if (slot_stride * static_cast<int64_t>(sizeof(T)) >= kWalkSlotBytes) {
      attend_unit_blocks<T, HD_FIXED>(p, plan, unit, q_f, slots, acc, stats);
      return;
    }
  }
#endif
  for (int g = 0; g < Hkv; ++g)
    for (int m = 0; m < num; ++m) {
      const int r = rows[m];
      const size_t it = static_cast<size_t>(plan.row_first_item[r] + unit.item);
      const T* q = static_cast<const T*>(p.q) + p.row_token[r] * p.q_token_stride;
      float* st = stats + it * H * 2;
      attend_kv_head<T, HD_FIXED>(p, g, q, q_f + static_cast<size_t>(m) * H * hd, slots, n,
                                  scores, acc + it * H * hd, st, st + H);
    }
}

// Whether rows that share prefix blocks attend to them together (poise_decode_use_cascade).
std::atomic<bool> use_cascade{true};
// Whether bf16 units run on AMX tiles where they can (poise_decode_use_amx; cpu_decode_amx.h).
std::atomic<bool> use_amx{true};

// Whether this call's units all run on AMX tiles (cpu_decode_amx.h): bf16 at head_dim 64 or
// 128, blocks of a multiple of 16 keys (a tile's 16 keys from a 16-aligned start lie in one
// block), where the CPU and the OS allow AMX.
template <typename T, int HD_FIXED>
bool amx_units(const Problem& p) {
#if defined(POISE_ATTENTION_AMX)
  if constexpr (std::is_same_v<T, bf16> && (HD_FIXED == 64 || HD_FIXED == 128))
    return use_amx.load(std::memory_order_relaxed) && p.block_size % 16 == 0 &&
           amx_available();
#endif
  (void)p;
  return false;
}

// A new id per decode call: the pool's threads configure their tiles once per call.
uint64_t next_call_id() {
  static std::atomic<uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) + 1;
}

template <typename T, int HD_FIXED>
void run(const Problem& p, int num_threads) {
  const int H = p.num_heads;
  const int hd = p.head_dim;
  // Partitions start at block boundaries.
  const int part = std::max(p.partition_size / p.block_size, 1) * p.block_size;
  const DecodePlan plan =
      plan_decode(p.tables, p.table_stride, p.row_table, p.context_len, p.num_rows, p.block_size,
                  part, use_cascade.load(std::memory_order_relaxed));
  const int num_units = static_cast<int>(plan.units.size());
  // Per item and head: acc [hd], m, l.
  std::vector<float> acc(static_cast<size_t>(plan.num_items) * H * hd);
  std::vector<float> stats(static_cast<size_t>(plan.num_items) * H * 2);
  const int threads = decode_threads(p.context_len, p.num_rows, H * hd, num_threads, num_units);

  // Scores of up to 4 heads plus their stats; the unit's q rows; slot pointers of one
  // partition: the running thread's (the pool's threads keep theirs between calls).
  static thread_local std::vector<float> scores, q_f;
  static thread_local std::vector<const T*> slots;
  const size_t scores_size = 4 * static_cast<size_t>(part) + 8;
  const size_t q_size = static_cast<size_t>(plan.max_unit_rows) * H * hd;
  auto buffers = [&] {
    if (scores.size() < scores_size) scores.resize(scores_size);
    if (q_f.size() < q_size) q_f.resize(q_size);
    if (slots.size() < static_cast<size_t>(part)) slots.resize(part);
  };
  const bool amx = amx_units<T, HD_FIXED>(p);
  const uint64_t call = next_call_id();
  ppool::parallel_for(num_units, threads, [&](int64_t u) {
    buffers();
#if defined(POISE_ATTENTION_AMX)
    if constexpr (std::is_same_v<T, bf16> && (HD_FIXED == 64 || HD_FIXED == 128)) {
      if (amx) {
        static thread_local uint64_t configured_for = 0;  // tiles configured once per call
        static thread_local AmxDecodeScratch w;
        if (configured_for != call) {
          amx_configure();
          configured_for = call;
        }
        const DecodeUnit& unit = plan.units[u];
        const int64_t* table = p.tables + p.row_table[plan.unit_rows[unit.rows_begin]] *
                                              p.table_stride;
        fill_slots(static_cast<const T*>(p.kv_cache), table, p.block_size, unit.begin, unit.end,
                   static_cast<int64_t>(2 * p.num_kv_heads) * hd, slots.data());
        attend_unit_amx<HD_FIXED>(p, plan, unit, slots.data(), w, acc.data(), stats.data());
        return;
      }
    }
#endif
    attend_unit<T, HD_FIXED>(p, plan, plan.units[u], scores.data(), q_f.data(), slots.data(),
                             acc.data(), stats.data());
  });
#if defined(POISE_ATTENTION_AMX)
  if (amx) _tile_release();  // the calling thread's tile state, for whatever it runs next
#endif
  ppool::parallel_for(p.num_rows, threads, [&](int64_t r) {
    buffers();
    merge_partials(stats.data(), acc.data(), plan.row_first_item[r], plan.row_first_item[r + 1],
                   H, hd, q_f.data(), static_cast<T*>(p.out) + p.row_token[r] * p.out_token_stride);
  });
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Returns 0 on success, a negative code on bad arguments.
int poise_paged_attention(int dtype, const void* q, int64_t q_token_stride, const void* kv_cache,
                          const int64_t* tables, int64_t table_stride, const int64_t* row_table,
                          const int64_t* row_token, const int64_t* context_len, int num_rows,
                          int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, void* out, int64_t out_token_stride, int partition_size,
                          int num_threads) {
  if (num_rows <= 0) return 0;
  if (bad_shape(num_heads, num_kv_heads, head_dim, block_size)) return -1;
  const Problem p{q, q_token_stride, kv_cache, tables, table_stride, row_table, row_token,
                  context_len, num_rows, num_heads, num_kv_heads, head_dim, block_size, scale,
                  out, out_token_stride, partition_size};
  const int threads = std::max(num_threads, 1);
  return dispatch_dtype_head_dim(dtype, head_dim, [&](auto t, auto hd) {
    run<decltype(t), decltype(hd)::value>(p, threads);
  });
}

// Shared-prefix groups on (1) or off (0, every row alone: the comparison and the fallback);
// -1 only asks. Returns the setting now.
int poise_decode_use_cascade(int enable) {
  if (enable >= 0) use_cascade.store(enable != 0, std::memory_order_relaxed);
  return use_cascade.load(std::memory_order_relaxed) ? 1 : 0;
}

// bf16 decode units on AMX tiles (1, the default, where the CPU and the OS allow them) or on
// the vectors (0; tests compare both on one machine); -1 only asks. Returns whether a bf16
// call at head_dim 64 with 16-key blocks would take the tiles now.
int poise_decode_use_amx(int enable) {
  if (enable >= 0) use_amx.store(enable != 0, std::memory_order_relaxed);
#if defined(POISE_ATTENTION_AMX)
  return use_amx.load(std::memory_order_relaxed) && amx_available() ? 1 : 0;
#else
  return 0;
#endif
}

// How the decode kernels spread their units (cpu_pool.h; linear_kernel.set_threading).
void poise_attention_threading(int openmp, int spin_us) {
  ppool::use_openmp().store(openmp != 0);
  ppool::Pool::instance().set_spin_us(spin_us);
}

// The groups the kernel would form with this partition size (tests): each row's shared keys
// into shared[R] (0: alone); returns the number of groups.
int poise_decode_groups(const int64_t* tables, int64_t table_stride, const int64_t* row_table,
                        const int64_t* context_len, int num_rows, int block_size,
                        int partition_size, int64_t* shared) {
  const int part = std::max(partition_size / block_size, 1) * block_size;
  const DecodePlan plan = plan_decode(tables, table_stride, row_table, context_len, num_rows,
                                      block_size, part, true);
  std::copy(plan.row_shared.begin(), plan.row_shared.end(), shared);
  return plan.num_groups;
}

}  // extern "C"
