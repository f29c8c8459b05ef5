/* A check of the serving kernels' sparse panels (src/waferscale/serve/csrc/spanels.c) under AddressSanitizer and
   UBSan, built and run by tests/test_serve_sparse.py (once as this machine builds the kernels, once without
   AVX-512: the portable path): random matrices at several densities, packed by wsc_sparse_plan /
   wsc_sparse_pack into buffers of their exact size, must give the dense panels' products bit for bit, with one
   thread and with the pool's two, for row counts that take each of the window kernel's row groups (8, 4, 2, 1),
   the residual apart and in place; and the decode layers over sparse matrices must give the dense layers' bits.
   Prints one line per failed comparison and exits 1 if any failed; a sanitizer report aborts the run by itself.

   Build: cc -I src/waferscale/serve/csrc -O1 -g -march=native -fno-fast-math -pthread
          -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
          tests/csrc/serve_sparse_check.c -lm */

#include "serve_kernels.c"

#include <stdio.h>
#include <string.h>

static int g_fail;
static unsigned long long g_rng = 88172645463325252ull;

static double urand(void) {  /* uniform in [0, 1), xorshift64 */
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}

static void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

static float* randv(long n) {
    float* v = xmalloc((size_t)n * sizeof(float));
    for (long i = 0; i < n; i++) v[i] = (float)(urand() * 2 - 1);
    return v;
}

/* (out, in) with about `density` of its weights non-zero; the others +0 or -0 (as w * mask leaves them) */
static float* sparse_matrix(long out, long in, double density) {
    float* w = randv(out * in);
    for (long i = 0; i < out * in; i++) if (urand() >= density) w[i] = w[i] < 0 ? -0.0f : 0.0f;
    return w;
}

static float* copyv(const float* s, long n) {
    float* v = xmalloc((size_t)n * sizeof(float));
    memcpy(v, s, (size_t)n * sizeof(float));
    return v;
}

static void expect_same(const char* what, const float* a, const float* b, long n) {
    if (memcmp(a, b, (size_t)n * sizeof(float)) != 0) {
        if (g_fail < 20) fprintf(stderr, "FAIL %s: not the same bits\n", what);
        g_fail++;
    }
}

/* W (out, in) -> dense panels, as kernels.pack */
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

typedef struct { float* blob; int64_t* off; } sparse_t;

/* W -> sparse panels in buffers of exactly the size wsc_sparse_plan gives */
static sparse_t pack_sparse(const float* W, long out, long in) {
    long info[3];
    sparse_t s = {NULL, NULL};
    if (wsc_sparse_plan(W, out, in, info) != 0) { fprintf(stderr, "FAIL sparse_plan: out of memory\n"); exit(2); }
    s.blob = xmalloc((size_t)info[1] * sizeof(float));
    s.off = xmalloc((size_t)((out + PANEL - 1) / PANEL + 2) * sizeof(int64_t));
    if (wsc_sparse_pack(W, out, in, (int)info[0], s.blob, s.off) != 0) {
        fprintf(stderr, "FAIL sparse_pack: out of memory\n");
        exit(2);
    }
    if (s.off[(out + PANEL - 1) / PANEL] + PANEL != info[1]) {
        fprintf(stderr, "FAIL sparse_pack %ldx%ld: wrote %ld floats, the plan counted %ld\n", out, in,
                (long)s.off[(out + PANEL - 1) / PANEL] + PANEL, info[1]);
        g_fail++;
    }
    return s;
}

static void check_linear(long rows, long out, long in, double density, int threads) {
    char what[128];
    snprintf(what, sizeof what, "sparse linear rows=%ld out=%ld in=%ld density=%.2f threads=%d", rows, out, in,
             density, threads);
    float *W = sparse_matrix(out, in, density), *x = randv(rows * in), *b = randv(out), *res = randv(rows * out);
    float* wp = pack(W, out, in);
    sparse_t s = pack_sparse(W, out, in);
    float *yd = randv(rows * out), *ys = randv(rows * out);
    wsc_set_threads(threads);
    for (int rep = 0; rep < (threads > 1 ? 10 : 1); rep++) {  /* shared or not, whichever the pool picks */
        if (wsc_linear(wp, x, NULL, NULL, yd, rows, out, in) != 0 ||
            wsc_linear_sparse(s.blob, s.off, x, NULL, NULL, ys, rows, out, in) != 0) {
            fprintf(stderr, "FAIL %s: out of memory\n", what);
            g_fail++;
        }
        expect_same(what, ys, yd, rows * out);
        wsc_linear(wp, x, b, res, yd, rows, out, in);
        wsc_linear_sparse(s.blob, s.off, x, b, res, ys, rows, out, in);
        expect_same(what, ys, yd, rows * out);
        float* yi = copyv(res, rows * out);  /* the residual in place, as the decode layers use it */
        wsc_linear_sparse(s.blob, s.off, x, b, yi, yi, rows, out, in);
        expect_same(what, yi, yd, rows * out);
        free(yi);
    }
    wsc_set_threads(1);
    free(W); free(x); free(b); free(res); free(wp); free(s.blob); free(s.off); free(yd); free(ys);
}

/* two Llama layers with every matrix dense, then sparse: the same bits, one sequence and a batch */
static void check_decode_layers(void) {
    enum { NL = 2, C = 48, NH = 2, NKV = 1, HD = 16, FFN = 40, R = 3, BS = 4, LDT = 2, SLOTS = R * LDT * BS };
    const long pos[R] = {2, 5, 0}, rows[R] = {0, 1, 2};
    long tables[R * LDT];
    for (long i = 0; i < R * LDT; i++) tables[i] = (i * 5 + 1) % (R * LDT);
    long P = 6, cn = 2 * NKV * SLOTS * HD, per = C + (NH + 2 * NKV) * HD + NH * HD + 3 * FFN;
    const long shape[4][2] = {{(NH + 2 * NKV) * HD, C}, {C, NH * HD}, {2 * FFN, C}, {C, FFN}};
    float *cos_t = randv(P * HD), *sin_t = randv(P * HD), *x0 = randv(R * C), *cache0 = randv(cn);
    float* scratch = xmalloc((size_t)R * per * sizeof(float));
    float *norms[NL][2], *W[NL][4], *dense[NL][4], *cache[NL];
    sparse_t sp[NL][4];
    layer_t Ld[NL], Ls[NL];
    for (int l = 0; l < NL; l++) {
        norms[l][0] = randv(C);
        norms[l][1] = randv(C);
        cache[l] = xmalloc((size_t)cn * sizeof(float));
        for (int i = 0; i < 4; i++) {
            W[l][i] = sparse_matrix(shape[i][0], shape[i][1], i == 2 ? 0.1 : 0.3);
            dense[l][i] = pack(W[l][i], shape[i][0], shape[i][1]);
            sp[l][i] = pack_sparse(W[l][i], shape[i][0], shape[i][1]);
        }
        layer_t t = {0};
        t.attn_norm = norms[l][0];
        t.mlp_norm = norms[l][1];
        t.attn_eps = 1e-5f;
        t.mlp_eps = 1e-6f;
        t.cache = cache[l];
        t.wqkv = dense[l][0]; t.wo = dense[l][1]; t.wgu = dense[l][2]; t.wd = dense[l][3];
        Ld[l] = t;
        t.wqkv = sp[l][0].blob; t.wo = sp[l][1].blob; t.wgu = sp[l][2].blob; t.wd = sp[l][3].blob;
        t.oqkv = sp[l][0].off; t.oo = sp[l][1].off; t.ogu = sp[l][2].off; t.od = sp[l][3].off;
        Ls[l] = t;
    }
    float* out[2][2];
    for (int s = 0; s < 2; s++) {
        layer_t* L = s ? Ls : Ld;
        for (int l = 0; l < NL; l++) memcpy(cache[l], cache0, cn * sizeof(float));
        out[s][0] = copyv(x0, R * C);
        if (wsc_decode_layers_batch(out[s][0], L, NL, R, C, NH, NKV, HD, FFN, cos_t, sin_t, SLOTS, pos, tables, LDT,
                                    BS, rows, scratch) != 0) {
            fprintf(stderr, "FAIL decode layers: out of memory\n");
            g_fail++;
        }
        for (int l = 0; l < NL; l++) memcpy(cache[l], cache0, cn * sizeof(float));
        out[s][1] = copyv(x0, C);
        wsc_decode_layers(out[s][1], L, NL, C, NH, NKV, HD, FFN, cos_t + 5 * HD, sin_t + 5 * HD, SLOTS, 0, 6, scratch);
    }
    expect_same("decode_layers_batch over sparse matrices vs dense", out[1][0], out[0][0], R * C);
    expect_same("decode_layers over sparse matrices vs dense", out[1][1], out[0][1], C);
    for (int s = 0; s < 2; s++) { free(out[s][0]); free(out[s][1]); }
    for (int l = 0; l < NL; l++) {
        free(norms[l][0]); free(norms[l][1]); free(cache[l]);
        for (int i = 0; i < 4; i++) { free(W[l][i]); free(dense[l][i]); free(sp[l][i].blob); free(sp[l][i].off); }
    }
    free(cos_t); free(sin_t); free(x0); free(cache0); free(scratch);
}

int main(void) {
    const long shapes[][2] = {{5, 37}, {16, 32}, {33, 17}, {50, 64}, {131, 77}, {40, 200}};
    const long rows[] = {1, 3, 8, 15, 17, 40};  /* (15: a group of 8, 4, 2 and 1) */
    const double dens[] = {0.0, 0.05, 0.25, 0.6, 1.0};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
            for (size_t d = 0; d < sizeof dens / sizeof dens[0]; d++)
                check_linear(rows[r], shapes[i][0], shapes[i][1], dens[d], 1);
    check_linear(1, 700, 48, 0.2, 2);
    check_linear(4, 700, 48, 0.5, 2);
    check_linear(40, 300, 37, 0.5, 2);
    check_linear(40, 300, 37, 0.05, 2);
    check_decode_layers();
    if (g_fail) {
        fprintf(stderr, "%d checks failed\n", g_fail);
        return 1;
    }
    printf("sparse panels: all checks passed\n");
    return 0;
}
