/* Row-wise float ops between the target's kernels (compiled with cpu_kernels.c and
cpu_attention.c into one library by cloud/engine/kernel_library.py): the MLP activation
act(gate) * up fused into the activation quantisation, RMSNorm, residual adds (with the added
branch's RMSNorm, Gemma's post norms) and tanh soft-caps.

Contract (cpu_kernels.c's): every output element is computed by one fixed sequence of float
operations that reads its own row only, whatever the rows in the call and the thread count. So:
- transcendentals are this file's own 8-lane polynomials, run the same way on every element (a
  tail shorter than 8 goes through the same vector code, padded), never libm's or torch's, whose
  vector body and scalar tail differ and whose split points move with the element and thread
  counts;
- a reduction (RMSNorm's sum of squares) runs within one row: 8 lanes in index order, then hsum8;
- threads split over rows (elementwise ops: over whole vectors), never inside a row's reduction.
Build with -ffp-contract=off (kernel_library.py does) so that no multiply-add is fused on its
own. */
#include "cpu_kernels.h"

/* 1 / (1 + e^-z) through e = e^-|z| <= 1, so nothing overflows: 1 / (1 + e) for z >= 0,
   e / (1 + e) below. Both are computed for every lane; the sign picks one. */
static inline __m256 sigmoid(__m256 z) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 e = exp_nonpositive(_mm256_or_ps(z, sign)); /* e^-|z| */
    const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
    const __m256 pos = _mm256_div_ps(_mm256_set1_ps(1.0f), d), neg = _mm256_div_ps(e, d);
    return _mm256_blendv_ps(pos, neg, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
}

/* act(g) for the activations of cloud/engine/cpu_kernels.py's ACTIVATIONS:
   SiLU       g * sigmoid(g)
   GELU-tanh  0.5 g (1 + tanh(u)) = g * sigmoid(2u),  u = sqrt(2 / pi) (g + 0.044715 g^3) */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

static inline __m256 activate(int act, __m256 g) {
    if (act == ACT_GELU_TANH) {
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube));
        return _mm256_mul_ps(g, sigmoid(_mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), inner)));
    }
    return _mm256_mul_ps(g, sigmoid(g));
}

/* out[i] = act(gate[i]) * up[i] for i < n, n a multiple of 8. */
static inline void act_mul_span(int act, const float *gate, const float *up, int64_t n,
                                float *out) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(activate(act, _mm256_loadu_ps(gate + i)),
                                                _mm256_loadu_ps(up + i)));
}

/* gu [M, 2F] (gate in columns 0..F-1, up in F..2F-1, as a fused gate/up projection writes
   them) -> out [M, F] = act(gate) * up. F is a multiple of 64 (the kernels' widths), so every
   value goes through a full vector. */
void specsplit_act_mul(const float *gu, int64_t M, int64_t F, int act, float *out, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (M * F >= 65536)
    for (int64_t r = 0; r < M; r++)
        act_mul_span(act, gu + r * 2 * F, gu + r * 2 * F + F, F, out + r * F);
}

/* As specsplit_act_mul, quantised as specsplit_quantize_rows quantises rows of width F: one
   super-block at a time from a stack buffer, so the float product never leaves this call and
   equals, bit for bit, specsplit_quantize_rows of specsplit_act_mul's output. */
void specsplit_act_mul_quantize(const float *gu, int act, const specsplit_rows *out, int paired,
                                int nt) {
    const int64_t M = out->m, F = out->k;
    int8_t *xq = out->xq;
    float *xs = out->xs;
    int16_t *xsum = out->xsum;
    const int64_t L = QK * per_block(F), B = F / L;
#pragma omp parallel for num_threads(nt) schedule(static) if (M * F >= 65536)
    for (int64_t rb = 0; rb < M * B; rb++) {
        const int64_t r = rb / B, at = (rb % B) * L;
        float y[8 * QK]; /* one super-block: L <= 256 */
        act_mul_span(act, gu + r * 2 * F + at, gu + r * 2 * F + F + at, L, y);
        quantize_block(y, L, xq + rb * L, xs + rb, xsum + rb * (L / QK), paired);
    }
}

/* 1 / sqrt(mean(v^2) + eps) of one D-long vector (D a multiple of 8). */
static inline float rms_scale(const float *v, int64_t D, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
        const __m256 t = _mm256_loadu_ps(v + i);
        ss = _mm256_add_ps(ss, _mm256_mul_ps(t, t));
    }
    return 1.0f / sqrtf(hsum8(ss) / (float)D + eps);
}

/* RMSNorm of each D-long vector on its own: M rows `stride` floats apart, each holding H
   vectors `hstride` floats apart (a row's heads, or H = 1 and D its width); out in the same
   layout, rows `out_stride` apart (out == x: in place). y = w * (v * (1 / sqrt(mean(v^2) +
   eps))), w [D], as specsplit_rmsnorm_quantize computes it. D a multiple of 8. */
void specsplit_rmsnorm(const specsplit_heads *heads, const float *w, float eps, float *out,
                       int64_t out_stride, int nt) {
    const float *x = heads->x;
    const int64_t M = heads->rows, stride = heads->stride, H = heads->heads;
    const int64_t hstride = heads->head_stride, D = heads->dim;
#pragma omp parallel for num_threads(nt) schedule(static) if (M * H * D >= 65536)
    for (int64_t t = 0; t < M * H; t++) {
        const float *v = x + (t / H) * stride + (t % H) * hstride;
        float *o = out + (t / H) * out_stride + (t % H) * hstride;
        const __m256 inv = _mm256_set1_ps(rms_scale(v, D, eps));
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(v + i), inv);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), s));
        }
    }
}

/* out[M, K] = x + y, or x + RMSNorm(y) (weight w [K], eps) where w != NULL: the residual
   stream plus a layer's branch (Gemma normalises its branches first). out may be x.
   K a multiple of 8. */
void specsplit_residual_add(const specsplit_residual_args *args, float *out, int nt) {
    const float *x = args->x, *y = args->y, *w = args->w;
    const int64_t M = args->m, K = args->k;
    const float eps = args->eps;
#pragma omp parallel for num_threads(nt) schedule(static) if (M * K >= 65536)
    for (int64_t r = 0; r < M; r++) {
        const float *a = x + r * K, *b = y + r * K;
        float *o = out + r * K;
        if (w == NULL) {
            for (int64_t i = 0; i < K; i += 8)
                _mm256_storeu_ps(o + i,
                                 _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
            continue;
        }
        const __m256 inv = _mm256_set1_ps(rms_scale(b, K, eps));
        for (int64_t i = 0; i < K; i += 8) {
            const __m256 n =
                _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(b + i), inv));
            _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(a + i), n));
        }
    }
}

/* tanh(t), 8 at a time (Cephes' tanhf): below |t| = 0.625 the odd polynomial
   t + t z P(z), z = t^2; above, (1 - e) / (1 + e) with e = e^-2|t| and t's sign. Both for every
   lane; NaN takes the polynomial (stays NaN). */
static inline __m256 tanh8(__m256 t) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, t);
    const __m256 z = _mm256_mul_ps(t, t);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, z), t), t);
    const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), a));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 large = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                                      _mm256_and_ps(sign, t));
    return _mm256_blendv_ps(small, large, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_GE_OQ));
}

static inline __m256 soft_cap8(__m256 x, __m256 cap) {
    return _mm256_mul_ps(tanh8(_mm256_div_ps(x, cap)), cap);
}

/* out[i] = cap * tanh(x[i] / cap) for i < n (Gemma 2's logit soft-cap), any n: the last
   n % 8 values through the same vector code, padded. out may be x. */
void specsplit_soft_cap(const float *x, int64_t n, float cap, float *out, int nt) {
    const __m256 c = _mm256_set1_ps(cap);
    const int64_t whole = n / 8;
#pragma omp parallel for num_threads(nt) schedule(static) if (n >= 65536)
    for (int64_t v = 0; v < whole; v++)
        _mm256_storeu_ps(out + 8 * v, soft_cap8(_mm256_loadu_ps(x + 8 * v), c));
    if (n % 8) {
        float tail[8] = {0};
        for (int64_t i = 8 * whole; i < n; i++) tail[i - 8 * whole] = x[i];
        _mm256_storeu_ps(tail, soft_cap8(_mm256_loadu_ps(tail), c));
        for (int64_t i = 8 * whole; i < n; i++) out[i] = tail[i - 8 * whole];
    }
}
