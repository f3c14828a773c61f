// AMX tiles for the attention kernels (prefill: cpu_prefill_amx.h; decode: cpu_decode_amx.h):
// whether this process may use them, and the one tile configuration both use.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define POISE_ATTENTION_AMX 1

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace poise_attention {

// Whether this process may run AMX: the CPU has AMX-BF16 and AMX-TILE, the OS saves the tile
// state (XCR0 bits 17-18), and Linux granted the tile data permission (ARCH_REQ_XCOMP_PERM,
// asked once per process; torch's oneDNN asks for the same and a second grant is a no-op).
inline bool amx_available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG, XTILEDATA
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes (palette 1). The configuration is per thread: each thread
// loads it before its first tile instruction.
inline void amx_configure() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

}  // namespace poise_attention

#endif
