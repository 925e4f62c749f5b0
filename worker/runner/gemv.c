/* Few-row projection Y = X · W (+ b), fp32, for steps of a few query rows (CPU): a small
 * decode batch, a verify chunk of a decode row and its drafts, a batch-1 decode.
 *
 * Built with paged_decode.c by kvfleet/worker/cpu_kernels.py. The weight is held as panels of
 * PANEL output columns, (panels, in, PANEL) row-major, zero-padded past `out`: walking `in`
 * reads one contiguous stream per panel. Each thread takes whole panels; for every group of
 * up to TILE_ROWS X rows it keeps their PANEL outputs in registers, adding x[r, i] · W[i, panel]
 * per input, so no horizontal sums are needed and the weight is read from memory once for all
 * rows. With AVX-512 a tile of eight rows is 8 x 3 vector accumulators, all in registers, with
 * fused multiply-adds: the arithmetic of rows 5..8 then overlaps the weight stream instead of
 * costing a second walk over the panel. Each row's sums run in the same order whatever the
 * tile's row count, so a row's outputs do not depend on the rows beside it. Past one tile the
 * thread runs the next tiles over the same panel while it is still in cache (a panel of the
 * default model's widest `in` fits in L2), so a step of a few dozen rows streams the weight from memory once
 * and runs at the FMA rate. During the second tile's pass the thread prefetches its next panel, so that
 * panel's stream from memory overlaps arithmetic instead of stalling its first tile. oneDNN's packed
 * path, which reads a weight at well under the bandwidth for a few rows, only catches up past FEW_ROWS
 * (kvfleet/worker/runner/models/linear.py).
 */
#include <stdint.h>

#include "kernels.h"

#define PANEL 48
#define TILE_ROWS 8

#if defined(__AVX512F__)
#include <immintrin.h>

/* Outputs [o0, o0 + width) of R (<= TILE_ROWS) rows of X against one panel `wp` (in, PANEL). */
static inline __attribute__((always_inline)) void panel_tile(
    const float *x, int64_t in, const float *wp, const float *bias, float *y, int64_t out,
    int64_t o0, int64_t width, const int R, const float *next) {
    __m512 acc[TILE_ROWS][3];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; ++i) {
        const float *wv = wp + i * PANEL;
        if (next != 0) {
            __builtin_prefetch(next + i * PANEL, 0, 2);
            __builtin_prefetch(next + i * PANEL + 16, 0, 2);
            __builtin_prefetch(next + i * PANEL + 32, 0, 2);
        }
        const __m512 w0 = _mm512_loadu_ps(wv), w1 = _mm512_loadu_ps(wv + 16);
        const __m512 w2 = _mm512_loadu_ps(wv + 32);
        for (int r = 0; r < R; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * in + i]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float sums[PANEL];
        _mm512_storeu_ps(sums, acc[r][0]);
        _mm512_storeu_ps(sums + 16, acc[r][1]);
        _mm512_storeu_ps(sums + 32, acc[r][2]);
        for (int64_t j = 0; j < width; ++j)
            y[r * out + o0 + j] = sums[j] + (bias != 0 ? bias[o0 + j] : 0.f);
    }
}
#else
/* Portable form of the tile above (the compiler vectorises the column loop). */
static inline __attribute__((always_inline)) void panel_tile(
    const float *x, int64_t in, const float *wp, const float *bias, float *y, int64_t out,
    int64_t o0, int64_t width, const int R, const float *next) {
    float acc[TILE_ROWS][PANEL];
    for (int r = 0; r < R; ++r)
#pragma omp simd
        for (int j = 0; j < PANEL; ++j) acc[r][j] = 0.f;
    for (int64_t i = 0; i < in; ++i) {
        const float *wv = wp + i * PANEL;
        if (next != 0) {
            __builtin_prefetch(next + i * PANEL, 0, 2);
            __builtin_prefetch(next + i * PANEL + 16, 0, 2);
            __builtin_prefetch(next + i * PANEL + 32, 0, 2);
        }
        for (int r = 0; r < R; ++r) {
            const float xv = x[r * in + i];
#pragma omp simd
            for (int j = 0; j < PANEL; ++j) acc[r][j] += xv * wv[j];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < width; ++j)
            y[r * out + o0 + j] = acc[r][j] + (bias != 0 ? bias[o0 + j] : 0.f);
}
#endif

int few_rows_panel_width(void) { return PANEL; }

void gemm_few_rows(const float *x, int64_t m, const float *panels, const float *bias, float *y,
                   int64_t in, int64_t out, int num_threads) {
    const int64_t count = (out + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < count; ++p) {
        const int64_t o0 = p * PANEL, width = out - o0 < PANEL ? out - o0 : PANEL;
        const float *wp = panels + p * in * PANEL;
        /* the second tile pass over a panel runs from cache: fetch the next panel meanwhile */
        const float *next = p + 1 < count ? wp + in * PANEL : 0;
        int64_t r = 0;
        for (; r + TILE_ROWS <= m; r += TILE_ROWS)
            panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, TILE_ROWS,
                       r == TILE_ROWS ? next : 0);
        const float *tail_next = r == TILE_ROWS ? next : 0;
        /* constant row counts: each call is specialised with its accumulators in registers */
        switch (m - r) {
            case 7: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 7, tail_next); break;
            case 6: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 6, tail_next); break;
            case 5: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 5, tail_next); break;
            case 4: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 4, tail_next); break;
            case 3: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 3, tail_next); break;
            case 2: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 2, tail_next); break;
            case 1: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 1, tail_next); break;
            default: break;
        }
    }
}
