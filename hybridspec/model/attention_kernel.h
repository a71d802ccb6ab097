/* Attention of a decode or verification step on a CPU: a few query rows per KV head over a long KV cache (and, at
   the end of this file, of a prompt chunk: many consecutive queries, causal).

   Why not PyTorch's flash attention: it is built for many query rows; with the 3-30 folded rows of a step it reads
   each key at a fraction of the memory's speed (SmolLM2, 2,048 tokens of context: ~10 ms per step for one row,
   where streaming the keys and values takes ~2 ms). Here each block of 16 keys is read once for all rows: a row's dot
   products with the 16 keys are 16 vectors of partial sums over the head dimension, added across in one transposing
   reduction (no per-key horizontal sum); the softmax's exponentials are vectorised; the values are read once per
   group of up to 6 rows, whose outputs stay in registers.

   Exactness: every row is computed alone, in an order that does not depend on the other rows nor on how many keys
   past its own the step holds (a masked key adds an exact zero), so a token's attention output is bitwise the same
   in a plain step and in a verification pass of any size.

   Layout: q and out [batch, kv_heads, rows, head_dim] contiguous; keys and values [batch, kv_heads, capacity,
   head_dim] (a layer of the KV cache); row r of a KV head is query r % num_queries of the step (the query heads that
   share a KV head, folded). Row r sees keys [0, prefix[b]) and key prefix[b] + j where see[b][r % nq][j].
   head_dim: 16, 32, 64 or 128. sinks (gpt-oss; NULL: none): a logit per query head [kv_heads * heads per KV head]
   in each softmax's denominator that has no value. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define HS_TARGET __attribute__((target("avx512f")))

static int hs_attention_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

#define HS_INLINE static inline __attribute__((always_inline))

/* 16 vectors of partial sums -> one vector of their 16 totals (lane i: the sum of v[i]'s lanes), adding partial sums
   of the same key only, in an order fixed by the lane */
HS_TARGET HS_INLINE __m512 hs_transpose_sum16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* t[i], each 128-bit lane: two partial sums of v[2i] and two of v[2i+1], interleaved */
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    /* u[i], each 128-bit lane: the lane's sums of v[4i] .. v[4i+3] */
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    /* w[i], 128-bit lanes: halves of the totals of v[8i] .. v[8i+3], then of v[8i+4] .. v[8i+7] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* exp(x) for x <= 0: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6 (relative error ~2e-7) */
HS_TARGET HS_INLINE __m512 hs_exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Row r's scores with the 16 keys from j0 (keys past n: any valid key, masked after); CHUNKS = head_dim / 16. All
   loop bounds are constants, so the 16 sums stay in registers. */
HS_TARGET HS_INLINE __m512 hs_scores16(const float *qr, const float *k, long key_stride, int j0, int n,
                                        const int chunks) {
    __m512 acc[16];
    const float *key[16];
    for (int i = 0; i < 16; i++) {
        acc[i] = _mm512_setzero_ps();
        key[i] = k + (long)(j0 + i < n ? j0 + i : n - 1) * key_stride;
    }
    for (int c = 0; c < chunks; c++) {
        const __m512 qc = _mm512_loadu_ps(qr + 16 * c);
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(key[i] + 16 * c), acc[i]);
    }
    return hs_transpose_sum16(acc);
}

/* out rows [r0, r0 + GROUP) = their probabilities (scores) times the values, the sums in registers */
HS_TARGET HS_INLINE void hs_values(const float *scores, long padded, const float *v, long key_stride, int n,
                                   float *out, int r0, const int group, const int chunks) {
    __m512 o[6][8];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) o[g][c] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *vj = v + (long)j * key_stride;
        for (int g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(scores[(long)(r0 + g) * padded + j]);
            for (int c = 0; c < chunks; c++) o[g][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * c), o[g][c]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + (long)(r0 + g) * 16 * chunks + 16 * c, o[g][c]);
}

/* One KV head of one row of the batch: rows x n scores (scratch: rows x n rounded up to 16), softmax, values. */
HS_TARGET HS_INLINE void hs_attend_head(const float *q, const float *k, const float *v, long key_stride, int rows,
                                        int prefix, int nq, const uint8_t *see, const float *sinks, float scale,
                                        float *out, float *scores, const int chunks) {
    const int dim = 16 * chunks, n = prefix + nq, padded = (n + 15) / 16 * 16;
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), scale_v = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < n; j0 += 16) {
        __mmask16 in_range = n - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
        for (int r = 0; r < rows; r++) {
            __mmask16 visible = in_range;
            if (j0 + 16 > prefix) {  /* the step's own keys: as the row's query sees them */
                const uint8_t *row_sees = see + (r % nq) * nq;
                for (int i = 0; i < 16 && j0 + i < n; i++)
                    if (j0 + i >= prefix && !row_sees[j0 + i - prefix]) visible &= (__mmask16)~(1u << i);
            }
            const __m512 s = _mm512_mul_ps(hs_scores16(q + (long)r * dim, k, key_stride, j0, n, chunks), scale_v);
            _mm512_storeu_ps(scores + (long)r * padded + j0, _mm512_mask_blend_ps(visible, neg_inf, s));
        }
    }
    /* softmax per row: lane sums by key index mod 16, then the lanes in a fixed order */
    for (int r = 0; r < rows; r++) {
        float *s = scores + (long)r * padded;
        __m512 m = neg_inf;
        for (int j = 0; j < padded; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
        const float sink = sinks ? sinks[r / nq] : -INFINITY;  /* this row's query head's */
        float top = _mm512_reduce_max_ps(m);
        if (sink > top) top = sink;
        const __m512 row_max = _mm512_set1_ps(top);
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < padded; j += 16) {
            const __m512 x = _mm512_loadu_ps(s + j);
            const __mmask16 live = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(live, hs_exp_nonpositive(_mm512_sub_ps(x, row_max)));
            _mm512_storeu_ps(s + j, e);
            total = _mm512_add_ps(total, e);
        }
        float lanes[16];
        _mm512_storeu_ps(lanes, total);
        for (int w = 8; w > 0; w /= 2)
            for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];
        const __m512 inverse = _mm512_set1_ps(1.0f / (sinks ? lanes[0] + expf(sink - top) : lanes[0]));
        for (int j = 0; j < padded; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inverse));
    }
    /* values: groups of rows whose outputs fit in registers (24 vectors), each group reading the values once */
    const int full = chunks <= 4 ? 6 : 3;
    int r0 = 0;
    for (; r0 + full <= rows; r0 += full) hs_values(scores, padded, v, key_stride, n, out, r0, full, chunks);
    switch (rows - r0) {
        case 5: hs_values(scores, padded, v, key_stride, n, out, r0, 5, chunks); break;
        case 4: hs_values(scores, padded, v, key_stride, n, out, r0, 4, chunks); break;
        case 3: hs_values(scores, padded, v, key_stride, n, out, r0, 3, chunks); break;
        case 2: hs_values(scores, padded, v, key_stride, n, out, r0, 2, chunks); break;
        case 1: hs_values(scores, padded, v, key_stride, n, out, r0, 1, chunks); break;
        default: break;
    }
}

/* hs_attend_head with head_dim (16, 32, 64 or 128) as a constant: its loops over the dimension unroll */
HS_TARGET static void hs_attend_head_of(const float *q, const float *k, const float *v, long key_stride, int rows,
                                        int prefix, int nq, const uint8_t *see, const float *sinks, float scale,
                                        float *out, float *scores, int dim) {
    switch (dim) {
        case 16: hs_attend_head(q, k, v, key_stride, rows, prefix, nq, see, sinks, scale, out, scores, 1); break;
        case 32: hs_attend_head(q, k, v, key_stride, rows, prefix, nq, see, sinks, scale, out, scores, 2); break;
        case 64: hs_attend_head(q, k, v, key_stride, rows, prefix, nq, see, sinks, scale, out, scores, 4); break;
        default: hs_attend_head(q, k, v, key_stride, rows, prefix, nq, see, sinks, scale, out, scores, 8); break;
    }
}

/* The (row, KV head) pairs of a step are dealt among OpenMP threads (torch's runtime, as the product kernel's), each
   pair computed by one thread alone, so the result does not depend on the thread count. A step whose keys are few is
   not worth waking the others: its KV reads are what the threads share. */
#define HS_ATTENTION_THREADS(threads, pairs, keys) \
    ((pairs) < 2 || (long)(pairs) * (keys) < 4096 ? 1 : (threads) < (pairs) ? (threads) : (pairs))

/* Every batch row and KV head of one layer; 0 when head_dim is not 16, 32, 64 or 128 (nothing computed). scores:
   per thread `scores_stride` floats, at least rows x (max prefix + nq + 15). */
HS_TARGET static int hs_decode_attention(const float *q, const float *keys, const float *values, float *out,
                                         float *scores, long scores_stride, int batch, int kv_heads, int rows,
                                         int dim, int nq, const int64_t *prefix, const uint8_t *see,
                                         const float *sinks, long batch_stride, long head_stride, long key_stride,
                                         float scale, int threads) {
    if (dim != 16 && dim != 32 && dim != 64 && dim != 128) return 0;
    const int pairs = batch * kv_heads;
    #pragma omp parallel for schedule(static) num_threads(HS_ATTENTION_THREADS(threads, pairs, prefix[0] + nq))
    for (int i = 0; i < pairs; i++) {
        const int b = i / kv_heads, h = i % kv_heads;
        const long qo = ((long)b * kv_heads + h) * rows * dim, ko = b * batch_stride + h * head_stride;
        hs_attend_head_of(q + qo, keys + ko, values + ko, key_stride, rows, (int)prefix[b], nq,
                          see + (long)b * nq * nq, sinks ? sinks + (long)h * (rows / nq) : NULL, scale, out + qo,
                          scores + omp_get_thread_num() * scores_stride, dim);
    }
    return 1;
}

/* hs_decode_attention for rows of separate caches (the one-row caches of concurrent calls: a pass's steps in one
   call): row b's layer of keys at address key_rows[b] (values: value_rows[b]), its KV heads head_strides[b] floats
   apart. First each row's nq new keys and values (new_keys, new_values: [batch, kv_heads, nq, head_dim] contiguous)
   go to its slots prefix[b] .. prefix[b] + nq - 1. */
HS_TARGET static int hs_decode_attention_rows(const float *q, const float *new_keys, const float *new_values,
                                              const int64_t *key_rows, const int64_t *value_rows,
                                              const int64_t *head_strides, float *out, float *scores,
                                              long scores_stride, int batch, int kv_heads, int rows, int dim, int nq,
                                              const int64_t *prefix, const uint8_t *see, const float *sinks,
                                              long key_stride, float scale, int threads) {
    if (dim != 16 && dim != 32 && dim != 64 && dim != 128) return 0;
    for (int b = 0; b < batch; b++) {
        float *keys = (float *)(uintptr_t)key_rows[b], *values = (float *)(uintptr_t)value_rows[b];
        for (int h = 0; h < kv_heads; h++)
            for (int j = 0; j < nq; j++) {
                const long to = h * head_strides[b] + (prefix[b] + j) * key_stride;
                const long from = (((long)b * kv_heads + h) * nq + j) * dim;
                memcpy(keys + to, new_keys + from, sizeof(float) * dim);
                memcpy(values + to, new_values + from, sizeof(float) * dim);
            }
    }
    const int pairs = batch * kv_heads;
    #pragma omp parallel for schedule(static) num_threads(HS_ATTENTION_THREADS(threads, pairs, prefix[0] + nq))
    for (int i = 0; i < pairs; i++) {
        const int b = i / kv_heads, h = i % kv_heads;
        const float *keys = (const float *)(uintptr_t)key_rows[b], *values = (const float *)(uintptr_t)value_rows[b];
        const long qo = ((long)b * kv_heads + h) * rows * dim, ko = h * head_strides[b];
        hs_attend_head_of(q + qo, keys + ko, values + ko, key_stride, rows, (int)prefix[b], nq,
                          see + (long)b * nq * nq, sinks ? sinks + (long)h * (rows / nq) : NULL, scale, out + qo,
                          scores + omp_get_thread_num() * scores_stride, dim);
    }
    return 1;
}

/* Attention of a prompt chunk: nq consecutive queries at positions start .. start + nq - 1, query i seeing keys
   [0, start + i]. Flash attention on tiles of 16 queries: a tile holds the 16 queries of every head that shares the
   KV head, transposed so that one vector is one head's 16 queries (the running maximum, sum and causal mask of 16
   rows are then one vector each, with no reduction across lanes), and runs over blocks of PF_KEYS keys, reading each
   key and value once per tile. A tile stops at its last query's keys: no work above the causal diagonal but its own
   corner (PyTorch's CPU flash attention computes whole 512-key blocks there: for a 512-token chunk's own keys, twice
   the work).

   Layout: q and out [batch, kv_heads, group * nq, head_dim] contiguous, row g * nq + i is query i of head g of the KV
   head; keys and values as in hs_decode_attention, the chunk's own keys already at start .. start + nq - 1; sinks as
   there. window (a sliding-window layer; 0: none, else at least PF_QUERIES): query i sees only the keys of its last
   `window` positions, start + i - window + 1 .. start + i; a tile starts at its first query's first key. */
#define PF_QUERIES 16
#define PF_KEYS 128

/* s[j][v] (v: a head's 16 queries) for the block's keys j0 .. j0 + 7 (keys past kb: the last one's, ignored), heads
   v0 .. v0 + RV - 1; qt [dim][width], s [PF_KEYS][width]. The sums over the head dimension in registers. */
HS_TARGET HS_INLINE void hs_pf_scores(const float *qt, int width, const float *k, long key_stride, int kb, float *s,
                                      int v0, const int rv, const int dim) {
    for (int j0 = 0; j0 < kb; j0 += 8) {
        __m512 acc[8][3];
        const float *key[8];
        for (int i = 0; i < 8; i++) {
            key[i] = k + (long)(j0 + i < kb ? j0 + i : kb - 1) * key_stride;
            for (int w = 0; w < rv; w++) acc[i][w] = _mm512_setzero_ps();
        }
        for (int d = 0; d < dim; d++) {
            __m512 qv[3];
            for (int w = 0; w < rv; w++) qv[w] = _mm512_loadu_ps(qt + (long)d * width + 16 * (v0 + w));
            for (int i = 0; i < 8; i++) {
                const __m512 kd = _mm512_set1_ps(key[i][d]);
                for (int w = 0; w < rv; w++) acc[i][w] = _mm512_fmadd_ps(kd, qv[w], acc[i][w]);
            }
        }
        for (int i = 0; i < 8; i++)
            for (int w = 0; w < rv; w++) _mm512_storeu_ps(s + (long)(j0 + i) * width + 16 * (v0 + w), acc[i][w]);
    }
}

/* ot [dim][width] += the values of the block's kb keys weighted by p [PF_KEYS][width], heads v0 .. v0 + RV - 1 */
HS_TARGET HS_INLINE void hs_pf_values(const float *p, int width, const float *v, long key_stride, int kb, float *ot,
                                      int v0, const int rv, const int dim) {
    for (int d0 = 0; d0 < dim; d0 += 8) {
        __m512 acc[8][3];
        for (int e = 0; e < 8; e++)
            for (int w = 0; w < rv; w++) acc[e][w] = _mm512_loadu_ps(ot + (long)(d0 + e) * width + 16 * (v0 + w));
        for (int j = 0; j < kb; j++) {
            const float *vj = v + (long)j * key_stride + d0;
            __m512 pv[3];
            for (int w = 0; w < rv; w++) pv[w] = _mm512_loadu_ps(p + (long)j * width + 16 * (v0 + w));
            for (int e = 0; e < 8; e++) {
                const __m512 x = _mm512_set1_ps(vj[e]);
                for (int w = 0; w < rv; w++) acc[e][w] = _mm512_fmadd_ps(x, pv[w], acc[e][w]);
            }
        }
        for (int e = 0; e < 8; e++)
            for (int w = 0; w < rv; w++) _mm512_storeu_ps(ot + (long)(d0 + e) * width + 16 * (v0 + w), acc[e][w]);
    }
}

#define HS_PF_HEADS(CALL)                                                                                           \
    for (int v0 = 0; v0 < group; v0 += 3) {                                                                         \
        const int rv = group - v0 < 3 ? group - v0 : 3;                                                             \
        if (rv == 3) CALL(3) else if (rv == 2) CALL(2) else CALL(1)                                                 \
    }

/* One tile: queries i0 .. i0 + tq - 1 of every head of the KV head (q and out: the KV head's first query head, its
   heads qh / oh and positions qp / op floats apart). scratch: width * (2 * dim + PF_KEYS + 2) floats */
HS_TARGET HS_INLINE void hs_prefill_tile(const float *q, long qh, long qp, const float *k, const float *v,
                                         long key_stride, int group, int start, int i0, int tq, const float *sinks,
                                         int window, float scale, float *out, long oh, long op, float *scratch,
                                         const int dim) {
    const int width = 16 * group, n = start + i0 + tq;  /* the tile's keys: up to its last query's */
    /* from its first query's first key: with a window of at least 16 keys every query of the tile sees one of the
       first block's, so from the first block on each running maximum is finite */
    const int first = window && start + i0 - window + 1 > 0 ? start + i0 - window + 1 : 0;
    float *qt = scratch, *s = qt + (long)dim * width, *ot = s + (long)PF_KEYS * width;
    float *row_max = ot + (long)dim * width, *row_sum = row_max + width;
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int g = 0; g < group; g++)
        for (int l = 0; l < 16; l++) {
            const float *qr = q + g * qh + (i0 + (l < tq ? l : 0)) * qp;
            for (int d = 0; d < dim; d++) qt[(long)d * width + 16 * g + l] = l < tq ? qr[d] * scale : 0.0f;
        }
    /* a sink is a key of score sinks[g] with no value: the running sums start from it */
    for (int x = 0; x < width; x++) row_max[x] = sinks ? sinks[x / 16] : -INFINITY, row_sum[x] = sinks ? 1.0f : 0.0f;
    memset(ot, 0, sizeof(float) * dim * width);
    for (int b0 = first; b0 < n; b0 += PF_KEYS) {
        const int kb = n - b0 < PF_KEYS ? n - b0 : PF_KEYS;
        const float *kblock = k + (long)b0 * key_stride, *vblock = v + (long)b0 * key_stride;
#define HS_PF_SCORES(RV) hs_pf_scores(qt, width, kblock, key_stride, kb, s, v0, RV, dim);
        HS_PF_HEADS(HS_PF_SCORES)
        /* the causal corner: query i0 + l sees key b0 + j when l >= b0 + j - start - i0 */
        for (int j = start + i0 - b0 > 0 ? start + i0 - b0 : 0; j < kb; j++) {
            const __mmask16 hidden = _mm512_cmplt_epi32_mask(lanes, _mm512_set1_epi32(b0 + j - start - i0));
            for (int g = 0; g < group; g++)
                _mm512_mask_storeu_ps(s + (long)j * width + 16 * g, hidden, neg_inf);
        }
        /* the window's far edge: query i0 + l no longer sees key b0 + j when l >= b0 + j - start - i0 + window */
        for (int j = 0; window && j < kb && b0 + j - start - i0 + window < 16; j++) {
            const __mmask16 hidden = _mm512_cmpge_epi32_mask(lanes, _mm512_set1_epi32(b0 + j - start - i0 + window));
            for (int g = 0; g < group; g++)
                _mm512_mask_storeu_ps(s + (long)j * width + 16 * g, hidden, neg_inf);
        }
        for (int g = 0; g < group; g++) {  /* the running maximum and sum, per query: one vector per head */
            __m512 block_max = neg_inf;
            for (int j = 0; j < kb; j++)
                block_max = _mm512_max_ps(block_max, _mm512_loadu_ps(s + (long)j * width + 16 * g));
            /* finite from the first block on (see first; a sink's from the start) */
            const __m512 old_max = _mm512_loadu_ps(row_max + 16 * g), new_max = _mm512_max_ps(old_max, block_max);
            const __m512 shrink = hs_exp_nonpositive(_mm512_sub_ps(old_max, new_max));  /* ~0 before the first */
            __m512 total = _mm512_setzero_ps();
            for (int j = 0; j < kb; j++) {
                const __m512 x = _mm512_loadu_ps(s + (long)j * width + 16 * g);
                const __mmask16 live = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
                const __m512 e = _mm512_maskz_mov_ps(live, hs_exp_nonpositive(_mm512_sub_ps(x, new_max)));
                _mm512_storeu_ps(s + (long)j * width + 16 * g, e);
                total = _mm512_add_ps(total, e);
            }
            _mm512_storeu_ps(row_sum + 16 * g, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + 16 * g), shrink, total));
            _mm512_storeu_ps(row_max + 16 * g, new_max);
            for (int d = 0; d < dim; d++)
                _mm512_storeu_ps(ot + (long)d * width + 16 * g,
                                 _mm512_mul_ps(shrink, _mm512_loadu_ps(ot + (long)d * width + 16 * g)));
        }
#define HS_PF_VALUES(RV) hs_pf_values(s, width, vblock, key_stride, kb, ot, v0, RV, dim);
        HS_PF_HEADS(HS_PF_VALUES)
    }
    for (int g = 0; g < group; g++)
        for (int l = 0; l < tq; l++) {
            const float inverse = 1.0f / row_sum[16 * g + l];
            float *dst = out + g * oh + (i0 + l) * op;
            for (int d = 0; d < dim; d++) dst[d] = ot[(long)d * width + 16 * g + l] * inverse;
        }
}

/* Tiles tile_begin, tile_begin + tile_step, ... below tile_end of batch x kv_heads x ceil(nq / PF_QUERIES), in that
   order (threads take every tile_step-th: later tiles see more keys, so a contiguous share would not be a fair one).
   q and out: [batch, heads, nq, dim] at any strides (qs, os: batch, head, position, in floats; dim contiguous).
   scratch: at least 16 * group * (2 * head_dim + PF_KEYS + 2) floats. 0 when head_dim is not 16, 32, 64 or 128
   (nothing computed). */
HS_TARGET static int hs_prefill_attention(const float *q, const long *qs, const float *keys, const float *values,
                                          float *out, const long *os, float *scratch, int kv_heads, int group, int nq,
                                          int dim, int start, int tile_begin, int tile_end, int tile_step,
                                          const float *sinks, int window, long batch_stride, long head_stride,
                                          long key_stride, float scale) {
    if (dim != 16 && dim != 32 && dim != 64 && dim != 128) return 0;
    const int tiles = (nq + PF_QUERIES - 1) / PF_QUERIES;
    for (int t = tile_begin; t < tile_end; t += tile_step) {
        const int b = t / (kv_heads * tiles), h = t / tiles % kv_heads, i0 = t % tiles * PF_QUERIES;
        const int tq = nq - i0 < PF_QUERIES ? nq - i0 : PF_QUERIES;
        const long ko = b * batch_stride + h * head_stride, head = (long)h * group;
#define HS_PF_TILE(DIM) \
    hs_prefill_tile(q + b * qs[0] + head * qs[1], qs[1], qs[2], keys + ko, values + ko, key_stride, group, start, \
                    i0, tq, sinks ? sinks + head : NULL, window, scale, out + b * os[0] + head * os[1], os[1], os[2], \
                    scratch, DIM)
        switch (dim) {  /* a constant head_dim: the loops over it unroll */
            case 16: HS_PF_TILE(16); break;
            case 32: HS_PF_TILE(32); break;
            case 64: HS_PF_TILE(64); break;
            default: HS_PF_TILE(128); break;
        }
    }
    return 1;
}

/* hs_prefill_attention's tiles (`tiles`: batch x kv_heads x ceil(nq / PF_QUERIES)) dealt over `threads` OpenMP
   threads, thread t taking every threads-th from t, in its scratch + t * scratch_stride. OpenMP, not threads of the
   caller's: the extension shares torch's libgomp, so the threads that just ran a product take the tiles up at once
   (a thread of another pool would wait for the core that a product's thread still spins on). */
HS_TARGET static int hs_prefill_attention_threads(const float *q, const long *qs, const float *keys,
                                                  const float *values, float *out, const long *os, float *scratch,
                                                  long scratch_stride, int kv_heads, int group, int nq, int dim,
                                                  int start, int tiles, const float *sinks, int window,
                                                  long batch_stride, long head_stride, long key_stride, float scale,
                                                  int threads) {
    if (dim != 16 && dim != 32 && dim != 64 && dim != 128) return 0;
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        hs_prefill_attention(q, qs, keys, values, out, os, scratch + t * scratch_stride, kv_heads, group, nq, dim,
                             start, t, tiles, n, sinks, window, batch_stride, head_stride, key_stride, scale);
    }
    return 1;
}
