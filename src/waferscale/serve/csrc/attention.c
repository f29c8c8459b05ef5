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
   p[j * P + u - lo] * V_u[i + 16 v ..]; each vector of 16 as NPARTS native registers (o[j][v NPARTS + h]) */
static inline __attribute__((always_inline)) void pv_block(const void* Vh, long hd, long i, int nv, int JN,
                                                           const float* p, long P, long lo, long S,
                                                           const long* table, long bs, long slot0,
                                                           const float* inv, float* out, int kv16) {
    long es = kv16 ? 2 : 4;  /* bytes a cache value */
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

/* the numerators of softmax(s[0 .. P)) in place; returns 1 / their sum */
static inline __attribute__((always_inline)) float softmax_(float* sj, long P) {
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
    return 1.0f / sum;
}

/* out[j hd ..] (j < n heads) = inv[j] * sum over positions u in [lo, S), in order, of p[j * P + u - lo] * V_u:
   pv_block over the heads four at a time */
static inline __attribute__((always_inline)) void pv_heads(const void* Vh, long hd, long n, const float* p, long P,
                                                           long lo, long S, const long* table, long bs,
                                                           long slot0, const float* inv, float* out, int kv16) {
    for (long jj = 0; jj < n; jj += 4) {
        int JN = n - jj < 4 ? (int)(n - jj) : 4;
        const float* pj = p + jj * P;
        float* o = out + jj * hd;
        const float* iv = inv + jj;
        for (long i = 0; i < hd; i += 16 * PV_NV) {
            int nv = hd - i < 16 * PV_NV ? (int)((hd - i) / 16) : PV_NV;
            if (nv == PV_NV) {
                switch (JN) {
                case 1: pv_block(Vh, hd, i, PV_NV, 1, pj, P, lo, S, table, bs, slot0, iv, o, kv16); break;
                case 2: pv_block(Vh, hd, i, PV_NV, 2, pj, P, lo, S, table, bs, slot0, iv, o, kv16); break;
                case 3: pv_block(Vh, hd, i, PV_NV, 3, pj, P, lo, S, table, bs, slot0, iv, o, kv16); break;
                default: pv_block(Vh, hd, i, PV_NV, 4, pj, P, lo, S, table, bs, slot0, iv, o, kv16); break;
                }
            } else {
                pv_block(Vh, hd, i, nv, JN, pj, P, lo, S, table, bs, slot0, iv, o, kv16);
            }
        }
    }
}

static _Thread_local long* t_slot;
static _Thread_local long t_slot_cap;

/* this thread's table of the slot of every position in [lo, S) (position lo + t at [t]); NULL when out of
   memory. (Written out, not grow(): attend's code as measured.) */
static inline long* slots_of(const long* table, long bs, long slot0, long lo, long S) {
    long P = S - lo;
    if (t_slot_cap < P) {
        long* nb = realloc(t_slot, (size_t)P * sizeof(long) + 64);
        if (!nb) return NULL;
        t_slot = nb; t_slot_cap = P;
    }
    for (long t0 = lo, base, n; t0 < S; t0 += n) {
        n = run_of(table, bs, slot0, t0, S, &base);
        for (long u = 0; u < n; u++) t_slot[t0 - lo + u] = base + u;
    }
    return t_slot;
}

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
    long* slot = slots_of(table, bs, slot0, lo, S);
    if (!slot) return -1;
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
            inv[(j - ja) % 64] = softmax_(sc + j * P, P);
            if ((j - ja) % 64 == 63 || j == jb - 1) {  /* values for heads [j0, j] */
                long j0 = j - (j - ja) % 64;
                pv_heads(Vh, hd, j + 1 - j0, sc + j0 * P, P, lo, S, table, bs, slot0, inv, y + (kh * g + j0) * hd,
                         kv16);
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

/* ---- a long prefill chunk's tokens, a block of them at a time ------------------------------------------
   Attending token by token (attend) reads every K row once per token and sums each score across the lanes of
   one K row: a 512-token chunk on AVX2 ran at ~10 GMAC/s on 2 threads, against ~37 for torch's SDPA. A run of
   PREFILL_MIN_ROWS or more consecutive positions of one sequence goes instead in blocks of QBLOCK tokens: for
   each KV head its keys are laid out once per block with positions across the lanes (kt: per tile of VLANES
   positions, hd rows of VLANES), so that every score is one lane of a multiply-add chain over d in order, four
   query vectors (tokens x heads) against two tiles at a time; then each query's softmax and values exactly as
   attend's. A token's result depends only on its own query and keys, not on the block it is in (the positions
   of a tile past a token's own are computed and never read), but differs in rounding from attend's; runs
   shorter than PREFILL_MIN_ROWS (a decode token, speculative decoding's verified drafts) keep attend's, so that
   decode is the same bit for bit however its tokens are batched. */
#define PREFILL_MIN_ROWS 65  /* (QBLOCK, tokens a block: kernels.h) */

static _Thread_local void* t_kt;
static _Thread_local long t_kt_cap;

/* sc[m ldp + VLANES i + l] = scale * (sum over d in order of q[m][d] kt_i[d][l]) for MB (<= 4) query vectors q[m],
   tiles i in [0, nt) (nt even) */
static inline __attribute__((always_inline)) void scores_tiles(const float* const* q, const int MB, long hd,
                                                               const float* kt, long nt, float scale, float* sc,
                                                               long ldp) {
    for (long i = 0; i < nt; i += 2) {
        vf acc[4][2];
        for (int m = 0; m < 4; m++) acc[m][0] = acc[m][1] = (vf){0};
        const float* k0 = kt + i * hd * VLANES;
        const float* k1 = k0 + hd * VLANES;
        for (long d = 0; d < hd; d++) {
            vf a = ldf(k0 + d * VLANES), b = ldf(k1 + d * VLANES);
            for (int m = 0; m < MB; m++) {
                vf qd = splatf(q[m][d]);
                acc[m][0] += qd * a;
                acc[m][1] += qd * b;
            }
        }
        for (int m = 0; m < MB; m++) {
            vf s0 = acc[m][0] * scale, s1 = acc[m][1] * scale;
            __builtin_memcpy(sc + m * ldp + i * VLANES, &s0, sizeof s0);
            __builtin_memcpy(sc + m * ldp + (i + 1) * VLANES, &s1, sizeof s1);
        }
    }
}

/* n tokens at consecutive positions p0 .. p0 + n - 1 of one sequence (entries e0 .. e0 + n - 1 of a's batch,
   their K and V already in the cache) -> y (n rows of nh hd). Returns 0, or -1 when out of memory. */
static int attend_block(const attn_t* a, long e0, long n, float* y) {
    long nh = a->nh, nkv = a->nkv, hd = a->hd, g = nh / nkv, bs = a->bs, p0 = a->pos[e0];
    const long* table = a->tables + e0 * a->ldt;
    long lo = window_lo(p0 + 1, a->window), S = p0 + n, P = S - lo;
    long nt = (P + VLANES - 1) / VLANES;
    nt += nt & 1;
    long ldp = nt * VLANES, rb = hd * (a->kv16 ? 2 : 4);
    float* kt = grow(&t_kt, &t_kt_cap, nt * VLANES * hd + hd, sizeof(float));
    float* sc = scores_buf(n * g * ldp);
    if (!kt || !sc) return -1;
    float* row = kt + nt * VLANES * hd;  /* one K row as floats */
    const long* slot = slots_of(table, bs, 0, lo, S);
    if (!slot) return -1;
    for (long kh = 0; kh < nkv; kh++) {
        const char* Kh = (const char*)a->cache + (size_t)kh * a->slots * rb;
        const char* Vh = (const char*)a->cache + (size_t)(nkv + kh) * a->slots * rb;
        for (long t = 0; t < ldp; t++) {  /* the keys across the lanes, zeros past the last */
            float* dst = kt + (t / VLANES) * hd * VLANES + t % VLANES;
            if (t < P) {
                const char* src = Kh + slot[t] * rb;
                if (a->kv16)
                    for (long d = 0; d < hd; d += VLANES) {
                        vf v = ldhf((const uint16_t*)(const void*)src + d);
                        __builtin_memcpy(row + d, &v, sizeof v);
                    }
                else
                    __builtin_memcpy(row, src, hd * sizeof(float));
                for (long d = 0; d < hd; d++) dst[d * VLANES] = row[d];
            } else {
                for (long d = 0; d < hd; d++) dst[d * VLANES] = 0.0f;
            }
        }
        /* query vector m: token m / g, head kh g + m % g; four at a time, over the tiles the last one reads */
        for (long m0 = 0; m0 < n * g; m0 += 4) {
            const int MB = n * g - m0 < 4 ? (int)(n * g - m0) : 4;
            const float* q[4];
            for (int m = 0; m < MB; m++)
                q[m] = a->qkv + a->rows[e0 + (m0 + m) / g] * a->ldq + (kh * g + (m0 + m) % g) * hd;
            long last = (m0 + MB - 1) / g, ntm = (p0 + last + 1 - lo + VLANES - 1) / VLANES;
            ntm += ntm & 1;
            float* s0 = sc + m0 * ldp;
            switch (MB) {
            case 1: scores_tiles(q, 1, hd, kt, ntm, a->scale, s0, ldp); break;
            case 2: scores_tiles(q, 2, hd, kt, ntm, a->scale, s0, ldp); break;
            case 3: scores_tiles(q, 3, hd, kt, ntm, a->scale, s0, ldp); break;
            default: scores_tiles(q, 4, hd, kt, ntm, a->scale, s0, ldp); break;
            }
        }
        for (long r = 0; r < n; r++) {  /* each token: its softmax and values, as attend */
            long Sr = p0 + r + 1, lr = window_lo(Sr, a->window), Pr = Sr - lr;
            float* sr = sc + r * g * ldp + (lr - lo);
            float inv[64];
            if (a->slopes)
                for (long j = 0; j < g; j++) {
                    float m = a->slopes[kh * g + j];
                    for (long t = 0; t < Pr; t++) sr[j * ldp + t] += m * (float)(lr + t - (Sr - 1));
                }
            for (long j0 = 0; j0 < g; j0 += 64) {
                long j1 = j0 + 64 < g ? j0 + 64 : g;
                for (long j = j0; j < j1; j++) inv[j - j0] = softmax_(sr + j * ldp, Pr);
                pv_heads(Vh, hd, j1 - j0, sr + j0 * ldp, ldp, lr, Sr, table, bs, 0, inv,
                         y + r * nh * hd + (kh * g + j0) * hd, a->kv16);
            }
        }
    }
    return 0;
}

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
    long e = a->blk ? a->blk[c] : c;  /* token e, or the block of tokens from it */
    if (a->blk && a->blk[c + 1] - e > 1) return attend_block(a, e, a->blk[c + 1] - e, y);
    long S = a->pos[e] + 1;
    return attend(a->qkv + a->rows[e] * a->ldq, a->cache, a->slots, 0, a->tables + e * a->ldt, a->bs,
                  window_lo(S, a->window), S, a->slopes, a->nh, a->nkv, a->hd, a->scale, y, 0, a->nh, a->kv16);
}

static _Thread_local long* t_blk;
static _Thread_local long t_blk_cap;

/* Decode tokens of B sequences, or the tokens of prefill chunks: token b is row rows[b] of qkv (row stride ldq)
   and of y (stride ldy); it sits at position pos[b] of its sequence and its block table is tables[b * ldt ..]
   (blocks of bs slots). cos_t / sin_t: (positions, hd) rotary tables, or NULL. Every token's rope and KV write
   first, then the attention, shared by the pool's threads: a token a chunk, or a block of QBLOCK tokens of a
   run of PREFILL_MIN_ROWS or more consecutive positions of one sequence (attend_block). window, slopes: as
   wsc_decode_attention_ex (a table's entries before the window are not read); kv16: the cache holds float16.
   Returns 0, or -1 when out of memory (y may be partly written). */
int wsc_decode_attention_batch_ex(float* qkv, long ldq, const long* rows, long B, const long* pos,
                                  const float* cos_t, const float* sin_t, void* cache, long slots,
                                  const long* tables, long ldt, long bs, long nh, long nkv, long hd, float scale,
                                  float* y, long ldy, long window, const float* slopes, int kv16) {
    long smax = 0, sblk = 0, nc = 0;
    long* blk = grow((void**)&t_blk, &t_blk_cap, B + 1, sizeof(long));
    if (!blk) return -1;
    for (long b = 0; b < B; b++) {
        long p = pos[b];
        rope_write(qkv + rows[b] * ldq, cos_t ? cos_t + p * hd : NULL, sin_t ? sin_t + p * hd : NULL, cache, slots,
                   tables[b * ldt + p / bs] * bs + p % bs, nh, nkv, hd, kv16);
        long P = p + 1 - window_lo(p + 1, window);
        smax = P > smax ? P : smax;
    }
    for (long b = 0, e; b < B; b = e) {  /* runs of consecutive positions of one sequence (the same table) */
        for (e = b + 1; e < B && pos[e] == pos[e - 1] + 1 &&
                        !memcmp(tables + e * ldt, tables + b * ldt, (size_t)(pos[e] / bs + 1) * sizeof(long)); e++) {}
        if (e - b < PREFILL_MIN_ROWS) {
            for (long t = b; t < e; t++) blk[nc++] = t;
            continue;
        }
        for (long t = b; t < e; t += QBLOCK) {
            long n = e - t < QBLOCK ? e - t : QBLOCK, P = pos[t] + n - window_lo(pos[t] + 1, window);
            long ldp = ((P + VLANES - 1) / VLANES + 1) / 2 * 2 * VLANES;
            sblk = n * (nh / nkv) * ldp > sblk ? n * (nh / nkv) * ldp : sblk;
            blk[nc++] = t;
        }
    }
    blk[nc] = B;
    attn_t a = {qkv, ldq, rows, pos, cache, slots, tables, ldt, bs, nh, nkv, hd, scale, y, ldy, window, slopes, 0, 0,
                kv16, nc < B ? blk : NULL};
    long ns = atomic_load(&g_use);
    if (ns > nc) ns = nc;
    int idle = 0;
    long nsc = nh / nkv * smax > sblk ? nh / nkv * smax : sblk;
    if (!scores_buf(nsc) || !chunk_buf((nc < B ? QBLOCK : 1) * nh * hd) || (NPARTS > 1 && kv16 && !ktile_buf(16 * hd)))
        return -1;  /* the caller's own, reserved */
    if (ns >= 2 && nc <= MAX_CHUNKS && atomic_compare_exchange_strong(&g_busy, &idle, 1)) {
        job_t j = {NULL, NULL, NULL, NULL, NULL, 0, 0, 0, &a};
        run_pool(&j, 1, nc, ns);
        atomic_store(&g_busy, 0);
        return 0;
    }
    float* buf = chunk_buf((nc < B ? QBLOCK : 1) * nh * hd);
    for (long c = 0; c < nc; c++) {
        if (attend_chunk(&a, c, buf) != 0) return -1;
        for (long e = a.blk ? blk[c] : c; e < (a.blk ? blk[c + 1] : c + 1); e++)
            __builtin_memcpy(y + rows[e] * ldy, buf + (e - (a.blk ? blk[c] : c)) * nh * hd, nh * hd * sizeof(float));
    }
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
