"""The stages of a training script.

A script is a sequence of *stages*: its top-level training calls (`fit`, `fit_one_cycle`,
`fit_flat_cos`, `fit_sgdr`, `fine_tune`; `lr_find` and fits inside a fit do not count), each of one or
more fits (`fine_tune` runs two). A checkpoint's position is (stage, fit, epoch, iteration), plus the
signature of every stage so far (`Stage.signature`), so a rerun of the same script skips finished stages
without training (`between` restores the state each ended with), continues the saved one at its
iteration, and refuses a changed script.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from . import between, dist, frozen, state
from .io import CheckpointError
from .script import STAGE_BEGIN_HOOKS, Script, script

__all__ = ["Stage", "stage_call"]


def _arg_repr(v) -> str:
    if isinstance(v, np.ndarray):
        return np.array2string(v, threshold=sys.maxsize, floatmode="unique")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_arg_repr(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_arg_repr(x)}" for k, x in sorted(v.items())) + "}"
    return repr(v)


_NOT_SIGNATURE = ("self", "cbs", "start_epoch", "start_iter", "resume")


def _trainable(learn) -> str:
    ps = list(learn.model.parameters())
    return f"{sum(p.requires_grad for p in ps)}/{len(ps)} parameter tensors trainable"


class Stage:
    "One top-level training call of the script, the `index`-th."

    def __init__(
        self, learn, index: int, method: str, bound: inspect.BoundArguments, start_epoch=0, start_iter=None, resume=True
    ):
        self.learn, self.index, self.method = learn, index, method
        args = {k: v for k, v in bound.arguments.items() if k not in _NOT_SIGNATURE}
        if isinstance(args.get("kwargs"), dict):
            args["kwargs"] = {k: v for k, v in args["kwargs"].items() if k not in _NOT_SIGNATURE}
        self.signature: dict = {
            "method": method,
            "args": {k: _arg_repr(v) for k, v in args.items()},
            "trainable": _trainable(learn),
        }
        self.start_epoch, self.start_iter, self.resume = start_epoch, start_iter, resume
        self.fits = 0  # fits started in this stage
        self.extra_cbs: list = []  # the call's own callbacks (`cbs=`), which may hold an AutoCheckpoint
        self.skip_all = False  # finished before the armed checkpoint was saved
        self.rng_start = state.rng_state()
        self.rows: list = []  # the printed row of every epoch of its fits
        self.stems: list = []  # (folder, stem) of the resumable checkpoints saved in it: AutoCheckpoint's first

    def end_stem(self):
        "Where this stage's end state goes (`between`): next to its resumable checkpoints, or None (none saved)."
        return self.stems[0] if self.stems else None

    def saved_in(self, folder, stem: str, auto: bool = False) -> None:
        "A resumable checkpoint named `stem` is saved in `folder` during this stage."
        if (folder, stem) not in self.stems:
            self.stems.insert(0, (folder, stem)) if auto else self.stems.append((folder, stem))

    @property
    def explicit(self) -> bool:
        return bool(self.start_epoch) or self.start_iter is not None

    def begin(self, sc: Script) -> None:
        "Autoresume, then check the armed checkpoint against this stage: skip it, resume in it, or refuse."
        for hook in STAGE_BEGIN_HOOKS:  # `fastai-resume check`'s resumed run, AutoCheckpoint's autoresume
            hook(self.learn, self)
        if sc.interrupted is not None and sc.armed is None and self.index == sc.interrupted.stage:
            i = sc.interrupted
            print(
                f"fastai_resume: the previous attempt at stage {i.stage} was interrupted at epoch {i.epoch}, "
                f"iteration {i.iter}; this fit starts the stage again from the model's current (partly trained) "
                "weights, which is not an exact continuation. To continue exactly, learn.load a checkpoint saved "
                "before the interruption (AutoCheckpoint does this by itself)."
            )
        sc.interrupted = None
        if dist.active():
            _same_resume_on_every_rank(self.learn, sc, self.index)
        a = sc.armed if self.resume else None
        if a is None or self.explicit:
            return
        pos, saved_stages = a.position, a.train["stages"]
        if self.index > pos["stage"]:
            raise ValueError(
                f"the checkpoint {a.path} was saved in stage {pos['stage']} ({saved_stages[-1]['method']}) of its "
                f"script, but this process has already finished {self.index} stage(s): load it before stage "
                f"{pos['stage']} runs (at the top of the script), or pass start_epoch/start_iter to apply it to this "
                "call anyway, or resume=False to start over."
            )
        want, now = saved_stages[self.index], self.signature
        diffs = [f"{k} {want[k]} -> {now[k]}" for k in ("method", "trainable") if want[k] != now[k]]
        diffs += [
            f"{k} {want['args'].get(k, '(none)')} -> {now['args'].get(k, '(none)')}"
            for k in sorted(set(want["args"]) | set(now["args"]))
            if want["args"].get(k) != now["args"].get(k)
        ]
        if diffs:
            raise ValueError(
                f"stage {self.index} of this script differs from stage {self.index} of the script that saved {a.path} "
                f"({'; '.join(diffs)}), so resuming would not give the uninterrupted run's result. Run the script "
                "as it was, or pass start_epoch/start_iter to resume anyway, or resume=False to start over."
            )
        if self.index < pos["stage"]:
            self.skip_all = True
            print(
                f"fastai_resume: skipping stage {self.index} ({self.method}), finished before {a.path.name} was saved"
            )
        else:
            state.set_rng_state(a.train["rng_stage"])  # where the uninterrupted run was when this stage began


def _identity(learn, a) -> str:
    """What tells one checkpoint from another, from what its load read: its position and, of a file rank 0
    wrote for every rank, its saved torch RNG (a sharded checkpoint's ranks each read their own RNG)."""
    raw = b""
    if not dist.sharded(learn.model):
        rng = a.train["rng"]["torch"]
        raw = rng.numpy().tobytes() if hasattr(rng, "numpy") else np.asarray(rng).tobytes()
    return hashlib.sha256(json.dumps(a.position, sort_keys=True).encode() + raw).hexdigest()[:16]


def _same_resume_on_every_rank(learn, sc: Script, index: int) -> None:
    """Under torch.distributed every rank resumes from the same checkpoint, or none does. On nodes with
    disks of their own, the checkpoint rank 0 wrote is on rank 0's node only: a script loads it where
    `os.path.exists` finds it and skips the load elsewhere. The lowest rank armed serves its file to the
    ranks that are not, which load it as their own `learn.load` would have; ranks armed from different
    checkpoints refuse together, naming them."""
    a = sc.armed
    mine = None if a is None else [str(a.path), _identity(learn, a), a.fast_forward]
    rows = dist.exchange(f"stage {index}: the checkpoint every rank resumes from", mine)
    armed = [r for r, row in enumerate(rows) if row is not None]
    if not armed:
        return
    if len({row[1] for row in rows if row is not None}) > 1:
        raise CheckpointError(
            "the ranks loaded different checkpoints to resume from ("
            + ", ".join(f"rank {r}: {row[0] if row else 'none'}" for r, row in enumerate(rows))
            + "); every rank must resume from the same one. Remove the stale files on the nodes that hold them, "
            "or keep the checkpoints in a folder every node shares (or mirror them: AutoCheckpoint(remote=...))"
        )
    if len(armed) == len(rows):
        return
    if dist.sharded(learn.model):  # each rank reads its own part: nothing one rank could send the others
        raise CheckpointError(
            f"ranks {armed} loaded {rows[armed[0]][0]} to resume from, ranks "
            f"{[r for r in range(len(rows)) if r not in armed]} loaded nothing: every rank of a sharded fit loads "
            "the same checkpoint (where the nodes do not share its folder: keep it in a folder every node shares)"
        )
    src, me = armed[0], dist.rank()
    path, _, fast_forward = rows[src]
    got = dist.share_file(f"stage {index}: {Path(path).name} for the ranks without it", path, src)
    try:
        if me not in armed:
            print(f"fastai_resume: rank {me} resumes from rank {src}'s {path} (it loaded none itself)")
        dist.together(
            f"stage {index}: load {Path(path).name} served by rank {src}",
            lambda: None if me in armed else learn.load(got, fast_forward=fast_forward),
        )
    finally:
        if me != src:  # a copy (armed ranks other than `src` were sent one too)
            os.unlink(got)
    if me not in armed and sc.armed is not None:
        sc.armed.path = Path(path)  # (rank `src`'s: what messages name)


@contextmanager
def stage_call(learn, method: str, bound, start_epoch=0, start_iter=None, resume=True, cbs=()):
    """The top-level training call in progress (a new `Stage`), or the one a nested call belongs to.
    A call that ends in an exception (an interrupt, an error) is not a finished stage: the next call of
    the process is the same stage again, and the fit's resources are released as after a normal fit."""
    sc = script(learn)
    if sc.stage is not None:
        yield sc.stage
        return
    st = Stage(learn, len(sc.signatures), method, bound, start_epoch, start_iter, resume)
    st.extra_cbs = list(cbs)
    sc.stage = st
    ok = False
    try:
        frozen.stage_began(learn)  # before a resume's load (a hook of `begin`) or anything the stage trains
        st.begin(sc)
        yield st
        ok = True
    finally:
        sc.stage = None
        if not ok:
            _after_interrupt(learn, sc, st)
    between.stage_ended(learn, sc, st)
    sc.signatures.append(st.signature)


def _after_interrupt(learn, sc: Script, st: Stage) -> None:
    "fastai runs no `after_fit` when a fit ends in an exception: release what callbacks hold for a fit."
    sc.session, sc.fit_depth = None, 0
    for c in list(learn.cbs) + list(st.extra_cbs):
        if hasattr(c, "after_interrupted_fit"):
            c.after_interrupted_fit()
