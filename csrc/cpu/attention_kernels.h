// Prefill attention kernel math (no torch): FlashAttention-style online softmax over
// key tiles, never the full score matrix.
//
// One work item = (sequence, kv head, block of BQ query positions). All G = Hq / Hkv
// query heads of the kv head are processed together (GQA), so the item's query rows
// are M = BQ * G rows ordered (position, head) and each K/V tile is converted to fp32
// once and reused by all of them. Per key tile of BK keys:
//   S = Q K^T        register-blocked MR x NR micro-kernel over a transposed K tile
//   online softmax    per row: running max m, running sum l, rescale factor alpha
//   O = alpha O + P V register-blocked micro-kernel over the V tile
// Extra memory per thread is O((M + BK) * D + M * BK): independent of the sequence length.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace topg::attn {

constexpr int64_t BK = 128;         // keys per tile
constexpr int64_t DIRECT_ROWS = 4;  // at most this many rows: no fp32 K/V tiles
constexpr int64_t MR = 6;  // micro-kernel rows (6 x 2 accumulators + 2 loads + 1 broadcast)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Query positions per work item: aim for ~128 rows (BQ * G) so a K/V tile's fp32
// conversion is amortised, while keeping the row buffers in L2.
inline int64_t query_block(int64_t group) {
  return std::clamp<int64_t>(128 / std::max<int64_t>(group, 1), 8, 64);
}

// Strided views of one prefill call. Element strides; per-sequence offsets are
// precomputed by the binding so dense and ragged inputs share the kernel.
template <typename T>
struct PrefillArgs {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  int64_t q_ss, q_sh, k_ss, k_sh, v_ss, v_sh, o_ss, o_sh;  // token / head strides
  const int64_t* q_off;  // per sequence: offset of its first token in q, k, out, v
  const int64_t* k_off;
  const int64_t* v_off;
  const int64_t* o_off;
  const int64_t* sq;  // per sequence: query / key lengths
  const int64_t* sk;
  int64_t hq, hkv, d;
  float scale, softcap;
  bool causal;
  int64_t window;               // -1 = unlimited
  const float* mask = nullptr;  // additive fp32, strides for [B, Hq, Sq, Sk] (0 = broadcast)
  int64_t m_sb = 0, m_sh = 0, m_si = 0, m_sj = 0;
  const float* sinks = nullptr;  // [hq] attention sinks: a logit per head with no value

  // Visible keys of query position i: [lo(i), hi(i)] (may be empty).
  int64_t hi(int64_t b, int64_t i) const {
    return causal ? std::min(sk[b] - 1, i + sk[b] - sq[b]) : sk[b] - 1;
  }
  int64_t lo(int64_t b, int64_t i) const {
    return window >= 0 ? std::max<int64_t>(0, i + sk[b] - sq[b] - window) : 0;
  }
};

// Per-thread scratch, reused across work items.
struct Workspace {
  std::vector<float> q, kt, v, s, o, m, l, alpha;
  // The fp32 K^T / V tiles: only the tiled path (more than DIRECT_ROWS rows) uses them.
  void reserve_tiles(int64_t dp) {
    kt.resize(dp * BK);
    v.resize(BK * dp);
  }
  void reserve(int64_t rows, int64_t dp) {
    q.resize(rows * dp);
    s.resize(rows * BK);
    o.resize(rows * dp);
    m.resize(rows);
    l.resize(rows);
    alpha.resize(rows);
  }
};

// s[r, 0:16 * NV] = q[r, :] . kt[:, 0:16 * NV] for R rows (kt is K^T, row stride BK).
template <int R>
inline void qk_micro(const float* q, int64_t dp, const float* kt, float* s) {
  Vec8 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = Vec8::zero();
  for (int64_t d = 0; d < dp; ++d) {
    const Vec8 k0 = Vec8::load(kt + d * BK), k1 = Vec8::load(kt + d * BK + 8);
    for (int r = 0; r < R; ++r) {
      const Vec8 x(q[r * dp + d]);
      a0[r] = Vec8::fma(x, k0, a0[r]);
      a1[r] = Vec8::fma(x, k1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    a0[r].store(s + r * BK);
    a1[r].store(s + r * BK + 8);
  }
}

// o[r, 0:8 * NV] = alpha[r] * o[r, :] + sum_{k < n} p[r, k] * v[k, :] for R rows.
template <int R, int NV>
inline void pv_micro(const float* p, const float* v, int64_t dp, int64_t n, const float* alpha,
                     float* o) {
  Vec8 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const Vec8 a(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec8::load(o + r * dp + 8 * c) * a;
  }
  for (int64_t k = 0; k < n; ++k) {
    Vec8 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = Vec8::load(v + k * dp + 8 * c);
    for (int r = 0; r < R; ++r) {
      const Vec8 x(p[r * BK + k]);
      for (int c = 0; c < NV; ++c) acc[r][c] = Vec8::fma(x, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(o + r * dp + 8 * c);
}

// One micro-kernel row group of R rows: S tile (ncols keys) and the P V update.
template <int R>
inline void qk_rows(const float* q, int64_t dp, const float* kt, int64_t ncols, float* s) {
  for (int64_t c = 0; c < ncols; c += 16) qk_micro<R>(q, dp, kt + c, s + c);
}
template <int R>
inline void pv_rows(const float* p, const float* v, int64_t dp, int64_t n, const float* alpha,
                    float* o) {
  int64_t c = 0;
  for (; c + 16 <= dp; c += 16) pv_micro<R, 2>(p, v + c, dp, n, alpha, o + c);
  if (c < dp) pv_micro<R, 1>(p, v + c, dp, n, alpha, o + c);
}

// Dispatch a row group of 1..MR rows to the fixed-size micro-kernels.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 6:
      return f.template operator()<6>();
    case 5:
      return f.template operator()<5>();
    case 4:
      return f.template operator()<4>();
    case 3:
      return f.template operator()<3>();
    case 2:
      return f.template operator()<2>();
    default:
      return f.template operator()<1>();
  }
}

// Convert key/value rows [j0, j0 + n) of one kv head to fp32: K transposed into
// kt[d * BK + c] (zero-padded to `ncols` keys), V into v[c * dp + d] (zero-padded dims).
template <typename T>
inline void load_kv_tile(const PrefillArgs<T>& a, const T* kbase, const T* vbase, int64_t n,
                         int64_t ncols, int64_t dp, Workspace& ws) {
  const int64_t d = a.d;
  float* kt = ws.kt.data();
  // K^T: 8 keys x 8 dims at a time through a register transpose (scalar stores strided
  // by BK would touch a different cache line per element).
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) {
      Vec8 r[8];
      for (int i = 0; i < 8; ++i) r[i] = Vec8::load(kbase + (c + i) * a.k_ss + e);
      transpose8(r);
      for (int i = 0; i < 8; ++i) r[i].store(kt + (e + i) * BK + c);
    }
    for (; e < d; ++e)
      for (int i = 0; i < 8; ++i) kt[e * BK + c + i] = to_float(kbase[(c + i) * a.k_ss + e]);
  }
  for (; c < n; ++c)
    for (int64_t e = 0; e < d; ++e) kt[e * BK + c] = to_float(kbase[c * a.k_ss + e]);
  for (int64_t e = d; e < dp; ++e) std::fill_n(kt + e * BK, ncols, 0.f);
  for (int64_t e = 0; e < d; ++e) std::fill(kt + e * BK + n, kt + e * BK + ncols, 0.f);
  for (c = 0; c < n; ++c) {
    const T* vr = vbase + c * a.v_ss;
    float* vo = ws.v.data() + c * dp;
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) Vec8::load(vr + e).store(vo + e);
    for (; e < d; ++e) vo[e] = to_float(vr[e]);
    for (; e < dp; ++e) vo[e] = 0.f;
  }
}

// Online-softmax update of one score row s[0, n) (already scaled, softcapped and
// masked; -inf = invisible). Leaves p = exp(s - m_new) in s; returns the factor that
// rescales the row's previous output.
inline float softmax_update(float* s, int64_t n, float& m, float& l) {
  const int64_t n8 = round_up(n, 8);
  for (int64_t c = n; c < n8; ++c) s[c] = NEG_INF;
  Vec8 mx(NEG_INF);
  for (int64_t c = 0; c < n8; c += 8) mx = Vec8::max(mx, Vec8::load(s + c));
  const float mt = mx.max();
  if (mt == NEG_INF) {  // nothing visible in this tile for this row, or NaN (max drops it)
    const bool nan = any_nan(s, n);
    for (int64_t c = 0; c < n; ++c) s[c] = nan ? NAN : 0.f;
    if (nan) l = NAN;  // the row's output is NaN, as softmax over a NaN score is
    return nan ? NAN : 1.f;
  }
  const float m_new = std::max(m, mt);
  const float alpha = std::exp(m - m_new);  // m = -inf on the first visible tile -> 0
  const Vec8 mv(m_new);
  Vec8 sum = Vec8::zero();
  for (int64_t c = 0; c < n8; c += 8) {
    const Vec8 p = exp(Vec8::load(s + c) - mv);
    p.store(s + c);
    sum = sum + p;
  }
  l = l * alpha + sum.sum();
  m = m_new;
  return alpha;
}

// Few query rows (decode: one position x the G heads of a kv head). Converting K and V
// tiles to fp32 (and transposing K) would cost more than the arithmetic for so few rows,
// so scores are dot products against K rows and the output is updated from V rows in
// place, converting on the fly (DIRECT_ROWS is defined with MR above).

// M is a template parameter so the row accumulators stay in registers.
template <int M, typename T>
inline void qk_direct(const PrefillArgs<T>& a, const T* kbase, int64_t n, int64_t dp,
                      Workspace& ws) {
  const int64_t d = a.d;
  const float* q = ws.q.data();
  for (int64_t c = 0; c < n; ++c) {
    const T* kr = kbase + c * a.k_ss;
    Vec8 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = Vec8::zero();
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) {
      const Vec8 k = Vec8::load(kr + e);
      for (int r = 0; r < M; ++r) acc[r] = Vec8::fma(Vec8::load(q + r * dp + e), k, acc[r]);
    }
    for (int r = 0; r < M; ++r) {
      float sc = acc[r].sum();
      for (int64_t t = e; t < d; ++t) sc += q[r * dp + t] * to_float(kr[t]);
      ws.s[r * BK + c] = sc;
    }
  }
}

// Output chunk by chunk (8 dims): the M row accumulators of a chunk stay in registers
// while all n keys stream through.
template <int M, typename T>
inline void pv_direct(const PrefillArgs<T>& a, const T* vbase, int64_t n, int64_t dp,
                      Workspace& ws) {
  const int64_t d = a.d;
  const float* p = ws.s.data();
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) {
    Vec8 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = Vec8::load(ws.o.data() + r * dp + e) * Vec8(ws.alpha[r]);
    for (int64_t c = 0; c < n; ++c) {
      const Vec8 v = Vec8::load(vbase + c * a.v_ss + e);
      for (int r = 0; r < M; ++r) acc[r] = Vec8::fma(Vec8(p[r * BK + c]), v, acc[r]);
    }
    for (int r = 0; r < M; ++r) acc[r].store(ws.o.data() + r * dp + e);
  }
  for (; e < d; ++e) {
    for (int r = 0; r < M; ++r) {
      float o = ws.o[r * dp + e] * ws.alpha[r];
      for (int64_t c = 0; c < n; ++c) o += p[r * BK + c] * to_float(vbase[c * a.v_ss + e]);
      ws.o[r * dp + e] = o;
    }
  }
}

template <typename F>
inline void with_direct_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1:
      f.template operator()<1>();
      break;
    case 2:
      f.template operator()<2>();
      break;
    case 3:
      f.template operator()<3>();
      break;
    default:
      f.template operator()<4>();
      break;
  }
}

// Attention for query positions [i0, i1) of sequence b, kv head kvh (all its query heads).
template <typename T>
void prefill_block(const PrefillArgs<T>& a, int64_t b, int64_t kvh, int64_t i0, int64_t i1,
                   Workspace& ws) {
  const int64_t G = a.hq / a.hkv, d = a.d, dp = round_up(d, 8);
  const int64_t M = (i1 - i0) * G;
  ws.reserve(M, dp);
  if (M > DIRECT_ROWS) ws.reserve_tiles(dp);
  const float qscale = a.softcap > 0 ? a.scale / a.softcap : a.scale;

  // Query rows r = (i - i0) * G + g, pre-scaled, fp32, zero-padded.
  for (int64_t r = 0; r < M; ++r) {
    float* dst = ws.q.data() + r * dp;
    const T* src = a.q + a.q_off[b] + (i0 + r / G) * a.q_ss + (kvh * G + r % G) * a.q_sh;
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) (Vec8::load(src + e) * Vec8(qscale)).store(dst + e);
    for (; e < d; ++e) dst[e] = to_float(src[e]) * qscale;
    for (; e < dp; ++e) dst[e] = 0.f;
    std::fill_n(ws.o.data() + r * dp, dp, 0.f);
    ws.m[r] = NEG_INF;
    ws.l[r] = 0.f;
  }

  const int64_t j_begin = a.lo(b, i0), j_end = a.hi(b, i1 - 1) + 1;
  const T* kbase = a.k + a.k_off[b] + kvh * a.k_sh;
  const T* vbase = a.v + a.v_off[b] + kvh * a.v_sh;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += BK) {
    const int64_t n = std::min(BK, j_end - j0), ncols = round_up(n, 16);
    const bool direct = M <= DIRECT_ROWS;
    if (direct)
      with_direct_rows(M, [&]<int R>() { qk_direct<R>(a, kbase + j0 * a.k_ss, n, dp, ws); });
    else
      load_kv_tile(a, kbase + j0 * a.k_ss, vbase + j0 * a.v_ss, n, ncols, dp, ws);

    // S = Q K^T, skipping keys no row of a row group can see (the causal diagonal).
    for (int64_t r0 = 0; r0 < M && !direct; r0 += MR) {
      const int64_t rows = std::min<int64_t>(MR, M - r0);
      const int64_t last_i = i0 + (r0 + rows - 1) / G;  // rows are ordered by position
      const int64_t cols = std::min(n, a.hi(b, last_i) - j0 + 1);
      if (cols <= 0) continue;
      with_rows(rows, [&]<int R>() {
        qk_rows<R>(ws.q.data() + r0 * dp, dp, ws.kt.data(), round_up(cols, 16),
                   ws.s.data() + r0 * BK);
      });
    }

    // Softcap, masks, online softmax per row.
    for (int64_t r = 0; r < M; ++r) {
      const int64_t i = i0 + r / G, h = kvh * G + r % G;
      float* s = ws.s.data() + r * BK;
      const int64_t cl = std::max<int64_t>(0, a.lo(b, i) - j0);
      const int64_t ch = std::min(n, a.hi(b, i) - j0 + 1);
      if (cl >= ch) {  // row sees nothing here
        std::fill_n(s, n, 0.f);
        ws.alpha[r] = 1.f;
        continue;
      }
      if (a.softcap > 0) {
        const Vec8 cap(a.softcap);
        for (int64_t c = 0; c < round_up(ch, 8); c += 8)
          (cap * tanh(Vec8::load(s + c))).store(s + c);
      }
      if (a.mask) {
        const float* mr = a.mask + b * a.m_sb + h * a.m_sh + i * a.m_si + j0 * a.m_sj;
        for (int64_t c = cl; c < ch; ++c) s[c] += mr[c * a.m_sj];
      }
      for (int64_t c = 0; c < cl; ++c) s[c] = NEG_INF;
      for (int64_t c = ch; c < n; ++c) s[c] = NEG_INF;
      ws.alpha[r] = softmax_update(s, n, ws.m[r], ws.l[r]);
    }

    // O = alpha O + P V (keys beyond the row group's causal limit have p = 0: skip them).
    if (direct)
      with_direct_rows(M, [&]<int R>() { pv_direct<R>(a, vbase + j0 * a.v_ss, n, dp, ws); });
    for (int64_t r0 = 0; r0 < M && !direct; r0 += MR) {
      const int64_t rows = std::min<int64_t>(MR, M - r0);
      const int64_t last_i = i0 + (r0 + rows - 1) / G;
      const int64_t cols = std::min(n, a.hi(b, last_i) - j0 + 1);
      with_rows(rows, [&]<int R>() {
        pv_rows<R>(ws.s.data() + r0 * BK, ws.v.data(), dp, std::max<int64_t>(cols, 0),
                   ws.alpha.data() + r0, ws.o.data() + r0 * dp);
      });
    }
  }

  // out = O / l (zeros for rows that saw no key), rounded once to T. A sink joins the
  // softmax here: O / (l e^(m - M) + e^(sink - M)) e^(m - M), M = max(m, sink).
  for (int64_t r = 0; r < M; ++r) {
    const int64_t i = i0 + r / G, h = kvh * G + r % G;
    T* dst = a.out + a.o_off[b] + i * a.o_ss + h * a.o_sh;
    const float* src = ws.o.data() + r * dp;
    const float l = ws.l[r];
    float inv = std::isnan(l) ? l : l > 0.f ? 1.f / l : 0.f;
    if (a.sinks && l > 0.f) {  // a NaN sink makes the row NaN (std::max keeps m, exp does not)
      const float sink = a.sinks[h], mx = std::max(ws.m[r], sink);
      const float f = std::exp(ws.m[r] - mx);
      inv = f / (l * f + std::exp(sink - mx));
    }
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) (Vec8::load(src + e) * Vec8(inv)).store(dst + e);
    for (; e < d; ++e) dst[e] = from_float<T>(src[e] * inv);
  }
}

// Every (sequence, kv head, query block) of `a`'s `num_seqs` sequences through
// prefill_block, most keys first. Decode-size calls (a few thousand multiply-adds per
// item) run on the calling thread: waking the pool costs more than the work, and on a
// loaded machine a descheduled worker can stall the call for a scheduler tick.
template <typename T>
void run_prefill(const PrefillArgs<T>& a, int64_t num_seqs) {
  struct Item {
    int64_t cost, b, h, i0, i1;
  };
  std::vector<Item> items;
  const int64_t bq = query_block(a.hq / a.hkv);
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t i0 = 0; i0 < a.sq[b]; i0 += bq) {
      const int64_t i1 = std::min(a.sq[b], i0 + bq);
      const int64_t keys = std::max<int64_t>(0, a.hi(b, i1 - 1) + 1 - a.lo(b, i0));
      for (int64_t h = 0; h < a.hkv; ++h) items.push_back({keys * (i1 - i0) + 1, b, h, i0, i1});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  int64_t work = 0;
  for (const Item& it : items) work += it.cost * a.d;
  if (work < (int64_t(1) << 18)) {
    Workspace ws;
    for (const Item& it : items) prefill_block(a, it.b, it.h, it.i0, it.i1, ws);
    return;
  }
  parallel_items_with<Workspace>(int64_t(items.size()), [&](int64_t n, Workspace& ws) {
    const Item& it = items[n];
    prefill_block(a, it.b, it.h, it.i0, it.i1, ws);
  });
}

}  // namespace topg::attn
