// Prompt products: Y = X W^T for the prompt rows of a pass (prompt tokens whose logits nobody reads,
// docs/GPU.md "Prompt rows"). X is float16, W a planar quantized matrix (formats.cuh) dequantized
// to float16 in shared memory; products and sums on the tensor cores (mma.sync m16n8k16, float32
// accumulators). Every output element accumulates K in ascending steps of 16 in one accumulator,
// whichever tile or variant holds it, so a row's result does not depend on N or on the other rows.
//
//   pmm_<fmt>_t<BN>  a block of 256 threads computes 128 weight rows x BN tokens (BN 32, 64, 128).
//                    A stage is 64 values of K (two sub-blocks): the weights' planes and the
//                    tokens' float16 values come in by cp.async (PMM_STAGES stages in flight),
//                    each thread dequantizes one (row, sub-block) into a float16 tile, and the
//                    warps multiply that tile with the tokens' by ldmatrix fragments.
//
// The float16 weight of each format (infer.gpu.reference.prompt_weights reproduces every bit):
//   q8      w = s * q                              one float16 multiply
//   g4, g5  w = fma(q, s, m)                       one float16 fused multiply-add
//   k4, k5  w = fma(q, f16(d * sc), f16(-(dmin * mn)))   (the float32 products are exact)
//   k6      w = (q - 32) * f16(d * sc)             (sc per 16 weights)
// Integers become float16 without the conversion unit: a byte b under the exponent of 1024
// (0x6400 | b) is the float16 1024 + b, and one subtraction removes the 1024 (exact).
// Row lengths must be multiples of 64 (ops.uses_pmm); K-quants have multiples of 256 anyway.
#include "formats.cuh"
#include "canon.cuh"
#include "async.cuh"
#include "qmm_operands.cuh"

#ifndef PMM_FORMAT
#define PMM_FORMAT 0  // the one format (KIND, as qmm.cu) this module instantiates; 0 every format
#endif
#ifndef PMM_STAGES
#define PMM_STAGES 3  // shared-memory stages of the cp.async pipeline
#endif
#ifndef PMM_MIN_BLOCKS
#define PMM_MIN_BLOCKS 2  // blocks per SM the register allocation must allow
#endif
#define PMM_BM 128       // weight rows per block
#define PMM_THREADS 256  // 8 warps; 2 threads per row dequantize a stage's two sub-blocks
#define PMM_PITCH 144    // bytes per row of a 64-value float16 tile (+16: ldmatrix reads hit 32 banks)

template <int KIND>
struct PFmt {
    static constexpr int QS = KIND == 1 ? 32 : 16;                  // qs bytes per sub-block
    static constexpr int BITS = KIND == 1 ? 8 : KIND % 10;
    static constexpr int HI = BITS == 5 ? 4 : (BITS == 6 ? 8 : 0);  // hi bytes per sub-block
    static constexpr int SMB = (KIND == 4 || KIND == 5) ? 4 : 2;     // sm bytes per sub-block
    static constexpr bool SUPER = KIND >= 14;
};

// One stage in shared memory: the planes of 128 rows x 2 sub-blocks, then BN tokens x 64 values.
template <int KIND, int BN>
struct PStage {
    typedef PFmt<KIND> F;
    static constexpr int OFF_H = PMM_BM * 2 * F::QS;
    static constexpr int OFF_S = OFF_H + PMM_BM * 2 * F::HI;
    static constexpr int OFF_D = OFF_S + PMM_BM * 2 * F::SMB;
    static constexpr int OFF_X = (OFF_D + (F::SUPER ? PMM_BM * 4 : 0) + 127) / 128 * 128;
    static constexpr int BYTES = OFF_X + BN * PMM_PITCH;
    static constexpr int A16 = PMM_STAGES * BYTES;             // the dequantized tile, after the stages
    static constexpr int TOTAL = A16 + PMM_BM * PMM_PITCH;     // dynamic shared memory of a block
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

// Thread (r, j): sub-block j of the stage's row r -> 32 float16 weights (natural order) at `out`.
template <int KIND, int BN>
__device__ __forceinline__ void pmm_dequant(const unsigned char* st, int r, int j, unsigned char* out) {
    typedef PFmt<KIND> F;
    typedef PStage<KIND, BN> S;
    const int sb = 2 * r + j;
    uint4 o[4];  // weights 8k .. 8k+7
    if (KIND == 1) {
        const uint4 lo = *reinterpret_cast<const uint4*>(st + sb * 32);
        const uint4 hi = *reinterpret_cast<const uint4*>(st + sb * 32 + 16);
        const __half2 s = __half2half2(*reinterpret_cast<const __half*>(st + S::OFF_S + sb * 2));
        const __half2 bias = __float2half2_rn(1152.f), zero = __float2half2_rn(0.f);
        const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // int8 b as the byte b + 128
            four<false>(w[2 * k] ^ 0x80808080u, bias, s, zero, o[k].x, o[k].y);
            four<false>(w[2 * k + 1] ^ 0x80808080u, bias, s, zero, o[k].z, o[k].w);
        }
    } else {
        const uint4 q = *reinterpret_cast<const uint4*>(st + sb * 16);
        const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
        uint32_t h0 = 0, h1 = 0;
        if (F::HI == 4) h0 = *reinterpret_cast<const uint32_t*>(st + S::OFF_H + sb * 4);
        if (F::HI == 8) {
            const uint2 h = *reinterpret_cast<const uint2*>(st + S::OFF_H + sb * 8);
            h0 = h.x;
            h1 = h.y;
        }
        __half2 s_lo, s_hi, m, bias = __float2half2_rn(1024.f);
        if (KIND == 4 || KIND == 5) {  // (s, m) per sub-block
            const __half2 sm = *reinterpret_cast<const __half2*>(st + S::OFF_S + sb * 4);
            s_lo = s_hi = __low2half2(sm);
            m = __high2half2(sm);
        } else {
            const uint32_t sc = *reinterpret_cast<const unsigned short*>(st + S::OFF_S + sb * 2);
            const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(st + S::OFF_D + r * 4));
            if (F::BITS == 6) {  // two signed scales, one per 16 weights; q - 32
                s_lo = __float2half2_rn(__fmul_rn(dm.x, (float)(int)(signed char)(sc & 0xFFu)));
                s_hi = __float2half2_rn(__fmul_rn(dm.x, (float)(int)(signed char)(sc >> 8)));
                m = __float2half2_rn(0.f);
                bias = __float2half2_rn(1056.f);
            } else {  // 6-bit scale and min
                s_lo = s_hi = __float2half2_rn(__fmul_rn(dm.x, (float)(int)(sc & 0xFFu)));
                m = __float2half2_rn(-__fmul_rn(dm.y, (float)(int)(sc >> 8)));
            }
        }
        constexpr bool FMA = F::BITS != 6;
#pragma unroll
        for (int t = 0; t < 4; ++t) {  // word t: weights 4t..4t+3 (low nibbles), 16+4t..16+4t+3 (high)
            uint32_t lo = qw[t] & 0x0F0F0F0Fu, hi = (qw[t] >> 4) & 0x0F0F0F0Fu;
            if (F::BITS == 5) {
                lo |= spread_bit4((h0 >> (4 * t)) & 0xFu);
                hi |= spread_bit4((h0 >> (16 + 4 * t)) & 0xFu);
            } else if (F::BITS == 6) {
                lo |= spread_2bit4((h0 >> (8 * t)) & 0xFFu);
                hi |= spread_2bit4((h1 >> (8 * t)) & 0xFFu);
            }
            uint32_t a0, a1, b0, b1;
            four<FMA>(lo, bias, s_lo, m, a0, a1);
            four<FMA>(hi, bias, s_hi, m, b0, b1);
            if (t & 1) {
                o[t >> 1].z = a0, o[t >> 1].w = a1;
                o[2 + (t >> 1)].z = b0, o[2 + (t >> 1)].w = b1;
            } else {
                o[t >> 1].x = a0, o[t >> 1].y = a1;
                o[2 + (t >> 1)].x = b0, o[2 + (t >> 1)].y = b1;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) reinterpret_cast<uint4*>(out)[k] = o[k];
}

// The cp.async copies of one stage; each thread's source pointers are worked out once per block.
template <int KIND, int BN>
struct PmmLoader {
    typedef PFmt<KIND> F;
    typedef PStage<KIND, BN> S;
    static constexpr int QP = F::QS / 16;                // 16-byte qs pieces per (row, sub-block)
    static constexpr int XP = BN * 8 / PMM_THREADS;       // 16-byte token pieces per thread
    static_assert(XP >= 1 && XP * PMM_THREADS == BN * 8, "token pieces");
    const uint8_t* qs;  // (row tid/2, sub-block tid%2) of stage 0
    const uint8_t* hi;  // rows tid < 128: the row's hi, sm and dm at stage 0
    const uint8_t* sm;
    const uint8_t* dm;
    const __half* xs;   // token tid/8 + k*32, values (tid%8)*8.. of stage 0
    bool qvalid, rvalid;
    unsigned xvalid;
    long long K;

    __device__ __forceinline__ PmmLoader(const Parts& parts, int M, int K_, const __half* x, int N, int row0,
                                         int tok0) {
        const int tid = threadIdx.x, nsb = K_ >> 5;
        K = K_;
        const int rq = row0 + (tid >> 1);
        qs = parts.p[0].qs;
        qvalid = rq < M;
        if (qvalid) {
            const int pi = parts.part(rq);
            qs = parts.planes(pi).qs + ((long long)(rq - parts.start(pi)) * nsb + (tid & 1)) * F::QS;
        }
        hi = parts.p[0].hi;
        sm = parts.p[0].sm;
        dm = parts.p[0].dm;
        rvalid = tid < PMM_BM && row0 + tid < M;
        if (rvalid) {
            const int pi = parts.part(row0 + tid);
            const long long g = (long long)(row0 + tid - parts.start(pi)) * nsb;
            const Planes pl = parts.planes(pi);
            hi = pl.hi + g * F::HI;
            sm = pl.sm + g * F::SMB;
            dm = pl.dm + (g >> 3) * 4;
        }
        xs = x + (long long)(tok0 + (tid >> 3)) * K_ + (tid & 7) * 8;
        xvalid = 0u;
#pragma unroll
        for (int k = 0; k < XP; ++k)
            if (tok0 + (tid >> 3) + k * (PMM_THREADS / 8) < N) xvalid |= 1u << k;
    }

    __device__ __forceinline__ void load(unsigned char* st, int kt, const __half* x) const {
        const int tid = threadIdx.x;
        const long long sb0 = 2LL * kt;  // the stage's first sub-block of the row
#pragma unroll
        for (int c = 0; c < QP; ++c)
            cp_async16(st + (tid >> 1) * 2 * F::QS + (tid & 1) * F::QS + c * 16, qvalid ? qs + sb0 * F::QS + c * 16 : qs,
                       qvalid);
        if (tid < PMM_BM) {
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
            cp_async16(st + S::OFF_X + t * PMM_PITCH + (tid & 7) * 16,
                       valid ? xs + (long long)k * (PMM_THREADS / 8) * K + kt * 64 : x, valid);
        }
    }
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const unsigned char* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// c += A B: A 16x16 float16 (row-major fragment), B 16x8 (column fragment), C float32
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int KIND, int BN>
__device__ __forceinline__ void pmm_body(const Parts& parts, int M, int K, const __half* x, int N, float* y, int ldy,
                                         const float* bias, const float* residual) {
    typedef PStage<KIND, BN> S;
    constexpr int WN = BN == 32 ? 1 : 2;        // warps across the tokens
    constexpr int WM = 8 / WN;                  // warps across the rows
    constexpr int MT = PMM_BM / WM / 16;        // 16-row tiles per warp
    constexpr int NT = BN / WN / 8;             // 8-token tiles per warp
    static_assert(NT % 2 == 0, "token tiles come in pairs (one ldmatrix.x4)");
    extern __shared__ __align__(128) unsigned char pmm_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int tok0 = blockIdx.x * BN, row0 = blockIdx.y * PMM_BM;
    const int wr = (warp / WN) * (PMM_BM / WM), wc = (warp % WN) * (BN / WN);
    const int nk = K >> 6;
    unsigned char* a16 = pmm_smem + S::A16;
    float acc[MT][NT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
    const PmmLoader<KIND, BN> loader(parts, M, K, x, N, row0, tok0);
#pragma unroll
    for (int s = 0; s < PMM_STAGES - 1; ++s) {
        if (s < nk) loader.load(pmm_smem + s * S::BYTES, s, x);
        cp_async_commit();
    }
    for (int i = 0; i < nk; ++i) {
        cp_async_wait<PMM_STAGES - 2>();  // stage i has landed (this thread's copies) ...
        __syncthreads();                  // ... everyone's, and the previous stage's tiles are read
        const int ahead = i + PMM_STAGES - 1;
        if (ahead < nk) loader.load(pmm_smem + (ahead % PMM_STAGES) * S::BYTES, ahead, x);
        cp_async_commit();
        const unsigned char* st = pmm_smem + (i % PMM_STAGES) * S::BYTES;
        pmm_dequant<KIND, BN>(st, tid >> 1, tid & 1, a16 + (tid >> 1) * PMM_PITCH + (tid & 1) * 64);
        __syncthreads();
        const unsigned char* xt = st + S::OFF_X;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {  // 16 values of K at a time, ascending
            uint32_t a[MT][4], b[NT / 2][4];  // b[nj]: token tiles 2nj, 2nj+1, (b0, b1) each
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
                ldsm_x4(a[mi], a16 + (wr + mi * 16 + (lane & 15)) * PMM_PITCH + kk * 32 + (lane >> 4) * 16);
#pragma unroll
            for (int nj = 0; nj < NT / 2; ++nj)
                ldsm_x4(b[nj], xt + (wc + nj * 16 + (lane >> 4) * 8 + (lane & 7)) * PMM_PITCH + kk * 32 +
                                   ((lane >> 3) & 1) * 16);
#pragma unroll
            for (int nj = 0; nj < NT / 2; ++nj)
#pragma unroll
                for (int mi = 0; mi < MT; ++mi) {
                    mma_f16(acc[mi][2 * nj], a[mi], b[nj][0], b[nj][1]);
                    mma_f16(acc[mi][2 * nj + 1], a[mi], b[nj][2], b[nj][3]);
                }
        }
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

#define PMM(NAME, KIND, BN)                                                                                     \
    extern "C" __global__ void __launch_bounds__(PMM_THREADS, PMM_MIN_BLOCKS)                                  \
        pmm_##NAME##_t##BN(PARTS_ARGS, int M, int K, const __half* x, int N, float* y, int ldy, const float* bias, \
                           const float* residual) {                                                             \
        pmm_body<KIND, BN>(PARTS_OF, M, K, x, N, y, ldy, bias, residual);                                      \
    }
#define PMMS(NAME, KIND) PMM(NAME, KIND, 32) PMM(NAME, KIND, 64) PMM(NAME, KIND, 128)

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
