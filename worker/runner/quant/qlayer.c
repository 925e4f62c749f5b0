/* One decoder layer of a decode-only step with int8 / int4 projections, in one call (fp32, CPU).
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

/* hidden (rows, L->hidden) += delta (delta NULL: nothing added), then the layer; the
 * attention output is added to hidden in place too, and the MLP's output written to out
 * (rows, L->hidden): the residual stream after the layer is hidden + out. cos / sin: rows of
 * `rot`; first: each decode's first visible key under this layer's window. Returns 0, or -1
 * when a scratch buffer could not be allocated (hidden and the cache may then be half
 * updated; the caller raises). */
int quant_decode_layer(const qlayer_t *L, const qstep_t *S, float *hidden, const float *delta,
                       float *out, const float *cos, const float *sin, int64_t rot,
                       const int64_t *first, float *k_cache, float *v_cache) {
    const int64_t rows = S->rows, h = L->hidden, q = L->heads * L->head_dim;
    const int64_t nqkv = L->qkv.out, width = L->gate_up.out / 2;
    const int th = S->num_threads;
    float *x = malloc(sizeof(float) * (size_t)(rows * h));
    float *qkv = malloc(sizeof(float) * (size_t)(rows * nqkv));
    float *attn = malloc(sizeof(float) * (size_t)(rows * q));
    float *gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * width));
    float *act = malloc(sizeof(float) * (size_t)(rows * width));
    int status = -1;
    if (x == NULL || qkv == NULL || attn == NULL || gate_up == NULL || act == NULL) goto done;
    add_rms_norm(hidden, h, delta, h, hidden, h, L->input_norm, x, h, rows, h, L->eps, th);
    if (product(&L->qkv, x, rows, qkv, th)) goto done;
    rope_write_kv(qkv, nqkv, rows, cos, sin, L->heads, L->kv_heads, L->head_dim, rot, k_cache,
                  v_cache, S->slots, th);
    if (paged_decode_attention(qkv, nqkv, attn, q, k_cache, v_cache, S->token, S->tables,
                               S->table_start, first, S->ctx, rows, L->heads, L->kv_heads,
                               L->head_dim, L->block_size, L->attn_scale, L->sinks,
                               th < rows * L->kv_heads ? th : (int)(rows * L->kv_heads)))
        goto done;
    if (product(&L->o, attn, rows, out, th)) goto done;  /* out holds the attention output */
    add_rms_norm(hidden, h, out, h, hidden, h, L->mlp_norm, x, h, rows, h, L->eps, th);
    if (product(&L->gate_up, x, rows, gate_up, th)) goto done;
    silu_mul(gate_up, 2 * width, rows, width, act, width, th);
    status = product(&L->down, act, rows, out, th);
done:
    free(x);
    free(qkv);
    free(attn);
    free(gate_up);
    free(act);
    return status;
}
