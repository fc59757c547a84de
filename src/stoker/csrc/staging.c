/* The GPU decode's reads (engine/gpu/staging.py): a wave's stored chunks read into one staging buffer by one call,
 * on the caller's thread and the helpers of a stage_pool (POSIX threads started once, at the pool's first round
 * with work for them, every signal blocked, as the engine's workers; without a pool, threads of the call's own);
 * and blosc1 frame headers parsed into streams (blosc_streams). See staging.h.
 *
 * Files are opened as the engine opens them (io.c: regular files only, non-blocking first, a shard's identity
 * checked at open and after its reads), so a shard rewritten since its index was read is ST_CHANGED here as
 * there. Every read lands inside the buffer: stage_check refuses a plan with a read past it before any byte is
 * read, and a whole file is read only where its size (stat'ed, then checked again at open) was placed.
 */
#if defined(__linux__)
#define _GNU_SOURCE /* pthread_setname_np */
#endif
#include "staging.h"
#include "threads.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_STAGE_THREADS 64
/* the name of a stage_pool's helper threads (at most 15 bytes on Linux) */
#define STAGE_THREAD_NAME "stoker-stage"

static long long threads_started; /* reader threads started in this process (stage_threads_started) */

int stage_check(const stage_plan *p, const char **error) {
    if (p->n_files < 0 || p->n_reads < 0 || p->buf_len < 0 || p->whole_base < 0 || p->whole_base > p->buf_len) {
        *error = "stage_read: negative sizes, or whole_base outside the buffer";
        return -1;
    }
    for (long long i = 0; i < p->n_reads; i++) {
        const int64_t *r = p->reads + i * STAGE_READ_COLS;
        if (r[SR_FILE] < 0 || r[SR_FILE] >= p->n_files || r[SR_LENGTH] < 0 || r[SR_OFFSET] < SR_ENTRY) {
            *error = "stage_read: a read names no file of the table, or has a negative length or offset";
            return -1;
        }
        if (r[SR_OFFSET] == SR_ENTRY) {
            const int64_t *id = p->idents == NULL ? NULL : p->idents + 2 * i;
            if (id == NULL || id[0] < 0 || id[1] < 0 || id[1] > ENTRY_IDENT_CAP || id[0] > p->ident_blob_len ||
                id[1] > p->ident_blob_len - id[0] || r[SR_LENGTH] > INT64_MAX - ENTRY_HEADER_BYTES - id[1]) {
                *error = "stage_read: an entry read's ident lies outside the idents blob, or is too long";
                return -1;
            }
        }
        if (r[SR_OFFSET] >= 0 && (r[SR_AT] < 0 || r[SR_AT] > p->buf_len || r[SR_LENGTH] > p->buf_len - r[SR_AT] ||
                                  r[SR_OFFSET] > INT64_MAX - r[SR_LENGTH])) {
            *error = "stage_read: a read lies outside the staging buffer";
            return -1;
        }
    }
    return 0;
}

size_t chunk_path(char *out, const char *prefix, size_t n, char sep, const int64_t *coords, int ndim) {
    memcpy(out, prefix, n);
    for (int k = 0; k < ndim; k++) {
        if (k)
            out[n++] = sep;
        char digits[24];
        int d = 0;
        unsigned long long v = (unsigned long long)coords[k];
        do {
            digits[d++] = (char)('0' + v % 10);
            v /= 10;
        } while (v);
        while (d)
            out[n++] = digits[--d];
    }
    out[n] = 0;
    return n;
}

static void file_job(const stage_plan *p, long long f, chunk_io *job) {
    memset(job, 0, sizeof(*job));
    const int64_t *row = p->files + f * STAGE_FILE_COLS;
    job->path = p->paths[f];
    job->has_ident = row[SF_HAS_IDENT] != 0;
    job->dev = (unsigned long long)row[SF_DEV];
    job->ino = (unsigned long long)row[SF_INO];
    job->size = row[SF_SIZE];
    job->mtime_ns = row[SF_MTIME];
    job->ctime_ns = row[SF_CTIME];
    job->fd = -1;
}

static void set_out(stage_plan *p, long long i, long long status, long long detail) {
    int64_t *o = p->out + i * STAGE_OUT_COLS;
    o[SO_STATUS] = status;
    o[SO_DETAIL] = detail;
}

void stage_cancel(int *flag) { __atomic_store_n(flag, 1, __ATOMIC_RELEASE); }

/* the round's cancel flag set (loaded between reads: a closing pipeline's round stops at the next one) */
static int cancelled(const stage_plan *p) { return p->cancel != NULL && __atomic_load_n(p->cancel, __ATOMIC_ACQUIRE); }

/* reads [first, last) not run: ST_CANCELLED, nothing of theirs in the staging */
static void not_run(stage_plan *p, long long first, long long last) {
    for (long long i = first; i < last; i++) {
        int64_t *o = p->out + i * STAGE_OUT_COLS;
        o[SO_STATUS] = ST_CANCELLED, o[SO_DETAIL] = 0, o[SO_AT] = -1, o[SO_NREAD] = 0;
    }
}

/* ranged reads [first, last) of one file: one open, each read, the identity checked after them all; cancelled
 * between two reads, the rest are not run */
static void read_runs(stage_plan *p, long long first, long long last) {
    chunk_io job;
    file_job(p, p->reads[first * STAGE_READ_COLS + SR_FILE], &job);
    size_t size;
    job.offset = 0;
    __atomic_fetch_add(&p->opens, 1, __ATOMIC_RELAXED);
    int fd = open_chunk(&job, (size_t)-1, &size);
    long long bad = fd < 0 ? job.status : ST_OK, detail = job.detail, stop = last;
    for (long long i = first; i < last && fd >= 0; i++) {
        if (i > first && cancelled(p)) {
            stop = i;
            break;
        }
        const int64_t *r = p->reads + i * STAGE_READ_COLS;
        job.offset = r[SR_OFFSET];
        job.nread = 0;
        job.status = ST_OK;
        int failed = read_range(&job, fd, p->buf + r[SR_AT], 0, (size_t)r[SR_LENGTH]);
        __atomic_fetch_add(&p->preads, 1, __ATOMIC_RELAXED);
        p->out[i * STAGE_OUT_COLS + SO_NREAD] = job.nread;
        if (failed)
            set_out(p, i, job.status, job.detail);
    }
    if (fd >= 0 && close_checked(&job, fd))
        bad = ST_CHANGED, detail = 0;
    for (long long i = first; i < stop; i++) {
        p->out[i * STAGE_OUT_COLS + SO_AT] = p->reads[i * STAGE_READ_COLS + SR_AT];
        if (bad != ST_OK)
            set_out(p, i, bad, detail);
    }
    not_run(p, stop, last);
}

/* an entry read's header bytes (header and ident) */
static long long entry_head(const stage_plan *p, long long i) { return ENTRY_HEADER_BYTES + p->idents[2 * i + 1]; }

/* a whole file's size by stat (no descriptor held between the two rounds: a wave may name thousands of files);
 * an entry's payload size */
static void stat_whole(stage_plan *p, long long i) {
    const int64_t *r = p->reads + i * STAGE_READ_COLS;
    int entry = r[SR_OFFSET] == SR_ENTRY;
    struct stat st;
    int rc;
    do /* a signal may cut it short on a thread that does not block them (the caller's) */
        rc = entry ? lstat(p->paths[r[SR_FILE]], &st) : stat(p->paths[r[SR_FILE]], &st);
    while (rc != 0 && errno == EINTR);
    int gone = rc != 0 && (errno == ENOENT || errno == ENOTDIR);
    if (entry && (rc != 0 || !S_ISREG(st.st_mode))) { /* (never followed: read_entry's O_NOFOLLOW) */
        set_out(p, i, ST_ENTRY, gone ? ENTRY_GONE : ENTRY_UNREADABLE);
        return;
    }
    if (rc != 0) {
        set_out(p, i, gone ? ST_MISSING : ST_OS_ERROR, errno);
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        set_out(p, i, ST_NOT_REGULAR, (long long)(st.st_mode & S_IFMT));
        return;
    }
    long long size = (long long)st.st_size;
    if (entry) {
        size -= entry_head(p, i);
        if (size < 0 || size > r[SR_LENGTH]) { /* no room taken: fetched through the store */
            set_out(p, i, ST_ENTRY, ENTRY_SIZE);
            return;
        }
    }
    p->out[i * STAGE_OUT_COLS + SO_DETAIL] = size;
    if (size > r[SR_LENGTH])
        set_out(p, i, ST_TOO_BIG, size);
}

/* an entry's payload read into the room placed for the size its stat gave, judged and touched by entries.c's
 * entry_read as the CPU engine's reads are (read_entry reads an entry whole into one buffer; here its header
 * and ident go to the stack and its payload alone to the staging, so the room placed is the payload's and what
 * crosses to the device is chunk bytes only); replaced since its stat (another size): ENTRY_SIZE, its room
 * another's */
static void read_entry_payload(stage_plan *p, long long i) {
    int64_t *o = p->out + i * STAGE_OUT_COLS;
    const int64_t *row = p->reads + i * STAGE_READ_COLS;
    unsigned char header[ENTRY_HEADER_BYTES + ENTRY_IDENT_CAP];
    entry_reading r = {.ident = p->ident_blob + p->idents[2 * i],
                       .ident_len = (size_t)p->idents[2 * i + 1],
                       .max_payload = (size_t)row[SR_LENGTH],
                       .expect_payload = o[SO_DETAIL],
                       .head = header,
                       .payload = p->buf + o[SO_AT],
                       .whole = 0};
    __atomic_fetch_add(&p->opens, 1, __ATOMIC_RELAXED);
    int why = entry_read(p->paths[row[SR_FILE]], &r);
    if (r.preads > 1) /* (the header's read not counted: the payload's is the read of the plan) */
        __atomic_fetch_add(&p->preads, 1, __ATOMIC_RELAXED);
    o[SO_NREAD] = why ? 0 : (long long)r.payload_len;
    if (why)
        set_out(p, i, ST_ENTRY, why);
}

/* a whole file into the room placed for the size its stat gave: ST_CHANGED when it has another size now */
static void read_whole(stage_plan *p, long long i) {
    int64_t *o = p->out + i * STAGE_OUT_COLS;
    chunk_io job;
    file_job(p, p->reads[i * STAGE_READ_COLS + SR_FILE], &job);
    job.has_ident = 0;
    job.offset = -1;
    size_t size;
    __atomic_fetch_add(&p->opens, 1, __ATOMIC_RELAXED);
    int fd = open_chunk(&job, (size_t)-1, &size);
    if (fd < 0) {
        set_out(p, i, job.status == ST_MISSING ? ST_CHANGED : job.status, job.detail);
        return;
    }
    if ((long long)size != o[SO_DETAIL]) {
        close_checked(&job, fd);
        set_out(p, i, ST_CHANGED, (long long)size);
        return;
    }
    int failed = read_range(&job, fd, p->buf + o[SO_AT], 0, size);
    __atomic_fetch_add(&p->preads, 1, __ATOMIC_RELAXED);
    close_checked(&job, fd);
    o[SO_NREAD] = job.nread;
    if (failed)
        set_out(p, i, job.status, job.detail);
}

/* a round of tasks: each thread takes the next task until none is left */
typedef struct {
    stage_plan *p;
    const int64_t *tasks; /* (first, last) pairs: a run of ranged reads of one file, or one whole file */
    long long n, next;
    int round;
} round_of;

static void run_task(round_of *r, long long t) {
    long long first = r->tasks[2 * t], last = r->tasks[2 * t + 1];
    int whole = r->p->reads[first * STAGE_READ_COLS + SR_OFFSET] < 0;
    if (cancelled(r->p)) { /* (each task is still taken, by one thread: every read gets its status) */
        if (r->round == 0 || (whole && r->p->out[first * STAGE_OUT_COLS + SO_STATUS] == ST_OK))
            not_run(r->p, first, last); /* (the second round: a whole file placed and not read yet) */
        return;
    }
    if (!whole && r->round == 0)
        read_runs(r->p, first, last);
    else if (whole && r->round == 0)
        stat_whole(r->p, first);
    else if (whole && r->p->out[first * STAGE_OUT_COLS + SO_STATUS] == ST_OK) {
        if (r->p->reads[first * STAGE_READ_COLS + SR_OFFSET] == SR_ENTRY)
            read_entry_payload(r->p, first);
        else
            read_whole(r->p, first);
    }
}

static void *run_round(void *arg) {
    round_of *r = arg;
    for (;;) {
        long long t = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
        if (t >= r->n)
            return NULL;
        run_task(r, t);
    }
}

/* run_round on a thread of the call's own, named as the pool's helpers are (what top, py-spy and gdb show) */
static void *call_reader(void *arg) {
#if defined(__linux__)
    (void)pthread_setname_np(pthread_self(), STAGE_THREAD_NAME);
#endif
    return run_round(arg);
}

static void run_parallel(round_of *r, int threads) {
    pthread_t ids[MAX_STAGE_THREADS];
    int k = threads < 1 ? 1 : threads > MAX_STAGE_THREADS ? MAX_STAGE_THREADS : threads, started = 0;
    if (k > r->n)
        k = (int)(r->n > 0 ? r->n : 1);
    for (int j = 0; j + 1 < k; j++)
        if (thread_start(&ids[started], 0, call_reader, r) == 0)
            started++; /* (none started: the caller reads them all) */
    __atomic_add_fetch(&threads_started, started, __ATOMIC_RELAXED);
    run_round(r);
    for (int j = 0; j < started; j++)
        pthread_join(ids[j], NULL);
}

/* ---- the persistent readers (see staging.h) ---- */

struct stage_pool {
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* helpers wait here: a round published, closing */
    pthread_cond_t done_cv; /* the caller waits here for the helpers in its round; close for their ends */
    int wanted, started, alive, refs, closing, busy, in_round;
    round_of *round;         /* the round helpers may join (NULL: none) */
    unsigned long long seq;  /* bumped per round published: a helper joins each at most once */
    unsigned generation;     /* the fork generation it was made in */
};

/* made in the parent of this process: its threads do not exist here, its lock may be held by one of them */
static int pool_foreign(const stage_pool *q) { return q->generation != fork_generation(); }

static void pool_free(stage_pool *q) {
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->work_cv);
    pthread_cond_destroy(&q->done_cv);
    free(q);
}

/* a helper's share of a round: tasks until none is left or the pool closes (the caller takes what remains) */
static void help_round(round_of *r, const stage_pool *q) {
    while (!__atomic_load_n(&q->closing, __ATOMIC_RELAXED)) {
        long long t = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
        if (t >= r->n)
            return;
        run_task(r, t);
    }
}

static void *helper(void *arg) {
    stage_pool *q = arg;
    unsigned long long seen = 0;
#if defined(__linux__)
    (void)pthread_setname_np(pthread_self(), STAGE_THREAD_NAME); /* what top, py-spy and gdb show */
#endif
    pthread_mutex_lock(&q->mu);
    while (!q->closing) {
        if (q->round != NULL && q->seq != seen) {
            seen = q->seq;
            round_of *r = q->round;
            q->in_round++;
            pthread_mutex_unlock(&q->mu);
            help_round(r, q);
            pthread_mutex_lock(&q->mu);
            if (--q->in_round == 0)
                pthread_cond_broadcast(&q->done_cv);
            continue;
        }
        cond_wait_for(&q->work_cv, &q->mu, 1.0); /* woken by a round or close; the second only bounds the wait */
    }
    q->alive--;
    int last = --q->refs == 0;
    pthread_cond_broadcast(&q->done_cv);
    pthread_mutex_unlock(&q->mu);
    if (last)
        pool_free(q);
    return NULL;
}

stage_pool *stage_pool_new(int threads) {
    stage_pool *q = calloc(1, sizeof(stage_pool));
    if (q == NULL)
        return NULL;
    pthread_mutex_init(&q->mu, NULL);
    cond_init(&q->work_cv);
    cond_init(&q->done_cv);
    q->wanted = threads < 1 ? 0 : threads - 1 > MAX_STAGE_THREADS - 1 ? MAX_STAGE_THREADS - 1 : threads - 1;
    q->refs = 1;
    q->generation = fork_watch();
    return q;
}

/* the helpers not started yet, started (at the first round that has work for them; with the lock held).
 * Detached (waited for by close, never joined), every signal blocked, as the engine's workers (threads.h). */
static void start_helpers(stage_pool *q) {
    int made = 0;
    while (q->started < q->wanted) {
        pthread_t id;
        q->refs++, q->alive++;
        if (thread_start(&id, 1, helper, q) != 0) {
            q->refs--, q->alive--;
            q->wanted = q->started; /* (fewer threads: the caller reads what they do not) */
            break;
        }
        q->started++, made++;
    }
    __atomic_add_fetch(&threads_started, made, __ATOMIC_RELAXED);
}

/* a round on the pool's helpers and the caller; the caller alone where the pool is another process's (forked),
 * closing, busy with another caller's round, or the round has one task. Returns once no helper is in it (the
 * helpers finish the task they hold: one file's reads; then the buffer is the caller's again). */
static void run_pooled(round_of *r, stage_pool *q) {
    if (r->n < 2 || q->wanted < 1 || pool_foreign(q)) {
        run_round(r);
        return;
    }
    pthread_mutex_lock(&q->mu);
    if (q->closing || q->busy) {
        pthread_mutex_unlock(&q->mu);
        run_round(r);
        return;
    }
    q->busy = 1;
    start_helpers(q);
    q->round = r;
    q->seq++;
    pthread_cond_broadcast(&q->work_cv);
    pthread_mutex_unlock(&q->mu);
    run_round(r);
    pthread_mutex_lock(&q->mu);
    q->round = NULL; /* no helper joins it now */
    while (q->in_round > 0)
        cond_wait_for(&q->done_cv, &q->mu, 0.1);
    q->busy = 0;
    pthread_mutex_unlock(&q->mu);
}

int stage_pool_close(stage_pool *q, double timeout_s) {
    if (pool_foreign(q)) { /* its threads are the parent's: none runs here */
        q->closing = 1;
        return 1;
    }
    double until = mono_s() + (timeout_s > 0 ? timeout_s : 0);
    pthread_mutex_lock(&q->mu);
    __atomic_store_n(&q->closing, 1, __ATOMIC_RELAXED); /* (helpers in a round read it unlocked) */
    pthread_cond_broadcast(&q->work_cv);
    for (double left; q->alive > 0 && (left = until - mono_s()) > 0;)
        cond_wait_for(&q->done_cv, &q->mu, left < 0.1 ? left : 0.1);
    int all = q->alive == 0;
    pthread_mutex_unlock(&q->mu);
    return all;
}

void stage_pool_info(stage_pool *q, long long out[4]) {
    if (pool_foreign(q)) { /* read without its lock, which a thread of the parent may hold */
        out[0] = q->wanted, out[1] = q->started, out[2] = 0, out[3] = 1;
        return;
    }
    pthread_mutex_lock(&q->mu);
    out[0] = q->wanted, out[1] = q->started, out[2] = q->alive, out[3] = q->closing;
    pthread_mutex_unlock(&q->mu);
}

void stage_pool_release(stage_pool *q) {
    if (pool_foreign(q)) /* left to the process's end (the parent's pages, copy-on-write) */
        return;
    pthread_mutex_lock(&q->mu);
    __atomic_store_n(&q->closing, 1, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&q->work_cv);
    int last = --q->refs == 0;
    pthread_mutex_unlock(&q->mu);
    if (last)
        pool_free(q);
}

long long stage_threads_started(void) { return __atomic_load_n(&threads_started, __ATOMIC_RELAXED); }

static void run_on(round_of *r, int threads, stage_pool *q) {
    if (q != NULL)
        run_pooled(r, q);
    else
        run_parallel(r, threads);
}

void stage_read(stage_plan *p, int threads) { stage_read_on(p, threads, NULL); }

void stage_read_on(stage_plan *p, int threads, stage_pool *q) {
    for (long long i = 0; i < p->n_reads; i++) {
        int64_t *o = p->out + i * STAGE_OUT_COLS;
        o[SO_STATUS] = ST_OK, o[SO_DETAIL] = 0, o[SO_AT] = -1, o[SO_NREAD] = 0;
    }
    int64_t *tasks = malloc(sizeof(int64_t) * 2 * (size_t)(p->n_reads + 1));
    if (tasks == NULL) {
        for (long long i = 0; i < p->n_reads; i++)
            set_out(p, i, ST_NO_MEMORY, 0);
        return;
    }
    long long n = 0;
    for (long long i = 0; i < p->n_reads;) {
        const int64_t *r = p->reads + i * STAGE_READ_COLS;
        long long j = i + 1;
        if (r[SR_OFFSET] >= 0) /* the ranged reads of one file that follow it: one task */
            while (j < p->n_reads && p->reads[j * STAGE_READ_COLS + SR_OFFSET] >= 0 &&
                   p->reads[j * STAGE_READ_COLS + SR_FILE] == r[SR_FILE])
                j++;
        tasks[2 * n] = i, tasks[2 * n + 1] = j, n++;
        i = j;
    }
    round_of r = {p, tasks, n, 0, 0};
    run_on(&r, threads, q);
    /* whole files end to end, in order, by their sizes; one past the buffer is ST_TOO_BIG (unread); cancelled
     * by now, none is placed */
    long long at = p->whole_base;
    int any = 0, stop = cancelled(p);
    for (long long i = 0; i < p->n_reads; i++) {
        int64_t *o = p->out + i * STAGE_OUT_COLS;
        if (p->reads[i * STAGE_READ_COLS + SR_OFFSET] >= 0 || o[SO_STATUS] != ST_OK)
            continue;
        if (stop) {
            not_run(p, i, i + 1);
            continue;
        }
        if (o[SO_DETAIL] > p->buf_len - at) {
            set_out(p, i, ST_TOO_BIG, o[SO_DETAIL]);
            continue;
        }
        o[SO_AT] = at;
        at += o[SO_DETAIL];
        any = 1;
    }
    if (any) {
        round_of w = {p, tasks, n, 0, 1};
        run_on(&w, threads, q);
    }
    free(tasks);
}

/* ---- blosc1 frames ---- */

#define BLOSC_HEADER 16
#define BLOSC_VERSION_FORMAT 2
#define BLOSC_MAX_SPLITS 16
#define BLOSC_MIN_BUFFERSIZE 128
#define BLOSC_MAX_BLOCKSIZE ((2147483647LL - 255 * 4) / 3)
enum { F_DOSHUFFLE = 0x1, F_MEMCPYED = 0x2, F_DOBITSHUFFLE = 0x4, F_RESERVED = 0x8, F_DONT_SPLIT = 0x10 };
/* frames.py's stream codecs (UNSUPPORTED 0, LZ4 1, ZSTD 2) by the frame's compressor format (flags >> 5) */
static const int64_t format_codec[8] = {0, 1, 0, 0, 2, 0, 0, 0};

static int64_t le32(const unsigned char *b, int is_signed) {
    uint32_t v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return is_signed ? (int64_t)(int32_t)v : (int64_t)v;
}

/* One frame: its first fault (BF_*), or BF_OK with its streams and blocks written from the rows *ns / *nb on
 * (counted only where streams / blocks are NULL). Every read lies in [0, size) of the frame ``f``. Rows are
 * written below cap_s / cap_b only: a frame that needs more than the count made room for (its bytes changed
 * since) is BF_CHANGED, its rows taken back. */
static int parse_frame(const unsigned char *f, long long size, long long ins, long long nbytes, long long out,
                       long long chunk, int64_t *streams, long long *ns, long long cap_s, int64_t *blocks,
                       long long *nb, long long cap_b) {
    if (size < BLOSC_HEADER)
        return BF_SHORT;
    int64_t version = f[0], versionlz = f[1], flags = f[2], typesize = f[3];
    int64_t n = le32(f + 4, 1), blocksize = le32(f + 8, 1), cbytes = le32(f + 12, 1);
    if (version != BLOSC_VERSION_FORMAT)
        return BF_VERSION;
    if (flags & F_RESERVED)
        return BF_RESERVED;
    if (cbytes != size)
        return BF_CBYTES;
    if (n != nbytes)
        return BF_NBYTES;
    if (n <= 0)
        return BF_OK; /* (n == nbytes >= 0: an empty chunk, nothing to decode) */
    if (typesize == 0)
        return BF_TYPESIZE;
    int64_t top = n < BLOSC_MAX_BLOCKSIZE ? n : BLOSC_MAX_BLOCKSIZE;
    if (blocksize < 1 || blocksize > top)
        return BF_BLOCKSIZE;
    int64_t fmt = flags >> 5, codec = format_codec[fmt & 7];
    if (flags & F_MEMCPYED) {
        if (cbytes != n + BLOSC_HEADER)
            return BF_MEMCPYED;
        if (streams != NULL) {
            if (*ns >= cap_s)
                return BF_CHANGED;
            int64_t *s = streams + *ns * BLOSC_STREAM_COLS;
            s[BS_SRC] = ins + BLOSC_HEADER, s[BS_CSIZE] = n, s[BS_DST] = out, s[BS_DSIZE] = n;
            s[BS_CODEC] = codec, s[BS_CHUNK] = chunk;
        }
        (*ns)++;
        return BF_OK;
    }
    if (fmt >= 5)
        return BF_FORMAT;
    if (versionlz != 1)
        return BF_VERSIONLZ;
    int64_t bs = blocksize, nfull = n / bs, leftover = n % bs, nblocks = nfull + (leftover > 0);
    int64_t table_end = BLOSC_HEADER + 4 * nblocks;
    if (table_end > size)
        return BF_TABLE;
    int split = !(flags & F_DONT_SPLIT) && typesize <= BLOSC_MAX_SPLITS && bs / typesize >= BLOSC_MIN_BUFFERSIZE;
    int64_t nsplits = split ? typesize : 1;
    if (nfull > 0 && bs % nsplits != 0)
        return BF_SPLIT;
    for (int64_t b = 0; b < nblocks; b++) { /* every block's start first, as frames.py checks them */
        int64_t start = le32(f + BLOSC_HEADER + 4 * b, 1);
        if (start < table_end || start > size - 4)
            return BF_BSTART;
    }
    long long ns0 = *ns, nb0 = *nb;
    for (int64_t b = 0; b < nblocks; b++) {
        int partial = b == nfull && leftover > 0;
        int64_t b_size = partial ? leftover : bs, splits = partial ? 1 : nsplits, ne = b_size / splits;
        int64_t pos = le32(f + BLOSC_HEADER + 4 * b, 1);
        for (int64_t j = 0; j < splits; j++) {
            if (pos > size - 4)
                return *ns = ns0, *nb = nb0, BF_SIZE_FIELD;
            int64_t cs = le32(f + pos, 0);
            if (cs < 1 || cs > ne)
                return *ns = ns0, *nb = nb0, BF_STREAM_SIZE;
            if (pos + 4 + cs > size)
                return *ns = ns0, *nb = nb0, BF_STREAM_END;
            if (streams != NULL) {
                if (*ns >= cap_s)
                    return *ns = ns0, *nb = nb0, BF_CHANGED;
                int64_t *s = streams + *ns * BLOSC_STREAM_COLS;
                s[BS_SRC] = ins + pos + 4, s[BS_CSIZE] = cs, s[BS_DST] = out + b * bs + j * ne, s[BS_DSIZE] = ne;
                s[BS_CODEC] = codec, s[BS_CHUNK] = chunk;
            }
            (*ns)++;
            pos += 4 + cs;
        }
        /* c-blosc's unshuffle: bytes when typesize > 1, else bits when the block holds a multiple of 8 items */
        int64_t items = b_size / typesize, kind = 0;
        if ((flags & F_DOSHUFFLE) && typesize > 1)
            kind = items > 0 ? 1 : 0;
        else if ((flags & F_DOBITSHUFFLE) && items > 0 && items % 8 == 0)
            kind = 2;
        if (kind) {
            if (blocks != NULL) {
                if (*nb >= cap_b)
                    return *ns = ns0, *nb = nb0, BF_CHANGED;
                int64_t *r = blocks + *nb * BLOSC_BLOCK_COLS;
                r[BB_DST] = out + b * bs, r[BB_SIZE] = b_size, r[BB_TYPESIZE] = typesize, r[BB_SHUFFLE] = kind;
            }
            (*nb)++;
        }
    }
    return BF_OK;
}

int blosc_streams(const unsigned char *buf, long long buf_len, long long k, const int64_t *in, const int64_t *in_len,
                  const int64_t *nbytes, const int64_t *out, int64_t **streams, long long *n_streams,
                  int64_t **blocks, long long *n_blocks, int64_t *fault, const char **error) {
    *streams = *blocks = NULL;
    *n_streams = *n_blocks = 0;
    for (long long c = 0; c < k; c++)
        if (in[c] < 0 || in_len[c] < 0 || in[c] > buf_len || in_len[c] > buf_len - in[c] || nbytes[c] < 0 ||
            out[c] < 0 || out[c] > INT64_MAX - nbytes[c]) {
            /* (an output ending past int64: its blocks' destinations, out + block * blocksize, would overflow) */
            *error = "blosc_streams: the chunks' stored bytes must lie inside the input, sizes >= 0, each output "
                     "ending within int64";
            return -1;
        }
    long long ns = 0, nb = 0; /* counted first, then written into exactly that room (blosc_rows) */
    for (long long c = 0; c < k; c++)
        fault[c] = parse_frame(buf + in[c], in_len[c], in[c], nbytes[c], out[c], c, NULL, &ns, 0, NULL, &nb, 0);
    *streams = malloc(sizeof(int64_t) * BLOSC_STREAM_COLS * (size_t)(ns + 1));
    *blocks = malloc(sizeof(int64_t) * BLOSC_BLOCK_COLS * (size_t)(nb + 1));
    if (*streams == NULL || *blocks == NULL) {
        free(*streams), free(*blocks);
        *streams = *blocks = NULL;
        *error = "out of memory";
        return -1;
    }
    blosc_rows(buf, k, in, in_len, nbytes, out, *streams, ns, n_streams, *blocks, nb, n_blocks, fault);
    return 0;
}

void blosc_rows(const unsigned char *buf, long long k, const int64_t *in, const int64_t *in_len,
                const int64_t *nbytes, const int64_t *out, int64_t *streams, long long cap_s, long long *n_streams,
                int64_t *blocks, long long cap_b, long long *n_blocks, int64_t *fault) {
    /* The bytes are read again, unlocked: a frame written since it was counted may parse to other rows, or to
     * a fault; either is its fault now, and no row goes past the room made */
    for (long long c = 0; c < k; c++)
        if (fault[c] == BF_OK)
            fault[c] = parse_frame(buf + in[c], in_len[c], in[c], nbytes[c], out[c], c, streams, n_streams, cap_s,
                                   blocks, n_blocks, cap_b);
}
