/* Shared by the target's CPU kernels (cpu_kernels.c: quantisation and matmuls; cpu_attention.c:
rotary embedding and attention), which cloud/engine/cpu_kernels.py compiles into one library.
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

/* ---- K-quants (cpu_kquants.c; cloud/engine/kquants.py builds these and the layouts) ---- */

/* Activations, as cloud/engine/cpu_kernels.py's QuantizedRows holds them, plus a work buffer
   for q6_k's sums per 16 values, which the matmul fills (NULL where it fits the matmul's
   stack, cpu_kquants.c's KQ_LOCAL_SUMS). */
typedef struct {
    int64_t m, k;
    const int8_t *xq;      /* [m, k], the kernel's layout */
    const float *xs;       /* [m, k / 256] */
    const int16_t *xsum;   /* [m, k / 32] */
    int32_t *xsum16;       /* q6_k, m * k / 16 > 8192: [m, k / 16] int32 of scratch; else NULL */
} specsplit_kq_rows;

/* One matmul's K-quant weights in a kernel's layout (cpu_kquants.c's header). */
typedef struct {
    int32_t fmt;           /* 0 q4_k, 1 q5_k, 2 q6_k */
    int64_t n;             /* output columns */
    const uint8_t *ql;     /* low 4 bits of the levels */
    const uint8_t *qh;     /* q5_k: bit 4; q6_k: bits 4, 5; NULL for q4_k */
    const void *sc;        /* uint8 (q4_k, q5_k) or int8 (q6_k) sub-block scales */
    const uint16_t *d;     /* float16 super-block scales */
    const uint8_t *mn;     /* q4_k, q5_k: uint8 mins; else NULL */
    const uint16_t *dm;    /* q4_k, q5_k: float16 super-block mins; else NULL */
} specsplit_kq_weights;

/* 0, or -1 (nothing computed) where q6_k's work buffer is needed and NULL. */
int specsplit_kq_gemm(const specsplit_kq_rows *x, const specsplit_kq_weights *w, float *out, int nt);
int specsplit_kq_gemm_vnni(const specsplit_kq_rows *x, const specsplit_kq_weights *w, float *out,
                           int nt);

#endif
