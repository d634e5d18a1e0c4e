// Attention of N query rows of a pass, each row with its own sequence (KV cache), position and span
// (a token tree's node attends to its ancestors' slots), in three launches for the whole pass:
//   rope_rows      rotary embedding of each row's q (in place) and k, k and v stored in the row's
//                  cache at its slot;
//   attn_chunks    grid (KV head, block of 4 chunks, row): per chunk of 64 positions of the row's
//                  span, the G query heads' partial softmax (max m, sum l, weighted values o), then
//                  the block's 4 chunks merged;
//   attn_merge     per row: the blocks' partials merged, o / l, rounded to the output projection's
//                  activation format (and its 8-bit form).
// Canonical order (the same bits for a row whatever else the pass holds, and whichever kernel or
// block holds a chunk): a chunk's scores are sequential fused multiply-adds over the head dimension
// by one lane; its max is exact; its sum and weighted values are formed in a fixed lane order; chunk
// partials are combined by `merge` in the complete binary tree over chunk indexes (chunks past the
// row's position are empty and pass through). A block holds an aligned power-of-two range of chunks
// (a subtree), so blocks and the final merge compute the same tree. Single precision throughout.
#include "formats.cuh"
#include "act.cuh"
#include "async.cuh"

#define ATTN_CHUNK 64         // positions per chunk
#define ATTN_BLOCK_CHUNKS 4   // chunks per attn_chunks block (one per warp)
#define ATTN_THREADS 128
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_MAX_GROUP 16

// (a, b) rotated by the angle with cosine c and sine s, each product and sum rounded (no fused
// multiply-add), as NumPy computes a*c - b*s and a*s + b*c
__device__ __forceinline__ void rotate(float a, float b, float c, float s, float& ra, float& rb) {
    ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// The rows of a pass (infer/gpu/passes.py PassIndex): position, cache slot, span (positions from
// `base` on are the slots anc[anc_off + t - base]; anc_off < 0: the span is the cache's own slots),
// and the row's cache: keys and values (n_layers, n_kv_heads, cap, D) float16.
struct Rows {
    const int* pos;
    const int* slot;
    const int* base;
    const int* anc_off;
    const int* anc;
    const unsigned long long* kptr;
    const unsigned long long* vptr;
    const int* cap;
};

__device__ __forceinline__ int span_slot(const Rows& R, int r, int t) {
    const int off = R.anc_off[r];
    return (off >= 0 && t >= R.base[r]) ? R.anc[off + t - R.base[r]] : t;
}

__device__ __forceinline__ __half* cache_at(unsigned long long base, int layer, int n_kv, int kvh, int cap, int slot,
                                            int D) {
    return reinterpret_cast<__half*>(base) + (((long long)layer * n_kv + kvh) * cap + slot) * (long long)D;
}

// grid (rows, n_heads + n_kv_heads): q rotated in place; k rotated and stored, v stored, at the row's
// slot. qkv: (rows, W) float32 with q at 0, k at n_heads*D, v at (n_heads + n_kv_heads)*D. Pair i is
// (2i, 2i+1) for Llama (GGUF permutes Q/K so pairs are adjacent), (i, i + n_pairs) for NeoX.
extern "C" __global__ void rope_rows(float* qkv, int W, const float* cos_t, const float* sin_t, int n_heads,
                                     int n_kv_heads, int D, int n_pairs, int neox, int layer, const int* pos,
                                     const int* slot, const unsigned long long* kptr,
                                     const unsigned long long* vptr, const int* cap) {
    const int r = blockIdx.x, h = blockIdx.y;
    const int p = pos[r];
    const float* c = cos_t + (long long)p * n_pairs;
    const float* s = sin_t + (long long)p * n_pairs;
    float* row = qkv + (long long)r * W;
    const bool is_q = h < n_heads;
    const int kh = h - n_heads;
    float* src = is_q ? row + h * D : row + (n_heads + kh) * D;
    __half* kdst = is_q ? nullptr : cache_at(kptr[r], layer, n_kv_heads, kh, cap[r], slot[r], D);
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + n_pairs : 2 * i + 1;
        float ra, rb;
        rotate(src[ia], src[ib], c[i], s[i], ra, rb);
        if (is_q) {
            src[ia] = ra;
            src[ib] = rb;
        } else {
            kdst[ia] = __float2half_rn(ra);
            kdst[ib] = __float2half_rn(rb);
        }
    }
    if (is_q) return;
    for (int d = 2 * n_pairs + threadIdx.x; d < D; d += blockDim.x) kdst[d] = __float2half_rn(src[d]);
    const float* vs = row + (n_heads + n_kv_heads + kh) * D;
    __half* vdst = cache_at(vptr[r], layer, n_kv_heads, kh, cap[r], slot[r], D);
    for (int d = threadIdx.x; d < D; d += blockDim.x) vdst[d] = __float2half_rn(vs[d]);
}

// A partial softmax over some positions: max m, sum l of exp(s - m), o = sum of exp(s - m) * v.
// Empty (no position): l == 0.
__device__ __forceinline__ void merge_into(float& m, float& l, float* o, float m2, float l2, const float* o2, int n,
                                           int stride2) {
    if (l2 == 0.f) return;
    if (l == 0.f) {
        m = m2;
        l = l2;
        for (int i = 0; i < n; ++i) o[i] = o2[i * stride2];
        return;
    }
    const float M = fmaxf(m, m2);
    const float fa = expf(__fsub_rn(m, M)), fb = expf(__fsub_rn(m2, M));
    l = __fadd_rn(__fmul_rn(l, fa), __fmul_rn(l2, fb));
    for (int i = 0; i < n; ++i) o[i] = __fadd_rn(__fmul_rn(o[i], fa), __fmul_rn(o2[i * stride2], fb));
    m = M;
}

// scalar form (one output element)
__device__ __forceinline__ void merge1(float& m, float& l, float& o, float m2, float l2, float o2) {
    if (l2 == 0.f) return;
    if (l == 0.f) {
        m = m2;
        l = l2;
        o = o2;
        return;
    }
    const float M = fmaxf(m, m2);
    const float fa = expf(__fsub_rn(m, M)), fb = expf(__fsub_rn(m2, M));
    l = __fadd_rn(__fmul_rn(l, fa), __fmul_rn(l2, fb));
    o = __fadd_rn(__fmul_rn(o, fa), __fmul_rn(o2, fb));
    m = M;
}

// Partials in shared memory: per slot and head, (m, l, o[D]) as D + 2 floats.
#define PART_STRIDE(D) ((D) + 2)

// grid (n_kv_heads, ceil(max positions / 256), rows), ATTN_THREADS threads; dynamic shared memory:
// G*D floats (queries) + 4*G*(D+2) floats (chunk partials) + 4*G*64 floats (probabilities), and
// for D <= 128 each warp's chunk of keys and values (2 x 64 x (D + 8) halves: attn_stage_bytes).
// work: (rows, n_heads, nb, D + 2) floats, nb = ceil(cap / 256). D (the head dimension) is a
// template parameter so that the loops over it unroll; the order of every sum is the one the
// header gives whatever the unrolling (scores: d ascending; values: positions ascending). A
// warp's keys and values are copied to shared memory in one burst (cp.async, every row at once):
// read where they are used, each row's loads would wait on memory one after another.
#define ATTN_HEAD_BATCH 4  // heads whose weighted values a warp accumulates at once (registers)
template <int D>
__device__ __forceinline__ void attn_chunks_body(const float* qkv, int W, int n_heads, int n_kv_heads, float scale,
                                                 int layer, const Rows& R, float* work, int nb) {
    extern __shared__ __align__(16) float attn_smem[];
    const int kvh = blockIdx.x, blk = blockIdx.y, r = blockIdx.z;
    const int G = n_heads / n_kv_heads, h0 = kvh * G;
    const int p = R.pos[r], nchunks = p / ATTN_CHUNK + 1;
    const int c0 = blk * ATTN_BLOCK_CHUNKS;
    if (c0 >= nchunks) return;  // the merge reads only the blocks that hold positions
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* q_s = attn_smem;                                  // G x D
    float* part = q_s + G * D;                               // 4 slots x G x (D + 2)
    float* e_s = part + ATTN_BLOCK_CHUNKS * G * PART_STRIDE(D);  // 4 warps x G x 64
    // the group's queries, rounded to float16 as they meet the float16 keys
    const float* qrow = qkv + (long long)r * W + h0 * D;
    for (int i = tid; i < G * D; i += ATTN_THREADS) q_s[i] = __half2float(__float2half_rn(qrow[i]));
    __syncthreads();
    const int row_cap = R.cap[r];
    const __half* kbase = cache_at(R.kptr[r], layer, n_kv_heads, kvh, row_cap, 0, D);
    const __half* vbase = cache_at(R.vptr[r], layer, n_kv_heads, kvh, row_cap, 0, D);
    const int chunk = c0 + warp;
    float* mine = part + warp * G * PART_STRIDE(D);
    constexpr bool STAGE = D <= 128;
    constexpr int RS = D + 8;  // halves per staged row: 16-byte loads of 8 lanes fall in 32 banks
    if (chunk >= nchunks) {  // empty slot
        for (int g = lane; g < G; g += 32) mine[g * PART_STRIDE(D) + 1] = 0.f;
    } else {
        const int t0 = chunk * ATTN_CHUNK, n = min(ATTN_CHUNK, p + 1 - t0);
        float* e_w = e_s + warp * G * ATTN_CHUNK;
        __half* ks = reinterpret_cast<__half*>(e_s + ATTN_BLOCK_CHUNKS * G * ATTN_CHUNK) + warp * 2 * ATTN_CHUNK * RS;
        __half* vs = ks + ATTN_CHUNK * RS;
        if (STAGE) {
            constexpr int PIECES_ROW = D / 8;
            for (int i = lane; i < n * PIECES_ROW; i += 32) {
                const int t = i / PIECES_ROW, piece = i % PIECES_ROW;
                const long long slot = span_slot(R, r, t0 + t);
                cp_async16(ks + t * RS + piece * 8, kbase + slot * D + piece * 8, true);
                cp_async16(vs + t * RS + piece * 8, vbase + slot * D + piece * 8, true);
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncwarp();  // every lane's copies are visible to the warp
        }
        // scores: this lane's positions t0 + lane and t0 + lane + 32, every head of the group; the
        // key's pieces loaded 8 at a time before they are used
        constexpr int PIECES = D / 8, BATCH = PIECES < 8 ? PIECES : 8;
        for (int half = 0; half < 2; ++half) {
            const int t = lane + 32 * half;
            float acc[ATTN_MAX_GROUP];
#pragma unroll
            for (int g = 0; g < ATTN_MAX_GROUP; ++g) acc[g] = 0.f;
            if (t < n) {
                const uint4* krow = reinterpret_cast<const uint4*>(
                    STAGE ? ks + t * RS : kbase + (long long)span_slot(R, r, t0 + t) * D);
#pragma unroll
                for (int b0 = 0; b0 < PIECES; b0 += BATCH) {
                    uint4 raw[BATCH];
#pragma unroll
                    for (int k = 0; k < BATCH; ++k) raw[k] = krow[b0 + k];
#pragma unroll
                    for (int k = 0; k < BATCH; ++k) {
                        const __half2* kh = reinterpret_cast<const __half2*>(&raw[k]);
                        float kf[8];
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float2 f = __half22float2(kh[e]);
                            kf[2 * e] = f.x;
                            kf[2 * e + 1] = f.y;
                        }
#pragma unroll
                        for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
                            if (g < G) {
                                const float* qg = q_s + g * D + 8 * (b0 + k);
#pragma unroll
                                for (int e = 0; e < 8; ++e) acc[g] = __fmaf_rn(qg[e], kf[e], acc[g]);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < ATTN_MAX_GROUP; ++g)
                if (g < G) e_w[g * ATTN_CHUNK + t] = t < n ? __fmul_rn(acc[g], scale) : NEG_INF;
        }
        __syncwarp();
        // per head: max, exp, sum in a fixed lane order; the probabilities replace the scores
        for (int g = 0; g < G; ++g) {
            float* eg = e_w + g * ATTN_CHUNK;
            const float sa = eg[lane], sb = eg[lane + 32];
            float m = fmaxf(sa, sb);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            const float ea = lane < n ? expf(__fsub_rn(sa, m)) : 0.f;
            const float eb = lane + 32 < n ? expf(__fsub_rn(sb, m)) : 0.f;
            float l = __fadd_rn(ea, eb);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, o));
            __syncwarp();
            eg[lane] = ea;
            eg[lane + 32] = eb;
            if (lane == 0) {
                mine[g * PART_STRIDE(D)] = m;
                mine[g * PART_STRIDE(D) + 1] = l;
            }
        }
        __syncwarp();
        // weighted values: each lane's dimension pairs (lane, lane + 32, ...), positions in order;
        // each value row is loaded once for ATTN_HEAD_BATCH heads, 4 positions' loads in flight
        constexpr int PAIRS = D / 64;  // pairs per lane
        for (int g0 = 0; g0 < G; g0 += ATTN_HEAD_BATCH) {
            float2 o[ATTN_HEAD_BATCH][PAIRS];
#pragma unroll
            for (int gg = 0; gg < ATTN_HEAD_BATCH; ++gg)
#pragma unroll
                for (int k = 0; k < PAIRS; ++k) o[gg][k] = make_float2(0.f, 0.f);
            int t = 0;
            for (; t + 4 <= n; t += 4) {
                float2 v[4][PAIRS];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const __half2* vr = reinterpret_cast<const __half2*>(
                        STAGE ? vs + (t + u) * RS : vbase + (long long)span_slot(R, r, t0 + t + u) * D);
#pragma unroll
                    for (int k = 0; k < PAIRS; ++k) v[u][k] = __half22float2(vr[lane + 32 * k]);
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
#pragma unroll
                    for (int gg = 0; gg < ATTN_HEAD_BATCH; ++gg) {
                        if (g0 + gg < G) {
                            const float e = e_w[(g0 + gg) * ATTN_CHUNK + t + u];
#pragma unroll
                            for (int k = 0; k < PAIRS; ++k) {
                                o[gg][k].x = __fmaf_rn(e, v[u][k].x, o[gg][k].x);
                                o[gg][k].y = __fmaf_rn(e, v[u][k].y, o[gg][k].y);
                            }
                        }
                    }
                }
            }
            for (; t < n; ++t) {
                const __half2* vr = reinterpret_cast<const __half2*>(
                    STAGE ? vs + t * RS : vbase + (long long)span_slot(R, r, t0 + t) * D);
                float2 v[PAIRS];
#pragma unroll
                for (int k = 0; k < PAIRS; ++k) v[k] = __half22float2(vr[lane + 32 * k]);
#pragma unroll
                for (int gg = 0; gg < ATTN_HEAD_BATCH; ++gg) {
                    if (g0 + gg < G) {
                        const float e = e_w[(g0 + gg) * ATTN_CHUNK + t];
#pragma unroll
                        for (int k = 0; k < PAIRS; ++k) {
                            o[gg][k].x = __fmaf_rn(e, v[k].x, o[gg][k].x);
                            o[gg][k].y = __fmaf_rn(e, v[k].y, o[gg][k].y);
                        }
                    }
                }
            }
#pragma unroll
            for (int gg = 0; gg < ATTN_HEAD_BATCH; ++gg) {
                if (g0 + gg < G) {
                    float* pg = mine + (g0 + gg) * PART_STRIDE(D);
#pragma unroll
                    for (int k = 0; k < PAIRS; ++k) {
                        const int dp = lane + 32 * k;
                        pg[2 + 2 * dp] = o[gg][k].x;
                        pg[3 + 2 * dp] = o[gg][k].y;
                    }
                }
            }
        }
    }
    __syncthreads();
    // the block's 4 slots as the subtree ((0, 1), (2, 3)); one thread per (head, element)
    for (int i = tid; i < G * D; i += ATTN_THREADS) {
        const int g = i / D, d = i % D;
        const float* s0 = part + g * PART_STRIDE(D);
        const int ss = G * PART_STRIDE(D);  // between slots
        float m01 = s0[0], l01 = s0[1], o01 = s0[2 + d];
        merge1(m01, l01, o01, s0[ss], s0[ss + 1], s0[ss + 2 + d]);
        float m23 = s0[2 * ss], l23 = s0[2 * ss + 1], o23 = s0[2 * ss + 2 + d];
        merge1(m23, l23, o23, s0[3 * ss], s0[3 * ss + 1], s0[3 * ss + 2 + d]);
        merge1(m01, l01, o01, m23, l23, o23);
        float* w = work + (((long long)r * n_heads + h0 + g) * nb + blk) * PART_STRIDE(D);
        if (d == 0) {
            w[0] = m01;
            w[1] = l01;
        }
        w[2 + d] = o01;
    }
}

#define ATTN_CHUNKS(D)                                                                                       \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                               \
        attn_chunks_d##D(const float* qkv, int W, int n_heads, int n_kv_heads, float scale, int layer,        \
                         const int* pos, const int* base, const int* anc_off, const int* anc,                 \
                         const unsigned long long* kptr, const unsigned long long* vptr, const int* cap,      \
                         float* work, int nb) {                                                               \
        const Rows R{pos, nullptr, base, anc_off, anc, kptr, vptr, cap};                                     \
        attn_chunks_body<D>(qkv, W, n_heads, n_kv_heads, scale, layer, R, work, nb);                         \
    }
ATTN_CHUNKS(64)
ATTN_CHUNKS(128)
ATTN_CHUNKS(256)

// grid (rows, n / chunk), `chunk` threads (256, or 32 where a row is no whole 256): out (rows,
// n_heads*D) = the merged attention, a thread per value, then the block's values rounded to `fmt`
// (whole 8-bit groups: a q8_k group is 256 values, q8_0's 32), with the 8-bit form when xq is given.
// The blocks' partials are merged as the complete binary tree over their indexes: a stack of
// subtrees, left to right, joined right to left at the end.
#define MERGE_MAX_LEVELS 16
extern "C" __global__ void __launch_bounds__(256)
    attn_merge(const float* work, int nb, int n_heads, int D, const int* pos, float* out, int fmt, signed char* xq,
               float* xs, int* xsum) {
    const int r = blockIdx.x, chunk = blockDim.x;
    const int nblk = (pos[r] / ATTN_CHUNK) / ATTN_BLOCK_CHUNKS + 1;
    const int n = n_heads * D;
    float* orow = out + (long long)r * n;
    const int i = blockIdx.y * chunk + threadIdx.x;
    const int h = i / D, d = i % D;
    const float* w = work + ((long long)r * n_heads + h) * nb * PART_STRIDE(D);
    float value;
    if (nblk == 1) {  // one block of positions: its partial is the whole softmax
        value = __fdiv_rn(w[2 + d], w[1]);
    } else {
        float sm[MERGE_MAX_LEVELS], sl[MERGE_MAX_LEVELS], so[MERGE_MAX_LEVELS];
        int lev[MERGE_MAX_LEVELS];
        int top = 0;
        for (int b = 0; b < nblk; ++b) {
            float m = w[b * PART_STRIDE(D)], l = w[b * PART_STRIDE(D) + 1], o = w[b * PART_STRIDE(D) + 2 + d];
            int level = 0;
            // block b completes every subtree whose last leaf it is
            while (top > 0 && lev[top - 1] == level) {
                float pm = sm[top - 1], pl = sl[top - 1], po = so[top - 1];
                merge1(pm, pl, po, m, l, o);
                m = pm;
                l = pl;
                o = po;
                ++level;
                --top;
            }
            sm[top] = m;
            sl[top] = l;
            so[top] = o;
            lev[top] = level;
            ++top;
        }
        float m = sm[top - 1], l = sl[top - 1], o = so[top - 1];
        for (int k = top - 2; k >= 0; --k) {  // the incomplete right edge: (left, right) from the right
            float pm = sm[k], pl = sl[k], po = so[k];
            merge1(pm, pl, po, m, l, o);
            m = pm;
            l = pl;
            o = po;
        }
        value = __fdiv_rn(o, l);
    }
    if (fmt == ACT_F32 || fmt == ACT_F16 || fmt == ACT_BF16) {
        orow[i] = round_float(value, fmt);
        return;
    }
    orow[i] = value;
    __syncthreads();  // the block's values are written: round them by groups, a warp a group
    const int group = fmt == ACT_Q8_0 ? 32 : 256, per_block = chunk / group, warp = threadIdx.x >> 5;
    if (warp < per_block)
        round_groups_8bit(orow, orow, nullptr, n, fmt, int8_row(xq, xs, xsum, r, n, fmt),
                          blockIdx.y * per_block + warp, 1 << 30);
}
