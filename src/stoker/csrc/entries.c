/* Disk-cache entries read by the workers as local files: a cache hit costs an open, an fstat, one pread into the
 * thread's scratch, a checksum and a close, then the chunk decodes from the scratch as a fetched one does from
 * its buffer. The layout is storage/diskcache.py's (ENTRY_HEADER_BYTES in the header); every field is checked
 * against the file's size and the caller's bounds before it is used, and the payload against its crc32c, so a
 * short, truncated, rewritten or corrupt entry is never decoded: ST_ENTRY, and the Python side fetches the
 * chunk from its store again (as it does for an entry its own reads find bad). The GPU decode's staged reads
 * (staging.c) judge and touch an entry through the same entry_read, so both paths agree on every entry.
 *
 * crc32c: where the CPU has AVX-512 and VPCLMULQDQ, carry-less multiplication folds 256 bytes a step (four
 * 512-bit registers, each 128-bit lane folded 2048 bits on: twice to four times the crc32 instruction's 8 bytes
 * a cycle, which a second epoch read from the cache spent a tenth of its CPU on), the last 16 bytes and the
 * tail by the crc32 instruction; else SSE4.2's crc32 instruction (three streams at once: the instruction's
 * latency is three cycles, one at a time reads a third as fast); else a table a byte at a time. All give what
 * the crc32c package gives, which wrote the entry's checksum.
 */
#include "stoker_native.h"
#include "again.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define POLY 0x82F63B78u /* crc32c, reflected */

/* A hit touches its entry (the LRU clock) only when the entry's mtime is at least this old, as relatime does for
 * atime: a hit within a minute of the entry's last use or write writes nothing (a futimens per entry of every
 * batch, each making the inode dirty); eviction then sees the uses of one minute as one. storage/diskcache.py's
 * SEEN_S, for markers, is the same minute. */
#define TOUCH_AFTER_S 60

#if defined(__APPLE__) /* the same time under another name */
#define ENTRY_MTIME(st) ((st)->st_mtimespec)
#define ENTRY_CTIME(st) ((st)->st_ctimespec)
#else
#define ENTRY_MTIME(st) ((st)->st_mtim)
#define ENTRY_CTIME(st) ((st)->st_ctim)
#endif

/* Entries whose payload this process checked, by file identity: a later read of the same file, unchanged
 * (device, inode, size, mtime and ctime all the same, and the header's crc), skips the payload's crc32c. A
 * cached epoch reads each entry many times (S1 reads its folder seven times over in an epoch): the crc was a
 * fifth of the engine's extra work over local files. Every way a file changes through the file system moves
 * its ctime (a write, a truncate, a rename onto its name makes another inode, utime too), and the kernel sets
 * it before it copies a write's bytes; so the file is stat'ed again after the read, and the check is skipped
 * only where both stats are the remembered one: a write in place that raced the read (another process's, a
 * damaged entry mended by hand) moved the second. A file is only remembered once its ctime is settled when
 * checked (VERIFIED_SETTLED_NS old where the file system keeps parts of a second, a hundred times a jiffy;
 * VERIFIED_SETTLED_COARSE_S where its times are whole seconds, or two), so a change after that lands on a later
 * time although timestamps are coarse. Trusted on local file systems only (on_local_fs: an allow-list): on NFS,
 * SMB, FUSE, 9p, Ceph or Lustre a server, another node or a daemon sets the times (its clock, its attribute
 * cache), so every read is checked there. What it does not see: a disk corrupting bytes beneath the page
 * cache after the check, in this process's lifetime, and a clock set back (a step of NTP, a restored
 * snapshot) by more than the settle time between a check and a write in place; a new process checks every entry once again, and
 * STOKER_CHECK_EVERY_READ=1 (true, yes) checks at every read. Direct-mapped slots (a collision forgets the older
 * one: it is checked again), taken with trylock only: a reader never waits on another, and a forked child
 * whose parent held the lock checks every entry. */
#define VERIFIED_SLOTS 16384 /* a power of two */
#define VERIFIED_SETTLED_NS 100000000LL
#define VERIFIED_SETTLED_COARSE_S 3
typedef struct {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
    uint32_t crc;
    int used;
} verified_entry;
static verified_entry verified[VERIFIED_SLOTS];
static pthread_mutex_t verified_lock = PTHREAD_MUTEX_INITIALIZER;
static long long verified_skips; /* payload checks skipped (entry_checks_skipped); atomic adds */
/* STOKER_CHECK_EVERY_READ, read by crc32c_init (at the module's init, the GIL held); -1 before: no memo */
static int check_every_read = -1;

static int env_true(const char *name) {
    const char *v = getenv(name);
    return v != NULL && (strcmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0);
}

static size_t verified_slot(const struct stat *st) {
    uint64_t h = ((uint64_t)st->st_ino * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)st->st_dev * 0xC2B2AE3D27D4EB4Full);
    return (size_t)(h >> 32) & (VERIFIED_SLOTS - 1);
}

static int same_time(struct timespec a, struct timespec b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }

/* Whether the file ``st`` whose header says ``crc`` was checked before, unchanged since */
static int verified_before(const struct stat *st, uint32_t crc) {
    if (check_every_read != 0 || pthread_mutex_trylock(&verified_lock) != 0)
        return 0;
    const verified_entry *v = &verified[verified_slot(st)];
    int hit = v->used && v->dev == st->st_dev && v->ino == st->st_ino && v->size == st->st_size &&
              same_time(v->mtime, ENTRY_MTIME(st)) && same_time(v->ctime, ENTRY_CTIME(st)) && v->crc == crc;
    pthread_mutex_unlock(&verified_lock);
    if (hit)
        __atomic_add_fetch(&verified_skips, 1, __ATOMIC_RELAXED);
    return hit;
}

/* Remember the file ``st`` (open at ``fd``), its payload just found sound against ``crc``, where its ctime is
 * settled and its file system trusted */
static void remember_verified(int fd, const struct stat *st, uint32_t crc) {
    struct timespec now;
#if defined(CLOCK_REALTIME_COARSE) /* the clock the kernel stamps files with (a jiffy behind the fine one) */
    int clock = CLOCK_REALTIME_COARSE;
#else
    int clock = CLOCK_REALTIME;
#endif
    if (check_every_read != 0 || clock_gettime(clock, &now) != 0)
        return;
    struct timespec ct = ENTRY_CTIME(st);
    long long age_ns = ((long long)now.tv_sec - (long long)ct.tv_sec) * 1000000000LL + (now.tv_nsec - ct.tv_nsec);
    int coarse = ct.tv_nsec == 0 && ENTRY_MTIME(st).tv_nsec == 0; /* (ns-resolution times of 0 by chance: safe) */
    if (age_ns < (coarse ? VERIFIED_SETTLED_COARSE_S * 1000000000LL : VERIFIED_SETTLED_NS) || !on_local_fs(fd) ||
        pthread_mutex_trylock(&verified_lock) != 0)
        return;
    verified[verified_slot(st)] = (verified_entry){.dev = st->st_dev, .ino = st->st_ino, .size = st->st_size,
                                                   .mtime = ENTRY_MTIME(st), .ctime = ENTRY_CTIME(st), .crc = crc,
                                                   .used = 1};
    pthread_mutex_unlock(&verified_lock);
}

/* Whether two stats of one open file say it did not change between them */
static int same_file(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
           same_time(ENTRY_MTIME(a), ENTRY_MTIME(b)) && same_time(ENTRY_CTIME(a), ENTRY_CTIME(b));
}

long long entry_checks_skipped(void) { return __atomic_load_n(&verified_skips, __ATOMIC_RELAXED); }

/* Whether an entry last changed at ``st``'s mtime is to be touched now (see TOUCH_AFTER_S); one dated in the
 * future (another host's clock) is touched, so it does not outlive the rest. */
static int to_touch(const struct stat *st) {
    struct timespec now;
    if (clock_gettime(CLOCK_REALTIME, &now) != 0)
        return 1;
    long long age = (long long)now.tv_sec - (long long)ENTRY_MTIME(st).tv_sec;
    return age >= TOUCH_AFTER_S || age < 0;
}

static uint32_t table[256];

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[n] = c;
    }
}

static uint32_t crc_soft(uint32_t crc, const unsigned char *p, size_t n) {
    while (n--)
        crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* a(x) * b(x) modulo the polynomial (both reflected), for joining the streams' checksums */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^bits modulo the polynomial (reflected) */
static uint32_t xpow(unsigned long long bits) {
    uint32_t p = 1u << 31, x = 1u << 30; /* p: x^0; x: x^1, squared on */
    while (bits) {
        if (bits & 1)
            p = multmodp(x, p);
        x = multmodp(x, x);
        bits >>= 1;
    }
    return p;
}

/* x^(8 n) modulo the polynomial: what appending n zero bytes multiplies a crc by */
static uint32_t zeros_op(size_t n) { return xpow((unsigned long long)n * 8); }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HAVE_HW 1
/* the three streams' length: long enough that joining them (a multiplication each) costs nothing */
#define STREAM 8192

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    static uint32_t shift; /* zeros_op(STREAM), set once (the same value by any thread that races to set it) */
    uint32_t op = __atomic_load_n(&shift, __ATOMIC_RELAXED);
    if (op == 0) {
        op = zeros_op(STREAM);
        __atomic_store_n(&shift, op, __ATOMIC_RELAXED);
    }
    while (n >= 3 * STREAM) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        for (size_t k = 0; k < STREAM; k += 8) {
            uint64_t v0, v1, v2;
            memcpy(&v0, p + k, 8);
            memcpy(&v1, p + STREAM + k, 8);
            memcpy(&v2, p + 2 * STREAM + k, 8);
            c0 = _mm_crc32_u64(c0, v0);
            c1 = _mm_crc32_u64(c1, v1);
            c2 = _mm_crc32_u64(c2, v2);
        }
        /* crc of A.B = shift(crc of A) ^ crc of B started at 0 (raw register values, no final inversion) */
        crc = multmodp(op, multmodp(op, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * STREAM;
        n -= 3 * STREAM;
    }
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--)
        crc = _mm_crc32_u8(crc, *p++);
    return crc;
}
#endif

#ifdef HAVE_HW
#include <immintrin.h>
#define FOLD_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))
/* shorter than this, the crc32 instruction alone (the folding's set-up and reduction cost more than they save) */
#define FOLD_MIN 512

/* The folding constants for a distance of d bits: a 128-bit lane (its low 64 bits the earlier bytes, higher
 * powers) times x^d is congruent to lo * x^(d+32) + hi * x^(d-32) in the reflected, shifted-by-one form that
 * PCLMULQDQ's product of reflected operands needs: {x^(d+32) mod P, x^(d-32) mod P}, each reflected and << 1. */
static void fold_consts(unsigned d, uint64_t k[2]) {
    k[0] = (uint64_t)xpow(d + 32) << 1;
    k[1] = (uint64_t)xpow(d - 32) << 1;
}

/* k[0]: 2048 bits (the loop), k[1..3]: 1536, 1024, 512 (four registers into one; also the 64-byte steps),
 * k[4..6]: 384, 256, 128 (a register's four lanes into one; 128 also the 16-byte steps). Set once. */
static uint64_t fold_k[7][2]; /* made by choose_crc_path, once, when it chooses the folding */

static void make_fold_k(void) {
    static const unsigned d[7] = {2048, 1536, 1024, 512, 384, 256, 128};
    for (int i = 0; i < 7; i++)
        fold_consts(d[i], fold_k[i]);
}

FOLD_TARGET static inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     next, 0x96);
}

/* Both foldings' 128-bit steps and their end, in PCLMULQDQ alone (inlined into either folding; where it has
 * AVX-512, the compiler makes fold128's two XORs one ternary-logic step, as fold512 spells it) */
#define FOLD128_TARGET __attribute__((target("pclmul,sse4.2")))

FOLD128_TARGET static inline __m128i fold128(__m128i x, const uint64_t k[2], __m128i next) {
    __m128i kk = _mm_set_epi64x((long long)k[1], (long long)k[0]);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11)), next);
}

/* y (the registers folded into 16 bytes) folded on over the 16-byte steps left (k: 128 bits' constants), the
 * CRC of the folded 16 bytes from 0, then the crc32 instruction over the tail (under 16 bytes) */
FOLD128_TARGET static inline uint32_t fold_end(__m128i y, const uint64_t k[2], const unsigned char *p, size_t n) {
    while (n >= 16) {
        y = fold128(y, k, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(y));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(y, 1));
    return n ? crc_hw((uint32_t)c, p, n) : (uint32_t)c;
}

/* crc (raw register, not inverted) continued over n >= FOLD_MIN bytes at p: the CRC of the message is kept as
 * the CRC of the folded registers followed by the bytes not read yet (the crc XORed into the first 4 bytes) */
FOLD_TARGET static uint32_t crc_fold(uint32_t crc, const unsigned char *p, size_t n) {
#define K512(i) _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_k[i][1], (long long)fold_k[i][0]))
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    __m512i a1 = _mm512_loadu_si512(p + 64), a2 = _mm512_loadu_si512(p + 128), a3 = _mm512_loadu_si512(p + 192);
    p += 256;
    n -= 256;
    __m512i k = K512(0);
    while (n >= 256) {
        a0 = fold512(a0, k, _mm512_loadu_si512(p));
        a1 = fold512(a1, k, _mm512_loadu_si512(p + 64));
        a2 = fold512(a2, k, _mm512_loadu_si512(p + 128));
        a3 = fold512(a3, k, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    /* a0..a2 moved on to a3's place (192, 128 and 64 bytes on) */
    __m512i x = fold512(a0, K512(1), fold512(a1, K512(2), fold512(a2, K512(3), a3)));
    k = K512(3);
    while (n >= 64) {
        x = fold512(x, k, _mm512_loadu_si512(p));
        p += 64;
        n -= 64;
    }
#undef K512
    /* the four lanes into the last one (48, 32 and 16 bytes on) */
    __m128i y = fold128(_mm512_extracti32x4_epi32(x, 0), fold_k[4],
                        fold128(_mm512_extracti32x4_epi32(x, 1), fold_k[5],
                                fold128(_mm512_extracti32x4_epi32(x, 2), fold_k[6], _mm512_extracti32x4_epi32(x, 3))));
    return fold_end(y, fold_k[6], p, n);
}

/* The same folding in 256-bit registers, where the CPU has VPCLMULQDQ but not AVX-512 (AMD's Zen 3, Intel's
 * Alder Lake): four registers fold 128 bytes a step (each 128-bit lane 1024 bits on), about twice the crc32
 * instruction's 8 bytes a cycle (a second epoch of scenario 1 read from the cache spent a tenth of its CPU on
 * the instruction's checksums). Two XORs where AVX-512 has one ternary-logic step. */
#define FOLD256_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

/* k[0]: 1024 bits (the loop), k[1..3]: 768, 512, 256 (four registers into one; 256 also the 32-byte steps),
 * k[4]: 128 (a register's two lanes into one; also the 16-byte steps). Set once. */
static uint64_t fold256_k[5][2]; /* made by choose_crc_path, once, when it chooses this folding */

static void make_fold256_k(void) {
    static const unsigned d[5] = {1024, 768, 512, 256, 128};
    for (int i = 0; i < 5; i++)
        fold_consts(d[i], fold256_k[i]);
}

FOLD256_TARGET static inline __m256i fold256(__m256i x, __m256i k, __m256i next) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00),
                                             _mm256_clmulepi64_epi128(x, k, 0x11)), next);
}

/* crc_fold's way in 256-bit registers: crc (raw register) continued over n >= FOLD_MIN bytes at p */
FOLD256_TARGET static uint32_t crc_fold256(uint32_t crc, const unsigned char *p, size_t n) {
#define K256(i) _mm256_broadcastsi128_si256(_mm_set_epi64x((long long)fold256_k[i][1], (long long)fold256_k[i][0]))
#define LOAD256(q) _mm256_loadu_si256((const __m256i *)(q))
    /* the crc XORed into the first 4 bytes (the rest of the register zero) */
    __m256i a0 = _mm256_xor_si256(LOAD256(p), _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)crc));
    __m256i a1 = LOAD256(p + 32), a2 = LOAD256(p + 64), a3 = LOAD256(p + 96);
    p += 128;
    n -= 128;
    __m256i k = K256(0);
    while (n >= 128) {
        a0 = fold256(a0, k, LOAD256(p));
        a1 = fold256(a1, k, LOAD256(p + 32));
        a2 = fold256(a2, k, LOAD256(p + 64));
        a3 = fold256(a3, k, LOAD256(p + 96));
        p += 128;
        n -= 128;
    }
    /* a0..a2 moved on to a3's place (96, 64 and 32 bytes on) */
    __m256i x = fold256(a0, K256(1), fold256(a1, K256(2), fold256(a2, K256(3), a3)));
    k = K256(3);
    while (n >= 32) {
        x = fold256(x, k, LOAD256(p));
        p += 32;
        n -= 32;
    }
#undef LOAD256
#undef K256
    /* the two lanes into the last one (16 bytes on) */
    return fold_end(fold128(_mm256_castsi256_si128(x), fold256_k[4], _mm256_extracti128_si256(x, 1)), fold256_k[4], p,
                    n);
}
#endif

/* the way crc32c_of goes, chosen once a process: 0 the table, 1 the crc32 instruction (SSE4.2), 2 and the folding
 * in 512-bit registers, 3 and the folding in 256-bit ones */
static int crc_path = -1;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* STOKER_NO_CRC_FOLD=1 (or true, yes: any case) keeps to the crc32 instruction; unset, 0, false, no do not */
static int fold_refused(void) { return env_true("STOKER_NO_CRC_FOLD"); }

static void choose_crc_path(void) {
    int path = 0;
#ifdef HAVE_HW
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        path = 1;
    if (path && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") && !fold_refused())
        path = 2;
    else if (path && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") &&
             __builtin_cpu_supports("pclmul") && !fold_refused())
        path = 3;
    if (path == 2)
        make_fold_k();
    if (path == 3)
        make_fold256_k();
#endif
    if (path == 0)
        make_table();
    crc_path = path;
    check_every_read = env_true("STOKER_CHECK_EVERY_READ");
}

/* The module's init calls this with the GIL held, so the environment is read there, once, and never on the
 * engine's worker threads (getenv beside a setenv is a data race); later calls only return. */
void crc32c_init(void) { pthread_once(&crc_once, choose_crc_path); }

const char *crc32c_path(void) {
    crc32c_init();
    return crc_path == 3 ? "fold256" : crc_path == 2 ? "fold" : crc_path == 1 ? "sse42" : "table";
}

uint32_t crc32c_of(uint32_t crc, const void *data, size_t n) {
    uint32_t c = ~crc;
    crc32c_init(); /* done at module init: here, a load */
#ifdef HAVE_HW
    if (crc_path == 2 && n >= FOLD_MIN)
        return ~crc_fold(c, data, n);
    if (crc_path == 3 && n >= FOLD_MIN)
        return ~crc_fold256(c, data, n);
    if (crc_path)
        return ~crc_hw(c, data, n);
#endif
    return ~crc_soft(c, data, n);
}

static unsigned long long le(const unsigned char *p, int n) {
    unsigned long long v = 0;
    for (int k = n - 1; k >= 0; k--)
        v = v << 8 | p[k];
    return v;
}

/* the header (ENTRY_HEADER_BYTES, then the ident as the file holds it) of an entry whose payload is
 * ``payload_len`` bytes (by its file's size): 0, ENTRY_LAYOUT (magic, the ident's or payload's length), or
 * ENTRY_OTHER_IDENT (the ident of the right length but another: a hash collision's entry) */
static int check_header(const unsigned char *h, const char *ident, size_t ident_len, size_t payload_len) {
    if (memcmp(h, "STKC1\n", 6) != 0 || le(h + 12, 4) != ident_len || le(h + 16, 8) != payload_len)
        return ENTRY_LAYOUT;
    if (ident_len && memcmp(h + ENTRY_HEADER_BYTES, ident, ident_len) != 0)
        return ENTRY_OTHER_IDENT;
    return 0;
}

int entry_judge(const unsigned char *raw, size_t len, const char *ident, size_t ident_len) {
    if (len < ENTRY_HEADER_BYTES || len - ENTRY_HEADER_BYTES < ident_len)
        return ENTRY_SIZE;
    size_t head = ENTRY_HEADER_BYTES + ident_len, n = len - head;
    int why = check_header(raw, ident, ident_len, n);
    uint32_t crc = why ? 0 : crc32c_of(crc32c_of(0, raw + ENTRY_HEADER_BYTES, ident_len), raw + head, n);
    return why ? why : crc != (uint32_t)le(raw + 8, 4) ? ENTRY_CHECKSUM : 0;
}

/* the LRU clock (stoker_native.h): a hit is a use, at most once a minute (see TOUCH_AFTER_S) */
void entry_touch(int fd, const struct stat *st) {
    if (to_touch(st))
        (void)futimens(fd, NULL);
}

/* n bytes at ``at`` of the entry into buf (stoker_native.h). O_NONBLOCK changes nothing for a regular file on a
 * local file system; a file system that honours it answers EAGAIN: then, once, the descriptor is made blocking
 * and the read made again. Not made blocking up front: an fcntl per entry read, for file systems that seldom
 * need it. */
int entry_pread(int fd, char *buf, size_t n, size_t at, int *blocking, long long *nread) {
    size_t done = 0;
    while (done < n) {
        ssize_t got = pread(fd, buf + done, n - done, (off_t)(at + done));
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !*blocking) {
            *blocking = 1;
            if (fcntl(fd, F_SETFL, 0) == 0) /* (only O_NONBLOCK was set: no F_GETFL first) */
                continue;
        }
        if (got <= 0) {
            *nread += (long long)done;
            return got < 0 ? ENTRY_UNREADABLE : ENTRY_SIZE;
        }
        done += (size_t)got;
    }
    *nread += (long long)done;
    return 0;
}

int entry_read(const char *path, entry_reading *r) {
    size_t head = ENTRY_HEADER_BYTES + r->ident_len;
    int why = 0, blocking = 0, checked = 0;
    r->payload_len = 0;
    r->nread = 0;
    r->preads = 0;
    /* O_NONBLOCK: a FIFO planted at an entry's name must not hang the open (it is no regular file) */
    int fd = AGAIN(open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
    if (fd < 0)
        return errno == ENOENT || errno == ENOTDIR ? ENTRY_GONE : ENTRY_UNREADABLE;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        why = ENTRY_UNREADABLE;
        goto out;
    }
    /* the file's size bounds every read: at least the header and ident, at most they and the bound more (and
     * exactly the payload expected, where one is: the room placed for it) */
    if (st.st_size < 0 || (unsigned long long)st.st_size < head ||
        (unsigned long long)st.st_size - head > r->max_payload ||
        (r->expect_payload >= 0 && (unsigned long long)st.st_size - head != (unsigned long long)r->expect_payload)) {
        why = ENTRY_SIZE;
        goto out;
    }
    size_t n = (size_t)st.st_size - head;
    r->preads++;
    if (r->whole) { /* one read of the whole file (the payload's room follows the header's) */
        why = entry_pread(fd, (char *)r->head, head + n, 0, &blocking, &r->nread);
    } else { /* the header first, checked before the payload is read to its own place */
        why = entry_pread(fd, (char *)r->head, head, 0, &blocking, &r->nread);
        if (!why)
            why = check_header(r->head, r->ident, r->ident_len, n);
        checked = 1;
        if (!why) {
            r->preads++;
            why = entry_pread(fd, r->payload, n, head, &blocking, &r->nread);
        }
    }
    if (!why && !checked)
        why = check_header(r->head, r->ident, r->ident_len, n);
    if (!why) {
        uint32_t want = (uint32_t)le(r->head + 8, 4);
        /* the file stat'ed again now its bytes are read: a write in place during the read moved its ctime */
        struct stat after;
        int unchanged = check_every_read == 0 && fstat(fd, &after) == 0 && same_file(&st, &after);
        if (!unchanged || !verified_before(&st, want)) { /* (the header, ident included, was checked above) */
            uint32_t crc = crc32c_of(0, r->head + ENTRY_HEADER_BYTES, r->ident_len);
            if (crc32c_of(crc, r->payload, n) != want)
                why = ENTRY_CHECKSUM;
            else if (unchanged)
                remember_verified(fd, &st, want);
        }
    }
    if (!why) {
        entry_touch(fd, &st);
        r->payload_len = n;
    }
out:
    close(fd);
    return why;
}

int read_entry(chunk_io *job, const char *path, const char *ident, size_t ident_len, char *buf, size_t max_stored,
               const char **payload, size_t *payload_len) {
    long long t0 = now_ns();
    size_t head = ENTRY_HEADER_BYTES + ident_len;
    entry_reading r = {.ident = ident, .ident_len = ident_len, .max_payload = max_stored, .expect_payload = -1,
                       .head = (unsigned char *)buf, .payload = buf + head, .whole = 1};
    int why = entry_read(path, &r);
    job->nread += r.nread;
    if (why) {
        job->status = ST_ENTRY;
        job->detail = why;
    } else {
        *payload = r.payload;
        *payload_len = r.payload_len;
    }
    job->read_ns += now_ns() - t0;
    return why ? -1 : 0;
}

/* ---- writing: a batch of entries with no Python between their system calls ----
 *
 * storage/diskcache.py holds the folder's lock (flock on v1/.index) and has reserved the batch's room in the
 * running total; this makes the files. Each entry goes to a fresh hidden sibling named as fsutil.py's
 * replace_atomically names them (".<name>.tmp-<host>-<pid>-<8 hex>", so a dead writer's is found and removed
 * by the next scan), created O_EXCL | O_NOFOLLOW (nothing planted there is written through: another name is
 * drawn), written whole (header, ident, payload in one writev loop), closed and renamed onto its name: a reader
 * sees no entry or a whole one. No fsync, as the Python writer: an entry a crash left short fails its checksum.
 */

/* what a file or folder takes on disk: its blocks, or its size where the file system reports fewer */
static long long allocated_of(const struct stat *st) {
    long long blocks = (long long)st->st_blocks * 512;
    long long size = S_ISDIR(st->st_mode) ? 0 : (long long)st->st_size;
    return blocks > size ? blocks : size;
}

static uint64_t next_random(uint64_t *state) { /* xorshift64*: names drawn from the caller's random seed */
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* The writer's system calls are made again while a signal interrupts them (again.h): failed, the entry, the rest
 * of its batch and every later write of the process (the cache turned off) were lost to a signal. */

/* close is never made again: Linux releases the descriptor even when a signal interrupts it (POSIX leaves its
 * state unspecified), and another thread may have been given that number since. EINTR counts as closed (what
 * was written stands or fails its checksum, as an entry not fsynced does); other errors as failures. 0 or
 * -errno. */
static int close_once(int fd) {
    return close(fd) != 0 && errno != EINTR ? -errno : 0;
}

static int write_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        ssize_t w = writev(fd, iov, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -errno;
        if (w == 0)
            return -EIO;
        size_t left = (size_t)w;
        while (n > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

/* how often a marker's O_EXCL open is tried where it failed EEXIST and the lstat then found nothing */
#define MARKER_TRIES 3

/* one entry's file at its final name (the folder exists): 1 written, or -errno (its temporary file removed) */
static int write_one(entry_write *e, const char *tag, uint64_t *state, char *tmp, size_t dir_len) {
    const char *base = e->path + dir_len + 1;
    int fd = -1;
    if (e->payload == NULL) { /* a marker: an empty file made at its name in one step */
        /* made meanwhile: the same marker, where a regular file (see write_entries); gone again before the
         * lstat (an outside cleaner removed it): tried again, a few times, then -ENOENT, a marker not made (the
         * caller's loss), never -EEXIST (the cache off in the process for something not there) */
        for (int attempt = 0; fd < 0; attempt++) {
            if (attempt == MARKER_TRIES)
                return -ENOENT;
            fd = AGAIN(open(e->path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666));
            if (fd < 0 && errno != EEXIST)
                return -errno;
            if (fd < 0) {
                struct stat st;
                if (AGAIN(lstat(e->path, &st)) == 0)
                    return S_ISREG(st.st_mode) ? 0 : -EEXIST;
                if (errno != ENOENT)
                    return -errno;
            }
        }
    } else {
        for (int attempt = 0; fd < 0; attempt++) {
            if (attempt == 100) /* as fsutil's _fresh: never reuse what sits at a name */
                return -EEXIST;
            int len = snprintf(tmp, PATH_MAX, "%.*s/.%s.tmp-%s-%08x", (int)dir_len, e->path, base, tag,
                               (unsigned)(next_random(state) >> 32));
            if (len < 0 || len >= PATH_MAX)
                return -ENAMETOOLONG;
            fd = AGAIN(open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666));
            if (fd < 0 && errno != EEXIST)
                return -errno;
        }
        unsigned char head[ENTRY_HEADER_BYTES] = {'S', 'T', 'K', 'C', '1', '\n', 0, 0};
        uint32_t crc = crc32c_of(crc32c_of(0, e->ident, e->ident_len), e->payload, e->payload_len);
        unsigned long long lens[2] = {e->ident_len, e->payload_len};
        for (int k = 0; k < 4; k++)
            head[8 + k] = (unsigned char)(crc >> (8 * k));
        for (int k = 0; k < 4; k++)
            head[12 + k] = (unsigned char)(lens[0] >> (8 * k));
        for (int k = 0; k < 8; k++)
            head[16 + k] = (unsigned char)(lens[1] >> (8 * k));
        struct iovec iov[3] = {{head, sizeof head},
                               {(void *)e->ident, e->ident_len},
                               {(void *)e->payload, e->payload_len}};
        int bad = write_all(fd, iov, 3);
        struct stat st;
        if (bad == 0 && AGAIN(fstat(fd, &st)) != 0)
            bad = -errno;
        int closed = close_once(fd); /* a network file system may report a failed write only here */
        if (bad == 0)
            bad = closed;
        if (bad == 0 && AGAIN(rename(tmp, e->path)) != 0)
            bad = -errno;
        if (bad != 0) {
            (void)AGAIN(unlink(tmp));
            return bad;
        }
        e->allocated = allocated_of(&st);
        return 1;
    }
    struct stat st;
    int bad = AGAIN(fstat(fd, &st)) != 0 ? -errno : 0;
    int closed = close_once(fd);
    if (bad == 0)
        bad = closed;
    if (bad != 0) {
        (void)AGAIN(unlink(e->path));
        return bad;
    }
    e->allocated = allocated_of(&st);
    return 1;
}

/* the disk the folder ``path`` (its first ``len`` bytes) takes now; 0 when it is not there */
static long long folder_allocated(const char *path, size_t len, char *buf) {
    struct stat st;
    memcpy(buf, path, len);
    buf[len] = '\0';
    return AGAIN(lstat(buf, &st)) == 0 ? allocated_of(&st) : 0;
}

int write_entries(entry_write *items, size_t n, const char *tag, uint64_t seed, long long *grown) {
    /* each subfolder the batch touches: the entry that first named it, and what it took before */
    struct folder {
        size_t first, len;
        long long before;
    } *folders = malloc((n ? n : 1) * sizeof *folders);
    char *tmp = malloc(2 * PATH_MAX); /* a temporary name; a folder's name */
    uint64_t state = seed ? seed : 0x9E3779B97F4A7C15ULL;
    size_t n_folders = 0, root_len = 0, root_of = 0;
    long long root_before = 0, total = 0;
    int bad = 0;
    *grown = 0;
    for (size_t i = 0; i < n; i++) {
        items[i].result = 0;
        items[i].allocated = 0;
    }
    if (tmp == NULL || folders == NULL) {
        free(tmp);
        free(folders);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        entry_write *e = &items[i];
        size_t path_len = strlen(e->path);
        const char *slash = strrchr(e->path, '/');
        size_t dir_len = slash == NULL ? 0 : (size_t)(slash - e->path);
        const char *up = NULL; /* the slash before the subfolder's name */
        for (size_t k = dir_len; k-- > 0 && up == NULL;)
            if (e->path[k] == '/')
                up = e->path + k;
        /* <root>/<subfolder>/<name>, each part not empty, short enough for a temporary sibling's name too */
        if (slash == NULL || slash[1] == '\0' || up == NULL || up == e->path || up + 1 == slash ||
            path_len + 64 >= PATH_MAX) {
            bad = e->result = -EINVAL;
            break;
        }
        size_t f = 0;
        while (f < n_folders && !(folders[f].len == dir_len && memcmp(items[folders[f].first].path, e->path,
                                                                      dir_len) == 0))
            f++;
        if (f == n_folders) { /* first seen in this batch: there (a real folder), or made now */
            struct stat st;
            memcpy(tmp, e->path, dir_len);
            tmp[dir_len] = '\0';
            long long before = 0;
            if (AGAIN(lstat(tmp, &st)) == 0) {
                if (!S_ISDIR(st.st_mode)) { /* a link or a file planted there: never written through */
                    bad = e->result = -ENOTDIR;
                    break;
                }
                before = allocated_of(&st);
            } else if (errno == ENOENT) {
                if (root_len == 0) { /* the root grows by the subfolders made: measured before the first */
                    root_of = i;
                    root_len = (size_t)(up - e->path);
                    root_before = folder_allocated(e->path, root_len, tmp + PATH_MAX);
                }
                /* only here, under the folder's lock, are subfolders made: eviction may remove an empty one */
                if (AGAIN(mkdir(tmp, 0777)) != 0 && errno != EEXIST) {
                    bad = e->result = -errno;
                    break;
                }
            } else {
                bad = e->result = -errno;
                break;
            }
            folders[f].first = i;
            folders[f].len = dir_len;
            folders[f].before = before;
            n_folders++;
        }
        struct stat st;
        if (AGAIN(lstat(e->path, &st)) == 0) {
            if (S_ISREG(st.st_mode))
                continue; /* another process wrote it meanwhile (or it came twice in this batch) */
            /* a folder, a link or a FIFO planted at the entry's name: no entry (readers open a regular file
             * only, never through a link), and nothing to remove or write through. Not "there already", which
             * left its key fetched at every read with no word said: a failure (the caller's one warning, the
             * cache off in this process, reads uncached) */
            bad = e->result = -EEXIST;
            break;
        }
        if (errno != ENOENT) {
            bad = e->result = -errno;
            break;
        }
        e->result = write_one(e, tag, &state, tmp, dir_len);
        if (e->result < 0) {
            bad = e->result;
            break;
        }
        total += e->allocated;
    }
    /* what the disk gave: the files written, their subfolders' growth, the root's where subfolders were made */
    for (size_t f = 0; f < n_folders; f++)
        total += folder_allocated(items[folders[f].first].path, folders[f].len, tmp) - folders[f].before;
    if (root_len)
        total += folder_allocated(items[root_of].path, root_len, tmp) - root_before;
    *grown = total;
    free(tmp);
    free(folders);
    return bad;
}
