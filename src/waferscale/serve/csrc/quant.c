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

typedef uint32_t vu __attribute__((vector_size(VLANES * 4)));

/* VLANES bytes (or 16-bit words) at p -> VLANES int32 lanes, zero- or sign-extended, with each path's own
   widening instructions (__builtin_convertvector of the bytes would be scalarized by GCC: ~10x slower) */
static inline __attribute__((always_inline)) vi zx8p(const uint8_t* p) {
#if WSC_X86 == 512
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif WSC_X86 == 256
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#elif defined(WSC_NEON)
    uint32_t u;
    __builtin_memcpy(&u, p, 4);
    return (vi)vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(u))));
#else
    typedef uint8_t vb __attribute__((vector_size(VLANES)));
    vb b;
    __builtin_memcpy(&b, p, VLANES);
    return __builtin_convertvector(b, vi);
#endif
}
static inline __attribute__((always_inline)) vi sx8p(const uint8_t* p) {
#if WSC_X86 == 512
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif WSC_X86 == 256
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
#elif defined(WSC_NEON)
    uint32_t u;
    __builtin_memcpy(&u, p, 4);
    return (vi)vmovl_s16(vget_low_s16(vmovl_s8(vcreate_s8(u))));
#else
    typedef int8_t vb __attribute__((vector_size(VLANES)));
    vb b;
    __builtin_memcpy(&b, p, VLANES);
    return __builtin_convertvector(b, vi);
#endif
}
static inline __attribute__((always_inline)) vi zx16p(const uint8_t* p) {
#if WSC_X86 == 512
    return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
#elif WSC_X86 == 256
    return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(WSC_NEON)
    return (vi)vmovl_u16(vld1_u16((const uint16_t*)p));
#else
    typedef uint16_t vh __attribute__((vector_size(VLANES * 2)));
    vh b;
    __builtin_memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vi);
#endif
}

/* ---- each type's weights at k of a panel's block, part h of its 16 outputs (VLANES lanes from h VLANES) a
   vector: the one home of the arithmetic ---------------------------------------------------------------- */
#define CVF(v) __builtin_convertvector(v, vf)

static inline __attribute__((always_inline)) vf bf16_w(const uint8_t* p, int h) {  /* the high half of a float */
    return (vf)(zx16p(p + 2 * VLANES * h) << 16);
}
/* Q8_0 block: d[16] fp16, then eight groups of 4 k, 64 bytes each: output c's 32-bit word holds k = 4g + t in
   its byte t as q + 128 (q int8, its sign bit flipped), as the integer path's vpdpbusd takes them: d q. The four
   weight vectors of group g at q (d: part h of the block's): */
static inline __attribute__((always_inline)) void q8_group(const uint8_t* q, int h, vf d, vf* w) {
    vi L;
    __builtin_memcpy(&L, q + 4 * VLANES * h, sizeof L);
    L ^= (int)0x80808080u;  /* back to int8 */
    for (int t = 0; t < 4; t++) w[t] = CVF(L << (24 - 8 * t) >> 24) * d;
}
/* Q4_0 and Q4_1 blocks: d[16] (Q4_1: then m[16]), then four groups of 8 k, 64 bytes each: output c's 32-bit
   word holds k = 8g + t (t < 4) in the low nibble of its byte t and k = 8g + 4 + t in the high one, as the
   integer path's vpdpbusd takes them. Q4_1: d q + m; Q4_0: d (q - 8) = d q + m with m = -8 d (exact too). The
   eight weight vectors of group g at q: */
static inline __attribute__((always_inline)) void q4_group(const uint8_t* q, int h, vf d, vf m, vf* w) {
    vu L;
    __builtin_memcpy(&L, q + 4 * VLANES * h, sizeof L);
    for (int t = 0; t < 4; t++) {
        w[t] = CVF((vi)(L >> (8 * t) & 15)) * d + m;
        w[4 + t] = CVF((vi)(L >> (8 * t + 4) & 15)) * d + m;
    }
}
/* Q4_K super-block: d[16], dmin[16], scale[8][16], min[8][16] (bytes), then its 32 groups of 8 k as Q4_1's
   (at 320 + 64 g); sub-block s (32 k, groups 4s .. 4s + 3): (d scale_s) q - dmin min_s, Q4_1's d q + m with
   d = d scale_s and m = -(dmin min_s), both products exact. The two of sub-block s at blk: */
static inline __attribute__((always_inline)) void q4_k_scales(const uint8_t* blk, int s, int h, vf* ds, vf* m) {
    *ds = CVF(zx8p(blk + 64 + 16 * s + VLANES * h)) * ldhf(blk + 2 * VLANES * h);
    *m = -(CVF(zx8p(blk + 192 + 16 * s + VLANES * h)) * ldhf(blk + 32 + 2 * VLANES * h));
}
/* Q6_K super-block: d[16], scale[16][16] (int8), the low nibbles of k = 2i, 2i + 1 at 288 + 16 i, the high
   2 bits of k = 4g .. 4g + 3 at 2336 + 16 g; sub-block s (16 k): (d scale_s) (q - 32), ds = d scale_s */
static inline __attribute__((always_inline)) vf q6_k_scale(const uint8_t* blk, int s, int h) {
    return CVF(sx8p(blk + 32 + 16 * s + VLANES * h)) * ldhf(blk + 2 * VLANES * h);
}
static inline __attribute__((always_inline)) void q6_k_w(const uint8_t* lo, const uint8_t* hi, int h, vf ds,
                                                         vf* w) {
    vi e = zx8p(hi + VLANES * h), a = zx8p(lo + VLANES * h), b = zx8p(lo + 16 + VLANES * h);
    w[0] = CVF(((a & 15) | (e & 3) << 4) - 32) * ds;
    w[1] = CVF(((a >> 4) | (e >> 2 & 3) << 4) - 32) * ds;
    w[2] = CVF(((b & 15) | (e >> 4 & 3) << 4) - 32) * ds;
    w[3] = CVF(((b >> 4) | (e >> 6 & 3) << 4) - 32) * ds;
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

/* ---- one row against NP panels at w, ps bytes apart, their blocks bs apart: a[p NPARTS + h] += part h of
   panel p's FMA chain ---- */
#define A(p, h) a[(p) * NPARTS + (h)]

AI void gemv_bf16(const uint8_t* w, long ps, long bs, long in, const float* x, vf* a, const int NP) {
    for (long k = 0; k < in; k++) {
        vf xk = splatf(x[k]);
        FOR_P {
            const uint8_t* q = w + p * ps + k * bs;
            if (!(k & 1)) PREFETCH(q + QPF, 1);
            for (int h = 0; h < NPARTS; h++) A(p, h) += xk * bf16_w(q, h);
        }
    }
}

AI void gemv_q8_0(const uint8_t* w, long ps, long bs, long in, const float* x, vf* a, const int NP) {
    for (long j = 0; j < in / 32; j++) {
        const uint8_t* blk[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; prefetch_block(blk[p], 544, 1); }
        for (int h = 0; h < NPARTS; h++) {
            vf d[QNP];
            FOR_P d[p] = ldhf(blk[p] + 2 * VLANES * h);
            for (int g = 0; g < 8; g++) {
                const float* xg = x + 32 * j + 4 * g;
                FOR_P {
                    vf wv[4];
                    q8_group(blk[p] + 32 + 64 * g, h, d[p], wv);
                    for (int t = 0; t < 4; t++) A(p, h) += splatf(xg[t]) * wv[t];
                }
            }
        }
    }
}

/* Q4_0 and Q4_1 (has_m) */
AI void gemv_q4(const uint8_t* w, long ps, long bs, long in, const float* x, vf* a, const int NP,
                const int has_m) {
    const int bb = has_m ? 320 : 288, qo = has_m ? 64 : 32;
    for (long j = 0; j < in / 32; j++) {
        const uint8_t* blk[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; prefetch_block(blk[p], bb, 1); }
        for (int h = 0; h < NPARTS; h++) {
            vf d[QNP], m[QNP];
            FOR_P {
                d[p] = ldhf(blk[p] + 2 * VLANES * h);
                m[p] = has_m ? ldhf(blk[p] + 32 + 2 * VLANES * h) : d[p] * -8.0f;
            }
            for (int g = 0; g < 4; g++) {
                const float* xg = x + 32 * j + 8 * g;
                FOR_P {
                    vf wv[8];
                    q4_group(blk[p] + qo + 64 * g, h, d[p], m[p], wv);
                    for (int t = 0; t < 8; t++) A(p, h) += splatf(xg[t]) * wv[t];
                }
            }
        }
    }
}

AI void gemv_q4_k(const uint8_t* w, long ps, long bs, long in, const float* x, vf* a, const int NP) {
    for (long j = 0; j < in / 256; j++) {
        const uint8_t* blk[QNP];
        FOR_P blk[p] = w + p * ps + j * bs;
        for (int s = 0; s < 8; s++) {
            FOR_P prefetch_block(blk[p] + 320 + 256 * s, 256, 1);
            for (int h = 0; h < NPARTS; h++) {
                vf ds[QNP], m[QNP];
                FOR_P q4_k_scales(blk[p], s, h, &ds[p], &m[p]);
                for (int g = 0; g < 4; g++) {
                    const float* xg = x + 256 * j + 32 * s + 8 * g;
                    FOR_P {
                        vf wv[8];
                        q4_group(blk[p] + 320 + 64 * (4 * s + g), h, ds[p], m[p], wv);
                        for (int t = 0; t < 8; t++) A(p, h) += splatf(xg[t]) * wv[t];
                    }
                }
            }
        }
    }
}

AI void gemv_q6_k(const uint8_t* w, long ps, long bs, long in, const float* x, vf* a, const int NP) {
    for (long j = 0; j < in / 256; j++) {
        const uint8_t* blk[QNP];
        FOR_P blk[p] = w + p * ps + j * bs;
        for (int s = 0; s < 16; s++) {
            FOR_P {
                prefetch_block(blk[p] + 288 + 128 * s, 128, 1);
                prefetch_block(blk[p] + 2336 + 64 * s, 64, 1);
            }
            for (int h = 0; h < NPARTS; h++) {
                vf ds[QNP];
                FOR_P ds[p] = q6_k_scale(blk[p], s, h);
                for (int g = 0; g < 4; g++) {
                    const float* xk = x + 256 * j + 16 * s + 4 * g;
                    vf xv[4] = {splatf(xk[0]), splatf(xk[1]), splatf(xk[2]), splatf(xk[3])};
                    FOR_P {
                        vf wv[4];
                        q6_k_w(blk[p] + 288 + 16 * (8 * s + 2 * g), blk[p] + 2336 + 16 * (4 * s + g), h, ds[p], wv);
                        for (int t = 0; t < 4; t++) A(p, h) += xv[t] * wv[t];
                    }
                }
            }
        }
    }
}

/* one row against NP panels of type qt (NP constant at each call) */
AI void qgemv(int qt, const uint8_t* w, long ps, long bs, long in, const float* x, vf* a, const int NP) {
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
#define PUT(k, v) do { vf v_ = (v); __builtin_memcpy(dst + (k) * PANEL + h * VLANES, &v_, sizeof v_); } while (0)
    vf wv[8];
    for (int h = 0; h < NPARTS; h++) switch (qt) {
    case QT_BF16:
        for (long k = 0; k < in; k++) PUT(k, bf16_w(w + k * bs, h));
        break;
    case QT_Q8_0:
        for (long j = 0; j < in / 32; j++) {
            const uint8_t* b = w + j * bs;
            vf d = ldhf(b + 2 * VLANES * h);
            for (int g = 0; g < 8; g++) {
                q8_group(b + 32 + 64 * g, h, d, wv);
                for (int t = 0; t < 4; t++) PUT(32 * j + 4 * g + t, wv[t]);
            }
        }
        break;
    case QT_Q4_0: case QT_Q4_1: {
        int has_m = qt == QT_Q4_1;
        for (long j = 0; j < in / 32; j++) {
            const uint8_t* b = w + j * bs;
            vf d = ldhf(b + 2 * VLANES * h), m = has_m ? ldhf(b + 32 + 2 * VLANES * h) : d * -8.0f;
            for (int g = 0; g < 4; g++) {
                q4_group(b + (has_m ? 64 : 32) + 64 * g, h, d, m, wv);
                for (int t = 0; t < 8; t++) PUT(32 * j + 8 * g + t, wv[t]);
            }
        }
        break;
    }
    case QT_Q4_K:
        for (long j = 0; j < in / 256; j++) {
            const uint8_t* b = w + j * bs;
            for (int s = 0; s < 8; s++) {
                vf ds, m;
                q4_k_scales(b, s, h, &ds, &m);
                for (int g = 0; g < 4; g++) {
                    q4_group(b + 320 + 64 * (4 * s + g), h, ds, m, wv);
                    for (int t = 0; t < 8; t++) PUT(256 * j + 32 * s + 8 * g + t, wv[t]);
                }
            }
        }
        break;
    case QT_Q6_K:
        for (long j = 0; j < in / 256; j++) {
            const uint8_t* b = w + j * bs;
            for (int s = 0; s < 16; s++) {
                vf ds = q6_k_scale(b, s, h);
                for (int g = 0; g < 4; g++) {
                    q6_k_w(b + 288 + 16 * (8 * s + 2 * g), b + 2336 + 16 * (4 * s + g), h, ds, wv);
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

/* VLANES floats t rounded half away from zero (|t| < 127.5) to int32, saturated to int8's range (for a t out of
   range: an x of NaN or inf); and VLANES such int32 stored as int8 at q */
static inline __attribute__((always_inline)) vi round_i8(vf t) {
    vf half = (vf)(((vi)t & (int)0x80000000u) | (vi)((vf){0} + 0.5f));  /* 0.5 with t's sign */
    vi qi = __builtin_convertvector(t + half, vi);  /* truncation */
#if WSC_X86 == 512
    return (vi)_mm512_max_epi32(_mm512_min_epi32((__m512i)qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
#elif WSC_X86 == 256
    return (vi)_mm256_max_epi32(_mm256_min_epi32((__m256i)qi, _mm256_set1_epi32(127)), _mm256_set1_epi32(-128));
#elif defined(WSC_NEON)
    return (vi)vmaxq_s32(vminq_s32((int32x4_t)qi, vdupq_n_s32(127)), vdupq_n_s32(-128));
#else
    vi hi = qi > 127, lo = qi < -128;
    return (qi & ~(hi | lo)) | (127 & hi) | (-128 & lo);
#endif
}
static inline __attribute__((always_inline)) void store_i8(int8_t* q, vi v) {
#if WSC_X86 == 512
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8((__m512i)v));
#elif WSC_X86 == 256
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    _mm_storel_epi64((__m128i*)q, _mm_packs_epi16(w, w));
#elif defined(WSC_NEON)
    int16x4_t w = vqmovn_s32((int32x4_t)v);
    vst1_lane_s32((int32_t*)(void*)q, vreinterpret_s32_s8(vqmovn_s16(vcombine_s16(w, w))), 0);
#else
    for (int c = 0; c < VLANES; c++) q[c] = (int8_t)v[c];
#endif
}

/* the largest and the sum of VLANES int32 lanes (integers: the order does not matter) */
static inline __attribute__((always_inline)) int hmaxi(vi v) {
#if WSC_X86 == 512
    return _mm512_reduce_max_epi32((__m512i)v);
#elif WSC_X86 == 256
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    return _mm_cvtsi128_si32(_mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
#elif defined(WSC_NEON)
    return vmaxvq_s32((int32x4_t)v);
#else
    int m = v[0];
    for (int c = 1; c < VLANES; c++) m = v[c] > m ? v[c] : m;
    return m;
#endif
}
static inline __attribute__((always_inline)) int hsumi(vi v) {
#if WSC_X86 == 512
    return _mm512_reduce_add_epi32((__m512i)v);
#elif WSC_X86 == 256
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
#elif defined(WSC_NEON)
    return vaddvq_s32((int32x4_t)v);
#else
    int s = 0;
    for (int c = 0; c < VLANES; c++) s += v[c];
    return s;
#endif
}

/* x (rows, in) -> per row its two int8 digits, xq then xr (2 in bytes a row), and xs (rows, in / 32, XS): each
   block's dx, dr, sum of x (the sum in a fixed order: lanes pairwise, then hsum16), and 128 times the sum of
   its xq and of its xr (Q8_0's correction, q8_part). xq = x / dx rounded half away from zero, dx = max |x| / 127
   (over the non-NaN x; 0 if none); xr = (x - dx xq) / dr rounded, dr = dx / 254 (|x - dx xq| <= dx / 2, so |xr|
   <= 127); digits saturated to int8 (an x of NaN or inf) before they are summed. */
static void quantize_x(const float* x, long rows, long in, int8_t* xq, float* xs) {
    long nb = in / 32;
    for (long r = 0; r < rows; r++)
        for (long j = 0; j < nb; j++) {
            const float* v = x + r * in + 32 * j;
            vf xv[32 / VLANES];
            vi mx = {0};
            for (int i = 0; i < 32 / VLANES; i++) {
                __builtin_memcpy(&xv[i], v + VLANES * i, sizeof xv[i]);
                vi ab = (vi)xv[i] & 0x7FFFFFFF;
                ab &= ab <= 0x7F800000;  /* |x| as its bits (which order as the values), NaN as 0 */
#if WSC_X86 == 512
                mx = (vi)_mm512_max_epi32((__m512i)mx, (__m512i)ab);
#elif WSC_X86 == 256
                mx = (vi)_mm256_max_epi32((__m256i)mx, (__m256i)ab);
#elif defined(WSC_NEON)
                mx = (vi)vmaxq_s32((int32x4_t)mx, (int32x4_t)ab);
#else
                mx = (mx & (mx >= ab)) | (ab & (mx < ab));
#endif
            }
            int mb = hmaxi(mx);
            float amax;
            __builtin_memcpy(&amax, &mb, 4);
            float dx = amax / 127, id = dx > 0 ? 1 / dx : 0, dr = dx / 254, idr = dr > 0 ? 1 / dr : 0;
            int8_t *q = xq + 2 * r * in + 32 * j, *qr = q + in;
            vi sq = {0}, sr = {0};
            for (int i = 0; i < 32 / VLANES; i++) {
                vi qi = round_i8(xv[i] * id);
                vi ri = round_i8((xv[i] - __builtin_convertvector(qi, vf) * dx) * idr);
                store_i8(q + VLANES * i, qi);
                store_i8(qr + VLANES * i, ri);
                sq += qi;
                sr += ri;
            }
            float* s = xs + XS * (r * nb + j);
            s[0] = dx;
            s[1] = dr;
            s[2] = hsum16(ld16(v) + ld16(v + 16));
            s[3] = (float)(128 * hsumi(sq));  /* (integers under 2^24: exact in float) */
            s[4] = (float)(128 * hsumi(sr));
        }
}

/* the four bytes at x in every lane (a 32-bit load of its own, broadcast from memory: a wider load split in
   registers costs each broadcast two more vector uops) */
static inline vi bcast4(const int8_t* x) {
    int32_t b;
    __builtin_memcpy(&b, x, 4);
    return (vi){0} + b;
}

/* The integer dots of each path. Each output's block sum is an exact integer on every path (the same as the
   portable code's), however it is reached:
   - the dot-product instructions (AVX-512 VNNI and AVX-VNNI's vpdpbusd, ARM's usdot with i8mm or sdot) add per
     lane the four u8 bytes of the weights times the four s8 bytes of x (x: the same four in every lane);
   - AVX2 and AVX-512 without VNNI have vpmaddubsw, which sums u8 x s8 pairs into 16 bits (saturating): their
     sums stay in 16-bit lanes, where they cannot overflow, for as many steps as the bounds below allow, then one
     vpmaddwd widens them. A Q4 nibble (< 16) times x (|x| <= 128): a pair < 2^12, two nibbles' pairs < 2^13,
     four such steps < 2^15. A Q8_0 byte is split into its two nibbles, each summed as a Q4 nibble (a pair
     < 2^12, eight steps < 2^15), the high sums then times 16.
   - plain NEON widens to 16-bit products (each < 2^15) and adds pairs.
   p7: the sums over Q4 nibbles (q4dot: lo nibbles against x0, hi nibbles against x1), p7sum after at most four
   q4dot; p8: over Q8_0 bytes (q8dot), p8sum after at most eight q8dot (a block). */
#if WSC_X86 == 512
#define MADDUBS(a, b) _mm512_maddubs_epi16((__m512i)(a), (__m512i)(b))
#define MADD(a, k) (vi)_mm512_madd_epi16((a), _mm512_set1_epi16(k))
#define ADD16(a, b) _mm512_add_epi16((a), (b))
typedef __m512i v16x;
#elif WSC_X86 == 256
#define MADDUBS(a, b) _mm256_maddubs_epi16((__m256i)(a), (__m256i)(b))
#define MADD(a, k) (vi)_mm256_madd_epi16((a), _mm256_set1_epi16(k))
#define ADD16(a, b) _mm256_add_epi16((a), (b))
typedef __m256i v16x;
#endif
#if (WSC_X86 == 512 && defined(__AVX512VNNI__)) || (WSC_X86 == 256 && defined(__AVXVNNI__))
#define DPBUSD 1
#endif

#if defined(WSC_X86) && !defined(DPBUSD)
/* each step's sum, as it is: integer sums are associative, and GCC otherwise reorders the adds of a whole block
   into a tree whose products wait in more registers than AVX2 has (spilled to the stack: ~2x slower) */
#define KEEP(v) __asm__("" : "+x"(v))
#define PAIRS16 1  /* sums held in 16 bits (vpmaddubsw), widened by p7sum / p8sum */
typedef v16x p7_t;
typedef struct { v16x l, h; } p8_t;
#else
typedef vi p7_t;
typedef vi p8_t;
#endif

#if defined(WSC_NEON) && !defined(__ARM_FEATURE_MATMUL_INT8) && !defined(__ARM_FEATURE_DOTPROD)
static inline vi neon_dp(vi acc, vi a, vi b) {  /* widened: each u8 x s8 product fits 16 bits */
    int16x8_t bl = vmovl_s8(vget_low_s8((int8x16_t)b)), bh = vmovl_high_s8((int8x16_t)b);
    int16x8_t al = (int16x8_t)vmovl_u8(vget_low_u8((uint8x16_t)a)), ah = (int16x8_t)vmovl_high_u8((uint8x16_t)a);
    return acc + (vi)vpaddq_s32(vpaddlq_s16(vmulq_s16(al, bl)), vpaddlq_s16(vmulq_s16(ah, bh)));
}
#endif

/* acc + per lane the sum of its four u8 bytes of a times the four s8 bytes of b (b: the same in every lane) */
static inline __attribute__((always_inline)) vi dp(vi acc, vi a, vi b) {
#if defined(DPBUSD) && WSC_X86 == 512
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif defined(DPBUSD)
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)a, (__m256i)b);
#elif defined(WSC_NEON) && defined(__ARM_FEATURE_MATMUL_INT8)
    return (vi)vusdotq_s32((int32x4_t)acc, (uint8x16_t)a, (int8x16_t)b);
#elif defined(WSC_NEON) && defined(__ARM_FEATURE_DOTPROD)  /* a = (a - 128) + 128, both signed dots */
    int32x4_t sb = vdotq_s32(vdupq_n_s32(0), vdupq_n_s8(1), (int8x16_t)b);
    return (vi)vdotq_s32((int32x4_t)acc, (int8x16_t)(a ^ (int)0x80808080u), (int8x16_t)b) + ((vi)sb << 7);
#elif defined(WSC_NEON)
    return neon_dp(acc, a, b);
#else
    for (int t = 0; t < 4; t++) acc += (vi)((vu)a >> (8 * t) & 255) * (int8_t)(b[0] >> (8 * t));
    return acc;
#endif
}

static inline __attribute__((always_inline)) p7_t p7zero(void) { return (p7_t){0}; }
/* acc + lo's bytes (< 16) times x0's + hi's times x1's */
static inline __attribute__((always_inline)) p7_t q4dot(p7_t acc, vi lo, vi x0, vi hi, vi x1) {
#ifdef PAIRS16
    acc = ADD16(acc, ADD16(MADDUBS(lo, x0), MADDUBS(hi, x1)));
    KEEP(acc);
    return acc;
#elif defined(WSC_NEON) && defined(__ARM_FEATURE_DOTPROD) && !defined(__ARM_FEATURE_MATMUL_INT8)
    return (vi)vdotq_s32(vdotq_s32((int32x4_t)acc, (int8x16_t)lo, (int8x16_t)x0), (int8x16_t)hi, (int8x16_t)x1);
#else
    return dp(dp(acc, lo, x0), hi, x1);
#endif
}
static inline __attribute__((always_inline)) vi p7sum(p7_t acc) {
#ifdef PAIRS16
    return MADD(acc, 1);
#else
    return acc;
#endif
}

static inline __attribute__((always_inline)) p8_t p8zero(void) { return (p8_t){0}; }
/* acc + a's bytes (any) times x's */
static inline __attribute__((always_inline)) p8_t q8dot(p8_t acc, vi a, vi x) {
#ifdef PAIRS16
    acc.l = ADD16(acc.l, MADDUBS(a & 0x0F0F0F0F, x));
    acc.h = ADD16(acc.h, MADDUBS((vi)((vu)a >> 4) & 0x0F0F0F0F, x));
    KEEP(acc.l);
    KEEP(acc.h);
    return acc;
#else
    return dp(acc, a, x);
#endif
}
static inline __attribute__((always_inline)) vi p8sum(p8_t acc) {
#ifdef PAIRS16
    return MADD(acc.l, 1) + MADD(acc.h, 16);
#else
    return acc;
#endif
}

/* The integer path runs NP panels x MR rows at once (NP MR <= 4: one decode row against a group of panels, or
   up to four rows against one panel), block by block. A panel's 16 outputs go in NPARTS parts of VLANES lanes (one
   native register), one after the other within each block, and the sums are kept in parts too: a[i NPARTS + h] is
   part h of the sums of i = p MR + r. Within a part, ICHUNK of the NP x MR products at a time (as many as the path's
   registers hold: each weight group is loaded and unpacked once for their rows, each row's x words broadcast
   once for their panels). */
#ifdef PAIRS16
#define ICHUNK 2
#else
#define ICHUNK 4
#endif
/* x's words are broadcast again in each part and chunk: a pointer the compiler cannot see through keeps it
   from holding every broadcast of a block in registers it does not have (AVX2: spilled to the stack) */
#define OPAQUE(ptr) __asm__("" : "+r"(ptr))
#define FOR_CHUNK(NP, MR) for (int c0 = 0; c0 < (NP > 1 ? NP : MR); c0 += ICHUNK)
#define CP(NP) (NP > 1 ? ICHUNK : 1)          /* panels of a chunk */
#define CR(NP, MR) (NP > 1 ? MR : ICHUNK < MR ? ICHUNK : MR)  /* rows of a chunk */

/* part h of block j of NP panels of Q8_0 (blk[p]) against MR rows r0 .. of xq (two digits, ldq apart) into a
   (rows MRA apart): vpdpbusd takes one side unsigned: the panels hold q + 128, so 128 times the block's sum of
   each digit (xs) comes off, in float: both terms are integers below 2^24, so the difference is exact, the
   integer sum itself */
AI void q8_part(const uint8_t* const* blk, long j, long in, const int8_t* xq, const float* xs, long ldq, long nb,
                vf* a, int MRA, const int h, const int NP, const int MR) {
    OPAQUE(xq);
    p8_t pq[ICHUNK], pr[ICHUNK];  /* (eight q8dot each: p8sum's bound) */
    for (int i = 0; i < NP * MR; i++) pq[i] = pr[i] = p8zero();
    for (int g = 0; g < 8; g++) {
        vi xb[ICHUNK][2];
        for (int r = 0; r < MR; r++) {
            xb[r][0] = bcast4(xq + r * ldq + 32 * j + 4 * g);
            xb[r][1] = bcast4(xq + r * ldq + in + 32 * j + 4 * g);
        }
        FOR_P {
            vi L;
            __builtin_memcpy(&L, blk[p] + 32 + 64 * g + 4 * VLANES * h, sizeof L);
            for (int r = 0; r < MR; r++) {
                pq[p * MR + r] = q8dot(pq[p * MR + r], L, xb[r][0]);
                pr[p * MR + r] = q8dot(pr[p * MR + r], L, xb[r][1]);
            }
        }
    }
    FOR_P {
        vf d = ldhf(blk[p] + 2 * VLANES * h);
        for (int r = 0; r < MR; r++) {
            const float* s = xs + XS * (r * nb + j);
            int i = p * MR + r;
            vf* t = &a[(p * MRA + r) * NPARTS + h];
            *t += (__builtin_convertvector(p8sum(pq[i]), vf) - s[3]) * (d * s[0]);
            *t += (__builtin_convertvector(p8sum(pr[i]), vf) - s[4]) * (d * s[1]);
        }
    }
}

/* MR rows of xq against NP panels of Q8_0: a[(p MR + r) NPARTS + h] += their block sums */
AI void i8_q8(const uint8_t* w, long ps, long bs, long in, const int8_t* xq, const float* xs, long ldq, vf* a,
              const int NP, const int MR) {
    const long nb = in / 32;
    for (long j = 0; j < nb; j++) {
        const uint8_t* blk[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; prefetch_block(blk[p], 544, MR == 1); }
        for (int h = 0; h < NPARTS; h++)
            FOR_CHUNK(NP, MR) {
                int p0 = NP > 1 ? c0 : 0, r0 = NP > 1 ? 0 : c0;
                q8_part(blk + p0, j, in, xq + r0 * ldq, xs + XS * r0 * nb, ldq, nb, a + (p0 * MR + r0) * NPARTS, MR, h,
                        CP(NP), CR(NP, MR));
            }
    }
}

/* part h of one sub-block of 32 k of NP panels (q[p]: its 4 groups of 8 k, Q4_1's layout; d[p], m[p] part h of
   its scales) against MR rows into a (rows MRA apart): d dx (sum q xq) + d dr (sum q xr) + m sum x (xs: each
   row's dx, dr, sum x of this block, XS nb floats apart) */
AI void q4_part(const uint8_t* const* q, const vf* d, const vf* m, const int8_t* xq, long ldq, long in,
                const float* xs, long nb, vf* a, int MRA, const int h, const int NP, const int MR) {
    OPAQUE(xq);
    p7_t pq[ICHUNK], pr[ICHUNK];  /* (four q4dot each: p7sum's bound) */
    for (int i = 0; i < NP * MR; i++) pq[i] = pr[i] = p7zero();
    for (int g = 0; g < 4; g++) {
        vi xb[ICHUNK][4];
        for (int r = 0; r < MR; r++) {
            const int8_t* x = xq + r * ldq + 8 * g;
            xb[r][0] = bcast4(x), xb[r][1] = bcast4(x + 4), xb[r][2] = bcast4(x + in), xb[r][3] = bcast4(x + in + 4);
        }
        FOR_P {
            vi L;
            __builtin_memcpy(&L, q[p] + 64 * g + 4 * VLANES * h, sizeof L);
            vi lo = L & 0x0F0F0F0F, hi = (vi)((vu)L >> 4) & 0x0F0F0F0F;
            for (int r = 0; r < MR; r++) {
                int i = p * MR + r;
                pq[i] = q4dot(pq[i], lo, xb[r][0], hi, xb[r][1]);
                pr[i] = q4dot(pr[i], lo, xb[r][2], hi, xb[r][3]);
            }
        }
    }
    FOR_P for (int r = 0; r < MR; r++) {
        const float* s = xs + XS * r * nb;
        int i = p * MR + r;
        vf* t = &a[(p * MRA + r) * NPARTS + h];
        *t += __builtin_convertvector(p7sum(pq[i]), vf) * (d[p] * s[0]);
        *t += __builtin_convertvector(p7sum(pr[i]), vf) * (d[p] * s[1]);
        *t += m[p] * s[2];
    }
}

/* MR rows of xq (two digits, ldq apart) against NP panels of Q4_0 / Q4_1 (has_m) / Q4_K (kq): a[(p MR + r) NPARTS +
   h] += their block sums. The scales as q4_k_scales and gemv_q4 compute them, part by part. */
AI void i8_q4(const uint8_t* w, long ps, long bs, long in, const int8_t* xq, const float* xs, long ldq, vf* a,
              const int NP, const int MR, const int has_m, const int kq) {
    const int bb = has_m ? 320 : 288, qo = has_m ? 64 : 32;
    const long nb = in / 32;
    for (long j = 0; j < nb / (kq ? 8 : 1); j++) {
        const uint8_t* blk[QNP];
        for (int s = 0; s < (kq ? 8 : 1); s++) {  /* Q4_K's eight sub-blocks of 32 k, or the one block */
            const uint8_t* q[QNP];
            vf d[QNP], m[QNP];
            FOR_P {
                blk[p] = w + p * ps + j * bs;
                q[p] = kq ? blk[p] + 320 + 256 * s : blk[p] + qo;
                if (kq) prefetch_block(q[p], 256, MR == 1);
                else prefetch_block(blk[p], bb, MR == 1);
            }
            for (int h = 0; h < NPARTS; h++) {
                FOR_P {
                    if (kq) {
                        q4_k_scales(blk[p], s, h, &d[p], &m[p]);
                    } else {
                        d[p] = ldhf(blk[p] + 2 * VLANES * h);
                        m[p] = has_m ? ldhf(blk[p] + 32 + 2 * VLANES * h) : d[p] * -8.0f;
                    }
                }
                long k0 = kq ? 256 * j + 32 * s : 32 * j, b0 = kq ? 8 * j + s : j;
                FOR_CHUNK(NP, MR) {
                    int p0 = NP > 1 ? c0 : 0, r0 = NP > 1 ? 0 : c0;
                    q4_part(q + p0, d + p0, m + p0, xq + r0 * ldq + k0, ldq, in, xs + XS * (r0 * nb + b0), nb,
                            a + (p0 * MR + r0) * NPARTS, MR, h, CP(NP), CR(NP, MR));
                }
            }
        }
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
            vf a[QNP * 4 * NPARTS] = {{0}};
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
                    store_row(join(&a[(q * MR + r) * NPARTS]), dst + row * ldd + (o - p0 * PANEL), nc, j->b ? j->b + o : NULL,
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
        vf a[QNP * NPARTS] = {{0}};
        if (NP == QNP) qgemv(j->qt, w, bb, bs, in, j->xt, a, QNP);
        else qgemv(j->qt, w, bb, bs, in, j->xt, a, 1);
        for (int q = 0; q < NP; q++, p++) {
            long o = p * PANEL;
            int nc = out - o < PANEL ? (int)(out - o) : PANEL;
            store_row(join(&a[q * NPARTS]), dst + (o - p0 * PANEL), nc, j->b ? j->b + o : NULL, j->res ? j->res + o : NULL);
        }
    }
}
