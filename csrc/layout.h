/* The checkpoint's byte layout (docs/FORMAT.md), named once.
 *
 * The reader, the writer, the C tests and the fuzz target use these names and
 * helpers; none of them spells an offset or a size of the layout by hand.
 * All integers are little-endian, offsets count from the start of a region:
 *
 *   preamble  FRK_PREAMBLE_SIZE bytes at the start of the file
 *   blobs     each at a multiple of FRK_BLOB_ALIGN
 *   index     u64 n_blobs, n_blobs blob entries,
 *             u64 n_tensors, n_tensors tensor entries,
 *             u64 tree_size, the value tree
 *   footer    FRK_FOOTER_SIZE bytes at the end of the file
 */
#ifndef FRK_LAYOUT_H
#define FRK_LAYOUT_H

#include <stdint.h>

#include "frk.h"

/* The preamble's magic, as PNG's: a non-ASCII first byte, then CR LF, ^Z, LF, so that a 7-bit
 * or newline-converting transfer breaks it detectably. */
#define FRK_PREAMBLE_MAGIC "\x89\x46\x52\x4b\r\n\x1a\n" /* \x89 F R K CR LF ^Z LF */
/* The footer's magic: the last bytes of a complete file. */
#define FRK_FOOTER_MAGIC "FRKFOOT\n"
#define FRK_MAGIC_SIZE 8u

/* Preamble fields. */
enum {
    FRK_PRE_MAGIC = 0,     /* FRK_MAGIC_SIZE bytes */
    FRK_PRE_VERSION = 8,   /* u32 */
    FRK_PRE_RESERVED = 12, /* zero, up to FRK_PREAMBLE_SIZE */
};

/* An index word: n_blobs, n_tensors and tree_size are u64. */
#define FRK_INDEX_WORD 8u

/* A blob entry. */
enum {
    FRK_BLOB_OFFSET = 0,    /* u64, from the start of the file */
    FRK_BLOB_LENGTH = 8,    /* u64 */
    FRK_BLOB_CRC = 16,      /* u32, CRC32C of the blob's bytes */
    FRK_BLOB_RESERVED = 20, /* u32, zero */
    FRK_BLOB_ENTRY_SIZE = 24,
};

/* A tensor entry: this head, then ndim sizes and ndim strides (i64 each). */
enum {
    FRK_TENSOR_KIND = 0,            /* u8, frk_kind */
    FRK_TENSOR_DTYPE = 1,           /* u8, frk_dtype */
    FRK_TENSOR_NDIM = 2,            /* u16 */
    FRK_TENSOR_RESERVED = 4,        /* u32, zero */
    FRK_TENSOR_BLOB = 8,            /* u64, index into the blob table */
    FRK_TENSOR_STORAGE_OFFSET = 16, /* u64, in elements */
    FRK_TENSOR_HEAD_SIZE = 24,
};
#define FRK_TENSOR_DIM_SIZE 16u /* one size and one stride */
/* Where size d and stride d of an entry with ndim dimensions start. */
#define FRK_TENSOR_SIZE_AT(d) (FRK_TENSOR_HEAD_SIZE + 8u * (d))
#define FRK_TENSOR_STRIDE_AT(ndim, d) (FRK_TENSOR_HEAD_SIZE + 8u * ((ndim) + (d)))

/* A value of the tree: a tag byte (frk_tag), then for an int, float, str, bytes, list, tuple,
 * dict or tensor a u64 word (the number's bits, a length, a count or a tensor index), then for
 * str and bytes their bytes, for containers their items. */
#define FRK_VALUE_TAG_SIZE 1u
#define FRK_VALUE_WORD 8u

/* Footer fields. */
enum {
    FRK_FOOT_INDEX_OFFSET = 0, /* u64, a multiple of 8 */
    FRK_FOOT_INDEX_SIZE = 8,   /* u64; the index ends where the footer starts */
    FRK_FOOT_FILE_SIZE = 16,   /* u64, the whole file's */
    FRK_FOOT_INDEX_CRC = 24,   /* u32, CRC32C of the index */
    FRK_FOOT_VERSION = 28,     /* u32, the preamble's */
    FRK_FOOT_RESERVED = 32,    /* zero, up to FRK_FOOT_CRC */
    FRK_FOOT_CRC = 52,         /* u32, CRC32C of the footer's bytes before it */
    FRK_FOOT_MAGIC = 56,       /* FRK_MAGIC_SIZE bytes */
};

/* Little-endian words, whatever the host's byte order. */
static inline uint16_t frk_get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint32_t frk_get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t frk_get64(const uint8_t *p)
{
    return (uint64_t)frk_get32(p) | (uint64_t)frk_get32(p + 4) << 32;
}

static inline void frk_put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline void frk_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++, v >>= 8)
        p[i] = (uint8_t)v;
}

static inline void frk_put64(uint8_t *p, uint64_t v)
{
    frk_put32(p, (uint32_t)v);
    frk_put32(p + 4, (uint32_t)(v >> 32));
}

#endif
