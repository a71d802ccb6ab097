/* The product of a few rows by a weight on a CPU: y = x @ w.T (+ bias) (+ residual) for 1 to HS_PRODUCT_MAX_ROWS
   rows of x, float32, what every linear layer of a decode or verification step computes; the same for a mixture of
   experts' chosen experts in one call. The kernels built on it: `head_kernel.h` (the greedy step's int8 output
   layer), `moe_kernel.h` (mixtures of experts), `norm_kernel.h` (RMSNorm and RoPE).

   Why not oneDNN's or MKL's: with so few rows a step only streams the weight from memory, and on an AMD EPYC (Zen 4)
   their kernels read it well below the memory's speed for one or two rows (`benchmarks/bench_verify_cost.py
   --products` times all three by row count). Here a block of output rows is read once, for all input rows together: each (input row, output row)
   pair keeps one vector of partial sums in a register while the weight rows stream past, and the blocks are dealt
   over OpenMP threads (torch's own runtime: the extension shares its libgomp).

   Exactness: every output is computed alone, in an order that depends on neither the number of input rows nor the
   block it falls in: 16 partial sums over k in steps of 16 (the tail masked), added across in one fixed order, then
   the bias, then the residual. So a token's logits are bitwise the same whether it is decoded alone or verified among
   a draft's tokens, and greedy speculation cannot flip a near-tie that plain decoding would not.

   The weight in float32, or where all its values are bfloat16 or float16 values (a bfloat16 checkpoint loaded into
   float32), in that format (`format`): half the bytes to stream, each vector widened to float32 in registers, which
   is exact, so the same sums of the same float32 values in the same order: the same bits in every format.

   Layout: x [rows, k] with row stride x_stride; w [n, k] contiguous; bias [n] or NULL; residual [rows, n] with row
   stride y_stride, or NULL; y [rows, n], row stride y_stride. */
#ifndef HS_PRODUCT_KERNEL_H
#define HS_PRODUCT_KERNEL_H
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HS_PRODUCT_MAX_ROWS 8
/* the weight's formats (`format`), and its bytes a value */
#define HS_WEIGHT_F32 0
#define HS_WEIGHT_BF16 1
#define HS_WEIGHT_F16 2
#define HS_WEIGHT_BYTES(format) ((format) == HS_WEIGHT_F32 ? 4 : 2)
#define HS_PRODUCT_TARGET __attribute__((target("avx512f")))
#define HS_PRODUCT_INLINE static inline __attribute__((always_inline))

static int hs_product_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* A block is 8 weight rows (enough independent sums to hide the FMA's latency, and streams to keep the memory busy)
   by the input rows, 3 at a time (24 sums, with the inputs and a weight vector, in the 32 registers). Up to 3 input
   rows go through the weight rows once; more take them a chunk of k at a time, every group of 3 rows over the chunk
   while it is in the L1 cache (the sums wait in memory between chunks), so the weight streams from memory once and
   its arithmetic overlaps the streaming. The order of every output's additions is the same either way.
   While a block streams, each of its loads asks for the same place in the next block into L2: one core's misses
   alone are too few to keep the memory busy, more so while a group of rows works through a chunk (on a 5th-gen.
   Xeon a greedy SmolLM2 pass over 5 or 7 draft tokens ran 1.2-1.5x faster, `benchmarks/bench_verify_cost.py`). */
#define HS_PRODUCT_BLOCK 8
#define HS_PRODUCT_GROUP 3
#define HS_PRODUCT_CHUNK 256

/* 16 weight values from element i as float32 (exact in every format) */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE __m512 hs_weight_vector(const void *w, long i, const int format) {
    if (format == HS_WEIGHT_F32) return _mm512_loadu_ps((const float *)w + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    if (format == HS_WEIGHT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* the first `count` (1 to 15) of them, zeros after (AVX-512F has no masked 16-bit load) */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE __m512 hs_weight_tail(const void *w, long i, int count, const int format) {
    if (format == HS_WEIGHT_F32) return _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1u), (const float *)w + i);
    uint16_t part[16] = {0};
    memcpy(part, (const uint16_t *)w + i, 2 * (size_t)count);
    return hs_weight_vector(part, 0, format);
}

/* acc[m][r] += x[m] . w[r] over k in [j0, j1) for M input rows and R weight rows (lanes past k: masked, adding exact
   zeros), the sums in registers while it runs */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_span(__m512 (*acc)[HS_PRODUCT_BLOCK], const float *x,
                                                         long x_stride, const void *wb, int k, int j0, int j1,
                                                         const int M, const int R, const int format) {
    __m512 a[HS_PRODUCT_GROUP][HS_PRODUCT_BLOCK];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) a[m][r] = acc[m][r];
    const long bytes = HS_WEIGHT_BYTES(format);
    int j = j0;
    for (; j + 16 <= j1; j += 16) {
        __m512 xs[HS_PRODUCT_GROUP];
        for (int m = 0; m < M; m++) xs[m] = _mm512_loadu_ps(x + m * x_stride + j);
        for (int r = 0; r < R; r++) {
            __m512 wv = hs_weight_vector(wb, (long)r * k + j, format);
            if (bytes == 4 || (j & 31) == 0)  /* the next block's, into L2: a line a prefetch */
                _mm_prefetch((const char *)wb + ((long)(R + r) * k + j) * bytes, _MM_HINT_T1);
            for (int m = 0; m < M; m++) a[m][r] = _mm512_fmadd_ps(wv, xs[m], a[m][r]);
        }
    }
    if (j < j1) {
        __mmask16 tail = (__mmask16)((1u << (j1 - j)) - 1u);
        for (int r = 0; r < R; r++) {
            __m512 wv = hs_weight_tail(wb, (long)r * k + j, j1 - j, format);
            for (int m = 0; m < M; m++)
                a[m][r] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * x_stride + j), a[m][r]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = a[m][r];
}

/* outputs [n0, n0 + R) of `rows` input rows (1 to HS_PRODUCT_MAX_ROWS) */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_rows(const float *x, long x_stride, const void *w, int k, float *y,
                                                         long y_stride, const float *bias, const float *residual,
                                                         int n0, int rows, const int R, const int format) {
    __m512 acc[HS_PRODUCT_MAX_ROWS][HS_PRODUCT_BLOCK];
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    const char *wb = (const char *)w + (long)n0 * k * HS_WEIGHT_BYTES(format);
    int chunk = rows <= HS_PRODUCT_GROUP ? k : HS_PRODUCT_CHUNK;
    for (int j0 = 0; j0 < k; j0 += chunk) {
        int j1 = j0 + chunk < k ? j0 + chunk : k;
        for (int m0 = 0; m0 < rows; m0 += HS_PRODUCT_GROUP) {
            const float *xg = x + m0 * x_stride;
            switch (rows - m0 < HS_PRODUCT_GROUP ? rows - m0 : HS_PRODUCT_GROUP) {
                case 1: hs_product_span(acc + m0, xg, x_stride, wb, k, j0, j1, 1, R, format); break;
                case 2: hs_product_span(acc + m0, xg, x_stride, wb, k, j0, j1, 2, R, format); break;
                default: hs_product_span(acc + m0, xg, x_stride, wb, k, j0, j1, 3, R, format); break;
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < R; r++) {
            float v = _mm512_reduce_add_ps(acc[m][r]);
            if (bias) v += bias[n0 + r];
            if (residual) v += residual[m * y_stride + n0 + r];
            y[m * y_stride + n0 + r] = v;
        }
}

/* the outputs of block b: 8 output rows, or past the last whole block, the remaining ones one by one; of any number of
   input rows, HS_PRODUCT_MAX_ROWS at a time */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_block(const float *x, long x_stride, const void *w, int n, int k,
                                                          float *y, long y_stride, const float *bias,
                                                          const float *residual, int rows, int b, const int format) {
    for (int m0 = 0; m0 < rows; m0 += HS_PRODUCT_MAX_ROWS) {
        int m = rows - m0 < HS_PRODUCT_MAX_ROWS ? rows - m0 : HS_PRODUCT_MAX_ROWS;
        const float *xm = x + m0 * x_stride, *rm = residual ? residual + m0 * y_stride : 0;
        float *ym = y + m0 * y_stride;
        if ((b + 1) * HS_PRODUCT_BLOCK <= n) {
            hs_product_rows(xm, x_stride, w, k, ym, y_stride, bias, rm, b * HS_PRODUCT_BLOCK, m, HS_PRODUCT_BLOCK,
                            format);
            continue;
        }
        for (int n0 = b * HS_PRODUCT_BLOCK; n0 < n; n0++)
            hs_product_rows(xm, x_stride, w, k, ym, y_stride, bias, rm, n0, m, 1, format);
    }
}

/* the same, the weight's format a constant in each copy (its loads inlined; the switch runs once a block) */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_part(const float *x, long x_stride, const void *w, int n, int k,
                                                         float *y, long y_stride, const float *bias,
                                                         const float *residual, int rows, int b, int format) {
    switch (format) {
        case HS_WEIGHT_BF16:
            hs_product_block(x, x_stride, w, n, k, y, y_stride, bias, residual, rows, b, HS_WEIGHT_BF16);
            break;
        case HS_WEIGHT_F16:
            hs_product_block(x, x_stride, w, n, k, y, y_stride, bias, residual, rows, b, HS_WEIGHT_F16);
            break;
        default:
            hs_product_block(x, x_stride, w, n, k, y, y_stride, bias, residual, rows, b, HS_WEIGHT_F32);
    }
}

#define HS_PRODUCT_PARTS(n) (((n) + HS_PRODUCT_BLOCK - 1) / HS_PRODUCT_BLOCK)
/* a product too small to be worth waking the other threads runs on the calling one */
#define HS_PRODUCT_THREADS(threads, bytes) ((bytes) < 262144 ? 1 : (threads))

HS_PRODUCT_TARGET static int hs_small_product(const float *x, long x_stride, const void *w, int n, int k,
                                              const float *bias, const float *residual, float *y, long y_stride,
                                              int rows, int format, int threads) {
    if (rows < 1 || rows > HS_PRODUCT_MAX_ROWS || format < HS_WEIGHT_F32 || format > HS_WEIGHT_F16) return 0;
    int parts = HS_PRODUCT_PARTS(n);
    #pragma omp parallel for schedule(static) num_threads(HS_PRODUCT_THREADS(threads, HS_WEIGHT_BYTES(format) * (long)n * k))
    for (int b = 0; b < parts; b++) hs_product_part(x, x_stride, w, n, k, y, y_stride, bias, residual, rows, b, format);
    return 1;
}

/* The products of a mixture of experts' chosen experts, all in one call: segment s is rows [starts[s], starts[s] +
   counts[s]) of x and y (the token rows routed to one expert, gathered), multiplied by expert experts[s]'s weight,
   the n x k values from w's experts[s] * n * k-th (its bias, bias + experts[s] * n). Each output as
   `hs_small_product` computes it. */
HS_PRODUCT_TARGET static void hs_expert_products(const float *x, long x_stride, const void *w, const float *bias,
                                                 int n, int k, const int64_t *experts, const int64_t *starts,
                                                 const int64_t *counts, int segments, float *y, long y_stride,
                                                 int format, int threads) {
    int parts = HS_PRODUCT_PARTS(n);
    #pragma omp parallel for schedule(static) \
        num_threads(HS_PRODUCT_THREADS(threads, HS_WEIGHT_BYTES(format) * (long)segments * n * k))
    for (long i = 0; i < (long)segments * parts; i++) {
        long s = i / parts, e = experts[s];
        hs_product_part(x + starts[s] * x_stride, x_stride, (const char *)w + e * n * k * HS_WEIGHT_BYTES(format), n,
                        k, y + starts[s] * y_stride, y_stride, bias ? bias + e * n : 0, 0, (int)counts[s],
                        (int)(i % parts), format);
    }
}

#endif
