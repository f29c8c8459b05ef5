/* Products over weights in sparse panels: fewer bytes read per token for a matrix with many exact zeros. */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* ---- y = residual + x W^T + bias over W in sparse panels -------------------------------------------------
   The panels of panels.c (16 outputs each, rows past `out` zero), each cut along k into windows of at most
   SP_WIN consecutive k in which no output has more than S non-zeros (S: one per matrix, chosen at packing, see
   wsc_sparse_plan). A window is its first k (int32), one uint32 mask per output (bit t: the weight at k0 + t
   is non-zero), S uint16 masks of the outputs that have an s-th non-zero (padded to whole floats: SP_HDR(S)
   floats in all), then its non-zero values in S steps: step s holds the s-th non-zero (in k order) of each
   output that has one, outputs in order. Panel p's windows lie at W + off[p] .. W + off[p + 1] (floats);
   off[np + 1] = S; 16 zero floats follow the last panel. Bytes read: 4 per non-zero and 68 + 2 S (rounded up
   to 4) per window (up to 32 k of 16 outputs, so at least 2/16 per weight; windows of zeros are left out).
   A step gathers each output's next x from the window's x (two vectors, one permute), expands the step's
   values into the outputs that have one (zeros elsewhere) and runs one FMA per x row, so a decode token costs
   S steps per window instead of a step per k. (A 16-bit mask per k with an expanding load per k reads the same
   bytes but takes a step per k: measured on a Zen 4 at ~1.7 ns a step whatever the density, a quarter of the
   memory's speed at 90% sparsity; this layout takes ~2 ns a step and 4 to 5 times fewer steps.) Each output is
   still one FMA chain over its non-zero k in order, and a zero lane adds x * 0 to a sum that starts at +0,
   which leaves it as it is: the same bits as the dense panels of the same matrix (for finite x), whatever the
   batch or the threads.
   On the Zen 5 this was last tuned on, a step is bound by the shuffle unit, not by the FMA's latency: its
   expand and its permutes (one per x row) take about a cycle each, the FMA and the mask arithmetic run beside
   them (an L1-resident loop of steps: ~0.8 ns a step without the expand, ~1.5 ns with it, the same without the
   mask arithmetic). So interleaving the steps of 2 or 4 panels, independent chains for one x row, measured no
   faster from the caches (and slower from memory); what one row does need is the prefetch well ahead: at SP_PF
   floats (8 KiB) a token of SmolLM2's matrices at 90% sparsity takes ~10% less than at 2 KiB. */

#define SP_WIN 32
#define SP_PF 2048  /* floats ahead of the sparse panel read to prefetch */
#define SP_FULL_S 10  /* from this S on, sp_window takes the steps with a value for every output apart */
#define SP_HDR(S) (1 + PANEL + ((S) + 1) / 2)

#if defined(__GNUC__) && defined(__AVX512F__) && (defined(__AVX512VPOPCNTDQ__) || defined(__AVX512CD__))
#define SP_AVX512 1
#include <immintrin.h>

/* the lowest set bit's index of each lane (lanes of 0: any index in 0 .. 31), and that bit cleared in *m */
static inline __m512i pop_lowest(__m512i* m) {
    __m512i t = _mm512_add_epi32(*m, _mm512_set1_epi32(-1));
#ifdef __AVX512VPOPCNTDQ__
    __m512i idx = _mm512_popcnt_epi32(_mm512_andnot_si512(*m, t));  /* the bits below the lowest */
#else
    __m512i low = _mm512_andnot_si512(t, *m);
    __m512i idx = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(low));
#endif
    *m = _mm512_and_si512(*m, t);
    return idx;
}
#elif WSC_X86 == 256
#define SP_AVX2 1
/* AVX2 has no expanding load, no per-lane bit count and no two-register permute: a step's values are spread
   over their outputs by a permutation looked up per 8-bit mask (SP_EXPAND), the lowest set bit's index is the
   exponent of that bit converted to float, and each output's x is gathered from the window's x in memory. */
#define SPE(m, c) ((m) >> (c) & 1 ? __builtin_popcount((m) & ((1 << (c)) - 1)) : 0)
#define SPE8(m) {SPE(m, 0), SPE(m, 1), SPE(m, 2), SPE(m, 3), SPE(m, 4), SPE(m, 5), SPE(m, 6), SPE(m, 7)}
#define SPE32(m) SPE8(m), SPE8(m + 1), SPE8(m + 2), SPE8(m + 3), SPE8(m + 4), SPE8(m + 5), SPE8(m + 6), \
    SPE8(m + 7), SPE8(m + 8), SPE8(m + 9), SPE8(m + 10), SPE8(m + 11), SPE8(m + 12), SPE8(m + 13), SPE8(m + 14), \
    SPE8(m + 15), SPE8(m + 16), SPE8(m + 17), SPE8(m + 18), SPE8(m + 19), SPE8(m + 20), SPE8(m + 21), \
    SPE8(m + 22), SPE8(m + 23), SPE8(m + 24), SPE8(m + 25), SPE8(m + 26), SPE8(m + 27), SPE8(m + 28), \
    SPE8(m + 29), SPE8(m + 30), SPE8(m + 31)
/* mask -> for each lane with its bit set, its value's place among them (0 elsewhere) */
static const int32_t SP_EXPAND[256][8] __attribute__((aligned(32))) = {
    SPE32(0), SPE32(32), SPE32(64), SPE32(96), SPE32(128), SPE32(160), SPE32(192), SPE32(224)};
/* the index of the lowest set bit of each lane (lanes of 0: any index in 0 .. 31), and that bit cleared in *m */
static inline __m256i pop_lowest8(__m256i* m) {
    __m256i low = _mm256_and_si256(*m, _mm256_sub_epi32(_mm256_setzero_si256(), *m));
    __m256i e = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(low)), 23);  /* (2^31: -2^31, 158) */
    *m = _mm256_and_si256(*m, _mm256_add_epi32(*m, _mm256_set1_epi32(-1)));
    return _mm256_and_si256(_mm256_sub_epi32(e, _mm256_set1_epi32(127)), _mm256_set1_epi32(31));
}
/* the values of the lanes whose bit of mask (8 bits) is set, in order at v; zero in the others */
static inline __m256 expand8(const float* v, int mask) {
    __m256 w = _mm256_permutevar8x32_ps(_mm256_loadu_ps(v), _mm256_loadu_si256((const __m256i*)SP_EXPAND[mask]));
    __m256i on = _mm256_and_si256(_mm256_set1_epi32(mask), _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128));
    return _mm256_and_ps(w, _mm256_castsi256_ps(_mm256_cmpeq_epi32(on, _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64,
                                                                                           128))));
}
#endif

/* One window at s of a sparse panel against MR (<= 8) x rows (x + r * ldx, `in` long): a[r] += its terms.
   Returns the next window. */
static inline __attribute__((always_inline)) const float* sp_window(const float* s, int S, const float* x,
                                                                    long ldx, long in, int MR, v16* a) {
    int32_t k0;
    __builtin_memcpy(&k0, s, sizeof k0);
    const float* v = s + SP_HDR(S);
#ifdef SP_AVX512
    __m512i m = _mm512_loadu_si512(s + 1);
    const uint16_t* act = (const uint16_t*)(s + 1 + PANEL);
    __m512 x0[8], x1[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) if (r < MR) {
        const float* xr = x + r * ldx + k0;
        if (in - k0 >= SP_WIN) {
            x0[r] = _mm512_loadu_ps(xr);
            x1[r] = _mm512_loadu_ps(xr + 16);
        } else {  /* the last window: x ends inside it */
            float t[SP_WIN] = {0};
            __builtin_memcpy(t, xr, (in - k0) * sizeof(float));
            x0[r] = _mm512_loadu_ps(t);
            x1[r] = _mm512_loadu_ps(t + 16);
        }
    }
    int st = 0;
    if (MR == 8 && S >= SP_FULL_S)  /* the leading steps in which every output has a value need no expand: with
                                       8 rows and many such steps, a shuffle less a step pays for the exit from
                                       this loop that the branch predictor misses (with fewer, it does not) */
        for (; st < S && act[st] == 0xFFFF; st++) {
            v16 w = ld16(v);
            v += PANEL;
#if SP_PF > 0
            __builtin_prefetch(v + SP_PF, 0, 3);
#endif
            __m512i idx = pop_lowest(&m);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) if (r < MR) a[r] += (v16)_mm512_permutex2var_ps(x0[r], idx, x1[r]) * w;
        }
    for (; st < S; st++) {
        v16 w = (v16)_mm512_maskz_expandloadu_ps(act[st], v);
        v += __builtin_popcount(act[st]);
#if SP_PF > 0
        __builtin_prefetch(v + SP_PF, 0, 3);
#endif
        __m512i idx = pop_lowest(&m);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) if (r < MR) a[r] += (v16)_mm512_permutex2var_ps(x0[r], idx, x1[r]) * w;
    }
#elif defined(SP_AVX2)
    __m256i m[2] = {_mm256_loadu_si256((const __m256i*)(s + 1)), _mm256_loadu_si256((const __m256i*)(s + 9))};
    const uint16_t* act = (const uint16_t*)(s + 1 + PANEL);
    const float* xw[8];
    float t[8][SP_WIN];
    vf acc[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) if (r < MR) {
        xw[r] = x + r * ldx + k0;
        if (in - k0 < SP_WIN) {  /* the last window: x ends inside it */
            __builtin_memset(t[r], 0, sizeof t[r]);
            __builtin_memcpy(t[r], xw[r], (in - k0) * sizeof(float));
            xw[r] = t[r];
        }
        acc[r][0] = part(a[r], 0), acc[r][1] = part(a[r], 1);
    }
    for (int st = 0; st < S; st++) {
        int lo = act[st] & 0xFF, hi = act[st] >> 8;
        __m256 w[2] = {expand8(v, lo), expand8(v + __builtin_popcount(lo), hi)};
        v += __builtin_popcount(act[st]);
#if SP_PF > 0
        __builtin_prefetch(v + SP_PF, 0, 3);
#endif
        __m256i idx[2] = {pop_lowest8(&m[0]), pop_lowest8(&m[1])};
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) if (r < MR)
            for (int h = 0; h < 2; h++) acc[r][h] += (vf)_mm256_i32gather_ps(xw[r], idx[h], 4) * (vf)w[h];
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) if (r < MR) a[r] = join(acc[r]);
#else
    uint32_t m[PANEL];
    __builtin_memcpy(m, s + 1, sizeof m);
    for (int st = 0; st < S; st++) {
        float w[PANEL], xs[8][PANEL];
        for (int c = 0; c < PANEL; c++) {
            int t = m[c] ? __builtin_ctz(m[c]) : 0;
            w[c] = m[c] ? *v++ : 0.0f;
            for (int r = 0; r < MR; r++) xs[r][c] = m[c] ? x[r * ldx + k0 + t] : 0.0f;
            m[c] &= m[c] - 1;
        }
        for (int r = 0; r < MR; r++) a[r] += ld16(xs[r]) * ld16(w);
    }
#endif
    return v;
}

/* pmk's stores: dst[r * ldd + c] = res[r * ldr + c] + (a[r][c] + b[c]), r < MR, c < nc (b, res may be NULL) */
static inline __attribute__((always_inline)) void sp_store(const v16* a, int MR, float* dst, long ldd, int nc,
                                                           const float* b, const float* res, long ldr) {
    if (nc == PANEL) {
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) if (r < MR) {
            v16 z = a[r];
            if (b) z = z + ld16(b);
            if (res) z = ld16(res + r * ldr) + z;
            __builtin_memcpy(dst + r * ldd, &z, sizeof z);
        }
        return;
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < nc; c++) {
            float z = a[r][c];
            if (b) z = z + b[c];
            if (res) z = res[r * ldr + c] + z;
            dst[r * ldd + c] = z;
        }
}

/* MR x rows against one sparse panel [sp, end): as pmk */
static inline __attribute__((always_inline)) void spmk(const float* sp, const float* end, int S, const float* x,
                                                       long ldx, long in, int MR, float* dst, long ldd, int nc,
                                                       const float* b, const float* res, long ldr) {
    v16 a[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) a[r] = (v16){0};
    for (const float* s = sp; s < end;) s = sp_window(s, S, x, ldx, in, MR, a);
    sp_store(a, MR, dst, ldd, nc, b, res, ldr);
}

/* panels_into over sparse panels, x (rows, in) row-major: rows go 8, 4, 2 or 1 at a time (each output's chain
   is the same whatever the rows beside it). With R rows a step costs about R + 1 shuffles where a dense k costs
   R / 2 cycles of FMAs, so in a batch the sparse panels win only while their steps are few (steps / dense k
   steps: ~0.68 at 50% sparsity, ~0.4 at 75%, ~0.2 at 90%). Measured on SmolLM2's shapes (bench/
   serve_sparse_kernels.c, one thread), dense time / sparse time at 16 and 64 rows: 0.9x and 0.65x at 50%
   sparsity, 1.3x and 0.95x at 75%, 2.1x and 1.55x at 90% (0.7x, 0.5x, 1.15x and 0.8x before the full steps went
   without their expand, see sp_window). Every row count takes this kernel, because on the Zen 5 the alternatives
   measured slower at every row count from 8 to 64: unpacking panels into dense ones for the dense microkernel
   (with a scatter per step, which this file did from 32 rows: 0.4x dense at 32 rows and 50% sparsity, against
   this kernel's 0.75x; or with scalar stores), and rows in the lanes (a table of each step's k and value, then
   one FMA per output, step and 16 rows, with a broadcast value and a row of x: bound by its loads, 0.3-0.5x dense
   at 50%). */
static void spanels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    long R = j->rows, in = j->in, out = j->out;
    int S = (int)j->off[(out + PANEL - 1) / PANEL + 1];
    for (long p = p0; p < p1; p++) {
        const float *sp = j->W + j->off[p], *end = j->W + j->off[p + 1];
        long o = p * PANEL;
        int nc = out - o < PANEL ? (int)(out - o) : PANEL;
        const float* b = j->b ? j->b + o : NULL;
        for (long r0 = 0, n; r0 < R; r0 += n) {
            n = R - r0 >= 8 ? 8 : R - r0 >= 4 ? 4 : R - r0 >= 2 ? 2 : 1;
            const float* x = j->xt + (size_t)r0 * in;
            float* d = dst + r0 * ldd + (o - p0 * PANEL);
            const float* res = j->res ? j->res + (size_t)r0 * out + o : NULL;
            switch (n) {
#define SPMK(n) case n: spmk(sp, end, S, x, in, in, n, d, ldd, nc, b, res, out); break;
            SPMK(1) SPMK(2) SPMK(4) SPMK(8)
#undef SPMK
            }
        }
    }
}

/* a job's panels [p0, p1) into dst */
static void any_panels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    if (j->off) spanels_into(j, p0, p1, dst, ldd);
    else if (j->qt) qpanels_into(j, p0, p1, dst, ldd);
    else panels_into(j, p0, p1, dst, ldd);
}

/* ---- packing -------------------------------------------------------------------------------------------- */

/* mk[k] = the outputs of panel p of W (out, in) whose weight at k is non-zero (-0.0 counts as zero) */
static void sp_masks(const float* W, long out, long in, long p, uint16_t* mk) {
    for (long k = 0; k < in; k++) mk[k] = 0;
    for (int c = 0; c < PANEL && p * PANEL + c < out; c++) {
        const float* row = W + (p * PANEL + c) * in;
        for (long k = 0; k < in; k++) mk[k] |= (uint16_t)((row[k] != 0) << c);
    }
}

/* the end of the window that starts at k0: at most SP_WIN k, at most S non-zeros per output */
static long sp_cut(const uint16_t* mk, long in, int S, long k0) {
    int cnt[PANEL] = {0};
    unsigned full = 0;  /* outputs with S non-zeros so far */
    long k = k0;
    for (; k < in && k - k0 < SP_WIN && !(mk[k] & full); k++)
        for (unsigned b = mk[k]; b; b &= b - 1) {
            int c = __builtin_ctz(b);
            if (++cnt[c] == S) full |= 1u << c;
        }
    return k;
}

/* panel p (its masks mk) in windows of S; with dst, written there. Returns the floats; *steps += S x windows. */
static long sp_panel(const float* W, long in, long p, const uint16_t* mk, int S, float* dst, long* steps) {
    long n = 0;
    for (long k0 = 0, k1; k0 < in; k0 = k1) {
        k1 = sp_cut(mk, in, S, k0);
        long nz = 0;
        for (long k = k0; k < k1; k++) nz += __builtin_popcount(mk[k]);
        if (nz == 0) continue;  /* (k0 is stored: a window of zeros is left out) */
        if (dst) {
            int32_t k32 = (int32_t)k0;
            uint32_t m[PANEL] = {0};
            uint16_t act[SP_WIN + 1] = {0};
            for (long k = k0; k < k1; k++)
                for (unsigned b = mk[k]; b; b &= b - 1) m[__builtin_ctz(b)] |= 1u << (k - k0);
            for (int st = 0; st < S; st++)
                for (int c = 0; c < PANEL; c++) act[st] |= (uint16_t)((__builtin_popcount(m[c]) > st) << c);
            __builtin_memcpy(dst + n, &k32, sizeof k32);
            __builtin_memcpy(dst + n + 1, m, sizeof m);
            __builtin_memcpy(dst + n + 1 + PANEL, act, (SP_HDR(S) - 1 - PANEL) * sizeof(float));
            float* v = dst + n + SP_HDR(S);
            for (int st = 0; st < S; st++)
                for (int c = 0; c < PANEL; c++)
                    if (m[c]) {
                        *v++ = W[(p * PANEL + c) * in + k0 + __builtin_ctz(m[c])];
                        m[c] &= m[c] - 1;
                    }
        }
        n += SP_HDR(S) + nz;
        *steps += S;
    }
    return n;
}

static const int SP_CAND[] = {1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32};
#define SP_NCAND (long)(sizeof SP_CAND / sizeof SP_CAND[0])

/* The S (of SP_CAND) that makes the fewest steps for W (out, in): info[0..2] = S, floats of its sparse panels
   (the 16 that follow included), steps (S x windows). Steps fall and then rise with S: the search stops two
   candidates past the fewest. Returns 0, or -1 when out of memory. */
int wsc_sparse_plan(const float* W, long out, long in, long* info) {
    long np = (out + PANEL - 1) / PANEL;
    uint16_t* mk = malloc((size_t)(np * in > 0 ? np * in : 1) * sizeof *mk);
    if (!mk) return -1;
    for (long p = 0; p < np; p++) sp_masks(W, out, in, p, mk + p * in);
    info[2] = -1;
    for (long i = 0, worse = 0; i < SP_NCAND && worse < 2; i++) {
        long floats = PANEL, steps = 0;
        for (long p = 0; p < np; p++) floats += sp_panel(W, in, p, mk + p * in, SP_CAND[i], NULL, &steps);
        worse = info[2] >= 0 && steps >= info[2] ? worse + 1 : 0;
        if (!worse) {
            info[0] = SP_CAND[i];
            info[1] = floats;
            info[2] = steps;
        }
    }
    free(mk);
    return 0;
}

/* W (out, in) row-major -> sparse panels of S (from wsc_sparse_plan): dst (the floats it counted, all written),
   off (np + 2 int64). Returns 0, or -1 when out of memory. */
int wsc_sparse_pack(const float* W, long out, long in, int S, float* dst, int64_t* off) {
    long np = (out + PANEL - 1) / PANEL, n = 0, steps = 0;
    uint16_t* mk = malloc((size_t)(in > 0 ? in : 1) * sizeof *mk);
    if (!mk) return -1;
    for (long p = 0; p < np; p++) {
        off[p] = n;
        sp_masks(W, out, in, p, mk);
        n += sp_panel(W, in, p, mk, S, dst + n, &steps);
    }
    free(mk);
    off[np] = n;
    off[np + 1] = S;
    for (int i = 0; i < PANEL; i++) dst[n + i] = 0.0f;
    return 0;
}
