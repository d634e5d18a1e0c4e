/* Weight and activation formats: the type table, row sizes, and the activations' rounding to
 * q8_0 / q8_K / f16 / bf16 / f32 rows (cpu_qdot.h). */
#include "cpu_qdot_common.h"

/* ---------------------------------------------------------------- type table */

int qdot_type_info(int type, int *block, int *bytes, int *family)
{
    int b, s, f;
    switch (type) {
    case T_F32: b = 1; s = 4; f = FAM_FLOAT; break;
    case T_F16: b = 1; s = 2; f = FAM_FLOAT; break;
    case T_BF16: b = 1; s = 2; f = FAM_FLOAT; break;
    case T_Q4_0: b = QK; s = 18; f = FAM_LEGACY; break;
    case T_Q4_1: b = QK; s = 20; f = FAM_LEGACY; break;
    case T_Q5_0: b = QK; s = 22; f = FAM_LEGACY; break;
    case T_Q5_1: b = QK; s = 24; f = FAM_LEGACY; break;
    case T_Q8_0: b = QK; s = 34; f = FAM_LEGACY; break;
    case T_MXFP4: b = QK; s = 17; f = FAM_LEGACY; break;  /* q8_0 activations, its own kernels */
    case T_Q4_K: b = QKK; s = 144; f = FAM_K; break;
    case T_Q5_K: b = QKK; s = 176; f = FAM_K; break;
    case T_Q6_K: b = QKK; s = 210; f = FAM_K; break;
    default: return QDOT_EUNSUPPORTED;
    }
    *block = b; *bytes = s; *family = f;
    return 0;
}

long long qdot_weight_row_bytes(int type, int cols)
{
    int block, bytes, family;
    if (qdot_type_info(type, &block, &bytes, &family))
        return QDOT_EUNSUPPORTED;
    if (cols <= 0 || cols % block)
        return QDOT_ECOLS;
    return (long long)(cols / block) * bytes;
}

long long qdot_activation_row_bytes(int type, int cols)
{
    int block, bytes, family;
    if (qdot_type_info(type, &block, &bytes, &family))
        return QDOT_EUNSUPPORTED;
    if (cols <= 0 || cols % block)
        return QDOT_ECOLS;
    switch (type) {
    case T_F32: return 4LL * cols;
    case T_F16: case T_BF16: return 2LL * cols;
    default: return family == FAM_K ? (long long)(cols / QKK) * Q8_K_BYTES : (long long)(cols / QK) * Q8_0_BYTES;
    }
}

/* ---------------------------------------------------------------- activation quantization */

static void quantize_row_q8_0_portable(const float *x, void *out, int k)
{
    uint8_t *o = out;
    for (int b = 0; b < k / QK; b++, x += QK, o += Q8_0_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            float a = fabsf(x[i]);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        uint16_t d = f32_to_fp16(amax / 127.0f);  /* the stored scale is the rounded amax / 127 */
        memcpy(o, &d, 2);
        for (int i = 0; i < QK; i++)
            o[2 + i] = (uint8_t)(int8_t)(int)rintf(x[i] * inv);
    }
}

static void quantize_row_q8_K_portable(const float *x, void *out, int k)
{
    uint8_t *o = out;
    for (int b = 0; b < k / QKK; b++, x += QKK, o += Q8_K_BYTES) {
        /* the scale comes from the signed value of largest magnitude (its first occurrence) */
        float amax = 0.0f, extreme = 0.0f;
        for (int i = 0; i < QKK; i++) {
            float a = fabsf(x[i]);
            if (a > amax) { amax = a; extreme = x[i]; }
        }
        float inv = extreme != 0.0f ? -127.0f / extreme : 0.0f;
        float d = extreme != 0.0f ? 1.0f / inv : 0.0f;
        memcpy(o, &d, 4);
        int8_t *q = (int8_t *)(o + 4);
        for (int i = 0; i < QKK; i++)
            q[i] = (int8_t)(int)fminf(rintf(x[i] * inv), 127.0f);
        for (int j = 0; j < QKK / 16; j++) {
            int16_t s = 0;
            for (int i = 0; i < 16; i++)
                s = (int16_t)(s + q[16 * j + i]);
            memcpy(o + Q8_K_BSUMS + 2 * j, &s, 2);
        }
    }
}

#ifdef QDOT_X86
/* The same roundings eight values at a time (a prompt's activations are rounded once per product,
 * and the scalar loops cost ~5% of a prompt): max is exact in any order, x * inv is the same IEEE
 * product, _mm256_round_ps rounds to nearest even as rintf does, and the packs keep the order. */
AVX2_INLINE float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* 32 values times inv, rounded (at most `cap`) -> 32 int8 at o. */
AVX2_INLINE void round32(const float *x, __m256 inv, __m256 cap, uint8_t *o)
{
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[j] = _mm256_cvtps_epi32(_mm256_min_ps(r, cap));
    }
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)o, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

AVX2 static void quantize_row_q8_0_avx2(const float *x, void *out, int k)
{
    uint8_t *o = out;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < k / QK; b++, x += QK, o += Q8_0_BYTES) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++)
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)));
        float amax = hmax8(m), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        uint16_t d = f32_to_fp16(amax / 127.0f);
        memcpy(o, &d, 2);
        round32(x, _mm256_set1_ps(inv), _mm256_set1_ps(127.0f), o + 2);  /* |x * inv| <= 127 anyway */
    }
}

AVX2 static void quantize_row_q8_K_avx2(const float *x, void *out, int k)
{
    uint8_t *o = out;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < k / QKK; b++, x += QKK, o += Q8_K_BYTES) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QKK / 8; j++)
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)));
        float amax = hmax8(m), extreme = 0.0f;
        for (int j = 0; amax > 0.0f && j < QKK / 8; j++) {  /* the first value of that magnitude */
            __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j));
            int hit = _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(amax), _CMP_EQ_OQ));
            if (hit) {
                extreme = x[8 * j + __builtin_ctz((unsigned)hit)];
                break;
            }
        }
        float inv = extreme != 0.0f ? -127.0f / extreme : 0.0f;
        float d = extreme != 0.0f ? 1.0f / inv : 0.0f;
        memcpy(o, &d, 4);
        for (int j = 0; j < QKK / 32; j++)
            round32(x + 32 * j, _mm256_set1_ps(inv), _mm256_set1_ps(127.0f), o + 4 + 32 * j);
        const int8_t *q = (const int8_t *)(o + 4);
        for (int j = 0; j < QKK / 16; j++) {
            int16_t s = 0;
            for (int i = 0; i < 16; i++)
                s = (int16_t)(s + q[16 * j + i]);
            memcpy(o + Q8_K_BSUMS + 2 * j, &s, 2);
        }
    }
}
#endif

void quantize_row_q8_0(const float *x, void *out, int k)
{
#ifdef QDOT_X86
    if (qdot_implementation()) {
        quantize_row_q8_0_avx2(x, out, k);
        return;
    }
#endif
    quantize_row_q8_0_portable(x, out, k);
}

void quantize_row_q8_K(const float *x, void *out, int k)
{
#ifdef QDOT_X86
    if (qdot_implementation()) {
        quantize_row_q8_K_avx2(x, out, k);
        return;
    }
#endif
    quantize_row_q8_K_portable(x, out, k);
}

int qdot_quantize_activations(int type, const float *x, int n_tokens, int cols, void *out)
{
    long long row = qdot_activation_row_bytes(type, cols);
    if (row < 0)
        return (int)row;
    if (n_tokens < 0)
        return QDOT_ERANGE;
    int block = 0, bytes = 0, family = FAM_FLOAT;
    qdot_type_info(type, &block, &bytes, &family);
    for (int t = 0; t < n_tokens; t++) {
        const float *xt = x + (size_t)t * cols;
        uint8_t *o = (uint8_t *)out + (size_t)t * row;
        if (type == T_F32) {
            memcpy(o, xt, (size_t)cols * 4);
        } else if (type == T_F16 || type == T_BF16) {
            for (int i = 0; i < cols; i++) {
                uint16_t h = type == T_F16 ? f32_to_fp16(xt[i]) : f32_to_bf16(xt[i]);
                memcpy(o + 2 * i, &h, 2);
            }
        } else if (family == FAM_K) {
            quantize_row_q8_K(xt, o, cols);
        } else {
            quantize_row_q8_0(xt, o, cols);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- float16 -> float32 */

#ifdef QDOT_X86
AVX2 static void half_to_float_avx2(const uint16_t *src, float *dst, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = fp16_to_f32(src[i]);
}
#endif

void qdot_half_to_float(const void *src, float *dst, size_t n)
{
#ifdef QDOT_X86
    if (qdot_implementation()) {
        half_to_float_avx2(src, dst, n);
        return;
    }
#endif
    const uint8_t *s = src;
    for (size_t i = 0; i < n; i++)
        dst[i] = fp16_to_f32(load_u16(s + 2 * i));
}
