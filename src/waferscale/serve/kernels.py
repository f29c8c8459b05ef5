"""Small C kernels for single-stream CPU decode, built once per machine with the system C compiler.

Why: one decode token reads every weight once, so a token costs (bytes read / memory bandwidth) plus
overheads. Measured on the 2-core AMD EPYC VM this project runs on (same runs, float32):

- MKL's one-row GEMM (packed or not), oneDNN and `torch.mv` stream the weights at ~7-9 GB/s where a plain
  reduction reads ~15-18 GB/s: they walk several weight rows at once (two interleaved rows alone halve the
  bandwidth here). A row-at-a-time dot product with four vector accumulators is one sequential stream and
  runs at the reduction's speed, provided its loop holds nothing but the dot products (bias / residual tests
  inside it cost ~30%).
- On 4 KiB pages every 4 KiB of weights is a TLB miss, and under virtualisation a costly one: the weights
  live in one 2 MiB-aligned arena on transparent huge pages (`hugepage_tensor`), 14 -> 26 GB/s on one thread.
- A second thread adds ~15-30% (when the other core is free): `set_threads` starts a work-stealing pool
  that measures whether sharing pays and falls back to one thread when it does not.
- `torch.compile` would generate a similar loop, but each compiled call costs ~30 us of guards (x 121
  projections per token) and a first compile of ~50 s; this file compiles in under a second.

Kernels (float32, contiguous, row-major; each output computed by the same code in the same order whichever
thread computes it, so results do not depend on the thread count):

- `linear(x, w, bias=None, residual=None)`: y = residual + x W^T + bias, for up to MAX_ROWS rows of x; W is
  read once per call (each weight row is used for every x row while it sits in L1). Several rows go through a
  register-blocked microkernel (4 weight rows x 4 x rows, 16 AVX-512 accumulators, then one 16-way tree
  reduction instead of 16 horizontal sums): measured ~100 GFLOP/s on one core at 16 rows for the SmolLM2
  shapes (MKL: ~75), ~150-180 shared by two threads, which doubled the 16-user aggregate decode rate.
- `rms_norm`, `silu_mul` (SwiGLU), `argmax` (greedy sampling), `decode_attention` (rope, KV write and GQA
  attention of one new token over consecutive cache slots), and `DecodeStack`: every layer of a Llama-style
  block stack for one token in one call. They agree with the torch ops to float32 rounding (~1e-7
  relative), not bit for bit.

Not available (`available()` is False) when there is no C compiler, when the build fails, or with
WSC_NO_C_KERNELS=1; the serving code then uses the torch path. The shared object is cached under
$WSC_CACHE_DIR (default ~/.cache/waferscale), keyed by the source, the compiler and this CPU's flags, and
written to a temporary name then renamed, so concurrent builds (pipeline stages) never see half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["DecodeStack", "MAX_ROWS", "argmax", "available", "decode_attention", "hugepage_tensor", "linear",
           "rms_norm", "set_threads", "silu_mul"]

MAX_ROWS = 32  # rows per call that the kernel handles well (register-blocked 4x4: ~100 GFLOP/s a core at 16)

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

static inline v16 ld16(const float* p) { v16 v; __builtin_memcpy(&v, p, sizeof v); return v; }

/* Fixed-order horizontal sum: halves, then halves again. */
static inline float hsum16(v16 v) {
#if defined(__clang__) || __GNUC__ >= 12
    v8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    v8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8 lo, hi; __builtin_memcpy(&lo, &v, 32); __builtin_memcpy(&hi, (const char*)&v + 32, 32);
#endif
    v8 s = lo + hi;
    float a = (s[0] + s[4]) + (s[2] + s[6]);
    float b = (s[1] + s[5]) + (s[3] + s[7]);
    return a + b;
}

/* One weight row against one input row: a single sequential stream, four vector accumulators. */
static inline float dot(const float* w, const float* x, long n) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 += ld16(w + i) * ld16(x + i);
        a1 += ld16(w + i + 16) * ld16(x + i + 16);
        a2 += ld16(w + i + 32) * ld16(x + i + 32);
        a3 += ld16(w + i + 48) * ld16(x + i + 48);
    }
    for (; i + 16 <= n; i += 16) a0 += ld16(w + i) * ld16(x + i);
    float s = hsum16((a0 + a1) + (a2 + a3));
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

/* Sums of 16 vectors at once, lanes in the fixed order of a 4-level tree: lane l of the result is the sum of
   vector TREE_PERM[l] (4 vector adds and 8 shuffles per level pair, instead of 16 horizontal sums). */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(p, q, ...) __builtin_shufflevector(p, q, __VA_ARGS__)
static inline v16 tlvl1(v16 p, v16 q) {
    return SHUF(p, q, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(p, q, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline v16 tlvl2(v16 p, v16 q) {
    return SHUF(p, q, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUF(p, q, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
static inline v16 tlvl3(v16 p, v16 q) {
    return SHUF(p, q, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUF(p, q, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
static inline v16 tlvl4(v16 p, v16 q) {
    return SHUF(p, q, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           SHUF(p, q, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#define HAVE_TREE 1
#endif
static const int TREE_PERM[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* nw (<= 4) weight rows against nx (<= 4) input rows: out[r * ldo + o] = dot(w[o], x[r]), one vector
   accumulator per pair, all in registers (16 + 8 of the 32), each step loading every operand once. Called
   with constant nw / nx so that each case compiles to its own unrolled loop. */
static inline __attribute__((always_inline)) void mk(const float* w, long ldw, int nw, const float* x, int nx,
                                                     long ldx, float* out, long ldo) {
    v16 acc[16];
    long n = ldw < ldx ? ldw : ldx, i = 0;
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) acc[k] = (v16){0};
    for (; i + 16 <= n; i += 16) {
        v16 wv[4], xv[4];
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) wv[a] = a < nw ? ld16(w + a * ldw + i) : (v16){0};
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) xv[b] = b < nx ? ld16(x + b * ldx + i) : (v16){0};
#if defined(__GNUC__) && defined(__AVX512F__)
        /* keep every operand in a register: folded into the FMAs, the compiler loads each one 4 times */
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) if (a < nw) __asm__("" : "+v"(wv[a]));
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) if (b < nx) __asm__("" : "+v"(xv[b]));
#endif
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++)
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++) if (a < nw && b < nx) acc[a * 4 + b] += wv[a] * xv[b];
    }
    float s[16];
#ifdef HAVE_TREE
    v16 t[8], u[4], v[2], r;
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) t[k] = tlvl1(acc[2 * k], acc[2 * k + 1]);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) u[k] = tlvl2(t[2 * k], t[2 * k + 1]);
    v[0] = tlvl3(u[0], u[1]); v[1] = tlvl3(u[2], u[3]);
    r = tlvl4(v[0], v[1]);
    float rs[16];
    __builtin_memcpy(rs, &r, sizeof r);
#pragma GCC unroll 16
    for (int l = 0; l < 16; l++) s[TREE_PERM[l]] = rs[l];
#else
    for (int k = 0; k < 16; k++) s[k] = hsum16(acc[k]);
#endif
#pragma GCC unroll 4
    for (int a = 0; a < 4; a++)
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++)
            if (a < nw && b < nx) {
                float z = s[a * 4 + b];
                for (long q = i; q < n; q++) z += w[a * ldw + q] * x[b * ldx + q];
                out[b * ldo + a] = z;
            }
}

typedef struct { const float *W, *x, *b, *res; float* y; long rows, out, in; } job_t;

/* outputs [o0, o1) of every row into buf (rows x (o1 - o0)). The one-row loop is kept free of anything but
   the dot products: with the bias / residual tests inside it, it streams ~30% slower. */
static void rows_into(const job_t* j, long o0, long o1, float* buf) {
    long m = o1 - o0, in = j->in, R = j->rows;
    const float* W = j->W;
    if (R == 1) {
        const float* x = j->x;
        for (long o = o0; o < o1; o++) buf[o - o0] = dot(W + (size_t)o * in, x, in);
    } else {
        /* register-blocked: 4 weight rows x 4 input rows at a time */
        long o = o0, x4 = R / 4 * 4;
        const float* x = j->x;
#define MK_ROWS(NW) \
        do { \
            const float* w = W + (size_t)o * in; \
            float* bo = buf + (o - o0); \
            for (long r = 0; r < x4; r += 4) mk(w, in, NW, x + (size_t)r * in, 4, in, bo + r * m, m); \
            switch (R - x4) { \
            case 3: mk(w, in, NW, x + (size_t)x4 * in, 3, in, bo + x4 * m, m); break; \
            case 2: mk(w, in, NW, x + (size_t)x4 * in, 2, in, bo + x4 * m, m); break; \
            case 1: mk(w, in, NW, x + (size_t)x4 * in, 1, in, bo + x4 * m, m); break; \
            } \
        } while (0)
        for (; o + 4 <= o1; o += 4) MK_ROWS(4);
        switch (o1 - o) {
        case 3: MK_ROWS(3); break;
        case 2: MK_ROWS(2); break;
        case 1: MK_ROWS(1); break;
        }
#undef MK_ROWS
    }
    if (j->b)
        for (long r = 0; r < R; r++)
            for (long o = o0; o < o1; o++) buf[r * m + (o - o0)] += j->b[o];
    if (j->res)
        for (long r = 0; r < R; r++)
            for (long o = o0; o < o1; o++)
                buf[r * m + (o - o0)] = j->res[(size_t)r * j->out + o] + buf[r * m + (o - o0)];
}

static void put(const job_t* j, long o0, long o1, const float* buf) {
    long m = o1 - o0;
    for (long r = 0; r < j->rows; r++)
        for (long o = o0; o < o1; o++) j->y[(size_t)r * j->out + o] = buf[r * m + (o - o0)];
}

/* ---- a tiny work-stealing pool for one matrix-vector product at a time ---------------------------------
   The output rows are cut into chunks (~32 KiB of weights each) and the chunks into one contiguous segment
   per thread, so that every thread streams its own stretch of the matrix front to back. A thread that runs
   out takes chunks from the back of another's segment (a worker that is asleep, or descheduled by another
   process, simply gets robbed). The caller never waits long: once no chunk is left to take it waits a few
   microseconds for chunks still in progress, then computes them itself. A chunk's result is published by
   whoever first moves its state from (gen, TODO) to (gen, WRITING), so a late worker only throws its result
   away. Every output is computed by the same code in the same order, whichever thread does it. */

#define CHUNK_FLOATS 8192          /* weights per chunk: 32 KiB, ~2 us at memory speed */
#define MAX_CHUNKS 8192
#define MAX_ROWS_MT 32
#define MAX_CHUNK_ROWS 256
#define MAX_THREADS 64
#define TODO 0
#define WRITING 1
#define DONE 2

typedef struct { _Atomic uint64_t fb; char pad[56]; } seg_t;  /* front << 32 | back, chunks [front, back) */

static job_t g_job;
static _Atomic long g_chunk_rows, g_nchunks, g_nseg;

static _Atomic uint64_t g_gen;     /* job generation; 0: none yet */
/* A chunk reads the caller's x and W, which may be freed once the caller returns: a worker enters a chunk
   only while its job is live (g_live) and counts itself in g_inflight, and the caller, once every chunk is
   done, ends the job and waits until no worker is inside one. */
static _Atomic uint64_t g_live;
static _Atomic long g_inflight;
static seg_t g_seg[MAX_THREADS];
static _Atomic uint64_t g_state[MAX_CHUNKS];  /* (gen << 2) | TODO/WRITING/DONE */
static _Atomic int g_sleeping, g_stop, g_workers, g_use = 1;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static long g_spin_ns = 100000;   /* a worker spins this long for the next job before it sleeps */
static long g_wait_ns = 20000;    /* the caller waits this long for chunks in progress before redoing them */

static inline long now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec;
}
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* take one chunk of segment k: from the front (owner) or the back (thief); -1 when it is empty */
static long take(long k, int front) {
    uint64_t w = atomic_load(&g_seg[k].fb);
    for (;;) {
        uint64_t f = w >> 32, bk = w & 0xFFFFFFFFu;
        if (f >= bk) return -1;
        uint64_t nw = front ? ((f + 1) << 32 | bk) : (f << 32 | (bk - 1));
        if (atomic_compare_exchange_weak(&g_seg[k].fb, &w, nw)) return (long)(front ? f : bk - 1);
    }
}

static inline int enter(uint64_t gen) {
    atomic_fetch_add(&g_inflight, 1);
    if (atomic_load(&g_live) == gen) return 1;
    atomic_fetch_sub(&g_inflight, 1);
    return 0;
}

static void finish_chunk(uint64_t gen, const job_t* j, long c, long cr, float* buf) {
    long o0 = c * cr, o1 = o0 + cr < j->out ? o0 + cr : j->out;
    rows_into(j, o0, o1, buf);
    uint64_t want = gen << 2 | TODO;
    if (atomic_compare_exchange_strong(&g_state[c], &want, gen << 2 | WRITING)) {
        put(j, o0, o1, buf);
        atomic_store(&g_state[c], gen << 2 | DONE);
    }
}

/* thread `me` of job `gen`: its own segment front to back, then the others' from their backs */
static void work(uint64_t gen, const job_t* j, long me) {
    float buf[MAX_ROWS_MT * MAX_CHUNK_ROWS];
    long cr = atomic_load(&g_chunk_rows), ns = atomic_load(&g_nseg);
    if (atomic_load(&g_gen) != gen || me >= ns) return;
    for (long c; (c = take(me, 1)) >= 0;) {
        if (!enter(gen)) return;  /* stale: the segments belong to a newer job */
        finish_chunk(gen, j, c, cr, buf);
        atomic_fetch_sub(&g_inflight, 1);
    }
    for (long d = 1; d < ns; d++) {
        long k = (me + d) % ns;
        for (long c; (c = take(k, 0)) >= 0;) {
            if (!enter(gen)) return;
            finish_chunk(gen, j, c, cr, buf);
            atomic_fetch_sub(&g_inflight, 1);
        }
    }
}

static void* worker_main(void* arg) {
    long me = (long)(intptr_t)arg;
    uint64_t seen = atomic_load(&g_gen);
    while (!atomic_load(&g_stop)) {
        long t0 = now_ns();
        uint64_t gen;
        while ((gen = atomic_load(&g_gen)) == seen && !atomic_load(&g_stop)) {
            cpu_relax();
            if (now_ns() - t0 > g_spin_ns) {
                pthread_mutex_lock(&g_mu);
                atomic_fetch_add(&g_sleeping, 1);
                while ((gen = atomic_load(&g_gen)) == seen && !atomic_load(&g_stop)) pthread_cond_wait(&g_cv, &g_mu);
                atomic_fetch_sub(&g_sleeping, 1);
                pthread_mutex_unlock(&g_mu);
                break;
            }
        }
        if (atomic_load(&g_stop)) break;
        seen = gen;
        job_t j = g_job;  /* stale if that job already finished: then every result below is thrown away */
        work(gen, &j, me);
    }
    return NULL;
}

/* Let `threads` threads (the caller's included) share each product from now on, starting workers as needed;
   returns how many will. */
int wsc_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    while (atomic_load(&g_workers) < threads - 1) {
        pthread_t t;
        long id = atomic_load(&g_workers) + 1;
        if (pthread_create(&t, NULL, worker_main, (void*)(intptr_t)id) != 0) break;
        pthread_detach(t);
        atomic_fetch_add(&g_workers, 1);
    }
    int n = atomic_load(&g_workers) + 1;
    atomic_store(&g_use, threads < n ? threads : n);
    return atomic_load(&g_use);
}

static void linear_1(const job_t* j) {
    float buf[MAX_ROWS_MT * 64];
    for (long o0 = 0; o0 < j->out; o0 += 64) {
        long o1 = o0 + 64 < j->out ? o0 + 64 : j->out;
        if (j->rows <= MAX_ROWS_MT) { rows_into(j, o0, o1, buf); put(j, o0, o1, buf); continue; }
        for (long r = 0; r < j->rows; r++) {  /* many rows: one at a time */
            job_t jr = {j->W, j->x + (size_t)r * j->in, j->b, j->res ? j->res + (size_t)r * j->out : NULL,
                        j->y + (size_t)r * j->out, 1, j->out, j->in};
            rows_into(&jr, o0, o1, buf); put(&jr, o0, o1, buf);
        }
    }
}

static int linear_pool(const job_t* jp, long cr, long nc, long ns);

/* Whether sharing pays is measured, not assumed: when another process keeps the other cores busy, a worker
   shows up late and the caller loses time to it. Each way keeps decaying sums of time spent and weight bytes
   streamed, per size class (a product's log2 bytes: big products share better than small ones, so a mix of
   sizes must not decide for one size) and over all sizes (for a class not measured both ways yet); the
   faster way is used. Every EXPLORE_EVERY products the other way runs a burst of EXPLORE_BURST, the first of
   which (which wakes sleeping workers, or lets them fall asleep) is not counted, nor is any product that had
   to wake a worker. */
#define EXPLORE_EVERY 256
#define EXPLORE_BURST 8
#define NCLASS 64
static double g_ns[2], g_bytes[2];  /* [0]: caller alone, [1]: shared */
static double g_cns[NCLASS][2], g_cbytes[NCLASS][2];
static long g_njobs, g_burst_left;
static int g_burst_mode;
static long g_count[2];  /* products run alone / shared */

static inline int faster_shared(const double* ns, const double* bytes) {
    return ns[1] * bytes[0] <= ns[0] * bytes[1];
}

/* out: fs per byte alone, shared (0: not measured yet); products run alone, shared */
void wsc_stats(long* out) {
    for (int m = 0; m < 2; m++) {
        out[m] = g_bytes[m] > 0 ? (long)(g_ns[m] * 1e6 / g_bytes[m]) : 0;
        out[2 + m] = g_count[m];
    }
}

/* y[r, o] = res[r, o] + (dot(W[o, :], x[r, :]) + b[o]); W (out, in), x (rows, in), y/res (rows, out).
   b and res may be NULL; res may alias y. Thread-safe: one caller at a time shares the pool, any others
   run alone. */
void wsc_linear(const float* W, const float* x, const float* b, const float* res, float* y,
                long rows, long out, long in) {
    job_t j = {W, x, b, res, y, rows, out, in};
    long cr = CHUNK_FLOATS / (in > 0 ? in : 1);
    if (cr < 1) cr = 1;
    if ((out + cr - 1) / cr > MAX_CHUNKS) cr = (out + MAX_CHUNKS - 1) / MAX_CHUNKS;
    long nc = (out + cr - 1) / cr;
    long ns = atomic_load(&g_use);
    if (ns > nc / 2) ns = nc / 2;
    static _Atomic int busy;
    int idle = 0;
    if (ns < 2 || rows > MAX_ROWS_MT || cr > MAX_CHUNK_ROWS || !atomic_compare_exchange_strong(&busy, &idle, 1)) {
        linear_1(&j);  /* (also when another thread is using the pool: this path is reentrant) */
        return;
    }
    double bytes = (double)out * in * 4;
    int cls = 63 - __builtin_clzl((unsigned long)bytes | 1);
    int pref = g_bytes[0] > 0 && g_bytes[1] > 0 && faster_shared(g_ns, g_bytes);
    if (g_cbytes[cls][0] > 0 && g_cbytes[cls][1] > 0) pref = faster_shared(g_cns[cls], g_cbytes[cls]);
    if (g_burst_left == 0 && g_bytes[0] > 0 && (g_bytes[1] == 0 || ++g_njobs % EXPLORE_EVERY == 0)) {
        g_burst_left = EXPLORE_BURST;
        g_burst_mode = !pref;
    }
    int shared = pref, count = 1;
    if (g_burst_left > 0) {
        shared = g_burst_mode;
        count = g_burst_left < EXPLORE_BURST;
        g_burst_left--;
    }
    long t0 = now_ns();
    g_count[shared]++;
    if (shared) count &= linear_pool(&j, cr, nc, ns); else linear_1(&j);
    if (count) {  /* decay: overall, the last ~64 MB-weighted products of each way count; per class, ~4 */
        double dt = (double)(now_ns() - t0), keep = 1.0 - bytes / (bytes + 64e6);
        g_ns[shared] = g_ns[shared] * keep + dt;
        g_bytes[shared] = g_bytes[shared] * keep + bytes;
        g_cns[cls][shared] = g_cns[cls][shared] * 0.75 + dt;
        g_cbytes[cls][shared] = g_cbytes[cls][shared] * 0.75 + bytes;
    }
    atomic_store(&busy, 0);
}

/* returns 0 when a worker had to be woken (a transient, e.g. the first product of a token: not a fair sample
   of what sharing costs), else 1 */
static int linear_pool(const job_t* jp, long cr, long nc, long ns) {
    job_t j = *jp;
    long out = j.out;
    uint64_t gen = atomic_load(&g_gen) + 1;
    for (long c = 0; c < nc; c++) atomic_store_explicit(&g_state[c], gen << 2 | TODO, memory_order_relaxed);
    atomic_store(&g_live, gen);
    for (long k = 0; k < ns; k++)
        atomic_store(&g_seg[k].fb, (uint64_t)(nc * k / ns) << 32 | (uint64_t)(nc * (k + 1) / ns));
    g_job = j;
    atomic_store(&g_chunk_rows, cr);
    atomic_store(&g_nchunks, nc);
    atomic_store(&g_nseg, ns);
    atomic_store(&g_gen, gen);
    int warm = atomic_load(&g_sleeping) == 0;
    if (!warm) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    work(gen, &j, 0);
    /* nothing left to take; wait briefly for chunks in progress, then redo what is still missing */
    long t0 = now_ns();
    float buf[MAX_ROWS_MT * MAX_CHUNK_ROWS];
    for (long c = 0; c < nc; c++) {
        while ((atomic_load(&g_state[c]) & 3) != DONE) {
            if (now_ns() - t0 < g_wait_ns) { cpu_relax(); continue; }
            finish_chunk(gen, &j, c, cr, buf);
            while ((atomic_load(&g_state[c]) & 3) != DONE) cpu_relax();  /* a worker is copying out */
        }
    }
    atomic_store(&g_live, 0);
    while (atomic_load(&g_inflight) != 0) cpu_relax();  /* a late worker still reading x / W */
    return warm;
}

/* ---- one decode token's attention, for one sequence whose KV sits in consecutive cache slots ---------- */

typedef int v16i __attribute__((vector_size(64)));

static inline v16 vsplat(float a) { v16 v = {a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; return v; }

/* e^x for x <= 0 (softmax arguments): 2^k * p(r), r = x - k ln 2, |r| <= ln 2, degree-7 Taylor polynomial
   (relative error < 3e-7, as good as float32 libm for this use); underflows to 0 below -87. */
static inline v16 vexp(v16 x) {
    v16i under = x < -87.0f;
    x = (v16)(((v16i)x & ~under) | ((v16i)vsplat(-87.0f) & under));
    v16 fk = x * 1.44269504088896341f - 0.5f;
    v16i k = __builtin_convertvector(fk, v16i);  /* truncation: round(x log2 e) for x <= 0 */
    v16 kf = __builtin_convertvector(k, v16);
    v16 r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    v16 pe = vsplat(1.0f / 5040) ;
    pe = pe * r + 1.0f / 720;
    pe = pe * r + 1.0f / 120;
    pe = pe * r + 1.0f / 24;
    pe = pe * r + 1.0f / 6;
    pe = pe * r + 0.5f;
    pe = pe * r + 1.0f;
    pe = pe * r + 1.0f;
    v16i bits = (k + 127) << 23;
    v16 y = pe * (v16)bits;
    return (v16)((v16i)y & ~under);
}

static _Thread_local float* t_scores;
static _Thread_local long t_cap;

/* qkv: the new token's (nh + 2 nkv) * hd projections (q heads | k heads | v heads), rotated here in place
   when cos is not NULL (x * cos + swap_halves(x) * sin_signed, sin_signed = sin with its first half negated);
   its k and v are written to cache slot slot0 + S - 1; then y (nh * hd) = softmax(q K^T * scale) V over the
   S positions in slots [slot0, slot0 + S). cache: (2 nkv, slots, hd), k heads then v heads. hd % 16 == 0.
   Returns 0, or -1 when out of memory (nothing written to y). */
int wsc_decode_attention(float* qkv, const float* cos, const float* sin_signed, float* cache, long slots,
                         long slot0, long S, long nh, long nkv, long hd, float scale, float* y) {
    long half = hd / 2, g = nh / nkv;
    if (cos) {
        for (long h = 0; h < nh + nkv; h++) {
            float* x = qkv + h * hd;
            for (long i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                x[i] = a * cos[i] + b * sin_signed[i];
                x[i + half] = b * cos[i + half] + a * sin_signed[i + half];
            }
        }
    }
    long slot = slot0 + S - 1;
    for (long h = 0; h < 2 * nkv; h++)
        __builtin_memcpy(cache + ((size_t)h * slots + slot) * hd, qkv + (nh + h) * hd, hd * sizeof(float));
    if (t_cap < g * S) {
        float* nb = realloc(t_scores, (size_t)g * S * sizeof(float) + 64);
        if (!nb) return -1;
        t_scores = nb; t_cap = g * S;
    }
    for (long kh = 0; kh < nkv; kh++) {
        const float* K = cache + ((size_t)kh * slots + slot0) * hd;
        const float* V = cache + ((size_t)(nkv + kh) * slots + slot0) * hd;
        const float* q = qkv + kh * g * hd;
        float* sc = t_scores;
        for (long t = 0; t < S; t++)
            for (long j = 0; j < g; j++) sc[j * S + t] = dot(q + j * hd, K + t * hd, hd) * scale;
        for (long j = 0; j < g; j++) {
            float* sj = sc + j * S;
            float m = sj[0];
            for (long t = 1; t < S; t++) m = sj[t] > m ? sj[t] : m;
            v16 acc = {0};
            long t = 0;
            for (; t + 16 <= S; t += 16) {
                v16 e = vexp(ld16(sj + t) - m);
                __builtin_memcpy(sj + t, &e, sizeof e);
                acc += e;
            }
            float sum = hsum16(acc);
            for (; t < S; t++) {
                v16 e = vexp(vsplat(sj[t] - m));
                sj[t] = e[0];
                sum += e[0];
            }
            float inv = 1.0f / sum;
            float* out = y + (kh * g + j) * hd;
            long i = 0;
            for (; i + 64 <= hd; i += 64) {  /* four independent accumulators over the positions */
                v16 o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
                for (long u = 0; u < S; u++) {
                    const float* v = V + u * hd + i;
                    v16 pu = vsplat(sj[u]);
                    o0 += pu * ld16(v); o1 += pu * ld16(v + 16); o2 += pu * ld16(v + 32); o3 += pu * ld16(v + 48);
                }
                o0 *= inv; o1 *= inv; o2 *= inv; o3 *= inv;
                __builtin_memcpy(out + i, &o0, 64); __builtin_memcpy(out + i + 16, &o1, 64);
                __builtin_memcpy(out + i + 32, &o2, 64); __builtin_memcpy(out + i + 48, &o3, 64);
            }
            for (; i < hd; i += 16) {
                v16 o = {0};
                for (long u = 0; u < S; u++) o += sj[u] * ld16(V + u * hd + i);
                o *= inv;
                __builtin_memcpy(out + i, &o, sizeof o);
            }
        }
    }
    return 0;
}

/* out[r, i] = silu(gu[r, i]) * gu[r, n + i]: SwiGLU over a fused gate|up row of 2n. */
void wsc_silu_mul(const float* gu, float* out, long rows, long n) {
    for (long r = 0; r < rows; r++) {
        const float* g = gu + (size_t)r * 2 * n;
        const float* u = g + n;
        float* o = out + (size_t)r * n;
        long i = 0;
        for (; i + 16 <= n; i += 16) {
            v16 x = ld16(g + i);
            v16i neg = x < 0.0f;
            v16 ax = (v16)((v16i)x & ~(v16i)vsplat(-0.0f));          /* |x| */
            v16 e = vexp(-ax);                                       /* exp(-|x|) in (0, 1] */
            v16 num = (v16)(((v16i)vsplat(1.0f) & ~neg) | ((v16i)e & neg));  /* x >= 0: 1, else e */
            v16 y = x * (num / (1.0f + e)) * ld16(u + i);
            __builtin_memcpy(o + i, &y, sizeof y);
        }
        for (; i < n; i++) {
            float x = g[i];
            float e = vexp(vsplat(-fabsf(x)))[0];
            o[i] = x * ((x < 0.0f ? e : 1.0f) / (1.0f + e)) * u[i];
        }
    }
}

/* index of the first maximum of x[0..n) (of the first NaN, if any: NaN counts as the largest, as in torch) */
long wsc_argmax(const float* x, long n) {
    if (n <= 0) return 0;
    float best = x[0];
    long where = 0, i = 0;
    int nan = 0;
    if (n >= 32 && n < (1L << 31)) {  /* per lane: its first maximum and where */
        v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, at = lane;
        v16 m = ld16(x);
        v16i nanv = m != m;
        for (i = 16; i + 16 <= n; i += 16) {
            v16 v = ld16(x + i);
            nanv |= v != v;
            v16i gt = v > m;
            m = (v16)(((v16i)v & gt) | ((v16i)m & ~gt));
            at = ((lane + (int)i) & gt) | (at & ~gt);
        }
        best = m[0]; where = at[0];
        for (int k = 0; k < 16; k++) {
            nan |= nanv[k];
            if (m[k] > best || (m[k] == best && at[k] < where)) { best = m[k]; where = at[k]; }
        }
    }
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        if (x[i] > best) { best = x[i]; where = i; }
    }
    if (nan)
        for (long t = 0; t < n; t++) if (x[t] != x[t]) return t;
    return where;
}

/* y[r] = w * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))), per row of n. */
void wsc_rms_norm(const float* x, const float* w, float eps, float* y, long rows, long n) {
    for (long r = 0; r < rows; r++) {
        const float* xr = x + (size_t)r * n;
        float* yr = y + (size_t)r * n;
        float ss = dot(xr, xr, n);
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (long i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* ---- every layer of a Llama-style block stack for one decode token of one sequence --------------------
   The same kernels as above, in the order the runner's per-op path calls them, without a Python round trip
   between them. */

typedef struct {
    const float *attn_norm, *wqkv, *bqkv, *wo, *bo, *mlp_norm, *wgu, *bgu, *wd, *bd;
    float attn_eps, mlp_eps;
    float* cache;  /* (2 nkv, slots, hd) */
} layer_t;

/* x (C,) in place through layers[0 .. n); scratch: at least C + (nh + 2 nkv) hd + nh hd + 3 ffn floats.
   Returns 0, or -1 when out of memory. */
int wsc_decode_layers(float* x, const layer_t* layers, long n, long C, long nh, long nkv, long hd, long ffn,
                      const float* cos, const float* sin_signed, long slots, long slot0, long S, float* scratch) {
    float* h = scratch;
    float* qkv = h + C;
    float* y = qkv + (nh + 2 * nkv) * hd;
    float* gu = y + nh * hd;
    float* a = gu + 2 * ffn;
    float scale = 1.0f / sqrtf((float)hd);
    for (long l = 0; l < n; l++) {
        const layer_t* L = layers + l;
        wsc_rms_norm(x, L->attn_norm, L->attn_eps, h, 1, C);
        wsc_linear(L->wqkv, h, L->bqkv, NULL, qkv, 1, (nh + 2 * nkv) * hd, C);
        if (wsc_decode_attention(qkv, cos, sin_signed, L->cache, slots, slot0, S, nh, nkv, hd, scale, y) != 0)
            return -1;
        wsc_linear(L->wo, y, L->bo, x, x, 1, C, nh * hd);
        wsc_rms_norm(x, L->mlp_norm, L->mlp_eps, h, 1, C);
        wsc_linear(L->wgu, h, L->bgu, NULL, gu, 1, 2 * ffn, C);
        wsc_silu_mul(gu, a, 1, ffn);
        wsc_linear(L->wd, a, L->bd, x, x, 1, C, ffn);
    }
    return 0;
}
"""

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-fast-math", "-pthread"]
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([_SOURCE, cc, version, " ".join(_FLAGS), _cpu_id()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("WSC_CACHE_DIR") or Path.home() / ".cache" / "waferscale") / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    so = root / f"serve_kernels-{key}.so"
    if not so.exists():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src = Path(tmp) / "serve_kernels.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / so.name
            r = subprocess.run([cc, *_FLAGS, str(src), "-o", str(out), "-lm"], capture_output=True, text=True,
                               timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
            os.replace(out, so)
    lib = ctypes.CDLL(str(so))
    P, L = ctypes.c_void_p, ctypes.c_long
    lib.wsc_linear.argtypes = [P, P, P, P, P, L, L, L]
    lib.wsc_linear.restype = None
    lib.wsc_rms_norm.argtypes = [P, P, ctypes.c_float, P, L, L]
    lib.wsc_rms_norm.restype = None
    lib.wsc_decode_attention.argtypes = [P, P, P, P, L, L, L, L, L, L, ctypes.c_float, P]
    lib.wsc_decode_attention.restype = ctypes.c_int
    lib.wsc_silu_mul.argtypes = [P, P, L, L]
    lib.wsc_silu_mul.restype = None
    lib.wsc_argmax.argtypes = [P, L]
    lib.wsc_argmax.restype = L
    lib.wsc_decode_layers.argtypes = [P, P, L, L, L, L, L, L, P, P, L, L, L, P]
    lib.wsc_decode_layers.restype = ctypes.c_int
    lib.wsc_stats.argtypes = [P]
    lib.wsc_stats.restype = None
    lib.wsc_set_threads.argtypes = [ctypes.c_int]
    lib.wsc_set_threads.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call)."""
    global _lib, _tried, _error
    if not _tried:
        _tried = True
        if os.environ.get("WSC_NO_C_KERNELS", "") not in ("", "0"):
            _error = "disabled by WSC_NO_C_KERNELS"
        else:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _error = str(e)
    return _lib is not None


def unavailable_reason() -> str | None:
    available()
    return _error


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def hugepage_tensor(numel: int) -> Tensor:
    """An uninitialised float32 (numel,) CPU tensor whose memory starts on a 2 MiB boundary and is marked for
    transparent huge pages before it is first touched (Linux; elsewhere, or if madvise fails, plain pages).

    Why: streaming the weights through 4 KiB pages costs a TLB miss every 4 KiB, and under virtualisation
    (nested page tables) that halves one core's read bandwidth: measured on this project's 2-core VM, the
    decode GEMV reads 14 -> 26 GB/s on one thread and 25 -> 33 GB/s on two with huge pages.
    """
    pad = HUGE_PAGE // 4
    raw = torch.empty(numel + pad)
    off = (-raw.data_ptr() % HUGE_PAGE) // 4
    t = raw[off:off + numel]
    if sys.platform.startswith("linux") and numel * 4 >= HUGE_PAGE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(t.data_ptr(), (numel * 4 + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
    return t


def set_threads(threads: int) -> int:
    """Let `threads` threads (the caller's included) share each `linear` call of this process from now on;
    starts workers as needed (idle ones sleep). Returns the number sharing."""
    if not available():
        return 1
    return int(_lib.wsc_set_threads(max(1, int(threads))))


def stats() -> dict:
    """How the shared products have gone: GB/s measured alone and shared (running averages; 0 = not measured)
    and how many products ran each way."""
    if not available():
        return {}
    buf = (ctypes.c_long * 4)()
    _lib.wsc_stats(buf)
    return {"alone_GBps": 1e6 / buf[0] if buf[0] else 0.0, "shared_GBps": 1e6 / buf[1] if buf[1] else 0.0,
            "products_alone": buf[2], "products_shared": buf[3]}


def usable(*ts: Tensor) -> bool:
    """Whether these tensors can go to the kernels: float32, contiguous, on the CPU."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in ts)


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """(R, in) x, (out, in) w [, (out,) bias, (R, out) residual] -> (R, out) residual + x w^T + bias.
    All float32 contiguous CPU tensors (see `usable`); R small (at most MAX_ROWS is where it pays)."""
    R, n = x.shape
    out = w.shape[0]
    y = torch.empty(R, out)
    _lib.wsc_linear(w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                    None if residual is None else residual.data_ptr(), y.data_ptr(), R, out, n)
    return y


def decode_attention(qkv: Tensor, cos: Tensor | None, sin_signed: Tensor | None, cache: Tensor, slot0: int,
                     S: int, n_head: int, n_kv: int) -> Tensor:
    """One new token of one sequence whose KV is in consecutive slots [slot0, slot0 + S) of `cache`
    ((2 n_kv, slots, hd), contiguous): rotates q and k of `qkv` ((1, (n_head + 2 n_kv) hd), contiguous; in
    place) by `cos` / `sin_signed` ((hd,) each, or None), writes k and v to slot slot0 + S - 1 and returns
    the (1, n_head * hd) attention output (scale 1/sqrt(hd), no mask: every position is visible)."""
    hd = cache.shape[-1]
    y = torch.empty(1, n_head * hd)
    rc = _lib.wsc_decode_attention(qkv.data_ptr(), None if cos is None else cos.data_ptr(),
                                   None if sin_signed is None else sin_signed.data_ptr(), cache.data_ptr(),
                                   cache.shape[1], slot0, S, n_head, n_kv, hd, hd ** -0.5, y.data_ptr())
    if rc != 0:
        raise MemoryError(f"decode attention over {S} positions: out of memory for the scores")
    return y


def silu_mul(gu: Tensor, n: int) -> Tensor:
    """(R, 2n) fused gate|up -> (R, n) silu(gate) * up; float32 contiguous CPU."""
    R = gu.shape[0]
    y = torch.empty(R, n)
    _lib.wsc_silu_mul(gu.data_ptr(), y.data_ptr(), R, n)
    return y


def argmax(x: Tensor) -> int:
    """Index of the first maximum of a 1-D float32 contiguous CPU tensor (the first NaN if any, as torch)."""
    return int(_lib.wsc_argmax(x.data_ptr(), x.shape[0]))


class _LayerT(ctypes.Structure):
    _fields_ = [(f, ctypes.c_void_p) for f in
                ("attn_norm", "wqkv", "bqkv", "wo", "bo", "mlp_norm", "wgu", "bgu", "wd", "bd")] + \
        [("attn_eps", ctypes.c_float), ("mlp_eps", ctypes.c_float), ("cache", ctypes.c_void_p)]


class DecodeStack:
    """Layers of Llama-style blocks (RMSNorm, fused q|k|v, GQA attention, fused gate|up SwiGLU) for one decode
    token of one sequence at a time, in one C call. Holds references to every tensor it points at."""

    def __init__(self, layers: list[dict], n_head: int, n_kv: int, head_dim: int, ffn: int) -> None:
        """layers: per layer attn_norm, attn_eps, wqkv, bqkv, wo, bo, mlp_norm, mlp_eps, wgu, bgu, wd, bd (None
        for absent biases) and cache ((2 n_kv, slots, hd)); float32 contiguous CPU tensors."""
        self._keep = layers
        self.n, self.nh, self.nkv, self.hd, self.ffn = len(layers), n_head, n_kv, head_dim, ffn
        self.C = layers[0]["attn_norm"].shape[0]
        self.slots = layers[0]["cache"].shape[1]
        arr = (_LayerT * len(layers))()
        for t, d in zip(arr, layers):
            for f in ("attn_norm", "wqkv", "bqkv", "wo", "bo", "mlp_norm", "wgu", "bgu", "wd", "bd", "cache"):
                setattr(t, f, None if d[f] is None else d[f].data_ptr())
            t.attn_eps, t.mlp_eps = d["attn_eps"], d["mlp_eps"]
        self._arr = arr
        self._scratch = torch.empty(self.C + (n_head + 2 * n_kv) * head_dim + n_head * head_dim + 3 * ffn)

    def __call__(self, x: Tensor, cos: Tensor | None, sin_signed: Tensor | None, slot0: int, S: int) -> Tensor:
        """x (1, C) -> (1, C) after every layer; the token's k/v go to slot slot0 + S - 1, attention reads slots
        [slot0, slot0 + S). x is updated in place (pass a copy if it must survive)."""
        rc = _lib.wsc_decode_layers(x.data_ptr(), self._arr, self.n, self.C, self.nh, self.nkv, self.hd, self.ffn,
                                    None if cos is None else cos.data_ptr(),
                                    None if sin_signed is None else sin_signed.data_ptr(), self.slots, slot0, S,
                                    self._scratch.data_ptr())
        if rc != 0:
            raise MemoryError(f"decode attention over {S} positions: out of memory for the scores")
        return x


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """(R, n) x, (n,) w -> (R, n) RMSNorm(x) * w, float32 contiguous CPU tensors."""
    R, n = x.shape
    y = torch.empty(R, n)
    _lib.wsc_rms_norm(x.data_ptr(), w.data_ptr(), eps, y.data_ptr(), R, n)
    return y
