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
- `.<fname>-<run>.lock`: the run's lease, JSON renewed every `RENEW` seconds by the process that
  mirrors it; another process takes it only once it has seen it unchanged for 4 renewals (a lost
  machine's), or at once when it names a process of this machine that is gone.

`Mirror` is one run's mirror: a thread uploads the newest local checkpoint each time one is committed
(those committed while an upload runs are skipped: the next upload takes the newest), retries with
backoff while the remote fails, then applies `keep` there (the marker of a stale checkpoint goes first,
and only after a newer one is complete). Training never waits for it, but at the end of the process
(a normal end, an exception, a SIGTERM's exit), which waits up to `wait` seconds for the newest
checkpoint to be mirrored. What it says (behind, caught up, given up) is said in the training thread.
The transfers, markers and names it uses are `objstore`'s; the lease, `lease`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import posixpath
import sys
import threading
import time
from pathlib import Path

from . import checkpoint, io, stored
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
    end_key,
    ends_named,
    fetch_ends,
    filesystem,
    is_local,
    local_crc,
    parse_marker,
    plain_name,
    put_whole,
    reason,
    remote_crc,
    upload,
)
from .script import say

__all__ = ["Mirror", "mirror_for", "RENEW"]


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60} s" if s < 7200 else f"{s // 3600} h {s % 3600 // 60} min"


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

    def listing(self) -> dict:
        "name -> size of every object in the remote folder (fresh: no listing cache)."
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in entries}

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
        t0 = time.perf_counter()
        m = self.manifest(name)
        dest = self.folder / name
        try:
            n, _ = download(self.fs, self.key(name), dest, m)
            io.info(dest, verify=True)
        except CheckpointError:
            with contextlib.suppress(OSError):
                dest.unlink()
            raise
        ends = fetch_ends(self.fs, self.root, self.url, dest, {e["key"]: e for e in m["ends"]})
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

    def publish(self, path: Path) -> None:
        "Uploads `path` and the stage-end files it names, checks them, writes its marker, applies `keep`."
        name, key = path.name, self.run.key
        with open(path, "rb") as f:  # held open: retention may unlink the file meanwhile
            size = os.fstat(f.fileno()).st_size
            ls = self.run.listing()
            if name + MARKER in ls:
                try:
                    old = self.run.manifest(name)
                except CheckpointError:
                    old = None
                if old is not None and (old["size"], old["crc32c"]) == local_crc(f"/proc/self/fd/{f.fileno()}"):
                    return  # already there (a rerun that resumed from it)
                self.lease.fence()
                self.fs.rm_file(key(name + MARKER))  # its bytes are about to change: no marker meanwhile
            ends = [self._end(file, token, ls) for file, token in ends_named(f"/proc/self/fd/{f.fileno()}")]
            crc = upload(self.fs, f, key(name), size)
        if int(self.fs.info(key(name))["size"]) != size or remote_crc(self.fs, key(name), size) != crc:
            raise CheckpointError(f"{self.url}{name}: the remote copy read back differs from what was sent")
        marker = {"name": name, "size": size, "crc32c": crc, "ends": [e for e in ends if e is not None]}
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
        "Keeps the newest `keep` complete checkpoints (markers go first) and the stage-end files they name."
        ls = self.run.listing()
        done = self.run.complete(ls)
        for name in done[: -self.keep]:
            self.lease.fence()
            for n in (name + MARKER, name):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.run.key(n))
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
        for n in ls:
            orphan = self.run.pattern.match(n) and n + MARKER not in ls and n + CORRUPT not in ls
            m = END_KEY.match(n)
            torn = TMP_NAME.search(n) and n.lstrip(".").startswith(self.run.prefix[:-1])  # a killed `put_whole`'s
            if orphan or torn or (m and n.startswith(self.run.prefix) and n not in named):
                with contextlib.suppress(Exception):
                    self.fs.rm_file(self.run.key(n))


class Uploader:
    """The thread that mirrors the newest local checkpoint each time one is committed (those committed while
    an upload runs are skipped), with `send`, retrying with backoff while the remote fails; what it has to say
    (behind, caught up), said in the training thread; and at the end, the wait of up to `wait` seconds."""

    def __init__(self, url: str, wait: float, lease: Lease, notices: Notices, send):
        self.url, self.wait, self.lease, self.notices, self.send = url, wait, lease, notices, send
        self.cond = threading.Condition()
        self.want: Path | None = None  # the newest local checkpoint, to mirror
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

    def start(self, newest: str | None) -> None:
        "Starts the thread; `newest`: the newest checkpoint complete on the remote now."
        with self.cond:
            self.newest = newest
        self.thread.start()

    def committed(self, path: Path) -> None:
        "A local checkpoint was committed: the thread mirrors it (or a newer one). Says what is due."
        with self.cond:
            self.commits += 1
            self.want = Path(path)
            self.cond.notify_all()
        self.say_due()

    def say_due(self) -> None:
        """What the background threads have to say, said in the caller's (the training) thread; and, at most
        once a minute, how far behind the remote is while uploads fail, or while one has taken a minute or
        more and a newer checkpoint than the one it uploads is already waiting (a slow remote)."""
        with self.cond:
            msgs = self.notices.take()
            now, behind = time.monotonic(), self.commits - self.mirrored_commits
            failing = self.error is not None and self.behind_since is not None
            slow = self.started is not None and now - self.started[0] >= 60 and self.commits > self.started[2]
            if (failing or slow) and self.lease.lost is None and now - self.last_said >= 60 and behind > 0:
                self.last_said = now
                msgs.append(self._behind(behind, now))
        for m in msgs:
            say(m)

    def _behind(self, n: int, now: float) -> str:
        newest = f"its newest checkpoint is {self.newest}" if self.newest else "it has no checkpoint of this run"
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
                while not self.closing and (self.want is None or self.want.name == self.newest or self.lease.lost):
                    self.cond.wait()
                if self.lease.lost or (self.closing and (self.want is None or self.want.name == self.newest)):
                    return
                path, count = self.want, self.commits
                self.started = (time.monotonic(), path.name, count)
            try:
                self.send(path)
                with self.cond:
                    if self.behind_since is not None:
                        self.notices.post(
                            f"AutoCheckpoint: the remote {self.url} is up to date again ({path.name}), after "
                            f"{_age(time.monotonic() - self.behind_since)} behind"
                        )
                    self.newest, self.mirrored_commits = path.name, count
                    self.error = self.behind_since = None
                    backoff = 1.0
            except _Lost:  # (the lease said so)
                return
            except Exception as e:
                with self.cond:
                    if isinstance(e, FileNotFoundError) and self.want != path:
                        continue  # local retention removed it: a newer one is due
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
            want = self.want
            pending = want is not None and want.name != self.newest and self.lease.lost is None
            self.deadline = time.monotonic() + self.wait
            self.closing = True
            self.cond.notify_all()
            if want is not None and pending:
                print(f"AutoCheckpoint: mirroring {want.name} to {self.url} (waiting up to {self.wait:.0f} s)")
                sys.stdout.flush()
                over = lambda: self.lease.lost is not None or self.newest == want.name or self._deadline_passed()  # noqa: E731
                while not over():
                    self.cond.wait_for(over, timeout=5.0)
                    self.say_due()  # meanwhile, what training would have said: how far behind, once a minute
            done = want is None or self.newest == want.name
        if want is not None and done:  # the process's last word on the remote, as it ends
            print(f"AutoCheckpoint: {want.name} is on {self.url}", flush=True)
        elif want is not None and pending and self.lease.lost is None:
            why = reason(self.error) if self.error else "the upload did not finish in time"
            print(
                f"AutoCheckpoint: exiting with the remote {self.url} behind: it has {self.newest or 'no checkpoint'} "
                f"of this run; {want.name} is on this machine only ({why})",
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

    def committed(self, path: Path) -> None:
        "A local checkpoint was committed: the upload thread mirrors it (or a newer one). Says what is due."
        self.uploads.committed(path)

    def say_due(self) -> None:
        "What the background threads have to say, said in the caller's (the training) thread."
        self.uploads.say_due()

    def _mirror(self, path: Path) -> None:
        "One checkpoint mirrored (`Publisher.publish`): what the upload thread runs for each."
        self.publisher.publish(path)

    def close(self) -> None:
        """At the process's end: waits up to `wait` seconds for the newest local checkpoint to be mirrored
        (saying so, and what the remote has if it is not; the lease renewed meanwhile, however long `wait`
        is), then the renewals stop and the lease is released. Once."""
        if self.uploads.close():
            self.lease.stop()
            self.lease.release()


_MIRRORS: dict = {}  # (url, folder, prefix) -> the Mirror of this process


def mirror_for(url, options, folder: Path, fname: str, run_id: str, keep: int, wait: float) -> Mirror:
    "This process's mirror of one run (every AutoCheckpoint of the run shares it), opened on first use."
    k = (url, str(folder), fname, run_id)
    m = _MIRRORS.get(k)
    if m is None:
        m = Mirror(url, options, folder, fname, run_id, keep, wait)
        m.open()
        _MIRRORS[k] = m
    return m
