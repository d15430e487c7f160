/* GGUF K-quant matmuls (Q4_K, Q5_K, Q6_K at their own widths) for the target's CPU kernels:
the contract of cpu_kernels.c (work split over output columns only, never inside one output's
reduction; no fused multiply-add) and its canonical product with K-quant containers
(cloud/engine/kquants.py has it in torch as ``reference_gemm``). Super-blocks of 256 values
(b), activations as cpu_kernels.c quantises them (xs per super-block, xsum per 32):
  q4_k, q5_k: w = d[n, b] * sc[n, g] * q - dm[n, b] * mn[n, g],  q in [0, 15] / [0, 31],
              sc, mn uint8 (6-bit) per 32 values, d, dm float16
  q6_k:       w = d[n, b] * sc[n, j] * (q - 32),  q in [0, 63], sc int8 per 16 values (j)
  S[r, n, b] = sum over sub-blocks of sc * sum_k (signed q) xq   (exact int32)
  M[r, n, b] = sum over groups of mn[n, g] * xsum[r, g]          (exact; 0 for q6_k)
  a = o = 0.0f; for b in order: a = a + (float)S * (d * xs[r, b]); o = o + (float)M * (dm * xs[r, b]);
  out = a - o.   (d, dm widen exactly from float16.)
Both kernels read unsigned levels (u8 x s8 products); q6_k's - 32 is the exact integer
-32 * sc[j] * xsum16[r, j], xsum16 the activations' sums per 16 values, which each call
computes first (into its stack, or the caller's work buffer for many rows) in the order its
kernel reads them.

Layouts (kquants.pack makes them from the natural one), per super-block of a column:
  AVX2, positions in the activations' paired order, chunk c (0..7) = positions 32c..32c+31:
    ql  128 bytes: 32-byte vector v, byte i: chunk 2v position i (low nibble), chunk 2v + 1
        (high nibble): the int4 natural layout of cpu_kernels.c;
    qh  q5_k: 32 bytes, byte i bit c = bit 4 of chunk c position i;
        q6_k: 64 bytes, vector u byte i bits 2s, 2s + 1 = bits 4, 5 of chunk 4u + s position i;
    sc  q4_k/q5_k: 8 uint8 (natural); q6_k: 16 int8 [A_0..A_7 | B_0..B_7], A_c and B_c the
        scales of chunk c's low and high 16 values (kquants._pack_avx2);
    d, mn, dm natural; xsum16 as int16 [M, B, 16] in the order of q6_k's sc.
  AVX-512 VNNI, blocks of 16 columns, one 32-bit lane each; per group of 32 (natural order),
  operand j (0..7) lane n byte t = element 4j + t of column n:
    ql  4 x 64 bytes, vector i: operand 2i (low nibbles), operand 2i + 1 (high nibbles);
    qh  q5_k: 64 bytes, bit j = bit 4 of operand j; q6_k: 2 x 64 bytes, vector u bits 2s,
        2s + 1 = bits 4, 5 of operand 4u + s;
    sc  q4_k/q5_k (and mn): [pairs of groups][16][2] uint8; q6_k: [K / 16][16] int8;
    d, dm [B][16] float16; xsum16 int32 [M, K / 16] (natural order), already times -32.
*/
#include "cpu_kernels.h"

#define KQ_SUPER 256
#define KQ_GROUPS 8 /* groups of 32 per super-block */
#define KQ_TILE 4   /* the tile switch covers remainders 1 .. KQ_TILE - 1 */
#define KQ_LANES 16
/* Software prefetch, this many bytes ahead in the low-bit plane (the high plane at its own
   proportion): one-row streams of several planes leave the hardware prefetcher behind. Measured
   on a shared 2-core EPYC (AVX-512 VNNI), one core, best of 60 calls from DRAM, one row:
   blk.0.ffn_down (Q6_K) 0.76 -> 0.58 ms (VNNI), 0.65 -> 0.61 (AVX2); blk.0.ffn_gate (Q4_K)
   0.35 -> 0.31 (VNNI). 8192 bytes did no better. Q6_K's scales too: 0.56 -> 0.50 ms (VNNI;
   in the AVX2 kernel they cost 0.59 -> 0.63). */
#define KQ_PREFETCH 4096
/* q6_k's sums per 16 activations live on the stack up to this many (32 KiB: K = 8960 up to 14
   rows); beyond, the caller hands in the work buffer (kquants.LOCAL_SUMS mirrors it), or the
   matmul returns -1 and computes nothing. */
#define KQ_LOCAL_SUMS 8192
_Static_assert(KQ_TILE == 4, "the tile switch handles remainders of up to 3 rows");
/* kquants.FORMATS order, the formats 0, 1, 2 of SPECSPLIT_FOR_EACH_FORMAT */
enum { KQ_Q4_K = 0, KQ_Q5_K = 1, KQ_Q6_K = 2 };

#define KQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KQ_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))
#define KQ_INLINE static inline __attribute__((always_inline))

static inline int32_t kq_load32(const void *p) { /* no aliasing cast */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- AVX2 + FMA ------------------------------------------------------------------------- */

/* The sum of 16 int8 values: psadbw of the values biased to unsigned, less the bias. */
static inline int32_t kq_sum16(const int8_t *p) {
    const __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)0x80));
    const __m128i s = _mm_sad_epu8(v, _mm_setzero_si128());
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
}

KQ_INLINE KQ_AVX2 int32_t kq_hsum8(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* bit c of each byte -> bit 4 (q5_k's fifth bit); c a constant after unrolling */
KQ_INLINE KQ_AVX2 __m256i kq_bit4(__m256i h, int c) {
    const __m256i b4 = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(c <= 4 ? _mm256_slli_epi16(h, 4 - c) : _mm256_srli_epi16(h, c - 4), b4);
}

/* bits 2s, 2s + 1 of each byte -> bits 4, 5 (q6_k's top two) */
KQ_INLINE KQ_AVX2 __m256i kq_bits45(__m256i h, int s) {
    const __m256i b45 = _mm256_set1_epi8(0x30);
    return _mm256_and_si256(s <= 2 ? _mm256_slli_epi16(h, 4 - 2 * s) : _mm256_srli_epi16(h, 2),
                            b45);
}

/* pshufb mask: int16 lane `low` in the low 128 bits, `high` in the high 128 bits, eight times */
KQ_INLINE KQ_AVX2 __m256i kq_bcast16(int low, int high) {
    const char a = (char)(2 * low), b = (char)(2 * high);
    return _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a,
                            a + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b,
                            b + 1, b, b + 1);
}

/* One tile of rt rows (a compile-time constant after inlining, as is f) against column n.
   Per 64 values and row: two vpmaddubsw; q4_k/q5_k add them in 16 bits (4 products of at most
   31 * 127) before one vpmaddwd by the pair's group scales, q6_k (products up to 63 * 127)
   takes one vpmaddwd per 32 values by its two 16-value scales. */
KQ_INLINE KQ_AVX2 void avx2_tile(const int f, const int rt, const specsplit_rows *x,
                                 const specsplit_kq_weights *w, float *out, int64_t n, int64_t r0) {
    const int64_t K = x->k, B = K / KQ_SUPER, G = K / 32;
    const uint8_t *ql = w->ql + n * (K / 2);
    const uint8_t *qh = f == KQ_Q4_K ? NULL : w->qh + n * (f == KQ_Q5_K ? K / 8 : K / 4);
    const __m256i low = _mm256_set1_epi8(0x0F);
    float acc[KQ_TILE], offset[KQ_TILE];
    for (int i = 0; i < rt; i++) acc[i] = offset[i] = 0.0f;
    for (int64_t b = 0; b < B; b++) {
        _mm_prefetch((const char *)ql + b * 128 + KQ_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)ql + b * 128 + KQ_PREFETCH + 64, _MM_HINT_T0);
        if (f == KQ_Q6_K) _mm_prefetch((const char *)qh + b * 64 + KQ_PREFETCH / 2, _MM_HINT_T0);
        if (f == KQ_Q5_K && b % 2 == 0)
            _mm_prefetch((const char *)qh + b * 32 + KQ_PREFETCH / 4, _MM_HINT_T0);
        __m256i scales, hv[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (f == KQ_Q6_K) {
            const int8_t *sc = (const int8_t *)w->sc + n * (K / 16) + b * 16;
            scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
            hv[0] = _mm256_loadu_si256((const __m256i *)(qh + b * 64));
            hv[1] = _mm256_loadu_si256((const __m256i *)(qh + b * 64 + 32));
        } else {
            const uint8_t *sc = (const uint8_t *)w->sc + n * G + b * KQ_GROUPS;
            scales = _mm256_broadcastsi128_si256(
                _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
            if (f == KQ_Q5_K) hv[0] = _mm256_loadu_si256((const __m256i *)(qh + b * 32));
        }
        __m256i sumi[KQ_TILE];
        for (int i = 0; i < rt; i++) sumi[i] = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(ql + b * 128 + 32 * v));
            __m256i lo = _mm256_and_si256(wv, low),
                    hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
            if (f == KQ_Q5_K) {
                lo = _mm256_or_si256(lo, kq_bit4(hv[0], 2 * v));
                hi = _mm256_or_si256(hi, kq_bit4(hv[0], 2 * v + 1));
            } else if (f == KQ_Q6_K) {
                lo = _mm256_or_si256(lo, kq_bits45(hv[v / 2], 2 * (v % 2)));
                hi = _mm256_or_si256(hi, kq_bits45(hv[v / 2], 2 * (v % 2) + 1));
            }
            const int8_t *xb = x->xq + b * KQ_SUPER + 64 * v;
            if (f == KQ_Q6_K) {
                const __m256i s0 = _mm256_shuffle_epi8(scales, kq_bcast16(2 * v, 2 * v));
                const __m256i s1 = _mm256_shuffle_epi8(scales, kq_bcast16(2 * v + 1, 2 * v + 1));
                for (int i = 0; i < rt; i++) {
                    const int8_t *xr = xb + (r0 + i) * K;
                    const __m256i p0 =
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr));
                    const __m256i p1 =
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32)));
                    sumi[i] =
                        _mm256_add_epi32(sumi[i], _mm256_add_epi32(_mm256_madd_epi16(p0, s0),
                                                                   _mm256_madd_epi16(p1, s1)));
                }
            } else { /* [sc[2v] x 8 | sc[2v + 1] x 8]: the pair's groups */
                const __m256i s = _mm256_shuffle_epi8(scales, kq_bcast16(2 * v, 2 * v + 1));
                for (int i = 0; i < rt; i++) {
                    const int8_t *xr = xb + (r0 + i) * K;
                    const __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32))));
                    sumi[i] = _mm256_add_epi32(sumi[i], _mm256_madd_epi16(p, s));
                }
            }
        }
        const float d = _cvtsh_ss(w->d[n * B + b]);
        if (f == KQ_Q6_K) { /* levels were q; the product wants q - 32 */
            const int16_t *s16 = (const int16_t *)x->xsum16; /* [M, B, 16] */
            for (int i = 0; i < rt; i++) {
                const __m256i xv =
                    _mm256_loadu_si256((const __m256i *)(s16 + ((r0 + i) * B + b) * 16));
                sumi[i] =
                    _mm256_sub_epi32(sumi[i], _mm256_slli_epi32(_mm256_madd_epi16(scales, xv), 5));
            }
        }
        for (int i = 0; i < rt; i++) {
            const float dx = x->xs[(r0 + i) * B + b];
            acc[i] = acc[i] + (float)kq_hsum8(sumi[i]) * (d * dx);
        }
        if (f != KQ_Q6_K) { /* sum over the block's groups of mn * sum(xq): exact integers */
            const float dm = _cvtsh_ss(w->dm[n * B + b]);
            const __m128i mins = _mm_cvtepu8_epi16(
                _mm_loadl_epi64((const __m128i *)(w->mn + n * G + b * KQ_GROUPS)));
            for (int i = 0; i < rt; i++) {
                const __m128i xv =
                    _mm_loadu_si128((const __m128i *)(x->xsum + (r0 + i) * G + b * KQ_GROUPS));
                __m128i t = _mm_madd_epi16(mins, xv);
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
                const float dx = x->xs[(r0 + i) * B + b];
                offset[i] = offset[i] + (float)_mm_cvtsi128_si32(t) * (dm * dx);
            }
        }
    }
    for (int i = 0; i < rt; i++) out[(r0 + i) * w->n + n] = acc[i] - offset[i];
}

KQ_INLINE KQ_AVX2 void avx2_column(const int f, const specsplit_rows *x,
                                   const specsplit_kq_weights *w, float *out, int64_t n) {
    int64_t r0 = 0;
    for (; r0 + KQ_TILE <= x->m; r0 += KQ_TILE) avx2_tile(f, KQ_TILE, x, w, out, n, r0);
    switch (x->m - r0) { /* the same per-row work as in a full tile, fewer rows */
    case 1: avx2_tile(f, 1, x, w, out, n, r0); break;
    case 2: avx2_tile(f, 2, x, w, out, n, r0); break;
    case 3: avx2_tile(f, 3, x, w, out, n, r0); break;
    default: break;
    }
}

/* q6_k's work buffer for its sums per 16 activations: the caller's, or `local` where they fit;
   NULL where neither. */
static inline int32_t *kq_sums_buffer(const specsplit_rows *x, int32_t *local) {
    if (x->xsum16) return x->xsum16;
    return x->m * (x->k / 16) <= KQ_LOCAL_SUMS ? local : NULL;
}

KQ_AVX2 int specsplit_kq_gemm(const specsplit_rows *rows, const specsplit_kq_weights *w, float *out,
                              int nt) {
    const int64_t N = w->n;
    int32_t local[KQ_LOCAL_SUMS];
    specsplit_rows own = *rows;
    const specsplit_rows *x = &own;
    if (w->fmt == KQ_Q6_K) { /* xsum16 as int16 [M, B, 16]: paired chunk c's halves at c, 8 + c */
        if (!(own.xsum16 = kq_sums_buffer(rows, local))) return -1;
        int16_t *s16 = (int16_t *)x->xsum16;
        for (int64_t r = 0; r < x->m; r++)
            for (int64_t b = 0; b < x->k / KQ_SUPER; b++)
                for (int half = 0; half < 2; half++)
                    for (int c = 0; c < 8; c++)
                        s16[(r * (x->k / KQ_SUPER) + b) * 16 + 8 * half + c] =
                            (int16_t)kq_sum16(x->xq + r * x->k + b * KQ_SUPER + 32 * c + 16 * half);
    }
#define KQ_AVX2_COLUMN(F, n) avx2_column(F, x, w, out, n)
    SPECSPLIT_FOR_EACH_FORMAT(w->fmt, N, n, KQ_AVX2_COLUMN)
#undef KQ_AVX2_COLUMN
    return 0;
}

/* ---- AVX-512 VNNI: 16 output columns per vector ------------------------------------------- */

KQ_INLINE KQ_VNNI __m512i kq_bit4_512(__m512i h, int j) {
    const __m512i b4 = _mm512_set1_epi8(0x10);
    return _mm512_and_si512(j <= 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4), b4);
}

KQ_INLINE KQ_VNNI __m512i kq_bits45_512(__m512i h, int s) {
    const __m512i b45 = _mm512_set1_epi8(0x30);
    return _mm512_and_si512(s <= 2 ? _mm512_slli_epi16(h, 4 - 2 * s) : _mm512_srli_epi16(h, 2),
                            b45);
}

/* One tile of rt rows against column block cb. Per group: the eight operands (levels of 4
   values a lane) built once, then per row eight vpdpbusd in two chains and one multiply by the
   sub-block's integer scale (q6_k: one per 16 values, its chain starting at -32 * xsum16, so
   the sum is of q - 32). q4_k/q5_k's mn * xsum: one vpdpwssd per pair of groups. */
KQ_INLINE KQ_VNNI void vnni_tile(const int f, const int rt, const specsplit_rows *x,
                                 const specsplit_kq_weights *w, float *out, int64_t cb,
                                 int64_t r0) {
    const int64_t K = x->k, B = K / KQ_SUPER, G = K / 32, N = w->n;
    const uint8_t *ql = w->ql + cb * G * 256;
    const uint8_t *qh = f == KQ_Q4_K ? NULL : w->qh + cb * G * (f == KQ_Q5_K ? 64 : 128);
    const uint8_t *sc = (const uint8_t *)w->sc + cb * G * KQ_LANES * (f == KQ_Q6_K ? 2 : 1);
    const uint8_t *mn = f == KQ_Q6_K ? NULL : w->mn + cb * G * KQ_LANES;
    const uint16_t *d = w->d + cb * B * KQ_LANES,
                   *dm = f == KQ_Q6_K ? NULL : w->dm + cb * B * KQ_LANES;
    const int32_t *bias = (const int32_t *)x->xsum16; /* q6_k: [M, K / 16], -32 * xsum16 */
    const __m512i low = _mm512_set1_epi8(0x0F), half = _mm512_set1_epi32(0xFFFF);
    __m512 a[KQ_TILE], o[KQ_TILE];
    for (int i = 0; i < rt; i++) a[i] = o[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        __m512i S[KQ_TILE], M[KQ_TILE];
        for (int i = 0; i < rt; i++) S[i] = M[i] = _mm512_setzero_si512();
        for (int64_t g = b * KQ_GROUPS; g < (b + 1) * KQ_GROUPS; g += 2) {
            __m512i scp = _mm512_setzero_si512();
            if (f != KQ_Q6_K) /* [16][sc[g], sc[g + 1]] as 16-bit halves of each lane */
                scp =
                    _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sc + g * KQ_LANES)));
            for (int h = 0; h < 2; h++) {
                const int64_t gg = g + h;
                for (int l = 0; l < 4; l++)
                    _mm_prefetch((const char *)ql + gg * 256 + KQ_PREFETCH + 64 * l, _MM_HINT_T0);
                if (f == KQ_Q5_K)
                    _mm_prefetch((const char *)qh + gg * 64 + KQ_PREFETCH / 4, _MM_HINT_T0);
                if (f == KQ_Q6_K)
                    for (int l = 0; l < 2; l++)
                        _mm_prefetch((const char *)qh + gg * 128 + KQ_PREFETCH / 2 + 64 * l,
                                     _MM_HINT_T0);
                if (f == KQ_Q6_K && h == 0) /* the scales: 32 bytes a group */
                    _mm_prefetch((const char *)sc + gg * 32 + KQ_PREFETCH / 8, _MM_HINT_T0);
                __m512i wv[8];
                for (int j = 0; j < 4; j++) {
                    const __m512i v = _mm512_loadu_si512(ql + gg * 256 + 64 * j);
                    wv[2 * j] = _mm512_and_si512(v, low);
                    wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                if (f == KQ_Q5_K) {
                    const __m512i hb = _mm512_loadu_si512(qh + gg * 64);
                    for (int j = 0; j < 8; j++) wv[j] = _mm512_or_si512(wv[j], kq_bit4_512(hb, j));
                } else if (f == KQ_Q6_K) {
                    const __m512i h0 = _mm512_loadu_si512(qh + gg * 128);
                    const __m512i h1 = _mm512_loadu_si512(qh + gg * 128 + 64);
                    for (int j = 0; j < 8; j++)
                        wv[j] = _mm512_or_si512(wv[j], kq_bits45_512(j < 4 ? h0 : h1, j % 4));
                }
                if (f == KQ_Q6_K) {
                    for (int c = 0; c < 2; c++) {
                        const int64_t chunk = 2 * gg + c; /* 16 values: operands 4c .. 4c + 3 */
                        const __m512i s = _mm512_cvtepi8_epi32(
                            _mm_loadu_si128((const __m128i *)(sc + chunk * KQ_LANES)));
                        for (int i = 0; i < rt; i++) {
                            const int8_t *xr = x->xq + (r0 + i) * K + gg * 32 + 16 * c;
                            __m512i t0 = _mm512_set1_epi32(bias[(r0 + i) * (K / 16) + chunk]);
                            __m512i t1 = _mm512_setzero_si512();
                            t0 = _mm512_dpbusd_epi32(t0, wv[4 * c],
                                                     _mm512_set1_epi32(kq_load32(xr)));
                            t1 = _mm512_dpbusd_epi32(t1, wv[4 * c + 1],
                                                     _mm512_set1_epi32(kq_load32(xr + 4)));
                            t0 = _mm512_dpbusd_epi32(t0, wv[4 * c + 2],
                                                     _mm512_set1_epi32(kq_load32(xr + 8)));
                            t1 = _mm512_dpbusd_epi32(t1, wv[4 * c + 3],
                                                     _mm512_set1_epi32(kq_load32(xr + 12)));
                            S[i] = _mm512_add_epi32(
                                S[i], _mm512_mullo_epi32(_mm512_add_epi32(t0, t1), s));
                        }
                    }
                } else {
                    const __m512i s = h ? _mm512_srli_epi32(scp, 16) : _mm512_and_si512(scp, half);
                    for (int i = 0; i < rt; i++) {
                        const int8_t *xr = x->xq + (r0 + i) * K + gg * 32;
                        __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
                        for (int j = 0; j < 8; j += 2) {
                            t0 = _mm512_dpbusd_epi32(t0, wv[j],
                                                     _mm512_set1_epi32(kq_load32(xr + 4 * j)));
                            t1 = _mm512_dpbusd_epi32(t1, wv[j + 1],
                                                     _mm512_set1_epi32(kq_load32(xr + 4 * j + 4)));
                        }
                        S[i] =
                            _mm512_add_epi32(S[i], _mm512_mullo_epi32(_mm512_add_epi32(t0, t1), s));
                    }
                }
            }
            if (f != KQ_Q6_K) { /* xsum[r, g], xsum[r, g + 1] as one 32-bit lane */
                const __m512i mins =
                    _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(mn + g * KQ_LANES)));
                for (int i = 0; i < rt; i++)
                    M[i] = _mm512_dpwssd_epi32(
                        M[i], mins, _mm512_set1_epi32(kq_load32(x->xsum + (r0 + i) * G + g)));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * KQ_LANES)));
        const __m512 dmv =
            f == KQ_Q6_K
                ? _mm512_setzero_ps()
                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + b * KQ_LANES)));
        for (int i = 0; i < rt; i++) {
            const __m512 dx = _mm512_set1_ps(x->xs[(r0 + i) * B + b]);
            a[i] =
                _mm512_add_ps(a[i], _mm512_mul_ps(_mm512_cvtepi32_ps(S[i]), _mm512_mul_ps(dv, dx)));
            if (f != KQ_Q6_K)
                o[i] = _mm512_add_ps(
                    o[i], _mm512_mul_ps(_mm512_cvtepi32_ps(M[i]), _mm512_mul_ps(dmv, dx)));
        }
    }
    const int64_t n0 = cb * KQ_LANES;
    const __mmask16 keep = N - n0 >= KQ_LANES ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int i = 0; i < rt; i++)
        _mm512_mask_storeu_ps(out + (r0 + i) * N + n0, keep, _mm512_sub_ps(a[i], o[i]));
}

KQ_INLINE KQ_VNNI void vnni_block(const int f, const specsplit_rows *x,
                                  const specsplit_kq_weights *w, float *out, int64_t cb) {
    int64_t r0 = 0;
    for (; r0 + KQ_TILE <= x->m; r0 += KQ_TILE) vnni_tile(f, KQ_TILE, x, w, out, cb, r0);
    switch (x->m - r0) {
    case 1: vnni_tile(f, 1, x, w, out, cb, r0); break;
    case 2: vnni_tile(f, 2, x, w, out, cb, r0); break;
    case 3: vnni_tile(f, 3, x, w, out, cb, r0); break;
    default: break;
    }
}

KQ_VNNI int specsplit_kq_gemm_vnni(const specsplit_rows *rows, const specsplit_kq_weights *w,
                                   float *out, int nt) {
    const int64_t blocks = (w->n + KQ_LANES - 1) / KQ_LANES;
    int32_t local[KQ_LOCAL_SUMS];
    specsplit_rows own = *rows;
    const specsplit_rows *x = &own;
    if (w->fmt == KQ_Q6_K && !(own.xsum16 = kq_sums_buffer(rows, local))) return -1;
    if (w->fmt == KQ_Q6_K) /* xsum16 as int32 [M, K / 16], times -32: the chains' start */
        for (int64_t r = 0; r < x->m; r++)
            for (int64_t j = 0; j < x->k / 16; j++)
                x->xsum16[r * (x->k / 16) + j] = -32 * kq_sum16(x->xq + r * x->k + 16 * j);
#define KQ_VNNI_BLOCK(F, cb) vnni_block(F, x, w, out, cb)
    SPECSPLIT_FOR_EACH_FORMAT(w->fmt, blocks, cb, KQ_VNNI_BLOCK)
#undef KQ_VNNI_BLOCK
    return 0;
}
