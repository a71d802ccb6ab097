# cython: language_level=3, boundscheck=False, wraparound=False
"""The small-row product kernel of linear layers on a CPU (`product_kernel.h`; the int8 greedy head, the mixtures of
experts and the norms built on it: `head_kernel.h`, `moe_kernel.h`, `norm_kernel.h`) and the gated delta rule's step
(`delta_kernel.h`), on raw pointers of tensors the caller checked (`hybridspec.model.linear`,
`hybridspec.model.kv_cache`): a thin layer, the GIL released while they run."""
from libc.stdint cimport int64_t, uintptr_t


cdef extern from "product_kernel.h" nogil:
    int hs_small_product(const float *x, long x_stride, const void *w, int n, int k, const float *bias,
                         const float *residual, float *y, long y_stride, int rows, int format, int threads)
    int HS_PRODUCT_MAX_ROWS
    int HS_WEIGHT_F32, HS_WEIGHT_BF16, HS_WEIGHT_F16
    int hs_product_supported()

cdef extern from "head_kernel.h" nogil:
    int hs_int8_product(const float *x, long x_stride, const signed char *q, long q_stride, const float *scales,
                        int n, int k, float *y, long y_stride, int rows, int threads)
    long hs_head_recheck(const float *x, long x_stride, const float *w, int n, int k, const float *bounds,
                         float slack, float *y, long y_stride, int rows)

cdef extern from "norm_kernel.h" nogil:
    void hs_rms_norm(const float *x, long group_stride, const float *w, int period, float eps, float *y, int rows,
                     int dim, int threads)
    void hs_norm_rotate(const float *x, long group_stride, const float *w, int period, float eps, const float *rope,
                        float *y, int rows, int dim, int threads)

cdef extern from "amx_kernel.h" nogil:
    int hs_amx_supported()
    void hs_amx_pack(const float *w, int n, int k, unsigned short *p)
    int hs_amx_product(const float *x, long x_stride, int m, const unsigned short *p, int n, int k, const float *bias,
                       const float *residual, float *y, long y_stride, int threads)
    int HS_AMX_ALIGN

cdef extern from "moe_kernel.h" nogil:
    void hs_grouped_products(const float *x, long x_stride, const int64_t *x_rows, const float *panels,
                             const float *bias, int n, int k, const int64_t *experts, const int64_t *starts,
                             const int64_t *counts, int segments, const float *scales, float *y, long y_stride,
                             int act, float alpha, float limit, float *h, long h_stride, int depth, int group,
                             int threads)
    void hs_gated_rows(const float *gate_up, long stride, int rows, int n, int act, float alpha, float limit,
                       float *out, int threads)
    int hs_expert_sums(const float *products, long stride, const int64_t *order, int tokens, int top_k, int dim,
                       const float *residual, float *out, int threads)
    int hs_moe_step(const float *x, long x_stride, int tokens, int top_k, const int64_t *chosen, const float *weights,
                    int num_experts, const void *gate_up, const float *gate_up_bias, const void *down,
                    const float *down_bias, int format, int units, int hidden, int act, float alpha, float limit,
                    const float *residual, float *out, int threads)
    int HS_EXPERT_SUM_MAX_K
    int HS_PANEL
    int HS_GATED_UNITS

cdef extern from "omp.h" nogil:
    ctypedef enum omp_pause_resource_t:
        omp_pause_soft
    int omp_pause_resource_all(omp_pause_resource_t kind)

MAX_ROWS = HS_PRODUCT_MAX_ROWS
# a weight's formats: float32, or values that are all bfloat16 / float16 ones kept in that format (`compact_weights`)
WEIGHT_F32, WEIGHT_BF16, WEIGHT_F16 = HS_WEIGHT_F32, HS_WEIGHT_BF16, HS_WEIGHT_F16
EXPERT_SUM_MAX_K = HS_EXPERT_SUM_MAX_K  # the most experts a token that `expert_sums` takes
PANEL = HS_PANEL  # output columns of a packed panel (`grouped_products`)
GATED_UNITS = HS_GATED_UNITS  # hidden units of a gated panel: its gate columns, then their up columns


def supported() -> bool:
    """Whether this CPU runs the kernel (AVX-512F)."""
    return bool(hs_product_supported())


AMX_ALIGN = HS_AMX_ALIGN  # n and k of an AMX product: multiples of it


def amx_supported() -> bool:
    """Whether this CPU has AMX-BF16 and Linux lets this process use its tiles (`amx_product`)."""
    return bool(hs_amx_supported())


def amx_pack(uintptr_t w, int n, int k, uintptr_t p) -> None:
    """w [n, k] float32 of bfloat16 values into p (n * k 16-bit values) as `amx_product` reads it."""
    with nogil:
        hs_amx_pack(<const float *>w, n, k, <unsigned short *>p)


def amx_product(uintptr_t x, long x_stride, int m, uintptr_t p, int n, int k, uintptr_t bias, uintptr_t residual,
                uintptr_t y, long y_stride, int threads) -> None:
    """y [m, n] = x [m, k] @ w.T (+ bias where nonzero) (+ residual [m, n] where nonzero) in float32, w packed by
    `amx_pack`, on AMX tiles (`hs_amx_product`: x as three bfloat16 pieces, float32 sums)."""
    cdef int done
    with nogil:
        done = hs_amx_product(<const float *>x, x_stride, m, <const unsigned short *>p, n, k, <const float *>bias,
                              <const float *>residual, <float *>y, y_stride, threads)
    if done != 0:
        raise ValueError(f"amx_product: n {n} and k {k} must be multiples of {HS_AMX_ALIGN} (or no memory)")


def release_threads() -> bool:
    """End the calling thread's idle OpenMP team (its worker threads; a later parallel region of that thread starts
    a new one). False where it is inside a parallel region."""
    cdef int done
    with nogil:
        done = omp_pause_resource_all(omp_pause_soft)
    return done == 0


def small_product(uintptr_t x, long x_stride, uintptr_t w, int n, int k, uintptr_t bias, uintptr_t residual,
                  uintptr_t y, long y_stride, int rows, int format, int threads) -> None:
    """y [rows, n] = x [rows, k] @ w [n, k].T (+ bias where nonzero) (+ residual [rows, n] where nonzero), w in
    `format` (WEIGHT_F32, WEIGHT_BF16, WEIGHT_F16)."""
    cdef int done
    with nogil:
        done = hs_small_product(<const float *>x, x_stride, <const void *>w, n, k, <const float *>bias,
                                <const float *>residual, <float *>y, y_stride, rows, format, threads)
    if not done:
        raise ValueError(f"small_product: {rows} rows (1 to {HS_PRODUCT_MAX_ROWS}), weight format {format}")


def int8_product(uintptr_t x, long x_stride, uintptr_t q, long q_stride, uintptr_t scales, int n, int k,
                 uintptr_t y, long y_stride, int rows, int threads) -> None:
    """y [rows, n] = (x [rows, k] @ q[:, :k].T) * scales [n], q int8 [n, q_stride] (a multiple of 16, zero past k),
    sums in float32 (`hs_int8_product`)."""
    cdef int done
    with nogil:
        done = hs_int8_product(<const float *>x, x_stride, <const signed char *>q, q_stride, <const float *>scales,
                               n, k, <float *>y, y_stride, rows, threads)
    if not done:
        raise ValueError(f"int8_product: {rows} rows (1 to {HS_PRODUCT_MAX_ROWS}), q_stride {q_stride} for k {k}")


def head_recheck(uintptr_t x, long x_stride, uintptr_t w, int n, int k, uintptr_t bounds, float slack, uintptr_t y,
                 long y_stride, int rows) -> int:
    """y [rows, n], an approximation of x [rows, k] @ w [n, k].T within |x[m]| bounds[i] + slack: the float32 logit
    wherever it could be its row's maximum (`hs_head_recheck`). Returns how many were recomputed."""
    cdef long done
    with nogil:
        done = hs_head_recheck(<const float *>x, x_stride, <const float *>w, n, k, <const float *>bounds, slack,
                               <float *>y, y_stride, rows)
    return done


def grouped_products(uintptr_t x, long x_stride, uintptr_t x_rows, uintptr_t panels, uintptr_t bias, int n, int k,
                     uintptr_t experts, uintptr_t starts, uintptr_t counts, int segments, uintptr_t scales,
                     uintptr_t y, long y_stride, int act, float alpha, float limit, uintptr_t h, long h_stride,
                     int depth, int group, int threads) -> None:
    """Segment s: y rows p in [starts[s], + counts[s]) = (x row x_rows[p] (p where x_rows is 0) @ w[experts[s]].T
    (+ its bias)) * scales[p] (where scales is nonzero), w given as its 32-column panels; with act (1: SiLU, 2:
    gpt-oss's clamped SwiGLU) gated panels of gate_up, n hidden units into h; k in slices `depth` deep, `group`
    panels together (0: this CPU's blocking; the bits are the same either way) (`hs_grouped_products`)."""
    with nogil:
        hs_grouped_products(<const float *>x, x_stride, <const int64_t *>x_rows, <const float *>panels,
                            <const float *>bias, n, k, <const int64_t *>experts, <const int64_t *>starts,
                            <const int64_t *>counts, segments, <const float *>scales, <float *>y, y_stride, act,
                            alpha, limit, <float *>h, h_stride, depth, group, threads)


def rms_norm(uintptr_t x, long group_stride, uintptr_t w, int period, float eps, uintptr_t y, int rows,
             int dim, int threads) -> None:
    """y [rows, dim], y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w[r % period]; x's rows in groups of `period`
    consecutive ones, group_stride apart; a prompt chunk's rows over `threads` threads."""
    with nogil:
        hs_rms_norm(<const float *>x, group_stride, <const float *>w, period, eps, <float *>y, rows, dim, threads)


def norm_rotate(uintptr_t x, long group_stride, uintptr_t w, int period, float eps, uintptr_t rope, uintptr_t y,
                int rows, int dim, int threads) -> None:
    """y [rows, dim]: x's rows as `rms_norm` takes them, normed as there (w nonzero) and then rotated by RoPE, pair i
    of token r // period's rows by rope[r // period][i] (complex, [tokens, dim / 2]) (`hs_norm_rotate`)."""
    with nogil:
        hs_norm_rotate(<const float *>x, group_stride, <const float *>w, period, eps, <const float *>rope, <float *>y,
                       rows, dim, threads)


def gated_rows(uintptr_t gate_up, long stride, int rows, int n, int act, float alpha, float limit, uintptr_t out,
               int threads) -> None:
    """out [rows, n] = act(gate_up[:, :n], gate_up[:, n:]) (1: silu(gate) * up, 2: gpt-oss's clamped SwiGLU), the
    panel kernel's activation; gate_up's rows `stride` floats apart."""
    with nogil:
        hs_gated_rows(<const float *>gate_up, stride, rows, n, act, alpha, limit, <float *>out, threads)


def expert_sums(uintptr_t products, long stride, uintptr_t order, int tokens, int top_k, int dim,
                uintptr_t residual, uintptr_t out, int threads) -> None:
    """out [tokens, dim], out[t] = residual[t] (where residual is nonzero) + the sum of token t's top_k product rows
    in row order, the rows those of pairs order[p] = t * top_k + j grouped by expert (`hs_expert_sums`)."""
    cdef int done
    with nogil:
        done = hs_expert_sums(<const float *>products, stride, <const int64_t *>order, tokens, top_k, dim,
                              <const float *>residual, <float *>out, threads)
    if done != 0:
        raise MemoryError("expert_sums: no memory for the pairs' rows")


def moe_step(uintptr_t x, long x_stride, int tokens, int top_k, uintptr_t chosen, uintptr_t weights,
             int num_experts, uintptr_t gate_up, uintptr_t gate_up_bias, uintptr_t down, uintptr_t down_bias,
             int format, int units, int hidden, int act, float alpha, float limit, uintptr_t residual, uintptr_t out,
             int threads) -> None:
    """out [tokens, hidden] = residual (where nonzero) + each token's chosen experts' down(act(gate_up(x))) times
    their router weights (chosen [tokens, top_k] int64 in [0, num_experts), weights float32), summed in expert order
    (`hs_moe_step`); gate_up and down in `format`."""
    cdef int done
    with nogil:
        done = hs_moe_step(<const float *>x, x_stride, tokens, top_k, <const int64_t *>chosen,
                           <const float *>weights, num_experts, <const void *>gate_up, <const float *>gate_up_bias,
                           <const void *>down, <const float *>down_bias, format, units, hidden, act, alpha, limit,
                           <const float *>residual, <float *>out, threads)
    if done != 0:
        raise MemoryError("moe_step: no memory for the pairs' rows")


cdef extern from "delta_kernel.h" nogil:
    int hs_delta_step(const float *src, long src_stride, float *dst, long dst_stride, const float *key,
                      const float *value, const float *decay, const float *beta, const float *query, float *out,
                      int rows, int heads, int key_dim, int value_dim, int threads)
    int HS_DELTA_MAX_VALUE_DIM

DELTA_MAX_VALUE_DIM = HS_DELTA_MAX_VALUE_DIM


def delta_step(uintptr_t src, long src_stride, uintptr_t dst, long dst_stride, uintptr_t key, uintptr_t value,
               uintptr_t decay, uintptr_t beta, uintptr_t query, uintptr_t out, int rows, int heads, int key_dim,
               int value_dim, int threads) -> bool:
    """One token of the gated delta rule for rows x heads states, src -> dst (may be src), and their outputs by
    `query` into `out` where query is nonzero (`hs_delta_step`). False: a value_dim the kernel does not take."""
    cdef int done
    with nogil:
        done = hs_delta_step(<const float *>src, src_stride, <float *>dst, dst_stride, <const float *>key,
                             <const float *>value, <const float *>decay, <const float *>beta, <const float *>query,
                             <float *>out, rows, heads, key_dim, value_dim, threads)
    return bool(done)
