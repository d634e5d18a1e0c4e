// A mixture of experts' per-row steps, for moe.cu's launches and for the product kernels that end
// with them (qmm.cu: the last block of a decode step's router or down product, arrival.cuh).
#pragma once
#include "formats.cuh"

#define WEIGHTS_SUM_FLOOR 6.103515625e-5f  // infer/moe.py: float16's smallest normal

// A float32 sum carried with its rounding error (Neumaier): the CPU takes these sums in double, which
// costs 64 times more than float32 on the RTX cards; this keeps about double's accuracy for the few
// hundred terms of a router row, in any order the warp adds them.
struct WideSum {
    float s = 0.f, c = 0.f;
    // the rounding error of t = a + b (Neumaier's branch: exact for any order of a and b)
    static __device__ __forceinline__ float error_of(float a, float b, float t) {
        return fabsf(a) >= fabsf(b) ? __fadd_rn(__fsub_rn(a, t), b) : __fadd_rn(__fsub_rn(b, t), a);
    }
    __device__ __forceinline__ void add(float v) {
        const float t = __fadd_rn(s, v);
        c = __fadd_rn(c, error_of(s, v, t));
        s = t;
    }
    // another wide sum into this one: symmetric in the two, so the lanes of a butterfly all end
    // with the same sum
    __device__ __forceinline__ void join(float other_s, float other_c) {
        const float t = __fadd_rn(s, other_s);
        c = __fadd_rn(__fadd_rn(c, other_c), error_of(s, other_s, t));
        s = t;
    }
    __device__ __forceinline__ float value() const { return __fadd_rn(s, c); }
};

// (probability, id) pairs in descending probability, ties to the lower id: a before b.
__device__ __forceinline__ bool ranks_before(float pa, int ea, float pb, int eb) {
    return pa > pb || (pa == pb && ea < eb);
}

// Row r of logits (n, E) routed by one warp (every lane calls it), k <= 32: softmax (exp(l - max)
// in float32; their sum carried wide, each lane over its own experts, then joined across the warp;
// each exp times the float32 reciprocal of the sum), the k most
// probable experts, most probable first (ties: the lower id), into ids[row * k + j]; their
// probabilities into weights, divided by their sum (carried wide in rank order, floored) when
// `normalize`. Lane j keeps the j-th pick and writes it. Rows whose `live` entry is 0 (the null rows
// padding a pass; live may be null: every row) get ids -1: no expert reads its weights.
__device__ __forceinline__ void route_row(const float* logits, int r, int E, int k, int normalize, const int* live,
                                          int* ids, float* weights, float* p) {
    const int lane = threadIdx.x & 31;
    int* out_ids = ids + (long long)r * k;
    float* out_w = weights + (long long)r * k;
    if (live && !live[r]) {
        if (lane < k) {
            out_ids[lane] = -1;
            out_w[lane] = 0.f;
        }
        return;
    }
    const float* l = logits + (long long)r * E;
    // p: the row's probabilities (E floats of shared memory, the warp's own); a lane reads and
    // writes only its own entries e = lane + 32 i
    float mx = NEG_INF;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, __ldcg(l + e));
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    WideSum sum;
    for (int e = lane; e < E; e += 32) {
        const float ex = expf(__fsub_rn(__ldcg(l + e), mx));
        p[e] = ex;
        sum.add(ex);
    }
    for (int o = 16; o; o >>= 1)
        sum.join(__shfl_xor_sync(0xffffffffu, sum.s, o), __shfl_xor_sync(0xffffffffu, sum.c, o));
    const float inverse = __frcp_rn(sum.value());
    for (int e = lane; e < E; e += 32) p[e] = __fmul_rn(p[e], inverse);
    // selection in descending (probability, -id) order: each pick is the best after the previous one
    float prev_p = __int_as_float(0x7f800000u), my_p = 0.f;
    int prev_e = -1, my_e = -1;
    WideSum total;
    for (int j = 0; j < k; ++j) {
        float best_p = -1.f;
        int best_e = -1;
        for (int e = lane; e < E; e += 32) {
            const float pe = p[e];
            if (ranks_before(prev_p, prev_e, pe, e) && pe > best_p) {  // after the previous pick
                best_p = pe;
                best_e = e;
            }
        }
        for (int o = 16; o; o >>= 1) {
            const float other_p = __shfl_xor_sync(0xffffffffu, best_p, o);
            const int other_e = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (other_e >= 0 && (best_e < 0 || ranks_before(other_p, other_e, best_p, best_e))) {
                best_p = other_p;
                best_e = other_e;
            }
        }
        if (lane == j) {
            my_p = best_p;
            my_e = best_e;
        }
        total.add(best_p);  // every lane the same sum
        prev_p = best_p;
        prev_e = best_e;
    }
    if (lane < k) {
        out_ids[lane] = my_e;
        out_w[lane] = normalize ? __fdiv_rn(my_p, fmaxf(total.value(), WEIGHTS_SUM_FLOOR)) : my_p;
    }
}

// x[r, c] += sum_j weights[r, j] * outs[r * k + j, c] over the k slots in order (each product in
// float32, then added one after another: infer/moe.py weighted_sum), + shared[r, c] * (silu(g) / g)
// with g = gate[r] (qwen2moe's shared expert; shared null: none), then the residual add. Pair j's
// output is row slot[j] of outs (moe_group's positions), or row j when slot is null. A null row
// (ids -1, moe_route) is left as it is, as the CPU leaves it.
__device__ __forceinline__ void combine_at(const float* outs, const int* ids, const float* weights, int k, int dim,
                                           const int* slot, const float* shared, const float* gate, float* x,
                                           long long r, int c) {
    if (ids[r * k] < 0) return;
    const float* w = weights + r * k;
    auto out = [&](int j) { return __ldcg(outs + (slot ? (long long)slot[r * k + j] : r * k + j) * dim + c); };
    float t = __fmul_rn(out(0), w[0]);
    for (int j = 1; j < k; ++j) t = __fadd_rn(t, __fmul_rn(out(j), w[j]));
    if (shared) {
        const float g = gate[r];
        const float scale = __fdiv_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), g);
        t = __fadd_rn(t, __fmul_rn(shared[r * dim + c], scale));
    }
    x[r * dim + c] = __fadd_rn(x[r * dim + c], t);
}
