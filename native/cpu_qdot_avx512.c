/* AVX-512 VNNI kernels of the legacy quants with a min (Q4_1, Q5_1; Q4_0, Q5_0 and Q8_0 sum in
 * llama.cpp's order, cpu_qdot_ggml.c, whose vpdpbusd lanes follow the scheme below) and of the
 * K-quants (Q4_K, Q5_K, Q6_K); the float weights stay on AVX2. Chosen by cpu_qdot.c when the CPU has
 * AVX-512 F, BW, VL and VNNI.
 *
 * Integers: a legacy block goes through one vpdpbusd (unsigned weights x signed activations, four
 * products summed into each int32 lane, no saturation) where the AVX2 code needs maddubs + madd:
 * Q4/Q5 nibbles as they are (the fifth bits added under a byte mask), Q8_0 weights with 128 added
 * (xor 0x80) instead of the sign trick, each offset taken back through the activations' block sums
 * exactly as the AVX2 code takes Q4_0's 8 back. K-quant sub-blocks need their scales inside the
 * block sum, so K-quant weights go through maddubs (int16 pairs: |q| <= 63 times |x| <= 128 twice,
 * exact, as in the AVX2 code) and vpdpwssd with the int16 scales, fusing the AVX2 code's madd and
 * add, 64 elements per 512-bit vector. Block sums are exact int32 either way, and every block's
 * float term is formed by the AVX2 kernels' 8-lane float code, block after block, so the results
 * are bit-identical to the AVX2 and portable paths (cpu_qdot_common.h).
 */
#include "cpu_qdot_common.h"

#ifdef QDOT_X86

/* ---------------------------------------------------------------- shared pieces */

/* The two 256-bit halves hi:lo as one vector. */
AVX512_INLINE __m512i join256(__m256i lo, __m256i hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* ---------------------------------------------------------------- legacy quants */

/* A legacy block's weights as unsigned bytes: Q4/Q5 values 0..31, Q8_0 values + 128 (256-bit
 * vectors: on Zen 4, which runs 512-bit operations as two halves, pairs of blocks in 512-bit
 * vectors measured slower, their extra shuffles and wider reductions costing more than they save). */
AVX512_INLINE __m256i legacy_bytes512(int type, const uint8_t *b)
{
    if (type == T_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    int qs_at = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
    __m128i packed = _mm_loadu_si128((const __m128i *)(b + qs_at));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0f));
    if (type == T_Q5_0 || type == T_Q5_1)  /* bit j of qh: element j's 16, one mask bit per byte */
        q = _mm256_mask_add_epi8(q, (__mmask32)load_u32(b + (type == T_Q5_0 ? 2 : 4)), q, _mm256_set1_epi8(0x10));
    return q;
}

/* R rows x T tokens of a legacy product (R * T == 8): legacy_tile_avx2 with one vpdpbusd per
 * block for its maddubs + madd (and Q8_0's sign trick). */
AVX512_INLINE void legacy_tile_avx512(const struct job *J, const int *rr, const int *tt, int nr, int nt,
                                      const int R, const int T, const int type)
{
    const int has_min = type == T_Q4_1 || type == T_Q5_1;
    const int offset_shift = type == T_Q4_0 ? 3 : type == T_Q5_0 ? 4 : type == T_Q8_0 ? 7 : 0;
    const uint8_t *wrow[8], *xrow[8];
    for (int r = 0; r < R; r++)
        wrow[r] = J->w + (size_t)rr[r] * J->wrow;
    for (int t = 0; t < T; t++)
        xrow[t] = J->x + (size_t)tt[t] * J->xrow;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < J->nb; b++) {
        __m256i xv[8], dots[8];
        uint32_t dm[8];
        for (int t = 0; t < T; t++)
            xv[t] = _mm256_loadu_si256((const __m256i *)(xrow[t] + (size_t)b * Q8_0_BYTES + 2));
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = wrow[r] + (size_t)b * J->wblock;
            if (T == 1)  /* one token: the same block of the next tile's rows (cpu_qdot_common.h) */
                _mm_prefetch((const char *)blk + 8 * J->wrow, _MM_HINT_T0);
            __m256i wq = legacy_bytes512(type, blk);
            uint32_t d = has_min ? load_u32(blk) : load_u16(blk);
            for (int t = 0; t < T; t++) {
                dots[r * T + t] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xv[t]);
                dm[r * T + t] = d;
            }
        }
        acc = legacy_terms(J, acc, sum8_epi32(dots), dm, tt, nt, b, R, T, has_min, offset_shift);
    }
    store_tile(J, acc, rr, tt, nr, nt, T);
}

/* One token, rows r0..r0 + 7 (ROWS8 in cpu_qdot_common.h): legacy_term8 on eight blocks of the run at
 * a time, block index b following the run through the rows. */
AVX512_INLINE void legacy_rows8_avx512(const struct job *J, int r0, const int type)
{
    const int has_min = type == T_Q4_1 || type == T_Q5_1;
    const int offset_shift = type == T_Q4_0 ? 3 : type == T_Q5_0 ? 4 : type == T_Q8_0 ? 7 : 0;
    const int wb = legacy_block_bytes(type);
    const int nb = J->nb, run = 8 * nb;
    const uint8_t *w = J->w + (size_t)r0 * J->wrow, *x = J->x;
    float terms[8 * ROWS8_MAX_NB + 8] __attribute__((aligned(32)));
    for (int j = 0, b = 0; j < run; j += 8) {
        const uint8_t *blk = w + (size_t)j * wb;
        for (int o = 0; o < 8 * wb; o += 64)
            _mm_prefetch((const char *)blk + ROWS8_PREFETCH + o, _MM_HINT_NTA);
        __m256i dots[8];
        uint32_t dm[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + (size_t)b * Q8_0_BYTES + 2));
            dots[k] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), legacy_bytes512(type, blk + k * wb), xv);
            dm[k] = has_min ? load_u32(blk + k * wb) : load_u16(blk + k * wb);
            b = b + 1 == nb ? 0 : b + 1;
        }
        __m256 dw, mw;
        halves_to_f32(dm, &dw, &mw);
        _mm256_store_ps(terms + j, legacy_term8(sum8_epi32(dots), _mm256_loadu_ps(J->dx8 + j),
                                                _mm256_loadu_si256((const __m256i *)(J->xsum8 + j)), dw, mw,
                                                has_min, offset_shift));
    }
    rows8_store(J, r0, terms, nb);
}

/* One token: whole 8-row tiles of rows up to ROWS8_MAX_NB blocks row by row (ROWS8), the rest in
 * lockstep; several: 1 row x 8 tokens (each block decoded once for eight). */
#define LEGACY_CASE(type_const)                                                                      \
    case type_const:                                                                                 \
        if (J->n_tokens == 1 && J->nb <= ROWS8_MAX_NB && J->dx8) {                                   \
            int r = r0;                                                                              \
            for (; r + 8 <= r1; r += 8)                                                              \
                legacy_rows8_avx512(J, r, type_const);                                               \
            FOR_TILES(J, r, r1, 8, 1, legacy_tile_avx512(J, rr, tt, nr, nt, 8, 1, type_const));      \
        } else if (J->n_tokens == 1)                                                                 \
            FOR_TILES(J, r0, r1, 8, 1, legacy_tile_avx512(J, rr, tt, nr, nt, 8, 1, type_const));     \
        else                                                                                         \
            FOR_TILES(J, r0, r1, 1, 8, legacy_tile_avx512(J, rr, tt, nr, nt, 1, 8, type_const));     \
        break;

AVX512 void qdot_legacy_rows_avx512(const struct job *J, int r0, int r1)
{
    if (ggml_order(J->type)) {  /* llama.cpp's 8 lanes (cpu_qdot_ggml.c) */
        qdot_ggml_avx512_pairs_rows(J, r0, r1);
        return;
    }
    switch (J->type) {
    LEGACY_CASE(T_Q4_1)
    LEGACY_CASE(T_Q5_1)
    default: break;
    }
}

/* ---------------------------------------------------------------- K-quants */

/* 64 weight elements (sub-blocks s0..s3 of 16 elements each, in order) times the matching
 * activations, each sub-block's sum times its scale, added to acc (int32x16): maddubs, then vpdpwssd
 * with the scales. (vpdpbusd then vpmulld by the scales measured slower on the 2-core Zen 4 machine:
 * Q4_K on one core, weights in L2, 16.6 against 18.4 GB/s; Zen 4's vpmulld is slow.) */
AVX512_INLINE __m512i k_dot(__m512i acc, __m512i w, __m512i x, __m512i scale)
{
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w, x), scale);
}

/* The int16 scales of sub-blocks s0..s3 (indices 0..7 into sc8, eight int16 scales repeated in
 * every 128-bit lane) for k_dot: in-lane byte shuffles, cheaper than a lane-crossing vpermw. */
AVX512_INLINE __m512i k_scale(__m512i sc8, int s0, int s1, int s2, int s3)
{
#define K_REP(s) (int)((2u * (s)) | (2u * (s) + 1) << 8 | (2u * (s)) << 16 | (2u * (s) + 1) << 24)
    int a = K_REP(s0), b = K_REP(s1), c = K_REP(s2), d = K_REP(s3);
#undef K_REP
    return _mm512_shuffle_epi8(sc8, _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d));
}

/* Q5_K's fifth bits of 64 weight bytes: bit `lo` of qh[l] for bytes l < 32, bit `hi` of qh[l] for
 * bytes 32 + l, added as 16. */
AVX512_INLINE __m512i k5_high(__m512i q, __m512i qh2, int lo, int hi)
{
    __m512i bit = join256(_mm256_set1_epi8((char)(1 << lo)), _mm256_set1_epi8((char)(1 << hi)));
    return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh2, bit), q, _mm512_set1_epi8(0x10));
}

/* One Q4_K/Q5_K super-block against T tokens' q8_K blocks xb[t]: isc[t] sums (over its lanes) to
 * sum_j sc[j] * dot(q_j, x_j), imn[t] to sum_j mn[j] * (sum of x_j).
 * T == 1: 64 stored bytes at once, whose low nibbles are sub-blocks 4h and 4h + 2 and high nibbles
 * 4h + 1 and 4h + 3, against xg (the activations regrouped to match, once per tile); T > 1: each
 * 32 bytes spread to [low nibbles, high nibbles], 64 consecutive elements, shared by the tokens. */
AVX512_INLINE void k45_block512(const uint8_t *blk, const uint8_t *const *xb, const __m512i *xg, const int T,
                                const int type, __m512i *isc, __m256i *imn)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m256i sm = k4_scales_mins(blk + 4);
    __m256i mins = shuf(_mm256_permute2x128_si256(sm, sm, 0x11), k_dup_shuffle);
    __m512i sc = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm));
    for (int t = 0; t < T; t++) {
        imn[t] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb[t] + Q8_K_BSUMS)), mins);
        isc[t] = _mm512_setzero_si512();
    }
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
    __m512i qh2 = type == T_Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)))
                                 : _mm512_setzero_si512();
    if (T == 1) {
        for (int h = 0; h < 2; h++) {
            __m512i packed = _mm512_loadu_si512((const void *)(qs + 64 * h));
            __m512i lo = _mm512_and_si512(packed, low4), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
            if (type == T_Q5_K) {
                lo = k5_high(lo, qh2, 4 * h, 4 * h + 2);
                hi = k5_high(hi, qh2, 4 * h + 1, 4 * h + 3);
            }
            int s = 4 * h;
            isc[0] = k_dot(isc[0], lo, xg[2 * h], k_scale(sc, s, s, s + 2, s + 2));
            isc[0] = k_dot(isc[0], hi, xg[2 * h + 1], k_scale(sc, s + 1, s + 1, s + 3, s + 3));
        }
        return;
    }
    for (int g = 0; g < 4; g++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
        __m512i q = _mm512_and_si512(join256(v, _mm256_srli_epi16(v, 4)), low4);
        if (type == T_Q5_K)
            q = k5_high(q, qh2, 2 * g, 2 * g + 1);
        __m512i scale = k_scale(sc, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1);
        for (int t = 0; t < T; t++)
            isc[t] = k_dot(isc[t], q, _mm512_loadu_si512((const void *)(xb[t] + 4 + 64 * g)), scale);
    }
}

/* One Q6_K super-block (unsigned 0..63 values) against T tokens: isc[t] sums to sum_j sc[j] *
 * dot(q_j, x_j), imn[t] to sum_j sc[j] * (sum of x_j), over the 16 sub-blocks of 16. */
AVX512_INLINE void q6k_block512(const uint8_t *blk, const uint8_t *const *xb, const int T, __m512i *isc, __m256i *imn)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    const __m512i shl = join256(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
    const __m512i shr = join256(_mm256_setzero_si256(), _mm256_set1_epi16(2));
    __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    for (int t = 0; t < T; t++) {
        imn[t] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb[t] + Q8_K_BSUMS)), sc16);
        isc[t] = _mm512_setzero_si512();
    }
    for (int h = 0; h < 2; h++) {
        /* ql bytes 64h.. (low nibbles: elements 128h + 0..63, high: + 64..127), qh bits 2k..2k+1 of
         * byte l: bits 4..5 of element 128h + 32k + l */
        __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
        __m512i q0 = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, shl), top2));
        __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                     _mm512_and_si512(_mm512_srlv_epi16(qh, shr), top2));
        __m512i sc = _mm512_broadcast_i32x4(h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
        __m512i s0 = k_scale(sc, 0, 1, 2, 3), s1 = k_scale(sc, 4, 5, 6, 7);  /* scales 8h.. */
        for (int t = 0; t < T; t++) {
            const uint8_t *x = xb[t] + 4 + 128 * h;
            isc[t] = k_dot(isc[t], q0, _mm512_loadu_si512((const void *)x), s0);
            isc[t] = k_dot(isc[t], q1, _mm512_loadu_si512((const void *)(x + 64)), s1);
        }
    }
}

/* R rows x T tokens of a K-quant product (R * T == 8): k_tile_avx2 with the blocks above. */
AVX512_INLINE void k_tile_avx512(const struct job *J, const int *rr, const int *tt, int nr, int nt,
                                 const int R, const int T, const int type)
{
    const int six = type == T_Q6_K, bytes = six ? 210 : type == T_Q5_K ? 176 : 144;
    const uint8_t *wrow[8], *xrow[8];
    for (int r = 0; r < R; r++)
        wrow[r] = J->w + (size_t)rr[r] * J->wrow;
    for (int t = 0; t < T; t++)
        xrow[t] = J->x + (size_t)tt[t] * J->xrow;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < J->nb; b++) {
        __m512i isc[8], xg[4];
        __m256i imn[8];
        uint32_t dd[8];
        const uint8_t *xb[8];
        for (int t = 0; t < T; t++)
            xb[t] = xrow[t] + (size_t)b * Q8_K_BYTES;
        if (T == 1 && !six)  /* the activations in the order of the stored nibbles (k45_block512) */
            for (int h = 0; h < 2; h++) {
                __m512i x0 = _mm512_loadu_si512((const void *)(xb[0] + 4 + 128 * h));
                __m512i x1 = _mm512_loadu_si512((const void *)(xb[0] + 68 + 128 * h));
                xg[2 * h] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(1, 0, 1, 0));
                xg[2 * h + 1] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 2, 3, 2));
            }
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = wrow[r] + (size_t)b * J->wblock;
            if (T == 1)  /* one token: the same block of the next tile's rows (cpu_qdot_common.h) */
                for (int o = 0; o < bytes; o += 64)
                    _mm_prefetch((const char *)blk + 8 * J->wrow + o, _MM_HINT_T0);
            uint32_t d;
            if (six) {
                q6k_block512(blk, xb, T, isc + r * T, imn + r * T);
                d = load_u16(blk + 208);
            } else {
                k45_block512(blk, xb, xg, T, type, isc + r * T, imn + r * T);
                d = load_u32(blk);
            }
            for (int t = 0; t < T; t++)
                dd[r * T + t] = d;
        }
        __m256i is256[8];  /* 512 -> 256 bits first: the 256-bit tree is cheaper on Zen 4 than sum8_epi32_512 */
        for (int p = 0; p < 8; p++)
            is256[p] = _mm256_add_epi32(_mm512_castsi512_si256(isc[p]), _mm512_extracti64x4_epi64(isc[p], 1));
        acc = k_terms(J, acc, sum8_epi32(is256), sum8_epi32(imn), dd, tt, nt, b, R, T, six);
    }
    store_tile(J, acc, rr, tt, nr, nt, T);
}

/* One token, rows r0..r0 + 7 (ROWS8 in cpu_qdot_common.h): k_term8 on eight super-blocks of the run
 * at a time, block index b following the run through the rows. */
AVX512_INLINE void k_rows8_avx512(const struct job *J, int r0, const int type)
{
    const int six = type == T_Q6_K, bytes = six ? 210 : type == T_Q5_K ? 176 : 144;
    const int nb = J->nb, run = 8 * nb;
    const uint8_t *w = J->w + (size_t)r0 * J->wrow, *x = J->x;
    float terms[8 * ROWS8_MAX_NB + 8] __attribute__((aligned(32)));
    __m512i xg[ROWS8_MAX_NB_K45 * 4];  /* Q4_K/Q5_K: the activations in the order of the stored nibbles */
    if (!six)
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                const uint8_t *xb = x + (size_t)b * Q8_K_BYTES;
                __m512i x0 = _mm512_loadu_si512((const void *)(xb + 4 + 128 * h));
                __m512i x1 = _mm512_loadu_si512((const void *)(xb + 68 + 128 * h));
                xg[b * 4 + 2 * h] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(1, 0, 1, 0));
                xg[b * 4 + 2 * h + 1] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 2, 3, 2));
            }
    for (int j = 0, b = 0; j < run; j += 8) {
        const uint8_t *blk = w + (size_t)j * bytes;
        for (int o = 0; o < 8 * bytes; o += 64)
            _mm_prefetch((const char *)blk + ROWS8_PREFETCH + o, _MM_HINT_NTA);
        __m256i is256[8], imn[8];
        uint32_t dd[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const uint8_t *xb = x + (size_t)b * Q8_K_BYTES;
            __m512i isc;
            if (six) {
                q6k_block512(blk + k * bytes, &xb, 1, &isc, &imn[k]);
                dd[k] = load_u16(blk + k * bytes + 208);
            } else {
                k45_block512(blk + k * bytes, &xb, xg + b * 4, 1, type, &isc, &imn[k]);
                dd[k] = load_u32(blk + k * bytes);
            }
            is256[k] = _mm256_add_epi32(_mm512_castsi512_si256(isc), _mm512_extracti64x4_epi64(isc, 1));
            b = b + 1 == nb ? 0 : b + 1;
        }
        __m256 dw, dm;
        halves_to_f32(dd, &dw, &dm);
        _mm256_store_ps(terms + j, k_term8(sum8_epi32(is256), sum8_epi32(imn), _mm256_loadu_ps(J->dx8 + j), dw, dm, six));
    }
    rows8_store(J, r0, terms, nb);
}

/* One token: whole 8-row tiles of rows up to ROWS8_MAX_NB (Q6_K) or ROWS8_MAX_NB_K45 (Q4_K, Q5_K)
 * super-blocks row by row (ROWS8), the rest in lockstep; several: 1 row x 8 tokens (32 vector
 * registers hold Q6_K's too). */
#define K512_CASE(type_const)                                                                   \
    case type_const:                                                                            \
        if (J->n_tokens == 1 && J->nb <= (type_const == T_Q6_K ? ROWS8_MAX_NB : ROWS8_MAX_NB_K45) && J->dx8) { \
            int r = r0;                                                                         \
            for (; r + 8 <= r1; r += 8)                                                         \
                k_rows8_avx512(J, r, type_const);                                               \
            FOR_TILES(J, r, r1, 8, 1, k_tile_avx512(J, rr, tt, nr, nt, 8, 1, type_const));      \
        } else if (J->n_tokens == 1)                                                            \
            FOR_TILES(J, r0, r1, 8, 1, k_tile_avx512(J, rr, tt, nr, nt, 8, 1, type_const));     \
        else                                                                                    \
            FOR_TILES(J, r0, r1, 1, 8, k_tile_avx512(J, rr, tt, nr, nt, 1, 8, type_const));     \
        break;

AVX512 void qdot_k_rows_avx512(const struct job *J, int r0, int r1)
{
    switch (J->type) {
    K512_CASE(T_Q4_K)
    K512_CASE(T_Q5_K)
    K512_CASE(T_Q6_K)
    default: break;
    }
}

#endif /* QDOT_X86 */
