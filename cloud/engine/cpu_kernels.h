/* Shared by the target's CPU kernels (cpu_kernels.c: quantisation and matmuls; cpu_attention.c:
rotary embedding and attention; every cpu_*.c beside them), which cloud/engine/cpu_kernels.py
compiles into one library. The batch-invariance contract and the weight formats are described at
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

#endif
