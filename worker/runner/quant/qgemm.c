/* Weight-only int8 / int4 products y = x · Wᵀ (+ b), fp32 activations, for every batch size.
 *
 * Built with the other kernels by kvfleet/worker/runner/cpu_kernels.py (plain C, no
 * intrinsics: GCC vectorises the 16-lane loops for the machine it is built on, 512-bit or
 * 256-bit). Layout of a packed weight of `out` outputs and `in` inputs, outputs in blocks of
 * 16 lanes (the last block zero-padded), groups of `group` consecutive inputs:
 *   int8  q[b][k][16]          signed; w = scale · q
 *   int4  q[b][k / 2][16]      uint8, input k (even) in the low nibble, k + 1 in the high one;
 *                              w = scale · q + offset   (q in 0..15)
 *   scale, offset [b][g][16]   fp32, or fp16 bits when `half` is set
 * One block's weights are contiguous, so a task streams them once while it multiplies them
 * with up to TILE rows of x: each weight is dequantized once per TILE rows, the group scale
 * applied once per group (products accumulate unscaled inside a group), and an int4 offset
 * enters through the rows' group sums of x, computed once per call.
 */
#pragma GCC optimize("fp-contract=fast")  /* fused multiply-adds: -std=c11 turns them off */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "qkernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* One IEEE half to float, exactly (qrows.c, in the same library, uses it too). */
float kvf_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {  /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define LANES 16
#define TILE 8

/* 16 lanes as one vector: one zmm register on AVX-512, two ymm on AVX2, scalar code elsewhere.
 * Only the widening loads need intrinsics (GCC makes scalar code of a vector byte → float
 * conversion); everything else is plain vector arithmetic. */
typedef float v16f __attribute__((vector_size(64)));

#if defined(__AVX512F__)
static inline v16f widen_i8(const int8_t *p) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void widen_u4(const uint8_t *p, v16f *lo, v16f *hi) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (v16f)_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)));
    *hi = (v16f)_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
}
static inline v16f widen_f16(const uint16_t *p) {
    return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__AVX2__) && defined(__F16C__)
static inline v16f join(__m256 a, __m256 b) {
    v16f v;
    memcpy(&v, &a, sizeof a);
    memcpy((char *)&v + sizeof a, &b, sizeof b);
    return v;
}
static inline v16f widen_i8(const int8_t *p) {
    const __m128i c = _mm_loadu_si128((const __m128i *)p);
    return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8))));
}
static inline void widen_u4(const uint8_t *p, v16f *lo, v16f *hi) {
    const __m128i c = _mm_loadu_si128((const __m128i *)p);
    const __m256i a = _mm256_cvtepu8_epi32(c), b = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
    const __m256i m = _mm256_set1_epi32(15);
    *lo = join(_mm256_cvtepi32_ps(_mm256_and_si256(a, m)), _mm256_cvtepi32_ps(_mm256_and_si256(b, m)));
    *hi = join(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
}
static inline v16f widen_f16(const uint16_t *p) {
    return join(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
#else
static inline v16f widen_i8(const int8_t *p) {
    v16f v;
    for (int l = 0; l < LANES; ++l) v[l] = (float)p[l];
    return v;
}
static inline void widen_u4(const uint8_t *p, v16f *lo, v16f *hi) {
    for (int l = 0; l < LANES; ++l) {
        (*lo)[l] = (float)(p[l] & 15);
        (*hi)[l] = (float)(p[l] >> 4);
    }
}
static inline v16f widen_f16(const uint16_t *p) {
    v16f v;
    for (int l = 0; l < LANES; ++l) v[l] = kvf_half_to_float(p[l]);
    return v;
}
#endif

/* Cache-line hints for the `bytes` of codes from p, which a task reads next: one thread
 * streaming alone does not keep enough lines in flight to reach the memory bandwidth. */
static inline void prefetch_lines(const void *p, int64_t bytes) {
#if defined(__GNUC__)
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
#else
    (void)p, (void)bytes;
#endif
}

static inline v16f lanes(const void *src, int half, int64_t index) {
    if (half) return widen_f16((const uint16_t *)src + index);
    v16f f;
    memcpy(&f, (const float *)src + index, sizeof f);
    return f;
}

/* One tile: rows 0 .. MT - 1 of x (row stride ldx) against NB consecutive output blocks
 * (block stride bstride codes), accumulated over every group into acc[m * NB + n]. Products
 * accumulate unscaled inside a group, in two chains per (m, n) where few rows give too few
 * independent sums to hide the add latency; the group's scale then multiplies them once. */
#define DEFINE_INT8_TILE(MT, NB)                                                                \
    static void int8_tile_##MT##_##NB(const float *x, int64_t ldx, const int8_t *q,             \
                                      int64_t bstride, const char *scale, int64_t sstride,       \
                                      int half, int64_t in, int64_t group, int64_t ahead,       \
                                      v16f *acc) {                                              \
        v16f sum[MT][NB] = {{{0}}};                                                               \
        for (int64_t k0 = 0; k0 < in; k0 += group) {                                            \
            v16f p0[MT][NB] = {{{0}}}, p1[MT][NB] = {{{0}}};                                        \
            for (int n = 0; n < NB; ++n)                                                        \
                prefetch_lines(q + n * bstride + k0 * LANES + ahead, group * LANES);            \
            int64_t k = k0;                                                                     \
            for (; k + 1 < k0 + group; k += 2)                                                  \
                _Pragma("GCC unroll 2") for (int n = 0; n < NB; ++n) {                          \
                    const v16f w0 = widen_i8(q + n * bstride + k * LANES);                      \
                    const v16f w1 = widen_i8(q + n * bstride + (k + 1) * LANES);                \
                    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {                      \
                        p0[m][n] += x[m * ldx + k] * w0;                                        \
                        p1[m][n] += x[m * ldx + k + 1] * w1;                                    \
                    }                                                                           \
                }                                                                               \
            if (k < k0 + group)                                                                 \
                _Pragma("GCC unroll 2") for (int n = 0; n < NB; ++n) {                          \
                    const v16f w0 = widen_i8(q + n * bstride + k * LANES);                      \
                    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m)                        \
                        p0[m][n] += x[m * ldx + k] * w0;                                        \
                }                                                                               \
            const int64_t g = k0 / group;                                                       \
            _Pragma("GCC unroll 2") for (int n = 0; n < NB; ++n) {                              \
                const v16f s = lanes(scale + n * sstride, half, g * LANES);                     \
                _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m)                            \
                    sum[m][n] += s * (p0[m][n] + p1[m][n]);                                     \
            }                                                                                   \
        }                                                                                       \
        for (int m = 0; m < MT; ++m)                                                            \
            for (int n = 0; n < NB; ++n) acc[m * NB + n] = sum[m][n];                           \
    }

#define DEFINE_INT4_TILE(MT, NB)                                                                \
    static void int4_tile_##MT##_##NB(const float *x, int64_t ldx, const uint8_t *q,            \
                                      int64_t bstride, const char *scale, const char *offset,   \
                                      int64_t sstride, const float *xsum, int64_t ngroups,      \
                                      int half, int64_t in, int64_t group, int64_t ahead,       \
                                      v16f *acc) {                                              \
        v16f sum[MT][NB] = {{{0}}};                                                               \
        for (int64_t k0 = 0; k0 < in; k0 += group) {                                            \
            v16f p0[MT][NB] = {{{0}}}, p1[MT][NB] = {{{0}}};                                        \
            for (int n = 0; n < NB; ++n)                                                        \
                prefetch_lines(q + n * bstride + k0 / 2 * LANES + ahead, group / 2 * LANES);    \
            for (int64_t k = k0; k < k0 + group; k += 2)                                        \
                _Pragma("GCC unroll 2") for (int n = 0; n < NB; ++n) {                          \
                    v16f lo, hi;                                                                \
                    widen_u4(q + n * bstride + k / 2 * LANES, &lo, &hi);                        \
                    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {                      \
                        p0[m][n] += x[m * ldx + k] * lo;                                        \
                        p1[m][n] += x[m * ldx + k + 1] * hi;                                    \
                    }                                                                           \
                }                                                                               \
            const int64_t g = k0 / group;                                                       \
            _Pragma("GCC unroll 2") for (int n = 0; n < NB; ++n) {                              \
                const v16f s = lanes(scale + n * sstride, half, g * LANES);                     \
                const v16f o = lanes(offset + n * sstride, half, g * LANES);                    \
                _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m)                            \
                    sum[m][n] += s * (p0[m][n] + p1[m][n]) + xsum[m * ngroups + g] * o;         \
            }                                                                                   \
        }                                                                                       \
        for (int m = 0; m < MT; ++m)                                                            \
            for (int n = 0; n < NB; ++n) acc[m * NB + n] = sum[m][n];                           \
    }

/* Tiles by rows: up to 4 rows over both blocks of a panel, 5 to 8 rows block by block. */
#define PANEL 2
DEFINE_INT8_TILE(1, 2)
DEFINE_INT8_TILE(2, 2)
DEFINE_INT8_TILE(3, 2)
DEFINE_INT8_TILE(4, 2)
DEFINE_INT8_TILE(5, 1)
DEFINE_INT8_TILE(6, 1)
DEFINE_INT8_TILE(7, 1)
DEFINE_INT8_TILE(8, 1)
DEFINE_INT4_TILE(1, 2)
DEFINE_INT4_TILE(2, 2)
DEFINE_INT4_TILE(3, 2)
DEFINE_INT4_TILE(4, 2)
DEFINE_INT4_TILE(5, 1)
DEFINE_INT4_TILE(6, 1)
DEFINE_INT4_TILE(7, 1)
DEFINE_INT4_TILE(8, 1)

typedef void (*int8_tile_fn)(const float *, int64_t, const int8_t *, int64_t, const char *,
                             int64_t, int, int64_t, int64_t, int64_t, v16f *);
typedef void (*int4_tile_fn)(const float *, int64_t, const uint8_t *, int64_t, const char *,
                             const char *, int64_t, const float *, int64_t, int, int64_t, int64_t,
                             int64_t, v16f *);
static const int8_tile_fn INT8_TILES[TILE + 1] = {
    0, int8_tile_1_2, int8_tile_2_2, int8_tile_3_2, int8_tile_4_2,
    int8_tile_5_1, int8_tile_6_1, int8_tile_7_1, int8_tile_8_1};
static const int4_tile_fn INT4_TILES[TILE + 1] = {
    0, int4_tile_1_2, int4_tile_2_2, int4_tile_3_2, int4_tile_4_2,
    int4_tile_5_1, int4_tile_6_1, int4_tile_7_1, int4_tile_8_1};
static inline int tile_blocks(int mt) { return mt <= 4 ? 2 : 1; }

/* acc[m * nb + n] → y rows m0.., columns (b + n) * 16.. (only those below out), plus bias. */
static void store_tile(const v16f *acc, int mt, int nb, float *y, int64_t ldy, int64_t m0,
                       int64_t b, int64_t out, const float *bias) {
    for (int n = 0; n < nb; ++n) {
        const int64_t o0 = (b + n) * LANES;
        const int64_t cols = out - o0 < LANES ? out - o0 : LANES;
        for (int m = 0; m < mt; ++m) {
            float *row = y + (m0 + m) * ldy + o0;
            for (int64_t l = 0; l < cols; ++l)
                row[l] = acc[m * nb + n][l] + (bias ? bias[o0 + l] : 0.f);
        }
    }
}

/* The packed blocks number a multiple of PANEL (the packer pads them); each task takes one
 * panel of PANEL blocks and every row of x, TILE rows at a time, prefetching the same place
 * of the next panel (`ahead` codes on; none past the last). Threads take contiguous runs of
 * panels, so that next panel is usually the thread's own. A work-shared loop without its
 * barrier: the caller opens the region (or calls it outside one) and waits where it must. */
#define FOR_EACH_TILE(BSTRIDE, BODY)                                                            \
    const int64_t panels = (out + PANEL * LANES - 1) / (PANEL * LANES);                         \
    _Pragma("omp for schedule(static) nowait")                                                  \
    for (int64_t p = 0; p < panels; ++p) {                                                      \
        v16f acc[TILE * PANEL];                                                                 \
        const int64_t ahead = p + 1 < panels ? PANEL * (BSTRIDE) : 0;                           \
        for (int64_t m0 = 0; m0 < rows; m0 += TILE) {                                           \
            const int mt = rows - m0 < TILE ? (int)(rows - m0) : TILE, nb = tile_blocks(mt);    \
            for (int64_t b = p * PANEL; b < (p + 1) * PANEL; b += nb) {                         \
                BODY;                                                                           \
                store_tile(acc, mt, nb, y, ldy, m0, b, out, bias);                              \
            }                                                                                   \
        }                                                                                       \
    }

/* qgemm_int8 as a work-shared loop of the enclosing parallel region, without its barrier (the
 * caller waits before it reads y); outside a region, the whole product on the calling thread. */
void qgemm_int8_for(const float *x, int64_t ldx, int64_t rows, const int8_t *q, const void *scale,
                    int half, int64_t in, int64_t out, int64_t group, const float *bias, float *y,
                    int64_t ldy) {
    const int64_t ngroups = in / group, bstride = in * LANES;
    const int64_t sstride = ngroups * LANES * (half ? 2 : 4);
    FOR_EACH_TILE(bstride, INT8_TILES[mt](x + m0 * ldx, ldx, q + b * bstride, bstride,
                                          (const char *)scale + b * sstride, sstride, half, in,
                                          group, ahead, acc))
}

/* x (rows, in) with row stride ldx → y (rows, out) with row stride ldy. */
void qgemm_int8(const float *x, int64_t ldx, int64_t rows, const int8_t *q, const void *scale,
                int half, int64_t in, int64_t out, int64_t group, const float *bias, float *y,
                int64_t ldy, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    qgemm_int8_for(x, ldx, rows, q, scale, half, in, out, group, bias, y, ldy);
}

/* qgemm_int4 as qgemm_int8_for; xsum: the calling thread's scratch of rows · (in / group)
 * floats (every thread of the region fills its own with the same group sums of x). */
void qgemm_int4_for(const float *x, int64_t ldx, int64_t rows, const uint8_t *q, const void *scale,
                    const void *offset, int half, int64_t in, int64_t out, int64_t group,
                    const float *bias, float *y, int64_t ldy, float *xsum) {
    const int64_t ngroups = in / group, bstride = in / 2 * LANES;
    const int64_t sstride = ngroups * LANES * (half ? 2 : 4);
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t g = 0; g < ngroups; ++g) {
            float s = 0.f;
            for (int64_t k = g * group; k < (g + 1) * group; ++k) s += x[m * ldx + k];
            xsum[m * ngroups + g] = s;
        }
    FOR_EACH_TILE(bstride, INT4_TILES[mt](x + m0 * ldx, ldx, q + b * bstride, bstride,
                                          (const char *)scale + b * sstride,
                                          (const char *)offset + b * sstride, sstride,
                                          xsum + m0 * ngroups, ngroups, half, in, group, ahead,
                                          acc))
}

/* As qgemm_int8; returns -1 (y unwritten) when the rows' group sums cannot be allocated. */
int qgemm_int4(const float *x, int64_t ldx, int64_t rows, const uint8_t *q, const void *scale,
               const void *offset, int half, int64_t in, int64_t out, int64_t group,
               const float *bias, float *y, int64_t ldy, int num_threads) {
    float *xsum = malloc((size_t)(rows * (in / group) * num_threads) * sizeof(float));
    if (xsum == 0) return -1;
#pragma omp parallel num_threads(num_threads)
    qgemm_int4_for(x, ldx, rows, q, scale, offset, half, in, out, group, bias, y, ldy,
                   xsum + (size_t)omp_get_thread_num() * (size_t)(rows * (in / group)));
    free(xsum);
    return 0;
}
