/* The packed path's operations around the products (infer.cpu_layers): RMSNorm and the rotary
 * embedding bit for bit as the NumPy reference computes them (infer.model.rms_norm,
 * infer.layers.Rope.apply), and attention over the float16 KV cache in a fixed order of its own.
 *
 * A decode step spent ~5 ms of SmolLM2's ~21 ms in NumPy around the products (2026-12-04, the 2-core
 * machine): ~25 small NumPy calls per layer for attention alone, each a few microseconds of dispatch
 * for microseconds of arithmetic. Here each is one call.
 *
 * Attention cannot repeat NumPy's bits: its score and value products go through OpenBLAS (gemv or
 * gemm, FMA kernels chosen by the CPU) and its exp is NumPy's SIMD one. Its order here, the same in
 * the AVX2 and the portable code and whatever the batch, the rows or the threads:
 *   - score(t, j) = q(t) . k(j) over 8 lanes (element d to lane d % 8, in order), then the tree
 *     ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), times the scale;
 *   - e(j) = exp_softmax(score - max), a fixed polynomial (the C library's expf differs between
 *     libraries, and the vector code must compute the same value);
 *   - their sum over 8 lanes (key j to lane j % 8, in order) and the same tree; p(j) = e(j) / sum
 *     rounded to float16 (as the reference rounds the probabilities);
 *   - out(t, d) = sum over j in increasing order of p(j) * v(j, d).
 * Here j counts the slots a row sees, in slot order (causal: the slots up to its position; with a
 * mask, the visible ones gathered first), so a row's result depends only on the keys and values it
 * sees, in order: not on the rows beside it (a prompt's row t is what decoding that token alone
 * gives), nor on where the slots it does not see lie (a token tree's node is what decoding its path
 * alone gives: its ancestors' slots come in the path's order).
 */
#include "cpu_qdot_common.h"

/* ---------------------------------------------------------------- RMSNorm */

static inline double square_f32(float x)
{
    float s = x * x;  /* np.square(x, dtype=float32): rounded to float32 before the double sum */
    return (double)s;
}

/* NumPy's pairwise summation (numpy/_core/src/umath/loops_utils.h.src, DOUBLE_pairwise_sum) of
 * the float32 squares: blocks of up to 128 in eight accumulators, halves above that. */
static double pairwise_squares(const float *x, ptrdiff_t n)
{
    if (n < 8) {
        double res = 0.;
        for (ptrdiff_t i = 0; i < n; i++)
            res += square_f32(x[i]);
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++)
            r[j] = square_f32(x[j]);
        ptrdiff_t i = 8;
        for (; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += square_f32(x[i + j]);
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += square_f32(x[i]);
        return res;
    }
    ptrdiff_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_squares(x, n2) + pairwise_squares(x + n2, n - n2);
}

/* NumPy reduces a float32 row into a float64 sum through its cast buffer (8192 elements, the
 * default np.getbufsize()): a pairwise sum per buffer, the buffers' sums added in order. */
#define NUMPY_BUFSIZE 8192

void qdot_rms_norm(const float *x, const float *weight, int rows, int cols, float eps, float *out)
{
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * cols;
        float *o = out + (size_t)r * cols;
        double sum = 0.;
        for (int c0 = 0; c0 < cols; c0 += NUMPY_BUFSIZE)
            sum += pairwise_squares(xr + c0, cols - c0 < NUMPY_BUFSIZE ? cols - c0 : NUMPY_BUFSIZE);
        float mean = (float)(sum / (double)cols);
        float scale = 1.0f / sqrtf(mean + eps);
        for (int i = 0; i < cols; i++)
            o[i] = (xr[i] * scale) * weight[i];
    }
}

/* ---------------------------------------------------------------- rotary embedding */

/* One head: the first n_pairs pairs rotated by c[i], s[i], the rest copied. */
static void rope_head(const float *src, const float *c, const float *s, int head_dim, int n_pairs, int neox, int fma,
                      float *dst)
{
    memcpy(dst, src, (size_t)head_dim * sizeof(float));
    for (int i = 0; i < n_pairs; i++) {
        int ia = neox ? i : 2 * i, ib = neox ? i + n_pairs : 2 * i + 1;
        float a = src[ia], b = src[ib];
        if (fma) {  /* the reference's float64 sum of an exact product and a float32 product */
            dst[ia] = (float)((double)a * (double)c[i] - (double)(b * s[i]));
            dst[ib] = (float)((double)a * (double)s[i] + (double)(b * c[i]));
        } else {
            dst[ia] = a * c[i] - b * s[i];
            dst[ib] = a * s[i] + b * c[i];
        }
    }
}

void qdot_rope(const float *x, int n_tokens, int n_heads, int head_dim, int n_pairs, const float *cos,
               const float *sin, int neox, int fma, float *out)
{
    for (int t = 0; t < n_tokens; t++)
        for (int h = 0; h < n_heads; h++)
            rope_head(x + ((size_t)t * n_heads + h) * head_dim, cos + (size_t)t * n_pairs,
                      sin + (size_t)t * n_pairs, head_dim, n_pairs, neox, fma,
                      out + ((size_t)t * n_heads + h) * head_dim);
}

/* ---------------------------------------------------------------- attention */

/* exp(x) for x <= 0 (a softmax's shifted scores), within ~1 ulp (exp_poly, cpu_qdot_common.h). Below
 * -87 (where exp is subnormal, < 2^-125) it gives 0. */
static inline float exp_softmax(float x)
{
    if (!(x >= -87.0f))  /* also -inf */
        return 0.0f;
    return exp_poly(x > 0.0f ? 0.0f : x);
}

void qdot_exp_softmax(const float *x, float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = exp_softmax(x[i]);
}

static inline float lane_tree(const float l[8])
{
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* Element i to lane i % 8, in order, then the tree. */
static float sum_lanes(const float *x, int n)
{
    float l[8] = {0};
    for (int i = 0; i < n; i++)
        l[i % 8] = l[i % 8] + x[i];
    return lane_tree(l);
}

/* Slot of the row's j-th key: idx[j], or j without a list. */
static inline size_t slot(const int *idx, int j) { return idx ? (size_t)idx[j] : (size_t)j; }

static void scores_portable(const float *q, const uint16_t *k, size_t k_stride, const int *idx, int hd, int n,
                            float *score)
{
    for (int j = 0; j < n; j++) {
        const uint16_t *kj = k + slot(idx, j) * k_stride;
        float l[8] = {0};
        for (int d = 0; d < hd; d++)
            l[d % 8] = l[d % 8] + q[d] * fp16_to_f32(kj[d]);
        score[j] = lane_tree(l);
    }
}

static void values_portable(const float *p, const uint16_t *v, size_t v_stride, const int *idx, int hd, int n,
                            float *out)
{
    for (int d = 0; d < hd; d++)
        out[d] = 0.0f;
    for (int j = 0; j < n; j++)
        for (int d = 0; d < hd; d++)
            out[d] = out[d] + p[j] * fp16_to_f32(v[slot(idx, j) * v_stride + d]);
}

#ifdef QDOT_X86
/* Eight keys at a time, one accumulator each (lane = d % 8); the two hadd steps and the final add
 * form exactly lane_tree's sums, for the eight keys at once. head_dim a multiple of 8. */
AVX2 static void scores_avx2(const float *q, const uint16_t *k, size_t k_stride, const int *idx, int hd, int n,
                             float *score)
{
    for (int j0 = 0; j0 < n; j0 += 8) {
        const uint16_t *kr[8];
        for (int i = 0; i < 8; i++)  /* past the last key: repeat it, its scores are not stored */
            kr[i] = k + slot(idx, j0 + i < n ? j0 + i : n - 1) * k_stride;
        __m256 acc[8];
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(qv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kr[i] + d)))));
        }
        __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
        __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
        if (j0 + 8 <= n) {
            _mm256_storeu_ps(score + j0, sum);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, sum);
            memcpy(score + j0, tmp, (size_t)(n - j0) * sizeof(float));
        }
    }
}

/* out[d] = sum over j in order of p[j] * v[j][d]: 64 outputs at a time, one lane each (eight
 * independent sums, so the adds' latency overlaps). */
AVX2 static void values_avx2(const float *p, const uint16_t *v, size_t v_stride, const int *idx, int hd, int n,
                             float *out)
{
    for (int d0 = 0; d0 < hd; d0 += 64) {
        int nv = (hd - d0) / 8 < 8 ? (hd - d0) / 8 : 8;
        __m256 acc[8];
        for (int u = 0; u < 8; u++)
            acc[u] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            __m256 pj = _mm256_set1_ps(p[j]);
            const uint16_t *vj = v + slot(idx, j) * v_stride + d0;
            for (int u = 0; u < nv; u++)
                acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(pj, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vj + 8 * u)))));
        }
        for (int u = 0; u < nv; u++)
            _mm256_storeu_ps(out + d0 + 8 * u, acc[u]);
    }
}
#endif

/* Row of n > 0 scores -> probabilities (each the float16 value of e / sum), in place. A sink (gpt-oss:
 * the head's learned logit, not NULL) joins the maximum and, after the keys' lanes, the sum. */
static void softmax_portable(float *p, int n, float scale, const float *sink)
{
    float m = sink ? *sink : -INFINITY;
    for (int j = 0; j < n; j++) {
        p[j] = p[j] * scale;
        m = p[j] > m ? p[j] : m;
    }
    for (int j = 0; j < n; j++)
        p[j] = exp_softmax(p[j] - m);
    float sum = sum_lanes(p, n);
    if (sink)
        sum = sum + exp_softmax(*sink - m);
    for (int j = 0; j < n; j++)
        p[j] = fp16_to_f32(f32_to_fp16(p[j] / sum));
}

#ifdef QDOT_X86
/* exp_softmax on eight lanes, operation for operation. */
AVX2_INLINE __m256 exp_softmax8(__m256 x)
{
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_blendv_ps(x, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
    return _mm256_and_ps(exp_poly8(x), keep);  /* 0 where x < -87, -inf */
}

/* softmax_portable, eight lanes at a time (the tails in scalar). */
AVX2 static void softmax_avx2(float *p, int n, float scale, const float *sink)
{
    int n8 = n & ~7, j = 0;
    float m = sink ? *sink : -INFINITY;
    __m256 vs = _mm256_set1_ps(scale), vmax = _mm256_set1_ps(-INFINITY);
    for (; j < n8; j += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + j), vs);
        _mm256_storeu_ps(p + j, x);
        vmax = _mm256_max_ps(vmax, x);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++)  /* the maximum is exact, whatever the order */
        m = lanes[i] > m ? lanes[i] : m;
    for (; j < n; j++) {
        p[j] = p[j] * scale;
        m = p[j] > m ? p[j] : m;
    }
    __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    for (j = 0; j < n8; j += 8) {  /* key j to lane j % 8, in order: sum_lanes' lanes */
        __m256 e = exp_softmax8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
        _mm256_storeu_ps(p + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float l[8];
    _mm256_storeu_ps(l, acc);
    for (; j < n; j++) {
        p[j] = exp_softmax(p[j] - m);
        l[j % 8] = l[j % 8] + p[j];
    }
    float sum = lane_tree(l);
    if (sink)
        sum = sum + exp_softmax(*sink - m);
    __m256 vsum = _mm256_set1_ps(sum);
    for (j = 0; j < n8; j += 8) {  /* F16C rounds to nearest even, as f32_to_fp16 */
        __m128i h = _mm256_cvtps_ph(_mm256_div_ps(_mm256_loadu_ps(p + j), vsum), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_ps(p + j, _mm256_cvtph_ps(h));
    }
    for (; j < n; j++)
        p[j] = fp16_to_f32(f32_to_fp16(p[j] / sum));
}
#endif

struct attn {
    const struct qdot_attn_shape *shape;
    const float *q;           /* [t][h][d] */
    const float *cos, *sin;   /* [t][pair], or NULL: q is rotated already */
    const uint16_t *k, *v;    /* [j][kv head][d] float16 */
    const uint8_t *mask;      /* [t][j] nonzero where row t sees slot j, or NULL: causal */
    const float *sinks;       /* [h]: each head's sink logit, or NULL: none */
    float *out;               /* [t][h][d] */
    int n_tokens, n_keys, first, start, rows_per_chunk, n_blocks, avx2;
};

/* One head over a block of query rows. */
static int attn_chunk(void *ctx, int i)
{
    const struct attn *A = ctx;
    const struct qdot_attn_shape *S = A->shape;
    int h = i / A->n_blocks, t0 = (i % A->n_blocks) * A->rows_per_chunk;
    int t1 = t0 + A->rows_per_chunk < A->n_tokens ? t0 + A->rows_per_chunk : A->n_tokens;
    int hd = S->head_dim, kvh = h / (S->n_heads / S->n_kv_heads);
    size_t stride = (size_t)S->n_kv_heads * hd;
    const uint16_t *k = A->k + (size_t)kvh * hd, *v = A->v + (size_t)kvh * hd;
    /* scratch: the rotated query, the row's scores, and with a mask the slots it sees */
    size_t bytes = ((size_t)hd + A->n_keys) * sizeof(float) + (A->mask ? (size_t)A->n_keys * sizeof(int) : 0);
    float *q = malloc(bytes);
    if (!q)
        return QDOT_ENOMEM;
    float *p = q + hd;
    int *idx = A->mask ? (int *)(p + A->n_keys) : NULL;
    for (int t = t0; t < t1; t++) {
        const float *qt = A->q + ((size_t)t * S->n_heads + h) * hd;
        float *o = A->out + ((size_t)t * S->n_heads + h) * hd;
        int n = 0;
        if (A->mask) {
            const uint8_t *row = A->mask + (size_t)t * A->n_keys;
            for (int j = 0; j < A->n_keys; j++)
                if (row[j])
                    idx[n++] = j;
        } else {  /* causal: the slots up to this row's position */
            n = A->start + t - A->first + 1;
            n = n < A->n_keys ? n : A->n_keys;
        }
        if (n <= 0) {  /* sees no slot (never in a pass the engine makes) */
            memset(o, 0, (size_t)hd * sizeof(float));
            continue;
        }
        if (A->cos)
            rope_head(qt, A->cos + (size_t)t * S->n_pairs, A->sin + (size_t)t * S->n_pairs, hd, S->n_pairs,
                      S->neox, S->fma, q);
        else
            memcpy(q, qt, (size_t)hd * sizeof(float));
        for (int d = 0; d < hd; d++)  /* the query as the float16 the reference rounds it to */
            q[d] = fp16_to_f32(f32_to_fp16(q[d] * S->q_scale));
#ifdef QDOT_X86
        if (A->avx2) {
            scores_avx2(q, k, stride, idx, hd, n, p);
            softmax_avx2(p, n, S->scale, A->sinks ? A->sinks + h : NULL);
            values_avx2(p, v, stride, idx, hd, n, o);
            continue;
        }
#endif
        scores_portable(q, k, stride, idx, hd, n, p);
        softmax_portable(p, n, S->scale, A->sinks ? A->sinks + h : NULL);
        values_portable(p, v, stride, idx, hd, n, o);
    }
    free(q);
    return 0;
}

#define ATTN_ROWS 16  /* query rows per chunk: a prompt's heads split further for the threads */

int qdot_attention(const struct qdot_attn_shape *shape, const float *q, int n_tokens,
                   const float *cos, const float *sin, const void *k, const void *v, int n_keys, int first,
                   int start, const uint8_t *mask, float *out, int n_threads)
{
    return qdot_attention_sinks(shape, q, n_tokens, cos, sin, k, v, n_keys, first, start, mask, NULL, out,
                                n_threads);
}

int qdot_attention_sinks(const struct qdot_attn_shape *shape, const float *q, int n_tokens,
                         const float *cos, const float *sin, const void *k, const void *v, int n_keys, int first,
                         int start, const uint8_t *mask, const float *sinks, float *out, int n_threads)
{
    const struct qdot_attn_shape *S = shape;
    if (S->n_heads < 1 || S->n_kv_heads < 1 || S->n_heads % S->n_kv_heads || S->head_dim < 1 ||
        S->n_pairs < 0 || 2 * S->n_pairs > S->head_dim || n_tokens < 0 || n_keys < 0)
        return QDOT_ERANGE;
    if (n_tokens == 0)
        return 0;
    struct attn A = {
        .shape = S, .q = q, .cos = cos, .sin = sin, .k = k, .v = v, .mask = mask, .sinks = sinks,
        .out = out, .n_tokens = n_tokens, .n_keys = n_keys, .first = first, .start = start,
        .rows_per_chunk = ATTN_ROWS, .n_blocks = (n_tokens + ATTN_ROWS - 1) / ATTN_ROWS,
        /* the vector code takes whole lanes of head_dim; the portable code computes the same bits */
        .avx2 = qdot_implementation() && S->head_dim % 8 == 0,
    };
    return qdot_pool_run(n_threads, S->n_heads * A.n_blocks, attn_chunk, &A);
}
