/* staging.c: a wave's stored chunks read into one staging buffer (the GPU decode's reads, engine/gpu/staging.py),
 * on the caller's thread and persistent helpers (stage_pool) or threads of the call's own, without the GIL;
 * and blosc1 frame headers parsed into the streams a batched decoder takes (blosc_streams). Statuses are stoker_native.h's ST_*.
 */
#ifndef STOKER_STAGING_H
#define STOKER_STAGING_H

#include "stoker_native.h"

/* a file to read from: its identity (has_ident 1: read only from a file that is this one, as a shard whose
 * index was read from it; dev and ino as uint64 bits) */
enum { SF_HAS_IDENT = 0, SF_DEV, SF_INO, SF_SIZE, SF_MTIME, SF_CTIME, STAGE_FILE_COLS };
/* a read: its file, its offset there (-1: the whole file; SR_ENTRY: the payload of a disk-cache entry file),
 * its length (of a whole file or an entry's payload: the most bytes it may take), where its bytes go in the
 * staging (a whole file or entry: ignored, see stage_read) */
enum { SR_FILE = 0, SR_OFFSET, SR_LENGTH, SR_AT, STAGE_READ_COLS };
#define SR_WHOLE (-1)
#define SR_ENTRY (-2)
/* what became of a read: ST_*, its detail (errno, a size), where its bytes are in the staging, the bytes read */
enum { SO_STATUS = 0, SO_DETAIL, SO_AT, SO_NREAD, STAGE_OUT_COLS };

typedef struct {
    long long n_files;
    const char *const *paths;
    const int64_t *files; /* n_files x STAGE_FILE_COLS */
    long long n_reads;
    const int64_t *reads; /* n_reads x STAGE_READ_COLS */
    char *buf;
    long long buf_len;
    long long whole_base; /* whole files are placed end to end from here, in order, as their sizes are learnt */
    int64_t *out;         /* n_reads x STAGE_OUT_COLS */
    /* an SR_ENTRY read's ident (the entry's own must equal it): row i (start, length) of ``idents`` (n_reads x
     * 2) in ``ident_blob``; NULL where the plan has no entry read */
    const char *ident_blob;
    long long ident_blob_len;
    const int64_t *idents;
    long long opens, preads; /* (totals, for the store's counters) */
    /* the round's cancel flag (NULL: none): once it is set (stage_cancel, from another thread) no read starts,
     * those not run are ST_CANCELLED (nothing of theirs in the staging), and stage_read returns after the reads
     * already under way end (a whole file: its read_range) */
    const int *cancel;
} stage_plan;

/* Sets a cancel flag that rounds read between reads (an atomic store: the readers load it without a lock). */
void stage_cancel(int *flag);

/* Reads every read of ``p`` on up to ``threads`` threads (the caller's among them). Ranged reads of one file
 * that follow each other in the table are one open: identity checked at open and after the last read (a change:
 * ST_CHANGED on each). Whole files are stat'ed first (missing: ST_MISSING, no room taken; larger than their
 * length: ST_TOO_BIG, detail the size), placed end to end from whole_base, then each opened, checked to have
 * that size still (else ST_CHANGED) and read. Disk-cache entries (SR_ENTRY; storage/diskcache.py's layout, as
 * entries.c reads them) are whole files whose payload alone is placed and read: stat'ed (missing: ST_ENTRY,
 * detail ENTRY_GONE; a payload past its length: ENTRY_SIZE; no room taken), placed end to end with the whole
 * files, then opened (not followed if a link), checked to have that size still, their header and ident read
 * and checked, their payload read into its place and checked against the header's crc32c (ident + payload),
 * and touched (the cache's LRU clock, at most once a minute): all by entries.c's entry_read, as the CPU
 * engine's reads; any failure is ST_ENTRY with its ENTRY_* detail (its place is then not the payload's).
 * SO_DETAIL of an entry: its payload's size. 0, or -1 with *error set when the plan is unsound
 * (a read outside the buffer, a file row out of range, an entry read with no ident in the blob): checked
 * before any byte is read. Call without the GIL. */
int stage_check(const stage_plan *p, const char **error);
/* A chunk file's (or a shard's) path: ``prefix`` (n bytes: the array's folder, its key prefix and separator), then
 * the ``ndim`` grid coordinates joined by ``sep``, NUL-terminated, into ``out`` (room for n + 21 * ndim + 1 bytes:
 * a coordinate takes 20 digits at most). Returns its length. The engine's paths (pool.c) and the staging's. */
size_t chunk_path(char *out, const char *prefix, size_t n, char sep, const int64_t *coords, int ndim);
/* Reads the plan (see stage_check). Cancelled (p->cancel set before or during the call): every read not run yet
 * is ST_CANCELLED with SO_AT -1 and SO_NREAD 0 ("not run": nothing of it in the staging), checked before each
 * file's reads, between a shard's runs and before the whole files are placed (none is placed then); a read under
 * way when it is set ends first, and a shard's runs that ran keep their statuses (its identity still checked
 * after them). */
void stage_read(stage_plan *p, int threads);

/* Persistent readers: stage_read_on(p, 0, pool) reads as stage_read does, on the caller's thread and the pool's
 * threads - 1 helpers, started at the pool's first round with two tasks or more and kept (a thread start costs
 * more CPU than a round of a few reads: ~150 us a call with threads of the call's own). A pool serves one round at
 * a time: a caller that finds it busy, closing, or made before a fork (its threads are the parent's: none runs in
 * a child, see pool.c "Fork") reads alone. The caller waits for the helpers in its round to finish the task each
 * holds (one file's reads) before returning: its buffer is never written after. stage_pool_close stops the helpers
 * (those in a round after their task) and waits for them at most timeout_s: 1 when none is left;
 * stage_pool_release drops the owner's reference (the last of the pool and its threads frees it).
 * stage_threads_started counts the reader threads this process started, pooled or not. */
typedef struct stage_pool stage_pool;
stage_pool *stage_pool_new(int threads);
void stage_read_on(stage_plan *p, int threads, stage_pool *pool);
int stage_pool_close(stage_pool *pool, double timeout_s);
void stage_pool_info(stage_pool *pool, long long out[4]); /* helpers wanted, started, alive; closing */
void stage_pool_release(stage_pool *pool);
long long stage_threads_started(void);

/* blosc1 frames (engine/gpu/frames.py's rules, c-blosc's blosc_d): chunk k's frame at in[k] of buf (in_len[k]
 * bytes) decodes to nbytes[k] bytes at out[k] of the output. Returns in *streams (BS_* columns, *n_streams rows)
 * and *blocks (BB_* columns: the blocks to unshuffle) the streams and blocks of the chunks it takes, in chunk
 * order (malloc'd: the caller frees them), and in fault[k] 0 or the BF_* code of chunk k's first fault (the
 * chunk is then left out). Every offset is checked against its frame before it is read: a hostile frame is a
 * fault, never a read outside [in[k], in[k] + in_len[k]). 0, or -1 with *error set (a chunk outside buf, or no
 * memory). Holds no lock and no GIL. */
enum { BS_SRC = 0, BS_CSIZE, BS_DST, BS_DSIZE, BS_CODEC, BS_CHUNK, BLOSC_STREAM_COLS };
enum { BB_DST = 0, BB_SIZE, BB_TYPESIZE, BB_SHUFFLE, BLOSC_BLOCK_COLS };
enum {
    BF_OK = 0, BF_SHORT, BF_VERSION, BF_RESERVED, BF_CBYTES, BF_NBYTES, BF_TYPESIZE, BF_BLOCKSIZE, BF_MEMCPYED,
    BF_FORMAT, BF_VERSIONLZ, BF_TABLE, BF_SPLIT, BF_BSTART, BF_SIZE_FIELD, BF_STREAM_SIZE, BF_STREAM_END,
    BF_CHANGED, /* the frame's bytes changed between the count of its rows and their writing */
    N_BLOSC_FAULTS
};
int blosc_streams(const unsigned char *buf, long long buf_len, long long k, const int64_t *in, const int64_t *in_len,
                  const int64_t *nbytes, const int64_t *out, int64_t **streams, long long *n_streams,
                  int64_t **blocks, long long *n_blocks, int64_t *fault, const char **error);
/* blosc_streams' second pass: the rows of the chunks with fault[k] == 0 written from *n_streams / *n_blocks on,
 * never at or past cap_s / cap_b rows (a chunk that would is BF_CHANGED, its rows taken back); its in / in_len
 * already checked against buf */
void blosc_rows(const unsigned char *buf, long long k, const int64_t *in, const int64_t *in_len,
                const int64_t *nbytes, const int64_t *out, int64_t *streams, long long cap_s, long long *n_streams,
                int64_t *blocks, long long cap_b, long long *n_blocks, int64_t *fault);

#endif
