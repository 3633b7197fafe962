"""One door to storage: a Learner checkpoint written, read and verified, whatever its layout.

    save(learn, path, build, background)   the tree `build()` returns, laid out as `learn`'s model is: one
                                           file (rank 0 writes it; under DDP the other ranks wait for it), or
                                           a sharded (FSDP2) model's folder (every rank its own file, then the
                                           manifest); synchronously, or in the background (a `Pending`)
    read(path, learn)                      validated, as `learn`'s model takes it (a sharded one: DTensors)
    verify(path)                           complete and intact (a folder: its manifest and every rank's file)
    make_full(learn, src, dst)             a delta's self-contained twin, its frozen tensors from the learner

A save of a model that is not sharded (one process, DDP) never enters `sharded`, which keeps the
DTensor mechanics: a rank's tree of local tensors, and reading a folder into a model at any world size.
A save in flight is a `Pending`; AutoCheckpoint holds at most one and decides only when to save and what
a failure does. A new storage case (a sharded delta) is a layout here; a copy elsewhere (object storage, a sharded fit's
per-rank uploads too) is `remote`'s.

A folder's save makes two small collectives (its token, 8 bytes; the outcome, `dist.verdict`): every rank
writes its file under the save's token, so a new save never overwrites a file of the checkpoint it
replaces before its own manifest is committed; rank 0 then commits the manifest and removes what earlier
saves of the same name left (each rank on a disk of its node's own, its own files).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from . import checkpoint, dist, frozen, io, sharded, shardfiles, stored
from .paths import MANIFEST
from .shardfiles import SCHEMA, Incomplete, shard_name
from .snapshot import BackgroundCommit

__all__ = ["save", "read", "verify", "make_full", "Pending", "CouldNotStart", "Incomplete"]


class Pending:
    """A save in flight on this rank: its file being written by `writer` (None: nothing to write here, or the
    save could not start: `error`), then, for a sharded model's folder (`collective`), the manifest, which
    every rank must reach together (`finish` where every rank calls it)."""

    def __init__(self, path: Path, writer=None, error=None, folder: _Folder | None = None, nbytes: int = 0):
        self.path, self.writer, self.error, self._folder, self.nbytes = Path(path), writer, error, folder, nbytes

    @property
    def collective(self) -> bool:
        return self._folder is not None

    @property
    def done(self) -> bool:
        "This rank's file has been written (or failed)."
        return self.writer is None or self.writer.done

    @property
    def then_result(self):
        return None if self.writer is None else self.writer.then_result

    @property
    def then_error(self):
        return None if self.writer is None else self.writer.then_error

    def finish(self) -> int:
        """Wait for this rank's file; a folder's manifest is then committed (collective). Returns the bytes of
        this rank's file once the checkpoint is in place, or raises (a folder's failure on every rank)."""
        err, nbytes = self.error, self.nbytes
        if self.writer is not None:
            try:
                nbytes = self.writer.wait() or 0
            except Exception as e:
                if self._folder is None:
                    raise
                err = e
        if self._folder is None:
            if err is not None:
                raise err
            return nbytes
        self._folder.finish(err, nbytes)
        return nbytes

    def abandon(self) -> None:
        "After an interrupted fit (the other ranks may be gone): wait for this rank's file, commit nothing more."
        if self.writer is not None:
            try:
                self.writer.wait()
            except Exception:
                pass


def save(learn, path, build, background=False, pool=None, then=None, direct=True):
    """Write the tree `build()` returns to `path`, on every rank (`build` may be collective).
    `background=False`: returns None once the checkpoint is committed, or raises (under torch.distributed on
    every rank; the previous checkpoint at `path` is intact). `background=True`: returns the `Pending` save
    (None on a rank with nothing to write: DDP's ranks but 0); its file is written by a thread
    (`snapshot.BackgroundCommit`, with `pool`, `then` and `direct`)."""
    path = Path(path)
    if dist.sharded(learn.model):
        return _Folder(path).save(learn, build, background, pool)
    if not background:
        _commit_file(path, build)
        return None
    tree = build()  # under DDP: collective (its errors are raised as a synchronous save's)
    if tree is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        w = BackgroundCommit(tree, path, pool, then=then, direct=direct)
    except (OSError, TypeError, ValueError, RuntimeError) as e:
        raise CouldNotStart(e) from e
    return Pending(path, w)


class CouldNotStart(Exception):
    "A background save of a file whose write could not start (`error`: a folder not made, an unstorable value)."

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _commit_file(path: Path, build) -> None:
    """One file, written atomically by rank 0; under torch.distributed every rank calls it (`build` may be
    collective) and returns once the file is committed, or raises on every rank if any rank could not build
    its part (agreed before rank 0 writes anything) or rank 0 could not write it."""

    failed = f"the checkpoint {path} was not saved ({{failures}}); the previous files are intact"
    tree = dist.together(f"build {path.name}", build, failed) if dist.active() else build()
    err = None
    if dist.rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            stored.remove_dead_temps(path.parent, lambda name: name == path.name)  # (a killed save's)
            io.save(tree, path)
        except Exception as e:  # under torch.distributed every rank hears of it
            if not dist.active():
                raise
            err = e
    if dist.active():
        dist.verdict(
            f"commit {path.name}", None if err is None else f"{type(err).__name__}: {err}", own=err, failed=failed
        )


class _Folder:
    "A sharded model's checkpoint: the folder `path`, a file per rank named after the save's token, a manifest."

    def __init__(self, path: Path):
        self.path, self.token, self.kind = path, 0, "other"
        self.position: dict | None = None

    def save(self, learn, build, background: bool, pool):
        sharded.reshard(learn.model)
        t = secrets.randbits(63) + 1 if dist.rank() == 0 else 0
        self.token = dist.all_gather_ints("sharded save: its token", [t])[0][0]  # rank 0's
        writer = err = None
        nbytes = 0
        try:
            tree = build()
            self.position, self.kind = checkpoint.position(tree), checkpoint.kind(tree)
            tree = sharded.rank_tree(tree, self.token)
            self.path.mkdir(parents=True, exist_ok=True)
            file = self.path / shard_name(dist.rank(), dist.world(), self.token)
            if background:
                writer = BackgroundCommit(tree, os.fspath(file), pool)
            else:
                nbytes = io.save(tree, file)
        except Exception as e:  # every rank must hear of it, or the others wait forever
            if not dist.active():
                raise
            err = e
        pending = Pending(self.path, writer, err, self, nbytes)
        if background:
            return pending
        pending.finish()
        return None

    def finish(self, err: BaseException | None, nbytes: int) -> None:
        """Every rank has tried to write its file: agree on the outcome, then rank 0 commits the manifest.
        Collective; every rank returns once the manifest is committed, or raises."""
        path = self.path
        rows = dist.verdict(
            f"sharded save {path.name}: every rank's file",
            None if err is None else f"{type(err).__name__}: {err}",
            nbytes,
            own=err,
            failed=f"the checkpoint {path} was not saved ({{failures}}); the previous checkpoint is intact",
        )

        def manifest():
            if dist.rank() != 0:
                return
            n = len(rows)
            io.save(
                {
                    "fastai_resume_sharded": SCHEMA,
                    "kind": self.kind,
                    "token": self.token,
                    "world_size": n,
                    "shards": [{"rank": r, "file": shard_name(r, n, self.token), "size": rows[r]} for r in range(n)],
                    "position": self.position,
                },
                path / MANIFEST,
            )
            self._remove_leftovers()

        dist.together(
            f"sharded save {path.name}: its manifest",
            manifest,
            f"the checkpoint {path} was not saved (its manifest: {{failures}})",
        )
        if dist.rank() != 0:  # a node's own disk: this rank's files of the saves this one replaces
            self._remove_leftovers(dist.rank())

    def _remove_leftovers(self, rank: int | None = None) -> None:
        """Shard files of other saves of this folder (the checkpoint replaced, saves that never finished), dead
        temps; `rank`: only that rank's files (each rank's on a disk of its own node, which rank 0 never sees)."""
        stored.remove_dead_temps(self.path)
        for p in self.path.iterdir():
            m = shardfiles.SHARD_FILE.match(p.name)
            if m is not None and int(m[3], 16) != self.token and (rank is None or int(m[1]) == rank):
                try:
                    p.unlink()
                except OSError:
                    pass


def read(path, learn) -> dict:
    """The checkpoint at `path` (a file, or a sharded checkpoint's folder), validated, as `learn`'s model
    takes it: a sharded model gets DTensors of this rank's part of each tensor (`sharded`), a model that is
    not sharded whole tensors. A folder is read by every rank together (a collective, as its save)."""
    path = Path(path)
    if path.is_dir():
        return sharded.read_folder(path, learn)
    tree = checkpoint.read(path)
    if dist.sharded(learn.model):  # a file checkpoint (one process, DDP) into a sharded model
        sharded.distribute(tree, learn, path)
    return tree


def verify(path) -> None:
    """Raise `CheckpointError` unless the checkpoint at `path` is complete and verifies: a file's every
    checksum, or a folder's manifest and every rank's file (`Incomplete`: a rank's file this disk lacks)."""
    p = Path(path)
    if p.is_dir():
        shardfiles.verify(p)
    else:
        io.info(p, verify=True)


def make_full(learn, src, dst) -> Path:
    """Write `dst`, the self-contained twin of the checkpoint `src`: the frozen tensors it references taken
    from `learn`'s model once they are checked to be those (everything else as `src` holds it). A file, written
    by the process that calls it; a sharded learner's ranks (every rank calls it) write a sharded checkpoint,
    each its part of every tensor."""
    from fastai.torch_core import get_model

    src, dst = Path(src), Path(dst)
    sharded_model = dist.sharded(learn.model)
    if sharded_model and getattr(learn, "opt", None) is None:
        learn.create_opt()  # (a sharded checkpoint's optimizer state is read into its parameters' placement)
    tree = read(src, learn)
    model = get_model(learn.model)
    checkpoint.model_mismatch_or_raise(model, tree, src, strict=True)
    frozen.check(model, tree, src)  # (collective for a sharded model, as the read)
    sd, held, refs = model.state_dict(), tree["model"], tree.pop("frozen", None) or {}
    own = lambda t: t.detach() if dist.is_dtensor(t) else t.detach().cpu()  # noqa: E731
    tree["model"] = {k: held[k] if k in held else own(sd[k]) for k in sd if k in held or k in refs}
    if sharded_model:
        save(learn, dst, lambda: tree)
    else:
        io.save(tree, dst)  # (this process's file, as `fastai_resume.save` writes one: nothing collective)
    return dst
