/* Products over weights in a file's own precision: bf16 and GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks. */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* ---- y = residual + x W^T + bias over W in quantized panels ----------------------------------------------
   Layout (wsc_qpack): panels of 16 outputs, as the float panels (panels.c), rows past `out` all zero bytes.
   A panel holds its outputs' blocks along k in order, each block j of the 16 outputs together: their scales
   side by side (16 fp16 d, then 16 fp16 m for Q4_1, ...), then their quants with the 16 outputs' values of the
   same k in one run that expands to one vector per k, as a float panel's row: bf16 and Q4_K / Q6_K 16 bytes for
   one k (or two, as low and high nibbles, or four, as 2-bit fields); Q8_0, Q4_0 and Q4_1 one 32-bit word per
   output holding 4 k (or 8, as nibbles), the integer path's operand (below; Q8_0's bytes q + 128, the sign bit
   flipped, as vpdpbusd's unsigned side takes them). The panels go in groups of four, their blocks interleaved
   (qpanel_at), so that a decode row reads one stream. The bytes are GGUF's, moved: a
   block of 16 outputs is 16 times GGUF's block (Q4_K's 6-bit scales and mins are unpacked to bytes: 148 bytes
   a block instead of 144).

   Two paths. Float (bf16, Q6_K always; Q8_0, Q4_0, Q4_1, Q4_K when the integer path is off): each weight is
   dequantized in registers exactly as gguf.quants.dequantize computes it (d * q is exact in float32 for every
   type here, so d * q + m rounds once either way; Q6_K's (d * scale) * q rounds where numpy's does), then goes
   into the same FMA chain over k as the float panels, so a product gives the same bits as the float panels of
   the dequantized matrix. One row (decode) runs a group's four panels together, four independent chains to
   hide the FMA latency; more rows dequantize one panel at a time into a per-thread float panel (in x 16
   floats, L1/L2-resident) that the float microkernel then reads for every row. Integer (Q8_0, Q4_0, Q4_1, Q4_K, the
   default): x as two int8 digits, see below. Either way a row's result depends neither on the batch nor on the
   thread count. */

enum { QT_F32, QT_BF16, QT_Q8_0, QT_Q4_0, QT_Q4_1, QT_Q4_K, QT_Q6_K, QT_N };  /* quant.py's QTYPES order */
static const int QK[QT_N] = {1, 1, 32, 32, 32, 256, 256};      /* weights per block */
static const int QROW[QT_N] = {4, 2, 34, 18, 20, 144, 210};    /* GGUF bytes of one output's block */
static const int QPAN[QT_N] = {4, 2, 34, 18, 20, 148, 210};    /* panel bytes of one output's block */
#ifndef QNP
#define QNP 4          /* panels one decode row runs at once */
#endif
#ifndef QPF
#define QPF 8192       /* bytes ahead of the read to prefetch. Measured on single-stream decode (bench/serve_kernels_ab.py,
                          2 threads), against 4096: Q4_1 +11% and +14% while this VM's memory reads ~70-80 GB/s
                          (2 threads can then stream ~82 GB/s, one ~42: 4 KiB ahead is less than a thread's
                          memory latency covers), the same (0.99x) while it reads ~46; Q8_0 the same either way
                          (1.01x); 16384 no faster than 8192 */
#endif

static inline long qpanel_bytes(int qt, long in) { return in / QK[qt] * QPAN[qt] * PANEL; }

/* Panels go in groups of QNP, the groups' blocks interleaved: block j of a group's panels q = 0 .. gs - 1 (gs
   = QNP but in the last group) side by side, then block j + 1, so that a decode row, which runs a group's
   panels together, reads one sequential stream. Where panel p of np starts, and (*bs) its blocks' stride: */
static inline const uint8_t* qpanel_at(const uint8_t* W, int qt, long in, long np, long p, long* bs) {
    long g = p / QNP, gs = np - g * QNP < QNP ? np - g * QNP : QNP, bb = (long)QPAN[qt] * PANEL;
    *bs = gs * bb;
    return W + g * QNP * qpanel_bytes(qt, in) + (p % QNP) * bb;
}

typedef uint8_t vu8 __attribute__((vector_size(16)));
typedef int8_t vi8 __attribute__((vector_size(16)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

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

/* ---- each type's weights at k of a panel's block, 16 outputs a vector (the one home of the arithmetic) ---- */

static inline v16 bf16_w(const uint8_t* p) { return (v16)(zx16(p) << 16); }  /* bf16: the high half of a float */
/* Q8_0 block: d[16] fp16, then eight groups of 4 k, 64 bytes each: output c's 32-bit word holds k = 4g + t in
   its byte t as q + 128 (q int8, its sign bit flipped), as the integer path's vpdpbusd takes them: d q. The four
   weight vectors of group g at q: */
static inline void q8_group(const uint8_t* q, v16 d, v16* w) {
    v16i L;
    __builtin_memcpy(&L, q, 64);
    L ^= (int)0x80808080u;  /* back to int8 */
    for (int t = 0; t < 4; t++) w[t] = i2f(L << (24 - 8 * t) >> 24) * d;
}
/* Q4_0 and Q4_1 blocks: d[16] (Q4_1: then m[16]), then four groups of 8 k, 64 bytes each: output c's 32-bit
   word holds k = 8g + t (t < 4) in the low nibble of its byte t and k = 8g + 4 + t in the high one, as the
   integer path's vpdpbusd takes them. Q4_1: d q + m; Q4_0: d (q - 8) = d q + m with m = -8 d (exact too). The
   eight weight vectors of group g at q: */
static inline void q4_group(const uint8_t* q, v16 d, v16 m, v16* w) {
    v16u L;
    __builtin_memcpy(&L, q, 64);
    for (int t = 0; t < 4; t++) {
        w[t] = i2f((v16i)(L >> (8 * t) & 15)) * d + m;
        w[4 + t] = i2f((v16i)(L >> (8 * t + 4) & 15)) * d + m;
    }
}
/* Q4_K super-block: d[16], dmin[16], scale[8][16], min[8][16] (bytes), then its 32 groups of 8 k as Q4_1's
   (at 320 + 64 g); sub-block s (32 k, groups 4s .. 4s + 3): (d scale_s) q - dmin min_s, Q4_1's d q + m with
   d = d scale_s and m = -(dmin min_s), both products exact. The two of sub-block s at blk: */
static inline void q4_k_scales(const uint8_t* blk, int s, v16 d, v16 dmin, v16* ds, v16* m) {
    *ds = i2f(zx8(blk + 64 + 16 * s)) * d;
    *m = -(i2f(zx8(blk + 192 + 16 * s)) * dmin);
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

/* One row's product (decode) reads each weight once: its prefetches are non-temporal (prefetchnta), so that
   the stream does not push out of the caches what the token reads again (its KV cache, activations, the pool's
   shared lines). Measured (bench/serve_kernels_ab.py, single-stream decode, 2 threads) against prefetcht0:
   Q4_1 +2.6% (20 rounds, this VM's memory at ~45 GB/s) and +4.4% (16, at ~80), Q8_0 +1.3% (20). Several
   rows re-read each panel once per 4 rows, from L1/L2: those keep prefetcht0. */
#define PREFETCH(a, nt) ((nt) ? __builtin_prefetch((a), 0, 0) : __builtin_prefetch((a), 0, 3))
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t* p, int bytes, const int nt) {
    for (int l = 0; l < bytes; l += 64) PREFETCH(p + QPF + l, nt);
}

/* ---- one row against NP panels at w, ps bytes apart, their blocks bs apart: a[p] += panel p's FMA chain ---- */
#define AI static inline __attribute__((always_inline))
#define FOR_P for (int p = 0; p < NP; p++)

AI void gemv_bf16(const uint8_t* w, long ps, long bs, long in, const float* x, v16* a, const int NP) {
    for (long k = 0; k < in; k++) {
        v16 xk = vsplat(x[k]);
        FOR_P {
            const uint8_t* q = w + p * ps + k * bs;
            if (!(k & 1)) PREFETCH(q + QPF, 1);
            a[p] += xk * bf16_w(q);
        }
    }
}

AI void gemv_q8_0(const uint8_t* w, long ps, long bs, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 32; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; d[p] = ldh16(blk[p]); prefetch_block(blk[p], 544, 1); }
        for (int g = 0; g < 8; g++) {
            const float* xg = x + 32 * j + 4 * g;
            FOR_P {
                v16 wv[4];
                q8_group(blk[p] + 32 + 64 * g, d[p], wv);
                for (int t = 0; t < 4; t++) a[p] += vsplat(xg[t]) * wv[t];
            }
        }
    }
}

/* Q4_0 and Q4_1 (has_m) */
AI void gemv_q4(const uint8_t* w, long ps, long bs, long in, const float* x, v16* a, const int NP,
                const int has_m) {
    const int bb = has_m ? 320 : 288, h = has_m ? 64 : 32;
    for (long j = 0; j < in / 32; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP], m[QNP];
        FOR_P {
            blk[p] = w + p * ps + j * bs;
            d[p] = ldh16(blk[p]);
            m[p] = has_m ? ldh16(blk[p] + 32) : d[p] * -8.0f;
            prefetch_block(blk[p], bb, 1);
        }
        for (int g = 0; g < 4; g++) {
            const float* xg = x + 32 * j + 8 * g;
            FOR_P {
                v16 wv[8];
                q4_group(blk[p] + h + 64 * g, d[p], m[p], wv);
                for (int t = 0; t < 8; t++) a[p] += vsplat(xg[t]) * wv[t];
            }
        }
    }
}

AI void gemv_q4_k(const uint8_t* w, long ps, long bs, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 256; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP], dmin[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; d[p] = ldh16(blk[p]); dmin[p] = ldh16(blk[p] + 32); }
        for (int s = 0; s < 8; s++) {
            v16 ds[QNP], m[QNP];
            FOR_P {
                q4_k_scales(blk[p], s, d[p], dmin[p], &ds[p], &m[p]);
                prefetch_block(blk[p] + 320 + 256 * s, 256, 1);
            }
            for (int g = 0; g < 4; g++) {
                const float* xg = x + 256 * j + 32 * s + 8 * g;
                FOR_P {
                    v16 wv[8];
                    q4_group(blk[p] + 320 + 64 * (4 * s + g), ds[p], m[p], wv);
                    for (int t = 0; t < 8; t++) a[p] += vsplat(xg[t]) * wv[t];
                }
            }
        }
    }
}

AI void gemv_q6_k(const uint8_t* w, long ps, long bs, long in, const float* x, v16* a, const int NP) {
    for (long j = 0; j < in / 256; j++) {
        const uint8_t* blk[QNP];
        v16 d[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; d[p] = ldh16(blk[p]); }
        for (int s = 0; s < 16; s++) {
            v16 ds[QNP];
            FOR_P {
                ds[p] = i2f(sx8(blk[p] + 32 + 16 * s)) * d[p];
                prefetch_block(blk[p] + 288 + 128 * s, 128, 1);
                prefetch_block(blk[p] + 2336 + 64 * s, 64, 1);
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
AI void qgemv(int qt, const uint8_t* w, long ps, long bs, long in, const float* x, v16* a, const int NP) {
    switch (qt) {
    case QT_BF16: gemv_bf16(w, ps, bs, in, x, a, NP); break;
    case QT_Q8_0: gemv_q8_0(w, ps, bs, in, x, a, NP); break;
    case QT_Q4_0: gemv_q4(w, ps, bs, in, x, a, NP, 0); break;
    case QT_Q4_1: gemv_q4(w, ps, bs, in, x, a, NP, 1); break;
    case QT_Q4_K: gemv_q4_k(w, ps, bs, in, x, a, NP); break;
    case QT_Q6_K: gemv_q6_k(w, ps, bs, in, x, a, NP); break;
    }
}

/* ---- one panel dequantized into a float panel dst (in, 16), for the float microkernel ---------------------- */
static void qdeq_panel(int qt, const uint8_t* w, long bs, long in, float* dst) {
#define PUT(k, v) do { v16 v_ = (v); __builtin_memcpy(dst + (k) * PANEL, &v_, sizeof v_); } while (0)
    v16 wv[8];
    switch (qt) {
    case QT_BF16:
        for (long k = 0; k < in; k++) PUT(k, bf16_w(w + k * bs));
        break;
    case QT_Q8_0:
        for (long j = 0; j < in / 32; j++) {
            const uint8_t* b = w + j * bs;
            v16 d = ldh16(b);
            for (int g = 0; g < 8; g++) {
                q8_group(b + 32 + 64 * g, d, wv);
                for (int t = 0; t < 4; t++) PUT(32 * j + 4 * g + t, wv[t]);
            }
        }
        break;
    case QT_Q4_0: case QT_Q4_1: {
        int has_m = qt == QT_Q4_1;
        for (long j = 0; j < in / 32; j++) {
            const uint8_t* b = w + j * bs;
            v16 d = ldh16(b), m = has_m ? ldh16(b + 32) : d * -8.0f;
            for (int g = 0; g < 4; g++) {
                q4_group(b + (has_m ? 64 : 32) + 64 * g, d, m, wv);
                for (int t = 0; t < 8; t++) PUT(32 * j + 8 * g + t, wv[t]);
            }
        }
        break;
    }
    case QT_Q4_K:
        for (long j = 0; j < in / 256; j++) {
            const uint8_t* b = w + j * bs;
            v16 d = ldh16(b), dmin = ldh16(b + 32);
            for (int s = 0; s < 8; s++) {
                v16 ds, m;
                q4_k_scales(b, s, d, dmin, &ds, &m);
                for (int g = 0; g < 4; g++) {
                    q4_group(b + 320 + 64 * (4 * s + g), ds, m, wv);
                    for (int t = 0; t < 8; t++) PUT(256 * j + 32 * s + 8 * g + t, wv[t]);
                }
            }
        }
        break;
    case QT_Q6_K:
        for (long j = 0; j < in / 256; j++) {
            const uint8_t* b = w + j * bs;
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

/* ---- the integer path: x as two int8 digits per block of 32, Q8_0 / Q4_0 / Q4_1 / Q4_K as integers -------
   Block j of a row of x is dx xq + dr xr (quantize_x: dx = max |x| / 127, xq = x / dx rounded half away from
   zero, dr = dx / 254, xr the rest over dr, rounded), and an output's block sum is d dx (sum q xq) + d dr
   (sum q xr) + m sum x (Q4_1: its m; Q4_0: -8 d; Q8_0: none; Q4_K, per sub-block of 32: d scale_s and -dmin
   min_s), the integer sums exact (vpdpbusd: four u8 x s8 products a lane, 4 k x 16 outputs an instruction; a
   plain-C stand-in without AVX512-VNNI gives the same integers), sum x the block's float sum in a fixed order.
   With one digit (llama.cpp's Q8_0 / Q8_1 activations) the perplexity of SmolLM2-135M's Q4_1 file on the
   held-out Shakespeare passage rose 3.1 %; the second digit brings x's rounding to dr / 2 = max |x| / 64516 per
   element (about 16 bits) and the perplexity to that of the float path (-0.002 %), at no measured cost in
   decode speed: it reads the same weight bytes and the weights' unpacking is shared; only the vpdpbusd double.
   It reads them with a fraction of the float path's instructions, which on this 2-core Zen 4 turns a
   compute-bound decode product into a memory-bound one, and prefill ~2.5x faster than the float path (figures:
   bench/serve_quant_kernels.py). Every row is computed alone by the same code. On by default (wsc_qset_int8). */

static _Atomic int g_qint8 = 1;
#define XS 5        /* floats of xs per row and block of 32 (quantize_x) */

/* whether products over qt take the integer path (1) or the float path (0) from now on: on != 0 / 0; returns
   the previous setting (on < 0: only returns it) */
int wsc_qset_int8(int on) {
    int was = atomic_load(&g_qint8);
    if (on >= 0) atomic_store(&g_qint8, on != 0);
    return was;
}

static inline int qint8_applies(int qt) {
    return atomic_load(&g_qint8) && (qt == QT_Q8_0 || qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q4_K);
}

/* 16 floats t rounded half away from zero (|t| < 127.5) into int8 at q; returns them (saturated to int8, as
   stored, for a t out of range: an x of NaN or inf) */
static inline v16i round_to_i8(v16 t, int8_t* q) {
    const v16i sign = (v16i)vsplat(-0.0f);
    v16 half = (v16)(((v16i)t & sign) | (v16i)vsplat(0.5f));  /* 0.5 with t's sign */
    v16i qi = __builtin_convertvector(t + half, v16i);  /* truncation */
#if defined(__AVX512F__)
    qi = (v16i)_mm512_max_epi32(_mm512_min_epi32((__m512i)qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8((__m512i)qi));
#else
    v16i hi = qi > 127, lo = qi < -128;
    qi = (qi & ~(hi | lo)) | (127 & hi) | (-128 & lo);
    for (int c = 0; c < PANEL; c++) q[c] = (int8_t)qi[c];
#endif
    return qi;
}

/* x (rows, in) -> per row its two int8 digits, xq then xr (2 in bytes a row), and xs (rows, in / 32, XS): each
   block's dx, dr, sum of x (the sum in a fixed order: lanes pairwise, then hsum16), and 128 times the sum of
   its xq and of its xr (Q8_0's correction, i8_q8). xq = x / dx rounded, dx
   = max |x| / 127; xr = (x - dx xq) / dr rounded, dr = dx / 254 (|x - dx xq| <= dx / 2, so |xr| <= 127). */
static void quantize_x(const float* x, long rows, long in, int8_t* xq, float* xs) {
    const v16i abs_mask = ~(v16i)vsplat(-0.0f);
    long nb = in / 32;
    for (long r = 0; r < rows; r++)
        for (long j = 0; j < nb; j++) {
            const float* v = x + r * in + 32 * j;
            v16 lo = ld16(v), hi = ld16(v + 16);
            v16 a = (v16)((v16i)lo & abs_mask), b = (v16)((v16i)hi & abs_mask);
            v16i ga = (a >= b) | (b != b);  /* max |x| over the non-NaN values */
            v16 m = (v16)(((v16i)a & ga) | ((v16i)b & ~ga));
#if defined(__AVX512F__)
            float amax = _mm512_reduce_max_ps((__m512)(v16)((v16i)m & (m == m)));  /* (NaN lanes as 0, as below) */
#else
            float amax = 0;
            for (int c = 0; c < PANEL; c++) amax = m[c] > amax ? m[c] : amax;
#endif
            float dx = amax / 127, id = dx > 0 ? 1 / dx : 0, dr = dx / 254, idr = dr > 0 ? 1 / dr : 0;
            int8_t *q = xq + 2 * r * in + 32 * j, *qr = q + in;
            v16i sq = {0}, sr = {0};
            for (int h = 0; h < 2; h++) {
                v16 xv = h ? hi : lo;
                v16i qi = round_to_i8(xv * id, q + 16 * h);
                sq += qi;
                sr += round_to_i8((xv - i2f(qi) * dx) * idr, qr + 16 * h);
            }
            float* s = xs + XS * (r * nb + j);
            s[0] = dx;
            s[1] = dr;
            s[2] = hsum16(lo + hi);
#if defined(__AVX512F__)
            s[3] = (float)(128 * _mm512_reduce_add_epi32((__m512i)sq));  /* (integers under 2^24: exact in float, */
            s[4] = (float)(128 * _mm512_reduce_add_epi32((__m512i)sr));  /* the same as the loop below) */
#else
            s[3] = s[4] = 0;
            for (int c = 0; c < PANEL; c++) { s[3] += 128 * sq[c]; s[4] += 128 * sr[c]; }  /* (integers: exact) */
#endif
        }
}

/* the four bytes at x in every lane (a 32-bit load of its own, broadcast from memory: a wider load split in
   registers costs each broadcast two more vector uops) */
static inline v16i bcast4(const int8_t* x) {
    int32_t b;
    __builtin_memcpy(&b, x, 4);
    v16i v = {b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b};
    return v;
}

/* acc + per lane the sum of its four u8 bytes of a times the four s8 bytes of b (b: the same in every lane) */
static inline v16i dpbusd(v16i acc, v16i a, v16i b) {
#if defined(__AVX512VNNI__)
    return (v16i)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#else
    for (int t = 0; t < 4; t++) acc += (v16i)((v16u)a >> (8 * t) & 255) * (int8_t)(b[0] >> (8 * t));
    return acc;
#endif
}

/* The integer path runs NP panels x MR rows at once (NP MR <= 4: one decode row against a group of panels, or
   up to four rows against one panel): each weight group is loaded and unpacked once for the MR rows, and each
   row's x words are broadcast once for the NP panels. */

/* MR rows of xq (two digits, ldq apart) against NP panels of Q8_0: a[p * MR + r] += their block sums. vpdpbusd
   takes one side unsigned: the panels hold q + 128, so 128 times the block's sum of each digit (xs) comes off,
   in float: both terms are integers below 2^24, so the difference is exact, the integer sum itself */
AI void i8_q8(const uint8_t* w, long ps, long bs, long in, const int8_t* xq, const float* xs, long ldq, v16* a,
              const int NP, const int MR) {
    const long nb = in / 32;
    for (long j = 0; j < nb; j++) {
        const uint8_t* blk[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; prefetch_block(blk[p], 544, MR == 1); }
        v16i acc[QNP] = {{0}}, acr[QNP] = {{0}};
        for (int g = 0; g < 8; g++) {
            v16i xb[QNP][2];
            for (int r = 0; r < MR; r++) {
                xb[r][0] = bcast4(xq + r * ldq + 32 * j + 4 * g);
                xb[r][1] = bcast4(xq + r * ldq + in + 32 * j + 4 * g);
            }
            FOR_P {
                v16i L;
                __builtin_memcpy(&L, blk[p] + 32 + 64 * g, 64);
                for (int r = 0; r < MR; r++) {
                    acc[p * MR + r] = dpbusd(acc[p * MR + r], L, xb[r][0]);
                    acr[p * MR + r] = dpbusd(acr[p * MR + r], L, xb[r][1]);
                }
            }
        }
        FOR_P {
            v16 d = ldh16(blk[p]);
            for (int r = 0; r < MR; r++) {
                const float* s = xs + XS * (r * nb + j);
                a[p * MR + r] += (i2f(acc[p * MR + r]) - s[3]) * (d * s[0]);
                a[p * MR + r] += (i2f(acr[p * MR + r]) - s[4]) * (d * s[1]);
            }
        }
    }
}

/* one sub-block of 32 k of NP panels (q[p]: its 4 groups of 8 k, Q4_1's layout; d[p], m[p] its scales) against
   MR rows into a: d dx (sum q xq) + d dr (sum q xr) + m sum x (xs: each row's dx, dr, sum x of this block, XS
   nb floats apart) */
AI void i8_q4_block(const uint8_t* const* q, const v16* d, const v16* m, const int8_t* xq, long ldq, long in,
                    const float* xs, long nb, v16* a, const int NP, const int MR) {
    v16i acc[QNP] = {{0}}, acr[QNP] = {{0}};
    for (int g = 0; g < 4; g++) {
        v16i xb[QNP][4];
        for (int r = 0; r < MR; r++) {
            const int8_t* x = xq + r * ldq + 8 * g;
            xb[r][0] = bcast4(x), xb[r][1] = bcast4(x + 4), xb[r][2] = bcast4(x + in), xb[r][3] = bcast4(x + in + 4);
        }
        FOR_P {
            v16u L;
            __builtin_memcpy(&L, q[p] + 64 * g, 64);
            v16i lo = (v16i)(L & 0x0F0F0F0Fu), hi = (v16i)(L >> 4 & 0x0F0F0F0Fu);
            for (int r = 0; r < MR; r++) {
                int i = p * MR + r;
                acc[i] = dpbusd(dpbusd(acc[i], lo, xb[r][0]), hi, xb[r][1]);
                acr[i] = dpbusd(dpbusd(acr[i], lo, xb[r][2]), hi, xb[r][3]);
            }
        }
    }
    FOR_P for (int r = 0; r < MR; r++) {
        const float* s = xs + XS * r * nb;
        int i = p * MR + r;
        a[i] += i2f(acc[i]) * (d[p] * s[0]);
        a[i] += i2f(acr[i]) * (d[p] * s[1]);
        a[i] += m[p] * s[2];
    }
}

/* MR rows of xq (two digits, ldq apart) against NP panels of Q4_0 / Q4_1 (has_m) / Q4_K (kq): a[p * MR + r] +=
   their block sums */
AI void i8_q4(const uint8_t* w, long ps, long bs, long in, const int8_t* xq, const float* xs, long ldq, v16* a,
              const int NP, const int MR, const int has_m, const int kq) {
    const int bb = has_m ? 320 : 288, h = has_m ? 64 : 32;
    const long nb = in / 32;
    for (long j = 0; j < nb / (kq ? 8 : 1); j++) {
        const uint8_t* blk[QNP];
        const uint8_t* q[QNP];
        v16 d[QNP], m[QNP];
        FOR_P blk[p] = w + p * ps + j * bs;
        if (kq) {
            v16 dk[QNP], dmin[QNP];
            FOR_P { dk[p] = ldh16(blk[p]); dmin[p] = ldh16(blk[p] + 32); }
            for (int s = 0; s < 8; s++) {
                FOR_P {
                    q4_k_scales(blk[p], s, dk[p], dmin[p], &d[p], &m[p]);
                    prefetch_block(blk[p] + 320 + 256 * s, 256, MR == 1);
                    q[p] = blk[p] + 320 + 256 * s;
                }
                i8_q4_block(q, d, m, xq + 256 * j + 32 * s, ldq, in, xs + XS * (8 * j + s), nb, a, NP, MR);
            }
            continue;
        }
        FOR_P {
            prefetch_block(blk[p], bb, MR == 1);
            d[p] = ldh16(blk[p]);
            m[p] = has_m ? ldh16(blk[p] + 32) : d[p] * -8.0f;
            q[p] = blk[p] + h;
        }
        i8_q4_block(q, d, m, xq + 32 * j, ldq, in, xs + XS * j, nb, a, NP, MR);
    }
}

/* panels [p0, p1) of a job on the integer path, into dst as qpanels_into */
static void i8_panels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    long in = j->in, out = j->out, np = (out + PANEL - 1) / PANEL, nb = in / 32, bb = QPAN[j->qt] * PANEL, bs;
    int has_m = j->qt == QT_Q4_1, q8 = j->qt == QT_Q8_0, kq = j->qt == QT_Q4_K;
    for (long p = p0; p < p1;) {
        const uint8_t* w = qpanel_at(j->qw, j->qt, in, np, p, &bs);
        int NP = j->rows == 1 && p % QNP == 0 && p1 - p >= QNP ? QNP : 1;
        for (long r0 = 0, MR; r0 < j->rows; r0 += MR) {
            MR = j->rows - r0 >= 4 ? 4 : j->rows - r0 >= 2 ? 2 : 1;
            v16 a[QNP * 4] = {{0}};
            const int8_t* xq = j->xq + 2 * r0 * in;
            const float* xs = j->xs + XS * r0 * nb;
#define I8(np, mr) do { if (q8) i8_q8(w, bb, bs, in, xq, xs, 2 * in, a, np, mr); \
                         else if (kq) i8_q4(w, bb, bs, in, xq, xs, 2 * in, a, np, mr, 0, 1); \
                         else if (has_m) i8_q4(w, bb, bs, in, xq, xs, 2 * in, a, np, mr, 1, 0); \
                         else i8_q4(w, bb, bs, in, xq, xs, 2 * in, a, np, mr, 0, 0); } while (0)
            if (NP == QNP) I8(QNP, 1);
            else if (MR == 4) I8(1, 4);
            else if (MR == 2) I8(1, 2);
            else I8(1, 1);
#undef I8
            for (int q = 0; q < NP; q++)
                for (int r = 0; r < MR; r++) {
                    long o = (p + q) * PANEL, row = r0 + r;
                    int nc = out - o < PANEL ? (int)(out - o) : PANEL;
                    store_row(a[q * MR + r], dst + row * ldd + (o - p0 * PANEL), nc, j->b ? j->b + o : NULL,
                              j->res ? j->res + row * out + o : NULL);
                }
        }
        p += NP;
    }
}

/* this thread's float panel for qdeq_panel; whether it is there (reserved by whoever runs a chunk, see pool.c)
   or not needed */
static _Thread_local void* t_deq;
static _Thread_local long t_deq_cap;
static int qbuf_ready(const job_t* j) {
    return !j->qt || j->rows == 1 || j->xq || grow(&t_deq, &t_deq_cap, j->in * PANEL, sizeof(float)) != NULL;
}

/* a job's quantized panels [p0, p1) for every row into dst (row r, output o at dst[r * ldd + o - 16 p0]) */
static void qpanels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    long in = j->in, out = j->out, np = (out + PANEL - 1) / PANEL, bb = QPAN[j->qt] * PANEL, bs;
    if (j->xq) {
        i8_panels_into(j, p0, p1, dst, ldd);
        return;
    }
    if (j->rows > 1) {
        for (long p = p0; p < p1; p++) {
            const uint8_t* w = qpanel_at(j->qw, j->qt, in, np, p, &bs);
            qdeq_panel(j->qt, w, bs, in, t_deq);
            panel_rows(j, t_deq, p, p0, dst, ldd);
        }
        return;
    }
    for (long p = p0; p < p1;) {
        const uint8_t* w = qpanel_at(j->qw, j->qt, in, np, p, &bs);
        int NP = p % QNP == 0 && p1 - p >= QNP ? QNP : 1;
        v16 a[QNP] = {{0}};
        if (NP == QNP) qgemv(j->qt, w, bb, bs, in, j->xt, a, QNP);
        else qgemv(j->qt, w, bb, bs, in, j->xt, a, 1);
        for (int q = 0; q < NP; q++, p++) {
            long o = p * PANEL;
            int nc = out - o < PANEL ? (int)(out - o) : PANEL;
            store_row(a[q], dst + (o - p0 * PANEL), nc, j->b ? j->b + o : NULL, j->res ? j->res + o : NULL);
        }
    }
}
