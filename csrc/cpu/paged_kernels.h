// Decode attention over a paged KV cache, and the cache writer (no torch).
//
// paged_attention: one work item = (query row, partition of the keys it sees), all
// heads. A query row is a decode token, or one token of a sequence's ragged query
// (cu_seqlens_q): row i of q_len new tokens is a "virtual sequence" of length
// seq_len - q_len + i + 1 that reads the block-table row of its sequence.
// The G = Hq / Hkv query heads of a kv head are computed together, so each K/V row is
// read once per group, and all kv heads of a token tile are processed back to back, so
// the cache is read in long contiguous runs (decode is bound by reading it). A partition
// produces an unnormalised output, its max score m and its sum l; partitions of one
// row are merged with their log-sum-exp afterwards (split-KV, like vLLM's
// paged_attention_v2), which keeps both cores busy when there are few sequences.
// A row's partitions depend only on its own visible length (part_tokens), so its
// result is bitwise the same whatever the batch around it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_bf16dp.h"
#include "vec.h"

namespace topg::paged {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t TOKEN_TILE = 16;  // tokens per tile: their K or V rows stay in L1/L2
static_assert(TOKEN_TILE == 16, "paged_bf16dp.h handles 16 keys (8 pairs) a tile");
// How far ahead (bytes of cache rows) the rows are prefetched, a line at a time spread
// through the compute. Measured on Zen 1: 8-12 KiB is best; 64-128 KiB ahead (in
// bursts of whole tiles) ran at 0.45-0.5 of the read bandwidth instead of ~0.6.
constexpr int64_t PREFETCH_BYTES = 12 << 10;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Tokens per partition for a row that sees `span` keys: a function of the row alone
// (never of the batch or the thread count), so the row's reduction order is fixed.
// Two partitions of 128..512 tokens (more past 1024 keys, multiples of TOKEN_TILE): both
// cores busy at batch 1, few merges at large batches (measured, docs/ops.md).
inline int64_t part_tokens(int64_t span) {
  return std::clamp<int64_t>(round_up((span + 1) / 2, TOKEN_TILE), 128, 512);
}

// Query rows of one sequence per work item at most: they share its K/V reads; the score
// buffer is Hq x rows x partition floats. 16 measured best (4 x 128-token chunks over a
// 1024 context: 1 row 117 ms, 4: 94, 8: 89, 16: 82, 32: 85, 64: 197 (buffers spill L2)).
constexpr int64_t kItemRows = 16;

// A sequence with at least this many query rows (a prefill chunk over cached keys) runs
// on the dense prefill kernel, which tiles queries and keys: measured on SmolLM2's
// heads (9 query / 3 KV, D 64, ~1,140 keys, 1 thread) 1.7x the paged kernel's rate at
// 22 rows and 2.6x at 64. Shorter runs (a speculative verify step: k + 1 rows) stay on
// the paged kernel, whose rows equal the decode of their token bitwise.
constexpr int64_t kDenseRows = 16;

// T: the query / output storage type; C: the cache's (T, or int8_t for a quantised
// cache, whose rows are read as q * scale: ks / vs [num_blocks, block_size, hkv]).
template <typename T, typename C = T>
struct PagedArgs {
  const T* q;
  int64_t q_ss, q_sh;         // query token / head strides
  const C* kc;                // [num_blocks, block_size, hkv, d], contiguous (head_major:
  const C* vc;                // [num_blocks, hkv, block_size, d], transformers' StaticCache)
  const float* ks = nullptr;  // int8 caches only: per token and kv head scales
  const float* vs = nullptr;
  const int32_t* bt;  // block tables, row stride bt_ss
  int64_t bt_ss;
  const int32_t* row_seq;  // query row -> its sequence (its row of the block table)
  int64_t hq, hkv, d, block_size;
  float scale, softcap;
  int64_t window;           // -1 = unlimited
  bool head_major = false;  // the cache layout (int8 caches: paged only)

  // Elements between one kv head's row of a token and the next head's.
  int64_t head_stride() const { return head_major ? block_size * d : d; }

  // First key a query at position n - 1 may see.
  int64_t first_key(int64_t n) const {
    return window >= 0 ? std::max<int64_t>(0, n - 1 - window) : 0;
  }
};

struct Workspace {
  std::vector<float> q, s, acc;
  std::vector<float> ksc, vsc;  // int8 caches: [hkv, ps] scales of the partition's tokens
  std::vector<int64_t> slots;   // int8 caches: the tokens' cache slots
  std::vector<int64_t> rows;
  std::vector<bf16> qb;      // bf16 dot path: the queries, unscaled
  std::vector<uint32_t> pw;  // bf16 dot path: a tile's weights in bf16 pairs
  // Per token of the K (V) pass: the row start to prefetch meanwhile, or null.
  std::vector<const char*> pfk, pfv;
};

// Partition result layout: per head g, [acc (dp floats), m, l].
inline int64_t part_stride(int64_t d) { return round_up(d, 8) + 2; }

// Prefetch the cache lines starting in [b0, b1) bytes past p (lines are 64 bytes;
// rows start line-aligned when the cache does). Callers spread these through the
// compute: a burst of hundreds would fill the miss buffers and stall the loads.
inline void prefetch_bytes(const char* c, int64_t b0, int64_t b1) {
  for (int64_t o = (b0 + 63) / 64 * 64; o < b1; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// Scores s[g * ps + (t - t0)] = q_g . k_t for HG heads at a time, two tokens at a time.
template <int HG, typename T>
inline void qk_heads(const float* q, int64_t dp, const T* kc, const int64_t* rows, int64_t n,
                     int64_t d, float* s, int64_t ps, const char* const* pf, int64_t pf_off) {
  constexpr int TT = HG == 4 ? 2 : 4;  // HG * TT = 8, 12 or 4 accumulators (a multiple of 4)
  for (int64_t t = 0; t < n; t += TT) {
    for (int j = 0; j < TT && t + j < n; ++j)
      if (pf && pf[t + j]) prefetch_bytes(pf[t + j] + pf_off, 0, d * int64_t(sizeof(T)));
    const T* k[TT];
    for (int j = 0; j < TT; ++j) k[j] = kc + rows[std::min<int64_t>(t + j, n - 1)];
    Vec8 acc[HG * TT];
    for (Vec8& x : acc) x = Vec8::zero();
    int64_t e = 0;
    if constexpr (HG == 3) {  // 12 accumulators, the 3 query vectors, one K vector: 16 ymm
      // Both pinned to registers: left to itself GCC loaded q once per token and K once
      // per head (24 loads for 12 FMAs, 2 loads a cycle); pinned, 7 loads. Bitwise the
      // same. One tile x kv head of SmolLM2 (16 keys, d 64, L1-warm): fp32 5.1-6.4 ->
      // 3.6-3.8 us, bf16 4.1-4.9 -> 3.0-3.8 us.
      for (; e + 8 <= d; e += 8) {
        Vec8 qv[HG];
        for (int g = 0; g < HG; ++g) qv[g] = Vec8::pinned(Vec8::load(q + g * dp + e));
        for (int j = 0; j < TT; ++j) {
          const Vec8 kv = Vec8::pinned(Vec8::load(k[j] + e));
          for (int g = 0; g < HG; ++g) acc[g * TT + j] = Vec8::fma(qv[g], kv, acc[g * TT + j]);
        }
      }
    }
    for (; e + 8 <= d; e += 8) {
      Vec8 kv[TT];
      for (int j = 0; j < TT; ++j) kv[j] = Vec8::load(k[j] + e);
      for (int g = 0; g < HG; ++g) {
        const Vec8 qv = Vec8::load(q + g * dp + e);
        for (int j = 0; j < TT; ++j) acc[g * TT + j] = Vec8::fma(qv, kv[j], acc[g * TT + j]);
      }
    }
    if (e < d) {  // head_dim tail; q is zero-padded
      for (int j = 0; j < TT; ++j) {
        const Vec8 kv = load_partial(k[j] + e, int(d - e));
        for (int g = 0; g < HG; ++g)
          acc[g * TT + j] = Vec8::fma(Vec8::load(q + g * dp + e), kv, acc[g * TT + j]);
      }
    }
    float sums[HG * TT];
    for (int i = 0; i < HG * TT; i += 4) sum4(acc + i, sums + i);
    for (int g = 0; g < HG; ++g)
      for (int j = 0; j < TT && t + j < n; ++j) s[g * ps + t + j] = sums[g * TT + j];
  }
}

// acc[g, e:e + 8 * NV] += sum_t p[g, t] * v_t[e:e + 8 * NV] for HG heads over a token
// tile; dims past d read as zero (acc rows are padded, so always loadable).
// The weights are broadcast from the scores (p[g * ps + t]): a broadcast from memory is a
// load, no shuffle. Pre-broadcasting them into a buffer (a store and a reload per weight,
// done until 2026-12-04) made the P V pass 2.5x slower on Zen 3: one tile x kv head of
// SmolLM2 (16 keys, 3 heads, d 64, L1-warm) 7.6 -> 2.8 us fp32, 8.7 -> 3.3 us bf16.
template <int HG, int NV, typename T>
inline void pv_strip(const float* p, int64_t ps, const T* vc, const int64_t* rows, int64_t n,
                     int64_t e, int64_t d, float* acc, int64_t as, const char* const* pf,
                     int64_t pf_off) {
  const bool full = e + 8 * NV <= d;
  {  // this strip's lines of the rows to be read later
    const int64_t b0 = e * int64_t(sizeof(T)), b1 = std::min(e + 8 * NV, d) * int64_t(sizeof(T));
    if (pf)
      for (int64_t t = 0; t < n; ++t)
        if (pf[t]) prefetch_bytes(pf[t] + pf_off, b0, b1);
  }
  Vec8 a[HG][NV];
  for (int g = 0; g < HG; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = Vec8::load(acc + g * as + e + 8 * c);
  // The token's HG weights in registers, then one V vector at a time: HG * NV + HG + 1
  // registers against HG * NV + NV + 1 below, which for SmolLM2's 3 heads x 4 vectors is
  // 17 of the 16 ymm and kept one accumulator on the stack (a store-to-load round trip per
  // token). The same FMAs in the same order.
  if (HG <= NV && full) {
    for (int64_t t = 0; t < n; ++t) {
      const T* v = vc + rows[t] + e;
      Vec8 w[HG];
      for (int g = 0; g < HG; ++g) w[g] = Vec8(p[g * ps + t]);
      for (int c = 0; c < NV; ++c) {
        const Vec8 vv = Vec8::load(v + 8 * c);
        for (int g = 0; g < HG; ++g) a[g][c] = Vec8::fma(w[g], vv, a[g][c]);
      }
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const T* v = vc + rows[t] + e;
      Vec8 vv[NV];
      for (int c = 0; c < NV; ++c)
        vv[c] = full ? Vec8::load(v + 8 * c)
                     : load_partial(v + 8 * c, int(std::clamp<int64_t>(d - e - 8 * c, 0, 8)));
      for (int g = 0; g < HG; ++g) {
        const Vec8 w(p[g * ps + t]);
        for (int c = 0; c < NV; ++c) a[g][c] = Vec8::fma(w, vv[c], a[g][c]);
      }
    }
  }
  for (int g = 0; g < HG; ++g)
    for (int c = 0; c < NV; ++c) a[g][c].store(acc + g * as + e + 8 * c);
}

// All dims in strips of as many Vec8 as the registers allow (HG * NV accumulators).
template <int HG, typename T>
inline void pv_heads(const float* p, int64_t ps, const T* vc, const int64_t* rows, int64_t n,
                     int64_t d, float* acc, int64_t as, const char* const* pf, int64_t pf_off) {
  constexpr int NV = HG == 4 ? 3 : HG == 3 || HG == 2 ? 4 : 8;
  int64_t e = 0;
  for (; e + 8 * NV <= d; e += 8 * NV)
    pv_strip<HG, NV>(p, ps, vc, rows, n, e, d, acc, as, pf, pf_off);
  for (; e < d; e += 8) pv_strip<HG, 1>(p, ps, vc, rows, n, e, d, acc, as, pf, pf_off);
}

// Largest head group the micro-kernels handle that divides G (3: SmolLM2's 9 / 3 heads,
// whose K/V rows are then loaded and converted once for all three).
inline int head_group(int64_t G) { return G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1; }

template <typename F>
inline void with_head_group(int hg, F&& f) {
  if (hg == 4) return f.template operator()<4>();
  if (hg == 3) return f.template operator()<3>();
  if (hg == 2) return f.template operator()<2>();
  return f.template operator()<1>();
}

// One query row's share of a work item: the row, the keys [lo, n) it sees, and where
// its result for this partition goes (Hq x part_stride(d) floats).
struct RowPart {
  int64_t row, lo, n;
  float* res;
};

// One partition: tokens [t0, t1) of one sequence for R of its query rows (R > 1: rows of
// a ragged query, which then share every K/V read), all heads. Row r's query heads are
// "virtual heads" of its kv head's group, (kvh, r, g) -> (kvh * R + r) * G + g, so the
// GQA micro-kernels serve R rows as they serve G heads. Keys a row does not see (before
// its lo, from its n on) score -inf and weigh exactly 0: a row's result does not depend on
// the rows it is grouped with, only on t0 (its lanes) and its own range.
// Token tiles are the outer loop, so each tile's K (then V) rows of all kv heads,
// contiguous in the cache, are read from memory once, while the rows PREFETCH_BYTES later
// are prefetched. Writes, per row and query head h, the unnormalised output, the max
// score and the sum of exps to rp[r].res[h * part_stride(d) ...] (m = -inf, l = 0 for an
// empty partition).
// int8 caches: a score is ks[t] * (q . k_int8[t]) (the scale applied to the finished dot
// product, before the softcap) and a weight p[t] becomes p[t] * vs[t] in the P V sum,
// so the int8 rows are only converted, never scaled element by element.
template <typename T, typename C>
void partition(const PagedArgs<T, C>& a, const RowPart* rp, int64_t R, int64_t t0, int64_t t1,
               Workspace& ws) {
  const int64_t H = a.hq, G = a.hq / a.hkv, d = a.d, dp = round_up(d, 8), rs = part_stride(d);
  const int64_t VH = H * R, VG = G * R;  // virtual heads, per kv head
  const int64_t n = std::max<int64_t>(0, t1 - t0), ps = round_up(std::max<int64_t>(n, 1), 8);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      float* res = rp[r].res + h * rs;
      std::fill_n(res, dp, 0.f);
      res[dp] = NEG_INF;
      res[dp + 1] = 0.f;
    }
  if (n == 0) return;
  const int64_t as = dp;  // accumulator row stride
  bool bf16dp = false;    // paged_bf16dp.h: bf16 query and cache, AVX-512 BF16
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>)
    bf16dp = TOPG_BF16DP && use_attention_bf16dp(d);
  if (!bf16dp) ws.q.assign(VH * dp, 0.f);  // the bf16 dot path reads ws.qb
  ws.acc.assign(VH * as, 0.f);
  ws.s.resize(VH * ps);
  ws.rows.resize(n);
  const bool quant = a.ks != nullptr;
  if (quant) ws.slots.resize(n);
  {  // token row offsets, walking the block table (no division per token)
    const int32_t* blocks = a.bt + int64_t(a.row_seq[rp[0].row]) * a.bt_ss;
    int64_t blk = t0 / a.block_size, off = t0 % a.block_size;
    const int64_t row = a.hkv * d;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = int64_t(blocks[blk]) * a.block_size + off;
      ws.rows[t] = a.head_major ? int64_t(blocks[blk]) * a.block_size * row + off * d : slot * row;
      if (quant) {
        ws.slots[t] = slot;
        if (t == 0 || off == 0) {  // this block's scales: read after the QK pass
          const int64_t bytes = std::min(a.block_size - off, n - t) * a.hkv * 4;
          prefetch_bytes(reinterpret_cast<const char*>(a.ks + slot * a.hkv), 0, bytes);
          prefetch_bytes(reinterpret_cast<const char*>(a.vs + slot * a.hkv), 0, bytes);
        }
      }
      if (++off == a.block_size) off = 0, ++blk;
    }
  }

  const float qscale = a.softcap > 0 ? a.scale / a.softcap : a.scale;
  if (bf16dp) ws.qb.resize(VH * d);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const T* src = a.q + rp[r].row * a.q_ss + h * a.q_sh;  // T: the query's type
      const int64_t vh = ((h / G) * R + r) * G + h % G;
      if (bf16dp) {
        std::memcpy(ws.qb.data() + vh * d, src, d * sizeof(T));
        continue;
      }
      float* dst = ws.q.data() + vh * dp;
      for (int64_t e = 0; e < d; ++e) dst[e] = to_float(src[e]) * qscale;
    }
  const int64_t* rows = ws.rows.data();
  {  // prefetch targets: K rows PF tokens ahead, running on into the V rows
    // The bf16 dot path issues a tile's prefetches as the tile starts: one tile ahead
    // (paged_bf16dp.h has the measurements).
    const int64_t PF =
        bf16dp ? TOKEN_TILE
               : std::max<int64_t>(1, PREFETCH_BYTES / (a.hkv * d * int64_t(sizeof(C))));
    ws.pfk.assign(n, nullptr);
    ws.pfv.assign(n, nullptr);
    const char* kb = reinterpret_cast<const char*>(a.kc);
    const char* vb = reinterpret_cast<const char*>(a.vc);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t f = t + PF;
      if (f < n) {
        ws.pfk[t] = kb + rows[f] * int64_t(sizeof(C));
        ws.pfv[t] = vb + rows[f] * int64_t(sizeof(C));
      } else if (f < 2 * n) {
        ws.pfk[t] = vb + rows[f - n] * int64_t(sizeof(C));
      }
    }
  }
  const int64_t hs = a.head_stride(), rsz = hs * int64_t(sizeof(C));  // head to head
  float* scores = ws.s.data();
#if TOPG_BF16DP
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>)
    if (bf16dp)
      for (int64_t t = 0; t < n; t += TOKEN_TILE) {
        const int64_t nt = std::min(TOKEN_TILE, n - t);
        for (int64_t vh = 0; vh < VH; ++vh) {
          const int64_t kvh = vh / VG;
          qk16_bf16dp(ws.qb.data() + vh * d, a.kc + kvh * hs, rows + t, nt, d, qscale,
                      scores + vh * ps + t, vh % VG == 0 ? ws.pfk.data() + t : nullptr, kvh * rsz);
        }
      }
#endif
  if (!bf16dp)
    with_head_group(head_group(VG), [&]<int HG>() {
      for (int64_t t = 0; t < n; t += TOKEN_TILE) {
        const int64_t nt = std::min(TOKEN_TILE, n - t);
        // Token-major: a few tokens' rows (all kv heads) at a time, read sequentially.
        constexpr int64_t TS = 4;
        for (int64_t u = 0; u < nt; u += TS)
          for (int64_t kvh = 0; kvh < a.hkv; ++kvh)
            for (int64_t h = kvh * VG; h < (kvh + 1) * VG; h += HG)
              qk_heads<HG>(ws.q.data() + h * dp, dp, a.kc + kvh * hs, rows + t + u,
                           std::min(TS, nt - u), d, scores + h * ps + t + u, ps,
                           h == kvh * VG ? ws.pfk.data() + t + u : nullptr, kvh * rsz);
      }
    });

  if (quant) {  // the scales, prefetched above: [hkv, ps], zero past n (finite pad lanes)
    ws.ksc.assign(a.hkv * ps, 0.f);
    ws.vsc.assign(a.hkv * ps, 0.f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t kvh = 0; kvh < a.hkv; ++kvh) {
        ws.ksc[kvh * ps + t] = a.ks[ws.slots[t] * a.hkv + kvh];
        ws.vsc[kvh * ps + t] = a.vs[ws.slots[t] * a.hkv + kvh];
      }
  }

  // Softmax over the partition, per virtual head (softcap first; keys the row does not
  // see and pad lanes are -inf).
  for (int64_t vh = 0; vh < VH; ++vh) {
    const int64_t r = (vh % VG) / G, h = (vh / VG) * G + vh % G;
    const int64_t b = std::max<int64_t>(rp[r].lo - t0, 0);
    const int64_t e = std::clamp<int64_t>(rp[r].n - t0, b, n);
    float* s = ws.s.data() + vh * ps;
    if (quant)
      for (int64_t c = 0; c < round_up(n, 8); c += 8)
        (Vec8::load(s + c) * Vec8::load(ws.ksc.data() + (vh / VG) * ps + c)).store(s + c);
    if (a.softcap > 0)
      for (int64_t c = 0; c < round_up(n, 8); c += 8)
        (Vec8(a.softcap) * tanh(Vec8::load(s + c))).store(s + c);
    std::fill(s, s + b, NEG_INF);
    std::fill(s + e, s + ps, NEG_INF);
    Vec8 mx(NEG_INF);
    for (int64_t c = 0; c < ps; c += 8) mx = Vec8::max(mx, Vec8::load(s + c));
    const float m = mx.max();
    if (m == NEG_INF) {      // sees nothing here (not for rows an item is built with), or NaN
      if (any_nan(s, ps)) {  // max drops NaN; softmax over a NaN score is NaN
        std::fill(s, s + ps, NAN);
        rp[r].res[h * rs + dp] = rp[r].res[h * rs + dp + 1] = NAN;
      } else {
        std::fill(s, s + ps, 0.f);
      }
      continue;
    }
    Vec8 sum = Vec8::zero();
    for (int64_t c = 0; c < ps; c += 8) {
      const Vec8 p = exp(Vec8::load(s + c) - Vec8(m));
      p.store(s + c);
      sum = sum + p;
    }
    rp[r].res[h * rs + dp] = m;
    rp[r].res[h * rs + dp + 1] = sum.sum();
  }

  // acc = P V, same tiling.
  float* acc = ws.acc.data();
#if TOPG_BF16DP
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>)
    if (bf16dp) {
      ws.pw.resize(4 * 8);  // HG <= 4 heads x 8 pairs
      with_head_group(head_group(VG), [&]<int HG>() {
        for (int64_t t = 0; t < n; t += TOKEN_TILE) {
          const int64_t nt = std::min(TOKEN_TILE, n - t);
          for (int64_t kvh = 0; kvh < a.hkv; ++kvh)
            for (int64_t h = kvh * VG; h < (kvh + 1) * VG; h += HG) {
              pair_weights<HG>(scores + h * ps + t, ps, nt, ws.pw.data());
              pv_bf16dp<HG>(ws.pw.data(), a.vc + kvh * hs, rows + t, nt, d, acc + h * as, as,
                            h == kvh * VG ? ws.pfv.data() + t : nullptr, kvh * rsz);
            }
        }
      });
      for (int64_t vh = 0; vh < VH; ++vh) unpermute_pairs(acc + vh * as, d);
    }
#endif
  if (quant)  // int8 caches: p[t] * vs[t], the weight each V row is summed with
    for (int64_t vh = 0; vh < VH; ++vh)
      for (int64_t c = 0; c < round_up(n, 8); c += 8)
        (Vec8::load(scores + vh * ps + c) * Vec8::load(ws.vsc.data() + (vh / VG) * ps + c))
            .store(scores + vh * ps + c);
  if (!bf16dp)
    with_head_group(head_group(VG), [&]<int HG>() {
      for (int64_t t = 0; t < n; t += TOKEN_TILE) {
        const int64_t nt = std::min(TOKEN_TILE, n - t);
        for (int64_t kvh = 0; kvh < a.hkv; ++kvh) {
          for (int64_t h = kvh * VG; h < (kvh + 1) * VG; h += HG)
            pv_heads<HG>(scores + h * ps + t, ps, a.vc + kvh * hs, rows + t, nt, d, acc + h * as,
                         as, h == kvh * VG ? ws.pfv.data() + t : nullptr, kvh * rsz);
        }
      }
    });
  for (int64_t vh = 0; vh < VH; ++vh) {
    const int64_t r = (vh % VG) / G, h = (vh / VG) * G + vh % G;
    std::copy_n(acc + vh * as, dp, rp[r].res + h * rs);
  }
}

// Merge the partitions of one query row (in partition order) and write its `heads`
// output rows. sinks (null: none): per head a logit that joins the softmax here, once per
// row whatever its partitions: in the max and in the sum, with no value (not for a row
// that saw no key: zeros, whatever its sink).
template <typename T>
void combine(const float* res, int64_t parts, int64_t heads, int64_t d, T* out, int64_t out_sh,
             const float* sinks = nullptr) {
  const int64_t dp = round_up(d, 8), rs = part_stride(d);
  std::vector<float> o(dp);
  for (int64_t g = 0; g < heads; ++g) {
    float m = NEG_INF;
    for (int64_t p = 0; p < parts; ++p) {  // NaN wins (std::max would drop it)
      const float mp = res[(p * heads + g) * rs + dp];
      m = std::isnan(mp) || std::isnan(m) ? NAN : std::max(m, mp);
    }
    if (sinks && m != NEG_INF)
      m = std::isnan(sinks[g]) || std::isnan(m) ? NAN : std::max(m, sinks[g]);
    std::fill(o.begin(), o.end(), 0.f);
    float l = 0.f;
    if (m != NEG_INF) {
      for (int64_t p = 0; p < parts; ++p) {
        const float* r = res + (p * heads + g) * rs;
        if (r[dp + 1] == 0.f) continue;
        const float w = std::exp(r[dp] - m);
        l += w * r[dp + 1];
        for (int64_t e = 0; e < dp; e += 8)
          Vec8::fma(Vec8(w), Vec8::load(r + e), Vec8::load(o.data() + e)).store(o.data() + e);
      }
      if (sinks) l += std::exp(sinks[g] - m);
    }
    const float inv = std::isnan(l) ? l : l > 0.f ? 1.f / l : 0.f;  // seq_len 0 -> zeros
    T* dst = out + g * out_sh;
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) (Vec8::load(o.data() + e) * Vec8(inv)).store(dst + e);
    for (; e < d; ++e) dst[e] = from_float<T>(o[e] * inv);
  }
}

// reshape_and_cache for tokens [begin, end): copy each token's [hkv, d] K and V rows
// (elements of `esize` bytes) into its cache slot; negative slots are skipped.
template <typename Index>
void cache_tokens(const char* key, const char* value, int64_t k_ts, int64_t k_hs, int64_t v_ts,
                  int64_t v_hs, char* kc, char* vc, const Index* slots, int64_t hkv, int64_t d,
                  int64_t esize, int64_t begin, int64_t end) {
  const int64_t row = d * esize;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = int64_t(slots[t]);
    if (slot < 0) continue;
    char* kd = kc + slot * hkv * row;
    char* vd = vc + slot * hkv * row;
    for (int64_t h = 0; h < hkv; ++h) {
      std::memcpy(kd + h * row, key + (t * k_ts + h * k_hs) * esize, row);
      std::memcpy(vd + h * row, value + (t * v_ts + h * v_hs) * esize, row);
    }
  }
}

// One row of d values (one token, one kv head) into an int8 cache row and its scale
// (torch_topg.reference.quantize_kv, bit for bit): fp32 scale = max|x| / 127 (NaN if the
// row holds one), q = round_half_even(x / scale) clamped to [-127, 127], 0 where the
// quotient is NaN (an all-zero row, or an inf over an inf scale).
template <typename T>
inline void quantize_row(const T* x, int64_t d, int8_t* q, float* scale) {
  float m = 0.f;
  bool nan = false;
  for (int64_t e = 0; e < d; ++e) {
    const float v = std::fabs(to_float(x[e]));
    nan |= std::isnan(v);
    m = std::max(m, v);
  }
  const float s = nan ? NAN : m / 127.f;
  *scale = s;
  for (int64_t e = 0; e < d; ++e) {
    const float r = to_float(x[e]) / s;  // a true division, as the reference's
    q[e] = std::isnan(r) ? int8_t(0) : int8_t(std::nearbyint(std::clamp(r, -127.f, 127.f)));
  }
}

// reshape_and_cache into int8 caches for tokens [begin, end): key / value strides in
// elements; negative slots are skipped.
template <typename T, typename Index>
void cache_tokens_int8(const T* key, const T* value, int64_t k_ts, int64_t k_hs, int64_t v_ts,
                       int64_t v_hs, int8_t* kc, int8_t* vc, float* ks, float* vs,
                       const Index* slots, int64_t hkv, int64_t d, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = int64_t(slots[t]);
    if (slot < 0) continue;
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t i = slot * hkv + h;
      quantize_row(key + t * k_ts + h * k_hs, d, kc + i * d, ks + i);
      quantize_row(value + t * v_ts + h * v_hs, d, vc + i * d, vs + i);
    }
  }
}

}  // namespace topg::paged
