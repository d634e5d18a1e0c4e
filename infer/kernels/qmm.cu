// Matrix products Y = X W^T for N token rows at once, over the planar quantized formats of
// formats.cuh, every output summed in the canonical order of canon.cuh (so a token's result does not
// depend on N, on the other tokens, or on which of these kernels computed it):
//   qgemv_<fmt>_v<NV>  a warp per weight row, each lane a sub-block, dp4a integer dot products, NV
//                      (1, 2, 4) vectors per block (grid y: groups of NV): the weights are read once
//                      per group. Decode and small batches, and any N where qmm does not apply.
//   qmm_<fmt>_n<NT>    any N: 64 weight rows x 8*NT tokens per block of 4 warps, both operands staged
//                      in shared memory by cp.async (two stages), integer products on the tensor
//                      cores (mma.sync int8, m16n8k32; m16n8k16 for Q6_K's 16-value scales). The grid
//                      walks the token tiles of a row tile first, so the blocks that share a weight
//                      tile run together and the weights come from HBM once per call.
//   fgemv_<fmt>        float formats (f16, bf16, f32), any N: a warp per row, each lane a sub-block.
// Up to three matrices of one format whose outputs are consecutive rows (Q, K, V; gate, up) are one
// launch: row r reads part p[i] for r in [start_i, end_i) (`Parts`), with no copy stacking them.
// Epilogue: y[t * ldy + r] = acc (+ bias[r]) (+ residual[t * ldy + r]); y may alias residual.
#include "formats.cuh"
#include "canon.cuh"
#include "async.cuh"

#ifndef QG_WARPS
#define QG_WARPS 4  // weight rows (warps) per qgemv block
#endif
#ifndef QG_UNROLL
#define QG_UNROLL 2  // iterations of 32 sub-blocks whose loads a qgemv lane issues before using them
#endif
#ifndef MMQ_WARPS
#define MMQ_WARPS 4  // warps per qmm block, 16 weight rows each
#endif
#ifndef MMQ_STAGES
#define MMQ_STAGES 2  // shared-memory stages of the cp.async pipeline (MMQ_STAGES - 1 loads in flight)
#endif
#ifndef MMQ_MIN_BLOCKS
#define MMQ_MIN_BLOCKS (256 / MMQ_THREADS)  // blocks per SM the register allocation must allow
#endif
#ifndef QMM_FORMAT
#define QMM_FORMAT 0  // the one format (KIND) this module instantiates; 0 every format, 100 the float ones
#endif
#ifndef QMM_KERNELS
#define QMM_KERNELS 3  // 1: the qgemv kernels only, 2: the qmm ones only (tuning sweeps), 3: both
#endif
#define FULL_MASK 0xffffffffu
#define MMQ_ROWS (16 * MMQ_WARPS)
#define MMQ_THREADS (32 * MMQ_WARPS)

// ---------------------------------------------------------------- operands
struct Parts {
    Planes p[3];
    int end0, end1;  // part 0 holds rows [0, end0), part 1 [end0, end1), part 2 [end1, M)
    __device__ __forceinline__ int part(int r) const { return (r >= end0) + (r >= end1); }
    __device__ __forceinline__ int start(int i) const { return i == 0 ? 0 : (i == 1 ? end0 : end1); }
    // part i's planes by selects, not by indexing p (which would put the array in local memory)
    __device__ __forceinline__ Planes planes(int i) const {
        return Planes{i == 0 ? p[0].qs : (i == 1 ? p[1].qs : p[2].qs), i == 0 ? p[0].hi : (i == 1 ? p[1].hi : p[2].hi),
                      i == 0 ? p[0].sm : (i == 1 ? p[1].sm : p[2].sm), i == 0 ? p[0].dm : (i == 1 ? p[1].dm : p[2].dm)};
    }
};

// 8-bit activations of N tokens, row-major: xq (N, K) int8; xs per scale group; xsum per 32
struct Act8 {
    const signed char* xq;
    const float* xs;
    const int* xsum;
};

// ---------------------------------------------------------------- formats
// KIND: 1 q8 (Q8_0), 4 g4 (Q4_0 Q4_1), 5 g5 (Q5_0 Q5_1), 14 k4 (Q4_K), 15 k5 (Q5_K), 16 k6 (Q6_K)
template <int KIND>
struct Q {
    static constexpr bool SUPER = KIND >= 14;  // 256-value tiles with integer sums
    static constexpr int BITS = KIND == 1 ? 8 : KIND % 10;
    static constexpr int QS = KIND == 1 ? 32 : 16;                     // qs bytes per sub-block
    static constexpr int HI = BITS == 5 ? 4 : (BITS == 6 ? 8 : 0);     // hi bytes per sub-block
    static constexpr int SM = (KIND == 4 || KIND == 5) ? 4 : 2;        // sm bytes per sub-block
    static constexpr bool XSUM = KIND == 4 || KIND == 5 || KIND == 14 || KIND == 15;  // offset term
    static constexpr int XS_SHIFT = SUPER ? 8 : 5;                    // log2 of values per act scale

    // --- one sub-block, as a qgemv lane reads it
    struct Raw {
        uint4 a, b;  // qs (b: bytes 16..31, q8 only)
        uint2 h;     // high bits
        uint32_t sm;
        uint32_t dm;  // half2 (d, dmin) of the super-block (K-quants)
    };
    static __device__ __forceinline__ Raw load(const Planes& p, long long sb) {
        Raw r;
        r.a = ldg_u4(p.qs + sb * QS);
        r.b = QS == 32 ? ldg_u4(p.qs + sb * QS + 16) : make_uint4(0, 0, 0, 0);
        r.h = make_uint2(0, 0);
        if (BITS == 5) r.h.x = __ldg(reinterpret_cast<const uint32_t*>(p.hi) + sb);
        if (BITS == 6) r.h = __ldg(reinterpret_cast<const uint2*>(p.hi) + sb);
        r.sm = SM == 4 ? __ldg(reinterpret_cast<const uint32_t*>(p.sm) + sb)
                       : (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p.sm) + sb);
        r.dm = SUPER ? __ldg(reinterpret_cast<const uint32_t*>(p.dm) + (sb >> 3)) : 0u;
        return r;
    }

    // nibble word t (0..3) and the high bits -> the byte values of weights 4t..4t+3 (lo) and
    // 16+4t..16+4t+3 (hi); Q6_K's as signed q - 32
    static __device__ __forceinline__ void values(uint32_t w, uint32_t h0, uint32_t h1, int t, uint32_t& lo,
                                                  uint32_t& hi) {
        lo = w & 0x0F0F0F0Fu;
        hi = (w >> 4) & 0x0F0F0F0Fu;
        if (BITS == 5) {
            lo |= spread_bit4((h0 >> (4 * t)) & 0xFu);
            hi |= spread_bit4((h0 >> (16 + 4 * t)) & 0xFu);
        } else if (BITS == 6) {
            lo = __vsub4(lo | spread_2bit4((h0 >> (8 * t)) & 0xFFu), 0x20202020u);
            hi = __vsub4(hi | spread_2bit4((h1 >> (8 * t)) & 0xFFu), 0x20202020u);
        }
    }

    // integer dot products of a sub-block with x (xa: values 0..15, xb: 16..31): the whole 32, or
    // (Q6_K) the two halves
    static __device__ __forceinline__ void idots(const Raw& r, int4 xa, int4 xb, int& lo16, int& hi16) {
        const int xav[4] = {xa.x, xa.y, xa.z, xa.w}, xbv[4] = {xb.x, xb.y, xb.z, xb.w};
        const uint32_t qa[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, qb[4] = {r.b.x, r.b.y, r.b.z, r.b.w};
        lo16 = 0;
        hi16 = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            if (BITS == 8) {
                lo16 = __dp4a((int)qa[t], xav[t], lo16);
                hi16 = __dp4a((int)qb[t], xbv[t], hi16);
            } else {
                uint32_t lo, hi;
                values(qa[t], r.h.x, r.h.y, t, lo, hi);
                lo16 = __dp4a((int)lo, xav[t], lo16);
                hi16 = __dp4a((int)hi, xbv[t], hi16);
            }
        }
    }

    static __device__ __forceinline__ float half_lo(uint32_t v) { return __half2float(__ushort_as_half((unsigned short)(v & 0xFFFFu))); }
    static __device__ __forceinline__ float half_hi(uint32_t v) { return __half2float(__ushort_as_half((unsigned short)(v >> 16))); }

    // 32-value formats: the sub-block's term
    static __device__ __forceinline__ float term(uint32_t sm, float xs, int idot, int xsum) {
        if (KIND == 1) return term_q8(half_lo(sm), xs, idot);
        return term_g(half_lo(sm), half_hi(sm), xs, idot, xsum);
    }
    // K-quants: the sub-block's contributions to isum and msum
    static __device__ __forceinline__ void super_parts(uint32_t sm, int lo16, int hi16, int xsum, int& ip, int& mp) {
        if (BITS == 6) {
            ip = (int)(signed char)(sm & 0xFFu) * lo16 + (int)(signed char)((sm >> 8) & 0xFFu) * hi16;
            mp = 0;
        } else {
            ip = (int)(sm & 0xFFu) * (lo16 + hi16);
            mp = (int)((sm >> 8) & 0xFFu) * xsum;
        }
    }
    static __device__ __forceinline__ float super_term(uint32_t dm, float xs, int isum, int msum) {
        if (BITS == 6) return term_k6(half_lo(dm), xs, isum);
        return term_k45(half_lo(dm), half_hi(dm), xs, isum, msum);
    }
};

// ---------------------------------------------------------------- qgemv: N <= NV vectors
template <int KIND, int NV>
__device__ __forceinline__ void qgemv_body(const Parts& parts, int M, int K, Act8 x, int nvec, float* y, int ldy,
                                           const float* bias, const float* residual) {
    typedef Q<KIND> F;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * QG_WARPS + (threadIdx.x >> 5);
    if (row >= M) return;  // the whole warp
    // grid y: groups of NV vectors (any N; the weights are read once per group)
    const int v0 = blockIdx.y * NV;
    nvec = min(NV, nvec - v0);
    x.xq += (long long)v0 * K;
    x.xs += (long long)v0 * (K >> F::XS_SHIFT);
    x.xsum += (long long)v0 * (K >> 5);
    y += (long long)v0 * ldy;
    if (residual) residual += (long long)v0 * ldy;
    const int pi = parts.part(row);
    const Planes p = parts.planes(pi);
    const int nsb = K >> 5, ngroups = K >> F::XS_SHIFT;
    const long long base = (long long)(row - parts.start(pi)) * nsb;
    float acc[NV];
#pragma unroll
    for (int v = 0; v < NV; ++v) acc[v] = 0.f;
    for (int s0 = 0; s0 < nsb; s0 += 32 * QG_UNROLL) {
        typename F::Raw r[QG_UNROLL];
#pragma unroll
        for (int u = 0; u < QG_UNROLL; ++u) {
            const int sb = s0 + 32 * u + lane;
            if (sb < nsb) r[u] = F::load(p, base + sb);
            else r[u] = typename F::Raw{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), make_uint2(0, 0), 0u, 0u};
        }
#pragma unroll
        for (int u = 0; u < QG_UNROLL; ++u) {
            const int first = s0 + 32 * u;  // the warp's first sub-block of this iteration
            if (first >= nsb) break;
            const int sb = first + lane;
            const bool have = sb < nsb;
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                if (v >= nvec) continue;  // uniform; `continue` keeps the loop fully unrolled
                int4 xa = make_int4(0, 0, 0, 0), xb = xa;
                float xs = 0.f;
                int xsum = 0;
                if (have) {
                    const int4* xv = reinterpret_cast<const int4*>(x.xq + (long long)v * K + ((long long)sb << 5));
                    xa = __ldg(xv);
                    xb = __ldg(xv + 1);
                    xs = __ldg(x.xs + (long long)v * ngroups + (sb >> (F::XS_SHIFT - 5)));
                    if (F::XSUM) xsum = __ldg(x.xsum + (long long)v * nsb + sb);
                }
                int lo16, hi16;
                F::idots(r[u], xa, xb, lo16, hi16);
                // the iteration's 32 sub-blocks are one group (CANON_GROUP): its tiles in order from 0,
                // then added to acc
                float group = 0.f;
                if (!F::SUPER) {
                    // lanes 4j..4j+3 hold tile j of the iteration: pairwise, as tile4
                    float t = have ? F::term(r[u].sm, xs, lo16 + hi16, xsum) : 0.f;
                    t = __fadd_rn(t, __shfl_xor_sync(FULL_MASK, t, 1));
                    t = __fadd_rn(t, __shfl_xor_sync(FULL_MASK, t, 2));
#pragma unroll
                    for (int j = 0; j < 32 / CANON_TILE; ++j) {
                        const float T = __shfl_sync(FULL_MASK, t, CANON_TILE * j);
                        if (first + CANON_TILE * j < nsb) group = __fadd_rn(group, T);
                    }
                } else {
                    // lanes 8j..8j+7 hold super-block j: exact integer sums, then its term
                    int ip, mp;
                    F::super_parts(r[u].sm, lo16, hi16, xsum, ip, mp);
#pragma unroll
                    for (int o = 1; o < 8; o <<= 1) {
                        ip += __shfl_xor_sync(FULL_MASK, ip, o);
                        mp += __shfl_xor_sync(FULL_MASK, mp, o);
                    }
                    const float t = F::super_term(r[u].dm, xs, ip, mp);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float T = __shfl_sync(FULL_MASK, t, 8 * j);
                        if (first + 8 * j < nsb) group = __fadd_rn(group, T);
                    }
                }
                acc[v] = __fadd_rn(acc[v], group);
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int v = 0; v < NV; ++v)
            if (v < nvec) y[(long long)v * ldy + row] = canon_out(acc[v], row, v, ldy, bias, residual);
    }
}

// ---------------------------------------------------------------- qmm: tensor cores
// D = A B (int8 in, int32 out, C = 0): A 16x32 row-major fragment, B 32x8 column fragment
__device__ __forceinline__ void mma_k32(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}
// D += A B with A unsigned bytes (weights times a scale part), B signed (activations)
__device__ __forceinline__ void mma_u8s8_k32_acc(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// the same for 16 values (A 16x16, B 16x8)
__device__ __forceinline__ void mma_k16(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0), "r"(0), "r"(0), "r"(0));
}

// One stage in shared memory: a super-block (8 sub-blocks, 256 values of K) of 64 weight rows and
// of the block's 8*NT tokens. Row strides are padded so that the fragment reads of a warp (8 rows
// x 4 lanes) fall in 32 different banks.
template <int KIND, int NT>
struct Stage {
    typedef Q<KIND> F;
    static constexpr int BN = 8 * NT;
    static constexpr int QSTR = 8 * F::QS + 16;
    static constexpr int HSTR = F::HI ? 8 * F::HI + 16 : 0;
    static constexpr int SSTR = F::SM == 4 ? 48 : 16;
    static constexpr int DSTR = F::SUPER ? 4 : 0;
    static constexpr int XQSTR = 272;
    static constexpr int XSSTR = F::SUPER ? 1 : 12;  // floats per token (q8_0: 8 scales, padded)
    static constexpr int XUSTR = F::XSUM ? 12 : 0;   // ints per token
    static constexpr int OFF_HI = MMQ_ROWS * QSTR;
    static constexpr int OFF_SM = OFF_HI + MMQ_ROWS * HSTR;
    static constexpr int OFF_DM = OFF_SM + MMQ_ROWS * SSTR;
    static constexpr int OFF_XQ = OFF_DM + MMQ_ROWS * DSTR;
    static constexpr int OFF_XS = OFF_XQ + BN * XQSTR;
    static constexpr int OFF_XU = OFF_XS + ((BN * XSSTR * 4 + 15) / 16) * 16;
    static constexpr int BYTES = OFF_XU + BN * XUSTR * 4;
};

// The cp.async copies of one stage. Which pieces a thread copies is the same in every stage (the
// piece counts are multiples of the block's threads, or fewer than them), so the source pointers of
// its pieces are computed once per block and a stage adds its offset: the per-stage work is an add
// and a copy per piece, not the row's part and index arithmetic again.
template <int KIND, int NT>
struct QmmLoader {
    typedef Q<KIND> F;
    typedef Stage<KIND, NT> S;
    static constexpr int QCH = F::QS / 16;                           // 16-byte pieces of a sub-block's qs
    static constexpr int PQ = MMQ_ROWS * 8 * QCH / MMQ_THREADS;      // qs pieces a thread copies
    static constexpr int PR = MMQ_ROWS * 8 / MMQ_THREADS;            // (row, sub-block) pieces: hi, g sm
    static constexpr int PP = MMQ_ROWS * 4 / MMQ_THREADS;            // (row, pair of sub-blocks): q8 sm
    static constexpr int PX = (S::BN * 16 + MMQ_THREADS - 1) / MMQ_THREADS;  // activation pieces
    static constexpr int PU = (S::BN * 8 + MMQ_THREADS - 1) / MMQ_THREADS;   // (token, sub-block) pieces
    static_assert(PQ * MMQ_THREADS == MMQ_ROWS * 8 * QCH && PR * MMQ_THREADS == MMQ_ROWS * 8, "pieces");
    static_assert(PP * MMQ_THREADS == MMQ_ROWS * 4, "pieces");

    const uint8_t* qs[PQ];
    const uint8_t* rh[PR];  // hi (g5, k5, k6) of the (row, sub-block) pieces
    const uint8_t* rs[PR];  // sm (g4, g5) of the same pieces
    const uint8_t* pp[PP];  // q8: sm of the (row, pair) pieces
    const uint8_t* ks;      // K-quants: the thread's row's sm and dm (threads < MMQ_ROWS)
    const uint8_t* kd;
    const signed char* xq;  // the thread's first activation piece (the others: whole token strides)
    const float* xs;
    const int* xu;
    unsigned qvalid, rvalid, pvalid;  // per piece: the row exists (bit k)
    bool kvalid;
    int nsb, K, N, tok0;

    __device__ __forceinline__ QmmLoader(const Parts& parts, int M, int K_, Act8 x, int N_, int row0, int tok0_) {
        const int tid = threadIdx.x;
        K = K_;
        N = N_;
        tok0 = tok0_;
        nsb = K >> 5;
        qvalid = rvalid = pvalid = 0u;
        auto row_index = [&](int grow, int& pi) -> long long {  // the row's part and its first sub-block
            pi = parts.part(grow);
            return (long long)(grow - parts.start(pi)) * nsb;
        };
#pragma unroll
        for (int k = 0; k < PQ; ++k) {
            const int i = tid + k * MMQ_THREADS, r = i / (8 * QCH), rest = i % (8 * QCH);
            const int sb = rest / QCH, ch = rest % QCH, grow = row0 + r;
            qs[k] = parts.p[0].qs;
            if (grow < M) {
                int pi;
                const long long g = row_index(grow, pi);
                qs[k] = parts.planes(pi).qs + (g + sb) * F::QS + ch * 16;
                qvalid |= 1u << k;
            }
        }
#pragma unroll
        for (int k = 0; k < PR; ++k) {
            const int i = tid + k * MMQ_THREADS, r = i >> 3, sb = i & 7, grow = row0 + r;
            rh[k] = parts.p[0].hi;
            rs[k] = parts.p[0].sm;
            if ((F::HI || F::SM == 4) && grow < M) {
                int pi;
                const long long g = row_index(grow, pi) + sb;
                const Planes pl = parts.planes(pi);
                rh[k] = pl.hi + g * F::HI;
                rs[k] = pl.sm + g * 4;
                rvalid |= 1u << k;
            }
        }
#pragma unroll
        for (int k = 0; k < PP; ++k) {
            const int i = tid + k * MMQ_THREADS, r = i >> 2, pair = i & 3, grow = row0 + r;
            pp[k] = parts.p[0].sm;
            if (KIND == 1 && grow < M) {
                int pi;
                const long long g = row_index(grow, pi) + 2 * pair;
                pp[k] = parts.planes(pi).sm + g * 2;
                pvalid |= 1u << k;
            }
        }
        ks = parts.p[0].sm;
        kd = parts.p[0].dm;
        kvalid = false;
        if (F::SUPER && tid < MMQ_ROWS && row0 + tid < M) {
            int pi;
            const long long g = row_index(row0 + tid, pi);
            ks = parts.planes(pi).sm + g * 2;
            kd = parts.planes(pi).dm + (g >> 3) * 4;
            kvalid = true;
        }
        xq = x.xq + (long long)(tok0 + (tid >> 4)) * K + (tid & 15) * 16;
        xs = x.xs;
        xu = x.xsum;
    }

    __device__ __forceinline__ void load(unsigned char* st, int kt, const Act8& x) const {
        const int tid = threadIdx.x, sb0 = kt * 8;
        // weights
#pragma unroll
        for (int k = 0; k < PQ; ++k) {
            const int i = tid + k * MMQ_THREADS, r = i / (8 * QCH), rest = i % (8 * QCH);
            const int sb = rest / QCH, ch = rest % QCH;
            const bool valid = ((qvalid >> k) & 1u) && sb0 + sb < nsb;
            cp_async16(st + r * S::QSTR + sb * F::QS + ch * 16, valid ? qs[k] + (long long)sb0 * F::QS : qs[k], valid);
        }
        if (F::HI || F::SM == 4) {
#pragma unroll
            for (int k = 0; k < PR; ++k) {
                const int i = tid + k * MMQ_THREADS, r = i >> 3, sb = i & 7;
                const bool valid = ((rvalid >> k) & 1u) && sb0 + sb < nsb;
                if (F::HI == 4)
                    cp_async4(st + S::OFF_HI + r * S::HSTR + sb * 4, valid ? rh[k] + (long long)sb0 * 4 : rh[k], valid);
                if (F::HI == 8)
                    cp_async8(st + S::OFF_HI + r * S::HSTR + sb * 8, valid ? rh[k] + (long long)sb0 * 8 : rh[k], valid);
                if (F::SM == 4)  // g4, g5: the half2 (s, m) per sub-block
                    cp_async4(st + S::OFF_SM + r * S::SSTR + sb * 4, valid ? rs[k] + (long long)sb0 * 4 : rs[k], valid);
            }
        }
        if (F::SUPER) {  // 8 (sc, mn) byte pairs = 16 bytes per row (K a multiple of 256), and dm
            if (tid < MMQ_ROWS) {
                cp_async16(st + S::OFF_SM + tid * S::SSTR, kvalid ? ks + (long long)sb0 * 2 : ks, kvalid);
                cp_async4(st + S::OFF_DM + tid * 4, kvalid ? kd + (long long)kt * 4 : kd, kvalid);
            }
        } else if (KIND == 1) {  // q8: a half per sub-block, loaded as pairs (K a multiple of 64)
#pragma unroll
            for (int k = 0; k < PP; ++k) {
                const int i = tid + k * MMQ_THREADS, r = i >> 2, pair = i & 3;
                const bool valid = ((pvalid >> k) & 1u) && sb0 + 2 * pair < nsb;
                cp_async4(st + S::OFF_SM + r * S::SSTR + pair * 4, valid ? pp[k] + (long long)sb0 * 2 : pp[k], valid);
            }
        }
        // activations of the block's tokens: 16-byte pieces, token t = (tid >> 4) + k * (threads / 16)
#pragma unroll
        for (int k = 0; k < PX; ++k) {
            const int i = tid + k * MMQ_THREADS;
            if (i >= S::BN * 16) break;
            const int t = i >> 4, ch = i & 15;
            const bool valid = tok0 + t < N && sb0 + (ch >> 1) < nsb;
            const signed char* src = xq + (long long)k * (MMQ_THREADS / 16) * K + sb0 * 32;
            cp_async16(st + S::OFF_XQ + t * S::XQSTR + ch * 16, valid ? src : x.xq, valid);
        }
        if (F::SUPER) {
            if (tid < S::BN) {
                const bool valid = tok0 + tid < N;
                cp_async4(st + S::OFF_XS + tid * 4, valid ? xs + (long long)(tok0 + tid) * (K >> 8) + kt : xs, valid);
            }
        }
#pragma unroll
        for (int k = 0; k < PU; ++k) {  // (token, sub-block): q8_0 scales, then sums per 32
            const int i = tid + k * MMQ_THREADS;
            if (i >= S::BN * 8) break;
            const int t = i >> 3, sb = i & 7;
            const bool valid = tok0 + t < N && sb0 + sb < nsb;
            const long long at = (long long)(tok0 + t) * nsb + sb0 + sb;
            if (!F::SUPER)
                cp_async4(st + S::OFF_XS + (t * S::XSSTR + sb) * 4, valid ? xs + at : xs, valid);
            if (F::XSUM)
                cp_async4(st + S::OFF_XU + (t * S::XUSTR + sb) * 4, valid ? xu + at : xu, valid);
        }
    }
};

__device__ __forceinline__ uint32_t lds32(const unsigned char* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint4 lds128(const unsigned char* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// The warp's 16 rows x the block's tokens for one stage, added into acc[nt][e] (e: the C fragment's
// elements: rows g, g, g+8, g+8; tokens 2c, 2c+1, 2c, 2c+1 of n-tile nt). The rows' fragments and
// scales are read once for the stage; the tokens' scales and sums once per n-tile (16-byte loads).
template <int KIND, int NT>
__device__ __forceinline__ void qmm_compute(const unsigned char* st, int nsb, int kt, float (&acc)[NT][4]) {
    // `acc` here is the current group's sum (qmm_body adds it to the total at the group's end)
    typedef Q<KIND> F;
    typedef Stage<KIND, NT> S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int ra = 16 * warp + g, rb = ra + 8;  // this thread's two weight rows in the tile
    const unsigned char* qa = st + ra * S::QSTR;
    const unsigned char* qb = st + rb * S::QSTR;
    // the rows' high bits for the stage (g5, k5: 4 bytes a sub-block; k6: 8)
    uint4 ha0 = make_uint4(0, 0, 0, 0), ha1 = ha0, hb0 = ha0, hb1 = ha0;
    if (F::HI) {
        ha0 = lds128(st + S::OFF_HI + ra * S::HSTR);
        ha1 = lds128(st + S::OFF_HI + ra * S::HSTR + 16);
        hb0 = lds128(st + S::OFF_HI + rb * S::HSTR);
        hb1 = lds128(st + S::OFF_HI + rb * S::HSTR + 16);
    }
    uint4 ha2 = make_uint4(0, 0, 0, 0), ha3 = ha2, hb2 = ha2, hb3 = ha2;
    if (F::HI == 8) {
        ha2 = lds128(st + S::OFF_HI + ra * S::HSTR + 32);
        ha3 = lds128(st + S::OFF_HI + ra * S::HSTR + 48);
        hb2 = lds128(st + S::OFF_HI + rb * S::HSTR + 32);
        hb3 = lds128(st + S::OFF_HI + rb * S::HSTR + 48);
    }
    // the A fragment of sub-block j (lo: k 4c..4c+3, hi: k 16+4c..16+4c+3): a0, a1 rows a, b lo;
    // a2, a3 rows a, b hi
    auto fragment = [&](int j, uint32_t (&a)[4]) {
        if (F::BITS == 8) {
            a[0] = lds32(qa + j * 32 + 4 * c);
            a[1] = lds32(qb + j * 32 + 4 * c);
            a[2] = lds32(qa + j * 32 + 16 + 4 * c);
            a[3] = lds32(qb + j * 32 + 16 + 4 * c);
        } else {
            uint32_t h0a = 0, h1a = 0, h0b = 0, h1b = 0;
            if (F::HI == 4) {
                h0a = word_of(j < 4 ? ha0 : ha1, j & 3);
                h0b = word_of(j < 4 ? hb0 : hb1, j & 3);
            } else if (F::HI == 8) {  // sub-block j: words 2j, 2j+1 of the row's 16
                const uint4 va = j < 2 ? ha0 : (j < 4 ? ha1 : (j < 6 ? ha2 : ha3));
                const uint4 vb = j < 2 ? hb0 : (j < 4 ? hb1 : (j < 6 ? hb2 : hb3));
                h0a = word_of(va, 2 * (j & 1));
                h1a = word_of(va, 2 * (j & 1) + 1);
                h0b = word_of(vb, 2 * (j & 1));
                h1b = word_of(vb, 2 * (j & 1) + 1);
            }
            F::values(lds32(qa + j * 16 + 4 * c), h0a, h1a, c, a[0], a[2]);
            F::values(lds32(qb + j * 16 + 4 * c), h0b, h1b, c, a[1], a[3]);
        }
    };
    // K-quants: all 8 sub-blocks' fragments for the stage; the 32-value formats build a tile's 4 at a
    // time (registers: their sums per tile hold more per token)
    uint32_t A[8][4];
    if (F::SUPER && F::BITS == 6) {
#pragma unroll
        for (int j = 0; j < 8; ++j) fragment(j, A[j]);
    }
    // the rows' scales for the stage, decoded once: sm words (2 bytes a sub-block, 4 for g4/g5)
    const uint4 sa0 = lds128(st + S::OFF_SM + ra * S::SSTR), sb0v = lds128(st + S::OFF_SM + rb * S::SSTR);
    uint4 sa1 = make_uint4(0, 0, 0, 0), sb1v = sa1;
    if (F::SM == 4) {
        sa1 = lds128(st + S::OFF_SM + ra * S::SSTR + 16);
        sb1v = lds128(st + S::OFF_SM + rb * S::SSTR + 16);
    }
    uint32_t sma[8], smb[8];  // each sub-block's sm value of rows a and b
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (F::SM == 4) {
            sma[j] = word_of(j < 4 ? sa0 : sa1, j & 3);
            smb[j] = word_of(j < 4 ? sb0v : sb1v, j & 3);
        } else {
            sma[j] = (word_of(sa0, j >> 1) >> (16 * (j & 1))) & 0xFFFFu;
            smb[j] = (word_of(sb0v, j >> 1) >> (16 * (j & 1))) & 0xFFFFu;
        }
    }
    int sca[8], scb[8], mna[8], mnb[8];  // K-quants: the integer scales (Q6_K: the two halves' in sc/mn)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (F::BITS == 6) {
            sca[j] = (int)(signed char)(sma[j] & 0xFFu);
            mna[j] = (int)(signed char)((sma[j] >> 8) & 0xFFu);
            scb[j] = (int)(signed char)(smb[j] & 0xFFu);
            mnb[j] = (int)(signed char)((smb[j] >> 8) & 0xFFu);
        } else {
            sca[j] = (int)(sma[j] & 0xFFu);
            mna[j] = (int)((sma[j] >> 8) & 0xFFu);
            scb[j] = (int)(smb[j] & 0xFFu);
            mnb[j] = (int)((smb[j] >> 8) & 0xFFu);
        }
    }
    uint32_t dma = 0, dmb = 0;
    if (F::SUPER) {
        dma = lds32(st + S::OFF_DM + ra * 4);
        dmb = lds32(st + S::OFF_DM + rb * 4);
    }
    const float* xs = reinterpret_cast<const float*>(st + S::OFF_XS);
    const int* xu = reinterpret_cast<const int*>(st + S::OFF_XU);
    if (F::SUPER && F::BITS != 6) {
        // Q4_K, Q5_K: isum = sum_j sc_j * idot_j on the tensor cores, with sc = 8 sh + sl (each 0..7)
        // folded into the weights (q * sl, q * sh <= 31 * 7: unsigned bytes, no carry between the
        // bytes of a word) and the sums over j accumulated by the mma: isum = 8 dh + dl. msum =
        // sum_j mn_j * xsum_j as two 16-deep products, xsum = 64 uh + ul. Integers throughout: the
        // same isum and msum as any other order, so the same canonical term.
        int dl[NT][4], dh[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dl[nt][e] = dh[nt][e] = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            uint32_t a[4];
            fragment(j, a);
            const uint32_t la = (uint32_t)sca[j] & 7u, ha = (uint32_t)sca[j] >> 3;
            const uint32_t lb = (uint32_t)scb[j] & 7u, hb = (uint32_t)scb[j] >> 3;
            const uint32_t alo[4] = {a[0] * la, a[1] * lb, a[2] * la, a[3] * lb};
            const uint32_t ahi[4] = {a[0] * ha, a[1] * hb, a[2] * ha, a[3] * hb};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned char* xb = st + S::OFF_XQ + (nt * 8 + g) * S::XQSTR;  // B: token nt*8 + g
                const uint32_t b0 = lds32(xb + j * 32 + 4 * c), b1 = lds32(xb + j * 32 + 16 + 4 * c);
                mma_u8s8_k32_acc(dl[nt], alo, b0, b1);
                mma_u8s8_k32_acc(dh[nt], ahi, b0, b1);
            }
        }
        // the mins as a 16 x 16 A (k = j, 8..15 zero): lane c holds k 4c..4c+3
        auto pack4 = [](const int* v) {
            return (uint32_t)v[0] | ((uint32_t)v[1] << 8) | ((uint32_t)v[2] << 16) | ((uint32_t)v[3] << 24);
        };
        const uint32_t ma = c == 0 ? pack4(mna) : (c == 1 ? pack4(mna + 4) : 0u);
        const uint32_t mb = c == 0 ? pack4(mnb) : (c == 1 ? pack4(mnb + 4) : 0u);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            uint32_t ul = 0, uh = 0;  // B: token nt*8 + g's xsum_j for j = 4c..4c+3, low 6 bits and the rest
            if (c < 2) {
                const uint4 u = lds128(st + S::OFF_XU + (nt * 8 + g) * S::XUSTR * 4 + 16 * c);
                const int uv[4] = {(int)u.x, (int)u.y, (int)u.z, (int)u.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    ul |= ((uint32_t)uv[i] & 63u) << (8 * i);
                    uh |= ((uint32_t)(uv[i] >> 6) & 255u) << (8 * i);
                }
            }
            int ml[4], mh[4];
            mma_k16(ml, ma, mb, ul);
            mma_k16(mh, ma, mb, uh);
            const int t0 = nt * 8 + 2 * c, t1 = t0 + 1;  // C: tokens t0, t1
            const float x0 = xs[t0], x1 = xs[t1];
            int isum[4], msum[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                isum[e] = 8 * dh[nt][e] + dl[nt][e];
                msum[e] = 64 * mh[e] + ml[e];
            }
            acc[nt][0] = __fadd_rn(acc[nt][0], F::super_term(dma, x0, isum[0], msum[0]));
            acc[nt][1] = __fadd_rn(acc[nt][1], F::super_term(dma, x1, isum[1], msum[1]));
            acc[nt][2] = __fadd_rn(acc[nt][2], F::super_term(dmb, x0, isum[2], msum[2]));
            acc[nt][3] = __fadd_rn(acc[nt][3], F::super_term(dmb, x1, isum[3], msum[3]));
        }
    }
    if (F::SUPER && F::BITS == 6) {  // Q6_K; the 32-value formats below
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const unsigned char* xb = st + S::OFF_XQ + (nt * 8 + g) * S::XQSTR;  // B: token nt*8 + g
        const int t0 = nt * 8 + 2 * c, t1 = t0 + 1;                          // C: tokens t0, t1
        {  // Q6_K: two 16-value halves per sub-block, each with its own signed scale
            int isum[4] = {0, 0, 0, 0};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const uint32_t b0 = lds32(xb + j * 32 + 4 * c), b1 = lds32(xb + j * 32 + 16 + 4 * c);
                int dl[4], dh[4];
                mma_k16(dl, A[j][0], A[j][1], b0);
                mma_k16(dh, A[j][2], A[j][3], b1);
                isum[0] += sca[j] * dl[0] + mna[j] * dh[0];
                isum[1] += sca[j] * dl[1] + mna[j] * dh[1];
                isum[2] += scb[j] * dl[2] + mnb[j] * dh[2];
                isum[3] += scb[j] * dl[3] + mnb[j] * dh[3];
            }
            const float x0 = xs[t0], x1 = xs[t1];
            acc[nt][0] = __fadd_rn(acc[nt][0], F::super_term(dma, x0, isum[0], 0));
            acc[nt][1] = __fadd_rn(acc[nt][1], F::super_term(dma, x1, isum[1], 0));
            acc[nt][2] = __fadd_rn(acc[nt][2], F::super_term(dmb, x0, isum[2], 0));
            acc[nt][3] = __fadd_rn(acc[nt][3], F::super_term(dmb, x1, isum[3], 0));
        }
    }
    }
    if (!F::SUPER) {
#pragma unroll
        for (int T = 0; T < 8 / CANON_TILE; ++T) {
            uint32_t At[CANON_TILE][4];
#pragma unroll
            for (int jj = 0; jj < CANON_TILE; ++jj) fragment(CANON_TILE * T + jj, At[jj]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned char* xb = st + S::OFF_XQ + (nt * 8 + g) * S::XQSTR;  // B: token nt*8 + g
                const int t0 = nt * 8 + 2 * c, t1 = t0 + 1;                          // C: tokens t0, t1
                float tt[CANON_TILE][4];
#pragma unroll
                for (int jj = 0; jj < CANON_TILE; ++jj) {
                    const int j = CANON_TILE * T + jj;
                    const uint32_t b0 = lds32(xb + j * 32 + 4 * c), b1 = lds32(xb + j * 32 + 16 + 4 * c);
                    int d[4];
                    mma_k32(d, At[jj], b0, b1);
                    // the tokens' scale and sum of sub-block j (registers: per use, not held for 8)
                    const float x0 = xs[t0 * S::XSSTR + j], x1 = xs[t1 * S::XSSTR + j];
                    const int w0 = F::XSUM ? xu[t0 * S::XUSTR + j] : 0, w1 = F::XSUM ? xu[t1 * S::XUSTR + j] : 0;
                    const bool have = kt * 8 + j < nsb;  // the same for the whole block
                    tt[jj][0] = have ? F::term(sma[j], x0, d[0], w0) : 0.f;
                    tt[jj][1] = have ? F::term(sma[j], x1, d[1], w1) : 0.f;
                    tt[jj][2] = have ? F::term(smb[j], x0, d[2], w0) : 0.f;
                    tt[jj][3] = have ? F::term(smb[j], x1, d[3], w1) : 0.f;
                }
                if (kt * 8 + CANON_TILE * T < nsb) {
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[nt][e] = __fadd_rn(acc[nt][e], tile4(tt[0][e], tt[1][e], tt[2][e], tt[3][e]));
                }
            }
        }
    }
}

#define STAGES_PER_GROUP (CANON_GROUP / 256)  // a stage holds 256 values of K

// One block: 16 * MMQ_WARPS rows x 8 * NT tokens. Without `partial` it walks all of K and writes y;
// with it (split K, grid z = group) it computes group blockIdx.z alone and writes that group's sums
// to partial[(group * N + token) * M + row] for qmm_combine.
template <int KIND, int NT>
__device__ __forceinline__ void qmm_body(const Parts& parts, int M, int K, Act8 x, int N, float* y, int ldy,
                                         const float* bias, const float* residual, float* partial) {
    typedef Stage<KIND, NT> S;
    extern __shared__ __align__(16) unsigned char qmm_smem[];
    const int tok0 = blockIdx.x * S::BN, row0 = blockIdx.y * MMQ_ROWS;
    const int nsb = K >> 5, nk_all = (nsb + 7) >> 3;
    const int k_first = partial ? blockIdx.z * STAGES_PER_GROUP : 0;
    const int nk = partial ? min(STAGES_PER_GROUP, nk_all - k_first) : nk_all;
    float acc[NT][4], grp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = grp[nt][e] = 0.f;
    const QmmLoader<KIND, NT> loader(parts, M, K, x, N, row0, tok0);
    // MMQ_STAGES - 1 stages in flight; a group is committed every step (empty past the end) so
    // that wait_group counts stay the same
#pragma unroll
    for (int s = 0; s < MMQ_STAGES - 1; ++s) {
        if (s < nk) loader.load(qmm_smem + s * S::BYTES, k_first + s, x);
        cp_async_commit();
    }
    for (int i = 0; i < nk; ++i) {
        const int ahead = i + MMQ_STAGES - 1;
        if (ahead < nk)  // into the buffer the previous step computed on (read before its barrier)
            loader.load(qmm_smem + (ahead % MMQ_STAGES) * S::BYTES, k_first + ahead, x);
        cp_async_commit();
        cp_async_wait<MMQ_STAGES - 1>();  // stage i has landed
        __syncthreads();
        const int kt = k_first + i;
        qmm_compute<KIND, NT>(qmm_smem + (i % MMQ_STAGES) * S::BYTES, nsb, kt, grp);
        __syncthreads();  // the stage is read before a later load overwrites it
        if (!partial && (kt % STAGES_PER_GROUP == STAGES_PER_GROUP - 1 || kt == nk_all - 1)) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[nt][e] = __fadd_rn(acc[nt][e], grp[nt][e]);
                    grp[nt][e] = 0.f;
                }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + 16 * warp + g + (e >= 2 ? 8 : 0);
            const int tok = tok0 + nt * 8 + 2 * c + (e & 1);
            if (row >= M || tok >= N) continue;
            if (partial) partial[((long long)blockIdx.z * N + tok) * M + row] = grp[nt][e];
            else y[(long long)tok * ldy + row] = canon_out(acc[nt][e], row, tok, ldy, bias, residual);
        }
    }
}

// y = the groups' sums of a split product, added in order, + bias + residual (grid: N*M / 256)
extern "C" __global__ void qmm_combine(const float* partial, int groups, int M, int N, float* y, int ldy,
                                       const float* bias, const float* residual) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * M) return;
    const int tok = (int)(i / M), row = (int)(i % M);
    float acc = 0.f;
    for (int g = 0; g < groups; ++g) acc = __fadd_rn(acc, partial[((long long)g * N + tok) * M + row]);
    y[(long long)tok * ldy + row] = canon_out(acc, row, tok, ldy, bias, residual);
}

// ---------------------------------------------------------------- float formats
template <typename T>
__device__ __forceinline__ void fgemv_body(const T* w, int M, int K, const float* x, int nvec, float* y, int ldy,
                                           const float* bias, const float* residual) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * QG_WARPS + (threadIdx.x >> 5);
    if (row >= M) return;
    const int nsb = K >> 5;
    const T* wr = w + (long long)row * K;
    for (int v = blockIdx.y; v < nvec; v += gridDim.y) {
        const float* xv = x + (long long)v * K;
        float acc = 0.f;
        for (int first = 0; first < nsb; first += 32) {
            const int sb = first + lane;
            float t = 0.f;
            if (sb < nsb) {
#pragma unroll 8
                for (int i = 0; i < 32; ++i) t = __fadd_rn(t, __fmul_rn(to_float(wr[sb * 32 + i]), xv[sb * 32 + i]));
            }
            t = __fadd_rn(t, __shfl_xor_sync(FULL_MASK, t, 1));
            t = __fadd_rn(t, __shfl_xor_sync(FULL_MASK, t, 2));
            float group = 0.f;  // the iteration's 32 sub-blocks: one group
#pragma unroll
            for (int j = 0; j < 32 / CANON_TILE; ++j) {
                const float Tv = __shfl_sync(FULL_MASK, t, CANON_TILE * j);
                if (first + CANON_TILE * j < nsb) group = __fadd_rn(group, Tv);
            }
            acc = __fadd_rn(acc, group);
        }
        if (lane == 0) y[(long long)v * ldy + row] = canon_out(acc, row, v, ldy, bias, residual);
    }
}

// ---------------------------------------------------------------- entry points
// (qs, hi, sm, dm) of each part, then the row where parts 1 and 2 start
#define PARTS_ARGS                                                                                              \
    const uint8_t *qs0, const uint8_t *hi0, const uint8_t *sm0, const uint8_t *dm0, const uint8_t *qs1,        \
        const uint8_t *hi1, const uint8_t *sm1, const uint8_t *dm1, const uint8_t *qs2, const uint8_t *hi2,     \
        const uint8_t *sm2, const uint8_t *dm2, int end0, int end1
#define PARTS_OF Parts{{Planes{qs0, hi0, sm0, dm0}, Planes{qs1, hi1, sm1, dm1}, Planes{qs2, hi2, sm2, dm2}}, end0, end1}
#define PRODUCT_ARGS                                                                                            \
    int M, int K, const signed char *xq, const float *xs, const int *xsum, int N, float *y, int ldy,           \
        const float *bias, const float *residual, float *partial

#define QGEMV(NAME, KIND, NV)                                                                                   \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32) qgemv_##NAME##_v##NV(PARTS_ARGS, PRODUCT_ARGS) { \
        qgemv_body<KIND, NV>(PARTS_OF, M, K, Act8{xq, xs, xsum}, N, y, ldy, bias, residual);                    \
    }
#define QMM(NAME, KIND, NT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQ_MIN_BLOCKS) qmm_##NAME##_n##NT(PARTS_ARGS, PRODUCT_ARGS) {    \
        qmm_body<KIND, NT>(PARTS_OF, M, K, Act8{xq, xs, xsum}, N, y, ldy, bias, residual, partial);             \
    }
#if QMM_KERNELS & 1
#define QGEMVS(NAME, KIND) QGEMV(NAME, KIND, 1) QGEMV(NAME, KIND, 2) QGEMV(NAME, KIND, 4)
#else
#define QGEMVS(NAME, KIND)
#endif
#if QMM_KERNELS & 2
#define QMMS(NAME, KIND) QMM(NAME, KIND, 1) QMM(NAME, KIND, 2) QMM(NAME, KIND, 4) QMM(NAME, KIND, 8)
#else
#define QMMS(NAME, KIND)
#endif
#define QUANT_FORMAT(NAME, KIND) QGEMVS(NAME, KIND) QMMS(NAME, KIND)

// a module per format (QMM_FORMAT): a model compiles only the formats it holds
#if QMM_FORMAT == 0 || QMM_FORMAT == 1
QUANT_FORMAT(q8, 1)
#endif
#if QMM_FORMAT == 0 || QMM_FORMAT == 4
QUANT_FORMAT(g4, 4)
#endif
#if QMM_FORMAT == 0 || QMM_FORMAT == 5
QUANT_FORMAT(g5, 5)
#endif
#if QMM_FORMAT == 0 || QMM_FORMAT == 14
QUANT_FORMAT(k4, 14)
#endif
#if QMM_FORMAT == 0 || QMM_FORMAT == 15
QUANT_FORMAT(k5, 15)
#endif
#if QMM_FORMAT == 0 || QMM_FORMAT == 16
QUANT_FORMAT(k6, 16)
#endif

// float formats: part 0 only (qs0 is the row-major matrix); x float32 (N, K); grid y splits the vectors
#define FGEMV(NAME, T)                                                                                          \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32)                                                 \
        fgemv_##NAME(const uint8_t* w, int M, int K, const float* x, int N, float* y, int ldy, const float* bias, \
                     const float* residual) {                                                                   \
        fgemv_body<T>(reinterpret_cast<const T*>(w), M, K, x, N, y, ldy, bias, residual);                       \
    }
#if QMM_FORMAT == 0 || QMM_FORMAT == 100
FGEMV(f16, __half)
FGEMV(bf16, __nv_bfloat16)
FGEMV(f32, float)
#endif
