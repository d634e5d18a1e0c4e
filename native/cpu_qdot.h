/* Quantized matrix-vector/matrix products on the CPU: weights stay in their packed GGUF blocks,
 * activations are rounded once per product to the format each weight type multiplies with
 * (8-bit blocks of 32 for Q4_0..Q8_0, 8-bit blocks of 256 for the K-quants, f16/bf16/f32 for the
 * float types), and each block's products are summed in integers before its scales are applied.
 *
 * Determinism: every output element y[t][r] is computed by one fixed sequence of float operations
 * (block terms added one block after another; for Q4_0, Q5_0 and Q8_0, llama.cpp's 8 lanes of fused
 * multiply-adds and its tree over them), whatever the token batch, the row range, the thread count or
 * the instruction set (AVX-512, AVX2 or portable C), so results are bit-identical across all of them.
 * The files must be compiled with -ffp-contract=off for that: the only fused multiply-adds are the
 * explicit ones (fmaf, _mm256_fmadd_ps), which every path performs alike.
 */
#ifndef NVMEDIRECT_CPU_QDOT_H
#define NVMEDIRECT_CPU_QDOT_H

#include <stddef.h>
#include <stdint.h>

/* Error codes (negative returns). */
#define QDOT_EUNSUPPORTED -1 /* weight type not handled */
#define QDOT_ECOLS -2        /* cols not a positive multiple of the type's block size */
#define QDOT_ERANGE -3       /* bad rows / row range / token count */
#define QDOT_ENOMEM -4
#define QDOT_ENOIMPL -5      /* the requested implementation is not available on this CPU */
#define QDOT_ENONFINITE -6   /* activations contain NaN or infinity */

/* Bytes of one packed weight row of `cols` elements; negative error code if unsupported. */
long long qdot_weight_row_bytes(int ggml_type, int cols);
/* Bytes of one activation row after quantize_activations for this weight type; negative on error. */
long long qdot_activation_row_bytes(int ggml_type, int cols);

/* Standard GGML blocks: q8_0 = f16 scale + 32 x int8 (34 bytes), q8_K = f32 scale + 256 x int8 +
 * 16 x int16 sums of 16 (292 bytes). k must be a multiple of the block size. Rounding: scale from the
 * block's largest magnitude, quotients rounded to nearest, ties to even. */
void quantize_row_q8_0(const float *x, void *out, int k);
void quantize_row_q8_K(const float *x, void *out, int k);

/* n_tokens rows of x (each `cols` floats) -> the activation format of `ggml_type` (q8_0, q8_K,
 * f16, bf16 or f32 rows of qdot_activation_row_bytes each). 0 or a negative error code. */
int qdot_quantize_activations(int ggml_type, const float *x, int n_tokens, int cols, void *out);

/* y[t * rows + r] = dot(weight row r, activation row t) for r in [row0, row1), t in [0, n_tokens).
 * w: rows packed rows; xq: n_tokens rows from qdot_quantize_activations. Other entries of y are
 * left untouched. n_threads <= 1 runs on the calling thread; more share the rows through a
 * persistent pool of threads (cpu_qdot_pool.c). 0 or a negative error code. */
int matmul_q(const void *w, int ggml_type, int rows, int cols, const void *xq, int n_tokens, float *y,
             int row0, int row1, int n_threads);

/* One fused product: y = x @ [W_0; W_1; ...].T for n_parts (at most 8) weight matrices stacked
 * row-wise, each in its own type (w[p]: rows[p] packed rows of `cols`), x: n_tokens rows of `cols`
 * floats. x is rounded once per activation format and shared by the parts that take it; y is
 * (n_tokens, sum of rows), part p's outputs after those of the parts before it. One call, one task
 * for the threads, the same bits as matmul_q on each part. 0 or a negative error code. */
int matmul_q_parts(int n_parts, const void *const *w, const int *types, const int *rows, int cols,
                   const float *x, int n_tokens, float *y, int n_threads);

/* One token's routed experts (cpu_moe.c): for slot j < k (at most 32), out[j * dim ...] = the down
 * product of expert ids[j] applied to SwiGLU(gate, up) of its gate and up products of x (dim floats).
 * gate, up, down: each expert's packed matrix (width x dim, width x dim, dim x width), indexed by
 * expert id < n_experts. The same bits as a fused matmul_q_parts of [gate; up], qdot_swiglu and a
 * matmul_q_parts of down per slot. With weights (k floats, non-NULL), out is instead dim floats: the
 * slots' outputs each times its weight in float32 and added in slot order (infer.moe.weighted_sum).
 * 0 or a negative error code. */
int qdot_moe_row(const int *ids, int k, const void *const *gate, const void *const *up, const void *const *down,
                 int n_experts, int gate_type, int up_type, int down_type, int width, int dim, const float *x,
                 const float *weights, float *out, int n_threads);

/* dst[i] = the float value of the float16 src[i] (exact), for i < n: the engine's float16 KV cache
 * widened for attention (NumPy's conversion runs about ten times slower). */
void qdot_half_to_float(const void *src, float *dst, size_t n);

/* The layers around the products (cpu_layers.c). out[r] = RMSNorm of x's row r (rows x cols) times
 * weight, bit for bit infer.model.rms_norm (NumPy's pairwise double sum of the float32 squares). */
void qdot_rms_norm(const float *x, const float *weight, int rows, int cols, float eps, float *out);
/* Rotary embedding of x (n_tokens, n_heads, head_dim): pairs i < n_pairs rotated by cos/sin[t][i]
 * (NeoX halves or adjacent pairs), the rest copied, into out (the same shape). Bit for bit
 * infer.layers.Rope.apply (fma: its float64 form). */
void qdot_rope(const float *x, int n_tokens, int n_heads, int head_dim, int n_pairs, const float *cos,
               const float *sin, int neox, int fma, float *out);
/* What stays the same for a model's attention calls: heads, rope and scales. */
struct qdot_attn_shape {
    int n_heads, n_kv_heads, head_dim;
    int n_pairs, neox, fma;  /* qdot_rope's */
    float q_scale, scale;    /* the query times q_scale before its float16 rounding; the scores times scale */
};
/* Attention of q (n_tokens, n_heads, head_dim) over n_keys float16 slots k, v (n_keys, n_kv_heads,
 * head_dim) of positions first..: query row t (position start + t), rotated by cos/sin[t] as
 * qdot_rope does (unless cos is NULL), sees the slots up to its position, or those where
 * mask[t * n_keys + j] is nonzero. The query and the probabilities are rounded to float16, as the
 * reference does; out is (n_tokens, n_heads, head_dim). Every sum runs in a fixed order over the
 * slots a row sees, in slot order (cpu_layers.c), not NumPy's. 0 or a negative error code. */
int qdot_attention(const struct qdot_attn_shape *shape, const float *q, int n_tokens,
                   const float *cos, const float *sin, const void *k, const void *v, int n_keys, int first,
                   int start, const uint8_t *mask, float *out, int n_threads);
/* The same with a sink per query head (gpt-oss; NULL: none): sinks[h] joins head h's softmax as one
 * more logit with no value, after the keys in the sum's order. */
int qdot_attention_sinks(const struct qdot_attn_shape *shape, const float *q, int n_tokens,
                         const float *cos, const float *sin, const void *k, const void *v, int n_keys, int first,
                         int start, const uint8_t *mask, const float *sinks, float *out, int n_threads);
/* y[i] = the softmax's exp of x[i] <= 0 (cpu_layers.c's polynomial, within ~1 ulp; 0 below -87). */
void qdot_exp_softmax(const float *x, float *y, size_t n);

/* The decode step (cpu_decode.c). out[i] = silu(gate[i]) * up[i]: g / (1 + exp(-g)) * u in double,
 * rounded to float32 once, exp by a fixed polynomial (the same bits in the AVX2 and the portable code). */
void qdot_swiglu(const float *gate, const float *up, size_t n, float *out);
/* A fused product's matrices, as matmul_q_parts takes them. */
struct qdot_product {
    int n_parts;
    const void *const *w;
    const int *types, *rows;
    int cols;
};
/* What stays the same for a model's decode steps. */
struct qdot_decode_shape {
    struct qdot_attn_shape attn;
    int dim, ffn_dim;
    float eps;  /* RMSNorm's */
};
/* One dense pre-norm layer: its norms (dim), optional QKV bias (q_dim + 2 kv_dim) and per-head q/k
 * norms (head_dim), its products, and its KV cache (max positions, n_kv_heads, head_dim) float16. */
struct qdot_decode_layer {
    const float *attn_norm, *ffn_norm, *bqkv, *q_norm, *k_norm;
    struct qdot_product qkv, o, gate_up, down;
    uint16_t *keys, *values;
};
/* Floats of scratch qdot_decode_layers needs. */
long long qdot_decode_scratch_floats(const struct qdot_decode_shape *shape);
/* x (dim) through n_layers layers in place as the token at position pos (cos/sin its rope angles,
 * n_pairs each): each layer writes the token's key and value at slot pos and attends over slots
 * 0..pos. 0 or a negative error code (QDOT_ENONFINITE: a product met a NaN or infinity). */
int qdot_decode_layers(const struct qdot_decode_shape *shape, const struct qdot_decode_layer *layers, int n_layers,
                       float *x, const float *cos, const float *sin, int pos, float *scratch, int n_threads);

/* Implementations (qdot_implementation's values). AVX-512 means F + BW + VL + VNNI; its float
 * weight types (F32/F16/BF16) and the activations' rounding run the AVX2 code. */
#define QDOT_IMPL_PORTABLE 0
#define QDOT_IMPL_AVX2 1
#define QDOT_IMPL_AVX512 2
/* Implementation in use: a QDOT_IMPL_* (nonzero: the AVX2 instructions are there). The initial
 * choice is the best the CPU runs (AVX-512, else AVX2 with F16C, else portable); the environment
 * variable NVMEDIRECT_CPU_KERNELS=avx2 caps it at AVX2, =portable forces portable C. */
int qdot_implementation(void);
/* Force an implementation (a QDOT_IMPL_*; 1 = AVX2 and 0 = portable as before); QDOT_ENOIMPL if
 * the CPU cannot run it. */
int qdot_set_implementation(int impl);
/* Whether this CPU can run the AVX2 path, the AVX-512 path. */
int qdot_cpu_has_avx2(void);
int qdot_cpu_has_avx512(void);

#endif
