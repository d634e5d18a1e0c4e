/* Quantized CPU products (cpu_qdot.h): the choice of implementation and matmul_q, which decodes
 * the activations' block scales once and splits the rows over threads. The kernels are in
 * cpu_qdot_portable.c, cpu_qdot_avx2_legacy.c and cpu_qdot_avx2_k.c; the shared definitions and the
 * summation order that makes them bit-identical in cpu_qdot_common.h. */
#include "cpu_qdot_common.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------- dispatch */

static int g_impl = -1;  /* -1: not chosen yet */

int qdot_cpu_has_avx2(void)
{
#ifdef QDOT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

int qdot_implementation(void)
{
    if (g_impl < 0) {
        const char *force = getenv("NVMEDIRECT_CPU_KERNELS");
        g_impl = (force && strcmp(force, "portable") == 0) ? 0 : qdot_cpu_has_avx2();
    }
    return g_impl;
}

int qdot_set_implementation(int avx2)
{
    if (avx2 && !qdot_cpu_has_avx2())
        return QDOT_ENOIMPL;
    g_impl = avx2 ? 1 : 0;
    return 0;
}

static int rows_any(const struct job *J, int r0, int r1, int avx2)
{
    if (r0 >= r1)
        return 0;
#ifdef QDOT_X86
    if (avx2) {
        if (J->family == FAM_LEGACY)
            qdot_legacy_rows_avx2(J, r0, r1);
        else if (J->family == FAM_K)
            qdot_k_rows_avx2(J, r0, r1);
        else
            qdot_float_rows_avx2(J, r0, r1);
        return 0;
    }
#else
    (void)avx2;
#endif
    if (J->family == FAM_LEGACY)
        qdot_legacy_rows_portable(J, r0, r1);
    else if (J->family == FAM_K)
        qdot_k_rows_portable(J, r0, r1);
    else
        return qdot_float_rows_portable(J, r0, r1);
    return 0;
}

int matmul_q(const void *w, int type, int rows, int cols, const void *xq, int n_tokens, float *y,
             int row0, int row1, int n_threads)
{
    int block, wblock, family;
    if (qdot_type_info(type, &block, &wblock, &family))
        return QDOT_EUNSUPPORTED;
    long long wrow = qdot_weight_row_bytes(type, cols), xrow = qdot_activation_row_bytes(type, cols);
    if (wrow < 0)
        return (int)wrow;
    if (rows < 0 || n_tokens < 0 || row0 < 0 || row1 > rows || row0 > row1)
        return QDOT_ERANGE;
    if (n_tokens == 0 || row0 == row1)
        return 0;
    struct job J = {
        .type = type, .family = family, .rows = rows, .cols = cols, .nb = cols / block, .n_tokens = n_tokens,
        .w = w, .wrow = (size_t)wrow, .wblock = wblock, .x = xq, .xrow = (size_t)xrow, .y = y,
    };
    /* Per-block activation scales (and q8_0 sums) as plain arrays, decoded once per product. */
    float *dx = NULL, *xf = NULL;
    int32_t *xsum = NULL;
    size_t nblk = (size_t)n_tokens * J.nb;
    if (family == FAM_FLOAT) {
        xf = malloc((size_t)n_tokens * cols * sizeof(float));
        if (!xf)
            return QDOT_ENOMEM;
        for (int t = 0; t < n_tokens; t++)
            for (int i = 0; i < cols; i++)
                xf[(size_t)t * cols + i] = weight_to_f32(type, J.x + (size_t)t * J.xrow, i);
    } else {
        dx = malloc(nblk * sizeof(float));
        xsum = malloc(nblk * sizeof(int32_t));
        if (!dx || !xsum) {
            free(dx);
            free(xsum);
            return QDOT_ENOMEM;
        }
        for (int t = 0; t < n_tokens; t++)
            for (int b = 0; b < J.nb; b++) {
                size_t i = (size_t)t * J.nb + b;
                if (family == FAM_K) {
                    dx[i] = load_f32(J.x + (size_t)t * J.xrow + (size_t)b * Q8_K_BYTES);
                    xsum[i] = 0;
                } else {
                    const uint8_t *blk = J.x + (size_t)t * J.xrow + (size_t)b * Q8_0_BYTES;
                    int32_t s = 0;
                    for (int k = 0; k < QK; k++)
                        s += (int8_t)blk[2 + k];
                    dx[i] = fp16_to_f32(load_u16(blk));
                    xsum[i] = s;
                }
            }
    }
    J.dx = dx;
    J.xsum = xsum;
    J.xf = xf;
    int avx2 = qdot_implementation();
    int span = row1 - row0, threads = n_threads < 1 ? 1 : n_threads;
    if (threads > span)
        threads = span;
    int rc = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(min : rc)
    {
        int i = omp_get_thread_num(), n = omp_get_num_threads();
        int a = row0 + (int)((long long)span * i / n), b = row0 + (int)((long long)span * (i + 1) / n);
        rc = rows_any(&J, a, b, avx2);
    }
#else
    rc = rows_any(&J, row0, row1, avx2);
#endif
    free(dx);
    free(xsum);
    free(xf);
    return rc;
}
