/* Few-row projection Y = X · W (+ b), fp32, for steps of a few query rows (CPU): a small
 * decode batch, a verify chunk of a decode row and its drafts, a batch-1 decode.
 *
 * Built with paged_decode.c by kvfleet/worker/cpu_kernels.py. The weight is held as panels of
 * PANEL output columns, (panels, in, PANEL) row-major, zero-padded past `out`: walking `in`
 * reads one contiguous stream per panel. Each thread takes whole panels; for every group of
 * up to four X rows it keeps their PANEL outputs in registers, adding x[r, i] · W[i, panel] per
 * input, so no horizontal sums are needed and the weight is read from memory once for all rows
 * (rows past the first four re-read the panel from cache). oneDNN's packed path, which wins
 * from a dozen or so rows on, reads a weight at well under the bandwidth for so few rows.
 */
#include <stdint.h>

#define PANEL 64
#define TILE_ROWS 4

/* Outputs [o0, o0 + width) of R (<= TILE_ROWS) rows of X against one panel `wp` (in, PANEL). */
static inline __attribute__((always_inline)) void panel_tile(
    const float *x, int64_t in, const float *wp, const float *bias, float *y, int64_t out,
    int64_t o0, int64_t width, const int R) {
    float acc[TILE_ROWS][PANEL];
    for (int r = 0; r < R; ++r)
#pragma omp simd
        for (int j = 0; j < PANEL; ++j) acc[r][j] = 0.f;
    for (int64_t i = 0; i < in; ++i) {
        const float *wv = wp + i * PANEL;
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

int few_rows_panel_width(void) { return PANEL; }

void gemm_few_rows(const float *x, int64_t m, const float *panels, const float *bias, float *y,
                   int64_t in, int64_t out, int num_threads) {
    const int64_t count = (out + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < count; ++p) {
        const int64_t o0 = p * PANEL, width = out - o0 < PANEL ? out - o0 : PANEL;
        const float *wp = panels + p * in * PANEL;
        int64_t r = 0;
        for (; r + TILE_ROWS <= m; r += TILE_ROWS)
            panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, TILE_ROWS);
        /* constant row counts: each call is specialised with its accumulators in registers */
        switch (m - r) {
            case 3: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 3); break;
            case 2: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 2); break;
            case 1: panel_tile(x + r * in, in, wp, bias, y + r * out, out, o0, width, 1); break;
            default: break;
        }
    }
}
