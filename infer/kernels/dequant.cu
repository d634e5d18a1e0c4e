// Planar weights -> plain numbers: whole matrices to float16 for the batched (cuBLAS) prompt path,
// and selected rows to float32 for the token embedding lookup. One thread per 32-weight sub-block.
#include "formats.cuh"
#include "pdl.cuh"

template <class F>
__device__ __forceinline__ void dequant_matrix(Planes p, long long n_sb, __half* out) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n_sb) return;
    float v[32];
    F::dequant(F::load(p, g), v);
    uint4* dst = reinterpret_cast<uint4*>(out + g * 32);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        __half2 h[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) h[k] = __floats2half2_rn(v[8 * c + 2 * k], v[8 * c + 2 * k + 1]);
        dst[c] = *reinterpret_cast<uint4*>(h);
    }
}

// out[i, :] = W[ids[i], :] * scale for i < n (scale 1 leaves the bits); ids outside [0, rows) give a row of zeros
template <class F>
__device__ __forceinline__ void embed_rows(Planes p, int rows, int K, const int* ids, int n, float* out, float scale) {
    const int nsb = K >> 5;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)n * nsb) return;
    const int i = (int)(g / nsb), sb = (int)(g % nsb);
    const int row = ids[i];
    float4* dst = reinterpret_cast<float4*>(out + (long long)i * K + sb * 32);
    if (row < 0 || row >= rows) {
#pragma unroll
        for (int c = 0; c < 8; ++c) dst[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        return;
    }
    float v[32];
    F::dequant(F::load(p, (long long)row * nsb + sb), v);
#pragma unroll
    for (int k = 0; k < 32; ++k) v[k] = __fmul_rn(v[k], scale);
#pragma unroll
    for (int c = 0; c < 8; ++c) dst[c] = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
}

template <typename T>
__device__ __forceinline__ void embed_rows_float(const T* w, int rows, int K, const int* ids, int n, float* out,
                                                 float scale) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)n * K) return;
    const int i = (int)(g / K), k = (int)(g % K);
    const int row = ids[i];
    out[g] = (row < 0 || row >= rows) ? 0.f : __fmul_rn(to_float(w[(long long)row * K + k]), scale);
}

template <typename T>
__device__ __forceinline__ void to_half(const T* w, long long n, __half* out) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g < n) out[g] = __float2half_rn(to_float(w[g]));
}

#define DEQUANT_QUANT(NAME, F)                                                                              \
    extern "C" __global__ void dequant_##NAME(const uint8_t* qs, const uint8_t* hi, const uint8_t* sm,      \
                                              const uint8_t* dm, long long n_sb, __half* out) {             \
        dequant_matrix<F>(Planes{qs, hi, sm, dm}, n_sb, out);                                               \
    }                                                                                                       \
    extern "C" __global__ void embed_##NAME(const uint8_t* qs, const uint8_t* hi, const uint8_t* sm,        \
                                            const uint8_t* dm, int rows, int K, const int* ids, int n,      \
                                            float* out, float scale) {                                      \
        pdl_enter();                                                                                        \
        embed_rows<F>(Planes{qs, hi, sm, dm}, rows, K, ids, n, out, scale);                                 \
    }

#define DEQUANT_FLOAT(NAME, T)                                                                              \
    extern "C" __global__ void dequant_##NAME(const uint8_t* qs, const uint8_t* hi, const uint8_t* sm,      \
                                              const uint8_t* dm, long long n, __half* out) {                \
        to_half<T>(reinterpret_cast<const T*>(qs), n, out);                                                 \
    }                                                                                                       \
    extern "C" __global__ void embed_##NAME(const uint8_t* qs, const uint8_t* hi, const uint8_t* sm,        \
                                            const uint8_t* dm, int rows, int K, const int* ids, int n,      \
                                            float* out, float scale) {                                      \
        pdl_enter();                                                                                        \
        embed_rows_float<T>(reinterpret_cast<const T*>(qs), rows, K, ids, n, out, scale);                   \
    }

DEQUANT_QUANT(q8, FmtQ8)
DEQUANT_QUANT(g4, FmtG4)
DEQUANT_QUANT(g5, FmtG5)
DEQUANT_QUANT(k4, FmtK4)
DEQUANT_QUANT(k5, FmtK5)
DEQUANT_QUANT(k6, FmtK6)
DEQUANT_FLOAT(f16, __half)
DEQUANT_FLOAT(bf16, __nv_bfloat16)
DEQUANT_FLOAT(f32, float)
