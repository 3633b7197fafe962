"""A remote folder's objects, through fsspec (s3://, gs://, az://, file://): the file system of a URL, small
objects written whole (`put_whole`), files streamed up and down in parts of `CHUNK` and checked by CRC32C,
the markers that say an upload is complete (`MARKER`, `parse_marker`) and the stage-end files a checkpoint
names. The manual path: `learn.load(url)` downloads a checkpoint (`fetch`), and the command-line tool reads
a remote copy (`local_copy`). One run's mirror, kept by AutoCheckpoint, is `remote`.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import secrets
import tempfile
import time
from pathlib import Path

from . import checkpoint, io, paths, shardfiles, stored
from .fields import Bad, is_int, need, refused
from .io import CheckpointError
from .paths import MANIFEST
from .script import say

__all__ = [
    "INSTALL",
    "CHUNK",
    "MARKER",
    "CORRUPT",
    "NO_CREDENTIALS",
    "END_KEY",
    "TMP_NAME",
    "RemoteError",
    "is_url",
    "put_whole",
    "filesystem",
    "is_local",
    "reason",
    "upload",
    "remote_crc",
    "download",
    "download_parts",
    "held",
    "download_manifest",
    "local_crc",
    "ends_named",
    "end_key",
    "plain_name",
    "parse_marker",
    "fetch_ends",
    "fetch",
    "local_copy",
    "is_folder",
]

INSTALL = "pip install 'fastai-resume[remote]'"
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError")  # botocore's, google's
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
CHUNK = 16 << 20  # one part of an upload, one ranged read of a download: the memory a transfer holds
MARKER, CORRUPT = ".done", ".corrupt"
END_KEY = re.compile(r"^(?P<file>.+" + stored.STAGE_END + r")\.t(?P<token>[0-9a-f]{16})$")


class RemoteError(OSError):
    "The remote cannot be used (credentials refused, no such bucket, unreachable); the message says which."


def is_url(file) -> bool:
    "A URL (`s3://...`, `file://...`) rather than a local name or path."
    return isinstance(file, str) and _URL.match(file) is not None


TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{12}$")  # put_whole's temporary names


def put_whole(fs, key: str, data: bytes) -> None:
    """A small object (a marker, the lease) written whole or not at all. An object store's PUT is that
    already; on a file system (`file://`, a mounted network folder) a process killed mid-write would leave
    it torn, so there it is written under a temporary name in the same folder, synced, and renamed over."""
    if not is_local(fs):
        fs.pipe_file(key, data)
        return
    tmp = f"{key}.tmp-{secrets.token_hex(6)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, key)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def filesystem(url: str, options: dict | None = None):
    """(fsspec file system, root path without a trailing '/') of `url`. Missing packages: an ImportError
    of one line that says what to install."""
    proto = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"a remote ({url}) needs fsspec: {INSTALL}") from None
    try:
        fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    except ImportError:
        pkg = _PACKAGES.get(proto, f"fsspec's implementation of {proto}://")
        how = INSTALL if pkg == "s3fs" else f"pip install {pkg}"
        raise ImportError(f"a remote ({url}) needs {pkg}: {how}") from None
    return fs, root.rstrip("/")


def is_local(fs) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protos or "local" in protos


def reason(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if isinstance(e, (OSError, CheckpointError)) else f"{type(e).__name__}: {msg}"


# ---- transfers ----------------------------------------------------------------------------------


def upload(fs, f, key: str, size: int) -> int:
    """Streams `size` bytes of the open binary file `f` to `key`, in parts of `CHUNK` or more (an object
    store takes at most 10,000 parts). Returns the CRC32C of what was sent. A failed upload is discarded
    where the store allows (an unfinished multipart upload is never an object)."""
    block = max(CHUNK, -(-size // 9000))
    crc, sent = 0, 0
    out = fs.open(key, "wb", block_size=block) if not is_local(fs) else fs.open(key, "wb")
    try:
        while sent < size:
            chunk = f.read(min(block, size - sent))
            if not chunk:
                raise CheckpointError(f"{getattr(f, 'name', key)}: the file ended at {sent:,} of {size:,} bytes")
            crc = io.crc32c(chunk, crc)
            out.write(chunk)
            sent += len(chunk)
        out.close()
    except BaseException:
        with contextlib.suppress(Exception):
            if hasattr(out, "discard"):
                out.discard()
                out.closed = True  # (its close would upload the part it holds)
            else:
                out.close()
        raise
    return crc


def remote_crc(fs, key: str, size: int) -> int:
    "CRC32C of the first `size` bytes of the remote object `key`, read back in ranges of `CHUNK`."
    crc = 0
    for start in range(0, size, CHUNK):
        data = fs.cat_file(key, start=start, end=min(size, start + CHUNK))
        if len(data) != min(CHUNK, size - start):
            raise CheckpointError(f"{key}: the remote object is shorter than its {size:,} bytes")
        crc = io.crc32c(data, crc)
    return crc


def download(fs, key: str, dest: Path, expect: dict | None = None) -> tuple:
    """Streams the remote object `key` into `dest`, atomically (a temporary file beside it, fsynced,
    renamed: a kill leaves no partial `dest`). `expect`: {"size", "crc32c"} the bytes must match, or
    `CheckpointError` (the remote copy is not what was uploaded). Returns (size, crc32c)."""
    size = int(fs.info(key)["size"])
    if expect is not None and size != expect["size"]:
        raise CheckpointError(f"{key}: {size:,} bytes on the remote, {expect['size']:,} uploaded")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = stored.temp_name(dest)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    crc = 0
    try:
        for start in range(0, size, CHUNK):
            data = fs.cat_file(key, start=start, end=min(size, start + CHUNK))
            if len(data) != min(CHUNK, size - start):
                raise CheckpointError(f"{key}: the remote object changed while it was read")
            crc = io.crc32c(data, crc)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        if expect is not None and crc != expect["crc32c"]:
            raise CheckpointError(
                f"{key}: the remote copy differs from what was uploaded "
                f"(CRC32C {crc:08x}, uploaded {expect['crc32c']:08x})"
            )
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.rename(tmp, dest)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    stored.sync_folder(dest.parent)
    return size, crc


def local_crc(path) -> tuple:
    "(size, CRC32C) of a local file, read in pieces."
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = io.crc32c(chunk, crc)
            size += len(chunk)
    return size, crc


def ends_named(path) -> list:
    "The stage-end files (`between`) a checkpoint names: [(file relative to its folder, token)]."
    train = checkpoint.training(io.info(path, verify=False)["tree"])
    script = train.get("script") if train is not None else None
    ends = script.get("ends") if isinstance(script, dict) else None
    out = []
    for e in ends if isinstance(ends, list) else ():
        if isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("token"), int):
            out.append((e["file"], e["token"]))
    return out


def end_key(file: str, token: int) -> str:
    return f"{file}.t{token:016x}"


def plain_name(name) -> bool:
    "A file name of the folder itself (no separator, not '.' or '..'): the only names mirrored."
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _sized(d, where: str) -> None:
    "An entry of a marker: the size and CRC32C of one uploaded file."
    need(isinstance(d, dict), where, "expected an object")
    for k, hi in (("size", 1 << 62), ("crc32c", 1 << 32)):
        need(is_int(d.get(k)) and d[k] < hi, f"{where}.{k}", f"expected an int in [0, {hi})")


def parse_marker(raw: bytes, name: str, where: str) -> dict:
    """A marker's JSON, checked before a field of it is used (the remote is untrusted). A sharded checkpoint's
    (a folder: `NAME/manifest.frk` and a file per rank) has its manifest's size and CRC32C, and `parts`: each
    rank's file's name, size and CRC32C, in rank order."""
    with refused(f"{where}: malformed marker: "):
        try:
            m = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise Bad(str(e)) from None
        _sized(m, "marker")
        need(m.get("name") == name, "marker.name", f"{m.get('name')!r}, expected {name!r}")
        need(isinstance(m.get("ends"), list), "marker.ends", "expected a list")
        for i, end in enumerate(m["ends"]):
            _sized(end, f"marker.ends[{i}]")
            need(plain_name(end.get("file")) and plain_name(end.get("key")), f"marker.ends[{i}]", "a plain file name")
        if "parts" in m:
            n, token, parts = m.get("world_size"), m.get("token"), m["parts"]
            need(is_int(n, 1) and n < 100000, "marker.world_size", "expected an int >= 1")
            need(is_int(token, 1), "marker.token", "expected an int >= 1")
            need(isinstance(parts, list) and len(parts) == n, "marker.parts", f"expected a list of {n}")
            for r, part in enumerate(parts):
                _sized(part, f"marker.parts[{r}]")
                want = shardfiles.shard_name(r, n, token)
                need(part.get("file") == want, f"marker.parts[{r}].file", f"expected {want}")
    return m


def download_parts(fs, root: str, dest: Path, marker: dict, ranks, wrote: list | None = None) -> int:
    """The files of ranks `ranks` of the sharded checkpoint whose marker is `marker`, from the remote folder
    `root` (`NAME/<file>`) into the local folder `dest` (`dest/<file>`), each checked against the marker. Returns
    the bytes downloaded. A file that does not match is `CheckpointError`, one missing `FileNotFoundError`.
    `wrote`: a file `dest` holds already (of the marker's size) is kept, and those downloaded are listed there."""
    got = 0
    for r in ranks:
        part = marker["parts"][r]
        target = dest / part["file"]
        if wrote is not None and held(target, part["size"]):
            continue
        got += download(fs, f"{root}/{marker['name']}/{part['file']}", target, part)[0]
        if wrote is not None:
            wrote.append(target)
    return got


def held(path: Path, size: int) -> bool:
    "A file this disk holds already, of the size a marker says (its bytes are checked as the resume chooses)."
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def download_manifest(fs, root: str, dest: Path, marker: dict) -> int:
    "A sharded checkpoint's manifest (`dest/manifest.frk`), downloaded last: its folder is a checkpoint from then on."
    return download(fs, f"{root}/{marker['name']}/{MANIFEST}", dest / MANIFEST, marker)[0]


# ---- the manual path: learn.load(url), the command-line tool's remote copies --------------------


def fetch_ends(fs, root: str, url: str, dest: Path, known: dict, into: Path | None = None) -> str:
    """The stage-end files the checkpoint at `dest` names, downloaded beside it from the remote folder `root`
    (under their token, or their own name for a file copied there by hand); `known`: key -> the marker's entry
    (size, CRC32C) to check. Returns what to add to the download's line. `into`: a sharded checkpoint's folder
    (`dest` one of its files, whose training state names them): they go beside the folder."""
    got, missing = 0, []
    for file, token in ends_named(dest):
        if not plain_name(file):
            continue
        target = (dest.parent if into is None else into) / file
        with contextlib.suppress(CheckpointError, OSError):
            end = checkpoint.end_state(io.info(target, verify=False)["tree"])
            if end is not None and end.get("token") == token:
                continue  # already here
        for key in (end_key(file, token), file):
            try:
                download(fs, f"{root}/{key}", target, known.get(key))
                got += 1
                break
            except FileNotFoundError:
                continue
            except CheckpointError as e:
                say(f"fastai_resume: {e}: not used")
                break
        else:
            missing.append(file)
    if missing:
        say(
            f"fastai_resume: {url} lacks the stage-end file(s) {', '.join(missing)} that "
            f"{dest.name if into is None else dest.parent.name} names: a rerun "
            "that skips those stages says so and refuses what would need their state"
        )
    return f" and {got} stage-end file{'s' if got != 1 else ''}" if got else ""


def _split(url: str):
    fs, key = filesystem(url)
    return fs, key, posixpath.dirname(key), posixpath.basename(key)


def _marker_of(fs, key: str, name: str, url: str) -> dict | None:
    try:
        raw = fs.cat_file(key + MARKER)
    except FileNotFoundError:
        return None
    return parse_marker(raw, name, url + MARKER)


def fetch(learn, url: str) -> Path:
    """`learn.load(url)`: the remote file downloaded (streamed, checked against its marker when it has
    one) into the learner's model folder under its own name, with the stage-end files it names; a local
    file of that name is reused if it has the same bytes, and never replaced by other ones."""
    fs, key, root, name = _split(url)
    if not name:
        raise ValueError(f"learn.load({url!r}): name a file, not a folder")
    dest = paths.resolve(learn, name)
    t0 = time.perf_counter()
    m = _marker_of(fs, key, name, url)
    if m is not None and "parts" in m:
        raise ValueError(
            f"learn.load({url!r}): a sharded checkpoint's folder (a file per rank): AutoCheckpoint(remote=...) "
            "resumes from it on every rank; or download the folder (`fastai-resume verify` reads it) and load it"
        )
    if dest.exists():
        size, crc = local_crc(dest)
        if m is None:
            if size == int(fs.info(key)["size"]) and remote_crc(fs, key, size) == crc:
                m = {"size": size, "crc32c": crc}
        if m is None or (m["size"], m["crc32c"]) != (size, crc):
            raise FileExistsError(
                None, f"learn.load({url!r}): {dest} exists and differs from the remote file; move it away first"
            )
        how = "already here"
    else:
        n, _ = download(fs, key, dest, m)
        how = f"downloaded {n:,} bytes"
    ends = fetch_ends(fs, root, url, dest, {e["key"]: e for e in m["ends"]} if m and "ends" in m else {})
    print(f"fastai_resume: {url} -> {dest} ({how}{ends}, {time.perf_counter() - t0:.1f} s)", flush=True)
    return dest


@contextlib.contextmanager
def local_copy(url: str):
    """A downloaded copy of the remote file `url` in a temporary folder (checked against its marker if any); of
    a sharded checkpoint (a folder whose marker names every rank's file), the folder: every file, its manifest."""
    fs, key, root, name = _split(url)
    with tempfile.TemporaryDirectory(prefix="fastai-resume-") as d:
        dest = Path(d) / (name or "file")
        marker = _marker_of(fs, key, name, url)
        if marker is not None and "parts" in marker:
            download_parts(fs, root, dest, marker, range(marker["world_size"]))
            download_manifest(fs, root, dest, marker)
        else:
            download(fs, key, dest, marker)
        yield dest


def is_folder(url: str) -> bool:
    fs, key = filesystem(url)
    return url.endswith("/") or fs.isdir(key)
