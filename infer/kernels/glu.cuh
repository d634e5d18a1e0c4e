// The gated activation of a feed-forward (SiLU or GELU of the gate times up), rounded to the down
// product's activation format: ops.cu glu_round's rows, and the last block of qmm.cu's
// qgemv_id_glu (a decode step's gate/up product of routed experts, arrival.cuh).
#pragma once
#include "act.cuh"

// SiLU(gate) * up in float32, each operation rounded: gate / (1 + exp(-gate)) * up
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
}

// GELU(gate) * up, GELU's tanh form in float32 (Gemma's GeGLU, as llama.cpp's CUDA computes it):
// 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))) * up
__device__ __forceinline__ float gelu_mul(float g, float u) {
    const float inner = __fmul_rn(__fmul_rn(0.7978845608028654f, g), __fmaf_rn(__fmul_rn(0.044715f, g), g, 1.f));
    return __fmul_rn(__fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.f, tanhf(inner))), u);
}

__device__ __forceinline__ float glu(float g, float u, int gelu) { return gelu ? gelu_mul(g, u) : silu_mul(g, u); }

// Row gr = [gate (n) | up (n)] (up at gr + n) of glu_round: ff = glu(gate, up), rounded to the
// down projection's activation format `fmt`: its 8-bit form o8 for q8_0/q8_k, and/or the rounded
// float32 values in yr; hr (optional) the values before rounding as float16. The float formats:
// value i by thread `first_thread` + i * `thread_stride`; the 8-bit ones: a warp an 8-bit group
// (q8_0: 32 values, q8_k: 256), group g by warp `first_warp` + g * `warp_stride`. The inputs are
// read past L1 (__ldcg): another block of the launch may have written them (arrival.cuh).
__device__ __forceinline__ void glu_round_row(const float* gr, int n, float* yr, __half* hr, int fmt, Int8Out o8,
                                              int gelu, int first_thread, int thread_stride, int first_warp,
                                              int warp_stride) {
    const float* ur = gr + n;
    const int lane = threadIdx.x & 31;
    if (fmt == ACT_F32 || fmt == ACT_F16 || fmt == ACT_BF16) {
        for (int i = first_thread; i < n; i += thread_stride) {
            const float v = glu(__ldcg(gr + i), __ldcg(ur + i), gelu);
            yr[i] = round_float(v, fmt);
            if (hr) hr[i] = __float2half_rn(v);
        }
        return;
    }
    if (fmt == ACT_Q8_0) {
        for (int g = first_warp; g < n / 32; g += warp_stride) {
            const int i = g * 32 + lane;
            const float v[1] = {glu(__ldcg(gr + i), __ldcg(ur + i), gelu)};
            if (hr) hr[i] = __float2half_rn(v[0]);
            quantize_group<1>(v, g, fmt, yr ? yr + g * 32 : nullptr, nullptr, o8);
        }
    } else {
        for (int g = first_warp; g < n / 256; g += warp_stride) {
            const int i = g * 256 + lane * 8;
            float v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = glu(__ldcg(gr + i + k), __ldcg(ur + i + k), gelu);
            if (hr) {
                uint4 h;
                h.x = half2_bits(v[0], v[1]), h.y = half2_bits(v[2], v[3]), h.z = half2_bits(v[4], v[5]);
                h.w = half2_bits(v[6], v[7]);
                reinterpret_cast<uint4*>(hr + i)[0] = h;
            }
            quantize_group<8>(v, g, fmt, yr ? yr + g * 256 : nullptr, nullptr, o8);
        }
    }
}
