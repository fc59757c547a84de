/* Placing decoded chunks into the batch: checked copy plans, casts, streaming stores and fill values.
 *
 * A copy is (src_offset, dst_offset, extent[ndim]) in elements, with the chunk's strides (ss) and the
 * batch's (ds); the innermost stride of both is 1, so a copy is runs of extent[ndim - 1] elements.
 */
#include "stoker_native.h"

#include <math.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

const int src_itemsize[N_SRC_KINDS] = {1, 1, 2, 2, 4, 4, 8, 8, 4, 8};

/* Loops marked HOT are compiled twice on x86-64 with GCC and glibc: for AVX2 and for the baseline (SSE2), the
 * copy used being picked once when the extension loads (target_clones, through an ifunc). Wheels must run on
 * every x86-64, so the build never uses -march=native. Elsewhere (other compilers, architectures or C
 * libraries), or built with -DHOT= , HOT is nothing and the plain C below is what runs. */
#if !defined(HOT) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) &&         \
    defined(__has_attribute)
#if __has_attribute(target_clones)
#define HOT __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef HOT
#define HOT
#endif

/* float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN (torch's conversion). Written as a
 * select, not a branch, so loops of it vectorise. */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t rounded = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    return isnan(f) ? (uint16_t)0x7FC0 : rounded;
}

#define TO_F32(x) ((float)(x))
#define TO_BF16(x) bf16_bits((float)(x))
size_t dst_itemsize(const batch_dst *dst, int src_kind) {
    switch (dst->kind) {
    case KIND_SAME:
        return (size_t)src_itemsize[src_kind];
    case KIND_F32:
    case KIND_I32:
        return 4;
    case KIND_I64:
        return 8;
    default:
        return 2;
    }
}

/* The batch's end, in elements of ``d_item`` bytes, and every copy's last element in it; -1 when a copy
 * leaves the batch, its extents are not positive, or it writes more elements than the batch holds (with
 * zero strides any extent stays in bounds, and the work must stay bounded too). *s_last gets the last
 * source element per copy when ``ss`` is given. Products are checked for overflow before they are used. */
static int copy_bounds(int ndim, const int64_t *ss, const int64_t *ds, const int64_t *c, long long dst_elems,
                       long long *s_last_out) {
    long long s_last = c[CP_SRC_OFFSET], d_last = c[CP_DST_OFFSET], step, count = 1;
    if (s_last < 0 || d_last < 0)
        return -1;
    for (int k = 0; k < ndim; k++) {
        long long sk = ss != NULL ? ss[k] : 0;
        if (c[CP_EXTENT + k] < 1 || sk < 0 || ds[k] < 0)
            return -1;
        if (__builtin_mul_overflow(count, c[CP_EXTENT + k], &count) || count > dst_elems)
            return -1;
        if (__builtin_mul_overflow(c[CP_EXTENT + k] - 1, sk, &step) || __builtin_add_overflow(s_last, step, &s_last))
            return -1;
        if (__builtin_mul_overflow(c[CP_EXTENT + k] - 1, ds[k], &step) ||
            __builtin_add_overflow(d_last, step, &d_last))
            return -1;
    }
    if (d_last >= dst_elems)
        return -1;
    *s_last_out = s_last;
    return 0;
}

int check_copies(int kind, int ndim, const int64_t *ss, const int64_t *ds, const int64_t *copies, long long ncopies,
                 long long step, long long chunk_bytes, long long span_start, long long span_stop, const char *chunk,
                 const batch_dst *dst, int strided) {
    if (kind < 0 || kind >= N_SRC_KINDS || ndim < 1 || ndim > MAX_NDIM || ncopies < 0 || step < COPY_COLS(ndim))
        return -1;
    if (!cast_supported(kind, dst->kind))
        return -1;
    if ((ss[ndim - 1] != 1 && !strided) || ds[ndim - 1] != 1)
        return -1;
    long long item = src_itemsize[kind];
    /* a cast reads and writes whole elements in place: the chunk and the batch aligned to them (numpy and
     * torch buffers always are; a plain copy is a memcpy) */
    if (dst->kind != KIND_SAME &&
        ((chunk != NULL && (uintptr_t)chunk % (uintptr_t)item) || (uintptr_t)dst->base % dst_itemsize(dst, kind)))
        return -1;
    long long chunk_elems = chunk_bytes / item;
    long long dst_elems = dst->nbytes / (long long)dst_itemsize(dst, kind);
    const int64_t *c = copies;
    for (long long i = 0; i < ncopies; i++, c += step) {
        long long s_last;
        if (copy_bounds(ndim, ss, ds, c, dst_elems, &s_last) || s_last >= chunk_elems)
            return -1;
        /* a copy reads only the decoded span: outside it a shared buffer holds another chunk's bytes */
        if (c[CP_SRC_OFFSET] * item < span_start || (s_last + 1) * item > span_stop)
            return -1;
    }
    return 0;
}

int check_fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                      size_t d_item, const batch_dst *dst) {
    if (ndim < 1 || ndim > MAX_NDIM || ncopies < 0 || step < COPY_COLS(ndim) || d_item == 0 || ds[ndim - 1] != 1)
        return -1;
    if (dst->kind != KIND_SAME && (uintptr_t)dst->base % d_item)
        return -1;
    long long dst_elems = dst->nbytes / (long long)d_item;
    const int64_t *c = copies;
    for (long long i = 0; i < ncopies; i++, c += step) {
        long long s_last;
        if (copy_bounds(ndim, NULL, ds, c, dst_elems, &s_last))
            return -1;
    }
    return 0;
}

/* Writing into the batch. A batch is usually far larger than the caches and is read only later (by the
 * consumer or a DMA), so ordinary stores first read every destination line from memory and then evict it
 * again: twice the memory traffic. Streaming (non-temporal) stores write whole lines straight to memory; only
 * whole lines are streamed (a partly streamed line costs a read-modify-write in memory), the partial lines at
 * a run's ends are written with ordinary stores. */
#define LINE 64
#define STREAM_PIECE 1024 /* bytes of an L1 buffer: gathered elements, or repeated fill values */

#if defined(__SSE2__)
#define CAN_STREAM 1
static inline void stream_line(char *d, const char *s) {
    __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
}
/* the same from a line written in 8-byte stores, by a conversion the compiler leaves scalar (u64 -> i64 with
 * its range check): a 16-byte load cannot take its bytes from two stores, and each waited for both to retire,
 * which made that streamed copy 3x slower than the unstreamed one; an 8-byte load takes its store's value.
 * Only for such conversions: after vectorised 16-byte stores, eight 8-byte streams are slower than four. */
static inline void stream_line_words(char *d, const char *s) {
#if defined(__x86_64__)
    for (int k = 0; k < LINE; k += 8) {
        long long w;
        memcpy(&w, s + k, 8);
        _mm_stream_si64((long long *)(d + k), w);
    }
#else /* no 64-bit movnti on 32-bit x86 */
    stream_line(d, s);
#endif
}
#else
#define CAN_STREAM 0
static inline void stream_line(char *d, const char *s) { memcpy(d, s, LINE); }
static inline void stream_line_words(char *d, const char *s) { memcpy(d, s, LINE); }
#endif

/* ``rows`` runs of ``run`` elements (bytes, for a plain copy), the i-th from s + i * s_step to d + i * d_step
 * (byte steps). One function per element conversion, so that the whole walk over a plane of a copy is one
 * straight loop the compiler vectorises: no call, branch or index arithmetic per element. Returns 1 when a
 * value did not fit the batch's integer type (zero written in its place), else 0. */
typedef int (*rows_fn)(const char *s, ptrdiff_t s_step, char *d, ptrdiff_t d_step, size_t rows, size_t run,
                       int stream);

static int copy_rows(const char *s, ptrdiff_t s_step, char *d, ptrdiff_t d_step, size_t rows, size_t run,
                     int stream) {
    for (size_t r = 0; r < rows; r++) {
        const char *sr = s + (ptrdiff_t)r * s_step;
        char *dr = d + (ptrdiff_t)r * d_step;
        size_t n = run;
        if (CAN_STREAM && stream) {
            size_t head = (LINE - ((uintptr_t)dr & (LINE - 1))) & (LINE - 1);
            head = head < n ? head : n;
            memcpy(dr, sr, head);
            sr += head, dr += head, n -= head;
            for (; n >= LINE; n -= LINE, sr += LINE, dr += LINE)
                stream_line(dr, sr);
        }
        memcpy(dr, sr, n);
    }
    return 0;
}

/* OUT(v): 1 when v does not fit U (then 0 is written, never the out-of-range conversion): outside an integer
 * batch's range, or a finite value that the float batch would hold as inf; 0 where every value fits, and the
 * test vanishes at compile time. The bad flag is an OR reduction, which vectorises. */
#define CONVERT_ROWS(NAME, T, U, CONV, OUT, ATTR, STREAM_LINE)                                               \
    static inline int NAME##_run(const T *restrict s, U *restrict d, size_t n) {                             \
        int bad = 0;                                                                                         \
        for (size_t i = 0; i < n; i++) {                                                                     \
            T v = s[i];                                                                                      \
            int out = OUT(v);                                                                                \
            bad |= out;                                                                                      \
            d[i] = out ? (U)0 : CONV(v);                                                                     \
        }                                                                                                    \
        return bad;                                                                                          \
    }                                                                                                        \
    ATTR static int NAME##_rows(const char *s, ptrdiff_t s_step, char *d, ptrdiff_t d_step, size_t rows,     \
                                size_t run, int stream) {                                                    \
        enum { PER_LINE = LINE / sizeof(U) };                                                                \
        int bad = 0;                                                                                         \
        for (size_t r = 0; r < rows; r++) {                                                                  \
            const T *sr = (const T *)(s + (ptrdiff_t)r * s_step);                                            \
            U *dr = (U *)(d + (ptrdiff_t)r * d_step);                                                        \
            size_t n = run;                                                                                  \
            if (CAN_STREAM && stream) {                                                                      \
                size_t head = ((LINE - ((uintptr_t)dr & (LINE - 1))) & (LINE - 1)) / sizeof(U);              \
                head = head < n ? head : n;                                                                  \
                bad |= NAME##_run(sr, dr, head);                                                             \
                sr += head, dr += head, n -= head;                                                           \
                for (; n >= PER_LINE; n -= PER_LINE, sr += PER_LINE, dr += PER_LINE) {                       \
                    U line[PER_LINE] __attribute__((aligned(LINE)));                                        \
                    bad |= NAME##_run(sr, line, PER_LINE);                                                   \
                    STREAM_LINE((char *)dr, (const char *)line);                                             \
                }                                                                                            \
            }                                                                                                \
            bad |= NAME##_run(sr, dr, n);                                                                    \
        }                                                                                                    \
        return bad;                                                                                          \
    }

/* AVX2 pays for the bfloat16 rounding only: the widening conversions to float32 wait on memory either way,
 * and their 32-byte copies were slower on the short rows of small chunks */
#define FITS(v) 0
/* Finite values that round to inf (engine/cast.py OVERFLOW_AT, the Python path's check): from 2**128 - 2**103
 * in float32 (the midpoint past FLT_MAX rounds up, to even), from 0x1.ffp127 in bfloat16, which a float64 reaches
 * through its float32 rounding. Integers fit both (2**64 is far below). NaN compares false; inf stays inf. */
#define F32_INF(v) (fabs(v) >= 0x1.ffffffp127 && fabs(v) != (double)INFINITY)
#define BF16_INF(v) (fabsf((float)(v)) >= 0x1.ffp127f && fabs((double)(v)) != (double)INFINITY)
/* a float source compared as float (as double, the loop's vectors were half as wide: 3.5x its time) */
#define BF16_INF_F(v) ((fabsf(v) >= 0x1.ffp127f) & (fabsf(v) != INFINITY))
#define CONVERSIONS(NAME, T, OUT32, OUT16)                                                                   \
    CONVERT_ROWS(NAME##_f32, T, float, TO_F32, OUT32, , stream_line)                                         \
    CONVERT_ROWS(NAME##_bf16, T, uint16_t, TO_BF16, OUT16, HOT, stream_line)
CONVERSIONS(u8, uint8_t, FITS, FITS)
CONVERSIONS(i8, int8_t, FITS, FITS)
CONVERSIONS(u16, uint16_t, FITS, FITS)
CONVERSIONS(i16, int16_t, FITS, FITS)
CONVERSIONS(u32, uint32_t, FITS, FITS)
CONVERSIONS(i32, int32_t, FITS, FITS)
CONVERSIONS(u64, uint64_t, FITS, FITS)
CONVERSIONS(i64, int64_t, FITS, FITS)
CONVERSIONS(f32, float, FITS, BF16_INF_F)
CONVERSIONS(f64, double, F32_INF, BF16_INF)

/* Integer batches from integer sources: each value checked against the batch's range, so an id never wraps
 * (the tests are per source type: a comparison that can never hold would draw warnings) */
#define TO_I32(x) ((int32_t)(x))
#define TO_I64(x) ((int64_t)(x))
#define ABOVE_I32(v) ((v) > INT32_MAX)
#define OUTSIDE_I32(v) ((v) < INT32_MIN || (v) > INT32_MAX)
#define ABOVE_I64(v) ((v) > INT64_MAX)
/* LINE64: how a streamed line of the int64 batch is written (stream_line_words where the loop stays scalar) */
#define INTEGERS(NAME, T, OUT32, OUT64, LINE64)                                                              \
    CONVERT_ROWS(NAME##_i32, T, int32_t, TO_I32, OUT32, , stream_line)                                       \
    CONVERT_ROWS(NAME##_i64, T, int64_t, TO_I64, OUT64, , LINE64)
INTEGERS(u8, uint8_t, FITS, FITS, stream_line)
INTEGERS(i8, int8_t, FITS, FITS, stream_line)
INTEGERS(u16, uint16_t, FITS, FITS, stream_line)
INTEGERS(i16, int16_t, FITS, FITS, stream_line)
INTEGERS(u32, uint32_t, ABOVE_I32, FITS, stream_line)
INTEGERS(i32, int32_t, FITS, FITS, stream_line)
INTEGERS(u64, uint64_t, ABOVE_I32, ABOVE_I64, stream_line_words)
INTEGERS(i64, int64_t, OUTSIDE_I32, FITS, stream_line)

/* by [source kind][batch kind]; KIND_SAME is copy_rows; float sources make no integer batch */
#define INT_ROWS(NAME) NAME##_i32_rows, NAME##_i64_rows
static const rows_fn converters[N_SRC_KINDS][N_DST_KINDS] = {
    {NULL, u8_f32_rows, u8_bf16_rows, INT_ROWS(u8)},    {NULL, i8_f32_rows, i8_bf16_rows, INT_ROWS(i8)},
    {NULL, u16_f32_rows, u16_bf16_rows, INT_ROWS(u16)}, {NULL, i16_f32_rows, i16_bf16_rows, INT_ROWS(i16)},
    {NULL, u32_f32_rows, u32_bf16_rows, INT_ROWS(u32)}, {NULL, i32_f32_rows, i32_bf16_rows, INT_ROWS(i32)},
    {NULL, u64_f32_rows, u64_bf16_rows, INT_ROWS(u64)}, {NULL, i64_f32_rows, i64_bf16_rows, INT_ROWS(i64)},
    {NULL, f32_f32_rows, f32_bf16_rows, NULL, NULL},    {NULL, f64_f32_rows, f64_bf16_rows, NULL, NULL},
};

int cast_supported(int src_kind, int dst_kind) {
    return src_kind >= 0 && src_kind < N_SRC_KINDS && dst_kind >= 0 && dst_kind < N_DST_KINDS &&
           (dst_kind == KIND_SAME || converters[src_kind][dst_kind] != NULL);
}

/* Run over every plane of a copy, its two innermost axes: the body gets so and dof (the plane's first element
 * in the chunk and the batch), rows (its extent on axis ndim - 2, 1 for a 1-d copy), s_row and d_row (the
 * element strides of that axis) and run (the innermost extent). */
#define FOR_EACH_PLANE(ndim, ss, ds, c, ...)                                                                \
    do {                                                                                                   \
        const int64_t *ext_ = (c) + CP_EXTENT, *ss_ = (ss);                                                \
        int outer_ = (ndim) - 2; /* axes [0, outer_) are walked here */                                    \
        long long idx_[MAX_NDIM] = {0};                                                                    \
        size_t run = (size_t)ext_[(ndim) - 1];                                                             \
        size_t rows = outer_ >= 0 ? (size_t)ext_[outer_] : 1;                                              \
        long long s_row = outer_ >= 0 && ss_ != NULL ? ss_[outer_] : 0;                                    \
        long long d_row = outer_ >= 0 ? (ds)[outer_] : 0;                                                  \
        for (;;) {                                                                                         \
            long long so = (c)[CP_SRC_OFFSET], dof = (c)[CP_DST_OFFSET];                                   \
            for (int k_ = 0; k_ < outer_; k_++) {                                                          \
                so += idx_[k_] * (ss_ != NULL ? ss_[k_] : 0);                                              \
                dof += idx_[k_] * (ds)[k_];                                                                \
            }                                                                                              \
            __VA_ARGS__;                                                                                   \
            int k_ = outer_ - 1;                                                                           \
            for (; k_ >= 0; k_--) {                                                                        \
                if (++idx_[k_] < ext_[k_])                                                                 \
                    break;                                                                                 \
                idx_[k_] = 0;                                                                              \
            }                                                                                              \
            if (k_ < 0)                                                                                    \
                break;                                                                                     \
        }                                                                                                  \
    } while (0)

/* ``n`` elements of ``item`` bytes, ``stride`` elements apart from ``s``, next to each other at ``d``; bytes
 * reversed within each element when ``swap``. Next to each other already (stride 1) it is a straight loop
 * that vectorises (a byte swap needs AVX2's byte shuffles: hence HOT). */
#define GATHER(T, BSWAP)                                                                                     \
    do {                                                                                                     \
        T v;                                                                                                 \
        if (stride == 1) {                                                                                   \
            for (size_t i = 0; i < n; i++) {                                                                 \
                memcpy(&v, s + i * sizeof(T), sizeof(T));                                                    \
                v = swap ? BSWAP(v) : v;                                                                     \
                memcpy(d + i * sizeof(T), &v, sizeof(T));                                                    \
            }                                                                                                \
            return;                                                                                          \
        }                                                                                                    \
        for (size_t i = 0; i < n; i++, s += step) {                                                          \
            memcpy(&v, s, sizeof(T));                                                                        \
            v = swap ? BSWAP(v) : v;                                                                         \
            memcpy(d + i * sizeof(T), &v, sizeof(T));                                                        \
        }                                                                                                    \
        return;                                                                                              \
    } while (0)
#define NO_SWAP(v) (v)

HOT static void gather(const char *restrict s, char *restrict d, size_t n, size_t item, long long stride, int swap) {
    size_t step = (size_t)stride * item;
    switch (item) {
    case 1:
        GATHER(uint8_t, NO_SWAP);
    case 2:
        GATHER(uint16_t, __builtin_bswap16);
    case 4:
        GATHER(uint32_t, __builtin_bswap32);
    default:
        GATHER(uint64_t, __builtin_bswap64);
    }
}

/* Elements of a run that fill a piece of ``per_piece``, the first piece ending on a line of the batch, so no
 * line is split between two pieces (per_piece * d_item is a whole number of lines). */
static size_t piece_len(const char *d, size_t d_item, size_t per_piece, size_t left, int first) {
    size_t k = per_piece - (first ? ((uintptr_t)d & (LINE - 1)) / d_item : 0);
    return k < left ? k : left;
}

/* Bytes from one row of a plane to the next. A row stride counts only between rows: with one row (an axis of
 * extent 1) the checks let any stride through, and scaling it to bytes could overflow. With two rows or more
 * the checks keep stride * (rows - 1) inside the buffer, so the product fits. */
static ptrdiff_t row_step(long long stride, size_t rows, size_t item) {
    return rows > 1 ? (ptrdiff_t)(stride * (long long)item) : 0;
}

/* Cast every copy from the decoded chunk into the batch; runs without the GIL. Runs whose elements are not
 * next to each other in the chunk, or are in the other byte order, are gathered into an L1 buffer first. */
int place_copies(int kind, int swap, int ndim, const int64_t *ss, const int64_t *ds, const int64_t *copies,
                 long long ncopies, long long step, const char *chunk, const batch_dst *dst) {
    size_t s_item = (size_t)src_itemsize[kind];
    size_t d_item = dst_itemsize(dst, kind);
    /* an integer batch of the source's own type is a plain copy too */
    int same = dst->kind == KIND_SAME || (dst->kind == KIND_I32 && kind == K_I32) ||
               (dst->kind == KIND_I64 && kind == K_I64);
    int bad = 0;
    rows_fn rows_of = same ? copy_rows : converters[kind][dst->kind];
    size_t unit = same ? s_item : 1; /* copy_rows counts bytes */
    int stream = dst->stream;
    swap = swap && s_item > 1;
    int direct = ss[ndim - 1] == 1 && !swap;
    long long inner = ss[ndim - 1];
    char buf[STREAM_PIECE] __attribute__((aligned(LINE)));
    size_t per_buf = STREAM_PIECE / s_item;
    const int64_t *c = copies;
    for (long long i = 0; i < ncopies; i++, c += step) {
        FOR_EACH_PLANE(ndim, ss, ds, c, {
            const char *src = chunk + (size_t)so * s_item;
            char *d = dst->base + (size_t)dof * d_item;
            if (direct)
                bad |= rows_of(src, row_step(s_row, rows, s_item), d, row_step(d_row, rows, d_item), rows, run * unit,
                               stream);
            for (size_t r = 0; !direct && r < rows; r++) {
                const char *sr = src + (size_t)(r * s_row) * s_item;
                char *dr = d + (size_t)(r * d_row) * d_item;
                for (size_t left = run, k; left; left -= k) {
                    k = piece_len(dr, d_item, per_buf, left, left == run);
                    gather(sr, buf, k, s_item, inner, swap);
                    bad |= rows_of(buf, 0, dr, 0, 1, k * unit, stream);
                    sr += (size_t)inner * s_item * k, dr += d_item * k;
                }
            }
        });
    }
    return bad;
}

/* Write ``value`` (one element of ``d_item`` bytes, the batch's dtype) into every element of the copies. */
void fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                 const unsigned char *value, size_t d_item, const batch_dst *dst) {
    /* a piece of repeated values, copied (or streamed) run by run */
    char piece[STREAM_PIECE] __attribute__((aligned(LINE)));
    size_t per_piece = STREAM_PIECE / d_item;
    for (size_t i = 0; i < per_piece; i++)
        memcpy(piece + i * d_item, value, d_item);
    const int64_t *c = copies;
    for (long long i = 0; i < ncopies; i++, c += step) {
        FOR_EACH_PLANE(ndim, NULL, ds, c, {
            (void)so, (void)s_row;
            char *d = dst->base + (size_t)dof * d_item;
            int whole = run <= per_piece; /* each run from the piece's start */
            if (whole)
                copy_rows(piece, 0, d, row_step(d_row, rows, d_item), rows, run * d_item, dst->stream);
            for (size_t r = 0; !whole && r < rows; r++) {
                char *dr = d + (size_t)(r * d_row) * d_item;
                for (size_t left = run, k; left; left -= k) {
                    k = piece_len(dr, d_item, per_piece, left, left == run);
                    copy_rows(piece, 0, dr, 0, 1, k * d_item, dst->stream);
                    dr += k * d_item;
                }
            }
        });
    }
}

/* Streamed stores are weakly ordered: make them visible before the batch is handed on. */
void place_fence(const batch_dst *dst) {
#if defined(__SSE2__)
    if (dst->stream)
        _mm_sfence();
#else
    (void)dst;
#endif
}
