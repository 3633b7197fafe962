/* Bringing a checkpoint file into memory: mapped privately, or read into memory of the process's
 * own; and the pass over the blobs that checks their CRC32C, split into chunks that the cores
 * take in turn, reading each chunk first when the bytes come from a file. */
#define _GNU_SOURCE
#include "internal.h"
#include "layout.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* The unit of work: read (when reading), then checksummed while it is still in the cache. */
#define CHUNK ((uint64_t)2 << 20)
/* Below this many bytes one thread does it all (a thread costs more than it saves). */
#define SPLIT_MIN ((uint64_t)16 << 20)
/* How far ahead of the chunk it checks a pass over a mapped file asks for the file's pages. */
#define AHEAD_CHUNKS 8
/* Threads at most: two saturate the memory of a small machine; more help a larger one. */
#define MAX_THREADS 8
/* What a direct read's file offset, length and memory are aligned to (a page: what every block
 * device takes; a file system that wants more refuses with EINVAL, and the rest is read buffered).
 */
#define DIRECT_ALIGN ((uint64_t)4096)

/* Opens path for reading if it is a regular file long enough to be a checkpoint. */
static int open_checkpoint_file(const char *path, int *fd_out, size_t *len, frk_error *err)
{
    /* O_NONBLOCK: a FIFO or device must fail the S_ISREG check below, not block the open. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return frk_io_fail(err, "cannot open", path, errno);
    struct stat st;
    int rc = FRK_OK;
    if (fstat(fd, &st))
        rc = frk_io_fail(err, "cannot stat", path, errno);
    else if (!S_ISREG(st.st_mode))
        rc = frk_fail(err, FRK_ECORRUPT, 0, "%s is not a regular file", path);
    else if (st.st_size < (off_t)(FRK_PREAMBLE_SIZE + FRK_FOOTER_SIZE))
        rc = frk_fail(err, FRK_ECORRUPT, 0,
                      "%s is %lld bytes, too short to be a checkpoint (truncated?)", path,
                      (long long)st.st_size);
    else if ((uint64_t)st.st_size > SIZE_MAX)
        rc = frk_fail(err, FRK_ECORRUPT, 0, "%s is too large to map", path);
    if (rc) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    *len = (size_t)st.st_size;
    return FRK_OK;
}

int frk_map_file(const char *path, uint8_t **base, size_t *len, frk_error *err)
{
    int fd, rc = open_checkpoint_file(path, &fd, len, err);
    if (rc)
        return rc;
    void *m = mmap(NULL, *len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED)
        return frk_io_fail(err, "cannot map", path, e);
    *base = m;
    return FRK_OK;
}

void frk_unmap(uint8_t *base, size_t len)
{
    if (base)
        munmap(base, len);
}

/* ---- the pass over the blobs ---------------------------------------------------------------- */

/* A file a pass reads from. */
typedef struct {
    int fd;
    int direct_fd;      /* the same file opened with O_DIRECT, or -1 */
    const uint8_t *map; /* the file mapped (never touched) to ask which pages are cached */
    const char *path;
    size_t len;
} pass_file;

typedef struct {
    const frk_blob *blobs;
    size_t n_blobs;
    const uint8_t *data; /* the image */
    uint8_t *dest;       /* the same memory, when each chunk is read into it from file first */
    const pass_file *file;
    atomic_int direct_ok; /* cleared when the file system refuses a direct read */
    int verify;
    /* data maps the file: each chunk taken asks for the one AHEAD_CHUNKS further (MADV_WILLNEED).
     * In bench/io.py's rounds (3.4 GB, ext4, cold cache): 2.5 s, safetensors' load 2.6 s; the
     * whole file asked for before the pass took 3.8 s (and 12 s in runs while other work filled
     * the memory: pages were reclaimed before the pass reached them); with no advice the two
     * threads' faults read around each other (3.5 s against safetensors' 3.0 s). */
    int ahead;
    uint64_t start, end; /* the bytes passed over, [start, end) of the image */
    /* Chunk k is the image's [(first_chunk + k) * CHUNK, ... + CHUNK), cut to [start, end). */
    uint64_t first_chunk;
    size_t n_chunks;
    /* Per chunk: the CRC32C of its part of the blob that began before it (head), and of its part
     * of the blob that goes on after it (tail); the blobs spanning chunks are checked from these
     * once every chunk is done. */
    uint32_t *head, *tail;
    atomic_size_t next; /* the next chunk to take */
    atomic_int failed;  /* set at the first error: no thread takes another chunk */
    pthread_mutex_t lock;
    uint64_t err_at; /* where the error reported is (the first in the file of those found) */
    int rc;
    frk_error err;
} blob_pass;

static void chunk_bounds(const blob_pass *p, size_t k, uint64_t *cs, uint64_t *ce)
{
    uint64_t s = (p->first_chunk + k) * CHUNK, e = s + CHUNK;
    *cs = s < p->start ? p->start : s;
    *ce = e > p->end ? p->end : e;
}

/* Keeps the error found at file offset `at` if it is the first in the file so far. */
static void pass_fail(blob_pass *p, uint64_t at, const frk_error *e)
{
    pthread_mutex_lock(&p->lock);
    if (p->rc == FRK_OK || at < p->err_at) {
        p->rc = e->status;
        p->err = *e;
        p->err_at = at;
    }
    pthread_mutex_unlock(&p->lock);
    atomic_store(&p->failed, 1);
}

static void blob_mismatch(blob_pass *p, size_t i)
{
    const frk_blob *bl = &p->blobs[i];
    frk_error e;
    frk_corrupt(&e, "checksum mismatch in blob %zu (offset %llu, %llu bytes): the file is damaged",
                i, (unsigned long long)bl->offset, (unsigned long long)bl->length);
    pass_fail(p, bl->offset, &e);
}

/* The first blob that ends after `at` (blobs are sorted and do not overlap: their ends rise). */
static size_t first_blob_after(const blob_pass *p, uint64_t at)
{
    size_t lo = 0, hi = p->n_blobs;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p->blobs[mid].offset + p->blobs[mid].length > at)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* Whether every page of [at, at + n) of the file is in the page cache (mincore on a mapping that
 * is never touched: asking starts no read, as a RWF_NOWAIT read would). */
static int cached(const blob_pass *p, uint64_t at, uint64_t n)
{
    unsigned char vec[CHUNK / 4096 + 2];
    uint64_t from = at / 4096 * 4096;
    size_t pages = (size_t)((at + n - from + 4095) / 4096);
    if (pages > sizeof vec || mincore((void *)(p->file->map + from), at + n - from, vec))
        return 1; /* cannot tell: read it buffered */
    for (size_t i = 0; i < pages; i++)
        if (!(vec[i] & 1))
            return 0;
    return 1;
}

/* Reads from [at, at + n) into dest straight from the disk: neither a copy nor the page cache
 * filled with what is read once. The bytes before the first aligned offset, and a last piece
 * shorter than the alignment, are read buffered. Returns the bytes read, 0 at the end of the
 * file, -1 with errno set, or -2 when the file system refuses (read buffered from now on). */
static ssize_t read_direct(blob_pass *p, uint64_t at, uint64_t n)
{
    uint64_t head = (DIRECT_ALIGN - at % DIRECT_ALIGN) % DIRECT_ALIGN;
    if (head || n < DIRECT_ALIGN)
        return pread(p->file->fd, p->dest + at, (size_t)(head && head < n ? head : n), (off_t)at);
    ssize_t got = pread(p->file->direct_fd, p->dest + at, (size_t)(n / DIRECT_ALIGN * DIRECT_ALIGN),
                        (off_t)at);
    if (got < 0 && errno == EINVAL) {
        atomic_store(&p->direct_ok, 0);
        return -2;
    }
    return got;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; an older kernel says EINVAL and the read faults */
#endif

static int read_chunk(blob_pass *p, uint64_t cs, uint64_t ce)
{
    uint64_t done = cs;
    /* The chunk's fresh pages are made first, in one call, instead of one fault at a time under
     * the read's copy: a verified load of 1 GiB from tmpfs and a read of every tensor, 15 rounds of
     * each interleaved, took 0.315 s against 0.327 s (medians).
     * A failure changes nothing: the read faults the pages in itself. */
    uint64_t ps = cs / 4096 * 4096, pe = (ce + 4095) / 4096 * 4096;
    madvise(p->dest + ps, (size_t)(pe - ps), MADV_POPULATE_WRITE);
    int direct = p->file->direct_fd >= 0 && !cached(p, cs, ce - cs);
    while (done < ce) {
        ssize_t n = -2;
        if (direct && atomic_load_explicit(&p->direct_ok, memory_order_relaxed))
            n = read_direct(p, done, ce - done);
        if (n == -2)
            n = pread(p->file->fd, p->dest + done, (size_t)(ce - done), (off_t)done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            frk_error e;
            if (n < 0)
                frk_io_fail(&e, "cannot read", p->file->path, errno);
            else
                frk_corrupt(&e, "shrank from %zu to %llu bytes while it was read (truncated?)",
                            p->file->len, (unsigned long long)done);
            pass_fail(p, done, &e);
            return -1;
        }
        done += (uint64_t)n;
    }
    return 0;
}

/* Asks the kernel to read chunks [from, to) of a mapped file now (MADV_WILLNEED: readahead that
 * is not judged by the faults of the threads checking it). */
static void ask_ahead(const blob_pass *p, size_t from, size_t to)
{
    if (from >= p->n_chunks)
        return;
    uint64_t s, e, unused;
    chunk_bounds(p, from, &s, &unused);
    chunk_bounds(p, (to < p->n_chunks ? to : p->n_chunks) - 1, &unused, &e);
    s = s / 4096 * 4096;
    madvise((void *)(p->data + s), (size_t)(e - s), MADV_WILLNEED);
}

static void pass_chunk(blob_pass *p, size_t k)
{
    uint64_t cs, ce;
    chunk_bounds(p, k, &cs, &ce);
    if (p->ahead)
        ask_ahead(p, k + AHEAD_CHUNKS, k + AHEAD_CHUNKS + 1);
    if (p->dest && read_chunk(p, cs, ce))
        return;
    if (!p->verify)
        return;
    for (size_t i = first_blob_after(p, cs); i < p->n_blobs && p->blobs[i].offset < ce; i++) {
        const frk_blob *bl = &p->blobs[i];
        uint64_t end = bl->offset + bl->length;
        uint64_t s = bl->offset < cs ? cs : bl->offset, e = end > ce ? ce : end;
        uint32_t crc = frk_crc32c(0, p->data + s, (size_t)(e - s));
        if (bl->offset < cs)
            p->head[k] = crc;
        else if (end > ce)
            p->tail[k] = crc;
        else if (crc != bl->crc)
            blob_mismatch(p, i);
    }
}

static void *pass_worker(void *arg)
{
    blob_pass *p = arg;
    for (;;) {
        if (atomic_load(&p->failed))
            break;
        size_t k = atomic_fetch_add(&p->next, 1);
        if (k >= p->n_chunks)
            break;
        pass_chunk(p, k);
    }
    return NULL;
}

/* How many threads the pass may use: the CPUs this process may run on, within MAX_THREADS; a pass
 * that reads takes at least two (they also keep two reads in flight: a disk is faster so). */
static int pass_threads(uint64_t bytes, int reading)
{
    if (bytes < SPLIT_MIN)
        return 1;
    cpu_set_t set;
    int n = sched_getaffinity(0, sizeof set, &set) ? 1 : CPU_COUNT(&set);
    if (n < (reading ? 2 : 1))
        n = reading ? 2 : 1;
    return n > MAX_THREADS ? MAX_THREADS : n;
}

/* The blobs that span chunks, from the chunks' head and tail CRCs, once every chunk is done. */
static void check_spanning(blob_pass *p)
{
    for (size_t i = 0; i < p->n_blobs; i++) {
        const frk_blob *bl = &p->blobs[i];
        if (!bl->length)
            continue;
        size_t k0 = (size_t)(bl->offset / CHUNK - p->first_chunk);
        size_t k1 = (size_t)((bl->offset + bl->length - 1) / CHUNK - p->first_chunk);
        if (k0 == k1)
            continue;
        uint32_t crc = p->tail[k0];
        for (size_t k = k0 + 1; k <= k1; k++) {
            uint64_t cs, ce;
            chunk_bounds(p, k, &cs, &ce);
            uint64_t end = bl->offset + bl->length;
            crc = frk_crc32c_combine(crc, p->head[k], (end < ce ? end : ce) - cs);
        }
        if (crc != bl->crc) {
            blob_mismatch(p, i);
            return;
        }
    }
}

/* The chunks: read (with dest), then checked (with verify), on as many threads as the CPUs allow.
 */
static void pass_chunks(blob_pass *p)
{
    pthread_t tids[MAX_THREADS];
    int started = 0, want = pass_threads(p->end - p->start, p->dest != NULL);
    while (started < want - 1 && !pthread_create(&tids[started], NULL, pass_worker, p))
        started++; /* no thread to be had: fewer do it */
    pass_worker(p);
    for (int t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
}

/* Passes over [start, end) of data: reads it from file into dest first when dest is not NULL,
 * and with verify checks the CRC32C of every blob; the error told is the first in the file of
 * those found. The blobs must have been validated (sorted, inside [start, end), not overlapping).
 */
static int blob_pass_run(const frk_blob *blobs, size_t n_blobs, const uint8_t *data, uint8_t *dest,
                         const pass_file *file, uint64_t start, uint64_t end, int verify, int ahead,
                         frk_error *err)
{
    blob_pass p = {.blobs = blobs,
                   .n_blobs = n_blobs,
                   .data = data,
                   .dest = dest,
                   .file = file,
                   .verify = verify,
                   .ahead = ahead,
                   .start = start,
                   .end = end,
                   .first_chunk = start / CHUNK};
    atomic_init(&p.next, 0);
    atomic_init(&p.failed, 0);
    atomic_init(&p.direct_ok, 1);
    if (start < end && (dest || verify)) {
        p.n_chunks = (size_t)((end - 1) / CHUNK - p.first_chunk + 1);
        if (verify) {
            p.head = malloc(p.n_chunks * sizeof *p.head);
            p.tail = malloc(p.n_chunks * sizeof *p.tail);
            if (!p.head || !p.tail) {
                free(p.head);
                free(p.tail);
                return frk_oom(err);
            }
        }
    }
    pthread_mutex_init(&p.lock, NULL);
    if (p.n_chunks) {
        if (p.ahead)
            ask_ahead(&p, 0, AHEAD_CHUNKS);
        pass_chunks(&p);
        if (verify && p.rc == FRK_OK)
            check_spanning(&p);
    }
    for (size_t i = 0; verify && i < n_blobs; i++)
        if (!blobs[i].length && blobs[i].crc) /* the CRC32C of no bytes is 0 */
            blob_mismatch(&p, i);
    pthread_mutex_destroy(&p.lock);
    free(p.head);
    free(p.tail);
    if (p.rc != FRK_OK)
        *err = p.err;
    return p.rc;
}

int frk_check_blobs(const frk_blob *blobs, size_t n_blobs, const uint8_t *data, uint64_t start,
                    uint64_t end, frk_error *err)
{
    return blob_pass_run(blobs, n_blobs, data, NULL, NULL, start, end, 1, 0, err);
}

/* ---- reading a file into memory of the process's own --------------------------------------- */

static int read_range(const pass_file *file, uint8_t *dest, uint64_t from, uint64_t to,
                      frk_error *err)
{
    blob_pass p = {.dest = dest, .file = file};
    pthread_mutex_init(&p.lock, NULL);
    read_chunk(&p, from, to);
    pthread_mutex_destroy(&p.lock);
    if (p.rc != FRK_OK)
        *err = p.err;
    return p.rc;
}

/* For reading a big file around the page cache where its pages are not in it: the same file
 * opened again with O_DIRECT (through /proc: the same inode whatever became of its name) and
 * mapped (never touched: mincore says which pages are cached). Nothing where either cannot be had.
 */
static void open_direct(pass_file *f)
{
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", f->fd);
    int d = open(proc, O_RDONLY | O_DIRECT | O_CLOEXEC | O_NONBLOCK);
    struct stat a, b;
    if (d < 0)
        return;
    void *m = mmap(NULL, f->len, PROT_READ, MAP_SHARED, f->fd, 0);
    if (m == MAP_FAILED || fstat(f->fd, &a) || fstat(d, &b) || a.st_dev != b.st_dev ||
        a.st_ino != b.st_ino) {
        if (m != MAP_FAILED)
            munmap(m, f->len);
        close(d);
        return;
    }
    f->direct_fd = d;
    f->map = m;
}

static void close_direct(pass_file *f)
{
    if (f->direct_fd < 0)
        return;
    munmap((void *)f->map, f->len);
    close(f->direct_fd);
}

/* Puts the file's name before a message of the reader's (which knows no file); returns the status.
 */
static int name_file(frk_error *err, const char *path)
{
    char msg[sizeof err->msg];
    memcpy(msg, err->msg, sizeof msg);
    return frk_fail(err, err->status, err->sys_errno, "%s: %s", path, msg);
}

/* Reads path whole into fresh memory, the structure first, then the blobs (see frk_load_file). */
static int read_file(const char *path, int verify, uint8_t **base, size_t *len, frk_error *err)
{
    pass_file f = {.direct_fd = -1, .path = path};
    int rc = open_checkpoint_file(path, &f.fd, len, err);
    if (rc)
        return rc;
    size_t n = f.len = *len;
    /* Anonymous memory in base pages. Transparent huge pages (MADV_HUGEPAGE) took 4 times the CPU
     * time here: where the kernel must compact memory for them a large first load stalls, and
     * in a virtual machine the host faults each huge page in that the guest had given back. */
    uint8_t *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        close(f.fd);
        return frk_fail(err, FRK_ENOMEM, ENOMEM, "out of memory reading %s", path);
    }
    posix_fadvise(f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    /* The preamble, the footer and the index first: the structure is checked before the blobs
     * are read. A footer that does not locate an index inside the file gets the whole file read,
     * and the reader's checks say what is wrong. */
    frk_reader *r = NULL;
    if ((rc = read_range(&f, m, n - FRK_FOOTER_SIZE, n, err)))
        goto out;
    uint64_t index_offset = frk_get64(m + n - FRK_FOOTER_SIZE + FRK_FOOT_INDEX_OFFSET);
    if (index_offset < FRK_PREAMBLE_SIZE || index_offset > n - FRK_FOOTER_SIZE)
        index_offset = FRK_PREAMBLE_SIZE; /* no index found: all of it, for the reader to judge */
    if ((rc = read_range(&f, m, 0, FRK_PREAMBLE_SIZE, err)) ||
        (rc = read_range(&f, m, index_offset, n - FRK_FOOTER_SIZE, err)) ||
        (rc = frk_reader_open(m, n, 0, &r, err)))
        goto out;
    if (index_offset - FRK_PREAMBLE_SIZE >= SPLIT_MIN)
        open_direct(&f);
    rc = blob_pass_run(frk_reader_blob(r, 0), frk_reader_blob_count(r), m, m, &f, FRK_PREAMBLE_SIZE,
                       index_offset, verify, 0, err);
    close_direct(&f);
out:
    frk_reader_free(r);
    close(f.fd);
    if (rc) {
        frk_unmap(m, n);
        return rc == FRK_ECORRUPT ? name_file(err, path) : rc;
    }
    *base = m;
    return FRK_OK;
}

int frk_load_file(const char *path, unsigned flags, uint8_t **base, size_t *len, frk_error *err)
{
    if (flags & FRK_LOAD_COPY)
        return read_file(path, (flags & FRK_LOAD_VERIFY) != 0, base, len, err);
    int rc = frk_map_file(path, base, len, err);
    frk_reader *r = NULL;
    if (rc || !(flags & FRK_LOAD_VERIFY))
        return rc;
    /* The structure, then the blobs, the pass asking for the file's pages a few chunks ahead of
     * the ones it checks (blob_pass.ahead). The pass ends where the validated blob table says
     * the last blob ends, not where the footer's bytes say the index starts: read again, they
     * are the file's page, which another process's write may have changed since the check. */
    if (!(rc = frk_reader_open(*base, *len, 0, &r, err))) {
        size_t nb = frk_reader_blob_count(r);
        const frk_blob *last = nb ? frk_reader_blob(r, nb - 1) : NULL;
        uint64_t end = last ? last->offset + last->length : FRK_PREAMBLE_SIZE;
        rc = blob_pass_run(frk_reader_blob(r, 0), nb, *base, NULL, NULL, FRK_PREAMBLE_SIZE, end, 1,
                           1, err);
    }
    frk_reader_free(r);
    if (rc) {
        frk_unmap(*base, *len);
        return rc == FRK_ECORRUPT ? name_file(err, path) : rc;
    }
    return FRK_OK;
}
