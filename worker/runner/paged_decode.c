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
 * A verify chunk's rows are decodes too: consecutive decodes over the same blocks are walked
 * together, one task per such group (or a chunk of it) and KV head, or all KV heads when there
 * are enough groups for the threads, every block read once per task while hot;
 * each row's keys stay in cache order block by block, the next block's first slot prefetched,
 * so every row's result is bit-equal to its lone decode's. With AVX-512 and head_dim 64 the
 * scores of 16 keys of a block are summed together (one transpose-add instead of 16 horizontal
 * sums), and the values are weighed per KV head with its query heads' outputs held in registers
 * over each block.
 * Softmax in two passes over a scores buffer (max, then exp and sum), as SDPA's math does;
 * with AVX-512 the exp is a vector polynomial (about one ulp) instead of scalar expf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* One KV head h's outputs acc[g] (its G query heads, g < G) += scores[g, i + s] · V[p + s, h] for
 * the run keys of one block (their first slot at v, position p = lo + i), keys in cache order.
 * A row's keys are walked block by block in the same order whatever the rows beside it, so its
 * accumulation order (and its bits) stay those of a lone decode. */
#if defined(__AVX512F__)
#include <immintrin.h>

/* head_dim 64: the G outputs in 4 x G vector registers over the block's keys. */
static inline __attribute__((always_inline)) void weigh_block64(
    float *acc, const float *scores, int64_t n, int64_t i, int64_t run, const float *v,
    int64_t slot_stride, const int G) {
    __m512 a[4][4];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 64 + c * 16);
    for (int64_t s = 0; s < run; ++s, v += slot_stride) {
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
        for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(scores[g * n + i + s]);
            a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
            a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
            a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * 64 + c * 16, a[g][c]);
}
#endif

static void weigh_block(float *acc, const float *scores, int64_t n, int64_t i, int64_t run,
                        const float *v, int64_t slot_stride, int64_t head_dim, int64_t group) {
#if defined(__AVX512F__)
    if (head_dim == 64 && group >= 1 && group <= 4) {
        switch (group) {
            case 1: weigh_block64(acc, scores, n, i, run, v, slot_stride, 1); break;
            case 2: weigh_block64(acc, scores, n, i, run, v, slot_stride, 2); break;
            case 3: weigh_block64(acc, scores, n, i, run, v, slot_stride, 3); break;
            default: weigh_block64(acc, scores, n, i, run, v, slot_stride, 4); break;
        }
        return;
    }
#endif
    for (int64_t s = 0; s < run; ++s, v += slot_stride)
        for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * n + i + s];
            float *ah = acc + g * head_dim;
#pragma omp simd
            for (int64_t e = 0; e < head_dim; ++e) ah[e] += w * v[e];
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

/* scores[g, i + s] = scale · q[g] · K[p + s, h] for KV head h's G query heads (q: the first of
 * them) and the run keys of one block (their first slot at k, h's part at k + h * head_dim).
 * With AVX-512 and head_dim 64, 16 keys at a time per query head, their 16 horizontal sums done
 * together; the block's last run % 16 keys one by one. A key's score depends only on its place
 * in its block's run, as in a lone decode's walk. */
static void score_block(float *scores, int64_t n, int64_t i, int64_t run, const float *q,
                        const float *k, int64_t slot_stride, int64_t head_dim, int64_t group,
                        float scale) {
    int64_t s = 0;
#if defined(__AVX512F__)
    if (head_dim == 64)
        for (; s + 16 <= run; s += 16)
            for (int64_t g = 0; g < group; ++g) {
                const float *qh = q + g * 64, *kh = k + s * slot_stride;
                const __m512 qv[4] = {_mm512_loadu_ps(qh), _mm512_loadu_ps(qh + 16),
                                      _mm512_loadu_ps(qh + 32), _mm512_loadu_ps(qh + 48)};
                __m512 t[16];
                for (int j = 0; j < 16; ++j) t[j] = dot64(qv, kh + j * slot_stride);
                _mm512_storeu_ps(scores + g * n + i + s, _mm512_mul_ps(sum16(t), _mm512_set1_ps(scale)));
            }
#endif
    for (const float *ks = k + s * slot_stride; s < run; ++s, ks += slot_stride)
        for (int64_t g = 0; g < group; ++g) {
            const float *qh = q + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t e = 0; e < head_dim; ++e) dot += qh[e] * ks[e];
            scores[g * n + i + s] = dot * scale;
        }
}

/* Whether decodes a and b may share a walk: the same first key and the same blocks over the
 * keys both see (a verify chunk's rows, or sequences sharing a cached prefix). Sharing is only
 * a speed-up: each row still reads through its own block table. */
static int same_walk(int64_t a, int64_t b, const int64_t *tables, const int64_t *table_start,
                     const int64_t *first, const int64_t *ctx, int64_t block_size) {
    if (first[a] != first[b]) return 0;
    const int64_t last = (ctx[a] < ctx[b] ? ctx[a] : ctx[b]) - 1;
    const int64_t *ta = tables + table_start[a], *tb = tables + table_start[b];
    for (int64_t j = first[a] / block_size; j <= last / block_size; ++j)
        if (ta[j] != tb[j]) return 0;
    return 1;
}

/* Fewer decodes than threads split each decode's KV heads across the threads; that pays
 * only when the decodes see this many keys on average: below it a parallel region's start
 * and barrier cost about what they save, so such steps run on one thread a decode. The
 * split does not change any result (each KV head's arithmetic is the same either way). */
#define SPLIT_MIN_KEYS 64

/* Consecutive decodes with the same walk (same_walk with the group's first) form a group; a task
 * (a group's rows, or a chunk of them, and all KV heads or one) walks the keys block by block,
 * and at each block every row of the task that sees it scores, then later weighs, that block's
 * keys, so a block is read from memory once for the task while it is hot. Each row keeps a lone
 * decode's per-key arithmetic and order, so the tasks' split never changes a result.
 *
 * decode_attention_plan writes the tasks for `num_threads` threads: 3 int64 each (first row,
 * rows, first KV head) into tasks (room for num_decodes * num_kv_heads), gstart (room for
 * num_decodes + 1) its scratch; *per_task gets the KV heads a task covers, *threads the threads
 * worth running them (at most num_threads). Returns the number of tasks. The plan depends only
 * on its arguments, so every thread of a team may make its own. */
int64_t decode_attention_plan(const decode_attn_t *a, int num_threads, int64_t *gstart,
                              int64_t *tasks, int64_t *per_task_out, int *threads) {
    const int64_t num_decodes = a->num_decodes, num_kv_heads = a->num_kv_heads;
    const int64_t *first = a->first, *ctx = a->ctx;
    if (num_decodes < num_threads) {  /* the KV heads would go apart: worth a region? */
        int64_t keys = 0;
        for (int64_t d = 0; d < num_decodes; ++d) keys += ctx[d] - first[d];
        if (keys < SPLIT_MIN_KEYS * num_decodes) num_threads = (int)num_decodes;
    }
    int64_t num_groups = 0, widest = 1;
    for (int64_t d = 0; d < num_decodes; ++d)
        if (d == 0 || !same_walk(gstart[num_groups - 1], d, a->tables, a->table_start, first, ctx,
                                 a->block_size))
            gstart[num_groups++] = d;
    gstart[num_groups] = num_decodes;
    for (int64_t j = 0; j < num_groups; ++j)
        widest = gstart[j + 1] - gstart[j] > widest ? gstart[j + 1] - gstart[j] : widest;
    /* Enough tasks to keep the threads even (a few per thread): KV heads apart when there are
     * few groups, then groups cut into chunks of at most most_rows rows. */
    const int64_t want = num_threads > 1 ? 2 * (int64_t)num_threads : 1;
    const int64_t per_task = num_groups >= want ? num_kv_heads : 1;
    int64_t most_rows = widest, num_tasks;
    for (;;) {
        num_tasks = 0;
        for (int64_t j = 0; j < num_groups; ++j)
            num_tasks += (gstart[j + 1] - gstart[j] + most_rows - 1) / most_rows * (num_kv_heads / per_task);
        if (num_tasks >= want || most_rows == 1) break;
        most_rows = (most_rows + 1) / 2;
    }
    num_tasks = 0;
    for (int64_t j = 0; j < num_groups; ++j)
        for (int64_t d = gstart[j]; d < gstart[j + 1]; d += most_rows)
            for (int64_t h = 0; h < num_kv_heads; h += per_task, ++num_tasks) {
                tasks[3 * num_tasks] = d;
                tasks[3 * num_tasks + 1] = gstart[j + 1] - d < most_rows ? gstart[j + 1] - d : most_rows;
                tasks[3 * num_tasks + 2] = h;
            }
    *per_task_out = per_task;
    *threads = num_threads;
    return num_tasks;
}

/* One task of a plan. Returns 0, or -1 when its scratch could not be allocated (its rows are
 * left unwritten). */
int decode_attention_task(const decode_attn_t *a, const int64_t *tasks, int64_t task,
                          int64_t per_task) {
    const float *query = a->query, *k_cache = a->k_cache, *v_cache = a->v_cache, *sinks = a->sinks;
    float *out = a->out;
    const int64_t q_stride = a->q_stride, o_stride = a->o_stride, head_dim = a->head_dim;
    const int64_t *token = a->token, *tables = a->tables, *table_start = a->table_start;
    const int64_t *first = a->first, *ctx = a->ctx, block_size = a->block_size;
    const int64_t group = a->num_heads / a->num_kv_heads, slot_stride = a->num_kv_heads * head_dim;
    const float scale = a->scale;
    const int64_t d0 = tasks[3 * task], rows = tasks[3 * task + 1], h0 = tasks[3 * task + 2];
    const int64_t lo = first[d0], heads = per_task * group, width = heads * head_dim;
    int64_t total = 0, most = 0, far = d0;  /* scores over all rows; the longest row, its keys */
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = ctx[d0 + r] - lo;
        total += n;
        if (n > most) most = n, far = d0 + r;
    }
    float *scores = malloc(sizeof(float) * (size_t)(heads * total));
    float *acc = calloc((size_t)(rows * width), sizeof(float));
    if (scores == NULL || acc == NULL) {
        free(scores);
        free(acc);
        return -1;
    }
    for (int pass = 0; pass < 2; ++pass) {  /* 0: scores of every row; 1: weighed values */
        if (pass == 1)  /* each row's softmax, per query head, over its n keys */
            for (int64_t r = 0, at = 0; r < rows; at += heads * (ctx[d0 + r] - lo), ++r) {
                const int64_t n = ctx[d0 + r] - lo;
                for (int64_t j = 0; j < heads; ++j) {
                    const int64_t hq = h0 * group + j;
                    float *sh = scores + at + j * n, m = sinks ? sinks[hq] : -INFINITY, sum;
                    for (int64_t i = 0; i < n; ++i) m = sh[i] > m ? sh[i] : m;
                    sum = exp_shifted(sh, n, m);
                    if (sinks) sum += expf(sinks[hq] - m);
                    const float inv = 1.f / sum;
                    for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
                }
            }
        const float *cache = pass == 0 ? k_cache : v_cache;
        for (int64_t i = 0, p = lo; i < most;) {
            const int64_t off = p % block_size, span = block_size - off;
            if (i + span < most)  /* the next block's first keys: the prefetcher does not know it */
                __builtin_prefetch(cache + tables[table_start[far] + (p + span) / block_size]
                                               * block_size * slot_stride + h0 * head_dim);
            for (int64_t r = 0, at = 0; r < rows; at += heads * (ctx[d0 + r] - lo), ++r) {
                const int64_t d = d0 + r, n = ctx[d] - lo;
                if (i >= n) continue;
                const int64_t run = span < n - i ? span : n - i;
                const float *slot = cache + (tables[table_start[d] + p / block_size] * block_size + off)
                                                * slot_stride;
                for (int64_t h = h0; h < h0 + per_task; ++h) {
                    const int64_t j = (h - h0) * group;  /* h's first query head in this task */
                    if (pass == 0)
                        score_block(scores + at + j * n, n, i, run,
                                    query + token[d] * q_stride + h * group * head_dim,
                                    slot + h * head_dim, slot_stride, head_dim, group, scale);
                    else
                        weigh_block(acc + r * width + j * head_dim, scores + at + j * n, n, i, run,
                                    slot + h * head_dim, slot_stride, head_dim, group);
                }
            }
            i += span;
            p += span;
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *o = out + token[d0 + r] * o_stride + h0 * group * head_dim;
        for (int64_t e = 0; e < width; ++e) o[e] = acc[r * width + e];
    }
    free(scores);
    free(acc);
    return 0;
}

/* Returns 0, or -1 when a scratch buffer could not be allocated (that task's rows are left
 * unwritten; the caller raises). */
int paged_decode_attention(const float *query, int64_t q_stride, float *out, int64_t o_stride,
                           const float *k_cache, const float *v_cache, const int64_t *token,
                           const int64_t *tables, const int64_t *table_start,
                           const int64_t *first, const int64_t *ctx, int64_t num_decodes,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, const float *sinks,
                           int num_threads) {
    const decode_attn_t a = {query, q_stride, out, o_stride, k_cache, v_cache, token, tables,
                             table_start, first, ctx, num_decodes, num_heads, num_kv_heads,
                             head_dim, block_size, scale, sinks};
    int64_t *gstart = malloc(sizeof(int64_t) * (size_t)(num_decodes + 1));
    int64_t *tasks = malloc(sizeof(int64_t) * 3 * (size_t)(num_decodes * num_kv_heads));
    if (gstart == NULL || tasks == NULL) {
        free(gstart);
        free(tasks);
        return -1;
    }
    int64_t per_task;
    const int64_t num_tasks = decode_attention_plan(&a, num_threads, gstart, tasks, &per_task,
                                                    &num_threads);
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_tasks; ++task)
        if (decode_attention_task(&a, tasks, task, per_task)) {
#pragma omp atomic write
            failed = 1;
        }
    free(gstart);
    free(tasks);
    return failed ? -1 : 0;
}
