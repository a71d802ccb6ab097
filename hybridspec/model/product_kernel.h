/* The product of a few rows by a weight on a CPU: y = x @ w.T (+ bias) (+ residual) for 1 to HS_PRODUCT_MAX_ROWS
   rows of x, float32, what every linear layer of a decode or verification step computes.

   Why not oneDNN's or MKL's: with so few rows a step only streams the weight from memory, and their kernels read it
   at 60-80% of the memory's speed on an AMD EPYC (Zen 4) for one row (`benchmarks/bench_products.py`). Here a block of
   output rows is read once, for all input rows together: each (input row, output row) pair keeps one vector of
   partial sums in a register while the weight rows stream past, and the blocks are dealt over OpenMP threads (torch's
   own runtime: the extension shares its libgomp).

   Exactness: every output is computed alone, in an order that depends on neither the number of input rows nor the
   block it falls in: 16 partial sums over k in steps of 16 (the tail masked), added across in one fixed order, then
   the bias, then the residual. So a token's logits are bitwise the same whether it is decoded alone or verified among
   a draft's tokens, and greedy speculation cannot flip a near-tie that plain decoding would not.

   Layout: x [rows, k] with row stride x_stride; w [n, k] contiguous; bias [n] or NULL; residual [rows, n] with row
   stride y_stride, or NULL; y [rows, n], row stride y_stride. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define HS_PRODUCT_MAX_ROWS 8
#define HS_PRODUCT_TARGET __attribute__((target("avx512f")))
#define HS_PRODUCT_INLINE static inline __attribute__((always_inline))

static int hs_product_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* A block is 8 weight rows (enough independent sums to hide the FMA's latency, and streams to keep the memory busy)
   by up to 3 input rows (24 sums, with the inputs and a weight vector, in the 32 registers); more input rows take the
   block again, 3 at a time, from the cache. */
#define HS_PRODUCT_BLOCK 8
#define HS_PRODUCT_GROUP 3

/* outputs [n0, n0 + R) of all M input rows: R x M vectors of partial sums in registers */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_block(const float *x, long x_stride, const float *w, int k,
                                                          float *y, long y_stride, const float *bias,
                                                          const float *residual, int n0, const int M, const int R) {
    __m512 acc[HS_PRODUCT_GROUP][HS_PRODUCT_BLOCK];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    const float *wb = w + (long)n0 * k;
    int j = 0;
    for (; j + 16 <= k; j += 16) {
        __m512 xs[HS_PRODUCT_GROUP];
        for (int m = 0; m < M; m++) xs[m] = _mm512_loadu_ps(x + m * x_stride + j);
        for (int r = 0; r < R; r++) {
            __m512 wv = _mm512_loadu_ps(wb + (long)r * k + j);
            for (int m = 0; m < M; m++) acc[m][r] = _mm512_fmadd_ps(wv, xs[m], acc[m][r]);
        }
    }
    if (j < k) {  /* the tail: lanes past k load zeros and add exact zeros */
        __mmask16 tail = (__mmask16)((1u << (k - j)) - 1u);
        for (int r = 0; r < R; r++) {
            __m512 wv = _mm512_maskz_loadu_ps(tail, wb + (long)r * k + j);
            for (int m = 0; m < M; m++)
                acc[m][r] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * x_stride + j), acc[m][r]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            float v = _mm512_reduce_add_ps(acc[m][r]);
            if (bias) v += bias[n0 + r];
            if (residual) v += residual[m * y_stride + n0 + r];
            y[m * y_stride + n0 + r] = v;
        }
}

/* outputs [n0, n0 + R) of `rows` input rows (any count), HS_PRODUCT_GROUP at a time */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_rows(const float *x, long x_stride, const float *w, int k, float *y,
                                                         long y_stride, const float *bias, const float *residual,
                                                         int n0, int rows, const int R) {
    for (int m0 = 0; m0 < rows; m0 += HS_PRODUCT_GROUP) {
        const float *xg = x + m0 * x_stride, *rg = residual ? residual + m0 * y_stride : 0;
        float *yg = y + m0 * y_stride;
        switch (rows - m0 < HS_PRODUCT_GROUP ? rows - m0 : HS_PRODUCT_GROUP) {
            case 1: hs_product_block(xg, x_stride, w, k, yg, y_stride, bias, rg, n0, 1, R); break;
            case 2: hs_product_block(xg, x_stride, w, k, yg, y_stride, bias, rg, n0, 2, R); break;
            default: hs_product_block(xg, x_stride, w, k, yg, y_stride, bias, rg, n0, 3, R); break;
        }
    }
}

/* the outputs of block b: 8 output rows, or past the last whole block, the remaining ones one by one */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_part(const float *x, long x_stride, const float *w, int n, int k,
                                                         float *y, long y_stride, const float *bias,
                                                         const float *residual, int rows, int b) {
    if ((b + 1) * HS_PRODUCT_BLOCK <= n) {
        hs_product_rows(x, x_stride, w, k, y, y_stride, bias, residual, b * HS_PRODUCT_BLOCK, rows, HS_PRODUCT_BLOCK);
        return;
    }
    for (int n0 = b * HS_PRODUCT_BLOCK; n0 < n; n0++)
        hs_product_rows(x, x_stride, w, k, y, y_stride, bias, residual, n0, rows, 1);
}

#define HS_PRODUCT_PARTS(n) (((n) + HS_PRODUCT_BLOCK - 1) / HS_PRODUCT_BLOCK)
/* a product too small to be worth waking the other threads runs on the calling one */
#define HS_PRODUCT_THREADS(threads, bytes) ((bytes) < 262144 ? 1 : (threads))

HS_PRODUCT_TARGET static int hs_small_product(const float *x, long x_stride, const float *w, int n, int k,
                                              const float *bias, const float *residual, float *y, long y_stride,
                                              int rows, int threads) {
    if (rows < 1 || rows > HS_PRODUCT_MAX_ROWS) return 0;
    int parts = HS_PRODUCT_PARTS(n);
    #pragma omp parallel for schedule(static) num_threads(HS_PRODUCT_THREADS(threads, 4L * n * k))
    for (int b = 0; b < parts; b++) hs_product_part(x, x_stride, w, n, k, y, y_stride, bias, residual, rows, b);
    return 1;
}

/* The products of a mixture of experts' chosen experts, all in one call: segment s is rows [starts[s], starts[s] +
   counts[s]) of x and y (the token rows routed to one expert, gathered), multiplied by expert experts[s]'s weight,
   w + experts[s] * n * k (its bias, bias + experts[s] * n). Each output as `hs_small_product` computes it. */
HS_PRODUCT_TARGET static void hs_expert_products(const float *x, long x_stride, const float *w, const float *bias,
                                                 int n, int k, const int64_t *experts, const int64_t *starts,
                                                 const int64_t *counts, int segments, float *y, long y_stride,
                                                 int threads) {
    int parts = HS_PRODUCT_PARTS(n);
    #pragma omp parallel for schedule(static) num_threads(HS_PRODUCT_THREADS(threads, 4L * segments * n * k))
    for (long i = 0; i < (long)segments * parts; i++) {
        long s = i / parts, e = experts[s];
        hs_product_part(x + starts[s] * x_stride, x_stride, w + e * n * k, n, k, y + starts[s] * y_stride, y_stride,
                        bias ? bias + e * n : 0, 0, (int)counts[s], (int)(i % parts));
    }
}
