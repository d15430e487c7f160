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

/* ---- block-32 formats (cpu_block_quants.c): GGUF's Q8_0, Q5_0, Q4_0 at their own widths ----
   fmt: 0 q8_0, 1 q5_0, 2 q4_0 (block_quants.FORMATS); high: q5_0's high bits, else NULL. */
void specsplit_block_gemm(int fmt, const int8_t *xq, const float *xs, const int16_t *xsum,
                          int64_t M, int64_t K, const uint8_t *v, const uint32_t *high,
                          const uint16_t *d, int64_t N, float *out, int nt);
void specsplit_block_gemm_vnni(int fmt, const int8_t *xq, const float *xs, const int16_t *xsum,
                               int64_t M, int64_t K, const uint8_t *v, const uint32_t *high,
                               const uint16_t *d, int64_t N, float *out, int nt);

#endif
