/* Reading stored chunks: open regular files only, check a shard's identity before and after, pread loops.
 *
 * Files are opened non-blocking and refused unless regular: opening a FIFO without O_NONBLOCK waits for
 * a writer forever (the thread could never be stopped), and O_NONBLOCK changes nothing for regular files on
 * local file systems (where one honours it, a read that says EAGAIN makes the descriptor blocking: read_range).
 *
 * A chunk already in memory (job->in_memory: fetched from a store) goes through the same calls, so every
 * codec reads it exactly as it reads a file of the buffer's size: "opening" checks its size against the
 * stored-size bound, the codecs read its bytes where they are (stored_bytes: the buffer itself, never a
 * copy), "reads" only check that the bytes asked for lie inside it (past it: SHORT, as a file that ends
 * early), and "closing" does nothing.
 */
#include "stoker_native.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/vfs.h>
#elif defined(__APPLE__)
#include <sys/mount.h>
#include <sys/param.h>
#endif

long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* read_range for a chunk in memory: nothing is copied (the codecs read the buffer, see stored_bytes); only
 * checks that bytes [base + lo, base + hi) lie inside the buffer, as a read of a file of its size would */
static int read_memory(chunk_io *job, size_t lo, size_t hi) {
    unsigned long long base = job->offset < 0 ? 0 : (unsigned long long)job->offset;
    unsigned long long len = job->mem == NULL ? 0 : (unsigned long long)job->mem_len;
    size_t done = lo;
    if (lo < hi && base <= len && lo < len - base) {
        size_t n = hi - lo;
        if (n > len - base - lo)
            n = (size_t)(len - base - lo);
        job->nread += (long long)n;
        done = lo + n;
    }
    if (done != hi) {
        job->status = ST_SHORT;
        job->detail = (long long)done;
        return -1;
    }
    return 0;
}

const char *stored_bytes(const chunk_io *job, char *scratch) {
    if (!job->in_memory)
        return scratch;
    return job->mem + (job->offset < 0 ? 0 : job->offset);
}

/* Read bytes [lo, hi) of the stored chunk into buf + lo (a chunk in memory: check them, see read_memory);
 * 0 on success, else sets the job's status (OS error, or SHORT: the file ends early). */
int read_range(chunk_io *job, int fd, char *buf, size_t lo, size_t hi) {
    if (job->in_memory)
        return read_memory(job, lo, hi);
    off_t base = job->offset < 0 ? 0 : (off_t)job->offset;
    size_t done = lo;
    int blocking = 0;
    while (done < hi) {
        ssize_t got = pread(fd, buf + done, hi - done, base + (off_t)done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            /* a file system that honours O_NONBLOCK for regular files (some FUSE and network ones): made blocking
             * once and read again (as entries.c's entry_pread), not by an fcntl at every open. F_SETFL changes
             * only the status flags, and the open set none but O_NONBLOCK: no F_GETFL first. */
            if ((errno == EAGAIN || errno == EWOULDBLOCK) && !blocking) {
                blocking = 1;
                if (fcntl(fd, F_SETFL, 0) == 0)
                    continue;
                errno = EAGAIN;
            }
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

/* Read bytes [lo, hi) of the stored chunk into buf + lo, timing it into job->read_ns (see read_range). */
int read_timed(chunk_io *job, int fd, char *buf, size_t lo, size_t hi) {
    long long t = now_ns();
    int bad = read_range(job, fd, buf, lo, hi);
    job->read_ns += now_ns() - t;
    return bad;
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
static int same_file(const chunk_io *job, const struct stat *st) {
    return (unsigned long long)st->st_dev == job->dev && (unsigned long long)st->st_ino == job->ino &&
           (long long)st->st_size == job->size && ns_of(MTIME(st)) == job->mtime_ns &&
           ns_of(CTIME(st)) == job->ctime_ns;
}

/* 1 when the open file is on a local file system, whose pages and attributes are the file's own. A network
 * file system (NFS, SMB, Lustre, a FUSE mount) checks a file against its server at open and answers fstat from
 * a cache for a while, so there a shard rewritten from another machine is only seen by opening it anew: its
 * files are never kept open (see chunk_io.keep), and a disk-cache entry's crc is checked at every read (their
 * times are the server's: see entries.c's verified entries). Unknown file systems count as remote. */
int on_local_fs(int fd) {
#if defined(__linux__)
    struct statfs fs;
    if (fstatfs(fd, &fs) != 0)
        return 0;
    switch ((unsigned long)fs.f_type) {
    case 0xEF53UL:     /* ext2, ext3, ext4 */
    case 0x58465342UL: /* xfs */
    case 0x9123683EUL: /* btrfs */
    case 0x01021994UL: /* tmpfs */
    case 0x794C7630UL: /* overlayfs (containers) */
    case 0x2FC12FC1UL: /* zfs */
    case 0xF2F52010UL: /* f2fs */
    case 0xCA451A4EUL: /* bcachefs */
        return 1;
    default:
        return 0;
    }
#elif defined(__APPLE__)
    struct statfs fs;
    return fstatfs(fd, &fs) == 0 && (strcmp(fs.f_fstypename, "apfs") == 0 || strcmp(fs.f_fstypename, "hfs") == 0);
#else
    (void)fd;
    return 0;
#endif
}

/* Done with the chunk's file: kept open for the next chunk of it (job->keep), else closed. */
static void release_file(chunk_io *job, int fd) {
    if (job->keep) {
        job->kept = 1;
        job->fd = fd;
    } else {
        close(fd);
    }
}

/* Close the chunk's file after its reads (or keep it, see release_file). An inner chunk of a shard is checked
 * once more first: a shard rewritten in place while it was read may have given bytes of both versions, at the
 * old index's offsets. Then the job's status is ST_CHANGED (Python reads the index anew), the file is closed
 * and 1 is returned. */
int close_checked(chunk_io *job, int fd) {
    if (job->in_memory)
        return 0;
    int changed = 0;
    if (job->has_ident) {
        struct stat st;
        changed = fstat(fd, &st) != 0 || !same_file(job, &st);
    }
    if (changed) {
        close(fd);
        job->status = ST_CHANGED;
    } else {
        release_file(job, fd);
    }
    return changed;
}

/* Open the chunk's file and learn the stored chunk's size; -1 with the job's status set when it
 * cannot be read, is not a regular file, is not the shard file the job expects, or is larger than
 * ``max_stored`` (ST_TOO_BIG, detail: its size; a file's scratch holds that many bytes). */
/* Open the chunk's file and check it (regular, the identity expected; kept only on a local file system; left
 * non-blocking: read_range makes it blocking where a read says EAGAIN): its descriptor with job->file_size set,
 * or -1 with the job's status set. */
static int open_file(chunk_io *job) {
    int fd;
    do /* a signal may cut it short on a thread that does not block them (decode_files' caller) */
        fd = open(job->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    while (fd < 0 && errno == EINTR);
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
    if (job->has_ident && !same_file(job, &st)) {
        job->status = ST_CHANGED;
        close(fd);
        return -1;
    }
    if (job->keep && !on_local_fs(fd))
        job->keep = 0;
    job->file_size = (long long)st.st_size;
    return fd;
}

int open_chunk(chunk_io *job, size_t max_stored, size_t *size) {
    int fd;
    if (job->in_memory) { /* no file: a missing value (NULL) is a missing file, the buffer's size the file's */
        if (job->mem == NULL) {
            job->status = ST_MISSING;
            job->detail = ENOENT;
            return -1;
        }
        job->file_size = job->mem_len;
        fd = MEM_FD;
    } else if (job->reuse) { /* a shard's file, kept open since the thread's last chunk of it: checked after that */
        job->file_size = job->size;
        fd = job->fd;
    } else if ((fd = open_file(job)) < 0) {
        return -1;
    }
    /* an inner chunk of a shard: its index gave the size */
    *size = job->offset >= 0 ? (size_t)job->length : (size_t)job->file_size;
    if (*size > max_stored) {
        job->status = ST_TOO_BIG;
        job->detail = (long long)*size;
        if (fd != MEM_FD)
            release_file(job, fd);
        return -1;
    }
    return fd;
}
