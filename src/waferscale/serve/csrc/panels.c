/* Products over weights packed in panels: the microkernel, a job's panels into a buffer, packing x. */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* ---- y = residual + x W^T + bias over W packed in panels ---------------------------------------------
   W (out, in) is stored as ceil(out / 16) panels of (in, 16): panel p holds W[16 p + c][k] at [k][c] (rows
   past `out` are zero). A panel is one sequential stream of memory, whatever the number of x rows, and the
   microkernel keeps up to 16 x rows' sums for its 16 outputs in 16 vector registers: per k one panel load,
   and one broadcast x element and one FMA per row; no horizontal sums. Each output is one FMA chain over k
   in order (then + bias, then residual +), the same chain whatever the number of rows, the row's tile or the
   thread: results do not depend on the batch or the thread count. x rows go in tiles of 16, each tile
   transposed to (in, rows in the tile) so that a step of k reads one short contiguous run. */

/* one row's sums of one panel's outputs, nc (<= 16) of them: dst[c] = res[c] + (a[c] + b[c]) (b, res may be NULL) */
static inline __attribute__((always_inline)) void store_row(v16 a, float* dst, int nc, const float* b,
                                                            const float* res) {
    if (nc == PANEL) {
        if (b) a = a + ld16(b);
        if (res) a = ld16(res) + a;
        __builtin_memcpy(dst, &a, sizeof a);
        return;
    }
    float s[PANEL];
    __builtin_memcpy(s, &a, sizeof s);
    for (int c = 0; c < nc; c++) {
        float z = s[c];
        if (b) z = z + b[c];
        if (res) z = res[c] + z;
        dst[c] = z;
    }
}

/* MR (<= TILE) rows of one tile against one panel: dst[r * ldd + c] = res[r * ldr + c] + (sum_k xt[k * MR + r]
   * wp[k * 16 + c] + b[c]), c < nc. Called with constant MR so that each case compiles to its own loop. The
   sums are kept in native registers, NPARTS a row (kernels.h). */
static inline __attribute__((always_inline)) void pmk(const float* wp, const float* xt, long K, int MR,
                                                      float* dst, long ldd, int nc, const float* b,
                                                      const float* res, long ldr) {
    vf a[TILE][NPARTS];
#pragma GCC unroll 16
    for (int r = 0; r < TILE; r++)
        for (int h = 0; h < NPARTS; h++) a[r][h] = (vf){0};
    for (long k = 0; k < K; k++) {
        vf w[NPARTS];
        for (int h = 0; h < NPARTS; h++) w[h] = ldf(wp + k * PANEL + h * VLANES);
#if PF_DIST > 0
        __builtin_prefetch(wp + k * PANEL + PF_DIST, 0, 3);
#endif
#if WSC_X86 == 512
        __asm__("" : "+v"(w[0]));  /* one load, kept in a register (not folded into every FMA) */
#endif
        const float* xk = xt + k * MR;
#pragma GCC unroll 16
        for (int r = 0; r < TILE; r++)
            if (r < MR) {
                vf xb = splatf(xk[r]);
                for (int h = 0; h < NPARTS; h++) a[r][h] += xb * w[h];
            }
    }
#pragma GCC unroll 16
    for (int r = 0; r < TILE; r++) if (r < MR) store_row(join(a[r]), dst + r * ldd, nc, b, res ? res + r * ldr : NULL);
}

/* every row of job j against panel p, stored at wp (in, 16), into dst (row r, output o at dst[r * ldd + o -
   16 p0]); the quantized panels (quant.c) come here dequantized */
static void panel_rows(const job_t* j, const float* wp, long p, long p0, float* dst, long ldd) {
    long R = j->rows, in = j->in, out = j->out;
    long o = p * PANEL;
    int nc = out - o < PANEL ? (int)(out - o) : PANEL;
    const float* b = j->b ? j->b + o : NULL;
    for (long t0 = 0; t0 < R; t0 += TILE) {
        int MR = R - t0 < TILE ? (int)(R - t0) : TILE;
        const float* xt = j->xt + (size_t)t0 * in;
        float* d = dst + t0 * ldd + (o - p0 * PANEL);
        const float* res = j->res ? j->res + (size_t)t0 * out + o : NULL;
        switch (MR) {  /* (a compiled case per row count) */
#define PMK(n) case n: pmk(wp, xt, in, n, d, ldd, nc, b, res, out); break;
        PMK(1) PMK(2) PMK(3) PMK(4) PMK(5) PMK(6)
#if TILE > 6
        PMK(7) PMK(8) PMK(9) PMK(10) PMK(11) PMK(12) PMK(13) PMK(14) PMK(15) PMK(16)
#endif
#undef PMK
        }
    }
}

/* panels [p0, p1) for every row into dst (row r, output o at dst[r * ldd + o - 16 p0]) */
static void panels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    for (long p = p0; p < p1; p++) panel_rows(j, j->W + (size_t)p * j->in * PANEL, p, p0, dst, ldd);
}

static inline long out_end(const job_t* j, long p1) { return p1 * PANEL < j->out ? p1 * PANEL : j->out; }

static void put(const job_t* j, long p0, long p1, const float* buf) {
    long o0 = p0 * PANEL, m = out_end(j, p1) - o0;
    for (long r = 0; r < j->rows; r++)
        __builtin_memcpy(j->y + (size_t)r * j->out + o0, buf + r * m, m * sizeof(float));
}

/* x (rows, in) -> tiles of TILE rows, each (in, rows in the tile): xt[t0 * in + k * MR + r] = x[t0 + r][k] */
static void pack_x(const float* x, long rows, long in, float* xt) {
    for (long t0 = 0; t0 < rows; t0 += TILE) {
        long MR = rows - t0 < TILE ? rows - t0 : TILE;
        float* d = xt + t0 * in;
        for (long r = 0; r < MR; r++) {
            const float* s = x + (t0 + r) * in;
            for (long k = 0; k < in; k++) d[k * MR + r] = s[k];
        }
    }
}
