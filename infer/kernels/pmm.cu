// Prompt products: Y = X W^T for the prompt rows of a pass (prompt tokens whose logits nobody reads,
// docs/GPU.md "Prompt rows"). X is float16, W a planar quantized matrix (formats.cuh) dequantized
// to float16 in registers as the tensor cores take it; products and sums on the tensor cores
// (mma.sync m16n8k16, float32 accumulators). Every output element accumulates its K in one fixed
// order in one accumulator, whichever tile or variant holds it, so a row's result does not depend
// on N or on the other rows.
//
//   pmm_<fmt>_t<BN>  a block of 256 threads computes 128 weight rows x BN tokens (BN 32, 64, 128):
//                    8 warps, 4 across the rows (32 each) and 2 across the tokens. A stage is 64
//                    values of K (two sub-blocks): the weights' planes and the tokens' float16
//                    values come in by cp.async (three slots, one barrier a stage). Each thread
//                    builds its A fragments straight from the quantized bytes (lane c of a quad
//                    takes bytes 4c..4c+3 of a row's sub-block: weights 4c..4c+3 and 16+4c..16+4c+3)
//                    and loads the matching activations (8 bytes: values 4c..4c+3 of a 16-value
//                    step) as its B fragment: in each mma, slots 2c, 2c+1, 2c+8, 2c+9 of K hold
//                    weights 4c, 4c+1, 4c+2, 4c+3 of the step, one order for every tile.
//
// The float16 weight of each format (infer.gpu.reference.prompt_weights reproduces every bit):
//   q8      w = s * q                              one float16 multiply
//   g4, g5  w = fma(q, s, m)                       one float16 fused multiply-add
//   k4, k5  w = fma(q, f16(d * sc), f16(-(dmin * mn)))   (the float32 products are exact)
//   k6      w = (q - 32) * f16(d * sc)             (sc per 16 weights)
// Integers become float16 without the conversion unit: a byte b under the exponent of 1024
// (0x6400 | b) is the float16 1024 + b, and one subtraction removes the 1024 (exact).
// Row lengths must be multiples of 64 (products.uses_pmm); K-quants have multiples of 256 anyway.
#include "formats.cuh"
#include "canon.cuh"
#include "async.cuh"
#include "qmm_operands.cuh"

#ifndef PMM_FORMAT
#define PMM_FORMAT 0  // the one format (KIND, as qmm.cu) this module instantiates; 0 every format
#endif
#ifndef PMM_MIN_BLOCKS
#define PMM_MIN_BLOCKS 2  // blocks per SM the register allocation must allow
#endif
#define PMM_SLOTS 3      // stages in shared memory: the one multiplied and two in flight
#define PMM_THREADS 256  // 8 warps: BM / 32 across the rows (32 each), the rest across the tokens
#define PMM_XPITCH 160   // bytes per token of a stage (64 float16 + 32: a warp's 8-byte loads, 8 tokens x
                         // 4 lanes, hit every bank twice)

template <int KIND>
struct PFmt {
    static constexpr int QS = KIND == 1 ? 32 : 16;                  // qs bytes per sub-block
    static constexpr int QP = 2 * QS + 16;                          // qs bytes per row of a stage (+16:
                                                                    // 8 rows x 4 lanes hit 32 banks)
    static constexpr int BITS = KIND == 1 ? 8 : KIND % 10;
    static constexpr int HI = BITS == 5 ? 4 : (BITS == 6 ? 8 : 0);  // hi bytes per sub-block
    static constexpr int SMB = (KIND == 4 || KIND == 5) ? 4 : 2;     // sm bytes per sub-block
    static constexpr bool SUPER = KIND >= 14;
};

// One stage in shared memory: the planes of BM rows x 2 sub-blocks, then BN tokens x 64 values.
template <int KIND, int BN, int BM>
struct PStage {
    typedef PFmt<KIND> F;
    static constexpr int OFF_H = BM * F::QP;
    static constexpr int OFF_S = OFF_H + BM * 2 * F::HI;
    static constexpr int OFF_D = OFF_S + BM * 2 * F::SMB;
    static constexpr int OFF_X = (OFF_D + (F::SUPER ? BM * 4 : 0) + 127) / 128 * 128;
    static constexpr int BYTES = OFF_X + BN * PMM_XPITCH;
    static constexpr int TOTAL = PMM_SLOTS * BYTES;  // dynamic shared memory of a block
};

__device__ __forceinline__ __half2 bits_h2(uint32_t v) {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = v;
    return h;
}
__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// bytes (0, 1) (sel 0x4140) or (2, 3) (sel 0x4342) of v as the float16 pair (1024 + b0, 1024 + b1)
__device__ __forceinline__ __half2 byte_pair(uint32_t v, uint32_t sel) { return bits_h2(__byte_perm(v, 0x64u, sel)); }

// four byte values (weights i..i+3) as two float16 pairs, minus `bias`, times s (+ m)
template <bool FMA>
__device__ __forceinline__ void four(uint32_t v, __half2 bias, __half2 s, __half2 m, uint32_t& p0, uint32_t& p1) {
    const __half2 a = __hsub2(byte_pair(v, 0x4140u), bias), b = __hsub2(byte_pair(v, 0x4342u), bias);
    p0 = h2_bits(FMA ? __hfma2(a, s, m) : __hmul2(a, s));
    p1 = h2_bits(FMA ? __hfma2(b, s, m) : __hmul2(b, s));
}

// A row's scales for one sub-block of the stage: w = fma(q - bias, s, m) (or (q - bias) * s), s_lo for
// weights 0..15 and s_hi for 16..31 (they differ for Q6_K only)
struct PScale {
    __half2 s_lo, s_hi, m;
};

template <int KIND, int BN, int BM>
__device__ __forceinline__ PScale pmm_scale(const unsigned char* st, int r, int j) {
    typedef PFmt<KIND> F;
    typedef PStage<KIND, BN, BM> S;
    const int sb = 2 * r + j;
    PScale p;
    p.m = __float2half2_rn(0.f);
    if (KIND == 1) {
        p.s_lo = p.s_hi = __half2half2(*reinterpret_cast<const __half*>(st + S::OFF_S + sb * 2));
    } else if (KIND == 4 || KIND == 5) {  // (s, m) per sub-block
        const __half2 sm = *reinterpret_cast<const __half2*>(st + S::OFF_S + sb * 4);
        p.s_lo = p.s_hi = __low2half2(sm);
        p.m = __high2half2(sm);
    } else {
        const uint32_t sc = *reinterpret_cast<const unsigned short*>(st + S::OFF_S + sb * 2);
        const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(st + S::OFF_D + r * 4));
        if (F::BITS == 6) {  // two signed scales, one per 16 weights
            p.s_lo = __float2half2_rn(__fmul_rn(dm.x, (float)(int)(signed char)(sc & 0xFFu)));
            p.s_hi = __float2half2_rn(__fmul_rn(dm.x, (float)(int)(signed char)(sc >> 8)));
        } else {  // 6-bit scale and min
            p.s_lo = p.s_hi = __float2half2_rn(__fmul_rn(dm.x, (float)(int)(sc & 0xFFu)));
            p.m = __float2half2_rn(-__fmul_rn(dm.y, (float)(int)(sc >> 8)));
        }
    }
    return p;
}

// Lane c's A fragment halves of row r, sub-block j, step h (h = 0: weights 4c..4c+3, 1: 16+4c..16+4c+3):
// lo = weights (4c, 4c+1), hi = (4c+2, 4c+3) as float16 pairs. `q` is the row's qs word at 4c (bytes
// 4c..4c+3; for Q8_0 those of step h).
template <int KIND, int BN, int BM>
__device__ __forceinline__ void pmm_pairs(const unsigned char* st, int r, int j, int c, int h, uint32_t q,
                                          const PScale& p, uint32_t& lo, uint32_t& hi) {
    typedef PFmt<KIND> F;
    typedef PStage<KIND, BN, BM> S;
    const int sb = 2 * r + j;
    uint32_t v;
    if (KIND == 1) {
        v = q ^ 0x80808080u;  // int8 b as the byte b + 128
    } else {
        v = h ? (q >> 4) & 0x0F0F0F0Fu : q & 0x0F0F0F0Fu;
        if (F::BITS == 5)
            v |= spread_bit4((*reinterpret_cast<const uint32_t*>(st + S::OFF_H + sb * 4) >> (16 * h + 4 * c)) & 0xFu);
        if (F::BITS == 6)
            v |= spread_2bit4((*reinterpret_cast<const uint32_t*>(st + S::OFF_H + sb * 8 + 4 * h) >> (8 * c)) & 0xFFu);
    }
    const __half2 bias = __float2half2_rn(KIND == 1 ? 1152.f : (F::BITS == 6 ? 1056.f : 1024.f));
    four<F::BITS != 6 && KIND != 1>(v, bias, h ? p.s_hi : p.s_lo, p.m, lo, hi);
}

// The cp.async copies of one stage; each thread's source pointers are worked out once per block.
template <int KIND, int BN, int BM>
struct PmmLoader {
    typedef PFmt<KIND> F;
    typedef PStage<KIND, BN, BM> S;
    static constexpr int QP = F::QS / 16;                // 16-byte qs pieces per (row, sub-block)
    static constexpr int XP = BN * 8 / PMM_THREADS;       // 16-byte token pieces per thread
    static_assert(XP >= 1 && XP * PMM_THREADS == BN * 8, "token pieces");
    const uint8_t* qs;  // threads < 2 BM: (row tid/2, sub-block tid%2) of stage 0
    const uint8_t* hi;  // threads < BM: the row's hi, sm and dm at stage 0
    const uint8_t* sm;
    const uint8_t* dm;
    int xs;             // where token tid/8 + k*32's values (tid%8)*8.. of stage 0 are in x
    bool qvalid, rvalid;
    unsigned xvalid;
    int K;

    __device__ __forceinline__ PmmLoader(const Parts& parts, int M, int K_, int N, int row0, int tok0) {
        const int tid = threadIdx.x, nsb = K_ >> 5;
        K = K_;
        const int rq = row0 + (tid >> 1);
        qs = parts.p[0].qs;
        qvalid = tid < 2 * BM && rq < M;
        if (qvalid) {
            const int pi = parts.part(rq);
            qs = parts.planes(pi).qs + ((long long)(rq - parts.start(pi)) * nsb + (tid & 1)) * F::QS;
        }
        hi = parts.p[0].hi;
        sm = parts.p[0].sm;
        dm = parts.p[0].dm;
        rvalid = tid < BM && row0 + tid < M;
        if (rvalid) {
            const int pi = parts.part(row0 + tid);
            const long long g = (long long)(row0 + tid - parts.start(pi)) * nsb;
            const Planes pl = parts.planes(pi);
            hi = pl.hi + g * F::HI;
            sm = pl.sm + g * F::SMB;
            dm = pl.dm + (g >> 3) * 4;
        }
        xs = (tok0 + (tid >> 3)) * K_ + (tid & 7) * 8;  // N * K < 2^31: N <= 512 rows of K <= 2^16
        xvalid = 0u;
#pragma unroll
        for (int k = 0; k < XP; ++k)
            if (tok0 + (tid >> 3) + k * (PMM_THREADS / 8) < N) xvalid |= 1u << k;
    }

    __device__ __forceinline__ void load(unsigned char* st, int kt, const __half* x) const {
        const int tid = threadIdx.x;
        const long long sb0 = 2LL * kt;  // the stage's first sub-block of the row
        if (tid < 2 * BM) {
#pragma unroll
            for (int c = 0; c < QP; ++c)
                cp_async16(st + (tid >> 1) * F::QP + (tid & 1) * F::QS + c * 16,
                           qvalid ? qs + sb0 * F::QS + c * 16 : qs, qvalid);
        }
        if (tid < BM) {
            if (F::HI == 4) cp_async8(st + S::OFF_H + tid * 8, rvalid ? hi + sb0 * 4 : hi, rvalid);
            if (F::HI == 8) cp_async16(st + S::OFF_H + tid * 16, rvalid ? hi + sb0 * 8 : hi, rvalid);
            if (F::SMB == 2) cp_async4(st + S::OFF_S + tid * 4, rvalid ? sm + sb0 * 2 : sm, rvalid);
            if (F::SMB == 4) cp_async8(st + S::OFF_S + tid * 8, rvalid ? sm + sb0 * 4 : sm, rvalid);
            if (F::SUPER) cp_async4(st + S::OFF_D + tid * 4, rvalid ? dm + (kt >> 2) * 4 : dm, rvalid);
        }
#pragma unroll
        for (int k = 0; k < XP; ++k) {
            const bool valid = (xvalid >> k) & 1u;
            const int t = (tid >> 3) + k * (PMM_THREADS / 8);
            cp_async16(st + S::OFF_X + t * PMM_XPITCH + (tid & 7) * 16,
                       valid ? x + xs + k * (PMM_THREADS / 8) * K + kt * 64 : x, valid);
        }
    }
};

__device__ __forceinline__ uint2 lds64(const unsigned char* p) { return *reinterpret_cast<const uint2*>(p); }

// c += A B: A 16x16 float16 (row-major fragment), B 16x8 (column fragment), C float32
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The warp's products of one stage: rows wr.. (MT tiles of 16) x tokens wc.. (NT tiles of 8), the
// stage's four 16-value steps in ascending order (sub-block 0's weights 0..15, 16..31, then
// sub-block 1's), into acc.
template <int KIND, int BN, int BM, int MT, int NT>
__device__ __forceinline__ void pmm_products(const unsigned char* st, int wr, int wc, int lane, float (&acc)[MT][NT][4]) {
    typedef PFmt<KIND> F;
    typedef PStage<KIND, BN, BM> S;
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        PScale ps[MT][2];
        uint32_t qw[MT][2];  // rows g, g+8 of each 16-row tile: the qs word at 4c (Q8_0: per step, below)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int r = wr + mi * 16 + g + 8 * u;
                ps[mi][u] = pmm_scale<KIND, BN, BM>(st, r, j);
                qw[mi][u] = *reinterpret_cast<const uint32_t*>(st + r * F::QP + j * F::QS + 4 * c);
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int r = wr + mi * 16 + g + 8 * u;
                    const uint32_t q = KIND == 1 && h ? *reinterpret_cast<const uint32_t*>(st + r * F::QP + j * F::QS +
                                                                                            16 + 4 * c)
                                                      : qw[mi][u];
                    pmm_pairs<KIND, BN, BM>(st, r, j, c, h, q, ps[mi][u], a[mi][u], a[mi][2 + u]);
                }
            const int k0 = j * 32 + h * 16 + 4 * c;  // this lane's first value of the step
#pragma unroll
            for (int ni = 0; ni < NT; ++ni) {
                const uint2 b = lds64(st + S::OFF_X + (wc + ni * 8 + g) * PMM_XPITCH + k0 * 2);
#pragma unroll
                for (int mi = 0; mi < MT; ++mi) mma_f16(acc[mi][ni], a[mi], b.x, b.y);
            }
        }
    }
}

template <int KIND, int BN, int BM>
__device__ __forceinline__ void pmm_body(const Parts& parts, int M, int K, const __half* x, int N, float* y, int ldy,
                                         const float* bias, const float* residual) {
    typedef PStage<KIND, BN, BM> S;
    constexpr int MT = 2;              // 32 rows per warp
    constexpr int WM = BM / 32;        // warps across the rows
    constexpr int WN = 8 / WM;         // warps across the tokens
    constexpr int NT = BN / WN / 8;    // 8-token tiles per warp
    static_assert(NT >= 1 && NT * 8 * WN == BN, "token tiles");
    extern __shared__ __align__(128) unsigned char pmm_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int tok0 = blockIdx.x * BN, row0 = blockIdx.y * BM;
    const int wr = (warp / WN) * 32, wc = (warp % WN) * (BN / WN);
    const int nk = K >> 6;
    float acc[MT][NT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
    const PmmLoader<KIND, BN, BM> loader(parts, M, K, N, row0, tok0);
#pragma unroll
    for (int s = 0; s < PMM_SLOTS - 1; ++s) {
        if (s < nk) loader.load(pmm_smem + s * S::BYTES, s, x);
        cp_async_commit();
    }
    for (int i = 0; i < nk; ++i) {
        cp_async_wait<PMM_SLOTS - 2>();  // stage i has landed (this thread's copies) ...
        __syncthreads();                 // ... everyone's, and stage i - 1's slot is read by all
        const int ahead = i + PMM_SLOTS - 1;
        if (ahead < nk) loader.load(pmm_smem + (ahead % PMM_SLOTS) * S::BYTES, ahead, x);
        cp_async_commit();
        pmm_products<KIND, BN, BM, MT, NT>(pmm_smem + (i % PMM_SLOTS) * S::BYTES, wr, wc, lane, acc);
    }
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + wr + mi * 16 + g + (e >= 2 ? 8 : 0);
                const int tok = tok0 + wc + ni * 8 + 2 * c + (e & 1);
                if (row < M && tok < N)
                    y[(long long)tok * ldy + row] = canon_out(acc[mi][ni][e], row, tok, ldy, bias, residual);
            }
}

// pmm_<fmt>_t<BN> (128 rows a block) and pmm_<fmt>_t<BN>_m64 (64: more blocks for matrices of few rows)
#define PMM(NAME, KIND, BN, BM, SUFFIX)                                                                         \
    extern "C" __global__ void __launch_bounds__(PMM_THREADS, PMM_MIN_BLOCKS)                                  \
        pmm_##NAME##_t##BN##SUFFIX(PARTS_ARGS, int M, int K, const __half* x, int N, float* y, int ldy,         \
                                   const float* bias, const float* residual) {                                 \
        pmm_body<KIND, BN, BM>(PARTS_OF, M, K, x, N, y, ldy, bias, residual);                                  \
    }
#define PMMS(NAME, KIND)                                                                                        \
    PMM(NAME, KIND, 32, 128, ) PMM(NAME, KIND, 64, 128, ) PMM(NAME, KIND, 128, 128, )                          \
    PMM(NAME, KIND, 32, 64, _m64) PMM(NAME, KIND, 64, 64, _m64) PMM(NAME, KIND, 128, 64, _m64)

#if PMM_FORMAT == 0 || PMM_FORMAT == 1
PMMS(q8, 1)
#endif
#if PMM_FORMAT == 0 || PMM_FORMAT == 4
PMMS(g4, 4)
#endif
#if PMM_FORMAT == 0 || PMM_FORMAT == 5
PMMS(g5, 5)
#endif
#if PMM_FORMAT == 0 || PMM_FORMAT == 14
PMMS(k4, 14)
#endif
#if PMM_FORMAT == 0 || PMM_FORMAT == 15
PMMS(k5, 15)
#endif
#if PMM_FORMAT == 0 || PMM_FORMAT == 16
PMMS(k6, 16)
#endif
