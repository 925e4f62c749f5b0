/* The exported functions of the quantized kernels in this folder (layout and semantics in
 * qgemm.c and qrows.c), one declaration each for the files that define and call them; the
 * ctypes bindings in kernels.py mirror these signatures. Shipped and hashed with the sources
 * (../cpu_kernels.py). */
#ifndef KVFLEET_QKERNELS_H
#define KVFLEET_QKERNELS_H
#include <stdint.h>

/* qgemm.c */
float kvf_half_to_float(uint16_t h);
void qgemm_int8(const float *x, int64_t ldx, int64_t rows, const int8_t *q, const void *scale,
                int half, int64_t in, int64_t out, int64_t group, const float *bias, float *y,
                int64_t ldy, int num_threads);
int qgemm_int4(const float *x, int64_t ldx, int64_t rows, const uint8_t *q, const void *scale,
               const void *offset, int half, int64_t in, int64_t out, int64_t group,
               const float *bias, float *y, int64_t ldy, int num_threads);
/* The same as work-shared loops of the caller's parallel region, without a closing barrier. */
void qgemm_int8_for(const float *x, int64_t ldx, int64_t rows, const int8_t *q, const void *scale,
                    int half, int64_t in, int64_t out, int64_t group, const float *bias, float *y,
                    int64_t ldy);
void qgemm_int4_for(const float *x, int64_t ldx, int64_t rows, const uint8_t *q, const void *scale,
                    const void *offset, int half, int64_t in, int64_t out, int64_t group,
                    const float *bias, float *y, int64_t ldy, float *xsum);

/* qrows.c */
int quant_rows(const int64_t *index, int64_t n, int bits, const void *codes, const void *scale,
               const void *offset, int half, int64_t in, int64_t out_features, int64_t group,
               float *out);

/* qlayer.c (the structs are mirrored by qlayer.py and ../decode_rows.py) */
/* A packed projection's kernel arguments (see qgemm.c); offset NULL for int8. */
typedef struct {
    int32_t bits, half;
    int64_t in, out, group;
    const void *codes, *scale, *offset;
    const float *bias;
} qproj_t;

/* A layer's fixed arguments, filled once when the layer is bound. */
typedef struct {
    qproj_t qkv, o, gate_up, down;
    const float *input_norm, *mlp_norm;
    float eps, attn_scale;
    int64_t hidden, heads, kv_heads, head_dim, block_size;
    const float *sinks;
} qlayer_t;

/* A step's decode rows, filled once a step and shared by every layer: row d is decode d. */
typedef struct {
    int64_t rows;
    const int64_t *slots, *token, *tables, *table_start, *ctx;
    int32_t num_threads;
} qstep_t;

int quant_decode_layer(const qlayer_t *L, const qstep_t *S, float *hidden, const float *delta,
                       float *out, const float *cos, const float *sin, int64_t rot,
                       const int64_t *first, float *k_cache, float *v_cache);

/* One layer of a run of layers called at once: its bound arguments, its caches, and which of
 * the step's rope rows and first-key arrays it reads. */
typedef struct {
    const qlayer_t *layer;
    float *k_cache, *v_cache;
    int64_t rope, first;
} qstack_t;

int quant_decode_layers(const qstack_t *layers, int64_t n, const qstep_t *S, float *hidden,
                        float *out, const float *const *cos, const float *const *sin, int64_t rot,
                        const int64_t *const *first);

#endif
