/* Benchmark: one single-stream decode token's kernels from C (no Python, no engine), against the memory's own copy
   bandwidth: how close the C part alone comes to the bytes-read bound.

   SmolLM2-135M's shapes as its Q4_1 GGUF holds them: 30 layers of Q4_1 panels (q|k|v 960 x 576, o 576 x 576,
   gate|up 3072 x 576, down 576 x 1536: 66.4 MB) through wsc_decode_layers (norms, products, float16-KV attention
   at 100-127 positions, in one call, as the runner's single-stream path), then the final norm and the Q8_0 head
   (49,152 x 576: 30.1 MB) through wsc_qlinear; weights on huge pages, filled with a constant (the kernels' speed
   does not depend on the values). Each round measures the copy bandwidth (a 512 MiB copy on huge pages, the
   threads splitting it, read + write counted, best of 10: bench/serve_decode.py's bound) and then decodes
   `tokens` tokens, and prints the token's time split into layers and head, its bytes per second and that
   against the round's own bound (this VM's memory moves between a ~45 and a ~78 GB/s state within minutes).
   Each round first measures the round trip of one cache line between two threads: the price of each hand-off
   between the pool's threads, which moves with the memory's state (below).

   Build and run (from the repository root; to measure another version of the kernels, point -I at its csrc):
     cc -O3 -march=native -fno-fast-math -pthread -I src/waferscale/serve/csrc bench/serve_decode_token.c \
        -o /tmp/serve_decode_token -lm
     /tmp/serve_decode_token [threads=2] [tokens=200] [rounds=5] */

#include "serve_kernels.c"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void* huge_buf(long bytes, int fill) {  /* 2 MiB-aligned, on transparent huge pages where there are */
    long a = 2L << 20;
    bytes = (bytes + a - 1) / a * a;
    void* p = aligned_alloc(a, bytes);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, fill, bytes);
    return p;
}

typedef struct { char *dst, *src; long n; } copy_t;
static void* copy_part(void* a) { copy_t* c = a; memcpy(c->dst, c->src, c->n); return NULL; }

static double copy_bandwidth(int threads) {  /* bytes read + written per second, best of 10 */
    static char *a, *b;
    long n = 512L << 20;
    if (!a) { a = huge_buf(n, 1); b = huge_buf(n, 0); }
    double best = 1e9;
    for (int r = 0; r < 11; r++) {
        pthread_t t[64];
        copy_t c[64];
        double t0 = now();
        for (int k = 0; k < threads; k++) {
            c[k] = (copy_t){b + n / threads * k, a + n / threads * k, n / threads};
            if (k) pthread_create(&t[k], NULL, copy_part, &c[k]);
        }
        copy_part(&c[0]);
        for (int k = 1; k < threads; k++) pthread_join(t[k], NULL);
        double d = now() - t0;
        if (r && d < best) best = d;  /* (the first warms up) */
    }
    return 2.0 * n / best;
}

static _Atomic long g_flag;
enum { PINGS = 100000 };
static void* pong(void* arg) {
    (void)arg;
    for (long i = 1; i <= PINGS; i++) {
        while (atomic_load(&g_flag) != 2 * i - 1) cpu_relax();
        atomic_store(&g_flag, 2 * i);
    }
    return NULL;
}

static double round_trip_ns(void) {
    pthread_t t;
    pthread_create(&t, NULL, pong, NULL);
    double t0 = now();
    for (long i = 1; i <= PINGS; i++) {
        atomic_store(&g_flag, 2 * i - 1);
        while (atomic_load(&g_flag) != 2 * i) cpu_relax();
    }
    double d = now() - t0;
    pthread_join(t, NULL);
    return d / PINGS * 1e9;
}

/* (through a pointer: inlined into main, GCC warns about the expert path's loops this model never runs) */
static int (*volatile decode_layers)(float*, const layer_t*, long, long, long, long, long, long, const float*,
                                     const float*, long, long, long, float*) = wsc_decode_layers;

int main(int argc, char** argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2, tokens = argc > 2 ? atoi(argv[2]) : 200;
    int rounds = argc > 3 ? atoi(argv[3]) : 5;
    if (threads < 1 || tokens < 21 || rounds < 1) {
        fprintf(stderr, "usage: %s [threads >= 1] [tokens >= 21] [rounds >= 1]\n", argv[0]);
        return 2;
    }
    const long C = 576, nh = 9, nkv = 3, hd = 64, ffn = 1536, NL = 30, V = 49152, slots = 256, S0 = 100;
    const int qt = QT_Q4_1;
    threads = wsc_set_threads(threads);
    long bqkv = qpanel_bytes(qt, C) * ((nh + 2 * nkv) * hd / PANEL), bo = qpanel_bytes(qt, nh * hd) * (C / PANEL);
    long bgu = qpanel_bytes(qt, C) * (2 * ffn / PANEL), bd = qpanel_bytes(qt, ffn) * (C / PANEL);
    long per = bqkv + bo + bgu + bd, hb = qpanel_bytes(QT_Q8_0, C) * (V / PANEL);
    uint8_t* arena = huge_buf(per * NL, 0x11);  /* (fp16 0x1111 scales: small normal numbers) */
    uint8_t* head = huge_buf(hb, 0x11);
    float* ones = malloc(C * sizeof(float));
    for (long i = 0; i < C; i++) ones[i] = 1.0f;
    layer_t L[30];
    memset(L, 0, sizeof L);
    for (long l = 0; l < NL; l++) {
        uint8_t* p = arena + l * per;
        L[l].attn_norm = L[l].mlp_norm = ones;
        L[l].attn_eps = L[l].mlp_eps = 1e-5f;
        L[l].wqkv = (const float*)p, L[l].wo = (const float*)(p + bqkv);
        L[l].wgu = (const float*)(p + bqkv + bo), L[l].wd = (const float*)(p + bqkv + bo + bgu);
        L[l].qqkv = L[l].qo = L[l].qgu = L[l].qd = qt;
        L[l].kv16 = 1;
        L[l].cache = huge_buf(2 * nkv * slots * hd * 2, 0);
    }
    float *x = malloc(C * sizeof(float)), *h = malloc(C * sizeof(float)), *logits = malloc(V * sizeof(float));
    float* scratch = malloc((C + (nh + 2 * nkv) * hd + nh * hd + 3 * ffn) * sizeof(float));
    float cos[64], sin[64];
    for (int i = 0; i < 64; i++) cos[i] = 1.0f, sin[i] = 0.0f;
    double bytes = (double)per * NL + hb;
    printf("SmolLM2-135M Q4_1 shapes: layers %.1f MB + Q8_0 head %.1f MB = %.1f MB a token; %d thread(s)\n",
           per * NL / 1e6, hb / 1e6, bytes / 1e6, threads);
    for (int r = 0; r < rounds; r++) {
        double rt = round_trip_ns(), bw = copy_bandwidth(threads), tl = 0, th = 0;
        for (int t = 0; t < tokens; t++) {
            for (long i = 0; i < C; i++) x[i] = 0.01f * (float)((i * 7 + t) % 13 - 6);
            double t0 = now();
            int rc = decode_layers(x, L, NL, C, nh, nkv, hd, ffn, cos, sin, slots, 0, S0 + t % 28, scratch);
            double t1 = now();
            wsc_rms_norm(x, ones, 1e-5f, h, 1, C);
            rc |= wsc_qlinear(head, QT_Q8_0, h, NULL, NULL, logits, 1, V, C);
            double t2 = now();
            if (rc != 0) {
                fprintf(stderr, "out of memory\n");
                return 2;
            }
            if (t >= 20) tl += t1 - t0, th += t2 - t1;  /* (the first 20 warm up) */
        }
        int n = tokens - 20;
        double tok = (tl + th) / n;
        printf("round %d: line round trip %.0f ns, copy %.1f GB/s | layers %.0f us (%.1f GB/s), head %.0f us (%.1f GB/s) | token %.0f us = "
               "%.0f tok/s, %.1f GB/s = %.1f%% of the bound\n", r + 1, rt, bw / 1e9, tl / n * 1e6, per * NL / (tl / n) / 1e9,
               th / n * 1e6, hb / (th / n) / 1e9, tok * 1e6, 1 / tok, bytes / tok / 1e9, 100 * bytes / tok / bw);
    }
    return 0;
}
