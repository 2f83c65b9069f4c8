/* Layer "utilities": output files created owner-only (outfile.h says what is refused and why).
 * Each check is made on the descriptor opened, never on the path before opening it, so that
 * nothing can be swapped in between. */
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "optparse.h"
#include "testable.h"

bool vmh_outfile_path(const char *tmpl, char *path, size_t len, char *why, size_t whylen)
{
    if (vmh_expand_path(tmpl, (long)getpid(), path, len))
        return true;
    snprintf(why, whylen, "longer than %zu bytes once %%p is replaced", len - 1);
    return false;
}

/* Who owns the process's files: geteuid in the library; a test pretends to be another user. */
VMH_TESTABLE uid_t (*vmh_stats_euid)(void) = geteuid;

/* Opens an existing path for writing and checks it before anything is changed: a regular
 * file owned by us. -1 and why otherwise (errno ENOENT: it vanished, the caller creates it). */
static int open_existing(const char *path, int flags, char *why, size_t whylen)
{
    char err[128];
    /* O_NONBLOCK: opening a FIFO for writing would wait for a reader forever; with it the open
     * fails (ENXIO) or succeeds at once, and the type check below refuses it either way. */
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | flags);
    if (fd < 0) {
        int e = errno;
        if (e == ENXIO)
            snprintf(why, whylen, "it is not a regular file (a FIFO or socket)");
        else if (e == ELOOP)
            snprintf(why, whylen, "it is a symbolic link");
        else
            snprintf(why, whylen, "cannot open it: %s", strerror_r(e, err, sizeof(err)));
        errno = e;
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(why, whylen, "cannot examine it: %s", strerror_r(errno, err, sizeof(err)));
        close(fd);
        errno = EIO;
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, whylen, "it is not a regular file");
        close(fd);
        errno = EINVAL;
        return -1;
    }
    /* A file of another user is never truncated or made ours, even by root: a program run as
     * root with VMMHOOK_TRACE=/home/alice/x must not destroy alice's file. */
    if (st.st_uid != vmh_stats_euid()) {
        snprintf(why, whylen, "it belongs to uid %u, not to this process's uid %u",
                 (unsigned)st.st_uid, (unsigned)vmh_stats_euid());
        close(fd);
        errno = EPERM;
        return -1;
    }
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, 0) != 0) {
        snprintf(why, whylen, "cannot make it owner-only and empty: %s",
                 strerror_r(errno, err, sizeof(err)));
        close(fd);
        errno = EIO;
        return -1;
    }
    /* A regular file: O_NONBLOCK did its job (no wait at the open) and means nothing for its
     * writes; cleared all the same, keeping O_APPEND. */
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
}

/* Opens an output file (trace, its gauges, JSON) for writing, owner-only: a new file is
 * created 0600; an existing one must be a regular file of ours, and is made 0600 and emptied
 * only after that check. Anything else is refused with why: a symbolic link as the last
 * component (O_NOFOLLOW: a link planted in a shared /tmp cannot redirect the write), a FIFO (it
 * would block the program), a device, another user's file. */
int vmh_outfile_open(const char *path, int flags, char *why, size_t whylen)
{
    char err[128];
    for (int attempt = 0; attempt < 3; attempt++) {
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | flags, 0600);
        if (fd >= 0)
            return fd; /* ours, new, empty */
        if (errno != EEXIST) {
            snprintf(why, whylen, "cannot create it: %s", strerror_r(errno, err, sizeof(err)));
            return -1;
        }
        fd = open_existing(path, flags, why, whylen);
        if (fd >= 0 || errno != ENOENT)
            return fd;
        /* Removed between the two opens: try again. */
    }
    snprintf(why, whylen, "it keeps appearing and vanishing");
    return -1;
}

bool vmh_outfile_write(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return false;
        }
        p += w;
        n -= (size_t)w;
    }
    return true;
}
