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
   output holding 4 k (or 8, as nibbles), the integer path's operand (qint.c; Q8_0's bytes q + 128, the sign bit
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
   default): x as two int8 digits, see qint.c. Either way a row's result depends neither on the batch nor on the
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

/* The quantized products prefetch QPF bytes ahead with prefetcht2 (locality 1). Measured on this Zen 4
   (bench/serve_kernels_ab.py, single-stream decode, 2 threads, 6 rounds), against prefetchnta, which an earlier
   version used for one row: Q8_0 1.39x (AVX-512 VNNI) and 1.74x (x86-64-v3), Q4_1 1.19x and 1.46x; prefetcht1 the
   same as t2 (1.00x, 1.01x); prefetcht0 0.81x and 0.67x. With nta or t0 one thread streamed the Q8_0 head (49,152
   x 576) at 9-15 GB/s where t2 gives 15-23 (bench: a one-row product, weights past the caches). Several rows
   re-read each panel once per 4 rows, from L1/L2: those keep prefetcht0 (`one` 0): 16 users' batched decode
   (the engine alone, 16 x 128 tokens, 2 rounds each, alternating) 716-718 -> 753-764 tok/s on AVX-512 VNNI and
   368 -> 389-392 on x86-64-v3 against t2 for them too. */
#define PREFETCH(a) __builtin_prefetch((a), 0, 1)
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t* p, int bytes, const int one) {
    for (int l = 0; l < bytes; l += 64) {
        if (one) PREFETCH(p + QPF + l);
        else __builtin_prefetch(p + QPF + l, 0, 3);
    }
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
            if (!(k & 1)) PREFETCH(q + QPF);
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

/* the integer path (qint.c, included after this file): x as two int8 digits, every row against panels [p0, p1) */
static void i8_panels_into(const job_t* j, long p0, long p1, float* dst, long ldd);

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
