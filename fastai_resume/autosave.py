"""`AutoCheckpoint`: periodic, background, retained, auto-resumed checkpoints, and a clean exit on
preemption (SIGTERM). One callback; run the same script again after a crash and it continues.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import functools
import hashlib
import os
import re
import signal
import threading
import time
import warnings
from pathlib import Path

from fastai.callback.core import Callback

from . import check, checkpoint, dist, io, paths, sharded
from .io import CheckpointError
from .session import script, session_of
from .snapshot import BackgroundCommit, SnapshotPool

__all__ = ["AutoCheckpoint", "PREEMPTED_EXIT_CODE"]

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM
_ENOSPC = os.strerror(errno.ENOSPC)  # the words a user may search a log for


class AutoCheckpoint(Callback):
    """Saves a resumable checkpoint every `every_iters` training batches, every `every_seconds`
    and/or after every epoch, into `learn.path/learn.model_dir`, keeping the newest `keep` of this run.

    - Files: `{fname}-{run}-g{attempt}-s{stage}-f{fit}-e{epoch}-i{iter}.frk`. `run` identifies the run
      (a hash of the model's structure, the loaders' shape, the world size and the first stage's call:
      another model, another learning rate, another data size is another run); `attempt` counts the
      starts of this run that did not resume (`resume=False`, an explicit `start_epoch`, no valid file);
      names sort by (attempt, stage, fit, epoch, iteration), the order retention and autoresume use.
      Files of other runs, and any file not named so, are never touched.
    - `every_iters=N`: after every training batch whose `train_iter` (batches trained in this fit) is a
      multiple of N, whatever the epoch-end saves do.
    - `background=True`: the state is copied at the batch boundary (into the previous save's
      buffers) and written by a thread with the GIL released while training goes on; at most one
      save is in flight (a save due while one is still writing waits for it), and the fit's end
      waits for it. A failed save raises at the next
      batch boundary (`on_error='warn'`: a loud warning instead, for background and synchronous saves).
      A save that finds the disk full removes this run's older checkpoints (never the newest valid
      one) and tries again once; each time it says so, in a warning and a printed line (the folder,
      the room the checkpoint needs, what was removed). When nothing is left to remove, the error
      says what to do.
    - `resume=True`: the first training call of the process (and the next one after an interrupted
      fit) continues from the newest valid checkpoint of this run; a file proven corrupt is named in a
      warning and renamed `*.corrupt`; an error that is not the file's fault (too many open files,
      no memory) is raised, never taken for corruption. `fast_forward=True` allows resuming a stream
      without state by reading and discarding the trained batches.
    - One process per run and folder: a lock file (`.{fname}-{run}.lock`) is held while it trains; a
      second launch of the same script on the same folder is refused with a message.
    - `preempt=True`: on SIGTERM the current batch finishes, a checkpoint is saved synchronously
      and the process exits with status `PREEMPTED_EXIT_CODE` (143).
    - Under torch.distributed (`distrib_ctx`): every rank runs the callback; rank 0 writes each
      checkpoint (with every rank's RNG, loader and Recorder state), chooses the one to resume
      from and alone removes or renames files; a time-based save, a SIGTERM seen by one rank and a
      failed save are agreed by all (one all-reduce of 32 bytes per batch, over gloo).
    """

    order = 100  # after the Recorder and the trackers have updated, before ResumeSession

    def __init__(
        self,
        fname="auto",
        every_iters=None,
        every_seconds=None,
        every_epoch=True,
        keep=3,
        background=True,
        resume=True,
        preempt=True,
        on_error="raise",
        fast_forward=False,
    ):
        if keep < 1:
            raise ValueError("AutoCheckpoint(keep=...) must keep at least one checkpoint")
        if on_error not in ("raise", "warn"):
            raise ValueError("on_error must be 'raise' or 'warn'")
        if not re.fullmatch(r"[\w.]+", fname) or len(fname) > 64:
            raise ValueError(f"fname {fname!r}: use up to 64 letters, digits, '.', '_'")
        self.fname, self.every_iters, self.every_seconds, self.every_epoch = (
            fname,
            every_iters,
            every_seconds,
            every_epoch,
        )
        self.keep, self.background, self.resume, self.preempt, self.on_error = (
            keep,
            background,
            resume,
            preempt,
            on_error,
        )
        self.fast_forward = fast_forward
        self._inflight = None  # (BackgroundCommit, final path)
        self._pool = SnapshotPool()  # background saves copy into the previous save's buffers
        self._failure = None  # under DDP: a failed save of rank 0's, raised on every rank together
        self._retried = []  # what a full disk made a background save remove, until a save succeeds
        self._run = None  # this run's AutosaveRun, shared with every other instance of the same run
        self._lock = None  # the open lock file of this run
        self._old_handler = None
        self.run_id = None  # this run's identity (hex), set when its first stage begins (fastai's `run` is taken)
        self.attempt = None
        self.saved = []  # paths committed by this process, oldest first

    def __getstate__(self):  # an exported learner keeps the settings, not a fit's machinery
        d = dict(self.__dict__)
        for k in ("_inflight", "_lock", "_old_handler", "_failure", "_run"):
            d[k] = None
        d["_pool"] = SnapshotPool()  # buffers (and their lock) belong to this process's fit
        return d

    # -- files ------------------------------------------------------------------------------
    @property
    def folder(self) -> Path:
        return paths.model_folder(self.learn)

    def _name(self, stage, fit_index, epoch, it) -> Path:
        return self.folder / (
            f"{self.fname}-{self.run_id}-g{self.attempt:03d}-s{stage:03d}-f{fit_index:02d}"
            f"-e{epoch:06d}-i{it:010d}{io.EXT}"
        )

    def _pattern(self):
        return re.compile(
            re.escape(f"{self.fname}-{self.run_id}-")
            + r"g(\d{3})-s\d{3}-f\d{2}-e\d{6}-i\d{10}"
            + re.escape(io.EXT)
            + "$"
        )

    def checkpoints(self):
        "This run's checkpoint files, oldest (attempt, stage, fit, epoch, iteration) first."
        return self._files(self.folder)

    def _files(self, folder: Path) -> list:
        if self.run_id is None or not folder.is_dir():
            return []
        pat = self._pattern()
        return sorted(p for p in folder.iterdir() if pat.match(p.name))

    def latest_valid(self):
        """The newest checkpoint of this run that verifies. Each newer one proven corrupt (bad magic,
        structure or checksum) is named in a warning and renamed to `*.corrupt`, so that retention never
        counts it; any other error (EMFILE, ENOMEM, EACCES ...) is raised: the file may be fine."""
        for p in reversed(self.checkpoints()):
            try:
                sharded.verify(p)  # a file, or a sharded checkpoint's folder: the manifest and every shard
                return p
            except CheckpointError as e:
                warnings.warn(f"AutoCheckpoint: skipping {p}: {e}", stacklevel=2)
                try:
                    p.rename(p.with_name(p.name + ".corrupt"))
                except OSError:
                    pass
            except FileNotFoundError:
                continue
        return None

    def _run_identity(self, stage) -> str:
        learn, sc = self.learn, script(self.learn)
        first = sc.signatures[0] if sc.signatures else stage.signature
        from fastai.torch_core import get_model

        sd = get_model(learn.model).state_dict()
        from .loaders import batch_size

        parts = [f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sd.items() if hasattr(v, "shape")]
        parts += [
            f"world {dist.world()}",
            f"train {len(dist.unwrap_dl(learn.dls.train))}x{batch_size(learn.dls.train)}",
            f"first {first['method']} {sorted(first['args'].items())} {first['trainable']}",
        ]
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:10]

    def _take_lock(self):
        if self._lock is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f".{self.fname}-{self.run_id}.lock"
        for _ in range(10):
            f = open(path, "a+")
            try:  # a POSIX record lock: the process's own (DataLoader workers forked from it do not hold it)
                fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise RuntimeError(
                    f"AutoCheckpoint: {holder} is already training this run into {self.folder} (lock "
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
        self._lock = (f, path)
        atexit.register(self._release_lock)  # the script has ended: no lock file is left behind

    def _release_lock(self):
        if self._lock is not None:
            f, path = self._lock
            self._lock = None
            try:  # unlinked while still held: nobody can take the old file in between
                os.unlink(path)
            except OSError:
                pass
            f.close()

    def _remove_dead_temps(self):
        "Temporary files of this run's saves whose process is gone (killed mid-save): never valid."
        pat = self._pattern()
        checkpoint.remove_dead_temps(self.folder, lambda name: bool(pat.match(name)))
        sharded.remove_unfinished(self.folder, lambda name: bool(pat.match(name)))  # folders without a manifest

    def arm_resume(self, stage):
        """Called when a training call (a stage) begins: identifies the run, takes its lock, and the first
        time (or after an interrupted fit) loads the newest valid checkpoint of this run."""
        if os.environ.get(check.ENV):
            return  # `fastai-resume check` runs: no files of ours, no autoresume
        if self.run_id is None:
            self.run_id = self._run_identity(stage)
        run = self._run = script(self.learn).autosave_run((str(self.folder.resolve()), self.fname, self.run_id))
        p = None
        if dist.rank() == 0:  # under DDP rank 0 alone touches the folder, and tells the others
            self._take_lock()
            self._remove_dead_temps()
            if (
                self.resume
                and stage.resume
                and not stage.explicit
                and not run.resumed
                and script(self.learn).armed is None
            ):
                p = self.latest_valid()
                if p is not None:
                    self._retain()  # a run killed between a commit and its retention
            if run.attempt is None:
                files = self.checkpoints()
                last = int(self._pattern().match(files[-1].name)[1]) if files else -1
                run.attempt = int(self._pattern().match(p.name)[1]) if p is not None else last + 1
        if dist.active():
            p, run.attempt = dist.broadcast((None if p is None else str(p), run.attempt))
            p = None if p is None else Path(p)
        self.attempt = run.attempt
        stage.saved_in(self.folder, f"{self.fname}-{self.run_id}-g{self.attempt:03d}", auto=True)
        run.resumed = True
        if p is None:
            return
        err = None
        try:
            self.learn.load(p, fast_forward=self.fast_forward)
        except Exception as e:
            err = e
        if dist.active() and dist.agree_any(1 if err is not None else 0):  # one rank failing stops all
            if err is not None:
                raise err
            raise CheckpointError(f"AutoCheckpoint: another rank could not load {p}; see its error")
        if err is not None:
            raise err
        print(f"AutoCheckpoint: found {p.name}")

    # -- events -----------------------------------------------------------------------------
    def before_fit(self):
        self.last_time = time.monotonic()
        self._preempted = False
        self._old_handler = None
        if self.preempt and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self._preempted = True

    def before_batch(self):
        if self.training:
            self._check_inflight(block=False)

    def after_batch(self):
        if not self.training or session_of(self.learn) is None:
            return
        flags = 1 if self._preempted else 0
        if self.every_seconds and dist.rank() == 0 and time.monotonic() - self.last_time >= self.every_seconds:
            flags |= 2  # rank 0's clock decides for every rank
        if self._failure is not None:
            flags |= 4
        flags |= sharded.writing(self)  # 8: this rank's file of a sharded save in flight is still being written
        if dist.active() and (self.preempt or self.every_seconds or self.background):
            flags = dist.agree_any(flags)  # a SIGTERM seen by any rank: every rank saves at this batch
        if flags & 4:
            self._raise_failure()
        sharded.after_agreement(self, flags)  # every rank's file written: the manifest
        if flags & 1:
            self._check_inflight(block=True)
            path = self._save(background=False)
            print(f"AutoCheckpoint: SIGTERM: saved {path.name}, exiting with status {PREEMPTED_EXIT_CODE}", flush=True)
            self._restore_handler()
            raise SystemExit(PREEMPTED_EXIT_CODE)
        due = self.every_iters and self.learn.train_iter % self.every_iters == 0
        if due or flags & 2 or getattr(self, "_retry", False):
            self._save()

    def after_epoch(self):
        if self.every_epoch:  # the fit's last: written now (its end waits for it anyway), so a full disk can retry it
            self._save(background=False if self.epoch == self.n_epoch - 1 else None)

    def after_fit(self):
        self._check_inflight(block=True, last=True)
        self._pool.release()
        self._restore_handler()
        if dist.active() and dist.agree_any(4 if self._failure is not None else 0):
            self._raise_failure()

    def after_interrupted_fit(self):
        """The fit ended in an exception or an interrupt (fastai runs no `after_fit` then): finish the save
        in flight, put the SIGTERM handler back, and let the next training call resume from the newest
        checkpoint, as a rerun of the script after a crash would."""
        sharded.abandon(self)  # the other ranks may be gone: no manifest, no collective
        try:
            self._check_inflight(block=True)
        except Exception as e:
            warnings.warn(f"AutoCheckpoint: {e}", stacklevel=2)
        self._restore_handler()
        if self._run is not None:
            self._run.resumed = False

    def _fail(self, msg, exc):
        "A save failed: raise (now, or under DDP on every rank at the next agreement) or warn and print."
        if self.on_error == "warn":
            return self._say(msg)
        err = OSError(getattr(exc, "errno", None), msg) if isinstance(exc, OSError) else CheckpointError(msg)
        if not dist.active():
            raise err from exc
        self._failure = err

    def _raise_failure(self):
        err, self._failure = self._failure, None
        if err is not None:
            raise err
        raise OSError(
            None, "AutoCheckpoint: rank 0's save failed (its error says why); the previous checkpoints are intact"
        )

    @staticmethod
    def _say(msg):
        "What the operator must hear even where warnings are filtered out: a warning and a printed line."
        warnings.warn(msg, stacklevel=3)
        print(msg, flush=True)

    def _restore_handler(self):
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    # -- saving -----------------------------------------------------------------------------
    def _free_space(self) -> list:
        "After ENOSPC: remove this run's checkpoints but the newest valid one. Returns [(path, bytes)] removed."
        newest = self.latest_valid() if dist.rank() == 0 else None
        removed = []
        for old in self.checkpoints():
            if old == newest:
                continue
            try:
                size = sharded.size(old)
                sharded.remove(old)
                removed.append((old, size))
            except OSError:
                pass
        return removed

    def _disk_full(self, path, e, removed, then) -> str:
        "The notice of a full disk that removing `removed` made room on; the save is tried again `then`."
        names = ", ".join(p.name for p, _ in removed)
        return (
            f"AutoCheckpoint: the disk is full ({_ENOSPC}): {path.name} needs {_room(e)} in {path.parent}; "
            f"removed this run's older checkpoint{'s' if len(removed) > 1 else ''} {names} "
            f"({sum(n for _, n in removed):,} bytes) to make room, and saves again {then}"
        )

    def _disk_still_full(self, path, e, removed, fit_ended=False) -> str:
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

    def _save(self, background=None):
        background = self.background if background is None else background
        learn = self.learn
        s = session_of(learn)
        self.last_time = time.monotonic()
        self._retry = False
        pos = s.position() if s is not None else None
        if pos is None or self.run_id is None or os.environ.get(check.ENV):
            return None
        path = self._name(s.stage.index, s.fit_index, *pos)
        done = sharded.exists(path) or (self._inflight is not None and self._inflight[1] == path)
        if dist.active():
            done = dist.broadcast(done)  # rank 0 knows the folder; all must agree
        if done:
            return path  # already saved here
        self._check_inflight(block=True)  # at most one save in flight
        if dist.sharded(learn.model):  # every rank writes its own file, a manifest last
            return sharded.autosave(self, path, background)
        if not background:  # under DDP: every rank waits until rank 0 has committed
            removed: list = []
            for attempt in (0, 1):
                try:
                    checkpoint.commit(lambda: checkpoint.build_tree(learn, with_opt=True, with_iter=True), path)
                    break
                except OSError as e:
                    if e.errno == errno.ENOSPC and dist.rank() == 0:
                        freed = self._free_space() if attempt == 0 else []
                        if freed:
                            self._say(self._disk_full(path, e, freed, "now"))
                            removed = freed
                            continue
                        self._fail(self._disk_still_full(path, e, removed), e)
                        return None
                    self._fail(
                        f"AutoCheckpoint: the save of {path} failed: {e}. The previous checkpoints are intact.", e
                    )
                    return None
            if dist.rank() == 0:
                self._committed(path)
            return path
        tree = checkpoint.build_tree(learn, with_opt=True, with_iter=True)  # under DDP: collective
        if tree is None:
            return path  # not rank 0: nothing to write
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            w = BackgroundCommit(tree, path, self._pool, then=functools.partial(self._remove_stale, path.parent))
        except (OSError, TypeError, ValueError, RuntimeError) as e:
            if not dist.active():
                raise
            self._fail(
                f"AutoCheckpoint: the save of {path} could not start: {e}. The previous checkpoints are intact.", e
            )
            return None
        self._inflight = (w, path)
        return path

    def _check_inflight(self, block, last=False):
        "The save in flight, if done (or `block`: once done). `last`: the fit has ended, no batch is left to save at."
        if self._inflight is None:
            return
        if sharded.is_inflight(self._inflight):
            return sharded.check_inflight(self, block, last)
        w, path = self._inflight
        if not block and not w.done:
            return
        self._inflight = None
        try:
            w.wait()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                retried, self._retried = self._retried, []
                freed = [] if retried or last else self._free_space()
                if freed:
                    self._retried, self._retry = freed, True  # the next training batch saves again, once
                    self._say(self._disk_full(path, e, freed, "at the next batch"))
                    return
                self._fail(self._disk_still_full(path, e, retried, fit_ended=last), e)
                return
            self._fail(
                f"AutoCheckpoint: background save of {path} failed: {e}. The previous checkpoints are intact.", e
            )
            return
        self._retried = []
        self.saved.append(path)  # its thread has applied the retention (`_remove_stale`)
        if w.then_error is not None:
            msg = f"AutoCheckpoint: saved {path}, then removing older checkpoints failed: {w.then_error!r}"
            warnings.warn(msg, stacklevel=2)
        for msg in w.then_result or ():
            warnings.warn(msg, stacklevel=2)

    def _committed(self, path):
        "Retention, only ever after a commit (and at autoresume): the newest `keep` of this run stay."
        self.saved.append(path)
        self._retain()

    def _retain(self):
        for msg in self._remove_stale():
            warnings.warn(msg, stacklevel=2)

    def _remove_stale(self, folder: Path | None = None) -> list:
        """Removes this run's checkpoints in `folder` (default: `self.folder`) but the newest `keep`;
        returns what could not be removed, as warnings to give. A background save runs it in its writer
        thread after its commit, with the folder it wrote to: unlinking a big file costs tens of
        milliseconds, which training need not wait for."""
        folder = self.folder if folder is None else folder
        try:
            stale = self._files(folder)[: -self.keep]
        except OSError as e:
            return [f"AutoCheckpoint: could not list {folder} to remove old checkpoints: {e}"]
        failed = []
        for old in stale + self._stale_ends(folder, stale):
            try:
                sharded.remove(old)  # (a file, or a sharded checkpoint's folder)
            except OSError as e:
                failed.append(f"AutoCheckpoint: could not remove {old}: {e}")
        return failed

    def _stale_ends(self, folder: Path, removed: list) -> list:
        """This run's stage-end files (`between`) of attempts none of whose checkpoints is kept: no checkpoint
        that will be resumed names them. Those of the current attempt stay while it runs."""
        end = re.compile(re.escape(f"{self.fname}-{self.run_id}-") + r"g(\d{3})-s\d{3}-end" + re.escape(io.EXT) + "$")
        pat, gone = self._pattern(), set(removed)
        kept = {pat.match(p.name)[1] for p in self._files(folder) if p not in gone}
        if self.attempt is not None:
            kept.add(f"{self.attempt:03d}")
        return sorted(p for p in folder.iterdir() if (m := end.match(p.name)) and m[1] not in kept)


def _room(e: OSError) -> str:
    "The room a save that found the disk full needs, and what was free (`io.DiskFullError`)."
    if not isinstance(e, io.DiskFullError):
        return "more room than is free"
    free = "" if e.free is None else f" ({e.free:,} free)"
    return f"{e.needed:,} bytes{free}"
