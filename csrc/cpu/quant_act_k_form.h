// One form of the K-quants' int8 GEMV, included twice by quant_act_k.h: once as the AVX2
// form, once as the VNNI form, with
//   TOPG_K_FORM              the function's name,
//   TOPG_K_TARGET            its target attribute (empty for AVX2),
//   TOPG_K_MADD(acc, p, sc)  acc + the int16 pairs of p times those of sc, summed per int32
//                            lane (madd then add; VNNI: one vpdpwssd).
// One text, so both forms sum the same integers in the same fp32 order (bitwise the same
// sums; test_int8_gemv_rows_do_not_depend_on_m asserts it on VNNI CPUs). (One C++ body
// templated on the dot cannot be: GCC will not inline the VNNI dot into a function
// without the AVX-512 target, and a function with it cannot be inlined into the AVX2
// form.) No include guard, on purpose.
//
// out[r * ldo] for activation rows r < MR of the row at `row` (nb super-blocks), R = q4_k,
// q5_k or q6_k. The activations of a K-quant weight hold one scale per super-block of 256
// (x.d's 8 entries of a super-block are equal: quantize_act with group 256), so a
// super-block's 8 runs sum in int32, each run's integer dot times its integer scale, and
// one conversion and one FMA with d xd per super-block and row; q4_k / q5_k's minimums as 8
// lanes per super-block.
template <Fmt R, int MR>
TOPG_K_TARGET __attribute__((always_inline)) inline void TOPG_K_FORM(const uint8_t* row, int64_t nb,
                                                                     const Q8Acts& x, float* out,
                                                                     int64_t ldo) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc[MR], cterm[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r] = zero, cterm[r] = zero;
  for (int64_t s = 0; s < nb; ++s) {
    __m256i isum[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    float d;
    if constexpr (R != Fmt::q6_k) {  // q4_k, q5_k
      constexpr int64_t bb = R == Fmt::q5_k ? 176 : 144;
      const uint8_t* p = row + bb * s;
      stream_ahead(p, bb);  // L1: L2 measured no faster for q4_k (quant_kernels.h)
      const __m256i scv = k_scales_i16(k45_mins<MR>(p, s, x, cterm));
      d = half_at(p);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        k45_runs<R>(p, c, lo, hi);
        const __m256i sl = k_pick_i16(scv, 2 * c, 2 * c);
        const __m256i sh = k_pick_i16(scv, 2 * c + 1, 2 * c + 1);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = x.q[r] + 256 * s + 64 * c;
          isum[r] = TOPG_K_MADD(isum[r], _mm256_maddubs_epi16(lo, load32(xr)), sl);
          isum[r] = TOPG_K_MADD(isum[r], _mm256_maddubs_epi16(hi, load32(xr + 32)), sh);
        }
      }
    } else {  // q6_k
      const uint8_t* p = row + 210 * s;
      stream_ahead<Ahead::l2>(p, 210);
      d = half_at(p + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i scv =
            k_scales_i16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 192 + 8 * h)));
        __m256i u[4];
        q6k_runs(p + 64 * h, p + 128 + 32 * h, u);
        for (int q = 0; q < 4; ++q) {
          const int j = 4 * h + q;
          const __m256i sj = k_pick_i16(scv, 2 * q, 2 * q + 1);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = load32(x.q[r] + 256 * s + 32 * j);
            isum[r] = TOPG_K_MADD(isum[r], k_pairs6(u[q], xv), sj);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
      acc[r] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * x.d[r][8 * s]), acc[r]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r], cterm[r]));
}
