/* Threads: the fork generation, monotonic timed waits, threads started with signals blocked (see threads.h).
 * pool.c's engine and staging.c's readers both use these: one atfork counter for the process, one shape of
 * every bounded wait. */
#include "threads.h"

#include <signal.h>

static unsigned generation; /* bumped in a child by the atfork handler (one thread runs there) */
static pthread_once_t watch_once = PTHREAD_ONCE_INIT;

static void forked_child(void) { __atomic_add_fetch(&generation, 1, __ATOMIC_RELAXED); }

static void watch(void) { pthread_atfork(NULL, NULL, forked_child); }

unsigned fork_watch(void) {
    pthread_once(&watch_once, watch);
    return fork_generation();
}

unsigned fork_generation(void) { return __atomic_load_n(&generation, __ATOMIC_RELAXED); }

void cond_init(pthread_cond_t *cv) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
#if !defined(__APPLE__)
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* waits are not moved by changes of the wall clock */
#endif
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
}

void deadline_after(struct timespec *ts, double seconds) {
    if (seconds > 1e9) /* about 30 years: as good as forever, and no overflow */
        seconds = 1e9;
    if (!(seconds > 0)) /* (NaN too) */
        seconds = 0;
    clock_gettime(CLOCK_MONOTONIC, ts);
    long long ns = ts->tv_nsec + (long long)((seconds - (double)(long long)seconds) * 1e9);
    ts->tv_sec += (time_t)seconds + ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

int deadline_past(const struct timespec *deadline) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > deadline->tv_sec || (now.tv_sec == deadline->tv_sec && now.tv_nsec >= deadline->tv_nsec);
}

void cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, const struct timespec *deadline) {
#if defined(__APPLE__)
    (void)deadline;
    struct timespec rel = {0, 10 * 1000 * 1000};
    pthread_cond_timedwait_relative_np(cv, mu, &rel);
#else
    pthread_cond_timedwait(cv, mu, deadline);
#endif
}

void cond_wait_for(pthread_cond_t *cv, pthread_mutex_t *mu, double seconds) {
    struct timespec deadline;
    deadline_after(&deadline, seconds);
    cond_wait_until(cv, mu, &deadline);
}

double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int thread_start(pthread_t *id, int detached, void *(*fn)(void *), void *arg) {
    pthread_attr_t attr;
    int made = pthread_attr_init(&attr);
    if (made != 0)
        return made;
    if (detached)
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigset_t all, before;
    sigfillset(&all);
    int masked = pthread_sigmask(SIG_SETMASK, &all, &before) == 0;
    int rc = pthread_create(id, &attr, fn, arg);
    if (masked)
        pthread_sigmask(SIG_SETMASK, &before, NULL);
    pthread_attr_destroy(&attr);
    return rc;
}
