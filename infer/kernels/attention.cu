// Rotary embedding with the KV-cache store, and decode attention over the float16 cache (GQA, split
// over the sequence or one block per KV head for short caches). Positions and lengths are read from
// device memory so that one captured CUDA graph serves every decode step.
#include "formats.cuh"
#include "act.cuh"

#ifndef ATTN_CHUNK
#define ATTN_CHUNK 64  // cache positions per attention split (the loader sets it)
#endif
#ifndef ATTN_MAX_GROUP
#define ATTN_MAX_GROUP 16  // query heads per KV head
#endif
#ifndef ATTN_MAX_HEAD_DIM
#define ATTN_MAX_HEAD_DIM 256
#endif
#define ATTN_THREADS 128

// (a, b) rotated by the angle with cosine c and sine s, rounded as NumPy computes a*c - b*s and
// a*s + b*c (no fused multiply-add), so the float16 keys match the CPU engine's
__device__ __forceinline__ void rotate(float a, float b, float c, float s, float& ra, float& rb) {
    ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// Rotary embedding of q (in place) and k, then k and v stored into the cache at their positions, or
// at slot[t] when slot is given (a token tree: its nodes' positions repeat, their slots do not).
// grid (T, n_heads + n_kv_heads). q: (T, n_heads, D); k, v: (T, n_kv_heads, D) float32;
// cos/sin tables: (max_ctx, n_pairs); caches: (n_kv_heads, max_ctx, D) float16.
// Pair i is (2i, 2i+1) for Llama (GGUF permutes Q/K so pairs are adjacent), (i, i + n_pairs) for NeoX.
extern "C" __global__ void rope_store(float* q, const float* k, const float* v, const float* cos_t,
                                      const float* sin_t, const int* pos, const int* slot, int n_heads,
                                      int n_kv_heads, int D, int n_pairs, int neox, __half* kc, __half* vc,
                                      int max_ctx) {
    const int t = blockIdx.x, h = blockIdx.y;
    const int p = pos[t], at = slot ? slot[t] : p;
    const float* c = cos_t + (long long)p * n_pairs;
    const float* s = sin_t + (long long)p * n_pairs;
    const bool is_q = h < n_heads;
    const int kh = h - n_heads;
    const float* src = is_q ? q + ((long long)t * n_heads + h) * D : k + ((long long)t * n_kv_heads + kh) * D;
    __half* kdst = is_q ? nullptr : kc + ((long long)kh * max_ctx + at) * D;
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + n_pairs : 2 * i + 1;
        float ra, rb;
        rotate(src[ia], src[ib], c[i], s[i], ra, rb);
        if (is_q) {
            float* dst = q + ((long long)t * n_heads + h) * D;
            dst[ia] = ra;
            dst[ib] = rb;
        } else {
            kdst[ia] = __float2half_rn(ra);
            kdst[ib] = __float2half_rn(rb);
        }
    }
    if (is_q) return;
    for (int d = 2 * n_pairs + threadIdx.x; d < D; d += blockDim.x) kdst[d] = __float2half_rn(src[d]);
    const float* vs = v + ((long long)t * n_kv_heads + kh) * D;
    __half* vdst = vc + ((long long)kh * max_ctx + at) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) vdst[d] = __float2half_rn(vs[d]);
}

// Decode attention in three steps, each grid (KV head, split of ATTN_CHUNK positions) with the G query
// heads that share a KV head handled together (each cached key and value is read once per group):
//   attention_scores: s = q.k * scale for the split's positions -> scores, and the split's max and
//                     sum of exp -> part_ml;
//   attention_values: global max M and sum L from all splits, p = f16(exp(s - M) / L) (normalised and
//                     rounded to float16 as llama.cpp and the CPU engine do), partial sum of p * v;
//   attention_sum:    out = sum of the splits' partials.
// Dot products, sums of exponentials and the weighted sum of values are kept in double (the float16
// products are exact there) and exponentials taken in double, so scores and probabilities round to
// the same float32/float16 values as the CPU engine's float64 attention; part_ml holds (max, sum)
// and part_o the partial outputs, both double.
// kv_len = pos[0] + 1. q: (n_heads, D) float32, head h uses KV head h / G; q is rounded to float16
// first, as llama.cpp multiplies it with the float16 cache. scores: (n_heads, max_ctx).
// With `rope` (decode): q, and the new token's k and v (float32, not yet rotated or stored) are
// taken raw; each block rotates its group's queries, and the block whose split holds position
// pos[0] rotates k and stores k and v into the cache before reading it (no other block reads that
// position), which saves the separate rope_store launch.
struct RopeArgs {
    const float* k;
    const float* v;
    const float* cos_t;
    const float* sin_t;
    int n_pairs;
    int neox;
    __half* vc;
};

// Where position t of a query's attention span lives in the cache. Decode: slot t. A token tree
// (grid z = node): the node attends to positions 0..pos[node]; those below `base` are the cache's
// own slots, the rest are its ancestors' slots, root first, then itself (anc: one row per node). A
// node thus sums over the same values in the same order as the decode step at its position would:
// the same numbers, whatever slots its ancestors took.
struct SlotMap {
    const int* anc;  // this node's row, or null (decode)
    int base;

    __device__ __forceinline__ int slot(int t) const { return (anc && t >= base) ? anc[t - base] : t; }
};

// A node's row starts with the root's slot, which is the cache's length when the tree was laid out:
// the base comes from device memory, so a captured CUDA graph serves any cache length.
__device__ __forceinline__ SlotMap node_map(const int* anc, int anc_stride, int node) {
    const int* row = anc ? anc + (long long)node * anc_stride : nullptr;
    return SlotMap{row, row ? row[0] : 0};
}

// The G queries of KV head kvh (heads h0 = kvh*G ..) into q_s as double: rotated when `rope` carries
// the new token's raw k and v, and then, if `store`, k rotated and k and v stored into the cache at
// position p (the caller's block is the only one reading that position); finally rounded to
// float16, as llama.cpp multiplies the query with the float16 cache. Ends with a barrier.
__device__ void group_queries(const float* q, double* q_s, __half* kc, int kvh, int G, int D, int p, int max_ctx,
                              RopeArgs rope, bool store, int nthreads) {
    const int tid = threadIdx.x;
    for (int i = tid; i < G * D; i += nthreads) q_s[i] = q[(long long)kvh * G * D + i];
    if (rope.k) {
        const float* c = rope.cos_t + (long long)p * rope.n_pairs;
        const float* sn = rope.sin_t + (long long)p * rope.n_pairs;
        __syncthreads();
        for (int i = tid; i < G * rope.n_pairs; i += nthreads) {
            const int g = i / rope.n_pairs, j = i % rope.n_pairs;
            const int ia = rope.neox ? j : 2 * j, ib = rope.neox ? j + rope.n_pairs : 2 * j + 1;
            float ra, rb;
            rotate((float)q_s[g * D + ia], (float)q_s[g * D + ib], c[j], sn[j], ra, rb);
            q_s[g * D + ia] = ra;
            q_s[g * D + ib] = rb;
        }
        if (store) {
            const float* kn = rope.k + (long long)kvh * D;
            __half* kd = kc + ((long long)kvh * max_ctx + p) * D;
            for (int j = tid; j < rope.n_pairs; j += nthreads) {
                const int ia = rope.neox ? j : 2 * j, ib = rope.neox ? j + rope.n_pairs : 2 * j + 1;
                float ra, rb;
                rotate(kn[ia], kn[ib], c[j], sn[j], ra, rb);
                kd[ia] = __float2half_rn(ra);
                kd[ib] = __float2half_rn(rb);
            }
            for (int d = 2 * rope.n_pairs + tid; d < D; d += nthreads) kd[d] = __float2half_rn(kn[d]);
            __half* vd = rope.vc + ((long long)kvh * max_ctx + p) * D;
            for (int d = tid; d < D; d += nthreads) vd[d] = __float2half_rn(rope.v[(long long)kvh * D + d]);
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += nthreads) q_s[i] = __half2float(__float2half_rn((float)q_s[i]));
    __syncthreads();
}

// q.k of one cached key (D float16 values) with the G queries in q_s (double, float16 values):
// this thread takes every TPP-th 16-byte piece from `piece` (the key's values converted once for
// the group, products exact in double), then the TPP neighbouring threads add their sums by
// shuffles; every lane of the warp must call it, `active` says whether this one has a key.
template <int MAXG, int TPP>
__device__ __forceinline__ void key_dots(const __half* key, const double* q_s, int G, int D, int piece, bool active,
                                         double* acc) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) acc[g] = 0.0;
    if (active) {
        const uint4* krow = reinterpret_cast<const uint4*>(key);
#pragma unroll 8
        for (int c = piece; c < D / 8; c += TPP) {
            const uint4 raw = krow[c];
            const __half2* kh = reinterpret_cast<const __half2*>(&raw);
            double kf[8];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __half22float2(kh[e]);
                kf[2 * e] = f.x;
                kf[2 * e + 1] = f.y;
            }
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g < G) {
                    const double2* qd = reinterpret_cast<const double2*>(q_s + g * D + 8 * c);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const double2 qq = qd[e];
                        acc[g] = fma(qq.x, kf[2 * e], acc[g]);
                        acc[g] = fma(qq.y, kf[2 * e + 1], acc[g]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int o = 1; o < TPP; o <<= 1) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], o);
    }
}

// sum over positions t = ph, ph + phases, .. < n of p[g][t] * v[t] for one pair of dimensions (vb:
// its half2 in position 0, `pairs` half2 per position) and the G heads (p: p_stride doubles per
// head, float16 values); each value converted once for the group, products exact in double
template <int MAXG>
__device__ __forceinline__ void value_sums(const __half2* vb, int pairs, const double* p, int p_stride, int G, int n,
                                           int ph, int phases, double2* acc, SlotMap map, int start) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) acc[g] = make_double2(0.0, 0.0);
    if (ph >= phases) return;
#pragma unroll 8
    for (int t = ph; t < n; t += phases) {
        const float2 vv = __half22float2(vb[(long long)map.slot(start + t) * pairs]);
        const double vx = vv.x, vy = vv.y;
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g < G) {
                const double pr = p[g * p_stride + t];
                acc[g].x = fma(pr, vx, acc[g].x);
                acc[g].y = fma(pr, vy, acc[g].y);
            }
        }
    }
}

template <int MAXG>
__device__ __forceinline__ void attention_scores(const float* q, __half* kc, const int* pos, int G, int D,
                                                 int max_ctx, float scale, int n_splits, float* scores,
                                                 double* part_ml, RopeArgs rope, SlotMap map) {
    // the group's queries: float32 values through the rotation, then float16 values, held as double
    __shared__ __align__(16) double q_s[ATTN_MAX_GROUP * ATTN_MAX_HEAD_DIM];
    __shared__ float p_s[ATTN_MAX_GROUP * ATTN_CHUNK];
    const int kvh = blockIdx.x, split = blockIdx.y, tid = threadIdx.x;
    const int p = pos[0];
    const int start = split * ATTN_CHUNK;
    const int n = min(ATTN_CHUNK, p + 1 - start);
    const int h0 = kvh * G;
    if (n <= 0) {
        if (tid < G) {
            part_ml[((h0 + tid) * n_splits + split) * 2] = NEG_INF;
            part_ml[((h0 + tid) * n_splits + split) * 2 + 1] = 0.0;
        }
        return;
    }
    group_queries(q, q_s, kc, kvh, G, D, p, max_ctx, rope, split == p / ATTN_CHUNK, ATTN_THREADS);
    const __half* khead = kc + (long long)kvh * max_ctx * D;
    // TPP neighbouring threads share a position, each taking every TPP-th 16-byte piece of its key
    // (all threads busy, and a thread's loads are few enough to be in flight together), then add
    // their partial dot products by shuffles.
    constexpr int TPP = ATTN_THREADS / ATTN_CHUNK;
    static_assert(TPP >= 1 && TPP <= 32 && (TPP & (TPP - 1)) == 0, "ATTN_CHUNK: a power of two up to ATTN_THREADS");
    const int t = tid / TPP, piece = tid % TPP;
    double acc[MAXG];
    key_dots<MAXG, TPP>(khead + (long long)(t < n ? map.slot(start + t) : 0) * D, q_s, G, D, piece, t < n, acc);
    if (t < n && piece == 0) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g < G) {
                const float sc = (float)acc[g] * scale;
                p_s[g * ATTN_CHUNK + t] = sc;
                scores[(long long)(h0 + g) * max_ctx + start + t] = sc;
            }
        }
    }
    __syncthreads();
    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < G; g += ATTN_THREADS / 32) {
        float m = NEG_INF;
        for (int t = lane; t < n; t += 32) m = fmaxf(m, p_s[g * ATTN_CHUNK + t]);
        m = warp_max(m);
        double l = 0.0;
        for (int t = lane; t < n; t += 32) l += exp((double)p_s[g * ATTN_CHUNK + t] - (double)m);
        l = warp_sum(l);
        if (lane == 0) {
            part_ml[((h0 + g) * n_splits + split) * 2] = m;
            part_ml[((h0 + g) * n_splits + split) * 2 + 1] = l;
        }
    }
}

template <int MAXG>
__device__ __forceinline__ void attention_values(const __half* vc, const int* pos, int G, int D, int max_ctx,
                                                 int n_splits, const float* scores, const double* part_ml,
                                                 double* part_o, SlotMap map) {
    __shared__ double p_s[ATTN_MAX_GROUP * ATTN_CHUNK];
    __shared__ double M_s[ATTN_MAX_GROUP], L_s[ATTN_MAX_GROUP];
    const int kvh = blockIdx.x, split = blockIdx.y, tid = threadIdx.x;
    const int start = split * ATTN_CHUNK;
    const int n = min(ATTN_CHUNK, pos[0] + 1 - start);
    const int h0 = kvh * G;
    if (n <= 0) {
        for (int i = tid; i < G * D; i += ATTN_THREADS)
            part_o[((long long)(h0 + i / D) * n_splits + split) * D + i % D] = 0.0;
        return;
    }
    if (tid < G) {  // the global max and sum over all splits of this head
        const double* ml = part_ml + (long long)(h0 + tid) * n_splits * 2;
        double M = -INFINITY;
        for (int s = 0; s < n_splits; ++s) M = fmax(M, ml[2 * s]);
        double L = 0.0;
        for (int s = 0; s < n_splits; ++s)
            if (ml[2 * s + 1] > 0.0) L += ml[2 * s + 1] * exp(ml[2 * s] - M);
        M_s[tid] = M;
        L_s[tid] = L;
    }
    __syncthreads();
    for (int i = tid; i < G * n; i += ATTN_THREADS) {
        const int g = i / n, t = i % n;
        const float e = (float)(exp((double)scores[(long long)(h0 + g) * max_ctx + start + t] - M_s[g]) / L_s[g]);
        p_s[g * ATTN_CHUNK + t] = __half2float(__float2half_rn(e));
    }
    __syncthreads();
    const __half* vhead = vc + (long long)kvh * max_ctx * D;
    // thread = (pair of dimensions, phase): the `phases` threads of a pair take every phases-th
    // position (half2 loads, a short chain of dependent loads per thread); phase 0 adds the others'
    // sums from shared memory in phase order (deterministic).
    __shared__ __align__(16) double2 o_s[ATTN_THREADS * MAXG];
    const int pairs = D / 2, phases = ATTN_THREADS / pairs;
    const int dp = tid % pairs, ph = tid / pairs;
    double2 acc[MAXG];
    value_sums<MAXG>(reinterpret_cast<const __half2*>(vhead) + dp, pairs, p_s, ATTN_CHUNK, G, n, ph, phases, acc, map,
                     start);
    if (ph < phases) {
        if (ph > 0) {
#pragma unroll
            for (int g = 0; g < MAXG; ++g)
                if (g < G) o_s[((ph - 1) * MAXG + g) * pairs + dp] = acc[g];
        }
    }
    __syncthreads();
    if (ph == 0) {
        for (int q = 1; q < phases; ++q) {
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g < G) {
                    const double2 o = o_s[((q - 1) * MAXG + g) * pairs + dp];
                    acc[g].x += o.x;
                    acc[g].y += o.y;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
            if (g < G)
                reinterpret_cast<double2*>(part_o + ((long long)(h0 + g) * n_splits + split) * D)[dp] = acc[g];
    }
}


// Short caches: the whole decode attention of a KV head in one block (grid: n_kv_heads, 256
// threads): the group's queries and the new key and value as above, the scores of every position,
// their softmax, the weighted values, and the output rounded to `fmt` (its G*D values are whole
// 8-bit groups). One launch instead of three; the same numbers as the split kernels (sums in
// double, probabilities normalised with the global max and sum before their float16 rounding).
// Dynamic shared memory: G*D + G*max_ctx doubles (ops.attention_fused_fits).
#define ATTN_FUSED_THREADS 256
template <int MAXG>
__device__ __forceinline__ void attention_fused(const float* q, __half* kc, __half* vc, const int* pos, int G, int D,
                                                int max_ctx, float scale, float* out, int fmt, signed char* xq,
                                                float* xs, int* xsum, RopeArgs rope, SlotMap map) {
    extern __shared__ double fused_smem[];
    double* q_s = fused_smem;          // G*D
    double* p_s = fused_smem + G * D;  // G rows of max_ctx: scores, then probabilities
    __shared__ double M_s[ATTN_MAX_GROUP], L_s[ATTN_MAX_GROUP];
    const int kvh = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int p = pos[0], n = p + 1, h0 = kvh * G;
    group_queries(q, q_s, kc, kvh, G, D, p, max_ctx, rope, true, ATTN_FUSED_THREADS);
    // scores: TPP threads per position, each every TPP-th 16-byte piece of the key; the key's
    // float16 values are converted once for the whole group
    constexpr int TPP = 4;
    const int tl = tid / TPP, piece = tid % TPP;
    const __half* kbase = kc + (long long)kvh * max_ctx * D;
    for (int t0 = 0; t0 < n; t0 += ATTN_FUSED_THREADS / TPP) {
        const int t = t0 + tl;
        double acc[MAXG];
        key_dots<MAXG, TPP>(kbase + (long long)(t < n ? map.slot(t) : 0) * D, q_s, G, D, piece, t < n, acc);
        if (t < n && piece == 0) {
#pragma unroll
            for (int g = 0; g < MAXG; ++g)
                if (g < G) p_s[g * max_ctx + t] = (double)((float)acc[g] * scale);
        }
    }
    __syncthreads();
    for (int g = warp; g < G; g += ATTN_FUSED_THREADS / 32) {  // max and sum of exp per head
        double m = -INFINITY;
        for (int t = lane; t < n; t += 32) m = fmax(m, p_s[g * max_ctx + t]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
        double l = 0.0;
        for (int t = lane; t < n; t += 32) l += exp(p_s[g * max_ctx + t] - m);
        l = warp_sum(l);
        if (lane == 0) {
            M_s[g] = m;
            L_s[g] = l;
        }
    }
    __syncthreads();
    for (int i = tid; i < G * n; i += ATTN_FUSED_THREADS) {
        const int g = i / n, t = i % n;
        double* e = p_s + g * max_ctx + t;
        *e = __half2float(__float2half_rn((float)(exp(*e - M_s[g]) / L_s[g])));
    }
    __syncthreads();
    // weighted values: a thread per dimension pair (all G heads: each value converted once), the
    // positions split between the threads of a pair when there are more threads than pairs
    const int pairs = D / 2, phases = ATTN_FUSED_THREADS / pairs;
    const int dp = tid % pairs, ph = tid / pairs;
    const __half2* vb = reinterpret_cast<const __half2*>(vc + (long long)kvh * max_ctx * D) + dp;
    double2 acc[MAXG];
    value_sums<MAXG>(vb, pairs, p_s, max_ctx, G, n, ph, phases, acc, map, 0);
    __syncthreads();  // the probabilities are read: their space takes the phases' partial sums
    double2* o_s = reinterpret_cast<double2*>(p_s);  // (phases - 1) * G * pairs: fits (attention_fused_fits)
    if (ph > 0 && ph < phases) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
            if (g < G) o_s[((ph - 1) * G + g) * pairs + dp] = acc[g];
    }
    __syncthreads();
    float* ob = out + (long long)h0 * D;
    if (ph == 0) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g < G) {
                double2 o = acc[g];
                for (int r = 1; r < phases; ++r) {
                    const double2 other = o_s[((r - 1) * G + g) * pairs + dp];
                    o.x += other.x;
                    o.y += other.y;
                }
                reinterpret_cast<float2*>(ob + g * D)[dp] =
                    make_float2(round_float((float)o.x, fmt), round_float((float)o.y, fmt));
            }
        }
    }
    if (fmt == ACT_Q8_0 || fmt == ACT_Q8_K) {
        __syncthreads();  // the block's G*D outputs are written: round them by 8-bit groups
        const int group = fmt == ACT_Q8_0 ? 32 : 256;
        const long long first = (long long)h0 * D;
        const Int8Out o8 = xq ? Int8Out{xq + first, xs + first / group, xsum + first / 32}
                              : Int8Out{nullptr, nullptr, nullptr};
        round_groups_8bit(ob, ob, nullptr, G * D, fmt, o8, warp, ATTN_FUSED_THREADS / 32);
    }
}

// instantiations by group size (query heads per KV head): the smallest that holds G. Grid z = node
// of a token tree (1 for decode): its query, position, work buffers and output are the node-th of
// each; anc/anc_stride its attention span's slots (SlotMap; null anc: decode).
#define NODE_OFFSETS                                                                                           \
    const long long node = blockIdx.z, nh = (long long)G * gridDim.x;                                         \
    const SlotMap map = node_map(anc, anc_stride, (int)node);
// the 16-head group's scores kernel with the span map spilled under ptxas's own register choice;
// asking for 4 blocks per SM (its occupancy before) gives it the registers; the others are unchanged
#define ATTN_SCORES_BOUNDS_4 __launch_bounds__(ATTN_THREADS)
#define ATTN_SCORES_BOUNDS_8 __launch_bounds__(ATTN_THREADS)
#define ATTN_SCORES_BOUNDS_16 __launch_bounds__(ATTN_THREADS, 4)
#define ATTENTION_DECODE(MAXG)                                                                                 \
    extern "C" __global__ void ATTN_SCORES_BOUNDS_##MAXG                                                      \
        attention_scores_g##MAXG(const float* q, __half* kc, const int* pos, int G, int D, int max_ctx,        \
                                 float scale, int n_splits, float* scores, double* part_ml, const float* k_new, \
                                 const float* v_new, const float* cos_t, const float* sin_t, int n_pairs,      \
                                 int neox, __half* vc, const int* anc, int anc_stride) {                       \
        NODE_OFFSETS                                                                                           \
        attention_scores<MAXG>(q + node * nh * D, kc, pos + node, G, D, max_ctx, scale, n_splits,             \
                               scores + node * nh * max_ctx, part_ml + node * nh * n_splits * 2,              \
                               RopeArgs{k_new, v_new, cos_t, sin_t, n_pairs, neox, vc}, map);                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1)                                              \
        attention_values_g##MAXG(const __half* vc, const int* pos, int G, int D, int max_ctx, int n_splits,    \
                                 const float* scores, const double* part_ml, double* part_o, const int* anc,   \
                                 int anc_stride) {                                                             \
        NODE_OFFSETS                                                                                           \
        attention_values<MAXG>(vc, pos + node, G, D, max_ctx, n_splits, scores + node * nh * max_ctx,         \
                               part_ml + node * nh * n_splits * 2, part_o + node * nh * n_splits * D, map);   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_FUSED_THREADS, 1)                                        \
        attention_fused_g##MAXG(const float* q, __half* kc, __half* vc, const int* pos, int G, int D,           \
                                int max_ctx, float scale, float* out, int fmt, signed char* xq, float* xs,       \
                                int* xsum, const float* k_new, const float* v_new, const float* cos_t,          \
                                const float* sin_t, int n_pairs, int neox, const int* anc, int anc_stride) {    \
        NODE_OFFSETS                                                                                           \
        const Int8Out o8 = int8_row(xq, xs, xsum, node, (int)(nh * D), fmt);                                  \
        attention_fused<MAXG>(q + node * nh * D, kc, vc, pos + node, G, D, max_ctx, scale, out + node * nh * D, \
                              fmt, o8.xq, o8.xs, o8.xsum, RopeArgs{k_new, v_new, cos_t, sin_t, n_pairs, neox, vc}, \
                              map);                                                                            \
    }
ATTENTION_DECODE(4)
ATTENTION_DECODE(8)
ATTENTION_DECODE(16)

// out (n_heads * D) = sum over the splits holding positions 0..pos[0] of their partial outputs (in
// split order: deterministic), then rounded to activation format `fmt` for the output projection.
// Spread over blocks of 256 threads: for q8_0/q8_k a warp sums one 8-bit group's values, then rounds
// that group (one block of 1024 threads for the whole vector was a serial tail per layer, docs/GPU.md).
extern "C" __global__ void __launch_bounds__(256, 1)  // (, 1): ptxas otherwise caps it at 32 registers and spills
    attention_sum(const double* part_o, const int* pos, int n_splits, int n, int D, float* out, int fmt,
                  signed char* xq, float* xs, int* xsum) {
    const long long node = blockIdx.y;  // a token tree's node (0 for decode): its partials, position and output
    part_o += node * n_splits * n;
    out += node * n;
    if (xq) {
        const Int8Out o8 = int8_row(xq, xs, xsum, node, n, fmt);
        xq = o8.xq;
        xs = o8.xs;
        xsum = o8.xsum;
    }
    const int active = min(n_splits, pos[node] / ATTN_CHUNK + 1);
    if (fmt == ACT_F32 || fmt == ACT_F16 || fmt == ACT_BF16) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const int h = i / D, d = i % D;
            double sum = 0.0;
            for (int s = 0; s < active; ++s) sum += part_o[((long long)h * n_splits + s) * D + d];
            out[i] = round_float((float)sum, fmt);
        }
        return;
    }
    const int group = fmt == ACT_Q8_0 ? 32 : 256, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int first = blockIdx.x * warps + (threadIdx.x >> 5), stride = gridDim.x * warps;
    for (int g = first; g < n / group; g += stride) {  // this warp's groups, summed before rounding
        for (int i = g * group + lane; i < (g + 1) * group; i += 32) {
            const int h = i / D, d = i % D;
            double sum = 0.0;
            for (int s = 0; s < active; ++s) sum += part_o[((long long)h * n_splits + s) * D + d];
            out[i] = (float)sum;
        }
    }
    __syncwarp();  // the warp rounds the groups it wrote: its lanes read each other's sums
    const Int8Out o8 = int8_row(xq, xs, xsum, 0, n, fmt);
    round_groups_8bit(out, out, nullptr, n, fmt, o8, first, stride);
}

