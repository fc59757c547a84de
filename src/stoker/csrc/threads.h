/* threads.c: what the engine's workers (pool.c) and the staging's readers (staging.c) share about threads:
 * the fork generation (a pthread_atfork child handler), condition variables on the monotonic clock with waits
 * bounded by a deadline, and threads started with every signal blocked.
 *
 * Fork: a child process has none of its parent's threads, and a mutex or condition variable of theirs may be
 * held, or owe wake-ups, to threads that do not exist there. Whatever owns threads records fork_generation()
 * when it is made (after fork_watch()); where the two differ later it is its parent's, and its threads and
 * locks are left alone. */
#ifndef STOKER_THREADS_H
#define STOKER_THREADS_H

#include <pthread.h>
#include <time.h>

/* registers the child handler once a process (later calls: a load); returns fork_generation() */
unsigned fork_watch(void);
/* 0 in the process that called fork_watch first, bumped in each child forked after (one thread runs there) */
unsigned fork_generation(void);

/* a condition variable whose timed waits use the monotonic clock (not moved by changes of the wall clock) */
void cond_init(pthread_cond_t *cv);
/* the monotonic time ``seconds`` from now (capped at about 30 years: as good as forever, and no overflow) */
void deadline_after(struct timespec *ts, double seconds);
/* whether the monotonic clock has reached ``deadline`` */
int deadline_past(const struct timespec *deadline);
/* one wait on cv (made by cond_init, mu held) until ``deadline`` at most; it may return before (a wake-up, a
 * spurious one; macOS, which has no monotonic condition variables, waits in slices of 10 ms) */
void cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, const struct timespec *deadline);
/* cond_wait_until ``seconds`` from now */
void cond_wait_for(pthread_cond_t *cv, pthread_mutex_t *mu, double seconds);
/* seconds on the monotonic clock (for deadlines kept as a number) */
double mono_s(void);

/* Starts fn(arg) on a new thread (detached: never joined; else joinable) with every signal blocked: it
 * inherits the mask it is created with, so a signal for the process (Ctrl-C, a launcher's SIGTERM) goes to a
 * Python thread, whose handler runs there, and never cuts a worker's open or read short with EINTR. The
 * caller's mask is as it was after. 0 started, else an error number (pthread_attr_init's or pthread_create's:
 * EAGAIN, the system gives no thread). */
int thread_start(pthread_t *id, int detached, void *(*fn)(void *), void *arg);

#endif
