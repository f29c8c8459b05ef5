/* The integer path of the quantized products: x rounded to two int8 digits per block of 32, Q8_0 / Q4_0 / Q4_1 /
   Q4_K summed as exact integers with each instruction set's integer dot (quant.c holds the layout, the float
   path and the dispatch, qpanels_into). */
#ifndef WSC_SERVE_KERNELS_TU
#error "part of serve_kernels.c, which includes it: compile that file"
#endif

/* ---- the integer path: x as two int8 digits per block of 32, Q8_0 / Q4_0 / Q4_1 / Q4_K as integers -------
   Block j of a row of x is dx xq + dr xr (quantize_x: dx = max |x| / 127, xq = x / dx rounded half away from
   zero, dr = dx / 254, xr the rest over dr, rounded), and an output's block sum is d dx (sum q xq) + d dr
   (sum q xr) + m sum x (Q4_1: its m; Q4_0: -8 d; Q4_K, per sub-block of 32: d scale_s and -dmin min_s; Q8_0:
   d dr (sum q X), X = 254 xq + xr, one integer for both digits), the integer sums exact (vpdpbusd: four u8 x
   s8 products a lane, 4 k x 16 outputs an instruction; the other paths give the same integers), sum x the
   block's float sum in a fixed order.
   With one digit (llama.cpp's Q8_0 / Q8_1 activations) the perplexity of SmolLM2-135M's Q4_1 file on the
   held-out Shakespeare passage rose 3.1 %; the second digit brings x's rounding to dr / 2 = max |x| / 64516 per
   element (about 16 bits) and the perplexity to that of the float path (-0.002 %), at no measured cost in
   decode speed: it reads the same weight bytes and the weights' unpacking is shared; only the vpdpbusd double.
   It reads them with a fraction of the float path's instructions, which on this 2-core Zen 4 turns a
   compute-bound decode product into a memory-bound one, and prefill ~2.5x faster than the float path (figures:
   bench/serve_quant_kernels.py). Every row is computed alone by the same code. On by default (wsc_qset_int8). */

static _Atomic int g_qint8 = 1;
#define XS 4        /* floats of xs per row and block of 32 (quantize_x) */
#define XB 4        /* bytes of xq per row and element of x: its two int8 digits and their int16 X (quantize_x) */

/* whether products over qt take the integer path (1) or the float path (0) from now on: on != 0 / 0; returns
   the previous setting (on < 0: only returns it) */
int wsc_qset_int8(int on) {
    int was = atomic_load(&g_qint8);
    if (on >= 0) atomic_store(&g_qint8, on != 0);
    return was;
}

static inline int qint8_applies(int qt) {
    return atomic_load(&g_qint8) && (qt == QT_Q8_0 || qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q4_K);
}

/* VLANES floats t rounded half away from zero (|t| < 127.5) to int32, saturated to int8's range (for a t out of
   range: an x of NaN or inf); and VLANES such int32 stored as int8 at q */
static inline __attribute__((always_inline)) vi round_i8(vf t) {
    vf half = (vf)(((vi)t & (int)0x80000000u) | (vi)((vf){0} + 0.5f));  /* 0.5 with t's sign */
    vi qi = __builtin_convertvector(t + half, vi);  /* truncation */
#if WSC_X86 == 512
    return (vi)_mm512_max_epi32(_mm512_min_epi32((__m512i)qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
#elif WSC_X86 == 256
    return (vi)_mm256_max_epi32(_mm256_min_epi32((__m256i)qi, _mm256_set1_epi32(127)), _mm256_set1_epi32(-128));
#elif defined(WSC_NEON)
    return (vi)vmaxq_s32(vminq_s32((int32x4_t)qi, vdupq_n_s32(127)), vdupq_n_s32(-128));
#else
    vi hi = qi > 127, lo = qi < -128;
    return (qi & ~(hi | lo)) | (127 & hi) | (-128 & lo);
#endif
}
static inline __attribute__((always_inline)) void store_i8(int8_t* q, vi v) {
#if WSC_X86 == 512
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8((__m512i)v));
#elif WSC_X86 == 256
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    _mm_storel_epi64((__m128i*)q, _mm_packs_epi16(w, w));
#elif defined(WSC_NEON)
    int16x4_t w = vqmovn_s32((int32x4_t)v);
    vst1_lane_s32((int32_t*)(void*)q, vreinterpret_s32_s8(vqmovn_s16(vcombine_s16(w, w))), 0);
#else
    for (int c = 0; c < VLANES; c++) q[c] = (int8_t)v[c];
#endif
}

/* VLANES int32 (|v| < 2^15) stored as int16 at q */
static inline __attribute__((always_inline)) void store_i16(int16_t* q, vi v) {
#if WSC_X86 == 512
    _mm256_storeu_si256((__m256i*)q, _mm512_cvtsepi32_epi16((__m512i)v));
#elif WSC_X86 == 256
    __m128i lo = _mm256_castsi256_si128((__m256i)v), hi = _mm256_extracti128_si256((__m256i)v, 1);
    _mm_storeu_si128((__m128i*)q, _mm_packs_epi32(lo, hi));
#elif defined(WSC_NEON)
    vst1_s16(q, vqmovn_s32((int32x4_t)v));
#else
    for (int c = 0; c < VLANES; c++) q[c] = (int16_t)v[c];
#endif
}

/* the largest and the sum of VLANES int32 lanes (integers: the order does not matter) */
static inline __attribute__((always_inline)) int hmaxi(vi v) {
#if WSC_X86 == 512
    return _mm512_reduce_max_epi32((__m512i)v);
#elif WSC_X86 == 256
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    return _mm_cvtsi128_si32(_mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
#elif defined(WSC_NEON)
    return vmaxvq_s32((int32x4_t)v);
#else
    int m = v[0];
    for (int c = 1; c < VLANES; c++) m = v[c] > m ? v[c] : m;
    return m;
#endif
}
static inline __attribute__((always_inline)) int hsumi(vi v) {
#if WSC_X86 == 512
    return _mm512_reduce_add_epi32((__m512i)v);
#elif WSC_X86 == 256
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
#elif defined(WSC_NEON)
    return vaddvq_s32((int32x4_t)v);
#else
    int s = 0;
    for (int c = 0; c < VLANES; c++) s += v[c];
    return s;
#endif
}

/* x (rows, in) -> per row its two int8 digits xq, xr, then both as one int16 X = 254 xq + xr (XB in bytes a row:
   in of xq, in of xr, 2 in of X), and xs (rows, in / 32, XS): each block's dx, dr, sum of x (the sum in a fixed
   order: lanes pairwise, then hsum16), and the sum of its X (Q8_0's correction, q8_part). xq = x / dx rounded
   half away from zero, dx = max |x| / 127 (over the non-NaN x; 0 if none); xr = (x - dx xq) / dr rounded, dr =
   dx / 254 (|x - dx xq| <= dx / 2, so |xr| <= 127); digits saturated to int8 (an x of NaN or inf) before they
   are combined and summed, so |X| <= 254 128 + 128 < 2^15. x = dr X to within dr / 2. */
static void quantize_x(const float* x, long rows, long in, int8_t* xq, float* xs) {
    long nb = in / 32;
    for (long r = 0; r < rows; r++)
        for (long j = 0; j < nb; j++) {
            const float* v = x + r * in + 32 * j;
            vf xv[32 / VLANES];
            vi mx = {0};
            for (int i = 0; i < 32 / VLANES; i++) {
                __builtin_memcpy(&xv[i], v + VLANES * i, sizeof xv[i]);
                vi ab = (vi)xv[i] & 0x7FFFFFFF;
                ab &= ab <= 0x7F800000;  /* |x| as its bits (which order as the values), NaN as 0 */
#if WSC_X86 == 512
                mx = (vi)_mm512_max_epi32((__m512i)mx, (__m512i)ab);
#elif WSC_X86 == 256
                mx = (vi)_mm256_max_epi32((__m256i)mx, (__m256i)ab);
#elif defined(WSC_NEON)
                mx = (vi)vmaxq_s32((int32x4_t)mx, (int32x4_t)ab);
#else
                mx = (mx & (mx >= ab)) | (ab & (mx < ab));
#endif
            }
            int mb = hmaxi(mx);
            float amax;
            __builtin_memcpy(&amax, &mb, 4);
            float dx = amax / 127, id = dx > 0 ? 1 / dx : 0, dr = dx / 254, idr = dr > 0 ? 1 / dr : 0;
            int8_t *q = xq + XB * r * in + 32 * j, *qr = q + in;
            int16_t* qx = (int16_t*)(void*)(xq + XB * r * in + 2 * in) + 32 * j;
            vi sx = {0};
            for (int i = 0; i < 32 / VLANES; i++) {
                vi qi = round_i8(xv[i] * id);
                vi ri = round_i8((xv[i] - __builtin_convertvector(qi, vf) * dx) * idr);
                store_i8(q + VLANES * i, qi);
                store_i8(qr + VLANES * i, ri);
                store_i16(qx + VLANES * i, 254 * qi + ri);
                sx += 254 * qi + ri;
            }
            float* s = xs + XS * (r * nb + j);
            s[0] = dx;
            s[1] = dr;
            s[2] = hsum16(ld16(v) + ld16(v + 16));
            s[3] = (float)hsumi(sx);  /* (|sum| <= 32 2^15: exact in float) */
        }
}

/* the four bytes at x in every lane (a 32-bit load of its own, broadcast from memory: a wider load split in
   registers costs each broadcast two more vector uops) */
static inline vi bcast4(const int8_t* x) {
    int32_t b;
    __builtin_memcpy(&b, x, 4);
    return (vi){0} + b;
}

/* The integer dots of each path. Each output's block sum is an exact integer on every path (the same as the
   portable code's), however it is reached:
   - the dot-product instructions (AVX-512 VNNI and AVX-VNNI's vpdpbusd, ARM's usdot with i8mm or sdot) add per
     lane the four u8 bytes of the weights times the four s8 bytes of x (x: the same four in every lane);
   - AVX2 and AVX-512 without VNNI have vpmaddubsw, which sums u8 x s8 pairs into 16 bits (saturating): their
     sums stay in 16-bit lanes, where they cannot overflow, for as many steps as the bounds below allow, then one
     vpmaddwd widens them. A Q4 nibble (< 16) times x (|x| <= 128): a pair < 2^12, two nibbles' pairs < 2^13,
     four such steps < 2^15. (Q8_0 there takes vpmaddwd on 16-bit words: q8_part.)
   - plain NEON widens to 16-bit products (each < 2^15) and adds pairs.
   p7: the sums over Q4 nibbles (q4dot: lo nibbles against x0, hi nibbles against x1), p7sum after at most four
   q4dot. */
#if WSC_X86 == 512
#define MADDUBS(a, b) _mm512_maddubs_epi16((__m512i)(a), (__m512i)(b))
#define MADD(a, k) (vi)_mm512_madd_epi16((a), _mm512_set1_epi16(k))
#define ADD16(a, b) _mm512_add_epi16((a), (b))
typedef __m512i v16x;
#elif WSC_X86 == 256
#define MADDUBS(a, b) _mm256_maddubs_epi16((__m256i)(a), (__m256i)(b))
#define MADD(a, k) (vi)_mm256_madd_epi16((a), _mm256_set1_epi16(k))
#define ADD16(a, b) _mm256_add_epi16((a), (b))
typedef __m256i v16x;
#endif
#if (WSC_X86 == 512 && defined(__AVX512VNNI__)) || (WSC_X86 == 256 && defined(__AVXVNNI__))
#define DPBUSD 1
#endif

#if defined(WSC_X86) && !defined(DPBUSD)
/* each step's sum, as it is: integer sums are associative, and GCC otherwise reorders the adds of a whole block
   into a tree whose products wait in more registers than AVX2 has (spilled to the stack: ~2x slower) */
#define KEEP(v) __asm__("" : "+x"(v))
#define PAIRS16 1  /* Q4 sums held in 16 bits (vpmaddubsw), widened by p7sum */
typedef v16x p7_t;
#else
typedef vi p7_t;
#endif

#if defined(WSC_NEON) && !defined(__ARM_FEATURE_MATMUL_INT8) && !defined(__ARM_FEATURE_DOTPROD)
static inline vi neon_dp(vi acc, vi a, vi b) {  /* widened: each u8 x s8 product fits 16 bits */
    int16x8_t bl = vmovl_s8(vget_low_s8((int8x16_t)b)), bh = vmovl_high_s8((int8x16_t)b);
    int16x8_t al = (int16x8_t)vmovl_u8(vget_low_u8((uint8x16_t)a)), ah = (int16x8_t)vmovl_high_u8((uint8x16_t)a);
    return acc + (vi)vpaddq_s32(vpaddlq_s16(vmulq_s16(al, bl)), vpaddlq_s16(vmulq_s16(ah, bh)));
}
#endif

/* acc + per lane the sum of its four u8 bytes of a times the four s8 bytes of b (b: the same in every lane) */
static inline __attribute__((always_inline)) vi dp(vi acc, vi a, vi b) {
#if defined(DPBUSD) && WSC_X86 == 512
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif defined(DPBUSD)
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)a, (__m256i)b);
#elif defined(WSC_NEON) && defined(__ARM_FEATURE_MATMUL_INT8)
    return (vi)vusdotq_s32((int32x4_t)acc, (uint8x16_t)a, (int8x16_t)b);
#elif defined(WSC_NEON) && defined(__ARM_FEATURE_DOTPROD)  /* a = (a - 128) + 128, both signed dots */
    int32x4_t sb = vdotq_s32(vdupq_n_s32(0), vdupq_n_s8(1), (int8x16_t)b);
    return (vi)vdotq_s32((int32x4_t)acc, (int8x16_t)(a ^ (int)0x80808080u), (int8x16_t)b) + ((vi)sb << 7);
#elif defined(WSC_NEON)
    return neon_dp(acc, a, b);
#else
    for (int t = 0; t < 4; t++) acc += (vi)((vu)a >> (8 * t) & 255) * (int8_t)(b[0] >> (8 * t));
    return acc;
#endif
}

static inline __attribute__((always_inline)) p7_t p7zero(void) { return (p7_t){0}; }
/* acc + lo's bytes (< 16) times x0's + hi's times x1's */
static inline __attribute__((always_inline)) p7_t q4dot(p7_t acc, vi lo, vi x0, vi hi, vi x1) {
#ifdef PAIRS16
    acc = ADD16(acc, ADD16(MADDUBS(lo, x0), MADDUBS(hi, x1)));
    KEEP(acc);
    return acc;
#elif defined(WSC_NEON) && defined(__ARM_FEATURE_DOTPROD) && !defined(__ARM_FEATURE_MATMUL_INT8)
    return (vi)vdotq_s32(vdotq_s32((int32x4_t)acc, (int8x16_t)lo, (int8x16_t)x0), (int8x16_t)hi, (int8x16_t)x1);
#else
    return dp(dp(acc, lo, x0), hi, x1);
#endif
}
static inline __attribute__((always_inline)) vi p7sum(p7_t acc) {
#ifdef PAIRS16
    return MADD(acc, 1);
#else
    return acc;
#endif
}


/* The integer path runs NP panels x MR rows at once (NP MR <= 4: one decode row against a group of panels, or
   up to four rows against one panel), block by block. A panel's 16 outputs go in NPARTS parts of VLANES lanes (one
   native register), one after the other within each block, and the sums are kept in parts too: a[i NPARTS + h] is
   part h of the sums of i = p MR + r. Within a part, a chunk of the NP x MR products at a time (as many as the
   path's registers hold: each weight group is loaded and unpacked once for their rows, each row's x words
   broadcast once for their panels): Q4 4, but 2 on AVX2's 16-bit pairs (16 registers: 8 sums, 4 unpacked
   nibble vectors, 4 x words a row). Q8_0 the same for panels, 4 rows everywhere: on AVX2 4 rows against 2
   1.10-1.15x (8192 x 576, 2 threads, 16 and 64 rows), where 4 panels against 2 made single-stream decode slower
   (0.93x, bench/serve_kernels_ab.py, 8 rounds) though one product alone was faster. */
#ifdef PAIRS16
#define Q4CHUNK 2
#else
#define Q4CHUNK 4
#endif
#define Q8CHUNK(NP) (NP > 1 ? Q4CHUNK : 4)
/* x's words are broadcast again in each part and chunk: a pointer the compiler cannot see through keeps it
   from holding every broadcast of a block in registers it does not have (AVX2: spilled to the stack) */
#define OPAQUE(ptr) __asm__("" : "+r"(ptr))
#define FOR_CHUNK(NP, MR, C) for (int c0 = 0; c0 < (NP > 1 ? NP : MR); c0 += C)
#define CP(NP, C) (NP > 1 ? C : 1)          /* panels of a chunk of C */
#define CR(NP, MR, C) (NP > 1 ? MR : C < MR ? C : MR)  /* rows of a chunk of C */

/* Q8_0, part h of block j of NP panels (blk[p]) against MR rows of xq (XB in bytes a row, ldq apart) into a (rows
   MRA apart): an output's block sum is d dr (sum q X), with X = 254 xq + xr (quantize_x), the integer exact on
   every path. The panels hold q + 128 (vpdpbusd takes one side unsigned), so 128 times the block's sum of X (xs)
   comes off, in integers. */
#ifdef PAIRS16
/* x86 without a u8 x s8 dot (AVX2, AVX-512 without VNNI): vpmaddwd of the weights widened to 16 bits and X, two k a
   lane: a lane's four bytes (one output's four k) widen into two lanes, each of which adds the products of two
   k; the two lanes of an output are added at the end of the block (pairsum). The sums are exact: per lane 8
   steps of two products, 2 x 8 x 255 x 2^15 < 2^27, an output's two lanes < 2^28. This reads the weights once
   for both digits: on AVX2 4 vector operations per 32 weight bytes and row (2 vpmaddwd, 2 adds), where u8 x s8
   pairs in 16 bits (vpmaddubsw, as the Q4 kernels), with q + 128 up to 255, needed each byte split into its
   two nibbles, for each digit: 8. */
#if WSC_X86 == 512
#define WIDEN16(p) (vi)_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(const void*)(p)))
#define BCAST4X16(p) (vi)_mm512_set1_epi64(*(const long long*)(const void*)(p))
#define MADDW(w, x) (vi)_mm512_madd_epi16((__m512i)(w), (__m512i)(x))
/* lanes (2c, 2c + 1) of lo, then of hi, added: output c of the part */
static inline __attribute__((always_inline)) vi pairsum(vi lo, vi hi) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return (vi)_mm512_permutex2var_epi32((__m512i)lo, ev, (__m512i)hi) +
           (vi)_mm512_permutex2var_epi32((__m512i)lo, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), (__m512i)hi);
}
#else
#define WIDEN16(p) (vi)_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(const void*)(p)))
#define BCAST4X16(p) (vi)_mm256_set1_epi64x(*(const long long*)(const void*)(p))
#define MADDW(w, x) (vi)_mm256_madd_epi16((__m256i)(w), (__m256i)(x))
static inline __attribute__((always_inline)) vi pairsum(vi lo, vi hi) {  /* (hadd pairs within 128-bit halves) */
    return (vi)_mm256_permute4x64_epi64(_mm256_hadd_epi32((__m256i)lo, (__m256i)hi), 0xD8);
}
#endif
AI void q8_part(const uint8_t* const* blk, long j, long in, const int8_t* xq, const float* xs, long ldq, long nb,
                vf* a, int MRA, const int h, const int NP, const int MR) {
    OPAQUE(xq);
    vi lo[4], hi[4];
    for (int i = 0; i < NP * MR; i++) lo[i] = hi[i] = (vi){0};
    for (int g = 0; g < 8; g++) {
        vi xb[4];
        for (int r = 0; r < MR; r++) xb[r] = BCAST4X16(xq + r * ldq + 2 * in + 2 * (32 * j + 4 * g));
        FOR_P {
            const uint8_t* L = blk[p] + 32 + 64 * g + 4 * VLANES * h;
            vi w0 = WIDEN16(L), w1 = WIDEN16(L + 2 * VLANES);
            for (int r = 0; r < MR; r++) {
                lo[p * MR + r] += MADDW(w0, xb[r]);
                hi[p * MR + r] += MADDW(w1, xb[r]);
                if (MR > 1) { KEEP(lo[p * MR + r]); KEEP(hi[p * MR + r]); }
            }
        }
    }
    FOR_P {
        vf d = ldhf(blk[p] + 2 * VLANES * h);
        for (int r = 0; r < MR; r++) {
            const float* s = xs + XS * (r * nb + j);
            int i = p * MR + r;
            vi q = pairsum(lo[i], hi[i]) - 128 * (int)s[3];
            a[(p * MRA + r) * NPARTS + h] += __builtin_convertvector(q, vf) * (d * s[1]);
        }
    }
}
#else
/* the dot-product instructions (and the portable code): the sums of q + 128 times each digit, combined */
AI void q8_part(const uint8_t* const* blk, long j, long in, const int8_t* xq, const float* xs, long ldq, long nb,
                vf* a, int MRA, const int h, const int NP, const int MR) {
    OPAQUE(xq);
    vi pq[4], pr[4];  /* (per lane 8 x 4 products of 255 x 128: < 2^21) */
    for (int i = 0; i < NP * MR; i++) pq[i] = pr[i] = (vi){0};
    for (int g = 0; g < 8; g++) {
        vi xb[4][2];
        for (int r = 0; r < MR; r++) {
            xb[r][0] = bcast4(xq + r * ldq + 32 * j + 4 * g);
            xb[r][1] = bcast4(xq + r * ldq + in + 32 * j + 4 * g);
        }
        FOR_P {
            vi L;
            __builtin_memcpy(&L, blk[p] + 32 + 64 * g + 4 * VLANES * h, sizeof L);
            for (int r = 0; r < MR; r++) {
                pq[p * MR + r] = dp(pq[p * MR + r], L, xb[r][0]);
                pr[p * MR + r] = dp(pr[p * MR + r], L, xb[r][1]);
            }
        }
    }
    FOR_P {
        vf d = ldhf(blk[p] + 2 * VLANES * h);
        for (int r = 0; r < MR; r++) {
            const float* s = xs + XS * (r * nb + j);
            int i = p * MR + r;
            vi q = 254 * pq[i] + pr[i] - 128 * (int)s[3];  /* (< 2^29) */
            a[(p * MRA + r) * NPARTS + h] += __builtin_convertvector(q, vf) * (d * s[1]);
        }
    }
}
#endif

/* MR rows of xq against NP panels of Q8_0: a[(p MR + r) NPARTS + h] += their block sums */
AI void i8_q8(const uint8_t* w, long ps, long bs, long in, const int8_t* xq, const float* xs, long ldq, vf* a,
              const int NP, const int MR) {
    const long nb = in / 32;
    for (long j = 0; j < nb; j++) {
        const uint8_t* blk[QNP];
        FOR_P { blk[p] = w + p * ps + j * bs; prefetch_block(blk[p], 544, MR == 1); }
        for (int h = 0; h < NPARTS; h++)
            FOR_CHUNK(NP, MR, Q8CHUNK(NP)) {
                int p0 = NP > 1 ? c0 : 0, r0 = NP > 1 ? 0 : c0;
                q8_part(blk + p0, j, in, xq + r0 * ldq, xs + XS * r0 * nb, ldq, nb, a + (p0 * MR + r0) * NPARTS, MR, h,
                        CP(NP, Q8CHUNK(NP)), CR(NP, MR, Q8CHUNK(NP)));
            }
    }
}

/* part h of one sub-block of 32 k of NP panels (q[p]: its 4 groups of 8 k, Q4_1's layout; d[p], m[p] part h of
   its scales) against MR rows into a (rows MRA apart): d dx (sum q xq) + d dr (sum q xr) + m sum x (xs: each
   row's dx, dr, sum x of this block, XS nb floats apart) */
AI void q4_part(const uint8_t* const* q, const vf* d, const vf* m, const int8_t* xq, long ldq, long in,
                const float* xs, long nb, vf* a, int MRA, const int h, const int NP, const int MR) {
    OPAQUE(xq);
    p7_t pq[Q4CHUNK], pr[Q4CHUNK];  /* (four q4dot each: p7sum's bound) */
    for (int i = 0; i < NP * MR; i++) pq[i] = pr[i] = p7zero();
    for (int g = 0; g < 4; g++) {
        vi xb[Q4CHUNK][4];
        for (int r = 0; r < MR; r++) {
            const int8_t* x = xq + r * ldq + 8 * g;
            xb[r][0] = bcast4(x), xb[r][1] = bcast4(x + 4), xb[r][2] = bcast4(x + in), xb[r][3] = bcast4(x + in + 4);
        }
        FOR_P {
            vi L;
            __builtin_memcpy(&L, q[p] + 64 * g + 4 * VLANES * h, sizeof L);
            vi lo = L & 0x0F0F0F0F, hi = (vi)((vu)L >> 4) & 0x0F0F0F0F;
            for (int r = 0; r < MR; r++) {
                int i = p * MR + r;
                pq[i] = q4dot(pq[i], lo, xb[r][0], hi, xb[r][1]);
                pr[i] = q4dot(pr[i], lo, xb[r][2], hi, xb[r][3]);
            }
        }
    }
    FOR_P for (int r = 0; r < MR; r++) {
        const float* s = xs + XS * r * nb;
        int i = p * MR + r;
        vf* t = &a[(p * MRA + r) * NPARTS + h];
        *t += __builtin_convertvector(p7sum(pq[i]), vf) * (d[p] * s[0]);
        *t += __builtin_convertvector(p7sum(pr[i]), vf) * (d[p] * s[1]);
        *t += m[p] * s[2];
    }
}

/* MR rows of xq (two digits, ldq apart) against NP panels of Q4_0 / Q4_1 (has_m) / Q4_K (kq): a[(p MR + r) NPARTS +
   h] += their block sums. The scales as q4_k_scales and gemv_q4 compute them, part by part. */
AI void i8_q4(const uint8_t* w, long ps, long bs, long in, const int8_t* xq, const float* xs, long ldq, vf* a,
              const int NP, const int MR, const int has_m, const int kq) {
    const int bb = has_m ? 320 : 288, qo = has_m ? 64 : 32;
    const long nb = in / 32;
    for (long j = 0; j < nb / (kq ? 8 : 1); j++) {
        const uint8_t* blk[QNP];
        for (int s = 0; s < (kq ? 8 : 1); s++) {  /* Q4_K's eight sub-blocks of 32 k, or the one block */
            const uint8_t* q[QNP];
            vf d[QNP], m[QNP];
            FOR_P {
                blk[p] = w + p * ps + j * bs;
                q[p] = kq ? blk[p] + 320 + 256 * s : blk[p] + qo;
                if (kq) prefetch_block(q[p], 256, MR == 1);
                else prefetch_block(blk[p], bb, MR == 1);
            }
            for (int h = 0; h < NPARTS; h++) {
                FOR_P {
                    if (kq) {
                        q4_k_scales(blk[p], s, h, &d[p], &m[p]);
                    } else {
                        d[p] = ldhf(blk[p] + 2 * VLANES * h);
                        m[p] = has_m ? ldhf(blk[p] + 32 + 2 * VLANES * h) : d[p] * -8.0f;
                    }
                }
                long k0 = kq ? 256 * j + 32 * s : 32 * j, b0 = kq ? 8 * j + s : j;
                FOR_CHUNK(NP, MR, Q4CHUNK) {
                    int p0 = NP > 1 ? c0 : 0, r0 = NP > 1 ? 0 : c0;
                    q4_part(q + p0, d + p0, m + p0, xq + r0 * ldq + k0, ldq, in, xs + XS * (r0 * nb + b0), nb,
                            a + (p0 * MR + r0) * NPARTS, MR, h, CP(NP, Q4CHUNK), CR(NP, MR, Q4CHUNK));
                }
            }
        }
    }
}

/* Several rows go in blocks of RB (their x digits, XB in bytes a row, stay in L2 while every panel of the chunk
   runs over them, instead of all the rows streaming once per panel). Measured on AVX2 (2 threads, 512 rows, one
   run each): Q8_0 3072 x 576 12.4 -> 11.7 ms, 576 x 1536 7.0 -> 6.9 ms; Q4_1 576 x 1536 6.2 -> 6.1 ms. */
#ifndef RB
#define RB 64
#endif

/* panels [p0, p1) of a job on the integer path, into dst as qpanels_into */
static void i8_panels_into(const job_t* j, long p0, long p1, float* dst, long ldd) {
    long in = j->in, out = j->out, np = (out + PANEL - 1) / PANEL, nb = in / 32, bb = QPAN[j->qt] * PANEL, bs;
    int has_m = j->qt == QT_Q4_1, q8 = j->qt == QT_Q8_0, kq = j->qt == QT_Q4_K;
    for (long rb = 0; rb < j->rows; rb += RB)
    for (long p = p0; p < p1;) {
        const uint8_t* w = qpanel_at(j->qw, j->qt, in, np, p, &bs);
        int NP = j->rows == 1 && p % QNP == 0 && p1 - p >= QNP ? QNP : 1;
        long re = rb + RB < j->rows ? rb + RB : j->rows;
        for (long r0 = rb, MR; r0 < re; r0 += MR) {
            MR = re - r0 >= 4 ? 4 : re - r0 >= 2 ? 2 : 1;
            vf a[QNP * 4 * NPARTS] = {{0}};
            const int8_t* xq = j->xq + XB * r0 * in;
            const float* xs = j->xs + XS * r0 * nb;
#define I8(np, mr) do { if (q8) i8_q8(w, bb, bs, in, xq, xs, XB * in, a, np, mr); \
                         else if (kq) i8_q4(w, bb, bs, in, xq, xs, XB * in, a, np, mr, 0, 1); \
                         else if (has_m) i8_q4(w, bb, bs, in, xq, xs, XB * in, a, np, mr, 1, 0); \
                         else i8_q4(w, bb, bs, in, xq, xs, XB * in, a, np, mr, 0, 0); } while (0)
            if (NP == QNP) I8(QNP, 1);
            else if (MR == 4) I8(1, 4);
            else if (MR == 2) I8(1, 2);
            else I8(1, 1);
#undef I8
            for (int q = 0; q < NP; q++)
                for (int r = 0; r < MR; r++) {
                    long o = (p + q) * PANEL, row = r0 + r;
                    int nc = out - o < PANEL ? (int)(out - o) : PANEL;
                    store_row(join(&a[(q * MR + r) * NPARTS]), dst + row * ldd + (o - p0 * PANEL), nc, j->b ? j->b + o : NULL,
                              j->res ? j->res + row * out + o : NULL);
                }
        }
        p += NP;
    }
}
