/* Internals shared by the cpu_qdot*.c and cpu_layers.c files (see cpu_qdot.h for the contract).
 *
 * native/build_cpu_kernels.py compiles the files as one translation unit, in the order
 * cpu_qdot_quant.c, cpu_qdot_portable.c, cpu_qdot_avx2_legacy.c, cpu_qdot_avx2_k.c,
 * cpu_qdot_avx512.c, cpu_qdot_ggml.c, cpu_qdot_pool.c, cpu_qdot.c, cpu_layers.c, cpu_decode.c, so
 * the helpers below are static inline and the kernels can be inlined into their dispatchers.
 *
 * Summation order (the same in both implementations, which is what makes them bit-identical):
 *   - within a weight block, products of integers are summed in int32 (exact, so any order);
 *   - the block's term is formed by a fixed float formula from its scales and integer sums
 *     (legacy_term, kquant_term below);
 *   - terms are added to the output's float accumulator one block after another, in order.
 * The AVX2 code reduces each block's integer products horizontally (maddubs/madd, then exact int32
 * sums), and forms the float terms with one output per vector lane (8 (row, token) pairs), never
 * across the blocks of one output, so every lane performs exactly the portable scalar sequence.
 * The AVX-512 code (cpu_qdot_avx512.c) sums the same block integers with vpdpbusd / vpdpwssd; both
 * form the float terms through the same helpers below (legacy_terms, k_terms), so it is
 * bit-identical too.
 * Float weights (F32/F16/BF16) use 8 running lanes of fused multiply-adds (element i goes to lane
 * i % 8, in order), then ggml's tree over the lanes (hsum8_ggml): llama.cpp's order for these types
 * on an AVX2 build (the llamafile tiles; a synthetic qwen2moe's float32 routers and shared-expert
 * gates then give llama.cpp's bits, where a plain multiply-then-add and another tree missed by an ulp).
 *
 * Q4_0, Q5_0 and Q8_0 follow llama.cpp's order instead (ggml_order below; its AVX2 vec_dot and the
 * llamafile tiles for these types compute alike): 8 running lanes, lane k taking each block's exact
 * int32 sum of elements 4k..4k+3 (signed weights, offsets removed) times d = d_w * d_x (exact: two
 * halves) with one fused multiply-add per block, then ggml's tree over the lanes (hsum8_ggml). With
 * the sums of the blocks' totals, the synthetic Qwen3 Q8_0 file's logits were 0.0087 from llama.cpp's
 * (2.2 x its own batching noise); in its order, 0.0032 (0.8 x): a different rounding of the same
 * product, amplified by the 8-bit activations of every later product.
 */
#ifndef NVMEDIRECT_CPU_QDOT_COMMON_H
#define NVMEDIRECT_CPU_QDOT_COMMON_H

#include "cpu_qdot.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QDOT_X86 1
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39,
};
enum { FAM_FLOAT, FAM_LEGACY, FAM_K };

#define QK 32            /* legacy block */
#define QKK 256          /* K-quant super-block */
#define Q8_0_BYTES 34    /* f16 d + 32 int8 */
#define Q8_K_BYTES 292   /* f32 d + 256 int8 + 16 int16 */
#define Q8_K_BSUMS 260   /* offset of the int16 sums in a q8_K block */
#define TOKEN_TILE 64    /* portable path: outputs accumulated at once per weight row */

/* ---------------------------------------------------------------- scalars and conversions */

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float load_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }
static inline int16_t load_i16(const uint8_t *p) { int16_t v; memcpy(&v, p, 2); return v; }
static inline float bits_to_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* Exact half -> float (every half is a float). */
static inline float fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 is exact in float */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 0x1f)
        return bits_to_f32(sign | 0x7f800000u | (man << 13));
    return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* float -> half, round to nearest, ties to even (as NumPy's astype(float16)). */
static inline uint16_t f32_to_fp16(float f)
{
    uint32_t x = f32_to_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)  /* inf, NaN (kept quiet) */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u)  /* >= 65520 rounds past the largest half */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {  /* below 2^-14: a multiple of 2^-24; scaling by 2^24 is exact */
        uint32_t m = (uint32_t)rintf(bits_to_f32(ax) * 16777216.0f);
        return (uint16_t)(sign | m);
    }
    uint32_t r = ax - (112u << 23);  /* rebias the exponent, then round 13 mantissa bits away */
    r += 0x0fffu + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

/* float -> bf16, round to nearest even on the raw bits (the repo's NumPy rule, NaN included). */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t b = f32_to_bits(f);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

/* ---------------------------------------------------------------- one product's shared state */

struct job {
    int type, family, rows, cols, nb, n_tokens;
    const uint8_t *w;   /* packed weights */
    size_t wrow;        /* bytes per weight row */
    int wblock;         /* bytes per weight block */
    const uint8_t *x;   /* quantized activations */
    size_t xrow;        /* bytes per activation row */
    const float *dx;    /* [t * nb + b]: activation block scales as floats (legacy, K) */
    const int32_t *xsum;/* [t * nb + b]: sum of a q8_0 block's int8 values (legacy) */
    const float *dxT;   /* [b * n_tokens + t]: dx block-major (several tokens) */
    const int32_t *xsumT;/* [b * n_tokens + t]: xsum block-major (several tokens) */
    const float *dx8;   /* [j]: dx[j % nb], j < 8 * nb (one token: a tile's 8 rows as one run, ROWS8) */
    const int32_t *xsum8;/* [j]: xsum[j % nb], likewise (legacy) */
    const int32_t *xneg;/* [(t * nb + b) * 8 + k]: -(sum of elements 4k..4k+3 of the q8_0 block), for the
                         * weights' offsets (legacy; cpu_qdot_ggml.c) */
    const int8_t *xT;   /* [(b * n_tokens + t) * 32 + i]: the q8_0 values block-major (legacy, several tokens:
                         * a block's tokens 32 bytes apart, cpu_qdot_ggml.c) */
    const int32_t *xnegT;/* [(b * n_tokens + t) * 8 + k]: xneg block-major (legacy, several tokens) */
    const float *xf;    /* [t * cols + i]: activations as floats (float types) */
    float *y;           /* y[t * ystride + r]: output of row r for token t */
    size_t ystride;     /* floats per output row (the rows of every part of a fused product) */
};

/* The fixed per-block float formulas; the AVX2 code performs the same operations lane by lane. */
static inline float legacy_term(float d, float m, float dx, int32_t isum, int32_t xsum, int has_min)
{
    float term = (d * dx) * (float)isum;
    if (has_min)
        term = term + (m * dx) * (float)xsum;
    return term;
}

static inline float kquant_term(float d, float dmin, float dx, int32_t isc, int32_t imin, int has_min)
{
    float term = (d * dx) * (float)isc;
    if (has_min)
        term = term - (dmin * dx) * (float)imin;
    return term;
}

/* Whether a legacy type is summed in llama.cpp's order (8 lanes of fused multiply-adds). */
static inline int ggml_order(int type) { return type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0; }

/* ggml's hsum_float_8: the high four lanes plus the low four, then (0 + 2) + (1 + 3). */
static inline float hsum8_ggml(const float a[8])
{
    float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
    return (r0 + r2) + (r1 + r3);
}

/* Lanes of a float dot product -> its value: the tail elements fused into lanes 0..rem-1, then ggml's tree. */
static inline float finish_lanes(float lanes[8], const float *w, const float *x, int rem)
{
    for (int j = 0; j < rem; j++)
        lanes[j] = fmaf(w[j], x[j], lanes[j]);
    return hsum8_ggml(lanes);
}

static inline float weight_to_f32(int type, const uint8_t *row, int i)
{
    if (type == T_F32)
        return load_f32(row + 4 * (size_t)i);
    uint16_t h = load_u16(row + 2 * (size_t)i);
    return type == T_F16 ? fp16_to_f32(h) : bf16_to_f32(h);
}

/* Cephes' expf core for x in [-87, 88], within ~1 ulp: range reduction by ln 2 in two parts, a
 * degree-6 polynomial, times 2^k; float operations only, so every compiler and vector width gets the
 * same bits (exp_poly8). The softmax's exp (cpu_layers.c) clamps around it. */
static inline float exp_poly(float x)
{
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
    float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = (p * (r * r) + r) + 1.0f;
    return p * bits_to_f32((uint32_t)((int)k + 127) << 23);
}

/* Bytes of a legacy weight block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), a constant where the type is. */
static inline int legacy_block_bytes(int type)
{
    return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : type == T_Q5_1 ? 24 : 34;
}

/* ROWS8: a one-token tile of 8 rows, which are one contiguous stretch of the matrix, read in the
 * memory's order as one run of 8 * nb blocks, eight blocks' float terms formed at a time (lane by
 * lane, as legacy_term8 / k_term8 form them for the lockstep tile) into terms[r * nb + b], and then
 * added block by block over the 8 rows (rows8_add): the same bits as the lockstep tile. Reading the 8
 * rows in lockstep, a block of each in turn, measured half the bandwidth on short rows (2026-12-05,
 * 2-core Zen 4, one thread, from DRAM, Q8_0: 11.9 GB/s on 1536-wide rows against 22.6 on 10752-wide
 * ones; a bare read of the two orders, 12.9 against 26.0 GB/s): the hardware prefetcher follows one
 * stream through a page, not several interleaved ones. Long rows keep the lockstep tile: legacy rows
 * over 4096 wide (the run's terms would outgrow the stack; Q8_0 10752 wide reads as fast either way)
 * and Q4_K/Q5_K rows over 4096 wide (8960 wide, the 1.5B's down matrices: the same time either way
 * within the noise, and lockstep ahead on a benchmark whose matrices partly stay in L3). The AVX2
 * and AVX-512 kernels both have it. */
#define ROWS8_MAX_NB 128     /* blocks (legacy) or super-blocks (Q6_K) of a row, at most */
#define ROWS8_MAX_NB_K45 16  /* Q4_K, Q5_K super-blocks of a row, at most */
#define ROWS8_PREFETCH 2048  /* bytes ahead of the run (non-temporal: the weights are read once) */

/* ---------------------------------------------------------------- AVX2 helpers */

#ifdef QDOT_X86
/* fma: the fused multiply-adds of ggml_order's lanes (explicit intrinsics only: -ffp-contract=off
 * keeps the compiler from fusing anything else) */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* Eight int32x8 vectors -> one vector whose lane p is the sum of v[p]'s lanes (exact). */
AVX2_INLINE __m256i sum8_epi32(const __m256i v[8])
{
    __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* unsigned x signed bytes -> int32x8 of sums of four products. maddubs saturates its int16 pair
 * sums: callers keep |u| <= 63 (K-quants, Q4/Q5 nibbles), or |u| <= 128 with |s| <= 127 (the sign
 * trick), so a pair is at most 2 * 128 * 127 = 32512 and every sum is exact. */
AVX2_INLINE __m256i dot_u8_i8(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* signed x signed bytes (w in -128..127, x in -127..127): |w| (128 read as unsigned) times x with
 * w's sign, as llama.cpp's mul_sum_i8_pairs. */
AVX2_INLINE __m256i dot_i8_i8(__m256i w, __m256i x)
{
    return dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* Eight 32-bit words -> the float values of their low halves (*lo) and high halves (*hi), each a
 * float16 (exact conversions). */
AVX2_INLINE void halves_to_f32(const uint32_t v[8], __m256 *lo, __m256 *hi)
{
    /* element by element: one wide load of just-stored words would stall (no store forwarding) */
    __m256i w = _mm256_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5], (int)v[6], (int)v[7]);
    __m256i p = _mm256_packus_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(w, 16));
    p = _mm256_permute4x64_epi64(p, 0xd8);  /* [lo 0..3, lo 4..7 | hi 0..3, hi 4..7] */
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(p));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(p, 1));
}

/* Eight legacy block terms, lane by lane (legacy_term's sequence): block sums isum, activation
 * scales dx and sums xsum, weight scales dw and mins mw. */
AVX2_INLINE __m256 legacy_term8(__m256i isum, __m256 dx, __m256i xsum, __m256 dw, __m256 mw, int has_min,
                                int offset_shift)
{
    if (offset_shift)
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(xsum, offset_shift));
    __m256 term = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum));
    if (has_min)
        term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(xsum)));
    return term;
}

/* Eight K-quant super-block terms, lane by lane (kquant_term's sequence): sums is, minimum sums im
 * (Q6_K: the -32 offset with `six`), activation scales dx, weight scales dw and mins dm. */
AVX2_INLINE __m256 k_term8(__m256i is, __m256i im, __m256 dx, __m256 dw, __m256 dm, int six)
{
    if (six) {
        is = _mm256_sub_epi32(is, _mm256_slli_epi32(im, 5));  /* the weights' -32 offset */
        return _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(is));
    }
    return _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(is)),
                         _mm256_mul_ps(_mm256_mul_ps(dm, dx), _mm256_cvtepi32_ps(im)));
}

/* A legacy block's float terms for the 8 (row, token) lanes of a tile, added to acc (legacy_term's
 * sequence, lane by lane): the AVX2 and AVX-512 kernels share it, so both form the same floats. */
AVX2_INLINE __m256 legacy_terms(const struct job *J, __m256 acc, __m256i isum, const uint32_t dm[8], const int *tt,
                                  int nt, int b, const int R, const int T, int has_min, int offset_shift)
{
    __m256 dx;
    __m256i xsum;
    if (T == 1) {
        size_t xi = (size_t)tt[0] * J->nb + b;
        dx = _mm256_set1_ps(J->dx[xi]);
        xsum = _mm256_set1_epi32(J->xsum[xi]);
    } else if (T == 8 && nt == 8) {
        size_t xi = (size_t)b * J->n_tokens + tt[0];
        dx = _mm256_loadu_ps(J->dxT + xi);
        xsum = _mm256_loadu_si256((const __m256i *)(J->xsumT + xi));
    } else {
        float dxl[8];
        int32_t xsl[8];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) {
                size_t xi = (size_t)tt[t] * J->nb + b;
                dxl[r * T + t] = J->dx[xi];
                xsl[r * T + t] = J->xsum[xi];
            }
        dx = _mm256_loadu_ps(dxl);
        xsum = _mm256_loadu_si256((const __m256i *)xsl);
    }
    __m256 dw, mw;
    if (R == 1) {
        __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm[0]));
        dw = _mm256_broadcastss_ps(h);
        mw = _mm256_broadcastss_ps(_mm_movehdup_ps(h));
    } else {
        halves_to_f32(dm, &dw, &mw);
    }
    return _mm256_add_ps(acc, legacy_term8(isum, dx, xsum, dw, mw, has_min, offset_shift));
}

/* A K-quant super-block's float terms for the 8 (row, token) lanes of a tile from its integer sums
 * `is` and minimum sums `im` (Q4_K/Q5_K; Q6_K's -32 offset with `six`), added to acc
 * (kquant_term's sequence): shared by the AVX2 and AVX-512 kernels. */
AVX2_INLINE __m256 k_terms(const struct job *J, __m256 acc, __m256i is, __m256i im, const uint32_t dd[8], const int *tt,
                           int nt, int b, const int R, const int T, int six)
{
    __m256 dx;
    if (T == 1) {
        dx = _mm256_set1_ps(J->dx[(size_t)tt[0] * J->nb + b]);
    } else if (T == 8 && nt == 8) {  /* eight consecutive tokens: one load from the block-major copy */
        dx = _mm256_loadu_ps(J->dxT + (size_t)b * J->n_tokens + tt[0]);
    } else {
        float dxl[8];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                dxl[r * T + t] = J->dx[(size_t)tt[t] * J->nb + b];
        dx = _mm256_loadu_ps(dxl);
    }
    __m256 dw, dm;
    halves_to_f32(dd, &dw, &dm);
    return _mm256_add_ps(acc, k_term8(is, im, dx, dw, dm, six));
}

/* y[tt[t]][rr[r]] = lane r * T + t of acc, for the nr x nt valid outputs of a tile. */
AVX2_INLINE void store_tile(const struct job *J, __m256 acc, const int *rr, const int *tt, int nr, int nt, const int T)
{
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++)
            J->y[(size_t)tt[t] * J->ystride + rr[r]] = out[r * T + t];
}

/* One token, 8-row tiles: the 8 rows of a tile are one contiguous stretch of the matrix and the next
 * tile's the stretch after it, so while block b of a tile's rows is multiplied, block b of the next
 * tile's rows (8 * wrow bytes on) is prefetched: one tile ahead, whatever the row length (measured
 * 2026-12-04 on the 2-core machine, whole decode passes from DRAM: SmolLM2 Q8_0 layers 9.8 -> 8.1 ms,
 * against 384 bytes ahead per row; a fixed distance is too short for short rows).
 * The AVX2 and AVX-512 kernels read a one-token tile's rows one after another instead where it pays
 * (ROWS8).
 * Walk [r0, r1) x all tokens in R x T tiles (R * T == 8 lanes, lane p = r * T + t); rr/tt repeat the
 * last valid index to fill a tile, and only the first nr x nt outputs are stored. */
#define FOR_TILES(J, r0, r1, R, T, CALL)                                            \
    do {                                                                            \
        int rr[8], tt[8];                                                           \
        for (int rs = (r0); rs < (r1); rs += (R)) {                                 \
            int nr = (r1) - rs < (R) ? (r1) - rs : (R);                             \
            for (int r = 0; r < (R); r++)                                           \
                rr[r] = rs + (r < nr ? r : nr - 1);                                 \
            for (int ts = 0; ts < (J)->n_tokens; ts += (T)) {                       \
                int nt = (J)->n_tokens - ts < (T) ? (J)->n_tokens - ts : (T);       \
                for (int t = 0; t < (T); t++)                                       \
                    tt[t] = ts + (t < nt ? t : nt - 1);                             \
                CALL;                                                               \
            }                                                                       \
        }                                                                           \
    } while (0)

/* ---------------------------------------------------------------- AVX-512 helpers */
/* ROWS8's second half: terms[r * nb + b] holds row r's term of block b (and the array 8 floats more);
 * adds them to acc (lane r) block after block, eight blocks at a time through an 8x8 transpose. */
AVX2_INLINE __m256 rows8_add(__m256 acc, const float *terms, int n)
{
    for (int j = 0; j < n; j += 8) {
        __m256 v[8];
        for (int r = 0; r < 8; r++)
            v[r] = _mm256_loadu_ps(terms + (size_t)r * n + j);
        __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
        __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
        __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
        __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
        __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
        __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
        __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
        __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
        __m256 col[8] = {  /* col[k]: block j + k's terms of rows 0..7 */
            _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
            _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
            _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
            _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31),
        };
        const int m = n - j < 8 ? n - j : 8;
        for (int k = 0; k < m; k++)
            acc = _mm256_add_ps(acc, col[k]);
    }
    return acc;
}

/* exp_poly on eight lanes, operation for operation (lanes outside [-87, 88] give garbage to mask). */
AVX2_INLINE __m256 exp_poly8(__m256 x)
{
    __m256 big = _mm256_set1_ps(12582912.0f);
    __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), big), big);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f))),
                             _mm256_mul_ps(k, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* ROWS8's end: the 8 rows' terms added block by block (rows8_add), stored as rows r0..r0 + 7. */
AVX2_INLINE void rows8_store(const struct job *J, int r0, const float *terms, int nb)
{
    int rr[8], tt[1] = {0};
    for (int r = 0; r < 8; r++)
        rr[r] = r0 + r;
    store_tile(J, rows8_add(_mm256_setzero_ps(), terms, nb), rr, tt, 8, 1, 1);
}

/* F + BW (byte/word ops, masks) + VL + VNNI (vpdpbusd, vpdpwssd); avx2/f16c for the 8-lane float
 * code shared with the AVX2 kernels (inlined into these functions). */
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define AVX512 __attribute__((target(AVX512_TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))
#endif /* QDOT_X86 */

/* ---------------------------------------------------------------- between the files */

int qdot_type_info(int type, int *block, int *bytes, int *family);
/* cpu_qdot_pool.c: fn(ctx, i) for i in [0, n_chunks) on up to n_threads threads (the caller's
 * included); the lowest return code. */
typedef int (*qdot_chunk_fn)(void *ctx, int chunk);
int qdot_pool_run(int n_threads, int n_chunks, qdot_chunk_fn fn, void *ctx);
void qdot_legacy_rows_portable(const struct job *J, int r0, int r1);
void qdot_k_rows_portable(const struct job *J, int r0, int r1);
int qdot_float_rows_portable(const struct job *J, int r0, int r1);
void qdot_mxfp4_rows_portable(const struct job *J, int r0, int r1);  /* cpu_qdot_mxfp4.c */
#ifdef QDOT_X86
void qdot_legacy_rows_avx2(const struct job *J, int r0, int r1);
void qdot_k_rows_avx2(const struct job *J, int r0, int r1);
void qdot_float_rows_avx2(const struct job *J, int r0, int r1);
void qdot_legacy_rows_avx512(const struct job *J, int r0, int r1);
void qdot_k_rows_avx512(const struct job *J, int r0, int r1);
void qdot_ggml_avx2_rows(const struct job *J, int r0, int r1);    /* Q4_0, Q5_0, Q8_0 (ggml_order): */
void qdot_ggml_avx512_rows(const struct job *J, int r0, int r1);  /* cpu_qdot_ggml.c */
void qdot_ggml_avx512_pairs_rows(const struct job *J, int r0, int r1);
void qdot_mxfp4_rows_avx2(const struct job *J, int r0, int r1);    /* cpu_qdot_mxfp4.c */
void qdot_mxfp4_rows_avx512(const struct job *J, int r0, int r1);
#endif

#endif
