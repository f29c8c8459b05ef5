"""Small C kernels for CPU serving (decode and prefill), built once per machine with the system C compiler.

Why: a decode step reads every weight once, so a step of a few sequences costs (bytes read / memory
bandwidth) and one of many costs (multiply-adds / compute peak), plus overheads; both limits are within
reach only if the weights stream while the FMA units stay busy. Measured on the 2-core AMD EPYC (Zen 4) VM
this project runs on (same runs, float32):

- Weights are packed in panels of 16 outputs (`pack`): panel p is W[16p .. 16p + 15] transposed, (in, 16),
  one sequential stream of memory. The microkernel holds 16 x rows' partial sums for the panel's 16 outputs
  in 16 AVX-512 registers: per k, one panel load and one broadcast x element and one FMA per row, no
  horizontal sums, with a software prefetch 2 KiB ahead. One decode step of SmolLM2-135M's 121 products
  (538 MB) over 2 threads: 16 rows 24 ms (180 GFLOP/s; the former row-major 4x4 kernel: 42 ms; MKL: ~75
  GFLOP/s at 16 rows), 1 row 17 ms (32 GB/s, the memory bound). For prefill-sized batches it matches or beats
  MKL at 2 threads (190-210 vs 150-190 GFLOP/s on the SmolLM2 shapes), so on CPU float32 every projection
  runs here.
- Each output is one FMA chain over k in order, then + bias, then residual +: the same arithmetic whatever
  the number of rows, the row's place in the batch or the thread that computes it, so results do not depend
  on the batch or on the thread count.
- On 4 KiB pages every 4 KiB of weights is a TLB miss, and under virtualisation a costly one: the weights
  live in one 2 MiB-aligned arena on transparent huge pages (`hugepage_tensor`), 14 -> 26 GB/s on one thread.
- A second thread: `set_threads` starts a work-stealing pool that measures whether sharing pays (per size
  of work) and falls back to one thread when it does not (e.g. when another process holds the other core).
- `torch.compile` would generate similar loops, but each compiled call costs ~30 us of guards (x 121
  projections per token) and a first compile of ~50 s; this file compiles in ~6 s, once per machine (cached).

Kernels (float32, contiguous; results identical whichever thread computes them):

- `linear(x, wp, out, bias=None, residual=None)`: y = residual + x W^T + bias over a packed W, any rows.
- `decode_attention` (one sequence, consecutive cache slots) and `decode_attention_batch` (several
  sequences, block-paged cache): rope, KV write and GQA attention of each sequence's new token, with the same
  arithmetic, so a sequence decodes to the same bits alone or in a batch.
- `rms_norm`, `silu_mul` (SwiGLU), `argmax` (greedy sampling), and `DecodeStack`: every layer of a
  Llama-style block stack for one token in one call. They agree with the torch ops to float32 rounding
  (~1e-6 relative), not bit for bit.

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

__all__ = ["DecodeStack", "PANEL", "argmax", "argmax_rows", "available", "decode_attention", "decode_attention_batch",
           "hugepage_tensor", "linear", "pack", "packed_numel", "rms_norm", "set_threads", "silu_mul"]

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
typedef int v16i __attribute__((vector_size(64)));

static inline v16 vsplat(float a) { v16 v = {a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; return v; }

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

/* ---- y = residual + x W^T + bias over W packed in panels ---------------------------------------------
   W (out, in) is stored as ceil(out / 16) panels of (in, 16): panel p holds W[16 p + c][k] at [k][c] (rows
   past `out` are zero). A panel is one sequential stream of memory, whatever the number of x rows, and the
   microkernel keeps up to 16 x rows' sums for its 16 outputs in 16 vector registers: per k one panel load,
   and one broadcast x element and one FMA per row; no horizontal sums. Each output is one FMA chain over k
   in order (then + bias, then residual +), the same chain whatever the number of rows, the row's tile or the
   thread: results do not depend on the batch or the thread count. x rows go in tiles of 16, each tile
   transposed to (in, rows in the tile) so that a step of k reads one short contiguous run. */

#define PANEL 16
#define TILE 16
#ifndef PF_DIST
#define PF_DIST 512   /* floats ahead of the panel read to prefetch */
#endif

/* decode attention of B sequences over a paged cache (see wsc_decode_attention_batch) */
typedef struct {
    const float* qkv; long ldq; const long *rows, *pos; const float* cache; long slots;
    const long* tables; long ldt, bs, nh, nkv, hd; float scale; float* y; long ldy;
} attn_t;

/* one job for the pool: a product (at == NULL) or decode attention, one sequence per chunk */
typedef struct {
    const float *W, *xt, *b, *res; float* y;
    long rows, out, in;
    const attn_t* at;
} job_t;

static int attend_chunk(const attn_t* a, long b, float* y);

/* MR (<= TILE) rows of one tile against one panel: dst[r * ldd + c] = res[r * ldr + c] + (sum_k xt[k * MR + r]
   * wp[k * 16 + c] + b[c]), c < nc. Called with constant MR so that each case compiles to its own loop. */
static inline __attribute__((always_inline)) void pmk(const float* wp, const float* xt, long K, int MR,
                                                      float* dst, long ldd, int nc, const float* b,
                                                      const float* res, long ldr) {
    v16 a[TILE];
#pragma GCC unroll 16
    for (int r = 0; r < TILE; r++) a[r] = (v16){0};
    for (long k = 0; k < K; k++) {
        v16 w = ld16(wp + k * PANEL);
#if PF_DIST > 0
        __builtin_prefetch(wp + k * PANEL + PF_DIST, 0, 3);
#endif
#if defined(__GNUC__) && defined(__AVX512F__)
        __asm__("" : "+v"(w));  /* one load, kept in a register (not folded into every FMA) */
#endif
        const float* xk = xt + k * MR;
#pragma GCC unroll 16
        for (int r = 0; r < TILE; r++) if (r < MR) a[r] += vsplat(xk[r]) * w;
    }
    if (nc == PANEL) {
#pragma GCC unroll 16
        for (int r = 0; r < TILE; r++) if (r < MR) {
            v16 v = a[r];
            if (b) v = v + ld16(b);
            if (res) v = ld16(res + r * ldr) + v;
            __builtin_memcpy(dst + r * ldd, &v, sizeof v);
        }
    } else {
        for (int r = 0; r < MR; r++) {
            float s[PANEL];
            __builtin_memcpy(s, &a[r], sizeof s);
            for (int c = 0; c < nc; c++) {
                float z = s[c];
                if (b) z = z + b[c];
                if (res) z = res[r * ldr + c] + z;
                dst[r * ldd + c] = z;
            }
        }
    }
}

/* panels [p0, p1) for every row into dst (row r, output o at dst[r * ldd + o - 16 p0]) */
static void panels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    long R = j->rows, in = j->in, out = j->out;
    for (long p = p0; p < p1; p++) {
        const float* wp = j->W + (size_t)p * in * PANEL;
        long o = p * PANEL;
        int nc = out - o < PANEL ? (int)(out - o) : PANEL;
        const float* b = j->b ? j->b + o : NULL;
        for (long t0 = 0; t0 < R; t0 += TILE) {
            int MR = R - t0 < TILE ? (int)(R - t0) : TILE;
            const float* xt = j->xt + (size_t)t0 * in;
            float* d = dst + t0 * ldd + (o - p0 * PANEL);
            const float* res = j->res ? j->res + (size_t)t0 * out + o : NULL;
            switch (MR) {  /* (sixteen compiled cases, most of the build time: splitting odd tiles into 8/4/2/1
                              instead costs ~30% at 13 rows) */
#define PMK(n) case n: pmk(wp, xt, in, n, d, ldd, nc, b, res, out); break;
            PMK(1) PMK(2) PMK(3) PMK(4) PMK(5) PMK(6) PMK(7) PMK(8)
            PMK(9) PMK(10) PMK(11) PMK(12) PMK(13) PMK(14) PMK(15) PMK(16)
#undef PMK
            }
        }
    }
}

static inline long out_end(const job_t* j, long p1) { return p1 * PANEL < j->out ? p1 * PANEL : j->out; }

static void put(const job_t* j, long p0, long p1, const float* buf) {
    long o0 = p0 * PANEL, m = out_end(j, p1) - o0;
    for (long r = 0; r < j->rows; r++)
        __builtin_memcpy(j->y + (size_t)r * j->out + o0, buf + r * m, m * sizeof(float));
}

#ifdef HAVE_TREE
/* v[r][c] -> v[c][r] for a 16 x 16 block: 4 levels, each swapping one bit of the row with that of the column */
static inline void transpose16(v16* v) {
    for (int r = 0; r < 16; r++) if (!(r & 1)) {
        v16 p = v[r], q = v[r + 1];
        v[r] = SHUF(p, q, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        v[r + 1] = SHUF(p, q, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
    for (int r = 0; r < 16; r++) if (!(r & 2)) {
        v16 p = v[r], q = v[r + 2];
        v[r] = SHUF(p, q, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        v[r + 2] = SHUF(p, q, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    for (int r = 0; r < 16; r++) if (!(r & 4)) {
        v16 p = v[r], q = v[r + 4];
        v[r] = SHUF(p, q, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        v[r + 4] = SHUF(p, q, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int r = 0; r < 8; r++) {
        v16 p = v[r], q = v[r + 8];
        v[r] = SHUF(p, q, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        v[r + 8] = SHUF(p, q, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
}
#endif

/* x (rows, in) -> tiles of TILE rows, each (in, rows in the tile): xt[t0 * in + k * MR + r] = x[t0 + r][k] */
static void pack_x(const float* x, long rows, long in, float* xt) {
    for (long t0 = 0; t0 < rows; t0 += TILE) {
        long MR = rows - t0 < TILE ? rows - t0 : TILE;
        float* d = xt + t0 * in;
#ifdef HAVE_TREE
        if (MR == 16) {  /* 16 x 16 blocks through registers */
            long k0 = 0;
            for (; k0 + 16 <= in; k0 += 16) {
                v16 v[16];
                for (int r = 0; r < 16; r++) v[r] = ld16(x + (t0 + r) * in + k0);
                transpose16(v);
                for (int c = 0; c < 16; c++) __builtin_memcpy(d + (k0 + c) * 16, &v[c], sizeof(v16));
            }
            for (long r = 0; r < 16; r++)
                for (long k = k0; k < in; k++) d[k * 16 + r] = x[(t0 + r) * in + k];
            continue;
        }
#endif
        for (long r = 0; r < MR; r++) {
            const float* s = x + (t0 + r) * in;
            for (long k = 0; k < in; k++) d[k * MR + r] = s[k];
        }
    }
}

/* ---- a tiny work-stealing pool for one product at a time -------------------------------------------
   The panels are cut into chunks (~32 KiB of weights each) and the chunks into one contiguous segment per
   thread, so that every thread streams its own stretch of the matrix front to back. A thread that runs out
   takes chunks from the back of another's segment (a worker that is asleep, or descheduled by another
   process, simply gets robbed). The caller never waits long: once no chunk is left to take it waits a few
   microseconds for chunks still in progress, then computes them itself. A chunk's result is published by
   whoever first moves its state from (gen, OPEN) to (gen, WRITING), so a late worker only throws its result
   away. Every output is computed by the same code in the same order, whichever thread does it. */

#define CHUNK_FLOATS 8192          /* weights per chunk: 32 KiB, ~2 us at memory speed */
#define MAX_CHUNKS 8192
#define MAX_CHUNK_OUT 256
#define MAX_THREADS 64
#define OPEN 0
#define WRITING 1
#define DONE 2

typedef struct { _Atomic uint64_t fb; char pad[56]; } seg_t;  /* front << 32 | back, chunks [front, back) */

static job_t g_job;
static _Atomic long g_chunk_panels, g_nchunks, g_nseg;

static _Atomic uint64_t g_gen;     /* job generation; 0: none yet */
/* A chunk reads the caller's x and W, which may be freed once the caller returns: a worker enters a chunk
   only while its job is live (g_live) and counts itself in g_inflight, and the caller, once every chunk is
   done, ends the job and waits until no worker is inside one. */
static _Atomic uint64_t g_live;
static _Atomic long g_inflight;
static seg_t g_seg[MAX_THREADS];
static _Atomic uint64_t g_state[MAX_CHUNKS];  /* (gen << 2) | OPEN/WRITING/DONE */
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

/* this thread's buffer for one chunk's outputs (n floats); NULL when out of memory */
static _Thread_local float* t_buf;
static _Thread_local long t_buf_cap;
static float* chunk_buf(long n) {
    if (t_buf_cap < n) {
        float* nb = realloc(t_buf, (size_t)n * sizeof(float) + 64);
        if (!nb) return NULL;
        t_buf = nb; t_buf_cap = n;
    }
    return t_buf;
}

static inline int enter(uint64_t gen) {
    atomic_fetch_add(&g_inflight, 1);
    if (atomic_load(&g_live) == gen) return 1;
    atomic_fetch_sub(&g_inflight, 1);
    return 0;
}

static inline long job_buf(const job_t* j, long cp) { return j->at ? j->at->nh * j->at->hd : j->rows * cp * PANEL; }

static void finish_chunk(uint64_t gen, const job_t* j, long c, long cp, float* buf) {
    if (j->at) {  /* sequence c's attention */
        const attn_t* a = j->at;
        if (attend_chunk(a, c, buf) != 0) return;  /* out of memory: the caller (who reserved its own) redoes it */
        uint64_t want = gen << 2 | OPEN;
        if (atomic_compare_exchange_strong(&g_state[c], &want, gen << 2 | WRITING)) {
            __builtin_memcpy(a->y + a->rows[c] * a->ldy, buf, a->nh * a->hd * sizeof(float));
            atomic_store(&g_state[c], gen << 2 | DONE);
        }
        return;
    }
    long np = (j->out + PANEL - 1) / PANEL;
    long p0 = c * cp, p1 = p0 + cp < np ? p0 + cp : np;
    panels_into(j, p0, p1, buf, out_end(j, p1) - p0 * PANEL);
    uint64_t want = gen << 2 | OPEN;
    if (atomic_compare_exchange_strong(&g_state[c], &want, gen << 2 | WRITING)) {
        put(j, p0, p1, buf);
        atomic_store(&g_state[c], gen << 2 | DONE);
    }
}

/* thread `me` of job `gen`: its own segment front to back, then the others' from their backs */
static void work(uint64_t gen, const job_t* j, long me) {
    long cp = atomic_load(&g_chunk_panels), ns = atomic_load(&g_nseg);
    if (atomic_load(&g_gen) != gen || me >= ns) return;
    float* buf = chunk_buf(job_buf(j, cp));
    if (!buf) return;  /* the others (the caller at the latest) do this thread's chunks */
    for (long c; (c = take(me, 1)) >= 0;) {
        if (!enter(gen)) return;  /* stale: the segments belong to a newer job */
        finish_chunk(gen, j, c, cp, buf);
        atomic_fetch_sub(&g_inflight, 1);
    }
    for (long d = 1; d < ns; d++) {
        long k = (me + d) % ns;
        for (long c; (c = take(k, 0)) >= 0;) {
            if (!enter(gen)) return;
            finish_chunk(gen, j, c, cp, buf);
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

static int run_pool(const job_t* jp, long cp, long nc, long ns);
static _Atomic int g_busy;  /* the pool serves one caller at a time; others run alone */

/* Whether sharing pays is measured, not assumed: when another process keeps the other cores busy, a worker
   shows up late and the caller loses time to it. Each way keeps decaying sums of time spent and weight bytes
   streamed, per size class (a product's log2 bytes: big products share better than small ones, so a mix of
   sizes must not decide for one size) and over all sizes (for a class not measured both ways yet); the
   faster way is used. Every EXPLORE_EVERY products the other way runs a burst of EXPLORE_BURST, the first of
   which (which wakes sleeping workers, or lets them fall asleep) is not counted, nor is any product that had
   to wake a worker. */
#define SHARE_ROWS 4  /* products of this many rows or more are always shared */
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

static _Thread_local float* t_xt;
static _Thread_local long t_xt_cap;

/* y[r, o] = res[r, o] + (sum_k x[r, k] W[o, k] + b[o]); W packed (see above), x (rows, in), y/res (rows, out).
   b and res may be NULL; res may alias y. Thread-safe: one caller at a time shares the pool, any others
   run alone. Returns 0, or -1 when out of memory (nothing written). */
int wsc_linear(const float* W, const float* x, const float* b, const float* res, float* y,
               long rows, long out, long in) {
    const float* xt = x;
    if (rows > 1) {  /* (one row is its own transpose) */
        if (t_xt_cap < rows * in) {
            float* nb = realloc(t_xt, (size_t)rows * in * sizeof(float) + 64);
            if (!nb) return -1;
            t_xt = nb; t_xt_cap = rows * in;
        }
        pack_x(x, rows, in, t_xt);
        xt = t_xt;
    }
    job_t j = {W, xt, b, res, y, rows, out, in, NULL};
    long np = (out + PANEL - 1) / PANEL;
    long cp = CHUNK_FLOATS / (PANEL * (in > 0 ? in : 1));
    if (cp < 1) cp = 1;
    if (cp > MAX_CHUNK_OUT / PANEL) cp = MAX_CHUNK_OUT / PANEL;
    if ((np + cp - 1) / cp > MAX_CHUNKS) cp = (np + MAX_CHUNKS - 1) / MAX_CHUNKS;
    long nc = (np + cp - 1) / cp;
    long ns = atomic_load(&g_use);
    if (ns > nc / 2) ns = nc / 2;
    int idle = 0;
    if (ns < 2 || !chunk_buf(rows * cp * PANEL) || !atomic_compare_exchange_strong(&g_busy, &idle, 1)) {
        panels_into(&j, 0, np, y, out);  /* (also when another thread is using the pool: this is reentrant) */
        return 0;
    }
    double bytes = (double)out * in * 4;  /* weight bytes streamed; the class is by work (bytes x rows) */
    int cls = 63 - __builtin_clzl((unsigned long)(bytes * rows) | 1);
    int pref = g_bytes[0] > 0 && g_bytes[1] > 0 && faster_shared(g_ns, g_bytes);
    if (g_cbytes[cls][0] > 0 && g_cbytes[cls][1] > 0) pref = faster_shared(g_cns[cls], g_cbytes[cls]);
    if (rows < SHARE_ROWS && g_burst_left == 0 && g_bytes[0] > 0 && (g_bytes[1] == 0 || ++g_njobs % EXPLORE_EVERY == 0)) {
        g_burst_left = EXPLORE_BURST;
        g_burst_mode = !pref;
    }
    int shared = pref, count = 1;
    if (rows >= SHARE_ROWS) {  /* compute-bound: two cores beat one (a descheduled worker just gets robbed) */
        shared = 1;
        count = 0;
    } else if (g_burst_left > 0) {
        shared = g_burst_mode;
        count = g_burst_left < EXPLORE_BURST;
        g_burst_left--;
    }
    long t0 = now_ns();
    g_count[shared]++;
    if (shared) count &= run_pool(&j, cp, nc, ns); else panels_into(&j, 0, np, y, out);
    if (count) {  /* decay: overall, the last ~64 MB-weighted products of each way count; per class, ~4 */
        double dt = (double)(now_ns() - t0), keep = 1.0 - bytes / (bytes + 64e6);
        g_ns[shared] = g_ns[shared] * keep + dt;
        g_bytes[shared] = g_bytes[shared] * keep + bytes;
        g_cns[cls][shared] = g_cns[cls][shared] * 0.75 + dt;
        g_cbytes[cls][shared] = g_cbytes[cls][shared] * 0.75 + bytes;
    }
    atomic_store(&g_busy, 0);
    return 0;
}

/* returns 0 when a worker had to be woken (a transient, e.g. the first product of a token: not a fair sample
   of what sharing costs), else 1 */
static int run_pool(const job_t* jp, long cp, long nc, long ns) {
    job_t j = *jp;
    uint64_t gen = atomic_load(&g_gen) + 1;
    for (long c = 0; c < nc; c++) atomic_store_explicit(&g_state[c], gen << 2 | OPEN, memory_order_relaxed);
    atomic_store(&g_live, gen);
    for (long k = 0; k < ns; k++)
        atomic_store(&g_seg[k].fb, (uint64_t)(nc * k / ns) << 32 | (uint64_t)(nc * (k + 1) / ns));
    g_job = j;
    atomic_store(&g_chunk_panels, cp);
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
    float* buf = chunk_buf(job_buf(&j, cp));  /* (reserved by the caller) */
    for (long c = 0; c < nc; c++) {
        while ((atomic_load(&g_state[c]) & 3) != DONE) {
            if (now_ns() - t0 < g_wait_ns) { cpu_relax(); continue; }
            finish_chunk(gen, &j, c, cp, buf);
            while ((atomic_load(&g_state[c]) & 3) != DONE) cpu_relax();  /* a worker is copying out */
        }
    }
    atomic_store(&g_live, 0);
    while (atomic_load(&g_inflight) != 0) cpu_relax();  /* a late worker still reading x / W */
    return warm;
}
/* ---- one decode token's attention, for one sequence whose KV sits in consecutive cache slots ---------- */


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

/* The cache slots of positions [t0, t0 + n) of a sequence: one run of consecutive slots starting at *base.
   table == NULL: the sequence's KV sits in consecutive slots from slot0 (one run). Else its block table:
   position t lives in slot table[t / bs] * bs + t % bs, one run per block. */
static inline long run_of(const long* table, long bs, long slot0, long t0, long S, long* base) {
    if (!table) { *base = slot0 + t0; return S - t0; }
    *base = table[t0 / bs] * bs + t0 % bs;
    long n = bs - t0 % bs;
    return n < S - t0 ? n : S - t0;
}

/* One new token of one sequence, in two parts: `rope_write` rotates its q and k heads in place (when cos is
   not NULL: x * cos + swap_halves(x) * sin_signed, sin_signed = sin with its first half negated) and writes
   its k and v to cache slot `slot`; `attend` computes y (nh * hd) = softmax(q K^T * scale) V over positions
   [0, S), reading the cache only. qkv: (nh + 2 nkv) * hd projections (q heads | k heads | v heads); cache:
   (2 nkv, slots, hd), k heads then v heads; hd % 16 == 0. The arithmetic is the same whatever the slots and
   whichever thread runs it: batched and single-sequence decode agree bit for bit. */
static void rope_write(float* qkv, const float* cos, const float* sin_signed, float* cache, long slots, long slot,
                       long nh, long nkv, long hd) {
    long half = hd / 2;
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
    for (long h = 0; h < 2 * nkv; h++)
        __builtin_memcpy(cache + ((size_t)h * slots + slot) * hd, qkv + (nh + h) * hd, hd * sizeof(float));
}

/* this thread's scratch for g * S scores; NULL when out of memory */
static float* scores_buf(long n) {
    if (t_cap < n) {
        float* nb = realloc(t_scores, (size_t)n * sizeof(float) + 64);
        if (!nb) return NULL;
        t_scores = nb; t_cap = n;
    }
    return t_scores;
}

/* table == NULL: positions [0, S) in slots [slot0, slot0 + S); else in blocks of bs (see run_of).
   Scores go 16 positions at a time: 16 vector accumulators (q . K_t over hd), then one 16-way tree
   reduction instead of 16 horizontal sums; the K rows of the 16 positions stay in L1 for the g query heads
   that share them. Values: g heads at once, each V row loaded once. Returns 0, or -1 when out of memory
   (nothing written to y). */
static inline __attribute__((always_inline)) void scores16(const float* q, const float* const* kr, int n, long hd,
                                                           float scale, float* out) {
    v16 acc[16];
#pragma GCC unroll 16
    for (int l = 0; l < 16; l++) acc[l] = (v16){0};
    if (hd == 64) {  /* the common head size: each K row's pointer loaded once, q in 4 registers */
        v16 q0 = ld16(q), q1 = ld16(q + 16), q2 = ld16(q + 32), q3 = ld16(q + 48);
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++) if (l < n) {
            const float* k = kr[l];
            acc[l] += q0 * ld16(k);
            acc[l] += q1 * ld16(k + 16);
            acc[l] += q2 * ld16(k + 32);
            acc[l] += q3 * ld16(k + 48);
        }
    } else {
        for (long d = 0; d < hd; d += 16) {
            v16 qv = ld16(q + d);
#pragma GCC unroll 16
            for (int l = 0; l < 16; l++) if (l < n) acc[l] += qv * ld16(kr[l] + d);
        }
    }
#ifdef HAVE_TREE
    v16 t[8], u[4], v[2], r;
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) t[k] = tlvl1(acc[2 * k], acc[2 * k + 1]);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) u[k] = tlvl2(t[2 * k], t[2 * k + 1]);
    v[0] = tlvl3(u[0], u[1]); v[1] = tlvl3(u[2], u[3]);
    r = tlvl4(v[0], v[1]) * scale;
    float rs[16];
    __builtin_memcpy(rs, &r, sizeof r);
#pragma GCC unroll 16
    for (int l = 0; l < 16; l++) if (TREE_PERM[l] < n) out[TREE_PERM[l]] = rs[l];
#else
    for (int l = 0; l < n; l++) out[l] = hsum16(acc[l]) * scale;
#endif
}

/* o[j][v] (j < JN heads, v < 4 vectors of 16 dims from dim i) = sum over positions u, in order, of
   p[j * S + u] * V_u[i + 16 v ..] */
static inline __attribute__((always_inline)) void pv_block(const float* Vh, long hd, long i, int nv, int JN,
                                                           const float* p, long S, const long* table, long bs,
                                                           long slot0, const float* inv, float* out) {
    v16 o[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) o[j][v] = (v16){0};
    for (long t0 = 0, base, n; t0 < S; t0 += n) {
        n = run_of(table, bs, slot0, t0, S, &base);
        for (long u = 0; u < n; u++) {
            const float* vr = Vh + (base + u) * hd + i;
            v16 vv[4];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) vv[v] = v < nv ? ld16(vr + 16 * v) : (v16){0};
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) if (j < JN) {
                v16 pu = vsplat(p[j * S + t0 + u]);
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) if (v < nv) o[j][v] += pu * vv[v];
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) if (j < JN)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) if (v < nv) {
            v16 r = o[j][v] * inv[j];
            __builtin_memcpy(out + j * hd + i + 16 * v, &r, sizeof r);
        }
}

static _Thread_local long* t_slot;
static _Thread_local long t_slot_cap;

/* prefetch the hd floats at p (into L1: locality 3; L2: 2) */
static inline void prefetch_row(const float* p, long hd, int l2) {
    for (long d = 0; d < hd; d += 16) {
        if (l2) __builtin_prefetch(p + d, 0, 2); else __builtin_prefetch(p + d, 0, 3);
    }
}

static int attend(const float* qkv, const float* cache, long slots, long slot0, const long* table, long bs, long S,
                  long nh, long nkv, long hd, float scale, float* y) {
    long g = nh / nkv;
    float* sc = scores_buf(g * S);
    if (!sc) return -1;
    if (t_slot_cap < S) {  /* the slot of every position */
        long* nb = realloc(t_slot, (size_t)S * sizeof(long) + 64);
        if (!nb) return -1;
        t_slot = nb; t_slot_cap = S;
    }
    long* slot = t_slot;
    for (long t0 = 0, base, n; t0 < S; t0 += n) {
        n = run_of(table, bs, slot0, t0, S, &base);
        for (long u = 0; u < n; u++) slot[t0 + u] = base + u;
    }
    for (long kh = 0; kh < nkv; kh++) {
        const float* Kh = cache + (size_t)kh * slots * hd;
        const float* Vh = cache + (size_t)(nkv + kh) * slots * hd;
        const float* q = qkv + kh * g * hd;
        if (kh == 0)  /* this head's K and V into L2 now; each later head's while the one before computes */
            for (long t = 0; t < S; t++) { prefetch_row(Kh + slot[t] * hd, hd, 1); prefetch_row(Vh + slot[t] * hd, hd, 1); }
        const float* Kn = kh + 1 < nkv ? Kh + (size_t)slots * hd : NULL;
        const float* Vn = kh + 1 < nkv ? Vh + (size_t)slots * hd : NULL;
        for (long t = 0; t < 16 && t < S; t++) prefetch_row(Kh + slot[t] * hd, hd, 0);
        for (long t = 0; t < S;) {  /* scores, 16 positions at a time; the next 16 K rows are prefetched meanwhile
                                       (a sequence's blocks are scattered: short streams), and the next head's */
            const float* kr[16];
            int n = 0;
            for (; n < 16 && t + n < S; n++) {
                kr[n] = Kh + slot[t + n] * hd;
                if (t + n + 16 < S) prefetch_row(Kh + slot[t + n + 16] * hd, hd, 0);
                if (Kn) { prefetch_row(Kn + slot[t + n] * hd, hd, 1); prefetch_row(Vn + slot[t + n] * hd, hd, 1); }
            }
            for (long j = 0; j < g; j++) {
                if (n == 16) scores16(q + j * hd, kr, 16, hd, scale, sc + j * S + t);
                else scores16(q + j * hd, kr, n, hd, scale, sc + j * S + t);
            }
            t += n;
        }
        float inv[64];
        for (long j = 0; j < g; j++) {  /* softmax numerators in place, 1 / sums in inv */
            float* sj = sc + j * S;
            float m = sj[0];
            long t = 1;
            if (S >= 32) {  /* the maximum, 16 lanes at a time (exact: same value as the scalar loop) */
                v16 mv = ld16(sj);
                for (t = 16; t + 16 <= S; t += 16) {
                    v16 v = ld16(sj + t);
                    v16i gt = v > mv;
                    mv = (v16)(((v16i)v & gt) | ((v16i)mv & ~gt));
                }
                for (int l = 0; l < 16; l++) m = mv[l] > m ? mv[l] : m;
            }
            for (; t < S; t++) m = sj[t] > m ? sj[t] : m;
            v16 acc = {0};
            t = 0;
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
            inv[j % 64] = 1.0f / sum;
            if (j % 64 == 63 || j == g - 1) {  /* values for heads [j - j % 64, j] */
                long j0 = j - j % 64;
                float* out = y + (kh * g + j0) * hd;
                for (long jj = j0; jj <= j; jj += 4) {
                    int JN = j + 1 - jj < 4 ? (int)(j + 1 - jj) : 4;
                    const float* p = sc + jj * S;
                    float* o = out + (jj - j0) * hd;
                    const float* iv = inv + (jj - j0);
                    for (long i = 0; i < hd; i += 64) {
                        int nv = hd - i < 64 ? (int)((hd - i) / 16) : 4;
                        if (nv == 4) {
                            switch (JN) {
                            case 1: pv_block(Vh, hd, i, 4, 1, p, S, table, bs, slot0, iv, o); break;
                            case 2: pv_block(Vh, hd, i, 4, 2, p, S, table, bs, slot0, iv, o); break;
                            case 3: pv_block(Vh, hd, i, 4, 3, p, S, table, bs, slot0, iv, o); break;
                            default: pv_block(Vh, hd, i, 4, 4, p, S, table, bs, slot0, iv, o); break;
                            }
                        } else {
                            pv_block(Vh, hd, i, nv, JN, p, S, table, bs, slot0, iv, o);
                        }
                    }
                }
            }
        }
    }
    return 0;
}

/* One sequence whose KV sits in consecutive slots [slot0, slot0 + S); its new token goes to the last. Returns
   0, or -1 when out of memory (nothing written to y). */
int wsc_decode_attention(float* qkv, const float* cos, const float* sin_signed, float* cache, long slots,
                         long slot0, long S, long nh, long nkv, long hd, float scale, float* y) {
    rope_write(qkv, cos, sin_signed, cache, slots, slot0 + S - 1, nh, nkv, hd);
    return attend(qkv, cache, slots, slot0, NULL, 0, S, nh, nkv, hd, scale, y);
}

static int attend_chunk(const attn_t* a, long b, float* y) {
    return attend(a->qkv + a->rows[b] * a->ldq, a->cache, a->slots, 0, a->tables + b * a->ldt, a->bs, a->pos[b] + 1,
                  a->nh, a->nkv, a->hd, a->scale, y);
}

/* Decode tokens of B sequences: token b is row rows[b] of qkv (row stride ldq) and of y (stride ldy); it
   sits at position pos[b] (its sequence's length - 1) and its block table is tables[b * ldt ..] (blocks of
   bs slots). cos_t / sin_t: (positions, hd) rotary tables, or NULL. Every token's rope and KV write first,
   then the sequences' attention, shared by the pool's threads (one sequence per chunk). Returns 0, or -1
   when out of memory (y may be partly written). */
int wsc_decode_attention_batch(float* qkv, long ldq, const long* rows, long B, const long* pos,
                               const float* cos_t, const float* sin_t, float* cache, long slots,
                               const long* tables, long ldt, long bs, long nh, long nkv, long hd, float scale,
                               float* y, long ldy) {
    long smax = 0;
    for (long b = 0; b < B; b++) {
        long p = pos[b];
        rope_write(qkv + rows[b] * ldq, cos_t ? cos_t + p * hd : NULL, sin_t ? sin_t + p * hd : NULL, cache, slots,
                   tables[b * ldt + p / bs] * bs + p % bs, nh, nkv, hd);
        smax = p + 1 > smax ? p + 1 : smax;
    }
    attn_t a = {qkv, ldq, rows, pos, cache, slots, tables, ldt, bs, nh, nkv, hd, scale, y, ldy};
    long ns = atomic_load(&g_use);
    if (ns > B) ns = B;
    int idle = 0;
    if (!scores_buf(nh / nkv * smax) || !chunk_buf(nh * hd)) return -1;  /* the caller's own, reserved */
    if (ns >= 2 && B <= MAX_CHUNKS && atomic_compare_exchange_strong(&g_busy, &idle, 1)) {
        job_t j = {NULL, NULL, NULL, NULL, NULL, 0, 0, 0, &a};
        run_pool(&j, 1, B, ns);
        atomic_store(&g_busy, 0);
        return 0;
    }
    for (long b = 0; b < B; b++)
        if (attend_chunk(&a, b, y + rows[b] * ldy) != 0) return -1;
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

/* wsc_argmax of each of `rows` rows of n (row stride ld) into out */
void wsc_argmax_rows(const float* x, long rows, long ld, long n, long* out) {
    for (long r = 0; r < rows; r++) out[r] = wsc_argmax(x + r * ld, n);
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

/* The same layers for decode tokens of R sequences over a block-paged cache: x (R, C) in place; token r sits
   at position pos[r] of its sequence, whose block table is tables[r * ldt ..] (blocks of bs slots); rows:
   0 .. R-1. scratch: at least R * (C + (nh + 2 nkv) hd + nh hd + 3 ffn) floats. Returns 0, or -1 when out of
   memory. */
int wsc_decode_layers_batch(float* x, const layer_t* layers, long n, long R, long C, long nh, long nkv, long hd,
                            long ffn, const float* cos_t, const float* sin_t, long slots, const long* pos,
                            const long* tables, long ldt, long bs, const long* rows, float* scratch) {
    long nq = (nh + 2 * nkv) * hd;
    float* h = scratch;
    float* qkv = h + R * C;
    float* y = qkv + R * nq;
    float* gu = y + R * nh * hd;
    float* a = gu + R * 2 * ffn;
    float scale = 1.0f / sqrtf((float)hd);
    for (long l = 0; l < n; l++) {
        const layer_t* L = layers + l;
        wsc_rms_norm(x, L->attn_norm, L->attn_eps, h, R, C);
        if (wsc_linear(L->wqkv, h, L->bqkv, NULL, qkv, R, nq, C) != 0 ||
            wsc_decode_attention_batch(qkv, nq, rows, R, pos, cos_t, sin_t, L->cache, slots, tables, ldt, bs, nh,
                                       nkv, hd, scale, y, nh * hd) != 0 ||
            wsc_linear(L->wo, y, L->bo, x, x, R, C, nh * hd) != 0)
            return -1;
        wsc_rms_norm(x, L->mlp_norm, L->mlp_eps, h, R, C);
        if (wsc_linear(L->wgu, h, L->bgu, NULL, gu, R, 2 * ffn, C) != 0) return -1;
        wsc_silu_mul(gu, a, R, ffn);
        if (wsc_linear(L->wd, a, L->bd, x, x, R, C, ffn) != 0) return -1;
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
    lib.wsc_linear.restype = ctypes.c_int
    lib.wsc_rms_norm.argtypes = [P, P, ctypes.c_float, P, L, L]
    lib.wsc_rms_norm.restype = None
    lib.wsc_decode_attention.argtypes = [P, P, P, P, L, L, L, L, L, L, ctypes.c_float, P]
    lib.wsc_decode_attention.restype = ctypes.c_int
    lib.wsc_decode_attention_batch.argtypes = [P, L, P, L, P, P, P, P, L, P, L, L, L, L, L, ctypes.c_float, P, L]
    lib.wsc_decode_attention_batch.restype = ctypes.c_int
    lib.wsc_silu_mul.argtypes = [P, P, L, L]
    lib.wsc_silu_mul.restype = None
    lib.wsc_argmax.argtypes = [P, L]
    lib.wsc_argmax.restype = L
    lib.wsc_argmax_rows.argtypes = [P, L, L, L, P]
    lib.wsc_argmax_rows.restype = None
    lib.wsc_decode_layers.argtypes = [P, P, L, L, L, L, L, L, P, P, L, L, L, P]
    lib.wsc_decode_layers.restype = ctypes.c_int
    lib.wsc_decode_layers_batch.argtypes = [P, P, L, L, L, L, L, L, L, P, P, L, P, P, L, L, P, P]
    lib.wsc_decode_layers_batch.restype = ctypes.c_int
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


PANEL = 16  # outputs per weight panel (see pack)


def pack(w: Tensor, out: Tensor | None = None) -> Tensor:
    """(out, in) float32 weight -> the kernels' panel layout, (ceil(out / 16), in, 16): panel p holds rows
    16p .. 16p + 15 transposed (rows past `out` zero). Written into `out` when given (e.g. a huge-page arena
    view of numel packed_numel(w.shape))."""
    o, n = w.shape
    P = -(-o // PANEL)
    dst = torch.empty(P, n, PANEL) if out is None else out.view(P, n, PANEL)
    full = o // PANEL
    if full:
        dst[:full].copy_(w[:full * PANEL].view(full, PANEL, n).transpose(1, 2))
    if P > full:
        dst[full:].zero_()
        dst[full, :, :o - full * PANEL].copy_(w[full * PANEL:].t())
    return dst


def packed_numel(shape: tuple[int, int]) -> int:
    return -(-shape[0] // PANEL) * PANEL * shape[1]


def linear(x: Tensor, wp: Tensor, out: int, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """(R, in) x, packed weight `wp` (see pack) of `out` outputs [, (out,) bias, (R, out) residual] -> (R, out)
    residual + x W^T + bias. All float32 contiguous CPU tensors (see `usable`)."""
    R, n = x.shape
    y = torch.empty(R, out)
    rc = _lib.wsc_linear(wp.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                         None if residual is None else residual.data_ptr(), y.data_ptr(), R, out, n)
    if rc != 0:
        raise MemoryError(f"linear over {R} rows: out of memory for the packed input")
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


def decode_attention_batch(qkv: Tensor, rows: Tensor, pos: Tensor, cos_t: Tensor | None, sin_t: Tensor | None,
                           cache: Tensor, tables: Tensor, block_size: int, n_head: int, n_kv: int,
                           y: Tensor) -> None:
    """Decode tokens of several sequences over a block-paged cache, one C call: for each b, row rows[b] of
    `qkv` ((N, (n_head + 2 n_kv) hd), contiguous; rotated in place at position pos[b] by the rotary tables
    `cos_t` / `sin_t` ((positions, hd), sin with its first half negated; None: no rotation)) writes its k and
    v to the slot of position pos[b] and attends over positions [0, pos[b]] of its block table tables[b]
    ((B, max blocks) int64); the result goes to row rows[b] of y ((N, n_head hd), contiguous). rows, pos:
    (B,) int64. Same arithmetic as `decode_attention`."""
    hd = cache.shape[-1]
    rc = _lib.wsc_decode_attention_batch(
        qkv.data_ptr(), qkv.shape[1], rows.data_ptr(), rows.shape[0], pos.data_ptr(),
        None if cos_t is None else cos_t.data_ptr(), None if sin_t is None else sin_t.data_ptr(),
        cache.data_ptr(), cache.shape[1], tables.data_ptr(), tables.shape[1], block_size, n_head, n_kv, hd,
        hd ** -0.5, y.data_ptr(), y.shape[1])
    if rc != 0:
        raise MemoryError("batched decode attention: out of memory for the scores")


def silu_mul(gu: Tensor, n: int) -> Tensor:
    """(R, 2n) fused gate|up -> (R, n) silu(gate) * up; float32 contiguous CPU."""
    R = gu.shape[0]
    y = torch.empty(R, n)
    _lib.wsc_silu_mul(gu.data_ptr(), y.data_ptr(), R, n)
    return y


def argmax(x: Tensor) -> int:
    """Index of the first maximum of a 1-D float32 contiguous CPU tensor (the first NaN if any, as torch)."""
    return int(_lib.wsc_argmax(x.data_ptr(), x.shape[0]))


def argmax_rows(x: Tensor, n: int | None = None) -> list[int]:
    """`argmax` of each row of a 2-D float32 CPU tensor with unit column stride, over its first n columns
    (None: all)."""
    R, V = x.shape
    n = V if n is None else min(n, V)
    if x.stride(1) != 1 or n < 1:
        raise ValueError("argmax_rows needs rows of unit stride and at least one column")
    out = torch.empty(R, dtype=torch.long)
    _lib.wsc_argmax_rows(x.data_ptr(), R, x.stride(0), n, out.data_ptr())
    return out.tolist()


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

    def batch(self, x: Tensor, pos: Tensor, tables: Tensor, block_size: int, cos_t: Tensor | None,
              sin_t: Tensor | None) -> Tensor:
        """Decode tokens of R sequences over a block-paged cache: x (R, C) -> (R, C) after every layer, in
        place. Token r sits at position pos[r] of its sequence (block table tables[r], (R, max blocks) int64,
        blocks of `block_size` slots); cos_t / sin_t: (positions, hd) rotary tables (sin with its first half
        negated) or None. Same arithmetic as one sequence at a time."""
        R = x.shape[0]
        nq = (self.nh + 2 * self.nkv) * self.hd
        scratch = torch.empty(R * (self.C + nq + self.nh * self.hd + 3 * self.ffn))
        rows = torch.arange(R)
        rc = _lib.wsc_decode_layers_batch(x.data_ptr(), self._arr, self.n, R, self.C, self.nh, self.nkv, self.hd,
                                          self.ffn, None if cos_t is None else cos_t.data_ptr(),
                                          None if sin_t is None else sin_t.data_ptr(), self.slots, pos.data_ptr(),
                                          tables.data_ptr(), tables.shape[1], block_size, rows.data_ptr(),
                                          scratch.data_ptr())
        if rc != 0:
            raise MemoryError(f"batched decode of {R} sequences: out of memory")
        return x


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """(R, n) x, (n,) w -> (R, n) RMSNorm(x) * w, float32 contiguous CPU tensors."""
    R, n = x.shape
    y = torch.empty(R, n)
    _lib.wsc_rms_norm(x.data_ptr(), w.data_ptr(), eps, y.data_ptr(), R, n)
    return y
