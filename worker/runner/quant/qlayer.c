/* One decoder layer of a decode-only step with int8 / int4 projections, in one call (fp32, CPU);
 * and a run of such layers in one call (quant_decode_layers, driven by quant/qstack.py).
 *
 * Built with the other kernels by kvfleet/worker/runner/cpu_kernels.py and called through
 * kvfleet/worker/runner/quant/qlayer.py. It runs the same kernels, in the same order, as the
 * Python layer does with fused ops (models/llama.py): norm with the residual add, the qkv
 * product, RoPE with the K/V write, paged decode attention, the o product, norm with the
 * residual add, the gate_up product, SiLU · up, the down product. Its results are therefore
 * the Python path's bit for bit; what it saves is a dozen Python-level calls, allocations
 * and argument checks per layer, a large share of a batch-1 step on a small model.
 *
 * All of a call's layers run in one OpenMP parallel region: each product and the attention
 * are work-shared loops of the same team, with a barrier only where the next op reads what
 * other threads wrote. Every barrier can wait on a preempted thread (two cores shared with
 * other work), and each region start and end is such a wait too: one region for the call
 * instead of ~5 a layer. Up to FEW_ROWS rows, every thread makes its own copy of the norms'
 * and SiLU's outputs (the same arithmetic, so the same bits) rather than waiting for one
 * thread's; the residual sums alternate between hidden and a scratch copy so that the thread
 * writing them never overwrites a row another thread still reads. The products' work split
 * is static; attention tasks are taken dynamically, as in paged_decode.c, which does not
 * change their results (each task's arithmetic is its own).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "../kernels.h"
#include "qkernels.h"

/* As layer_ops.c's ROWS_PER_THREAD: up to this many rows the small ops are not worth a split
 * (here: every thread repeats them instead of waiting at a barrier for their split). */
#define FEW_ROWS 64

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The shared scratch of a call: resid (rows, hidden), the other copy of the residual stream;
 * x, act: the split small ops' outputs (more than FEW_ROWS rows); qkv, attn, gate_up. And each
 * thread's own: x and sum (rows, hidden), act, xsum (int4 group sums), the attention plan. */
typedef struct {
    float *resid, *x, *qkv, *attn, *gate_up, *act;
    float *own_x, *own_sum, *own_act, *own_xsum;
    int64_t *own_gstart, *own_tasks;
    int64_t h, gu, ngroups, ntasks;  /* per-thread strides */
} scratch_t;

static int64_t groups_of(const qproj_t *p) { return p->bits == 4 ? p->in / p->group : 0; }

static int scratch_alloc(scratch_t *s, const qstack_t *layers, int64_t n, int64_t rows, int threads) {
    int64_t h = 0, nqkv = 0, q = 0, gu = 0, ng = 0, kvh = 0;
    for (int64_t i = 0; i < n; i++) {
        const qlayer_t *L = layers[i].layer;
        h = max64(h, L->hidden);
        nqkv = max64(nqkv, L->qkv.out);
        q = max64(q, L->heads * L->head_dim);
        gu = max64(gu, L->gate_up.out);
        ng = max64(max64(ng, groups_of(&L->qkv)), max64(groups_of(&L->o), groups_of(&L->gate_up)));
        ng = max64(ng, groups_of(&L->down));
        kvh = max64(kvh, L->kv_heads);
    }
    const size_t f = sizeof(float), t = (size_t)threads;
    s->h = rows * h, s->gu = rows * (gu / 2), s->ngroups = rows * (ng > 0 ? ng : 1);
    s->ntasks = 3 * rows * kvh + rows + 1;
    s->resid = malloc(f * (size_t)(rows * h));
    s->x = malloc(f * (size_t)(rows * h));
    s->qkv = malloc(f * (size_t)(rows * nqkv));
    s->attn = malloc(f * (size_t)(rows * q));
    s->gate_up = malloc(f * (size_t)(rows * gu));
    s->act = malloc(f * (size_t)s->gu);
    s->own_x = malloc(f * t * (size_t)s->h);
    s->own_sum = malloc(f * t * (size_t)s->h);
    s->own_act = malloc(f * t * (size_t)s->gu);
    s->own_xsum = malloc(f * t * (size_t)s->ngroups);
    s->own_tasks = malloc(sizeof(int64_t) * t * (size_t)s->ntasks);
    return s->resid == NULL || s->x == NULL || s->qkv == NULL || s->attn == NULL
           || s->gate_up == NULL || s->act == NULL || s->own_x == NULL || s->own_sum == NULL
           || s->own_act == NULL || s->own_xsum == NULL || s->own_tasks == NULL ? -1 : 0;
}

static void scratch_free(scratch_t *s) {
    free(s->resid);
    free(s->x);
    free(s->qkv);
    free(s->attn);
    free(s->gate_up);
    free(s->act);
    free(s->own_x);
    free(s->own_sum);
    free(s->own_act);
    free(s->own_xsum);
    free(s->own_tasks);
}

/* The product as a work-shared loop of the region (no barrier; xsum: this thread's). */
static void product(const qproj_t *p, const float *x, int64_t rows, float *y, float *xsum) {
    if (p->bits == 8)
        qgemm_int8_for(x, p->in, rows, p->codes, p->scale, p->half, p->in, p->out, p->group,
                       p->bias, y, p->out);
    else
        qgemm_int4_for(x, p->in, rows, p->codes, p->scale, p->offset, p->half, p->in, p->out,
                       p->group, p->bias, y, p->out, xsum);
}

/* sum = a + b, normed rows: up to FEW_ROWS rows every thread its own (thread 0 writing sum,
 * the others their own copy of it), no barrier; else split by rows, then a barrier. Returns
 * the normed rows this thread reads. */
static const float *norm(const float *a, const float *b, float *sum, const float *w, int64_t rows,
                         int64_t h, float eps, const scratch_t *s, int tid) {
    if (rows <= FEW_ROWS) {
        float *x = s->own_x + tid * s->h;
        add_rms_norm_rows(a, b, tid == 0 ? sum : s->own_sum + tid * s->h, w, x, 0, rows, h, eps);
        return x;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) add_rms_norm_rows(a, b, sum, w, s->x, r, r + 1, h, eps);
    return s->x;
}

/* One layer on thread tid of the region: hidden (+ delta) → resid; attention output added →
 * hidden; the MLP's output → out. Sets *failed when an attention task's scratch could not be
 * allocated. */
static void layer_in_region(const qlayer_t *L, const qstep_t *S, float *hidden, const float *delta,
                            float *out, const float *cos, const float *sin, int64_t rot,
                            const int64_t *first, float *k_cache, float *v_cache,
                            const scratch_t *s, int tid, int threads, int *failed) {
    const int64_t rows = S->rows, h = L->hidden, q = L->heads * L->head_dim;
    const int64_t nqkv = L->qkv.out, width = L->gate_up.out / 2;
    float *xsum = s->own_xsum + tid * s->ngroups;
    const float *x = norm(hidden, delta, s->resid, L->input_norm, rows, h, L->eps, s, tid);
    product(&L->qkv, x, rows, s->qkv, xsum);
#pragma omp barrier
    const decode_attn_t a = {s->qkv, nqkv, s->attn, q, k_cache, v_cache, S->token, S->tables,
                             S->table_start, first, S->ctx, rows, L->heads, L->kv_heads,
                             L->head_dim, L->block_size, L->attn_scale, L->sinks};
    int64_t *tasks = s->own_tasks + tid * s->ntasks, *gstart = tasks + 3 * rows * L->kv_heads;
    int64_t per_task;
    int want;
    const int64_t clip = rows * L->kv_heads;
    const int64_t ntasks = decode_attention_plan(&a, threads < clip ? threads : (int)clip, gstart,
                                                 tasks, &per_task, &want);
    if (rows > FEW_ROWS) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; ++t)
            rope_write_kv_rows(s->qkv, nqkv, t, t + 1, cos, sin, L->heads, L->kv_heads,
                               L->head_dim, rot, k_cache, v_cache, S->slots);
    } else if (tid == 0) {
        rope_write_kv_rows(s->qkv, nqkv, 0, rows, cos, sin, L->heads, L->kv_heads, L->head_dim,
                           rot, k_cache, v_cache, S->slots);
    }
    if (want == 1) {  /* thread 0 alone, after its own RoPE and K/V write: no wait for them */
        if (tid == 0)
            for (int64_t t = 0; t < ntasks; ++t)
                if (decode_attention_task(&a, tasks, t, per_task)) {
#pragma omp atomic write
                    *failed = 1;
                }
    } else {
        if (rows <= FEW_ROWS) {
#pragma omp barrier
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < ntasks; ++t)
            if (decode_attention_task(&a, tasks, t, per_task)) {
#pragma omp atomic write
                *failed = 1;
            }
    }
#pragma omp barrier
    product(&L->o, s->attn, rows, out, xsum);  /* out holds the attention output */
#pragma omp barrier
    x = norm(s->resid, out, hidden, L->mlp_norm, rows, h, L->eps, s, tid);
    product(&L->gate_up, x, rows, s->gate_up, xsum);
#pragma omp barrier
    const float *act = s->act;
    if (rows <= FEW_ROWS) {
        float *own = s->own_act + tid * s->gu;
        silu_mul_rows(s->gate_up, 0, rows, width, own);
        act = own;
    } else {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; ++t) silu_mul_rows(s->gate_up, t, t + 1, width, s->act);
    }
    product(&L->down, act, rows, out, xsum);
#pragma omp barrier
}

/* layers[0..n) in one parallel region; the first layer adds delta (NULL: nothing). */
static int run_layers(const qstack_t *layers, int64_t n, const qstep_t *S, float *hidden,
                      const float *delta, float *out, const float *const *cos,
                      const float *const *sin, int64_t rot, const int64_t *const *first) {
    const int threads = S->num_threads > 0 ? S->num_threads : 1;
    scratch_t s = {0};
    int failed = 0;
    if (scratch_alloc(&s, layers, n, S->rows, threads) == 0) {
#pragma omp parallel num_threads(threads)
        {
            const int tid = omp_get_thread_num(), team = omp_get_num_threads();
            for (int64_t i = 0; i < n; i++) {
                int stop;
                /* read by every thread between the last write (an attention phase) and the next */
#pragma omp atomic read
                stop = failed;
                if (stop) break;
                const qstack_t *l = &layers[i];
                layer_in_region(l->layer, S, hidden, i ? out : delta, out, cos[l->rope],
                                sin[l->rope], rot, first[l->first], l->k_cache, l->v_cache, &s,
                                tid, team, &failed);
            }
        }
    } else {
        failed = 1;
    }
    scratch_free(&s);
    return failed ? -1 : 0;
}

/* hidden (rows, L->hidden) += delta (delta NULL: nothing added; delta may alias out), then the
 * layer; the attention output is added to hidden in place too, and the MLP's output written to
 * out (rows, L->hidden): the residual stream after the layer is hidden + out. cos / sin: rows
 * of `rot`; first: each decode's first visible key under this layer's window. Returns 0, or -1
 * when a scratch buffer could not be allocated (hidden and the cache may then be half updated;
 * the caller raises). */
int quant_decode_layer(const qlayer_t *L, const qstep_t *S, float *hidden, const float *delta,
                       float *out, const float *cos, const float *sin, int64_t rot,
                       const int64_t *first, float *k_cache, float *v_cache) {
    const qstack_t one = {L, k_cache, v_cache, 0, 0};
    return run_layers(&one, 1, S, hidden, delta, out, &cos, &sin, rot, &first);
}

/* quant_decode_layer for layers[0..n) in turn, as the model's layer loop calls it: the first
 * without a delta, each next one with the previous one's out; the stream after the last is
 * hidden + out. The step's rope rows are cos[layers[i].rope] / sin[...], its first keys
 * first[layers[i].first]. Returns 0 or -1 (as quant_decode_layer; the layers before the
 * failing one have run). */
int quant_decode_layers(const qstack_t *layers, int64_t n, const qstep_t *S, float *hidden,
                        float *out, const float *const *cos, const float *const *sin, int64_t rot,
                        const int64_t *const *first) {
    return run_layers(layers, n, S, hidden, NULL, out, cos, sin, rot, first);
}
