/* AGAIN(call): a system call made again while a signal interrupts it (EINTR: a signal that comes during a call on
 * a FUSE or network file system); its result. Shared by the cache's entry writer (entries.c) and its eviction
 * scan (evict.c), so a signal never costs an entry or a scan. */
#ifndef STOKER_AGAIN_H
#define STOKER_AGAIN_H

#include <errno.h>

#define AGAIN(call)                                                                                            \
    __extension__({                                                                                            \
        int again_rc_;                                                                                         \
        do                                                                                                     \
            again_rc_ = (call);                                                                                \
        while (again_rc_ < 0 && errno == EINTR);                                                               \
        again_rc_;                                                                                             \
    })

#endif
