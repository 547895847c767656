// CPU kernel: topg::fused_moe (grouped expert MLPs with the activation fused).
//
//   1. counting sort of the T * k (token, slot) assignments by expert;
//   2. per hit expert, gate/up product over its gathered token rows, epilogue
//      act(gate) * up into an fp32 intermediate h (rows in sorted order);
//   3. down product; the epilogue multiplies by the routing weight and adds into an fp32
//      output. Work is split over output columns, so each output element has exactly one
//      writer (no atomics); the same token twice in one expert is summed by that writer.
// Each expert takes the dot path (weights streamed once, decode) when it has at most
// kDotMaxRows rows, else the packed GEMM. Experts not hit are never read.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "common/op_checks.h"
#include "dispatch.h"
#include "gemm_kernels.h"
#include "modes.h"
#include "moe_items.h"
#include "moe_kernels.h"
#include "parallel.h"

namespace topg {
namespace {

using namespace gemm;

struct Expert {
  int64_t e, row0, rows;  // rows [row0, row0 + rows) of the sorted assignments
  bool packed;            // packed GEMM (else dot path)
  int64_t ap1, ap2;       // offsets of its packed A (gate/up input, down input)
};

// (expert index into `hit`, tile) pairs, to pack A tiles of all experts in one parallel loop.
template <typename F>
void for_each_tile(const std::vector<Expert>& hit, F&& pack_tile) {
  std::vector<std::pair<int, int64_t>> tiles;
  for (size_t i = 0; i < hit.size(); ++i)
    if (hit[i].packed)
      for (int64_t t = 0; t < ceil_div(hit[i].rows, MR); ++t) tiles.emplace_back(int(i), t);
  at::parallel_for(0, int64_t(tiles.size()), 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pack_tile(hit[tiles[i].first], tiles[i].second);
  });
}

template <typename T>
void fused_moe_impl(const T* x, int64_t ntok, int64_t H, const T* wgu, const T* wd, int64_t I,
                    const moe::Routing& route, int64_t E, moe::Act act, float* out32) {
  // Hit experts, their path and packed-A offsets.
  std::vector<Expert> hit;
  int64_t ap1_size = 0, ap2_size = 0;
  bool any_dot = false;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = route.offset[e + 1] - route.offset[e];
    if (rows == 0) continue;
    const bool packed = rows > kDotMaxRows || batch_invariant();
    any_dot |= !packed;
    hit.push_back({e, route.offset[e], rows, packed, ap1_size, ap2_size});
    if (packed) ap1_size += packed_a_size(rows, H), ap2_size += packed_a_size(rows, I);
  }
  const int64_t* tok = route.tok.data();
  const float* rw = route.weight.data();

  // fp32 copy of the hidden states: the dot path's A rows, in its layout (dot_a_row).
  std::vector<float> x32_buf;
  const float* x32 = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    x32 = x;
  } else if (any_dot) {
    x32_buf.resize(size_t(ntok * H));
    for (int64_t t = 0; t < ntok; ++t) dot_a_row<T>(x + t * H, H, x32_buf.data() + t * H);
    x32 = x32_buf.data();
  }

  // --- gate/up: h[r] = act(x[tok[r]] Wg^T) * (x[tok[r]] Wu^T), r in sorted order ---------
  std::vector<float> ap(size_t(std::max(ap1_size, ap2_size)));
  for_each_tile(hit, [&](const Expert& ex, int64_t t) {
    const T* rows[MR];
    for (int i = 0; i < MR; ++i) {
      const int64_t r = t * MR + i;
      rows[i] = r < ex.rows ? x + tok[ex.row0 + r] * H : nullptr;
    }
    pack_a_tile(rows, H, ceil_div(ex.rows, MR) * MR, t, ap.data() + ex.ap1);
  });
  std::vector<float> h(size_t(route.tok.size() * I));
  // Items: (expert, block of intermediate features). Packed: NCP panels of 8 gate + 8 up
  // rows (128 features); dot: 64 features.
  struct Item {
    int ex;
    int64_t n0, n1;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < hit.size(); ++i) {
    const int64_t step = hit[i].packed ? 8 * NCP : moe::kDotFeatures;
    for (int64_t n = 0; n < I; n += step) items.push_back({int(i), n, std::min(I, n + step)});
  }
  parallel_items(int64_t(items.size()), [&](int64_t it) {
    const Expert& ex = hit[items[it].ex];
    const T* wg = wgu + ex.e * 2 * I * H;
    const T* wu = wg + I * H;
    float* he = h.data() + ex.row0 * I;
    if (!ex.packed) {  // dot experts take the dot path for the down product too: h is
                       // written in its A layout
      moe::dot_gate_up<T>(x32, H, tok + ex.row0, ex.rows, wg, wu, I, items[it].n0, items[it].n1,
                          act, he);
      return;
    }
    // Panel p: gate rows 8p..8p+7 in columns 0..7, the matching up rows in 8..15.
    auto panel = [&](int64_t p) {
      const int64_t r = std::min(8 * p, I - 1);
      const int v = int(std::clamp<int64_t>(I - 8 * p, 0, 8));
      return std::pair{RowGroup<T>{wg + r * H, v}, RowGroup<T>{wu + r * H, v}};
    };
    const int64_t mp = ceil_div(ex.rows, MR) * MR;
    gemm_tiles<T>(ap.data() + ex.ap1, mp, H, H, 0, mp / MR, items[it].n0 / 8,
                  ceil_div(items[it].n1, 8), panel, [&](int64_t t, int64_t p, const float* tile) {
                    const int rows = int(std::min<int64_t>(MR, ex.rows - t * MR));
                    const int v = int(std::min<int64_t>(8, I - 8 * p));
                    for (int i = 0; i < rows; ++i) {
                      const Vec8 hv =
                          moe::act(act, Vec8::load(tile + i * NR)) * Vec8::load(tile + i * NR + 8);
                      store_n(he + (t * MR + i) * I + 8 * p, hv, v);
                    }
                  });
  });

  // --- down: out[tok[r]] += weight[r] * h[r] Wd^T; items own output columns -------------
  for_each_tile(hit, [&](const Expert& ex, int64_t t) {
    const float* rows[MR];
    for (int i = 0; i < MR; ++i) {
      const int64_t r = t * MR + i;
      rows[i] = r < ex.rows ? h.data() + (ex.row0 + r) * I : nullptr;
    }
    pack_a_tile(rows, I, ceil_div(ex.rows, MR) * MR, t, ap.data() + ex.ap2);
  });
  constexpr int64_t cols = moe::kDotColumns;  // 128 output columns per item
  parallel_items(ceil_div(H, cols), [&](int64_t c) {
    const int64_t n0 = c * cols, n1 = std::min(H, n0 + cols);
    for (const Expert& ex : hit) {
      const T* w = wd + ex.e * H * I;
      const int64_t* et = tok + ex.row0;
      const float* ew = rw + ex.row0;
      if (!ex.packed) {
        moe::dot_down<T>(h.data() + ex.row0 * I, I, et, ew, ex.rows, w, H, n0, n1, out32);
        continue;
      }
      const int64_t mp = ceil_div(ex.rows, MR) * MR;
      gemm_tiles<T>(ap.data() + ex.ap2, mp, I, I, 0, mp / MR, n0 / NR, ceil_div(n1, NR),
                    LinearPanels<T>{w, H, I}, [&](int64_t t, int64_t p, const float* tile) {
                      const int rows = int(std::min<int64_t>(MR, ex.rows - t * MR));
                      for (int hh = 0; hh < 2; ++hh) {
                        const int64_t n = p * NR + hh * 8;
                        const int nv = int(std::clamp<int64_t>(H - n, 0, 8));
                        if (nv == 0) break;
                        for (int i = 0; i < rows; ++i) {
                          const int64_t r = t * MR + i;
                          float* o = out32 + et[r] * H + n;
                          const Vec8 y = Vec8::fma(Vec8(ew[r]), Vec8::load(tile + i * NR + hh * 8),
                                                   nv == 8 ? Vec8::load(o) : load_partial(o, nv));
                          store_n(o, y, nv);
                        }
                      }
                    });
    }
  });
}

template <typename Id>
void check_ids(const Id* ids, int64_t n, int64_t E) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= E) checks::bad_expert_id(ids[i], i, E);
}

at::Tensor fused_moe_cpu(const at::Tensor& hidden, const at::Tensor& w_gate_up,
                         const at::Tensor& w_down, const at::Tensor& topk_weights_,
                         const at::Tensor& topk_ids_, c10::string_view activation) {
  const char* op = "fused_moe";
  const auto sz =
      checks::fused_moe(hidden, w_gate_up, w_down, topk_weights_, topk_ids_, activation, at::kCPU);
  const int64_t ntok = sz.tokens, H = sz.hidden, E = sz.experts, I = sz.inter;
  const moe::Act act = sz.act == checks::MoeAct::silu   ? moe::Act::silu
                       : sz.act == checks::MoeAct::gelu ? moe::Act::gelu
                                                        : moe::Act::gelu_tanh;

  const int64_t k = topk_ids_.size(1);
  const at::Tensor ids = topk_ids_.contiguous(), tw = topk_weights_.contiguous();
  const at::Tensor x = hidden.contiguous();
  at::Tensor out = at::empty({ntok, H}, x.options());
  if (ntok == 0 || H == 0) return out;

  TOPG_DISPATCH_FLOAT(x.scalar_type(), op, T, [&] {
    moe::Routing route;
    auto sort = [&]<typename Id>(const Id* id) {
      check_ids(id, ntok * k, E);
      route = tw.scalar_type() == at::kFloat ? moe::sort_by_expert(id, cptr<float>(tw), ntok, k, E)
                                             : moe::sort_by_expert(id, cptr<T>(tw), ntok, k, E);
    };
    if (ids.scalar_type() == at::kInt)
      sort(cptr<int32_t>(ids));
    else
      sort(cptr<int64_t>(ids));
    // fp32 accumulation buffer: the output itself for fp32.
    std::vector<float> acc;
    float* out32;
    if constexpr (std::is_same_v<T, float>) {
      out32 = ptr<float>(out);
    } else {
      acc.resize(size_t(ntok * H));
      out32 = acc.data();
    }
    std::fill(out32, out32 + ntok * H, 0.f);
    if (I > 0)
      fused_moe_impl(cptr<T>(x), ntok, H, cptr<T>(w_gate_up), cptr<T>(w_down), I, route, E, act,
                     out32);
    if constexpr (!std::is_same_v<T, float>) {
      T* o = ptr<T>(out);
      at::parallel_for(0, ntok * H, 1 << 14, [&](int64_t b, int64_t e) {
        int64_t i = b;
        for (; i + 8 <= e; i += 8) Vec8::load(out32 + i).store(o + i);
        for (; i < e; ++i) o[i] = from_float<T>(out32[i]);
      });
    }
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("fused_moe", &topg::fused_moe_cpu); }
