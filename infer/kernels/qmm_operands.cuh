// qmm.cu's operands: the weight parts of one launch (`Parts`), the 8-bit activations (`Act8`) and,
// per planar format (formats.cuh), how a sub-block is read and turned into integer dot products and
// canonical terms (`Q<KIND>`).
#pragma once
#include "formats.cuh"
#include "canon.cuh"

// ---------------------------------------------------------------- operands
struct Parts {
    Planes p[3];
    int end0, end1;  // part 0 holds rows [0, end0), part 1 [end0, end1), part 2 [end1, M)
    __device__ __forceinline__ int part(int r) const { return (r >= end0) + (r >= end1); }
    __device__ __forceinline__ int start(int i) const { return i == 0 ? 0 : (i == 1 ? end0 : end1); }
    __device__ __forceinline__ int size(int i, int M) const { return i == 0 ? end0 : (i == 1 ? end1 - end0 : M - end1); }
    // part i's planes by selects, not by indexing p (which would put the array in local memory)
    __device__ __forceinline__ Planes planes(int i) const {
        return Planes{i == 0 ? p[0].qs : (i == 1 ? p[1].qs : p[2].qs), i == 0 ? p[0].hi : (i == 1 ? p[1].hi : p[2].hi),
                      i == 0 ? p[0].sm : (i == 1 ? p[1].sm : p[2].sm), i == 0 ? p[0].dm : (i == 1 ? p[1].dm : p[2].dm)};
    }
};

// (qs, hi, sm, dm) of each part, then the row where parts 1 and 2 start
#define PARTS_ARGS                                                                                              \
    const uint8_t *qs0, const uint8_t *hi0, const uint8_t *sm0, const uint8_t *dm0, const uint8_t *qs1,        \
        const uint8_t *hi1, const uint8_t *sm1, const uint8_t *dm1, const uint8_t *qs2, const uint8_t *hi2,     \
        const uint8_t *sm2, const uint8_t *dm2, int end0, int end1
#define PARTS_OF Parts{{Planes{qs0, hi0, sm0, dm0}, Planes{qs1, hi1, sm1, dm1}, Planes{qs2, hi2, sm2, dm2}}, end0, end1}

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
