/* Benchmark: the serving kernels' sparse panels against the dense ones, from C (no Python overhead per product).

   SmolLM2-135M's fused matrix shapes (q|k|v 960 x 576, o 576 x 576, gate|up 3072 x 576, down 576 x 1536), random
   weights with each weight zero with probability `sparsity` (magnitude pruning of random weights), packed both
   ways into enough copies that a pass over them outruns the caches, as decode streams weights from memory. For
   each shape and row count, dense then sparse products of the same copy alternate, each timed alone (pairs a
   few microseconds apart see the same shared machine); the outputs must be the same bits. Per sparsity, the sums
   over the four shapes of the median times, their ratio (dense / sparse: above 1, sparse is faster) and that
   ratio over the bytes ratio (1: as fast as the bytes alone allow).

   Build and run (from the repository root; to measure another version of the kernels, point -I at its csrc):
     cc -O3 -march=native -fno-fast-math -pthread -I src/waferscale/serve/csrc bench/serve_sparse_kernels.c \
        -o /tmp/serve_sparse_kernels -lm
     /tmp/serve_sparse_kernels [threads=1] [rows=1,4,8,16,24,32,64] [sparsities=0.5,0.75,0.9] [pairs=150] */

#include "serve_kernels.c"

#include <stdio.h>
#include <string.h>

static unsigned long long g_rng = 88172645463325252ull;

static double urand(void) {  /* uniform in [0, 1), xorshift64 */
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}

static void* xmalloc(size_t n) {
    void* p = aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}

static double median(double* v, int n) { qsort(v, n, sizeof *v, cmp_double); return v[n / 2]; }

/* "a,b,c" -> up to max numbers */
static int parse_list(const char* s, double* v, int max) {
    int n = 0;
    while (*s && n < max) {
        v[n++] = atof(s);
        while (*s && *s != ',') s++;
        if (*s) s++;
    }
    return n;
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

#define MAX_COPIES 128
#define MAX_ROWS 16

int main(int argc, char** argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    double rows_d[MAX_ROWS], sp[8];
    int nr = parse_list(argc > 2 ? argv[2] : "1,4,8,16,24,32,64", rows_d, MAX_ROWS);
    int ns = parse_list(argc > 3 ? argv[3] : "0.5,0.75,0.9", sp, 8);
    int pairs = argc > 4 ? atoi(argv[4]) : 150;
    const long shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    printf("threads %d (wsc_set_threads: %d)\n", threads, wsc_set_threads(threads));
    printf("%8s %4s %10s %10s %8s %11s %18s\n", "sparsity", "rows", "dense us", "sparse us", "speedup",
           "bytes ratio", "speedup / bytes");
    for (int si = 0; si < ns; si++) {
        double dense_us[MAX_ROWS] = {0}, sparse_us[MAX_ROWS] = {0}, dense_b = 0, sparse_b = 0;
        for (int sh = 0; sh < 4; sh++) {
            long out = shapes[sh][0], in = shapes[sh][1], np = (out + PANEL - 1) / PANEL, info[3];
            float* W = xmalloc((size_t)out * in * sizeof(float));
            for (long i = 0; i < out * in; i++) {
                float v = (float)(urand() * 2 - 1);
                W[i] = urand() < sp[si] ? 0.0f : v;
            }
            if (wsc_sparse_plan(W, out, in, info) != 0) { fprintf(stderr, "out of memory\n"); return 2; }
            long dense_n = np * in * PANEL;
            int copies = (int)(96e6 / (dense_n * 4.0)) + 1;  /* ~96 MB of dense panels: past any cache */
            if (copies > MAX_COPIES) copies = MAX_COPIES;
            float *dw[MAX_COPIES], *sw[MAX_COPIES];
            int64_t* off = xmalloc((size_t)(np + 2) * sizeof(int64_t));
            for (int c = 0; c < copies; c++) {
                dw[c] = pack(W, out, in);
                sw[c] = xmalloc((size_t)info[1] * sizeof(float));
                if (wsc_sparse_pack(W, out, in, (int)info[0], sw[c], off) != 0) { fprintf(stderr, "oom\n"); return 2; }
            }
            dense_b += dense_n * 4.0;
            sparse_b += info[1] * 4.0;
            for (int r = 0; r < nr; r++) {
                long R = (long)rows_d[r];
                int n = (int)(pairs * (R < 8 ? 1.0 : 8.0 / R)) + 20;  /* (fewer pairs for the slower products) */
                float *x = xmalloc((size_t)R * in * sizeof(float)), *yd = xmalloc((size_t)R * out * sizeof(float)),
                      *ys = xmalloc((size_t)R * out * sizeof(float));
                double *td = xmalloc((size_t)n * sizeof(double)), *ts = xmalloc((size_t)n * sizeof(double));
                for (long i = 0; i < R * in; i++) x[i] = (float)(urand() - 0.5);
                for (int i = 0; i < n; i++) {
                    int c = i % copies;
                    long t0 = now_ns();
                    wsc_linear(dw[c], x, NULL, NULL, yd, R, out, in);
                    long t1 = now_ns();
                    wsc_linear_sparse(sw[c], off, x, NULL, NULL, ys, R, out, in);
                    td[i] = (double)(t1 - t0);
                    ts[i] = (double)(now_ns() - t1);
                }
                if (memcmp(yd, ys, (size_t)R * out * sizeof(float)) != 0) {
                    fprintf(stderr, "%ldx%ld, %ld rows: sparse and dense bits differ\n", out, in, R);
                    return 1;
                }
                dense_us[r] += median(td, n) / 1e3;
                sparse_us[r] += median(ts, n) / 1e3;
                free(x); free(yd); free(ys); free(td); free(ts);
            }
            for (int c = 0; c < copies; c++) { free(dw[c]); free(sw[c]); }
            free(W); free(off);
        }
        for (int r = 0; r < nr; r++)
            printf("%7.0f%% %4ld %10.1f %10.1f %7.2fx %10.2fx %18.2f\n", sp[si] * 100, (long)rows_d[r], dense_us[r],
                   sparse_us[r], dense_us[r] / sparse_us[r], dense_b / sparse_b,
                   dense_us[r] / sparse_us[r] / (dense_b / sparse_b));
    }
    double load[3];
    if (getloadavg(load, 3) > 0) printf("load average %.1f (other processes share these cores)\n", load[0]);
    return 0;
}
