/* One token's routed experts in one call (a mixture of experts' decode row, infer/moe.py): for each
 * of its k slots, the chosen expert's gate and up products of x, their SwiGLU (qdot_swiglu), and the
 * down product of that. x is rounded once for every gate and up product, the threads share one task
 * over all k experts' gate and up rows, then one over their down rows: two hand-offs to the pool
 * instead of two per expert, and no Python between the experts. Every product is the same job a
 * one-token matmul_q_parts call makes for that matrix, so the outputs are the same bits as k
 * separate calls (gate and up fused, SwiGLU, down). Given the slots' weights, it also sums them as
 * infer.moe.weighted_sum does (the weighted sum costs a Python decode step more than the products'
 * hand-offs: 26 us a block at 16 threads on the H100 host of 2026-12-07). Compiled after cpu_qdot.c, in its translation
 * unit: it uses that file's jobs, activation decoding and tasks. */

#define MOE_MAX_SLOTS (MAX_JOBS / 2)

int qdot_moe_row(const int *ids, int k, const void *const *gate, const void *const *up, const void *const *down,
                 int n_experts, int gate_type, int up_type, int down_type, int width, int dim, const float *x,
                 const float *weights, float *out, int n_threads)
{
    if (k < 1 || k > MOE_MAX_SLOTS || width < 1 || dim < 1)
        return QDOT_ERANGE;
    for (int j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= n_experts)
            return QDOT_ERANGE;
    for (int i = 0; i < dim; i++)
        if (!isfinite(x[i]))
            return QDOT_ENONFINITE;
    const int types[2] = {gate_type, up_type};
    int rc = 0;
    struct rounded R = {0};  /* x rounded once for gate and up (twice if their formats differ) */
    uint8_t *aq = NULL;
    struct xdec *DA = calloc((size_t)k, sizeof *DA);
    float *gu = malloc((size_t)k * 2 * width * sizeof(float)), *act = malloc((size_t)k * width * sizeof(float));
    float *outs = weights ? malloc((size_t)k * dim * sizeof(float)) : out;  /* the slots' rows before their sum */
    struct task *T = malloc(sizeof *T);
    if (!DA || !gu || !act || !outs || !T) {
        rc = QDOT_ENOMEM;
        goto done;
    }
    int which[2];
    for (int p = 0; p < 2 && !rc; p++)
        rc = rounded_for(&R, types[p], x, 1, dim, n_threads, &which[p]);
    T->n_jobs = 2 * k;
    for (int j = 0; j < k && !rc; j++)
        for (int p = 0; p < 2 && !rc; p++) {
            const void *w = (p ? up : gate)[ids[j]];
            rc = job_make(&T->jobs[2 * j + p], w, types[p], width, dim, R.xq[which[p]], 1, &R.D[which[p]],
                          gu + (size_t)j * 2 * width + p * width, (size_t)2 * width);
            T->row0[2 * j + p] = 0;
            T->span[2 * j + p] = width;
        }
    if (!rc)
        rc = task_run(T, n_threads);
    if (rc)
        goto done;
    for (int j = 0; j < k; j++)
        qdot_swiglu(gu + (size_t)j * 2 * width, gu + (size_t)j * 2 * width + width, (size_t)width,
                    act + (size_t)j * width);
    /* down: each slot's activation row rounded and decoded as a one-token product's */
    const int down_fmt = format_of(down_type);
    long long arow = qdot_activation_row_bytes(down_type, width);
    int block, bytes, family;
    if (arow < 0 || down_fmt < 0 || qdot_type_info(down_fmt, &block, &bytes, &family)) {
        rc = arow < 0 ? (int)arow : QDOT_EUNSUPPORTED;
        goto done;
    }
    for (int i = 0; i < k * width; i++)
        if (!isfinite(act[i])) {
            rc = QDOT_ENONFINITE;
            goto done;
        }
    if (!(aq = malloc((size_t)arow * k))) {
        rc = QDOT_ENOMEM;
        goto done;
    }
    if ((rc = qdot_quantize_activations(down_fmt, act, k, width, aq)))
        goto done;
    T->n_jobs = k;
    for (int j = 0; j < k && !rc; j++) {
        const uint8_t *row = aq + (size_t)j * arow;
        if (!(rc = xdec_make(&DA[j], down_fmt, family, width, width / block, row, (size_t)arow, 1)))
            rc = job_make(&T->jobs[j], down[ids[j]], down_type, dim, width, row, 1, &DA[j], outs + (size_t)j * dim,
                          (size_t)dim);
        T->row0[j] = 0;
        T->span[j] = dim;
    }
    if (!rc)
        rc = task_run(T, n_threads);
    if (!rc && weights)  /* infer.moe.weighted_sum: each product rounded to float, then added in slot order */
        for (int i = 0; i < dim; i++) {
            float sum = outs[i] * weights[0];
            for (int j = 1; j < k; j++)
                sum = sum + outs[(size_t)j * dim + i] * weights[j];
            out[i] = sum;
        }
done:
    rounded_free(&R);
    if (DA)
        for (int j = 0; j < k; j++)
            xdec_free(&DA[j]);
    free(DA);
    free(aq);
    free(gu);
    free(act);
    if (weights)
        free(outs);
    free(T);
    return rc;
}
