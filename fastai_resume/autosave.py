"""`AutoCheckpoint`: periodic, background, retained, auto-resumed checkpoints, and a clean exit on
preemption (SIGTERM). One callback; run the same script again after a crash and it continues. What it
does with files is `runfolder.RunFolder`'s; this is its policy: when to save, and what a failure does.
"""

from __future__ import annotations

import enum
import errno
import functools
import re
import signal
import threading
import time
import warnings
from pathlib import Path

from fastai.callback.core import Callback
from fastcore.basics import store_attr

from . import checkpoint, dist, objstore, paths, store, stored
from . import remote as _remote
from .io import CheckpointError
from .runfolder import RunFolder, run_identity
from .script import STAGE_BEGIN_HOOKS, checking, say, script, session_of
from .snapshot import SnapshotPool

__all__ = ["AutoCheckpoint", "PREEMPTED_EXIT_CODE"]

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM


class Agreed(enum.IntFlag):
    "What every rank of a data-parallel fit must know at a batch's end (one bounded step, `dist.agree_any`)."

    PREEMPTED = 1  # a SIGTERM seen by any rank: every rank saves at this batch, then exits
    TIME_DUE = 2  # `every_seconds` has passed, by rank 0's clock
    FAILED = 4  # rank 0's background save failed: every rank raises together
    WRITING = 8  # a sharded save's file is still being written on some rank: its manifest waits


class AutosaveRun:
    """What one AutoCheckpoint run has done in this process: whether it has autoresumed (once per process,
    again after an interrupted fit) and the attempt number its files carry. Shared by every instance of
    one run (a new AutoCheckpoint passed to each fit call is the same run, its files named alike)."""

    def __init__(self):
        self.resumed = False
        self.attempt: int | None = None


class Preemption:
    "While a fit runs in the main thread: SIGTERM only sets `requested` (the fit saves, then exits)."

    def __init__(self):
        self.requested, self._old = False, None

    def install(self) -> None:
        self.requested, self._old = False, None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


class AutoCheckpoint(Callback):
    """Saves a resumable checkpoint every `every_iters` training batches, every `every_seconds`
    and/or after every epoch, into `learn.path/learn.model_dir`, keeping the newest `keep` of this run
    (docs/autocheckpoint.md says each setting in full).

    - Files: `{fname}-{run}-g{attempt}-s{stage}-f{fit}-e{epoch}-i{iter}.frk` (`runfolder`); `run`
      identifies the run (`runfolder.run_identity`), `attempt` counts its starts that did not resume.
      Files of other runs, and any file not named so, are never touched.
    - `background=True`: the batch boundary waits only for what must happen there (a checkpoint of up to
      16 MB written from the live tensors, a bigger one copied), a thread commits it; at most one save is
      in flight. `'auto'` (the default): the way that costs training least, as measured (bench/everystep.py):
      today `True`'s, on every device. `False`: every save is committed at the boundary. A failed save
      raises at the next batch boundary (`on_error='warn'`: a loud warning). A full disk: this run's older
      checkpoints (never the newest valid one) are removed once and the save tried again, said each time.
    - `resume=True`: the first training call of the process (and the next one after an interrupted fit)
      continues from the newest valid checkpoint of this run; a file proven corrupt is named and renamed
      `*.corrupt`, an error that is not the file's fault is raised. `fast_forward=True` allows resuming a
      stream without state by reading and discarding the trained batches.
    - One process per run and folder (`runfolder.RunLock`). `preempt=True`: on SIGTERM the batch finishes,
      a checkpoint is saved and the process exits with `PREEMPTED_EXIT_CODE` (143).
    - Under torch.distributed every rank runs it: a time-based save, a SIGTERM and a failed save are agreed
      by all (one bounded step per batch); rank 0 writes each checkpoint and chooses the one to resume from,
      except that a sharded fit's ranks each write their file (`store`), and where their disks are their
      nodes' own every rank takes part in the choice.
    - `remote='s3://bucket/run/'` (any fsspec URL; `remote_options`): each checkpoint committed here is
      mirrored there by a thread, `keep` holds there too, and a start whose folder lacks a newer checkpoint
      resumes from the remote's (docs/remote.md); the process's end waits up to `remote_wait` seconds.
    """

    order = 100  # after the Recorder and the trackers have updated, before ResumeSession

    def __init__(
        self,
        fname="auto",
        every_iters=None,
        every_seconds=None,
        every_epoch=True,
        keep=3,
        background="auto",
        resume=True,
        preempt=True,
        on_error="raise",
        fast_forward=False,
        remote=None,
        remote_options=None,
        remote_wait=300.0,
    ):
        if keep < 1:
            raise ValueError("AutoCheckpoint(keep=...) must keep at least one checkpoint")
        if background not in (True, False, "auto"):
            raise ValueError("background must be True, False or 'auto'")
        if on_error not in ("raise", "warn"):
            raise ValueError("on_error must be 'raise' or 'warn'")
        if not re.fullmatch(r"[\w.]+", fname) or len(fname) > 64:
            raise ValueError(f"fname {fname!r}: use up to 64 letters, digits, '.', '_'")
        store_attr()  # (fastai's way: every argument an attribute of the same name)
        if remote is not None:
            objstore.filesystem(remote, remote_options)  # a missing package or a malformed URL: said now
        self._no_run_yet()

    def _no_run_yet(self) -> None:
        "The state of a run, before its first stage begins: everything but the settings."
        self.run_id: str | None = None  # this run's identity (hex; fastai's `run` is taken), from its first stage
        self.attempt: int | None = None
        self.files: RunFolder | None = None
        self.saves = Saves(self.on_error)
        self._run: AutosaveRun | None = None
        self._mirror = None  # this run's remote.Mirror (rank 0), once the run is known
        self._preemption = Preemption()
        self._last_time = 0.0

    def __getstate__(self):
        """An exported learner (`learn.export`) keeps the settings, not this run: a learner loaded from it and
        trained by another script starts a run of its own (it would find this run's checkpoints and take them
        for its own). Nor the remote's credentials (`remote_options`): an exported learner is shared; loaded,
        it reads them from the environment, as fsspec does."""
        blank = object.__new__(type(self))
        blank.on_error = self.on_error
        blank._no_run_yet()
        return {**self.__dict__, **blank.__dict__, "remote_options": None}

    @property
    def saved(self) -> list:
        "The checkpoints this process committed, oldest first."
        return self.saves.saved

    @property
    def folder(self) -> Path:
        return paths.model_folder(self.learn)

    def checkpoints(self) -> list:
        "This run's checkpoint files, oldest (attempt, stage, fit, epoch, iteration) first."
        return self.files.checkpoints() if self.files is not None else []

    def latest_valid(self):
        return self.files.latest_valid() if self.files is not None else None

    def arm_resume(self, stage):
        """Called when a training call (a stage) begins: identifies the run, takes its lock, and the first
        time (or after an interrupted fit) loads the newest valid checkpoint of this run (`_resume_point`)."""
        if checking():
            return  # `fastai-resume check` runs: no files of ours, no autoresume
        sc = script(self.learn)
        if self.run_id is None:
            self.run_id = run_identity(self.learn, sc.signatures[0] if sc.signatures else stage.signature)
        if self.files is None:
            self.files = RunFolder(self.folder, self.fname, self.run_id, self.keep)
        self.files.folder = self.folder
        key = (str(self.folder.resolve()), self.fname, self.run_id)
        run = self._run = sc.autosave_runs.setdefault(key, AutosaveRun())
        p = _resume_point(self, run, self.resume and stage.resume and not stage.explicit and not run.resumed)
        self.attempt = self.files.attempt = run.attempt
        stage.saved_in(self.folder, self.files.stem(), auto=True)
        run.resumed = True
        if p is None:
            return
        with dist.fetch_missing(f"AutoCheckpoint: {p.name} on every rank", p) as got:  # node-local: rank 0's
            dist.together(  # one rank failing stops all
                f"AutoCheckpoint: load {p.name}",
                lambda: self.learn.load(got, fast_forward=self.fast_forward),
                f"AutoCheckpoint: {p} could not be loaded ({{failures}}); every rank stops",
            )
        if sc.armed is not None:  # (loaded from a copy, on a node whose folder does not hold it: rank 0's name)
            sc.armed.path = p
        print(f"AutoCheckpoint: found {p.name}")

    # -- events -----------------------------------------------------------------------------
    def before_fit(self):
        self._last_time = time.monotonic()
        if self.preempt:
            self._preemption.install()

    def before_batch(self):
        if self.training:
            self._check_inflight(block=False)

    def after_batch(self):
        if not self.training or session_of(self.learn) is None:
            return
        flags = Agreed.PREEMPTED if self._preemption.requested else Agreed(0)
        if self.every_seconds and dist.rank() == 0 and time.monotonic() - self._last_time >= self.every_seconds:
            flags |= Agreed.TIME_DUE  # rank 0's clock decides for every rank
        if self.saves.failure is not None:
            flags |= Agreed.FAILED
        if self.saves.writing_together():
            flags |= Agreed.WRITING
        if dist.active() and (self.preempt or self.every_seconds or self.background):
            flags = Agreed(dist.agree_any("AutoCheckpoint: the batch's agreement", int(flags)))
        if flags & Agreed.FAILED:
            self.saves.raise_failure()
        if not flags & Agreed.WRITING:  # every rank's file of a sharded save written: its manifest
            self.saves.check_inflight(self.files, block=True, together_only=True)
        if flags & Agreed.PREEMPTED:
            self._check_inflight(block=True)
            path = self._save(background=False)
            print(f"AutoCheckpoint: SIGTERM: saved {path.name}, exiting with status {PREEMPTED_EXIT_CODE}", flush=True)
            self._preemption.restore()
            raise SystemExit(PREEMPTED_EXIT_CODE)
        due = self.every_iters and self.learn.train_iter % self.every_iters == 0
        if due or flags & Agreed.TIME_DUE or self.saves.retry:
            self._save()

    def after_epoch(self):
        if self.every_epoch:  # the fit's last: written now (its end waits for it anyway), so a full disk can retry it
            self._save(background=False if self.epoch == self.n_epoch - 1 else None)

    def after_fit(self):
        self._check_inflight(block=True, last=True)
        self.saves.pool.release()
        self._preemption.restore()
        failed = int(Agreed.FAILED) if self.saves.failure is not None else 0
        if dist.active() and dist.agree_any("AutoCheckpoint: the fit's end", failed):
            self.saves.raise_failure()

    def after_interrupted_fit(self):
        """The fit ended in an exception or an interrupt (fastai runs no `after_fit` then): finish the save
        in flight, put the SIGTERM handler back, and let the next training call resume from the newest
        checkpoint, as a rerun of the script after a crash would."""
        self.saves.abandon_together()  # the other ranks may be gone: no manifest, no collective
        try:
            self._check_inflight(block=True)
        except Exception as e:
            warnings.warn(f"AutoCheckpoint: {e}", stacklevel=2)
        self._preemption.restore()
        if self._run is not None:
            self._run.resumed = False

    # -- saving -----------------------------------------------------------------------------
    def _save(self, background=None):
        "A checkpoint at the current position (`Saves.save`); its path, or None where there is no position."
        self._last_time = time.monotonic()
        s = session_of(self.learn)
        if s is None or self.files is None or checking():
            return None
        return self.saves.save(self.learn, s, self.files, self.background if background is None else background)

    def _check_inflight(self, block, last=False):
        self.saves.check_inflight(self.files, block, last)


class Saves:
    """The saves of one AutoCheckpoint: synchronous, or in the background with at most one in flight
    (copied at the batch boundary into the previous save's buffers, written by a thread with the GIL
    released); retention after each commit; a full disk made room for once, and said; a failure raised
    (under DDP on every rank at the next agreement) or, `on_error='warn'`, warned and printed."""

    def __init__(self, on_error: str):
        self.on_error = on_error
        self.saved: list = []  # paths committed by this process, oldest first
        self.inflight = None  # the save in flight (`store.Pending`)
        self.pool = SnapshotPool()  # background saves copy into the previous save's buffers
        self.failure = None  # under DDP: a failed save of rank 0's, raised on every rank together
        self.retried: list = []  # what a full disk made a background save remove, until a save succeeds
        self.retry = False  # a save is due again at the next batch (after a full disk)
        self.direct = True  # written around the page cache (bench/overhead.py compares False: through it)
        self.mirror = None  # a remote.Mirror each committed checkpoint is handed to

    def __getstate__(self):  # an exported learner keeps the settings, not a fit's machinery
        return {**self.__dict__, "inflight": None, "failure": None, "pool": SnapshotPool(), "mirror": None}

    def save(self, learn, s, files, background):
        with dist.one_answer():
            return self._save(learn, s, files, background)

    def _save(self, learn, s, files, background):
        self.retry = False
        pos = s.position()
        if pos is None:
            return None
        path = files.name(s.stage.index, s.fit_index, *pos)
        done = stored.exists(path) or (self.inflight is not None and self.inflight.path == path)
        if dist.active():
            done = dist.exchange(f"AutoCheckpoint: is {path.name} saved", done)[0]  # rank 0 knows the folder
        if done:
            return path  # already saved here
        self.check_inflight(files, block=True)  # at most one save in flight
        s.saving(path)
        build = lambda: checkpoint.build_tree(learn, with_opt=True, with_iter=True)  # noqa: E731  (DDP: collective)
        if not background:
            return self._now(learn, files, path, build)
        try:
            self.inflight = store.save(
                learn,
                path,
                build,
                background=True,
                pool=self.pool,
                then=functools.partial(files.remove_stale, path.parent),
                direct=self.direct,
            )
        except store.CouldNotStart as e:
            if not dist.active():
                raise e.error from None
            self.fail(
                f"AutoCheckpoint: the save of {path} could not start: {e}. The previous checkpoints are intact.",
                e.error,
            )
            return None
        return path

    def _now(self, learn, files, path, build):
        """A synchronous save (under DDP every rank waits until rank 0 has committed; a sharded model's ranks each
        write their file); a full disk once makes room (one file's)."""
        removed: list = []
        every_rank = dist.sharded(learn.model)
        for attempt in (0, 1):
            try:
                store.save(learn, path, build)
                break
            except Exception as e:
                if not every_rank and not isinstance(e, OSError):
                    raise
                if not every_rank and e.errno == errno.ENOSPC and dist.rank() == 0:
                    freed = files.free_space() if attempt == 0 else []
                    if freed:
                        say(files.disk_full(path, e, freed, "now"))
                        removed = freed
                        continue
                    self.fail(files.disk_still_full(path, e, removed), e)
                    return None
                self.fail(f"AutoCheckpoint: the save of {path} failed: {e}. The previous checkpoints are intact.", e)
                return None
        self.committed(path, files if dist.rank() == 0 or every_rank else None, every_rank)
        return path

    def writing_together(self) -> bool:
        "A sharded save in flight whose file this rank is still writing (its manifest waits for every rank's)."
        return self.inflight is not None and self.inflight.collective and not self.inflight.done

    def check_inflight(self, files, block, last=False, together_only=False):
        """The save in flight, if done (or `block`: once done). `last`: the fit has ended, no batch is left to save
        at. A sharded save's (collective) only where every rank calls it with `block`; `together_only`: only it."""
        p = self.inflight
        if p is None or (together_only and not p.collective) or (not block and (p.collective or not p.done)):
            return
        self.inflight = None
        try:
            p.finish()
        except Exception as e:
            if not p.collective and not isinstance(e, OSError):
                raise
            if not p.collective and e.errno == errno.ENOSPC:
                retried, self.retried = self.retried, []
                freed = [] if retried or last else files.free_space()
                if freed:
                    self.retried, self.retry = freed, True  # the next training batch saves again, once
                    say(files.disk_full(p.path, e, freed, "at the next batch"))
                    return
                self.fail(files.disk_still_full(p.path, e, retried, fit_ended=last), e)
                return
            self.fail(
                f"AutoCheckpoint: background save of {p.path} failed: {e}. The previous checkpoints are intact.", e
            )
            return
        self.retried = []
        if p.collective:
            self.committed(p.path, files, every_rank=True)
            return
        self.committed(p.path)  # its thread has applied the retention (`RunFolder.remove_stale`)
        if p.then_error is not None:
            warnings.warn(
                f"AutoCheckpoint: saved {p.path}, then removing older checkpoints failed: {p.then_error!r}",
                stacklevel=3,
            )
        for msg in p.then_result or ():
            warnings.warn(msg, stacklevel=3)

    def abandon_together(self) -> None:
        "After an interrupted fit: a sharded save in flight waits for this rank's file, and commits no manifest."
        if self.inflight is not None and self.inflight.collective:
            self.inflight.abandon()
            self.inflight = None

    def committed(self, path, files=None, every_rank: bool = False) -> None:
        """`path` is committed: the mirror gets it and, `files` given (rank 0, not the writer thread; or
        `every_rank`, a sharded save, where each node's disk holds its ranks' files), the retention runs (only
        ever after a commit, and at autoresume: the newest `keep` of this run stay)."""
        self.saved.append(path)
        if self.mirror is not None:
            self.mirror.committed(path, every_rank)
        if files is not None:
            _retain(files, every_rank)

    def fail(self, msg, exc):
        "A save failed: raise (now, or under DDP on every rank at the next agreement) or warn and print."
        if self.on_error == "warn":
            return say(msg)
        err = OSError(getattr(exc, "errno", None), msg) if isinstance(exc, OSError) else CheckpointError(msg)
        if not dist.active():
            raise err from exc
        self.failure = err

    def raise_failure(self):
        err, self.failure = self.failure, None
        if err is not None:
            raise err
        raise OSError(
            None, "AutoCheckpoint: rank 0's save failed (its error says why); the previous checkpoints are intact"
        )


def _resume_point(cb: AutoCheckpoint, run: AutosaveRun, wanted: bool) -> Path | None:
    """The checkpoint a stage's start resumes from (None: none, or not `wanted`) and the run's attempt
    (`run.attempt`), the same on every rank. Rank 0 alone touches the folder (the lock, dead temps, the
    remote's lease, the choice) and tells the others, or every rank raises; where a sharded fit's nodes each
    write to a disk of their own, every rank takes part in the choice (`RunFolder.latest_valid_together`). A
    sharded fit's remote: every rank uploads its own files (`remote.Parts`), and every rank downloads what its
    disk lacks of a newer checkpoint there before the choice (`remote.resume_sharded`)."""
    files, learn = cb.files, cb.learn
    assert files is not None
    wanted = wanted and script(learn).armed is None
    together = dist.active() and dist.sharded(learn.model)  # every rank writes a file of each save

    def mirror():
        if cb.remote is not None and cb._mirror is None:  # rank 0: the remote's lease, checked before any training
            cb._mirror = cb.saves.mirror = _remote.mirror_for(
                cb.remote, cb.remote_options, cb.folder, cb.fname, files.run_id, cb.keep, cb.remote_wait
            )

    def open_folder():
        files.lock.take()
        files.remove_dead_temps()
        mirror()

    def in_folder():
        p = choose = None
        if not together or cb.remote is None:
            open_folder()
        if wanted:
            if files.node_local():  # chosen by every rank below, each checking the files its node's disk holds
                choose = [p.name for p in reversed(files.checkpoints())]
            else:
                p = files.latest_valid()
                if cb._mirror is not None and not together:  # a newer one on the remote (a new machine: none here)
                    p = cb._mirror.resume_point(p)
                if p is not None:
                    _retain(files)  # a run killed between a commit and its retention
        if run.attempt is None:
            names = [f.name for f in files.checkpoints()] + (cb._mirror.names() if cb._mirror else [])
            last = max((files.attempt_of(Path(n)) for n in names), default=-1)
            run.attempt = files.attempt_of(p) if p is not None else last + 1
        return p, choose

    files.near = dist.sees_rank0("AutoCheckpoint: the ranks on rank 0's disk", cb.folder) if together else None
    if together and cb.remote is not None:
        dist.together("AutoCheckpoint: its folder and remote", lambda: open_folder() if dist.rank() == 0 else None)
        dist.together("AutoCheckpoint: each rank's uploads", lambda: mirror() if dist.rank() != 0 else None)
        if wanted:
            assert cb._mirror is not None
            _remote.resume_sharded(cb._mirror.run)
    p, choose = dist.together("AutoCheckpoint: its folder", lambda: in_folder() if dist.rank() == 0 else (None, None))
    choose = dist.exchange("AutoCheckpoint: this run's checkpoints", choose)[0] if files.node_local() else None
    if choose is not None:
        p = files.latest_valid_together(choose, mirrored=cb.remote is not None)
        if p is not None:
            run.attempt = files.attempt_of(p)
            _retain(files, every_rank=True)  # a run killed between a commit and its retention
    if dist.active():
        mine = [None if p is None else str(p), run.attempt]
        p, run.attempt = dist.exchange("AutoCheckpoint: the checkpoint to resume from", mine)[0]
        p = None if p is None else Path(p)
    return p


def _retain(files, every_rank: bool = False) -> None:
    if every_rank and files.node_local():
        msgs = files.remove_stale_together()
    elif dist.rank() == 0:
        msgs = files.remove_stale()
    else:
        return
    for msg in msgs:
        warnings.warn(msg, stacklevel=3)


def _arm(learn, stage) -> None:
    "As a stage begins: every AutoCheckpoint of the learner or of the call identifies its run and autoresumes."
    for c in list(learn.cbs) + list(stage.extra_cbs):
        if isinstance(c, AutoCheckpoint):
            c.learn = learn
            c.arm_resume(stage)


STAGE_BEGIN_HOOKS.append(_arm)
