/* stoker._native: the shared declarations of its parts.
 *
 *   io.c      open regular files (non-blocking, then blocking), identity checks, pread loops
 *   codecs.c  zstd (whole, or up to the block the copies need), blosc (whole, or some blocks):
 *             every codec is the library's own function, handed in by address (stoker/native.py)
 *   place.c   copy plans: checks, casts, streaming stores, fill values
 *   pool.c    the engine: worker threads owned by the extension, jobs, the scratch budget
 *   module.c  the Python glue (set_codecs, decode_files, Engine, BatchJob)
 *
 * Nothing here holds the GIL except module.c, and module.c releases it around all work. (The folder is csrc/,
 * not native/ or _native/: beside native.py and the extension module _native, a folder of either name would
 * read as a package of that name.)
 */
#ifndef STOKER_NATIVE_H
#define STOKER_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define MAX_NDIM 32

/* Codecs of a stored chunk. CODEC_FILL: nothing is stored, the copies take the source's fill value. */
enum { CODEC_ZSTD = 0, CODEC_BLOSC = 1, N_CODECS, CODEC_FILL = -1 };

/* Chunk statuses (stoker/native.py has the same numbers). */
enum {
    ST_OK = 0,
    ST_MISSING,      /* no such file */
    ST_TOO_BIG,      /* the stored chunk is larger than the read buffer (detail: its size) */
    ST_OS_ERROR,     /* detail: errno */
    ST_SHORT,        /* the file ended before the stored chunk did (it changed while read) */
    ST_CODEC_ERROR,  /* detail: zstd's error code, or blosc's negative result */
    ST_SIZE,         /* decoded to another size than the chunk's (detail: the size) */
    ST_FRAME,        /* a frame this reader leaves to the Python path (it decides and words the error) */
    ST_NOT_REGULAR,  /* detail: st_mode & S_IFMT */
    ST_CHANGED,      /* the shard file is not the one its index was read from */
    ST_CANCELLED,    /* the job was cancelled before this chunk was placed */
    ST_SKIPPED,      /* not read: a chunk before it failed (only the first failure is reported) */
    N_STATUSES
};

/* Element kinds of a copy-cast: the source's, and the batch's (KIND_SAME: a plain copy). */
enum { K_U8 = 0, K_I8, K_U16, K_I16, K_U32, K_I32, K_U64, K_I64, K_F32, K_F64, N_SRC_KINDS };
enum { KIND_SAME = 0, KIND_F32 = 1, KIND_BF16 = 2, N_DST_KINDS };
extern const int src_itemsize[N_SRC_KINDS];

/* One stored chunk to read and decode: where it is, what the copies read, and what happened. */
typedef struct {
    const char *path;
    char *out; /* the decoded chunk */
    long long offset, length; /* the stored chunk in its file; offset -1: the whole file */
    long long span_start, span_stop;
    int has_ident; /* an inner chunk whose shard file must have this identity (see same_file) */
    unsigned long long dev, ino;
    long long size, mtime_ns, ctime_ns;
    long long file_size; /* the file's size, from the fstat at open */
    int status;
    long long nread;
    long long detail;
    long long read_ns;   /* open, stat and read */
    long long decode_ns; /* decompress */
} chunk_io;

/* ---- io.c ---- */
long long now_ns(void);
/* the file's descriptor, or -1 with the status set; *size: the stored chunk's size (from the index, or the file's) */
int open_chunk(chunk_io *job, size_t scratch_len, size_t *size);
int read_range(chunk_io *job, int fd, char *buf, size_t lo, size_t hi);
int read_timed(chunk_io *job, int fd, char *buf, size_t lo, size_t hi);
/* close after the reads; 1 (status CHANGED) when an inner chunk's shard is no longer the file expected */
int close_checked(chunk_io *job, int fd);

/* ---- codecs.c ---- */
/* What one thread keeps between chunks: zstd's context, made at the first zstd chunk (NULL: one-shot decodes). */
typedef struct {
    void *zstd_dctx;
    int zstd_tried;
} codec_ctx;
int codec_ready(int codec);
void codec_ctx_free(codec_ctx *ctx);
/* Open, read and decode one stored chunk into job->out (``nbytes``), reading through ``scratch``. */
void read_decode(chunk_io *job, int codec, char *scratch, size_t scratch_len, size_t nbytes, codec_ctx *ctx);
/* setters (module.c parses the arguments) */
void set_codec_functions(uintptr_t zd, uintptr_t ze, uintptr_t bd, uintptr_t bg, double share);
void set_zstd_functions(const uintptr_t a[7]);

/* ---- place.c ---- */
typedef struct {
    char *base;
    long long nbytes;
    int kind;
    int stream; /* write whole cache lines with streaming stores (see write_run) */
} batch_dst;

size_t dst_itemsize(const batch_dst *dst, int src_kind);
int cast_supported(int src_kind, int dst_kind);
/* 0 when every copy (src_offset, dst_offset, extent[ndim], ``step`` values apart) stays inside the decoded span
 * of a chunk of ``chunk_bytes`` and inside the batch, with bounded work; -1 otherwise */
int check_copies(int kind, int ndim, const int64_t *ss, const int64_t *ds, const int64_t *copies, long long ncopies,
                 long long step, long long chunk_bytes, long long span_start, long long span_stop, const char *chunk,
                 const batch_dst *dst);
/* the same for the copies of a fill chunk: inside the batch only */
int check_fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                      size_t d_item, const batch_dst *dst);
void place_copies(int kind, int ndim, const int64_t *ss, const int64_t *ds, const int64_t *copies, long long ncopies,
                  long long step, const char *chunk, const batch_dst *dst);
void fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                 const unsigned char *value, size_t d_item, const batch_dst *dst);
void place_fence(const batch_dst *dst);

#endif
