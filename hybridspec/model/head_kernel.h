#ifndef HS_HEAD_KERNEL_H
#define HS_HEAD_KERNEL_H
#include "product_kernel.h"

/* An argmax-only output layer's first guess (`GreedyHead`): y[m][i] = scales[i] * (x[m] . q[i]) for 1 to
   HS_PRODUCT_MAX_ROWS rows of x, q the layer's weight rounded to int8 per row (row i times scales[i] is the weight's
   row; q [n, q_stride], zero from k to q_stride, a multiple of 16). A decode step reads every weight once and a large
   vocabulary's output layer is a quarter to a half of a small model's bytes: int8 reads a quarter of float32's. Each
   int8 vector widens to float32 in registers, once for every input row; the sums run in float32 as in
   `hs_product_span` (the caller bounds their error, so their order does not matter). */
#define HS_INT8_GROUP 4

#define HS_INT8_VECTOR(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))

/* y[m][n0 + r] = scales[n0 + r] * (x[m] . q[n0 + r]) for M input rows and R int8 weight rows */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_int8_span(const float *x, long x_stride, const int8_t *q, long q_stride,
                                                      const float *scales, int k, float *y, long y_stride, int n0,
                                                      const int M, const int R) {
    __m512 a[HS_INT8_GROUP][HS_PRODUCT_BLOCK];
    const int8_t *qb = q + (long)n0 * q_stride;
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) a[m][r] = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= k; j += 16) {
        __m512 xs[HS_INT8_GROUP];
        for (int m = 0; m < M; m++) xs[m] = _mm512_loadu_ps(x + m * x_stride + j);
        for (int r = 0; r < R; r++) {
            __m512 wv = HS_INT8_VECTOR(qb + r * q_stride + j);
            if ((j & 63) == 0) _mm_prefetch((const char *)(qb + (R + r) * q_stride + j), _MM_HINT_T1);
            for (int m = 0; m < M; m++) a[m][r] = _mm512_fmadd_ps(wv, xs[m], a[m][r]);
        }
    }
    if (j < k) {  /* x's tail masked; q's row is zero past k */
        __mmask16 tail = (__mmask16)((1u << (k - j)) - 1u);
        for (int r = 0; r < R; r++) {
            __m512 wv = HS_INT8_VECTOR(qb + r * q_stride + j);
            for (int m = 0; m < M; m++)
                a[m][r] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * x_stride + j), a[m][r]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) y[m * y_stride + n0 + r] = scales[n0 + r] * _mm512_reduce_add_ps(a[m][r]);
}

/* outputs [n0, n0 + R) (R = 8, or 1 past the last whole block) of `rows` rows, up to 4 rows at a time (4 rows by 4
   weight rows, or up to 3 by 8: at most 24 sums in registers); a block's weight rows stay in L1 between groups */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_int8_rows(const float *x, long x_stride, const int8_t *q, long q_stride,
                                                      const float *scales, int k, float *y, long y_stride, int n0,
                                                      int rows, const int R) {
    for (int m0 = 0; m0 < rows; m0 += HS_INT8_GROUP) {
        const float *xg = x + m0 * x_stride;
        float *yg = y + m0 * y_stride;
        int M = rows - m0 < HS_INT8_GROUP ? rows - m0 : HS_INT8_GROUP;
        if (R == 1) {
            switch (M) {
                case 1: hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 1, 1); break;
                case 2: hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 2, 1); break;
                case 3: hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 3, 1); break;
                default: hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 4, 1); break;
            }
            continue;
        }
        switch (M) {
            case 1: hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 1, HS_PRODUCT_BLOCK); break;
            case 2: hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 2, HS_PRODUCT_BLOCK); break;
            case 3: hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 3, HS_PRODUCT_BLOCK); break;
            default:
                hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0, 4, HS_PRODUCT_BLOCK / 2);
                hs_int8_span(xg, x_stride, q, q_stride, scales, k, yg, y_stride, n0 + HS_PRODUCT_BLOCK / 2, 4,
                             HS_PRODUCT_BLOCK / 2);
                break;
        }
    }
}

HS_PRODUCT_TARGET static int hs_int8_product(const float *x, long x_stride, const int8_t *q, long q_stride,
                                             const float *scales, int n, int k, float *y, long y_stride, int rows,
                                             int threads) {
    if (rows < 1 || rows > HS_PRODUCT_MAX_ROWS || q_stride % 16 || q_stride < k) return 0;
    int parts = HS_PRODUCT_PARTS(n);
    #pragma omp parallel for schedule(static) num_threads(HS_PRODUCT_THREADS(threads, (long)n * k))
    for (int b = 0; b < parts; b++) {
        if ((b + 1) * HS_PRODUCT_BLOCK <= n) {
            hs_int8_rows(x, x_stride, q, q_stride, scales, k, y, y_stride, b * HS_PRODUCT_BLOCK, rows,
                         HS_PRODUCT_BLOCK);
        } else {
            for (int n0 = b * HS_PRODUCT_BLOCK; n0 < n; n0++)
                hs_int8_rows(x, x_stride, q, q_stride, scales, k, y, y_stride, n0, rows, 1);
        }
    }
    return 1;
}

/* The int8 guess made exact where it matters (`GreedyHead`): for each row m, with |x[m]| its norm and e_i = |x[m]|
   bounds[i] + slack the bound of |y[m][i] - x[m] . w[i]|, every i whose y[m][i] + e_i reaches max_j (y[m][j] - e_j)
   could be the row's float32 maximum, and gets its float32 logit x[m] . w[i] (w [n, k] float32); the others cannot
   be, and keep their guess. -inf (a grammar's masked token) stays. Returns the logits recomputed. */
HS_PRODUCT_TARGET static long hs_head_recheck(const float *x, long x_stride, const float *w, int n, int k,
                                              const float *bounds, float slack, float *y, long y_stride, int rows) {
    long recomputed = 0;
    for (int m = 0; m < rows; m++) {
        const float *xm = x + m * x_stride;
        float *ym = y + m * y_stride;
        double sq = 0;
        for (int j = 0; j < k; j++) sq += (double)xm[j] * xm[j];
        float hn = (float)sqrt(sq) * (1 + 1e-6f);
        __m512 norm = _mm512_set1_ps(hn), pad = _mm512_set1_ps(slack), lower = _mm512_set1_ps(-INFINITY);
        int i = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 e = _mm512_fmadd_ps(norm, _mm512_loadu_ps(bounds + i), pad);
            lower = _mm512_max_ps(lower, _mm512_sub_ps(_mm512_loadu_ps(ym + i), e));
        }
        float low = _mm512_reduce_max_ps(lower);
        for (; i < n; i++) {
            float v = ym[i] - (hn * bounds[i] + slack);
            if (v > low) low = v;
        }
        for (i = 0; i < n; i++) {
            float v = ym[i];
            if (v == -INFINITY || v + hn * bounds[i] + slack < low) continue;
            __m512 acc = _mm512_setzero_ps();
            const float *wi = w + (long)i * k;
            int j = 0;
            for (; j + 16 <= k; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xm + j), _mm512_loadu_ps(wi + j), acc);
            if (j < k) {
                __mmask16 tail = (__mmask16)((1u << (k - j)) - 1u);
                acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, xm + j), _mm512_maskz_loadu_ps(tail, wi + j), acc);
            }
            ym[i] = _mm512_reduce_add_ps(acc);
            recomputed++;
        }
    }
    return recomputed;
}

#endif
