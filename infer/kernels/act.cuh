// Reductions (shared by ops.cu, attention.cu and moe.cu) and the rounding of activations to the
// formats llama.cpp feeds its matrix products (float16, bfloat16, and the 8-bit q8_0 / q8_k blocks with their integer
// form for the dp4a GEMVs), used by ops.cu's RMSNorm, activation rounding and attention output.
#pragma once
#include "formats.cuh"

// butterfly: every lane ends with the same bits (a + b == b + a)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), every thread gets the result: each
// warp's butterfly, then the warps' sums in warp order. The order depends only on blockDim.x.
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

// v rounded to a float format (ACT_F16 / ACT_BF16; ACT_F32 and the 8-bit formats leave it)
__device__ __forceinline__ float round_float(float v, int fmt) {
    if (fmt == ACT_F16) return __half2float(__float2half_rn(v));
    if (fmt == ACT_BF16) return __bfloat162float(__float2bfloat16_rn(v));
    return v;
}

// Whether |value| a replaces the largest so far: larger, or NaN (which then stays: a > NaN is false).
__device__ __forceinline__ bool pick_largest(float a, float best) { return a > best || a != a; }

// v's int8 value (as a float) under the group's inv and clamp bound; a NaN gives 0 (its group's scale is
// NaN already), so the int8 form and its sums stay well defined (fminf would return the bound).
__device__ __forceinline__ float round_int8(float v, float inv, float hi) {
    const float q = rintf(v * inv);
    return q == q ? fminf(q, hi) : 0.f;
}

// One 8-bit group's scale from each lane's largest |x| (`best`, at index `best_i`, signed value
// `extreme`): reduced over xor distances up to `span` (ties to the lower index, as NumPy's argmax),
// then Q8_0's float16 scale (amax / 127) or Q8_K's (-127 / the signed extreme) with the clamp bound.
// A NaN in the group (taken as its largest value: pick_largest) makes the scale NaN, so every product
// that reads the group is NaN and the logits' check refuses it; comparisons alone would skip the NaN
// and round it to a finite int8 (rintf(NaN) clamped by fminf), turning NaN into plausible logits.
__device__ __forceinline__ void group_scale(int fmt, float best, int best_i, float extreme, int span, float& inv,
                                            float& scale, float& hi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        if (o > span) continue;
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        const float oe = __shfl_xor_sync(0xffffffffu, extreme, o);
        if (ob != ob || ob > best || (ob == best && oi < best_i)) {  // a NaN wins and stays (below)
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

// two floats as the bits of a float16 pair (round to nearest), for 16-byte stores of 8 halves
__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Eight int8 values (from ints in [-128, 127]) packed for one 8-byte store
__device__ __forceinline__ uint2 pack_int8x8(const int* q) {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo |= (uint32_t)(q[k] & 0xFF) << (8 * k);
        hi |= (uint32_t)(q[k + 4] & 0xFF) << (8 * k);
    }
    return make_uint2(lo, hi);
}

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

// One 8-bit group held by a warp, PER values a lane (lane * PER + k is value k of this lane): its
// scale, its rounded values into yg (if given; may be where the values came from) and y16g, and
// its 8-bit form into group g of o8.
template <int PER>
__device__ __forceinline__ void quantize_group(const float (&v)[PER], int g, int fmt, float* yg, __half* y16g,
                                               Int8Out o8) {
    const int lane = threadIdx.x & 31;
    constexpr int group = 32 * PER;
    float best = -1.f, extreme = 0.f;
    int best_i = 0x7fffffff;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int i = lane * PER + k;
        const float a = fabsf(v[k]);
        if (pick_largest(a, best)) {  // ascending i within the lane: the first maximum is kept
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
        const float qf = round_int8(v[k], inv, hi);
        r[k] = qf * scale;
        q[k] = (int)qf;
        qsum += q[k];
    }
    if (PER == 8) {  // 16-byte stores of the values, one 8-byte store of the int8 form
        if (yg) {
            reinterpret_cast<float4*>(yg)[lane * 2] = make_float4(r[0], r[1 % PER], r[2 % PER], r[3 % PER]);
            reinterpret_cast<float4*>(yg)[lane * 2 + 1] = make_float4(r[4 % PER], r[5 % PER], r[6 % PER], r[7 % PER]);
        }
        if (o8.xq) reinterpret_cast<uint2*>(o8.xq + (long long)g * group)[lane] = pack_int8x8(q);
    } else {
        if (yg) yg[lane] = r[0];
        if (o8.xq) o8.xq[(long long)g * group + lane] = (signed char)q[0];
    }
    if (y16g) {
#pragma unroll
        for (int k = 0; k < PER; ++k) y16g[lane * PER + k] = __float2half_rn(r[k]);
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

// Groups first, first + stride, ... of src go to y (y may be src): each warp reads its whole group
// before it writes it.
template <int PER>
__device__ void round_groups(const float* src, float* y, __half* y16, int n, int fmt, Int8Out o8, int first,
                             int stride) {
    const int lane = threadIdx.x & 31;
    constexpr int group = 32 * PER;
    for (int g = first; g < n / group; g += stride) {
        const float* in = src + (long long)g * group;
        float v[PER];
        if (PER == 8) {  // 32 bytes per lane: two 16-byte loads
            const float4 a0 = reinterpret_cast<const float4*>(in)[lane * 2];
            const float4 a1 = reinterpret_cast<const float4*>(in)[lane * 2 + 1];
            v[0] = a0.x, v[1 % PER] = a0.y, v[2 % PER] = a0.z, v[3 % PER] = a0.w;
            v[4 % PER] = a1.x, v[5 % PER] = a1.y, v[6 % PER] = a1.z, v[7 % PER] = a1.w;
        } else {
            v[0] = in[lane];
        }
        quantize_group<PER>(v, g, fmt, y ? y + (long long)g * group : nullptr,
                            y16 ? y16 + (long long)g * group : nullptr, o8);
    }
}

// round_groups for q8_0 (a lane per value) or q8_k (8 values per lane)
__device__ __forceinline__ void round_groups_8bit(const float* src, float* y, __half* y16, int n, int fmt, Int8Out o8,
                                                  int first, int stride) {
    if (fmt == ACT_Q8_0) round_groups<1>(src, y, y16, n, fmt, o8, first, stride);
    else round_groups<8>(src, y, y16, n, fmt, o8, first, stride);
}

// Rounds row y (n floats, written by this block before a __syncthreads) in place to `fmt`; y16, if
// given, receives the rounded values as float16. Called by every thread of the block.
__device__ void round_row(float* y, __half* y16, int n, int fmt, Int8Out o8 = Int8Out{nullptr, nullptr, nullptr}) {
    if (fmt == ACT_F32 || fmt == ACT_F16 || fmt == ACT_BF16) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = round_float(y[i], fmt);
            y[i] = v;
            if (y16) y16[i] = __float2half_rn(v);
        }
        return;
    }
    round_groups_8bit(y, y, y16, n, fmt, o8, threadIdx.x >> 5, blockDim.x >> 5);
}

// ---------------------------------------------------------------- RMSNorm, 8 values a thread
// A row of n values (n a multiple of 8, of 32 for q8_0, of 256 for q8_k, at most 8192) held 8
// consecutive values a thread by a block of n / 8 threads rounded up to whole warps (rmsnorm8's
// layout: a warp holds one q8_k group, four lanes one q8_0 group). Threads past the row's end hold
// zeros and store nothing.
__device__ __forceinline__ bool holds8(int n) { return 8 * (int)threadIdx.x < n; }

// This thread's 8 values of row r (n floats): zeros past the row's end.
__device__ __forceinline__ void load8(const float* r, int n, float (&v)[8]) {
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* p = reinterpret_cast<const float4*>(r) + 2 * threadIdx.x;
    const float4 a0 = holds8(n) ? p[0] : zero, a1 = holds8(n) ? p[1] : zero;
    v[0] = a0.x, v[1] = a0.y, v[2] = a0.z, v[3] = a0.w, v[4] = a1.x, v[5] = a1.y, v[6] = a1.z, v[7] = a1.w;
}

// Where a normalised row goes (rmsnorm8's outputs, row `row` of each; any may be null): y the values
// rounded to the activation format, y16 / yf the values before rounding as float16 / float32, and
// the 8-bit form (xq, xs, xsum) for q8_0 / q8_k.
struct Norm8Out {
    float* y;
    __half* y16;
    float* yf;
    signed char* xq;
    float* xs;
    int* xsum;
};

// RMSNorm of the row in v (this thread's 8 values): v / sqrt(mean(v^2) + eps) * w, the sum of
// squares in an order fixed by n (each thread's fused multiply-adds, then block_sum), into the
// outputs of row `row` (rounded to `fmt` into y, its 8-bit form, the values before rounding). Every
// thread of the block calls it (a block-wide sum and shuffles), so rmsnorm8 and moe.cu's
// moe_combine_norm give the same bits.
__device__ __forceinline__ void norm8_row(float (&v)[8], const float* w, int n, float eps, int fmt, Norm8Out o,
                                          long long row) {
    const int t = threadIdx.x, lane = t & 31;
    const bool store = holds8(n);
    float wv[8];
    load8(w, n, wv);  // before the reduction
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) ss = __fmaf_rn(v[k], v[k], ss);
    ss = block_sum(ss);
    const float s = sqrtf(__fadd_rn(__fdiv_rn(ss, (float)n), eps));
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __fmul_rn(__fdiv_rn(v[k], s), wv[k]);
    if (o.y16 && store) {  // before rounding: the prompt products' float16 input
        uint4 h;
        h.x = half2_bits(v[0], v[1]), h.y = half2_bits(v[2], v[3]), h.z = half2_bits(v[4], v[5]);
        h.w = half2_bits(v[6], v[7]);
        reinterpret_cast<uint4*>(o.y16 + row * n + 8 * t)[0] = h;
    }
    if (o.yf && store) {
        float4* fr = reinterpret_cast<float4*>(o.yf + row * n) + 2 * t;
        fr[0] = make_float4(v[0], v[1], v[2], v[3]);
        fr[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    int q[8];
    if (fmt == ACT_F16 || fmt == ACT_BF16) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = round_float(v[k], fmt);
    } else if (fmt == ACT_Q8_0 || fmt == ACT_Q8_K) {
        float best = -1.f, extreme = 0.f;
        int best_i = 0x7fffffff;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float a = fabsf(v[k]);
            if (pick_largest(a, best)) {
                best = a;
                best_i = lane * 8 + k;
                extreme = v[k];
            }
        }
        float inv, scale, hi;  // xor distances: 4 lanes (32 values) or the warp (256)
        group_scale(fmt, best, best_i, extreme, fmt == ACT_Q8_0 ? 2 : 16, inv, scale, hi);
        int qsum = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float qf = round_int8(v[k], inv, hi);
            v[k] = qf * scale;
            q[k] = (int)qf;
            qsum += q[k];
        }
        if (o.xq) {  // the 8-bit form: values, a scale per group, a sum per 32 values (4 lanes)
            qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
            qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);
            const long long e = row * n + 8 * t;  // first value of this thread
            if (store) {
                if ((lane & 3) == 0) o.xsum[e / 32] = qsum;
                if (fmt == ACT_Q8_0 ? (lane & 3) == 0 : lane == 0) o.xs[e / (fmt == ACT_Q8_0 ? 32 : 256)] = scale;
                reinterpret_cast<uint2*>(o.xq + e)[0] = pack_int8x8(q);
            }
        }
    }
    if (o.y && store) {
        float4* yr = reinterpret_cast<float4*>(o.y + row * n) + 2 * t;
        yr[0] = make_float4(v[0], v[1], v[2], v[3]);
        yr[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}
