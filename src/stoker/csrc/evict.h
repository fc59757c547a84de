/* evict.c: the disk cache's eviction scan (storage/diskcache.py's evict_entries, its Python twin). */
#ifndef STOKER_EVICT_H
#define STOKER_EVICT_H

#include <stddef.h>

/* The disk a folder takes, summed exactly as Python's twin sums it: a file's size is the file system's to say (a
 * sparse one may claim almost 2^63 bytes), so a sum of them passes 2^63. Where the compiler has no 128-bit
 * integer, held at LLONG_MAX (which then reads as a folder over any bound). */
#if defined(__SIZEOF_INT128__)
__extension__ typedef __int128 evict_total;
#else
typedef long long evict_total;
#endif

/* What one scan found and did: ``total``, the disk the folder takes after it (allocated blocks: the root, its
 * files, its subfolders and theirs; ``.index`` at least ``block``); ``evicted``, the entries it unlinked;
 * ``temp``, the names of the subfolders holding a file named like a temporary one (".<name>.tmp-..."), each
 * NUL-terminated one after another (``temp_len`` bytes, ``n_temp`` names; malloc'd: the caller frees it). */
typedef struct {
    evict_total total;
    long long evicted;
    char *temp;
    size_t temp_len;
    long long n_temp;
} evict_result;

/* Scan the cache folder ``root`` (<root>/<subfolder>/<32 hex entry names>) and, where ``incoming`` more bytes do
 * not fit in ``bound``, unlink the least recently used entries (oldest mtime first) until the total is at most
 * ``target``, removing each subfolder that leaves empty. Temporary files count as any file (the caller removes
 * the dead writers' ones afterwards, in the subfolders ``temp`` names). The caller holds the folder's lock. 0,
 * or -errno (ENOMEM: the listing did not fit in memory; nothing unlinked then). */
int evict_entries(const char *root, long long bound, long long target, long long incoming, long long block,
                  evict_result *out);

#endif
