/* stoker._native: read, decode and place a group of chunk files with the GIL released.
 *
 * Why this exists: for chunks of a few hundred KiB the Python work around each
 * read and decode (open, read, header checks, decompress, view, copy, bookkeeping)
 * holds the GIL for a large share of the chunk's time, so compute threads queue on
 * the GIL instead of decoding. Here a whole group of chunk files is opened, read,
 * decompressed and copied into the batch in one call that holds no GIL at all.
 *
 * No codec is implemented here: zstd is zstd's own ZSTD_decompress and blosc is
 * c-blosc's blosc_decompress_ctx / blosc_getitem, the copies numcodecs already
 * carries (their addresses are handed in by stoker/native.py, read off numcodecs'
 * extension modules through ctypes).
 *
 * decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst) -> list of
 *     (status, nread, decoded, read_ns, decode_ns, place_ns, placed)
 *   codec    CODEC_ZSTD (the chunk is one zstd frame) or CODEC_BLOSC (one blosc1 frame)
 *   paths    sequence of str or bytes (file system paths), one per chunk
 *   regions  sequence of (offset, length, byte_start, byte_stop[, dev, ino, size, mtime_ns, ctime_ns]),
 *            one per chunk: where the stored chunk is in its file (offset -1: the whole file, as long as
 *            the file is; else an inner chunk of a shard), the decoded bytes the chunk's copies read and,
 *            for an inner chunk, optionally the identity of the shard file its index was read from (a
 *            file with another identity is not read: status 9); blosc decodes only
 *            the blocks holding those when that is at most the partial share of the chunk
 *            (set_codecs; stoker/zarr/blosc_partial.py's PARTIAL_MAX_SHARE); zstd reads and
 *            decodes only up to the block that holds byte_stop - 1, when the frame states the
 *            chunk's size and has no checksum (set_zstd_streaming; see zstd_prefix)
 *   scratch  writable buffer for the encoded bytes of one file at a time
 *   outs     sequence of writable buffers of at least nbytes, one per path (decoded chunks)
 *   nbytes   the decoded size every chunk must have
 *   places   None, or per path None or a copy plan (int64 buffer, see parse_place): after
 *            decoding, the chunk's copies are cast into dst right here
 *   dst      None, or (address, size in bytes, kind[, stream]) of the batch the places write into
 *            (stream: write whole cache lines with streaming stores, see write_run)
 * status: 0 ok (decoded: bytes decompressed, fewer than nbytes when decoding stopped early), 1 missing
 * file, 2 file larger than scratch (decoded: its size), 3 OS error (decoded: errno), 4 file shorter than its size (it
 * changed while read), 5 codec error (decoded: zstd's error code, or blosc's negative
 * result), 6 decoded to a size other than nbytes (decoded: the size), 7 a blosc frame
 * whose header does not fit this chunk or the stored size (left to the Python path), 8 not a regular
 * file (decoded: its st_mode & S_IFMT), 9 the shard file is not the one its index was read from.
 *
 * Files are opened non-blocking and refused unless regular: opening a FIFO without O_NONBLOCK waits for
 * a writer forever (the thread could never be stopped), and O_NONBLOCK changes nothing for regular files.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef size_t (*zstd_decompress_fn)(void *dst, size_t dst_capacity, const void *src, size_t src_size);
typedef unsigned (*zstd_is_error_fn)(size_t code);
/* zstd's context API (a context reused across the chunks of a call) and its buffer-less streaming API
 * (block by block, straight into the output, so decoding can stop once the bytes the copies read are out) */
typedef void *(*zstd_create_dctx_fn)(void);
typedef size_t (*zstd_free_dctx_fn)(void *dctx);
typedef size_t (*zstd_decompress_dctx_fn)(void *dctx, void *dst, size_t dst_capacity, const void *src,
                                          size_t src_size);
typedef size_t (*zstd_begin_fn)(void *dctx);
typedef size_t (*zstd_continue_fn)(void *dctx, void *dst, size_t dst_capacity, const void *src, size_t src_size);
typedef size_t (*zstd_next_src_size_fn)(void *dctx);
typedef unsigned long long (*zstd_content_size_fn)(const void *src, size_t src_size);
typedef int (*blosc_decompress_ctx_fn)(const void *src, void *dest, size_t destsize, int nthreads);
typedef int (*blosc_getitem_fn)(const void *src, int start, int nitems, void *dest);

static zstd_decompress_fn zstd_decompress = NULL;
static zstd_is_error_fn zstd_is_error = NULL;
static zstd_create_dctx_fn zstd_create_dctx = NULL; /* the rest of zstd's API: all set, or all NULL */
static zstd_free_dctx_fn zstd_free_dctx = NULL;
static zstd_decompress_dctx_fn zstd_decompress_dctx = NULL;
static zstd_begin_fn zstd_begin = NULL;
static zstd_continue_fn zstd_continue = NULL;
static zstd_next_src_size_fn zstd_next_src_size = NULL;
static zstd_content_size_fn zstd_content_size = NULL;
static blosc_decompress_ctx_fn blosc_decompress_ctx = NULL;
static blosc_getitem_fn blosc_getitem = NULL;
/* blosc decodes only some blocks when they are at most this share of the chunk; blosc_getitem costs
 * a little more per block than a whole decode. Set from Python (blosc_partial.PARTIAL_MAX_SHARE), one rule. */
static double partial_max_share = 0.9;

enum { CODEC_ZSTD = 0, CODEC_BLOSC = 1 };
enum { ST_OK = 0, ST_MISSING, ST_TOO_BIG, ST_OS_ERROR, ST_SHORT, ST_CODEC_ERROR, ST_SIZE, ST_FRAME, ST_NOT_REGULAR,
       ST_CHANGED };

/* Element kinds of a copy-cast: the source's, and the batch's (KIND_SAME: a plain copy). */
enum { K_U8 = 0, K_I8, K_U16, K_I16, K_U32, K_I32, K_U64, K_I64, K_F32, K_F64, N_SRC_KINDS };
enum { KIND_SAME = 0, KIND_F32 = 1, KIND_BF16 = 2, N_DST_KINDS };
static const int src_itemsize[N_SRC_KINDS] = {1, 1, 2, 2, 4, 4, 8, 8, 4, 8};

#define MAX_NDIM 32

typedef struct {
    const char *path;
    char *out;
    long long offset, length; /* the stored chunk in its file; offset -1: the whole file */
    long long span_start, span_stop;
    int has_ident; /* an inner chunk whose shard file must have this identity (see same_file) */
    unsigned long long dev, ino;
    long long size, mtime_ns, ctime_ns;
    long long file_size; /* the file's size, from the fstat at open */
    const int64_t *place; /* copy plan, or NULL */
    int status;
    int placed;
    long long nread;
    long long detail;
    long long read_ns;   /* open, stat and read */
    long long decode_ns; /* decompress */
    long long place_ns;  /* copy-cast into the batch */
} chunk_job;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* set_codecs(zstd_decompress, zstd_is_error, blosc_decompress_ctx, blosc_getitem[, partial_max_share]):
 * the functions to call, by address; 0 for a codec that is not available (its pair must be both set or
 * both 0); and the largest share of a blosc chunk decoded block by block. */
static PyObject *set_codecs(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long zd, ze, bd, bg;
    double share = partial_max_share;
    if (!PyArg_ParseTuple(args, "KKKK|d", &zd, &ze, &bd, &bg, &share))
        return NULL;
    if (!zd != !ze || !bd != !bg) {
        PyErr_SetString(PyExc_ValueError, "each codec needs both of its function addresses, or neither");
        return NULL;
    }
    if (!(share >= 0.0 && share <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "partial_max_share must be between 0 and 1");
        return NULL;
    }
    partial_max_share = share;
    zstd_decompress = (zstd_decompress_fn)(uintptr_t)zd;
    zstd_is_error = (zstd_is_error_fn)(uintptr_t)ze;
    blosc_decompress_ctx = (blosc_decompress_ctx_fn)(uintptr_t)bd;
    blosc_getitem = (blosc_getitem_fn)(uintptr_t)bg;
    Py_RETURN_NONE;
}

/* set_zstd_streaming(create_dctx, free_dctx, decompress_dctx, decompress_begin, decompress_continue,
 * next_src_size, frame_content_size): zstd's context and buffer-less streaming
 * functions, by address; all 0 turns them off (each chunk is then one ZSTD_decompress call, decoded in full). */
static PyObject *set_zstd_streaming(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long a[7];
    if (!PyArg_ParseTuple(args, "KKKKKKK", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6]))
        return NULL;
    int set = 0;
    for (int i = 0; i < 7; i++)
        set += a[i] != 0;
    if (set != 0 && set != 7) {
        PyErr_SetString(PyExc_ValueError, "zstd's streaming functions must all be given, or none");
        return NULL;
    }
    zstd_create_dctx = (zstd_create_dctx_fn)(uintptr_t)a[0];
    zstd_free_dctx = (zstd_free_dctx_fn)(uintptr_t)a[1];
    zstd_decompress_dctx = (zstd_decompress_dctx_fn)(uintptr_t)a[2];
    zstd_begin = (zstd_begin_fn)(uintptr_t)a[3];
    zstd_continue = (zstd_continue_fn)(uintptr_t)a[4];
    zstd_next_src_size = (zstd_next_src_size_fn)(uintptr_t)a[5];
    zstd_content_size = (zstd_content_size_fn)(uintptr_t)a[6];
    Py_RETURN_NONE;
}

/* ---- reading ------------------------------------------------------------------------------ */

/* Read bytes [lo, hi) of the stored chunk into buf + lo; 0 on success, else sets the job's
 * status (OS error, or SHORT: the file ends early). */
static int read_range(chunk_job *job, int fd, char *buf, size_t lo, size_t hi) {
    off_t base = job->offset < 0 ? 0 : (off_t)job->offset;
    size_t done = lo;
    while (done < hi) {
        ssize_t got = pread(fd, buf + done, hi - done, base + (off_t)done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            job->status = ST_OS_ERROR;
            job->detail = errno;
            return -1;
        }
        if (got == 0)
            break;
        done += (size_t)got;
        job->nread += got;
    }
    if (done != hi) {
        job->status = ST_SHORT;
        job->detail = (long long)done;
        return -1;
    }
    return 0;
}

static long long ns_of(struct timespec t) { return (long long)t.tv_sec * 1000000000LL + t.tv_nsec; }

#if defined(__APPLE__) /* the same times under other names */
#define MTIME(st) ((st)->st_mtimespec)
#define CTIME(st) ((st)->st_ctimespec)
#else
#define MTIME(st) ((st)->st_mtim)
#define CTIME(st) ((st)->st_ctim)
#endif

/* 1 when ``st`` is the file (device, inode, size, modification and change times) the job expects */
static int same_file(const chunk_job *job, const struct stat *st) {
    return (unsigned long long)st->st_dev == job->dev && (unsigned long long)st->st_ino == job->ino &&
           (long long)st->st_size == job->size && ns_of(MTIME(st)) == job->mtime_ns &&
           ns_of(CTIME(st)) == job->ctime_ns;
}

/* Close the chunk's file after its reads. An inner chunk of a shard is checked once more first: a shard
 * rewritten in place while it was read may have given bytes of both versions, at the old index's offsets.
 * Then the job's status is ST_CHANGED (Python reads the index anew) and 1 is returned. */
static int close_checked(chunk_job *job, int fd) {
    int changed = 0;
    if (job->has_ident) {
        struct stat st;
        changed = fstat(fd, &st) != 0 || !same_file(job, &st);
    }
    close(fd);
    if (changed)
        job->status = ST_CHANGED;
    return changed;
}

/* Open the chunk's file and learn the stored chunk's size; -1 with the job's status set when it
 * cannot be read, is not a regular file, is not the shard file the job expects, or does not fit the
 * scratch buffer (ST_TOO_BIG, detail: its size). */
static int open_chunk(chunk_job *job, size_t scratch_len, size_t *size) {
    int fd = open(job->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        job->status = (errno == ENOENT || errno == ENOTDIR) ? ST_MISSING : ST_OS_ERROR;
        job->detail = errno;
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        job->status = ST_OS_ERROR;
        job->detail = errno;
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        job->status = ST_NOT_REGULAR;
        job->detail = (long long)(st.st_mode & S_IFMT);
        close(fd);
        return -1;
    }
    /* blocking again: a no-op for local regular files, but some FUSE and network file systems honour it */
    int fl = fcntl(fd, F_GETFL);
    if (fl != -1 && (fl & O_NONBLOCK))
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    if (job->has_ident && !same_file(job, &st)) {
        job->status = ST_CHANGED;
        close(fd);
        return -1;
    }
    job->file_size = (long long)st.st_size;
    /* an inner chunk of a shard: its index gave the size */
    *size = job->offset >= 0 ? (size_t)job->length : (size_t)st.st_size;
    if (*size > scratch_len) {
        job->status = ST_TOO_BIG;
        job->detail = (long long)*size;
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- codecs ------------------------------------------------------------------------------- */

/* The codecs: each reads the stored chunk (``size`` bytes) from the open ``fd``, closes it and decodes
 * into job->out; read_ns counts from ``t0``, when the file was opened. */

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The prefix path: a chunk whose copies end before its last byte is read and decoded only as far as they
 * need, block by block. It stops early only when the stored chunk is exactly one whole frame (its block
 * headers, hopped over with 3-byte reads, add up to the stored size: a truncated file or trailing bytes are
 * read and decoded in full, and fail as they always do) that says it holds the chunk and carries no checksum
 * (a checksum is checked at the frame's end, so a frame with one is always decoded whole: stopping early
 * would skip the check the writer asked for). Blocks after the stop are neither read nor decoded, so damage
 * inside them is not seen, as with blosc's partial decoding. */

#define ZSTD_MAGIC 0xFD2FB528u
/* The first read: the frame header and, as a rule, the whole first block with the next block's header
 * (a block holds at most 128 KiB, stored raw when zstd cannot shrink it). A file this small, e.g. a
 * one-block chunk, is read in one call as on the whole path; a syscall costs about what copying a few
 * KiB does, so reading less than a block first would not pay. */
#define ZSTD_FIRST_READ ((128 << 10) + 64)
/* Later reads take at least this much (frames written with small blocks would otherwise cost a read per
 * block), and the header hops read whatever is left in one go once it is this small or less. */
#define ZSTD_READ_AHEAD (128 << 10)
#define ZSTD_HOPS_READ_REST (64 << 10)

/* Read bytes [lo, hi) of the stored chunk into buf + lo, timing it into job->read_ns (see read_range). */
static int read_timed(chunk_job *job, int fd, char *buf, size_t lo, size_t hi) {
    long long t = now_ns();
    int bad = read_range(job, fd, buf, lo, hi);
    job->read_ns += now_ns() - t;
    return bad;
}

/* 1 when the blocks from the block header at ``pos`` to the frame's last block end exactly at ``size``,
 * read off their 3-byte headers alone (each read into scratch at its own offset; those before ``*have`` are
 * there already, and once little is left the rest is read in one go, extending ``*have``); 0 when they do
 * not, or a header is reserved; -1 when a read failed (the job's status is set). */
static int zstd_blocks_end_at(chunk_job *job, int fd, char *scratch, size_t *have, size_t pos, size_t size) {
    while (pos <= size && size - pos >= 3) {
        if (pos + 3 > *have) {
            if (size - *have <= ZSTD_HOPS_READ_REST) {
                if (read_timed(job, fd, scratch, *have, size))
                    return -1;
                *have = size;
            } else if (read_timed(job, fd, scratch, pos, pos + 3)) {
                return -1;
            }
        }
        const unsigned char *h = (const unsigned char *)scratch + pos;
        uint32_t header = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16;
        uint32_t type = (header >> 1) & 3, block = header >> 3;
        if (type == 3) /* reserved */
            return 0;
        pos += 3 + (type == 1 ? 1 : block); /* an RLE block stores one byte */
        if (header & 1) /* the last block */
            return pos == size;
    }
    return 0;
}

/* The prefix path (see above). Returns 1 when the chunk is done: decoded as far as job->span_stop with the
 * rest of the frame checked (ST_OK, detail: the bytes decoded), or a read failed (its status). Returns 0
 * when it must be read and decoded whole instead, with *have: the bytes [0, *have) already in scratch. */
static int zstd_prefix(chunk_job *job, int fd, size_t size, char *scratch, size_t nbytes, void *dctx,
                       size_t *have) {
    size_t stop = (size_t)job->span_stop;
    *have = 0;
    /* an inner chunk of a shard: its size came from the index, so check the file holds it (the whole
     * path's read says SHORT; the blocks after the stop are not read) */
    if (job->offset >= 0 && (unsigned long long)job->file_size < (unsigned long long)job->offset + size)
        return 0;
    *have = size < ZSTD_FIRST_READ ? size : ZSTD_FIRST_READ;
    if (read_timed(job, fd, scratch, 0, *have))
        return 1;
    const unsigned char *src = (const unsigned char *)scratch;
    if (*have < 5 || le32(src) != ZSTD_MAGIC || (src[4] & 0x04) || zstd_content_size(src, *have) != nbytes)
        return 0; /* not one frame that says it holds this chunk, or one with a checksum */
    long long t = now_ns();
    size_t r = zstd_begin(dctx);
    size_t produced = 0, consumed = 0;
    while (!zstd_is_error(r) && produced < stop) {
        size_t need = zstd_next_src_size(dctx);
        if (need == 0 || need > size - consumed)
            break; /* the frame ended early, or runs past the file: decoded whole, that is reported */
        if (consumed + need > *have) { /* this block and the next block's header, or more (READ_AHEAD) */
            size_t want = size - consumed - need > 3 ? consumed + need + 3 : size;
            if (want < *have + ZSTD_READ_AHEAD)
                want = size - *have > ZSTD_READ_AHEAD ? *have + ZSTD_READ_AHEAD : size;
            job->decode_ns += now_ns() - t;
            if (read_timed(job, fd, scratch, *have, want))
                return 1;
            t = now_ns();
            *have = want;
        }
        r = zstd_continue(dctx, job->out + produced, nbytes - produced, scratch + consumed, need);
        if (!zstd_is_error(r)) {
            consumed += need;
            produced += r;
        }
    }
    job->decode_ns += now_ns() - t;
    if (zstd_is_error(r) || produced < stop)
        return 0;
    int whole = zstd_next_src_size(dctx) == 0 ? consumed == size /* the frame is out: it must fill the file */
                                              : zstd_blocks_end_at(job, fd, scratch, have, consumed, size);
    if (whole < 0)
        return 1;
    if (!whole)
        return 0;
    job->status = ST_OK;
    job->detail = (long long)produced;
    return 1;
}

/* dctx: a context for this call's chunks, or NULL (zstd's streaming functions are not set up, or the
 * context could not be made): then each chunk is one ZSTD_decompress call, decoded whole. */
static void decode_zstd(chunk_job *job, int fd, size_t size, long long t0, char *scratch, size_t nbytes,
                        void *dctx) {
    job->read_ns = now_ns() - t0; /* open and stat */
    size_t have = 0;
    /* span_stop 0 (no byte needed: the engine never asks) would stop before any block and hop from the magic */
    if (dctx != NULL && job->span_stop > 0 && (size_t)job->span_stop < nbytes && zstd_prefix(job, fd, size, scratch, nbytes, dctx, &have)) {
        close_checked(job, fd); /* decoded as it was read: a change voids it */
        return;
    }
    /* the hops of zstd_blocks_end_at past ``have`` land at their own offsets: reading on from ``have``
     * overwrites them with the same bytes */
    int bad = read_timed(job, fd, scratch, have, size);
    if (close_checked(job, fd) || bad)
        return;
    long long t1 = now_ns();
    size_t decoded = dctx != NULL ? zstd_decompress_dctx(dctx, job->out, nbytes, scratch, size)
                                  : zstd_decompress(job->out, nbytes, scratch, size);
    job->decode_ns += now_ns() - t1;
    if (zstd_is_error(decoded)) {
        job->status = ST_CODEC_ERROR;
        job->detail = (long long)(0 - decoded); /* zstd error codes are negated size_t values */
        return;
    }
    job->detail = (long long)decoded;
    job->status = decoded == nbytes ? ST_OK : ST_SIZE;
}

#define BLOSC_HEADER 16
#define BLOSC_MEMCPYED 0x2

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* The stored bytes [*lo, *hi) holding blocks first..last of a frame whose block table is at
 * scratch + 16; 0 when the table is sound, -1 when it points outside the frame or repeats a
 * block. Blocks need not be stored in order (c-blosc compressing on several threads writes
 * them as they finish), so a block runs from its start to the next larger start of any block. */
static int blosc_stored_range(const unsigned char *table, uint32_t nblocks, uint32_t cbytes, uint32_t first,
                              uint32_t last, size_t *lo, size_t *hi) {
    uint32_t table_end = BLOSC_HEADER + 4 * nblocks;
    uint32_t *sorted = malloc(sizeof(uint32_t) * nblocks);
    if (sorted == NULL)
        return -1;
    for (uint32_t i = 0; i < nblocks; i++) {
        sorted[i] = le32(table + 4 * i);
        if (sorted[i] < table_end || sorted[i] >= cbytes) {
            free(sorted);
            return -1;
        }
    }
    qsort(sorted, nblocks, sizeof(uint32_t), cmp_u32);
    for (uint32_t i = 1; i < nblocks; i++) {
        if (sorted[i] == sorted[i - 1]) {
            free(sorted);
            return -1;
        }
    }
    size_t low = cbytes, high = 0;
    for (uint32_t j = first; j <= last; j++) {
        uint32_t start = le32(table + 4 * j);
        /* the next larger start: binary search in the sorted starts */
        uint32_t a = 0, b = nblocks;
        while (a < b) {
            uint32_t m = a + (b - a) / 2;
            if (sorted[m] <= start)
                a = m + 1;
            else
                b = m;
        }
        size_t end = a < nblocks ? sorted[a] : cbytes;
        if (start < low)
            low = start;
        if (end > high)
            high = end;
    }
    free(sorted);
    *lo = low;
    *hi = high;
    return 0;
}

/* Read a blosc1 chunk file and decode either the blocks holding the job's span (when they are
 * at most partial_max_share of the chunk, the rule of stoker/zarr/blosc_partial.py) or the whole frame. Frames
 * whose header disagrees with the chunk or the file get ST_FRAME: the Python path reports them. */
static void decode_blosc(chunk_job *job, int fd, size_t size, long long t0, char *scratch, size_t nbytes) {
    const unsigned char *h = (const unsigned char *)scratch;
    int partial = 0, failed = 1;
    size_t lo = 0, hi = 0;
    uint32_t first = 0, last = 0, typesize = 0, blocksize = 0;
    long long want = job->span_stop - job->span_start;
    /* a span over the share is decoded whole whatever the blocks: one read, no header first */
    int maybe_partial = want > 0 && (double)want <= partial_max_share * (double)nbytes && size > BLOSC_HEADER;
    if (read_range(job, fd, scratch, 0, maybe_partial ? BLOSC_HEADER : size))
        goto read_done;
    job->status = ST_FRAME; /* until the header is found to fit */
    if (size < BLOSC_HEADER)
        goto read_done;
    uint32_t flags = h[2], fr_nbytes = le32(h + 4), cbytes = le32(h + 12);
    typesize = h[3];
    blocksize = le32(h + 8);
    if (h[0] == 0 || h[0] > 4 || typesize == 0 || blocksize == 0 || fr_nbytes != nbytes || cbytes != size)
        goto read_done;
    job->status = ST_OK;
    if (maybe_partial && !(flags & BLOSC_MEMCPYED) && nbytes % typesize == 0) {
        uint32_t nblocks = (uint32_t)((nbytes + blocksize - 1) / blocksize);
        size_t block_lo = (size_t)job->span_start / blocksize * blocksize;
        size_t block_hi = ((size_t)job->span_stop + blocksize - 1) / blocksize * blocksize;
        if (block_hi > nbytes)
            block_hi = nbytes;
        size_t table_end = BLOSC_HEADER + 4 * (size_t)nblocks;
        if ((double)(block_hi - block_lo) <= partial_max_share * (double)nbytes && table_end <= size) {
            if (read_range(job, fd, scratch, BLOSC_HEADER, table_end))
                goto read_done;
            first = (uint32_t)(job->span_start / blocksize);
            last = (uint32_t)((job->span_stop - 1) / blocksize);
            if (blosc_stored_range(h + BLOSC_HEADER, nblocks, cbytes, first, last, &lo, &hi)) {
                job->status = ST_FRAME;
                goto read_done;
            }
            partial = 1;
            if (lo < table_end)
                lo = table_end;
        }
    }
    if (partial ? read_range(job, fd, scratch, lo, hi)
                : maybe_partial && read_range(job, fd, scratch, BLOSC_HEADER, size))
        goto read_done;
    failed = 0;
read_done:
    if (close_checked(job, fd))
        failed = 1;
    long long t1 = now_ns();
    job->read_ns = t1 - t0;
    if (failed)
        return;
    if (partial) {
        /* Only [lo, hi) of the blocks was read; the rest of scratch holds leftovers (another chunk's
         * bytes). blosc bounds every stream it decodes by the frame's stated size (cbytes), so state the
         * end of what was read: a block whose streams run past the next block's start then fails (and
         * the Python path decides) instead of decoding bytes that never came from this file. */
        unsigned char *stated = (unsigned char *)scratch + 12;
        for (int b = 0; b < 4; b++)
            stated[b] = (unsigned char)(hi >> (8 * b));
        /* whole items around the span; blosc decodes the blocks that hold them */
        long long first_item = job->span_start / typesize;
        long long last_item = (job->span_stop + typesize - 1) / typesize;
        int got = blosc_getitem(scratch, (int)first_item, (int)(last_item - first_item),
                                job->out + first_item * typesize);
        job->decode_ns = now_ns() - t1;
        if (got != (last_item - first_item) * (long long)typesize) {
            job->status = ST_CODEC_ERROR;
            job->detail = got;
            return;
        }
        size_t span_hi = (size_t)(last + 1) * blocksize;
        job->detail = (long long)((span_hi < nbytes ? span_hi : nbytes) - (size_t)first * blocksize);
        job->status = ST_OK;
        return;
    }
    int got = blosc_decompress_ctx(scratch, job->out, nbytes, 1);
    job->decode_ns = now_ns() - t1;
    if (got < 0) {
        job->status = ST_CODEC_ERROR;
        job->detail = got;
        return;
    }
    job->detail = got;
    job->status = (size_t)got == nbytes ? ST_OK : ST_SIZE;
}

/* ---- placing: the copy-cast into the batch ------------------------------------------------ */

/* float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN (torch's conversion) */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (isnan(f))
        return 0x7FC0;
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#define CONVERT_LOOPS(NAME, T)                                                                    \
    static void NAME##_to_f32(const void *s, void *d, size_t n) {                                 \
        const T *src = s;                                                                         \
        float *dst = d;                                                                           \
        for (size_t i = 0; i < n; i++)                                                            \
            dst[i] = (float)src[i];                                                               \
    }                                                                                             \
    static void NAME##_to_bf16(const void *s, void *d, size_t n) {                                \
        const T *src = s;                                                                         \
        uint16_t *dst = d;                                                                        \
        for (size_t i = 0; i < n; i++)                                                            \
            dst[i] = bf16_bits((float)src[i]);                                                  \
    }

CONVERT_LOOPS(u8, uint8_t)
CONVERT_LOOPS(i8, int8_t)
CONVERT_LOOPS(u16, uint16_t)
CONVERT_LOOPS(i16, int16_t)
CONVERT_LOOPS(u32, uint32_t)
CONVERT_LOOPS(i32, int32_t)
CONVERT_LOOPS(u64, uint64_t)
CONVERT_LOOPS(i64, int64_t)
CONVERT_LOOPS(f32, float)
CONVERT_LOOPS(f64, double)

typedef void (*convert_fn)(const void *src, void *dst, size_t n);

static const convert_fn converters[N_SRC_KINDS][N_DST_KINDS] = {
    {NULL, u8_to_f32, u8_to_bf16},   {NULL, i8_to_f32, i8_to_bf16},   {NULL, u16_to_f32, u16_to_bf16},
    {NULL, i16_to_f32, i16_to_bf16}, {NULL, u32_to_f32, u32_to_bf16}, {NULL, i32_to_f32, i32_to_bf16},
    {NULL, u64_to_f32, u64_to_bf16}, {NULL, i64_to_f32, i64_to_bf16}, {NULL, f32_to_f32, f32_to_bf16},
    {NULL, f64_to_f32, f64_to_bf16},
};

typedef struct {
    char *base;
    long long nbytes;
    int kind;
    int stream; /* write whole cache lines with streaming stores (see write_run) */
} batch_dst;

static size_t dst_itemsize(const batch_dst *dst, int src_kind) {
    return dst->kind == KIND_SAME ? (size_t)src_itemsize[src_kind] : dst->kind == KIND_F32 ? 4 : 2;
}

/* A copy plan (int64 values, aligned: array('q') always is):
 *   src_kind, ndim, ncopies, src_strides[ndim], dst_strides[ndim],
 *   then per copy: src_offset, dst_offset, extent[ndim]
 * strides and offsets count elements; the innermost stride of both must be 1. */
static int check_place(const void *plan, Py_ssize_t len, const chunk_job *job, long long chunk_bytes,
                       const batch_dst *dst, Py_ssize_t index) {
    const int64_t *p = plan;
    Py_ssize_t n = len / (Py_ssize_t)sizeof(int64_t);
    if (len % (Py_ssize_t)sizeof(int64_t) || (uintptr_t)plan % _Alignof(int64_t))
        goto bad;
    if (n < 3 || p[0] < 0 || p[0] >= N_SRC_KINDS || p[1] < 1 || p[1] > MAX_NDIM || p[2] < 0)
        goto bad;
    long long kind = p[0], ndim = p[1], ncopies = p[2];
    /* divide before multiplying: a huge ncopies must not wrap around to the right length */
    if (n < 3 + 2 * ndim || ncopies > (n - 3 - 2 * ndim) / (2 + ndim) || n != 3 + 2 * ndim + ncopies * (2 + ndim))
        goto bad;
    if (dst->kind == KIND_SAME ? 0 : converters[kind][dst->kind] == NULL)
        goto bad;
    const int64_t *ss = p + 3, *ds = p + 3 + ndim;
    if (ss[ndim - 1] != 1 || ds[ndim - 1] != 1)
        goto bad;
    long long item = src_itemsize[kind];
    /* a cast reads and writes whole elements in place: the chunk and the batch aligned to them (numpy and
     * torch buffers always are; a plain copy is a memcpy) */
    if (dst->kind != KIND_SAME &&
        ((uintptr_t)job->out % (uintptr_t)item || (uintptr_t)dst->base % dst_itemsize(dst, (int)kind)))
        goto bad;
    long long chunk_elems = chunk_bytes / item;
    long long dst_elems = dst->nbytes / (long long)dst_itemsize(dst, (int)kind);
    const int64_t *c = p + 3 + 2 * ndim;
    for (long long i = 0; i < ncopies; i++, c += 2 + ndim) {
        long long s_last = c[0], d_last = c[1], step, count = 1;
        if (s_last < 0 || d_last < 0)
            goto bad;
        for (long long k = 0; k < ndim; k++) {
            if (c[2 + k] < 1 || ss[k] < 0 || ds[k] < 0)
                goto bad;
            /* a copy writes no more elements than the batch holds: with zero strides any extent stays in
             * bounds, and the work must stay bounded too */
            if (__builtin_mul_overflow(count, c[2 + k], &count) || count > dst_elems)
                goto bad;
            if (__builtin_mul_overflow(c[2 + k] - 1, ss[k], &step) || __builtin_add_overflow(s_last, step, &s_last))
                goto bad;
            if (__builtin_mul_overflow(c[2 + k] - 1, ds[k], &step) || __builtin_add_overflow(d_last, step, &d_last))
                goto bad;
        }
        if (s_last >= chunk_elems || d_last >= dst_elems)
            goto bad;
        /* a copy reads only the decoded span: outside it a shared buffer holds another chunk's bytes */
        if (c[0] * item < job->span_start || (s_last + 1) * item > job->span_stop)
            goto bad;
    }
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "places[%zd] is not a valid copy plan for this chunk, its span and the batch",
                 index);
    return -1;
}

/* Writing a run into the batch. A batch is usually far larger than the caches and is read only
 * later (by the consumer or a DMA), so ordinary stores first read every destination line from memory
 * and then evict it again: twice the memory traffic. Streaming (non-temporal) stores write whole lines
 * straight to memory. Runs are converted in small pieces into an L1 buffer, then streamed. */
#define STREAM_PIECE 1024 /* bytes of batch per piece: stays in L1 */

static void stream_bytes(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    /* only whole cache lines are streamed: a partly streamed line costs a read-modify-write in memory */
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
#endif
    memcpy(d, s, n);
}

static void write_run(const char *s, char *d, size_t run, size_t s_item, size_t d_item, convert_fn convert,
                      int stream) {
#if !defined(__SSE2__)
    stream = 0; /* no streaming stores here: write in place rather than through the piece buffer */
#endif
    if (!stream) {
        if (convert == NULL)
            memcpy(d, s, run * s_item);
        else
            convert(s, d, run);
        return;
    }
    if (convert == NULL) {
        stream_bytes(d, s, run * s_item);
        return;
    }
    char piece[STREAM_PIECE] __attribute__((aligned(64)));
    /* the first piece ends on a line boundary, so no line is split between two pieces */
    size_t room = STREAM_PIECE - ((uintptr_t)d & 63);
    while (run) {
        size_t k = room / d_item;
        if (k > run)
            k = run;
        convert(s, piece, k);
        stream_bytes(d, piece, k * d_item);
        s += k * s_item, d += k * d_item, run -= k;
        room = STREAM_PIECE;
    }
}

/* Cast every copy of the plan from the decoded chunk into the batch; runs without the GIL. */
static void place_copies(const int64_t *p, const char *chunk, const batch_dst *dst) {
    int kind = (int)p[0], ndim = (int)p[1];
    long long ncopies = p[2];
    const int64_t *ss = p + 3, *ds = p + 3 + ndim;
    const int64_t *c = p + 3 + 2 * ndim;
    size_t s_item = (size_t)src_itemsize[kind];
    size_t d_item = dst_itemsize(dst, kind);
    convert_fn convert = dst->kind == KIND_SAME ? NULL : converters[kind][dst->kind];
    for (long long i = 0; i < ncopies; i++, c += 2 + ndim) {
        const int64_t *ext = c + 2;
        size_t run = (size_t)ext[ndim - 1];
        long long idx[MAX_NDIM] = {0};
        for (;;) {
            long long so = c[0], dof = c[1];
            for (int k = 0; k < ndim - 1; k++) {
                so += idx[k] * ss[k];
                dof += idx[k] * ds[k];
            }
            const char *s = chunk + (size_t)so * s_item;
            char *d = dst->base + (size_t)dof * d_item;
            write_run(s, d, run, s_item, d_item, convert, dst->stream);
            int k = ndim - 2;
            for (; k >= 0; k--) {
                if (++idx[k] < ext[k])
                    break;
                idx[k] = 0;
            }
            if (k < 0)
                break;
        }
    }
#if defined(__SSE2__)
    if (dst->stream)
        _mm_sfence(); /* streamed stores are weakly ordered: make them visible before the batch is handed on */
#endif
}

/* ---- the call ----------------------------------------------------------------------------- */

static int parse_dst(PyObject *obj, batch_dst *dst) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(obj, "KLi|p", &addr, &dst->nbytes, &dst->kind, &dst->stream))
        return -1;
    if (!addr || dst->nbytes < 0 || dst->kind < 0 || dst->kind >= N_DST_KINDS) {
        PyErr_SetString(PyExc_ValueError, "dst must be (address, size in bytes, kind[, stream]) of a batch");
        return -1;
    }
    dst->base = (char *)(uintptr_t)addr;
    return 0;
}

static PyObject *decode_files(PyObject *Py_UNUSED(self), PyObject *args) {
    int codec;
    PyObject *paths_obj, *regions_obj, *scratch_obj, *outs_obj, *places_obj, *dst_obj;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "iOOOOnOO", &codec, &paths_obj, &regions_obj, &scratch_obj, &outs_obj, &nbytes,
                          &places_obj, &dst_obj))
        return NULL;
    if (codec == CODEC_ZSTD ? zstd_decompress == NULL : codec == CODEC_BLOSC ? blosc_getitem == NULL : 1) {
        PyErr_Format(PyExc_RuntimeError, "stoker._native: codec %d is not set up", codec);
        return NULL;
    }
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
        return NULL;
    }
    batch_dst dst = {0};
    if (dst_obj != Py_None && parse_dst(dst_obj, &dst))
        return NULL;
    PyObject *paths = PySequence_Fast(paths_obj, "paths must be a sequence");
    PyObject *regions = paths ? PySequence_Fast(regions_obj, "regions must be a sequence") : NULL;
    PyObject *outs = regions ? PySequence_Fast(outs_obj, "outs must be a sequence") : NULL;
    PyObject *places = (outs && places_obj != Py_None) ? PySequence_Fast(places_obj, "places must be a sequence")
                                                        : NULL;
    Py_ssize_t n = paths ? PySequence_Fast_GET_SIZE(paths) : 0;
    PyObject *result = NULL;
    Py_buffer scratch = {0};
    Py_buffer *out_views = NULL, *place_views = NULL;
    PyObject **encoded_paths = NULL;
    chunk_job *jobs = NULL;
    Py_ssize_t views_held = 0, paths_held = 0, places_held = 0;

    if (outs == NULL || (places_obj != Py_None && places == NULL))
        goto done;
    if (PySequence_Fast_GET_SIZE(outs) != n || PySequence_Fast_GET_SIZE(regions) != n ||
        (places && PySequence_Fast_GET_SIZE(places) != n)) {
        PyErr_SetString(PyExc_ValueError, "paths, regions, outs and places must have the same length");
        goto done;
    }
    if (places && dst_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError, "places need a dst");
        goto done;
    }
    if (PyObject_GetBuffer(scratch_obj, &scratch, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
        goto done;
    out_views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    place_views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    encoded_paths = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    jobs = PyMem_Calloc((size_t)n + 1, sizeof(chunk_job));
    if (out_views == NULL || place_views == NULL || encoded_paths == NULL || jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(paths, i), &encoded_paths[i]))
            goto done;
        paths_held++;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(outs, i), &out_views[i],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
            goto done;
        views_held++;
        if (out_views[i].len < nbytes) {
            PyErr_Format(PyExc_ValueError, "outs[%zd] holds %zd bytes, fewer than nbytes (%zd)", i,
                         out_views[i].len, nbytes);
            goto done;
        }
        chunk_job *job = &jobs[i];
        PyObject *region = PySequence_Fast_GET_ITEM(regions, i);
        job->has_ident = PyTuple_Check(region) && PyTuple_GET_SIZE(region) == 9;
        if (job->has_ident ? !PyArg_ParseTuple(region, "LLLLKKLLL", &job->offset, &job->length, &job->span_start,
                                               &job->span_stop, &job->dev, &job->ino, &job->size, &job->mtime_ns,
                                               &job->ctime_ns)
                           : !PyArg_ParseTuple(region, "LLLL", &job->offset, &job->length, &job->span_start,
                                               &job->span_stop))
            goto done;
        if (job->has_ident && job->offset < 0) {
            PyErr_Format(PyExc_ValueError, "regions[%zd]: a file identity is for inner chunks only", i);
            goto done;
        }
        if (job->span_start < 0 || job->span_stop > nbytes || job->span_start > job->span_stop ||
            job->offset < -1 || job->length < 0 || job->offset > LLONG_MAX - job->length) {
            PyErr_Format(PyExc_ValueError, "regions[%zd] is outside its file or its chunk", i);
            goto done;
        }
        PyObject *place = places ? PySequence_Fast_GET_ITEM(places, i) : Py_None;
        if (place != Py_None) {
            if (PyObject_GetBuffer(place, &place_views[places_held], PyBUF_C_CONTIGUOUS) != 0)
                goto done;
            places_held++;
            Py_buffer *pv = &place_views[places_held - 1];
            job->out = out_views[i].buf;
            if (check_place(pv->buf, pv->len, job, nbytes, &dst, i))
                goto done;
            jobs[i].place = pv->buf;
        }
        jobs[i].path = PyBytes_AS_STRING(encoded_paths[i]);
        jobs[i].out = out_views[i].buf;
    }

    Py_BEGIN_ALLOW_THREADS
    void *dctx = codec == CODEC_ZSTD && zstd_create_dctx != NULL && n > 0 ? zstd_create_dctx() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        chunk_job *job = &jobs[i];
        size_t size;
        long long t0 = now_ns();
        int fd = open_chunk(job, (size_t)scratch.len, &size);
        if (fd < 0) {
            job->read_ns = now_ns() - t0;
            continue;
        }
        if (codec == CODEC_ZSTD)
            decode_zstd(job, fd, size, t0, scratch.buf, (size_t)nbytes, dctx);
        else
            decode_blosc(job, fd, size, t0, scratch.buf, (size_t)nbytes);
        if (job->status == ST_OK && job->place != NULL) {
            long long t = now_ns();
            place_copies(job->place, job->out, &dst);
            job->place_ns = now_ns() - t;
            job->placed = 1;
        }
    }
    if (dctx != NULL)
        zstd_free_dctx(dctx);
    Py_END_ALLOW_THREADS

    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        chunk_job *j = &jobs[i];
        PyObject *item = Py_BuildValue("(iLLLLLi)", j->status, j->nread, j->detail, j->read_ns, j->decode_ns,
                                       j->place_ns, j->placed);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, item);
    }

done:
    for (Py_ssize_t i = 0; i < views_held; i++)
        PyBuffer_Release(&out_views[i]);
    for (Py_ssize_t i = 0; i < places_held; i++)
        PyBuffer_Release(&place_views[i]);
    for (Py_ssize_t i = 0; i < paths_held; i++)
        Py_DECREF(encoded_paths[i]);
    if (scratch.obj != NULL)
        PyBuffer_Release(&scratch);
    PyMem_Free(out_views);
    PyMem_Free(place_views);
    PyMem_Free(encoded_paths);
    PyMem_Free(jobs);
    Py_XDECREF(paths);
    Py_XDECREF(regions);
    Py_XDECREF(outs);
    Py_XDECREF(places);
    return result;
}

static PyMethodDef methods[] = {
    {"set_codecs", set_codecs, METH_VARARGS,
     "set_codecs(zstd_decompress, zstd_is_error, blosc_decompress_ctx, blosc_getitem[, partial_max_share]): "
     "function addresses (0: that codec is not available) and the largest share of a blosc chunk decoded "
     "block by block."},
    {"set_zstd_streaming", set_zstd_streaming, METH_VARARGS,
     "set_zstd_streaming(create_dctx, free_dctx, decompress_dctx, decompress_begin, decompress_continue, "
     "next_src_size, frame_content_size): zstd's context and buffer-less "
     "streaming functions (all 0: off)."},
    {"decode_files", decode_files, METH_VARARGS,
     "decode_files(codec, paths, regions, scratch, outs, nbytes, places, dst) -> "
     "[(status, nread, decoded, read_ns, decode_ns, place_ns, placed)]: read, decompress and place chunk "
     "files without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
