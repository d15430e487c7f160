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

#endif
