/* One token of the gated delta rule (Gated DeltaNet's recurrence, `hybridspec.model.kv_cache.delta_update`) on a CPU,
   for a step's rows and heads at once: S' = a S + k (beta (v - (a S)^T k))^T with a = exp(decay), then the output
   o = S'^T q where a query is given.

   Why: a state is [key_dim, value_dim] float32 per head (64 KiB at 128 x 128, a megabyte per layer and row), and
   torch's composite form makes five passes over it with a fresh tensor each, at every node of a step and again when
   commit replays the kept ones. Here each head's state is read from memory once and written once: the first pass
   scales it into the destination and sums (a S)^T k, the second (from the cache) adds the correction and sums the
   output.

   Exactness: every (row, head) is computed alone in a fixed order, so a node's state and output are bitwise the same
   in a plain step, in a verification pass of any size and when commit replays the accepted path.

   Layout: src and dst [rows, heads, key_dim, value_dim] with row strides src_stride and dst_stride (floats; dst may
   be src: in place); key [rows, heads, key_dim], value [rows, heads, value_dim], decay and beta [rows, heads], query
   [rows, heads, key_dim] or NULL, out [rows, heads, value_dim] (written where query is given), all contiguous.
   value_dim: a multiple of 16, at most 256. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#define HS_DELTA_TARGET __attribute__((target("avx512f")))
#define HS_DELTA_MAX_VALUE_DIM 256

HS_DELTA_TARGET static int hs_delta_step(const float *src, long src_stride, float *dst, long dst_stride,
                                         const float *key, const float *value, const float *decay, const float *beta,
                                         const float *query, float *out, int rows, int heads, int key_dim,
                                         int value_dim, int threads) {
    if (value_dim % 16 || value_dim > HS_DELTA_MAX_VALUE_DIM) return 0;
    const int vectors = value_dim / 16, pairs = rows * heads;
    const long size = (long)key_dim * value_dim;
    #pragma omp parallel for schedule(static) num_threads(pairs > 1 && size * pairs >= 65536 ? threads : 1)
    for (int p = 0; p < pairs; p++) {
        const int r = p / heads, h = p % heads;
        const float *s = src + r * src_stride + h * size;
        float *d = dst + r * dst_stride + h * size;
        const float *k = key + (long)p * key_dim, *v = value + (long)p * value_dim;
        const __m512 a = _mm512_set1_ps(expf(decay[p]));
        __m512 u[HS_DELTA_MAX_VALUE_DIM / 16];
        for (int c = 0; c < vectors; c++) u[c] = _mm512_setzero_ps();
        for (int i = 0; i < key_dim; i++) {  /* d = a s; u = d^T k */
            const __m512 ki = _mm512_set1_ps(k[i]);
            for (int c = 0; c < vectors; c++) {
                const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + (long)i * value_dim + 16 * c), a);
                _mm512_storeu_ps(d + (long)i * value_dim + 16 * c, x);
                u[c] = _mm512_fmadd_ps(x, ki, u[c]);
            }
        }
        const __m512 b = _mm512_set1_ps(beta[p]);
        for (int c = 0; c < vectors; c++)  /* u becomes the correction: beta (v - u) */
            u[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + 16 * c), u[c]), b);
        __m512 o[HS_DELTA_MAX_VALUE_DIM / 16];
        for (int c = 0; c < vectors; c++) o[c] = _mm512_setzero_ps();
        const float *q = query ? query + (long)p * key_dim : 0;
        for (int i = 0; i < key_dim; i++) {  /* d += k u^T; o = d^T q */
            const __m512 ki = _mm512_set1_ps(k[i]);
            for (int c = 0; c < vectors; c++) {
                float *at = d + (long)i * value_dim + 16 * c;
                const __m512 x = _mm512_fmadd_ps(ki, u[c], _mm512_loadu_ps(at));
                _mm512_storeu_ps(at, x);
                if (q) o[c] = _mm512_fmadd_ps(x, _mm512_set1_ps(q[i]), o[c]);
            }
        }
        if (q)
            for (int c = 0; c < vectors; c++) _mm512_storeu_ps(out + (long)p * value_dim + 16 * c, o[c]);
    }
    return 1;
}
