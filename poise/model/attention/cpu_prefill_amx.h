// The prefill kernel's block math on AMX tiles (cpu_prefill_attention.cpp, bf16 inputs, CPUs
// with AMX-BF16 such as Sapphire Rapids): Q K^T and P V as tdpbf16ps, the online softmax on
// AVX-512 between them. Included by that one file only; compiled where the build's
// -march=native offers AMX, used where the CPU and the OS also allow it at run time
// (amx_available), else the AVX512-BF16 path of cpu_prefill_blocks.h runs.
//
// Why the transposed products: the vector path already keeps Q as bf16 pairs of head dims,
// 16 rows per vector ([hd/2][rp]), and the scores with the row index fastest ([key][rp]). On
// tiles that is S^T = K Q^T: A = 16 keys x 32 head dims (the packed keys' rows as they are),
// B = those pairs, C = 16 keys x 16 rows, stored straight into the scores' layout. Likewise
// O^T = V^T P^T: A = 16 head dims x 32 keys (values packed transposed, [hd][kKeys]), B = the
// probabilities as bf16 pairs of keys ([kKeys/2][rp], as the softmax writes them), C = O^T
// ([hd][rp] float, in the item's scratch), so the softmax's per-row correction is a vector
// multiply per head dim, done only for the 16-row groups whose maximum moved.
//
// Numerics as the vector path (float32 accumulation, P rounded to bf16 for P V), except that
// the softmax works in base 2: the scores are scaled by scale * log2(e) on their way out of the
// tiles and 2^x is taken by a degree-5 polynomial (relative error 2.4e-7, as the base-e one).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define POISE_PREFILL_AMX 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_amx.h"
#include "cpu_prefill_blocks.h"

namespace poise_prefill {

using poise_attention::amx_available;
using poise_attention::amx_configure;

// S^T of the block's n keys for rows r .. r + 31 into w.st ([key][rp], unscaled): 2 x 2 tiles
// of (16 keys, 16 rows) at a time, summed over head dims 32 at a time.
template <int HD>
inline void amx_scores(Scratch& w, const Packed& b, int rp, int r, int n) {
  const bf16* k = static_cast<const bf16*>(b.k);
  const uint32_t* q = w.qp.data();
  float* st = w.st.data();
  const int key_tiles = (n + 15) / 16;
  const int row_stride = rp * 4;
  int t = 0;
  for (; t + 2 <= key_tiles; t += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < HD / 32; ++c) {
      _tile_loadd(4, k + t * 16 * HD + c * 32, HD * 2);
      _tile_loadd(5, k + (t + 1) * 16 * HD + c * 32, HD * 2);
      _tile_loadd(6, q + c * 16 * rp + r, row_stride);
      _tile_loadd(7, q + c * 16 * rp + r + 16, row_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, st + t * 16 * rp + r, row_stride);
    _tile_stored(1, st + t * 16 * rp + r + 16, row_stride);
    _tile_stored(2, st + (t + 1) * 16 * rp + r, row_stride);
    _tile_stored(3, st + (t + 1) * 16 * rp + r + 16, row_stride);
  }
  if (t < key_tiles) {  // an odd last tile of keys
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < HD / 32; ++c) {
      _tile_loadd(4, k + t * 16 * HD + c * 32, HD * 2);
      _tile_loadd(6, q + c * 16 * rp + r, row_stride);
      _tile_loadd(7, q + c * 16 * rp + r + 16, row_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, st + t * 16 * rp + r, row_stride);
    _tile_stored(1, st + t * 16 * rp + r + 16, row_stride);
  }
}

// 2^x on 16 lanes for x <= 0 (to within a float rounding): 2^round(x) by scalef (0 below
// 2^-149) times a polynomial in the fraction f = x - round(x), |f| <= 1/2.
inline __m512 exp2_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3276472454890609e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675541892647743e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713092088699e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);
}

// Which keys of a block a softmax sees: all kKeys (a full block left of the diagonal: no
// masks, a fixed trip count), the first n (the context's last block), or those at or left of
// each row's position (a block on the diagonal).
enum class Keys { kFull, kFirstN, kCausal };

template <Keys K>
inline __mmask16 seen(__m512i pos, int j, int n) {
  if constexpr (K == Keys::kFull) return 0xffff;
  if (j >= n) return 0;
  if constexpr (K == Keys::kCausal) return _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(j));
  return 0xffff;
}

// The online softmax step of cpu_prefill_blocks.h's softmax_block for rows r .. r + 15 (the
// same pairs out), on unscaled scores and in base 2: m is kept in units of log2, P = 2^(s c -
// m'), c = scale * log2(e). Rows whose maximum moved have their O^T columns multiplied by
// 2^(m - m') here, before the block's P V adds to them; the others are left alone (corr 1).
template <Keys K>
inline void amx_softmax(Scratch& w, int rp, int r, int hd, int n_keys, float scale) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int n = K == Keys::kFull ? kKeys : n_keys;
  const int n2 = (n + 1) & ~1;
  const float* st = w.st.data() + r;  // raw pointers: the stores below cannot move them
  uint32_t* pp = w.pp.data() + r;
  float* o = w.o.data() + r;
  const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512i pos = K == Keys::kCausal ? _mm512_load_si512(&w.pos[r]) : _mm512_setzero_si512();
  __m512 mx0 = _mm512_set1_ps(-kInf), mx1 = mx0;  // two chains hide max's latency
  for (int j = 0; j < n2; j += 2) {
    mx0 = _mm512_mask_max_ps(mx0, seen<K>(pos, j, n), mx0, _mm512_load_ps(st + j * rp));
    mx1 = _mm512_mask_max_ps(mx1, seen<K>(pos, j + 1, n), mx1, _mm512_load_ps(st + (j + 1) * rp));
  }
  const __m512 m_old = _mm512_load_ps(&w.m[r]);
  // scale > 0, so the maximum of the scaled scores is the scaled maximum; finite: key 0 is
  // visible to every row.
  const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(_mm512_max_ps(mx0, mx1), c));
  const __mmask16 moved = _mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_UQ);
  __m512 l = _mm512_load_ps(&w.l[r]);
  if (moved) {
    // m_old is -inf on the first block: 2^-inf is 0 (the clamp keeps the fraction finite).
    const __m512 corr = _mm512_mask_blend_ps(
        moved, _mm512_set1_ps(1.0f),
        exp2_nonpositive16(_mm512_max_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(-200.0f))));
    l = _mm512_mul_ps(l, corr);
    for (int d = 0; d < hd; ++d)
      _mm512_store_ps(o + d * rp, _mm512_mul_ps(_mm512_load_ps(o + d * rp), corr));
  }
  // P up to the end of the last 32-key chunk P V multiplies: zeros past n, not the stale
  // probabilities of the block before (the packed values there are real keys when this
  // item's keys end inside the context's block).
  const int n32 = (n + 31) & ~31;
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
  for (int j = 0; j < n32; j += 2) {
    const __m512 x0 = _mm512_fmsub_ps(_mm512_load_ps(st + j * rp), c, m_new);
    const __m512 x1 = _mm512_fmsub_ps(_mm512_load_ps(st + (j + 1) * rp), c, m_new);
    __m512 e0 = exp2_nonpositive16(x0), e1 = exp2_nonpositive16(x1);
    if constexpr (K != Keys::kFull) {
      e0 = _mm512_maskz_mov_ps(seen<K>(pos, j, n), e0);
      e1 = _mm512_maskz_mov_ps(seen<K>(pos, j + 1, n), e1);
    }
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_store_si512(pp + (j / 2) * rp, pack_pairs(e0, e1));
  }
  _mm512_store_ps(&w.m[r], m_new);
  _mm512_store_ps(&w.l[r], _mm512_add_ps(l, _mm512_add_ps(sum0, sum1)));
}

// O^T += V^T P^T for rows r .. r + 31 over the block's keys, 32 at a time (P is zero past the
// item's keys, and the values past the context's are packed as zeros, never uninitialised
// memory whose NaN would survive a zero probability): 2 x 2 tiles of (16 head dims, 16 rows)
// loaded from the scratch, accumulated, stored back.
template <int HD>
inline void amx_accumulate(Scratch& w, const Packed& b, int rp, int r, int n2) {
  const bf16* vt = reinterpret_cast<const bf16*>(b.v);  // [HD][kKeys]
  const uint32_t* p = w.pp.data();
  float* o = w.o.data();
  const int key_chunks = (n2 + 31) / 32;
  const int row_stride = rp * 4;
  for (int d = 0; d < HD; d += 32) {  // HD is 64 or 128
    _tile_loadd(0, o + d * rp + r, row_stride);
    _tile_loadd(1, o + d * rp + r + 16, row_stride);
    _tile_loadd(2, o + (d + 16) * rp + r, row_stride);
    _tile_loadd(3, o + (d + 16) * rp + r + 16, row_stride);
    for (int kc = 0; kc < key_chunks; ++kc) {
      _tile_loadd(4, vt + d * kKeys + kc * 32, kKeys * 2);
      _tile_loadd(5, vt + (d + 16) * kKeys + kc * 32, kKeys * 2);
      _tile_loadd(6, p + kc * 16 * rp + r, row_stride);
      _tile_loadd(7, p + kc * 16 * rp + r + 16, row_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o + d * rp + r, row_stride);
    _tile_stored(1, o + d * rp + r + 16, row_stride);
    _tile_stored(2, o + (d + 16) * rp + r, row_stride);
    _tile_stored(3, o + (d + 16) * rp + r + 16, row_stride);
  }
}

// An item's walk over its keys, blocks[0 ..] up to key_end (the rows: first_pos's query and
// on, G heads each, as attend_item lays them out), leaving O^T and l in the scratch.
//
// Why this order: the tiles run beside the vector units, but a tile load of what vector
// stores have just written (P, the rescaled O^T), or a vector load of what a tile store has
// just written (the scores), waits for those stores to drain. So the rows go in slices of 32,
// and each slice's tile work (its P V, then the next block's scores for its rows) is issued
// one slice late, between the two halves of the next slice's softmax: by then its inputs are
// in the cache, and it overlaps that softmax. A single slice (rp 32) cannot lag behind itself
// and runs in turn.
template <int HD>
inline void amx_walk(Scratch& w, const Packed* blocks, int rp, int64_t key_end, int64_t first_pos,
                     int G, float scale) {
  struct Lagging {  // the tile work of the slice before
    const Packed *block = nullptr, *next = nullptr;
    int n2 = 0, n_next = 0, r = -1;
  } lag;
  auto accumulate = [&] {
    if (lag.r >= 0) amx_accumulate<HD>(w, *lag.block, rp, lag.r, lag.n2);
  };
  auto next_scores = [&] {
    if (lag.r >= 0 && lag.next != nullptr) amx_scores<HD>(w, *lag.next, rp, lag.r, lag.n_next);
  };
  for (int r = 0; r < rp; r += 32)  // the first block's scores; each block then its next's
    amx_scores<HD>(w, blocks[0], rp, r, static_cast<int>(std::min<int64_t>(kKeys, key_end)));
  for (int64_t kb = 0; kb < key_end; kb += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, key_end - kb));
    const int n2 = (n + 1) & ~1;
    const bool masked = kb + n - 1 > first_pos;  // some key past the first query: the diagonal
    if (masked)
      for (int r = 0; r < rp; ++r)
        w.pos[r] = static_cast<int32_t>(std::min<int64_t>(first_pos + r / G - kb, kKeys));
    const Packed* next = kb + kKeys < key_end ? &blocks[kb / kKeys + 1] : nullptr;
    const int n_next = static_cast<int>(std::min<int64_t>(kKeys, key_end - kb - kKeys));
    for (int r = 0; r < rp; r += 32) {
      if (lag.r == r) accumulate(), next_scores(), lag.r = -1;  // rp 32: no slice to lag
      for (int half = 0; half < 2; ++half) {
        if (masked)
          amx_softmax<Keys::kCausal>(w, rp, r + 16 * half, HD, n, scale);
        else if (n == kKeys)
          amx_softmax<Keys::kFull>(w, rp, r + 16 * half, HD, n, scale);
        else
          amx_softmax<Keys::kFirstN>(w, rp, r + 16 * half, HD, n, scale);
        half == 0 ? accumulate() : next_scores();
      }
      lag = {&blocks[kb / kKeys], next, n2, n_next, r};
    }
  }
  accumulate();
}

}  // namespace poise_prefill

#endif
