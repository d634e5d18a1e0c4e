// Matrix-vector products y = W x for decode, one warp per output row, weights read straight from
// the planar formats of formats.cuh. Each lane takes every 32nd sub-block of its row and issues four
// sub-blocks' (GEMV_UNROLL) loads before using any of them, so a warp keeps ~2 KB of weights in flight; x (float32)
// is re-read from L1/L2 by every warp. Sums are kept in double (formats.cuh says why) and rounded to
// float32 once per row. Fused epilogues: + bias, + residual (y may alias residual: each element is
// read and written by the same lane), and SiLU(gate)*up for the FFN.
#include "formats.cuh"
#include "act.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 4  // rows (warps) per block
#endif
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 4  // sub-blocks (16-byte pieces for float formats) in flight per lane
#endif

// SiLU(gate) * up of two float32 outputs, evaluated in double and rounded once, as the CPU engine
// does: both sides round the same float32 inputs to the same float32 result
__device__ __forceinline__ float swiglu(float gate, float up) {
    const double g = gate;
    return (float)(g / (1.0 + exp(-g)) * (double)up);
}

// Sum over one row's sub-blocks sb = lane, lane + 32, ... of dot(raw sub-block, sb): GEMV_UNROLL
// sub-blocks' loads are issued before the first is used.
template <class F, class Dot>
__device__ __forceinline__ double row_sum(const Planes& p, long long base, int nsb, int lane, Dot dot) {
    double acc = 0.0;
    int sb = lane;
    for (; sb + 32 * (GEMV_UNROLL - 1) < nsb; sb += 32 * GEMV_UNROLL) {
        typename F::Raw r[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) r[u] = F::load(p, base + sb + 32 * u);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) acc += dot(r[u], sb + 32 * u);
    }
    for (; sb < nsb; sb += 32) acc += dot(F::load(p, base + sb), sb);
    return acc;
}

template <class F>
__device__ __forceinline__ double row_dot(const Planes& p, long long base, int nsb, int lane, const float* x) {
    return row_sum<F>(p, base, nsb, lane,
                      [x](const typename F::Raw& r, int s) { return F::dot(r, x + (s << 5)); });
}

// The same with 8-bit activations: xq int8 values, xs their scales (one per 32 or per 256 values,
// F::XS_SHIFT), xsum the sums of xq per 32
template <class F>
__device__ __forceinline__ double row_dot8(const Planes& p, long long base, int nsb, int lane, const signed char* xq,
                                          const float* xs, const int* xsum) {
    return row_sum<F>(p, base, nsb, lane, [xq, xs, xsum](const typename F::Raw& r, int s) {
        const int4* xv = reinterpret_cast<const int4*>(xq + (s << 5));
        return F::dot8(r, __ldg(xv), __ldg(xv + 1), __ldg(xs + (s >> F::XS_SHIFT)), __ldg(xsum + s));
    });
}

// Two rows of two matrices (gate and up) against the same 8-bit activations: both rows' loads are
// issued together (twice the bytes in flight per lane) and each x piece is read once for both.
template <class F>
__device__ __forceinline__ void row_dot8_pair(const Planes& pg, const Planes& pu, long long base, int nsb, int lane,
                                              const signed char* xq, const float* xs, const int* xsum, double& a,
                                              double& b) {
    a = 0.0;
    b = 0.0;
    int sb = lane;
    for (; sb + 32 * (GEMV_UNROLL - 1) < nsb; sb += 32 * GEMV_UNROLL) {
        typename F::Raw rg[GEMV_UNROLL], ru[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            rg[u] = F::load(pg, base + sb + 32 * u);
            ru[u] = F::load(pu, base + sb + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int s = sb + 32 * u;
            const int4* xv = reinterpret_cast<const int4*>(xq + (s << 5));
            const int4 x0 = __ldg(xv), x1 = __ldg(xv + 1);
            const float sc = __ldg(xs + (s >> F::XS_SHIFT));
            const int sum = __ldg(xsum + s);
            a += F::dot8(rg[u], x0, x1, sc, sum);
            b += F::dot8(ru[u], x0, x1, sc, sum);
        }
    }
    for (; sb < nsb; sb += 32) {
        const int4* xv = reinterpret_cast<const int4*>(xq + (sb << 5));
        const int4 x0 = __ldg(xv), x1 = __ldg(xv + 1);
        const float sc = __ldg(xs + (sb >> F::XS_SHIFT));
        const int sum = __ldg(xsum + sb);
        a += F::dot8(F::load(pg, base + sb), x0, x1, sc, sum);
        b += F::dot8(F::load(pu, base + sb), x0, x1, sc, sum);
    }
}

template <typename T>
__device__ __forceinline__ double row_dot_float(const T* w, int K, int lane, const float* x) {
    double acc = 0.0;
    constexpr int VEC = 16 / sizeof(T);
    if (K % VEC == 0) {
        const uint4* w4 = reinterpret_cast<const uint4*>(w);
        const int n = K / VEC;
        int c = lane;
        for (; c + 32 * (GEMV_UNROLL - 1) < n; c += 32 * GEMV_UNROLL) {
            uint4 r[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) r[u] = __ldg(w4 + c + 32 * u);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) acc += dot16<T>(r[u], x + (c + 32 * u) * VEC);
        }
        for (; c < n; c += 32) acc += dot16<T>(__ldg(w4 + c), x + c * VEC);
    } else {
        for (int k = lane; k < K; k += 32) acc = fma((double)to_float(w[k]), (double)x[k], acc);
    }
    return acc;
}

// the row's sum rounded to float32, then + bias, + residual in float32 (the CPU engine's order)
// (y and residual at offset `off`: the vector's output row)
__device__ __forceinline__ void store_row(double acc, int row, float* y, const float* bias, const float* residual,
                                          int off) {
    float v = (float)acc;
    if (bias) v += bias[row];
    if (residual) v += residual[off + row];
    y[off + row] = v;
}

template <class F>
__device__ __forceinline__ void gemv_quant(int block, Planes p, int rows, int K, const float* x, float* y, const float* bias,
                                           const float* residual, int off) {
    const int lane = threadIdx.x & 31;
    const int row = block * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int nsb = K >> 5;
    const double acc = warp_sum(row_dot<F>(p, (long long)row * nsb, nsb, lane, x));
    if (lane == 0) store_row(acc, row, y, bias, residual, off);
}

template <class F>
__device__ __forceinline__ void gemv_swiglu_quant(int block, Planes g, Planes u, int rows, int K, const float* x, float* y,
                                                  int off) {
    const int lane = threadIdx.x & 31;
    const int row = block * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int nsb = K >> 5;
    const long long base = (long long)row * nsb;
    const double a = warp_sum(row_dot<F>(g, base, nsb, lane, x));
    const double b = warp_sum(row_dot<F>(u, base, nsb, lane, x));
    if (lane == 0) y[off + row] = swiglu((float)a, (float)b);
}

template <class F>
__device__ __forceinline__ void gemv8_quant(int block, Planes p, int rows, int K, const signed char* xq, const float* xs,
                                            const int* xsum, float* y, const float* bias, const float* residual,
                                            int off) {
    const int lane = threadIdx.x & 31;
    const int row = block * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int nsb = K >> 5;
    const double acc = warp_sum(row_dot8<F>(p, (long long)row * nsb, nsb, lane, xq, xs, xsum));
    if (lane == 0) store_row(acc, row, y, bias, residual, off);
}

template <class F>
__device__ __forceinline__ void gemv8_swiglu_quant(int block, Planes g, Planes u, int rows, int K, const signed char* xq,
                                                   const float* xs, const int* xsum, float* y, int off) {
    const int lane = threadIdx.x & 31;
    const int row = block * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int nsb = K >> 5;
    const long long base = (long long)row * nsb;
    double a, b;
    row_dot8_pair<F>(g, u, base, nsb, lane, xq, xs, xsum, a, b);
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) y[off + row] = swiglu((float)a, (float)b);
}

template <typename T>
__device__ __forceinline__ void gemv_float(int block, const T* w, int rows, int K, const float* x, float* y, const float* bias,
                                           const float* residual, int off) {
    const int lane = threadIdx.x & 31;
    const int row = block * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const double acc = warp_sum(row_dot_float<T>(w + (long long)row * K, K, lane, x));
    if (lane == 0) store_row(acc, row, y, bias, residual, off);
}

template <typename T>
__device__ __forceinline__ void gemv_swiglu_float(int block, const T* wg, const T* wu, int rows, int K, const float* x, float* y,
                                                  int off) {
    const int lane = threadIdx.x & 31;
    const int row = block * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const double a = warp_sum(row_dot_float<T>(wg + (long long)row * K, K, lane, x));
    const double b = warp_sum(row_dot_float<T>(wu + (long long)row * K, K, lane, x));
    if (lane == 0) y[off + row] = swiglu((float)a, (float)b);
}

// One signature for every format, so the Python side launches them alike: (qs, hi, sm, dm) are the
// planes (float formats use qs only). Many input vectors (a token tree's nodes): grid y = vector v of
// nvec, which takes its input at x + v*K (8-bit forms: xq + v*K, its scales and sums likewise) and
// writes y + v*ldy (the residual likewise). Every vector runs the one-vector code unchanged (a decode
// step is v = 0 of 1), so each node gets exactly the numbers it would get alone in a decode step.
// One vector per block (a loop over vectors made ptxas spill), the output's offset passed as `off`
// or folded into y: the same addresses either way; each wrapper uses the form with which ptxas
// keeps every kernel free of spills (tests/infer/test_kernels_compile.py checks both variants).
#define THIS_VECTOR const int v = blockIdx.y;  // 32-bit offsets below: v*K and v*ldy stay under 2^31
#define GEMV_QUANT(NAME, F)                                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv_##NAME(const uint8_t* qs, const uint8_t* hi, const uint8_t* sm, const uint8_t* dm, int rows, int K, \
                    const float* x, float* y, const float* bias, const float* residual, int ldy, int nvec) {  \
        THIS_VECTOR                                                                                       \
        gemv_quant<F>(blockIdx.x, Planes{qs, hi, sm, dm}, rows, K, x + v * K, y, bias, residual, v * ldy);      \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv_swiglu_##NAME(const uint8_t* gqs, const uint8_t* ghi, const uint8_t* gsm, const uint8_t* gdm,    \
                           const uint8_t* uqs, const uint8_t* uhi, const uint8_t* usm, const uint8_t* udm,    \
                           int rows, int K, const float* x, float* y, int ldy, int nvec) {                    \
        THIS_VECTOR                                                                                       \
        gemv_swiglu_quant<F>(blockIdx.x, Planes{gqs, ghi, gsm, gdm}, Planes{uqs, uhi, usm, udm}, rows, K,  \
                                 x + v * K, y, v * ldy);                                                     \
    }

#define GEMV8_QUANT(NAME, F)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv8_##NAME(const uint8_t* qs, const uint8_t* hi, const uint8_t* sm, const uint8_t* dm, int rows, int K, \
                     const signed char* xq, const float* xs, const int* xsum, float* y, const float* bias,     \
                     const float* residual, int ldy, int nvec) {                                              \
        THIS_VECTOR                                                                                       \
        gemv8_quant<F>(blockIdx.x, Planes{qs, hi, sm, dm}, rows, K, xq + v * K,                               \
                       xs + v * (K >> (5 + F::XS_SHIFT)), xsum + v * (K >> 5), y, bias, residual, v * ldy);   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv8_swiglu_##NAME(const uint8_t* gqs, const uint8_t* ghi, const uint8_t* gsm, const uint8_t* gdm,   \
                            const uint8_t* uqs, const uint8_t* uhi, const uint8_t* usm, const uint8_t* udm,   \
                            int rows, int K, const signed char* xq, const float* xs, const int* xsum, float* y, \
                            int ldy, int nvec) {                                                              \
        THIS_VECTOR                                                                                       \
        gemv8_swiglu_quant<F>(blockIdx.x, Planes{gqs, ghi, gsm, gdm}, Planes{uqs, uhi, usm, udm}, rows, K, \
                                  xq + v * K, xs + v * (K >> (5 + F::XS_SHIFT)), xsum + v * (K >> 5),         \
                                  y + v * ldy, 0);                                                               \
    }

#define GEMV_FLOAT(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv_##NAME(const uint8_t* qs, const uint8_t* hi, const uint8_t* sm, const uint8_t* dm, int rows, int K, \
                    const float* x, float* y, const float* bias, const float* residual, int ldy, int nvec) {  \
        THIS_VECTOR                                                                                       \
        gemv_float<T>(blockIdx.x, reinterpret_cast<const T*>(qs), rows, K, x + v * K, y, bias, residual,      \
                      v * ldy);                                                                               \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv_swiglu_##NAME(const uint8_t* gqs, const uint8_t* ghi, const uint8_t* gsm, const uint8_t* gdm,    \
                           const uint8_t* uqs, const uint8_t* uhi, const uint8_t* usm, const uint8_t* udm,    \
                           int rows, int K, const float* x, float* y, int ldy, int nvec) {                    \
        THIS_VECTOR                                                                                       \
        gemv_swiglu_float<T>(blockIdx.x, reinterpret_cast<const T*>(gqs), reinterpret_cast<const T*>(uqs), \
                                 rows, K, x + v * K, y, v * ldy);                                              \
    }

GEMV_QUANT(q8, FmtQ8)
GEMV_QUANT(g4, FmtG4)
GEMV_QUANT(g5, FmtG5)
GEMV_QUANT(k4, FmtK4)
GEMV_QUANT(k5, FmtK5)
GEMV_QUANT(k6, FmtK6)
GEMV8_QUANT(q8, FmtQ8)
GEMV8_QUANT(g4, FmtG4)
GEMV8_QUANT(g5, FmtG5)
GEMV8_QUANT(k4, FmtK4)
GEMV8_QUANT(k5, FmtK5)
GEMV8_QUANT(k6, FmtK6)
GEMV_FLOAT(f16, __half)
GEMV_FLOAT(bf16, __nv_bfloat16)
GEMV_FLOAT(f32, float)
