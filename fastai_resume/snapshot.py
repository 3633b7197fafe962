"""Background saves: a copy of the training state taken at the batch boundary into buffers reused
from one save to the next, then written by a thread while training goes on.

Training waits only for the copy, so everything else is kept off its path:
- the copy goes into the previous save's buffers (`SnapshotPool`), memory already touched: fresh
  memory pays a page fault per page at every save;
- big storages are checksummed while they are copied (`_core.copy_crc32c`: each piece checksummed
  from the source, then copied with non-temporal stores, on both cores; the second half on a worker
  of torch's own OpenMP pool where the core shares torch's runtime, `COPY_ON_OPENMP`, since that
  worker spins on its core after each step and takes the work at once);
- the buffers are page-aligned private memory on transparent huge pages (`_page_storage`), so the
  commit writes them around the page cache (O_DIRECT) in few, large requests: the writer thread
  makes system calls and almost nothing else, and neither fills the page cache nor interrupts the
  cores training runs on;
- what must follow the commit (AutoCheckpoint's retention, unlinking old files) runs in the writer
  thread too (`BackgroundCommit(then=...)`).
`bench/overhead.py` measures the stall and the cost per save against a memcpy of the same bytes.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import io

__all__ = ["SnapshotPool", "BackgroundCommit"]


def _openmp_is_torchs() -> bool:
    """Whether the OpenMP runtime the core would run on (the loaded `libgomp.so.1`: the core links
    none, it finds that one by name) is the one torch runs its threads on, its own
    `torch/lib/libgomp.so.1`: then the split copy's OpenMP team (`_core.copy_use_openmp`) gets a
    worker of torch's pool, which spins on its core after each step and takes the copy at once.
    Otherwise (torch on a runtime bundled under another name, or Intel's) a team would start threads
    of its own that spin after the copy: the copy then keeps its own thread. (Libraries that bundle
    their own renamed copy, as scikit-learn does, run apart and do not matter.)"""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    torchs = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
    try:
        with open("/proc/self/maps") as f:
            named = {os.path.realpath(ln.split()[-1]) for ln in f if ln.rstrip().endswith("/libgomp.so.1")}
    except OSError:
        return False
    return named == {torchs}


COPY_ON_OPENMP = io.copy_use_openmp(_openmp_is_torchs())  # False: the copy's own second thread


class SnapshotPool:
    """Host buffers for snapshots, reused across saves: the buffers of the previous snapshot are
    taken back (by size and kind) at the next `snapshot`, which refuses to run while the
    previous snapshot's `BackgroundCommit` is still writing them. Holds one snapshot's memory
    between saves; `release()` lets it go."""

    def __init__(self, huge_pages: bool = True):
        self.huge_pages = huge_pages  # False: the big buffers in base pages (bench/overhead.py compares both)
        self._lent: list = []  # (key, buffer) handed out by the latest snapshot
        self.user: Any = None  # the BackgroundCommit writing the latest snapshot
        self.crcs: dict = {}  # the latest snapshot's checksums, by (address, bytes) of its storages

    def release(self):
        "Forget every buffer (their memory goes when the last snapshot using them does)."
        self._lent, self.user = [], None

    def _free(self) -> dict:
        free: dict = {}
        for key, buf in self._lent:
            free.setdefault(key, []).append(buf)
        self._lent = []
        return free

    def snapshot(self, tree: Any) -> Any:
        """A copy of `tree` that training can no longer change: CPU storages and NumPy arrays are
        copied into pooled buffers, CUDA storages into pooled pinned host memory; `bytearray`
        becomes `bytes`; lists, tuples and dicts are rebuilt. Tensors sharing a storage keep
        sharing it, and a tensor or array met twice is copied once."""
        if self.user is not None and not self.user.done:
            raise RuntimeError("SnapshotPool: the previous snapshot is still being written")
        self.user = None
        free = self._free()
        lent = self._lent

        def take(key, make):
            bufs = free.get(key)
            buf = bufs.pop() if bufs else make()
            lent.append((key, buf))
            return buf

        storages: dict = {}  # (device, address, size) -> copy, (the source, kept so its address stays its own)
        memo: dict = {}  # id -> copy (the encoder writes one table entry per object)
        cuda = set()
        crcs = self.crcs = {}

        def copy_tensor(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()  # bits a storage copy loses
            st = t.untyped_storage()
            n = st.nbytes()
            skey = (t.device, st.data_ptr(), n)
            new = storages.get(skey, (None,))[0]
            if new is None:
                if t.device.type == "cpu" and n >= io.PAGE_ALIGN_MIN:
                    new = take(("page", n), lambda: _page_storage(n, self.huge_pages))
                    crcs[new.data_ptr(), n] = io.copy_crc32c(io.storage_bytes(new), io.storage_bytes(st))
                elif t.device.type == "cpu":
                    new = take(("torch", False, n), lambda: torch.empty(n, dtype=torch.uint8).untyped_storage())
                    new.copy_(st)
                elif t.device.type == "cuda":
                    new = take(
                        ("torch", True, n), lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True).untyped_storage()
                    )
                    new.copy_(st, non_blocking=True)
                    cuda.add(t.device)
                else:
                    new = take(("torch", False, n), lambda: torch.empty(n, dtype=torch.uint8).untyped_storage())
                    new.copy_(st.cpu())
                storages[skey] = new, t
            return torch.empty(0, dtype=t.dtype).set_(new, t.storage_offset(), t.shape, t.stride())

        def copy_array(a: np.ndarray) -> np.ndarray:
            if a.dtype.hasobject:
                return a  # not storable: the encoder says so with its path
            out = take(("numpy", a.dtype.str, a.shape), lambda: np.empty(a.shape, dtype=a.dtype))
            np.copyto(out, a)
            return out

        def leaf(v):
            if isinstance(v, (torch.Tensor, np.ndarray)):
                c = memo.get(id(v))
                if c is None:
                    c = memo[id(v)] = (copy_tensor if isinstance(v, torch.Tensor) else copy_array)(v), v
                return c[0]  # (the original is kept in the memo so that its id stays unique)
            if isinstance(v, bytearray):
                return bytes(v)
            return v

        out = io.map_tree(tree, leaf, scalars=True)
        for dev in cuda:
            torch.cuda.synchronize(dev)
        return out


_HUGE = 2 << 20  # a huge page on x86-64 and arm64 (4 KB base pages)


def _page_storage(n: int, huge_pages: bool = True):
    """A storage of n bytes starting on a page: private anonymous memory, kept alive by the storage.

    At least `_HUGE` bytes start on a huge page and are offered to transparent huge pages (where the
    system's setting is `madvise` or `always`): an O_DIRECT write from 4 KB pages goes out in requests
    of under 1 MB (a device's limit on segments per request), each an interrupt on the cores training
    runs on; from huge pages in requests of several MB.

    The mapping is not inherited by forked processes (`MADV_DONTFORK`): fastai forks its DataLoader
    workers at every epoch and validation; private memory shared with them would be copied on the
    next save's write, a fault per page on the training thread, and its huge pages split."""
    huge = huge_pages and n >= _HUGE
    m = mmap.mmap(-1, n + _HUGE if huge else n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -torch.frombuffer(m, dtype=torch.uint8).data_ptr() % _HUGE if huge else 0
    _advise(m, "MADV_DONTFORK")
    _NOT_FORKED.add(m)
    if huge:
        _advise(m, "MADV_HUGEPAGE", skip, n + _HUGE - skip)
    return torch.frombuffer(m, dtype=torch.uint8, offset=skip, count=n).untyped_storage()


# The mappings a forked child does not have (MADV_DONTFORK). Their Python objects are in the child all the
# same; freeing one there (a garbage cycle the child's GC collects) would munmap whatever the child has
# mapped since at those addresses: a DataLoader worker's batch, and a segmentation fault. So a child keeps
# them all, never freed.
_NOT_FORKED: weakref.WeakSet = weakref.WeakSet()
_KEPT_IN_CHILD: list = []
os.register_at_fork(after_in_child=lambda: _KEPT_IN_CHILD.extend(_NOT_FORKED))


def _advise(m: mmap.mmap, name: str, *where: int) -> None:
    "madvise, where this Python and this kernel have it (a kernel without THP refuses MADV_HUGEPAGE)."
    if hasattr(mmap, name):
        try:
            m.madvise(getattr(mmap, name), *where)
        except OSError:
            pass


# A checkpoint of at most this many bytes is written by the training thread itself, from the live
# tensors, through the page cache (a copy into the cache: no snapshot of its own, and no Python in the
# writer thread), and only published by the thread: its sync, rename and directory sync. A bigger one
# is snapshotted and written by the thread around the page cache. (bench/everystep.py: a LoRA fine-tune's
# every-step checkpoint, a few MB.)
WRITE_NOW_MAX = 16 << 20


class BackgroundCommit:
    """Commits `tree` to `path` in the background: training waits only for what must happen at the batch
    boundary. A checkpoint of up to `write_now_max` bytes is encoded and written now, from the live tensors,
    to its temporary file (through the page cache); a thread then syncs it, renames it into place and syncs
    the directory, with the GIL released (a process killed before that leaves the whole file, which the next
    start verifies and puts in place: `runfolder.RunFolder.remove_dead_temps`). A bigger one is snapshotted
    into `pool`'s buffers now, then written by the thread. `done`: whether the commit has ended; `wait()`
    returns the bytes written or raises the commit's error (a full disk met while writing now included);
    `seconds`: how long the thread's part took, once done.

    The thread keeps the process's priority (at a lower one a write on busy cores takes several times
    as long, and the next save waits for it). With `direct` a snapshot's thread only makes system calls:
    big storages were checksummed during the copy, and the bytes go to the disk around the page cache
    (`direct=False`: through it; bench/overhead.py measures both ways in the same run).

    `then`, if given, runs in the thread once the commit has succeeded (never after a failed one);
    its return value is `then_result`, what it raised `then_error` (the file is committed either
    way: `wait()` does not raise it), its time `then_seconds`. AutoCheckpoint removes its old
    checkpoints there (unlinking a big file takes tens of milliseconds)."""

    def __init__(
        self,
        tree: Any,
        path: str,
        pool: SnapshotPool | None = None,
        fsync: bool = True,
        then: Callable[[], Any] | None = None,
        direct: bool = True,
        write_now_max: int = WRITE_NOW_MAX,
    ):
        self._result = self._error = self.seconds = None
        self.then_result = self.then_error = self.then_seconds = None
        self._then, self.direct, self.written_now = then, direct, False
        writer = io.encode(tree)  # an unstorable value raises here, in this thread
        self._writer = writer
        self._thread: threading.Thread | None = None
        if writer.size <= write_now_max:
            self.written_now = True
            try:
                io.write(writer, path, fsync=fsync, direct=False)
            except OSError as e:  # (a full disk: said by `wait()`, as the thread's errors are)
                self._error = e
        else:
            pool = pool or SnapshotPool()
            writer = io.encode(pool.snapshot(tree), pool.crcs)
            pool.user = self
        self._writer = writer
        self._thread = threading.Thread(target=self._run, args=(os.fspath(path), fsync), name="fastai_resume-commit")
        self._thread.start()

    def _run(self, path, fsync):
        t0 = time.perf_counter()
        try:
            if self._error is None and self.written_now:
                self._result = self._writer.publish()
            elif self._error is None:
                self._result = io.commit(self._writer, path, fsync=fsync, direct=self.direct)
        except BaseException as e:
            self._error = e
        finally:
            self._writer = None  # the snapshot's buffers are free once the bytes are on disk
            self.seconds = time.perf_counter() - t0
        if self._error is None and self._then is not None:
            t0 = time.perf_counter()
            try:
                self.then_result = self._then()
            except BaseException as e:
                self.then_error = e
            self.then_seconds = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> int | None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
