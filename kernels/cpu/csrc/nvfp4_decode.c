/* One decode layer over NVFP4 pages on the CPU: RoPE (optional), the K recipe, the
 * NVFP4 store of the new K/V rows, and GQA attention over each sequence's pages.
 *
 * Plain C (no torch headers), built on first use by nibble/kernels/cpu/build.py and
 * called through ctypes. Compiled with -ffp-contract=off and without -ffast-math, so
 * every fp32 operation below rounds as the torch references' do: RoPE, the NVFP4
 * quantizer and the dequantized K/V are bit-identical to theirs; the recipe's matmuls
 * and the attention sums differ from torch only in summation order.
 *
 * Layouts (all row-major, fp32 unless stated):
 *   q rows  [B][Hq*D] with row stride q_stride (elements); k, v rows [B][H*D] likewise;
 *           float32, or bf16 (raw uint16) with in_dtype 1
 *   cos/sin [B][D] (NULL: q and k already rotated)
 *   k_map/q_map [H][D][D], k_bias/k_shift/v_shift [H][D] (NULL: absent)
 *   pool: uint8 pages of page_stride bytes; sec[4] = byte offsets, inside a page, of
 *         this layer's K data [H][S][D/2], V data, K scales [H][S][D/16], V scales
 *   slots [B] = page * S + offset of each new row; page_ids [B][M]; lo/hi [B]: the
 *         positions lo..hi (hi = the new row's) each query attends to
 *   out [B][Hq*D], float32, or bf16 with out_dtype 1 (rounded once, after the V shift)
 * Returns 0, 1 when a transformed K or V value is not finite (nothing written), 2 when out of
 * memory, 3 for a bad dtype.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "simd_exp.h"
#include "nvfp4_avx2.h"

#define BLOCK 16

static float PAIR[256][2];       /* the two E2M1 values (low, high nibble) of each byte */
static float E4M3[256];          /* the value of each E4M3 byte */
static int ready = 0;

static void init_tables(void) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int c = 0; c < 256; c++) {
        int lo = c & 15, hi = c >> 4;
        PAIR[c][0] = (lo & 8) ? -mag[lo & 7] : mag[lo & 7];
        PAIR[c][1] = (hi & 8) ? -mag[hi & 7] : mag[hi & 7];
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
        E4M3[c] = (c & 128) ? -v : v;
    }
    ready = 1;
}

/* E4M3 byte of x in [0, 448], round to nearest even. */
static inline uint8_t e4m3_byte(float x) {
    if (x < 0.015625f)                              /* below 2^-6: subnormal steps of 2^-9 */
        return (uint8_t)nearbyintf(x * 512.0f);     /* 8 is 2^-6, byte 0x08: still right */
    int e;
    frexpf(x, &e);                                  /* x in [2^(e-1), 2^e) */
    int r = (int)nearbyintf(ldexpf(x, 4 - e));      /* 8..16 */
    return (uint8_t)(((e + 6) << 3) + r - 8);       /* r = 16 carries into the exponent */
}

/* The reference quantizer (kernels/nvfp4.py) on one row of D values. */
static void quantize_row(const float *x, int d, float gs, uint8_t *codes, uint8_t *scales) {
    for (int b0 = 0; b0 < d; b0 += BLOCK) {
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(x[b0 + i]));
        float s = amax / 6.0f / gs;
        if (!(s <= 448.0f)) s = 448.0f;
        uint8_t sb = e4m3_byte(s);
        float denom = E4M3[sb] * gs;
        float inv = 0.0f;
        if (denom > 0.0f) { inv = 1.0f / denom; if (inv > FLT_MAX) inv = FLT_MAX; }
        uint8_t c[BLOCK];
        for (int i = 0; i < BLOCK; i++) {
            float q = x[b0 + i] * inv, m = fabsf(q);
            int code = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f)
                       + (m >= 3.5f) + (m > 5.0f);
            c[i] = (uint8_t)(code | (signbit(q) ? 8 : 0));
        }
        for (int i = 0; i < BLOCK / 2; i++) codes[b0 / 2 + i] = (uint8_t)(c[2 * i] | (c[2 * i + 1] << 4));
        scales[b0 / BLOCK] = sb;
    }
}

/* (e2m1 * scale) * gs, as the references dequantize: the pair table's values first, then
 * the block's two multiplies (a loop the compiler vectorizes). */
static inline void dequant_row(const uint8_t *codes, const uint8_t *scales, int d, float gs,
                               float *out) {
    for (int i = 0; i < d / 2; i++) memcpy(out + 2 * i, PAIR[codes[i]], 2 * sizeof(float));
    for (int b0 = 0; b0 < d; b0 += BLOCK) {
        float s = E4M3[scales[b0 / BLOCK]];
        for (int i = 0; i < BLOCK; i++) out[b0 + i] = (out[b0 + i] * s) * gs;
    }
}

/* x [D] rotated as apply_rope does: x * cos + cat(-x[h:], x[:h]) * sin. */
static void rope(const float *x, const float *cos, const float *sin, int d, float *out) {
    int h = d / 2;
    for (int i = 0; i < h; i++) out[i] = x[i] * cos[i] + (-x[i + h]) * sin[i];
    for (int i = h; i < d; i++) out[i] = x[i] * cos[i] + x[i - h] * sin[i];
}

/* out[e] = bias[e] + sum_d x[d] * m[d][e] (bias NULL: 0); fused multiply-adds: its
 * summation order differs from torch's matmul anyway. */
static void row_matmul(const float *x, const float *m, const float *bias, int d, float *out) {
    for (int e = 0; e < d; e++) out[e] = 0.0f;
    for (int i = 0; i < d; i++) {
        float xi = x[i];
        const float *row = m + (size_t)i * d;
        for (int e = 0; e < d; e++) out[e] = fmaf(xi, row[e], out[e]);
    }
    if (bias)
        for (int e = 0; e < d; e++) out[e] = bias[e] + out[e];
}

static inline float dot(const float *a, const float *b, int d) {
    float acc[BLOCK] = {0};
    for (int i = 0; i < d; i += BLOCK)
        for (int j = 0; j < BLOCK; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < BLOCK; j++) s += acc[j];
    return s;
}

#ifdef __AVX512F__
/* One 16-value block of a row: codes (8 bytes) and its scale -> (e2m1 * scale) * gs. */
static inline __m512 dequant_block(const uint8_t *codes, float scale, float gs) {
    static const float mag[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f,
                                  -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    __m128i b = _mm_loadl_epi64((const __m128i *)codes);
    __m128i nib = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));    /* element order */
    __m512 v = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(mag));
    return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(scale)), _mm512_set1_ps(gs));
}
#endif

/* The run of positions [p, *end) that share p's page (*end <= hi + 1): that page, with p's
 * row inside head h's section in *r. One 64-bit divide by the runtime page size per run, not
 * per position (it costs tens of cycles, as much as a token's scores at a short head). */
static inline const uint8_t *page_run(const uint8_t *pool, int64_t page_stride,
                                      const int64_t *pages, int s, int h, int64_t p, int64_t hi,
                                      int64_t *r, int64_t *end) {
    int64_t pg = p / s;
    *r = (int64_t)h * s + (p - pg * s);
    *end = (pg + 1) * s < hi + 1 ? (pg + 1) * s : hi + 1;
    return pool + pages[pg] * page_stride;
}

/* Scores of the G query rows q [G][D] against one K row (sm_scale applied), or one V
 * row's weighted add into out [G][D] (w [G]); the row read from its page. (AVX512 and AVX2
 * with G <= 8 take k_scores_batched instead.) */
static inline void k_scores(const float *q, int g, int d, const uint8_t *codes,
                            const uint8_t *scales, float gs, float sm_scale, float *row,
                            float *sc, int64_t stride) {
    dequant_row(codes, scales, d, gs, row);
    for (int i = 0; i < g; i++) sc[i * stride] = dot(q + i * d, row, d) * sm_scale;
}

static inline void v_accumulate(const float *w, int64_t stride, int g, int d,
                                const uint8_t *codes, const uint8_t *scales, float gs,
                                float *row, float *out) {
#ifdef __AVX512F__
    for (int b0 = 0; b0 < d; b0 += BLOCK) {
        __m512 v = dequant_block(codes + b0 / 2, E4M3[scales[b0 / BLOCK]], gs);
        for (int i = 0; i < g; i++) {
            __m512 o = _mm512_loadu_ps(out + i * d + b0);
            _mm512_storeu_ps(out + i * d + b0, _mm512_fmadd_ps(_mm512_set1_ps(w[i * stride]), v, o));
        }
    }
    (void)row;
#else
    dequant_row(codes, scales, d, gs, row);
    for (int i = 0; i < g; i++) {
        float wi = w[i * stride], *o = out + i * d;
        for (int e = 0; e < d; e++) o[e] += wi * row[e];
    }
#endif
}


#ifdef __AVX512F__
/* Lane m of the result = the sum of v[m]'s 16 lanes: 16 horizontal sums in 45 instructions
 * (pairwise unpacks, then 128-bit lane shuffles), against about 8 for each one alone. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 s1[8], s2[4];
    for (int k = 0; k < 8; k++)          /* lane L: [a02, b02, a13, b13] of v[2k], v[2k+1] */
        s1[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                              _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {        /* lane L: the lane-L sums of v[4k .. 4k+3] */
        __m512d c = _mm512_castps_pd(s1[2 * k]), e = _mm512_castps_pd(s1[2 * k + 1]);
        s2[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, e)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(c, e)));
    }
    __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512F__) || defined(NB_AVX2)
/* One vector of NB_W floats: 16 with AVX512, 8 with AVX2 (v_sum_blocks_g and
 * k_scores_batched below). */
#ifdef __AVX512F__
#define NB_W 16
typedef __m512 nb_vec;
#define NB_ZERO() _mm512_setzero_ps()
#define NB_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define NB_LOAD(p) _mm512_loadu_ps(p)
#define NB_STORE(p, v) _mm512_storeu_ps(p, v)
#define NB_SCALE(v, x) _mm512_mul_ps(v, _mm512_set1_ps(x))
#define NB_BCAST(x) _mm512_set1_ps(x)
#define NB_DEQUANT(codes, scale, gs) dequant_block(codes, scale, gs)
#define NB_HSUM(v) hsum16(v)
#else
#define NB_W 8
typedef __m256 nb_vec;
#define NB_ZERO() _mm256_setzero_ps()
#define NB_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define NB_LOAD(p) _mm256_loadu_ps(p)
#define NB_STORE(p, v) _mm256_storeu_ps(p, v)
#define NB_SCALE(v, x) _mm256_mul_ps(v, _mm256_set1_ps(x))
#define NB_BCAST(x) _mm256_set1_ps(x)
#define NB_DEQUANT(codes, scale, gs) dequant8(codes, scale, gs)
#define NB_HSUM(v) hsum8x8(v)
#endif

/* out [G][D] = sum over positions lo..hi of w[i * n + j] * V_j, one NB_W-wide block of D at
 * a time with the G accumulators in registers (G <= 8): the same fmas in the same token order
 * as v_accumulate from a zeroed out, so bit for bit the same sums, without loading and
 * storing out once per token. */
static inline void v_sum_blocks_g(const float *w, int64_t n, int g, int d, int s,
                                  const uint8_t *pool, int64_t page_stride, const int64_t *sec,
                                  const int64_t *pages, int h, int64_t lo, int64_t hi, float gs,
                                  float *out) {
    int cb = d / 2, sb = d / BLOCK;
    for (int e0 = 0; e0 < d; e0 += NB_W) {
        nb_vec acc[8];
        for (int i = 0; i < g; i++) acc[i] = NB_ZERO();
        for (int64_t p = lo, j = 0, r, end; p <= hi;) {
            const uint8_t *page = page_run(pool, page_stride, pages, s, h, p, hi, &r, &end);
            const uint8_t *vc = page + sec[1] + r * cb + e0 / 2;
            const uint8_t *vs = page + sec[3] + r * sb + e0 / BLOCK;
            for (; p < end; p++, j++, vc += cb, vs += sb) {
                nb_vec v = NB_DEQUANT(vc, E4M3[*vs], gs);
                for (int i = 0; i < g; i++) acc[i] = NB_FMA(NB_BCAST(w[i * n + j]), v, acc[i]);
            }
        }
        for (int i = 0; i < g; i++) NB_STORE(out + i * d + e0, acc[i]);
    }
}

/* The group sizes of common models as constants, so the accumulators stay in registers. */
static void v_sum_blocks(const float *w, int64_t n, int g, int d, int s, const uint8_t *pool,
                         int64_t page_stride, const int64_t *sec, const int64_t *pages, int h,
                         int64_t lo, int64_t hi, float gs, float *out) {
#define NB_V_SUM(G) v_sum_blocks_g(w, n, G, d, s, pool, page_stride, sec, pages, h, lo, hi, gs, out)
    switch (g) {
    case 1: NB_V_SUM(1); break;
    case 2: NB_V_SUM(2); break;
    case 3: NB_V_SUM(3); break;
    case 4: NB_V_SUM(4); break;
    case 5: NB_V_SUM(5); break;
    case 6: NB_V_SUM(6); break;
    case 7: NB_V_SUM(7); break;
    default: NB_V_SUM(8); break;
    }
#undef NB_V_SUM
}

/* The scores of the G <= 8 query rows q [G][D] against K rows lo..hi into sc [G][n] (row
 * stride n), sm_scale applied: each row's NB_W-lane products go to acc [G][NB_W] per
 * position, and every NB_W positions one NB_HSUM per query row gives NB_W scores at once
 * (instead of a horizontal sum per position and row). */
static void k_scores_batched(const float *q, int g, int d, int s, const uint8_t *pool,
                             int64_t page_stride, const int64_t *sec, const int64_t *pages,
                             int h, int64_t lo, int64_t hi, float gs, float sm_scale, float *sc,
                             int64_t n) {
    nb_vec acc[8][NB_W];
    int cb = d / 2, sb = d / BLOCK, t = 0;
    for (int64_t p = lo, j = 0, r, end; p <= hi;) {
        const uint8_t *page = page_run(pool, page_stride, pages, s, h, p, hi, &r, &end);
        const uint8_t *kc = page + sec[0] + r * cb, *ks = page + sec[2] + r * sb;
        for (; p < end; p++, j++, kc += cb, ks += sb) {
            for (int i = 0; i < g; i++) acc[i][t] = NB_ZERO();
            for (int e0 = 0; e0 < d; e0 += NB_W) {
                nb_vec v = NB_DEQUANT(kc + e0 / 2, E4M3[ks[e0 / BLOCK]], gs);
                for (int i = 0; i < g; i++)
                    acc[i][t] = NB_FMA(NB_LOAD(q + i * d + e0), v, acc[i][t]);
            }
            if (++t < NB_W && p < hi) continue;
            for (int i = 0; i < g; i++) {       /* slots past t: zeroed, their lanes not stored */
                float out[NB_W];
                for (int u = t; u < NB_W; u++) acc[i][u] = NB_ZERO();
                NB_STORE(out, NB_SCALE(NB_HSUM(acc[i]), sm_scale));
                memcpy(sc + i * n + j + 1 - t, out, sizeof(float) * (size_t)t);
            }
            t = 0;
        }
    }
}
#endif

/* One query row's scores sc [n] -> softmax weights, in place. */
static void softmax_row(float *sc, int64_t n) {
    float sum = 0.0f;
    int64_t j = 0;
#ifdef __AVX512F__
    float mx;
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(sc + j));
    mx = _mm512_reduce_max_ps(vmx);
    for (int64_t t = j; t < n; t++) mx = fmaxf(mx, sc[t]);
    const __m512 m = _mm512_set1_ps(mx);
    __m512 vs = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sc + j), m));
        _mm512_storeu_ps(sc + j, e);
        vs = _mm512_add_ps(vs, e);
    }
    if (j < n) {
        const __mmask16 k = (__mmask16)((1u << (n - j)) - 1u);
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), m));
        _mm512_mask_storeu_ps(sc + j, k, e);
        vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(k, e));
    }
    sum = _mm512_reduce_add_ps(vs);
#elif defined(NB_AVX2)
    sum = exp_shifted8(sc, n);
#else
    float mx = -INFINITY;
    for (; j < n; j++) mx = fmaxf(mx, sc[j]);
    for (j = 0; j < n; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
#endif
    float inv = 1.0f / sum;
    for (j = 0; j < n; j++) sc[j] *= inv;
}

/* Attention of the G query rows q [G][D] of one KV head over positions lo..hi into
 * out [G][D] (contiguous). */
static void attend(const float *q, int g, int d, int s, const uint8_t *pool, int64_t page_stride,
                   const int64_t *sec, const int64_t *pages, int h, int64_t lo, int64_t hi,
                   float gs_k, float gs_v, float sm_scale, float *scores, float *row,
                   float *out) {
    int64_t n = hi - lo + 1;
    int cb = d / 2, sb = d / BLOCK;
#if defined(__AVX512F__) || defined(NB_AVX2)
    if (g <= 8)
        k_scores_batched(q, g, d, s, pool, page_stride, sec, pages, h, lo, hi, gs_k, sm_scale,
                         scores, n);
    else
#endif
    for (int64_t p = lo, j = 0, r, end; p <= hi;) {          /* page by page */
        const uint8_t *page = page_run(pool, page_stride, pages, s, h, p, hi, &r, &end);
        for (; p < end; p++, j++, r++)
            k_scores(q, g, d, page + sec[0] + r * cb, page + sec[2] + r * sb, gs_k, sm_scale,
                     row, scores + j, n);
    }
    for (int i = 0; i < g; i++) softmax_row(scores + i * n, n);
#if defined(__AVX512F__) || defined(NB_AVX2)
    if (g <= 8) {
        v_sum_blocks(scores, n, g, d, s, pool, page_stride, sec, pages, h, lo, hi, gs_v, out);
        return;
    }
#endif
    memset(out, 0, sizeof(float) * (size_t)g * d);
    for (int64_t p = lo, j = 0, r, end; p <= hi;) {
        const uint8_t *page = page_run(pool, page_stride, pages, s, h, p, hi, &r, &end);
        for (; p < end; p++, j++, r++)
            v_accumulate(scores + j, n, g, d, page + sec[1] + r * cb, page + sec[3] + r * sb,
                         gs_v, row, out);
    }
}

/* Row `off` of a float32 or bf16 (dtype 1) tensor as float32: the row itself, or `tmp`. */
static const float *row_f32(const void *base, int64_t off, int dtype, int d, float *tmp) {
    if (!dtype) return (const float *)base + off;
    for (int e = 0; e < d; e++) tmp[e] = bf16_load((const uint16_t *)base + off + e);
    return tmp;
}

int nb_decode_nvfp4(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                    const void *v, int64_t v_stride, const float *cos, const float *sin,
                    const float *k_map, const float *k_bias, const float *k_shift,
                    const float *q_map, const float *v_shift,
                    uint8_t *pool, int64_t page_stride, const int64_t *sec,
                    int b_n, int h_n, int g_n, int d, int s,
                    const int64_t *slots, const int64_t *page_ids, int m,
                    const int64_t *lo, const int64_t *hi,
                    float gs_k, float gs_v, float sm_scale, void *out, int in_dtype,
                    int out_dtype) {
    if ((in_dtype != 0 && in_dtype != 1) || (out_dtype != 0 && out_dtype != 1)) return 3;
    if (!ready) init_tables();
    int hq = h_n * g_n, cb = d / 2, sb = d / BLOCK;
    size_t qn = (size_t)hq * d, kn = (size_t)h_n * d;
    float *buf = malloc(sizeof(float) * ((size_t)b_n * (qn + 2 * kn) + 4 * d));
    if (!buf) return 2;
    float *qt = buf, *kt = qt + (size_t)b_n * qn, *vt = kt + (size_t)b_n * kn;
    float *tmp = vt + (size_t)b_n * kn, *tmp2 = tmp + d, *wide = tmp2 + d, *wide2 = wide + d;
    int bad = 0;
    for (int b = 0; b < b_n; b++) {                 /* q, k, v as the store and SDPA see them */
        const float *cs = cos ? cos + (size_t)b * d : NULL, *sn = sin ? sin + (size_t)b * d : NULL;
        for (int hh = 0; hh < hq; hh++) {
            const float *x = row_f32(q, b * q_stride + (int64_t)hh * d, in_dtype, d, wide);
            float *o = qt + b * qn + (size_t)hh * d;
            if (cs) { rope(x, cs, sn, d, tmp); x = tmp; }
            if (q_map) row_matmul(x, q_map + (size_t)(hh / g_n) * d * d, NULL, d, o);
            else memcpy(o, x, sizeof(float) * d);
        }
        for (int hh = 0; hh < h_n; hh++) {
            const float *x = row_f32(k, b * k_stride + (int64_t)hh * d, in_dtype, d, wide);
            const float *y = row_f32(v, b * v_stride + (int64_t)hh * d, in_dtype, d, wide2);
            float *ko = kt + b * kn + (size_t)hh * d, *vo = vt + b * kn + (size_t)hh * d;
            if (cs) { rope(x, cs, sn, d, tmp2); x = tmp2; }
            if (k_map) row_matmul(x, k_map + (size_t)hh * d * d, k_bias + (size_t)hh * d, d, ko);
            else if (k_shift) for (int e = 0; e < d; e++) ko[e] = x[e] - k_shift[hh * d + e];
            else memcpy(ko, x, sizeof(float) * d);
            if (v_shift) for (int e = 0; e < d; e++) vo[e] = y[e] - v_shift[hh * d + e];
            else memcpy(vo, y, sizeof(float) * d);
            for (int e = 0; e < d; e++) bad |= !isfinite(ko[e]) | !isfinite(vo[e]);
        }
    }
    if (bad) { free(buf); return 1; }
    for (int b = 0; b < b_n; b++) {                 /* the store */
        uint8_t *page = pool + (slots[b] / s) * page_stride;
        int64_t off = slots[b] % s;
        for (int hh = 0; hh < h_n; hh++) {
            int64_t r = (int64_t)hh * s + off;
            quantize_row(kt + b * kn + (size_t)hh * d, d, gs_k, page + sec[0] + r * cb, page + sec[2] + r * sb);
            quantize_row(vt + b * kn + (size_t)hh * d, d, gs_v, page + sec[1] + r * cb, page + sec[3] + r * sb);
        }
    }
    int64_t nmax = 1;
    for (int b = 0; b < b_n; b++) if (hi[b] - lo[b] + 1 > nmax) nmax = hi[b] - lo[b] + 1;
    float *scores = malloc(sizeof(float) * (size_t)(nmax * g_n + d + g_n * d));
    if (!scores) { free(buf); return 2; }
    for (int b = 0; b < b_n; b++)
        for (int hh = 0; hh < h_n; hh++) {
            size_t at = (size_t)b * qn + (size_t)hh * g_n * d;
            float *o = out_dtype ? scores + nmax * g_n + d : (float *)out + at;
            attend(qt + b * qn + (size_t)hh * g_n * d, g_n, d, s, pool, page_stride, sec,
                   page_ids + (size_t)b * m, hh, lo[b], hi[b], gs_k, gs_v, sm_scale,
                   scores, scores + nmax * g_n, o);
            if (v_shift)                            /* the recipe's finish */
                for (int i = 0; i < g_n; i++)
                    for (int e = 0; e < d; e++) o[i * d + e] = o[i * d + e] + v_shift[hh * d + e];
            if (out_dtype)
                for (int e = 0; e < g_n * d; e++) ((uint16_t *)out)[at + e] = bf16_round(o[e]);
        }
    free(scores);
    free(buf);
    return 0;
}
