/* Paged decode attention (fp32, CPU): every one-token query of a step against its own keys,
 * read in place from the paged cache through its block table — no gather copy, no padding.
 *
 * Built and loaded by kvfleet/worker/cpu_kernels.py (plain C, no torch headers, compiled once
 * per machine). Layouts, all contiguous unless a stride is given:
 *   query   rows at query + token[d] * q_stride, each (num_heads, head_dim)
 *   out     rows at out   + token[d] * o_stride, each (num_heads, head_dim)
 *   k_cache, v_cache  (num_blocks, block_size, num_kv_heads, head_dim)
 *   tables  the decodes' block tables concatenated; table_start[d] .. table_start[d + 1]
 *   first[d] .. ctx[d] - 1  the keys decode d sees (first > 0 under a sliding window)
 *   sinks   NULL, or (num_heads,) per-head sink logits: each joins its head's softmax
 *           denominator (a key with that logit and a zero value), so the weights sum below 1
 * One task per decode (a verify chunk's rows are decodes too): it walks its keys in cache
 * order block by block (the prefetcher then streams the block), the next block's first slot
 * prefetched. With AVX-512 and head_dim 64 the scores of 16 keys of a block are summed
 * together (one transpose-add instead of 16 horizontal sums), and the values are weighed per
 * KV head with its query heads' outputs held in registers, not summed in memory.
 * Softmax in two passes over a scores buffer (max, then exp and sum), as SDPA's math does;
 * with AVX-512 the exp is a vector polynomial (about one ulp) instead of scalar expf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Heads' outputs acc[hq] = sum over the n keys from position lo of scores[hq, i] · V[i, hq's KV
 * head], keys in cache order (the same order for every query row, whatever the batch). */
#if defined(__AVX512F__)
#include <immintrin.h>

/* One KV head's G query heads with head_dim 64: their outputs in 4 x G vector registers while
 * the walk over the keys reads each value once. */
static inline __attribute__((always_inline)) void weigh_head64(
    float *acc, const float *scores, int64_t n, const float *v_cache, const int64_t *table,
    int64_t lo, int64_t block_size, int64_t slot_stride, int64_t h, const int G) {
    __m512 a[4][4];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm512_setzero_ps();
    for (int64_t i = 0, p = lo; i < n;) {
        const int64_t off = p % block_size, run = block_size - off < n - i ? block_size - off : n - i;
        const float *v = v_cache + (table[p / block_size] * block_size + off) * slot_stride + h * 64;
        for (int64_t s = 0; s < run; ++s, v += slot_stride) {
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
            for (int g = 0; g < G; ++g) {
                const __m512 w = _mm512_set1_ps(scores[(h * G + g) * n + i + s]);
                a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
                a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
                a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
            }
        }
        i += run;
        p += run;
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (h * G + g) * 64 + c * 16, a[g][c]);
}
#endif

static void weigh_values(float *acc, const float *scores, int64_t n, const float *v_cache,
                         const int64_t *table, int64_t lo, int64_t block_size,
                         int64_t num_kv_heads, int64_t head_dim, int64_t group) {
    const int64_t slot_stride = num_kv_heads * head_dim;
#if defined(__AVX512F__)
    if (head_dim == 64 && group >= 1 && group <= 4) {
        for (int64_t h = 0; h < num_kv_heads; ++h) switch (group) {
            case 1: weigh_head64(acc, scores, n, v_cache, table, lo, block_size, slot_stride, h, 1); break;
            case 2: weigh_head64(acc, scores, n, v_cache, table, lo, block_size, slot_stride, h, 2); break;
            case 3: weigh_head64(acc, scores, n, v_cache, table, lo, block_size, slot_stride, h, 3); break;
            default: weigh_head64(acc, scores, n, v_cache, table, lo, block_size, slot_stride, h, 4); break;
        }
        return;
    }
#endif
    for (int64_t i = 0, p = lo; i < n;) {
        const int64_t off = p % block_size, run = block_size - off < n - i ? block_size - off : n - i;
        const float *v = v_cache + (table[p / block_size] * block_size + off) * slot_stride;
        for (int64_t s = 0; s < run; ++s, v += slot_stride)
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                const float *vh = v + h * head_dim;
                for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
                    const float w = scores[hq * n + i + s];
                    float *ah = acc + hq * head_dim;
#pragma omp simd
                    for (int64_t e = 0; e < head_dim; ++e) ah[e] += w * vh[e];
                }
            }
        i += run;
        p += run;
    }
}

#if defined(__AVX512F__)
/* exp of x <= 0: 2^k · e^r, x = k ln 2 + r (ln 2 in two parts, for an accurate r), |r| <= ln 2 / 2,
 * e^r by its Taylor series to r^7 (truncation below 1e-8 relative; about one ulp in all).
 * Below about -103 the result is 0 or a denormal, as expf's. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, k);
}
#endif

/* sh[i] = exp(sh[i] - m) for i < n (every sh[i] <= m); returns their sum. */
static float exp_shifted(float *sh, int64_t n, float m) {
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 keep = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, sh + i), mv));
        _mm512_mask_storeu_ps(sh + i, keep, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(keep, e));
    }
    return _mm512_reduce_add_ps(sum);
#else
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) { sh[i] = expf(sh[i] - m); sum += sh[i]; }
    return sum;
#endif
}

#if defined(__AVX512F__)
/* The sums of 16 vectors, one per lane: lane j of the result is the sum of t[j]'s lanes. */
static inline __m512 sum16(__m512 t[16]) {
    __m512 u[8], v[4];
    for (int j = 0; j < 8; ++j)  /* per 128-bit lane: t[2j] at 0 and 2, t[2j + 1] at 1 and 3 */
        u[j] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * j], t[2 * j + 1]),
                             _mm512_unpackhi_ps(t[2 * j], t[2 * j + 1]));
    for (int j = 0; j < 4; ++j)  /* per 128-bit lane: t[4j] .. t[4j + 3], one each */
        v[j] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* q · k of one query head (qv: its 64 values) and one key row (64 values at kh), as a vector
 * whose lanes sum to it. */
static inline __m512 dot64(const __m512 qv[4], const float *kh) {
    __m512 t = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kh));
    t = _mm512_fmadd_ps(qv[1], _mm512_loadu_ps(kh + 16), t);
    t = _mm512_fmadd_ps(qv[2], _mm512_loadu_ps(kh + 32), t);
    return _mm512_fmadd_ps(qv[3], _mm512_loadu_ps(kh + 48), t);
}
#endif

/* scores[hq, i] = scale · q[hq] · K[lo + i, hq's KV head] for the n keys from position lo, keys
 * walked in cache order block by block (no division per key). With AVX-512 and head_dim 64,
 * 16 keys of a block at a time per query head, their 16 horizontal sums done together. */
static void score_keys(float *scores, int64_t n, const float *q, const float *k_cache,
                       const int64_t *table, int64_t lo, int64_t block_size, int64_t num_kv_heads,
                       int64_t head_dim, int64_t group, float scale) {
    const int64_t slot_stride = num_kv_heads * head_dim;
    for (int64_t i = 0, p = lo; i < n;) {
        const int64_t off = p % block_size, run = block_size - off < n - i ? block_size - off : n - i;
        const float *k = k_cache + (table[p / block_size] * block_size + off) * slot_stride;
        if (i + run < n)  /* the next block's first keys: the prefetcher does not know it */
            __builtin_prefetch(k_cache + table[(p + run) / block_size] * block_size * slot_stride);
        int64_t s = 0;
#if defined(__AVX512F__)
        if (head_dim == 64)
            for (; s + 16 <= run; s += 16)
                for (int64_t hq = 0; hq < num_kv_heads * group; ++hq) {
                    const float *qh = q + hq * 64, *kh = k + s * slot_stride + (hq / group) * 64;
                    const __m512 qv[4] = {_mm512_loadu_ps(qh), _mm512_loadu_ps(qh + 16),
                                          _mm512_loadu_ps(qh + 32), _mm512_loadu_ps(qh + 48)};
                    __m512 t[16];
                    for (int j = 0; j < 16; ++j) t[j] = dot64(qv, kh + j * slot_stride);
                    _mm512_storeu_ps(scores + hq * n + i + s,
                                     _mm512_mul_ps(sum16(t), _mm512_set1_ps(scale)));
                }
#endif
        for (const float *ks = k + s * slot_stride; s < run; ++s, ks += slot_stride)
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                const float *kh = ks + h * head_dim;
                for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
                    const float *qh = q + hq * head_dim;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t e = 0; e < head_dim; ++e) dot += qh[e] * kh[e];
                    scores[hq * n + i + s] = dot * scale;
                }
            }
        i += run;
        p += run;
    }
}

/* Returns 0, or -1 when a scratch buffer could not be allocated (that decode's row is left
 * unwritten; the caller raises). */
int paged_decode_attention(const float *query, int64_t q_stride, float *out, int64_t o_stride,
                            const float *k_cache, const float *v_cache, const int64_t *token,
                            const int64_t *tables, const int64_t *table_start,
                            const int64_t *first, const int64_t *ctx, int64_t num_decodes,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, const float *sinks,
                            int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t d = 0; d < num_decodes; ++d) {
        const int64_t lo = first[d], n = ctx[d] - first[d];
        const int64_t *table = tables + table_start[d];
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * n));
        float *acc = calloc((size_t)(num_heads * head_dim), sizeof(float));
        if (scores == NULL || acc == NULL) {
            free(scores);
            free(acc);
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *q = query + token[d] * q_stride;
        score_keys(scores, n, q, k_cache, table, lo, block_size, num_kv_heads, head_dim, group, scale);
        for (int64_t hq = 0; hq < num_heads; ++hq) {
            float *sh = scores + hq * n, m = sinks ? sinks[hq] : -INFINITY, sum = 0.f;
            for (int64_t i = 0; i < n; ++i) m = sh[i] > m ? sh[i] : m;
            sum = exp_shifted(sh, n, m);
            if (sinks) sum += expf(sinks[hq] - m);
            const float inv = 1.f / sum;
            for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
        }
        weigh_values(acc, scores, n, v_cache, table, lo, block_size, num_kv_heads, head_dim, group);
        float *o = out + token[d] * o_stride;
        for (int64_t e = 0; e < num_heads * head_dim; ++e) o[e] = acc[e];
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
