/* A decoder layer's small per-token ops, each fused into one pass over its rows (fp32, CPU).
 *
 * Built with the other kernels by kvfleet/worker/runner/cpu_kernels.py and called through
 * kvfleet/worker/runner/layer_ops.py. Between its projections a decode step's layer runs a
 * dozen tiny torch ops (norm, residual add, RoPE, K/V write, gate activation), each costing
 * more in dispatch and allocation than in arithmetic; here they are four calls. The
 * arithmetic follows the torch formulations it replaces (same operation order, fp32), so the
 * two agree to fp32 rounding. Rows are split between threads only when there are many
 * (prefill chunks): a decode step's few rows cost less than waking a thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define ROWS_PER_THREAD 64

/* One row of add_rms_norm (sr may alias ar when br is NULL). */
static inline void norm_row(const float *ar, const float *br, float *sr, const float *weight,
                            float *nr, int64_t size, float eps) {
    float ss = 0.f;
    if (br != NULL) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < size; ++i) {
            const float v = ar[i] + br[i];
            sr[i] = v;
            ss += v * v;
        }
    } else {
        if (sr != ar) memcpy(sr, ar, (size_t)size * sizeof(float));
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < size; ++i) ss += ar[i] * ar[i];
    }
    const float inv = 1.f / sqrtf(ss / (float)size + eps);
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) nr[i] = sr[i] * inv * weight[i];
}

/* sum = a + b (b NULL: sum = a, which may then alias a), then
 * normed = sum · (1 / sqrt(mean(sum²) + eps)) · weight, row by row. */
void add_rms_norm(const float *a, int64_t lda, const float *b, int64_t ldb, float *sum,
                  int64_t lds, const float *weight, float *normed, int64_t ldn, int64_t rows,
                  int64_t size, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > ROWS_PER_THREAD)
    for (int64_t r = 0; r < rows; ++r)
        norm_row(a + r * lda, b == NULL ? NULL : b + r * ldb, sum + r * lds, weight,
                 normed + r * ldn, size, eps);
}

/* add_rms_norm's rows r0 .. r1 - 1 (contiguous rows of `size`), on the calling thread. */
void add_rms_norm_rows(const float *a, const float *b, float *sum, const float *weight,
                       float *normed, int64_t r0, int64_t r1, int64_t size, float eps) {
    for (int64_t r = r0; r < r1; ++r)
        norm_row(a + r * size, b == NULL ? NULL : b + r * size, sum + r * size, weight,
                 normed + r * size, size, eps);
}

/* In place on qkv rows (row stride ldq; heads + kv_heads rotated heads of head_dim, then
 * kv_heads value heads): RoPE, half-split layout, on the first `rot` dims of every query and
 * key head with row t's cos / sin (rows of `rot`, contiguous); then, where k_cache is not
 * NULL, row t's keys and values copied to flat cache slot slots[t] (caches (slots, kv_heads,
 * head_dim) contiguous). */
static inline void rope_row(float *row, const float *c, const float *s, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, int64_t rot, float *k_cache,
                            float *v_cache, int64_t slot) {
    const int64_t half = rot / 2, kv = kv_heads * head_dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float *x = row + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] + (-x2) * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
    }
    if (k_cache != NULL) {
        memcpy(k_cache + slot * kv, row + heads * head_dim, (size_t)kv * sizeof(float));
        memcpy(v_cache + slot * kv, row + (heads + kv_heads) * head_dim, (size_t)kv * sizeof(float));
    }
}

void rope_write_kv(float *qkv, int64_t ldq, int64_t rows, const float *cos, const float *sin,
                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rot,
                   float *k_cache, float *v_cache, const int64_t *slots, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > ROWS_PER_THREAD)
    for (int64_t t = 0; t < rows; ++t)
        rope_row(qkv + t * ldq, cos + t * rot, sin + t * rot, heads, kv_heads, head_dim, rot,
                 k_cache, v_cache, k_cache != NULL ? slots[t] : 0);
}

/* rope_write_kv's rows r0 .. r1 - 1, on the calling thread. */
void rope_write_kv_rows(float *qkv, int64_t ldq, int64_t r0, int64_t r1, const float *cos,
                        const float *sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        int64_t rot, float *k_cache, float *v_cache, const int64_t *slots) {
    for (int64_t t = r0; t < r1; ++t)
        rope_row(qkv + t * ldq, cos + t * rot, sin + t * rot, heads, kv_heads, head_dim, rot,
                 k_cache, v_cache, k_cache != NULL ? slots[t] : 0);
}

/* exp(x) for x in [-87, 88] to about one ulp, in plain arithmetic so that loops over it
 * vectorise (libm's expf is a scalar call here): x = n·ln2 + r, |r| ≤ ln2 / 2 (ln2 split in
 * two for the reduction), a degree-6 polynomial for exp(r), 2^n through the exponent bits. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    /* fmaf: the build's -fassociative-math would fold the two-part ln2 back into one */
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out[t] = silu(gate) · up over rows of gate | up (row stride ldg, `width` each);
 * silu(x) = x / (1 + exp(-x)). */
static inline void silu_row(const float *g, float *o, int64_t width) {
    const float *u = g + width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
}

void silu_mul(const float *gate_up, int64_t ldg, int64_t rows, int64_t width, float *out,
              int64_t ldo, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > ROWS_PER_THREAD)
    for (int64_t t = 0; t < rows; ++t) silu_row(gate_up + t * ldg, out + t * ldo, width);
}

/* silu_mul's rows r0 .. r1 - 1 (gate_up rows of 2 · width, out rows of width), on the calling
 * thread. */
void silu_mul_rows(const float *gate_up, int64_t r0, int64_t r1, int64_t width, float *out) {
    for (int64_t t = r0; t < r1; ++t) silu_row(gate_up + t * 2 * width, out + t * width, width);
}
