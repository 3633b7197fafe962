"""Checkpoints mirrored to object storage (any fsspec URL: s3://, gs://, az://, file:// on a network file
system), and resumed from it on another machine, whose local disk starts empty.

The remote folder of a run holds, for each checkpoint `NAME` (the local file's name):
- `NAME`: the file's bytes, uploaded in parts of `CHUNK` (multipart on object stores: memory stays bounded)
  from an open descriptor (local retention may unlink the file meanwhile), then read back and checked
  against the CRC32C of what was sent;
- `NAME.done`: the marker, written last, one small object (a single PUT, or on `file://` a rename: whole
  or absent): JSON with the size and CRC32C of `NAME` and of each stage-end file it names. A checkpoint
  without its marker (an upload in progress, or killed) does not exist for a resume; one whose bytes do
  not match their marker is set aside as `NAME.corrupt` (the marker renamed), as autoresume renames a
  corrupt local file;
- `END.t<token>`: each stage-end file (`between`) a kept checkpoint names, under its token (the same
  name is written again when a stage is run again, with another token): immutable, uploaded before the
  marker that names it, deleted once no kept marker names it;
- a sharded (FSDP2) fit's checkpoint `NAME` is a folder: `NAME/<rank's file>` uploaded by each rank from its
  own disk, read back and checked, then its `NAME/<rank's file>.done`; rank 0 uploads `NAME/manifest.frk` and,
  once every rank's file is there, the marker `NAME.done`, which names each rank's file with its size and
  CRC32C (`parts`). A rerun downloads it on every rank together (`resume_sharded`): each rank the files it
  reads, onto its own node's disk, rank 0 the manifest last;
- `.<fname>-<run>.lock`: the run's lease, JSON renewed every `RENEW` seconds by the process that
  mirrors it; another process takes it only once it has seen it unchanged for 4 renewals (a lost
  machine's), or at once when it names a process of this machine that is gone.

`Mirror` is one run's mirror: a thread uploads the newest local checkpoint each time one is committed
(those committed while an upload runs are skipped: the next upload takes the newest), retries with
backoff while the remote fails, then applies `keep` there (the marker of a stale checkpoint goes first,
and only after a newer one is complete). Training never waits for it, but at the end of the process
(a normal end, an exception, a SIGTERM's exit), which waits up to `wait` seconds for the newest
checkpoint to be mirrored. What it says (behind, caught up, given up) is said in the training thread.
The transfers, markers and names it uses are `objstore`'s; the lease, `lease`'s. A sharded fit's other ranks
each have a `Parts`: their own upload thread, no lease (they only add objects; rank 0 removes).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import posixpath
import sys
import threading
import time
from pathlib import Path

from . import checkpoint, dist, io, shardfiles, stored
from .io import CheckpointError
from .lease import RENEW, Lease, Notices, machine
from .lease import Lost as _Lost  # (`_Lost`: the name tests and the threads here catch)
from .objstore import (
    CORRUPT,
    END_KEY,
    MARKER,
    NO_CREDENTIALS,
    TMP_NAME,
    RemoteError,
    download,
    download_manifest,
    download_parts,
    end_key,
    ends_named,
    fetch_ends,
    filesystem,
    held,
    is_local,
    local_crc,
    parse_marker,
    plain_name,
    put_whole,
    reason,
    remote_crc,
    upload,
)
from .paths import MANIFEST
from .script import say

__all__ = ["Mirror", "Parts", "mirror_for", "resume_sharded", "RENEW"]


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60} s" if s < 7200 else f"{s // 3600} h {s % 3600 // 60} min"


class Gone(FileNotFoundError):
    "A checkpoint (or this rank's file of it) that local retention removed before it was up: dropped, not retried."


class Superseded(Exception):
    "A sharded checkpoint's marker not written yet: a newer checkpoint is due, or the end's wait is over."


class RemoteRun:
    """One run's folder on the remote, as read: its objects (a fresh listing), the run's checkpoints complete
    there and their markers, and the resume: the newest one downloaded into the local `folder`, verified."""

    def __init__(self, url, options, folder: Path, fname: str, run_id: str):
        self.url = url if url.endswith("/") else url + "/"
        self.fs, self.root = filesystem(url, options)
        self.folder = Path(folder)
        self.prefix = f"{fname}-{run_id}-"
        self.pattern = stored.run_checkpoints(self.prefix)

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def listing(self, under: str = "") -> dict:
        "name -> size of every object in the remote folder, or its folder `under` (fresh: no listing cache)."
        where = self.key(under) if under else self.root
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(where)
        try:
            entries = self.fs.ls(where, detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in entries}

    def remove(self, name: str) -> None:
        "The object `name`, or every object under `NAME/` (a sharded checkpoint's folder); gone already is fine."
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key(name), recursive=True)

    def unmarked(self, ls: dict) -> list:
        "This run's checkpoints in the listing `ls` without a marker, nor set aside: uploads not complete."
        return [n for n in ls if self.pattern.match(n) and n + MARKER not in ls and n + CORRUPT not in ls]

    def complete(self, listing: dict | None = None) -> list:
        "This run's checkpoints complete on the remote (data and marker), oldest first."
        ls = self.listing() if listing is None else listing
        return sorted(n for n in ls if self.pattern.match(n) and n + MARKER in ls)

    def manifest(self, name: str) -> dict:
        return parse_marker(self.fs.cat_file(self.key(name + MARKER)), name, self.url + name + MARKER)

    def names(self) -> list:
        "This run's checkpoint names on the remote (complete or set aside as corrupt): for attempt numbering."
        ls = self.listing()
        return sorted(n for n in ls if self.pattern.match(n) and (n + MARKER in ls or n + CORRUPT in ls))

    def resume_point(self, local: Path | None) -> Path | None:
        """The checkpoint to resume from: `local` (the newest valid local one), or a newer one complete on
        the remote, downloaded into the local folder with the stage-end files it names and verified. A
        remote copy that does not verify is named in a warning and set aside (`NAME.corrupt`)."""
        for name in reversed(self.complete()):
            if local is not None and name <= local.name:
                break
            try:
                return self.fetch(name)
            except (CheckpointError, FileNotFoundError) as e:  # (a marker whose data is gone)
                say(f"AutoCheckpoint: skipping {self.url}{name}: {reason(e)}")
                self.set_aside(name)
            except OSError as e:  # this machine's disk (full, read-only): not the remote's fault, and not this run's
                raise RemoteError(e.errno, f"AutoCheckpoint: could not download {self.url}{name}: {reason(e)}") from e
            except Exception as e:  # the network: the remote's copy may be fine
                raise RemoteError(
                    None,
                    f"AutoCheckpoint: could not download {self.url}{name} ({reason(e)}); run the script again once "
                    "the remote is reachable: training has not started",
                ) from e
        return local

    def fetch(self, name: str) -> Path:
        "The checkpoint `name` downloaded by this process (a sharded one: every rank's file, the manifest last)."
        t0 = time.perf_counter()
        m = self.manifest(name)
        dest = self.folder / name
        if "parts" in m:
            files = [dest / p["file"] for p in m["parts"]] + [dest / MANIFEST]
            try:
                n = download_parts(self.fs, self.root, dest, m, range(m["world_size"]))
                ends = fetch_ends(self.fs, self.root, self.url, dest / m["parts"][0]["file"], _known(m), self.folder)
                n += download_manifest(self.fs, self.root, dest, m)
                shardfiles.verify(dest)
            except BaseException:
                _discard(dest, files)  # (a name newer than any here: nothing of it was on this disk)
                raise
        else:
            try:
                n, _ = download(self.fs, self.key(name), dest, m)
                io.info(dest, verify=True)
            except CheckpointError:
                with contextlib.suppress(OSError):
                    dest.unlink()
                raise
            ends = fetch_ends(self.fs, self.root, self.url, dest, _known(m))
        print(
            f"AutoCheckpoint: downloaded {name} from {self.url} ({n:,} bytes{ends}, {time.perf_counter() - t0:.1f} s; "
            "checksums verified)",
            flush=True,
        )
        return dest

    def set_aside(self, name):
        with contextlib.suppress(Exception):
            put_whole(self.fs, self.key(name + CORRUPT), self.fs.cat_file(self.key(name + MARKER)))
            self.fs.rm_file(self.key(name + MARKER))


class Publisher:
    """What a checkpoint is on the remote: its bytes and the stage-end files it names, checked against what
    was sent, then its marker; the newest `keep` kept there, and what killed uploads left removed. A write
    that removes or replaces a checkpoint's object is fenced by the run's lease."""

    def __init__(self, run: RemoteRun, lease: Lease, notices: Notices, keep: int):
        self.run, self.lease, self.notices, self.keep = run, lease, notices, keep
        self.fs, self.url = run.fs, run.url
        self.ends: dict = {}  # (file, token) -> {"file", "key", "size", "crc32c"} uploaded
        self.folders: set = set()  # sharded stage ends said not to be mirrored (once each)

    def publish(self, path: Path, superseded=lambda: False) -> None:
        """Uploads `path` and the stage-end files it names, checks them, writes its marker, applies `keep`. A
        sharded checkpoint's folder: this rank's file and the manifest, then the marker once every rank's file
        is there, unless `superseded()` says first that it need not be (`Superseded`)."""
        if path.is_dir():
            return self._publish_folder(path, superseded)
        name, key = path.name, self.run.key
        with open(path, "rb") as f:  # held open: retention may unlink the file meanwhile
            size = os.fstat(f.fileno()).st_size
            ls = self.run.listing()
            same = lambda old: (old["size"], old["crc32c"]) == local_crc(f"/proc/self/fd/{f.fileno()}")  # noqa: E731
            if self._there(name, ls, same):
                return
            ends = [self._end(file, token, ls) for file, token in ends_named(f"/proc/self/fd/{f.fileno()}")]
            crc = upload(self.fs, f, key(name), size)
        _read_back(self.fs, key(name), size, crc, self.url + name)
        self._complete({"name": name, "size": size, "crc32c": crc, "ends": [e for e in ends if e is not None]}, ls)

    def _publish_folder(self, path: Path, superseded) -> None:
        "A sharded checkpoint (rank 0): its file (`publish_part`), its manifest, the stage ends, every rank's file."
        name, key = path.name, self.run.key
        if not (path / MANIFEST).exists():  # (local retention removes it, the manifest first)
            raise Gone(None, f"{path}: gone")
        m = shardfiles.read_manifest(path)
        n, token = m["world_size"], m["token"]
        ls = self.run.listing()
        if self._there(name, ls, lambda old: old.get("token") == token):
            return
        publish_part(self.run, path, 0)
        with open(path / MANIFEST, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            crc = upload(self.fs, f, key(f"{name}/{MANIFEST}"), size)
        _read_back(self.fs, key(f"{name}/{MANIFEST}"), size, crc, f"{self.url}{name}/{MANIFEST}")
        ends = [self._end(file, t, ls) for file, t in ends_named(path / shardfiles.shard_name(0, n, token))]
        parts = self._parts(name, [shardfiles.shard_name(r, n, token) for r in range(n)], superseded)
        for r, part in enumerate(parts):
            if part["size"] != m["shards"][r]["size"]:
                raise CheckpointError(
                    f"{self.url}{name}/{part['file']}: {part['size']:,} bytes uploaded, the manifest says "
                    f"{m['shards'][r]['size']:,}"
                )
        marker = {"name": name, "size": size, "crc32c": crc, "ends": [e for e in ends if e is not None]}
        self._complete({**marker, "world_size": n, "token": token, "parts": parts}, ls)

    def _there(self, name: str, ls: dict, same) -> bool:
        """Whether the checkpoint `name` is complete on the remote already, as `same(its marker)` says (a rerun
        that resumed from it). Otherwise its marker, if any, is removed (fenced): its objects are about to change."""
        if name + MARKER not in ls:
            return False
        try:
            old = self.run.manifest(name)
        except CheckpointError:
            old = None
        if old is not None and same(old):
            return True
        self.lease.fence()
        self.fs.rm_file(self.run.key(name + MARKER))
        return False

    def _parts(self, name: str, files: list, superseded) -> list:
        """Each rank's file of the sharded checkpoint `name` as its rank's marker says it was uploaded and checked
        (`publish_part`), once every rank's is there; `Superseded` if `superseded()` says first that it need not be."""
        pause = 0.1
        while True:
            have = self.run.listing(name)
            missing = [r for r, f in enumerate(files) if f + MARKER not in have]
            if not missing:
                parts = []
                for f in files:
                    where = f"{self.url}{name}/{f}{MARKER}"
                    p = parse_marker(self.fs.cat_file(self.run.key(f"{name}/{f}{MARKER}")), f, where)
                    parts.append({"file": f, "size": p["size"], "crc32c": p["crc32c"]})
                return parts
            if not self.run.folder.joinpath(name, MANIFEST).exists():  # (removed here: dropped, as the others)
                raise Gone(None, f"{self.run.folder / name}: gone")
            if superseded():
                ranks = ", ".join(f"rank {r}'s" for r in missing)
                raise Superseded(f"the remote lacks {ranks} file of {name} (not uploaded yet)")
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def _complete(self, marker: dict, ls: dict) -> None:
        "A checkpoint's every object is up and checked: its marker (fenced), then `keep` applied."
        name, key = marker["name"], self.run.key
        marker.update(uploaded=time.time(), machine=machine().split(" ")[0], pid=os.getpid())
        self.lease.fence()
        put_whole(self.fs, key(name + MARKER), json.dumps(marker).encode())
        try:  # the checkpoint is complete there now: what follows tidies, and the next upload does it again
            if name + CORRUPT in ls:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(key(name + CORRUPT))
            self.retain()
        except _Lost:
            raise
        except Exception as e:
            self.notices.post(
                f"AutoCheckpoint: {name} is complete on {self.url}, but removing what `keep` no longer holds "
                f"there failed ({reason(e)}); the next upload tries again"
            )

    def _end(self, file: str, token: int, ls: dict):
        "A stage-end file a checkpoint names, uploaded once under its token: its marker entry."
        known = self.ends.get((file, token))
        key = end_key(file, token)
        if known is not None and key in ls:
            return known
        if not plain_name(file):
            self.notices.post(f"AutoCheckpoint: the stage-end file {file} is not in {self.run.folder}: not mirrored")
            return None
        path = self.run.folder / file
        if path.is_dir():  # (a sharded fit's stage end: a file per rank, on each rank's disk)
            if (file, token) in self.folders:
                return None
            self.folders.add((file, token))
            self.notices.post(
                f"AutoCheckpoint: the stage-end {path} is a sharded checkpoint's folder: not mirrored (a rerun on "
                "another machine that skips its stage says so and refuses what would need its state)"
            )
            return None
        try:
            with open(path, "rb") as f:
                proc = f"/proc/self/fd/{f.fileno()}"
                end = checkpoint.end_state(io.info(proc, verify=False)["tree"])
                if end is None or end.get("token") != token:
                    return None  # written again since (a rerun of its stage): the checkpoint's own is gone
                size = os.fstat(f.fileno()).st_size
                crc = upload(self.fs, f, self.run.key(key), size)
        except FileNotFoundError:
            self.notices.post(f"AutoCheckpoint: the stage-end file {path} is gone: not mirrored")
            return None
        if remote_crc(self.fs, self.run.key(key), size) != crc:
            raise CheckpointError(f"{self.url}{key}: the remote copy read back differs from what was sent")
        entry = {"file": file, "key": key, "size": size, "crc32c": crc}
        self.ends[(file, token)] = entry
        return entry

    def retain(self) -> None:
        """Keeps the newest `keep` complete checkpoints (markers go first) and the stage-end files they name; a
        sharded checkpoint older than the newest complete one that never got its marker (given up for a newer
        one: every rank has moved on from it) is removed."""
        ls = self.run.listing()
        done = self.run.complete(ls)
        for name in done[: -self.keep]:
            self.lease.fence()
            for n in (name + MARKER, name):
                self.run.remove(n)
        for n in self.run.unmarked(ls):
            if done and n < done[-1]:
                self.run.remove(n)
        named = set()
        for name in done[-self.keep :]:
            with contextlib.suppress(CheckpointError, FileNotFoundError):
                named |= {e["key"] for e in self.run.manifest(name)["ends"]}
        for n in ls:
            if END_KEY.match(n) and n.startswith(self.run.prefix) and n not in named:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.run.key(n))

    def clean(self) -> None:
        """Data of killed uploads (no marker), stage-end files no marker names and the temporary names of a
        killed `put_whole`: never a checkpoint."""
        ls = self.run.listing()
        named = set()
        for n in self.run.complete(ls):
            with contextlib.suppress(Exception):
                for e in self.run.manifest(n)["ends"]:
                    named.add(e["key"])
                    m = END_KEY.match(e["key"])
                    if m and m["file"] == e["file"]:  # uploaded already: not again (`_end`)
                        self.ends[(e["file"], int(m["token"], 16))] = e
        orphans = set(self.run.unmarked(ls))
        for n in ls:
            orphan = n in orphans
            m = END_KEY.match(n)
            torn = TMP_NAME.search(n) and n.lstrip(".").startswith(self.run.prefix[:-1])  # a killed `put_whole`'s
            if orphan or torn or (m and n.startswith(self.run.prefix) and n not in named):
                with contextlib.suppress(Exception):
                    self.run.remove(n)


def _read_back(fs, key: str, size: int, crc: int, shown: str) -> None:
    if int(fs.info(key)["size"]) != size or remote_crc(fs, key, size) != crc:
        raise CheckpointError(f"{shown}: the remote copy read back differs from what was sent")


def publish_part(run: RemoteRun, path: Path, rank: int) -> None:
    """Rank `rank`'s file of the sharded checkpoint `path` (on this rank's disk): uploaded to `NAME/<file>`, read
    back and checked, then its marker `NAME/<file>.done` (size, CRC32C), which rank 0's marker of the whole
    checkpoint waits for. Already there with the same bytes: nothing sent."""
    mine = [p for p in path.iterdir() if (m := shardfiles.SHARD_FILE.match(p.name)) and int(m[1]) == rank]
    if not mine:  # (local retention removed it)
        raise Gone(None, f"{path}: rank {rank}'s file is gone")
    if len(mine) != 1:
        raise CheckpointError(f"{path}: {len(mine)} files of rank {rank} in it, expected one")
    file, key = mine[0], run.key(f"{path.name}/{mine[0].name}")
    if is_local(run.fs):
        run.fs.makedirs(run.key(path.name), exist_ok=True)
    with open(file, "rb") as f:  # held open: retention may unlink the file meanwhile
        size = os.fstat(f.fileno()).st_size
        try:
            old = parse_marker(run.fs.cat_file(key + MARKER), file.name, run.url + key + MARKER)
        except (FileNotFoundError, CheckpointError):
            old = None
        if old is not None and (old["size"], old["crc32c"]) == local_crc(f"/proc/self/fd/{f.fileno()}"):
            return
        crc = upload(run.fs, f, key, size)
    _read_back(run.fs, key, size, crc, f"{run.url}{path.name}/{file.name}")
    put_whole(run.fs, key + MARKER, json.dumps({"name": file.name, "size": size, "crc32c": crc, "ends": []}).encode())


class Uploader:
    """The thread that mirrors the newest local checkpoint each time one is committed (those committed while
    an upload runs are skipped), with `send`, retrying with backoff while the remote fails; what it has to say
    (behind, caught up), said in the training thread; and at the end, the wait of up to `wait` seconds.
    `send(path, superseded)`; `lease`: None where this process removes nothing there (a sharded fit's other
    ranks); `what`: how its messages name what it uploads of a checkpoint (a rank's file of it)."""

    def __init__(self, url: str, wait: float, lease: Lease | None, notices: Notices, send, what: str = ""):
        self.url, self.wait, self.lease, self.notices, self.send = url, wait, lease, notices, send
        self.what = what
        self.cond = threading.Condition()
        self.want: Path | None = None  # the newest local checkpoint handed over, to mirror
        self.latest: Path | None = None  # the newest local checkpoint (all are handed over but a sharded fit's)
        self.newest: str | None = None  # the newest checkpoint complete on the remote
        self.commits = 0  # local checkpoints handed over by this process
        self.mirrored_commits = 0  # ... of which the newest mirrored was the n-th
        self.behind_since: float | None = None  # since when an upload has been failing
        self.started: tuple | None = None  # (when, name, commits then) of the upload in progress
        self.error: BaseException | None = None
        self.closing = False
        self.deadline: float | None = None  # set at the end: how long the last upload may still take
        self.last_said = 0.0
        self.thread = threading.Thread(target=self._loop, name="fastai_resume-remote", daemon=True)

    def _lost(self) -> str | None:
        return None if self.lease is None else self.lease.lost

    def _superseded(self, path: Path) -> bool:
        "The upload of `path` need not finish: a newer checkpoint is due, the end's wait is over, the lease lost."
        return self.want != path or (self.closing and self._deadline_passed()) or self._lost() is not None

    def start(self, newest: str | None) -> None:
        "Starts the thread; `newest`: the newest checkpoint complete on the remote now."
        with self.cond:
            self.newest = newest
        self.thread.start()

    def committed(self, path: Path, hand: bool = True) -> None:
        """A local checkpoint was committed: the thread mirrors it (or a newer one), or with `hand=False` only
        the end's wait does (if it is still the newest then). Says what is due."""
        with self.cond:
            self.commits += 1
            self.latest = Path(path)
            if hand:
                self.want = self.latest
                self.cond.notify_all()
        self.say_due()

    def idle(self) -> bool:
        "Nothing being uploaded and nothing waiting to be (the newest handed over is up)."
        with self.cond:
            return self.started is None and (self.want is None or self.want.name == self.newest)

    def say_due(self) -> None:
        """What the background threads have to say, said in the caller's (the training) thread; and, at most
        once a minute, how far behind the remote is while uploads fail, or while one has taken a minute or
        more and a newer checkpoint than the one it uploads is already waiting (a slow remote)."""
        with self.cond:
            msgs = self.notices.take()
            now, behind = time.monotonic(), self.commits - self.mirrored_commits
            failing = self.error is not None and self.behind_since is not None
            slow = self.started is not None and now - self.started[0] >= 60 and self.commits > self.started[2]
            if (failing or slow) and self._lost() is None and now - self.last_said >= 60 and behind > 0:
                self.last_said = now
                msgs.append(self._behind(behind, now))
        for m in msgs:
            say(m)

    def _behind(self, n: int, now: float) -> str:
        if self.what:  # (a sharded fit's rank: its own files)
            newest = f"{self.what}{self.newest} is the newest there" if self.newest else f"it has no {self.what}any"
        else:
            newest = (
                f"its newest checkpoint is {self.newest}" if self.newest else "no upload of this run is confirmed on it"
            )
        if self.error is not None and self.behind_since is not None:
            why = f"uploads have failed for {_age(now - self.behind_since)}: {reason(self.error)}"
        else:
            t0, name, _ = self.started or (now, "?", 0)
            why = f"the upload of {name} has taken {_age(now - t0)} so far"
        return (
            f"AutoCheckpoint: the remote {self.url} is {n} checkpoint{'s' if n != 1 else ''} behind ({newest}; "
            f"{why}). Training goes on and local checkpoints are written; the upload goes on (a failed one is retried)."
        )

    def _loop(self):
        backoff = 1.0
        while True:
            with self.cond:
                while not self.closing and (self.want is None or self.want.name == self.newest or self._lost()):
                    self.cond.wait()
                if self._lost() or (self.closing and (self.want is None or self.want.name == self.newest)):
                    return
                if self.closing and self._deadline_passed():
                    return
                path, count = self.want, self.commits
                self.started = (time.monotonic(), path.name, count)
            try:
                self.send(path, functools.partial(self._superseded, path))
                with self.cond:
                    if self.behind_since is not None:
                        self.notices.post(
                            f"AutoCheckpoint: the remote {self.url} is up to date again ({self.what}{path.name}), "
                            f"after {_age(time.monotonic() - self.behind_since)} behind"
                        )
                    self.newest, self.mirrored_commits = path.name, count
                    self.error = self.behind_since = None
                    backoff = 1.0
            except _Lost:  # (the lease said so)
                return
            except Superseded as e:  # a newer checkpoint is due (the loop takes it), or the end's wait is over
                with self.cond:
                    if self.closing and self._deadline_passed():
                        self.error = e
                continue
            except Exception as e:
                with self.cond:
                    if isinstance(e, Gone) or (isinstance(e, FileNotFoundError) and not path.exists()):  # removed here
                        if self.want == path:  # (a sharded fit's: no newer one is handed over until every rank
                            self.want = None  # is idle, which this one is now)
                        continue
                    first = self.behind_since is None
                    self.error = e
                    if first:
                        self.behind_since = time.monotonic()
                        self.last_said = 0.0  # said at the next checkpoint (or at the end)
                    self.cond.wait_for(lambda: self.closing and self._deadline_passed(), timeout=backoff)
                backoff = min(backoff * 2, 60.0)
            finally:
                with self.cond:
                    self.started = None
                    self.cond.notify_all()

    def _deadline_passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def close(self) -> bool:
        """At the process's end: waits up to `wait` seconds for the newest local checkpoint to be mirrored
        (saying so, and what the remote has if it is not). False if it was closed already."""
        with self.cond:
            if self.closing:
                return False
            self.want = want = self.latest  # (every rank of a sharded fit has the same newest)
            pending = want is not None and want.name != self.newest and self._lost() is None
            self.deadline = time.monotonic() + self.wait
            self.closing = True
            self.cond.notify_all()
            if want is not None and pending:
                print(
                    f"AutoCheckpoint: mirroring {self.what}{want.name} to {self.url} (waiting up to {self.wait:.0f} s)"
                )
                sys.stdout.flush()
                over = lambda: self._lost() is not None or self.newest == want.name or self._deadline_passed()  # noqa: E731
                while not over():
                    self.cond.wait_for(over, timeout=5.0)
                    self.say_due()  # meanwhile, what training would have said: how far behind, once a minute
            done = want is None or self.newest == want.name
        if want is not None and done:  # the process's last word on the remote, as it ends
            print(f"AutoCheckpoint: {self.what}{want.name} is on {self.url}", flush=True)
        elif want is not None and pending and self._lost() is None:
            why = reason(self.error) if self.error else "the upload did not finish in time"
            print(
                f"AutoCheckpoint: exiting with the remote {self.url} behind: it has {self.newest or 'no checkpoint'} "
                f"of this run; {self.what}{want.name} is on this machine only ({why})",
                flush=True,
            )
        self.say_due()
        return True


class Mirror:
    """The remote copy of one run's checkpoints (`AutoCheckpoint(remote=...)`): see the module's doc. A
    composition of the run's folder there (`RemoteRun`: listing, markers, the resume's download), its lease
    (`Lease`), what a checkpoint is there (`Publisher`: upload, marker, retention) and the thread that
    mirrors each new one (`Uploader`).

    `open()` (at the run's start) takes the run's lease on the remote and fails at once, with a message
    that says why, where the remote refuses the credentials, lacks the bucket or cannot be reached.
    `resume_point(local)` is the checkpoint to resume from (downloading a newer one the remote has);
    `committed(path)` hands a new local checkpoint to the upload thread."""

    def __init__(self, url, options, folder: Path, fname: str, run_id: str, keep: int, wait: float):
        self.run = RemoteRun(url, options, folder, fname, run_id)
        self.notices = Notices()
        self.lease = Lease(self.run, fname, run_id, self.notices)
        self.publisher = Publisher(self.run, self.lease, self.notices, keep)
        self.uploads = Uploader(self.run.url, wait, self.lease, self.notices, self._mirror)
        self.url, self.token, self.cond = self.run.url, self.lease.token, self.uploads.cond

    @property
    def newest(self) -> str | None:
        "The newest checkpoint complete on the remote (read under `cond`)."
        return self.uploads.newest

    def open(self):
        """Takes the run's lease and removes what killed uploads left; fails now, saying why, where the
        remote cannot be used (the credentials, the bucket, the network), rather than hours later."""
        tries = (2.0, 4.0, 8.0)
        for i in range(len(tries) + 1):
            try:
                if is_local(self.run.fs):
                    self.run.fs.makedirs(self.run.root, exist_ok=True)
                self.run.listing()
                self.lease.take()
                break
            except RuntimeError:
                raise  # the lease: held by another process
            except Exception as e:
                if isinstance(e, PermissionError) or type(e).__name__ in NO_CREDENTIALS:
                    raise RemoteError(
                        None,
                        f"AutoCheckpoint: the remote {self.url} refused the credentials ({reason(e)}); check them "
                        "(for s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                        "remote_options=dict(key=..., secret=...)). Training has not started.",
                    ) from None
                if isinstance(e, FileNotFoundError):
                    raise RemoteError(
                        None,
                        f"AutoCheckpoint: the remote {self.url} does not exist ({reason(e)}): create the bucket "
                        "(or folder) first. Training has not started.",
                    ) from None
                if i == len(tries):
                    raise RemoteError(
                        None,
                        f"AutoCheckpoint: cannot reach the remote {self.url} ({reason(e)}), tried {i + 1} times. "
                        "Training has not started: without the remote, this machine cannot know whether it holds a "
                        "newer checkpoint of this run.",
                    ) from None
                time.sleep(tries[i])
        self.publisher.clean()
        self.publisher.retain()  # a process killed between a marker and the retention after it
        done = self.run.complete()
        self.uploads.start(done[-1] if done else None)
        self.lease.thread.start()
        atexit.register(self.close)

    def names(self) -> list:
        "This run's checkpoint names on the remote (complete or set aside as corrupt): for attempt numbering."
        return self.run.names()

    def resume_point(self, local: Path | None) -> Path | None:
        "The checkpoint to resume from: `local`, or a newer one downloaded from the remote (`RemoteRun`)."
        return self.run.resume_point(local)

    def committed(self, path: Path, every_rank: bool = False) -> None:
        """A local checkpoint was committed: the upload thread mirrors it (or a newer one). Says what is due.
        `every_rank`: a sharded fit's, committed on every rank together (a collective): it is handed over to every
        rank's upload thread where each is idle, and to none otherwise, so that they upload the same checkpoints
        (one that is skipped costs nothing: a newer one follows, and the end's wait takes the newest)."""
        hand = all(dist.exchange("AutoCheckpoint: the uploads idle", self.uploads.idle())) if every_rank else True
        self.uploads.committed(path, hand)

    def say_due(self) -> None:
        "What the background threads have to say, said in the caller's (the training) thread."
        self.uploads.say_due()

    def _mirror(self, path: Path, superseded=lambda: False) -> None:
        "One checkpoint mirrored (`Publisher.publish`): what the upload thread runs for each."
        self.publisher.publish(path, superseded)

    def close(self) -> None:
        """At the process's end: waits up to `wait` seconds for the newest local checkpoint to be mirrored
        (saying so, and what the remote has if it is not; the lease renewed meanwhile, however long `wait`
        is), then the renewals stop and the lease is released. Once."""
        if self.uploads.close():
            self.lease.stop()
            self.lease.release()


class Parts:
    """A sharded fit's rank other than 0 (`AutoCheckpoint(remote=...)`): its own file of each committed checkpoint
    uploaded by a thread of its own (`publish_part`), whatever disk it is on; rank 0's `Mirror` uploads its own
    file and the manifest, and writes the checkpoint's marker once every rank's file is there. No lease: it only
    adds objects (rank 0 alone removes any). `run`: the remote folder, for the rerun's download."""

    committed, say_due = Mirror.committed, Mirror.say_due

    def __init__(self, url, options, folder: Path, fname: str, run_id: str, wait: float):
        self.run = RemoteRun(url, options, folder, fname, run_id)
        self.url, self.notices, rank = self.run.url, Notices(), dist.rank()
        send = lambda path, _: publish_part(self.run, path, rank)  # noqa: E731
        self.uploads = Uploader(self.url, wait, None, self.notices, send, what=f"rank {rank}'s file of ")
        self.uploads.start(None)
        atexit.register(self.close)

    def names(self) -> list:
        return []  # (rank 0's mirror numbers the attempts)

    def close(self) -> None:
        "At the process's end: waits up to `wait` seconds for this rank's file of the newest checkpoint to be up."
        self.uploads.close()


_MIRRORS: dict = {}  # (url, folder, prefix) -> the Mirror (rank 0's) or Parts of this process


def mirror_for(url, options, folder: Path, fname: str, run_id: str, keep: int, wait: float):
    """This process's mirror of one run (every AutoCheckpoint of the run shares it), opened on first use: rank
    0's `Mirror`, or where a sharded fit's other ranks call it, their `Parts` (after rank 0's is open)."""
    k = (url, str(folder), fname, run_id)
    m = _MIRRORS.get(k)
    if m is None:
        if dist.rank() == 0:
            m = Mirror(url, options, folder, fname, run_id, keep, wait)
            m.open()
        else:
            m = Parts(url, options, folder, fname, run_id, wait)
        _MIRRORS[k] = m
    return m


def resume_sharded(run: RemoteRun) -> str | None:
    """A sharded fit's start, on every rank together: what each disk lacks of the newest checkpoint complete on
    the remote, downloaded: each rank the files of ranks r, r + world, ... (at the saved world size its own) its
    disk does not hold, then rank 0 the stage-end files it names and, where its disk lacks it, the manifest,
    last (a checkpoint every disk holds whole is not downloaded at all: the common case). One whose files do not
    match its marker, or lack one, is said and set aside on the remote (the files this download wrote of it
    removed, nothing else), and the one before it tried; the remote unreachable, or a disk failing, stops every
    rank before training. Returns the name made whole (None: none on the remote)."""
    rank, world, t0 = dist.rank(), dist.world(), time.perf_counter()

    def each(step: str, fn, only0: bool = False) -> list:
        "Every rank's outcome of `fn()` at `step`: ['ok', value], ['bad', why] (this copy), or raise on every rank."
        out: list = ["ok", None]
        if rank == 0 or not only0:
            try:
                out = ["ok", fn()]
            except (CheckpointError, FileNotFoundError) as e:  # (the remote's copy: not what was uploaded, or gone)
                out = ["bad", reason(e)]
            except Exception as e:  # the network, or this machine's disk (full, read-only): the copy may be fine
                out = ["down", reason(e)]
        rows = dist.exchange(f"AutoCheckpoint: {step}", out)
        down = [f"rank {r}: {why}" for r, (k, why) in enumerate(rows) if k == "down"]
        if down:
            raise RemoteError(
                None,
                f"AutoCheckpoint: could not get {step} from {run.url} onto every rank's disk ({'; '.join(down)}); "
                "run the script again once the remote is reachable and the disks have room: training has not started",
            )
        return rows

    def bad(rows) -> str | None:
        return "; ".join(f"rank {r}: {why}" for r, (k, why) in enumerate(rows) if k == "bad") or None

    rows = each("its checkpoints", lambda: list(reversed(run.complete())), True)
    if bad(rows):  # (a listing that failed otherwise than by the network)
        raise RemoteError(None, f"AutoCheckpoint: could not list {run.url}: {bad(rows)}")
    for name in rows[0][1]:
        dest, wrote = run.folder / name, []
        rows = each(f"{name}'s marker", lambda: run.manifest(name), True)  # noqa: B023
        why, marker = bad(rows), rows[0][1]
        if why is None and "parts" not in marker:
            say(f"AutoCheckpoint: skipping {run.url}{name}: one file, not a sharded checkpoint's folder")
            continue

        def last() -> int:  # the stage ends its training state names (beside the checkpoints), then the manifest
            own = dest / marker["parts"][0]["file"]  # noqa: B023
            fetch_ends(run.fs, run.root, run.url, own, _known(marker), into=run.folder)  # noqa: B023
            if held(dest / MANIFEST, marker["size"]):  # noqa: B023
                return 0
            wrote.append(dest / MANIFEST)  # noqa: B023
            return download_manifest(run.fs, run.root, dest, marker)  # noqa: B023

        got = 0
        try:
            if why is None:
                mine = range(rank, marker["world_size"], world)  # (those this disk lacks: `wrote` lists them)
                rows = each(f"{name}'s files", lambda: download_parts(run.fs, run.root, dest, marker, mine, wrote))  # noqa: B023
                why, got = bad(rows), sum(n for _, n in rows if isinstance(n, int))
            if why is None:
                rows = each(f"{name}'s manifest", last, True)
                why, got = bad(rows), got + (rows[0][1] or 0)
        except BaseException:
            _discard(dest, wrote)
            raise
        if why is None:
            if rank == 0 and got:
                print(
                    f"AutoCheckpoint: downloaded {name} from {run.url} ({got:,} bytes: what each rank's disk lacked "
                    f"of its {marker['world_size']} ranks' files and manifest; {time.perf_counter() - t0:.1f} s; "
                    "checksums verified)",
                    flush=True,
                )
            return name
        _discard(dest, wrote)
        if rank == 0:
            say(f"AutoCheckpoint: skipping {run.url}{name}: {why}")
            run.set_aside(name)
    return None


def _known(marker: dict) -> dict:
    return {e["key"]: e for e in marker["ends"]}


def _discard(dest: Path, wrote: list) -> None:
    "What a download that was given up wrote (those files only: what the disk held before stays), its folder if empty."
    for p in wrote:
        with contextlib.suppress(OSError):
            p.unlink()
    with contextlib.suppress(OSError):
        dest.rmdir()
