// GPU-initiated NVMe reads: GPU threads build SQEs in a submission ring, ring the SQ tail doorbell,
// poll completion phase tags and ring the CQ head doorbell, with the builder the CPU shim uses
// (native/nvme_sqe.h, native/nvme_ring.h; nvmedirect/gpu/doorbell.py inlines them). The rings, PRP
// lists and data live in host memory registered for the GPU (cudaHostRegisterMapped); the doorbells
// are words of BAR0 registered with cudaHostRegisterIoMemory on real hardware, or of the emulator's
// stand-in page in the tests.
//
// Memory ordering, the whole argument:
// - An SQE (and its PRP list) must reach the controller before a doorbell that covers it. Each
//   submitting thread stores its SQE, then __threadfence_system(): its stores are visible to every
//   observer of system memory (the CPU, a PCIe device) before any later store of that thread. The
//   block barrier then orders those threads before thread 0, which fences again and writes the
//   tail doorbell: a store the controller can only see after the SQEs.
// - A CQE is new when its phase tag flips. The controller writes the entry's body before dword 3
//   (CID, status, phase), so one 32-bit volatile load of dword 3 gives a consistent CID and status.
//   A reader that then wants the data the command moved fences (__threadfence_system) after seeing
//   the phase: nothing it loads afterwards is older than the completion.
// - The CQ head doorbell hands entries back; it is written after the entries were read (the values
//   were consumed before the barrier that precedes the write).

#include "nvme_ring.h"

#define NVD_MAX_QD 1024  // CIDs per queue: one thread each, so at most a block

static __device__ __forceinline__ uint64_t nvd_globaltimer_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The SQEs (and PRP lists) a submitter writes for commands ring.first.. with CID k % queue_depth:
// the GPU's side of the "same seed, same bytes" comparison with nvd_host_build (one thread each).
extern "C" __global__ void nvd_build_sqes(const struct nvd_ring *ring, const struct nvd_work *work,
                                          struct nvd_sqe *out, int *errors)
{
    uint64_t k = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= ring->count)
        return;
    struct nvd_sqe sqe = {};
    int rc = nvd_ring_build_read(ring, work, ring->first + k, (uint16_t)(k % ring->queue_depth), &sqe);
    out[k] = sqe;
    if (rc)
        atomicAdd(errors, 1);
}

// One block per queue pair; thread t owns CID t and issues commands first + t, first + t + qd, ...
// Each round: every free thread with work builds its SQE into a slot given by its rank among this
// round's submitters, thread 0 rings the tail once; every thread looks at one CQ entry ahead of the
// head, the leading run of new entries is consumed, thread 0 rings the head once; each owner of a
// completed CID records its status. A round with no progress for timeout_ns ends the drive with
// HOST_TIMEOUT for whatever is unfinished. stray[blockIdx.x] counts completions for CIDs not in flight.
extern "C" __global__ void nvd_drive_queues(struct nvd_ring *rings, const struct nvd_work *work,
                                            uint64_t timeout_ns, unsigned int *stray)
{
    struct nvd_ring *ring = &rings[blockIdx.x];
    const uint32_t t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const uint32_t qd = (uint32_t)ring->queue_depth, depth = (uint32_t)ring->depth, cq_depth = (uint32_t)ring->cq_depth;
    __shared__ uint32_t s_status[NVD_MAX_QD];
    __shared__ uint8_t s_done[NVD_MAX_QD];
    __shared__ uint32_t s_rank[NVD_MAX_QD / 32];
    __shared__ uint32_t s_tail, s_head, s_phase, s_nsub, s_first_new, s_abort;
    __shared__ uint64_t s_last_progress;
    struct nvd_sqe *sq = (struct nvd_sqe *)ring->sq;
    const volatile uint32_t *cq = (const volatile uint32_t *)ring->cq;
    uint32_t *status = (uint32_t *)work->status;
    const uint64_t end = ring->first + ring->count;
    uint64_t next = ring->first + t, mine = 0;
    bool busy = false;
    if (t < NVD_MAX_QD)
        s_done[t] = 0;
    if (t == 0) {
        s_tail = (uint32_t)ring->sq_tail;
        s_head = (uint32_t)ring->cq_head;
        s_phase = (uint32_t)ring->cq_phase;
        s_abort = 0;
        s_last_progress = nvd_globaltimer_ns();
    }
    __syncthreads();
    for (;;) {
        // -- submit: build, rank, store, fence; one doorbell for the round
        union { struct nvd_sqe sqe; uint4 words[4]; } entry;  // 16-byte aligned: stored as 4 vectors
        bool want = t < qd && !busy && next < end;
        if (want && nvd_ring_build_read(ring, work, next, (uint16_t)t, &entry.sqe)) {
            status[next] = NVD_HOST_STATUS | NVD_HOST_BUILD_ERROR;  // never reaches the ring
            next += qd;
            want = false;
        }
        uint32_t ballot = __ballot_sync(0xFFFFFFFFu, want);
        if (lane == 0)
            s_rank[warp] = __popc(ballot);
        __syncthreads();
        if (t == 0) {
            uint32_t sum = 0;
            for (uint32_t w = 0; w < (blockDim.x + 31) / 32; w++) {
                uint32_t n = s_rank[w];
                s_rank[w] = sum;
                sum += n;
            }
            s_nsub = sum;
            s_first_new = NVD_MAX_QD;
        }
        __syncthreads();
        if (want) {
            uint32_t slot = (s_tail + s_rank[warp] + __popc(ballot & ((1u << lane) - 1u))) % depth;
            uint4 *dst = (uint4 *)&sq[slot];  // SQ slots are 64-byte aligned
            dst[0] = entry.words[0];
            dst[1] = entry.words[1];
            dst[2] = entry.words[2];
            dst[3] = entry.words[3];
            __threadfence_system();  // this SQE and its PRP list before the doorbell that covers it
            busy = true;
            mine = next;
            next += qd;
        }
        __syncthreads();
        if (t == 0 && s_nsub) {
            s_tail = (s_tail + s_nsub) % depth;
            __threadfence_system();  // the submitters' SQEs, ordered to us by the barrier, go first
            *(volatile uint32_t *)ring->sq_doorbell = s_tail;
        }
        // -- reap: thread t looks at the entry t places after the head (at most qd can be new)
        uint32_t dw3 = 0;
        bool fresh = false;
        if (t < qd && t < cq_depth) {
            uint32_t pos = s_head + t, wrapped = pos >= cq_depth;
            dw3 = cq[(wrapped ? pos - cq_depth : pos) * 4 + 3];
            fresh = ((dw3 >> 16) & 1u) == (s_phase ^ wrapped);
            if (!fresh)
                atomicMin(&s_first_new, t);
        }
        __syncthreads();
        uint32_t consumed = s_first_new < qd ? s_first_new : (qd < cq_depth ? qd : cq_depth);
        if (fresh && t < consumed) {
            uint32_t cid = dw3 & 0xFFFFu;
            if (cid < qd) {
                s_status[cid] = (dw3 >> 16) & ~NVD_CQE_PHASE;
                s_done[cid] = 1;
            } else {
                atomicAdd(&stray[blockIdx.x], 1u);
            }
        }
        __syncthreads();
        if (t == 0) {
            uint64_t now = nvd_globaltimer_ns();
            if (consumed) {
                uint32_t head = s_head + consumed;
                if (head >= cq_depth) {
                    head -= cq_depth;
                    s_phase ^= 1u;
                }
                s_head = head;
                *(volatile uint32_t *)ring->cq_doorbell = head;  // entries read above: the controller may reuse them
                s_last_progress = now;
            } else if (!s_nsub && now - s_last_progress > timeout_ns) {
                s_abort = 1;
            }
        }
        if (t < qd && s_done[t]) {
            s_done[t] = 0;
            if (busy) {
                status[mine] = s_status[t];
                busy = false;
            } else {
                atomicAdd(&stray[blockIdx.x], 1u);
            }
        }
        int active = __syncthreads_or(busy || (t < qd && next < end));
        if (!active)
            break;
        if (s_abort) {
            if (busy)
                status[mine] = NVD_HOST_STATUS | NVD_HOST_TIMEOUT;
            for (; t < qd && next < end; next += qd)
                status[next] = NVD_HOST_STATUS | NVD_HOST_TIMEOUT;
            break;
        }
    }
    __syncthreads();
    if (t == 0) {
        ring->sq_tail = s_tail;
        ring->cq_head = s_head;
        ring->cq_phase = s_phase;
    }
}

// The probe: CAP (as two 32-bit reads: a 64-bit MMIO read may be split or refused) and VS of a
// BAR0 mapped for the GPU, read by a kernel.
extern "C" __global__ void nvd_read_registers(const volatile uint32_t *bar, uint32_t *out)
{
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = bar[0];  // CAP low
        out[1] = bar[1];  // CAP high
        out[2] = bar[2];  // VS
    }
}
