/* AVX2 kernels of the legacy quants with a min (Q4_1, Q5_1) against q8_0 activations, and of the
 * float weights (F32, F16, BF16). Q4_0, Q5_0 and Q8_0 sum in llama.cpp's order instead
 * (cpu_qdot_ggml.c); the block helpers here still read them (legacy_bytes) for it.
 *
 * A legacy block's 32 products are summed horizontally (maddubs/madd, exact); a tile of 8 (row,
 * token) pairs reduces its vectors to one int32 per lane and forms the block terms with one output
 * per float lane (cpu_qdot_common.h).
 */
#include "cpu_qdot_common.h"

#ifdef QDOT_X86

/* Legacy weights of one block as bytes: unsigned 0..31 (Q4_*, Q5_*) or signed (Q8_0). */
AVX2_INLINE __m256i legacy_bytes(int type, const uint8_t *b)
{
    if (type == T_Q8_0)
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    int qs_at = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
    __m128i packed = _mm_loadu_si128((const __m128i *)(b + qs_at));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0f));
    if (type == T_Q5_0 || type == T_Q5_1) {
        /* bit j of qh is the fifth bit of element j: spread byte j/8 over 8 lanes, test bit j%8 */
        __m256i qh = _mm256_set1_epi32((int)load_u32(b + (type == T_Q5_0 ? 2 : 4)));
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return q;
}

/* R rows x T tokens of a legacy product (R * T == 8). */
AVX2_INLINE void legacy_tile_avx2(const struct job *J, const int *rr, const int *tt, int nr, int nt,
                                  const int R, const int T, const int type)
{
    const int has_min = type == T_Q4_1 || type == T_Q5_1;
    const int offset_shift = type == T_Q4_0 ? 3 : type == T_Q5_0 ? 4 : 0;  /* offsets 8 and 16 */
    const uint8_t *wrow[8], *xrow[8];
    for (int r = 0; r < R; r++)
        wrow[r] = J->w + (size_t)rr[r] * J->wrow;
    for (int t = 0; t < T; t++)
        xrow[t] = J->x + (size_t)tt[t] * J->xrow;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < J->nb; b++) {
        __m256i xv[8], dots[8];
        uint32_t dm[8];  /* lane p: d (low half) and m (high half, Q4_1/Q5_1) of its row */
        for (int t = 0; t < T && R > 1; t++)  /* one row: each is read once, below (no spills) */
            xv[t] = _mm256_loadu_si256((const __m256i *)(xrow[t] + (size_t)b * Q8_0_BYTES + 2));
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = wrow[r] + (size_t)b * J->wblock;
            if (T == 1)  /* one token: the same block of the next tile's rows (cpu_qdot_common.h) */
                _mm_prefetch((const char *)blk + 8 * J->wrow, _MM_HINT_T0);
            __m256i wq = legacy_bytes(type, blk);
            uint32_t d = has_min ? load_u32(blk) : load_u16(blk);
            for (int t = 0; t < T; t++) {
                __m256i x = R > 1 ? xv[t] : _mm256_loadu_si256((const __m256i *)(xrow[t] + (size_t)b * Q8_0_BYTES + 2));
                dots[r * T + t] = type == T_Q8_0 ? dot_i8_i8(wq, x) : dot_u8_i8(wq, x);
                dm[r * T + t] = d;
            }
        }
        acc = legacy_terms(J, acc, sum8_epi32(dots), dm, tt, nt, b, R, T, has_min, offset_shift);
    }
    store_tile(J, acc, rr, tt, nr, nt, T);
}

/* One token, rows r0..r0 + 7 (ROWS8 in cpu_qdot_common.h): legacy_term8 on eight blocks of the run at
 * a time, block index b following the run through the rows (legacy_rows8_avx512's, with this
 * file's block products). */
AVX2_INLINE void legacy_rows8_avx2(const struct job *J, int r0, const int type)
{
    const int has_min = type == T_Q4_1 || type == T_Q5_1;
    const int offset_shift = type == T_Q4_0 ? 3 : type == T_Q5_0 ? 4 : 0;
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
            __m256i wq = legacy_bytes(type, blk + k * wb);
            dots[k] = type == T_Q8_0 ? dot_i8_i8(wq, xv) : dot_u8_i8(wq, xv);
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

AVX2_INLINE __m256 weights8(int type, const uint8_t *row, int i)
{
    if (type == T_F32)
        return _mm256_loadu_ps((const float *)(row + 4 * (size_t)i));
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * (size_t)i));
    if (type == T_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2_INLINE void float_tile_avx2(const struct job *J, const int *rr, const int *tt, int nr, int nt,
                                 const int R, const int T, const int type)
{
    __m256 acc[8];
    for (int p = 0; p < R * T; p++)
        acc[p] = _mm256_setzero_ps();
    int n8 = J->cols & ~7, rem = J->cols - n8;
    for (int i = 0; i < n8; i += 8)
        for (int r = 0; r < R; r++) {
            __m256 w = weights8(type, J->w + (size_t)rr[r] * J->wrow, i);
            for (int t = 0; t < T; t++)
                acc[r * T + t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(J->xf + (size_t)tt[t] * J->cols + i), acc[r * T + t]);
        }
    for (int r = 0; r < nr; r++) {
        float wtail[8];
        for (int j = 0; j < rem; j++)
            wtail[j] = weight_to_f32(type, J->w + (size_t)rr[r] * J->wrow, n8 + j);
        for (int t = 0; t < nt; t++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r * T + t]);
            J->y[(size_t)tt[t] * J->ystride + rr[r]] = finish_lanes(lanes, wtail, J->xf + (size_t)tt[t] * J->cols + n8, rem);
        }
    }
}

/* One token: 8 rows per tile (4 for floats); several: 2 rows x 4 tokens, so each weight block
 * loaded serves four tokens (floats), or 1 row x 8 tokens (legacy quants: the block is decoded
 * once for eight tokens, and their scales are one load, from the block-major copy). */
#define TILE_CASE(tile, type_const, R1, T1, RN, TN)                                             \
    case type_const:                                                                            \
        if (J->n_tokens == 1)                                                                   \
            FOR_TILES(J, r0, r1, R1, T1, tile(J, rr, tt, nr, nt, R1, T1, type_const));          \
        else                                                                                    \
            FOR_TILES(J, r0, r1, RN, TN, tile(J, rr, tt, nr, nt, RN, TN, type_const));          \
        break;

/* One token: whole 8-row tiles of rows up to ROWS8_MAX_NB blocks row by row (ROWS8), the rest in
 * lockstep; several: as TILE_CASE. */
#define LEGACY2_CASE(type_const)                                                                      \
    case type_const:                                                                                 \
        if (J->n_tokens == 1 && J->nb <= ROWS8_MAX_NB && J->dx8) {                                   \
            int r = r0;                                                                              \
            for (; r + 8 <= r1; r += 8)                                                              \
                legacy_rows8_avx2(J, r, type_const);                                                 \
            FOR_TILES(J, r, r1, 8, 1, legacy_tile_avx2(J, rr, tt, nr, nt, 8, 1, type_const));        \
        } else if (J->n_tokens == 1)                                                                 \
            FOR_TILES(J, r0, r1, 8, 1, legacy_tile_avx2(J, rr, tt, nr, nt, 8, 1, type_const));       \
        else                                                                                         \
            FOR_TILES(J, r0, r1, 1, 8, legacy_tile_avx2(J, rr, tt, nr, nt, 1, 8, type_const));       \
        break;

AVX2 void qdot_legacy_rows_avx2(const struct job *J, int r0, int r1)
{
    if (ggml_order(J->type)) {  /* cpu_qdot_ggml.c */
        qdot_ggml_avx2_rows(J, r0, r1);
        return;
    }
    switch (J->type) {
    LEGACY2_CASE(T_Q4_1)
    LEGACY2_CASE(T_Q5_1)
    default: break;
    }
}

AVX2 void qdot_float_rows_avx2(const struct job *J, int r0, int r1)
{
    switch (J->type) {
    TILE_CASE(float_tile_avx2, T_F32, 4, 1, 2, 4)
    TILE_CASE(float_tile_avx2, T_F16, 4, 1, 2, 4)
    TILE_CASE(float_tile_avx2, T_BF16, 4, 1, 2, 4)
    default: break;
    }
}

#endif /* QDOT_X86 */
