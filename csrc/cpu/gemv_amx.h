// bf16 dot path with AMX (Sapphire Rapids and later), for CPUs and kernels that have it,
// chosen at run time; the library itself is built for x86-64-v3.
//
// Why: a decode step of 1-16 rows reads every weight once, and on AVX-512 BF16 the
// arithmetic of 8 rows (vdpbf16ps) does not hide behind those reads: a batch-8 step or a
// speculative verify step of k + 1 rows costs 1.3-1.6x a one-row step. One AMX
// instruction (TDPBF16PS) multiplies a 16 x 32 weight tile by 32 x M activations, 16 x 32
// x M products, at ~2 TFLOP/s per core: 1 KiB of weights every ~8 ns, ten times the read
// rate of a core. So 1 to 16 A rows cost the same, the weight reads.
//
// Layout. C^T = W A^T: the weight tile is AMX's A operand as it lies in memory (16 rows
// x 64 bytes, row stride ldw), so weights need no repacking; the activations are the B
// operand in AMX's VNNI layout (pairs of k for each of the M rows: b[k / 2][m][k % 2]),
// packed once per GEMV (pack_b: M x K values). Each output is computed by the hardware
// from its weight row and its A row alone, in one order (the tile's k pairs in turn), so a
// row's result does not depend on the rows beside it, on M, on the tile it falls in or on
// how the caller splits the weight rows: topg::linear and the decode plan agree bitwise,
// and a speculative verify step's rows equal the one-row step's.
//
// The products are exact in fp32 (bf16 x bf16), the sums are rounded to fp32 as they go
// and denormals are flushed (the instruction's fixed DAZ / FTZ), a difference from the
// AVX-512 BF16 path within bf16 rounding.
//
// Linux hands a process the AMX tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM); available() asks once and says no where it is refused.
// TOPG_DISABLE_AMX=1 (or TOPG_DISABLE_AVX512=1) turns the path off.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "gemv_avx512.h"
#include "vec.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#define TOPG_AMX 1
#define TOPG_TARGET_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#else
#define TOPG_AMX 0
#endif

namespace topg::gemm::amx {

// Rows of A (activations) the tiles take: the B tile holds 16 columns.
constexpr int64_t kMaxRows = 16;

// The CPU has AMX-TILE and AMX-BF16, the OS enables their state (XCR0 bits 17, 18), the
// kernel grants it to this process, AVX-512 is on (use_avx512) and TOPG_DISABLE_AMX is not set.
inline bool available() {
#if TOPG_AMX
  static const bool on = [] {
    const char* off = std::getenv("TOPG_DISABLE_AMX");
    if (off && off[0] && off[0] != '0') return false;
    if (!use_avx512()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    if (!((c >> 27) & 1)) return false;                      // OSXSAVE: xgetbv is allowed
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0x60000u) != 0x60000u) return false;  // XTILECFG, XTILEDATA
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return on;
#else
  return false;
#endif
}

// available() and not switched off for now (set_enabled: torch_topg.modes.set_amx, for
// benchmarks comparing both paths in one process). The decode plan and topg::linear ask
// per call, so a switch applies from the next call.
inline std::atomic<bool>& switch_on() {
  static std::atomic<bool> on{true};
  return on;
}
inline bool enabled() { return available() && switch_on().load(std::memory_order_relaxed); }
inline bool set_enabled(bool on) { return switch_on().exchange(on) && available(); }

// The shapes the path takes: 1-16 A rows, K even (the tiles hold k in pairs).
inline bool fits(int64_t M, int64_t K) { return M >= 1 && M <= kMaxRows && K >= 2 && K % 2 == 0; }

// b[(k / 2) * 2 M + 2 m + k % 2] = a[m][k]: the B operand, M x K values.
inline void pack_b(const bf16* const* a, int64_t M, int64_t K, bf16* b) {
  for (int64_t m = 0; m < M; ++m) {
    const bf16* row = a[m];
    for (int64_t k = 0; k < K; k += 2) {
      b[k * M + 2 * m] = row[k];
      b[k * M + 2 * m + 1] = row[k + 1];
    }
  }
}

#if TOPG_AMX

// ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 sums (16 weight rows x M); 2, 3 weight tiles (16 rows x 32 k); 4 the A rows'
// tile (16 k pairs x M); 5, 6, 7 the same for the last K % 32 values.
inline TileConfig tile_config(int64_t M, int64_t K, int nr0, int nr1) {
  TileConfig c;
  const auto cb = uint16_t(4 * M), kt = uint16_t(K % 32);
  c.rows[0] = uint8_t(nr0), c.rows[1] = uint8_t(nr1), c.colsb[0] = c.colsb[1] = cb;
  c.rows[2] = uint8_t(nr0), c.rows[3] = uint8_t(nr1), c.colsb[2] = c.colsb[3] = 64;
  c.rows[4] = 16, c.colsb[4] = cb;
  if (kt) {
    c.rows[5] = uint8_t(nr0), c.rows[6] = uint8_t(nr1), c.colsb[5] = c.colsb[6] = uint16_t(2 * kt);
    c.rows[7] = uint8_t(kt / 2), c.colsb[7] = cb;
  }
  return c;
}

// The weight rows are read in chunks of 32 rows x 32 values (two tiles, 2 KiB; one per
// k step of a pass), and the chunk kAheadChunks ahead in that order is prefetched into L1
// and L2 as a chunk is read, the first kAheadChunks at the start of a call. Why: tiles are
// not renamed, so a tile load waits for the instruction reading its last contents and only
// ~2 tiles of lines are in flight per core unless prefetched, and a call of the decode plan
// covers only 64-450 weight rows. Standalone, [1536, 576] bf16, cold, 2 threads, items of
// 64 rows (as the plan's q / k / v heads), AMX / AVX-512 BF16 time in the same run, 3 runs:
// 1 A row 0.99-1.04 (the next pass prefetched row by row: 1.21-1.23), 8 A rows 0.60-0.63;
// 2 or 8 chunks ahead, or T1, no better.
constexpr int64_t kAheadChunks = 4;

// Prefetches chunk c of weight rows [n0, n1): pass c / steps (32 rows), k step c % steps.
TOPG_TARGET_AMX inline void prefetch_chunk(const bf16* w, int64_t ldw, int64_t n0, int64_t n1,
                                           int64_t steps, int64_t c) {
  const int64_t r0 = n0 + 32 * (c / steps), r1 = std::min(n1, r0 + 32), k = 32 * (c % steps);
  for (int64_t r = r0; r < r1; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(w + r * ldw + k), _MM_HINT_T0);
}

// For weight rows [n0, n1) of W ([N, K] bf16, row stride ldw) and the M (<= 16) A rows
// packed in b (pack_b): emit(m, n, sum) for every pair. 32 weight rows a pass (tiles 0 / 2
// the first 16, 1 / 3 the rest), a pass of fewer rows configuring the tiles for them. The
// tile state is released on return.
template <typename Emit>
TOPG_TARGET_AMX void dot_rows(const bf16* b, int64_t M, const bf16* w, int64_t ldw, int64_t K,
                              int64_t n0, int64_t n1, Emit&& emit) {
  alignas(64) float sums[512];
  const int64_t steps = (K + 31) / 32, sb = ldw * int64_t(sizeof(bf16)), bs = 4 * M;
  const int64_t chunks = (n1 - n0 + 31) / 32 * steps;
  for (int64_t c = 0; c < std::min(kAheadChunks, chunks); ++c)
    prefetch_chunk(w, ldw, n0, n1, steps, c);
  int64_t c = 0;
  int loaded = -1;  // the row count the tiles are configured for
  for (int64_t n = n0; n < n1; n += 32) {
    const int left = int(std::min<int64_t>(32, n1 - n)), nr0 = std::min(left, 16);
    const int nr1 = left - nr0;
    if (left != loaded) {
      const TileConfig cfg = tile_config(M, K, nr0, nr1 > 0 ? nr1 : 16);
      _tile_loadconfig(&cfg);
      loaded = left;
    }
    const bf16* row = w + n * ldw;
    _tile_zero(0);
    _tile_zero(1);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32, ++c) {
      if (c + kAheadChunks < chunks) prefetch_chunk(w, ldw, n0, n1, steps, c + kAheadChunks);
      _tile_loadd(4, b + k * M, bs);
      _tile_loadd(2, row + k, sb);
      _tile_dpbf16ps(0, 2, 4);
      if (nr1 > 0) {
        _tile_loadd(3, row + 16 * ldw + k, sb);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    if (k < K) {  // the last K % 32 values: tiles 5, 6, 7
      if (c + kAheadChunks < chunks) prefetch_chunk(w, ldw, n0, n1, steps, c + kAheadChunks);
      ++c;
      _tile_loadd(7, b + k * M, bs);
      _tile_loadd(5, row + k, sb);
      _tile_dpbf16ps(0, 5, 7);
      if (nr1 > 0) {
        _tile_loadd(6, row + 16 * ldw + k, sb);
        _tile_dpbf16ps(1, 6, 7);
      }
    }
    _tile_stored(0, sums, 64);
    if (nr1 > 0) _tile_stored(1, sums + 256, 64);
    // One output row at a time: its 32 sums are adjacent in memory. Rows of an LM head's
    // output lie a multiple of 4 KiB apart (one L1 set each); weight row by weight row,
    // 16 output rows took turns in a 12-way set (bf16 [49152, 576] x 16 rows 3.43 ->
    // 2.71 ms, x 12 unchanged; the plan's LM head at 16 rows 4.05 -> 2.34 ms).
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < left; ++r) emit(m, n + r, sums[r * 16 + m]);
  }
  _tile_release();
}

#endif

}  // namespace topg::gemm::amx
