/*
 * The controller emulator's strict side (see native/nvme_emu.c): address translation through the
 * mapped regions, the checks every SQE must pass (NVMe 1.4: the Read command, PRP rules of section
 * 4.3, CID uniqueness among outstanding commands) and the data movement of one command. A failed
 * check is counted as a violation, its first message kept, and answered with the status a controller
 * would post.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "nvme_emu.h"

uint64_t emu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void emu_violation(struct nvd_emu *emu, const char *fmt, uint64_t a, uint64_t b, uint64_t c)
{
    if (emu->violations++ == 0)
        snprintf(emu->first_violation, sizeof emu->first_violation, fmt, (unsigned long long)a,
                 (unsigned long long)b, (unsigned long long)c);
}

/* Host address of device range [iova, iova + len), or NULL when no single region holds it. */
uint8_t *emu_translate(const struct nvd_emu *emu, uint64_t iova, uint64_t len)
{
    for (uint32_t r = 0; r < emu->nregions; r++) {
        const struct emu_region *reg = &emu->regions[r];
        if (iova >= reg->iova && len <= reg->size && iova - reg->iova <= reg->size - len)
            return reg->host + (iova - reg->iova);
    }
    return NULL;
}

/* The data segments of a read of `len` bytes at PRP1/PRP2, validated; returns 0 or a status code. */
static int emu_prp_segments(struct nvd_emu *emu, const struct nvd_sqe *sqe, uint64_t len, uint64_t *nsegs)
{
    uint64_t prp1 = sqe->prp1, prp2 = sqe->prp2, n = 0;
    if (prp1 & 3) {
        emu_violation(emu, "PRP1 %#llx not dword aligned (cid %llu)%.0llu", prp1, sqe->cid, 0);
        return SC_PRP_OFFSET_INVALID;
    }
    uint64_t first = NVD_PAGE - (prp1 & (NVD_PAGE - 1));
    first = first < len ? first : len;
    emu->seg_iova[n] = prp1;
    emu->seg_len[n++] = first;
    uint64_t remaining = len - first;
    if (remaining == 0) {
        /* Not used by the command; our builders write 0, so anything else is a builder bug. */
        if (prp2 != 0) {
            emu_violation(emu, "unused PRP2 is %#llx, not 0 (cid %llu)%.0llu", prp2, sqe->cid, 0);
            return SC_INVALID_FIELD;
        }
    } else if (remaining <= NVD_PAGE) {
        if (prp2 & (NVD_PAGE - 1)) {
            emu_violation(emu, "PRP2 %#llx (second data page) not page aligned (cid %llu)%.0llu", prp2, sqe->cid, 0);
            return SC_PRP_OFFSET_INVALID;
        }
        emu->seg_iova[n] = prp2;
        emu->seg_len[n++] = remaining;
    } else {
        if (prp2 & 7) {
            emu_violation(emu, "PRP list pointer %#llx not qword aligned (cid %llu)%.0llu", prp2, sqe->cid, 0);
            return SC_PRP_OFFSET_INVALID;
        }
        uint64_t entry_iova = prp2;
        while (remaining) {
            const volatile uint64_t *entry = (const uint64_t *)emu_translate(emu, entry_iova, 8);
            if (entry == NULL) {
                emu_violation(emu, "PRP list entry at %#llx outside every mapped region (cid %llu)%.0llu",
                              entry_iova, sqe->cid, 0);
                return SC_DATA_TRANSFER_ERROR;
            }
            uint64_t value = *entry;
            /* The last entry of a list page points to the next list page when more than one data
             * page is still to come. */
            if (((entry_iova + 8) & (NVD_PAGE - 1)) == 0 && remaining > NVD_PAGE) {
                if (value & (NVD_PAGE - 1)) {
                    emu_violation(emu, "chained PRP list %#llx not page aligned (cid %llu)%.0llu", value, sqe->cid, 0);
                    return SC_PRP_OFFSET_INVALID;
                }
                entry_iova = value;
                continue;
            }
            if (value & (NVD_PAGE - 1)) {
                emu_violation(emu, "PRP list entry %#llx not page aligned (cid %llu)%.0llu", value, sqe->cid, 0);
                return SC_PRP_OFFSET_INVALID;
            }
            uint64_t take = remaining < NVD_PAGE ? remaining : NVD_PAGE;
            if (n == emu->max_segs) {
                emu_violation(emu, "more PRP entries than MDTS allows (cid %llu)%.0llu%.0llu", sqe->cid, 0, 0);
                return SC_INVALID_FIELD;
            }
            emu->seg_iova[n] = value;
            emu->seg_len[n++] = take;
            remaining -= take;
            entry_iova += 8;
        }
    }
    *nsegs = n;
    return SC_SUCCESS;
}

/* Validate and execute one SQE (a copy: the ring may change under us); returns its status. */
uint16_t emu_execute(struct nvd_emu *emu, uint32_t qid, const struct nvd_sqe *sqe, int *delay)
{
    struct emu_queue *q = &emu->queues[qid];
    *delay = 0;
    if (q->cid_busy[sqe->cid]) {
        emu_violation(emu, "CID %llu already outstanding on queue %llu%.0llu", sqe->cid, qid, 0);
        return nvd_cqe_status(0, SC_CID_CONFLICT, 1, 0);
    }
    q->cid_busy[sqe->cid] = 1;
    if (sqe->opcode != NVD_OPC_READ) {
        emu_violation(emu, "opcode %#llx is not Read (cid %llu, queue %llu)", sqe->opcode, sqe->cid, qid);
        return nvd_cqe_status(0, SC_INVALID_OPCODE, 1, 0);
    }
    if (sqe->flags != 0 || sqe->cdw2 || sqe->cdw3 || sqe->mptr || (sqe->cdw12 >> 16) || sqe->cdw13 || sqe->cdw14 ||
        sqe->cdw15) {
        emu_violation(emu, "reserved or unsupported field set (flags %#llx, cdw12 %#llx, cid %llu)", sqe->flags,
                      sqe->cdw12, sqe->cid);
        return nvd_cqe_status(0, SC_INVALID_FIELD, 1, 0);
    }
    if (sqe->nsid != 1) {
        emu_violation(emu, "namespace %llu does not exist (cid %llu)%.0llu", sqe->nsid, sqe->cid, 0);
        return nvd_cqe_status(0, SC_INVALID_NAMESPACE, 1, 0);
    }
    uint64_t slba = (uint64_t)sqe->cdw10 | (uint64_t)sqe->cdw11 << 32, nblocks = (sqe->cdw12 & 0xFFFFu) + 1;
    if (slba >= emu->nsze || nblocks > emu->nsze - slba) {
        emu_violation(emu, "LBAs %llu+%llu beyond the namespace (cid %llu)", slba, nblocks, sqe->cid);
        return nvd_cqe_status(0, SC_LBA_OUT_OF_RANGE, 1, 0);
    }
    uint64_t len = nblocks * emu->lba_size, nsegs = 0;
    if (len > emu->mdts_bytes) {
        emu_violation(emu, "%llu bytes exceed MDTS (%llu bytes, cid %llu)", len, emu->mdts_bytes, sqe->cid);
        return nvd_cqe_status(0, SC_INVALID_FIELD, 1, 0);
    }
    int sc = emu_prp_segments(emu, sqe, len, &nsegs);
    if (sc)
        return nvd_cqe_status(0, sc, 1, 0);
    uint8_t *targets[nsegs > 0 ? nsegs : 1];
    for (uint64_t s = 0; s < nsegs; s++) {
        targets[s] = emu_translate(emu, emu->seg_iova[s], emu->seg_len[s]);
        if (targets[s] == NULL) {
            emu_violation(emu, "data page %#llx+%llu outside every mapped region (cid %llu)", emu->seg_iova[s],
                          emu->seg_len[s], sqe->cid);
            return nvd_cqe_status(0, SC_DATA_TRANSFER_ERROR, 1, 0);
        }
    }
    if (emu->fail_modulo && slba % emu->fail_modulo == emu->fail_remainder) {
        emu->injected_errors++;
        return nvd_cqe_status(emu->fail_sct, emu->fail_sc, 1, 0);
    }
    const uint8_t *src = emu->backing + slba * emu->lba_size;
    for (uint64_t s = 0; s < nsegs; s++) {
        memcpy(targets[s], src, emu->seg_len[s]);
        src += emu->seg_len[s];
    }
    emu->bytes_read += len;
    if (emu->delay_modulo && slba % emu->delay_modulo == emu->delay_remainder) {
        emu->injected_delays++;
        *delay = 1;
    }
    return 0;
}

