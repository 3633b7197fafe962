/* The checkpoint format (docs/FORMAT.md): the builder that encodes a value
 * tree, the atomic durable writer, and the validating reader. */
#define _GNU_SOURCE
#include "frk.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const unsigned char PREAMBLE_MAGIC[8] = {0x89, 'F', 'R', 'K', '\r', '\n', 0x1a, '\n'};
static const unsigned char FOOTER_MAGIC[8] = {'F', 'R', 'K', 'F', 'O', 'O', 'T', '\n'};

#define BLOB_ENTRY_SIZE 24u
#define TENSOR_HEAD_SIZE 24u
#define WRITE_CHUNK (1u << 20)

static int fail(frk_error *err, int status, int sys_errno, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->status = status;
        err->sys_errno = sys_errno;
    }
    return status;
}

#define corrupt(err, ...) fail(err, FRK_ECORRUPT, 0, __VA_ARGS__)

static const unsigned char DTYPE_SIZE[FRK_DT_COUNT] = {
    [FRK_DT_BOOL] = 1, [FRK_DT_U8] = 1, [FRK_DT_I8] = 1, [FRK_DT_I16] = 2,
    [FRK_DT_I32] = 4, [FRK_DT_I64] = 8, [FRK_DT_U16] = 2, [FRK_DT_U32] = 4,
    [FRK_DT_U64] = 8, [FRK_DT_F16] = 2, [FRK_DT_BF16] = 2, [FRK_DT_F32] = 4,
    [FRK_DT_F64] = 8, [FRK_DT_C32] = 4, [FRK_DT_C64] = 8, [FRK_DT_C128] = 16,
    [FRK_DT_F8_E4M3FN] = 1, [FRK_DT_F8_E5M2] = 1, [FRK_DT_F8_E4M3FNUZ] = 1,
    [FRK_DT_F8_E5M2FNUZ] = 1, [FRK_DT_F8_E8M0FNU] = 1,
};

size_t frk_dtype_size(unsigned code) { return code < FRK_DT_COUNT ? DTYPE_SIZE[code] : 0; }

/* ---- little-endian helpers ------------------------------------------------ */

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}
static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++, v >>= 8)
        p[i] = (uint8_t)v;
}
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++, v >>= 8)
        p[i] = (uint8_t)v;
}

/* ---- growable byte buffer ------------------------------------------------- */

typedef struct {
    uint8_t *data;
    size_t len, cap;
} buf_t;

static uint8_t *buf_grow(buf_t *b, size_t n)
{
    if (n > SIZE_MAX - b->len)
        return NULL;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) {
            if (cap > SIZE_MAX / 2)
                return NULL;
            cap *= 2;
        }
        uint8_t *d = realloc(b->data, cap);
        if (!d)
            return NULL;
        b->data = d;
        b->cap = cap;
    }
    uint8_t *p = b->data + b->len;
    b->len += n;
    return p;
}

/* ---- UTF-8 --------------------------------------------------------------- */

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
static int utf8_valid(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t k;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) {
            k = 1, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            k = 2, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            k = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return 0;
        }
        if (n - i <= k)
            return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80)
                return 0;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

/* ---- tree parsing, shared by the reader and the builder's self-check ---------- */

typedef struct {
    const uint8_t *p;
    size_t len, pos;
    uint64_t n_tensors;
    frk_node *nodes; /* NULL: check only */
    size_t n_nodes, cap_nodes;
    frk_error *err;
} tree_parser;

static int node_push(tree_parser *tp, const frk_node *nd, size_t *at)
{
    if (tp->n_nodes == tp->cap_nodes && tp->nodes) {
        size_t cap = tp->cap_nodes * 2;
        frk_node *n2 = realloc(tp->nodes, cap * sizeof *n2);
        if (!n2)
            return fail(tp->err, FRK_ENOMEM, ENOMEM, "out of memory decoding the value tree");
        tp->nodes = n2;
        tp->cap_nodes = cap;
    }
    *at = tp->n_nodes;
    if (tp->nodes)
        tp->nodes[tp->n_nodes] = *nd;
    tp->n_nodes++;
    return FRK_OK;
}

static int parse_value(tree_parser *tp, unsigned depth, int is_key)
{
    size_t start = tp->pos;
    if (depth > FRK_MAX_DEPTH)
        return fail(tp->err, FRK_ECORRUPT, 0, "value tree nested deeper than %u levels at byte %zu",
                    FRK_MAX_DEPTH, start);
    if (tp->pos >= tp->len)
        return fail(tp->err, FRK_ECORRUPT, 0, "value tree ends early at byte %zu", start);
    frk_node nd = {0};
    nd.tag = tp->p[tp->pos++];
    size_t rest = tp->len - tp->pos;
    if (is_key && nd.tag != FRK_TAG_STR && nd.tag != FRK_TAG_INT)
        return fail(tp->err, FRK_ECORRUPT, 0, "dict key at byte %zu is tag %u, not str or int",
                    start, nd.tag);
    switch (nd.tag) {
    case FRK_TAG_NONE:
    case FRK_TAG_FALSE:
    case FRK_TAG_TRUE:
        break;
    case FRK_TAG_INT:
    case FRK_TAG_FLOAT:
        if (rest < 8)
            return fail(tp->err, FRK_ECORRUPT, 0, "number at byte %zu is cut short", start);
        {
            uint64_t v = get64(tp->p + tp->pos);
            if (nd.tag == FRK_TAG_INT)
                memcpy(&nd.ival, &v, 8);
            else
                memcpy(&nd.fval, &v, 8);
        }
        tp->pos += 8;
        break;
    case FRK_TAG_STR:
    case FRK_TAG_BYTES:
    case FRK_TAG_LIST:
    case FRK_TAG_TUPLE:
    case FRK_TAG_DICT:
    case FRK_TAG_TENSOR:
        if (rest < 8)
            return fail(tp->err, FRK_ECORRUPT, 0, "length at byte %zu is cut short", start);
        nd.count = get64(tp->p + tp->pos);
        tp->pos += 8;
        rest -= 8;
        break;
    default:
        return fail(tp->err, FRK_ECORRUPT, 0, "unknown value tag %u at byte %zu", nd.tag, start);
    }
    if (nd.tag == FRK_TAG_STR || nd.tag == FRK_TAG_BYTES) {
        if (nd.count > rest)
            return fail(tp->err, FRK_ECORRUPT, 0,
                        "string at byte %zu claims %llu bytes, only %zu remain", start,
                        (unsigned long long)nd.count, rest);
        nd.data = tp->p + tp->pos;
        if (nd.tag == FRK_TAG_STR && !utf8_valid(nd.data, (size_t)nd.count))
            return fail(tp->err, FRK_ECORRUPT, 0, "string at byte %zu is not valid UTF-8", start);
        tp->pos += (size_t)nd.count;
    } else if (nd.tag == FRK_TAG_TENSOR) {
        if (nd.count >= tp->n_tensors)
            return fail(tp->err, FRK_ECORRUPT, 0,
                        "tensor reference %llu at byte %zu, but the table holds %llu",
                        (unsigned long long)nd.count, start, (unsigned long long)tp->n_tensors);
    } else if (nd.tag >= FRK_TAG_LIST) { /* containers: every item takes at least a byte */
        uint64_t need = nd.count;
        if (nd.tag == FRK_TAG_DICT)
            need = nd.count > UINT64_MAX / 2 ? UINT64_MAX : nd.count * 2;
        if (need > rest)
            return fail(tp->err, FRK_ECORRUPT, 0,
                        "container at byte %zu claims %llu items, only %zu bytes remain", start,
                        (unsigned long long)nd.count, rest);
    }
    size_t at = 0;
    int rc = node_push(tp, &nd, &at);
    if (rc)
        return rc;
    if (nd.tag == FRK_TAG_LIST || nd.tag == FRK_TAG_TUPLE || nd.tag == FRK_TAG_DICT) {
        int dict = nd.tag == FRK_TAG_DICT;
        for (uint64_t i = 0; i < nd.count; i++) {
            if (dict && (rc = parse_value(tp, depth + 1, 1)))
                return rc;
            if ((rc = parse_value(tp, depth + 1, 0)))
                return rc;
        }
    }
    if (tp->nodes)
        tp->nodes[at].next = tp->n_nodes;
    return FRK_OK;
}

static int parse_tree(tree_parser *tp)
{
    int rc = parse_value(tp, 0, 0);
    if (rc)
        return rc;
    if (tp->pos != tp->len)
        return fail(tp->err, FRK_ECORRUPT, 0, "%zu stray bytes after the value tree",
                    tp->len - tp->pos);
    return FRK_OK;
}

/* Elements a strided view reaches, from its storage offset: 0 if it is empty.
 * Returns -1 on overflow or a negative size or stride. */
static int view_extent(unsigned ndim, const int64_t *sizes, const int64_t *strides,
                       uint64_t storage_offset, uint64_t *extent)
{
    uint64_t last = 0;
    for (unsigned d = 0; d < ndim; d++) {
        if (sizes[d] < 0 || strides[d] < 0)
            return -1;
        if (sizes[d] == 0) {
            *extent = 0;
            for (unsigned e = d + 1; e < ndim; e++)
                if (sizes[e] < 0 || strides[e] < 0)
                    return -1;
            return 0;
        }
        uint64_t step;
        if (__builtin_mul_overflow((uint64_t)(sizes[d] - 1), (uint64_t)strides[d], &step) ||
            __builtin_add_overflow(last, step, &last))
            return -1;
    }
    if (__builtin_add_overflow(last, storage_offset, &last) ||
        __builtin_add_overflow(last, 1, &last))
        return -1;
    *extent = last;
    return 0;
}

static int check_tensor(unsigned kind, unsigned dtype, unsigned ndim, uint64_t blob,
                        uint64_t n_blobs, uint64_t blob_len, uint64_t storage_offset,
                        const int64_t *sizes, const int64_t *strides, uint64_t idx,
                        frk_error *err)
{
    size_t item = frk_dtype_size(dtype);
    if (kind > FRK_KIND_NUMPY)
        return fail(err, FRK_ECORRUPT, 0, "tensor %llu has unknown kind %u", (unsigned long long)idx,
                    kind);
    if (!item)
        return fail(err, FRK_ECORRUPT, 0, "tensor %llu has unknown dtype code %u",
                    (unsigned long long)idx, dtype);
    if (ndim > FRK_MAX_NDIM)
        return fail(err, FRK_ECORRUPT, 0, "tensor %llu has %u dimensions (at most %u)",
                    (unsigned long long)idx, ndim, FRK_MAX_NDIM);
    if (blob >= n_blobs)
        return fail(err, FRK_ECORRUPT, 0, "tensor %llu refers to blob %llu of %llu",
                    (unsigned long long)idx, (unsigned long long)blob,
                    (unsigned long long)n_blobs);
    uint64_t extent, bytes, span = item;
    int empty = 0;
    /* torch and NumPy count elements and bytes in int64: so must a valid shape (broadcast
     * strides of 0 let a huge shape fit a tiny blob).  NumPy multiplies the non-zero sizes
     * even when one size is 0, and takes every stride of a non-empty array in bytes. */
    for (unsigned d = 0; d < ndim; d++) {
        if (sizes[d] < 0 ||
            (sizes[d] > 0 && (__builtin_mul_overflow(span, (uint64_t)sizes[d], &span) ||
                              span > (uint64_t)INT64_MAX)))
            return fail(err, FRK_ECORRUPT, 0, "tensor %llu has an impossible shape",
                        (unsigned long long)idx);
        empty |= sizes[d] == 0;
    }
    for (unsigned d = 0; d < ndim && !empty; d++)
        if (strides[d] > INT64_MAX / (int64_t)item)
            return fail(err, FRK_ECORRUPT, 0, "tensor %llu has an impossible stride",
                        (unsigned long long)idx);
    if (view_extent(ndim, sizes, strides, storage_offset, &extent) ||
        __builtin_mul_overflow(extent, (uint64_t)item, &bytes))
        return fail(err, FRK_ECORRUPT, 0, "tensor %llu has an impossible shape or stride",
                    (unsigned long long)idx);
    if (bytes > blob_len || (extent == 0 && storage_offset > blob_len / item))
        return fail(err, FRK_ECORRUPT, 0,
                    "tensor %llu needs %llu bytes of blob %llu, which holds %llu",
                    (unsigned long long)idx, (unsigned long long)bytes, (unsigned long long)blob,
                    (unsigned long long)blob_len);
    /* Overlapping views (stride 0, expand) would let a small file become a huge tensor as soon
     * as anything copies it: no tensor may hold more bytes than its blob stores. */
    if (!empty && span > blob_len)
        return fail(err, FRK_ECORRUPT, 0,
                    "tensor %llu holds %llu bytes of elements but its blob %llu stores %llu: "
                    "a tensor may not be larger than its stored bytes (an overlapping view, "
                    "such as a stride of 0)",
                    (unsigned long long)idx, (unsigned long long)span, (unsigned long long)blob,
                    (unsigned long long)blob_len);
    return FRK_OK;
}

/* ---- builder --------------------------------------------------------------- */

typedef struct {
    const void *data;
    uint64_t len;
} blob_ref;

struct frk_builder {
    blob_ref *blobs;
    size_t n_blobs, cap_blobs;
    buf_t tensors; /* encoded tensor entries */
    uint64_t n_tensors;
    buf_t tree;
};

frk_builder *frk_builder_new(void) { return calloc(1, sizeof(frk_builder)); }

void frk_builder_free(frk_builder *b)
{
    if (!b)
        return;
    free(b->blobs);
    free(b->tensors.data);
    free(b->tree.data);
    free(b);
}

static int oom(frk_error *err) { return fail(err, FRK_ENOMEM, ENOMEM, "out of memory"); }

int frk_builder_add_blob(frk_builder *b, const void *data, uint64_t len, uint64_t *idx,
                         frk_error *err)
{
    if (b->n_blobs == b->cap_blobs) {
        size_t cap = b->cap_blobs ? b->cap_blobs * 2 : 16;
        blob_ref *nb = realloc(b->blobs, cap * sizeof *nb);
        if (!nb)
            return oom(err);
        b->blobs = nb;
        b->cap_blobs = cap;
    }
    b->blobs[b->n_blobs].data = data;
    b->blobs[b->n_blobs].len = len;
    *idx = b->n_blobs++;
    return FRK_OK;
}

int frk_builder_add_tensor(frk_builder *b, unsigned kind, unsigned dtype, uint64_t blob,
                           uint64_t storage_offset, unsigned ndim, const int64_t *sizes,
                           const int64_t *strides, uint64_t *idx, frk_error *err)
{
    uint64_t blob_len = blob < b->n_blobs ? b->blobs[blob].len : 0;
    int rc = check_tensor(kind, dtype, ndim, blob, b->n_blobs, blob_len, storage_offset, sizes,
                          strides, b->n_tensors, err);
    if (rc == FRK_ECORRUPT) {
        char why[sizeof err->msg];
        memcpy(why, err->msg, sizeof why);
        return fail(err, FRK_EINVAL, 0, "%s", why);
    }
    if (rc)
        return rc;
    uint8_t *p = buf_grow(&b->tensors, TENSOR_HEAD_SIZE + 16u * ndim);
    if (!p)
        return oom(err);
    p[0] = (uint8_t)kind;
    p[1] = (uint8_t)dtype;
    p[2] = (uint8_t)ndim;
    p[3] = (uint8_t)(ndim >> 8);
    put32(p + 4, 0);
    put64(p + 8, blob);
    put64(p + 16, storage_offset);
    for (unsigned d = 0; d < ndim; d++) {
        put64(p + 24 + 8 * d, (uint64_t)sizes[d]);
        put64(p + 24 + 8 * (ndim + d), (uint64_t)strides[d]);
    }
    *idx = b->n_tensors++;
    return FRK_OK;
}

static int tree_put(frk_builder *b, uint8_t tag, int has_word, uint64_t word, frk_error *err)
{
    uint8_t *p = buf_grow(&b->tree, has_word ? 9 : 1);
    if (!p)
        return oom(err);
    p[0] = tag;
    if (has_word)
        put64(p + 1, word);
    return FRK_OK;
}

int frk_builder_put_scalar(frk_builder *b, frk_tag tag, frk_error *err)
{
    if (tag != FRK_TAG_NONE && tag != FRK_TAG_FALSE && tag != FRK_TAG_TRUE)
        return fail(err, FRK_EINVAL, 0, "tag %u is not a scalar", (unsigned)tag);
    return tree_put(b, (uint8_t)tag, 0, 0, err);
}

int frk_builder_put_int(frk_builder *b, int64_t v, frk_error *err)
{
    uint64_t u;
    memcpy(&u, &v, 8);
    return tree_put(b, FRK_TAG_INT, 1, u, err);
}

int frk_builder_put_float(frk_builder *b, double v, frk_error *err)
{
    uint64_t u;
    memcpy(&u, &v, 8);
    return tree_put(b, FRK_TAG_FLOAT, 1, u, err);
}

int frk_builder_put_str(frk_builder *b, frk_tag tag, const void *data, uint64_t len,
                        frk_error *err)
{
    if (tag != FRK_TAG_STR && tag != FRK_TAG_BYTES)
        return fail(err, FRK_EINVAL, 0, "tag %u is not str or bytes", (unsigned)tag);
    if (len > SIZE_MAX - 9)
        return oom(err);
    if (tag == FRK_TAG_STR && !utf8_valid(data, (size_t)len))
        return fail(err, FRK_EINVAL, 0, "string is not valid UTF-8");
    int rc = tree_put(b, (uint8_t)tag, 1, len, err);
    if (rc)
        return rc;
    uint8_t *p = buf_grow(&b->tree, (size_t)len);
    if (!p)
        return oom(err);
    if (len)
        memcpy(p, data, (size_t)len);
    return FRK_OK;
}

int frk_builder_put_container(frk_builder *b, frk_tag tag, uint64_t count, frk_error *err)
{
    if (tag != FRK_TAG_LIST && tag != FRK_TAG_TUPLE && tag != FRK_TAG_DICT)
        return fail(err, FRK_EINVAL, 0, "tag %u is not a container", (unsigned)tag);
    return tree_put(b, (uint8_t)tag, 1, count, err);
}

int frk_builder_put_tensor(frk_builder *b, uint64_t tensor, frk_error *err)
{
    if (tensor >= b->n_tensors)
        return fail(err, FRK_EINVAL, 0, "tensor %llu was never added", (unsigned long long)tensor);
    return tree_put(b, FRK_TAG_TENSOR, 1, tensor, err);
}

/* ---- atomic durable commit ------------------------------------------------------ */

static int write_all(int fd, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len) {
        ssize_t n = write(fd, p, len > (1u << 30) ? (1u << 30) : len);
        if (n < 0) {
            if (errno == EINTR)
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

static uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static int io_fail(frk_error *err, const char *what, const char *path, int e)
{
    return fail(err, FRK_EIO, e, "%s %s: %s (errno %d)", what, path, strerror(e), e);
}

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

int frk_builder_commit(frk_builder *b, const char *path, unsigned flags, uint64_t *written,
                       frk_error *err)
{
    int rc = FRK_OK, fd = -1;
    uint64_t *offsets = NULL;
    uint8_t *index = NULL;
    char dir[4096], tmp[4096 + 64];
    const char *base;

    if (split_path(path, dir, sizeof dir, &base) || !*base)
        return fail(err, FRK_EINVAL, 0, "invalid checkpoint path %s", path);

    /* Refuse to write a tree the reader would reject. */
    tree_parser tp = {b->tree.data, b->tree.len, 0, b->n_tensors, NULL, 0, 0, err};
    if ((rc = parse_tree(&tp))) {
        char why[sizeof err->msg];
        memcpy(why, err->msg, sizeof why);
        return fail(err, FRK_EINVAL, 0, "malformed value tree: %s", why);
    }

    /* Layout. */
    offsets = malloc((b->n_blobs ? b->n_blobs : 1) * sizeof *offsets);
    if (!offsets)
        return oom(err);
    uint64_t off = FRK_PREAMBLE_SIZE;
    for (size_t i = 0; i < b->n_blobs; i++) {
        off = align_up(off, FRK_BLOB_ALIGN);
        offsets[i] = off;
        if (__builtin_add_overflow(off, b->blobs[i].len, &off)) {
            rc = fail(err, FRK_EINVAL, 0, "checkpoint larger than 2^64 bytes");
            goto out;
        }
    }
    uint64_t index_offset = align_up(off, 8);
    size_t index_size = 8 + BLOB_ENTRY_SIZE * b->n_blobs + 8 + b->tensors.len + 8 + b->tree.len;
    uint64_t file_size = index_offset + index_size + FRK_FOOTER_SIZE;
    index = malloc(index_size);
    if (!index) {
        rc = oom(err);
        goto out;
    }

    /* Temporary file beside the target, so the rename stays on one file system. */
    for (unsigned attempt = 0;; attempt++) {
        snprintf(tmp, sizeof tmp, "%s/.%s.tmp.%ld.%u", dir, base, (long)getpid(), attempt);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0)
            break;
        if (errno != EEXIST || attempt > 100) {
            int e = errno;
            rc = fail(err, FRK_EIO, e, "cannot create a temporary file for %s (%s): %s (errno %d)",
                      path, tmp, strerror(e), e);
            fd = -1;
            goto out;
        }
    }
    int e = posix_fallocate(fd, 0, (off_t)file_size);
    if (e && e != EOPNOTSUPP && e != EINVAL && e != ENOSYS) {
        rc = io_fail(err, "cannot reserve space for", path, e);
        goto fail_tmp;
    }

    uint8_t head[FRK_PREAMBLE_SIZE] = {0};
    static const uint8_t zeros[FRK_BLOB_ALIGN];
    memcpy(head, PREAMBLE_MAGIC, 8);
    put32(head + 8, FRK_FORMAT_VERSION);
    if (write_all(fd, head, sizeof head))
        goto io_error;

    uint8_t *q = index;
    put64(q, b->n_blobs);
    q += 8;
    uint64_t pos = FRK_PREAMBLE_SIZE;
    for (size_t i = 0; i < b->n_blobs; i++) {
        if (write_all(fd, zeros, (size_t)(offsets[i] - pos)))
            goto io_error;
        const uint8_t *p = b->blobs[i].data;
        uint64_t left = b->blobs[i].len;
        uint32_t crc = 0;
        while (left) {
            size_t n = left > WRITE_CHUNK ? WRITE_CHUNK : (size_t)left;
            crc = frk_crc32c(crc, p, n); /* while the chunk is still in cache */
            if (write_all(fd, p, n))
                goto io_error;
            p += n;
            left -= n;
        }
        pos = offsets[i] + b->blobs[i].len;
        put64(q, offsets[i]);
        put64(q + 8, b->blobs[i].len);
        put32(q + 16, crc);
        put32(q + 20, 0);
        q += BLOB_ENTRY_SIZE;
    }
    if (write_all(fd, zeros, (size_t)(index_offset - pos)))
        goto io_error;
    put64(q, b->n_tensors);
    q += 8;
    if (b->tensors.len)
        memcpy(q, b->tensors.data, b->tensors.len);
    q += b->tensors.len;
    put64(q, b->tree.len);
    q += 8;
    memcpy(q, b->tree.data, b->tree.len);

    uint8_t foot[FRK_FOOTER_SIZE] = {0};
    put64(foot, index_offset);
    put64(foot + 8, index_size);
    put64(foot + 16, file_size);
    put32(foot + 24, frk_crc32c(0, index, index_size));
    put32(foot + 28, FRK_FORMAT_VERSION);
    put32(foot + 52, frk_crc32c(0, foot, 52));
    memcpy(foot + 56, FOOTER_MAGIC, 8);
    if (write_all(fd, index, index_size) || write_all(fd, foot, sizeof foot))
        goto io_error;
    if ((flags & FRK_COMMIT_FSYNC) && fsync(fd))
        goto io_error;
    if (close(fd)) {
        fd = -1;
        goto io_error;
    }
    fd = -1;
    if (rename(tmp, path)) {
        rc = io_fail(err, "cannot rename the new checkpoint onto", path, errno);
        goto fail_tmp;
    }
    if (flags & FRK_COMMIT_FSYNC) {
        int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            /* The file is complete and in place; a failing directory sync
             * only weakens durability, so report it. */
            if (fsync(dfd) && errno != EINVAL)
                rc = io_fail(err, "cannot sync directory", dir, errno);
            close(dfd);
        }
    }
    if (written)
        *written = file_size;
    goto out;

io_error:
    rc = io_fail(err, "cannot write checkpoint", path, errno);
fail_tmp:
    if (fd >= 0)
        close(fd);
    fd = -1;
    unlink(tmp);
out:
    free(offsets);
    free(index);
    return rc;
}

/* ---- reader ---------------------------------------------------------------- */

struct frk_reader {
    const uint8_t *data;
    size_t len;
    uint32_t version;
    frk_blob *blobs;
    size_t n_blobs;
    frk_tensor *tensors;
    int64_t *dims; /* sizes and strides of every tensor */
    size_t n_tensors;
    frk_node *nodes;
    size_t n_nodes;
};

int frk_has_magic(const void *data, size_t len)
{
    return len >= 8 && memcmp(data, PREAMBLE_MAGIC, 8) == 0;
}

/* Opens path for reading if it is a regular file long enough to be a checkpoint. */
static int open_checkpoint_file(const char *path, int *fd_out, size_t *len, frk_error *err)
{
    /* O_NONBLOCK: a FIFO or device must fail the S_ISREG check below, not block the open. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return io_fail(err, "cannot open", path, errno);
    struct stat st;
    int rc = FRK_OK;
    if (fstat(fd, &st))
        rc = io_fail(err, "cannot stat", path, errno);
    else if (!S_ISREG(st.st_mode))
        rc = fail(err, FRK_ECORRUPT, 0, "%s is not a regular file", path);
    else if (st.st_size < (off_t)(FRK_PREAMBLE_SIZE + FRK_FOOTER_SIZE))
        rc = fail(err, FRK_ECORRUPT, 0,
                  "%s is %lld bytes, too short to be a checkpoint (truncated?)", path,
                  (long long)st.st_size);
    else if ((uint64_t)st.st_size > SIZE_MAX)
        rc = fail(err, FRK_ECORRUPT, 0, "%s is too large to map", path);
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
        return io_fail(err, "cannot map", path, e);
    madvise(m, *len, MADV_WILLNEED);
    *base = m;
    return FRK_OK;
}

int frk_read_file(const char *path, uint8_t **base, size_t *len, frk_error *err)
{
    int fd, rc = open_checkpoint_file(path, &fd, len, err);
    if (rc)
        return rc;
    /* Anonymous memory (not malloc) so that frk_unmap frees either kind.  (MADV_HUGEPAGE
     * would halve the page faults but stalls in compaction on a first large load.) */
    uint8_t *m = mmap(NULL, *len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        close(fd);
        return e == ENOMEM ? fail(err, FRK_ENOMEM, e, "out of memory reading %s", path)
                           : io_fail(err, "cannot allocate memory for", path, e);
    }
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    size_t done = 0;
    while (done < *len) {
        size_t want = *len - done > (1u << 30) ? (1u << 30) : *len - done;
        ssize_t n = pread(fd, m + done, want, (off_t)done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = errno;
            rc = n < 0 ? io_fail(err, "cannot read", path, e)
                       : fail(err, FRK_ECORRUPT, 0,
                              "%s shrank from %zu to %zu bytes while it was read (truncated?)",
                              path, *len, done);
            close(fd);
            munmap(m, *len);
            return rc;
        }
        done += (size_t)n;
    }
    close(fd);
    *base = m;
    return FRK_OK;
}

void frk_unmap(uint8_t *base, size_t len)
{
    if (base)
        munmap(base, len);
}

void frk_reader_free(frk_reader *r)
{
    if (!r)
        return;
    free(r->blobs);
    free(r->tensors);
    free(r->dims);
    free(r->nodes);
    free(r);
}

static int check_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

int frk_reader_open(const uint8_t *data, size_t len, int verify, frk_reader **out, frk_error *err)
{
    int rc;
    *out = NULL;
    if (len < FRK_PREAMBLE_SIZE + FRK_FOOTER_SIZE)
        return corrupt(err, "file is %zu bytes, too short to be a checkpoint (truncated?)", len);
    if (!frk_has_magic(data, len))
        return corrupt(err, "not a fastai-resume checkpoint (bad magic bytes)");
    uint32_t version = get32(data + 8);
    if (version != FRK_FORMAT_VERSION)
        return corrupt(err, "format version %u, this build reads version %u: upgrade fastai_resume",
                       version, FRK_FORMAT_VERSION);
    if (!check_zero(data + 12, FRK_PREAMBLE_SIZE - 12))
        return corrupt(err, "preamble has unknown flags set");

    const uint8_t *foot = data + len - FRK_FOOTER_SIZE;
    if (memcmp(foot + 56, FOOTER_MAGIC, 8))
        return corrupt(err, "no valid footer: the file is incomplete or truncated");
    if (get32(foot + 52) != frk_crc32c(0, foot, 52))
        return corrupt(err, "footer checksum mismatch: the file is damaged");
    uint64_t index_offset = get64(foot), index_size = get64(foot + 8), file_size = get64(foot + 16);
    if (file_size != len)
        return corrupt(err, "footer says %llu bytes but the file has %zu: truncated or appended to",
                       (unsigned long long)file_size, len);
    if (get32(foot + 28) != version || !check_zero(foot + 32, 20))
        return corrupt(err, "footer fields are inconsistent");
    uint64_t index_end;
    if (index_offset < FRK_PREAMBLE_SIZE || index_offset % 8 ||
        __builtin_add_overflow(index_offset, index_size, &index_end) ||
        index_end != len - FRK_FOOTER_SIZE || index_size < 24)
        return corrupt(err, "index location (offset %llu, %llu bytes) is outside the file",
                       (unsigned long long)index_offset, (unsigned long long)index_size);
    const uint8_t *ix = data + index_offset;
    if (get32(foot + 24) != frk_crc32c(0, ix, (size_t)index_size))
        return corrupt(err, "index checksum mismatch: the file is damaged");

    frk_reader *r = calloc(1, sizeof *r);
    if (!r)
        return oom(err);
    r->data = data;
    r->len = len;
    r->version = version;
    size_t pos = 0, isz = (size_t)index_size;

    /* Blob table. */
    uint64_t nb = get64(ix);
    pos = 8;
    if (nb > (isz - pos) / BLOB_ENTRY_SIZE) {
        rc = corrupt(err, "blob count %llu does not fit in the index", (unsigned long long)nb);
        goto bad;
    }
    r->n_blobs = (size_t)nb;
    r->blobs = malloc((nb ? nb : 1) * sizeof *r->blobs);
    if (!r->blobs) {
        rc = oom(err);
        goto bad;
    }
    uint64_t prev_end = FRK_PREAMBLE_SIZE;
    for (size_t i = 0; i < r->n_blobs; i++, pos += BLOB_ENTRY_SIZE) {
        frk_blob *bl = &r->blobs[i];
        bl->offset = get64(ix + pos);
        bl->length = get64(ix + pos + 8);
        bl->crc = get32(ix + pos + 16);
        uint64_t end;
        if (get32(ix + pos + 20) || bl->offset % FRK_BLOB_ALIGN || bl->offset < prev_end ||
            __builtin_add_overflow(bl->offset, bl->length, &end) || end > index_offset) {
            rc = corrupt(err,
                         "blob %zu (offset %llu, %llu bytes) overlaps another or lies outside "
                         "the data area",
                         i, (unsigned long long)bl->offset, (unsigned long long)bl->length);
            goto bad;
        }
        prev_end = end;
    }

    /* Tensor table. */
    if (isz - pos < 8) {
        rc = corrupt(err, "index ends before the tensor table");
        goto bad;
    }
    uint64_t nt = get64(ix + pos);
    pos += 8;
    if (nt > (isz - pos) / TENSOR_HEAD_SIZE) {
        rc = corrupt(err, "tensor count %llu does not fit in the index", (unsigned long long)nt);
        goto bad;
    }
    r->n_tensors = (size_t)nt;
    r->tensors = malloc((nt ? nt : 1) * sizeof *r->tensors);
    /* Every dimension takes 16 index bytes, so this bounds the dims array. */
    size_t max_dims = (isz - pos) / 8 + 1;
    r->dims = malloc(max_dims * sizeof *r->dims);
    if (!r->tensors || !r->dims) {
        rc = oom(err);
        goto bad;
    }
    size_t used_dims = 0;
    for (size_t i = 0; i < r->n_tensors; i++) {
        if (isz - pos < TENSOR_HEAD_SIZE) {
            rc = corrupt(err, "tensor table ends early at tensor %zu", i);
            goto bad;
        }
        const uint8_t *t = ix + pos;
        frk_tensor *te = &r->tensors[i];
        te->kind = t[0];
        te->dtype = t[1];
        te->ndim = (uint16_t)(t[2] | t[3] << 8);
        te->blob = get64(t + 8);
        te->storage_offset = get64(t + 16);
        pos += TENSOR_HEAD_SIZE;
        if (get32(t + 4)) {
            rc = corrupt(err, "tensor %zu has reserved bytes set", i);
            goto bad;
        }
        if (te->ndim > FRK_MAX_NDIM || (isz - pos) / 16 < te->ndim) {
            rc = corrupt(err, "tensor %zu has %u dimensions, more than the index holds", i,
                         te->ndim);
            goto bad;
        }
        int64_t *sz = r->dims + used_dims, *st = sz + te->ndim;
        for (unsigned d = 0; d < te->ndim; d++) {
            sz[d] = (int64_t)get64(ix + pos + 8 * d);
            st[d] = (int64_t)get64(ix + pos + 8 * (te->ndim + d));
        }
        pos += 16u * te->ndim;
        used_dims += 2u * te->ndim;
        te->sizes = sz;
        te->strides = st;
        uint64_t blen = te->blob < r->n_blobs ? r->blobs[te->blob].length : 0;
        if ((rc = check_tensor(te->kind, te->dtype, te->ndim, te->blob, r->n_blobs, blen,
                               te->storage_offset, sz, st, i, err)))
            goto bad;
    }

    /* Value tree. */
    if (isz - pos < 8) {
        rc = corrupt(err, "index ends before the value tree");
        goto bad;
    }
    uint64_t tree_len = get64(ix + pos);
    pos += 8;
    if (tree_len != isz - pos) {
        rc = corrupt(err, "value tree claims %llu bytes, the index has %zu left",
                     (unsigned long long)tree_len, isz - pos);
        goto bad;
    }
    tree_parser tp = {ix + pos, (size_t)tree_len, 0, nt, NULL, 0, 64, err};
    tp.nodes = malloc(tp.cap_nodes * sizeof *tp.nodes);
    if (!tp.nodes) {
        rc = oom(err);
        goto bad;
    }
    rc = parse_tree(&tp);
    r->nodes = tp.nodes;
    r->n_nodes = tp.n_nodes;
    if (rc)
        goto bad;

    if (verify)
        for (size_t i = 0; i < r->n_blobs; i++)
            if ((rc = frk_reader_verify_blob(r, i, err)))
                goto bad;
    *out = r;
    return FRK_OK;
bad:
    frk_reader_free(r);
    return rc;
}

int frk_reader_verify_blob(const frk_reader *r, size_t i, frk_error *err)
{
    if (i >= r->n_blobs)
        return fail(err, FRK_EINVAL, 0, "no blob %zu", i);
    const frk_blob *bl = &r->blobs[i];
    if (frk_crc32c(0, r->data + bl->offset, (size_t)bl->length) != bl->crc)
        return corrupt(err, "checksum mismatch in blob %zu (offset %llu, %llu bytes): the file is "
                            "damaged",
                       i, (unsigned long long)bl->offset, (unsigned long long)bl->length);
    return FRK_OK;
}

uint32_t frk_reader_version(const frk_reader *r) { return r->version; }
size_t frk_reader_blob_count(const frk_reader *r) { return r->n_blobs; }
const frk_blob *frk_reader_blob(const frk_reader *r, size_t i)
{
    return i < r->n_blobs ? &r->blobs[i] : NULL;
}
size_t frk_reader_tensor_count(const frk_reader *r) { return r->n_tensors; }
const frk_tensor *frk_reader_tensor(const frk_reader *r, size_t i)
{
    return i < r->n_tensors ? &r->tensors[i] : NULL;
}
size_t frk_reader_node_count(const frk_reader *r) { return r->n_nodes; }
const frk_node *frk_reader_nodes(const frk_reader *r) { return r->nodes; }
