/* stoker._native: the shared declarations of its parts, and the one source of its interface.
 *
 *   io.c      open regular files (non-blocking, then blocking), identity checks, pread loops; or a buffer
 *             already in memory (a chunk fetched from a store), decoded where it is
 *   codecs.c  zstd (whole, or up to the block the copies need), blosc (whole, or some blocks), lz4 (numcodecs'
 *             framing), zlib and gzip (zlib's inflate):
 *             every codec is the library's own function, handed in by address (stoker/native.py)
 *   place.c   copy plans: checks, casts, streaming stores, fill values
 *   grid.c    planning a batch's grid: the chunks its crops touch, once each, and every copy
 *   tables.c  the engine's tables from a plan's columns
 *   pool.c    the engine: worker threads owned by the extension, jobs, the scratch budget
 *   py_*.c    the Python glue (py_glue.h): py_args.c (argument buffers), py_codecs.c (set_codecs...),
 *             py_tables.c (plan_grid, plan_crops, chunk_rows...), py_engine.c (Engine, BatchJob)
 *   module.c  the module stoker._native: the glue's functions and types, and ``interface``, this header's
 *             constants by name
 *   testing.c stoker._testing, built for the tests only (never shipped in a wheel): the codec setters and
 *             decode_files, which reads, decodes and places chunks on the calling thread
 *
 * The constants below (enums and #defines; the function-like #defines give a table's columns for a rank D)
 * are the interface's one source: .ci/interface writes stoker/engine/interface.py from this file, and the
 * extension exports the same names with the values it was compiled with (module.c: ``interface``), which
 * stoker/engine/cpu/native.py checks before it uses the extension.
 *
 * Nothing here holds the GIL except the glue, and the glue releases it around all work. (The folder is csrc/,
 * not native/ or _native/: beside native.py and the extension module _native, a folder of either name would
 * read as a package of that name.)
 */
#ifndef STOKER_NATIVE_H
#define STOKER_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define MAX_NDIM 32
/* the longest chunk path the engine builds, NUL included: a source's prefix plus at most 21 bytes per grid
 * coordinate and separator must fit (engine/cpu/decode_native.py leaves longer ones to the Python path) */
#define PATH_CAP 4096

/* Codecs of a stored chunk. CODEC_FILL: nothing is stored, the copies take the source's fill value. */
enum { CODEC_ZSTD = 0, CODEC_BLOSC = 1, CODEC_LZ4 = 2, CODEC_ZLIB = 3, CODEC_GZIP = 4, N_CODECS, CODEC_FILL = -1 };

/* Chunk statuses (engine/cpu/decode_native.py maps each to a typed error or a retry on the Python path). */
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
    ST_CANCELLED,    /* the job was cancelled before this chunk was placed; a staging read not run (staging.h: its
                      * round's cancel flag was set before it started) */
    ST_NO_MEMORY,    /* the thread's scratch could not be allocated */
    ST_RANGE,        /* a value the copies read does not fit the integer batch (KIND_I32, KIND_I64), or is finite
                      * and would be inf in the float batch; the batch holds zero in its place, and the Python
                      * side raises DtypeMismatch naming the chunk */
    ST_PENDING,      /* not finished yet */
    ST_ENTRY,        /* a disk-cache entry (buffer with an entries row) that is missing, unreadable, of another size,
                      * ident or layout, or fails its checksum (detail: ENTRY_*): never decoded, the Python side
                      * fetches the chunk from its store again */
    N_STATUSES
};

/* Element kinds of a copy-cast: the source's, and the batch's (KIND_SAME: a plain copy). KIND_I32 and KIND_I64
 * take integer sources only, each value checked against the batch's range (ST_RANGE when one does not fit). */
enum { K_U8 = 0, K_I8, K_U16, K_I16, K_U32, K_I32, K_U64, K_I64, K_F32, K_F64, N_SRC_KINDS };
enum { KIND_SAME = 0, KIND_F32 = 1, KIND_BF16 = 2, KIND_I32 = 3, KIND_I64 = 4, N_DST_KINDS };
extern const int src_itemsize[N_SRC_KINDS];

/* One stored chunk to read and decode: where it is, what the copies read, and what happened. */
typedef struct {
    const char *path;
    /* in_memory: the stored chunk is in ``mem`` (``mem_len`` bytes; NULL: a missing value), read as a file of
     * that size would be; no file is opened */
    int in_memory;
    const char *mem; /* read only: never written, whoever else holds it */
    long long mem_len;
    char *out; /* the decoded chunk */
    long long offset, length; /* the stored chunk in its file; offset -1: the whole file */
    long long span_start, span_stop;
    int has_ident; /* an inner chunk whose shard file must have this identity (see same_file) */
    unsigned long long dev, ino;
    long long size, mtime_ns, ctime_ns;
    long long file_size; /* the file's size, from the fstat at open */
    /* An inner chunk's shard file kept open between the chunks of it that one thread reads (pool.c), which
     * saves an open, an fstat, an fcntl and a close per chunk. reuse: ``fd`` is that file, open already, so
     * it is neither opened nor stat'ed again (the check after the previous chunk's reads saw the identity
     * this chunk expects; a change since is seen by the check after this chunk's reads). keep: leave the
     * file open after the reads unless that check failed or the file system is not local (open_chunk
     * clears it then, see on_local_fs); ``kept`` then says it is open, and ``fd`` holds it. */
    int reuse, keep, kept, fd;
    /* claim_out set: ``out`` is the chunk's place in a batch, which its decode writes into straight (pool.c's
     * direct_place; zstd chunks read whole only). The decode runs between claim_out(out_arg), 0 when it may
     * write (else ST_CANCELLED, nothing written), and release_out(out_arg); the reads come before, unclaimed. */
    int (*claim_out)(void *arg);
    void (*release_out)(void *arg);
    void *out_arg;
    int status;
    long long nread;
    long long detail;
    long long read_ns;   /* open, stat and read */
    long long decode_ns; /* decompress */
} chunk_io;

/* ---- io.c ---- */
long long now_ns(void);
/* the file's descriptor (MEM_FD for a chunk in memory), or -1 with the status set; *size: the stored chunk's
 * size (from the index, or the file's / buffer's) */
#define MEM_FD 0x7fffffff
int open_chunk(chunk_io *job, size_t max_stored, size_t *size);
/* where the codecs read the stored chunk: ``scratch``, which read_range fills, for a file; the buffer itself
 * for a chunk in memory (read_range then copies nothing: it checks the bytes asked for are inside it) */
const char *stored_bytes(const chunk_io *job, char *scratch);
int read_range(chunk_io *job, int fd, char *buf, size_t lo, size_t hi);
int read_timed(chunk_io *job, int fd, char *buf, size_t lo, size_t hi);
/* close after the reads (or keep it open: job->keep); 1 (status CHANGED, the file closed) when an inner chunk's
 * shard is no longer the file expected */
int close_checked(chunk_io *job, int fd);
/* 1 when the open file is on a local file system (only there are shard files kept open between chunks) */
int on_local_fs(int fd);

/* ---- entries.c: disk-cache entries (storage/diskcache.py's layout), read as local files ---- */
/* An entry file: ENTRY_HEADER_BYTES of header (6 bytes of magic "STKC1\n", 2 of padding, then little-endian the
 * crc32c of ident + payload (4 bytes), the ident's length (4) and the payload's (8)), the ident, the payload. */
#define ENTRY_HEADER_BYTES 24
/* the longest ident an entry chunk may name (longer: the Python side reads the entry itself) */
#define ENTRY_IDENT_CAP 4096
/* ST_ENTRY details: why an entry was not used */
enum { ENTRY_GONE = 1, ENTRY_UNREADABLE, ENTRY_SIZE, ENTRY_LAYOUT, ENTRY_OTHER_IDENT, ENTRY_CHECKSUM };
/* crc32c (Castagnoli) of n bytes continuing ``crc`` (0 to start), as the crc32c package's crc32c(data, crc) */
uint32_t crc32c_of(uint32_t crc, const void *data, size_t n);
/* choose crc32c_of's way once (the CPU's features, STOKER_NO_CRC_FOLD): the module's init calls it, GIL held */
void crc32c_init(void);
/* the way chosen: "fold" (AVX-512 VPCLMULQDQ), "sse42" (the crc32 instruction) or "table" */
const char *crc32c_path(void);
/* Read the entry file ``path`` whole into ``buf`` (room for ENTRY_HEADER_BYTES + ident_len + max_stored bytes)
 * and check it: a regular file (not followed if a link), its header, its ident equal to ``ident``, its payload
 * at most ``max_stored`` bytes and its checksum; touch it (its modification time now: the cache's LRU clock,
 * where allowed). 0 with *payload, *payload_len set; else -1 with the job's status ST_ENTRY (detail: ENTRY_*).
 * An entry unlinked while open is read whole (its inode lives until closed). */
int read_entry(chunk_io *job, const char *path, const char *ident, size_t ident_len, char *buf, size_t max_stored,
               const char **payload, size_t *payload_len);
/* One entry read, as read_entry and the GPU decode's staged reads (staging.c) both make it, so both judge an
 * entry alike: open (not followed if a link; a regular file), its size against the bounds, its header and
 * ident, its crc32c; touched (the LRU clock) at most once a minute, as relatime. In: the ident expected, the
 * payload's bound, the payload's exact size expected (-1: any within the bound), ``head`` (room for
 * ENTRY_HEADER_BYTES + ident_len bytes) and ``payload`` (room for the payload); ``whole``: 1 when ``payload`` is
 * head + ENTRY_HEADER_BYTES + ident_len (the whole file read in one pread), 0 where the header is read and
 * checked first. Out: the payload's length, the bytes read, the reads made. 0, or the ENTRY_* why it is not
 * used. */
typedef struct {
    const char *ident;
    size_t ident_len;
    size_t max_payload;
    long long expect_payload;
    unsigned char *head;
    char *payload;
    int whole;
    size_t payload_len;
    long long nread;
    int preads;
} entry_reading;
int entry_read(const char *path, entry_reading *r);
/* How many entry_read calls skipped the payload's crc32c: the same file, unchanged, checked before (entries.c) */
long long entry_checks_skipped(void);
/* How every reader of cache entries (entry_read, py_engine.c's read_files) reads and touches one, opened
 * O_NONBLOCK (a FIFO at an entry's name must not hang the open). entry_pread: n bytes at ``at`` into buf, made
 * again on EINTR; on EAGAIN (a file system that honours O_NONBLOCK: some FUSE and network ones) the descriptor
 * is made blocking once (*blocking, 0 at the open, set) and the read made again. 0, ENTRY_SIZE (the file ends
 * early) or ENTRY_UNREADABLE (a read error); the bytes read are added to *nread. entry_touch: the LRU clock, the
 * entry's mtime set to now when it is a minute old or more (or dated in the future); a read-only folder: a hit
 * all the same. */
int entry_pread(int fd, char *buf, size_t n, size_t at, int *blocking, long long *nread);
/* A whole entry file's ``len`` bytes at ``raw`` judged as entry_read judges one of ``ident``: 0 (sound: its
 * payload the bytes after ENTRY_HEADER_BYTES + ident_len), or the ENTRY_* why not (read_files judges so before
 * it touches: only a sound entry is a use for the LRU). */
int entry_judge(const unsigned char *raw, size_t len, const char *ident, size_t ident_len);
struct stat;
void entry_touch(int fd, const struct stat *st);
/* One entry for write_entries: its final name ``path`` (<root>/<subfolder>/<name>), its ident and payload (NULL: a
 * marker, an empty file made at its name); out: ``result`` 1 written, 0 something was there already (left as
 * it is), -errno failed; ``allocated`` the disk the file took (its blocks, or its size where more). */
typedef struct {
    const char *path;
    const char *ident;
    size_t ident_len;
    const void *payload;
    size_t payload_len;
    int result;
    long long allocated;
} entry_write;
/* Write the entries in order, each in the layout above through a temporary sibling
 * ``.<name>.tmp-<tag>-<8 hex>`` (hex from ``seed``) renamed onto its name, subfolders made where missing (the
 * caller holds the folder's lock). Stops at the first failure: 0, or its -errno. ``*grown``: what the disk gave
 * the files written, their subfolders and the root (subfolders made), as storage/diskcache.py counts it. */
int write_entries(entry_write *items, size_t n, const char *tag, uint64_t seed, long long *grown);

/* ---- codecs.c ---- */
/* What one thread keeps between chunks: zstd's context, made at the first zstd chunk (NULL: one-shot decodes). */
typedef struct {
    void *zstd_dctx;
    int zstd_tried;
} codec_ctx;
int codec_ready(int codec);
void codec_ctx_free(codec_ctx *ctx);
/* Open, read and decode one stored chunk into job->out (``nbytes``). A stored chunk larger than ``max_stored``
 * is ST_TOO_BIG, unread. A file is read through ``scratch`` (``max_stored`` bytes); a chunk in memory is
 * decoded straight from its buffer, and ``scratch`` is not used (it may be NULL). */
void read_decode(chunk_io *job, int codec, char *scratch, size_t max_stored, size_t nbytes, codec_ctx *ctx);
/* setters (module.c parses the arguments) */
void set_codec_functions(uintptr_t zd, uintptr_t ze, uintptr_t bd, uintptr_t bg, double share);
void set_zstd_functions(const uintptr_t a[7]);
void set_lz4_function(uintptr_t decompress_safe);
/* 0 when this build has no zlib.h (the z_stream layout): zlib and gzip chunks then take the Python path */
int set_zlib_functions(uintptr_t init2, uintptr_t inflate_fn, uintptr_t end, uintptr_t reset);

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
 * of a chunk of ``chunk_bytes`` and inside the batch, with bounded work; -1 otherwise. The batch's innermost
 * stride must be 1, and the chunk's too unless ``strided``. */
int check_copies(int kind, int ndim, const int64_t *ss, const int64_t *ds, const int64_t *copies, long long ncopies,
                 long long step, long long chunk_bytes, long long span_start, long long span_stop, const char *chunk,
                 const batch_dst *dst, int strided);
/* the same for the copies of a fill chunk: inside the batch only */
int check_fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                      size_t d_item, const batch_dst *dst);
/* swap: the chunk's elements are in the other byte order; an innermost chunk stride other than 1 (F order, a
 * transpose) gathers each run's elements first. Returns 1 when a value read did not fit an integer batch
 * (KIND_I32, KIND_I64: zero written in its place, the other copies made), else 0. */
int place_copies(int kind, int swap, int ndim, const int64_t *ss, const int64_t *ds, const int64_t *copies,
                  long long ncopies, long long step, const char *chunk, const batch_dst *dst);
void fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                 const unsigned char *value, size_t d_item, const batch_dst *dst);
void place_fence(const batch_dst *dst);

/* ---- grid.c ---- */

/* a planned chunk: its array, its copies (rows [first, first + n) of the copies), its decoded byte span, then
 * its ndim grid coordinates; a copy: its crop (batch row), its first element in the chunk (decoded layout),
 * then per axis its start in the chunk, its start in the crop, its extent */
enum { G_SOURCE = 0, G_FIRST_COPY, G_NCOPIES, G_SPAN_START, G_SPAN_STOP, GRID_CHUNK_COLS };
#define GC_ROW 0
#define GC_SRC_OFFSET 1
#define GC_CHUNK_START 2
#define GC_BOX_START(D) (2 + (D))
#define GC_EXTENT(D) (2 + 2 * (D))
#define GRID_COPY_COLS(D) (2 + 3 * (D))
typedef struct {
    long long n_copies, n_chunks;
    int64_t *copies, *chunks;
} grid_plan;
int plan_grid(int ndim, long long n_samples, const int64_t *starts, const int64_t *sids, const int64_t *shape,
              long long n_sources, const int64_t *chunk_shapes, const int64_t *strides, const int64_t *itemsizes,
              grid_plan *out, const char **error);
void grid_plan_free(grid_plan *g);
/* a sharded array's chunks: each one's inner index and shard (numbered in order of first use); each shard's
 * first chunk and number over the shard grid. inner, shard_of: n values; first, numbers: room for n */
int shard_positions(int ndim, long long n, const int64_t *index, const int64_t *cps, const int64_t *shard_strides,
                    int64_t *inner, int64_t *shard_of, int64_t *first, int64_t *numbers, long long *n_shards,
                    const char **error);
/* each chunk's (offset, length) from its shard's index table (slot -1: a missing shard, the empty entry) */
int gather_entries(long long n, const int64_t *shard_of, const int64_t *inner, long long n_shards,
                   const int64_t *slot, long long n_tables, const uint64_t *const *tables, long long n_inner,
                   uint64_t *out, const char **error);

/* ---- tables.c: the engine's tables from a plan's columns ---- */

/* a batch plan's per-chunk columns (engine/planning/tables.py's TablePlan), in chunk_rows' cols[] */
enum { P_SOURCE = 0, P_FILE, P_OFFSET, P_LENGTH, P_SPAN_START, P_SPAN_STOP, P_FIRST_COPY, P_NCOPIES, N_PLAN_COLS };
/* an array's row of what the engine does with it (engine/cpu/decode_native.py's _Source.info_row, I_* there) */
enum { I_FILLS = 0, I_READS, I_MEMORY, I_CODEC, I_NBYTES, I_STORED, N_INFO_COLS };
/* the chunks table (N_CHUNK_COLS values a row) of n_rows chunks, given as columns (the chunks a batch takes,
 * gathered): each its array's codec and sizes (info: n_sources rows), its place in its file, or with fetched
 * buffer i for chunk i */
int plan_chunk_rows(long long n_rows, const int64_t *const cols[N_PLAN_COLS], long long n_sources,
                    const int64_t *info, int fetched, int64_t *out, const char **error);
/* Whether a layout's elements of ``item`` units lie apart: its axes of length > 1 (``len``, n <= STRIDES_MAX_AXES),
 * taken by increasing ``step`` (stride magnitudes), each stepping at least past what the axes before it span,
 * the span at most INT64_MAX. 1 (apart) or 0; the copies' check (plan_copy_rows) and Python buffers'
 * (buffer_apart) */
#define STRIDES_MAX_AXES 64
int strides_apart(int n, const int64_t *len, const uint64_t *step, uint64_t item);
/* the copies table (CP_* columns, COPY_COLS(ndim) a row): each copy's first element in its chunk, its first in
 * the batch (row * row_stride + box_start . dst_strides, checked against int64 overflow), its extent */
int plan_copy_rows(int ndim, long long n_copies, const int64_t *src_offset, const int64_t *row,
                   const int64_t *box_start, const int64_t *extent, int64_t row_stride, const int64_t *dst_strides,
                   int64_t *out, const char **error);

/* an array's row for plan_crops (engine/planning/tables.py's _array_row): its item size, read chunk shape (D values),
 * element strides (D), sharded or not, shape (D) */
#define A_ITEMSIZE 0
#define A_CHUNK_SHAPE 1
#define A_STRIDES(D) (1 + (D))
#define A_SHARDED(D) (1 + 2 * (D))
#define A_SHAPE(D) (2 + 2 * (D))
#define ARRAY_ROW_COLS(D) (2 + 3 * (D))
/* plan_grid from a batch's boxes (n_crops x ndim x [start, stop)) and its arrays' rows (A_* above), as
 * engine/planning/tables.py keeps them; first
 * the boxes are checked against their arrays' shapes: *first_outside is the first crop that ends past its array
 * (then nothing is planned), else -1; a box whose stop - start is not ``shape`` on some axis is an error (it
 * would be planned from its start past its array); *bytes_needed the crops' elements times their item sizes;
 * *any_sharded whether an array is sharded */
int plan_crops(int ndim, long long n_crops, const int64_t *boxes, const int64_t *sids, const int64_t *shape,
               long long n_sources, const int64_t *rows, grid_plan *out, long long *first_outside,
               long long *bytes_needed, int *any_sharded, const char **error);

/* ---- pool.c: the engine ---- */

/* The plan tables of a batch (int64, row-major; ndim: the batch's sample rank). Columns: */
enum { /* a chunk: one stored chunk (or a fill), and its copies */
    C_SOURCE = 0,  /* row of the sources table */
    C_FILE,        /* row of the files table; -1: nothing is stored (CODEC_FILL) */
    C_OFFSET,      /* the stored chunk's offset in its file; -1: the whole file */
    C_LENGTH,      /* its length (an inner chunk; 0 for a whole file) */
    C_SPAN_START,  /* the decoded bytes the copies read: [start, stop) */
    C_SPAN_STOP,
    C_CODEC,       /* CODEC_* */
    C_NBYTES,      /* the decoded chunk's size */
    C_MAX_STORED,  /* the most bytes a stored chunk of this codec may take (larger: ST_TOO_BIG, unread) */
    C_FIRST_COPY,  /* its copies: rows [first, first + n) of the copies table */
    C_NCOPIES,
    C_BUFFER,      /* -1: read from its file; else the buffer holding it (C_FILE -1, C_OFFSET/C_LENGTH: in it) */
    N_CHUNK_COLS
};
/* a buffer's entries row (plan_tables.entries): where its entry file's path and its ident are in the entry blob */
enum { E_PATH_START = 0, E_PATH_LEN, E_IDENT_START, E_IDENT_LEN, N_ENTRY_COLS };
/* a slot of a decoder's table of disk-cache entries (engine/cpu/entry_table.py; read by entry_hits, py_entries.c):
 * its key (its array's number, its file's number in the array's grid, the chunk's offset and length in it: -1, -1
 * the whole file), its store's stamp number, the disk cache's write ticket, its path's and ident's lengths, and
 * until (a float64's bits); ET_WAYS slots a set */
enum { ET_UID = 0, ET_FILE, ET_OFFSET, ET_LENGTH, ET_STAMP, ET_TICKET, ET_PATH_LEN, ET_IDENT_LEN, ET_UNTIL, N_ET_COLS };
#define ET_KEY_COLS 4
#define ET_WAYS 8
/* an array's disk row (decode_native.py's _Source.disk_row): whether its chunks may be read from disk-cache entries,
 * its number in the table of entries (0: none), then its grid of files' shape (D values) and their strides (D) */
enum { DISK_ROOM = 0, DISK_UID, DISK_GRID };
/* a copy: its first element in the chunk (decoded layout) and in the batch, then its extent (D values) */
#define CP_SRC_OFFSET 0
#define CP_DST_OFFSET 1
#define CP_EXTENT 2
#define COPY_COLS(D) (2 + (D))
enum { /* a source (an array): S_STRIDES then holds ndim strides of its decoded chunks (any layout), in elements */
    S_KIND = 0,    /* element kind (K_*) of its decoded chunks */
    S_FILL,        /* its fill value as the batch holds it: the element's bytes, in the low bytes (little end) */
    S_PATH_START,  /* its files' path prefix in the blob: the array's directory, separator, key prefix */
    S_PATH_LEN,
    S_SEP,         /* the key separator ('/' or '.'), written between grid coordinates */
    S_SWAP,        /* 1: its decoded elements are in the other byte order (swapped before the cast) */
    S_STRIDES,
};
enum { /* a file (a chunk file or a shard): F_COORDS then holds its ndim grid coordinates (its key) */
    F_SOURCE = 0,
    F_HAS_IDENT,   /* 1: read only from a file of this identity (a shard whose index was read from it) */
    F_DEV, F_INO, F_SIZE, F_MTIME, F_CTIME,
    F_COORDS,
};

typedef struct {
    long long n_chunks, n_copies, n_sources, n_files;
    int ndim;
    const int64_t *chunks, *copies, *sources, *files;
    const char *blob;
    long long blob_len;
    /* buffers holding stored chunks (a chunk's C_BUFFER): n_buffers base addresses (NULL: a missing value, the
     * fill) and lengths; the caller keeps them alive until the job is done or cancelled */
    long long n_buffers;
    const char *const *buffers;
    const long long *buffer_lens;
    /* NULL, or n_buffers rows (E_* columns): a row with E_PATH_LEN > 0 makes its buffer (then NULL, length 0) a
     * disk-cache entry the workers read themselves (read_entry): its path and ident in ``entry_blob`` */
    const int64_t *entries;
    const char *entry_blob;
    long long entry_blob_len;
    batch_dst dst;
    int64_t dst_strides[MAX_NDIM];
} plan_tables;

/* A worker thread's clocks (monotonic ns, summed since the thread started): where its time went, a few clock
 * reads a chunk. Each thread writes only its own row; engine_worker_clocks reads every row consistently and
 * adds the segment under way to its column, so W_READ ... W_OTHER sum to W_WALL. */
enum {
    W_READ = 0, /* opening, stat'ing and reading stored chunks */
    W_DECODE,   /* decompressing them */
    W_PLACE,    /* copying and casting decoded chunks into batches */
    W_FILL,     /* writing fill values into batches */
    W_LOCK,     /* waiting for a lock: the engine's, or a job's place or buffer lock */
    W_IDLE,     /* waiting for work: no job had chunks left */
    W_BUDGET,   /* waiting for scratch: other threads held the budget */
    W_OTHER,    /* the rest: taking chunks, building paths, allocating scratch, bookkeeping */
    W_WALL,     /* time since the thread started (until it left) */
    W_CHUNKS,   /* chunks it finished (placed, filled, failed or cancelled) */
    W_TID,      /* its thread id (Linux: gettid(); 0 elsewhere) */
    N_WORKER_COLS
};

/* Counters of a job, summed over its chunks. */
typedef struct {
    long long bytes_read, bytes_decoded, chunks_decoded, chunks_filled;
    long long read_ns, decode_ns, place_ns, fill_ns;
    long long max_threads; /* the most threads that worked on it at once */
    long long files_opened; /* opens of files tried (a shard's may stay open for a thread's next chunks of it) */
    long long chunks_shared; /* placed from another live job's read and decode of the same stored chunk */
    long long chunks_reused; /* placed from a chunk decoded earlier and kept (engine_reuse: pool.c "Reused") */
} job_counters;

typedef struct engine engine;
typedef struct job job;

/* NULL with *error set (a message) when the tables are not a sound plan: checked before any thread sees it */
job *job_new(engine *e, const plan_tables *t, const char **error);
engine *engine_new(int n_threads, long long budget, int *started);
void engine_submit(engine *e, job *j);
/* 1 once every chunk finished; waits at most timeout_s (< 0: no limit); call without the GIL */
int job_wait(engine *e, job *j, double timeout_s);
int job_done(engine *e, job *j);
/* after it returns no worker writes into the job's batch nor reads its buffers; call without the GIL */
void job_cancel(engine *e, job *j);
void job_results(engine *e, job *j, int32_t *status, int64_t *detail, job_counters *counters);
long long job_chunks(const job *j);
void job_release(engine *e, job *j);
/* cancel every job, stop the threads; 1 when all have left within timeout_s; call without the GIL */
int engine_close(engine *e, double timeout_s);
void engine_info(engine *e, long long out[6]);
/* each started thread's clocks (a row of N_WORKER_COLS, W_* above), at most ``rows`` rows; returns the rows
 * written. A forked child's copy of an engine has no threads: no rows. */
int engine_worker_clocks(engine *e, int64_t *out, int rows);
void engine_release(engine *e);
/* keep decoded chunks of jobs submitted from now on, at most ``max_bytes`` (0: none), for the jobs of
 * ``generation``: an entry of another generation is never served (changing it drops every entry) */
void engine_reuse(engine *e, long long max_bytes, long long generation);
/* {max_bytes, held, peak, entries, hits, inserted, evicted, generation} */
void engine_reuse_info(engine *e, long long out[8]);

#endif
