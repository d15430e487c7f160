/* Shared by the target's CPU kernels (cpu_kernels.c: quantisation and matmuls; cpu_attention.c:
rotary embedding and attention; cpu_rowwise.c: the float ops between them; cpu_kquants.c and
cpu_block_quants.c: the GGUF formats), which cloud/engine/kernel_library.py compiles into one
library. The batch-invariance contract and the weight formats are described at
the top of cpu_kernels.c.

Every function the library exports is declared here, so the compiler checks each definition
against its prototype; kernel_library.py's ctypes table (_SIGNATURES, _RETURNS) must agree with
these prototypes (tests/cloud/engine/test_cpu_kernels.py parses them and checks). */

#ifndef SPECSPLIT_CPU_KERNELS_H
#define SPECSPLIT_CPU_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- parameter structs: what the exported functions read, one struct per concept ---- */

/* Activations quantised per 32 values, as cloud/engine/cpu_kernels.py's QuantizedRows holds
   them: x[r, k] ~ xs[r, b] * xq[r, k] (cpu_kernels.c's formats). The quantising functions
   write xq, xs and xsum; the matmuls read them. xsum16 is q6_k's work buffer for its sums per
   16 values, which its matmul fills (NULL where they fit its stack, cpu_kquants.c's
   KQ_LOCAL_SUMS, and for every other kernel). */
typedef struct {
    int64_t m, k;
    int8_t *xq;      /* [m, k], the kernel's layout (paired for AVX2, else natural) */
    float *xs;       /* [m, k / (32 * per_block(k))] */
    int16_t *xsum;   /* [m, k / 32] */
    int32_t *xsum16; /* q6_k, m * k / 16 > 8192: [m, k / 16] int32 of scratch; else NULL */
} specsplit_rows;

/* Our own int8 / int4 weights in a kernel's layout (cpu_kernels.c's header). */
typedef struct {
    int64_t n;          /* output columns */
    const uint8_t *q;   /* levels: int8, or two int4 a byte */
    const void *sc;     /* group scales: uint8 (int8 weights) or uint16 (int4; VNNI: always) */
    const float *d;     /* super-block scales */
    const uint16_t *mn; /* int4: group mins; NULL for int8 */
    const float *dm;    /* int4: super-block mins; NULL for int8 */
} specsplit_weights;

/* One matmul's K-quant weights in a kernel's layout (cpu_kquants.c's header). */
typedef struct {
    int32_t fmt;        /* 0 q4_k, 1 q5_k, 2 q6_k */
    int64_t n;          /* output columns */
    const uint8_t *ql;  /* low 4 bits of the levels */
    const uint8_t *qh;  /* q5_k: bit 4; q6_k: bits 4, 5; NULL for q4_k */
    const void *sc;     /* uint8 (q4_k, q5_k) or int8 (q6_k) sub-block scales */
    const uint16_t *d;  /* float16 super-block scales */
    const uint8_t *mn;  /* q4_k, q5_k: uint8 mins; else NULL */
    const uint16_t *dm; /* q4_k, q5_k: float16 super-block mins; else NULL */
} specsplit_kq_weights;

/* One matmul's block-32 weights (GGUF's Q8_0, Q5_0, Q4_0) in a kernel's layout
   (cpu_block_quants.c's header). */
typedef struct {
    int32_t fmt;          /* 0 q8_0, 1 q5_0, 2 q4_0 (block_quants.FORMATS) */
    int64_t n;            /* output columns */
    const uint8_t *v;     /* values: q8_0 bytes or nibbles */
    const uint32_t *high; /* q5_0's high bits, else NULL */
    const uint16_t *d;    /* float16 group scales */
} specsplit_block_weights;

/* A ragged pass's segments as attention reads them (cpu_kernels.py's RaggedBatch, built once
   per pass): segment s is rows [row0[s], row0[s] + len[s]) at positions [start[s], start[s] +
   len[s]) of the KV slot slot[s], [layers, 2, kv_heads, cap[s], head_dim] floats. */
typedef struct {
    int64_t count;
    float *const *slot;
    const int64_t *cap, *start, *len, *row0;
} specsplit_segments;

/* One layer's attention over a pass: q [R, heads, head_dim], the new keys and values
   [R, kv_heads, head_dim]; window > 0: a sliding window; softcap > 0: scores soft-capped. */
typedef struct {
    const float *q, *k_new, *v_new;
    int64_t heads, kv_heads, head_dim, layer;
    float scale;
    int64_t window;
    float softcap;
} specsplit_attention_args;

/* Vectors of dim values inside rows: `heads` of them a row, head_stride floats apart, rows
   `stride` floats apart (a fused q/k/v output's q heads, say). */
typedef struct {
    float *x;
    int64_t rows, stride, heads, head_stride, dim;
} specsplit_heads;

/* A residual add's inputs (cpu_rowwise.c's specsplit_residual_add): x and y [m, k], rows
   contiguous, k a multiple of 8; w [k] and eps normalise y first, w NULL: plain x + y. */
typedef struct {
    const float *x, *y; /* the residual stream and a layer's branch */
    int64_t m, k;
    const float *w; /* the branch's RMSNorm weight, or NULL */
    float eps;
} specsplit_residual_args;

/* ---- cpu_kernels.c ---- */
int specsplit_has_avx2(void);
int specsplit_has_avx512vnni(void);
void specsplit_quantize_rows(const float *x, const specsplit_rows *out, int paired, int nt);
void specsplit_rmsnorm_quantize(const float *x, const float *w, float eps,
                                const specsplit_rows *out, int paired, int nt);
void specsplit_gemm(const specsplit_rows *x, const specsplit_weights *w, float *out, int nt);
void specsplit_gemm_vnni(const specsplit_rows *x, const specsplit_weights *w, float *out, int nt);

/* ---- cpu_attention.c ---- */
void specsplit_rope(const specsplit_heads *x, const float *cos, const float *sin);
int specsplit_attention(const specsplit_attention_args *a, const specsplit_segments *seg,
                        float *out, int nt);

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0, 8 at a time: 2^n * P(r), x = n ln2 + r, |r| <= ln2 / 2, P of degree 6
   (Cephes' expf: ~1 ulp); below -87.3 the result is 0. Deterministic, so a row's softmax
   (cpu_attention.c) and activation (cpu_rowwise.c) do not depend on what else is in the pass. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r),
                      _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

/* One parallel loop `for (int64_t i = 0; i < count; i++) STEP(F, i)` per weight format F in
   0, 1, 2 (cpu_kquants.c's and cpu_block_quants.c's enums), chosen by fmt; any other fmt
   computes nothing. F reaches each loop as a literal: OpenMP outlines a parallel loop before
   anything is inlined, so a format passed in a variable would stay a variable in the outlined
   loop, and the always-inline kernels would not be specialised per format. Reads `nt`, the
   thread count, from the caller's scope. */
// clang-format off: one statement a line reads better than the formatter's packing
#define SPECSPLIT_PARALLEL_LOOP_(F, count, i, STEP)                       \
    _Pragma("omp parallel for num_threads(nt) schedule(static)")          \
    for (int64_t i = 0; i < (count); i++) STEP(F, i)
#define SPECSPLIT_FOR_EACH_FORMAT(fmt, count, i, STEP)                    \
    switch (fmt) {                                                        \
    case 0: SPECSPLIT_PARALLEL_LOOP_(0, count, i, STEP); break;           \
    case 1: SPECSPLIT_PARALLEL_LOOP_(1, count, i, STEP); break;           \
    case 2: SPECSPLIT_PARALLEL_LOOP_(2, count, i, STEP); break;           \
    default: break;                                                       \
    }
// clang-format on

/* ---- K-quants (cpu_kquants.c; cloud/engine/kquants.py builds the layouts) ---- */

/* 0, or -1 (nothing computed) where q6_k's work buffer is needed and NULL. */
int specsplit_kq_gemm(const specsplit_rows *x, const specsplit_kq_weights *w, float *out, int nt);
int specsplit_kq_gemm_vnni(const specsplit_rows *x, const specsplit_kq_weights *w, float *out,
                           int nt);

/* ---- block-32 formats (cpu_block_quants.c): GGUF's Q8_0, Q5_0, Q4_0 at their own widths ---- */
void specsplit_block_gemm(const specsplit_rows *x, const specsplit_block_weights *w, float *out,
                          int nt);
void specsplit_block_gemm_vnni(const specsplit_rows *x, const specsplit_block_weights *w,
                               float *out, int nt);

#define QK 32 /* values per group (cpu_kernels.c's formats) */

/* ---- the GGUF blocks, as a file stores them (ggml-common.h's layout) ----
   The kernels read their own layouts (above); cloud/engine/kquants.py and block_quants.py read
   these blocks from a GGUF file and repack them. tests/cloud/engine/test_cpu_kernels.py checks
   that their block sizes (GGUF_BLOCK_BYTES, BLOCK_BYTES) are these structs' sizes. */
#define QK_K 256                 /* values per K-quant super-block */
typedef uint16_t specsplit_half; /* IEEE float16 bits */

typedef struct {
    specsplit_half d;     /* super-block scale of the sub-block scales */
    specsplit_half dmin;  /* super-block scale of the sub-block mins */
    uint8_t scales[12];   /* 8 scales and 8 mins of 6 bits, packed */
    uint8_t qs[QK_K / 2]; /* 4-bit levels */
} specsplit_block_q4_k;
_Static_assert(sizeof(specsplit_block_q4_k) == 144, "q4_k: 4.5 bits a weight");

typedef struct {
    specsplit_half d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8]; /* bit 4 of each level */
    uint8_t qs[QK_K / 2]; /* bits 0..3 */
} specsplit_block_q5_k;
_Static_assert(sizeof(specsplit_block_q5_k) == 176, "q5_k: 5.5 bits a weight");

typedef struct {
    uint8_t ql[QK_K / 2];     /* bits 0..3 of each level */
    uint8_t qh[QK_K / 4];     /* bits 4, 5 */
    int8_t scales[QK_K / 16]; /* 16 sub-block scales, 8 bits */
    specsplit_half d;         /* super-block scale */
} specsplit_block_q6_k;
_Static_assert(sizeof(specsplit_block_q6_k) == 210, "q6_k: 6.5625 bits a weight");

typedef struct {
    specsplit_half d;
    int8_t qs[QK];
} specsplit_block_q8_0;
_Static_assert(sizeof(specsplit_block_q8_0) == 34, "q8_0: 8.5 bits a weight");

typedef struct {
    specsplit_half d;
    uint8_t qh[4];      /* bit 4 of each of the 32 levels */
    uint8_t qs[QK / 2]; /* bits 0..3 */
} specsplit_block_q5_0;
_Static_assert(sizeof(specsplit_block_q5_0) == 22, "q5_0: 5.5 bits a weight");

typedef struct {
    specsplit_half d;
    uint8_t qs[QK / 2];
} specsplit_block_q4_0;
_Static_assert(sizeof(specsplit_block_q4_0) == 18, "q4_0: 4.5 bits a weight");

/* Shared between the library's files, not exported (hidden: so cpu_kernels.c still inlines
   them under -fPIC). Defined in cpu_kernels.c. */
#define SPECSPLIT_INTERNAL __attribute__((visibility("hidden")))
SPECSPLIT_INTERNAL int64_t per_block(int64_t K);
SPECSPLIT_INTERNAL void quantize_block(const float *v, int64_t L, int8_t *q, float *xs,
                                       int16_t *xsum, int paired);

/* row-wise ops (cpu_rowwise.c) */
void specsplit_act_mul(const float *gu, int64_t M, int64_t F, int act, float *out, int nt);
/* act(gate) * up of gu [out->m, 2 * out->k], quantised as specsplit_quantize_rows does. */
void specsplit_act_mul_quantize(const float *gu, int act, const specsplit_rows *out, int paired,
                                int nt);
/* RMSNorm of each vector of x (x->dim values, w [x->dim]) into out, same heads and head
   stride, rows out_stride floats apart. */
void specsplit_rmsnorm(const specsplit_heads *x, const float *w, float eps, float *out,
                       int64_t out_stride, int nt);
void specsplit_residual_add(const specsplit_residual_args *args, float *out, int nt);
void specsplit_soft_cap(const float *x, int64_t n, float cap, float *out, int nt);

#endif
