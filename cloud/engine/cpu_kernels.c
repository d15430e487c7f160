/* Batch-invariant CPU kernels for the target (x86-64: AVX2 + FMA, and AVX-512 VNNI where the
CPU has it), called through ctypes: activation quantisation and the matmuls here, rotary
embedding and attention in cpu_attention.c.

Contract: every output element is computed by the same sequence of operations whatever the
number of rows (tokens, sessions) in the call, whatever the thread count, and whichever of the
matmul kernels runs. Work is split over output columns (matmuls) or (row, head) pairs
(attention), never inside one element's reduction. So a row's result is a function of that
row's inputs alone: a verify block of k + 1 rows gives bit-for-bit the logits that k + 1
one-row steps give, which keeps greedy output lossless in reduced precision. Build with
-ffp-contract=off so the compiler fuses no multiply-add on its own.

Formats: groups of 32 values along the input dimension K (g = k / 32), read in pairs (K is a
multiple of 64), and super-blocks of P groups (P = 8 where K allows, as llama.cpp's K-quants,
else 4 or 2; b = g / P):
  activations  x[r, k] ~ xs[r, b] * xq[r, k],  xq int8 in [-127, 127], xs = amax / 127,
               xsum[r, g] = sum of the group's xq (int16)
  int8 weights w[n, k] = d[n, b] * sc[n, g] * q[n, k],  q int8 in [-127, 127]
  int4 weights w[n, k] = d[n, b] * sc[n, g] * q[n, k] - dm[n, b] * mn[n, g],  q in [0, 15]
               sc, mn: integer group scales under float super-block ones, so the inner loop
               stays in integers; uint8 for int8 weights, uint16 below 4096 for int4 ones
               (fine enough to keep a 4-bit source's own group scales to ~0.1%).

The canonical product (what every matmul kernel computes, bit for bit; cloud/engine/cpu_kernels.py has
it in torch as ``reference_gemm`` for the tests):
  S[r, n, b] = sum over the block's groups of sc[n, g] * sum_k q[n, k] xq[r, k]   (exact int32)
  M[r, n, b] = sum over the block's groups of mn[n, g] * xsum[r, g]   (exact; int4 only, else 0)
  a = o = 0.0f; for b in order:  a = a + (float)S * (d[n, b] * xs[r, b]);
                                 o = o + (float)M * (dm[n, b] * xs[r, b]);
  out[r, n] = a - o;   every float operation rounded on its own (no fused multiply-add).
Integer sums are exact whatever their order (any kernel may add them as it likes; int32
wrap-around cancels where a kernel's partial sums overflow and the true sum does not), so only
that float sequence fixes the result.
The block-32 formats (GGUF's Q8_0, Q5_0, Q4_0: cpu_block_quants.c) have a float16 scale d per
group and no super-block scale; their canonical product (block_quants.reference_gemm in torch):
  S[r, n, g] = sum over the group's k of v[n, k] * xq[r, k]   (exact int32, v the signed value)
  a = 0.0f; for g in order:  a = a + (float)S * (d[n, g] * xs[r, g / P]);   out[r, n] = a;
  d widened exactly from float16; every float operation rounded on its own.

Weight layouts, one per kernel (cpu_kernels.pack makes them from the natural one):
  AVX2 ("paired"): int8 q and activations as each pair of groups' four 16-value halves
  [g 0..15 | g+1 0..15 | g 16..31 | g+1 16..31], the order in which one 32-byte load of two
  packed int4 groups (byte j of a group: element j low, j + 16 high) yields its values.
  AVX-512 VNNI ("columns"): blocks of 16 output columns, one 32-bit lane per column: per group,
  int4 as four 64-byte vectors whose lane n holds, in byte t, element 8i + t (low nibble) and
  8i + 4 + t (high nibble) of column n; int8 as eight vectors, lane n of vector j holding
  elements 4j..4j+3 of column n biased by +128 (u8); sc and mn as [pairs of groups][16][2]
  uint16, d and dm as [blocks][16]. Activations in natural order.
*/
#include "cpu_kernels.h"

#define TILE 4 /* gemm_column's switch covers remainders 1 .. TILE - 1 */
_Static_assert(TILE == 4, "gemm_column handles remainders of up to 3 rows");
/* Short columns of weights (K = 1536 in int4: 768 bytes) leave ~15% of the bandwidth to the
   hardware prefetcher alone, so gemm_column asks for the weights PREFETCH bytes ahead of its
   own; longer ones (int8 at K = 1536, anything at K = 8960) stream better without (measured
   on EPYC: 14 -> 17 GB/s for the former, 15 -> 12 for the latter). */
#define PREFETCH 4096
#define PREFETCH_COLUMN 1024

int specsplit_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* Groups per super-block of a K-long row: the most of 8, 4, 2 that divides K / 32 (K is a
   multiple of 64, so groups come in pairs). */
int64_t per_block(int64_t K) {
    const int64_t G = K / QK;
    return G % 8 == 0 ? 8 : (G % 4 == 0 ? 4 : 2);
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* One super-block of L values (a whole number of pairs of groups) -> its int8 values (paired
   layout for the AVX2 kernel, else natural order), its scale and its groups' sums. Each value:
   round-to-nearest-even of v / d (the CPU's default rounding), clamped. */
void quantize_block(const float *v, int64_t L, int8_t *q, float *xs, int16_t *xsum, int paired) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 peak = _mm256_setzero_ps();
    for (int64_t i = 0; i < L; i += 8)
        peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < L / QK; g++) {
        __m256i n[4];
        for (int h = 0; h < 4; h++) {
            const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + g * QK + 8 * h), id);
            n[h] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(t), top), bottom);
        }
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])),
            order);
        if (paired) { /* the pair's halves: [g 0..15 | g+1 0..15 | g 16..31 | g+1 16..31] */
            int8_t *pair = q + (g / 2) * 2 * QK + (g % 2) * 16;
            _mm_storeu_si128((__m128i *)pair, _mm256_castsi256_si128(bytes));
            _mm_storeu_si128((__m128i *)(pair + 32), _mm256_extracti128_si256(bytes, 1));
        } else {
            _mm256_storeu_si256((__m256i *)(q + g * QK), bytes);
        }
        xsum[g] = (int16_t)hsum8_epi32(
            _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])));
    }
    *xs = d;
}

/* x [M, K] -> xq [M, K] (paired or natural layout), xs [M, B] (one scale per super-block),
   xsum [M, G] (sum of xq per group, int16: |sum| <= 32 * 127); B = K / (32 * per_block(K));
   M, K and the outputs are `out`'s. */
void specsplit_quantize_rows(const float *x, const specsplit_rows *out, int paired, int nt) {
    const int64_t M = out->m, K = out->k;
    int8_t *xq = out->xq;
    float *xs = out->xs;
    int16_t *xsum = out->xsum;
    const int64_t L = QK * per_block(K), B = K / L;
#pragma omp parallel for num_threads(nt) schedule(static) if (M * K >= 65536)
    for (int64_t rb = 0; rb < M * B; rb++)
        quantize_block(x + rb * L, L, xq + rb * L, xs + rb, xsum + rb * (L / QK), paired);
}

/* RMSNorm then quantisation, as specsplit_quantize_rows of y: y[r, k] = w[k] * (x[r, k] *
   (1 / sqrt(mean_k x[r, k]^2 + eps))) (Llama's and Qwen2's norm), never stored in float. */
void specsplit_rmsnorm_quantize(const float *x, const float *w, float eps,
                                const specsplit_rows *out, int paired, int nt) {
    const int64_t M = out->m, K = out->k;
    int8_t *xq = out->xq;
    float *xs = out->xs;
    int16_t *xsum = out->xsum;
    const int64_t L = QK * per_block(K), B = K / L;
#pragma omp parallel for num_threads(nt) schedule(static) if (M * K >= 65536)
    for (int64_t r = 0; r < M; r++) {
        const float *v = x + r * K;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < K; i += 8) {
            const __m256 t = _mm256_loadu_ps(v + i);
            ss = _mm256_add_ps(ss, _mm256_mul_ps(t, t));
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)K + eps));
        float y[8 * QK]; /* one super-block: L <= 256 */
        for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < L; i += 8) {
                const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + b * L + i), inv);
                _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + b * L + i), t));
            }
            const int64_t rb = r * B + b;
            quantize_block(y, L, xq + rb * L, xs + rb, xsum + rb * (L / QK), paired);
        }
    }
}

/* A super-block's P (<= 8) integer group scales as eight 16-bit lanes (zeros past P). */
static inline __m128i block_scales(const int four, const void *sc, int64_t at, int64_t P) {
    if (P == 8)
        return four ? _mm_loadu_si128((const __m128i *)((const uint16_t *)sc + at))
                    : _mm_cvtepu8_epi16(
                          _mm_loadl_epi64((const __m128i *)((const uint8_t *)sc + at)));
    uint16_t v[8] = {0};
    for (int64_t g = 0; g < P; g++)
        v[g] = four ? ((const uint16_t *)sc)[at + g] : ((const uint8_t *)sc)[at + g];
    return _mm_loadu_si128((const __m128i *)v);
}

/* pshufb masks: pair j of a super-block's broadcast scales -> [sc[2j] x 8 | sc[2j+1] x 8] */
static inline __m256i pair_mask(int64_t j) {
    const char a = (char)(4 * j), b = (char)(4 * j + 2);
    return _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a,
                            a + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b,
                            b + 1, b, b + 1);
}

static inline int32_t hsum4_epi32(__m128i t) {
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* out[M, N] = x @ w.T, weights of either format in super-blocks of P groups:
     int8 (mn == NULL): w = d[n, b] * sc[n, g] * q,           q int8 in [-127, 127], paired
     int4:              w = d[n, b] * sc[n, g] * q - dm[n, b] * mn[n, g],  q in [0, 15]
   Per pair of groups and row the work is all-integer; floats only once per super-block, in
   the canonical order (the header).
   int4: the two halves' byte products add in 16 bits (4 products of at most 15 * 127 each)
   before one multiply-add by the pair's scales; int8 (products up to 2 * 127 * 127) takes a
   multiply-add per half. One tile of rt rows (a compile-time constant after inlining, so the
   accumulators live in registers) against column n. */
static inline __attribute__((always_inline)) void
gemm_tile(const int four, const int rt, const int8_t *xq, const float *xs, const int16_t *xsum,
          int64_t K, const uint8_t *wq, const void *sc, const float *d, const uint16_t *mn,
          const float *dm, int64_t N, float *out, int64_t n, int64_t r0) {
    const int64_t P = per_block(K), G = K / QK, B = G / P;
    const uint8_t *wrow = wq + n * (four ? K / 2 : K);
    const __m256i low = _mm256_set1_epi8(0x0F);
    float acc[TILE], offset[TILE];
    for (int i = 0; i < rt; i++) acc[i] = offset[i] = 0.0f;
    for (int64_t b = 0; b < B; b++) {
        const __m256i scales =
            _mm256_broadcastsi128_si256(block_scales(four, sc, n * G + b * P, P));
        __m256i sumi[TILE];
        for (int i = 0; i < rt; i++) sumi[i] = _mm256_setzero_si256();
        for (int64_t j = 0; j < P / 2; j++) {
            const int64_t g = b * P + 2 * j;
            const __m256i s = _mm256_shuffle_epi8(scales, pair_mask(j));
            if (four) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wrow + g * (QK / 2)));
                const __m256i lo = _mm256_and_si256(w, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                for (int i = 0; i < rt; i++) {
                    const int8_t *x = xq + (r0 + i) * K + g * QK;
                    const __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))));
                    sumi[i] = _mm256_add_epi32(sumi[i], _mm256_madd_epi16(p, s));
                }
            } else {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wrow + g * QK));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wrow + g * QK + 32));
                const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
                for (int i = 0; i < rt; i++) {
                    const int8_t *x = xq + (r0 + i) * K + g * QK;
                    const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w0);
                    const __m256i x1 =
                        _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x + 32)), w1);
                    const __m256i p =
                        _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, x0), s),
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(a1, x1), s));
                    sumi[i] = _mm256_add_epi32(sumi[i], p);
                }
            }
        }
        const __m128i mins = four ? block_scales(1, mn, n * G + b * P, P) : _mm_setzero_si128();
        for (int i = 0; i < rt; i++) {
            const float dx = xs[(r0 + i) * B + b];
            acc[i] = acc[i] + (float)hsum8_epi32(sumi[i]) * (d[n * B + b] * dx);
            if (four) { /* sum over the block's groups of mn * sum(xq): exact integers */
                const int16_t *xs16 = xsum + (r0 + i) * G + b * P;
                __m128i xv;
                if (P == 8)
                    xv = _mm_loadu_si128((const __m128i *)xs16);
                else {
                    int16_t v[8] = {0};
                    for (int64_t g = 0; g < P; g++) v[g] = xs16[g];
                    xv = _mm_loadu_si128((const __m128i *)v);
                }
                const int32_t m = hsum4_epi32(_mm_madd_epi16(mins, xv));
                offset[i] = offset[i] + (float)m * (dm[n * B + b] * dx);
            }
        }
    }
    for (int i = 0; i < rt; i++) out[(r0 + i) * N + n] = acc[i] - offset[i];
}

static inline __attribute__((always_inline)) void
gemm_column(const int four, const int8_t *xq, const float *xs, const int16_t *xsum, int64_t M,
            int64_t K, const uint8_t *wq, const void *sc, const float *d, const uint16_t *mn,
            const float *dm, int64_t N, float *out, int64_t n) {
    const int64_t bytes = four ? K / 2 : K; /* one column's weights */
    if (bytes <= PREFETCH_COLUMN && (n + 1) * bytes + PREFETCH <= N * bytes) {
        const char *ahead = (const char *)wq + n * bytes + PREFETCH;
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    }
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

void specsplit_gemm(const specsplit_rows *x, const specsplit_weights *w, float *out, int nt) {
    const int8_t *xq = x->xq;
    const float *xs = x->xs;
    const int16_t *xsum = x->xsum;
    const int64_t M = x->m, K = x->k, N = w->n;
    const uint8_t *wq = w->q;
    const void *sc = w->sc;
    const float *d = w->d, *dm = w->dm;
    const uint16_t *mn = w->mn;
    if (mn != NULL) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t n = 0; n < N; n++)
            gemm_column(1, xq, xs, xsum, M, K, wq, sc, d, mn, dm, N, out, n);
    } else {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t n = 0; n < N; n++)
            gemm_column(0, xq, xs, xsum, M, K, wq, sc, d, mn, dm, N, out, n);
    }
}

/* ---- AVX-512 VNNI: 16 output columns per vector, one 32-bit lane each ("columns" layout) ---- */

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define LANES 16

int specsplit_has_avx512vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

/* One tile of rt rows (a compile-time constant after inlining) against column block cb.
   Per group and row: eight vpdpbusd (u8 weights x s8 activations, 4 products a lane) in two
   chains, then one multiply by the group's integer scale into the block's exact sum. The
   correction terms (int4: mn * xsum; int8: the +128 bias, 128 * sc * xsum) take one vpdpwssd
   per pair of groups. Floats once per super-block, in the canonical order. */
static inline __attribute__((always_inline)) VNNI_TARGET void
vnni_tile(const int four, const int rt, const int8_t *xq, const float *xs, const int16_t *xsum,
          int64_t K, const uint8_t *wq, const uint16_t *sc, const float *d, const uint16_t *mn,
          const float *dm, int64_t N, float *out, int64_t cb, int64_t r0) {
    const int64_t P = per_block(K), G = K / QK, B = G / P;
    const int64_t gbytes = four ? LANES * QK / 2 : LANES * QK; /* one group of the block */
    const uint8_t *wb = wq + cb * G * gbytes;
    const uint16_t *scb = sc + cb * G * LANES, *mnb = four ? mn + cb * G * LANES : NULL;
    const float *db = d + cb * B * LANES, *dmb = four ? dm + cb * B * LANES : NULL;
    const __m512i low = _mm512_set1_epi8(0x0F), half = _mm512_set1_epi32(0xFFFF);
    __m512 a[TILE], o[TILE];
    for (int i = 0; i < rt; i++) a[i] = o[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        __m512i S[TILE], M[TILE];
        for (int i = 0; i < rt; i++) S[i] = M[i] = _mm512_setzero_si512();
        for (int64_t g = b * P; g < (b + 1) * P; g += 2) {
            const __m512i scp = _mm512_loadu_si512(scb + g * LANES); /* [16][g, g + 1] */
            for (int h = 0; h < 2; h++) {
                const uint8_t *wg = wb + (g + h) * gbytes;
                __m512i w[8];
                if (four) {
                    for (int j = 0; j < 4; j++) {
                        const __m512i v = _mm512_loadu_si512(wg + 64 * j);
                        w[2 * j] = _mm512_and_si512(v, low);
                        w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    }
                } else {
                    for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(wg + 64 * j);
                }
                const __m512i s = h ? _mm512_srli_epi32(scp, 16) : _mm512_and_si512(scp, half);
                for (int i = 0; i < rt; i++) {
                    int32_t x[8]; /* the group's 32 int8 as 8 lanes (memcpy: no aliasing) */
                    memcpy(x, xq + (r0 + i) * K + (g + h) * QK, sizeof x);
                    __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
                    for (int j = 0; j < 8; j += 2) {
                        t0 = _mm512_dpbusd_epi32(t0, w[j], _mm512_set1_epi32(x[j]));
                        t1 = _mm512_dpbusd_epi32(t1, w[j + 1], _mm512_set1_epi32(x[j + 1]));
                    }
                    S[i] = _mm512_add_epi32(S[i], _mm512_mullo_epi32(_mm512_add_epi32(t0, t1), s));
                }
            }
            const __m512i corr = four ? _mm512_loadu_si512(mnb + g * LANES) : scp;
            for (int i = 0; i < rt; i++) { /* xsum[r, g], xsum[r, g + 1] as one 32-bit lane */
                int32_t pair;
                memcpy(&pair, xsum + (r0 + i) * G + g, sizeof pair);
                M[i] = _mm512_dpwssd_epi32(M[i], corr, _mm512_set1_epi32(pair));
            }
        }
        const __m512 dv = _mm512_loadu_ps(db + b * LANES);
        const __m512 dmv = four ? _mm512_loadu_ps(dmb + b * LANES) : _mm512_setzero_ps();
        for (int i = 0; i < rt; i++) {
            const __m512 dx = _mm512_set1_ps(xs[(r0 + i) * B + b]);
            if (!four) /* remove the +128 bias: sum(sc * (q + 128) * x) - 128 * sum(sc * xsum) */
                S[i] = _mm512_sub_epi32(S[i], _mm512_slli_epi32(M[i], 7));
            a[i] =
                _mm512_add_ps(a[i], _mm512_mul_ps(_mm512_cvtepi32_ps(S[i]), _mm512_mul_ps(dv, dx)));
            if (four)
                o[i] = _mm512_add_ps(
                    o[i], _mm512_mul_ps(_mm512_cvtepi32_ps(M[i]), _mm512_mul_ps(dmv, dx)));
        }
    }
    const int64_t n0 = cb * LANES;
    const __mmask16 keep = N - n0 >= LANES ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int i = 0; i < rt; i++)
        _mm512_mask_storeu_ps(out + (r0 + i) * N + n0, keep, _mm512_sub_ps(a[i], o[i]));
}

static inline __attribute__((always_inline)) VNNI_TARGET void
vnni_block(const int four, const int8_t *xq, const float *xs, const int16_t *xsum, int64_t M,
           int64_t K, const uint8_t *wq, const uint16_t *sc, const float *d, const uint16_t *mn,
           const float *dm, int64_t N, float *out, int64_t cb) {
    int64_t r0 = 0;
    for (; r0 + TILE <= M; r0 += TILE)
        vnni_tile(four, TILE, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, cb, r0);
    switch (M - r0) {
    case 1: vnni_tile(four, 1, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, cb, r0); break;
    case 2: vnni_tile(four, 2, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, cb, r0); break;
    case 3: vnni_tile(four, 3, xq, xs, xsum, K, wq, sc, d, mn, dm, N, out, cb, r0); break;
    default: break;
    }
}

/* out[M, N] = x @ w.T in the "columns" layout (N padded to whole blocks of 16 in the weights;
   only N columns are written); activations in natural order. mn == NULL: int8. */
VNNI_TARGET void specsplit_gemm_vnni(const specsplit_rows *x, const specsplit_weights *w,
                                     float *out, int nt) {
    const int8_t *xq = x->xq;
    const float *xs = x->xs;
    const int16_t *xsum = x->xsum;
    const int64_t M = x->m, K = x->k, N = w->n;
    const uint8_t *wq = w->q;
    const uint16_t *sc = (const uint16_t *)w->sc;
    const float *d = w->d, *dm = w->dm;
    const uint16_t *mn = w->mn;
    const int64_t blocks = (N + LANES - 1) / LANES;
    if (mn != NULL) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t cb = 0; cb < blocks; cb++)
            vnni_block(1, xq, xs, xsum, M, K, wq, sc, d, mn, dm, N, out, cb);
    } else {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t cb = 0; cb < blocks; cb++)
            vnni_block(0, xq, xs, xsum, M, K, wq, sc, d, mn, dm, N, out, cb);
    }
}
