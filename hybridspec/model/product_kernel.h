/* The product of a few rows by a weight on a CPU: y = x @ w.T (+ bias) (+ residual) for 1 to HS_PRODUCT_MAX_ROWS
   rows of x, float32, what every linear layer of a decode or verification step computes; the same for a mixture of
   experts' chosen experts in one call; a prompt chunk's expert products on packed weights (`hs_grouped_products`);
   and the RMSNorm of a step's rows (at the end of this file).

   Why not oneDNN's or MKL's: with so few rows a step only streams the weight from memory, and on an AMD EPYC (Zen 4)
   their kernels read it well below the memory's speed for one or two rows (`benchmarks/bench_verify_cost.py
   --products` times all three by row count). Here a block of output rows is read once, for all input rows together: each (input row, output row)
   pair keeps one vector of partial sums in a register while the weight rows stream past, and the blocks are dealt
   over OpenMP threads (torch's own runtime: the extension shares its libgomp).

   Exactness: every output is computed alone, in an order that depends on neither the number of input rows nor the
   block it falls in: 16 partial sums over k in steps of 16 (the tail masked), added across in one fixed order, then
   the bias, then the residual. So a token's logits are bitwise the same whether it is decoded alone or verified among
   a draft's tokens, and greedy speculation cannot flip a near-tie that plain decoding would not.

   Layout: x [rows, k] with row stride x_stride; w [n, k] contiguous; bias [n] or NULL; residual [rows, n] with row
   stride y_stride, or NULL; y [rows, n], row stride y_stride. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HS_PRODUCT_MAX_ROWS 8
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

/* acc[m][r] += x[m] . w[r] over k in [j0, j1) for M input rows and R weight rows (lanes past k: masked, adding exact
   zeros), the sums in registers while it runs */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_span(__m512 (*acc)[HS_PRODUCT_BLOCK], const float *x,
                                                         long x_stride, const float *wb, int k, int j0, int j1,
                                                         const int M, const int R) {
    __m512 a[HS_PRODUCT_GROUP][HS_PRODUCT_BLOCK];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) a[m][r] = acc[m][r];
    int j = j0;
    for (; j + 16 <= j1; j += 16) {
        __m512 xs[HS_PRODUCT_GROUP];
        for (int m = 0; m < M; m++) xs[m] = _mm512_loadu_ps(x + m * x_stride + j);
        for (int r = 0; r < R; r++) {
            __m512 wv = _mm512_loadu_ps(wb + (long)r * k + j);
            _mm_prefetch((const char *)(wb + (long)(R + r) * k + j), _MM_HINT_T1);  /* the next block's, into L2 */
            for (int m = 0; m < M; m++) a[m][r] = _mm512_fmadd_ps(wv, xs[m], a[m][r]);
        }
    }
    if (j < j1) {
        __mmask16 tail = (__mmask16)((1u << (j1 - j)) - 1u);
        for (int r = 0; r < R; r++) {
            __m512 wv = _mm512_maskz_loadu_ps(tail, wb + (long)r * k + j);
            for (int m = 0; m < M; m++)
                a[m][r] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * x_stride + j), a[m][r]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = a[m][r];
}

/* outputs [n0, n0 + R) of `rows` input rows (1 to HS_PRODUCT_MAX_ROWS) */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_rows(const float *x, long x_stride, const float *w, int k, float *y,
                                                         long y_stride, const float *bias, const float *residual,
                                                         int n0, int rows, const int R) {
    __m512 acc[HS_PRODUCT_MAX_ROWS][HS_PRODUCT_BLOCK];
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    const float *wb = w + (long)n0 * k;
    int chunk = rows <= HS_PRODUCT_GROUP ? k : HS_PRODUCT_CHUNK;
    for (int j0 = 0; j0 < k; j0 += chunk) {
        int j1 = j0 + chunk < k ? j0 + chunk : k;
        for (int m0 = 0; m0 < rows; m0 += HS_PRODUCT_GROUP) {
            const float *xg = x + m0 * x_stride;
            switch (rows - m0 < HS_PRODUCT_GROUP ? rows - m0 : HS_PRODUCT_GROUP) {
                case 1: hs_product_span(acc + m0, xg, x_stride, wb, k, j0, j1, 1, R); break;
                case 2: hs_product_span(acc + m0, xg, x_stride, wb, k, j0, j1, 2, R); break;
                default: hs_product_span(acc + m0, xg, x_stride, wb, k, j0, j1, 3, R); break;
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
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_product_part(const float *x, long x_stride, const float *w, int n, int k,
                                                         float *y, long y_stride, const float *bias,
                                                         const float *residual, int rows, int b) {
    for (int m0 = 0; m0 < rows; m0 += HS_PRODUCT_MAX_ROWS) {
        int m = rows - m0 < HS_PRODUCT_MAX_ROWS ? rows - m0 : HS_PRODUCT_MAX_ROWS;
        const float *xm = x + m0 * x_stride, *rm = residual ? residual + m0 * y_stride : 0;
        float *ym = y + m0 * y_stride;
        if ((b + 1) * HS_PRODUCT_BLOCK <= n) {
            hs_product_rows(xm, x_stride, w, k, ym, y_stride, bias, rm, b * HS_PRODUCT_BLOCK, m, HS_PRODUCT_BLOCK);
            continue;
        }
        for (int n0 = b * HS_PRODUCT_BLOCK; n0 < n; n0++)
            hs_product_rows(xm, x_stride, w, k, ym, y_stride, bias, rm, n0, m, 1);
    }
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
        __m512 norm = _mm512_set1_ps((float)sqrt(sq) * (1 + 1e-6f)), pad = _mm512_set1_ps(slack);
        __m512 lower = _mm512_set1_ps(-INFINITY);
        int i = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 e = _mm512_fmadd_ps(norm, _mm512_loadu_ps(bounds + i), pad);
            lower = _mm512_max_ps(lower, _mm512_sub_ps(_mm512_loadu_ps(ym + i), e));
        }
        float low = _mm512_reduce_max_ps(lower);
        float hn = (float)sqrt(sq) * (1 + 1e-6f);
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

/* A mixture of experts' products for a prompt chunk (hundreds of (token, expert) pairs, tens a chosen expert): there
   each expert's weight is read by many rows, so the work is arithmetic, not streaming, and wants the FMA units full.
   The weight of each expert is packed once into panels of 32 output columns, [k][32] each (`pack_panels` layout:
   panels[e][t][j][c] = w[e][32 t + c][j], zero past n), so that a tile of up to 8 input rows by one panel keeps its
   8 x 32 sums in 16 registers while the panel streams past: per k, two panel vectors and a broadcast of each row's
   input feed 16 FMAs. The panels are taken a slice of k at a time and a group of them together (`hs_panel_blocking`):
   each tile of the expert's rows runs through the group's slices (in L2) while its own inputs' slice stays in L1, so
   an input row is read once per group of panels rather than once per panel (where a router sends most of a chunk's
   tokens to a few experts, their rows are megabytes); the next slices are fetched into L2 meanwhile, the sums wait in
   y between slices. Each output is one chain of FMAs in k's order, whatever the slices, so the same bits for any
   number of rows and on any CPU.

   Gated experts: the gate_up weight packed with panel t's first 16 columns gate units [16 t, 16 t + 16) and its last
   16 the same up units, so the tile that finishes them applies the activation to both halves and stores 16 hidden
   units: the hidden rows are written once, no pass of their own. */
#define HS_PANEL 32
#define HS_PANEL_ROWS 8
#define HS_PANEL_GROUP_MAX 8
#define HS_GATED_UNITS 16
enum { HS_ACT_NONE = 0, HS_ACT_SILU = 1, HS_ACT_CLAMPED_SWIGLU = 2 };

/* The slice of k and the panels a group takes, from this CPU's caches: a slice as deep as an 8-row tile's inputs
   keep within L1 (all of k where it fits, else equal slices), as many panels as their slices keep within three
   quarters of L2 (at most HS_PANEL_GROUP_MAX). Deep slices store and reload the sums less often: on an AMD EPYC
   (Zen 5: L1 48 KiB, L2 1 MiB) all of k = 1024 in groups of 6 ran the MoE layers of a prompt chunk about 8% faster
   than slices of 256 in groups of 8 (`benchmarks/bench_moe_block.py`); on a Zen 4 (L1 32 KiB, L2 1 MiB), where the
   inputs of all of k fill L1, vLLM's fused MoE took 0.97x our time with slices of 512 (three quarters of L1) and
   1.03x / 1.06x (Qwen3-MoE / gpt-oss) with all of k. */
static void hs_panel_blocking(int k, int *depth, int *group) {
    static long l1, l2;  /* asked once (the same answer on every thread) */
    if (!l1) {
        long one = sysconf(_SC_LEVEL1_DCACHE_SIZE), two = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = two > 0 ? two : 1 << 20;
        l1 = one > 0 ? one : 32768;
    }
    long most = l1 / (HS_PANEL_ROWS * (long)sizeof(float)) / 16 * 16;
    if (most < 64) most = 64;
    long slices = (k + most - 1) / most;
    *depth = (int)(((k + slices - 1) / slices + 15) / 16 * 16);
    long panels = (l2 * 3 / 4) / ((long)*depth * HS_PANEL * (long)sizeof(float));
    *group = (int)(panels < 1 ? 1 : panels > HS_PANEL_GROUP_MAX ? HS_PANEL_GROUP_MAX : panels);
}

/* e^x within 2 ulp over float32's range (Cephes' polynomial on x - n ln 2, then scaled by 2^n) */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE __m512 hs_exp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.37626f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* a gated expert's hidden units from its gate and up sums: silu(gate) * up, or gpt-oss's clamped form
   (up + 1) * (gate * sigmoid(gate * alpha)) with gate <= limit and |up| <= limit */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE __m512 hs_gated(__m512 gate, __m512 up, int act, float alpha, float limit) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (act == HS_ACT_SILU)
        return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(one, hs_exp(_mm512_sub_ps(_mm512_setzero_ps(), gate)))),
                             up);
    gate = _mm512_min_ps(gate, _mm512_set1_ps(limit));
    up = _mm512_max_ps(_mm512_min_ps(up, _mm512_set1_ps(limit)), _mm512_set1_ps(-limit));
    __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, hs_exp(_mm512_mul_ps(gate, _mm512_set1_ps(-alpha)))));
    return _mm512_mul_ps(_mm512_add_ps(up, one), _mm512_mul_ps(gate, sigmoid));
}

/* ys[m][c] (+)= xs[m][j0:j1] . column c of the panel's rows [j0, j1), for the tile's M rows and its first `cols`
   columns: the sums start from zero at j0 = 0 and from ys after. At j1 = k they become (sum + bias[c]) * scales[m]
   (bias, scales NULL where there are none), or with an activation its first `units` (of 16) hidden units into hs[m].
   `ahead`: a slice to fetch into L2 meanwhile, or NULL. */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_panel_tile(const float *const *xs, const float *panel, int j0, int j1,
                                                       int k, const float *bias, const float *scales,
                                                       float *const *ys, int cols, const float *ahead, int act,
                                                       float alpha, float limit, float *const *hs, int units,
                                                       const int M) {
    __mmask16 mask_lo = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1u);
    __mmask16 mask_hi = cols >= 32 ? (__mmask16)0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1u) : 0;
    __m512 lo[HS_PANEL_ROWS], hi[HS_PANEL_ROWS];
    for (int m = 0; m < M; m++) {
        lo[m] = j0 ? _mm512_maskz_loadu_ps(mask_lo, ys[m]) : _mm512_setzero_ps();
        hi[m] = j0 ? _mm512_maskz_loadu_ps(mask_hi, ys[m] + 16) : _mm512_setzero_ps();
    }
    for (int j = j0; j < j1; j++) {
        __m512 b0 = _mm512_loadu_ps(panel + (long)j * HS_PANEL), b1 = _mm512_loadu_ps(panel + (long)j * HS_PANEL + 16);
        if (ahead) {
            _mm_prefetch((const char *)(ahead + (long)(j - j0) * HS_PANEL), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + (long)(j - j0) * HS_PANEL + 16), _MM_HINT_T1);
        }
        for (int m = 0; m < M; m++) {
            __m512 a = _mm512_set1_ps(xs[m][j]);
            lo[m] = _mm512_fmadd_ps(a, b0, lo[m]);
            hi[m] = _mm512_fmadd_ps(a, b1, hi[m]);
        }
    }
    if (j1 < k) {
        for (int m = 0; m < M; m++) {
            _mm512_mask_storeu_ps(ys[m], mask_lo, lo[m]);
            _mm512_mask_storeu_ps(ys[m] + 16, mask_hi, hi[m]);
        }
        return;
    }
    __m512 bias_lo = bias ? _mm512_maskz_loadu_ps(mask_lo, bias) : _mm512_setzero_ps();
    __m512 bias_hi = bias ? _mm512_maskz_loadu_ps(mask_hi, bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++) {
        __m512 v0 = _mm512_add_ps(lo[m], bias_lo), v1 = _mm512_add_ps(hi[m], bias_hi);
        if (act) {
            _mm512_mask_storeu_ps(hs[m], (__mmask16)((1u << units) - 1u), hs_gated(v0, v1, act, alpha, limit));
            continue;
        }
        if (scales) {
            v0 = _mm512_mul_ps(v0, _mm512_set1_ps(scales[m]));
            v1 = _mm512_mul_ps(v1, _mm512_set1_ps(scales[m]));
        }
        _mm512_mask_storeu_ps(ys[m], mask_lo, v0);
        _mm512_mask_storeu_ps(ys[m] + 16, mask_hi, v1);
    }
}

/* Panels [t0, t1) of expert e for the pairs [begin, end): y and h as `hs_grouped_products` says. Per slice of k, each
   tile of rows runs through every panel of the group while its inputs' slice is in L1 (the group's panel slices wait in
   L2): an input row is read once per group, not once per panel. */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE void hs_grouped_panels(const float *x, long x_stride, const int64_t *x_rows,
                                                           const float *panels, const float *bias, int n, int k,
                                                           long t0, long t1, long begin, long end,
                                                           const float *scales, float *y, long y_stride, int act,
                                                           float alpha, float limit, float *h, long h_stride,
                                                           int depth) {
    int width = act ? HS_GATED_UNITS : HS_PANEL;
    for (int j0 = 0; j0 < k; j0 += depth) {
        int j1 = j0 + depth < k ? j0 + depth : k;
        for (long p0 = begin; p0 < end; p0 += HS_PANEL_ROWS) {
            int M = (int)(end - p0 < HS_PANEL_ROWS ? end - p0 : HS_PANEL_ROWS);
            const float *xs[HS_PANEL_ROWS];
            for (int m = 0; m < M; m++)
                xs[m] = x + (x_rows ? x_rows[p0 + m] : p0 + m) * x_stride;
            const float *sc = scales ? scales + p0 : 0;
            for (long t = t0; t < t1; t++) {
                const float *panel = panels + t * (long)k * HS_PANEL;
                const float *b = bias ? bias + t * HS_PANEL : 0;
                int left = n - (int)t * width;
                int cols = act ? HS_PANEL : left < HS_PANEL ? left : HS_PANEL;
                /* hidden units past n: computed on the padding's zero columns, not stored */
                int units = act ? (left < HS_GATED_UNITS ? left : HS_GATED_UNITS) : 0;
                float *ys[HS_PANEL_ROWS], *hs[HS_PANEL_ROWS];
                for (int m = 0; m < M; m++) {
                    ys[m] = y + (p0 + m) * y_stride + t * HS_PANEL;
                    hs[m] = act ? h + (p0 + m) * h_stride + t * HS_GATED_UNITS : 0;
                }
                /* the first tile of a slice fetches the next slice of its panel (the next panel after the last) */
                const float *ahead = p0 == begin ? panel + (long)j1 * HS_PANEL : 0;
                #define HS_TILE(M_) hs_panel_tile(xs, panel, j0, j1, k, b, sc, ys, cols, ahead, act, alpha, limit, \
                                                  hs, units, M_)
                switch (M) {
                    case 1: HS_TILE(1); break;
                    case 2: HS_TILE(2); break;
                    case 3: HS_TILE(3); break;
                    case 4: HS_TILE(4); break;
                    case 5: HS_TILE(5); break;
                    case 6: HS_TILE(6); break;
                    case 7: HS_TILE(7); break;
                    default: HS_TILE(8); break;
                }
                #undef HS_TILE
            }
        }
    }
}

/* Segment s: pairs [starts[s], starts[s] + counts[s]) by expert experts[s]: y row p = (x row x_rows[p] (p where
   x_rows is NULL) @ w[experts[s]].T + its bias) * scales[p] (where scales is not NULL), w given as its panels, its
   n outputs as y's columns. With an activation (act not HS_ACT_NONE), w the gated packing of gate_up for n hidden
   units: y holds the sums between slices (32 columns a panel) and h row p, row stride h_stride, the hidden units.
   Slices `depth` deep, groups of `group` panels (either 0: this CPU's, `hs_panel_blocking`). Dealt over threads by
   (segment, group of panels), as they come free (an equal share of the rows
   each, in that order, was no faster). */
HS_PRODUCT_TARGET static void hs_grouped_products(const float *x, long x_stride, const int64_t *x_rows,
                                                  const float *panels, const float *bias, int n, int k,
                                                  const int64_t *experts, const int64_t *starts,
                                                  const int64_t *counts, int segments, const float *scales, float *y,
                                                  long y_stride, int act, float alpha, float limit, float *h,
                                                  long h_stride, int depth, int group, int threads) {
    long tiles = (n + (act ? HS_GATED_UNITS : HS_PANEL) - 1) / (act ? HS_GATED_UNITS : HS_PANEL);
    if (depth <= 0 || group <= 0) hs_panel_blocking(k, &depth, &group);
    long groups = (tiles + group - 1) / group;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long i = 0; i < segments * groups; i++) {
        long s = i / groups, t0 = i % groups * group, e = experts[s];
        long t1 = t0 + group < tiles ? t0 + group : tiles;
        const float *b = !bias ? 0 : act ? bias + e * tiles * HS_PANEL : bias + e * n;
        hs_grouped_panels(x, x_stride, x_rows, panels + e * tiles * (long)k * HS_PANEL, b, n, k, t0, t1, starts[s],
                          starts[s] + counts[s], scales, y, y_stride, act, alpha, limit, h, h_stride, depth);
    }
}

/* 1 / sqrt(mean(x^2) + eps) of dim floats */
HS_PRODUCT_TARGET HS_PRODUCT_INLINE __m512 hs_inverse_rms(const float *x, int dim, float eps) {
    __m512 squares = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= dim; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    if (j < dim) {
        __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (dim - j)) - 1u), x + j);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    return _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
}

/* RMSNorm of `rows` rows of dim floats into y [rows, dim]: y[r] = (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) *
   w[r % period], each row alone. The rows come in groups of `period` consecutive ones, group g at x + g * group_stride
   (a token's query and key heads in its row of the QKV product: w then holds the query norm for each query head,
   then the key norm for each key head); period 1: rows at that stride. A layer's norms in a call each, where torch's
   composite norm costs ~40 us a call; a prompt chunk's rows dealt over the threads (a row's bits do not depend on
   which thread computes it), a step's few rows on the calling thread alone. */
#define HS_NORM_THREADED_ELEMENTS (1 << 16)
HS_PRODUCT_TARGET static void hs_rms_norm(const float *x, long group_stride, const float *w, int period, float eps,
                                          float *y, int rows, int dim, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && (long)rows * dim >= HS_NORM_THREADED_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (r / period) * group_stride + (long)(r % period) * dim;
        const float *wr = w + (long)(r % period) * dim;
        float *yr = y + (long)r * dim;
        __m512 scale = hs_inverse_rms(xr, dim, eps);
        int j = 0;
        for (; j + 16 <= dim; j += 16)
            _mm512_storeu_ps(yr + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + j), scale),
                                                   _mm512_loadu_ps(wr + j)));
        if (j < dim) {
            __mmask16 tail = (__mmask16)((1u << (dim - j)) - 1u);
            _mm512_mask_storeu_ps(yr + j, tail, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + j), scale),
                                                              _mm512_maskz_loadu_ps(tail, wr + j)));
        }
    }
}

/* A layer's queries and keys positioned: x as hs_rms_norm's rows (a token's period heads of dim floats, tokens
   group_stride apart), each head normed as there where w is not NULL (Qwen3's and Gemma's per-head norms), then
   rotated by RoPE, its dimensions in pairs (`interleave_rotary_pairs`): pair i of token t's heads times rope[t][i], a
   complex number stored (cos, sin), into y [rows, dim]. One pass over the heads where the norm and torch's complex
   product took three; (a, b) (c, s) = (a c - b s, a s + b c) as one fused multiply-add of each part. */
HS_PRODUCT_TARGET static void hs_norm_rotate(const float *x, long group_stride, const float *w, int period, float eps,
                                             const float *rope, float *y, int rows, int dim, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && (long)rows * dim >= HS_NORM_THREADED_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (r / period) * group_stride + (long)(r % period) * dim;
        const float *wr = w ? w + (long)(r % period) * dim : 0;
        const float *turn = rope + (long)(r / period) * dim;
        float *yr = y + (long)r * dim;
        __m512 scale = wr ? hs_inverse_rms(xr, dim, eps) : _mm512_set1_ps(1.0f);
        for (int j = 0; j < dim; j += 16) {
            __mmask16 m = (__mmask16)(dim - j >= 16 ? 0xFFFFu : (1u << (dim - j)) - 1u);
            __m512 v = _mm512_maskz_loadu_ps(m, xr + j), t = _mm512_maskz_loadu_ps(m, turn + j);
            if (wr)
                v = _mm512_mul_ps(_mm512_mul_ps(v, scale), _mm512_maskz_loadu_ps(m, wr + j));
            __m512 swapped = _mm512_permute_ps(v, 0xB1);  /* (b, a) of each pair */
            __m512 rotated = _mm512_fmaddsub_ps(v, _mm512_moveldup_ps(t),
                                                _mm512_mul_ps(swapped, _mm512_movehdup_ps(t)));
            _mm512_mask_storeu_ps(yr + j, m, rotated);
        }
    }
}

/* out[r][j] = hs_gated(gate_up[r][j], gate_up[r][n + j]): a gated MLP's hidden units from its gate_up product, rows
   `stride` apart, in one pass (torch: the activation's output, then the product), and the same bits as the panel
   kernel's gated tiles give (a prompt chunk's experts), so a step's few tokens agree with a chunk's */
HS_PRODUCT_TARGET static void hs_gated_rows(const float *gate_up, long stride, int rows, int n, int act, float alpha,
                                            float limit, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && (long)rows * n >= HS_NORM_THREADED_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (long)r * stride, *u = g + n;
        float *o = out + (long)r * n;
        for (int j = 0; j < n; j += 16) {
            __mmask16 m = (__mmask16)(n - j >= 16 ? 0xFFFFu : (1u << (n - j)) - 1u);
            _mm512_mask_storeu_ps(o + j, m, hs_gated(_mm512_maskz_loadu_ps(m, g + j), _mm512_maskz_loadu_ps(m, u + j),
                                                     act, alpha, limit));
        }
    }
}

/* A mixture of experts' weighted sum per token: out[t] = residual[t] + (products[q0] + products[q1] + ...), q the
   rows of token t's top_k pairs among the products, added in ascending row order: with the rows grouped by expert
   (order[p]: the pair t * top_k + j of row p, experts ascending) that is expert order, the bits of torch's
   zeros(...).index_add_(0, order // top_k, products) then + residual, with a token's rows read once (index_add_ runs
   on one thread and writes every pair's sum back) and the residual in the same pass. residual NULL: the sum alone. */
#define HS_EXPERT_SUM_MAX_K 64
HS_PRODUCT_TARGET static int hs_expert_sums(const float *products, long stride, const int64_t *order, int tokens,
                                            int top_k, int dim, const float *residual, float *out, int threads) {
    long pairs = (long)tokens * top_k;
    int64_t *row_of = (int64_t *)malloc(sizeof(int64_t) * (pairs > 0 ? pairs : 1));
    if (!row_of) return -1;
    for (long p = 0; p < pairs; p++) row_of[order[p]] = p;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && pairs * dim >= HS_NORM_THREADED_ELEMENTS)
    for (int t = 0; t < tokens; t++) {
        int64_t q[HS_EXPERT_SUM_MAX_K];
        for (int j = 0; j < top_k; j++) {  /* insertion sort: top_k is a handful */
            int64_t v = row_of[(long)t * top_k + j];
            int i = j;
            for (; i > 0 && q[i - 1] > v; i--) q[i] = q[i - 1];
            q[i] = v;
        }
        float *o = out + (long)t * dim;
        const float *res = residual ? residual + (long)t * dim : NULL;
        for (int c = 0; c < dim; c += 16) {
            __mmask16 m = (__mmask16)(dim - c >= 16 ? 0xFFFFu : (1u << (dim - c)) - 1u);
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < top_k; j++) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, products + q[j] * stride + c));
            if (res) acc = _mm512_add_ps(_mm512_maskz_loadu_ps(m, res + c), acc);
            _mm512_mask_storeu_ps(o + c, m, acc);
        }
    }
    free(row_of);
    return 0;
}

/* A few tokens' mixture of experts in one call (a decode step, a verification's draft): the (token, expert) pairs of
   chosen [tokens, top_k] grouped by expert (stable: within an expert in pair order), each pair's token row gathered,
   gate_up of every chosen expert (`hs_expert_products`), its activation (`hs_gated_rows`), down, each pair's row
   times its router weight, then each token's sum in expert order plus the residual (`hs_expert_sums`). The kernels of
   the products one call at a time, in the same order, so the same bits; what it saves is a dozen small tensor
   operations a layer. chosen in [0, num_experts); gate_up [E, 2 units, hidden] (gate rows, then up rows) and down
   [E, hidden, units], biases [E, ...] or NULL; residual [tokens, hidden] or NULL. Returns 0, or -1 where memory ran
   out. */
HS_PRODUCT_TARGET static int hs_moe_step(const float *x, long x_stride, int tokens, int top_k, const int64_t *chosen,
                                         const float *weights, int num_experts, const float *gate_up,
                                         const float *gate_up_bias, const float *down, const float *down_bias,
                                         int units, int hidden, int act, float alpha, float limit,
                                         const float *residual, float *out, int threads) {
    long pairs = (long)tokens * top_k;
    if (pairs < 1) return 0;
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * 4 * pairs);
    float *rows = (float *)malloc(sizeof(float) * pairs * (2 * (size_t)hidden + 3 * (size_t)units));
    if (!order || !rows) {
        free(order);
        free(rows);
        return -1;
    }
    int64_t *experts = order + pairs, *starts = experts + pairs, *counts = starts + pairs;
    int64_t *next = (int64_t *)calloc((size_t)num_experts, sizeof(int64_t));  /* a stable counting sort by expert */
    if (!next) {
        free(order);
        free(rows);
        return -1;
    }
    for (long p = 0; p < pairs; p++) next[chosen[p]]++;
    int segments = 0;
    for (long e = 0, begin = 0; e < num_experts; e++) {
        long count = next[e];
        if (count) {
            experts[segments] = e;
            starts[segments] = begin;
            counts[segments++] = count;
        }
        next[e] = begin;
        begin += count;
    }
    for (long p = 0; p < pairs; p++) order[next[chosen[p]]++] = p;
    free(next);
    float *gate_ups = rows + pairs * hidden, *acts = gate_ups + pairs * 2 * units, *products = acts + pairs * units;
    for (long p = 0; p < pairs; p++)
        memcpy(rows + p * hidden, x + (order[p] / top_k) * x_stride, sizeof(float) * hidden);
    hs_expert_products(rows, hidden, gate_up, gate_up_bias, 2 * units, hidden, experts, starts, counts, segments,
                       gate_ups, 2 * units, threads);
    hs_gated_rows(gate_ups, 2 * units, (int)pairs, units, act, alpha, limit, acts, threads);
    hs_expert_products(acts, units, down, down_bias, hidden, units, experts, starts, counts, segments, products,
                       hidden, threads);
    for (long p = 0; p < pairs; p++) {
        __m512 w = _mm512_set1_ps(weights[order[p]]);
        float *row = products + p * hidden;
        for (int c = 0; c < hidden; c += 16) {
            __mmask16 m = (__mmask16)(hidden - c >= 16 ? 0xFFFFu : (1u << (hidden - c)) - 1u);
            _mm512_mask_storeu_ps(row + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + c), w));
        }
    }
    int done = hs_expert_sums(products, hidden, order, tokens, top_k, hidden, residual, out, threads);
    free(rows);
    free(order);
    return done;
}
