// The block math of the prefill kernel (cpu_prefill_attention.cpp): one item's per-thread
// buffers, and for one key block Q K^T, the online softmax step and P V. Included by that one
// file only (a header to keep each file short); numerics as described there.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_prefill_avx2.h"

namespace poise_prefill {

using namespace poise_attention;

constexpr int kKeys = 64;      // keys per block
// An item's rows, padded: to one 16-lane vector on the vector path (a short tail's few rows
// after a long context compute half as much as at 32), to two on AMX (its tiles take 32).
// The padding changes no row's sums: every row is one lane of its own.
constexpr int kRowAlign = 32;
constexpr int kVectorRowAlign = 16;
inline int padded_rows(int rows, bool amx) {
  const int align = amx ? kRowAlign : kVectorRowAlign;
  return (rows + align - 1) / align * align;
}
// Register tiles (16 accumulators each; measured on Zen 5 against 24-accumulator tiles, which
// spill): Q K^T takes kQkKeys keys x kQkRowVectors x 16 rows, P V kPvRows rows x head_dim.
constexpr int kQkKeys = 8;
constexpr int kQkRowVectors = 2;
constexpr int kPvRows = 4;

// Storage on 64-byte (cache line) boundaries: a vector or tile row that straddles two lines
// costs two accesses (the AMX tiles' 64-byte rows ran at half speed from malloc's 16-byte
// alignment). Every row stride below is a multiple of 64 bytes, so rows stay aligned.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

// Per-thread buffers of one item, rows padded to rp (padded_rows). Q and the
// scores are stored transposed (row index fastest), so one vector holds 16 rows: Q K^T
// broadcasts each key element against 16 rows' q, and the softmax runs 16 rows per vector.
struct Scratch {
  AlignedVector<float> qt;     // [hd][rp] Q transposed (float path)
  AlignedVector<uint32_t> qp;  // [hd/2][rp] Q as bf16 pairs of head dims (dpbf16 path)
  AlignedVector<float> st;     // [kKeys][rp] scores, then probabilities
  AlignedVector<uint32_t> pp;  // [kKeys/2][rp] probabilities as bf16 pairs of keys
  AlignedVector<float> o, m, l, corr;  // o: [rp][hd], or [hd][rp] on AMX (O^T)
  AlignedVector<int32_t> pos;  // [rp] the row's query position minus the block's first key
  Scratch(int rp, int hd)
      : qt(static_cast<size_t>(hd) * rp), qp(static_cast<size_t>(hd) * rp),
        st(static_cast<size_t>(kKeys) * rp), pp(static_cast<size_t>(kKeys) * rp),
        o(static_cast<size_t>(rp) * hd), m(rp), l(rp), corr(rp), pos(rp) {}
};

// One key block of one kv head, packed once per call for every item that reads it: its keys
// as rows of T, its values as bf16 pairs of keys [kKeys/2][hd][2] (dpbf16 path) or float
// rows [kKeys][hd] (float path). Both are kKeys * hd floats of room.
struct Packed {
  const void* k;   // [kKeys][hd] T
  const float* v;  // as above
};

#if defined(__AVX512F__)
// acc + a * b: float lanes (fma), or on the PAIRS path 16 lanes of bf16 pairs (dpbf16).
template <bool PAIRS>
inline __m512 madd(__m512 acc, __m512 a, __m512 b) {
#if defined(__AVX512BF16__)
  if constexpr (PAIRS)
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
#endif
  return _mm512_fmadd_ps(a, b, acc);
}

// Scores of NJ keys (from j0) for RV x 16 rows (from r0): st[j][r] = scale * q_r . k_j, the
// key's elements broadcast (a bf16 pair per dpbf16 on the PAIRS path) against the rows' q.
template <typename T, bool PAIRS, int HD, int NJ, int RV>
inline void qk_tile(Scratch& w, const Packed& b, int rp, int r0, int j0, float scale) {
  constexpr int kSteps = PAIRS ? HD / 2 : HD;
  const T* k = static_cast<const T*>(b.k) + j0 * HD;  // key t at k + t * HD
  const float* qsrc = (PAIRS ? reinterpret_cast<const float*>(w.qp.data()) : w.qt.data()) + r0;
  __m512 acc[NJ][RV];
  for (int t = 0; t < NJ; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int d = 0; d < kSteps; ++d) {
    __m512 q[RV];
    for (int v = 0; v < RV; ++v) q[v] = _mm512_loadu_ps(qsrc + d * rp + 16 * v);
    for (int t = 0; t < NJ; ++t) {
      __m512 b;
      if constexpr (PAIRS) {
        uint32_t pair;
        std::memcpy(&pair, k + t * HD + 2 * d, sizeof pair);
        b = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
      } else {
        b = _mm512_set1_ps(to_float(k[t * HD + d]));
      }
      for (int v = 0; v < RV; ++v) acc[t][v] = madd<PAIRS>(acc[t][v], b, q[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int t = 0; t < NJ; ++t)
    for (int v = 0; v < RV; ++v)
      _mm512_storeu_ps(&w.st[(j0 + t) * rp + r0 + 16 * v], _mm512_mul_ps(acc[t][v], sc));
}

// All rows against keys j0 .. j0 + NJ - 1: tiles of RV row vectors, then of two.
template <typename T, bool PAIRS, int HD, int NJ, int RV>
inline void qk_keys(Scratch& w, const Packed& b, int rp, int j0, float scale) {
  int r = 0;
  for (; r + 16 * RV <= rp; r += 16 * RV) qk_tile<T, PAIRS, HD, NJ, RV>(w, b, rp, r, j0, scale);
  for (; r + 32 <= rp; r += 32) qk_tile<T, PAIRS, HD, NJ, 2>(w, b, rp, r, j0, scale);
  for (; r < rp; r += 16) qk_tile<T, PAIRS, HD, NJ, 1>(w, b, rp, r, j0, scale);
}
#endif

// Whether this build packs a block's keys as float (the AVX2 vectors broadcast them so).
template <int HD, bool AMX>
constexpr bool float_keys() {
#if defined(POISE_ATTENTION_AVX2)
  return HD > 0 && !AMX;
#else
  return false;
#endif
}

template <typename T, bool PAIRS, int HD>
void scores(Scratch& w, const Packed& b, int rp, int hd, int n, float scale) {
#if defined(POISE_ATTENTION_AVX2)
  if constexpr (float_keys<HD, false>()) {
    poise_prefill_avx2::scores<HD>(w, static_cast<const float*>(b.k), rp, n, scale);
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (HD > 0) {
    int j = 0;
    for (; j + kQkKeys <= n; j += kQkKeys) qk_keys<T, PAIRS, HD, kQkKeys, kQkRowVectors>(w, b, rp, j, scale);
    for (; j < n; ++j) qk_keys<T, PAIRS, HD, 1, kQkRowVectors>(w, b, rp, j, scale);
    return;
  }
#endif
  for (int j = 0; j < n; ++j) {
    const T* k = static_cast<const T*>(b.k) + static_cast<int64_t>(j) * hd;
    float* sj = &w.st[j * rp];
    std::fill(sj, sj + rp, 0.0f);
    for (int d = 0; d < hd; ++d) {
      const float kd = to_float(k[d]) * scale;
      const float* qd = &w.qt[d * rp];
#pragma omp simd
      for (int r = 0; r < rp; ++r) sj[r] += kd * qd[r];
    }
  }
}

// Online softmax step for every row over the block's n keys (key j visible to row r iff
// j <= pos[r]; MASKED: the block crosses the diagonal, else every key is visible to every row):
// P = e^(S - m') (0 where not visible, up to n2 = n rounded up to even), m, l updated, corr =
// e^(m - m') for the rows' accumulated O. P goes to pp as bf16 pairs of keys on the PAIRS path
// (rounded once, as P V takes it; l sums the float values), else back into st.
#if defined(__AVX512F__)
template <bool MASKED>
inline __mmask16 visible(__m512i pos, int j, int n) {
  if (j >= n) return 0;
  if constexpr (MASKED) return _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(j));
  return 0xffff;
}

// (p_2jp, p_2jp+1) of 16 rows -> 16 bf16 pairs (key 2jp in the low half), in row order.
inline __m512i pack_pairs(__m512 even, __m512 odd) {
  // cvtne2ps puts `even` rounded in elements 0-15 and `odd` in 16-31; interleave them.
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(
      order, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
}
#endif

template <bool PAIRS, bool MASKED>
inline void softmax_block(Scratch& w, int rp, int n, int n2) {
#if defined(POISE_ATTENTION_AVX2)
  poise_prefill_avx2::softmax_block<MASKED>(w, rp, n, n2);
#elif defined(__AVX512F__)
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int r = 0; r < rp; r += 16) {
    const __m512i pos = _mm512_loadu_si512(&w.pos[r]);
    // Two running maxima (max is exact, so the split changes nothing) hide its latency.
    __m512 mx0 = _mm512_set1_ps(-kInf), mx1 = mx0;
    for (int j = 0; j < n2; j += 2) {
      mx0 = _mm512_mask_max_ps(mx0, visible<MASKED>(pos, j, n), mx0,
                               _mm512_loadu_ps(&w.st[j * rp + r]));
      mx1 = _mm512_mask_max_ps(mx1, visible<MASKED>(pos, j + 1, n), mx1,
                               _mm512_loadu_ps(&w.st[(j + 1) * rp + r]));
    }
    const __m512 m_old = _mm512_loadu_ps(&w.m[r]);
    // finite: key 0 is visible to every row
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_max_ps(mx0, mx1));
    const __m512 corr = exp_nonpositive16(_mm512_sub_ps(m_old, m_new));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n2; j += 2) {
      __m512 e[2];
      for (int t = 0; t < 2; ++t) {
        const __m512 s = _mm512_loadu_ps(&w.st[(j + t) * rp + r]);
        e[t] = _mm512_maskz_mov_ps(visible<MASKED>(pos, j + t, n),
                                   exp_nonpositive16(_mm512_sub_ps(s, m_new)));
        sum = _mm512_add_ps(sum, e[t]);
      }
#if defined(__AVX512BF16__)
      if constexpr (PAIRS) {
        _mm512_storeu_si512(&w.pp[(j / 2) * rp + r], pack_pairs(e[0], e[1]));
        continue;
      }
#endif
      _mm512_storeu_ps(&w.st[j * rp + r], e[0]);
      _mm512_storeu_ps(&w.st[(j + 1) * rp + r], e[1]);
    }
    _mm512_storeu_ps(&w.m[r], m_new);
    _mm512_storeu_ps(&w.l[r], _mm512_fmadd_ps(_mm512_loadu_ps(&w.l[r]), corr, sum));
    _mm512_storeu_ps(&w.corr[r], corr);
  }
#else
  for (int r = 0; r < rp; ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    // Unmasked blocks leave pos as the last masked one did: every key is visible there.
    auto seen = [&](int j) { return j < n && (!MASKED || j <= w.pos[r]); };
    for (int j = 0; seen(j); ++j) mx = std::max(mx, w.st[j * rp + r]);
    const float m_new = std::max(w.m[r], mx);
    const float corr = std::exp(w.m[r] - m_new);
    float sum = 0.0f;
    for (int j = 0; j < n2; ++j) {
      float& s = w.st[j * rp + r];
      s = seen(j) ? exp_nonpositive(s - m_new) : 0.0f;
      sum += s;
    }
    w.m[r] = m_new;
    w.l[r] = w.l[r] * corr + sum;
    w.corr[r] = corr;
  }
#endif
}

#if defined(__AVX512F__)
// PV for NR rows from r0 over `steps` keys (or key pairs): the rows' O (times corr) held in
// NR x HD/16 registers, each V vector (pair) loaded once for the NR rows.
template <typename T, bool PAIRS, int HD, int NR>
inline void pv_rows(Scratch& w, const float* vsrc, int rp, int r0, int steps) {
  constexpr int NV = HD / 16;
  const float* psrc = PAIRS ? reinterpret_cast<const float*>(w.pp.data()) : w.st.data();
  __m512 acc[NR][NV];
  for (int i = 0; i < NR; ++i) {
    const __m512 c = _mm512_set1_ps(w.corr[r0 + i]);
    for (int v = 0; v < NV; ++v)
      acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(&w.o[(r0 + i) * HD + v * 16]), c);
  }
  for (int j = 0; j < steps; ++j) {
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_ps(vsrc + j * HD + v * 16);
    for (int i = 0; i < NR; ++i) {
      const __m512 p = _mm512_set1_ps(like_t<T, PAIRS>(psrc[j * rp + r0 + i]));
      for (int v = 0; v < NV; ++v) acc[i][v] = madd<PAIRS>(acc[i][v], p, vv[v]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(&w.o[(r0 + i) * HD + v * 16], acc[i][v]);
}
#endif

// O[r] = O[r] * corr[r] + sum_j P[r][j] V[j] over the block's keys. PAIRS: P (rounded to bf16,
// as flash attention does; its sum l stays float) and V in bf16, two keys per dpbf16.
template <typename T, bool PAIRS, int HD>
void accumulate(Scratch& w, const Packed& b, int rp, int hd, int n, int n2) {
#if defined(POISE_ATTENTION_AVX2)
  if constexpr (HD > 0) {
    poise_prefill_avx2::accumulate<HD, std::is_same_v<T, bf16>>(w, b.v, rp, n);
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (HD > 0) {
    const int steps = PAIRS ? n2 / 2 : n;  // key pairs, or keys
    int r0 = 0;  // tiles of kPvRows rows, then of two (rp is a multiple of 16)
    for (; r0 + kPvRows <= rp; r0 += kPvRows) pv_rows<T, PAIRS, HD, kPvRows>(w, b.v, rp, r0, steps);
    for (; r0 < rp; r0 += 2) pv_rows<T, PAIRS, HD, 2>(w, b.v, rp, r0, steps);
    return;
  }
#endif
  (void)n2;
  for (int r = 0; r < rp; ++r) {
    float* o = &w.o[r * hd];
    const float c = w.corr[r];
    for (int d = 0; d < hd; ++d) o[d] *= c;
    for (int j = 0; j < n; ++j) {
      const float p = like_t<T, false>(w.st[j * rp + r]);
      const float* v = b.v + j * hd;
#pragma omp simd
      for (int d = 0; d < hd; ++d) o[d] += p * v[d];
    }
  }
}

// Q rows 0 .. rp - 1 of an item into its transposed layout: src(r) is row r's q, or nullptr
// for padding (zero).
template <typename T, bool PAIRS, typename Src>
void load_q(Scratch& w, int rp, int hd, Src src) {
  for (int r = 0; r < rp; ++r) {
    const T* q = src(r);
    if constexpr (PAIRS) {
      for (int d = 0; d < hd / 2; ++d) {
        uint32_t pair = 0;
        if (q) std::memcpy(&pair, q + 2 * d, sizeof pair);
        w.qp[d * rp + r] = pair;
      }
    } else {
      for (int d = 0; d < hd; ++d) w.qt[d * rp + r] = q ? to_float(q[d]) : 0.0f;
    }
  }
}

// The online softmax state of rows 0 .. rows - 1 (o [rp][hd], m, l) from `state` (rows of
// hd + 2 floats), or fresh where state is null; padding rows fresh.
inline void load_state(Scratch& w, int rp, int rows, int hd, const float* state) {
  std::fill(w.o.begin(), w.o.begin() + static_cast<size_t>(rp) * hd, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rp, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rp, 0.0f);
  if (state == nullptr) return;
  for (int r = 0; r < rows; ++r, state += hd + 2) {
    std::memcpy(&w.o[static_cast<size_t>(r) * hd], state, sizeof(float) * hd);
    w.m[r] = state[hd];
    w.l[r] = state[hd + 1];
  }
}

// The vector walk over key blocks kb_from / kKeys .. of keys 0 .. key_end - 1, the item's
// first query at first_pos (row r's query at first_pos + r / G). block_at(b): key block b,
// packed (already, or just now: cpu_prefill_attention.cpp packs a lone item's blocks as it goes).
template <typename T, bool PAIRS, int HD, typename BlockAt>
void walk_vector(Scratch& w, BlockAt&& block_at, int64_t kb_from, int64_t key_end,
                 int64_t first_pos, int rp, int hd, int G, float scale) {
  for (int64_t kb = kb_from; kb < key_end; kb += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, key_end - kb));
    const int n2 = (n + 1) & ~1;
    const Packed& b = block_at(kb / kKeys);
    const bool masked = kb + n - 1 > first_pos;  // some key past the first query: the diagonal
    if (masked)
      for (int r = 0; r < rp; ++r)
        w.pos[r] = static_cast<int32_t>(std::min<int64_t>(first_pos + r / G - kb, kKeys));
    scores<T, PAIRS, HD>(w, b, rp, hd, n, scale);
    if (masked)
      softmax_block<PAIRS, true>(w, rp, n, n2);
    else
      softmax_block<PAIRS, false>(w, rp, n, n2);
    accumulate<T, PAIRS, HD>(w, b, rp, hd, n, n2);
  }
}

}  // namespace poise_prefill
