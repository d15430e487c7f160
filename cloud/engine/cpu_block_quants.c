/* Matmuls over GGUF's block-32 formats (Q8_0, Q5_0, Q4_0) at their own widths: one float16
scale per group of 32 weights, no super-block scale. Part of the library kernel_library.py builds;
the batch-invariance contract is cpu_kernels.c's (work split over output columns only, never
inside one element's reduction; -ffp-contract=off).

Formats (group g = k / 32; u the stored unsigned level, v = u - bias the signed value):
  q8_0  w[n, k] = d[n, g] * v,  v int8 (stored as is; -128 allowed),
  q5_0  w[n, k] = d[n, g] * v,  v = u - 16, u in [0, 31] (4 low bits + 1 high bit),
  q4_0  w[n, k] = d[n, g] * v,  v = u - 8,  u in [0, 15];
  d float16, widened exactly to float32. Activations as cpu_kernels.c's: xq int8, xs one
  float32 per super-block of P groups (P = per_block(K): 8, 4 or 2), xsum the sum of each
  group's xq.

The canonical product of block-32 formats (cloud/engine/block_quants.py has it in torch as
``reference_gemm`` for the tests):
  S[r, n, g] = sum over the group's k of v[n, k] * xq[r, k]   (exact int32)
  a = 0.0f; for g in order:  a = a + (float)S * (d[n, g] * xs[r, g / P]);
  out[r, n] = a;   every float operation rounded on its own (no fused multiply-add).
|S| <= 32 * 128 * 127 < 2^24, so (float)S is exact. Kernels that read the unsigned level u
start the group's integer sum at -bias * xsum[r, g] and add u * xq: the same exact S.

Weight layout ("columns", block_quants.pack makes it from the natural one), for both kernels:
blocks of L output columns (L = 8 for AVX2, 16 for AVX-512), one 32-bit lane per column, N
padded with zero columns to whole blocks; per block and group:
  q8_0  eight vectors [8 j][L][4 t]: lane n, byte t of vector j = element 4j + t of column n
        (AVX2: v as int8, vpmaddubsw taking |v| and moving v's sign onto xq, as cpu_kernels.c's
        int8 does; AVX-512: u = v + 128 as uint8, for u8 x s8 vpdpbusd);
  q5_0, q4_0  four vectors [4 i][L][4 t] of nibbles: byte t of lane n of vector i holds the
        low 4 bits of u of element 8i + t (low nibble) and 8i + 4 + t (high nibble);
  q5_0  the high bits of u, 4 bytes per column: AVX2, one uint32 per column [L] whose bit
        8t + j is that of element 4j + t, so one shift moves the four high bits of "vector" j
        (j = 2i low nibbles, 2i + 1 high) onto bit 4 of their bytes; AVX-512, one 64-bit mask
        per vector [8 j] whose bit 4n + t is that of element 4j + t of column n, added as 16
        by one masked byte add (~10% more one-row GB/s than the shifts on EPYC);
  d     [L] float16.
Each stream (values, high bits, scales) is one tensor, laid out block after block, group after
group, so every kernel reads three sequential streams at most. Every block-32 weight is read
at the GGUF's own width (8.5, 5.5, 4.5 bits).

The activations come as QuantizedRows makes them for the kernel: AVX2 in the paired layout
(cpu_kernels.c), in which the 4 values of "vector" j of group g still lie together; AVX-512
in natural order. */
#include "cpu_kernels.h"

#define QK 32
#define ROWS 4 /* rows per tile: each tile reads a block's weights once */
/* block_quants.FORMATS' order, the formats 0, 1, 2 of SPECSPLIT_FOR_EACH_FORMAT */
enum block_format { Q8_0 = 0, Q5_0 = 1, Q4_0 = 2 };

/* One group's weights of a block of L columns in each stream. */
typedef struct {
    int8_t v[8][16][4];
} q8_0_group16;
typedef struct {
    int8_t v[8][8][4];
} q8_0_group8;
typedef struct {
    uint8_t nib[4][16][4];
} nibbles_group16;
typedef struct {
    uint8_t nib[4][8][4];
} nibbles_group8;
_Static_assert(sizeof(q8_0_group16) == 16 * QK, "q8_0: a byte per weight");
_Static_assert(sizeof(q8_0_group8) == 8 * QK, "q8_0: a byte per weight");
_Static_assert(sizeof(nibbles_group16) == 16 * QK / 2, "two weights a byte");
_Static_assert(sizeof(nibbles_group8) == 8 * QK / 2, "two weights a byte");

/* Groups per super-block of a K-long row (cpu_kernels.c's per_block; K a multiple of 64). */
static inline int64_t groups_per_block(int64_t K) {
    const int64_t G = K / QK;
    return G % 8 == 0 ? 8 : (G % 4 == 0 ? 4 : 2);
}

static inline int32_t load_i32(const void *p) { /* no strict-aliasing cast */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* u - v of the kernels' unsigned levels (AVX2 reads q8_0 signed: it uses bias only for q5_0, q4_0) */
static inline int32_t bias(const int fmt) { return fmt == Q8_0 ? 128 : (fmt == Q5_0 ? 16 : 8); }

/* One call's arguments, flattened for the kernels below (the exported functions take the
   header's structs). */
typedef struct {
    const int8_t *xq;
    const float *xs;
    const int16_t *xsum;
    int64_t M, K;
    const uint8_t *v;     /* values: q8_0 bytes or nibbles */
    const uint32_t *high; /* q5_0's high bits, else NULL */
    const uint16_t *d;    /* float16 group scales */
    int64_t N;
    float *out;
    int64_t groups; /* in each stream: blocks of columns x K / 32 */
} block_gemm_args;

/* blocks: blocks of columns (8 or 16 lanes each) in the weights' layout. */
static inline block_gemm_args call_args(const specsplit_rows *x, const specsplit_block_weights *w,
                                        float *out, int64_t blocks) {
    const block_gemm_args a = {
        x->xq, x->xs, x->xsum, x->m, x->k, w->v, w->high, w->d, w->n, out, blocks * (x->k / QK)};
    return a;
}

/* q5_0 reads three streams and does the most work a byte: the hardware prefetcher alone left
   it 13-20% below q4_0's GB/s on EPYC (one core, one row, K = 896; both kernels). Asking for
   its values and high bits PREFETCH_GROUPS groups ahead closes most of that; q8_0 and q4_0
   stream as fast without (q8_0 ~5% slower with). Prefetches past the end never fault, but
   none is issued there. */
#define PREFETCH_GROUPS 4
static inline __attribute__((always_inline)) void prefetch_q5_0(const block_gemm_args *a,
                                                                int64_t at, int64_t lanes) {
    if (at + PREFETCH_GROUPS >= a->groups) return;
    const int64_t bytes = lanes * QK / 2; /* one group's nibbles */
    const char *ahead = (const char *)a->v + (at + PREFETCH_GROUPS) * bytes;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    _mm_prefetch((const char *)(a->high + (at + PREFETCH_GROUPS) * lanes), _MM_HINT_T0);
}

/* ---- AVX2 + FMA (+ F16C, which every AVX2 CPU has): 8 columns a vector ---- */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX2_LANES 8

/* Byte offset of "vector" j (values 4j .. 4j + 3) of group g in a row of paired activations:
   each pair of groups as [g 0..15 | g+1 0..15 | g 16..31 | g+1 16..31]. */
static inline int64_t paired_offset(int64_t g, int j) {
    return (g / 2) * 2 * QK + (g % 2) * 16 + (j < 4 ? 4 * j : 32 + 4 * (j - 4));
}

/* Vectors j0 .. j0 + 3 of one group's weights as the bytes maddubs takes first (unsigned):
   |v| for q8_0 (the activations take v's sign), else u. */
static inline __attribute__((always_inline)) AVX2_TARGET void
avx2_weights(const int fmt, const block_gemm_args *a, int64_t at, int j0, __m256i *w,
             __m256i *sgn) {
    if (fmt == Q8_0) {
        const q8_0_group8 *q = (const q8_0_group8 *)a->v + at;
        for (int j = 0; j < 4; j++) {
            sgn[j] = _mm256_loadu_si256((const __m256i *)q->v[j0 + j]);
            w[j] = _mm256_sign_epi8(sgn[j], sgn[j]);
        }
        return;
    }
    const nibbles_group8 *q = (const nibbles_group8 *)a->v + at;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 2; i++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)q->nib[j0 / 2 + i]);
        w[2 * i] = _mm256_and_si256(b, low);
        w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
    if (fmt == Q5_0) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(a->high + at * AVX2_LANES));
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        for (int j = 0; j < 4; j++) { /* bit 8t + (j0 + j) -> bit 8t + 4 */
            const int s = j0 + j;
            const __m256i m = s <= 4 ? _mm256_slli_epi32(h, 4 - s) : _mm256_srli_epi32(h, s - 4);
            w[j] = _mm256_or_si256(w[j], _mm256_and_si256(m, bit4));
        }
    }
}

static inline __attribute__((always_inline)) AVX2_TARGET void
avx2_tile(const int fmt, const int rt, const block_gemm_args *a, int64_t cb, int64_t r0) {
    const int64_t K = a->K, G = K / QK, P = groups_per_block(K), B = G / P;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS];
    for (int i = 0; i < rt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t at = cb * G + g; /* this block's group g in every stream */
        if (fmt == Q5_0) prefetch_q5_0(a, at, AVX2_LANES);
        __m256i S[ROWS];
        for (int i = 0; i < rt; i++) /* start at -bias * xsum: the sum of v * xq, not u * xq */
            S[i] = fmt == Q8_0 ? _mm256_setzero_si256()
                               : _mm256_set1_epi32(-a->xsum[(r0 + i) * G + g] * bias(fmt));
        for (int j0 = 0; j0 < 8; j0 += 4) {
            __m256i w[4], sgn[4];
            avx2_weights(fmt, a, at, j0, w, sgn);
            for (int i = 0; i < rt; i++) {
                const int8_t *x = a->xq + (r0 + i) * K;
                __m256i p[4];
                for (int j = 0; j < 4; j++) {
                    __m256i xb = _mm256_set1_epi32(load_i32(x + paired_offset(g, j0 + j)));
                    if (fmt == Q8_0) xb = _mm256_sign_epi8(xb, sgn[j]);
                    p[j] = _mm256_maddubs_epi16(w[j], xb);
                }
                if (fmt == Q8_0) { /* |pairs| <= 2 * 128 * 127: widen each */
                    for (int j = 0; j < 4; j++)
                        S[i] = _mm256_add_epi32(S[i], _mm256_madd_epi16(p[j], ones));
                } else { /* four of at most 2 * 31 * 127 add in 16 bits */
                    const __m256i t = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]),
                                                       _mm256_add_epi16(p[2], p[3]));
                    S[i] = _mm256_add_epi32(S[i], _mm256_madd_epi16(t, ones));
                }
            }
        }
        const __m256 d =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a->d + at * AVX2_LANES)));
        for (int i = 0; i < rt; i++) {
            const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(a->xs[(r0 + i) * B + g / P]));
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(S[i]), dx));
        }
    }
    const int64_t n0 = cb * AVX2_LANES, live = a->N - n0 < AVX2_LANES ? a->N - n0 : AVX2_LANES;
    for (int i = 0; i < rt; i++) {
        float *o = a->out + (r0 + i) * a->N + n0;
        if (live == AVX2_LANES)
            _mm256_storeu_ps(o, acc[i]);
        else {
            float t[AVX2_LANES];
            _mm256_storeu_ps(t, acc[i]);
            memcpy(o, t, (size_t)live * sizeof(float));
        }
    }
}

static inline __attribute__((always_inline)) AVX2_TARGET void
avx2_block(const int fmt, const block_gemm_args *a, int64_t cb) {
    int64_t r0 = 0;
    for (; r0 + ROWS <= a->M; r0 += ROWS) avx2_tile(fmt, ROWS, a, cb, r0);
    switch (a->M - r0) { /* the same per-row work as in a full tile, fewer rows */
    case 1: avx2_tile(fmt, 1, a, cb, r0); break;
    case 2: avx2_tile(fmt, 2, a, cb, r0); break;
    case 3: avx2_tile(fmt, 3, a, cb, r0); break;
    default: break;
    }
}

/* out[M, N] = x @ w.T for weights of w->fmt (enum block_format) in the columns layout of 8;
   activations in the paired layout. */
AVX2_TARGET void specsplit_block_gemm(const specsplit_rows *x, const specsplit_block_weights *w,
                                      float *out, int nt) {
    const int64_t blocks = (w->n + AVX2_LANES - 1) / AVX2_LANES;
    const block_gemm_args a = call_args(x, w, out, blocks);
#define AVX2_BLOCK(F, cb) avx2_block(F, &a, cb)
    SPECSPLIT_FOR_EACH_FORMAT(w->fmt, blocks, cb, AVX2_BLOCK)
#undef AVX2_BLOCK
}

/* ---- AVX-512 VNNI: 16 columns a vector ---- */

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define LANES 16

/* One group's eight weight vectors as unsigned bytes u (q8_0: v + 128, stored so). */
static inline __attribute__((always_inline)) VNNI_TARGET void
vnni_weights(const int fmt, const block_gemm_args *a, int64_t at, __m512i *w) {
    if (fmt == Q8_0) {
        const q8_0_group16 *q = (const q8_0_group16 *)a->v + at;
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(q->v[j]);
        return;
    }
    const nibbles_group16 *q = (const nibbles_group16 *)a->v + at;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; i++) {
        const __m512i b = _mm512_loadu_si512(q->nib[i]);
        w[2 * i] = _mm512_and_si512(b, low);
        w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    }
    if (fmt == Q5_0) {
        const uint64_t *h = (const uint64_t *)(a->high + at * LANES);
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        for (int j = 0; j < 8; j++) {
            uint64_t m;
            memcpy(&m, h + j, sizeof m);
            w[j] = _mm512_mask_add_epi8(w[j], _cvtu64_mask64(m), w[j], bit4);
        }
    }
}

static inline __attribute__((always_inline)) VNNI_TARGET void
vnni_tile(const int fmt, const int rt, const block_gemm_args *a, int64_t cb, int64_t r0) {
    const int64_t K = a->K, G = K / QK, P = groups_per_block(K), B = G / P;
    __m512 acc[ROWS];
    for (int i = 0; i < rt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t at = cb * G + g;
        if (fmt == Q5_0) prefetch_q5_0(a, at, LANES);
        __m512i w[8];
        vnni_weights(fmt, a, at, w);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a->d + at * LANES)));
        for (int i = 0; i < rt; i++) {
            const int8_t *x = a->xq + (r0 + i) * K + g * QK;
            /* u = v + bias: start at -bias * xsum so the chains add up to sum v * xq */
            __m512i t0 = _mm512_set1_epi32(-a->xsum[(r0 + i) * G + g] * bias(fmt));
            __m512i t1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                t0 = _mm512_dpbusd_epi32(t0, w[j], _mm512_set1_epi32(load_i32(x + 4 * j)));
                t1 = _mm512_dpbusd_epi32(t1, w[j + 1], _mm512_set1_epi32(load_i32(x + 4 * j + 4)));
            }
            const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(a->xs[(r0 + i) * B + g / P]));
            const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(s, dx));
        }
    }
    const int64_t n0 = cb * LANES;
    const __mmask16 keep = a->N - n0 >= LANES ? 0xFFFF : (__mmask16)((1u << (a->N - n0)) - 1);
    for (int i = 0; i < rt; i++) _mm512_mask_storeu_ps(a->out + (r0 + i) * a->N + n0, keep, acc[i]);
}

static inline __attribute__((always_inline)) VNNI_TARGET void
vnni_block(const int fmt, const block_gemm_args *a, int64_t cb) {
    int64_t r0 = 0;
    for (; r0 + ROWS <= a->M; r0 += ROWS) vnni_tile(fmt, ROWS, a, cb, r0);
    switch (a->M - r0) {
    case 1: vnni_tile(fmt, 1, a, cb, r0); break;
    case 2: vnni_tile(fmt, 2, a, cb, r0); break;
    case 3: vnni_tile(fmt, 3, a, cb, r0); break;
    default: break;
    }
}

/* specsplit_block_gemm for the columns layout of 16; activations in natural order. */
VNNI_TARGET void specsplit_block_gemm_vnni(const specsplit_rows *x,
                                           const specsplit_block_weights *w, float *out, int nt) {
    const int64_t blocks = (w->n + LANES - 1) / LANES;
    const block_gemm_args a = call_args(x, w, out, blocks);
#define VNNI_BLOCK(F, cb) vnni_block(F, &a, cb)
    SPECSPLIT_FOR_EACH_FORMAT(w->fmt, blocks, cb, VNNI_BLOCK)
#undef VNNI_BLOCK
}
