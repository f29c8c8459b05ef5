/* Shared by every part of the serving kernels (one translation unit: serve_kernels.c includes this header,
   then the parts): the headers, the 16-float vector type and its helpers (fixed-order sums, e^x), the
   weight-panel layout constants and the pool's job types. */

#ifndef WSC_KERNELS_H
#define WSC_KERNELS_H

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

static inline v16 ld16(const float* p) { v16 v; __builtin_memcpy(&v, p, sizeof v); return v; }
typedef int v16i __attribute__((vector_size(64)));

/* IEEE half precision (GGUF's block scales, a float16 KV cache) <-> float32 */
static inline float h2f(uint16_t h) {  /* IEEE half -> float, exact (subnormals, inf and NaN included) */
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023u, u;
    if (e == 31) u = s | 0x7F800000u | m << 13;
    else if (e) u = s | (e + 112) << 23 | m << 13;
    else {
        float f = (float)m * 0x1p-24f;
        __builtin_memcpy(&u, &f, 4);
        u |= s;
    }
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2h(float f) {  /* float -> IEEE half, rounded to nearest even (as vcvtps2ph) */
    uint32_t u, s, a;
    __builtin_memcpy(&u, &f, 4);
    s = u >> 16 & 0x8000u;
    a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(s | 0x7E00u | (a >> 13 & 0x3FFu));  /* NaN, quiet */
    if (a >= 0x477FF000u) return (uint16_t)(s | 0x7C00u);  /* 65520 and up round to infinity */
    if (a < 0x38800000u)  /* under 2^-14: a subnormal half, in units of 2^-24 (exact scaling, rounded) */
        return (uint16_t)(s | (uint32_t)nearbyintf(fabsf(f) * 0x1p24f));
    uint32_t h = (a >> 13) - (112u << 10), rem = a & 0x1FFFu;
    h += rem > 0x1000u || (rem == 0x1000u && (h & 1u));
    return (uint16_t)(s | h);
}

/* ---- the instruction-set paths ------------------------------------------------------------------------------
   One set of sources; the compiler's target picks the path (serve/kernels.py builds with -march=native, or the
   level WSC_KERNEL_MARCH names): AVX-512 (16 lanes a register; vpdpbusd with VNNI), x86-64-v3 = AVX2 + FMA +
   F16C (8 lanes; AVX-VNNI's 256-bit vpdpbusd where present), ARM NEON (4 lanes; the dot-product and i8mm
   instructions where present), or the portable code (WSC_PORTABLE, or a target with none of these): plain C
   and GCC vector arithmetic, the reference every path is compared with bit for bit (tests/test_serve_csrc.py).
   Only the primitives below differ between paths (VLANES lanes: one native register of int32 or float); the
   arithmetic of every kernel is written once over them. wsc_kernel_path() names the path built. */
#if defined(WSC_PORTABLE)
#define VLANES 16
#define WSC_PATH "portable"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define WSC_X86 512
#define VLANES 16
#if defined(__AVX512VNNI__)
#define WSC_PATH "avx512-vnni"
#else
#define WSC_PATH "avx512"
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WSC_X86 256
#define VLANES 8
#if defined(__AVXVNNI__)
#define WSC_PATH "avx2-vnni"
#else
#define WSC_PATH "avx2"
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define WSC_NEON 1
#define VLANES 4
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define WSC_PATH "neon-i8mm"
#elif defined(__ARM_FEATURE_DOTPROD)
#define WSC_PATH "neon-dotprod"
#else
#define WSC_PATH "neon"
#endif
#else
#define VLANES 16
#define WSC_PATH "portable"
#endif
#if defined(WSC_X86)
#include <immintrin.h>
#elif defined(WSC_NEON)
#include <arm_neon.h>
#endif
#define NPARTS (16 / VLANES)  /* native registers that a panel's 16 outputs span */

typedef float vf __attribute__((vector_size(VLANES * 4)));    /* one native register of floats */
typedef int32_t vi __attribute__((vector_size(VLANES * 4)));  /* ... of int32 */

/* part h (VLANES lanes from lane h VLANES) of a 16-lane vector, and a 16-lane vector put together from its
   NPARTS parts: register shuffles (through memory, GCC splits 32-byte moves into 16-byte ones and the loads that
   follow wait for the stores: ~10x slower) */
#define SH8(v, o) __builtin_shufflevector(v, v, o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7)
#define SH4(v, o) __builtin_shufflevector(v, v, o, o + 1, o + 2, o + 3)
#define CAT8(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define CAT4(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7)
static inline __attribute__((always_inline)) vf part(v16 v, int h) {
#if NPARTS == 1
    (void)h;
    return v;
#elif NPARTS == 2
    return h ? SH8(v, 8) : SH8(v, 0);
#else
    return h == 0 ? SH4(v, 0) : h == 1 ? SH4(v, 4) : h == 2 ? SH4(v, 8) : SH4(v, 12);
#endif
}
static inline __attribute__((always_inline)) v16 join(const vf* p) {
#if NPARTS == 1
    return p[0];
#elif NPARTS == 2
    return CAT8(p[0], p[1]);
#else
    v8 lo = CAT4(p[0], p[1]), hi = CAT4(p[2], p[3]);
    return CAT8(lo, hi);
#endif
}
/* VLANES floats at p */
static inline __attribute__((always_inline)) vf ldf(const float* p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* VLANES halves at p -> floats; VLANES floats -> halves at p (rounded to nearest even, as vcvtps2ph) */
static inline __attribute__((always_inline)) vf ldhf(const void* p) {
#if WSC_X86 == 512
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif WSC_X86 == 256
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#elif defined(WSC_NEON)
    return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)p)));
#else
    uint16_t h[VLANES];
    vf v;
    __builtin_memcpy(h, p, sizeof h);
    for (int i = 0; i < VLANES; i++) v[i] = h2f(h[i]);
    return v;
#endif
}
static inline __attribute__((always_inline)) void sthf(void* p, vf v) {
#if WSC_X86 == 512
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif WSC_X86 == 256
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(WSC_NEON)
    vst1_u16((uint16_t*)p, vreinterpret_u16_f16(vcvt_f16_f32((float32x4_t)v)));
#else
    uint16_t h[VLANES];
    for (int i = 0; i < VLANES; i++) h[i] = f2h(v[i]);
    __builtin_memcpy(p, h, sizeof h);
#endif
}

/* x in every lane of a native register */
static inline __attribute__((always_inline)) vf splatf(float x) {
#if WSC_X86 == 512
    return (vf)_mm512_set1_ps(x);
#elif WSC_X86 == 256
    return (vf)_mm256_set1_ps(x);
#elif defined(WSC_NEON)
    return (vf)vdupq_n_f32(x);
#else
    vf v;
    for (int i = 0; i < VLANES; i++) v[i] = x;
    return v;
#endif
}

/* 16 halves at p -> floats, and 16 floats -> halves at p */
static inline __attribute__((always_inline)) v16 ldh16(const void* p) {
    vf r[NPARTS];
    for (int h = 0; h < NPARTS; h++) r[h] = ldhf((const uint16_t*)p + h * VLANES);
    return join(r);
}
static inline __attribute__((always_inline)) void sth16(void* p, v16 v) {
    for (int h = 0; h < NPARTS; h++) sthf((uint16_t*)p + h * VLANES, part(v, h));
}

/* a KV cache row's 16 values from index d: float32 (kv16 0) or float16 (kv16 1) storage */
static inline __attribute__((always_inline)) v16 ldkv(const void* row, long d, int kv16) {
    return kv16 ? ldh16((const uint16_t*)row + d) : ld16((const float*)row + d);
}

static inline v16 vsplat(float a) { v16 v = {a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; return v; }

/* Fixed-order horizontal sum: halves, then halves again. */
static inline float hsum16(v16 v) {
#if defined(__clang__) || __GNUC__ >= 12
    v8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    v8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8 lo, hi; __builtin_memcpy(&lo, &v, 32); __builtin_memcpy(&hi, (const char*)&v + 32, 32);
#endif
    v8 s = lo + hi;
    float a = (s[0] + s[4]) + (s[2] + s[6]);
    float b = (s[1] + s[5]) + (s[3] + s[7]);
    return a + b;
}

/* One weight row against one input row: a single sequential stream, four vector accumulators. */
static inline float dot(const float* w, const float* x, long n) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 += ld16(w + i) * ld16(x + i);
        a1 += ld16(w + i + 16) * ld16(x + i + 16);
        a2 += ld16(w + i + 32) * ld16(x + i + 32);
        a3 += ld16(w + i + 48) * ld16(x + i + 48);
    }
    for (; i + 16 <= n; i += 16) a0 += ld16(w + i) * ld16(x + i);
    float s = hsum16((a0 + a1) + (a2 + a3));
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

/* Sums of 16 vectors at once, lanes in the fixed order of a 4-level tree: lane l of the result is the sum of
   vector TREE_PERM[l] (4 vector adds and 8 shuffles per level pair, instead of 16 horizontal sums). */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(p, q, ...) __builtin_shufflevector(p, q, __VA_ARGS__)
static inline v16 tlvl1(v16 p, v16 q) {
    return SHUF(p, q, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(p, q, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline v16 tlvl2(v16 p, v16 q) {
    return SHUF(p, q, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUF(p, q, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
static inline v16 tlvl3(v16 p, v16 q) {
    return SHUF(p, q, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUF(p, q, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
static inline v16 tlvl4(v16 p, v16 q) {
    return SHUF(p, q, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           SHUF(p, q, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#define HAVE_TREE 1
#endif
static const int TREE_PERM[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};


/* e^x for x <= 0 (softmax arguments): 2^k * p(r), r = x - k ln 2, |r| <= ln 2, degree-7 Taylor polynomial
   (relative error < 3e-7, as good as float32 libm for this use); underflows to 0 below -87. On native registers
   (vexpf), and on 16 lanes part by part (vexp): a comparison of 16 lanes where the target has no 16-lane
   register (AVX2, NEON) GCC lowers lane by lane, with scalar compares, extracts and inserts. */
static inline __attribute__((always_inline)) vf vexpf(vf x) {
    vi under = x < -87.0f;
    x = (vf)(((vi)x & ~under) | ((vi)splatf(-87.0f) & under));
    vf fk = x * 1.44269504088896341f - 0.5f;
    vi k = __builtin_convertvector(fk, vi);  /* truncation: round(x log2 e) for x <= 0 */
    vf kf = __builtin_convertvector(k, vf);
    vf r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    vf pe = splatf(1.0f / 5040);
    pe = pe * r + 1.0f / 720;
    pe = pe * r + 1.0f / 120;
    pe = pe * r + 1.0f / 24;
    pe = pe * r + 1.0f / 6;
    pe = pe * r + 0.5f;
    pe = pe * r + 1.0f;
    pe = pe * r + 1.0f;
    vi bits = (k + 127) << 23;
    vf y = pe * (vf)bits;
    return (vf)((vi)y & ~under);
}
static inline __attribute__((always_inline)) v16 vexp(v16 x) {
    vf r[NPARTS];
    for (int h = 0; h < NPARTS; h++) r[h] = vexpf(part(x, h));
    return join(r);
}

/* per lane a > b ? a : b (so b where a is NaN), part by part (as vexp) */
static inline __attribute__((always_inline)) v16 vmax16(v16 a, v16 b) {
    vf r[NPARTS];
    for (int h = 0; h < NPARTS; h++) {
        vf x = part(a, h), y = part(b, h);
        vi gt = x > y;
        r[h] = (vf)(((vi)x & gt) | ((vi)y & ~gt));
    }
    return join(r);
}

/* this thread's buffer *buf, grown to hold at least n elements of `size` bytes; NULL when out of memory */
static inline void* grow(void** buf, long* cap, long n, size_t size) {
    if (*cap < n) {
        void* nb = realloc(*buf, (size_t)n * size + 64);
        if (!nb) return NULL;
        *buf = nb;
        *cap = n;
    }
    return *buf;
}

#define PANEL 16
/* x rows a panel microkernel keeps in registers (panels.c): 6 rows' sums of 16 floats, with the weights and a
   broadcast, fit AVX2's 16 registers (of 8 floats) and NEON's 32 (of 4). On AVX-512 too: with 7 rows or more GCC
   keeps the sums in memory (measured on a Zen 4, fp32 3072 x 576 x 64 rows, one thread: 6 rows 54 GMAC/s, 7 rows
   21, 16 rows 22) */
#ifndef TILE
#define TILE 6
#endif
#ifndef PF_DIST
#define PF_DIST 512   /* floats ahead of the panel read to prefetch */
#endif

/* decode attention for the pool: B tokens over a paged cache, one a chunk, or (blk) chunk c the tokens [blk[c],
   blk[c + 1]) (see wsc_decode_attention_batch), or (hsplit > 0) one sequence whose KV sits in consecutive slots
   from slot0, hsplit query heads a chunk (see wsc_decode_attention_ex) */
typedef struct {
    const float* qkv; long ldq; const long *rows, *pos; const void* cache; long slots;
    const long* tables; long ldt, bs, nh, nkv, hd; float scale; float* y; long ldy;
    long window; const float* slopes;  /* sliding window (0: none), ALiBi slopes per query head (NULL: none) */
    long slot0, hsplit;
    int kv16;  /* the cache holds float16 (1) or float32 (0) */
    const long* blk;
} attn_t;
#define QBLOCK 16  /* tokens of a long prefill chunk attended together (attention.c, attend_block) */

/* one job for the pool: a product (at == NULL) or decode attention (attn_t's chunks). A product's W is in
   dense panels (off == NULL, qt == 0, panels.c), in sparse panels with panel offsets off (spanels.c), or in
   quantized panels at qw of type qt (quant.c), x then as it is, or as xq and xs when quantized (qint.c). */
typedef struct {
    const float *W, *xt, *b, *res; float* y;
    long rows, out, in;
    const attn_t* at;
    const int64_t* off;
    const uint8_t* qw; int qt;
    const int8_t* xq; const float* xs;
    const float* xr;  /* not NULL: the job rounds x = xr (rows, in) into xq and xs instead (qint.c's quantize_x),
                         QX_ROWS rows a chunk */
} job_t;
#define QX_ROWS 4

/* defined in attention.c, run by the pool (pool.c) */
static int attend_chunk(const attn_t* a, long c, float* y);

#endif  /* WSC_KERNELS_H */
