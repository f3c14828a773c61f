// Prefill attention for CPU: every query of a prompt chunk against its request's keys up to its
// own position (causal), read in place from the paged KV cache through the chunk's block table.
// No gather copy of the context, no dense mask: the cost is the causal pairs, not context^2.
//
// Flash-attention style. A work item is (chunk, block of kQueries queries, kv head g): its rows
// are those queries times the G query heads that share kv head g (GQA, as transformers'
// repeat_kv: query head h uses kv head h / G). The item walks the keys in blocks of kKeys:
//   pack the block's K transposed (and V widened to float) once, for all the item's rows;
//   S = Q K^T * scale  (bf16 pairs through AVX512-BF16 dpbf16 when the inputs are bf16 and the
//                       CPU has it; float FMAs otherwise; plain loops without AVX-512);
//   online softmax per row: keys after the row's position are cut by a count, not a mask,
//   m' = max(m, max S), O = O e^(m - m') + e^(S - m') V, l likewise;
// then O / l is written once, rounded to the output dtype. Items run under OpenMP, the most
// expensive (last query blocks, most keys) first, so the causal triangle balances.
//
// Numerics: scores, softmax and P V in float32 (bf16 q and k products are exact in float32;
// dpbf16 sums pairs in float32). Shapes as in cpu_paged_attention.cpp; chunk c is the flat
// tokens query_start[c] .. + query_len[c], at positions start_position[c] .., block table
// row c of `tables`.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"

namespace {

using namespace poise_attention;

constexpr int kQueries = 32;  // queries per work item
constexpr int kKeys = 64;     // keys per block (4 vectors of 16)

struct Chunks {
  const void* q;
  int64_t q_token_stride;
  const void* kv_cache;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* query_start;
  const int64_t* query_len;
  const int64_t* start_position;
  int num_chunks;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  float scale;
  void* out;
  int64_t out_token_stride;
};

struct Item {
  int chunk, first_query, kv_head;
  int64_t cost;
};

// Per-thread buffers of one item (sized for its largest shape, reused across items).
struct Scratch {
  std::vector<const void*> slots;  // [kKeys] slot pointers of the key block
  std::vector<float> kt;           // [hd][kKeys] K transposed (float path)
  std::vector<uint32_t> kp;        // [hd/2][kKeys] K as bf16 pairs (dpbf16 path)
  std::vector<float> vf;           // [kKeys][hd] V widened
  std::vector<float> qf;           // [R][hd] (float path)
  std::vector<uint32_t> qp;        // [R][hd/2] (dpbf16 path)
  std::vector<float> s;            // [R][kKeys] scores, then probabilities
  std::vector<bf16> vp;            // [kKeys/2][hd][2] V as pairs of keys (dpbf16 path)
  std::vector<bf16> pb;            // [R][kKeys] probabilities in bf16 (dpbf16 path)
  std::vector<float> o, m, l, corr;
  Scratch(int rows, int hd)
      : slots(kKeys), kt(static_cast<size_t>(hd) * kKeys), kp(static_cast<size_t>(hd) * kKeys),
        vf(static_cast<size_t>(hd) * kKeys), qf(static_cast<size_t>(rows) * hd),
        qp(static_cast<size_t>(rows) * hd), s(static_cast<size_t>(rows) * kKeys),
        vp(static_cast<size_t>(hd) * kKeys), pb(static_cast<size_t>(rows) * kKeys),
        o(static_cast<size_t>(rows) * hd), m(rows), l(rows), corr(rows) {}
};

// S[r][0..kKeys) = scale * q_r . k_j for all rows. HD > 0: the AVX-512 register kernels.
template <bool PAIRS, int HD>
void scores(Scratch& w, int rows, int hd, float scale) {
#if defined(__AVX512F__)
  if constexpr (HD > 0) {
    constexpr int NR = 4;
    constexpr int kSteps = PAIRS ? HD / 2 : HD;
    for (int r0 = 0; r0 < rows; r0 += NR) {
      const int nr = std::min(NR, rows - r0);
      __m512 acc[NR][4];
      for (int i = 0; i < NR; ++i)
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
      for (int d = 0; d < kSteps; ++d) {
        __m512 k[4];
        for (int v = 0; v < 4; ++v)
          k[v] = PAIRS ? _mm512_castsi512_ps(_mm512_loadu_si512(&w.kp[d * kKeys + v * 16]))
                       : _mm512_loadu_ps(&w.kt[d * kKeys + v * 16]);
        for (int i = 0; i < NR; ++i) {
          if (i >= nr) break;
          if constexpr (PAIRS) {
#if defined(__AVX512BF16__)
            const __m512bh b = reinterpret_cast<__m512bh>(
                _mm512_set1_epi32(static_cast<int>(w.qp[(r0 + i) * (HD / 2) + d])));
            for (int v = 0; v < 4; ++v)
              acc[i][v] = _mm512_dpbf16_ps(acc[i][v], b, reinterpret_cast<__m512bh>(k[v]));
#endif
          } else {
            const __m512 b = _mm512_set1_ps(w.qf[(r0 + i) * HD + d]);
            for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(b, k[v], acc[i][v]);
          }
        }
      }
      const __m512 sc = _mm512_set1_ps(scale);
      for (int i = 0; i < nr; ++i)
        for (int v = 0; v < 4; ++v)
          _mm512_storeu_ps(&w.s[(r0 + i) * kKeys + v * 16], _mm512_mul_ps(acc[i][v], sc));
    }
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) {
    float* sr = &w.s[r * kKeys];
    std::fill(sr, sr + kKeys, 0.0f);
    for (int d = 0; d < hd; ++d) {
      const float qd = w.qf[r * hd + d] * scale;
      const float* kd = &w.kt[d * kKeys];
#pragma omp simd
      for (int j = 0; j < kKeys; ++j) sr[j] += qd * kd[j];
    }
  }
}

// One row's online-softmax step over its `vis` visible keys: S -> P = e^(S - m') in place (0
// past vis), l and m updated; returns the factor e^(m - m') for the row's accumulated O.
inline float softmax_update(float* sr, int vis, float& m, float& l) {
  if (vis <= 0) {
    std::fill(sr, sr + kKeys, 0.0f);
    return 1.0f;
  }
  float mx = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < vis; ++j) mx = std::max(mx, sr[j]);
  const float m_new = std::max(m, mx);
  const float corr = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  float sum = 0.0f;
#if defined(__AVX512F__)
  const __m512 mb = _mm512_set1_ps(m_new);
  __m512 sv = _mm512_setzero_ps();
  for (int j = 0; j < kKeys; j += 16) {
    const int left = std::clamp(vis - j, 0, 16);
    const __mmask16 k = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        k, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + j), mb)));
    _mm512_storeu_ps(sr + j, e);
    sv = _mm512_add_ps(sv, e);
  }
  sum = _mm512_reduce_add_ps(sv);
#else
  for (int j = 0; j < kKeys; ++j) {
    sr[j] = j < vis ? exp_nonpositive(sr[j] - m_new) : 0.0f;
    sum += sr[j];
  }
#endif
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// O[r] = O[r] * corr[r] + sum_j P[r][j] V[j] over the block's n keys. PAIRS: P and V in bf16,
// two keys per dpbf16 (P rounded to bf16 as flash attention does; its sum l stays float).
template <bool PAIRS, int HD>
void accumulate(Scratch& w, int rows, int hd, int n) {
#if defined(__AVX512BF16__)
  if constexpr (PAIRS && HD > 0) {
    constexpr int NV = HD / 16;
    constexpr int NR = NV <= 4 ? 4 : 2;
    const uint32_t* pp = reinterpret_cast<const uint32_t*>(w.pb.data());
    for (int r0 = 0; r0 < rows; r0 += NR) {
      const int nr = std::min(NR, rows - r0);
      __m512 acc[NR][NV];
      for (int i = 0; i < nr; ++i) {
        const __m512 c = _mm512_set1_ps(w.corr[r0 + i]);
        for (int v = 0; v < NV; ++v)
          acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(&w.o[(r0 + i) * HD + v * 16]), c);
      }
      for (int jp = 0; jp < (n + 1) / 2; ++jp) {
        __m512bh vv[NV];
        for (int v = 0; v < NV; ++v)
          vv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(&w.vp[(jp * HD + v * 16) * 2]));
        for (int i = 0; i < NR; ++i) {
          if (i >= nr) break;
          const __m512bh pr = reinterpret_cast<__m512bh>(
              _mm512_set1_epi32(static_cast<int>(pp[(r0 + i) * (kKeys / 2) + jp])));
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pr, vv[v]);
        }
      }
      for (int i = 0; i < nr; ++i)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(&w.o[(r0 + i) * HD + v * 16], acc[i][v]);
    }
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (HD > 0) {
    constexpr int NV = HD / 16;
    constexpr int NR = NV <= 4 ? 4 : 2;  // NR * NV accumulators + NV values <= 32 registers
    for (int r0 = 0; r0 < rows; r0 += NR) {
      const int nr = std::min(NR, rows - r0);
      __m512 acc[NR][NV];
      for (int i = 0; i < nr; ++i) {
        const __m512 c = _mm512_set1_ps(w.corr[r0 + i]);
        for (int v = 0; v < NV; ++v)
          acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(&w.o[(r0 + i) * HD + v * 16]), c);
      }
      for (int j = 0; j < n; ++j) {
        __m512 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_ps(&w.vf[j * HD + v * 16]);
        for (int i = 0; i < NR; ++i) {
          if (i >= nr) break;
          const __m512 p = _mm512_set1_ps(w.s[(r0 + i) * kKeys + j]);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(p, vv[v], acc[i][v]);
        }
      }
      for (int i = 0; i < nr; ++i)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(&w.o[(r0 + i) * HD + v * 16], acc[i][v]);
    }
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) {
    float* o = &w.o[r * hd];
    const float c = w.corr[r];
    for (int d = 0; d < hd; ++d) o[d] *= c;
    for (int j = 0; j < n; ++j) {
      const float p = w.s[r * kKeys + j];
      const float* v = &w.vf[j * hd];
#pragma omp simd
      for (int d = 0; d < hd; ++d) o[d] += p * v[d];
    }
  }
}

// The dpbf16 path's V: keys 2jp and 2jp+1 interleaved per head dim, vp[jp][d] = (v0, v1);
// keys past n are zeros.
template <typename T>
void pack_value_pairs(Scratch& w, int hd, int n, int64_t v_off) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    static const bf16 zeros[256] = {};
    for (int jp = 0; jp < kKeys / 2; ++jp) {
      const int j = 2 * jp;
      const bf16* a = j < n ? static_cast<const bf16*>(w.slots[j]) + v_off : zeros;
      const bf16* b = j + 1 < n ? static_cast<const bf16*>(w.slots[j + 1]) + v_off : zeros;
      bf16* dst = &w.vp[static_cast<size_t>(jp) * hd * 2];
      for (int d = 0; d < hd; d += 16) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d));
        const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d));
        const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * d),
                            _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * d + 16),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
      }
    }
    return;
  }
#endif
  (void)w, (void)hd, (void)n, (void)v_off;
}

// The dpbf16 path's P: each row's probabilities rounded to bf16 (nearest even).
inline void to_bf16_rows(Scratch& w, int rows) {
#if defined(__AVX512BF16__)
  for (int k = 0; k < rows * kKeys; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&w.pb[k]),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(&w.s[k]))));
#else
  (void)w, (void)rows;
#endif
}

template <typename T, bool PAIRS, int HD>
void attend_item(const Chunks& p, const Item& it, Scratch& w) {
  const int hd = HD > 0 ? HD : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads, g = it.kv_head;
  const int nq = std::min<int>(kQueries, static_cast<int>(p.query_len[it.chunk]) - it.first_query);
  const int rows = nq * G;
  const int64_t first_pos = p.start_position[it.chunk] + it.first_query;
  const int64_t key_end = first_pos + nq;  // keys 0 .. key_end - 1
  const int64_t token0 = p.query_start[it.chunk] + it.first_query;
  const T* cache = static_cast<const T*>(p.kv_cache);
  const int64_t* table = p.tables + it.chunk * p.table_stride;
  const int64_t slot_stride = static_cast<int64_t>(2 * p.num_kv_heads) * hd;
  const int64_t k_off = static_cast<int64_t>(g) * hd, v_off = k_off + p.num_kv_heads * hd;

  // Row r = (query r / G, head g * G + r % G): that head's q row, contiguous per token.
  for (int r = 0; r < rows; ++r) {
    const T* src = static_cast<const T*>(p.q) + (token0 + r / G) * p.q_token_stride +
                   static_cast<int64_t>(g * G + r % G) * hd;
    if constexpr (PAIRS)
      std::memcpy(&w.qp[r * (hd / 2)], src, hd * sizeof(T));
    else
      for (int d = 0; d < hd; ++d) w.qf[r * hd + d] = to_float(src[d]);
  }
  std::fill(w.o.begin(), w.o.begin() + rows * hd, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);

  for (int64_t kb = 0; kb < key_end; kb += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, key_end - kb));
    for (int j = 0; j < n; ++j) {
      const int64_t pos = kb + j;
      w.slots[j] = cache + (table[pos / p.block_size] * p.block_size + pos % p.block_size) *
                               slot_stride;
    }
    for (int j = 0; j < kKeys; ++j) {  // keys past n: zeros (their P is 0, never NaN * 0)
      const T* k = j < n ? static_cast<const T*>(w.slots[j]) + k_off : nullptr;
      const T* v = j < n ? static_cast<const T*>(w.slots[j]) + v_off : nullptr;
      if constexpr (PAIRS) {
        for (int d = 0; d < hd / 2; ++d) {
          uint32_t pair = 0;
          if (k) std::memcpy(&pair, k + 2 * d, sizeof pair);
          w.kp[d * kKeys + j] = pair;
        }
      } else {
        for (int d = 0; d < hd; ++d) w.kt[d * kKeys + j] = k ? to_float(k[d]) : 0.0f;
      }
      if constexpr (!PAIRS)
        for (int d = 0; d < hd; ++d) w.vf[j * hd + d] = v ? to_float(v[d]) : 0.0f;
    }
    if constexpr (PAIRS) pack_value_pairs<T>(w, hd, n, v_off);
    scores<PAIRS, HD>(w, rows, hd, p.scale);
    for (int r = 0; r < rows; ++r) {
      const int64_t vis = std::min<int64_t>(n, first_pos + r / G - kb + 1);
      w.corr[r] = softmax_update(&w.s[r * kKeys], static_cast<int>(vis), w.m[r], w.l[r]);
    }
    if constexpr (PAIRS) to_bf16_rows(w, rows);
    accumulate<PAIRS, HD>(w, rows, hd, n);
  }

  for (int r = 0; r < rows; ++r) {
    T* dst = static_cast<T*>(p.out) + (token0 + r / G) * p.out_token_stride +
             static_cast<int64_t>(g * G + r % G) * hd;
    const float inv = 1.0f / w.l[r];  // > 0: key 0 is visible to every query
    for (int d = 0; d < hd; ++d) from_float(w.o[r * hd + d] * inv, dst + d);
  }
}

template <typename T, bool PAIRS, int HD>
void run(const Chunks& p, int num_threads) {
  std::vector<Item> items;
  for (int c = 0; c < p.num_chunks; ++c)
    for (int q0 = 0; q0 < p.query_len[c]; q0 += kQueries)
      for (int g = 0; g < p.num_kv_heads; ++g)
        items.push_back({c, q0, g, p.start_position[c] + q0 + kQueries});
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int rows = kQueries * (p.num_heads / p.num_kv_heads);
  const int num_items = static_cast<int>(items.size());
#pragma omp parallel num_threads(num_threads)
  {
    Scratch w(rows, p.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < num_items; ++k) attend_item<T, PAIRS, HD>(p, items[k], w);
  }
}

template <typename T, bool PAIRS>
void dispatch_head_dim(const Chunks& p, int num_threads) {
  switch (p.head_dim) {
    case 64:
      run<T, PAIRS, 64>(p, num_threads);
      break;
    case 128:
      run<T, PAIRS, 128>(p, num_threads);
      break;
    default:
      run<T, false, 0>(p, num_threads);  // the plain loops read K as float
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Returns 0 on success, a negative code on bad arguments.
int poise_paged_prefill(int dtype, const void* q, int64_t q_token_stride, const void* kv_cache,
                        const int64_t* tables, int64_t table_stride, const int64_t* query_start,
                        const int64_t* query_len, const int64_t* start_position, int num_chunks,
                        int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, void* out, int64_t out_token_stride, int num_threads) {
  if (num_chunks <= 0) return 0;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0)
    return -1;
  const Chunks p{q,           q_token_stride, kv_cache,     tables,       table_stride,
                 query_start, query_len,      start_position, num_chunks, num_heads,
                 num_kv_heads, head_dim,      block_size,   scale,        out,
                 out_token_stride};
  const int threads = std::max(num_threads, 1);
  if (dtype == 0) {
    dispatch_head_dim<float, false>(p, threads);
  } else if (dtype == 1) {
#if defined(__AVX512BF16__)
    dispatch_head_dim<bf16, true>(p, threads);
#else
    dispatch_head_dim<bf16, false>(p, threads);
#endif
  } else {
    return -2;
  }
  return 0;
}

}  // extern "C"
