/* AVX2 forms of the NVFP4 decode's inner loops (nvfp4_decode.c), 8 values a vector: what an
 * AVX2 CPU runs where an AVX512 one runs the 16-wide forms. Included, not built alone. */
#ifndef NIBBLE_NVFP4_AVX2_H
#define NIBBLE_NVFP4_AVX2_H
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define NB_AVX2 1
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Eight values of a row from their 4 code bytes (low nibble first) and their block's scale:
 * (e2m1 * scale) * gs, as the references dequantize. The magnitude comes from an 8-entry
 * table (the code's low 3 bits), the sign from its bit 3. */
static inline __m256 dequant8(const uint8_t *codes, float scale, float gs) {
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    int32_t word;
    memcpy(&word, codes, 4);
    const __m128i b = _mm_cvtsi32_si128(word), nib = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));   /* element order */
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    const __m256 v = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, idx), _mm256_castsi256_ps(sign));
    return _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(scale)), _mm256_set1_ps(gs));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Lane m of the result = the sum of v[m]'s 8 lanes: 8 horizontal sums in 9 instructions. */
static inline __m256 hsum8x8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a's 128-bit lane L holds the lane-L sums of v[0..3], b's those of v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* sc [n] -> exp(sc - max) in place; returns their sum. */
static inline float exp_shifted8(float *sc, int64_t n) {
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = fmaxf(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
    for (int64_t t = j; t < n; t++) mx = fmaxf(mx, sc[t]);
    const __m256 m = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m));
        _mm256_storeu_ps(sc + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum8(vs);
    for (; j < n; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
    return sum;
}
#endif
#endif
