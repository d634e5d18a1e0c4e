/*
 * What a submitter knows about one I/O queue pair and the reads it is to issue: shared by the GPU
 * kernels (nvmedirect/gpu/doorbell.cu) and the CPU reference submitter of the controller emulator
 * (native/nvme_emu.c), so both drive the same rings with the same commands. Python fills these
 * structs from bytes (nvmedirect/gpu/rings.py), hence every field is 64 bits wide: no padding to
 * agree on. Addresses are "views": pointers the submitter itself dereferences (host pointers for the
 * CPU, device pointers of host-registered memory for the GPU). "iova" fields are device addresses
 * the controller sees.
 */
#ifndef NVD_NVME_RING_H
#define NVD_NVME_RING_H

#include "nvme_sqe.h"

struct nvd_ring {
    uint64_t sq;            /* view of the SQ ring: depth entries of 64 bytes */
    uint64_t cq;            /* view of the CQ ring: cq_depth entries of 16 bytes */
    uint64_t sq_doorbell;   /* view of the SQ tail doorbell (a BAR0 word) */
    uint64_t cq_doorbell;   /* view of the CQ head doorbell */
    uint64_t lists;         /* view of the PRP list pages: CID c owns list_pages pages from c * list_pages */
    uint64_t list_iovas;    /* view of an array of their device addresses, same indexing */
    uint64_t depth, cq_depth;
    uint64_t queue_depth;   /* commands in flight at most: CIDs 0..queue_depth-1, < depth */
    uint64_t list_pages;
    uint64_t nsid, lba_size;
    uint64_t first, count;  /* this queue issues commands first..first+count-1 of the work */
    /* ring state, carried from one drive of the queue to the next (all 0, phase 1, when attached) */
    uint64_t sq_tail, cq_head, cq_phase;
};

/* The reads: command i reads nblocks[i] LBAs from slba[i] into byte dst_offset[i] of the
 * destination buffer, whose 4 KiB pages the device sees at dst_pages[0..dst_npages). The submitter
 * writes each command's outcome to status[i]: the CQE status without its phase bit (0: success),
 * or NVD_HOST_STATUS | a host code. */
struct nvd_work {
    uint64_t slba, nblocks, dst_offset;  /* views of uint64 arrays */
    uint64_t dst_pages, dst_npages;
    uint64_t status;                     /* view of a uint32 array */
};

NVD_STATIC_ASSERT(sizeof(struct nvd_ring) == 17 * 8, "struct nvd_ring is packed 64-bit fields");
NVD_STATIC_ASSERT(sizeof(struct nvd_work) == 6 * 8, "struct nvd_work is packed 64-bit fields");

#define NVD_HOST_STATUS 0x10000u             /* an outcome decided by the submitter, not a CQE */
#define NVD_HOST_TIMEOUT 0x01u               /* no completion within the submitter's timeout */
#define NVD_HOST_BUILD_ERROR 0x02u           /* the command could not be expressed (NVD_PRP_*) */
#define NVD_HOST_STRAY_CID 0x04u             /* a completion named a CID not in flight */

/* SQE of command i of `work` with CID `cid`, its PRP list (if any) in that CID's list pages. */
NVD_FN int nvd_ring_build_read(const struct nvd_ring *ring, const struct nvd_work *work, uint64_t i,
                               uint16_t cid, struct nvd_sqe *out)
{
    const uint64_t *slba = (const uint64_t *)work->slba, *nblocks = (const uint64_t *)work->nblocks;
    const uint64_t *offset = (const uint64_t *)work->dst_offset;
    uint64_t *lists = (uint64_t *)ring->lists + (uint64_t)cid * ring->list_pages * NVD_LIST_ENTRIES;
    const uint64_t *list_iovas = (const uint64_t *)ring->list_iovas + (uint64_t)cid * ring->list_pages;
    return nvd_sqe_read(out, cid, (uint32_t)ring->nsid, slba[i], (uint32_t)nblocks[i], (uint32_t)ring->lba_size,
                        (const uint64_t *)work->dst_pages, work->dst_npages, offset[i], lists, list_iovas,
                        (uint32_t)ring->list_pages);
}

#endif /* NVD_NVME_RING_H */
