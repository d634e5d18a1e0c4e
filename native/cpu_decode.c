/* One decode token through the dense layers of a model in one call (infer.cpu_decode): the packed
 * path's layer recipe (infer.model.Transformer.forward_batch with infer.cpu_layers) for a single
 * row, step for step, with the same functions and float operations, so its bits are those of the
 * same token in a batch or a prompt. Python around ~12 small calls a layer cost SmolLM2 Q8_0 about a
 * quarter of its decode step (2026-12-05, the 2-core machine: ~63 us a layer beside ~190 us of
 * products); here the layers cost their products and arithmetic.
 *
 * Also the SwiGLU of the packed path (qdot_swiglu), which the batched recipe calls too: its exp is
 * exp_softmax's polynomial over the full range, not NumPy's, so both recipes form the same bits.
 */
#include "cpu_qdot_common.h"

/* exp(x) to within ~1 ulp for x <= 88 (exp_poly, cpu_qdot_common.h; 88 and above give exp(88),
 * finite; below -87, 0). NaN stays NaN. */
static inline float exp_full(float x)
{
    if (x != x)
        return x;
    if (!(x >= -87.0f))
        return 0.0f;
    return exp_poly(x > 88.0f ? 88.0f : x);
}

static inline float silu_times(float g, float u) { return g / (1.0f + exp_full(-g)) * u; }

#ifdef QDOT_X86
/* exp_full on eight lanes, operation for operation. */
AVX2_INLINE __m256 exp_full8(__m256 x)
{
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    return _mm256_blendv_ps(_mm256_and_ps(exp_poly8(x), keep), x, nan);  /* min_ps passed the NaN through to x */
}

AVX2 static void swiglu_avx2(const float *g, const float *u, size_t n, float *out)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 vg = _mm256_loadu_ps(g + i);
        __m256 e = exp_full8(_mm256_sub_ps(_mm256_setzero_ps(), vg));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                _mm256_loadu_ps(u + i)));
    }
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
