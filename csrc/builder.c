/* The builder: encodes a value tree, its tensor table and its blob references in memory,
 * for commit.c to write. */
#include "internal.h"
#include "layout.h"

#include <stdlib.h>
#include <string.h>

uint8_t *frk_buf_grow(frk_buf *b, size_t n)
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

/* ---- builder --------------------------------------------------------------- */

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

static int add_blob(frk_builder *b, const void *data, uint64_t len, int has_crc, uint32_t crc,
                    uint64_t *idx, frk_error *err)
{
    if (b->n_blobs == b->cap_blobs) {
        size_t cap = b->cap_blobs ? b->cap_blobs * 2 : 16;
        frk_blob_ref *nb = realloc(b->blobs, cap * sizeof *nb);
        if (!nb)
            return frk_oom(err);
        b->blobs = nb;
        b->cap_blobs = cap;
    }
    frk_blob_ref *r = &b->blobs[b->n_blobs];
    r->data = data;
    r->len = len;
    r->crc = crc;
    r->has_crc = has_crc;
    *idx = b->n_blobs++;
    return FRK_OK;
}

int frk_builder_add_blob(frk_builder *b, const void *data, uint64_t len, uint64_t *idx,
                         frk_error *err)
{
    return add_blob(b, data, len, 0, 0, idx, err);
}

int frk_builder_add_blob_crc(frk_builder *b, const void *data, uint64_t len, uint32_t crc,
                             uint64_t *idx, frk_error *err)
{
    return add_blob(b, data, len, 1, crc, idx, err);
}

int frk_builder_add_tensor(frk_builder *b, unsigned kind, unsigned dtype, uint64_t blob,
                           uint64_t storage_offset, unsigned ndim, const int64_t *sizes,
                           const int64_t *strides, uint64_t *idx, frk_error *err)
{
    uint64_t blob_len = blob < b->n_blobs ? b->blobs[blob].len : 0;
    int rc = frk_check_tensor(kind, dtype, ndim, blob, b->n_blobs, blob_len, storage_offset, sizes,
                              strides, b->n_tensors, err);
    if (rc == FRK_ECORRUPT) {
        char why[sizeof err->msg];
        memcpy(why, err->msg, sizeof why);
        return frk_fail(err, FRK_EINVAL, 0, "%s", why);
    }
    if (rc)
        return rc;
    uint8_t *p = frk_buf_grow(&b->tensors, FRK_TENSOR_HEAD_SIZE + FRK_TENSOR_DIM_SIZE * ndim);
    if (!p)
        return frk_oom(err);
    p[FRK_TENSOR_KIND] = (uint8_t)kind;
    p[FRK_TENSOR_DTYPE] = (uint8_t)dtype;
    frk_put16(p + FRK_TENSOR_NDIM, (uint16_t)ndim);
    frk_put32(p + FRK_TENSOR_RESERVED, 0);
    frk_put64(p + FRK_TENSOR_BLOB, blob);
    frk_put64(p + FRK_TENSOR_STORAGE_OFFSET, storage_offset);
    for (unsigned d = 0; d < ndim; d++) {
        frk_put64(p + FRK_TENSOR_SIZE_AT(d), (uint64_t)sizes[d]);
        frk_put64(p + FRK_TENSOR_STRIDE_AT(ndim, d), (uint64_t)strides[d]);
    }
    *idx = b->n_tensors++;
    return FRK_OK;
}

static int tree_put(frk_builder *b, uint8_t tag, int has_word, uint64_t word, frk_error *err)
{
    uint8_t *p = frk_buf_grow(&b->tree, FRK_VALUE_TAG_SIZE + (has_word ? FRK_VALUE_WORD : 0));
    if (!p)
        return frk_oom(err);
    p[0] = tag;
    if (has_word)
        frk_put64(p + FRK_VALUE_TAG_SIZE, word);
    return FRK_OK;
}

int frk_builder_put_scalar(frk_builder *b, frk_tag tag, frk_error *err)
{
    if (tag != FRK_TAG_NONE && tag != FRK_TAG_FALSE && tag != FRK_TAG_TRUE)
        return frk_fail(err, FRK_EINVAL, 0, "tag %u is not a scalar", (unsigned)tag);
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

int frk_builder_put_str(frk_builder *b, frk_tag tag, const void *data, uint64_t len, frk_error *err)
{
    if (tag != FRK_TAG_STR && tag != FRK_TAG_BYTES)
        return frk_fail(err, FRK_EINVAL, 0, "tag %u is not str or bytes", (unsigned)tag);
    if (len > SIZE_MAX - 9)
        return frk_oom(err);
    if (tag == FRK_TAG_STR && !frk_utf8_valid(data, (size_t)len))
        return frk_fail(err, FRK_EINVAL, 0, "string is not valid UTF-8");
    int rc = tree_put(b, (uint8_t)tag, 1, len, err);
    if (rc)
        return rc;
    uint8_t *p = frk_buf_grow(&b->tree, (size_t)len);
    if (!p)
        return frk_oom(err);
    if (len)
        memcpy(p, data, (size_t)len);
    return FRK_OK;
}

int frk_builder_put_container(frk_builder *b, frk_tag tag, uint64_t count, frk_error *err)
{
    if (tag != FRK_TAG_LIST && tag != FRK_TAG_TUPLE && tag != FRK_TAG_DICT)
        return frk_fail(err, FRK_EINVAL, 0, "tag %u is not a container", (unsigned)tag);
    return tree_put(b, (uint8_t)tag, 1, count, err);
}

int frk_builder_put_tensor(frk_builder *b, uint64_t tensor, frk_error *err)
{
    if (tensor >= b->n_tensors)
        return frk_fail(err, FRK_EINVAL, 0, "tensor %llu was never added",
                        (unsigned long long)tensor);
    return tree_put(b, FRK_TAG_TENSOR, 1, tensor, err);
}
