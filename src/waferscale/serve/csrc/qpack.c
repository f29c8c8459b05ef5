/* GGUF's rows in and out of the kernels: packing them into quantized panels (quant.c's layout) and reading rows
   back as floats (an embedding lookup). */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

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
        if (qt == QT_Q4_1) sc[1] = (uint16_t)(b[2] | b[3] << 8);
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
    for (long i = 0; i < np * pb; i++) dst[i] = 0;
    uint8_t q[256] = {0}, sb[16] = {0};
    uint16_t sc[2] = {0, 0};
    for (long p = 0; p < np; p++)
        for (int c = 0; c < PANEL && p * PANEL + c < out; c++) {
            const uint8_t* row = src + (p * PANEL + c) * rb;
            long bs;
            uint8_t* at = (uint8_t*)qpanel_at(dst, qt, in, np, p, &bs);
            if (qt == QT_BF16) {
                for (long k = 0; k < in; k++) {
                    at[k * bs + 2 * c] = row[2 * k];
                    at[k * bs + 2 * c + 1] = row[2 * k + 1];
                }
                continue;
            }
            for (long j = 0; j < nb; j++) {
                uint8_t* o = at + j * bs;
                qdecode(qt, row + j * QROW[qt], q, sc, sb);
                o[2 * c] = (uint8_t)sc[0];
                o[2 * c + 1] = (uint8_t)(sc[0] >> 8);
                switch (qt) {
                case QT_Q8_0:
                    for (int k = 0; k < 32; k++) o[32 + 64 * (k >> 2) + 4 * c + (k & 3)] = q[k] ^ 0x80;
                    break;
                case QT_Q4_0: case QT_Q4_1: {
                    int h = qt == QT_Q4_1 ? 64 : 32;
                    if (qt == QT_Q4_1) { o[32 + 2 * c] = (uint8_t)sc[1]; o[33 + 2 * c] = (uint8_t)(sc[1] >> 8); }
                    for (int k = 0; k < 32; k++) o[h + 64 * (k >> 3) + 4 * c + (k & 3)] |= (uint8_t)(q[k] << (k & 4));
                    break;
                }
                case QT_Q4_K:
                    o[32 + 2 * c] = (uint8_t)sc[1];
                    o[33 + 2 * c] = (uint8_t)(sc[1] >> 8);
                    for (int s = 0; s < 8; s++) { o[64 + 16 * s + c] = sb[s]; o[192 + 16 * s + c] = sb[8 + s]; }
                    for (int k = 0; k < 256; k++)
                        o[320 + 64 * (k >> 3) + 4 * c + (k & 3)] |= (uint8_t)(q[k] << (k & 4));
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

/* rows ids[0 .. n) of W as GGUF rows (`src`, in / QK[qt] * QROW[qt] bytes each; bf16 and every block type) ->
   float32 dst (n, in), each value computed as gguf.quants.dequantize computes it: d q (Q8_0, Q4_0 with q - 8),
   d q + m (Q4_1), (d scale_s) q - dmin min_s (Q4_K), (d scale_s) (q - 32) (Q6_K), in float32, the products
   that numpy rounds rounded alike (every one exact but Q6_K's last). 0; -1 for a type it does not read, -2 for
   an id outside [0, out) (nothing written). */
int wsc_qrows(const uint8_t* src, int qt, long out, long in, const int64_t* ids, long n, float* dst) {
    if (qt <= QT_F32 || qt >= QT_N || in % QK[qt]) return -1;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= out) return -2;
    long nb = in / QK[qt], rb = nb * QROW[qt];
    uint8_t q[256], sb[16];
    uint16_t sc[2] = {0, 0};
    for (long i = 0; i < n; i++) {
        const uint8_t* row = src + ids[i] * rb;
        float* y = dst + i * in;
        if (qt == QT_BF16) {
            for (long k = 0; k < in; k++) {
                uint32_t u = (uint32_t)(row[2 * k] | row[2 * k + 1] << 8) << 16;
                __builtin_memcpy(y + k, &u, 4);
            }
            continue;
        }
        for (long j = 0; j < nb; j++, y += QK[qt]) {
            qdecode(qt, row + j * QROW[qt], q, sc, sb);
            float d = h2f(sc[0]), m = h2f(sc[1]);
            switch (qt) {
            case QT_Q8_0: for (int k = 0; k < 32; k++) y[k] = d * (float)(int8_t)q[k]; break;
            case QT_Q4_0: for (int k = 0; k < 32; k++) y[k] = d * (float)(q[k] - 8); break;
            case QT_Q4_1: for (int k = 0; k < 32; k++) y[k] = d * (float)q[k] + m; break;
            case QT_Q4_K:
                for (int s = 0; s < 8; s++) {
                    float ds = d * (float)sb[s], ms = m * (float)sb[8 + s];
                    for (int k = 32 * s; k < 32 * s + 32; k++) y[k] = ds * (float)q[k] - ms;
                }
                break;
            case QT_Q6_K:
                for (int s = 0; s < 16; s++) {
                    float ds = d * (float)(int8_t)sb[s];
                    for (int k = 16 * s; k < 16 * s + 16; k++) y[k] = ds * (float)(q[k] - 32);
                }
                break;
            }
        }
    }
    return 0;
}
