/*
 * The controller emulator's private layout, shared by its two halves: native/nvme_emu.c (lifetime,
 * configuration, the polling thread, completions) and native/nvme_emu_validate.c (the strict checks
 * and the data movement of one command). Not an interface: Python sees only the functions declared
 * in nvmedirect/emulator.py.
 */
#ifndef NVD_NVME_EMU_H
#define NVD_NVME_EMU_H

#include <pthread.h>

#include "nvme_ring.h"

#define EMU_MAX_QUEUES 64
#define EMU_MAX_REGIONS 64
#define EMU_MAX_DELAYED 8192
#define EMU_MAX_CID 65536

/* Generic command status values (NVMe 1.4 figure 126) and the media errors we inject. */
enum {
    SC_SUCCESS = 0x00, SC_INVALID_OPCODE = 0x01, SC_INVALID_FIELD = 0x02, SC_CID_CONFLICT = 0x03,
    SC_DATA_TRANSFER_ERROR = 0x04, SC_INVALID_NAMESPACE = 0x0B, SC_PRP_OFFSET_INVALID = 0x13,
    SC_LBA_OUT_OF_RANGE = 0x80,
};

struct emu_region { uint64_t iova, size; uint8_t *host; };

struct emu_queue {
    int live;
    volatile struct nvd_sqe *sq;
    volatile struct nvd_cqe *cq;
    uint32_t sq_size, cq_size;
    uint32_t sq_head;               /* next SQE to fetch */
    uint32_t sq_tail;               /* last tail doorbell value seen */
    uint32_t cq_tail, phase;        /* next CQE slot and the phase it is written with */
    uint32_t cq_head;               /* last CQ head doorbell value seen */
    uint32_t delayed;               /* completions held back: each has a CQ slot reserved */
    uint8_t *cid_busy;              /* outstanding CIDs: fetched, completion not yet posted */
};

struct emu_delayed { uint64_t due_ns; uint32_t qid; struct nvd_cqe cqe; };

struct nvd_emu {
    volatile uint32_t *bar;         /* the stand-in for BAR0: registers, then doorbells */
    uint64_t bar_bytes;
    uint32_t dstrd;
    const uint8_t *backing;         /* the namespace's bytes (the backing file, mapped) */
    uint64_t backing_bytes, nsze;   /* namespace size in LBAs */
    uint32_t lba_size;
    uint64_t mdts_bytes;
    struct emu_region regions[EMU_MAX_REGIONS];
    uint32_t nregions;
    struct emu_queue queues[EMU_MAX_QUEUES];
    struct emu_delayed delayed[EMU_MAX_DELAYED];
    uint32_t ndelayed;
    /* injection: commands whose SLBA % modulo == remainder (modulo 0: off) */
    uint64_t fail_modulo, fail_remainder; uint32_t fail_sct, fail_sc;
    uint64_t delay_modulo, delay_remainder, delay_ns;
    uint64_t idle_sleep_ns;         /* sleep this long when idle (0: spin) */
    pthread_t thread;
    volatile int running, stop;
    pthread_mutex_t lock;           /* attach/detach against the thread's loop */
    /* counters (read while running: approximate; exact after stop) */
    volatile uint64_t fetched, completed, bytes_read, injected_errors, injected_delays;
    volatile uint64_t sq_doorbells, cq_doorbells, violations;
    char first_violation[256];
    /* scratch of the fetching thread: one command's data segments */
    uint64_t *seg_iova, *seg_len;
    uint64_t max_segs;
};

uint64_t emu_now_ns(void);
void emu_violation(struct nvd_emu *emu, const char *fmt, uint64_t a, uint64_t b, uint64_t c);
uint8_t *emu_translate(const struct nvd_emu *emu, uint64_t iova, uint64_t len);
uint16_t emu_execute(struct nvd_emu *emu, uint32_t qid, const struct nvd_sqe *sqe, int *delay);

#endif /* NVD_NVME_EMU_H */
