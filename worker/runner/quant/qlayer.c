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
 */
#include <stdint.h>
#include <stdlib.h>

#include "../kernels.h"
#include "qkernels.h"

static int product(const qproj_t *p, const float *x, int64_t rows, float *y, int threads) {
    if (p->bits == 8) {
        qgemm_int8(x, p->in, rows, p->codes, p->scale, p->half, p->in, p->out, p->group, p->bias,
                   y, p->out, threads);
        return 0;
    }
    return qgemm_int4(x, p->in, rows, p->codes, p->scale, p->offset, p->half, p->in, p->out,
                      p->group, p->bias, y, p->out, threads);
}

/* A layer's scratch: x (rows, hidden), qkv, attn (rows, heads * head_dim), gate_up, act. */
typedef struct {
    float *x, *qkv, *attn, *gate_up, *act;
} scratch_t;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Scratch for `rows` rows of every layer in layers[0..n) (each buffer the widest layer's). */
static int scratch_alloc(scratch_t *s, const qlayer_t *const *layers, int64_t n, int64_t rows) {
    int64_t h = 0, nqkv = 0, q = 0, gu = 0;
    for (int64_t i = 0; i < n; i++) {
        const qlayer_t *L = layers[i];
        h = max64(h, L->hidden);
        nqkv = max64(nqkv, L->qkv.out);
        q = max64(q, L->heads * L->head_dim);
        gu = max64(gu, L->gate_up.out);
    }
    s->x = malloc(sizeof(float) * (size_t)(rows * h));
    s->qkv = malloc(sizeof(float) * (size_t)(rows * nqkv));
    s->attn = malloc(sizeof(float) * (size_t)(rows * q));
    s->gate_up = malloc(sizeof(float) * (size_t)(rows * gu));
    s->act = malloc(sizeof(float) * (size_t)(rows * (gu / 2)));
    return s->x == NULL || s->qkv == NULL || s->attn == NULL || s->gate_up == NULL
           || s->act == NULL ? -1 : 0;
}

static void scratch_free(scratch_t *s) {
    free(s->x);
    free(s->qkv);
    free(s->attn);
    free(s->gate_up);
    free(s->act);
}

/* The layer body of quant_decode_layer over preallocated scratch; delta may alias out (it is
 * consumed by the first norm, before out is written). */
static int layer_body(const qlayer_t *L, const qstep_t *S, float *hidden, const float *delta,
                      float *out, const float *cos, const float *sin, int64_t rot,
                      const int64_t *first, float *k_cache, float *v_cache, const scratch_t *s) {
    const int64_t rows = S->rows, h = L->hidden, q = L->heads * L->head_dim;
    const int64_t nqkv = L->qkv.out, width = L->gate_up.out / 2;
    const int th = S->num_threads;
    add_rms_norm(hidden, h, delta, h, hidden, h, L->input_norm, s->x, h, rows, h, L->eps, th);
    if (product(&L->qkv, s->x, rows, s->qkv, th)) return -1;
    rope_write_kv(s->qkv, nqkv, rows, cos, sin, L->heads, L->kv_heads, L->head_dim, rot, k_cache,
                  v_cache, S->slots, th);
    if (paged_decode_attention(s->qkv, nqkv, s->attn, q, k_cache, v_cache, S->token, S->tables,
                               S->table_start, first, S->ctx, rows, L->heads, L->kv_heads,
                               L->head_dim, L->block_size, L->attn_scale, L->sinks,
                               th < rows * L->kv_heads ? th : (int)(rows * L->kv_heads)))
        return -1;
    if (product(&L->o, s->attn, rows, out, th)) return -1;  /* out holds the attention output */
    add_rms_norm(hidden, h, out, h, hidden, h, L->mlp_norm, s->x, h, rows, h, L->eps, th);
    if (product(&L->gate_up, s->x, rows, s->gate_up, th)) return -1;
    silu_mul(s->gate_up, 2 * width, rows, width, s->act, width, th);
    return product(&L->down, s->act, rows, out, th);
}

/* hidden (rows, L->hidden) += delta (delta NULL: nothing added), then the layer; the
 * attention output is added to hidden in place too, and the MLP's output written to out
 * (rows, L->hidden): the residual stream after the layer is hidden + out. cos / sin: rows of
 * `rot`; first: each decode's first visible key under this layer's window. Returns 0, or -1
 * when a scratch buffer could not be allocated (hidden and the cache may then be half
 * updated; the caller raises). */
int quant_decode_layer(const qlayer_t *L, const qstep_t *S, float *hidden, const float *delta,
                       float *out, const float *cos, const float *sin, int64_t rot,
                       const int64_t *first, float *k_cache, float *v_cache) {
    scratch_t s;
    int status = scratch_alloc(&s, &L, 1, S->rows);
    if (status == 0)
        status = layer_body(L, S, hidden, delta, out, cos, sin, rot, first, k_cache, v_cache, &s);
    scratch_free(&s);
    return status;
}

/* quant_decode_layer for layers[0..n) in turn, as the model's layer loop calls it: the first
 * without a delta, each next one with the previous one's out; the stream after the last is
 * hidden + out. The step's rope rows are cos[layers[i].rope] / sin[...], its first keys
 * first[layers[i].first]. One scratch for all layers. Returns 0 or -1 (as quant_decode_layer;
 * the layers before the failing one have run). */
int quant_decode_layers(const qstack_t *layers, int64_t n, const qstep_t *S, float *hidden,
                        float *out, const float *const *cos, const float *const *sin, int64_t rot,
                        const int64_t *const *first) {
    const qlayer_t **each = malloc(sizeof(*each) * (size_t)(n > 0 ? n : 1));
    scratch_t s = {0};
    int status = -1;
    if (each == NULL) return -1;
    for (int64_t i = 0; i < n; i++) each[i] = layers[i].layer;
    if (scratch_alloc(&s, each, n, S->rows) == 0) {
        status = 0;
        for (int64_t i = 0; i < n && status == 0; i++) {
            const qstack_t *l = &layers[i];
            status = layer_body(l->layer, S, hidden, i ? out : NULL, out, cos[l->rope], sin[l->rope],
                                rot, first[l->first], l->k_cache, l->v_cache, &s);
        }
    }
    scratch_free(&s);
    free(each);
    return status;
}
