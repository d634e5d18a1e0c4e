/*
 * NVMe hot path, part 1: command ids, PRPs, SQE writes, doorbells and completion reaping for one
 * queue pair (native/nvme_run.c, appended after this file into the same module, adds the loop that
 * keeps a queue full for a whole batch).
 *
 * Python (nvmedirect/queues/qpair.py) allocates every array, owns the DMA memory and decides what
 * to do about timeouts and controller faults; this file does the per-command work. The doorbell
 * writer takes a plain address, so the same code serves a BAR mapped by the CPU and, later, a BAR
 * window mapped for the GPU (the seed's GPU-MMIO doorbell path).
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "nvme_sqe.h"  /* struct nvd_sqe / nvd_cqe, the SQE and PRP builder shared with the GPU kernels */

union nvd_reg_cap {
    uint64_t raw;
    struct {
        uint64_t mqes : 16; uint64_t cqr : 1; uint64_t ams : 2; uint64_t rsvd19 : 5;
        uint64_t to : 8; uint64_t dstrd : 4; uint64_t nssrs : 1; uint64_t css : 8;
        uint64_t bps : 1; uint64_t rsvd46 : 2; uint64_t mpsmin : 4; uint64_t mpsmax : 4;
        uint64_t pmrs : 1; uint64_t cmbs : 1; uint64_t rsvd58 : 6;
    } bits;
};

union nvd_reg_cc {
    uint32_t raw;
    struct {
        uint32_t en : 1; uint32_t rsvd1 : 3; uint32_t css : 3; uint32_t mps : 4; uint32_t ams : 3;
        uint32_t shn : 2; uint32_t iosqes : 4; uint32_t iocqes : 4; uint32_t rsvd24 : 8;
    } bits;
};

union nvd_reg_csts {
    uint32_t raw;
    struct {
        uint32_t rdy : 1; uint32_t cfs : 1; uint32_t shst : 2; uint32_t nssro : 1; uint32_t pp : 1;
        uint32_t rsvd6 : 26;
    } bits;
};

union nvd_reg_aqa {
    uint32_t raw;
    struct { uint32_t asqs : 12; uint32_t rsvd12 : 4; uint32_t acqs : 12; uint32_t rsvd28 : 4; } bits;
};

_Static_assert(sizeof(union nvd_reg_cap) == 8, "CAP is a 64-bit register");
_Static_assert(sizeof(union nvd_reg_cc) == 4, "CC is a 32-bit register");

#define NVD_TAG_FREE 0xFFFFFFFFu            /* CID on the free stack */
#define NVD_TAG_PYTHON 0xFFFFFFFEu          /* submitted by nvd_submit: its CQE is handed to Python */
#define NVD_TAG_QUARANTINED 0xFFFFFFFDu     /* timed out: free again once the device completes it */
#define NVD_HOST_STATUS 0x10000u            /* flag on a run's failed_status: a host outcome, not a CQE */
#define NVD_QUEUE_FULL (-4)
#define NVD_NO_STAGING (-5)                 /* a staged extent in a run without staging slots */
#define NVD_MAX_SLOTS 64
#define NVD_FOREIGN_MAX 64

enum { NVD_RUN_DONE = 0, NVD_RUN_AGAIN = 1, NVD_RUN_TIMEOUT = 2, NVD_RUN_FOREIGN = 3, NVD_RUN_FAILED = 4 };

/* One contiguous LBA range of a batch. Direct: the data lands in (or comes from) the device pages
 * `pages` from byte `offset`. Staged (reads into memory the device cannot reach, or at addresses
 * PRPs cannot express): each command reads into a staging slot and the wanted bytes, `copy_len`
 * of them starting `copy_skip` bytes into the range, are copied to `copy_to`. */
struct nvd_extent {
    uint64_t slba;
    uint64_t nblocks;
    const uint64_t *pages;
    uint64_t npages;
    uint64_t offset;
    uint8_t *copy_to;
    uint64_t copy_skip;
    uint64_t copy_len;
};

/* A batch of extents moved with one opcode, and how far it has got. */
struct nvd_run {
    const struct nvd_extent *extents;
    uint32_t count;
    uint32_t opcode, nsid, lba_size, max_blocks, max_in_flight;
    /* staging slots for staged extents: host view, device pages, slot size */
    uint8_t *staging;
    const uint64_t *staging_pages;
    uint64_t staging_npages;
    uint32_t slot_bytes, nslots, nfree_slots;
    uint16_t free_slots[NVD_MAX_SLOTS];
    /* progress: the next command starts at block `next_block` of extent `next_extent` */
    uint32_t next_extent;
    uint64_t next_block;
    uint32_t in_flight;
    uint64_t submitted, completed;
    int64_t failed_extent;                  /* -1, else the extent of the first failure */
    uint32_t failed_status;                 /* its CQE status (phase bit dropped), or NVD_HOST_STATUS | sc */
    uint32_t stop;                          /* submit nothing more; only reap what is in flight */
    int32_t error;                          /* a submit's build error (-1..-3, -5), or 0 */
};

/* Per-CID state lives in arrays of depth - 1 entries (one SQ slot stays empty: head == tail means
 * empty), allocated by Python. */
struct nvd_qpair {
    struct nvd_sqe *sq;
    struct nvd_cqe *cq;
    volatile uint32_t *sq_doorbell, *cq_doorbell;   /* NULL: notify `hook` instead (test fakes) */
    void *hook;
    uint32_t depth, sq_tail, sq_head, unrung;     /* SQ entries; the SQ holds depth - 1 commands */
    uint32_t cq_depth, cq_head, phase;
    uint32_t cq_unannounced;                /* CQEs consumed since the last CQ head doorbell */
    uint32_t nfree, quarantined;
    uint64_t late_completions;
    uint64_t sq_doorbells, cq_doorbells;    /* MMIO writes so far (each is a VM exit when emulated) */
    uint64_t idle_sleep_ns;                 /* 0: pure polling; else sleep this long when idle */
    uint64_t timeout_ns;                    /* a run's commands older than this have timed out */
    uint16_t *free_cids;                    /* a stack: low CIDs on top */
    uint32_t *tags;                         /* run extent index, or NVD_TAG_* */
    uint64_t *submitted_ns;                 /* when each run command was submitted */
    uint8_t **copy_dst;                     /* staged run commands: where their bytes go, */
    uint32_t *copy_src, *copy_len;          /* from which byte of the slot, how many */
    uint16_t *slot;                         /* which staging slot (NVD_MAX_SLOTS: none) */
    uint64_t *prp_list_host;                /* CID c's PRP list pages: host view at c * list_pages pages, */
    const uint64_t *prp_list_pages;         /* their device addresses at [c * list_pages ...] */
    uint32_t list_pages;
    struct nvd_run *run;                    /* the batch in progress, if any */
    struct nvd_cqe foreign[NVD_FOREIGN_MAX];/* completions for Python reaped inside a run */
    uint32_t nforeign;
};

static void nvd_doorbell_hook(void *hook, uint32_t which, uint32_t value);  /* extern "Python" */

/* Order every earlier store to host memory (the SQE, a PRP list) before the device can see the
 * doorbell. x86 keeps stores in order (TSO, the BAR is uncached), so a compiler barrier suffices;
 * weaker architectures need a real store barrier that also covers device memory. */
static inline void nvd_store_barrier(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("" ::: "memory");
#elif defined(__aarch64__)
    __asm__ __volatile__("dsb st" ::: "memory");
#else
    __sync_synchronize();
#endif
}

/* Keep the loads of a CQE's body after the load of its phase bit. */
static inline void nvd_load_barrier(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("" ::: "memory");
#elif defined(__aarch64__)
    __asm__ __volatile__("dmb ld" ::: "memory");
#else
    __sync_synchronize();
#endif
}

static uint64_t nvd_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void nvd_doorbell(struct nvd_qpair *qp, volatile uint32_t *doorbell, uint32_t which, uint32_t value)
{
    nvd_store_barrier();
    if (doorbell != NULL)
        *doorbell = value;  /* one aligned 32-bit store: MMIO registers must not be written piecewise */
    else
        nvd_doorbell_hook(qp->hook, which, value);
}

/* Tell the controller which CQ entries it may reuse. */
static void nvd_ring_cq(struct nvd_qpair *qp)
{
    if (qp->cq_unannounced) {
        nvd_doorbell(qp, qp->cq_doorbell, 1, qp->cq_head);
        qp->cq_unannounced = 0;
        qp->cq_doorbells++;
    }
}

/* Announce every SQE written since the last ring with one tail doorbell write. */
static void nvd_ring_sq(struct nvd_qpair *qp)
{
    if (qp->unrung) {
        nvd_doorbell(qp, qp->sq_doorbell, 0, qp->sq_tail);
        qp->unrung = 0;
        qp->sq_doorbells++;
    }
}

/* Take a CID, build its PRPs (when it moves data) and write the SQE into the ring at the tail.
 * The doorbell is not written: callers ring once per batch. Returns the CID or a negative code. */
static int nvd_push(struct nvd_qpair *qp, uint32_t tag, uint8_t opcode, uint32_t nsid, const uint32_t *cdw,
                    const uint64_t *pages, uint64_t npages, uint64_t byte_offset, uint64_t nbytes, uint64_t prp1)
{
    uint64_t prps[2] = {prp1, 0};
    if (qp->nfree == 0)
        return NVD_QUEUE_FULL;
    uint16_t cid = qp->free_cids[qp->nfree - 1];
    if (nbytes) {
        uint64_t *list = qp->list_pages ? qp->prp_list_host + (uint64_t)cid * qp->list_pages * NVD_LIST_ENTRIES : NULL;
        const uint64_t *list_pages = qp->list_pages ? qp->prp_list_pages + (uint64_t)cid * qp->list_pages : NULL;
        int rc = nvd_build_prps(pages, npages, byte_offset, nbytes, list, list_pages, qp->list_pages, prps);
        if (rc)
            return rc;
    }
    /* The CQ head doorbell waits until the entries are needed: every command in flight (this one
     * included) must find a CQ slot the controller knows to be free. Consuming a CQE frees a CID
     * as it adds an unannounced entry, so this check at submission is the only one needed. */
    uint32_t outstanding = qp->depth - 1 - qp->nfree;
    if (qp->cq_unannounced + outstanding + 1 > qp->cq_depth - 1)
        nvd_ring_cq(qp);
    qp->nfree--;
    qp->tags[cid] = tag;
    struct nvd_sqe sqe;
    nvd_sqe_fill(&sqe, opcode, (uint16_t)cid, nsid, cdw, prps[0], prps[1]);
    qp->sq[qp->sq_tail] = sqe;
    qp->sq_tail = qp->sq_tail + 1 == qp->depth ? 0 : qp->sq_tail + 1;
    qp->unrung++;
    return cid;
}

static void nvd_release(struct nvd_qpair *qp, uint16_t cid)
{
    qp->tags[cid] = NVD_TAG_FREE;
    qp->free_cids[qp->nfree++] = cid;
}

/* One general command for Python (admin commands, single I/Os). */
int nvd_submit(struct nvd_qpair *qp, uint8_t opcode, uint32_t nsid, const uint32_t *cdw, const uint64_t *pages,
               uint64_t npages, uint64_t byte_offset, uint64_t nbytes, uint64_t prp1, int ring)
{
    int cid = nvd_push(qp, NVD_TAG_PYTHON, opcode, nsid, cdw, pages, npages, byte_offset, nbytes, prp1);
    if (cid >= 0 && ring)
        nvd_ring_sq(qp);
    return cid;
}

void nvd_ring(struct nvd_qpair *qp)
{
    nvd_ring_sq(qp);
}

/* Record the first failure of a run: device statuses keep their CQE form, host outcomes are flagged. */
static void nvd_run_fail(struct nvd_run *run, uint32_t extent, uint32_t status)
{
    if (run->failed_extent < 0) {
        run->failed_extent = extent;
        run->failed_status = status;
    }
    run->stop = 1;
}

/* A run command finished: copy staged bytes out, give the slot and the CID back. */
static void nvd_run_complete(struct nvd_qpair *qp, struct nvd_run *run, uint16_t cid, uint16_t status)
{
    uint32_t extent = qp->tags[cid];
    uint16_t slot = qp->slot[cid];
    if (status & NVD_STATUS_ERROR_BITS)
        nvd_run_fail(run, extent, status & 0xFFFEu);
    else if (slot != NVD_MAX_SLOTS)
        memcpy(qp->copy_dst[cid], run->staging + (uint64_t)slot * run->slot_bytes + qp->copy_src[cid], qp->copy_len[cid]);
    if (slot != NVD_MAX_SLOTS) {
        run->free_slots[run->nfree_slots++] = slot;
        qp->slot[cid] = NVD_MAX_SLOTS;
    }
    run->in_flight--;
    run->completed++;
    nvd_release(qp, cid);
}

/* Copy out every new CQE (phase tag matches); the CQ head doorbell is written lazily (nvd_push).
 * Completions of run
 * commands are finished here; those of Python's commands go to `out` (or, inside a run, to the
 * qpair's foreign buffer). Returns how many CQEs were consumed. */
static int nvd_reap_into(struct nvd_qpair *qp, struct nvd_cqe *out, int max_out, int *nout)
{
    int consumed = 0;
    for (;;) {
        volatile struct nvd_cqe *entry = &qp->cq[qp->cq_head];
        if ((entry->status & 1u) != qp->phase)
            break;
        if (*nout == max_out)
            break;
        nvd_load_barrier();
        struct nvd_cqe cqe;
        memcpy(&cqe, (const void *)entry, sizeof(cqe));
        if (++qp->cq_head == qp->cq_depth) {
            qp->cq_head = 0;
            qp->phase ^= 1u;
        }
        consumed++;
        qp->cq_unannounced++;
        qp->sq_head = cqe.sq_head;
        uint32_t tag = cqe.cid < qp->depth - 1 ? qp->tags[cqe.cid] : NVD_TAG_FREE;
        if (tag == NVD_TAG_PYTHON) {
            nvd_release(qp, cqe.cid);
            out[(*nout)++] = cqe;  /* Python delivers it to the command's handle */
        } else if (tag == NVD_TAG_FREE) {
            out[(*nout)++] = cqe;  /* Python reports a completion for an idle CID */
        } else if (tag == NVD_TAG_QUARANTINED) {
            qp->quarantined--;
            qp->late_completions++;
            nvd_release(qp, cqe.cid);
        } else if (qp->run != NULL) {
            nvd_run_complete(qp, qp->run, cqe.cid, cqe.status);
        } else {
            out[(*nout)++] = cqe;
        }
    }
    return consumed;
}

/* Python's poll: CQEs for its commands into `out` (up to max_out); spins up to `max_spins` times
 * while nothing has arrived, so a waiting caller does not pay a Python round trip per empty look. */
int nvd_reap(struct nvd_qpair *qp, struct nvd_cqe *out, int max_out, uint64_t max_spins)
{
    int nout = 0;
    while (nout < max_out && qp->nforeign) {  /* reaped earlier inside a run */
        out[nout++] = qp->foreign[--qp->nforeign];
    }
    nvd_ring_sq(qp);
    uint64_t spins = 0;
    for (;;) {
        int consumed = nvd_reap_into(qp, out, max_out, &nout);
        if (consumed || nout || ++spins >= max_spins)
            return nout;
    }
}

/* Python's command `cid` timed out: keep its CID out of circulation until it completes late. */
void nvd_quarantine(struct nvd_qpair *qp, uint16_t cid)
{
    qp->tags[cid] = NVD_TAG_QUARANTINED;
    qp->quarantined++;
}

/* After a controller reset (or before freeing the rings): every CID is free again, the run in
 * progress (if any) has nothing in flight and fails with `host_status`; ring indices restart. */
void nvd_reset(struct nvd_qpair *qp, uint32_t host_status)
{
    struct nvd_run *run = qp->run;
    if (run != NULL) {
        if (run->in_flight)
            nvd_run_fail(run, run->next_extent < run->count ? run->next_extent : run->count - 1,
                         NVD_HOST_STATUS | host_status);
        run->in_flight = 0;
        run->nfree_slots = 0;
        for (uint32_t s = 0; s < run->nslots; s++)
            run->free_slots[run->nfree_slots++] = (uint16_t)(run->nslots - 1 - s);
    }
    qp->nfree = 0;
    for (uint32_t c = qp->depth - 1; c-- > 0;) {
        qp->tags[c] = NVD_TAG_FREE;
        qp->slot[c] = NVD_MAX_SLOTS;
        qp->free_cids[qp->nfree++] = (uint16_t)c;
    }
    qp->quarantined = 0;
    qp->nforeign = 0;
    qp->sq_tail = qp->sq_head = qp->cq_head = qp->unrung = qp->cq_unannounced = 0;
    qp->phase = 1;  /* the controller writes phase 1 on its first pass */
}
