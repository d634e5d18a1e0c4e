/*
 * NVMe hot path: SQE copy into the ring, CQ phase-tag polling, and MMIO doorbell writes.
 *
 * The doorbell writer takes a plain address so the same function serves a BAR mapped by the CPU
 * and, later, a BAR window mapped for the GPU (the seed's GPU-MMIO doorbell path).
 */
#include <stdint.h>
#include <string.h>

struct nvd_sqe {
    uint8_t opcode; uint8_t flags; uint16_t cid; uint32_t nsid;
    uint32_t cdw2; uint32_t cdw3; uint64_t mptr; uint64_t prp1; uint64_t prp2;
    uint32_t cdw10; uint32_t cdw11; uint32_t cdw12; uint32_t cdw13; uint32_t cdw14; uint32_t cdw15;
};

struct nvd_cqe {
    uint32_t dw0; uint32_t dw1; uint16_t sq_head; uint16_t sq_id; uint16_t cid; uint16_t status;
};

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

_Static_assert(sizeof(struct nvd_sqe) == 64, "an NVMe submission queue entry is 64 bytes");
_Static_assert(sizeof(struct nvd_cqe) == 16, "an NVMe completion queue entry is 16 bytes");
_Static_assert(sizeof(union nvd_reg_cap) == 8, "CAP is a 64-bit register");
_Static_assert(sizeof(union nvd_reg_cc) == 4, "CC is a 32-bit register");

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

static void nvd_doorbell_write(uintptr_t doorbell_address, uint32_t value)
{
    nvd_store_barrier();
    /* One aligned 32-bit store: MMIO registers must not be written piecewise. */
    *(volatile uint32_t *)doorbell_address = value;
}

static uint32_t nvd_mmio_read32(uintptr_t address)
{
    return *(volatile uint32_t *)address;
}

/* Copy one prepared SQE into the ring at `tail`; returns the new tail (wrapped). The doorbell is
 * not written here: the caller rings it once for a whole batch. */
static uint32_t nvd_sq_push(struct nvd_sqe *ring, uint32_t entries, uint32_t tail,
                            const struct nvd_sqe *sqe)
{
    memcpy(&ring[tail], sqe, sizeof(*sqe));
    return tail + 1 == entries ? 0 : tail + 1;
}

/* Copy out up to `max_entries` new CQEs (those whose phase tag matches *phase), advancing the head
 * and flipping the expected phase on wrap. Returns how many were copied; the caller writes the CQ
 * head doorbell once afterwards. */
static int nvd_cq_poll(struct nvd_cqe *ring, uint32_t entries, uint32_t *head, uint32_t *phase,
                       struct nvd_cqe *out, int max_entries)
{
    int found = 0;
    while (found < max_entries) {
        volatile struct nvd_cqe *entry = &ring[*head];
        if ((entry->status & 1u) != *phase)
            break;
        nvd_load_barrier();
        memcpy(&out[found], (const void *)entry, sizeof(*entry));
        found++;
        if (++*head == entries) {
            *head = 0;
            *phase ^= 1u;
        }
    }
    return found;
}

/* Like nvd_cq_poll, but spins up to `max_spins` times while nothing has arrived, so a waiting
 * caller does not pay a Python round trip per empty look. */
static int nvd_cq_poll_spin(struct nvd_cqe *ring, uint32_t entries, uint32_t *head, uint32_t *phase,
                            struct nvd_cqe *out, int max_entries, uint64_t max_spins)
{
    uint64_t spins = 0;
    int found;
    do {
        found = nvd_cq_poll(ring, entries, head, phase, out, max_entries);
    } while (found == 0 && ++spins < max_spins);
    return found;
}

/* PRP1/PRP2 (and PRP list entries) for `nbytes` at `byte_offset` of a buffer whose 4 KiB pages sit
 * at device addresses pages[0..npages). The list pages (host view `list`, device addresses
 * `list_pages`) hold 512 entries each; the last entry of a full page chains to the next page.
 * Writes prps[0] and prps[1]; returns 0, -1 (range outside the buffer), -2 (PRP1 not dword
 * aligned) or -3 (not enough list pages). Same rules as nvmedirect/queues/prp.py, which tests
 * them; this copy keeps the per-command cost off the Python interpreter. */
static int nvd_build_prps(const uint64_t *pages, uint64_t npages, uint64_t byte_offset, uint64_t nbytes,
                          uint64_t *list, const uint64_t *list_pages, uint32_t nlist_pages, uint64_t *prps)
{
    const uint64_t page = 4096, per_list = 512;
    uint64_t first = byte_offset / page, within = byte_offset % page;
    uint64_t count = (within + nbytes + page - 1) / page;
    if (nbytes == 0 || first + count > npages)
        return -1;
    prps[0] = pages[first] + within;
    if (prps[0] & 3)
        return -2;
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
        uint64_t *entries = list + lp * per_list;
        if (remaining <= per_list) {
            memcpy(entries, &pages[src], remaining * sizeof(uint64_t));
            prps[1] = list_pages[0];
            return 0;
        }
        memcpy(entries, &pages[src], (per_list - 1) * sizeof(uint64_t));
        entries[per_list - 1] = lp + 1 < nlist_pages ? list_pages[lp + 1] : 0;
        src += per_list - 1;
        remaining -= per_list - 1;
    }
    return -3;
}

/* Build an SQE directly in the ring slot at `tail` (no intermediate copy); returns the new tail. */
static uint32_t nvd_sq_write(struct nvd_sqe *ring, uint32_t entries, uint32_t tail, uint8_t opcode, uint16_t cid,
                             uint32_t nsid, uint64_t prp1, uint64_t prp2, uint32_t cdw10, uint32_t cdw11,
                             uint32_t cdw12, uint32_t cdw13, uint32_t cdw14, uint32_t cdw15)
{
    struct nvd_sqe *sqe = &ring[tail];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = opcode;
    sqe->cid = cid;
    sqe->nsid = nsid;
    sqe->prp1 = prp1;
    sqe->prp2 = prp2;
    sqe->cdw10 = cdw10;
    sqe->cdw11 = cdw11;
    sqe->cdw12 = cdw12;
    sqe->cdw13 = cdw13;
    sqe->cdw14 = cdw14;
    sqe->cdw15 = cdw15;
    return tail + 1 == entries ? 0 : tail + 1;
}
