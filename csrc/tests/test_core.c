/* Tests of the frk C core: CRC32C, the builder / atomic writer / validating
 * reader, and the SkipToIter state machine.  Plain C, no framework: one line
 * per test, then "N passed, M failed"; the exit status is non-zero on any
 * failure.
 *
 *   test_core                  run every test
 *   test_core NAME...          run the tests whose name contains one of NAME
 *   test_core --write-seeds D  write small valid checkpoints into D (fuzz corpus)
 *
 * The hostile-file tests build images by hand from the byte layout named in
 * csrc/layout.h and re-seal them (index CRC, footer CRC, blob CRCs), so every
 * rejection they check is a structural check, not a checksum.  A valid image
 * from the same helper is opened first in each group as the negative control.
 *
 * One file of about 2,900 lines: the sanitizer build (make ctest) and the fuzz target's seed writer
 * (--write-seeds) are this one binary, and each hand-built hostile image sits beside the check
 * it must trip.
 */
#define _GNU_SOURCE
#include "frk.h"
#include "internal.h" /* frk_utf8_valid */
#include "layout.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- the tiny harness ------------------------------------------------------ */

static int n_pass, n_fail;
static int t_checks, t_failures;
static char t_first[768];

static int check_(int ok, const char *file, int line, const char *fmt, ...)
{
    t_checks++;
    if (ok)
        return 1;
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (t_failures < 8)
        fprintf(stderr, "    %s:%d: %s\n", file, line, msg);
    if (!t_failures)
        snprintf(t_first, sizeof t_first, "line %d: %s", line, msg);
    t_failures++;
    return 0;
}
#define CHECK(c) check_(!!(c), __FILE__, __LINE__, "%s", #c)
#define CHECKF(c, ...) check_(!!(c), __FILE__, __LINE__, __VA_ARGS__)

typedef void (*test_fn)(void);
static int n_filters;
static char **filters;

static void run_test(const char *name, test_fn fn)
{
    if (n_filters) {
        int hit = 0;
        for (int i = 0; i < n_filters; i++)
            hit |= strstr(name, filters[i]) != NULL;
        if (!hit)
            return;
    }
    t_checks = t_failures = 0;
    t_first[0] = 0;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    fn();
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
    if (t_checks == 0) {
        t_failures = 1;
        snprintf(t_first, sizeof t_first, "made no checks");
    }
    if (t_failures) {
        n_fail++;
        printf("FAIL %-44s %d of %d checks failed; first: %s\n", name, t_failures, t_checks,
               t_first);
    } else {
        n_pass++;
        printf("ok   %-44s %6d checks %8.1f ms\n", name, t_checks, ms);
    }
    fflush(stdout);
}

/* Notes printed under a test (what was skipped or measured). */
static void note(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("     note: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

/* ---- fault injection: this program's own open() and fsync() ---------------------- */

/* The core calls open() and fsync() by name: these definitions take their place in this
 * program (the sanitizers intercept neither), so that a test can make the directory's open or
 * sync fail, and see the name of each file the core syncs. */
static int fail_dir_open_errno, fail_dir_fsync_errno;
static char last_synced_file[4096];

int open(const char *path, int flags, ...)
{
    unsigned mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, unsigned);
        va_end(ap);
    }
    if (fail_dir_open_errno && (flags & O_DIRECTORY)) {
        errno = fail_dir_open_errno;
        return -1;
    }
    return (int)syscall(SYS_openat, AT_FDCWD, path, flags, mode);
}

int fsync(int fd)
{
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && fail_dir_fsync_errno) {
        errno = fail_dir_fsync_errno;
        return -1;
    }
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, last_synced_file, sizeof last_synced_file - 1);
        last_synced_file[n > 0 ? n : 0] = 0;
    }
    return (int)syscall(SYS_fsync, fd);
}

/* ---- small utilities --------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}
static size_t rnd_below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static void *dup_mem(const void *p, size_t n)
{
    void *q = xmalloc(n);
    if (n)
        memcpy(q, p, n);
    return q;
}

static char tmpdir[256];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    if (remove(p))
        chmod(p, 0700), remove(p);
    return 0;
}
static void rm_rf(const char *p) { nftw(p, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

static void path_in(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", tmpdir, name);
}

static uint8_t *read_whole(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = xmalloc((size_t)n);
    if (fread(p, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(p);
        return NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return p;
}

static int write_whole(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* Entries of dir named ".BASE.tmp.*": the writer's temporary files. */
static int count_temps(const char *dir, const char *base)
{
    char prefix[512];
    snprintf(prefix, sizeof prefix, ".%s.tmp.", base);
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

/* ---- growable byte buffer for hand-built indexes and trees ---------------------- */

typedef struct {
    uint8_t *p;
    size_t len, cap;
} bb;

static void bb_put(bb *b, const void *d, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q)
            exit(2);
        b->p = q;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->len, d, n);
    b->len += n;
}
static void bb_u8(bb *b, uint8_t v) { bb_put(b, &v, 1); }
static void bb_u32(bb *b, uint32_t v)
{
    uint8_t t[4];
    frk_put32(t, v);
    bb_put(b, t, 4);
}
static void bb_u64(bb *b, uint64_t v)
{
    uint8_t t[8];
    frk_put64(t, v);
    bb_put(b, t, 8);
}
static void bb_free(bb *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* Value-tree encoders (tag byte, then a u64 word for numbers/lengths/counts). */
static void t_tag(bb *t, uint8_t tag) { bb_u8(t, tag); }
static void t_word(bb *t, uint8_t tag, uint64_t w)
{
    bb_u8(t, tag);
    bb_u64(t, w);
}
static void t_str(bb *t, uint8_t tag, const void *s, size_t n)
{
    t_word(t, tag, n);
    bb_put(t, s, n);
}
static void t_cstr(bb *t, const char *s) { t_str(t, FRK_TAG_STR, s, strlen(s)); }

/* ---- re-sealing images (the layout's names: csrc/layout.h) ---------------------- */

/* Recomputes the index CRC and the footer CRC of a whole image in place, from
 * the footer's own index_offset / index_size (which must lie inside).  Returns
 * 0, or -1 if the footer does not locate an index inside the image. */
static int reseal(uint8_t *img, size_t len)
{
    if (len < FRK_PREAMBLE_SIZE + FRK_FOOTER_SIZE)
        return -1;
    uint8_t *foot = img + len - FRK_FOOTER_SIZE;
    uint64_t off = frk_get64(foot + FRK_FOOT_INDEX_OFFSET);
    uint64_t size = frk_get64(foot + FRK_FOOT_INDEX_SIZE);
    if (off > len || size > len - off)
        return -1;
    frk_put32(foot + FRK_FOOT_INDEX_CRC, frk_crc32c(0, img + off, (size_t)size));
    frk_put32(foot + FRK_FOOT_CRC, frk_crc32c(0, foot, FRK_FOOT_CRC));
    return 0;
}

/* Recomputes every blob CRC in the index of a whole image (entries that lie
 * outside the image are left alone), then reseals. */
static void reseal_blobs(uint8_t *img, size_t len)
{
    uint8_t *foot = img + len - FRK_FOOTER_SIZE;
    uint64_t off = frk_get64(foot + FRK_FOOT_INDEX_OFFSET);
    uint64_t size = frk_get64(foot + FRK_FOOT_INDEX_SIZE);
    if (off > len || size > len - off || size < FRK_INDEX_WORD)
        return;
    uint8_t *ix = img + off;
    uint64_t nb = frk_get64(ix);
    for (uint64_t i = 0; i < nb && FRK_INDEX_WORD + FRK_BLOB_ENTRY_SIZE * (i + 1) <= size; i++) {
        uint8_t *e = ix + FRK_INDEX_WORD + FRK_BLOB_ENTRY_SIZE * i;
        uint64_t bo = frk_get64(e + FRK_BLOB_OFFSET), bl = frk_get64(e + FRK_BLOB_LENGTH);
        if (bo <= len && bl <= len - bo)
            frk_put32(e + FRK_BLOB_CRC, frk_crc32c(0, img + bo, (size_t)bl));
    }
    reseal(img, len);
}

/* ---- hand-built images ---------------------------------------------------------- */

#define H_DATA_END 256u /* the data area is bytes 64..256: two default blobs, then padding */
#define H_MAXDIM 40

typedef struct {
    uint64_t off, len;
    uint32_t resv;
    int fixed_crc; /* use crc as given instead of the data's CRC */
    uint32_t crc;
} hblob;

typedef struct {
    uint8_t kind, dtype;
    uint16_t ndim;
    uint32_t resv;
    uint64_t blob, soff;
    int dims_written; /* dimensions actually written (default: ndim) */
    int64_t sizes[H_MAXDIM], strides[H_MAXDIM];
} htensor;

typedef struct {
    uint32_t pre_version, foot_version;
    uint8_t pre_flag;  /* written in the preamble's reserved bytes */
    uint8_t foot_resv; /* written in the footer's reserved bytes */
    int has_nb_claim;
    uint64_t nb_claim;
    size_t nb;
    hblob blobs[4];
    int has_nt_claim;
    uint64_t nt_claim;
    size_t nt;
    htensor tensors[4];
    int has_tree_len_claim;
    uint64_t tree_len_claim;
    bb tree;
    int64_t file_size_delta;
    uint64_t index_offset_delta;
} hspec;

static void ht_set(htensor *t, uint8_t kind, uint8_t dtype, uint64_t blob, uint64_t soff,
                   unsigned ndim, const int64_t *sizes, const int64_t *strides)
{
    memset(t, 0, sizeof *t);
    t->kind = kind;
    t->dtype = dtype;
    t->ndim = (uint16_t)ndim;
    t->dims_written = (int)ndim;
    t->blob = blob;
    t->soff = soff;
    for (unsigned d = 0; d < ndim && d < H_MAXDIM; d++) {
        t->sizes[d] = sizes[d];
        t->strides[d] = strides[d];
    }
}

/* The default: blob 0 = 96 bytes at 64 (a 4x6 float32 torch tensor), blob 1 =
 * 40 bytes at 192 (a 5-element int64 numpy array), tree {"w": T0, "v": [T1, 7]}. */
static void hspec_default(hspec *s)
{
    memset(s, 0, sizeof *s);
    s->pre_version = s->foot_version = FRK_FORMAT_VERSION;
    s->nb = 2;
    s->blobs[0] = (hblob){64, 96, 0, 0, 0};
    s->blobs[1] = (hblob){192, 40, 0, 0, 0};
    s->nt = 2;
    ht_set(&s->tensors[0], FRK_KIND_TORCH, FRK_DT_F32, 0, 0, 2, (int64_t[]){4, 6},
           (int64_t[]){6, 1});
    ht_set(&s->tensors[1], FRK_KIND_NUMPY, FRK_DT_I64, 1, 0, 1, (int64_t[]){5}, (int64_t[]){1});
    t_word(&s->tree, FRK_TAG_DICT, 2);
    t_cstr(&s->tree, "w");
    t_word(&s->tree, FRK_TAG_TENSOR, 0);
    t_cstr(&s->tree, "v");
    t_word(&s->tree, FRK_TAG_LIST, 2);
    t_word(&s->tree, FRK_TAG_TENSOR, 1);
    t_word(&s->tree, FRK_TAG_INT, 7);
}

/* Replaces the default tree with a single value tree (the caller fills it). */
static bb *hspec_tree(hspec *s)
{
    s->tree.len = 0;
    return &s->tree;
}

static uint8_t *hspec_image(const hspec *s, size_t *out_len)
{
    bb ix = {0};
    bb_u64(&ix, s->has_nb_claim ? s->nb_claim : s->nb);
    uint8_t data[H_DATA_END];
    memcpy(data + FRK_PRE_MAGIC, FRK_PREAMBLE_MAGIC, FRK_MAGIC_SIZE);
    frk_put32(data + FRK_PRE_VERSION, s->pre_version);
    memset(data + FRK_PRE_RESERVED, 0, FRK_PREAMBLE_SIZE - FRK_PRE_RESERVED);
    data[FRK_PRE_RESERVED + 8] = s->pre_flag;
    for (size_t i = FRK_PREAMBLE_SIZE; i < H_DATA_END; i++)
        data[i] = (uint8_t)(i * 37 + 11);
    for (size_t i = 0; i < s->nb; i++) {
        const hblob *b = &s->blobs[i];
        uint32_t crc = b->crc;
        if (!b->fixed_crc)
            crc = b->off <= H_DATA_END && b->len <= H_DATA_END - b->off
                      ? frk_crc32c(0, data + b->off, (size_t)b->len)
                      : 0;
        bb_u64(&ix, b->off);
        bb_u64(&ix, b->len);
        bb_u32(&ix, crc);
        bb_u32(&ix, b->resv);
    }
    bb_u64(&ix, s->has_nt_claim ? s->nt_claim : s->nt);
    for (size_t i = 0; i < s->nt; i++) {
        const htensor *t = &s->tensors[i];
        bb_u8(&ix, t->kind);
        bb_u8(&ix, t->dtype);
        bb_u8(&ix, (uint8_t)t->ndim);
        bb_u8(&ix, (uint8_t)(t->ndim >> 8));
        bb_u32(&ix, t->resv);
        bb_u64(&ix, t->blob);
        bb_u64(&ix, t->soff);
        for (int d = 0; d < t->dims_written; d++)
            bb_u64(&ix, (uint64_t)t->sizes[d]);
        for (int d = 0; d < t->dims_written; d++)
            bb_u64(&ix, (uint64_t)t->strides[d]);
    }
    bb_u64(&ix, s->has_tree_len_claim ? s->tree_len_claim : s->tree.len);
    bb_put(&ix, s->tree.p, s->tree.len);

    size_t len = H_DATA_END + ix.len + FRK_FOOTER_SIZE;
    uint8_t *img = xmalloc(len);
    memcpy(img, data, H_DATA_END);
    memcpy(img + H_DATA_END, ix.p, ix.len);
    uint8_t *foot = img + H_DATA_END + ix.len;
    memset(foot, 0, FRK_FOOTER_SIZE);
    frk_put64(foot + FRK_FOOT_INDEX_OFFSET, H_DATA_END + s->index_offset_delta);
    frk_put64(foot + FRK_FOOT_INDEX_SIZE, ix.len);
    frk_put64(foot + FRK_FOOT_FILE_SIZE, (uint64_t)((int64_t)len + s->file_size_delta));
    frk_put32(foot + FRK_FOOT_INDEX_CRC, frk_crc32c(0, ix.p, ix.len));
    frk_put32(foot + FRK_FOOT_VERSION, s->foot_version);
    foot[FRK_FOOT_RESERVED + 8] = s->foot_resv;
    frk_put32(foot + FRK_FOOT_CRC, frk_crc32c(0, foot, FRK_FOOT_CRC));
    memcpy(foot + FRK_FOOT_MAGIC, FRK_FOOTER_MAGIC, FRK_MAGIC_SIZE);
    bb_free(&ix);
    *out_len = len;
    return img;
}

static void hspec_free(hspec *s) { bb_free(&s->tree); }

/* Opens an image from an exact-size heap copy (so ASan sees any overread). */
static int open_copy(const uint8_t *img, size_t len, int verify, frk_error *err)
{
    uint8_t *c = dup_mem(img, len);
    frk_reader *r = (frk_reader *)0x1;
    memset(err, 0, sizeof *err);
    int rc = frk_reader_open(c, len, verify, &r, err);
    if (rc == FRK_OK)
        frk_reader_free(r);
    else
        CHECKF(r == NULL, "a failed open left *out = %p", (void *)r);
    free(c);
    return rc;
}

/* The image must be rejected as corrupt, with verify on and off, by the check
 * whose message contains `why`. */
static void expect_corrupt_img(const char *what, const uint8_t *img, size_t len, const char *why)
{
    for (int verify = 1; verify >= 0; verify--) {
        frk_error err;
        int rc = open_copy(img, len, verify, &err);
        CHECKF(rc == FRK_ECORRUPT && err.status == FRK_ECORRUPT,
               "%s (verify=%d): rc %d, want FRK_ECORRUPT", what, verify, rc);
        if (rc == FRK_ECORRUPT)
            CHECKF(strstr(err.msg, why) != NULL, "%s (verify=%d): message \"%s\" lacks \"%s\"",
                   what, verify, err.msg, why);
    }
}

static void expect_corrupt(const char *what, const hspec *s, const char *why)
{
    size_t len;
    uint8_t *img = hspec_image(s, &len);
    expect_corrupt_img(what, img, len, why);
    free(img);
}

static void expect_valid(const char *what, const hspec *s)
{
    size_t len;
    uint8_t *img = hspec_image(s, &len);
    for (int verify = 1; verify >= 0; verify--) {
        frk_error err;
        int rc = open_copy(img, len, verify, &err);
        CHECKF(rc == FRK_OK, "%s (verify=%d): rc %d (%s), want FRK_OK", what, verify, rc,
               rc ? err.msg : "");
    }
    free(img);
}

/* ---- CRC32C ---------------------------------------------------------------------- */

typedef uint32_t (*crc_fn)(uint32_t, const void *, size_t);

static void test_crc_vectors(void)
{
    uint8_t buf[32];
    crc_fn fns[2] = {frk_crc32c, frk_crc32c_portable};
    const char *names[2] = {"frk_crc32c", "frk_crc32c_portable"};
    for (int f = 0; f < 2; f++) {
        crc_fn crc = fns[f];
        memset(buf, 0, 32);
        CHECKF(crc(0, buf, 32) == 0x8A9136AAu, "%s(32 zeros) = %08x", names[f], crc(0, buf, 32));
        memset(buf, 0xFF, 32);
        CHECKF(crc(0, buf, 32) == 0x62A8AB43u, "%s(32 x ff) = %08x", names[f], crc(0, buf, 32));
        for (int i = 0; i < 32; i++)
            buf[i] = (uint8_t)i;
        CHECKF(crc(0, buf, 32) == 0x46DD794Eu, "%s(0..31) = %08x", names[f], crc(0, buf, 32));
        for (int i = 0; i < 32; i++)
            buf[i] = (uint8_t)(31 - i);
        CHECKF(crc(0, buf, 32) == 0x113FDB5Cu, "%s(31..0) = %08x", names[f], crc(0, buf, 32));
        CHECKF(crc(0, "123456789", 9) == 0xE3069283u, "%s(\"123456789\") = %08x", names[f],
               crc(0, "123456789", 9));
        CHECKF(crc(0, NULL, 0) == 0 && crc(0x12345678u, "", 0) == 0x12345678u,
               "%s of nothing must return the incoming crc", names[f]);
        /* continuation over the published vector */
        CHECKF(crc(crc(0, "1234", 4), "56789", 5) == 0xE3069283u, "%s continuation", names[f]);
    }
    const char *impl = frk_crc32c_impl();
    CHECKF(!strcmp(impl, "sse4.2") || !strcmp(impl, "armv8-crc") || !strcmp(impl, "portable"),
           "frk_crc32c_impl() = %s", impl);
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        CHECKF(!strcmp(impl, "sse4.2"), "CPU has SSE4.2 but frk_crc32c uses %s", impl);
#endif
    note("frk_crc32c uses %s", impl);
}

/* Bitwise reference CRC32C, independent of both implementations. */
static uint32_t crc_bitwise(uint32_t crc, const uint8_t *p, size_t n)
{
    crc = ~crc;
    while (n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++)
            crc = crc & 1 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return ~crc;
}

static void test_crc_hw_vs_portable(void)
{
    size_t big = (4u << 20) + 77;
    uint8_t *buf = xmalloc(big + 64);
    for (size_t i = 0; i < big + 64; i++)
        buf[i] = (uint8_t)rnd();
    int bad = 0;
    /* every length 0..2100 at every alignment 0..7, also against the bitwise reference */
    for (size_t n = 0; n <= 2100; n++)
        for (size_t a = 0; a < 8; a++) {
            uint32_t h = frk_crc32c(0, buf + a, n), p = frk_crc32c_portable(0, buf + a, n);
            if (h != p || (n < 300 && h != crc_bitwise(0, buf + a, n)))
                bad += !CHECKF(0, "len %zu align %zu: hw %08x portable %08x", n, a, h, p);
        }
    /* lengths around the 3 x 4096-byte three-stream blocks, every alignment */
    static const size_t edges[] = {8 * 1024,      12 * 1024 - 9, 12 * 1024 - 1, 12 * 1024,
                                   12 * 1024 + 1, 12 * 1024 + 7, 12 * 1024 + 8, 24 * 1024 - 1,
                                   24 * 1024,     24 * 1024 + 5, 36 * 1024 + 3, 65536,
                                   100000};
    for (size_t e = 0; e < sizeof edges / sizeof *edges; e++)
        for (size_t a = 0; a < 16; a++) {
            size_t n = edges[e];
            uint32_t h = frk_crc32c(0, buf + a, n), p = frk_crc32c_portable(0, buf + a, n);
            if (h != p)
                bad += !CHECKF(0, "edge len %zu align %zu: hw %08x portable %08x", n, a, h, p);
        }
    CHECK(frk_crc32c(0, buf + 3, 12288) == crc_bitwise(0, buf + 3, 12288));
    /* random lengths 0..100000 at random alignments, random initial crc */
    for (int i = 0; i < 1000; i++) {
        size_t n = rnd_below(100001), a = rnd_below(64);
        uint32_t c0 = (uint32_t)rnd();
        uint32_t h = frk_crc32c(c0, buf + a, n), p = frk_crc32c_portable(c0, buf + a, n);
        if (h != p)
            bad += !CHECKF(0, "random len %zu align %zu crc0 %08x: hw %08x portable %08x", n, a, c0,
                           h, p);
    }
    /* a few MB at odd alignments */
    for (size_t a = 0; a < 8; a += 1) {
        size_t n = big - a * 1013;
        uint32_t h = frk_crc32c(0, buf + a, n), p = frk_crc32c_portable(0, buf + a, n);
        CHECKF(h == p, "%zu bytes at align %zu: hw %08x portable %08x", n, a, h, p);
    }
    /* continuation: crc(crc(a), b) == crc(a + b), split anywhere (in three-stream blocks too) */
    for (int i = 0; i < 300; i++) {
        size_t n = i < 8 ? big - rnd_below(100) : rnd_below(200000), a = rnd_below(32);
        size_t cut = rnd_below(n + 1);
        uint32_t whole_h = frk_crc32c(0, buf + a, n);
        uint32_t whole_p = frk_crc32c_portable(0, buf + a, n);
        uint32_t part_h = frk_crc32c(frk_crc32c(0, buf + a, cut), buf + a + cut, n - cut);
        uint32_t part_p =
            frk_crc32c_portable(frk_crc32c_portable(0, buf + a, cut), buf + a + cut, n - cut);
        uint32_t mixed = frk_crc32c_portable(frk_crc32c(0, buf + a, cut), buf + a + cut, n - cut);
        if (whole_h != whole_p || part_h != whole_h || part_p != whole_p || mixed != whole_h)
            bad += !CHECKF(0, "continuation n %zu cut %zu: %08x %08x %08x %08x %08x", n, cut,
                           whole_h, whole_p, part_h, part_p, mixed);
    }
    /* a flipped bit anywhere changes the crc (both implementations) */
    uint32_t ref = frk_crc32c(0, buf, 50000);
    for (int i = 0; i < 200; i++) {
        size_t at = rnd_below(50000);
        uint8_t bit = (uint8_t)(1u << rnd_below(8));
        buf[at] ^= bit;
        uint32_t h = frk_crc32c(0, buf, 50000), p = frk_crc32c_portable(0, buf, 50000);
        buf[at] ^= bit;
        CHECKF(h != ref && h == p, "bit flip at %zu not seen: %08x %08x %08x", at, ref, h, p);
    }
    CHECK(bad == 0);
    free(buf);
}

/* ---- builder round trip -------------------------------------------------------------- */

static const float RT_F32[6] = {0.5f, 1.5f, -2.0f, 3.25f, 1e-3f, 7.0f};
static const int64_t RT_I64[5] = {INT64_MIN, -1, 0, 1, INT64_MAX};
static const uint8_t RT_U8[3] = {0xde, 0xad, 0xbf};
static const char RT_STR[] = "h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80";
static const uint8_t RT_BYTES[6] = {0, 0xff, 0xc0, 0xaf, '\n', 0xed};

/* dict of 10 pairs:
 *   "int": -42, "min": INT64_MIN, "float": 3.25, "str": RT_STR, "bytes": RT_BYTES, "none": None,
 *   "bools": (True, False), "t": [T0, T1, T2, T3, T4], 7: {"deep": [[]]}, "empty": "" */
static int build_roundtrip(frk_builder *b, frk_error *err)
{
    uint64_t b0, b1, b2, b3, t0, t1, t2, t3, t4;
    int rc = 0;
#define TRY(x)                                                                                     \
    do {                                                                                           \
        if ((rc = (x)) != FRK_OK)                                                                  \
            return rc;                                                                             \
    } while (0)
    TRY(frk_builder_add_blob(b, RT_F32, sizeof RT_F32, &b0, err));
    TRY(frk_builder_add_blob(b, RT_I64, sizeof RT_I64, &b1, err));
    TRY(frk_builder_add_blob(b, NULL, 0, &b2, err));
    TRY(frk_builder_add_blob(b, RT_U8, sizeof RT_U8, &b3, err));
    TRY(frk_builder_add_tensor(b, FRK_KIND_TORCH, FRK_DT_F32, b0, 0, 2, (int64_t[]){2, 3},
                               (int64_t[]){3, 1}, &t0, err));
    TRY(frk_builder_add_tensor(b, FRK_KIND_TORCH, FRK_DT_F32, b0, 0, 2, (int64_t[]){3, 2},
                               (int64_t[]){1, 3}, &t1, err));
    TRY(frk_builder_add_tensor(b, FRK_KIND_NUMPY, FRK_DT_I64, b2, 0, 2, (int64_t[]){0, 5},
                               (int64_t[]){5, 1}, &t2, err));
    TRY(frk_builder_add_tensor(b, FRK_KIND_TORCH, FRK_DT_U8, b3, 1, 1, (int64_t[]){2},
                               (int64_t[]){1}, &t3, err));
    TRY(frk_builder_add_tensor(b, FRK_KIND_TORCH, FRK_DT_I64, b1, 4, 0, NULL, NULL, &t4, err));
    TRY(frk_builder_put_container(b, FRK_TAG_DICT, 10, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "int", 3, err));
    TRY(frk_builder_put_int(b, -42, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "min", 3, err));
    TRY(frk_builder_put_int(b, INT64_MIN, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "float", 5, err));
    TRY(frk_builder_put_float(b, 3.25, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "str", 3, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, RT_STR, strlen(RT_STR), err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "bytes", 5, err));
    TRY(frk_builder_put_str(b, FRK_TAG_BYTES, RT_BYTES, sizeof RT_BYTES, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "none", 4, err));
    TRY(frk_builder_put_scalar(b, FRK_TAG_NONE, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "bools", 5, err));
    TRY(frk_builder_put_container(b, FRK_TAG_TUPLE, 2, err));
    TRY(frk_builder_put_scalar(b, FRK_TAG_TRUE, err));
    TRY(frk_builder_put_scalar(b, FRK_TAG_FALSE, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "t", 1, err));
    TRY(frk_builder_put_container(b, FRK_TAG_LIST, 5, err));
    TRY(frk_builder_put_tensor(b, t0, err));
    TRY(frk_builder_put_tensor(b, t1, err));
    TRY(frk_builder_put_tensor(b, t2, err));
    TRY(frk_builder_put_tensor(b, t3, err));
    TRY(frk_builder_put_tensor(b, t4, err));
    TRY(frk_builder_put_int(b, 7, err));
    TRY(frk_builder_put_container(b, FRK_TAG_DICT, 1, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "deep", 4, err));
    TRY(frk_builder_put_container(b, FRK_TAG_LIST, 1, err));
    TRY(frk_builder_put_container(b, FRK_TAG_LIST, 0, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "empty", 5, err));
    TRY(frk_builder_put_str(b, FRK_TAG_STR, "", 0, err));
#undef TRY
    return FRK_OK;
}

/* Commits the round-trip checkpoint to path; returns its bytes (caller frees). */
static uint8_t *make_roundtrip_file(const char *path, size_t *len)
{
    frk_builder *b = frk_builder_new();
    frk_error err;
    uint64_t written = 0;
    int rc = build_roundtrip(b, &err);
    CHECKF(rc == FRK_OK, "building: %s", rc ? err.msg : "");
    if (rc == FRK_OK) {
        rc = frk_builder_commit(b, path, 0, &written, &err);
        CHECKF(rc == FRK_OK, "commit: %s", rc ? err.msg : "");
    }
    frk_builder_free(b);
    if (rc)
        return NULL;
    uint8_t *img = read_whole(path, len);
    CHECK(img != NULL);
    if (img)
        CHECKF(written == *len, "commit reported %llu bytes, file has %zu",
               (unsigned long long)written, *len);
    return img;
}

/* Index of the value of key `key` (a str) in the dict at node d, or (size_t)-1. */
static size_t dict_get(const frk_node *nodes, size_t d, const char *key)
{
    if (nodes[d].tag != FRK_TAG_DICT)
        return (size_t)-1;
    size_t i = d + 1;
    for (uint64_t k = 0; k < nodes[d].count; k++) {
        const frk_node *kn = &nodes[i];
        size_t v = kn->next;
        if (kn->tag == FRK_TAG_STR && kn->count == strlen(key) && !memcmp(kn->data, key, kn->count))
            return v;
        i = nodes[v].next;
    }
    return (size_t)-1;
}

/* Checks every node's `next` against a walk by counts; returns the index after the subtree. */
static size_t check_next(const frk_node *nodes, size_t n, size_t i, int *ok)
{
    if (i >= n) {
        *ok = 0;
        return n;
    }
    size_t j = i + 1;
    if (nodes[i].tag == FRK_TAG_LIST || nodes[i].tag == FRK_TAG_TUPLE ||
        nodes[i].tag == FRK_TAG_DICT) {
        uint64_t items = nodes[i].tag == FRK_TAG_DICT ? 2 * nodes[i].count : nodes[i].count;
        for (uint64_t k = 0; k < items && *ok; k++)
            j = check_next(nodes, n, j, ok);
    }
    if (nodes[i].next != j)
        *ok = 0;
    return j;
}

static void test_roundtrip(void)
{
    char path[512];
    path_in(path, sizeof path, "roundtrip.frk");
    size_t flen = 0;
    uint8_t *file = make_roundtrip_file(path, &flen);
    if (!file)
        return;
    CHECK(flen >= FRK_PREAMBLE_SIZE + FRK_FOOTER_SIZE &&
          !memcmp(file + FRK_PRE_MAGIC, FRK_PREAMBLE_MAGIC, FRK_MAGIC_SIZE) &&
          !memcmp(file + flen - FRK_MAGIC_SIZE, FRK_FOOTER_MAGIC, FRK_MAGIC_SIZE));
    CHECK(frk_get32(file + FRK_PRE_VERSION) == FRK_FORMAT_VERSION);
    CHECK(frk_has_magic(file, flen) && !frk_has_magic(file + 1, flen - 1) &&
          !frk_has_magic(file, 7));
    free(file);

    uint8_t *base = NULL;
    size_t len = 0;
    frk_error err;
    int rc = frk_map_file(path, &base, &len, &err);
    CHECKF(rc == FRK_OK, "map: %s", rc ? err.msg : "");
    if (rc)
        return;
    CHECK(len == flen);
    frk_reader *r = NULL;
    rc = frk_reader_open(base, len, 1, &r, &err);
    CHECKF(rc == FRK_OK, "open: %s", rc ? err.msg : "");
    if (rc) {
        frk_unmap(base, len);
        return;
    }
    CHECK(frk_reader_version(r) == FRK_FORMAT_VERSION);

    /* blobs: aligned, in order, the bytes and CRCs of the sources */
    const void *src[4] = {RT_F32, RT_I64, NULL, RT_U8};
    size_t srclen[4] = {sizeof RT_F32, sizeof RT_I64, 0, sizeof RT_U8};
    CHECK(frk_reader_blob_count(r) == 4);
    for (size_t i = 0; i < 4 && i < frk_reader_blob_count(r); i++) {
        const frk_blob *bl = frk_reader_blob(r, i);
        CHECKF(bl->offset % FRK_BLOB_ALIGN == 0 && bl->offset >= FRK_PREAMBLE_SIZE,
               "blob %zu at %llu", i, (unsigned long long)bl->offset);
        CHECKF(bl->length == srclen[i], "blob %zu length %llu", i, (unsigned long long)bl->length);
        CHECKF(bl->crc == frk_crc32c(0, src[i], srclen[i]), "blob %zu crc", i);
        if (srclen[i])
            CHECKF(!memcmp(base + bl->offset, src[i], srclen[i]), "blob %zu bytes differ", i);
        CHECK(frk_reader_verify_blob(r, i, &err) == FRK_OK);
    }
    CHECK(frk_reader_blob(r, 4) == NULL);
    CHECK(frk_reader_verify_blob(r, 4, &err) == FRK_EINVAL);

    /* tensors */
    CHECK(frk_reader_tensor_count(r) == 5);
    if (frk_reader_tensor_count(r) == 5) {
        const frk_tensor *t = frk_reader_tensor(r, 0);
        CHECK(t->kind == FRK_KIND_TORCH && t->dtype == FRK_DT_F32 && t->ndim == 2 && t->blob == 0 &&
              t->storage_offset == 0 && t->sizes[0] == 2 && t->sizes[1] == 3 &&
              t->strides[0] == 3 && t->strides[1] == 1);
        t = frk_reader_tensor(r, 1);
        CHECK(t->dtype == FRK_DT_F32 && t->ndim == 2 && t->sizes[0] == 3 && t->sizes[1] == 2 &&
              t->strides[0] == 1 && t->strides[1] == 3);
        /* element [2][1] of the transposed view is RT_F32[2*1 + 1*3] */
        float v;
        memcpy(&v, base + frk_reader_blob(r, t->blob)->offset + 4 * (2 * 1 + 1 * 3), 4);
        CHECK(v == RT_F32[5]);
        t = frk_reader_tensor(r, 2);
        CHECK(t->kind == FRK_KIND_NUMPY && t->dtype == FRK_DT_I64 && t->ndim == 2 && t->blob == 2 &&
              t->sizes[0] == 0 && t->sizes[1] == 5);
        t = frk_reader_tensor(r, 3);
        CHECK(t->dtype == FRK_DT_U8 && t->ndim == 1 && t->blob == 3 && t->storage_offset == 1 &&
              t->sizes[0] == 2);
        CHECK(base[frk_reader_blob(r, 3)->offset + 1] == 0xad);
        t = frk_reader_tensor(r, 4);
        CHECK(t->dtype == FRK_DT_I64 && t->ndim == 0 && t->blob == 1 && t->storage_offset == 4);
        int64_t last;
        memcpy(&last, base + frk_reader_blob(r, 1)->offset + 8 * 4, 8);
        CHECK(last == INT64_MAX);
        CHECK(frk_reader_tensor(r, 5) == NULL);
    }

    /* nodes */
    const frk_node *nd = frk_reader_nodes(r);
    size_t n = frk_reader_node_count(r);
    /* 1 dict + 10 keys + int, int, float, str, bytes, none + tuple(2) + list(5)
     * + dict(1) + key + list + list + str */
    CHECKF(n == 1 + 10 + 6 + 3 + 6 + 4 + 1, "node count %zu", n);
    int ok = 1;
    CHECK(check_next(nd, n, 0, &ok) == n && ok);
    CHECK(nd[0].tag == FRK_TAG_DICT && nd[0].count == 10 && nd[0].next == n);
    if (ok && n == 31) {
        size_t i;
        i = dict_get(nd, 0, "int");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_INT && nd[i].ival == -42);
        i = dict_get(nd, 0, "min");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_INT && nd[i].ival == INT64_MIN);
        i = dict_get(nd, 0, "float");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_FLOAT && nd[i].fval == 3.25);
        i = dict_get(nd, 0, "str");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_STR && nd[i].count == strlen(RT_STR) &&
              !memcmp(nd[i].data, RT_STR, strlen(RT_STR)));
        i = dict_get(nd, 0, "bytes");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_BYTES && nd[i].count == sizeof RT_BYTES &&
              !memcmp(nd[i].data, RT_BYTES, sizeof RT_BYTES));
        /* str/bytes payloads point into the mapped index */
        CHECK(i != (size_t)-1 && nd[i].data > base && nd[i].data + nd[i].count <= base + len);
        i = dict_get(nd, 0, "none");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_NONE);
        i = dict_get(nd, 0, "bools");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_TUPLE && nd[i].count == 2 &&
              nd[i + 1].tag == FRK_TAG_TRUE && nd[i + 2].tag == FRK_TAG_FALSE);
        i = dict_get(nd, 0, "t");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_LIST && nd[i].count == 5);
        for (uint64_t k = 0; i != (size_t)-1 && k < 5; k++)
            CHECKF(nd[i + 1 + k].tag == FRK_TAG_TENSOR && nd[i + 1 + k].count == k,
                   "list item %llu", (unsigned long long)k);
        i = dict_get(nd, 0, "empty");
        CHECK(i != (size_t)-1 && nd[i].tag == FRK_TAG_STR && nd[i].count == 0);
        /* the int key 7 */
        size_t key = 0;
        for (size_t j = 1; j < n; j = nd[nd[j].next].next)
            if (nd[j].tag == FRK_TAG_INT && nd[j].ival == 7) {
                key = j;
                break;
            }
        CHECK(key != 0);
        if (key) {
            size_t v = nd[key].next;
            CHECK(nd[v].tag == FRK_TAG_DICT && nd[v].count == 1);
            size_t deep = dict_get(nd, v, "deep");
            CHECK(deep != (size_t)-1 && nd[deep].tag == FRK_TAG_LIST && nd[deep].count == 1 &&
                  nd[deep + 1].tag == FRK_TAG_LIST && nd[deep + 1].count == 0 &&
                  nd[deep + 1].next == deep + 2 && nd[deep].next == deep + 2);
        }
        CHECK(dict_get(nd, 0, "missing") == (size_t)-1);
    }
    frk_reader_free(r);
    frk_unmap(base, len);

    /* The mapping is private: writes to it never reach the file. */
    size_t l1 = 0, l2 = 0;
    uint8_t *before = read_whole(path, &l1);
    rc = frk_map_file(path, &base, &len, &err);
    CHECK(rc == FRK_OK && before);
    if (rc == FRK_OK && before) {
        for (size_t i = 0; i < len; i++)
            base[i] ^= 0xff;
        CHECK(frk_reader_open(base, len, 1, &r, &err) == FRK_ECORRUPT);
        frk_unmap(base, len);
        uint8_t *after = read_whole(path, &l2);
        CHECK(after && l1 == l2 && !memcmp(before, after, l1));
        free(after);
    }
    free(before);

    /* An empty-tree-only checkpoint: just None, no blobs, no tensors. */
    frk_builder *b = frk_builder_new();
    path_in(path, sizeof path, "none.frk");
    CHECK(frk_builder_put_scalar(b, FRK_TAG_NONE, &err) == FRK_OK);
    uint64_t written = 0;
    CHECK(frk_builder_commit(b, path, FRK_COMMIT_FSYNC, &written, &err) == FRK_OK);
    CHECKF(written == 64 + 8 + 8 + 8 + 1 + 64, "None-only checkpoint is %llu bytes",
           (unsigned long long)written);
    frk_builder_free(b);
    rc = frk_map_file(path, &base, &len, &err);
    CHECK(rc == FRK_OK);
    if (rc == FRK_OK) {
        CHECK(frk_reader_open(base, len, 1, &r, &err) == FRK_OK);
        if (r) {
            CHECK(frk_reader_node_count(r) == 1 && frk_reader_nodes(r)[0].tag == FRK_TAG_NONE &&
                  frk_reader_nodes(r)[0].next == 1 && frk_reader_blob_count(r) == 0 &&
                  frk_reader_tensor_count(r) == 0);
            frk_reader_free(r);
        }
        frk_unmap(base, len);
    }
}

/* The builder refuses what the reader would reject, and commits nothing then. */
static void test_builder_rejects(void)
{
    frk_error err;
    uint64_t idx;
    frk_builder *b = frk_builder_new();
    uint8_t buf[64] = {0};
    CHECK(frk_builder_add_blob(b, buf, sizeof buf, &idx, &err) == FRK_OK && idx == 0);
    CHECK(frk_builder_add_tensor(b, 0, FRK_DT_F32, 0, 0, 1, (int64_t[]){17}, (int64_t[]){1}, &idx,
                                 &err) == FRK_EINVAL &&
          err.status == FRK_EINVAL && strstr(err.msg, "needs 68 bytes"));
    CHECK(frk_builder_add_tensor(b, 0, FRK_DT_F32, 0, 0, 1, (int64_t[]){16}, (int64_t[]){1}, &idx,
                                 &err) == FRK_OK &&
          idx == 0);
    CHECK(frk_builder_add_tensor(b, 0, FRK_DT_COUNT, 0, 0, 1, (int64_t[]){1}, (int64_t[]){1}, &idx,
                                 &err) == FRK_EINVAL);
    CHECK(frk_builder_add_tensor(b, 2, FRK_DT_U8, 0, 0, 1, (int64_t[]){1}, (int64_t[]){1}, &idx,
                                 &err) == FRK_EINVAL);
    CHECK(frk_builder_add_tensor(b, 0, FRK_DT_U8, 1, 0, 1, (int64_t[]){1}, (int64_t[]){1}, &idx,
                                 &err) == FRK_EINVAL);
    CHECK(frk_builder_add_tensor(b, 0, FRK_DT_U8, 0, 0, 1, (int64_t[]){2}, (int64_t[]){-1}, &idx,
                                 &err) == FRK_EINVAL);
    int64_t dims[33];
    for (int i = 0; i < 33; i++)
        dims[i] = 1;
    CHECK(frk_builder_add_tensor(b, 0, FRK_DT_U8, 0, 0, 33, dims, dims, &idx, &err) == FRK_EINVAL);
    CHECK(frk_builder_add_tensor(b, 0, FRK_DT_U8, 0, 0, 32, dims, dims, &idx, &err) == FRK_OK &&
          idx == 1);
    CHECK(frk_builder_put_tensor(b, 2, &err) == FRK_EINVAL);
    CHECK(frk_builder_put_str(b, FRK_TAG_STR, "\xed\xa0\x80", 3, &err) == FRK_EINVAL);
    CHECK(frk_builder_put_str(b, FRK_TAG_LIST, "x", 1, &err) == FRK_EINVAL);
    CHECK(frk_builder_put_scalar(b, FRK_TAG_INT, &err) == FRK_EINVAL);
    CHECK(frk_builder_put_container(b, FRK_TAG_STR, 1, &err) == FRK_EINVAL);
    /* a list that claims 3 items and holds 1: the commit refuses, and writes no file */
    CHECK(frk_builder_put_container(b, FRK_TAG_LIST, 3, &err) == FRK_OK);
    CHECK(frk_builder_put_tensor(b, 0, &err) == FRK_OK);
    char path[512];
    path_in(path, sizeof path, "malformed.frk");
    int rc = frk_builder_commit(b, path, 0, NULL, &err);
    CHECKF(rc == FRK_EINVAL && strstr(err.msg, "malformed value tree"), "rc %d %s", rc, err.msg);
    CHECK(access(path, F_OK) != 0 && count_temps(tmpdir, "malformed.frk") == 0);
    frk_builder_free(b);

    /* nesting beyond FRK_MAX_DEPTH is refused at commit time */
    b = frk_builder_new();
    for (unsigned i = 0; i < FRK_MAX_DEPTH + 1; i++)
        frk_builder_put_container(b, FRK_TAG_LIST, 1, &err);
    frk_builder_put_scalar(b, FRK_TAG_NONE, &err);
    rc = frk_builder_commit(b, path, 0, NULL, &err);
    CHECKF(rc == FRK_EINVAL && strstr(err.msg, "deeper"), "rc %d %s", rc, err.msg);
    CHECK(access(path, F_OK) != 0);
    frk_builder_free(b);
    b = frk_builder_new(); /* control: exactly FRK_MAX_DEPTH levels below the root is fine */
    for (unsigned i = 0; i < FRK_MAX_DEPTH; i++)
        frk_builder_put_container(b, FRK_TAG_LIST, 1, &err);
    frk_builder_put_scalar(b, FRK_TAG_NONE, &err);
    rc = frk_builder_commit(b, path, 0, NULL, &err);
    CHECKF(rc == FRK_OK, "rc %d %s", rc, err.msg);
    frk_builder_free(b);
    /* an empty builder (no tree at all) is refused */
    b = frk_builder_new();
    CHECK(frk_builder_commit(b, path, 0, NULL, &err) == FRK_EINVAL);
    CHECK(frk_builder_commit(b, "", 0, NULL, &err) == FRK_EINVAL);
    frk_builder_free(b);
    frk_builder_free(NULL);
}

/* ---- commit atomicity ---------------------------------------------------------------------- */

/* Commits {"gen": gen, "blob": T0} where the blob is n bytes of value (gen & 0xff). */
/* A builder holding {"gen": gen, "blob": n bytes of gen's low byte}, *data the bytes it holds (the
 * caller frees both); NULL on failure (*rc the error). */
static frk_builder *gen_builder(int64_t gen, size_t n, uint8_t **data, int *rc, frk_error *err)
{
    *data = xmalloc(n);
    memset(*data, (int)(gen & 0xff), n);
    frk_builder *b = frk_builder_new();
    uint64_t bi, ti;
    *rc = frk_builder_add_blob(b, *data, n, &bi, err);
    if (!*rc)
        *rc = frk_builder_add_tensor(b, 0, FRK_DT_U8, bi, 0, 1, (int64_t[]){(int64_t)n},
                                     (int64_t[]){1}, &ti, err);
    if (!*rc)
        *rc = frk_builder_put_container(b, FRK_TAG_DICT, 2, err);
    if (!*rc)
        *rc = frk_builder_put_str(b, FRK_TAG_STR, "gen", 3, err);
    if (!*rc)
        *rc = frk_builder_put_int(b, gen, err);
    if (!*rc)
        *rc = frk_builder_put_str(b, FRK_TAG_STR, "blob", 4, err);
    if (!*rc)
        *rc = frk_builder_put_tensor(b, ti, err);
    return b;
}

static int commit_gen(const char *path, int64_t gen, size_t n, unsigned flags, frk_error *err)
{
    uint8_t *data;
    int rc;
    frk_builder *b = gen_builder(gen, n, &data, &rc, err);
    if (!rc)
        rc = frk_builder_commit(b, path, flags, NULL, err);
    frk_builder_free(b);
    free(data);
    return rc;
}

/* Opens path and returns its "gen" if it is a complete, valid commit_gen
 * checkpoint whose blob matches it; -1 if invalid, -2 if it cannot be opened. */
static int64_t read_gen(const char *path)
{
    uint8_t *base;
    size_t len;
    frk_error err;
    if (frk_map_file(path, &base, &len, &err))
        return -2;
    frk_reader *r;
    int64_t gen = -1;
    if (frk_reader_open(base, len, 1, &r, &err) == FRK_OK) {
        const frk_node *nd = frk_reader_nodes(r);
        size_t g = dict_get(nd, 0, "gen"), t = dict_get(nd, 0, "blob");
        if (g != (size_t)-1 && t != (size_t)-1 && nd[g].tag == FRK_TAG_INT &&
            frk_reader_blob_count(r) == 1) {
            const frk_blob *bl = frk_reader_blob(r, 0);
            int good = 1;
            for (uint64_t i = 0; i < bl->length && good; i += 4093)
                good = base[bl->offset + i] == (uint8_t)(nd[g].ival & 0xff);
            if (good && bl->length)
                good = base[bl->offset + bl->length - 1] == (uint8_t)(nd[g].ival & 0xff);
            if (good)
                gen = nd[g].ival;
        }
        frk_reader_free(r);
    }
    frk_unmap(base, len);
    return gen;
}

/* commit_gen's checkpoint, written to path's temporary file and handed over (*out). */
static int write_gen(const char *path, int64_t gen, size_t n, unsigned flags, frk_pending **out,
                     frk_error *err)
{
    uint8_t *data;
    int rc;
    frk_builder *b = gen_builder(gen, n, &data, &rc, err);
    if (!rc)
        rc = frk_builder_write(b, path, flags, NULL, out, err);
    frk_builder_free(b); /* the written file no longer needs the builder */
    free(data);
    return rc;
}

/* The two halves of a commit: a written file is a temporary file only (the old checkpoint stays in
 * place, readable) until it is published; abandoned, nothing of it is left; a publish whose rename
 * fails (its directory gone) removes it and says so. */
static void test_write_then_publish_or_abandon(void)
{
    char path[512];
    frk_error err;
    frk_pending *p = NULL;
    path_in(path, sizeof path, "halves.frk");
    CHECK(commit_gen(path, 1, 1000, FRK_COMMIT_FSYNC, &err) == FRK_OK);
    CHECK(write_gen(path, 2, 3u << 20, FRK_COMMIT_FSYNC | FRK_COMMIT_DIRECT, &p, &err) == FRK_OK);
    CHECK(p != NULL);
    CHECK(read_gen(path) == 1);
    CHECK(count_temps(tmpdir, "halves.frk") == 1);
    CHECK(frk_publish(p, FRK_COMMIT_FSYNC, &err) == FRK_OK);
    CHECK(read_gen(path) == 2);
    CHECK(count_temps(tmpdir, "halves.frk") == 0);

    p = NULL;
    CHECK(write_gen(path, 3, 1000, 0, &p, &err) == FRK_OK);
    CHECK(count_temps(tmpdir, "halves.frk") == 1);
    frk_abandon(p);
    frk_abandon(NULL);
    CHECK(read_gen(path) == 2);
    CHECK(count_temps(tmpdir, "halves.frk") == 0);

    char sub[512], inner[600];
    path_in(sub, sizeof sub, "halves-dir");
    CHECK(mkdir(sub, 0777) == 0);
    snprintf(inner, sizeof inner, "%s/x.frk", sub);
    p = NULL;
    CHECK(write_gen(inner, 4, 1000, 0, &p, &err) == FRK_OK);
    char tmpname[600];
    DIR *d = opendir(sub);
    struct dirent *e;
    tmpname[0] = 0;
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) /* the one file: the temporary one */
            snprintf(tmpname, sizeof tmpname, "%s/%s", sub, e->d_name);
    if (d)
        closedir(d);
    CHECK(tmpname[0] && unlink(tmpname) == 0); /* the temporary file gone before the publish */
    CHECK(frk_publish(p, 0, &err) == FRK_EIO);
    CHECKF(strstr(err.msg, "cannot rename") != NULL, "%s", err.msg);
    CHECK(rmdir(sub) == 0); /* nothing left in it */
}

static void test_commit_replaces_atomically(void)
{
    char path[512];
    frk_error err;
    path_in(path, sizeof path, "atomic.frk");
    CHECK(commit_gen(path, 1, 1000, FRK_COMMIT_FSYNC, &err) == FRK_OK);
    CHECK(read_gen(path) == 1);

    /* a reader holding the old file keeps a valid checkpoint after the replacement */
    uint8_t *old_base;
    size_t old_len;
    CHECK(frk_map_file(path, &old_base, &old_len, &err) == FRK_OK);

    /* a child replaces it with a 48 MB checkpoint while we read it in a loop: every
     * read is a whole old or a whole new checkpoint, never a partial one */
    pid_t pid = fork();
    if (pid == 0) {
        frk_error e2;
        _exit(commit_gen(path, 2, 48u << 20, FRK_COMMIT_FSYNC, &e2) == FRK_OK ? 0 : 1);
    }
    CHECK(pid > 0);
    int seen_old = 0, seen_new = 0, seen_bad = 0, seen_tmp = 0, status = 0;
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        int64_t g = read_gen(path);
        if (g == 1)
            seen_old++;
        else if (g == 2)
            seen_new++;
        else
            seen_bad++;
        if (count_temps(tmpdir, "atomic.frk") > 0)
            seen_tmp++;
        if (w == pid || w < 0)
            break;
    }
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECKF(seen_bad == 0, "%d reads saw a partial or invalid checkpoint", seen_bad);
    CHECK(seen_new >= 1); /* the last read, after the child exited */
    CHECK(read_gen(path) == 2);
    CHECK(count_temps(tmpdir, "atomic.frk") == 0);
    note("during the replacement: %d reads saw the old file, %d the new, %d saw a temp file",
         seen_old, seen_new, seen_tmp);

    frk_reader *r;
    CHECK(frk_reader_open(old_base, old_len, 1, &r, &err) == FRK_OK);
    if (r) {
        size_t g = dict_get(frk_reader_nodes(r), 0, "gen");
        CHECK(g != (size_t)-1 && frk_reader_nodes(r)[g].ival == 1);
        frk_reader_free(r);
    }
    frk_unmap(old_base, old_len);

    /* a relative path (no slash) commits into the current directory */
    char cwd[512];
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    CHECK(chdir(tmpdir) == 0);
    CHECK(commit_gen("relative.frk", 5, 10, 0, &err) == FRK_OK);
    CHECK(read_gen("relative.frk") == 5 && count_temps(".", "relative.frk") == 0);
    CHECK(chdir(cwd) == 0);
}

/* What a forked child's commit returned, sent back through a pipe. */
typedef struct {
    int ran, rc, sys_errno;
    char msg[sizeof(((frk_error *)0)->msg)];
} child_result;

enum { CHILD_READONLY, CHILD_FSIZE };

/* Forks; the child sets up (drops to nobody / sets RLIMIT_FSIZE = limit and ignores
 * SIGXFSZ), commits gen 4 (1 MiB) to path and reports.  Returns the child's exit code. */
static int commit_in_child(int mode, const char *path, rlim_t limit, child_result *res)
{
    int fds[2];
    memset(res, 0, sizeof *res);
    if (pipe(fds))
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        if (mode == CHILD_READONLY) {
            if (geteuid() == 0 && (setgid(65534) || setuid(65534)))
                _exit(77);
        } else {
            signal(SIGXFSZ, SIG_IGN);
            struct rlimit rl = {limit, limit};
            if (setrlimit(RLIMIT_FSIZE, &rl))
                _exit(77);
        }
        child_result r;
        memset(&r, 0, sizeof r);
        frk_error e2;
        memset(&e2, 0, sizeof e2);
        r.ran = 1;
        r.rc = commit_gen(path, 4, 1u << 20, FRK_COMMIT_FSYNC, &e2);
        r.sys_errno = e2.sys_errno;
        memcpy(r.msg, e2.msg, sizeof r.msg);
        _exit(write(fds[1], &r, sizeof r) == (ssize_t)sizeof r ? 0 : 3);
    }
    close(fds[1]);
    if (pid < 0) {
        close(fds[0]);
        return -1;
    }
    size_t got = 0;
    while (got < sizeof *res) {
        ssize_t n = read(fds[0], (char *)res + got, sizeof *res - got);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fds[0]);
    if (got != sizeof *res)
        res->ran = 0;
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

static void test_commit_failures(void)
{
    char path[600], dir[512];
    frk_error err;

    /* a directory that does not exist */
    snprintf(dir, sizeof dir, "%s/no-such-dir", tmpdir);
    snprintf(path, sizeof path, "%s/ckpt.frk", dir);
    memset(&err, 0, sizeof err);
    int rc = commit_gen(path, 1, 100, FRK_COMMIT_FSYNC, &err);
    CHECKF(rc == FRK_EIO && err.status == FRK_EIO && err.sys_errno == ENOENT, "rc %d errno %d", rc,
           err.sys_errno);
    CHECKF(strstr(err.msg, dir) && strstr(err.msg, "ckpt.frk"),
           "message does not name the path: %s", err.msg);
    CHECK(access(dir, F_OK) != 0 && count_temps(tmpdir, "ckpt.frk") == 0);

    /* the target's directory component is a file */
    char filedir[512];
    path_in(filedir, sizeof filedir, "plainfile");
    CHECK(write_whole(filedir, "x", 1) == 0);
    snprintf(path, sizeof path, "%s/ckpt.frk", filedir);
    rc = commit_gen(path, 1, 100, 0, &err);
    CHECKF(rc == FRK_EIO && err.sys_errno == ENOTDIR && strstr(err.msg, filedir),
           "rc %d errno %d: %s", rc, err.sys_errno, err.msg);

    /* the target is a directory: everything is written, the rename fails, the temp goes */
    char target[600];
    path_in(target, sizeof target, "isadir.frk");
    CHECK(mkdir(target, 0755) == 0);
    rc = commit_gen(target, 1, 5000, FRK_COMMIT_FSYNC, &err);
    CHECKF(rc == FRK_EIO && err.sys_errno == EISDIR && strstr(err.msg, target),
           "rc %d errno %d: %s", rc, err.sys_errno, err.msg);
    CHECK(count_temps(tmpdir, "isadir.frk") == 0);
    struct stat st;
    CHECK(stat(target, &st) == 0 && S_ISDIR(st.st_mode));

    /* a read-only directory holding a good checkpoint (as nobody when we are root) */
    char rodir[512];
    path_in(rodir, sizeof rodir, "readonly");
    CHECK(mkdir(rodir, 0755) == 0);
    snprintf(path, sizeof path, "%s/ckpt.frk", rodir);
    CHECK(commit_gen(path, 3, 100, 0, &err) == FRK_OK);
    CHECK(chmod(rodir, 0555) == 0);
    child_result res;
    int code = commit_in_child(CHILD_READONLY, path, 0, &res);
    if (code == 77)
        note("read-only directory case not run (could not drop root privileges)");
    else if (res.ran && res.rc == FRK_OK && geteuid() == 0)
        note("read-only directory case not run (still writable after dropping privileges)");
    else {
        CHECKF(code == 0 && res.ran, "read-only directory child: exit code %d", code);
        CHECKF(res.rc == FRK_EIO &&
                   (res.sys_errno == EACCES || res.sys_errno == EPERM || res.sys_errno == EROFS),
               "read-only directory: rc %d errno %d", res.rc, res.sys_errno);
        CHECKF(strstr(res.msg, rodir) && strstr(res.msg, "ckpt.frk"),
               "message does not name the path: %s", res.msg);
        note("read-only directory: %s", res.msg);
    }
    CHECK(read_gen(path) == 3 && count_temps(rodir, "ckpt.frk") == 0);
    chmod(rodir, 0755);

    /* the file-size limit hits mid-write (RLIMIT_FSIZE, SIGXFSZ ignored) over a good file */
    path_in(path, sizeof path, "fsize.frk");
    CHECK(commit_gen(path, 6, 3000, 0, &err) == FRK_OK);
    size_t before_len = 0;
    uint8_t *before = read_whole(path, &before_len);
    for (int limit_i = 0; limit_i < 3; limit_i++) {
        static const rlim_t limits[3] = {100, 4096, 200000};
        code = commit_in_child(CHILD_FSIZE, path, limits[limit_i], &res);
        CHECKF(code == 0 && res.ran, "RLIMIT_FSIZE %llu child: exit code %d",
               (unsigned long long)limits[limit_i], code);
        CHECKF(res.rc == FRK_EIO && res.sys_errno == EFBIG, "RLIMIT_FSIZE %llu: rc %d errno %d",
               (unsigned long long)limits[limit_i], res.rc, res.sys_errno);
        CHECKF(strstr(res.msg, path) && strstr(res.msg, strerror(EFBIG)),
               "message does not name the path and EFBIG: %s", res.msg);
        if (limit_i == 0)
            note("file-size limit: %s", res.msg);
        size_t after_len = 0;
        uint8_t *after = read_whole(path, &after_len);
        CHECK(before && after && before_len == after_len && !memcmp(before, after, after_len));
        CHECK(read_gen(path) == 6 && count_temps(tmpdir, "fsize.frk") == 0);
        free(after);
    }
    free(before);
}

/* The one place the layout's numbers are restated: as docs/FORMAT.md's tables give them, so
 * that a change to csrc/layout.h that would change the format fails here. */
static void test_layout_matches_the_spec(void)
{
    CHECK(FRK_PREAMBLE_SIZE == 64 && FRK_FOOTER_SIZE == 64 && FRK_BLOB_ALIGN == 64);
    CHECK(!memcmp(FRK_PREAMBLE_MAGIC, "\x89\x46\x52\x4b\x0d\x0a\x1a\x0a", 8) &&
          !memcmp(FRK_FOOTER_MAGIC, "FRKFOOT\n", 8) && FRK_MAGIC_SIZE == 8);
    CHECK(FRK_PRE_MAGIC == 0 && FRK_PRE_VERSION == 8 && FRK_PRE_RESERVED == 12);
    CHECK(FRK_INDEX_WORD == 8 && FRK_VALUE_TAG_SIZE == 1 && FRK_VALUE_WORD == 8);
    CHECK(FRK_BLOB_OFFSET == 0 && FRK_BLOB_LENGTH == 8 && FRK_BLOB_CRC == 16 &&
          FRK_BLOB_RESERVED == 20 && FRK_BLOB_ENTRY_SIZE == 24);
    CHECK(FRK_TENSOR_KIND == 0 && FRK_TENSOR_DTYPE == 1 && FRK_TENSOR_NDIM == 2 &&
          FRK_TENSOR_RESERVED == 4 && FRK_TENSOR_BLOB == 8 && FRK_TENSOR_STORAGE_OFFSET == 16 &&
          FRK_TENSOR_HEAD_SIZE == 24 && FRK_TENSOR_DIM_SIZE == 16);
    CHECK(FRK_TENSOR_SIZE_AT(2) == 24 + 16 && FRK_TENSOR_STRIDE_AT(3, 1) == 24 + 8 * 3 + 8);
    CHECK(FRK_FOOT_INDEX_OFFSET == 0 && FRK_FOOT_INDEX_SIZE == 8 && FRK_FOOT_FILE_SIZE == 16 &&
          FRK_FOOT_INDEX_CRC == 24 && FRK_FOOT_VERSION == 28 && FRK_FOOT_RESERVED == 32 &&
          FRK_FOOT_CRC == 52 && FRK_FOOT_MAGIC == 56);
    uint8_t w[8];
    frk_put64(w, 0x0807060504030201ull);
    CHECK(w[0] == 1 && w[7] == 8 && frk_get64(w) == 0x0807060504030201ull &&
          frk_get32(w + 4) == 0x08070605u && frk_get16(w + 6) == 0x0807);
}

static void test_commit_directory_sync(void)
{
    char path[600];
    frk_error err;
    path_in(path, sizeof path, "dirsync.frk");
    CHECK(commit_gen(path, 1, 100, FRK_COMMIT_FSYNC, &err) == FRK_OK);

    /* the directory's sync fails after the rename: the new file is in place, and the error
     * says so instead of "save failed" */
    fail_dir_fsync_errno = EIO;
    memset(&err, 0, sizeof err);
    int rc = commit_gen(path, 2, 100, FRK_COMMIT_FSYNC, &err);
    fail_dir_fsync_errno = 0;
    CHECKF(rc == FRK_EIO && err.sys_errno == EIO, "rc %d errno %d", rc, err.sys_errno);
    CHECKF(strstr(err.msg, "the new checkpoint is in place at") && strstr(err.msg, path) &&
               strstr(err.msg, "syncing its directory failed") && strstr(err.msg, strerror(EIO)),
           "%s", err.msg);
    CHECK(read_gen(path) == 2 && count_temps(tmpdir, "dirsync.frk") == 0);
    note("directory sync failed: %s", err.msg);
    /* EINVAL: a file system that cannot sync a directory at all; without FRK_COMMIT_FSYNC
     * nothing is synced: neither fails */
    fail_dir_fsync_errno = EINVAL;
    CHECK(commit_gen(path, 3, 100, FRK_COMMIT_FSYNC, &err) == FRK_OK);
    fail_dir_fsync_errno = EIO;
    CHECK(commit_gen(path, 4, 100, 0, &err) == FRK_OK);
    fail_dir_fsync_errno = 0;
    CHECK(read_gen(path) == 4);

    /* the directory cannot be opened (so could not be synced): the save fails before it
     * writes anything, never silently without the sync */
    fail_dir_open_errno = EACCES;
    memset(&err, 0, sizeof err);
    rc = commit_gen(path, 5, 100, FRK_COMMIT_FSYNC, &err);
    fail_dir_open_errno = 0;
    CHECKF(rc == FRK_EIO && err.sys_errno == EACCES, "rc %d errno %d", rc, err.sys_errno);
    CHECKF(strstr(err.msg, "cannot open the directory") && strstr(err.msg, tmpdir) &&
               strstr(err.msg, "dirsync.frk"),
           "%s", err.msg);
    CHECK(read_gen(path) == 4 && count_temps(tmpdir, "dirsync.frk") == 0);
}

/* Entries of dir whose name starts with '.', other than "." and "..". */
static int count_hidden(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += e->d_name[0] == '.' && strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

/* True if name ends ".tmp.<this pid>.<16 hex digits>", the writer's temporary-name suffix. */
static int temp_suffix_ok(const char *name)
{
    char pid_part[40];
    int n = snprintf(pid_part, sizeof pid_part, ".tmp.%ld.", (long)getpid());
    size_t len = strlen(name);
    if (len < (size_t)n + 16 || strncmp(name + len - 16 - (size_t)n, pid_part, (size_t)n))
        return 0;
    for (size_t i = len - 16; i < len; i++)
        if (!strchr("0123456789abcdef", name[i]))
            return 0;
    return 1;
}

/* Names planted in the directory before the writer's commit: every name the old scheme
 * (".<name>.tmp.<pid>.<n>", n counting from 0) would have tried, and a thousand of the new
 * form with random parts of their own.  The commit still succeeds, leaves every planted file
 * as it was, and two commits do not pick one temporary name. */
static void test_commit_planted_temp_names(void)
{
    char dir[600], path[1200], planted[1400], first[4096];
    path_in(dir, sizeof dir, "planted");
    CHECK(mkdir(dir, 0755) == 0);
    snprintf(path, sizeof path, "%s/ckpt.frk", dir);
    int n_planted = 0;
    for (int i = 0; i < 1200; i++) {
        if (i < 200)
            snprintf(planted, sizeof planted, "%s/.ckpt.frk.tmp.%ld.%d", dir, (long)getpid(), i);
        else
            snprintf(planted, sizeof planted, "%s/.ckpt.frk.tmp.%ld.%016llx", dir, (long)getpid(),
                     (unsigned long long)rnd());
        n_planted += write_whole(planted, "planted", 7) == 0;
    }
    CHECK(n_planted == 1200 && count_temps(dir, "ckpt.frk") == 1200);
    frk_error err;
    for (int64_t gen = 1; gen <= 2; gen++) {
        last_synced_file[0] = 0;
        memset(&err, 0, sizeof err);
        int rc = commit_gen(path, gen, 100, FRK_COMMIT_FSYNC, &err);
        CHECKF(rc == FRK_OK, "commit %d: %s", (int)gen, err.msg);
        CHECK(read_gen(path) == gen && count_temps(dir, "ckpt.frk") == 1200);
        const char *tmp = strrchr(last_synced_file, '/');
        CHECKF(tmp && temp_suffix_ok(tmp + 1), "temporary name %s", last_synced_file);
        if (gen == 1)
            snprintf(first, sizeof first, "%s", last_synced_file);
        else
            CHECKF(strcmp(first, last_synced_file), "two commits used %s", first);
    }
    snprintf(planted, sizeof planted, "%s/.ckpt.frk.tmp.%ld.0", dir, (long)getpid());
    size_t len = 0;
    uint8_t *back = read_whole(planted, &len);
    CHECK(back && len == 7 && !memcmp(back, "planted", 7));
    free(back);
}

/* frk_builder_size before the commit is the size the commit writes: small blobs, blobs big
 * enough to start on a page, an empty one. */
static void test_builder_size_is_the_committed_size(void)
{
    static const size_t lens[] = {3, 0, (size_t)FRK_PAGE_ALIGN_MIN + 5, 100, 2 * 4096};
    enum { N = sizeof lens / sizeof *lens };
    uint8_t *data[N];
    frk_builder *b = frk_builder_new();
    frk_error err;
    uint64_t bi, ti, size = 0, written = 0;
    CHECK(b != NULL);
    CHECK(frk_builder_put_container(b, FRK_TAG_LIST, N, &err) == FRK_OK);
    for (size_t i = 0; i < N; i++) {
        data[i] = xmalloc(lens[i]);
        memset(data[i], (int)i, lens[i]);
        CHECK(frk_builder_add_blob(b, data[i], lens[i], &bi, &err) == FRK_OK);
        CHECK(frk_builder_add_tensor(b, 0, FRK_DT_U8, bi, 0, 1, (int64_t[]){(int64_t)lens[i]},
                                     (int64_t[]){1}, &ti, &err) == FRK_OK);
        CHECK(frk_builder_put_tensor(b, ti, &err) == FRK_OK);
    }
    char path[600];
    path_in(path, sizeof path, "sized.frk");
    CHECK(frk_builder_size(b, &size, &err) == FRK_OK);
    CHECKF(frk_builder_commit(b, path, 0, &written, &err) == FRK_OK, "%s", err.msg);
    struct stat st;
    CHECK(stat(path, &st) == 0);
    CHECKF(size == written && written == (uint64_t)st.st_size, "size %llu, wrote %llu, file %lld",
           (unsigned long long)size, (unsigned long long)written, (long long)st.st_size);
    frk_builder_free(b);
    for (size_t i = 0; i < N; i++)
        free(data[i]);
}

static void test_commit_long_names(void)
{
    char dir[600], path[1200], name[300];
    path_in(dir, sizeof dir, "longnames");
    CHECK(mkdir(dir, 0755) == 0);
    frk_error err;
    /* names of 240 and 255 bytes (NAME_MAX), ASCII and 2-byte UTF-8 (an odd cut would split
     * a character): the temporary name stays a valid name, UTF-8 included */
    static const struct {
        size_t bytes;
        const char *unit;
    } cases[] = {{240, "a"}, {255, "a"}, {241, "\xc3\xa9"}, {255, "\xc3\xa9"}, {200, "a"}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        size_t n = 0, u = strlen(cases[i].unit);
        while (n + u + 4 <= cases[i].bytes)
            memcpy(name + n, cases[i].unit, u), n += u;
        while (n + 4 < cases[i].bytes)
            name[n++] = 'x';
        memcpy(name + n, ".frk", 5);
        CHECK(strlen(name) == cases[i].bytes);
        snprintf(path, sizeof path, "%s/%s", dir, name);
        last_synced_file[0] = 0;
        memset(&err, 0, sizeof err);
        int rc = commit_gen(path, (int64_t)i + 1, 100, FRK_COMMIT_FSYNC, &err);
        CHECKF(rc == FRK_OK, "%zu-byte name: %s", cases[i].bytes, err.msg);
        CHECK(read_gen(path) == (int64_t)i + 1 && count_hidden(dir) == 0);
        /* the temporary file the core synced, before its rename */
        const char *tmp = strrchr(last_synced_file, '/');
        tmp = tmp ? tmp + 1 : "";
        CHECKF(tmp[0] == '.' && strlen(tmp) <= 255 && temp_suffix_ok(tmp) &&
                   frk_utf8_valid((const uint8_t *)tmp, strlen(tmp)),
               "temporary name %s", tmp);
        if (cases[i].bytes == 200) /* short enough: the plain ".<name>.tmp.<pid>.<random>" */
            CHECKF(!strncmp(tmp + 1, name, strlen(name)) &&
                       tmp + 1 + strlen(name) == strstr(tmp, ".tmp."),
                   "temporary name %s", tmp);
        else /* the start of the name and a hash of the whole */
            CHECKF(!strncmp(tmp + 1, name, 100) && strchr(tmp, '~'), "temporary name %s", tmp);
        if (i == 3)
            note("temporary name of a 255-byte name: %zu bytes", strlen(tmp));
    }
}

static void test_error_message_cut_at_a_character(void)
{
    /* a path longer than the message buffer, of 2- and 3-byte characters, in a directory
     * that does not exist: the message is cut, with "...", between characters */
    for (int pad = 0; pad < 3; pad++) {
        char path[4000];
        int n = snprintf(path, sizeof path, "%s/%.*s", tmpdir, pad, "xx");
        for (int k = 0; k < 150; k++)
            n += snprintf(path + n, sizeof path - (size_t)n, "\xc3\xa9\xe2\x82\xac");
        snprintf(path + n, sizeof path - (size_t)n, "/ckpt.frk");
        frk_error err;
        memset(&err, 0, sizeof err);
        CHECK(commit_gen(path, 1, 10, FRK_COMMIT_FSYNC, &err) == FRK_EIO);
        size_t len = strlen(err.msg);
        CHECKF(len < sizeof err.msg && len > sizeof err.msg - 8 &&
                   !strcmp(err.msg + len - 3, "...") &&
                   frk_utf8_valid((const uint8_t *)err.msg, len),
               "pad %d: %zu bytes, ends %s", pad, len, err.msg + (len > 10 ? len - 10 : 0));
    }
}

/* ---- reader: damaged real files ---------------------------------------------------------- */

/* A small real checkpoint (the round-trip tree) as bytes. */
static uint8_t *small_checkpoint(size_t *len)
{
    char path[512];
    path_in(path, sizeof path, "small.frk");
    return make_roundtrip_file(path, len);
}

static void test_truncation_every_offset(void)
{
    size_t len;
    uint8_t *img = small_checkpoint(&len);
    if (!img)
        return;
    frk_error err;
    CHECK(open_copy(img, len, 1, &err) == FRK_OK); /* control */
    int bad = 0;
    for (size_t k = 0; k < len; k++) {
        /* the first k bytes, and the file without its first len-k bytes */
        int rc1 = open_copy(img, k, 1, &err);
        int rc2 = open_copy(img + (len - k), k, 1, &err);
        if (rc1 != FRK_ECORRUPT || rc2 != FRK_ECORRUPT)
            bad += !CHECKF(0, "truncated to %zu of %zu bytes: rc %d / %d", k, len, rc1, rc2);
    }
    /* extra bytes after the footer, or before the preamble */
    for (size_t extra = 1; extra <= 130; extra++) {
        uint8_t *g = xmalloc(len + extra);
        memcpy(g, img, len);
        memset(g + len, 0, extra);
        int rc1 = open_copy(g, len + extra, 1, &err);
        memset(g, 0, extra);
        memcpy(g + extra, img, len);
        int rc2 = open_copy(g, len + extra, 1, &err);
        if (rc1 != FRK_ECORRUPT || rc2 != FRK_ECORRUPT)
            bad += !CHECKF(0, "%zu extra bytes: rc %d / %d", extra, rc1, rc2);
        free(g);
    }
    /* through files and frk_map_file */
    char path[512];
    path_in(path, sizeof path, "trunc.frk");
    size_t cuts[] = {0, 1, 8, 127, 128, 129, len / 2, len - 65, len - 64, len - 8, len - 1};
    for (size_t c = 0; c < sizeof cuts / sizeof *cuts; c++) {
        CHECK(write_whole(path, img, cuts[c]) == 0);
        uint8_t *base = NULL;
        size_t blen = 0;
        int rc = frk_map_file(path, &base, &blen, &err);
        if (rc == FRK_OK) {
            frk_reader *r;
            rc = frk_reader_open(base, blen, 1, &r, &err);
            frk_unmap(base, blen);
        }
        CHECKF(rc == FRK_ECORRUPT && strlen(err.msg) > 0, "file cut to %zu: rc %d", cuts[c], rc);
        if (cuts[c] < 128)
            CHECKF(strstr(err.msg, path) && strstr(err.msg, "too short"), "%s", err.msg);
        for (unsigned copy = 0; copy < 2; copy++) { /* frk_load_file: its message names the file */
            rc = frk_load_file(path, (copy ? FRK_LOAD_COPY : 0u) | FRK_LOAD_VERIFY, &base, &blen,
                               &err);
            CHECKF(rc == FRK_ECORRUPT && !strncmp(err.msg, path, strlen(path)),
                   "file cut to %zu, copy %u: rc %d %s", cuts[c], copy, rc, rc ? err.msg : "");
            if (rc == FRK_OK)
                frk_unmap(base, blen);
        }
    }
    CHECK(write_whole(path, img, len) == 0); /* control: the whole file maps and opens */
    {
        uint8_t *m;
        size_t ml;
        frk_reader *r;
        CHECK(frk_map_file(path, &m, &ml, &err) == FRK_OK && ml == len);
        if (ml == len) {
            CHECK(frk_reader_open(m, ml, 1, &r, &err) == FRK_OK);
            frk_reader_free(r);
            frk_unmap(m, ml);
        }
    }
    /* not a regular file, and a missing file */
    uint8_t *base;
    size_t blen;
    CHECK(frk_map_file(tmpdir, &base, &blen, &err) == FRK_ECORRUPT &&
          strstr(err.msg, "not a regular file"));
    /* a FIFO with no writer: refused at once, not a blocked open() (SIGALRM ends a hang) */
    path_in(path, sizeof path, "fifo.frk");
    CHECK(mkfifo(path, 0600) == 0);
    alarm(20);
    CHECK(frk_map_file(path, &base, &blen, &err) == FRK_ECORRUPT &&
          strstr(err.msg, "not a regular file") && strstr(err.msg, path));
    alarm(0);
    path_in(path, sizeof path, "missing.frk");
    CHECK(frk_map_file(path, &base, &blen, &err) == FRK_EIO && err.sys_errno == ENOENT &&
          strstr(err.msg, path));
    CHECK(bad == 0);
    free(img);
}

/* covered[i] = 1 where byte i is checked by magic, version, a zero test or a CRC. */
static uint8_t *covered_map(const uint8_t *img, size_t len, size_t *n_covered)
{
    uint8_t *cov = xmalloc(len);
    memset(cov, 0, len);
    memset(cov, 1, FRK_PREAMBLE_SIZE);
    uint64_t ioff = frk_get64(img + len - FRK_FOOTER_SIZE + FRK_FOOT_INDEX_OFFSET);
    memset(cov + ioff, 1, len - ioff);
    frk_reader *r;
    frk_error err;
    if (frk_reader_open(img, len, 1, &r, &err) == FRK_OK) {
        for (size_t i = 0; i < frk_reader_blob_count(r); i++) {
            const frk_blob *bl = frk_reader_blob(r, i);
            memset(cov + bl->offset, 1, (size_t)bl->length);
        }
        frk_reader_free(r);
    }
    *n_covered = 0;
    for (size_t i = 0; i < len; i++)
        *n_covered += cov[i];
    return cov;
}

static void test_bit_flips(void)
{
    size_t len, n_cov;
    uint8_t *img = small_checkpoint(&len);
    if (!img)
        return;
    uint8_t *cov = covered_map(img, len, &n_cov);
    frk_error err;
    CHECK(open_copy(img, len, 1, &err) == FRK_OK);
    CHECK(n_cov > len / 2 && n_cov < len); /* the round-trip file has padding */
    int bad = 0, pad_accepted = 0, n_pad = 0;
    size_t n_opens = 0;
    /* every bit of every covered byte */
    for (size_t i = 0; i < len; i++) {
        for (int bit = 0; bit < 8; bit++) {
            img[i] ^= (uint8_t)(1u << bit);
            int rc = open_copy(img, len, 1, &err);
            n_opens++;
            img[i] ^= (uint8_t)(1u << bit);
            if (cov[i]) {
                if (rc != FRK_ECORRUPT)
                    bad += !CHECKF(0, "bit %d of byte %zu flipped: rc %d", bit, i, rc);
            } else {
                n_pad++;
                pad_accepted += rc == FRK_OK;
            }
        }
    }
    /* random multi-byte damage confined to covered bytes */
    size_t *cidx = xmalloc(n_cov * sizeof *cidx);
    for (size_t i = 0, j = 0; i < len; i++)
        if (cov[i])
            cidx[j++] = i;
    for (int trial = 0; trial < 20000; trial++) {
        int nflip = 1 + (int)rnd_below(4);
        size_t at[4];
        uint8_t x[4];
        for (int f = 0; f < nflip; f++) {
            at[f] = cidx[rnd_below(n_cov)];
            x[f] = (uint8_t)(1 + rnd_below(255));
            img[at[f]] ^= x[f];
        }
        int same = 1; /* flips that cancel out leave the image unchanged */
        for (int f = 0; f < nflip; f++) {
            uint8_t acc = 0;
            for (int g = 0; g < nflip; g++)
                if (at[g] == at[f])
                    acc ^= x[g];
            same &= acc == 0;
        }
        int rc = open_copy(img, len, 1, &err);
        n_opens++;
        for (int f = nflip - 1; f >= 0; f--)
            img[at[f]] ^= x[f];
        if (same ? rc != FRK_OK : rc != FRK_ECORRUPT)
            bad += !CHECKF(0, "trial %d (%d flips, first at %zu): rc %d", trial, nflip, at[0], rc);
    }
    CHECK(open_copy(img, len, 1, &err) == FRK_OK); /* restored */
    /* with verify=0 a flipped blob byte passes the open, and verify_blob catches it */
    frk_reader *r;
    CHECK(frk_reader_open(img, len, 1, &r, &err) == FRK_OK);
    if (r) {
        const frk_blob *bl = frk_reader_blob(r, 1);
        size_t at = (size_t)bl->offset + 3;
        frk_reader_free(r);
        uint8_t *c = dup_mem(img, len);
        c[at] ^= 0x10;
        CHECK(frk_reader_open(c, len, 0, &r, &err) == FRK_OK);
        if (r) {
            CHECK(frk_reader_verify_blob(r, 0, &err) == FRK_OK);
            CHECK(frk_reader_verify_blob(r, 1, &err) == FRK_ECORRUPT &&
                  strstr(err.msg, "checksum mismatch in blob 1"));
            frk_reader_free(r);
        }
        CHECK(frk_reader_open(c, len, 1, &r, &err) == FRK_ECORRUPT &&
              strstr(err.msg, "checksum mismatch in blob 1"));
        free(c);
    }
    CHECK(bad == 0);
    note("%zu-byte file, %zu covered bytes, %zu opens; %d/%d padding-bit flips were accepted "
         "(padding is not checked)",
         len, n_cov, n_opens, pad_accepted, n_pad);
    free(cidx);
    free(cov);
    free(img);
}

/* Patching a real file's index and resealing: structural checks still apply. */
static void test_patched_real_file(void)
{
    size_t len;
    uint8_t *img = small_checkpoint(&len);
    if (!img)
        return;
    frk_error err;
    uint64_t ioff = frk_get64(img + len - FRK_FOOTER_SIZE + FRK_FOOT_INDEX_OFFSET);
    uint8_t *ix = img + ioff;
    uint64_t nb = frk_get64(ix);
    /* tensor 0: f32 [2,3] strides [3,1] */
    size_t t0 = FRK_INDEX_WORD + FRK_BLOB_ENTRY_SIZE * (size_t)nb + FRK_INDEX_WORD;
    size_t blob0 = FRK_INDEX_WORD, blob1 = FRK_INDEX_WORD + FRK_BLOB_ENTRY_SIZE;
    CHECK(ix[t0 + FRK_TENSOR_DTYPE] == FRK_DT_F32 && frk_get16(ix + t0 + FRK_TENSOR_NDIM) == 2 &&
          frk_get64(ix + t0 + FRK_TENSOR_SIZE_AT(0)) == 2);
    size_t stride0 = (size_t)ioff + t0 + FRK_TENSOR_STRIDE_AT(2, 0);

    uint8_t *c = dup_mem(img, len);
    CHECK(reseal(c, len) == 0 && open_copy(c, len, 1, &err) == FRK_OK); /* reseal is a no-op */
    frk_put64(c + stride0, 4); /* stride[0] = 4: [1][2] at element 6 > 5 */
    CHECK(open_copy(c, len, 1, &err) == FRK_ECORRUPT && strstr(err.msg, "index checksum"));
    reseal(c, len);
    expect_corrupt_img("real file, stride 4", c, len, "needs 28 bytes");
    frk_put64(c + stride0, 2); /* stride[0] = 2 overlaps itself but fits: valid */
    reseal(c, len);
    CHECK(open_copy(c, len, 1, &err) == FRK_OK);
    /* blob 1 moved onto blob 0 */
    memcpy(c, img, len);
    frk_put64(c + ioff + blob1 + FRK_BLOB_OFFSET, frk_get64(c + ioff + blob0 + FRK_BLOB_OFFSET));
    reseal_blobs(c, len);
    expect_corrupt_img("real file, blob 1 onto blob 0", c, len, "overlaps");
    /* blob 0 claims the whole file */
    memcpy(c, img, len);
    frk_put64(c + ioff + blob0 + FRK_BLOB_LENGTH, len);
    reseal(c, len);
    expect_corrupt_img("real file, blob 0 is the whole file", c, len, "outside");
    free(c);
    free(img);
}

/* ---- reader: hostile hand-built files with valid checksums -------------------------------- */

/* An image with the default data area and these exact index bytes, sealed; with
 * fix_blob0, the first blob entry's CRC is computed.  why == NULL: must be valid. */
static void expect_corrupt_raw(const char *what, const uint8_t *ix, size_t n, int fix_blob0,
                               const char *why)
{
    size_t len = H_DATA_END + n + FRK_FOOTER_SIZE;
    uint8_t *img = xmalloc(len);
    memset(img, 0, len);
    memcpy(img + FRK_PRE_MAGIC, FRK_PREAMBLE_MAGIC, FRK_MAGIC_SIZE);
    frk_put32(img + FRK_PRE_VERSION, FRK_FORMAT_VERSION);
    for (size_t i = FRK_PREAMBLE_SIZE; i < H_DATA_END; i++)
        img[i] = (uint8_t)(i * 37 + 11);
    memcpy(img + H_DATA_END, ix, n);
    if (fix_blob0) {
        const uint8_t *e = ix + FRK_INDEX_WORD;
        frk_put32(img + H_DATA_END + FRK_INDEX_WORD + FRK_BLOB_CRC,
                  frk_crc32c(0, img + frk_get64(e + FRK_BLOB_OFFSET),
                             (size_t)frk_get64(e + FRK_BLOB_LENGTH)));
    }
    uint8_t *foot = img + len - FRK_FOOTER_SIZE;
    frk_put64(foot + FRK_FOOT_INDEX_OFFSET, H_DATA_END);
    frk_put64(foot + FRK_FOOT_INDEX_SIZE, n);
    frk_put64(foot + FRK_FOOT_FILE_SIZE, len);
    frk_put32(foot + FRK_FOOT_VERSION, FRK_FORMAT_VERSION);
    memcpy(foot + FRK_FOOT_MAGIC, FRK_FOOTER_MAGIC, FRK_MAGIC_SIZE);
    reseal(img, len);
    if (why)
        expect_corrupt_img(what, img, len, why);
    else {
        frk_error err;
        CHECKF(open_copy(img, len, 1, &err) == FRK_OK, "raw control: %s", err.msg);
    }
    free(img);
}

static void test_hostile_control(void)
{
    hspec s;
    hspec_default(&s);
    expect_valid("default hand-built image", &s);
    size_t len;
    uint8_t *img = hspec_image(&s, &len);
    frk_reader *r;
    frk_error err;
    CHECK(frk_reader_open(img, len, 1, &r, &err) == FRK_OK);
    if (r) {
        CHECK(frk_reader_blob_count(r) == 2 && frk_reader_tensor_count(r) == 2 &&
              frk_reader_node_count(r) == 7);
        frk_reader_free(r);
    }
    /* the same tree through the builder gives the same index bytes (same layout as the spec) */
    frk_builder *b = frk_builder_new();
    uint64_t bi, ti;
    frk_builder_add_blob(b, img + 64, 96, &bi, &err);
    frk_builder_add_blob(b, img + 192, 40, &bi, &err);
    frk_builder_add_tensor(b, 0, FRK_DT_F32, 0, 0, 2, (int64_t[]){4, 6}, (int64_t[]){6, 1}, &ti,
                           &err);
    frk_builder_add_tensor(b, 1, FRK_DT_I64, 1, 0, 1, (int64_t[]){5}, (int64_t[]){1}, &ti, &err);
    frk_builder_put_container(b, FRK_TAG_DICT, 2, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "w", 1, &err);
    frk_builder_put_tensor(b, 0, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "v", 1, &err);
    frk_builder_put_container(b, FRK_TAG_LIST, 2, &err);
    frk_builder_put_tensor(b, 1, &err);
    frk_builder_put_int(b, 7, &err);
    char path[512];
    path_in(path, sizeof path, "hcontrol.frk");
    CHECK(frk_builder_commit(b, path, 0, NULL, &err) == FRK_OK);
    frk_builder_free(b);
    size_t flen;
    uint8_t *file = read_whole(path, &flen);
    /* the builder puts the index right after blob 1 (at 232), the hand-built image at 256,
     * and zero-fills the padding 160..192: otherwise the bytes are the same, index included */
    size_t ilen = len - 256 - 64;
    CHECK(file && flen + 24 == len && !memcmp(file, img, 160) &&
          !memcmp(file + 192, img + 192, 40) && !memcmp(file + 232, img + 256, ilen));
    CHECK(file && flen + 24 == len && file[160] == 0 && !memcmp(file + 160, file + 161, 31));
    if (file && flen + 24 == len) {
        const uint8_t *ff = file + flen - FRK_FOOTER_SIZE, *hf = img + len - FRK_FOOTER_SIZE;
        CHECK(frk_get64(ff + FRK_FOOT_INDEX_OFFSET) == 232 &&
              frk_get64(ff + FRK_FOOT_INDEX_SIZE) == ilen &&
              frk_get64(hf + FRK_FOOT_INDEX_SIZE) == ilen &&
              frk_get64(ff + FRK_FOOT_FILE_SIZE) == flen &&
              frk_get32(ff + FRK_FOOT_INDEX_CRC) == frk_get32(hf + FRK_FOOT_INDEX_CRC) &&
              !memcmp(ff + FRK_FOOT_VERSION, hf + FRK_FOOT_VERSION,
                      FRK_FOOT_CRC - FRK_FOOT_VERSION) &&
              !memcmp(ff + FRK_FOOT_MAGIC, hf + FRK_FOOT_MAGIC, FRK_MAGIC_SIZE));
    }
    free(file);
    free(img);
    hspec_free(&s);
}

static void test_hostile_blobs(void)
{
    hspec s;
    hspec_default(&s);
    s.blobs[1].off = 128; /* inside blob 0 (64..160) */
    s.blobs[1].len = 32;
    expect_corrupt("overlapping blobs", &s, "overlaps another");
    s.blobs[1].off = 64; /* same start as blob 0 */
    expect_corrupt("blob 1 on blob 0", &s, "overlaps another");
    s.blobs[0] = (hblob){128, 64, 0, 0, 0}; /* out of order */
    s.blobs[1] = (hblob){64, 40, 0, 0, 0};
    s.tensors[0].sizes[0] = 2, s.tensors[0].sizes[1] = 8, s.tensors[0].strides[0] = 8;
    expect_corrupt("blobs out of order", &s, "overlaps another");
    hspec_free(&s);

    hspec_default(&s);
    s.blobs[1].len = 1000; /* runs into the index and past the file */
    expect_corrupt("blob past the data area", &s, "outside the data area");
    s.blobs[1].len = 65; /* ends at 257, one byte into the index */
    expect_corrupt("blob one byte into the index", &s, "outside the data area");
    s.blobs[1].len = 64; /* ends exactly at the index: fine */
    expect_valid("blob ending at the index", &s);
    s.blobs[1].off = 1ull << 40;
    s.blobs[1].len = 8;
    expect_corrupt("blob far past the end", &s, "outside the data area");
    s.blobs[1].off = 192;
    s.blobs[1].len = UINT64_MAX - 100; /* offset + length overflows */
    expect_corrupt("blob length overflow", &s, "outside the data area");
    s.blobs[1].off = 193;
    s.blobs[1].len = 40;
    expect_corrupt("misaligned blob", &s, "overlaps another or lies outside");
    s.blobs[1].off = 0; /* in the preamble */
    expect_corrupt("blob in the preamble", &s, "lies outside");
    s.blobs[1].off = 192;
    s.blobs[1].resv = 1;
    expect_corrupt("blob entry reserved bytes", &s, "blob 1");
    s.blobs[1].resv = 0;
    s.blobs[1].fixed_crc = 1;
    s.blobs[1].crc = 0x12345678;
    {
        size_t len;
        uint8_t *img = hspec_image(&s, &len);
        frk_error err;
        CHECK(open_copy(img, len, 1, &err) == FRK_ECORRUPT &&
              strstr(err.msg, "checksum mismatch in blob 1"));
        CHECK(open_copy(img, len, 0, &err) == FRK_OK); /* verify=0 skips blob CRCs only */
        free(img);
    }
    hspec_free(&s);

    /* huge blob counts with a small index */
    static const uint64_t counts[] = {3,         1000, 1ull << 32, 1ull << 60, UINT64_MAX / 24 + 1,
                                      UINT64_MAX};
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) {
        hspec_default(&s);
        s.has_nb_claim = 1;
        s.nb_claim = counts[i];
        char what[64];
        snprintf(what, sizeof what, "blob count %llu", (unsigned long long)counts[i]);
        /* 3 blobs read the tensor count as a blob entry: rejected one way or another */
        expect_corrupt(what, &s, i == 0 ? "blob 2" : "does not fit in the index");
        hspec_free(&s);
    }
    /* zero blobs and zero tensors, tree None: valid */
    hspec_default(&s);
    s.nb = 0;
    s.nt = 0;
    t_tag(hspec_tree(&s), FRK_TAG_NONE);
    expect_valid("no blobs, no tensors", &s);
    /* empty blobs may share an offset */
    s.nb = 3;
    s.blobs[0] = (hblob){64, 0, 0, 0, 0};
    s.blobs[1] = (hblob){64, 0, 0, 0, 0};
    s.blobs[2] = (hblob){64, 192, 0, 0, 0};
    expect_valid("empty blobs at one offset", &s);
    hspec_free(&s);
}

static void test_hostile_tensors(void)
{
    hspec s;
    static const uint64_t counts[] = {3, 1000, 1ull << 40, UINT64_MAX / 24 + 1, UINT64_MAX};
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) {
        hspec_default(&s);
        s.has_nt_claim = 1;
        s.nt_claim = counts[i];
        char what[64];
        snprintf(what, sizeof what, "tensor count %llu", (unsigned long long)counts[i]);
        expect_corrupt(what, &s, i == 0 ? "tensor " : "tensor count");
        hspec_free(&s);
    }

    struct {
        const char *what, *why;
        uint8_t kind, dtype;
        uint64_t blob, soff;
        unsigned ndim;
        int64_t sizes[3], strides[3];
    } cases[] = {
        /* blob 0 holds 96 bytes = 24 float32 */
        {"25 elements in a 24-element blob", "needs 100 bytes", 0, FRK_DT_F32, 0, 0, 1, {25}, {1}},
        {"storage offset past the end", "needs 100 bytes", 0, FRK_DT_F32, 0, 1, 1, {24}, {1}},
        {"stride pushes past the end", "needs 108 bytes", 0, FRK_DT_F32, 0, 0, 2, {4, 6}, {6, 1}},
        {"shape x stride larger than the blob", "needs", 0, FRK_DT_F32, 0, 0, 2, {2, 3}, {100, 1}},
        {"float64 view of a float32 blob", "needs 192 bytes", 0, FRK_DT_F64, 0, 0, 1, {24}, {1}},
        {"huge storage offset",
         "impossible shape or stride",
         0,
         FRK_DT_F32,
         0,
         UINT64_MAX,
         1,
         {1},
         {1}},
        {"storage offset x item overflows",
         "impossible shape or stride",
         0,
         FRK_DT_F32,
         0,
         (1ull << 62),
         1,
         {1},
         {1}},
        {"empty tensor with an offset past the blob",
         "needs 0 bytes",
         0,
         FRK_DT_F32,
         0,
         25,
         1,
         {0},
         {1}},
        {"shape product overflow",
         "impossible shape",
         0,
         FRK_DT_U8,
         0,
         0,
         3,
         {1ll << 32, 1ll << 32, 2},
         {0, 0, 0}},
        {"shape product overflow, then 0",
         "impossible shape",
         0,
         FRK_DT_U8,
         0,
         0,
         3,
         {1ll << 40, 1ll << 40, 0},
         {0, 0, 0}},
        {"size x stride overflow",
         "impossible shape or stride",
         0,
         FRK_DT_U8,
         0,
         0,
         2,
         {1ll << 33, 2},
         {1ll << 33, 1}},
        /* torch and NumPy count elements and bytes in int64: a broadcast (stride 0) shape
         * fits a one-element blob, but no loader could build it */
        {"broadcast numel x 4 over int64",
         "impossible shape",
         0,
         FRK_DT_F32,
         0,
         0,
         2,
         {1ll << 31, 1ll << 31},
         {0, 0}},
        {"broadcast numel over int64",
         "impossible shape",
         0,
         FRK_DT_U8,
         0,
         0,
         2,
         {1ll << 62, 3},
         {0, 0}},
        {"empty, huge non-zero dims",
         "impossible shape",
         0,
         FRK_DT_F32,
         0,
         0,
         3,
         {0, 1ll << 62, 1ll << 62},
         {0, 0, 0}},
        {"size-1 dim, byte stride over int64",
         "impossible stride",
         0,
         FRK_DT_F32,
         0,
         0,
         2,
         {1, 6},
         {1ll << 62, 1}},
        /* a view that reaches inside its blob but holds more bytes than the blob stores
         * (stride 0, expand): copying it would turn a small file into a huge allocation */
        {"broadcast (stride 0), 2^60 elements",
         "may not be larger than its stored bytes",
         0,
         FRK_DT_F32,
         0,
         0,
         2,
         {1ll << 30, 1ll << 30},
         {0, 0}},
        {"overlapping rows, 120 bytes of a 96-byte blob",
         "holds 120 bytes of elements",
         0,
         FRK_DT_F32,
         0,
         0,
         2,
         {5, 6},
         {0, 1}},
        {"negative stride", "impossible shape or stride", 0, FRK_DT_F32, 0, 10, 1, {2}, {-1}},
        {"negative stride on a size-1 dim",
         "impossible shape or stride",
         0,
         FRK_DT_F32,
         0,
         0,
         1,
         {1},
         {-1}},
        {"INT64_MIN stride on a size-1 dim",
         "impossible shape or stride",
         0,
         FRK_DT_F32,
         0,
         0,
         2,
         {1, 3},
         {INT64_MIN, 1}},
        {"negative stride on an empty dim",
         "impossible shape or stride",
         0,
         FRK_DT_F32,
         0,
         0,
         2,
         {0, 2},
         {1, -1}},
        {"negative size", "impossible shape", 0, FRK_DT_F32, 0, 0, 1, {-1}, {1}},
        {"INT64_MIN size", "impossible shape", 0, FRK_DT_F32, 0, 0, 1, {INT64_MIN}, {1}},
        {"bad dtype code 21", "unknown dtype code 21", 0, FRK_DT_COUNT, 0, 0, 1, {1}, {1}},
        {"bad dtype code 255", "unknown dtype code 255", 0, 255, 0, 0, 1, {1}, {1}},
        {"bad kind 2", "unknown kind 2", 2, FRK_DT_F32, 0, 0, 1, {1}, {1}},
        {"NumPy bfloat16", "not a NumPy dtype", FRK_KIND_NUMPY, FRK_DT_BF16, 0, 0, 1, {4}, {1}},
        {"NumPy complex32", "not a NumPy dtype", FRK_KIND_NUMPY, FRK_DT_C32, 0, 0, 1, {4}, {1}},
        {"NumPy float8", "not a NumPy dtype", FRK_KIND_NUMPY, FRK_DT_F8_E5M2, 0, 0, 1, {4}, {1}},
        {"blob index out of range", "refers to blob 2 of 2", 0, FRK_DT_F32, 2, 0, 1, {1}, {1}},
        {"blob index UINT64_MAX", "refers to blob", 0, FRK_DT_F32, UINT64_MAX, 0, 1, {1}, {1}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        hspec_default(&s);
        ht_set(&s.tensors[0], cases[i].kind, cases[i].dtype, cases[i].blob, cases[i].soff,
               cases[i].ndim, cases[i].sizes, cases[i].strides);
        if (i == 2)
            s.tensors[0].strides[0] = 7; /* [3][5] is element 26 */
        expect_corrupt(cases[i].what, &s, cases[i].why);
        hspec_free(&s);
    }
    /* controls on the edge of each check */
    struct {
        const char *what;
        uint8_t dtype;
        uint64_t soff;
        unsigned ndim;
        int64_t sizes[3], strides[3];
    } valid[] = {
        {"exactly the blob", FRK_DT_F32, 0, 1, {24}, {1}},
        {"offset + rest is the blob", FRK_DT_F32, 23, 1, {1}, {1}},
        {"overlapping (stride 0) but no larger than the blob", FRK_DT_F32, 0, 2, {4, 6}, {0, 1}},
        {"empty tensor at the blob's end", FRK_DT_F32, 24, 1, {0}, {1}},
        {"empty with huge stride", FRK_DT_F32, 0, 2, {0, 5}, {1ll << 62, 1ll << 62}},
        {"0-d scalar at the last element", FRK_DT_F32, 23, 0, {0}, {0}},
        {"complex128 x 6", FRK_DT_C128, 0, 1, {6}, {1}},
        {"dtype code 20 (last)", FRK_DT_F8_E8M0FNU, 0, 1, {96}, {1}},
    };
    for (size_t i = 0; i < sizeof valid / sizeof *valid; i++) {
        hspec_default(&s);
        ht_set(&s.tensors[0], 0, valid[i].dtype, 0, valid[i].soff, valid[i].ndim, valid[i].sizes,
               valid[i].strides);
        expect_valid(valid[i].what, &s);
        hspec_free(&s);
    }
    /* NumPy arrays of the dtypes NumPy has, beside the codes it lacks */
    static const uint8_t numpy_dtypes[] = {FRK_DT_BOOL, FRK_DT_F16, FRK_DT_F64, FRK_DT_C64,
                                           FRK_DT_C128};
    for (size_t i = 0; i < sizeof numpy_dtypes; i++) {
        hspec_default(&s);
        ht_set(&s.tensors[0], FRK_KIND_NUMPY, numpy_dtypes[i], 0, 0, 1, (int64_t[]){4},
               (int64_t[]){1});
        expect_valid("a NumPy array of a NumPy dtype", &s);
        hspec_free(&s);
    }

    /* ndim */
    hspec_default(&s);
    int64_t ones[H_MAXDIM];
    for (int d = 0; d < H_MAXDIM; d++)
        ones[d] = 1;
    ht_set(&s.tensors[0], 0, FRK_DT_F32, 0, 0, FRK_MAX_NDIM, ones, ones);
    expect_valid("ndim 32", &s);
    ht_set(&s.tensors[0], 0, FRK_DT_F32, 0, 0, FRK_MAX_NDIM + 1, ones, ones);
    expect_corrupt("ndim 33", &s, "33 dimensions");
    ht_set(&s.tensors[0], 0, FRK_DT_F32, 0, 0, 40, ones, ones);
    expect_corrupt("ndim 40", &s, "40 dimensions");
    s.tensors[0].ndim = 65535;
    expect_corrupt("ndim 65535", &s, "65535 dimensions");
    ht_set(&s.tensors[1], 1, FRK_DT_I64, 1, 0, 8, ones, ones);
    s.tensors[0] = s.tensors[1];
    s.nt = 1;
    s.tensors[0].dims_written = 0; /* claims 8 dims, the index ends first */
    t_tag(hspec_tree(&s), FRK_TAG_NONE);
    expect_corrupt("ndim past the index end", &s, "more than the index holds");
    hspec_free(&s);

    hspec_default(&s);
    s.tensors[1].resv = 0x100;
    expect_corrupt("tensor reserved bytes", &s, "tensor 1 has reserved bytes set");
    hspec_free(&s);

    /* the tensor table claims 2 tensors but only has room for one head */
    hspec_default(&s);
    s.nt = 1;
    s.has_nt_claim = 1;
    s.nt_claim = 2;
    t_tag(hspec_tree(&s), FRK_TAG_NONE);
    /* the count fits (2 x 24 <= 56 + 9 bytes left), but only 9 bytes follow tensor 0 */
    expect_corrupt("tensor table ends early", &s, "tensor table ends early at tensor 1");
    hspec_free(&s);
}

/* Tree cases share the default blobs and tensors. */
static void tree_case(const char *what, const uint8_t *bytes, size_t n, const char *why)
{
    hspec s;
    hspec_default(&s);
    bb *t = hspec_tree(&s);
    bb_put(t, bytes, n);
    if (why)
        expect_corrupt(what, &s, why);
    else
        expect_valid(what, &s);
    hspec_free(&s);
}

static void test_hostile_tree(void)
{
    bb t = {0};
    /* nesting: FRK_MAX_DEPTH levels below the root are fine, one more is not */
    for (unsigned depth = FRK_MAX_DEPTH - 1; depth <= FRK_MAX_DEPTH + 2; depth++) {
        for (int kind = 0; kind < 3; kind++) {
            t.len = 0;
            for (unsigned i = 0; i < depth; i++) {
                if (kind == 0)
                    t_word(&t, FRK_TAG_LIST, 1);
                else if (kind == 1)
                    t_word(&t, FRK_TAG_TUPLE, 1);
                else {
                    t_word(&t, FRK_TAG_DICT, 1);
                    t_word(&t, FRK_TAG_INT, i);
                }
            }
            t_tag(&t, FRK_TAG_NONE);
            char what[64];
            snprintf(what, sizeof what, "nesting %u (kind %d)", depth, kind);
            tree_case(what, t.p, t.len, depth <= FRK_MAX_DEPTH ? NULL : "nested deeper than 64");
        }
    }
    /* very deep: 200000 nested lists (must not recurse that deep) */
    t.len = 0;
    for (int i = 0; i < 200000; i++)
        t_word(&t, FRK_TAG_LIST, 1);
    t_tag(&t, FRK_TAG_NONE);
    tree_case("nesting 200000", t.p, t.len, "nested deeper");

    /* strings */
    t.len = 0;
    t_word(&t, FRK_TAG_STR, 1000);
    bb_put(&t, "abc", 3);
    tree_case("string claims 1000 bytes, 3 remain", t.p, t.len, "claims 1000 bytes, only 3");
    t.len = 0;
    t_word(&t, FRK_TAG_BYTES, 4);
    bb_put(&t, "abc", 3);
    tree_case("bytes claims 4, 3 remain", t.p, t.len, "claims 4 bytes, only 3");
    t.len = 0;
    t_word(&t, FRK_TAG_STR, UINT64_MAX);
    bb_put(&t, "abc", 3);
    tree_case("string claims 2^64-1 bytes", t.p, t.len, "claims");
    t.len = 0;
    t_word(&t, FRK_TAG_LIST, 2);
    t_word(&t, FRK_TAG_STR, 10);
    bb_put(&t, "0123456789", 10);
    t_word(&t, FRK_TAG_BYTES, 2);
    bb_put(&t, "xyz", 3); /* one stray byte: it is not part of the string */
    tree_case("stray byte after a string", t.p, t.len, "1 stray bytes");
    t.len = 0;
    t_word(&t, FRK_TAG_LIST, 2);
    t_word(&t, FRK_TAG_STR, 10);
    bb_put(&t, "0123456789", 10);
    t_word(&t, FRK_TAG_BYTES, 3);
    bb_put(&t, "xyz", 3);
    tree_case("control: exact strings", t.p, t.len, NULL);

    static const struct {
        const char *what, *s;
    } bad_utf8[] = {
        {"overlong '/' (2 bytes)", "\xc0\xaf"}, {"overlong NUL", "\xc0\x80"},
        {"overlong (3 bytes)", "\xe0\x80\xaf"}, {"overlong (4 bytes)", "\xf0\x80\x80\xaf"},
        {"surrogate D800", "\xed\xa0\x80"},     {"surrogate DFFF", "\xed\xbf\xbf"},
        {"above U+10FFFF", "\xf4\x90\x80\x80"}, {"5-byte form", "\xf8\x88\x80\x80\x80"},
        {"lone continuation", "a\x80"},         {"truncated 3-byte at end", "ok\xe2\x82"},
        {"bad continuation", "\xe2\x28\xa1"},   {"0xff", "\xff"},
    };
    for (size_t i = 0; i < sizeof bad_utf8 / sizeof *bad_utf8; i++) {
        t.len = 0;
        t_str(&t, FRK_TAG_STR, bad_utf8[i].s, strlen(bad_utf8[i].s));
        tree_case(bad_utf8[i].what, t.p, t.len, "not valid UTF-8");
        t.len = 0; /* the same bytes as bytes are fine */
        t_str(&t, FRK_TAG_BYTES, bad_utf8[i].s, strlen(bad_utf8[i].s));
        tree_case("control: as bytes", t.p, t.len, NULL);
    }
    /* a string whose last character is cut by the string's end, though the bytes follow */
    t.len = 0;
    t_word(&t, FRK_TAG_LIST, 2);
    t_str(&t, FRK_TAG_STR, "\xe2\x82\xac", 2);
    t_word(&t, FRK_TAG_BYTES, 0);
    tree_case("utf-8 sequence cut by the length", t.p, t.len, "not valid UTF-8");
    static const char *good_utf8[] = {"",
                                      "ascii",
                                      "\xc2\x80",
                                      "\xdf\xbf",
                                      "\xe0\xa0\x80",
                                      "\xed\x9f\xbf",
                                      "\xee\x80\x80",
                                      "\xef\xbf\xbf",
                                      "\xf0\x90\x80\x80",
                                      "\xf4\x8f\xbf\xbf"};
    for (size_t i = 0; i < sizeof good_utf8 / sizeof *good_utf8; i++) {
        t.len = 0;
        t_str(&t, FRK_TAG_STR, good_utf8[i], strlen(good_utf8[i]));
        tree_case("control: valid utf-8 edge", t.p, t.len, NULL);
    }

    /* containers claiming more items than bytes remain */
    t.len = 0;
    t_word(&t, FRK_TAG_LIST, 1000);
    t_tag(&t, FRK_TAG_NONE);
    t_tag(&t, FRK_TAG_NONE);
    tree_case("list of 1000 in 2 bytes", t.p, t.len, "claims 1000 items, only 2 bytes");
    t.len = 0;
    t_word(&t, FRK_TAG_TUPLE, UINT64_MAX);
    tree_case("tuple of 2^64-1", t.p, t.len, "claims");
    t.len = 0;
    t_word(&t, FRK_TAG_DICT, 2);
    t_tag(&t, FRK_TAG_NONE);
    t_tag(&t, FRK_TAG_NONE);
    t_tag(&t, FRK_TAG_NONE);
    tree_case("dict of 2 pairs in 3 bytes", t.p, t.len, "claims 2 items, only 3 bytes");
    t.len = 0;
    t_word(&t, FRK_TAG_DICT, 1ull << 63);
    for (int i = 0; i < 16; i++)
        t_tag(&t, FRK_TAG_NONE);
    tree_case("dict of 2^63 pairs (x2 overflows)", t.p, t.len, "claims");
    t.len = 0;
    t_word(&t, FRK_TAG_LIST, 3);
    t_tag(&t, FRK_TAG_NONE);
    t_tag(&t, FRK_TAG_NONE);
    t_tag(&t, FRK_TAG_NONE);
    tree_case("control: list of 3 Nones", t.p, t.len, NULL);
    t.len = 0;
    t_word(&t, FRK_TAG_LIST, 2);
    t_word(&t, FRK_TAG_LIST, 1); /* the inner list takes the bytes the outer one counted on */
    t_tag(&t, FRK_TAG_NONE);
    tree_case("list ends early", t.p, t.len, "value tree ends early at byte 19");
    t.len = 0;
    t_word(&t, FRK_TAG_LIST, 3);
    t_tag(&t, FRK_TAG_NONE);
    t_word(&t, FRK_TAG_LIST, 1);
    tree_case("inner list has no bytes left", t.p, t.len, "claims 1 items, only 0 bytes");

    /* dict keys */
    static const uint8_t bad_keys[] = {
        FRK_TAG_NONE, FRK_TAG_FALSE, FRK_TAG_TRUE, FRK_TAG_FLOAT,  FRK_TAG_BYTES,
        FRK_TAG_LIST, FRK_TAG_TUPLE, FRK_TAG_DICT, FRK_TAG_TENSOR, 11,
        200};
    for (size_t i = 0; i < sizeof bad_keys; i++) {
        t.len = 0;
        t_word(&t, FRK_TAG_DICT, 1);
        if (bad_keys[i] == FRK_TAG_NONE || bad_keys[i] == FRK_TAG_FALSE ||
            bad_keys[i] == FRK_TAG_TRUE || bad_keys[i] > FRK_TAG_TENSOR)
            t_tag(&t, bad_keys[i]);
        else if (bad_keys[i] == FRK_TAG_BYTES)
            t_str(&t, FRK_TAG_BYTES, "k", 1);
        else
            t_word(&t, bad_keys[i], 0);
        t_tag(&t, FRK_TAG_NONE);
        char what[64];
        snprintf(what, sizeof what, "dict key tag %u", bad_keys[i]);
        char why[64];
        snprintf(why, sizeof why, "is tag %u, not str or int", bad_keys[i]);
        tree_case(what, t.p, t.len, why);
    }
    t.len = 0;
    t_word(&t, FRK_TAG_DICT, 2);
    t_word(&t, FRK_TAG_INT, -5);
    t_tag(&t, FRK_TAG_NONE);
    t_cstr(&t, "k");
    t_word(&t, FRK_TAG_DICT, 1); /* a dict value with a str key, then a bad key in it */
    t_word(&t, FRK_TAG_FLOAT, 0);
    t_tag(&t, FRK_TAG_NONE);
    tree_case("nested dict with a float key", t.p, t.len, "not str or int");
    t.len = 0;
    t_word(&t, FRK_TAG_DICT, 2);
    t_word(&t, FRK_TAG_INT, -5);
    t_tag(&t, FRK_TAG_NONE);
    t_cstr(&t, "k");
    t_word(&t, FRK_TAG_DICT, 1);
    t_word(&t, FRK_TAG_INT, 0);
    t_tag(&t, FRK_TAG_NONE);
    tree_case("control: int and str keys", t.p, t.len, NULL);

    /* tensor references */
    t.len = 0;
    t_word(&t, FRK_TAG_TENSOR, 2);
    tree_case("tensor reference 2 of 2", t.p, t.len, "tensor reference 2");
    t.len = 0;
    t_word(&t, FRK_TAG_TENSOR, UINT64_MAX);
    tree_case("tensor reference 2^64-1", t.p, t.len, "tensor reference");
    t.len = 0;
    t_word(&t, FRK_TAG_TENSOR, 1);
    tree_case("control: tensor reference 1", t.p, t.len, NULL);

    /* tags and lengths */
    for (unsigned tag = 11; tag < 256; tag += 61) {
        uint8_t b1 = (uint8_t)tag;
        char why[64];
        snprintf(why, sizeof why, "unknown value tag %u", tag);
        tree_case("unknown tag", &b1, 1, why);
    }
    uint8_t nums[2][6] = {{FRK_TAG_INT, 1, 2, 3, 4, 5}, {FRK_TAG_FLOAT, 1, 2, 3, 4, 5}};
    tree_case("int cut short", nums[0], 6, "number at byte 0 is cut short");
    tree_case("float cut short", nums[1], 6, "cut short");
    uint8_t lens[4] = {FRK_TAG_LIST, 1, 0, 0};
    tree_case("length cut short", lens, 4, "length at byte 0 is cut short");
    tree_case("empty tree", NULL, 0, "ends early");

    /* stray bytes after the tree */
    uint8_t stray[2] = {FRK_TAG_NONE, FRK_TAG_NONE};
    tree_case("stray byte after the tree", stray, 2, "1 stray bytes");
    tree_case("control: one None", stray, 1, NULL);
    bb_free(&t);

    /* the tree length word disagrees with the index */
    hspec s;
    hspec_default(&s);
    s.has_tree_len_claim = 1;
    s.tree_len_claim = s.tree.len - 1;
    expect_corrupt("tree length short by one", &s, "value tree claims");
    s.tree_len_claim = UINT64_MAX;
    expect_corrupt("tree length 2^64-1", &s, "value tree claims");
    hspec_free(&s);
}

static void test_hostile_preamble_footer(void)
{
    hspec s;
    hspec_default(&s);
    s.file_size_delta = 1;
    expect_corrupt("footer file_size + 1", &s, "footer says");
    s.file_size_delta = -1;
    expect_corrupt("footer file_size - 1", &s, "footer says");
    s.file_size_delta = 0;
    s.pre_version = s.foot_version = 2;
    expect_corrupt("version 2", &s, "format version 2");
    s.pre_version = s.foot_version = 0;
    expect_corrupt("version 0", &s, "format version 0");
    s.pre_version = 1;
    s.foot_version = 2;
    expect_corrupt("footer version differs", &s, "inconsistent");
    s.foot_version = 1;
    s.foot_resv = 1;
    expect_corrupt("footer reserved bytes", &s, "inconsistent");
    s.foot_resv = 0;
    s.pre_flag = 4;
    expect_corrupt("preamble flags", &s, "unknown flags");
    s.pre_flag = 0;
    s.index_offset_delta = 8; /* index_offset + index_size then misses the footer */
    expect_corrupt("index offset + 8", &s, "index location");
    s.index_offset_delta = 1;
    expect_corrupt("index offset + 1", &s, "index location");
    s.index_offset_delta = (uint64_t)-256; /* index at 0 */
    expect_corrupt("index offset 0", &s, "index location");
    hspec_free(&s);

    /* hand-patched footers on the default image */
    hspec_default(&s);
    size_t len;
    uint8_t *img = hspec_image(&s, &len);
    uint8_t *c = dup_mem(img, len);
    uint8_t *foot = c + len - FRK_FOOTER_SIZE;
    /* index 8 bytes longer, reaching into the footer */
    frk_put64(foot + FRK_FOOT_INDEX_SIZE, frk_get64(foot + FRK_FOOT_INDEX_SIZE) + 8);
    frk_put32(foot + FRK_FOOT_CRC, frk_crc32c(0, foot, FRK_FOOT_CRC));
    expect_corrupt_img("index size into the footer", c, len, "index location");
    memcpy(c, img, len);
    frk_put64(foot + FRK_FOOT_INDEX_OFFSET, UINT64_MAX - 10); /* offset + size overflows */
    frk_put32(foot + FRK_FOOT_CRC, frk_crc32c(0, foot, FRK_FOOT_CRC));
    expect_corrupt_img("index offset overflow", c, len, "index location");
    memcpy(c, img, len);
    frk_put64(foot + FRK_FOOT_INDEX_SIZE, 16); /* index too small to hold the three counts */
    frk_put64(foot + FRK_FOOT_INDEX_OFFSET, len - FRK_FOOTER_SIZE - 16);
    frk_put32(foot + FRK_FOOT_CRC, frk_crc32c(0, foot, FRK_FOOT_CRC));
    expect_corrupt_img("index of 16 bytes", c, len, "index location");
    memcpy(c, img, len);
    foot[FRK_FOOT_MAGIC + 4] ^= 1;
    expect_corrupt_img("footer magic", c, len, "no valid footer");
    memcpy(c, img, len);
    foot[FRK_FOOT_CRC] ^= 1;
    expect_corrupt_img("footer crc", c, len, "footer checksum");
    memcpy(c, img, len);
    c[3] = 'X';
    expect_corrupt_img("preamble magic", c, len, "bad magic");
    memcpy(c, img, len);
    c[300] ^= 1;
    expect_corrupt_img("index byte, not resealed", c, len, "index checksum");
    free(c);
    free(img);
    hspec_free(&s);

    /* indexes that end between their tables (the hspec always writes all three) */
    enum { W = FRK_INDEX_WORD, BLOB0 = W, NT = W + FRK_BLOB_ENTRY_SIZE, T0 = NT + W };
    uint8_t raw[80];
    memset(raw, 0, sizeof raw);
    frk_put64(raw, 1); /* one blob entry: 64, 96 bytes, then 7 bytes */
    frk_put64(raw + BLOB0 + FRK_BLOB_OFFSET, 64);
    frk_put64(raw + BLOB0 + FRK_BLOB_LENGTH, 96);
    expect_corrupt_raw("index ends in the tensor count", raw, NT + 7, 1,
                       "index ends before the tensor table");
    frk_put64(raw + NT, 1); /* + one tensor (0-d u8 of blob 0), then 7 bytes */
    raw[T0 + FRK_TENSOR_DTYPE] = FRK_DT_U8;
    expect_corrupt_raw("index ends in the tree length", raw, T0 + FRK_TENSOR_HEAD_SIZE + 7, 1,
                       "index ends before the value tree");
    memset(raw, 0, sizeof raw); /* control: no blobs, no tensors, tree None */
    frk_put64(raw + 2 * W, 1);
    expect_corrupt_raw(NULL, raw, 3 * W + 1, 0, NULL);
}

/* ---- SkipToIter ------------------------------------------------------------------------------ */

static void test_skip_plan(void)
{
    int64_t e = -7, i = -7;
    CHECK(frk_skip_plan(0, 0, 0, -1, -1, &e, &i) == 0);
    CHECK(frk_skip_plan(0, 3, 4, -1, -1, &e, &i) == 0); /* saved values ignored when absent */
    CHECK(frk_skip_plan(1, 2, 5, -1, -1, &e, &i) == 1 && e == 2 && i == 5);
    CHECK(frk_skip_plan(1, 2, 5, 3, -1, &e, &i) == 1 && e == 3 && i == 0);
    CHECK(frk_skip_plan(1, 2, 5, 0, -1, &e, &i) == 1 && e == 0 && i == 0); /* explicit 0 */
    CHECK(frk_skip_plan(1, 2, 5, -1, 7, &e, &i) == 1 && e == 2 && i == 7);
    CHECK(frk_skip_plan(0, 2, 5, -1, 7, &e, &i) == 1 && e == 0 && i == 7);
    CHECK(frk_skip_plan(1, 2, 5, 4, 9, &e, &i) == 1 && e == 4 && i == 9);
    CHECK(frk_skip_plan(0, 0, 0, 4, 9, &e, &i) == 1 && e == 4 && i == 9);
    CHECK(frk_skip_plan(1, 2, 5, 0, 0, &e, &i) == 1 && e == 0 && i == 0);
}

static void test_skip_arm_errors(void)
{
    frk_skip s;
    frk_error err;
    struct {
        int64_t e, i, ne, ni;
        const char *why;
    } bad[] = {
        {0, 0, -1, 10, "-1 epochs"},
        {0, 0, 3, -1, "-1 batches"},
        {-1, 0, 3, 10, "epoch -1"},
        {4, 0, 3, 10, "epoch 4 of a fit of 3"},
        {0, -1, 3, 10, "batch -1"},
        {0, 11, 3, 10, "batch 11 of an epoch of 10"},
        {3, 1, 3, 10, "after the last epoch"},
        {INT64_MAX, 0, 3, 10, "epoch"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        memset(&err, 0, sizeof err);
        memset(&s, 0x5a, sizeof s);
        int rc = frk_skip_arm(&s, bad[k].e, bad[k].i, bad[k].ne, bad[k].ni, &err);
        CHECKF(rc == FRK_EINVAL && err.status == FRK_EINVAL && strstr(err.msg, bad[k].why),
               "arm(%lld, %lld, %lld, %lld): rc %d \"%s\"", (long long)bad[k].e,
               (long long)bad[k].i, (long long)bad[k].ne, (long long)bad[k].ni, rc, err.msg);
        /* a refused arm leaves the machine disarmed */
        CHECK(!frk_skip_pending(&s));
        frk_skip_step st = frk_skip_before_epoch(&s, 0);
        CHECK(st.action == FRK_SKIP_RUN && st.rng == FRK_RNG_NONE && st.first_iter == 0);
        CHECK(frk_skip_take_rng(&s) == 0);
    }
    /* the edges that are allowed */
    CHECK(frk_skip_arm(&s, 3, 0, 3, 10, &err) == FRK_OK && frk_skip_pending(&s));
    CHECK(frk_skip_arm(&s, 2, 10, 3, 10, &err) == FRK_OK);
    CHECK(frk_skip_arm(&s, 0, 0, 0, 0, &err) == FRK_OK);
    CHECK(frk_skip_arm(&s, 0, 0, 1, 0, &err) == FRK_OK);
}

static void test_skip_at_the_fits_very_end(void)
{
    frk_skip s;
    frk_error err;
    CHECK(frk_skip_arm(&s, 3, 0, 3, 10, &err) == FRK_OK);
    for (int64_t e = 0; e < 3; e++)
        CHECK(frk_skip_before_epoch(&s, e).action == FRK_SKIP_SKIP);
    CHECK(frk_skip_take_rng(&s) == 0);         /* no epoch resumed: no mid-epoch RNG */
    CHECK(frk_skip_after_last_epoch(&s) == 1); /* the saved state is due now, once */
    CHECK(frk_skip_after_last_epoch(&s) == 0 && !frk_skip_pending(&s));
    CHECK(frk_skip_arm(&s, 2, 0, 3, 10, &err) == FRK_OK); /* a target inside the fit: never */
    CHECK(frk_skip_after_last_epoch(&s) == 0 && frk_skip_pending(&s));
}

static void test_skip_mid_epoch(void)
{
    frk_skip s;
    frk_error err;
    CHECK(frk_skip_arm(&s, 2, 5, 4, 10, &err) == FRK_OK);
    CHECK(frk_skip_pending(&s));
    CHECK(frk_skip_take_rng(&s) == 0); /* not yet in the resumed epoch */
    for (int64_t e = 0; e < 2; e++) {
        frk_skip_step st = frk_skip_before_epoch(&s, e);
        CHECKF(st.action == FRK_SKIP_SKIP && st.rng == FRK_RNG_NONE, "epoch %lld: %d %d",
               (long long)e, st.action, st.rng);
        CHECK(frk_skip_pending(&s));
    }
    frk_skip_step st = frk_skip_before_epoch(&s, 2);
    CHECK(st.action == FRK_SKIP_RESUME && st.first_iter == 5 && st.rng == FRK_RNG_EPOCH_START);
    CHECK(frk_skip_pending(&s));
    CHECK(frk_skip_take_rng(&s) == 1);
    CHECK(frk_skip_take_rng(&s) == 0);
    CHECK(frk_skip_take_rng(&s) == 0);
    CHECK(frk_skip_pending(&s)); /* until the epoch ends */
    frk_skip_after_epoch(&s, 2);
    CHECK(!frk_skip_pending(&s));
    st = frk_skip_before_epoch(&s, 3);
    CHECK(st.action == FRK_SKIP_RUN && st.rng == FRK_RNG_NONE && st.first_iter == 0);
    frk_skip_after_epoch(&s, 3);
    CHECK(frk_skip_take_rng(&s) == 0 && !frk_skip_pending(&s));
}

static void test_skip_epoch_start(void)
{
    frk_skip s;
    frk_error err;
    CHECK(frk_skip_arm(&s, 1, 0, 3, 10, &err) == FRK_OK);
    CHECK(frk_skip_before_epoch(&s, 0).action == FRK_SKIP_SKIP);
    frk_skip_step st = frk_skip_before_epoch(&s, 1);
    CHECK(st.action == FRK_SKIP_RESUME && st.first_iter == 0 && st.rng == FRK_RNG_SAVED);
    CHECK(frk_skip_take_rng(&s) == 0); /* restored at once (SAVED): nothing is due later */
    CHECK(frk_skip_pending(&s));
    frk_skip_after_epoch(&s, 1);
    CHECK(!frk_skip_pending(&s) && frk_skip_take_rng(&s) == 0);
    CHECK(frk_skip_before_epoch(&s, 2).action == FRK_SKIP_RUN);

    /* resume at (0, 0): the first epoch resumes, nothing is skipped */
    CHECK(frk_skip_arm(&s, 0, 0, 2, 10, &err) == FRK_OK);
    st = frk_skip_before_epoch(&s, 0);
    CHECK(st.action == FRK_SKIP_RESUME && st.first_iter == 0 && st.rng == FRK_RNG_SAVED);
}

static void test_skip_end_of_epoch(void)
{
    /* iter == n_iter: training of the epoch is done, its validation is not */
    frk_skip s;
    frk_error err;
    CHECK(frk_skip_arm(&s, 1, 10, 3, 10, &err) == FRK_OK);
    CHECK(frk_skip_before_epoch(&s, 0).action == FRK_SKIP_SKIP);
    frk_skip_step st = frk_skip_before_epoch(&s, 1);
    CHECK(st.action == FRK_SKIP_RESUME && st.first_iter == 10 && st.rng == FRK_RNG_EPOCH_START);
    /* no batch is fetched: the saved state is due at the end of training */
    CHECK(frk_skip_pending(&s));
    CHECK(frk_skip_take_rng(&s) == 1 && frk_skip_take_rng(&s) == 0);
    frk_skip_after_epoch(&s, 1);
    CHECK(!frk_skip_pending(&s));
    CHECK(frk_skip_before_epoch(&s, 2).action == FRK_SKIP_RUN);

    /* after_epoch with the rng still pending ends the resume and drops it */
    CHECK(frk_skip_arm(&s, 0, 4, 2, 10, &err) == FRK_OK);
    CHECK(frk_skip_before_epoch(&s, 0).action == FRK_SKIP_RESUME);
    frk_skip_after_epoch(&s, 0);
    CHECK(!frk_skip_pending(&s) && frk_skip_take_rng(&s) == 0);

    /* an after_epoch for an earlier epoch does not end the resume */
    CHECK(frk_skip_arm(&s, 1, 4, 3, 10, &err) == FRK_OK);
    frk_skip_after_epoch(&s, 0);
    CHECK(frk_skip_pending(&s));
    CHECK(frk_skip_before_epoch(&s, 1).action == FRK_SKIP_RESUME);
    frk_skip_after_epoch(&s, 0);
    CHECK(frk_skip_pending(&s) && frk_skip_take_rng(&s) == 1);

    /* resumed past the target (the fit started at a later epoch): everything runs */
    CHECK(frk_skip_arm(&s, 1, 4, 3, 10, &err) == FRK_OK);
    st = frk_skip_before_epoch(&s, 2);
    CHECK(st.action == FRK_SKIP_RUN && st.rng == FRK_RNG_NONE && !frk_skip_pending(&s));
    CHECK(frk_skip_before_epoch(&s, 1).action == FRK_SKIP_RUN);

    /* resume after the whole fit: every epoch is skipped */
    CHECK(frk_skip_arm(&s, 3, 0, 3, 10, &err) == FRK_OK);
    for (int64_t e = 0; e < 3; e++)
        CHECK(frk_skip_before_epoch(&s, e).action == FRK_SKIP_SKIP);
    CHECK(frk_skip_take_rng(&s) == 0);

    /* disarmed: every epoch runs */
    frk_skip_disarm(&s);
    CHECK(!frk_skip_pending(&s));
    for (int64_t e = 0; e < 3; e++) {
        st = frk_skip_before_epoch(&s, e);
        CHECK(st.action == FRK_SKIP_RUN && st.rng == FRK_RNG_NONE && st.first_iter == 0);
    }
    CHECK(frk_skip_take_rng(&s) == 0);
}

/* ---- fuzz seeds ------------------------------------------------------------------------------ */

/* ---- direct commits, known checksums, CRC combining ----------------------------------------- */

/* The blobs of the direct-commit test: small and unaligned, page-aligned big ones (written in
 * place), an unaligned big one (through the staging buffer), one larger than the staging buffer,
 * an empty one, and one whose checksum the caller gives. */
enum { N_DIRECT_BLOBS = 6 };
static size_t direct_sizes[N_DIRECT_BLOBS] = {100, (1u << 20) + 37,  (3u << 20) + 1, (9u << 20) + 5,
                                              0,   (2u << 20) + 4096};

static int commit_direct_case(const char *path, uint8_t **bufs, unsigned flags, uint32_t wrong_crc,
                              frk_error *err)
{
    frk_builder *b = frk_builder_new();
    int rc = frk_builder_put_container(b, FRK_TAG_LIST, N_DIRECT_BLOBS, err);
    for (size_t i = 0; i < N_DIRECT_BLOBS && !rc; i++) {
        uint64_t bi, ti;
        size_t n = direct_sizes[i];
        if (i == N_DIRECT_BLOBS - 1) {
            uint32_t crc = frk_crc32c(0, bufs[i], n) ^ wrong_crc;
            rc = frk_builder_add_blob_crc(b, bufs[i], n, crc, &bi, err);
        } else {
            rc = frk_builder_add_blob(b, bufs[i], n, &bi, err);
        }
        if (!rc)
            rc = frk_builder_add_tensor(b, 0, FRK_DT_U8, bi, 0, 1, (int64_t[]){(int64_t)n},
                                        (int64_t[]){1}, &ti, err);
        if (!rc)
            rc = frk_builder_put_tensor(b, ti, err);
    }
    if (!rc)
        rc = frk_builder_commit(b, path, flags, NULL, err);
    frk_builder_free(b);
    return rc;
}

static void direct_case(void);

/* Twice: with less than 16 MiB of unknown checksums (each piece checksummed before it is written),
 * then more (a second thread checksums while the commit writes). */
static void test_commit_direct_same_bytes_as_buffered(void)
{
    direct_case();
    direct_sizes[3] = (17u << 20) + 5;
    direct_case();
    direct_sizes[3] = (9u << 20) + 5;
}

static void direct_case(void)
{
    uint8_t *bufs[N_DIRECT_BLOBS], *owned[N_DIRECT_BLOBS];
    for (size_t i = 0; i < N_DIRECT_BLOBS; i++) {
        void *m;
        size_t n = direct_sizes[i] + FRK_PAGE_ALIGN;
        CHECK(!posix_memalign(&m, FRK_PAGE_ALIGN, n));
        owned[i] = m;
        bufs[i] = owned[i] + (i == 0 || i == 2 ? 1 : 0); /* 0 and 2 start off a page */
        for (size_t k = 0; k < direct_sizes[i]; k++)
            bufs[i][k] = (uint8_t)(rnd() >> 24);
    }
    char buffered[512], direct[512], shm[512] = "", wrong[512];
    snprintf(buffered, sizeof buffered, "%s/buffered.frk", tmpdir);
    snprintf(direct, sizeof direct, "%s/direct.frk", tmpdir);
    snprintf(wrong, sizeof wrong, "%s/wrong.frk", tmpdir);
    struct stat st;
    if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode))
        snprintf(shm, sizeof shm, "/dev/shm/frk-direct-%ld.frk", (long)getpid());
    frk_error err;
    CHECKF(!commit_direct_case(buffered, bufs, FRK_COMMIT_FSYNC, 0, &err), "%s", err.msg);
    for (int round = 0; round < 2; round++) /* the second one reuses the kept staging buffer */
        CHECKF(!commit_direct_case(direct, bufs, FRK_COMMIT_FSYNC | FRK_COMMIT_DIRECT, 0, &err),
               "%s", err.msg);
    if (*shm)
        CHECKF(!commit_direct_case(shm, bufs, FRK_COMMIT_FSYNC | FRK_COMMIT_DIRECT, 0, &err), "%s",
               err.msg);
    size_t la, lb, lc = 0;
    uint8_t *a = read_whole(buffered, &la), *bb = read_whole(direct, &lb);
    uint8_t *c = *shm ? read_whole(shm, &lc) : NULL;
    CHECK(a && bb && la == lb && !memcmp(a, bb, la));
    if (*shm)
        CHECK(c && lc == la && !memcmp(a, c, la));
    CHECK(count_temps(tmpdir, "direct.frk") == 0);

    /* Every blob verified, at its place, with its bytes; the big ones on a page. */
    frk_reader *r;
    if (CHECKF(!frk_reader_open(bb, lb, 1, &r, &err), "%s", err.msg)) {
        CHECK(frk_reader_blob_count(r) == N_DIRECT_BLOBS);
        for (size_t i = 0; i < N_DIRECT_BLOBS && i < frk_reader_blob_count(r); i++) {
            const frk_blob *bl = frk_reader_blob(r, i);
            CHECKF(bl->length == direct_sizes[i] && !memcmp(bb + bl->offset, bufs[i], bl->length),
                   "blob %zu", i);
            if (direct_sizes[i] >= FRK_PAGE_ALIGN_MIN)
                CHECKF(bl->offset % FRK_PAGE_ALIGN == 0, "blob %zu at %llu", i,
                       (unsigned long long)bl->offset);
        }
        frk_reader_free(r);
    }

    /* A wrong known checksum makes a file that a verifying read refuses (and an unverified one
     * opens): the commit trusted the caller, as documented. */
    CHECKF(!commit_direct_case(wrong, bufs, FRK_COMMIT_FSYNC | FRK_COMMIT_DIRECT, 1, &err), "%s",
           err.msg);
    size_t lw;
    uint8_t *w = read_whole(wrong, &lw);
    CHECK(w && frk_reader_open(w, lw, 1, &r, &err) == FRK_ECORRUPT);
    if (CHECK(w && frk_reader_open(w, lw, 0, &r, &err) == FRK_OK)) {
        CHECK(frk_reader_verify_blob(r, N_DIRECT_BLOBS - 1, &err) == FRK_ECORRUPT);
        frk_reader_free(r);
    }
    free(w);
    free(a);
    free(bb);
    free(c);
    if (*shm)
        unlink(shm);
    for (size_t i = 0; i < N_DIRECT_BLOBS; i++)
        free(owned[i]);
}

/* Blobs for frk_load_file: some span the pass's 2 MiB chunks, some start and end inside one, some
 * are empty; 27 MiB in all, enough for the pass to be split over threads. */
static const size_t load_sizes[] = {
    0, 100, (3u << 20) + 7, 1, (5u << 20) + 4096, 64, (11u << 20) + 3,
    0, 77,  2u << 20,       5, (4u << 20) + 1,    3};
#define N_LOAD_BLOBS (sizeof load_sizes / sizeof *load_sizes)

/* Loads path both ways with verify; each must fail naming blob `bad` (or succeed when bad < 0) and
 * give back the file's bytes. */
static void load_both_ways(const char *path, const uint8_t *file, size_t flen, long bad)
{
    static const unsigned ways[] = {FRK_LOAD_COPY | FRK_LOAD_VERIFY, FRK_LOAD_VERIFY};
    for (size_t w = 0; w < 2; w++) {
        uint8_t *base = NULL;
        size_t len = 0;
        frk_error err;
        int rc = frk_load_file(path, ways[w], &base, &len, &err);
        if (bad < 0) {
            if (CHECKF(rc == FRK_OK, "way %zu: %s", w, rc ? err.msg : ""))
                CHECKF(len == flen && !memcmp(base, file, flen), "way %zu: other bytes", w);
        } else {
            char want[64];
            snprintf(want, sizeof want, "checksum mismatch in blob %ld ", bad);
            CHECKF(rc == FRK_ECORRUPT && strstr(err.msg, want) &&
                       !strncmp(err.msg, path, strlen(path)),
                   "way %zu, blob %ld: rc %d, %s", w, bad, rc, rc ? err.msg : "");
        }
        if (rc == FRK_OK)
            frk_unmap(base, len);
    }
}

/* The fraction of a file's pages in the page cache. */
static double resident_fraction(int fd, size_t len)
{
    size_t pages = (len + 4095) / 4096, in = 0;
    unsigned char *vec = xmalloc(pages);
    void *m = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED || mincore(m, len, vec))
        in = pages;
    else
        for (size_t i = 0; i < pages; i++)
            in += vec[i] & 1;
    if (m != MAP_FAILED)
        munmap(m, len);
    free(vec);
    return (double)in / (double)pages;
}

/* frk_load_file, mapped and read, with the page cache holding all of the file, none of it (read
 * around it then), or part of it. */
static void test_load_file(void)
{
    uint8_t *bufs[N_LOAD_BLOBS];
    frk_builder *b = frk_builder_new();
    frk_error err;
    int rc = frk_builder_put_container(b, FRK_TAG_LIST, N_LOAD_BLOBS, &err);
    for (size_t i = 0; i < N_LOAD_BLOBS; i++) {
        bufs[i] = xmalloc(load_sizes[i] + 1);
        for (size_t k = 0; k < load_sizes[i]; k++)
            bufs[i][k] = (uint8_t)(rnd() >> 24);
        uint64_t bi, ti;
        if (!rc)
            rc = frk_builder_add_blob(b, bufs[i], load_sizes[i], &bi, &err);
        if (!rc)
            rc = frk_builder_add_tensor(b, 0, FRK_DT_U8, bi, 0, 1,
                                        (int64_t[]){(int64_t)load_sizes[i]}, (int64_t[]){1}, &ti,
                                        &err);
        if (!rc)
            rc = frk_builder_put_tensor(b, ti, &err);
    }
    char path[512];
    path_in(path, sizeof path, "load.frk");
    if (!rc)
        rc = frk_builder_commit(b, path, FRK_COMMIT_FSYNC, NULL, &err);
    frk_builder_free(b);
    size_t flen = 0;
    uint8_t *file = rc ? NULL : read_whole(path, &flen);
    if (!CHECKF(file, "%s", rc ? err.msg : "cannot read it back"))
        goto out;
    frk_reader *r;
    if (!CHECK(frk_reader_open(file, flen, 1, &r, &err) == FRK_OK))
        goto out;
    uint64_t off[N_LOAD_BLOBS];
    for (size_t i = 0; i < N_LOAD_BLOBS; i++)
        off[i] = frk_reader_blob(r, i)->offset;
    frk_reader_free(r);

    int fd = open(path, O_RDWR);
    CHECK(fd >= 0);
    for (int cache = 0; cache < 3; cache++) {
        /* 0: all cached; 1: none; 2: the first 9 MiB and a page in the middle of blob 6 */
        if (cache) {
            CHECK(fdatasync(fd) == 0 && posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
            if (cache == 2) {
                uint8_t *tmp = xmalloc(9u << 20);
                CHECK(pread(fd, tmp, 9u << 20, 0) == 9 << 20 &&
                      pread(fd, tmp, 4096, (off_t)(off[6] + (3u << 20) + 100)) == 4096);
                free(tmp);
            }
        }
        if (cache == 1) { /* where the file left the cache, the read goes around it */
            double before = resident_fraction(fd, flen), after = -1;
            uint8_t *base;
            size_t len;
            if (CHECK(frk_load_file(path, FRK_LOAD_COPY | FRK_LOAD_VERIFY, &base, &len, &err) ==
                      FRK_OK)) {
                after = resident_fraction(fd, flen);
                CHECK(len == flen && !memcmp(base, file, flen));
                frk_unmap(base, len);
            }
            CHECKF(before > 0.5 || after < 0.2, "%.0f%% of the file in the cache after the read",
                   100 * after); /* (tmpfs: always in it) */
        }
        load_both_ways(path, file, flen, -1);
    }
    /* A flipped byte: in a blob inside one chunk, at the start, middle and end of blobs that span
     * chunks, in the first and the last bytes of the data; each names its blob. */
    const struct {
        size_t blob;
        uint64_t at;
    } flips[] = {{1, 50},   {2, 0},    {2, (2u << 20) + 9}, {2, (3u << 20) + 6},
                 {4, 4096}, {6, 1000}, {6, (8u << 20) + 1}, {9, (2u << 20) - 1},
                 {12, 2}};
    for (size_t f = 0; f < sizeof flips / sizeof *flips; f++) {
        uint64_t at = off[flips[f].blob] + flips[f].at;
        uint8_t x = file[at] ^ 0x10;
        for (int cache = 0; cache < 2; cache++) {
            CHECK(pwrite(fd, &x, 1, (off_t)at) == 1);
            if (cache)
                CHECK(fdatasync(fd) == 0 && posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
            load_both_ways(path, file, flen, (long)flips[f].blob);
            CHECK(pwrite(fd, file + at, 1, (off_t)at) == 1);
        }
    }
    /* without verify the copy holds the flipped byte */
    {
        uint64_t at = off[6] + (5u << 20);
        uint8_t x = file[at] ^ 1;
        CHECK(pwrite(fd, &x, 1, (off_t)at) == 1);
        uint8_t *base;
        size_t len;
        if (CHECK(frk_load_file(path, FRK_LOAD_COPY, &base, &len, &err) == FRK_OK)) {
            CHECK(len == flen && base[at] == x && !memcmp(base, file, at));
            frk_unmap(base, len);
        }
        CHECK(pwrite(fd, file + at, 1, (off_t)at) == 1);
    }
    close(fd);
out:
    free(file);
    for (size_t i = 0; i < N_LOAD_BLOBS; i++)
        free(bufs[i]);
}

static void test_crc_combine_and_copy(void)
{
    static const size_t sizes[] = {
        0, 1, 15, 100, (64u << 10) + 3, (2u << 20) + 77, (16u << 20) + 4099};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        size_t n = sizes[s];
        uint8_t *src = xmalloc(n + 16), *out = xmalloc(n + 32);
        for (size_t k = 0; k < n + 16; k++)
            src[k] = (uint8_t)(rnd() >> 32);
        uint32_t crc = frk_crc32c(0, src, n);
        for (size_t off = 0; off < 17; off += off < 4 ? 1 : 4) { /* dst and src off 16-byte lines */
            uint8_t *dst = out + off;
            memset(out, 0xAA, n + 32);
            CHECKF(frk_copy_crc32c(dst, src + off % 3, n) == frk_crc32c(0, src + off % 3, n) &&
                       (!n || !memcmp(dst, src + off % 3, n)),
                   "copy of %zu to +%zu", n, off);
            for (size_t k = 0; k < off; k++) /* nothing written outside dst */
                CHECKF(out[k] == 0xAA, "copy of %zu to +%zu wrote before dst", n, off);
            for (size_t k = off + n; k < n + 32; k++)
                CHECKF(out[k] == 0xAA, "copy of %zu to +%zu wrote after dst", n, off);
        }
        for (int k = 0; k < 8; k++) { /* crc(A || B) from crc(A), crc(B) and len(B) */
            size_t cut = rnd_below(n + 1);
            uint32_t ca = frk_crc32c(0, src, cut), cb = frk_crc32c(0, src + cut, n - cut);
            CHECKF(frk_crc32c_combine(ca, cb, n - cut) == crc, "%zu cut at %zu", n, cut);
        }
        free(src);
        free(out);
    }
}

/* The split copy's OpenMP team runs on the libgomp.so.1 the process has loaded (torch's, in
 * Python), never on one the core loads: refused before one is loaded, then the same copy on it. */
static void test_copy_on_the_loaded_openmp(void)
{
    CHECKF(!frk_copy_use_openmp(1), "%s", "the team is used with no libgomp.so.1 loaded");
    if (!dlopen("libgomp.so.1", RTLD_NOW)) { /* kept loaded: the core holds it from here on */
        note("libgomp.so.1 not installed: the team's copy not run (%s)", dlerror());
        return;
    }
    CHECK(frk_copy_use_openmp(1));
    size_t n = (16u << 20) + 4099;
    uint8_t *src = xmalloc(n + 3), *dst = xmalloc(n + 1);
    for (size_t k = 0; k < n + 3; k++)
        src[k] = (uint8_t)(rnd() >> 32);
    CHECK(frk_copy_crc32c(dst + 1, src + 3, n) == frk_crc32c(0, src + 3, n) &&
          !memcmp(dst + 1, src + 3, n));
    CHECK(!frk_copy_use_openmp(0));
    free(src);
    free(dst);
}

static void test_crc_many(void)
{
    static const size_t sizes[] = {0,       1, (1u << 20) - 1, 1u << 20, (1u << 20) + 1, (3u << 20),
                                   5000003, 17};
    enum { N = sizeof sizes / sizeof *sizes };
    const void *data[N];
    size_t len[N];
    uint8_t *bufs[N];
    for (size_t i = 0; i < N; i++) {
        bufs[i] = xmalloc(sizes[i] + 1);
        for (size_t k = 0; k < sizes[i]; k++)
            bufs[i][k] = (uint8_t)(rnd() >> 32);
        data[i] = bufs[i];
        len[i] = sizes[i];
    }
    for (int threads = 1; threads <= 9; threads += 2) { /* 9: more than it allows (8) */
        uint32_t out[N];
        memset(out, 0xAA, sizeof out);
        CHECK(frk_crc32c_many(N, data, len, out, threads) == FRK_OK);
        for (size_t i = 0; i < N; i++)
            CHECKF(out[i] == frk_crc32c(0, data[i], len[i]),
                   "buffer %zu of %zu bytes on %d threads", i, len[i], threads);
    }
    CHECK(frk_crc32c_many(0, data, len, NULL, 2) == FRK_OK); /* nothing to do, nothing written */
    for (size_t i = 0; i < N; i++)
        free(bufs[i]);
}

static int write_seeds(const char *dir)
{
    frk_error err;
    char path[4096];
    int n = 0, rc;
    uint8_t data[512];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (uint8_t)(i * 7 + 3);
#define SEED_COMMIT(b)                                                                             \
    do {                                                                                           \
        snprintf(path, sizeof path, "%s/seed-%02d.frk", dir, n++);                                 \
        if ((rc = frk_builder_commit(b, path, 0, NULL, &err))) {                                   \
            fprintf(stderr, "seed %s: %s\n", path, err.msg);                                       \
            frk_builder_free(b);                                                                   \
            return 1;                                                                              \
        }                                                                                          \
        frk_builder_free(b);                                                                       \
    } while (0)
    frk_builder *b;
    uint64_t bi, ti;

    /* 0: a single int */
    b = frk_builder_new();
    frk_builder_put_int(b, 42, &err);
    SEED_COMMIT(b);

    /* 1: the round-trip tree */
    b = frk_builder_new();
    if (build_roundtrip(b, &err))
        return 1;
    SEED_COMMIT(b);

    /* 2: empty tensors on an empty blob, 0-d tensor */
    b = frk_builder_new();
    frk_builder_add_blob(b, NULL, 0, &bi, &err);
    frk_builder_add_tensor(b, 0, FRK_DT_F32, bi, 0, 2, (int64_t[]){0, 3}, (int64_t[]){3, 1}, &ti,
                           &err);
    frk_builder_add_tensor(b, 1, FRK_DT_F64, bi, 0, 1, (int64_t[]){0}, (int64_t[]){1}, &ti, &err);
    frk_builder_add_blob(b, data, 8, &bi, &err);
    frk_builder_add_tensor(b, 0, FRK_DT_I64, bi, 0, 0, NULL, NULL, &ti, &err);
    frk_builder_put_container(b, FRK_TAG_LIST, 3, &err);
    frk_builder_put_tensor(b, 0, &err);
    frk_builder_put_tensor(b, 1, &err);
    frk_builder_put_tensor(b, 2, &err);
    SEED_COMMIT(b);

    /* 3: nested containers, every scalar kind, int and str keys */
    b = frk_builder_new();
    frk_builder_put_container(b, FRK_TAG_DICT, 3, &err);
    frk_builder_put_int(b, -1, &err);
    frk_builder_put_container(b, FRK_TAG_LIST, 4, &err);
    frk_builder_put_scalar(b, FRK_TAG_NONE, &err);
    frk_builder_put_scalar(b, FRK_TAG_TRUE, &err);
    frk_builder_put_scalar(b, FRK_TAG_FALSE, &err);
    frk_builder_put_float(b, -0.0, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "tuple", 5, &err);
    frk_builder_put_container(b, FRK_TAG_TUPLE, 2, &err);
    frk_builder_put_container(b, FRK_TAG_DICT, 0, &err);
    frk_builder_put_container(b, FRK_TAG_LIST, 1, &err);
    frk_builder_put_container(b, FRK_TAG_TUPLE, 1, &err);
    frk_builder_put_container(b, FRK_TAG_DICT, 1, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "x", 1, &err);
    frk_builder_put_str(b, FRK_TAG_BYTES, "\x00\xff", 2, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "deep", 4, &err);
    for (int i = 0; i < 20; i++)
        frk_builder_put_container(b, FRK_TAG_LIST, 1, &err);
    frk_builder_put_str(b, FRK_TAG_STR, RT_STR, strlen(RT_STR), &err);
    SEED_COMMIT(b);

    /* 4: many dtypes (as torch tensors, and as NumPy arrays where NumPy has the dtype) and
     * strided views over a few blobs */
    b = frk_builder_new();
    uint64_t blobs[3];
    frk_builder_add_blob(b, data, 96, &blobs[0], &err);
    frk_builder_add_blob(b, data + 100, 50, &blobs[1], &err);
    frk_builder_add_blob(b, data + 200, 256, &blobs[2], &err);
    unsigned nt = 0;
    for (unsigned dt = 0; dt < FRK_DT_COUNT; dt++) {
        size_t item = frk_dtype_size(dt);
        int64_t n = (int64_t)(96 / item);
        int numpy = dt % 2 && dt != FRK_DT_C32 && dt < FRK_DT_F8_E4M3FN;
        frk_builder_add_tensor(b, numpy ? FRK_KIND_NUMPY : FRK_KIND_TORCH, dt, blobs[0], 0, 1,
                               (int64_t[]){n}, (int64_t[]){1}, &ti, &err);
        nt++;
    }
    frk_builder_add_tensor(b, 0, FRK_DT_U8, blobs[1], 2, 3, (int64_t[]){2, 3, 4},
                           (int64_t[]){12, 1, 3}, &ti, &err);
    frk_builder_add_tensor(b, 0, FRK_DT_I16, blobs[2], 1, 2, (int64_t[]){3, 40}, (int64_t[]){0, 3},
                           &ti, &err);
    nt += 2;
    frk_builder_put_container(b, FRK_TAG_TUPLE, nt, &err);
    for (unsigned i = 0; i < nt; i++)
        frk_builder_put_tensor(b, i, &err);
    SEED_COMMIT(b);

    /* 5: a state-dict-like mapping with one shared blob */
    b = frk_builder_new();
    frk_builder_add_blob(b, data, 256, &bi, &err);
    frk_builder_add_tensor(b, 0, FRK_DT_F32, bi, 0, 2, (int64_t[]){8, 8}, (int64_t[]){8, 1}, &ti,
                           &err);
    frk_builder_add_tensor(b, 0, FRK_DT_F32, bi, 0, 2, (int64_t[]){8, 8}, (int64_t[]){1, 8}, &ti,
                           &err);
    frk_builder_add_tensor(b, 0, FRK_DT_F32, bi, 8, 1, (int64_t[]){8}, (int64_t[]){1}, &ti, &err);
    frk_builder_put_container(b, FRK_TAG_DICT, 4, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "model.weight", 12, &err);
    frk_builder_put_tensor(b, 0, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "model.weight_t", 14, &err);
    frk_builder_put_tensor(b, 1, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "row1", 4, &err);
    frk_builder_put_tensor(b, 2, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "opt", 3, &err);
    frk_builder_put_container(b, FRK_TAG_DICT, 2, &err);
    frk_builder_put_str(b, FRK_TAG_STR, "lr", 2, &err);
    frk_builder_put_float(b, 1e-3, &err);
    frk_builder_put_int(b, 0, &err);
    frk_builder_put_container(b, FRK_TAG_LIST, 0, &err);
    SEED_COMMIT(b);
#undef SEED_COMMIT

    /* 6, 7: hand-built images (the default, and one with a 32-dim tensor) */
    hspec s;
    hspec_default(&s);
    size_t len;
    uint8_t *img = hspec_image(&s, &len);
    snprintf(path, sizeof path, "%s/seed-%02d.frk", dir, n++);
    if (write_whole(path, img, len))
        return 1;
    free(img);
    int64_t ones[H_MAXDIM];
    for (int d = 0; d < H_MAXDIM; d++)
        ones[d] = 1;
    ht_set(&s.tensors[0], 0, FRK_DT_F32, 0, 0, FRK_MAX_NDIM, ones, ones);
    img = hspec_image(&s, &len);
    snprintf(path, sizeof path, "%s/seed-%02d.frk", dir, n++);
    if (write_whole(path, img, len))
        return 1;
    free(img);
    hspec_free(&s);
    printf("wrote %d seed checkpoints into %s\n", n, dir);
    return 0;
}

/* ---- main ---------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && !strcmp(argv[1], "--write-seeds")) {
        if (argc != 3) {
            fprintf(stderr, "usage: %s --write-seeds DIR\n", argv[0]);
            return 2;
        }
        return write_seeds(argv[2]);
    }
    n_filters = argc - 1;
    filters = argv + 1;

    snprintf(tmpdir, sizeof tmpdir, "%s/frk-test.XXXXXX",
             getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 2;
    }
    chmod(tmpdir, 0755); /* the read-only-directory child runs as nobody */

    run_test("layout_matches_the_spec", test_layout_matches_the_spec);
    run_test("crc32c_published_vectors", test_crc_vectors);
    run_test("crc32c_hw_vs_portable", test_crc_hw_vs_portable);
    run_test("roundtrip_builder_commit_map_read", test_roundtrip);
    run_test("builder_rejects_bad_input", test_builder_rejects);
    run_test("commit_replaces_atomically", test_commit_replaces_atomically);
    run_test("write_then_publish_or_abandon", test_write_then_publish_or_abandon);
    run_test("commit_failures_leave_no_temp", test_commit_failures);
    run_test("commit_directory_sync_failures_are_told", test_commit_directory_sync);
    run_test("commit_long_names_get_a_short_temp_name", test_commit_long_names);
    run_test("commit_planted_temp_names_do_not_block_it", test_commit_planted_temp_names);
    run_test("builder_size_is_the_committed_size", test_builder_size_is_the_committed_size);
    run_test("commit_direct_same_bytes_as_buffered", test_commit_direct_same_bytes_as_buffered);
    run_test("crc32c_combine_and_copy", test_crc_combine_and_copy);
    run_test("crc32c_copy_on_the_loaded_openmp", test_copy_on_the_loaded_openmp);
    run_test("crc32c_many", test_crc_many);
    run_test("error_message_cut_at_a_character", test_error_message_cut_at_a_character);
    run_test("reader_truncation_every_offset", test_truncation_every_offset);
    run_test("load_file_mapped_and_read_in_chunks", test_load_file);
    run_test("reader_bit_flips", test_bit_flips);
    run_test("reader_patched_real_file", test_patched_real_file);
    run_test("hostile_control_matches_builder", test_hostile_control);
    run_test("hostile_blobs", test_hostile_blobs);
    run_test("hostile_tensors", test_hostile_tensors);
    run_test("hostile_tree", test_hostile_tree);
    run_test("hostile_preamble_footer", test_hostile_preamble_footer);
    run_test("skip_plan_overrides", test_skip_plan);
    run_test("skip_arm_validation", test_skip_arm_errors);
    run_test("skip_at_the_fits_very_end", test_skip_at_the_fits_very_end);
    run_test("skip_resume_mid_epoch", test_skip_mid_epoch);
    run_test("skip_resume_at_epoch_start", test_skip_epoch_start);
    run_test("skip_resume_at_end_of_epoch", test_skip_end_of_epoch);

    rm_rf(tmpdir);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
