/* The work-stealing thread pool, when it shares a product, and wsc_linear (the products' entry point). */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* ---- a tiny work-stealing pool for one product at a time -------------------------------------------
   The panels are cut into chunks (~32 KiB of weights each; 64 KiB for one row) and the chunks into one contiguous
   segment per thread, so that every thread streams its own stretch of the matrix front to back. A thread that runs
   out takes chunks from the back of another's segment (a worker that is asleep, or descheduled by another process,
   simply gets robbed). The caller never waits long: once no chunk is left to take it waits a few microseconds for
   chunks still in progress, then computes them itself. A chunk's result is published by whoever first moves its
   state from (gen, OPEN) to (gen, WRITING), so a late worker only throws its result away. Every output is computed
   by the same code in the same order, whichever thread does it. */

#define CHUNK_FLOATS 8192          /* weights per chunk: 32 KiB, ~2 us at memory speed */
#define CHUNK_FLOATS_ONE 16384     /* the same for a single row's product (decode): 64 KiB, fewer hand-offs.
                                      Measured (bench/serve_kernels_ab.py) against 32 KiB: single-stream decode
                                      +2.3% Q4_1 (12 rounds), +3.1% Q8_0 (10); 128 KiB: 0.95x of 64 */
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
static _Atomic long g_wstart;  /* when the first worker entered the current job (0: none yet) */
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

/* The weights of the product after the current one, when the caller knows it (decode_layers.c's single-stream
   loop): a worker waiting for that job (while the caller runs attention, a norm, the activations' rounding)
   pulls its share of them, the segment it will stream, into its L2 meanwhile, 4 KiB at a time, looking for the
   job between, so that it starts the product from cache instead of ramping up a stream from memory. Measured
   (bench/serve_kernels_ab.py, single-stream decode, 2 threads): +3.8% on Q4_1 (20 rounds), +5.3% on Q8_0
   (12); the caller prefetching the start of its own share as well, or the worker prefetching the next
   token's first layer after the last, gained nothing more (0.99x, 1.00x). */
static _Atomic(const char*) g_next_w;
static _Atomic long g_next_bytes;
static _Atomic uint64_t g_next_id;
static inline void hint_next(const void* w, long bytes) {
    atomic_store_explicit(&g_next_w, (const char*)w, memory_order_relaxed);
    atomic_store_explicit(&g_next_bytes, bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_next_id, 1, memory_order_release);
}
#ifndef NEXT_PF_BYTES
#define NEXT_PF_BYTES (1L << 20)   /* at most this much of the next product's share prefetched */
#endif

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
static _Thread_local void* t_buf;
static _Thread_local long t_buf_cap;
static float* chunk_buf(long n) { return grow(&t_buf, &t_buf_cap, n, sizeof(float)); }

static inline int enter(uint64_t gen) {
    atomic_fetch_add(&g_inflight, 1);
    if (atomic_load(&g_live) == gen) return 1;
    atomic_fetch_sub(&g_inflight, 1);
    return 0;
}

static inline long job_buf(const job_t* j, long cp) {
    if (j->xr) return QX_ROWS * (XB * j->in / 4 + XS * (j->in / 32));  /* (XB: a multiple of 4 bytes) */
    return j->at ? (j->at->blk ? QBLOCK : 1) * j->at->nh * j->at->hd : j->rows * cp * PANEL;
}

static void finish_chunk(uint64_t gen, const job_t* j, long c, long cp, float* buf) {
    if (j->xr) {  /* the rounding of rows [r0, r1) of x */
        long in = j->in, nb = in / 32, r0 = c * QX_ROWS, r1 = r0 + QX_ROWS < j->rows ? r0 + QX_ROWS : j->rows;
        float* bs = buf + QX_ROWS * XB * in / 4;
        quantize_x(j->xr + r0 * in, r1 - r0, in, (int8_t*)buf, bs);
        uint64_t want = gen << 2 | OPEN;
        if (atomic_compare_exchange_strong(&g_state[c], &want, gen << 2 | WRITING)) {
            __builtin_memcpy((int8_t*)j->xq + XB * r0 * in, buf, (size_t)(r1 - r0) * XB * in);
            __builtin_memcpy((float*)j->xs + XS * r0 * nb, bs, (size_t)(r1 - r0) * XS * nb * sizeof(float));
            atomic_store(&g_state[c], gen << 2 | DONE);
        }
        return;
    }
    if (j->at) {  /* attention: token c's (or tokens [blk[c], blk[c + 1])), or query heads [h0, h1) of the one */
        const attn_t* a = j->at;
        if (attend_chunk(a, c, buf) != 0) return;  /* out of memory: the caller (who reserved its own) redoes it */
        long h0 = a->hsplit ? c * a->hsplit : 0, h1 = a->hsplit && h0 + a->hsplit < a->nh ? h0 + a->hsplit : a->nh;
        long e0 = a->blk ? a->blk[c] : c, e1 = a->blk ? a->blk[c + 1] : c + 1;
        uint64_t want = gen << 2 | OPEN;
        if (atomic_compare_exchange_strong(&g_state[c], &want, gen << 2 | WRITING)) {
            if (a->hsplit)
                __builtin_memcpy(a->y + h0 * a->hd, buf + h0 * a->hd, (h1 - h0) * a->hd * sizeof(float));
            else
                for (long e = e0; e < e1; e++)
                    __builtin_memcpy(a->y + a->rows[e] * a->ldy, buf + (e - e0) * a->nh * a->hd,
                                     a->nh * a->hd * sizeof(float));
            atomic_store(&g_state[c], gen << 2 | DONE);
        }
        return;
    }
    long np = (j->out + PANEL - 1) / PANEL;
    long p0 = c * cp, p1 = p0 + cp < np ? p0 + cp : np;
    any_panels_into(j, p0, p1, buf, out_end(j, p1) - p0 * PANEL);
    uint64_t want = gen << 2 | OPEN;
    if (atomic_compare_exchange_strong(&g_state[c], &want, gen << 2 | WRITING)) {
        put(j, p0, p1, buf);
        atomic_store(&g_state[c], gen << 2 | DONE);
    }
}

/* enter job `gen` for one chunk, with this thread's chunk buffer in *buf. The job's fields are read only
   inside the job (a worker that reads them before may see the next job being written); 0: stale job, or out
   of memory (the others, the caller at the latest, do the chunk). */
static int enter_with_buf(uint64_t gen, const job_t* j, long cp, float** buf) {
    if (!enter(gen)) return 0;
    if ((!*buf && !(*buf = chunk_buf(job_buf(j, cp)))) || !qbuf_ready(j)) {
        atomic_fetch_sub(&g_inflight, 1);
        return 0;
    }
    return 1;
}

/* thread `me` of job `gen`: its own segment front to back, then the others' from their backs; returns the number
   of chunks it computed */
static long work(uint64_t gen, const job_t* j, long me) {
    long cp = atomic_load(&g_chunk_panels), ns = atomic_load(&g_nseg), done = 0;
    if (atomic_load(&g_gen) != gen || me >= ns) return 0;
    float* buf = NULL;
    if (me) {
        long zero = 0;
        atomic_compare_exchange_strong(&g_wstart, &zero, now_ns());
    }
    for (long c; (c = take(me, 1)) >= 0; done++) {
        if (!enter_with_buf(gen, j, cp, &buf)) return done;  /* stale: the segments belong to a newer job */
        finish_chunk(gen, j, c, cp, buf);
        atomic_fetch_sub(&g_inflight, 1);
    }
    for (long d = 1; d < ns; d++) {
        long k = (me + d) % ns;
        for (long c; (c = take(k, 0)) >= 0; done++) {
            if (!enter_with_buf(gen, j, cp, &buf)) return done;
            finish_chunk(gen, j, c, cp, buf);
            atomic_fetch_sub(&g_inflight, 1);
        }
    }
    return done;
}

static void* worker_main(void* arg) {
    long me = (long)(intptr_t)arg;
    uint64_t seen = atomic_load(&g_gen), hint_seen = 0;
    const char *pf = NULL, *pf_end = NULL;  /* what is left to prefetch of the hinted product (kept across jobs) */
    while (!atomic_load(&g_stop)) {
        long t0 = now_ns();
        uint64_t gen;
        uint64_t hid = atomic_load_explicit(&g_next_id, memory_order_acquire);
        if (hid != hint_seen) {  /* this thread's share of the next product: segment me of ns, by bytes */
            hint_seen = hid;
            const char* w = atomic_load_explicit(&g_next_w, memory_order_relaxed);
            long bytes = atomic_load_explicit(&g_next_bytes, memory_order_relaxed), ns = atomic_load(&g_use);
            if (w && me < ns) {
                pf = w + bytes * me / ns;
                pf_end = w + bytes * (me + 1) / ns;
                if (pf_end - pf > NEXT_PF_BYTES) pf_end = pf + NEXT_PF_BYTES;
            }
        }
        while ((gen = atomic_load(&g_gen)) == seen && !atomic_load(&g_stop)) {
            if (pf < pf_end) {
                for (int i = 0; i < 64 && pf < pf_end; i++, pf += 64) __builtin_prefetch(pf, 0, 2);
                continue;
            }
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

static double g_late;  /* the decaying fraction of shared products whose workers were late (see LATE_NS) */

/* Let `threads` threads (the caller's included) share each product from now on, starting workers as needed
   (and, until they are seen late, assuming they keep up); returns how many will. */
int wsc_set_threads(int threads) {
    g_late = 0;
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

/* Whether to share a product of few rows is decided by whether the other threads show up: when another process
   keeps the other cores busy, a worker starts late or is descheduled in the middle of a chunk, and the caller
   waits for it. A shared product is late when its first worker started more than LATE_NS after the job was
   published, or none did before the caller ran out of chunks, or the caller then waited more than LATE_NS and
   one chunk's time (as the caller took them) for chunks in progress. g_late is the decaying fraction of late products (the last ~16 count); products of few
   rows are shared while it stays under LATE_SHARE, else run by the caller alone, and every EXPLORE_EVERY
   products alone a burst of EXPLORE_BURST runs shared to look again (the first of a burst, which wakes sleeping
   workers, is not counted, nor is any product that had to wake one).
   Measured (bench/serve_kernels_ab.py, SmolLM2's GGUF files, single-stream decode, 2 threads on this 2-core
   VM) against the rule this replaces, which compared timings of both ways per product size and whose
   estimates (a few products each) flipped between the two from token to token: +5.1% on Q4_1 and +5.5% on
   Q8_0 with nothing else running (the same as always sharing), -1.6% with a busy loop on the other core
   (always sharing: -10.8%). */
#define SHARE_ROWS 4  /* products of this many rows or more are always shared */
#define QX_SHARE_CHUNKS 2  /* ... and their rounding of x (qint.c) when it makes this many chunks of QX_ROWS */
#define LATE_NS 5000
#define LATE_SHARE 0.25
#define EXPLORE_EVERY 256
#define EXPLORE_BURST 8
static long g_njobs, g_burst_left;

static _Thread_local void* t_xt;
static _Thread_local long t_xt_cap;

/* y[r, o] = res[r, o] + (sum_k x[r, k] W[o, k] + b[o]); W packed in panels (off NULL, see panels.c), in sparse
   panels (spanels.c) or, with qt > 0, in quantized panels at qw (quant.c), x (rows, in), y/res (rows, out). b and
   res may be NULL; res may alias y. Thread-safe: one caller at a time shares the pool, any others run alone.
   Returns 0, or -1 when out of memory (nothing written). */
static int qproduct(const float* W, const int64_t* off, const uint8_t* qw, int qt, const float* x, const float* b,
                    const float* res, float* y, long rows, long out, long in) {
    const float* xt = x;
    long np = (out + PANEL - 1) / PANEL;
    const int8_t* xq = NULL;
    const float* xs = NULL;
    int round = qt && qint8_applies(qt);
    if (round) {  /* x rounded to int8 (qint.c), in one buffer: xq, then xs (below) */
        long nb = in / 32, at = (XB * rows * in + 15) / 16 * 16;
        if (!grow(&t_xt, &t_xt_cap, at / 4 + rows * nb * XS, sizeof(float))) return -1;
        xq = (const int8_t*)t_xt;
        xs = (const float*)t_xt + at / 4;
    } else if (rows > 1 && !off) {  /* (one row is its own transpose; sparse panels read x as it is) */
        if (!grow(&t_xt, &t_xt_cap, rows * in, sizeof(float))) return -1;
        pack_x(x, rows, in, t_xt);
        xt = t_xt;
    }
    job_t j = {W, xt, b, res, y, rows, out, in, NULL, off, qw, qt, xq, xs, NULL};
    if (!qbuf_ready(&j)) return -1;
    /* floats (quantized: 4-byte words) streamed per panel */
    long per = off ? (long)off[np] / (np > 0 ? np : 1) : qt ? qpanel_bytes(qt, in) / 4 : PANEL * in;
    long cp = (rows == 1 ? CHUNK_FLOATS_ONE : CHUNK_FLOATS) / (per > 0 ? per : 1);
    if (qt && rows == 1) cp = cp < QNP ? QNP : cp / QNP * QNP;  /* one decode row runs QNP panels at once */
    if (cp < 1) cp = 1;
    if (cp > MAX_CHUNK_OUT / PANEL) cp = MAX_CHUNK_OUT / PANEL;
    if ((np + cp - 1) / cp > MAX_CHUNKS) cp = (np + MAX_CHUNKS - 1) / MAX_CHUNKS;
    long nc = (np + cp - 1) / cp;
    long ns = atomic_load(&g_use);
    if (ns > nc / 2) ns = nc / 2;
    int idle = 0;
    if (ns < 2 || !chunk_buf(rows * cp * PANEL) || !atomic_compare_exchange_strong(&g_busy, &idle, 1)) {
        if (round) quantize_x(x, rows, in, (int8_t*)xq, (float*)xs);
        any_panels_into(&j, 0, np, y, out);  /* (also when another thread is using the pool: this is reentrant) */
        return 0;
    }
    if (round) {  /* the rounding shared too when there are enough rows to share */
        long nq = (rows + QX_ROWS - 1) / QX_ROWS;
        job_t jq = {NULL, NULL, NULL, NULL, NULL, rows, 0, in, NULL, NULL, NULL, 0, xq, xs, x};
        if (nq >= QX_SHARE_CHUNKS && nq <= MAX_CHUNKS && chunk_buf(job_buf(&jq, 1)))
            run_pool(&jq, 1, nq, atomic_load(&g_use) < nq ? atomic_load(&g_use) : nq);
        else
            quantize_x(x, rows, in, (int8_t*)xq, (float*)xs);
    }
    int shared = 1, count = 0;
    if (rows < SHARE_ROWS) {  /* (more rows are compute-bound: two cores beat one, a late worker gets robbed) */
        shared = g_late < LATE_SHARE;
        count = 1;
        if (!shared && g_burst_left == 0 && ++g_njobs % EXPLORE_EVERY == 0) g_burst_left = EXPLORE_BURST;
        if (g_burst_left > 0) {
            shared = 1;
            count = g_burst_left-- < EXPLORE_BURST;
        }
    }
    if (!shared) {
        any_panels_into(&j, 0, np, y, out);
    } else {
        int late = run_pool(&j, cp, nc, ns);
        if (count && late >= 0) g_late = g_late * (15.0 / 16) + late / 16.0;
    }
    atomic_store(&g_busy, 0);
    return 0;
}

static int product(const float* W, const int64_t* off, const float* x, const float* b, const float* res, float* y,
                   long rows, long out, long in) {
    return qproduct(W, off, NULL, 0, x, b, res, y, rows, out, in);
}

int wsc_linear(const float* W, const float* x, const float* b, const float* res, float* y, long rows, long out,
               long in) {
    return product(W, NULL, x, b, res, y, rows, out, in);
}

/* wsc_linear over W in quantized panels of type qt (wsc_qpack) */
int wsc_qlinear(const uint8_t* W, int qt, const float* x, const float* b, const float* res, float* y, long rows,
                long out, long in) {
    if (qt <= QT_F32 || qt >= QT_N || in % QK[qt]) return -2;
    return qproduct(NULL, NULL, W, qt, x, b, res, y, rows, out, in);
}

/* wsc_linear over W in sparse panels with panel offsets off (spanels.c) */
int wsc_linear_sparse(const float* W, const int64_t* off, const float* x, const float* b, const float* res, float* y,
                      long rows, long out, long in) {
    return product(W, off, x, b, res, y, rows, out, in);
}

/* returns -1 when a worker had to be woken (a transient, e.g. the first product of a token: not a fair sample
   of whether the workers keep up), else 1 when the job was late (see LATE_NS), 0 when not */
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
    atomic_store(&g_wstart, 0);
    long t_pub = now_ns();
    atomic_store(&g_gen, gen);
    int warm = atomic_load(&g_sleeping) == 0;
    if (!warm) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    long mine = work(gen, &j, 0);
    /* nothing left to take; wait briefly for chunks in progress, then redo what is still missing. A chunk in
       progress may have just begun: the waits count from a chunk's time as the caller took it (a slower vector
       path or a slower memory state makes every chunk longer, not the worker late) */
    long t0 = now_ns(), ws = atomic_load(&g_wstart);
    long chunk_ns = mine > 0 ? (t0 - t_pub) / mine : 0, wait_ns = g_wait_ns + 2 * chunk_ns;
    float* buf = chunk_buf(job_buf(&j, cp));  /* (reserved by the caller) */
    for (long c = 0; c < nc; c++) {
        while ((atomic_load(&g_state[c]) & 3) != DONE) {
            if (now_ns() - t0 < wait_ns) { cpu_relax(); continue; }
            finish_chunk(gen, &j, c, cp, buf);
            while ((atomic_load(&g_state[c]) & 3) != DONE) cpu_relax();  /* a worker is copying out */
        }
    }
    atomic_store(&g_live, 0);
    while (atomic_load(&g_inflight) != 0) cpu_relax();  /* a late worker still reading x / W */
    if (!warm) return -1;
    return ws == 0 || ws - t_pub > LATE_NS || now_ns() - t0 > LATE_NS + chunk_ns;
}
