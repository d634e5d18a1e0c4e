/* MXFP4 weights (gpt-oss's experts) times q8_0 activations, in llama.cpp's order.
 *
 * A block is one E8M0 exponent byte e and 16 bytes of 4-bit codes (the 16 low nibbles are elements
 * 0..15, the high ones 16..31); a code indexes the doubled E2M1 values below and the block's scale is
 * 2^(e - 128) (half of 2^(e - 127), undoing the doubling). llama.cpp's vec_dot on AVX2 keeps two sets
 * of 8 float lanes, the even blocks' in one and the odd blocks' in the other: lane k accumulates, with a
 * fused multiply-add, (d_x * scale) times the integer sum of elements 4k..4k+3; the two sets are added
 * lane by lane and reduced with ggml's hsum_float_8; a last odd block is added as d * (its integer sum).
 * Every kernel below (portable, AVX2, AVX-512 VNNI) computes that sequence, so they give the same
 * bits as each other (and as llama.cpp's AVX2 build). */
#include "cpu_qdot_common.h"

#define MXFP4_BYTES 17

static const int8_t FP4_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) as a float, subnormal for e < 2 (ggml's E8M0 to float, halved). */
static inline float e8m0_half(uint8_t e)
{
    return e < 2 ? bits_to_f32(0x00200000u << e) : bits_to_f32((uint32_t)(e - 1) << 23);
}

/* The pairs' total plus the last block b of an odd count, as llama.cpp's scalar tail adds it:
 * d * (its integer sum). */
static inline float last_block(float total, const uint8_t *w, const uint8_t *x, const float *dx, int b)
{
    const uint8_t *wb = w + (size_t)b * MXFP4_BYTES;
    const int8_t *xq = (const int8_t *)(x + (size_t)b * Q8_0_BYTES + 2);
    int32_t s = 0;
    for (int i = 0; i < 16; i++)
        s += xq[i] * FP4_DOUBLED[wb[1 + i] & 0x0f] + xq[i + 16] * FP4_DOUBLED[wb[1 + i] >> 4];
    float d = dx[b] * e8m0_half(wb[0]);
    return total + d * (float)s;
}

/* One output: weight row w (nb blocks) against one token's q8_0 row x (scales dx). */
static float mxfp4_dot_portable(const uint8_t *w, const uint8_t *x, const float *dx, int nb)
{
    float even[8] = {0}, odd[8] = {0};
    const int paired = nb & ~1;  /* llama.cpp's loop takes blocks in pairs */
    int b = 0;
    for (; b < paired; b++) {
        float *lanes = (b & 1) ? odd : even;
        const uint8_t *wb = w + (size_t)b * MXFP4_BYTES;
        const int8_t *xq = (const int8_t *)(x + (size_t)b * Q8_0_BYTES + 2);
        float d = dx[b] * e8m0_half(wb[0]);
        for (int k = 0; k < 8; k++) {
            int32_t s = 0;
            for (int i = 4 * k; i < 4 * k + 4; i++) {
                int code = i < 16 ? wb[1 + i] & 0x0f : wb[1 + i - 16] >> 4;
                s += FP4_DOUBLED[code] * xq[i];
            }
            lanes[k] = fmaf(d, (float)s, lanes[k]);
        }
    }
    float sum[8];
    for (int k = 0; k < 8; k++)
        sum[k] = even[k] + odd[k];
    float total = hsum8_ggml(sum);
    return b < nb ? last_block(total, w, x, dx, b) : total;
}

void qdot_mxfp4_rows_portable(const struct job *J, int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < J->n_tokens; t++)
            J->y[(size_t)t * J->ystride + r] = mxfp4_dot_portable(J->w + (size_t)r * J->wrow,
                                                                  J->x + (size_t)t * J->xrow,
                                                                  J->dx + (size_t)t * J->nb, J->nb);
}

#ifdef QDOT_X86
/* A block's 32 codes as signed bytes (low nibbles, then high nibbles) through a table lookup. */
AVX2_INLINE __m256i mxfp4_values(const uint8_t *qs, __m128i table)
{
    __m128i bits = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bits, low));
    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bits, 4), low));
    return _mm256_set_m128i(hi, lo);
}

AVX2 static float mxfp4_dot_avx2(const uint8_t *w, const uint8_t *x, const float *dx, int nb)
{
    const __m128i table = _mm_loadu_si128((const __m128i *)FP4_DOUBLED);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *w0 = w + (size_t)b * MXFP4_BYTES, *w1 = w0 + MXFP4_BYTES;
        const uint8_t *x0 = x + (size_t)b * Q8_0_BYTES, *x1 = x0 + Q8_0_BYTES;
        __m256i p0 = dot_i8_i8(mxfp4_values(w0 + 1, table), _mm256_loadu_si256((const __m256i *)(x0 + 2)));
        __m256i p1 = dot_i8_i8(mxfp4_values(w1 + 1, table), _mm256_loadu_si256((const __m256i *)(x1 + 2)));
        even = _mm256_fmadd_ps(_mm256_set1_ps(dx[b] * e8m0_half(w0[0])), _mm256_cvtepi32_ps(p0), even);
        odd = _mm256_fmadd_ps(_mm256_set1_ps(dx[b + 1] * e8m0_half(w1[0])), _mm256_cvtepi32_ps(p1), odd);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(even, odd));
    float total = hsum8_ggml(lanes);
    return b < nb ? last_block(total, w, x, dx, b) : total;
}

AVX2 void qdot_mxfp4_rows_avx2(const struct job *J, int r0, int r1)
{
    for (int r = r0; r < r1; r++) {
        const uint8_t *w = J->w + (size_t)r * J->wrow;
        if (r + 1 < r1)
            _mm_prefetch((const char *)(w + J->wrow), _MM_HINT_T0);
        for (int t = 0; t < J->n_tokens; t++)
            J->y[(size_t)t * J->ystride + r] = mxfp4_dot_avx2(w, J->x + (size_t)t * J->xrow,
                                                              J->dx + (size_t)t * J->nb, J->nb);
    }
}

/* AVX-512 VNNI, several tokens: a row's blocks are decoded once into a buffer of the codes shifted by
 * +12 to unsigned bytes (0..24), which vpdpbusd multiplies with each token's signed activations, each
 * lane started from 12 x -(its activations' sum) (struct job's xneg): the same integers as above. One
 * token, or rows of more than MXFP4_ROW_BLOCKS blocks, take the AVX2 kernel. */
#define MXFP4_ROW_BLOCKS 512

AVX512_INLINE __m256i mxfp4_lanes_vnni(__m256i wu, const int8_t *x, const int32_t *xneg)
{
    __m256i neg = _mm256_loadu_si256((const __m256i *)xneg);
    __m256i start = _mm256_add_epi32(_mm256_slli_epi32(neg, 3), _mm256_slli_epi32(neg, 2));  /* 12 x */
    return _mm256_dpbusd_epi32(start, wu, _mm256_loadu_si256((const __m256i *)x));
}

AVX512 void qdot_mxfp4_rows_avx512(const struct job *J, int r0, int r1)
{
    const int nb = J->nb;
    if (nb > MXFP4_ROW_BLOCKS) {
        qdot_mxfp4_rows_avx2(J, r0, r1);
        return;
    }
    int8_t shifted[16];
    for (int i = 0; i < 16; i++)
        shifted[i] = (int8_t)(FP4_DOUBLED[i] + 12);
    const __m128i table = _mm_loadu_si128((const __m128i *)shifted);
    uint8_t wu[MXFP4_ROW_BLOCKS * QK];
    float ws[MXFP4_ROW_BLOCKS];
    const int paired = nb & ~1;
    if (J->n_tokens == 1) {  /* a decode row: the AVX2 kernel's direct lookups measured faster (2 threads,
                              * gpt-oss-20b's shape: 33.5 tok/s against 32.2 through vpdpbusd) */
        qdot_mxfp4_rows_avx2(J, r0, r1);
        return;
    }
    for (int r = r0; r < r1; r++) {
        const uint8_t *w = J->w + (size_t)r * J->wrow;
        if (r + 1 < r1)
            _mm_prefetch((const char *)(w + J->wrow), _MM_HINT_T0);
        for (int b = 0; b < nb; b++) {
            const uint8_t *wb = w + (size_t)b * MXFP4_BYTES;
            _mm256_storeu_si256((__m256i *)(wu + (size_t)b * QK), mxfp4_values(wb + 1, table));
            ws[b] = e8m0_half(wb[0]);
        }
        for (int t = 0; t < J->n_tokens; t++) {
            const uint8_t *x = J->x + (size_t)t * J->xrow;
            const float *dx = J->dx + (size_t)t * nb;
            const int32_t *xneg = J->xneg + (size_t)t * nb * 8;
            __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
            for (int b = 0; b < paired; b += 2) {
                __m256i p0 = mxfp4_lanes_vnni(_mm256_loadu_si256((const __m256i *)(wu + (size_t)b * QK)),
                                              (const int8_t *)(x + (size_t)b * Q8_0_BYTES + 2), xneg + (size_t)b * 8);
                __m256i p1 = mxfp4_lanes_vnni(_mm256_loadu_si256((const __m256i *)(wu + (size_t)(b + 1) * QK)),
                                              (const int8_t *)(x + (size_t)(b + 1) * Q8_0_BYTES + 2),
                                              xneg + (size_t)(b + 1) * 8);
                even = _mm256_fmadd_ps(_mm256_set1_ps(dx[b] * ws[b]), _mm256_cvtepi32_ps(p0), even);
                odd = _mm256_fmadd_ps(_mm256_set1_ps(dx[b + 1] * ws[b + 1]), _mm256_cvtepi32_ps(p1), odd);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, _mm256_add_ps(even, odd));
            float total = hsum8_ggml(lanes);
            if (paired < nb)
                total = last_block(total, w, x, dx, paired);
            J->y[(size_t)t * J->ystride + r] = total;
        }
    }
}
#endif
