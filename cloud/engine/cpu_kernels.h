/* Shared by the target's CPU kernels (cpu_kernels.c: quantisation and matmuls; cpu_attention.c:
rotary embedding and attention; cpu_rowwise.c: the float ops between them), which cloud/engine/cpu_kernels.py compiles into one library.
The batch-invariance contract and the weight formats are described at the top of cpu_kernels.c. */
#ifndef SPECSPLIT_CPU_KERNELS_H
#define SPECSPLIT_CPU_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define QK 32 /* values per group (cpu_kernels.c's formats) */

/* Shared between the library's files, not exported (hidden: so cpu_kernels.c still inlines
   them under -fPIC). Defined in cpu_kernels.c. */
#define SPECSPLIT_INTERNAL __attribute__((visibility("hidden")))
SPECSPLIT_INTERNAL int64_t per_block(int64_t K);
SPECSPLIT_INTERNAL void quantize_block(const float *v, int64_t L, int8_t *q, float *xs,
                                       int16_t *xsum, int paired);

/* row-wise ops (cpu_rowwise.c) */
void specsplit_act_mul(const float *gu, int64_t M, int64_t F, int act, float *out, int nt);
void specsplit_act_mul_quantize(const float *gu, int64_t M, int64_t F, int act, int8_t *xq,
                                float *xs, int16_t *xsum, int paired, int nt);
void specsplit_rmsnorm(const float *x, int64_t M, int64_t stride, int64_t H, int64_t D,
                       const float *w, float eps, float *out, int64_t out_stride, int nt);
void specsplit_residual_add(const float *x, const float *y, int64_t M, int64_t K, const float *w,
                            float eps, float *out, int nt);
void specsplit_soft_cap(const float *x, int64_t n, float cap, float *out, int nt);

#endif
