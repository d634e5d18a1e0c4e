/* The portable C kernels: the reference float sequence of every output (cpu_qdot_common.h). */
#include "cpu_qdot_common.h"

/* ---------------------------------------------------------------- portable implementation */

/* Legacy block -> 32 signed weight integers (offsets removed for Q4_0/Q5_0), scale d and min m. */
static void unpack_legacy(int type, const uint8_t *b, int8_t q[QK], float *d, float *m)
{
    *d = fp16_to_f32(load_u16(b));
    *m = 0.0f;
    const uint8_t *qs;
    uint32_t qh = 0;
    int offset = 0;
    switch (type) {
    case T_Q8_0:
        memcpy(q, b + 2, QK);
        return;
    case T_Q4_0: qs = b + 2; offset = 8; break;
    case T_Q4_1: qs = b + 4; *m = fp16_to_f32(load_u16(b + 2)); break;
    case T_Q5_0: qh = load_u32(b + 2); qs = b + 6; offset = 16; break;
    default: /* T_Q5_1 */ qh = load_u32(b + 4); qs = b + 8; *m = fp16_to_f32(load_u16(b + 2)); break;
    }
    for (int i = 0; i < 16; i++) {
        int lo = (qs[i] & 0x0f) | (((qh >> i) & 1) << 4);
        int hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        q[i] = (int8_t)(lo - offset);
        q[i + 16] = (int8_t)(hi - offset);
    }
}

/* The six-bit scales and mins of Q4_K/Q5_K (12 bytes). */
static void k_scales_mins(const uint8_t *p, int sc[8], int mn[8])
{
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[4 + j] & 63;
        sc[4 + j] = (p[8 + j] & 0x0f) | ((p[j] >> 6) << 4);
        mn[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 6) << 4);
    }
}

/* K-quant super-block -> 256 unsigned weight integers (Q6_K: 0..63, its -32 applied through the
 * activation sums), the scales (8 for Q4_K/Q5_K, 16 for Q6_K), the mins, d and dmin. */
static void unpack_k(int type, const uint8_t *b, uint8_t q[QKK], int sc[16], int mn[8], float *d, float *dmin)
{
    if (type == T_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *lq = ql + 64 * h, hb = qh[32 * h + l];
                uint8_t *o = q + 128 * h + l;
                o[0] = (uint8_t)((lq[l] & 0x0f) | ((hb & 3) << 4));
                o[32] = (uint8_t)((lq[32 + l] & 0x0f) | (((hb >> 2) & 3) << 4));
                o[64] = (uint8_t)((lq[l] >> 4) | (((hb >> 4) & 3) << 4));
                o[96] = (uint8_t)((lq[32 + l] >> 4) | (((hb >> 6) & 3) << 4));
            }
        for (int j = 0; j < 16; j++)
            sc[j] = (int8_t)b[192 + j];
        *d = fp16_to_f32(load_u16(b + 208));
        *dmin = 0.0f;
        return;
    }
    *d = fp16_to_f32(load_u16(b));
    *dmin = fp16_to_f32(load_u16(b + 2));
    k_scales_mins(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = type == T_Q5_K ? b + 48 : b + 16;
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            uint8_t lo = qs[32 * g + l] & 0x0f, hi = qs[32 * g + l] >> 4;
            if (type == T_Q5_K) {
                lo |= (uint8_t)(((qh[l] >> (2 * g)) & 1) << 4);
                hi |= (uint8_t)(((qh[l] >> (2 * g + 1)) & 1) << 4);
            }
            q[64 * g + l] = lo;
            q[64 * g + 32 + l] = hi;
        }
}

/* Q4_0, Q5_0, Q8_0 in llama.cpp's order (ggml_order, cpu_qdot_common.h): per output 8 lanes, lane k
 * accumulating d * (block sum of elements 4k..4k+3) with fmaf, one block after another. */
static void ggml_rows_portable(const struct job *J, int r0, int r1)
{
    float lanes[TOKEN_TILE][8];
    int8_t q[QK];
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = J->w + (size_t)r * J->wrow;
        for (int t0 = 0; t0 < J->n_tokens; t0 += TOKEN_TILE) {
            int nt = J->n_tokens - t0 < TOKEN_TILE ? J->n_tokens - t0 : TOKEN_TILE;
            memset(lanes, 0, sizeof lanes);
            for (int b = 0; b < J->nb; b++) {
                float dw, m;
                unpack_legacy(J->type, wrow + (size_t)b * J->wblock, q, &dw, &m);
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = (const int8_t *)(J->x + (size_t)(t0 + t) * J->xrow + (size_t)b * Q8_0_BYTES + 2);
                    float d = dw * J->dx[(size_t)(t0 + t) * J->nb + b];
                    for (int k = 0; k < 8; k++) {
                        int32_t s = 0;
                        for (int i = 4 * k; i < 4 * k + 4; i++)
                            s += q[i] * xq[i];
                        lanes[t][k] = fmaf(d, (float)s, lanes[t][k]);
                    }
                }
            }
            for (int t = 0; t < nt; t++)
                J->y[(size_t)(t0 + t) * J->ystride + r] = hsum8_ggml(lanes[t]);
        }
    }
}

void qdot_legacy_rows_portable(const struct job *J, int r0, int r1)
{
    if (ggml_order(J->type)) {
        ggml_rows_portable(J, r0, r1);
        return;
    }
    const int has_min = J->type == T_Q4_1 || J->type == T_Q5_1;
    float acc[TOKEN_TILE];
    int8_t q[QK];
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = J->w + (size_t)r * J->wrow;
        for (int t0 = 0; t0 < J->n_tokens; t0 += TOKEN_TILE) {
            int nt = J->n_tokens - t0 < TOKEN_TILE ? J->n_tokens - t0 : TOKEN_TILE;
            for (int t = 0; t < nt; t++)
                acc[t] = 0.0f;
            for (int b = 0; b < J->nb; b++) {
                float d, m;
                unpack_legacy(J->type, wrow + (size_t)b * J->wblock, q, &d, &m);
                for (int t = 0; t < nt; t++) {
                    size_t xi = (size_t)(t0 + t) * J->nb + b;
                    const int8_t *xq = (const int8_t *)(J->x + (size_t)(t0 + t) * J->xrow + (size_t)b * Q8_0_BYTES + 2);
                    int32_t isum = 0;
                    for (int i = 0; i < QK; i++)
                        isum += q[i] * xq[i];
                    acc[t] = acc[t] + legacy_term(d, m, J->dx[xi], isum, J->xsum[xi], has_min);
                }
            }
            for (int t = 0; t < nt; t++)
                J->y[(size_t)(t0 + t) * J->ystride + r] = acc[t];
        }
    }
}

void qdot_k_rows_portable(const struct job *J, int r0, int r1)
{
    const int six = J->type == T_Q6_K;
    float acc[TOKEN_TILE];
    uint8_t q[QKK];
    int sc[16], mn[8] = {0};  /* mn: unused by Q6_K */
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = J->w + (size_t)r * J->wrow;
        for (int t0 = 0; t0 < J->n_tokens; t0 += TOKEN_TILE) {
            int nt = J->n_tokens - t0 < TOKEN_TILE ? J->n_tokens - t0 : TOKEN_TILE;
            for (int t = 0; t < nt; t++)
                acc[t] = 0.0f;
            for (int b = 0; b < J->nb; b++) {
                float d, dmin;
                unpack_k(J->type, wrow + (size_t)b * J->wblock, q, sc, mn, &d, &dmin);
                for (int t = 0; t < nt; t++) {
                    const uint8_t *xb = J->x + (size_t)(t0 + t) * J->xrow + (size_t)b * Q8_K_BYTES;
                    const int8_t *xq = (const int8_t *)(xb + 4);
                    int32_t isc = 0, imin = 0;
                    int per = six ? 16 : 32;  /* elements per scale */
                    for (int j = 0; j < QKK / per; j++) {
                        int32_t s = 0;
                        for (int i = 0; i < per; i++)
                            s += q[per * j + i] * xq[per * j + i];
                        isc += sc[j] * s;
                    }
                    if (six) {
                        for (int j = 0; j < 16; j++)
                            imin += sc[j] * load_i16(xb + Q8_K_BSUMS + 2 * j);
                        isc -= 32 * imin;  /* the weights' -32 offset */
                    } else {
                        for (int j = 0; j < 8; j++)
                            imin += mn[j] * (load_i16(xb + Q8_K_BSUMS + 4 * j) + load_i16(xb + Q8_K_BSUMS + 4 * j + 2));
                    }
                    acc[t] = acc[t] + kquant_term(d, dmin, J->dx[(size_t)(t0 + t) * J->nb + b], isc, imin, !six);
                }
            }
            for (int t = 0; t < nt; t++)
                J->y[(size_t)(t0 + t) * J->ystride + r] = acc[t];
        }
    }
}

int qdot_float_rows_portable(const struct job *J, int r0, int r1)
{
    float *wf = malloc((size_t)J->cols * sizeof(float));
    if (!wf)
        return QDOT_ENOMEM;
    int n8 = J->cols & ~7;
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = J->w + (size_t)r * J->wrow;
        for (int i = 0; i < J->cols; i++)
            wf[i] = weight_to_f32(J->type, wrow, i);
        for (int t = 0; t < J->n_tokens; t++) {
            const float *x = J->xf + (size_t)t * J->cols;
            float lanes[8] = {0};
            for (int i = 0; i < n8; i += 8)
                for (int j = 0; j < 8; j++)
                    lanes[j] = fmaf(wf[i + j], x[i + j], lanes[j]);
            J->y[(size_t)t * J->ystride + r] = finish_lanes(lanes, wf + n8, x + n8, J->cols - n8);
        }
    }
    free(wf);
    return 0;
}
