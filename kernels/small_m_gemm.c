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

typedef void (*pair_fn)(const float *, long, long, const void *, float *, long,
                        const float *, int, const void *);
#else
#define TIDAL_PANEL_GEMM 0
#endif

/* 1 where this build has the kernel (compiled for a CPU with AVX-512), else 0. */
int tidal_panel_gemm_available(void) { return TIDAL_PANEL_GEMM; }

/* x [M, K], wp [N / 16][K][16] of weight type `wtype` (0 float32, 1 bfloat16, 2 float16; N
 * a multiple of 32), y and other [M, N], all contiguous; op 0: y = x W^T, 1: y = x W^T + other,
 * 2: y = x W^T * other. */
void tidal_panel_gemm(const float *x, long M, long K, const void *wp, int wtype, long N,
                      float *y, const float *other, int op) {
#if TIDAL_PANEL_GEMM
    static const pair_fn pairs_by_type[3] = {pair_f32, pair_bf16, pair_f16};
    static const size_t size_by_type[3] = {4, 2, 2};
    pair_fn pair = pairs_by_type[wtype];
    size_t pair_bytes = (size_t)32 * K * size_by_type[wtype];
    long pairs = N / 32;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < pairs; p++) {
        const char *w0 = (const char *)wp + p * pair_bytes;
        const char *next = p + 1 < pairs ? w0 + pair_bytes : 0;
        pair(x, M, K, w0, y + 32 * p, N, other ? other + 32 * p : 0, op, next);
    }
#else
    (void)x; (void)M; (void)K; (void)wp; (void)wtype; (void)N; (void)y; (void)other; (void)op;
#endif
}
