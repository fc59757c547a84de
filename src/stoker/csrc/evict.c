/* The disk cache's eviction scan (storage/diskcache.py: DiskCache._evict; evict_entries there is its Python twin,
 * the same answers): every subfolder of the cache folder listed and every file in it measured (fstatat), then,
 * where the folder is over its bound, the least recently used entries unlinked, all with no Python between the
 * system calls. In Python each of them gave the GIL up and waited to get it back: 5,000 entries took 0.06 s on an
 * idle process and 0.46 s beside a thread busy in Python, the folder's lock held all along.
 *
 * Rules kept from the Python scan: an entry is a regular name of 32 lowercase hex digits in a subfolder; it is
 * unlinked only (a reader that opened it reads on); nothing is followed through a link (a link is counted as
 * what it is, a subfolder only if it is a real one); a subfolder left empty is removed (its block freed).
 */
#define _GNU_SOURCE
#include "evict.h"
#include "again.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>


#define ENTRY_NAME 32 /* hex digits of an entry's name */

#if defined(__APPLE__) /* the same times under another name (as io.c) */
#define MTIME(st) ((st)->st_mtimespec)
#else
#define MTIME(st) ((st)->st_mtim)
#endif

/* a + b (b >= 0: what a file or folder takes), exact (see evict_total): a total held at LLONG_MAX, less the
 * entries it evicts, then less the dead temporary files the caller removes, read as less than nothing (and the
 * Python twin, whose sum is exact, said otherwise) */
static evict_total add_total(evict_total a, long long b) {
#if defined(__SIZEOF_INT128__)
    return a + b;
#else
    long long s;
    return __builtin_add_overflow(a, b, &s) ? LLONG_MAX : s;
#endif
}

/* whether total + incoming passes bound (a total that wrapped would read as an empty folder: nothing evicted) */
static int over_bound(evict_total total, long long incoming, long long bound) {
#if defined(__SIZEOF_INT128__)
    return total + incoming > bound;
#else
    long long need;
    return __builtin_add_overflow(total, incoming, &need) ? incoming > 0 : need > bound;
#endif
}

typedef struct {
    long long mtime_s, mtime_ns, held; /* the mtime as (seconds, ns): seconds * 10^9 overflows past 2262 */
    size_t folder;               /* index in the folders */
    char name[ENTRY_NAME + 1];
} entry;

typedef struct {
    char name[NAME_MAX + 1]; /* as readdir gives it (a longer name, where d_name allows one, is skipped) */
    dev_t dev; /* the subfolder scanned: an unlink goes through it only while it is still this one */
    ino_t ino;
    long long allocated; /* the subfolder's own blocks */
    long long names;     /* the names in it, while it is scanned then as entries go */
    int temp;            /* holds a file named like a temporary one */
} folder;

/* what a file or folder takes on disk: its blocks, or its size where the file system reports fewer (as
 * diskcache.py's _allocated_of) */
static long long allocated_of(const struct stat *st) {
    long long blocks = (long long)st->st_blocks * 512;
    long long size = S_ISDIR(st->st_mode) ? 0 : (long long)st->st_size;
    return blocks > size ? blocks : size;
}

static int is_entry_name(const char *name) {
    for (int i = 0; i < ENTRY_NAME; i++)
        if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f')))
            return 0;
    return name[ENTRY_NAME] == '\0';
}

static int is_temp_name(const char *name) { /* fsutil.is_temp_path's names, and some more (Python decides) */
    return name[0] == '.' && strstr(name, ".tmp-") != NULL;
}

static int dots(const char *name) {
    return name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'));
}

/* grow *items (of *cap, each size bytes) to hold n + 1; 0 or -ENOMEM */
static int room_for(void **items, size_t *cap, size_t n, size_t size) {
    if (n < *cap)
        return 0;
    size_t want = *cap ? *cap * 2 : 256;
    if (want > SIZE_MAX / size)
        return -ENOMEM;
    void *grown = realloc(*items, want * size);
    if (grown == NULL)
        return -ENOMEM;
    *items = grown;
    *cap = want;
    return 0;
}

/* least recently used first, then by size and path (as the Python twin: the folders are sorted by name) */
static int older(const void *a, const void *b) {
    const entry *x = a, *y = b;
    if (x->mtime_s != y->mtime_s)
        return x->mtime_s < y->mtime_s ? -1 : 1;
    if (x->mtime_ns != y->mtime_ns)
        return x->mtime_ns < y->mtime_ns ? -1 : 1;
    if (x->held != y->held)
        return x->held < y->held ? -1 : 1;
    if (x->folder != y->folder)
        return x->folder < y->folder ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int by_name(const void *a, const void *b) {
    return strcmp(((const folder *)a)->name, ((const folder *)b)->name);
}

/* the subfolders of the root (open as root_fd): each real directory among its names; the other files counted */
static int list_root(int root_fd, long long block, folder **folders, size_t *n_folders, evict_total *total) {
    int fd = AGAIN(openat(root_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (fd < 0)
        return 0;
    DIR *dir = fdopendir(fd);
    if (dir == NULL) {
        close(fd);
        return 0;
    }
    size_t cap = 0;
    int bad = 0;
    evict_total total0 = *total;
    struct dirent *d;
    while ((errno = 0, d = readdir(dir)) != NULL) {
        struct stat st;
        if (dots(d->d_name) || strlen(d->d_name) > NAME_MAX ||
            AGAIN(fstatat(root_fd, d->d_name, &st, AT_SYMLINK_NOFOLLOW)) != 0)
            continue; /* removed since listed */
        if (S_ISDIR(st.st_mode)) {
            if ((bad = room_for((void **)folders, &cap, *n_folders, sizeof **folders)))
                break;
            folder *f = &(*folders)[(*n_folders)++];
            memset(f, 0, sizeof *f);
            strcpy(f->name, d->d_name);
        } else if (strcmp(d->d_name, ".index") == 0) { /* its block, even before its first write gives it one */
            long long held = allocated_of(&st);
            *total = add_total(*total, held > block ? held : block);
        } else {
            *total = add_total(*total, allocated_of(&st)); /* anything else kept here */
        }
    }
    if (bad == 0 && d == NULL && errno != 0) { /* the listing failed part way: none of it, as the Python twin */
        *n_folders = 0;
        *total = total0;
    }
    closedir(dir);
    return bad;
}

/* one subfolder's names measured: its entries appended, the rest counted */
static int list_folder(int root_fd, folder *f, size_t index, entry **entries, size_t *n_entries, size_t *cap,
                       evict_total *total) {
    int fd = AGAIN(openat(root_fd, f->name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (fd < 0)
        return 0; /* removed (or replaced) since listed: not counted, as the Python scan */
    struct stat st;
    if (AGAIN(fstat(fd, &st)) != 0) {
        close(fd);
        return 0;
    }
    DIR *dir = fdopendir(fd);
    if (dir == NULL) {
        close(fd);
        return 0;
    }
    evict_total total0 = *total;
    f->allocated = allocated_of(&st);
    f->dev = st.st_dev;
    f->ino = st.st_ino;
    *total = add_total(*total, f->allocated);
    int bad = 0;
    size_t n0 = *n_entries;
    struct dirent *d;
    while ((errno = 0, d = readdir(dir)) != NULL) {
        if (dots(d->d_name) || AGAIN(fstatat(fd, d->d_name, &st, AT_SYMLINK_NOFOLLOW)) != 0)
            continue;
        f->names++;
        long long held = allocated_of(&st);
        *total = add_total(*total, held); /* entries, markers (none), live writers' temporary files, anything else */
        if (is_temp_name(d->d_name))
            f->temp = 1;
        if (is_entry_name(d->d_name)) {
            if ((bad = room_for((void **)entries, cap, *n_entries, sizeof **entries)))
                break;
            entry *e = &(*entries)[(*n_entries)++];
            e->mtime_s = (long long)MTIME(&st).tv_sec;
            e->mtime_ns = (long long)MTIME(&st).tv_nsec;
            e->held = held;
            e->folder = index;
            memcpy(e->name, d->d_name, ENTRY_NAME + 1);
        }
    }
    if (bad == 0 && d == NULL && errno != 0) { /* the listing failed part way: the folder skipped, as the twin */
        *total = total0;
        *n_entries = n0;
        f->names = 0;
        f->temp = 0;
        f->allocated = 0;
    }
    closedir(dir);
    return bad;
}

int evict_entries(const char *root, long long bound, long long target, long long incoming, long long block,
                  evict_result *out) {
    memset(out, 0, sizeof *out);
    struct stat st;
    if (AGAIN(lstat(root, &st)) == 0) /* the root's own (the Python twin's _allocated): not made yet, 0 */
        out->total = allocated_of(&st);
    int root_fd = AGAIN(open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (root_fd < 0)
        return 0;
    folder *folders = NULL;
    entry *entries = NULL;
    size_t n_folders = 0, n_entries = 0, cap = 0;
    int bad = list_root(root_fd, block, &folders, &n_folders, &out->total);
    if (n_folders > 1)
        qsort(folders, n_folders, sizeof *folders, by_name);
    for (size_t i = 0; bad == 0 && i < n_folders; i++)
        bad = list_folder(root_fd, &folders[i], i, &entries, &n_entries, &cap, &out->total);
    if (bad == 0)
        for (size_t i = 0; i < n_folders; i++)
            if (folders[i].temp) {
                size_t len = strlen(folders[i].name) + 1;
                char *grown = realloc(out->temp, out->temp_len + len);
                if (grown == NULL) {
                    bad = -ENOMEM;
                    break;
                }
                memcpy(grown + out->temp_len, folders[i].name, len);
                out->temp = grown;
                out->temp_len += len;
                out->n_temp++;
            }
    if (bad == 0 && over_bound(out->total, incoming, bound)) {
        if (n_entries > 1) /* (qsort's base is declared non-null: none listed leaves entries NULL) */
            qsort(entries, n_entries, sizeof *entries, older);
        int dir_fd = -1, dir_gone = 0;
        size_t dir_of = SIZE_MAX; /* the subfolder last unlinked in, open (or gone) */
        for (size_t i = 0; i < n_entries && out->total > target; i++) {
            entry *e = &entries[i];
            folder *f = &folders[e->folder];
            /* through the subfolder scanned, never a link put at its name since (which would unlink a file of
             * an entry's name outside the cache): opened not following one, and still the folder listed */
            if (dir_of != e->folder) {
                if (dir_fd >= 0)
                    close(dir_fd);
                struct stat ds;
                dir_of = e->folder;
                dir_fd = AGAIN(openat(root_fd, f->name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
                dir_gone = dir_fd < 0 && errno == ENOENT; /* its entries gone with it, as an unlink's ENOENT */
                if (dir_fd >= 0 && (AGAIN(fstat(dir_fd, &ds)) != 0 || ds.st_dev != f->dev || ds.st_ino != f->ino)) {
                    close(dir_fd);
                    dir_fd = -1;
                }
            }
            if (dir_fd < 0 && !dir_gone)
                continue; /* replaced since listed (a link, another folder): its names are not this scan's */
            if (dir_fd >= 0 && AGAIN(unlinkat(dir_fd, e->name, 0)) != 0 && errno != ENOENT)
                continue; /* a reader that opened it reads on; later ones miss */
            out->total -= e->held;
            out->evicted++;
            if (--f->names == 0 && AGAIN(unlinkat(root_fd, f->name, AT_REMOVEDIR)) == 0)
                out->total -= f->allocated; /* emptied: its block freed (a write makes it again, under the lock) */
        }
        if (dir_fd >= 0)
            close(dir_fd);
    }
    free(entries);
    free(folders);
    close(root_fd);
    if (bad != 0) {
        free(out->temp);
        out->temp = NULL;
        out->temp_len = 0;
        out->n_temp = 0;
    }
    return bad;
}
