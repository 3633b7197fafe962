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

The protection and the scans are `pages`' (which watches a mapped file's pages the same way, for `provenance`).

Tracked: contiguous CPU tensors of at least `MIN_BYTES` (`FASTAI_RESUME_WRITE_TRACKING=N`: of N bytes; `0`:
none) in this process's private anonymous memory (`provenance.anonymous`: not a file's pages, which a write to
the file changes under a private mapping, nor memory shared with another process, which writes through its own
page tables: those are read each time), not pinned for a CUDA device (`is_pinned`). Not seen: a device writing
by DMA into memory pinned for it by other means (an RDMA registration, io_uring's fixed buffers): a frozen
base is not such memory. Unprivileged (`UFFD_USER_MODE_ONLY`). Where it is not there (not Linux, a kernel
before 6.7, a seccomp profile that forbids userfaultfd): every such tensor is read, as before.
"""

from __future__ import annotations

import numpy as np
import torch

from . import provenance
from .pages import _LOCK, _PAGE, _T, ENV, MIN_BYTES, _Tracker  # noqa: F401  (ENV, MIN_BYTES, _Tracker: its settings)

__all__ = ["crcs", "available", "stats", "ENV", "MIN_BYTES"]


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
            tracked[k] = (addr, n, lo, hi, _edges(_view(t), addr, lo, hi))  # (what was known of its pages: forgotten)
    got = dict(zip(todo, read(todo))) if todo else {}
    if len(_T.known) > 100_000:  # (tensors long freed: forget them all, read once more)
        _T.known.clear()
    for k, (addr, n, lo, hi, edges) in tracked.items():
        _T.known[(addr, n)] = (got[k], lo, hi, edges)
    _T.reads += len(todo)
    _T.proven += len(out)
    out.update(got)
    return {k: out[k] for k in tensors}  # (in the order given)
