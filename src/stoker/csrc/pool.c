/* The engine: worker threads owned by the extension make whole batches from flat plan tables.
 *
 * An engine starts its threads once. A job is one batch: its tables (copied and checked in job_new, before any
 * thread sees them), a status and a detail per chunk, and summed counters. Workers take the first job that has
 * chunks left and pull its chunks by an atomic counter; each reads, decodes and places a chunk on its own.
 *
 * Memory: each thread reads and decodes into scratch of its own, sized for the job's largest chunk (its decoded
 * bytes, then for a file its stored bytes; a chunk in a buffer is decoded from there, so its decoded bytes
 * only), reserved from the engine's budget under its lock. A thread whose scratch is too small gives
 * it back before reserving more; when the budget is short it waits, so fewer threads work at once, and nothing
 * is allocated past the budget. Scratch that cannot be allocated (a budget larger than the machine) gives its
 * reservation back and leaves one chunk NO_MEMORY, which the Python path reads. Scratch is kept between jobs
 * (fresh pages cost a fault each); ``peak`` counts what was allocated, never what was only reserved.
 *
 * Lifetime: the engine's state is shared by the Python object, every thread and every job, refcounted under
 * its lock; the last one out frees it. A job is refcounted the same way (its Python object, the engine's list
 * of live jobs, each worker inside it or allocating scratch for it). Workers write into a job's batch only holding its place lock shared,
 * after checking that the job is not cancelled; job_cancel takes the lock exclusively, so once it returns no
 * worker writes into that batch again. engine_close cancels every job and waits a bounded time for the
 * threads; a thread stuck in a system call (a hung network mount) is left behind: it holds only its own
 * scratch, references and the few shard files it keeps open (kept_files), checks cancellation before any
 * write into a batch, and frees what it holds last.
 * Workers never call into Python.
 *
 * Accounting: a thread sums a job's counters over the chunks it takes in a row and adds them to the job's once,
 * as it leaves the job (before it reports them finished), so no cache line is written by every thread per
 * chunk. Each thread also keeps clocks of its own (worker_slot, W_* in the header): every stretch of its time
 * goes to one column (reading, decoding, placing, waiting for a lock, for work, for the budget, the rest),
 * closed at a chunk's end, around waits and around lock acquisitions: a few clock reads a chunk. A sequence
 * count per row lets engine_worker_clocks read a row whole while its thread writes it.
 *
 * Decoded into the batch: a zstd chunk whose one copy is all of it, as stored, contiguous in the batch, is
 * decoded straight into its place (direct_place) instead of the scratch, holding the place lock for the
 * decode only (its reads come first). A failed one may leave part of its bytes there: its status fails the
 * batch, or the Python path reads the chunk again and places all of it.
 *
 * Shared: a stored chunk that jobs in flight both need (batches drawn near each other read the same chunks) is
 * read and decoded once. A worker about to decode a shareable chunk (read from a file, not a fetched buffer: an
 * inner chunk of a shard file of known identity, a whole chunk file, or a disk-cache entry, whose ident names
 * the store, key, range and generation of its bytes) looks it up in the engine's other live jobs (each job's
 * shared_at table, by file identity and byte range, by path, or by the entry's ident and path), takes the ones no thread took
 * yet (claimed: one atomic exchange, which every other taker - a job's own workers, job_cancel - does too,
 * so a chunk is finished exactly once), decodes into its scratch as far as the farthest of their spans and places the chunk into
 * every job that takes it, each with its own copies, checks and lock, then finishes it there. A decode of
 * the union that fails is done again, alone, for each job whose own span is narrower (span_failure), so a
 * job's chunk fails only as its own decode would, whichever jobs are in flight. Nothing is kept
 * once the chunk is placed: only jobs submitted before its decode share it. Counted in the job that shares
 * it as chunks_shared (not decoded, not read there; a decode done again alone for it is read and timed in the
 * job whose thread did it). The claim of the thread's own copy, the lookups (kept entries and flights, see
 * "Reused", then the other jobs) and the listing of its flight are one section of the engine's lock
 * (start_shared): of two threads that need one stored chunk at once, the second finds the first's claim, so
 * it is decoded once (claimed first and looked up after, both could find the other's copy claimed and decode
 * it). A job alone in the engine that keeps nothing claims its chunks with no lock: no other job can want them
 * (one submitted after that look shares none of its decodes).
 *
 * Reused: a pipeline reading a tile grid ahead (engine_reuse: a byte bound and a generation) has its jobs keep the
 * chunks they decode from files (whole chunks, decoded in full for it, not straight into a batch), so a batch
 * submitted after the decode of a chunk it shares with an earlier one is placed from the kept copy instead of
 * racing to be in flight at the same time (see "Shared"). An entry is keyed by the same stored identity as a
 * shared chunk (a shard's identity and byte range, a chunk file's path and grid coordinates; a disk-cache entry or
 * a fetched buffer is never kept) and by the generation in force when its job was submitted (engine_submit copies
 * it): only jobs of that generation are served it, so the caller's new generation (a new push) reads every file
 * again, and changing the generation drops every entry. Entries are least recently used first out, their bytes
 * bounded by the byte bound (an entry taken by a placing thread is pinned: unlisted when evicted, freed by the
 * last one out, and counted until then; the memory a chunk is decoded into to be kept is counted from before the
 * decode, room made for it first: reuse_reserve_locked); everything under the engine's lock but the copies in
 * and out. A chunk being decoded to be kept is a flight, listed from the section that starts it (start_shared)
 * to the one that lists its entry (reuse_land), so a taker finds one or the other: a job of its generation
 * submitted meanwhile joins it (its own thread goes on) and is placed from that decode as a sharer is, where it
 * would have missed the entry not kept yet and decoded the chunk again. Counted per job as chunks_reused (not
 * read, not decoded there; a job that joined a flight counts it as chunks_shared) and per engine by
 * engine_reuse_info.
 *
 * Sources: a chunk is read from its file (path built from the source's prefix and the file's grid coordinates)
 * or from a buffer the caller holds (C_BUFFER: a chunk fetched from a store), through the same codec code and
 * checks (io.c), straight from the buffer (nothing is copied, nothing written to it). Buffers are read only holding the job's mem lock shared, after checking that the job is not
 * cancelled; job_cancel takes it exclusively too, so once it returns no worker reads them again (the caller
 * may then let them go; a chunk in memory makes no system call, so that wait is one chunk's decode at most).
 *
 * Fork: a child process has none of the engine's threads, and its mutex, condition variables and job locks may
 * be held, or owe wake-ups, to threads that do not exist there (glibc's pthread_cond_broadcast then waits for
 * waiters that never come). An engine records the fork generation it was made in (counted by a pthread_atfork
 * handler); in a later one (foreign) every call leaves its threads and locks alone: close reports the threads
 * gone, a submitted job is done with every chunk cancelled, and memory is left to the process's end (the
 * parent's pages, copy-on-write).
 */
#include "stoker_native.h"
#include "staging.h" /* chunk_path */
#include "threads.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#define ALIGN 64

struct job {
    plan_tables t;     /* points into owned and blob */
    int64_t *owned;    /* the tables: chunks, copies, sources, files */
    char *blob;
    const char **buf_base; /* the buffers' addresses and lengths (plan_tables), owned copies */
    long long *buf_len;
    int64_t *entries; /* plan_tables.entries and entry_blob, owned copies (NULL: none) */
    char *entry_blob;
    size_t need; /* scratch per thread: the most any chunk needs (decoded, rounded up to ALIGN, then stored
                  * for a file) */
    int32_t *status;
    int64_t *detail;
    unsigned char *claimed; /* atomic, per chunk: 1 once a thread took it (its job's worker, a sharer, job_cancel) */
    long long *shared_at;   /* the shareable chunks (see "Shared"): open addressing, chunk index + 1, 0 empty */
    long long shared_cap;   /* its slots: a power of two, at least twice the shareable chunks; 0: none */
    int reuse;              /* its decoded chunks kept and looked up (see "Reused"); set at submit, under mu */
    long long reuse_gen;    /* the generation they are kept for */
    pthread_rwlock_t place_lock; /* shared: a worker writing into the batch; exclusive: job_cancel */
    pthread_rwlock_t mem_lock;   /* shared: a worker reading one of the buffers; exclusive: job_cancel */
    int cancelled;               /* set under place_lock held exclusively; read under it, or atomically */
    long long next;              /* atomic: the next chunk to hand out */
    long long finished;          /* atomic: chunks with their status set */
    job_counters counters;       /* atomic sums */
    /* under the engine's lock: */
    long long threads_now;
    int done;
    int submitted;
    int live; /* in the engine's list of live jobs */
    int refs;
    job *prev, *next_live;
};

/* A worker thread's own row (see "Accounting"): written by its thread only, a cache line or more of its own. */
typedef struct {
    engine *e;
    unsigned seq;               /* odd while the thread updates the row */
    int state;                  /* the column the stretch under way goes to (-1: the thread has left) */
    long long mark;             /* when that stretch began */
    long long start, stop;      /* when the thread started and left (0: not yet) */
    long long v[N_WORKER_COLS]; /* W_WALL is computed when read */
} __attribute__((aligned(ALIGN))) worker_slot;

/* A decoded chunk kept (see "Reused"): its key (stored identity) and its decoded bytes. */
typedef struct reuse_entry {
    struct reuse_entry *chain;         /* the bucket's next (unlisted: the next to free) */
    struct reuse_entry *newer, *older; /* the list, most recently used first */
    unsigned long long hash;
    long long generation, nbytes, refs; /* refs: threads placing from it now */
    int listed;                         /* in the table and the list; 0: evicted, freed by its last user */
    size_t key_len;
    unsigned char *key;
    char *data; /* nbytes, ALIGN-aligned (placed with typed loads as from a thread's scratch) */
} reuse_entry;

#define REUSE_BUCKETS 256 /* entries are chunks within a byte bound: a few hundred at most in practice */

typedef struct {
    /* held: entries listed or still pinned, and the memory of decodes in flight to be kept (reuse_buffer) */
    long long max_bytes, held, peak, generation;
    long long entries, hits, inserted, evicted;
    reuse_entry *newest, *oldest;
    reuse_entry *bucket[REUSE_BUCKETS];
} reuse_table;

struct engine {
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* workers wait here: new jobs, budget given back, closing */
    pthread_cond_t done_cv; /* job_wait and engine_close wait here */
    int refs;               /* the Python object, each live thread, each job */
    int closing;            /* written under mu, atomically: workers read it unlocked between chunks */
    int n_threads, alive;
    long long budget, used; /* the scratch budget, and how much of it threads have reserved */
    long long held, peak;   /* scratch allocated now, and at most (never more than reserved) */
    job *live; /* jobs not done nor cancelled, in submission order */
    unsigned generation; /* the fork generation it was made in (see "Fork" above) */
    worker_slot *workers; /* a row per thread asked for; rows [0, n_threads) are started threads' */
    reuse_table reuse;    /* decoded chunks kept (see "Reused"), under mu */
    struct flight *flights; /* decodes in flight of chunks to be kept (see "Reused"), under mu */
    long long n_live;       /* jobs in ``live``: written under mu, read atomically (see "Shared") */
};

/* ---- fork ---- */

/* whether e was made in another process (a parent of this one): its threads and locks are not ours to touch */
static int foreign(const engine *e) { return e->generation != fork_generation(); }

/* ---- small helpers ---- */

static int add_ok(long long a, long long b, long long *out) { return !__builtin_add_overflow(a, b, out); }

/* ---- a worker's clocks (see "Accounting"); only its own thread writes a row ---- */

static void clock_open(worker_slot *w) { /* the row is being written: a reader retries */
    __atomic_store_n(&w->seq, w->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void clock_close(worker_slot *w) { __atomic_store_n(&w->seq, w->seq + 1, __ATOMIC_RELEASE); }

static void clock_add(worker_slot *w, int col, long long ns) {
    __atomic_store_n(&w->v[col], w->v[col] + (ns > 0 ? ns : 0), __ATOMIC_RELAXED);
}

/* the stretch under way ends ``now`` and goes to its column; the next one goes to ``next`` */
static void clock_switch(worker_slot *w, long long now, int next) {
    clock_open(w);
    clock_add(w, w->state, now - w->mark);
    __atomic_store_n(&w->mark, now, __ATOMIC_RELAXED);
    __atomic_store_n(&w->state, next, __ATOMIC_RELAXED);
    clock_close(w);
}

/* lock the engine's mutex, the wait for it on the W_LOCK clock */
static void lock_timed(worker_slot *w, pthread_mutex_t *mu) {
    clock_switch(w, now_ns(), W_LOCK);
    pthread_mutex_lock(mu);
    clock_switch(w, now_ns(), W_OTHER);
}

/* wait on the engine's work condition, the wait on the ``col`` clock (W_IDLE, W_BUDGET) */
static void wait_timed(worker_slot *w, engine *e, int col) {
    clock_switch(w, now_ns(), col);
    pthread_cond_wait(&e->work_cv, &e->mu);
    clock_switch(w, now_ns(), W_OTHER);
}

static void reuse_free_all(reuse_table *r);

static void engine_free(engine *e) {
    reuse_free_all(&e->reuse);
    free(e->workers);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->done_cv);
    free(e);
}

static void job_free(job *j) {
    pthread_rwlock_destroy(&j->place_lock);
    pthread_rwlock_destroy(&j->mem_lock);
    free(j->owned);
    free(j->blob);
    free(j->buf_base);
    free(j->buf_len);
    free(j->entries);
    free(j->entry_blob);
    free(j->status);
    free(j->detail);
    free(j->claimed);
    free(j->shared_at);
    free(j);
}

static void unlink_live_locked(engine *e, job *j) {
    if (!j->live)
        return;
    if (j->prev != NULL)
        j->prev->next_live = j->next_live;
    else
        e->live = j->next_live;
    if (j->next_live != NULL)
        j->next_live->prev = j->prev;
    j->prev = j->next_live = NULL;
    j->live = 0;
    __atomic_store_n(&e->n_live, e->n_live - 1, __ATOMIC_RELAXED);
    j->refs--; /* the list's reference */
}

/* drop one reference of a job and one of the engine it holds; frees what reaches zero (after the lock) */
static void job_unref_locked(engine *e, job *j, job **free_job, int *free_engine) {
    if (--j->refs == 0) {
        *free_job = j;
        *free_engine = --e->refs == 0;
    }
}

/* job_unref_locked for a thread that holds a reference of the engine too (so never the engine's last): a job
 * freed is freed with the lock let go for a moment */
static void job_unref_unlocking(engine *e, job *j) {
    job *fj = NULL;
    int fe = 0;
    job_unref_locked(e, j, &fj, &fe);
    if (fj != NULL) {
        pthread_mutex_unlock(&e->mu);
        job_free(fj);
        pthread_mutex_lock(&e->mu);
    }
}

/* ---- checking a plan ---- */

#define FAIL(msg)                                                                                                  \
    do {                                                                                                           \
        *error = msg;                                                                                              \
        return -1;                                                                                                 \
    } while (0)

/* The whole plan, before any thread sees it: every index in range, every size sane, every copy inside its
 * chunk's decoded span and inside the batch (check_copies), and no more elements written than the batch holds. */
static size_t aligned(long long n) { return ((size_t)n + ALIGN - 1) / ALIGN * ALIGN; }

/* buffer ``b``'s entries row when it is a disk-cache entry, else NULL */
static const int64_t *entry_of(const plan_tables *t, long long b) {
    if (t->entries == NULL)
        return NULL;
    const int64_t *r = t->entries + b * N_ENTRY_COLS;
    return r[E_PATH_LEN] == 0 && r[E_IDENT_LEN] == 0 ? NULL : r;
}

static int check_tables(const plan_tables *t, size_t *need, const char **error) {
    int ndim = t->ndim;
    if (ndim < 1 || ndim > MAX_NDIM)
        FAIL("the batch's rank must be between 1 and 32");
    if (t->n_chunks < 0 || t->n_copies < 0 || t->n_sources < 0 || t->n_files < 0 || t->blob_len < 0 ||
        t->n_buffers < 0)
        FAIL("negative table sizes");
    for (long long b = 0; b < t->n_buffers; b++)
        if (t->buffer_lens[b] < 0 || (t->buffers[b] == NULL && t->buffer_lens[b] != 0))
            FAIL("a buffer's length is negative");
    if (t->entries != NULL) {
        if (t->entry_blob_len < 0 || (t->entry_blob == NULL && t->entry_blob_len != 0))
            FAIL("the entry blob's length is negative");
        for (long long b = 0; b < t->n_buffers; b++) {
            const int64_t *r = t->entries + b * N_ENTRY_COLS;
            long long end;
            if (r[E_PATH_LEN] == 0 && r[E_IDENT_LEN] == 0)
                continue; /* a buffer in memory */
            if (t->buffers[b] != NULL)
                FAIL("a disk-cache entry's buffer is not None");
            if (r[E_PATH_START] < 0 || r[E_PATH_LEN] < 1 || r[E_PATH_LEN] >= PATH_CAP ||
                !add_ok(r[E_PATH_START], r[E_PATH_LEN], &end) || end > t->entry_blob_len)
                FAIL("a disk-cache entry's path is outside the entry blob, or too long");
            if (memchr(t->entry_blob + r[E_PATH_START], 0, (size_t)r[E_PATH_LEN]) != NULL)
                FAIL("a disk-cache entry's path holds a NUL byte");
            if (r[E_IDENT_START] < 0 || r[E_IDENT_LEN] < 0 || r[E_IDENT_LEN] > ENTRY_IDENT_CAP ||
                !add_ok(r[E_IDENT_START], r[E_IDENT_LEN], &end) || end > t->entry_blob_len)
                FAIL("a disk-cache entry's ident is outside the entry blob, or too long");
        }
    }
    if (t->dst.base == NULL || t->dst.nbytes < 0 || t->dst.kind < 0 || t->dst.kind >= N_DST_KINDS)
        FAIL("the batch target is not (a buffer, a kind of batch)");
    /* a buffer chunks are decoded from must not be the batch they are placed into: the threads write the batch
     * while others decode, and a frame whose header changes under its decode (c-blosc reads its sizes again
     * from the buffer) is read past its end. stoker's buffers are fetched values, never the batch; a direct
     * call could pass it. Compared as addresses (uintptr_t): two distinct objects. */
    for (long long b = 0; b < t->n_buffers; b++) {
        uintptr_t lo = (uintptr_t)t->buffers[b], dst = (uintptr_t)t->dst.base;
        if (t->buffer_lens[b] > 0 && t->dst.nbytes > 0 && lo < dst + (uintptr_t)t->dst.nbytes &&
            dst < lo + (uintptr_t)t->buffer_lens[b])
            FAIL("a buffer overlaps the batch it is placed into");
    }
    if (t->dst_strides[ndim - 1] != 1)
        FAIL("the batch's innermost stride must be 1");
    for (int k = 0; k < ndim; k++)
        if (t->dst_strides[k] < 0)
            FAIL("the batch's strides must not be negative");
    long long sw = S_STRIDES + ndim, fw = F_COORDS + ndim, cw = COPY_COLS(ndim);
    for (long long s = 0; s < t->n_sources; s++) {
        const int64_t *r = t->sources + s * sw;
        long long end;
        if (!cast_supported((int)r[S_KIND], t->dst.kind) || r[S_KIND] != (int)r[S_KIND])
            FAIL("a source's element kind cannot be cast into this batch");
        if (r[S_PATH_START] < 0 || r[S_PATH_LEN] < 1 || !add_ok(r[S_PATH_START], r[S_PATH_LEN], &end) ||
            end > t->blob_len || r[S_PATH_LEN] + 21LL * ndim + 1 > PATH_CAP)
            FAIL("a source's path prefix is outside the paths blob, or too long");
        if (memchr(t->blob + r[S_PATH_START], 0, (size_t)r[S_PATH_LEN]) != NULL)
            FAIL("a source's path prefix holds a NUL byte");
        if (r[S_SEP] != '/' && r[S_SEP] != '.')
            FAIL("a source's key separator is not '/' or '.'");
        if (r[S_SWAP] != 0 && r[S_SWAP] != 1)
            FAIL("a source's byte order flag is not 0 or 1");
    }
    for (long long f = 0; f < t->n_files; f++) {
        const int64_t *r = t->files + f * fw;
        if (r[F_SOURCE] < 0 || r[F_SOURCE] >= t->n_sources || (r[F_HAS_IDENT] != 0 && r[F_HAS_IDENT] != 1))
            FAIL("a file's source is out of range");
        for (int k = 0; k < ndim; k++)
            if (r[F_COORDS + k] < 0)
                FAIL("a file's grid coordinates are negative");
    }
    long long written = 0;
    *need = 0;
    for (long long i = 0; i < t->n_chunks; i++) {
        const int64_t *c = t->chunks + i * N_CHUNK_COLS;
        long long last;
        if (c[C_SOURCE] < 0 || c[C_SOURCE] >= t->n_sources)
            FAIL("a chunk's source is out of range");
        if (c[C_FIRST_COPY] < 0 || c[C_NCOPIES] < 0 || !add_ok(c[C_FIRST_COPY], c[C_NCOPIES], &last) ||
            last > t->n_copies)
            FAIL("a chunk's copies are outside the copies table");
        const int64_t *src = t->sources + c[C_SOURCE] * sw;
        int kind = (int)src[S_KIND];
        size_t d_item = dst_itemsize(&t->dst, kind);
        const int64_t *copies = t->copies + c[C_FIRST_COPY] * cw;
        for (long long k = 0; k < c[C_NCOPIES]; k++) { /* bytes written: each bounded by the batch in check_copies */
            long long n = 1;
            for (int a = 0; a < ndim; a++)
                if (copies[k * cw + CP_EXTENT + a] < 1 ||
                    __builtin_mul_overflow(n, copies[k * cw + CP_EXTENT + a], &n) || n > t->dst.nbytes)
                    FAIL("a copy's extent is not positive, or larger than the batch");
            if (__builtin_mul_overflow(n, (long long)d_item, &n) || !add_ok(written, n, &written) ||
                written > t->dst.nbytes)
                FAIL("the copies write more elements than the batch holds");
        }
        long long buf = c[C_BUFFER];
        if (buf < -1 || buf >= t->n_buffers)
            FAIL("a chunk's buffer is out of range");
        if (c[C_CODEC] == CODEC_FILL) {
            if (c[C_FILE] != -1 || buf != -1)
                FAIL("a fill chunk names a file or a buffer");
            if (check_fill_copies(ndim, t->dst_strides, copies, c[C_NCOPIES], cw, d_item, &t->dst))
                FAIL("a fill chunk's copies leave the batch");
            continue;
        }
        if (c[C_CODEC] < 0 || c[C_CODEC] >= N_CODECS || !codec_ready((int)c[C_CODEC]))
            FAIL("a chunk's codec is unknown or not set up");
        if (c[C_OFFSET] < -1 || c[C_LENGTH] < 0 || !add_ok(c[C_OFFSET], c[C_LENGTH], &last) ||
            (c[C_OFFSET] == -1 && c[C_LENGTH] != 0))
            FAIL("a chunk's byte range is not (-1, 0) nor (offset, length)");
        const int64_t *entry = buf >= 0 ? entry_of(t, buf) : NULL;
        if (entry != NULL) { /* a disk-cache entry: its whole payload (the entry says how long, read_entry checks) */
            if (c[C_FILE] != -1 || c[C_OFFSET] != -1)
                FAIL("a chunk in a disk-cache entry names a file or a byte range");
        } else if (buf >= 0) { /* in memory: the whole buffer (a missing value when NULL), or a range inside it */
            if (c[C_FILE] != -1)
                FAIL("a chunk in a buffer names a file");
            if (c[C_OFFSET] >= 0 && (t->buffers[buf] == NULL || last > t->buffer_lens[buf]))
                FAIL("a chunk's byte range is outside its buffer");
        } else {
            if (c[C_FILE] < 0 || c[C_FILE] >= t->n_files)
                FAIL("a chunk's file is out of range");
            const int64_t *f = t->files + c[C_FILE] * fw;
            if (f[F_SOURCE] != c[C_SOURCE])
                FAIL("a chunk's file belongs to another source");
            if (c[C_OFFSET] == -1 && f[F_HAS_IDENT])
                FAIL("a chunk's byte range is outside its file (a file identity is for inner chunks only)");
        }
        long long item = src_itemsize[kind];
        if (c[C_NBYTES] < 1 || c[C_NBYTES] % item || c[C_NBYTES] > (1LL << 40) || c[C_MAX_STORED] < 0 ||
            c[C_MAX_STORED] > (1LL << 41))
            FAIL("a chunk's sizes are not those of a chunk");
        if (c[C_SPAN_START] < 0 || c[C_SPAN_START] > c[C_SPAN_STOP] || c[C_SPAN_STOP] > c[C_NBYTES])
            FAIL("a chunk's span is outside the chunk");
        if (check_copies(kind, ndim, src + S_STRIDES, t->dst_strides, copies, c[C_NCOPIES], cw, c[C_NBYTES],
                         c[C_SPAN_START], c[C_SPAN_STOP], NULL, &t->dst, 1))
            FAIL("a chunk's copies leave its decoded span or the batch");
        /* a chunk in a buffer is decoded from it: its stored bytes take no scratch; a disk-cache entry is read
         * whole (header, ident, payload) after the decoded bytes */
        size_t chunk_need = aligned(c[C_NBYTES]) + (entry != NULL ? ENTRY_HEADER_BYTES + (size_t)entry[E_IDENT_LEN] +
                                                                       (size_t)c[C_MAX_STORED]
                                                    : buf >= 0 ? 0 : (size_t)c[C_MAX_STORED]);
        if (chunk_need > *need)
            *need = chunk_need;
    }
    return 0;
}

/* ---- shared chunks (see "Shared") ---- */

#define MAX_SHARERS 8 /* the most other jobs one decode is placed into */

static const int64_t *file_row(const plan_tables *t, const int64_t *c) {
    return t->files + c[C_FILE] * (F_COORDS + t->ndim);
}

/* chunk ``c``'s disk-cache entry row when it is read from one (by a non-empty ident), else NULL */
static const int64_t *shared_entry(const plan_tables *t, const int64_t *c) {
    if (c[C_CODEC] == CODEC_FILL || c[C_BUFFER] < 0)
        return NULL;
    const int64_t *r = entry_of(t, c[C_BUFFER]);
    return r != NULL && r[E_IDENT_LEN] > 0 ? r : NULL;
}

/* whether chunk ``c`` (checked) may be shared: read from a file (a fetched buffer belongs to its job), an
 * inner chunk of a shard file of known identity or a whole chunk file (named by its path), or a disk-cache
 * entry (named by its ident: the store, key, range and generation of the bytes it holds) */
static int shareable(const plan_tables *t, const int64_t *c) {
    if (c[C_CODEC] == CODEC_FILL)
        return 0;
    if (c[C_BUFFER] >= 0)
        return shared_entry(t, c) != NULL;
    if (c[C_FILE] < 0)
        return 0;
    return (c[C_OFFSET] >= 0) == (file_row(t, c)[F_HAS_IDENT] == 1);
}

static unsigned long long mix(unsigned long long h, unsigned long long v) {
    h ^= v + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
    return h * 0xBF58476D1CE4E5B9ULL;
}

/* h continued over n bytes at p: FNV-1a */
static unsigned long long fnv1a(unsigned long long h, const unsigned char *p, long long n) {
    for (long long k = 0; k < n; k++)
        h = (h ^ p[k]) * 0x100000001B3ULL;
    return h;
}

/* a shard's inner chunk by its file's identity and offset; a chunk file by its path: the source's prefix
 * and the file's grid coordinates */
static unsigned long long share_hash(const plan_tables *t, const int64_t *c) {
    unsigned long long h = 0;
    const int64_t *e = shared_entry(t, c);
    if (e != NULL) { /* an entry by its ident */
        const unsigned char *p = (const unsigned char *)t->entry_blob + e[E_IDENT_START];
        h = fnv1a(h, p, e[E_IDENT_LEN]);
        return h ^ (h >> 31);
    }
    const int64_t *f = file_row(t, c);
    if (c[C_OFFSET] >= 0) {
        /* the length too: an index may name one offset with many lengths (never equal, see same_stored),
         * which would otherwise make one probe chain of them all (quadratic) */
        h = mix(mix(mix(mix(h, (unsigned long long)f[F_DEV]), (unsigned long long)f[F_INO]),
                    (unsigned long long)c[C_OFFSET]), (unsigned long long)c[C_LENGTH]);
    } else {
        const int64_t *src = t->sources + c[C_SOURCE] * (S_STRIDES + t->ndim);
        const unsigned char *p = (const unsigned char *)t->blob + src[S_PATH_START];
        h = fnv1a(h, p, src[S_PATH_LEN]);
        for (int k = 0; k < t->ndim; k++)
            h = mix(h, (unsigned long long)f[F_COORDS + k]);
    }
    return h ^ (h >> 31);
}

/* whether shareable chunks ``a`` of ``ta`` and ``b`` of ``tb`` are the same stored bytes, decoded alike: the
 * same byte range, codec and decoded size of the same file (a shard's whole identity; a chunk file's path) */
static int same_stored(const plan_tables *ta, const int64_t *a, const plan_tables *tb, const int64_t *b) {
    if (a[C_OFFSET] != b[C_OFFSET] || a[C_LENGTH] != b[C_LENGTH] || a[C_CODEC] != b[C_CODEC] ||
        a[C_NBYTES] != b[C_NBYTES] || a[C_MAX_STORED] != b[C_MAX_STORED] || ta->ndim != tb->ndim)
        return 0;
    const int64_t *ea = shared_entry(ta, a), *eb = shared_entry(tb, b);
    if (ea != NULL || eb != NULL) /* entries: the same ident and path (an entry and a file: never the same) */
        return ea != NULL && eb != NULL && ea[E_IDENT_LEN] == eb[E_IDENT_LEN] && ea[E_PATH_LEN] == eb[E_PATH_LEN] &&
               memcmp(ta->entry_blob + ea[E_IDENT_START], tb->entry_blob + eb[E_IDENT_START],
                      (size_t)ea[E_IDENT_LEN]) == 0 &&
               memcmp(ta->entry_blob + ea[E_PATH_START], tb->entry_blob + eb[E_PATH_START],
                      (size_t)ea[E_PATH_LEN]) == 0;
    const int64_t *fa = file_row(ta, a), *fb = file_row(tb, b);
    if (fa[F_HAS_IDENT] != fb[F_HAS_IDENT])
        return 0;
    if (a[C_OFFSET] >= 0) {
        for (int k = F_DEV; k <= F_CTIME; k++)
            if (fa[k] != fb[k])
                return 0;
        return 1;
    }
    const int64_t *sa = ta->sources + a[C_SOURCE] * (S_STRIDES + ta->ndim);
    const int64_t *sb = tb->sources + b[C_SOURCE] * (S_STRIDES + tb->ndim);
    if (sa[S_PATH_LEN] != sb[S_PATH_LEN] || sa[S_SEP] != sb[S_SEP] ||
        memcmp(ta->blob + sa[S_PATH_START], tb->blob + sb[S_PATH_START], (size_t)sa[S_PATH_LEN]) != 0)
        return 0;
    for (int k = 0; k < ta->ndim; k++)
        if (fa[F_COORDS + k] != fb[F_COORDS + k])
            return 0;
    return 1;
}

/* the job's table of shareable chunks (after check_tables): -1 when out of memory. One entry per distinct stored
 * chunk, its first row: take_sharers_locked stops at the first match, so a later row of the same bytes (a shard
 * whose index names one range for many inner chunks) is never found, and entered it would lengthen every probe
 * through its slot (many such rows: a build quadratic in them). Linear in the rows, expected. */
static int build_shared(job *j) {
    const plan_tables *t = &j->t;
    long long n = 0, cap = 1;
    for (long long i = 0; i < t->n_chunks; i++)
        n += shareable(t, t->chunks + i * N_CHUNK_COLS);
    if (n == 0)
        return 0;
    while (cap < 2 * n) /* n <= n_chunks, bounded by the tables' memory: no overflow */
        cap <<= 1;
    j->shared_at = calloc((size_t)cap, sizeof(long long));
    if (j->shared_at == NULL)
        return -1;
    j->shared_cap = cap;
    for (long long i = 0; i < t->n_chunks; i++) {
        const int64_t *c = t->chunks + i * N_CHUNK_COLS;
        if (!shareable(t, c))
            continue;
        long long s = (long long)(share_hash(t, c) & (unsigned long long)(cap - 1));
        while (j->shared_at[s] && !same_stored(t, t->chunks + (j->shared_at[s] - 1) * N_CHUNK_COLS, t, c))
            s = (s + 1) & (cap - 1); /* at most half full: an empty slot ends the probe */
        if (!j->shared_at[s])
            j->shared_at[s] = i + 1;
    }
    return 0;
}

/* the job's own copy: the caller's buffers may change once job_new returns (they were checked here) */
static void copy_table(int64_t *to, const int64_t *from, long long n) {
    if (n)
        memcpy(to, from, sizeof(int64_t) * (size_t)n);
}

job *job_new(engine *e, const plan_tables *t, const char **error) {
    job *j = calloc(1, sizeof(job));
    long long sw = S_STRIDES + t->ndim, fw = F_COORDS + t->ndim, cw = COPY_COLS(t->ndim);
    long long values = t->n_chunks * N_CHUNK_COLS + t->n_copies * cw + t->n_sources * sw + t->n_files * fw;
    if (j == NULL)
        goto oom;
    j->owned = malloc(sizeof(int64_t) * (size_t)(values ? values : 1));
    j->blob = malloc((size_t)(t->blob_len ? t->blob_len : 1));
    j->status = malloc(sizeof(int32_t) * (size_t)(t->n_chunks ? t->n_chunks : 1));
    j->detail = calloc((size_t)(t->n_chunks ? t->n_chunks : 1), sizeof(int64_t));
    j->claimed = calloc((size_t)(t->n_chunks ? t->n_chunks : 1), 1);
    long long nb = t->n_buffers > 0 ? t->n_buffers : 1;
    j->buf_base = nb <= LLONG_MAX / 8 ? malloc(sizeof(char *) * (size_t)nb) : NULL;
    j->buf_len = nb <= LLONG_MAX / 8 ? malloc(sizeof(long long) * (size_t)nb) : NULL;
    if (t->entries != NULL) {
        j->entries = nb <= LLONG_MAX / 64 ? malloc(sizeof(int64_t) * N_ENTRY_COLS * (size_t)nb) : NULL;
        j->entry_blob = t->entry_blob_len >= 0 ? malloc((size_t)(t->entry_blob_len ? t->entry_blob_len : 1)) : NULL;
        if (j->entries == NULL || j->entry_blob == NULL)
            goto oom;
    }
    if (j->owned == NULL || j->blob == NULL || j->status == NULL || j->detail == NULL || j->claimed == NULL ||
        j->buf_base == NULL || j->buf_len == NULL)
        goto oom;
    /* copied first, then checked: what the workers read is what was checked, whatever the caller's buffers do */
    j->t = *t;
    int64_t *p = j->owned;
    copy_table(p, t->chunks, t->n_chunks * N_CHUNK_COLS);
    j->t.chunks = p, p += t->n_chunks * N_CHUNK_COLS;
    copy_table(p, t->copies, t->n_copies * cw);
    j->t.copies = p, p += t->n_copies * cw;
    copy_table(p, t->sources, t->n_sources * sw);
    j->t.sources = p, p += t->n_sources * sw;
    copy_table(p, t->files, t->n_files * fw);
    j->t.files = p;
    if (t->blob_len)
        memcpy(j->blob, t->blob, (size_t)t->blob_len);
    j->t.blob = j->blob;
    if (t->n_buffers > 0) {
        memcpy(j->buf_base, t->buffers, sizeof(char *) * (size_t)t->n_buffers);
        memcpy(j->buf_len, t->buffer_lens, sizeof(long long) * (size_t)t->n_buffers);
    }
    j->t.buffers = j->buf_base;
    j->t.buffer_lens = j->buf_len;
    if (t->entries != NULL) {
        if (t->n_buffers > 0)
            memcpy(j->entries, t->entries, sizeof(int64_t) * N_ENTRY_COLS * (size_t)t->n_buffers);
        if (t->entry_blob_len > 0)
            memcpy(j->entry_blob, t->entry_blob, (size_t)t->entry_blob_len);
        j->t.entries = j->entries;
        j->t.entry_blob = j->entry_blob;
    }
    if (check_tables(&j->t, &j->need, error))
        goto bad;
    if ((long long)j->need > e->budget) {
        *error = "the batch's largest chunk needs more scratch per thread than the engine's budget";
        goto bad;
    }
    if (build_shared(j))
        goto oom;
    for (long long i = 0; i < t->n_chunks; i++)
        j->status[i] = ST_PENDING;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#if defined(__GLIBC__)
    /* glibc prefers readers by default: with many workers placing, job_cancel could wait on and on */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    pthread_rwlock_init(&j->place_lock, &attr);
    pthread_rwlock_init(&j->mem_lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    j->refs = 1; /* the caller's */
    return j;
oom:
    *error = "out of memory";
bad:
    if (j != NULL) {
        free(j->owned);
        free(j->blob);
        free(j->status);
        free(j->detail);
        free(j->claimed);
        free(j->shared_at);
        free(j->buf_base);
        free(j->buf_len);
        free(j->entries);
        free(j->entry_blob);
        free(j);
    }
    return NULL;
}

long long job_chunks(const job *j) { return j->t.n_chunks; }

/* ---- a worker ---- */

static void count(long long *field, long long value) { __atomic_add_fetch(field, value, __ATOMIC_RELAXED); }

/* dir/prefix (the source's path prefix) then the grid coordinates joined by the separator */
static void build_path(char *out, const job *j, const int64_t *src, const int64_t *coords) {
    chunk_path(out, j->t.blob + src[S_PATH_START], (size_t)src[S_PATH_LEN], (char)src[S_SEP], coords, j->t.ndim);
}

/* A chunk's times (ns) as its worker's clocks take them (see "Accounting"); ``end``: when it was placed (0: not
 * measured, the clock is read then). */
typedef struct {
    long long read, decode, lock, place, fill, end;
} chunk_times;

/* Write into the batch only while the job is not cancelled (see job_cancel): ST_OK, ST_CANCELLED, or ST_RANGE
 * when a value did not fit the batch (see ST_RANGE). The job's counters go to ``mine`` (see run_job). */
static int place_chunk(job *j, const int64_t *src, const int64_t *c, const char *decoded, int fill,
                       job_counters *mine, chunk_times *tm) {
    const plan_tables *t = &j->t;
    int ndim = t->ndim, kind = (int)src[S_KIND];
    const int64_t *copies = t->copies + c[C_FIRST_COPY] * COPY_COLS(ndim);
    long long t0 = now_ns();
    pthread_rwlock_rdlock(&j->place_lock);
    long long t1 = now_ns();
    int go = !j->cancelled, bad = 0;
    if (go) {
        if (fill) {
            unsigned char value[8];
            memcpy(value, &src[S_FILL], sizeof(value));
            fill_copies(ndim, t->dst_strides, copies, c[C_NCOPIES], COPY_COLS(ndim), value,
                        dst_itemsize(&t->dst, kind), &t->dst);
        } else {
            bad = place_copies(kind, (int)src[S_SWAP], ndim, src + S_STRIDES, t->dst_strides, copies, c[C_NCOPIES],
                               COPY_COLS(ndim), decoded, &t->dst);
        }
        place_fence(&t->dst);
    }
    pthread_rwlock_unlock(&j->place_lock);
    long long t2 = now_ns();
    *(fill ? &mine->fill_ns : &mine->place_ns) += t2 - t0;
    tm->lock += t1 - t0;
    *(fill ? &tm->fill : &tm->place) += t2 - t1;
    tm->end = t2;
    return !go ? ST_CANCELLED : bad ? ST_RANGE : ST_OK;
}

/* Where a chunk's decode may write straight into the batch, skipping the copy through the scratch, or NULL: a
 * zstd chunk of a file (a chunk file or a shard's inner chunk; not a buffer), its copies reading all of it
 * (so no early stop: the reads come first, then the decode), placed as it is stored (its source kind is the
 * batch's, no byte swap) by one copy of the whole chunk from its first element, over which the chunk's strides
 * and the batch's are both C-contiguous (axes of extent 1 aside): the decoded bytes are then that copy's
 * bytes, in order, one contiguous run of the batch, inside it (check_copies at job_new). Forecasting's whole
 * (1, lat, lon) planes of float32 are such chunks: the copy took 1.1-1.4 ms of CPU a batch of 96. */
static char *direct_place(const job *j, const int64_t *src, const int64_t *c) {
    const plan_tables *t = &j->t;
    int ndim = t->ndim, kind = (int)src[S_KIND], dk = t->dst.kind;
    if (c[C_CODEC] != CODEC_ZSTD || c[C_BUFFER] >= 0 || c[C_NCOPIES] != 1 ||
        c[C_SPAN_START] != 0 || c[C_SPAN_STOP] != c[C_NBYTES])
        return NULL;
    int same = dk == KIND_SAME || (dk == KIND_F32 && kind == K_F32) || (dk == KIND_I32 && kind == K_I32) ||
               (dk == KIND_I64 && kind == K_I64);
    long long item = src_itemsize[kind];
    if (!same || (src[S_SWAP] && item > 1))
        return NULL;
    const int64_t *cp = t->copies + c[C_FIRST_COPY] * COPY_COLS(ndim);
    const int64_t *ss = src + S_STRIDES;
    long long elems = 1; /* the copy's elements so far, innermost axes first: the stride a contiguous axis has */
    if (cp[CP_SRC_OFFSET] != 0)
        return NULL;
    for (int k = ndim - 1; k >= 0; k--) {
        long long ext = cp[CP_EXTENT + k];
        if (ext == 1)
            continue;
        if (ss[k] != elems || t->dst_strides[k] != elems)
            return NULL;
        elems *= ext; /* no overflow: check_copies bounded the copy's elements by the batch's */
    }
    if (elems * item != c[C_NBYTES])
        return NULL;
    return t->dst.base + cp[CP_DST_OFFSET] * item;
}

/* claim_out and release_out of a chunk decoded into the batch: the place lock, as place_chunk holds it, so
 * that job_cancel waits for the decode and none writes after it returns */
static int claim_batch(void *arg) {
    job *j = arg;
    pthread_rwlock_rdlock(&j->place_lock);
    if (!j->cancelled)
        return 0;
    pthread_rwlock_unlock(&j->place_lock);
    return 1;
}

static void release_batch(void *arg) {
    job *j = arg;
    pthread_rwlock_unlock(&j->place_lock);
}

/* Shard files a thread keeps open while it works on a job (see chunk_io.reuse): a crop's inner chunks come
 * one after the other, and one crop may straddle a few shards (threads share a job's chunks in turn, so each
 * sees those shards alternate). Keyed by the job's file row, so a file is only ever reused for the identity
 * its row was read with. Only files on a local file system are kept (on_local_fs); a thread holds at most
 * KEPT_FILES of them, and none once it leaves the job. */
#define KEPT_FILES 4
typedef struct {
    long long file[KEPT_FILES]; /* the job's file row */
    int fd[KEPT_FILES];
    int n;
} kept_files;

/* the descriptor kept for file row ``file``, taken out of ``k`` (the chunk's read owns it now), or -1; the
 * others stay in order of last use, oldest first */
static int take_kept(kept_files *k, long long file) {
    for (int s = 0; s < k->n; s++) {
        if (k->file[s] == file) {
            int fd = k->fd[s];
            k->n--;
            memmove(k->file + s, k->file + s + 1, (size_t)(k->n - s) * sizeof(k->file[0]));
            memmove(k->fd + s, k->fd + s + 1, (size_t)(k->n - s) * sizeof(k->fd[0]));
            return fd;
        }
    }
    return -1;
}

/* keep ``fd`` (file row ``file``) for the thread's next chunks of it; full: the least recently used is closed */
static void keep_file(kept_files *k, long long file, int fd) {
    if (k->n == KEPT_FILES) {
        close(k->fd[0]);
        memmove(k->file, k->file + 1, (KEPT_FILES - 1) * sizeof(k->file[0]));
        memmove(k->fd, k->fd + 1, (KEPT_FILES - 1) * sizeof(k->fd[0]));
        k->n--;
    }
    k->file[k->n] = file, k->fd[k->n] = fd;
    k->n++;
}

static void close_kept(kept_files *k) {
    while (k->n)
        close(k->fd[--k->n]);
}

static void finish_chunks(engine *e, job *j, long long n, worker_slot *w);

/* Under mu: take the chunks of the engine's other live jobs that are chunk ``c`` of ``j`` (hash ``h``, see
 * "Shared") and that no thread took yet: each in ``jobs``/``idx``, with a reference held. Returns how many. */
static int take_sharers_locked(engine *e, job *j, const int64_t *c, unsigned long long h, job **jobs,
                               long long *idx) {
    int n = 0;
    for (job *k = e->live; k != NULL && n < MAX_SHARERS; k = k->next_live) {
        if (k == j || k->shared_cap == 0 || __atomic_load_n(&k->cancelled, __ATOMIC_ACQUIRE))
            continue;
        long long mask = k->shared_cap - 1;
        /* the table is at most half full: the probe meets an empty slot */
        for (long long s = (long long)(h & (unsigned long long)mask); k->shared_at[s]; s = (s + 1) & mask) {
            long long i = k->shared_at[s] - 1;
            if (!same_stored(&j->t, c, &k->t, k->t.chunks + i * N_CHUNK_COLS))
                continue;
            if (__atomic_exchange_n(&k->claimed[i], 1, __ATOMIC_ACQ_REL) == 0) {
                k->refs++;
                jobs[n] = k, idx[n] = i, n++;
            }
            break;
        }
    }
    return n;
}

/* Chunk ``i`` of ``k``, taken by take_sharers_locked (or joined to a flight), from the chunk another job's thread
 * read and decoded (``io``, into ``scratch``): placed with k's own copies (or its failure reported as k's),
 * finished, k let go.
 * ``served``: a disk-cache entry's payload bytes, its detail once placed (the cache's hit bytes; 0 else). */
static void share_out(engine *e, worker_slot *w, job *k, long long i, const chunk_io *io, const char *scratch,
                      chunk_times *tm, long long served) {
    const int64_t *c = k->t.chunks + i * N_CHUNK_COLS;
    const int64_t *src = k->t.sources + c[C_SOURCE] * (S_STRIDES + k->t.ndim);
    job_counters mine = {0};
    int32_t status = io->status;
    int64_t detail = io->detail;
    if (status == ST_MISSING && c[C_OFFSET] < 0) { /* an absent chunk file: k's fill value */
        status = place_chunk(k, src, c, NULL, 1, &mine, tm);
        detail = 0;
        if (status == ST_OK)
            mine.chunks_filled++;
    } else if (status == ST_OK) {
        status = place_chunk(k, src, c, scratch, 0, &mine, tm);
        detail = status == ST_OK ? served : 0;
        if (status == ST_OK)
            mine.chunks_shared++;
    }
    long long *from = (long long *)&mine, *to = (long long *)&k->counters;
    for (size_t f = 0; f < sizeof(job_counters) / sizeof(long long); f++)
        if (from[f])
            __atomic_add_fetch(&to[f], from[f], __ATOMIC_RELAXED);
    __atomic_store_n(&k->detail[i], detail, __ATOMIC_RELAXED);
    __atomic_store_n(&k->status[i], status, __ATOMIC_RELEASE);
    clock_open(w); /* a chunk this thread finished (its times go to the chunk it was read for) */
    clock_add(w, W_CHUNKS, 1);
    clock_close(w);
    /* mid-chunk: the worker's clock stretch is the chunk's (clock_chunk closes it), so the locks here are not
     * clock_switch'ed (lock_timed) but timed into the chunk's tm->lock; finish_chunks' rare lock falls in the
     * chunk's W_OTHER rest */
    finish_chunks(e, k, 1, NULL);
    long long t0 = now_ns();
    pthread_mutex_lock(&e->mu);
    tm->lock += now_ns() - t0;
    job_unref_unlocking(e, k);
    pthread_mutex_unlock(&e->mu);
}

/* a chunk file's (or a shard's inner chunk's) path and identity into ``io``; a shard's file may stay open */
static void file_io(const job *j, const int64_t *src, const int64_t *c, char *path, chunk_io *io, kept_files *kept,
                    job_counters *mine) {
    const plan_tables *t = &j->t;
    const int64_t *f = t->files + c[C_FILE] * (F_COORDS + t->ndim);
    build_path(path, j, src, f + F_COORDS);
    io->path = path;
    io->has_ident = (int)f[F_HAS_IDENT];
    io->dev = (unsigned long long)f[F_DEV];
    io->ino = (unsigned long long)f[F_INO];
    io->size = f[F_SIZE];
    io->mtime_ns = f[F_MTIME];
    io->ctime_ns = f[F_CTIME];
    if (io->has_ident && io->offset >= 0) { /* an inner chunk of a shard: its file may stay open */
        io->keep = 1;
        io->fd = take_kept(kept, c[C_FILE]);
        io->reuse = io->fd >= 0;
    }
    if (!io->reuse)
        mine->files_opened++;
}

/* statuses a decode as far as another span may not have had: a codec's error or size, a file read short */
static int span_failure(int32_t status) {
    return status == ST_CODEC_ERROR || status == ST_SIZE || status == ST_SHORT || status == ST_FRAME;
}

/* a shareable chunk ``c`` of ``j`` (from a file) read and decoded into the scratch as far as [start, stop) alone */
static void decode_alone(const job *j, const int64_t *src, const int64_t *c, long long start, long long stop,
                         char *path, chunk_io *io, char *scratch, codec_ctx *ctx, kept_files *kept,
                         job_counters *mine, chunk_times *tm) {
    memset(io, 0, sizeof(*io));
    io->out = scratch;
    io->offset = c[C_OFFSET];
    io->length = c[C_LENGTH];
    io->span_start = start;
    io->span_stop = stop;
    file_io(j, src, c, path, io, kept, mine);
    read_decode(io, (int)c[C_CODEC], scratch + aligned(c[C_NBYTES]), (size_t)c[C_MAX_STORED], (size_t)c[C_NBYTES],
                ctx);
    if (io->kept)
        keep_file(kept, c[C_FILE], io->fd);
    mine->bytes_read += io->nread;
    mine->read_ns += io->read_ns;
    mine->decode_ns += io->decode_ns;
    tm->read += io->read_ns;
    tm->decode += io->decode_ns;
}

/* ---- decoded chunks kept (see "Reused") ---- */

#define REUSE_KEY_CAP 4096 /* a key longer than this (a very long path) is not kept */

typedef struct {
    unsigned char bytes[REUSE_KEY_CAP];
    size_t len; /* 0: the chunk is not kept */
    unsigned long long hash;
} reuse_key;

static size_t key_put(unsigned char *out, size_t at, const void *p, size_t n) {
    if (at + n <= REUSE_KEY_CAP)
        memcpy(out + at, p, n);
    return at + n;
}

/* chunk ``c``'s key into ``k`` when its job keeps chunks and it is a file's (k->len 0 otherwise): what same_stored
 * compares, as bytes (a shard's identity and range; a chunk file's path, separator and grid coordinates) */
static void reuse_key_of(const job *j, const int64_t *c, reuse_key *k) {
    const plan_tables *t = &j->t;
    k->len = 0;
    if (!j->reuse || c[C_BUFFER] >= 0 || !shareable(t, c))
        return;
    int64_t head[6] = {c[C_CODEC], c[C_NBYTES], c[C_MAX_STORED], c[C_OFFSET], c[C_LENGTH], t->ndim};
    size_t at = key_put(k->bytes, 0, head, sizeof(head));
    const int64_t *f = file_row(t, c);
    if (c[C_OFFSET] >= 0) { /* an inner chunk of a shard of known identity (shareable) */
        at = key_put(k->bytes, at, f + F_DEV, sizeof(int64_t) * (size_t)(F_CTIME - F_DEV + 1));
    } else {
        const int64_t *src = t->sources + c[C_SOURCE] * (S_STRIDES + t->ndim);
        int64_t path[2] = {src[S_SEP], src[S_PATH_LEN]};
        at = key_put(k->bytes, at, path, sizeof(path));
        at = key_put(k->bytes, at, t->blob + src[S_PATH_START], (size_t)src[S_PATH_LEN]);
        at = key_put(k->bytes, at, f + F_COORDS, sizeof(int64_t) * (size_t)t->ndim);
    }
    if (at > REUSE_KEY_CAP)
        return;
    k->len = at;
    unsigned long long h = fnv1a(0xCBF29CE484222325ULL, k->bytes, (long long)at);
    k->hash = h ^ (h >> 31);
}

static void lock_in_chunk(engine *e, chunk_times *tm) { /* mid-chunk: timed into the chunk (see share_out) */
    long long t0 = now_ns();
    pthread_mutex_lock(&e->mu);
    tm->lock += now_ns() - t0;
}

static void reuse_unlink_list(reuse_table *r, reuse_entry *x) {
    if (x->newer != NULL)
        x->newer->older = x->older;
    else
        r->newest = x->older;
    if (x->older != NULL)
        x->older->newer = x->newer;
    else
        r->oldest = x->newer;
    x->newer = x->older = NULL;
}

static void reuse_push_newest(reuse_table *r, reuse_entry *x) {
    x->older = r->newest;
    x->newer = NULL;
    if (r->newest != NULL)
        r->newest->newer = x;
    r->newest = x;
    if (r->oldest == NULL)
        r->oldest = x;
}

/* under mu: ``x`` out of the table and the list; returned to be freed (after mu) when nobody places from it,
 * else its last user frees it. Its bytes stay counted until freed. */
static reuse_entry *reuse_unlist_locked(reuse_table *r, reuse_entry *x) {
    reuse_entry **at = &r->bucket[x->hash % REUSE_BUCKETS];
    while (*at != x)
        at = &(*at)->chain;
    *at = x->chain;
    x->chain = NULL;
    reuse_unlink_list(r, x);
    x->listed = 0;
    r->entries--;
    r->evicted++;
    if (x->refs > 0)
        return NULL;
    r->held -= x->nbytes;
    return x;
}

static void reuse_entry_free(reuse_entry *x) {
    free(x->data);
    free(x->key);
    free(x);
}

/* the entries in a chain of ``chain`` links (unlisted, unpinned), freed */
static void reuse_free_chain(reuse_entry *x) {
    while (x != NULL) {
        reuse_entry *next = x->chain;
        reuse_entry_free(x);
        x = next;
    }
}

/* under mu: evict least recently used entries until ``room`` more bytes fit; the evicted ones to free after mu
 * are chained onto ``*spent`` */
static void reuse_make_room_locked(reuse_table *r, long long room, reuse_entry **spent) {
    while (r->oldest != NULL && r->held + room > r->max_bytes) {
        reuse_entry *x = reuse_unlist_locked(r, r->oldest);
        if (x != NULL)
            x->chain = *spent, *spent = x;
    }
}

/* under mu: the kept chunk of key ``k`` for ``j``'s generation, pinned (reuse_let_go), or NULL */
static reuse_entry *reuse_find_locked(reuse_table *r, const job *j, const reuse_key *k) {
    if (r->entries == 0) /* nothing kept (a new generation, the first batches): no bucket to walk */
        return NULL;
    reuse_entry *x = r->bucket[k->hash % REUSE_BUCKETS];
    while (x != NULL && !(x->hash == k->hash && x->generation == j->reuse_gen && x->key_len == k->len &&
                          memcmp(x->key, k->bytes, k->len) == 0))
        x = x->chain;
    if (x != NULL) {
        x->refs++;
        r->hits++;
        reuse_unlink_list(r, x);
        reuse_push_newest(r, x);
    }
    return x;
}

static void reuse_let_go(engine *e, reuse_entry *x, chunk_times *tm) {
    lock_in_chunk(e, tm);
    int last = --x->refs == 0 && !x->listed;
    if (last)
        e->reuse.held -= x->nbytes;
    pthread_mutex_unlock(&e->mu);
    if (last)
        reuse_entry_free(x);
}

/* under mu: room for ``nbytes`` a chunk to be kept is decoded (or copied) into, counted in ``held`` from here on,
 * within the bound (older entries evicted first, chained onto ``*spent`` to free after mu, so the bytes of decodes
 * in flight are bounded too and in ``peak``): 1 when taken, 0 when the bound has no room for it (entries pinned,
 * other decodes in flight) */
static int reuse_reserve_locked(reuse_table *r, long long nbytes, reuse_entry **spent) {
    if (nbytes <= 0 || nbytes > r->max_bytes)
        return 0;
    reuse_make_room_locked(r, nbytes, spent);
    if (r->held + nbytes > r->max_bytes)
        return 0;
    r->held += nbytes;
    r->peak = r->held > r->peak ? r->held : r->peak;
    return 1;
}

/* the memory for ``nbytes`` reserved (reuse_reserve_locked), or NULL when there is none (the reservation given
 * back) */
static char *reuse_alloc(engine *e, long long nbytes, chunk_times *tm) {
    void *data = NULL;
    if (posix_memalign(&data, ALIGN, (size_t)nbytes) == 0)
        return data;
    lock_in_chunk(e, tm);
    e->reuse.held -= nbytes;
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* memory a chunk of ``nbytes`` to be kept is copied into (reuse_reserve_locked, then reuse_alloc): handed to
 * reuse_land or to reuse_unbuffer; NULL when the bound has no room for it or no memory */
static char *reuse_buffer(engine *e, long long nbytes, chunk_times *tm) {
    reuse_table *r = &e->reuse;
    reuse_entry *spent = NULL;
    lock_in_chunk(e, tm);
    int room = reuse_reserve_locked(r, nbytes, &spent);
    pthread_mutex_unlock(&e->mu);
    reuse_free_chain(spent);
    return room ? reuse_alloc(e, nbytes, tm) : NULL;
}

/* a buffer from reuse_buffer (or a reservation's, reuse_alloc) not kept: freed, its bytes no longer counted */
static void reuse_unbuffer(engine *e, char *data, long long nbytes, chunk_times *tm) {
    lock_in_chunk(e, tm);
    e->reuse.held -= nbytes;
    pthread_mutex_unlock(&e->mu);
    free(data);
}

/* A decode in flight of a chunk to be kept (see "Reused"), on its thread's stack, listed in e->flights from the
 * section that starts it (start_shared) to the one that keeps it (reuse_land) or lets it go (flight_land), both
 * under mu: a job of its generation that needs the same stored chunk meanwhile joins it (flight_join_locked; its
 * thread goes on to other chunks) and is placed from this decode, as a sharer is. At most one per thread. */
typedef struct flight {
    struct flight *next;
    const job *j; /* the job it is read for (its thread holds a reference), its chunk row and share_hash */
    const int64_t *c;
    unsigned long long hash;
    long long generation; /* j's reuse_gen: only jobs of it join */
    int room, n;          /* joiners it may take (MAX_SHARERS less the sharers taken with it), and has */
    job *jobs[MAX_SHARERS];
    long long idx[MAX_SHARERS];
} flight;

/* under mu: chunk ``i`` of ``j`` (``c``, share_hash ``h``) handed to a decode in flight of its generation of the
 * same stored chunk (whole: any span is inside it), a reference of j held for it: 1, or 0 when none has room */
static int flight_join_locked(engine *e, job *j, long long i, const int64_t *c, unsigned long long h) {
    for (flight *f = e->flights; f != NULL; f = f->next) {
        if (f->hash != h || f->j == j || f->generation != j->reuse_gen || f->n >= f->room ||
            !same_stored(&f->j->t, f->c, &j->t, c))
            continue;
        j->refs++;
        f->jobs[f->n] = j, f->idx[f->n] = i;
        f->n++;
        return 1;
    }
    return 0;
}

/* under mu: ``f`` out of the engine's list, its joiners into ``jobs``/``idx`` (room for f->room); how many */
static int flight_unlist_locked(engine *e, flight *f, job **jobs, long long *idx) {
    flight **at = &e->flights;
    while (*at != f)
        at = &(*at)->next;
    *at = f->next;
    for (int k = 0; k < f->n; k++)
        jobs[k] = f->jobs[k], idx[k] = f->idx[k];
    return f->n;
}

/* the end of a flight whose chunk is not kept (its decode failed): flight_unlist_locked under a lock of its own */
static int flight_land(engine *e, flight *f, job **jobs, long long *idx, chunk_times *tm) {
    lock_in_chunk(e, tm);
    int n = flight_unlist_locked(e, f, jobs, idx);
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* The end of flight ``f``, its chunk decoded whole and sound at ``decoded`` (see "Reused"): kept under key ``k``
 * for ``j``'s generation (older entries evicted to fit the bound as it is now), unless another thread kept it
 * meanwhile, the generation moved on or the bound, lowered meanwhile, is below it; and unlisted in the same
 * section (a thread that misses the flight finds the entry); its joiners into ``jobs``/``idx`` (returned: how
 * many). The entry takes ``fresh`` when the chunk was decoded there (memory from a reservation: *took set; not
 * kept, it stays the caller's), else holds a copy (reuse_buffer, when the bound has room). ``sharers``: jobs taken
 * with the decode are still to be placed from ``decoded``: an entry that took ``fresh`` is then pinned for them
 * and their joiners (``*pin``, let go by the caller), as eviction may free it once listed. */
static int reuse_land(engine *e, const job *j, const reuse_key *k, flight *f, const char *decoded, char *fresh,
                      long long nbytes, int sharers, job **jobs, long long *idx, reuse_entry **pin, int *took,
                      chunk_times *tm) {
    reuse_table *r = &e->reuse;
    reuse_entry *x = calloc(1, sizeof(reuse_entry));
    char *data = fresh;
    if (x != NULL && (x->key = malloc(k->len)) != NULL && data == NULL)
        data = reuse_buffer(e, nbytes, tm);
    int ready = x != NULL && x->key != NULL && data != NULL; /* else not kept: no memory is no error here */
    if (ready) {
        x->data = data;
        if (data != decoded)
            memcpy(x->data, decoded, (size_t)nbytes);
        memcpy(x->key, k->bytes, k->len);
        x->key_len = k->len;
        x->hash = k->hash;
        x->generation = j->reuse_gen;
        x->nbytes = nbytes;
    }
    reuse_entry *spent = NULL;
    lock_in_chunk(e, tm);
    /* not for an old push, nor past the bound as it is now: engine_reuse may have lowered it (a grant taken
     * back, to 0 at most) since this chunk's room was reserved */
    int keep = ready && x->generation == r->generation && nbytes <= r->max_bytes;
    if (keep) {
        reuse_entry *y = r->bucket[k->hash % REUSE_BUCKETS];
        while (y != NULL && !(y->hash == k->hash && y->generation == x->generation && y->key_len == k->len &&
                              memcmp(y->key, k->bytes, k->len) == 0))
            y = y->chain;
        keep = y == NULL; /* another thread kept it meanwhile (one whose flight began before this one's) */
    }
    if (keep) { /* its bytes are in ``held`` since their reservation: the entry takes them over */
        x->listed = 1;
        x->chain = r->bucket[k->hash % REUSE_BUCKETS];
        r->bucket[k->hash % REUSE_BUCKETS] = x;
        reuse_push_newest(r, x);
        r->entries++;
        r->inserted++;
    } else if (data != NULL && data != fresh) {
        r->held -= nbytes; /* the copy's, freed below */
    }
    int n = flight_unlist_locked(e, f, jobs, idx);
    *pin = NULL;
    if (keep && data == fresh && (sharers || n)) {
        x->refs++;
        *pin = x;
    }
    if (keep) /* within the bound as lowered: older entries go first (x too if they are pinned; once pinned
               * here it stays for the placing, its last user frees it) */
        reuse_make_room_locked(r, 0, &spent);
    pthread_mutex_unlock(&e->mu);
    reuse_free_chain(spent);
    *took = keep && data == fresh;
    if (!keep && x != NULL) {
        if (data != fresh)
            free(data);
        free(x->key);
        free(x);
    }
    return n;
}

/* at the engine's end: nothing uses an entry any more */
static void reuse_free_all(reuse_table *r) {
    for (reuse_entry *x = r->newest; x != NULL;) {
        reuse_entry *older = x->older;
        reuse_entry_free(x);
        x = older;
    }
    r->newest = r->oldest = NULL;
}

void engine_reuse(engine *e, long long max_bytes, long long generation) {
    if (foreign(e)) /* no thread here reads for it (see "Fork") */
        return;
    reuse_entry *spent = NULL;
    pthread_mutex_lock(&e->mu);
    reuse_table *r = &e->reuse;
    if (generation != r->generation)
        while (r->oldest != NULL) { /* a new generation: nothing kept is served again */
            reuse_entry *x = reuse_unlist_locked(r, r->oldest);
            if (x != NULL)
                x->chain = spent, spent = x;
        }
    __atomic_store_n(&r->max_bytes, max_bytes > 0 ? max_bytes : 0, __ATOMIC_RELAXED);
    r->generation = generation;
    reuse_make_room_locked(r, 0, &spent);
    pthread_mutex_unlock(&e->mu);
    reuse_free_chain(spent);
}

void engine_reuse_info(engine *e, long long out[8]) {
    int mine = !foreign(e);
    if (mine)
        pthread_mutex_lock(&e->mu);
    const reuse_table *r = &e->reuse;
    out[0] = r->max_bytes, out[1] = r->held, out[2] = r->peak, out[3] = r->entries;
    out[4] = r->hits, out[5] = r->inserted, out[6] = r->evicted, out[7] = r->generation;
    if (mine)
        pthread_mutex_unlock(&e->mu);
}

enum { GO_DECODE, GO_KEPT, GO_ELSEWHERE, GO_CANCELLED };

/* The one section a shareable chunk ``i`` of ``j`` takes when another job may need it (run_job says when; see
 * "Shared" and "Reused"): under mu it is claimed here (GO_ELSEWHERE when another job's thread took it already),
 * then placed from a kept decode (GO_KEPT, *x pinned), or handed to a flight of it (GO_ELSEWHERE: that thread
 * finishes it), or read and decoded here (GO_DECODE), with the other live jobs' copies of it that no thread took
 * yet (``jobs``/``idx``, *n) and, when it is to be kept (k->len > 0), its flight ``f`` listed and the memory it
 * is decoded into reserved (*room; entries evicted for it onto *spent, to free after). Claim, lookups and listing
 * in one section: of two threads that need one stored chunk at once, the second finds the first's claim, entry or
 * flight, so they never both miss it and both decode it. */
static int start_shared(engine *e, worker_slot *w, job *j, long long i, const reuse_key *k, flight *f,
                        job **jobs, long long *idx, int *n, reuse_entry **x, int *room, reuse_entry **spent) {
    const int64_t *c = j->t.chunks + i * N_CHUNK_COLS;
    unsigned long long h = share_hash(&j->t, c);
    int go = GO_DECODE;
    *n = 0, *x = NULL, *room = 0;
    lock_timed(w, &e->mu);
    if (__atomic_exchange_n(&j->claimed[i], 1, __ATOMIC_ACQ_REL))
        go = GO_ELSEWHERE; /* taken by another job's thread (take_sharers_locked): it finishes it */
    else if (__atomic_load_n(&j->cancelled, __ATOMIC_ACQUIRE))
        go = GO_CANCELLED;
    else if (k->len > 0 && (*x = reuse_find_locked(&e->reuse, j, k)) != NULL)
        go = GO_KEPT;
    else if (k->len > 0 && flight_join_locked(e, j, i, c, h))
        go = GO_ELSEWHERE;
    if (go == GO_DECODE) {
        *n = take_sharers_locked(e, j, c, h, jobs, idx);
        if (k->len > 0) {
            f->j = j, f->c = c, f->hash = h, f->generation = j->reuse_gen;
            f->room = MAX_SHARERS - *n, f->n = 0;
            f->next = e->flights;
            e->flights = f;
            *room = reuse_reserve_locked(&e->reuse, c[C_NBYTES], spent);
        }
    }
    pthread_mutex_unlock(&e->mu);
    return go;
}

/* Chunk ``i`` of ``j``, claimed by run_job or, with ``section``, in start_shared: 1 when this thread finished it
 * (its status set), 0 when another thread does (taken by a sharer, or handed to a flight). */
static int run_chunk(engine *e, worker_slot *w, job *j, long long i, int section, char *scratch, codec_ctx *ctx,
                     kept_files *kept, job_counters *mine, chunk_times *tm) {
    const plan_tables *t = &j->t;
    const int64_t *c = t->chunks + i * N_CHUNK_COLS;
    const int64_t *src = t->sources + c[C_SOURCE] * (S_STRIDES + t->ndim);
    int32_t status = ST_OK;
    int64_t detail = 0;
    reuse_key kept_key; /* len 0: not kept (see "Reused") */
    kept_key.len = 0;
    job *sharers[MAX_SHARERS];
    long long shared[MAX_SHARERS];
    int n_sharers = 0, room = 0, go = GO_DECODE;
    flight f; /* listed by start_shared when the chunk is to be kept; unlisted before this returns */
    reuse_entry *x = NULL;
    if (section) {
        reuse_entry *spent = NULL;
        reuse_key_of(j, c, &kept_key);
        go = start_shared(e, w, j, i, &kept_key, &f, sharers, shared, &n_sharers, &x, &room, &spent);
        reuse_free_chain(spent);
    }
    if (go == GO_ELSEWHERE)
        return 0;
    if (c[C_CODEC] == CODEC_FILL) {
        status = place_chunk(j, src, c, NULL, 1, mine, tm);
        if (status == ST_OK)
            mine->chunks_filled++;
    } else if (go == GO_CANCELLED) {
        status = ST_CANCELLED;
    } else if (go == GO_KEPT) { /* placed from a kept chunk ("Reused") */
        status = place_chunk(j, src, c, x->data, 0, mine, tm);
        if (status == ST_OK)
            mine->chunks_reused++;
        reuse_let_go(e, x, tm);
    } else {
        char path[PATH_CAP];
        chunk_io io = {0};
        long long entry_payload = 0;
        int keep = kept_key.len > 0; /* kept once decoded, whole (see "Reused") */
        /* kept: decoded into the memory its entry will own (no copy), else into the scratch */
        char *fresh = room ? reuse_alloc(e, c[C_NBYTES], tm) : NULL;
        char *decoded = fresh != NULL ? fresh : scratch;
        /* shared or kept: decoded into the scratch (or the entry's memory) */
        char *place = n_sharers || keep ? NULL : direct_place(j, src, c);
        io.out = place != NULL ? place : decoded;
        if (place != NULL) {
            io.claim_out = claim_batch;
            io.release_out = release_batch;
            io.out_arg = j;
        }
        io.offset = c[C_OFFSET];
        io.length = c[C_LENGTH];
        io.span_start = c[C_SPAN_START];
        io.span_stop = c[C_SPAN_STOP];
        for (int k = 0; k < n_sharers; k++) { /* decoded as far as every job that takes it reads */
            const int64_t *ck = sharers[k]->t.chunks + shared[k] * N_CHUNK_COLS;
            io.span_start = ck[C_SPAN_START] < io.span_start ? ck[C_SPAN_START] : io.span_start;
            io.span_stop = ck[C_SPAN_STOP] > io.span_stop ? ck[C_SPAN_STOP] : io.span_stop;
        }
        if (keep) /* all of it, for the batches after this one */
            io.span_start = 0, io.span_stop = c[C_NBYTES];
        if (c[C_BUFFER] < 0) {
            file_io(j, src, c, path, &io, kept, mine);
        } else {
            io.in_memory = 1;
            io.mem = t->buffers[c[C_BUFFER]];
            io.mem_len = t->buffer_lens[c[C_BUFFER]];
        }
        const int64_t *entry = c[C_BUFFER] >= 0 ? entry_of(t, c[C_BUFFER]) : NULL;
        /* the decoded chunk, then a file's stored bytes: the thread's scratch holds both (job->need); a chunk
         * in a buffer is decoded from the buffer; a disk-cache entry is read into the scratch, checked, and
         * decoded from there as a chunk in memory (its own bytes: no mem lock) */
        if (entry != NULL) {
            char path[PATH_CAP];
            memcpy(path, t->entry_blob + entry[E_PATH_START], (size_t)entry[E_PATH_LEN]);
            path[entry[E_PATH_LEN]] = 0;
            const char *payload = NULL;
            size_t payload_len = 0;
            if (read_entry(&io, path, t->entry_blob + entry[E_IDENT_START], (size_t)entry[E_IDENT_LEN],
                           scratch + aligned(c[C_NBYTES]), (size_t)c[C_MAX_STORED], &payload, &payload_len) == 0) {
                io.mem = payload;
                io.mem_len = (long long)payload_len;
                long long read_ns = io.read_ns;
                read_decode(&io, (int)c[C_CODEC], NULL, (size_t)c[C_MAX_STORED], (size_t)c[C_NBYTES], ctx);
                io.read_ns = read_ns;
                io.nread = (long long)(ENTRY_HEADER_BYTES + entry[E_IDENT_LEN]) + (long long)payload_len;
                entry_payload = (long long)payload_len;
            }
        } else if (io.in_memory) {
            long long t = now_ns();
            pthread_rwlock_rdlock(&j->mem_lock);
            tm->lock += now_ns() - t;
            if (__atomic_load_n(&j->cancelled, __ATOMIC_ACQUIRE)) /* its buffers may be gone */
                io.status = ST_CANCELLED;
            else
                read_decode(&io, (int)c[C_CODEC], NULL, (size_t)c[C_MAX_STORED], (size_t)c[C_NBYTES], ctx);
            pthread_rwlock_unlock(&j->mem_lock);
        } else {
            read_decode(&io, (int)c[C_CODEC], scratch + aligned(c[C_NBYTES]), (size_t)c[C_MAX_STORED],
                        (size_t)c[C_NBYTES], ctx);
        }
        if (io.kept)
            keep_file(kept, c[C_FILE], io.fd);
        mine->bytes_read += io.nread;
        mine->read_ns += io.read_ns;
        mine->decode_ns += io.decode_ns;
        tm->read += io.read_ns;
        tm->decode += io.decode_ns;
        /* the flight's end (see "Reused"): decoded whole and sound, the chunk is placed here first, then kept and
         * its flight unlisted in one section; else its flight is unlisted. Its joiners are placed as sharers. */
        int whole = keep && io.status == ST_OK && io.span_start == 0 && io.span_stop == c[C_NBYTES];
        int took = 0; /* the entry took ``fresh`` */
        reuse_entry *pin = NULL;
        if (whole) {
            status = place_chunk(j, src, c, decoded, 0, mine, tm);
            n_sharers += reuse_land(e, j, &kept_key, &f, decoded, fresh, c[C_NBYTES], n_sharers > 0,
                                    sharers + n_sharers, shared + n_sharers, &pin, &took, tm);
        } else if (keep) {
            n_sharers += flight_land(e, &f, sharers + n_sharers, shared + n_sharers, tm);
        }
        /* (an entry whose decode failed: every job that took it fetches it again, the Python path decides) */
        int widened = io.span_start != c[C_SPAN_START] || io.span_stop != c[C_SPAN_STOP];
        if ((n_sharers || widened) && span_failure(io.status) && entry == NULL) {
            decoded = scratch; /* what is decoded again below goes to the scratch */
            /* the union of the spans failed to decode: each job gets what its own span alone gives (damage
             * past it fails only the jobs that read that far, whichever others are in flight) */
            for (int k = 0; k < n_sharers; k++) {
                const int64_t *ck = sharers[k]->t.chunks + shared[k] * N_CHUNK_COLS;
                if (ck[C_SPAN_START] == io.span_start && ck[C_SPAN_STOP] == io.span_stop) {
                    share_out(e, w, sharers[k], shared[k], &io, scratch, tm, 0);
                } else {
                    chunk_io alone;
                    decode_alone(j, src, c, ck[C_SPAN_START], ck[C_SPAN_STOP], path, &alone, scratch, ctx, kept,
                                 mine, tm);
                    share_out(e, w, sharers[k], shared[k], &alone, scratch, tm, 0);
                }
            }
            n_sharers = 0;
            if (c[C_SPAN_START] != io.span_start || c[C_SPAN_STOP] != io.span_stop)
                decode_alone(j, src, c, c[C_SPAN_START], c[C_SPAN_STOP], path, &io, scratch, ctx, kept, mine, tm);
        }
        if (io.status == ST_MISSING && io.offset < 0) { /* an absent chunk file is the fill value */
            status = place_chunk(j, src, c, NULL, 1, mine, tm);
            if (status == ST_OK)
                mine->chunks_filled++;
        } else if (io.status == ST_OK) {
            if (!whole) /* (placed before it was kept) */
                status = place != NULL ? ST_OK : place_chunk(j, src, c, decoded, 0, mine, tm);
            if (status == ST_OK) {
                mine->bytes_decoded += io.detail;
                mine->chunks_decoded++;
                detail = entry_payload; /* a disk-cache entry's: the bytes it served (the cache's hit bytes) */
            }
        } else {
            status = io.status;
            detail = io.detail;
        }
        for (int k = 0; k < n_sharers; k++)
            share_out(e, w, sharers[k], shared[k], &io, decoded, tm, entry_payload);
        if (pin != NULL) /* the sharers are placed: the entry may go */
            reuse_let_go(e, pin, tm);
        if (fresh != NULL && !took)
            reuse_unbuffer(e, fresh, c[C_NBYTES], tm);
    }
    __atomic_store_n(&j->detail[i], detail, __ATOMIC_RELAXED);
    __atomic_store_n(&j->status[i], status, __ATOMIC_RELEASE);
    return 1;
}

/* ``w``: the worker's clocks, or NULL (job_cancel's caller) */
static void finish_chunks(engine *e, job *j, long long n, worker_slot *w) {
    if (__atomic_add_fetch(&j->finished, n, __ATOMIC_ACQ_REL) == j->t.n_chunks) {
        if (w != NULL)
            lock_timed(w, &e->mu);
        else
            pthread_mutex_lock(&e->mu);
        j->done = 1;
        unlink_live_locked(e, j); /* never the last reference: the worker (or job_cancel's caller) holds one */
        pthread_cond_broadcast(&e->done_cv);
        pthread_mutex_unlock(&e->mu);
    }
}

/* a chunk's times into the worker's clocks: its reads, decode, lock waits and copies, and the rest of the
 * stretch since the last one closed (taking the chunk, its path, kept files) as W_OTHER */
static void clock_chunk(worker_slot *w, const chunk_times *tm, int chunks) {
    long long end = tm->end ? tm->end : now_ns();
    long long split = tm->read + tm->decode + tm->lock + tm->place + tm->fill;
    clock_open(w);
    clock_add(w, W_READ, tm->read);
    clock_add(w, W_DECODE, tm->decode);
    clock_add(w, W_LOCK, tm->lock);
    clock_add(w, W_PLACE, tm->place);
    clock_add(w, W_FILL, tm->fill);
    clock_add(w, W_OTHER, end - w->mark - split);
    clock_add(w, W_CHUNKS, chunks);
    __atomic_store_n(&w->mark, end, __ATOMIC_RELAXED);
    clock_close(w);
}

/* Work on a job's chunks until none is left. The chunks are reported finished when the thread leaves the job,
 * after it closed the files it kept: once a job is done, none of its files is open. (It leaves right after
 * its last chunk: the next fetch finds none left, so this delays nothing.) Its counters are summed here and
 * added to the job's once, before the chunks are reported finished (see "Accounting"). */
static void run_job(engine *e, job *j, char *scratch, codec_ctx *ctx, worker_slot *w) {
    kept_files kept = {0};
    job_counters mine = {0};
    long long finished = 0;
    for (;;) {
        if (__atomic_load_n(&e->closing, __ATOMIC_ACQUIRE))
            break;
        long long i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->t.n_chunks)
            break;
        /* a chunk another job may need (one is live beside this one, or this job keeps chunks for later ones)
         * is claimed in run_chunk's one section (start_shared); else no other thread can want it: claimed here,
         * with no lock (a job submitted after this look does not share this decode) */
        const int64_t *c = j->t.chunks + i * N_CHUNK_COLS;
        int section = c[C_CODEC] != CODEC_FILL && shareable(&j->t, c) &&
                      (j->reuse || __atomic_load_n(&e->n_live, __ATOMIC_RELAXED) > 1);
        if (!section && __atomic_exchange_n(&j->claimed[i], 1, __ATOMIC_ACQ_REL))
            continue; /* another job's thread took it (see "Shared"): it finishes it */
        chunk_times tm = {0};
        int done = 1;
        if (!section && __atomic_load_n(&j->cancelled, __ATOMIC_ACQUIRE))
            __atomic_store_n(&j->status[i], ST_CANCELLED, __ATOMIC_RELEASE);
        else
            done = run_chunk(e, w, j, i, section, scratch, ctx, &kept, &mine, &tm);
        clock_chunk(w, &tm, done);
        finished += done;
    }
    close_kept(&kept);
    long long *from = (long long *)&mine, *to = (long long *)&j->counters;
    for (size_t k = 0; k < sizeof(job_counters) / sizeof(long long); k++)
        if (from[k])
            count(&to[k], from[k]);
    if (finished)
        finish_chunks(e, j, finished, w);
}

static void *worker(void *arg) {
    worker_slot *w = arg;
    engine *e = w->e;
    char *scratch = NULL;
    size_t cap = 0;
    codec_ctx ctx = {0};
#if defined(__linux__)
    __atomic_store_n(&w->v[W_TID], (long long)syscall(SYS_gettid), __ATOMIC_RELAXED);
#endif
    lock_timed(w, &e->mu);
    while (!e->closing) {
        job *j = e->live;
        while (j != NULL && __atomic_load_n(&j->next, __ATOMIC_RELAXED) >= j->t.n_chunks)
            j = j->next_live;
        if (j == NULL) {
            wait_timed(w, e, W_IDLE);
            continue;
        }
        if (cap < j->need) { /* give back what is too small, then reserve enough, or wait for the budget */
            char *old = scratch;
            if (old != NULL) {
                e->used -= (long long)cap;
                e->held -= (long long)cap;
                scratch = NULL, cap = 0;
                pthread_mutex_unlock(&e->mu);
                free(old);
                lock_timed(w, &e->mu);
                pthread_cond_broadcast(&e->work_cv); /* what it gave back may let another thread work */
                continue; /* look again: the lock was let go */
            }
            if (e->used + (long long)j->need > e->budget) {
                wait_timed(w, e, W_BUDGET);
                continue;
            }
            size_t want = j->need;
            e->used += (long long)want;
            j->refs++; /* held while the lock is let go: other threads may finish the job and drop it meanwhile */
            pthread_mutex_unlock(&e->mu);
            void *fresh = NULL;
            if (posix_memalign(&fresh, ALIGN, want) != 0)
                fresh = NULL;
            lock_timed(w, &e->mu);
            if (fresh != NULL) {
                scratch = fresh, cap = want;
                e->held += (long long)want;
                if (e->held > e->peak)
                    e->peak = e->held;
            } else { /* reserved but not allocated: the budget goes back, and a chunk to the Python path */
                e->used -= (long long)want;
                pthread_cond_broadcast(&e->work_cv);
                long long i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
                if (i < j->t.n_chunks && __atomic_exchange_n(&j->claimed[i], 1, __ATOMIC_ACQ_REL) == 0) {
                    pthread_mutex_unlock(&e->mu);
                    __atomic_store_n(&j->status[i], ST_NO_MEMORY, __ATOMIC_RELEASE);
                    finish_chunks(e, j, 1, w);
                    lock_timed(w, &e->mu);
                }
            }
            job_unref_unlocking(e, j);
            continue; /* look again: the lock was let go */
        }
        j->refs++;
        if (++j->threads_now > j->counters.max_threads)
            j->counters.max_threads = j->threads_now;
        pthread_mutex_unlock(&e->mu);
        run_job(e, j, scratch, &ctx, w);
        lock_timed(w, &e->mu);
        j->threads_now--;
        job_unref_unlocking(e, j);
    }
    long long now = now_ns(); /* the thread's last stretch: its clocks stop */
    clock_open(w);
    clock_add(w, w->state, now - w->mark);
    __atomic_store_n(&w->state, -1, __ATOMIC_RELAXED);
    __atomic_store_n(&w->stop, now, __ATOMIC_RELAXED);
    clock_close(w);
    e->used -= (long long)cap;
    e->held -= (long long)cap;
    e->alive--;
    int last = --e->refs == 0;
    pthread_cond_broadcast(&e->done_cv);
    pthread_cond_broadcast(&e->work_cv); /* the budget it held */
    pthread_mutex_unlock(&e->mu);
    free(scratch);
    codec_ctx_free(&ctx);
    if (last)
        engine_free(e);
    return NULL;
}

/* ---- the engine ---- */

engine *engine_new(int n_threads, long long budget, int *started) {
    *started = 0;
    engine *e = calloc(1, sizeof(engine));
    void *rows = NULL;
    if (e == NULL || n_threads < 1 || posix_memalign(&rows, ALIGN, sizeof(worker_slot) * (size_t)n_threads) != 0) {
        free(e);
        return NULL;
    }
    e->workers = rows;
    memset(e->workers, 0, sizeof(worker_slot) * (size_t)n_threads);
    long long t0 = now_ns();
    for (int i = 0; i < n_threads; i++) {
        worker_slot *w = &e->workers[i];
        w->e = e;
        w->state = W_OTHER; /* starting */
        w->start = w->mark = t0;
    }
    pthread_mutex_init(&e->mu, NULL);
    cond_init(&e->work_cv);
    cond_init(&e->done_cv);
    e->budget = budget;
    e->refs = 1;
    e->generation = fork_watch();
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < n_threads; i++) {
        pthread_t thread;
        e->refs++, e->alive++;
        /* detached: waited for by engine_close, never joined; every signal blocked (threads.h) */
        if (thread_start(&thread, 1, worker, &e->workers[i]) != 0) {
            e->refs--, e->alive--;
            break;
        }
        e->n_threads++;
    }
    *started = e->n_threads;
    pthread_mutex_unlock(&e->mu);
    return e;
}

void engine_submit(engine *e, job *j) {
    if (foreign(e)) { /* no thread to make it: done, every chunk cancelled (it holds no engine reference) */
        for (long long i = 0; i < j->t.n_chunks; i++)
            j->status[i] = ST_CANCELLED;
        j->next = j->finished = j->t.n_chunks;
        j->cancelled = j->done = 1;
        return;
    }
    pthread_mutex_lock(&e->mu);
    e->refs++; /* the job's */
    j->submitted = 1;
    if (j->t.n_chunks == 0 || e->closing) { /* nothing to do, or nobody to do it: done, every chunk cancelled */
        j->cancelled = e->closing;
        for (long long i = 0; i < j->t.n_chunks; i++)
            j->status[i] = ST_CANCELLED;
        j->next = j->finished = j->t.n_chunks;
        j->done = 1;
    } else {
        j->refs++; /* the list's */
        j->live = 1;
        __atomic_store_n(&e->n_live, e->n_live + 1, __ATOMIC_RELAXED);
        j->reuse = e->reuse.max_bytes > 0; /* see "Reused": the generation of its submission */
        j->reuse_gen = e->reuse.generation;
        job **at = &e->live;
        job *prev = NULL;
        while (*at != NULL)
            prev = *at, at = &(*at)->next_live;
        *at = j;
        j->prev = prev;
        pthread_cond_broadcast(&e->work_cv);
    }
    pthread_mutex_unlock(&e->mu);
}

int job_done(engine *e, job *j) {
    if (foreign(e)) /* nothing changes it here any more */
        return __atomic_load_n(&j->done, __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&e->mu);
    int done = j->done;
    pthread_mutex_unlock(&e->mu);
    return done;
}

int job_wait(engine *e, job *j, double timeout_s) {
    if (foreign(e)) /* no thread here will finish it: waiting could only last for ever */
        return __atomic_load_n(&j->done, __ATOMIC_ACQUIRE);
    struct timespec deadline;
    if (!(timeout_s < 0)) /* (NaN too: a wait with a deadline, deadline_after makes it 0) */
        deadline_after(&deadline, timeout_s);
    pthread_mutex_lock(&e->mu);
    while (!j->done) {
        if (timeout_s < 0) {
            pthread_cond_wait(&e->done_cv, &e->mu);
        } else {
            if (deadline_past(&deadline))
                break;
            cond_wait_until(&e->done_cv, &e->mu, &deadline);
        }
    }
    int done = j->done;
    pthread_mutex_unlock(&e->mu);
    return done;
}

void job_cancel(engine *e, job *j) {
    if (foreign(e)) /* no worker writes into it here */
        return;
    /* waits for the workers placing a chunk of it right now (a chunk's copies: microseconds; or its decode, for
     * one decoded into the batch: see direct_place) */
    pthread_rwlock_wrlock(&j->place_lock);
    __atomic_store_n(&j->cancelled, 1, __ATOMIC_RELEASE);
    pthread_rwlock_unlock(&j->place_lock);
    /* and for those reading one of its buffers (a chunk's decode): after this none reads them again */
    pthread_rwlock_wrlock(&j->mem_lock);
    pthread_rwlock_unlock(&j->mem_lock);
    /* the chunks nobody took are finished here, so the job is done once the workers inside it are */
    long long first = __atomic_exchange_n(&j->next, j->t.n_chunks, __ATOMIC_ACQ_REL), taken = 0;
    for (long long i = first; i < j->t.n_chunks; i++) {
        if (__atomic_exchange_n(&j->claimed[i], 1, __ATOMIC_ACQ_REL))
            continue; /* another job's thread took it (see "Shared"): it finishes it */
        __atomic_store_n(&j->status[i], ST_CANCELLED, __ATOMIC_RELEASE);
        taken++;
    }
    if (taken)
        finish_chunks(e, j, taken, NULL);
    pthread_mutex_lock(&e->mu);
    unlink_live_locked(e, j); /* the caller holds a reference: never the last */
    pthread_mutex_unlock(&e->mu);
}

void job_results(engine *e, job *j, int32_t *status, int64_t *detail, job_counters *counters) {
    (void)e;
    for (long long i = 0; i < j->t.n_chunks; i++) {
        status[i] = __atomic_load_n(&j->status[i], __ATOMIC_ACQUIRE);
        detail[i] = __atomic_load_n(&j->detail[i], __ATOMIC_RELAXED);
    }
    long long *src = (long long *)&j->counters, *dst = (long long *)counters;
    for (size_t k = 0; k < sizeof(job_counters) / sizeof(long long); k++)
        dst[k] = __atomic_load_n(&src[k], __ATOMIC_RELAXED);
}

void job_release(engine *e, job *j) {
    if (foreign(e)) /* left as it is (see "Fork") */
        return;
    pthread_mutex_lock(&e->mu);
    job *fj = NULL;
    int fe = 0;
    if (!j->submitted) { /* it holds no engine reference */
        j->refs = 0;
        fj = j;
    } else {
        job_unref_locked(e, j, &fj, &fe);
    }
    pthread_mutex_unlock(&e->mu);
    if (fj != NULL)
        job_free(fj);
    if (fe)
        engine_free(e);
}

int engine_close(engine *e, double timeout_s) {
    if (foreign(e)) { /* its threads are the parent's: none runs here */
        __atomic_store_n(&e->closing, 1, __ATOMIC_RELEASE);
        return 1;
    }
    pthread_mutex_lock(&e->mu);
    __atomic_store_n(&e->closing, 1, __ATOMIC_RELEASE); /* (read unlocked by workers between chunks) */
    job *j = e->live;
    while (j != NULL) { /* cancel each live job: hold it while the lock is let go */
        j->refs++;
        pthread_mutex_unlock(&e->mu);
        job_cancel(e, j);
        pthread_mutex_lock(&e->mu);
        job *fj = NULL;
        int fe = 0;
        job_unref_locked(e, j, &fj, &fe);
        if (fj != NULL) { /* never the engine's last reference: the caller holds one */
            pthread_mutex_unlock(&e->mu);
            job_free(fj);
            pthread_mutex_lock(&e->mu);
        }
        j = e->live;
    }
    pthread_cond_broadcast(&e->work_cv);
    struct timespec deadline;
    deadline_after(&deadline, timeout_s > 0 ? timeout_s : 0);
    while (e->alive > 0 && !deadline_past(&deadline))
        cond_wait_until(&e->done_cv, &e->mu, &deadline);
    int all = e->alive == 0;
    pthread_mutex_unlock(&e->mu);
    return all;
}

void engine_info(engine *e, long long out[6]) {
    if (foreign(e)) { /* read without its lock, which a thread of the parent may hold */
        out[0] = e->n_threads, out[1] = 0, out[2] = e->budget, out[3] = 0, out[4] = e->peak, out[5] = 1;
        return;
    }
    pthread_mutex_lock(&e->mu);
    out[0] = e->n_threads;
    out[1] = e->alive;
    out[2] = e->budget;
    out[3] = e->used;
    out[4] = e->peak;
    out[5] = e->closing;
    pthread_mutex_unlock(&e->mu);
}

int engine_worker_clocks(engine *e, int64_t *out, int rows) {
    if (foreign(e)) /* its threads are the parent's (see "Fork") */
        return 0;
    int n = e->n_threads < rows ? e->n_threads : rows; /* set before engine_new returned, never changed */
    for (int i = 0; i < n; i++) {
        worker_slot *w = &e->workers[i];
        int64_t *r = out + (size_t)i * N_WORKER_COLS;
        long long mark = 0, stop = 0;
        int state = -1;
        /* a consistent row: its thread writes one in nanoseconds, so a few tries do; bounded all the same */
        for (int tries = 0; tries < 1000; tries++) {
            unsigned before = __atomic_load_n(&w->seq, __ATOMIC_ACQUIRE);
            for (int k = 0; k < N_WORKER_COLS; k++)
                r[k] = __atomic_load_n(&w->v[k], __ATOMIC_RELAXED);
            mark = __atomic_load_n(&w->mark, __ATOMIC_RELAXED);
            state = __atomic_load_n(&w->state, __ATOMIC_RELAXED);
            stop = __atomic_load_n(&w->stop, __ATOMIC_RELAXED);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (!(before & 1) && __atomic_load_n(&w->seq, __ATOMIC_RELAXED) == before)
                break;
        }
        long long now = now_ns();
        if (state >= 0 && state < W_WALL && now > mark)
            r[state] += now - mark; /* the stretch under way */
        r[W_WALL] = (stop ? stop : now) - w->start;
    }
    return n;
}

void engine_release(engine *e) {
    if (foreign(e)) /* left as it is (see "Fork") */
        return;
    pthread_mutex_lock(&e->mu);
    int last = --e->refs == 0;
    pthread_mutex_unlock(&e->mu);
    if (last)
        engine_free(e);
}
