/* Products over weights in a file's own precision: bf16 and GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks. */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* ---- y = residual + x W^T + bias over W in quantized panels ----------------------------------------------
   Layout (wsc_qpack): panels of 16 outputs, as the float panels (panels.c), rows past `out` all zero bytes.
   A panel holds its outputs' blocks along k in order, each block j of the 16 outputs together: their scales
   side by side (16 fp16 d, then 16 fp16 m for Q4_1, ...) and then their quants with the 16 outputs of one k
   (or of two k, as low and high nibbles, or four, as 2-bit fields) in one 16-byte run, so that one 16-byte load
   expands to the 16 outputs' weights at k: one vector, as a float panel's row. The bytes are GGUF's, moved:
   a block of 16 outputs is 16 times GGUF's block (Q4_K's 6-bit scales and mins are unpacked to bytes: 148
   bytes a block instead of 144).

   Activations stay float32: each weight is dequantized in registers exactly as gguf.quants.dequantize
   computes it (d * q is exact in float32 for every type here, so d * q + m rounds once either way; Q6_K's
   (d * scale) * q rounds where numpy's does), then goes into the same FMA chain over k as the float panels.
   So a product over quantized panels gives the same bits as the float panels of the dequantized matrix,
   for any batch and thread count. One row (decode) runs four panels at a time, four independent chains to
   hide the FMA latency; more rows dequantize one panel at a time into a per-thread float panel (in x 16 floats,
   L1/L2-resident) that the float microkernel then reads for every row, so prefill reads W once per 16 x 16
   tile-set as the float path does. */

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { QT_F32, QT_BF16, QT_Q8_0, QT_Q4_0, QT_Q4_1, QT_Q4_K, QT_Q6_K, QT_N };  /* quant.py's QTYPES order */
static const int QK[QT_N] = {1, 1, 32, 32, 32, 256, 256};      /* weights per block */
static const int QROW[QT_N] = {4, 2, 34, 18, 20, 144, 210};    /* GGUF bytes of one output's block */
static const int QPAN[QT_N] = {4, 2, 34, 18, 20, 148, 210};    /* panel bytes of one output's block */
#define QNP 4          /* panels one decode row runs at once */
#define QPF 2048       /* bytes ahead of each panel's read to prefetch */

static inline long qpanel_bytes(int qt, long in) { return in / QK[qt] * QPAN[qt] * PANEL; }

typedef uint8_t vu8 __attribute__((vector_size(16)));
typedef int8_t vi8 __attribute__((vector_size(16)));
typedef uint16_t vu16 __attribute__((vector_size(32)));

/* 16 bytes (or 16-bit words) -> 16 int32 lanes, zero- or sign-extended (GCC scalarizes __builtin_convertvector
   here: ~10x slower) */
#if defined(__AVX512F__)
static inline v16i zx8(const uint8_t* p) { return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline v16i sx8(const uint8_t* p) { return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline v16i zx16(const uint8_t* p) {
    return (v16i)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
}
#else
#define CONVERT_LOAD(T, p) ({ T v_; __builtin_memcpy(&v_, p, sizeof v_); __builtin_convertvector(v_, v16i); })
static inline v16i zx8(const uint8_t* p) { return CONVERT_LOAD(vu8, p); }
static inline v16i sx8(const uint8_t* p) { return CONVERT_LOAD(vi8, p); }
static inline v16i zx16(const uint8_t* p) { return CONVERT_LOAD(vu16, p); }
#endif
static inline v16 i2f(v16i v) { return __builtin_convertvector(v, v16); }

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

static inline v16 ldh16(const uint8_t* p) {  /* 16 fp16 -> floats */
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
    v16 v;
    for (int c = 0; c < PANEL; c++) v[c] = h2f((uint16_t)(p[2 * c] | p[2 * c + 1] << 8));
    return v;
#endif
}

/* ---- each type's weights at k of a panel's block, 16 outputs a vector (the one home of the arithmetic) ---- */

static inline v16 bf16_w(const uint8_t* p) { return (v16)(zx16(p) << 16); }  /* bf16: the high half of a float */
/* Q8_0 block: d[16] fp16, then q (int8) at k: 32 + 16 k */
static inline v16 q8_0_w(const uint8_t* q, v16 d) { return i2f(sx8(q)) * d; }
/* Q4_0 block: d[16], then k = 2i, 2i + 1 as the low and high nibbles of 32 + 16 i: d (q - 8) */
static inline void q4_0_w(const uint8_t* q, v16 d, v16* w0, v16* w1) {
    v16i b = zx8(q);
    *w0 = i2f((b & 15) - 8) * d;
    *w1 = i2f((b >> 4) - 8) * d;
}
/* Q4_1 block: d[16], m[16], then the nibbles of k = 2i, 2i + 1 at 64 + 16 i: d q + m */
static inline void q4_1_w(const uint8_t* q, v16 d, v16 m, v16* w0, v16* w1) {
    v16i b = zx8(q);
    *w0 = i2f(b & 15) * d + m;
    *w1 = i2f(b >> 4) * d + m;
}
/* Q4_K super-block: d[16], dmin[16], scale[8][16], min[8][16] (bytes), then the nibbles of k = 2i, 2i + 1 at
   320 + 16 i; sub-block s (32 k): (d scale_s) q - dmin min_s, with ds = d scale_s and dm = dmin min_s */
static inline void q4_k_w(const uint8_t* q, v16 ds, v16 dm, v16* w0, v16* w1) {
    v16i b = zx8(q);
    *w0 = i2f(b & 15) * ds - dm;
    *w1 = i2f(b >> 4) * ds - dm;
}
/* Q6_K super-block: d[16], scale[16][16] (int8), the low nibbles of k = 2i, 2i + 1 at 288 + 16 i, the high
   2 bits of k = 4g .. 4g + 3 at 2336 + 16 g; sub-block s (16 k): (d scale_s) (q - 32), ds = d scale_s */
static inline void q6_k_w(const uint8_t* lo, const uint8_t* hi, v16 ds, v16* w) {
    v16i h = zx8(hi), a = zx8(lo), b = zx8(lo + 16);
    w[0] = i2f(((a & 15) | (h & 3) << 4) - 32) * ds;
    w[1] = i2f(((a >> 4) | (h >> 2 & 3) << 4) - 32) * ds;
    w[2] = i2f(((b & 15) | (h >> 4 & 3) << 4) - 32) * ds;
    w[3] = i2f(((b >> 4) | (h >> 6 & 3) << 4) - 32) * ds;
}

static inline void prefetch_block(const uint8_t* p, int bytes) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(p + QPF + l, 0, 3);
}

/* ---- one row against NP panels at w, pb bytes apart: a[p] += the FMA chain over k of panel p -------------- */
#define AI static inline __attribute__((always_inline))
#define FOR_P for (int p = 0; p < NP; p++)

AI void gemv_bf16(const uint8_t* w, long pb, long in, const float* x, v16* a, const int NP) {
    for (long k = 0; k < in; k++) {
        v16 xk = vsplat(x[k]);
        FOR_P {
            const uint8_t* q = w + p * pb + 32 * k;
            if (!(k & 1)) __builtin_prefetch(q + QPF, 0, 3);
            a[p] += xk * bf16_w(q);
        }
    }
}

AI void gemv_q8_0(const uint8_t* w, long pb, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 32; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP];
        FOR_P { blk[p] = w + p * pb + j * 544; d[p] = ldh16(blk[p]); prefetch_block(blk[p], 544); }
        for (int k = 0; k < 32; k++) {
            v16 xk = vsplat(x[32 * j + k]);
            FOR_P a[p] += xk * q8_0_w(blk[p] + 32 + 16 * k, d[p]);
        }
    }
}

AI void gemv_q4_0(const uint8_t* w, long pb, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 32; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP];
        FOR_P { blk[p] = w + p * pb + j * 288; d[p] = ldh16(blk[p]); prefetch_block(blk[p], 288); }
        for (int i = 0; i < 16; i++) {
            v16 x0 = vsplat(x[32 * j + 2 * i]), x1 = vsplat(x[32 * j + 2 * i + 1]);
            FOR_P {
                v16 w0, w1;
                q4_0_w(blk[p] + 32 + 16 * i, d[p], &w0, &w1);
                a[p] += x0 * w0;
                a[p] += x1 * w1;
            }
        }
    }
}

AI void gemv_q4_1(const uint8_t* w, long pb, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 32; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP], m[QNP];
        FOR_P {
            blk[p] = w + p * pb + j * 320;
            d[p] = ldh16(blk[p]);
            m[p] = ldh16(blk[p] + 32);
            prefetch_block(blk[p], 320);
        }
        for (int i = 0; i < 16; i++) {
            v16 x0 = vsplat(x[32 * j + 2 * i]), x1 = vsplat(x[32 * j + 2 * i + 1]);
            FOR_P {
                v16 w0, w1;
                q4_1_w(blk[p] + 64 + 16 * i, d[p], m[p], &w0, &w1);
                a[p] += x0 * w0;
                a[p] += x1 * w1;
            }
        }
    }
}

AI void gemv_q4_k(const uint8_t* w, long pb, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 256; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP], dmin[QNP];
        FOR_P { blk[p] = w + p * pb + j * 2368; d[p] = ldh16(blk[p]); dmin[p] = ldh16(blk[p] + 32); }
        for (int s = 0; s < 8; s++) {
            v16 ds[QNP], dm[QNP];
            FOR_P {
                ds[p] = i2f(zx8(blk[p] + 64 + 16 * s)) * d[p];
                dm[p] = i2f(zx8(blk[p] + 192 + 16 * s)) * dmin[p];
                prefetch_block(blk[p] + 320 + 256 * s, 256);
            }
            for (int i = 0; i < 16; i++) {
                const float* xk = x + 256 * j + 32 * s + 2 * i;
                v16 x0 = vsplat(xk[0]), x1 = vsplat(xk[1]);
                FOR_P {
                    v16 w0, w1;
                    q4_k_w(blk[p] + 320 + 16 * (16 * s + i), ds[p], dm[p], &w0, &w1);
                    a[p] += x0 * w0;
                    a[p] += x1 * w1;
                }
            }
        }
    }
}

AI void gemv_q6_k(const uint8_t* w, long pb, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 256; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP];
        FOR_P { blk[p] = w + p * pb + j * 3360; d[p] = ldh16(blk[p]); }
        for (int s = 0; s < 16; s++) {
            v16 ds[QNP];
            FOR_P {
                ds[p] = i2f(sx8(blk[p] + 32 + 16 * s)) * d[p];
                prefetch_block(blk[p] + 288 + 128 * s, 128);
                prefetch_block(blk[p] + 2336 + 64 * s, 64);
            }
            for (int g = 0; g < 4; g++) {
                const float* xk = x + 256 * j + 16 * s + 4 * g;
                v16 xv[4] = {vsplat(xk[0]), vsplat(xk[1]), vsplat(xk[2]), vsplat(xk[3])};
                FOR_P {
                    v16 wv[4];
                    q6_k_w(blk[p] + 288 + 16 * (8 * s + 2 * g), blk[p] + 2336 + 16 * (4 * s + g), ds[p], wv);
                    for (int t = 0; t < 4; t++) a[p] += xv[t] * wv[t];
                }
            }
        }
    }
}

/* one row against NP panels of type qt (NP constant at each call) */
AI void qgemv(int qt, const uint8_t* w, long pb, long in, const float* x, v16* a, const int NP) {
    switch (qt) {
    case QT_BF16: gemv_bf16(w, pb, in, x, a, NP); break;
    case QT_Q8_0: gemv_q8_0(w, pb, in, x, a, NP); break;
    case QT_Q4_0: gemv_q4_0(w, pb, in, x, a, NP); break;
    case QT_Q4_1: gemv_q4_1(w, pb, in, x, a, NP); break;
    case QT_Q4_K: gemv_q4_k(w, pb, in, x, a, NP); break;
    case QT_Q6_K: gemv_q6_k(w, pb, in, x, a, NP); break;
    }
}

/* ---- one panel dequantized into a float panel dst (in, 16), for the float microkernel ---------------------- */
static void qdeq_panel(int qt, const uint8_t* w, long in, float* dst) {
#define PUT(k, v) do { v16 v_ = (v); __builtin_memcpy(dst + (k) * PANEL, &v_, sizeof v_); } while (0)
    v16 w0, w1, wv[4];
    switch (qt) {
    case QT_BF16:
        for (long k = 0; k < in; k++) PUT(k, bf16_w(w + 32 * k));
        break;
    case QT_Q8_0:
        for (long j = 0; j < in / 32; j++) {
            const uint8_t* b = w + j * 544;
            v16 d = ldh16(b);
            for (int k = 0; k < 32; k++) PUT(32 * j + k, q8_0_w(b + 32 + 16 * k, d));
        }
        break;
    case QT_Q4_0:
        for (long j = 0; j < in / 32; j++) {
            const uint8_t* b = w + j * 288;
            v16 d = ldh16(b);
            for (int i = 0; i < 16; i++) {
                q4_0_w(b + 32 + 16 * i, d, &w0, &w1);
                PUT(32 * j + 2 * i, w0);
                PUT(32 * j + 2 * i + 1, w1);
            }
        }
        break;
    case QT_Q4_1:
        for (long j = 0; j < in / 32; j++) {
            const uint8_t* b = w + j * 320;
            v16 d = ldh16(b), m = ldh16(b + 32);
            for (int i = 0; i < 16; i++) {
                q4_1_w(b + 64 + 16 * i, d, m, &w0, &w1);
                PUT(32 * j + 2 * i, w0);
                PUT(32 * j + 2 * i + 1, w1);
            }
        }
        break;
    case QT_Q4_K:
        for (long j = 0; j < in / 256; j++) {
            const uint8_t* b = w + j * 2368;
            v16 d = ldh16(b), dmin = ldh16(b + 32);
            for (int s = 0; s < 8; s++) {
                v16 ds = i2f(zx8(b + 64 + 16 * s)) * d, dm = i2f(zx8(b + 192 + 16 * s)) * dmin;
                for (int i = 0; i < 16; i++) {
                    q4_k_w(b + 320 + 16 * (16 * s + i), ds, dm, &w0, &w1);
                    PUT(256 * j + 32 * s + 2 * i, w0);
                    PUT(256 * j + 32 * s + 2 * i + 1, w1);
                }
            }
        }
        break;
    case QT_Q6_K:
        for (long j = 0; j < in / 256; j++) {
            const uint8_t* b = w + j * 3360;
            v16 d = ldh16(b);
            for (int s = 0; s < 16; s++) {
                v16 ds = i2f(sx8(b + 32 + 16 * s)) * d;
                for (int g = 0; g < 4; g++) {
                    q6_k_w(b + 288 + 16 * (8 * s + 2 * g), b + 2336 + 16 * (4 * s + g), ds, wv);
                    for (int t = 0; t < 4; t++) PUT(256 * j + 16 * s + 4 * g + t, wv[t]);
                }
            }
        }
        break;
    }
#undef PUT
}

/* this thread's float panel for qdeq_panel; whether it is there (reserved by whoever runs a chunk, see pool.c)
   or not needed */
static _Thread_local void* t_deq;
static _Thread_local long t_deq_cap;
static int qbuf_ready(const job_t* j) {
    return !j->qt || j->rows == 1 || grow(&t_deq, &t_deq_cap, j->in * PANEL, sizeof(float)) != NULL;
}

/* a job's quantized panels [p0, p1) for every row into dst (row r, output o at dst[r * ldd + o - 16 p0]) */
static void qpanels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    long in = j->in, out = j->out, pb = qpanel_bytes(j->qt, in);
    if (j->rows > 1) {
        for (long p = p0; p < p1; p++) {
            qdeq_panel(j->qt, j->qw + (size_t)p * pb, in, t_deq);
            panel_rows(j, t_deq, p, p0, dst, ldd);
        }
        return;
    }
    for (long p = p0; p < p1;) {
        int NP = p1 - p >= QNP ? QNP : 1;
        v16 a[QNP] = {{0}};
        if (NP == QNP) qgemv(j->qt, j->qw + (size_t)p * pb, pb, in, j->xt, a, QNP);
        else qgemv(j->qt, j->qw + (size_t)p * pb, pb, in, j->xt, a, 1);
        for (int q = 0; q < NP; q++, p++) {
            long o = p * PANEL;
            int nc = out - o < PANEL ? (int)(out - o) : PANEL;
            store_row(a[q], dst + (o - p0 * PANEL), nc, j->b ? j->b + o : NULL, j->res ? j->res + o : NULL);
        }
    }
}

/* ---- packing: GGUF rows -> quantized panels ------------------------------------------------------------ */

/* output o's block j of GGUF rows src (QROW[qt] bytes a block) -> its quants q[QK] and its scales: sc[0] d,
   sc[1] m or dmin (fp16 bits, copied); Q4_K: sb[0..7] scales, sb[8..15] mins; Q6_K: sb[0..15] scales */
static void qdecode(int qt, const uint8_t* b, uint8_t* q, uint16_t* sc, uint8_t* sb) {
    switch (qt) {
    case QT_Q8_0:
        sc[0] = (uint16_t)(b[0] | b[1] << 8);
        for (int k = 0; k < 32; k++) q[k] = b[2 + k];
        break;
    case QT_Q4_0: case QT_Q4_1: {
        int h = qt == QT_Q4_1 ? 4 : 2;
        sc[0] = (uint16_t)(b[0] | b[1] << 8);
        sc[1] = (uint16_t)(b[2] | b[3] << 8);
        for (int k = 0; k < 16; k++) { q[k] = b[h + k] & 15; q[k + 16] = b[h + k] >> 4; }
        break;
    }
    case QT_Q4_K: {
        const uint8_t *s = b + 4, *qs = b + 16;
        sc[0] = (uint16_t)(b[0] | b[1] << 8);
        sc[1] = (uint16_t)(b[2] | b[3] << 8);
        for (int i = 0; i < 4; i++) {  /* (gguf.quants.Q4_K.get_scale_min) */
            sb[i] = s[i] & 63;
            sb[4 + i] = (s[8 + i] & 15) | ((s[i] >> 2) & 0x30);
            sb[8 + i] = s[4 + i] & 63;
            sb[12 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
        }
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 32; i++) {
                q[64 * c + i] = qs[32 * c + i] & 15;
                q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
            }
        break;
    }
    case QT_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        for (int s = 0; s < 16; s++) sb[s] = b[192 + s];
        sc[0] = (uint16_t)(b[208] | b[209] << 8);
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 128; r++) {
                int lo = r < 64 ? ql[64 * h + r] & 15 : ql[64 * h + r - 64] >> 4;
                q[128 * h + r] = (uint8_t)(lo | ((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4);
            }
        break;
    }
    }
}

/* W (out, in) as GGUF rows (`src`, in / QK[qt] * QROW[qt] bytes each; bf16 and every block type) -> its
   quantized panels at dst (ceil(out / 16) * qpanel_bytes(qt, in) bytes). 0, or -1 for a type it does not pack. */
int wsc_qpack(const uint8_t* src, int qt, long out, long in, uint8_t* dst) {
    if (qt <= QT_F32 || qt >= QT_N || in % QK[qt]) return -1;
    long nb = in / QK[qt], rb = nb * QROW[qt], np = (out + PANEL - 1) / PANEL, pb = qpanel_bytes(qt, in);
    long bb = (long)QPAN[qt] * PANEL;  /* bytes of one block of a panel */
    for (long i = 0; i < np * pb; i++) dst[i] = 0;
    uint8_t q[256] = {0}, sb[16] = {0};
    uint16_t sc[2] = {0, 0};
    for (long p = 0; p < np; p++)
        for (int c = 0; c < PANEL && p * PANEL + c < out; c++) {
            const uint8_t* row = src + (p * PANEL + c) * rb;
            if (qt == QT_BF16) {
                for (long k = 0; k < in; k++) {
                    dst[p * pb + 32 * k + 2 * c] = row[2 * k];
                    dst[p * pb + 32 * k + 2 * c + 1] = row[2 * k + 1];
                }
                continue;
            }
            for (long j = 0; j < nb; j++) {
                uint8_t* o = dst + p * pb + j * bb;
                qdecode(qt, row + j * QROW[qt], q, sc, sb);
                o[2 * c] = (uint8_t)sc[0];
                o[2 * c + 1] = (uint8_t)(sc[0] >> 8);
                switch (qt) {
                case QT_Q8_0:
                    for (int k = 0; k < 32; k++) o[32 + 16 * k + c] = q[k];
                    break;
                case QT_Q4_0: case QT_Q4_1: {
                    int h = qt == QT_Q4_1 ? 64 : 32;
                    if (qt == QT_Q4_1) { o[32 + 2 * c] = (uint8_t)sc[1]; o[33 + 2 * c] = (uint8_t)(sc[1] >> 8); }
                    for (int k = 0; k < 32; k++) o[h + 16 * (k >> 1) + c] |= (uint8_t)(q[k] << 4 * (k & 1));
                    break;
                }
                case QT_Q4_K:
                    o[32 + 2 * c] = (uint8_t)sc[1];
                    o[33 + 2 * c] = (uint8_t)(sc[1] >> 8);
                    for (int s = 0; s < 8; s++) { o[64 + 16 * s + c] = sb[s]; o[192 + 16 * s + c] = sb[8 + s]; }
                    for (int k = 0; k < 256; k++) o[320 + 16 * (k >> 1) + c] |= (uint8_t)(q[k] << 4 * (k & 1));
                    break;
                case QT_Q6_K:
                    for (int s = 0; s < 16; s++) o[32 + 16 * s + c] = sb[s];
                    for (int k = 0; k < 256; k++) {
                        o[288 + 16 * (k >> 1) + c] |= (uint8_t)((q[k] & 15) << 4 * (k & 1));
                        o[2336 + 16 * (k >> 2) + c] |= (uint8_t)((q[k] >> 4) << 2 * (k & 3));
                    }
                    break;
                }
            }
        }
    return 0;
}
