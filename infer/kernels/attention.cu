// Attention of N query rows of a pass, each row with its own sequence (KV cache), position and span
// (a token tree's node attends to its ancestors' slots), in three launches for the whole pass:
//   rope_rows      rotary embedding of each row's q (in place) and k, k and v stored in the row's
//                  cache at its slot;
//   attn_chunks    grid (KV head, block of 4 chunks, group of rows): a warp per chunk of 32
//                  positions of the row's span (copied to shared memory first) computes the G query
//                  heads' partial softmax (max m, sum l, weighted values o), then the block's 4
//                  chunks are merged; row after row of the group;
//   attn_merge     per row: the blocks' partials merged, o / l, rounded to the output projection's
//                  activation format (and its 8-bit form; and as float16 before that rounding).
// Canonical order (the same bits for a row whatever else the pass holds, and whichever block holds
// a chunk). Lane l of a warp owns dimensions [l*D/32, (l+1)*D/32) of the query, keys and values. A
// score is the sum over lanes of each lane's sequential fused multiply-adds over its dimensions,
// the 32 lane sums added by a fixed pattern (attn_reduce8); the chunk's max is exact; its sum is a
// butterfly over the lanes (position = lane); a lane's weighted values are fused multiply-adds over
// the positions in ascending order. Chunk partials are combined by `merge` in the complete binary
// tree over chunk indexes (chunks past the row's position are empty and pass through; so are those
// wholly before a sliding window, whose other positions before it weigh nothing: window > 0, a
// row at position p sees positions p - window + 1 .. p). A block
// holds an aligned power-of-two range of chunks (a subtree), so blocks and the final merge compute
// the same tree. Single precision throughout.
#include "formats.cuh"
#include "act.cuh"
#include "async.cuh"
#include "pdl.cuh"

#define ATTN_CHUNK 32         // positions per chunk (one per lane of the warp that holds it)
#define ATTN_BLOCK_CHUNKS 4   // chunks per attn_chunks block (one per warp)
#define ATTN_HEADS 4          // query heads a warp works on at once (registers)
#define ATTN_TILE 8           // positions whose keys or values a warp loads at once
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
// and the row's cache: keys and values (layers, n_kv_heads, cap, D) float16. Slot s lies at s % cap:
// a local layer's cache is a ring of cap positions (infer/gpu/cache.py); a global one has cap
// positions past every slot, where the modulo changes nothing.
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
    return reinterpret_cast<__half*>(base) + (((long long)layer * n_kv + kvh) * cap + slot % cap) * (long long)D;
}

// grid (rows, n_heads + n_kv_heads): q rotated in place; k rotated and stored, v stored, at the row's
// slot. qkv: (rows, W) float32 with q at 0, k at n_heads*D, v at (n_heads + n_kv_heads)*D. Pair i is
// (2i, 2i+1) for Llama (GGUF permutes Q/K so pairs are adjacent), (i, i + n_pairs) for NeoX.
// q_norm / k_norm (D floats, or null): each query / key head is first RMS-normalised over its D
// values and multiplied by them (Qwen3), in the rmsnorm kernels' arithmetic (ops.cu).
extern "C" __global__ void rope_rows(float* qkv, int W, const float* cos_t, const float* sin_t, int n_heads,
                                     int n_kv_heads, int D, int n_pairs, int neox, int layer, const int* pos,
                                     const int* slot, const unsigned long long* kptr,
                                     const unsigned long long* vptr, const int* cap, const float* q_norm,
                                     const float* k_norm, float eps) {
    pdl_enter();
    const int r = blockIdx.x, h = blockIdx.y;
    const int p = pos[r];
    const float* c = cos_t + (long long)p * n_pairs;
    const float* s = sin_t + (long long)p * n_pairs;
    float* row = qkv + (long long)r * W;
    const bool is_q = h < n_heads;
    const int kh = h - n_heads;
    float* src = is_q ? row + h * D : row + (n_heads + kh) * D;
    __half* kdst = is_q ? nullptr : cache_at(kptr[r], layer, n_kv_heads, kh, cap[r], slot[r], D);
    const float* nw = is_q ? q_norm : k_norm;  // the same for the whole block
    float rms = 1.f;
    if (nw) {
        float ss = 0.f;
        for (int d = threadIdx.x; d < D; d += blockDim.x) ss = __fmaf_rn(src[d], src[d], ss);
        ss = block_sum(ss);  // every thread has read its values before any is written below
        rms = sqrtf(__fadd_rn(__fdiv_rn(ss, (float)D), eps));
    }
    auto value = [&](int d) { return nw ? __fmul_rn(__fdiv_rn(src[d], rms), nw[d]) : src[d]; };
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + n_pairs : 2 * i + 1;
        float ra, rb;
        rotate(value(ia), value(ib), c[i], s[i], ra, rb);
        if (is_q) {
            src[ia] = ra;
            src[ib] = rb;
        } else {
            kdst[ia] = __float2half_rn(ra);
            kdst[ib] = __float2half_rn(rb);
        }
    }
    if (is_q) {  // the dimensions past the rotated ones: normalised in place
        if (nw)
            for (int d = 2 * n_pairs + threadIdx.x; d < D; d += blockDim.x) src[d] = value(d);
        return;
    }
    for (int d = 2 * n_pairs + threadIdx.x; d < D; d += blockDim.x) kdst[d] = __float2half_rn(value(d));
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

// merge1 split in two: merge_plan does the (m, l) part and records how o is to be combined in
// cf[0..2] (cf[0]: 0 keep o, 1 take o2, 2 o * cf[1] + o2 * cf[2]); merge_apply combines a pair of
// o values by that record. merge_plan + merge_apply on each element == merge1, bit for bit.
#define MERGE_COEFFS 12  // floats per head: three plans, then the merged m and l
__device__ __forceinline__ void merge_plan(float& m, float& l, float m2, float l2, float* cf) {
    cf[1] = cf[2] = 0.f;
    if (l2 == 0.f) {
        cf[0] = 0.f;
        return;
    }
    if (l == 0.f) {
        m = m2;
        l = l2;
        cf[0] = 1.f;
        return;
    }
    const float M = fmaxf(m, m2);
    const float fa = expf(__fsub_rn(m, M)), fb = expf(__fsub_rn(m2, M));
    l = __fadd_rn(__fmul_rn(l, fa), __fmul_rn(l2, fb));
    m = M;
    cf[0] = 2.f;
    cf[1] = fa;
    cf[2] = fb;
}
__device__ __forceinline__ float merge_apply(const float* cf, float o, float o2) {
    return cf[0] == 0.f ? o : (cf[0] == 1.f ? o2 : __fadd_rn(__fmul_rn(o, cf[1]), __fmul_rn(o2, cf[2])));
}

// Partials in shared memory: per slot and head, (m, l, o[D]) as D + 2 floats.
#define PART_STRIDE(D) ((D) + 2)

// The D/32 float16 values of a row that a lane owns, in one load, as floats.
template <int DL> struct LaneVector;
template <> struct LaneVector<2> { using type = unsigned int; };
template <> struct LaneVector<4> { using type = uint2; };
template <> struct LaneVector<8> { using type = uint4; };

template <int DL>
__device__ __forceinline__ void load_lane(const __half* p, float (&f)[DL]) {
    using V = typename LaneVector<DL>::type;
    const V raw = *reinterpret_cast<const V*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int k = 0; k < DL / 2; ++k) {
        const float2 x = __half22float2(h[k]);
        f[2 * k] = x.x;
        f[2 * k + 1] = x.y;
    }
}

// Each lane's partial sums s[0..7] of 8 positions, added over the warp: returns, in every lane,
// the sum for position (lane >> 2). Halving over lane bits 4, 3, 2 (a lane keeps the half of its
// positions that its bit selects and adds its partner's), then a butterfly over bits 1, 0 (a sum
// and its partner's are the same bits: addition commutes).
__device__ __forceinline__ float attn_reduce8(float (&s)[ATTN_TILE], int lane) {
    const unsigned full = 0xffffffffu;
#pragma unroll
    for (int half = ATTN_TILE / 2, bit = 16; half >= 1; half >>= 1, bit >>= 1) {
        const bool upper = lane & bit;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float keep = upper ? s[i + half] : s[i], send = upper ? s[i] : s[i + half];
            s[i] = __fadd_rn(keep, __shfl_xor_sync(full, send, bit));
        }
    }
    float v = s[0];
    v = __fadd_rn(v, __shfl_xor_sync(full, v, 2));
    return __fadd_rn(v, __shfl_xor_sync(full, v, 1));
}

// grid (n_kv_heads * S, blocks along the positions, ceil(rows / group)), ATTN_THREADS threads: a
// block takes one of S equal parts of a KV head's query heads (attn_chunks_s<S>_d<D>, S of
// attention.py's HEAD_SPLITS: 2, 4, 8, and 3, 6, 7 for the groups of 6 and 7 heads of the Qwen2.5
// family: more blocks, each with fewer heads a warp, for a decode step over a short cache, whose grid is
// otherwise a block per KV head; each part copies the keys again; S is a template parameter: a
// run-time split costs the kernels registers) and
// holds 4 chunks (a warp each) for `group` consecutive rows, one row after the other, and walks the
// position blocks blockIdx.y, + gridDim.y, ... of nb = ceil(max positions / 128) until the rows'
// positions end (a grid of nb blocks there is mostly empty blocks for prompt rows in a long context). Before a warp
// computes, its chunk's keys and values are copied into shared memory with all the copies in flight
// at once (cp.async), so a chunk costs one trip to memory instead of one per ATTN_TILE positions;
// when the group's rows read the same cache through its own slots (a prompt chunk: anc_off < 0),
// the block copies its chunks once, up to the group's last position, for all of them. Dynamic shared
// memory (attention_chunks_shared_bytes): 4 slots of G x (D + 2) floats (the chunks' partials), per
// warp 32 x ATTN_HEADS floats (scores, then probabilities) and 32 slot numbers, and per warp 32 keys
// and 32 values of D float16. work: (rows, n_heads, nb, D + 2) floats, nb = ceil(cap / 128). D (the
// head dimension) is a template parameter so that the loops over a lane's dimensions unroll.
// Queries, keys and values are used from registers: a warp takes ATTN_HEADS query heads at a time
// and ATTN_TILE positions' rows at a time. A row's arithmetic does not depend on the group or on
// where its keys were copied from.
template <int D, int S>
__device__ __forceinline__ bool attn_chunks_body(const float* qkv, int W, int n_heads, int n_kv_heads, float scale,
                                                 int window, int layer, const Rows& R, float* work, int nb,
                                                 int n_rows, int group, int blk) {
    constexpr int DL = D / 32;     // dimensions per lane
    constexpr int PIECES = D / 8;  // 16-byte pieces of a key or value row
    extern __shared__ __align__(16) float attn_smem[];
    const int kvh = blockIdx.x / S;
    const int r_first = blockIdx.z * group, r_end = min(n_rows, r_first + group);
    const int G = n_heads / n_kv_heads / S, h0 = blockIdx.x * G;  // this block's query heads
    const int c0 = blk * ATTN_BLOCK_CHUNKS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned full = 0xffffffffu;
    // the group's last position, and whether its rows share one cache read through its own slots
    int p_max = 0;
    bool shared_rows = true;
    for (int r = r_first; r < r_end; ++r) {
        p_max = max(p_max, R.pos[r]);
        shared_rows = shared_rows && R.anc_off[r] < 0 && R.kptr[r] == R.kptr[r_first] &&
                      R.vptr[r] == R.vptr[r_first] && R.cap[r] == R.cap[r_first];
    }
    if (c0 >= p_max / ATTN_CHUNK + 1) return false;  // the merge reads only the blocks that hold positions
    // nor, for a sliding window, those wholly before the row's window (attn_merge starts after them)
    if (window > 0 && r_end - r_first == 1 && (c0 + ATTN_BLOCK_CHUNKS) * ATTN_CHUNK <= R.pos[r_first] - window + 1)
        return true;
    float* part = attn_smem;  // 4 slots x G x (D + 2)
    float* e_all = part + ATTN_BLOCK_CHUNKS * G * PART_STRIDE(D);  // per warp [t][head]
    int* slots_all = reinterpret_cast<int*>(e_all + ATTN_BLOCK_CHUNKS * ATTN_CHUNK * ATTN_HEADS);
    __half* kv_all = reinterpret_cast<__half*>(slots_all + ATTN_BLOCK_CHUNKS * ATTN_CHUNK);  // 16-byte aligned
    float* e_w = e_all + warp * ATTN_CHUNK * ATTN_HEADS;
    int* slots_w = slots_all + warp * ATTN_CHUNK;
    __half* kst = kv_all + warp * 2 * ATTN_CHUNK * D;  // the chunk's keys, then its values
    __half* vst = kst + ATTN_CHUNK * D;
    const int chunk = c0 + warp, t0 = chunk * ATTN_CHUNK;
    float* mine = part + warp * G * PART_STRIDE(D);
    bool staged = false;
    for (int r = r_first; r < r_end; ++r) {
        const int p = R.pos[r], nchunks = p / ATTN_CHUNK + 1;
        const int lo = window > 0 ? p - window + 1 : 0;  // the first position a sliding window shows
        if (c0 >= nchunks) continue;  // uniform over the block
        if (!staged || !shared_rows) {  // this warp's chunk into shared memory
            staged = true;
            const int upto = shared_rows ? p_max : p;
            // nothing to copy past the last position, nor before the first a row's window shows (a
            // ring's older slots hold later positions); rows sharing one copy take every chunk (a
            // prompt's rows: the copy is made once for all of them)
            const int lo_copy = shared_rows && r_end - r_first > 1 ? 0 : lo;
            const int n_copy = t0 + ATTN_CHUNK <= lo_copy ? 0 : min(ATTN_CHUNK, upto + 1 - t0);
            if (n_copy > 0) {
                const int row_cap = R.cap[r];
                const __half* kg = cache_at(R.kptr[r], layer, n_kv_heads, kvh, row_cap, 0, D);
                const __half* vg = cache_at(R.vptr[r], layer, n_kv_heads, kvh, row_cap, 0, D);
                slots_w[lane] = lane < n_copy ? (int)((unsigned)span_slot(R, r, t0 + lane) % (unsigned)row_cap) : 0;  // position t0 + t's
                __syncwarp();
                for (int i = lane; i < n_copy * PIECES; i += 32) {
                    const int t = i / PIECES, pc = i % PIECES;
                    const long long off = (long long)slots_w[t] * D + pc * 8;
                    cp_async16(kst + t * D + pc * 8, kg + off, true);
                    cp_async16(vst + t * D + pc * 8, vg + off, true);
                }
                cp_async_commit();
                cp_async_wait<0>();
            }
            __syncwarp();
        }
        if (chunk >= nchunks || t0 + ATTN_CHUNK <= lo) {  // empty slot: past the position, or before the window
            for (int g = lane; g < G; g += 32) mine[g * PART_STRIDE(D) + 1] = 0.f;
        } else {
            const __half* kbase = kst + lane * DL;
            const __half* vbase = vst + lane * DL;
            const int n = min(ATTN_CHUNK, p + 1 - t0);
            const float* qrow = qkv + (long long)r * W + (long long)h0 * D + lane * DL;
            for (int g0 = 0; g0 < G; g0 += ATTN_HEADS) {
                // the heads' queries, rounded to float16 as they meet the float16 keys
                float q[ATTN_HEADS][DL];
#pragma unroll
                for (int gg = 0; gg < ATTN_HEADS; ++gg)
#pragma unroll
                    for (int j = 0; j < DL; ++j)
                        q[gg][j] = g0 + gg < G ? __half2float(__float2half_rn(qrow[(g0 + gg) * D + j])) : 0.f;
                // scores, ATTN_TILE positions at a time
                for (int t1 = 0; t1 < n; t1 += ATTN_TILE) {
                    float kf[ATTN_TILE][DL];
#pragma unroll
                    for (int i = 0; i < ATTN_TILE; ++i) {
                        if (t1 + i < n) {
                            load_lane<DL>(kbase + (t1 + i) * D, kf[i]);
                        } else {
#pragma unroll
                            for (int j = 0; j < DL; ++j) kf[i][j] = 0.f;
                        }
                    }
#pragma unroll
                    for (int gg = 0; gg < ATTN_HEADS; ++gg) {
                        if (g0 + gg < G) {
                            float s[ATTN_TILE];
#pragma unroll
                            for (int i = 0; i < ATTN_TILE; ++i) {
                                s[i] = __fmul_rn(q[gg][0], kf[i][0]);
#pragma unroll
                                for (int j = 1; j < DL; ++j) s[i] = __fmaf_rn(q[gg][j], kf[i][j], s[i]);
                            }
                            const float score = attn_reduce8(s, lane);
                            const int t = t1 + (lane >> 2);
                            if ((lane & 3) == 0 && t < n)  // positions before the window weigh nothing
                                e_w[t * ATTN_HEADS + gg] = t0 + t < lo ? NEG_INF : __fmul_rn(score, scale);
                        }
                    }
                }
                __syncwarp();
                // per head: max, exp, sum over the chunk (lane = position)
#pragma unroll
                for (int gg = 0; gg < ATTN_HEADS; ++gg) {
                    if (g0 + gg < G) {
                        const float sc = lane < n ? e_w[lane * ATTN_HEADS + gg] : NEG_INF;
                        float m = sc;
#pragma unroll
                        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(full, m, o));
                        const float e = lane < n ? expf(__fsub_rn(sc, m)) : 0.f;
                        float l = e;
#pragma unroll
                        for (int o = 16; o > 0; o >>= 1) l = __fadd_rn(l, __shfl_xor_sync(full, l, o));
                        if (lane < n) e_w[lane * ATTN_HEADS + gg] = e;
                        if (lane == 0) {
                            mine[(g0 + gg) * PART_STRIDE(D)] = m;
                            mine[(g0 + gg) * PART_STRIDE(D) + 1] = l;
                        }
                    }
                }
                __syncwarp();
                // weighted values: each lane's dimensions, positions in ascending order
                float o[ATTN_HEADS][DL];
#pragma unroll
                for (int gg = 0; gg < ATTN_HEADS; ++gg)
#pragma unroll
                    for (int j = 0; j < DL; ++j) o[gg][j] = 0.f;
                for (int t1 = 0; t1 < n; t1 += ATTN_TILE) {
                    float vf[ATTN_TILE][DL];
#pragma unroll
                    for (int i = 0; i < ATTN_TILE; ++i)
                        if (t1 + i < n) load_lane<DL>(vbase + (t1 + i) * D, vf[i]);
#pragma unroll
                    for (int i = 0; i < ATTN_TILE; ++i) {
                        if (t1 + i < n) {
                            const float4 e = *reinterpret_cast<const float4*>(e_w + (t1 + i) * ATTN_HEADS);
                            const float ev[ATTN_HEADS] = {e.x, e.y, e.z, e.w};
#pragma unroll
                            for (int gg = 0; gg < ATTN_HEADS; ++gg)
#pragma unroll
                                for (int j = 0; j < DL; ++j) o[gg][j] = __fmaf_rn(ev[gg], vf[i][j], o[gg][j]);
                        }
                    }
                }
#pragma unroll
                for (int gg = 0; gg < ATTN_HEADS; ++gg) {
                    if (g0 + gg < G) {
                        float* pg = mine + (g0 + gg) * PART_STRIDE(D) + 2 + lane * DL;
#pragma unroll
                        for (int j = 0; j < DL; ++j) pg[j] = o[gg][j];
                    }
                }
                __syncwarp();  // the chunk's probabilities are read before the next heads' scores
            }
        }
        __syncthreads();
        // the block's 4 slots as the subtree ((0, 1), (2, 3)): merge1's scale factors depend on the
        // head only, so a thread per head works them out once (in e_all, free now) and a thread
        // per (head, element) applies them, operation for operation as merge1 would
        const int ss = G * PART_STRIDE(D);  // between slots
        if (tid < G) {
            const float* s0 = part + tid * PART_STRIDE(D);
            float* cf = e_all + tid * MERGE_COEFFS;
            float m01 = s0[0], l01 = s0[1], m23 = s0[2 * ss], l23 = s0[2 * ss + 1];
            merge_plan(m01, l01, s0[ss], s0[ss + 1], cf);
            merge_plan(m23, l23, s0[3 * ss], s0[3 * ss + 1], cf + 3);
            merge_plan(m01, l01, m23, l23, cf + 6);
            cf[9] = m01;
            cf[10] = l01;
        }
        __syncthreads();
        for (int i = tid; i < G * D; i += ATTN_THREADS) {
            const int g = i / D, d = i % D;
            const float* s0 = part + g * PART_STRIDE(D);
            const float* cf = e_all + g * MERGE_COEFFS;
            const float o01 = merge_apply(cf, s0[2 + d], s0[ss + 2 + d]);
            const float o23 = merge_apply(cf + 3, s0[2 * ss + 2 + d], s0[3 * ss + 2 + d]);
            float* w = work + (((long long)r * n_heads + h0 + g) * nb + blk) * PART_STRIDE(D);
            if (d == 0) {
                w[0] = cf[9];
                w[1] = cf[10];
            }
            w[2 + d] = merge_apply(cf + 6, o01, o23);
        }
        __syncthreads();  // the slots are read before the next row's partials overwrite them
    }
    return true;
}

// BOUNDS: the kernel's __launch_bounds__. The split kernels of head size 64 say a block an SM is
// enough: without it ptxas holds them at 80 registers and spills (8-16 bytes, CUDA 13.0, sm_90);
// with it they take 89-90 and spill nothing. The others keep the bounds they were measured with.
#define ATTN_CHUNKS_BOUNDED(NAME, D, S, BOUNDS)                                                              \
    extern "C" __global__ void BOUNDS                                                                        \
        NAME(const float* qkv, int W, int n_heads, int n_kv_heads, float scale, int window, int layer,       \
             const int* pos, const int* base, const int* anc_off, const int* anc,                             \
             const unsigned long long* kptr, const unsigned long long* vptr, const int* cap, float* work,     \
             int nb, int n_rows, int group) {                                                                 \
        pdl_enter();                                                                                         \
        const Rows R{pos, nullptr, base, anc_off, anc, kptr, vptr, cap};                                     \
        for (int blk = blockIdx.y; blk < nb; blk += gridDim.y)                                               \
            if (!attn_chunks_body<D, S>(qkv, W, n_heads, n_kv_heads, scale, window, layer, R, work, nb,       \
                                        n_rows, group, blk))                                                 \
                break;                                                                                       \
    }
#define ATTN_CHUNKS(NAME, D, S) ATTN_CHUNKS_BOUNDED(NAME, D, S, __launch_bounds__(ATTN_THREADS))
#define ATTN_CHUNKS_ONE_BLOCK(NAME, D, S) ATTN_CHUNKS_BOUNDED(NAME, D, S, __launch_bounds__(ATTN_THREADS, 1))
ATTN_CHUNKS(attn_chunks_d64, 64, 1)
ATTN_CHUNKS(attn_chunks_d128, 128, 1)
ATTN_CHUNKS(attn_chunks_d256, 256, 1)
ATTN_CHUNKS_ONE_BLOCK(attn_chunks_s2_d64, 64, 2)
ATTN_CHUNKS_ONE_BLOCK(attn_chunks_s4_d64, 64, 4)
ATTN_CHUNKS_ONE_BLOCK(attn_chunks_s7_d64, 64, 7)
ATTN_CHUNKS_ONE_BLOCK(attn_chunks_s8_d64, 64, 8)
ATTN_CHUNKS(attn_chunks_s2_d128, 128, 2)
ATTN_CHUNKS(attn_chunks_s3_d128, 128, 3)
ATTN_CHUNKS(attn_chunks_s4_d128, 128, 4)
ATTN_CHUNKS(attn_chunks_s6_d128, 128, 6)
ATTN_CHUNKS(attn_chunks_s7_d128, 128, 7)
ATTN_CHUNKS(attn_chunks_s8_d128, 128, 8)
ATTN_CHUNKS(attn_chunks_s2_d256, 256, 2)
ATTN_CHUNKS(attn_chunks_s4_d256, 256, 4)
ATTN_CHUNKS(attn_chunks_s8_d256, 256, 8)

// grid (rows, n / chunk), `chunk` threads (256, or 32 where a row is no whole 256): out (rows,
// n_heads*D) = the merged attention, a thread per value, then the block's values rounded to `fmt`
// (whole 8-bit groups: a q8_k group is 256 values, q8_0's 32), with the 8-bit form when xq is given.
// The blocks' partials are merged as the complete binary tree over their indexes: a stack of
// subtrees, left to right, joined right to left at the end.
#define MERGE_MAX_LEVELS 16
extern "C" __global__ void __launch_bounds__(256)
    attn_merge(const float* work, int nb, int n_heads, int D, const int* pos, int window, float* out, __half* out16,
               int fmt, signed char* xq, float* xs, int* xsum) {
    pdl_enter();
    const int r = blockIdx.x, chunk = blockDim.x;
    // the blocks from the first that holds a position of the row's window to the one of its position
    const int b0 = window > 0 ? max(0, pos[r] - window + 1) / (ATTN_CHUNK * ATTN_BLOCK_CHUNKS) : 0;
    const int nblk = (pos[r] / ATTN_CHUNK) / ATTN_BLOCK_CHUNKS + 1 - b0;
    const int n = n_heads * D;
    float* orow = out + (long long)r * n;
    const int i = blockIdx.y * chunk + threadIdx.x;
    const int h = i / D, d = i % D;
    const float* w = work + (((long long)r * n_heads + h) * nb + b0) * PART_STRIDE(D);
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
    if (out16) out16[(long long)r * n + i] = __float2half_rn(value);  // before rounding: the prompt products' input
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
