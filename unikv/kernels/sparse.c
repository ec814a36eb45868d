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
 * The score of block b for KV head h: the largest, over the group's query heads g and the
 * step's query rows r, of q . c_b + alpha |q| . r_b, where c_b and r_b are the block's
 * per-channel key centre and half-range (`bounds`: [c, r] per block, 2d floats). alpha = 1 is
 * Quest's upper bound of q . k over the block; smaller alpha weighs the centre more.
 *
 * Top-k: a quickselect finds the room-th largest score per head; the blocks above it, and
 * as many of those equal to it as there is room for, are taken in block order, so the chosen
 * blocks come out in ascending order (the PyTorch reference sorts its topk's: the same list).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The `k`-th largest of a[0..n) (k in [1, n]); a is reordered. */
static float kth_largest(float *a, long n, long k) {
    long lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = a[lo + (hi - lo) / 2];
        long i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const float t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return a[want];
    }
    return a[want];
}

/* Scores of blocks [lo, hi) of one KV head: s[b - lo]. qa: the head's nq query vectors as
 * [q, alpha |q|] (2d floats each); bnd: the head's summaries, 2d floats per block. */
static void score_head(const float *qa, int nq, int d, const float *bnd, long lo, long hi,
                       float *s) {
    const int w = 2 * d;
    for (long b = lo; b < hi; b++) {
        const float *x = bnd + b * w;
        float best = -INFINITY;
        for (int j = 0; j < nq; j++) {
            const float *v = qa + (long)j * w;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < w; i++) acc += v[i] * x[i];
            best = acc > best ? acc : best;
        }
        s[b - lo] = best;
    }
}

/* q [rows, hq, d] float32 (hq = hkv * group); bounds: KV head h's summaries at
 * bounds + h * head_stride, block b at + b * 2d. Writes out [hkv, lo + room + (end - hi)]
 * int64 per KV head: the sink blocks 0..lo-1, the `room` best of the candidates [lo, hi),
 * then the window hi..end-1. Returns 0, or -1 for arguments out of its limits (or no memory). */
int sparse_choose(const float *q, int rows, int hq, int hkv, int d, const float *bounds,
                  long head_stride, long lo, long hi, long room, long end, float alpha,
                  int64_t *out, int threads) {
    const int group = hkv > 0 ? hq / hkv : 0, nq = rows * group, w = 2 * d;
    const long n = hi - lo, width = lo + room + (end - hi);
    if (hkv <= 0 || hq % hkv || nq <= 0 || d <= 0 || lo < 0 || n < 0 ||
        room < 0 || room > n || end < hi)
        return -1;
    float *qa = malloc(sizeof(float) * ((size_t)hkv * nq * w + 2 * (size_t)hkv * n + 1));
    if (!qa) return -1;
    for (int h = 0; h < hkv; h++)
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < group; g++) {
                const float *src = q + ((long)r * hq + h * group + g) * d;
                float *dst = qa + ((long)h * nq + r * group + g) * w;
                for (int i = 0; i < d; i++) {
                    dst[i] = src[i];
                    dst[d + i] = alpha * fabsf(src[i]);
                }
            }
    float *s = qa + (long)hkv * nq * w, *tmp = s + (long)hkv * n;
    /* Scoring in chunks of 64 blocks over the threads; top-k per head. A small layer runs on
     * one thread (the fork costs more than it saves). */
    const long chunk = 64, chunks = (n + chunk - 1) / chunk;
    const int team = (long)nq * n * w < (1L << 16) ? 1 : threads;
#pragma omp parallel for num_threads(team) schedule(static)
    for (long t = 0; t < hkv * chunks; t++) {
        const long h = t / chunks, b0 = lo + (t % chunks) * chunk;
        const long b1 = b0 + chunk < hi ? b0 + chunk : hi;
        score_head(qa + h * nq * w, nq, d, bounds + h * head_stride, b0, b1, s + h * n + b0 - lo);
    }
    for (int h = 0; h < hkv; h++) {
        int64_t *o = out + h * width;
        for (long b = 0; b < lo; b++) o[b] = b;
        for (long b = hi; b < end; b++) o[lo + room + b - hi] = b;
        if (!room) continue;
        const float *sh = s + h * n;
        memcpy(tmp, sh, sizeof(float) * n);
        const float thr = kth_largest(tmp, n, room);
        long above = 0; /* blocks above the threshold: all taken; of those equal to it, the
                           first in block order fill the rest, so the chosen come out sorted */
        for (long b = 0; b < n; b++) above += sh[b] > thr;
        long k = 0, equal = room - above;
        for (long b = 0; b < n && k < room; b++)
            if (sh[b] > thr || (sh[b] == thr && equal-- > 0)) o[lo + k++] = lo + b;
    }
    free(qa);
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
 * a partial softmax per query (its running max m, sum l and weighted values), merged at the end
 * as flash-decoding does: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. Query row r
 * (of the step's T new tokens) sees sequence positions <= past + r, so a chunk's rows are
 * causal over the step's own tokens in the window's last block and a partly filled block's
 * empty slots are never read as keys. */

/* Ask for the next block's floats while this one is multiplied: the blocks lie apart (a
 * 16-token block's keys are 4 KB of one head's rows), where the hardware prefetcher, which
 * follows one stream within a page, does not reach. */
#ifndef PF_AHEAD
#define PF_AHEAD 4 /* blocks */
#endif
static inline void prefetch_block(const char *p, long floats) {
    for (long o = 0; o < floats * 4; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* One range [b0, b1) of head h's blocks against its nq = T * group queries: m, l, acc [nq][d]. */
static void attend_range(const float *q, int T, int hq, int hkv, int d, int bs,
                         const int64_t *kaddr, const int64_t *vaddr, const int64_t *pos, long b0,
                         long b1, long past, float scale, int h, float *m, float *l, float *acc,
                         float *s) {
    const int group = hq / hkv, nq = T * group;
    const long n = (b1 - b0) * bs;
    for (long b = b0; b < b1; b++) { /* keys: each read once for every query */
        const float *kb = (const float *)(intptr_t)kaddr[b];
        if (b == b0) /* the first blocks, then one PF_AHEAD blocks ahead of the one in hand */
            for (long a = b0 + 1; a < b1 && a <= b0 + PF_AHEAD; a++)
                prefetch_block((const char *)(intptr_t)kaddr[a], bs * d);
        else if (b + PF_AHEAD < b1)
            prefetch_block((const char *)(intptr_t)kaddr[b + PF_AHEAD], bs * d);
        const long p0 = pos[b] * bs;
        for (int j = 0; j < bs; j++) {
            const float *kj = kb + (long)j * d;
            for (int i = 0; i < nq; i++) { /* query i: row i / group, head h * group + i % group */
                const int r = i / group;
                float dot = -INFINITY;
                if (p0 + j <= past + r) {
                    const float *qv = q + ((long)r * hq + h * group + i % group) * d;
                    float a = 0.0f;
#pragma omp simd reduction(+ : a)
                    for (int c = 0; c < d; c++) a += qv[c] * kj[c];
                    dot = a * scale;
                }
                s[(long)i * n + (b - b0) * bs + j] = dot;
            }
        }
    }
    for (int i = 0; i < nq; i++) { /* a partial softmax per query */
        float *si = s + (long)i * n, best = -INFINITY, sum = 0.0f;
        for (long t = 0; t < n; t++) best = si[t] > best ? si[t] : best;
        for (long t = 0; t < n; t++) {
            const float e = best == -INFINITY ? 0.0f : expf(si[t] - best);
            si[t] = e;
            sum += e;
        }
        m[i] = best;
        l[i] = sum;
        memset(acc + (long)i * d, 0, sizeof(float) * d);
    }
    for (long b = b0; b < b1; b++) { /* values: each block read once for every query */
        const float *vb = (const float *)(intptr_t)vaddr[b];
        if (b == b0)
            for (long a = b0 + 1; a < b1 && a <= b0 + PF_AHEAD; a++)
                prefetch_block((const char *)(intptr_t)vaddr[a], bs * d);
        else if (b + PF_AHEAD < b1)
            prefetch_block((const char *)(intptr_t)vaddr[b + PF_AHEAD], bs * d);
        for (int j = 0; j < bs; j++) {
            const float *vj = vb + (long)j * d;
            for (int i = 0; i < nq; i++) {
                const float w = s[(long)i * n + (b - b0) * bs + j];
                if (w == 0.0f) continue;
                float *a = acc + (long)i * d;
#pragma omp simd
                for (int c = 0; c < d; c++) a[c] += w * vj[c];
            }
        }
    }
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
    const int parts = threads > 1 && nb >= 2 ? 2 : 1;
    const long per = (nb + parts - 1) / parts, items = (long)hkv * parts;
    /* per item: m, l [nq], acc [nq][d], scores [nq][per * bs] */
    const long stride = 2L * nq + (long)nq * d + (long)nq * per * bs;
    float *buf = malloc(sizeof(float) * (size_t)(items * stride));
    if (!buf) {
        free(kaddr);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < items; t++) {
        const int h = (int)(t / parts);
        const long b0 = (t % parts) * per, b1 = b0 + per < nb ? b0 + per : nb;
        float *m = buf + t * stride, *l = m + nq, *acc = l + nq, *s = acc + (long)nq * d;
        if (b0 >= b1) {
            for (int i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0.0f;
            continue;
        }
        attend_range(q, T, hq, hkv, d, bs, kaddr + (long)h * nb, vaddr + (long)h * nb,
                     blocks + (long)h * nb, b0, b1, past, scale, h, m, l, acc, s);
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
