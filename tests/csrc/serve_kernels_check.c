/* A check of the serving kernels (src/waferscale/serve/csrc) under AddressSanitizer and UBSan, built and run by
   tests/test_serve_csrc.py: it includes the kernels' one translation unit, calls every entry point on small
   inputs of odd and aligned sizes, with one thread and with the pool's two, and compares the results with
   plain double-precision references written here (and batched with one-at-a-time results, bit for bit).
   Every buffer is allocated at its exact size, so a read or write past it is a sanitizer report. Prints one
   line per failed comparison and exits 1 if any failed; a sanitizer report aborts the run by itself.
   Its last line is a digest of every result it compared (their bits, in order): each vector path must print the
   portable code's digest (the same build with -DWSC_PORTABLE), which the test compares, so a path that differs
   from the reference in one bit anywhere fails even where the tolerance of a comparison would let it pass.

   Build: cc -I src/waferscale/serve/csrc -O1 -g -march=native -fno-fast-math -pthread
          -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
          tests/csrc/serve_kernels_check.c -lm */

#include "serve_kernels.c"

#include <stdio.h>
#include <string.h>

static int g_fail;
static unsigned long long g_digest = 14695981039346656037ull;  /* FNV-1a over the results' bytes */

static void digest(const void* p, size_t n) {
    for (size_t i = 0; i < n; i++) g_digest = (g_digest ^ ((const unsigned char*)p)[i]) * 1099511628211ull;
}
static unsigned long long g_rng = 88172645463325252ull;

static float frand(void) {  /* uniform in [-1, 1), xorshift64 */
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

static float* randv(long n) {
    float* v = xmalloc((size_t)n * sizeof(float));
    for (long i = 0; i < n; i++) v[i] = frand();
    return v;
}

static float* copyv(const float* s, long n) {
    float* v = xmalloc((size_t)n * sizeof(float));
    memcpy(v, s, (size_t)n * sizeof(float));
    return v;
}

/* got vs want within tol * (1 + scale): scale is the magnitude of the terms summed (0: want's own) */
static void expect(const char* what, long i, double got, double want, double scale, double tol) {
    digest(&got, sizeof got);
    double lim = tol * (1.0 + (scale > 0 ? scale : fabs(want)));
    if (!(fabs(got - want) <= lim)) {
        if (g_fail < 20) fprintf(stderr, "FAIL %s [%ld]: got %.9g, want %.9g (limit %.3g)\n", what, i, got, want, lim);
        g_fail++;
    }
}

static void expect_same(const char* what, const float* a, const float* b, long n) {
    digest(a, (size_t)n * sizeof(float));
    if (memcmp(a, b, (size_t)n * sizeof(float)) != 0) {
        if (g_fail < 20) fprintf(stderr, "FAIL %s: not the same bits\n", what);
        g_fail++;
    }
}

/* W (out, in) -> panels of 16 outputs, (ceil(out / 16), in, 16), rows past `out` zero (as kernels.pack) */
static float* pack(const float* W, long out, long in) {
    long np = (out + PANEL - 1) / PANEL;
    float* wp = xmalloc((size_t)np * in * PANEL * sizeof(float));
    for (long p = 0; p < np; p++)
        for (long k = 0; k < in; k++)
            for (long c = 0; c < PANEL; c++) {
                long o = p * PANEL + c;
                wp[(p * in + k) * PANEL + c] = o < out ? W[o * in + k] : 0.0f;
            }
    return wp;
}

/* ---- wsc_linear ---------------------------------------------------------------------------------------- */

static void check_linear(long rows, long out, long in) {
    char what[96];
    float *x = randv(rows * in), *W = randv(out * in), *b = randv(out), *res = randv(rows * out);
    float* wp = pack(W, out, in);
    float *y = randv(rows * out), *yb = randv(rows * out);
    if (wsc_linear(wp, x, NULL, NULL, y, rows, out, in) != 0 || wsc_linear(wp, x, b, res, yb, rows, out, in) != 0) {
        fprintf(stderr, "FAIL linear %ldx%ldx%ld: out of memory\n", rows, out, in);
        g_fail++;
    }
    snprintf(what, sizeof what, "linear rows=%ld out=%ld in=%ld", rows, out, in);
    for (long r = 0; r < rows; r++)
        for (long o = 0; o < out; o++) {
            double s = 0, mag = 0;
            for (long k = 0; k < in; k++) {
                s += (double)x[r * in + k] * W[o * in + k];
                mag += fabs((double)x[r * in + k] * W[o * in + k]);
            }
            expect(what, r * out + o, y[r * out + o], s, mag, 1e-6);
            expect(what, r * out + o, yb[r * out + o], res[r * out + o] + s + b[o], mag + 2, 1e-6);
        }
    float* yi = copyv(res, rows * out);  /* the residual aliasing the output, as the decode layers use it */
    wsc_linear(wp, x, b, yi, yi, rows, out, in);
    snprintf(what, sizeof what, "linear in place rows=%ld out=%ld in=%ld", rows, out, in);
    expect_same(what, yi, yb, rows * out);
    free(x); free(W); free(b); free(res); free(wp); free(y); free(yb); free(yi);
}

/* the same product, alone and shared by the pool's threads (again and again: it picks either): same bits */
static void check_linear_threads(long rows, long out, long in) {
    char what[96];
    float *x = randv(rows * in), *W = randv(out * in), *b = randv(out), *res = randv(rows * out);
    float* wp = pack(W, out, in);
    float *one = randv(rows * out), *two = randv(rows * out);
    wsc_set_threads(1);
    wsc_linear(wp, x, b, res, one, rows, out, in);
    if (wsc_set_threads(2) != 2) { fprintf(stderr, "FAIL set_threads(2)\n"); g_fail++; }
    snprintf(what, sizeof what, "linear on 2 threads rows=%ld out=%ld in=%ld", rows, out, in);
    for (int i = 0; i < 40; i++) {
        wsc_linear(wp, x, b, res, two, rows, out, in);
        expect_same(what, two, one, rows * out);
    }
    wsc_set_threads(1);
    free(x); free(W); free(b); free(res); free(wp); free(one); free(two);
}

/* ---- row-wise kernels ------------------------------------------------------------------------------------ */

static void check_rms_norm(long rows, long n) {
    char what[64];
    snprintf(what, sizeof what, "rms_norm rows=%ld n=%ld", rows, n);
    float *x = randv(rows * n), *w = randv(n), *y = randv(rows * n);
    wsc_rms_norm(x, w, 1e-5f, y, rows, n);
    for (long r = 0; r < rows; r++) {
        double ss = 0;
        for (long i = 0; i < n; i++) ss += (double)x[r * n + i] * x[r * n + i];
        double inv = 1.0 / sqrt(ss / n + 1e-5);
        for (long i = 0; i < n; i++) expect(what, r * n + i, y[r * n + i], w[i] * (x[r * n + i] * inv), 0, 1e-5);
    }
    free(x); free(w); free(y);
}

static void check_silu_mul(long rows, long n) {
    char what[64];
    snprintf(what, sizeof what, "silu_mul rows=%ld n=%ld", rows, n);
    float *gu = randv(rows * 2 * n), *y = randv(rows * n);
    for (long i = 0; i < rows * 2 * n; i += 7) gu[i] *= 60.0f;  /* large |x|: exp under- and overflow sides */
    wsc_silu_mul(gu, y, rows, n);
    for (long r = 0; r < rows; r++)
        for (long i = 0; i < n; i++) {
            double g = gu[r * 2 * n + i], u = gu[r * 2 * n + n + i];
            expect(what, r * n + i, y[r * n + i], g / (1.0 + exp(-g)) * u, 0, 1e-5);
        }
    free(gu); free(y);
}

static long ref_argmax(const float* x, long n) {
    for (long i = 0; i < n; i++) if (x[i] != x[i]) return i;
    long best = 0;
    for (long i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
}

static void check_argmax(long n) {
    char what[64];
    snprintf(what, sizeof what, "argmax n=%ld", n);
    float* x = randv(n);
    for (long at = 0; at < n; at += (n > 20 ? 5 : 1)) {  /* a planted maximum, tied later when there is room */
        float* v = copyv(x, n);
        v[at] = 2.0f;
        if (at + 17 < n) v[at + 17] = 2.0f;
        expect(what, at, (double)wsc_argmax(v, n), (double)ref_argmax(v, n), 0, 0);
        v[n - 1 - at] = NAN;  /* the first NaN wins, as in torch */
        expect(what, at, (double)wsc_argmax(v, n), (double)ref_argmax(v, n), 0, 0);
        free(v);
    }
    long rows = 3, ld = n + 5;  /* rows of a wider matrix */
    float* m = randv(rows * ld);
    long* out = xmalloc((size_t)rows * sizeof(long));
    wsc_argmax_rows(m, rows, ld, n, out);
    for (long r = 0; r < rows; r++) expect(what, 100 + r, (double)out[r], (double)ref_argmax(m + r * ld, n), 0, 0);
    free(x); free(m); free(out);
}

/* ---- decode attention -------------------------------------------------------------------------------- */

/* rope of one token's q and k heads in place (double), as rope_write documents it */
static void ref_rope(float* qkv, const float* cos, const float* sin_signed, long nh, long nkv, long hd) {
    long half = hd / 2;
    for (long h = 0; cos && h < nh + nkv; h++) {
        float* x = qkv + h * hd;
        for (long i = 0; i < half; i++) {
            double a = x[i], b = x[i + half];
            x[i] = (float)(a * cos[i] + b * sin_signed[i]);
            x[i + half] = (float)(b * cos[i + half] + a * sin_signed[i + half]);
        }
    }
}

/* y (nh hd) = softmax(q K^T / sqrt(hd)) V over positions t < S at slot slot_of(t) */
static void ref_attend(const float* q, const float* cache, long slots, const long* slot_of, long S, long nh,
                       long nkv, long hd, double* y) {
    long g = nh / nkv;
    double* p = xmalloc((size_t)S * sizeof(double));
    for (long h = 0; h < nh; h++) {
        const float* K = cache + (h / g) * slots * hd;
        const float* V = cache + (nkv + h / g) * slots * hd;
        double m = -INFINITY, sum = 0;
        for (long t = 0; t < S; t++) {
            double s = 0;
            for (long d = 0; d < hd; d++) s += (double)q[h * hd + d] * K[slot_of[t] * hd + d];
            p[t] = s / sqrt((double)hd);
            m = p[t] > m ? p[t] : m;
        }
        for (long t = 0; t < S; t++) sum += p[t] = exp(p[t] - m);
        for (long d = 0; d < hd; d++) {
            double o = 0;
            for (long t = 0; t < S; t++) o += p[t] * V[slot_of[t] * hd + d];
            y[h * hd + d] = o / sum;
        }
    }
    free(p);
}

static void check_decode_attention(long nh, long nkv, long hd, long S, int rope) {
    char what[96];
    snprintf(what, sizeof what, "decode_attention nh=%ld nkv=%ld hd=%ld S=%ld rope=%d", nh, nkv, hd, S, rope);
    long nq = (nh + 2 * nkv) * hd, slot0 = 2, slots = S + 3;
    float *qkv = randv(nq), *cache = randv(2 * nkv * slots * hd), *y = randv(nh * hd);
    float *cos = rope ? randv(hd) : NULL, *sin = rope ? randv(hd) : NULL;
    float *rq = copyv(qkv, nq), *rc = copyv(cache, 2 * nkv * slots * hd);
    double* ry = xmalloc((size_t)nh * hd * sizeof(double));
    long* slot_of = xmalloc((size_t)S * sizeof(long));
    for (long t = 0; t < S; t++) slot_of[t] = slot0 + t;
    ref_rope(rq, cos, sin, nh, nkv, hd);
    for (long h = 0; h < 2 * nkv; h++) memcpy(rc + (h * slots + slot0 + S - 1) * hd, rq + (nh + h) * hd, hd * 4);
    ref_attend(rq, rc, slots, slot_of, S, nh, nkv, hd, ry);
    if (wsc_decode_attention(qkv, cos, sin, cache, slots, slot0, S, nh, nkv, hd, 1.0f / sqrtf((float)hd), y) != 0) {
        fprintf(stderr, "FAIL %s: out of memory\n", what);
        g_fail++;
    }
    for (long i = 0; i < nq; i++) expect(what, i, qkv[i], rq[i], 0, 1e-6);
    for (long i = 0; i < 2 * nkv * slots * hd; i++) expect(what, i, cache[i], rc[i], 0, 1e-6);
    for (long i = 0; i < nh * hd; i++) expect(what, i, y[i], ry[i], 1, 1e-5);
    free(qkv); free(cache); free(y); free(cos); free(sin); free(rq); free(rc); free(ry); free(slot_of);
}

/* A float16 cache: the k and v written are the rotated values rounded to nearest (f2h's bits), and the output
   is the reference's over the cache's values widened (h2f) */
static uint16_t* to_half(const float* v, long n) {
    uint16_t* h = xmalloc((size_t)n * sizeof(uint16_t));
    for (long i = 0; i < n; i++) h[i] = f2h(v[i]);
    return h;
}

static void check_decode_attention_f16(long nh, long nkv, long hd, long S, int threads) {
    char what[96];
    snprintf(what, sizeof what, "decode_attention f16 nh=%ld nkv=%ld hd=%ld S=%ld threads=%d", nh, nkv, hd, S,
             threads);
    long nq = (nh + 2 * nkv) * hd, slot0 = 1, slots = S + 2, cn = 2 * nkv * slots * hd;
    float *qkv = randv(nq), *cache0 = randv(cn), *y = randv(nh * hd), *cos = randv(hd), *sin = randv(hd);
    uint16_t* cache = to_half(cache0, cn);
    float* rq = copyv(qkv, nq);
    float* rc = xmalloc((size_t)cn * sizeof(float));
    ref_rope(rq, cos, sin, nh, nkv, hd);
    for (long h = 0; h < 2 * nkv; h++)  /* the new token's k and v, as the kernel writes them */
        for (long d = 0; d < hd; d++) cache0[(h * slots + slot0 + S - 1) * hd + d] = rq[(nh + h) * hd + d];
    uint16_t* want = to_half(cache0, cn);
    for (long i = 0; i < cn; i++) rc[i] = h2f(want[i]);
    double* ry = xmalloc((size_t)nh * hd * sizeof(double));
    long* slot_of = xmalloc((size_t)S * sizeof(long));
    for (long t = 0; t < S; t++) slot_of[t] = slot0 + t;
    ref_attend(rq, rc, slots, slot_of, S, nh, nkv, hd, ry);
    wsc_set_threads(threads);
    if (wsc_decode_attention_ex(qkv, cos, sin, cache, slots, slot0, S, nh, nkv, hd, 1.0f / sqrtf((float)hd), y, 0,
                                NULL, 1) != 0) {
        fprintf(stderr, "FAIL %s: out of memory\n", what);
        g_fail++;
    }
    wsc_set_threads(1);
    for (long i = 0; i < cn; i++) expect(what, i, cache[i], want[i], 0, 0);
    for (long i = 0; i < nh * hd; i++) expect(what, i, y[i], ry[i], 1, 1e-5);
    free(qkv); free(cache0); free(y); free(cos); free(sin); free(cache); free(rq); free(rc); free(want); free(ry);
    free(slot_of);
}

/* float <-> half: the vector conversions (the hardware's with AVX-512) agree with f2h / h2f on every
   half and on floats at and around each rounding boundary, subnormals, overflow, infinities and NaN */
static void check_half_conversions(void) {
    const char* what = "float16 conversions";
    float f[16];
    uint16_t h[16];
    for (uint32_t b = 0; b < 65536; b += 16) {  /* every half: widen, then narrow back (NaNs stay NaN) */
        for (int i = 0; i < 16; i++) h[i] = (uint16_t)(b + i);
        v16 v = ldh16(h);
        for (int i = 0; i < 16; i++) {
            float want = h2f(h[i]);
            if (!(v[i] == want || (v[i] != v[i] && want != want))) expect(what, b + i, v[i], want, 0, 0);
        }
        uint16_t back[16];
        sth16(back, v);
        for (int i = 0; i < 16; i++)
            if (((h[i] & 0x7C00u) != 0x7C00u || !(h[i] & 0x3FFu)) && back[i] != h[i]) expect(what, b + i, back[i], h[i], 0, 0);
    }
    for (long n = 0; n < 100000; n++) {
        for (int i = 0; i < 16; i++) {  /* from 2^-26 to 2^17 (the halves' subnormals to past their largest), either
                                           sign; every fourth exactly halfway between two normal halves */
            uint32_t e = 101 + (uint32_t)((frand() + 1) * 21.5f), m = (uint32_t)((frand() + 1) * 4194304.0f) & 0x7FFFFFu;
            if (n % 4 == 0) m = (m & ~0x1FFFu) | 0x1000u;
            uint32_t u = (frand() < 0 ? 0x80000000u : 0u) | e << 23 | m;
            memcpy(&f[i], &u, 4);
        }
        f[0] = 65519.0f; f[1] = 65520.0f; f[2] = -1e30f; f[3] = 0x1p-25f; f[4] = 0x1.8p-25f; f[5] = -0.0f;
        f[6] = INFINITY;
        v16 v;
        memcpy(&v, f, sizeof v);
        sth16(h, v);
        for (int i = 0; i < 16; i++) if (h[i] != f2h(f[i])) expect(what, n * 16 + i, h[i], f2h(f[i]), 0, 0);
    }
}

/* wsc_decode_attention_batch_ex on 1 thread and on 2 (the pool's attention jobs), each from the same qkv and cache
   (float32 values, stored as float16 with kv16): the same bits either way; returns the output */
static float* attend_batch_1_and_2(const char* what, const float* qkv0, long nq, const long* rows, long B,
                                   const long* pos, const float* cos_t, const float* sin_t, const float* cache0,
                                   long cn, long slots, const long* tables, long ldt, long bs, long nh, long nkv,
                                   long hd, long window, const float* slopes, int kv16) {
    float* out[2];
    for (int threads = 1; threads <= 2; threads++) {
        float* qkv = copyv(qkv0, B * nq);
        void* cache = kv16 ? (void*)to_half(cache0, cn) : (void*)copyv(cache0, cn);
        float* y = randv(B * nh * hd);
        wsc_set_threads(threads);
        if (wsc_decode_attention_batch_ex(qkv, nq, rows, B, pos, cos_t, sin_t, cache, slots, tables, ldt, bs, nh, nkv,
                                          hd, 1.0f / sqrtf((float)hd), y, nh * hd, window, slopes, kv16) != 0) {
            fprintf(stderr, "FAIL %s: out of memory\n", what);
            g_fail++;
        }
        out[threads - 1] = y;
        free(qkv); free(cache);
    }
    wsc_set_threads(1);
    expect_same(what, out[1], out[0], B * nh * hd);
    free(out[1]);
    return out[0];
}

/* B sequences over a block-paged cache, one thread and two (the pool's attention jobs): against the
   reference, and the same bits either way */
static void check_decode_attention_batch(long nh, long nkv, long hd, long bs) {
    enum { B = 3 };
    const long pos[B] = {0, 6, 13}, rows[B] = {2, 0, 1};
    char what[96];
    snprintf(what, sizeof what, "decode_attention_batch nh=%ld nkv=%ld hd=%ld bs=%ld", nh, nkv, hd, bs);
    long nq = (nh + 2 * nkv) * hd, ldt = (pos[B - 1] + bs) / bs, nblocks = B * ldt, slots = nblocks * bs;
    long* tables = xmalloc((size_t)B * ldt * sizeof(long));
    for (long i = 0; i < B * ldt; i++) tables[i] = (i * 7 + 3) % nblocks;  /* a scrambled order, all distinct */
    long P = pos[B - 1] + 1;
    float *cos_t = randv(P * hd), *sin_t = randv(P * hd);
    float *qkv0 = randv(B * nq), *cache0 = randv(2 * nkv * slots * hd);
    float* out0 = attend_batch_1_and_2(what, qkv0, nq, rows, B, pos, cos_t, sin_t, cache0, 2 * nkv * slots * hd,
                                       slots, tables, ldt, bs, nh, nkv, hd, 0, NULL, 0);
    float* rc = copyv(cache0, 2 * nkv * slots * hd);
    float* rq = copyv(qkv0, B * nq);
    for (long b = 0; b < B; b++) {  /* every token's rope and KV write first, then each one's attention */
        float* q = rq + rows[b] * nq;
        long p = pos[b], slot = tables[b * ldt + p / bs] * bs + p % bs;
        ref_rope(q, cos_t + p * hd, sin_t + p * hd, nh, nkv, hd);
        for (long h = 0; h < 2 * nkv; h++) memcpy(rc + (h * slots + slot) * hd, q + (nh + h) * hd, hd * 4);
    }
    double* ry = xmalloc((size_t)nh * hd * sizeof(double));
    long* slot_of = xmalloc((size_t)P * sizeof(long));
    for (long b = 0; b < B; b++) {
        for (long t = 0; t <= pos[b]; t++) slot_of[t] = tables[b * ldt + t / bs] * bs + t % bs;
        ref_attend(rq + rows[b] * nq, rc, slots, slot_of, pos[b] + 1, nh, nkv, hd, ry);
        for (long i = 0; i < nh * hd; i++) expect(what, b * 1000 + i, out0[rows[b] * nh * hd + i], ry[i], 1, 1e-5);
    }
    free(tables); free(cos_t); free(sin_t); free(qkv0); free(cache0); free(out0);
    free(rc); free(rq); free(ry); free(slot_of);
}

/* Prefill chunks in one batch with decode tokens (attention.c: a run of PREFILL_MIN_ROWS or more consecutive
   positions of one sequence goes in blocks of QBLOCK tokens, attend_block; shorter runs token by token):
   sequence A's chunk of 70 tokens from position 10 (a partial last block), a decode token of B, a chunk of 5 of
   D (token by token), C's first 66 tokens; scattered blocks, rows out of order; float32 or float16 cache, a
   sliding window, ALiBi. Against the reference per token, one thread and two the same bits. */
static void check_prefill_attention_batch(long nh, long nkv, long hd, long bs, long window, int alibi, int kv16) {
    enum { NS = 4 };
    const long start[NS] = {10, 20, 3, 0}, len[NS] = {70, 1, 5, 66};
    char what[128];
    snprintf(what, sizeof what, "prefill attention batch nh=%ld nkv=%ld hd=%ld bs=%ld window=%ld alibi=%d kv16=%d", nh,
             nkv, hd, bs, window, alibi, kv16);
    long B = 0, maxp = 0;
    for (int i = 0; i < NS; i++) { B += len[i]; maxp = start[i] + len[i] > maxp ? start[i] + len[i] : maxp; }
    long nq = (nh + 2 * nkv) * hd, ldt = (maxp + bs - 1) / bs, nblocks = NS * ldt, slots = nblocks * bs;
    long cn = 2 * nkv * slots * hd;
    long *seq_tab = xmalloc((size_t)NS * ldt * sizeof(long)), *tables = xmalloc((size_t)B * ldt * sizeof(long));
    long *pos = xmalloc((size_t)B * sizeof(long)), *rows = xmalloc((size_t)B * sizeof(long));
    long *seq = xmalloc((size_t)B * sizeof(long));
    for (long i = 0; i < NS * ldt; i++) seq_tab[i] = (i * 7 + 3) % nblocks;  /* scrambled, all distinct */
    for (long i = 0, b = 0; i < NS; i++)
        for (long t = 0; t < len[i]; t++, b++) {
            pos[b] = start[i] + t;
            rows[b] = B - 1 - b;
            seq[b] = i;
            memcpy(tables + b * ldt, seq_tab + i * ldt, (size_t)ldt * sizeof(long));
        }
    float *cos_t = randv(maxp * hd), *sin_t = randv(maxp * hd), *slopes = NULL;
    if (alibi) {
        slopes = xmalloc((size_t)nh * sizeof(float));
        for (long h = 0; h < nh; h++) slopes[h] = powf(2.0f, -8.0f * (float)(h + 1) / (float)nh);
    }
    float *qkv0 = randv(B * nq), *cache0 = randv(cn);
    if (kv16)  /* the float16 cache's values, as floats */
        for (long i = 0; i < cn; i++) cache0[i] = h2f(f2h(cache0[i]));
    float* out0 = attend_batch_1_and_2(what, qkv0, nq, rows, B, pos, cos_t, sin_t, cache0, cn, slots, tables, ldt, bs,
                                       nh, nkv, hd, window, slopes, kv16);
    float *rc = copyv(cache0, cn), *rq = copyv(qkv0, B * nq);
    for (long b = 0; b < B; b++) {  /* every token's rope and KV write first */
        float* q = rq + rows[b] * nq;
        long p = pos[b], slot = tables[b * ldt + p / bs] * bs + p % bs;
        ref_rope(q, cos_t + p * hd, sin_t + p * hd, nh, nkv, hd);
        for (long h = 0; h < 2 * nkv; h++)
            for (long d = 0; d < hd; d++) {
                float v = q[(nh + h) * hd + d];
                rc[(h * slots + slot) * hd + d] = kv16 ? h2f(f2h(v)) : v;
            }
    }
    double* ry = xmalloc((size_t)nh * hd * sizeof(double));
    double* p = xmalloc((size_t)maxp * sizeof(double));
    long g = nh / nkv;
    for (long b = 0; b < B; b++) {  /* token b over positions [lo, S) of its sequence */
        long S = pos[b] + 1, lo = window > 0 && S > window ? S - window : 0;
        const float* q = rq + rows[b] * nq;
        for (long h = 0; h < nh; h++) {
            double m = -INFINITY, sum = 0;
            for (long t = lo; t < S; t++) {
                long sl = seq_tab[seq[b] * ldt + t / bs] * bs + t % bs;
                double s = 0;
                for (long d = 0; d < hd; d++) s += (double)q[h * hd + d] * rc[((h / g) * slots + sl) * hd + d];
                p[t] = s / sqrt((double)hd) + (alibi ? (double)slopes[h] * (double)(t - (S - 1)) : 0.0);
                m = p[t] > m ? p[t] : m;
            }
            for (long t = lo; t < S; t++) sum += p[t] = exp(p[t] - m);
            for (long d = 0; d < hd; d++) {
                double o = 0;
                for (long t = lo; t < S; t++)
                    o += p[t] * rc[((nkv + h / g) * slots + seq_tab[seq[b] * ldt + t / bs] * bs + t % bs) * hd + d];
                ry[h * hd + d] = o / sum;
            }
        }
        for (long i = 0; i < nh * hd; i++) expect(what, b * 10000 + i, out0[rows[b] * nh * hd + i], ry[i], 1, 1e-5);
    }
    free(seq_tab); free(tables); free(pos); free(rows); free(seq); free(cos_t); free(sin_t); free(slopes);
    free(qkv0); free(cache0); free(out0); free(rc); free(rq); free(ry); free(p);
}

/* ---- the decode layers: a batch of one agrees with the single-sequence call, and each sequence of a batch
   with itself run alone, bit for bit ------------------------------------------------------------------- */

enum { NL = 2, C = 32, NH = 2, NKV = 1, HD = 16, FFN = 40 };

static void make_layers(layer_t* L, float** owned, int* nown, float* cache_for_layer[NL]) {
    for (int l = 0; l < NL; l++) {
        float *wqkv = randv((NH + 2 * NKV) * HD * C), *wo = randv(C * NH * HD);
        float *wgu = randv(2 * FFN * C), *wd = randv(C * FFN);
        layer_t t = {0};
        t.attn_norm = owned[(*nown)++] = randv(C);
        t.mlp_norm = owned[(*nown)++] = randv(C);
        t.wqkv = owned[(*nown)++] = pack(wqkv, (NH + 2 * NKV) * HD, C);
        t.wo = owned[(*nown)++] = pack(wo, C, NH * HD);
        t.wgu = owned[(*nown)++] = pack(wgu, 2 * FFN, C);
        t.wd = owned[(*nown)++] = pack(wd, C, FFN);
        t.bqkv = l == 0 ? (owned[(*nown)++] = randv((NH + 2 * NKV) * HD)) : NULL;  /* biases: some present */
        t.bd = l == 0 ? (owned[(*nown)++] = randv(C)) : NULL;
        t.attn_eps = 1e-5f; t.mlp_eps = 1e-6f;
        t.cache = cache_for_layer[l];
        L[l] = t;
        free(wqkv); free(wo); free(wgu); free(wd);
    }
}

static void check_decode_layers(void) {
    enum { R = 3, BS = 4, LDT = 2, SLOTS = R * LDT * BS };
    const long pos[R] = {2, 5, 0}, rows[R] = {0, 1, 2};
    long tables[R * LDT];
    for (long i = 0; i < R * LDT; i++) tables[i] = (i * 5 + 1) % (R * LDT);
    long P = 6, cn = 2 * NKV * SLOTS * HD;
    float *cos_t = randv(P * HD), *sin_t = randv(P * HD), *x0 = randv(R * C);
    float* cache0[NL];
    for (int l = 0; l < NL; l++) cache0[l] = randv(cn);
    float* owned[4 * NL * 8];
    int nown = 0;
    float* caches[NL];
    layer_t L[NL];
    for (int l = 0; l < NL; l++) caches[l] = copyv(cache0[l], cn);
    make_layers(L, owned, &nown, caches);
    long per = C + (NH + 2 * NKV) * HD + NH * HD + 3 * FFN;
    float* scratch = xmalloc((size_t)R * per * sizeof(float));

    float* xb = copyv(x0, R * C);  /* all R together */
    if (wsc_decode_layers_batch(xb, L, NL, R, C, NH, NKV, HD, FFN, cos_t, sin_t, SLOTS, pos, tables, LDT, BS, rows,
                                scratch) != 0) { fprintf(stderr, "FAIL decode_layers_batch: out of memory\n"); g_fail++; }
    for (long r = 0; r < R; r++) {  /* each alone, on a fresh cache */
        for (int l = 0; l < NL; l++) memcpy(caches[l], cache0[l], cn * sizeof(float));
        float* x1 = copyv(x0 + r * C, C);
        long zero = 0;
        wsc_decode_layers_batch(x1, L, NL, 1, C, NH, NKV, HD, FFN, cos_t, sin_t, SLOTS, pos + r, tables + r * LDT, LDT,
                                BS, &zero, scratch);
        expect_same("decode_layers_batch: a sequence alone vs in the batch", x1, xb + r * C, C);
        free(x1);
    }
    /* one sequence whose blocks are consecutive from slot 0: the single-sequence call, same bits */
    long ident[LDT] = {0, 1}, p = 5, one = 0;
    for (int l = 0; l < NL; l++) memcpy(caches[l], cache0[l], cn * sizeof(float));
    float* xa = copyv(x0, C);
    wsc_decode_layers_batch(xa, L, NL, 1, C, NH, NKV, HD, FFN, cos_t, sin_t, SLOTS, &p, ident, LDT, BS, &one, scratch);
    for (int l = 0; l < NL; l++) memcpy(caches[l], cache0[l], cn * sizeof(float));
    float* xs = copyv(x0, C);
    if (wsc_decode_layers(xs, L, NL, C, NH, NKV, HD, FFN, cos_t + p * HD, sin_t + p * HD, SLOTS, 0, p + 1,
                          scratch) != 0) { fprintf(stderr, "FAIL decode_layers: out of memory\n"); g_fail++; }
    expect_same("decode_layers vs decode_layers_batch of one", xs, xa, C);
    for (long i = 0; i < C; i++) expect("decode_layers finite", i, isfinite(xs[i]), 1, 0, 0);

    free(cos_t); free(sin_t); free(x0); free(scratch); free(xb); free(xa); free(xs);
    for (int l = 0; l < NL; l++) { free(cache0[l]); free(caches[l]); }
    for (int i = 0; i < nown; i++) free(owned[i]);
}

/* ---- wsc_qpack / wsc_qlinear: weights as GGUF's blocks ---------------------------------------------------- */

static double half_ref(const uint8_t* p) {  /* IEEE half, as ggml reads it */
    unsigned h = p[0] | p[1] << 8, e = (h >> 10) & 31, m = h & 1023;
    double v = e ? ldexp(1024.0 + m, (int)e - 25) : ldexp(m, -24);
    return h >> 15 ? -v : v;
}

/* one output's GGUF row (`in` weights of type qt) -> doubles, after ggml's dequantize_row_* */
static void dequant_ref(int qt, const uint8_t* b, long in, double* w) {
    for (long j = 0; j < in / QK[qt]; j++, b += QROW[qt], w += QK[qt]) {
        double d = half_ref(b);
        switch (qt) {
        case QT_BF16: {
            uint32_t u = (uint32_t)(b[0] | b[1] << 8) << 16;
            float f;
            memcpy(&f, &u, 4);
            w[0] = f;
            break;
        }
        case QT_Q8_0:
            for (int k = 0; k < 32; k++) w[k] = d * (int8_t)b[2 + k];
            break;
        case QT_Q4_0:
            for (int k = 0; k < 16; k++) {
                w[k] = d * ((b[2 + k] & 15) - 8);
                w[k + 16] = d * ((b[2 + k] >> 4) - 8);
            }
            break;
        case QT_Q4_1: {
            double m = half_ref(b + 2);
            for (int k = 0; k < 16; k++) { w[k] = d * (b[4 + k] & 15) + m; w[k + 16] = d * (b[4 + k] >> 4) + m; }
            break;
        }
        case QT_Q4_K: {
            const uint8_t *q = b + 4, *qs = b + 16;
            double dmin = half_ref(b + 2);
            for (int s = 0; s < 8; s++) {  /* ggml's get_scale_min_k4 */
                int sc = s < 4 ? q[s] & 63 : (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
                int mn = s < 4 ? q[s + 4] & 63 : (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
                for (int l = 0; l < 32; l++) {
                    int v = s & 1 ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15;
                    w[32 * s + l] = d * sc * v - dmin * mn;
                }
            }
            break;
        }
        case QT_Q6_K: {
            d = half_ref(b + 208);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                const int8_t* sc = (const int8_t*)b + 192 + 8 * h;
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    w[128 * h + l] = d * sc[is] * (((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                    w[128 * h + l + 32] = d * sc[is + 2] * (((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    w[128 * h + l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    w[128 * h + l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
            break;
        }
        }
    }
}

/* random GGUF rows of type qt: random bytes, fp16 scales (d; Q4_1's m, Q4_K's dmin) of magnitude 2^-10 .. 2^-3 */
static uint8_t* random_rows(int qt, long out, long in) {
    long n = out * (in / QK[qt]) * QROW[qt];
    uint8_t* b = xmalloc((size_t)n);
    for (long i = 0; i < n; i++) b[i] = (uint8_t)(frand() * 128 + 128);
    if (qt == QT_BF16) {
        for (long i = 1; i < n; i += 2) b[i] = (uint8_t)((b[i] & 0x80) | (0x3C + (b[i] & 3)));  /* |w| ~ 2^-7..2^0 */
        return b;
    }
    int half_at[2] = {qt == QT_Q6_K ? 208 : 0, qt == QT_Q4_1 || qt == QT_Q4_K ? 2 : -1};
    for (long blk = 0; blk < n / QROW[qt]; blk++)
        for (int f = 0; f < 2; f++)
            if (half_at[f] >= 0) {
                uint8_t* h = b + blk * QROW[qt] + half_at[f];
                h[1] = (uint8_t)((h[1] & 0x83) | (5 + (int)((frand() + 1) * 3.5)) << 2);  /* exponent 5 .. 12 */
            }
    return b;
}

/* the product through the kernels (both paths, 1 and 2 threads) against doubles over the reference weights */
static void check_qlinear(int qt, long rows, long out, long in) {
    char what[128];
    uint8_t* src = random_rows(qt, out, in);
    long np = (out + PANEL - 1) / PANEL, nb = in / 32;
    uint8_t* packed = xmalloc((size_t)(np * qpanel_bytes(qt, in)));
    double* W = xmalloc((size_t)(out * in) * sizeof(double));
    float* Wf = xmalloc((size_t)(out * in) * sizeof(float));
    if (wsc_qpack(src, qt, out, in, packed) != 0) { fprintf(stderr, "FAIL qpack type %d\n", qt); g_fail++; }
    for (long o = 0; o < out; o++) dequant_ref(qt, src + o * (in / QK[qt]) * QROW[qt], in, W + o * in);
    for (long i = 0; i < out * in; i++) Wf[i] = (float)W[i];
    float* wp = pack(Wf, out, in);
    float *x = randv(rows * in), *b = randv(out), *res = randv(rows * out);
    float *y = randv(rows * out), *y2 = randv(rows * out), *yf = randv(rows * out);
    for (int int8 = 0; int8 < 2; int8++) {
        wsc_qset_int8(int8);
        if (int8 && !qint8_applies(qt)) break;  /* (the types the integer path takes) */
        wsc_set_threads(1);
        if (wsc_qlinear(packed, qt, x, b, res, y, rows, out, in) != 0) {
            fprintf(stderr, "FAIL qlinear: out of memory\n");
            g_fail++;
        }
        wsc_set_threads(2);
        for (int i = 0; i < 8; i++) {
            wsc_qlinear(packed, qt, x, b, res, y2, rows, out, in);
            snprintf(what, sizeof what, "qlinear type %d int8 %d on 2 threads rows=%ld out=%ld in=%ld", qt, int8, rows,
                     out, in);
            expect_same(what, y2, y, rows * out);
        }
        wsc_set_threads(1);
        snprintf(what, sizeof what, "qlinear type %d int8 %d rows=%ld out=%ld in=%ld", qt, int8, rows, out, in);
        for (long r = 0; r < rows; r++)
            for (long o = 0; o < out; o++) {
                double s = 0, mag = 0, xerr = 0;
                for (long k = 0; k < in; k++) {
                    s += (double)x[r * in + k] * W[o * in + k];
                    mag += fabs((double)x[r * in + k] * W[o * in + k]);
                }
                for (long j = 0; int8 && j < nb; j++) {  /* x's rounding (two int8 digits): at most max |x| /
                                                              (127 * 508) per element, and the rest's float error */
                    double amax = 0, wsum = 0;
                    for (int k = 0; k < 32; k++) {
                        amax = fmax(amax, fabs(x[r * in + 32 * j + k]));
                        wsum += fabs(W[o * in + 32 * j + k]);
                    }
                    xerr += (amax / (127 * 508) * 1.001 + 4 * amax * 0x1p-24) * wsum;
                }
                expect(what, r * out + o, y[r * out + o], res[r * out + o] + s + b[o], mag + 2 + xerr / 1e-6, 1e-6);
            }
        if (!int8) {  /* exact dequantization, then the float panels' chain: their bits */
            wsc_linear(wp, x, b, res, yf, rows, out, in);
            snprintf(what, sizeof what, "qlinear type %d vs float panels rows=%ld out=%ld in=%ld", qt, rows, out, in);
            expect_same(what, y, yf, rows * out);
        }
    }
    wsc_qset_int8(1);
    free(src); free(packed); free(W); free(Wf); free(wp); free(x); free(b); free(res); free(y); free(y2); free(yf);
}

/* quantize_x (its vector reductions) against the same rule written lane by lane, bit for bit: max |x| ignoring
   NaN, the digits, their int16 X = 254 xq + xr and its sum as exact integers; rows of ordinary, tiny (subnormal), huge, NaN, inf and zero values */
static void check_quantize_x(void) {
    const long rows = 7, in = 96, nb = in / 32;
    float* x = randv(rows * in);
    for (long i = 0; i < in; i++) {
        x[1 * in + i] *= 1e-40f;
        x[2 * in + i] *= 1e30f;
        if (i % 7 == 0) x[3 * in + i] = NAN;
        if (i % 11 == 0) x[4 * in + i] = -INFINITY;
        x[5 * in + i] = i % 3 ? 0.0f : -0.0f;
    }
    int8_t* xq = xmalloc((size_t)(XB * rows * in));
    float* xs = xmalloc((size_t)(rows * nb * XS) * sizeof(float));
    quantize_x(x, rows, in, xq, xs);
    digest(xq, (size_t)(XB * rows * in));
    digest(xs, (size_t)(rows * nb * XS) * sizeof(float));
    for (long r = 0; r < rows; r++)
        for (long j = 0; j < nb; j++) {
            const float* v = x + r * in + 32 * j;
            float amax = 0, t[XS];
            for (int k = 0; k < 32; k++) amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
            float dx = amax / 127, id = dx > 0 ? 1 / dx : 0, dr = dx / 254, idr = dr > 0 ? 1 / dr : 0;
            long sx = 0, bad = 0;
            for (int k = 0; k < 32; k++) {
                int8_t q = (int8_t)round_i8((vf){0} + v[k] * id)[0];  /* (every lane the same: the first) */
                int8_t qr = (int8_t)round_i8((vf){0} + (v[k] - (float)q * dx) * idr)[0];
                int16_t X;
                memcpy(&X, xq + XB * r * in + 2 * in + 2 * (32 * j + k), 2);
                sx += 254 * q + qr;
                bad += q != xq[XB * r * in + 32 * j + k] || qr != xq[XB * r * in + in + 32 * j + k] || X != 254 * q + qr;
            }
            t[0] = dx, t[1] = dr, t[3] = (float)sx;
            t[2] = xs[XS * (r * nb + j) + 2];  /* (the block's float sum: hsum16's order, checked by the products) */
            if (bad || memcmp(t, xs + XS * (r * nb + j), sizeof t) != 0) {
                fprintf(stderr, "FAIL quantize_x row %ld block %ld: %ld digits differ, or dx/dr/sums\n", r, j, bad);
                g_fail++;
            }
        }
    free(x); free(xq); free(xs);
}

int main(void) {
    const long lin[][3] = {{1, 5, 37}, {1, 32, 64}, {3, 17, 16}, {4, 130, 64}, {5, 131, 37}, {7, 6, 15},
                           {16, 33, 48}, {17, 50, 20}, {33, 16, 64}};
    for (size_t i = 0; i < sizeof lin / sizeof lin[0]; i++) check_linear(lin[i][0], lin[i][1], lin[i][2]);
    check_linear_threads(4, 700, 48);
    check_linear_threads(1, 700, 48);
    check_linear_threads(20, 300, 37);
    check_rms_norm(3, 37);
    check_rms_norm(2, 64);
    check_rms_norm(1, 1);
    check_silu_mul(2, 37);
    check_silu_mul(1, 64);
    const long am[] = {1, 7, 16, 31, 32, 37, 64, 100};
    for (size_t i = 0; i < sizeof am / sizeof am[0]; i++) check_argmax(am[i]);
    check_decode_attention(4, 2, 16, 1, 1);
    check_decode_attention(4, 2, 16, 5, 0);
    check_decode_attention(3, 1, 64, 33, 1);
    check_decode_attention(2, 2, 48, 17, 1);
    check_decode_attention(8, 1, 64, 40, 1);
    wsc_set_threads(2);  /* one sequence's KV heads shared out among the threads (32 positions or more) */
    check_decode_attention(6, 3, 64, 40, 1);
    check_decode_attention(4, 2, 32, 100, 0);
    wsc_set_threads(1);
    check_decode_attention_batch(4, 2, 32, 4);
    check_half_conversions();
    check_decode_attention_f16(3, 1, 64, 33, 1);
    check_decode_attention_f16(9, 3, 64, 40, 2);
    check_decode_attention_f16(4, 2, 32, 5, 1);
    check_decode_attention_batch(3, 1, 64, 16);
    check_prefill_attention_batch(6, 2, 32, 4, 0, 0, 0);
    check_prefill_attention_batch(9, 3, 64, 16, 0, 0, 1);
    check_prefill_attention_batch(4, 4, 16, 8, 24, 1, 0);
    check_prefill_attention_batch(8, 1, 128, 16, 40, 0, 1);
    check_decode_layers();
    check_quantize_x();
    const long qs[][3] = {{1, 5, 256}, {3, 37, 512}, {5, 70, 256}, {17, 16, 256}, {1, 130, 512}};
    for (int qt = QT_BF16; qt < QT_N; qt++)
        for (size_t i = 0; i < sizeof qs / sizeof qs[0]; i++) check_qlinear(qt, qs[i][0], qs[i][1], qs[i][2]);
    if (g_fail) {
        fprintf(stderr, "%d checks failed\n", g_fail);
        return 1;
    }
    printf("serve kernels: all checks passed\n");
    printf("path %s, digest %016llx\n", wsc_kernel_path(), g_digest);
    return 0;
}
