/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78): hardware instructions
 * where the CPU has them (SSE4.2 on x86-64, the CRC extension on ARMv8),
 * chosen once at run time, and a portable slicing-by-8 fallback; joining two CRCs, and a copy
 * that checksums what it copies. */
#include "frk.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static uint32_t shift_table[4][256]; /* multiplies a raw CRC state by x^(8*LANE) */
static void make_zeros_ops(void);    /* frk_crc32c_combine's maps (below) */

static void make_tables(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            table[k][n] = (table[k - 1][n] >> 8) ^ table[0][table[k - 1][n] & 0xff];
}

static inline uint64_t load_le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* Raw state update: no pre- or post-inversion. */
static uint32_t raw_portable(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint64_t w = load_le64(p) ^ c;
        c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
            table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
            table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
    return c;
}

/* Three independent streams of LANE bytes hide the instruction's latency;
 * their states are joined with shift_table.  LANE is a multiple of 8. */
#define LANE 4096u

static uint32_t shift_state(uint32_t c)
{
    return shift_table[0][c & 0xff] ^ shift_table[1][(c >> 8) & 0xff] ^
           shift_table[2][(c >> 16) & 0xff] ^ shift_table[3][c >> 24];
}

static void make_shift_table(uint32_t (*raw)(uint32_t, const unsigned char *, size_t))
{
    static const unsigned char zeros[LANE];
    uint32_t bit_image[32];
    /* Feeding zeros is linear in the state: image of each state bit, then of each byte. */
    for (int b = 0; b < 32; b++)
        bit_image[b] = raw(1u << b, zeros, LANE);
    for (int k = 0; k < 4; k++)
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t v = 0;
            for (int b = 0; b < 8; b++)
                if (n & (1u << b))
                    v ^= bit_image[8 * k + b];
            shift_table[k][n] = v;
        }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <nmmintrin.h>
#define HAVE_HW 1
/* "crc32": newer clang (zig cc's) no longer takes the CRC instructions as part of "sse4.2" */
__attribute__((target("sse4.2,crc32"))) static uint32_t raw_hw(uint32_t c, const unsigned char *p,
                                                               size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8(c, *p++);
        n--;
    }
    uint64_t c0 = c;
    while (n >= 3 * LANE && shift_table[0][1]) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *p1 = p + LANE, *p2 = p + 2 * LANE;
        for (size_t i = 0; i < LANE; i += 8) {
            c0 = _mm_crc32_u64(c0, load_le64(p + i));
            c1 = _mm_crc32_u64(c1, load_le64(p1 + i));
            c2 = _mm_crc32_u64(c2, load_le64(p2 + i));
        }
        c0 = shift_state(shift_state((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    while (n >= 8) {
        c0 = _mm_crc32_u64(c0, load_le64(p));
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c0;
    while (n--)
        c = _mm_crc32_u8(c, *p++);
    return c;
}
/* CPUID rather than __builtin_cpu_supports, whose __cpu_model zig's linker cannot reach from a
 * shared object (the wheels are built with zig cc) */
static int cpu_has_hw(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSE4_2);
}
#define HW_NAME "sse4.2"
#elif defined(__aarch64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_acle.h>
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#define HAVE_HW 1
__attribute__((target("+crc"))) static uint32_t raw_hw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = __crc32cb(c, *p++);
        n--;
    }
    while (n >= 3 * LANE && shift_table[0][1]) {
        uint32_t c1 = 0, c2 = 0;
        const unsigned char *p1 = p + LANE, *p2 = p + 2 * LANE;
        for (size_t i = 0; i < LANE; i += 8) {
            c = __crc32cd(c, load_le64(p + i));
            c1 = __crc32cd(c1, load_le64(p1 + i));
            c2 = __crc32cd(c2, load_le64(p2 + i));
        }
        c = shift_state(shift_state(c) ^ c1) ^ c2;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    while (n >= 8) {
        c = __crc32cd(c, load_le64(p));
        p += 8;
        n -= 8;
    }
    while (n--)
        c = __crc32cb(c, *p++);
    return c;
}
static int cpu_has_hw(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#define HW_NAME "armv8-crc"
#else
#define HAVE_HW 0
#endif

static uint32_t (*raw_impl)(uint32_t, const unsigned char *, size_t);
static const char *impl_name = "portable";

/* Runs when the code is loaded (before main for the C tests, while the extension module is
 * being imported for Python), before any thread can call it, so no lock is needed. */
__attribute__((constructor)) static void crc32c_init(void)
{
    make_tables();
    make_zeros_ops();
    raw_impl = raw_portable;
#if HAVE_HW
    if (cpu_has_hw()) {
        /* shift_table is all zeros while it is built, which keeps raw_hw on
         * its single-stream path (the `shift_table[0][1]` test above). */
        make_shift_table(raw_hw);
        raw_impl = raw_hw;
        impl_name = HW_NAME;
    }
#endif
}

uint32_t frk_crc32c(uint32_t crc, const void *data, size_t len)
{
    return ~raw_impl(~crc, (const unsigned char *)data, len);
}

uint32_t frk_crc32c_portable(uint32_t crc, const void *data, size_t len)
{
    return ~raw_portable(~crc, (const unsigned char *)data, len);
}

const char *frk_crc32c_impl(void) { return impl_name; }

/* ---- combining and copying ---------------------------------------------------------------- */

/* The CRC of A || B from crc(A), crc(B) and len(B): appending len(B) zero bytes to A's raw state
 * is a linear map over GF(2). The maps for 1, 2, 4, ... 2^63 zero bytes are made once (32 words
 * each, by repeated squaring of the one-zero-bit map), and a combine applies those of len(B)'s set
 * bits: about a microsecond, where squaring anew at each call took 64 (a verified load of 3.4 GB
 * joins about 1,700 pieces). */
static uint32_t zeros_op[64][32]; /* zeros_op[k]: the map for 2^k zero bytes */

static uint32_t gf2_apply(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1)
            sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *out, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++)
        out[n] = gf2_apply(mat, mat[n]);
}

static void make_zeros_ops(void)
{
    uint32_t a[32], b[32];
    a[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++)
        a[n] = 1u << (n - 1);
    gf2_square(b, a);           /* two zero bits */
    gf2_square(a, b);           /* four */
    gf2_square(zeros_op[0], a); /* eight: one zero byte */
    for (int k = 1; k < 64; k++)
        gf2_square(zeros_op[k], zeros_op[k - 1]);
}

uint32_t frk_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    for (int k = 0; len2; k++, len2 >>= 1)
        if (len2 & 1)
            crc1 = gf2_apply(zeros_op[k], crc1);
    return crc1 ^ crc2;
}

#define COPY_PIECE (64u << 10)           /* checksummed, then copied while still in cache */
#define COPY_SPLIT_MIN ((size_t)2 << 20) /* from here on the copy is split over two threads */

#if defined(__SSE2__)
#include <emmintrin.h>
#define STREAM_STORES 1
/* Copies n bytes with non-temporal stores from where dst is 16-byte aligned: the destination is
 * not read into the cache first (an ordinary copy reads every line it writes), and the caches keep
 * what training had in them. A snapshot of 205 MB on 2 threads: 15.9 ms against 19.3 ms. */
static void stream_copy(uint8_t *d, const uint8_t *s, size_t n)
{
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
}
#endif

/* Each piece is checksummed from the source, which brings it into the cache, then copied from
 * there. The checksum is of the bytes copied as long as the source does not change during the
 * call (training is stopped at its batch boundary then); if it did change, the copy would not
 * match its checksum and the checkpoint would fail verification, never load different bytes. */
static uint32_t copy_crc_one(void *dst, const void *src, size_t len)
{
    uint8_t *d = dst;
    const uint8_t *s = src;
    uint32_t crc = 0;
    while (len) {
        size_t n = len < COPY_PIECE ? len : COPY_PIECE;
        crc = frk_crc32c(crc, s, n);
#ifdef STREAM_STORES
        stream_copy(d, s, n);
#else
        memcpy(d, s, n);
#endif
        d += n;
        s += n;
        len -= n;
    }
#ifdef STREAM_STORES
    _mm_sfence(); /* the streamed stores are visible before the copy is reported done */
#endif
    return crc;
}

typedef struct {
    void *dst;
    const void *src;
    size_t len;
    uint32_t crc;
} copy_job;

static void *copy_crc_thread(void *arg)
{
    copy_job *j = arg;
    j->crc = copy_crc_one(j->dst, j->src, j->len);
    return NULL;
}

/* The split copy on an OpenMP team, on the runtime the process already has: torch's libgomp.so.1.
 * The core is built without OpenMP and links no runtime (a wheel would have to carry its own, a
 * second pool beside torch's); it calls libgomp's ABI, what gcc emits for `#pragma omp parallel`,
 * resolved at run time from the loaded library (frk_copy_use_openmp). */
typedef struct {
    void (*parallel)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
    int (*thread_num)(void);
    int (*num_threads)(void);
    int (*max_threads)(void);
    int (*in_parallel)(void);
} gomp_abi;

static gomp_abi gomp;          /* filled once, under gomp_lock, before copy_openmp is first set */
static atomic_int copy_openmp; /* whether the split copy runs on the team */
static pthread_mutex_t gomp_lock = PTHREAD_MUTEX_INITIALIZER;

/* libgomp has no fork handler: a forked child's first parallel region would wait for the parent's
 * pool threads, which the child does not have. A child's copies take a thread of their own. */
static void copy_openmp_off(void) { atomic_store(&copy_openmp, 0); }

/* libgomp's entry points, from the libgomp.so.1 already loaded (RTLD_NOLOAD: never loaded here). */
static int resolve_gomp(void)
{
    if (gomp.parallel)
        return 1;
    void *lib = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD); /* kept open: the process's own */
    if (!lib)
        return 0;
    gomp_abi g;
    g.parallel = (__typeof__(g.parallel))dlsym(lib, "GOMP_parallel");
    g.thread_num = (__typeof__(g.thread_num))dlsym(lib, "omp_get_thread_num");
    g.num_threads = (__typeof__(g.num_threads))dlsym(lib, "omp_get_num_threads");
    g.max_threads = (__typeof__(g.max_threads))dlsym(lib, "omp_get_max_threads");
    g.in_parallel = (__typeof__(g.in_parallel))dlsym(lib, "omp_in_parallel");
    if (!g.parallel || !g.thread_num || !g.num_threads || !g.max_threads || !g.in_parallel) {
        dlclose(lib);
        return 0;
    }
    pthread_atfork(NULL, NULL, copy_openmp_off);
    gomp = g;
    return 1;
}

int frk_copy_use_openmp(int on)
{
    pthread_mutex_lock(&gomp_lock);
    on = on && resolve_gomp();
    atomic_store(&copy_openmp, on); /* sequentially consistent: gomp is filled before it reads 1 */
    pthread_mutex_unlock(&gomp_lock);
    return on;
}

typedef struct {
    void *dst;
    const void *src;
    size_t len, half;
    uint32_t crc[2];
    int team;
} team_job;

static void copy_team_member(void *arg)
{
    team_job *j = arg;
    int id = gomp.thread_num();
    if (id == 0) {
        j->team = gomp.num_threads();
        j->crc[0] = copy_crc_one(j->dst, j->src, j->team == 1 ? j->len : j->half);
    } else if (id == 1) {
        j->crc[1] = copy_crc_one((uint8_t *)j->dst + j->half, (const uint8_t *)j->src + j->half,
                                 j->len - j->half);
    }
}

/* Where the core's OpenMP runtime is the one torch's own threads come from, the second half goes
 * to a worker of torch's pool, which after each parallel region of a training step spins for
 * milliseconds waiting for the next one, and takes this region at once. A thread of our own shared
 * that core with the spinning worker: 205 MB in 22-25 ms inside a fit against 16-17 ms this way.
 * The team is the pool's own size (num_threads 0: a smaller team makes libgomp end the pool's
 * threads left over, which torch avoids for that reason, pytorch#32008); threads 0 and 1 copy, any
 * others pass. */
static uint32_t copy_crc_openmp(void *dst, const void *src, size_t len)
{
    team_job j = {dst, src, len, len / 2 / 4096 * 4096, {0, 0}, 1};
    gomp.parallel(copy_team_member, &j, 0, 0);
    return j.team == 1 ? j.crc[0] : frk_crc32c_combine(j.crc[0], j.crc[1], len - j.half);
}

uint32_t frk_copy_crc32c(void *dst, const void *src, size_t len)
{
    if (len < COPY_SPLIT_MIN)
        return copy_crc_one(dst, src, len);
    /* torch's pool has a second thread (its setting: one thread means no pool to share) */
    if (atomic_load(&copy_openmp) && gomp.max_threads() >= 2 && !gomp.in_parallel())
        return copy_crc_openmp(dst, src, len);
    size_t half = len / 2 / 4096 * 4096; /* the second half starts on a page */
    copy_job tail = {(uint8_t *)dst + half, (const uint8_t *)src + half, len - half, 0};
    pthread_t t;
    if (pthread_create(&t, NULL, copy_crc_thread, &tail))
        return copy_crc_one(dst, src, len); /* no thread to be had: one pass */
    uint32_t head = copy_crc_one(dst, src, half);
    pthread_join(t, NULL);
    return frk_crc32c_combine(head, tail.crc, tail.len);
}

/* ---- many buffers at once ----------------------------------------------------------------- */

/* The unit of work a thread takes: small enough to balance the threads. */
#define MANY_PIECE ((size_t)1 << 20)
#define MANY_THREADS_MAX 8

typedef struct {
    const void *const *data;
    const size_t *len;
    size_t n;
    const size_t *first; /* first[i]: the index of buffer i's first piece; first[n]: the count */
    uint32_t *piece_crc;
    atomic_size_t next; /* the next piece to take */
} many_job;

static void *many_worker(void *arg)
{
    many_job *j = arg;
    size_t b = 0; /* pieces are taken in order, so the buffer a piece is in only moves forward */
    for (;;) {
        size_t k = atomic_fetch_add(&j->next, 1);
        if (k >= j->first[j->n])
            return NULL;
        while (j->first[b + 1] <= k)
            b++;
        size_t off = (k - j->first[b]) * MANY_PIECE;
        size_t left = j->len[b] - off;
        j->piece_crc[k] =
            frk_crc32c(0, (const uint8_t *)j->data[b] + off, left < MANY_PIECE ? left : MANY_PIECE);
    }
}

int frk_crc32c_many(size_t n, const void *const *data, const size_t *len, uint32_t *out,
                    int threads)
{
    size_t *first = malloc((n + 1) * sizeof *first);
    if (!first)
        return FRK_ENOMEM;
    first[0] = 0;
    for (size_t i = 0; i < n; i++) /* an empty buffer has no piece; its CRC is 0 */
        first[i + 1] = first[i] + len[i] / MANY_PIECE + (len[i] % MANY_PIECE != 0);
    uint32_t *piece_crc = malloc((first[n] ? first[n] : 1) * sizeof *piece_crc);
    if (!piece_crc) {
        free(first);
        return FRK_ENOMEM;
    }
    many_job j = {data, len, n, first, piece_crc, 0};
    if (threads > MANY_THREADS_MAX)
        threads = MANY_THREADS_MAX;
    if ((size_t)threads > first[n])
        threads = (int)first[n];
    pthread_t tids[MANY_THREADS_MAX];
    int started = 0;
    while (started < threads - 1 && !pthread_create(&tids[started], NULL, many_worker, &j))
        started++;
    many_worker(&j); /* this thread works too; with no thread to be had, it does it all */
    for (int t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
    for (size_t i = 0; i < n; i++) {
        uint32_t crc = 0;
        for (size_t k = first[i]; k < first[i + 1]; k++) {
            size_t piece = k + 1 < first[i + 1] ? MANY_PIECE : len[i] - (k - first[i]) * MANY_PIECE;
            crc = k == first[i] ? piece_crc[k] : frk_crc32c_combine(crc, piece_crc[k], piece);
        }
        out[i] = crc;
    }
    free(piece_crc);
    free(first);
    return FRK_OK;
}
