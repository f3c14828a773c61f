// Linear layers for CPU: y[M,N] = x[M,K] . W[N,K]^T, x and y bf16. Built by linear_kernel.py;
// measured by benchmarks/linear_kernels.py (RESULTS.md "Linear kernels").
//
// Weights:
// - bf16, as the checkpoint stores them, for decode-sized row counts (cpu_linear_bf16.h;
//   more rows: torch);
// - int8: q in [-127, 127], w = q * scale[n], with 16-bit integer activations on VNNI / AMX
//   int8 (cpu_linear_int8.h);
// - int4: q in [0, 15], w = q * d + m per channel and group of 32 inputs (cpu_linear_int4.h).
// Quantized weights are packed once at load (linear_kernel.py): output channels in tiles of
// 16, tiles in groups of T (4, 2 or 1), each group's inputs in order, so that a group is one
// sequential stream and the groups are split over the threads.
//
// Two paths for quantized weights, chosen per call by the caller (from measured crossovers):
// - streamed (few rows: decode): each weight is read once and used by every row at once in
//   registers; the read is the cost;
//   int8 from 4 rows on CPUs without AMX runs blocked: the same sums, K in L1-sized chunks that
//   every 3-row block uses before the next (cpu_linear_int8.h);
// - tiled (more rows): AMX tiles, 16-32 rows of x per pass against the group's weights
//   (int8: tdpbusd on the stored bytes; int4: tdpbf16ps on blocks decoded just before use,
//   or once per group when several row blocks read them), rows in chunks that stay in L2.
// Groups go to the threads dynamically: on a shared CPU (the server's event loop, another
// process) a static split waits for the thread whose core is taken. Every path runs on
// cpu_pool.h's pool, whose caller starts at once and whose helpers join when awake; on the AMX
// paths each thread configures its tiles at its first item of a call.
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "cpu_linear_bf16.h"
#include "cpu_linear_bf16_amx.h"
#include "cpu_linear_bf16_split.h"
#include "cpu_linear_common.h"
#include "cpu_linear_int4.h"
#include "cpu_linear_int8.h"
#include "cpu_pool.h"

namespace plk {
namespace {

template <int T>
void stream_group(const Problem& p, int64_t g, const float* xsum) {
  if (p.fmt == kInt8) stream_int8_group<T>(p, g);
  else stream_int4_group<T>(p, g, xsum);
}

// Rows per pass of the tiled and blocked paths: they stay in L2 while every group's weights pass
// by (one read of the weights per chunk).
constexpr int64_t kRowChunk = 128;

#if defined(PLK_AMX)
// Tiled int4: rows [r_begin, r_end) of group g through AMX tdpbf16ps on the decoded weights,
// 32 rows x 2 tiles per pass.
void tiled_int4_group(const Problem& p, int64_t g, const uint16_t* x, int64_t r_begin,
                      int64_t r_end, uint16_t* buf, float* cbuf) {
  const int T = p.t;
  const int64_t kp_count = p.k / 2, kb_count = p.k / kGroup;
  const bool per_block = r_end - r_begin <= 32;
  alignas(64) uint16_t blocks[2][16 * 32];
  if (!per_block)
    for (int t = 0; t < T; ++t)
      for (int64_t kb = 0; kb < kb_count; ++kb)
        int4_decode_block(p, g, t, kb, buf + (t * kp_count + kb * 16) * 32);
  auto b_tile = [&](int t, int64_t kb, int slot) -> const void* {
    if (per_block) {
      int4_decode_block(p, g, t, kb, blocks[slot]);
      return blocks[slot];
    }
    return buf + (t * kp_count + kb * 16) * 32;
  };
  for (int t0 = 0; t0 < T; t0 += 2) {
    const bool two = t0 + 1 < T;
    for (int64_t r0 = r_begin; r0 < r_end; r0 += 32) {
      const bool rows2 = r0 + 16 < r_end;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        const uint16_t* a = x + r0 * p.k + kb * kGroup;
        _tile_loadd(4, a, p.k * 2);
        _tile_loadd(6, b_tile(t0, kb, 0), 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, b_tile(t0 + 1, kb, 1), 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (rows2) {
          _tile_loadd(5, a + 16 * p.k, p.k * 2);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      // cbuf: [32 rows][32 channels] float32.
      _tile_stored(0, cbuf, 128);
      if (two) _tile_stored(1, cbuf + 16, 128);
      if (rows2) {
        _tile_stored(2, cbuf + 16 * 32, 128);
        if (two) _tile_stored(3, cbuf + 16 * 32 + 16, 128);
      }
      for (int tt = 0; tt < (two ? 2 : 1); ++tt) {
        const int64_t c0 = (g * T + t0 + tt) * kTile;
        for (int64_t r = r0; r < r0 + 32 && r < p.m; ++r)
          store_row(p.y + r * p.n + c0, _mm512_loadu_ps(cbuf + (r - r0) * 32 + tt * 16));
      }
    }
  }
}

// int4 up to this many rows: scaled AMX products per group (tiled_int4_rows16: 1.2x faster
// than decoding at 4-8 rows, even at 16, slower at 32), beyond: the
// weights decoded once per row chunk.
constexpr int64_t kInt4ScaledRows = 16;

// A new id per bf16 AMX call: the pool's threads configure their tiles once per call.
uint64_t amx_call_id() {
  static std::atomic<uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) + 1;
}

bool request_amx() {
  constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
}
#endif  // PLK_AMX

}  // namespace
}  // namespace plk

using namespace plk;

// y = x . W^T for bf16 W [n, k] as stored (cpu_linear_bf16.h), k % 32 == 0, any row count
// (cpu_linear_bf16_split.h).
extern "C" int poise_linear_bf16_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w,
                                      int64_t n, uint16_t* y, int threads) {
  if (k % 32) return 1;
  bf16_rows_split(x, m, k, w, n, y, threads, kBf16Rows, dot_bf16_block);
  return 0;
}

// y = x . W^T for bf16 W packed by pack_bf16 (cpu_linear_bf16_amx.h): t tiles (1 or 2) per
// group, k % 32 == 0, n % (16 t) == 0; every row count through the same tiles. Returns nonzero,
// writing nothing, when the shape does not fit or the library has no AMX.
extern "C" int poise_linear_bf16_amx(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w,
                                     int t, int64_t n, uint16_t* y, int threads) {
#if defined(PLK_AMX)
  if (k % kGroup || (t != 1 && t != 2) || n % (kTile * t)) return 1;
  if (m <= 0) return 0;  // no rows: nothing to write (and no 0-row tile configuration)
  const int64_t groups = n / (kTile * t), m_pad = (m + 15) / 16 * 16;
  const int64_t group_elems = k * kTile * t;
  // A tiles read 16 rows at a time: the rows of a last, partial block from a zero-padded copy;
  // fewer than 16 rows in all: tiles of that many rows, straight from x.
  static thread_local std::vector<uint16_t> tail_buf;  // the calling thread's
  const int64_t full = m < 16 ? m : m / 16 * 16;
  if (full != m) {
    tail_buf.assign(16 * k, 0);
    std::memcpy(tail_buf.data(), x + full * k, (m - full) * k * 2);
  }
  const uint16_t* tail = tail_buf.data();
  // An output larger than the caches is written past them (cpu_linear_bf16_amx.h, write_rows):
  // at 2,048 rows 1.2x faster; a smaller one stays cached for the next operation to read.
  const bool stream_y = t == 2 && m * n * 2 > (int64_t(4) << 20);
  // (row chunk, group) items, chunk-major: a thread's next item mostly reads the same rows. On
  // the pool (cpu_pool.h), not an OpenMP region: a decode-sized call takes ~150 us, and the
  // region's wake of its sleeping worker cost as much as the second thread gave (SmolLM2-135M's
  // 120 decode linears at 8 rows: 19.2 ms on two threads in regions, 18.6 ms on one).
  const int64_t chunks = (m_pad + kAmxRowChunk - 1) / kAmxRowChunk;
  const int tile_rows = m < 16 ? static_cast<int>(m) : 16;
  const uint64_t call = amx_call_id();
  ppool::parallel_for(chunks * groups, threads, [&](int64_t item) {
    // Each thread configures its tiles once per call (the caller's may have been changed by
    // torch's oneDNN between calls; a helper's hold this call's row count from then on).
    static thread_local uint64_t configured_for = 0;
    alignas(64) static thread_local float cbuf[2 * 32 * 32];
    if (configured_for != call) {
      configure_tiles(tile_rows);
      configured_for = call;
    }
    const int64_t g = item % groups, c0 = item / groups * kAmxRowChunk;
    const int64_t c1 = c0 + kAmxRowChunk < m_pad ? c0 + kAmxRowChunk : m_pad;
    const uint16_t* wg = w + g * group_elems;
    if (stream_y) amx_bf16_group<2, true>(x, tail, k, wg, n, g, m, c0, c1, y, cbuf);
    else if (t == 2) amx_bf16_group<2, false>(x, tail, k, wg, n, g, m, c0, c1, y, cbuf);
    else amx_bf16_group<1, false>(x, tail, k, wg, n, g, m, c0, c1, y, cbuf);
  });
  _tile_release();  // the calling thread's tile state, for whatever it runs next
  return 0;
#else
  (void)x; (void)m; (void)k; (void)w; (void)t; (void)n; (void)y; (void)threads;
  return 1;
#endif
}

// How the decode-sized paths run their items (cpu_pool.h), for benchmarks: openmp 1 as before
// (an OpenMP region per call), else the pool with its helpers spinning spin_us after a loop
// (0: asleep at once; -1: every loop on the calling thread alone).
extern "C" void poise_linear_threading(int openmp, int spin_us) {
  ppool::use_openmp().store(openmp != 0);
  ppool::Pool::instance().set_spin_us(spin_us);
}

// Asks the OS for the AMX tile state once per process; 1 when the tiled path may run.
extern "C" int poise_linear_init() {
#if defined(PLK_AMX)
  static const bool ok = request_amx();
#else
  static const bool ok = false;  // built without AMX: the tiled path is not in this library
#endif
  return ok ? 1 : 0;
}

// y = x . W^T for packed W. tiled: 1 for the AMX path (after poise_linear_init()), 0 for the
// streamed one. Returns nonzero, writing nothing, when the shape does not fit the packing.
extern "C" int poise_linear(const uint16_t* x, int64_t m, int64_t k, const void* w, int fmt,
                            int t, const float* scale, const uint16_t* dm,
                            const int32_t* rowsum, int64_t n, uint16_t* y, int tiled,
                            int threads) {
  if (!shape_fits(k, n, fmt, t, tiled)) return 1;
  Problem p{x, m, k, n, static_cast<const uint8_t*>(w), fmt, t, scale, dm, rowsum, y,
            nullptr, nullptr, nullptr};
  const int64_t groups = n / (kTile * t);
  // Rows past m (A tiles read 16 at a time) come from zero-padded copies.
  const int64_t m_pad = tiled ? (m + 15) / 16 * 16 : m;
  static thread_local std::vector<uint8_t> lo, hi;
  static thread_local std::vector<float> xscale, xsum;
  if (fmt == kInt8) {
    lo.resize(m_pad * k);
    hi.resize(m_pad * k);
    xscale.resize(m_pad);
    int8_activations(x, m, m_pad, k, lo.data(), hi.data(), xscale.data());
    p.xlo = lo.data();
    p.xhi = hi.data();
    p.xscale = xscale.data();
  }
  if (fmt == kInt4) {
    xsum.resize(m * (k / kGroup));
    int4_sums(x, m, k, xsum.data());
  }
  const float* sums = xsum.data();
  if (!tiled && fmt == kInt8 && m > 3) {
    // Blocked: every row in chunks of kRowChunk (their activations stay in L2 while every
    // group's weights pass by), each group's K in L1-sized chunks (cpu_linear_int8.h).
    for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
      const int64_t c1 = c0 + kRowChunk < m ? c0 + kRowChunk : m;
      ppool::parallel_for(groups, threads, [&](int64_t g) {
        static thread_local std::vector<__m512i> part;  // the running thread's
        if (part.size() < size_t(kRowChunk * t * 2)) part.resize(kRowChunk * t * 2);
        switch (t) {
          case 1: blocked_int8_group<1>(p, g, c0, c1, part.data()); break;
          case 2: blocked_int8_group<2>(p, g, c0, c1, part.data()); break;
          default: blocked_int8_group<4>(p, g, c0, c1, part.data()); break;
        }
      });
    }
    return 0;
  }
  if (!tiled) {
    ppool::parallel_for(groups, threads, [&](int64_t g) {
      switch (t) {
        case 1: stream_group<1>(p, g, sums); break;
        case 2: stream_group<2>(p, g, sums); break;
        default: stream_group<4>(p, g, sums); break;
      }
    });
    return 0;
  }
#if defined(PLK_AMX)
  std::vector<uint16_t> padded;
  const uint16_t* xs = x;
  if (fmt == kInt4 && m_pad != m) {
    padded.assign(m_pad * k, 0);
    std::memcpy(padded.data(), x, m * k * 2);
    xs = padded.data();
  }
  // On the pool, as the bf16 AMX path (poise_linear_bf16_amx: the OpenMP region's wake cost
  // as much as the second thread gave at decode sizes). Rows in chunks that stay in L2 while
  // every group's weights pass by (one read of the weights per chunk): 1.5x faster than all
  // rows per group at 2,048 rows; (chunk, group) items, chunk-major.
  const int64_t chunks = (m_pad + kRowChunk - 1) / kRowChunk;
  const uint64_t call = amx_call_id();
  ppool::parallel_for(chunks * groups, threads, [&](int64_t item) {
    static thread_local uint64_t configured_for = 0;  // tiles configured once per call
    if (configured_for != call) {
      configure_tiles();
      configured_for = call;
    }
    // int4 weights of one group decoded once, when more than one row block reads them.
    static thread_local std::vector<uint16_t> buf;
    if (fmt == kInt4 && m_pad > 32 && buf.size() < size_t(t * (k / 2) * 32))
      buf.resize(t * (k / 2) * 32);
    alignas(64) float cbuf[32 * 32], acc[16 * 64];
    const int64_t g = item % groups, c0 = item / groups * kRowChunk;
    const int64_t c1 = c0 + kRowChunk < m_pad ? c0 + kRowChunk : m_pad;
    if (fmt == kInt8) tiled_int8_group(p, g, c0, c1, reinterpret_cast<int32_t*>(cbuf));
    else if (m_pad <= kInt4ScaledRows)
      for (int64_t r0 = c0; r0 < c1; r0 += 16) tiled_int4_rows16(p, g, xs, r0, sums, cbuf, acc);
    else tiled_int4_group(p, g, xs, c0, c1, buf.data(), cbuf);
  });
  _tile_release();  // the calling thread's tile state, for whatever it runs next
  return 0;
#else
  return 1;  // no tiled path in this build (poise_linear_init() said so)
#endif
}
