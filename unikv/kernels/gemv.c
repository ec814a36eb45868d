/* Matrix-vector products for decode (a few activation rows): y[n, out] = x[n, in] @ W[out, in]^T.
 *
 * Built and loaded by engine/gemv.py through kvstrategies/kernels.py (cc -O3, the ISA flags of
 * `kernels.isa()`, -fopenmp, cached, ctypes), registered as the preferred CPU entry of
 * matmul.float, matmul.q8_0, matmul.q4_0 and matmul.q4_1. engine/linear.py's reference entries
 * compute the same thing; tests/test_operators.py compares them under every ISA this CPU runs.
 *
 * Why: at batch 1 a decode step is a stream over every weight byte. Each OpenMP thread takes a
 * contiguous range of output rows of the row-major weights and streams them one row after the
 * other (one purely sequential stream per thread), with independent FMA chains along the row;
 * x (a few KB) stays in L1. Quantized weights are read as their GGUF blocks (the packed bytes
 * are what streams) and decoded in registers.
 *
 * Block formats (ggml-common.h; 32 consecutive elements of a row per block):
 *   Q8_0: fp16 d, int8 q[32];            w = d q
 *   Q4_0: fp16 d, 16 bytes of nibbles;   w = d (q - 8)   (element j low nibble of byte j,
 *   Q4_1: fp16 d, fp16 m, 16 bytes;      w = d q + m      j + 16 its high nibble)
 *
 * One source, three instruction sets, chosen by the compiler's target (the build's flags):
 *   GEMV_ISA 2: AVX-512F/BW (and VNNI for the int8 kernel), the paths tuned first;
 *   GEMV_ISA 1: AVX2 + FMA + F16C (x86-64-v3: every x86-64 server CPU since 2013-2015);
 *   GEMV_ISA 0: portable C (any other target: baseline x86-64, and aarch64, where -mcpu=native
 *               lets the compiler vectorize the plain loops with NEON).
 * Each entry point computes the same product on every path; only the order of the float32 sums
 * differs (the int8 kernel's integer dots are exact on all three). `gemv_isa()` and
 * `gemv_i8_isa()` tell the loader which path this build holds.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GEMV_MAX_ROWS 4
#define GEMV_I8_MAX_ROWS 16 /* gemv_qi8: rows in chunks of 16, groups of 4; each chunk one pass */
/* How far ahead of the row it multiplies a thread of the int8 kernels asks for its weights
 * (bytes). The hardware prefetcher alone left them waiting on memory: measured at batch 1 on
 * SmolLM2's packed layers, 92 -> 99-110 tok/s with VNNI, 70-80 -> 89 on the AVX2 path (1,024 to
 * 8,192 bytes all within noise). The float32 kernel streams plain rows, which the hardware
 * prefetcher follows: there it gained nothing (33.6 against 34.6 tok/s). */
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif
#define GEMV_MAX_BLOCKS 4096 /* blocks per packed row (in <= 131072): Q4_1's per-call sums */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GEMV_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMV_ISA 1
#else
#define GEMV_ISA 0
#endif
#if GEMV_ISA == 2 && defined(__AVX512VNNI__)
#define GEMV_I8_ISA 2
#elif GEMV_ISA >= 1
#define GEMV_I8_ISA 1 /* AVX2, or AVX-512 without VNNI: the int16 path below, in AVX2 */
#else
#define GEMV_I8_ISA 0
#endif

int gemv_isa(void) { return GEMV_ISA; }
int gemv_i8_isa(void) { return GEMV_I8_ISA; }
int gemv_max_rows(void) { return GEMV_MAX_ROWS; }
int gemv_i8_max_rows(void) { return GEMV_I8_MAX_ROWS; }
long gemv_max_in(void) { return 32L * GEMV_MAX_BLOCKS; }

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

INLINE long block_bytes(const int fmt) { return fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20; }

/* ---- rows interleaved by 16: the same blocks, reordered for a 16-row register ----------------
 *
 * Why: in GGUF order a 512-bit step holds 64 codes of one row, so every step of every row pays
 * its own unpack, scale permute, convert and FMA, and a decode step on the Intel Xeon was bound
 * by those instructions, not by its bytes. Interleaved, one register holds 4 codes of 16 rows:
 * one vpdpbusd against 4 broadcast activation codes makes 16 rows' partial dots, and a block's
 * scale is one convert and one FMA for 16 rows. llama.cpp repacks its Q4_0 / Q8_0 this way
 * (its decode at Q8_0 falls from 224 to 103 tok/s here without it).
 *
 * `fmt | ROWS16` names the layout. For rows 16 g .. 16 g + 15 and block b, at byte
 * (g nb + b) 16 bs (bs: the block's bytes, so the whole weight keeps its size):
 *   codes  [quads][16 rows][4 bytes]: quad c of row r is bytes 4c .. 4c + 3 of the row's
 *          block codes (Q8_0: 8 quads, each byte xor 0x80, i.e. q + 128 as vpdpbusd's unsigned
 *          operand; Q4_0 / Q4_1: 4 quads of nibble bytes, elements 4c.. low, 16 + 4c.. high);
 *   d      [16] fp16, the rows' scales;   m [16] fp16 (Q4_1 only), their offsets.
 * Only a weight with a multiple of 16 rows takes it. engine/gemv.py's `interleave` writes it
 * and `deinterleave` reads it back (torch; tests/test_operators.py checks the round trip).
 * gemv_qi8 reads it on the VNNI path only, dequant_rows (a prefill's GEMM) on every build.
 * Q4_K has its own interleaved layout (q4k_r16_group, below), read by gemv_ki8 (VNNI, AVX2). */
#define ROWS16 8

/* How far ahead an interleaved group's thread asks for its bytes. Measured on the Intel Xeon,
 * SmolLM2-sized layer matrices at Q4_1, one activation row, 2 threads (against the GGUF order
 * in the same process): no prefetch 1.01x, 1,024 bytes 1.15x, 2,048 (the GGUF kernels') 1.19x,
 * 4,096 1.25x, 8,192 1.27x, 16,384 1.31x, within the runs' noise from 4,096 on. The whole
 * decode step (benchmarks/kernel_ab.py, builds alternating in one process, 20-40 rounds; an
 * identical build reads 0.99-1.02x), 8,192 against 4,096: the Q4_1 model 1.03-1.05x faster
 * (three runs; AVX2 build 1.02x), the Q8_0 GGUF 0.99-1.04x (four runs, mean 1.01x); 16,384
 * 0.97x and 2,048 0.93x at Q8_0. Interleaved Q4_K on the AMD EPYC (Zen 4), 256 MiB of
 * [8192, 2048] matrices, one row, 2 threads, builds alternating: 4,096 26-28, 8,192 26-28,
 * 16,384 25-26 GB/s. On AMD's Zen 3 and later it is not asked for (weight_prefetch, below). */
#ifndef R16_PF_BYTES
#define R16_PF_BYTES 8192
#endif

/* Whether the weights are asked for ahead in software where they stream in order: the VNNI
 * path's interleaved groups (r16_group, q4k_r16_group: prefetch_group) and the float32 rows
 * (f32_row: F32_PF_FLOATS). Not on AMD's Zen 3 and later (amd_zen3_or_later), chosen by cpuid
 * when the library loads: there a thread's prefetcht1 requests 4 KB and more ahead hold it to
 * 21-23 GB/s, where its hardware prefetcher alone follows lines read in order (r16_group) at
 * the stream's 28-33. Measured on the AMD EPYC (Zen 4), builds alternating in one process: one thread over 240 MiB of
 * interleaved Q4_1 [8192, 2048] matrices, the lines in order, 29.2-30.4 GB/s without it and
 * 22.4 with it (8,192 bytes ahead; the older build, the headers' line read first, 21.0-21.9);
 * float32 rows of SmolLM2's shapes 26.5 against 23.3 GB/s (2 threads 46.2 against 41.0). The
 * whole decode step (benchmarks/kernel_ab.py, without against with): SmolLM2 Q4_1 0.939x the
 * time, a Llama 3.2 1B-shaped Q4_1 0.872x, SmolLM2 float32 0.815-0.998x. The Intel Xeon's
 * figures (above, and F32_PF_FLOATS's) were measured with it; it stays on there, and on AMD's
 * older Zen 1 and 2, until measured again.
 * gemv_weight_prefetch switches it (tests: the same bits either way). */
static int weight_prefetch = 1;
/* Whether this is an AMD CPU of family 25 or later (Zen 3, Zen 4, Zen 5), whose hardware
 * prefetcher was measured to stream alone (Zen 4). Zen 1 and 2 (family 23) keep the prefetch:
 * not measured there. */
static int amd_zen3_or_later(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0));
    if (!(b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u)) /* "AuthenticAMD" */
        return 0;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
    return family >= 25;
#else
    return 0;
#endif
}
__attribute__((constructor)) static void weight_prefetch_choose(void) {
    weight_prefetch = !amd_zen3_or_later();
}
/* on: 1 or 0 sets it (while no kernel runs); any other value only reads it. Returns it. */
int gemv_weight_prefetch(int on) {
    if (on == 0 || on == 1) weight_prefetch = on;
    return weight_prefetch;
}

/* Whether an interleaved group asks for its weights ahead for n x rows: always from 5 rows on,
 * where a group is read again from the caches for every 4 x rows (on the AMD EPYC (Zen 4), 2
 * threads over SmolLM2-sized Q4_1 matrices, without it against with it: 1 row 1.06x the bytes
 * a second, 4 rows 1.00x, 8 and 16 rows 0.86x), and as weight_prefetch says below that. */
INLINE int weight_pf(int n) { return weight_prefetch || n > 4; }

/* Where a weight prefetch puts its line: L2 and beyond (prefetcht1), not L1. A weight byte is
 * read once per step; pulled into L1 ahead of use, it evicts the activations, the accumulators'
 * spills and the Python interpreter's hot lines. Whole decode step, kernel_ab.py, against L1
 * (locality 3) on the Intel Xeon: Q4_1 model 1.05, 1.10, 1.18x faster; Q8_0 GGUF 1.10, 1.11x;
 * AVX2 build Q4_1 1.05x, Q8_0 0.99x; float32 weights (no software prefetch) 1.01x. prefetcht2
 * reads the same as t1 (0.99x); prefetchnta was 2.2x slower (its lines leave L1 before use),
 * at every distance from 1,024 to 8,192 bytes about 2x. */
#define PF_LOCALITY 2

/* How far ahead a float32 row asks for its weights: 2,048 floats (8 KB; the row goes on into the
 * next one, which the same thread reads next). The float32 model's step against none, in
 * kernel_ab.py: 512 floats 0.97x, 1,024 1.01x, 2,048 1.06 and 1.05x, 4,096 1.04x. (Into the L1,
 * as an older build asked, software prefetch slowed every variant.) */
#ifndef F32_PF_FLOATS
#define F32_PF_FLOATS 2048
#endif

/* Prefetch the `ahead` bytes after row r (of `row` bytes) of a thread's rows [., hi) of w. */
INLINE void prefetch_rows(const uint8_t *w, long r, long row, long hi, const long ahead) {
    const long end = (r + 1) * row + ahead < hi * row ? (r + 1) * row + ahead : hi * row;
    for (long o = (r * row + ahead) & ~63L; o < end; o += 64) __builtin_prefetch(w + o, 0, PF_LOCALITY);
}

/* The same, PF_BYTES ahead (the GGUF-order kernels). */
INLINE void prefetch_ahead(const uint8_t *w, long r, long row, long hi) {
    prefetch_rows(w, r, row, hi, PF_BYTES);
}

/* How far ahead gemv_ki8 (K-quants, int8 activations) asks for its rows: on the AMD EPYC (Zen 4),
 * both builds alternating in one process over 250 MiB of [8192, 2048] matrices at one row, 8,192
 * against 2,048 bytes read Q4_K 1.08-1.17x and Q6_K 1.07-1.34x faster in four runs (AVX2 build
 * 1.11 / 1.06x; 4,096: 1.08 / 1.24x; 16,384 and 32,768 level with 8,192). gemv_k, with float32
 * activations bound by its arithmetic, reads level with either (1.01 / 1.02x). */
#ifndef K_PF_BYTES
#define K_PF_BYTES 8192
#endif

/* Prefetch an interleaved group's block of gb bytes at o, R16_PF_BYTES ahead. */
INLINE void prefetch_group(const uint8_t *o, long gb) {
    for (long f = R16_PF_BYTES; f < R16_PF_BYTES + gb; f += 64) __builtin_prefetch(o + f, 0, PF_LOCALITY);
}

/* An fp16 value (little-endian at p) as float. */
INLINE float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if GEMV_ISA >= 1
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

#if GEMV_ISA >= 1
/* The sum of 8 float lanes. */
INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif

#ifndef GEMV_U
#define GEMV_U 2
#endif

#if GEMV_ISA == 2
/* ---- float32 weights and GGUF blocks, float32 activations: AVX-512 ---------------------- */

/* Independent accumulators along a row, for one or two activation rows (more rows bring their
 * own chains). Measured here (one core, a model-sized set of weights, interleaved): one row of
 * W at a time with 2 chains streamed 2.3-2.9x faster than the split bmm at batch 1; 4 or 8 rows
 * of W interleaved at a time only 1.3-1.5x, and software prefetch into the L1 slowed every
 * variant (into the L2 it gains: F32_PF_FLOATS). */

/* ---- float32 weights ------------------------------------------------------------------- */

/* Row w (length `in`) against N rows of x: y[j * out] = w . x[j]. */
INLINE void f32_row(const float *restrict x, const float *restrict w, long in, float *restrict y,
                    long out, const int N, const int U) {
    __m512 acc[GEMV_MAX_ROWS][GEMV_U];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) acc[j][u] = _mm512_setzero_ps();
    const int pf = weight_prefetch;
    long k = 0;
    for (; k + 16 * U <= in; k += 16 * U)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            if (pf) __builtin_prefetch(w + k + 16 * u + F32_PF_FLOATS, 0, PF_LOCALITY); /* a line */
            const __m512 wv = _mm512_loadu_ps(w + k + 16 * u);
#pragma GCC unroll 4
            for (int j = 0; j < N; j++)
                acc[j][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * in + k + 16 * u), acc[j][u]);
        }
    for (; k < in; k += 16) { /* the rest; the last step masked when `in` is no multiple of 16 */
        const __mmask16 m = in - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (in - k)) - 1);
        const __m512 wv = _mm512_maskz_loadu_ps(m, w + k);
#pragma GCC unroll 4
        for (int j = 0; j < N; j++)
            acc[j][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + j * in + k), acc[j][0]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);
        y[j * out] = _mm512_reduce_add_ps(acc[j][0]);
    }
}

/* ---- GGUF blocks --------------------------------------------------------------------------- */

/* The block at p: its codes as two float vectors (elements 0..15, 16..31), its scale d and
 * (Q4_1) its offset m, w = d * code + m. Q4_0's -8 is folded into the code. */
INLINE void codes(const uint8_t *restrict p, const int fmt, __m512 *lo, __m512 *hi, float *d,
                  float *m) {
    *d = half(p);
    if (fmt == Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 2));
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
        return;
    }
    /* vpermps reads the low 4 bits of each index: each nibble looks its value up in a table
     * (one instruction instead of a mask and a conversion) */
    const __m512 table =
        fmt == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                    : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + (fmt == Q4_1 ? 4 : 2))));
    *lo = _mm512_permutexvar_ps(v, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    if (fmt == Q4_1) *m = half(p + 2);
}

/* One block (codes lo/hi, d, m) against the N rows of x at xb: per x row, acc += d * (code . x)
 * and macc += m * sum(x over the block) (xs: the block's sums, one per x row, stride nb). */
INLINE void q_step(const float *restrict xb, long in, const float *restrict xs, long nb, __m512 lo,
                   __m512 hi, float d, float m, __m512 *acc, float *macc, const int fmt,
                   const int N, const int U) {
    const __m512 dv = _mm512_set1_ps(d);
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xb + j * in));
        t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + j * in + 16), t);
        acc[j * U] = _mm512_fmadd_ps(dv, t, acc[j * U]);
        if (fmt == Q4_1) macc[j * U] += m * xs[j * nb];
    }
}

/* Row w (nb blocks) against N rows of x (length nb * 32); U blocks per step, each with its own
 * accumulators. xsum: per x row and block, the sum of x (read for Q4_1 only). */
INLINE void q_row(const float *restrict x, const float *restrict xsum, const uint8_t *restrict w,
                  long nb, float *restrict y, long out, const int fmt, const int N, const int U) {
    const long bs = block_bytes(fmt), in = nb * 32;
    __m512 acc[GEMV_MAX_ROWS][GEMV_U];
    float macc[GEMV_MAX_ROWS][GEMV_U];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) acc[j][u] = _mm512_setzero_ps(), macc[j][u] = 0.0f;
    long b = 0;
    for (; b + U <= nb; b += U)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            __m512 lo, hi;
            float d, m = 0.0f;
            codes(w + (b + u) * bs, fmt, &lo, &hi, &d, &m);
            q_step(x + (b + u) * 32, in, xsum + b + u, nb, lo, hi, d, m, &acc[0][u], &macc[0][u],
                   fmt, N, GEMV_U);
        }
    for (; b < nb; b++) {
        __m512 lo, hi;
        float d, m = 0.0f;
        codes(w + b * bs, fmt, &lo, &hi, &d, &m);
        q_step(x + b * 32, in, xsum + b, nb, lo, hi, d, m, &acc[0][0], &macc[0][0], fmt, N, GEMV_U);
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) {
            acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);
            macc[j][0] += macc[j][u];
        }
        y[j * out] = _mm512_reduce_add_ps(acc[j][0]) + macc[j][0];
    }
}

#elif GEMV_ISA == 1
/* ---- float32 weights and GGUF blocks, float32 activations: AVX2 + FMA ------------------- */

/* As the AVX-512 f32_row, 8 lanes a vector; the last `in % 8` elements in scalar. */
INLINE void f32_row(const float *restrict x, const float *restrict w, long in, float *restrict y,
                    long out, const int N, const int U) {
    __m256 acc[GEMV_MAX_ROWS][GEMV_U];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) acc[j][u] = _mm256_setzero_ps();
    const int pf = weight_prefetch;
    long k = 0;
    for (; k + 8 * U <= in; k += 8 * U)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            if (pf && u % 2 == 0)
                __builtin_prefetch(w + k + 8 * u + F32_PF_FLOATS, 0, PF_LOCALITY);
            const __m256 wv = _mm256_loadu_ps(w + k + 8 * u);
#pragma GCC unroll 4
            for (int j = 0; j < N; j++)
                acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * in + k + 8 * u), acc[j][u]);
        }
    for (; k + 8 <= in; k += 8) {
        const __m256 wv = _mm256_loadu_ps(w + k);
#pragma GCC unroll 4
        for (int j = 0; j < N; j++)
            acc[j][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * in + k), acc[j][0]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
#pragma GCC unroll 4
        for (int u = 1; u < U; u++) acc[j][0] = _mm256_add_ps(acc[j][0], acc[j][u]);
        float tail = 0.0f;
        for (long t = k; t < in; t++) tail += w[t] * x[j * in + t];
        y[j * out] = hsum256(acc[j][0]) + tail;
    }
}

/* The block at p as four vectors of 8 float codes (elements 0..7, .., 24..31), its scale d and
 * (Q4_1) its offset m: w = d * code + m. Q4_0's -8 is folded into the code. */
INLINE void codes(const uint8_t *restrict p, const int fmt, __m256 c[4], float *d, float *m) {
    *d = half(p);
    if (fmt == Q8_0) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 2 + 8 * i))));
        return;
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)(p + (fmt == Q4_1 ? 4 : 2)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, nib), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
    const __m256 off = _mm256_set1_ps(fmt == Q4_0 ? -8.0f : 0.0f);
    c[0] = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), off);
    c[1] = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), off);
    c[2] = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), off);
    c[3] = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), off);
    if (fmt == Q4_1) *m = half(p + 2);
}

/* Row w (nb blocks) against N rows of x (length nb * 32): per block acc += d * (code . x),
 * two accumulators per x row (even and odd blocks); xsum as in the AVX-512 path. */
INLINE void q_row(const float *restrict x, const float *restrict xsum, const uint8_t *restrict w,
                  long nb, float *restrict y, long out, const int fmt, const int N, const int U) {
    (void)U;
    const long bs = block_bytes(fmt), in = nb * 32;
    __m256 acc[GEMV_MAX_ROWS][2];
    float macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps(), macc[j] = 0.0f;
    for (long b = 0; b < nb; b++) {
        __m256 c[4];
        float d, m = 0.0f;
        codes(w + b * bs, fmt, c, &d, &m);
        const __m256 dv = _mm256_set1_ps(d);
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const float *xb = x + j * in + b * 32;
            __m256 t = _mm256_mul_ps(c[0], _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xb + 24), t);
            acc[j][b & 1] = _mm256_fmadd_ps(dv, t, acc[j][b & 1]);
            if (fmt == Q4_1) macc[j] += m * xsum[j * nb + b];
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) y[j * out] = hsum256(_mm256_add_ps(acc[j][0], acc[j][1])) + macc[j];
}

#else
/* ---- float32 weights and GGUF blocks, float32 activations: portable C ------------------- */
/* Plain loops with several partial sums (so -O3 vectorizes them for the target: SSE2, NEON). */

#define PSUMS 16

INLINE void f32_row(const float *restrict x, const float *restrict w, long in, float *restrict y,
                    long out, const int N, const int U) {
    (void)U;
    for (int j = 0; j < N; j++) {
        const float *xj = x + j * in;
        float s[PSUMS] = {0};
        long k = 0;
        for (; k + PSUMS <= in; k += PSUMS)
            for (int u = 0; u < PSUMS; u++) s[u] += w[k + u] * xj[k + u];
        float t = 0.0f;
        for (; k < in; k++) t += w[k] * xj[k];
        for (int u = 0; u < PSUMS; u++) t += s[u];
        y[j * out] = t;
    }
}

/* The block at p decoded to 32 float codes (Q4_0's -8 folded in), its d and (Q4_1) m. */
INLINE void codes(const uint8_t *restrict p, const int fmt, float c[32], float *d, float *m) {
    *d = half(p);
    if (fmt == Q8_0) {
        for (int i = 0; i < 32; i++) c[i] = (float)(int8_t)p[2 + i];
        return;
    }
    const uint8_t *q = p + (fmt == Q4_1 ? 4 : 2);
    const float off = fmt == Q4_0 ? -8.0f : 0.0f;
    for (int i = 0; i < 16; i++) {
        c[i] = (float)(q[i] & 0x0F) + off;
        c[i + 16] = (float)(q[i] >> 4) + off;
    }
    if (fmt == Q4_1) *m = half(p + 2);
}

INLINE void q_row(const float *restrict x, const float *restrict xsum, const uint8_t *restrict w,
                  long nb, float *restrict y, long out, const int fmt, const int N, const int U) {
    (void)U;
    const long bs = block_bytes(fmt), in = nb * 32;
    float acc[GEMV_MAX_ROWS] = {0}, macc[GEMV_MAX_ROWS] = {0};
    for (long b = 0; b < nb; b++) {
        float c[32], d, m = 0.0f;
        codes(w + b * bs, fmt, c, &d, &m);
        for (int j = 0; j < N; j++) {
            const float *xb = x + j * in + b * 32;
            float s[8] = {0};
            for (int i = 0; i < 32; i += 8)
                for (int u = 0; u < 8; u++) s[u] += c[i + u] * xb[i + u];
            acc[j] += d * (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
            if (fmt == Q4_1) macc[j] += m * xsum[j * nb + b];
        }
    }
    for (int j = 0; j < N; j++) y[j * out] = acc[j] + macc[j];
}

#endif

/* ---- entry points: the output rows split over `threads` (torch's OpenMP team) -------------- */

/* The rows go in chunks (a multiple of 16 rows: whole cache lines of y; about SPLIT_CHUNKS per
 * thread) that the threads take in turn as they finish one (OpenMP's dynamic schedule), not in
 * one fixed range per thread: a thread the machine slows (another tenant on its core, the
 * caller's thread arriving late) takes fewer chunks instead of holding up the call. On a 2-core
 * AMD EPYC whose cores ran at different paces the fixed ranges made a 2-thread Q4_1 decode
 * step no faster than one thread (BENCHMARKS.md, "Threads that share the work"). Each row is
 * computed by one thread with the same code either way: the output is the same bits.
 * Not many chunks, though: each starts on bytes no prefetch asked for yet. A SmolLM2 Q4_1
 * decode step (Intel Xeon, 2 threads, benchmarks/kernel_ab.py against 8 chunks a thread and
 * a fork per product) took 0.94x as long at 4 chunks; with decode_layers' team (below) 1.155x
 * at 32 chunks, 0.92x at 4, 0.935x at 2, 0.92x at 1 (the runs' spread: about 3%). On the AMD
 * EPYC (Zen 4), against 4 chunks: the Q4_1 step 0.94-0.98x as long at 2 (three runs), 0.94-0.99x
 * at 1 (two), 1.09x at 8; the float32 step 0.96x at 2. So 2. */
#ifndef SPLIT_CHUNKS
#define SPLIT_CHUNKS 2
#endif
INLINE long split_chunk(const long out, const int threads) {
    const long c = (out / ((long)threads * SPLIT_CHUNKS) + 15) / 16 * 16;
    return c < 16 ? 16 : c;
}

#define SPLIT(CALL)                                                                              \
    do {                                                                                         \
        if (threads <= 1 || out < 64) {                                                          \
            const long lo = 0, hi = out;                                                         \
            CALL;                                                                                \
        } else {                                                                                 \
            const long chunk_ = split_chunk(out, threads), chunks_ = (out + chunk_ - 1) / chunk_; \
            _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")               \
            for (long c_ = 0; c_ < chunks_; c_++) {                                              \
                const long lo = c_ * chunk_;                                                     \
                const long hi = lo + chunk_ < out ? lo + chunk_ : out;                           \
                CALL;                                                                            \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* Rows [lo, hi) of W: N (the activation rows) is a compile-time constant in each loop. */
static void f32_range(const float *x, int n, const float *w, long in, float *y, long out, long lo,
                      long hi) {
#define F32_LOOP(N)                                                                              \
    for (long r = lo; r < hi; r++) f32_row(x, w + r * in, in, y + r, out, N, N <= 2 ? GEMV_U : 1)
    switch (n) {
    case 1: F32_LOOP(1); break;
    case 2: F32_LOOP(2); break;
    case 3: F32_LOOP(3); break;
    default: F32_LOOP(4); break;
    }
#undef F32_LOOP
}

#define Q_RANGE(F)                                                                               \
    static void q_range_##F(const float *x, const float *xsum, int n, const uint8_t *w, long nb, \
                            float *y, long out, long lo, long hi) {                              \
        const long row = nb * block_bytes(F);                                                    \
        switch (n) {                                                                             \
        case 1: Q_LOOP(F, 1); break;                                                             \
        case 2: Q_LOOP(F, 2); break;                                                             \
        case 3: Q_LOOP(F, 3); break;                                                             \
        default: Q_LOOP(F, 4); break;                                                            \
        }                                                                                        \
    }
#define Q_LOOP(F, N)                                                                             \
    for (long r = lo; r < hi; r++)                                                               \
    q_row(x, xsum, w + r * row, nb, y + r, out, F, N, N <= 2 ? GEMV_U : 1)
Q_RANGE(Q8_0)
Q_RANGE(Q4_0)
Q_RANGE(Q4_1)

/* y [n, out] = x [n, in] @ w [out, in]^T, float32, 1 <= n <= GEMV_MAX_ROWS. */
void gemv_f32(const float *x, int n, const float *w, long out, long in, float *y, int threads) {
    if (n < 1 || n > GEMV_MAX_ROWS) return; /* the caller checks: never reached */
    SPLIT(f32_range(x, n, w, in, y, out, lo, hi));
}

/* The sum of x over each of `count` runs of 32 elements (Q4_1's per-block offset term, Q4_K's
 * per-sub-block one), in one order of additions wherever it is taken. */
static void sums32(const float *x, long count, float *sums) {
    for (long i = 0; i < count; i++) {
        float s[8] = {0};
        for (int k = 0; k < 32; k += 8)
            for (int u = 0; u < 8; u++) s[u] += x[i * 32 + k + u];
        sums[i] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
}

/* y [n, out] = x [n, nb * 32] @ W^T, W given as `fmt` blocks [out, nb, block bytes]. */
void gemv_q(int fmt, const float *x, int n, const uint8_t *w, long out, long nb, float *y,
            int threads) {
    if (n < 1 || n > GEMV_MAX_ROWS || nb > GEMV_MAX_BLOCKS) return; /* the caller checks */
    /* Q4_1's offsets multiply each block's sum of x: computed once per call */
    float xsum[GEMV_MAX_ROWS * GEMV_MAX_BLOCKS];
    if (fmt == Q4_1) sums32(x, n * nb, xsum);
    if (fmt == Q8_0)
        SPLIT(q_range_Q8_0(x, xsum, n, w, nb, y, out, lo, hi));
    else if (fmt == Q4_0)
        SPLIT(q_range_Q4_0(x, xsum, n, w, nb, y, out, lo, hi));
    else
        SPLIT(q_range_Q4_1(x, xsum, n, w, nb, y, out, lo, hi));
}

/* ---- int8 activations (AVX512-VNNI): llama.cpp's Q8_0 / Q8_1 activation format --------------
 *
 * Why: with float32 activations every block costs ~10 vector instructions (decode the codes to
 * floats, multiply, add), so the kernel is compute-bound at about half of llama.cpp's pace.
 * Rounding the activations to int8 once per call (per 32-element block: d = amax / 127,
 * q = round(x / d), as ggml's quantize_row_q8_0) lets one vpdpbusd multiply and add 64 weight
 * codes against 64 activation codes in integers: ~3 instructions per block for one row.
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes. The 4-bit codes (0..15) are unsigned as
 * they are; Q8_0's signed codes are made unsigned by an xor with 0x80 (q + 128). The offsets
 * this takes out come back per block as float terms: sum_i w_i x_i over a block is
 *   Q8_0: dw dx (dot(q + 128, xq) - 128 sum(xq))
 *   Q4_0: dw dx (dot(q, xq) - 8 sum(xq))
 *   Q4_1: dw dx dot(q, xq) + m dx sum(xq)          (q8_1's block sum)
 * with the integer dot exact. The second terms are added once per 16 blocks as one vector
 * product (the block's dw or m times a per-call term of x). Unlike llama.cpp the activation
 * scale dx stays float32 (ggml rounds it to fp16): the same speed, one rounding less.
 *
 * Two digits (`digits` = 2, what engine/linear.py uses): one int8 code per element loses 0.6-0.9%
 * of a matmul's output (measured on SmolLM2's decode activations), about 4% on the logits after
 * 30 layers, and moved the decode PPL of the GPL texts by 2.5-2.7% (256 tokens): too much for the
 * 0.1% the engine promises. So x is written as d (q1 + q2 / 256): q1 = round(x / d) as above and
 * q2 = round(256 (x / d - q1)), saturated to int8 (|x / d - q1| <= 1/2), a second int8 code for
 * what q1 left over (about 16 bits in all). Per step that is one more vpdpbusd and one shift:
 * (dot(w, q1) << 8) + dot(w, q2) = dot(w, 256 q1 + q2) fits int32 (< 2^26 per lane), the scale
 * becomes d / 256. `digits` = 1 is ggml's single code (kept to measure against).
 *
 * Two blocks are one 512-bit step. Their activation codes are laid out per call in the order the
 * weight bytes unpack: Q8_0 [b 0..31, b+1 0..31]; Q4 [b 0..15, b+1 0..15, b 16..31, b+1 16..31]
 * (the low nibbles of both blocks' 16 bytes, then the high ones). The per-block scales dw dx are
 * computed 16 blocks at a time from the weight's headers (`h`: each row's fp16 d of every
 * block, padded with zeros to a multiple of 16, then for Q4_1 its fp16 m the same way; built
 * once at load by engine/gemv.py), times dx; each step spreads its two blocks' scales over the
 * int32 lanes that hold their sums with one permute. NOTE: the headers are a copy of 2 (Q4_1: 4)
 * bytes per block because gathering them from the blocks (stride 34 / 18 / 20 bytes: one
 * vpgatherdd per 16 blocks) made the whole kernel 1.35-1.6x slower here (Zen 4), and 16 scalar
 * loads into a stack array slower still (a stalled store-to-load forward). An odd last block is
 * paired with a zero block (zero activation codes and scale); nothing past a row's last block is
 * read.
 */
#if GEMV_I8_ISA == 2
/* The activations of one call in the kernel's form. Per x row j and block b (nb rounded up to
 * a multiple of 16, the pad zero): q codes [n][nbp * 32] (the step layout above; q2 the second
 * digit's, the same layout, with two digits), dx [n][nb16] (the scale of the code 1 or of
 * 256 q1 + q2), t [n][nb16]: the offset term's x factor (-128 dx sum(xq), -8 dx sum(xq),
 * dx sum(xq), xq the whole code). */
typedef struct {
    int8_t *q, *q2;
    float *dx, *t;
    long nb, nbp, nb16;
    int pf; /* r16_group: ask for the weights ahead (set per call: r16_range's weight_pf) */
} xq_t;

/* Round x [n, nb * 32] to int8 per block (round to nearest even, as ggml's AVX path); with
 * two digits the rest to a second int8 code. */
static void quantize_x(const int fmt, const float *x, int n, xq_t *a, const int digits) {
    const long nb = a->nb;
    memset(a->q, 0, (size_t)n * a->nbp * 32 * digits);
    memset(a->dx, 0, sizeof(float) * n * a->nb16);
    memset(a->t, 0, sizeof(float) * n * a->nb16);
    const float off = fmt == Q8_0 ? -128.0f : fmt == Q4_0 ? -8.0f : 1.0f;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int j = 0; j < n; j++)
        for (long b = 0; b < nb; b++) {
            const float *xb = x + (j * nb + b) * 32;
            const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512 iv = _mm512_set1_ps(id);
            const __m512 slo = _mm512_mul_ps(lo, iv), shi = _mm512_mul_ps(hi, iv);
            __m512i qlo = _mm512_cvtps_epi32(slo), qhi = _mm512_cvtps_epi32(shi);
            const long at = j * a->nbp * 32 + (fmt == Q8_0 ? b * 32 /* 0..15 then 16..31 */
                                                             : (b / 2) * 64 + (b % 2) * 16);
            const long second = fmt == Q8_0 ? 16 : 32; /* where elements 16..31 go */
            _mm_storeu_si128((__m128i *)(a->q + at), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(a->q + at + second), _mm512_cvtsepi32_epi8(qhi));
            float dd = d;
            if (digits == 2) { /* the rest, exact in float32: 256 (s - q1) rounded */
                const __m512 k = _mm512_set1_ps(256.0f);
                const __m512i rlo = _mm512_cvtps_epi32(
                    _mm512_mul_ps(_mm512_sub_ps(slo, _mm512_cvtepi32_ps(qlo)), k));
                const __m512i rhi = _mm512_cvtps_epi32(
                    _mm512_mul_ps(_mm512_sub_ps(shi, _mm512_cvtepi32_ps(qhi)), k));
                _mm_storeu_si128((__m128i *)(a->q2 + at), _mm512_cvtsepi32_epi8(rlo));
                _mm_storeu_si128((__m128i *)(a->q2 + at + second), _mm512_cvtsepi32_epi8(rhi));
                /* the whole code 256 q1 + q2 (q2 as stored: saturated) for the block sum */
                const __m512i c127 = _mm512_set1_epi32(127), cm128 = _mm512_set1_epi32(-128);
                qlo = _mm512_add_epi32(_mm512_slli_epi32(qlo, 8),
                                       _mm512_max_epi32(_mm512_min_epi32(rlo, c127), cm128));
                qhi = _mm512_add_epi32(_mm512_slli_epi32(qhi, 8),
                                       _mm512_max_epi32(_mm512_min_epi32(rhi, c127), cm128));
                dd = d / 256.0f;
            }
            a->dx[j * a->nb16 + b] = dd;
            a->t[j * a->nb16 + b] =
                off * dd * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
}

/* The codes of blocks b (at p) and b + 1 (at p + bs; a zero block if `single`) as 64 unsigned
 * bytes in the step layout. */
INLINE __m512i step_codes(const uint8_t *restrict p, const int fmt, const int single) {
    const long bs = block_bytes(fmt);
    if (fmt == Q8_0) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(p + 2));
        const __m256i b = single ? _mm256_setzero_si256()
                                 : _mm256_loadu_si256((const __m256i *)(p + bs + 2));
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        return single ? _mm512_mask_xor_epi64(v, 0x0F, v, _mm512_set1_epi8((char)0x80))
                      : _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    const long o = fmt == Q4_1 ? 4 : 2;
    const __m128i a = _mm_loadu_si128((const __m128i *)(p + o));
    const __m128i b = single ? _mm_setzero_si128() : _mm_loadu_si128((const __m128i *)(p + bs + o));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
}

/* Row w (nb blocks; h: its headers) against the N quantized x rows: y[j * out] = w . x[j]. */
INLINE void qi8_row(const xq_t *restrict a, const uint8_t *restrict w, const uint16_t *restrict h,
                    float *restrict y, long out, const int fmt, const int N, const int D) {
    const long bs = block_bytes(fmt), nb = a->nb;
    /* the lanes of a step's int32 sums -> its block (0 or 1; + 2 per step in the chunk) */
    const __m512i lanes = fmt == Q8_0
                              ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                              : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    __m512 acc[GEMV_MAX_ROWS][2], tacc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = tacc[j] = _mm512_setzero_ps();
    for (long c = 0; c < nb; c += 16) {
        const long nc = nb - c < 16 ? nb - c : 16; /* blocks in this chunk */
        const uint8_t *wc = w + c * bs;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + c)));
        const __m512 k =
            fmt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + a->nb16 + c)))
                        : dw;
    __m512 sc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            sc[j] = _mm512_mul_ps(dw, _mm512_loadu_ps(a->dx + j * a->nb16 + c));
            tacc[j] = _mm512_fmadd_ps(k, _mm512_loadu_ps(a->t + j * a->nb16 + c), tacc[j]);
        }
        const long full = nc / 2; /* whole steps of two blocks */
#pragma GCC unroll 8
        for (long s = 0; s < 8; s++) {
            if (s >= (nc + 1) / 2) break;
            const __m512i v = step_codes(wc + 2 * s * bs, fmt, s >= full);
            const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(2 * (int)s));
#pragma GCC unroll 4
            for (int j = 0; j < N; j++) {
                const long at = j * a->nbp * 32 + (c + 2 * s) * 32;
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v,
                                                  _mm512_loadu_si512(a->q + at));
                if (D == 2)
                    dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), v,
                                              _mm512_loadu_si512(a->q2 + at));
                acc[j][s & 1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, sc[j]),
                                                _mm512_cvtepi32_ps(dot), acc[j][s & 1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
        y[j * out] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]), tacc[j]));
}

/* Rows [lo, hi) of W against all n x rows: per weight row the x rows in groups of up to 4 (N
 * and D compile-time constants in each call), so a row of W (a few hundred bytes) is read from
 * memory once and from L1 by the later groups: up to 16 rows (a 16-token chunk) cost about 4x
 * one group, not a pass over the weights each (measured at 16 rows: 1.05-1.1x PyTorch's int4
 * kernel for Q4_1, 0.55x its two-plane Q8_0, both with bf16 activations). */
#define QI8_RANGE(F)                                                                             \
    static void qi8_range_##F(const xq_t *a, int n, const uint8_t *w, const uint16_t *h,         \
                              float *y, long out, long lo, long hi, int digits) {                \
        const long row = a->nb * block_bytes(F), hrow = a->nb16 * (F == Q4_1 ? 2 : 1);           \
        for (long r = lo; r < hi; r++) {                                                         \
            prefetch_ahead(w, r, row, hi);                                                       \
            for (int g = 0; g < n; g += 4) {                                                     \
                xq_t s = *a; /* x rows g .. g + 3 */                                             \
                s.q += g * a->nbp * 32, s.q2 += g * a->nbp * 32;                                 \
                s.dx += g * a->nb16, s.t += g * a->nb16;                                         \
                const uint8_t *wr = w + r * row;                                                 \
                const uint16_t *hr = h + r * hrow;                                               \
                float *yr = y + g * out + r;                                                     \
                switch ((n - g < 4 ? n - g : 4) + 4 * (digits == 2)) {                           \
                case 1: qi8_row(&s, wr, hr, yr, out, F, 1, 1); break;                            \
                case 2: qi8_row(&s, wr, hr, yr, out, F, 2, 1); break;                            \
                case 3: qi8_row(&s, wr, hr, yr, out, F, 3, 1); break;                            \
                case 4: qi8_row(&s, wr, hr, yr, out, F, 4, 1); break;                            \
                case 5: qi8_row(&s, wr, hr, yr, out, F, 1, 2); break;                            \
                case 6: qi8_row(&s, wr, hr, yr, out, F, 2, 2); break;                            \
                case 7: qi8_row(&s, wr, hr, yr, out, F, 3, 2); break;                            \
                default: qi8_row(&s, wr, hr, yr, out, F, 4, 2); break;                           \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
QI8_RANGE(Q8_0)
QI8_RANGE(Q4_0)
QI8_RANGE(Q4_1)

/* acc + vpdpbusd of v against the four activation codes at p broadcast to every int32 lane,
 * the codes read by the instruction itself (`{1to16}`, a load-port broadcast): GCC 12 makes
 * _mm512_set1_epi32 of them a separate vpbroadcastd before each vpdpbusd. The interleaved Q8_0
 * decode step (16 of them a block and 16 rows) 1.05-1.10x faster in four same-process A/B
 * runs (benchmarks/kernel_ab.py --model the Q8_0 GGUF), the Q4_1 one level (0.99-1.03x). */
typedef int32_t i32_alias __attribute__((may_alias));
INLINE __m512i dpbusd_bcast4(__m512i acc, __m512i v, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*(const i32_alias *)p));
    return acc;
}

/* The activation codes of a long row, asked for into L1 ACT_PF_BLOCKS blocks ahead. Per group
 * the 16 rows' weights stream through L1 (20 bytes a block and row at Q4_1), so where a row's
 * codes (64 bytes a block with two digits) are longer than ACT_PF_MIN_BLOCKS, the next group
 * finds them pushed out to L2: a Llama 3.2 1B's down projection, rows of 8,192 (16 KB of
 * codes, 80 KB of weights a group), read at 18 GB/s on one thread where [8192, 2048] read 25
 * (AMD EPYC, Zen 4). Asked for 4 blocks ahead: 23.7 GB/s (2 blocks 19.2); [8192, 2048] level. */
#define ACT_PF_BLOCKS 4
#define ACT_PF_MIN_BLOCKS 64

/* 16 interleaved rows (wg: their group, ROWS16) against N quantized x rows: y[j * out + r] for
 * r < 16. Per block: the codes (8 registers: Q8_0's quads, or the 4-bit quads' low and high
 * nibbles) are loaded once and serve every x row; each makes 16 rows' partial dots by one
 * vpdpbusd per digit against the 4 activation codes of its elements (two chains a digit). */
INLINE void r16_group(const xq_t *restrict a, const uint8_t *restrict wg, float *restrict y,
                      long out, const int fmt, const int N, const int D) {
    const long bs = block_bytes(fmt), nb = a->nb, gb = 16 * bs;
    const long codes = fmt == Q8_0 ? 512 : 256;
    __m512 acc[GEMV_MAX_ROWS], tacc[GEMV_MAX_ROWS];
    const int pf = a->pf, apf = nb > ACT_PF_MIN_BLOCKS; /* long rows: ask for x's codes */
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j] = tacc[j] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * gb;
        if (pf) prefetch_group(o, gb);
        if (apf && b % 2 == 0 && b + ACT_PF_BLOCKS < nb) { /* the codes of block b + 4 (and 5) */
            const long at = fmt == Q8_0 ? (b + ACT_PF_BLOCKS) * 32 : (b + ACT_PF_BLOCKS) / 2 * 64;
#pragma GCC unroll 4
            for (int j = 0; j < N; j++) {
                _mm_prefetch((const char *)(a->q + j * a->nbp * 32 + at), _MM_HINT_T0);
                if (D == 2) _mm_prefetch((const char *)(a->q2 + j * a->nbp * 32 + at), _MM_HINT_T0);
            }
        }
        __m512i v[8];
        int off[8]; /* the element of each register's first activation code, in a->q's layout */
        if (fmt == Q8_0) {
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) v[c] = _mm512_loadu_si512(o + 64 * c), off[c] = 4 * c;
        } else {
            const __m512i m4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_loadu_si512(o + 64 * c);
                v[c] = _mm512_and_si512(raw, m4), off[c] = 4 * c;
                v[4 + c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4), off[4 + c] = 32 + 4 * c;
            }
        }
        /* The headers' line after the codes' (a compiler barrier: GCC 12 hoisted its loads to
         * the block's start). Read in that order a group's lines ascend, as the hardware
         * prefetcher follows them; the last line first, it left the AMD EPYC (Zen 4) at 16-18
         * GB/s a thread without software prefetch, and at 21-23 with it. */
        __asm__ volatile("" ::: "memory");
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + codes)));
        const __m512 k =
            fmt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + codes + 32)))
                        : dw;
        /* block b's first activation code (Q4: its low half; the high half 32 further) */
        const long at = fmt == Q8_0 ? b * 32 : (b / 2) * 64 + (b % 2) * 16;
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const int8_t *q1 = a->q + j * a->nbp * 32 + at, *q2 = a->q2 + j * a->nbp * 32 + at;
            __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            __m512i t[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                s[c & 1] = dpbusd_bcast4(s[c & 1], v[c], q1 + off[c]);
                if (D == 2) t[c & 1] = dpbusd_bcast4(t[c & 1], v[c], q2 + off[c]);
            }
            __m512i dot = _mm512_add_epi32(s[0], s[1]);
            if (D == 2)
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), _mm512_add_epi32(t[0], t[1]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(dw, _mm512_set1_ps(a->dx[j * a->nb16 + b])),
                                     acc[j]);
            tacc[j] = _mm512_fmadd_ps(k, _mm512_set1_ps(a->t[j * a->nb16 + b]), tacc[j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) _mm512_storeu_ps(y + j * out, _mm512_add_ps(acc[j], tacc[j]));
}

/* Groups [g0, g1) of an interleaved W against all n x rows, the x rows 4 at a time (each
 * group's bytes read from memory once, from L1 by the later x rows). */
#define R16_RANGE(F)                                                                             \
    static void r16_range_##F(const xq_t *a, int n, const uint8_t *w, float *y, long out,        \
                              long g0, long g1, int digits) {                                    \
        const long gbytes = a->nb * 16 * block_bytes(F);                                         \
        const int pf = weight_pf(n);                                                             \
        for (long g = g0; g < g1; g++)                                                           \
            for (int j = 0; j < n; j += 4) {                                                     \
                xq_t s = *a; /* x rows j .. j + 3 */                                             \
                s.pf = pf;                                                                       \
                s.q += j * a->nbp * 32, s.q2 += j * a->nbp * 32;                                 \
                s.dx += j * a->nb16, s.t += j * a->nb16;                                         \
                const uint8_t *wg = w + g * gbytes;                                              \
                float *yg = y + j * out + 16 * g;                                                \
                switch ((n - j < 4 ? n - j : 4) + 4 * (digits == 2)) {                           \
                case 1: r16_group(&s, wg, yg, out, F, 1, 1); break;                              \
                case 2: r16_group(&s, wg, yg, out, F, 2, 1); break;                              \
                case 3: r16_group(&s, wg, yg, out, F, 3, 1); break;                              \
                case 4: r16_group(&s, wg, yg, out, F, 4, 1); break;                              \
                case 5: r16_group(&s, wg, yg, out, F, 1, 2); break;                              \
                case 6: r16_group(&s, wg, yg, out, F, 2, 2); break;                              \
                case 7: r16_group(&s, wg, yg, out, F, 3, 2); break;                              \
                default: r16_group(&s, wg, yg, out, F, 4, 2); break;                             \
                }                                                                                \
            }                                                                                    \
    }
R16_RANGE(Q8_0)
R16_RANGE(Q4_0)
R16_RANGE(Q4_1)

/* A product's activations in the int8 kernel's form: x [n, nb * 32] rounded to `digits` int8
 * codes per element (quantize_x), in one buffer (*buf, for free) that act_make allocates:
 * q and q2 (64-byte multiples per row), then dx and t. 0, or -1 (no memory). */
typedef xq_t act_t;
static int act_make(int fmt, const float *x, int n, long nb, int digits, act_t *a, void **buf) {
    *a = (xq_t){.nb = nb, .nbp = (nb + 1) / 2 * 2, .nb16 = (nb + 15) / 16 * 16};
    const size_t qbytes = (size_t)n * a->nbp * 32, fbytes = sizeof(float) * n * a->nb16;
    *buf = aligned_alloc(64, qbytes * digits + 2 * fbytes);
    if (*buf == NULL) return -1;
    a->q = (int8_t *)*buf;
    a->q2 = a->q + qbytes; /* with one digit: where dx begins, never read as codes */
    a->dx = (float *)((char *)*buf + qbytes * digits);
    a->t = a->dx + n * a->nb16;
    quantize_x(fmt & ~ROWS16, x, n, a, digits);
    return 0;
}

/* Rows [lo, hi) of W against a's n rows (interleaved: lo and hi multiples of 16, whole groups;
 * the threads' chunks are, split_chunk). */
static void act_rows(int fmt, const act_t *a, int n, const uint8_t *w, const uint16_t *h,
                     float *y, long out, long lo, long hi, int digits) {
    if (fmt == (Q8_0 | ROWS16))
        r16_range_Q8_0(a, n, w, y, out, lo / 16, hi / 16, digits);
    else if (fmt == (Q4_0 | ROWS16))
        r16_range_Q4_0(a, n, w, y, out, lo / 16, hi / 16, digits);
    else if (fmt == (Q4_1 | ROWS16))
        r16_range_Q4_1(a, n, w, y, out, lo / 16, hi / 16, digits);
    else if (fmt == Q8_0)
        qi8_range_Q8_0(a, n, w, h, y, out, lo, hi, digits);
    else if (fmt == Q4_0)
        qi8_range_Q4_0(a, n, w, h, y, out, lo, hi, digits);
    else
        qi8_range_Q4_1(a, n, w, h, y, out, lo, hi, digits);
}

#else
/* ---- int8 activations without VNNI: AVX2 (GEMV_I8_ISA 1) and portable C (0) ----------------
 *
 * The same rounding as the VNNI path (per 32-element block d = amax / 127, q1 = round(x / d),
 * with two digits q2 = round(256 (x / d - q1)) saturated to int8), kept as one int16 code per
 * element: 256 q1 + q2 lies in [-32640, 32639]. The weight codes are widened to int16 (Q8_0's
 * q, Q4_0's q - 8, Q4_1's q) and multiplied by vpmaddwd: each int32 lane sums 4 products of at
 * most 128 x 32640, so a block's partial sums stay below 2^24 and convert to float exactly;
 * the integer dot equals the VNNI path's (dot(w, q1) << 8) + dot(w, q2). Only Q4_1's m needs
 * the block's code sum (sx = dx sum(codes)). This is Q8_0's path on AVX2 (vpmaddubsw, bytes as
 * ggml's AVX2 path multiplies them, saturates at int16 for Q8_0's signed codes against the
 * second digit) and every format's in portable C.
 *
 * Q4_0 and Q4_1 on AVX2 multiply bytes instead (`q4_row`): their codes 0..15 are unsigned, so
 * vpmaddubsw takes them as they unpack, against each digit plane (q1, q2: int8), with no
 * widening and no saturation (a pair of products is at most 2 x 15 x 128 = 3840); see q4_dot.
 */
typedef struct {
    int16_t *c; /* [n][nb * 32] */
    int8_t *q1, *q2; /* [n][nb * 32] (AVX2 only): the digits of each code, c = 256 q1 + q2 (one
                      * digit: q1 = 0, q2 = c), what the 4-bit formats multiply as bytes */
    float *dx, *sx; /* [n][nb]: the scale of a code, and dx times the block's code sum */
    long nb;
} x16_t;

#if GEMV_I8_ISA == 1
#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* int32 codes [8] as int8 at q (they fit: the callers clamp them). */
INLINE void store_i8x8(int8_t *q, const __m256i v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(w, w));
}

/* quantize_x16's block i in AVX2, eight elements at a time: the same float operations in the
 * same order (one rounding each, to nearest even), so the same codes and scales as the scalar
 * loop. The activations are quantized on the calling thread before every int8 product; done
 * element by element that was a few percent of a Q4_1 decode step. */
INLINE void quantize_block16(const float *xb, x16_t *a, const long i, const int digits,
                             const int planes) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int u = 0; u < 4; u++) {
        v[u] = _mm256_loadu_ps(xb + 8 * u);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[u]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 iv = _mm256_set1_ps(id), k256 = _mm256_set1_ps(256.0f);
    const __m256i hi8 = _mm256_set1_epi32(127), lo8 = _mm256_set1_epi32(-128);
    __m256i sum = _mm256_setzero_si256();
    for (int u = 0; u < 4; u++) {
        const __m256 s = _mm256_mul_ps(v[u], iv), r1 = _mm256_round_ps(s, NEAREST);
        const __m256i q1 = _mm256_cvtps_epi32(r1);
        __m256i code, q2;
        if (digits == 2) {
            q2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(s, r1), k256), NEAREST));
            q2 = _mm256_max_epi32(_mm256_min_epi32(q2, hi8), lo8);
            code = _mm256_add_epi32(_mm256_slli_epi32(q1, 8), q2);
        } else {
            code = q2 = _mm256_max_epi32(_mm256_min_epi32(q1, hi8), lo8);
        }
        _mm_storeu_si128((__m128i *)(a->c + i * 32 + 8 * u),
                         _mm_packs_epi32(_mm256_castsi256_si128(code),
                                         _mm256_extracti128_si256(code, 1)));
        if (planes) {
            store_i8x8(a->q1 + i * 32 + 8 * u, digits == 2 ? q1 : _mm256_setzero_si256());
            store_i8x8(a->q2 + i * 32 + 8 * u, q2);
        }
        sum = _mm256_add_epi32(sum, code);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
    const float dx = digits == 2 ? d / 256.0f : d;
    a->dx[i] = dx;
    a->sx[i] = dx * (float)_mm_cvtsi128_si32(t);
}
#endif

static void quantize_x16(const float *x, int n, x16_t *a, const int digits, const int planes) {
    const long nb = a->nb;
#if GEMV_I8_ISA == 1
    for (long i = 0; i < n * nb; i++) quantize_block16(x + i * 32, a, i, digits, planes);
#else
    for (long i = 0; i < n * nb; i++) {
        const float *xb = x + i * 32;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) {
            const float v = xb[k] < 0 ? -xb[k] : xb[k];
            amax = v > amax ? v : amax;
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int k = 0; k < 32; k++) {
            const float s = xb[k] * id, r1 = __builtin_rintf(s); /* to nearest even */
            int code = (int)r1;
            code = code > 127 ? 127 : code < -128 ? -128 : code;
            if (digits == 2) {
                int q2 = (int)__builtin_rintf((s - r1) * 256.0f);
                q2 = q2 > 127 ? 127 : q2 < -128 ? -128 : q2;
                code = (int)r1 * 256 + q2;
            }
            a->c[i * 32 + k] = (int16_t)code;
            if (planes) {
                a->q1[i * 32 + k] = (int8_t)(digits == 2 ? (int)r1 : 0);
                a->q2[i * 32 + k] = (int8_t)(digits == 2 ? code - (int)r1 * 256 : code);
            }
            sum += code;
        }
        const float dx = digits == 2 ? d / 256.0f : d;
        a->dx[i] = dx;
        a->sx[i] = dx * (float)sum;
    }
#endif
}

#if GEMV_I8_ISA == 1
/* Q8_0 block b of a weight row against N rows of codes, into accumulator set u (a constant: with
 * the block loop unrolled by two every accumulator stays in a register; indexed by b & 1 they
 * went through the stack, and each block waited on a store-to-load forward: on an AMD EPYC
 * (Zen 1) that made a Q4_1 decode step of SmolLM2 1.23x slower when Q4_1 took this path). */
INLINE void i16_block(const x16_t *restrict a, const uint8_t *restrict p, long b, const int N,
                      __m256 acc[][2], const int u) {
    const long nb = a->nb;
    const float dw = half(p);
    /* int16 codes of elements 0..15 and 16..31 */
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 2)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 18)));
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        const int16_t *xb = a->c + (j * nb + b) * 32;
        const __m256i s =
            _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xb)),
                             _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xb + 16))));
        acc[j][u] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a->dx[j * nb + b]), _mm256_cvtepi32_ps(s),
                                    acc[j][u]);
    }
}

/* Block b's 4-bit codes (lo: elements 0..15, hi: 16..31, as unsigned bytes) against row j's
 * digit planes: 4 int32 lanes summing to dot(w, 256 q1 + q2). vpmaddubsw gives pairs of
 * products per plane, the two halves are summed as int16 (at most 7680), and two vpmaddwd
 * (by 256 and by 1) make int32 of them: exact, the integer dot of the other paths. */
INLINE __m128i q4_dot(const x16_t *restrict a, const __m128i lo, const __m128i hi, const long b,
                      const int j) {
    const int8_t *q1 = a->q1 + (j * a->nb + b) * 32, *q2 = a->q2 + (j * a->nb + b) * 32;
    const __m128i p1 =
        _mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i *)q1)),
                      _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i *)(q1 + 16))));
    const __m128i p2 =
        _mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i *)q2)),
                      _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i *)(q2 + 16))));
    return _mm_add_epi32(_mm_madd_epi16(p1, _mm_set1_epi16(256)),
                         _mm_madd_epi16(p2, _mm_set1_epi16(1)));
}

/* The codes of the 4-bit block at p as bytes: low nibbles (elements 0..15), high (16..31). */
INLINE void q4_codes(const uint8_t *p, const int fmt, __m128i *lo, __m128i *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(p + (fmt == Q4_1 ? 4 : 2)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    *lo = _mm_and_si128(v, nib), *hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
}

/* A Q4_0 / Q4_1 row against N rows, four blocks at a time: their dots are summed across lanes
 * by three vphaddd into one vector of 4 block sums, scaled by the 4 blocks' dw dx in one FMA
 * (no broadcast per block), and the offsets (Q4_1's m, Q4_0's -8 dw) times the blocks' sx in
 * another; the 4 fp16 headers are gathered into one vector. Measured on an AMD EPYC (Zen 1),
 * SmolLM2's 120 layer matrices at 2 threads, both builds in one process: 1.21-1.24x the word
 * path for Q4_1, 1.16x for Q4_0 (the bytes skip 4 widening micro-ops a block, the sums 4 more). */
INLINE void q4_row(const x16_t *restrict a, const uint8_t *restrict w, float *restrict y,
                   long out, const int fmt, const int N) {
    const long bs = block_bytes(fmt), nb = a->nb;
    __m128 acc[GEMV_MAX_ROWS], macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j] = macc[j] = _mm_setzero_ps();
    long b = 0;
    for (; b + 3 < nb; b += 4) {
        const uint8_t *p = w + b * bs;
        __m128i lo[4], hi[4];
        uint16_t hd[4], hm[4];
        for (int i = 0; i < 4; i++) {
            q4_codes(p + i * bs, fmt, &lo[i], &hi[i]);
            memcpy(&hd[i], p + i * bs, 2);
            if (fmt == Q4_1) memcpy(&hm[i], p + i * bs + 2, 2);
        }
        const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)hd));
        const __m128 mw = fmt == Q4_1 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)hm))
                                      : _mm_mul_ps(dw, _mm_set1_ps(-8.0f));
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const __m128i s = _mm_hadd_epi32(
                _mm_hadd_epi32(q4_dot(a, lo[0], hi[0], b, j), q4_dot(a, lo[1], hi[1], b + 1, j)),
                _mm_hadd_epi32(q4_dot(a, lo[2], hi[2], b + 2, j), q4_dot(a, lo[3], hi[3], b + 3, j)));
            acc[j] = _mm_fmadd_ps(_mm_mul_ps(dw, _mm_loadu_ps(a->dx + j * nb + b)),
                                  _mm_cvtepi32_ps(s), acc[j]);
            macc[j] = _mm_fmadd_ps(mw, _mm_loadu_ps(a->sx + j * nb + b), macc[j]);
        }
    }
    float tail[GEMV_MAX_ROWS] = {0}; /* the last nb % 4 blocks, one at a time */
    for (; b < nb; b++) {
        const uint8_t *p = w + b * bs;
        __m128i lo, hi;
        q4_codes(p, fmt, &lo, &hi);
        const float dw = half(p), m = fmt == Q4_1 ? half(p + 2) : -8.0f * dw;
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            __m128i s = q4_dot(a, lo, hi, b, j);
            s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
            tail[j] += dw * a->dx[j * nb + b] * (float)_mm_cvtsi128_si32(s) + m * a->sx[j * nb + b];
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        __m128 s = _mm_add_ps(acc[j], macc[j]);
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        y[j * out] = _mm_cvtss_f32(s) + tail[j];
    }
}

INLINE void i16_row(const x16_t *restrict a, const uint8_t *restrict w, float *restrict y,
                    long out, const int fmt, const int N) {
    if (fmt != Q8_0) {
        q4_row(a, w, y, out, fmt, N);
        return;
    }
    const long bs = block_bytes(fmt), nb = a->nb;
    __m256 acc[GEMV_MAX_ROWS][2];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    long b = 0;
    for (; b + 1 < nb; b += 2) {
        i16_block(a, w + b * bs, b, N, acc, 0);
        i16_block(a, w + (b + 1) * bs, b + 1, N, acc, 1);
    }
    if (b < nb) i16_block(a, w + b * bs, b, N, acc, 0);
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) y[j * out] = hsum256(_mm256_add_ps(acc[j][0], acc[j][1]));
}
#else
INLINE void i16_row(const x16_t *restrict a, const uint8_t *restrict w, float *restrict y,
                    long out, const int fmt, const int N) {
    const long bs = block_bytes(fmt), nb = a->nb;
    float acc[GEMV_MAX_ROWS] = {0}, macc[GEMV_MAX_ROWS] = {0};
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bs;
        const float dw = half(p), m = fmt == Q4_1 ? half(p + 2) : 0.0f;
        int16_t wq[32];
        if (fmt == Q8_0) {
            for (int k = 0; k < 32; k++) wq[k] = (int8_t)p[2 + k];
        } else {
            const uint8_t *q = p + (fmt == Q4_1 ? 4 : 2);
            const int off = fmt == Q4_0 ? 8 : 0;
            for (int k = 0; k < 16; k++) wq[k] = (q[k] & 0x0F) - off, wq[k + 16] = (q[k] >> 4) - off;
        }
        for (int j = 0; j < N; j++) {
            const int16_t *xb = a->c + (j * nb + b) * 32;
            int32_t s = 0;
            for (int k = 0; k < 32; k++) s += (int32_t)wq[k] * xb[k];
            acc[j] += dw * a->dx[j * nb + b] * (float)s;
            if (fmt == Q4_1) macc[j] += m * a->sx[j * nb + b];
        }
    }
    for (int j = 0; j < N; j++) y[j * out] = acc[j] + macc[j];
}
#endif

#define I16_RANGE(F)                                                                             \
    static void i16_range_##F(const x16_t *a, int n, const uint8_t *w, float *y, long out,       \
                              long lo, long hi) {                                                \
        const long row = a->nb * block_bytes(F);                                                 \
        for (long r = lo; r < hi; r++) {                                                         \
            prefetch_ahead(w, r, row, hi);                                                       \
            for (int g = 0; g < n; g += 4) {                                                     \
                x16_t s = *a; /* x rows g .. g + 3 */                                            \
                s.c += g * a->nb * 32, s.dx += g * a->nb, s.sx += g * a->nb;                     \
                s.q1 += g * a->nb * 32, s.q2 += g * a->nb * 32;                                  \
                const uint8_t *wr = w + r * row;                                                 \
                float *yr = y + g * out + r;                                                     \
                switch (n - g < 4 ? n - g : 4) {                                                 \
                case 1: i16_row(&s, wr, yr, out, F, 1); break;                                   \
                case 2: i16_row(&s, wr, yr, out, F, 2); break;                                   \
                case 3: i16_row(&s, wr, yr, out, F, 3); break;                                   \
                default: i16_row(&s, wr, yr, out, F, 4); break;                                  \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
I16_RANGE(Q8_0)
I16_RANGE(Q4_0)
I16_RANGE(Q4_1)

#if GEMV_I8_ISA == 1
/* ---- rows interleaved by 16 on AVX2 (Q4_0 / Q4_1) ------------------------------------------
 *
 * The ROWS16 layout read 8 rows at a time: a 256-bit half of a quad's 64 bytes holds 4 codes
 * of 8 rows, and vpmaddubsw against 4 broadcast activation codes of one digit plane makes each
 * row's two int16 pair sums (at most 2 x 15 x 128), summed over the block's 8 code vectors in
 * int16 (at most 30,720) and widened once by vpmaddwd (by 256 for q1, 1 for q2): the integer
 * dot of the other paths. Q8_0 stays in GGUF order here: its unsigned codes (q + 128) against
 * int8 digits overflow vpmaddubsw's int16 pairs. */
INLINE __m256i bcast4_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

INLINE void r16_group(const x16_t *restrict a, const uint8_t *restrict wg, float *restrict y,
                      long out, const int fmt, const int N) {
    const long bs = block_bytes(fmt), nb = a->nb, gb = 16 * bs;
    __m256 acc[GEMV_MAX_ROWS][2], tacc[GEMV_MAX_ROWS][2];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = tacc[j][0] = tacc[j][1] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), k256 = _mm256_set1_epi16(256), one = _mm256_set1_epi16(1);
    for (long b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * gb;
        prefetch_group(o, gb);
        for (int hh = 0; hh < 2; hh++) { /* rows 8 hh .. 8 hh + 7 */
            __m256i v[8];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(o + 64 * c + 32 * hh));
                v[c] = _mm256_and_si256(raw, m4);
                v[4 + c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 256 + 16 * hh)));
            const __m256 k =
                fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 288 + 16 * hh)))
                            : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
#pragma GCC unroll 4
            for (int j = 0; j < N; j++) {
                const int8_t *q1 = a->q1 + (j * nb + b) * 32, *q2 = a->q2 + (j * nb + b) * 32;
                __m256i s1 = _mm256_setzero_si256(), s2 = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                    const int e = c < 4 ? 4 * c : 16 + 4 * (c - 4); /* the codes' first element */
                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(v[c], bcast4_256(q1 + e)));
                    s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(v[c], bcast4_256(q2 + e)));
                }
                const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(s1, k256), _mm256_madd_epi16(s2, one));
                acc[j][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                             _mm256_mul_ps(dw, _mm256_set1_ps(a->dx[j * nb + b])),
                                             acc[j][hh]);
                tacc[j][hh] = _mm256_fmadd_ps(k, _mm256_set1_ps(a->sx[j * nb + b]), tacc[j][hh]);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
        for (int hh = 0; hh < 2; hh++)
            _mm256_storeu_ps(y + j * out + 8 * hh, _mm256_add_ps(acc[j][hh], tacc[j][hh]));
}

#define R16_RANGE(F)                                                                             \
    static void r16_range_##F(const x16_t *a, int n, const uint8_t *w, float *y, long out,       \
                              long g0, long g1) {                                                \
        const long gbytes = a->nb * 16 * block_bytes(F);                                         \
        for (long g = g0; g < g1; g++)                                                           \
            for (int j = 0; j < n; j += 4) {                                                     \
                x16_t s = *a; /* x rows j .. j + 3 */                                            \
                s.c += j * a->nb * 32, s.dx += j * a->nb, s.sx += j * a->nb;                     \
                s.q1 += j * a->nb * 32, s.q2 += j * a->nb * 32;                                  \
                const uint8_t *wg = w + g * gbytes;                                              \
                float *yg = y + j * out + 16 * g;                                                \
                switch (n - j < 4 ? n - j : 4) {                                                 \
                case 1: r16_group(&s, wg, yg, out, F, 1); break;                                 \
                case 2: r16_group(&s, wg, yg, out, F, 2); break;                                 \
                case 3: r16_group(&s, wg, yg, out, F, 3); break;                                 \
                default: r16_group(&s, wg, yg, out, F, 4); break;                                \
                }                                                                                \
            }                                                                                    \
    }
R16_RANGE(Q4_0)
R16_RANGE(Q4_1)
#endif

/* A product's activations in the int16 kernels' form (quantize_x16), in one buffer (*buf, for
 * free): c, dx, sx, then (read on AVX2 only) the digit planes q1, q2. 0, or -1 (no memory). */
typedef x16_t act_t;
static int act_make(int fmt, const float *x, int n, long nb, int digits, act_t *a, void **buf) {
    *a = (x16_t){.nb = nb};
    *buf = malloc((size_t)n * nb * (32 * (sizeof(int16_t) + 2) + 2 * sizeof(float)));
    if (*buf == NULL) return -1;
    a->c = (int16_t *)*buf;
    a->dx = (float *)(a->c + (size_t)n * nb * 32);
    a->sx = a->dx + n * nb;
    a->q1 = (int8_t *)(a->sx + n * nb);
    a->q2 = a->q1 + (size_t)n * nb * 32;
    /* planes: q4_row's and the interleaved rows' */
    quantize_x16(x, n, a, digits, GEMV_I8_ISA == 1 && (fmt & ~ROWS16) != Q8_0);
    return 0;
}

/* Rows [lo, hi) of W against a's n rows (the headers h are the VNNI path's: unused; digits are
 * in the codes). */
static void act_rows(int fmt, const act_t *a, int n, const uint8_t *w, const uint16_t *h,
                     float *y, long out, long lo, long hi, int digits) {
    (void)h, (void)digits;
#if GEMV_I8_ISA == 1
    if (fmt == (Q4_0 | ROWS16))
        r16_range_Q4_0(a, n, w, y, out, lo / 16, hi / 16);
    else if (fmt == (Q4_1 | ROWS16))
        r16_range_Q4_1(a, n, w, y, out, lo / 16, hi / 16);
    else
#endif
    if (fmt == Q8_0)
        i16_range_Q8_0(a, n, w, y, out, lo, hi);
    else if (fmt == Q4_0)
        i16_range_Q4_0(a, n, w, y, out, lo, hi);
    else
        i16_range_Q4_1(a, n, w, y, out, lo, hi);
}
#endif

/* One chunk of at most GEMV_I8_MAX_ROWS rows (h: the VNNI path's headers), x rounded to `digits`
 * int8 codes per element first (once per chunk, before the threads split the rows). */
static int qi8_chunk(int fmt, const float *x, int n, const uint8_t *w, const uint16_t *h,
                     long out, long nb, float *y, int threads, int digits) {
    act_t a;
    void *buf;
    if (act_make(fmt, x, n, nb, digits, &a, &buf)) return -1;
    SPLIT(act_rows(fmt, &a, n, w, h, y, out, lo, hi, digits));
    free(buf);
    return 0;
}

/* As gemv_q for any number of rows (h: the VNNI path's headers, built by engine/gemv.py; the
 * other paths ignore them; none for `fmt | ROWS16`, the interleaved rows, which the VNNI path
 * alone reads: -1 elsewhere), x rounded to `digits` (1 or 2) int8 codes per element: the rows go
 * in chunks of GEMV_I8_MAX_ROWS, each a pass over the weights (a prefill of 256 rows is 16
 * passes, the weights of one matrix staying in cache between them). Returns 0, or -1 for bad
 * arguments or when the activations' buffer cannot be allocated. */
int gemv_qi8(int fmt, const float *x, int n, const uint8_t *w, const uint16_t *h, long out,
             long nb, float *y, int threads, int digits) {
    if (n < 1 || nb > GEMV_MAX_BLOCKS || (digits != 1 && digits != 2)) return -1;
    if (fmt & ROWS16) /* interleaved by 16 rows, whole groups only: the VNNI path reads Q8_0,
                       * Q4_0 and Q4_1 so, the AVX2 path Q4_0 and Q4_1 */
        if (out % 16 || (fmt & ~ROWS16) > Q4_1 || GEMV_I8_ISA == 0 ||
            (GEMV_I8_ISA == 1 && (fmt & ~ROWS16) == Q8_0))
            return -1;
    for (int c0 = 0; c0 < n; c0 += GEMV_I8_MAX_ROWS) {
        const int m = n - c0 < GEMV_I8_MAX_ROWS ? n - c0 : GEMV_I8_MAX_ROWS;
        if (qi8_chunk(fmt, x + (long)c0 * nb * 32, m, w, h, out, nb, y + (long)c0 * out, threads,
                      digits))
            return -1;
    }
    return 0;
}

/* ---- K-quants: Q4_K and Q6_K super-blocks (256 elements), float32 activations ---------------
 *
 * ggml-common.h's layouts, decoded as ggml's dequantize_row_q4_K / _q6_K do:
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, scales[12] (8 sub-blocks of 32: 6-bit scale and min
 *        each), qs[128] (sub-block pairs share 32 bytes: the first's low nibbles, the second's
 *        high ones); w = d sc q - dmin m.
 *   Q6_K (210 bytes): ql[128] (low nibbles), qh[64] (high 2 bits), int8 scales[16] (16
 *        sub-blocks of 16), fp16 d; w = d sc (q - 32).
 * Each thread takes a range of weight rows; per row and super-block the 256 weights are decoded
 * once into float32 (plain loops the compiler vectorizes for the target) and dotted with every
 * activation row, so any number of rows costs one pass over the weights. The packed bytes are
 * what streams (4.5 and 6.56 bits per weight), prefetched ahead as the int8 kernels do.
 */
enum { Q4_K = 3, Q6_K = 4 };

INLINE long k_block_bytes(const int fmt) { return fmt == Q4_K ? 144 : 210; }

static void decode_q4_k(const uint8_t *restrict b, float *restrict y) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *sc = b + 4, *q = b + 16;
    for (int j = 0; j < 8; j += 2) { /* sub-blocks j and j + 1 share 32 bytes of nibbles */
        float dd[2], mm[2];
        for (int u = 0; u < 2; u++) {
            const int i = j + u;
            const int s = i < 4 ? sc[i] & 63 : (sc[i + 4] & 0xF) | ((sc[i - 4] >> 6) << 4);
            const int m = i < 4 ? sc[i + 4] & 63 : (sc[i + 4] >> 4) | ((sc[i] >> 6) << 4);
            dd[u] = d * (float)s, mm[u] = dmin * (float)m;
        }
        const uint8_t *qj = q + j / 2 * 32;
        for (int l = 0; l < 32; l++) {
            y[j * 32 + l] = dd[0] * (float)(qj[l] & 0xF) - mm[0];
            y[j * 32 + 32 + l] = dd[1] * (float)(qj[l] >> 4) - mm[1];
        }
    }
}

static void decode_q6_k(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half(b + 208);
    /* per half of 128: four groups of 32 (low or high nibbles of ql's first or second 32 bytes,
     * and 2 bits of qh each), two sub-blocks of 16 per group: simple loops that vectorize */
    for (int h = 0; h < 2; h++, y += 128, ql += 64, qh += 32, sc += 8)
        for (int g = 0; g < 4; g++) {
            const uint8_t *lq = ql + (g & 1) * 32;
            const int shift = (g >> 1) * 4, hshift = 2 * g;
            const float s0 = d * (float)sc[2 * g], s1 = d * (float)sc[2 * g + 1];
            float *yg = y + 32 * g;
            for (int l = 0; l < 32; l++) {
                const int q = (((lq[l] >> shift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
                yg[l] = (l < 16 ? s0 : s1) * (float)q;
            }
        }
}

/* The dot of 256 decoded weights with 256 activations (16 lanes, then pairwise). */
INLINE float dot256(const float *restrict a, const float *restrict b) {
    float s[16] = {0};
    for (int k = 0; k < 256; k += 16)
        for (int u = 0; u < 16; u++) s[u] += a[k + u] * b[k + u];
    for (int u = 8; u >= 1; u /= 2)
        for (int v = 0; v < u; v++) s[v] += s[v + u];
    return s[0];
}

static void k_range(const int fmt, const float *x, int n, const uint8_t *w, long nb, float *y,
                    long out, long lo, long hi) {
    const long bs = k_block_bytes(fmt), row = nb * bs, in = nb * 256;
    float tmp[256] __attribute__((aligned(64)));
    for (long r = lo; r < hi; r++) {
        prefetch_ahead(w, r, row, hi);
        for (int j = 0; j < n; j++) y[j * out + r] = 0.0f;
        for (long b = 0; b < nb; b++) {
            if (fmt == Q4_K)
                decode_q4_k(w + r * row + b * bs, tmp);
            else
                decode_q6_k(w + r * row + b * bs, tmp);
            for (int j = 0; j < n; j++) y[j * out + r] += dot256(tmp, x + j * in + b * 256);
        }
    }
}

#if GEMV_ISA >= 1
/* ---- Q4_K in registers (AVX2 and AVX-512) ------------------------------------------------
 *
 * Why: decoding each super-block into a float32 buffer and dotting it after (k_range) spent
 * about 330 instructions a super-block, a third of them the scalar 6-bit scales, and ran at a
 * quarter of the stream. Here the scales and mins of a super-block are unpacked together
 * (ggml's 32-bit masks: 8 scale bytes, then 8 min bytes) and converted as one vector each; the
 * codes go from bytes to float lanes (zero-extended, the low nibble masked, the high one
 * shifted) and meet x by FMA, each sub-block's sum then scaled once; the mins multiply a
 * per-call sum of x per sub-block of 32 (xs), 8 lanes at once. The same float32 activations and
 * exact weights as k_range, the sums in another order. */

/* Q4_K super-block b's 8 sub-block scales d sc and mins dmin m as float lanes. */
INLINE void q4k_scales(const uint8_t *b, __m256 *a, __m256 *m) {
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mins_lo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_lo;
    u[0] &= k1;
    /* 8 scales, then 8 mins (made in registers: four 32-bit stores read back as one 128-bit
     * load would wait on the stores, which cannot forward to it) */
    const __m128i v = _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
    *a = _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *m = _mm256_mul_ps(_mm256_set1_ps(half(b + 2)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}

/* The K-quant kernels' float vectors, one source for both widths: KACC holds KW float lanes
 * (16 on AVX-512, 8 on AVX2), and k* are its loads, broadcasts and products. knibbles: KW bytes
 * at p as floats, their low nibbles and their high ones. codes32: 32 signed codes (bytes of
 * c) times their scales, s0 for the first 16 and s1 for the rest (Q6_K's two sub-blocks),
 * against the 32 activations at x + j * in of each of the N rows: acc[j] += ... */
#if GEMV_ISA == 2
#define KACC __m512
#define KW 16 /* float lanes */
INLINE KACC kacc_zero(void) { return _mm512_setzero_ps(); }
INLINE float kacc_sum(const KACC a) { return _mm512_reduce_add_ps(a); }
INLINE KACC kload(const float *p) { return _mm512_loadu_ps(p); }
INLINE KACC kset(const float v) { return _mm512_set1_ps(v); }
INLINE KACC kmul(const KACC a, const KACC b) { return _mm512_mul_ps(a, b); }
INLINE KACC kfma(const KACC a, const KACC b, const KACC c) { return _mm512_fmadd_ps(a, b, c); }
INLINE void knibbles(const uint8_t *p, KACC *lo, KACC *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
INLINE void codes32(const __m256i c, const float s0, const float s1, const float *restrict x,
                    long in, KACC *acc, const int N) {
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))),
                                    _mm512_set1_ps(s0));
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))),
                                    _mm512_set1_ps(s1));
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        acc[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * in), acc[j]);
        acc[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + j * in + 16), acc[j]);
    }
}
#else
#define KACC __m256
#define KW 8
INLINE KACC kacc_zero(void) { return _mm256_setzero_ps(); }
INLINE float kacc_sum(const KACC a) { return hsum256(a); }
INLINE KACC kload(const float *p) { return _mm256_loadu_ps(p); }
INLINE KACC kset(const float v) { return _mm256_set1_ps(v); }
INLINE KACC kmul(const KACC a, const KACC b) { return _mm256_mul_ps(a, b); }
INLINE KACC kfma(const KACC a, const KACC b, const KACC c) { return _mm256_fmadd_ps(a, b, c); }
INLINE void knibbles(const uint8_t *p, KACC *lo, KACC *hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
INLINE void codes32(const __m256i c, const float s0, const float s1, const float *restrict x,
                    long in, KACC *acc, const int N) {
    __m256 w[4];
    for (int k = 0; k < 4; k++) {
        const __m128i h = k < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
        w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k & 1 ? _mm_srli_si128(h, 8) : h)),
                             _mm256_set1_ps(k < 2 ? s0 : s1));
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
        for (int k = 0; k < 4; k++)
            acc[j] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + j * in + 8 * k), acc[j]);
}
#endif

/* Row w (nb super-blocks) against N rows of x (xs: their sums per sub-block, [N][nb * 8]):
 * y[j * out] = w . x[j]. */
INLINE void q4k_row(const float *restrict x, const float *restrict xs, long nb,
                    const uint8_t *restrict w, float *restrict y, long out, const int N) {
    const long in = nb * 256;
    float sa[8] __attribute__((aligned(32)));
    KACC acc[GEMV_MAX_ROWS];
    __m256 macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j] = kacc_zero(), macc[j] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 144, *q = p + 16;
        __m256 a, m;
        q4k_scales(p, &a, &m);
        _mm256_store_ps(sa, a);
#pragma GCC unroll 4
        for (int j = 0; j < N; j++)
            macc[j] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + (j * nb + b) * 8), macc[j]);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            const float *xc = x + b * 256 + 64 * c;
            KACC lo[32 / KW], hi[32 / KW];
            for (int k = 0; k < 32 / KW; k++) knibbles(q + 32 * c + KW * k, &lo[k], &hi[k]);
            const KACC a0 = kset(sa[2 * c]), a1 = kset(sa[2 * c + 1]);
#pragma GCC unroll 4
            for (int j = 0; j < N; j++) { /* each sub-block's dot, then scaled once */
                const float *xj = xc + j * in;
                KACC s0 = kmul(lo[0], kload(xj)), s1 = kmul(hi[0], kload(xj + 32));
                for (int k = 1; k < 32 / KW; k++) {
                    s0 = kfma(lo[k], kload(xj + KW * k), s0);
                    s1 = kfma(hi[k], kload(xj + 32 + KW * k), s1);
                }
                acc[j] = kfma(s1, a1, kfma(s0, a0, acc[j]));
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) y[j * out] = kacc_sum(acc[j]) - hsum256(macc[j]);
}


/* A Q6_K row (nb super-blocks of 210 bytes) against N rows of x. Per half of 128 and group
 * of 32 the 6-bit codes are put together as bytes (ql's nibble, qh's 2 bits, less 32: 32
 * signed codes at a time in 256-bit byte lanes), then as floats times their sub-block's d sc.
 * (The offset taken off as d sc times sums of x instead cancelled: 1e-5 of a single dot.) */
INLINE void q6k_row(const float *restrict x, long nb, const uint8_t *restrict w,
                    float *restrict y, long out, const int N) {
    const long in = nb * 256;
    KACC acc[GEMV_MAX_ROWS];
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i k32 = _mm256_set1_epi8(32);
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j] = kacc_zero();
    for (long b = 0; b < nb; b++) {
        const uint8_t *ql = w + b * 210, *qh = ql + 128;
        const int8_t *sc = (const int8_t *)(ql + 192);
        const float d = half(ql + 208);
        float s[16] __attribute__((aligned(32)));
        const __m128i sc16 = _mm_loadu_si128((const __m128i *)sc);
        const __m256 s0 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16)));
        const __m256 s1 = _mm256_mul_ps(_mm256_set1_ps(d),
                                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8))));
        _mm256_store_ps(s, s0), _mm256_store_ps(s + 8, s1);

        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i l = g & 1 ? l1 : l0;
                const __m256i lo4 = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(l, 4) : l, m4);
                const __m256i hi2 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), m2);
                const __m256i c = _mm256_sub_epi8(_mm256_or_si256(lo4, _mm256_slli_epi16(hi2, 4)), k32);
                const int k = 8 * h + 2 * g; /* the group's first sub-block */
                codes32(c, s[k], s[k + 1], x + b * 256 + 128 * h + 32 * g, in, acc, N);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) y[j * out] = kacc_sum(acc[j]);
}

static void q6k_range(const float *x, int n, const uint8_t *w, long nb, float *y, long out,
                      long lo, long hi) {
    const long row = nb * 210;
    for (long r = lo; r < hi; r++) {
        prefetch_ahead(w, r, row, hi);
        for (int g = 0; g < n; g += 4) {
            const float *xg = x + g * nb * 256;
            float *yr = y + g * out + r;
            switch (n - g < 4 ? n - g : 4) {
            case 1: q6k_row(xg, nb, w + r * row, yr, out, 1); break;
            case 2: q6k_row(xg, nb, w + r * row, yr, out, 2); break;
            case 3: q6k_row(xg, nb, w + r * row, yr, out, 3); break;
            default: q6k_row(xg, nb, w + r * row, yr, out, 4); break;
            }
        }
    }
}

static void q4k_range(const float *x, const float *xs, int n, const uint8_t *w, long nb,
                      float *y, long out, long lo, long hi) {
    const long row = nb * 144;
    for (long r = lo; r < hi; r++) {
        prefetch_ahead(w, r, row, hi);
        for (int g = 0; g < n; g += 4) {
            const float *xg = x + g * nb * 256, *sg = xs + g * nb * 8;
            float *yr = y + g * out + r;
            switch (n - g < 4 ? n - g : 4) {
            case 1: q4k_row(xg, sg, nb, w + r * row, yr, out, 1); break;
            case 2: q4k_row(xg, sg, nb, w + r * row, yr, out, 2); break;
            case 3: q4k_row(xg, sg, nb, w + r * row, yr, out, 3); break;
            default: q4k_row(xg, sg, nb, w + r * row, yr, out, 4); break;
            }
        }
    }
}
#endif

/* y [n, out] = x [n, nb * 256] @ W^T, W given as Q4_K or Q6_K super-blocks [out, nb, bytes];
 * any n >= 1. Returns 0, or -1 for another format (or no memory). (Q4_K's mins folded into a
 * per-sub-block sum of x in plain C measured 4.8x slower than the decoded copy: the compiler
 * did not vectorize it; with intrinsics, q4k_row, it is the faster way.) */
int gemv_k(int fmt, const float *x, int n, const uint8_t *w, long out, long nb, float *y,
           int threads) {
    if (n < 1 || (fmt != Q4_K && fmt != Q6_K)) return -1;
#if GEMV_ISA >= 1
    if (fmt == Q6_K) {
        SPLIT(q6k_range(x, n, w, nb, y, out, lo, hi));
        return 0;
    }
    float *xs = malloc(sizeof(float) * (size_t)n * nb * 8); /* x summed per sub-block of 32 */
    if (xs == NULL) return -1;
    sums32(x, n * nb * 8, xs);
    SPLIT(q4k_range(x, xs, n, w, nb, y, out, lo, hi));
    free(xs);
    return 0;
#endif
    SPLIT(k_range(fmt, x, n, w, nb, y, out, lo, hi));
    return 0;
}

/* ---- K-quants against int8 activations: Q4_K and Q6_K ------------------------------------
 *
 * Why: with float32 activations (gemv_k) each weight code becomes a float lane (a widening and
 * a convert per 16 weights, on the ports the FMAs need too), and Q4_K / Q6_K read 55-61% of the
 * stream. Here x is rounded as gemv_qi8 rounds it (per 32-element block d = amax / 127, two
 * int8 digits by default) and the codes meet it in integers, as gemv_qi8 does for Q4_1:
 *   Q4_K: w = d sc q - dmin m per sub-block of 32 (q 0..15): the sub-block's integer dot of q
 *         with the codes, times d sc dx, less dmin m times dx sum(codes) (sx, per call);
 *   Q6_K: w = d sc (q - 32) per sub-block of 16 (q 0..63): the sub-block's integer dot of q
 *         with the codes times d sc dx, less d sc dx times 32 times the sum of the codes (`bsub`,
 *         per call and sub-block, exact in a float32), the second term one FMA of 16
 *         sub-blocks a super-block. Why: subtracting the offset from each lane's integer dot
 *         (a load and a subtract per 16 codes) made Q6_K the slowest kernel from the cache
 *         (20 GB/s a thread on Zen 4), where a step of a Q4_K_M model reads a third of its
 *         bytes. (The offset taken off in floats per weight cancelled: gemv_k says so; taken
 *         off per sub-block as here it does not: both terms are of a sub-block's size.)
 * The integer dots are exact (a lane: 4 x 63 x 32640 < 2^24, a float32 exactly), so the result
 * is the dequantized weight times the rounded x, the sums in another order: what
 * kernels.gemv.quantize_blocks and the tests' reference compute. A 64-code register holds
 * whole sub-blocks (Q4_K 2 of 32, Q6_K 4 of 16); its int32 lanes are converted once and meet a
 * vector of their sub-blocks' scales (one permute) in one FMA.
 *
 * The activations' order is each path's own: on the VNNI path a 512-bit load of Q4_K's nibble
 * bytes holds sub-blocks 4k and 4k + 2 in its low nibbles and 4k + 1, 4k + 3 in its high ones,
 * so the codes of each 128 elements are stored in that order (elements 0..31, 64..95, 32..63,
 * 96..127) once per call instead of shuffling the weights per row; Q6_K's and every AVX2
 * register are in element order. */
typedef struct {
    const int8_t *q1, *q2; /* [n][in] the digit planes (two digits: 256 q1 + q2; one: see below) */
    const int16_t *c;      /* [n][in] the whole codes (portable C) */
    const float *dx, *sx;  /* [n][xs] per 32-element block: a code's scale, dx times the code sum */
    const float *bsub;     /* [n][in / 16] (Q6_K): 32 times the sum of each sub-block's codes */
    long nb, xs;           /* super-blocks per row; the stride of dx and sx */
    int pf;                /* q4k_r16_group: ask for the weights ahead (r16_range's weight_pf) */
} kact_t;

/* The 6-bit scales and mins of Q4_K super-block p as integers (ggml's get_scale_min_k4). */
INLINE void q4k_scale_min(const uint8_t *sc, const int i, int *s, int *m) {
    *s = i < 4 ? sc[i] & 63 : (sc[i + 4] & 0xF) | ((sc[i - 4] >> 6) << 4);
    *m = i < 4 ? sc[i + 4] & 63 : (sc[i + 4] >> 4) | ((sc[i] >> 6) << 4);
}

#if GEMV_I8_ISA == 2
/* v's 16 int32 lanes: the dot of its unsigned codes with the digit planes at p1 and p2 (one
 * digit: p1 only), as gemv_qi8 combines them ((dot q1 << 8) + dot q2). */
INLINE __m512i kdot(const __m512i v, const int8_t *p1, const int8_t *p2, const int D) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(p1));
    if (D == 2) dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), v, _mm512_loadu_si512(p2));
    return dot;
}

INLINE void q4k_i8_row(const kact_t *restrict a, const uint8_t *restrict w, float *restrict y,
                       long out, const int N, const int D) {
    const long nb = a->nb, in = nb * 256;
    /* register r's lanes 0..7 and 8..15 -> their sub-blocks (the order above) */
    const __m512i idx[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
        _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
        _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)};
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[GEMV_MAX_ROWS][2];
    __m256 macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
        acc[j][0] = acc[j][1] = _mm512_setzero_ps(), macc[j] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 144;
        __m256 s8, m8;
        q4k_scales(p, &s8, &m8);
        const __m512i raw0 = _mm512_loadu_si512(p + 16), raw1 = _mm512_loadu_si512(p + 80);
        const __m512i v[4] = {_mm512_and_si512(raw0, m4), _mm512_and_si512(_mm512_srli_epi16(raw0, 4), m4),
                              _mm512_and_si512(raw1, m4), _mm512_and_si512(_mm512_srli_epi16(raw1, 4), m4)};
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const long e = j * in + b * 256, s = j * a->xs + b * 8;
            const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(s8, _mm256_loadu_ps(a->dx + s)));
            macc[j] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(a->sx + s), macc[j]);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                acc[j][r & 1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx[r], sc),
                                                _mm512_cvtepi32_ps(kdot(v[r], a->q1 + e + 64 * r,
                                                                        a->q2 + e + 64 * r, D)),
                                                acc[j][r & 1]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
        y[j * out] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1])) - hsum256(macc[j]);
}

INLINE void q6k_i8_row(const kact_t *restrict a, const uint8_t *restrict w, float *restrict y,
                       long out, const int N, const int D) {
    const long nb = a->nb, in = nb * 256;
    /* register r (elements 64 r ..): its lanes 4 i .. 4 i + 3 -> sub-block 4 r + i */
    const __m512i idx[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
        _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
        _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[GEMV_MAX_ROWS][2], macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = macc[j] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *ql = w + b * 210, *qh = ql + 128;
        const __m512 sc = _mm512_mul_ps(
            _mm512_set1_ps(half(ql + 208)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ql + 192)))));
        __m512i v[4];
        for (int h = 0; h < 2; h++) { /* elements 128 h ..: ql's 64 bytes, qh's 32 */
            const __m512i l = _mm512_loadu_si512(ql + 64 * h);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            /* bytes 0..31 qh (groups 0 and 2), 32..63 qh >> 2 (groups 1 and 3) */
            const __m512i hx = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
            v[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4),
                                       _mm512_and_si512(_mm512_slli_epi16(hx, 4), m30));
            v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                           _mm512_and_si512(hx, m30));
        }
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const long e = j * in + b * 256;
            const __m512 dx = _mm512_permutexvar_ps(
                pairs, _mm512_castps256_ps512(_mm256_loadu_ps(a->dx + j * a->xs + b * 8)));
            const __m512 s = _mm512_mul_ps(sc, dx); /* per sub-block of 16: d sc dx */
            macc[j] = _mm512_fmadd_ps(s, _mm512_loadu_ps(a->bsub + e / 16), macc[j]);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                acc[j][r & 1] = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(idx[r], s),
                    _mm512_cvtepi32_ps(kdot(v[r], a->q1 + e + 64 * r, a->q2 + e + 64 * r, D)),
                    acc[j][r & 1]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
        y[j * out] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1])) - _mm512_reduce_add_ps(macc[j]);
}

#elif GEMV_I8_ISA == 1
/* 8 int32 lanes: the dot of 32 unsigned codes v (bytes, at most 63) with the digit planes at
 * p1 and p2 (vpmaddubsw's pairs at most 2 x 63 x 128, then vpmaddwd by 256 and by 1): lane i
 * sums elements 4 i .. 4 i + 3. One digit: p1 holds zeros (quantize_x16's planes). */
INLINE __m256i kdot(const __m256i v, const int8_t *p1, const int8_t *p2, const int D) {
    (void)D;
    const __m256i a = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)p1));
    const __m256i b = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)p2));
    return _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(b, _mm256_set1_epi16(1)));
}

INLINE void q4k_i8_row(const kact_t *restrict a, const uint8_t *restrict w, float *restrict y,
                       long out, const int N, const int D) {
    const long nb = a->nb, in = nb * 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[GEMV_MAX_ROWS][2], macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = macc[j] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 144;
        __m256 s8, m8;
        q4k_scales(p, &s8, &m8);
        __m256i v[8]; /* sub-block 2c: the low nibbles of bytes 32 c .., 2c + 1 the high ones */
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c));
            v[2 * c] = _mm256_and_si256(raw, m4);
            v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const long e = j * in + b * 256, s = j * a->xs + b * 8;
            float sc[8] __attribute__((aligned(32)));
            _mm256_store_ps(sc, _mm256_mul_ps(s8, _mm256_loadu_ps(a->dx + s)));
            macc[j] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(a->sx + s), macc[j]);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                acc[j][k & 1] = _mm256_fmadd_ps(
                    _mm256_set1_ps(sc[k]),
                    _mm256_cvtepi32_ps(kdot(v[k], a->q1 + e + 32 * k, a->q2 + e + 32 * k, D)),
                    acc[j][k & 1]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) y[j * out] = hsum256(_mm256_add_ps(acc[j][0], acc[j][1])) - hsum256(macc[j]);
}

INLINE void q6k_i8_row(const kact_t *restrict a, const uint8_t *restrict w, float *restrict y,
                       long out, const int N, const int D) {
    const long nb = a->nb, in = nb * 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    __m256 acc[GEMV_MAX_ROWS][2], macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = macc[j] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *ql = w + b * 210, *qh = ql + 128;
        const __m128i sc16 = _mm_loadu_si128((const __m128i *)(ql + 192));
        const __m256 d = _mm256_set1_ps(half(ql + 208));
        const __m256 sc[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16))),
                              _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8))))};
        __m256i v[8]; /* groups of 32 elements: 4 per half of 128 */
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            v[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
            v[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
            v[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
            v[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
        }
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const long e = j * in + b * 256;
            const __m256 dx = _mm256_loadu_ps(a->dx + j * a->xs + b * 8);
            for (int h = 0; h < 2; h++) {
                /* d sc dx of sub-blocks 8 h .. 8 h + 7 (dx: one per pair) */
                const __m256 s = _mm256_mul_ps(sc[h], _mm256_permutevar8x32_ps(
                    dx, _mm256_add_epi32(pairs, _mm256_set1_epi32(4 * h))));
                macc[j] = _mm256_fmadd_ps(s, _mm256_loadu_ps(a->bsub + e / 16 + 8 * h), macc[j]);
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) { /* lanes 0..3: sub-block 2g, 4..7: 2g + 1 */
                    const long o = e + 128 * h + 32 * g;
                    const __m256i dot = kdot(v[4 * h + g], a->q1 + o, a->q2 + o, D);
                    const __m256i lane = _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1,
                                                           2 * g + 1, 2 * g + 1, 2 * g + 1);
                    acc[j][g & 1] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(s, lane),
                                                    _mm256_cvtepi32_ps(dot), acc[j][g & 1]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) y[j * out] = hsum256(_mm256_add_ps(acc[j][0], acc[j][1])) - hsum256(macc[j]);
}

#else
/* Portable C: the codes c as int16, the weights' integer codes per sub-block. */
INLINE void q4k_i8_row(const kact_t *restrict a, const uint8_t *restrict w, float *restrict y,
                       long out, const int N, const int D) {
    (void)D;
    const long nb = a->nb, in = nb * 256;
    float acc[GEMV_MAX_ROWS] = {0};
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * 144, *q = p + 16;
        const float d = half(p), dmin = half(p + 2);
        for (int i = 0; i < 8; i++) {
            int sc, m;
            q4k_scale_min(p + 4, i, &sc, &m);
            const uint8_t *qi = q + 32 * (i / 2);
            const int shift = 4 * (i & 1);
            for (int j = 0; j < N; j++) {
                const int16_t *c = a->c + j * in + b * 256 + 32 * i;
                int32_t s = 0;
                for (int l = 0; l < 32; l++) s += ((qi[l] >> shift) & 0xF) * c[l];
                const long k = j * a->xs + b * 8 + i;
                acc[j] += d * (float)sc * a->dx[k] * (float)s - dmin * (float)m * a->sx[k];
            }
        }
    }
    for (int j = 0; j < N; j++) y[j * out] = acc[j];
}

INLINE void q6k_i8_row(const kact_t *restrict a, const uint8_t *restrict w, float *restrict y,
                       long out, const int N, const int D) {
    (void)D;
    const long nb = a->nb, in = nb * 256;
    float acc[GEMV_MAX_ROWS] = {0};
    for (long b = 0; b < nb; b++) {
        const uint8_t *ql = w + b * 210, *qh = ql + 128;
        const int8_t *sc = (const int8_t *)(ql + 192);
        const float d = half(ql + 208);
        for (int i = 0; i < 16; i++) { /* sub-block i: elements 16 i .. 16 i + 15 */
            const int h = i / 8, g = (i % 8) / 2, l0 = 16 * (i & 1);
            const uint8_t *lq = ql + 64 * h + 32 * (g & 1), *hq = qh + 32 * h;
            for (int j = 0; j < N; j++) {
                const int16_t *c = a->c + j * in + b * 256 + 16 * i;
                int32_t s = 0;
                for (int l = 0; l < 16; l++) {
                    const int q = ((lq[l0 + l] >> (4 * (g >> 1))) & 0xF) | (((hq[l0 + l] >> (2 * g)) & 3) << 4);
                    s += (q - 32) * c[l];
                }
                acc[j] += d * (float)sc[i] * a->dx[j * a->xs + b * 8 + i / 2] * (float)s;
            }
        }
    }
    for (int j = 0; j < N; j++) y[j * out] = acc[j];
}
#endif

/* Rows [lo, hi) of a K-quant W against a's n rows, in groups of up to 4 x rows. */
#define KI8_RANGE(NAME, ROW, BYTES)                                                              \
    static void NAME(const kact_t *a, int n, const uint8_t *w, float *y, long out, long lo,      \
                     long hi, int digits) {                                                      \
        const long row = a->nb * BYTES, in = a->nb * 256;                                        \
        for (long r = lo; r < hi; r++) {                                                         \
            prefetch_rows(w, r, row, hi, K_PF_BYTES);                                            \
            for (int g = 0; g < n; g += 4) {                                                     \
                kact_t s = *a; /* x rows g .. g + 3 */                                           \
                s.q1 += g * in, s.q2 += g * in, s.bsub += g * in / 16;                           \
                if (s.c != NULL) s.c += g * in; /* (portable C only) */                          \
                s.dx += g * a->xs, s.sx += g * a->xs;                                            \
                const uint8_t *wr = w + r * row;                                                 \
                float *yr = y + g * out + r;                                                     \
                switch ((n - g < 4 ? n - g : 4) + 4 * (digits == 2)) {                           \
                case 1: ROW(&s, wr, yr, out, 1, 1); break;                                       \
                case 2: ROW(&s, wr, yr, out, 2, 1); break;                                       \
                case 3: ROW(&s, wr, yr, out, 3, 1); break;                                       \
                case 4: ROW(&s, wr, yr, out, 4, 1); break;                                       \
                case 5: ROW(&s, wr, yr, out, 1, 2); break;                                       \
                case 6: ROW(&s, wr, yr, out, 2, 2); break;                                       \
                case 7: ROW(&s, wr, yr, out, 3, 2); break;                                       \
                default: ROW(&s, wr, yr, out, 4, 2); break;                                      \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
KI8_RANGE(q4k_i8_range, q4k_i8_row, 144)
KI8_RANGE(q6k_i8_range, q6k_i8_row, 210)

#if GEMV_I8_ISA >= 1
/* ---- Q4_K interleaved by 16 rows (the VNNI and AVX2 paths) ---------------------------------
 *
 * Why: in GGUF order each row's super-block pays its own scale unpack (about 30 scalar
 * instructions) and, per 64 codes, a convert, a scale permute and an FMA: on the AMD EPYC
 * (Zen 4) the GGUF-order kernel above multiplies about 12-15 GB/s a core in cache, and two
 * cores read 75% of the stream. Interleaved as the 32-element formats are (ROWS16), one
 * register holds 4 codes of 16 rows (AVX2: 8): one vpdpbusd per digit (AVX2: vpmaddubsw per
 * digit plane, summed in int16 over the sub-block and widened once) against 4 broadcast
 * activation codes makes those rows' partial dots, and the scales of 16 rows unpack together in
 * byte lanes; per sub-block one convert and one FMA serve 16 (8) rows.
 *
 * Q4_K | ROWS16: for rows 16 g .. 16 g + 15 and super-block b, at byte (g nb + b) 2304:
 *   codes  [32 quads][16 rows][4 bytes]: quad c of a row is bytes 4c .. 4c + 3 of its 128
 *          code bytes (low nibbles: elements 64 (c / 8) + 4 (c % 8) .., sub-block 2 (c / 8);
 *          high nibbles 32 further, sub-block 2 (c / 8) + 1);
 *   d [16], dmin [16] fp16;  scales [12][16]: byte j of the 16 rows' 12 scale bytes.
 * The activations are in element order. */
#define K16_BYTES (16 * 144)

/* Sub-block i's 6-bit scales (*s) and mins (*m) of 16 interleaved rows (S: their scale bytes,
 * [12][16]) as 16 bytes each: ggml's get_scale_min_k4 on 16 rows at once. */
INLINE void k16_scale_bytes(const uint8_t *S, const int i, __m128i *s, __m128i *m) {
    const __m128i k3f = _mm_set1_epi8(0x3F), k0f = _mm_set1_epi8(0x0F), k30 = _mm_set1_epi8(0x30);
    if (i < 4) {
        *s = _mm_and_si128(_mm_loadu_si128((const __m128i *)(S + 16 * i)), k3f);
        *m = _mm_and_si128(_mm_loadu_si128((const __m128i *)(S + 16 * (i + 4))), k3f);
    } else { /* the low 4 bits from byte i + 4, the high 2 from the top of bytes i - 4 and i */
        const __m128i lo = _mm_loadu_si128((const __m128i *)(S + 16 * (i + 4)));
        const __m128i sh = _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(S + 16 * (i - 4))), 2);
        const __m128i mh = _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(S + 16 * i)), 2);
        *s = _mm_or_si128(_mm_and_si128(lo, k0f), _mm_and_si128(sh, k30));
        *m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), k0f), _mm_and_si128(mh, k30));
    }
}

#if GEMV_I8_ISA == 2
/* 16 interleaved Q4_K rows (wg: their group) against N x rows: y[j * out + r] for r < 16. Per
 * 64 elements (sub-blocks 2k and 2k + 1): 8 registers of codes, each a low and a high vector,
 * one vpdpbusd per digit and x row (CH chains each); then per sub-block one convert and one
 * FMA for 16 rows, and one FMA for their mins. The high nibbles are multiplied unshifted (16 q,
 * at most 240: vpdpbusd's unsigned operand), the sub-block's dot shifted right by 4 after
 * (exact). */
INLINE void q4k_r16_group(const kact_t *restrict a, const uint8_t *restrict wg, float *restrict y,
                          long out, const int N, const int D) {
    const long nb = a->nb, in = nb * 256;
    const int CH = N == 1 ? 2 : 1; /* independent chains per sub-block and digit */
    /* long rows (r16_group's ACT_PF_MIN_BLOCKS: 8 super-blocks) ask for x's codes a super-block
     * ahead: a 1B's down projection [2048, 8192] read 19.9 GB/s on one thread without, 25.2
     * with (2 ahead: 20.6; AMD EPYC, Zen 4; [8192, 2048] 23-25 either way) */
    const int pf = a->pf, apf = nb * 8 > ACT_PF_MIN_BLOCKS;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[GEMV_MAX_ROWS], macc[GEMV_MAX_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j] = macc[j] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * K16_BYTES, *S = o + 2112;
        if (pf) prefetch_group(o, K16_BYTES);
        if (apf && b + 1 < nb) /* a long row (as r16_group's): the next super-block's codes */
#pragma GCC unroll 4
            for (int j = 0; j < N; j++)
                for (int l = 0; l < 256; l += 64) {
                    const long e = j * in + (b + 1) * 256 + l;
                    _mm_prefetch((const char *)(a->q1 + e), _MM_HINT_T0);
                    if (D == 2) _mm_prefetch((const char *)(a->q2 + e), _MM_HINT_T0);
                }
        __m512 d = _mm512_setzero_ps(), dmin = d;
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m512i s[GEMV_MAX_ROWS][2][2][2]; /* [x row][low / high][digit][chain] */
#pragma GCC unroll 4
            for (int j = 0; j < N; j++)
                for (int h = 0; h < 2; h++)
                    for (int t = 0; t < D; t++)
                        for (int c = 0; c < CH; c++) s[j][h][t][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m512i raw = _mm512_loadu_si512(o + 64 * (8 * k + c));
                const __m512i v[2] = {_mm512_and_si512(raw, m4), _mm512_andnot_si512(m4, raw)};
#pragma GCC unroll 4
                for (int j = 0; j < N; j++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        const long e = j * in + b * 256 + 64 * k + 32 * h + 4 * c;
                        s[j][h][0][c % CH] = dpbusd_bcast4(s[j][h][0][c % CH], v[h], a->q1 + e);
                        if (D == 2) s[j][h][1][c % CH] = dpbusd_bcast4(s[j][h][1][c % CH], v[h], a->q2 + e);
                    }
            }
            if (k == 0) { /* the headers' line after the first codes' (as r16_group) */
                __asm__ volatile("" ::: "memory");
                d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 2048)));
                dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 2080)));
            }
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int i = 2 * k + h;
                __m128i sb, mb;
                k16_scale_bytes(S, i, &sb, &mb);
                const __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sb)));
                const __m512 mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb)));
#pragma GCC unroll 4
                for (int j = 0; j < N; j++) {
                    __m512i dot = CH == 2 ? _mm512_add_epi32(s[j][h][0][0], s[j][h][0][1]) : s[j][h][0][0];
                    if (D == 2)
                        dot = _mm512_add_epi32(
                            _mm512_slli_epi32(dot, 8),
                            CH == 2 ? _mm512_add_epi32(s[j][h][1][0], s[j][h][1][1]) : s[j][h][1][0]);
                    if (h) dot = _mm512_srai_epi32(dot, 4); /* the high nibbles were 16 q */
                    const long x = j * a->xs + b * 8 + i;
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sc, _mm512_set1_ps(a->dx[x])),
                                             acc[j]);
                    macc[j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sx[x]), macc[j]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) _mm512_storeu_ps(y + j * out, _mm512_sub_ps(acc[j], macc[j]));
}
#else
/* The same on AVX2, 8 rows at a time (hh: rows 8 hh .. 8 hh + 7, a 256-bit half of each quad
 * register): per sub-block and x row, vpmaddubsw of the 8 code vectors against each digit
 * plane's 4 broadcast codes (pairs at most 2 x 15 x 128), summed in int16 (at most 30,720)
 * and widened once by vpmaddwd (by 256 for q1, 1 for q2); one digit: q1 holds zeros. Both
 * halves take each broadcast as it is made, and the mins go into the same accumulator: with
 * the halves in turn GCC kept the broadcasts (and the accumulators) on the stack, 16 registers
 * being all AVX2 has. */
INLINE void q4k_r16_group(const kact_t *restrict a, const uint8_t *restrict wg, float *restrict y,
                          long out, const int N, const int D) {
    (void)D;
    const long nb = a->nb, in = nb * 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[GEMV_MAX_ROWS][2];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * K16_BYTES, *S = o + 2112;
        prefetch_group(o, K16_BYTES);
        for (int i = 0; i < 8; i++) { /* sub-block i: elements 32 i .., quads 8 (i / 2) .. */
            const int k = i / 2, h = i % 2;
            __m256i s1[GEMV_MAX_ROWS][2], s2[GEMV_MAX_ROWS][2];
#pragma GCC unroll 4
            for (int j = 0; j < N; j++) s1[j][0] = s1[j][1] = s2[j][0] = s2[j][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const uint8_t *r = o + 64 * (8 * k + c);
                __m256i v[2];
#pragma GCC unroll 2
                for (int hh = 0; hh < 2; hh++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(r + 32 * hh));
                    v[hh] = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m4);
                }
#pragma GCC unroll 4
                for (int j = 0; j < N; j++) {
                    const long e = j * in + b * 256 + 32 * i + 4 * c;
                    const __m256i b1 = bcast4_256(a->q1 + e), b2 = bcast4_256(a->q2 + e);
#pragma GCC unroll 2
                    for (int hh = 0; hh < 2; hh++) {
                        s1[j][hh] = _mm256_add_epi16(s1[j][hh], _mm256_maddubs_epi16(v[hh], b1));
                        s2[j][hh] = _mm256_add_epi16(s2[j][hh], _mm256_maddubs_epi16(v[hh], b2));
                    }
                }
            }
            __m128i sb, mb;
            k16_scale_bytes(S, i, &sb, &mb);
#pragma GCC unroll 2
            for (int hh = 0; hh < 2; hh++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2048 + 16 * hh)));
                const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2080 + 16 * hh)));
                const __m128i sh = hh ? _mm_srli_si128(sb, 8) : sb, mh = hh ? _mm_srli_si128(mb, 8) : mb;
                const __m256 sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sh)));
                const __m256 mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mh)));
#pragma GCC unroll 4
                for (int j = 0; j < N; j++) {
                    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(s1[j][hh], _mm256_set1_epi16(256)),
                                                         _mm256_madd_epi16(s2[j][hh], _mm256_set1_epi16(1)));
                    const long x = j * a->xs + b * 8 + i;
                    acc[j][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_set1_ps(a->dx[x])),
                                                 acc[j][hh]);
                    acc[j][hh] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(a->sx[x]), acc[j][hh]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
        for (int hh = 0; hh < 2; hh++) _mm256_storeu_ps(y + j * out + 8 * hh, acc[j][hh]);
}
#endif

/* Groups [g0, g1) of an interleaved Q4_K W against all n x rows, the x rows 4 at a time. */
static void q4k_r16_range(const kact_t *a, int n, const uint8_t *w, float *y, long out, long g0,
                          long g1, int digits) {
    const long in = a->nb * 256;
    const int pf = weight_pf(n);
    for (long g = g0; g < g1; g++)
        for (int j = 0; j < n; j += 4) {
            kact_t s = *a; /* x rows j .. j + 3 */
            s.q1 += j * in, s.q2 += j * in, s.dx += j * a->xs, s.sx += j * a->xs;
            s.pf = pf;
            const uint8_t *wg = w + g * a->nb * K16_BYTES;
            float *yg = y + j * out + 16 * g;
            switch ((n - j < 4 ? n - j : 4) + 4 * (digits == 2)) {
            case 1: q4k_r16_group(&s, wg, yg, out, 1, 1); break;
            case 2: q4k_r16_group(&s, wg, yg, out, 2, 1); break;
            case 3: q4k_r16_group(&s, wg, yg, out, 3, 1); break;
            case 4: q4k_r16_group(&s, wg, yg, out, 4, 1); break;
            case 5: q4k_r16_group(&s, wg, yg, out, 1, 2); break;
            case 6: q4k_r16_group(&s, wg, yg, out, 2, 2); break;
            case 7: q4k_r16_group(&s, wg, yg, out, 3, 2); break;
            default: q4k_r16_group(&s, wg, yg, out, 4, 2); break;
            }
        }
}
#endif

/* x [n, nb * 256] in the K-quant kernels' form (k): rounded as gemv_qi8 rounds it (act_make,
 * into *buf), then Q6_K's bsub and the VNNI path's sx (into *extra); both for free. 0, or -1 (no
 * memory; then neither needs freeing). */
static int kact_make(int fmt, const float *x, int n, long nb, int digits, kact_t *k, void **buf,
                     void **extra) {
    const long in = nb * 256, nb32 = nb * 8;
    act_t a;
    *extra = NULL;
    /* Q8_0's layout on the VNNI path is element order; Q4_1 asks the AVX2 path for the planes */
    if (act_make(GEMV_I8_ISA == 2 ? Q8_0 : Q4_1, x, n, nb32, digits, &a, buf)) return -1;
    /* Q6_K's bsub, then sx (the VNNI path's: dx's stride, nb32 rounded up to 16) */
    float *bsub = malloc(sizeof(float) * ((size_t)n * in / 16 + n * (nb32 + 15) / 16 * 16));
    if (bsub == NULL) {
        free(*buf);
        return -1;
    }
    *extra = bsub;
    *k = (kact_t){.nb = nb, .bsub = bsub};
#if GEMV_I8_ISA == 2
    float *sx = bsub + (size_t)n * in / 16;
    k->q1 = a.q, k->q2 = a.q2, k->dx = a.dx, k->sx = sx, k->xs = a.nb16;
    for (long i = 0; i < (long)n * a.nb16; i++) sx[i] = a.t[i] * (-1.0f / 128.0f); /* exact */
    for (long i = 0; fmt == Q6_K && i < (long)n * in / 16; i++) { /* 16 whole codes, summed */
        int s = 0;
        for (int u = 0; u < 16; u++) s += digits == 2 ? 256 * a.q[16 * i + u] + a.q2[16 * i + u] : a.q[16 * i + u];
        bsub[i] = (float)(32 * s); /* |32 s| < 2^24: exact */
    }
    if (fmt == Q4_K) /* each 128 elements as elements 0..31, 64..95, 32..63, 96..127 */
        for (int d = 0; d < digits; d++) {
            int8_t *q = d == 0 ? a.q : a.q2, t[32];
            for (long o = 0; o < (long)n * in; o += 128) {
                memcpy(t, q + o + 32, 32);
                memcpy(q + o + 32, q + o + 64, 32);
                memcpy(q + o + 64, t, 32);
            }
        }
#else
    k->q1 = a.q1, k->q2 = a.q2, k->c = a.c, k->dx = a.dx, k->sx = a.sx, k->xs = nb32;
    for (long i = 0; fmt == Q6_K && i < (long)n * in / 16; i++) { /* 16 whole codes, summed */
        int s = 0;
        for (int u = 0; u < 16; u++) s += a.c[16 * i + u];
        bsub[i] = (float)(32 * s); /* |32 s| < 2^24: exact */
    }
#endif
    return 0;
}

/* Rows [lo, hi) of a K-quant W (fmt) against k's n rows. */
static void kact_rows(int fmt, const kact_t *k, int n, const uint8_t *w, float *y, long out,
                      long lo, long hi, int digits) {
#if GEMV_I8_ISA >= 1
    if (fmt == (Q4_K | ROWS16)) {
        q4k_r16_range(k, n, w, y, out, lo / 16, hi / 16, digits);
        return;
    }
#endif
    if (fmt == Q4_K)
        q4k_i8_range(k, n, w, y, out, lo, hi, digits);
    else
        q6k_i8_range(k, n, w, y, out, lo, hi, digits);
}

/* One chunk of at most GEMV_I8_MAX_ROWS x rows: its activations made once, then the rows split
 * among the threads. */
static int ki8_chunk(int fmt, const float *x, int n, const uint8_t *w, long out, long nb, float *y,
                     int threads, int digits) {
    kact_t k;
    void *buf, *extra;
    if (kact_make(fmt, x, n, nb, digits, &k, &buf, &extra)) return -1;
    SPLIT(kact_rows(fmt, &k, n, w, y, out, lo, hi, digits));
    free(extra);
    free(buf);
    return 0;
}

/* y [n, out] = x [n, nb * 256] @ W^T, W Q4_K or Q6_K super-blocks [out, nb, bytes] (or, on the
 * VNNI and AVX2 paths, Q4_K | ROWS16: interleaved by 16 rows, whole groups), x rounded to
 * `digits` (1 or 2) int8 codes per 32-element block as gemv_qi8 rounds it; any n >= 1, in
 * chunks of GEMV_I8_MAX_ROWS. Returns 0, or -1 for bad arguments or no memory. */
int gemv_ki8(int fmt, const float *x, int n, const uint8_t *w, long out, long nb, float *y,
             int threads, int digits) {
    const int r16 = fmt == (Q4_K | ROWS16) && GEMV_I8_ISA >= 1 && out % 16 == 0;
    if (n < 1 || (fmt != Q4_K && fmt != Q6_K && !r16) || nb * 8 > GEMV_MAX_BLOCKS ||
        (digits != 1 && digits != 2))
        return -1;
    for (int c0 = 0; c0 < n; c0 += GEMV_I8_MAX_ROWS) {
        const int m = n - c0 < GEMV_I8_MAX_ROWS ? n - c0 : GEMV_I8_MAX_ROWS;
        if (ki8_chunk(fmt, x + (long)c0 * nb * 256, m, w, out, nb, y + (long)c0 * out, threads, digits))
            return -1;
    }
    return 0;
}

/* ---- prefill: the weights decoded for a float32 GEMM ------------------------------------------
 *
 * At many rows (a prompt's prefill) the products are bound by arithmetic, not by the weight
 * bytes: a BLAS GEMM over float32 weights does 2.3-2.6x the work per second of gemv_qi8 at 512
 * rows on SmolLM2's layers (Intel Xeon, AVX-512 VNNI). engine/linear.py decodes a panel of
 * rows here (L2-sized, so the GEMM reads it from the cache) and multiplies it by PyTorch's
 * float32 GEMM: the exact weights against float32 activations, the reference entry's numbers.
 *
 * y [rows, nb * 32] (Q8_0 / Q4_0 / Q4_1) or [rows, nb * 256] (Q4_K / Q6_K) = the weights of
 * `rows` rows of blocks w [rows, nb, block bytes]. Returns 0, or -1 for another format. */
static void dequant_row(const int fmt, const uint8_t *restrict p, const long nb, float *restrict y) {
    if (fmt == Q4_K || fmt == Q6_K) {
        for (long b = 0; b < nb; b++, p += k_block_bytes(fmt), y += 256)
            fmt == Q4_K ? decode_q4_k(p, y) : decode_q6_k(p, y);
        return;
    }
    const long bs = block_bytes(fmt);
    for (long b = 0; b < nb; b++, p += bs, y += 32) {
        const float d = half(p);
        if (fmt == Q8_0) {
            const int8_t *q = (const int8_t *)(p + 2);
            for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
        } else if (fmt == Q4_0) {
            const uint8_t *q = p + 2;
            for (int j = 0; j < 16; j++) {
                y[j] = d * (float)((q[j] & 0xF) - 8);
                y[j + 16] = d * (float)((q[j] >> 4) - 8);
            }
        } else {
            const float m = half(p + 2);
            const uint8_t *q = p + 4;
            for (int j = 0; j < 16; j++) {
                y[j] = d * (float)(q[j] & 0xF) + m;
                y[j + 16] = d * (float)(q[j] >> 4) + m;
            }
        }
    }
}

/* Row r (0..15) of 16 interleaved rows (one group, ROWS16) -> y [nb * 32] (Q4_K: [nb * 256],
 * each super-block put back in GGUF order and decoded as dequant_row decodes it). */
static void dequant_r16_row(const int fmt, const uint8_t *restrict g, const long nb, const int r,
                            float *restrict y) {
    if (fmt == Q4_K) {
        for (long b = 0; b < nb; b++) {
            const uint8_t *o = g + b * 16 * 144;
            uint8_t blk[144];
            memcpy(blk, o + 2048 + 2 * r, 2);     /* d */
            memcpy(blk + 2, o + 2080 + 2 * r, 2); /* dmin */
            for (int j = 0; j < 12; j++) blk[4 + j] = o[2112 + 16 * j + r];
            for (int c = 0; c < 32; c++) memcpy(blk + 16 + 4 * c, o + 64 * c + 4 * r, 4);
            decode_q4_k(blk, y + b * 256);
        }
        return;
    }
    const long bs = block_bytes(fmt), codes = fmt == Q8_0 ? 512 : 256;
    for (long b = 0; b < nb; b++) {
        const uint8_t *o = g + b * 16 * bs;
        const float d = half(o + codes + 2 * r);
        const float m = fmt == Q4_1 ? half(o + codes + 32 + 2 * r) : 0.0f;
        float *yr = y + b * 32;
        for (int c = 0; c < codes / 64; c++)
            for (int i = 0; i < 4; i++) {
                const uint8_t q = o[c * 64 + r * 4 + i];
                if (fmt == Q8_0) {
                    yr[4 * c + i] = d * (float)(int8_t)(q ^ 0x80);
                } else if (fmt == Q4_0) { /* as dequant_row: d (q - 8) */
                    yr[4 * c + i] = d * (float)((q & 0xF) - 8);
                    yr[16 + 4 * c + i] = d * (float)((q >> 4) - 8);
                } else {
                    yr[4 * c + i] = d * (float)(q & 0xF) + m;
                    yr[16 + 4 * c + i] = d * (float)(q >> 4) + m;
                }
            }
    }
}

/* 16 interleaved rows (one group, ROWS16) -> y [16, nb * 32 (Q4_K: 256)]. */
static void dequant_group16(const int fmt, const uint8_t *restrict g, const long nb,
                            float *restrict y) {
    const long in = nb * (fmt == Q4_K ? 256 : 32);
    for (int r = 0; r < 16; r++) dequant_r16_row(fmt, g, nb, r, y + r * in);
}

int dequant_rows(int fmt, const uint8_t *w, long rows, long nb, float *y, int threads) {
    if (fmt & ROWS16) { /* interleaved (whole groups of 16 rows) */
        const int f = fmt & ~ROWS16;
        if ((f > Q4_1 && f != Q4_K) || rows < 0 || rows % 16 || nb < 1) return -1;
        const long gbytes = 16 * nb * (f == Q4_K ? 144 : block_bytes(f)), in = nb * (f == Q4_K ? 256 : 32);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * in >= 65536)
        for (long g = 0; g < rows / 16; g++) dequant_group16(f, w + g * gbytes, nb, y + g * 16 * in);
        return 0;
    }
    if (fmt < Q8_0 || fmt > Q6_K || rows < 0 || nb < 1) return -1;
    const int k = fmt == Q4_K || fmt == Q6_K;
    const long row = nb * (k ? k_block_bytes(fmt) : block_bytes(fmt)), in = nb * (k ? 256 : 32);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * in >= 65536)
    for (long r = 0; r < rows; r++) dequant_row(fmt, w + r * row, nb, y + r * in);
    return 0;
}

/* A float32 embedding table's rows, for dequant_index alone (nb: the row's runs of 32 floats):
 * a float32 model's decode steps read their tokens' rows in C too (decode_step, decode_steps). */
enum { F32_ROWS = 5 };

/* Rows index[0 .. n) of a weight of `rows` rows, decoded as dequant_rows decodes them: y [n,
 * nb * 32 (K-quants: nb * 256)]. A tied embedding's lookup: one call for a step's tokens, which
 * reads only their rows (interleaved: 1/16 of each of their groups). 0, or -1 (a bad format, or
 * an index outside [0, rows)). */
int dequant_index(int fmt, const uint8_t *w, long rows, long nb, const int64_t *index, int n,
                  float *y) {
    const int f = fmt & ~ROWS16, k = f == Q4_K || f == Q6_K;
    if (fmt != F32_ROWS && (f < Q8_0 || f > Q6_K || ((fmt & ROWS16) && ((k && f != Q4_K) || rows % 16))))
        return -1;
    if (nb < 1 || n < 0) return -1;
    for (int i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= rows) return -1;
    if (fmt == F32_ROWS) { /* copied as they are */
        for (int i = 0; i < n; i++)
            memcpy(y + i * nb * 32, (const float *)w + index[i] * nb * 32, sizeof(float) * nb * 32);
        return 0;
    }
    const long row = nb * (k ? k_block_bytes(f) : block_bytes(f)), in = nb * (k ? 256 : 32);
    for (int i = 0; i < n; i++) {
        if (fmt & ROWS16)
            dequant_r16_row(f, w + index[i] / 16 * 16 * row, nb, (int)(index[i] % 16), y + i * in);
        else
            dequant_row(f, w + index[i] * row, nb, y + i * in);
    }
    return 0;
}

/* ---- one decoder layer's dense part: two calls around the KV seam --------------------------
 *
 * engine/fused.py calls these instead of about a dozen torch ops per layer and step (the two
 * norms, four matmuls through their breakers, RoPE, the splits and copies, SiLU, the product,
 * the residual adds): at a few rows a decode step is mostly the fixed cost of each op, not its
 * arithmetic. A layer is described once (`layer_t`, its four linear layers as `lin_t`), and each
 * linear layer is multiplied by the entry point its registry entry calls (gemv_f32, gemv_q, or
 * gemv_qi8 with two digits), so the products are the same numbers; the norms, RoPE and SiLU are
 * plain float32 loops over a few KB, as the torch ops compute them (only the order of the norm's
 * sum of squares differs).
 */
typedef struct {
    int kind; /* 0: float32 [out, in] (gemv_f32); 1: packed blocks, float32 activations
                 (gemv_q); 2: packed blocks, int8x2 activations (gemv_qi8); 3: K-quant
                 super-blocks (gemv_k) */
    int fmt; /* Q8_0 / Q4_0 / Q4_1 (kinds 1 and 2; kind 2 also | ROWS16), Q4_K / Q6_K (kinds 2
              * and 3; kind 2 also Q4_K | ROWS16) */
    const void *w; /* the weight, or its blocks */
    const uint16_t *h; /* kind 2: the block headers of gemv.headers() */
    long out, in; /* in: elements of a row (a multiple of 32 when packed) */
    const void *next; /* NULL, or the lin_t of the rows stacked below these (a part in another
                       * format: a GGUF whose fused layer's tensors differ, as Q4_K_M's attn_v
                       * in Q6_K beside attn_q and attn_k in Q4_K), the same `in` */
} lin_t;

/* The part after l (lin_t.next), or NULL. */
INLINE const lin_t *lin_next(const lin_t *l) { return (const lin_t *)l->next; }

/* The rows of l and every part stacked below it. */
static long lin_out(const lin_t *l) {
    long out = 0;
    for (; l != NULL; l = lin_next(l)) out += l->out;
    return out;
}

typedef struct {
    long hidden, ffn, context; /* context: the rows of the RoPE tables */
    int hq, hkv, d;
    float eps;
    const float *attn_norm, *ffn_norm; /* [hidden] */
    const float *cos, *sin_signed; /* [context, d]: engine.model.RotaryTable's tables */
    lin_t qkv, wo, gu, down; /* [(hq + 2 hkv) d, hidden], [hidden, hq d], [2 ffn, hidden],
                                [hidden, ffn] */
} layer_t;

int layer_struct_size(void) { return (int)sizeof(layer_t); }

/* Whether l is a K-quant weight multiplied by gemv_ki8 (kind 2: Q4_K or Q6_K, Q4_K also
 * interleaved; what lin_fits let through). */
INLINE int lin_ki8(const lin_t *l) {
    return l->kind == 2 && ((l->fmt & ~ROWS16) == Q4_K || l->fmt == Q6_K);
}

/* Whether a layer call multiplies l by n rows (the refusals of lin_apply and decode_layers,
 * before any work). */
static int lin_fits_one(const lin_t *l, int n);
static int lin_fits(const lin_t *l, int n) {
    for (const lin_t *p = l; p != NULL; p = lin_next(p))
        if (p->in != l->in || !lin_fits_one(p, n)) return 0;
    return 1;
}

static int lin_fits_one(const lin_t *l, int n) {
    if (l->kind == 0) return n <= GEMV_MAX_ROWS;
    if (l->fmt == (Q4_K | ROWS16)) /* gemv_ki8, interleaved (the VNNI and AVX2 paths) */
        return l->kind == 2 && l->in % 256 == 0 && l->in / 32 <= GEMV_MAX_BLOCKS && l->out % 16 == 0 &&
               GEMV_I8_ISA >= 1;
    if (l->fmt == Q4_K || l->fmt == Q6_K) /* gemv_k (kind 3) or gemv_ki8 (kind 2) */
        return l->in % 256 == 0 && (l->kind == 3 || (l->kind == 2 && l->in / 32 <= GEMV_MAX_BLOCKS));
    if (l->kind == 3) return 0;
    if (l->in % 32 || l->in / 32 > GEMV_MAX_BLOCKS || (l->fmt & ~ROWS16) > Q4_1) return 0;
    if (l->kind == 1) return n <= GEMV_MAX_ROWS && !(l->fmt & ROWS16);
    if (l->kind != 2) return 0;
    if (l->fmt & ROWS16) /* as gemv_qi8 */
        return l->out % 16 == 0 && GEMV_I8_ISA != 0 && !(GEMV_I8_ISA == 1 && l->fmt == (Q8_0 | ROWS16));
    return 1;
}

static int lin_apply_one(const lin_t *l, const float *x, int n, float *y, int threads);

/* y [n, lin_out(l)] = x [n, l->in] l^T, every part (lin_t.next) into its columns. 0, or -1
 * (refused: sizes, rows; no memory). */
static int lin_apply(const lin_t *l, const float *x, int n, float *y, int threads) {
    if (!lin_fits(l, n)) return -1;
    if (l->next == NULL) return lin_apply_one(l, x, n, y, threads);
    const long out = lin_out(l);
    int rc = 0;
    for (long at = 0; l != NULL && rc == 0; at += l->out, l = lin_next(l)) {
        float *t = malloc(sizeof(float) * n * l->out);
        rc = t == NULL ? -1 : lin_apply_one(l, x, n, t, threads);
        for (int i = 0; i < n && rc == 0; i++)
            memcpy(y + i * out + at, t + i * l->out, sizeof(float) * l->out);
        free(t);
    }
    return rc;
}

static int lin_apply_one(const lin_t *l, const float *x, int n, float *y, int threads) {
    if (l->kind == 0) {
        gemv_f32(x, n, (const float *)l->w, l->out, l->in, y, threads);
        return 0;
    }
    if (l->kind == 3) return gemv_k(l->fmt, x, n, l->w, l->out, l->in / 256, y, threads);
    if (lin_ki8(l))
        return gemv_ki8(l->fmt, x, n, l->w, l->out, l->in / 256, y, threads, 2);
    if (l->kind == 1) {
        gemv_q(l->fmt, x, n, (const uint8_t *)l->w, l->out, l->in / 32, y, threads);
        return 0;
    }
    return gemv_qi8(l->fmt, x, n, (const uint8_t *)l->w, l->h, l->out, l->in / 32, y, threads, 2);
}

/* y = x / sqrt(mean(x^2) + eps) * w over n rows of `dim` (the squares summed in 16 lanes). */
static void rms_rows(const float *x, int n, long dim, const float *w, float eps, float *y) {
    for (int i = 0; i < n; i++) {
        const float *xr = x + i * dim;
        float s[16] = {0};
        long j = 0;
        for (; j + 16 <= dim; j += 16)
            for (int u = 0; u < 16; u++) s[u] += xr[j + u] * xr[j + u];
        for (; j < dim; j++) s[0] += xr[j] * xr[j];
        for (int u = 8; u >= 1; u /= 2)
            for (int v = 0; v < u; v++) s[v] += s[v + u];
        const float r = 1.0f / sqrtf(s[0] / (float)dim + eps);
        for (j = 0; j < dim; j++) y[i * dim + j] = w[j] * (xr[j] * r);
    }
}

/* Whether layer_qkv takes n rows at positions pos (the sizes, and every position in the RoPE
 * tables). */
static int qkv_fits(const layer_t *L, int n, const int64_t *pos) {
    if (L->qkv.in != L->hidden || lin_out(&L->qkv) != (long)(L->hq + 2 * L->hkv) * L->d ||
        L->d % 2)
        return 0;
    for (int i = 0; i < n; i++)
        if (pos[i] < 0 || pos[i] >= L->context) return 0;
    return 1;
}

/* t [n, (hq + 2 hkv) d] (the QKV product) -> q [n, hq, d] and k [n, hkv, d], rotated by each
 * row's position (rotate-half: x cos + roll(x, d/2) sin_signed), and v [n, hkv, d]. */
static void rope_rows(const layer_t *L, const float *t, int n, const int64_t *pos, float *q,
                      float *k, float *v) {
    const int d = L->d, hq = L->hq, hkv = L->hkv, half_d = L->d / 2;
    const long width = (long)(hq + 2 * hkv) * d;
    for (int i = 0; i < n; i++) {
        const float *c = L->cos + pos[i] * d, *s = L->sin_signed + pos[i] * d;
        for (int head = 0; head < hq + hkv; head++) {
            const float *src = t + i * width + (long)head * d;
            float *dst = head < hq ? q + ((long)i * hq + head) * d
                                   : k + ((long)i * hkv + head - hq) * d;
            for (int j = 0; j < half_d; j++) {
                dst[j] = src[j] * c[j] + src[j + half_d] * s[j];
                dst[j + half_d] = src[j + half_d] * c[j + half_d] + src[j] * s[j + half_d];
            }
        }
        memcpy(v + (long)i * hkv * d, t + i * width + (long)(hq + hkv) * d,
               sizeof(float) * hkv * d);
    }
}

/* x [n, hidden] -> q [n, hq, d] and k [n, hkv, d], rotated by each row's position (rope_rows),
 * and v [n, hkv, d]. Returns 0, or -1 (a size the layer does
 * not have, too many rows for a kernel, no memory): the caller then takes the ops path. */
int layer_qkv(const layer_t *L, const float *x, int n, const int64_t *pos, float *q, float *k,
              float *v, int threads) {
    const long hidden = L->hidden, width = lin_out(&L->qkv);
    if (n < 1 || !qkv_fits(L, n, pos)) return -1;
    float *h = malloc(sizeof(float) * n * (hidden + width));
    if (h == NULL) return -1;
    float *t = h + n * hidden;
    rms_rows(x, n, hidden, L->attn_norm, L->eps, h);
    if (lin_apply(&L->qkv, h, n, t, threads)) {
        free(h);
        return -1;
    }
    rope_rows(L, t, n, pos, q, k, v);
    free(h);
    return 0;
}

/* Whether layer_out's sizes agree. */
static int out_fits(const layer_t *L) {
    const long hidden = L->hidden, ffn = L->ffn;
    return lin_out(&L->wo) == hidden && L->wo.in == (long)L->hq * L->d && L->gu.in == hidden &&
           lin_out(&L->gu) == 2 * ffn && L->down.in == ffn && lin_out(&L->down) == hidden;
}

/* ---- SiLU's exp, vectorized to libm's bits ------------------------------------------------
 *
 * Why: 1,536 libm `expf` calls a layer were 0.12 ms of a 2.9 ms SmolLM2 Q4_1 decode step (4%),
 * and a vectorized polynomial with its own rounding moved the decode PPL by 0.012% on AVX2 (its
 * last bits moved int8 codes of the down projection's input; tests/test_fused.py's limit is
 * 0.01%). So this is glibc's own expf algorithm (e_expf.c, the FMA build: x N / ln 2 = k + r in
 * double, 2^(k/N) from a 32-entry table, a cubic in r), lane by lane in double: with the
 * container's glibc it returns libm's float for every one of the 2^32 floats (`exp_mismatches(0,
 * 1, 2^32)`: 0 on the AVX-512 and the AVX2 build), the inputs |x| >= 88, inf and NaN taking
 * libm's expf itself. A step 0.965-0.978x as long on AVX-512 (benchmarks/kernel_ab.py, the
 * check forced off as A), 0.99-1.005x on AVX2 (4 lanes, a gather each). Whether the C library at hand agrees is checked when the library loads
 * (`exp_check`, 65,536 inputs over (-88, 88) and the cases a contraction would change); if one
 * differs, SiLU keeps calling expf. */
static int exp_vector_ok; /* set by exp_check at load: the vector exp equals libm's */
#if GEMV_ISA >= 1
#define EXP_N 32
/* 2^(i/32) as double bits, less i << 47 (the exponent the index adds back) */
static const uint64_t EXP_T[EXP_N] = {
    0x3ff0000000000000ULL, 0x3fefd9b0d3158574ULL, 0x3fefb5586cf9890fULL, 0x3fef9301d0125b51ULL,
    0x3fef72b83c7d517bULL, 0x3fef54873168b9aaULL, 0x3fef387a6e756238ULL, 0x3fef1e9df51fdee1ULL,
    0x3fef06fe0a31b715ULL, 0x3feef1a7373aa9cbULL, 0x3feedea64c123422ULL, 0x3feece086061892dULL,
    0x3feebfdad5362a27ULL, 0x3feeb42b569d4f82ULL, 0x3feeab07dd485429ULL, 0x3feea47eb03a5585ULL,
    0x3feea09e667f3bcdULL, 0x3fee9f75e8ec5f74ULL, 0x3feea11473eb0187ULL, 0x3feea589994cce13ULL,
    0x3feeace5422aa0dbULL, 0x3feeb737b0cdc5e5ULL, 0x3feec49182a3f090ULL, 0x3feed503b23e255dULL,
    0x3feee89f995ad3adULL, 0x3feeff76f2fb5e47ULL, 0x3fef199bdd85529cULL, 0x3fef3720dcef9069ULL,
    0x3fef5818dcfba487ULL, 0x3fef7c97337b9b5fULL, 0x3fefa4afa2a490daULL, 0x3fefd0765b6e4540ULL,
};
static const double EXP_INVLN2N = 0x1.71547652b82fep+0 * EXP_N, EXP_SHIFT = 0x1.8p+52;
static const double EXP_C0 = 0x1.c6af84b912394p-5 / EXP_N / EXP_N / EXP_N,
                    EXP_C1 = 0x1.ebfce50fac4f3p-3 / EXP_N / EXP_N,
                    EXP_C2 = 0x1.62e42ff0c52d6p-1 / EXP_N;
#endif

#if GEMV_ISA == 2
#define EXP_W 8 /* floats per call: 8 doubles in a 512-bit register */
INLINE __m256 exp_lanes(const __m256 x) {
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d z = _mm512_mul_pd(_mm512_set1_pd(EXP_INVLN2N), xd);
    __m512d kd = _mm512_add_pd(z, _mm512_set1_pd(EXP_SHIFT));
    const __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, _mm512_set1_pd(EXP_SHIFT));
    const __m512d r = _mm512_fmsub_pd(_mm512_set1_pd(EXP_INVLN2N), xd, kd); /* as glibc's FMA build */
    const __m512i at = _mm512_and_si512(ki, _mm512_set1_epi64(EXP_N - 1));
    __m512i t = _mm512_i64gather_epi64(at, (const long long *)EXP_T, 8);
    t = _mm512_add_epi64(t, _mm512_slli_epi64(ki, 52 - 5));
    const __m512d p = _mm512_fmadd_pd(_mm512_set1_pd(EXP_C0), r, _mm512_set1_pd(EXP_C1));
    __m512d y = _mm512_fmadd_pd(_mm512_set1_pd(EXP_C2), r, _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(p, _mm512_mul_pd(r, r), y);
    return _mm512_cvtpd_ps(_mm512_mul_pd(y, _mm512_castsi512_pd(t)));
}
#elif GEMV_ISA == 1
#define EXP_W 4 /* 4 doubles in a 256-bit register */
INLINE __m128 exp_lanes(const __m128 x) {
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d z = _mm256_mul_pd(_mm256_set1_pd(EXP_INVLN2N), xd);
    __m256d kd = _mm256_add_pd(z, _mm256_set1_pd(EXP_SHIFT));
    const __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, _mm256_set1_pd(EXP_SHIFT));
    const __m256d r = _mm256_fmsub_pd(_mm256_set1_pd(EXP_INVLN2N), xd, kd);
    const __m256i at = _mm256_and_si256(ki, _mm256_set1_epi64x(EXP_N - 1));
    __m256i t = _mm256_i64gather_epi64((const long long *)EXP_T, at, 8);
    t = _mm256_add_epi64(t, _mm256_slli_epi64(ki, 52 - 5));
    const __m256d p = _mm256_fmadd_pd(_mm256_set1_pd(EXP_C0), r, _mm256_set1_pd(EXP_C1));
    __m256d y = _mm256_fmadd_pd(_mm256_set1_pd(EXP_C2), r, _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(p, _mm256_mul_pd(r, r), y);
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(t)));
}
#endif

/* exp of x[0 .. EXP_W) into y: the vector lanes, and libm where |x| >= 88 or x is not finite. */
INLINE void exp_block(const float *x, float *y) {
#ifdef EXP_W
#if EXP_W == 8
    _mm256_storeu_ps(y, exp_lanes(_mm256_loadu_ps(x)));
#else
    _mm_storeu_ps(y, exp_lanes(_mm_loadu_ps(x)));
#endif
    for (int k = 0; k < EXP_W; k++)
        if (!(fabsf(x[k]) < 88.0f)) y[k] = expf(x[k]);
#else
    (void)x, (void)y;
#endif
}

/* How many of `count` floats, the bits lo, lo + step, ..., give another exp than libm's expf
 * (0 where there is no vector exp: nothing to differ). */
long exp_mismatches(uint32_t lo, uint32_t step, long count) {
#ifdef EXP_W
    long bad = 0;
    float x[EXP_W], y[EXP_W];
    for (long i = 0; i < count; i += EXP_W) {
        for (int k = 0; k < EXP_W; k++) {
            const uint32_t u = lo + (uint32_t)(i + k) * step;
            memcpy(&x[k], &u, 4);
        }
        exp_block(x, y);
        for (int k = 0; k < EXP_W && i + k < count; k++) {
            const float want = expf(x[k]);
            bad += memcmp(&want, &y[k], 4) != 0;
        }
    }
    return bad;
#else
    (void)lo, (void)step, (void)count;
    return 0;
#endif
}

__attribute__((constructor)) static void exp_check(void) {
#ifdef EXP_W
    /* 65,536 floats spread over both signs, and the two inputs a missing contraction of r
     * changed (found by the exhaustive check: 0x1.04845ep+5 and -0x1.f8cbb2p+5, given as bits,
     * since the compiler would fold expf of a constant to the correctly rounded value, which
     * is not libm's there) */
    exp_vector_ok = exp_mismatches(0x00000000u, 65537u, 32768) == 0 &&
                    exp_mismatches(0x80000000u, 65537u, 32768) == 0 &&
                    exp_mismatches(0x4202422fu, 1, 1) == 0 && exp_mismatches(0xc27c65d9u, 1, 1) == 0;
#endif
}

/* Whether SiLU takes the vector exp here (exp_check found it equal to libm's). */
int exp_vector(void) { return exp_vector_ok; }

/* a[e] = silu(gate) * up for the elements e in [lo, hi) of a [n, ffn], g [n, 2 ffn] holding each
 * row's gate, then its up: z / (1 + exp(-z)) * up, in float32, exp as libm's expf (above). */
static void silu_rows(const float *g, int n, long ffn, float *a, long lo, long hi) {
    (void)n;
    long e = lo;
#ifdef EXP_W
    if (exp_vector_ok)
        for (; e < hi; e++) {
            const long i = e / ffn, j = e % ffn;
            if (j + EXP_W > ffn || e + EXP_W > hi) { /* a row's or the range's last few */
                const float z = g[i * 2 * ffn + j];
                a[e] = z / (1.0f + expf(-z)) * g[i * 2 * ffn + ffn + j];
                continue;
            }
            float z[EXP_W], m[EXP_W], x[EXP_W];
            for (int k = 0; k < EXP_W; k++) z[k] = g[i * 2 * ffn + j + k], m[k] = -z[k];
            exp_block(m, x);
            for (int k = 0; k < EXP_W; k++)
                a[e + k] = z[k] / (1.0f + x[k]) * g[i * 2 * ffn + ffn + j + k];
            e += EXP_W - 1;
        }
#endif
    for (; e < hi; e++) {
        const long i = e / ffn, j = e % ffn;
        const float z = g[i * 2 * ffn + j];
        a[e] = z / (1.0f + expf(-z)) * g[i * 2 * ffn + ffn + j];
    }
}

/* out [n, hidden] = x1 + down(silu(gate) * up), where x1 = x + wo(attn [n, hq d]) and gate, up
 * are the two halves of gu(rmsnorm(x1)): the rest of the layer after attention. 0 or -1. */
int layer_out(const layer_t *L, const float *x, const float *attn, int n, float *out,
              int threads) {
    const long hidden = L->hidden, ffn = L->ffn;
    if (n < 1 || !out_fits(L)) return -1;
    float *h = malloc(sizeof(float) * n * (2 * hidden + 3 * ffn));
    if (h == NULL) return -1;
    float *t = h + n * hidden, *g = t + n * hidden, *a = g + n * 2 * ffn;
    int rc = lin_apply(&L->wo, attn, n, t, threads);
    if (rc == 0) {
        for (long j = 0; j < n * hidden; j++) out[j] = x[j] + t[j];
        rms_rows(out, n, hidden, L->ffn_norm, L->eps, h);
        rc = lin_apply(&L->gu, h, n, g, threads);
    }
    if (rc == 0) {
        silu_rows(g, n, ffn, a, 0, n * ffn);
        rc = lin_apply(&L->down, a, n, t, threads);
    }
    if (rc == 0)
        for (long j = 0; j < n * hidden; j++) out[j] += t[j];
    free(h);
    return rc;
}

/* ---- where a decode step's time goes inside its call (a profiling build) ----------------------
 *
 * Built with -DSTEP_PROFILE (benchmarks/decode_profile.py --inside), run_step counts, per thread,
 * the seconds it spends making a product's activations, multiplying (and the weight bytes it
 * reads, per kind of matrix), waiting at the barriers inside a region, and between a region's
 * start or end and its own work (the fork and join); on the calling thread also the seconds
 * between the regions (RoPE; a sparse choice; the KV writes and the attention) and in the whole
 * call. step_profile() copies them out. Without the define the macros are empty: nothing is
 * counted, and step_profile_size() is 0. */
enum { P_MAKE, P_ROWS, P_WAIT, P_SYNC, P_ROPE, P_CHOOSE, P_ATTEND, P_CALL, P_PARTS };
enum { M_QKV, M_OUT, M_GATE_UP, M_DOWN, M_HEAD, M_KINDS };
#define PROF_THREADS 16
/* The bytes of one row of l's weight (its blocks; kind 2's separate headers not counted). */
static long lin_row_bytes(const lin_t *l) {
    const int f = l->fmt & ~ROWS16;
    if (l->kind == 0) return 4L * l->in;
    if (f == Q4_K || f == Q6_K) return l->in / 256 * k_block_bytes(f);
    return l->in / 32 * block_bytes(f);
}
#ifdef STEP_PROFILE
/* [thread][part] seconds, then [thread][kind][seconds, bytes] */
static double prof_part[PROF_THREADS][P_PARTS], prof_rows[PROF_THREADS][M_KINDS][2];
#define PROF_NOW(t) const double t = omp_get_wtime()
#define PROF_ADD(tid, part, t0) (prof_part[(tid) % PROF_THREADS][part] += omp_get_wtime() - (t0))
int step_profile_size(void) { return PROF_THREADS * (P_PARTS + 2 * M_KINDS); }
void step_profile(double *out) {
    memcpy(out, prof_part, sizeof prof_part);
    memcpy(out + PROF_THREADS * P_PARTS, prof_rows, sizeof prof_rows);
}
void step_profile_reset(void) {
    memset(prof_part, 0, sizeof prof_part);
    memset(prof_rows, 0, sizeof prof_rows);
}
#else
#define PROF_NOW(t)
#define PROF_ADD(tid, part, t0) ((void)0)
int step_profile_size(void) { return 0; }
void step_profile(double *out) { (void)out; }
void step_profile_reset(void) {}
#endif

/* ---- one product shared by a team of threads ---------------------------------------------------
 *
 * Why: SPLIT forks and joins the threads for every product, five times a layer with attention,
 * about 150 times a SmolLM2 decode step, and between them the other thread waits while the
 * caller's thread alone does the norms, RoPE and SiLU. At batch 1 on Q4_1 weights (Intel Xeon,
 * 2 threads) the second thread stood idle 43% of the step, and the caller waited in OpenMP's
 * joins 11% of it. decode_layers runs one parallel region per layer instead (attention, with
 * its own threads, between them); inside it a product is split in two: its activations in
 * the kernel's form, which each thread makes for itself (prod_make: a few KB, no barrier), and
 * its rows, which the threads share (team_product's claims, below) before one barrier (0.27 us
 * here against a fork and join's 1.4). Each row is computed by the same code as the entry
 * point's: the same bits. Measured (benchmarks/kernel_ab.py, the same 4 chunks a thread forked
 * per product as A): 0.97-0.99x the step; the second thread's idle share fell from 43% to 33%,
 * the rest of it is the Python and attention between regions.
 *
 * The rows: each thread owns one range of a product (own_groups), which it reads front to
 * back, and a thread whose range is done takes what is left of another's from its end, a
 * claim (CLAIM_BYTES) at a time. Before, the threads took SPLIT's chunks (2 a thread) from one
 * counter: one chunk was the unit of balance, and at the end of a product the thread that
 * finished first waited for the other's last chunk. A Llama 3.2 1B-shaped Q4_1 step (AMD EPYC,
 * Zen 4, `decode_profile.py --inside`) waited at the barriers 10-11% of the call with chunks,
 * 1-2% with claims (its step level: the memory was the bound either way); the SmolLM2 Q4_1 step
 * took 0.975-0.99x the time (kernel_ab.py, four runs), and 0.86x with another process busy on
 * one of the two cores. A thief taking half of what is left instead of one claim was 1.13x
 * slower there: a big claim whose thread is then preempted holds up the barrier. */
typedef struct {
    const lin_t *l;
    const float *x;
    int n;
    float *y;
    long stride; /* from one row of y to the next (l->out, or more: l a part, lin_t.next) */
    act_t a; /* kind 2 */
    kact_t k; /* kind 2 at Q4_K / Q6_K; extra: its second buffer */
    void *extra;
    float *xs; /* kind 1 at Q4_1, kind 3 at Q4_K: sums of x per 32 elements */
    void *buf;
} prod_t;


/* p: the product of l (one part) by x [n, l->in] into y [n, l->out] (rows `stride` apart),
 * its activations made (kind 2: at most GEMV_I8_MAX_ROWS rows). 0, or -1 (no memory; p then
 * holds nothing to free). */
static int prod_make(prod_t *p, const lin_t *l, const float *x, int n, float *y, long stride) {
    *p = (prod_t){.l = l, .x = x, .n = n, .y = y, .stride = stride};
    if (lin_ki8(l))
        return kact_make(l->fmt, x, n, l->in / 256, 2, &p->k, &p->buf, &p->extra);
    if (l->kind == 2) return act_make(l->fmt, x, n, l->in / 32, 2, &p->a, &p->buf);
    const long runs = (long)n * (l->in / 32);
    if ((l->kind == 1 && l->fmt == Q4_1) || (l->kind == 3 && l->fmt == Q4_K && GEMV_ISA >= 1)) {
        p->buf = p->xs = malloc(sizeof(float) * runs);
        if (p->xs == NULL) return -1;
        sums32(x, runs, p->xs);
    }
    return 0;
}

/* Rows [lo, hi) of p's product (multiples of 16 but for the last: whole interleaved groups). */
static void prod_rows(const prod_t *p, long lo, long hi) {
    const lin_t *l = p->l;
    const int n = p->n;
    const long out = p->stride; /* (the kernels' `out`: y's row stride) */
    const uint8_t *w = (const uint8_t *)l->w;
    if (l->kind == 0) {
        f32_range(p->x, n, (const float *)l->w, l->in, p->y, out, lo, hi);
    } else if (lin_ki8(l)) {
        kact_rows(l->fmt, &p->k, n, w, p->y, out, lo, hi, 2);
    } else if (l->kind == 2) {
        act_rows(l->fmt, &p->a, n, w, l->h, p->y, out, lo, hi, 2);
    } else if (l->kind == 1) {
        const long nb = l->in / 32;
        if (l->fmt == Q8_0)
            q_range_Q8_0(p->x, p->xs, n, w, nb, p->y, out, lo, hi);
        else if (l->fmt == Q4_0)
            q_range_Q4_0(p->x, p->xs, n, w, nb, p->y, out, lo, hi);
        else
            q_range_Q4_1(p->x, p->xs, n, w, nb, p->y, out, lo, hi);
    } else {
        const long nb = l->in / 256;
#if GEMV_ISA >= 1
        if (l->fmt == Q6_K)
            q6k_range(p->x, n, w, nb, p->y, out, lo, hi);
        else
            q4k_range(p->x, p->xs, n, w, nb, p->y, out, lo, hi);
#else
        k_range(l->fmt, p->x, n, w, nb, p->y, out, lo, hi);
#endif
    }
}

/* A team: the threads of one parallel region, each calling the same team_* functions in the
 * same order. `claims` are the shared claim counters (zero at the region's start; each product
 * takes the next `threads` of them, one per thread's rows, every thread counting them alike in
 * `next`), `failed` is set when a thread could not make a product's activations (the call's
 * result is then thrown away). */
typedef struct {
    _Alignas(64) atomic_long v; /* groups taken from the front (low 32 bits), from the back */
} claim_t;

typedef struct {
    claim_t *claims;
    int next, threads, tid;
    atomic_int *failed;
} team_t;

/* Thread t's own rows of a product of `out` rows among nt threads: groups [g0, g1) of 16 rows
 * (the last group ends at `out`). */
INLINE void own_groups(long out, int nt, int t, long *g0, long *g1) {
    const long groups = (out + 15) / 16;
    *g0 = groups * t / nt, *g1 = groups * (t + 1) / nt;
}

/* Up to k of the `size` groups a claim counter covers, from its front (the owner's, in order)
 * or its back (another thread's, once its own are done): 1 and the first group taken (from
 * the range's start) into *at and how many into *got, or 0 when none is left. */
INLINE int claim(claim_t *c, long size, long k, int back, long *at, long *got) {
    long v = atomic_load_explicit(&c->v, memory_order_relaxed);
    for (;;) {
        const long front = v & 0xffffffffL, behind = v >> 32, left = size - front - behind;
        if (left <= 0) return 0;
        const long take = k < left ? k : left;
        if (atomic_compare_exchange_weak_explicit(&c->v, &v, v + (back ? take << 32 : take),
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *at = back ? size - behind - take : front, *got = take;
            return 1;
        }
    }
}

/* Groups a claim takes: about CLAIM_BYTES of weights (at least one group). Smaller claims
 * balance finer and bound what a preempted thread holds; each one a thief takes starts a cold
 * stream. SmolLM2 Q4_1 step (AMD EPYC, Zen 4): 64 KB 0.97x the time of 16 KB; 256 KB and 1 MB
 * within the runs' spread of 64 KB (1.03x, 0.99x). */
#ifndef CLAIM_BYTES
#define CLAIM_BYTES (64L << 10)
#endif
/* 1: each thread takes the others' rows first, its own last (a test build's: the claims from
 * a range's end made to run, tests/test_fused.py) */
#ifndef STEAL_FIRST
#define STEAL_FIRST 0
#endif

/* One part l of a product by the whole team into y (rows `stride` apart): every thread makes
 * the activations, then multiplies its own rows (own_groups: one range, read front to back,
 * CLAIM_BYTES at a time; thread t's are the rows `touch_ahead` read for it) and, when they are
 * done, takes the rows still left in the other threads' ranges from their ends, a claim at a
 * time, until none is left. No barrier: team_product's. */
static void team_part(team_t *tm, const lin_t *l, const float *x, int n, float *y, long stride,
                      int kind) {
    const int nt = tm->threads;
    const long out = l->out, row = lin_row_bytes(l);
    const long k = CLAIM_BYTES / (16 * row) > 1 ? CLAIM_BYTES / (16 * row) : 1;
    claim_t *claims = tm->claims + (long)tm->next++ * nt;
    prod_t p;
    PROF_NOW(t0);
    if (prod_make(&p, l, x, n, y, stride)) {
        atomic_store(tm->failed, 1);
        return;
    }
    PROF_ADD(tm->tid, P_MAKE, t0);
    PROF_NOW(t1);
    long rows = 0;
    for (int i = STEAL_FIRST; i < nt + STEAL_FIRST; i++) { /* its own rows, then the others' */
        const int t = (tm->tid + i) % nt;
        long g0, g1, at, got;
        own_groups(out, nt, t, &g0, &g1);
        while (claim(&claims[t], g1 - g0, k, t != tm->tid, &at, &got)) {
            const long lo = (g0 + at) * 16, end = (g0 + at + got) * 16;
            const long hi = end < out ? end : out;
            prod_rows(&p, lo, hi);
            rows += hi - lo;
        }
    }
#ifdef STEP_PROFILE
    const double dt = omp_get_wtime() - t1;
    prof_part[tm->tid % PROF_THREADS][P_ROWS] += dt;
    prof_rows[tm->tid % PROF_THREADS][kind][0] += dt;
    prof_rows[tm->tid % PROF_THREADS][kind][1] += (double)row * rows;
#else
    (void)kind, (void)rows;
#endif
    free(p.buf);
    free(p.extra);
}

/* y [n, lin_out(l)] = x [n, l->in] l^T by the whole team, each part (lin_t.next) into its
 * columns (team_part); whole when it returns (one barrier per chunk of GEMV_I8_MAX_ROWS x rows
 * where a part is kind 2, as gemv_qi8 goes). */
static void team_product(team_t *tm, const lin_t *l, const float *x, int n, float *y, int kind) {
    int step = n;
    for (const lin_t *part = l; part != NULL; part = lin_next(part))
        if (part->kind == 2) step = GEMV_I8_MAX_ROWS;
    const long stride = lin_out(l);
    for (int r0 = 0; r0 < n; r0 += step) {
        const int m = n - r0 < step ? n - r0 : step;
        long at = 0;
        for (const lin_t *part = l; part != NULL; at += part->out, part = lin_next(part))
            team_part(tm, part, x + (long)r0 * l->in, m, y + (long)r0 * stride + at, stride, kind);
        PROF_NOW(t2);
#pragma omp barrier
        PROF_ADD(tm->tid, P_WAIT, t2);
    }
}

/* The parts a region multiplies at most (`parts`: of its four products together, each a
 * lin_t and those stacked below it), each in chunks of GEMV_I8_MAX_ROWS x rows (a claim counter
 * per thread each). */
INLINE long team_counters(int n, long parts) {
    return parts * ((n + GEMV_I8_MAX_ROWS - 1) / GEMV_I8_MAX_ROWS);
}

/* l's parts: 1 and those stacked below it. */
static long lin_parts(const lin_t *l) {
    long parts = 0;
    for (; l != NULL; l = lin_next(l)) parts++;
    return parts;
}

/* ---- a whole decode step: every layer in one call --------------------------------------------
 *
 * engine/fused.py's `decode.step` calls this when the step's KV cache describes itself as plain
 * float32 arenas (`kv_step_t`, from the strategy's `native_step`): the layers' dense parts
 * (layer_qkv, layer_out), the new keys and values written into their slots, and attention over
 * each sequence's blocks, with no return to Python in between. Per layer and step that saves
 * the ctypes calls, torch's index_copy_ and the strategy's Python around its attention (at 64
 * tokens of context that was more than half of a Q4_1 step). The attention is the strategy's
 * own kernel, called through `attend` (sparse.c's sparse_attend: the function the per-layer
 * path calls), so the numbers are those of the per-layer path. */
typedef int (*attend_fn)(const float *q, int T, int hq, int hkv, int d, int bs,
                         const int64_t *bases, const int64_t *slots, const int64_t *where,
                         const int64_t *ids, const int64_t *blocks, long nb, long past,
                         float scale, float *out, int threads);

/* A sparse selection's choice (sparse.c's sparse_choose: its signature). */
typedef int (*choose_fn)(const float *q, int rows, int hq, int hkv, int d, const int8_t *codes,
                         const float *scales, long head_stride, long scale_stride, int parts,
                         int w, long lo, long hi, long room, long end, float alpha, float temp,
                         int64_t *out, int threads);

/* Per layer from `first` on, each sequence with a plan (lo >= 0) reads the blocks `choose`
 * picks from its summaries instead of every block: the sinks [0, lo), `room` of [lo, hi), the
 * window [hi, end) (sparse.c's sparse_choose), written into out + layer * per_layer + at[s]
 * ([hkv, lo + room + end - hi]) for the selection to read back after the step. */
typedef struct {
    choose_fn choose;
    int first, parts, w;
    float alpha, temp;
    const int64_t *plan; /* [nseq][4]: lo, hi, room, end (lo < 0: the sequence reads all) */
    const int64_t *codes, *scales; /* [nseq]: layer 0's int8 summaries and float32 scales */
    const int64_t *codes_layer, *scales_layer; /* [nseq]: bytes from one layer's to the next */
    const int64_t *head_stride, *scale_stride; /* [nseq]: elements from one KV head's to the next */
    int64_t *out;
    const int64_t *at; /* [nseq]: each sequence's place in a layer's part of out */
    int64_t per_layer;
} choice_t;

/* A cache's own KV work for one layer, in place of the slot writes and `attend` (a packed
 * format's: hybrid_attend.c's hybrid_layer): store the step's new k, v [n, hkv, d] of `layer`
 * and write the attention of q [n, hq, d] into out [n, hq, d], each sequence s reading the
 * blocks chosen[s] ([hkv, nchosen[s]]: positions in its block list, as a choice writes them)
 * or, where chosen[s] is NULL, every block; 0, or -1 (refused). In a sequential run
 * (decode_steps) the context describes a step of several rows per sequence, row j of each
 * computed by sub-step j after the rows before it: n is then one row per sequence, and `sub`
 * says which (0 otherwise). */
typedef int (*layer_fn)(const void *ctx, int layer, const float *q, const float *k,
                        const float *v, int n, float *out, int threads,
                        const int64_t *const *chosen, const int64_t *nchosen, int sub);

typedef struct {
    attend_fn attend;
    int64_t base; /* layer 0's [2, hkv, slots, d] float32 arena (K, then V) */
    int64_t layer_bytes; /* from one layer's arena to the next */
    int64_t slots; /* token slots per KV head in a layer's arena */
    int bs, nseq;
    float scale;
    const int64_t *new_slots; /* [n]: the slot of each new row's key and value */
    const int64_t *rows; /* [nseq + 1]: each sequence's first row, then n */
    const int64_t *past; /* [nseq]: tokens stored before the step (own: NULL, or the same) */
    const int64_t *nb; /* [nseq]: blocks each sequence reads (per KV head) */
    const int64_t *ids; /* [nseq]: addresses of int64 [blocks]: each block's index in the arena */
    const int64_t *blocks; /* [nseq]: addresses of int64 [hkv, nb]: the blocks read, in order */
    const choice_t *choice; /* NULL: every sequence reads every block at every layer */
    layer_fn own; /* not NULL: the cache's own layer work, on `own_ctx` (only nseq, rows,
                   * past and choice above are read then; own reads every stored token) */
    const void *own_ctx;
    /* Further places a read block may lie in, after the arena above (place 0, where the new
     * keys and values are written): a tiered cache's host arena, read in place. */
    int nplaces; /* 0 .. MAX_PLACES - 1 */
    const int64_t *places; /* [nplaces][3]: layer 0's address, bytes to the next layer, slots */
    const int64_t *where; /* NULL, or [nseq]: addresses of int64 [blocks]: each block's place
                           * (0 for a sequence whose blocks all lie in place 0) */
    int sub; /* own's sub-step (decode_steps sets it; 0 for one step) */
} kv_step_t;

#define MAX_PLACES 4

int kv_step_size(void) { return (int)sizeof(kv_step_t); }
/* Seconds spent in `choice->choose` and in `attend` by every decode_layers call so far (what
 * choosing and attention cost inside the step; read by benchmarks/sparse.py). */
static double choose_seconds, attend_seconds;
double decode_choose_seconds(void) { return choose_seconds; }
double decode_attend_seconds(void) { return attend_seconds; }
int choice_size(void) { return (int)sizeof(choice_t); }

/* x [n, hidden] through `nlayers` layers into out [n, hidden] (st NULL), or a whole step as
 * decode_step describes it. Returns 0, or -1 (a layer's sizes or kernels refused, the attention
 * refused, no memory): the caller then runs the step layer by layer, which rewrites every slot
 * this call may have written (the same values).
 *
 * The dense work runs as one parallel region per layer (team_product): region r holds layer
 * r - 1's output projection, norm and MLP and layer r's norm and QKV projection; between two
 * regions the calling thread applies RoPE, writes the keys and values, and runs the choice and
 * attention (each with its own threads: layer_attention), or, where every attention is short,
 * thread 0 does so at the end of region r while the others read ahead (touch_ahead); the last
 * region ends with the output layer (st). Every thread keeps its own copy of the hidden state
 * and computes the norms and residual adds itself (a few KB: cheaper than a barrier); SiLU is
 * split between them. The same operations on the same numbers as layer_qkv and layer_out. */
/* What a decode step does around its layers (decode_step): each new row's input is the
 * embedding row of its token (decoded from `embed`, a packed weight read as dequant_index
 * reads it; embed NULL: the caller gives x), and after the last layer the rows `rows` are
 * normalized (RMSNorm by `norm`) and multiplied by the output layer `head`. */
typedef struct {
    const uint8_t *embed;
    int embed_fmt;
    long embed_rows, embed_nb;
    const int64_t *tokens; /* [n] */
    const float *norm;
    float eps;
    lin_t head;
    const int64_t *rows; /* [nrows]: the rows whose logits the step returns */
    int nrows;
} step_t;

int step_struct_size(void) { return (int)sizeof(step_t); }

/* Layer li's work between its QKV product (tqkv [n, (hq + 2 hkv) d]) and its output
 * projection: RoPE into q, k, v; each sequence's choice of blocks (`kv->choice`, from its
 * first layer on: into chosen / nchosen, [nseq]); then the cache's own layer work, or the new
 * keys and values written into their slots and `attend` over each sequence's blocks, into attn
 * [n, hq, d]. Run by the calling thread between two parallel regions (with `threads` for the
 * choice and the attention), or inside one by its thread 0 (one thread; see INSIDE_KEYS).
 * 0, or -1 (refused). */
static int layer_attention(const kv_step_t *kv, const layer_t *L, int li, const float *tqkv,
                           int n, const int64_t *pos, float *q, float *k, float *v, float *attn,
                           const int64_t **chosen, int64_t *nchosen, int threads) {
    const int hq = L->hq, hkv = L->hkv, d = L->d, nseq = kv->nseq;
    int rc = 0;
    PROF_NOW(t_rope);
    rope_rows(L, tqkv, n, pos, q, k, v);
    PROF_ADD(0, P_ROPE, t_rope);
    /* Each sequence's blocks this layer: its choice (a plan, from `first` on), else all. */
    const choice_t *c = kv->choice;
    for (int s = 0; s < nseq && rc == 0; s++) {
        chosen[s] = NULL, nchosen[s] = 0;
        if (c == NULL || li < c->first || c->plan[4 * s] < 0) continue;
        const int64_t *p = c->plan + 4 * s; /* lo, hi, room, end */
        const long r0 = kv->rows[s], t = kv->rows[s + 1] - r0;
        int64_t *picked = c->out + li * c->per_layer + c->at[s];
        const double t0 = omp_get_wtime();
        rc = c->choose(q + r0 * hq * d, (int)t, hq, hkv, d,
                       (const int8_t *)(intptr_t)(c->codes[s] + li * c->codes_layer[s]),
                       (const float *)(intptr_t)(c->scales[s] + li * c->scales_layer[s]),
                       c->head_stride[s], c->scale_stride[s], c->parts, c->w, p[0], p[1], p[2],
                       p[3], c->alpha, c->temp, picked, threads);
        choose_seconds += omp_get_wtime() - t0;
        PROF_ADD(0, P_CHOOSE, t0);
        chosen[s] = picked, nchosen[s] = p[0] + p[2] + (p[3] - p[1]);
    }
    if (rc) return -1;
    const double t0 = omp_get_wtime();
    if (kv->own != NULL) {
        rc = kv->own(kv->own_ctx, li, q, k, v, n, attn, threads, chosen, nchosen, kv->sub);
        attend_seconds += omp_get_wtime() - t0;
        PROF_ADD(0, P_ATTEND, t0);
        return rc ? -1 : 0;
    }
    float *arena = (float *)(intptr_t)(kv->base + li * kv->layer_bytes);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < hkv; h++) {
            const long at = ((long)h * kv->slots + kv->new_slots[i]) * d;
            memcpy(arena + at, k + ((long)i * hkv + h) * d, sizeof(float) * d);
            memcpy(arena + (long)hkv * kv->slots * d + at, v + ((long)i * hkv + h) * d,
                   sizeof(float) * d);
        }
    int64_t bases[MAX_PLACES], slots[MAX_PLACES];
    bases[0] = (int64_t)(intptr_t)arena, slots[0] = kv->slots;
    for (int gi = 0; gi < kv->nplaces; gi++) {
        const int64_t *pl = kv->places + 3 * gi;
        bases[gi + 1] = pl[0] + li * pl[1], slots[gi + 1] = pl[2];
    }
    for (int s = 0; s < nseq && rc == 0; s++) {
        const long r0 = kv->rows[s], t = kv->rows[s + 1] - r0;
        const int64_t *all = (const int64_t *)(intptr_t)kv->blocks[s];
        const int64_t *blocks = chosen[s] ? chosen[s] : all;
        const long nb = chosen[s] ? nchosen[s] : kv->nb[s];
        rc = kv->attend(q + r0 * hq * d, (int)t, hq, hkv, d, kv->bs, bases, slots,
                        kv->where ? (const int64_t *)(intptr_t)kv->where[s] : NULL,
                        (const int64_t *)(intptr_t)kv->ids[s], blocks, nb, kv->past[s],
                        kv->scale, attn + r0 * hq * d, threads);
    }
    attend_seconds += omp_get_wtime() - t0;
    PROF_ADD(0, P_ATTEND, t0);
    return rc ? -1 : 0;
}

/* ---- the other threads' reads during a short attention --------------------------------------
 *
 * Why: at a short context (SmolLM2 at 64 tokens) a layer's attention is a one-thread call of
 * about 12 us (sparse_attend takes one thread below its SERIAL_KEYS), and the step's other
 * threads had nothing to do but wait, with the memory idle: 10-12% of the call
 * (`decode_profile.py --inside`). Now, where every sequence's attention is that short
 * (INSIDE_KEYS) and no sequence has a choice to make (short_attention), thread 0 runs RoPE and
 * the attention inside the layer's parallel region (one thread, as before; a packed cache's own
 * layer work, hybrid_attend.c's hybrid_layer, on one thread too), and each other thread
 * t reads, until thread 0 is done, the first half of its own rows (own_groups) in each of the
 * next products (the output projection, gate|up, down and the next layer's QKV; at most half
 * its L2 cache), so those bytes come from its L2 when it gets there. Reads, not software
 * prefetches: on the AMD EPYC (Zen 4) a run of prefetches over 128 or 384 KB left the region as
 * cold as before (a one-off test: they were dropped once the core's miss buffers filled), where
 * plain loads left it in the cache. The products are the same bits whichever thread takes which
 * rows. */
#ifndef INSIDE_KEYS
#define INSIDE_KEYS 1024 /* sparse.c's SERIAL_KEYS: below it sparse_attend uses one thread */
#endif

static long inside_layers; /* layers whose attention ran inside a region, by every call so far */
long decode_inside_layers(void) { return inside_layers; }

/* Thread tid of nt reads the first half of its own rows of each of the `count` products
 * lin[], up to `cap` bytes in all, until *done. */
static void touch_ahead(const lin_t *const *lin, int count, int tid, int nt, long cap,
                        atomic_int *done) {
    for (int i = 0; i < count && cap > 0; i++)
        for (const lin_t *l = lin[i]; l != NULL && cap > 0; l = lin_next(l)) { /* each part */
            long g0, g1;
            own_groups(l->out, nt, tid, &g0, &g1);
            const long lo = g0 * 16, hi = g1 * 16 < l->out ? g1 * 16 : l->out;
            if (lo >= hi) continue;
            const long row = lin_row_bytes(l), half = (hi - lo + 1) / 2 * row; /* first half */
            const char *w = (const char *)l->w + lo * row;
            const long n = half < cap ? half : cap;
            for (long o = 0; o < n; o += 64) {
                if (o % 4096 == 0 && atomic_load_explicit(done, memory_order_acquire)) return;
                (void)*(const volatile char *)(w + o); /* a load the compiler keeps */
            }
            cap -= n;
        }
}

/* Whether every sequence's attention in this step is short (fewer than INSIDE_KEYS keys read
 * over its KV heads) and chooses no blocks (no plan: a choice runs on the step's threads). A
 * cache's own layer work reads every stored token; without `past` it is taken as long. */
static int short_attention(const kv_step_t *kv, int hkv) {
    for (int s = 0; s < kv->nseq; s++) {
        if (kv->choice != NULL && kv->choice->plan[4 * s] >= 0) return 0;
        const long n = kv->rows[s + 1] - kv->rows[s];
        const long keys = kv->own == NULL   ? (long)kv->nb[s] * kv->bs
                          : kv->past != NULL ? kv->past[s] + n
                                             : INSIDE_KEYS;
        if ((long)hkv * keys >= INSIDE_KEYS) return 0;
    }
    return 1;
}

/* Half this core's L2 cache (what touch_ahead may fill), or 256 KB where it is not known. */
static long touch_cap(void) {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? l2 / 2 : 256L << 10;
}

static int run_step(const layer_t *const *layers, int nlayers, const kv_step_t *kv,
                    const float *x, int n, const int64_t *pos, const step_t *st, float *out,
                    int threads) {
    if (nlayers < 1 || n < 1 || kv->nseq < 1 || kv->rows[kv->nseq] != n) return -1;
    if (st != NULL) { /* the rows asked for, and the output layer's sizes */
        if (st->nrows < 1 || st->nrows > n || st->head.in != layers[0]->hidden ||
            !lin_fits(&st->head, st->nrows))
            return -1;
        for (int i = 0; i < st->nrows; i++)
            if (st->rows[i] < 0 || st->rows[i] >= n) return -1;
        const int ef = st->embed_fmt & ~ROWS16;
        if (st->embed != NULL &&
            st->embed_nb * (ef == Q4_K || ef == Q6_K ? 256 : 32) != layers[0]->hidden)
            return -1;
    }
    if (kv->own == NULL && (kv->nplaces < 0 || kv->nplaces >= MAX_PLACES)) return -1;
    const layer_t *L0 = layers[0];
    const int hq = L0->hq, hkv = L0->hkv, d = L0->d;
    const long hidden = L0->hidden, width = (long)(hq + 2 * hkv) * d;
    long ffn = 0, outs = 0, qkvs = 0; /* the most parts a layer's out half and QKV have */
    for (int li = 0; li < nlayers; li++) {
        const layer_t *L = layers[li];
        if (L->hq != hq || L->hkv != hkv || L->d != d || L->hidden != hidden ||
            !qkv_fits(L, n, pos) || !out_fits(L) || !lin_fits(&L->qkv, n) ||
            !lin_fits(&L->wo, n) || !lin_fits(&L->gu, n) || !lin_fits(&L->down, n))
            return -1;
        ffn = L->ffn > ffn ? L->ffn : ffn;
        const long o = lin_parts(&L->wo) + lin_parts(&L->gu) + lin_parts(&L->down);
        outs = o > outs ? o : outs;
        qkvs = lin_parts(&L->qkv) > qkvs ? lin_parts(&L->qkv) : qkvs;
    }
    if (threads < 1) threads = 1;
    const int nseq = kv->nseq;
    const long heads = st != NULL ? lin_parts(&st->head) : 0;
    const long ncount = team_counters(n, outs + (qkvs > heads ? qkvs : heads));
    /* shared: q, k, v, attn, the QKV product, the output and down products, gate|up, SiLU's
     * product, the hidden state between regions; then each thread's hidden state and norm */
    const size_t shared = (size_t)n * (2 * hq * d + 2 * hkv * d + width + 3 * hidden + 3 * ffn);
    float *buf = malloc(sizeof(float) * (shared + (size_t)threads * 2 * n * hidden));
    claim_t *claims = aligned_alloc(64, sizeof(claim_t) * ncount * threads);
    const int64_t **chosen = malloc(sizeof(int64_t *) * nseq);
    int64_t *nchosen = malloc(sizeof(int64_t) * nseq);
    int rc = buf == NULL || claims == NULL || chosen == NULL || nchosen == NULL ? -1 : 0;
    float *q = buf, *k = q + (long)n * hq * d, *v = k + (long)n * hkv * d;
    float *attn = v + (long)n * hkv * d, *tqkv = attn + (long)n * hq * d;
    float *two = tqkv + n * width, *tdown = two + n * hidden, *g = tdown + n * hidden;
    float *act = g + n * 2 * ffn, *a = act + n * ffn, *priv = a + n * hidden;
    if (rc == 0 && (st == NULL || st->embed == NULL))
        memcpy(a, x, sizeof(float) * n * hidden);
    else if (rc == 0 && dequant_index(st->embed_fmt, st->embed, st->embed_rows, st->embed_nb,
                                      st->tokens, n, a))
        rc = -1; /* a token outside the table, or a table gemv.c does not read */
    atomic_int failed = 0;
    /* short attentions inside the regions, the other threads reading ahead (touch_ahead) */
    const int inside = threads > 1 && short_attention(kv, hkv);
    const long cap = inside ? touch_cap() : 0;
    PROF_NOW(t_call);
    for (int r = 0; r <= nlayers && rc == 0; r++) {
        const layer_t *P = r > 0 ? layers[r - 1] : NULL, *L = r < nlayers ? layers[r] : NULL;
        for (long c = 0; c < ncount * threads; c++) atomic_init(&claims[c].v, 0);
        atomic_int done = 0; /* thread 0's attention, inside */
        PROF_NOW(t_fork);
#ifdef STEP_PROFILE
        double ended[PROF_THREADS]; /* when each thread's work in the region ended */
#endif
#pragma omp parallel num_threads(threads)
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            PROF_ADD(tid, P_SYNC, t_fork);
            team_t tm = {.claims = claims, .next = 0, .threads = nt, .tid = tid, .failed = &failed};
            float *hid = priv + (long)tid * 2 * n * hidden, *h = hid + n * hidden;
            memcpy(hid, a, sizeof(float) * n * hidden);
            if (P != NULL) { /* layer r - 1 after its attention: layer_out */
                team_product(&tm, &P->wo, attn, n, two, M_OUT);
                for (long j = 0; j < n * hidden; j++) hid[j] += two[j];
                rms_rows(hid, n, hidden, P->ffn_norm, P->eps, h);
                team_product(&tm, &P->gu, h, n, g, M_GATE_UP);
                const long all = n * P->ffn;
                silu_rows(g, n, P->ffn, act, all * tid / nt, all * (tid + 1) / nt);
                PROF_NOW(t_silu);
#pragma omp barrier
                PROF_ADD(tid, P_WAIT, t_silu);
                team_product(&tm, &P->down, act, n, tdown, M_DOWN);
                for (long j = 0; j < n * hidden; j++) hid[j] += tdown[j];
            }
            if (L != NULL) { /* layer r up to its attention: layer_qkv before RoPE */
                rms_rows(hid, n, hidden, L->attn_norm, L->eps, h);
                team_product(&tm, &L->qkv, h, n, tqkv, M_QKV);
                if (inside && tid == 0) {
                    inside_layers++;
                    if (layer_attention(kv, L, r, tqkv, n, pos, q, k, v, attn, chosen, nchosen, 1))
                        atomic_store(&failed, 1);
                    atomic_store_explicit(&done, 1, memory_order_release);
                } else if (inside) { /* the next products' first rows of this thread */
                    const lin_t *next[4] = {&L->wo, &L->gu, &L->down, NULL};
                    const lin_t *after = r + 1 < nlayers ? &layers[r + 1]->qkv
                                         : st != NULL     ? &st->head
                                                          : NULL;
                    next[3] = after;
                    touch_ahead(next, after ? 4 : 3, tid, nt, cap, &done);
                }
            } else if (st != NULL) { /* the output layer over the rows asked for */
                for (int i = 0; i < st->nrows; i++)
                    memcpy(h + i * hidden, hid + st->rows[i] * hidden, sizeof(float) * hidden);
                rms_rows(h, st->nrows, hidden, st->norm, st->eps, h);
                team_product(&tm, &st->head, h, st->nrows, out, M_HEAD);
            }
            if (tid == 0) memcpy(a, hid, sizeof(float) * n * hidden);
#ifdef STEP_PROFILE
            ended[tid % PROF_THREADS] = omp_get_wtime();
#endif
        }
#ifdef STEP_PROFILE
        for (int t = 0; t < threads && t < PROF_THREADS; t++) PROF_ADD(t, P_SYNC, ended[t]);
#endif
        if (atomic_load(&failed)) rc = -1;
        if (rc || L == NULL) break;
        if (inside) continue; /* done in the region, on thread 0 */
        rc = layer_attention(kv, L, r, tqkv, n, pos, q, k, v, attn, chosen, nchosen, threads);
    }
    PROF_ADD(0, P_CALL, t_call);
    if (rc == 0 && st == NULL) memcpy(out, a, sizeof(float) * n * hidden);
    free(chosen);
    free(nchosen);
    free(claims);
    free(buf);
    return rc ? -1 : 0;
}

/* x [n, hidden] through `nlayers` layers into out [n, hidden] (run_step). */
int decode_layers(const layer_t *const *layers, int nlayers, const kv_step_t *kv,
                  const float *x, int n, const int64_t *pos, float *out, int threads) {
    return run_step(layers, nlayers, kv, x, n, pos, NULL, out, threads);
}

/* A whole decode step: the rows' input (x, or the embedding rows of st->tokens), every layer,
 * the final norm and the output layer of rows st->rows into logits [nrows, head.out]. 0, or -1
 * (refused, as decode_layers; or a token outside the embedding table). */
int decode_step(const layer_t *const *layers, int nlayers, const kv_step_t *kv, const float *x,
                int n, const int64_t *pos, const step_t *st, float *logits, int threads) {
    return run_step(layers, nlayers, kv, x, n, pos, st, logits, threads);
}

/* The index of x[0 .. n)'s largest value as torch.argmax picks it: the first NaN where there is
 * one, else the first of the largest. */
static int64_t argmax_row(const float *x, long n) {
    int64_t best = 0;
    float top = x[0];
    if (top != top) return 0;
    for (long i = 1; i < n; i++) {
        const float y = x[i];
        if (y != y) return i;
        if (y > top) top = y, best = i;
    }
    return best;
}

/* argmax_row of each of `rows` rows x [rows, n] into out [rows] (what the tests compare with
 * torch.argmax). */
void argmax_rows(const float *x, long rows, long n, int64_t *out) {
    for (long r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}

/* ---- a sampled token ---------------------------------------------------------------------
 *
 * A token drawn from logits x[0 .. n) under spec = {temperature t, top_k, top_p, min_p} with the
 * uniform number u in [0, 1):
 *   1. the weights w_i = expf((x_i - max x) / t) (libm's bits: exp_block where it is checked
 *      equal), so the most likely token's is 1;
 *   2. top_k (0 < k < n): weights below the k-th largest dropped (ties with it kept, as vLLM
 *      keeps them); the k-th largest found by a radix select on the weights' bits
 *      (radix_boundary: three passes of 11, 11 and 10 bits);
 *   3. top_p (< 1): in descending order of weight (ties in ascending index order), a token
 *      kept while the mass of the kept ones before it is below top_p times the mass left after
 *      top-k (the first always); the boundary weight found the same way, the masses in float64;
 *   4. min_p (> 0): weights below min_p (min_p times the most likely token's) dropped;
 *   5. the draw: the weights left summed in float64 per block of SAMPLE_BLOCK (8 lane sums added
 *      in a fixed tree), the blocks' sums in order; the first index whose running sum passes u
 *      times the total, the block first, then its elements one by one from the sum of the
 *      blocks before. (Where the block's own sum and its elements' running sum differ in the
 *      last bit and the target falls between them: the block's last index of weight; where u
 *      times the total rounds up to the total: the last such index of all.)
 * -1 where x holds a NaN or only -inf. engine/sampling.py's torch path keeps the same tokens at
 * each step up to float rounding at the boundaries (its `nucleus`, `top_k`, `categorical`).
 *
 * Why in C: a sampled request's tokens must not depend on whether its steps ran one a call
 * (engine.sampling.sample calls this on a CPU) or several in one call (decode_steps, below):
 * the same function on the same logits and the same u gives the same token. And it reads
 * SmolLM2's 49,152 logits in tens of microseconds where torch's softmax, cumulative sum and
 * search took 0.1-0.3 ms and a top-p over a flat distribution sorted all of them (3.4 ms). */
#define SAMPLE_BLOCK 256

/* w[0 .. m) = expf((x[0 .. m) - top) * inv), libm's bits either way. */
static void sample_weights(const float *x, long m, float top, float inv, float *w) {
    long i = 0;
#ifdef EXP_W
    if (exp_vector_ok)
        for (; i + EXP_W <= m; i += EXP_W) {
            float z[EXP_W];
            for (int k = 0; k < EXP_W; k++) z[k] = (x[i + k] - top) * inv;
            exp_block(z, w + i);
        }
#endif
    for (; i < m; i++) w[i] = expf((x[i] - top) * inv);
}

/* The sum of w[0 .. m) in float64: 8 lane sums added as ((0+1)+(2+3))+((4+5)+(6+7)). */
static double block_sum(const float *w, long m) {
    double a[8] = {0};
    long i = 0;
    for (; i + 8 <= m; i += 8)
        for (int k = 0; k < 8; k++) a[k] += w[i + k];
    for (int k = 0; i < m; i++, k++) a[k] += w[i];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static inline uint32_t weight_bits(float w) { /* a weight >= 0: its bits order as it does */
    uint32_t b;
    memcpy(&b, &w, 4);
    return b;
}

/* The weight v among w[0 .. n) (each >= 0; those at least `floor` and above 0 counted) at
 * which, in descending order, the running measure (mass: the weights' sum, else their count)
 * first reaches `need` (need <= 0: the largest weight); *above = the measure of the counted
 * weights above v. A radix select on the bits, most significant digit first (11, 11 and 10
 * bits; 2,048 float64 buckets; an empty bucket is never chosen), the second and third digits
 * over the weights the first kept (gathered into `kept`, n floats). need must be at most the
 * counted total.
 *
 * Each pass is free of branches and adds into RADIX_WAYS histograms in turn (weight i into
 * i % RADIX_WAYS, a weight not counted adding 0), combined per bucket in a fixed order:
 * softmax weights crowd a few buckets, where one histogram's adds waited on each other, and
 * the tests of each weight mispredicted. 1.43x faster on SmolLM2's 49,152 weights (AMD EPYC,
 * Zen 4). */
#define RADIX_WAYS 4
_Static_assert(RADIX_WAYS == 4, "radix_pass's combining order adds four histograms");

/* One digit's histogram: bucket[d] = the measure of the counted weights among w[0 .. m)
 * whose bits above `hi_sh` are `want` (hi_sh 32: any) and whose digit at `sh` is d. */
static void radix_pass(const float *w, long m, float floor, int mass, int sh, int nb, int hi_sh,
                       uint32_t want, double *bucket) {
    double hist[RADIX_WAYS][2048];
    for (int j = 0; j < RADIX_WAYS; j++) memset(hist[j], 0, sizeof(double) * nb);
    for (long i = 0; i < m; i += RADIX_WAYS)
        for (int j = 0; j < RADIX_WAYS && i + j < m; j++) {
            const float x = w[i + j];
            const uint32_t b = weight_bits(x);
            const int counted = x > 0.0f && x >= floor && (hi_sh == 32 || (b >> hi_sh) == want);
            hist[j][(b >> sh) & (nb - 1)] += counted ? (mass ? (double)x : 1.0) : 0.0;
        }
    for (int d = 0; d < nb; d++)
        bucket[d] = (hist[0][d] + hist[1][d]) + (hist[2][d] + hist[3][d]);
}

static float radix_boundary(const float *w, long n, float floor, int mass, double need,
                            double *above, float *kept) {
    static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    double bucket[2048];
    uint32_t prefix = 0; /* the bits decided so far */
    const float *src = w;
    long m = n;
    *above = 0.0;
    for (int level = 0; level < 3; level++) {
        const int sh = shift[level], nb = 1 << width[level];
        const int hi_sh = level ? shift[level - 1] : 32; /* the decided bits are above hi_sh */
        radix_pass(src, m, floor, mass, sh, nb, hi_sh, hi_sh < 32 ? prefix >> hi_sh : 0, bucket);
        int d = nb - 1;
        for (; d > 0 && (bucket[d] == 0.0 || *above + bucket[d] < need); d--) *above += bucket[d];
        prefix |= (uint32_t)d << sh;
        if (level == 0) { /* the counted weights of this first digit, for the next two */
            long k = 0;
            for (long i = 0; i < n; i++) {
                const float x = w[i];
                kept[k] = x;
                k += x > 0.0f && x >= floor && weight_bits(x) >> sh == (uint32_t)d;
            }
            src = kept, m = k;
        }
    }
    float v;
    memcpy(&v, &prefix, 4);
    return v;
}

/* A token drawn from weights w[0 .. n) (>= 0) with u: step 5 above. -1 where all are 0. */
static int64_t draw_weights(const float *w, long n, double u) {
    const long nblocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double *sums = malloc(sizeof(double) * nblocks), total = 0.0;
    if (sums == NULL) return -1;
    for (long b = 0; b < nblocks; b++) {
        const long lo = b * SAMPLE_BLOCK;
        sums[b] = block_sum(w + lo, n - lo < SAMPLE_BLOCK ? n - lo : SAMPLE_BLOCK);
        total += sums[b];
    }
    if (!(total > 0.0)) {
        free(sums);
        return -1;
    }
    const double target = u * total;
    double before = 0.0;
    long b = 0;
    while (b < nblocks && !(before + sums[b] > target)) before += sums[b++];
    const int beyond = b == nblocks; /* u * total rounded up to the total */
    if (beyond) /* the last block of weight: its last index of weight */
        for (b = nblocks - 1; b > 0 && sums[b] == 0.0; b--) {}
    free(sums);
    const long lo = b * SAMPLE_BLOCK, m = n - lo < SAMPLE_BLOCK ? n - lo : SAMPLE_BLOCK;
    double c = before;
    long last = -1;
    for (long i = 0; i < m; i++) {
        if (w[lo + i] > 0.0f) last = i;
        c += w[lo + i];
        if (!beyond && c > target && w[lo + i] > 0.0f) return lo + i;
    }
    return last < 0 ? -1 : lo + last;
}

int64_t sample_row(const float *x, long n, const double *spec, double u) {
    const float t = (float)spec[0], p = (float)spec[2], min_p = (float)spec[3];
    const long k = (long)spec[1];
    float top = -INFINITY;
    for (long i = 0; i < n; i++) {
        if (x[i] != x[i]) return -1;
        top = x[i] > top ? x[i] : top;
    }
    if (top == -INFINITY) return -1;
    /* (a temperature past float32's range: 1 / t is 0, and -inf times 0 NaN; the smallest
     * normal float instead leaves every finite logit its weight of about 1, -inf its 0) */
    const float inv = 1.0f / t >= FLT_MIN ? 1.0f / t : FLT_MIN;
    /* the weights' buffer, kept by the thread: a vocabulary's (196 KB at 49,152) is past
     * malloc's mmap threshold, and mapping it anew each token cost its page faults */
    static __thread float *w; /* n weights, then n for radix_boundary's kept ones */
    static __thread long cap;
    if (n > cap) {
        float *grown = realloc(w, sizeof(float) * 2 * n);
        if (grown == NULL) return -1;
        w = grown, cap = n;
    }
    sample_weights(x, n, top, inv, w);
    float floor = 0.0f; /* top-k's boundary (ties kept) */
    double above;
    if (k > 0 && k < n) {
        long counted = 0;
        for (long i = 0; i < n; i++) counted += w[i] > 0.0f;
        if (k < counted) floor = radix_boundary(w, n, 0.0f, 0, (double)k, &above, w + n);
    }
    if (p < 1.0f) { /* top-p over the weights top-k left */
        double left = 0.0;
        for (long b = 0; b < n; b += SAMPLE_BLOCK) {
            float kept[SAMPLE_BLOCK];
            const long m = n - b < SAMPLE_BLOCK ? n - b : SAMPLE_BLOCK;
            for (long i = 0; i < m; i++) kept[i] = w[b + i] >= floor ? w[b + i] : 0.0f;
            left += block_sum(kept, m);
        }
        const double need = (double)p * left;
        const float v = radix_boundary(w, n, floor, 1, need, &above, w + n);
        long ties = 0; /* the tokens of weight v kept: while the mass before each is below need
                        * (the most likely token always, however small top_p) */
        for (long i = 0; i < n; i++) {
            if (!(w[i] >= floor) || w[i] < v) {
                w[i] = 0.0f;
            } else if (w[i] == v) {
                if (above + (double)ties * v < need || (above == 0.0 && ties == 0))
                    ties++;
                else
                    w[i] = 0.0f;
            }
        }
    }
    if (floor > 0.0f || min_p > 0.0f) /* (a temperature alone: nothing to drop) */
        for (long i = 0; i < n; i++)
            if (w[i] < floor || w[i] < min_p) w[i] = 0.0f;
    return draw_weights(w, n, u);
}

/* Row r of x [rows, n]: sample_row with spec + 4 r ({temperature, top_k, top_p, min_p}) and
 * draws[r] where spec is given and its temperature above 0, else argmax_row; into out [rows].
 * Several rows (a multi-step run's sequences) are shared among the process's OpenMP threads:
 * each row's token depends on its own logits and number only. */
void sample_rows(const float *x, long rows, long n, const double *spec, const double *draws,
                 int64_t *out) {
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1)
    for (long r = 0; r < rows; r++)
        out[r] = spec != NULL && spec[4 * r] > 0.0 ? sample_row(x + r * n, n, spec + 4 * r, draws[r])
                                                   : argmax_row(x + r * n, n);
}

/* `steps` greedy decode steps of the same sequences in one call (multi-step decoding).
 *
 * Why: between two steps' calls a decode loop runs Python (the strategy's bookkeeping, the
 * sampler, the scheduler) with caches the step's weights have just emptied: 0.5-0.7 ms of a
 * SmolLM2 step of 4-5 ms on the 2-core AMD EPYC. Run back to back here, the steps share one
 * such gap.
 *
 * kv describes one step in which every sequence has `steps` rows (no choice of blocks): each
 * row's slot (plain arenas: new_slots, the blocks read masked past the row's position) or the
 * cache's own function's context (a packed format's hybrid_layer) says where its KV goes. Sub-step
 * j runs as decode_step over one row per sequence (row j of each: its slot, or own's sub-step j;
 * positions pos + j, the sequences' stored tokens past + j), with the embedding rows of
 * tokens + j * nseq, and writes
 * its logits [nseq, vocab] at logits + j * nseq * vocab and each row's token at
 * tokens + (j + 1) * nseq: the next sub-step's tokens (tokens [steps + 1][nseq], row 0 given),
 * its argmax (argmax_row), or where spec [nseq][4] is given and sequence s's temperature is
 * above 0 its draw under spec + 4 s with the uniform number draws[j * nseq + s] (sample_row).
 * Returns how many sub-steps ran (fewer than `steps`: one was refused or a draw had no
 * weights, or the description is not one this runs: 0). */
int decode_steps(const layer_t *const *layers, int nlayers, const kv_step_t *kv, int steps,
                 const int64_t *pos, const step_t *st, int64_t *tokens, float *logits,
                 const double *spec, const double *draws, int threads) {
    const int nseq = kv->nseq;
    if (steps < 1 || nseq < 1 || kv->choice != NULL || kv->past == NULL || st == NULL ||
        st->embed == NULL)
        return 0;
    for (int s = 0; s < nseq; s++)
        if (kv->rows[s + 1] - kv->rows[s] != steps) return 0;
    const long vocab = lin_out(&st->head);
    int64_t *ints = malloc(sizeof(int64_t) * 5 * (nseq + 1));
    if (ints == NULL) return 0;
    int64_t *rows = ints, *past = rows + nseq + 1, *at = past + nseq + 1, *every = at + nseq + 1;
    int64_t *slots = every + nseq + 1;
    for (int s = 0; s <= nseq; s++) rows[s] = s, every[s] = s;
    kv_step_t one = *kv;
    one.rows = rows, one.past = past;
    if (kv->own == NULL) one.new_slots = slots;
    step_t head = *st;
    head.rows = every, head.nrows = nseq;
    int done = 0;
    for (; done < steps; done++) {
        one.sub = done;
        for (int s = 0; s < nseq; s++) {
            past[s] = kv->past[s] + done, at[s] = pos[kv->rows[s]] + done;
            if (kv->own == NULL) slots[s] = kv->new_slots[kv->rows[s] + done];
        }
        head.tokens = tokens + (long)done * nseq;
        float *out = logits + (long)done * nseq * vocab;
        if (run_step(layers, nlayers, &one, NULL, nseq, at, &head, out, threads)) break;
        int64_t *next = tokens + (long)(done + 1) * nseq;
        sample_rows(out, nseq, vocab, spec, draws ? draws + (long)done * nseq : NULL, next);
        int bad = 0;
        for (int s = 0; s < nseq; s++) bad |= next[s] < 0;
        if (bad) break;
    }
    free(ints);
    return done;
}
