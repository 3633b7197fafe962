"""Pickle-free save and load of a value tree of Python values, torch tensors and NumPy arrays.

This is the only module that imports the C core (`_core`): what the modules above use of it (CRC32C,
the copy that checksums, the SkipToIter state machine) is re-exported here; everything above it deals
in plain trees (`state`), never in bytes.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import Any, Union

import numpy as np
import torch

from . import _core
from ._core import (  # (re-exported: the C core as the modules above use it)
    PAGE_ALIGN_MIN,
    RNG_NONE,
    RNG_SAVED,
    STEP_RESUME,
    STEP_SKIP,
    CheckpointError,
    SkipToIter,
    copy_crc32c,
    copy_use_openmp,
    crc32c,
    crc32c_combine,
    has_magic,
    skip_plan,
)

__all__ = [
    "save",
    "load",
    "Mapped",
    "CheckpointError",
    "DiskFullError",
    "is_checkpoint",
    "EXT",
    "info",
    "map_tree",
    "crc32c",
    "crc32c_combine",
    "crc32c_many",
    "copy_crc32c",
    "copy_use_openmp",
    "dtype_size",
    "has_magic",
    "PAGE_ALIGN_MIN",
    "SkipToIter",
    "skip_plan",
    "RNG_NONE",
    "RNG_SAVED",
    "STEP_SKIP",
    "STEP_RESUME",
]

EXT = ".frk"  # the file extension of this format (a plain torch.load user never meets it)

PathLike = Union[str, "os.PathLike[str]"]

_TORCH, _NUMPY = 0, 1

# The format's dtype codes (csrc/frk.h: frk_dtype). Never renumber.
_TORCH_DTYPES = {
    "bool": 0,
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "uint16": 6,
    "uint32": 7,
    "uint64": 8,
    "float16": 9,
    "bfloat16": 10,
    "float32": 11,
    "float64": 12,
    "complex32": 13,
    "complex64": 14,
    "complex128": 15,
    "float8_e4m3fn": 16,
    "float8_e5m2": 17,
    "float8_e4m3fnuz": 18,
    "float8_e5m2fnuz": 19,
    "float8_e8m0fnu": 20,
}
TORCH_CODE = {getattr(torch, n): c for n, c in _TORCH_DTYPES.items() if hasattr(torch, n)}
TORCH_DTYPE = {c: d for d, c in TORCH_CODE.items()}
TORCH_DTYPE_SIZE = {n: _core.dtype_size(c) for n, c in _TORCH_DTYPES.items()}  # by name, as `frozen` records it
NUMPY_CODE = {
    np.dtype(n): c
    for n, c in _TORCH_DTYPES.items()
    if n
    in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
NUMPY_DTYPE = {c: d for d, c in NUMPY_CODE.items()}
_INT64 = (-(1 << 63), (1 << 63) - 1)


def map_tree(tree: Any, leaf: Callable, path: tuple | None = None, scalars: bool = False, seqs: tuple = ()) -> Any:
    """`tree` rebuilt: each dict, list and tuple walked (into new ones of the base types), every other value
    replaced by `leaf(value)`, or by `leaf(value, keys)` when a `path` is given (`keys`: `path` and the keys
    down to the value). `scalars`: `leaf` returns an int, float, str, bool or None as it is, so a list or
    tuple of only those is copied without calling it (an RNG's state: hundreds of ints). `seqs`: other
    sequence types walked into lists (fastcore's `L`). The one walk of a value tree."""
    if isinstance(tree, dict):
        if path is None:
            return {k: map_tree(v, leaf, None, scalars, seqs) for k, v in tree.items()}
        return {k: map_tree(v, leaf, (*path, k), scalars, seqs) for k, v in tree.items()}
    if seqs and isinstance(tree, seqs):
        tree = list(tree)
    if isinstance(tree, (list, tuple)):
        if scalars and len(tree) >= 8 and all(type(v) in _SCALARS for v in tree):
            out = list(tree)
        elif path is None:
            out = [map_tree(v, leaf, None, scalars, seqs) for v in tree]
        else:
            out = [map_tree(v, leaf, (*path, i), scalars, seqs) for i, v in enumerate(tree)]
        return tuple(out) if isinstance(tree, tuple) else out
    return leaf(tree) if path is None else leaf(tree, path)


_SCALARS = frozenset({int, float, str, bool, type(None)})


def storage_bytes(st: Any) -> np.ndarray:
    "A torch storage's bytes as a flat uint8 NumPy array over the same memory (CPU storages)."
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).numpy()


def dtype_size(code: int) -> int:
    "The bytes of one element of the format's dtype `code`."
    return _core.dtype_size(code)


def crc32c_many(buffers: list, threads: int) -> list:
    "The CRC32C of each buffer, on `threads` threads, the GIL released (`frozen`'s fingerprints)."
    return _core.crc32c_many(buffers, threads)


class _Encoder:
    """Walks a value tree once, feeding the C writer; tensors sharing storage share one blob.
    `crcs`: the CRC32C of storages already checksummed, by (address, bytes) (a snapshot's)."""

    def __init__(self, writer: _core.Writer, crcs: dict | None = None):
        self.w = writer
        self.crcs = crcs or {}
        self.blobs: dict = {}  # storage key -> blob index
        self.tensors: dict = {}  # id(tensor) -> tensor index
        self.seen: list = []  # keeps tensors alive so their ids stay unique during the walk

    def value(self, v: Any, path: str) -> None:
        w = self.w
        if v is None:
            w.put_none()
        elif v is True or v is False:
            w.put_bool(v)
        elif isinstance(v, int):
            if not _INT64[0] <= v <= _INT64[1]:
                raise TypeError(f"{path or 'value'}: int {v} does not fit in 64 bits")
            w.put_int(v)
        elif isinstance(v, float):
            w.put_float(v)
        elif isinstance(v, str):
            w.put_str(v)
        elif isinstance(v, (bytes, bytearray)):
            w.put_bytes(v)
        elif isinstance(v, torch.Tensor):
            w.put_tensor(self.torch_tensor(v, path))
        elif isinstance(v, np.ndarray):
            w.put_tensor(self.numpy_array(v, path))
        elif isinstance(v, dict):
            w.put_dict(len(v))
            for k, x in v.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(
                        f"{path or 'value'}: dict key {k!r} ({type(k).__name__}) is not "
                        "storable: keys must be str or int"
                    )
                self.value(k, path)
                self.value(x, f"{path}[{k!r}]")
        elif isinstance(v, (list, tuple)):
            (w.put_tuple if isinstance(v, tuple) else w.put_list)(len(v))
            if len(v) >= 8 and w.put_ints(v):
                return  # all ints (an RNG's state): appended in one call, as one by one
            for i, x in enumerate(v):
                self.value(x, f"{path}[{i}]")
        else:
            raise TypeError(
                f"{path or 'value'}: {type(v).__module__}.{type(v).__qualname__} is not "
                "storable (None, bool, int, float, str, bytes, list, tuple, dict, "
                "torch.Tensor and numpy.ndarray are)"
            )

    def other(self, v) -> int:
        "The tensor index of a tensor or array met by the walk in C (`Writer.put_tree`)."
        return self.torch_tensor(v, "") if isinstance(v, torch.Tensor) else self.numpy_array(v, "")

    def torch_tensor(self, t: torch.Tensor, path: str) -> int:
        if id(t) in self.tensors:
            return self.tensors[id(t)]
        if t.layout != torch.strided or t.is_quantized or getattr(t, "is_nested", False):
            raise TypeError(f"{path}: a {t.layout} tensor is not storable (dense tensors are)")
        code = TORCH_CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"{path}: tensor dtype {t.dtype} is not storable")
        src = t
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if t.device.type != "cpu":
            t = t.cpu()
        # The reader refuses a tensor that holds more bytes than its blob (so that a small file can
        # never become a huge allocation): store overlapping views (expand, stride 0) as copies.
        st = t.untyped_storage()
        if t.numel() * t.element_size() > st.nbytes() or any(s < 0 for s in t.stride()):
            t = t.contiguous()
            st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        blob = self.blobs.get(key)
        if blob is None:
            blob = self.blobs[key] = self.w.add_blob(storage_bytes(st), crc=self.crcs.get(key))
        idx = self.w.add_tensor(_TORCH, code, blob, int(t.storage_offset()), tuple(t.shape), t.stride())
        self.tensors[id(src)] = idx
        self.seen.append(src)
        return idx

    def numpy_array(self, a: np.ndarray, path: str) -> int:
        if id(a) in self.tensors:
            return self.tensors[id(a)]
        code = NUMPY_CODE.get(a.dtype)
        if code is None or not a.dtype.isnative:
            raise TypeError(f"{path}: numpy dtype {a.dtype} is not storable")
        c = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        self.seen.append(a)
        blob = self.w.add_blob(c.reshape(-1).view(np.uint8) if c.size else b"")
        strides = tuple(s // c.itemsize for s in c.strides) if c.size else (0,) * c.ndim
        idx = self.w.add_tensor(_NUMPY, code, blob, 0, c.shape, strides)
        self.tensors[id(a)] = idx
        return idx


def encode(tree: Any, crcs: dict | None = None) -> _core.Writer:
    """A Writer holding `tree`, ready to commit. It holds the tensors' memory (not copies):
    the caller keeps them unchanged until the commit ends. `crcs` maps (address, bytes) of a
    storage to its CRC32C when the caller has it (`SnapshotPool`): the commit then does not read
    those bytes for it."""
    w = _core.Writer()
    enc = _Encoder(w, crcs)
    try:
        with torch._C.DisableTorchFunctionSubclass():  # (fastai's TensorBase: its methods as a tensor's)
            w.put_tree(tree, _OTHER, enc.other)  # the walk in C: the same values appended
    except Exception:  # (an unstorable value: the walk in Python raises the error that names it)
        w = _core.Writer()
        _Encoder(w, crcs).value(tree, "")
    return w


_OTHER = (torch.Tensor, np.ndarray)


class DiskFullError(OSError):
    """A save found its file system full (ENOSPC): nothing was written and the file previously at
    the path is intact. `needed`: the checkpoint's size in bytes; `free`: the bytes free in
    `folder` once the save had failed (None if that could not be read)."""

    def __init__(self, e: OSError, path: PathLike, needed: int):
        self.folder = os.path.dirname(os.path.abspath(os.fspath(path)))
        self.needed, self.free = needed, free_bytes(self.folder)
        free = "?" if self.free is None else f"{self.free:,}"
        super().__init__(
            errno.ENOSPC, f"{e.strerror or e}; the checkpoint needs {needed:,} bytes, {free} are free in {self.folder}"
        )


def free_bytes(folder: PathLike) -> int | None:
    "The bytes an unprivileged writer may still use on `folder`'s file system (None if unknown)."
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def commit(w: _core.Writer, path: PathLike, fsync: bool = True, direct: bool = True) -> int:
    "`w.commit(...)`; a full disk raises `DiskFullError`, which says how much room the checkpoint needs."
    return _full_said(w.commit, w.size, path, fsync, direct)


def write(w: _core.Writer, path: PathLike, fsync: bool = True, direct: bool = True) -> int:
    """`w.write(...)`: the first half of `commit`, the file written whole beside `path` and kept there for
    `w.publish()` (or `w.abandon()`); a full disk raises `DiskFullError`, as `commit`'s does."""
    return _full_said(w.write, w.size, path, fsync, direct)


def _full_said(run: Callable, needed: int, path: PathLike, fsync: bool, direct: bool) -> int:
    try:
        return run(os.fspath(path), fsync=fsync, direct=direct)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise DiskFullError(e, path, needed) from None


def save(tree: Any, path: PathLike, fsync: bool = True) -> int:
    """Save `tree` to `path` atomically and durably; returns the bytes written. A synced save is
    written around the page cache (O_DIRECT) where the file system allows it: the checkpoint does
    not push training's memory out of the cache (`Writer.commit`).

    On any failure (an unstorable value, a full disk) the file previously at `path` is untouched;
    a full disk raises `DiskFullError` (an OSError, errno ENOSPC) that says how much room it needs.
    """
    return commit(encode(tree), path, fsync=fsync)


def _decoder(mapping, reader):
    mv = memoryview(mapping)
    blobs, tensors = reader.blobs(), reader.tensors()
    storages: dict = {}
    made: dict = {}

    def make(i: int) -> Any:
        if i in made:
            return made[i]
        t: Any
        kind, code, b, off, sizes, strides = tensors[i]
        o, n, _ = blobs[b]
        if kind == _TORCH:
            dtype = TORCH_DTYPE.get(code)
            if dtype is None:
                raise CheckpointError(f"tensor {i} has dtype code {code}, which this torch lacks")
            st = storages.get(b)
            if st is None:
                st = storages[b] = (
                    torch.frombuffer(mv[o : o + n], dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
                ).untyped_storage()
            t = torch.empty(0, dtype=dtype).set_(st, off, sizes, strides)
        else:
            dtype = NUMPY_DTYPE[code]  # (the reader refuses an array of a dtype NumPy lacks)
            if n == 0 or 0 in sizes:
                t = np.empty(sizes, dtype=dtype)
            else:
                t = np.ndarray(
                    sizes,
                    dtype=dtype,
                    buffer=mv[o : o + n],
                    offset=off * dtype.itemsize,
                    strides=tuple(s * dtype.itemsize for s in strides),
                )
        made[i] = t
        return t

    return make


def load(path: PathLike, verify: bool = True, mmap: bool = False) -> Any:
    """Load a checkpoint saved by `save`: the value tree, its tensors writable and the process's
    own memory (the file is read whole into it, then verified): nothing done to the file
    afterwards (replacing, deleting, truncating or rewriting it in place) can reach them.

    `mmap=True` instead maps the file privately (copy-on-write) and returns tensors that are views
    of the mapping: no copy, and pages are read only when touched. Caveat: the views still read the
    file's inode, so truncating or rewriting that file in place while they live (`cp` or `truncate`
    over it; an atomic replace such as `save` is safe) makes the process fault (SIGBUS) or see the
    new bytes. Use it only for files nothing else writes, and for tensors that are read (a model to
    evaluate, or to copy into a model's parameters): each page a tensor writes is copied then, a
    page fault at a time, which for a state updated in place (an optimizer's) costs several times
    the default load's copy.

    `verify=False` skips the blobs' checksums (never the index's). Any defect raises
    `CheckpointError`; no code from the file is ever run.
    """
    m = _core.Mapping(os.fspath(path), copy=not mmap, verify=verify)  # checked on the way in, naming the file
    try:
        r = _core.Reader(m, verify=False)
        return r.tree(_decoder(m, r))
    except CheckpointError as e:
        raise CheckpointError(f"{os.fspath(path)}: {e}") from None


class Mapped:
    """A checkpoint file mapped, not read: its footer and index checked, its tensors views of the mapping
    (`tree`), each blob's checksum verified only when asked (`verify_blob`). For reading a few tensors of
    a large file (`sharded`'s chunks of other ranks' files)."""

    def __init__(self, path: PathLike):
        self.path = os.fspath(path)
        self._m = _core.Mapping(self.path)
        try:
            self._r = _core.Reader(self._m, verify=False)  # (the footer and the index are always checked)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def tree(self, leaf) -> Any:
        "The value tree, each tensor as `leaf(tensor, the index of its blob)`."
        try:
            table = self._r.tensors()
            make = _decoder(self._m, self._r)
            return self._r.tree(lambda i: leaf(make(i), table[i][2]))
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def verify_blob(self, blob: int) -> None:
        try:
            self._r.verify_blob(blob)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None


def is_checkpoint(path: PathLike) -> bool:
    """True if `path` is a regular file that starts with this format's magic bytes (the name is
    never looked at). A FIFO or a device is not a checkpoint, and testing one never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and _core.has_magic(os.pread(fd, 8, 0))
    finally:
        os.close(fd)


def info(path: PathLike, verify: bool = True) -> dict:
    "Format facts of a checkpoint without building its tensors: version, blobs, tensor table."
    m = _core.Mapping(os.fspath(path), verify=verify)  # checked as load checks it, naming the file
    try:
        r = _core.Reader(m, verify=False)  # (the structure again, the only check without verify)
        tensors = r.tensors()  # the table once: info must stay linear in the tensor count
        tree = r.tree(lambda i: _TensorRef(i, tensors[i]))
    except CheckpointError as e:
        raise CheckpointError(f"{os.fspath(path)}: {e}") from None
    return {"version": r.version, "size": m.size, "blobs": r.blobs(), "tensors": tensors, "tree": tree}


class _TensorRef:
    "A tensor's entry in the table, standing in for the tensor when only its description is wanted."

    def __init__(self, i, entry):
        self.index, (self.kind, self.code, self.blob, self.offset, self.shape, self.strides) = i, entry

    @property
    def dtype(self):
        return (TORCH_DTYPE if self.kind == _TORCH else NUMPY_DTYPE).get(self.code, f"code {self.code}")

    def __repr__(self):
        return f"<tensor {self.dtype} {list(self.shape)}>"

    def stand_in(self) -> Any:
        """What `load` would build here, with its type, dtype and shape but no data: a tensor on torch's
        `meta` device, or a NumPy array broadcast from one element. (The reader has checked that each
        shape fits its blob, so neither can be huge.)"""
        if self.kind == _TORCH:
            dtype = TORCH_DTYPE.get(self.code)
            if dtype is None:
                raise CheckpointError(f"tensor {self.index} has dtype code {self.code}, which this torch lacks")
            return torch.empty(self.shape, dtype=dtype, device="meta")
        return np.broadcast_to(np.zeros((), dtype=NUMPY_DTYPE[self.code]), self.shape)


def stand_ins(tree: Any) -> Any:
    "An `info()` tree (or part of one) with each tensor entry replaced by its `stand_in()`: what validation reads."
    return map_tree(tree, lambda v: v.stand_in() if isinstance(v, _TensorRef) else v)
