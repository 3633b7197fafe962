"""Where a training script is, and the resume of one fit.

A script is a sequence of *stages*: its top-level training calls (`fit`, `fit_one_cycle`,
`fit_flat_cos`, `fit_sgdr`, `fine_tune`; `lr_find` and fits inside a fit do not count), each of one or
more fits (`fine_tune` runs two). A checkpoint's position is (stage, fit, epoch, iteration), plus the
signature of every stage so far (`Stage.signature`), so a rerun of the same script skips finished stages
without training, continues the saved one at its iteration, and refuses a changed script.

`Script` is everything fastai_resume keeps about one Learner; it lives in a weak table here, never on
the Learner (an exported or pickled Learner carries none of it). `ResumeSession` is the callback of one
fit: it tracks the position for `save(with_iter=True)`, captures the training state, and, when a resume
is armed, restores it and skips the finished work, with the decisions made by `_core.SkipToIter`.
(About 600 lines: the stage bookkeeping and the fit's session share their state and are read together;
what each captures or restores is in `loaders.py` and `state.py`.)
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from fastai.callback.core import Callback

from . import _core, between, check, checkpoint, dist, loaders, state
from .io import CheckpointError
from .script import Armed, AutosaveRun, Interrupted, Script, script, session_of

__all__ = [
    "Script",
    "Armed",
    "Stage",
    "FitPlan",
    "ResumeSession",
    "script",
    "session_of",
    "InBatchSave",
    "AutosaveRun",
    "Interrupted",
]

_IN_BATCH = {
    "before_batch",
    "after_pred",
    "after_loss",
    "before_backward",
    "after_backward",
    "before_step",
    "after_step",
    "after_cancel_step",
    "after_cancel_backward",
    "after_cancel_batch",
}


class InBatchSave(ValueError):
    "A resumable save asked for inside a training batch, where no position is exact."


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
        if os.environ.get(check.ENV_DIR):  # `fastai-resume check`: every stage's end, in its own folder
            return Path(os.environ[check.ENV_DIR]), check.CKPT
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
        learn = self.learn
        if os.environ.get(check.ENV) == "resume" and self.index == 0 and sc.armed is None:
            learn.load(check.CKPT)  # `fastai-resume check`: the resumed run
            if sc.armed is not None:
                sc.armed.path.unlink()
        for c in list(learn.cbs) + list(self.extra_cbs):
            if hasattr(c, "arm_resume"):  # AutoCheckpoint: its run, its lock, and autoresume
                c.learn = learn
                c.arm_resume(self)
        if sc.interrupted is not None and sc.armed is None and self.index == sc.interrupted.stage:
            i = sc.interrupted
            print(
                f"fastai_resume: the previous attempt at stage {i.stage} was interrupted at epoch {i.epoch}, "
                f"iteration {i.iter}; this fit starts the stage again from the model's current (partly trained) "
                "weights, which is not an exact continuation. To continue exactly, learn.load a checkpoint saved "
                "before the interruption (AutoCheckpoint does this by itself)."
            )
        sc.interrupted = None
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


@dataclass
class FitPlan:
    "What a fit of a stage does: skip to `target` and, from a checkpoint (`source`), restore `saved`."

    stage: Stage
    fit_index: int
    saved: dict | None = None
    target: tuple | None = None
    source: Path | None = None
    opt_state: dict | None = None
    fast_forward: bool = False
    model_state: dict | None = None  # put back before the restore: skipped stages' end states replaced it


class ResumeSession(Callback):
    """Added to every top-level fit. Tracks the training position for `save(with_iter=True)`; when a
    resume is armed, restores the saved training state and delegates the skipping to
    `_core.SkipToIter`. Runs after every other callback (so it restores what their `before_fit` reset)."""

    order = 200

    def __init__(self, plan: FitPlan):
        # (the fields are the plan's, not `__init__`'s arguments: fastai's W&B callback logs a callback's
        # `__init__` arguments as configuration, and the plan holds the Learner and whole tensors)
        self.stage, self.fit_index, self.saved, self.target = plan.stage, plan.fit_index, plan.saved, plan.target
        self.source, self.opt_state, self.fast_forward = plan.source, plan.opt_state, plan.fast_forward
        self.model_state = plan.model_state
        self.skip = _core.SkipToIter()
        self.rows: list = []  # the printed row of every finished epoch
        self.rng_epoch = self.loaders_epoch = self.rng_valid = self.loaders_valid = None
        self.frames: list = []  # the events in progress: [name, callbacks in order, index of the next one]
        self.first_iter = 0
        self.resuming = False
        self.deferred = None
        self.fast_forwarding = 0  # batches `all_batches` reads and discards first (a stream without state)

    # -- events ---------------------------------------------------------------------------------
    @property
    def event(self):
        return self.frames[-1][0] if self.frames else None

    def run_event(self, learn, event_name) -> None:
        "fastai's `Learner._call_one`, with the event's progress kept so a save can complete it first."
        frame = [event_name, learn.cbs.sorted("order"), 0]
        self.frames.append(frame)
        try:
            self._run_rest(frame)
        finally:
            self.frames.pop()

    def _run_rest(self, frame):
        cbs = frame[1]
        while frame[2] < len(cbs):
            cb = cbs[frame[2]]
            frame[2] += 1
            cb(frame[0])
            if self.deferred is not None:  # raised by a later callback while this one saved
                e, self.deferred = self.deferred, None
                raise e

    def complete_event(self):
        """Run the callbacks of the event in progress that have not run yet (a save from `after_batch` or
        `after_epoch` by a callback that comes before the Recorder sees the batch or epoch as finished,
        whatever its order). Returns the exception one of them raised (re-raised after the save)."""
        if not self.frames:
            return None
        frame = self.frames[-1]
        if not frame[0].startswith("after_") or frame[0] == "after_fit":
            return None
        try:
            self._run_rest(frame)
        except BaseException as e:
            return e
        return None

    # -- resuming -------------------------------------------------------------------------------
    def before_fit(self):
        self.t0 = time.perf_counter()
        if self.saved is not None:
            self._warm_dls()  # only before a restore: a fresh fit draws as fastai does
        for dl in self.dls.loaders:
            self._seed_workers(dl)
        csv = state.csv_logger_class()
        for cb in self.learn.cbs:
            if csv is not None and isinstance(cb, csv) and getattr(cb, "file", None) is not None:
                cb.resume_file_start = self._csv_start(cb)
        if self.target is None:
            return
        epoch, it = self.target
        self.skip.arm(epoch, it, self.n_epoch, len(self.dls.train))
        if self.saved is None:
            return  # a bare start_epoch / start_iter: skip, restore nothing
        sv = self.saved = checkpoint.rank_view(self.saved)
        if self.model_state is not None:
            from fastai.torch_core import get_model

            get_model(self.model).load_state_dict(self.model_state)
            self.model_state = None
        if self.opt_state is not None:  # again: a wrapper may have cleared it (fine_tune's freeze)
            self.opt.load_state_dict(_on_training_device(self.learn, self.opt_state))
        self._restore_grads(sv)
        hypers = sv["hypers"]
        if hypers and len(hypers) != len(self.opt.hypers):
            raise CheckpointError(
                f"{self.source}: {len(hypers)} parameter groups saved, the optimizer has {len(self.opt.hypers)}"
            )
        for i, (live, saved) in enumerate(zip(self.opt.hypers, hypers)):
            for k, v in saved.items():
                if k not in live or _kind(live[k]) != _kind(v):
                    raise CheckpointError(
                        f"{self.source}: train.hypers[{i}][{k!r}] is a {type(v).__name__} in the file, "
                        f"{type(live.get(k)).__name__ if k in live else 'not a hyper-parameter'} in the optimizer"
                    )
        for k in hypers[0] if hypers else {}:  # fit() has just reset the learning rate and weight decay
            self.opt.set_hyper(k, [h[k] for h in hypers])
        if sv["recorder"] is not None:
            state.set_recorder_state(self.learn, sv["recorder"])
        state.set_callback_states(self.learn, sv["callbacks"])
        self.rows = [list(r) for r in sv["rows"]]

    def _warm_dls(self):
        "Compute what fastai computes lazily with the RNG on first use (TfmdDL's `_one_pass`), before any restore."
        for dl in self.dls.loaders:
            try:
                getattr(dl, "n_inp", None)
            except Exception:
                pass

    def _restore_grads(self, sv):
        """The gradients as the uninterrupted run had them (`state.set_grads`): a rerun that skipped the
        stages that made them has none; in the process itself, an interrupt between `backward` and
        `zero_grad` left gradients that the next `backward` would add to."""
        ps = list(self.model.parameters())
        bad = checkpoint.grads_mismatch(sv, len(ps))
        if bad:
            raise CheckpointError(f"{self.source}: malformed training state: {bad}")
        state.set_grads(self.model, sv.get("grad_set"), sv.get("grads"))

    def _seed_workers(self, dl):
        if (
            loaders.is_fastai(dl)
            and dl.num_workers > 0
            and not isinstance(dl.__dict__.get("do_item"), loaders.BatchSeeder)
        ):
            dl.do_item = loaders.BatchSeeder(type(dl).do_item.__get__(dl), dl.bs or 1, 0)

    @staticmethod
    def _csv_start(cb) -> int:
        header = (",".join(cb.recorder.metric_names) + "\n").encode()
        cb.file.flush()
        return cb.file.tell() - len(header)

    def skips(self, epoch) -> bool:
        "Called by `Learner._do_fit` before each epoch: True if the epoch is already done."
        action, self.rng_action, self.first_iter = self.skip.before_epoch(epoch)
        if action == _core.STEP_SKIP:
            mbar = getattr(getattr(self.learn, "progress", None), "mbar", None)
            if mbar is not None:
                mbar.update(epoch)  # fastprogress wants every epoch counted
            if epoch < len(self.rows):
                state.print_row(self.learn, self.rows[epoch])
            return True
        self.resuming = action == _core.STEP_RESUME
        return False

    def before_train(self):
        if self.resuming:
            self.resuming = False
            self._start_resumed_epoch()
        for dl in self.dls.loaders:
            do_item = dl.__dict__.get("do_item") if loaders.is_fastai(dl) else None
            if isinstance(do_item, loaders.BatchSeeder):
                do_item.first, do_item.n = (self.first_iter if dl is self.dls.train else 0), 0
        self.rng_epoch = state.rng_state()
        self.loaders_epoch = [loaders.capture(dl) for dl in self.dls.loaders]
        self.rng_valid = self.loaders_valid = None

    def before_validate(self):
        for dl in self.dls.loaders:
            do_item = dl.__dict__.get("do_item") if loaders.is_fastai(dl) else None
            if isinstance(do_item, loaders.BatchSeeder) and dl is not self.dls.train:
                do_item.first, do_item.n = 0, 0
        self.rng_valid = state.rng_state()
        self.loaders_valid = [loaders.capture(dl) for dl in self.dls.loaders]

    def _start_resumed_epoch(self):
        sv, k, learn = self.saved, self.first_iter, self.learn
        n_iter, n_epoch = len(self.dls.train), self.n_epoch
        if sv is not None:
            if self.rng_action == _core.RNG_SAVED:
                state.set_rng_state(_saved_rng(sv))
                self._restore_loaders(sv["loaders_now"])
            else:
                state.set_rng_state(sv["rng_epoch"])
                self._restore_loaders(sv["loaders_epoch"], with_stream_state=False)
            learn.train_iter, learn.pct_train = sv["position"]["train_iter"], sv["position"]["pct_train"]
        else:
            learn.train_iter = self.epoch * n_iter + k
            learn.pct_train = (self.epoch * n_iter + k) / (n_iter * n_epoch)
        how = ""
        if sv is not None and k and sv.get("modules"):
            state.set_module_states(learn.model, sv["modules"])
        if sv is not None and k and sv["recorder"] is not None:
            state.set_train_metrics(learn, sv["recorder"])
        if k:
            if sv is not None and loaders.is_stream(self.dls.train) and loaders.has_state(self.dls.train):
                loaders.restore(self.dls.train, sv["loaders_now"][0])  # the stream continues from where it was
            how = loaders.skip_first(
                self.dls.train,
                k,
                self._restore_saved_rng,
                self.fast_forward,
                f"at epoch {self.epoch}, iteration {k} " if sv is None else f"from {self.source} ",
                whole=sv is not None and bool(sv["position"].get("loader_done")),
            )
            self._guard_after_batch()
        pbar = getattr(getattr(learn, "progress", None), "pbar", None)
        if pbar is not None and k:
            pbar.update(k)
        where = f"{self.source} " if self.source else ""
        print(
            f"fastai_resume: resuming {where}at epoch {self.epoch}, iteration {k}/{n_iter} "
            f"(skip took {time.perf_counter() - self.t0:.3f}s{', ' + how if how else ''})"
        )
        self.fast_forwarding = k if how == "fast-forward" else 0

    def _restore_loaders(self, states, with_stream_state=True):
        for dl, st in zip(self.dls.loaders, states):
            loaders.restore(dl, st, with_stream_state)

    def _guard_after_batch(self):
        """With worker processes the skipped part is behind the main process once the loader hands over
        its first batch: restore the saved RNG before that batch's `after_batch` transforms run."""
        dl = self.dls.train
        if not loaders.is_fastai(dl):
            return
        dl.after_batch = loaders.call_hook_first(
            dl.after_batch, self._restore_saved_rng, lambda orig: setattr(dl, "after_batch", orig)
        )

    def _restore_saved_rng(self):
        if self.skip.take_rng() and self.saved is not None:
            state.set_rng_state(_saved_rng(self.saved))

    def batch_fetched(self):
        "Called by `all_batches` once a batch is in hand (a loader with no earlier hook)."
        if self.skip.pending:
            self._restore_saved_rng()

    def after_train(self):
        self.first_iter = 0
        if self.skip.pending:
            self._restore_saved_rng()  # nothing was left to train

    def after_epoch(self):
        rec = getattr(self.learn, "recorder", None)
        if rec is not None and len(self.rows) <= self.epoch and hasattr(rec, "log"):
            self.rows.append(state.plain(list(rec.log)))

    def end_of_epochs(self):
        "Called by `Learner._do_fit` after the last epoch: a fit resumed at its very end gets the saved RNG now."
        if self.skip.pending:
            self._restore_saved_rng()

    # -- saving ---------------------------------------------------------------------------------
    def position(self):
        "Where training is now, as `(epoch, iter)` with iter = training batches done, or None."
        learn, ev = self.learn, self.event
        n_iter = len(self.dls.train)
        if ev in (None, "before_fit", "after_fit", "after_cancel_fit"):
            return None
        if ev == "before_epoch":
            return self.epoch, 0
        if ev in ("after_epoch", "after_cancel_epoch"):
            return self.epoch + 1, 0
        if ev == "before_train":
            return self.epoch, self.first_iter
        if learn.training and ev == "after_batch":
            return self.epoch, learn.iter + 1
        if learn.training and ev in _IN_BATCH:
            raise InBatchSave(
                f"save(with_iter=True) from {ev} is inside training batch {learn.iter}, where no "
                "position is exact (the batch has partly run): save from after_batch (the batch "
                "counts as done), before_epoch or after_epoch"
            )
        return self.epoch, n_iter  # training done; validation reruns on resume

    def capture(self) -> dict | None:
        learn = self.learn
        pos = self.position()  # before completing the event: a save from inside a batch is refused first
        if pos is not None and self.deferred is None:
            self.deferred = self.complete_event()
        pos = self.position()
        if pos is None:
            return None
        epoch, it = pos
        rec = getattr(learn, "recorder", None)
        rows = list(self.rows)
        if rec is not None and len(rows) == self.epoch and len(rec.values) > self.epoch and epoch > self.epoch:
            rows.append(state.plain(list(rec.log)))  # this epoch's row, logged by the Recorder already
        boundary = it == 0
        validating = self.rng_valid is not None and epoch == self.epoch and it == len(self.dls.train)
        # saved after the training loop ended (after_train, validation): the loader had read all of the
        # epoch, the partial batch drop_last discards included; from after_batch of the last batch it had not
        loader_done = (
            epoch == self.epoch and it == len(self.dls.train) and not (learn.training and self.event == "after_batch")
        )
        now_loaders = [loaders.capture(dl) for dl in self.dls.loaders]
        mine = {  # what differs between the ranks of a data-parallel fit
            "rng": state.rng_state(),
            "rng_valid": self.rng_valid if validating else None,
            "rng_epoch": self.rng_epoch if self.rng_epoch is not None and not boundary else state.rng_state(),
            "loaders_now": self.loaders_valid if validating else now_loaders,
            "loaders_epoch": self.loaders_epoch if self.loaders_epoch is not None and not boundary else now_loaders,
            "recorder": state.recorder_state(rec) if rec is not None else None,
            "modules": state.module_states(learn.model),
        }
        per_rank = dist.sharded(learn.model)  # a sharded model: every rank writes its own file (`sharded`)
        ranks = dist.gather(mine) if dist.active() and not per_rank else None  # collective: on every rank
        if dist.rank() != 0 and not per_rank:
            return None  # rank 0 writes
        sc = script(learn)
        st = self.stage
        return {
            "position": {
                "epoch": epoch,
                "iter": it,
                "n_epoch": self.n_epoch,
                "n_iter": len(self.dls.train),
                "bs": loaders.batch_size(self.dls.train),
                "fit_index": self.fit_index,
                "stage": st.index,
                "train_iter": learn.train_iter,
                "pct_train": float(learn.pct_train),
                "world_size": dist.world(),
                "loader_done": loader_done,
                "n_iter_all": len(dist.unwrap_dl(self.dls.train)),
            },
            "stages": list(sc.signatures[: st.index]) + [st.signature],
            "rng_stage": st.rng_start,
            **mine,
            "ranks": None if ranks is None else [None] + ranks[1:],  # rank 0's are the fields above
            "hypers": state.plain([dict(h) for h in learn.opt.hypers]),
            "grads": _pending_grads(learn.model),
            "grad_set": [p.grad is not None for p in learn.model.parameters()],
            "rows": rows,
            "callbacks": state.callback_states(learn),
            "script": between.script_tree(sc, st),
        }


def _kind(v) -> str:
    "What a hyper-parameter's value is, for comparing a saved one with the optimizer's own."
    if v is None or isinstance(v, (bool, str)):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, (list, tuple)):
        return f"sequence of {len(v)}"
    return type(v).__name__


def _saved_rng(sv: dict) -> dict:
    "The RNG state the uninterrupted run continued with: at the save, or at the start of the validation it was in."
    return sv["rng"] if sv["rng_valid"] is None else sv["rng_valid"]


def _on_training_device(learn, tree):
    """`tree` (an optimizer state kept on the CPU since `learn.load`) on the device the fit trains on:
    the loaders' device, as fastai's `load` and `TrainEvalCallback` use, else the parameters'. On the
    CPU a CUDA fit's first step failed: Adam's moments on the CPU, the gradients on the GPU."""
    from fastai.torch_core import to_device

    dev = getattr(learn.dls, "device", None)
    if dev is None:
        dev = next(iter(learn.model.parameters()), torch.empty(0)).device
    return tree if torch.device(dev).type == "cpu" else to_device(tree, dev)


def _pending_grads(model):
    """The parameters' gradients if any is non-zero (accumulation in progress), else None. A sharded
    gradient (a DTensor) is judged by this rank's part: its `any()` would be a collective, and each rank
    saves its own."""
    grads = [p.grad for p in model.parameters()]
    if not any(g is not None and bool((g.to_local() if hasattr(g, "to_local") else g).any()) for g in grads):
        return None
    return [None if g is None else g.detach() for g in grads]
