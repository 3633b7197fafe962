"""The files of one `AutoCheckpoint` run in one folder: their names, the newest valid one, the run's lock,
retention, the temporary files of killed saves, and the room a full disk needs.

Files are `{fname}-{run}-g{attempt}-s{stage}-f{fit}-e{epoch}-i{iter}.frk`, which sort by (attempt, stage,
fit, epoch, iteration), the order retention and autoresume use; the stage ends `between` writes for the
run are `{fname}-{run}-g{attempt}-s{stage}-end.frk`. Files of other runs, and any file not named so, are
never touched.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import os
import re
import warnings
from pathlib import Path
from typing import IO

from . import dist, io, loaders, shardfiles, store, stored
from .io import CheckpointError
from .paths import MANIFEST
from .script import say

__all__ = ["RunFolder", "RunLock", "run_identity"]

_ENOSPC = os.strerror(errno.ENOSPC)  # the words a user may search a log for


def run_identity(learn, first_signature: dict) -> str:
    """A run's identity: a hash of the model's structure, the loaders' shape, the world size and the first
    stage's call (another model, learning rate or data size is another run)."""
    from fastai.torch_core import get_model

    sd = get_model(learn.model).state_dict()
    parts = [f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sd.items() if hasattr(v, "shape")]
    first = first_signature
    parts += [
        f"world {dist.world()}",
        f"train {len(dist.unwrap_dl(learn.dls.train))}x{loaders.batch_size(learn.dls.train)}",
        f"first {first['method']} {sorted(first['args'].items())} {first['trainable']}",
    ]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:10]


class RunFolder:
    "The files of the run `run_id` named `fname` in `folder`, `keep` of its checkpoints kept."

    def __init__(self, folder: Path, fname: str, run_id: str, keep: int):
        self.folder, self.fname, self.run_id, self.keep = folder, fname, run_id, keep
        self.prefix = f"{fname}-{run_id}-"
        self.pattern = stored.run_checkpoints(self.prefix)
        self.ends = re.compile(re.escape(self.prefix) + r"g(\d{3})" + stored.STAGE_END + "$")
        self.attempt: int | None = None
        self.lock = RunLock(folder / f".{fname}-{run_id}.lock")
        self.near: list | None = None  # a sharded fit under torch.distributed: the ranks whose disk is rank 0's

    def node_local(self) -> bool:
        "Does a sharded fit's every rank write to this folder on a disk of its node's own (not every rank rank 0's)?"
        return self.near is not None and not all(self.near)

    def name(self, stage, fit_index, epoch, it) -> Path:
        return self.folder / (
            f"{self.prefix}g{self.attempt:03d}-s{stage:03d}-f{fit_index:02d}-e{epoch:06d}-i{it:010d}{io.EXT}"
        )

    def stem(self) -> str:
        "What the stage ends of the current attempt are named after (`between`)."
        return f"{self.prefix}g{self.attempt:03d}"

    def checkpoints(self, folder: Path | None = None) -> list:
        "The run's checkpoint files, oldest (attempt, stage, fit, epoch, iteration) first."
        folder = self.folder if folder is None else folder
        if not folder.is_dir():
            return []
        return sorted(p for p in folder.iterdir() if self.pattern.match(p.name))

    def attempt_of(self, path: Path) -> int:
        m = self.pattern.match(path.name)
        assert m is not None, path
        return int(m[1])

    def latest_valid(self):
        """The newest checkpoint of this run that verifies. Each newer one proven corrupt (bad magic,
        structure or checksum) is named in a warning and renamed to `*.corrupt`, so that retention never
        counts it; any other error (EMFILE, ENOMEM, EACCES ...) is raised: the file may be fine."""
        for p in reversed(self.checkpoints()):
            try:
                store.verify(p)  # a file, or a sharded checkpoint's folder: the manifest and every shard
                return p
            except CheckpointError as e:
                if isinstance(e, store.Incomplete) and dist.active():  # not corrupt: another node may have it
                    raise CheckpointError(f"AutoCheckpoint: {e} on rank 0's disk. {_NOT_TOGETHER}") from None
                _set_aside(p, e)
            except FileNotFoundError:
                continue
        return None

    def latest_valid_together(self, names, mirrored: bool = False) -> Path | None:
        """Under torch.distributed, a sharded fit's choice, on every rank: the newest of rank 0's checkpoints
        `names` (newest first) whose every file verifies. Where the nodes' disks are their own, rank 0's holds
        the manifest and each rank's file is on its own node's: the manifest is sent to the ranks whose disk
        lacks it and the files are checked where they are (rank r those of ranks r, r + world, ...), so each
        node's ranks find their files; one proven corrupt sets that checkpoint aside on every disk that holds
        it, one missing (ranks placed on other nodes than when it was saved) is refused on every rank; where the run is
        `mirrored` (its remote's newest was made whole on every disk first: `remote.resume_sharded`), one missing is
        passed over, said, for the one before it."""
        world, rank = dist.world(), dist.rank()
        for name in names:
            p = self.folder / name
            with dist.fetch_missing(f"AutoCheckpoint: {name}'s manifest", p / MANIFEST) as mf:
                try:
                    m = shardfiles.read_manifest(p, mf)
                    mine = shardfiles.problems(p, range(rank, m["world_size"], world), mf)
                except (CheckpointError, OSError) as e:  # (said on every rank, not raised on this one alone)
                    mine = [(rank, MANIFEST, str(e))]
            try:
                dist.verdict(f"AutoCheckpoint: {name} checked on every rank", mine or None)
                return p
            except dist.RankFailures as e:
                bad = [row for rows in e.failures.values() for row in rows]
            missing = [(r, f) for r, f, why in bad if why == shardfiles.MISSING]
            if missing:
                lacks = "; ".join(f"rank {r}'s file {f} is not on its node's disk" for r, f in missing)
                if mirrored:  # (newer than the remote's newest, which every disk holds now: an older one is taken)
                    if rank == 0:
                        say(f"AutoCheckpoint: passing over {name}: {lacks}, nor on the remote")
                    continue
                raise CheckpointError(f"AutoCheckpoint: {p}: {lacks}. {_NOT_TOGETHER}")
            r, f, why = bad[0]
            if self.near is None or rank == 0 or not self.near[rank]:  # each disk's copy, once
                _set_aside(p, CheckpointError(f"rank {r}'s file {f} {why}"), warn=rank == 0)
        return None

    # -- removing files -------------------------------------------------------------------------
    def remove_dead_temps(self) -> None:
        """Temporary files of this run's saves whose process is gone (killed mid-save): never valid. Where a
        sharded fit's ranks write on their nodes' own disks, a folder without a manifest here that holds a file
        of a rank on another node now was not left by a killed save: the ranks were placed otherwise."""
        stored.remove_dead_temps(self.folder, lambda name: bool(self.pattern.match(name)), self._adopt)
        if self.node_local():
            self._placed_as_saved()
        stored.remove_unfinished(self.folder, lambda name: bool(self.pattern.match(name)))  # folders without a manifest

    def _adopt(self, temp: Path, final: Path) -> bool:
        """A save whose process was killed after its checkpoint was written whole, before its thread synced it and
        put it in place (a small one is written at the batch's end, published by a thread while the next batch
        trains): every checksum verified, then synced and put in place, and said. So a SIGKILL loses at most the
        step in flight. False (it is removed): a file cut short, or its name taken."""
        if temp.is_dir() or final.exists():
            return False
        try:
            store.verify(temp)
            stored.publish(temp, final)
        except (CheckpointError, OSError):
            return False
        say(
            f"AutoCheckpoint: {final.name} was written whole by a process killed before putting it in place: "
            "verified and put in place"
        )
        return True

    def _placed_as_saved(self) -> None:
        assert self.near is not None
        for p in self.checkpoints():
            if not p.is_dir() or (p / MANIFEST).exists():
                continue
            for f in p.iterdir():
                m = shardfiles.SHARD_FILE.match(f.name)
                if m and (int(m[1]) >= len(self.near) or not self.near[int(m[1])]):
                    raise CheckpointError(
                        f"AutoCheckpoint: {f} is rank {int(m[1])}'s file, on rank 0's disk without its manifest: "
                        f"rank {int(m[1])} runs on another node than when it was saved. {_NOT_TOGETHER}"
                    )

    def remove_stale(self, folder: Path | None = None, kept_names: list | None = None) -> list:
        """Removes this run's checkpoints in `folder` (default: its own) but the newest `keep` (or but
        `kept_names`: rank 0's choice, on another node's disk), and the stage ends no kept checkpoint can
        name; returns what could not be removed, as warnings to give. A background save runs it in its writer
        thread after its commit, with the folder it wrote to: unlinking a big file costs tens of
        milliseconds, which training need not wait for."""
        folder = self.folder if folder is None else folder
        try:
            names = sorted(os.listdir(folder))  # (one listing: a save at every step runs this at every step)
        except OSError as e:
            return [f"AutoCheckpoint: could not list {folder} to remove old checkpoints: {e}"]
        files = [n for n in names if self.pattern.match(n)]
        if kept_names is None:
            kept_names = files[-self.keep :]
        stale = [n for n in files if n not in kept_names]
        kept = {f"{self.attempt_of(Path(n)):03d}" for n in kept_names}
        if self.attempt is not None:  # those of the current attempt stay while it runs
            kept.add(f"{self.attempt:03d}")
        stale += [n for n in names if (m := self.ends.match(n)) and m[1] not in kept]
        failed = []
        for old in (folder / n for n in stale):
            try:
                stored.remove(old, names)  # (a file, or a sharded checkpoint's folder)
            except FileNotFoundError:
                pass  # (another rank of this node removed it first)
            except OSError as e:
                failed.append(f"AutoCheckpoint: could not remove {old}: {e}")
        return failed

    def remove_stale_together(self) -> list:
        """A sharded fit's retention under torch.distributed, on every rank: rank 0 removes this run's stale
        checkpoints (`remove_stale`) and names those it keeps; each rank whose disk is not rank 0's (node-local
        disks) removes on its own what rank 0 keeps no more (the files of its node's ranks: checkpoints, those
        a killed save left, stage ends)."""
        failed = self.remove_stale() if dist.rank() == 0 else []
        kept = [p.name for p in self.checkpoints()] if dist.rank() == 0 else None
        kept = dist.exchange("AutoCheckpoint: the checkpoints kept", kept)[0]
        if self.near is None or self.near[dist.rank()]:
            return failed  # (rank 0's disk: rank 0's to remove)
        return self.remove_stale(kept_names=kept)

    def free_space(self) -> list:
        "After ENOSPC: remove this run's checkpoints but the newest valid one. Returns [(path, bytes)] removed."
        newest = self.latest_valid() if dist.rank() == 0 else None
        removed = []
        for old in self.checkpoints():
            if old == newest:
                continue
            try:
                size = stored.size(old)
                stored.remove(old)
                removed.append((old, size))
            except OSError:
                pass
        return removed

    # -- a full disk, said ----------------------------------------------------------------------
    def disk_full(self, path, e, removed, then) -> str:
        "The notice of a full disk that removing `removed` made room on; the save is tried again `then`."
        names = ", ".join(p.name for p, _ in removed)
        return (
            f"AutoCheckpoint: the disk is full ({_ENOSPC}): {path.name} needs {_room(e)} in {path.parent}; "
            f"removed this run's older checkpoint{'s' if len(removed) > 1 else ''} {names} "
            f"({sum(n for _, n in removed):,} bytes) to make room, and saves again {then}"
        )

    def disk_still_full(self, path, e, removed, fit_ended=False) -> str:
        "The error of a full disk that removing this run's older checkpoints cannot help: what to do."
        newest = self.checkpoints() if dist.rank() == 0 else []
        kept = f"its newest checkpoint {newest[-1].name} stays" if newest else "it has no checkpoint there"
        gone = f"; {', '.join(p.name for p, _ in removed)} removed already" if removed else ""
        why = (
            "the fit has ended, no batch is left to save it at"
            if fit_ended
            else f"this run has nothing left to remove there ({kept}{gone}; other files are never touched)"
        )
        resume = f"it resumes from {newest[-1].name}" if newest else "it starts from the beginning"
        return (
            f"AutoCheckpoint: the disk is full ({_ENOSPC}): {path.name} needs {_room(e)} in {path.parent}, and {why}. "
            "Free space on that disk, or give the Learner a path (or model_dir) on a larger one, then run "
            f"the script again: {resume}. The previous checkpoints are intact."
        )


class RunLock:
    """One process per run and folder: a lock file (`.{fname}-{run}.lock`) held while it trains, naming the
    process; a POSIX record lock, so a process killed lets it go (DataLoader workers forked from the holder do
    not hold it)."""

    def __init__(self, path: Path):
        self.path = path
        self._held: IO | None = None  # the open lock file while this process trains the run

    def take(self) -> None:
        "Taken, or a second launch of the same script on the same folder is refused."
        if self._held is not None:
            return
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            f = open(path, "a+")
            try:  # a POSIX record lock: the process's own (DataLoader workers forked from it do not hold it)
                fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise RuntimeError(
                    f"AutoCheckpoint: {holder} is already training this run into {path.parent} (lock "
                    f"{path.name}); two processes writing one run's checkpoints would delete each "
                    "other's files. Stop the other one, or give this one another fname or path."
                ) from None
            try:  # the file a process ending just now unlinked is not the lock any more: take the new one
                same = os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        else:
            raise RuntimeError(f"AutoCheckpoint: could not take the lock {path}: it keeps being replaced")
        f.truncate(0)
        f.write(f"process {os.getpid()}")
        f.flush()
        self._held = f
        atexit.register(self.release)  # the script has ended: no lock file is left behind

    def release(self) -> None:
        if self._held is not None:
            f, path = self._held, self.path
            self._held = None
            try:  # unlinked while still held: nobody can take the old file in between
                os.unlink(path)
            except OSError:
                pass
            f.close()


_NOT_TOGETHER = (
    "Where the nodes do not share this folder, each rank of a sharded fit writes its file on its own node's disk, "
    "and a resume needs every rank on the node that holds its file (launch each node with the same --node_rank as "
    "before) or the files together: keep a sharded fit's checkpoints in a folder every node shares. Nothing was "
    "changed"
)


def _set_aside(p: Path, e: Exception, warn: bool = True) -> None:
    "A checkpoint proven corrupt: named in a warning and renamed `*.corrupt`, which retention never counts."
    if warn:
        warnings.warn(f"AutoCheckpoint: skipping {p}: {e}", stacklevel=4)
    try:
        p.rename(p.with_name(p.name + ".corrupt"))
    except OSError:
        pass


def _room(e: OSError) -> str:
    "The room a save that found the disk full needs, and what was free (`io.DiskFullError`)."
    if not isinstance(e, io.DiskFullError):
        return "more room than is free"
    free = "" if e.free is None else f" ({e.free:,} free)"
    return f"{e.needed:,} bytes{free}"
