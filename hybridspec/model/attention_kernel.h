/* Attention of a decode or verification step on a CPU: a few query rows per KV head over a long KV cache.

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
   head_dim: 16, 32, 64 or 128. */
#include <immintrin.h>
#include <math.h>
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
                                        int prefix, int nq, const uint8_t *see, float scale, float *out,
                                        float *scores, const int chunks) {
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
        const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
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
        const __m512 inverse = _mm512_set1_ps(1.0f / lanes[0]);
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

#define HS_HEADS(CHUNKS)                                                                                            \
    for (int b = 0; b < batch; b++)                                                                                 \
        for (int h = 0; h < kv_heads; h++) {                                                                        \
            long qo = ((long)b * kv_heads + h) * rows * 16 * CHUNKS, ko = b * batch_stride + h * head_stride;       \
            hs_attend_head(q + qo, keys + ko, values + ko, key_stride, rows, (int)prefix[b], nq,                    \
                           see + (long)b * nq * nq, scale, out + qo, scores, CHUNKS);                               \
        }

/* Every batch row and KV head of one layer; 0 when head_dim is not 16, 32, 64 or 128 (nothing computed). scores:
   at least rows x (max prefix + nq + 15) floats. */
HS_TARGET static int hs_decode_attention(const float *q, const float *keys, const float *values, float *out,
                                         float *scores, int batch, int kv_heads, int rows, int dim, int nq,
                                         const int64_t *prefix, const uint8_t *see, long batch_stride,
                                         long head_stride, long key_stride, float scale) {
    switch (dim) {
        case 16: HS_HEADS(1) return 1;
        case 32: HS_HEADS(2) return 1;
        case 64: HS_HEADS(4) return 1;
        case 128: HS_HEADS(8) return 1;
        default: return 0;
    }
}
