/* A prompt chunk's product on Intel's AMX tiles, for a weight of bfloat16 values (`compact_weights`): y = x @ w.T
   (+ bias) (+ residual) in float32 for any number of rows of x.

   Why: a prompt chunk's products are arithmetic, and float32 FMAs (oneDNN's, at this CPU's peak) are the ceiling of
   any float32 engine; AMX multiplies bfloat16 pairs into float32 sums at several times that rate. The weight is
   bfloat16 already (exactly); each input row is split into three bfloat16 pieces whose sum is the row exactly (hi: x
   truncated to bfloat16's 8 significant bits, mid: the rest truncated, lo: what remains, at most 8 bits), so every
   product of a piece and a weight is exact in float32 and the sums are float32 sums of the exact products: float32's
   accuracy (the tests check within a few float32 roundings of a float64 product), not bfloat16's. Three tile products
   for one, and still about 1.8x oneDNN's float32 product on a 2-core Xeon (Qwen3-0.6B's prefill 2.99 -> 1.68 ms a
   token, `benchmarks/profile_prefill.py`).

   Each output depends on its own input row and the weight only, in one order over k: the same bits for any number of
   rows. Layout: tiles of 16 rows by 32 bfloat16 values (1 KiB), the weight packed once by `hs_amx_pack` as
   [n / 16][k / 32] tiles of 16 pairs of k by 16 columns (AMX's pairs layout), an input's pieces as [3][rows / 16][k /
   32] tiles; n and k multiples of 32. Blocks of 32 rows by 32 columns (four accumulator tiles: the two row tiles of a
   piece and the two weight tiles of a step of k in the other four), taken in chunks of 8 x 8 blocks whose pieces and
   weight tiles stay in L2, chunks dealt over threads. */
#ifndef HS_AMX_KERNEL_H
#define HS_AMX_KERNEL_H
#include <cpuid.h>
#include <sys/syscall.h>
#include "product_kernel.h"
#include "norm_kernel.h"  /* HS_NORM_THREADED_ELEMENTS */

#define HS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#define HS_AMX_ALIGN 32   /* n and k: multiples of it */
#define HS_AMX_CHUNK 8    /* blocks of 32 a chunk takes, of rows and of columns */
#define HS_ARCH_REQ_XCOMP_PERM 0x1023
#define HS_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} hs_tile_config;

/* whether this CPU has AMX-BF16 and Linux lets this process use its tiles (asked once) */
static int hs_amx_supported(void) {
    static int state = -1;
    if (state < 0) {
        unsigned a, b, c, d;
        state = 0;
        if (hs_product_supported() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1))
            state = syscall(SYS_arch_prctl, HS_ARCH_REQ_XCOMP_PERM, HS_XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

/* w [n, k] float32 of bfloat16 values (the low 16 bits zero) into p, n * k bfloat16 values in tiles */
static void hs_amx_pack(const float *w, int n, int k, uint16_t *p) {
    const uint32_t *bits = (const uint32_t *)w;
    long steps = k / 32;
    for (long nb = 0; nb < n / 16; nb++)
        for (long kb = 0; kb < steps; kb++) {
            uint16_t *tile = p + (nb * steps + kb) * 512;
            for (int pair = 0; pair < 16; pair++)
                for (int col = 0; col < 16; col++)
                    for (int e = 0; e < 2; e++)
                        tile[(pair * 16 + col) * 2 + e] = bits[(nb * 16 + col) * (long)k + kb * 32 + pair * 2 + e] >> 16;
        }
}

/* rows [0, m) of x (zeros to padded, a multiple of 32) as three bfloat16 pieces into a [3][padded / 16][k / 32] tiles */
HS_PRODUCT_TARGET static void hs_amx_split(const float *x, long x_stride, int m, int padded, int k, uint16_t *a,
                                           int threads) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    long piece = (long)padded * k, steps = k / 32;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && (long)m * k >= HS_NORM_THREADED_ELEMENTS)
    for (int r = 0; r < padded; r++)
        for (int j = 0; j < k; j += 16) {
            __m512 v = r < m ? _mm512_loadu_ps(x + r * x_stride + j) : _mm512_setzero_ps();
            __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), high));
            __m512 rest = _mm512_sub_ps(v, hi);  /* exact: the low 16 bits of v's significand */
            __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), high));
            __m512 lo = _mm512_sub_ps(rest, mid);  /* exact, and at most 8 significant bits */
            long at = (((long)(r / 16) * steps + j / 32) * 16 + r % 16) * 32 + j % 32;
            _mm256_storeu_si256((__m256i *)(a + at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
            _mm256_storeu_si256((__m256i *)(a + piece + at),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(mid), 16)));
            _mm256_storeu_si256((__m256i *)(a + 2 * piece + at),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
        }
}

/* y [m, n] = the pieces a (`hs_amx_split`, padded rows) @ the packed weight p, the rows of a tail block by way of a
   scratch block */
HS_AMX_TARGET static void hs_amx_tiles(const uint16_t *a, int m, int padded, int k, const uint16_t *p, int n, float *y,
                                       long y_stride, int threads) {
    long steps = k / 32, piece = (long)padded * k;
    int row_blocks = padded / 32, col_blocks = n / 32;
    int row_chunks = (row_blocks + HS_AMX_CHUNK - 1) / HS_AMX_CHUNK;
    int col_chunks = (col_blocks + HS_AMX_CHUNK - 1) / HS_AMX_CHUNK;
    #pragma omp parallel num_threads(threads)
    {
        hs_tile_config config;
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t < 8; t++) {
            config.rows[t] = 16;
            config.colsb[t] = 64;
        }
        _tile_loadconfig(&config);
        float scratch[32 * 32];
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int rc = 0; rc < row_chunks; rc++)
            for (int cc = 0; cc < col_chunks; cc++)
                for (int rb = rc * HS_AMX_CHUNK; rb < row_blocks && rb < (rc + 1) * HS_AMX_CHUNK; rb++)
                    for (int cb = cc * HS_AMX_CHUNK; cb < col_blocks && cb < (cc + 1) * HS_AMX_CHUNK; cb++) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        const uint16_t *w0 = p + (long)(2 * cb) * steps * 512, *w1 = w0 + steps * 512;
                        const uint16_t *a0 = a + (long)(2 * rb) * steps * 512, *a1 = a0 + steps * 512;
                        for (long kb = 0; kb < steps; kb++) {
                            _tile_loadd(6, w0 + kb * 512, 64);
                            _tile_loadd(7, w1 + kb * 512, 64);
                            for (long s = 0; s < 3; s++) {  /* hi, mid, lo: each accumulator's sums in that order */
                                _tile_loadd(4, a0 + s * piece + kb * 512, 64);
                                _tile_loadd(5, a1 + s * piece + kb * 512, 64);
                                _tile_dpbf16ps(0, 4, 6);
                                _tile_dpbf16ps(1, 4, 7);
                                _tile_dpbf16ps(2, 5, 6);
                                _tile_dpbf16ps(3, 5, 7);
                            }
                        }
                        int r0 = rb * 32, c0 = cb * 32;
                        int full = r0 + 32 <= m;
                        float *out = full ? y + r0 * y_stride + c0 : scratch;
                        long stride = full ? y_stride : 32;
                        _tile_stored(0, out, stride * 4);
                        _tile_stored(1, out + 16, stride * 4);
                        _tile_stored(2, out + 16 * stride, stride * 4);
                        _tile_stored(3, out + 16 * stride + 16, stride * 4);
                        for (int r = 0; !full && r < 32 && r0 + r < m; r++)
                            memcpy(y + (r0 + r) * y_stride + c0, scratch + r * 32, 32 * sizeof(float));
                    }
        _tile_release();
    }
}

/* y [m, n] = x [m, k] @ w.T (+ bias [n]) (+ residual [m, n], row stride y_stride), w packed by `hs_amx_pack`. Returns
   0, or -1 where memory ran out or the shapes are not multiples of HS_AMX_ALIGN. */
HS_PRODUCT_TARGET static int hs_amx_product(const float *x, long x_stride, int m, const uint16_t *p, int n, int k,
                                            const float *bias, const float *residual, float *y, long y_stride,
                                            int threads) {
    if (m < 1) return 0;
    if (n % HS_AMX_ALIGN || k % HS_AMX_ALIGN) return -1;
    int padded = (m + 31) / 32 * 32;
    uint16_t *a = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 3 * (size_t)padded * k);
    if (!a) return -1;
    hs_amx_split(x, x_stride, m, padded, k, a, threads);
    hs_amx_tiles(a, m, padded, k, p, n, y, y_stride, threads);
    free(a);
    if (bias || residual) {  /* the sum, then the bias, then the residual, as the small-row kernel adds them */
        #pragma omp parallel for num_threads(threads) if (threads > 1 && (long)m * n >= HS_NORM_THREADED_ELEMENTS)
        for (int r = 0; r < m; r++)
            for (int c = 0; c < n; c += 16) {
                __m512 v = _mm512_loadu_ps(y + r * y_stride + c);
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
                if (residual) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + r * y_stride + c));
                _mm512_storeu_ps(y + r * y_stride + c, v);
            }
    }
    return 0;
}

#endif
