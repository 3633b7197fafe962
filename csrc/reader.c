/* The validating reader: checks a checkpoint image (load.c brings files into memory) and
 * decodes its index. */
#include "internal.h"
#include "layout.h"

#include <stdlib.h>
#include <string.h>

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
    return len >= FRK_MAGIC_SIZE && memcmp(data, FRK_PREAMBLE_MAGIC, FRK_MAGIC_SIZE) == 0;
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
        return frk_corrupt(err, "file is %zu bytes, too short to be a checkpoint (truncated?)",
                           len);
    if (!frk_has_magic(data, len))
        return frk_corrupt(err, "not a fastai-resume checkpoint (bad magic bytes)");
    uint32_t version = frk_get32(data + FRK_PRE_VERSION);
    if (version != FRK_FORMAT_VERSION)
        return frk_corrupt(err,
                           "format version %u, this build reads version %u: upgrade fastai_resume",
                           version, FRK_FORMAT_VERSION);
    if (!check_zero(data + FRK_PRE_RESERVED, FRK_PREAMBLE_SIZE - FRK_PRE_RESERVED))
        return frk_corrupt(err, "preamble has unknown flags set");

    const uint8_t *foot = data + len - FRK_FOOTER_SIZE;
    if (memcmp(foot + FRK_FOOT_MAGIC, FRK_FOOTER_MAGIC, FRK_MAGIC_SIZE))
        return frk_corrupt(err, "no valid footer: the file is incomplete or truncated");
    if (frk_get32(foot + FRK_FOOT_CRC) != frk_crc32c(0, foot, FRK_FOOT_CRC))
        return frk_corrupt(err, "footer checksum mismatch: the file is damaged");
    uint64_t index_offset = frk_get64(foot + FRK_FOOT_INDEX_OFFSET);
    uint64_t index_size = frk_get64(foot + FRK_FOOT_INDEX_SIZE);
    uint64_t file_size = frk_get64(foot + FRK_FOOT_FILE_SIZE);
    if (file_size != len)
        return frk_corrupt(err,
                           "footer says %llu bytes but the file has %zu: truncated or appended to",
                           (unsigned long long)file_size, len);
    if (frk_get32(foot + FRK_FOOT_VERSION) != version ||
        !check_zero(foot + FRK_FOOT_RESERVED, FRK_FOOT_CRC - FRK_FOOT_RESERVED))
        return frk_corrupt(err, "footer fields are inconsistent");
    uint64_t index_end;
    if (index_offset < FRK_PREAMBLE_SIZE || index_offset % FRK_INDEX_WORD ||
        __builtin_add_overflow(index_offset, index_size, &index_end) ||
        index_end != len - FRK_FOOTER_SIZE || index_size < 3 * FRK_INDEX_WORD)
        return frk_corrupt(err, "index location (offset %llu, %llu bytes) is outside the file",
                           (unsigned long long)index_offset, (unsigned long long)index_size);
    const uint8_t *ix = data + index_offset;
    if (frk_get32(foot + FRK_FOOT_INDEX_CRC) != frk_crc32c(0, ix, (size_t)index_size))
        return frk_corrupt(err, "index checksum mismatch: the file is damaged");

    frk_reader *r = calloc(1, sizeof *r);
    if (!r)
        return frk_oom(err);
    r->data = data;
    r->len = len;
    r->version = version;
    size_t pos = 0, isz = (size_t)index_size;

    /* Blob table. */
    uint64_t nb = frk_get64(ix);
    pos = FRK_INDEX_WORD;
    if (nb > (isz - pos) / FRK_BLOB_ENTRY_SIZE) {
        rc = frk_corrupt(err, "blob count %llu does not fit in the index", (unsigned long long)nb);
        goto bad;
    }
    r->n_blobs = (size_t)nb;
    r->blobs = malloc((nb ? nb : 1) * sizeof *r->blobs);
    if (!r->blobs) {
        rc = frk_oom(err);
        goto bad;
    }
    uint64_t prev_end = FRK_PREAMBLE_SIZE;
    for (size_t i = 0; i < r->n_blobs; i++, pos += FRK_BLOB_ENTRY_SIZE) {
        const uint8_t *e = ix + pos;
        frk_blob *bl = &r->blobs[i];
        bl->offset = frk_get64(e + FRK_BLOB_OFFSET);
        bl->length = frk_get64(e + FRK_BLOB_LENGTH);
        bl->crc = frk_get32(e + FRK_BLOB_CRC);
        uint64_t end;
        if (frk_get32(e + FRK_BLOB_RESERVED) || bl->offset % FRK_BLOB_ALIGN ||
            bl->offset < prev_end || __builtin_add_overflow(bl->offset, bl->length, &end) ||
            end > index_offset) {
            rc = frk_corrupt(err,
                             "blob %zu (offset %llu, %llu bytes) overlaps another or lies outside "
                             "the data area",
                             i, (unsigned long long)bl->offset, (unsigned long long)bl->length);
            goto bad;
        }
        prev_end = end;
    }

    /* Tensor table. */
    if (isz - pos < FRK_INDEX_WORD) {
        rc = frk_corrupt(err, "index ends before the tensor table");
        goto bad;
    }
    uint64_t nt = frk_get64(ix + pos);
    pos += FRK_INDEX_WORD;
    if (nt > (isz - pos) / FRK_TENSOR_HEAD_SIZE) {
        rc =
            frk_corrupt(err, "tensor count %llu does not fit in the index", (unsigned long long)nt);
        goto bad;
    }
    r->n_tensors = (size_t)nt;
    r->tensors = malloc((nt ? nt : 1) * sizeof *r->tensors);
    /* Every dimension takes FRK_TENSOR_DIM_SIZE index bytes for its two words: this bounds
     * the dims array. */
    size_t max_dims = (isz - pos) / (FRK_TENSOR_DIM_SIZE / 2) + 1;
    r->dims = malloc(max_dims * sizeof *r->dims);
    if (!r->tensors || !r->dims) {
        rc = frk_oom(err);
        goto bad;
    }
    size_t used_dims = 0;
    for (size_t i = 0; i < r->n_tensors; i++) {
        if (isz - pos < FRK_TENSOR_HEAD_SIZE) {
            rc = frk_corrupt(err, "tensor table ends early at tensor %zu", i);
            goto bad;
        }
        const uint8_t *t = ix + pos;
        frk_tensor *te = &r->tensors[i];
        te->kind = t[FRK_TENSOR_KIND];
        te->dtype = t[FRK_TENSOR_DTYPE];
        te->ndim = frk_get16(t + FRK_TENSOR_NDIM);
        te->blob = frk_get64(t + FRK_TENSOR_BLOB);
        te->storage_offset = frk_get64(t + FRK_TENSOR_STORAGE_OFFSET);
        pos += FRK_TENSOR_HEAD_SIZE;
        if (frk_get32(t + FRK_TENSOR_RESERVED)) {
            rc = frk_corrupt(err, "tensor %zu has reserved bytes set", i);
            goto bad;
        }
        if (te->ndim > FRK_MAX_NDIM || (isz - pos) / FRK_TENSOR_DIM_SIZE < te->ndim) {
            rc = frk_corrupt(err, "tensor %zu has %u dimensions, more than the index holds", i,
                             te->ndim);
            goto bad;
        }
        int64_t *sz = r->dims + used_dims, *st = sz + te->ndim;
        for (unsigned d = 0; d < te->ndim; d++) {
            sz[d] = (int64_t)frk_get64(t + FRK_TENSOR_SIZE_AT(d));
            st[d] = (int64_t)frk_get64(t + FRK_TENSOR_STRIDE_AT(te->ndim, d));
        }
        pos += FRK_TENSOR_DIM_SIZE * te->ndim;
        used_dims += 2u * te->ndim;
        te->sizes = sz;
        te->strides = st;
        uint64_t blen = te->blob < r->n_blobs ? r->blobs[te->blob].length : 0;
        if ((rc = frk_check_tensor(te->kind, te->dtype, te->ndim, te->blob, r->n_blobs, blen,
                                   te->storage_offset, sz, st, i, err)))
            goto bad;
    }

    /* Value tree. */
    if (isz - pos < FRK_INDEX_WORD) {
        rc = frk_corrupt(err, "index ends before the value tree");
        goto bad;
    }
    uint64_t tree_len = frk_get64(ix + pos);
    pos += FRK_INDEX_WORD;
    if (tree_len != isz - pos) {
        rc = frk_corrupt(err, "value tree claims %llu bytes, the index has %zu left",
                         (unsigned long long)tree_len, isz - pos);
        goto bad;
    }
    frk_tree_parser tp = {ix + pos, (size_t)tree_len, 0, nt, NULL, 0, 64, err};
    tp.nodes = malloc(tp.cap_nodes * sizeof *tp.nodes);
    if (!tp.nodes) {
        rc = frk_oom(err);
        goto bad;
    }
    rc = frk_parse_tree(&tp);
    r->nodes = tp.nodes;
    r->n_nodes = tp.n_nodes;
    if (rc)
        goto bad;

    if (verify &&
        (rc = frk_check_blobs(r->blobs, r->n_blobs, data, FRK_PREAMBLE_SIZE, index_offset, err)))
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
        return frk_fail(err, FRK_EINVAL, 0, "no blob %zu", i);
    const frk_blob *bl = &r->blobs[i];
    if (frk_crc32c(0, r->data + bl->offset, (size_t)bl->length) != bl->crc)
        return frk_corrupt(err,
                           "checksum mismatch in blob %zu (offset %llu, %llu bytes): the file is "
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
