/* libFuzzer harness for the checkpoint reader.
 *
 * Each input is opened as is with frk_reader_open(data, size, verify = 1).
 * Because random bytes almost never carry valid CRCs, the input is then also
 * opened "resealed": a copy whose footer magic, file size, index CRC, blob
 * CRCs and footer CRC are recomputed, so the fuzzer reaches the structural
 * checks of the blob table, tensor table and value tree.
 *
 * On every successful open, the harness walks every node and touches the first
 * and last byte of every string, every blob and every tensor's byte extent, so
 * ASan reports any view the reader accepted that leaves the buffer, and it
 * aborts if a tensor's extent leaves its blob or a node's `next` is wrong.
 *
 * Each input (and its resealed copy) is also written to a memory file and loaded with
 * frk_load_file in its three ways (copied and verified, mapped and verified, copied): the verified
 * loads must accept exactly what frk_reader_open(verify = 1) accepts of the same bytes, and every
 * accepted load must hand back those bytes.
 */
#define _GNU_SOURCE
#include "frk.h"
#include "layout.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static volatile uint8_t sink;

#define REQUIRE(c)                                                                                 \
    do {                                                                                           \
        if (!(c))                                                                                  \
            abort();                                                                               \
    } while (0)

static void touch(const uint8_t *base, size_t len, uint64_t off, uint64_t n)
{
    REQUIRE(off <= len && n <= len - off);
    if (n) {
        sink ^= base[off];
        sink ^= base[off + n - 1];
    }
}

static void walk(const uint8_t *data, size_t size, const frk_reader *r)
{
    size_t nb = frk_reader_blob_count(r), nt = frk_reader_tensor_count(r);
    size_t nn = frk_reader_node_count(r);
    REQUIRE(nn >= 1);
    for (size_t i = 0; i < nb; i++) {
        const frk_blob *b = frk_reader_blob(r, i);
        REQUIRE(b && b->offset % FRK_BLOB_ALIGN == 0 && b->offset >= FRK_PREAMBLE_SIZE);
        touch(data, size, b->offset, b->length);
    }
    for (size_t i = 0; i < nt; i++) {
        const frk_tensor *t = frk_reader_tensor(r, i);
        REQUIRE(t && t->blob < nb && t->ndim <= FRK_MAX_NDIM);
        size_t item = frk_dtype_size(t->dtype);
        REQUIRE(item > 0);
        const frk_blob *b = frk_reader_blob(r, (size_t)t->blob);
        int empty = 0;
        uint64_t last = t->storage_offset; /* element index of the last element */
        for (unsigned d = 0; d < t->ndim; d++) {
            sink ^= (uint8_t)t->sizes[d];
            sink ^= (uint8_t)t->strides[d];
            REQUIRE(t->sizes[d] >= 0 && t->strides[d] >= 0);
            if (t->sizes[d] == 0)
                empty = 1;
        }
        if (empty) {
            REQUIRE(t->storage_offset <= b->length / item);
            continue;
        }
        uint64_t logical = item; /* no tensor holds more bytes than its blob stores */
        for (unsigned d = 0; d < t->ndim; d++)
            REQUIRE(!__builtin_mul_overflow(logical, (uint64_t)t->sizes[d], &logical));
        REQUIRE(logical <= b->length);
        for (unsigned d = 0; d < t->ndim; d++) {
            uint64_t step;
            REQUIRE(!__builtin_mul_overflow((uint64_t)(t->sizes[d] - 1), (uint64_t)t->strides[d],
                                            &step));
            REQUIRE(!__builtin_add_overflow(last, step, &last));
        }
        uint64_t first_byte, end_byte;
        REQUIRE(!__builtin_mul_overflow(t->storage_offset, (uint64_t)item, &first_byte));
        REQUIRE(!__builtin_mul_overflow(last + 1, (uint64_t)item, &end_byte));
        REQUIRE(end_byte <= b->length);
        /* first element's first byte, last element's last byte */
        touch(data, size, b->offset + first_byte, item);
        touch(data, size, b->offset + end_byte - item, item);
    }
    const frk_node *nodes = frk_reader_nodes(r);
    for (size_t i = 0; i < nn; i++) {
        const frk_node *n = &nodes[i];
        REQUIRE(n->next > i && n->next <= nn);
        switch (n->tag) {
        case FRK_TAG_NONE:
        case FRK_TAG_FALSE:
        case FRK_TAG_TRUE:
        case FRK_TAG_INT:
        case FRK_TAG_FLOAT:
            REQUIRE(n->next == i + 1);
            break;
        case FRK_TAG_STR:
        case FRK_TAG_BYTES:
            REQUIRE(n->next == i + 1);
            REQUIRE(n->data >= data && (size_t)(n->data - data) <= size);
            touch(data, size, (uint64_t)(n->data - data), n->count);
            break;
        case FRK_TAG_TENSOR:
            REQUIRE(n->next == i + 1 && n->count < nt);
            break;
        case FRK_TAG_LIST:
        case FRK_TAG_TUPLE:
        case FRK_TAG_DICT: {
            uint64_t items = n->tag == FRK_TAG_DICT ? 2 * n->count : n->count;
            size_t j = i + 1;
            for (uint64_t k = 0; k < items; k++) {
                REQUIRE(j < nn);
                if (n->tag == FRK_TAG_DICT && k % 2 == 0)
                    REQUIRE(nodes[j].tag == FRK_TAG_STR || nodes[j].tag == FRK_TAG_INT);
                j = nodes[j].next;
            }
            REQUIRE(n->next == j);
            break;
        }
        default:
            abort();
        }
    }
    REQUIRE(nodes[0].next == nn);
    for (size_t i = 0; i < nb; i++) {
        frk_error err;
        REQUIRE(frk_reader_verify_blob(r, i, &err) == FRK_OK);
    }
}

static int open_and_walk(const uint8_t *data, size_t size)
{
    frk_reader *r = NULL;
    frk_error err;
    int rc = frk_reader_open(data, size, 1, &r, &err);
    if (rc == FRK_OK) {
        REQUIRE(r != NULL);
        walk(data, size, r);
        frk_reader_free(r);
    } else {
        REQUIRE(r == NULL && err.status == rc && (rc == FRK_ECORRUPT || rc == FRK_ENOMEM));
        REQUIRE(memchr(err.msg, 0, sizeof err.msg) != NULL && err.msg[0]);
    }
    return rc;
}

/* The same bytes as a file, loaded the three ways frk_load_file offers. */
static void load_as_file(const uint8_t *data, size_t size, int opened)
{
    int fd = memfd_create("fuzz", 0);
    REQUIRE(fd >= 0);
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(fd, data + done, size - done);
        REQUIRE(w > 0);
        done += (size_t)w;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    static const unsigned ways[] = {FRK_LOAD_COPY | FRK_LOAD_VERIFY, FRK_LOAD_VERIFY,
                                    FRK_LOAD_COPY};
    for (size_t k = 0; k < sizeof ways / sizeof ways[0]; k++) {
        uint8_t *base = NULL;
        size_t len = 0;
        frk_error err;
        int rc = frk_load_file(path, ways[k], &base, &len, &err);
        if (ways[k] & FRK_LOAD_VERIFY)
            REQUIRE((rc == FRK_OK) == (opened == FRK_OK) || rc == FRK_ENOMEM ||
                    opened == FRK_ENOMEM);
        if (rc == FRK_OK) {
            REQUIRE(len == size && (size == 0 || memcmp(base, data, size) == 0));
            frk_unmap(base, len);
        } else {
            REQUIRE(memchr(err.msg, 0, sizeof err.msg) != NULL && err.msg[0]);
        }
    }
    close(fd);
}

/* A copy with every checksum (and the footer's magic and file size) made right. */
static uint8_t *reseal_copy(const uint8_t *data, size_t size)
{
    if (size < FRK_PREAMBLE_SIZE + FRK_FOOTER_SIZE)
        return NULL;
    uint8_t *c = malloc(size);
    if (!c)
        return NULL;
    memcpy(c, data, size);
    uint8_t *foot = c + size - FRK_FOOTER_SIZE;
    memcpy(foot + FRK_FOOT_MAGIC, FRK_FOOTER_MAGIC, FRK_MAGIC_SIZE);
    frk_put64(foot + FRK_FOOT_FILE_SIZE, size);
    uint64_t ioff = frk_get64(foot + FRK_FOOT_INDEX_OFFSET);
    uint64_t data_end = size - FRK_FOOTER_SIZE;
    if (ioff <= data_end) {
        uint64_t isz = data_end - ioff; /* the index always runs to the footer */
        frk_put64(foot + FRK_FOOT_INDEX_SIZE, isz);
        uint8_t *ix = c + ioff;
        if (isz >= FRK_INDEX_WORD) {
            uint64_t nb = frk_get64(ix);
            for (uint64_t i = 0; i < nb && i < (isz - FRK_INDEX_WORD) / FRK_BLOB_ENTRY_SIZE; i++) {
                uint8_t *e = ix + FRK_INDEX_WORD + FRK_BLOB_ENTRY_SIZE * i;
                uint64_t bo = frk_get64(e + FRK_BLOB_OFFSET), bl = frk_get64(e + FRK_BLOB_LENGTH);
                if (bo <= size && bl <= size - bo)
                    frk_put32(e + FRK_BLOB_CRC, frk_crc32c(0, c + bo, (size_t)bl));
            }
        }
        frk_put32(foot + FRK_FOOT_INDEX_CRC, frk_crc32c(0, ix, (size_t)isz));
    }
    frk_put32(foot + FRK_FOOT_CRC, frk_crc32c(0, foot, FRK_FOOT_CRC));
    return c;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    load_as_file(data, size, open_and_walk(data, size));
    uint8_t *c = reseal_copy(data, size);
    if (c) {
        load_as_file(c, size, open_and_walk(c, size));
        free(c);
    }
    return 0;
}
