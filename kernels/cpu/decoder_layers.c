/* A Llama decoder's layers for one step on the CPU, in one C call (fused_layers.py loads it):
 * the same kernels the layers call one by one from Python (the panel GEMM of small_m_gemm.c,
 * RMSNorm and the rotation of layer_ops.c, the K/V write and the row and chunk attention of
 * decode_attention.c), called through function pointers the caller passes in, so each kernel
 * stays built and tested where it is and this file holds only the order of a layer.
 *
 * Why: a 7M-parameter model's decode step of 4 requests spent ~1 ms of its 1.75 in Python
 * between ~40 kernel calls (module dispatch, output allocation, ctypes argument conversion:
 * measured with cProfile and a per-part timer on the 2-vCPU Xeon), its kernels ~0.6 ms.
 *
 * One layer, T tokens (all buffers float32, rows contiguous):
 *
 *   xn   = rms_norm(h, input_norm)                          [T, hidden]
 *   qkv  = xn W_qkv^T                                       [T, (heads + 2 kv_heads) head_dim]
 *   q, k = rotate(qkv's q and k heads)                      [T, heads, d], [T, kv_heads, d]
 *   cache[slot[t]] = k[t], qkv's v heads of t
 *   attn = attention(q, cache)                              [T, heads * d]
 *   h2   = attn W_o^T + h                                   (the add fused into the GEMM)
 *   xn   = rms_norm(h2, post_norm)
 *   gate = silu(xn W_gate^T)                                [T, intermediate]
 *   m    = (xn W_up^T) * gate                               (the product fused into the GEMM)
 *   h    = m W_down^T + h2
 *
 * as LlamaDecoderLayer computes it with the CPU kernels, except silu's exp: here exp16 below
 * (the C library's expf past the last 16 lanes, and in builds without AVX-512), there torch's
 * vectorized exp; the two differ by float32 rounding.
 */
#include <math.h>

typedef void (*gemm_fn)(const float *x, long rows, long k, const void *w, int wtype, long n,
                        float *y, const float *other, int op);
typedef void (*norm_fn)(const float *x, long rows, int hidden, const float *weight, float eps,
                        float *out);
typedef void (*rotate_fn)(const float *qk, long tokens, int heads, int head_dim,
                          long token_stride, long head_stride, const float *cos,
                          const float *sin, long table_stride, int num_heads, float *q,
                          float *k);
typedef long (*write_kv_fn)(const float *key, const float *value, long key_token,
                            long key_head, long value_token, long value_head,
                            float *key_cache, float *value_cache, const long *slots, long n,
                            int num_kv_heads, int head_dim, int block_size, long num_slots,
                            long block_stride, long pos_stride, long head_stride);
typedef int (*rows_fn)(const float *q, const float *key_cache, const float *value_cache,
                       const int *tables, long max_blocks, const int *lens,
                       const long *requests, const long *rows, long n, int num_heads,
                       int num_kv_heads, int head_dim, int block_size, long block_stride,
                       long pos_stride, long head_stride, float scale, float *out);
typedef int (*chunk_fn)(const float *q, const float *key_cache, const float *value_cache,
                        const int *table, int q_len, int seq_len, long q_row0, int num_heads,
                        int num_kv_heads, int head_dim, int block_size, long block_stride,
                        long pos_stride, long head_stride, float scale, float *out);

/* The kernels, as the libraries that hold them export them. */
typedef struct {
    gemm_fn gemm;
    norm_fn norm;
    rotate_fn rotate;
    write_kv_fn write_kv;
    rows_fn rows;
    chunk_fn chunk;
} tidal_kernels;

/* The model's shape and its caches' layout (strides in floats, as decode_attention.c's). */
typedef struct {
    int hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    long num_slots, block_stride, pos_stride, head_stride;
} tidal_shape;

/* One layer: its norms' weights, its weights as panels (with their small_m_gemm.c type
 * numbers), its caches. */
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv, *o, *gate, *up, *down;
    float *key_cache, *value_cache;
    int qkv_type, o_type, gate_type, up_type, down_type;
} tidal_layer;

/* One step: T tokens' rotary factors and cache slots, the attention's rows (n_rows of them;
 * tables [requests][max_blocks]) and its chunks, each (request, q_len, seq_len, first row). */
typedef struct {
    long tokens;
    const float *cos, *sin;
    long table_stride;
    const long *slots;
    const int *tables;
    long max_blocks;
    const int *lens;
    const long *requests, *rows;
    long n_rows;
    const long *chunks;
    long n_chunks;
} tidal_step;

/* Scratch buffers, each at least T rows of its width. */
typedef struct {
    float *xn, *qkv, *q, *k, *attn, *h2, *gate, *m;
} tidal_scratch;

int tidal_decoder_layers_available(void) { return 1; }

#ifdef __AVX512F__
#include <immintrin.h>

/* exp of 16 lanes: 2^n p(r), n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, Cody
 * and Waite's, so r keeps the bits one rounded product would lose), p Cephes' degree-7
 * polynomial. Within 2 ulp of the exact value over [-88, 88] (1.24 measured; checked in
 * tests/workers/test_fused_layers.py), torch's own vectorized exp within 1 (0.56). Inputs are
 * clamped to +-88.376 (expf's finite range). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.376f)), _mm512_set1_ps(88.376f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* silu(g) = g / (1 + exp(-g)), as torch computes it (its exp: another polynomial of the same
 * accuracy). */
void tidal_silu(float *g, long n) {
    long i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(g + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i]));
}

/* 16 lanes of exp (the C library's expf past the last whole 16), for the accuracy test. */
void tidal_exp(const float *x, long n, float *out) {
    long i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, exp16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = expf(x[i]);
}

/* Per-part times of the layers (measurement only): built with -DTIDAL_LAYER_TIMES
 * (fused_layers.timed_build(); benchmarks/verify_step.py --parts), each part's wall seconds
 * over every call add up in part_seconds; in the served build MARK is nothing and
 * tidal_layer_times returns 0. The parts, in a layer's order: */
enum { P_NORM, P_QKV, P_ROTATE, P_WRITE_KV, P_ROWS, P_CHUNKS, P_O, P_NORM2, P_GATE, P_SILU,
       P_UP, P_DOWN, P_PARTS };
#ifdef TIDAL_LAYER_TIMES
#include <time.h>
static double part_seconds[P_PARTS];
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define MARK_START double mark_last_ = now_s()
#define MARK(part)                                                                        \
    do {                                                                                  \
        double mark_now_ = now_s();                                                       \
        part_seconds[part] += mark_now_ - mark_last_;                                     \
        mark_last_ = mark_now_;                                                           \
    } while (0)
#else
#define MARK_START ((void)0)
#define MARK(part) ((void)0)
#endif

/* Copies the parts' seconds so far into out[P_PARTS] and, when reset, zeroes them; returns
 * P_PARTS, or 0 in a build without the timer (out untouched). */
int tidal_layer_times(double *out, int reset) {
#ifdef TIDAL_LAYER_TIMES
    for (int p = 0; p < P_PARTS; p++) {
        out[p] = part_seconds[p];
        if (reset) part_seconds[p] = 0.0;
    }
    return P_PARTS;
#else
    (void)out; (void)reset;
    return 0;
#endif
}

/* Run layers [0, num_layers) over h [T, hidden] in place. Returns 0; -1 - t when token t's
 * slot is past the cache (nothing of that layer written); 1 when an attention kernel fails
 * (out of memory). */
long tidal_decoder_layers(const tidal_kernels *kn, const tidal_shape *s,
                          const tidal_layer *layers, int num_layers, const tidal_step *st,
                          const tidal_scratch *b, float *h) {
    const long T = st->tokens;
    const int H = s->hidden, nh = s->num_heads, nkv = s->num_kv_heads, d = s->head_dim;
    const long qkv_width = (long)(nh + 2 * nkv) * d;
    enum { PLAIN = 0, ADD = 1, MUL = 2 };
    MARK_START;
    for (int i = 0; i < num_layers; i++) {
        const tidal_layer *L = &layers[i];
        kn->norm(h, T, H, L->input_norm, s->eps, b->xn);
        MARK(P_NORM);
        kn->gemm(b->xn, T, H, L->qkv, L->qkv_type, qkv_width, b->qkv, 0, PLAIN);
        MARK(P_QKV);
        kn->rotate(b->qkv, T, nh + nkv, d, qkv_width, d, st->cos, st->sin, st->table_stride,
                   nh, b->q, b->k);
        MARK(P_ROTATE);
        long bad = kn->write_kv(b->k, b->qkv + (long)(nh + nkv) * d, (long)nkv * d, d,
                                qkv_width, d, L->key_cache, L->value_cache, st->slots, T,
                                nkv, d, s->block_size, s->num_slots, s->block_stride,
                                s->pos_stride, s->head_stride);
        if (bad >= 0) return -1 - bad;
        MARK(P_WRITE_KV);
        if (st->n_rows > 0
            && kn->rows(b->q, L->key_cache, L->value_cache, st->tables, st->max_blocks,
                        st->lens, st->requests, st->rows, st->n_rows, nh, nkv, d,
                        s->block_size, s->block_stride, s->pos_stride, s->head_stride,
                        s->scale, b->attn) != 0)
            return 1;
        MARK(P_ROWS);
        for (long c = 0; c < st->n_chunks; c++) {
            const long *chunk = st->chunks + 4 * c;
            if (kn->chunk(b->q, L->key_cache, L->value_cache,
                          st->tables + chunk[0] * st->max_blocks, (int)chunk[1],
                          (int)chunk[2], chunk[3], nh, nkv, d, s->block_size,
                          s->block_stride, s->pos_stride, s->head_stride, s->scale,
                          b->attn) != 0)
                return 1;
        }
        MARK(P_CHUNKS);
        kn->gemm(b->attn, T, (long)nh * d, L->o, L->o_type, H, b->h2, h, ADD);
        MARK(P_O);
        kn->norm(b->h2, T, H, L->post_norm, s->eps, b->xn);
        MARK(P_NORM2);
        kn->gemm(b->xn, T, H, L->gate, L->gate_type, s->intermediate, b->gate, 0, PLAIN);
        MARK(P_GATE);
        tidal_silu(b->gate, T * s->intermediate);
        MARK(P_SILU);
        kn->gemm(b->xn, T, H, L->up, L->up_type, s->intermediate, b->m, b->gate, MUL);
        MARK(P_UP);
        kn->gemm(b->m, T, s->intermediate, L->down, L->down_type, H, h, b->h2, ADD);
        MARK(P_DOWN);
    }
    return 0;
}
