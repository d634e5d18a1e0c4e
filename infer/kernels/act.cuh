// Reductions and the rounding of activations to the formats llama.cpp feeds its matrix products
// (float16, bfloat16, and the 8-bit q8_0 / q8_k blocks with their integer form for the dp4a GEMVs),
// shared by ops.cu (RMSNorm, activation rounding, attention output) and gemv.cu (the fused epilogues
// that normalise or round a GEMV's output in the same launch).
#include "formats.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Activation formats: how llama.cpp's CPU converts the input of a matrix product for each weight
// type (infer.quants.round_activations). ACT_Q8_0: blocks of 32, scale = f16(amax/127),
// q = rint(x * (127/amax)); ACT_Q8_K: blocks of 256, scale from the signed value of largest
// magnitude (first one on ties), q = min(rint(x * (-127/extreme)), 127), scale 1/(-127/extreme).
#define ACT_F32 0
#define ACT_F16 1
#define ACT_BF16 2
#define ACT_Q8_0 3
#define ACT_Q8_K 4

// One 8-bit group's scale from each lane's largest |x| (`best`, at index `best_i`, signed value
// `extreme`): reduced over xor distances up to `span` (ties to the lower index, as NumPy's argmax),
// then Q8_0's float16 scale (amax / 127) or Q8_K's (-127 / the signed extreme) with the clamp bound.
__device__ __forceinline__ void group_scale(int fmt, float best, int best_i, float extreme, int span, float& inv,
                                            float& scale, float& hi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        if (o > span) continue;
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        const float oe = __shfl_xor_sync(0xffffffffu, extreme, o);
        if (ob > best || (ob == best && oi < best_i)) {
            best = ob;
            best_i = oi;
            extreme = oe;
        }
    }
    if (fmt == ACT_Q8_0) {
        inv = best > 0.f ? 127.f / best : 0.f;
        scale = __half2float(__float2half_rn(best / 127.f));
        hi = 1e30f;
    } else {
        inv = extreme != 0.f ? -127.f / extreme : 0.f;
        scale = extreme != 0.f ? 1.f / inv : 0.f;
        hi = 127.f;
    }
}

// One warp per group of 32*PER values (PER = 1: q8_0, 8: q8_k)
// The 8-bit form of q8_0/q8_k activations for the integer (dp4a) GEMVs: xq the int8 values, xs the
// float scale per group (32 or 256 values), xsum the sum of xq per 32 values. Null xq: not wanted.
struct Int8Out {
    signed char* xq;
    float* xs;
    int* xsum;
};

// the Int8Out of row `row` of rows of n values
__device__ __forceinline__ Int8Out int8_row(signed char* xq, float* xs, int* xsum, long long row, int n, int fmt) {
    if (!xq) return Int8Out{nullptr, nullptr, nullptr};
    const int group = fmt == ACT_Q8_0 ? 32 : 256;
    return Int8Out{xq + row * n, xs + row * (n / group), xsum + row * (n / 32)};
}

// Loads that bypass L1 (`FROM_L2`): for values other blocks of the same launch wrote (fused
// epilogues), which this SM's L1 may not have seen.
template <bool FROM_L2>
__device__ __forceinline__ float4 load4(const float4* p) {
    if (FROM_L2) return __ldcg(p);
    return *p;
}
template <bool FROM_L2>
__device__ __forceinline__ float load1(const float* p) {
    if (FROM_L2) return __ldcg(p);
    return *p;
}

// Groups first, first + stride, ... of src go to y (y may be src; null: only the 8-bit form and
// y16 are written): each warp reads its whole group before it writes it.
template <int PER, bool FROM_L2 = false>
__device__ void round_groups(const float* src, float* y, __half* y16, int n, int fmt, Int8Out o8, int first,
                             int stride) {
    const int lane = threadIdx.x & 31;
    constexpr int group = 32 * PER;
    for (int g = first; g < n / group; g += stride) {
        const float* in = src + (long long)g * group;
        float* b = y + (long long)g * group;
        float v[PER];
        float best = -1.f, extreme = 0.f;
        int best_i = 0x7fffffff;
        if (PER == 8) {  // 32 bytes per lane: two 16-byte loads
            const float4 a0 = load4<FROM_L2>(reinterpret_cast<const float4*>(in) + lane * 2);
            const float4 a1 = load4<FROM_L2>(reinterpret_cast<const float4*>(in) + lane * 2 + 1);
            v[0] = a0.x, v[1 % PER] = a0.y, v[2 % PER] = a0.z, v[3 % PER] = a0.w;
            v[4 % PER] = a1.x, v[5 % PER] = a1.y, v[6 % PER] = a1.z, v[7 % PER] = a1.w;
        } else {
            v[0] = load1<FROM_L2>(in + lane);
        }
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int i = lane * PER + k;
            const float a = fabsf(v[k]);
            if (a > best) {  // ascending i within the lane: the first maximum is kept
                best = a;
                best_i = i;
                extreme = v[k];
            }
        }
        float inv, scale, hi;
        group_scale(fmt, best, best_i, extreme, 16, inv, scale, hi);
        int qsum = 0;
        float r[PER];
        int q[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const float qf = fminf(rintf(v[k] * inv), hi);
            r[k] = qf * scale;
            q[k] = (int)qf;
            qsum += q[k];
        }
        if (PER == 8) {  // 16-byte stores of the values, one 8-byte store of the int8 form
            if (y) {
                reinterpret_cast<float4*>(b)[lane * 2] = make_float4(r[0], r[1 % PER], r[2 % PER], r[3 % PER]);
                reinterpret_cast<float4*>(b)[lane * 2 + 1] = make_float4(r[4 % PER], r[5 % PER], r[6 % PER], r[7 % PER]);
            }
            if (o8.xq) {
                uint32_t w0 = 0, w1 = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    w0 |= (uint32_t)(q[k % PER] & 0xFF) << (8 * k);
                    w1 |= (uint32_t)(q[(k + 4) % PER] & 0xFF) << (8 * k);
                }
                reinterpret_cast<uint2*>(o8.xq + (long long)g * group)[lane] = make_uint2(w0, w1);
            }
        } else {
            if (y) b[lane] = r[0];
            if (o8.xq) o8.xq[(long long)g * group + lane] = (signed char)q[0];
        }
        if (y16) {
#pragma unroll
            for (int k = 0; k < PER; ++k) y16[(long long)g * group + lane * PER + k] = __float2half_rn(r[k]);
        }
        if (o8.xq) {
            if (PER == 1) {  // the group is one sub-block of 32
                qsum = __reduce_add_sync(0xffffffffu, qsum);
                if (lane == 0) o8.xsum[g] = qsum;
            } else {  // 8 sub-blocks of 32: lanes 4j..4j+3 hold sub-block j
                qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
                qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);
                if ((lane & 3) == 0) o8.xsum[(long long)g * 8 + (lane >> 2)] = qsum;
            }
            if (lane == 0) o8.xs[g] = scale;
        }
    }
}

// Rounds row y (n floats, written by this block before a __syncthreads) in place to `fmt`; y16, if
// given, receives the rounded values as float16. Called by every thread of the block.
__device__ void round_row(float* y, __half* y16, int n, int fmt, Int8Out o8 = Int8Out{nullptr, nullptr, nullptr}) {
    if (fmt == ACT_F32 || fmt == ACT_F16 || fmt == ACT_BF16) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            float v = y[i];
            if (fmt == ACT_F16) v = __half2float(__float2half_rn(v));
            if (fmt == ACT_BF16) v = __bfloat162float(__float2bfloat16_rn(v));
            y[i] = v;
            if (y16) y16[i] = __float2half_rn(v);
        }
        return;
    }
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (fmt == ACT_Q8_0) round_groups<1>(y, y, y16, n, fmt, o8, warp, warps);
    else round_groups<8>(y, y, y16, n, fmt, o8, warp, warps);
}


// One block normalises a row that other blocks of the same launch have just written (the fused
// epilogue of the GEMVs that add the residual): y = x / sqrt(mean(x^2) + eps) * w, rounded to q8_0
// or q8_k, with its 8-bit form. n a multiple of 256 (q8_k) or 32 (q8_0), at most
// 8 * NORM_CHUNKS * blockDim.x. Same arithmetic as rmsnorm8 (ops.cu): each thread rounds runs of 8
// consecutive values, so a warp covers one q8_k group or eight q8_0 groups per step; only the order
// of the sum of squares differs. The row is read once, through L2 (other SMs wrote it), every
// thread's loads issued together: this tail is on the critical path of the step, and a loop of
// dependent loads made the first version (run 9) slower than the separate rmsnorm launch.
#define NORM_CHUNKS 4
__device__ void norm_row_block(const float* x, const float* w, int n, float eps, int fmt, float* y, Int8Out o8) {
    const int t = threadIdx.x, lane = t & 31, chunks = n / 8;
    float v[NORM_CHUNKS][8];
#pragma unroll
    for (int k = 0; k < NORM_CHUNKS; ++k) {  // chunk t + k * blockDim.x: values 8c .. 8c+7
        const int c = t + k * blockDim.x;
        float4 a0 = make_float4(0.f, 0.f, 0.f, 0.f), a1 = a0;
        if (c < chunks) {
            a0 = __ldcg(reinterpret_cast<const float4*>(x) + 2 * c);
            a1 = __ldcg(reinterpret_cast<const float4*>(x) + 2 * c + 1);
        }
        v[k][0] = a0.x, v[k][1] = a0.y, v[k][2] = a0.z, v[k][3] = a0.w;
        v[k][4] = a1.x, v[k][5] = a1.y, v[k][6] = a1.z, v[k][7] = a1.w;
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_CHUNKS; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += v[k][e] * v[k][e];
    ss = block_sum(ss);
    const float s = sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int k = 0; k < NORM_CHUNKS; ++k) {
        const int c = t + k * blockDim.x;
        if (c - lane >= chunks) break;  // warp-uniform: the warp's first chunk is past the end
        const bool on = c < chunks;
        float best = -1.f, extreme = 0.f;
        int best_i = 0x7fffffff;
        if (on) {
            const float4 w0 = reinterpret_cast<const float4*>(w)[2 * c], w1 = reinterpret_cast<const float4*>(w)[2 * c + 1];
            const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                v[k][e] = (v[k][e] / s) * wv[e];
                const float a = fabsf(v[k][e]);
                if (a > best) {
                    best = a;
                    best_i = lane * 8 + e;
                    extreme = v[k][e];
                }
            }
        }
        float inv, scale, hi;  // xor distances: 4 lanes (32 values) or the warp (256)
        group_scale(fmt, best, best_i, extreme, fmt == ACT_Q8_0 ? 2 : 16, inv, scale, hi);
        int q[8], qsum = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float qf = fminf(rintf(v[k][e] * inv), hi);
            v[k][e] = qf * scale;
            q[e] = (int)qf;
            qsum += q[e];
        }
        qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
        qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);
        if (!on) continue;
        const int first = 8 * c;  // first value of this thread's chunk
        if ((lane & 3) == 0) o8.xsum[first / 32] = qsum;
        if (fmt == ACT_Q8_0 ? (lane & 3) == 0 : lane == 0) o8.xs[first / (fmt == ACT_Q8_0 ? 32 : 256)] = scale;
        uint32_t lo = 0, hi8 = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            lo |= (uint32_t)(q[e] & 0xFF) << (8 * e);
            hi8 |= (uint32_t)(q[e + 4] & 0xFF) << (8 * e);
        }
        reinterpret_cast<uint2*>(o8.xq + first)[0] = make_uint2(lo, hi8);
        if (y) {
            reinterpret_cast<float4*>(y + first)[0] = make_float4(v[k][0], v[k][1], v[k][2], v[k][3]);
            reinterpret_cast<float4*>(y + first)[1] = make_float4(v[k][4], v[k][5], v[k][6], v[k][7]);
        }
    }
}
