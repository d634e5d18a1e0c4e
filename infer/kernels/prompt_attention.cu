// Attention of the prompt rows of a pass (prompt tokens whose logits nobody reads; docs/GPU.md
// "Prompt rows") on the tensor cores, flash-attention style: their float16 output is the input of
// the prompt products (pmm.cu). The canonical rows keep attention.cu.
//
//   attn_prompt_d<D>  grid (KV heads, tiles of 16 prompt rows), a warp per query head of the KV
//                     head's group. The block loads each tile of KEYS positions of a sequence's
//                     keys and values into shared memory once for its heads; a warp computes the
//                     scores of its 16 rows (mma.sync m16n8k16: float16 query x keys, float32
//                     sums), their running max and sum, and adds the probabilities (rounded to
//                     float16) times the values to its float32 outputs (mma.sync again).
//
// A row's result does not depend on the other rows of the pass: the tiles of keys start at 0 and
// go up in steps of KEYS whatever the rows beside it; a tile past the row's position holds only
// masked keys, whose probabilities are exact zeros and leave its max, sum and outputs as they
// were (times exp2(0) = 1). Rows of another sequence in the same tile of 16 are done in another
// round over their own keys (a tile of 16 rows holds one prompt chunk's rows, except where chunks
// of two sequences meet). Prompt rows span their sequence's own slots 0..pos (no tree spans).
//
//   attn_prompt_window_d<D>  the same for a local (sliding-window) layer: a row sees pos - window +
//                     1 .. pos. A round's tiles start at the tile of its rows' earliest window start;
//                     a tile before a row's own window is all masked for it, which leaves its max,
//                     sum and outputs as they were (-inf, 0, 0), so its bits again do not depend on
//                     the rows beside it. Slot s lies at s % cap (the layer's cache is a ring,
//                     infer/gpu/cache.py). A kernel of its own: the window's registers stay out of
//                     the global layers' kernel.
#include "formats.cuh"
#include "async.cuh"

#define AP_ROWS 16  // prompt rows per block (the mma's M)

// the fields of the pass's rows that the kernel reads, offset to the first prompt row
struct PromptRows {
    const int* pos;
    const unsigned long long* kptr;
    const unsigned long long* vptr;
    const int* cap;
};

__device__ __forceinline__ void ap_ldsm_x4(uint32_t (&r)[4], const __half* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void ap_ldsm_x4_trans(uint32_t (&r)[4], const __half* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void ap_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t ap_pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

#define AP_LOG2E 1.4426950408889634f

template <int D, bool WINDOW>
__device__ __forceinline__ void attn_prompt_body(const float* qkv, int W, int n_heads, int n_kv_heads, float scale,
                                                 int window, int layer, const PromptRows R, int n_rows,
                                                 __half* out16) {
    constexpr int KEYS = 64;         // keys per tile
    constexpr int PITCH = D + 8;     // halves per key row in shared memory (+16 bytes: ldmatrix hits 32 banks)
    constexpr int NT = KEYS / 8;     // 8-key tiles of the scores
    constexpr int DK = D / 16;       // 16-value steps of a score
    constexpr int DT = D / 8;        // 8-value tiles of the output
    extern __shared__ __align__(16) unsigned char ap_smem[];
    __half* ks = reinterpret_cast<__half*>(ap_smem);  // [KEYS][PITCH]
    __half* vs = ks + KEYS * PITCH;
    const int kvh = blockIdx.x, t0 = blockIdx.y * AP_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int group = n_heads / n_kv_heads, h = kvh * group + warp;
    const int nthreads = blockDim.x;
    unsigned done = 0u;  // bit i: row t0 + i is done (or past the rows)
    for (int i = 0; i < AP_ROWS; ++i)
        if (t0 + i >= n_rows) done |= 1u << i;
    while (done != 0xFFFFu) {
        // one round: the rows of the first row's sequence
        const int lead = __ffs(~done) - 1;
        const unsigned long long kp = R.kptr[t0 + lead], vp = R.vptr[t0 + lead];
        const int cap = R.cap[t0 + lead];
        unsigned active = 0u;
        int pmax = 0;
        for (int i = 0; i < AP_ROWS; ++i)
            if (!((done >> i) & 1u) && R.kptr[t0 + i] == kp) {
                active |= 1u << i;
                pmax = max(pmax, R.pos[t0 + i]);
            }
        const bool act0 = (active >> g) & 1u, act1 = (active >> (g + 8)) & 1u;
        const int p0 = act0 ? R.pos[t0 + g] : -1, p1 = act1 ? R.pos[t0 + g + 8] : -1;
        // the query fragments of this warp's head, rows g and g + 8, rounded to float16
        uint32_t qa[DK][4];
        {
            const float* q0 = qkv + (long long)(t0 + g) * W + h * D;
            const float* q1 = qkv + (long long)(t0 + g + 8) * W + h * D;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk) {
                const int d = kk * 16 + 2 * c;
                qa[kk][0] = act0 ? ap_pack(q0[d], q0[d + 1]) : 0u;
                qa[kk][1] = act1 ? ap_pack(q1[d], q1[d + 1]) : 0u;
                qa[kk][2] = act0 ? ap_pack(q0[d + 8], q0[d + 9]) : 0u;
                qa[kk][3] = act1 ? ap_pack(q1[d + 8], q1[d + 9]) : 0u;
            }
        }
        float o[DT][4];
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
        float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
        const __half* kg = reinterpret_cast<const __half*>(kp) + ((long long)layer * n_kv_heads + kvh) * cap * D;
        const __half* vg = reinterpret_cast<const __half*>(vp) + ((long long)layer * n_kv_heads + kvh) * cap * D;
        const int ntiles = pmax / KEYS + 1;
        int kt0 = 0;  // the round's first tile: the earliest key any of its rows sees
        if (WINDOW) {
            int lo = pmax;
            for (int i = 0; i < AP_ROWS; ++i)
                if ((active >> i) & 1u) lo = min(lo, R.pos[t0 + i] - window + 1);
            kt0 = max(lo, 0) / KEYS;
        }
        for (int kt = kt0; kt < ntiles; ++kt) {
            __syncthreads();  // the previous tile is read by every warp
            for (int i = threadIdx.x; i < KEYS * (D / 8); i += nthreads) {  // 16-byte pieces of keys and values
                const int key = i / (D / 8), piece = i % (D / 8), slot = kt * KEYS + key;
                // slots past the round's rows: zeros, never stale values (a masked key's 0 x inf would be
                // NaN); a ring's slot s at s % cap
                const bool valid = slot <= pmax && (WINDOW || slot < cap);
                const int at = WINDOW ? (int)((unsigned)slot % (unsigned)cap) : slot;
                const long long off = (long long)(valid ? at : 0) * D + piece * 8;
                cp_async16(ks + key * PITCH + piece * 8, kg + off, valid);
                cp_async16(vs + key * PITCH + piece * 8, vg + off, valid);
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            // scores: 16 rows x KEYS keys
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk)
#pragma unroll
                for (int n2 = 0; n2 < NT / 2; ++n2) {
                    uint32_t b[4];  // keys 16 n2 .. +15 (two 8-key tiles), values kk*16 .. +15
                    ap_ldsm_x4(b, ks + (n2 * 16 + (lane >> 4) * 8 + (lane & 7)) * PITCH + kk * 16 + ((lane >> 3) & 1) * 8);
                    ap_mma(s[2 * n2], qa[kk], b[0], b[1]);
                    ap_mma(s[2 * n2 + 1], qa[kk], b[2], b[3]);
                }
            // scale and mask (key > the row's position, or an inactive row), the rows' max
            float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kt * KEYS + nt * 8 + 2 * c + (e & 1), r = e >> 1;
                    const int p = r ? p1 : p0;  // a row sees keys up to p (with a window: from p - window + 1)
                    const bool seen = key <= p && (!WINDOW || key + window > p);
                    const float v = seen ? __fmul_rn(s[nt][e], scale) : NEG_INF;
                    s[nt][e] = v;
                    tmax[r] = fmaxf(tmax[r], v);
                }
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
                tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
                const float mn = fmaxf(m[r], tmax[r]);
                alpha[r] = mn == NEG_INF ? 1.f : exp2f(__fmul_rn(__fsub_rn(m[r], mn), AP_LOG2E));
                m[r] = mn;
            }
            float tsum[2] = {0.f, 0.f};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    const float p = s[nt][e] == NEG_INF ? 0.f : exp2f(__fmul_rn(__fsub_rn(s[nt][e], m[r]), AP_LOG2E));
                    s[nt][e] = p;
                    tsum[r] = __fadd_rn(tsum[r], p);
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                tsum[r] = __fadd_rn(tsum[r], __shfl_xor_sync(0xffffffffu, tsum[r], 1));
                tsum[r] = __fadd_rn(tsum[r], __shfl_xor_sync(0xffffffffu, tsum[r], 2));
                l[r] = __fadd_rn(__fmul_rn(l[r], alpha[r]), tsum[r]);
            }
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[dt][e] = __fmul_rn(o[dt][e], alpha[e >> 1]);
            // outputs += probabilities (float16) x values
#pragma unroll
            for (int k2 = 0; k2 < KEYS / 16; ++k2) {
                uint32_t pa[4];  // A: rows g, g + 8; keys 16 k2 + 2c.. (and + 8)
                pa[0] = ap_pack(s[2 * k2][0], s[2 * k2][1]);
                pa[1] = ap_pack(s[2 * k2][2], s[2 * k2][3]);
                pa[2] = ap_pack(s[2 * k2 + 1][0], s[2 * k2 + 1][1]);
                pa[3] = ap_pack(s[2 * k2 + 1][2], s[2 * k2 + 1][3]);
#pragma unroll
                for (int d2 = 0; d2 < DT / 2; ++d2) {
                    uint32_t b[4];  // keys 16 k2 .. +15, values 16 d2 .. +15 (two 8-value tiles), transposed
                    ap_ldsm_x4_trans(b, vs + (k2 * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * PITCH + d2 * 16 +
                                            (lane >> 4) * 8);
                    ap_mma(o[2 * d2], pa, b[0], b[1]);
                    ap_mma(o[2 * d2 + 1], pa, b[2], b[3]);
                }
            }
        }
        // the round's rows: o / l as float16
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, row = g + 8 * r;
                if ((r ? act1 : act0) && l[r] > 0.f)
                    out16[(long long)(t0 + row) * n_heads * D + h * D + dt * 8 + 2 * c + (e & 1)] =
                        __float2half_rn(__fdiv_rn(o[dt][e], l[r]));
            }
        done |= active;
    }
}

#define ATTN_PROMPT(D)                                                                                        \
    extern "C" __global__ void attn_prompt_d##D(const float* qkv, int W, int n_heads, int n_kv_heads, float scale, \
                                                int layer, const int* pos, const unsigned long long* kptr,     \
                                                const unsigned long long* vptr, const int* cap, int n_rows,    \
                                                __half* out16) {                                               \
        attn_prompt_body<D, false>(qkv, W, n_heads, n_kv_heads, scale, 0, layer, PromptRows{pos, kptr, vptr, cap}, \
                                   n_rows, out16);                                                             \
    }                                                                                                          \
    extern "C" __global__ void attn_prompt_window_d##D(const float* qkv, int W, int n_heads, int n_kv_heads,    \
                                                       float scale, int window, int layer, const int* pos,     \
                                                       const unsigned long long* kptr,                          \
                                                       const unsigned long long* vptr, const int* cap, int n_rows, \
                                                       __half* out16) {                                        \
        attn_prompt_body<D, true>(qkv, W, n_heads, n_kv_heads, scale, window, layer, PromptRows{pos, kptr, vptr, cap}, \
                                  n_rows, out16);                                                              \
    }
ATTN_PROMPT(64)
ATTN_PROMPT(128)
