/* Row-wise kernels: SwiGLU, argmax (greedy sampling), RMSNorm, a mixture of experts' routing. */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* out[r, i] = silu(gu[r, i]) * gu[r, n + i]: SwiGLU over a fused gate|up row of 2n. */
void wsc_silu_mul(const float* gu, float* out, long rows, long n) {
    for (long r = 0; r < rows; r++) {
        const float* g = gu + (size_t)r * 2 * n;
        const float* u = g + n;
        float* o = out + (size_t)r * n;
        long i = 0;
        for (; i + VLANES <= n; i += VLANES) {  /* (native registers: see vexp) */
            vf x = ldf(g + i);
            vi neg = x < 0.0f;
            vf ax = (vf)((vi)x & ~(vi)splatf(-0.0f));                 /* |x| */
            vf e = vexpf(-ax);                                        /* exp(-|x|) in (0, 1] */
            vf num = (vf)(((vi)splatf(1.0f) & ~neg) | ((vi)e & neg));  /* x >= 0: 1, else e */
            vf y = x * (num / (1.0f + e)) * ldf(u + i);
            __builtin_memcpy(o + i, &y, sizeof y);
        }
        for (; i < n; i++) {
            float x = g[i];
            float e = vexpf(splatf(-fabsf(x)))[0];
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
    if (n >= 32 && n < (1L << 31)) {  /* per lane of 16: its first maximum and where (native registers: vexp) */
        vi lane, at[NPARTS], nanv[NPARTS];
        vf m[NPARTS];
        for (int k = 0; k < VLANES; k++) lane[k] = k;
        for (int h = 0; h < NPARTS; h++) {
            m[h] = ldf(x + h * VLANES);
            at[h] = lane + h * VLANES;
            nanv[h] = m[h] != m[h];
        }
        for (i = 16; i + 16 <= n; i += 16)
            for (int h = 0; h < NPARTS; h++) {
                vf v = ldf(x + i + h * VLANES);
                nanv[h] |= v != v;
                vi gt = v > m[h];
                m[h] = (vf)(((vi)v & gt) | ((vi)m[h] & ~gt));
                at[h] = ((lane + (int)(i + h * VLANES)) & gt) | (at[h] & ~gt);
            }
        best = m[0][0]; where = at[0][0];
        for (int h = 0; h < NPARTS; h++)
            for (int k = 0; k < VLANES; k++) {
                nan |= nanv[h][k];
                if (m[h][k] > best || (m[h][k] == best && at[h][k] < where)) { best = m[h][k]; where = at[h][k]; }
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

/* A mixture of experts' routing of rows rows of router logits (E each): the softmax (max subtracted, expf,
   float32), its k largest probabilities (the first of equal ones first, largest first, as torch.topk) and these
   renormalized by their sum: chosen[r * k ..], w[r * k ..]. */
void wsc_route(const float* logits, long rows, long E, long k, long* chosen, float* w) {
    for (long r = 0; r < rows; r++) {
        const float* l = logits + r * E;
        long* c = chosen + r * k;
        float* p = w + r * k;
        float m = l[0], sum = 0.0f;
        for (long e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
        for (long e = 0; e < E; e++) sum += expf(l[e] - m);
        for (long j = 0; j < k; j++) {  /* selection: k is small */
            long best = -1;
            for (long e = 0; e < E; e++) {
                int taken = 0;
                for (long i = 0; i < j; i++) taken |= c[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            c[j] = best;
            p[j] = expf(l[best] - m) / sum;
        }
        float s = 0.0f;
        for (long j = 0; j < k; j++) s += p[j];
        for (long j = 0; j < k; j++) p[j] /= s;
    }
}
