/* Batch-invariant CPU kernels for the target (x86-64, AVX2 + FMA), called through ctypes.

Contract: every output element is computed by the same sequence of operations whatever the
number of rows (tokens, sessions) in the call and whatever the thread count. Work is split over
output columns (matmuls) or (row, head) pairs (attention), never inside one element's
reduction; rows are processed one at a time inside a tile, each with its own accumulators. So
a row's result is a function of that row's inputs alone: a verify block of k + 1 rows gives
bit-for-bit the logits that k + 1 one-row steps give, which keeps greedy output lossless in
reduced precision. Build with -ffp-contract=off so the compiler fuses no multiply-add on its own.

Formats: groups of 32 values along the input dimension K (g = k / 32), and super-blocks of P
groups (P = 8 where K allows, as llama.cpp's K-quants; b = g / P):
  activations  x[r, k] ~ xs[r, b] * xq[r, k],  xq int8 in [-127, 127], xs = amax / 127
  int8 weights w[n, k] = d[n, b] * sc[n, g] * q[n, k],  q int8 in [-127, 127]
  int4 weights w[n, k] = d[n, b] * sc[n, g] * q[n, k] - dm[n, b] * mn[n, g],  q in [0, 15],
               two per byte: byte j of a group holds element j in its low nibble, j + 16 in
               its high one. sc, mn: integer group scales under float super-block ones, so
               the inner loop stays in integers; uint8 for int8 weights, uint16 below 4096
               for int4 ones (fine enough to keep a 4-bit source's own group scales to
               ~0.1%; sums stay below 2^31: 8 groups * 2 * 15 * 127 * 4095).
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define TILE 4 /* gemm_column's switch covers remainders 1 .. TILE - 1 */
_Static_assert(TILE == 4, "gemm_column handles remainders of up to 3 rows");
#define MAX_HEAD_DIM 512 /* the Python side checks head_dim <= this and % 8 == 0 */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i unpack_q4(const uint8_t *b) {
    __m128i raw = _mm_loadu_si128((const __m128i *)b);
    __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

int specsplit_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static inline int32_t block_mins(const uint16_t *mn, const int32_t *xsum, int64_t P) {
    if (P == 8) {
        const __m256i m = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)mn));
        const __m256i v = _mm256_mullo_epi32(m, _mm256_loadu_si256((const __m256i *)xsum));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        return _mm_cvtsi128_si32(t);
    }
    int32_t total = 0;
    for (int64_t g = 0; g < P; g++) total += (int32_t)mn[g] * xsum[g];
    return total;
}

/* Groups per super-block of a K-long row: the most of 8, 4, 2, 1 that divides K / 32. */
static inline int64_t per_block(int64_t K) {
    const int64_t G = K / QK;
    return G % 8 == 0 ? 8 : (G % 4 == 0 ? 4 : (G % 2 == 0 ? 2 : 1));
}

/* x [M, K] -> xq [M, K], xs [M, B] (one scale per super-block), xsum [M, G] (sum of xq per
   group); B = K / (32 * per_block(K)) */
void specsplit_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs,
                             int32_t *xsum, int nt) {
    const int64_t L = QK * per_block(K), B = K / L;
#pragma omp parallel for num_threads(nt) schedule(static) if (M * K >= 65536)
    for (int64_t rb = 0; rb < M * B; rb++) {
        const float *v = x + rb * L;
        int8_t *q = xq + rb * L;
        float amax = 0.0f;
        for (int64_t i = 0; i < L; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t g = 0; g < L / QK; g++) {
            int32_t sum = 0;
            for (int i = 0; i < QK; i++) {
                int t = (int)nearbyintf(v[g * QK + i] * id);
                t = t > 127 ? 127 : (t < -127 ? -127 : t);
                q[g * QK + i] = (int8_t)t;
                sum += t;
            }
            xsum[rb * (L / QK) + g] = sum;
        }
        xs[rb] = d;
    }
}

/* out[M, N] = x @ w.T, weights of either format in super-blocks of P groups:
     int8 (wm == NULL): w = d[n, b] * sc[n, g] * q,           q int8 in [-127, 127]
     int4:              w = d[n, b] * sc[n, g] * q - dm[n, b] * mn[n, g],  q in [0, 15]
   Per group and row the work is all-integer (a multiply-add of the weight's
   integer scale); floats only once per super-block. */
/* One tile of rt rows (a compile-time constant after inlining, so the accumulators live in
   registers) against column n. */
static inline __attribute__((always_inline)) void gemm_tile(
    const int four, const int rt, const int8_t *xq, const float *xs, const int32_t *xsum,
    int64_t K, const uint8_t *wq, const void *sc, const float *d, const uint16_t *mn,
    const float *dm, int64_t N, float *out, int64_t n, int64_t r0) {
    const int64_t P = per_block(K), G = K / QK, B = G / P;
    const uint8_t *wrow = wq + n * (four ? K / 2 : K);
    __m256 acc[TILE];
    float offset[TILE];
    for (int i = 0; i < rt; i++) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0.0f;
    }
    for (int64_t b = 0; b < B; b++) {
        __m256i sumi[TILE];
        for (int i = 0; i < rt; i++) sumi[i] = _mm256_setzero_si256();
        for (int64_t g = b * P; g < (b + 1) * P; g++) {
            const __m256i scale = _mm256_set1_epi16(
                four ? ((const uint16_t *)sc)[n * G + g] : ((const uint8_t *)sc)[n * G + g]);
            const __m256i w = four ? unpack_q4(wrow + g * (QK / 2))
                                   : _mm256_loadu_si256((const __m256i *)(wrow + g * QK));
            const __m256i wabs = four ? w : _mm256_sign_epi8(w, w);
            for (int i = 0; i < rt; i++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (r0 + i) * K + g * QK));
                if (!four) x = _mm256_sign_epi8(x, w);
                const __m256i p = _mm256_maddubs_epi16(wabs, x);
                sumi[i] = _mm256_add_epi32(sumi[i], _mm256_madd_epi16(p, scale));
            }
        }
        for (int i = 0; i < rt; i++) {
            const float dx = xs[(r0 + i) * B + b];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[i]),
                                     _mm256_set1_ps(d[n * B + b] * dx), acc[i]);
            if (four) { /* sum over the block's groups of mn * sum(xq): exact integers */
                const int32_t mins = block_mins(mn + n * G + b * P, xsum + (r0 + i) * G + b * P, P);
                offset[i] += (dm[n * B + b] * dx) * (float)mins;
            }
        }
    }
    for (int i = 0; i < rt; i++) out[(r0 + i) * N + n] = hsum8(acc[i]) - offset[i];
}

static inline __attribute__((always_inline)) void gemm_column(
    const int four, const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,
    const uint8_t *wq, const void *sc, const float *d, const uint16_t *mn, const float *dm,
    int64_t N, float *out, int64_t n) {
    int64_t r0 = 0;
    for (; r0 + TILE <= M; r0 += TILE)
        gemm_tile(four, TILE, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, n, r0);
    switch (M - r0) { /* the same per-row work as in a full tile, fewer rows */
    case 1: gemm_tile(four, 1, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, n, r0); break;
    case 2: gemm_tile(four, 2, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, n, r0); break;
    case 3: gemm_tile(four, 3, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, n, r0); break;
    default: break;
    }
}

void specsplit_gemm(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,
                    const uint8_t *wq, const void *sc, const float *d, const uint16_t *mn,
                    const float *dm, int64_t N, float *out, int nt) {
    if (mn != NULL) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t n = 0; n < N; n++) gemm_column(1, xq, xs, xsum, M, K, wq, sc, d, mn, dm, N, out, n);
    } else {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t n = 0; n < N; n++) gemm_column(0, xq, xs, xsum, M, K, wq, sc, d, mn, dm, N, out, n);
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return hsum8(acc);
}

/* Layer `layer`'s attention for every segment of a ragged pass.
   q [R, H, D], k_new/v_new [R, KVH, D] (rotated keys); segment s owns rows
   [row0[s], row0[s] + len[s]) at positions [start[s], start[s] + len[s]) and the KV slot
   slot[s]: [layers, 2, KVH, cap[s], D] floats. Writes the new keys/values into the layer's
   cache, then out [R, H, D]: row i of a segment attends to positions 0..start + i, in
   position order. */
void specsplit_attention(const float *q, const float *k_new, const float *v_new, int64_t H,
                         int64_t KVH, int64_t D, int64_t nseg, float *const *slot,
                         int64_t layer, const int64_t *cap, const int64_t *start,
                         const int64_t *len, const int64_t *row0, float scale, float *out,
                         int nt) {
    float **cache = malloc(sizeof(float *) * (nseg > 0 ? nseg : 1));
    for (int64_t s = 0; s < nseg; s++) cache[s] = slot[s] + layer * 2 * KVH * cap[s] * D;
    int64_t rows = 0;
    for (int64_t s = 0; s < nseg; s++) {
        for (int64_t i = 0; i < len[s]; i++)
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t r = row0[s] + i, at = (h * cap[s] + start[s] + i) * D;
                memcpy(cache[s] + at, k_new + (r * KVH + h) * D, D * sizeof(float));
                memcpy(cache[s] + KVH * cap[s] * D + at, v_new + (r * KVH + h) * D,
                       D * sizeof(float));
            }
        rows += len[s];
    }
    int64_t *seg_of = malloc(sizeof(int64_t) * (rows > 0 ? rows : 1));
    for (int64_t s = 0; s < nseg; s++)
        for (int64_t i = 0; i < len[s]; i++) seg_of[row0[s] + i] = s;
    const int64_t group = H / KVH;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 4)
    for (int64_t task = 0; task < rows * H; task++) {
        const int64_t r = task / H, h = task % H, s = seg_of[r];
        const int64_t ctx = start[s] + (r - row0[s]) + 1;
        const float *keys = cache[s] + (h / group) * cap[s] * D;
        const float *values = keys + KVH * cap[s] * D;
        const float *qv = q + (r * H + h) * D;
        float *p = malloc(sizeof(float) * ctx);
        float peak = -INFINITY;
        for (int64_t j = 0; j < ctx; j++) {
            p[j] = dot_f32(qv, keys + j * D, D) * scale;
            peak = fmaxf(peak, p[j]);
        }
        float total = 0.0f;
        for (int64_t j = 0; j < ctx; j++) {
            p[j] = expf(p[j] - peak);
            total += p[j];
        }
        float acc[MAX_HEAD_DIM];
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t j = 0; j < ctx; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pj, _mm256_loadu_ps(values + j * D + d),
                                                          _mm256_loadu_ps(acc + d)));
        }
        const __m256 inv = _mm256_set1_ps(1.0f / total);
        float *o = out + (r * H + h) * D;
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), inv));
        free(p);
    }
    free(seg_of);
    free(cache);
}

