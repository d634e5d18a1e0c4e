/* A persistent pool of worker threads for the products (cpu_qdot.c), in place of an OpenMP region
 * per product: a decode step makes ~170 small products (tens of microseconds each), where starting
 * a team each time costs as much as the work, and a static split of the rows waits for the slowest
 * thread, which on a shared machine is often one the scheduler has taken away for a time slice.
 *
 * A task is n_chunks independent calls fn(ctx, i); the caller and the workers claim chunks one at a
 * time from a shared counter, so a thread that is not running simply takes fewer. Which thread
 * computes a chunk changes nothing in its result (every output has its own fixed float sequence,
 * cpu_qdot_common.h). Idle workers spin for a short while (the next product usually follows within
 * microseconds), then sleep on a condition variable. One task runs at a time: a second caller that
 * finds the pool busy runs its task on its own thread.
 */
#include "cpu_qdot_common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_MAX 64           /* workers at most (threads beyond the caller's) */
#define POOL_SPIN_NS 1000000 /* an idle worker spins this long before it sleeps */
#define CLAIMS_CLOSED 0xffffffffu /* the claim counter of a task whose fields are being replaced */

static struct {
    pthread_mutex_t mu;       /* guards the sleep/wake handshake */
    pthread_cond_t wake;
    pthread_mutex_t run;      /* held by the caller whose task the pool runs */
    int n_workers;            /* started so far (only the holder of `run` starts more) */
    _Atomic uint32_t gen;     /* task generation: a new value publishes a task */
    _Atomic uint64_t claim;   /* (generation << 32) | next chunk to hand out */
    _Atomic int done;         /* chunks finished in the current task */
    _Atomic int rc;           /* the task's lowest return code */
    _Atomic int sleepers;     /* workers waiting on `wake` */
    /* The task; read by workers only between loading `claim` and claiming a chunk of it, which
     * succeeds only while the task is current (so a stale read is never acted on). */
    _Atomic(qdot_chunk_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int n_chunks;
    _Atomic int n_threads;
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .run = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void)
{
#ifdef QDOT_X86
    _mm_pause();
#endif
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Claim and run chunks of task `g` until none is left (or another task has replaced it). */
static void run_chunks(uint32_t g, int id)
{
    for (;;) {
        uint64_t c = atomic_load(&P.claim);
        if ((uint32_t)(c >> 32) != g)
            return;
        uint32_t i = (uint32_t)c;  /* CLAIMS_CLOSED (above any chunk count) once the caller moves on */
        qdot_chunk_fn fn = atomic_load_explicit(&P.fn, memory_order_acquire);
        void *ctx = atomic_load_explicit(&P.ctx, memory_order_acquire);
        if (i >= (uint32_t)atomic_load_explicit(&P.n_chunks, memory_order_acquire) ||
            id >= atomic_load_explicit(&P.n_threads, memory_order_acquire))
            return;
        /* Fails unless the counter still reads c: fields read after the caller closed generation g
         * (to write the next task's) come with a counter that no longer does. */
        if (!atomic_compare_exchange_weak(&P.claim, &c, c + 1))
            continue;
        int rc = fn(ctx, (int)i);
        int old = atomic_load(&P.rc);
        while (rc < old && !atomic_compare_exchange_weak(&P.rc, &old, rc))
            ;
        atomic_fetch_add(&P.done, 1);
    }
}

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&P.gen);
    int wanted = 1;  /* whether the last task had room for this worker: if not, sleep without spinning */
    for (;;) {
        uint32_t g = atomic_load(&P.gen);
        if (g == seen) {
            long long until = now_ns() + (wanted ? POOL_SPIN_NS : 0);
            for (int spin = 0; (g = atomic_load(&P.gen)) == seen; spin++) {
                cpu_relax();
                if ((spin & 63) == 63) {  /* a thread that shares this core (a loaded machine) runs */
                    if (now_ns() > until)
                        break;
                    sched_yield();
                }
            }
            if (g == seen) {
                pthread_mutex_lock(&P.mu);
                atomic_fetch_add(&P.sleepers, 1);
                while ((g = atomic_load(&P.gen)) == seen)
                    pthread_cond_wait(&P.wake, &P.mu);
                atomic_fetch_sub(&P.sleepers, 1);
                pthread_mutex_unlock(&P.mu);
            }
        }
        seen = g;
        wanted = id < atomic_load_explicit(&P.n_threads, memory_order_relaxed);
        run_chunks(g, id);
    }
    return NULL;
}

/* After fork() only the calling thread exists in the child: forget the workers. */
static void pool_after_fork_child(void)
{
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.wake, NULL);
    pthread_mutex_init(&P.run, NULL);
    P.n_workers = 0;
    atomic_store(&P.sleepers, 0);
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

/* Start workers until `want` exist (or creating one fails); returns how many there are. */
static int ensure_workers(int want)
{
    pthread_once(&pool_once, pool_init);
    if (want > POOL_MAX)
        want = POOL_MAX;
    while (P.n_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(P.n_workers + 1));
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        P.n_workers++;
    }
    return P.n_workers;
}

static int run_inline(int n_chunks, qdot_chunk_fn fn, void *ctx)
{
    int rc = 0;
    for (int i = 0; i < n_chunks; i++) {
        int r = fn(ctx, i);
        rc = r < rc ? r : rc;
    }
    return rc;
}

int qdot_pool_run(int n_threads, int n_chunks, qdot_chunk_fn fn, void *ctx)
{
    if (n_threads <= 1 || n_chunks <= 1 || pthread_mutex_trylock(&P.run) != 0)
        return run_inline(n_chunks, fn, ctx);
    int workers = ensure_workers(n_threads - 1);
    if (workers < 1) {
        pthread_mutex_unlock(&P.run);
        return run_inline(n_chunks, fn, ctx);
    }
    /* Close the previous task's claims before its fields are overwritten: a worker still in its
     * run_chunks may have read the counter of the previous task (its chunks all claimed) and then
     * read this task's chunk count, which can exceed that counter; claiming against the previous
     * task's counter would run this task's function with a chunk index of that task, count it done
     * twice, and let the caller return while a chunk still reads its stack (seen as a crash in CI
     * once the one-call decode issued products back to back). */
    uint32_t g = atomic_load(&P.gen) + 1;
    atomic_store(&P.claim, ((uint64_t)(g - 1) << 32) | CLAIMS_CLOSED);
    atomic_store_explicit(&P.fn, fn, memory_order_release);
    atomic_store_explicit(&P.ctx, ctx, memory_order_release);
    atomic_store_explicit(&P.n_chunks, n_chunks, memory_order_release);
    atomic_store_explicit(&P.n_threads, n_threads, memory_order_release);
    atomic_store(&P.done, 0);
    atomic_store(&P.rc, 0);
    atomic_store(&P.claim, (uint64_t)g << 32);  /* publishes the fields above (seq_cst) */
    atomic_store(&P.gen, g);
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.wake);
        pthread_mutex_unlock(&P.mu);
    }
    run_chunks(g, 0);
    /* Only chunks already claimed by a worker remain; yield if it is not getting to run. */
    for (int spin = 0; atomic_load(&P.done) < n_chunks; spin++) {
        cpu_relax();
        if (spin > 1000)
            sched_yield();
    }
    int rc = atomic_load(&P.rc);
    pthread_mutex_unlock(&P.run);
    return rc;
}
