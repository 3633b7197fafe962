/* What the format forbids, checked in one place: by the reader before it trusts a file, and
 * by the builder before it writes one.  Error reporting, dtype sizes, strict UTF-8, the value
 * tree's parser and the tensor-entry check. */
#include "internal.h"
#include "layout.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int frk_fail(frk_error *err, int status, int sys_errno, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof err->msg) {
        /* Cut short (a long path): end with "..." at a character boundary, never inside a
         * UTF-8 sequence. */
        size_t end = sizeof err->msg - 4;
        while (end > 0 && ((uint8_t)err->msg[end] & 0xC0) == 0x80)
            end--;
        memcpy(err->msg + end, "...", 4);
    }
    err->status = status;
    err->sys_errno = sys_errno;
    return status;
}

int frk_oom(frk_error *err) { return frk_fail(err, FRK_ENOMEM, ENOMEM, "out of memory"); }

int frk_io_fail(frk_error *err, const char *what, const char *path, int e)
{
    return frk_fail(err, FRK_EIO, e, "%s %s: %s (errno %d)", what, path, strerror(e), e);
}

static const unsigned char DTYPE_SIZE[FRK_DT_COUNT] = {
    [FRK_DT_BOOL] = 1,        [FRK_DT_U8] = 1,          [FRK_DT_I8] = 1,
    [FRK_DT_I16] = 2,         [FRK_DT_I32] = 4,         [FRK_DT_I64] = 8,
    [FRK_DT_U16] = 2,         [FRK_DT_U32] = 4,         [FRK_DT_U64] = 8,
    [FRK_DT_F16] = 2,         [FRK_DT_BF16] = 2,        [FRK_DT_F32] = 4,
    [FRK_DT_F64] = 8,         [FRK_DT_C32] = 4,         [FRK_DT_C64] = 8,
    [FRK_DT_C128] = 16,       [FRK_DT_F8_E4M3FN] = 1,   [FRK_DT_F8_E5M2] = 1,
    [FRK_DT_F8_E4M3FNUZ] = 1, [FRK_DT_F8_E5M2FNUZ] = 1, [FRK_DT_F8_E8M0FNU] = 1,
};

size_t frk_dtype_size(unsigned code) { return code < FRK_DT_COUNT ? DTYPE_SIZE[code] : 0; }

/* ---- UTF-8 --------------------------------------------------------------- */

int frk_utf8_valid(const uint8_t *s, size_t n)
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

static int node_push(frk_tree_parser *tp, const frk_node *nd, size_t *at)
{
    if (tp->n_nodes == tp->cap_nodes && tp->nodes) {
        size_t cap = tp->cap_nodes * 2;
        frk_node *n2 = realloc(tp->nodes, cap * sizeof *n2);
        if (!n2)
            return frk_fail(tp->err, FRK_ENOMEM, ENOMEM, "out of memory decoding the value tree");
        tp->nodes = n2;
        tp->cap_nodes = cap;
    }
    *at = tp->n_nodes;
    if (tp->nodes)
        tp->nodes[tp->n_nodes] = *nd;
    tp->n_nodes++;
    return FRK_OK;
}

static int parse_value(frk_tree_parser *tp, unsigned depth, int is_key)
{
    size_t start = tp->pos;
    if (depth > FRK_MAX_DEPTH)
        return frk_fail(tp->err, FRK_ECORRUPT, 0,
                        "value tree nested deeper than %u levels at byte %zu", FRK_MAX_DEPTH,
                        start);
    if (tp->pos >= tp->len)
        return frk_fail(tp->err, FRK_ECORRUPT, 0, "value tree ends early at byte %zu", start);
    frk_node nd = {0};
    nd.tag = tp->p[tp->pos++];
    size_t rest = tp->len - tp->pos;
    if (is_key && nd.tag != FRK_TAG_STR && nd.tag != FRK_TAG_INT)
        return frk_fail(tp->err, FRK_ECORRUPT, 0, "dict key at byte %zu is tag %u, not str or int",
                        start, nd.tag);
    switch (nd.tag) {
    case FRK_TAG_NONE:
    case FRK_TAG_FALSE:
    case FRK_TAG_TRUE:
        break;
    case FRK_TAG_INT:
    case FRK_TAG_FLOAT:
        if (rest < FRK_VALUE_WORD)
            return frk_fail(tp->err, FRK_ECORRUPT, 0, "number at byte %zu is cut short", start);
        {
            uint64_t v = frk_get64(tp->p + tp->pos);
            if (nd.tag == FRK_TAG_INT)
                memcpy(&nd.ival, &v, sizeof v);
            else
                memcpy(&nd.fval, &v, sizeof v);
        }
        tp->pos += FRK_VALUE_WORD;
        break;
    case FRK_TAG_STR:
    case FRK_TAG_BYTES:
    case FRK_TAG_LIST:
    case FRK_TAG_TUPLE:
    case FRK_TAG_DICT:
    case FRK_TAG_TENSOR:
        if (rest < FRK_VALUE_WORD)
            return frk_fail(tp->err, FRK_ECORRUPT, 0, "length at byte %zu is cut short", start);
        nd.count = frk_get64(tp->p + tp->pos);
        tp->pos += FRK_VALUE_WORD;
        rest -= FRK_VALUE_WORD;
        break;
    default:
        return frk_fail(tp->err, FRK_ECORRUPT, 0, "unknown value tag %u at byte %zu", nd.tag,
                        start);
    }
    if (nd.tag == FRK_TAG_STR || nd.tag == FRK_TAG_BYTES) {
        if (nd.count > rest)
            return frk_fail(tp->err, FRK_ECORRUPT, 0,
                            "string at byte %zu claims %llu bytes, only %zu remain", start,
                            (unsigned long long)nd.count, rest);
        nd.data = tp->p + tp->pos;
        if (nd.tag == FRK_TAG_STR && !frk_utf8_valid(nd.data, (size_t)nd.count))
            return frk_fail(tp->err, FRK_ECORRUPT, 0, "string at byte %zu is not valid UTF-8",
                            start);
        tp->pos += (size_t)nd.count;
    } else if (nd.tag == FRK_TAG_TENSOR) {
        if (nd.count >= tp->n_tensors)
            return frk_fail(tp->err, FRK_ECORRUPT, 0,
                            "tensor reference %llu at byte %zu, but the table holds %llu",
                            (unsigned long long)nd.count, start, (unsigned long long)tp->n_tensors);
    } else if (nd.tag >= FRK_TAG_LIST) { /* containers: every item takes at least a byte */
        uint64_t need = nd.count;
        if (nd.tag == FRK_TAG_DICT)
            need = nd.count > UINT64_MAX / 2 ? UINT64_MAX : nd.count * 2;
        if (need > rest)
            return frk_fail(tp->err, FRK_ECORRUPT, 0,
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

int frk_parse_tree(frk_tree_parser *tp)
{
    int rc = parse_value(tp, 0, 0);
    if (rc)
        return rc;
    if (tp->pos != tp->len)
        return frk_fail(tp->err, FRK_ECORRUPT, 0, "%zu stray bytes after the value tree",
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

int frk_check_tensor(unsigned kind, unsigned dtype, unsigned ndim, uint64_t blob, uint64_t n_blobs,
                     uint64_t blob_len, uint64_t storage_offset, const int64_t *sizes,
                     const int64_t *strides, uint64_t idx, frk_error *err)
{
    size_t item = frk_dtype_size(dtype);
    if (kind > FRK_KIND_NUMPY)
        return frk_fail(err, FRK_ECORRUPT, 0, "tensor %llu has unknown kind %u",
                        (unsigned long long)idx, kind);
    if (!item)
        return frk_fail(err, FRK_ECORRUPT, 0, "tensor %llu has unknown dtype code %u",
                        (unsigned long long)idx, dtype);
    if (kind == FRK_KIND_NUMPY &&
        (dtype == FRK_DT_BF16 || dtype == FRK_DT_C32 || dtype >= FRK_DT_F8_E4M3FN))
        return frk_fail(err, FRK_ECORRUPT, 0,
                        "tensor %llu is a NumPy array of dtype code %u, not a NumPy dtype",
                        (unsigned long long)idx, dtype);
    if (ndim > FRK_MAX_NDIM)
        return frk_fail(err, FRK_ECORRUPT, 0, "tensor %llu has %u dimensions (at most %u)",
                        (unsigned long long)idx, ndim, FRK_MAX_NDIM);
    if (blob >= n_blobs)
        return frk_fail(err, FRK_ECORRUPT, 0, "tensor %llu refers to blob %llu of %llu",
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
            return frk_fail(err, FRK_ECORRUPT, 0, "tensor %llu has an impossible shape",
                            (unsigned long long)idx);
        empty |= sizes[d] == 0;
    }
    for (unsigned d = 0; d < ndim && !empty; d++)
        if (strides[d] > INT64_MAX / (int64_t)item)
            return frk_fail(err, FRK_ECORRUPT, 0, "tensor %llu has an impossible stride",
                            (unsigned long long)idx);
    if (view_extent(ndim, sizes, strides, storage_offset, &extent) ||
        __builtin_mul_overflow(extent, (uint64_t)item, &bytes))
        return frk_fail(err, FRK_ECORRUPT, 0, "tensor %llu has an impossible shape or stride",
                        (unsigned long long)idx);
    if (bytes > blob_len || (extent == 0 && storage_offset > blob_len / item))
        return frk_fail(err, FRK_ECORRUPT, 0,
                        "tensor %llu needs %llu bytes of blob %llu, which holds %llu",
                        (unsigned long long)idx, (unsigned long long)bytes,
                        (unsigned long long)blob, (unsigned long long)blob_len);
    /* Overlapping views (stride 0, expand) would let a small file become a huge tensor as soon
     * as anything copies it: no tensor may hold more bytes than its blob stores. */
    if (!empty && span > blob_len)
        return frk_fail(err, FRK_ECORRUPT, 0,
                        "tensor %llu holds %llu bytes of elements but its blob %llu stores %llu: "
                        "a tensor may not be larger than its stored bytes (an overlapping view, "
                        "such as a stride of 0)",
                        (unsigned long long)idx, (unsigned long long)span, (unsigned long long)blob,
                        (unsigned long long)blob_len);
    return FRK_OK;
}
