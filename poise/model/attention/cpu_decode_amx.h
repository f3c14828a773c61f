// The decode kernel's units (cpu_paged_attention.cpp, cpu_decode_cascade.h) on AMX tiles, for
// bf16 caches at head_dim 64 or 128 with blocks of a multiple of 16 keys, where the CPU and the
// OS allow AMX. Every unit of a call takes this path (a lone row's partition and a group's shared
// one alike), so a row's output is the same bits alone or in a group, as on the vector path.
//
// Why: a group unit (rows sharing a cached prefix) reads each shared key once, but on vectors it
// still paid every query's products one by one: at concurrency 32 of the seed mix, 24 queries
// per kv head over 3,363 shared keys made decode attention compute-bound (26.5 ms a step, 5.5
// GB/s of KV). On tiles a unit's queries go 16 at a time per kv head:
// - Q K^T as S^T = K Q^T: A = 16 keys' K rows straight from the cache (a block's rows of one
//   head are at the slot's stride), B = the queries as bf16 pairs of head dims (built once per
//   unit and head), C = [16 keys][16 queries] float;
// - the softmax per query on 16 lanes, over the unit's keys in order (max, exp, sum);
// - P V as O = P V: A = P [16 queries][32 keys] bf16, B = 32 keys' values interleaved in pairs
//   (packed once per unit and head), C = [16 queries][16 head dims], four at a time.
// A query's every sum depends on its own row of A (or column of B) only, so the other queries in
// its tile (a group's, or zeros) change none of its bits.
//
// Numerics: float32 sums (a tile adds each K block's 32 products, then rounds), P rounded to
// bf16 for P V as on the vector path, the same exp; the partials (max, sum, unnormalised
// values) merge as every partition's do.
#pragma once

#include "cpu_amx.h"

#if defined(POISE_ATTENTION_AMX)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_decode_cascade.h"

namespace poise_attention {

// A thread's buffers for one unit, kept from call to call (sized for the largest partition).
struct AmxDecodeScratch {
  std::vector<float> st;      // [keys rounded to 32][16 queries]: scores, then exps
  std::vector<uint32_t> vp;   // [32-key chunks][HD / 16][16 key pairs][16 dims]: V as B tiles
  std::vector<uint32_t> pa;   // [32-key chunks][16 queries][16 key pairs]: P as A tiles
  alignas(64) uint32_t qt[4][16][16];  // [HD / 32][16 dim pairs][16 queries]: Q^T as B tiles
  alignas(64) float o[4][16][16];      // a pass's accumulators: [tile][query][16 dims]
  alignas(64) float m[16], l[16];

  void reserve(int keys, int hd) {
    const size_t chunks = static_cast<size_t>(keys + 31) / 32;
    if (st.size() < chunks * 32 * 16) st.resize(chunks * 32 * 16);
    if (vp.size() < chunks * (hd / 16) * 256) vp.resize(chunks * (hd / 16) * 256);
    if (pa.size() < chunks * 256) pa.resize(chunks * 256);
  }
};

// Values of keys [0, n) (slots, v_offset) as B tiles: for each 32-key chunk and 16 head dims,
// row i = (v[2i][d], v[2i + 1][d]) for d in the 16 dims. Keys past n: zero rows (their weights
// are zero, and 0 * a stale value could be NaN).
template <int HD>
inline void amx_pack_values(const bf16* const* slots, int n, int64_t v_offset, uint32_t* vp) {
  constexpr int kTiles = HD / 16;
  // Interleaves two rows' 16-bit elements 0-15 (lo) or 16-31 (hi) in pairs.
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int chunks = (n + 31) / 32;
  for (int c = 0; c < chunks; ++c)
    for (int i = 0; i < 16; ++i) {
      const int j = 32 * c + 2 * i;
      for (int d = 0; d < HD; d += 32) {
        const __m512i x = j < n ? _mm512_loadu_si512(slots[j] + v_offset + d)
                                : _mm512_setzero_si512();
        const __m512i y = j + 1 < n ? _mm512_loadu_si512(slots[j + 1] + v_offset + d)
                                    : _mm512_setzero_si512();
        uint32_t* t0 = vp + ((static_cast<size_t>(c) * kTiles + d / 16) * 16 + i) * 16;
        _mm512_storeu_si512(t0, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(t0 + 256, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
}

// One unit (keys [unit.begin, unit.end) of its rows), every kv head: each row's partial to its
// item, as attend_unit's vector path writes it. slots: the unit's keys (fill_slots).
template <int HD>
void attend_unit_amx(const DecodeProblem<void>& p, const DecodePlan& plan, const DecodeUnit& unit,
                     const bf16* const* slots, AmxDecodeScratch& w, float* acc, float* stats) {
  constexpr int kKb = HD / 32;  // K blocks of Q K^T
  constexpr int kTiles = HD / 16;
  const int H = p.num_heads, Hkv = p.num_kv_heads, G = H / Hkv;
  const int n = unit.end - unit.begin;
  const int chunks = (n + 31) / 32;
  const int* rows = plan.unit_rows.data() + unit.rows_begin;
  const int num = unit.rows_end - unit.rows_begin;
  const int64_t slot_stride = static_cast<int64_t>(2 * Hkv) * HD;
  const int64_t k_stride = slot_stride * static_cast<int64_t>(sizeof(bf16));
  w.reserve(n, HD);
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int g = 0; g < Hkv; ++g) {
    amx_pack_values<HD>(slots, n, static_cast<int64_t>(Hkv + g) * HD, w.vp.data());
    const int queries = num * G;
    for (int set = 0; set < queries; set += 16) {
      const int count = std::min(16, queries - set);
      auto query = [&](int j) {  // (row index in the unit, head) of the set's query j
        return std::pair<int, int>((set + j) / G, g * G + (set + j) % G);
      };
      // Q^T as B tiles: qt[kb][i][j] = query j's head dims (32 kb + 2i, + 1); zeros past count.
      std::memset(w.qt, 0, sizeof w.qt);
      for (int j = 0; j < count; ++j) {
        const auto [m, h] = query(j);
        const bf16* q = static_cast<const bf16*>(p.q) + p.row_token[rows[m]] * p.q_token_stride +
                        static_cast<int64_t>(h) * HD;
        for (int kb = 0; kb < kKb; ++kb)
          for (int i = 0; i < 16; ++i) std::memcpy(&w.qt[kb][i][j], q + kb * 32 + 2 * i, 4);
      }
      // S^T, 16 keys at a time: a run of 16 keys from a 16-aligned start lies in one block
      // (block_size % 16 == 0), its rows at the slot's stride. Keys past n (the rest of the
      // last run, in the same block) are computed and never read.
      for (int kb = 0; kb < kKb; ++kb) {
        if (kb == 0) _tile_loadd(2, w.qt[0], 64);
        if (kb == 1) _tile_loadd(3, w.qt[1], 64);
        if (kb == 2) _tile_loadd(4, w.qt[2], 64);
        if (kb == 3) _tile_loadd(5, w.qt[3], 64);
      }
      for (int j0 = 0; j0 < n; j0 += 16) {
        const bf16* k = slots[j0] + static_cast<int64_t>(g) * HD;
        _tile_zero(0);
        _tile_loadd(1, k, k_stride);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(1, k + 32, k_stride);
        _tile_dpbf16ps(0, 1, 3);
        if constexpr (kKb == 4) {
          _tile_loadd(1, k + 64, k_stride);
          _tile_dpbf16ps(0, 1, 4);
          _tile_loadd(1, k + 96, k_stride);
          _tile_dpbf16ps(0, 1, 5);
        }
        _tile_stored(0, w.st.data() + static_cast<size_t>(j0) * 16, 64);
      }
      // The softmax of each query (lane) over keys [0, n) in order; exps past n are zero.
      float* st = w.st.data();
      __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int j = 0; j < n; ++j) mv = _mm512_max_ps(mv, _mm512_mul_ps(_mm512_loadu_ps(st + j * 16), scale));
      __m512 lv = _mm512_setzero_ps();
      for (int j = 0; j < n; ++j) {
        const __m512 e = exp_nonpositive16(
            _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(st + j * 16), scale), mv));
        _mm512_storeu_ps(st + j * 16, e);
        lv = _mm512_add_ps(lv, e);
      }
      for (int j = n; j < chunks * 32; ++j) _mm512_storeu_ps(st + j * 16, _mm512_setzero_ps());
      _mm512_store_ps(w.m, mv);
      _mm512_store_ps(w.l, lv);
      // P as A tiles: pa[c][q][i] = bf16 (p[32c + 2i][q], p[32c + 2i + 1][q]).
      const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                             9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                             17, 1, 16, 0);
      for (int c = 0; c < chunks; ++c) {
        alignas(64) uint32_t d[16][16];  // [key pair][query]
        for (int i = 0; i < 16; ++i) {
          const float* x = st + static_cast<size_t>(32 * c + 2 * i) * 16;
          const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
          _mm512_store_si512(d[i], _mm512_permutexvar_epi16(pairs, (__m512i)b));
        }
        uint32_t* a = w.pa.data() + static_cast<size_t>(c) * 256;
        for (int q = 0; q < 16; ++q)
          for (int i = 0; i < 16; ++i) a[q * 16 + i] = d[i][q];
      }
      // O = P V, four 16-dim tiles at a time, over the chunks in order.
      for (int t0 = 0; t0 < kTiles; t0 += 4) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < chunks; ++c) {
          _tile_loadd(4, w.pa.data() + static_cast<size_t>(c) * 256, 64);
          const uint32_t* v = w.vp.data() + (static_cast<size_t>(c) * kTiles + t0) * 256;
          _tile_loadd(5, v, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, v + 256, 64);
          _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, v + 512, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, v + 768, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, w.o[0], 64);
        _tile_stored(1, w.o[1], 64);
        _tile_stored(2, w.o[2], 64);
        _tile_stored(3, w.o[3], 64);
        for (int j = 0; j < count; ++j) {
          const auto [m, h] = query(j);
          const size_t it = static_cast<size_t>(plan.row_first_item[rows[m]] + unit.item);
          float* out = acc + (it * H + h) * HD + t0 * 16;
          for (int t = 0; t < 4; ++t) _mm512_storeu_ps(out + t * 16, _mm512_load_ps(w.o[t][j]));
        }
      }
      for (int j = 0; j < count; ++j) {
        const auto [m, h] = query(j);
        float* s = stats + static_cast<size_t>(plan.row_first_item[rows[m]] + unit.item) * H * 2;
        s[h] = w.m[j];
        s[H + h] = w.l[j];
      }
    }
  }
}

}  // namespace poise_attention

#endif  // POISE_ATTENTION_AMX
