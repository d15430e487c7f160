/* Rotary embedding and attention for the target's ragged passes (compiled with cpu_kernels.c
into one library by cloud/engine/kernel_library.py). Batch-invariant as the matmuls are: work is
split over (row, kv head) pairs, never inside one score's or one output's reduction, so a row's
result does not depend on the other rows or sessions in the pass, nor on the thread count. */
#include "cpu_kernels.h"

#include <omp.h>

/* Rotary embedding in place, Llama's "rotate half" form over the first D values of each head:
   H heads per row, `hstride` floats apart, rows `stride` floats apart; cos/sin [R, D].
   x[i] <- x[i] cos[i] - x[i + D/2] sin[i] and x[i + D/2] <- x[i + D/2] cos[i + D/2] +
   x[i] sin[i + D/2], for i < D/2; a head's values past D (partial rotary) stay as they are. */
void specsplit_rope(const specsplit_heads *heads, const float *cos, const float *sin) {
    float *x = heads->x;
    const int64_t R = heads->rows, stride = heads->stride, H = heads->heads;
    const int64_t hstride = heads->head_stride, D = heads->dim;
    const int64_t half = D / 2;
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++) {
            float *v = x + r * stride + h * hstride;
            const float *c = cos + r * D, *s = sin + r * D;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
                _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                      _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
                _mm256_storeu_ps(v + half + i,
                                 _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                               _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
            }
        }
}

static inline float dot_f32(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return hsum8(acc);
}

/* e^(p[j] - max p) in place for j < n; returns their sum (added in a fixed order). */
static inline float exp_shifted(float *p, int64_t n) {
    float peak = -INFINITY;
    for (int64_t j = 0; j < n; j++) peak = fmaxf(peak, p[j]);
    const __m256 m = _mm256_set1_ps(peak);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
        _mm256_storeu_ps(p + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) { /* the tail, padded with -inf (e^-inf = 0) */
        float tail[8];
        for (int t = 0; t < 8; t++) tail[t] = j + t < n ? p[j + t] - peak : -INFINITY;
        const __m256 e = exp_nonpositive(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, e);
        for (int64_t t = 0; j + t < n; t++) p[j + t] = tail[t];
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}

/* Attention of `group` query heads (q [group, D]) that share one kv head over ctx positions:
   keys/values [ctx, D] (D floats apart); p [group, ctx] scratch; out [group, D]. Each key and
   value is read once for the whole group. */
static inline void attend_group(const float *q, const float *keys, const float *values, int64_t ctx,
                                int64_t group, int64_t D, float scale, float softcap, float *p,
                                float *out) {
    for (int64_t j = 0; j < ctx; j++)
        for (int64_t g = 0; g < group; g++) {
            float v = dot_f32(q + g * D, keys + j * D, D) * scale;
            if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
            p[g * ctx + j] = v;
        }
    for (int64_t g = 0; g < group; g++) {
        float *pg = p + g * ctx;
        const __m256 inv = _mm256_set1_ps(1.0f / exp_shifted(pg, ctx));
        for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 8 accumulators stay in registers */
            const int64_t w = D - d0 < 64 ? D - d0 : 64;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < ctx; j++) {
                const __m256 pj = _mm256_set1_ps(pg[j]);
                const float *v = values + j * D + d0;
                for (int i = 0; i < 8; i++)
                    if (8 * i < w) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), acc[i]);
            }
            for (int i = 0; i < 8; i++)
                if (8 * i < w)
                    _mm256_storeu_ps(out + g * D + d0 + 8 * i, _mm256_mul_ps(acc[i], inv));
        }
    }
}

/* The segment that row r belongs to: the last s with row0[s] <= r (row0 ascending). */
static inline int64_t segment_of(const int64_t *row0, int64_t nseg, int64_t r) {
    int64_t lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (row0[mid] <= r)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Layer `layer`'s attention for every segment of a ragged pass.
   q [R, H, D], k_new/v_new [R, KVH, D] (rotated keys); segment s owns rows
   [row0[s], row0[s] + len[s]) at positions [start[s], start[s] + len[s]) and the KV slot
   slot[s]: [layers, 2, KVH, cap[s], D] floats. Writes the new keys/values into the layer's
   cache, then out [R, H, D]: row i of a segment (position p = start + i) attends to positions
   lo..p in position order, lo = 0, or p - window + 1 with a sliding window (window > 0).
   Scores are q.k * scale, soft-capped (softcap > 0: softcap * tanh(score / softcap), Gemma 2).
   Returns 0, or -1 (nothing computed) when its scratch memory cannot be allocated. */
int specsplit_attention(const specsplit_attention_args *a, const specsplit_segments *seg,
                        float *out, int nt) {
    const float *q = a->q, *k_new = a->k_new, *v_new = a->v_new;
    const int64_t H = a->heads, KVH = a->kv_heads, D = a->head_dim, layer = a->layer;
    const float scale = a->scale, softcap = a->softcap;
    const int64_t window = a->window, nseg = seg->count;
    float *const *slot = seg->slot;
    const int64_t *cap = seg->cap, *start = seg->start, *len = seg->len, *row0 = seg->row0;
    const int64_t group = H / KVH;
    if (nt < 1) nt = 1;
    int64_t rows = 0, widest = 1; /* the most positions one row attends to */
    for (int64_t s = 0; s < nseg; s++) {
        rows += len[s];
        const int64_t end = start[s] + len[s];
        const int64_t ctx = window > 0 && end > window ? window : end;
        if (ctx > widest) widest = ctx;
    }
    /* Scores: one [group, widest] block per thread, reused by each of its tasks. */
    float *scratch = malloc(sizeof(float) * (size_t)(nt * group * widest));
    if (scratch == NULL) return -1;
    for (int64_t s = 0; s < nseg; s++) {
        float *cache = slot[s] + layer * 2 * KVH * cap[s] * D;
        for (int64_t i = 0; i < len[s]; i++)
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t r = row0[s] + i, at = (h * cap[s] + start[s] + i) * D;
                memcpy(cache + at, k_new + (r * KVH + h) * D, D * sizeof(float));
                memcpy(cache + KVH * cap[s] * D + at, v_new + (r * KVH + h) * D, D * sizeof(float));
            }
    }
    /* One task per (row, kv head): its query heads share every key and value read. */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 2)
    for (int64_t task = 0; task < rows * KVH; task++) {
        const int64_t r = task / KVH, kvh = task % KVH, s = segment_of(row0, nseg, r);
        const int64_t end = start[s] + (r - row0[s]) + 1; /* positions lo .. end - 1 */
        const int64_t lo = window > 0 && end > window ? end - window : 0, ctx = end - lo;
        const float *cache = slot[s] + layer * 2 * KVH * cap[s] * D;
        const float *keys = cache + kvh * cap[s] * D + lo * D;
        const float *values = cache + (KVH + kvh) * cap[s] * D + lo * D;
        float *p = scratch + (int64_t)omp_get_thread_num() * group * widest; /* p[g * ctx + j] */
        attend_group(q + (r * H + kvh * group) * D, keys, values, ctx, group, D, scale, softcap, p,
                     out + (r * H + kvh * group) * D);
    }
    free(scratch);
    return 0;
}
