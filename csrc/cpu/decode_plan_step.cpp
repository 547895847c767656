// topg.DecodePlan's step (decode_plan.h): every layer's phases, run by one thread team.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "activation_kernels.h"
#include "decode_plan.h"
#include "decode_plan_moe.h"
#include "dispatch.h"
#include "gemm_kernels.h"
#include "norm_kernels.h"
#include "paged_kernels.h"
#include "rotary_kernels.h"
#include "team.h"

namespace topg::plan {

template <typename T>
void DecodePlan::step(const Step& s) {
  const int64_t B = s.B, R = s.R, H = H_, I = I_, V = V_, hq = hq_, hkv = hkv_, d = d_;
  const int64_t qd = hq * d, kd = hkv * d, rs = paged::part_stride(d);
  const int want = int(std::max<int64_t>(1, at::get_num_threads()));
  const auto sz = [](std::vector<char>& v, int64_t n) { v.resize(size_t(n * sizeof(T))); };
  sz(q_, B * qd), sz(k_, B * kd), sz(v_, B * kd), sz(attn_, B * qd), sz(delta_, B * H);
  int64_t Imax = I;  // the widest gate/up: a dense MLP's or a shared expert's
  for (const Layer& y : layers_) Imax = std::max(Imax, y.m.Is);
  sz(gu_, B * 2 * Imax), sz(act_, B * Imax);
  if (any_moe_) moe_buffers<T>(B);
  const int64_t kmax = kmax_;
  if (int64_t(members_.size()) < want) members_.resize(size_t(want));
  for (Member& m : members_) {
    sz(m.resid, B * H), sz(m.x, B * H);
    constexpr bool is_bf16 = std::is_same_v<T, bf16>;
    m.in.fit(std::max(B, R), kmax, packed_, a8_, is_bf16 && gemm::use_bf16dp(),
             is_bf16 && gemm::amx::enabled());
    m.cos.resize(size_t(tables_ * B * d)), m.sin.resize(size_t(tables_ * B * d));
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
  for (int64_t i = 0; i < kLayerCounters * L_ + 1; ++i) counters_[i].next.store(0);
  // Every norm's weight as the kernels read it: [final, then per layer ln_in, ln_post,
  // post_attn, post_ffw, q_norm, k_norm]. Gemma's norms (norm_offset_) apply 1 + w in
  // float32, as transformers' (x * (1 + w.float())).type_as(x) and the graph's rms_norm with
  // that float32 weight: made here from the bound tensors, each step.
  std::vector<NormW<T>> nw(size_t(1 + 6 * L_));
  {
    std::vector<const at::Tensor*> ts{&final_norm_};
    for (const Layer& y : layers_)
      ts.insert(ts.end(), {&y.ln_in, &y.ln_post, &y.post_attn, &y.post_ffw, &y.qn, &y.kn});
    int64_t total = 0;
    for (const at::Tensor* t : ts) total += t->numel();
    if (norm_offset_) unit_.resize(size_t(total));
    int64_t at = 0;
    for (size_t i = 0; i < ts.size(); ++i) {
      const at::Tensor& t = *ts[i];
      if (!t.numel()) continue;
      if (!norm_offset_) {
        nw[i].t = cptr<T>(t);
        continue;
      }
      const T* w = cptr<T>(t);
      for (int64_t j = 0; j < t.numel(); ++j) unit_[size_t(at + j)] = 1.f + to_float(w[j]);
      nw[i].f = unit_.data() + at;
      at += t.numel();
    }
  }

  T* q = reinterpret_cast<T*>(q_.data());
  T* kb = reinterpret_cast<T*>(k_.data());
  T* vb = reinterpret_cast<T*>(v_.data());
  T* attn = reinterpret_cast<T*>(attn_.data());
  T* delta = reinterpret_cast<T*>(delta_.data());
  T* gu = reinterpret_cast<T*>(gu_.data());
  T* act = reinterpret_cast<T*>(act_.data());
  const bool cs32 = cos_sin_.scalar_type() == at::kFloat;  // a float32 rotary table
  const int64_t cs_table = positions_ * d;                 // elements of one table
  const T* cs = cs32 ? nullptr : cptr<T>(cos_sin_);
  const float* cs_f = cs32 ? cptr<float>(cos_sin_) : nullptr;
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
    // rows [0, rows) of x (row stride xs, n wide) normalised by w into out (stride os)
    const auto rms = [&](const T* xr, int64_t xs, NormW<T> w, T* out, int64_t os, int64_t n,
                         int64_t rows) {
      if (w.f)
        norm::rms_norm_rows(xr, xs, w.f, out, os, n, eps_, 0, rows);
      else
        norm::rms_norm_rows(xr, xs, w.t, out, os, n, eps_, 0, rows);
    };

    for (int64_t b = 0; b < B; ++b) {
      if (embed_.f) {  // embedding_q's rows: de-quantised, rounded once to T
        float* row = m.row.data();
        quant::dequant_row(*embed_.f, cptr<uint8_t>(embed_.t) + s.ids[b] * embed_.rb, H, row);
        for (int64_t i = 0; i < H; ++i) resid[b * H + i] = from_float<T>(row[i]);
      } else {
        std::memcpy(resid + b * H, cptr<T>(embed_.t) + s.ids[b] * H, size_t(H) * sizeof(T));
      }
      if (embed_mult_ != 1.f)  // Granite: embed_tokens(ids) * embedding_multiplier
        for (int64_t i = 0; i < H; ++i)
          resid[b * H + i] = from_float<T>(to_float(resid[b * H + i]) * embed_mult_);
      // each row's cos / sin per table, once a step (positions are the same in every layer)
      for (int64_t tb = 0; tb < tables_; ++tb) {
        const int64_t o = tb * cs_table + s.pos[b] * d, to = (tb * B + b) * d;
        if (cs32)
          rotary::load_cos_sin(cs_f + o, d, true, &m.cos[to], &m.sin[to]);
        else
          rotary::load_cos_sin(cs + o, d, true, &m.cos[to], &m.sin[to]);
      }
    }
    // A sublayer's output (delta) joins the residual stream, then x is what the next
    // sublayer reads: delta's post-norm (OLMo 2), times the residual multiplier (Granite),
    // added to the stream, and the stream's pre-norm (absent: the stream itself). Each
    // step is an op of the graph, rounded to T as it rounds it (the add and the pre-norm
    // its fused_add_rms_norm).
    const auto join = [&](NormW<T> post, NormW<T> pre) {
      if (post)
        rms(delta, H, post, x, H, H, B);
      else
        std::memcpy(x, delta, size_t(B * H) * sizeof(T));
      if (resid_mult_ != 1.f)
        for (int64_t i = 0; i < B * H; ++i) x[i] = from_float<T>(to_float(x[i]) * resid_mult_);
      if (pre.f) {
        norm::fused_add_rms_norm_rows(x, resid, pre.f, H, eps_, 0, B);
        return;
      }
      if (pre.t) {
        norm::fused_add_rms_norm_rows(x, resid, pre.t, H, eps_, 0, B);
        return;
      }
      for (int64_t b = 0; b < B; ++b) norm::add_row(x + b * H, resid + b * H, H);
      std::memcpy(x, resid, size_t(B * H) * sizeof(T));
    };
    // 3. / 5. out[:, rows of w] = A . w^T for a projection to H outputs (o, down).
    const auto project = [&](team::Counter& c, const Lin& w, int64_t K) {
      const int64_t step = rows_per_item(w, w.rb);
      share(c, gemm::ceil_div(H, 8), step / 8, [&](int64_t u0, int64_t u1) {
        gemv(w, K, nullptr, B, u0 * 8, std::min(H, u1 * 8), delta, H);
      });
    };
    for (int64_t l = 0; l < L_; ++l) {
      const Layer& y = layers_[l];
      const NormW<T>* yn = &nw[size_t(1 + 6 * l)];  // ln_in, ln_post, post_attn, post_ffw, qn, kn
      const int64_t rt = std::max<int64_t>(y.rope - 1, 0) * B;  // the layer's rotary table rows
      const AttnSched& as = scheds_[size_t(sched_of[l])];
      team::Counter* c = &counters_[kLayerCounters * l];
      // 1. (residual add +) norm, q/k/v by head, rotary, cache write.
      if (l > 0) {
        join(nw[size_t(1 + 6 * (l - 1) + 3)], yn[0]);
      } else if (yn[0]) {
        rms(resid, H, yn[0], x, H, H, B);
      } else {
        std::memcpy(x, resid, size_t(B * H) * sizeof(T));
      }
      load_a(x, H, B, nullptr);
      if (me == 0)
        for (int64_t b = 0; b < B; ++b)
          pending_[b].store(int32_t(as.first[b + 1] - as.first[b]), std::memory_order_relaxed);
      share(c[cQKV], hq + 2 * hkv, 1, [&](int64_t h0, int64_t h1) {
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
              if (part < 2 && y.qk_whole) continue;       // after the whole row's norm, below
              const NormW<T> hn = yn[part == 0 ? 4 : 5];  // per-head RMSNorm (Qwen3, Gemma 3)
              if (part < 2 && hn) rms(head, d, hn, head, d, d, 1);
              if (part < 2 && y.rope)
                rotary::rotate_neox(head, &m.cos[(rt + b) * d], &m.sin[(rt + b) * d], d / 2);
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
      if (y.qk_whole) {
        // QK-norm over the whole projection (OLMoE): each q / k row once all its heads
        // are done, then rotary and the cache write per head.
        bar.wait();
        items(c[cQKNorm], 2 * B, [&](int64_t i) {
          const int64_t b = i / 2, part = i % 2, heads = part == 0 ? hq : hkv;
          T* row = (part == 0 ? q + b * qd : kb + b * kd);
          rms(row, heads * d, yn[part == 0 ? 4 : 5], row, heads * d, heads * d, 1);
          for (int64_t h = 0; h < heads; ++h) {
            if (y.rope)
              rotary::rotate_neox(row + h * d, &m.cos[(rt + b) * d], &m.sin[(rt + b) * d], d / 2);
            if (part == 1) {
              const int64_t slot = s.slots[b];
              const int64_t at =
                  head_major_ ? ((slot / bs_) * hkv + h) * bs_ + slot % bs_ : slot * hkv + h;
              std::memcpy(ptr<T>(y.kc) + at * d, row + h * d, size_t(d) * sizeof(T));
            }
          }
        });
      }
      sync(kQKV);
      // 2. Paged attention: (row, partition) items; a row is merged by the member that
      // finishes its last partition.
      {
        paged::PagedArgs<T, T> a{};
        a.q = q, a.q_ss = qd, a.q_sh = d;
        a.kc = cptr<T>(y.kc), a.vc = cptr<T>(y.vc);
        a.bt = s.bt, a.bt_ss = s.bt_ss, a.row_seq = row_seq_.data();
        a.hq = hq, a.hkv = hkv, a.d = d, a.block_size = bs_;
        a.scale = scale_, a.softcap = softcap_, a.window = y.window, a.head_major = head_major_;
        items(c[cAttn], int64_t(as.items.size()), [&](int64_t i) {
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
      project(c[cOProj], y.wo, qd);
      sync(kOProj);
      // 4. Residual add + norm, gate/up, SiLU(gate) * up.
      join(yn[2], yn[1]);
      load_a(x, H, B, nullptr);
      if (y.moe) {  // 4. - 6. of an MoE layer (decode_plan_moe.h)
        moe_layer<T>(y, m, c, x, delta, B, me, sync);
        continue;
      }
      {
        const int64_t step = rows_per_item(y.wg, y.wg.rb + y.wu.rb);
        share(c[cGateUp], gemm::ceil_div(I, 8), step / 8, [&](int64_t u0, int64_t u1) {
          const int64_t n0 = u0 * 8, n1 = std::min(I, u1 * 8);
          // gate rows, then up rows: the kernel topg::linear runs on the fused [gate; up]
          // weight of the compiled graph, so each row's sum is the same.
          gemv(y.wg, H, nullptr, B, n0, n1, gu, 2 * I);
          gemv(y.wu, H, nullptr, B, n0, n1, gu + I, 2 * I);
          for (int64_t b = 0; b < B; ++b) {
            if (y.act == moe::Act::gelu_tanh)  // Gemma's gelu_pytorch_tanh: gelu_and_mul's kernel
              act::gated_span<act::GeluTanh>(gu, 2 * I, act, I, b, n0, n1);
            else if (y.act == moe::Act::gelu)
              act::gated_span<act::GeluErf>(gu, 2 * I, act, I, b, n0, n1);
            else
              act::gated_span<act::Silu>(gu, 2 * I, act, I, b, n0, n1);
          }
        });
      }
      sync(kGateUp);
      // 5. down.
      load_a(act, I, B, nullptr);
      project(c[cDown], y.wd, I);
      sync(kDown);
    }
    // 6. Residual add + final norm, LM head on the sampled rows.
    join(nw[size_t(1 + 6 * (L_ - 1) + 3)], nw[0]);
    load_a(x, H, R, s.li);
    const int64_t step = rows_per_item(lm_head_, lm_head_.rb);
    const float div = logits_div_;
    share(counters_[kLayerCounters * L_], gemm::ceil_div(V, 8), step / 8,
          [&](int64_t u0, int64_t u1) {
            dot(lm_head_, H, R, u0 * 8, std::min(V, u1 * 8), [&](int64_t r, int64_t n, float v) {
              const float t = to_float(from_float<T>(v));  // the LM head's output in T
              // Granite: logits / logits_scaling, one more op rounded to T
              s.logits[r * V + n] = div == 1.f ? t : to_float(from_float<T>(t / div));
            });
          });
    sync(kHead);
  });
  if (prof) ++prof_steps_;
}

template void DecodePlan::step<float>(const Step&);
template void DecodePlan::step<bf16>(const Step&);
template void DecodePlan::step<fp16>(const Step&);

}  // namespace topg::plan
