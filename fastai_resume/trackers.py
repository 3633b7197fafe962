"""Experiment trackers continue the same run after a resume.

fastai's `TensorBoardCallback` and `WandbCallback` log each batch at a step they count themselves
from the start of the process: after a resume they would start a new TensorBoard log dir (fastai's
default `log_dir` is named after the clock), log the steps between the checkpoint and the crash a
second time, or start W&B's step count at 0. Their state here is what makes the resumed process log
at the steps, in the places, the uninterrupted run would have used.

Each kind has `state(cb) -> tree or None`, called when a checkpoint is taken (`save(with_iter=True)`),
and `load(cb, tree)`, called when a resumed fit starts, after the callbacks' own `before_fit` (the
writer / W&B run they open there is what `load` continues). `HANDLERS` lists them as
`(predicate, state, load)` for the callback-state registry (`callbacks`).
"""

from __future__ import annotations

import glob
import os
import warnings

from .fastai_classes import is_a
from .io import CheckpointError

__all__ = ["HANDLERS", "tensorboard_state", "load_tensorboard", "wandb_state", "load_wandb"]


def _checked(tree, fields: dict, what: str) -> dict:
    "`tree` if it is a dict with these fields of these types (it comes from a file), else CheckpointError."
    bad = [
        k
        for k, types in fields.items()
        if not isinstance(tree, dict) or not isinstance(tree.get(k), types) or isinstance(tree.get(k), bool)
    ]
    if bad:
        raise CheckpointError(f"callback state {what}: {', '.join(bad)} missing or of the wrong type")
    return tree


# ---- TensorBoard ----------------------------------------------------------------------------


def tensorboard_state(cb) -> dict | None:
    """The log dir and the step of the checkpoint. Flushes the writer first: every event logged
    before the checkpoint is then on disk, so a crash after it loses no step that a resume will
    not log again."""
    writer = getattr(cb, "writer", None)
    if not getattr(cb, "run", False) or writer is None:
        return None
    writer.flush()
    return {"log_dir": os.path.abspath(writer.log_dir), "step": int(cb.learn.train_iter)}


def load_tensorboard(cb, tree: dict) -> None:
    """Reopen the writer in the checkpoint's log dir (unless the user named a `log_dir`: theirs is
    kept) with `purge_step` one past the checkpoint's step: TensorBoard then hides what the crashed
    process logged after its checkpoint, which this process logs again. The fresh log dir fastai's
    `before_fit` just opened under its default name is removed if nothing else is in it. A saved
    log dir that holds no TensorBoard events (moved, deleted) is not recreated: a warning says so."""
    from torch.utils.tensorboard import SummaryWriter

    if not getattr(cb, "run", False):
        return
    tree = _checked(tree, {"log_dir": (str,), "step": (int,)}, "TensorBoardCallback")
    old = getattr(cb, "writer", None)
    if old is None:
        raise RuntimeError("fastai_resume.trackers.load_tensorboard must run after TensorBoardCallback.before_fit")
    log_dir = tree["log_dir"] if cb.log_dir is None else old.log_dir
    if not glob.glob(os.path.join(glob.escape(str(log_dir)), "events.out.tfevents.*")):
        warnings.warn(
            f"fastai_resume: the checkpoint's TensorBoard log dir {log_dir} holds no events (moved or "
            f"deleted?); the resumed run logs to {old.log_dir}, at the uninterrupted run's steps",
            stacklevel=2,
        )
        return
    fresh = getattr(getattr(getattr(old, "file_writer", None), "event_writer", None), "_file_name", None)
    old.close()
    if cb.log_dir is None and fresh is not None:
        # the event file this process's before_fit just opened: the run goes on in the saved dir. (A
        # rerun that starts in the same second as the crashed run did gets the same default name,
        # and its file would sit beside the crashed run's as a third one.)
        os.remove(fresh)
        if os.path.abspath(old.log_dir) != os.path.abspath(log_dir):
            try:
                os.rmdir(old.log_dir)
            except OSError:
                pass  # not empty: something else of the user's is in it
    cb.writer = SummaryWriter(log_dir=log_dir, purge_step=tree["step"] + 1)


# ---- Weights & Biases -----------------------------------------------------------------------


def wandb_state(cb) -> dict | None:
    """fastai's W&B step and epoch counters, and the run they log to. (W&B's service writes an
    offline run's file every 15 s, `wandb.Settings(x_transaction_log_flush_interval=...)`, and has
    no call to flush it now: a SIGKILL loses what was logged since, before the checkpoint too.)"""
    if not getattr(cb, "run", False) or not hasattr(cb, "_wandb_step"):
        return None
    import wandb

    run = wandb.run
    return {"step": int(cb._wandb_step), "epoch": float(cb._wandb_epoch), "run_id": run.id if run is not None else None}


def load_wandb(cb, tree: dict) -> None:
    """Continue fastai's W&B step and epoch counters where the checkpoint left them (fastai's
    `before_fit` restarts them from the run's own step, 0 in a new or offline-resumed run). Warns
    when this process logs to another W&B run than the checkpoint's: the history is then split."""
    if not getattr(cb, "run", False):
        return
    import wandb

    tree = _checked(tree, {"step": (int,), "epoch": (float, int), "run_id": (str, type(None))}, "WandbCallback")
    cb._wandb_step, cb._wandb_epoch = tree["step"], tree["epoch"]
    run_id = wandb.run.id if wandb.run is not None else None
    if tree["run_id"] is not None and run_id != tree["run_id"]:
        warnings.warn(
            f"fastai_resume: this checkpoint was logging to W&B run {tree['run_id']!r}, and this process logs to "
            f"{run_id!r}: the resumed steps go to another run. To continue the same run, start it with "
            f"wandb.init(id={tree['run_id']!r}, resume='allow', ...).",
            stacklevel=2,
        )


HANDLERS = [
    (lambda cb: is_a(cb, "fastai.callback.tensorboard", "TensorBoardCallback"), tensorboard_state, load_tensorboard),
    (lambda cb: is_a(cb, "fastai.callback.wandb", "WandbCallback"), wandb_state, load_wandb),
]
