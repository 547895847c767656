// topg.DecodePlan (decode_plan.h): binding and checking the model's tensors at
// construction, run()'s argument checks, the class registration. The step itself is in
// decode_plan_step.cpp.
#include "decode_plan.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "dispatch.h"

namespace topg::plan {

// weights: embed, final_norm, lm_head, then kPerLayer per layer (decode_plan.h; an empty
// tensor for an absent bias, norm, or the MLP kind a layer does not have). formats: one
// per weight, "" (the model dtype) or the packed format of embed, lm_head, a projection or
// an experts tensor (suffix ":a8": int8 activations, as linear_q's int8_activations).
// kv_caches: [k_0, v_0, ...]. dims: layers, hq, hkv, head_dim, block_size, then per layer
// window (-1: none), top_k (0: dense MLP), flags, rotary (decode_plan.h). params: rms
// eps, attention scale, embedding multiplier, residual multiplier, logits divisor (1: none),
// optionally then the attention logit softcap (0: none) and the norms' weight offset (0: w,
// 1: 1 + w in float32, Gemma's RMSNorm). cos_sin: [positions, head_dim] or
// [tables, positions, head_dim] (a layer's rotary dim picks its table).
// cache_layout: "paged" (each cache [blocks, block_size, hkv, head_dim],
// the engine's) or "bhsd" ([batch, hkv, max_len, head_dim], transformers' StaticCache:
// each batch row one block of block_size = max_len).
DecodePlan::DecodePlan(std::vector<at::Tensor> weights, std::vector<std::string> formats,
                       std::vector<at::Tensor> kv_caches, at::Tensor cos_sin,
                       std::vector<int64_t> dims, std::vector<double> params,
                       std::string cache_layout)
    : cos_sin_(std::move(cos_sin)) {
  TORCH_CHECK(cache_layout == "paged" || cache_layout == "bhsd",
              "topg::DecodePlan: cache_layout expected 'paged' or 'bhsd', got '", cache_layout,
              "'");
  head_major_ = cache_layout == "bhsd";
  TORCH_CHECK(params.size() == 5 || params.size() == 7, "topg::DecodePlan: params expected [eps, ",
              "scale, embedding multiplier, residual multiplier, logits divisor(, attention ",
              "softcap, norm offset)], got ", params.size(), " values");
  TORCH_CHECK(dims.size() >= 5, "topg::DecodePlan: dims expected [layers, hq, hkv, head_dim, ",
              "block_size, (window, top_k, flags, rotary) per layer], got ", dims.size(),
              " values");
  L_ = dims[0], hq_ = dims[1], hkv_ = dims[2], d_ = dims[3], bs_ = dims[4];
  TORCH_CHECK(L_ >= 1 && hq_ >= 1 && hkv_ >= 1 && hq_ % hkv_ == 0 && d_ % 2 == 0 && bs_ >= 1,
              "topg::DecodePlan: bad dims layers=", L_, " hq=", hq_, " hkv=", hkv_,
              " head_dim=", d_, " block_size=", bs_);
  TORCH_CHECK(int64_t(dims.size()) == 5 + kLayerDims * L_, "topg::DecodePlan: expected ",
              kLayerDims * L_, " per-layer dims (window, top_k, flags, rotary), got ",
              dims.size() - 5);
  TORCH_CHECK(int64_t(weights.size()) == 3 + kPerLayer * L_, "topg::DecodePlan: expected ",
              3 + kPerLayer * L_, " weight tensors, got ", weights.size());
  TORCH_CHECK(int64_t(kv_caches.size()) == 2 * L_, "topg::DecodePlan: expected ", 2 * L_,
              " KV cache tensors (K and V per layer), got ", kv_caches.size());
  TORCH_CHECK(formats.size() == weights.size(), "topg::DecodePlan: expected one format per ",
              "weight (", weights.size(), "), got ", formats.size());
  eps_ = float(params[0]), scale_ = float(params[1]);
  embed_mult_ = float(params[2]), resid_mult_ = float(params[3]), logits_div_ = float(params[4]);
  if (params.size() == 7) {
    softcap_ = float(params[5]);
    TORCH_CHECK(softcap_ >= 0.f, "topg::DecodePlan: attention softcap expected >= 0 (0: none), ",
                "got ", softcap_);
    TORCH_CHECK(params[6] == 0.0 || params[6] == 1.0,
                "topg::DecodePlan: norm offset expected 0 (w) or 1 (1 + w), got ", params[6]);
    norm_offset_ = params[6] == 1.0;
  }
  TORCH_CHECK(logits_div_ != 0.f, "topg::DecodePlan: logits divisor expected non-zero, got 0");
  // Which weights may be packed: embed, lm_head, the projections and the experts.
  std::vector<const quant::Format*> fmt(weights.size(), nullptr);
  std::vector<bool> a8(weights.size(), false);
  for (size_t i = 0; i < weights.size(); ++i) {
    if (formats[i].empty()) continue;
    const int64_t j = i < 3 ? int64_t(i) : (int64_t(i) - 3) % kPerLayer;
    const bool projection =
        i < 3 ? i != 1
              : (j >= 1 && j <= 3) || j == 9 || (j >= 11 && j <= 13) || (j >= 15 && j <= 20);
    TORCH_CHECK(projection, "topg::DecodePlan: weight ", i, " (a norm, a bias or a router) ",
                "cannot be packed (format '", formats[i], "')");
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
  expect(embed_, "embed", -1, H_);
  expect(final_norm_, "final_norm", {H_});
  expect(lm_head_, "lm_head", V_, H_);
  // The rotary table in the model dtype, or in float32 where the model's rotary module
  // returns float32 (the graph's rotary op then reads float32 cos / sin).
  // Several tables (Gemma 3: local and global layers' frequencies): [tables, positions, d].
  tables_ = cos_sin_.dim() == 3 ? cos_sin_.size(0) : 1;
  TORCH_CHECK((cos_sin_.dim() == 2 || cos_sin_.dim() == 3) && cos_sin_.size(-1) == d_ &&
                  (cos_sin_.scalar_type() == dtype_ || cos_sin_.scalar_type() == at::kFloat) &&
                  cos_sin_.is_contiguous(),
              "topg::DecodePlan: cos_sin expected contiguous [(tables,) positions, ", d_, "] ",
              dtype_, " or float32, got ", cos_sin_.sizes(), " ", cos_sin_.scalar_type());
  positions_ = cos_sin_.size(-2);
  kmax_ = std::max(H_, hq_ * d_);
  layers_.resize(size_t(L_));
  for (int64_t l = 0; l < L_; ++l) {
    const size_t o = size_t(3 + kPerLayer * l);
    layers_[l].kc = kv_caches[2 * l], layers_[l].vc = kv_caches[2 * l + 1];
    bind_layer(l, &weights[o], fmt, a8, o, &dims[size_t(5 + kLayerDims * l)]);
  }
  num_blocks_ = layers_[0].kc.size(0);
  counters_ = std::make_unique<team::Counter[]>(kLayerCounters * L_ + 1);
  const char* prof = std::getenv("TOPG_PROFILE");
  profile_on_ = prof && prof[0] && std::string(prof) != "0";
}

void DecodePlan::bind_layer(int64_t l, const at::Tensor* w,
                            const std::vector<const quant::Format*>& fmt,
                            const std::vector<bool>& a8, size_t o, const int64_t* ldims) {
  Layer& y = layers_[l];
  const auto lin = [&](int f) { return Lin{w[f], fmt[o + size_t(f)], a8[o + size_t(f)]}; };
  y.ln_in = w[0], y.wq = lin(1), y.wk = lin(2), y.wv = lin(3), y.bq = w[4], y.bk = w[5];
  y.bv = w[6], y.qn = w[7], y.kn = w[8], y.wo = lin(9), y.ln_post = w[10];
  y.post_attn = w[21], y.post_ffw = w[22];
  y.window = ldims[0], y.rope = ldims[3];
  const std::string n = "layers." + std::to_string(l) + ".";
  TORCH_CHECK(y.rope >= 0 && y.rope <= tables_, "topg::DecodePlan: ", n, "rotary ", y.rope,
              " expected 0 (none) .. ", tables_, " (the tables in cos_sin)");
  // Every norm of the residual stream is optional (an absent pre-norm: the sublayer reads
  // the stream itself; an absent post-norm: its output joins the stream as it is).
  for (const auto& [t, name] :
       {std::pair{&y.ln_in, "ln_in"}, std::pair{&y.ln_post, "ln_post"},
        std::pair{&y.post_attn, "post_attn_norm"}, std::pair{&y.post_ffw, "post_ffw_norm"}})
    if (t->numel()) expect(*t, n + name, {H_});
  expect(y.wq, n + "wq", hq_ * d_, H_);
  expect(y.wk, n + "wk", hkv_ * d_, H_);
  expect(y.wv, n + "wv", hkv_ * d_, H_);
  for (const auto& [b, rows, name] :
       {std::tuple{&y.bq, hq_ * d_, "bq"}, std::tuple{&y.bk, hkv_ * d_, "bk"},
        std::tuple{&y.bv, hkv_ * d_, "bv"}})
    if (b->numel()) expect(*b, n + name, {rows});
  // q_norm / k_norm: per head ([head_dim], Qwen3) or over the whole projection (OLMoE)
  y.qk_whole = y.qn.numel() > d_;
  if (y.qn.numel()) expect(y.qn, n + "q_norm", {y.qk_whole ? hq_ * d_ : d_});
  if (y.kn.numel()) expect(y.kn, n + "k_norm", {y.qk_whole ? hkv_ * d_ : d_});
  TORCH_CHECK(y.qn.numel() == 0 || y.kn.numel() != 0, "topg::DecodePlan: ", n,
              "q_norm without k_norm");
  expect(y.wo, n + "wo", H_, hq_ * d_);
  const int64_t c1 = head_major_ ? hkv_ : bs_, c2 = head_major_ ? bs_ : hkv_;
  for (const at::Tensor* c : {&y.kc, &y.vc})
    TORCH_CHECK(c->dim() == 4 && c->size(0) == layers_[0].kc.size(0) && c->size(1) == c1 &&
                    c->size(2) == c2 && c->size(3) == d_ && c->scalar_type() == dtype_ &&
                    c->is_contiguous() && c->device().is_cpu(),
                "topg::DecodePlan: ", n, "kv cache expected contiguous [",
                head_major_ ? "batch" : "blocks", ", ", c1, ", ", c2, ", ", d_, "] ", dtype_,
                " on cpu, got ", c->sizes(), " ", c->scalar_type(), " on ", c->device());
  if (ldims[1] > 0) {
    for (int f = 11; f <= 13; ++f)
      TORCH_CHECK(!w[f].defined() || w[f].numel() == 0, "topg::DecodePlan: ", n,
                  "an MoE layer (top_k ", ldims[1], ") has dense MLP weight ", f);
    bind_moe(y, n, w, fmt, a8, o, ldims[1], ldims[2]);
    return;
  }
  const int act = int(ldims[2] >> kActShift) & 3;
  TORCH_CHECK(act <= 2 && (ldims[2] & ((int64_t(1) << kActShift) - 1)) == 0,
              "topg::DecodePlan: ", n, "dense MLP flags ", ldims[2],
              " expected only an activation (bits 2-3: 0..2)");
  y.act = moe::Act(act);
  y.wg = lin(11), y.wu = lin(12), y.wd = lin(13);
  if (I_ == 0) I_ = y.wg.t.size(0);
  expect(y.wg, n + "wg", I_, H_);
  expect(y.wu, n + "wu", I_, H_);
  expect(y.wd, n + "wd", H_, I_);
  kmax_ = std::max(kmax_, I_);
}

void DecodePlan::bind_moe(Layer& y, const std::string& n, const at::Tensor* w,
                          const std::vector<const quant::Format*>& fmt, const std::vector<bool>& a8,
                          size_t o, int64_t top_k, int64_t flags) {
  MoeLayer& m = y.m;
  y.moe = any_moe_ = true;
  const at::Tensor &router = w[14], &gu = w[15], &dn = w[16];
  TORCH_CHECK(router.dim() == 2 && gu.dim() == 3 && dn.dim() == 3, "topg::DecodePlan: ", n,
              "router, experts' gate_up, down expected 2-D, 3-D, 3-D, got ", router.sizes(), ", ",
              gu.sizes(), ", ", dn.sizes());
  m.E = router.size(0), m.k = top_k, m.I = gu.size(1) / 2;
  TORCH_CHECK(top_k <= m.E && m.I >= 1, "topg::DecodePlan: ", n, "top_k ", top_k, " of ", m.E,
              " experts, intermediate size ", m.I);
  const int act = int(flags >> kActShift) & 3;
  TORCH_CHECK(act <= 2, "topg::DecodePlan: ", n, "unknown experts activation ", act);
  m.renorm = flags & kRenormalize, m.round_w = flags & kRoundWeights, m.act = moe::Act(act);
  m.router = Lin{router, nullptr};
  expect(m.router, n + "router", m.E, H_);
  m.fgu = fmt[o + 15], m.fd = fmt[o + 16], m.gu = gu, m.dn = dn;
  TORCH_CHECK(!m.fgu == !m.fd && a8[o + 15] == a8[o + 16], "topg::DecodePlan: ", n,
              "experts' gate_up and down expected both packed or both not (and the same ",
              "int8 activations)");
  m.a8 = a8[o + 15];
  if (m.fgu) {
    TORCH_CHECK(quant::pads(*m.fgu) || H_ % m.fgu->block == 0, "topg::DecodePlan: ", n,
                "experts: ", H_, " inputs is not a multiple of the format's block");
    TORCH_CHECK(quant::pads(*m.fd) || m.I % m.fd->block == 0, "topg::DecodePlan: ", n,
                "experts: ", m.I, " inputs is not a multiple of the down format's block");
    expect(gu, n + "experts_gate_up", {m.E, 2 * m.I, m.fgu->row_bytes(H_)}, at::kByte);
    expect(dn, n + "experts_down", {m.E, H_, m.fd->row_bytes(m.I)}, at::kByte);
  } else {
    expect(gu, n + "experts_gate_up", {m.E, 2 * m.I, H_});
    expect(dn, n + "experts_down", {m.E, H_, m.I});
  }
  m.gu_p = gu.const_data_ptr(), m.dn_p = dn.const_data_ptr();
  m.shared = w[17].numel() > 0;
  if (m.shared) {
    const auto lin = [&](int f) { return Lin{w[f], fmt[o + size_t(f)], a8[o + size_t(f)]}; };
    m.sg = lin(17), m.su = lin(18), m.sd = lin(19), m.sgate = lin(20);
    m.Is = m.sg.t.size(0);
    expect(m.sg, n + "shared_gate", m.Is, H_);
    expect(m.su, n + "shared_up", m.Is, H_);
    expect(m.sd, n + "shared_down", H_, m.Is);
    expect(m.sgate, n + "shared_expert_gate", 1, H_);
    kmax_ = std::max(kmax_, m.Is);
  }
}

at::Tensor DecodePlan::run(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping,
                           at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cu_seqlens_q,
                           at::Tensor logits_indices) {
  const std::string why = stale();
  TORCH_CHECK(why.empty(), "topg::DecodePlan is stale: ", why);
  const auto arg = [](const at::Tensor& t, const char* name, at::ScalarType dt, int64_t n) {
    TORCH_CHECK(t.scalar_type() == dt && t.numel() == n && t.device().is_cpu() && t.is_contiguous(),
                "topg::DecodePlan.run: ", name, " expected contiguous ", dt, " with ", n,
                " elements on cpu, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
  };
  const int64_t T = input_ids.numel(), S = seq_lens.numel();
  arg(input_ids, "input_ids", at::kLong, T);
  arg(positions, "positions", at::kLong, T);
  arg(slot_mapping, "slot_mapping", at::kLong, T);
  arg(seq_lens, "seq_lens", at::kInt, S);
  arg(cu_seqlens_q, "cu_seqlens_q", at::kInt, S + 1);
  arg(logits_indices, "logits_indices", at::kLong, logits_indices.numel());
  TORCH_CHECK(T >= 1 && S >= 1 && logits_indices.numel() >= 1, "topg::DecodePlan.run: empty step (",
              T, " tokens, ", S, " sequences, ", logits_indices.numel(), " sampled rows)");
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
    TORCH_CHECK(pos[b] >= 0 && pos[b] < positions_, "topg::DecodePlan.run: positions[", b,
                "] = ", pos[b], " outside the rotary table [0, ", positions_, ")");
    TORCH_CHECK(slots[b] >= 0 && slots[b] < num_blocks_ * bs_,
                "topg::DecodePlan.run: ", "slot_mapping[", b, "] = ", slots[b], " outside [0, ",
                num_blocks_ * bs_, ")");
  }
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(li[r] >= 0 && li[r] < T, "topg::DecodePlan.run: logits_indices[", r, "] = ", li[r],
                " outside [0, ", T, ")");
  at::Tensor logits = at::empty({R, V_}, input_ids.options().dtype(at::kFloat));
  const Step s{
      ids, pos, slots, bt, mb, row_len_.data(), li, T, R, logits.mutable_data_ptr<float>()};
  TOPG_DISPATCH_FLOAT(dtype_, "DecodePlan", T, [&] { step<T>(s); });
  return logits;
}

std::vector<double> DecodePlan::profile() const {
  std::vector<double> p(prof_, prof_ + kPhases);
  p.push_back(double(prof_steps_));
  return p;
}

void DecodePlan::reset_profile() {
  std::fill(prof_, prof_ + kPhases, 0.0);
  prof_steps_ = 0;
}

std::string DecodePlan::stale() const {
  for (const auto& b : bound_)
    if (b.t.scalar_type() != b.dtype || !b.t.is_contiguous() || b.t.const_data_ptr() != b.data)
      return b.name + " changed (dtype " + std::string(c10::toString(b.t.scalar_type())) +
             ", storage moved) since the plan was built; lower the model again";
  return "";
}

void DecodePlan::expect(const at::Tensor& t, const std::string& name, std::vector<int64_t> shape,
                        std::optional<at::ScalarType> dtype, const std::string& what) {
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
void DecodePlan::expect(Lin& w, const std::string& name, int64_t N, int64_t K) {
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

}  // namespace topg::plan

TORCH_LIBRARY_FRAGMENT(topg, m) {
  topg::team::register_fork_handler();  // at load: every later fork is seen
  m.class_<topg::plan::DecodePlan>("DecodePlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::string>, std::vector<at::Tensor>,
                       at::Tensor, std::vector<int64_t>, std::vector<double>, std::string>())
      .def("run", &topg::plan::DecodePlan::run)
      .def("profile", &topg::plan::DecodePlan::profile)
      .def("reset_profile", &topg::plan::DecodePlan::reset_profile)
      .def("stale", &topg::plan::DecodePlan::stale)
      .def("last_members", &topg::plan::DecodePlan::last_members);
}
