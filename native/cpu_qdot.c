/* Quantized CPU products: see cpu_qdot.h for the contract.
 *
 * Summation order (the same in both implementations, which is what makes them bit-identical):
 *   - within a weight block, products of integers are summed in int32 (exact, so any order);
 *   - the block's term is formed by a fixed float formula from its scales and integer sums;
 *   - terms are added to the output's float accumulator one block after another, in order.
 * The AVX2 code vectorizes across outputs (8 (row, token) pairs per vector lane set), never across
 * the blocks of one output, so every lane performs exactly the portable scalar sequence.
 * Float weights (F32/F16/BF16) use 8 running lanes (element i goes to lane i % 8, in order), then a
 * fixed pairwise tree over the lanes.
 */
#include "cpu_qdot.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QDOT_X86 1
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};
enum { FAM_FLOAT, FAM_LEGACY, FAM_K };

#define QK 32            /* legacy block */
#define QKK 256          /* K-quant super-block */
#define Q8_0_BYTES 34    /* f16 d + 32 int8 */
#define Q8_K_BYTES 292   /* f32 d + 256 int8 + 16 int16 */
#define Q8_K_BSUMS 260   /* offset of the int16 sums in a q8_K block */
#define TOKEN_TILE 64    /* portable path: outputs accumulated at once per weight row */

/* ---------------------------------------------------------------- scalars and conversions */

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float load_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }
static inline int16_t load_i16(const uint8_t *p) { int16_t v; memcpy(&v, p, 2); return v; }
static inline float bits_to_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* Exact half -> float (every half is a float). */
static inline float fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 is exact in float */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 0x1f)
        return bits_to_f32(sign | 0x7f800000u | (man << 13));
    return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* float -> half, round to nearest, ties to even (as NumPy's astype(float16)). */
static inline uint16_t f32_to_fp16(float f)
{
    uint32_t x = f32_to_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)  /* inf, NaN (kept quiet) */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u)  /* >= 65520 rounds past the largest half */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {  /* below 2^-14: a multiple of 2^-24; scaling by 2^24 is exact */
        uint32_t m = (uint32_t)rintf(bits_to_f32(ax) * 16777216.0f);
        return (uint16_t)(sign | m);
    }
    uint32_t r = ax - (112u << 23);  /* rebias the exponent, then round 13 mantissa bits away */
    r += 0x0fffu + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

/* float -> bf16, round to nearest even on the raw bits (the repo's NumPy rule, NaN included). */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t b = f32_to_bits(f);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

/* ---------------------------------------------------------------- type table */

static int type_info(int type, int *block, int *bytes, int *family)
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
    if (type_info(type, &block, &bytes, &family))
        return QDOT_EUNSUPPORTED;
    if (cols <= 0 || cols % block)
        return QDOT_ECOLS;
    return (long long)(cols / block) * bytes;
}

long long qdot_activation_row_bytes(int type, int cols)
{
    int block, bytes, family;
    if (type_info(type, &block, &bytes, &family))
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

void quantize_row_q8_0(const float *x, void *out, int k)
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

void quantize_row_q8_K(const float *x, void *out, int k)
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

int qdot_quantize_activations(int type, const float *x, int n_tokens, int cols, void *out)
{
    long long row = qdot_activation_row_bytes(type, cols);
    if (row < 0)
        return (int)row;
    if (n_tokens < 0)
        return QDOT_ERANGE;
    int block = 0, bytes = 0, family = FAM_FLOAT;
    type_info(type, &block, &bytes, &family);
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

/* ---------------------------------------------------------------- one product's shared state */

struct job {
    int type, family, rows, cols, nb, n_tokens;
    const uint8_t *w;   /* packed weights */
    size_t wrow;        /* bytes per weight row */
    int wblock;         /* bytes per weight block */
    const uint8_t *x;   /* quantized activations */
    size_t xrow;        /* bytes per activation row */
    const float *dx;    /* [t * nb + b]: activation block scales as floats (legacy, K) */
    const int32_t *xsum;/* [t * nb + b]: sum of a q8_0 block's int8 values (legacy) */
    const float *xf;    /* [t * cols + i]: activations as floats (float types) */
    float *y;
};

/* The fixed per-block float formulas; the AVX2 code performs the same operations lane by lane. */
static inline float legacy_term(float d, float m, float dx, int32_t isum, int32_t xsum, int has_min)
{
    float term = (d * dx) * (float)isum;
    if (has_min)
        term = term + (m * dx) * (float)xsum;
    return term;
}

static inline float kquant_term(float d, float dmin, float dx, int32_t isc, int32_t imin, int has_min)
{
    float term = (d * dx) * (float)isc;
    if (has_min)
        term = term - (dmin * dx) * (float)imin;
    return term;
}

/* Lanes of a float dot product -> its value: the tail elements go to lanes 0..rem-1, then a fixed tree. */
static inline float finish_lanes(float lanes[8], const float *w, const float *x, int rem)
{
    for (int j = 0; j < rem; j++)
        lanes[j] = lanes[j] + w[j] * x[j];
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

static inline float weight_to_f32(int type, const uint8_t *row, int i)
{
    if (type == T_F32)
        return load_f32(row + 4 * (size_t)i);
    uint16_t h = load_u16(row + 2 * (size_t)i);
    return type == T_F16 ? fp16_to_f32(h) : bf16_to_f32(h);
}

/* ---------------------------------------------------------------- portable implementation */

/* Legacy block -> 32 signed weight integers (offsets removed for Q4_0/Q5_0), scale d and min m. */
static void unpack_legacy(int type, const uint8_t *b, int8_t q[QK], float *d, float *m)
{
    *d = fp16_to_f32(load_u16(b));
    *m = 0.0f;
    const uint8_t *qs;
    uint32_t qh = 0;
    int offset = 0;
    switch (type) {
    case T_Q8_0:
        memcpy(q, b + 2, QK);
        return;
    case T_Q4_0: qs = b + 2; offset = 8; break;
    case T_Q4_1: qs = b + 4; *m = fp16_to_f32(load_u16(b + 2)); break;
    case T_Q5_0: qh = load_u32(b + 2); qs = b + 6; offset = 16; break;
    default: /* T_Q5_1 */ qh = load_u32(b + 4); qs = b + 8; *m = fp16_to_f32(load_u16(b + 2)); break;
    }
    for (int i = 0; i < 16; i++) {
        int lo = (qs[i] & 0x0f) | (((qh >> i) & 1) << 4);
        int hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        q[i] = (int8_t)(lo - offset);
        q[i + 16] = (int8_t)(hi - offset);
    }
}

/* The six-bit scales and mins of Q4_K/Q5_K (12 bytes). */
static void k_scales_mins(const uint8_t *p, int sc[8], int mn[8])
{
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[4 + j] & 63;
        sc[4 + j] = (p[8 + j] & 0x0f) | ((p[j] >> 6) << 4);
        mn[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 6) << 4);
    }
}

/* K-quant super-block -> 256 unsigned weight integers (Q6_K: 0..63, its -32 applied through the
 * activation sums), the scales (8 for Q4_K/Q5_K, 16 for Q6_K), the mins, d and dmin. */
static void unpack_k(int type, const uint8_t *b, uint8_t q[QKK], int sc[16], int mn[8], float *d, float *dmin)
{
    if (type == T_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *lq = ql + 64 * h, hb = qh[32 * h + l];
                uint8_t *o = q + 128 * h + l;
                o[0] = (uint8_t)((lq[l] & 0x0f) | ((hb & 3) << 4));
                o[32] = (uint8_t)((lq[32 + l] & 0x0f) | (((hb >> 2) & 3) << 4));
                o[64] = (uint8_t)((lq[l] >> 4) | (((hb >> 4) & 3) << 4));
                o[96] = (uint8_t)((lq[32 + l] >> 4) | (((hb >> 6) & 3) << 4));
            }
        for (int j = 0; j < 16; j++)
            sc[j] = (int8_t)b[192 + j];
        *d = fp16_to_f32(load_u16(b + 208));
        *dmin = 0.0f;
        return;
    }
    *d = fp16_to_f32(load_u16(b));
    *dmin = fp16_to_f32(load_u16(b + 2));
    k_scales_mins(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = type == T_Q5_K ? b + 48 : b + 16;
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            uint8_t lo = qs[32 * g + l] & 0x0f, hi = qs[32 * g + l] >> 4;
            if (type == T_Q5_K) {
                lo |= (uint8_t)(((qh[l] >> (2 * g)) & 1) << 4);
                hi |= (uint8_t)(((qh[l] >> (2 * g + 1)) & 1) << 4);
            }
            q[64 * g + l] = lo;
            q[64 * g + 32 + l] = hi;
        }
}

static void legacy_rows_portable(const struct job *J, int r0, int r1)
{
    const int has_min = J->type == T_Q4_1 || J->type == T_Q5_1;
    float acc[TOKEN_TILE];
    int8_t q[QK];
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = J->w + (size_t)r * J->wrow;
        for (int t0 = 0; t0 < J->n_tokens; t0 += TOKEN_TILE) {
            int nt = J->n_tokens - t0 < TOKEN_TILE ? J->n_tokens - t0 : TOKEN_TILE;
            for (int t = 0; t < nt; t++)
                acc[t] = 0.0f;
            for (int b = 0; b < J->nb; b++) {
                float d, m;
                unpack_legacy(J->type, wrow + (size_t)b * J->wblock, q, &d, &m);
                for (int t = 0; t < nt; t++) {
                    size_t xi = (size_t)(t0 + t) * J->nb + b;
                    const int8_t *xq = (const int8_t *)(J->x + (size_t)(t0 + t) * J->xrow + (size_t)b * Q8_0_BYTES + 2);
                    int32_t isum = 0;
                    for (int i = 0; i < QK; i++)
                        isum += q[i] * xq[i];
                    acc[t] = acc[t] + legacy_term(d, m, J->dx[xi], isum, J->xsum[xi], has_min);
                }
            }
            for (int t = 0; t < nt; t++)
                J->y[(size_t)(t0 + t) * J->rows + r] = acc[t];
        }
    }
}

static void k_rows_portable(const struct job *J, int r0, int r1)
{
    const int six = J->type == T_Q6_K;
    float acc[TOKEN_TILE];
    uint8_t q[QKK];
    int sc[16], mn[8];
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = J->w + (size_t)r * J->wrow;
        for (int t0 = 0; t0 < J->n_tokens; t0 += TOKEN_TILE) {
            int nt = J->n_tokens - t0 < TOKEN_TILE ? J->n_tokens - t0 : TOKEN_TILE;
            for (int t = 0; t < nt; t++)
                acc[t] = 0.0f;
            for (int b = 0; b < J->nb; b++) {
                float d, dmin;
                unpack_k(J->type, wrow + (size_t)b * J->wblock, q, sc, mn, &d, &dmin);
                for (int t = 0; t < nt; t++) {
                    const uint8_t *xb = J->x + (size_t)(t0 + t) * J->xrow + (size_t)b * Q8_K_BYTES;
                    const int8_t *xq = (const int8_t *)(xb + 4);
                    int32_t isc = 0, imin = 0;
                    int per = six ? 16 : 32;  /* elements per scale */
                    for (int j = 0; j < QKK / per; j++) {
                        int32_t s = 0;
                        for (int i = 0; i < per; i++)
                            s += q[per * j + i] * xq[per * j + i];
                        isc += sc[j] * s;
                    }
                    if (six) {
                        for (int j = 0; j < 16; j++)
                            imin += sc[j] * load_i16(xb + Q8_K_BSUMS + 2 * j);
                        isc -= 32 * imin;  /* the weights' -32 offset */
                    } else {
                        for (int j = 0; j < 8; j++)
                            imin += mn[j] * (load_i16(xb + Q8_K_BSUMS + 4 * j) + load_i16(xb + Q8_K_BSUMS + 4 * j + 2));
                    }
                    acc[t] = acc[t] + kquant_term(d, dmin, J->dx[(size_t)(t0 + t) * J->nb + b], isc, imin, !six);
                }
            }
            for (int t = 0; t < nt; t++)
                J->y[(size_t)(t0 + t) * J->rows + r] = acc[t];
        }
    }
}

static int float_rows_portable(const struct job *J, int r0, int r1)
{
    float *wf = malloc((size_t)J->cols * sizeof(float));
    if (!wf)
        return QDOT_ENOMEM;
    int n8 = J->cols & ~7;
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = J->w + (size_t)r * J->wrow;
        for (int i = 0; i < J->cols; i++)
            wf[i] = weight_to_f32(J->type, wrow, i);
        for (int t = 0; t < J->n_tokens; t++) {
            const float *x = J->xf + (size_t)t * J->cols;
            float lanes[8] = {0};
            for (int i = 0; i < n8; i += 8)
                for (int j = 0; j < 8; j++)
                    lanes[j] = lanes[j] + wf[i + j] * x[i + j];
            J->y[(size_t)t * J->rows + r] = finish_lanes(lanes, wf + n8, x + n8, J->cols - n8);
        }
    }
    free(wf);
    return 0;
}

/* ---------------------------------------------------------------- AVX2 implementation */
#ifdef QDOT_X86
#define AVX2 __attribute__((target("avx2,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

/* Eight int32x8 vectors -> one vector whose lane p is the sum of v[p]'s lanes (exact). */
AVX2_INLINE __m256i sum8_epi32(const __m256i v[8])
{
    __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* unsigned x signed bytes -> int32x8 of pair sums (no saturation: |u| <= 63 here, or |u| <= 128
 * with the sign trick below and activations within +-127) */
AVX2_INLINE __m256i dot_u8_i8(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* Legacy weights of one block as bytes: unsigned 0..31 (Q4_*, Q5_*) or signed (Q8_0). */
AVX2_INLINE __m256i legacy_bytes(int type, const uint8_t *b)
{
    if (type == T_Q8_0)
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    int qs_at = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
    __m128i packed = _mm_loadu_si128((const __m128i *)(b + qs_at));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0f));
    if (type == T_Q5_0 || type == T_Q5_1) {
        /* bit j of qh is the fifth bit of element j: spread byte j/8 over 8 lanes, test bit j%8 */
        __m256i qh = _mm256_set1_epi32((int)load_u32(b + (type == T_Q5_0 ? 2 : 4)));
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return q;
}

/* R rows x T tokens (R * T == 8 lanes, lane p = r * T + t); rr/tt may repeat the last valid index to
 * fill a tile, and only the first nr x nt outputs are stored. */
AVX2_INLINE void legacy_tile_avx2(const struct job *J, const int *rr, const int *tt, int nr, int nt,
                                  const int R, const int T, const int type)
{
    const int has_min = type == T_Q4_1 || type == T_Q5_1;
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < J->nb; b++) {
        __m256i wq[8], xv[8], dots[8];
        uint16_t dw16[8], mw16[8];
        float dxl[8];
        int32_t xsl[8];
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = J->w + (size_t)rr[r] * J->wrow + (size_t)b * J->wblock;
            wq[r] = legacy_bytes(type, blk);
            dw16[r] = load_u16(blk);
            mw16[r] = has_min ? load_u16(blk + 2) : 0;
        }
        for (int t = 0; t < T; t++)
            xv[t] = _mm256_loadu_si256((const __m256i *)(J->x + (size_t)tt[t] * J->xrow + (size_t)b * Q8_0_BYTES + 2));
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) {
                if (type == T_Q8_0)  /* signed x signed: |w| times x with w's sign */
                    dots[r * T + t] = dot_u8_i8(_mm256_sign_epi8(wq[r], wq[r]), _mm256_sign_epi8(xv[t], wq[r]));
                else
                    dots[r * T + t] = dot_u8_i8(wq[r], xv[t]);
            }
        uint16_t dwl16[8], mwl16[8];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) {
                size_t xi = (size_t)tt[t] * J->nb + b;
                dwl16[r * T + t] = dw16[r];
                mwl16[r * T + t] = mw16[r];
                dxl[r * T + t] = J->dx[xi];
                xsl[r * T + t] = J->xsum[xi];
            }
        __m256i isum = sum8_epi32(dots);
        __m256i xsum = _mm256_loadu_si256((const __m256i *)xsl);
        if (offset)
            isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(xsum, _mm256_set1_epi32(offset)));
        __m256 dx = _mm256_loadu_ps(dxl);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dwl16));  /* exact */
        __m256 term = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum));
        if (has_min) {
            __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mwl16));
            term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(xsum)));
        }
        acc = _mm256_add_ps(acc, term);
    }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++)
            J->y[(size_t)tt[t] * J->rows + rr[r]] = out[r * T + t];
}

AVX2_INLINE void k_tile_avx2(const struct job *J, const int *rr, const int *tt, int nr, int nt,
                             const int R, const int T, const int type)
{
    const int six = type == T_Q6_K;
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < J->nb; b++) {
        __m256i isc[8], imn[8], bsums[8];
        float dwl[8], dml[8], dxl[8];
        for (int t = 0; t < T; t++)
            bsums[t] = _mm256_loadu_si256((const __m256i *)(J->x + (size_t)tt[t] * J->xrow + (size_t)b * Q8_K_BYTES + Q8_K_BSUMS));
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = J->w + (size_t)rr[r] * J->wrow + (size_t)b * J->wblock;
            const int8_t *xq[8];
            for (int t = 0; t < T; t++) {
                xq[t] = (const int8_t *)(J->x + (size_t)tt[t] * J->xrow + (size_t)b * Q8_K_BYTES + 4);
                isc[r * T + t] = _mm256_setzero_si256();
            }
            float d, dmin;
            if (six) {
                int16_t s16[16];
                for (int j = 0; j < 16; j++)
                    s16[j] = (int8_t)blk[192 + j];
                d = fp16_to_f32(load_u16(blk + 208));
                dmin = 0.0f;
                __m256i scales = _mm256_loadu_si256((const __m256i *)s16);
                for (int t = 0; t < T; t++)
                    imn[r * T + t] = _mm256_madd_epi16(bsums[t], scales);
                for (int h = 0; h < 2; h++) {
                    __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                    __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                    __m256i q[4] = {
                        _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2)),
                        _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, top2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2)),
                    };
                    for (int k = 0; k < 4; k++) {
                        int j = 8 * h + 2 * k;  /* scales j (first 16 elements) and j + 1 */
                        __m256i sv = _mm256_set_m128i(_mm_set1_epi16(s16[j + 1]), _mm_set1_epi16(s16[j]));
                        for (int t = 0; t < T; t++) {
                            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[t] + 128 * h + 32 * k));
                            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xv), sv);
                            isc[r * T + t] = _mm256_add_epi32(isc[r * T + t], p);
                        }
                    }
                }
            } else {
                int sc[8], mn[8];
                k_scales_mins(blk + 4, sc, mn);
                d = fp16_to_f32(load_u16(blk));
                dmin = fp16_to_f32(load_u16(blk + 2));
                __m256i mins = _mm256_setr_epi16((short)mn[0], (short)mn[0], (short)mn[1], (short)mn[1],
                                                 (short)mn[2], (short)mn[2], (short)mn[3], (short)mn[3],
                                                 (short)mn[4], (short)mn[4], (short)mn[5], (short)mn[5],
                                                 (short)mn[6], (short)mn[6], (short)mn[7], (short)mn[7]);
                for (int t = 0; t < T; t++)
                    imn[r * T + t] = _mm256_madd_epi16(bsums[t], mins);
                const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
                __m256i qh = type == T_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
                    __m256i lo = _mm256_and_si256(packed, low4);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                    if (type == T_Q5_K) {  /* bit 2g / 2g+1 of qh[l] -> 16 */
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
                    }
                    __m256i slo = _mm256_set1_epi16((short)sc[2 * g]), shi = _mm256_set1_epi16((short)sc[2 * g + 1]);
                    for (int t = 0; t < T; t++) {
                        __m256i xl = _mm256_loadu_si256((const __m256i *)(xq[t] + 64 * g));
                        __m256i xh = _mm256_loadu_si256((const __m256i *)(xq[t] + 64 * g + 32));
                        __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), slo),
                                                     _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), shi));
                        isc[r * T + t] = _mm256_add_epi32(isc[r * T + t], p);
                    }
                }
            }
            for (int t = 0; t < T; t++) {
                dwl[r * T + t] = d;
                dml[r * T + t] = dmin;
                dxl[r * T + t] = J->dx[(size_t)tt[t] * J->nb + b];
            }
        }
        __m256i is = sum8_epi32(isc), im = sum8_epi32(imn);
        __m256 dx = _mm256_loadu_ps(dxl);
        __m256 term;
        if (six) {
            is = _mm256_sub_epi32(is, _mm256_slli_epi32(im, 5));  /* the weights' -32 offset */
            term = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(dwl), dx), _mm256_cvtepi32_ps(is));
        } else {
            term = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(dwl), dx), _mm256_cvtepi32_ps(is)),
                                 _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(dml), dx), _mm256_cvtepi32_ps(im)));
        }
        acc = _mm256_add_ps(acc, term);
    }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++)
            J->y[(size_t)tt[t] * J->rows + rr[r]] = out[r * T + t];
}

AVX2_INLINE __m256 weights8(int type, const uint8_t *row, int i)
{
    if (type == T_F32)
        return _mm256_loadu_ps((const float *)(row + 4 * (size_t)i));
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * (size_t)i));
    if (type == T_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2_INLINE void float_tile_avx2(const struct job *J, const int *rr, const int *tt, int nr, int nt,
                                 const int R, const int T, const int type)
{
    __m256 acc[8];
    for (int p = 0; p < R * T; p++)
        acc[p] = _mm256_setzero_ps();
    int n8 = J->cols & ~7, rem = J->cols - n8;
    for (int i = 0; i < n8; i += 8)
        for (int r = 0; r < R; r++) {
            __m256 w = weights8(type, J->w + (size_t)rr[r] * J->wrow, i);
            for (int t = 0; t < T; t++)
                acc[r * T + t] = _mm256_add_ps(acc[r * T + t], _mm256_mul_ps(w, _mm256_loadu_ps(J->xf + (size_t)tt[t] * J->cols + i)));
        }
    for (int r = 0; r < nr; r++) {
        float wtail[8];
        for (int j = 0; j < rem; j++)
            wtail[j] = weight_to_f32(type, J->w + (size_t)rr[r] * J->wrow, n8 + j);
        for (int t = 0; t < nt; t++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r * T + t]);
            J->y[(size_t)tt[t] * J->rows + rr[r]] = finish_lanes(lanes, wtail, J->xf + (size_t)tt[t] * J->cols + n8, rem);
        }
    }
}

enum { TILE_LEGACY, TILE_K, TILE_FLOAT };

/* Walk [r0, r1) x all tokens in R x T tiles; the kind and type are constants after inlining. */
AVX2_INLINE void tiles_avx2(const struct job *J, int r0, int r1, const int R, const int T, const int kind, const int type)
{
    int rr[8], tt[8];
    for (int rs = r0; rs < r1; rs += R) {
        int nr = r1 - rs < R ? r1 - rs : R;
        for (int r = 0; r < R; r++)
            rr[r] = rs + (r < nr ? r : nr - 1);
        for (int ts = 0; ts < J->n_tokens; ts += T) {
            int nt = J->n_tokens - ts < T ? J->n_tokens - ts : T;
            for (int t = 0; t < T; t++)
                tt[t] = ts + (t < nt ? t : nt - 1);
            if (kind == TILE_LEGACY)
                legacy_tile_avx2(J, rr, tt, nr, nt, R, T, type);
            else if (kind == TILE_K)
                k_tile_avx2(J, rr, tt, nr, nt, R, T, type);
            else
                float_tile_avx2(J, rr, tt, nr, nt, R, T, type);
        }
    }
}

/* One token: 8 rows per tile (4 for floats); several: 2 rows x 4 tokens, so each weight block
 * loaded serves four tokens. */
#define DISPATCH(kind, type_const, R1, T1)                                          \
    case type_const:                                                                \
        if (J->n_tokens == 1) tiles_avx2(J, r0, r1, R1, T1, kind, type_const);       \
        else tiles_avx2(J, r0, r1, 2, 4, kind, type_const);                          \
        break;

static AVX2 void rows_avx2(const struct job *J, int r0, int r1)
{
    switch (J->type) {
    DISPATCH(TILE_LEGACY, T_Q4_0, 8, 1)
    DISPATCH(TILE_LEGACY, T_Q4_1, 8, 1)
    DISPATCH(TILE_LEGACY, T_Q5_0, 8, 1)
    DISPATCH(TILE_LEGACY, T_Q5_1, 8, 1)
    DISPATCH(TILE_LEGACY, T_Q8_0, 8, 1)
    DISPATCH(TILE_K, T_Q4_K, 8, 1)
    DISPATCH(TILE_K, T_Q5_K, 8, 1)
    DISPATCH(TILE_K, T_Q6_K, 8, 1)
    DISPATCH(TILE_FLOAT, T_F32, 4, 1)
    DISPATCH(TILE_FLOAT, T_F16, 4, 1)
    DISPATCH(TILE_FLOAT, T_BF16, 4, 1)
    default: break;
    }
}
#endif /* QDOT_X86 */

/* ---------------------------------------------------------------- dispatch */

static int g_impl = -1;  /* -1: not chosen yet */

int qdot_cpu_has_avx2(void)
{
#ifdef QDOT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

int qdot_implementation(void)
{
    if (g_impl < 0) {
        const char *force = getenv("NVMEDIRECT_CPU_KERNELS");
        g_impl = (force && strcmp(force, "portable") == 0) ? 0 : qdot_cpu_has_avx2();
    }
    return g_impl;
}

int qdot_set_implementation(int avx2)
{
    if (avx2 && !qdot_cpu_has_avx2())
        return QDOT_ENOIMPL;
    g_impl = avx2 ? 1 : 0;
    return 0;
}

static int rows_any(const struct job *J, int r0, int r1, int avx2)
{
    if (r0 >= r1)
        return 0;
#ifdef QDOT_X86
    if (avx2) {
        rows_avx2(J, r0, r1);
        return 0;
    }
#else
    (void)avx2;
#endif
    if (J->family == FAM_LEGACY)
        legacy_rows_portable(J, r0, r1);
    else if (J->family == FAM_K)
        k_rows_portable(J, r0, r1);
    else
        return float_rows_portable(J, r0, r1);
    return 0;
}

int matmul_q(const void *w, int type, int rows, int cols, const void *xq, int n_tokens, float *y,
             int row0, int row1, int n_threads)
{
    int block, wblock, family;
    if (type_info(type, &block, &wblock, &family))
        return QDOT_EUNSUPPORTED;
    long long wrow = qdot_weight_row_bytes(type, cols), xrow = qdot_activation_row_bytes(type, cols);
    if (wrow < 0)
        return (int)wrow;
    if (rows < 0 || n_tokens < 0 || row0 < 0 || row1 > rows || row0 > row1)
        return QDOT_ERANGE;
    if (n_tokens == 0 || row0 == row1)
        return 0;
    struct job J = {
        .type = type, .family = family, .rows = rows, .cols = cols, .nb = cols / block, .n_tokens = n_tokens,
        .w = w, .wrow = (size_t)wrow, .wblock = wblock, .x = xq, .xrow = (size_t)xrow, .y = y,
    };
    /* Per-block activation scales (and q8_0 sums) as plain arrays, decoded once per product. */
    float *dx = NULL, *xf = NULL;
    int32_t *xsum = NULL;
    size_t nblk = (size_t)n_tokens * J.nb;
    if (family == FAM_FLOAT) {
        xf = malloc((size_t)n_tokens * cols * sizeof(float));
        if (!xf)
            return QDOT_ENOMEM;
        for (int t = 0; t < n_tokens; t++)
            for (int i = 0; i < cols; i++)
                xf[(size_t)t * cols + i] = weight_to_f32(type, J.x + (size_t)t * J.xrow, i);
    } else {
        dx = malloc(nblk * sizeof(float));
        xsum = malloc(nblk * sizeof(int32_t));
        if (!dx || !xsum) {
            free(dx);
            free(xsum);
            return QDOT_ENOMEM;
        }
        for (int t = 0; t < n_tokens; t++)
            for (int b = 0; b < J.nb; b++) {
                size_t i = (size_t)t * J.nb + b;
                if (family == FAM_K) {
                    dx[i] = load_f32(J.x + (size_t)t * J.xrow + (size_t)b * Q8_K_BYTES);
                    xsum[i] = 0;
                } else {
                    const uint8_t *blk = J.x + (size_t)t * J.xrow + (size_t)b * Q8_0_BYTES;
                    int32_t s = 0;
                    for (int k = 0; k < QK; k++)
                        s += (int8_t)blk[2 + k];
                    dx[i] = fp16_to_f32(load_u16(blk));
                    xsum[i] = s;
                }
            }
    }
    J.dx = dx;
    J.xsum = xsum;
    J.xf = xf;
    int avx2 = qdot_implementation();
    int span = row1 - row0, threads = n_threads < 1 ? 1 : n_threads;
    if (threads > span)
        threads = span;
    int rc = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(min : rc)
    {
        int i = omp_get_thread_num(), n = omp_get_num_threads();
        int a = row0 + (int)((long long)span * i / n), b = row0 + (int)((long long)span * (i + 1) / n);
        rc = rows_any(&J, a, b, avx2);
    }
#else
    rc = rows_any(&J, row0, row1, avx2);
#endif
    free(dx);
    free(xsum);
    free(xf);
    return rc;
}
