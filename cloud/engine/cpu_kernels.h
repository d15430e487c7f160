/* Shared by the target's CPU kernels (cpu_kernels.c: quantisation and matmuls; cpu_attention.c:
rotary embedding and attention; cpu_rowwise.c: the float ops between them; cpu_kquants.c and
cpu_block_quants.c: the GGUF formats), which cloud/engine/cpu_kernels.py compiles into one
library. The batch-invariance contract and the weight formats are described at
the top of cpu_kernels.c.

Every function the library exports is declared here, so the compiler checks each definition
against its prototype; cpu_kernels.py's ctypes table (_SIGNATURES, _RETURNS) must agree with
these prototypes (tests/cloud/engine/test_cpu_kernels.py parses them and checks). */

#ifndef SPECSPLIT_CPU_KERNELS_H
#define SPECSPLIT_CPU_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- cpu_kernels.c ---- */
int specsplit_has_avx2(void);
int specsplit_has_avx512vnni(void);
void specsplit_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs,
                             int16_t *xsum, int paired, int nt);
void specsplit_rmsnorm_quantize(const float *x, const float *w, float eps, int64_t M, int64_t K,
                                int8_t *xq, float *xs, int16_t *xsum, int paired, int nt);
void specsplit_gemm(const int8_t *xq, const float *xs, const int16_t *xsum, int64_t M, int64_t K,
                    const uint8_t *wq, const void *sc, const float *d, const uint16_t *mn,
                    const float *dm, int64_t N, float *out, int nt);
void specsplit_gemm_vnni(const int8_t *xq, const float *xs, const int16_t *xsum, int64_t M,
                         int64_t K, const uint8_t *wq, const uint16_t *sc, const float *d,
                         const uint16_t *mn, const float *dm, int64_t N, float *out, int nt);

/* ---- cpu_attention.c ---- */
void specsplit_rope(float *x, int64_t R, int64_t stride, int64_t H, int64_t hstride, int64_t D,
                    const float *cos, const float *sin);
int specsplit_attention(const float *q, const float *k_new, const float *v_new, int64_t H,
                        int64_t KVH, int64_t D, int64_t nseg, float *const *slot, int64_t layer,
                        const int64_t *cap, const int64_t *start, const int64_t *len,
                        const int64_t *row0, float scale, int64_t window, float softcap,
                        float *out, int nt);

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

/* ---- block-32 formats (cpu_block_quants.c): GGUF's Q8_0, Q5_0, Q4_0 at their own widths ----
   fmt: 0 q8_0, 1 q5_0, 2 q4_0 (block_quants.FORMATS); high: q5_0's high bits, else NULL. */
void specsplit_block_gemm(int fmt, const int8_t *xq, const float *xs, const int16_t *xsum,
                          int64_t M, int64_t K, const uint8_t *v, const uint32_t *high,
                          const uint16_t *d, int64_t N, float *out, int nt);
void specsplit_block_gemm_vnni(int fmt, const int8_t *xq, const float *xs, const int16_t *xsum,
                               int64_t M, int64_t K, const uint8_t *v, const uint32_t *high,
                               const uint16_t *d, int64_t N, float *out, int nt);

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
