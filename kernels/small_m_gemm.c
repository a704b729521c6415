/* y[M, N] = x[M, K] W^T (op 1: + other, op 2: * other) for float32 and a few rows: the
 * decode steps' linear layers on an AVX-512 CPU. Built and loaded by small_m_gemm.py.
 *
 * W is packed once at load as panels of 16 output columns, wp[N / 16][K][16], so one panel
 * is a contiguous K x 64-byte stream (bfloat16 weights: pairs of panels interleaved, see
 * PAIR_ROW_bf16). float32, bfloat16 and float16 weights are all widened to float32 before
 * any arithmetic, so a weight stored narrow gives the products of its float32 values.
 * Each thread takes a run of panel pairs (32 columns); for a pair it sweeps the rows in blocks of 12, 8, 4 and 1, every block holding its
 * 12 x 32 (or fewer) sums in registers over the whole K loop, one broadcast row element
 * times two panel vectors per step.
 *
 * Why not oneDNN: a decode step streams every weight from memory once, and oneDNN's kernel
 * pulls them at 5.5 GB/s a core at 32 rows (87-92 GFLOP/s a thread, against 131-140 when the
 * same weight sits in cache). Here the first two row blocks of a pair also prefetch the next
 * pair into L2, one cache line per K step, so the stream overlaps the arithmetic: 202
 * against 152-165 GFLOP/s on two threads for SmolLM2's four layer shapes at 32 rows
 * (BENCHMARKS.md). Sums run over k in order with fused multiply-adds, as oneDNN's do: results
 * equal F.linear's to float32 rounding; the add and mul of op 1 and 2 are applied to the
 * finished sums, so they equal the separate ops bit for bit.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TIDAL_PANEL_GEMM 1
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Sixteen weights of a panel row as float32, by storage type. bfloat16 is the top half of a
 * float32, so widening it is a 16-bit shift and exact; so is float16's conversion. */
static inline v16 weights_f32(const void *w, long i) { return load16((const float *)w + i); }
static inline v16 weights_f16(const void *w, long i) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const unsigned short *)w + i));
    return (v16)_mm512_cvtph_ps(h);
}

/* Row k of a panel pair as two float32 vectors (columns 0-15, 16-31). float32 and float16
 * pairs are two panels, w1 = w0 + 16 K; a bfloat16 pair is one [K][16][2] array with column j
 * at 2j and column 16 + j at 2j + 1, so one 64-byte load holds both rows: a 16-bit shift left
 * widens columns 0-15, masking the low half widens 16-31 (two cheap integer ops instead of
 * two zero-extending shuffles plus two shifts: 10% at 256 rows, where the FMA ports are busy). */
#define PAIR_ROW_f32(w0, w1, k, b0, b1) \
    v16 b0 = weights_f32(w0, 16 * (k)), b1 = weights_f32(w1, 16 * (k))
#define PAIR_ROW_f16(w0, w1, k, b0, b1) \
    v16 b0 = weights_f16(w0, 16 * (k)), b1 = weights_f16(w1, 16 * (k))
#define PAIR_ROW_bf16(w0, w1, k, b0, b1)                                                    \
    __m512i both_##k = _mm512_loadu_si512((const unsigned short *)(w0) + 32 * (k));        \
    v16 b0 = (v16)_mm512_castsi512_ps(_mm512_slli_epi32(both_##k, 16));                     \
    v16 b1 = (v16)_mm512_castsi512_ps(_mm512_and_si512(both_##k, _mm512_set1_epi32((int)0xFFFF0000u)))

static inline void finish16(float *y, const float *other, int op, v16 acc) {
    if (op == 1) acc += load16(other);
    else if (op == 2) acc *= load16(other);
    store16(y, acc);
}

/* RB rows of x against panels w0, w1 (K x 16 each, of type T); `prefetch` (or NULL): K cache
 * lines (64 bytes apart) of the next pair to bring into L2 meanwhile. */
#define ROW_BLOCK(RB, T)                                                                     \
static void rows_##RB##_##T(const float *x, long K, const void *w0, const void *w1,        \
                            float *y, long N, const float *other, int op,                  \
                            const char *prefetch) {                                        \
    v16 a0[RB], a1[RB];                                                                      \
    (void)w1; /* a bfloat16 pair reads both panels from w0 */                                \
    for (int i = 0; i < RB; i++) { a0[i] = (v16){0}; a1[i] = (v16){0}; }                    \
    for (long k = 0; k < K; k++) {                                                           \
        PAIR_ROW_##T(w0, w1, k, b0, b1);                                                     \
        if (prefetch) __builtin_prefetch(prefetch + 64 * k, 0, 2);                           \
        for (int i = 0; i < RB; i++) {                                                       \
            float xi = x[i * K + k];                                                         \
            a0[i] += xi * b0;                                                                \
            a1[i] += xi * b1;                                                                \
        }                                                                                    \
    }                                                                                        \
    for (int i = 0; i < RB; i++) {                                                           \
        finish16(y + i * N, other ? other + i * N : 0, op, a0[i]);                           \
        finish16(y + i * N + 16, other ? other + i * N + 16 : 0, op, a1[i]);                 \
    }                                                                                        \
}

/* One pair of panels (32 output columns) against all M rows, in row blocks of 12, 8, 4, 1.
 * A pair is 32 K `SIZE`-byte weights, 2 K cache lines for float32 and K for 16-bit types:
 * the first (and for float32 the second) row block prefetches K lines of the next pair. */
#define PAIR(T, SIZE)                                                                        \
ROW_BLOCK(12, T)                                                                             \
ROW_BLOCK(8, T)                                                                              \
ROW_BLOCK(4, T)                                                                              \
ROW_BLOCK(1, T)                                                                              \
static void pair_##T(const float *x, long M, long K, const void *w0, float *y, long N,     \
                     const float *other, int op, const void *next) {                        \
    const void *w1 = (const char *)w0 + (size_t)16 * K * SIZE;                              \
    long m = 0;                                                                              \
    int block = 0;                                                                           \
    while (m < M) {                                                                          \
        long left = M - m;                                                                   \
        const char *pf = next && block < SIZE / 2                                            \
            ? (const char *)next + (size_t)block * 64 * K : 0;                               \
        const float *o = other ? other + m * N : 0;                                          \
        const float *xm = x + m * K;                                                         \
        float *ym = y + m * N;                                                               \
        if (left >= 12) { rows_12_##T(xm, K, w0, w1, ym, N, o, op, pf); m += 12; }          \
        else if (left >= 8) { rows_8_##T(xm, K, w0, w1, ym, N, o, op, pf); m += 8; }        \
        else if (left >= 4) { rows_4_##T(xm, K, w0, w1, ym, N, o, op, pf); m += 4; }        \
        else { rows_1_##T(xm, K, w0, w1, ym, N, o, op, pf); m += 1; }                       \
        block++;                                                                             \
    }                                                                                        \
}
PAIR(f32, 4)
PAIR(bf16, 2)
PAIR(f16, 2)

/* 4-bit blocks (wtype 3): a weight that is exactly m + d q over each run of 32 k of a column
 * (q in 0..15, d and m float16 values: a GGUF Q4_1 checkpoint de-quantized to float32) is
 * stored as those parts. A pair is K / 32 blocks of Q4_BLOCK_BYTES:
 *
 *     float d[32], m[32]      columns 0-31 of the pair (256 bytes)
 *     uint8 q[32][16]         row k, byte j: column j's q in the low nibble, 16 + j's high
 *
 * and each weight is widened as fl(fl(d q) + m), two roundings, the way the de-quantizer
 * computed the float32 values (numpy's d * q + m): the explicit-rounding intrinsics keep the
 * compiler from fusing them into one multiply-add. So again the products are those of the
 * float32 weights, from 6 bits a weight instead of 32. */
#define ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define Q4_BLOCK_BYTES 768
#define Q4_HEADER(w)                                                                         \
    const float *dm = (const float *)(w);                                                    \
    __m512 d0 = _mm512_loadu_ps(dm), d1 = _mm512_loadu_ps(dm + 16);                          \
    __m512 m0 = _mm512_loadu_ps(dm + 32), m1 = _mm512_loadu_ps(dm + 48)
#define Q4_ROW(w, k, b0, b1)                                                                 \
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((w) + 256 + 16 * (k)))); \
    v16 b0 = (v16)_mm512_add_round_ps(                                                       \
        _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), \
                            d0, ROUND), m0, ROUND);                                          \
    v16 b1 = (v16)_mm512_add_round_ps(                                                       \
        _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d1, ROUND), m1, ROUND)

/* 8-bit blocks (wtype 4): a weight that is exactly d q over each run of 32 k of a column (q in
 * -128..127, d a float16 value: GGUF Q8_0 de-quantized, numpy's d * q) is stored as float
 * d[32] (128 bytes) and int8 q[32][32] (row k: columns 0-31), widened as fl(d q). */
#define Q8_BLOCK_BYTES 1152
#define Q8_HEADER(w)                                                                         \
    const float *dm = (const float *)(w);                                                    \
    __m512 d0 = _mm512_loadu_ps(dm), d1 = _mm512_loadu_ps(dm + 16)
#define Q8_ROW(w, k, b0, b1)                                                                 \
    const __m128i *qk = (const __m128i *)((w) + 128 + 32 * (k));                             \
    v16 b0 = (v16)_mm512_mul_round_ps(                                                       \
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk))), d0, ROUND);          \
    v16 b1 = (v16)_mm512_mul_round_ps(                                                       \
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk + 1))), d1, ROUND)

#define ROW_BLOCK_Q(RB, T)                                                                   \
static void rows_##RB##_##T(const float *x, long K, const unsigned char *w, float *y, long N, \
                            const float *other, int op, const char *prefetch) {            \
    v16 a0[RB], a1[RB];                                                                      \
    for (int i = 0; i < RB; i++) { a0[i] = (v16){0}; a1[i] = (v16){0}; }                    \
    for (long kb = 0; kb < K; kb += 32, w += T##_BLOCK_BYTES) {                              \
        T##_HEADER(w);                                                                       \
        if (prefetch)                                                                        \
            for (int l = 0; l < T##_BLOCK_BYTES; l += 64)                                    \
                __builtin_prefetch(prefetch + kb / 32 * T##_BLOCK_BYTES + l, 0, 2);          \
        for (long k = 0; k < 32; k++) {                                                      \
            T##_ROW(w, k, b0, b1);                                                           \
            for (int i = 0; i < RB; i++) {                                                   \
                float xi = x[i * K + kb + k];                                                \
                a0[i] += xi * b0;                                                            \
                a1[i] += xi * b1;                                                            \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (int i = 0; i < RB; i++) {                                                           \
        finish16(y + i * N, other ? other + i * N : 0, op, a0[i]);                           \
        finish16(y + i * N + 16, other ? other + i * N + 16 : 0, op, a1[i]);                 \
    }                                                                                        \
}

/* A pair of blocks against all M rows in row blocks of 12, 8, 4, 1; the first row block
 * prefetches the whole next pair. */
#define PAIR_Q(T)                                                                            \
ROW_BLOCK_Q(12, T)                                                                           \
ROW_BLOCK_Q(8, T)                                                                            \
ROW_BLOCK_Q(4, T)                                                                            \
ROW_BLOCK_Q(1, T)                                                                            \
static void pair_##T(const float *x, long M, long K, const void *w0, float *y, long N,     \
                     const float *other, int op, const void *next) {                        \
    long m = 0;                                                                              \
    int block = 0;                                                                           \
    while (m < M) {                                                                          \
        long left = M - m;                                                                   \
        const char *pf = next && block == 0 ? (const char *)next : 0;                       \
        const float *o = other ? other + m * N : 0;                                          \
        const float *xm = x + m * K;                                                         \
        float *ym = y + m * N;                                                               \
        if (left >= 12) { rows_12_##T(xm, K, w0, ym, N, o, op, pf); m += 12; }              \
        else if (left >= 8) { rows_8_##T(xm, K, w0, ym, N, o, op, pf); m += 8; }            \
        else if (left >= 4) { rows_4_##T(xm, K, w0, ym, N, o, op, pf); m += 4; }            \
        else { rows_1_##T(xm, K, w0, ym, N, o, op, pf); m += 1; }                           \
        block++;                                                                             \
    }                                                                                        \
}
PAIR_Q(Q4)
PAIR_Q(Q8)

/* Finding the blocks (at load): one column's run of 32 weights w, checked against the float16
 * d (and m) its quantizer chose. fl(fl(d q) + m) and fl(d q) are computed with the
 * explicit-rounding intrinsics, as the kernel widens them, and q = round((w - m) / d) (half
 * to even, as torch's round) clamped to the type's range. */
static inline float rebuilt(float d, float q, float m, int offset) {
    __m128 product = _mm_mul_round_ss(_mm_set_ss(d), _mm_set_ss(q), ROUND);
    return _mm_cvtss_f32(offset ? _mm_add_round_ss(product, _mm_set_ss(m), ROUND) : product);
}

static inline float half_to_float(unsigned short h) { return _cvtsh_ss(h); }
static inline unsigned short float_to_half(float f) {
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

/* Whether the run w[0], w[stride], ... (32 values) is exactly fl(fl(d q) + m) (Q4_1: offset 1,
 * q 0..15) or fl(d q) (Q8_0: offset 0, q -128..127) for float16 d and m; if so writes d, m
 * and the 32 q. d is tried at the float16 nearest (max - min) / 15 (or max |w| / 127), which
 * the quantizer stored, and at the two float16 values either side. */
static int find_run(const float *w, long stride, int offset, float *d_out, float *m_out,
                    int *q_out) {
    float lo = w[0], hi = w[0], top = 0;
    for (int i = 0; i < 32; i++) {
        float v = w[i * stride];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        top = fabsf(v) > top ? fabsf(v) : top;
    }
    float m = offset ? lo : 0.0f;
    if (offset && half_to_float(float_to_half(lo)) != lo) return 0;
    int q_min = offset ? 0 : -128, q_max = offset ? 15 : 127;
    unsigned short guess = float_to_half(offset ? (hi - lo) / 15.0f : top / 127.0f);
    static const int steps[5] = {0, -1, 1, -2, 2};
    for (int s = 0; s < 5; s++) {
        float d = half_to_float((unsigned short)(guess + steps[s]));
        if (!(d >= 0.0f) || isinf(d)) continue;
        int ok = 1;
        for (int i = 0; i < 32 && ok; i++) {
            float v = w[i * stride];
            float q = d > 0.0f ? nearbyintf((v - m) / d) : 0.0f;
            q = q < q_min ? q_min : q > q_max ? q_max : q;
            q_out[i] = (int)q;
            ok = rebuilt(d, q, m, offset) == v;
        }
        if (ok) { *d_out = d; *m_out = m; return 1; }
    }
    return 0;
}

/* w [N, K] float32 (N, K multiples of 32) -> out, the kernel's 4-bit (kind 3) or 8-bit (kind 4)
 * blocks, [N / 32][K / 32] of Q4_BLOCK_BYTES / Q8_BLOCK_BYTES; returns 1, or 0 (out undefined)
 * where some run of 32 is not exactly made of such parts. */
int tidal_find_blocks(const float *w, long N, long K, int kind, unsigned char *out) {
    int offset = kind == 3;
    size_t block_bytes = offset ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    long runs = N / 32 * (K / 32);
    int found = 1; /* cleared by the first run that is not made of blocks */
    #pragma omp parallel for schedule(static)
    for (long r = 0; r < runs; r++) {
        int still;
        #pragma omp atomic read
        still = found;
        if (!still) continue;
        long pair = r / (K / 32), kb = r % (K / 32);
        unsigned char *block = out + r * block_bytes;
        float *d = (float *)block, *m = d + 32, no_offset;
        int q[32][32]; /* [column][k] */
        for (int c = 0; c < 32 && still; c++)
            still = find_run(w + (pair * 32 + c) * K + kb * 32, 1, offset, &d[c],
                             offset ? &m[c] : &no_offset, q[c]);
        if (!still) {
            #pragma omp atomic write
            found = 0;
            continue;
        }
        if (offset) {
            unsigned char *nibbles = block + 256; /* row k, byte j: column j low, 16 + j high */
            for (int k = 0; k < 32; k++)
                for (int j = 0; j < 16; j++)
                    nibbles[16 * k + j] = (unsigned char)(q[j][k] | (q[16 + j][k] << 4));
        } else {
            signed char *bytes = (signed char *)(block + 128); /* row k: columns 0-31 */
            for (int k = 0; k < 32; k++)
                for (int c = 0; c < 32; c++)
                    bytes[32 * k + c] = (signed char)q[c][k];
        }
    }
    return found;
}

/* Rows taken against all the weights before the next rows start: a prefill's [ROW_CHUNK, K]
 * slice of x stays in L2 while the weights stream past it once per chunk. */
#define ROW_CHUNK 256

typedef void (*pair_fn)(const float *, long, long, const void *, float *, long,
                        const float *, int, const void *);
#else
#define TIDAL_PANEL_GEMM 0
#endif

/* 1 where this build has the kernel (compiled for a CPU with AVX-512), else 0. */
int tidal_panel_gemm_available(void) { return TIDAL_PANEL_GEMM; }

/* x [M, K], wp [N / 16][K][16] of weight type `wtype` (0 float32, 1 bfloat16, 2 float16; N
 * a multiple of 32), or 3 / 4: [N / 32][K / 32] 4-bit / 8-bit blocks (K a multiple of 32), y and other [M, N], all contiguous; op 0: y = x W^T, 1: y = x W^T + other,
 * 2: y = x W^T * other. */
void tidal_panel_gemm(const float *x, long M, long K, const void *wp, int wtype, long N,
                      float *y, const float *other, int op) {
#if TIDAL_PANEL_GEMM
    static const pair_fn pairs_by_type[5] = {pair_f32, pair_bf16, pair_f16, pair_Q4, pair_Q8};
    pair_fn pair = pairs_by_type[wtype];
    size_t pair_bytes = wtype == 3 ? (size_t)K / 32 * Q4_BLOCK_BYTES
                      : wtype == 4 ? (size_t)K / 32 * Q8_BLOCK_BYTES
                      : (size_t)32 * K * (wtype == 0 ? 4 : 2);
    long pairs = N / 32;
    #pragma omp parallel
    for (long m = 0; m < M; m += ROW_CHUNK) {
        long rows = M - m < ROW_CHUNK ? M - m : ROW_CHUNK;
        const float *xm = x + m * K, *om = other ? other + m * N : 0;
        float *ym = y + m * N;
        #pragma omp for schedule(static)
        for (long p = 0; p < pairs; p++) {
            const char *w0 = (const char *)wp + p * pair_bytes;
            const char *next = p + 1 < pairs ? w0 + pair_bytes : 0;
            pair(xm, rows, K, w0, ym + 32 * p, N, om ? om + 32 * p : 0, op, next);
        }
    }
#else
    (void)x; (void)M; (void)K; (void)wp; (void)wtype; (void)N; (void)y; (void)other; (void)op;
#endif
}
