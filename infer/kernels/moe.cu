// A mixture of experts' steps around its products (the products themselves: qmm.cu's qgemv_id),
// for the rows of a pass, in the order infer/moe.py computes them on the CPU (llama.cpp's
// llm_build_moe_ffn), so a row gets the same bits in any pass and the choice of experts matches the
// CPU's up to the last bit of an exp:
//   moe_route    router logits -> the top-k experts and their weights
//   moe_group    the (row, slot) pairs sorted by expert, for products that read an expert once
//                (qmm.cu qmm_id), and moe_gather8 their input rows in that order
//   moe_combine  x += sum over slots of weight * expert output (+ the shared expert's, gated)
//   moe_combine_norm  the same, then the next layer's input RMSNorm of x (ops.cu rmsnorm8's outputs)
#include "formats.cuh"
#include "act.cuh"
#include "pdl.cuh"

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

// A block of ROUTE_THREADS threads per row of logits (n, E), k <= 32; dynamic shared memory: E
// floats, then the k picks (probability, id). Warp 0 takes the softmax: exp(l - max) in float32,
// their sum carried wide, each lane over its own experts e = lane + 32 i, then joined across the
// warp; each exp times the float32 reciprocal of the sum. Then every thread ranks its experts: the
// rank of e is the number of experts before it in descending (probability, -id) order (ties: the
// lower id first), so the k most probable experts, most probable first, are ranks 0 .. k - 1, all
// found in one step (k warp-wide arg-maxes one after another took most of the kernel's 5 us a
// decode step on the H100). A NaN probability ranks nowhere (no comparison with it holds), and a
// slot no expert fills keeps id -1, probability -1, as the serial picks left it. The k picks' sum
// is carried wide in rank order; their probabilities go to weights divided by it (floored) when
// `normalize`. Rows whose `live` entry is 0 (the null rows padding a pass; live may be null: every
// row) get ids -1: no expert reads its weights.
#define ROUTE_THREADS 128
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route(const float* logits, int n, int E, int k, int normalize, const int* live, int* ids, float* weights) {
    pdl_enter();
    extern __shared__ float route_probs[];
    float* p = route_probs;
    float* pick_p = p + E;
    int* pick_e = reinterpret_cast<int*>(pick_p + k);
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    int* out_ids = ids + (long long)r * k;
    float* out_w = weights + (long long)r * k;
    if (live && !live[r]) {
        if (tid < k) {
            out_ids[tid] = -1;
            out_w[tid] = 0.f;
        }
        return;  // the whole block
    }
    if (tid < k) {
        pick_p[tid] = -1.f;
        pick_e[tid] = -1;
    }
    if (tid < 32) {
        const float* l = logits + (long long)r * E;
        float mx = NEG_INF;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        WideSum sum;
        for (int e = lane; e < E; e += 32) {
            const float ex = expf(__fsub_rn(l[e], mx));
            p[e] = ex;
            sum.add(ex);
        }
        for (int o = 16; o; o >>= 1)
            sum.join(__shfl_xor_sync(0xffffffffu, sum.s, o), __shfl_xor_sync(0xffffffffu, sum.c, o));
        const float inverse = __frcp_rn(sum.value());
        for (int e = lane; e < E; e += 32) p[e] = __fmul_rn(p[e], inverse);
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        const float pe = p[e];
        int before = 0, before2 = 0;  // two counts: independent adds
        int f = 0;
        for (; f + 1 < E; f += 2) {
            before += ranks_before(p[f], f, pe, e);
            before2 += ranks_before(p[f + 1], f + 1, pe, e);
        }
        if (f < E) before += ranks_before(p[f], f, pe, e);
        const int rank = before + before2;
        if (rank < k && pe == pe) {  // pe == pe: not NaN
            pick_p[rank] = pe;
            pick_e[rank] = e;
        }
    }
    __syncthreads();
    if (tid < 32) {
        WideSum total;  // every lane the same sum, in rank order
        for (int j = 0; j < k; ++j) total.add(pick_p[j]);
        if (lane < k) {
            const float pj = pick_p[lane];
            out_ids[lane] = pick_e[lane];
            out_w[lane] = normalize ? __fdiv_rn(pj, fmaxf(total.value(), WEIGHTS_SUM_FLOOR)) : pj;
        }
    }
}

// The pass's pairs (ids: an expert, or < 0 for a null row's) sorted by expert, one block of 1024
// threads, 2 * E ints of dynamic shared memory: starts[e] the first sorted position of expert e's
// pairs (starts[E]: the pairs that have an expert), tiles[e] the first of its token tiles of `bn`
// pairs (tiles[E]: their count), order[pos] the pair at sorted position pos, slot[j] pair j's
// position (-1: none). Positions within an expert follow the atomics' order: a pair's product does
// not depend on where it sits (canonical sums), so nothing downstream depends on that order.
extern "C" __global__ void moe_group(const int* ids, int pairs, int E, int bn, int* starts, int* tiles, int* order,
                                     int* slot) {
    pdl_enter();
    extern __shared__ int group_counts[];  // counts, then each expert's next free position
    int* fill = group_counts + E;
    const int tid = threadIdx.x, lane = tid & 31;
    for (int e = tid; e < E; e += blockDim.x) group_counts[e] = 0;
    __syncthreads();
    for (int j = tid; j < pairs; j += blockDim.x) {
        const int e = ids[j];
        if (e >= 0) atomicAdd(group_counts + e, 1);
    }
    __syncthreads();
    if (tid < 32) {  // exclusive scans of the counts and of the tiles, 32 experts a step
        int pos = 0, tile = 0;
        for (int base = 0; base < E; base += 32) {
            const int e = base + lane;
            const int c = e < E ? group_counts[e] : 0;
            int cs = c, ts = (c + bn - 1) / bn;
            const int t0 = ts;
            for (int o = 1; o < 32; o <<= 1) {
                const int a = __shfl_up_sync(0xffffffffu, cs, o), b = __shfl_up_sync(0xffffffffu, ts, o);
                if (lane >= o) {
                    cs += a;
                    ts += b;
                }
            }
            if (e < E) {
                starts[e] = fill[e] = pos + cs - c;
                tiles[e] = tile + ts - t0;
            }
            pos += __shfl_sync(0xffffffffu, cs, 31);
            tile += __shfl_sync(0xffffffffu, ts, 31);
        }
        if (lane == 0) {
            starts[E] = pos;
            tiles[E] = tile;
        }
    }
    __syncthreads();
    for (int j = tid; j < pairs; j += blockDim.x) {
        const int e = ids[j];
        int pos = -1;
        if (e >= 0) {
            pos = atomicAdd(fill + e, 1);
            order[pos] = j;
        }
        slot[j] = pos;
    }
}

// Rows of an 8-bit activation (K int8 values, K / group scales, K / 32 sums a row) in moe_group's
// order: out row pos = row order[pos] / xdiv of x, for pos < *count (moe_group's starts[E]).
// grid (pairs), 64 threads; K a multiple of 32 (16-byte pieces of the values).
extern "C" __global__ void moe_gather8(const signed char* xq, const float* xs, const int* xsum, int K, int group,
                                       const int* order, const int* count, int xdiv, signed char* oq, float* os,
                                       int* osum) {
    pdl_enter();
    const int pos = blockIdx.x;
    if (pos >= *count) return;
    const long long src = order[pos] / xdiv;
    const int4* q = reinterpret_cast<const int4*>(xq + src * K);
    int4* oqv = reinterpret_cast<int4*>(oq + (long long)pos * K);
    for (int i = threadIdx.x; i < K / 16; i += blockDim.x) oqv[i] = q[i];
    const int ng = K / group, ns = K / 32;
    for (int i = threadIdx.x; i < ng; i += blockDim.x) os[(long long)pos * ng + i] = xs[src * ng + i];
    for (int i = threadIdx.x; i < ns; i += blockDim.x) osum[(long long)pos * ns + i] = xsum[src * ns + i];
}

// qwen2moe's shared expert's factor silu(g) / g for its gate value g (infer/moe.py SharedExpert.scale)
__device__ __forceinline__ float shared_expert_scale(float g) {
    return __fdiv_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), g);
}

// x[r] += sum_j weights[r, j] * outs[r * k + j] over the k slots in order (each product in float32,
// then added one after another: infer/moe.py weighted_sum), + shared[r] * (silu(g) / g) with g =
// gate[r] (qwen2moe's shared expert; shared null: none), then the residual add. Pair j's output is
// row slot[j] of outs (moe_group's positions), or row j when slot is null. grid (pieces of dim,
// rows), 256 threads. A null row (ids -1, moe_route) is left as it is, as the CPU leaves it.
extern "C" __global__ void moe_combine(const float* outs, const int* ids, const float* weights, int k, int dim,
                                       const int* slot, const float* shared, const float* gate, float* x) {
    pdl_enter();
    const long long r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim || ids[r * k] < 0) return;
    const float* w = weights + r * k;
    auto out = [&](int j) { return outs[(slot ? (long long)slot[r * k + j] : r * k + j) * dim + c]; };
    float t = __fmul_rn(out(0), w[0]);
    for (int j = 1; j < k; ++j) t = __fadd_rn(t, __fmul_rn(out(j), w[j]));
    if (shared) {
        t = __fadd_rn(t, __fmul_rn(shared[r * dim + c], shared_expert_scale(gate[r])));
    }
    x[r * dim + c] = __fadd_rn(x[r * dim + c], t);
}

// moe_combine, then RMSNorm(x[r]) * norm_w into rmsnorm8's outputs (the next layer's normalised input:
// that launch and its wait saved; act.cuh norm8_row, so the same bits). A block per row of
// dim / 8 threads in whole warps (dim as rmsnorm8 takes it), each thread its 8 consecutive values.
extern "C" __global__ void __launch_bounds__(1024)
    moe_combine_norm(const float* outs, const int* ids, const float* weights, int k, int dim, const int* slot,
                     const float* shared, const float* gate, float* x, const float* norm_w, float eps, int fmt,
                     float* y, __half* y16, float* yf, signed char* xq, float* xs, int* xsum) {
    pdl_enter();
    const long long r = blockIdx.x;
    float* xr = x + r * dim;
    float v[8];
    load8(xr, dim, v);
    if (ids[r * k] >= 0 && holds8(dim)) {  // a null row is left as it is
        const float* w = weights + r * k;
        // moe_combine's operations for 8 consecutive values at once, slot after slot
        float t[8], o[8];
        for (int j = 0; j < k; ++j) {
            load8(outs + (slot ? (long long)slot[r * k + j] : r * k + j) * dim, dim, o);
#pragma unroll
            for (int i = 0; i < 8; ++i) t[i] = j ? __fadd_rn(t[i], __fmul_rn(o[i], w[j])) : __fmul_rn(o[i], w[j]);
        }
        if (shared) {
            float sh[8];
            load8(shared + r * dim, dim, sh);
            const float scale = shared_expert_scale(gate[r]);
#pragma unroll
            for (int i = 0; i < 8; ++i) t[i] = __fadd_rn(t[i], __fmul_rn(sh[i], scale));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(v[i], t[i]);
        float4* xp = reinterpret_cast<float4*>(xr) + 2 * threadIdx.x;
        xp[0] = make_float4(v[0], v[1], v[2], v[3]);
        xp[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    norm8_row(v, norm_w, dim, eps, fmt, Norm8Out{y, y16, yf, xq, xs, xsum}, r);
}
