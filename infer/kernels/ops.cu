// The non-matrix steps of a Llama block: RMSNorm, rotary embedding fused with the KV-cache store,
// decode attention over the float16 cache (GQA, split over the sequence), SwiGLU for the batched path,
// and the sampler. Positions and lengths are read from device memory so that one captured CUDA graph
// serves every decode step.
#include "formats.cuh"

#ifndef ATTN_CHUNK
#define ATTN_CHUNK 256  // cache positions per attention split
#endif
#ifndef ATTN_MAX_GROUP
#define ATTN_MAX_GROUP 16  // query heads per KV head
#endif
#ifndef ATTN_MAX_HEAD_DIM
#define ATTN_MAX_HEAD_DIM 256
#endif
#define ATTN_THREADS 128

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

// y = x / sqrt(mean(x^2) + eps) * w, one block per row; writes float32 (y) and/or float16 (y16)
extern "C" __global__ void rmsnorm(const float* x, const float* w, float* y, __half* y16, int n, float eps) {
    const float* xr = x + (long long)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] * inv * w[i];
        if (y) y[(long long)blockIdx.x * n + i] = v;
        if (y16) y16[(long long)blockIdx.x * n + i] = __float2half_rn(v);
    }
}

// Rotary embedding of q (in place) and k, then k and v stored into the cache at their positions.
// grid (T, n_heads + n_kv_heads). q: (T, n_heads, D); k, v: (T, n_kv_heads, D) float32;
// cos/sin tables: (max_ctx, n_pairs); caches: (n_kv_heads, max_ctx, D) float16.
// Pair i is (2i, 2i+1) for Llama (GGUF permutes Q/K so pairs are adjacent), (i, i + n_pairs) for NeoX.
extern "C" __global__ void rope_store(float* q, const float* k, const float* v, const float* cos_t,
                                      const float* sin_t, const int* pos, int n_heads, int n_kv_heads, int D,
                                      int n_pairs, int neox, __half* kc, __half* vc, int max_ctx) {
    const int t = blockIdx.x, h = blockIdx.y;
    const int p = pos[t];
    const float* c = cos_t + (long long)p * n_pairs;
    const float* s = sin_t + (long long)p * n_pairs;
    const bool is_q = h < n_heads;
    const int kh = h - n_heads;
    const float* src = is_q ? q + ((long long)t * n_heads + h) * D : k + ((long long)t * n_kv_heads + kh) * D;
    __half* kdst = is_q ? nullptr : kc + ((long long)kh * max_ctx + p) * D;
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + n_pairs : 2 * i + 1;
        const float a = src[ia], b = src[ib];
        const float ra = a * c[i] - b * s[i], rb = a * s[i] + b * c[i];
        if (is_q) {
            float* dst = q + ((long long)t * n_heads + h) * D;
            dst[ia] = ra;
            dst[ib] = rb;
        } else {
            kdst[ia] = __float2half_rn(ra);
            kdst[ib] = __float2half_rn(rb);
        }
    }
    if (is_q) return;
    for (int d = 2 * n_pairs + threadIdx.x; d < D; d += blockDim.x) kdst[d] = __float2half_rn(src[d]);
    const float* vs = v + ((long long)t * n_kv_heads + kh) * D;
    __half* vdst = vc + ((long long)kh * max_ctx + p) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) vdst[d] = __float2half_rn(vs[d]);
}

// Decode attention, one block per (KV head, split of ATTN_CHUNK positions): the G query heads that
// share the KV head are handled together, so each cached key and value is read once per group.
// Writes unnormalised partial outputs with their running max and sum; attention_combine merges them.
// kv_len = pos[0] + 1. q: (n_heads, D) float32, head h uses KV head h / G.
template <int MAXG>
__device__ __forceinline__ void attention_decode(const float* q, const __half* kc, const __half* vc, const int* pos,
                                                 int G, int D, int max_ctx, float scale, int n_splits, float* part_o,
                                                 float* part_ml) {
    __shared__ __align__(16) float q_s[ATTN_MAX_GROUP * ATTN_MAX_HEAD_DIM];
    __shared__ float p_s[ATTN_MAX_GROUP * ATTN_CHUNK];
    __shared__ float m_s[ATTN_MAX_GROUP], l_s[ATTN_MAX_GROUP];
    const int kvh = blockIdx.x, split = blockIdx.y, tid = threadIdx.x;
    const int kv_len = pos[0] + 1;
    const int start = split * ATTN_CHUNK;
    const int n = min(ATTN_CHUNK, kv_len - start);
    const int h0 = kvh * G;
    if (n <= 0) {
        for (int i = tid; i < G * D; i += ATTN_THREADS) {
            const int g = i / D, d = i % D;
            part_o[((long long)(h0 + g) * n_splits + split) * D + d] = 0.f;
        }
        if (tid < G) {
            part_ml[((h0 + tid) * n_splits + split) * 2] = NEG_INF;
            part_ml[((h0 + tid) * n_splits + split) * 2 + 1] = 0.f;
        }
        return;
    }
    // the query rounded to float16, as llama.cpp multiplies it with the float16 cache
    for (int i = tid; i < G * D; i += ATTN_THREADS) q_s[i] = __half2float(__float2half_rn(q[(long long)h0 * D + i]));
    __syncthreads();

    const __half* kbase = kc + ((long long)kvh * max_ctx + start) * D;
    for (int t = tid; t < n; t += ATTN_THREADS) {
        float acc[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; ++g) acc[g] = 0.f;
        const uint4* krow = reinterpret_cast<const uint4*>(kbase + (long long)t * D);
        for (int c = 0; c < D / 8; ++c) {
            const uint4 raw = krow[c];
            const __half2* kh = reinterpret_cast<const __half2*>(&raw);
            float kf[8];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __half22float2(kh[e]);
                kf[2 * e] = f.x;
                kf[2 * e + 1] = f.y;
            }
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g < G) {
                    const float4 qa = *reinterpret_cast<const float4*>(q_s + g * D + 8 * c);
                    const float4 qb = *reinterpret_cast<const float4*>(q_s + g * D + 8 * c + 4);
                    acc[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] +
                              qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                }
            }
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
            if (g < G) p_s[g * ATTN_CHUNK + t] = acc[g] * scale;
    }
    __syncthreads();

    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < G; g += ATTN_THREADS / 32) {
        float m = NEG_INF;
        for (int t = lane; t < n; t += 32) m = fmaxf(m, p_s[g * ATTN_CHUNK + t]);
        m = warp_max(m);
        float l = 0.f;
        for (int t = lane; t < n; t += 32) {
            const float e = expf(p_s[g * ATTN_CHUNK + t] - m);
            p_s[g * ATTN_CHUNK + t] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            m_s[g] = m;
            l_s[g] = l;
        }
    }
    __syncthreads();

    const __half* vbase = vc + ((long long)kvh * max_ctx + start) * D;
    for (int d = tid; d < D; d += ATTN_THREADS) {
        float acc[MAXG];
#pragma unroll
        for (int g = 0; g < MAXG; ++g) acc[g] = 0.f;
        for (int t = 0; t < n; ++t) {
            const float vv = __half2float(vbase[(long long)t * D + d]);
#pragma unroll
            for (int g = 0; g < MAXG; ++g)
                if (g < G) acc[g] += p_s[g * ATTN_CHUNK + t] * vv;
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
            if (g < G) part_o[((long long)(h0 + g) * n_splits + split) * D + d] = acc[g];
    }
    if (tid < G) {
        part_ml[((h0 + tid) * n_splits + split) * 2] = m_s[tid];
        part_ml[((h0 + tid) * n_splits + split) * 2 + 1] = l_s[tid];
    }
}

// instantiations by group size (query heads per KV head): the smallest that holds G
#define ATTENTION_DECODE(MAXG)                                                                                \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                                \
        attention_decode_g##MAXG(const float* q, const __half* kc, const __half* vc, const int* pos, int G,   \
                                 int D, int max_ctx, float scale, int n_splits, float* part_o, float* part_ml) { \
        attention_decode<MAXG>(q, kc, vc, pos, G, D, max_ctx, scale, n_splits, part_o, part_ml);             \
    }
ATTENTION_DECODE(4)
ATTENTION_DECODE(8)
ATTENTION_DECODE(16)

// out[h, :] = merged softmax-weighted values of all splits; grid n_heads
extern "C" __global__ void attention_combine(const float* part_o, const float* part_ml, int n_splits, int D,
                                             float* out) {
    const int h = blockIdx.x;
    const float* ml = part_ml + (long long)h * n_splits * 2;
    float m = NEG_INF;
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, ml[2 * s]);
    float l = 0.f;
    for (int s = 0; s < n_splits; ++s)
        if (ml[2 * s + 1] > 0.f) l += ml[2 * s + 1] * expf(ml[2 * s] - m);
    const float inv = 1.f / l;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < n_splits; ++s)
            if (ml[2 * s + 1] > 0.f) acc += part_o[((long long)h * n_splits + s) * D + d] * expf(ml[2 * s] - m);
        out[(long long)h * D + d] = acc * inv;
    }
}

// out = SiLU(gate) * up, float32 (decode, when gate and up have different formats)
extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
}

// out = SiLU(gate) * up for the batched path; gate_up: (T, 2F) float16 (gate then up) -> (T, F)
extern "C" __global__ void swiglu_half(const __half* gate_up, __half* out, int F, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long t = i / F, f = i % F;
    const float g = __half2float(gate_up[t * 2 * F + f]);
    const float u = __half2float(gate_up[t * 2 * F + F + f]);
    out[i] = __float2half_rn(g / (1.f + expf(-g)) * u);
}

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// Picks the next token from logits (vocab,) in one block of 1024 threads: the arg-max when
// temperature <= 0, else the Gumbel-max trick (argmax of logits/T + Gumbel noise draws exactly from
// softmax(logits/T)) with noise hashed from (seed, position, token). Stores the token into *tok and
// tokens[pos + 1], then advances *pos: the next decode step reads both from device memory.
// Ties go to the lowest id, as numpy.argmax does.
extern "C" __global__ void __launch_bounds__(1024)
    sample_token(const float* logits, int vocab, float temperature, unsigned int seed, int* tok, int* pos,
                 int* tokens) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const int p = *pos;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    const uint32_t key = mix32(seed ^ mix32((uint32_t)p * 0x9E3779B9u));
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = logits[i];
        if (temperature > 0.f) {
            const uint32_t r = mix32(key ^ (uint32_t)i * 0x85EBCA6Bu);
            const float u = ((float)(r >> 8) + 0.5f) * (1.f / 16777216.f);
            v = v / temperature - logf(-logf(u));
        }
        if (v > bv || (v == bv && i < bi)) {
            bv = v;
            bi = i;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? best_v[lane] : NEG_INF;
        bi = lane < nw ? best_i[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            const int next = bi == 0x7fffffff ? 0 : bi;
            *tok = next;
            tokens[p + 1] = next;
            *pos = p + 1;
        }
    }
}
