"""`AutoCheckpoint`: periodic, background, retained, auto-resumed checkpoints, and a clean exit on
preemption (SIGTERM). One callback; run the same script again after a crash and it continues.
"""
from __future__ import annotations

import re
import signal
import threading
import time
import warnings
from pathlib import Path

import torch
from fastai.callback.core import Callback

from . import dist, io
from .io import CheckpointError

__all__ = ["AutoCheckpoint", "PREEMPTED_EXIT_CODE", "snapshot"]

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM


def snapshot(tree):
    """A copy of `tree` whose tensors training can no longer change: CPU storages are cloned,
    CUDA storages copied into pinned host memory. Tensors sharing a storage keep sharing it."""
    storages: dict = {}
    cuda = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = (t.device, st.data_ptr())
        new = storages.get(key)
        if new is None:
            if t.device.type == "cpu":
                new = st.clone()
            else:
                new = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
                new.copy_(st, non_blocking=True)
                cuda.append(t.device)
            storages[key] = new
        return torch.empty(0, dtype=t.dtype).set_(new, t.storage_offset(), t.shape, t.stride())

    def walk(v):
        if isinstance(v, torch.Tensor): return copy(v.detach())
        if isinstance(v, dict): return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list): return [walk(x) for x in v]
        if isinstance(v, tuple): return tuple(walk(x) for x in v)
        return v
    out = walk(tree)
    for dev in set(cuda): torch.cuda.synchronize(dev)
    return out


class AutoCheckpoint(Callback):
    """Saves a resumable checkpoint every `every_iters` training batches, every `every_seconds`
    and/or after every epoch, into `learn.path/learn.model_dir`, keeping the newest `keep`.

    - `background=True`: the state is copied at the batch boundary and written by a C thread with
      the GIL released while training goes on; at most one save is in flight, and the fit's end
      waits for it. A failed background save raises at the next batch boundary
      (`on_error='warn'`: a loud warning instead).
    - `resume=True`: the first fit of the process continues from the newest valid checkpoint of
      this `fname` (incomplete or corrupt files are skipped with a warning); with none, training
      starts from the beginning.
    - `preempt=True`: on SIGTERM the current batch finishes, a checkpoint is saved synchronously
      and the process exits with status `PREEMPTED_EXIT_CODE` (143).
    - Under torch.distributed (`distrib_ctx`): every rank runs the callback; rank 0 writes each
      checkpoint (with every rank's RNG, loader and Recorder state), chooses the one to resume
      from and alone removes or renames files; a synchronous save returns on every rank once it is
      committed; a time-based save, a SIGTERM seen by one rank and a failed save are agreed by
      all (one all-reduce of 32 bytes per batch, over gloo) so that every rank saves, or raises,
      at the same batch.
    """
    order = 100  # after the Recorder and the trackers have updated, before ResumeCallback

    def __init__(self, fname="auto", every_iters=None, every_seconds=None, every_epoch=True, keep=3,
                 background=True, resume=True, preempt=True, on_error="raise"):
        if keep < 1: raise ValueError("AutoCheckpoint(keep=...) must keep at least one checkpoint")
        if on_error not in ("raise", "warn"): raise ValueError("on_error must be 'raise' or 'warn'")
        if not re.fullmatch(r"[\w.-]+", fname): raise ValueError(f"fname {fname!r}: use letters, digits, '.', '_', '-'")
        self.fname, self.every_iters, self.every_seconds, self.every_epoch = fname, every_iters, every_seconds, every_epoch
        self.keep, self.background, self.resume, self.preempt, self.on_error = keep, background, resume, preempt, on_error
        self._inflight = None  # (Writer, final path)
        self._failure = None  # under DDP: a failed save of rank 0's, raised on every rank together
        self._resumed_once = False
        self.saved = []  # paths committed by this process, oldest first

    # -- files ------------------------------------------------------------------------------
    @property
    def folder(self) -> Path: return Path(self.learn.path) / self.learn.model_dir

    def _name(self, fit_index, epoch, it) -> Path:
        return self.folder / f"{self.fname}-f{fit_index:03d}-e{epoch:06d}-i{it:010d}{io.EXT}"

    def checkpoints(self):
        "This callback's checkpoint files, oldest position first."
        pat = re.compile(re.escape(self.fname) + r"-f\d{3}-e\d{6}-i\d{10}" + re.escape(io.EXT) + "$")
        if not self.folder.is_dir(): return []
        return sorted(p for p in self.folder.iterdir() if pat.match(p.name))

    def latest_valid(self):
        """The newest checkpoint that verifies. Each newer one that does not is named in a warning
        and renamed to `*.corrupt`, so that retention never counts it as a good checkpoint."""
        for p in reversed(self.checkpoints()):
            try:
                io.info(p, verify=True)
                return p
            except (CheckpointError, OSError) as e:
                warnings.warn(f"AutoCheckpoint: skipping {p}: {e}")
                try: p.rename(p.with_name(p.name + ".corrupt"))
                except OSError: pass
        return None

    def _remove_stale_temps(self):
        "Temporary files of saves that were killed midway are never valid: remove them."
        if not self.folder.is_dir(): return
        for p in self.folder.glob(f".{self.fname}-f*{io.EXT}.tmp.*"):
            try: p.unlink()
            except OSError: pass

    def arm_resume(self):
        "Called by `fit` before it starts: loads the newest valid checkpoint once per process."
        if not self.resume or self._resumed_once: return
        self._resumed_once = True
        p = None
        if dist.rank() == 0:  # under DDP rank 0 alone touches the folder, and tells the others
            self._remove_stale_temps()
            p = self.latest_valid()
            if p is not None: self._retain()  # a run killed between a commit and its retention
        if dist.active():
            p = dist.broadcast(None if p is None else str(p))
            p = None if p is None else Path(p)
        if p is None: return
        err = None
        try: self.learn.load(p)
        except Exception as e: err = e
        if dist.active() and dist.agree_any(1 if err is not None else 0):  # one rank failing stops all
            if err is not None: raise err
            raise CheckpointError(f"AutoCheckpoint: another rank could not load {p}; see its error")
        if err is not None: raise err
        print(f"AutoCheckpoint: found {p.name}")

    # -- events -----------------------------------------------------------------------------
    def before_fit(self):
        self.last_time, self.last_iter = time.monotonic(), None
        self._preempted = False
        self._old_handler = None
        if self.preempt and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame): self._preempted = True

    def before_batch(self):
        if self.training: self._check_inflight(block=False)

    def after_batch(self):
        if not self.training: return
        flags = 1 if self._preempted else 0
        if self.every_seconds and dist.rank() == 0 and time.monotonic() - self.last_time >= self.every_seconds:
            flags |= 2  # rank 0's clock decides for every rank
        if self._failure is not None: flags |= 4
        if dist.active() and (self.preempt or self.every_seconds or self.background):
            flags = dist.agree_any(flags)  # a SIGTERM seen by any rank: every rank saves at this batch
        if flags & 4: self._raise_failure()
        if flags & 1:
            self._check_inflight(block=True)
            path = self._save(background=False)
            print(f"AutoCheckpoint: SIGTERM: saved {path.name}, exiting with status {PREEMPTED_EXIT_CODE}", flush=True)
            self._restore_handler()
            raise SystemExit(PREEMPTED_EXIT_CODE)
        it = self.learn.train_iter
        if self.last_iter is None: self.last_iter = it - 1
        if (self.every_iters and it - self.last_iter >= self.every_iters) or flags & 2: self._save()

    def after_epoch(self):
        if self.every_epoch: self._save()

    def after_fit(self):
        self._check_inflight(block=True)
        self._restore_handler()
        if dist.active() and dist.agree_any(4 if self._failure is not None else 0): self._raise_failure()

    def _fail(self, msg, exc):
        "A save failed: raise (now, or under DDP on every rank at the next agreement) or warn."
        if self.on_error == "warn": return warnings.warn(msg)
        err = OSError(getattr(exc, "errno", None), msg) if isinstance(exc, OSError) else CheckpointError(msg)
        if not dist.active(): raise err from exc
        self._failure = err

    def _raise_failure(self):
        err, self._failure = self._failure, None
        if err is not None: raise err
        raise OSError(None, "AutoCheckpoint: rank 0's save failed (its error says why); the previous "
                            "checkpoints are intact")

    def _restore_handler(self):
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    # -- saving -----------------------------------------------------------------------------
    def _save(self, background=None):
        background = self.background if background is None else background
        learn = self.learn
        ctl = getattr(learn, "_frk_ctl", None)
        self.last_time, self.last_iter = time.monotonic(), learn.train_iter
        pos = ctl.position() if ctl is not None else None
        if pos is None: return None
        path = self._name(ctl.fit_index, *pos)
        done = path.exists() or (self._inflight is not None and self._inflight[1] == path)
        if dist.active(): done = dist.broadcast(done)  # rank 0 knows the folder; all must agree
        if done: return path  # already saved here
        self._check_inflight(block=True)  # at most one save in flight
        from .learner import checkpoint_tree, commit
        if not background:  # under DDP: every rank waits until rank 0 has committed
            commit(lambda: checkpoint_tree(learn, with_opt=True, with_iter=True), path)
            if dist.rank() == 0: self._committed(path)
            return path
        tree = checkpoint_tree(learn, with_opt=True, with_iter=True)  # under DDP: collective
        if tree is None: return path  # not rank 0: nothing to write
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            w = io.encode(snapshot(tree))
            w.commit_async(str(path))
        except (OSError, TypeError, ValueError, RuntimeError) as e:
            if not dist.active(): raise
            self._fail(f"AutoCheckpoint: the save of {path} could not start: {e}. The previous checkpoints "
                       "are intact.", e)
            return None
        self._inflight = (w, path)
        return path

    def _check_inflight(self, block):
        if self._inflight is None: return
        w, path = self._inflight
        if not block and not w.done: return
        self._inflight = None
        try:
            w.wait()
        except OSError as e:
            self._fail(f"AutoCheckpoint: background save of {path} failed: {e}. The previous checkpoints are "
                       "intact.", e)
            return
        self._committed(path)

    def _committed(self, path):
        "Retention, only ever after a commit (and at autoresume): the newest `keep` stay."
        self.saved.append(path)
        self._retain()

    def _retain(self):
        for old in self.checkpoints()[:-self.keep]:
            try: old.unlink()
            except OSError as e: warnings.warn(f"AutoCheckpoint: could not remove {old}: {e}")
