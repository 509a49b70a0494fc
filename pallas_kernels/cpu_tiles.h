// AMX tiles for the native CPU kernels (cpu_matmul.cc, cpu_attention.cc): whether the process may use them,
// and the one configuration both kernels use. Where the compiler does not target AMX-BF16, amx_enabled() is
// false and nothing else here exists.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>

#define JAXENGINE_CPU_TILES 1
#endif

namespace {

// The CPU has AMX-BF16 (the build targets it), Linux lets the process use its tile registers (asked for
// once per library), and JAXENGINE_CPU_AMX is not "0".
inline bool amx_enabled() {
#ifdef JAXENGINE_CPU_TILES
  static const bool enabled = [] {
    const char* env = std::getenv("JAXENGINE_CPU_AMX");
    if (env && std::string_view(env) == "0") return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return enabled;
#else
  return false;
#endif
}

constexpr int kTileRows = 16;  // every tile: 16 rows of 64 bytes (16 float32, 32 bfloat16 or 16 pairs)

#ifdef JAXENGINE_CPU_TILES

// Loads that configuration into all 8 tiles of the calling thread. Each kernel loads it where its tile work
// starts on a thread (another library may have configured the thread's tiles in between) and releases the
// tiles (_tile_release) where it ends.
inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = kTileRows;
  _tile_loadconfig(&config);
}
#endif

}  // namespace
