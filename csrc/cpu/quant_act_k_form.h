// One form of the K-quants' int8 GEMV, included twice by quant_act_k.h: once as the AVX2
// form, once as the VNNI form, with
//   TOPG_K_FORM       the function's name,
//   TOPG_K_TARGET     its target attribute (empty for AVX2),
//   TOPG_K_DOT(u, x)  dpbusd's int32 lanes (udot4, or vpdpbusd from zero).
// One text, so both forms sum the same integers in the same fp32 order (bitwise the same
// sums; test_int8_gemv_rows_do_not_depend_on_m asserts it on VNNI CPUs). (One C++ body
// templated on the dot cannot be: GCC will not inline the VNNI dot into a function
// without the AVX-512 target, and a function with it cannot be inlined into the AVX2
// form.) No include guard, on purpose.
//
// out[r * ldo] for activation rows r < MR of the row at `row` (nb super-blocks), R = q4_k,
// q5_k or q6_k: per run one integer dot, one conversion, one FMA with the run's scale into
// one of two accumulators (two FMA chains); the minimums per super-block as 8 lanes.
template <Fmt R, int MR>
TOPG_K_TARGET __attribute__((always_inline)) inline void TOPG_K_FORM(const uint8_t* row, int64_t nb,
                                                                     const Q8Acts& x, float* out,
                                                                     int64_t ldo) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0[MR], a1[MR], cterm[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) a0[r] = zero, a1[r] = zero, cterm[r] = zero;
  for (int64_t s = 0; s < nb; ++s) {
    if constexpr (R != Fmt::q6_k) {  // q4_k, q5_k
      constexpr int64_t bb = R == Fmt::q5_k ? 176 : 144;
      const uint8_t* p = row + bb * s;
      stream_ahead(p, bb);  // L1: L2 measured no faster for q4_k (quant_kernels.h)
      alignas(32) float sv[MR][8];
      k45_scales<MR>(p, s, x, sv, cterm);
      asm("" : "+m"(sv));  // keep the broadcasts loads (GCC forwards the stores otherwise)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        k45_runs<R>(p, c, lo, hi);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = x.q[r] + 256 * s + 64 * c;
          const __m256i dl = TOPG_K_DOT(lo, load32(xr)), dh = TOPG_K_DOT(hi, load32(xr + 32));
          a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dl), _mm256_set1_ps(sv[r][2 * c]), a0[r]);
          a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_set1_ps(sv[r][2 * c + 1]), a1[r]);
        }
      }
    } else {  // q6_k
      const uint8_t* p = row + 210 * s;
      stream_ahead<Ahead::l2>(p, 210);
      const __m256 d = _mm256_set1_ps(half_at(p + 208));
      const __m256i k32 = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        const __m256 scv = q6k_scales(p, h, d);
        __m256i u[4];
        q6k_runs(p + 64 * h, p + 128 + 32 * h, u);
        for (int q = 0; q < 4; ++q) {
          const int j = 4 * h + q;
          const __m256 scq = q6k_run_scale(scv, q);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = load32(x.q[r] + 256 * s + 32 * j);
            const __m256i dot = _mm256_sub_epi32(TOPG_K_DOT(u[q], xv), TOPG_K_DOT(k32, xv));
            const __m256 sv = _mm256_mul_ps(scq, _mm256_set1_ps(x.d[r][8 * s + j]));
            if (q & 1)
              a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sv, a1[r]);
            else
              a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sv, a0[r]);
          }
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
    out[r * ldo] = hsum(_mm256_add_ps(_mm256_add_ps(a0[r], a1[r]), cterm[r]));
}
