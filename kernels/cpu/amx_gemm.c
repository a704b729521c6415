/* y[M, N] = x[M, K] W^T (op 1: + other, op 2: * other) on Intel AMX, for a weight made of
 * GGUF blocks: every run of 32 k of a column exactly d q + m (Q4_1: q in 0..15, d and m
 * float16 values) or d q (Q8_0: q in -128..127): a de-quantized GGUF model's linear layers
 * (SmolLM2 in this project's benchmarks) in prefill chunks and large decode batches. Built
 * and loaded by amx_gemm.py.
 *
 * AMX multiplies bfloat16 tiles into float32 sums (TDPBF16PS). Neither x nor the float32
 * weight is bfloat16, but both sides can be made exact:
 *
 *   - q is a small integer: exactly a bfloat16 (8 significant bits hold -128..127).
 *   - x = x1 + x2 + x3 exactly, each a bfloat16: x1 is x with its low 16 bits cleared (its top
 *     8 significant bits), x2 the same of x - x1, x3 = x - x1 - x2, which has at most 8
 *     significant bits left. Each subtraction is exact in float32. (A part below float32's
 *     normal range, from an input under ~1e-33, is flushed to zero by the tile unit: an error
 *     far below the sum's own rounding.)
 *
 * so over one run b of 32 k, sum_k x[k] w[n, k] = d[n, b] (sum_k x1 q + x2 q + x3 q)
 * + m[n, b] sum_k x[k]: three tile products of exact bfloat16 values (each product exact in
 * float32: 8 x 8 bits) summed in float32, scaled by d per column and run, plus the run's sum
 * of x times m. The weights are the same float32 values as the layer's (pack checks that
 * d q + m is exact for every one); only the order and grouping of the float32 additions differ
 * from F.linear's, as between any two GEMM libraries.
 *
 * Packing (tidal_amx_pack, once at load): column tile c (16 columns), run b is one B tile,
 * [16][32] bfloat16: row p holds, for each column n, q[n][2p] and q[n][2p + 1] side by side
 * (TDPBF16PS pairs k two by two). Tiles of a column tile follow one another over b, so a
 * column tile's weights are one stream. 4-bit q are stored as nibbles (256 bytes a tile) and
 * widened to bfloat16 per column pair and call (widen_tile): a quarter of the bytes read;
 * 8-bit q as bfloat16. d as [N / 16][K / 32][16] floats, m as tiles of its own (below).
 *
 * Why: SmolLM2's prefill spent 75% of its time in these GEMMs, and float32 on AVX-512 runs at
 * ~400 GFLOP/s on this project's 2-vCPU Xeon, where AMX multiplies bfloat16 at ~2500 (oneDNN,
 * same shapes). With three products a weight and the scaling, SmolLM2's layer shapes run at
 * 590-810 GFLOP/s here (benchmarks/archive/BENCHMARKS.md, "AMX for a GGUF's weights").
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TIDAL_AMX 1

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Rows of x a tile holds. A row tile's sums over two column tiles are 2 x RT float32
 * vectors, held in registers (the compiler spills a few of the 32). SmolLM2's four layer
 * shapes at 512 rows, two threads: 5.25 ms with the scaling below software-pipelined, 6.6-7.0
 * with each run's products scaled as soon as stored (the vector loads then wait on the tile
 * store, and the tiles on the vector loads), 7.6 with 12-row tiles and no spills. */
#define RT 16

/* The tile registers: 0-2 the three bfloat16 parts of RT rows of x over one run, 3 and 6 the
 * run's B tiles of two column tiles, 4 and 5 their sums. */
typedef struct {
    unsigned char palette_id, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 7; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t == 3 || t == 6 ? 16 : RT;
    }
    _tile_loadconfig(&cfg);
}

/* The bfloat16 parts of x, [Mp / RT][runs][3][RT][32] with Mp = M rounded up to RT (zero
 * rows): a row tile's three parts of a run are 3 RT 64-byte rows one after the other. And of
 * its sums over each run, [3][Mp][Rp] (Rp: the runs rounded up to 32, zeros after). Kept
 * between calls and grown as needed (a prefill's 4.7 MB allocated afresh each call costs its
 * page faults each call); a worker calls from one thread at a time. */
static unsigned short *parts, *sum_parts, *expanded;
static size_t parts_size, sum_parts_size, expanded_size;

static int reserve(long Mp, long K, long Rp) {
    size_t need = (size_t)3 * Mp * K, need_sums = (size_t)3 * Mp * Rp;
    size_t need_expanded = (size_t)omp_get_max_threads() * 2 * (K / 32) * 512;
    if (need_expanded > expanded_size) {
        free(expanded);
        expanded = aligned_alloc(64, need_expanded * 2);
        expanded_size = expanded ? need_expanded : 0;
    }
    if (need > parts_size) {
        free(parts);
        parts = aligned_alloc(64, need * 2);
        parts_size = parts ? need : 0;
    }
    if (need_sums > sum_parts_size) {
        free(sum_parts);
        sum_parts = aligned_alloc(64, need_sums * 2);
        sum_parts_size = sum_parts ? need_sums : 0;
    }
    return parts != NULL && sum_parts != NULL && expanded != NULL;
}

/* 16 floats -> their top 16 bits (bfloat16 by truncation). */
static inline __m256i top_halves(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}

/* v = v1 + v2 + v3 exactly, each a bfloat16 (stored at p1, p2, p3). */
static inline void split3(__m512 v, unsigned short *p1, unsigned short *p2, unsigned short *p3) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 v1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), high));
    __m512 r1 = _mm512_sub_ps(v, v1);
    __m512 v2 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), high));
    _mm256_storeu_si256((__m256i *)p1, top_halves(v1));
    _mm256_storeu_si256((__m256i *)p2, top_halves(v2));
    _mm256_storeu_si256((__m256i *)p3, top_halves(_mm512_sub_ps(r1, v2)));
}

/* Each row of x into its three parts and, with `sums`, its run sums into theirs. */
static void split_rows(const float *x, long M, long Mp, long K, long Rp, int sums) {
    long runs = K / 32;
    unsigned short *s1 = sum_parts, *s2 = s1 + Mp * Rp, *s3 = s2 + Mp * Rp;
    #pragma omp for schedule(static)
    for (long i = 0; i < Mp; i++) {
        float row_sums[Rp];
        for (long k = 0; k < K; k += 32) {
            float run = 0.0f;
            for (long h = k; h < k + 32; h += 16) {
                __m512 v = i < M ? _mm512_loadu_ps(x + i * K + h) : _mm512_setzero_ps();
                unsigned short *at = parts + (((i / RT) * runs + k / 32) * 3 * RT + i % RT) * 32 + (h - k);
                split3(v, at, at + RT * 32, at + 2 * RT * 32);
                run += _mm512_reduce_add_ps(v);
            }
            row_sums[k / 32] = run;
        }
        if (!sums) continue;
        for (long r = K / 32; r < Rp; r++) row_sums[r] = 0.0f;
        for (long r = 0; r < Rp; r += 16)
            split3(_mm512_loadu_ps(row_sums + r), s1 + i * Rp + r, s2 + i * Rp + r, s3 + i * Rp + r);
    }
}

/* A 4-bit B tile (256 bytes: byte j holds tile element j % 32 + 64 (j / 32) in its low
 * nibble and that + 32 in its high one) widened to its 512 bfloat16, q -> bf16(q) by a
 * 16-entry table lookup (vpermw). */
static inline void widen_tile(const unsigned char *q4, unsigned short *tile) {
    static const unsigned short bf16_of[32] = {
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i table = _mm512_loadu_si512(bf16_of);
    for (int g = 0; g < 8; g++) {
        __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q4 + 32 * g)));
        __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
        __m512i hi = _mm512_srli_epi16(bytes, 4);
        _mm512_store_si512(tile + 64 * g, _mm512_permutexvar_epi16(lo, table));
        _mm512_store_si512(tile + 64 * g + 32, _mm512_permutexvar_epi16(hi, table));
    }
}

/* Tiles 0-2 (three parts of the rows) times B tiles 3 and 6 into sums 4 and 5, the two
 * column tiles' chains interleaved: one chain's three products would wait on each other's
 * latency. */
static inline __attribute__((always_inline)) void both_products(void) {
    _tile_dpbf16ps(4, 0, 3);
    _tile_dpbf16ps(5, 0, 6);
    _tile_dpbf16ps(4, 1, 3);
    _tile_dpbf16ps(5, 1, 6);
    _tile_dpbf16ps(4, 2, 3);
    _tile_dpbf16ps(5, 2, 6);
}

/* RT rows (r0..) by the column tiles c, c + 1: for each run the three products into tiles 4
 * and 5 (both_products), stored, and scaled by d into float32 sums held in registers; then
 * m times the run sums the same way, and the finish into y. */
static void tile_rows(long r0, long M, long Mp, long K, long c, const unsigned short *b0,
                      const float *d, const unsigned short *mt, long N, float *y,
                      const float *other, int op) {
    long runs = K / 32;
    const unsigned short *a = parts + (r0 / RT) * runs * (3 * RT * 32);
    const unsigned short *b1 = b0 + (size_t)runs * 512;
    const float *d0 = d + (size_t)c * runs * 16, *d1 = d0 + (size_t)runs * 16;
    float sums[2][2][RT][16] __attribute__((aligned(64)));
    __m512 acc0[RT], acc1[RT];
    for (int i = 0; i < RT; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    /* Software-pipelined: run r's products are stored to sums[r % 2] and scaled one run
     * later, so the vector loads read a store that has long left the tiles, while the tile
     * unit works on run r + 1. */
    for (long r = 0; r <= runs; r++) {
        if (r < runs) {
            const unsigned short *ar = a + r * (3 * RT * 32);
            _tile_loadd(0, ar, 64);
            _tile_loadd(1, ar + RT * 32, 64);
            _tile_loadd(2, ar + 2 * RT * 32, 64);
            _tile_loadd(3, b0 + 512 * r, 64);
            _tile_loadd(6, b1 + 512 * r, 64);
            _tile_zero(4);
            _tile_zero(5);
            both_products();
        }
        if (r > 0) {
            long p = r - 1;
            __m512 dv0 = _mm512_loadu_ps(d0 + 16 * p), dv1 = _mm512_loadu_ps(d1 + 16 * p);
            for (int i = 0; i < RT; i++) {
                acc0[i] = _mm512_fmadd_ps(_mm512_load_ps(sums[p % 2][0][i]), dv0, acc0[i]);
                acc1[i] = _mm512_fmadd_ps(_mm512_load_ps(sums[p % 2][1][i]), dv1, acc1[i]);
            }
        }
        if (r < runs) {
            _tile_stored(4, sums[r % 2][0], 64);
            _tile_stored(5, sums[r % 2][1], 64);
        }
    }
    if (mt) {
        /* m times the run sums: [RT rows][runs] by [runs][16 columns], both exact in
         * bfloat16 parts (three of a sum, two of a float16 m), six tile products a group of
         * 32 runs and column tile. */
        long groups = (runs + 31) / 32, Rp = groups * 32;
        const unsigned short *s1 = sum_parts + r0 * Rp, *s2 = s1 + Mp * Rp, *s3 = s2 + Mp * Rp;
        const unsigned short *m0 = mt + (size_t)c * groups * 1024, *m1 = m0 + groups * 1024;
        _tile_zero(4);
        _tile_zero(5);
        for (long g = 0; g < groups; g++) {
            _tile_loadd(0, s1 + 32 * g, Rp * 2);
            _tile_loadd(1, s2 + 32 * g, Rp * 2);
            _tile_loadd(2, s3 + 32 * g, Rp * 2);
            for (int h = 0; h < 2; h++) {
                _tile_loadd(3, m0 + 1024 * g + 512 * h, 64);
                _tile_loadd(6, m1 + 1024 * g + 512 * h, 64);
                both_products();
            }
        }
        _tile_stored(4, sums[0][0], 64);
        _tile_stored(5, sums[0][1], 64);
        for (int i = 0; i < RT; i++) {
            acc0[i] = _mm512_add_ps(acc0[i], _mm512_load_ps(sums[0][0][i]));
            acc1[i] = _mm512_add_ps(acc1[i], _mm512_load_ps(sums[0][1][i]));
        }
    }
    for (int i = 0; i < RT && r0 + i < M; i++) {
        long at = (r0 + i) * N + 16 * c;
        __m512 v0 = acc0[i], v1 = acc1[i];
        if (op == 1) {
            v0 = _mm512_add_ps(v0, _mm512_loadu_ps(other + at));
            v1 = _mm512_add_ps(v1, _mm512_loadu_ps(other + at + 16));
        } else if (op == 2) {
            v0 = _mm512_mul_ps(v0, _mm512_loadu_ps(other + at));
            v1 = _mm512_mul_ps(v1, _mm512_loadu_ps(other + at + 16));
        }
        _mm512_storeu_ps(y + at, v0);
        _mm512_storeu_ps(y + at + 16, v1);
    }
}

/* Rows taken against all the weights before the next rows start: the chunk's three parts
 * (ROW_CHUNK x K x 6 bytes: 1.2 MB at K = 1536) stay in L2 while the B tiles stream past
 * (128 rows: 5.1 ms for the shapes above, 64: 5.3, 256: 5.8, 512: 6.9). */
#define ROW_CHUNK (RT * 8)
#endif

/* 1 where this build has AMX (compiled for a CPU with AMX-BF16 and AVX-512) and Linux lets
 * this process use the tile registers (the permission is asked for here, once per process);
 * else 0. */
int tidal_amx_available(void) {
#if TIDAL_AMX
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* From small_m_gemm.c's blocks ([N / 32][K / 32] of 768 bytes for kind 3, Q4_1: float d[32],
 * m[32], then nibbles [32 k][16]: column j low, 16 + j high; of 1152 bytes for kind 4, Q8_0:
 * float d[32], then int8 [32 k][32 columns]) to this kernel's B tiles
 * ([N / 16][K / 32][16][32] bfloat16), d and m ([N / 16][K / 32][16] float; m only for
 * kind 3). Returns 1, or 0 where some d q + m is not exact in float32 (the weights would not
 * be the layer's: the caller keeps its other path). */
int tidal_amx_pack(const unsigned char *blocks, int kind, long N, long K,
                   unsigned short *tiles, float *d_out, unsigned short *m_tiles) {
#if TIDAL_AMX
    long runs = K / 32, groups = (runs + 31) / 32;
    size_t block_bytes = kind == 3 ? 768 : 1152;
    int exact = 1;
    if (kind == 3) memset(m_tiles, 0, (size_t)N / 16 * groups * 1024 * 2);
    #pragma omp parallel for schedule(static) reduction(&& : exact)
    for (long c = 0; c < N / 16; c++) {
        long pair = c / 2, half = c % 2;
        for (long r = 0; r < runs; r++) {
            const unsigned char *block = blocks + ((size_t)pair * runs + r) * block_bytes;
            const float *d = (const float *)block, *m = d + 32;
            unsigned short *tile = tiles + ((size_t)c * runs + r) * 512;
            for (int n = 0; n < 16; n++) {
                int col = 16 * half + n;
                d_out[((size_t)c * runs + r) * 16 + n] = d[col];
                if (kind == 3) {
                    /* m = m1 + m2 (a float16: 11 significant bits, 8 + 3), column n's pair
                     * slot of row r / 2 of its group's two tiles. */
                    unsigned int mb;
                    memcpy(&mb, &m[col], 4);
                    float m1;
                    unsigned int m1b = mb & 0xFFFF0000u;
                    memcpy(&m1, &m1b, 4);
                    float m2 = m[col] - m1;
                    unsigned int m2b;
                    memcpy(&m2b, &m2, 4);
                    unsigned short *group = m_tiles + ((size_t)c * groups + r / 32) * 1024;
                    long slot = (r % 32 / 2) * 32 + 2 * n + r % 2;
                    group[slot] = (unsigned short)(m1b >> 16);
                    group[512 + slot] = (unsigned short)(m2b >> 16);
                    exact = exact && (m2b & 0xFFFFu) == 0;
                }
                for (int k = 0; k < 32; k++) {
                    int q = kind == 3 ? (block[256 + 16 * k + n] >> (4 * half)) & 15
                                      : (int)(signed char)block[128 + 32 * k + col];
                    int e = (k / 2) * 32 + 2 * n + (k % 2); /* element in the tile */
                    if (kind == 3) {
                        unsigned char *q4 = (unsigned char *)tiles + ((size_t)c * runs + r) * 256;
                        int j = e % 32 + 32 * (e / 64), high = e % 64 >= 32;
                        q4[j] = (unsigned char)(high ? (q4[j] & 15) | (q << 4) : (q4[j] & 0xF0) | q);
                    } else {
                        float qf = (float)q;
                        unsigned int bits;
                        memcpy(&bits, &qf, 4);
                        tile[e] = (unsigned short)(bits >> 16);
                    }
                    if (kind == 3) {
                        float product = d[col] * (float)q; /* exact: 11 x 4 bits */
                        __asm__("" : "+x"(product));
                        float w = product + m[col];
                        exact = exact && (double)w == (double)product + (double)m[col];
                    }
                }
            }
        }
    }
    return exact;
#else
    (void)blocks; (void)kind; (void)N; (void)K; (void)tiles; (void)d_out; (void)m_tiles;
    return 0;
#endif
}

/* x [M, K] float32, tiles / d / m as tidal_amx_pack made them (m NULL for Q8_0), y and other
 * [M, N]; all contiguous, N a multiple of 16 and K of 32. op 0: y = x W^T, 1: + other,
 * 2: * other. Returns 0, or -1 where its scratch could not be allocated (y untouched). */
int tidal_amx_gemm(const float *x, long M, long K, const unsigned short *tiles, const float *d,
                   const unsigned short *m, long N, float *y, const float *other, int op) {
#if TIDAL_AMX
    long Mp = (M + RT - 1) / RT * RT, Rp = (K / 32 + 31) / 32 * 32, runs = K / 32;
    if (!reserve(Mp, K, Rp)) return -1;
    #pragma omp parallel
    {
        configure_tiles();
        split_rows(x, M, Mp, K, Rp, m != NULL);  /* ends with the omp for's barrier */
        for (long r0 = 0; r0 < Mp; r0 += ROW_CHUNK) {
            long rn = Mp - r0 < ROW_CHUNK ? Mp - r0 : ROW_CHUNK;
            #pragma omp for schedule(static)
            for (long c = 0; c < N / 16; c += 2) {
                /* the pair's B tiles: 4-bit ones widened once for all the chunk's row tiles
                 * (a quarter of the bytes from memory), 8-bit ones stored as bfloat16 */
                const unsigned short *b = tiles + (size_t)c * runs * 512;
                if (m) {
                    unsigned short *wide = expanded + (size_t)omp_get_thread_num() * 2 * runs * 512;
                    const unsigned char *q4 = (const unsigned char *)tiles + (size_t)c * runs * 256;
                    for (long t = 0; t < 2 * runs; t++) widen_tile(q4 + 256 * t, wide + 512 * t);
                    b = wide;
                }
                for (long r = r0; r < r0 + rn; r += RT)
                    tile_rows(r, M, Mp, K, c, b, d, m, N, y, other, op);
            }
        }
        _tile_release();
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)tiles; (void)d; (void)m; (void)N; (void)y; (void)other; (void)op;
    return -1;
#endif
}
