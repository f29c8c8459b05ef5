/* Decode attention: rope, KV write and GQA attention of each sequence's new token, one sequence or a
   batch over a block-paged cache; optionally over a sliding window of the latest positions only (Mistral) and
   with ALiBi's linear distance bias (MPT). */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* ---- one decode token's attention, for one sequence whose KV sits in consecutive cache slots ---------- */

static _Thread_local void* t_scores;
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
   (2 nkv, slots, hd), k heads then v heads, float32 or (kv16) float16, written rounded to nearest; hd % 16 ==
   0. The arithmetic is the same whatever the slots and whichever thread runs it: batched and single-sequence
   decode agree bit for bit. */
static void rope_write(float* qkv, const float* cos, const float* sin_signed, void* cache, long slots, long slot,
                       long nh, long nkv, long hd, int kv16) {
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
    for (long h = 0; h < 2 * nkv; h++) {
        const float* src = qkv + (nh + h) * hd;
        size_t at = ((size_t)h * slots + slot) * hd;
        if (kv16)
            for (long d = 0; d < hd; d += 16) sth16((uint16_t*)cache + at + d, ld16(src + d));
        else
            __builtin_memcpy((float*)cache + at, src, hd * sizeof(float));
    }
}

/* this thread's scratch for g * S scores; NULL when out of memory */
static float* scores_buf(long n) { return grow(&t_scores, &t_cap, n, sizeof(float)); }
static _Thread_local void* t_ktile;
static _Thread_local long t_ktile_cap;
/* this thread's scratch for a tile's K rows widened to float32 (scores_heads); NULL when out of memory */
static float* ktile_buf(long n) { return grow(&t_ktile, &t_ktile_cap, n, sizeof(float)); }

/* table == NULL: positions [lo, S) in slots [slot0 + lo, slot0 + S); else in blocks of bs (see run_of); the
   positions before lo (outside a sliding window) are never read, so their table entries may be stale.
   slopes (NULL: none): per query head, ALiBi's bias slope * (t - (S - 1)) added to the score of position t.
   Scores go 16 positions at a time: 16 vector accumulators (q . K_t over hd), then one 16-way tree
   reduction instead of 16 horizontal sums; the K rows of the 16 positions stay in L1 for the g query heads
   that share them. Values: g heads at once, each V row loaded once. Only query heads [h0, h1) are computed
   (their rows of y written): each head's arithmetic is its own, so a head's output has the same bits whichever
   heads are computed with it. Returns 0, or -1 when out of memory (nothing written to y). */
static inline __attribute__((always_inline)) void scores16(const float* q, const void* const* kr, int n, long hd,
                                                           float scale, float* out, int kv16) {
    v16 acc[16];
#pragma GCC unroll 16
    for (int l = 0; l < 16; l++) acc[l] = (v16){0};
    if (hd == 64) {  /* the common head size: each K row's pointer loaded once, q in 4 registers */
        v16 q0 = ld16(q), q1 = ld16(q + 16), q2 = ld16(q + 32), q3 = ld16(q + 48);
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++) if (l < n) {
            const void* k = kr[l];
            acc[l] += q0 * ldkv(k, 0, kv16);
            acc[l] += q1 * ldkv(k, 16, kv16);
            acc[l] += q2 * ldkv(k, 32, kv16);
            acc[l] += q3 * ldkv(k, 48, kv16);
        }
    } else {
        for (long d = 0; d < hd; d += 16) {
            v16 qv = ld16(q + d);
#pragma GCC unroll 16
            for (int l = 0; l < 16; l++) if (l < n) acc[l] += qv * ldkv(kr[l], d, kv16);
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

#if NPARTS > 1
/* scores16 where a register holds fewer than 16 floats (AVX2, NEON), for query heads [ja, jb) at once: there
   scores16's 16 sums of 16 lanes would take twice (four times) the registers the target has (spilled to the
   stack every step: decode attention ran at a quarter of AVX-512's speed on AVX2). The same arithmetic, in
   another order: each position's 16 lanes go as NPARTS native registers, and level 1 of the tree (a
   position's two halves added, as tlvl1) is done per position, into s1; levels 2-4 as scores16. A float16
   cache's K rows of the tile are widened once into kt (16 hd floats), for all the heads. */
static inline __attribute__((always_inline)) void scores_heads(const float* q, long ja, long jb, long hd,
                                                               const void* const* kr, int n, float scale,
                                                               float* out, long P, float* kt, int kv16) {
    const float* kp[16];
    for (int l = 0; l < n; l++) {
        if (kv16) {
            for (long d = 0; d < hd; d += VLANES) {
                vf v = ldhf((const uint16_t*)kr[l] + d);
                __builtin_memcpy(kt + l * hd + d, &v, sizeof v);
            }
            kp[l] = kt + l * hd;
        } else {
            kp[l] = (const float*)kr[l];
        }
    }
    for (long j = ja; j < jb; j++) {
        const float* qj = q + j * hd;
        float s1[16 * 8] __attribute__((aligned(64)));
        for (int l = 0; l < 16; l++) {
            vf a[NPARTS];
            for (int h = 0; h < NPARTS; h++) a[h] = (vf){0};
            if (l < n)
                for (long d = 0; d < hd; d += 16)
                    for (int h = 0; h < NPARTS; h++) a[h] += ldf(qj + d + h * VLANES) * ldf(kp[l] + d + h * VLANES);
            for (int h = 0; h < NPARTS / 2; h++) {
                vf s = a[h] + a[h + NPARTS / 2];
                __builtin_memcpy(s1 + 8 * l + h * VLANES, &s, sizeof s);
            }
        }
        v16 t[8], u[4], v[2], r;
        for (int k = 0; k < 8; k++) t[k] = ld16(s1 + 16 * k);
        for (int k = 0; k < 4; k++) u[k] = tlvl2(t[2 * k], t[2 * k + 1]);
        v[0] = tlvl3(u[0], u[1]); v[1] = tlvl3(u[2], u[3]);
        r = tlvl4(v[0], v[1]) * scale;
        float rs[16];
        __builtin_memcpy(rs, &r, sizeof r);
        for (int l = 0; l < 16; l++) if (TREE_PERM[l] < n) out[j * P + TREE_PERM[l]] = rs[l];
    }
}
#define PV_NV 1  /* vectors of 16 values of V a pv_block pass (4 heads' sums of 2 of them would not fit) */
#else
static inline __attribute__((always_inline)) void scores_heads(const float* q, long ja, long jb, long hd,
                                                               const void* const* kr, int n, float scale,
                                                               float* out, long P, float* kt, int kv16) {
    (void)kt;
    for (long j = ja; j < jb; j++) {
        if (n == 16) scores16(q + j * hd, kr, 16, hd, scale, out + j * P, kv16);
        else scores16(q + j * hd, kr, n, hd, scale, out + j * P, kv16);
    }
}
#define PV_NV 4
#endif

/* o[j][v] (j < JN heads, v < nv vectors of 16 dims from dim i) = sum over positions u in [lo, S), in order, of
   p[j * (S - lo) + u - lo] * V_u[i + 16 v ..]; each vector of 16 as NPARTS native registers (o[j][v NPARTS + h]) */
static inline __attribute__((always_inline)) void pv_block(const void* Vh, long hd, long i, int nv, int JN,
                                                           const float* p, long lo, long S, const long* table,
                                                           long bs, long slot0, const float* inv, float* out,
                                                           int kv16) {
    long es = kv16 ? 2 : 4;  /* bytes a cache value */
    long P = S - lo;
    vf o[4][4 * NPARTS];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 16
        for (int v = 0; v < 4 * NPARTS; v++) o[j][v] = (vf){0};
    for (long t0 = lo, base, n; t0 < S; t0 += n) {
        n = run_of(table, bs, slot0, t0, S, &base);
        for (long u = 0; u < n; u++) {
            const char* vr = (const char*)Vh + (base + u) * hd * es;
            vf vv[4 * NPARTS];
#pragma GCC unroll 16
            for (int v = 0; v < 4 * NPARTS; v++) {
                long d = i + 16 * (v / NPARTS) + VLANES * (v % NPARTS);
                vv[v] = v >= nv * NPARTS ? (vf){0} : kv16 ? ldhf((const uint16_t*)(const void*)vr + d)
                                                          : ldf((const float*)(const void*)vr + d);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) if (j < JN) {
                vf pu = splatf(p[j * P + t0 - lo + u]);
#pragma GCC unroll 16
                for (int v = 0; v < 4 * NPARTS; v++) if (v < nv * NPARTS) o[j][v] += pu * vv[v];
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) if (j < JN)
#pragma GCC unroll 16
        for (int v = 0; v < 4 * NPARTS; v++) if (v < nv * NPARTS) {
            vf r = o[j][v] * inv[j];
            __builtin_memcpy(out + j * hd + i + 16 * (v / NPARTS) + VLANES * (v % NPARTS), &r, sizeof r);
        }
}

static _Thread_local long* t_slot;
static _Thread_local long t_slot_cap;

/* prefetch the `bytes` at p (into L1: locality 3; L2: 2) */
static inline void prefetch_row(const void* p, long bytes, int l2) {
    for (long d = 0; d < bytes; d += 64) {
        if (l2) __builtin_prefetch((const char*)p + d, 0, 2); else __builtin_prefetch((const char*)p + d, 0, 3);
    }
}

static inline __attribute__((always_inline)) int attend_t(const float* qkv, const void* cache, long slots,
                                                          long slot0, const long* table, long bs, long lo, long S,
                                                          const float* slopes, long nh, long nkv, long hd,
                                                          float scale, float* y, long h0, long h1, int kv16) {
    long g = nh / nkv;
    long P = S - lo;  /* the positions attended; below, position lo + t is t */
    float* sc = scores_buf(g * P);
    float* kt = NPARTS > 1 && kv16 ? ktile_buf(16 * hd) : NULL;
    if (!sc || (NPARTS > 1 && kv16 && !kt)) return -1;
    if (t_slot_cap < P) {  /* the slot of every position (written out, not grow(): attend's code as measured) */
        long* nb = realloc(t_slot, (size_t)P * sizeof(long) + 64);
        if (!nb) return -1;
        t_slot = nb; t_slot_cap = P;
    }
    long* slot = t_slot;
    for (long t0 = lo, base, n; t0 < S; t0 += n) {
        n = run_of(table, bs, slot0, t0, S, &base);
        for (long u = 0; u < n; u++) slot[t0 - lo + u] = base + u;
    }
    long kh1 = (h1 - 1) / g, rb = hd * (kv16 ? 2 : 4);  /* bytes a cache row */
#define ROW(base, t) ((const char*)(base) + slot[t] * rb)
    for (long kh = h0 / g; kh <= kh1; kh++) {
        const char* Kh = (const char*)cache + (size_t)kh * slots * rb;
        const char* Vh = (const char*)cache + (size_t)(nkv + kh) * slots * rb;
        const float* q = qkv + kh * g * hd;
        long ja = h0 > kh * g ? h0 - kh * g : 0, jb = h1 < (kh + 1) * g ? h1 - kh * g : g;  /* its heads here */
        if (kh == h0 / g)  /* this head's K and V into L2 now; each later head's while the one before computes */
            for (long t = 0; t < P; t++) { prefetch_row(ROW(Kh, t), rb, 1); prefetch_row(ROW(Vh, t), rb, 1); }
        const char* Kn = kh < kh1 ? Kh + (size_t)slots * rb : NULL;
        const char* Vn = kh < kh1 ? Vh + (size_t)slots * rb : NULL;
        for (long t = 0; t < 16 && t < P; t++) prefetch_row(ROW(Kh, t), rb, 0);
        for (long t = 0; t < P;) {  /* scores, 16 positions at a time; the next 16 K rows are prefetched meanwhile
                                       (a sequence's blocks are scattered: short streams), and the next head's */
            const void* kr[16];
            int n = 0;
            for (; n < 16 && t + n < P; n++) {
                kr[n] = ROW(Kh, t + n);
                if (t + n + 16 < P) prefetch_row(ROW(Kh, t + n + 16), rb, 0);
                if (Kn) { prefetch_row(ROW(Kn, t + n), rb, 1); prefetch_row(ROW(Vn, t + n), rb, 1); }
            }
            scores_heads(q, ja, jb, hd, kr, n, scale, sc + t, P, kt, kv16);
            t += n;
        }
        if (slopes)  /* ALiBi: scores fall linearly with the distance to the query (as the model adds them) */
            for (long j = ja; j < jb; j++) {
                float m = slopes[kh * g + j];
                for (long t = 0; t < P; t++) sc[j * P + t] += m * (float)(lo + t - (S - 1));
            }
        float inv[64];
        for (long j = ja; j < jb; j++) {  /* softmax numerators in place, 1 / sums in inv */
            float* sj = sc + j * P;
            float m = sj[0];
            long t = 1;
            if (P >= 32) {  /* the maximum, 16 lanes at a time (exact: same value as the scalar loop) */
                v16 mv = ld16(sj);
                for (t = 16; t + 16 <= P; t += 16) {
                    mv = vmax16(ld16(sj + t), mv);
                }
                for (int l = 0; l < 16; l++) m = mv[l] > m ? mv[l] : m;
            }
            for (; t < P; t++) m = sj[t] > m ? sj[t] : m;
            v16 acc = {0};
            t = 0;
            for (; t + 16 <= P; t += 16) {
                v16 e = vexp(ld16(sj + t) - m);
                __builtin_memcpy(sj + t, &e, sizeof e);
                acc += e;
            }
            float sum = hsum16(acc);
            for (; t < P; t++) {
                v16 e = vexp(vsplat(sj[t] - m));
                sj[t] = e[0];
                sum += e[0];
            }
            inv[(j - ja) % 64] = 1.0f / sum;
            if ((j - ja) % 64 == 63 || j == jb - 1) {  /* values for heads [j0, j] */
                long j0 = j - (j - ja) % 64;
                float* out = y + (kh * g + j0) * hd;
                for (long jj = j0; jj <= j; jj += 4) {
                    int JN = j + 1 - jj < 4 ? (int)(j + 1 - jj) : 4;
                    const float* p = sc + jj * P;
                    float* o = out + (jj - j0) * hd;
                    const float* iv = inv + (jj - j0);
                    for (long i = 0; i < hd; i += 16 * PV_NV) {
                        int nv = hd - i < 16 * PV_NV ? (int)((hd - i) / 16) : PV_NV;
                        if (nv == PV_NV) {
                            switch (JN) {
                            case 1: pv_block(Vh, hd, i, PV_NV, 1, p, lo, S, table, bs, slot0, iv, o, kv16); break;
                            case 2: pv_block(Vh, hd, i, PV_NV, 2, p, lo, S, table, bs, slot0, iv, o, kv16); break;
                            case 3: pv_block(Vh, hd, i, PV_NV, 3, p, lo, S, table, bs, slot0, iv, o, kv16); break;
                            default: pv_block(Vh, hd, i, PV_NV, 4, p, lo, S, table, bs, slot0, iv, o, kv16); break;
                            }
                        } else {
                            pv_block(Vh, hd, i, nv, JN, p, lo, S, table, bs, slot0, iv, o, kv16);
                        }
                    }
                }
            }
        }
    }
#undef ROW
    return 0;
}

/* attend_t for a float32 (kv16 0) or float16 (1) cache, each compiled on its own */
static int attend(const float* qkv, const void* cache, long slots, long slot0, const long* table, long bs, long lo,
                  long S, const float* slopes, long nh, long nkv, long hd, float scale, float* y, long h0, long h1,
                  int kv16) {
    if (kv16) return attend_t(qkv, cache, slots, slot0, table, bs, lo, S, slopes, nh, nkv, hd, scale, y, h0, h1, 1);
    return attend_t(qkv, cache, slots, slot0, table, bs, lo, S, slopes, nh, nkv, hd, scale, y, h0, h1, 0);
}

/* The first position a token at position S - 1 attends to: the window holds the latest `window` positions
   (itself included; window 0: every position). */
static inline long window_lo(long S, long window) { return window > 0 && S > window ? S - window : 0; }

/* One sequence's attention is shared by the pool's threads, the query heads of one KV head a chunk (each KV
   head's K and V read once, by one thread), once it reads at least this many positions; shorter ones run on
   the caller alone. Measured with SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64), 30 layers' caches
   in turn, 2 threads against 1 on this 2-core VM: 1.08x at 100 positions, 1.3x at 500, 1.2x at 2,000 (there
   the caches exceed L3; a lone thread reads them at ~24 GB/s). Only while the pool's workers keep up (g_late,
   pool.c): with the other core busy, sharing measured 0.73x at 2,000 positions. */
#define SPLIT_MIN_POSITIONS 32

/* One sequence whose KV sits in consecutive slots (position t in slot slot0 + t); its new token is position
   S - 1. window: attend to the latest `window` positions only (0: all; slot0 may then be negative, the slots
   of positions before the window being no longer its own); slopes: per query head ALiBi slopes, or NULL;
   kv16: the cache holds float16 (else float32). Returns 0, or -1 when out of memory (nothing written to y). */
int wsc_decode_attention_ex(float* qkv, const float* cos, const float* sin_signed, void* cache, long slots,
                            long slot0, long S, long nh, long nkv, long hd, float scale, float* y, long window,
                            const float* slopes, int kv16) {
    rope_write(qkv, cos, sin_signed, cache, slots, slot0 + S - 1, nh, nkv, hd, kv16);
    long lo = window_lo(S, window), ns = atomic_load(&g_use);
    if (ns > nkv) ns = nkv;
    int idle = 0;
    if (ns >= 2 && S - lo >= SPLIT_MIN_POSITIONS && g_late < LATE_SHARE && nkv <= MAX_CHUNKS
        && scores_buf(nh / nkv * (S - lo))
        && chunk_buf(nh * hd) && atomic_compare_exchange_strong(&g_busy, &idle, 1)) {
        long row = 0, pos = S - 1;
        attn_t a = {qkv, 0, &row, &pos, cache, slots, NULL, 0, 0, nh, nkv, hd, scale, y, 0, window, slopes, slot0,
                    nh / nkv, kv16};
        job_t j = {NULL, NULL, NULL, NULL, NULL, 0, 0, 0, &a};
        run_pool(&j, 1, nkv, ns);
        atomic_store(&g_busy, 0);
        return 0;
    }
    return attend(qkv, cache, slots, slot0, NULL, 0, lo, S, slopes, nh, nkv, hd, scale, y, 0, nh, kv16);
}

/* wsc_decode_attention_ex over every position, without ALiBi, on a float32 cache. */
int wsc_decode_attention(float* qkv, const float* cos, const float* sin_signed, float* cache, long slots,
                         long slot0, long S, long nh, long nkv, long hd, float scale, float* y) {
    return wsc_decode_attention_ex(qkv, cos, sin_signed, cache, slots, slot0, S, nh, nkv, hd, scale, y, 0, NULL, 0);
}

static int attend_chunk(const attn_t* a, long c, float* y) {
    if (a->hsplit) {  /* query heads [c hsplit, (c + 1) hsplit) of the one sequence */
        long S = a->pos[0] + 1, h0 = c * a->hsplit, h1 = h0 + a->hsplit < a->nh ? h0 + a->hsplit : a->nh;
        return attend(a->qkv, a->cache, a->slots, a->slot0, NULL, 0, window_lo(S, a->window), S, a->slopes, a->nh,
                      a->nkv, a->hd, a->scale, y, h0, h1, a->kv16);
    }
    long S = a->pos[c] + 1;  /* sequence c */
    return attend(a->qkv + a->rows[c] * a->ldq, a->cache, a->slots, 0, a->tables + c * a->ldt, a->bs,
                  window_lo(S, a->window), S, a->slopes, a->nh, a->nkv, a->hd, a->scale, y, 0, a->nh, a->kv16);
}

/* Decode tokens of B sequences: token b is row rows[b] of qkv (row stride ldq) and of y (stride ldy); it
   sits at position pos[b] (its sequence's length - 1) and its block table is tables[b * ldt ..] (blocks of
   bs slots). cos_t / sin_t: (positions, hd) rotary tables, or NULL. Every token's rope and KV write first,
   then the sequences' attention, shared by the pool's threads (one sequence per chunk). window, slopes: as
   wsc_decode_attention_ex (a table's entries before the window are not read); kv16: the cache holds float16.
   Returns 0, or -1 when out of memory (y may be partly written). */
int wsc_decode_attention_batch_ex(float* qkv, long ldq, const long* rows, long B, const long* pos,
                                  const float* cos_t, const float* sin_t, void* cache, long slots,
                                  const long* tables, long ldt, long bs, long nh, long nkv, long hd, float scale,
                                  float* y, long ldy, long window, const float* slopes, int kv16) {
    long smax = 0;
    for (long b = 0; b < B; b++) {
        long p = pos[b];
        rope_write(qkv + rows[b] * ldq, cos_t ? cos_t + p * hd : NULL, sin_t ? sin_t + p * hd : NULL, cache, slots,
                   tables[b * ldt + p / bs] * bs + p % bs, nh, nkv, hd, kv16);
        long P = p + 1 - window_lo(p + 1, window);
        smax = P > smax ? P : smax;
    }
    attn_t a = {qkv, ldq, rows, pos, cache, slots, tables, ldt, bs, nh, nkv, hd, scale, y, ldy, window, slopes, 0, 0,
                kv16};
    long ns = atomic_load(&g_use);
    if (ns > B) ns = B;
    int idle = 0;
    if (!scores_buf(nh / nkv * smax) || !chunk_buf(nh * hd) || (NPARTS > 1 && kv16 && !ktile_buf(16 * hd)))
        return -1;  /* the caller's own, reserved */
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

/* wsc_decode_attention_batch_ex over every position, without ALiBi, on a float32 cache. */
int wsc_decode_attention_batch(float* qkv, long ldq, const long* rows, long B, const long* pos,
                               const float* cos_t, const float* sin_t, float* cache, long slots,
                               const long* tables, long ldt, long bs, long nh, long nkv, long hd, float scale,
                               float* y, long ldy) {
    return wsc_decode_attention_batch_ex(qkv, ldq, rows, B, pos, cos_t, sin_t, cache, slots, tables, ldt, bs, nh,
                                         nkv, hd, scale, y, ldy, 0, NULL, 0);
}
