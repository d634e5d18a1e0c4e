/*
 * NVMe hot path, part 2: the loop that keeps one queue pair full for a whole batch of reads or
 * writes (a `struct nvd_run` of extents) without returning to Python per command.
 *
 * native/build_vfio.py appends this file after native/nvme_queue.c into one module, so it uses that
 * file's structs and static helpers (nvd_push, nvd_reap_into, nvd_ring_sq, ...).
 */

/* Submit run commands while slots, CIDs and the in-flight limit allow; one doorbell for all. */
static void nvd_run_fill(struct nvd_qpair *qp, struct nvd_run *run)
{
    uint64_t now = 0;  /* read once per batch, when the first command goes out */
    while (!run->stop && run->next_extent < run->count && run->in_flight < run->max_in_flight && qp->nfree) {
        const struct nvd_extent *ext = &run->extents[run->next_extent];
        uint64_t nblocks = ext->nblocks - run->next_block;
        if (nblocks > run->max_blocks)
            nblocks = run->max_blocks;
        uint64_t lba = ext->slba + run->next_block;
        uint64_t at = run->next_block * run->lba_size;    /* byte of this command within the extent */
        uint64_t nbytes = nblocks * run->lba_size;
        uint32_t cdw[6] = {(uint32_t)lba, (uint32_t)(lba >> 32), (uint32_t)(nblocks - 1), 0, 0, 0};
        uint16_t slot = NVD_MAX_SLOTS;
        int cid;
        if (ext->copy_to != NULL) {
            if (run->nslots == 0) {
                run->error = NVD_NO_STAGING;
                run->stop = 1;
                break;
            }
            if (run->nfree_slots == 0)
                break;
            slot = run->free_slots[run->nfree_slots - 1];
            cid = nvd_push(qp, run->next_extent, (uint8_t)run->opcode, run->nsid, cdw, run->staging_pages,
                           run->staging_npages, (uint64_t)slot * run->slot_bytes, nbytes, 0);
        } else {
            cid = nvd_push(qp, run->next_extent, (uint8_t)run->opcode, run->nsid, cdw, ext->pages, ext->npages,
                           ext->offset + at, nbytes, 0);
        }
        if (cid == NVD_QUEUE_FULL)
            break;
        if (cid < 0) {
            run->error = cid;
            run->stop = 1;
            break;
        }
        if (slot != NVD_MAX_SLOTS) {
            /* The overlap of the wanted bytes [copy_skip, copy_skip + copy_len) and this command's. */
            uint64_t lo = at > ext->copy_skip ? at : ext->copy_skip;
            uint64_t end = ext->copy_skip + ext->copy_len, hi = at + nbytes < end ? at + nbytes : end;
            run->nfree_slots--;
            qp->slot[cid] = slot;
            qp->copy_dst[cid] = ext->copy_to + (lo - ext->copy_skip);
            qp->copy_src[cid] = (uint32_t)(lo - at);
            qp->copy_len[cid] = hi > lo ? (uint32_t)(hi - lo) : 0;
        }
        if (!now)
            now = nvd_now_ns();
        qp->submitted_ns[cid] = now;
        run->in_flight++;
        run->submitted++;
        run->next_block += nblocks;
        if (run->next_block == ext->nblocks) {
            run->next_extent++;
            run->next_block = 0;
        }
    }
    nvd_ring_sq(qp);
}

/* A run whose extents are filled in starts over: nothing done yet, every staging slot free. */
static void nvd_run_prepare(struct nvd_run *run)
{
    run->next_extent = 0;
    run->next_block = 0;
    run->in_flight = 0;
    run->submitted = run->completed = 0;
    run->failed_extent = -1;
    run->failed_status = 0;
    run->stop = 0;
    run->error = 0;
    if (run->nslots > NVD_MAX_SLOTS)
        run->nslots = NVD_MAX_SLOTS;
    run->nfree_slots = 0;
    for (uint32_t s = 0; s < run->nslots; s++)
        run->free_slots[run->nfree_slots++] = (uint16_t)(run->nslots - 1 - s);
}

static int nvd_run_timed_out(const struct nvd_qpair *qp, uint64_t now, uint64_t timeout_ns)
{
    for (uint32_t cid = 0; cid + 1 < qp->depth; cid++) {
        uint32_t tag = qp->tags[cid];
        if (tag < NVD_TAG_QUARANTINED && now - qp->submitted_ns[cid] > timeout_ns)
            return 1;
    }
    return 0;
}

/* Keep the queue full with the run's commands, reaping as they finish, for at most `budget_ns`.
 * Returns NVD_RUN_DONE once everything was submitted and completed, NVD_RUN_FAILED once nothing
 * is left in flight after a failure (failed_extent, failed_status, error say which), NVD_RUN_AGAIN when the budget ran out (call again), NVD_RUN_TIMEOUT
 * when a command is older than the run's timeout (Python checks the controller, then calls
 * nvd_run_expire), NVD_RUN_FOREIGN when completions for Python's own commands are waiting. */
int nvd_run(struct nvd_qpair *qp, struct nvd_run *run, uint64_t budget_ns)
{
    uint64_t start = nvd_now_ns(), now;
    uint32_t idle = 0;
    qp->run = run;
    for (;;) {
        nvd_run_fill(qp, run);
        if (run->in_flight == 0 && (run->stop || run->next_extent == run->count)) {
            qp->run = NULL;
            return run->failed_extent >= 0 || run->error ? NVD_RUN_FAILED : NVD_RUN_DONE;
        }
        int nout = (int)qp->nforeign;
        int consumed = nvd_reap_into(qp, qp->foreign, NVD_FOREIGN_MAX, &nout);
        qp->nforeign = (uint32_t)nout;
        if (qp->nforeign)
            return NVD_RUN_FOREIGN;
        if (consumed) {
            idle = 0;
            continue;
        }
        if (++idle % 64)
            continue;
        now = nvd_now_ns();
        if (nvd_run_timed_out(qp, now, qp->timeout_ns))
            return NVD_RUN_TIMEOUT;
        if (now - start >= budget_ns)
            return NVD_RUN_AGAIN;
        if (qp->idle_sleep_ns) {
            /* Give the CPU away briefly: on a shared host (a TCG guest, a busy box) the device's
             * emulation or the rest of the pipeline may need the core we would spin on. */
            struct timespec pause = {0, (long)qp->idle_sleep_ns};
            nanosleep(&pause, NULL);
        }
    }
}

/* Start `run` with at most `max_in_flight` commands in flight; the same outcomes as nvd_run. */
int nvd_run_start(struct nvd_qpair *qp, struct nvd_run *run, uint32_t max_in_flight, uint64_t budget_ns)
{
    run->max_in_flight = max_in_flight;
    nvd_run_prepare(run);
    return nvd_run(qp, run, budget_ns);
}

/* Fail the run's commands older than its timeout with a host status; their CIDs stay quarantined
 * (the device may still write their buffers or post their CQEs) until they complete late or the
 * queue is reset. Returns how many expired. */
uint32_t nvd_run_expire(struct nvd_qpair *qp, struct nvd_run *run, uint32_t host_status)
{
    uint64_t now = nvd_now_ns();
    uint32_t expired = 0;
    for (uint32_t cid = 0; cid + 1 < qp->depth; cid++) {
        uint32_t tag = qp->tags[cid];
        if (tag >= NVD_TAG_QUARANTINED || now - qp->submitted_ns[cid] <= qp->timeout_ns)
            continue;
        nvd_run_fail(run, tag, NVD_HOST_STATUS | host_status);
        if (qp->slot[cid] != NVD_MAX_SLOTS) {  /* the slot too stays out of use: the device may write it */
            qp->slot[cid] = NVD_MAX_SLOTS;
        }
        qp->tags[cid] = NVD_TAG_QUARANTINED;
        qp->quarantined++;
        run->in_flight--;
        expired++;
    }
    return expired;
}

