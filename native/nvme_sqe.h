/*
 * The one builder of NVMe submission entries, PRPs and doorbell offsets, shared by every submitter:
 * the CPU shim (native/nvme_queue.c, through cffi), the controller emulator's reference submitter
 * (native/nvme_emu.c) and the GPU kernels (nvmedirect/gpu/doorbell.cu, through NVRTC or nvcc). So
 * what a GPU thread writes into a submission ring is byte for byte what the CPU path writes, and
 * what QEMU's controller already accepts from the CPU path.
 *
 * NVMe base specification 1.4: the SQE (section 4.2), the CQE (4.6), PRP entries and lists (4.3),
 * doorbell registers at 0x1000 + (2 * qid + is_cq) * (4 << CAP.DSTRD) (3.1.20 and 3.1.21).
 * Everything here is plain integer work on caller-owned memory: no allocation, no libc calls, so it
 * compiles as C (gcc) and as CUDA device code alike.
 */
#ifndef NVD_NVME_SQE_H
#define NVD_NVME_SQE_H

#if defined(__CUDACC_RTC__)
/* NVRTC has no libc headers: the fixed-width types the layouts need. */
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

#if defined(__CUDACC__)
#define NVD_FN static __host__ __device__ __forceinline__
#define NVD_STATIC_ASSERT(cond, why) static_assert(cond, why)
#else
#define NVD_FN static inline
#define NVD_STATIC_ASSERT(cond, why) _Static_assert(cond, why)
#endif

#define NVD_PAGE 4096u                      /* CC.MPS = 0: the memory page size PRPs are built for */
#define NVD_LIST_ENTRIES 512u               /* 8-byte PRP entries per list page */
#define NVD_DOORBELL_BASE 0x1000u
#define NVD_OPC_READ 0x02u

/* Build errors (a command that cannot be expressed; never reaches the device). */
#define NVD_PRP_OUTSIDE (-1)                /* range outside the buffer */
#define NVD_PRP_MISALIGNED (-2)             /* PRP1 not dword aligned */
#define NVD_PRP_NO_LIST (-3)                /* more PRP list pages needed than the command owns */

struct nvd_sqe {
    uint8_t opcode; uint8_t flags; uint16_t cid; uint32_t nsid;
    uint32_t cdw2; uint32_t cdw3; uint64_t mptr; uint64_t prp1; uint64_t prp2;
    uint32_t cdw10; uint32_t cdw11; uint32_t cdw12; uint32_t cdw13; uint32_t cdw14; uint32_t cdw15;
};

struct nvd_cqe {
    uint32_t dw0; uint32_t dw1; uint16_t sq_head; uint16_t sq_id; uint16_t cid; uint16_t status;
};

NVD_STATIC_ASSERT(sizeof(struct nvd_sqe) == 64, "an NVMe submission queue entry is 64 bytes");
NVD_STATIC_ASSERT(sizeof(struct nvd_cqe) == 16, "an NVMe completion queue entry is 16 bytes");
NVD_STATIC_ASSERT(__builtin_offsetof(struct nvd_sqe, prp1) == 24, "PRP1 is dwords 6-7 of an SQE");
NVD_STATIC_ASSERT(__builtin_offsetof(struct nvd_sqe, cdw10) == 40, "CDW10 is dword 10 of an SQE");
NVD_STATIC_ASSERT(__builtin_offsetof(struct nvd_cqe, cid) == 12, "the CID shares dword 3 with the status");

/* Byte offset of a queue's doorbell in BAR0: SQ tail (is_cq 0) or CQ head (is_cq 1). */
NVD_FN uint32_t nvd_doorbell_offset(uint32_t qid, uint32_t is_cq, uint32_t dstrd)
{
    return NVD_DOORBELL_BASE + (2u * qid + is_cq) * (4u << dstrd);
}

/* The SQE of any command: CDW0 (opcode, CID; FUSE = 0, PSDT = 0: PRPs), NSID, PRPs, CDW10-15.
 * Metadata pointer and CDW2-3 stay zero. Built whole in `out` so the caller copies it into the ring
 * in one go (the ring may be device-visible memory that should not see half a command rewritten). */
NVD_FN void nvd_sqe_fill(struct nvd_sqe *out, uint8_t opcode, uint16_t cid, uint32_t nsid, const uint32_t *cdw,
                         uint64_t prp1, uint64_t prp2)
{
    out->opcode = opcode;
    out->flags = 0;
    out->cid = cid;
    out->nsid = nsid;
    out->cdw2 = 0;
    out->cdw3 = 0;
    out->mptr = 0;
    out->prp1 = prp1;
    out->prp2 = prp2;
    out->cdw10 = cdw[0];
    out->cdw11 = cdw[1];
    out->cdw12 = cdw[2];
    out->cdw13 = cdw[3];
    out->cdw14 = cdw[4];
    out->cdw15 = cdw[5];
}

/* CDW10-15 of an NVM Read or Write: SLBA in CDW10-11, NLB (0-based) in CDW12 bits 15:0. */
NVD_FN void nvd_rw_cdw(uint32_t *cdw, uint64_t slba, uint32_t nblocks)
{
    cdw[0] = (uint32_t)slba;
    cdw[1] = (uint32_t)(slba >> 32);
    cdw[2] = nblocks - 1;
    cdw[3] = cdw[4] = cdw[5] = 0;
}

/* PRP1/PRP2 (and PRP list entries) for `nbytes` at `byte_offset` of a buffer whose 4 KiB pages sit
 * at device addresses pages[0..npages). PRP1 may start anywhere dword aligned in its page; every
 * later page is whole. Two pages: PRP2 is the second page. More: PRP2 points at a list in the
 * pages `list` (host or kernel view; device addresses `list_pages`), 512 entries each; the last
 * entry of a full page chains to the next page. Writes prps[0] and prps[1]; returns 0 or an
 * NVD_PRP_* error. */
NVD_FN int nvd_build_prps(const uint64_t *pages, uint64_t npages, uint64_t byte_offset, uint64_t nbytes,
                          uint64_t *list, const uint64_t *list_pages, uint32_t nlist_pages, uint64_t *prps)
{
    uint64_t first = byte_offset / NVD_PAGE, within = byte_offset % NVD_PAGE;
    uint64_t count = (within + nbytes + NVD_PAGE - 1) / NVD_PAGE;
    if (nbytes == 0 || first + count > npages)
        return NVD_PRP_OUTSIDE;
    prps[0] = pages[first] + within;
    if (prps[0] & 3)
        return NVD_PRP_MISALIGNED;
    if (count == 1) {
        prps[1] = 0;
        return 0;
    }
    if (count == 2) {
        prps[1] = pages[first + 1];
        return 0;
    }
    uint64_t remaining = count - 1, src = first + 1;
    for (uint32_t lp = 0; lp < nlist_pages; lp++) {
        uint64_t *entries = list + (uint64_t)lp * NVD_LIST_ENTRIES;
        if (remaining <= NVD_LIST_ENTRIES) {
            for (uint64_t i = 0; i < remaining; i++)
                entries[i] = pages[src + i];
            prps[1] = list_pages[0];
            return 0;
        }
        for (uint32_t i = 0; i < NVD_LIST_ENTRIES - 1; i++)
            entries[i] = pages[src + i];
        entries[NVD_LIST_ENTRIES - 1] = lp + 1 < nlist_pages ? list_pages[lp + 1] : 0;
        src += NVD_LIST_ENTRIES - 1;
        remaining -= NVD_LIST_ENTRIES - 1;
    }
    return NVD_PRP_NO_LIST;
}

/* A read of `nblocks` LBAs from `slba` into `nbytes` at `byte_offset` of `pages`: PRPs, then the
 * whole SQE in `out`. Returns 0 or an NVD_PRP_* error. */
NVD_FN int nvd_sqe_read(struct nvd_sqe *out, uint16_t cid, uint32_t nsid, uint64_t slba, uint32_t nblocks,
                        uint32_t lba_size, const uint64_t *pages, uint64_t npages, uint64_t byte_offset,
                        uint64_t *list, const uint64_t *list_pages, uint32_t nlist_pages)
{
    uint64_t prps[2];
    uint32_t cdw[6];
    int rc = nvd_build_prps(pages, npages, byte_offset, (uint64_t)nblocks * lba_size, list, list_pages,
                            nlist_pages, prps);
    if (rc)
        return rc;
    nvd_rw_cdw(cdw, slba, nblocks);
    nvd_sqe_fill(out, NVD_OPC_READ, cid, nsid, cdw, prps[0], prps[1]);
    return 0;
}

/* CQE status word: bit 0 phase tag, SC bits 8:1, SCT bits 11:9, CRD 13:12, More 14, DNR 15. */
#define NVD_CQE_PHASE 1u
#define NVD_STATUS_ERROR_BITS 0x0FFEu       /* SC and SCT: zero means success */
NVD_FN uint16_t nvd_cqe_status(uint32_t sct, uint32_t sc, uint32_t dnr, uint32_t phase)
{
    return (uint16_t)((dnr & 1u) << 15 | (sct & 7u) << 9 | (sc & 0xFFu) << 1 | (phase & 1u));
}

#endif /* NVD_NVME_SQE_H */
