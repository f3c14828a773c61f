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
// the other thread idle, and short rows cost one item each.
//
// Numerics: everything in float32 (bfloat16 inputs are widened, the output rounded once to
// nearest even), softmax with the max subtracted, exp by a polynomial accurate to ~2 ulp that
// the compiler vectorises.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"

namespace {

using namespace poise_attention;

struct Problem {
  const void* q;
  int64_t q_token_stride;
  const void* kv_cache;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* row_table;
  const int64_t* row_token;
  const int64_t* context_len;
  int num_rows;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  float scale;
  void* out;
  int64_t out_token_stride;
  int partition_size;
};

// Scores and weighted values of NQ query heads that share one kv head, over n key slots.
// Generic version: plain loops the compiler vectorises over the head dimension.
template <typename T, int NQ>
void qk_generic(const float* q_f, int hd, const T* const* slots, int n, int64_t k_offset,
                float* scores, int scores_stride) {
  for (int j = 0; j < n; ++j) {
    const T* k = slots[j] + k_offset;
    for (int i = 0; i < NQ; ++i) {
      const float* qh = q_f + i * hd;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int d = 0; d < hd; ++d) s += qh[d] * to_float(k[d]);
      scores[i * scores_stride + j] = s;
    }
  }
}

template <typename T, int NQ>
void pv_generic(const float* weights, int weights_stride, int hd, const T* const* slots, int n,
                int64_t v_offset, float* acc) {
  std::fill(acc, acc + NQ * hd, 0.0f);
  for (int j = 0; j < n; ++j) {
    const T* v = slots[j] + v_offset;
    for (int i = 0; i < NQ; ++i) {
      const float w = weights[i * weights_stride + j];
      float* a = acc + i * hd;
#pragma omp simd
      for (int d = 0; d < hd; ++d) a[d] += w * to_float(v[d]);
    }
  }
}

#if defined(__AVX512F__)
// AVX-512 version for head_dim = 16 * NV: the NQ query rows and the accumulators stay in
// registers for the whole loop over keys (NQ * NV + NV + NQ <= 32 zmm registers).
//
// Dot products of NQ query rows with one key: NQ vectors of 16 partial sums each.
// float keys (or bf16 widened to float): NV fused multiply-adds per query row. With AVX512-BF16
// and bf16 keys: NV / 2 dpbf16 instructions on the raw bf16 q and k (no widening), the scale
// applied to the summed score instead of to q.
template <typename T, int NV, int NQ>
struct QKRows {
#if defined(__AVX512BF16__)
  static constexpr bool kNativeBf16 = std::is_same_v<T, bf16> && NV % 2 == 0;
#else
  static constexpr bool kNativeBf16 = false;
#endif
  static constexpr int kRegs = kNativeBf16 ? NV / 2 : NV;
  __m512 q[NQ][kRegs];
  float post_scale;

  QKRows(const float* q_f, const T* q_raw, float scale) {
    if constexpr (kNativeBf16) {
      for (int i = 0; i < NQ; ++i)
        for (int v = 0; v < kRegs; ++v)
          q[i][v] = _mm512_castsi512_ps(_mm512_loadu_si512(q_raw + (i * NV + 2 * v) * 16));
      post_scale = scale;
    } else {
      (void)q_raw;
      for (int i = 0; i < NQ; ++i)
        for (int v = 0; v < NV; ++v) q[i][v] = _mm512_loadu_ps(q_f + (i * NV + v) * 16);
      post_scale = 1.0f;  // q_f is pre-scaled
    }
  }

  inline void partials(const T* k, __m512* out) const {
    if constexpr (kNativeBf16) {
#if defined(__AVX512BF16__)
      __m512bh kv[kRegs];
      for (int v = 0; v < kRegs; ++v)
        kv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + v * 32));
      for (int i = 0; i < NQ; ++i) {
        __m512 a = _mm512_setzero_ps();
        for (int v = 0; v < kRegs; ++v)
          a = _mm512_dpbf16_ps(a, reinterpret_cast<__m512bh>(q[i][v]), kv[v]);
        out[i] = a;
      }
#endif
    } else {
      __m512 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load16(k + v * 16);
      for (int i = 0; i < NQ; ++i) {
        __m512 a = _mm512_mul_ps(q[i][0], kv[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(q[i][v], kv[v], a);
        out[i] = a;
      }
    }
  }
};

template <typename T, int NV, int NQ>
void qk_avx512(const float* q_f, const T* q_raw, float scale, const T* const* slots, int n,
               int64_t k_offset, float* scores, int scores_stride) {
  const QKRows<T, NV, NQ> rows(q_f, q_raw, scale);
  const __m128 post = _mm_set1_ps(rows.post_scale);
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 a[4][NQ];
    for (int t = 0; t < 4; ++t) rows.partials(slots[j + t] + k_offset, a[t]);
    for (int i = 0; i < NQ; ++i)
      _mm_storeu_ps(scores + i * scores_stride + j,
                    _mm_mul_ps(hsum4(a[0][i], a[1][i], a[2][i], a[3][i]), post));
  }
  for (; j < n; ++j) {
    __m512 a[NQ];
    rows.partials(slots[j] + k_offset, a);
    for (int i = 0; i < NQ; ++i)
      scores[i * scores_stride + j] = _mm512_reduce_add_ps(a[i]) * rows.post_scale;
  }
}

template <typename T, int NV, int NQ>
void pv_avx512(const float* weights, int weights_stride, const T* const* slots, int n,
               int64_t v_offset, float* acc) {
  __m512 a[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = _mm512_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const T* vrow = slots[j] + v_offset;
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load16(vrow + v * 16);
    for (int i = 0; i < NQ; ++i) {
      const __m512 w = _mm512_set1_ps(weights[i * weights_stride + j]);
      for (int v = 0; v < NV; ++v) a[i][v] = _mm512_fmadd_ps(w, vv[v], a[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (i * NV + v) * 16, a[i][v]);
}
#endif

// Query heads [first, first + count) of one kv head, count <= 4: the fixed-count kernels.
// q_f: the NQ query rows in float, pre-scaled; q_raw: the same rows as stored (unscaled).
template <typename T, int HD_FIXED, int NQ>
void attend_heads_fixed(const float* q_f, const T* q_raw, float scale, int hd,
                        const T* const* slots, int n, int64_t k_offset, int64_t v_offset,
                        float* scores, float* acc) {
#if defined(__AVX512F__)
  if constexpr (HD_FIXED > 0 && HD_FIXED % 16 == 0 && (HD_FIXED / 16) * (NQ + 1) + NQ <= 30) {
    qk_avx512<T, HD_FIXED / 16, NQ>(q_f, q_raw, scale, slots, n, k_offset, scores, n);
    softmax_rows(scores, NQ, n);
    pv_avx512<T, HD_FIXED / 16, NQ>(scores, n, slots, n, v_offset, acc);
    return;
  }
#endif
  (void)q_raw;
  (void)scale;
  qk_generic<T, NQ>(q_f, hd, slots, n, k_offset, scores, n);
  softmax_rows(scores, NQ, n);
  pv_generic<T, NQ>(scores, n, hd, slots, n, v_offset, acc);
}

// One (row, partition): keys [begin, end) of the row. Writes per head h: the running max
// m_out[h], the sum of exps l_out[h] and acc[h] = sum_j exp(s_j - m) v_j (unnormalised).
// scratch holds the slot pointers, scores and stats: see run().
template <typename T, int HD_FIXED>
void attend_partition(const Problem& p, int row, int begin, int end, float* scores, float* q_f,
                      const T** slots, float* acc, float* m_out, float* l_out) {
  const int hd = HD_FIXED > 0 ? HD_FIXED : p.head_dim;
  const int H = p.num_heads, Hkv = p.num_kv_heads, G = H / Hkv;
  const int n = end - begin;
  const T* q = static_cast<const T*>(p.q) + p.row_token[row] * p.q_token_stride;
  const T* cache = static_cast<const T*>(p.kv_cache);
  const int64_t* table = p.tables + p.row_table[row] * p.table_stride;
  const int64_t slot_stride = static_cast<int64_t>(2 * Hkv) * hd;

  // Slot pointers once per partition, walking the block table block by block (no division
  // per key).
  for (int pos = begin, j = 0; pos < end;) {
    const int block = pos / p.block_size;
    const int stop = std::min(end, (block + 1) * p.block_size);
    const T* base = cache + table[block] * p.block_size * slot_stride;
    for (int off = pos - block * p.block_size; pos < stop; ++pos, ++off, ++j)
      slots[j] = base + off * slot_stride;
  }
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < hd; ++d) q_f[h * hd + d] = to_float(q[h * hd + d]) * p.scale;

  constexpr int kMaxHeads = 4;
  for (int g = 0; g < Hkv; ++g) {
    const int64_t k_offset = static_cast<int64_t>(g) * hd;
    const int64_t v_offset = static_cast<int64_t>(Hkv + g) * hd;
    for (int i = 0; i < G; i += kMaxHeads) {
      const int h = g * G + i;
      const int count = std::min(kMaxHeads, G - i);
      const float* qh = q_f + h * hd;
      float* a = acc + h * hd;
      switch (count) {
        case 1:
          attend_heads_fixed<T, HD_FIXED, 1>(qh, q + h * hd, p.scale, hd, slots, n, k_offset,
                                             v_offset, scores, a);
          break;
        case 2:
          attend_heads_fixed<T, HD_FIXED, 2>(qh, q + h * hd, p.scale, hd, slots, n, k_offset,
                                             v_offset, scores, a);
          break;
        case 3:
          attend_heads_fixed<T, HD_FIXED, 3>(qh, q + h * hd, p.scale, hd, slots, n, k_offset,
                                             v_offset, scores, a);
          break;
        default:
          attend_heads_fixed<T, HD_FIXED, 4>(qh, q + h * hd, p.scale, hd, slots, n, k_offset,
                                             v_offset, scores, a);
      }
      const float* stats = scores + count * n;
      for (int c = 0; c < count; ++c) {
        m_out[h + c] = stats[2 * c];
        l_out[h + c] = stats[2 * c + 1];
      }
    }
  }
}

// Query-key products (keys x heads x head dims) from which a decode call is split over the
// threads. Below it the call is ~50 us or less and a worker woken for it (OMP_WAIT_POLICY=
// PASSIVE) starts late enough to lose the gain: SmolLM2-1.7B at batch 1, context 64, spent
// 7.0 ms of a step in attention over 2 threads, 3.6 ms on one.
constexpr int64_t kParallelWork = int64_t(1) << 19;

template <typename T, int HD_FIXED>
void run(const Problem& p, int num_threads) {
  const int H = p.num_heads;
  const int hd = p.head_dim;
  // Partitions start at block boundaries.
  const int part = std::max(p.partition_size / p.block_size, 1) * p.block_size;
  // Items: (row, first key), rows in the caller's order.
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
  // Run order: partition-major (the first partition of every row, then the second ...), so
  // rows that share prefix blocks (prefix caching) read the same keys close together in time,
  // from L2 instead of L3 / memory.
  std::vector<int> order;
  order.reserve(num_items);
  for (int k = 0; static_cast<int>(order.size()) < num_items; ++k)
    for (int r = 0; r < p.num_rows; ++r)
      if (row_first_item[r] + k < row_first_item[r + 1]) order.push_back(row_first_item[r] + k);
  // Per item and head: acc [hd], m, l.
  std::vector<float> acc(static_cast<size_t>(num_items) * H * hd);
  std::vector<float> stats(static_cast<size_t>(num_items) * H * 2);
  // One thread for short work (a few rows of short contexts: tens of microseconds), where
  // waking a sleeping worker costs more than it saves (see kParallelWork).
  int64_t keys = 0;
  for (int r = 0; r < p.num_rows; ++r) keys += p.context_len[r];
  const int threads = keys * H * hd >= kParallelWork ? num_threads : 1;

#pragma omp parallel num_threads(threads)
  {
    // Scores of up to 4 heads plus their stats; q rows; slot pointers of one partition.
    std::vector<float> scores(4 * static_cast<size_t>(part) + 8), q_f(static_cast<size_t>(H) * hd);
    std::vector<const T*> slots(part);
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < num_items; ++k) {
      const int it = order[k];
      const int r = item_row[it];
      const int begin = item_begin[it];
      const int end = std::min<int>(begin + part, static_cast<int>(p.context_len[r]));
      float* st = stats.data() + static_cast<size_t>(it) * H * 2;
      attend_partition<T, HD_FIXED>(p, r, begin, end, scores.data(), q_f.data(), slots.data(),
                                    acc.data() + static_cast<size_t>(it) * H * hd, st, st + H);
    }
    // Merge each row's partitions: out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.
#pragma omp for schedule(static)
    for (int r = 0; r < p.num_rows; ++r) {
      T* out = static_cast<T*>(p.out) + p.row_token[r] * p.out_token_stride;
      const int first = row_first_item[r], last = row_first_item[r + 1];
      for (int h = 0; h < H; ++h) {
        float M = -std::numeric_limits<float>::infinity();
        for (int it = first; it < last; ++it)
          M = std::max(M, stats[static_cast<size_t>(it) * H * 2 + h]);
        float denom = 0.0f;
        float* o = q_f.data();  // reuse as the [hd] float accumulator
        std::fill(o, o + hd, 0.0f);
        for (int it = first; it < last; ++it) {
          const float* st = stats.data() + static_cast<size_t>(it) * H * 2;
          const float w = std::exp(st[h] - M);
          denom += w * st[H + h];
          const float* a = acc.data() + (static_cast<size_t>(it) * H + h) * hd;
#pragma omp simd
          for (int d = 0; d < hd; ++d) o[d] += w * a[d];
        }
        const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
        for (int d = 0; d < hd; ++d) from_float(o[d] * inv, out + h * hd + d);
      }
    }
  }
}

template <typename T>
void dispatch_head_dim(const Problem& p, int num_threads) {
  switch (p.head_dim) {
    case 64:
      run<T, 64>(p, num_threads);
      break;
    case 128:
      run<T, 128>(p, num_threads);
      break;
    default:
      run<T, 0>(p, num_threads);
  }
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
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0)
    return -1;
  const Problem p{q,         q_token_stride, kv_cache,   tables,     table_stride,
                  row_table, row_token,      context_len, num_rows,  num_heads,
                  num_kv_heads, head_dim,    block_size, scale,      out,
                  out_token_stride, partition_size};
  const int threads = std::max(num_threads, 1);
  if (dtype == 0) {
    dispatch_head_dim<float>(p, threads);
  } else if (dtype == 1) {
    dispatch_head_dim<bf16>(p, threads);
  } else {
    return -2;
  }
  return 0;
}

}  // extern "C"
