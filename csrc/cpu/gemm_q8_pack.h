// The weight side of the int8-activation GEMM (gemm_q8_vnni.h): a strip of packed weight
// rows unpacked into the GEMM's lanes layout, once per work item, into a per-thread scratch.
//
// The layout of one group of 16 weight rows: for every 4 codes along K, 64 bytes holding
// those 4 unsigned codes u of each of the 16 rows (one zmm, one int32 lane a row), and per
// scale block of SB codes along K the 16 rows' (dw, cw) as two 16-lane vectors, with the
// weights w = dw * u + cw (gemm_q8_vnni.h's header comment):
//   q8_0, int8        u = code + 128, cw = -128 dw                          (SB = 32)
//   q4_0, q5_0        u = code, cw = -8 dw, -16 dw                          (SB = 32)
//   q4_1, q5_1, int4  u = code, cw = the block's minimum                    (SB = 32)
//   q4_k, q5_k        u = code, dw = d sc_j, cw = -dmin m_j per 32-run j    (SB = 32)
//   q6_k              u = code (0..63), dw = d sc_i, cw = -32 dw per 16     (SB = 16)
// The K-quants' 6-bit scales (q4_k, q5_k) are decoded once per super-block.
//
// Two ways to pack. q4_0, q4_1 / int4 with groups of 32, q8_0, q4_k and q6_k
// (gemm_pack_fast): the packed bytes of the 16 rows are transposed first (t16) and the
// codes unpacked in the transposed domain, the headers and K-quant scales read with one
// gather per field. The other formats, in chunks of 256 codes: the 16 rows' codes of a
// chunk are unpacked with the GEMV's vector helpers (quant_kernels.h) into 16 rows of
// bytes (4 KiB, L1), then each 64 codes of the 16 rows (16 rows x 16 dwords) are
// transposed in registers (4 rounds of 16 shuffles) into 16 of the layout's vectors.
// (Row by row for every format, the pack made the GEMM at 4 rows 2.2 ms against the
// GEMV's 1.4; the transposed-bytes form 1.05: docs/cpu-kernels.md.)
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "gemv_avx512.h"
#include "quant_act.h"

namespace topg::quant {

// Codes per scale block: 16 for q6_k (a scale per 16 weights), 32 for the other formats.
inline int64_t gemm_scale_block(Fmt f) { return f == Fmt::q6_k ? 16 : 32; }

// The formats whose constant term is a fixed multiple of the scale, cw = OFF * dw (the
// GEMM adds OFF * sum(q) to the integer sums instead of an FMA per block); 0 for those
// with a minimum per block (q4_1, q5_1, int4, q4_k, q5_k).
inline int gemm_offset(Fmt f) {
  switch (f) {
    case Fmt::q4_0:
      return -8;
    case Fmt::q5_0:
      return -16;
    case Fmt::q6_k:
      return -32;
    case Fmt::q8_0:
    case Fmt::int8:
      return -128;
    default:
      return 0;
  }
}

// A (scale-block length, offset) pair as a type: the GEMM's tile instantiations.
template <int SB, int OFF>
struct SbOff {
  static constexpr int first = SB, second = OFF;
};

// 64-byte aligned scratch that only grows (one per thread: the packed strip, the
// activations' 16-code sums, the strip's sums).
struct AlignedBuf {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> p;
  size_t size = 0;
  template <typename T>
  T* fit(int64_t n) {
    const size_t bytes = (size_t(n) * sizeof(T) + 63) / 64 * 64;
    if (bytes > size) {
      p.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
      TORCH_CHECK(p, "linear_q: could not allocate ", bytes, " bytes of GEMM scratch");
      size = bytes;
    }
    return reinterpret_cast<T*>(p.get());
  }
};

// The activations of the GEMM (quant::quantize_act's output): int8 codes (row r at
// q + r * kp), and per block of 32 the scale xd and the code sum xsum (at r * nb). Row m
// of the product is row idx[m] of these (idx null: row m). xs16: q6_k's code sums per
// 16 (gemm_q8_sums16; row m at m * padded(K) / 16), set by the entry points.
struct VnniActs {
  const int8_t* q;
  const float *xd, *xsum;
  int64_t kp, nb;
  const int64_t* idx = nullptr;
  const float* xs16 = nullptr;
  int64_t row(int64_t m) const { return idx ? idx[m] : m; }
};

// One thread's GEMM scratch (gemm_q8_vnni.h).
struct GemmQ8Scratch {
  AlignedBuf codes, scales, sums16, out;
};

#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
// Block b (32 codes along K) of a packed row of k weights in a 32-block format: its
// unsigned codes u and its (dw, cw). Codes past k (the int8 format's last block) are
// 128, the zero weight; their activations are zero anyway.
inline void gemm_block(const Format& f, const uint8_t* row, int64_t k, int64_t b, uint8_t* u,
                       float& dw, float& cw) {
  switch (f.fmt) {
    case Fmt::q8_0: {
      const uint8_t* p = row + 34 * b;
      dw = half_at(p), cw = -128.f * dw;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u),
                          _mm256_xor_si256(load32(p + 2), _mm256_set1_epi8(char(0x80))));
      return;
    }
    case Fmt::q4_0: {
      const uint8_t* p = row + 18 * b;
      dw = half_at(p), cw = -8.f * dw;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack16(p + 2));
      return;
    }
    case Fmt::q4_1: {
      const uint8_t* p = row + 20 * b;
      dw = half_at(p), cw = half_at(p + 2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack16(p + 4));
      return;
    }
    case Fmt::q5_0: {
      const uint8_t* p = row + 22 * b;
      dw = half_at(p), cw = -16.f * dw;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack_q5(p + 2, p + 6));
      return;
    }
    case Fmt::q5_1: {
      const uint8_t* p = row + 24 * b;
      dw = half_at(p), cw = half_at(p + 2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack_q5(p + 4, p + 8));
      return;
    }
    case Fmt::int4: {
      const int64_t sub = f.block / 32, c = b % sub;  // the block's place in its group
      const uint8_t* p = row + f.block_bytes * (b / sub);
      dw = half_at(p), cw = half_at(p + 2);
      if (sub == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack16(p + 4));
        return;
      }
      // Larger groups: runs of 32 bytes, the low nibbles block c, the high ones c + sub / 2.
      const int64_t half = sub / 2;
      const __m256i run = load32(p + 4 + 32 * (c % half));
      const __m256i v = c < half ? run : _mm256_srli_epi16(run, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u),
                          _mm256_and_si256(v, _mm256_set1_epi8(0x0F)));
      return;
    }
    case Fmt::int8: {
      std::memcpy(&dw, row, 4);
      cw = -128.f * dw;
      const int64_t left = k - 32 * b;
      if (left >= 32) {
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(u),
            _mm256_xor_si256(load32(row + 4 + 32 * b), _mm256_set1_epi8(char(0x80))));
        return;
      }
      for (int64_t i = 0; i < 32; ++i) u[i] = i < left ? uint8_t(row[4 + 32 * b + i] ^ 0x80) : 0x80;
      return;
    }
    default:
      TORCH_CHECK(false, "linear_q: no int8 GEMM for this format");  // callers check int8_gemm
  }
}

// The 256 unsigned codes of the K-quant super-block at p (q4_k / q5_k: 144 / 176 bytes,
// q6_k: 210) into u.
inline void gemm_super_block_codes(Fmt fmt, const uint8_t* p, uint8_t* u) {
  auto store = [&](int64_t at, __m256i v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + at), v);
  };
  if (fmt == Fmt::q6_k) {
    for (int h = 0; h < 2; ++h) {
      __m256i v[4];
      q6k_runs(p + 64 * h, p + 128 + 32 * h, v);
      for (int q = 0; q < 4; ++q) store(128 * h + 32 * q, v[q]);
    }
    return;
  }
  for (int c = 0; c < 4; ++c) {
    __m256i lo, hi;
    if (fmt == Fmt::q5_k)
      k45_runs<Fmt::q5_k>(p, c, lo, hi);
    else
      k45_runs<Fmt::q4_k>(p, c, lo, hi);
    store(64 * c, lo), store(64 * c + 32, hi);
  }
}

// Super-block s of a q4_k / q5_k / q6_k row: its 256 codes u and the (dw, cw) of its
// scale blocks (8 of 32 codes, q6_k 16 of 16) at dw[j * ld], cw[j * ld].
inline void gemm_super_block(Fmt fmt, const uint8_t* row, int64_t s, uint8_t* u, float* dw,
                             float* cw, int64_t ld = 16) {
  if (fmt == Fmt::q6_k) {
    const uint8_t* p = row + 210 * s;
    const float d = half_at(p + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int i = 0; i < 16; ++i) dw[ld * i] = d * float(sc[i]), cw[ld * i] = -32.f * dw[ld * i];
    return gemm_super_block_codes(fmt, p, u);
  }
  const uint8_t* p = row + (fmt == Fmt::q5_k ? 176 : 144) * s;
  const float d = half_at(p), dmin = half_at(p + 2);
  uint8_t sc[8], mn[8];
  k_scales(p + 4, sc, mn);
  for (int j = 0; j < 8; ++j) dw[ld * j] = d * float(sc[j]), cw[ld * j] = -(dmin * float(mn[j]));
  gemm_super_block_codes(fmt, p, u);
}

// 16 rows of 16 dwords (row r at u + r * ld) transposed: out[16 j + r] = dword j of row r.
TOPG_TARGET_VNNI inline void transpose16x16(const uint8_t* u, int64_t ld, uint32_t* out) {
  __m512i z[16], t[16];
  for (int r = 0; r < 16; ++r) z[r] = _mm512_loadu_si512(u + r * ld);
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // z[4 i + j]: lane L holds dword 4 L + j of rows 4i..4i+3
    z[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    z[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    z[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    z[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // the 4 x 4 transposition of 128-bit lanes
    const __m512i v0 = _mm512_shuffle_i32x4(z[j], z[4 + j], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(z[j], z[4 + j], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(z[8 + j], z[12 + j], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(z[8 + j], z[12 + j], 0xEE);
    _mm512_store_si512(out + 16 * j, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_store_si512(out + 16 * (4 + j), _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_store_si512(out + 16 * (8 + j), _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_store_si512(out + 16 * (12 + j), _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// 16 bytes at offset o of each of the 16 rows rp[r], transposed: out[j] holds bytes
// [4 j, 4 j + 4) of row r in int32 lane r (rows loaded 4 to a zmm, then two rounds of
// unpacks). The codes of the formats below are byte-wise functions of their packed bytes
// (nibble masks, shifts within 16-bit pairs that the masks make byte-wise), so they are
// unpacked after this transposition, 16 rows a vector.
TOPG_TARGET_VNNI inline void t16(const uint8_t* const* rp, int64_t o, __m512i out[4]) {
  __m512i z[4];
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L: row 4 L + i
    auto at = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[r] + o)); };
    __m512i v = _mm512_castsi128_si512(at(i));
    v = _mm512_inserti32x4(v, at(4 + i), 1);
    v = _mm512_inserti32x4(v, at(8 + i), 2);
    z[i] = _mm512_inserti32x4(v, at(12 + i), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Helpers of gemm_pack_fast (functions, not lambdas: a lambda does not take its
// enclosing function's target attribute).
namespace pk {
TOPG_TARGET_VNNI inline __m512i lo(__m512i v) {
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}
TOPG_TARGET_VNNI inline __m512i hi(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
// the fp16 at bits [shift, shift + 16) of each lane, as fp32
TOPG_TARGET_VNNI inline __m512 f16(__m512i h, int shift) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, shift)));
}
TOPG_TARGET_VNNI inline __m512i byte(__m512i v, int j) { return _mm512_srli_epi32(v, 8 * j); }
TOPG_TARGET_VNNI inline __m512 i2f(__m512i v) { return _mm512_cvtepi32_ps(v); }
TOPG_TARGET_VNNI inline __m512i gather(__m512i vidx, const uint8_t* p) {
  return _mm512_i32gather_epi32(vidx, p, 1);
}
TOPG_TARGET_VNNI inline void put(uint32_t* codes, int64_t s, __m512i v) {
  _mm512_store_si512(codes + 16 * s, v);
}
TOPG_TARGET_VNNI inline void scales(float* dw, float* cw, int64_t b, __m512 d, __m512 c) {
  _mm512_store_ps(dw + 16 * b, d), _mm512_store_ps(cw + 16 * b, c);
}
// q6_k's code bits 4-5 from qh's bits at `shift` (a 16-bit shift, made byte-wise by the mask)
TOPG_TARGET_VNNI inline __m512i or_hi2(__m512i low, __m512i qh, int shift) {
  const __m512i v = shift > 0   ? _mm512_slli_epi16(qh, shift)
                    : shift < 0 ? _mm512_srli_epi16(qh, -shift)
                                : qh;
  return _mm512_or_si512(low, _mm512_and_si512(v, _mm512_set1_epi8(0x30)));
}
}  // namespace pk

// gemm_pack_group's vector form for q4_0, q4_1 / int4 with groups of 32, q8_0, q4_k and
// q6_k: the packed bytes transposed first (t16), the block headers and K-quant scales of
// the 16 rows read with one gather each and converted as 16 lanes. Rows past `rows` read
// row 0 (their lanes are never stored). false: another format.
TOPG_TARGET_VNNI inline bool gemm_pack_fast(const Format& f, const uint8_t* w, int64_t rb,
                                            int64_t rows, int64_t k, uint32_t* codes, float* dw,
                                            float* cw) {
  const Fmt fmt = f.fmt;
  const bool nib = fmt == Fmt::q4_0 || fmt == Fmt::q4_1 || (fmt == Fmt::int4 && f.block == 32);
  if (!nib && fmt != Fmt::q8_0 && fmt != Fmt::q4_k && fmt != Fmt::q6_k) return false;
  const uint8_t* rp[16];
  alignas(64) int32_t off[16];
  for (int r = 0; r < 16; ++r) {
    const int64_t row = r < rows ? r : 0;
    rp[r] = w + row * rb, off[r] = int32_t(row * rb);
  }
  const __m512i vidx = _mm512_load_si512(off);
  const int64_t kw = f.padded(k);
  __m512i t[4];
  if (nib || fmt == Fmt::q8_0) {
    const int64_t bb = f.block_bytes, co = fmt == Fmt::q4_0 || fmt == Fmt::q8_0 ? 2 : 4;
    for (int64_t b = 0; b < kw / 32; ++b) {
      const __m512i h = pk::gather(vidx, w + bb * b);
      const __m512 d = pk::f16(h, 0);
      if (fmt == Fmt::q8_0) {
        pk::scales(dw, cw, b, d, _mm512_mul_ps(d, _mm512_set1_ps(-128.f)));
        const __m512i flip = _mm512_set1_epi8(char(0x80));
        for (int half = 0; half < 2; ++half) {
          t16(rp, bb * b + co + 16 * half, t);
          for (int j = 0; j < 4; ++j)
            pk::put(codes, 8 * b + 4 * half + j, _mm512_xor_si512(t[j], flip));
        }
        continue;
      }
      pk::scales(dw, cw, b, d,
                 fmt == Fmt::q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f)) : pk::f16(h, 16));
      t16(rp, bb * b + co, t);  // byte i: code i (low nibble), code 16 + i (high)
      for (int j = 0; j < 4; ++j)
        pk::put(codes, 8 * b + j, pk::lo(t[j])), pk::put(codes, 8 * b + 4 + j, pk::hi(t[j]));
    }
    return true;
  }
  if (fmt == Fmt::q4_k) {
    for (int64_t s = 0; s < kw / 256; ++s) {
      const __m512i h = pk::gather(vidx, w + 144 * s), s0 = pk::gather(vidx, w + 144 * s + 4),
                    s1 = pk::gather(vidx, w + 144 * s + 8), s2 = pk::gather(vidx, w + 144 * s + 12);
      const __m512 d = pk::f16(h, 0), dmin = pk::f16(h, 16);
      const __m512i k63 = _mm512_set1_epi32(63), k15 = _mm512_set1_epi32(15),
                    k48 = _mm512_set1_epi32(0x30);
      for (int j = 0; j < 4; ++j) {  // quant_dequant.h's k_scales, 16 rows a lane each
        const __m512i sc = _mm512_and_si512(pk::byte(s0, j), k63);
        const __m512i mn = _mm512_and_si512(pk::byte(s1, j), k63);
        const __m512i sc4 =
            _mm512_or_si512(_mm512_and_si512(pk::byte(s2, j), k15),
                            _mm512_and_si512(_mm512_srli_epi32(pk::byte(s0, j), 2), k48));
        const __m512i mn4 =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(pk::byte(s2, j), 4), k15),
                            _mm512_and_si512(_mm512_srli_epi32(pk::byte(s1, j), 2), k48));
        pk::scales(dw, cw, 8 * s + j, _mm512_mul_ps(d, pk::i2f(sc)),
                   _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, pk::i2f(mn))));
        pk::scales(dw, cw, 8 * s + 4 + j, _mm512_mul_ps(d, pk::i2f(sc4)),
                   _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, pk::i2f(mn4))));
      }
      for (int c = 0; c < 4; ++c)  // 32 bytes: runs 2c (low nibbles) and 2c + 1 (high)
        for (int half = 0; half < 2; ++half) {
          t16(rp, 144 * s + 16 + 32 * c + 16 * half, t);
          for (int j = 0; j < 4; ++j) {
            pk::put(codes, 64 * s + 16 * c + 4 * half + j, pk::lo(t[j]));
            pk::put(codes, 64 * s + 16 * c + 8 + 4 * half + j, pk::hi(t[j]));
          }
        }
    }
    return true;
  }
  // q6_k: ql [0, 128), qh [128, 192), 16 int8 scales at 192, fp16 d at 208
  for (int64_t s = 0; s < kw / 256; ++s) {
    const __m512 d =
        pk::f16(pk::gather(vidx, w + 210 * s + 206), 16);  // no read past the super-block
    for (int i4 = 0; i4 < 4; ++i4) {
      const __m512i sc4 = pk::gather(vidx, w + 210 * s + 192 + 4 * i4);
      for (int j = 0; j < 4; ++j) {
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(sc4, 24 - 8 * j), 24);
        const __m512 dv = _mm512_mul_ps(d, pk::i2f(sc));
        pk::scales(dw, cw, 16 * s + 4 * i4 + j, dv, _mm512_mul_ps(dv, _mm512_set1_ps(-32.f)));
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int ih = 0; ih < 2; ++ih) {  // quant_kernels.h's q6k_runs, transposed
        __m512i a[4], b[4], q[4];
        t16(rp, 210 * s + 64 * h + 16 * ih, a);
        t16(rp, 210 * s + 64 * h + 32 + 16 * ih, b);
        t16(rp, 210 * s + 128 + 32 * h + 16 * ih, q);
        for (int j = 0; j < 4; ++j) {
          const int64_t g = 64 * s + 32 * h + 4 * ih + j;  // + 8 per run
          pk::put(codes, g, pk::or_hi2(pk::lo(a[j]), q[j], 4));
          pk::put(codes, g + 8, pk::or_hi2(pk::lo(b[j]), q[j], 2));
          pk::put(codes, g + 16, pk::or_hi2(pk::hi(a[j]), q[j], 0));
          pk::put(codes, g + 24, pk::or_hi2(pk::hi(b[j]), q[j], -2));
        }
      }
  }
  return true;
}

// Rows [0, rows) of the 16 packed rows at w (rb bytes apart; rows past `rows`: zero codes
// and scales) into codes [kw64 / 4][16] (uint32: 4 codes; kw64 = kw rounded up to 64) and
// dw, cw [kw / SB][16]; kw = f.padded(k).
TOPG_TARGET_VNNI inline void gemm_pack_group(const Format& f, const uint8_t* w, int64_t rb,
                                             int64_t rows, int64_t k, uint32_t* codes, float* dw,
                                             float* cw) {
  if (gemm_pack_fast(f, w, rb, rows, k, codes, dw, cw)) return;
  constexpr int64_t kChunk = 256;
  alignas(64) uint8_t u[16 * kChunk];
  const int64_t kw = f.padded(k), sb = gemm_scale_block(f.fmt);
  const bool kq = f.fmt == Fmt::q4_k || f.fmt == Fmt::q5_k || f.fmt == Fmt::q6_k;
  for (int64_t k0 = 0; k0 < kw; k0 += kChunk) {
    const int64_t len = std::min(kChunk, kw - k0), b0 = k0 / 32, nsb = len / sb;
    for (int64_t r = 0; r < 16; ++r) {
      uint8_t* ur = u + r * kChunk;
      float *d = dw + (k0 / sb) * 16 + r, *c = cw + (k0 / sb) * 16 + r;
      if (r >= rows) {
        std::memset(ur, 0, size_t(len));
        for (int64_t j = 0; j < nsb; ++j) d[16 * j] = 0.f, c[16 * j] = 0.f;
      } else if (kq) {
        gemm_super_block(f.fmt, w + r * rb, k0 / 256, ur, d, c);
      } else {
        for (int64_t b = 0; b < len / 32; ++b)
          gemm_block(f, w + r * rb, k, b0 + b, ur + 32 * b, d[16 * b], c[16 * b]);
      }
    }
    // a last chunk of 32 codes transposes 64: the extra 32 land in the padding of codes
    for (int64_t c0 = 0; c0 < len; c0 += 64)
      transpose16x16(u + c0, kChunk, codes + (k0 + c0) / 4 * 16);
  }
}
#endif

}  // namespace topg::quant
