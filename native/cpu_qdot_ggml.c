/* Q4_0, Q5_0 and Q8_0 products in llama.cpp's order (ggml_order, cpu_qdot_common.h), on AVX2 and
 * AVX-512: per output 8 float lanes, lane k taking each block's exact int32 sum of elements 4k..4k+3
 * (weights with their offsets removed, times the q8_0 activations) times d = d_w * d_x in one fused
 * multiply-add, block after block, then ggml's tree over the lanes. The portable path does the same
 * with fmaf (cpu_qdot_portable.c), so the three give the same bits.
 *
 * A lane's integer sum comes from the unsigned weights (nibbles, or Q8_0's bytes + 128 under VNNI)
 * and the activations, minus offset * (the lane's activation sum, held negated by the decoded
 * activations: struct job's xneg; the offsets 8, 16 and 128 are shifts): equal integers to
 * llama.cpp's signed products, fewer instructions than its sign trick. AVX2's Q8_0 keeps the sign
 * trick (maddubs would saturate on bytes + 128).
 */
#include "cpu_qdot_common.h"

#ifdef QDOT_X86

/* ggml's hsum_float_8 (hsum8_ggml) of a vector. */
AVX2_INLINE float hsum8_ggml_avx(__m256 a)
{
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* -offset * (the lanes' activation sums): the offsets are 2^3 (Q4_0), 2^4 (Q5_0), 2^7 (Q8_0 + 128). */
AVX2_INLINE __m256i offset_terms(int type, const int32_t *xneg)
{
    return _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)xneg), type == T_Q4_0 ? 3 : type == T_Q5_0 ? 4 : 7);
}

/* A block's 8 lane sums: AVX2 (maddubs, madd) and AVX-512 VNNI (vpdpbusd on 256 bits). */
AVX2_INLINE __m256i lanes_avx2(int type, const uint8_t *blk, const uint8_t *xblk, const int32_t *xneg)
{
    __m256i xv = _mm256_loadu_si256((const __m256i *)(xblk + 2));
    if (type == T_Q8_0)
        return dot_i8_i8(_mm256_loadu_si256((const __m256i *)(blk + 2)), xv);
    return _mm256_add_epi32(dot_u8_i8(legacy_bytes(type, blk), xv), offset_terms(type, xneg));
}

AVX512_INLINE __m256i lanes_vnni(int type, const uint8_t *blk, const uint8_t *xblk, const int32_t *xneg)
{
    __m256i xv = _mm256_loadu_si256((const __m256i *)(xblk + 2));
    __m256i u = type == T_Q8_0 ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80))
                               : legacy_bytes(type, blk);
    return _mm256_dpbusd_epi32(offset_terms(type, xneg), u, xv);
}

/* A block's weights as signed bytes in element order, offsets removed (-8..7, -16..15, Q8_0's own). */
AVX2_INLINE __m256i signed_bytes(int type, const uint8_t *b)
{
    __m256i q = legacy_bytes(type, b);
    return type == T_Q8_0 ? q : _mm256_sub_epi8(q, _mm256_set1_epi8(type == T_Q4_0 ? 8 : 16));
}

/* dot_u8_i8's lane sums with VNNI (exact: vpdpbusd adds the four products in int32). */
AVX512_INLINE __m256i dot_vnni(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }

/* The kernels, once per instruction set (ATTR: its function attributes, LANES: its lane sums).
 * One token: rows one after another in memory order, one chain of fused multiply-adds each (the
 * hardware prefetcher follows a single stream: ROWS8's reason, cpu_qdot_common.h). Several: a row's
 * block decoded once for up to 8 tokens (signed, llama.cpp's sign trick: the weights' sign work is
 * shared by the tokens), a vector of lanes each, the 8 tokens' d formed at once. */
#define GGML_ORDER_KERNELS(NAME, ATTR, LANES, DOT)                                                            \
    ATTR static void NAME##_rows(const struct job *J, int r0, int r1, const int type)                   \
    {                                                                                                   \
        const int wb = legacy_block_bytes(type), nb = J->nb;                                            \
        for (int r = r0; r < r1; r++) {                                                                 \
            const uint8_t *row = J->w + (size_t)r * J->wrow;                                            \
            __m256 acc = _mm256_setzero_ps();                                                           \
            for (int b = 0; b < nb; b++) {                                                              \
                const uint8_t *blk = row + (size_t)b * wb;                                              \
                if (!(b & 1))                                                                           \
                    _mm_prefetch((const char *)blk + ROWS8_PREFETCH, _MM_HINT_NTA);                     \
                __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)) * J->dx[b]);                         \
                __m256i s = LANES(type, blk, J->x + (size_t)b * Q8_0_BYTES, J->xneg + 8 * (size_t)b);   \
                acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc);                                   \
            }                                                                                           \
            J->y[r] = hsum8_ggml_avx(acc);                                                              \
        }                                                                                               \
    }                                                                                                   \
    ATTR##_INLINE void NAME##_tile(const struct job *J, const uint8_t *row, int r, int t0, const int type,   \
                                   const int nt)                                                        \
    {                                                                                                   \
        const int wb = legacy_block_bytes(type), n = J->n_tokens;                                       \
        __m256 acc[8];                                                                                  \
        _Pragma("GCC unroll 8")                                                                         \
        for (int t = 0; t < 8; t++)                                                                     \
            acc[t] = _mm256_setzero_ps();                                                               \
        for (int b = 0; b < J->nb; b++) {                                                               \
            const uint8_t *blk = row + (size_t)b * wb;                                                  \
            const int8_t *xb = J->xT + ((size_t)b * n + t0) * QK;  /* the tokens 32 bytes apart */      \
            __m256i w = signed_bytes(type, blk), u = _mm256_sign_epi8(w, w);                            \
            float d[8] __attribute__((aligned(32)));  /* the tokens' d_w * d_x, broadcast one by one */ \
            _mm256_store_ps(d, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(blk))),                 \
                                             _mm256_loadu_ps(J->dxT + (size_t)b * n + t0)));            \
            _Pragma("GCC unroll 8")                                                                     \
            for (int t = 0; t < nt; t++) {                                                              \
                __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + QK * t)), w);  \
                acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(d + t), _mm256_cvtepi32_ps(DOT(u, sx)), acc[t]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8")                                                                         \
        for (int t = 0; t < nt; t++)                                                                    \
            J->y[(size_t)(t0 + t) * J->ystride + r] = hsum8_ggml_avx(acc[t]);                           \
    }                                                                                                   \
    ATTR static void NAME##_tokens(const struct job *J, int r0, int r1, const int type)                 \
    {                                                                                                   \
        for (int r = r0; r < r1; r++) {                                                                 \
            const uint8_t *row = J->w + (size_t)r * J->wrow;                                            \
            int t0 = 0;                                                                                 \
            for (; t0 + 8 <= J->n_tokens; t0 += 8)  /* whole tiles: unrolled, lanes in registers */     \
                NAME##_tile(J, row, r, t0, type, 8);                                                    \
            if (t0 < J->n_tokens)                                                                       \
                NAME##_tile(J, row, r, t0, type, J->n_tokens - t0);                                     \
        }                                                                                               \
    }                                                                                                   \
    ATTR void qdot_##NAME##_rows(const struct job *J, int r0, int r1)                                   \
    {                                                                                                   \
        switch (J->type) {                                                                              \
        case T_Q4_0:                                                                                    \
            J->n_tokens == 1 ? NAME##_rows(J, r0, r1, T_Q4_0) : NAME##_tokens(J, r0, r1, T_Q4_0);       \
            break;                                                                                      \
        case T_Q5_0:                                                                                    \
            J->n_tokens == 1 ? NAME##_rows(J, r0, r1, T_Q5_0) : NAME##_tokens(J, r0, r1, T_Q5_0);       \
            break;                                                                                      \
        case T_Q8_0:                                                                                    \
            J->n_tokens == 1 ? NAME##_rows(J, r0, r1, T_Q8_0) : NAME##_tokens(J, r0, r1, T_Q8_0);       \
            break;                                                                                      \
        default: break;                                                                                 \
        }                                                                                               \
    }

GGML_ORDER_KERNELS(ggml_avx2, AVX2, lanes_avx2, dot_u8_i8)
GGML_ORDER_KERNELS(ggml_avx512, AVX512, lanes_vnni, dot_vnni)

/* AVX-512, several tokens: two rows x 8 tokens a tile. With VNNI a lane's sum is vpdpbusd of the
 * unsigned weights and the raw activations from the offset term (lanes_vnni), so the activations and
 * their offset terms, loaded once, serve both rows; the sign trick of ggml_avx512_tile would redo
 * each token's activations per row. Same lanes, same bits. */
AVX512_INLINE void ggml_pair_tile(const struct job *J, int r, int t0, const int type, const int nt)
{
    const int wb = legacy_block_bytes(type), n = J->n_tokens;
    const uint8_t *row0 = J->w + (size_t)r * J->wrow, *row1 = row0 + J->wrow;
    const int shift = type == T_Q4_0 ? 3 : type == T_Q5_0 ? 4 : 7;
    __m256 acc0[8], acc1[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++)
        acc0[t] = acc1[t] = _mm256_setzero_ps();
    for (int b = 0; b < J->nb; b++) {
        const uint8_t *blk0 = row0 + (size_t)b * wb, *blk1 = row1 + (size_t)b * wb;
        const int8_t *xb = J->xT + ((size_t)b * n + t0) * QK;
        const int32_t *ob = J->xnegT + ((size_t)b * n + t0) * 8;
        __m256i u0, u1;
        if (type == T_Q8_0) {
            u0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk0 + 2)), _mm256_set1_epi8((char)0x80));
            u1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk1 + 2)), _mm256_set1_epi8((char)0x80));
        } else {
            u0 = legacy_bytes(type, blk0);
            u1 = legacy_bytes(type, blk1);
        }
        __m256 dx = _mm256_loadu_ps(J->dxT + (size_t)b * n + t0);
        float d0[8] __attribute__((aligned(32))), d1[8] __attribute__((aligned(32)));
        _mm256_store_ps(d0, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(blk0))), dx));
        _mm256_store_ps(d1, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(blk1))), dx));
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + QK * t));
            __m256i off = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(ob + 8 * t)), shift);
            acc0[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(d0 + t), _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(off, u0, xv)), acc0[t]);
            acc1[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(d1 + t), _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(off, u1, xv)), acc1[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) {
        J->y[(size_t)(t0 + t) * J->ystride + r] = hsum8_ggml_avx(acc0[t]);
        J->y[(size_t)(t0 + t) * J->ystride + r + 1] = hsum8_ggml_avx(acc1[t]);
    }
}

AVX512_INLINE void ggml_pairs_avx512(const struct job *J, int r0, int r1, const int type)
{
    int r = r0;
    for (; r + 2 <= r1; r += 2) {
        int t0 = 0;
        for (; t0 + 8 <= J->n_tokens; t0 += 8)
            ggml_pair_tile(J, r, t0, type, 8);
        if (t0 < J->n_tokens)
            ggml_pair_tile(J, r, t0, type, J->n_tokens - t0);
    }
    if (r < r1)
        ggml_avx512_tokens(J, r, r1, type);
}

/* The AVX-512 entry: one token as ggml_avx512_rows, several in row pairs. */
AVX512 void qdot_ggml_avx512_pairs_rows(const struct job *J, int r0, int r1)
{
    if (J->n_tokens == 1) {
        qdot_ggml_avx512_rows(J, r0, r1);
        return;
    }
    switch (J->type) {
    case T_Q4_0: ggml_pairs_avx512(J, r0, r1, T_Q4_0); break;
    case T_Q5_0: ggml_pairs_avx512(J, r0, r1, T_Q5_0); break;
    case T_Q8_0: ggml_pairs_avx512(J, r0, r1, T_Q8_0); break;
    default: break;
    }
}

#endif /* QDOT_X86 */
