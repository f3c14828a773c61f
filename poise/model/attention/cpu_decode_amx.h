// The decode kernel's units (cpu_paged_attention.cpp, cpu_decode_cascade.h) on AMX tiles, for
// bf16 caches at head_dim 64 or 128 with blocks of a multiple of 16 keys, where the CPU and the
// OS allow AMX. Every unit of a call takes this path (a lone row's partition and a group's shared
// one alike), so a row's output is the same bits alone or in a group, as on the vector path.
//
// Why: a group unit (rows sharing a cached prefix) reads each shared key once, but on vectors it
// still paid every query's products one by one: at concurrency 32 of the seed mix, 24 queries
// per kv head over 3,363 shared keys made decode attention compute-bound (26.5 ms a step, 5.5
// GB/s of KV). On tiles a unit's queries (every kv head's, in kv head order) go 16 at a time,
// a set of 16 (a job) split into pieces by kv head:
// - Q K^T as S^T = K Q^T: A = 16 keys' K rows straight from the cache (a block's rows of one
//   head are at the slot's stride), B = a piece's queries as bf16 pairs of head dims (the
//   job's other columns zero), C = [16 keys][16 queries] float, the job's pieces summed into
//   one C: a query's column gets its own kv head's products and exact zeros from the others;
// - the softmax per query on 16 lanes, over the unit's keys in order (max, exp, sum), once per
//   job (a lone row of SmolLM2-135M: its 9 heads in one job, not 3 of 3 heads);
// - P V as O = P V: A = a piece's rows of P [16 queries][32 keys] bf16 (others zero), B = 32
//   keys of its kv head's values interleaved in pairs (packed once per unit), C = [16
//   queries][16 head dims], four at a time.
// A query's every sum is its own products plus exact zeros, in the same order, whichever
// queries share its job, so a row gets the same bits alone or in a group.
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
#include <limits>
#include <utility>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_decode_cascade.h"

namespace poise_attention {

// A thread's buffers for one unit, kept from call to call (sized for the largest unit).
struct AmxDecodeScratch {
  std::vector<float> st;     // [job][keys rounded to 32][16 queries]: scores, then exps
  std::vector<uint32_t> vp;  // [kv head][32-key chunk][HD / 16][16 key pairs][16 dims]
  std::vector<uint32_t> qt;  // [piece][HD / 32][16 dim pairs][16 queries]: Q^T as B tiles
  std::vector<uint32_t> pa;  // [piece of a job][32-key chunk][16 queries][16 key pairs]: P
  alignas(64) float o[4][16][16];  // a pass's accumulators: [tile][query][16 dims]
  alignas(64) float m[16], l[16];

  void reserve(int keys, int hd, int kv_heads, int jobs, int pieces) {
    const size_t chunks = static_cast<size_t>(keys + 31) / 32;
    auto grow = [](auto& v, size_t size) {
      if (v.size() < size) v.resize(size);
    };
    grow(st, jobs * chunks * 32 * 16);
    grow(vp, kv_heads * chunks * (hd / 16) * 256);
    grow(qt, static_cast<size_t>(pieces) * (hd / 32) * 256);
    grow(pa, kv_heads * chunks * 256);
  }
};

// The queries [lo, hi) of a job (columns of its tiles) that belong to kv head g.
struct AmxPiece {
  int g, lo, hi;
};

// r[i] <- column i of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15].
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3.
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// Values of keys [0, n) of every kv head as B tiles (vp: [kv head][chunk][HD / 16][16][16]):
// for each 32-key chunk and 16 head dims, row i = (v[2i][d], v[2i + 1][d]) for d in the 16
// dims. Keys past n: zero rows (their weights are zero, and 0 * a stale value could be NaN).
// Key pair by key pair, every kv head inside: each slot's value lines are read in order.
template <int HD>
inline void amx_pack_values(const bf16* const* slots, int n, int kv_heads, uint32_t* vp) {
  constexpr int kTiles = HD / 16;
  // Interleaves two rows' 16-bit elements 0-15 (lo) or 16-31 (hi) in pairs.
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int chunks = (n + 31) / 32;
  const size_t head_elems = static_cast<size_t>(chunks) * kTiles * 256;
  for (int c = 0; c < chunks; ++c)
    for (int i = 0; i < 16; ++i) {
      const int j = 32 * c + 2 * i;
      for (int g = 0; g < kv_heads; ++g) {
        const int64_t v_offset = static_cast<int64_t>(kv_heads + g) * HD;
        for (int d = 0; d < HD; d += 32) {
          const __m512i x = j < n ? _mm512_loadu_si512(slots[j] + v_offset + d)
                                  : _mm512_setzero_si512();
          const __m512i y = j + 1 < n ? _mm512_loadu_si512(slots[j + 1] + v_offset + d)
                                      : _mm512_setzero_si512();
          uint32_t* t0 =
              vp + g * head_elems + ((static_cast<size_t>(c) * kTiles + d / 16) * 16 + i) * 16;
          _mm512_storeu_si512(t0, _mm512_permutex2var_epi16(x, lo, y));
          _mm512_storeu_si512(t0 + 256, _mm512_permutex2var_epi16(x, hi, y));
        }
      }
    }
}

// One unit (keys [unit.begin, unit.end) of its rows), every kv head: each row's partial to its
// item, as attend_unit's vector path writes it. slots: the unit's keys (fill_slots). The keys
// are walked a 16-key run at a time with every job inside it, so a run's K lines of every kv
// head are read together, and the values of every kv head are packed in one pass.
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
  const int per_head = num * G, total = Hkv * per_head;  // queries: kv head, row, head
  const int jobs = (total + 15) / 16;
  // Job b's pieces: pieces[first[b] .. first[b + 1]).
  thread_local std::vector<AmxPiece> pieces;
  thread_local std::vector<int> first;
  pieces.clear();
  first.assign(1, 0);
  for (int b = 0; b < jobs; ++b) {
    const int x0 = 16 * b, x1 = std::min(x0 + 16, total);
    for (int g = x0 / per_head; g * per_head < x1; ++g)
      pieces.push_back({g, std::max(x0, g * per_head) - x0, std::min(x1, (g + 1) * per_head) - x0});
    first.push_back(static_cast<int>(pieces.size()));
  }
  const size_t st_job = static_cast<size_t>(chunks) * 32 * 16;
  const int64_t k_stride = static_cast<int64_t>(2 * Hkv) * HD * static_cast<int64_t>(sizeof(bf16));
  w.reserve(n, HD, Hkv, jobs, static_cast<int>(pieces.size()));
  // Job b's query j: (row index in the unit, head).
  auto query = [&](int b, int j) {
    const int x = 16 * b + j, g = x / per_head, y = x % per_head;
    return std::pair<int, int>(y / G, g * G + y % G);
  };
  auto count = [&](int b) { return std::min(16, total - 16 * b); };
  amx_pack_values<HD>(slots, n, Hkv, w.vp.data());
  // Q^T of each piece as B tiles: qt[piece][kb][i][j] = query j's head dims (32 kb + 2i, + 1)
  // for the piece's queries, zeros in the job's other columns.
  for (int b = 0; b < jobs; ++b)
    for (int pc = first[b]; pc < first[b + 1]; ++pc)
      for (int kb = 0; kb < kKb; ++kb) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) {
          if (j < pieces[pc].lo || j >= pieces[pc].hi) {
            r[j] = _mm512_setzero_si512();
            continue;
          }
          const auto [m, h] = query(b, j);
          const bf16* q = static_cast<const bf16*>(p.q) +
                          p.row_token[rows[m]] * p.q_token_stride + static_cast<int64_t>(h) * HD +
                          kb * 32;
          r[j] = _mm512_loadu_si512(q);
        }
        transpose16x16_epi32(r);
        uint32_t* dst = w.qt.data() + (static_cast<size_t>(pc) * kKb + kb) * 256;
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
      }
  // S^T, a 16-key run at a time, every job inside it: a run from a 16-aligned start lies in one
  // block (block_size % 16 == 0), its rows at the slot's stride. Keys past n (the rest of the
  // last run, in the same block) are computed and never read.
  for (int j0 = 0; j0 < n; j0 += 16)
    for (int b = 0; b < jobs; ++b) {
      _tile_zero(0);
      for (int pc = first[b]; pc < first[b + 1]; ++pc) {
        const bf16* k = slots[j0] + static_cast<int64_t>(pieces[pc].g) * HD;
        const uint32_t* qt = w.qt.data() + static_cast<size_t>(pc) * kKb * 256;
        _tile_loadd(1, k, k_stride);
        _tile_loadd(2, qt, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(3, k + 32, k_stride);
        _tile_loadd(4, qt + 256, 64);
        _tile_dpbf16ps(0, 3, 4);
        if constexpr (kKb == 4) {
          _tile_loadd(1, k + 64, k_stride);
          _tile_loadd(2, qt + 512, 64);
          _tile_dpbf16ps(0, 1, 2);
          _tile_loadd(3, k + 96, k_stride);
          _tile_loadd(4, qt + 768, 64);
          _tile_dpbf16ps(0, 3, 4);
        }
      }
      _tile_stored(0, w.st.data() + b * st_job + static_cast<size_t>(j0) * 16, 64);
    }
  const __m512 scale = _mm512_set1_ps(p.scale);
  // P as A tiles: (p[32c + 2i][q], p[32c + 2i + 1][q]) as bf16, transposed to [q][i].
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  const size_t vp_head = static_cast<size_t>(chunks) * kTiles * 256;
  for (int b = 0; b < jobs; ++b) {
    // The softmax of each query (lane) over keys [0, n) in order; exps past n are zero.
    float* st = w.st.data() + b * st_job;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < n; ++j) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(st + j * 16), scale);
      _mm512_storeu_ps(st + j * 16, x);
      mv = _mm512_max_ps(mv, x);
    }
    __m512 lv = _mm512_setzero_ps();
    for (int j = 0; j < n; ++j) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(st + j * 16), mv));
      _mm512_storeu_ps(st + j * 16, e);
      lv = _mm512_add_ps(lv, e);
    }
    for (int j = n; j < chunks * 32; ++j) _mm512_storeu_ps(st + j * 16, _mm512_setzero_ps());
    _mm512_store_ps(w.m, mv);
    _mm512_store_ps(w.l, lv);
    const int np = first[b + 1] - first[b];
    for (int c = 0; c < chunks; ++c) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const float* x = st + static_cast<size_t>(32 * c + 2 * i) * 16;
        const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
        r[i] = _mm512_permutexvar_epi16(pairs, (__m512i)pb);
      }
      transpose16x16_epi32(r);
      for (int k = 0; k < np; ++k) {  // each piece's rows of P, the job's others zero
        const AmxPiece& pc = pieces[first[b] + k];
        uint32_t* a = w.pa.data() + (static_cast<size_t>(k) * chunks + c) * 256;
        for (int q = 0; q < 16; ++q)
          _mm512_storeu_si512(a + q * 16,
                              q >= pc.lo && q < pc.hi ? r[q] : _mm512_setzero_si512());
      }
    }
    // O = P V, four 16-dim tiles at a time, over the chunks in order, each chunk's pieces in
    // turn.
    for (int t0 = 0; t0 < kTiles; t0 += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < chunks; ++c)
        for (int k = 0; k < np; ++k) {
          const int g = pieces[first[b] + k].g;
          _tile_loadd(4, w.pa.data() + (static_cast<size_t>(k) * chunks + c) * 256, 64);
          const uint32_t* v =
              w.vp.data() + g * vp_head + (static_cast<size_t>(c) * kTiles + t0) * 256;
          _tile_loadd(5, v, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, v + 256, 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, v + 512, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, v + 768, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      _tile_stored(0, w.o[0], 64);
      _tile_stored(1, w.o[1], 64);
      _tile_stored(2, w.o[2], 64);
      _tile_stored(3, w.o[3], 64);
      for (int j = 0; j < count(b); ++j) {
        const auto [m, h] = query(b, j);
        const size_t it = static_cast<size_t>(plan.row_first_item[rows[m]] + unit.item);
        float* out = acc + (it * H + h) * HD + t0 * 16;
        for (int t = 0; t < 4; ++t) _mm512_storeu_ps(out + t * 16, _mm512_load_ps(w.o[t][j]));
      }
    }
    for (int j = 0; j < count(b); ++j) {
      const auto [m, h] = query(b, j);
      float* s = stats + static_cast<size_t>(plan.row_first_item[rows[m]] + unit.item) * H * 2;
      s[h] = w.m[j];
      s[H + h] = w.l[j];
    }
  }
}

}  // namespace poise_attention

#endif  // POISE_ATTENTION_AMX
