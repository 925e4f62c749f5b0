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
 * One task per decode: it walks its keys in cache order, each slot's heads in one contiguous
 * read (the prefetcher then streams whole blocks), the next block's slot prefetched ahead.
 * Softmax in two passes over a scores buffer (max, then exp and sum), as SDPA's math does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline const float *slot_ptr(const float *cache, const int64_t *table, int64_t p,
                                    int64_t block_size, int64_t slot_stride) {
    return cache + (table[p / block_size] * block_size + p % block_size) * slot_stride;
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
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t ahead = 4;  /* keys prefetched ahead: covers the jump to the next block */
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
        for (int64_t i = 0; i < n; ++i) {
            if (i + ahead < n)
                __builtin_prefetch(slot_ptr(k_cache, table, lo + i + ahead, block_size, slot_stride));
            const float *k = slot_ptr(k_cache, table, lo + i, block_size, slot_stride);
            for (int64_t hq = 0; hq < num_heads; ++hq) {
                const float *qh = q + hq * head_dim, *kh = k + (hq / group) * head_dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t e = 0; e < head_dim; ++e) s += qh[e] * kh[e];
                scores[hq * n + i] = s * scale;
            }
        }
        for (int64_t hq = 0; hq < num_heads; ++hq) {
            float *sh = scores + hq * n, m = sinks ? sinks[hq] : -INFINITY, sum = 0.f;
            for (int64_t i = 0; i < n; ++i) m = sh[i] > m ? sh[i] : m;
            for (int64_t i = 0; i < n; ++i) { sh[i] = expf(sh[i] - m); sum += sh[i]; }
            if (sinks) sum += expf(sinks[hq] - m);
            const float inv = 1.f / sum;
            for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
        }
        for (int64_t i = 0; i < n; ++i) {
            if (i + ahead < n)
                __builtin_prefetch(slot_ptr(v_cache, table, lo + i + ahead, block_size, slot_stride));
            const float *v = slot_ptr(v_cache, table, lo + i, block_size, slot_stride);
            for (int64_t hq = 0; hq < num_heads; ++hq) {
                const float w = scores[hq * n + i], *vh = v + (hq / group) * head_dim;
                float *ah = acc + hq * head_dim;
#pragma omp simd
                for (int64_t e = 0; e < head_dim; ++e) ah[e] += w * vh[e];
            }
        }
        float *o = out + token[d] * o_stride;
        for (int64_t e = 0; e < num_heads * head_dim; ++e) o[e] = acc[e];
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
