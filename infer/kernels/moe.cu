// A mixture of experts' steps around its products (the products themselves: qmm.cu's qgemv_id),
// for the rows of a pass, in the order infer/moe.py computes them on the CPU (llama.cpp's
// llm_build_moe_ffn), so a row gets the same bits in any pass and the choice of experts matches the
// CPU's up to the last bit of an exp:
//   moe_route    router logits -> the top-k experts and their weights
//   moe_group    the (row, slot) pairs sorted by expert, for products that read an expert once
//                (qmm.cu qmm_id), and moe_gather8 their input rows in that order
//   moe_combine  x += sum over slots of weight * expert output (+ the shared expert's, gated)
#include "moe_steps.cuh"

// One warp per row of logits (n, E), ROUTE_ROWS rows a block, E floats of dynamic shared memory a
// row: moe_steps.cuh route_row.
#define ROUTE_ROWS 4
extern "C" __global__ void moe_route(const float* logits, int n, int E, int k, int normalize, const int* live,
                                     int* ids, float* weights) {
    extern __shared__ float route_probs[];
    const int warp = threadIdx.x >> 5;
    const int r = blockIdx.x * ROUTE_ROWS + warp;
    if (r >= n) return;  // the whole warp
    route_row(logits, r, E, k, normalize, live, ids, weights, route_probs + warp * E);
}

// The pass's pairs (ids: an expert, or < 0 for a null row's) sorted by expert, one block of 1024
// threads, 2 * E ints of dynamic shared memory: starts[e] the first sorted position of expert e's
// pairs (starts[E]: the pairs that have an expert), tiles[e] the first of its token tiles of `bn`
// pairs (tiles[E]: their count), order[pos] the pair at sorted position pos, slot[j] pair j's
// position (-1: none). Positions within an expert follow the atomics' order: a pair's product does
// not depend on where it sits (canonical sums), so nothing downstream depends on that order.
extern "C" __global__ void moe_group(const int* ids, int pairs, int E, int bn, int* starts, int* tiles, int* order,
                                     int* slot) {
    extern __shared__ int group_counts[];  // counts, then each expert's next free position
    int* fill = group_counts + E;
    const int tid = threadIdx.x, lane = tid & 31;
    for (int e = tid; e < E; e += blockDim.x) group_counts[e] = 0;
    __syncthreads();
    for (int j = tid; j < pairs; j += blockDim.x) {
        const int e = ids[j];
        if (e >= 0) atomicAdd(group_counts + e, 1);
    }
    __syncthreads();
    if (tid < 32) {  // exclusive scans of the counts and of the tiles, 32 experts a step
        int pos = 0, tile = 0;
        for (int base = 0; base < E; base += 32) {
            const int e = base + lane;
            const int c = e < E ? group_counts[e] : 0;
            int cs = c, ts = (c + bn - 1) / bn;
            const int t0 = ts;
            for (int o = 1; o < 32; o <<= 1) {
                const int a = __shfl_up_sync(0xffffffffu, cs, o), b = __shfl_up_sync(0xffffffffu, ts, o);
                if (lane >= o) {
                    cs += a;
                    ts += b;
                }
            }
            if (e < E) {
                starts[e] = fill[e] = pos + cs - c;
                tiles[e] = tile + ts - t0;
            }
            pos += __shfl_sync(0xffffffffu, cs, 31);
            tile += __shfl_sync(0xffffffffu, ts, 31);
        }
        if (lane == 0) {
            starts[E] = pos;
            tiles[E] = tile;
        }
    }
    __syncthreads();
    for (int j = tid; j < pairs; j += blockDim.x) {
        const int e = ids[j];
        int pos = -1;
        if (e >= 0) {
            pos = atomicAdd(fill + e, 1);
            order[pos] = j;
        }
        slot[j] = pos;
    }
}

// Rows of an 8-bit activation (K int8 values, K / group scales, K / 32 sums a row) in moe_group's
// order: out row pos = row order[pos] / xdiv of x, for pos < *count (moe_group's starts[E]).
// grid (pairs), 64 threads; K a multiple of 32 (16-byte pieces of the values).
extern "C" __global__ void moe_gather8(const signed char* xq, const float* xs, const int* xsum, int K, int group,
                                       const int* order, const int* count, int xdiv, signed char* oq, float* os,
                                       int* osum) {
    const int pos = blockIdx.x;
    if (pos >= *count) return;
    const long long src = order[pos] / xdiv;
    const int4* q = reinterpret_cast<const int4*>(xq + src * K);
    int4* oqv = reinterpret_cast<int4*>(oq + (long long)pos * K);
    for (int i = threadIdx.x; i < K / 16; i += blockDim.x) oqv[i] = q[i];
    const int ng = K / group, ns = K / 32;
    for (int i = threadIdx.x; i < ng; i += blockDim.x) os[(long long)pos * ng + i] = xs[src * ng + i];
    for (int i = threadIdx.x; i < ns; i += blockDim.x) osum[(long long)pos * ns + i] = xsum[src * ns + i];
}

// moe_steps.cuh combine_at for rows r < n (grid y) and every column: grid (pieces of dim, rows),
// 256 threads.
extern "C" __global__ void moe_combine(const float* outs, const int* ids, const float* weights, int k, int dim,
                                       const int* slot, const float* shared, const float* gate, float* x) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < dim) combine_at(outs, ids, weights, k, dim, slot, shared, gate, x, blockIdx.y, c);
}
