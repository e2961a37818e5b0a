/* A 16-wide (AVX512) or 8-wide (AVX2) exp for the CPU kernels of this directory (included,
 * not built alone).
 * build.py hashes the headers here with each source, so a change rebuilds its users. */
#ifndef NIBBLE_SIMD_EXP_H
#define NIBBLE_SIMD_EXP_H
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

/* Both widths: n = round(x * log2 e), r = x - n ln 2 with ln 2 in two parts, exp(r) by its
 * Taylor coefficients to r^7 in Horner order. */
#define NB_LOG2E 1.44269504f
#define NB_LN2_HI 0.693145752f
#define NB_LN2_LO 1.42860677e-06f
static const float NB_EXP_POLY[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                                     1.0f / 6, 0.5f, 1.0f, 1.0f};
#endif

#ifdef __AVX512F__

/* exp(x) for x <= 0 (scores minus their max): 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2
 * in two parts, exp(r) by its Taylor polynomial to r^7 (|r| <= ln 2 / 2: error below 1e-8
 * relative, under half an fp32 ulp), scaled by 2^n with scalef (exact; underflows to 0). */
static inline __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(NB_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(NB_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(NB_LN2_LO), r);
    __m512 p = _mm512_set1_ps(NB_EXP_POLY[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(NB_EXP_POLY[i]));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The 8-wide exp_neg for AVX2 CPUs: the same reduction and polynomial; 2^n built in the
 * exponent bits, so x below -87 (2^n under the smallest normal) gives 0, not a subnormal
 * (its weight beside the max's 1 is below 2^-125 either way). */
static inline __m256 exp_neg8(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(NB_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(NB_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(NB_LN2_LO), r);
    __m256 p = _mm256_set1_ps(NB_EXP_POLY[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(NB_EXP_POLY[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif
#endif
