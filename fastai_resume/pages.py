"""The kernel's word on this process's pages, in one place: PAGEMAP_SCAN's categories of a range's pages (Linux
6.7), and userfaultfd's asynchronous write protection (`UFFD_FEATURE_WP_ASYNC`: the first write to a protected
page, by any thread of the process or by the kernel on its behalf, just clears that page's protection, and a
scan lists the pages whose protection is gone, `PAGE_IS_WRITTEN`). `provenance` asks which pages of a mapped
file are still the file's, `unwritten` which of a copy in memory nothing wrote: both through this module.

    _T                 this process's userfaultfd and pagemap descriptors (`protect`, `untouched`), opened on first use
    watch_file(lo, hi) a mapped file's pages protected (`provenance.keys`, before it asks which are the file's), and
    file_written       which of them were written since (each a copy now: the next save's proof, one scan)

Protecting a page not mapped (or mapped as part of a huge page) leaves a marker in its place, which a scan
reports as swapped out (a copy, not the file's): `watch_file` reads each such page in (the file's, still
protected) before the scan that tells the file's pages from copies. Where userfaultfd is not there (not Linux,
a kernel before 6.7, a seccomp profile that forbids it, `FASTAI_RESUME_WRITE_TRACKING=0`), nothing is
protected: the callers read or walk instead.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading

try:
    import fcntl
except ImportError:  # (not POSIX: nothing is protected)
    fcntl = None  # type: ignore[assignment]

__all__ = ["watch_file", "watched_file", "file_watches", "file_watch", "file_written", "ENV", "MIN_BYTES"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# PAGEMAP_SCAN (Linux 6.7): the runs of pages of a range with the categories asked for, one ioctl (where it is not
# there, `provenance` reads the range's entries of /proc/self/pagemap, 8 bytes a page)
_SCAN_ARG, _REGION = struct.Struct("<12Q"), struct.Struct("<3Q")  # struct pm_scan_arg, struct page_region
_PAGEMAP_SCAN = (3 << 30) | (_SCAN_ARG.size << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, struct pm_scan_arg)
_IS_FILE, _IS_PRESENT, _IS_SWAPPED = 1 << 2, 1 << 3, 1 << 4

ENV = "FASTAI_RESUME_WRITE_TRACKING"  # "0": nothing protected; "N": `unwritten` tracks tensors of N bytes or more
MIN_BYTES = 1 << 16  # smaller tensors are read (by default): a few pages, less than the scans would cost
_SYSCALL = {"x86_64": 323, "aarch64": 282, "riscv64": 282}.get(platform.machine())  # userfaultfd(2)


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr  # (x86-64, arm64, riscv64's ioctl numbering)


# <linux/userfaultfd.h>, <linux/fs.h> (defined here: the build machine's headers may predate them)
_API, _RANGE_MODE, _RANGE_MODE_IOCTLS = struct.Struct("<3Q"), struct.Struct("<3Q"), struct.Struct("<4Q")
_UFFDIO_API = _iowr(0xAA, 0x3F, _API.size)
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, _RANGE_MODE_IOCTLS.size)
_UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x06, _RANGE_MODE.size)
_USER_MODE_ONLY, _WP_UNPOPULATED, _WP_ASYNC, _MODE_WP = 1, 1 << 13, 1 << 15, 1 << 1
_WRITTEN = 1 << 1  # PAGE_IS_WRITTEN
_CHECK_WPASYNC = (
    1 << 1
)  # the scan fails (EPERM) where a mapping of the range is not registered for asynchronous protection


class _Tracker:
    """This process's userfaultfd and pagemap descriptors; `known`: what `unwritten` read, (addr, nbytes) -> (crc, lo,
    hi, edges); `files`: the file pages watched for `provenance`, (lo, hi) -> what it proved of them."""

    def __init__(self) -> None:
        self.pid, self.uffd, self.pagemap = -1, -1, -1
        self.known: dict = {}
        self.files: dict = {}
        self.reads = self.proven = 0  # tensors read, and known without reading (for tests and benchmarks)
        self.min_bytes = MIN_BYTES

    def ready(self) -> bool:
        "Whether tracking works in this process (opened on first use; a forked child opens its own)."
        if self.pid == os.getpid():
            return self.uffd >= 0
        self.pid, self.uffd, self.pagemap, self.known, self.files = os.getpid(), -1, -1, {}, {}  # (not a parent's)
        setting = os.environ.get(ENV, "")
        self.min_bytes = int(setting) if setting.isdigit() else MIN_BYTES
        if setting == "0" or fcntl is None or _SYSCALL is None:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY, os.O_CLOEXEC | os.O_NONBLOCK):
            fd = libc.syscall(_SYSCALL, flags)
            if fd >= 0:
                break
        else:
            return False
        try:
            fcntl.ioctl(fd, _UFFDIO_API, bytearray(_API.pack(0xAA, _WP_ASYNC | _WP_UNPOPULATED, 0)), True)
            self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(fd)
            return False
        self.uffd = fd
        return True

    def protect(self, lo: int, hi: int) -> bool:
        """Write-protects the pages [lo, hi) (registering them first); False where they cannot be. What was known of
        any range it overlaps is forgotten first (protecting again erases the pages' evidence of a write; and the
        same addresses may hold other memory now: a file mapped where a freed tensor was)."""
        for key, seen in list(self.known.items()):
            if seen[1] < hi and lo < seen[2]:
                del self.known[key]
        for r in [r for r in self.files if r[0] < hi and lo < r[1]]:
            del self.files[r]
        try:
            fcntl.ioctl(self.uffd, _UFFDIO_REGISTER, bytearray(_RANGE_MODE_IOCTLS.pack(lo, hi - lo, _MODE_WP, 0)), True)
            fcntl.ioctl(self.uffd, _UFFDIO_WRITEPROTECT, bytearray(_RANGE_MODE.pack(lo, hi - lo, 1)), True)
        except OSError:
            return False
        return True

    def untouched(self, lo: int, hi: int) -> bool:
        """Whether every page of [lo, hi) is still protected and still there (present or swapped out): nothing
        wrote it since `protect`, nothing dropped it."""
        vec = ctypes.create_string_buffer(_REGION.size)
        there = _IS_PRESENT | _IS_SWAPPED
        for inverted, mask in ((0, _WRITTEN), (there, there)):  # written; dropped (neither present nor swapped)
            arg = _SCAN_ARG.pack(_SCAN_ARG.size, _CHECK_WPASYNC, lo, hi, 0, ctypes.addressof(vec), 1, 0, inverted,
                                 mask, 0, mask)  # fmt: skip
            try:
                if fcntl.ioctl(self.pagemap, _PAGEMAP_SCAN, bytearray(arg), True) != 0:
                    return False
            except OSError:
                return False
        return True


_T = _Tracker()


_LIBC = ctypes.CDLL(None, use_errno=True)
_MADV_POPULATE_READ = 22  # (Linux 5.14)
_LOCK = threading.RLock()  # (one pass at a time: what is known, and what protecting forgets; held by callers too)


def watch_file(lo: int, hi: int) -> bool:
    """Write-protects the pages [lo, hi) of a private file mapping (`provenance.keys`, before it asks which of them
    are the file's: a write after that is seen), forgetting any watch it overlaps. False where they cannot be."""
    with _LOCK:
        if not _T.ready():
            return False
        if not _T.protect(lo, hi):
            return False
        # protecting a page not mapped (or mapped as part of a huge page) leaves a marker in its place, which a scan
        # takes for a page swapped out (this process's copy): each is read in (the file's, still protected)
        _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_POPULATE_READ)
        return True


def watched_file(lo: int, hi: int, proved) -> None:
    "What `provenance` proved of the file pages [lo, hi) it has just protected (`watch_file`), kept for `file_watch`."
    with _LOCK:
        if len(_T.files) > 10_000:  # (mappings long gone: forget them all, walk once more)
            _T.files.clear()
        _T.files[(lo, hi)] = proved


def file_watches(lo: int, hi: int) -> list:
    "`[(lo, hi, proved)]`: the watched file pages that overlap [lo, hi) (callers hold `_LOCK`)."
    return [(a, b, proved) for (a, b), proved in _T.files.items() if a < hi and lo < b]


def file_watch(addr: int, n: int) -> tuple | None:
    """`(lo, hi, proved)`: the watched file pages that hold the bytes [addr, addr + n), and what was proved of them
    (None: none do; callers hold `_LOCK`)."""
    for (lo, hi), proved in _T.files.items():
        if lo <= addr and addr + n <= hi:
            return lo, hi, proved
    return None


def file_written(lo: int, hi: int) -> list | None:
    """The runs `(from, to)` of pages (page numbers) of the watched file pages [lo, hi) written since `watch_file`
    (each now this process's own copy, no longer the file's); None where it cannot be told (not watched here, its
    protection gone: the mapping unmapped or replaced). A page dropped since may count as written (read again)."""
    with _LOCK:
        if _T.pid != os.getpid() or (lo, hi) not in _T.files:
            return None
        out, at = [], lo
        vec = ctypes.create_string_buffer(_REGION.size * 64)
        while at < hi:
            arg = bytearray(_SCAN_ARG.pack(_SCAN_ARG.size, _CHECK_WPASYNC, at, hi, 0, ctypes.addressof(vec), 64, 0, 0,
                                           _WRITTEN, 0, _WRITTEN))  # fmt: skip
            try:
                n = fcntl.ioctl(_T.pagemap, _PAGEMAP_SCAN, arg, True)
            except OSError:
                return None
            out += [
                (a // _PAGE, -(-b // _PAGE))
                for a, b, _ in (_REGION.unpack_from(vec, i * _REGION.size) for i in range(n))
            ]
            walked = _SCAN_ARG.unpack(arg)[4]
            if walked <= at:
                return None
            at = walked
        return out
