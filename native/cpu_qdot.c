/* Quantized CPU products (cpu_qdot.h): the choice of implementation, matmul_q and matmul_q_parts,
 * which decode the activations' block scales once and hand chunks of rows to the thread pool
 * (cpu_qdot_pool.c). The kernels are in cpu_qdot_portable.c, cpu_qdot_avx2_legacy.c,
 * cpu_qdot_avx2_k.c and cpu_qdot_avx512.c; the shared definitions and the summation order that
 * makes them bit-identical in cpu_qdot_common.h. */
#include "cpu_qdot_common.h"

/* ---------------------------------------------------------------- dispatch */

static int g_impl = -1;  /* -1: not chosen yet; else a QDOT_IMPL_* */

int qdot_cpu_has_avx2(void)
{
#ifdef QDOT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

int qdot_cpu_has_avx512(void)
{
#ifdef QDOT_X86
    __builtin_cpu_init();  /* libgcc's answers include the OS's saving of the 512-bit state */
    return qdot_cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

int qdot_implementation(void)
{
    if (g_impl < 0) {
        const char *force = getenv("NVMEDIRECT_CPU_KERNELS");
        if (force && strcmp(force, "portable") == 0)
            g_impl = QDOT_IMPL_PORTABLE;
        else if (qdot_cpu_has_avx512() && !(force && strcmp(force, "avx2") == 0))
            g_impl = QDOT_IMPL_AVX512;
        else
            g_impl = qdot_cpu_has_avx2() ? QDOT_IMPL_AVX2 : QDOT_IMPL_PORTABLE;
    }
    return g_impl;
}

int qdot_set_implementation(int impl)
{
    if ((impl == QDOT_IMPL_AVX2 && !qdot_cpu_has_avx2()) || (impl == QDOT_IMPL_AVX512 && !qdot_cpu_has_avx512()) ||
        impl < QDOT_IMPL_PORTABLE || impl > QDOT_IMPL_AVX512)
        return QDOT_ENOIMPL;
    g_impl = impl;
    return 0;
}

static int rows_any(const struct job *J, int r0, int r1, int impl)
{
    if (r0 >= r1)
        return 0;
    if (J->type == T_MXFP4) {  /* one kernel of its own (cpu_qdot_mxfp4.c) */
#ifdef QDOT_X86
        if (impl) {
            if (impl == QDOT_IMPL_AVX512)
                qdot_mxfp4_rows_avx512(J, r0, r1);
            else
                qdot_mxfp4_rows_avx2(J, r0, r1);
            return 0;
        }
#endif
        qdot_mxfp4_rows_portable(J, r0, r1);
        return 0;
    }
#ifdef QDOT_X86
    if (impl == QDOT_IMPL_AVX512 && J->family != FAM_FLOAT) {  /* float weights stay on AVX2 */
        if (J->family == FAM_LEGACY)
            qdot_legacy_rows_avx512(J, r0, r1);
        else
            qdot_k_rows_avx512(J, r0, r1);
        return 0;
    }
    if (impl) {
        if (J->family == FAM_LEGACY)
            qdot_legacy_rows_avx2(J, r0, r1);
        else if (J->family == FAM_K)
            qdot_k_rows_avx2(J, r0, r1);
        else
            qdot_float_rows_avx2(J, r0, r1);
        return 0;
    }
#else
    (void)impl;
#endif
    if (J->family == FAM_LEGACY)
        qdot_legacy_rows_portable(J, r0, r1);
    else if (J->family == FAM_K)
        qdot_k_rows_portable(J, r0, r1);
    else
        return qdot_float_rows_portable(J, r0, r1);
    return 0;
}

/* The activations in the form the kernels read: per-block scales (and q8_0 sums) as plain arrays
 * for the quantized families, float values for the float types. Decoded once per product. */
struct xdec {
    float *dx, *xf, *dxT, *dx8;
    int32_t *xsum, *xsumT, *xsum8, *xneg;
    int8_t *xT;
    int32_t *xnegT;
};

static void xdec_free(struct xdec *D)
{
    free(D->dx);
    free(D->xf);
    free(D->xsum);
    free(D->dxT);
    free(D->xsumT);
    free(D->dx8);
    free(D->xsum8);
    free(D->xneg);
    free(D->xT);
    free(D->xnegT);
}

static int xdec_make(struct xdec *D, int type, int family, int cols, int nb, const uint8_t *x, size_t xrow,
                     int n_tokens)
{
    memset(D, 0, sizeof *D);
    if (family == FAM_FLOAT) {
        D->xf = malloc((size_t)n_tokens * cols * sizeof(float));
        if (!D->xf)
            return QDOT_ENOMEM;
        for (int t = 0; t < n_tokens; t++)
            for (int i = 0; i < cols; i++)
                D->xf[(size_t)t * cols + i] = weight_to_f32(type, x + (size_t)t * xrow, i);
        return 0;
    }
    size_t nblk = (size_t)n_tokens * nb;
    D->dx = malloc(nblk * sizeof(float));
    D->xsum = malloc(nblk * sizeof(int32_t));
    if (!D->dx || !D->xsum) {
        xdec_free(D);
        return QDOT_ENOMEM;
    }
    for (int t = 0; t < n_tokens; t++)
        for (int b = 0; b < nb; b++) {
            size_t i = (size_t)t * nb + b;
            if (family == FAM_K) {
                D->dx[i] = load_f32(x + (size_t)t * xrow + (size_t)b * Q8_K_BYTES);
                D->xsum[i] = 0;
            } else {
                const uint8_t *blk = x + (size_t)t * xrow + (size_t)b * Q8_0_BYTES;
                int32_t s = 0;
                for (int k = 0; k < QK; k++)
                    s += (int8_t)blk[2 + k];
                D->dx[i] = fp16_to_f32(load_u16(blk));
                D->xsum[i] = s;
            }
        }
    if (family == FAM_LEGACY && n_tokens > 1) {  /* the values block-major (struct job's xT) */
        D->xT = malloc(nblk * QK);
        if (!D->xT) {
            xdec_free(D);
            return QDOT_ENOMEM;
        }
        for (int t = 0; t < n_tokens; t++)
            for (int b = 0; b < nb; b++)
                memcpy(D->xT + ((size_t)b * n_tokens + t) * QK, x + (size_t)t * xrow + (size_t)b * Q8_0_BYTES + 2, QK);
    }
    if (family == FAM_LEGACY && n_tokens > 1) {  /* xneg block-major, + 8 tokens of room (struct job's xnegT) */
        D->xnegT = calloc((nblk + 8) * 8, sizeof(int32_t));
        if (!D->xnegT) {
            xdec_free(D);
            return QDOT_ENOMEM;
        }
    }
    if (family == FAM_LEGACY) {  /* the negated lane sums (struct job's xneg, cpu_qdot_ggml.c) */
        D->xneg = malloc(nblk * 8 * sizeof(int32_t));
        if (!D->xneg) {
            xdec_free(D);
            return QDOT_ENOMEM;
        }
        for (size_t i = 0; i < nblk; i++) {
            size_t t = i / (size_t)nb, b = i % (size_t)nb;
            const int8_t *q = (const int8_t *)(x + t * xrow + b * Q8_0_BYTES + 2);
            for (int k = 0; k < 8; k++)
                D->xneg[8 * i + k] = -(q[4 * k] + q[4 * k + 1] + q[4 * k + 2] + q[4 * k + 3]);
            if (D->xnegT)
                memcpy(D->xnegT + 8 * (b * (size_t)n_tokens + t), D->xneg + 8 * i, 8 * sizeof(int32_t));
        }
    }
    if (n_tokens == 1 && nb <= ROWS8_MAX_NB) {  /* ROWS8: eight rows' worth, in the order of a run */
        D->dx8 = malloc(8 * (size_t)nb * sizeof(float));
        D->xsum8 = malloc(8 * (size_t)nb * sizeof(int32_t));
        if (!D->dx8 || !D->xsum8) {
            xdec_free(D);
            return QDOT_ENOMEM;
        }
        for (int r = 0; r < 8; r++) {
            memcpy(D->dx8 + (size_t)r * nb, D->dx, (size_t)nb * sizeof(float));
            memcpy(D->xsum8 + (size_t)r * nb, D->xsum, (size_t)nb * sizeof(int32_t));
        }
    }
    if (n_tokens > 1) {  /* the 8-token AVX2 tiles read eight tokens' scales at once */
        D->dxT = calloc(nblk + 8, sizeof(float));  /* + 8: a last partial tile loads 8 (cpu_qdot_ggml.c) */
        D->xsumT = malloc(nblk * sizeof(int32_t));
        if (!D->dxT || !D->xsumT) {
            xdec_free(D);
            return QDOT_ENOMEM;
        }
        for (int t = 0; t < n_tokens; t++)
            for (int b = 0; b < nb; b++) {
                D->dxT[(size_t)b * n_tokens + t] = D->dx[(size_t)t * nb + b];
                D->xsumT[(size_t)b * n_tokens + t] = D->xsum[(size_t)t * nb + b];
            }
    }
    return 0;
}

/* A job for weights w (type, rows x cols) against decoded activations; y points at its first column. */
static int job_make(struct job *J, const void *w, int type, int rows, int cols, const uint8_t *xq, int n_tokens,
                    const struct xdec *D, float *y, size_t ystride)
{
    int block, wblock, family;
    if (qdot_type_info(type, &block, &wblock, &family))
        return QDOT_EUNSUPPORTED;
    long long wrow = qdot_weight_row_bytes(type, cols), xrow = qdot_activation_row_bytes(type, cols);
    if (wrow < 0)
        return (int)wrow;
    *J = (struct job){
        .type = type, .family = family, .rows = rows, .cols = cols, .nb = cols / block, .n_tokens = n_tokens,
        .w = w, .wrow = (size_t)wrow, .wblock = wblock, .x = xq, .xrow = (size_t)xrow,
        .dx = D ? D->dx : NULL, .xsum = D ? D->xsum : NULL, .xf = D ? D->xf : NULL, .y = y, .ystride = ystride,
        .dxT = D ? D->dxT : NULL, .xsumT = D ? D->xsumT : NULL, .dx8 = D ? D->dx8 : NULL,
        .xsum8 = D ? D->xsum8 : NULL, .xneg = D ? D->xneg : NULL, .xT = D ? D->xT : NULL, .xnegT = D ? D->xnegT : NULL,
    };
    return 0;
}

#define MAX_PARTS 8  /* matrices of one matmul_q_parts call */
#define MAX_JOBS 64  /* jobs of one task (cpu_moe.c: two per routed expert) */

/* Rows [row0[p], row0[p] + span[p]) of each job, cut into chunks of chunk[p] rows for the pool. */
struct task {
    struct job jobs[MAX_JOBS];
    int row0[MAX_JOBS], span[MAX_JOBS], chunk[MAX_JOBS], first[MAX_JOBS + 1];
    int n_jobs, impl;
};

static int task_chunk(void *ctx, int i)
{
    const struct task *T = ctx;
    int p = 0;
    while (i >= T->first[p + 1])
        p++;
    int a = T->row0[p] + (i - T->first[p]) * T->chunk[p];
    int b = a + T->chunk[p] < T->row0[p] + T->span[p] ? a + T->chunk[p] : T->row0[p] + T->span[p];
    return rows_any(&T->jobs[p], a, b, T->impl);
}

/* Chunks a thread gets of each task: 8 by default (a thread that is descheduled holds up at most one);
 * NVMEDIRECT_CPU_CHUNKS (1 to 64) sets it, to measure what longer runs of rows (each streamed in
 * memory order) give against the balance of shorter ones. */
static int chunks_per_thread(void)
{
    static int chunks;
    if (!chunks) {
        const char *set = getenv("NVMEDIRECT_CPU_CHUNKS");
        int n = set ? atoi(set) : 8;
        chunks = n >= 1 && n <= 64 ? n : 8;
    }
    return chunks;
}

/* Rows per chunk: about chunks_per_thread() chunks per thread over the task's n_jobs jobs together
 * (a routed expert's task has 16 or more: cut each as if it were alone, 16 threads made ~1500
 * chunks of 8 rows, each claimed and set up on its own), at most ~256 KB of weights times tokens
 * each, a multiple of 8 (the one-token tile). */
static int chunk_rows(const struct job *J, int span, int threads, int n_jobs)
{
    if (threads <= 1)
        return span > 0 ? span : 1;
    long long split = ((long long)chunks_per_thread() * threads + n_jobs - 1) / n_jobs;
    split = split < 1 ? 1 : split;
    long long per = (span + split - 1) / split;
    long long cap = (1LL << 18) / ((long long)J->wrow * J->n_tokens);
    per = per < cap ? per : cap;
    per = (per + 7) & ~7LL;
    return per < 8 ? 8 : (int)per;
}

static int task_run(struct task *T, int n_threads)
{
    int threads = n_threads < 1 ? 1 : n_threads;
    T->impl = qdot_implementation();
    T->first[0] = 0;
    for (int p = 0; p < T->n_jobs; p++) {
        T->chunk[p] = chunk_rows(&T->jobs[p], T->span[p], threads, T->n_jobs);
        T->first[p + 1] = T->first[p] + (T->span[p] + T->chunk[p] - 1) / T->chunk[p];
    }
    return qdot_pool_run(threads, T->first[T->n_jobs], task_chunk, T);
}

int matmul_q(const void *w, int type, int rows, int cols, const void *xq, int n_tokens, float *y,
             int row0, int row1, int n_threads)
{
    struct task T;  /* no zeroing: a hot path (the fields a chunk reads are set here and in task_run) */
    T.n_jobs = 1;
    T.row0[0] = row0;
    T.span[0] = row1 - row0;
    int rc = job_make(&T.jobs[0], w, type, rows, cols, xq, n_tokens, NULL, y, (size_t)rows);
    if (rc)
        return rc;
    if (rows < 0 || n_tokens < 0 || row0 < 0 || row1 > rows || row0 > row1)
        return QDOT_ERANGE;
    if (n_tokens == 0 || row0 == row1)
        return 0;
    struct xdec D;
    if ((rc = xdec_make(&D, type, T.jobs[0].family, cols, T.jobs[0].nb, xq, T.jobs[0].xrow, n_tokens)))
        return rc;
    T.jobs[0].dx = D.dx;
    T.jobs[0].xsum = D.xsum;
    T.jobs[0].xf = D.xf;
    T.jobs[0].dxT = D.dxT;
    T.jobs[0].xsumT = D.xsumT;
    T.jobs[0].dx8 = D.dx8;
    T.jobs[0].xsum8 = D.xsum8;
    T.jobs[0].xneg = D.xneg;
    T.jobs[0].xT = D.xT;
    T.jobs[0].xnegT = D.xnegT;
    rc = task_run(&T, n_threads);
    xdec_free(&D);
    return rc;
}

/* A prompt's activations rounded on the pool's threads, a few tokens per chunk (each row is
 * rounded on its own, so the bytes do not depend on who rounds it). */
struct qtask {
    int type, cols, n_tokens;
    const float *x;
    uint8_t *out;
    size_t xrow;
};

#define QUANT_TOKENS 4

static int qtask_chunk(void *ctx, int i)
{
    const struct qtask *Q = ctx;
    int t0 = i * QUANT_TOKENS, n = Q->n_tokens - t0 < QUANT_TOKENS ? Q->n_tokens - t0 : QUANT_TOKENS;
    return qdot_quantize_activations(Q->type, Q->x + (size_t)t0 * Q->cols, n, Q->cols, Q->out + (size_t)t0 * Q->xrow);
}

static int quantize_on_pool(int type, const float *x, int n_tokens, int cols, uint8_t *out, size_t xrow, int threads)
{
    struct qtask Q = {.type = type, .cols = cols, .n_tokens = n_tokens, .x = x, .out = out, .xrow = xrow};
    return qdot_pool_run(threads, (n_tokens + QUANT_TOKENS - 1) / QUANT_TOKENS, qtask_chunk, &Q);
}

/* The activation format a weight type multiplies with, as one representative type. */
static int format_of(int type)
{
    int block, bytes, family;
    if (qdot_type_info(type, &block, &bytes, &family))
        return -1;
    return family == FAM_K ? T_Q4_K : family == FAM_LEGACY ? T_Q8_0 : type;
}

/* x (n_tokens rows of cols floats) rounded once per activation format and decoded, for the weight
 * types that ask for it: rounding k is format fmt[k]. */
struct rounded {
    int fmt[MAX_PARTS], n;
    uint8_t *xq[MAX_PARTS];
    struct xdec D[MAX_PARTS];
};

/* The index in R of x rounded for weight type `type` (rounded and decoded now if no earlier type took
 * the same format), in *which. 0 or a negative error code; free R with rounded_free either way. */
static int rounded_for(struct rounded *R, int type, const float *x, int n_tokens, int cols, int n_threads, int *which)
{
    int f = format_of(type), k = 0;
    if (f < 0)
        return QDOT_EUNSUPPORTED;
    while (k < R->n && R->fmt[k] != f)
        k++;
    *which = k;
    if (k < R->n)
        return 0;
    if (k == MAX_PARTS)
        return QDOT_ERANGE;
    long long row_bytes = qdot_activation_row_bytes(f, cols);
    if (row_bytes < 0)
        return (int)row_bytes;
    size_t xrow = (size_t)row_bytes;
    int block, bytes, family, rc;
    R->fmt[R->n++] = f;
    if (!(R->xq[k] = malloc(xrow * (size_t)n_tokens)))
        return QDOT_ENOMEM;
    qdot_type_info(f, &block, &bytes, &family);
    if ((rc = quantize_on_pool(f, x, n_tokens, cols, R->xq[k], xrow, n_threads)))
        return rc;
    return xdec_make(&R->D[k], f, family, cols, cols / block, R->xq[k], xrow, n_tokens);
}

static void rounded_free(struct rounded *R)
{
    for (int k = 0; k < R->n; k++) {
        free(R->xq[k]);
        xdec_free(&R->D[k]);
    }
}

int matmul_q_parts(int n_parts, const void *const *w, const int *types, const int *rows, int cols,
                   const float *x, int n_tokens, float *y, int n_threads)
{
    if (n_parts < 1 || n_parts > MAX_PARTS || n_tokens < 0)
        return QDOT_ERANGE;
    size_t total = 0;
    for (int p = 0; p < n_parts; p++) {
        long long n = qdot_activation_row_bytes(types[p], cols);
        if (n < 0)
            return (int)n;
        if (rows[p] < 0)
            return QDOT_ERANGE;
        total += (size_t)rows[p];
    }
    if (n_tokens == 0 || total == 0)
        return 0;
    for (size_t i = 0; i < (size_t)n_tokens * cols; i++)
        if (!isfinite(x[i]))
            return QDOT_ENONFINITE;
    /* x rounded once per activation format, shared by the parts that take it */
    struct rounded R = {0};
    struct task T;  /* every field a chunk reads is set below or by task_run (no zeroing: a hot path) */
    T.n_jobs = n_parts;
    size_t col0 = 0;
    int rc = 0;
    for (int p = 0; p < n_parts && !rc; p++) {
        int k;
        if (!(rc = rounded_for(&R, types[p], x, n_tokens, cols, n_threads, &k)))
            rc = job_make(&T.jobs[p], w[p], types[p], rows[p], cols, R.xq[k], n_tokens, &R.D[k], y + col0, total);
        T.row0[p] = 0;
        T.span[p] = rows[p];
        col0 += (size_t)rows[p];
    }
    if (!rc)
        rc = task_run(&T, n_threads);
    rounded_free(&R);
    return rc;
}
