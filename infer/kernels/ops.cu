// The non-matrix steps of a Llama block besides attention, for the rows of a pass: RMSNorm with the
// rounding of its output to the next matrix product's activation format, that rounding alone, SwiGLU
// and GeGLU with their rounding, Gemma's post-norms with the residual add, and the samplers. Everything per row in an order fixed by the row's length, so
// a row gets the same bits in any pass. (Rotary embedding, the KV cache and attention: attention.cu.)
#include "formats.cuh"
#include "act.cuh"
#include "pdl.cuh"

// y = x / sqrt(mean(x^2) + eps) * w, one block per row, then rounded to activation format `fmt`.
// The sum of squares in float32 in an order fixed by n alone (each thread's values in order, then
// block_sum), so a row gets the same bits in any pass; writes float32 (y, rounded; required for the
// 8-bit form) and/or float16 (y16: the values before that rounding, the prompt products' input)
extern "C" __global__ void rmsnorm(const float* x, const float* w, float* y, __half* y16, int n, float eps,
                                   int fmt, signed char* xq, float* xs, int* xsum, const int* src_rows) {
    pdl_enter();
    const long long row = blockIdx.x;
    const float* xr = x + (src_rows ? (long long)src_rows[row] : row) * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = __fmaf_rn(xr[i], xr[i], ss);
    ss = block_sum(ss);
    const float s = sqrtf(__fadd_rn(__fdiv_rn(ss, (float)n), eps));
    float* yr = y ? y + row * n : nullptr;
    __half* y16r = y16 ? y16 + row * n : nullptr;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = __fmul_rn(__fdiv_rn(xr[i], s), w[i]);
        if (yr) yr[i] = v;
        if (y16r) y16r[i] = __float2half_rn(v);
    }
    if (!yr || fmt == ACT_F32) return;
    __syncthreads();  // the row is in y: round it by groups
    round_row(yr, nullptr, n, fmt, int8_row(xq, xs, xsum, row, n, fmt));
}

// The same for rows of n values, n a multiple of 8 (of 32 for q8_0, of 256 for q8_k), at most
// 8192, with blockDim.x = n / 8 rounded up to whole warps: each thread keeps its 8 consecutive
// values in registers from the load to the rounded store, so a warp holds exactly one q8_k group
// (256 values) and four lanes one q8_0 group: one pass over memory. Threads past the row's end
// take zeros and store nothing (e.g. Qwen2.5-0.5B's width of 896: 112 threads in 4 warps).
// y may be null when only the 8-bit form is wanted; y16 and yf (optional) get the values before
// rounding as float16 and float32 (yf: a float product's input beside the 8-bit one, e.g. a mixture
// of experts' router, without a second launch). src_rows (optional): output row i normalises input
// row src_rows[i] (the rows of a pass whose logits are wanted).
extern "C" __global__ void __launch_bounds__(1024)
    rmsnorm8(const float* x, const float* w, float* y, __half* y16, int n, float eps, int fmt, signed char* xq,
             float* xs, int* xsum, const int* src_rows, float* yf) {
    pdl_enter();
    const long long row = blockIdx.x;
    float v[8];
    load8(x + (src_rows ? (long long)src_rows[row] : row) * n, n, v);
    norm8_row(v, w, n, eps, fmt, Norm8Out{y, y16, yf, xq, xs, xsum}, row);
}

// y (and/or y16) = x rounded to activation format `fmt`; grid (pieces of a row, rows of n); y may
// alias x. The row is spread over blocks (one block per row is one SM's latency-bound loop: slow
// for an 8B FFN's 14336 values, docs/GPU.md), a warp per 8-bit group, no copy before rounding.
extern "C" __global__ void round_act(const float* x, float* y, __half* y16, int n, int fmt, signed char* xq,
                                     float* xs, int* xsum) {
    pdl_enter();
    const long long row = blockIdx.y;
    const float* xr = x + row * n;
    float* yr = y + row * n;
    __half* y16r = y16 ? y16 + row * n : nullptr;
    if (fmt == ACT_F32 || fmt == ACT_F16 || fmt == ACT_BF16) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const float v = round_float(xr[i], fmt);
            yr[i] = v;
            if (y16r) y16r[i] = __float2half_rn(v);
        }
        return;
    }
    const int warps = blockDim.x >> 5, first = blockIdx.x * warps + (threadIdx.x >> 5), stride = gridDim.x * warps;
    const Int8Out o8 = int8_row(xq, xs, xsum, row, n, fmt);
    round_groups_8bit(xr, yr, y16r, n, fmt, o8, first, stride);
}

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

// x[row] += RMSNorm(t[row]) * w, one block per row (Gemma's post-attention and post-FFN norms: the
// block's output normalised before the residual add); the sum of squares as rmsnorm's.
extern "C" __global__ void norm_add(const float* t, const float* w, float* x, int n, float eps) {
    pdl_enter();
    const long long row = blockIdx.x;
    const float* tr = t + row * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = __fmaf_rn(tr[i], tr[i], ss);
    ss = block_sum(ss);
    const float s = sqrtf(__fadd_rn(__fdiv_rn(ss, (float)n), eps));
    float* xr = x + row * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] = __fadd_rn(xr[i], __fmul_rn(__fdiv_rn(tr[i], s), w[i]));
}

// ff = SiLU(gate) * up (gelu: GELU(gate) * up) of rows of gu = [gate (n) | up (n)] (row stride 2n), rounded to the down
// projection's activation format `fmt`: its 8-bit form (xq/xs/xsum) for q8_0/q8_k, and/or the
// rounded float32 values in y (row stride n); y16 (optional) the values before rounding as float16
// (the prompt products' input). grid (pieces of a row, rows), 256 threads: a warp per 8-bit group
// (q8_0: 32 values, q8_k: 256), 1024 values a block for the float formats.
extern "C" __global__ void glu_round(const float* gu, int n, float* y, __half* y16, int fmt, signed char* xq,
                                     float* xs, int* xsum, int gelu) {
    pdl_enter();
    const long long row = blockIdx.y;
    const float* gr = gu + row * 2 * n;
    const float* ur = gr + n;
    float* yr = y ? y + row * n : nullptr;
    __half* hr = y16 ? y16 + row * n : nullptr;
    if (fmt == ACT_F32 || fmt == ACT_F16 || fmt == ACT_BF16) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const float v = glu(gr[i], ur[i], gelu);
            yr[i] = round_float(v, fmt);
            if (hr) hr[i] = __float2half_rn(v);
        }
        return;
    }
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int first = blockIdx.x * warps + (threadIdx.x >> 5), stride = gridDim.x * warps;
    const Int8Out o8 = int8_row(xq, xs, xsum, row, n, fmt);
    if (fmt == ACT_Q8_0) {
        for (int g = first; g < n / 32; g += stride) {
            const int i = g * 32 + lane;
            const float v[1] = {glu(gr[i], ur[i], gelu)};
            if (hr) hr[i] = __float2half_rn(v[0]);
            quantize_group<1>(v, g, fmt, yr ? yr + g * 32 : nullptr, nullptr, o8);
        }
    } else {
        for (int g = first; g < n / 256; g += stride) {
            const int i = g * 256 + lane * 8;
            float v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = glu(gr[i + k], ur[i + k], gelu);
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

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// The best (value, id) of the block: ties to the lowest id; every thread gets the result.
__device__ __forceinline__ void block_best(float& bv, int& bi) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
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
}

// Picks the next token of each logits row i (grid: rows, 1024 threads), for pass row r = out_rows[i]:
// the arg-max when temps[r] <= 0, else the Gumbel-max trick (argmax of logits/T + Gumbel noise draws
// exactly from softmax(logits/T)) with noise hashed from (seeds[r], position, token). Ties go to the
// lowest id, as numpy.argmax does; NaN never wins. The token goes to hist[r][pos + 1] (the
// sequence's token history, when hist[r] != 0); with `advance` the row becomes the next decode
// step's: tok = the token, pos and slot one further, and base too for a plain row (its span is its
// own slots); a row with a span of its own (anc_off >= 0: a branch drafted ahead in slots past the
// sequence's, infer/draft_ahead.py) keeps its base and reads its next slot from the span.
extern "C" __global__ void __launch_bounds__(1024)
    sample_rows(const float* logits, int vocab, const int* out_rows, const float* temps, const unsigned int* seeds,
                int* tok, int* pos, int* slot, int* base, const int* anc_off, const unsigned long long* hist,
                int advance) {
    pdl_enter();
    const float* row = logits + (size_t)blockIdx.x * vocab;
    const int r = out_rows[blockIdx.x];
    const int p = pos[r];
    const float temperature = temps[r];
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    const uint32_t key = mix32(seeds[r] ^ mix32((uint32_t)p * 0x9E3779B9u));
    // SAMPLE_UNROLL logits' loads in flight per thread before any is compared: one block streams a
    // 150k vocabulary in a few memory latencies instead of one per element
    constexpr int SAMPLE_UNROLL = 16;
    auto consider = [&](float v, int i) {
        if (temperature > 0.f) {
            const uint32_t h = mix32(key ^ (uint32_t)i * 0x85EBCA6Bu);
            const float u = ((float)(h >> 8) + 0.5f) * (1.f / 16777216.f);
            v = v / temperature - logf(-logf(u));
        }
        if (v > bv || (v == bv && i < bi)) {
            bv = v;
            bi = i;
        }
    };
    int i0 = threadIdx.x;
    for (; i0 + (SAMPLE_UNROLL - 1) * (int)blockDim.x < vocab; i0 += SAMPLE_UNROLL * blockDim.x) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; ++u) v[u] = __ldg(row + i0 + u * blockDim.x);
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; ++u) consider(v[u], i0 + u * blockDim.x);
    }
    for (; i0 < vocab; i0 += blockDim.x) consider(__ldg(row + i0), i0);
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        const int next = bi == 0x7fffffff ? 0 : bi;
        if (hist[r]) reinterpret_cast<int*>(hist[r])[p + 1] = next;
        if (advance && hist[r]) {  // rows without a history (padding) stay where they are
            tok[r] = next;
            pos[r] = p + 1;
            slot[r] = slot[r] + 1;
            if (anc_off[r] < 0) base[r] = p + 2;
        }
    }
}

// Each row's arg-max of `rows` logits vectors (vocab,) at once, one block of 1024 threads a row:
// the id (ties to the lowest, as sample_token and numpy.argmax; NaN never wins, as in
// sample_token), its value, and how many NaN or +inf the row holds. A greedy walk down a verified
// token tree reads these few numbers instead of copying each visited row of the vocabulary.
extern "C" __global__ void __launch_bounds__(1024)
    argmax_rows(const float* logits, int vocab, int* ids, float* maxima, int* nonfinite) {
    pdl_enter();
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ int bad_n[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float bv = NEG_INF;
    int bi = 0x7fffffff, bad = 0;
    constexpr int ROW_UNROLL = 16;  // loads in flight per thread, as in sample_token
    auto consider = [&](float v, int i) {
        bad += (isnan(v) || (isinf(v) && v > 0.f)) ? 1 : 0;
        if (v > bv || (v == bv && i < bi)) {
            bv = v;
            bi = i;
        }
    };
    int i0 = threadIdx.x;
    for (; i0 + (ROW_UNROLL - 1) * (int)blockDim.x < vocab; i0 += ROW_UNROLL * blockDim.x) {
        float v[ROW_UNROLL];
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) v[u] = __ldg(row + i0 + u * blockDim.x);
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) consider(v[u], i0 + u * blockDim.x);
    }
    for (; i0 < vocab; i0 += blockDim.x) consider(__ldg(row + i0), i0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        bad += __shfl_xor_sync(0xffffffffu, bad, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
        bad_n[warp] = bad;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? best_v[lane] : NEG_INF;
        bi = lane < nw ? best_i[lane] : 0x7fffffff;
        bad = lane < nw ? bad_n[lane] : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            bad += __shfl_xor_sync(0xffffffffu, bad, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            ids[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
            maxima[blockIdx.x] = bv;
            nonfinite[blockIdx.x] = bad;
        }
    }
}

// A small upload done by the SMs (infer/gpu/uploads.py): `n` words read from pinned host memory
// (mapped under unified addressing; volatile loads, as the host rewrites it between passes) into
// device memory. A copy engine's memcpy would queue behind a streamed model's ring refills.
extern "C" __global__ void copy_words_from_host(const unsigned int* src, unsigned int* dst, long long n) {
    pdl_enter();  // a kernel before it in a captured pass may still read the old words
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = __ldcv(src + i);
}
