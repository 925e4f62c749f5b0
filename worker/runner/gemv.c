/* One-row projection y = x · Wᵀ (+ b), fp32, for batch-1 decode steps (CPU).
 *
 * Built with paged_decode.c by kvfleet/worker/cpu_kernels.py. W is (out, in) row-major, so
 * each output is one dot product over a contiguous weight row; four rows at a time keep four
 * independent accumulators, and the rows are split between the threads, so the whole weight
 * streams from memory once at close to the machine's read bandwidth. (oneDNN's packed path,
 * which wins from two rows on, reaches about half of it with one row.)
 */
#include <stdint.h>

void gemv_rows(const float *x, const float *w, const float *bias, float *y, int64_t in,
               int64_t out, int num_threads) {
    const int64_t quads = out / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t q = 0; q < quads; ++q) {
        const int64_t o = 4 * q;
        const float *w0 = w + o * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t i = 0; i < in; ++i) {
            s0 += x[i] * w0[i];
            s1 += x[i] * w1[i];
            s2 += x[i] * w2[i];
            s3 += x[i] * w3[i];
        }
        y[o] = s0;
        y[o + 1] = s1;
        y[o + 2] = s2;
        y[o + 3] = s3;
    }
    for (int64_t o = 4 * quads; o < out; ++o) {
        const float *wr = w + o * in;
        float s = 0.f;
        for (int64_t i = 0; i < in; ++i) s += x[i] * wr[i];
        y[o] = s;
    }
    if (bias != 0)
        for (int64_t o = 0; o < out; ++o) y[o] += bias[o];
}
