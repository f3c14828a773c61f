// Decode-row attention over the int8 KV cache (layout: kv_int8.py, cpu_kv_int8.h): the rows,
// work split and merge of cpu_paged_attention.cpp (one item per (row, partition of keys),
// flash-decoding merge), with keys and values read as int8 and their per-(token, head) scales
// applied where they cost one multiply per key, not per element:
//   score_j = (q . k_j) * k_scale_j          (q pre-scaled by the softmax scale)
//   out     = sum_j (p_j * v_scale_j) * v_j / sum_j p_j
// A separate file (not a template parameter of that kernel) so the two evolve independently;
// the shared numerics are in cpu_attention_common.h. Arguments as poise_paged_attention's, the
// cache [num_blocks, block_size, 2 * Hkv, HD + 2] int8 and q / out float or bf16.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_decode_cascade.h"
#include "cpu_kv_int8.h"
#include "../cpu_pool.h"

namespace {

using namespace poise_attention;

using Problem = DecodeProblem<int8_t>;  // rows of head_dim int8 values + a bf16 scale

// Per kv head and key of one partition: the key's and the value's scale.
struct Scales {
  const float* k;
  const float* v;
};

#if defined(__AVX512F__)
// head_dim = 16 * NV: the NQ query rows stay in registers; each key's int8 row is widened
// once (16 values per vpmovsxbd + vcvtdq2ps) for all NQ rows.
template <int NV, int NQ>
void qk_avx512(const float* q_f, const int8_t* const* slots, int n, int64_t k_offset, Scales sc,
               float* scores) {
  __m512 q[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NV; ++v) q[i][v] = _mm512_loadu_ps(q_f + (i * NV + v) * 16);
  auto partials = [&](const int8_t* k, __m512* out) {
    __m512 kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = load16_i8(k + v * 16);
    for (int i = 0; i < NQ; ++i) {
      __m512 a = _mm512_mul_ps(q[i][0], kv[0]);
      for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(q[i][v], kv[v], a);
      out[i] = a;
    }
  };
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 a[4][NQ];
    for (int t = 0; t < 4; ++t) partials(slots[j + t] + k_offset, a[t]);
    const __m128 ks = _mm_loadu_ps(sc.k + j);
    for (int i = 0; i < NQ; ++i)
      _mm_storeu_ps(scores + i * n + j, _mm_mul_ps(hsum4(a[0][i], a[1][i], a[2][i], a[3][i]), ks));
  }
  for (; j < n; ++j) {
    __m512 a[NQ];
    partials(slots[j] + k_offset, a);
    for (int i = 0; i < NQ; ++i) scores[i * n + j] = _mm512_reduce_add_ps(a[i]) * sc.k[j];
  }
}

#endif

template <int HD_FIXED, int NQ>
void attend_heads(const float* q_f, int hd, const int8_t* const* slots, int n, int64_t k_offset,
                  int64_t v_offset, Scales sc, float* scores, float* acc) {
#if defined(__AVX512F__)
  if constexpr (fits_registers<HD_FIXED, NQ>()) {
    qk_avx512<HD_FIXED / 16, NQ>(q_f, slots, n, k_offset, sc, scores);
    softmax_rows(scores, NQ, n);
    pv_avx512<int8_t, HD_FIXED / 16, NQ>(scores, n, slots, n, v_offset,
                                          [&](int j) { return sc.v[j]; }, acc);
    return;
  }
#elif defined(POISE_ATTENTION_AVX2)
  if constexpr (avx2_heads<HD_FIXED, NQ>()) {
    qk_avx2<int8_t, HD_FIXED, NQ>(q_f, slots, n, k_offset, [&](int j) { return sc.k[j]; },
                                  scores, n);
    softmax_rows(scores, NQ, n);
    pv_avx2<int8_t, HD_FIXED, NQ>(scores, n, slots, n, v_offset, [&](int j) { return sc.v[j]; },
                                  acc);
    return;
  }
#endif
  qk_generic<int8_t, NQ>(q_f, hd, slots, n, k_offset, [&](int j) { return sc.k[j]; }, scores,
                         n);
  softmax_rows(scores, NQ, n);
  pv_generic<int8_t, NQ>(scores, n, hd, slots, n, v_offset, [&](int j) { return sc.v[j]; },
                         acc);
}

// One (row, partition): keys [begin, end). Writes per head h the running max m_out[h], the
// sum of exps l_out[h] and the unnormalised acc[h], as cpu_paged_attention.cpp's.
template <typename T, int HD_FIXED>
void attend_partition(const Problem& p, int row, int begin, int end, float* scores, float* q_f,
                      const int8_t** slots, float* ks, float* vs, float* acc, float* m_out,
                      float* l_out) {
  const int hd = HD_FIXED > 0 ? HD_FIXED : p.head_dim;
  const int H = p.num_heads, Hkv = p.num_kv_heads, G = H / Hkv;
  const int n = end - begin;
  const int64_t row_bytes = hd + kInt8ScaleBytes;
  const int64_t slot_stride = 2 * Hkv * row_bytes;
  const T* q = static_cast<const T*>(p.q) + p.row_token[row] * p.q_token_stride;
  const int64_t* table = p.tables + p.row_table[row] * p.table_stride;
  fill_slots(p.kv_cache, table, p.block_size, begin, end, slot_stride, slots);
  prefetch_slots(slots, n, p.block_size, slot_stride);
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < hd; ++d) q_f[h * hd + d] = to_float(q[h * hd + d]) * p.scale;

  for (int g = 0; g < Hkv; ++g) {
    const int64_t k_offset = g * row_bytes, v_offset = (Hkv + g) * row_bytes;
    for (int j = 0; j < n; ++j) {
      ks[j] = row_scale(slots[j] + k_offset, hd);
      vs[j] = row_scale(slots[j] + v_offset, hd);
    }
    const Scales sc{ks, vs};
    constexpr int kHeads = heads_per_group<HD_FIXED>();
    for_head_groups<kHeads>(g, G, n, scores, m_out, l_out, [&](int h, auto nq) {
      attend_heads<HD_FIXED, decltype(nq)::value>(q_f + h * hd, hd, slots, n, k_offset, v_offset,
                                                  sc, scores, acc + h * hd);
    });
  }
}

template <typename T, int HD_FIXED>
void run(const Problem& p, int num_threads) {
  const int H = p.num_heads;
  const int hd = p.head_dim;
  const int part = std::max(p.partition_size / p.block_size, 1) * p.block_size;
  std::vector<int> item_row, item_begin, row_first_item(p.num_rows + 1, 0);
  for (int r = 0; r < p.num_rows; ++r) {
    row_first_item[r] = static_cast<int>(item_row.size());
    const int ctx = static_cast<int>(p.context_len[r]);
    for (int b = 0; b < ctx; b += part) {
      item_row.push_back(r);
      item_begin.push_back(b);
    }
  }
  const int num_items = static_cast<int>(item_row.size());
  row_first_item[p.num_rows] = num_items;
  // Partition-major run order, as cpu_paged_attention.cpp (shared prefix blocks read close
  // together in time).
  std::vector<int> order;
  order.reserve(num_items);
  for (int k = 0; static_cast<int>(order.size()) < num_items; ++k)
    for (int r = 0; r < p.num_rows; ++r)
      if (row_first_item[r] + k < row_first_item[r + 1]) order.push_back(row_first_item[r] + k);
  std::vector<float> acc(static_cast<size_t>(num_items) * H * hd);
  std::vector<float> stats(static_cast<size_t>(num_items) * H * 2);

  const int threads = decode_threads(p.context_len, p.num_rows, H * hd, num_threads, num_items);

  // The running thread's buffers (the pool's threads keep theirs between calls).
  static thread_local std::vector<float> scores, q_f, ks, vs;
  static thread_local std::vector<const int8_t*> slots;
  auto buffers = [&] {
    if (scores.size() < 4 * static_cast<size_t>(part) + 8) scores.resize(4 * static_cast<size_t>(part) + 8);
    if (q_f.size() < static_cast<size_t>(H) * hd) q_f.resize(static_cast<size_t>(H) * hd);
    if (ks.size() < static_cast<size_t>(part)) ks.resize(part);
    if (vs.size() < static_cast<size_t>(part)) vs.resize(part);
    if (slots.size() < static_cast<size_t>(part)) slots.resize(part);
  };
  ppool::parallel_for(num_items, threads, [&](int64_t k) {
    buffers();
    const int it = order[k];
    const int r = item_row[it];
    const int begin = item_begin[it];
    const int end = std::min<int>(begin + part, static_cast<int>(p.context_len[r]));
    float* st = stats.data() + static_cast<size_t>(it) * H * 2;
    attend_partition<T, HD_FIXED>(p, r, begin, end, scores.data(), q_f.data(), slots.data(),
                                  ks.data(), vs.data(),
                                  acc.data() + static_cast<size_t>(it) * H * hd, st, st + H);
  });
  ppool::parallel_for(p.num_rows, threads, [&](int64_t r) {
    buffers();
    merge_partials(stats.data(), acc.data(), row_first_item[r], row_first_item[r + 1], H, hd,
                   q_f.data(), static_cast<T*>(p.out) + p.row_token[r] * p.out_token_stride);
  });
}

}  // namespace

extern "C" {

// dtype (of q and out): 0 = float32, 1 = bfloat16; head_dim: of q (the cache rows are
// head_dim + 2 bytes). Returns 0 on success, a negative code on bad arguments.
int poise_paged_attention_int8(int dtype, const void* q, int64_t q_token_stride,
                               const void* kv_cache, const int64_t* tables, int64_t table_stride,
                               const int64_t* row_table, const int64_t* row_token,
                               const int64_t* context_len, int num_rows, int num_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale,
                               void* out, int64_t out_token_stride, int partition_size,
                               int num_threads) {
  if (num_rows <= 0) return 0;
  if (bad_shape(num_heads, num_kv_heads, head_dim, block_size)) return -1;
  const Problem p{q, q_token_stride, static_cast<const int8_t*>(kv_cache), tables, table_stride,
                  row_table, row_token, context_len, num_rows, num_heads, num_kv_heads,
                  head_dim, block_size, scale, out, out_token_stride, partition_size};
  const int threads = std::max(num_threads, 1);
  return dispatch_dtype_head_dim(dtype, head_dim, [&](auto t, auto hd) {
    run<decltype(t), decltype(hd)::value>(p, threads);
  });
}

}  // extern "C"
