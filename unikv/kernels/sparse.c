/* The sparse selection's two kernels, one call each per sequence and layer.
 *
 * sparse_choose: score every candidate block of one sequence by its key summaries, keep the
 * best `room` per KV head, and write the blocks the step reads (sinks, the chosen, the window)
 * as one index row per KV head. sparse_attend: attention of the step's queries over exactly
 * those blocks, read in place wherever each lies (the device or host arena, a staged tensor: no
 * gathered copy).
 *
 * Why kernels: in PyTorch the choice is about ten small ops per layer (view, abs, cat, a
 * batched matmul, amax, topk, add, cat), each a dispatch of a few microseconds, and their
 * fixed cost was 9-11% of a decode step at 8K tokens. Here it is one call that reads the
 * summaries once.
 *
 * The score of block b for KV head h: the largest, over the block's summaries (`parts` per
 * block: each summarizes a run of its tokens), the group's query heads g and the step's query
 * rows r, of q . c + alpha |q| . r, where c and r are the summary's per-channel key centre and
 * half-range (per summary [c, r], 2d int8 codes, or [c] alone, d codes, when the score is the
 * centre's; and one float32 scale). alpha = 1 is Quest's upper bound of q . k over the tokens
 * summarized; smaller alpha weighs the centre more. The queries are quantized to int8 here
 * (see "choosing" below). With temp > 0 a block's score is instead the sum of e^(temp (x -
 * M)) over its summaries' scores x (each still the largest over the queries; M the head's
 * best): with one token per summary, about how much of the softmax mass at the attention's
 * scale `temp` the block takes, where the largest counts one strong token as much as many.
 *
 * Top-k: a quickselect finds the room-th largest score per head; the blocks above it, and
 * as many of those equal to it as there is room for, are taken in block order, so the chosen
 * blocks come out in ascending order (the PyTorch reference sorts its topk's: the same list).
 */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The `k`-th largest of a[0..n) (k in [1, n]), found bit by bit in the scores' order as
 * unsigned integers (`order_key`: the sign bit set for x >= 0, every bit flipped for x < 0; -0
 * taken as 0): from the top bit down, a bit is kept where at least k keys are at or above the
 * prefix with it set; once exactly k are, the least of them is the answer. Counting passes the
 * compiler vectorizes, over fewer keys as the prefix grows (those below it are dropped), with
 * no branch per score: the quickselect it replaces mispredicted about every other comparison
 * (510 block scores, k = 61, random: 3.9 us against 0.73, AVX2 0.74, no SIMD 0.94; the same
 * value in 200,000 random cases with ties, -0 and -inf). key: n uint32 of scratch. */
static inline uint32_t order_key(float x) {
    uint32_t u;
    x += 0.0f; /* -0 -> +0 */
    memcpy(&u, &x, 4);
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}
static float kth_largest(const float *a, long n, long k, uint32_t *key) {
    for (long i = 0; i < n; i++) key[i] = order_key(a[i]);
    uint32_t t = 0;
    long m = n; /* key[0..m) holds every key at or above t */
    for (int bit = 31; bit >= 0; bit--) {
        const uint32_t c = t | (1u << bit);
        uint32_t count = 0;
        for (long i = 0; i < m; i++) count += key[i] >= c;
        if (count < k) continue;
        t = c;
        if (count == k) { /* the k-th largest: the least of the k keys at or above c */
            uint32_t least = UINT32_MAX;
            for (long i = 0; i < m; i++) least = key[i] >= c && key[i] < least ? key[i] : least;
            t = least;
            break;
        }
        if (2 * (long)count <= m) { /* keep only those at or above t (no branch per key) */
            long j = 0;
            for (long i = 0; i < m; i++) {
                key[j] = key[i];
                j += key[i] >= c;
            }
            m = j;
        }
    }
    const uint32_t u = t & 0x80000000u ? t ^ 0x80000000u : ~t;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Eight floats as one vector (GCC/Clang vector extensions: AVX/AVX2 registers, two SSE or NEON
 * registers elsewhere), loaded and stored unaligned. */
typedef float v8 __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline __attribute__((always_inline)) void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v8i __attribute__((vector_size(32)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* s[0..8) = q . k for the 8 keys in rows kj, kj + d, ... (d % 8 == 0): eight independent sums
 * (one sum's chain of dependent adds is what bounds a dot product at a time), then one
 * transpose-and-add of the eight vectors (`sum8x8`) instead of eight horizontal sums. */
static inline __attribute__((always_inline)) v8 sum8x8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5,
                                                       v8 a6, v8 a7) {
    const v8 b0 = SHUF(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 b1 = SHUF(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 b2 = SHUF(a4, a5, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a4, a5, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 b3 = SHUF(a6, a7, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a6, a7, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 c0 = SHUF(b0, b1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(b0, b1, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8 c1 = SHUF(b2, b3, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(b2, b3, 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(c0, c1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(c0, c1, 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline void dot8(const float *qv, const float *kj, int d, float scale, float *s) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int c = 0; c < d; c += 8) {
        const v8 x = load8(qv + c);
        a0 += x * load8(kj + c);
        a1 += x * load8(kj + d + c);
        a2 += x * load8(kj + 2 * d + c);
        a3 += x * load8(kj + 3 * d + c);
        a4 += x * load8(kj + 4 * d + c);
        a5 += x * load8(kj + 5 * d + c);
        a6 += x * load8(kj + 6 * d + c);
        a7 += x * load8(kj + 7 * d + c);
    }
    store8(s, sum8x8(a0, a1, a2, a3, a4, a5, a6, a7) * scale);
}

static inline float dot1(const float *qv, const float *kj, int d) {
    float a = 0.0f;
#pragma omp simd reduction(+ : a)
    for (int c = 0; c < d; c++) a += qv[c] * kj[c];
    return a;
}

/* ---- choosing: int8 summaries against int8 queries -----------------------------------------
 *
 * A summary is w int8 codes and one float32 scale (its values: codes x scale); a query vector
 * [q, alpha |q|] is quantized here to codes in [-63, 63] with one scale (its largest magnitude
 * / 63, rounded half to even as torch.round). The integer dot of the codes is exact, so every
 * instruction set and the PyTorch reference compute the same score bit for bit: float(dot) x
 * the query's scale, the largest over the group's queries, x the summary's scale. Why int8:
 * float16 summaries took 4.1 ms of an 8K step (11.7%), most of it converting them to float;
 * int8 codes are half the bytes and multiply without conversion.
 *
 * Layout: summaries in tiles of 16, a tile [w / 4][16][4]: for each 4 channels, the 16
 * summaries' 4 codes side by side. One vpdpbusd then adds 4 channels of 16 summaries against
 * one query's 4 codes (broadcast): each lane is one summary's dot, with no horizontal sums (a
 * summary per row would need one per summary and query, more work than the dot itself).
 *
 * The instructions multiply unsigned by signed bytes (vpdpbusd; vpmaddubsw on AVX2), so the
 * codes are read as c + 128 (one xor) and 128 times the query's code sum is taken off. On AVX2
 * a pair of products sums to int16: (c + 128) q lies within 255 x 63, two of them within int16;
 * that is why the query's codes stop at 63. */
#define QMAX 63
#define TILE 16 /* summaries per tile */
#define QT 4    /* queries per pass over a tile (the query codes are padded to a multiple) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CHOOSE_ISA 2
#elif defined(__AVX2__)
#include <immintrin.h>
#define CHOOSE_ISA 1
#else
#define CHOOSE_ISA 0
#endif

/* Scoring asks for the tile CHOOSE_AHEAD tiles ahead, into the L2 (prefetcht1). Why: a step's
 * summaries (24 MiB at 8K tokens, 28 layers) come from memory, and the hardware prefetcher did
 * not keep the scoring fed: 28 layers' choice, 2 threads, after a sweep of the caches, took
 * 1.48-1.83 ms without it, 1.09-1.24 with 8 tiles ahead (4 and 16: between the two; into the
 * L1, slower). The tile ahead is asked for a line at a time as the current one is multiplied
 * (`pf`, one line per 4 channels; NULL: none): asked for at once, its 16 lines had the loads
 * behind them wait for the core's line fill buffers (the same choice from a one-off harness:
 * 2.38-2.41 -> 2.10-2.13 ms, ctypes calls included). Not for the keys' tiles (8 lines each):
 * there a line per 8 channels made the choice slower (2.60 -> 3.09 ms). */
#ifndef CHOOSE_AHEAD
#define CHOOSE_AHEAD 8
#endif
#ifndef CHOOSE_HINT
#define CHOOSE_HINT 2
#endif

/* best[k] = the largest of best[k] and, over the queries u < nu (of QT: qc + u * w their
 * codes, qs[u] their scales, xq[u] 128 x their code sums), float(dot of codes) x qs[u], for
 * the 16 summaries k of one tile. Inlined with nu a constant (`tile_best`), so a pass with
 * fewer than QT queries (a decode step of a 3-query group) multiplies only those. Asks for the
 * tile at pf as it goes (see CHOOSE_AHEAD). */
static inline __attribute__((always_inline)) void tile_best_n(const int8_t *qc, const float *qs,
                                                              const int *xq, const int nu, int w,
                                                              const int8_t *tile, float *best,
                                                              const char *pf) {
#if CHOOSE_ISA == 2
    __m512i acc[QT];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++) acc[u] = _mm512_setzero_si512();
    for (int c = 0; c < w; c += 4) {
        if (pf) __builtin_prefetch(pf + c * TILE, 0, CHOOSE_HINT);
        const __m512i x = _mm512_xor_si512(_mm512_loadu_si512(tile + c * TILE), flip);
#pragma GCC unroll 4
        for (int u = 0; u < nu; u++) {
            int32_t q4;
            memcpy(&q4, qc + (long)u * w + c, 4);
            acc[u] = _mm512_dpbusd_epi32(acc[u], x, _mm512_set1_epi32(q4));
        }
    }
    __m512 m = _mm512_loadu_ps(best);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++)
        m = _mm512_max_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[u], _mm512_set1_epi32(xq[u]))),
                                        _mm512_set1_ps(qs[u])), m);
    _mm512_storeu_ps(best, m);
#elif CHOOSE_ISA == 1
    __m256i acc[QT][2];
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++) acc[u][0] = acc[u][1] = _mm256_setzero_si256();
    for (int c = 0; c < w; c += 4) {
        if (pf) __builtin_prefetch(pf + c * TILE, 0, CHOOSE_HINT);
        const __m256i x0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(tile + c * TILE)), flip);
        const __m256i x1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(tile + c * TILE + 32)), flip);
#pragma GCC unroll 4
        for (int u = 0; u < nu; u++) {
            int32_t q4;
            memcpy(&q4, qc + (long)u * w + c, 4);
            const __m256i y = _mm256_set1_epi32(q4);
            acc[u][0] = _mm256_add_epi32(acc[u][0], _mm256_madd_epi16(_mm256_maddubs_epi16(x0, y), ones));
            acc[u][1] = _mm256_add_epi32(acc[u][1], _mm256_madd_epi16(_mm256_maddubs_epi16(x1, y), ones));
        }
    }
    __m256 m0 = _mm256_loadu_ps(best), m1 = _mm256_loadu_ps(best + 8);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++) {
        const __m256i x = _mm256_set1_epi32(xq[u]);
        const __m256 f = _mm256_set1_ps(qs[u]);
        m0 = _mm256_max_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[u][0], x)), f), m0);
        m1 = _mm256_max_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[u][1], x)), f), m1);
    }
    _mm256_storeu_ps(best, m0);
    _mm256_storeu_ps(best + 8, m1);
#else /* the plain sum of c q: the same integer */
    (void)xq, (void)pf;
    for (int u = 0; u < nu; u++)
        for (int k = 0; k < TILE; k++) {
            int a = 0;
            for (int c = 0; c < w; c += 4)
                for (int i = 0; i < 4; i++) a += (int)qc[(long)u * w + c + i] * tile[c * TILE + k * 4 + i];
            const float v = (float)a * qs[u];
            best[k] = v > best[k] ? v : best[k];
        }
#endif
}

static void tile_best(const int8_t *qc, const float *qs, const int *xq, int nu, int w,
                      const int8_t *tile, float *best, const char *pf) {
    switch (nu) {
    case 1: tile_best_n(qc, qs, xq, 1, w, tile, best, pf); break;
    case 2: tile_best_n(qc, qs, xq, 2, w, tile, best, pf); break;
    case 3: tile_best_n(qc, qs, xq, 3, w, tile, best, pf); break;
    default: tile_best_n(qc, qs, xq, QT, w, tile, best, pf); break;
    }
}

/* Scores of the summaries in tiles [t0, t1) of one KV head: s[i] for summary t0 * TILE + i.
 * qc: the head's query codes (nq rounded up to QT, w each), qs their scales, xq 128 x their
 * code sums; tiles: the head's; scales: one per summary. The tile CHOOSE_AHEAD ahead is asked
 * for by the first pass of queries over each tile. */
static void score_tiles(const int8_t *qc, const float *qs, const int *xq, int nq, int w,
                        const int8_t *tiles, const float *scales, long t0, long t1, float *s) {
    for (long t = t0; t < t1; t++) {
        const char *p = CHOOSE_AHEAD ? (const char *)(tiles + (t + CHOOSE_AHEAD) * TILE * w) : NULL;
        if (CHOOSE_AHEAD) __builtin_prefetch(scales + (t + CHOOSE_AHEAD) * TILE, 0, CHOOSE_HINT);
        float *o = s + (t - t0) * TILE;
        for (int k = 0; k < TILE; k++) o[k] = -INFINITY;
        for (int j = 0; j < nq; j += QT)
            tile_best(qc + (long)j * w, qs + j, xq + j, nq - j < QT ? nq - j : QT, w,
                      tiles + t * TILE * w, o, j == 0 ? p : NULL);
        for (int k = 0; k < TILE; k++) o[k] *= scales[t * TILE + k];
    }
}

#define MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- choosing from 4-bit keys (the selection's summary = keys) -----------------------------
 *
 * Each token's key in 4 bits: per group of tokens (a multiple of 16) and channel c a minimum
 * m_c and a step s_c (float16), and a code u in 0..15 per token and channel, the key about
 * m_c + u s_c. For a query q the estimate of q . k is then q . m + sum_c (q_c s_c) u_c: the
 * first term once per group and query, the second an integer dot after a = q s is rounded (once
 * per group) to int8 codes of scale A
 * (its largest magnitude / 127, half to even). A token's score is the largest over the group's
 * queries (a "summary" per token: parts = the block's tokens), and the block score, top-k and
 * output are the centres' (below). The codes are unsigned, as vpdpbusd and vpmaddubsw want
 * them: no offset to take off, and a's codes may use all of int8 (on AVX2 two products sum to
 * at most 2 x 15 x 127 in int16, and two such pairs to 7,620).
 *
 * Layout per tile: [d / 8][16 tokens][4 bytes], byte i of token k in group j holding channel
 * 8j + i in its low nibble and 8j + 4 + i in its high one: one 64-byte load, masked and
 * shifted, gives 4 channels of the 16 tokens twice, each lane one token's dot (no horizontal
 * sums). The minima and steps: [2][d] float16 (uint16 here) per group of tiles (`key_group`
 * tokens). `sparse_choose` takes this form when its summaries' width w is d / 2 (bytes of
 * codes per token). */
#define KMAX 127
#define DMAX 1024 /* the longest head dim of the keys form */

static inline float half_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    float f;
    if (e == 0) { /* zero or subnormal: man * 2^-24, exact in float32 */
        f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* float32 to float16, rounded to nearest, ties to even (torch's `.half()`): F16C, or the same
 * in integers (overflow to infinity, subnormal halves, NaN kept a NaN). */
static inline uint16_t float_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7FFFFFFFu;
    if (x > 0x7F800000u) return sign | 0x7E00; /* NaN */
    if (x >= 0x47800000u) return sign | 0x7C00; /* 2^16 and above: infinity */
    if (x < 0x38800000u) /* below 2^-14: a subnormal half, |f| x 2^24 rounded (exact scaling) */
        return sign | (uint16_t)rintf(fabsf(f) * 16777216.0f);
    uint32_t h = (x >> 13) - (112u << 10), rem = x & 0x1FFFu; /* exponent rebiased by 127 - 15 */
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* a carry moves the exponent on */
    return sign | (uint16_t)h;
#endif
}

/* The centres' summaries after a decode step (`kvstrategies.sparse.summarize_torch`, the same
 * operations in the same order, so both give the same bytes): the step's n keys k of every
 * layer l and KV head h (token t's at k + l * k_layer + (t * hkv + h) * d), all of them within
 * summary `index`, update its running minimum and maximum (`opened` [2][layers][hkv][d]: taken
 * from those where goes_on, else started anew) and its codes and scale: the centre c = (max +
 * min) / 2 and, where `ranged`, the half-range r = (max - min) / 2, over one scale (the largest
 * |c| / 127, and r's / 126) as int8 codes round(c / scale) (half to even) and ceil(r / scale +
 * 0.501), into row index % 16 of tile index / 16 of `codes` [layers][hkv][tiles][w / 4][16][4]
 * (w = 2d ranged, else d) and the scale into `scales` [layers][hkv][cap]. Why: in PyTorch that
 * was about twenty small ops a step, 0.33 ms of a 4.8 ms step at 300 tokens (SmolLM2, the
 * default strategy's `hybrid+resident+sparse`); here it is one pass over the step's keys.
 * Returns 0, or -1 (arguments out of their limits; nothing written). */
int sparse_summarize(const float *k, long layers, long n, long k_layer, int hkv, int d,
                     float *opened, int goes_on, int ranged, int8_t *codes, long tiles,
                     float *scales, long cap, long index) {
    const int w = ranged ? 2 * d : d;
    if (layers < 1 || n < 1 || hkv < 1 || d < 1 || d > 1024 || w % 4 || k_layer < n * hkv * d ||
        index < 0 || index >= cap || index / TILE >= tiles)
        return -1;
    float c[1024], r[1024];
    for (long l = 0; l < layers; l++)
        for (int h = 0; h < hkv; h++) {
            float *mn = opened + (l * hkv + h) * d, *mx = opened + ((layers + l) * hkv + h) * d;
            const float *kh = k + l * k_layer + (long)h * d;
            float top = 0.0f, rtop = 0.0f;
            for (int j = 0; j < d; j++) {
                float a = kh[j], b = kh[j];
                for (long t = 1; t < n; t++) {
                    const float x = kh[t * hkv * d + j];
                    a = x < a ? x : a;
                    b = x > b ? x : b;
                }
                if (goes_on) {
                    a = mn[j] < a ? mn[j] : a;
                    b = mx[j] > b ? mx[j] : b;
                }
                mn[j] = a, mx[j] = b;
                c[j] = (b + a) * 0.5f;
                top = fabsf(c[j]) > top ? fabsf(c[j]) : top;
                if (ranged) {
                    r[j] = (b - a) * 0.5f;
                    rtop = r[j] > rtop ? r[j] : rtop;
                }
            }
            top /= 127.0f;
            if (ranged && rtop / 126.0f > top) top = rtop / 126.0f;
            const float div = top > 0.0f ? top : 1.0f;
            int8_t *tile = codes + (((l * hkv + h) * tiles + index / TILE) * (w / 4) * TILE +
                                    index % TILE) * 4;
            for (int j = 0; j < w; j++) {
                float x;
                if (j < d) {
                    x = rintf(c[j] / div);
                    x = x > 127.0f ? 127.0f : x < -127.0f ? -127.0f : x;
                } else {
                    x = ceilf(r[j - d] / div + 0.501f);
                    x = x > 127.0f ? 127.0f : x < 0.0f ? 0.0f : x;
                }
                tile[(long)(j / 4) * TILE * 4 + j % 4] = (int8_t)x;
            }
            scales[(l * hkv + h) * cap + index] = top;
        }
    return 0;
}

/* A channel's float16 minimum m and step s from its keys' minimum lo and maximum hi, and both
 * as floats (the reference's order: s from the rounded minimum). */
static inline void key_scale(float lo, float hi, uint16_t *m, uint16_t *s, float *mf, float *sf) {
    *m = float_half(lo);
    *mf = half_float(*m);
    *s = float_half((hi - *mf) / 15.0f);
    *sf = half_float(*s);
}

/* A key's code in a channel of minimum mf and step sf: round((x - mf) / sf) in 0..15, 0 where
 * the step is 0 (and for a NaN). */
static inline uint8_t key_code(float x, float mf, float sf) {
    float v = sf > 0.0f ? rintf((x - mf) / sf) : 0.0f;
    v = v > 15.0f ? 15.0f : v >= 0.0f ? v : 0.0f;
    return (uint8_t)v;
}

/* Keys xg[from..len) of one group (from < len) written into its tiles at o, through the end
 * of the tile holding key len - 1: each key's codes packed as a tile holds them (byte 4j + i:
 * channel 8j + i's code, channel 8j + 4 + i's in the high nibble), the last tile's slots past
 * len - 1 repeating its last key (as the reference pads). */
static void put_keys(const float *xg, long from, long len, int d, const float *mf,
                     const float *sf, uint8_t *o) {
    uint8_t c[DMAX], pk[DMAX / 2];
    for (long t = from; t < (len + TILE - 1) / TILE * TILE; t++) {
        if (t < len) { /* past it, the padding: key len - 1's bytes again */
            const float *x = xg + t * d;
            for (int ch = 0; ch < d; ch++) c[ch] = key_code(x[ch], mf[ch], sf[ch]);
            for (int j = 0; j < d / 8; j++)
                for (int i = 0; i < 4; i++)
                    pk[j * 4 + i] = (uint8_t)(c[8 * j + i] | (c[8 * j + 4 + i] << 4));
        }
        uint8_t *tile = o + t / TILE * 8 * d;
        for (int j = 0; j < d / 8; j++) memcpy(tile + (j * TILE + t % TILE) * 4, pk + j * 4, 4);
    }
}

/* Keys x (row r's n tokens at x + r * stride, each d float32) as `quantize_keys` and
 * `tile_keys` make them, per group of g tokens (g a multiple of 16; the last group may hold
 * fewer): each channel's minimum m and step s = (max - m) / 15 as float16 (`params`
 * [rows][groups][2][d]), a token's code round((x - m) / s) in 0..15 (0 where s is 0), packed
 * into tiles of 16 tokens ([d / 8][16][4] bytes: `codes` [rows][tiles][8d], tiles = n / 16
 * rounded up; a last tile's missing tokens repeat its last key, as the reference pads). The
 * same operations as torch's, in the same order, so that both give the same bytes. */
static int quantize_key_rows(const float *x, long rows, long n, long stride, int g, int d,
                             uint8_t *codes, long cstride, uint16_t *params, long pstride,
                             int threads) {
    if (rows < 0 || n <= 0 || stride < n * d || g <= 0 || g % TILE || d <= 0 || d % 8 ||
        d > DMAX)
        return -1;
    const long groups = (n + g - 1) / g;
#pragma omp parallel for schedule(static) num_threads(rows * groups > 1 ? threads : 1)
    for (long rg = 0; rg < rows * groups; rg++) {
        const long r = rg / groups, gi = rg % groups;
        const int len = n - gi * g < g ? (int)(n - gi * g) : g; /* tokens in this group */
        const float *xg = x + r * stride + gi * g * d;
        float lo[DMAX], hi[DMAX], mf[DMAX], sf[DMAX];
        uint16_t *m16 = params + r * pstride + gi * 2 * d, *s16 = m16 + d;
        for (int ch = 0; ch < d; ch++) lo[ch] = hi[ch] = xg[ch];
        for (int k = 1; k < len; k++)
            for (int ch = 0; ch < d; ch++) {
                const float v = xg[(long)k * d + ch];
                lo[ch] = v < lo[ch] ? v : lo[ch];
                hi[ch] = v > hi[ch] ? v : hi[ch];
            }
        for (int ch = 0; ch < d; ch++)
            key_scale(lo[ch], hi[ch], m16 + ch, s16 + ch, mf + ch, sf + ch);
        put_keys(xg, 0, len, d, mf, sf, codes + r * cstride + gi * (g / TILE) * 8 * d);
    }
    return 0;
}

/* The codes as [rows][tiles][8d] and the minima and steps as [rows][groups][2][d], contiguous. */
int sparse_quantize_keys(const float *x, long rows, long n, long stride, int g, int d,
                         uint8_t *codes, uint16_t *params, int threads) {
    if (g <= 0 || d <= 0) return -1;
    const long groups = (n + g - 1) / g, tiles = (n + TILE - 1) / TILE;
    return quantize_key_rows(x, rows, n, stride, g, d, codes, tiles * 8 * d, params,
                             groups * 2 * d, threads);
}

/* A decode step's keys into every layer's and KV head's open group of 4-bit keys, in place,
 * as `kvstrategies.sparse.add_keys_torch` does it, byte for byte: the n tokens of k
 * ([layers][n][hkv][d] float32, layer l at k + l * kstride) are copied to tokens [have, have
 * + n) of `opened` ([layers][hkv][g][d]: the open group's keys so far), the group's running
 * minimum and maximum `span` ([layers][hkv][2][d] float32) take them in, and the group's
 * minima and steps (params + r * pstride) and tiles (codes + r * cstride, from the group's
 * first tile; row r = l * hkv + h) become those of its first have + n keys quantized as one
 * group. Incrementally: a code depends only on its key and its channel's minimum and step, so
 * only the new tokens' codes (and the last tile's padding, which repeats the last key) are
 * computed, and every earlier token's only in a channel whose float16 minimum or step moved.
 * Why: quantizing the whole open group again each step read it twice (up to 128 keys a layer
 * and head) and had the default strategy's loop at a short context, where every block is read
 * and only the summaries are kept up, at 0.88 of its format's alone. */
int sparse_add_keys(const float *k, long layers, long n, long kstride, int hkv, int d,
                    float *opened, float *span, int g, long have, uint8_t *codes, long cstride,
                    uint16_t *params, long pstride, int threads) {
    if (layers <= 0 || n <= 0 || hkv <= 0 || d <= 0 || d % 8 || d > DMAX || have < 0 ||
        g <= 0 || g % TILE || have + n > g || kstride < n * hkv * d || cstride < 0 || pstride < 0)
        return -1;
    const long rows = layers * hkv, len = have + n;
#pragma omp parallel for schedule(static) num_threads(rows > 1 ? threads : 1)
    for (long r = 0; r < rows; r++) {
        const long l = r / hkv, h = r % hkv;
        float *xg = opened + r * g * d, *lo = span + r * 2 * d, *hi = lo + d;
        uint16_t *m16 = params + r * pstride, *s16 = m16 + d;
        uint8_t *o = codes + r * cstride;
        float mf[DMAX], sf[DMAX];
        unsigned char moved[DMAX];
        for (long j = 0; j < n; j++) {
            const float *x = k + l * kstride + (j * hkv + h) * d;
            memcpy(xg + (have + j) * d, x, sizeof(float) * d);
            for (int ch = 0; ch < d; ch++) {
                const float v = x[ch];
                lo[ch] = (have || j) && lo[ch] <= v ? lo[ch] : v;
                hi[ch] = (have || j) && hi[ch] >= v ? hi[ch] : v;
            }
        }
        for (int ch = 0; ch < d; ch++) {
            uint16_t m, st;
            key_scale(lo[ch], hi[ch], &m, &st, mf + ch, sf + ch);
            moved[ch] = !have || m != m16[ch] || st != s16[ch];
            m16[ch] = m, s16[ch] = st;
        }
        /* token t's code in channel ch into its nibble, for the earlier tokens of a channel
         * that moved (a few a step once a group has some keys) */
        for (int ch = 0; ch < d; ch++)
            if (moved[ch])
                for (long t = 0; t < have; t++) {
                    const uint8_t v = key_code(xg[t * d + ch], mf[ch], sf[ch]);
                    uint8_t *b = o + ((t / TILE * (d / 8) + ch / 8) * TILE + t % TILE) * 4 + ch % 4;
                    const int sh = ch % 8 < 4 ? 0 : 4;
                    *b = (uint8_t)((*b & (0xF0 >> sh)) | (v << sh));
                }
        put_keys(xg, have, len, d, mf, sf, o); /* the new keys whole, the last tile's padding */
    }
    return 0;
}

/* One query against one tile's minima mf and steps sf: a = q sf as int8 codes ac (a times the
 * reciprocal of its scale, rounded half to even), their scale *scale and q . mf (*bias): the
 * reference's operations but for the order of that sum. Vectors where d fills them. */
static inline void key_query(const float *q, const float *mf, const float *sf, int d, int8_t *ac,
                             float *scale, float *bias) {
    float a[DMAX];
#if CHOOSE_ISA == 2
    if (d % 16 == 0) {
        __m512 mx = _mm512_setzero_ps(), b = _mm512_setzero_ps();
        for (int c = 0; c < d; c += 16) {
            const __m512 qv = _mm512_loadu_ps(q + c), av = _mm512_mul_ps(qv, _mm512_loadu_ps(sf + c));
            _mm512_storeu_ps(a + c, av);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(av));
            b = _mm512_add_ps(b, _mm512_mul_ps(qv, _mm512_loadu_ps(mf + c)));
        }
        const float sc = _mm512_reduce_max_ps(mx) / (float)KMAX;
        const __m512 inv = _mm512_set1_ps(sc > 0.0f ? 1.0f / sc : 0.0f);
        for (int c = 0; c < d; c += 16) /* rounded in the default mode: to nearest, ties to even */
            _mm_storeu_si128((__m128i *)(ac + c),
                             _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(a + c), inv))));
        *scale = sc, *bias = _mm512_reduce_add_ps(b);
        return;
    }
#elif CHOOSE_ISA == 1
    if (d % 8 == 0) {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int c = 0; c < d; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + c), av = _mm256_mul_ps(qv, _mm256_loadu_ps(sf + c));
            _mm256_storeu_ps(a + c, av);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, av));
            b = _mm256_add_ps(b, _mm256_mul_ps(qv, _mm256_loadu_ps(mf + c)));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        __m128 b4 = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
        b4 = _mm_add_ps(b4, _mm_movehl_ps(b4, b4));
        b4 = _mm_add_ss(b4, _mm_shuffle_ps(b4, b4, 1));
        const float sc = _mm_cvtss_f32(m4) / (float)KMAX;
        const __m256 inv = _mm256_set1_ps(sc > 0.0f ? 1.0f / sc : 0.0f);
        for (int c = 0; c < d; c += 8) { /* rounded to nearest, ties to even; packed in order */
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + c), inv));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i *)(ac + c), _mm_packs_epi16(w, w));
        }
        *scale = sc, *bias = _mm_cvtss_f32(b4);
        return;
    }
#endif
    float amax = 0.0f, b = 0.0f;
    for (int c = 0; c < d; c++) {
        a[c] = q[c] * sf[c];
        amax = MAX(fabsf(a[c]), amax);
        b += q[c] * mf[c];
    }
    const float sc = amax / (float)KMAX, inv = sc > 0.0f ? 1.0f / sc : 0.0f;
    for (int c = 0; c < d; c++) {
        float v = rintf(a[c] * inv);
        v = v > KMAX ? KMAX : v < -KMAX ? -KMAX : v;
        ac[c] = (int8_t)v;
    }
    *scale = sc, *bias = b;
}

/* best[k] = the largest of best[k] and bias[u] + scale[u] x (the integer dot of ac[u] with
 * token k's codes) over the queries u < nu, for the 16 tokens of one tile. */
static inline __attribute__((always_inline)) void key_tile_n(const int8_t *ac, const float *scale,
                                                             const float *bias, const int nu,
                                                             int d, const uint8_t *tile,
                                                             float *best) {
#if CHOOSE_ISA == 2
    __m512i acc[QT];
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++) acc[u] = _mm512_setzero_si512();
    for (int j = 0; j < d / 8; j++) {
        const __m512i x = _mm512_loadu_si512(tile + j * 64);
        const __m512i lo = _mm512_and_si512(x, low), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
#pragma GCC unroll 4
        for (int u = 0; u < nu; u++) {
            int32_t a0, a1;
            memcpy(&a0, ac + (long)u * d + 8 * j, 4);
            memcpy(&a1, ac + (long)u * d + 8 * j + 4, 4);
            acc[u] = _mm512_dpbusd_epi32(acc[u], lo, _mm512_set1_epi32(a0));
            acc[u] = _mm512_dpbusd_epi32(acc[u], hi, _mm512_set1_epi32(a1));
        }
    }
    __m512 m = _mm512_loadu_ps(best);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++)
        m = _mm512_max_ps(_mm512_add_ps(_mm512_set1_ps(bias[u]),
                                        _mm512_mul_ps(_mm512_cvtepi32_ps(acc[u]), _mm512_set1_ps(scale[u]))),
                          m);
    _mm512_storeu_ps(best, m);
#elif CHOOSE_ISA == 1
    __m256i acc[QT][2];
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++) acc[u][0] = acc[u][1] = _mm256_setzero_si256();
    for (int j = 0; j < d / 8; j++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(tile + j * 64));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(tile + j * 64 + 32));
        const __m256i l0 = _mm256_and_si256(x0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), low);
        const __m256i l1 = _mm256_and_si256(x1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), low);
#pragma GCC unroll 4
        for (int u = 0; u < nu; u++) {
            int32_t a0, a1;
            memcpy(&a0, ac + (long)u * d + 8 * j, 4);
            memcpy(&a1, ac + (long)u * d + 8 * j + 4, 4);
            const __m256i y0 = _mm256_set1_epi32(a0), y1 = _mm256_set1_epi32(a1);
            /* two pairs of products in int16: at most 4 x 15 x 127 */
            const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, y0), _mm256_maddubs_epi16(h0, y1));
            const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(l1, y0), _mm256_maddubs_epi16(h1, y1));
            acc[u][0] = _mm256_add_epi32(acc[u][0], _mm256_madd_epi16(p0, ones));
            acc[u][1] = _mm256_add_epi32(acc[u][1], _mm256_madd_epi16(p1, ones));
        }
    }
    __m256 m0 = _mm256_loadu_ps(best), m1 = _mm256_loadu_ps(best + 8);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++) {
        const __m256 f = _mm256_set1_ps(scale[u]), b = _mm256_set1_ps(bias[u]);
        m0 = _mm256_max_ps(_mm256_add_ps(b, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[u][0]), f)), m0);
        m1 = _mm256_max_ps(_mm256_add_ps(b, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[u][1]), f)), m1);
    }
    _mm256_storeu_ps(best, m0);
    _mm256_storeu_ps(best + 8, m1);
#else /* the plain sum: the same integer */
    for (int u = 0; u < nu; u++)
        for (int k = 0; k < TILE; k++) {
            int a = 0;
            for (int j = 0; j < d / 8; j++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t x = tile[j * 64 + k * 4 + i];
                    a += (int)ac[(long)u * d + 8 * j + i] * (x & 15) + (int)ac[(long)u * d + 8 * j + 4 + i] * (x >> 4);
                }
            const float v = bias[u] + (float)a * scale[u];
            best[k] = v > best[k] ? v : best[k];
        }
#endif
}

static void key_tile(const int8_t *ac, const float *scale, const float *bias, int nu, int d,
                     const uint8_t *tile, float *best) {
    switch (nu) {
    case 1: key_tile_n(ac, scale, bias, 1, d, tile, best); break;
    case 2: key_tile_n(ac, scale, bias, 2, d, tile, best); break;
    case 3: key_tile_n(ac, scale, bias, 3, d, tile, best); break;
    default: key_tile_n(ac, scale, bias, QT, d, tile, best); break;
    }
}

/* Scores of the tokens in tiles [t0, t1) of one KV head from its keys: s[i] for token
 * t0 * TILE + i. qf: the head's nq queries [nq][d] float32; tiles: its codes (8d bytes a tile);
 * par: its minima and steps (2d float16 for each group of `per` tiles). A query's codes are
 * computed once per group. */
static void score_key_tiles(const float *qf, int nq, int d, const uint8_t *tiles,
                            const uint16_t *par, long per, long t0, long t1, float *s) {
    int8_t ac[QT * DMAX];
    float mf[DMAX], sf[DMAX], scale[QT], bias[QT];
    for (long k = 0; k < (t1 - t0) * TILE; k++) s[k] = -INFINITY;
    for (int j = 0; j < nq; j += QT) {
        const int nu = nq - j < QT ? nq - j : QT;
        for (long t = t0; t < t1; t++) {
            const uint16_t *p = par + t / per * 2 * d;
            if (t == t0 || t % per == 0) {
                int c = 0;
#if CHOOSE_ISA == 2
                for (; c + 16 <= d; c += 16) {
                    _mm512_storeu_ps(mf + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + c))));
                    _mm512_storeu_ps(sf + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + d + c))));
                }
#elif CHOOSE_ISA == 1 && defined(__F16C__)
                for (; c + 8 <= d; c += 8) {
                    _mm256_storeu_ps(mf + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + c))));
                    _mm256_storeu_ps(sf + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + d + c))));
                }
#endif
                for (; c < d; c++) mf[c] = half_float(p[c]), sf[c] = half_float(p[d + c]);
                for (int u = 0; u < nu; u++)
                    key_query(qf + (long)(j + u) * d, mf, sf, d, ac + (long)u * d, scale + u, bias + u);
            }
            if (CHOOSE_AHEAD) { /* a tile is 8d bytes */
                const char *a = (const char *)(tiles + (t + CHOOSE_AHEAD) * 8 * d);
                for (int o = 0; o < 8 * d; o += 64) __builtin_prefetch(a + o, 0, CHOOSE_HINT);
            }
            key_tile(ac, scale, bias, nu, d, tiles + t * 8 * d, s + (t - t0) * TILE);
        }
    }
}



/* e^x for x <= 0 (or -inf: 0), vectorizable (libm's expf is a call per element): the Cephes
 * polynomial on x - n ln 2, times 2^n; relative error about 2e-7. */
static inline float exp_neg(float x) {
    const float c = x < -87.0f ? -87.0f : x;
    const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round: 1.5 * 2^23 */
    const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } two = {.i = ((int32_t)n + 127) << 23};
    return x == -INFINITY ? 0.0f : p * two.f;
}

/* sh[b] = the largest of sp[b * parts .. (b + 1) * parts), for b < n. For 8 parts (the
 * default) as a tree, three compares deep: one chain of seven serial compares per block was
 * a third of the choice's time. */
static void block_max(const float *sp, long n, int parts, float *sh) {
    if (parts == 8)
        for (long b = 0; b < n; b++) {
            const float *x = sp + b * 8;
            sh[b] = MAX(MAX(MAX(x[0], x[1]), MAX(x[2], x[3])), MAX(MAX(x[4], x[5]), MAX(x[6], x[7])));
        }
    else
        for (long b = 0; b < n; b++) {
            float best = sp[b * parts];
            for (int p = 1; p < parts; p++) best = MAX(sp[b * parts + p], best);
            sh[b] = best;
        }
}

static void block_lse(float *sp, long n, int parts, float temp, float *zb, float *lb);
static void block_lse_mass(float *lb, const float *zb, long n);

/* A spinning thread's pause (the other thread is about to finish). */
static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* KV head h's row of `out` (sparse_choose's): the sinks, the `room` best of its n block scores
 * (s + h * 2n: a block's best summary's, or block_lse's mass), the window. */
static void rank_one(int h, int64_t *out, long width, long lo, long hi, long end, long room,
                     float *s, long n, float temp, int early, float *ss, long ns, long s0,
                     long t0, int parts) {
    int64_t *o = out + h * width;
    for (long b = 0; b < lo; b++) o[b] = b;
    for (long b = hi; b < end; b++) o[lo + room + b - hi] = b;
    if (!room) return;
    float *sh = s + h * (2 * n), *tmp = sh + n;
    if (temp <= 0.0f && !early) /* from summary lo * parts */
        block_max(ss + h * ns + (s0 - t0 * TILE), n, parts, sh);
    if (temp > 0.0f) /* the mass from block_lse's lb and zb */
        block_lse_mass(sh, tmp, n);
    const float thr = kth_largest(sh, n, room, (uint32_t *)tmp);
    long above = 0; /* blocks above the threshold: all taken; of those equal to it, the first in
                       block order fill the rest, so the chosen come out sorted (without a
                       branch per block) */
    for (long b = 0; b < n; b++) above += sh[b] > thr;
    long k = 0, equal = room - above;
    for (long b = 0; b < n && k < room; b++) {
        const int eq = sh[b] == thr, take = (sh[b] > thr) | (eq & (equal > 0));
        equal -= eq;
        o[lo + k] = lo + b;
        k += take;
    }
}

/* q [rows, hq, d] float32 (hq = hkv * group); codes (int8) and scales (float32): KV head h's
 * summaries at codes + h * head_stride, in tiles of 16 (`w` codes each, w % 4 == 0: 2d,
 * centre and half-range, or d, the centre alone; `parts` per block, block b's first is
 * summary b * parts) and their scales at scales + h * scale_stride. Writes out [hkv, lo + room
 * + (end - hi)] int64 per KV head: the sink blocks 0..lo-1, the `room` best of the candidates
 * [lo, hi), then the window hi..end-1; a block's score: its summaries' largest (temp = 0) or
 * their mass at scale temp (`block_lse`). Returns 0, or -1 for arguments out of its
 * limits (or no memory). w <= 1024 keeps every integer dot exact as a float. */
int sparse_choose(const float *q, int rows, int hq, int hkv, int d, const int8_t *codes,
                  const float *scales, long head_stride, long scale_stride, int parts, int w,
                  long lo, long hi, long room, long end, float alpha, float temp, int64_t *out,
                  int threads) {
    const int group = hkv > 0 ? hq / hkv : 0, nq = rows * group, nqp = (nq + QT - 1) / QT * QT;
    const long n = hi - lo, width = lo + room + (end - hi);
    const int keys = d > 0 && 2 * w == d; /* 4-bit keys (above), not centres */
    if (hkv <= 0 || hq % hkv || nq <= 0 || d <= 0 || (w != d && w != 2 * d && !keys) || w % 4 ||
        w > 1024 || (keys && (d % 8 || d > DMAX)) || parts <= 0 || lo < 0 || n < 0 || room < 0 ||
        room > n || end < hi || !(temp >= 0.0f) || isinf(temp))
        return -1;
    /* Keys: a head's minima and steps cover the tokens its codes do, one entry per group of
     * `per` tiles, so per is the ratio of the two head strides (the callers check both). */
    long per = 1;
    if (keys) {
        const long tiles = head_stride / (8L * d), groups = scale_stride / (2L * d);
        if (head_stride % (8L * d) || scale_stride % (2L * d) || groups <= 0 || tiles % groups)
            return -1;
        per = tiles / groups;
    }
    /* the tiles that hold summaries [lo * parts, hi * parts), scored whole */
    const long s0 = lo * parts, t0 = s0 / TILE, t1 = (hi * parts + TILE - 1) / TILE;
    const long nt = n ? t1 - t0 : 0, ns = nt * TILE, nqs = (long)hkv * nqp;
    float *qs = malloc(sizeof(float) * (nqs + (size_t)hkv * (ns + 2 * (size_t)n) + w) +
                       sizeof(int) * nqs + (size_t)nqs * w);
    if (!qs) return -1;
    float *ss = qs + nqs, *s = ss + (long)hkv * ns, *qa = s + (long)hkv * (2 * n);
    int *xq = (int *)(qa + w);
    int8_t *qc = (int8_t *)(xq + nqs);
    memset(qc, 0, (size_t)nqs * w); /* the padding queries: codes 0 */
    memset(xq, 0, sizeof(int) * nqs);
    /* Keys: the queries as they are, per head [nq][d] (quantized per tile as they are scored).
     * Centres: each query vector [q, alpha |q|] as codes in [-QMAX, QMAX] and one scale (torch's
     * order of operations: the scale is amax / QMAX, a code round(x / scale), half to even). */
    float *qf = keys ? malloc(sizeof(float) * (size_t)hkv * nq * d) : NULL;
    if (keys && !qf) {
        free(qs);
        return -1;
    }
    if (keys)
        for (int h = 0; h < hkv; h++)
            for (int r = 0; r < rows; r++)
                memcpy(qf + ((long)h * nq + (long)r * group) * d, q + ((long)r * hq + h * group) * d,
                       sizeof(float) * group * d);
    else
        for (int h = 0; h < hkv; h++)
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < group; g++) {
                    const float *src = q + ((long)r * hq + h * group + g) * d;
                    const long j = (long)h * nqp + r * group + g;
                    float amax = 0.0f;
                    for (int i = 0; i < w; i++) {
                        qa[i] = i < d ? src[i] : alpha * fabsf(src[i - d]);
                        const float m = fabsf(qa[i]);
                        amax = m > amax ? m : amax;
                    }
                    const float scale = amax / (float)QMAX;
                    int sum = 0;
                    for (int i = 0; i < w; i++) {
                        float c = scale > 0.0f ? rintf(qa[i] / scale) : 0.0f;
                        c = c > QMAX ? QMAX : c < -QMAX ? -QMAX : c;
                        qc[j * w + i] = (int8_t)c;
                        sum += (int)c;
                    }
                    qs[j] = scale;
                    xq[j] = 128 * sum;
                }
    /* Scoring in chunks of 4 tiles over the threads (keys: 8, from a multiple of 8, so that
     * a group of up to 128 tokens, whose tiles share the queries' codes, is one chunk's), then
     * per head (over the threads too) a block's score, its summaries' largest, and top-k. A
     * small layer runs on one thread (the fork costs more than it saves). */
    const long chunk = keys ? 8 : 4, base = t0 - t0 % chunk;
    const long chunks = nt ? (t1 - base + chunk - 1) / chunk : 0;
    const int team = (long)nq * ns * w < (1L << 17) ? 1 : threads;
    /* A block's score is taken by the thread that scored its summaries, right after its chunk,
     * where every block lies within one chunk (parts divides a chunk's summaries): read later
     * by the thread that ranks the head, the scores (16 KB a head at 8K tokens) had to cross
     * to the other core first. 28 layers' choice at 8K, 2 threads, in cache: the ranking's
     * part 0.25 ms before. Their largest (temp = 0, `block_max`), or their mass against the
     * chunk's best (`block_lse`), which the ranking scales to the head's best: no pass over
     * every summary's score for the head's best first, and no second pass for the exps (keys,
     * lse, the same choice: 1.15-1.19 -> 1.00-1.05 ms, one thread 2.13 -> 1.86 ms). */
    const int early = room && (chunk * TILE) % parts == 0;
    /* A head's scores are ranked once all its chunks are: `ready[h]` counts them, so a thread
     * that finished its share of the scoring ranks a head whose chunks are done instead of
     * waiting for the other thread at a barrier (28 layers' choice at 8K, 2 threads: the
     * worker waited 0.19 ms a step there, the ranking itself 0.14). */
    atomic_long *ready = malloc(sizeof(atomic_long) * (size_t)hkv), next = 0;
    if (!ready) {
        free(qs);
        free(qf);
        return -1;
    }
    for (int h = 0; h < hkv; h++) atomic_init(&ready[h], 0);
#define rank_head(h) rank_one(h, out, width, lo, hi, end, room, s, n, temp, early, ss, ns, s0, \
                              t0, parts)
#pragma omp parallel num_threads(team)
    {
        long cur = 0, count = 0; /* this thread's chunks of head `cur` not yet counted in ready */
#pragma omp for schedule(static) nowait
        for (long c = 0; c < hkv * chunks; c++) {
            const long h = c / chunks, from = base + (c % chunks) * chunk;
            if (h != cur && count) { /* a thread's chunks are consecutive: one add a head */
                atomic_fetch_add_explicit(&ready[cur], count, memory_order_release);
                count = 0;
            }
            cur = h;
            const long a = from < t0 ? t0 : from, b = from + chunk < t1 ? from + chunk : t1;
            if (keys)
                score_key_tiles(qf + h * nq * d, nq, d, (const uint8_t *)codes + h * head_stride,
                                (const uint16_t *)(const void *)scales + h * scale_stride, per, a,
                                b, ss + h * ns + (a - t0) * TILE);
            else
                score_tiles(qc + h * nqp * w, qs + h * nqp, xq + h * nqp, nq, w,
                            codes + h * head_stride, scales + h * scale_stride, a, b,
                            ss + h * ns + (a - t0) * TILE);
            if (early) { /* the chunk's blocks' largest, while its scores are in this core's
                            cache: summaries [f0, f1), whole blocks (parts divides a chunk) */
                const long f0 = a * TILE > s0 ? a * TILE : s0;
                const long f1 = b * TILE < s0 + n * parts ? b * TILE : s0 + n * parts;
                if (f1 > f0 && temp <= 0.0f)
                    block_max(ss + h * ns + (f0 - t0 * TILE), (f1 - f0) / parts, parts,
                              s + h * (2 * n) + (f0 - s0) / parts);
                else if (f1 > f0)
                    block_lse(ss + h * ns + (f0 - t0 * TILE), (f1 - f0) / parts, parts, temp,
                              s + h * (2 * n) + n + (f0 - s0) / parts,
                              s + h * (2 * n) + (f0 - s0) / parts);
            }
            count++;
        }
        if (count) atomic_fetch_add_explicit(&ready[cur], count, memory_order_release);
        /* where a block spans chunks (parts does not divide one): the mass of each block as
           `block_lse` takes it, in runs of 64 blocks over the threads (against each run's best),
           after every chunk is scored; the largest (a few compares) per head in rank_one. */
        const long runs = temp > 0.0f && room && !early ? (n + 63) / 64 : 0;
        if (runs) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (long c = 0; c < hkv * runs; c++) {
                const long h = c / runs, b0 = (c % runs) * 64, nb = n - b0 < 64 ? n - b0 : 64;
                float *sh = s + h * (2 * n);
                block_lse(ss + h * ns + (s0 - t0 * TILE) + b0 * parts, nb, parts, temp,
                          sh + n + b0, sh + b0);
            }
#pragma omp for schedule(static)
            for (int h = 0; h < hkv; h++) rank_head(h);
        } else { /* each head ranked as soon as its chunks are scored, by whichever thread is
                    free first (see `ready`) */
            for (long h; (h = atomic_fetch_add(&next, 1)) < hkv;) {
                while (atomic_load_explicit(&ready[h], memory_order_acquire) < chunks) relax();
                rank_head((int)h);
            }
        }
    }
#undef rank_head
    free(ready);
    free(qs);
    free(qf);
    return 0;
}

/* ---- attention over the chosen blocks, in place --------------------------------------------
 *
 * Why: the PyTorch path gathers the chosen blocks' K and V into a new tensor (one index_select:
 * the bytes are read, written and read again) and runs scaled_dot_product_attention over the
 * copy; at 1/8 of an 8K context that fixed cost was most of a sparse layer's attention. Here
 * each block's keys and values are read once from the arena where they lie.
 *
 * Per KV head the chosen blocks are split in `parts` ranges over the threads; each range keeps
 * a running softmax per query (its max m, sum l and weighted values), updated block by block
 * in one pass over keys and values, and the ranges are merged at the end as flash-decoding
 * does: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. Query row r (of the step's T
 * new tokens) sees sequence positions <= past + r, so a chunk's rows are causal over the
 * step's own tokens in the window's last block and a partly filled block's empty slots are
 * never read, as keys or as values.
 *
 * Where the time went (8K tokens, 1/8 read, one core, blocks in cache: 24 ns per key and
 * query before, 12 after): a dot product written as one `omp simd` sum is one chain of
 * dependent adds and a horizontal sum through memory per key; `dot8` keeps eight keys' sums
 * apart and adds them across in one transpose. libm's expf is a call per score; `exp_neg` is a
 * polynomial. Then (one core, 256 tokens of 3 KV heads in cache, a GQA group of 3: 7.2 ns a
 * key and query before, 5.5 after; 30 layers' dense 8K cache from memory, 2 threads: 26.3 ms
 * before, 20.1 after): a row's queries of one KV head go through a block together, so each
 * value row is loaded once for all of them (`add_values_n`); with AVX-512 the dot products,
 * exps and sums run 16 lanes wide (`dotw`, `exp_negw`); the compiler's own vectorization of
 * the exp loop had fallen back to scalar code inside the inlined kernel; the common head dims
 * are constants (`attend_range`), so a key's 16 rows are offsets from one register. */

/* Ask for a block's floats ahead of its use: the blocks lie apart (a 16-token block's keys are
 * 4 KB of one head's rows), where the hardware prefetcher, which follows one stream within a
 * page, does not reach. Each item (a part of one head's blocks) is walked as one stream that
 * asks for the blocks PF_AHEAD ahead. */
#ifndef PF_AHEAD
#define PF_AHEAD 4 /* blocks */
#endif
#ifndef PF_HINT
#define PF_HINT 2 /* prefetcht1: into the L2, where the L1 keeps the block being read; against
                   * prefetcht0, level or faster in every case tried (30 layers' 8K dense cache:
                   * 20.1 against 20.3 ms; 1/8 of it: 2.56 against 2.58; 64K keys from memory:
                   * 12.6 against 14.2 ns a key and query) */
#endif
static inline void prefetch_block(const char *p, long floats) {
    for (long o = 0; o < floats * 4; o += 64) __builtin_prefetch(p + o, 0, PF_HINT);
}

/* The wide path's vectors: 16 floats where the compiler has AVX-512, else 8 (AVX2; two SSE or
 * NEON registers elsewhere). */
#if defined(__AVX512F__)
#define AW 16
#define AV 4 /* vectors of channels a query's values add per pass (registers: AV x UB + AV + 1) */
#else
#define AW 8
#define AV 2
#endif
#define UB 4 /* a row's queries (of a GQA group) attended together over a block */
typedef float vw __attribute__((vector_size(AW * 4)));
static inline __attribute__((always_inline)) vw loadw(const float *p) {
    vw x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline __attribute__((always_inline)) void storew(float *p, vw x) { memcpy(p, &x, sizeof x); }

#if AW == 16
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v16i __attribute__((vector_size(64)));
#define SHUF16(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif
/* Lane j of the result: the sum of a[j]'s 16 lanes (sum8x8's transpose-and-add, four levels). */
static inline __attribute__((always_inline)) vw sum_across(const vw *a) {
    vw b[8], c[4], e[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        b[i] = SHUF16(a[2 * i], a[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                      30) +
               SHUF16(a[2 * i], a[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                      31);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        c[i] = SHUF16(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                      29) +
               SHUF16(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                      31);
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        e[i] = SHUF16(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                      27) +
               SHUF16(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                      31);
    return SHUF16(e[0], e[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF16(e[0], e[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
#else
static inline __attribute__((always_inline)) vw sum_across(const vw *a) {
    return sum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
}
#endif

/* The wide path's lane-wise max, exp and the sums and largest across the lanes. */
typedef int32_t vwi __attribute__((vector_size(AW * 4)));
static inline __attribute__((always_inline)) vw vmax(vw a, vw b) {
    const vwi gt = a > b;
    return (vw)(((vwi)a & gt) | ((vwi)b & ~gt));
}
/* exp_neg lane by lane: the same polynomial and the same steps. */
static inline __attribute__((always_inline)) vw exp_negw(vw x) {
    const vwi low = x < -87.0f;
    const vw c = (vw)(((vwi)((vw){0} - 87.0f) & low) | ((vwi)x & ~low));
    const vw n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vw r = c - n * 0.693359375f + n * 2.12194440e-4f;
    vw p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vwi two = (__builtin_convertvector(n, vwi) + 127) << 23;
    return (vw)((vwi)(p * (vw)two) & ~(x == -INFINITY));
}
#if AW == 16
#define SWAP8(x) SHUF16(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define SWAP4(x) SHUF16(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define SWAP2(x) SHUF16(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define SWAP1(x) SHUF16(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
static inline __attribute__((always_inline)) float hmax(vw x) {
    x = vmax(x, SWAP8(x)), x = vmax(x, SWAP4(x)), x = vmax(x, SWAP2(x));
    return vmax(x, SWAP1(x))[0];
}
static inline __attribute__((always_inline)) float hsum(vw x) {
    x += SWAP8(x), x += SWAP4(x), x += SWAP2(x);
    return (x + SWAP1(x))[0];
}
#else
#define SWAP4(x) SHUF(x, x, 4, 5, 6, 7, 0, 1, 2, 3)
#define SWAP2(x) SHUF(x, x, 2, 3, 0, 1, 6, 7, 4, 5)
#define SWAP1(x) SHUF(x, x, 1, 0, 3, 2, 5, 4, 7, 6)
static inline __attribute__((always_inline)) float hmax(vw x) {
    x = vmax(x, SWAP4(x)), x = vmax(x, SWAP2(x));
    return vmax(x, SWAP1(x))[0];
}
static inline __attribute__((always_inline)) float hsum(vw x) {
    x += SWAP4(x), x += SWAP2(x);
    return (x + SWAP1(x))[0];
}
#endif

/* The mass of blocks whose scores were just computed (`sparse_choose`'s lse, taken by the thread
 * that scored a chunk, while its scores are in that core's cache): with z = temp times the
 * chunk's best score, zb[b] = z and lb[b] = the sum of e^(temp x - z) over x in sp[b * parts ..
 * (b + 1) * parts), so that the block's mass against the head's best score top is
 * lb[b] e^(zb[b] - top): the sum of e^(temp x - top) over the block, but where a term or the
 * factor falls below e^-87 (blocks that far below the best take no attention). The exps in place (`sp` is not read
 * again), lane by lane. */
static void block_lse(float *sp, long n, int parts, float temp, float *zb, float *lb) {
    const long all = n * parts;
    long i = 0;
    vw mv = (vw){0} - INFINITY;
    for (; i + AW <= all; i += AW) mv = vmax(mv, loadw(sp + i));
    float m = hmax(mv);
    for (; i < all; i++) m = MAX(sp[i], m);
    const float z = temp * m;
    const vw tv = (vw){0} + temp, zv = (vw){0} + z;
    for (i = 0; i + AW <= all; i += AW) storew(sp + i, exp_negw(tv * loadw(sp + i) - zv));
    for (; i < all; i++) sp[i] = exp_neg(temp * sp[i] - z);
    for (long b = 0; b < n; b++) {
        const float *x = sp + b * parts;
        float sum = 0.0f;
        if (parts % AW == 0) {
            vw a = loadw(x);
            for (int p = AW; p < parts; p += AW) a += loadw(x + p);
            sum = hsum(a);
        } else {
            for (int p = 0; p < parts; p++) sum += x[p];
        }
        zb[b] = z, lb[b] = sum;
    }
}

/* lb[b] = the mass of block b (block_lse's lb and zb over a head's blocks, b < n):
 * lb[b] e^(zb[b] - top), top the largest zb. */
static void block_lse_mass(float *lb, const float *zb, long n) {
    long b = 0;
    vw mv = (vw){0} - INFINITY;
    for (; b + AW <= n; b += AW) mv = vmax(mv, loadw(zb + b));
    float top = hmax(mv);
    for (; b < n; b++) top = MAX(zb[b], top);
    const vw tv = (vw){0} + top;
    for (b = 0; b + AW <= n; b += AW) storew(lb + b, loadw(lb + b) * exp_negw(loadw(zb + b) - tv));
    for (; b < n; b++) lb[b] *= exp_neg(zb[b] - top);
}

/* s[0..AW) = scale x q . k for the AW keys in rows kj, kj + d, ... (d % AW == 0): dot8 at the
 * wide path's width. */
static inline __attribute__((always_inline)) void dotw(const float *qv, const float *kj, int d,
                                                       float scale, float *s) {
    vw a[AW];
#pragma GCC unroll 16
    for (int j = 0; j < AW; j++) a[j] = (vw){0};
    for (int c = 0; c < d; c += AW) {
        const vw x = loadw(qv + c);
#pragma GCC unroll 16
        for (int j = 0; j < AW; j++) a[j] += x * loadw(kj + (long)j * d + c);
    }
    storew(s, sum_across(a) * scale);
}

/* q . k for one key (d % AW == 0), in vectors. */
static inline __attribute__((always_inline)) float dot1w(const float *qv, const float *kj, int d) {
    vw a = loadw(qv) * loadw(kj);
    for (int c = AW; c < d; c += AW) a += loadw(qv + c) * loadw(kj + c);
    return hsum(a);
}

/* One key or value row of d floats asked for (see attend_range_d). */
static inline void prefetch_row(const char *p, int d) {
    for (int o = 0; o < d * 4; o += 64) __builtin_prefetch(p + o, 0, PF_HINT);
}

/* For the U queries u of a row (acc + u d their sums, w + u ws their weights):
 * acc_u[0..d) += sum_j w_u[j] v_j over the n value rows vb, vb + d, ...: AV vectors of channels
 * at a time held in registers for every query across the rows, so that each value row is
 * loaded once for all U queries; then single vectors, then single channels. Where pk is not
 * NULL, the `ahead` key and value rows of a later block (pk, pv) are asked for as they go, one
 * of each per value row added, the rest after. */
static inline __attribute__((always_inline)) void add_values_n(float *acc, const float *w, int ws,
                                                               const float *vb, int n, int d,
                                                               const int U, const char *pk,
                                                               const char *pv, int ahead) {
    int c0 = 0, asked = 0;
    for (; c0 + AV * AW <= d; c0 += AV * AW) {
        vw a[UB][AV];
#pragma GCC unroll 4
        for (int u = 0; u < U; u++)
#pragma GCC unroll 4
            for (int r = 0; r < AV; r++) a[u][r] = loadw(acc + (long)u * d + c0 + AW * r);
        for (int j = 0; j < n; j++) {
            if (pk && c0 == 0 && j < ahead) {
                prefetch_row(pk + (long)j * d * 4, d);
                prefetch_row(pv + (long)j * d * 4, d);
                asked = j + 1;
            }
            const float *vj = vb + (long)j * d + c0;
            vw x[AV];
#pragma GCC unroll 4
            for (int r = 0; r < AV; r++) x[r] = loadw(vj + AW * r);
#pragma GCC unroll 4
            for (int u = 0; u < U; u++) {
                const float wj = w[u * ws + j];
#pragma GCC unroll 4
                for (int r = 0; r < AV; r++) a[u][r] += wj * x[r];
            }
        }
#pragma GCC unroll 4
        for (int u = 0; u < U; u++)
#pragma GCC unroll 4
            for (int r = 0; r < AV; r++) storew(acc + (long)u * d + c0 + AW * r, a[u][r]);
    }
    for (; c0 + AW <= d; c0 += AW)
        for (int u = 0; u < U; u++) {
            vw a = loadw(acc + (long)u * d + c0);
            for (int j = 0; j < n; j++) a += w[u * ws + j] * loadw(vb + (long)j * d + c0);
            storew(acc + (long)u * d + c0, a);
        }
    for (int u = 0; u < U && c0 < d; u++)
        for (int j = 0; j < n; j++) {
            const float *vj = vb + (long)j * d;
            const float wj = w[u * ws + j];
#pragma omp simd
            for (int c = c0; c < d; c++) acc[(long)u * d + c] += wj * vj[c];
        }
    if (pk)
        for (int j = asked; j < ahead; j++) {
            prefetch_row(pk + (long)j * d * 4, d);
            prefetch_row(pv + (long)j * d * 4, d);
        }
}

/* One block of `valid` keys kb and values vb against U queries q0, q0 + d, ... (consecutive
 * heads of one row), each with its running softmax (m[u], l[u], acc + u d): its scores (s + u
 * bs), the max raised where a score exceeds it (what is summed so far shrinks by e^(m - top)),
 * the weights e^(score - max), then the values for all U at once, asking for the bs key and
 * value rows at pk and pv as it goes (NULL: none). */
static inline __attribute__((always_inline)) void attend_block_n(const float *q0, const int U,
                                                                 const float *kb, const float *vb,
                                                                 int valid, int d, int bs,
                                                                 float scale, float *m, float *l,
                                                                 float *acc, float *s,
                                                                 const char *pk, const char *pv) {
#pragma GCC unroll 4
    for (int u = 0; u < U; u++) {
        const float *qv = q0 + (long)u * d;
        float *su = s + u * bs;
        int j = 0;
        if (d % AW == 0)
            for (; j + AW <= valid; j += AW) dotw(qv, kb + (long)j * d, d, scale, su + j);
        else if (d % 8 == 0)
            for (; j + 8 <= valid; j += 8) dot8(qv, kb + (long)j * d, d, scale, su + j);
        if (d % AW == 0) /* the compiler's own vectorization of dot1 fell back to scalar
                            code inside this inlined kernel */
            for (; j < valid; j++) su[j] = dot1w(qv, kb + (long)j * d, d) * scale;
        for (; j < valid; j++) su[j] = dot1(qv, kb + (long)j * d, d) * scale;
        float top = -INFINITY;
        if (valid % AW == 0) {
            vw t = loadw(su);
            for (j = AW; j < valid; j += AW) t = vmax(t, loadw(su + j));
            top = hmax(t);
        } else {
#pragma omp simd reduction(max : top)
            for (j = 0; j < valid; j++) top = MAX(su[j], top);
        }
        float *au = acc + (long)u * d;
        if (top > m[u]) { /* a new max */
            const float f = exp_neg(m[u] - top);
            l[u] *= f;
#pragma omp simd
            for (int c = 0; c < d; c++) au[c] *= f;
            m[u] = top;
        }
        const float mu = m[u];
        if (valid % AW == 0) {
            vw sum = {0};
            for (j = 0; j < valid; j += AW) {
                const vw e = exp_negw(loadw(su + j) - mu);
                storew(su + j, e);
                sum += e;
            }
            l[u] += hsum(sum);
        } else {
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (j = 0; j < valid; j++) {
                su[j] = exp_neg(su[j] - mu);
                sum += su[j];
            }
            l[u] += sum;
        }
    }
    add_values_n(acc, s, bs, vb, valid, d, U, pk, pv, bs);
}

static inline __attribute__((always_inline)) void attend_block(const float *q0, int U,
                                                               const float *kb, const float *vb,
                                                               int valid, const int d, int bs,
                                                               float scale, float *m, float *l,
                                                               float *acc, float *s,
                                                               const char *pk, const char *pv) {
    switch (U) {
    case 1: attend_block_n(q0, 1, kb, vb, valid, d, bs, scale, m, l, acc, s, pk, pv); break;
    case 2: attend_block_n(q0, 2, kb, vb, valid, d, bs, scale, m, l, acc, s, pk, pv); break;
    case 3: attend_block_n(q0, 3, kb, vb, valid, d, bs, scale, m, l, acc, s, pk, pv); break;
    default: attend_block_n(q0, UB, kb, vb, valid, d, bs, scale, m, l, acc, s, pk, pv); break;
    }
}

/* One range of head h's blocks (addresses kaddr/vaddr[0..nb), sequence positions pos) against
 * its nq = T * group queries, in one pass: per block, row and up to UB of the row's queries
 * (`attend_block`), the running softmax (max m, sum l, weighted values acc [nq][d]). Query row
 * r sees the block's first `valid` keys (positions <= past + r): a partly filled block's empty
 * slots are never read, as keys or values. s: UB x bs floats.
 *
 * The blocks are asked for PF_AHEAD ahead: the first PF_AHEAD at the start where `start` is
 * set, block b + PF_AHEAD's rows while block b's values are added (a key and a value row per
 * value row), where b + PF_AHEAD < `ahead` (kaddr/vaddr hold that many: the range's own and
 * the next ranges the same thread reads). Asked for all at once (128 prefetches of a 16-token
 * block of 64 channels before its turn), the loads behind them waited for the core's line fill
 * buffers: 30 layers' 8K cache, 2 threads, 21.5 -> 18.2 ms all of it, 4.0 -> 3.5 ms 1/8 of it
 * (a one-off harness). */
static inline __attribute__((always_inline)) void attend_range_d(
    const float *q, int T, int hq, int hkv, const int d, int bs, const int64_t *kaddr,
    const int64_t *vaddr, const int64_t *pos, long nb, long past, float scale, int h, float *m,
    float *l, float *acc, float *s, long ahead, int start) {
    const int group = hq / hkv, nq = T * group;
    for (int i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)nq * d);
    for (long b = 0; b < nb; b++) {
        const char *pk = b + PF_AHEAD < ahead ? (const char *)(intptr_t)kaddr[b + PF_AHEAD] : NULL;
        const char *pv = pk ? (const char *)(intptr_t)vaddr[b + PF_AHEAD] : NULL;
        if (b == 0 && start)
            for (long a = 0; a < PF_AHEAD && a < nb; a++) {
                prefetch_block((const char *)(intptr_t)kaddr[a], (long)bs * d);
                prefetch_block((const char *)(intptr_t)vaddr[a], (long)bs * d);
            }
        const float *kb = (const float *)(intptr_t)kaddr[b];
        const float *vb = (const float *)(intptr_t)vaddr[b];
        const long p0 = pos[b] * bs;
        for (int r = 0; r < T; r++) { /* row r: queries r * group + g, heads h * group + g */
            const long seen = past + r - p0 + 1;
            const int valid = seen >= bs ? bs : seen <= 0 ? 0 : (int)seen;
            if (!valid) {
                if (pk) prefetch_block(pk, (long)bs * d), prefetch_block(pv, (long)bs * d);
                pk = pv = NULL;
                continue;
            }
            for (int g = 0; g < group; g += UB) {
                const int i = r * group + g;
                attend_block(q + ((long)r * hq + h * group + g) * d, group - g < UB ? group - g : UB,
                             kb, vb, valid, d, bs, scale, m + i, l + i, acc + (long)i * d, s,
                             pk, pv);
                pk = pv = NULL;
            }
        }
    }
}

/* attend_range_d with the common head dims as constants: a key's channels then lie at fixed
 * offsets from one register, and a query's vectors stay in registers. */
static void attend_range(const float *q, int T, int hq, int hkv, int d, int bs,
                         const int64_t *kaddr, const int64_t *vaddr, const int64_t *pos, long nb,
                         long past, float scale, int h, float *m, float *l, float *acc, float *s,
                         long ahead, int start) {
    if (d == 64)
        attend_range_d(q, T, hq, hkv, 64, bs, kaddr, vaddr, pos, nb, past, scale, h, m, l, acc, s,
                       ahead, start);
    else if (d == 128)
        attend_range_d(q, T, hq, hkv, 128, bs, kaddr, vaddr, pos, nb, past, scale, h, m, l, acc,
                       s, ahead, start);
    else
        attend_range_d(q, T, hq, hkv, d, bs, kaddr, vaddr, pos, nb, past, scale, h, m, l, acc, s,
                       ahead, start);
}

/* Fewer keys than this over all KV heads are attended on the calling thread alone: measured
 * on SmolLM2's decode step (3 KV heads of 64, one row, 2 threads, 16-token blocks), splitting a
 * short cache across the threads cost more than the attention (at 40 tokens of context 0.3-0.5
 * ms of a 4.8 ms step over its 30 layers), while at 1,000 tokens one thread made the step 1.35x
 * slower; at about 340 tokens (1,024 keys over the 3 heads) both were level. Counted in keys,
 * not blocks: with 64-token blocks a sparse selection's 54 chosen blocks (3,456 keys) had gone
 * to one thread. */
#ifndef SERIAL_KEYS
#define SERIAL_KEYS 1024
#endif
/* With more threads than one, each KV head's blocks go in this many parts (items), and each
 * thread takes an equal run of consecutive items (heads in order, parts in order): one stretch
 * of kaddr/vaddr, which its prefetches follow across the items' bounds, so only a thread's
 * first item starts unasked for. The items had gone to the threads in turn as each finished one
 * (a dynamic schedule, so that a thread the machine slows takes fewer); each item then started
 * cold, and with 1/8 of an 8K cache an item is only about 33 blocks: 30 layers' 8K cache, 2
 * threads (a one-off harness), all of it 17.5 -> 16.5 ms, 1/8 of it 3.21 -> 3.07 ms; in the
 * 8K step (benchmarks/sparse.py) `full`'s attention 18.3 -> 16.6 ms, `sparse`'s 4.85 -> 4.67. */
#ifndef ATTEND_PARTS
#define ATTEND_PARTS 2
#endif

/* Item t (KV head t / parts, its part t % parts of `per` blocks) reads kaddr[first, end), where
 * first = (t / parts) * nb + (t % parts) * per; this is end (a head's last part may be short). */
static inline long item_end(long t, int parts, long per, long nb) {
    const long end = t / parts * nb + (t % parts + 1) * per, head_end = (t / parts + 1) * nb;
    return end < head_end ? end : head_end;
}

/* out [T, hq, d] = attention of q [T, hq, d] over nb blocks per KV head: the sequence's
 * blocks blocks[h, b] (positions in its block list; block p holds positions p * bs .. + bs - 1),
 * found in place where[p] (0 when where is NULL) at block index ids[p] there. Place g is a
 * [2, hkv, slots[g], d] float32 array at address bases[g] (K, then V). Returns 0, or -1 (bad
 * arguments, no memory). */
int sparse_attend(const float *q, int T, int hq, int hkv, int d, int bs, const int64_t *bases,
                  const int64_t *slots, const int64_t *where, const int64_t *ids,
                  const int64_t *blocks, long nb, long past, float scale, float *out,
                  int threads) {
    const int group = hkv > 0 ? hq / hkv : 0, nq = T * group;
    if (hkv <= 0 || hq % hkv || T <= 0 || d <= 0 || bs <= 0 || nb <= 0) return -1;
    if ((long)hkv * nb * bs < SERIAL_KEYS) threads = 1; /* see SERIAL_KEYS */
    /* each chosen block's first key and value */
    int64_t *kaddr = malloc(sizeof(int64_t) * 2 * (size_t)hkv * nb), *vaddr = kaddr + hkv * nb;
    if (!kaddr) return -1;
    for (int h = 0; h < hkv; h++)
        for (long b = 0; b < nb; b++) {
            const int64_t p = blocks[h * nb + b], g = where ? where[p] : 0;
            const int64_t head = (int64_t)h * slots[g] * d, rows = (int64_t)hkv * slots[g] * d;
            kaddr[h * nb + b] = bases[g] + (int64_t)sizeof(float) * (head + ids[p] * bs * d);
            vaddr[h * nb + b] = kaddr[h * nb + b] + (int64_t)sizeof(float) * rows;
        }
    const int parts = threads == 1 ? 1 : nb < ATTEND_PARTS ? (int)nb : ATTEND_PARTS;
    const long per = (nb + parts - 1) / parts, items = (long)hkv * parts;
    /* per item: m, l [nq], acc [nq][d]; per thread: one block's scores */
    const long stride = 2L * nq + (long)nq * d;
    float *buf = malloc(sizeof(float) * (size_t)(items * stride + (long)threads * UB * bs));
    if (!buf) {
        free(kaddr);
        return -1;
    }
    /* Each thread's run of items [t_lo, t_hi): kaddr/vaddr up to `last` (see ATTEND_PARTS). */
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        float *s = buf + items * stride + (long)tid * UB * bs;
        const long t_lo = items * tid / nt, t_hi = items * (tid + 1) / nt;
        const long last = t_hi > t_lo ? item_end(t_hi - 1, parts, per, nb) : 0;
        for (long t = t_lo; t < t_hi; t++) {
            const int h = (int)(t / parts);
            const long first = (long)h * nb + (t % parts) * per, end = item_end(t, parts, per, nb);
            float *m = buf + t * stride, *l = m + nq, *acc = l + nq;
            if (first >= end) {
                for (int i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0.0f;
                continue;
            }
            attend_range(q, T, hq, hkv, d, bs, kaddr + first, vaddr + first, blocks + first,
                         end - first, past, scale, h, m, l, acc, s, last - first, t == t_lo);
        }
    }
    for (int h = 0; h < hkv; h++)
        for (int i = 0; i < nq; i++) {
            float big = -INFINITY;
            for (int p = 0; p < parts; p++) {
                const float mp = buf[((long)h * parts + p) * stride + i];
                big = mp > big ? mp : big;
            }
            float *o = out + ((long)(i / group) * hq + h * group + i % group) * d;
            float den = 0.0f;
            memset(o, 0, sizeof(float) * d);
            for (int p = 0; p < parts; p++) {
                const float *m = buf + ((long)h * parts + p) * stride, *acc = m + 2L * nq;
                if (m[i] == -INFINITY) continue;
                const float f = expf(m[i] - big);
                den += f * m[nq + i];
                for (int c = 0; c < d; c++) o[c] += f * acc[(long)i * d + c];
            }
            const float inv = den > 0.0f ? 1.0f / den : 0.0f;
            for (int c = 0; c < d; c++) o[c] *= inv;
        }
    free(buf);
    free(kaddr);
    return 0;
}
