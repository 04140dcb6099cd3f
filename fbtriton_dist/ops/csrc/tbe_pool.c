/* The native CPU kernels' threads: tbe_parallel(fn, ctx, ntasks, nthreads) runs fn(ctx, task,
 * executor) for every task, on the calling thread and up to nthreads - 1 pool threads.
 *
 * Tasks are claimed one at a time from a shared counter, and the caller returns once every
 * task is done: it never waits for a pool thread that has not claimed one. On a machine whose
 * cores are busy with other processes a fork-join team (OpenMP's) waits at every barrier
 * until each of its threads has been scheduled, which can take an OS time slice; here a late
 * thread finds no task left and goes back to sleep. `executor` (0 for the caller) names the
 * thread, for its scratch memory only: results never depend on who ran a task.
 *
 * Between jobs a pool thread polls for the next one for about 1 ms, first pausing, then
 * yielding its core to any other runnable thread at each poll, and only then sleeps: the host
 * code between two kernel calls (a module's forward runs the batch check, then ~0.1 ms of
 * Python, then the lookup) is shorter than that, and a woken sleeper made the next job up to
 * 2x slower than with the thread still polling (libgomp's threads poll for longer).
 *
 * A job runs on at most as many threads as the process may use cores: the CPUs of its
 * affinity mask (sched_getaffinity, at every job: taskset / os.sched_setaffinity may change it)
 * and its cgroup's CPU quota (cgroup v2 cpu.max or v1 cpu.cfs_quota_us of its own cgroup, read
 * once per process), whatever torch.get_num_threads() says: a second thread on one usable core
 * only takes turns with the first.
 *
 * One job at a time (a lock); the pool threads start at the first job that needs them, and
 * again in a forked child (threads do not survive fork). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tbe_cpu.h"

#define MAX_POOL 255
#define SPINS 4000     /* polls of the job counter (pause between) before yielding */
#define SPIN_NS 1000000 /* then polls between sched_yield()s for up to 1 ms, then sleep */

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;     /* the job's description */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int started;  /* pool threads running (in process `owner`) */
static pid_t owner;
static int quota_cpus; /* the cgroup's CPU quota, rounded up (0: none), in process quota_pid */
static pid_t quota_pid;
static _Atomic uint64_t generation; /* jobs published so far */
static _Atomic uint64_t claim;      /* generation << 32 | the next task */
static _Atomic int64_t done;        /* tasks of this generation finished */
static tbe_task job_fn;
static void *job_ctx;
static int64_t job_tasks;
static int job_threads;

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_tasks(uint64_t gen, tbe_task fn, void *ctx, int64_t n, int executor) {
    const uint64_t tag = (gen & 0xffffffffu) << 32;
    for (;;) {
        uint64_t c = atomic_load(&claim);
        if ((c & ~(uint64_t)0xffffffffu) != tag || (int64_t)(c & 0xffffffffu) >= n) return;
        if (!atomic_compare_exchange_weak(&claim, &c, c + 1)) continue;
        fn(ctx, (int64_t)(c & 0xffffffffu), executor);
        atomic_fetch_add(&done, 1);
    }
}

static void *pool_thread(void *arg) {
    const int executor = (int)(intptr_t)arg;
    uint64_t seen = atomic_load(&generation);
    for (;;) {
        for (int i = 0; i < SPINS && atomic_load(&generation) == seen; ++i) cpu_relax();
        if (atomic_load(&generation) == seen) {
            const int64_t until = now_ns() + SPIN_NS;
            while (atomic_load(&generation) == seen && now_ns() < until) sched_yield();
        }
        pthread_mutex_lock(&lock);
        while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &lock);
        seen = atomic_load(&generation);
        const tbe_task fn = job_fn;
        void *ctx = job_ctx;
        const int64_t n = job_tasks;
        const int threads = job_threads;
        pthread_mutex_unlock(&lock);
        if (executor < threads) run_tasks(seen, fn, ctx, n, executor);
    }
    return NULL;
}

/* the first line of `path` as two numbers (or "max" and a number: -1, n); how many were read */
static int read_pair(const char *path, long long *a, long long *b) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char word[32] = {0};
    int n = fscanf(f, "%31s %lld", word, b);
    fclose(f);
    if (n < 1) return 0;
    *a = strcmp(word, "max") == 0 ? -1 : atoll(word);
    return n;
}

/* does the comma-separated list name the controller "cpu"? */
static int has_cpu(const char *list) {
    for (const char *c = list; c; c = strchr(c, ',') ? strchr(c, ',') + 1 : NULL)
        if (strncmp(c, "cpu", 3) == 0 && (c[3] == ',' || c[3] == 0)) return 1;
    return 0;
}

/* CPUs of the quota of this process's own cgroup (v2 cpu.max, else v1 cfs_quota / period),
 * rounded up; 0 without one */
static int cgroup_cpus(void) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return 0;
    char line[4096], path[4200];
    long long q = -1, period = 0, p1 = 0;
    while (q < 0 && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c2 = 0;
        const char *controllers = c1 + 1, *where = c2 + 1;
        if (*controllers == 0) { /* v2 */
            snprintf(path, sizeof path, "/sys/fs/cgroup%s/cpu.max", where);
            if (read_pair(path, &q, &period) < 2) q = -1;
        } else if (has_cpu(controllers)) { /* v1: the hierarchy with the cpu controller */
            snprintf(path, sizeof path, "/sys/fs/cgroup/cpu%s/cpu.cfs_quota_us", where);
            if (read_pair(path, &q, &p1) < 1) q = -1;
            snprintf(path, sizeof path, "/sys/fs/cgroup/cpu%s/cpu.cfs_period_us", where);
            if (q > 0 && read_pair(path, &period, &p1) < 1) q = -1;
        }
    }
    fclose(f);
    if (q <= 0 || period <= 0) return 0;
    return (int)((q + period - 1) / period);
}

int tbe_usable_cpus(void) {
    int n = 0;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
    if (n <= 0) {
        const long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
    }
    if (quota_pid != getpid()) {
        quota_cpus = cgroup_cpus();
        quota_pid = getpid();
    }
    if (quota_cpus > 0 && quota_cpus < n) n = quota_cpus;
    return n;
}

/* pool threads running in this process (not counting the caller) */
int tbe_pool_started(void) { return owner == getpid() ? started : 0; }

/* at least `want` pool threads (fewer if the system refuses); returns how many run */
static int ensure_pool(int want) {
    if (owner != getpid()) { /* first use, or a forked child: its threads are gone */
        started = 0;
        owner = getpid();
        pthread_mutex_init(&lock, NULL);
        pthread_cond_init(&wake, NULL);
    }
    if (want > MAX_POOL) want = MAX_POOL;
    while (started < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int err = pthread_create(&t, &attr, pool_thread, (void *)(intptr_t)(started + 1));
        pthread_attr_destroy(&attr);
        if (err) break;
        ++started;
    }
    return started;
}

void tbe_parallel(tbe_task fn, void *ctx, int64_t ntasks, int nthreads) {
    if (nthreads > ntasks) nthreads = (int)ntasks;
    if (nthreads > 1) {
        const int usable = tbe_usable_cpus();
        if (nthreads > usable) nthreads = usable;
    }
    if (nthreads <= 1 || ntasks >= ((int64_t)1 << 31)) {
        for (int64_t t = 0; t < ntasks; ++t) fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&run_lock);
    const int pool = ensure_pool(nthreads - 1);
    pthread_mutex_lock(&lock);
    job_fn = fn, job_ctx = ctx, job_tasks = ntasks, job_threads = pool + 1 < nthreads ? pool + 1 : nthreads;
    const uint64_t gen = atomic_load(&generation) + 1;
    atomic_store(&done, 0);
    atomic_store(&claim, (gen & 0xffffffffu) << 32);
    atomic_store(&generation, gen);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    run_tasks(gen, fn, ctx, ntasks, 0);
    while (atomic_load(&done) < ntasks) sched_yield(); /* only tasks someone claimed are left */
    pthread_mutex_unlock(&run_lock);
}
