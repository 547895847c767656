// topg.DecodePlan (CPU): the whole decode step of a Llama-style decoder as one native
// call, for the engine's steps of at most 16 tokens: decode batches (one new token a
// sequence) and speculative verify steps (k + 1 a sequence).
//
// Built once from the model's tensors (torch_topg/compile/decode_plan.py lowers the model
// and checks that it is the family this plan computes); run() then does the step without
// Python or the dispatcher: the weights, KV caches and the rotary table are bound at
// construction (read in place: in-place weight updates are seen; a replaced or converted
// tensor makes run() refuse with "stale", and the engine lowers again), buffers persist
// across steps, and one thread team (team.h) runs every op of the step, phase by phase:
//
//   per layer  1. norm (+ residual add) -> q/k/v GEMV by head -> rotary -> cache write
//              2. paged attention, one item per (sequence, key partition), merged by
//                 whichever member finishes a sequence's last partition
//              3. o_proj GEMV
//              4. residual add + norm -> gate/up GEMV -> SiLU(gate) * up
//              5. down GEMV
//   then       6. residual add + final norm -> LM head GEMV on the sampled rows
//
// Fusions: each member keeps its own copy of the residual stream and normalises it
// itself (a few KiB; no barrier and no shared write between a GEMV's output and the
// next GEMV's input); rotary and the cache write run on each q/k/v head as soon as its
// GEMV item is done; the activation runs on each gate/up item. Every value is rounded
// where the compiled graph rounds it (each op's output in the model dtype) and every
// sum runs in the same order as the ops' kernels (the same dot-product blocks, the same
// attention partitions and merge), so the logits equal the compiled graph's bitwise (fp32, bf16).
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "activation_kernels.h"
#include "dispatch.h"
#include "gemm_kernels.h"
#include "gemv_bf16dp.h"
#include "norm_kernels.h"
#include "paged_kernels.h"
#include "plan_gemv.h"
#include "quant_kernels.h"
#include "rotary_kernels.h"
#include "team.h"

namespace topg {
namespace {

enum Phase : int { kQKV, kAttn, kOProj, kGateUp, kDown, kHead, kPhases };
constexpr int kLayerPhases = 5;
constexpr int kPerLayer = 14;  // weight tensors per layer
// Tokens a step may have: topg::linear's dot path (gemm::kDotMaxRows); beyond it the
// compiled graph runs a packed GEMM, which rounds differently.
constexpr int64_t kMaxTokens = gemm::kDotMaxRows;

using plan::GemvInput;
using plan::Lin;
using plan::padded_k;

struct Layer {
  at::Tensor ln_in, bq, bk, bv, qn, kn, ln_post, kc, vc;
  Lin wq, wk, wv, wo, wg, wu, wd;
  int64_t window = -1;
};

// One member's private state: its copy of the residual stream, the normalised rows, the
// A operand of the next GEMV (plan_gemv.h) and kernel scratch.
struct Member {
  std::vector<char> resid, x;
  std::vector<float> cos, sin, row;  // row: a de-quantised embedding row
  GemvInput in;
  paged::Workspace pw;
};

// The attention schedule of a step for one sliding-window value: per row its first key,
// partition size, result slots, and the (row, partition) items, costliest first.
struct AttnSched {
  int64_t window = -1;
  std::vector<int64_t> lo, size, first;
  std::vector<std::pair<int64_t, int64_t>> items;
};

// Weight rows per GEMV work item (rows of row_bytes each): ~256 KiB. Measured (SmolLM2 fp32, batch
// 1, 2 threads, ms per step, 3 alternating rounds): 128 KiB 22.2-24.2, 256 KiB 21.0-21.7, 512 KiB
// 21.3-23.3; one static range per member 20.4-21.3 (no better within the noise, and it
// cannot rebalance when a member is descheduled on a shared machine).
int64_t rows_per_item(int64_t row_bytes) {
  return std::max<int64_t>(8, (int64_t(1) << 18) / std::max<int64_t>(row_bytes, 1) / 8 * 8);
}

class DecodePlan : public torch::CustomClassHolder {
 public:
  // weights: embed, final_norm, lm_head, then per layer ln_in, wq, wk, wv, bq, bk, bv,
  // q_norm, k_norm, wo, ln_post, wg, wu, wd (an empty tensor for a missing bias or
  // per-head norm). formats: one per weight, "" (the model dtype) or the packed format of
  // embed, lm_head and the seven projections (suffix ":a8": int8 activations, as
  // linear_q's int8_activations). kv_caches: [k_0, v_0, ...].
  // dims: layers, hq, hkv, head_dim, block_size, then one window per layer (-1: none).
  // params: rms eps, attention scale. cache_layout: "paged" (each cache [blocks,
  // block_size, hkv, head_dim], the engine's) or "bhsd" ([batch, hkv, max_len, head_dim],
  // transformers' StaticCache: each batch row one block of block_size = max_len).
  DecodePlan(std::vector<at::Tensor> weights, std::vector<std::string> formats,
             std::vector<at::Tensor> kv_caches, at::Tensor cos_sin, std::vector<int64_t> dims,
             std::vector<double> params, std::string cache_layout)
      : cos_sin_(std::move(cos_sin)) {
    TORCH_CHECK(cache_layout == "paged" || cache_layout == "bhsd",
                "topg::DecodePlan: cache_layout expected 'paged' or 'bhsd', got '", cache_layout,
                "'");
    head_major_ = cache_layout == "bhsd";
    TORCH_CHECK(dims.size() >= 5, "topg::DecodePlan: dims expected [layers, hq, hkv, head_dim, ",
                "block_size, windows...], got ", dims.size(), " values");
    L_ = dims[0], hq_ = dims[1], hkv_ = dims[2], d_ = dims[3], bs_ = dims[4];
    TORCH_CHECK(L_ >= 1 && hq_ >= 1 && hkv_ >= 1 && hq_ % hkv_ == 0 && d_ % 2 == 0 && bs_ >= 1,
                "topg::DecodePlan: bad dims layers=", L_, " hq=", hq_, " hkv=", hkv_,
                " head_dim=", d_, " block_size=", bs_);
    TORCH_CHECK(int64_t(dims.size()) == 5 + L_, "topg::DecodePlan: expected ", L_, " windows, got ",
                dims.size() - 5);
    TORCH_CHECK(int64_t(weights.size()) == 3 + kPerLayer * L_, "topg::DecodePlan: expected ",
                3 + kPerLayer * L_, " weight tensors, got ", weights.size());
    TORCH_CHECK(int64_t(kv_caches.size()) == 2 * L_, "topg::DecodePlan: expected ", 2 * L_,
                " KV cache tensors (K and V per layer), got ", kv_caches.size());
    TORCH_CHECK(params.size() == 2, "topg::DecodePlan: params expected [eps, scale]");
    TORCH_CHECK(formats.size() == weights.size(), "topg::DecodePlan: expected one format per ",
                "weight (", weights.size(), "), got ", formats.size());
    eps_ = float(params[0]), scale_ = float(params[1]);
    // Which weights may be packed: embed, lm_head and the projections.
    std::vector<const quant::Format*> fmt(weights.size(), nullptr);
    std::vector<bool> a8(weights.size(), false);
    for (size_t i = 0; i < weights.size(); ++i) {
      if (formats[i].empty()) continue;
      const int64_t j = i < 3 ? int64_t(i) : (int64_t(i) - 3) % kPerLayer;
      const bool projection = i < 3 ? i != 1 : (j >= 1 && j <= 3) || j == 9 || j >= 11;
      TORCH_CHECK(projection, "topg::DecodePlan: weight ", i, " (a norm or a bias) cannot be ",
                  "packed (format '", formats[i], "')");
      std::string name = formats[i];
      if (name.size() > 3 && name.compare(name.size() - 3, 3, ":a8") == 0) {
        name.resize(name.size() - 3);
        a8[i] = true;
        TORCH_CHECK(i != 0, "topg::DecodePlan: the embedding has no activations (':a8')");
      }
      fmt[i] = quant::find_format(name);
      TORCH_CHECK(fmt[i], "topg::DecodePlan: weight ", i, ": unknown format '", formats[i], "'");
      packed_ = true;
      a8_ = a8_ || a8[i];
    }
    final_norm_ = weights[1];
    dtype_ = final_norm_.scalar_type();
    TORCH_CHECK(final_norm_.dim() == 1 && weights[0].dim() == 2 && weights[2].dim() == 2,
                "topg::DecodePlan: embed, final_norm, lm_head expected 2-D, 1-D, 2-D, got ",
                weights[0].sizes(), ", ", final_norm_.sizes(), ", ", weights[2].sizes());
    H_ = final_norm_.size(0), V_ = weights[2].size(0);
    embed_ = Lin{weights[0], fmt[0]}, lm_head_ = Lin{weights[2], fmt[2], a8[2]};
    for (int64_t l = 0; l < L_; ++l) {
      const size_t o = size_t(3 + kPerLayer * l);
      const at::Tensor* w = &weights[o];
      const auto lin = [&](int f) { return Lin{w[f], fmt[o + size_t(f)], a8[o + size_t(f)]}; };
      Layer y;
      y.ln_in = w[0], y.wq = lin(1), y.wk = lin(2), y.wv = lin(3), y.bq = w[4], y.bk = w[5];
      y.bv = w[6], y.qn = w[7], y.kn = w[8], y.wo = lin(9), y.ln_post = w[10], y.wg = lin(11);
      y.wu = lin(12), y.wd = lin(13);
      y.kc = kv_caches[2 * l], y.vc = kv_caches[2 * l + 1], y.window = dims[5 + l];
      layers_.push_back(y);
    }
    I_ = layers_[0].wg.t.size(0);
    expect(embed_, "embed", -1, H_);
    expect(final_norm_, "final_norm", {H_});
    expect(lm_head_, "lm_head", V_, H_);
    TORCH_CHECK(cos_sin_.dim() == 2 && cos_sin_.size(1) == d_ && cos_sin_.scalar_type() == dtype_ &&
                    cos_sin_.is_contiguous(),
                "topg::DecodePlan: cos_sin expected contiguous [positions, ", d_, "] ", dtype_,
                ", got ", cos_sin_.sizes(), " ", cos_sin_.scalar_type());
    for (int64_t l = 0; l < L_; ++l) {
      Layer& y = layers_[l];
      const std::string n = "layers." + std::to_string(l) + ".";
      expect(y.ln_in, n + "ln_in", {H_});
      expect(y.wq, n + "wq", hq_ * d_, H_);
      expect(y.wk, n + "wk", hkv_ * d_, H_);
      expect(y.wv, n + "wv", hkv_ * d_, H_);
      for (const auto& [b, rows, name] :
           {std::tuple{&y.bq, hq_ * d_, "bq"}, std::tuple{&y.bk, hkv_ * d_, "bk"},
            std::tuple{&y.bv, hkv_ * d_, "bv"}})
        if (b->numel()) expect(*b, n + name, {rows});
      if (y.qn.numel()) expect(y.qn, n + "q_norm", {d_});
      if (y.kn.numel()) expect(y.kn, n + "k_norm", {d_});
      expect(y.wo, n + "wo", H_, hq_ * d_);
      expect(y.ln_post, n + "ln_post", {H_});
      expect(y.wg, n + "wg", I_, H_);
      expect(y.wu, n + "wu", I_, H_);
      expect(y.wd, n + "wd", H_, I_);
      const int64_t c1 = head_major_ ? hkv_ : bs_, c2 = head_major_ ? bs_ : hkv_;
      for (const at::Tensor* c : {&y.kc, &y.vc})
        TORCH_CHECK(c->dim() == 4 && c->size(0) == layers_[0].kc.size(0) && c->size(1) == c1 &&
                        c->size(2) == c2 && c->size(3) == d_ && c->scalar_type() == dtype_ &&
                        c->is_contiguous() && c->device().is_cpu(),
                    "topg::DecodePlan: ", n, "kv cache expected contiguous [",
                    head_major_ ? "batch" : "blocks", ", ", c1, ", ", c2, ", ", d_, "] ", dtype_,
                    " on cpu, got ", c->sizes(), " ", c->scalar_type(), " on ", c->device());
    }
    num_blocks_ = layers_[0].kc.size(0);
    counters_ = std::make_unique<team::Counter[]>(kLayerPhases * L_ + 1);
    const char* prof = std::getenv("TOPG_PROFILE");
    profile_on_ = prof && prof[0] && std::string(prof) != "0";
  }

  // Logits [R, vocab] (float32) of the rows `logits_indices` of a step of T tokens of S
  // sequences (cu_seqlens_q: sequence s computes tokens [cu[s], cu[s + 1]); a decode batch
  // has one each, a speculative verify step k + 1), T <= kMaxTokens.
  at::Tensor run(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping,
                 at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cu_seqlens_q,
                 at::Tensor logits_indices) {
    check_weights();
    const int64_t T = input_ids.numel(), S = seq_lens.numel();
    arg(input_ids, "input_ids", at::kLong, T);
    arg(positions, "positions", at::kLong, T);
    arg(slot_mapping, "slot_mapping", at::kLong, T);
    arg(seq_lens, "seq_lens", at::kInt, S);
    arg(cu_seqlens_q, "cu_seqlens_q", at::kInt, S + 1);
    arg(logits_indices, "logits_indices", at::kLong, logits_indices.numel());
    TORCH_CHECK(T >= 1 && S >= 1 && logits_indices.numel() >= 1,
                "topg::DecodePlan.run: empty step (", T, " tokens, ", S, " sequences, ",
                logits_indices.numel(), " sampled rows)");
    TORCH_CHECK(T <= kMaxTokens, "topg::DecodePlan.run: ", T, " tokens; the plan runs steps of at ",
                "most ", kMaxTokens, " (larger ones take the compiled graph's GEMM)");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S &&
                    block_tables.scalar_type() == at::kInt && block_tables.device().is_cpu(),
                "topg::DecodePlan.run: block_tables expected int32 [", S, ", max_blocks] on cpu, ",
                "got ", block_tables.scalar_type(), " ", block_tables.sizes(), " on ",
                block_tables.device());
    const at::Tensor bt_t = block_tables.contiguous();
    const int64_t R = logits_indices.numel(), mb = bt_t.size(1);
    const int64_t* ids = input_ids.const_data_ptr<int64_t>();
    const int64_t* pos = positions.const_data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
    const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
    const int32_t* cu = cu_seqlens_q.const_data_ptr<int32_t>();
    const int32_t* bt = bt_t.const_data_ptr<int32_t>();
    const int64_t* li = logits_indices.const_data_ptr<int64_t>();
    TORCH_CHECK(cu[0] == 0 && cu[S] == T, "topg::DecodePlan.run: cu_seqlens_q expected to run ",
                "from 0 to ", T, ", got ", cu[0], " .. ", cu[S]);
    row_seq_.resize(size_t(T)), row_len_.resize(size_t(T));
    for (int64_t q = 0; q < S; ++q) {
      const int64_t rows = cu[q + 1] - cu[q];
      TORCH_CHECK(rows >= 0 && rows < paged::kDenseRows, "topg::DecodePlan.run: sequence ", q,
                  " has ", rows, " new tokens (cu_seqlens_q not increasing, or a run the ",
                  "compiled graph gives to the dense prefill kernel)");
      TORCH_CHECK(lens[q] >= rows && lens[q] <= mb * bs_, "topg::DecodePlan.run: seq_lens[", q,
                  "] = ", lens[q], " outside [", rows, ", ", mb * bs_,
                  "] (its new tokens .. max_blocks x block_size)");
      for (int64_t j = 0; j < (lens[q] + bs_ - 1) / bs_; ++j)
        TORCH_CHECK(bt[q * mb + j] >= 0 && bt[q * mb + j] < num_blocks_,
                    "topg::DecodePlan.run: ", "block_tables[", q, ", ", j, "] = ", bt[q * mb + j],
                    " outside [0, ", num_blocks_, ")");
      for (int64_t t = cu[q]; t < cu[q + 1]; ++t)
        row_seq_[t] = int32_t(q), row_len_[t] = int32_t(lens[q] - (cu[q + 1] - t) + 1);
    }
    for (int64_t b = 0; b < T; ++b) {
      TORCH_CHECK(ids[b] >= 0 && ids[b] < embed_.t.size(0), "topg::DecodePlan.run: input_ids[", b,
                  "] = ", ids[b], " outside the vocabulary [0, ", embed_.t.size(0), ")");
      TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_sin_.size(0), "topg::DecodePlan.run: positions[", b,
                  "] = ", pos[b], " outside the rotary table [0, ", cos_sin_.size(0), ")");
      TORCH_CHECK(slots[b] >= 0 && slots[b] < num_blocks_ * bs_,
                  "topg::DecodePlan.run: ", "slot_mapping[", b, "] = ", slots[b], " outside [0, ",
                  num_blocks_ * bs_, ")");
    }
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(li[r] >= 0 && li[r] < T, "topg::DecodePlan.run: logits_indices[", r,
                  "] = ", li[r], " outside [0, ", T, ")");
    at::Tensor logits = at::empty({R, V_}, input_ids.options().dtype(at::kFloat));
    const Step s{
        ids, pos, slots, bt, mb, row_len_.data(), li, T, R, logits.mutable_data_ptr<float>()};
    TOPG_DISPATCH_FLOAT(dtype_, "DecodePlan", T, [&] { step<T>(s); });
    return logits;
  }

  // Seconds per phase summed over the steps run with TOPG_PROFILE=1, then the step count.
  std::vector<double> profile() const {
    std::vector<double> p(prof_, prof_ + kPhases);
    p.push_back(double(prof_steps_));
    return p;
  }
  void reset_profile() {
    std::fill(prof_, prof_ + kPhases, 0.0);
    prof_steps_ = 0;
  }
  int64_t last_members() const { return last_members_; }

 private:
  struct Step {
    const int64_t *ids, *pos, *slots;
    const int32_t* bt;
    int64_t bt_ss;
    const int32_t* lens;  // per token: the keys its row sees (its sequence up to itself)
    const int64_t* li;
    int64_t B, R;
    float* logits;
  };

  void expect(const at::Tensor& t, const std::string& name, std::vector<int64_t> shape,
              std::optional<at::ScalarType> dtype = std::nullopt, const std::string& what = "") {
    const at::ScalarType dt = dtype.value_or(dtype_);
    bool ok = t.dim() == int64_t(shape.size()) && t.scalar_type() == dt && t.is_contiguous() &&
              t.device().is_cpu();
    for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || t.size(i) == shape[i];
    TORCH_CHECK(ok, "topg::DecodePlan: ", name, " expected a contiguous cpu ", dt,
                " tensor of shape ", at::IntArrayRef(shape), what, " (-1: any), got ",
                t.scalar_type(), " ", t.sizes(), " on ", t.device(),
                t.is_contiguous() ? "" : " (not contiguous)");
    bound_.push_back({t, t.const_data_ptr(), name, dt});
  }
  // A weight [N, K] (N = -1: any): in the model dtype, or packed ([N, row_bytes(K)] uint8).
  void expect(Lin& w, const std::string& name, int64_t N, int64_t K) {
    w.p = w.t.const_data_ptr();  // checked below; bound_ catches a later move
    if (!w.f) {
      expect(w.t, name, {N, K});
      w.rb = K * int64_t(c10::elementSize(dtype_));
      return;
    }
    TORCH_CHECK(quant::pads(*w.f) || K % w.f->block == 0, "topg::DecodePlan: ", name, ": ", K,
                " inputs is not a multiple of its format's block of ", w.f->block);
    w.rb = w.f->row_bytes(K);
    expect(
        w.t, name, {N, w.rb}, at::kByte,
        " (packed: " + std::to_string(K) + " weights a row in " + std::to_string(w.rb) + " bytes)");
  }

  static void arg(const at::Tensor& t, const char* name, at::ScalarType dt, int64_t n) {
    TORCH_CHECK(t.scalar_type() == dt && t.numel() == n && t.device().is_cpu() && t.is_contiguous(),
                "topg::DecodePlan.run: ", name, " expected contiguous ", dt, " with ", n,
                " elements on cpu, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
  }

 public:
  // A bound tensor converted (.to(dtype) through .data), resized or replaced in storage:
  // why, or "" while every bound tensor is as it was. run() refuses a stale plan; callers
  // ask stale() to tell that refusal from other errors (torch_topg.compile.decode_plan).
  std::string stale() const {
    for (const auto& b : bound_)
      if (b.t.scalar_type() != b.dtype || !b.t.is_contiguous() || b.t.const_data_ptr() != b.data)
        return b.name + " changed (dtype " + std::string(c10::toString(b.t.scalar_type())) +
               ", storage moved) since the plan was built; lower the model again";
    return "";
  }

 private:
  void check_weights() const {
    const std::string why = stale();
    TORCH_CHECK(why.empty(), "topg::DecodePlan is stale: ", why);
  }

  template <typename T>
  void step(const Step& s);

  struct Bound {
    at::Tensor t;
    const void* data;
    std::string name;
    at::ScalarType dtype;
  };
  Lin embed_, lm_head_;
  at::Tensor final_norm_, cos_sin_;
  bool packed_ = false;      // some weight is packed: the A rows are also kept as padded fp32
  bool head_major_ = false;  // cache_layout "bhsd"
  bool a8_ = false;          // some weight takes int8 activations: and as int8 blocks
  std::vector<Layer> layers_;
  std::vector<Bound> bound_;
  at::ScalarType dtype_;
  int64_t L_, H_, I_, V_, hq_, hkv_, d_, bs_, num_blocks_;
  float eps_, scale_;
  // Shared buffers of a step (bytes; typed in step<T>), persistent across steps.
  std::vector<char> q_, k_, v_, attn_, delta_, gu_, act_;
  std::vector<float> res_;
  std::vector<Member> members_;
  std::vector<AttnSched> scheds_;
  std::vector<int32_t> row_seq_, row_len_;  // per token: its sequence, its keys
  std::unique_ptr<std::atomic<int32_t>[]> pending_;
  int64_t pending_size_ = 0;
  std::unique_ptr<team::Counter[]> counters_;
  bool profile_on_ = false;
  double prof_[kPhases] = {};
  int64_t prof_steps_ = 0, last_members_ = 0;
};

template <typename T>
void DecodePlan::step(const Step& s) {
  const int64_t B = s.B, R = s.R, H = H_, I = I_, V = V_, hq = hq_, hkv = hkv_, d = d_;
  const int64_t qd = hq * d, kd = hkv * d, rs = paged::part_stride(d);
  const int want = int(std::max<int64_t>(1, at::get_num_threads()));
  const auto sz = [](std::vector<char>& v, int64_t n) { v.resize(size_t(n * sizeof(T))); };
  sz(q_, B * qd), sz(k_, B * kd), sz(v_, B * kd), sz(attn_, B * qd), sz(delta_, B * H);
  sz(gu_, B * 2 * I), sz(act_, B * I);
  const int64_t kmax = std::max({H, qd, I});
  if (int64_t(members_.size()) < want) members_.resize(size_t(want));
  for (Member& m : members_) {
    sz(m.resid, B * H), sz(m.x, B * H);
    constexpr bool is_bf16 = std::is_same_v<T, bf16>;
    m.in.fit(std::max(B, R), kmax, packed_, a8_, is_bf16 && gemm::use_bf16dp(),
             is_bf16 && gemm::amx::enabled());
    m.cos.resize(size_t(B * d)), m.sin.resize(size_t(B * d));
    if (embed_.f) m.row.resize(size_t(padded_k(H)));
  }
  // The attention schedule per distinct window (paged_attention's partitions, bitwise).
  scheds_.clear();
  int64_t res_floats = 0;
  std::vector<int> sched_of(static_cast<size_t>(L_));
  for (int64_t l = 0; l < L_; ++l) {
    const int64_t w = layers_[l].window;
    size_t i = 0;
    while (i < scheds_.size() && scheds_[i].window != w) ++i;
    sched_of[l] = int(i);
    if (i < scheds_.size()) continue;
    AttnSched a;
    a.window = w;
    a.lo.resize(B), a.size.resize(B), a.first.resize(B + 1);
    std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> costed;
    int64_t parts = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = s.lens[b];
      a.lo[b] = w >= 0 ? std::max<int64_t>(0, n - 1 - w) : 0;
      const int64_t P = a.size[b] = paged::part_tokens(n - a.lo[b]), k0 = a.lo[b] / P;
      a.first[b] = parts;
      for (int64_t k = k0; k * P < n; ++k)
        costed.push_back({std::min(n, (k + 1) * P) - k * P, {b, k}}), ++parts;
    }
    a.first[B] = parts;
    std::stable_sort(costed.begin(), costed.end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
    for (const auto& c : costed) a.items.push_back(c.second);
    res_floats = std::max(res_floats, parts * hq * rs);
    scheds_.push_back(std::move(a));
  }
  res_.resize(size_t(res_floats));
  if (pending_size_ < B) {
    pending_ = std::make_unique<std::atomic<int32_t>[]>(size_t(B));
    pending_size_ = B;
  }
  for (int64_t i = 0; i < kLayerPhases * L_ + 1; ++i) counters_[i].next.store(0);

  T* q = reinterpret_cast<T*>(q_.data());
  T* kb = reinterpret_cast<T*>(k_.data());
  T* vb = reinterpret_cast<T*>(v_.data());
  T* attn = reinterpret_cast<T*>(attn_.data());
  T* delta = reinterpret_cast<T*>(delta_.data());
  T* gu = reinterpret_cast<T*>(gu_.data());
  T* act = reinterpret_cast<T*>(act_.data());
  const T* cs = cptr<T>(cos_sin_);
  const bool prof = profile_on_;

  last_members_ = team::run_team(want, [&](int me, int, team::Barrier& bar) {
    Member& m = members_[size_t(me)];
    T* resid = reinterpret_cast<T*>(m.resid.data());
    T* x = reinterpret_cast<T*>(m.x.data());
    auto clock = std::chrono::steady_clock::now();
    const auto sync = [&](Phase p) {
      bar.wait();
      if (prof && me == 0) {
        const auto now = std::chrono::steady_clock::now();
        prof_[p] += std::chrono::duration<double>(now - clock).count();
        clock = now;
      }
    };
    // The A operand of the next GEMVs (plan_gemv.h), and emit(r, n, sum) for weight rows
    // [n0, n1) of w against it.
    const auto load_a = [&](const T* src, int64_t K, int64_t rows, const int64_t* idx) {
      m.in.load(src, K, rows, idx);
    };
    const auto dot = [&](const Lin& w, int64_t K, int64_t rows, int64_t n0, int64_t n1,
                         auto&& emit) { m.in.dot<T>(w, K, rows, n0, n1, emit); };
    // out[r * ldo + n] = T(A_r . w_n + bias_n) for weight rows [n0, n1).
    const auto gemv = [&](const Lin& w, int64_t K, const T* bias, int64_t rows, int64_t n0,
                          int64_t n1, T* out, int64_t ldo) {
      dot(w, K, rows, n0, n1, [&](int64_t r, int64_t n, float v) {
        out[r * ldo + n] = from_float<T>(bias ? v + to_float(bias[n]) : v);
      });
    };
    const auto items = [&](team::Counter& c, int64_t n, auto&& fn) {
      for (int64_t i = c.take(); i < n; i = c.take()) fn(i);
    };
    // fn(u0, u1) over chunks of `chunk` units taken from the shared counter.
    const auto share = [&](team::Counter& c, int64_t units, int64_t chunk, auto&& fn) {
      const int64_t n = gemm::ceil_div(units, chunk);
      for (int64_t i = c.take(); i < n; i = c.take())
        fn(i * chunk, std::min(units, (i + 1) * chunk));
    };
    const auto opt = [](const at::Tensor& b) { return b.numel() ? cptr<T>(b) : nullptr; };

    for (int64_t b = 0; b < B; ++b) {
      if (embed_.f) {  // embedding_q's rows: de-quantised, rounded once to T
        float* row = m.row.data();
        quant::dequant_row(*embed_.f, cptr<uint8_t>(embed_.t) + s.ids[b] * embed_.rb, H, row);
        for (int64_t i = 0; i < H; ++i) resid[b * H + i] = from_float<T>(row[i]);
      } else {
        std::memcpy(resid + b * H, cptr<T>(embed_.t) + s.ids[b] * H, size_t(H) * sizeof(T));
      }
      // each row's cos / sin, once a step (positions are the same in every layer)
      rotary::load_cos_sin(cs + s.pos[b] * d, d, true, &m.cos[b * d], &m.sin[b * d]);
    }
    // 3. / 5. out[:, rows of w] = A . w^T for a projection to H outputs (o, down).
    const auto project = [&](team::Counter& c, const Lin& w, int64_t K) {
      const int64_t step = rows_per_item(w.rb);
      share(c, gemm::ceil_div(H, 8), step / 8, [&](int64_t u0, int64_t u1) {
        gemv(w, K, nullptr, B, u0 * 8, std::min(H, u1 * 8), delta, H);
      });
    };
    for (int64_t l = 0; l < L_; ++l) {
      const Layer& y = layers_[l];
      const AttnSched& as = scheds_[size_t(sched_of[l])];
      team::Counter* c = &counters_[kLayerPhases * l];
      // 1. (residual add +) norm, q/k/v by head, rotary, cache write.
      if (l == 0) {
        norm::rms_norm_rows(resid, H, cptr<T>(y.ln_in), x, H, H, eps_, 0, B);
      } else {
        std::memcpy(x, delta, size_t(B * H) * sizeof(T));
        norm::fused_add_rms_norm_rows(x, resid, cptr<T>(y.ln_in), H, eps_, 0, B);
      }
      load_a(x, H, B, nullptr);
      if (me == 0)
        for (int64_t b = 0; b < B; ++b)
          pending_[b].store(int32_t(as.first[b + 1] - as.first[b]), std::memory_order_relaxed);
      share(c[kQKV], hq + 2 * hkv, 1, [&](int64_t h0, int64_t h1) {
        // heads [h0, h1) of q | k | v: one GEMV call per tensor, then per head rotary and
        // the cache write.
        for (int part = 0; part < 3; ++part) {
          const int64_t base = part == 0 ? 0 : part == 1 ? hq : hq + hkv;
          const int64_t count = part == 0 ? hq : hkv;
          const int64_t a0 = std::max(h0, base) - base, a1 = std::min(h1, base + count) - base;
          if (a1 <= a0) continue;
          const Lin& w = part == 0 ? y.wq : part == 1 ? y.wk : y.wv;
          const T* bias = opt(part == 0 ? y.bq : part == 1 ? y.bk : y.bv);
          T* out = part == 0 ? q : part == 1 ? kb : vb;
          const int64_t ld = part == 0 ? qd : kd;
          gemv(w, H, bias, B, a0 * d, a1 * d, out, ld);
          for (int64_t h = a0; h < a1; ++h)
            for (int64_t b = 0; b < B; ++b) {
              T* head = out + b * ld + h * d;
              const at::Tensor& hn = part == 0 ? y.qn : y.kn;  // per-head RMSNorm (Qwen3)
              if (part < 2 && hn.numel())
                norm::rms_norm_rows(head, d, cptr<T>(hn), head, d, d, eps_, 0, 1);
              if (part < 2) rotary::rotate_neox(head, &m.cos[b * d], &m.sin[b * d], d / 2);
              if (part > 0) {
                T* cache = ptr<T>(part == 1 ? y.kc : y.vc);
                const int64_t slot = s.slots[b];
                const int64_t at =
                    head_major_ ? ((slot / bs_) * hkv + h) * bs_ + slot % bs_ : slot * hkv + h;
                std::memcpy(cache + at * d, head, size_t(d) * sizeof(T));
              }
            }
        }
      });
      sync(kQKV);
      // 2. Paged attention: (row, partition) items; a row is merged by the member that
      // finishes its last partition.
      {
        paged::PagedArgs<T, T> a{};
        a.q = q, a.q_ss = qd, a.q_sh = d;
        a.kc = cptr<T>(y.kc), a.vc = cptr<T>(y.vc);
        a.bt = s.bt, a.bt_ss = s.bt_ss, a.row_seq = row_seq_.data();
        a.hq = hq, a.hkv = hkv, a.d = d, a.block_size = bs_;
        a.scale = scale_, a.softcap = 0.f, a.window = y.window, a.head_major = head_major_;
        items(c[kAttn], int64_t(as.items.size()), [&](int64_t i) {
          const auto [b, k] = as.items[size_t(i)];
          const int64_t n = s.lens[b], P = as.size[b], k0 = as.lo[b] / P;
          float* res = res_.data() + as.first[b] * hq * rs;
          const paged::RowPart rp{b, as.lo[b], n, res + (k - k0) * hq * rs};
          paged::partition(a, &rp, 1, k * P, std::min(n, (k + 1) * P), m.pw);
          if (pending_[b].fetch_sub(1, std::memory_order_acq_rel) == 1)
            paged::combine(res, as.first[b + 1] - as.first[b], hq, d, attn + b * qd, d);
        });
      }
      sync(kAttn);
      // 3. o_proj.
      load_a(attn, qd, B, nullptr);
      project(c[kOProj], y.wo, qd);
      sync(kOProj);
      // 4. Residual add + norm, gate/up, SiLU(gate) * up.
      std::memcpy(x, delta, size_t(B * H) * sizeof(T));
      norm::fused_add_rms_norm_rows(x, resid, cptr<T>(y.ln_post), H, eps_, 0, B);
      load_a(x, H, B, nullptr);
      {
        const int64_t step = rows_per_item(y.wg.rb + y.wu.rb);
        share(c[kGateUp], gemm::ceil_div(I, 8), step / 8, [&](int64_t u0, int64_t u1) {
          const int64_t n0 = u0 * 8, n1 = std::min(I, u1 * 8);
          // gate rows, then up rows: the kernel topg::linear runs on the fused [gate; up]
          // weight of the compiled graph, so each row's sum is the same.
          gemv(y.wg, H, nullptr, B, n0, n1, gu, 2 * I);
          gemv(y.wu, H, nullptr, B, n0, n1, gu + I, 2 * I);
          for (int64_t b = 0; b < B; ++b) act::gated_span<act::Silu>(gu, 2 * I, act, I, b, n0, n1);
        });
      }
      sync(kGateUp);
      // 5. down.
      load_a(act, I, B, nullptr);
      project(c[kDown], y.wd, I);
      sync(kDown);
    }
    // 6. Residual add + final norm, LM head on the sampled rows.
    std::memcpy(x, delta, size_t(B * H) * sizeof(T));
    norm::fused_add_rms_norm_rows(x, resid, cptr<T>(final_norm_), H, eps_, 0, B);
    load_a(x, H, R, s.li);
    const int64_t step = rows_per_item(lm_head_.rb);
    share(counters_[kLayerPhases * L_], gemm::ceil_div(V, 8), step / 8,
          [&](int64_t u0, int64_t u1) {
            dot(lm_head_, H, R, u0 * 8, std::min(V, u1 * 8), [&](int64_t r, int64_t n, float v) {
              s.logits[r * V + n] = to_float(from_float<T>(v));
            });
          });
    sync(kHead);
  });
  if (prof) ++prof_steps_;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_FRAGMENT(topg, m) {
  topg::team::register_fork_handler();  // at load: every later fork is seen
  m.class_<topg::DecodePlan>("DecodePlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::string>, std::vector<at::Tensor>,
                       at::Tensor, std::vector<int64_t>, std::vector<double>, std::string>())
      .def("run", &topg::DecodePlan::run)
      .def("profile", &topg::DecodePlan::profile)
      .def("reset_profile", &topg::DecodePlan::reset_profile)
      .def("stale", &topg::DecodePlan::stale)
      .def("last_members", &topg::DecodePlan::last_members);
}
