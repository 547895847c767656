// topg.DecodePlan (CPU): the whole decode step of a decoder as one native call, for the
// engine's steps of at most 16 tokens: decode batches (one new token a sequence) and
// speculative verify steps (k + 1 a sequence).
//
// Built once from the model's tensors (torch_topg/compile/decode_plan.py probes the model
// and lowers what this plan computes); run() then does the step without Python or the
// dispatcher: the weights, KV caches and the rotary table are bound at construction (read
// in place: in-place weight updates are seen; a replaced or converted tensor makes run()
// refuse with "stale", and the engine lowers again), buffers persist across steps, and one
// thread team (team.h) runs every op of the step, phase by phase:
//
//   per layer  1. norm (+ residual add) -> q/k/v GEMV by head -> rotary -> cache write
//                 (QK-norm over the whole projection: a second phase normalises each row,
//                 then rotary and the cache write)
//              2. paged attention, one item per (sequence, key partition), merged by
//                 whichever member finishes a sequence's last partition
//              3. o_proj GEMV
//              4. residual add + norm -> gate/up GEMV -> SiLU(gate) * up      (dense MLP)
//              5. down GEMV
//           or 4. residual add + norm -> router GEMV, shared expert's gate/up (MoE layer,
//                 decode_plan_moe.h)
//              5. top-k routing -> experts' gate/up items, shared expert's down
//              6. experts' down items (+ the shared expert, gated)
//   then       7. residual add + final norm -> LM head GEMV on the sampled rows
//
// Files: decode_plan.h (the plan's state), decode_plan.cpp (binding and checking the
// tensors, run()'s argument checks), decode_plan_step.cpp (the step), decode_plan_moe.h
// (an MoE layer's phases), plan_gemv.h (the GEMV operand).
//
// Fusions: each member keeps its own copy of the residual stream and normalises it
// itself (a few KiB; no barrier and no shared write between a GEMV's output and the
// next GEMV's input); rotary and the cache write run on each q/k/v head as soon as its
// GEMV item is done; the activation runs on each gate/up item. Every value is rounded
// where the compiled graph rounds it (each op's output in the model dtype) and every
// sum runs in the same order as the ops' kernels (the same dot-product blocks, the same
// attention partitions and merge, fused_moe's items), so the logits equal the compiled
// graph's bitwise (fp32, bf16).
#pragma once

#include <torch/custom_class.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moe_items.h"
#include "moe_kernels.h"
#include "paged_kernels.h"
#include "plan_gemv.h"
#include "quant_kernels.h"
#include "quant_ops.h"
#include "team.h"

namespace topg::plan {

// Profile phases (TOPG_PROFILE=1), in profile() order.
enum Phase : int { kQKV, kAttn, kOProj, kGateUp, kExperts, kDown, kHead, kPhases };
// Work counters of a layer: one per loop of items (a member goes from one loop to the
// next without a barrier where the loops write different outputs).
enum Loop : int {
  cQKV,
  cQKNorm,
  cAttn,
  cOProj,
  cGateUp,
  cPrep,
  cRouter,
  cSharedGate,
  cExperts,
  cSharedDown,
  cRound,
  cDown,
  kLayerCounters
};
// Weight tensors per layer: ln_in, wq, wk, wv, bq, bk, bv, q_norm, k_norm, wo, ln_post,
// wg, wu, wd (dense MLP), router, experts_gate_up, experts_down, shared_gate, shared_up,
// shared_down, shared_expert_gate (MoE layer), post_attn_norm, post_ffw_norm. Absent ones
// are empty tensors. ln_in / ln_post are the pre-norms of the attention / the MLP (absent:
// the sublayer reads the residual stream itself, OLMo 2); post_attn_norm / post_ffw_norm
// normalise a sublayer's output before it joins the residual stream (OLMo 2).
constexpr int kPerLayer = 23;
// Integers per layer in dims: window (-1: none), top_k (0: dense MLP), flags (an MoE layer's,
// below; a dense layer's: its activation in bits 2-3, moe::Act), rotary (0: the layer's q / k
// are not rotated, SmolLM3's no_rope_layers; r >= 1: rotated by table r - 1 of cos_sin,
// Gemma 3's local and global layers have one each).
constexpr int kLayerDims = 4;
// MoE flags: renormalise the top-k weights; round them to the model dtype (as transformers'
// Qwen2-MoE / Qwen3-MoE / OLMoE routers do); the experts' activation (bits 2-3, moe::Act).
constexpr int64_t kRenormalize = 1, kRoundWeights = 2, kActShift = 2;
// Tokens a step may have: topg::linear's dot path (gemm::kDotMaxRows); beyond it the
// compiled graph runs a packed GEMM, which rounds differently.
constexpr int64_t kMaxTokens = gemm::kDotMaxRows;

// An MoE layer: router [E, H] and experts ([E, 2I, H] / [E, H, I] in the model dtype, or
// packed: [E, 2I, row_bytes(H)] / [E, H, row_bytes(I)] uint8, fused_moe_q's layout),
// optionally a shared expert (Qwen2-MoE) whose output is scaled by sigmoid(x . gate).
struct MoeLayer {
  Lin router, sg, su, sd, sgate;
  at::Tensor gu, dn;
  const quant::Format *fgu = nullptr, *fd = nullptr;  // packed experts
  bool a8 = false, renorm = false, round_w = false, shared = false;
  moe::Act act = moe::Act::silu;
  int64_t E = 0, k = 0, I = 0, Is = 0;
  const void *gu_p = nullptr, *dn_p = nullptr;
};

struct Layer {
  at::Tensor ln_in, bq, bk, bv, qn, kn, ln_post, post_attn, post_ffw, kc, vc;
  Lin wq, wk, wv, wo, wg, wu, wd;
  int64_t window = -1;
  bool qk_whole = false;  // q_norm / k_norm over the whole projection (OLMoE), not per head
  bool moe = false;
  int64_t rope = 1;  // rotary table + 1 (0: q / k not rotated, SmolLM3's layers without rotary)
  moe::Act act = moe::Act::silu;  // a dense MLP's gate activation
  MoeLayer m;
};

// A norm's weight as the kernels read it: the bound tensor in T, or (norm_offset_, Gemma's
// RMSNorm: x * (1 + w) in float32, rounded once) its 1 + w in float32, made each step from
// the bound tensor so in-place updates are seen. Both null: no norm.
template <typename T>
struct NormW {
  const T* t = nullptr;
  const float* f = nullptr;
  explicit operator bool() const { return t || f; }
};

// One member's private state: its copy of the residual stream, the normalised rows, the
// A operand of the next GEMV (plan_gemv.h), kernel scratch and its copy of an MoE
// layer's routing (every member routes every token: no barrier between router and experts).
struct Member {
  std::vector<char> resid, x;
  std::vector<float> cos, sin, row;  // row: a de-quantised embedding row
  GemvInput in;
  paged::Workspace pw;
  moe::Routing route;
  std::vector<float> scores, tw;
  std::vector<int32_t> ids;
  std::vector<int64_t> hit;  // experts with rows, in expert order
  moe::QScratch qs;
};

// The attention schedule of a step for one sliding-window value: per row its first key,
// partition size, result slots, and the (row, partition) items, costliest first.
struct AttnSched {
  int64_t window = -1;
  std::vector<int64_t> lo, size, first;
  std::vector<std::pair<int64_t, int64_t>> items;
};

// A step's inputs (validated by run()).
struct Step {
  const int64_t *ids, *pos, *slots;
  const int32_t* bt;
  int64_t bt_ss;
  const int32_t* lens;  // per token: the keys its row sees (its sequence up to itself)
  const int64_t* li;
  int64_t B, R;
  float* logits;
};

class DecodePlan : public torch::CustomClassHolder {
 public:
  DecodePlan(std::vector<at::Tensor> weights, std::vector<std::string> formats,
             std::vector<at::Tensor> kv_caches, at::Tensor cos_sin, std::vector<int64_t> dims,
             std::vector<double> params, std::string cache_layout);

  at::Tensor run(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping,
                 at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cu_seqlens_q,
                 at::Tensor logits_indices);

  // Seconds per phase summed over the steps run with TOPG_PROFILE=1, then the step count.
  std::vector<double> profile() const;
  void reset_profile();
  int64_t last_members() const { return last_members_; }
  // A bound tensor converted (.to(dtype) through .data), resized or replaced in storage:
  // why, or "" while every bound tensor is as it was. run() refuses a stale plan; callers
  // ask stale() to tell that refusal from other errors (torch_topg.compile.decode_plan).
  std::string stale() const;

 private:
  void bind_layer(int64_t l, const at::Tensor* w, const std::vector<const quant::Format*>& fmt,
                  const std::vector<bool>& a8, size_t o, const int64_t* ldims);
  void bind_moe(Layer& y, const std::string& n, const at::Tensor* w,
                const std::vector<const quant::Format*>& fmt, const std::vector<bool>& a8, size_t o,
                int64_t top_k, int64_t flags);
  void expect(const at::Tensor& t, const std::string& name, std::vector<int64_t> shape,
              std::optional<at::ScalarType> dtype = std::nullopt, const std::string& what = "");
  void expect(Lin& w, const std::string& name, int64_t N, int64_t K);
  template <typename T>
  void step(const Step& s);
  // An MoE layer's phases 4-6 for member m (decode_plan_moe.h): x holds the normalised
  // rows (also loaded as m.in), delta receives the layer's MLP output.
  template <typename T>
  void moe_buffers(int64_t B);
  template <typename T, typename Sync>
  void moe_layer(const Layer& y, Member& m, team::Counter* c, const T* x, T* delta, int64_t B,
                 int me, Sync&& sync);

  struct Bound {
    at::Tensor t;
    const void* data;
    std::string name;
    at::ScalarType dtype;
  };
  Lin embed_, lm_head_;
  at::Tensor final_norm_, cos_sin_;
  int64_t tables_ = 1, positions_ = 0;  // rotary tables in cos_sin_, rows of each
  bool packed_ = false;      // some weight is packed: the A rows are also kept as padded fp32
  bool head_major_ = false;  // cache_layout "bhsd"
  bool a8_ = false;          // some weight takes int8 activations: and as int8 blocks
  bool any_moe_ = false;
  std::vector<Layer> layers_;
  std::vector<Bound> bound_;
  at::ScalarType dtype_;
  int64_t L_, H_, I_ = 0, V_, hq_, hkv_, d_, bs_, num_blocks_;
  int64_t kmax_ = 0;  // the widest GEMV input
  float eps_, scale_;
  float softcap_ = 0.f;       // attention logit softcap (0: none; Gemma 2)
  bool norm_offset_ = false;  // every norm applies 1 + w (Gemma), not w
  std::vector<float> unit_;   // the 1 + w of every norm this step (norm_offset_)
  // Granite's multipliers: the embedding rows', each sublayer output's before the
  // residual add, and the divisor of the logits (1: none; each a rounded op in the graph).
  float embed_mult_ = 1.f, resid_mult_ = 1.f, logits_div_ = 1.f;
  // Shared buffers of a step (bytes; typed in step<T>), persistent across steps.
  std::vector<char> q_, k_, v_, attn_, delta_, gu_, act_;
  std::vector<float> res_;
  // MoE layers' shared buffers: router logits and the shared expert's gate (model dtype),
  // expert inputs (fp32 in the dot layout, or fused_moe_q's rows), h, the fp32 sums.
  std::vector<char> logits_, sgate_, sdown_;
  std::vector<float> x32_, h_, out32_, h8d_, h8s_;
  std::vector<int8_t> h8q_;
  std::vector<int64_t> ident_;
  quant::Rows xr_;
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

// Weight rows per GEMV work item (rows of row_bytes each): ~256 KiB. Measured (SmolLM2 fp32, batch
// 1, 2 threads, ms per step, 3 alternating rounds): 128 KiB 22.2-24.2, 256 KiB 21.0-21.7, 512 KiB
// 21.3-23.3; one static range per member 20.4-21.3 (no better within the noise, and it
// cannot rebalance when a member is descheduled on a shared machine).
inline int64_t rows_per_item(int64_t row_bytes) {
  return std::max<int64_t>(8, (int64_t(1) << 18) / std::max<int64_t>(row_bytes, 1) / 8 * 8);
}
// The same for weight w: for a packed weight with int8 activations a multiple of 32, the
// integer GEMM's strip (gemm_q8_vnni.h), so that no item ends in a part-empty strip.
inline int64_t rows_per_item(const Lin& w, int64_t row_bytes) {
  const int64_t n = rows_per_item(row_bytes);
  return w.f && w.a8 ? std::max<int64_t>(32, n / 32 * 32) : n;
}

}  // namespace topg::plan
