/* The atomic durable commit: a builder's checkpoint written beside its target in one
 * sequential pass, synced, renamed over the target, and the directory synced. */
#define _GNU_SOURCE
#include "internal.h"
#include "layout.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef __linux__
#include <linux/magic.h>
#include <sys/random.h>
#include <sys/vfs.h>
#endif
#include <stdatomic.h>
#ifndef O_DIRECT
#define O_DIRECT 0 /* a system without it: every commit is written buffered */
#endif

#define WRITE_CHUNK (1u << 20)       /* buffered: checksummed, then written while in cache */
#define DIRECT_CHUNK (8u << 20)      /* direct: larger writes, each one waits for the device */
#define STAGE_SIZE ((size_t)8 << 20) /* the direct path's staging buffer */
#define TEMP_NAME_TRIES 16u          /* random temporary names tried before giving up */

/* Where the commit's bytes go: the temporary file, written in one sequential pass, either
 * through the page cache, or (direct) with O_DIRECT in whole pages from page-aligned memory:
 * bytes gather in a staging buffer, and a page-aligned piece at a page-aligned file position goes
 * out from where it is. */
typedef struct {
    int fd;
    int direct;
    uint8_t *stage; /* direct: STAGE_SIZE bytes on a page */
    size_t staged;  /* bytes in stage, the next ones of the file */
} sink;

/* One staging buffer kept for the process's next commit (commits may run in several threads at
 * once: each takes it, or allocates its own, and gives one back). */
static _Atomic(uint8_t *) kept_stage;

static uint8_t *stage_take(void)
{
    uint8_t *p = atomic_exchange(&kept_stage, NULL);
    void *m;
    if (!p && !posix_memalign(&m, FRK_PAGE_ALIGN, STAGE_SIZE))
        p = m;
    return p;
}

static void stage_give(uint8_t *p)
{
    if (p)
        free(atomic_exchange(&kept_stage, p));
}

/* O_DIRECT off for the rest of the file: this file system refused it. */
static int sink_buffered(sink *s)
{
    int fl = fcntl(s->fd, F_GETFL);
    if (fl < 0 || fcntl(s->fd, F_SETFL, fl & ~O_DIRECT) < 0)
        return -1;
    s->direct = 0;
    return 0;
}

/* Writes all of data, retrying partial writes and EINTR; a direct write refused with EINVAL (a
 * file system without O_DIRECT for this size or alignment) is written again buffered. */
static int sink_write(sink *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len) {
        ssize_t n = write(s->fd, p, len > (1u << 30) ? (1u << 30) : len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EINVAL && s->direct && !sink_buffered(s))
                continue;
            return -1;
        }
        if (n == 0) {
            errno = EIO;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int sink_flush(sink *s)
{
    size_t n = s->staged;
    s->staged = 0;
    return n ? sink_write(s, s->stage, n) : 0;
}

/* Appends len bytes to the file. */
static int sink_put(sink *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len) {
        if (!s->direct)
            return sink_flush(s) || sink_write(s, p, len) ? -1 : 0;
        size_t whole = len / FRK_PAGE_ALIGN * FRK_PAGE_ALIGN;
        if (whole && s->staged % FRK_PAGE_ALIGN == 0 && (uintptr_t)p % FRK_PAGE_ALIGN == 0) {
            if (sink_flush(s) || sink_write(s, p, whole))
                return -1;
            p += whole;
            len -= whole;
            continue;
        }
        size_t n = STAGE_SIZE - s->staged < len ? STAGE_SIZE - s->staged : len;
        memcpy(s->stage + s->staged, p, n);
        s->staged += n;
        p += n;
        len -= n;
        if (s->staged == STAGE_SIZE && sink_flush(s))
            return -1;
    }
    return 0;
}

/* The last bytes: a direct file's tail page is written whole (zero-padded), and the file is then
 * cut back to its size. */
static int sink_finish(sink *s, uint64_t file_size)
{
    if (!s->direct || !s->staged)
        return sink_flush(s);
    size_t padded = (s->staged + FRK_PAGE_ALIGN - 1) / FRK_PAGE_ALIGN * FRK_PAGE_ALIGN;
    memset(s->stage + s->staged, 0, padded - s->staged);
    s->staged = padded;
    if (sink_flush(s))
        return -1;
    return ftruncate(s->fd, (off_t)file_size);
}

/* Direct I/O where it saves something: not on tmpfs or ramfs, whose pages are the storage. */
static void sink_try_direct(sink *s)
{
#ifdef __linux__
    struct statfs fs;
    if (fstatfs(s->fd, &fs) == 0 &&
        ((unsigned long)fs.f_type == TMPFS_MAGIC || (unsigned long)fs.f_type == RAMFS_MAGIC))
        return;
    if (!(s->stage = stage_take()))
        return;
    int fl = fcntl(s->fd, F_GETFL);
    if (fl >= 0 && fcntl(s->fd, F_SETFL, fl | O_DIRECT) == 0)
        s->direct = 1;
#else
    (void)s;
#endif
}

#ifndef CRC_THREAD_MIN /* (a build may set it, to compare) */
#define CRC_THREAD_MIN ((uint64_t)16 << 20)
#endif

/* The checksummer thread: the CRC32C of every blob whose checksum the caller did not give, kept
 * in the blob's own `crc` slot (each blob is its own: the writer reads only the data meanwhile). */
static void *crc_blobs(void *arg)
{
    frk_builder *b = arg;
    for (size_t i = 0; i < b->n_blobs; i++)
        if (!b->blobs[i].has_crc)
            b->blobs[i].crc = frk_crc32c(0, b->blobs[i].data, (size_t)b->blobs[i].len);
    return NULL;
}

/* A blob's place: big ones on a page, so that a direct commit can write them from where they are.
 */
static uint64_t blob_align(uint64_t len)
{
    return len >= FRK_PAGE_ALIGN_MIN ? FRK_PAGE_ALIGN : FRK_BLOB_ALIGN;
}

static uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* dirname into dir (".") and basename pointer. */
static int split_path(const char *path, char *dir, size_t dir_cap, const char **base)
{
    const char *slash = strrchr(path, '/');
    if (!slash) {
        if (dir_cap < 2)
            return -1;
        strcpy(dir, ".");
        *base = path;
        return 0;
    }
    size_t n = (size_t)(slash - path);
    if (n == 0)
        n = 1; /* "/file" */
    if (n >= dir_cap)
        return -1;
    memcpy(dir, path, n);
    dir[n] = 0;
    *base = slash + 1;
    return 0;
}

/* 64 bits no other process can guess, for a temporary file's name: getrandom(2), else
 * /dev/urandom.  A system with neither gets the clock and a counter: names still differ, and
 * O_EXCL with a bounded retry still never overwrites a planted file. */
static uint64_t random_bits(void)
{
    uint64_t r = 0;
#ifdef __linux__
    if (getrandom(&r, sizeof r, 0) == (ssize_t)sizeof r)
        return r;
#endif
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, &r, sizeof r);
        close(fd);
        if (n == (ssize_t)sizeof r)
            return r;
    }
    static _Atomic uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)ts.tv_nsec ^
           (atomic_fetch_add(&counter, 1) * 0x9E3779B97F4A7C15u);
}

/* The temporary file's name in the target's directory: ".<name>.tmp.<pid>.<random>", 16 hex
 * digits of random_bits(): it says whose it is and which process writes it (a dead writer's
 * file is recognised by its pid), and nobody can create it ahead of the writer.  A name too
 * long for that (NAME_MAX is 255 bytes) keeps its first bytes, cut at a character boundary,
 * and a hash of the whole name: ".<start of name>~<crc32c of name>.tmp.<pid>.<random>". */
static void temp_name(char *out, size_t cap, const char *base)
{
    enum { NAME_MAX_ = 255, SUFFIX_MAX = 48 }; /* ".tmp." pid "." 16 hex digits, with room */
    long pid = (long)getpid();
    unsigned long long rnd = (unsigned long long)random_bits();
    size_t n = strlen(base);
    if (1 + n + SUFFIX_MAX <= NAME_MAX_) {
        snprintf(out, cap, ".%s.tmp.%ld.%016llx", base, pid, rnd);
        return;
    }
    size_t keep = NAME_MAX_ - 1 - 9 - SUFFIX_MAX; /* "." and "~xxxxxxxx" */
    while (keep > 0 && ((uint8_t)base[keep] & 0xC0) == 0x80)
        keep--;
    snprintf(out, cap, ".%.*s~%08x.tmp.%ld.%016llx", (int)keep, base, frk_crc32c(0, base, n), pid,
             rnd);
}

/* Where each blob goes (offsets, when not NULL), where the index starts, its size and the file's
 * size: the layout the commit writes, and what frk_builder_size reports. */
static int plan_layout(const frk_builder *b, uint64_t *offsets, uint64_t *index_offset,
                       size_t *index_size, uint64_t *file_size, frk_error *err)
{
    uint64_t off = FRK_PREAMBLE_SIZE, total = 0;
    int over = 0;
    for (size_t i = 0; i < b->n_blobs && !over; i++) {
        uint64_t a = blob_align(b->blobs[i].len);
        over = off > UINT64_MAX - (a - 1);
        off = over ? off : align_up(off, a);
        if (offsets)
            offsets[i] = off;
        over = over || __builtin_add_overflow(off, b->blobs[i].len, &off);
    }
    /* the index's parts are in memory already: their sum fits in a size_t */
    size_t ix = FRK_INDEX_WORD + FRK_BLOB_ENTRY_SIZE * b->n_blobs + FRK_INDEX_WORD +
                b->tensors.len + FRK_INDEX_WORD + b->tree.len;
    over = over || off > UINT64_MAX - (FRK_INDEX_WORD - 1);
    uint64_t start = over ? 0 : align_up(off, FRK_INDEX_WORD);
    if (over || __builtin_add_overflow(start, (uint64_t)ix, &total) ||
        __builtin_add_overflow(total, (uint64_t)FRK_FOOTER_SIZE, &total))
        return frk_fail(err, FRK_EINVAL, 0, "checkpoint larger than 2^64 bytes");
    *index_offset = start;
    *index_size = ix;
    *file_size = total;
    return FRK_OK;
}

int frk_builder_size(const frk_builder *b, uint64_t *size, frk_error *err)
{
    uint64_t index_offset;
    size_t index_size;
    return plan_layout(b, NULL, &index_offset, &index_size, size, err);
}

/* A written file, not yet in place (frk_builder_write). */
struct frk_pending {
    int fd, dfd;
    char tmp[256];
    char *path; /* the target, as given */
    const char *base;
};

int frk_builder_write(frk_builder *b, const char *path, unsigned flags, uint64_t *written,
                      frk_pending **out, frk_error *err)
{
    int rc = FRK_OK, fd = -1, dfd = -1;
    frk_pending *pending = NULL;
    uint64_t *offsets = NULL;
    uint8_t *index = NULL;
    char dir[4096], tmp[256];
    const char *base;
    sink snk = {-1, 0, NULL, 0};
    pthread_t crc_th;
    int crc_thread = 0;

    if (split_path(path, dir, sizeof dir, &base) || !*base)
        return frk_fail(err, FRK_EINVAL, 0, "invalid checkpoint path %s", path);

    /* Refuse to write a tree the reader would reject. */
    frk_tree_parser tp = {b->tree.data, b->tree.len, 0, b->n_tensors, NULL, 0, 0, err};
    if ((rc = frk_parse_tree(&tp))) {
        char why[sizeof err->msg];
        memcpy(why, err->msg, sizeof why);
        return frk_fail(err, FRK_EINVAL, 0, "malformed value tree: %s", why);
    }

    /* Layout. */
    offsets = malloc((b->n_blobs ? b->n_blobs : 1) * sizeof *offsets);
    if (!offsets)
        return frk_oom(err);
    uint64_t index_offset, file_size;
    size_t index_size;
    if ((rc = plan_layout(b, offsets, &index_offset, &index_size, &file_size, err)))
        goto out;
    index = malloc(index_size);
    if (!index) {
        rc = frk_oom(err);
        goto out;
    }

    /* The directory first: the temporary file, the rename and the directory's sync all happen
     * in it, and a directory that cannot be synced must fail the save before it starts. */
    dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        int e = errno;
        rc = frk_fail(err, FRK_EIO, e, "cannot open the directory %s to save %s: %s (errno %d)",
                      dir, path, strerror(e), e);
        goto out;
    }
    /* The temporary file beside the target, so the rename stays on one file system.  Its name
     * cannot be guessed; a name taken all the same (a collision, or a file planted by chance)
     * gets another one, a bounded number of times. */
    for (unsigned attempt = 1;; attempt++) {
        temp_name(tmp, sizeof tmp, base);
        fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0)
            break;
        if (errno != EEXIST || attempt == TEMP_NAME_TRIES) {
            int e = errno;
            rc = frk_fail(err, FRK_EIO, e,
                          "cannot create a temporary file %s in %s for %s: %s (errno %d%s)", tmp,
                          dir, path, strerror(e), e,
                          e == EEXIST ? ", every random name tried was taken" : "");
            goto out;
        }
    }
    int e = posix_fallocate(fd, 0, (off_t)file_size);
    if (e && e != EOPNOTSUPP && e != EINVAL && e != ENOSYS) {
        rc = frk_io_fail(err, "cannot reserve space for", path, e);
        goto fail_tmp;
    }

    snk.fd = fd;
    if (flags & FRK_COMMIT_DIRECT)
        sink_try_direct(&snk);

    uint8_t head[FRK_PREAMBLE_SIZE] = {0};
    static const uint8_t zeros[FRK_PAGE_ALIGN];
    memcpy(head + FRK_PRE_MAGIC, FRK_PREAMBLE_MAGIC, FRK_MAGIC_SIZE);
    frk_put32(head + FRK_PRE_VERSION, FRK_FORMAT_VERSION);
    if (sink_put(&snk, head, sizeof head))
        goto io_error;

    /* Checksums not known yet are taken by a second thread while this one writes (the commit then
     * takes about max(write, checksum) rather than their sum); a few megabytes are checksummed
     * here, each piece just before it is written. */
    uint64_t unknown = 0;
    for (size_t i = 0; i < b->n_blobs; i++)
        unknown += b->blobs[i].has_crc ? 0 : b->blobs[i].len;
    if (unknown >= CRC_THREAD_MIN && !pthread_create(&crc_th, NULL, crc_blobs, b))
        crc_thread = 1;

    uint8_t *q = index;
    frk_put64(q, b->n_blobs);
    q += FRK_INDEX_WORD;
    uint64_t pos = FRK_PREAMBLE_SIZE;
    for (size_t i = 0; i < b->n_blobs; i++) {
        if (sink_put(&snk, zeros, (size_t)(offsets[i] - pos)))
            goto io_error;
        const frk_blob_ref *blob = &b->blobs[i];
        const uint8_t *p = blob->data;
        uint64_t left = blob->len;
        uint32_t crc = 0;
        if (blob->has_crc || crc_thread) {
            if (left && sink_put(&snk, p, (size_t)left))
                goto io_error;
            left = 0;
        }
        while (left) {
            size_t chunk = snk.direct ? DIRECT_CHUNK : WRITE_CHUNK;
            size_t n = left > chunk ? chunk : (size_t)left;
            crc = frk_crc32c(crc, p, n); /* buffered: while the chunk is still in cache */
            if (sink_put(&snk, p, n))
                goto io_error;
            p += n;
            left -= n;
        }
        pos = offsets[i] + blob->len;
        frk_put64(q + FRK_BLOB_OFFSET, offsets[i]);
        frk_put64(q + FRK_BLOB_LENGTH, blob->len);
        frk_put32(q + FRK_BLOB_CRC, crc);
        frk_put32(q + FRK_BLOB_RESERVED, 0);
        q += FRK_BLOB_ENTRY_SIZE;
    }
    int threaded = crc_thread;
    if (crc_thread) {
        pthread_join(crc_th, NULL);
        crc_thread = 0;
    }
    for (size_t i = 0; i < b->n_blobs; i++) /* the caller's, or the checksummer thread's */
        if (b->blobs[i].has_crc || threaded)
            frk_put32(index + FRK_INDEX_WORD + FRK_BLOB_ENTRY_SIZE * i + FRK_BLOB_CRC,
                      b->blobs[i].crc);
    if (sink_put(&snk, zeros, (size_t)(index_offset - pos)))
        goto io_error;
    frk_put64(q, b->n_tensors);
    q += FRK_INDEX_WORD;
    if (b->tensors.len)
        memcpy(q, b->tensors.data, b->tensors.len);
    q += b->tensors.len;
    frk_put64(q, b->tree.len);
    q += FRK_INDEX_WORD;
    memcpy(q, b->tree.data, b->tree.len);

    uint8_t foot[FRK_FOOTER_SIZE] = {0};
    frk_put64(foot + FRK_FOOT_INDEX_OFFSET, index_offset);
    frk_put64(foot + FRK_FOOT_INDEX_SIZE, index_size);
    frk_put64(foot + FRK_FOOT_FILE_SIZE, file_size);
    frk_put32(foot + FRK_FOOT_INDEX_CRC, frk_crc32c(0, index, index_size));
    frk_put32(foot + FRK_FOOT_VERSION, FRK_FORMAT_VERSION);
    frk_put32(foot + FRK_FOOT_CRC, frk_crc32c(0, foot, FRK_FOOT_CRC));
    memcpy(foot + FRK_FOOT_MAGIC, FRK_FOOTER_MAGIC, FRK_MAGIC_SIZE);
    if (sink_put(&snk, index, index_size) || sink_put(&snk, foot, sizeof foot) ||
        sink_finish(&snk, file_size))
        goto io_error;
    size_t plen = strlen(path);
    pending = malloc(sizeof *pending);
    char *path_copy = malloc(plen + 1);
    if (!pending || !path_copy) {
        free(pending);
        free(path_copy);
        pending = NULL;
        rc = frk_oom(err);
        goto fail_tmp;
    }
    memcpy(path_copy, path, plen + 1);
    pending->fd = fd;
    pending->dfd = dfd;
    memcpy(pending->tmp, tmp, sizeof tmp);
    pending->path = path_copy;
    pending->base = path_copy + (base - path);
    fd = dfd = -1; /* the pending file's now */
    *out = pending;
    if (written)
        *written = file_size;
    goto out;

io_error:
    rc = frk_io_fail(err, "cannot write checkpoint", path, errno);
fail_tmp:
    if (fd >= 0)
        close(fd);
    fd = -1;
    unlinkat(dfd, tmp, 0);
out:
    if (crc_thread)
        pthread_join(crc_th, NULL);
    if (dfd >= 0)
        close(dfd);
    stage_give(snk.stage);
    free(offsets);
    free(index);
    return rc;
}

static void pending_free(frk_pending *p)
{
    if (p->fd >= 0)
        close(p->fd);
    if (p->dfd >= 0)
        close(p->dfd);
    free(p->path);
    free(p);
}

void frk_abandon(frk_pending *p)
{
    if (!p)
        return;
    unlinkat(p->dfd, p->tmp, 0);
    pending_free(p);
}

int frk_publish(frk_pending *p, unsigned flags, frk_error *err)
{
    int rc = FRK_OK, fd = p->fd;
    p->fd = -1;
    if ((flags & FRK_COMMIT_FSYNC) && fsync(fd)) {
        rc = frk_io_fail(err, "cannot write checkpoint", p->path, errno);
        close(fd);
        frk_abandon(p);
        return rc;
    }
    if (close(fd)) {
        rc = frk_io_fail(err, "cannot write checkpoint", p->path, errno);
        frk_abandon(p);
        return rc;
    }
    if (renameat(p->dfd, p->tmp, p->dfd, p->base)) {
        rc = frk_io_fail(err, "cannot rename the new checkpoint onto", p->path, errno);
        frk_abandon(p);
        return rc;
    }
    /* From here on the new file is complete and in place: a failing directory sync does not
     * undo the save, it only leaves the rename not yet durable, and the message says so.
     * (EINVAL: a file system that cannot sync directories, whose renames are as durable as
     * it makes them.) */
    if ((flags & FRK_COMMIT_FSYNC) && fsync(p->dfd) && errno != EINVAL) {
        int e = errno;
        rc = frk_fail(err, FRK_EIO, e,
                      "the new checkpoint is in place at %s, but syncing its directory failed: "
                      "%s (errno %d); until the directory reaches the disk, a crash may bring "
                      "back the file that was there before",
                      p->path, strerror(e), e);
    }
    pending_free(p);
    return rc;
}

int frk_builder_commit(frk_builder *b, const char *path, unsigned flags, uint64_t *written,
                       frk_error *err)
{
    frk_pending *p = NULL;
    int rc = frk_builder_write(b, path, flags, written, &p, err);
    return rc ? rc : frk_publish(p, flags, err);
}
