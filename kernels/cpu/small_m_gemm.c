/* y[M, N] = x[M, K] W^T (op 1: + other, op 2: * other) for float32 and a few rows: the
 * decode steps' linear layers on an AVX-512 or AVX2 CPU. Built and loaded by small_m_gemm.py.
 *
 * W is packed once at load as panels of 16 output columns, wp[N / 16][K][16], so one panel
 * is a contiguous K x 64-byte stream (bfloat16 weights: pairs of panels interleaved, see
 * PAIR_ROW_bf16). float32, bfloat16 and float16 weights are all widened to float32 before
 * any arithmetic, so a weight stored narrow gives the products of its float32 values.
 * Each thread takes a run of panel pairs (32 columns); for a pair it sweeps the rows in
 * blocks (12, 8, 4, 1 with AVX-512; 2, 1 with AVX2), every block holding its rows' 32 sums in
 * registers over the whole K loop, one broadcast row element times the pair's row per step.
 *
 * Why not oneDNN: a decode step streams every weight from memory once, and oneDNN's kernel
 * pulls them at 5.5 GB/s a core at 32 rows (87-92 GFLOP/s a thread, against 131-140 when the
 * same weight sits in cache). Here the first two row blocks of a pair also prefetch the next
 * pair into L2, one cache line per K step, so the stream overlaps the arithmetic: 202
 * against 152-165 GFLOP/s on two threads for SmolLM2's four layer shapes at 32 rows
 * (benchmarks/archive/BENCHMARKS.md). Sums run over k in order with fused multiply-adds, as
 * oneDNN's do: results
 * equal F.linear's to float32 rounding; the add and mul of op 1 and 2 are applied to the
 * finished sums, so they equal the separate ops bit for bit.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define TIDAL_PANEL_GEMM 1

/* A row k of a panel pair, 32 weights, is NV vectors of VL floats: two zmm with AVX-512, four
 * ymm with AVX2. Only these macros and the widening below differ between the two. */
#if defined(__AVX512F__)
typedef __m512 vec;
#define NV 2
#define VL 16
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#define VMUL _mm512_mul_ps
#else
typedef __m256 vec;
#define NV 4
#define VL 8
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#define VMUL _mm256_mul_ps
#endif

/* fl(q d): the product rounded to float32 before anything adds to it. The empty asm hides the
 * product from the compiler, which would otherwise fuse it with a following add into one
 * multiply-add (one rounding) under GCC's default -ffp-contract=fast. */
static inline vec rounded_product(vec q, vec d) {
    vec p = VMUL(q, d);
    __asm__("" : "+x"(p));
    return p;
}

/* Row k of a pair as float32, b[0..NV): columns 0-31 in order, by storage type. float32 and
 * float16 pairs are two panels, w1 = w0 + 16 K. A bfloat16 pair is one [K][16][2] array with
 * column j at 2j and column 16 + j at 2j + 1, so 64 bytes hold the whole row: a 16-bit shift
 * left widens columns 0-15, masking the low half widens 16-31 (bfloat16 is the top half of a
 * float32: exact), two cheap integer ops where zero-extending shuffles cost 10% at 256 rows on
 * AVX-512, where the FMA ports are busy. float16 widens exactly too (vcvtph2ps). */
#if defined(__AVX512F__)
#define PAIR_ROW_f32(w0, w1, k, b)                                                           \
    vec b[2] = {VLOAD((const float *)(w0) + 16 * (k)), VLOAD((const float *)(w1) + 16 * (k))}
#define HALVES16(w, k) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const unsigned short *)(w) + 16 * (k))))
#define PAIR_ROW_f16(w0, w1, k, b) vec b[2] = {HALVES16(w0, k), HALVES16(w1, k)}
#define PAIR_ROW_bf16(w0, w1, k, b)                                                          \
    __m512i both = _mm512_loadu_si512((const unsigned short *)(w0) + 32 * (k));            \
    vec b[2] = {_mm512_castsi512_ps(_mm512_slli_epi32(both, 16)),                            \
                _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32((int)0xFFFF0000u)))}
#else
#define PAIR_ROW_f32(w0, w1, k, b)                                                           \
    const float *f0 = (const float *)(w0) + 16 * (k), *f1 = (const float *)(w1) + 16 * (k);  \
    vec b[4] = {VLOAD(f0), VLOAD(f0 + 8), VLOAD(f1), VLOAD(f1 + 8)}
#define HALVES8(w, k, j) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const unsigned short *)(w) + 16 * (k) + 8 * (j))))
#define PAIR_ROW_f16(w0, w1, k, b)                                                           \
    vec b[4] = {HALVES8(w0, k, 0), HALVES8(w0, k, 1), HALVES8(w1, k, 0), HALVES8(w1, k, 1)}
#define PAIR_ROW_bf16(w0, w1, k, b)                                                          \
    const __m256i *both = (const __m256i *)((const unsigned short *)(w0) + 32 * (k));      \
    __m256i lo = _mm256_loadu_si256(both), hi = _mm256_loadu_si256(both + 1);               \
    __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);                                       \
    vec b[4] = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),                              \
                _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)),                              \
                _mm256_castsi256_ps(_mm256_and_si256(lo, top)),                              \
                _mm256_castsi256_ps(_mm256_and_si256(hi, top))}
#endif

/* y (VL columns of one row) = acc, + other (op 1) or * other (op 2). */
static inline void finish(float *y, const float *other, int op, vec acc) {
    if (op == 1) acc = VADD(acc, VLOAD(other));
    else if (op == 2) acc = VMUL(acc, VLOAD(other));
    VSTORE(y, acc);
}

/* RB rows' sums over k of x[i, k] * b[j] (the row of the pair ROW(k) defines), held in
 * registers over the whole loop, then finished into y. */
#define ACCUMULATE(RB, x, K, k0, kn, ROW, a)                                                 \
    for (long k = (k0); k < (kn); k++) {                                                     \
        ROW;                                                                                 \
        for (int i = 0; i < RB; i++) {                                                       \
            vec xi = VSET1((x)[i * (K) + k]);                                                \
            for (int j = 0; j < NV; j++) a[i][j] = VFMA(xi, b[j], a[i][j]);                 \
        }                                                                                    \
    }
#define FINISH(RB, a, y, N, other, op)                                                       \
    for (int i = 0; i < RB; i++)                                                             \
        for (int j = 0; j < NV; j++)                                                         \
            finish((y) + i * (N) + VL * j, (other) ? (other) + i * (N) + VL * j : 0, op, a[i][j]);

/* RB rows of x against panels w0, w1 (K x 16 each, of type T); `prefetch` (or NULL): K cache
 * lines (64 bytes apart) of the next pair to bring into L2 meanwhile. */
#define ROW_BLOCK(RB, T)                                                                     \
static void rows_##RB##_##T(const float *x, long K, const void *w0, const void *w1,        \
                            float *y, long N, const float *other, int op,                  \
                            const char *prefetch) {                                        \
    vec a[RB][NV];                                                                           \
    (void)w1; /* a bfloat16 pair reads both panels from w0 */                                \
    for (int i = 0; i < RB; i++) for (int j = 0; j < NV; j++) a[i][j] = VZERO();            \
    ACCUMULATE(RB, x, K, 0, K, PAIR_ROW_##T(w0, w1, k, b);                                   \
               if (prefetch) __builtin_prefetch(prefetch + 64 * k, 0, 2), a)                 \
    FINISH(RB, a, y, N, other, op)                                                           \
}

/* The row-block functions of one type, and a call of the largest that fits `left` rows
 * (returns the rows it took). A block holds its rows' sums in registers beside the row of
 * weights: AVX-512's 32 zmm take 12 rows (24 sums, 2 weight vectors), AVX2's 16 ymm take 2
 * (8 sums, 4 weight vectors; 3 rows spill). */
#if defined(__AVX512F__)
#define ROW_BLOCKS(MAKE, T) MAKE(12, T) MAKE(8, T) MAKE(4, T) MAKE(1, T)
#define DISPATCH(T, left, args)                                                              \
    ((left) >= 12 ? (rows_12_##T args, 12) : (left) >= 8 ? (rows_8_##T args, 8)            \
     : (left) >= 4 ? (rows_4_##T args, 4) : (rows_1_##T args, 1))
#else
#define ROW_BLOCKS(MAKE, T) MAKE(2, T) MAKE(1, T)
#define DISPATCH(T, left, args) ((left) >= 2 ? (rows_2_##T args, 2) : (rows_1_##T args, 1))
#endif

/* One pair of panels (32 output columns) against all M rows, in row blocks of 12, 8, 4, 1.
 * A pair is 32 K `SIZE`-byte weights, 2 K cache lines for float32 and K for 16-bit types:
 * the first (and for float32 the second) row block prefetches K lines of the next pair. */
#define PAIR(T, SIZE)                                                                        \
ROW_BLOCKS(ROW_BLOCK, T)                                                                     \
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
        m += DISPATCH(T, left, (xm, K, w0, w1, ym, N, o, op, pf));                          \
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
 * computed the float32 values (numpy's d * q + m): `rounded_product` keeps the compiler from
 * fusing them into one multiply-add. So again the products are those of the
 * float32 weights, from 6 bits a weight instead of 32. */
#define Q4_BLOCK_BYTES 768
#define Q8_BLOCK_BYTES 1152

/* Row k of a block as float32 vectors b[0..NV), columns 0-31: 4-bit fl(fl(d q) + m), 8-bit
 * fl(d q); d (and m) are the block's header, re-read from L1 per row. */
#if defined(__AVX512F__)
#define Q4_ROW(w, k, b)                                                                      \
    const float *dm = (const float *)(w);                                                    \
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((w) + 256 + 16 * (k)))); \
    vec b[2] = {VADD(rounded_product(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), \
                                     VLOAD(dm)), VLOAD(dm + 32)),                            \
                VADD(rounded_product(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), VLOAD(dm + 16)), \
                     VLOAD(dm + 48))}
#define Q8_ROW(w, k, b)                                                                      \
    const float *dm = (const float *)(w);                                                    \
    const __m128i *qk = (const __m128i *)((w) + 128 + 32 * (k));                             \
    vec b[2] = {rounded_product(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk))), VLOAD(dm)), \
                rounded_product(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qk + 1))), VLOAD(dm + 16))}
#else
/* Eight 4-bit weights from 8 bytes (low or high nibbles), or eight 8-bit ones. */
static inline vec q4_eight(const unsigned char *bytes, int high, const float *d, const float *m) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    q = high ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
    return VADD(rounded_product(_mm256_cvtepi32_ps(q), VLOAD(d)), VLOAD(m));
}
static inline vec q8_eight(const unsigned char *bytes, const float *d) {
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    return rounded_product(_mm256_cvtepi32_ps(q), VLOAD(d));
}
#define Q4_ROW(w, k, b)                                                                      \
    const float *dm = (const float *)(w);                                                    \
    const unsigned char *qk = (w) + 256 + 16 * (k);                                          \
    vec b[4] = {q4_eight(qk, 0, dm, dm + 32), q4_eight(qk + 8, 0, dm + 8, dm + 40),          \
                q4_eight(qk, 1, dm + 16, dm + 48), q4_eight(qk + 8, 1, dm + 24, dm + 56)}
#define Q8_ROW(w, k, b)                                                                      \
    const float *dm = (const float *)(w);                                                    \
    const unsigned char *qk = (w) + 128 + 32 * (k);                                          \
    vec b[4] = {q8_eight(qk, dm), q8_eight(qk + 8, dm + 8), q8_eight(qk + 16, dm + 16),      \
                q8_eight(qk + 24, dm + 24)}
#endif

#define ROW_BLOCK_Q(RB, T)                                                                   \
static void rows_##RB##_##T(const float *x, long K, const unsigned char *w, float *y, long N, \
                            const float *other, int op, const char *prefetch) {            \
    vec a[RB][NV];                                                                           \
    for (int i = 0; i < RB; i++) for (int j = 0; j < NV; j++) a[i][j] = VZERO();            \
    for (long kb = 0; kb < K; kb += 32, w += T##_BLOCK_BYTES) {                              \
        if (prefetch)                                                                        \
            for (int l = 0; l < T##_BLOCK_BYTES; l += 64)                                    \
                __builtin_prefetch(prefetch + kb / 32 * T##_BLOCK_BYTES + l, 0, 2);          \
        ACCUMULATE(RB, x + kb, K, 0, 32, T##_ROW(w, k, b), a)                                \
    }                                                                                        \
    FINISH(RB, a, y, N, other, op)                                                           \
}

#if defined(__AVX512F__)
#define ROW_BLOCKS_Q(T) ROW_BLOCKS(ROW_BLOCK_Q, T)
#define DISPATCH_Q(T, left, args) DISPATCH(T, left, args)
#else
/* Half of row k of a block (h 0: columns 0-15, 1: 16-31) as two vectors, b[0..2). */
#define Q4_HALF(w, k, h, b)                                                                  \
    const float *dm = (const float *)(w);                                                    \
    const unsigned char *qk = (w) + 256 + 16 * (k);                                          \
    vec b[2] = {q4_eight(qk, h, dm + 16 * (h), dm + 32 + 16 * (h)),                          \
                q4_eight(qk + 8, h, dm + 8 + 16 * (h), dm + 40 + 16 * (h))}
#define Q8_HALF(w, k, h, b)                                                                  \
    const float *dm = (const float *)(w);                                                    \
    const unsigned char *qk = (w) + 128 + 32 * (k) + 16 * (h);                               \
    vec b[2] = {q8_eight(qk, dm + 16 * (h)), q8_eight(qk + 8, dm + 16 * (h) + 8)}
/* AVX2, 3 to 5 rows: each half of the pair in turn (16 columns, two vectors of weights),
 * RB rows' 2 RB sums in registers (5 rows: 10 sums, 2 weights, a broadcast and the widening's
 * temporaries in 16 ymm). Why: in row blocks of 2 and 1 every block widens the pair's
 * weights again, and the widening (a multiply and an add per weight) rivals the FMAs: on the
 * 2-vCPU AVX2 EPYC a 5-row product of SmolLM2's layers cost ~2.5x a 1-row one. Here the
 * weights are widened once for the rows of the block. Each sum still runs over k in order
 * with fused multiply-adds from zero, so results are those of the 2- and 1-row blocks bit
 * for bit. The first half prefetches the next pair. */
#define ROW_BLOCK_QH(RB, T)                                                                  \
static void rows_h##RB##_##T(const float *x, long K, const unsigned char *w0, float *y,     \
                             long N, const float *other, int op, const char *prefetch) {   \
    for (int h = 0; h < 2; h++) {                                                            \
        const unsigned char *w = w0;                                                         \
        vec a[RB][2];                                                                        \
        for (int i = 0; i < RB; i++) a[i][0] = a[i][1] = VZERO();                           \
        for (long kb = 0; kb < K; kb += 32, w += T##_BLOCK_BYTES) {                          \
            if (prefetch && h == 0)                                                          \
                for (int l = 0; l < T##_BLOCK_BYTES; l += 64)                                \
                    __builtin_prefetch(prefetch + kb / 32 * T##_BLOCK_BYTES + l, 0, 2);      \
            for (long k = 0; k < 32; k++) {                                                  \
                T##_HALF(w, k, h, b);                                                        \
                for (int i = 0; i < RB; i++) {                                               \
                    vec xi = VSET1(x[i * K + kb + k]);                                       \
                    a[i][0] = VFMA(xi, b[0], a[i][0]);                                       \
                    a[i][1] = VFMA(xi, b[1], a[i][1]);                                       \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < RB; i++)                                                         \
            for (int j = 0; j < 2; j++)                                                      \
                finish(y + i * N + 16 * h + VL * j,                                          \
                       other ? other + i * N + 16 * h + VL * j : 0, op, a[i][j]);            \
    }                                                                                        \
}
#define ROW_BLOCKS_Q(T) ROW_BLOCKS(ROW_BLOCK_Q, T) ROW_BLOCK_QH(5, T) ROW_BLOCK_QH(4, T)     \
    ROW_BLOCK_QH(3, T)
#define DISPATCH_Q(T, left, args)                                                            \
    ((left) >= 5 ? (rows_h5_##T args, 5) : (left) == 4 ? (rows_h4_##T args, 4)              \
     : (left) == 3 ? (rows_h3_##T args, 3) : DISPATCH(T, left, args))
#endif
/* A pair of blocks against all M rows in row blocks (12, 8, 4, 1 with AVX-512; 5, 4, 3 of
 * half pairs, then 2, 1 with AVX2); the first row block prefetches the whole next pair. */
#define PAIR_Q(T)                                                                            \
ROW_BLOCKS_Q(T)                                                                              \
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
        m += DISPATCH_Q(T, left, (xm, K, w0, ym, N, o, op, pf));                            \
        block++;                                                                             \
    }                                                                                        \
}
PAIR_Q(Q4)
PAIR_Q(Q8)

/* Finding the blocks (at load): one column's run of 32 weights w, checked against the float16
 * d (and m) its quantizer chose. fl(fl(d q) + m) and fl(d q) are rounded as the kernel widens
 * them, and q = round((w - m) / d) (half to even, as torch's round) clamped to the type's
 * range. */
static inline float rebuilt(float d, float q, float m, int offset) {
    float product = d * q;
    __asm__("" : "+x"(product)); /* rounded to float32 before the add, never fused */
    return offset ? product + m : product;
}

static inline float half_to_float(unsigned short h) { return _cvtsh_ss(h); }
static inline unsigned short float_to_half(float f) {
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

/* Whether the run w[0..32) is exactly fl(fl(d q) + m) (Q4_1: offset 1,
 * q 0..15) or fl(d q) (Q8_0: offset 0, q -128..127) for float16 d and m; if so writes d, m
 * and the 32 q. d is tried at the float16 nearest (max - min) / 15 (or max |w| / 127), which
 * the quantizer stored, and at the two float16 values either side. */
static int find_run(const float *w, int offset, float *d_out, float *m_out, int *q_out) {
    float lo = w[0], hi = w[0], top = 0;
    for (int i = 0; i < 32; i++) {
        float v = w[i];
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
            float v = w[i];
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
            still = find_run(w + (pair * 32 + c) * K + kb * 32, offset, &d[c],
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

/* 1 where this build has the kernel (compiled for a CPU with AVX-512, or AVX2 with FMA and
 * F16C), else 0. */
int tidal_panel_gemm_available(void) { return TIDAL_PANEL_GEMM; }

/* Floats in one of the build's vector registers: 16 (AVX-512) or 8 (AVX2); 0 without it. */
int tidal_panel_gemm_vector_floats(void) {
#if TIDAL_PANEL_GEMM
    return VL;
#else
    return 0;
#endif
}

/* x [M, K], wp [N / 16][K][16] of weight type `wtype` (0 float32, 1 bfloat16, 2 float16; N
 * a multiple of 32), or 3 / 4: [N / 32][K / 32] 4-bit / 8-bit blocks (K a multiple of 32);
 * y and other [M, N]; all contiguous. op 0: y = x W^T, 1: y = x W^T + other, 2: y = x W^T *
 * other. */
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
