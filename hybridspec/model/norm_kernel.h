#ifndef HS_NORM_KERNEL_H
#define HS_NORM_KERNEL_H
#include "product_kernel.h"

/* The RMSNorms of a forward pass and a layer's query and key norms with RoPE, float32 rows, threaded for a prompt
   chunk (`hybridspec.model.norms`). */

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

#endif
