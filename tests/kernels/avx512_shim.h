/* Scalar stand-ins for the AVX-512 intrinsics kernels/attention/decode_attention.c uses, so
 * its AVX-512 code (VL = 16: the blocked prefill kernel, and the row kernel's 16-lane
 * tiles) compiles and runs on any CPU:
 * tests/kernels/test_avx512_emulated.py builds it with these and checks it against the
 * reference. Lane by lane, the same operations (fmaf for the fused multiply-adds). */
#include <math.h>
#include <string.h>
typedef struct { float f[16]; } __m512;
typedef struct { int i[16]; } __m512i;
typedef struct { signed char b[16]; } __m128i;
#define _MM_FROUND_TO_NEG_INF 1
#define _MM_FROUND_NO_EXC 8
#define _MM_HINT_T1 2
#define L for (int k = 0; k < 16; k++)
static inline __m512 _mm512_setzero_ps(void) { __m512 r; L r.f[k] = 0; return r; }
static inline __m512 _mm512_set1_ps(float x) { __m512 r; L r.f[k] = x; return r; }
static inline __m512 _mm512_loadu_ps(const float *p) { __m512 r; memcpy(r.f, p, 64); return r; }
static inline void _mm512_storeu_ps(float *p, __m512 a) { memcpy(p, a.f, 64); }
static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) { __m512 r; L r.f[k] = fmaf(a.f[k], b.f[k], c.f[k]); return r; }
static inline __m512 _mm512_fnmadd_ps(__m512 a, __m512 b, __m512 c) { __m512 r; L r.f[k] = fmaf(-a.f[k], b.f[k], c.f[k]); return r; }
static inline __m512 _mm512_mul_ps(__m512 a, __m512 b) { __m512 r; L r.f[k] = a.f[k] * b.f[k]; return r; }
static inline __m512 _mm512_add_ps(__m512 a, __m512 b) { __m512 r; L r.f[k] = a.f[k] + b.f[k]; return r; }
static inline __m512 _mm512_sub_ps(__m512 a, __m512 b) { __m512 r; L r.f[k] = a.f[k] - b.f[k]; return r; }
static inline __m512 _mm512_max_ps(__m512 a, __m512 b) { __m512 r; L r.f[k] = a.f[k] > b.f[k] ? a.f[k] : b.f[k]; return r; }
static inline __m512 _mm512_roundscale_ps(__m512 a, int m) { (void)m; __m512 r; L r.f[k] = floorf(a.f[k]); return r; }
static inline __m512i _mm512_cvtps_epi32(__m512 a) { __m512i r; L r.i[k] = (int)lrintf(a.f[k]); return r; }
static inline __m512i _mm512_slli_epi32(__m512i a, int s) { __m512i r; L r.i[k] = (int)((unsigned)a.i[k] << s); return r; }
static inline __m512i _mm512_add_epi32(__m512i a, __m512i b) { __m512i r; L r.i[k] = a.i[k] + b.i[k]; return r; }
static inline __m512 _mm512_castsi512_ps(__m512i a) { __m512 r; memcpy(&r, &a, 64); return r; }
static inline __m512i _mm512_castps_si512(__m512 a) { __m512i r; memcpy(&r, &a, 64); return r; }
static inline float _mm512_reduce_add_ps(__m512 a) { float s = 0; L s += a.f[k]; return s; }
/* quarters (4 lanes): a's imm[1:0], imm[3:2], then b's imm[5:4], imm[7:6] */
static inline __m512 _mm512_shuffle_f32x4(__m512 a, __m512 b, int imm) {
    __m512 r;
    for (int q = 0; q < 4; q++)
        memcpy(r.f + 4 * q, (q < 2 ? a : b).f + 4 * ((imm >> (2 * q)) & 3), 16);
    return r;
}
/* within each quarter: a's lanes imm[1:0], imm[3:2], then b's imm[5:4], imm[7:6] */
static inline __m512 _mm512_shuffle_ps(__m512 a, __m512 b, int imm) {
    __m512 r;
    L r.f[k] = (k % 4 < 2 ? a : b).f[k / 4 * 4 + ((imm >> (2 * (k % 4))) & 3)];
    return r;
}
static inline __m128i _mm_loadu_si128(const __m128i *p) { __m128i r; memcpy(&r, p, 16); return r; }
static inline __m512i _mm512_cvtepi8_epi32(__m128i a) { __m512i r; L r.i[k] = a.b[k]; return r; }
static inline __m512 _mm512_cvtepi32_ps(__m512i a) { __m512 r; L r.f[k] = (float)a.i[k]; return r; }
static inline void _mm_prefetch(const char *p, int h) { (void)p; (void)h; }
