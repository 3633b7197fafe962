"""CPU tensors whose bytes nothing has written since their CRC32C was read: the kernel's word for it.

A frozen base that is not a file's pages (`provenance`): a copy in another dtype (`model.to(torch.bfloat16)`),
a state dict `torch.load`ed into it, weights built in memory, is read whole by each fingerprint pass. Linux
(6.7 or newer) can say instead which pages of a range were written since they were write-protected, without
stopping any write (x86-64; arm64 from Linux 6.10): userfaultfd's asynchronous write protection
(`UFFD_FEATURE_WP_ASYNC`: the first write to a protected page, by any thread of the process or by the kernel
on its behalf, a `read()` into it, just clears that page's protection, in the kernel) and the PAGEMAP_SCAN
ioctl, which lists the pages of a range whose protection is gone (`PAGE_IS_WRITTEN`). So a tensor's whole
pages are protected, then its bytes read (their CRC32C); at the next fingerprint, a scan that finds none of
those pages written and every one still there (a page dropped, `MADV_DONTNEED`, reads as zeros though nothing
wrote it: it counts as written), and the bytes of its first and last pages that are not whole pages of it
equal to a copy kept (a few KB), prove its bytes are the ones read: their CRC32C is known, not read. Anything
else (a page written, the same bytes or not; a scan that fails; another process: a forked child) and the
tensor is read again, protected first.

    crcs(tensors, read)   {name: CRC32C}: those proven unwritten known, the rest by `read(names)`, and tracked

Tracked: contiguous CPU tensors of at least `MIN_BYTES` (`FASTAI_RESUME_WRITE_TRACKING=N`: of N bytes; `0`:
none) in this process's private anonymous memory (`provenance.anonymous`: not a file's pages, which a write to
the file changes under a private mapping, nor memory shared with another process, which writes through its own
page tables: those are read each time), not pinned for a CUDA device (`is_pinned`). Not seen: a device writing
by DMA into memory pinned for it by other means (an RDMA registration, io_uring's fixed buffers): a frozen
base is not such memory. Unprivileged (`UFFD_USER_MODE_ONLY`). Where it is not there (not Linux, a kernel
before 6.7, a seccomp profile that forbids userfaultfd): every such tensor is read, as before.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading

import numpy as np
import torch

from . import provenance
from .provenance import _IS_PRESENT, _IS_SWAPPED, _PAGE, _PAGEMAP_SCAN, _REGION, _SCAN_ARG

try:
    import fcntl
except ImportError:  # (not POSIX: nothing is tracked)
    fcntl = None  # type: ignore[assignment]

__all__ = ["crcs", "available", "stats", "ENV", "MIN_BYTES"]

ENV = "FASTAI_RESUME_WRITE_TRACKING"  # "0": nothing tracked; "N": tensors of N bytes or more
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
_WRITTEN = 1 << 1  # PAGE_IS_WRITTEN (PAGEMAP_SCAN's layout and its other categories: `provenance`'s)
_CHECK_WPASYNC = 1 << 1  # the scan fails (EPERM) where a page of the range is not under asynchronous protection


class _Tracker:
    "This process's userfaultfd and pagemap descriptors, and what it read: (addr, nbytes) -> (crc, lo, hi, edges)."

    def __init__(self) -> None:
        self.pid, self.uffd, self.pagemap = -1, -1, -1
        self.known: dict = {}
        self.reads = self.proven = 0  # tensors read, and known without reading (for tests and benchmarks)
        self.min_bytes = MIN_BYTES

    def ready(self) -> bool:
        "Whether tracking works in this process (opened on first use; a forked child opens its own)."
        if self.pid == os.getpid():
            return self.uffd >= 0
        self.pid, self.uffd, self.pagemap, self.known = os.getpid(), -1, -1, {}  # (a parent's are not ours)
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
        "Write-protects the pages [lo, hi) (registering them first); False where they cannot be."
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


def available() -> bool:
    "Whether this process's tensors can be tracked (Linux 6.7+, userfaultfd allowed, not turned off)."
    return _T.ready()


def stats() -> dict:
    "How many tensors this process's fingerprints read, and how many were proven unwritten instead."
    return {"reads": _T.reads, "proven": _T.proven}


def _view(t) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _trackable(t) -> bool:
    n = t.numel() * t.element_size()
    return t.device.type == "cpu" and t.is_contiguous() and n >= _T.min_bytes and not t.is_sparse and not t.is_pinned()


def _span(addr: int, n: int) -> tuple:
    "The whole pages [lo, hi) of the bytes [addr, addr + n)."
    return -(-addr // _PAGE) * _PAGE, (addr + n) // _PAGE * _PAGE


def _edges(b: np.ndarray, addr: int, lo: int, hi: int) -> bytes:
    "The bytes of `b` (at `addr`) outside its whole pages [lo, hi): those no protection covers."
    return b[: lo - addr].tobytes() + b[hi - addr :].tobytes()


_LOCK = threading.Lock()  # (one fingerprint pass at a time: what is known, and what protecting forgets)


def crcs(tensors: dict, read) -> dict:
    """`{name: CRC32C}` of CPU tensors, in their order: where a tensor is tracked and proven unwritten since its
    CRC32C was read, that CRC; the rest by `read(names) -> [crc, ...]`, each trackable one write-protected first."""
    with _LOCK:
        return _crcs(tensors, read)


def _crcs(tensors: dict, read) -> dict:
    out: dict = {}
    ready = _T.ready() and any(_trackable(t) for t in tensors.values())
    if ready:
        for k, t in tensors.items():
            addr, n = t.data_ptr(), t.numel() * t.element_size()
            seen = _T.known.get((addr, n)) if _trackable(t) else None
            if seen is None:
                continue
            crc, lo, hi, edges = seen
            if _T.untouched(lo, hi) and _edges(_view(t), addr, lo, hi) == edges:
                out[k] = crc
            else:
                del _T.known[(addr, n)]
    todo = [k for k in tensors if k not in out]
    tracked: dict = {}
    spans = {k: _span(tensors[k].data_ptr(), tensors[k].numel() * tensors[k].element_size()) for k in todo}
    spans = {k: (lo, hi) for k, (lo, hi) in spans.items() if ready and hi > lo and _trackable(tensors[k])}
    anonymous = dict(zip(spans, provenance.anonymous(list(spans.values()))))
    for k, (lo, hi) in spans.items():
        t = tensors[k]
        addr, n = t.data_ptr(), t.numel() * t.element_size()
        if anonymous[k] and _T.protect(lo, hi):  # before the read: writes are seen
            tracked[k] = (addr, n, lo, hi, _edges(_view(t), addr, lo, hi))
            for key, seen in list(_T.known.items()):  # protecting again erased the pages' evidence of a write:
                if seen[1] < hi and lo < seen[2]:  # what was known of them (another view of the same bytes) goes
                    del _T.known[key]
    got = dict(zip(todo, read(todo))) if todo else {}
    if len(_T.known) > 100_000:  # (tensors long freed: forget them all, read once more)
        _T.known.clear()
    for k, (addr, n, lo, hi, edges) in tracked.items():
        _T.known[(addr, n)] = (got[k], lo, hi, edges)
    _T.reads += len(todo)
    _T.proven += len(out)
    out.update(got)
    return {k: out[k] for k in tensors}  # (in the order given)
