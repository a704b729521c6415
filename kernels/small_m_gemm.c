/* y[M, N] = x[M, K] W^T (op 1: + other, op 2: * other) for float32 and a few rows: the
 * decode steps' linear layers on an AVX-512 CPU. Built and loaded by small_m_gemm.py.
 *
 * W is packed once at load as panels of 16 output columns, wp[N / 16][K][16], so one panel
 * is a contiguous K x 64-byte stream. Each thread takes a run of panel pairs (32 columns);
 * for a pair it sweeps the rows in blocks of 12, 8, 4 and 1, every block holding its
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
#define TIDAL_PANEL_GEMM 1
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline void finish16(float *y, const float *other, int op, v16 acc) {
    if (op == 1) acc += load16(other);
    else if (op == 2) acc *= load16(other);
    store16(y, acc);
}

/* RB rows of x against panels w0, w1 (K x 16 each); `prefetch` (or NULL): K cache lines of
 * the next pair to bring into L2 meanwhile. */
#define ROW_BLOCK(RB)                                                                        \
static void rows_##RB(const float *x, long K, const float *w0, const float *w1,            \
                      float *y, long N, const float *other, int op, const float *prefetch) { \
    v16 a0[RB], a1[RB];                                                                      \
    for (int i = 0; i < RB; i++) { a0[i] = (v16){0}; a1[i] = (v16){0}; }                    \
    for (long k = 0; k < K; k++) {                                                           \
        v16 b0 = load16(w0 + 16 * k), b1 = load16(w1 + 16 * k);                              \
        if (prefetch) __builtin_prefetch(prefetch + 16 * k, 0, 2);                           \
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
ROW_BLOCK(12)
ROW_BLOCK(8)
ROW_BLOCK(4)
ROW_BLOCK(1)

static void pair(const float *x, long M, long K, const float *w0, float *y, long N,
                 const float *other, int op, const float *next) {
    const float *w1 = w0 + 16 * K;
    long m = 0;
    int block = 0;
    while (m < M) {
        long left = M - m;
        /* the next pair's 2K lines: K by the first row block, K by the second */
        const float *pf = next && block < 2 ? next + (size_t)block * 16 * K : 0;
        const float *o = other ? other + m * N : 0;
        if (left >= 12) { rows_12(x + m * K, K, w0, w1, y + m * N, N, o, op, pf); m += 12; }
        else if (left >= 8) { rows_8(x + m * K, K, w0, w1, y + m * N, N, o, op, pf); m += 8; }
        else if (left >= 4) { rows_4(x + m * K, K, w0, w1, y + m * N, N, o, op, pf); m += 4; }
        else { rows_1(x + m * K, K, w0, w1, y + m * N, N, o, op, pf); m += 1; }
        block++;
    }
}
#else
#define TIDAL_PANEL_GEMM 0
#endif

/* 1 where this build has the kernel (compiled for a CPU with AVX-512), else 0. */
int tidal_panel_gemm_available(void) { return TIDAL_PANEL_GEMM; }

/* x [M, K], wp [N / 16][K][16] (N a multiple of 32), y and other [M, N], all contiguous;
 * op 0: y = x W^T, 1: y = x W^T + other, 2: y = x W^T * other. */
void tidal_panel_gemm(const float *x, long M, long K, const float *wp, long N, float *y,
                      const float *other, int op) {
#if TIDAL_PANEL_GEMM
    long pairs = N / 32;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < pairs; p++) {
        const float *w0 = wp + (size_t)p * 32 * K;
        const float *next = p + 1 < pairs ? w0 + 32 * K : 0;
        pair(x, M, K, w0, y + 32 * p, N, other ? other + 32 * p : 0, op, next);
    }
#else
    (void)x; (void)M; (void)K; (void)wp; (void)N; (void)y; (void)other; (void)op;
#endif
}
