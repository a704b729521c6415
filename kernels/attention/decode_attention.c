/* Paged attention for float32 on an AVX-512 or AVX2 CPU, one query row at a time: each row
 * against the first `len` cached K/V of its request, read in place from the paged cache (a
 * decode's row sees the whole sequence, row i of a prefill chunk the positions up to its own).
 * Built and loaded by cpu_attention.py; the same arithmetic as numba_attention.py's kernel.
 *
 * Layouts: q and out [T, H, D]; key and value caches [num_blocks, block_size, KVH, D] in any
 * order of the first three (strides in floats: block, position, KV head; D contiguous; K and
 * V alike): the cpu backend stores them head-major, [num_blocks, KVH, block_size, D]; block
 * tables [S, max_blocks] int32. Head h reads KV head h / (H / KVH). An int8 cache
 * (tidal_decode_attention_int8, kv_quant.py) has the same layout in bytes, with a float32
 * scale per (position, KV head) beside it; rows are widened to float a tile at a time and the
 * arithmetic is then the float32 kernel's.
 *
 * Work item (int8 caches, and AVX2 builds) = (query row, KV head, up to MAX_GROUP of the query
 * heads that share it), taken by the threads dynamically (lengths vary); AVX-512 builds over
 * float32 caches take (query row, its query heads: all of them, or a part where the rows are
 * too few for the threads) and walk all those heads' KV heads a cache block at a time, which
 * reads the head-major cache's blocks front to back (HEADS_ITEM below: 0.74x the time of an
 * item a KV head for 12 KV heads, from memory). An item makes two passes over its KV heads' rows:
 *
 *   scores[g, p] = scale * q[g] . K[p]        then the row maximum, and for each head
 *   e[g, p]      = exp(scores[g, p] - max)    (16 at a time, exp16), and their sum;
 *   out[g]       = sum_p e[g, p] V[p] / sum_p e[g, p]
 *
 * so each K and V row is read once for all heads of its group (q and the group's output
 * accumulators stay in registers: in the heads items, for a block's rows). A KV head's rows are contiguous within a block (head-major)
 * or D floats every KVH x D (position-major), and blocks lie anywhere: the hardware prefetcher
 * does not follow them from block to block. Each pass prefetches the row PREFETCH positions
 * ahead through the block table: measured on the 2-vCPU Xeon (position-major), 32 requests x
 * 257 positions x 3 KV heads x 64 (30 layers' caches in turn, 2 threads), 0.92 ms a layer
 * without it, 0.69 with 32 ahead (4: 0.81, 8: 0.73, 16: 0.72, 64: 0.70); numba's kernel 0.90.
 * The prefetches go to L2 (prefetcht1), not L1: on a 2-vCPU AMD EPYC (Zen 4) the kernel read
 * 15-19 GB/s with L1 prefetches where a plain read of memory gets 32-50, its streams held back
 * by the few misses L1 keeps in flight; into L2, 0.75-0.80x the time with results bit for bit
 * the same (SmolLM2's geometry, 32 requests x 150-300 positions, 30 layers' caches in turn:
 * 0.60-0.73 -> 0.46-0.57 ms a layer; 7M's, 80 requests: 0.94-1.26 -> 0.72-0.96 ms; 16 x 32
 * heads of 128 over 8 KV heads, 500-1000 positions: 5.8-6.2 -> 4.7-4.9 ms). T2 and a distance
 * of 16, 24 or 48 were slower; NTA no better than T1. (Not measured on the Xeon since.)
 *
 * Positions at or past a row's len are never read (nor their block table entries), so the cache
 * may hold anything there. Results differ from the reference by float32 rounding only (sums
 * in a different order; exp16's polynomial has relative error 6e-8).
 */
#include <math.h>
#include <stdlib.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define TIDAL_DECODE_ATTENTION 1
#define MAX_GROUP 8
#define PREFETCH 32
#ifndef PREFETCH_I8
#define PREFETCH_I8 32
#endif

/* VL floats a vector: a zmm with AVX-512, a ymm with AVX2; only these differ between them. */
#if defined(__AVX512F__)
typedef __m512 vec;
#define VL 16
#define V(op) _mm512_##op
#define VI(op) _mm512_##op
typedef __m512i veci;
#define VCASTF _mm512_castsi512_ps
#define VCASTI _mm512_castps_si512
#define VFLOOR(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vec;
#define VL 8
#define V(op) _mm256_##op
#define VI(op) _mm256_##op
typedef __m256i veci;
#define VCASTF _mm256_castsi256_ps
#define VCASTI _mm256_castps_si256
#define VFLOOR(x) _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
static inline float vsum(vec v) {
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    four = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}
#endif

/* exp(x) for x <= 0, VL lanes: x = n ln 2 + r with n = round(x / ln 2) and ln 2 in two parts
 * (Cody and Waite), exp(r) by its degree-7 Taylor polynomial (|r| <= ln 2 / 2: error 2e-9),
 * and 2^n added to the exponent field. x is clamped at -87 (exp(-87) = 1.6e-38, just above
 * float32's smallest normal), so the exponent never underflows. As numba_attention.py's. */
static inline vec expv(vec x) {
    x = V(max_ps)(x, V(set1_ps)(-87.0f));
    vec n = VFLOOR(V(fmadd_ps)(x, V(set1_ps)(1.4426950408889634f), V(set1_ps)(0.5f)));
    vec r = V(fnmadd_ps)(n, V(set1_ps)(0.693359375f), x);
    r = V(fnmadd_ps)(n, V(set1_ps)(-2.12194440e-4f), r);
    vec e = V(set1_ps)(1.0f / 5040);
    e = V(fmadd_ps)(e, r, V(set1_ps)(1.0f / 720));
    e = V(fmadd_ps)(e, r, V(set1_ps)(1.0f / 120));
    e = V(fmadd_ps)(e, r, V(set1_ps)(1.0f / 24));
    e = V(fmadd_ps)(e, r, V(set1_ps)(1.0f / 6));
    e = V(fmadd_ps)(e, r, V(set1_ps)(0.5f));
    e = V(fmadd_ps)(e, r, V(set1_ps)(1.0f));
    e = V(fmadd_ps)(e, r, V(set1_ps)(1.0f));
    veci exponent = VI(slli_epi32)(V(cvtps_epi32)(n), 23);
    return VCASTF(VI(add_epi32)(VCASTI(e), exponent));
}

/* Where a cache's rows are: `bs` positions a block, and the strides (in floats) of a block and
 * of a position; a KV head's offset (its index times the head stride) is passed beside it. */
typedef struct { int bs; long block, pos; } layout_t;

/* Row of position p of one KV head: `head` is the head's offset inside a block's position. */
static inline const float *row_at(const float *cache, const int *table, int p, layout_t at,
                                  long head) {
    return cache + (long)table[p / at.bs] * at.block + (long)(p % at.bs) * at.pos + head;
}

/* A walk over one KV head's rows in position order, block by block: the block table is read
 * once a block and a row costs no division (row_at's p / bs and p % bs, for the row and again
 * for the prefetch, at every position). Measured on the 2-vCPU AMD EPYC (Zen 4) against
 * row_at at every position, results bit for bit the same: SmolLM2's geometry (28 requests x
 * 128-256 positions, 9 heads over 3) 0.79-0.86x the time with one layer's cache in L3,
 * 0.96-0.98x with 30 layers' caches in turn (read from memory); the 7M model's (80 requests)
 * 0.97-0.98x; 16 x 32 heads of 128 over 8, 500-1000 positions, 0.94x. `row` is position p's
 * row while p < seq_len; past it no table entry is read and `row` points into block 0. The
 * prefetching walk runs PREFETCH positions ahead of the reading one, and its prefetches go
 * into L2 (prefetcht1), see the top of this file. */
typedef struct { const char *cache; const int *table; layout_t at; long head; int p, i, seq_len;
                 const char *row; } walk_t;

/* A walk of a cache of `size`-byte elements (float32 rows, int8 rows, float32 scales): `at`
 * and `head` in elements, as everywhere else; the walk keeps them in bytes. */
static inline walk_t walk_from(const void *cache, const int *table, layout_t at, long head,
                               int p, int seq_len, int size) {
    layout_t bytes = {at.bs, at.block * size, at.pos * size};
    walk_t w = {cache, table, bytes, head * size, p, p % at.bs, seq_len,
                (const char *)cache + head * size};
    if (p < seq_len)
        w.row = w.cache + (long)table[p / at.bs] * bytes.block + (long)(p % at.bs) * bytes.pos
                + w.head;
    return w;
}

static inline __attribute__((always_inline)) void walk_next(walk_t *w) {
    w->p++;
    if (++w->i < w->at.bs) {
        w->row += w->at.pos;
    } else {
        w->i = 0;
        /* past seq_len: block 0's row, never read, so that stepping on stays in bounds */
        long block = w->p < w->seq_len ? w->table[w->p / w->at.bs] : 0;
        w->row = w->cache + block * w->at.block + w->head;
    }
}

/* Prefetch the walk's row (`bytes` long) if it is inside the sequence, then step on.
 * Forced inline: GCC kept such a helper a call in the item functions, 0.82 -> 1.07 ms a layer. */
static inline __attribute__((always_inline)) void prefetch_walk(walk_t *w, int bytes) {
    if (w->p < w->seq_len)
        for (int l = 0; l < bytes; l += 64) _mm_prefetch(w->row + l, _MM_HINT_T1);
    walk_next(w);
}

/* e = exp(row - max) in place over `len` scores; returns 1 / sum(e). The last partial
 * vector goes through a copy padded with -inf (exp: 0), so it adds nothing to the sum. */
static float softmax_row(float *row, int len, float top) {
    vec t = V(set1_ps)(top), sum = V(setzero_ps)();
    int p = 0;
    for (; p + VL <= len; p += VL) {
        vec e = expv(V(sub_ps)(V(loadu_ps)(row + p), t));
        V(storeu_ps)(row + p, e);
        sum = V(add_ps)(sum, e);
    }
    if (p < len) {
        float tail[VL];
        for (int i = 0; i < VL; i++) tail[i] = p + i < len ? row[p + i] : -INFINITY;
        vec e = expv(V(sub_ps)(V(loadu_ps)(tail), t));
        V(storeu_ps)(tail, e);
        for (int i = 0; p + i < len; i++) row[p + i] = tail[i];
        for (int i = len - p; i < VL; i++) tail[i] = 0.0f;
        sum = V(add_ps)(sum, V(loadu_ps)(tail));
    }
    return 1.0f / vsum(sum);
}

/* Lane j = the sum of s[j]'s lanes, for the VL vectors s[0..VL), added in vsum's order (the
 * halves first, then quarters, ..., then neighbours; float addition is commutative, so each
 * lane is bit for bit vsum(s[j])), in a tree of shuffles that serves VL vectors at once: a
 * tile of VL scores costs about what 3 of vsum's reductions do. */
#if VL == 16
/* [a's lanes i + (i + 8), i < 8 | b's]: quarters of 4 lanes */
static inline vec fold_halves(vec a, vec b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
/* quarters 0 + 1 and 2 + 3 of a, then of b */
static inline vec fold_quarters(vec a, vec b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
#else
/* [a's lanes i + (i + 4), i < 4 | b's] */
static inline vec fold_halves(vec a, vec b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                         _mm256_permute2f128_ps(a, b, 0x31));
}
#endif
/* within each 4-lane quarter: [a0 + a2, a1 + a3, b0 + b2, b1 + b3] */
static inline vec fold_pairs(vec a, vec b) {
    return V(add_ps)(V(shuffle_ps)(a, b, 0x44), V(shuffle_ps)(a, b, 0xEE));
}
/* within each quarter: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] */
static inline vec fold_neighbours(vec a, vec b) {
    return V(add_ps)(V(shuffle_ps)(a, b, 0x88), V(shuffle_ps)(a, b, 0xDD));
}

static inline __attribute__((always_inline)) vec vsum_tile(const vec *s) {
#if VL == 16
    /* lane 4k + e comes from quarter k of the e-th vector the last folds combine: pair the
     * inputs so that it is s[4k + e] */
    vec y0 = fold_quarters(fold_halves(s[0], s[4]), fold_halves(s[8], s[12]));
    vec y1 = fold_quarters(fold_halves(s[1], s[5]), fold_halves(s[9], s[13]));
    vec y2 = fold_quarters(fold_halves(s[2], s[6]), fold_halves(s[10], s[14]));
    vec y3 = fold_quarters(fold_halves(s[3], s[7]), fold_halves(s[11], s[15]));
    return fold_neighbours(fold_pairs(y0, y1), fold_pairs(y2, y3));
#else
    return fold_neighbours(fold_pairs(fold_halves(s[0], s[4]), fold_halves(s[1], s[5])),
                           fold_pairs(fold_halves(s[2], s[6]), fold_halves(s[3], s[7])));
#endif
}

/* VL int8 values widened to float (int8 -> int32 -> float: exact). */
#if VL == 16
static inline vec load_i8(const signed char *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
static inline vec load_i8(const signed char *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* The next m <= VL rows of a walk (`bytes` each), PREFETCH ahead through `ahead`, as float
 * rows: rows[j] the cache's own (float32), or (int8: `scales` walks their scales) each
 * widened into wide[j] (D floats) with its scale in row_scale[j]. Rows past m repeat row 0
 * (scale 0), so a tile's arithmetic always runs VL wide; what they give is never stored. */
static inline __attribute__((always_inline)) void next_rows(
        const float **rows, float *wide, float *row_scale, walk_t *w, walk_t *ahead,
        walk_t *scales, walk_t *scales_ahead, int m, int D) {
    for (int j = 0; j < m; j++, walk_next(w)) {
        prefetch_walk(ahead, scales ? D : 4 * D);
        if (scales) prefetch_walk(scales_ahead, 4);
        if (!scales) {
            rows[j] = (const float *)w->row;
            continue;
        }
        for (int c = 0; c < D; c += VL)
            V(storeu_ps)(wide + j * D + c, load_i8((const signed char *)w->row + c));
        rows[j] = wide + j * D;
        row_scale[j] = *(const float *)scales->row;
        walk_next(scales);
    }
    for (int j = m; j < VL; j++) {
        rows[j] = rows[0];
        row_scale[j] = 0.0f;
    }
}

/* One work item for head size D = VL DV: `group` query heads q [group, D] sharing KV head
 * offset `head`, over positions [lo, seq_len) (lo > 0 under a sliding window: the blocks
 * before it are never read); writes out [group, D]. Scores above 0 in `cap` are soft-capped,
 * cap tanh(s / cap). scores: group x (seq_len - lo) floats of scratch.
 *
 * float32 caches (ks 0), or int8 ones (kv_quant.py) with their scales ks and vs (layout
 * `sat`, KV head offset `shead`): a row is widened to float once (int8 -> float: exact) and a
 * score is k_scale * (q . k), a V row's weight e * v_scale, as numba_decode.py's kernel does.
 *
 * Both passes go a tile of VL positions at a time. Scores: for each head, VL dot products
 * (DV multiply-adds each, one row after the other) and one vsum_tile for all VL of them,
 * where one vsum a position spent more shuffles than multiply-adds; each head re-reads the
 * tile's rows from L1. Weighted sum: each head adds the tile's rows into its DV accumulators
 * in position order. Every sum is added in the order of the row-at-a-time item below (the
 * same float32 results, bit for bit), which keeps all heads' accumulators live at once: 24
 * vectors for SmolLM2's 3 heads of 64 in AVX2, more than its 16 registers. AVX2 builds take
 * these tiles for float32 and int8 caches, AVX-512 builds for int8 only (see ROW_ITEM). */
#define ITEM(DV)                                                                            \
static void item_##DV(const float *q, const void *kc, const void *vc, const float *ks,      \
                      const float *vs, const int *table, int lo, int seq_len, layout_t at,  \
                      long head, layout_t sat, long shead, int group, float scale,          \
                      float cap, float *out, float *scores) {                               \
    enum { D = VL * (DV) };                                                                 \
    vec qv[MAX_GROUP][DV], acc[MAX_GROUP][DV], tops[MAX_GROUP];                             \
    float inverse[MAX_GROUP], wide[VL * D] __attribute__((aligned(64))), row_scale[VL];     \
    const float *rows[VL];                                                                  \
    int n = seq_len - lo, size = ks ? 1 : 4, ahead = ks ? PREFETCH_I8 : PREFETCH;           \
    for (int g = 0; g < group; g++) {                                                       \
        tops[g] = V(set1_ps)(-INFINITY);                                                    \
        for (int c = 0; c < DV; c++) {                                                      \
            qv[g][c] = V(mul_ps)(V(loadu_ps)(q + g * D + VL * c), V(set1_ps)(scale));       \
            acc[g][c] = V(setzero_ps)();                                                    \
        }                                                                                   \
    }                                                                                       \
    walk_t kw = walk_from(kc, table, at, head, lo, seq_len, size);                          \
    walk_t ka = walk_from(kc, table, at, head, lo + ahead, seq_len, size);                  \
    walk_t sw = walk_from(ks ? ks : q, table, sat, shead, lo, seq_len, 4);                  \
    walk_t sa = walk_from(ks ? ks : q, table, sat, shead, lo + ahead, seq_len, 4);          \
    for (int p = 0; p < n; p += VL) {                                                       \
        int m = n - p < VL ? n - p : VL;                                                    \
        next_rows(rows, wide, row_scale, &kw, &ka, ks ? &sw : 0, &sa, m, D);                \
        for (int g = 0; g < group; g++) {                                                   \
            vec s[VL];                                                                      \
            for (int j = 0; j < VL; j++) {                                                  \
                s[j] = V(mul_ps)(qv[g][0], V(loadu_ps)(rows[j]));                           \
                for (int c = 1; c < DV; c++)                                                \
                    s[j] = V(fmadd_ps)(qv[g][c], V(loadu_ps)(rows[j] + VL * c), s[j]);      \
            }                                                                               \
            vec t = vsum_tile(s);                                                           \
            if (ks) t = V(mul_ps)(V(loadu_ps)(row_scale), t);                               \
            if (m == VL && !(cap > 0.0f)) {                                                 \
                V(storeu_ps)(scores + g * n + p, t);                                        \
                tops[g] = V(max_ps)(tops[g], t);                                            \
                continue;                                                                   \
            }                                                                               \
            float lanes[VL];                                                                \
            V(storeu_ps)(lanes, t);                                                         \
            for (int j = 0; j < m; j++) {                                                   \
                float score = cap > 0.0f ? cap * tanhf(lanes[j] / cap) : lanes[j];          \
                scores[g * n + p + j] = score;                                              \
                lanes[j] = score;                                                           \
            }                                                                               \
            for (int j = m; j < VL; j++) lanes[j] = -INFINITY;                              \
            tops[g] = V(max_ps)(tops[g], V(loadu_ps)(lanes));                               \
        }                                                                                   \
    }                                                                                       \
    for (int g = 0; g < group; g++) {                                                       \
        float lanes[VL], top = -INFINITY;                                                   \
        V(storeu_ps)(lanes, tops[g]);                                                       \
        for (int j = 0; j < VL; j++) top = lanes[j] > top ? lanes[j] : top;                 \
        inverse[g] = softmax_row(scores + g * n, n, top);                                   \
    }                                                                                       \
    walk_t vw = walk_from(vc, table, at, head, lo, seq_len, size);                          \
    walk_t va = walk_from(vc, table, at, head, lo + ahead, seq_len, size);                  \
    sw = walk_from(vs ? vs : q, table, sat, shead, lo, seq_len, 4);                         \
    sa = walk_from(vs ? vs : q, table, sat, shead, lo + ahead, seq_len, 4);                 \
    for (int p = 0; p < n; p += VL) {                                                       \
        int m = n - p < VL ? n - p : VL;                                                    \
        next_rows(rows, wide, row_scale, &vw, &va, vs ? &sw : 0, &sa, m, D);                \
        for (int g = 0; g < group; g++) {                                                   \
            vec a[DV];                                                                      \
            const float *e = scores + g * n + p;                                            \
            for (int c = 0; c < DV; c++) a[c] = acc[g][c];                                  \
            for (int j = 0; j < m; j++) {                                                   \
                vec w = V(set1_ps)(vs ? e[j] * row_scale[j] : e[j]);                        \
                for (int c = 0; c < DV; c++)                                                \
                    a[c] = V(fmadd_ps)(w, V(loadu_ps)(rows[j] + VL * c), a[c]);             \
            }                                                                               \
            for (int c = 0; c < DV; c++) acc[g][c] = a[c];                                  \
        }                                                                                   \
    }                                                                                       \
    for (int g = 0; g < group; g++)                                                         \
        for (int c = 0; c < DV; c++)                                                        \
            V(storeu_ps)(out + g * D + VL * c, V(mul_ps)(acc[g][c], V(set1_ps)(inverse[g]))); \
}
/* Head sizes 16..128 in steps of 16, and 256. */
#if VL == 16
ITEM(1) ITEM(2) ITEM(3) ITEM(4) ITEM(5) ITEM(6) ITEM(7) ITEM(8) ITEM(16)
#else
ITEM(2) ITEM(4) ITEM(6) ITEM(8) ITEM(10) ITEM(12) ITEM(14) ITEM(16) ITEM(32)
#endif

typedef void (*item_fn)(const float *, const void *, const void *, const float *,
                        const float *, const int *, int, int, layout_t, long, layout_t, long,
                        int, float, float, float *, float *);

/* AVX-512 builds' float32 items: query heads [first, first + count) of one query row (all of
 * its heads unless there are too few rows for the threads, see decode_rows_heads), every KV
 * head they read in one walk. A chunk is one KV head's positions within one cache block (16
 * rows of D floats, contiguous in the head-major cache); the walk takes a block's chunks head
 * after head, then the next block's: with the cpu backend's [num_blocks, KVH, block_size, D]
 * a whole block, 12 x 4 KB for 12 KV heads of 64, is read front to back, where an item of one
 * KV head (as before) read 4 KB runs scattered over the cache, its hardware prefetch starting
 * cold at every block. Software prefetches (into L2) run CHUNKS_AHEAD chunks ahead, through
 * the K chunks and on into the V chunks.
 *
 * Within a chunk each query head's scores are those of the row-at-a-time arithmetic (scale q,
 * one vsum a position), each head's V sum goes position by position into its accumulators
 * (kept in scratch between chunks): per head the same operations in the same order as the
 * item of one KV head's group this replaced, so results are bit for bit its results, and do
 * not depend on how heads are split into items.
 *
 * Measured on the 2-vCPU AMD EPYC (Zen 4), benchmarks/decode_attention_ab.py (random caches
 * in 2 MB pages, layers' caches in turn, from memory), OMP_NUM_THREADS=1, CPU ms a layer, the
 * item of one KV head against this, 2026-12-04: 125M's geometry (12 heads over 12 KV heads of
 * 64), 32 x 256 positions: 2.88 -> 2.12 (24 GB/s, where a 1-thread streaming read gets 25.6);
 * 8 x 1024: 2.55 -> 2.09; SmolLM2's (9 over 3), 32 x 256: 0.80 -> 0.72. Without the software
 * prefetches 2.24 (32 x 256): the contiguous walk alone is most of the gain. Prefetch 1, 4 or
 * 8 chunks ahead: within noise of 2; into L1 (T0) 2.93; L3 (T2) the same as L2. From cache
 * (8 x 256, one layer): 0.33 -> 0.26 for 125M's, SmolLM2's within 5%. A tile of VL scores a
 * vsum_tile (as the int8 items) was slower here too: 0.29 against 0.26 from cache; so was
 * taking all of a KV head's query heads at each position (0.42: the runtime group's registers
 * spill). Taking them up to 4 at a time with the count fixed at compile time (a K or V row
 * loaded once for them) was mixed for 9 over 3, one run each: from cache 0.118 against 0.114,
 * from memory 0.66 against 0.69; not worth its code, so each head reads the chunk's rows from
 * L1 in turn. */
#if VL == 16
#ifndef CHUNKS_AHEAD
#define CHUNKS_AHEAD 2
#endif
/* The chunks of an item: K's then V's (for the prefetches), in bytes. Chunk c: block
 * lo / bs + c / kv_heads of the table, KV head c % kv_heads counted from `head`. */
typedef struct { const char *k, *v; const int *table; layout_t at; long head, head_stride;
                 int lo, seq_len, kv_heads, chunks, row_bytes; } chunks_t;

/* Positions [p0, p1) of chunk c (its block's, within [lo, seq_len)). */
static inline __attribute__((always_inline)) void chunk_span(const chunks_t *s, int c, int *p0,
                                                             int *p1) {
    int b = s->lo / s->at.bs + c / s->kv_heads;
    *p0 = b * s->at.bs > s->lo ? b * s->at.bs : s->lo;
    *p1 = (b + 1) * s->at.bs < s->seq_len ? (b + 1) * s->at.bs : s->seq_len;
}

/* The query heads [*i0, *i1) of an item's heads [first, first + count) that read chunk c's
 * KV head (kv0: the item's first KV head; group: query heads a KV head). */
static inline __attribute__((always_inline)) void chunk_heads(const chunks_t *s, int c, int kv0,
                                                              int group, int first, int count,
                                                              int *i0, int *i1) {
    int kv = kv0 + c % s->kv_heads;
    *i0 = kv * group - first > 0 ? kv * group - first : 0;
    *i1 = (kv + 1) * group - first < count ? (kv + 1) * group - first : count;
}

/* Position p's row of chunk c's KV head in `cache` (s->k or s->v). */
static inline __attribute__((always_inline)) const char *chunk_row(const chunks_t *s,
                                                                   const char *cache, int c,
                                                                   int p) {
    return cache + (long)s->table[p / s->at.bs] * s->at.block + (long)(p % s->at.bs) * s->at.pos
           + s->head + (long)(c % s->kv_heads) * s->head_stride;
}

/* Prefetch into L2 chunk c of K's chunks then V's (nothing past the last), all its rows at
 * once, each row's address from the block table again. Faster-issuing forms were slower from
 * memory on the Zen 4 EPYC, though faster from cache (one thread, 12 over 12 KV heads of 64, 32
 * x 256 positions, 12 layers' caches, CPU ms a layer against this form in the same run,
 * 2026-12-04): the rows' addresses stepped from the first row, 2.11 -> 2.60 (9 over 3: 0.71 ->
 * 1.04; from cache 0.95x); one row prefetched beside each row read (as the walks above), 2, 3,
 * 4 or 8 chunks ahead, 2.16-2.35 -> 2.48-2.65 (from cache 0.85x); only a row's first line,
 * 2.32 -> 2.49; none at all, 2.32 -> 2.45 (and 2.12 -> 2.24 in another run); NTA, 2.32 ->
 * 3.09. Why the slower issue wins is not known: what was measured is kept. */
static inline __attribute__((always_inline)) void prefetch_chunk(const chunks_t *s, int c) {
    if (c >= 2 * s->chunks) return;
    const char *cache = c < s->chunks ? s->k : s->v;
    c = c < s->chunks ? c : c - s->chunks;
    int p0, p1;
    chunk_span(s, c, &p0, &p1);
    for (int p = p0; p < p1; p++) {
        const char *row = chunk_row(s, cache, c, p);
        for (int l = 0; l < s->row_bytes; l += 64) _mm_prefetch(row + l, _MM_HINT_T1);
    }
}

/* Query heads [first, first + count) of row q (all its heads; out likewise) over positions
 * [lo, seq_len), scores above 0 soft-capped at cap. scratch: count x (2 D + 2 + seq_len - lo)
 * floats, 64-byte aligned. */
#define HEADS_ITEM(DV)                                                                      \
static void heads_item_##DV(const float *q, const float *kc, const float *vc,               \
                            const int *table, int lo, int seq_len, layout_t at,             \
                            long head_stride, int group, int first, int count, float scale, \
                            float cap, float *out, float *scratch) {                        \
    enum { D = VL * (DV) };                                                                 \
    int n = seq_len - lo, kv0 = first / group, kv_heads = (first + count - 1) / group + 1 - kv0; \
    /* per query head i = h - first: scaled q, V sums, top score, 1 / sum, scores */        \
    float *qs = scratch, *accs = qs + (long)count * D, *top = accs + (long)count * D;       \
    float *inverse = top + count, *scores = inverse + count;                                \
    for (int i = 0; i < count; i++) {                                                       \
        top[i] = -INFINITY;                                                                 \
        for (int j = 0; j < DV; j++) {                                                      \
            V(storeu_ps)(qs + i * D + VL * j,                                               \
                         V(mul_ps)(V(loadu_ps)(q + (first + i) * D + VL * j),               \
                                   V(set1_ps)(scale)));                                     \
            V(storeu_ps)(accs + i * D + VL * j, V(setzero_ps)());                           \
        }                                                                                   \
    }                                                                                       \
    int blocks = (seq_len - 1) / at.bs - lo / at.bs + 1;                                    \
    layout_t bytes = {at.bs, at.block * 4, at.pos * 4};                                     \
    chunks_t s = {(const char *)kc, (const char *)vc, table, bytes, kv0 * head_stride * 4,  \
                  head_stride * 4, lo, seq_len, kv_heads, blocks * kv_heads, D * 4};        \
    for (int c = 0; c < CHUNKS_AHEAD; c++) prefetch_chunk(&s, c);                           \
    for (int c = 0; c < s.chunks; c++) {                                                    \
        prefetch_chunk(&s, c + CHUNKS_AHEAD);                                               \
        int p0, p1, i0, i1;                                                                 \
        chunk_heads(&s, c, kv0, group, first, count, &i0, &i1);                             \
        chunk_span(&s, c, &p0, &p1);                                                        \
        const float *k0 = (const float *)chunk_row(&s, s.k, c, p0);                         \
        for (int i = i0; i < i1; i++) {                                                     \
            vec qv[DV];                                                                     \
            float t = top[i], *sc = scores + (long)i * n - lo;                              \
            const float *k = k0;                                                            \
            for (int j = 0; j < DV; j++) qv[j] = V(loadu_ps)(qs + i * D + VL * j);          \
            for (int p = p0; p < p1; p++, k += at.pos) {                                    \
                vec x = V(mul_ps)(qv[0], V(loadu_ps)(k));                                   \
                for (int j = 1; j < DV; j++)                                                \
                    x = V(fmadd_ps)(qv[j], V(loadu_ps)(k + VL * j), x);                     \
                float score = vsum(x);                                                      \
                if (cap > 0.0f) score = cap * tanhf(score / cap);                           \
                sc[p] = score;                                                              \
                t = score > t ? score : t;                                                  \
            }                                                                               \
            top[i] = t;                                                                     \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < count; i++)                                                         \
        inverse[i] = softmax_row(scores + (long)i * n, n, top[i]);                          \
    for (int c = 0; c < s.chunks; c++) {                                                    \
        prefetch_chunk(&s, s.chunks + c + CHUNKS_AHEAD);                                    \
        int p0, p1, i0, i1;                                                                 \
        chunk_heads(&s, c, kv0, group, first, count, &i0, &i1);                             \
        chunk_span(&s, c, &p0, &p1);                                                        \
        const float *v0 = (const float *)chunk_row(&s, s.v, c, p0);                         \
        for (int i = i0; i < i1; i++) {                                                     \
            vec a[DV];                                                                      \
            const float *e = scores + (long)i * n - lo, *v = v0;                            \
            for (int j = 0; j < DV; j++) a[j] = V(loadu_ps)(accs + i * D + VL * j);         \
            for (int p = p0; p < p1; p++, v += at.pos) {                                    \
                vec w = V(set1_ps)(e[p]);                                                   \
                for (int j = 0; j < DV; j++)                                                \
                    a[j] = V(fmadd_ps)(w, V(loadu_ps)(v + VL * j), a[j]);                   \
            }                                                                               \
            for (int j = 0; j < DV; j++) V(storeu_ps)(accs + i * D + VL * j, a[j]);         \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < count; i++)                                                         \
        for (int j = 0; j < DV; j++)                                                        \
            V(storeu_ps)(out + (first + i) * D + VL * j,                                    \
                         V(mul_ps)(V(loadu_ps)(accs + i * D + VL * j),                      \
                                   V(set1_ps)(inverse[i])));                                \
}
HEADS_ITEM(1) HEADS_ITEM(2) HEADS_ITEM(3) HEADS_ITEM(4) HEADS_ITEM(5) HEADS_ITEM(6)
HEADS_ITEM(7) HEADS_ITEM(8) HEADS_ITEM(16)

typedef void (*heads_fn)(const float *, const float *, const float *, const int *, int, int,
                         layout_t, long, int, int, int, float, float, float *, float *);

/* The heads item for a head size (0: none). */
static heads_fn heads_for(int head_dim) {
    switch (head_dim / VL * (head_dim % VL == 0)) {
#define CASE(DV) case DV: return heads_item_##DV;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(16)
#undef CASE
    default: return 0;
    }
}
#endif

/* The tile item for a head size (0: none): AVX2 builds' for float32 and int8 caches, AVX-512
 * builds' for int8 (their float32 caches take the heads items above). */
static item_fn item_for(int head_dim) {
    switch (head_dim / VL * (head_dim % VL == 0)) {
#if VL == 16
#define CASE(DV) case DV: return item_##DV;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(16)
#undef CASE
#else
    case 2: return item_2; case 4: return item_4; case 6: return item_6; case 8: return item_8;
    case 10: return item_10; case 12: return item_12; case 14: return item_14;
    case 16: return item_16; case 32: return item_32;
#endif
    default: return 0;
    }
}

/* Prefill chunks: rows r of one request's chunk at positions start + r (start = seq_len -
 * q_len), row r seeing positions 0..start + r. Row by row (the item above) each query row
 * reads its request's K and V again and reduces every score across a vector; here K is first
 * transposed once per call into kt [KVH][blocks of VL positions][D][VL], so a score vector is
 * VL positions' dot products from D multiply-adds with no reduction, and an item takes QV
 * query vectors (rows x heads of one KV head) at once: each K column and V row is loaded once
 * for all of them, QV x DV sums held in registers in the second pass. Two passes as above:
 * scores, softmax per query vector, then the weighted sum of V.
 *
 * AVX-512 builds only: the second pass's sums need registers that AVX2's 16 do not have (an
 * item of one query vector there; built for AVX2 and run on the Xeon it took 5.0 ms for a
 * 512-token prompt's layer against SDPA's 2.8 and the rows' 4.35), so AVX2 machines keep the
 * rows for short chunks and SDPA for long ones (cpu_attention.py). */
#if VL == 16
#define TIDAL_PREFILL_ATTENTION 1
#define PREFILL_REGISTERS 24
#define PREFILL_QV(DV) (PREFILL_REGISTERS / (DV) > 0 ? PREFILL_REGISTERS / (DV) : 1)

/* The largest of row[0..len), len >= 1. */
static inline float row_max(const float *row, int len) {
    vec m = V(set1_ps)(-INFINITY);
    int p = 0;
    for (; p + VL <= len; p += VL) m = V(max_ps)(m, V(loadu_ps)(row + p));
    float lanes[VL], top = -INFINITY;
    V(storeu_ps)(lanes, m);
    for (int i = 0; i < VL; i++) top = lanes[i] > top ? lanes[i] : top;
    for (; p < len; p++) top = row[p] > top ? row[p] : top;
    return top;
}

#define PREFILL_ITEM(DV)                                                                    \
static void prefill_##DV(const float *const *qs, float *const *outs, const int *limits,    \
                         int nq, const float *kt, const float *vc, const int *table,        \
                         layout_t at, long head, float scale, float *scores, int stride,    \
                         int window, float cap) {                                           \
    enum { QV = PREFILL_QV(DV), D = VL * (DV) };                                            \
    /* the item's query vectors times scale; past nq, copies of the last (computed, never  \
     * written), so every loop below runs QV wide */                                        \
    float qb[QV][D] __attribute__((aligned(64)));                                           \
    int len = 0;                                                                            \
    for (int v = 0; v < QV; v++) {                                                          \
        const float *src = qs[v < nq ? v : nq - 1];                                         \
        for (int d = 0; d < D; d++) qb[v][d] = src[d] * scale;                              \
    }                                                                                       \
    for (int v = 0; v < nq; v++) len = limits[v] + 1 > len ? limits[v] + 1 : len;          \
    /* vector v sees [lows[v], limits[v]] (a sliding window); scores from the VL-block of  \
     * the lowest, V rows from the lowest itself (earlier cache blocks may be freed) */     \
    int lows[QV], low = len;                                                                \
    for (int v = 0; v < nq; v++) {                                                          \
        lows[v] = window > 0 && limits[v] + 1 > window ? limits[v] + 1 - window : 0;        \
        low = lows[v] < low ? lows[v] : low;                                                \
    }                                                                                       \
    int from = low / VL * VL;                                                               \
    for (int b = from / VL; b * VL < len; b++) {                                            \
        const float *kb = kt + (long)b * D * VL;                                            \
        vec s[QV];                                                                          \
        for (int v = 0; v < QV; v++) s[v] = V(setzero_ps)();                                \
        for (int d = 0; d < D; d++) {                                                       \
            vec kd = V(loadu_ps)(kb + d * VL);                                              \
            for (int v = 0; v < QV; v++) s[v] = V(fmadd_ps)(V(set1_ps)(qb[v][d]), kd, s[v]); \
        }                                                                                   \
        for (int v = 0; v < nq; v++) V(storeu_ps)(scores + v * stride + b * VL, s[v]);     \
    }                                                                                       \
    float inverse[QV];                                                                      \
    for (int v = 0; v < nq; v++) {                                                          \
        float *row = scores + v * stride;                                                   \
        int lo = lows[v], n = limits[v] + 1 - lo;                                           \
        if (cap > 0.0f)                                                                     \
            for (int p = lo; p <= limits[v]; p++) row[p] = cap * tanhf(row[p] / cap);       \
        float top = row_max(row + lo, n);                                                   \
        inverse[v] = softmax_row(row + lo, n, top);                                         \
        for (int p = low; p < lo; p++) row[p] = 0.0f;                                       \
        for (int p = limits[v] + 1; p < len; p++) row[p] = 0.0f;                            \
    }                                                                                       \
    for (int v = nq; v < QV; v++) { /* the copies: weights 0 */                             \
        inverse[v] = 0.0f;                                                                  \
        for (int p = low; p < len; p++) scores[v * stride + p] = 0.0f;                      \
    }                                                                                       \
    vec acc[QV][DV];                                                                        \
    for (int v = 0; v < QV; v++)                                                            \
        for (int c = 0; c < DV; c++) acc[v][c] = V(setzero_ps)();                           \
    walk_t vw = walk_from(vc, table, at, head, low, len, 4);                                \
    walk_t va = walk_from(vc, table, at, head, low + PREFETCH, len, 4);                     \
    for (int p = low; p < len; p++, walk_next(&vw)) {                                       \
        prefetch_walk(&va, 4 * D);                                                          \
        const float *vr = (const float *)vw.row;                                            \
        vec vv[DV];                                                                         \
        for (int c = 0; c < DV; c++) vv[c] = V(loadu_ps)(vr + VL * c);                      \
        for (int v = 0; v < QV; v++) {                                                      \
            vec w = V(set1_ps)(scores[v * stride + p]);                                     \
            for (int c = 0; c < DV; c++) acc[v][c] = V(fmadd_ps)(w, vv[c], acc[v][c]);      \
        }                                                                                   \
    }                                                                                       \
    for (int v = 0; v < nq; v++)                                                            \
        for (int c = 0; c < DV; c++)                                                        \
            V(storeu_ps)(outs[v] + VL * c, V(mul_ps)(acc[v][c], V(set1_ps)(inverse[v])));   \
}
PREFILL_ITEM(1) PREFILL_ITEM(2) PREFILL_ITEM(3) PREFILL_ITEM(4) PREFILL_ITEM(5)
PREFILL_ITEM(6) PREFILL_ITEM(7) PREFILL_ITEM(8) PREFILL_ITEM(16)

typedef void (*prefill_fn)(const float *const *, float *const *, const int *, int,
                           const float *, const float *, const int *, layout_t, long, float,
                           float *, int, int, float);

/* (function, query vectors an item takes) for a head size, or (0, 0). */
static prefill_fn prefill_for(int head_dim, int *qv) {
    switch (head_dim / VL * (head_dim % VL == 0)) {
#define CASE(DV) case DV: *qv = PREFILL_QV(DV); return prefill_##DV;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(16)
#undef CASE
    default: *qv = 0; return 0;
    }
}
#else
#define TIDAL_PREFILL_ATTENTION 0
#endif /* VL == 16 */
#else
#define TIDAL_DECODE_ATTENTION 0
#define TIDAL_PREFILL_ATTENTION 0
#endif

/* 1 where this build has the blocked prefill kernel (AVX-512), else 0. */
int tidal_prefill_attention_available(void) { return TIDAL_PREFILL_ATTENTION; }

/* 1 where this build has the kernel (compiled for a CPU with AVX-512, or AVX2 and FMA), else 0. */
int tidal_decode_attention_available(void) { return TIDAL_DECODE_ATTENTION; }

/* 1 where tidal_decode_attention takes this head size (16..128 in steps of 16, or 256). */
int tidal_decode_attention_head_dim_ok(int head_dim) {
#if TIDAL_DECODE_ATTENTION
    return item_for(head_dim) != 0;
#else
    (void)head_dim;
    return 0;
#endif
}

/* Rows whose (key position, head) pairs are fewer run on the calling thread alone (each item
 * is the same arithmetic on any thread: results do not change): there a region's wake-up of
 * the other threads costs about what it saves on a quiet machine, and on one shared with
 * other processes far more. Per-part times of SmolLM2's 30 layers on the 2-vCPU AVX2 EPYC
 * (`benchmarks/verify_step.py --parts`, 1 request at ~200 positions, 9 heads, 2026-12-04):
 * its 1-row decode steps (1,800 pairs a layer) spent a median 6.7 ms a step in this kernel
 * at load ~4 with OpenMP's default wait policy, 1.1 ms on one thread; but 5-row steps (9,000
 * pairs) took 3.3 ms with spinning threads (OMP_WAIT_POLICY=ACTIVE) against 5.3 ms on one,
 * so they stay split. */
#define ROWS_PARALLEL_WORK 4096

/* Items a thread, at least, where the rows are too few for one item each (decode_rows_heads):
 * lengths vary, and with dynamic scheduling a thread's last item is what the others may wait
 * for. */
#define ITEMS_PER_THREAD 4

#if TIDAL_DECODE_ATTENTION && VL == 16
#ifdef _OPENMP
#include <omp.h>
#endif
/* decode_rows over float32 caches in an AVX-512 build: the heads items, one a row (all its
 * heads) or, where rows are fewer than ITEMS_PER_THREAD a thread, each row's heads in parts of
 * whole KV heads' groups (of MAX_GROUP heads where a group is larger) so that each thread has
 * items, as far as the KV heads go. */
static int decode_rows_heads(const float *q, const void *key_cache, const void *value_cache,
                             const int *tables, long max_blocks, const int *lens,
                             const long *requests, const long *rows, long n, int num_heads,
                             int num_kv_heads, int head_dim, layout_t at, long head_stride,
                             float scale, int window, float soft_cap, float *out) {
    heads_fn item = heads_for(head_dim);
    int group = num_heads / num_kv_heads, threads = 1, failed = 0;
    long work = 0; /* (key position, head) pairs: the rows' arithmetic */
    for (long r = 0; r < n; r++) work += (long)lens[r] * num_heads;
#ifdef _OPENMP
    if (work >= ROWS_PARALLEL_WORK) threads = omp_get_max_threads();
#endif
    int parts = 1, per = num_heads; /* items a row, query heads an item */
    if (threads > 1 && n < (long)ITEMS_PER_THREAD * threads) {
        parts = (int)((ITEMS_PER_THREAD * threads + n - 1) / n);
        parts = parts < num_heads ? parts : num_heads;
        per = (num_heads + parts - 1) / parts;
        /* no finer than a KV head's group (or MAX_GROUP of it, as the other items): a part
         * with a few of a group's heads would read its KV head again for the others */
        int least = group < MAX_GROUP ? group : MAX_GROUP;
        per = per > least ? per : least;
        if (per >= group) per = (per + group - 1) / group * group;
        parts = (num_heads + per - 1) / per;
    }
    long items = n * parts;
    #pragma omp parallel if (threads > 1)
    {
        float *scratch = 0;
        long capacity = 0;
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < items; i++) {
            long r = i / parts, row = rows[r];
            int first = (int)(i % parts) * per;
            int count = num_heads - first < per ? num_heads - first : per;
            int seq_len = lens[r], lo = window > 0 && seq_len > window ? seq_len - window : 0;
            long need = (long)count * (2 * head_dim + 2 + seq_len - lo);
            if (need > capacity) {
                free(scratch);
                capacity = (need + 15) / 16 * 16;
                scratch = aligned_alloc(64, capacity * sizeof(float));
                if (!scratch) { capacity = 0; failed = 1; continue; }
            }
            item(q + row * num_heads * head_dim, key_cache, value_cache,
                 tables + requests[r] * max_blocks, lo, seq_len, at, head_stride, group, first,
                 count, scale, soft_cap, out + row * num_heads * head_dim, scratch);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}
#endif

#if TIDAL_DECODE_ATTENTION
/* The work items of tidal_decode_attention_window and _int8 (ks and vs 0: float32 caches),
 * split between the threads. */
static int decode_rows(const float *q, const void *key_cache, const void *value_cache,
                       const float *ks, const float *vs, const int *tables, long max_blocks,
                       const int *lens, const long *requests, const long *rows, long n,
                       int num_heads, int num_kv_heads, int head_dim, layout_t at,
                       long head_stride, layout_t sat, long scale_head, float scale,
                       int window, float soft_cap, float *out) {
    item_fn item = item_for(head_dim);
    if (!item) return -1;
#if VL == 16
    if (!ks)
        return decode_rows_heads(q, key_cache, value_cache, tables, max_blocks, lens, requests,
                                 rows, n, num_heads, num_kv_heads, head_dim, at, head_stride,
                                 scale, window, soft_cap, out);
#endif
    int group = num_heads / num_kv_heads;
    int parts = (group + MAX_GROUP - 1) / MAX_GROUP; /* items per KV head */
    long items = n * num_kv_heads * parts;
    int failed = 0;
    long work = 0; /* (key position, head) pairs: the rows' arithmetic */
    for (long r = 0; r < n; r++) work += (long)lens[r] * num_heads;
    #pragma omp parallel if (work >= ROWS_PARALLEL_WORK)
    {
        float *scores = 0;
        long capacity = 0;
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < items; i++) {
            long request = requests[i / (num_kv_heads * parts)];
            long row = rows[i / (num_kv_heads * parts)];
            int kv_head = (int)(i / parts % num_kv_heads), part = (int)(i % parts);
            int first = kv_head * group + part * MAX_GROUP;
            int heads = group - part * MAX_GROUP < MAX_GROUP ? group - part * MAX_GROUP : MAX_GROUP;
            int seq_len = lens[i / (num_kv_heads * parts)];
            int lo = window > 0 && seq_len > window ? seq_len - window : 0;
            if ((long)heads * (seq_len - lo) > capacity) {
                free(scores);
                capacity = (long)heads * (seq_len - lo);
                scores = malloc(capacity * sizeof(float));
                if (!scores) { capacity = 0; failed = 1; continue; }
            }
            item(q + (row * num_heads + first) * head_dim, key_cache, value_cache, ks, vs,
                 tables + request * max_blocks, lo, seq_len, at, kv_head * head_stride, sat,
                 kv_head * scale_head, heads, scale, soft_cap,
                 out + (row * num_heads + first) * head_dim, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
#endif

/* Attend query row rows[i] over the first lens[i] >= 1 positions of request requests[i] (a
 * row of tables), i < n, of those only the last `window` when window > 0 (the rows'
 * sliding window: blocks before it are never read), scores soft-capped at soft_cap when it is
 * above 0; writes those rows of out. Returns 0, or -1 for a head size it does not take (out
 * untouched) or -2 when scratch could not be allocated. */
int tidal_decode_attention_window(const float *q, const float *key_cache,
                                  const float *value_cache, const int *tables, long max_blocks,
                                  const int *lens, const long *requests, const long *rows,
                                  long n, int num_heads, int num_kv_heads, int head_dim,
                                  int block_size, long block_stride, long pos_stride,
                                  long head_stride, float scale, int window, float soft_cap,
                                  float *out) {
#if TIDAL_DECODE_ATTENTION
    layout_t at = {block_size, block_stride, pos_stride};
    return decode_rows(q, key_cache, value_cache, 0, 0, tables, max_blocks, lens, requests,
                       rows, n, num_heads, num_kv_heads, head_dim, at, head_stride, at, 0,
                       scale, window, soft_cap, out);
#else
    (void)q; (void)key_cache; (void)value_cache; (void)tables; (void)max_blocks;
    (void)lens; (void)requests; (void)rows; (void)n; (void)num_heads; (void)num_kv_heads;
    (void)head_dim; (void)block_size; (void)block_stride; (void)pos_stride; (void)head_stride;
    (void)scale; (void)window; (void)soft_cap; (void)out;
    return -1;
#endif
}

/* tidal_decode_attention_window over an int8 cache (kv_cache_dtype int8, kv_quant.py):
 * key_cache / value_cache int8 rows (strides in elements, as the float32 caches'), key_scales /
 * value_scales their float32 scales, one per (position, KV head) (strides scale_block,
 * scale_pos, scale_head in floats). Returns as tidal_decode_attention_window does. */
int tidal_decode_attention_int8(const float *q, const signed char *key_cache,
                                const signed char *value_cache, const float *key_scales,
                                const float *value_scales, const int *tables, long max_blocks,
                                const int *lens, const long *requests, const long *rows, long n,
                                int num_heads, int num_kv_heads, int head_dim, int block_size,
                                long block_stride, long pos_stride, long head_stride,
                                long scale_block, long scale_pos, long scale_head, float scale,
                                int window, float soft_cap, float *out) {
#if TIDAL_DECODE_ATTENTION
    layout_t at = {block_size, block_stride, pos_stride};
    layout_t sat = {block_size, scale_block, scale_pos};
    return decode_rows(q, key_cache, value_cache, key_scales, value_scales, tables, max_blocks,
                       lens, requests, rows, n, num_heads, num_kv_heads, head_dim, at,
                       head_stride, sat, scale_head, scale, window, soft_cap, out);
#else
    (void)q; (void)key_cache; (void)value_cache; (void)key_scales; (void)value_scales;
    (void)tables; (void)max_blocks; (void)lens; (void)requests; (void)rows; (void)n;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size; (void)block_stride;
    (void)pos_stride; (void)head_stride; (void)scale_block; (void)scale_pos; (void)scale_head;
    (void)scale; (void)window; (void)soft_cap; (void)out;
    return -1;
#endif
}

/* tidal_decode_attention_window without a window or a cap (the fused decoder layers' call). */
int tidal_decode_attention(const float *q, const float *key_cache, const float *value_cache,
                           const int *tables, long max_blocks, const int *lens,
                           const long *requests, const long *rows, long n, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, long block_stride,
                           long pos_stride, long head_stride, float scale, float *out) {
    return tidal_decode_attention_window(q, key_cache, value_cache, tables, max_blocks, lens,
                                         requests, rows, n, num_heads, num_kv_heads, head_dim,
                                         block_size, block_stride, pos_stride, head_stride,
                                         scale, 0, 0.0f, out);
}

/* One prefill chunk of one request: q_len query rows q[q_row0 + r] at positions seq_len -
 * q_len + r, each over the positions up to its own (the last `window` of them when window >
 * 0: blocks wholly before the first row's window are neither transposed nor read), K and V
 * read through `table` (the request's block-table row), scores soft-capped at soft_cap when
 * it is above 0; writes those rows of out. Returns 0, -1 for a head size it does not take or
 * a build without it (out untouched), -2 when scratch could not be allocated. */
int tidal_prefill_attention_window(const float *q, const float *key_cache,
                                   const float *value_cache, const int *table, int q_len,
                                   int seq_len, long q_row0, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, long block_stride,
                                   long pos_stride, long head_stride, float scale, int window,
                                   float soft_cap, float *out) {
#if TIDAL_PREFILL_ATTENTION
    int qv;
    prefill_fn item = prefill_for(head_dim, &qv);
    if (!item) return -1;
    int group = num_heads / num_kv_heads, start = seq_len - q_len;
    layout_t at = {block_size, block_stride, pos_stride};
    long blocks = (seq_len + VL - 1) / VL, block_floats = (long)head_dim * VL;
    /* the first row's first visible position: cache blocks before it may be freed */
    long low = window > 0 && start + 1 > window ? start + 1 - window : 0;
    float *kt = aligned_alloc(64, (size_t)num_kv_heads * blocks * block_floats * sizeof(float));
    if (!kt) return -2;
    int vectors = q_len * group, per_head = (vectors + qv - 1) / qv;
    int stride = (int)(blocks * VL), failed = 0;
    #pragma omp parallel
    {
        /* K transposed: kt[h][b][d][j] = K[position b VL + j][h][d], zeros past seq_len and
         * before `low` (VL-blocks wholly before it are left unwritten: never read) */
        #pragma omp for schedule(static)
        for (long hb = 0; hb < num_kv_heads * blocks; hb++) {
            long h = hb / blocks, b = hb % blocks;
            float *dst = kt + hb * block_floats;
            if ((b + 1) * VL <= low) continue;
            for (int j = 0; j < VL; j++) {
                long p = b * VL + j;
                const float *k = p < seq_len && p >= low
                    ? row_at(key_cache, table, (int)p, at, h * head_stride) : 0;
                for (int d = 0; d < head_dim; d++) dst[d * VL + j] = k ? k[d] : 0.0f;
            }
        }
        float *scores = malloc((size_t)qv * stride * sizeof(float));
        if (!scores) failed = 1;
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < (long)num_kv_heads * per_head; i++) {
            if (!scores) continue;
            int h = (int)(i / per_head), first = (int)(i % per_head) * qv;
            int nq = vectors - first < qv ? vectors - first : qv;
            const float *qs[32];
            float *outs[32];
            int limits[32];
            for (int v = 0; v < nq; v++) {
                int r = (first + v) / group, g = (first + v) % group;
                long at = ((q_row0 + r) * num_heads + (long)h * group + g) * head_dim;
                qs[v] = q + at;
                outs[v] = out + at;
                limits[v] = start + r;
            }
            item(qs, outs, limits, nq, kt + (long)h * blocks * block_floats, value_cache,
                 table, at, (long)h * head_stride, scale, scores, stride, window, soft_cap);
        }
        free(scores);
    }
    free(kt);
    return failed ? -2 : 0;
#else
    (void)q; (void)key_cache; (void)value_cache; (void)table; (void)q_len; (void)seq_len;
    (void)q_row0; (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size;
    (void)block_stride; (void)pos_stride; (void)head_stride; (void)scale; (void)window;
    (void)soft_cap; (void)out;
    return -1;
#endif
}

/* tidal_prefill_attention_window without a window or a cap (the fused decoder layers' call). */
int tidal_prefill_attention(const float *q, const float *key_cache, const float *value_cache,
                            const int *table, int q_len, int seq_len, long q_row0,
                            int num_heads, int num_kv_heads, int head_dim, int block_size,
                            long block_stride, long pos_stride, long head_stride, float scale,
                            float *out) {
    return tidal_prefill_attention_window(q, key_cache, value_cache, table, q_len, seq_len,
                                          q_row0, num_heads, num_kv_heads, head_dim, block_size,
                                          block_stride, pos_stride, head_stride, scale, 0, 0.0f,
                                          out);
}

/* Write token t's K and V rows (num_kv_heads x head_dim floats each, strides in floats: token,
 * head; head_dim contiguous) into cache slot slots[t] (position slots[t] % block_size of
 * block slots[t] / block_size; the caches' strides as tidal_decode_attention's), for t < n;
 * a slot < 0 is skipped. Returns -1, or the first t whose slot is num_slots or more (then
 * nothing is written). A loop of row copies (one step's K/V are at most a few MB), split
 * between the threads: the copies are nothing, but where a block is written for the first
 * time its pages fault in here, and on a VM whose host backs memory at first touch a fault
 * costs ~10 us (a 2048-token prefill chunk of SmolLM2 takes ~25k of them, a decode step of 28
 * requests ~300). Measured on the 2-vCPU AMD EPYC (Zen 4), SmolLM2's offline run (64
 * sharegpt-like requests, tidal alone), one thread against two: its six 2048-token steps
 * 17.8 / 17.6 s against 16.1 / 16.0 s, walls 37.1 / 38.1 s against 36.1 / 35.3 s; splitting
 * decode steps too (any step of 8 or more tokens, not 64 or more) took its decode steps
 * from 18.8 / 18.6 s to 18.6 / 18.1 s. A step of fewer tokens (one request verifying its
 * drafts) writes on one thread: its region's wake-up of the other thread, on the same VM
 * shared with other processes, cost a median 18 ms a step over 30 layers against 0.1 ms for
 * the copies (`benchmarks/verify_step.py --parts`, 2026-12-04). */
#define WRITE_KV_PARALLEL 8
long tidal_write_kv(const float *key, const float *value, long key_token, long key_head,
                    long value_token, long value_head, float *key_cache, float *value_cache,
                    const long *slots, long n, int num_kv_heads, int head_dim, int block_size,
                    long num_slots, long block_stride, long pos_stride, long head_stride) {
    for (long t = 0; t < n; t++)
        if (slots[t] >= num_slots) return t;
    #pragma omp parallel for schedule(static) if (n >= WRITE_KV_PARALLEL)
    for (long t = 0; t < n; t++) {
        long slot = slots[t];
        if (slot < 0) continue;
        long at = slot / block_size * block_stride + slot % block_size * pos_stride;
        for (int h = 0; h < num_kv_heads; h++) {
            float *k = key_cache + at + h * head_stride, *v = value_cache + at + h * head_stride;
            const float *ks = key + t * key_token + h * key_head;
            const float *vs = value + t * value_token + h * value_head;
            for (int d = 0; d < head_dim; d++) k[d] = ks[d];
            for (int d = 0; d < head_dim; d++) v[d] = vs[d];
        }
    }
    return -1;
}

/* tidal_write_kv into an int8 cache (kv_quant.py): each (token, KV head) row of head_dim floats
 * x stored as round(x / s) (to nearest, ties to even; within [-127, 127]) with its scale s =
 * max|x| / 127 in the scale tensors (strides scale_block, scale_pos, scale_head in floats), an
 * all-zero row as zeros with scale 0: bit for bit kv_quant.quantize's float32 arithmetic
 * (x * (1 / s), the reciprocal rounded first). Where torch's ops took 10 calls a layer (abs,
 * amax, the reciprocal, round, clamp, cast, two scatters, for K and again for V), this is one.
 * Returns as tidal_write_kv does. Its loop is tidal_write_kv's written out again on purpose:
 * sharing it would take a macro with statement arguments or a per-row callback that the
 * OpenMP-outlined loop need not inline; only the slot check could be a plain function. */
static inline void quantize_row(const float *x, int head_dim, signed char *q, float *scale) {
    float top = 0.0f;
    for (int d = 0; d < head_dim; d++) top = fabsf(x[d]) > top ? fabsf(x[d]) : top;
    float s = top / 127.0f, inverse = s > 0.0f ? 1.0f / s : 0.0f;
    for (int d = 0; d < head_dim; d++) {
        float r = nearbyintf(x[d] * inverse);
        q[d] = (signed char)(r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r);
    }
    *scale = s;
}

long tidal_write_kv_int8(const float *key, const float *value, long key_token, long key_head,
                         long value_token, long value_head, signed char *key_cache,
                         signed char *value_cache, float *key_scales, float *value_scales,
                         const long *slots, long n, int num_kv_heads, int head_dim,
                         int block_size, long num_slots, long block_stride, long pos_stride,
                         long head_stride, long scale_block, long scale_pos, long scale_head) {
    for (long t = 0; t < n; t++)
        if (slots[t] >= num_slots) return t;
    #pragma omp parallel for schedule(static) if (n >= WRITE_KV_PARALLEL)
    for (long t = 0; t < n; t++) {
        long slot = slots[t];
        if (slot < 0) continue;
        long block = slot / block_size, offset = slot % block_size;
        long at = block * block_stride + offset * pos_stride;
        long scale_at = block * scale_block + offset * scale_pos;
        for (int h = 0; h < num_kv_heads; h++) {
            quantize_row(key + t * key_token + h * key_head, head_dim,
                         key_cache + at + h * head_stride, key_scales + scale_at + h * scale_head);
            quantize_row(value + t * value_token + h * value_head, head_dim,
                         value_cache + at + h * head_stride,
                         value_scales + scale_at + h * scale_head);
        }
    }
    return -1;
}
