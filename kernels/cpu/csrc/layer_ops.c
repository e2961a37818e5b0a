/* A decoder layer's small ops on the CPU: residual add + RMSNorm, and SiLU-and-mul.
 *
 * What kernels/fused_ref.py's add_rms_norm_ref and silu_mul_ref compute: float32 math, one
 * rounding into each output's dtype (the residual sum is rounded before its statistics, as
 * the unfused model does). One call replaces the torch ops whose dispatch dominates at a
 * decode step's one to eight rows. Each tensor has its own dtype, so a float32 model whose
 * projections multiply bf16 rows (--quantization gguf) reads their bf16 outputs and writes
 * the next projection's bf16 input directly, with the values the conversions would give.
 *
 * dtype: 0 = float32, 1 = bfloat16 (raw uint16, round to nearest even as torch does).
 */
#include <math.h>
#include <stdint.h>
#include "bf16.h"
#include "simd_exp.h"

static inline float load(const void *base, int64_t i, int dtype) {
    return dtype ? bf16_load((const uint16_t *)base + i) : ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float v, int dtype) {
    if (dtype) ((uint16_t *)base)[i] = bf16_round(v);
    else ((float *)base)[i] = v;
}

static inline int bad_dtype(int dtype) { return dtype != 0 && dtype != 1; }

/* Row r of x [rows, n] (row stride sx, x_dtype), plus residual (stride sr, sum_dtype, or
 * NULL), rounded to sum_dtype, goes to sum_out (stride ss); out (stride so, out_dtype) =
 * rms_norm(sum) * (w + w_offset). w [n] is float32 (w_dtype 0) or bf16 (1). Returns 0, or
 * -1 for bad sizes or dtypes. */
int nb_add_rms_norm(const void *x, int64_t sx, int x_dtype, const void *residual, int64_t sr,
                    const void *w, int w_dtype, float w_offset, float eps, int64_t rows,
                    int64_t n, void *sum_out, int64_t ss, int sum_dtype, void *out, int64_t so,
                    int out_dtype) {
    if (rows < 0 || n <= 0 || bad_dtype(x_dtype) || bad_dtype(w_dtype) || bad_dtype(sum_dtype) ||
        bad_dtype(out_dtype))
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        double sq = 0.0;
        for (int64_t i = 0; i < n; i++) {
            float s = load(x, r * sx + i, x_dtype);
            if (residual) s += load(residual, r * sr + i, sum_dtype);
            store(sum_out, r * ss + i, s, sum_dtype);
            float rounded = load(sum_out, r * ss + i, sum_dtype);
            sq += (double)rounded * rounded;
        }
        float inv = 1.0f / sqrtf((float)(sq / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) {
            float s = load(sum_out, r * ss + i, sum_dtype);
            store(out, r * so + i, s * inv * (load(w, i, w_dtype) + w_offset), out_dtype);
        }
    }
    return 0;
}

/* silu(g) * u in float32 for one value pair (the scalar tail, and CPUs without AVX512). */
static inline float silu_mul1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

#ifdef __AVX512F__
static inline __m512 load16(const void *base, int64_t i, int dtype) {
    if (!dtype) return _mm512_loadu_ps((const float *)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store16(void *base, int64_t i, __m512 v, int dtype) {
    if (!dtype) { _mm512_storeu_ps((float *)base + i, v); return; }
    __m512i u = _mm512_castps_si512(v);              /* bf16_round, 16 at a time */
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, else
 * e / (1 + e); within a few fp32 ulps of torch's g / (1 + exp(-g)). */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    __m512 e = exp_neg(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
    __mmask16 neg = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
    __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}
#endif

/* out [rows, n] (stride so, out_dtype) = silu(gate) * up, float32 math, one rounding; gate
 * and up [rows, n] (strides sg, su) in x_dtype: two tensors, or the halves of one. Returns 0,
 * or -1 for bad sizes or dtypes. */
int nb_silu_mul(const void *gate, int64_t sg, const void *up, int64_t su, int x_dtype,
                int64_t rows, int64_t n, void *out, int64_t so, int out_dtype) {
    if (rows < 0 || n <= 0 || bad_dtype(x_dtype) || bad_dtype(out_dtype)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= n; i += 16)
            store16(out, r * so + i,
                    silu_mul16(load16(gate, r * sg + i, x_dtype), load16(up, r * su + i, x_dtype)),
                    out_dtype);
#endif
        for (; i < n; i++)
            store(out, r * so + i,
                  silu_mul1(load(gate, r * sg + i, x_dtype), load(up, r * su + i, x_dtype)),
                  out_dtype);
    }
    return 0;
}
