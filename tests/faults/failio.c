/* failio: an LD_PRELOAD shim that makes writes and syncs of chosen files fail, for fault tests.
 *
 * While the file named by FAILIO_TRIGGER exists, every call of the kinds listed in FAILIO_OPS
 * ("write": write, writev, pwrite, pwrite64, pwritev, pwritev64; "sync": fsync, fdatasync) on a
 * file descriptor whose path (/proc/self/fd/N) starts with FAILIO_PREFIX fails with errno
 * FAILIO_ERRNO (a number, e.g. 5 for EIO, 28 for ENOSPC) and does nothing. Everything else is
 * passed to the real call (dlsym(RTLD_NEXT)). The trigger is looked at with access() at most
 * once per CHECK_NS, so a test turns the fault on and off by creating and removing that file.
 *
 * Built by tests/faults/failio.py: gcc -shared -fPIC -O2 -o failio.so failio.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* How often the trigger file is looked at: 2 ms keeps access() off the hot path and still
 * turns a fault on within a few appends. */
#define CHECK_NS 2000000LL

static atomic_llong checked_at = -CHECK_NS - 1;
static atomic_int trigger_present;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The errno to fail a call of kind `op` ("write" or "sync") on `fd` with, or 0 to pass it. */
static int failure(int fd, const char *op) {
    const char *trigger = getenv("FAILIO_TRIGGER");
    const char *prefix = getenv("FAILIO_PREFIX");
    const char *ops = getenv("FAILIO_OPS");
    const char *code = getenv("FAILIO_ERRNO");
    if (!trigger || !prefix || !ops || !code || !strstr(ops, op))
        return 0;
    int saved = errno;
    long long now = now_ns();
    if (now - atomic_load(&checked_at) >= CHECK_NS) {
        atomic_store(&trigger_present, access(trigger, F_OK) == 0);
        atomic_store(&checked_at, now);
    }
    int fail = 0;
    if (atomic_load(&trigger_present)) {
        char link[64], path[PATH_MAX];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, path, sizeof path - 1);
        if (n > 0) {
            path[n] = '\0';
            fail = strncmp(path, prefix, strlen(prefix)) == 0;
        }
    }
    errno = saved;
    return fail ? atoi(code) : 0;
}

#define REAL(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))
#define FAIL_OR_PASS(fd, op, call)    \
    do {                              \
        int e = failure((fd), (op));  \
        if (e) {                      \
            errno = e;                \
            return -1;                \
        }                             \
        return call;                  \
    } while (0)

ssize_t write(int fd, const void *buf, size_t count) {
    FAIL_OR_PASS(fd, "write", REAL(write)(fd, buf, count));
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    FAIL_OR_PASS(fd, "write", REAL(writev)(fd, iov, iovcnt));
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    FAIL_OR_PASS(fd, "write", REAL(pwrite)(fd, buf, count, offset));
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off64_t offset) {
    FAIL_OR_PASS(fd, "write", REAL(pwrite64)(fd, buf, count, offset));
}

ssize_t pwritev(int fd, const struct iovec *iov, int iovcnt, off_t offset) {
    FAIL_OR_PASS(fd, "write", REAL(pwritev)(fd, iov, iovcnt, offset));
}

ssize_t pwritev64(int fd, const struct iovec *iov, int iovcnt, off64_t offset) {
    FAIL_OR_PASS(fd, "write", REAL(pwritev64)(fd, iov, iovcnt, offset));
}

int fsync(int fd) {
    FAIL_OR_PASS(fd, "sync", REAL(fsync)(fd));
}

int fdatasync(int fd) {
    FAIL_OR_PASS(fd, "sync", REAL(fdatasync)(fd));
}
