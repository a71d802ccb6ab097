# cython: language_level=3, boundscheck=False, wraparound=False
"""The CPU attention kernels of decode and verification steps and of prompt chunks (`attention_kernel.h`), on raw
pointers of tensors the caller checked (`hybridspec.model.attention`): a thin layer, the GIL released while they run."""
from libc.stdint cimport int64_t, uint8_t, uintptr_t


cdef extern from "attention_kernel.h" nogil:
    int hs_attention_supported()
    int hs_decode_attention(const float *q, const float *keys, const float *values, float *out, float *scores,
                             long scores_stride, int batch, int kv_heads, int rows, int dim, int nq,
                             const int64_t *prefix, const uint8_t *see, const float *sinks, long batch_stride,
                             long head_stride, long key_stride, float scale, int threads)
    int hs_decode_attention_rows(const float *q, const float *new_keys, const float *new_values,
                                 const int64_t *key_rows, const int64_t *value_rows, const int64_t *head_strides,
                                 float *out, float *scores, long scores_stride, int batch, int kv_heads, int rows,
                                 int dim, int nq, const int64_t *prefix, const uint8_t *see, const float *sinks,
                                 long key_stride, float scale, int threads)
    int hs_prefill_attention_threads(const float *q, const long *qs, const float *keys, const float *values,
                                     float *out, const long *os, float *scratch, long scratch_stride, int kv_heads,
                                     int group, int nq, int dim, int start, int tiles, const float *sinks,
                                     int window, long batch_stride, long head_stride, long key_stride, float scale,
                                     int threads)
    int PF_QUERIES, PF_KEYS


def supported() -> bool:
    """Whether this CPU runs the kernel (AVX-512F)."""
    return bool(hs_attention_supported())


def decode_attention(uintptr_t q, uintptr_t keys, uintptr_t values, uintptr_t out, uintptr_t scores,
                     long scores_stride, int batch, int kv_heads, int rows, int dim, int nq, uintptr_t prefix,
                     uintptr_t see, uintptr_t sinks, long batch_stride, long head_stride, long key_stride,
                     float scale, int threads) -> bool:
    """On up to `threads` threads, each with `scores_stride` floats of `scores`; sinks: a float per query head, or 0
    for none. False: head_dim is not one the kernel has (16, 32, 64, 128); nothing was computed."""
    cdef int done
    with nogil:
        done = hs_decode_attention(<const float *>q, <const float *>keys, <const float *>values, <float *>out,
                                   <float *>scores, scores_stride, batch, kv_heads, rows, dim, nq,
                                   <const int64_t *>prefix, <const uint8_t *>see, <const float *>sinks,
                                   batch_stride, head_stride, key_stride, scale, threads)
    return bool(done)


def decode_attention_rows(uintptr_t q, uintptr_t new_keys, uintptr_t new_values, uintptr_t key_rows,
                          uintptr_t value_rows, uintptr_t head_strides, uintptr_t out, uintptr_t scores,
                          long scores_stride, int batch, int kv_heads, int rows, int dim, int nq, uintptr_t prefix,
                          uintptr_t see, uintptr_t sinks, long key_stride, float scale, int threads) -> bool:
    """`decode_attention` for rows of separate caches, each row's new keys and values written first
    (`hs_decode_attention_rows`); False: head_dim is not one the kernel has (nothing written)."""
    cdef int done
    with nogil:
        done = hs_decode_attention_rows(<const float *>q, <const float *>new_keys, <const float *>new_values,
                                        <const int64_t *>key_rows, <const int64_t *>value_rows,
                                        <const int64_t *>head_strides, <float *>out, <float *>scores, scores_stride,
                                        batch, kv_heads, rows, dim, nq, <const int64_t *>prefix,
                                        <const uint8_t *>see, <const float *>sinks, key_stride, scale, threads)
    return bool(done)


TILE_QUERIES, TILE_KEYS = PF_QUERIES, PF_KEYS  # a prompt tile's queries; the keys of one block


def prefill_attention(uintptr_t q, tuple q_strides, uintptr_t keys, uintptr_t values, uintptr_t out,
                      tuple out_strides, uintptr_t scratch, long scratch_stride, int kv_heads, int group, int nq,
                      int dim, int start, int tiles, uintptr_t sinks, int window, long batch_stride, long head_stride,
                      long key_stride, float scale, int threads) -> bool:
    """A prompt chunk's causal attention, its `tiles` tiles over `threads` OpenMP threads, each with its scratch
    (`hs_prefill_attention_threads`; window 0 or at least TILE_QUERIES); q and out [batch, heads, nq, dim] at the
    strides given (batch, head, position; dim contiguous). False: head_dim is not one the kernel has."""
    cdef long qs[3]
    cdef long os[3]
    cdef int done
    qs[0], qs[1], qs[2] = q_strides
    os[0], os[1], os[2] = out_strides
    with nogil:
        done = hs_prefill_attention_threads(<const float *>q, qs, <const float *>keys, <const float *>values,
                                            <float *>out, os, <float *>scratch, scratch_stride, kv_heads, group, nq,
                                            dim, start, tiles, <const float *>sinks, window, batch_stride,
                                            head_stride, key_stride, scale, threads)
    return bool(done)
