/* Decoding stored chunks. No codec is implemented here: zstd is zstd's own ZSTD_decompress (and its
 * buffer-less streaming functions, for the early stop), blosc is c-blosc's blosc_decompress_ctx /
 * blosc_getitem and lz4 is LZ4_decompress_safe, the copies numcodecs already carries, and zlib and gzip are
 * zlib's inflate, the library Python's zlib module uses (their addresses are handed in by stoker/native.py,
 * through ctypes). lz4, zlib and gzip chunks are decoded whole; any of them that does not decode to exactly
 * the chunk is left to the Python path (ST_FRAME), which decides and words the error.
 */
#include "stoker_native.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__has_include)
#if __has_include(<zlib.h>)
#include <zlib.h> /* the z_stream layout only: the functions come from the library Python loaded */
#define HAVE_ZLIB 1
#endif
#endif

typedef size_t (*zstd_decompress_fn)(void *dst, size_t dst_capacity, const void *src, size_t src_size);
typedef unsigned (*zstd_is_error_fn)(size_t code);
/* zstd's context API (a context reused across chunks) and its buffer-less streaming API (block by block,
 * straight into the output, so decoding can stop once the bytes the copies read are out) */
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
typedef int (*lz4_decompress_safe_fn)(const char *src, char *dst, int src_size, int dst_capacity);
static lz4_decompress_safe_fn lz4_decompress_safe = NULL;
#if HAVE_ZLIB
typedef int (*z_init2_fn)(z_streamp strm, int window_bits, const char *version, int stream_size);
typedef int (*z_call_fn)(z_streamp strm);
typedef int (*z_inflate_fn)(z_streamp strm, int flush);
static z_init2_fn z_init2 = NULL;
static z_inflate_fn z_inflate = NULL;
static z_call_fn z_end = NULL, z_reset = NULL;
#endif
/* blosc decodes only some blocks when they are at most this share of the chunk; blosc_getitem costs
 * a little more per block than a whole decode. Set from Python (zarr/codecs/blosc.py, PARTIAL_MAX_SHARE), one rule. */
static double partial_max_share = 0.9;

/* Set while no thread decodes (stoker/native.py at import; tests between calls). */
void set_codec_functions(uintptr_t zd, uintptr_t ze, uintptr_t bd, uintptr_t bg, double share) {
    partial_max_share = share;
    zstd_decompress = (zstd_decompress_fn)zd;
    zstd_is_error = (zstd_is_error_fn)ze;
    blosc_decompress_ctx = (blosc_decompress_ctx_fn)bd;
    blosc_getitem = (blosc_getitem_fn)bg;
}

void set_zstd_functions(const uintptr_t a[7]) {
    zstd_create_dctx = (zstd_create_dctx_fn)a[0];
    zstd_free_dctx = (zstd_free_dctx_fn)a[1];
    zstd_decompress_dctx = (zstd_decompress_dctx_fn)a[2];
    zstd_begin = (zstd_begin_fn)a[3];
    zstd_continue = (zstd_continue_fn)a[4];
    zstd_next_src_size = (zstd_next_src_size_fn)a[5];
    zstd_content_size = (zstd_content_size_fn)a[6];
}

void set_lz4_function(uintptr_t decompress_safe) { lz4_decompress_safe = (lz4_decompress_safe_fn)decompress_safe; }

int set_zlib_functions(uintptr_t init2, uintptr_t inflate_fn, uintptr_t end, uintptr_t reset) {
#if HAVE_ZLIB
    z_init2 = (z_init2_fn)init2;
    z_inflate = (z_inflate_fn)inflate_fn;
    z_end = (z_call_fn)end;
    z_reset = (z_call_fn)reset;
    return 1;
#else
    (void)init2, (void)inflate_fn, (void)end, (void)reset;
    return 0;
#endif
}

int codec_ready(int codec) {
    switch (codec) {
    case CODEC_ZSTD:
        return zstd_decompress != NULL;
    case CODEC_BLOSC:
        return blosc_getitem != NULL;
    case CODEC_LZ4:
        return lz4_decompress_safe != NULL;
#if HAVE_ZLIB
    case CODEC_ZLIB:
    case CODEC_GZIP:
        return z_init2 != NULL;
#endif
    default:
        return 0;
    }
}

void codec_ctx_free(codec_ctx *ctx) {
    /* a context made while the streaming functions were set is freed by the same library */
    if (ctx->zstd_dctx != NULL && zstd_free_dctx != NULL)
        zstd_free_dctx(ctx->zstd_dctx);
    ctx->zstd_dctx = NULL;
    ctx->zstd_tried = 0;
}

/* The codecs: each reads the stored chunk (``size`` bytes) from the open ``fd`` into ``scratch``, closes it
 * (or keeps it open: close_checked) and
 * decodes into job->out; read_ns counts from ``t0``, when the file was opened. They read the stored bytes at
 * ``src`` (stored_bytes): ``scratch`` itself for a file; for a chunk in memory its buffer, which the reads
 * only check (scratch is NULL then, and nothing is written to the buffer). */

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


/* 1 when the blocks from the block header at ``pos`` to the frame's last block end exactly at ``size``,
 * read off their 3-byte headers alone (each read into scratch at its own offset; those before ``*have`` are
 * there already, and once little is left the rest is read in one go, extending ``*have``); 0 when they do
 * not, or a header is reserved; -1 when a read failed (the job's status is set). */
static int zstd_blocks_end_at(chunk_io *job, int fd, char *scratch, const char *src, size_t *have, size_t pos,
                              size_t size) {
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
        const unsigned char *h = (const unsigned char *)src + pos;
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
static int zstd_prefix(chunk_io *job, int fd, size_t size, char *scratch, const char *stored, size_t nbytes,
                       void *dctx, size_t *have) {
    size_t stop = (size_t)job->span_stop;
    *have = 0;
    /* an inner chunk of a shard: its size came from the index, so check the file holds it (the whole
     * path's read says SHORT; the blocks after the stop are not read) */
    if (job->offset >= 0 && (unsigned long long)job->file_size < (unsigned long long)job->offset + size)
        return 0;
    *have = size < ZSTD_FIRST_READ ? size : ZSTD_FIRST_READ;
    if (read_timed(job, fd, scratch, 0, *have))
        return 1;
    const unsigned char *src = (const unsigned char *)stored;
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
        r = zstd_continue(dctx, job->out + produced, nbytes - produced, stored + consumed, need);
        if (!zstd_is_error(r)) {
            consumed += need;
            produced += r;
        }
    }
    job->decode_ns += now_ns() - t;
    if (zstd_is_error(r) || produced < stop)
        return 0;
    int whole = zstd_next_src_size(dctx) == 0 ? consumed == size /* the frame is out: it must fill the file */
                                              : zstd_blocks_end_at(job, fd, scratch, stored, have, consumed, size);
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
static void decode_zstd(chunk_io *job, int fd, size_t size, long long t0, char *scratch, const char *src,
                        size_t nbytes, void *dctx) {
    job->read_ns = now_ns() - t0; /* open and stat */
    size_t have = 0;
    /* span_stop 0 (no byte needed: the engine never asks) would stop before any block and hop from the magic */
    if (dctx != NULL && job->claim_out == NULL && job->span_stop > 0 && (size_t)job->span_stop < nbytes &&
        zstd_prefix(job, fd, size, scratch, src, nbytes, dctx, &have)) {
        close_checked(job, fd); /* decoded as it was read: a change voids it */
        return;
    }
    /* the hops of zstd_blocks_end_at past ``have`` land at their own offsets: reading on from ``have``
     * overwrites them with the same bytes */
    int bad = read_timed(job, fd, scratch, have, size);
    if (close_checked(job, fd) || bad)
        return;
    long long t1 = now_ns();
    if (job->claim_out != NULL && job->claim_out(job->out_arg)) {
        job->status = ST_CANCELLED;
        return;
    }
    size_t decoded = dctx != NULL ? zstd_decompress_dctx(dctx, job->out, nbytes, src, size)
                                  : zstd_decompress(job->out, nbytes, src, size);
    if (job->claim_out != NULL)
        job->release_out(job->out_arg);
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
/* c-blosc 1's largest chunk (BLOSC_MAX_BUFFERSIZE: INT_MAX less its 16-byte overhead). blosc_getitem takes
 * its first item and count as int and both blosc calls read the header's sizes as int32 and return an int:
 * a header stating more is refused before any call, so no size, item or result is narrowed past INT_MAX. */
#define BLOSC_MAX_NBYTES ((uint32_t)INT_MAX - BLOSC_HEADER)

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
 * at most partial_max_share of the chunk, the rule of stoker/zarr/codecs/blosc.py) or the whole frame. Frames
 * whose header disagrees with the chunk or the file, or states more than blosc1 holds (BLOSC_MAX_NBYTES), get
 * ST_FRAME: the Python path reports them. */
static void decode_blosc(chunk_io *job, int fd, size_t size, long long t0, char *scratch, const char *src,
                         size_t nbytes) {
    const unsigned char *h = (const unsigned char *)src;
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
    if (h[0] == 0 || h[0] > 4 || typesize == 0 || blocksize == 0 || fr_nbytes != nbytes || cbytes != size ||
        fr_nbytes > BLOSC_MAX_NBYTES || cbytes > (uint32_t)INT_MAX)
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
        /* From a file, only [lo, hi) of the blocks was read; the rest of scratch holds leftovers (another
         * chunk's bytes). blosc bounds every stream it decodes by the frame's stated size (cbytes), so state
         * the end of what was read: a block whose streams run past the next block's start then fails (and
         * the Python path decides) instead of decoding bytes that never came from this file. A chunk in
         * memory is never written: it holds the whole frame (cbytes is its size), or, fetched as its needed
         * blocks (engine/cpu/frame_spans.py), a buffer of that size holding the header, zeros, those blocks and
         * zeros, so a stream running past its block reads the zeros, never another chunk's bytes. */
        if (!job->in_memory) {
            unsigned char *stated = (unsigned char *)scratch + 12;
            for (int b = 0; b < 4; b++)
                stated[b] = (unsigned char)(hi >> (8 * b));
        }
        /* whole items around the span; blosc decodes the blocks that hold them. Both fit an int: the span is
         * inside the chunk, whose size the header check bounded by BLOSC_MAX_NBYTES. */
        long long first_item = job->span_start / typesize;
        long long last_item = (job->span_stop + typesize - 1) / typesize;
        int got = blosc_getitem(src, (int)first_item, (int)(last_item - first_item),
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
    int got = blosc_decompress_ctx(src, job->out, nbytes, 1);
    job->decode_ns = now_ns() - t1;
    if (got < 0) {
        job->status = ST_CODEC_ERROR;
        job->detail = got;
        return;
    }
    job->detail = got;
    job->status = (size_t)got == nbytes ? ST_OK : ST_SIZE;
}

/* Read the whole stored chunk; 0 with its file closed (or kept: close_checked), or -1 with the status set. */
static int read_whole(chunk_io *job, int fd, size_t size, long long t0, char *scratch) {
    job->read_ns = now_ns() - t0; /* open and stat */
    int bad = read_timed(job, fd, scratch, 0, size);
    return close_checked(job, fd) || bad ? -1 : 0;
}

/* numcodecs' LZ4: the decoded size (4 bytes, little end), then one LZ4 block. */
static void decode_lz4(chunk_io *job, int fd, size_t size, long long t0, char *scratch, const char *src,
                       size_t nbytes) {
    if (read_whole(job, fd, size, t0, scratch))
        return;
    if (size < 4 || le32((const unsigned char *)src) != nbytes || size - 4 > INT_MAX || nbytes > INT_MAX) {
        job->status = ST_FRAME;
        return;
    }
    long long t1 = now_ns();
    int got = lz4_decompress_safe(src + 4, job->out, (int)(size - 4), (int)nbytes);
    job->decode_ns = now_ns() - t1;
    job->detail = got;
    job->status = got == (int)nbytes ? ST_OK : ST_FRAME;
}

#if HAVE_ZLIB
/* One zlib stream (bytes after it ignored, as zlib.decompress does), or gzip members one after the other
 * with zero bytes between or after them (as numcodecs' GZip reads them); the output must be the chunk. */
static void decode_inflate(chunk_io *job, int fd, size_t size, long long t0, char *scratch, const char *src,
                           size_t nbytes, int gzip) {
    if (read_whole(job, fd, size, t0, scratch))
        return;
    job->status = ST_FRAME; /* until it decodes to exactly the chunk */
    if (size > UINT_MAX || nbytes > UINT_MAX)
        return;
    long long t1 = now_ns();
    z_stream zs;
    memset(&zs, 0, sizeof(zs));
    zs.next_in = (Bytef *)(uintptr_t)src; /* zlib only reads it (next_in is const only with ZLIB_CONST) */
    zs.avail_in = (uInt)size;
    zs.next_out = (Bytef *)job->out;
    zs.avail_out = (uInt)nbytes;
    if (z_init2(&zs, gzip ? 16 + MAX_WBITS : MAX_WBITS, ZLIB_VERSION, (int)sizeof(z_stream)) != Z_OK)
        return;
    int ok = 0;
    for (;;) {
        if (z_inflate(&zs, Z_FINISH) != Z_STREAM_END) /* damaged, cut short, or more than the chunk */
            break;
        if (gzip) {
            while (zs.avail_in && *zs.next_in == 0)
                zs.next_in++, zs.avail_in--;
            if (zs.avail_in) {
                if (z_reset(&zs) != Z_OK)
                    break;
                continue;
            }
        }
        ok = zs.avail_out == 0;
        break;
    }
    z_end(&zs);
    job->decode_ns = now_ns() - t1;
    job->detail = (long long)(nbytes - zs.avail_out);
    if (ok)
        job->status = ST_OK;
}
#endif

/* The codecs: each reads the stored chunk from its file, closes (or keeps) it and decodes into job->out. */
void read_decode(chunk_io *job, int codec, char *scratch, size_t max_stored, size_t nbytes, codec_ctx *ctx) {
    size_t size;
    long long t0 = now_ns();
    int fd = open_chunk(job, max_stored, &size);
    if (fd < 0) {
        job->read_ns = now_ns() - t0;
        return;
    }
    const char *src = stored_bytes(job, scratch);
    if (codec == CODEC_ZSTD) {
        if (!ctx->zstd_tried && zstd_create_dctx != NULL) {
            ctx->zstd_dctx = zstd_create_dctx(); /* NULL when out of memory: one-shot decodes then */
            ctx->zstd_tried = 1;
        }
        /* the streaming functions may have been turned off since (tests do, between calls) */
        decode_zstd(job, fd, size, t0, scratch, src, nbytes, zstd_create_dctx != NULL ? ctx->zstd_dctx : NULL);
    } else if (codec == CODEC_BLOSC) {
        decode_blosc(job, fd, size, t0, scratch, src, nbytes);
    } else if (codec == CODEC_LZ4) {
        decode_lz4(job, fd, size, t0, scratch, src, nbytes);
#if HAVE_ZLIB
    } else {
        decode_inflate(job, fd, size, t0, scratch, src, nbytes, codec == CODEC_GZIP);
#endif
    }
}
