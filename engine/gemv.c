/* Matrix-vector products for decode (a few activation rows): y[n, out] = x[n, in] @ W[out, in]^T.
 *
 * Built and loaded by engine/linear.py through kvstrategies/kernels.py (cc -O3 -march=native
 * -fopenmp, cached, ctypes), registered as the preferred CPU entry of matmul.float, matmul.q8_0,
 * matmul.q4_0 and matmul.q4_1 for calls of at most GEMV_MAX_ROWS rows (larger batches, i.e.
 * prefill, keep PyTorch's matrix products). engine/linear.py's reference entries compute the
 * same thing; tests/test_operators.py compares them.
 *
 * Why: at batch 1 a decode step is a stream over every weight byte. Each OpenMP thread takes a
 * contiguous range of output rows of the row-major weights and streams them one row after the
 * other (one purely sequential stream per thread), with independent FMA chains along the row;
 * x (a few KB) stays in L1. Quantized weights are read as their GGUF blocks (the packed bytes
 * are what streams) and decoded in registers: activations stay float32, so the product equals
 * the dequantized model's up to the order of the float32 sums.
 *
 * Block formats (ggml-common.h; 32 consecutive elements of a row per block):
 *   Q8_0: fp16 d, int8 q[32];            w = d q
 *   Q4_0: fp16 d, 16 bytes of nibbles;   w = d (q - 8)   (element j low nibble of byte j,
 *   Q4_1: fp16 d, fp16 m, 16 bytes;      w = d q + m      j + 16 its high nibble)
 *
 * Needs AVX-512F/BW (checked by the loader against /proc/cpuinfo; `gemv_ok` tells the build).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define GEMV_MAX_ROWS 4
#define GEMV_MAX_BLOCKS 4096 /* blocks per packed row (in <= 131072): Q4_1's per-call sums */
#define INLINE static inline __attribute__((always_inline))

int gemv_max_rows(void) { return GEMV_MAX_ROWS; }
long gemv_max_in(void) { return 32L * GEMV_MAX_BLOCKS; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
int gemv_ok(void) { return 1; }

/* Independent accumulators along a row, for one or two activation rows (more rows bring their
 * own chains). Measured here (one core, a model-sized set of weights, interleaved): one row of
 * W at a time with 2 chains streamed 2.3-2.9x faster than the split bmm at batch 1; 4 or 8 rows
 * of W interleaved at a time only 1.3-1.5x, and software prefetch slowed every variant. */
#ifndef GEMV_U
#define GEMV_U 2
#endif

/* ---- float32 weights ------------------------------------------------------------------- */

/* Row w (length `in`) against N rows of x: y[j * out] = w . x[j]. */
INLINE void f32_row(const float *restrict x, const float *restrict w, long in, float *restrict y,
                    long out, const int N, const int U) {
    __m512 acc[GEMV_MAX_ROWS][GEMV_U];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) acc[j][u] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 16 * U <= in; k += 16 * U)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
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

/* ---- GGUF blocks --------------------------------------------------------------------------- */

INLINE float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

INLINE long block_bytes(const int fmt) { return fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20; }

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

/* ---- entry points: the output rows split over `threads` (torch's OpenMP team) -------------- */

/* Each thread takes a contiguous range of rows, a multiple of 16 (whole cache lines of y). */
#define SPLIT(CALL)                                                                              \
    do {                                                                                         \
        if (threads <= 1 || out < 64) {                                                          \
            const long lo = 0, hi = out;                                                         \
            CALL;                                                                                \
        } else {                                                                                 \
            _Pragma("omp parallel num_threads(threads)") {                                       \
                const int t = omp_get_thread_num(), nt = omp_get_num_threads();                  \
                const long per = ((out + nt - 1) / nt + 15) / 16 * 16;                           \
                const long lo = t * per < out ? t * per : out;                                   \
                const long hi = lo + per < out ? lo + per : out;                                 \
                CALL;                                                                            \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* y [n, out] = x [n, in] @ w [out, in]^T, float32, 1 <= n <= GEMV_MAX_ROWS. */
void gemv_f32(const float *x, int n, const float *w, long out, long in, float *y, int threads) {
    if (n < 1 || n > GEMV_MAX_ROWS) return; /* the caller checks: never reached */
    SPLIT(f32_range(x, n, w, in, y, out, lo, hi));
}

/* y [n, out] = x [n, nb * 32] @ W^T, W given as `fmt` blocks [out, nb, block bytes]. */
void gemv_q(int fmt, const float *x, int n, const uint8_t *w, long out, long nb, float *y,
            int threads) {
    if (n < 1 || n > GEMV_MAX_ROWS || nb > GEMV_MAX_BLOCKS) return; /* the caller checks */
    /* Q4_1's offsets multiply each block's sum of x: computed once per call */
    float xsum[GEMV_MAX_ROWS * GEMV_MAX_BLOCKS];
    if (fmt == Q4_1)
        for (long i = 0; i < n * nb; i++)
            xsum[i] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_loadu_ps(x + i * 32), _mm512_loadu_ps(x + i * 32 + 16)));
    if (fmt == Q8_0)
        SPLIT(q_range_Q8_0(x, xsum, n, w, nb, y, out, lo, hi));
    else if (fmt == Q4_0)
        SPLIT(q_range_Q4_0(x, xsum, n, w, nb, y, out, lo, hi));
    else
        SPLIT(q_range_Q4_1(x, xsum, n, w, nb, y, out, lo, hi));
}

#else /* no AVX-512: the library builds, says so (gemv_ok), and is never called */
int gemv_ok(void) { return 0; }
void gemv_f32(const float *x, int n, const float *w, long out, long in, float *y, int threads) {}
void gemv_q(int fmt, const float *x, int n, const uint8_t *w, long out, long nb, float *y,
            int threads) {}
#endif
