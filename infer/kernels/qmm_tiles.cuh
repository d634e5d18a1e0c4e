// qmm.cu's tensor-core tiles: the mma.sync wrappers, one shared-memory stage (`Stage`), the
// cp.async copies of a stage (`QmmLoader`) and the warp's products of a stage (`qmm_compute`).
// Uses qmm.cu's MMQ_ROWS / MMQ_THREADS and qmm_operands.cuh.
#pragma once
#include "async.cuh"
#include "qmm_operands.cuh"

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

    // `expert` e: each part is a stack of experts of the part's rows, and row r reads row e * rows + r
    __device__ __forceinline__ QmmLoader(const Parts& parts, int M, int K_, Act8 x, int N_, int row0, int tok0_,
                                         int expert) {
        const int tid = threadIdx.x;
        K = K_;
        N = N_;
        tok0 = tok0_;
        nsb = K >> 5;
        qvalid = rvalid = pvalid = 0u;
        auto row_index = [&](int grow, int& pi) -> long long {  // the row's part and its first sub-block
            pi = parts.part(grow);
            return ((long long)expert * parts.size(pi, M) + (grow - parts.start(pi))) * nsb;
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
