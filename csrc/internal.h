/* What the format's source files (validate.c, builder.c, commit.c, reader.c, load.c) share, and
 * nothing outside them sees. */
#ifndef FRK_INTERNAL_H
#define FRK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "frk.h"

/* Fills *err and returns status.  The message is cut, if it must be, at a character boundary. */
int frk_fail(frk_error *err, int status, int sys_errno, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define frk_corrupt(err, ...) frk_fail(err, FRK_ECORRUPT, 0, __VA_ARGS__)
int frk_oom(frk_error *err);
/* "<what> <path>: <strerror(e)> (errno <e>)". */
int frk_io_fail(frk_error *err, const char *what, const char *path, int e);

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
int frk_utf8_valid(const uint8_t *s, size_t n);

/* Parses an encoded value tree; with nodes == NULL it only checks it. */
typedef struct {
    const uint8_t *p;
    size_t len, pos;
    uint64_t n_tensors;
    frk_node *nodes;
    size_t n_nodes, cap_nodes;
    frk_error *err;
} frk_tree_parser;
int frk_parse_tree(frk_tree_parser *tp);

/* Validates a tensor entry against its blob table: FRK_ECORRUPT names tensor idx. */
int frk_check_tensor(unsigned kind, unsigned dtype, unsigned ndim, uint64_t blob, uint64_t n_blobs,
                     uint64_t blob_len, uint64_t storage_offset, const int64_t *sizes,
                     const int64_t *strides, uint64_t idx, frk_error *err);

/* Checks the CRC32C of every blob of an image whose blob table has been validated (sorted, not
 * overlapping, inside [start, end)), split over the CPUs when there are many bytes (load.c). */
int frk_check_blobs(const frk_blob *blobs, size_t n_blobs, const uint8_t *data, uint64_t start,
                    uint64_t end, frk_error *err);

/* A growable byte buffer. */
typedef struct {
    uint8_t *data;
    size_t len, cap;
} frk_buf;
/* n more bytes at the end, or NULL when out of memory. */
uint8_t *frk_buf_grow(frk_buf *b, size_t n);

typedef struct {
    const void *data;
    uint64_t len;
    uint32_t crc; /* the bytes' CRC32C, when has_crc: the commit then does not read them for it */
    int has_crc;
} frk_blob_ref;

/* The builder's state, read by the commit. */
struct frk_builder {
    frk_blob_ref *blobs;
    size_t n_blobs, cap_blobs;
    frk_buf tensors; /* the encoded tensor entries */
    uint64_t n_tensors;
    frk_buf tree; /* the encoded value tree */
};

#endif
