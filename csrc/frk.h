/* frk: the fastai-resume checkpoint core.
 *
 * A plain C11 library with no Python in it: the checkpoint format (builder,
 * atomic durable writer, validating reader), CRC32C, and the SkipToIter state
 * machine that decides which work a resumed fit skips.  docs/FORMAT.md is the
 * byte-level contract this file implements.
 *
 * Every function that can fail returns FRK_OK (0) or a negative frk_status and
 * fills *err (which must not be NULL) with a message that names what is wrong
 * and where.
 */
#ifndef FRK_H
#define FRK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FRK_FORMAT_VERSION 1u
#define FRK_PREAMBLE_SIZE 64u
#define FRK_FOOTER_SIZE 64u
#define FRK_BLOB_ALIGN 64u
#define FRK_MAX_DEPTH 64u
#define FRK_MAX_NDIM 32u

typedef enum {
    FRK_OK = 0,
    FRK_ECORRUPT = -1, /* the file is not a valid checkpoint */
    FRK_EIO = -2,      /* the operating system refused (errno in err->sys_errno) */
    FRK_ENOMEM = -3,
    FRK_EINVAL = -4, /* the caller asked for something impossible */
} frk_status;

typedef struct {
    int status;
    int sys_errno;
    char msg[512];
} frk_error;

/* ---- CRC32C (Castagnoli) ------------------------------------------------ */

/* Standard CRC32C of len bytes, continuing from crc (pass 0 to start). */
uint32_t frk_crc32c(uint32_t crc, const void *data, size_t len);
/* The same, always with the portable table code (for tests). */
uint32_t frk_crc32c_portable(uint32_t crc, const void *data, size_t len);
/* "sse4.2", "armv8-crc" or "portable": what frk_crc32c uses on this CPU. */
const char *frk_crc32c_impl(void);
/* The CRC32C of A || B, given crc1 of A, crc2 of B and B's length. */
uint32_t frk_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
/* Copies len bytes from src to dst (not overlapping) and returns their CRC32C, each piece
 * checksummed while it is still in cache; from 2 MiB on, split over two threads. Safe to call
 * without the GIL. */
uint32_t frk_copy_crc32c(void *dst, const void *src, size_t len);
/* From now on, the split copy runs as an OpenMP team (on) or on a thread of its own (off, the
 * default); returns whether OpenMP is used: only where the process has libgomp.so.1 loaded (the
 * core links no OpenMP runtime: it uses torch's). */
int frk_copy_use_openmp(int on);
/* The CRC32C of each of n buffers (out[i] for data[i], len[i] bytes), their 1 MiB pieces shared out
 * among `threads` threads (this one among them; at most 8). Safe to call without the GIL.
 * FRK_OK, or FRK_ENOMEM with nothing written to out. */
int frk_crc32c_many(size_t n, const void *const *data, const size_t *len, uint32_t *out,
                    int threads);

/* ---- value tree ---------------------------------------------------------- */

typedef enum {
    FRK_TAG_NONE = 0,
    FRK_TAG_FALSE = 1,
    FRK_TAG_TRUE = 2,
    FRK_TAG_INT = 3,
    FRK_TAG_FLOAT = 4,
    FRK_TAG_STR = 5,
    FRK_TAG_BYTES = 6,
    FRK_TAG_LIST = 7,
    FRK_TAG_TUPLE = 8,
    FRK_TAG_DICT = 9,
    FRK_TAG_TENSOR = 10,
} frk_tag;

typedef enum { FRK_KIND_TORCH = 0, FRK_KIND_NUMPY = 1 } frk_kind;

/* Element types. The numbering is part of the format: never renumber. */
typedef enum {
    FRK_DT_BOOL = 0,
    FRK_DT_U8 = 1,
    FRK_DT_I8 = 2,
    FRK_DT_I16 = 3,
    FRK_DT_I32 = 4,
    FRK_DT_I64 = 5,
    FRK_DT_U16 = 6,
    FRK_DT_U32 = 7,
    FRK_DT_U64 = 8,
    FRK_DT_F16 = 9,
    FRK_DT_BF16 = 10,
    FRK_DT_F32 = 11,
    FRK_DT_F64 = 12,
    FRK_DT_C32 = 13,
    FRK_DT_C64 = 14,
    FRK_DT_C128 = 15,
    FRK_DT_F8_E4M3FN = 16,
    FRK_DT_F8_E5M2 = 17,
    FRK_DT_F8_E4M3FNUZ = 18,
    FRK_DT_F8_E5M2FNUZ = 19,
    FRK_DT_F8_E8M0FNU = 20,
    FRK_DT_COUNT = 21
} frk_dtype;

/* Bytes per element, or 0 for an unknown code. */
size_t frk_dtype_size(unsigned code);

typedef struct {
    uint64_t offset; /* from the start of the file, multiple of FRK_BLOB_ALIGN */
    uint64_t length;
    uint32_t crc;
} frk_blob;

typedef struct {
    uint8_t kind;  /* frk_kind */
    uint8_t dtype; /* frk_dtype */
    uint16_t ndim;
    uint64_t blob;           /* index into the blob table */
    uint64_t storage_offset; /* in elements, from the blob's start */
    const int64_t *sizes;    /* ndim entries (points into the index) */
    const int64_t *strides;  /* ndim entries, in elements */
} frk_tensor;

/* One node of the decoded tree, in pre-order.  Containers are followed by
 * their children (a dict by key, value, key, value, ...); `next` is the index
 * of the node after the whole subtree, so a reader can skip it. */
typedef struct {
    uint8_t tag;    /* frk_tag */
    uint64_t count; /* items of list/tuple, pairs of dict, bytes of str/bytes, tensor index */
    int64_t ival;
    double fval;
    const uint8_t *data; /* str/bytes payload, inside the index */
    size_t next;
} frk_node;

/* ---- builder and atomic writer ------------------------------------------- */

typedef struct frk_builder frk_builder;

frk_builder *frk_builder_new(void);
void frk_builder_free(frk_builder *b);

/* Registers len bytes at data as a blob; the memory must stay valid and
 * unchanged until commit returns.  *idx receives the blob's index. */
int frk_builder_add_blob(frk_builder *b, const void *data, uint64_t len, uint64_t *idx,
                         frk_error *err);
/* The same for bytes whose CRC32C the caller already has (frk_copy_crc32c): the commit writes
 * crc into the blob table without reading the bytes for it.  A wrong crc makes a file that every
 * verifying read refuses. */
int frk_builder_add_blob_crc(frk_builder *b, const void *data, uint64_t len, uint32_t crc,
                             uint64_t *idx, frk_error *err);
int frk_builder_add_tensor(frk_builder *b, unsigned kind, unsigned dtype, uint64_t blob,
                           uint64_t storage_offset, unsigned ndim, const int64_t *sizes,
                           const int64_t *strides, uint64_t *idx, frk_error *err);
int frk_builder_put_scalar(frk_builder *b, frk_tag tag, frk_error *err); /* NONE/FALSE/TRUE */
int frk_builder_put_int(frk_builder *b, int64_t v, frk_error *err);
int frk_builder_put_float(frk_builder *b, double v, frk_error *err);
int frk_builder_put_str(frk_builder *b, frk_tag tag, const void *data, uint64_t len,
                        frk_error *err); /* STR (must be UTF-8) or BYTES */
int frk_builder_put_container(frk_builder *b, frk_tag tag, uint64_t count, frk_error *err);
int frk_builder_put_tensor(frk_builder *b, uint64_t tensor, frk_error *err);

/* Flags for frk_builder_commit. */
#define FRK_COMMIT_FSYNC 1u
/* Write around the page cache (O_DIRECT, through a page-aligned staging buffer kept for the
 * next commit; page-aligned blobs go out from where they are).  A file system that refuses it
 * gets the rest written buffered; tmpfs and ramfs (whose page cache is the storage) always do. */
#define FRK_COMMIT_DIRECT 2u
/* Blobs of at least this many bytes start on a FRK_PAGE_ALIGN boundary in files this writer
 * makes (readers require FRK_BLOB_ALIGN only), so that O_DIRECT can write them in place. */
#define FRK_PAGE_ALIGN 4096u
#define FRK_PAGE_ALIGN_MIN ((uint64_t)1 << 20)

/* Writes the checkpoint to path atomically: a temporary file in the same
 * directory, preallocated, written in one sequential pass, fsynced, renamed
 * over path, then the directory fsynced.  The temporary file's name has a random part (no
 * other process can create it first) and the writer's pid.  On any failure the temporary file
 * is removed and whatever was at path before is untouched.  Safe to call
 * without the GIL: touches no Python state.  *written receives the file size. */
int frk_builder_commit(frk_builder *b, const char *path, unsigned flags, uint64_t *written,
                       frk_error *err);
/* The two halves of frk_builder_commit, for a caller that publishes later (in another thread):
 * frk_builder_write writes the whole file to its temporary name (everything of the commit up to
 * the sync) and hands it over, open, in *out; frk_publish then syncs it (flags & FRK_COMMIT_FSYNC),
 * renames it over its path and syncs the directory, and frees *p (whatever it returns);
 * frk_abandon removes the temporary file and frees *p.  A written file is complete and
 * checksummed but not in place: until published, a crash leaves only its temporary file (which
 * readers never take for a checkpoint). frk_builder_commit is the write and the publish at once. */
typedef struct frk_pending frk_pending;
int frk_builder_write(frk_builder *b, const char *path, unsigned flags, uint64_t *written,
                      frk_pending **out, frk_error *err);
int frk_publish(frk_pending *p, unsigned flags, frk_error *err);
void frk_abandon(frk_pending *p);
/* *size receives the bytes the commit of what b holds now will write (a full disk's error says
 * how much room the checkpoint needs).  Fails only for a checkpoint of 2^64 bytes or more. */
int frk_builder_size(const frk_builder *b, uint64_t *size, frk_error *err);

/* ---- reader --------------------------------------------------------------- */

typedef struct frk_reader frk_reader;

/* Maps path privately (copy-on-write, writable); nothing is read until it is
 * touched.  Free with frk_unmap.  The mapping still reads the file: truncating
 * that inode later faults (SIGBUS). */
int frk_map_file(const char *path, uint8_t **base, size_t *len, frk_error *err);
/* How frk_load_file brings a file into memory. */
#define FRK_LOAD_COPY 1u   /* read whole into fresh memory of the process's own (else: mapped) */
#define FRK_LOAD_VERIFY 2u /* check the structure and every blob's CRC32C on the way in */
/* frk_map_file, or with FRK_LOAD_COPY a read of the whole file into fresh anonymous memory of
 * the process's own: nothing done to the file afterwards can reach it (the preamble, index and
 * footer are read first, then the blobs in chunks split over the CPUs, straight from the disk
 * where they are not in the page cache).  With FRK_LOAD_VERIFY the image is checked as
 * frk_reader_open(verify = 1) checks it, each chunk while it is in the CPU's cache, and a message
 * says which file is damaged.  Free with frk_unmap. */
int frk_load_file(const char *path, unsigned flags, uint8_t **base, size_t *len, frk_error *err);
void frk_unmap(uint8_t *base, size_t len);

/* True if the first bytes are this format's magic. */
int frk_has_magic(const void *data, size_t len);

/* Validates a checkpoint image and decodes its index.  The reader borrows
 * data: keep it mapped while the reader or anything derived from it lives.
 * verify != 0 also checks every blob's CRC32C (the index's is always checked). */
int frk_reader_open(const uint8_t *data, size_t len, int verify, frk_reader **out, frk_error *err);
void frk_reader_free(frk_reader *r);

uint32_t frk_reader_version(const frk_reader *r);
size_t frk_reader_blob_count(const frk_reader *r);
const frk_blob *frk_reader_blob(const frk_reader *r, size_t i);
size_t frk_reader_tensor_count(const frk_reader *r);
const frk_tensor *frk_reader_tensor(const frk_reader *r, size_t i);
size_t frk_reader_node_count(const frk_reader *r);
const frk_node *frk_reader_nodes(const frk_reader *r);
/* Verifies blob i's checksum (for readers opened with verify = 0). */
int frk_reader_verify_blob(const frk_reader *r, size_t i, frk_error *err);

/* ---- SkipToIter: what a resumed fit skips ---------------------------------- */

/* A position is (epoch, iter): iter training batches of epoch are done.
 * iter == n_iter means the epoch's training is done but not its validation. */

/* Applies the caller's overrides to a saved position.  start_epoch and
 * start_iter are negative when not given; a missing half of an explicit start
 * is the saved epoch (or 0) and batch 0.  Returns 1 and fills the target when
 * the fit resumes, 0 when it runs from the start with nothing restored. */
int frk_skip_plan(int has_saved, int64_t saved_epoch, int64_t saved_iter, int64_t start_epoch,
                  int64_t start_iter, int64_t *epoch, int64_t *iter);

typedef enum {
    FRK_SKIP_RUN = 0,    /* run the epoch normally */
    FRK_SKIP_SKIP = 1,   /* the epoch was completed before the save: run nothing */
    FRK_SKIP_RESUME = 2, /* run the epoch from batch first_iter */
} frk_skip_action;

typedef enum {
    FRK_RNG_NONE = 0,
    FRK_RNG_SAVED = 1,       /* restore the state saved at the position, now */
    FRK_RNG_EPOCH_START = 2, /* restore the epoch-start state now; the saved state
                                when the first remaining batch is fetched */
} frk_rng_action;

typedef struct {
    int action;         /* frk_skip_action */
    int rng;            /* frk_rng_action */
    int64_t first_iter; /* batches to skip on the index list */
} frk_skip_step;

typedef struct {
    int64_t epoch, iter, n_epoch, n_iter;
    int state;       /* internal */
    int rng_pending; /* the saved state is still to be restored */
} frk_skip;

/* Arms a resume at (epoch, iter) in a fit of n_epoch epochs of n_iter batches. */
int frk_skip_arm(frk_skip *s, int64_t epoch, int64_t iter, int64_t n_epoch, int64_t n_iter,
                 frk_error *err);
/* Disarmed: every epoch runs. */
void frk_skip_disarm(frk_skip *s);
/* At the start of each epoch. */
frk_skip_step frk_skip_before_epoch(frk_skip *s, int64_t epoch);
/* Returns 1 exactly once, when the saved mid-epoch RNG state is due: at the
 * first fetch of a remaining batch, or at the end of training if none remain. */
int frk_skip_take_rng(frk_skip *s);
/* At the end of each epoch that ran. */
void frk_skip_after_epoch(frk_skip *s, int64_t epoch);
/* 1 while the resume has still something to do. */
int frk_skip_pending(const frk_skip *s);
/* After the last epoch: 1 (once) if the resume's target was the fit's very end, so that no epoch
 * resumed and the saved state is due now; 0 otherwise. */
int frk_skip_after_last_epoch(frk_skip *s);

#ifdef __cplusplus
}
#endif
#endif
