/* Attention over hybrid_fp16_int4's packed blocks, for one sequence and one layer.
 *
 * Built and loaded by kvstrategies/kernels.py (gcc -O3 -march=native -fopenmp); the pure PyTorch
 * path in kvstrategies/hybrid.py computes the same thing and is what the tests compare against.
 *
 * One pool block holds, per KV head, one record of `rec` bytes (offsets in `off`, channels in
 * the calibrated order: nf fp16 channels, nm main-width channels, nl low-width channels; keys
 * and values each have their own three counts):
 *   kfp  f16 [nf][T]       key fp16 channels
 *   vfp  f16 [nf][T]       value fp16 channels
 *   ksc  f16 [2][nm+nl]    key scale and low, per channel of the block
 *   vsc  f16 [2*cls][T]    value scale, low per token: main class, then low class (cls of
 *                          them present: a class with no channels has no rows)
 *   km   u8  [nm][T*b/8]   key codes
 *   kl   u8  [nl][T*lb/8]
 *   vm   u8  [nm][T*b/8]   value codes
 *   vl   u8  [nl][T*lb/8]
 * Everything is channel-major, codes packed along the block's tokens (keys are quantized per
 * channel, values per token, but both are read one channel row at a time).
 * A value is code * scale + low. Split order: byte j of a run of m bytes holds elements
 * j, j + m, j + 2m, ... so one shift unpacks a contiguous run.
 *
 * Scores fold the key scales into the query (q.k = sum_c (q_c s_c) code_c + sum_c q_c low_c) and
 * outputs the value scales into the weights (packed_block), so each code is only converted to a
 * float, once per block, and reused by every query row of the KV head. The softmax
 * is computed online (flash-decoding): work items are (head, chunk of blocks) plus (head, dense
 * tokens); each keeps a running max, sum and accumulator, merged at the end.
 *
 * A latent (MLA) cache (-DKLAT=1) stores keys only (no value fields): the value rows are the
 * key rows, the output has all D channels in key order, and `out_raw` keeps the KDV channels
 * whose model index is below KDV (the latent part, the keys' first channels).
 *
 * The dense tokens are those not in a packed block: `na` fp16 tokens every row sees (the sinks
 * and the block being filled) and `tq` float tokens of the current step (causal: row r, step
 * token r % tq, sees current tokens 0..r % tq).
 */
#include <math.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 8 /* packed blocks per work item */

/* kernels.py compiles one library per record shape (-DKT=64 -DKD=64 -DKNF=4 ...): the block
 * size, head dim, class sizes and widths are then constants, and the hot loops below run on
 * registers of 16 floats with no remainder handling. */
#if !defined(KT) || !defined(KD) || !defined(KNF) || !defined(KNM) || !defined(KNL) || \
    !defined(KVF) || !defined(KVM) || !defined(KVL) || !defined(KB) || !defined(KLB)
#error "compile with -DKT= -DKD= -DKNF= -DKNM= -DKNL= -DKVF= -DKVM= -DKVL= -DKB= -DKLB="
#endif
#if KT % 16 || KD % 16
#error "KT and KD must be multiples of 16"
#endif
#ifndef KSF
#define KSF 0 /* group headers: 0 = fp16 scale + fp16 low, 1 = fp8 (e4m3) scale + int8 zero */
#endif
#define HB (KSF ? 1 : 2) /* bytes of one header entry */
#ifndef KLAT
#define KLAT 0 /* 1: a latent cache, values are the keys */
#endif
#ifndef KDV
#define KDV KD /* channels of the output in the model's layout */
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));

/* Sum and max of the 16 lanes as a tree (a plain loop would add them one after another). */
#if defined(__clang__)
#define SHUF(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUF(v, ...) __builtin_shuffle(v, (v16i){__VA_ARGS__})
#endif
static inline float hsum16(v16 v) {
    v += SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUF(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}
static inline v16 vmax(v16 a, v16 b) {
    const v16i gt = a > b; /* lanes of all ones where a > b */
    return (v16)(((v16i)a & gt) | ((v16i)b & ~gt));
}
static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline float hmax16(v16 v) {
    v = vmax(v, SHUF(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, SHUF(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, SHUF(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, SHUF(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}
/* Query rows per register block: the query heads of one KV head (decode: one row each). */
#if defined(KG) && KG >= 1 && KG <= 8
#define RB KG
#else
#define RB 4
#endif

enum { OFF_KFP, OFF_VFP, OFF_KSC, OFF_VSC, OFF_KM, OFF_KL, OFF_VM, OFF_VL };

/* Codes to floats, one function per width so that the shifts are constants and the loops
 * vectorize. */
static inline void unpack(const uint8_t *restrict p, int n, int bits, float *restrict out) {
    if (bits == 4) {
        const int m = n / 2;
        for (int j = 0; j < m; j++) {
            out[j] = (float)(p[j] & 15);
            out[j + m] = (float)(p[j] >> 4);
        }
    } else if (bits == 2) {
        const int m = n / 4;
        for (int j = 0; j < m; j++) {
            out[j] = (float)(p[j] & 3);
            out[j + m] = (float)((p[j] >> 2) & 3);
            out[j + 2 * m] = (float)((p[j] >> 4) & 3);
            out[j + 3 * m] = (float)(p[j] >> 6);
        }
    } else {
        for (int j = 0; j < n; j++) out[j] = (float)p[j];
    }
}

/* The packed blocks' arithmetic runs on vectors of the instruction set's width (VW floats:
 * AVX-512 16, AVX 8, otherwise 4), so that its accumulators stay in registers: written on
 * 16-float vectors, an AVX2 build spilled them to the stack at every channel. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint8_t vb __attribute__((vector_size(VW)));
/* Vectors per block row; per tile of the scores, whose RB x TV accumulators, TV codes and RB
 * weights then fit the 16 (AVX-512: 32) vector registers. */
enum { NV = KT / VW, TV = NV < (VW == 16 ? 4 : 2) ? NV : (VW == 16 ? 4 : 2) };

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline float hsumv(vf v) {
    float x = 0.0f;
    for (int i = 0; i < VW; i++) x += v[i];
    return x;
}

/* VW fp16 values as floats. */
static inline vf h2f_v(const _Float16 *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VW == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* fp16 to float (exact either way): VW at a time by `h2f_v` (the vector conversion where there
 * is one). Why: the scalar loop converted one value at a time (a 16-bit insert, a convert, a
 * store), and the fp16 side buffer a 64-token block leaves (up to 63 tokens a head, both K and
 * V) is converted at every layer of every decode step. */
static inline void h2f(const _Float16 *restrict p, int n, float *restrict out) {
    int i = 0;
    for (; i + VW <= n; i += VW) {
        const vf x = h2f_v(p + i);
        memcpy(out + i, &x, sizeof x);
    }
    for (; i < n; i++) out[i] = (float)p[i];
}

/* exp(x) for x <= 0 to about 2e-7 relative: 2^(x log2 e) split into an integer power (built in
 * the exponent bits) and a degree-5 polynomial on [0, 1). Unlike expf it vectorizes; x below
 * -87 (masked scores, -inf) gives a denormal-free ~1e-38, i.e. no weight. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504f;
    const float fi = floorf(t);
    const float f = t - fi;
    float p = 0.0018951086f;
    p = p * f + 0.0089462250f;
    p = p * f + 0.0558632575f;
    p = p * f + 0.2401407808f;
    p = p * f + 0.6931546330f;
    p = p * f + 0.9999998808f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)fi + 127) << 23};
    return p * scale.f;
}

/* exp_neg on 16 lanes at once (the same polynomial and rounding). */
static inline v16 exp_neg16(v16 x) {
    x = vmax(x, (v16){0} - 87.0f);
    const v16 t = x * 1.44269504f;
    v16i ti = __builtin_convertvector(t, v16i); /* toward zero; t <= 0: floor is one less */
    ti += (v16i)(__builtin_convertvector(ti, v16) > t);
    const v16 f = t - __builtin_convertvector(ti, v16);
    v16 p = (v16){0} + 0.0018951086f;
    p = p * f + 0.0089462250f;
    p = p * f + 0.0558632575f;
    p = p * f + 0.2401407808f;
    p = p * f + 0.6931546330f;
    p = p * f + 0.9999998808f;
    return p * (v16)((ti + 127) << 23);
}

/* Online-softmax update of one row with scores s[0..n) and return the weights in s. */
static float softmax_update(float *s, int n, float *m, float *l, float *acc, int d) {
    const int n16 = n / 16 * 16;
    v16 vm = {0};
    vm -= INFINITY;
    for (int t = 0; t < n16; t += 16) vm = vmax(vm, load16(s + t));
    float mx = n16 ? hmax16(vm) : -INFINITY;
    mx = *m > mx ? *m : mx;
    for (int t = n16; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    if (mx == -INFINITY) { /* nothing visible in this piece */
        for (int t = 0; t < n; t++) s[t] = 0.0f;
        return 1.0f;
    }
    const float corr = exp_neg(*m - mx);
    for (int t = 0; t < n16; t += 16) {
        const v16 e = exp_neg16(load16(s + t) - mx);
        memcpy(s + t, &e, sizeof e);
    }
    for (int t = n16; t < n; t++) s[t] = exp_neg(s[t] - mx);
    v16 vs = {0};
    for (int t = 0; t < n16; t += 16) vs += load16(s + t);
    float sum = n16 ? hsum16(vs) : 0.0f;
    for (int t = n16; t < n; t++) sum += s[t];
    if (corr != 1.0f)
        for (int c = 0; c < d; c++) acc[c] *= corr;
    *l = *l * corr + sum;
    *m = mx;
    return corr;
}

typedef struct {
    int R;           /* query rows per KV head */
    const long *off; /* field offsets in a record */
} Shape;

/* Codes of one run of n elements, dequantized: out[i] = code_i * scale + low. */
static inline void dequant(const uint8_t *restrict p, int n, int bits, float scale, float low,
                           float *restrict out) {
    unpack(p, n, bits, out);
    for (int i = 0; i < n; i++) out[i] = out[i] * scale + low;
}

/* e4m3 (no infinities) byte -> float; filled once, the same by every thread. */
static float fp8_table[256];
static void fp8_init(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
        fp8_table[b] = b & 128 ? -v : v;
    }
}

/* One header row pair of n groups: scales, then the additive lows (-zero * scale for fp8). */
static inline void header_rows(const uint8_t *p, int n, float *scale, float *low) {
#if KSF
    for (int i = 0; i < n; i++) scale[i] = fp8_table[p[i]];
    for (int i = 0; i < n; i++) low[i] = -(float)(int8_t)p[n + i] * scale[i];
#else
    h2f((const _Float16 *)p, n, scale);
    h2f((const _Float16 *)p + n, n, low);
#endif
}

/* Key channel c (stored order) of a block, dequantized into row[0..T). */
static inline void key_row(int c, const _Float16 *kfp, const uint8_t *km, const uint8_t *kl,
                           const float *ks, const float *kl0, float *row) {
    enum { T = KT, NF = KNF, NM = KNM };
    if (c < NF) {
        h2f(kfp + c * T, T, row);
    } else if (c < NF + NM) {
        dequant(km + (c - NF) * (T * KB / 8), T, KB, ks[c - NF], kl0[c - NF], row);
    } else {
        dequant(kl + (c - NF - NM) * (T * KLB / 8), T, KLB, ks[c - NF], kl0[c - NF], row);
    }
}

/* The codes of tokens t0 .. t0 + VW of one channel row (`bits` wide, split layout: byte j of
 * its m = KT * bits / 8 bytes holds tokens j, j + m, ...) as floats; t0 a multiple of VW. */
static inline vf codes_v(const uint8_t *p, int bits, int t0) {
    const int m = KT * bits / 8;
#if defined(__AVX512F__) || defined(__AVX2__)
    if (m < VW && m <= 8 && VW % m == 0) { /* a row shorter than a vector (16-token blocks) */
        /* Lane i is token t0 + i: byte (t0 + i) % m (m divides VW: i % m), shifted right by
         * bits * ((t0 + i) / m). Why: unpacking the row into floats and loading a vector of
         * them cost a stalled store-to-load forward per channel; the default strategy's
         * attention at 64 tokens (SmolLM2, 16-token blocks) spent most of its time there. */
        uint64_t raw = 0;
        memcpy(&raw, p, m < 8 ? m : 8);
        uint8_t idx[16];
        for (int i = 0; i < 16; i++) idx[i] = (uint8_t)(i % m);
        const __m128i g = _mm_shuffle_epi8(_mm_cvtsi64_si128((long long)raw),
                                           _mm_loadu_si128((const __m128i *)idx));
        int32_t sh[VW];
        for (int i = 0; i < VW; i++) sh[i] = bits * ((t0 + i) / m);
#if defined(__AVX512F__)
        vi c = (vi)_mm512_srlv_epi32(_mm512_cvtepu8_epi32(g), _mm512_loadu_si512(sh));
#else
        vi c = (vi)_mm256_srlv_epi32(_mm256_cvtepu8_epi32(g), _mm256_loadu_si256((const __m256i *)sh));
#endif
        return __builtin_convertvector(c & ((1 << bits) - 1), vf);
    }
#endif
    if (m % VW) { /* a run that does not fill whole vectors: unpack the row */
        float row[KT];
        unpack(p, KT, bits, row);
        return loadv(row + t0);
    }
#if defined(__AVX512F__)
    vi c = (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + t0 % m)));
#elif defined(__AVX2__)
    vi c = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + t0 % m)));
#else
    vb x;
    memcpy(&x, p + t0 % m, VW);
    vi c = __builtin_convertvector(x, vi);
#endif
    if (bits < 8) c = (c >> (bits * (t0 / m))) & ((1 << bits) - 1);
    return __builtin_convertvector(c, vf);
}

/* One packed block of one head into the running (m, l, acc) of all R rows. Scales fold into
 * the other operand, so each code is only converted to a float:
 *   keys (quantized per channel c): q.k_t = sum_c (q_c s_c) code_ct + sum_c q_c low_c, the
 *     second sum one number per row and block;
 *   values (quantized per token t): o_c = sum_t (p_t s_t) code_ct + sum_t p_t low_t, the second
 *     sum one number per row, block and value class.
 * A value channel's products over the block's tokens stay a vector of VW partial sums in
 * `wide` [R][D], reduced once per work item (`reduce_wide`) instead of a horizontal sum per
 * channel and row.
 *
 * pf (not NULL): the record read next (`rec` bytes), asked for into the L2 as this one is
 * read, a line per key channel scored and per value channel added (then the rest at once):
 * the records lie apart (one KV head's blocks are H records from each other), where the
 * hardware prefetcher does not reach, and the channel loops had waited on them. SmolLM2 at
 * 4,048 tokens (GPL-2), the 30 layers' packed attention in the decode step, two alternating
 * pairs: 5.90-6.04 ms without, 5.48-5.64 with the next record asked for at once before its
 * turn, 5.02-5.10 a line at a time (`full`'s in the same runs: 8.2-8.9 ms). */
static void packed_block(const Shape *sh, const uint8_t *blk, const float *q, int mask0,
                         float *s, float *row, float *m, float *l, float *acc, vf *wide,
                         const char *pf, long rec) {
    enum { T = KT, D = KD, NF = KNF, NM = KNM, NQ = KNM + KNL };
    const int R = sh->R;
    const _Float16 *kfp = (const _Float16 *)(blk + sh->off[OFF_KFP]);
    const _Float16 *vfp = (const _Float16 *)(blk + sh->off[OFF_VFP]);
    const uint8_t *ksc = blk + sh->off[OFF_KSC], *vsc = blk + sh->off[OFF_VSC];
    const uint8_t *km = blk + sh->off[OFF_KM], *kl = blk + sh->off[OFF_KL];
    const uint8_t *vm = blk + sh->off[OFF_VM], *vl = blk + sh->off[OFF_VL];
    enum { VF = KVF, VM = KVM, VL = KVL, CLASSES = (KVM > 0) + (KVL > 0) };
    float vs[4 * T]; /* value scale, low per token: main class, then low class */
    for (int j = 0; j < CLASSES; j++) header_rows(vsc + j * 2 * T * HB, T, vs + 2 * j * T, vs + (2 * j + 1) * T);
    float ks[NQ + 1], kl0[NQ + 1]; /* key scale, low per channel */
    header_rows(ksc, NQ, ks, kl0);
    if (pf) /* the next record's lines past the 2D the channel loops below ask for */
        for (long o = 64L * (2 * KD); o < rec; o += 64) __builtin_prefetch(pf + o, 0, 2);
    for (int r0 = 0; r0 < R; r0 += RB) {
        const int rn = R - r0 < RB ? R - r0 : RB;
        const float *qr = q + (long)r0 * D;
        float base[RB] = {0}; /* sum over the quantized key channels of q_c low_c */
        for (int i = 0; i < rn; i++)
            for (int c = NF; c < D; c++) base[i] += qr[i * D + c] * kl0[c - NF];
        /* Scores of rows r0.. over the block's tokens, a tile of TV vectors at a time. */
        for (int v0 = 0; v0 < NV; v0 += TV) {
            vf sc[RB][TV] = {0};
            /* channels [lo, hi): each one's TV code vectors (CODE, of token t0), times the
             * rows' q_c * SCALE */
#define SCORE_CHANNELS(lo, hi, CODE, SCALE)                                                    \
    for (int c = lo; c < hi; c++) {                                                            \
        if (pf && r0 == 0 && v0 == 0 && 64L * c < rec) __builtin_prefetch(pf + 64L * c, 0, 2); \
        vf code[TV];                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < TV; j++) {                                 \
            const int t0 = (v0 + j) * VW;                                                      \
            code[j] = CODE;                                                                    \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < RB; i++) {                                 \
            const float w = i < rn ? qr[i * D + c] * (SCALE) : 0.0f;                           \
            _Pragma("GCC unroll 4") for (int j = 0; j < TV; j++) sc[i][j] += w * code[j];      \
        }                                                                                      \
    }
            SCORE_CHANNELS(0, NF, h2f_v(kfp + c * T + t0), 1.0f)
            SCORE_CHANNELS(NF, NF + NM, codes_v(km + (c - NF) * (T * KB / 8), KB, t0), ks[c - NF])
            SCORE_CHANNELS(NF + NM, D, codes_v(kl + (c - NF - NM) * (T * KLB / 8), KLB, t0),
                           ks[c - NF])
#undef SCORE_CHANNELS
            for (int i = 0; i < rn; i++)
                for (int j = 0; j < TV; j++) {
                    const vf x = sc[i][j] + base[i];
                    memcpy(s + (long)(r0 + i) * T + (v0 + j) * VW, &x, sizeof x);
                }
        }
        for (int i = 0; i < rn; i++) {
            float *sr = s + (long)(r0 + i) * T;
            for (int t = 0; t < mask0; t++) sr[t] = -INFINITY;
            const float corr =
                softmax_update(sr, T, m + r0 + i, l + r0 + i, acc + (long)(r0 + i) * D, D);
            if (corr != 1.0f)
                for (int c = 0; c < D; c++) wide[(long)(r0 + i) * D + c] *= corr;
        }
        /* Outputs of rows r0..: o[r][c] = sum over tokens of p[r][t] * value[c][t], from the
         * weights p (fp16 channels; a latent cache's key rows) or p * scale (a value class),
         * and per class the sum of p * low. */
        float pw[1 + CLASSES][RB][T], plow[CLASSES + 1][RB];
        for (int i = 0; i < rn; i++) {
            const float *sr = s + (long)(r0 + i) * T;
            memcpy(pw[0][i], sr, sizeof(float) * T);
            for (int k = 0; k < CLASSES; k++) {
                const float *scl = vs + 2 * k * T, *lo = scl + T;
                float sum = 0.0f;
                for (int t = 0; t < T; t++) {
                    pw[1 + k][i][t] = sr[t] * scl[t];
                    sum += sr[t] * lo[t];
                }
                plow[k][i] = sum;
            }
        }
        for (int c = 0; c < D; c++) {
            if (pf && r0 == 0 && 64L * (D + c) < rec) __builtin_prefetch(pf + 64L * (D + c), 0, 2);
            int k = -1; /* the value class of channel c (-1: fp16, or a latent cache's keys) */
            vf code[NV];
            if (KLAT) { /* the key row again: cheaper than keeping a [D][T] copy of it */
                key_row(c, kfp, km, kl, ks, kl0, row);
                for (int j = 0; j < NV; j++) code[j] = loadv(row + j * VW);
            } else if (c < VF) {
                for (int j = 0; j < NV; j++) code[j] = h2f_v(vfp + c * T + j * VW);
            } else {
                const int low = c >= VF + VM;
                const uint8_t *p = low ? vl + (c - VF - VM) * (T * KLB / 8)
                                       : vm + (c - VF) * (T * KB / 8);
                for (int j = 0; j < NV; j++) code[j] = codes_v(p, low ? KLB : KB, j * VW);
                k = low && VM ? 1 : 0;
            }
            for (int i = 0; i < rn; i++) {
                const float *w = pw[1 + k][i];
                vf dot = loadv(w) * code[0];
#pragma GCC unroll 16
                for (int j = 1; j < NV; j++) dot += loadv(w + j * VW) * code[j];
                wide[(long)(r0 + i) * D + c] += dot;
                if (k >= 0) acc[(long)(r0 + i) * D + c] += plow[k][i];
            }
        }
    }
}

/* acc[r][c] += the VW partial sums of wide[r][c], which is zeroed for the next work item. */
static void reduce_wide(vf *wide, float *acc, int R) {
    for (long i = 0; i < (long)R * KD; i++) {
        acc[i] += hsumv(wide[i]);
        wide[i] = (vf){0};
    }
}

/* Dense tokens of one head: `na` fp16 tokens seen by all rows, then `tq` float causal tokens. */
static void dense(const Shape *sh, const _Float16 *ak, const _Float16 *av, int na,
                  const float *ck, const float *cv, long cstride, int tq, const float *q,
                  float *s, float *m, float *l, float *acc) {
    enum { D = KD };
    const int R = sh->R, n = na + tq;
    /* The fp16 tokens once as floats (a head's tokens are contiguous rows of D). */
    float *kf = malloc(sizeof(float) * (2L * na * D + 1)), *vf = kf + (long)na * D;
    h2f(ak, na * D, kf);
    h2f(av, na * D, vf);
    for (int r = 0; r < R; r++) {
        const float *qr = q + (long)r * D;
        float *sr = s + (long)r * n;
        const int visible = na + (tq ? r % tq + 1 : 0);
        for (int j = 0; j < n; j++) {
            if (j >= visible) {
                sr[j] = -INFINITY;
                continue;
            }
            const float *k = j < na ? kf + (long)j * D : ck + (long)(j - na) * cstride;
            v16 dot = load16(qr) * load16(k);
            for (int i = 1; i < D / 16; i++) dot += load16(qr + 16 * i) * load16(k + 16 * i);
            sr[j] = hsum16(dot);
        }
        softmax_update(sr, n, m + r, l + r, acc + (long)r * D, D);
        float *ar = acc + (long)r * D;
        for (int j = 0; j < visible; j++) {
            const float p = sr[j];
            const float *v = j < na ? vf + (long)j * D : cv + (long)(j - na) * cstride;
            for (int c = 0; c < D; c++) ar[c] += p * v[c];
        }
    }
    free(kf);
}

/* Attention of one sequence's query rows over its packed blocks and dense tokens.
 *   arena: this layer's records, block b head h at arena + b * H * rec + h * rec
 *   blocks[nb]: the sequence's packed blocks in token order; mask0 leading positions of the
 *     sequence's first block are not attended (the sinks, which are dense). With bstride > 0
 *     each KV head h reads its own nb blocks, blocks + h * bstride (a sparse selection's
 *     choice), and the mask applies to a head's first block only where it is block `masked`
 *     (the sequence's first)
 *   q_raw: [nq][H * G][D] the step's queries in the model's layout; korder/vorder [H][D] the
 *     stored channel order of keys/values (stored channel c is model channel order[c]); rows
 *     are r = g * nq + t per KV head, R = G * nq
 *   ak/av: [H][na_stride][D] fp16 dense tokens; ck/cv: current tokens, head h token j at
 *     ck + j * cstride + h * D (the step's [T, H, D] activations, stored channel order)
 *   out_raw: if not NULL, the normalized output in the model's layout [nq][H * G][KDV];
 *     otherwise out [H][R][D] (stored value order) and lse [H][R] for a merge by the caller.
 *   threads: the parallel region's (0: the process's OpenMP threads). The work is split in
 *     items whose results are merged in a fixed order, so any count gives the same bits.
 */
static void attend_on(const uint8_t *arena, const int64_t *blocks, long bstride, int64_t masked,
                      int nb, int mask0, long rec, const long *off, int H, int G, int nq,
                      const float *q_raw, const int64_t *korder, const int64_t *vorder,
                      float scale, const _Float16 *ak, const _Float16 *av, int na,
                      long na_stride, const float *ck, const float *cv, long cstride, int tq,
                      float *out_raw, float *out, float *lse, int threads) {
    enum { T = KT, D = KD }; /* the shape is compiled in (record sizes come from kernels.py) */
    const int R = G * nq;
    if (KSF && fp8_table[0x38] == 0.0f) fp8_init(); /* 0x38 is 1.0 */
    float *q = malloc(sizeof(float) * H * R * D);
    for (int h = 0; h < H; h++)
        for (int g = 0; g < G; g++)
            for (int t = 0; t < nq; t++) {
                const float *src = q_raw + ((long)t * H * G + h * G + g) * D;
                float *dst = q + ((long)h * R + g * nq + t) * D;
                for (int c = 0; c < D; c++) dst[c] = src[korder[h * D + c]] * scale;
            }
    float *o = out_raw ? malloc(sizeof(float) * H * R * D) : out;
    float *l_out = out_raw ? malloc(sizeof(float) * H * R) : lse;
    const Shape sh = {R, off};
    const int nchunks = (nb + CHUNK - 1) / CHUNK;
    const int has_dense = na + tq > 0;
    const int per_head = nchunks + has_dense;
    const int items = H * per_head;
    /* Per item: m[R], l[R], acc[R][D]. */
    const long item_floats = (long)R * (D + 2);
    float *part = malloc(sizeof(float) * item_floats * (items ? items : 1));
    const long scratch_n = (long)R * (T > na + tq ? T : na + tq) + 2L * D + T + 16;

#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
    {
        float *scratch = malloc(sizeof(float) * scratch_n);
        vf *wide = aligned_alloc(64, sizeof(vf) * R * D);
        memset(wide, 0, sizeof(vf) * R * D);
        float *s = scratch;
        float *row = s + (long)R * (T > na + tq ? T : na + tq);
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            const int h = it / per_head, c = it % per_head;
            float *m = part + it * item_floats, *l = m + R, *acc = l + R;
            for (int r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
            memset(acc, 0, sizeof(float) * R * D);
            const float *qh = q + (long)h * R * D;
            if (c < nchunks) {
                const int end = (c + 1) * CHUNK < nb ? (c + 1) * CHUNK : nb;
                const int64_t *hb = blocks + h * bstride;
                const int mask = bstride == 0 || hb[0] == masked ? mask0 : 0;
                for (int i = c * CHUNK; i < end; i++) {
                    const uint8_t *blk = arena + (hb[i] * H + h) * rec;
                    const char *nx =
                        i + 1 < nb ? (const char *)(arena + (hb[i + 1] * H + h) * rec) : NULL;
                    packed_block(&sh, blk, qh, i == 0 ? mask : 0, s, row, m, l, acc, wide, nx,
                                 rec);
                }
                reduce_wide(wide, acc, R);
            } else {
                dense(&sh, ak + (long)h * na_stride * D, av + (long)h * na_stride * D, na,
                      ck + (long)h * D, cv + (long)h * D, cstride, tq, qh, s, m, l, acc);
            }
        }
        free(scratch);
        free(wide);
    }
    for (int h = 0; h < H; h++) {
        for (int r = 0; r < R; r++) {
            float mx = -INFINITY;
            for (int c = 0; c < per_head; c++) {
                const float mi = part[(h * per_head + c) * item_floats + r];
                mx = mi > mx ? mi : mx;
            }
            float *orow = o + ((long)h * R + r) * D;
            memset(orow, 0, sizeof(float) * D);
            float denom = 0.0f;
            for (int c = 0; c < per_head && mx != -INFINITY; c++) {
                const float *m = part + (h * per_head + c) * item_floats;
                if (m[r] == -INFINITY) continue;
                const float w = exp_neg(m[r] - mx);
                denom += w * m[R + r];
                const float *acc = m + 2 * R + (long)r * D;
                for (int d = 0; d < D; d++) orow[d] += w * acc[d];
            }
            if (denom > 0.0f)
                for (int d = 0; d < D; d++) orow[d] /= denom;
            l_out[h * R + r] = denom > 0.0f ? mx + logf(denom) : -INFINITY;
        }
    }
    free(part);
    free(q);
    if (out_raw) {
        for (int h = 0; h < H; h++)
            for (int g = 0; g < G; g++)
                for (int t = 0; t < nq; t++) {
                    const float *src = o + ((long)h * R + g * nq + t) * D;
                    float *dst = out_raw + ((long)t * H * G + h * G + g) * KDV;
                    for (int c = 0; c < D; c++)
                        if (vorder[h * D + c] < KDV) dst[vorder[h * D + c]] = src[c];
                }
        free(o);
        free(l_out);
    }
}

/* attend_on with the process's OpenMP threads (the per-layer path's call, through ctypes). */
void hybrid_attend(const uint8_t *arena, const int64_t *blocks, long bstride, int64_t masked,
                   int nb, int mask0, long rec, const long *off, int H, int G, int nq,
                   const float *q_raw, const int64_t *korder, const int64_t *vorder, float scale,
                   const _Float16 *ak, const _Float16 *av, int na, long na_stride,
                   const float *ck, const float *cv, long cstride, int tq, float *out_raw,
                   float *out, float *lse) {
    attend_on(arena, blocks, bstride, masked, nb, mask0, rec, off, H, G, nq, q_raw, korder,
              vorder, scale, ak, av, na, na_stride, ck, cv, cstride, tq, out_raw, out, lse, 0);
}

/* ---- one layer of a native decode step ---------------------------------------------------------
 *
 * gemv.c's decode_layers runs every layer of a decode step in one call; a cache that is not
 * plain float32 arenas does its layer's KV work through a function of its own (`layer_fn`
 * there). This is the packed format's (kvstrategies/hybrid.py `PackedFormat.native_step`): the
 * step's new keys and values into stored channel order, attention over the packed blocks, the
 * fp16 side buffer and the new tokens (hybrid_attend above: the call the per-layer path makes,
 * with the same arguments), then the new tokens into the side buffer as fp16 (what the
 * per-layer path's end of step writes). The format offers such a step only when no block
 * completes in it (quantizing a block stays in Python) and each sequence's attention is one
 * kernel call in the per-layer path too, so both give the same numbers. A sequence given a
 * sparse selection's choice reads, per KV head, the packed blocks among its chosen positions
 * (the side buffer's tokens always), as the per-layer path's gathered records do. */
typedef struct {
    const uint8_t *arena;  /* layer 0's records: block b, head h at arena + (b * H + h) * rec */
    int64_t arena_layer;   /* bytes from one layer's records to the next */
    long rec;
    const long *off;       /* field offsets in a record */
    int H, G, nseq;
    float scale;
    const int64_t *korder, *vorder; /* layer 0's [H][D] stored channel orders; a layer H*D on */
    const int64_t *rows;   /* [nseq + 1]: each sequence's first row, then n */
    const int64_t *blocks; /* [nseq]: addresses of int64 [nb]: its packed blocks in order */
    const int64_t *nb, *mask0;
    const int64_t *dense;  /* [nseq]: addresses of its fp16 side buffer [L][2][H][span][D] */
    int64_t span;          /* token slots per head in a side buffer (sinks + one block) */
    const int64_t *lo, *na; /* [nseq]: the side buffer's tokens attended: [lo, lo + na) */
    const int64_t *tail, *sink; /* [n]: each new row's side-buffer slot; its sink slot or -1 */
    float *keys;           /* NULL, or [L][n][H][D]: the step's new keys kept (model order) */
    float *values;         /* NULL, or the same of its values (a block it completes is packed
                            * from them after the step; its tokens take no side-buffer slot) */
} hybrid_step_t;

int hybrid_step_size(void) { return (int)sizeof(hybrid_step_t); }

/* Layer `layer` of the step described by `st`: k, v [n][H][D] (the model's channel order, after
 * RoPE), q [n][H * G][D]; out [n][H * G][KDV]; the attention on `threads` (1 inside gemv.c's
 * parallel region: see its INSIDE_KEYS). Returns 0, or -1 (no memory, or a latent cache,
 * which this does not serve): the caller then goes layer by layer. */
int hybrid_layer(const hybrid_step_t *st, int layer, const float *q, const float *k,
                 const float *v, int n, float *out, int threads, const int64_t *const *chosen,
                 const int64_t *nchosen, int sub) {
    enum { D = KD };
    const int H = st->H;
    const long hd = (long)H * D, total = st->rows[st->nseq];
    /* Sub-step `sub` of a sequential step (n: one row per sequence): each sequence's row sub */
    const int seq_rows = n != total;
    if (KLAT || (seq_rows && (n != st->nseq || sub < 0))) return -1;
    for (int s = 0; seq_rows && s < st->nseq; s++)
        if (st->rows[s] + sub >= st->rows[s + 1]) return -1;
    const int64_t *korder = st->korder + layer * hd, *vorder = st->vorder + layer * hd;
    float *kp = malloc(sizeof(float) * 2 * n * hd);
    if (kp == NULL) return -1;
    float *vp = kp + n * hd;
    for (long i = 0; i < n; i++) /* stored order: kp[i][h][c] = k[i][h][korder[h][c]] */
        for (int h = 0; h < H; h++)
            for (int c = 0; c < D; c++) {
                kp[i * hd + h * D + c] = k[i * hd + h * D + korder[h * D + c]];
                vp[i * hd + h * D + c] = v[i * hd + h * D + vorder[h * D + c]];
            }
    const uint8_t *arena = st->arena + layer * st->arena_layer;
    const long part = hd * st->span; /* fp16 elements of one part (K or V) of a layer */
    int rc = 0;
    for (int s = 0; s < st->nseq && rc == 0; s++) {
        /* i0: the sequence's first row in this call; r0: in the whole step (tail, sink) */
        const long r0 = seq_rows ? st->rows[s] + sub : st->rows[s];
        const long t = seq_rows ? 1 : st->rows[s + 1] - st->rows[s], i0 = seq_rows ? s : r0;
        const long na = st->na[s] + (seq_rows ? sub : 0); /* and the rows before, written */
        if (st->keys) /* the rows kept, at their place in the whole step */
            memcpy(st->keys + (layer * total + r0) * hd, k + i0 * hd, sizeof(float) * t * hd);
        if (st->values)
            memcpy(st->values + (layer * total + r0) * hd, v + i0 * hd, sizeof(float) * t * hd);
        _Float16 *kd = (_Float16 *)(intptr_t)st->dense[s] + 2 * part * layer, *vd = kd + part;
        const int64_t *blocks = (const int64_t *)(intptr_t)st->blocks[s];
        int64_t nb = st->nb[s], bstride = 0, *picked = NULL;
        if (chosen != NULL && chosen[s] != NULL) { /* per head, its chosen packed blocks */
            const int64_t nc = nchosen[s];
            picked = malloc(sizeof(int64_t) * (H * nc + 1));
            if (picked == NULL) {
                rc = -1;
                break;
            }
            for (int h = 0; h < H; h++) {
                int64_t c = 0;
                for (int64_t j = 0; j < nc; j++) {
                    const int64_t pos = chosen[s][h * nc + j];
                    if (pos < st->nb[s]) picked[h * nc + c++] = blocks[pos];
                }
                if (h > 0 && c != nb) rc = -1; /* heads reading unlike counts: not a choice's */
                nb = c;
            }
            bstride = nc;
        }
        if (rc == 0)
            attend_on(arena, picked ? picked : blocks, bstride, st->nb[s] ? blocks[0] : -1,
                      (int)nb, (int)st->mask0[s], st->rec, st->off, H, st->G, (int)t,
                      q + i0 * H * st->G * D, korder, vorder, st->scale, kd + st->lo[s] * D,
                      vd + st->lo[s] * D, (int)na, st->span, kp + i0 * hd, vp + i0 * hd,
                      hd, (int)t, out + i0 * H * st->G * KDV, NULL, NULL, threads);
        free(picked);
        if (rc) break;
        for (long i = 0; i < t; i++)
            for (int h = 0; h < H; h++)
                for (int w = 0; w < 2; w++) { /* the tail slot, then the sink slot if any */
                    const int64_t slot = w ? st->sink[r0 + i] : st->tail[r0 + i];
                    if (slot < 0) continue;
                    const long at = ((long)h * st->span + slot) * D;
                    for (int c = 0; c < D; c++) {
                        kd[at + c] = (_Float16)kp[(i0 + i) * hd + h * D + c];
                        vd[at + c] = (_Float16)vp[(i0 + i) * hd + h * D + c];
                    }
                }
    }
    free(kp);
    return rc;
}
