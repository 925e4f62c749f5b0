/* The exported functions of kvfleet's C kernels in this folder, one declaration each for the
 * files that define them and the ones that call them (quant/qlayer.c); the ctypes bindings
 * in cpu_kernels.py and layer_ops.py mirror these signatures. Shipped and hashed with the
 * sources (cpu_kernels.py). */
#ifndef KVFLEET_KERNELS_H
#define KVFLEET_KERNELS_H
#include <stdint.h>

/* paged_decode.c */
int paged_decode_attention(const float *query, int64_t q_stride, float *out, int64_t o_stride,
                           const float *k_cache, const float *v_cache, const int64_t *token,
                           const int64_t *tables, const int64_t *table_start,
                           const int64_t *first, const int64_t *ctx, int64_t num_decodes,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, const float *sinks,
                           int num_threads);
/* Its arguments as one struct, for callers that run its tasks in a parallel region of their own. */
typedef struct {
    const float *query;
    int64_t q_stride;
    float *out;
    int64_t o_stride;
    const float *k_cache, *v_cache;
    const int64_t *token, *tables, *table_start, *first, *ctx;
    int64_t num_decodes, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    const float *sinks;
} decode_attn_t;
int64_t decode_attention_plan(const decode_attn_t *a, int num_threads, int64_t *gstart,
                              int64_t *tasks, int64_t *per_task, int *threads);
int decode_attention_task(const decode_attn_t *a, const int64_t *tasks, int64_t task,
                          int64_t per_task);

/* gemv.c */
int few_rows_panel_width(void);
void gemm_few_rows(const float *x, int64_t m, const float *panels, const float *bias, float *y,
                   int64_t in, int64_t out, int num_threads);

/* layer_ops.c */
void add_rms_norm(const float *a, int64_t lda, const float *b, int64_t ldb, float *sum,
                  int64_t lds, const float *weight, float *normed, int64_t ldn, int64_t rows,
                  int64_t size, float eps, int num_threads);
void rope_write_kv(float *qkv, int64_t ldq, int64_t rows, const float *cos, const float *sin,
                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rot,
                   float *k_cache, float *v_cache, const int64_t *slots, int num_threads);
void silu_mul(const float *gate_up, int64_t ldg, int64_t rows, int64_t width, float *out,
              int64_t ldo, int num_threads);
/* The same per row, rows r0 .. r1 - 1 on the calling thread (quant/qlayer.c's parallel region);
 * a, b, sum, normed rows of `size`, contiguous. */
void add_rms_norm_rows(const float *a, const float *b, float *sum, const float *weight,
                       float *normed, int64_t r0, int64_t r1, int64_t size, float eps);
void rope_write_kv_rows(float *qkv, int64_t ldq, int64_t r0, int64_t r1, const float *cos,
                        const float *sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        int64_t rot, float *k_cache, float *v_cache, const int64_t *slots);
void silu_mul_rows(const float *gate_up, int64_t r0, int64_t r1, int64_t width, float *out);

#endif
