/* Dequantized rows of a packed int8 / int4 weight: an embedding lookup on a quantized table.
 *
 * Built with the other kernels by kvfleet/worker/runner/cpu_kernels.py and called by
 * PackedWeight.rows (kvfleet/worker/runner/quant/packed.py) on CPU. Layout as in qgemm.c. Each
 * weight is scale · q, then + offset for int4, as two separate fp32 operations (this file
 * leaves multiply-adds unfused), which is what the torch formulation computes: the rows are
 * equal bit for bit. A decode step looks up a row or a few, where the dozen torch ops of that
 * formulation cost far more than the row.
 */
#include <stdint.h>

#include "qkernels.h"

#define LANES 16

static float lane(const void *p, int half, int64_t i) {
    return half ? kvf_half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* out[t] (in floats) = output row index[t] of the weight (out_features rows, bits 8 or 4).
 * Returns 0, or -1 (nothing written) when an index is outside 0 .. out_features - 1. */
int quant_rows(const int64_t *index, int64_t n, int bits, const void *codes, const void *scale,
               const void *offset, int half, int64_t in, int64_t out_features, int64_t group,
               float *out) {
    for (int64_t t = 0; t < n; ++t)
        if (index[t] < 0 || index[t] >= out_features) return -1;
    const int64_t ngroups = in / group;
    for (int64_t t = 0; t < n; ++t) {
        const int64_t b = index[t] / LANES, l = index[t] % LANES;
        const int64_t sbase = b * ngroups * LANES + l;
        float *row = out + t * in;
        for (int64_t k = 0; k < in; ++k) {
            const int64_t s = sbase + (k / group) * LANES;
            float q;
            if (bits == 8) {
                q = (float)((const int8_t *)codes)[(b * in + k) * LANES + l];
            } else {
                const uint8_t byte = ((const uint8_t *)codes)[(b * (in / 2) + k / 2) * LANES + l];
                q = (float)(k % 2 ? byte >> 4 : byte & 15);
            }
            float w = lane(scale, half, s) * q;
            if (bits == 4) w = w + lane(offset, half, s);
            row[k] = w;
        }
    }
    return 0;
}
