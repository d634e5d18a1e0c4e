/* One decode token through the dense layers of a model in one call (infer.cpu_decode): the packed
 * path's layer recipe (infer.model.Transformer.forward_batch with infer.cpu_layers) for a single
 * row, step for step, with the same functions and float operations, so its bits are those of the
 * same token in a batch or a prompt. Python around ~12 small calls a layer cost SmolLM2 Q8_0 about a
 * quarter of its decode step (2026-12-05, the 2-core machine: ~63 us a layer beside ~190 us of
 * products); here the layers cost their products and arithmetic.
 *
 * Also the SwiGLU of the packed path (qdot_swiglu), which the batched recipe calls too: its exp is a
 * fixed polynomial in double, not NumPy's, so both recipes form the same bits.
 */
#include "cpu_qdot_common.h"

/* SwiGLU in double, rounded to float once at the end: a float formula rounds four times (exp ~1 ulp,
 * the add, the divide, the multiply) and reached 3 ulps near the top of a binade; this is within
 * ~0.5 ulp. exp(x) for x clamped to [-708, 709]: k = round(x / ln 2), r = x - k ln 2 (ln 2 in two
 * parts, |r| <= 0.35), a degree-10 Taylor polynomial (relative error < 1e-13), times 2^k from the
 * exponent bits. Only + - * /, no FMA (-ffp-contract=off), so the scalar and AVX2 code give the same
 * bits. A NaN gate gives NaN through the divide, whatever the exp gives. */
#define EXP_D_ROUND 6755399441055744.0  /* 1.5 * 2^52: adding it rounds to an integer in the low bits */
#define LN2_HI 6.93145751953125E-1
#define LN2_LO 1.42860682030941723212E-6
#define LOG2E 1.4426950408889634
static const double exp_taylor[11] = {1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720,
                                      1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0};

static inline double exp_d(double x)
{
    x = x > 709.0 ? 709.0 : x < -708.0 ? -708.0 : x;
    double k = (x * LOG2E + EXP_D_ROUND) - EXP_D_ROUND;
    double r = (x - k * LN2_HI) - k * LN2_LO;
    double p = exp_taylor[0];
    for (int i = 1; i < 11; i++)
        p = p * r + exp_taylor[i];
    uint64_t scale = (uint64_t)((int64_t)k + 1023) << 52;
    double s;
    memcpy(&s, &scale, sizeof s);
    return p * s;
}

static inline float silu_times(float g, float u)
{
    if (g != g)
        return g;
    double gd = g;
    return (float)(gd / (1.0 + exp_d(-gd)) * (double)u);
}

#ifdef QDOT_X86
/* exp_d on four lanes, operation for operation (NaN lanes give garbage: the divide makes them NaN). */
AVX2_INLINE __m256d exp_d4(__m256d x)
{
    x = _mm256_min_pd(_mm256_max_pd(x, _mm256_set1_pd(-708.0)), _mm256_set1_pd(709.0));
    __m256d round = _mm256_set1_pd(EXP_D_ROUND);
    __m256d t = _mm256_add_pd(_mm256_mul_pd(x, _mm256_set1_pd(LOG2E)), round);
    __m256d k = _mm256_sub_pd(t, round);
    __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(k, _mm256_set1_pd(LN2_HI))),
                              _mm256_mul_pd(k, _mm256_set1_pd(LN2_LO)));
    __m256d p = _mm256_set1_pd(exp_taylor[0]);
    for (int i = 1; i < 11; i++)
        p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(exp_taylor[i]));
    /* k as an integer: t's low mantissa bits hold it, offset by the rounding constant's */
    __m256i ki = _mm256_sub_epi64(_mm256_castpd_si256(t), _mm256_castpd_si256(round));
    __m256i scale = _mm256_slli_epi64(_mm256_add_epi64(ki, _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(scale));
}

AVX2_INLINE __m128 silu_times4(__m128 g, __m128 u)
{
    __m256d gd = _mm256_cvtps_pd(g);
    __m256d e = exp_d4(_mm256_sub_pd(_mm256_setzero_pd(), gd));
    __m256d s = _mm256_div_pd(gd, _mm256_add_pd(_mm256_set1_pd(1.0), e));
    return _mm256_cvtpd_ps(_mm256_mul_pd(s, _mm256_cvtps_pd(u)));
}

AVX2 static void swiglu_avx2(const float *g, const float *u, size_t n, float *out)
{
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        _mm_storeu_ps(out + i, silu_times4(_mm_loadu_ps(g + i), _mm_loadu_ps(u + i)));
    for (; i < n; i++)
        out[i] = silu_times(g[i], u[i]);
}
#endif

void qdot_swiglu(const float *gate, const float *up, size_t n, float *out)
{
#ifdef QDOT_X86
    if (qdot_implementation()) {
        swiglu_avx2(gate, up, n, out);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++)
        out[i] = silu_times(gate[i], up[i]);
}

/* ---------------------------------------------------------------- the decode step */

static int product(const struct qdot_product *P, const float *x, float *y, int n_threads)
{
    return matmul_q_parts(P->n_parts, P->w, P->types, P->rows, P->cols, x, 1, y, n_threads);
}

long long qdot_decode_scratch_floats(const struct qdot_decode_shape *S)
{
    const struct qdot_attn_shape *A = &S->attn;
    long long q_dim = (long long)A->n_heads * A->head_dim, kv_dim = (long long)A->n_kv_heads * A->head_dim;
    return 2LL * S->dim + (q_dim + 2 * kv_dim) + kv_dim + q_dim + 3LL * S->ffn_dim;
}

int qdot_decode_layers(const struct qdot_decode_shape *S, const struct qdot_decode_layer *layers, int n_layers,
                       float *x, const float *cos, const float *sin, int pos, float *scratch, int n_threads)
{
    const struct qdot_attn_shape *A = &S->attn;
    const int dim = S->dim, hd = A->head_dim, q_dim = A->n_heads * hd, kv_dim = A->n_kv_heads * hd;
    float *h = scratch, *y = h + dim, *qkv = y + dim, *kr = qkv + q_dim + 2 * kv_dim, *att = kr + kv_dim,
          *gu = att + q_dim, *act = gu + 2 * (size_t)S->ffn_dim;
    int rc;
    for (int i = 0; i < n_layers; i++) {
        const struct qdot_decode_layer *L = &layers[i];
        qdot_rms_norm(x, L->attn_norm, 1, dim, S->eps, h);
        if ((rc = product(&L->qkv, h, qkv, n_threads)))
            return rc;
        if (L->bqkv)
            for (int j = 0; j < q_dim + 2 * kv_dim; j++)
                qkv[j] = qkv[j] + L->bqkv[j];
        float *q = qkv, *k = qkv + q_dim, *v = k + kv_dim;
        if (L->q_norm)  /* Qwen3: each head normalised before rope (in place: row by row, as the reference) */
            qdot_rms_norm(q, L->q_norm, A->n_heads, hd, S->eps, q);
        if (L->k_norm)
            qdot_rms_norm(k, L->k_norm, A->n_kv_heads, hd, S->eps, k);
        qdot_rope(k, 1, A->n_kv_heads, hd, A->n_pairs, cos, sin, A->neox, A->fma, kr);
        uint16_t *keys = L->keys + (size_t)pos * kv_dim, *values = L->values + (size_t)pos * kv_dim;
        for (int j = 0; j < kv_dim; j++) {  /* the cache's float16, rounded as NumPy's astype */
            keys[j] = f32_to_fp16(kr[j]);
            values[j] = f32_to_fp16(v[j]);
        }
        if ((rc = qdot_attention(A, q, 1, cos, sin, L->keys, L->values, pos + 1, 0, pos, NULL, att, n_threads)))
            return rc;
        if ((rc = product(&L->o, att, y, n_threads)))
            return rc;
        for (int j = 0; j < dim; j++)
            x[j] = x[j] + y[j];
        qdot_rms_norm(x, L->ffn_norm, 1, dim, S->eps, h);
        if ((rc = product(&L->gate_up, h, gu, n_threads)))
            return rc;
        qdot_swiglu(gu, gu + S->ffn_dim, (size_t)S->ffn_dim, act);
        if ((rc = product(&L->down, act, y, n_threads)))
            return rc;
        for (int j = 0; j < dim; j++)
            x[j] = x[j] + y[j];
    }
    return 0;
}
