/* AVX2 kernels of the K-quants (Q4_K, Q5_K, Q6_K) against q8_K activations.
 *
 * Each weight super-block is multiplied horizontally, as llama.cpp does: 32 weight bytes (unsigned,
 * 0..15 / 0..31 / 0..63) times 32 activation bytes with maddubs (int16 pairs, no saturation at these
 * magnitudes), then madd with the sub-block scales (int32), summed over the block into one int32x8
 * vector per (row, token). Q6_K's -32 is applied through the activations' sums of 16 (q8_K bsums),
 * as are the Q4_K/Q5_K mins. A tile of 8 (row, token) pairs then reduces its vectors to one exact
 * int32 per lane and forms the block terms with one output per float lane (cpu_qdot_common.h).
 */
#include "cpu_qdot_common.h"

#ifdef QDOT_X86

/* pshufb masks: in each 128-bit half, the int16 element e (of 8) repeated. */
#define REP16(e) 2 * (e), 2 * (e) + 1, 2 * (e), 2 * (e) + 1, 2 * (e), 2 * (e) + 1, 2 * (e), 2 * (e) + 1, \
                 2 * (e), 2 * (e) + 1, 2 * (e), 2 * (e) + 1, 2 * (e), 2 * (e) + 1, 2 * (e), 2 * (e) + 1
/* low half element 2k, high half element 2k + 1 */
static const uint8_t k_pair_shuffle[4][32] __attribute__((aligned(32))) = {
    {REP16(0), REP16(1)}, {REP16(2), REP16(3)}, {REP16(4), REP16(5)}, {REP16(6), REP16(7)},
};
/* both halves element e */
static const uint8_t k_rep_shuffle[8][32] __attribute__((aligned(32))) = {
    {REP16(0), REP16(0)}, {REP16(1), REP16(1)}, {REP16(2), REP16(2)}, {REP16(3), REP16(3)},
    {REP16(4), REP16(4)}, {REP16(5), REP16(5)}, {REP16(6), REP16(6)}, {REP16(7), REP16(7)},
};
/* int16 elements 0..7 each twice: m0 m0 m1 m1 .. m3 m3 | m4 m4 .. m7 m7 (from both halves = m0..m7) */
static const uint8_t k_dup_shuffle[32] __attribute__((aligned(32))) = {
    0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 8, 9, 8, 9, 10, 11, 10, 11, 12, 13, 12, 13, 14, 15, 14, 15,
};

AVX2_INLINE __m256i shuf(__m256i v, const uint8_t *mask)
{
    return _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i *)mask));
}

/* The 12 scale bytes of Q4_K/Q5_K -> int16: the 8 scales (low half), the 8 mins (high half). */
AVX2_INLINE __m256i k4_scales_mins(const uint8_t *p)
{
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    uint32_t u0 = load_u32(p), u1 = load_u32(p + 4), u2 = load_u32(p + 8);
    uint32_t sc_lo = u0 & m6, sc_hi = (u2 & m4) | (((u0 >> 6) & m2) << 4);
    uint32_t mn_lo = u1 & m6, mn_hi = ((u2 >> 4) & m4) | (((u1 >> 6) & m2) << 4);
    return _mm256_cvtepu8_epi16(_mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo, (int)mn_hi));
}

/* One Q4_K/Q5_K super-block against T tokens' q8_K blocks xb[t]: isc[t] sums (over its lanes) to
 * sum_j sc[j] * dot(q_j, x_j), imn[t] to sum_j mn[j] * (sum of x_j). */
AVX2_INLINE void k45_block(const uint8_t *blk, const uint8_t *const *xb, const int T, const int type,
                           __m256i *isc, __m256i *imn)
{
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i sm = k4_scales_mins(blk + 4);
    __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);
    __m256i mins = shuf(_mm256_permute2x128_si256(sm, sm, 0x11), k_dup_shuffle);
    for (int t = 0; t < T; t++) {
        imn[t] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb[t] + Q8_K_BSUMS)), mins);
        isc[t] = _mm256_setzero_si256();
    }
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
    __m256i qh = type == T_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
        __m256i lo = _mm256_and_si256(packed, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        if (type == T_Q5_K) {  /* bit 2g / 2g+1 of qh[l] -> 16 */
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
        }
        __m256i slo = shuf(scales, k_rep_shuffle[2 * g]), shi = shuf(scales, k_rep_shuffle[2 * g + 1]);
        for (int t = 0; t < T; t++) {
            const int8_t *xq = (const int8_t *)(xb[t] + 4) + 64 * g;
            __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)), slo);
            __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))), shi);
            isc[t] = _mm256_add_epi32(isc[t], _mm256_add_epi32(pl, ph));
        }
    }
}

/* One Q6_K super-block (unsigned 0..63 values) against T tokens: isc[t] sums to sum_j sc[j] *
 * dot(q_j, x_j), imn[t] to sum_j sc[j] * (sum of x_j), both over the 16 sub-blocks of 16. */
AVX2_INLINE void q6k_block(const uint8_t *blk, const uint8_t *const *xb, const int T, __m256i *isc, __m256i *imn)
{
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    for (int t = 0; t < T; t++) {
        imn[t] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb[t] + Q8_K_BSUMS)), sc16);
        isc[t] = _mm256_setzero_si256();
    }
    for (int h = 0; h < 2; h++) {
        /* scales 8h..8h+7 in both halves */
        __m256i s8 = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2)),
            _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, top2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2)),
        };
        for (int k = 0; k < 4; k++) {  /* elements 128h + 32k ..: scales 8h + 2k (first 16), 8h + 2k + 1 */
            __m256i sv = shuf(s8, k_pair_shuffle[k]);
            for (int t = 0; t < T; t++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xb[t] + 4 + 128 * h + 32 * k));
                isc[t] = _mm256_add_epi32(isc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xv), sv));
            }
        }
    }
}

/* R rows x T tokens of a K-quant product (R * T == 8). */
AVX2_INLINE void k_tile_avx2(const struct job *J, const int *rr, const int *tt, int nr, int nt,
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
        __m256i isc[8], imn[8];
        uint32_t dd[8];  /* lane p: d (low half) and dmin (high half, Q4_K/Q5_K) of its row */
        const uint8_t *xb[8];
        for (int t = 0; t < T; t++)
            xb[t] = xrow[t] + (size_t)b * Q8_K_BYTES;
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = wrow[r] + (size_t)b * J->wblock;
            if (T == 1)  /* one token: the same block of the next tile's rows (cpu_qdot_common.h) */
                for (int o = 0; o < bytes; o += 64)
                    _mm_prefetch((const char *)blk + 8 * J->wrow + o, _MM_HINT_T0);
            uint32_t d;
            if (six) {
                q6k_block(blk, xb, T, isc + r * T, imn + r * T);
                d = load_u16(blk + 208);
            } else {
                k45_block(blk, xb, T, type, isc + r * T, imn + r * T);
                d = load_u32(blk);
            }
            for (int t = 0; t < T; t++)
                dd[r * T + t] = d;
        }
        acc = k_terms(J, acc, sum8_epi32(isc), sum8_epi32(imn), dd, tt, nt, b, R, T, six);
    }
    store_tile(J, acc, rr, tt, nr, nt, T);
}

/* One token, rows r0..r0 + 7 (ROWS8 in cpu_qdot_common.h): k_term8 on eight super-blocks of the run
 * at a time, block index b following the run through the rows (k_rows8_avx512's, with this file's
 * block products). */
AVX2_INLINE void k_rows8_avx2(const struct job *J, int r0, const int type)
{
    const int six = type == T_Q6_K, bytes = six ? 210 : type == T_Q5_K ? 176 : 144;
    const int nb = J->nb, run = 8 * nb;
    const uint8_t *w = J->w + (size_t)r0 * J->wrow;
    float terms[8 * ROWS8_MAX_NB + 8] __attribute__((aligned(32)));
    for (int j = 0, b = 0; j < run; j += 8) {
        const uint8_t *blk = w + (size_t)j * bytes;
        for (int o = 0; o < 8 * bytes; o += 64)
            _mm_prefetch((const char *)blk + ROWS8_PREFETCH + o, _MM_HINT_NTA);
        __m256i isc[8], imn[8];
        uint32_t dd[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const uint8_t *xb = J->x + (size_t)b * Q8_K_BYTES;
            if (six) {
                q6k_block(blk + k * bytes, &xb, 1, &isc[k], &imn[k]);
                dd[k] = load_u16(blk + k * bytes + 208);
            } else {
                k45_block(blk + k * bytes, &xb, 1, type, &isc[k], &imn[k]);
                dd[k] = load_u32(blk + k * bytes);
            }
            b = b + 1 == nb ? 0 : b + 1;
        }
        __m256 dw, dm;
        halves_to_f32(dd, &dw, &dm);
        _mm256_store_ps(terms + j, k_term8(sum8_epi32(isc), sum8_epi32(imn), _mm256_loadu_ps(J->dx8 + j), dw, dm, six));
    }
    rows8_store(J, r0, terms, nb);
}

/* One token: 8 rows per tile (whole tiles of rows up to ROWS8_MAX_NB (Q6_K) or ROWS8_MAX_NB_K45
 * (Q4_K, Q5_K) super-blocks row by row, ROWS8); several: 1 row x 8 tokens for Q4_K/Q5_K (each super-block decoded
 * once for eight tokens), 2 rows x 4 tokens for Q6_K (whose eight accumulators and four decoded
 * vectors would not fit the registers: measured slower at 1 x 8). */
#define K_CASE(type_const, RN, TN)                                                              \
    case type_const:                                                                            \
        if (J->n_tokens == 1 && J->nb <= (type_const == T_Q6_K ? ROWS8_MAX_NB : ROWS8_MAX_NB_K45) && J->dx8) { \
            int r = r0;                                                                         \
            for (; r + 8 <= r1; r += 8)                                                         \
                k_rows8_avx2(J, r, type_const);                                                 \
            FOR_TILES(J, r, r1, 8, 1, k_tile_avx2(J, rr, tt, nr, nt, 8, 1, type_const));        \
        } else if (J->n_tokens == 1)                                                            \
            FOR_TILES(J, r0, r1, 8, 1, k_tile_avx2(J, rr, tt, nr, nt, 8, 1, type_const));       \
        else                                                                                    \
            FOR_TILES(J, r0, r1, RN, TN, k_tile_avx2(J, rr, tt, nr, nt, RN, TN, type_const));   \
        break;

AVX2 void qdot_k_rows_avx2(const struct job *J, int r0, int r1)
{
    switch (J->type) {
    K_CASE(T_Q4_K, 1, 8)
    K_CASE(T_Q5_K, 1, 8)
    K_CASE(T_Q6_K, 2, 4)
    default: break;
    }
}

#endif /* QDOT_X86 */
