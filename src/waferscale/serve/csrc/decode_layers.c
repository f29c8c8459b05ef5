/* Every layer of a Llama-style block stack for decode tokens in one call: the kernels of the other parts, in the
   order the runner's per-op path calls them, without a Python round trip between them. */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

typedef struct {
    const float *attn_norm, *wqkv, *bqkv, *wo, *bo, *mlp_norm, *wgu, *bgu, *wd, *bd;
    float attn_eps, mlp_eps;
    void* cache;  /* (2 nkv, slots, hd), float32 or (kv16) float16 */
    const int64_t *oqkv, *oo, *ogu, *od;  /* sparse panel offsets of wqkv, wo, wgu, wd (spanels.c); NULL: dense */
    long window;  /* sliding-window attention over the latest `window` positions (0: all) */
    const float* slopes;  /* ALiBi slopes per query head (NULL: none) */
    /* a mixture of experts instead of wgu / wd (n_experts 0: none; single-sequence decode only): the router
       (n_experts outputs, no bias), each expert's fused gate|up and down (no biases), packed; picked: where
       the k experts each token chose are written (in index order) */
    long n_experts, top_k;
    const float* wr;
    const int64_t* orr;
    const float* const* wgu_e;
    const int64_t* const* ogu_e;
    const float* const* wd_e;
    const int64_t* const* od_e;
    long* picked;
    int qqkv, qo, qgu, qd;  /* > 0: wqkv, wo, wgu, wd hold quantized panels of that type (quant.c) */
    int kv16;  /* the cache holds float16 */
} layer_t;

/* a product over one of a layer's matrices: float panels (dense or sparse) or, with qt > 0, quantized ones */
#define LPRODUCT(w, off, qt, ...) \
    qproduct((qt) ? NULL : (w), (off), (qt) ? (const uint8_t*)(w) : NULL, (qt), __VA_ARGS__)

#define MAX_TOP_K 16

/* bytes of a layer matrix's panels (out x in) for hint_next: quantized (qt > 0) or dense float (sparse: 0,
   no hint) */
static inline long lbytes(int qt, const int64_t* off, long out, long in) {
    long np = (out + PANEL - 1) / PANEL;
    return off ? 0 : qt ? qpanel_bytes(qt, in) * np : np * PANEL * in * (long)sizeof(float);
}

/* x (C,) += the mixture of experts of h (C,): the routed experts in index order, each one's output times its
   weight summed into a zeroed out (C,), then added to x: layers.MoE's (and the runner's) arithmetic.
   scratch: E + 2 C + 3 ffn floats. Returns 0, or -1 when out of memory. */
static int moe_row(const layer_t* L, const float* h, float* x, long C, long ffn, float* scratch) {
    float* logits = scratch;
    float* out = logits + L->n_experts;
    float* ye = out + C;
    float* gu = ye + C;
    float* a = gu + 2 * ffn;
    long k = L->top_k, chosen[MAX_TOP_K];
    float w[MAX_TOP_K];
    if (product(L->wr, L->orr, h, NULL, NULL, logits, 1, L->n_experts, C) != 0) return -1;
    wsc_route(logits, 1, L->n_experts, k, chosen, w);
    for (long i = 1; i < k; i++)  /* index order */
        for (long j = i; j > 0 && chosen[j - 1] > chosen[j]; j--) {
            long c = chosen[j]; chosen[j] = chosen[j - 1]; chosen[j - 1] = c;
            float t = w[j]; w[j] = w[j - 1]; w[j - 1] = t;
        }
    for (long i = 0; i < C; i++) out[i] = 0.0f;
    for (long j = 0; j < k; j++) {
        long e = chosen[j];
        L->picked[j] = e;
        if (product(L->wgu_e[e], L->ogu_e[e], h, NULL, NULL, gu, 1, 2 * ffn, C) != 0) return -1;
        wsc_silu_mul(gu, a, 1, ffn);
        if (product(L->wd_e[e], L->od_e[e], a, NULL, NULL, ye, 1, C, ffn) != 0) return -1;
        /* a product, then a sum (two loops: no fused multiply-add, which the runner's torch ops do not do) */
        for (long i = 0; i < C; i++) ye[i] *= w[j];
        for (long i = 0; i < C; i++) out[i] += ye[i];
    }
    for (long i = 0; i < C; i++) x[i] += out[i];
    return 0;
}

/* x (C,) in place through layers[0 .. n); scratch: at least C + (nh + 2 nkv) hd + nh hd + 3 ffn floats, and
   with experts E + 3 C + (nh + 2 nkv) hd + nh hd + 3 ffn. Returns 0, or -1 when out of memory. */
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
        hint_next(L->wo, lbytes(L->qo, L->oo, C, nh * hd));
        LPRODUCT(L->wqkv, L->oqkv, L->qqkv, h, L->bqkv, NULL, qkv, 1, (nh + 2 * nkv) * hd, C);
        if (wsc_decode_attention_ex(qkv, cos, sin_signed, L->cache, slots, slot0, S, nh, nkv, hd, scale, y,
                                    L->window, L->slopes, L->kv16) != 0)
            return -1;
        if (!L->n_experts) hint_next(L->wgu, lbytes(L->qgu, L->ogu, 2 * ffn, C));
        LPRODUCT(L->wo, L->oo, L->qo, y, L->bo, x, x, 1, C, nh * hd);
        wsc_rms_norm(x, L->mlp_norm, L->mlp_eps, h, 1, C);
        if (L->n_experts) {
            if (moe_row(L, h, x, C, ffn, gu) != 0) return -1;
            continue;
        }
        hint_next(L->wd, lbytes(L->qd, L->od, C, ffn));
        LPRODUCT(L->wgu, L->ogu, L->qgu, h, L->bgu, NULL, gu, 1, 2 * ffn, C);
        wsc_silu_mul(gu, a, 1, ffn);
        if (l + 1 < n) hint_next(L[1].wqkv, lbytes(L[1].qqkv, L[1].oqkv, (nh + 2 * nkv) * hd, C));
        LPRODUCT(L->wd, L->od, L->qd, a, L->bd, x, x, 1, C, ffn);
    }
    return 0;
}

/* The same layers (without experts) for decode tokens of R sequences over a block-paged cache: x (R, C) in place; token r sits
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
        if (LPRODUCT(L->wqkv, L->oqkv, L->qqkv, h, L->bqkv, NULL, qkv, R, nq, C) != 0 ||
            wsc_decode_attention_batch_ex(qkv, nq, rows, R, pos, cos_t, sin_t, L->cache, slots, tables, ldt, bs,
                                          nh, nkv, hd, scale, y, nh * hd, L->window, L->slopes, L->kv16) != 0 ||
            LPRODUCT(L->wo, L->oo, L->qo, y, L->bo, x, x, R, C, nh * hd) != 0)
            return -1;
        wsc_rms_norm(x, L->mlp_norm, L->mlp_eps, h, R, C);
        if (LPRODUCT(L->wgu, L->ogu, L->qgu, h, L->bgu, NULL, gu, R, 2 * ffn, C) != 0) return -1;
        wsc_silu_mul(gu, a, R, ffn);
        if (LPRODUCT(L->wd, L->od, L->qd, a, L->bd, x, x, R, C, ffn) != 0) return -1;
    }
    return 0;
}
