/* evict.c: the disk cache's eviction scan (storage/diskcache.py's evict_entries, its Python twin). */
#ifndef STOKER_EVICT_H
#define STOKER_EVICT_H

#include <stddef.h>

/* What one scan found and did: ``total``, the disk the folder takes after it (allocated blocks: the root, its
 * files, its subfolders and theirs; ``.index`` at least ``block``); ``evicted``, the entries it unlinked;
 * ``temp``, the names of the subfolders holding a file named like a temporary one (".<name>.tmp-..."), each
 * NUL-terminated one after another (``temp_len`` bytes, ``n_temp`` names; malloc'd: the caller frees it). */
typedef struct {
    long long total;
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
