"""A checkpoint on disk: a file, or a sharded checkpoint's folder (its shard files and a manifest, committed
last: `sharded`). Whether one exists, its size, its removal; the temporary files of saves in progress, and
of saves whose writer died, told apart and cleaned up. What saves and retention ask of a checkpoint without
reading it.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
from pathlib import Path

from .io import EXT
from .paths import MANIFEST

__all__ = [
    "is_sharded_checkpoint",
    "exists",
    "size",
    "remove",
    "remove_data_logs",
    "remove_unfinished",
    "is_temp",
    "temp_name",
    "remove_dead_temps",
    "publish",
    "sync_folder",
    "alive",
    "AUTO_NAME",
    "STAGE_END",
    "run_checkpoints",
]

# The names AutoCheckpoint gives a run's files (`runfolder`): `<fname>-<run id>-` then, for a checkpoint,
# AUTO_NAME and the extension (group 1: the attempt); for a stage's end state (`between`) `g<attempt>` and
# STAGE_END (any save's stage ends are `<stem>` and STAGE_END).
AUTO_NAME = r"g(\d{3})-s\d{3}-f\d{2}-e\d{6}-i\d{10}"
STAGE_END = r"-s\d{3}-end" + re.escape(EXT)


def run_checkpoints(prefix: str) -> re.Pattern:
    "The names of the checkpoints of the run whose files begin with `prefix` (group 1: the attempt)."
    return re.compile(re.escape(prefix) + AUTO_NAME + re.escape(EXT) + "$")


# A commit's temporary file (csrc/commit.c): `.<name>.tmp.<pid>.<16 random hex digits>` (older writers: `.<n>`, a count)
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>\d+)\.[0-9a-f]+$")


def is_temp(name: str) -> bool:
    "Is `name` a commit's temporary file (a save in progress, or one whose writer died)?"
    return _TEMP.match(name) is not None


def temp_name(path: Path) -> Path:
    "A new temporary file beside `path`, named as a commit names its own (what `remove_dead_temps` cleans up)."
    return path.with_name(f".{path.name}.tmp.{os.getpid()}.{secrets.token_hex(8)}")


def alive(pid) -> bool:
    "Is the process `pid` (of this machine) running? True where that cannot be told (not ours, not a pid)."
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def remove_dead_temps(folder: Path, names=None, adopt=None) -> int:
    """Remove temporary files of saves whose writing process is gone (killed mid-save), for the final
    names `names` accepts (a callable; all when None), but those `adopt(temp, final)` put in place, and the data
    logs begun beside a removed one. A live writer's file is never touched."""
    n = 0
    if not folder.is_dir():
        return 0
    for p in sorted(folder.iterdir()):
        m = _TEMP.match(p.name)
        if m is None or (names is not None and not names(m["name"])):
            continue
        if int(m["pid"]) == os.getpid() or alive(int(m["pid"])):
            continue
        if adopt is not None and adopt(p, folder / m["name"]):
            continue
        try:
            p.unlink()
            n += 1
        except OSError:
            continue
        if not (folder / m["name"]).exists():  # the data logs begun beside a save that never was
            remove_data_logs(folder / m["name"])
    return n


def publish(temp: Path, final: Path) -> None:
    """A whole checkpoint file put in place as a commit puts it: synced, given the name `final` (linked, never
    over another: `FileExistsError`) and its temporary name removed, the folder synced."""
    fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.link(temp, final)
    os.unlink(temp)
    sync_folder(final.parent)


def sync_folder(folder) -> None:
    "The folder's entries on the disk (a name just given to a synced file survives a crash)."
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_sharded_checkpoint(path) -> bool:
    "Is `path` a folder with a manifest (whether it verifies or not)?"
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def exists(path) -> bool:
    "A checkpoint at `path`: a file, or a folder whose manifest is committed."
    p = Path(path)
    return is_sharded_checkpoint(p) if p.is_dir() else p.exists()


def size(path) -> int:
    "The bytes a checkpoint takes (a folder: all of its files)."
    p = Path(path)
    if not p.is_dir():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


def data_log(path: Path, rank: int) -> Path:
    "The data log of a checkpoint (`datalog`), of one rank: removed with it."
    return path.with_name(path.name + ".datalog" + (f".rank{rank}" if rank else ""))


def remove_data_logs(path: Path, listing: list | None = None) -> None:
    "Remove the data logs of the checkpoint `path`, every rank's (`listing`: the names in its folder, if listed)."
    if listing is None:
        logs = list(path.parent.glob(glob.escape(path.name) + ".datalog*"))
    else:
        logs = [path.parent / n for n in listing if n.startswith(path.name + ".datalog")]
    for log in logs:
        log.unlink(missing_ok=True)


def remove(path, listing: list | None = None) -> None:
    """Remove a checkpoint, a file or a folder (its manifest first: from then on it no longer exists), and its
    data logs (`listing`: the names in its folder, where the caller has listed it)."""
    p = Path(path)
    remove_data_logs(p, listing)
    if not p.is_dir():
        p.unlink()
        return
    try:
        (p / MANIFEST).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(p)


def remove_unfinished(folder: Path, names=None) -> int:
    """Remove the sharded checkpoints in `folder` (those whose names `names` accepts) that a killed save left
    without a manifest, and dead writers' temporary files in the others: never a checkpoint, as a dead
    writer's temporary file is not. A folder in which a live process is still writing is left alone."""
    n = 0
    if not folder.is_dir():
        return 0
    for p in folder.iterdir():
        if not p.is_dir() or not p.name.endswith(EXT) or (names is not None and not names(p.name)):
            continue
        remove_dead_temps(p)
        if (p / MANIFEST).exists() or any(is_temp(f.name) for f in p.iterdir()):
            continue
        shutil.rmtree(p, ignore_errors=True)
        n += 1
    return n
