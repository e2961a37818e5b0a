/* bfloat16 as raw uint16 for the CPU kernels of this directory (included, not built alone):
 * widening is exact, rounding is to nearest even with NaN kept quiet, as torch does. */
#ifndef NIBBLE_BF16_H
#define NIBBLE_BF16_H
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
#endif
