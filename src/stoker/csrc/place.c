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

size_t dst_itemsize(const batch_dst *dst, int src_kind) {
    return dst->kind == KIND_SAME ? (size_t)src_itemsize[src_kind] : dst->kind == KIND_F32 ? 4 : 2;
}

int cast_supported(int src_kind, int dst_kind) {
    return src_kind >= 0 && src_kind < N_SRC_KINDS && dst_kind >= 0 && dst_kind < N_DST_KINDS &&
           (dst_kind == KIND_SAME || converters[src_kind][dst_kind] != NULL);
}

/* The batch's end, in elements of ``d_item`` bytes, and every copy's last element in it; -1 when a copy
 * leaves the batch, its extents are not positive, or it writes more elements than the batch holds (with
 * zero strides any extent stays in bounds, and the work must stay bounded too). *s_last gets the last
 * source element per copy when ``ss`` is given. Products are checked for overflow before they are used. */
static int copy_bounds(int ndim, const int64_t *ss, const int64_t *ds, const int64_t *c, long long dst_elems,
                       long long *s_last_out) {
    long long s_last = c[0], d_last = c[1], step, count = 1;
    if (s_last < 0 || d_last < 0)
        return -1;
    for (int k = 0; k < ndim; k++) {
        long long sk = ss != NULL ? ss[k] : 0;
        if (c[2 + k] < 1 || sk < 0 || ds[k] < 0)
            return -1;
        if (__builtin_mul_overflow(count, c[2 + k], &count) || count > dst_elems)
            return -1;
        if (__builtin_mul_overflow(c[2 + k] - 1, sk, &step) || __builtin_add_overflow(s_last, step, &s_last))
            return -1;
        if (__builtin_mul_overflow(c[2 + k] - 1, ds[k], &step) || __builtin_add_overflow(d_last, step, &d_last))
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
    if (kind < 0 || kind >= N_SRC_KINDS || ndim < 1 || ndim > MAX_NDIM || ncopies < 0 || step < 2 + ndim)
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
        if (c[0] * item < span_start || (s_last + 1) * item > span_stop)
            return -1;
    }
    return 0;
}

int check_fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                      size_t d_item, const batch_dst *dst) {
    if (ndim < 1 || ndim > MAX_NDIM || ncopies < 0 || step < 2 + ndim || d_item == 0 || ds[ndim - 1] != 1)
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

/* Run over every innermost run of a copy: fn(src element offset, dst element offset, run) */
#define FOR_EACH_RUN(ndim, ss, ds, c, ...)                                                                  \
    do {                                                                                                   \
        const int64_t *ext_ = (c) + 2, *ss_ = (ss);                                                        \
        long long idx_[MAX_NDIM] = {0};                                                                    \
        size_t run = (size_t)ext_[(ndim) - 1];                                                             \
        for (;;) {                                                                                         \
            long long so = (c)[0], dof = (c)[1];                                                           \
            for (int k_ = 0; k_ < (ndim) - 1; k_++) {                                                      \
                so += idx_[k_] * (ss_ != NULL ? ss_[k_] : 0);                                              \
                dof += idx_[k_] * (ds)[k_];                                                                \
            }                                                                                              \
            __VA_ARGS__;                                                                                   \
            int k_ = (ndim) - 2;                                                                           \
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
 * reversed within each element when ``swap`` */
static void gather(const char *s, char *d, size_t n, size_t item, long long stride, int swap) {
    size_t step = (size_t)stride * item;
    switch (item * 2 + (swap != 0)) {
    case 2: case 3:
        for (size_t i = 0; i < n; i++, s += step)
            d[i] = *s;
        return;
    case 4: case 5: {
        uint16_t v;
        for (size_t i = 0; i < n; i++, s += step) {
            memcpy(&v, s, 2);
            v = swap ? __builtin_bswap16(v) : v;
            memcpy(d + 2 * i, &v, 2);
        }
        return;
    }
    case 8: case 9: {
        uint32_t v;
        for (size_t i = 0; i < n; i++, s += step) {
            memcpy(&v, s, 4);
            v = swap ? __builtin_bswap32(v) : v;
            memcpy(d + 4 * i, &v, 4);
        }
        return;
    }
    default: {
        uint64_t v;
        for (size_t i = 0; i < n; i++, s += step) {
            memcpy(&v, s, 8);
            v = swap ? __builtin_bswap64(v) : v;
            memcpy(d + 8 * i, &v, 8);
        }
        return;
    }
    }
}

/* Cast every copy from the decoded chunk into the batch; runs without the GIL. Runs whose elements are not
 * next to each other in the chunk, or are in the other byte order, are gathered into an L1 buffer first. */
void place_copies(int kind, int swap, int ndim, const int64_t *ss, const int64_t *ds, const int64_t *copies,
                  long long ncopies, long long step, const char *chunk, const batch_dst *dst) {
    size_t s_item = (size_t)src_itemsize[kind];
    size_t d_item = dst_itemsize(dst, kind);
    convert_fn convert = dst->kind == KIND_SAME ? NULL : converters[kind][dst->kind];
    swap = swap && s_item > 1;
    int direct = ss[ndim - 1] == 1 && !swap;
    long long inner = ss[ndim - 1];
    char buf[STREAM_PIECE] __attribute__((aligned(64)));
    size_t per_buf = STREAM_PIECE / s_item;
    const int64_t *c = copies;
    for (long long i = 0; i < ncopies; i++, c += step) {
        FOR_EACH_RUN(ndim, ss, ds, c, {
            const char *src = chunk + (size_t)so * s_item;
            char *d = dst->base + (size_t)dof * d_item;
            if (direct) {
                write_run(src, d, run, s_item, d_item, convert, dst->stream);
            } else {
                for (size_t left = run; left;) {
                    size_t k = left < per_buf ? left : per_buf;
                    gather(src, buf, k, s_item, inner, swap);
                    write_run(buf, d, k, s_item, d_item, convert, dst->stream);
                    src += (size_t)inner * s_item * k, d += d_item * k, left -= k;
                }
            }
        });
    }
}

/* Write ``value`` (one element of ``d_item`` bytes, the batch's dtype) into every element of the copies. */
void fill_copies(int ndim, const int64_t *ds, const int64_t *copies, long long ncopies, long long step,
                 const unsigned char *value, size_t d_item, const batch_dst *dst) {
    /* a piece of repeated values, as long as a streamed piece, copied (or streamed) run by run */
    char piece[STREAM_PIECE] __attribute__((aligned(64)));
    size_t per_piece = STREAM_PIECE / d_item;
    for (size_t i = 0; i < per_piece; i++)
        memcpy(piece + i * d_item, value, d_item);
    const int64_t *c = copies;
    for (long long i = 0; i < ncopies; i++, c += step) {
        FOR_EACH_RUN(ndim, NULL, ds, c, {
            (void)so;
            char *d = dst->base + (size_t)dof * d_item;
            for (size_t left = run; left;) {
                size_t k = left < per_piece ? left : per_piece;
                write_run(piece, d, k, d_item, d_item, NULL, dst->stream);
                d += k * d_item, left -= k;
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
