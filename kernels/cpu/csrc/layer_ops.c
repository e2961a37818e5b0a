/* Residual add + RMSNorm for a decoder layer on the CPU, fp32 or bf16 rows.
 *
 * What kernels/fused_ref.py's add_rms_norm_ref computes: float32 math, one rounding into the
 * row dtype per output (the residual sum is rounded before its statistics, as the unfused
 * model does). One call replaces the six to eight torch ops of an add and an RMSNorm, whose
 * dispatch dominates at a decode step's one to eight rows. (SiLU-and-mul stays on torch's
 * two ops: its vectorized exp beats a scalar expf loop here.)
 *
 * dtype: 0 = float32, 1 = bfloat16 (raw uint16, round to nearest even as torch does).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load(const void *base, int64_t i, int dtype) {
    return dtype ? bf16_load((const uint16_t *)base + i) : ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float v, int dtype) {
    if (dtype) ((uint16_t *)base)[i] = bf16_round(v);
    else ((float *)base)[i] = v;
}

/* Row r of x [rows, n] (row stride sx), plus residual (stride sr, or NULL), rounded to the
 * dtype, goes to sum_out (stride ss); out (stride so) = rms_norm(sum) * (w + w_offset).
 * w [n] is float32 (w_dtype 0) or bf16 (1). Returns 0, or -1 for bad sizes. */
int nb_add_rms_norm(const void *x, int64_t sx, const void *residual, int64_t sr,
                    const void *w, int w_dtype, float w_offset, float eps, int64_t rows,
                    int64_t n, void *sum_out, int64_t ss, void *out, int64_t so, int dtype) {
    if (rows < 0 || n <= 0 || (dtype != 0 && dtype != 1) || (w_dtype != 0 && w_dtype != 1))
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        double sq = 0.0;
        for (int64_t i = 0; i < n; i++) {
            float s = load(x, r * sx + i, dtype);
            if (residual) s += load(residual, r * sr + i, dtype);
            store(sum_out, r * ss + i, s, dtype);
            float rounded = load(sum_out, r * ss + i, dtype);
            sq += (double)rounded * rounded;
        }
        float inv = 1.0f / sqrtf((float)(sq / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) {
            float s = load(sum_out, r * ss + i, dtype);
            store(out, r * so + i, s * inv * (load(w, i, w_dtype) + w_offset), dtype);
        }
    }
    return 0;
}
