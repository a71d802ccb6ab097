#ifndef HS_MOE_KERNEL_H
#define HS_MOE_KERNEL_H
#include "product_kernel.h"
#include "norm_kernel.h"  /* HS_NORM_THREADED_ELEMENTS */

/* A mixture of experts on a CPU (`hybridspec.model.layers`): a prompt chunk's expert products on packed panels
   (`hs_grouped_products`), a gated MLP's activation (`hs_gated_rows`), the weighted sum in expert order
   (`hs_expert_sums`), and a step's few tokens in one call (`hs_moe_step`). */

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
   [E, hidden, units], both in `format` (as `hs_small_product` takes a weight); biases [E, ...] or NULL; residual
   [tokens, hidden] or NULL. Returns 0, or -1 where memory ran out. */
HS_PRODUCT_TARGET static int hs_moe_step(const float *x, long x_stride, int tokens, int top_k, const int64_t *chosen,
                                         const float *weights, int num_experts, const void *gate_up,
                                         const float *gate_up_bias, const void *down, const float *down_bias,
                                         int format, int units, int hidden, int act, float alpha, float limit,
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
                       gate_ups, 2 * units, format, threads);
    hs_gated_rows(gate_ups, 2 * units, (int)pairs, units, act, alpha, limit, acts, threads);
    hs_expert_products(acts, units, down, down_bias, hidden, units, experts, starts, counts, segments, products,
                       hidden, format, threads);
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

#endif
