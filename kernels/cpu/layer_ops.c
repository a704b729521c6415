/* The decoder layer's float32 glue for the CPU, one C call each (cpu_fused.py loads it): the
 * same arithmetic as cpu_fused.py's numba kernels, without numba's dispatch (a call there cost
 * ~10 us at a decode step's sizes, the work well under 1 us: measured on the 2-vCPU Xeon,
 * the 7M model's RMSNorm of one row, 10.1 us through numba).
 *
 * Layouts: x, out [rows, hidden] contiguous; qk [tokens, heads, head_dim] with any token and
 * head strides (in floats), head_dim contiguous; cos, sin [tokens, head_dim / 2] rows
 * `table_stride` floats apart; q [tokens, num_heads, head_dim] and k [tokens, heads -
 * num_heads, head_dim] contiguous. Single-threaded: these run on a few hundred KB. */
#include <math.h>

int tidal_layer_ops_available(void) { return 1; }

/* out = weight * x / sqrt(mean(x^2) + eps) per row; the sum of squares in float32 (vector
 * lanes in any order: results differ from torch's by float32 rounding). */
void tidal_rms_norm(const float *x, long rows, int hidden, const float *weight, float eps,
                    float *out) {
    for (long i = 0; i < rows; i++) {
        const float *row = x + i * hidden;
        float total = 0.0f;
        #pragma omp simd reduction(+:total)
        for (int j = 0; j < hidden; j++) total += row[j] * row[j];
        float scale = 1.0f / sqrtf(total / (float)hidden + eps);
        float *dst = out + i * hidden;
        for (int j = 0; j < hidden; j++) dst[j] = weight[j] * (row[j] * scale);
    }
}

/* The neox rotation of q and k heads side by side, into contiguous q and k. Compiled without
 * contracting a product into an FMA, so each half is two rounded products and one rounded
 * sum or difference, as transformers' `x * cos + rotate_half(x) * sin`: bit-identical. */
__attribute__((optimize("fp-contract=off")))
void tidal_rotate_split(const float *qk, long tokens, int heads, int head_dim,
                        long token_stride, long head_stride, const float *cos,
                        const float *sin, long table_stride, int num_heads, float *q,
                        float *k) {
    int half = head_dim / 2;
    for (long t = 0; t < tokens; t++) {
        const float *c = cos + t * table_stride, *s = sin + t * table_stride;
        for (int h = 0; h < heads; h++) {
            const float *src = qk + t * token_stride + h * head_stride;
            float *dst = h < num_heads ? q + (t * num_heads + h) * head_dim
                                       : k + (t * (heads - num_heads) + h - num_heads) * head_dim;
            for (int j = 0; j < half; j++) {
                float x1 = src[j], x2 = src[j + half];
                float a = x1 * c[j], b = x2 * s[j];
                dst[j] = a - b;
                float e = x2 * c[j], f = x1 * s[j];
                dst[j + half] = e + f;
            }
        }
    }
}
