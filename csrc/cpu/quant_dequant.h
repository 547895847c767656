// Exact de-quantisation of the packed formats (torch_topg/formats.py): a block, or a row,
// into float32 with the reference's float operations in its order (embedding_q, the
// de-quantise-and-mm GEMM path, and the generic tail of quant_kernels.h's dot products).
// Torch-free, scalar.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/quant_formats.h"
#include "vec.h"

namespace topg::quant {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return to_float(fp16{h});
}

// --- exact de-quantisation (embedding_q, the GEMM path): the reference's float ops ----
// 4-bit runs: byte i holds element i (low nibble) and element n + i (high nibble).
inline void nibbles(const uint8_t* q, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = q[i] & 0x0F;
    out[n + i] = q[i] >> 4;
  }
}

// A q4_k / q5_k super-block's 12 bytes of 6-bit scales and minimums s as sc[8], mn[8]:
// for j < 4, sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63, sc[j + 4] = (s[j + 8] & 15) |
// (s[j] >> 6) << 4, mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4. Four bytes at a
// time on 32-bit words (the bits a shift moves in from the next byte are masked off): ten
// integer ops instead of a loop of byte ops on every super-block of the GEMV.
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "byte j of a word is s[j]");
  uint32_t w0, w1, w2;
  std::memcpy(&w0, s, 4), std::memcpy(&w1, s + 4, 4), std::memcpy(&w2, s + 8, 4);
  constexpr uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, bits45 = 0x30303030;
  const uint32_t sc_lo = w0 & low6, mn_lo = w1 & low6;
  const uint32_t sc_hi = (w2 & low4) | ((w0 >> 2) & bits45);
  const uint32_t mn_hi = ((w2 >> 4) & low4) | ((w1 >> 2) & bits45);
  std::memcpy(sc, &sc_lo, 4), std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &mn_lo, 4), std::memcpy(mn + 4, &mn_hi, 4);
}

// One block (or, for int8, the whole row of k weights) into out.
inline void dequant_block(const Format& f, const uint8_t* b, int64_t k, float* out) {
  uint8_t q[256];
  switch (f.fmt) {
    case Fmt::q8_0: {
      const float d = half_at(b);
      for (int i = 0; i < 32; ++i) out[i] = float(int8_t(b[2 + i])) * d;
      break;
    }
    case Fmt::q4_0: {
      const float d = half_at(b);
      nibbles(b + 2, 16, q);
      for (int i = 0; i < 32; ++i) out[i] = d * float(int(q[i]) - 8);
      break;
    }
    case Fmt::q5_0:
    case Fmt::q5_1: {  // qh: bit i of the little-endian word is element i's 5th bit
      const bool one = f.fmt == Fmt::q5_1;
      const float d = half_at(b), m = one ? half_at(b + 2) : 0.f;
      const uint8_t* qh = b + (one ? 4 : 2);
      nibbles(qh + 4, 16, q);
      for (int i = 0; i < 32; ++i) {
        const int v = q[i] | (((qh[i / 8] >> (i % 8)) & 1) << 4);
        const float t = one ? d * float(v) : d * float(v - 16);
        out[i] = one ? t + m : t;
      }
      break;
    }
    case Fmt::q4_1:
    case Fmt::int4: {
      const float d = half_at(b), m = half_at(b + 2);
      const int64_t g = f.block;
      nibbles(b + 4, g / 2, q);
      for (int64_t i = 0; i < g; ++i) {
        const float t = d * float(q[i]);
        out[i] = t + m;
      }
      break;
    }
    case Fmt::q4_k: {
      const float d = half_at(b), dmin = half_at(b + 2);
      uint8_t sc[8], mn[8];
      k_scales(b + 4, sc, mn);
      for (int c = 0; c < 4; ++c) nibbles(b + 16 + 32 * c, 32, q + 64 * c);
      for (int j = 0; j < 8; ++j) {
        const float s = d * float(sc[j]), o = dmin * float(mn[j]);
        for (int i = 0; i < 32; ++i) {
          const float t = s * float(q[32 * j + i]);
          out[32 * j + i] = t - o;
        }
      }
      break;
    }
    case Fmt::q5_k: {  // q4_k's with a 5th bit per weight: bit j of qh[i] for sub-block j
      const float d = half_at(b), dmin = half_at(b + 2);
      uint8_t sc[8], mn[8];
      k_scales(b + 4, sc, mn);
      for (int c = 0; c < 4; ++c) nibbles(b + 48 + 32 * c, 32, q + 64 * c);
      for (int j = 0; j < 8; ++j) {
        const float s = d * float(sc[j]), o = dmin * float(mn[j]);
        for (int i = 0; i < 32; ++i) {
          const int v = q[32 * j + i] | (((b[16 + i] >> j) & 1) << 4);
          const float t = s * float(v);
          out[32 * j + i] = t - o;
        }
      }
      break;
    }
    case Fmt::q6_k: {
      const float d = half_at(b + 208);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        for (int i = 0; i < 32; ++i) {
          const int v[4] = {(ql[i] & 0x0F) | (((qh[i] >> 0) & 3) << 4),
                            (ql[32 + i] & 0x0F) | (((qh[i] >> 2) & 3) << 4),
                            (ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4),
                            (ql[32 + i] >> 4) | (((qh[i] >> 6) & 3) << 4)};
          for (int r = 0; r < 4; ++r) {
            const int e = 128 * h + 32 * r + i;
            out[e] = (d * float(int8_t(b[192 + e / 16]))) * float(v[r] - 32);
          }
        }
      }
      break;
    }
    case Fmt::int8: {
      float s;
      std::memcpy(&s, b, 4);
      for (int64_t i = 0; i < k; ++i) out[i] = float(int8_t(b[4 + i])) * s;
      break;
    }
  }
}

// A row of k weights into out[f.padded(k)] (the padding: zeros for int8; for int4 the
// padded group's values, which the zero-padded activations cancel).
inline void dequant_row(const Format& f, const uint8_t* row, int64_t k, float* out) {
  if (f.block == 0) {
    dequant_block(f, row, k, out);
    for (int64_t i = k; i < f.padded(k); ++i) out[i] = 0.f;
    return;
  }
  for (int64_t b = 0; b < f.blocks(k); ++b)
    dequant_block(f, row + b * f.block_bytes, f.block, out + b * f.block);
}

}  // namespace topg::quant
