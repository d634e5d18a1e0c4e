// Matrix products Y = X W^T for N token rows at once, over the planar quantized formats of
// formats.cuh, every output summed in the canonical order of canon.cuh (so a token's result does not
// depend on N, on the other tokens, or on which of these kernels computed it):
//   qgemv_<fmt>_v<NV>  a warp per QG_ROWS weight rows, each lane a sub-block, dp4a integer dot products, NV
//                      (1, 2, 4) vectors per block (grid y: groups of NV): the weights are read once
//                      per group. Decode and small batches, and any N where qmm does not apply.
//   qmm_<fmt>_n<NT>    any N: 64 weight rows x 8*NT tokens per block of 4 warps, both operands staged
//                      in shared memory by cp.async (two stages), integer products on the tensor
//                      cores (mma.sync int8, m16n8k32; m16n8k16 for Q6_K's 16-value scales). The grid
//                      walks the token tiles of a row tile first, so the blocks that share a weight
//                      tile run together and the weights come from HBM once per call.
//   qmm_id_<fmt>_n<NT> routed experts, the pass's (row, slot) pairs grouped by expert (moe.cu
//                      moe_group): qmm's blocks over each expert's pairs and rows, so an expert's
//                      weights come from HBM once per call, not once per pair as in qgemv_id.
//   fgemv_<fmt>        float formats (f16, bf16, f32), any N: a warp per row, each lane a sub-block.
// Up to three matrices of one format whose outputs are consecutive rows (Q, K, V; gate, up) are one
// launch: row r reads part p[i] for r in [start_i, end_i) (`Parts`), with no copy stacking them.
// Epilogue: y[t * ldy + r] = acc (+ bias[r]) (+ residual[t * ldy + r]); y may alias residual.
// The operands and formats are in qmm_operands.cuh, qmm's stages and tiles in qmm_tiles.cuh.
#include "formats.cuh"
#include "canon.cuh"
#include "async.cuh"
#include "pdl.cuh"

#ifndef QG_WARPS
#define QG_WARPS 4  // weight rows (warps) per qgemv block
#endif
#ifndef QG_UNROLL
#define QG_UNROLL 2  // iterations of 32 sub-blocks whose loads a qgemv lane issues before using them
#endif
#ifndef PDL_PREFETCH
// 1: qgemv and fgemv issue their first weight loads before pdl_wait (pdl.cuh), overlapping the
// previous kernel's end; only for weights no kernel writes: resident layers' (the streaming engine
// repacks a streamed layer on the GPU). infer/gpu/pdl.py prefetch_weights chooses the variant
// (NVMEDIRECT_PDL_PREFETCH=0: never).
#define PDL_PREFETCH 0
#endif
#ifndef QG_ROWS
#define QG_ROWS 1  // consecutive weight rows a qgemv warp takes (loads of all of them in flight at once)
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

#include "qmm_operands.cuh"

// ---------------------------------------------------------------- qgemv: N <= NV vectors
// Vectors v0 .. v0 + NV - 1 of x times the parts' rows, QG_ROWS consecutive rows a warp: the warp
// issues every row's weight loads of an iteration before it sums any, so a short row (an expert's
// down row of 768 values: 24 sub-blocks) keeps more bytes in flight a warp and the launch has
// fewer warps to cycle through; the vectors' 8-bit values are loaded once for the warp's rows. Each
// row's sum is the same whatever QG_ROWS. `expert` e: each part holds a stack of experts of the
// part's rows each, and row r of the part reads row e * rows + r (qgemv_id).
template <int KIND, int NV>
__device__ __forceinline__ void qgemv_body(const Parts& parts, int M, int K, Act8 x, int nvec, float* y, int ldy,
                                           const float* bias, const float* residual, int v0, int expert) {
    typedef Q<KIND> F;
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * QG_WARPS + (threadIdx.x >> 5)) * QG_ROWS;
    if (row0 >= M) return;  // the whole warp
    nvec = min(NV, nvec - v0);
    x.xq += (long long)v0 * K;
    x.xs += (long long)v0 * (K >> F::XS_SHIFT);
    x.xsum += (long long)v0 * (K >> 5);
    y += (long long)v0 * ldy;
    if (residual) residual += (long long)v0 * ldy;
    const int nsb = K >> 5, ngroups = K >> F::XS_SHIFT;
    Planes p[QG_ROWS];
    long long base[QG_ROWS];
    float acc[QG_ROWS][NV];
#pragma unroll
    for (int i = 0; i < QG_ROWS; ++i) {
        const int row = min(row0 + i, M - 1);  // past the last row: a copy of it, not written
        const int pi = parts.part(row);
        p[i] = parts.planes(pi);
        base[i] = ((long long)expert * parts.size(pi, M) + (row - parts.start(pi))) * nsb;
#pragma unroll
        for (int v = 0; v < NV; ++v) acc[i][v] = 0.f;
    }
    for (int s0 = 0; s0 < nsb; s0 += 32 * QG_UNROLL) {
        typename F::Raw r[QG_ROWS][QG_UNROLL];
#pragma unroll
        for (int i = 0; i < QG_ROWS; ++i)
#pragma unroll
            for (int u = 0; u < QG_UNROLL; ++u) {
                const int sb = s0 + 32 * u + lane;
                if (sb < nsb) r[i][u] = F::load(p[i], base[i] + sb);
                else r[i][u] = typename F::Raw{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), make_uint2(0, 0), 0u, 0u};
            }
        if (PDL_PREFETCH && s0 == 0) pdl_enter();  // the first weight loads are in flight; x is an earlier kernel's
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
#pragma unroll
                for (int i = 0; i < QG_ROWS; ++i) {
                    int lo16, hi16;
                    F::idots(r[i][u], xa, xb, lo16, hi16);
                    // the iteration's 32 sub-blocks are one group (CANON_GROUP): its tiles in order
                    // from 0, then added to acc
                    float group = 0.f;
                    if (!F::SUPER) {
                        // lanes 4j..4j+3 hold tile j of the iteration: pairwise, as tile4
                        float t = have ? F::term(r[i][u].sm, xs, lo16 + hi16, xsum) : 0.f;
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
                        F::super_parts(r[i][u].sm, lo16, hi16, xsum, ip, mp);
#pragma unroll
                        for (int o = 1; o < 8; o <<= 1) {
                            ip += __shfl_xor_sync(FULL_MASK, ip, o);
                            mp += __shfl_xor_sync(FULL_MASK, mp, o);
                        }
                        const float t = F::super_term(r[i][u].dm, xs, ip, mp);
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const float T = __shfl_sync(FULL_MASK, t, 8 * j);
                            if (first + 8 * j < nsb) group = __fadd_rn(group, T);
                        }
                    }
                    acc[i][v] = __fadd_rn(acc[i][v], group);
                }
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < QG_ROWS; ++i) {
            const int row = row0 + i;
#pragma unroll
            for (int v = 0; v < NV; ++v)
                if (v < nvec && row < M) y[(long long)v * ldy + row] = canon_out(acc[i][v], row, v, ldy, bias, residual);
        }
    }
}

#include "qmm_tiles.cuh"

#define STAGES_PER_GROUP (CANON_GROUP / 256)  // a stage holds 256 values of K

// One block: rows row0 .. row0 + 16 * MMQ_WARPS - 1 x tokens tok0 .. tok0 + 8 * NT - 1 (of expert
// `expert`'s rows when the parts are stacks of experts, as qgemv_body). Without `partial` it walks
// all of K and writes y; with it (split K, grid z = group) it computes group blockIdx.z alone and
// writes that group's sums to partial[(group * N + token) * M + row] for qmm_combine.
template <int KIND, int NT>
__device__ __forceinline__ void qmm_body(const Parts& parts, int M, int K, Act8 x, int N, float* y, int ldy,
                                         const float* bias, const float* residual, float* partial, int tok0,
                                         int row0, int expert) {
    typedef Stage<KIND, NT> S;
    extern __shared__ __align__(16) unsigned char qmm_smem[];
    const int nsb = K >> 5, nk_all = (nsb + 7) >> 3;
    const int k_first = partial ? blockIdx.z * STAGES_PER_GROUP : 0;
    const int nk = partial ? min(STAGES_PER_GROUP, nk_all - k_first) : nk_all;
    float acc[NT][4], grp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = grp[nt][e] = 0.f;
    const QmmLoader<KIND, NT> loader(parts, M, K, x, N, row0, tok0, expert);
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

// Which expert's token tile block `g` of a qmm_id launch is: e with tiles[e] <= g < tiles[e + 1]
// (experts without pairs have no tiles), and the tile's index within e's; -1 past the last tile.
__device__ __forceinline__ int expert_tile(const int* tiles, int E, int g, int& e) {
    if (g >= __ldg(tiles + E)) return -1;
    int lo = 0, hi = E - 1;  // the last e with tiles[e] <= g
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (__ldg(tiles + mid) <= g) lo = mid;
        else hi = mid - 1;
    }
    e = lo;
    return g - __ldg(tiles + lo);
}

// y = the groups' sums of a split product, added in order, + bias + residual (grid: N*M / 256)
extern "C" __global__ void qmm_combine(const float* partial, int groups, int M, int N, float* y, int ldy,
                                       const float* bias, const float* residual) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * M) return;
    const int tok = (int)(i / M), row = (int)(i % M);
    float acc = 0.f;
    for (int g = 0; g < groups; ++g) acc = __fadd_rn(acc, partial[((long long)g * N + tok) * M + row]);
    y[(long long)tok * ldy + row] = canon_out(acc, row, tok, ldy, bias, residual);
}

// ---------------------------------------------------------------- float formats
// A warp a weight row; each block row (grid y) takes FG_VECTORS vectors at a time, so a sub-block of
// weights is read once for all of them (a prompt's 512 rows through a router). Each output's sum
// runs in the same order whatever the grouping: the same bits for any N and any grid.
#define FG_VECTORS 8
#ifndef FG_UNROLL
#define FG_UNROLL 2  // iterations of 32 sub-blocks whose weight loads a fgemv lane issues before using them
#endif
template <typename T>
__device__ __forceinline__ void fgemv_body(const T* w, int M, int K, const float* x, int nvec, float* y, int ldy,
                                           const float* bias, const float* residual) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * QG_WARPS + (threadIdx.x >> 5);
    if (row >= M) return;
    const int nsb = K >> 5;
    const T* wr = w + (long long)row * K;
    for (int v0 = blockIdx.y * FG_VECTORS; v0 < nvec; v0 += gridDim.y * FG_VECTORS) {
        float acc[FG_VECTORS];
#pragma unroll
        for (int j = 0; j < FG_VECTORS; ++j) acc[j] = 0.f;
        constexpr int WLOADS = 32 * sizeof(T) / 16;
        for (int first0 = 0; first0 < nsb; first0 += 32 * FG_UNROLL) {
            // the sub-blocks' weights in 16-byte loads, once for the block row's vectors, FG_UNROLL
            // iterations' loads in flight before the first is used (a router row of 2048 floats:
            // one trip to memory instead of two)
            uint4 wv_all[FG_UNROLL][WLOADS];
#pragma unroll
            for (int u = 0; u < FG_UNROLL; ++u) {
                const int sb = first0 + 32 * u + lane;
                if (sb < nsb) {
                    const uint4* wp = reinterpret_cast<const uint4*>(wr + sb * 32);
#pragma unroll
                    for (int i = 0; i < WLOADS; ++i) wv_all[u][i] = wp[i];
                }
            }
            if (PDL_PREFETCH && first0 == 0) pdl_enter();  // the first weight loads are in flight
#pragma unroll
            for (int u = 0; u < FG_UNROLL; ++u) {
                const int first = first0 + 32 * u;
                if (first >= nsb) break;  // uniform across the warp
                const int sb = first + lane;
                const T* we = reinterpret_cast<const T*>(wv_all[u]);
#pragma unroll
                for (int j = 0; j < FG_VECTORS; ++j) {
                    if (v0 + j >= nvec) break;  // uniform across the warp
                    float t = 0.f;
                    if (sb < nsb) {
                        float4 xq[8];
                        const float4* xp = reinterpret_cast<const float4*>(x + (long long)(v0 + j) * K + sb * 32);
#pragma unroll
                        for (int i = 0; i < 8; ++i) xq[i] = xp[i];
                        const float* xe = reinterpret_cast<const float*>(xq);
#pragma unroll
                        for (int i = 0; i < 32; ++i) t = __fadd_rn(t, __fmul_rn(to_float(we[i]), xe[i]));
                    }
                    t = __fadd_rn(t, __shfl_xor_sync(FULL_MASK, t, 1));
                    t = __fadd_rn(t, __shfl_xor_sync(FULL_MASK, t, 2));
                    float group = 0.f;  // the iteration's 32 sub-blocks: one group
#pragma unroll
                    for (int g = 0; g < 32 / CANON_TILE; ++g) {
                        const float Tv = __shfl_sync(FULL_MASK, t, CANON_TILE * g);
                        if (first + CANON_TILE * g < nsb) group = __fadd_rn(group, Tv);
                    }
                    acc[j] = __fadd_rn(acc[j], group);
                }
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < FG_VECTORS; ++j)
                if (v0 + j < nvec) y[(long long)(v0 + j) * ldy + row] = canon_out(acc[j], row, v0 + j, ldy, bias, residual);
        }
    }
}

// ---------------------------------------------------------------- entry points
#define PRODUCT_ARGS                                                                                            \
    int M, int K, const signed char *xq, const float *xs, const int *xsum, int N, float *y, int ldy,           \
        const float *bias, const float *residual, float *partial

#define QGEMV(NAME, KIND, NV)                                                                                   \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32) qgemv_##NAME##_v##NV(PARTS_ARGS, PRODUCT_ARGS) { \
        if (!PDL_PREFETCH) pdl_enter(); /* else qgemv_body waits after its first weight loads */                \
        qgemv_body<KIND, NV>(PARTS_OF, M, K, Act8{xq, xs, xsum}, N, y, ldy, bias, residual, blockIdx.y * NV, 0); \
    }
// qgemv_id_<fmt>: routed experts (a mixture of experts' rows). Each part is a stack of experts of
// the same rows (gate, up; or down); grid y walks the (token, slot) pairs: pair j multiplies input
// row j / xdiv by the matrices of expert ids[j] into y[j * ldy ...]. ids[j] < 0: no product (the row
// of y is left as it is). The same canonical sums as qgemv, so the same bits as any product of
// that expert's rows.
#define QGEMV_ID(NAME, KIND)                                                                                    \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * 32)                                                 \
        qgemv_id_##NAME(PARTS_ARGS, int M, int K, const signed char* xq, const float* xs, const int* xsum,      \
                        const int* ids, int xdiv, float* y, int ldy) {                                          \
        pdl_enter();                                                                                            \
        const int pair = blockIdx.y, expert = __ldg(ids + pair), xrow = pair / xdiv;                            \
        if (expert < 0) return;                                                                                  \
        const Act8 x{xq + (long long)xrow * K, xs + (long long)xrow * (K >> Q<KIND>::XS_SHIFT),                  \
                     xsum + (long long)xrow * (K >> 5)};                                                         \
        qgemv_body<KIND, 1>(PARTS_OF, M, K, x, 1, y + (long long)pair * ldy, ldy, nullptr, nullptr, 0, expert);  \
    }
#define QMM(NAME, KIND, NT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQ_MIN_BLOCKS) qmm_##NAME##_n##NT(PARTS_ARGS, PRODUCT_ARGS) {    \
        pdl_enter();                                                                                            \
        qmm_body<KIND, NT>(PARTS_OF, M, K, Act8{xq, xs, xsum}, N, y, ldy, bias, residual, partial,              \
                           blockIdx.x * 8 * NT, blockIdx.y * MMQ_ROWS, 0);                                       \
    }
// qmm_id_<fmt>_n<NT>: routed experts with many pairs an expert (a prompt's or a batch's pairs grouped
// by expert: moe.cu moe_group), so each expert's weights are read once a call, not once a pair. Rows
// [starts[e], starts[e + 1]) of x and y are expert e's pairs; tiles[e] is the first of its token
// tiles (8 * NT pairs each), tiles[E] their count. Block x is one token tile of one expert (grid x:
// an upper bound on the tiles; blocks past tiles[E] exit), block y a tile of its rows. The same
// canonical sums as qgemv_id: a pair gets the same bits by either kernel.
#define QMM_ID(NAME, KIND, NT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQ_MIN_BLOCKS)                                   \
        qmm_id_##NAME##_n##NT(PARTS_ARGS, int M, int K, const signed char* xq, const float* xs, const int* xsum,  \
                              const int* starts, const int* tiles, int E, float* y, int ldy) {                   \
        pdl_enter();                                                                                             \
        int e;                                                                                                   \
        const int tile = expert_tile(tiles, E, blockIdx.x, e);                                                   \
        if (tile < 0) return;  /* the whole block */                                                             \
        const long long s = starts[e];                                                                           \
        const Act8 x{xq + s * K, xs + s * (K >> Q<KIND>::XS_SHIFT), xsum + s * (K >> 5)};                         \
        qmm_body<KIND, NT>(PARTS_OF, M, K, x, starts[e + 1] - (int)s, y + s * ldy, ldy, nullptr, nullptr,          \
                           nullptr, tile * 8 * NT, blockIdx.y * MMQ_ROWS, e);                                    \
    }
#if QMM_KERNELS & 1
#define QGEMVS(NAME, KIND) QGEMV(NAME, KIND, 1) QGEMV(NAME, KIND, 2) QGEMV(NAME, KIND, 4) QGEMV_ID(NAME, KIND)
#else
#define QGEMVS(NAME, KIND)
#endif
#if QMM_KERNELS & 2
#define QMMS(NAME, KIND)                                                                                        \
    QMM(NAME, KIND, 1) QMM(NAME, KIND, 2) QMM(NAME, KIND, 4) QMM(NAME, KIND, 8)                                 \
    QMM_ID(NAME, KIND, 1) QMM_ID(NAME, KIND, 2) QMM_ID(NAME, KIND, 4) QMM_ID(NAME, KIND, 8)
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
        if (!PDL_PREFETCH) pdl_enter(); /* else fgemv_body waits after its first weight loads */                \
        fgemv_body<T>(reinterpret_cast<const T*>(w), M, K, x, N, y, ldy, bias, residual);                       \
    }
#if QMM_FORMAT == 0 || QMM_FORMAT == 100
FGEMV(f16, __half)
FGEMV(bf16, __nv_bfloat16)
FGEMV(f32, float)
#endif
