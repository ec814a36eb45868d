/* Attention over hybrid_fp16_int4's packed blocks, for one sequence and one layer.
 *
 * Built and loaded by kvstrategies/kernels.py (gcc -O3 -march=native -fopenmp); the pure PyTorch
 * path in kvstrategies/hybrid.py computes the same thing and is what the tests compare against.
 *
 * One pool block holds, per KV head, one record of `rec` bytes (offsets in `off`, channels in
 * the calibrated order: nf fp16 channels, nm main-width channels, nl low-width channels):
 *   kfp  f16 [nf][T]       key fp16 channels, channel-major
 *   vfp  f16 [T][nf]       value fp16 channels
 *   ksc  f16 [2][nm+nl]    key scale and low, per channel of the block
 *   vsc  f16 [T][4]        value scale, low of the main class; scale, low of the low class
 *   km   u8  [nm][T*b/8]   key codes, per channel, packed along tokens in split order
 *   kl   u8  [nl][T*lb/8]
 *   vm   u8  [T][nm*b/8]   value codes, per token, packed along channels in split order
 *   vl   u8  [T][nl*lb/8]
 * A value is code * scale + low. Split order: byte j of a run of m bytes holds elements
 * j, j + m, j + 2m, ... so one shift unpacks a contiguous run.
 *
 * Scores fold the key scales into the query (q.k = sum_c (q_c s_c) code_c + sum_c q_c low_c), so
 * each code is converted once per block and reused by every query row of the KV head. The softmax
 * is computed online (flash-decoding): work items are (head, chunk of blocks) plus (head, dense
 * tokens); each keeps a running max, sum and accumulator, merged at the end.
 *
 * The dense tokens are those not in a packed block: `na` fp16 tokens every row sees (the sinks
 * and the block being filled) and `tq` float tokens of the current step (causal: row r, step
 * token r % tq, sees current tokens 0..r % tq).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 8 /* packed blocks per work item */

enum { OFF_KFP, OFF_VFP, OFF_KSC, OFF_VSC, OFF_KM, OFF_KL, OFF_VM, OFF_VL };

static inline void unpack(const uint8_t *p, int n, int bits, float *out) {
    const int per = 8 / bits, m = n / per, mask = (1 << bits) - 1;
    for (int i = 0; i < per; i++)
        for (int j = 0; j < m; j++) out[i * m + j] = (float)((p[j] >> (bits * i)) & mask);
}

static inline void h2f(const _Float16 *p, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = (float)p[i];
}

/* Online-softmax update of one row with scores s[0..n) and return the weights in s. */
static inline void softmax_update(float *s, int n, float *m, float *l, float *acc, int d) {
    float mx = *m;
    for (int t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    if (mx == -INFINITY) { /* nothing visible in this piece */
        for (int t = 0; t < n; t++) s[t] = 0.0f;
        return;
    }
    const float corr = expf(*m - mx);
    float sum = 0.0f;
    for (int t = 0; t < n; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    if (corr != 1.0f)
        for (int c = 0; c < d; c++) acc[c] *= corr;
    *l = *l * corr + sum;
    *m = mx;
}

typedef struct {
    int T, nf, nm, nl, b, lb, H, R, D;
    long rec;
    const long *off;
} Shape;

/* One packed block of one head into the running (m, l, acc) of all R rows. */
static void packed_block(const Shape *sh, const uint8_t *blk, const float *q, int mask0,
                         float *s, float *tmp, float *qs, float *m, float *l, float *acc) {
    const int T = sh->T, nf = sh->nf, nm = sh->nm, nl = sh->nl, R = sh->R, D = sh->D;
    const int nq = nm + nl;
    const _Float16 *kfp = (const _Float16 *)(blk + sh->off[OFF_KFP]);
    const _Float16 *vfp = (const _Float16 *)(blk + sh->off[OFF_VFP]);
    const _Float16 *ksc = (const _Float16 *)(blk + sh->off[OFF_KSC]);
    const _Float16 *vsc = (const _Float16 *)(blk + sh->off[OFF_VSC]);
    const uint8_t *km = blk + sh->off[OFF_KM], *kl = blk + sh->off[OFF_KL];
    const uint8_t *vm = blk + sh->off[OFF_VM], *vl = blk + sh->off[OFF_VL];
    /* Scores: s[r][t] = sum_c q[r][c] k[c][t]. */
    for (int r = 0; r < R; r++) {
        const float *qr = q + (long)r * D;
        float z = 0.0f;
        for (int c = 0; c < nq; c++) {
            qs[r * nq + c] = qr[nf + c] * (float)ksc[c];
            z += qr[nf + c] * (float)ksc[nq + c];
        }
        for (int t = 0; t < T; t++) s[r * T + t] = z;
    }
    for (int c = 0; c < nf; c++) {
        h2f(kfp + (long)c * T, T, tmp);
        for (int r = 0; r < R; r++) {
            const float w = q[(long)r * D + c];
            float *sr = s + r * T;
            for (int t = 0; t < T; t++) sr[t] += w * tmp[t];
        }
    }
    for (int c = 0; c < nq; c++) {
        const int low = c >= nm;
        const int bits = low ? sh->lb : sh->b;
        const uint8_t *codes = low ? kl + (long)(c - nm) * (T * bits / 8) : km + (long)c * (T * bits / 8);
        unpack(codes, T, bits, tmp);
        for (int r = 0; r < R; r++) {
            const float w = qs[r * nq + c];
            float *sr = s + r * T;
            for (int t = 0; t < T; t++) sr[t] += w * tmp[t];
        }
    }
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < mask0; t++) s[r * T + t] = -INFINITY;
        softmax_update(s + r * T, T, m + r, l + r, acc + (long)r * D, D);
    }
    /* Values: acc[r][c] += p[r][t] * (code * scale + low). */
    const int mb = nm * sh->b / 8, lbb = nl * sh->lb / 8;
    for (int t = 0; t < T; t++) {
        h2f(vfp + (long)t * nf, nf, tmp);
        if (nm) unpack(vm + (long)t * mb, nm, sh->b, tmp + nf);
        if (nl) unpack(vl + (long)t * lbb, nl, sh->lb, tmp + nf + nm);
        const float ms = (float)vsc[t * 4], ml = (float)vsc[t * 4 + 1];
        const float ls = (float)vsc[t * 4 + 2], ll = (float)vsc[t * 4 + 3];
        for (int r = 0; r < R; r++) {
            const float p = s[r * T + t];
            if (p == 0.0f) continue;
            float *ar = acc + (long)r * D;
            for (int c = 0; c < nf; c++) ar[c] += p * tmp[c];
            const float a = p * ms, z = p * ml;
            for (int c = nf; c < nf + nm; c++) ar[c] += a * tmp[c] + z;
            const float a2 = p * ls, z2 = p * ll;
            for (int c = nf + nm; c < D; c++) ar[c] += a2 * tmp[c] + z2;
        }
    }
}

/* Dense tokens of one head: `na` fp16 tokens seen by all rows, then `tq` float causal tokens. */
static void dense(const Shape *sh, const _Float16 *ak, const _Float16 *av, int na,
                  const float *ck, const float *cv, long cstride, int tq, const float *q,
                  float *s, float *tmp, float *m, float *l, float *acc) {
    const int R = sh->R, D = sh->D, n = na + tq;
    for (int r = 0; r < R; r++) {
        const float *qr = q + (long)r * D;
        float *sr = s + (long)r * n;
        const int visible = na + (tq ? r % tq + 1 : 0);
        for (int j = 0; j < n; j++) {
            if (j >= visible) {
                sr[j] = -INFINITY;
                continue;
            }
            float dot = 0.0f;
            if (j < na) {
                h2f(ak + (long)j * D, D, tmp);
                for (int c = 0; c < D; c++) dot += qr[c] * tmp[c];
            } else {
                const float *k = ck + (long)(j - na) * cstride;
                for (int c = 0; c < D; c++) dot += qr[c] * k[c];
            }
            sr[j] = dot;
        }
        softmax_update(sr, n, m + r, l + r, acc + (long)r * D, D);
        float *ar = acc + (long)r * D;
        for (int j = 0; j < visible; j++) {
            const float p = sr[j];
            if (j < na) {
                h2f(av + (long)j * D, D, tmp);
                for (int c = 0; c < D; c++) ar[c] += p * tmp[c];
            } else {
                const float *v = cv + (long)(j - na) * cstride;
                for (int c = 0; c < D; c++) ar[c] += p * v[c];
            }
        }
    }
}

/* out[h][r][:] (normalized) and lse[h][r] over packed blocks + dense tokens.
 *   arena: this layer's records, block b head h at arena + b * H * rec + h * rec
 *   blocks[nb]: the sequence's packed blocks in token order; mask0 leading positions of the
 *     sequence's first block are not attended (the sinks, which are dense)
 *   q: [H][R][D] query rows in key channel order, already multiplied by the softmax scale
 *   ak/av: [H][na_stride][D] fp16 dense tokens; ck/cv: current tokens, head h token j at
 *     ck + j * cstride + h * D (the step's [T, H, D] activations)
 */
void hybrid_attend(const uint8_t *arena, const int64_t *blocks, int nb, int mask0, int T,
                   int nf, int nm, int nl, int b, int lb, long rec, const long *off, int H,
                   int R, int D, const float *q, const _Float16 *ak, const _Float16 *av,
                   int na, long na_stride, const float *ck, const float *cv, long cstride,
                   int tq, float *out, float *lse) {
    const Shape sh = {T, nf, nm, nl, b, lb, H, R, D, rec, off};
    const int nchunks = (nb + CHUNK - 1) / CHUNK;
    const int has_dense = na + tq > 0;
    const int per_head = nchunks + has_dense;
    const int items = H * per_head;
    /* Per item: m[R], l[R], acc[R][D]. */
    const long item_floats = (long)R * (D + 2);
    float *part = malloc(sizeof(float) * item_floats * (items ? items : 1));
    const long scratch_n = (long)R * (T > na + tq ? T : na + tq) + (long)R * (nm + nl) + D + T;

#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * scratch_n);
        float *s = scratch;
        float *qs = s + (long)R * (T > na + tq ? T : na + tq);
        float *tmp = qs + (long)R * (nm + nl);
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            const int h = it / per_head, c = it % per_head;
            float *m = part + it * item_floats, *l = m + R, *acc = l + R;
            for (int r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
            memset(acc, 0, sizeof(float) * R * D);
            const float *qh = q + (long)h * R * D;
            if (c < nchunks) {
                const int end = (c + 1) * CHUNK < nb ? (c + 1) * CHUNK : nb;
                for (int i = c * CHUNK; i < end; i++) {
                    const uint8_t *blk = arena + (blocks[i] * H + h) * rec;
                    packed_block(&sh, blk, qh, i == 0 ? mask0 : 0, s, tmp, qs, m, l, acc);
                }
            } else {
                dense(&sh, ak + (long)h * na_stride * D, av + (long)h * na_stride * D, na,
                      ck + (long)h * D, cv + (long)h * D, cstride, tq, qh, s, tmp, m, l, acc);
            }
        }
        free(scratch);
    }
    for (int h = 0; h < H; h++) {
        for (int r = 0; r < R; r++) {
            float mx = -INFINITY;
            for (int c = 0; c < per_head; c++) {
                const float mi = part[(h * per_head + c) * item_floats + r];
                mx = mi > mx ? mi : mx;
            }
            float *o = out + ((long)h * R + r) * D;
            memset(o, 0, sizeof(float) * D);
            float denom = 0.0f;
            for (int c = 0; c < per_head && mx != -INFINITY; c++) {
                const float *m = part + (h * per_head + c) * item_floats;
                if (m[r] == -INFINITY) continue;
                const float w = expf(m[r] - mx);
                denom += w * m[R + r];
                const float *acc = m + 2 * R + (long)r * D;
                for (int d = 0; d < D; d++) o[d] += w * acc[d];
            }
            if (denom > 0.0f)
                for (int d = 0; d < D; d++) o[d] /= denom;
            lse[h * R + r] = denom > 0.0f ? mx + logf(denom) : -INFINITY;
        }
    }
    free(part);
}
