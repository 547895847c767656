// Small SIMD layer for the CPU kernels: 8 x fp32 lanes, loads/stores from fp32,
// bf16 and fp16 storage (and loads of int8, the quantised KV cache), and the transcendental
// functions the kernels need.
//
// This header never includes torch: kernel math lives in headers that only see
// raw pointers and these types; the binding files (*.cpp) check tensors and
// dispatch. With AVX2+FMA+F16C enabled at compile time (the default build flag
// -march=x86-64-v3, see CMakeLists.txt) Vec8 is one __m256; otherwise it is a
// plain array the compiler may auto-vectorise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOPG_AVX2 1
#include <immintrin.h>
#else
#define TOPG_AVX2 0
#endif

namespace topg {

// Storage types for 16-bit floats. Arithmetic always happens in fp32.
struct bf16 {
  uint16_t x;
};
struct fp16 {
  uint16_t x;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_float(float v) { return v; }
inline float to_float(int8_t v) { return float(v); }  // int8 KV cache values
inline float to_float(bf16 v) { return bits_to_float(uint32_t(v.x) << 16); }
inline float to_float(fp16 v) {
#if TOPG_AVX2
  return _cvtsh_ss(v.x);
#else
  const uint32_t h = v.x, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      u = sign | (uint32_t(127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return bits_to_float(u);
#endif
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline bf16 from_float<bf16>(float f) {
  if (std::isnan(f)) return bf16{0x7fc0};
  const uint32_t u = float_to_bits(f);
  return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};  // round to nearest even
}
template <>
inline fp16 from_float<fp16>(float f) {
#if TOPG_AVX2
  return fp16{uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
#else
  // Round-to-nearest-even fp32 -> fp16 (handles subnormals, overflow to inf, NaN).
  const uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return fp16{uint16_t(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0))};
  if (a >= 0x477ff000u) return fp16{uint16_t(sign | 0x7c00u)};  // rounds to inf
  if (a < 0x38800000u) {                                        // subnormal or zero
    const float sub = bits_to_float(a) + 0.5f;  // 0.5 = 2^-1: aligns mantissa at 2^-24
    return fp16{uint16_t(sign | (float_to_bits(sub) - 0x3f000000u))};
  }
  const uint32_t r = a + 0xc8000fffu + ((a >> 13) & 1u);  // rebias exponent and round
  return fp16{uint16_t(sign | (r >> 13))};
#endif
}

// ---------------------------------------------------------------------------------
// Vec8: eight fp32 lanes.
// ---------------------------------------------------------------------------------
#if TOPG_AVX2

struct Vec8 {
  __m256 v;
  Vec8() = default;
  explicit Vec8(__m256 x) : v(x) {}
  explicit Vec8(float s) : v(_mm256_set1_ps(s)) {}
  static Vec8 zero() { return Vec8(_mm256_setzero_ps()); }

  static Vec8 load(const float* p) { return Vec8(_mm256_loadu_ps(p)); }
  static Vec8 load(const bf16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return Vec8(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  static Vec8 load(const fp16* p) {
    return Vec8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static Vec8 load(const int8_t* p) {  // 8 bytes, sign-extended, converted exactly
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return Vec8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const {
    const __m256i i = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  void store(fp16* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }

  friend Vec8 operator+(Vec8 a, Vec8 b) { return Vec8(_mm256_add_ps(a.v, b.v)); }
  friend Vec8 operator-(Vec8 a, Vec8 b) { return Vec8(_mm256_sub_ps(a.v, b.v)); }
  friend Vec8 operator*(Vec8 a, Vec8 b) { return Vec8(_mm256_mul_ps(a.v, b.v)); }
  friend Vec8 operator/(Vec8 a, Vec8 b) { return Vec8(_mm256_div_ps(a.v, b.v)); }
  // a * b + c
  static Vec8 fma(Vec8 a, Vec8 b, Vec8 c) { return Vec8(_mm256_fmadd_ps(a.v, b.v, c.v)); }
  static Vec8 max(Vec8 a, Vec8 b) { return Vec8(_mm256_max_ps(a.v, b.v)); }
  static Vec8 min(Vec8 a, Vec8 b) { return Vec8(_mm256_min_ps(a.v, b.v)); }
  // 1/x: hardware estimate plus one Newton step (relative error ~1e-7, far cheaper than
  // a divide on the hot paths of sigmoid and softmax).
  Vec8 reciprocal() const {
    const __m256 r = _mm256_rcp_ps(v);
    return Vec8(_mm256_mul_ps(r, _mm256_fnmadd_ps(v, r, _mm256_set1_ps(2.f))));
  }

  // [x0, x1, x2, x3, ...] -> [x1, x0, x3, x2, ...]
  Vec8 swap_pairs() const { return Vec8(_mm256_permute_ps(v, 0xB1)); }
  Vec8 abs() const { return Vec8(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v)); }
  // Copies the sign of `s` onto the magnitude of this.
  Vec8 with_sign_of(Vec8 s) const {
    const __m256 m = _mm256_set1_ps(-0.f);
    return Vec8(_mm256_or_ps(_mm256_andnot_ps(m, v), _mm256_and_ps(m, s.v)));
  }

  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // This value, held in a register from here on: GCC otherwise folds the load that made it
  // into every FMA that uses it (one load per use) when the registers run short.
  static Vec8 pinned(Vec8 x) {
    asm("" : "+x"(x.v));
    return x;
  }
};

// exp(x) for x already known to lie in [-87, 88]: range reduction x = n ln2 + r, a
// degree-6 polynomial for e^r, 2^n through the exponent bits (about 3 ulp). No
// clamping, so callers that bound x themselves (sigmoid) save four instructions.
inline Vec8 exp_in_range(Vec8 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x.v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 xv = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x.v);
  xv = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), xv);
  // Cephes' expf polynomial without its x^7 term: that term is below 1.2e-7 on
  // |r| <= ln2/2, so dropping it costs < 1 ulp and saves an FMA per 8 values.
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_fmadd_ps(p, xv, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, xv, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, xv, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, xv, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(xv, xv), _mm256_add_ps(xv, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return Vec8(_mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// exp(x) for any x: below -87.3 returns 0 (so exp(-inf) = 0, which masked softmax
// relies on); above 88.3 returns inf; NaN stays NaN (max/min return their second
// operand when either is NaN, so x goes second: a NaN score must not become a weight).
inline Vec8 exp(Vec8 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447504f);
  const __m256 underflow = _mm256_cmp_ps(x.v, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(lo, x.v));
  return Vec8(_mm256_andnot_ps(underflow, exp_in_range(Vec8(xc)).v));
}

#else  // portable fallback

struct Vec8 {
  float v[8];
  Vec8() = default;
  explicit Vec8(float s) {
    for (float& x : v) x = s;
  }
  static Vec8 zero() { return Vec8(0.f); }
  template <typename T>
  static Vec8 load(const T* p) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  template <typename T>
  void store(T* p) const {
    for (int i = 0; i < 8; ++i) p[i] = from_float<T>(v[i]);
  }
#define TOPG_VEC8_BINOP(op)                                \
  friend Vec8 operator op(Vec8 a, Vec8 b) {                \
    for (int i = 0; i < 8; ++i) a.v[i] = a.v[i] op b.v[i]; \
    return a;                                              \
  }
  TOPG_VEC8_BINOP(+)
  TOPG_VEC8_BINOP(-)
  TOPG_VEC8_BINOP(*)
  TOPG_VEC8_BINOP(/)
#undef TOPG_VEC8_BINOP
  static Vec8 fma(Vec8 a, Vec8 b, Vec8 c) {
    for (int i = 0; i < 8; ++i) a.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return a;
  }
  static Vec8 max(Vec8 a, Vec8 b) {
    for (int i = 0; i < 8; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  static Vec8 min(Vec8 a, Vec8 b) {
    for (int i = 0; i < 8; ++i) a.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  Vec8 reciprocal() const { return Vec8(1.f) / *this; }
  static Vec8 pinned(Vec8 x) { return x; }
  Vec8 swap_pairs() const {
    Vec8 r;
    for (int i = 0; i < 8; i += 2) r.v[i] = v[i + 1], r.v[i + 1] = v[i];
    return r;
  }
  Vec8 abs() const {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = std::fabs(v[i]);
    return r;
  }
  Vec8 with_sign_of(Vec8 s) const {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = std::copysign(v[i], s.v[i]);
    return r;
  }
  float sum() const {
    float s = 0.f;
    for (float x : v) s += x;
    return s;
  }
  float max() const {
    float m = v[0];
    for (float x : v) m = x > m ? x : m;
    return m;
  }
};

inline Vec8 exp(Vec8 x) {
  for (float& f : x.v) f = std::exp(f);
  return x;
}
inline Vec8 exp_in_range(Vec8 x) { return exp(x); }

#endif

// In-place 8 x 8 transpose: afterwards r[j].lane(i) is the old r[i].lane(j).
inline void transpose8(Vec8 r[8]) {
#if TOPG_AVX2
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i].v, r[i + 1].v);
    t[i + 1] = _mm256_unpackhi_ps(r[i].v, r[i + 1].v);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
#else
  for (int i = 0; i < 8; ++i)
    for (int j = i + 1; j < 8; ++j) {
      const float x = r[i].v[j];
      r[i].v[j] = r[j].v[i];
      r[j].v[i] = x;
    }
#endif
}

// Horizontal sums of four vectors at once: out[i] = x[i].sum(). Cheaper than four
// separate reductions (decode attention reduces one dot product per head and token).
inline void sum4(const Vec8 x[4], float* out) {
#if TOPG_AVX2
  const __m256 ab = _mm256_hadd_ps(x[0].v, x[1].v), cd = _mm256_hadd_ps(x[2].v, x[3].v);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  for (int i = 0; i < 4; ++i) out[i] = x[i].sum();
#endif
}

// Element-wise helpers built on exp.
// The clamp keeps 1 + exp(-x) finite so the reciprocal's Newton step cannot make NaN;
// sigmoid(+-80) is already 1 and 1.8e-35.
inline Vec8 sigmoid(Vec8 x) {
  const Vec8 xc = Vec8::min(Vec8::max(x, Vec8(-80.f)), Vec8(80.f));
  return (Vec8(1.f) + exp_in_range(Vec8::zero() - xc)).reciprocal();
}
inline Vec8 silu(Vec8 x) { return x * sigmoid(x); }
// tanh(x) = 1 - 2 / (exp(2x) + 1); exact at the saturated ends.
inline Vec8 tanh(Vec8 x) { return Vec8(1.f) - Vec8(2.f) / (exp(x + x) + Vec8(1.f)); }

// erf(x), Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, below fp32 test tolerances).
inline Vec8 erf(Vec8 x) {
  const Vec8 a = x.abs();
  const Vec8 t = Vec8(1.f) / Vec8::fma(Vec8(0.3275911f), a, Vec8(1.f));
  Vec8 p = Vec8(1.061405429f);
  p = Vec8::fma(p, t, Vec8(-1.453152027f));
  p = Vec8::fma(p, t, Vec8(1.421413741f));
  p = Vec8::fma(p, t, Vec8(-0.284496736f));
  p = Vec8::fma(p, t, Vec8(0.254829592f));
  const Vec8 y = Vec8(1.f) - p * t * exp(Vec8::zero() - a * a);
  return y.with_sign_of(x);
}

// Load / store n < 8 trailing elements (rest padded with `pad`).
template <typename T>
inline Vec8 load_partial(const T* p, int n, float pad = 0.f) {
  alignas(32) float tmp[8];
  for (int i = 0; i < 8; ++i) tmp[i] = i < n ? to_float(p[i]) : pad;
  return Vec8::load(tmp);
}
template <typename T>
inline void store_partial(T* p, Vec8 v, int n) {
  alignas(32) float tmp[8];
  v.store(tmp);
  for (int i = 0; i < n; ++i) p[i] = from_float<T>(tmp[i]);
}

// True if any of x[0, n) is NaN (for the rare paths where a max reduction dropped it).
inline bool any_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return true;
  return false;
}

}  // namespace topg
