// AMX tiles (the "amx" level: Intel Xeon 4th generation on): what the kernels that use them share. Built into
// the avx512_bf16 library as functions with the AMX target, run only where the caller asks (the "amx" level)
// and the OS grants this process the tile state.
#pragma once
#if defined(__AVX512BF16__) && (defined(__clang__) ? (__clang_major__ >= 12) : (__GNUC__ >= 11))
#define PL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

namespace pl {

// Linux hands out the tile state only on request (once per process).
inline bool amx_permitted() {
  static bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The calling thread's 8 tiles configured 16 rows x 64 bytes while it lives (when `on`), released after.
struct AmxTiles {
  bool on;
  __attribute__((target("amx-tile"))) explicit AmxTiles(bool on_) : on(on_) {
    if (!on) return;
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 drops the stores above: it does not see ldtilecfg read them
    _tile_loadconfig(&cfg);
  }
  __attribute__((target("amx-tile"))) ~AmxTiles() {
    if (on) _tile_release();
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

}  // namespace pl
#endif  // PL_AMX
