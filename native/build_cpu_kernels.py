"""cffi build script (API mode) for the quantized CPU product kernels (native/cpu_qdot*.c).

Built by `pip install -e .` through setup.py's cffi_modules, or standalone for development:
`python native/build_cpu_kernels.py` compiles under build/cpu_kernels/ and copies the extension
into infer/. The AVX2 functions carry their own target attribute, so the module is compiled for the
baseline ISA and still loads on CPUs without AVX2 (they run the portable code); likewise the AVX-512
functions (cpu_qdot_avx512.c), chosen at run time where the CPU has them.
"""

import shutil
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CDEF = r"""
long long qdot_weight_row_bytes(int ggml_type, int cols);
long long qdot_activation_row_bytes(int ggml_type, int cols);
void quantize_row_q8_0(const float *x, void *out, int k);
void quantize_row_q8_K(const float *x, void *out, int k);
int qdot_quantize_activations(int ggml_type, const float *x, int n_tokens, int cols, void *out);
int matmul_q(const void *w, int ggml_type, int rows, int cols, const void *xq, int n_tokens, float *y,
             int row0, int row1, int n_threads);
int matmul_q_parts(int n_parts, const void *const *w, const int *types, const int *rows, int cols,
                   const float *x, int n_tokens, float *y, int n_threads);
void qdot_half_to_float(const void *src, float *dst, size_t n);
void qdot_rms_norm(const float *x, const float *weight, int rows, int cols, float eps, float *out);
void qdot_rope(const float *x, int n_tokens, int n_heads, int head_dim, int n_pairs, const float *cos,
               const float *sin, int neox, int fma, float *out);
struct qdot_attn_shape {
    int n_heads, n_kv_heads, head_dim;
    int n_pairs, neox, fma;
    float q_scale, scale;
};
int qdot_attention(const struct qdot_attn_shape *shape, const float *q, int n_tokens,
                   const float *cos, const float *sin, const void *k, const void *v, int n_keys, int first,
                   int start, const uint8_t *mask, float *out, int n_threads);
int qdot_attention_sinks(const struct qdot_attn_shape *shape, const float *q, int n_tokens,
                         const float *cos, const float *sin, const void *k, const void *v, int n_keys, int first,
                         int start, const uint8_t *mask, const float *sinks, float *out, int n_threads);
void qdot_exp_softmax(const float *x, float *y, size_t n);
void qdot_swiglu(const float *gate, const float *up, size_t n, float *out);
struct qdot_product {
    int n_parts;
    const void *const *w;
    const int *types, *rows;
    int cols;
};
struct qdot_decode_shape {
    struct qdot_attn_shape attn;
    int dim, ffn_dim;
    float eps;
};
struct qdot_decode_layer {
    const float *attn_norm, *ffn_norm, *bqkv, *q_norm, *k_norm;
    struct qdot_product qkv, o, gate_up, down;
    uint16_t *keys, *values;
};
long long qdot_decode_scratch_floats(const struct qdot_decode_shape *shape);
int qdot_decode_layers(const struct qdot_decode_shape *shape, const struct qdot_decode_layer *layers, int n_layers,
                       float *x, const float *cos, const float *sin, int pos, float *scratch, int n_threads);
int qdot_moe_row(const int *ids, int k, const void *const *gate, const void *const *up, const void *const *down,
                 int n_experts, int gate_type, int up_type, int down_type, int width, int dim, const float *x,
                 const float *weights, float *out, int n_threads);
int qdot_implementation(void);
int qdot_set_implementation(int impl);
int qdot_cpu_has_avx2(void);
int qdot_cpu_has_avx512(void);
"""

# The kernels' files, compiled as one translation unit (their helpers are static inline, and the
# kernels inline into their dispatchers) in this order; cpu_qdot_common.h holds what they share.
SOURCES = ["cpu_qdot_quant.c", "cpu_qdot_portable.c", "cpu_qdot_avx2_legacy.c", "cpu_qdot_avx2_k.c",
           "cpu_qdot_avx512.c", "cpu_qdot_ggml.c", "cpu_qdot_mxfp4.c", "cpu_qdot_pool.c", "cpu_qdot.c", "cpu_moe.c", "cpu_layers.c",
           "cpu_decode.c"]
HEADERS = ["cpu_qdot.h", "cpu_qdot_common.h"]
# Their text is inlined (as build_vfio.py does) so the setuptools build needs no source paths; #line
# keeps the compiler's messages pointing at the real files.
SOURCE = "".join(f'#line 1 "native/{name}"\n' + (HERE / name).read_text() for name in SOURCES)

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
# -ffp-contract=off: the bit-identity of the AVX2 and portable paths needs every a * b + c rounded
# twice, never fused. -pthread: the pool of threads over output rows (cpu_qdot_pool.c).
ffibuilder.set_source("infer._cpu_kernels", SOURCE, include_dirs=[str(HERE)],
                      extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"], extra_link_args=["-pthread"],
                      depends=[str(HERE / name) for name in SOURCES + HEADERS])

if __name__ == "__main__":
    built = Path(ffibuilder.compile(tmpdir=str(ROOT / "build" / "cpu_kernels"), verbose=True))
    target = ROOT / "infer" / built.name
    # a new file renamed over the old one: a process that has the old one loaded keeps its pages
    # (copying over it in place would change the code under that process)
    staged = target.with_name(target.name + ".new")
    shutil.copyfile(built, staged)
    staged.replace(target)
    print(f"installed {target}")
