/*
 * An NVMe controller emulator for tests: a thread that watches the doorbell words of an ordinary
 * host memory page standing in for BAR0, fetches and strictly validates every SQE, reads from a
 * backing file into the PRP targets and posts completions with the right phase tag. Any submitter
 * drives it: the CPU shim (native/nvme_queue.c), the CPU reference submitter (native/nvme_emu_host.c),
 * or GPU kernels writing the page through a host-registered mapping (nvmedirect/gpu/doorbell.cu).
 * The strict checks of each command live in native/nvme_emu_validate.c.
 *
 * Not a device model for production: no admin queue (queues are attached by a call, as Create I/O
 * CQ/SQ would), reads only, one namespace (NSID 1). Device addresses are translated through a small
 * table of mapped regions, like an IOMMU: an address outside every region is a violation.
 * Built with plain gcc (nvmedirect/emulator.py) and loaded through cffi's ABI mode, so it needs no
 * Python headers or setuptools on the machine that runs it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nvme_emu.h"

/* ---- lifetime and configuration -------------------------------------------------------------- */

struct nvd_emu *nvd_emu_create(const char *backing_path, uint32_t lba_size, uint64_t mdts_bytes, uint32_t dstrd,
                               uint32_t mqes)
{
    struct nvd_emu *emu = calloc(1, sizeof *emu);
    if (emu == NULL)
        return NULL;
    int fd = open(backing_path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) || st.st_size < (off_t)lba_size) {
        if (fd >= 0)
            close(fd);
        free(emu);
        return NULL;
    }
    emu->backing = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (emu->backing == MAP_FAILED) {
        free(emu);
        return NULL;
    }
    emu->backing_bytes = st.st_size;
    emu->lba_size = lba_size;
    emu->nsze = st.st_size / lba_size;
    emu->mdts_bytes = mdts_bytes;
    emu->dstrd = dstrd;
    emu->max_segs = mdts_bytes / NVD_PAGE + 2;
    emu->seg_iova = calloc(emu->max_segs, sizeof(uint64_t));
    emu->seg_len = calloc(emu->max_segs, sizeof(uint64_t));
    /* Registers, then a doorbell pair per possible queue, rounded up to whole pages. */
    uint64_t bytes = nvd_doorbell_offset(EMU_MAX_QUEUES, 0, dstrd);
    emu->bar_bytes = (bytes + NVD_PAGE - 1) / NVD_PAGE * NVD_PAGE;
    void *bar = mmap(NULL, emu->bar_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    emu->bar = bar == MAP_FAILED ? NULL : bar;
    if (emu->bar == NULL || emu->seg_iova == NULL || emu->seg_len == NULL) {
        munmap((void *)emu->backing, emu->backing_bytes);
        free(emu->seg_iova);
        free(emu->seg_len);
        free(emu);
        return NULL;
    }
    /* CAP: MQES, CQR (contiguous queues required), TO = 2 s, DSTRD, CSS = NVM; VS = 1.4.0. */
    uint64_t cap = (uint64_t)mqes | 1ull << 16 | 4ull << 24 | (uint64_t)dstrd << 32 | 1ull << 37;
    emu->bar[0] = (uint32_t)cap;
    emu->bar[1] = (uint32_t)(cap >> 32);
    emu->bar[2] = 0x00010400u;
    emu->bar[7] = 1;  /* CSTS.RDY: the emulator is always enabled */
    pthread_mutex_init(&emu->lock, NULL);
    return emu;
}

uint64_t nvd_emu_bar(struct nvd_emu *emu) { return (uint64_t)(uintptr_t)emu->bar; }
uint64_t nvd_emu_bar_bytes(struct nvd_emu *emu) { return emu->bar_bytes; }
uint64_t nvd_emu_nsze(struct nvd_emu *emu) { return emu->nsze; }
const char *nvd_emu_first_violation(struct nvd_emu *emu) { return emu->first_violation; }

/* Make host memory [host, host + size) reachable by the device at [iova, iova + size). */
int nvd_emu_map(struct nvd_emu *emu, uint64_t iova, uint64_t host, uint64_t size)
{
    pthread_mutex_lock(&emu->lock);
    int rc = emu->nregions < EMU_MAX_REGIONS ? 0 : -ENOSPC;
    if (!rc)
        emu->regions[emu->nregions++] = (struct emu_region){iova, size, (uint8_t *)(uintptr_t)host};
    pthread_mutex_unlock(&emu->lock);
    return rc;
}

int nvd_emu_unmap(struct nvd_emu *emu, uint64_t iova)
{
    pthread_mutex_lock(&emu->lock);
    int rc = -ENOENT;
    for (uint32_t r = 0; r < emu->nregions; r++) {
        if (emu->regions[r].iova == iova) {
            emu->regions[r] = emu->regions[--emu->nregions];
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&emu->lock);
    return rc;
}

/* Attach I/O queue `qid` (1..63) with contiguous rings at device addresses sq_iova and cq_iova, as
 * Create I/O CQ and SQ would; its doorbells start at zero. */
int nvd_emu_attach(struct nvd_emu *emu, uint32_t qid, uint64_t sq_iova, uint32_t sq_size, uint64_t cq_iova,
                   uint32_t cq_size)
{
    if (qid == 0 || qid >= EMU_MAX_QUEUES || sq_size < 2 || cq_size < 2 || sq_size > EMU_MAX_CID || cq_size > EMU_MAX_CID)
        return -EINVAL;
    pthread_mutex_lock(&emu->lock);
    struct emu_queue *q = &emu->queues[qid];
    void *sq = emu_translate(emu, sq_iova, (uint64_t)sq_size * sizeof(struct nvd_sqe));
    void *cq = emu_translate(emu, cq_iova, (uint64_t)cq_size * sizeof(struct nvd_cqe));
    int rc = q->live ? -EBUSY : sq == NULL || cq == NULL ? -EFAULT : 0;
    if (!rc && q->cid_busy == NULL)
        q->cid_busy = calloc(EMU_MAX_CID, 1);
    if (!rc && q->cid_busy == NULL)
        rc = -ENOMEM;
    if (!rc) {
        memset(q->cid_busy, 0, EMU_MAX_CID);
        q->sq = sq;
        q->cq = cq;
        q->sq_size = sq_size;
        q->cq_size = cq_size;
        q->sq_head = q->sq_tail = q->cq_tail = q->cq_head = q->delayed = 0;
        q->phase = 1;  /* the first pass through the CQ writes phase 1 */
        emu->bar[nvd_doorbell_offset(qid, 0, emu->dstrd) / 4] = 0;
        emu->bar[nvd_doorbell_offset(qid, 1, emu->dstrd) / 4] = 0;
        __atomic_thread_fence(__ATOMIC_RELEASE);
        q->live = 1;
    }
    pthread_mutex_unlock(&emu->lock);
    return rc;
}

int nvd_emu_detach(struct nvd_emu *emu, uint32_t qid)
{
    if (qid == 0 || qid >= EMU_MAX_QUEUES)
        return -EINVAL;
    pthread_mutex_lock(&emu->lock);
    emu->queues[qid].live = 0;
    /* Completions still held back for it are dropped, as a deleted queue's would be. */
    uint32_t kept = 0;
    for (uint32_t d = 0; d < emu->ndelayed; d++)
        if (emu->delayed[d].qid != qid)
            emu->delayed[kept++] = emu->delayed[d];
    emu->ndelayed = kept;
    pthread_mutex_unlock(&emu->lock);
    return 0;
}

void nvd_emu_inject_status(struct nvd_emu *emu, uint64_t modulo, uint64_t remainder, uint32_t sct, uint32_t sc)
{
    emu->fail_modulo = modulo;
    emu->fail_remainder = remainder;
    emu->fail_sct = sct;
    emu->fail_sc = sc;
}

void nvd_emu_inject_delay(struct nvd_emu *emu, uint64_t modulo, uint64_t remainder, uint64_t delay_ns)
{
    emu->delay_modulo = modulo;
    emu->delay_remainder = remainder;
    emu->delay_ns = delay_ns;
}

void nvd_emu_set_idle_sleep(struct nvd_emu *emu, uint64_t ns) { emu->idle_sleep_ns = ns; }

/* Counters: 0 fetched, 1 completed, 2 bytes read, 3 injected errors, 4 injected delays,
 * 5 SQ doorbell writes seen, 6 CQ doorbell writes seen, 7 violations. */
uint64_t nvd_emu_counter(struct nvd_emu *emu, uint32_t which)
{
    const volatile uint64_t *all[] = {&emu->fetched, &emu->completed, &emu->bytes_read, &emu->injected_errors,
                                      &emu->injected_delays, &emu->sq_doorbells, &emu->cq_doorbells,
                                      &emu->violations};
    return which < 8 ? *all[which] : 0;
}

/* ---- the controller ---------------------------------------------------------------------------- */

/* Write a CQE: body first, then (after a release fence) dword 3, whose phase bit tells the host the
 * entry is new. CID and status share that dword, so a reader that sees the new phase with one
 * 32-bit load sees the matching CID too. The data the command moved was written before the fence. */
static void emu_post(struct emu_queue *q, const struct nvd_cqe *cqe)
{
    /* A CID conflict's completion names the CID of the other, still outstanding command. */
    int conflict = (cqe->status & NVD_STATUS_ERROR_BITS) == nvd_cqe_status(0, SC_CID_CONFLICT, 0, 0);
    volatile uint32_t *entry = (volatile uint32_t *)&q->cq[q->cq_tail];
    entry[0] = cqe->dw0;
    entry[1] = cqe->dw1;
    entry[2] = (uint32_t)cqe->sq_head | (uint32_t)cqe->sq_id << 16;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    entry[3] = (uint32_t)cqe->cid | (uint32_t)((cqe->status & ~NVD_CQE_PHASE) | q->phase) << 16;
    if (!conflict)
        q->cid_busy[cqe->cid] = 0;
    if (++q->cq_tail == q->cq_size) {
        q->cq_tail = 0;
        q->phase ^= 1u;
    }
}

/* Fetch what the SQ tail doorbell announced, as far as free CQ slots allow. */
static int emu_service(struct nvd_emu *emu, uint32_t qid)
{
    struct emu_queue *q = &emu->queues[qid];
    uint32_t tail = emu->bar[nvd_doorbell_offset(qid, 0, emu->dstrd) / 4];
    uint32_t head = emu->bar[nvd_doorbell_offset(qid, 1, emu->dstrd) / 4];
    /* Pairs with the submitter's fence before its doorbell store: SQEs read below are at least as
     * new as the tail we just loaded. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (head != q->cq_head) {
        uint32_t used = (q->cq_tail + q->cq_size - q->cq_head) % q->cq_size;
        uint32_t advance = (head + q->cq_size - q->cq_head) % q->cq_size;
        if (head >= q->cq_size || advance > used) {
            emu_violation(emu, "CQ head doorbell %llu of queue %llu passes the tail %llu", head, qid, q->cq_tail);
        } else {
            q->cq_head = head;
            emu->cq_doorbells++;
        }
    }
    if (tail != q->sq_tail) {
        if (tail >= q->sq_size) {
            emu_violation(emu, "SQ tail doorbell %llu of queue %llu beyond its %llu entries", tail, qid, q->sq_size);
            return 0;
        }
        q->sq_tail = tail;
        emu->sq_doorbells++;
    }
    int progress = 0;
    while (q->sq_head != q->sq_tail) {
        uint32_t used = (q->cq_tail + q->cq_size - q->cq_head) % q->cq_size;
        if (used + q->delayed + 1 > q->cq_size - 1)
            break;  /* the CQ is full: a real controller waits too */
        struct nvd_sqe sqe;
        memcpy(&sqe, (const void *)&q->sq[q->sq_head], sizeof sqe);
        q->sq_head = q->sq_head + 1 == q->sq_size ? 0 : q->sq_head + 1;
        emu->fetched++;
        int delay;
        uint16_t status = emu_execute(emu, qid, &sqe, &delay);
        struct nvd_cqe cqe = {0, 0, (uint16_t)q->sq_head, (uint16_t)qid, sqe.cid, status};
        if (delay && emu->ndelayed < EMU_MAX_DELAYED) {
            emu->delayed[emu->ndelayed++] = (struct emu_delayed){emu_now_ns() + emu->delay_ns, qid, cqe};
            q->delayed++;
        } else {
            emu_post(q, &cqe);
            emu->completed++;
        }
        progress = 1;
    }
    return progress;
}

static int emu_post_due(struct nvd_emu *emu)
{
    if (emu->ndelayed == 0)
        return 0;
    uint64_t now = emu_now_ns();
    int progress = 0;
    for (uint32_t d = 0; d < emu->ndelayed;) {
        if (emu->delayed[d].due_ns > now) {
            d++;
            continue;
        }
        struct emu_queue *q = &emu->queues[emu->delayed[d].qid];
        q->delayed--;
        emu_post(q, &emu->delayed[d].cqe);
        emu->completed++;
        emu->delayed[d] = emu->delayed[--emu->ndelayed];
        progress = 1;
    }
    return progress;
}

static void *emu_loop(void *arg)
{
    struct nvd_emu *emu = arg;
    uint64_t idle = 0;
    while (!emu->stop) {
        int progress = 0;
        pthread_mutex_lock(&emu->lock);
        for (uint32_t qid = 1; qid < EMU_MAX_QUEUES; qid++)
            if (emu->queues[qid].live)
                progress |= emu_service(emu, qid);
        progress |= emu_post_due(emu);
        pthread_mutex_unlock(&emu->lock);
        if (progress) {
            idle = 0;
        } else if (++idle > 256) {
            /* Nothing to do: let a submitter sharing this core run (a CPU test on a small box). */
            if (emu->idle_sleep_ns) {
                struct timespec pause = {0, (long)emu->idle_sleep_ns};
                nanosleep(&pause, NULL);
            } else {
                sched_yield();
            }
        }
    }
    return NULL;
}

int nvd_emu_start(struct nvd_emu *emu)
{
    if (emu->running)
        return 0;
    emu->stop = 0;
    int rc = pthread_create(&emu->thread, NULL, emu_loop, emu);
    emu->running = rc == 0;
    return -rc;
}

void nvd_emu_stop(struct nvd_emu *emu)
{
    if (!emu->running)
        return;
    emu->stop = 1;
    pthread_join(emu->thread, NULL);
    emu->running = 0;
}

void nvd_emu_destroy(struct nvd_emu *emu)
{
    if (emu == NULL)
        return;
    nvd_emu_stop(emu);
    for (uint32_t qid = 0; qid < EMU_MAX_QUEUES; qid++)
        free(emu->queues[qid].cid_busy);
    munmap((void *)emu->bar, emu->bar_bytes);
    munmap((void *)emu->backing, emu->backing_bytes);
    free(emu->seg_iova);
    free(emu->seg_len);
    pthread_mutex_destroy(&emu->lock);
    free(emu);
}
