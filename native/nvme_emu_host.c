/*
 * The CPU reference submitter: drives one queue pair (struct nvd_ring) through a list of reads
 * (struct nvd_work) the way the GPU kernel of nvmedirect/gpu/doorbell.cu does, with the same
 * builder (native/nvme_sqe.h). Against the emulator it gives the CPU-initiated side of the
 * doorbell benchmark and the CPU side of the "same seed, same SQE bytes" tests.
 * Compiled together with native/nvme_emu.c into one library (nvmedirect/emulator.py).
 */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "nvme_ring.h"

static uint64_t host_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Issue ring->count reads from command ring->first on, keeping up to queue_depth in flight; one SQ
 * doorbell per batch of submissions, one CQ doorbell per batch of completions. Writes each
 * command's outcome to work->status and returns how many completed with success, or -ETIMEDOUT
 * when nothing completed for timeout_ns (what was in flight then is marked HOST_TIMEOUT). */
int64_t nvd_host_drive(struct nvd_ring *ring, const struct nvd_work *work, uint64_t timeout_ns)
{
    uint32_t qd = (uint32_t)ring->queue_depth, nfree = 0;
    int64_t *owner = malloc(qd * sizeof(int64_t));      /* command index per CID, -1 when free */
    uint16_t *free_cids = malloc(qd * sizeof(uint16_t));
    if (owner == NULL || free_cids == NULL || qd == 0 || qd >= ring->depth || qd > ring->cq_depth - 1) {
        free(owner);
        free(free_cids);
        return -EINVAL;
    }
    for (uint32_t c = qd; c-- > 0;) {
        owner[c] = -1;
        free_cids[nfree++] = (uint16_t)c;
    }
    struct nvd_sqe *sq = (struct nvd_sqe *)(uintptr_t)ring->sq;
    volatile struct nvd_cqe *cq = (volatile struct nvd_cqe *)(uintptr_t)ring->cq;
    volatile uint32_t *sq_db = (volatile uint32_t *)(uintptr_t)ring->sq_doorbell;
    volatile uint32_t *cq_db = (volatile uint32_t *)(uintptr_t)ring->cq_doorbell;
    uint32_t *status = (uint32_t *)(uintptr_t)work->status;
    uint32_t tail = (uint32_t)ring->sq_tail, head = (uint32_t)ring->cq_head, phase = (uint32_t)ring->cq_phase;
    uint64_t next = ring->first, end = ring->first + ring->count, done = 0, ok = 0;
    uint64_t last_progress = host_now_ns();
    int64_t rc = 0;
    while (done < ring->count) {
        uint32_t submitted = 0;
        while (nfree && next < end) {
            uint16_t cid = free_cids[nfree - 1];
            struct nvd_sqe sqe;
            if (nvd_ring_build_read(ring, work, next, cid, &sqe)) {
                status[next++] = NVD_HOST_STATUS | NVD_HOST_BUILD_ERROR;
                done++;
                continue;
            }
            nfree--;
            owner[cid] = (int64_t)next++;
            sq[tail] = sqe;
            tail = tail + 1 == ring->depth ? 0 : tail + 1;
            submitted++;
        }
        if (submitted) {
            /* SQEs and PRP lists before the doorbell (x86: stores stay in order; this stops the
             * compiler; elsewhere it is a real barrier). */
            __atomic_thread_fence(__ATOMIC_RELEASE);
            *sq_db = tail;
        }
        uint32_t reaped = 0;
        for (;;) {
            uint32_t dw3 = ((volatile uint32_t *)&cq[head])[3];
            if ((dw3 >> 16 & 1u) != phase)
                break;
            __atomic_thread_fence(__ATOMIC_ACQUIRE);  /* nothing of this entry read before its phase */
            uint16_t cid = (uint16_t)dw3, cqe_status = (uint16_t)(dw3 >> 16);
            if (cid < qd && owner[cid] >= 0) {
                status[owner[cid]] = cqe_status & ~NVD_CQE_PHASE;
                ok += (cqe_status & NVD_STATUS_ERROR_BITS) == 0;
                owner[cid] = -1;
                free_cids[nfree++] = cid;
                done++;
            }  /* else: a stray completion, nothing to attribute it to (the emulator counts it) */
            if (++head == ring->cq_depth) {
                head = 0;
                phase ^= 1u;
            }
            reaped++;
        }
        if (reaped) {
            __atomic_thread_fence(__ATOMIC_RELEASE);  /* our CQE reads before the slots are handed back */
            *cq_db = head;
            last_progress = host_now_ns();
        } else if (!submitted && host_now_ns() - last_progress > timeout_ns) {
            for (uint32_t c = 0; c < qd; c++)
                if (owner[c] >= 0)
                    status[owner[c]] = NVD_HOST_STATUS | NVD_HOST_TIMEOUT;
            for (; next < end; next++)
                status[next] = NVD_HOST_STATUS | NVD_HOST_TIMEOUT;
            rc = -ETIMEDOUT;
            break;
        }
    }
    ring->sq_tail = tail;
    ring->cq_head = head;
    ring->cq_phase = phase;
    free(owner);
    free(free_cids);
    return rc ? rc : (int64_t)ok;
}

/* The SQE (and PRP list) of every command of `ring` with CID (i - first) % queue_depth, into
 * out[0..count): what any submitter must write for these commands. Build errors leave the SQE zero
 * and return the first error code. */
int nvd_host_build(const struct nvd_ring *ring, const struct nvd_work *work, struct nvd_sqe *out)
{
    int first_error = 0;
    for (uint64_t k = 0; k < ring->count; k++) {
        struct nvd_sqe sqe = {0};
        int rc = nvd_ring_build_read(ring, work, ring->first + k, (uint16_t)(k % ring->queue_depth), &sqe);
        out[k] = sqe;
        if (rc && !first_error)
            first_error = rc;
    }
    return first_error;
}
