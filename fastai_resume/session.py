"""The resume of one fit: `run_fit` runs a fit of a stage (skipped, resumed or run), with its
`ResumeSession`, the callback that tracks the training position for `save(with_iter=True)` and, when a
resume is armed, restores the saved training state (`trainstate`) and skips the finished work, with the
decisions made by `io.SkipToIter` and the batches cut by `loaders.skip_first`. A checkpoint saved at
another world size continues at the position counted in samples (`continue_at`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from fastai.callback.core import Callback
from fastcore.foundation import L

from . import callbacks, datalog, dist, frozen, io, loaders, state, trainstate
from .script import FIT_HOOKS, Interrupted, say
from .stages import Stage

__all__ = ["FitPlan", "EventFrames", "ResumeSession", "InBatchSave", "run_fit", "continue_at", "batches_per_rank"]

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


@dataclass
class FitPlan:
    "What a fit of a stage does: skip to `target` and, from a checkpoint (`source`), restore `saved`."

    script: object
    stage: Stage
    fit_index: int
    saved: dict | None = None
    target: tuple | None = None
    source: Path | None = None
    opt_state: dict | None = None
    fast_forward: bool = False
    model_state: dict | None = None  # put back before the restore: what ran since the load may have changed it


class EventFrames:
    """fastai's `Learner._call_one` for a fit with a session: each event's progress (its callbacks in
    order, the next to run) is kept, so that a save from a callback can first run the rest of the event."""

    def __init__(self):
        self.stack: list = []  # [event name, callbacks in order, index of the next one]
        self.deferred = None  # an exception a later callback raised while a save completed the event

    @property
    def event(self):
        return self.stack[-1][0] if self.stack else None

    def run(self, learn, event_name) -> None:
        frame = [event_name, learn.cbs.sorted("order"), 0]
        self.stack.append(frame)
        try:
            self._run_rest(frame)
        finally:
            self.stack.pop()

    def _run_rest(self, frame):
        cbs = frame[1]
        while frame[2] < len(cbs):
            cb = cbs[frame[2]]
            frame[2] += 1
            cb(frame[0])
            if self.deferred is not None:  # raised by a later callback while this one saved
                e, self.deferred = self.deferred, None
                raise e

    def complete(self):
        """Run the callbacks of the event in progress that have not run yet (a save from `after_batch` or
        `after_epoch` by a callback that comes before the Recorder sees the batch or epoch as finished,
        whatever its order). Returns the exception one of them raised (re-raised after the save)."""
        if not self.stack:
            return None
        frame = self.stack[-1]
        if not frame[0].startswith("after_") or frame[0] == "after_fit":
            return None
        try:
            self._run_rest(frame)
        except BaseException as e:
            return e
        return None


class ResumeSession(Callback):
    """Added to every top-level fit. Tracks the training position for `save(with_iter=True)`; when a
    resume is armed, restores the saved training state and delegates the skipping to
    `io.SkipToIter`. Runs after every other callback (so it restores what their `before_fit` reset)."""

    order = 200

    def __init__(self, plan: FitPlan):
        # (the fields are the plan's, not `__init__`'s arguments: fastai's W&B callback logs a callback's
        # `__init__` arguments as configuration, and the plan holds the Learner and whole tensors)
        self.script, self.stage, self.fit_index = plan.script, plan.stage, plan.fit_index
        self.saved, self.target, self.source = plan.saved, plan.target, plan.source
        self.opt_state, self.model_state, self.fast_forward = plan.opt_state, plan.model_state, plan.fast_forward
        self.skip = io.SkipToIter()
        self.frames = EventFrames()
        self.rows: list = []  # the printed row of every finished epoch
        self.rng_epoch = self.loaders_epoch = self.rng_valid = self.loaders_valid = None
        self.first_iter, self.rng_action, self.resuming, self.t0 = 0, io.RNG_NONE, False, 0.0
        self.fast_forwarding = 0  # batches `all_batches` reads and discards first (a stream's replay)
        self.first_fetch = None  # once the resumed epoch's first batch is in (a stream's loaded state forgotten)
        self.streamed, self.log = False, datalog.DataLog()  # a stream's batches: logged, and checked against
        self.expect: list = []  # the ((epoch, iter), fingerprint) the saving run logged after its save

    def before_fit(self):
        self.t0 = time.perf_counter()
        self.streamed = loaders.is_stream(self.dls.train)
        if self.saved is not None:
            loaders.warm(self.dls)  # only before a restore: a fresh fit draws as fastai does
        loaders.seed_workers(self.dls)
        callbacks.mark_csv_start(self.learn)
        if self.target is None:
            return
        self.skip.arm(*self.target, self.n_epoch, len(self.dls.train))
        if self.saved is None:
            return  # a bare start_epoch / start_iter: skip, restore nothing
        self.saved = trainstate.rank_view(self.saved)
        self.rows = trainstate.restore_fit(self.learn, self.saved, self.source, self.model_state, self.opt_state)
        self.model_state = None

    def skips(self, epoch) -> bool:
        "Called by `Learner._do_fit` before each epoch: True if the epoch is already done."
        action, self.rng_action, self.first_iter = self.skip.before_epoch(epoch)
        if action == io.STEP_SKIP:
            mbar = getattr(getattr(self.learn, "progress", None), "mbar", None)
            if mbar is not None:
                mbar.update(epoch)  # fastprogress wants every epoch counted
            if epoch < len(self.rows):
                state.print_row(self.learn, self.rows[epoch])
            return True
        self.resuming = action == io.STEP_RESUME
        if self.resuming and not self.first_iter and self.saved is not None:
            # saved at an epoch boundary: the tensors the model keeps between batches are the ones it had
            # there, before any callback's before_epoch (ModelResetter's before_train resets them after, as
            # it did in the uninterrupted run; a model carrying them on from its validation keeps them)
            self._restore_saved_modules()
        return False

    def before_train(self):
        if self.resuming:
            self.resuming = False
            self._start_resumed_epoch()
        loaders.seed_epoch(self.dls, 0 if self.fast_forwarding else self.first_iter)  # (a replay reads from 0)
        self.rng_epoch = state.rng_state()
        self.loaders_epoch = [loaders.capture(dl) for dl in self.dls.loaders]
        self.rng_valid = self.loaders_valid = None

    def saving(self, path: Path) -> None:
        "A resumable save to `path` at the position now: a stream's batches from here on go to its data log."
        if self.streamed:
            self.log.start(path)

    def before_batch(self):
        "A stream's batch: checked against the data log it is resumed from, then logged (`datalog`)."
        if not (self.streamed and self.training):
            return
        pos = (self.epoch, self.iter)
        self._not_drawn(pos)
        if not self.expect and not self.log.open:
            return
        got = datalog.fingerprint((*self.learn.xb, *self.learn.yb))
        if self.expect and self.expect[0][0] == pos:
            datalog.verdict(self.source, *pos, self.expect.pop(0)[1], got, self._stream_name())
        self.log.record(*pos, got)

    def _stream_name(self) -> str:
        return type(getattr(dist.unwrap_dl(self.dls.train), "dataset", None)).__name__

    def _not_drawn(self, before) -> None:
        """The logged batches before position `before` that this fit passed without drawing: the saving run
        trained them, so the stream diverged (on every rank alike: every rank holds the same positions)."""
        while self.expect and (before is None or self.expect[0][0] < before):
            (e, i), want = self.expect.pop(0)
            datalog.verdict(self.source, e, i, want, None, self._stream_name())

    def _fetched(self) -> None:
        "The resumed epoch's first batch is in, or none will be: what waited for it runs (once)."
        if self.first_fetch is not None:
            f, self.first_fetch = self.first_fetch, None
            f()

    def after_fit(self):
        self.log.close()
        self._fetched()  # (a resumed epoch that drew no batch: nothing was left of it)
        self._not_drawn(None)

    def before_validate(self):
        loaders.seed_epoch(self.dls, None)
        self.rng_valid = state.rng_state()
        self.loaders_valid = [loaders.capture(dl) for dl in self.dls.loaders]

    def _start_resumed_epoch(self):
        sv, k, learn = self.saved, self.first_iter, self.learn
        n_iter = len(self.dls.train)
        if sv is not None:
            trainstate.restore_epoch(learn, sv, self.rng_action == io.RNG_SAVED, k)
        else:
            learn.train_iter = self.epoch * n_iter + k
            learn.pct_train = (self.epoch * n_iter + k) / (n_iter * self.n_epoch)
        how = ""
        if k:
            how = loaders.skip_first(
                self.dls.train,
                k,
                self._restore_saved_rng,
                self.fast_forward,
                f"at epoch {self.epoch}, iteration {k} " if sv is None else f"from {self.source} ",
                whole=sv is not None and bool(sv["position"].get("loader_done")),
            )
            if how.startswith("stream state"):
                self.first_fetch = lambda: loaders.forget_loaded(self.dls.train)
            if not how.startswith(("replay", "fast-forward")):  # (a replay restores it after its last batch)
                loaders.before_first_batch(self.dls.train, self._restore_saved_rng)
            pbar = getattr(getattr(learn, "progress", None), "pbar", None)
            if pbar is not None:
                pbar.update(k)
        where = f"{self.source} " if self.source else ""
        print(
            f"fastai_resume: resuming {where}at epoch {self.epoch}, iteration {k}/{n_iter} "
            f"(skip took {time.perf_counter() - self.t0:.3f}s{', ' + how if how else ''})"
        )
        self.fast_forwarding = k if how.startswith(("replay", "fast-forward")) else 0
        if self.streamed and self.source is not None and sv is not None:  # what the saving run trained after it
            log = sorted(datalog.expected(self.source).items())
            if log and log[0][0] not in ((self.epoch, k), (self.epoch + 1, 0)):
                log = []  # (not this checkpoint's log: one of a save that did not commit)
            got = dist.exchange("datalog: the batches to check", [len(log), list(log[0][0]) if log else None])
            same = all(g[1] == got[0][1] for g in got)  # (every rank checks the same positions, or none)
            self.expect = log[: min(g[0] for g in got)] if same else []

    def _restore_saved_modules(self):
        "The tensors the model kept between batches when the checkpoint was saved (its hidden state)."
        state.set_module_states(self.learn.model, self.saved.get("modules") or {})

    def _restore_saved_rng(self):
        if self.skip.take_rng() and self.saved is not None:
            state.set_rng_state(trainstate.saved_rng(self.saved))

    def batch_fetched(self):
        "Called by `all_batches` once a batch is in hand (a loader with no earlier hook)."
        self._fetched()
        if self.skip.pending:
            self._restore_saved_rng()

    def after_train(self):
        self.first_iter = 0
        self._fetched()  # (the resumed epoch drew no batch: saved at its end)
        if self.streamed:
            self._not_drawn((self.epoch + 1, 0))
        if self.skip.pending:
            self._restore_saved_rng()  # nothing was left to train

    def after_epoch(self):
        rec = getattr(self.learn, "recorder", None)
        if rec is not None and len(self.rows) <= self.epoch and hasattr(rec, "log"):
            self.rows.append(state.plain(list(rec.log)))

    def end_of_epochs(self):
        """Called by `Learner._do_fit` after the last epoch: a fit resumed at its very end (no epoch left to
        resume in) gets the state it was saved with now: RNG, loaders, schedule position, the model's
        hidden state."""
        if self.skip.after_last_epoch() and self.saved is not None:
            trainstate.restore_epoch(self.learn, self.saved, True, 0)
            # and the tensors the model keeps between batches: no epoch starts after this one to reset them
            self._restore_saved_modules()
        elif self.skip.pending:
            self._restore_saved_rng()

    def position(self):
        "Where training is now, as `(epoch, iter)` with iter = training batches done, or None."
        learn, ev = self.learn, self.frames.event
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
        return self.epoch, len(self.dls.train)  # training done; validation reruns on resume


# ---- a fit of a stage --------------------------------------------------------------------------


def batches_per_rank(n_iter_all: int, world: int) -> int:
    "Training batches per rank per epoch for a loader of `n_iter_all` batches (fastai's `DistributedDL.__len__`)."
    return -(-n_iter_all // world) if world > 1 else n_iter_all


def continue_at(learn, train: dict, source, n_epoch: int) -> dict:
    """The saved training state of a fit of another world size, as this fit continues it: the position
    counted in samples (the epoch's training samples done across the saved ranks, in whole batches of this
    world size; what does not make a whole batch is trained again). Says plainly that the run is no longer
    the uninterrupted one: every rank's share of the data differs. Raises what cannot be continued."""
    pos = train["position"]
    old, new = pos["world_size"], dist.world()
    bs = pos["bs"]
    if loaders.is_stream(learn.dls.train):
        raise ValueError(
            f"{source} was saved by {old} process(es); this fit runs {new}. Its training data is a stream, whose "
            "position cannot be moved to another number of processes: resume it with "
            f"{old}, or pass start_epoch to start an epoch anew"
        )
    if not bs:
        raise ValueError(f"{source}: its training loader has no batch size: it cannot be continued by {new} processes")
    if train.get("grads") is not None:
        raise ValueError(
            f"{source} was saved by {old} process(es) in the middle of a gradient accumulation; its partial "
            f"gradients (sums over each process's own batches) cannot be continued by {new}: resume it with "
            f"{old}, or from a checkpoint saved at an optimizer step"
        )
    n_iter = batches_per_rank(pos["n_iter_all"], new)
    done = pos["iter"] * bs * old  # training samples of this epoch done, across the saved ranks
    if pos.get("loader_done") or pos["iter"] >= pos["n_iter"]:
        it = n_iter
    else:
        it = min(done // (bs * new), n_iter)
    again = done - it * bs * new if it < n_iter else 0
    epoch = pos["epoch"]
    train_iter = epoch * n_iter + it
    moved = {
        **pos,
        "iter": it,
        "n_iter": n_iter,
        "train_iter": train_iter,
        "pct_train": train_iter / max(1, n_epoch * n_iter),
        "world_size": new,
        "saved_world_size": old,
    }
    msg = (
        f"fastai_resume: {source} was saved by {old} process(es) and this fit runs {new}: it continues at epoch "
        f"{epoch}, iteration {it} of {n_iter} per process (the position counted in samples: {done:,} training "
        "samples of the epoch were done"
        + (f"; {again:,} of them, less than a batch of every process, are trained again" if again else "")
        + f"). The model and optimizer are the saved ones, rebuilt exactly for {new} process(es), but each "
        "process's share of the data differs from the uninterrupted run's: the result is no longer the "
        "uninterrupted run's"
    )
    say(msg, stacklevel=3)
    return {**train, "position": moved, "ranks": None}


def _check_same_fit(learn, pos, n_epoch):
    "A resumed fit must be the fit that was saved, or the result silently changes."
    diffs = []
    if pos["n_epoch"] != n_epoch:
        diffs.append(f"n_epoch {pos['n_epoch']} -> {n_epoch}")
    n_all, now = pos["n_iter_all"], len(dist.unwrap_dl(learn.dls.train))
    if n_all != now:
        diffs.append(f"batches per epoch {n_all} -> {now}")
    bs = loaders.batch_size(learn.dls.train)
    if pos["bs"] != bs:
        diffs.append(f"batch size {pos['bs']} -> {bs}")
    if diffs:
        raise ValueError(
            "this fit differs from the one that was saved (" + ", ".join(diffs) + "), so resuming "
            "it would not give the result of the uninterrupted run. Fit as before, or pass "
            "start_epoch/start_iter to resume anyway, or resume=False to start over."
        )


def run_fit(learn, sc, st, n_epoch, lr, wd, cbs, reset_opt, start_epoch, start_iter, resume):
    "One fit of stage `st`: skipped, resumed or run, with its `ResumeSession`."
    fit_index = st.fits
    st.fits += 1
    frozen.stage_began(learn, first_fit=False)  # a parameter the stage froze since it began (fine_tune's freeze)
    if not start_epoch:
        start_epoch = st.start_epoch
    if start_iter is None:
        start_iter = st.start_iter
    resume = resume and st.resume
    explicit = bool(start_epoch) or start_iter is not None
    if not resume:
        sc.disarm("resume=False")
    a = sc.armed
    if a is not None and not explicit:
        if st.skip_all:
            return  # the whole stage is done (Stage.begin said so)
        if fit_index < a.position["fit_index"]:
            print(f"fastai_resume: skipping fit {fit_index} of stage {st.index} (finished before the save)")
            return
    saved = a.train if a is not None else None
    pos = saved["position"] if saved else None
    if saved is not None and not explicit and pos["world_size"] != dist.world():  # moved, counted in samples
        saved = continue_at(learn, saved, a.path, n_epoch)
        pos = saved["position"]
    target = io.skip_plan(
        saved is not None,
        pos["epoch"] if saved else 0,
        pos["iter"] if saved else 0,
        start_epoch if start_epoch else -1,
        -1 if start_iter is None else start_iter,
    )
    if saved is not None and not explicit:
        _check_same_fit(learn, pos, n_epoch)  # raises: still armed
    if saved is not None:
        frozen.recheck(learn, a.frozen, a.path)  # raises (on every rank): still armed
    if a is not None:  # consumed by this fit: the log of the calls replayed before it is the script's own again
        sc.log = [ev for ev in a.log if ev["at"] <= st.index]
    sc.armed = None
    if explicit and saved is not None and (target != (pos["epoch"], pos["iter"]) or pos["world_size"] != dist.world()):
        saved = None  # another position or sharding: the model and optimizer, not the saved state
        trainstate.put_state(learn, a.model, a.opt)
    s = ResumeSession(
        FitPlan(
            sc,
            st,
            fit_index,
            saved,
            target,
            a.path if a is not None else None,
            a.opt if saved is not None else None,
            a.fast_forward if a is not None else False,
            a.model if saved is not None else None,
        )
    )
    sc.session = s
    sc.fit_depth += 1
    try:
        probes = [cb for hook in FIT_HOOKS if (cb := hook(learn)) is not None]  # `fastai-resume check`'s
        learn._orig_fit(n_epoch, lr=lr, wd=wd, cbs=L(s) + L(cbs) + L(probes), reset_opt=reset_opt, start_epoch=0)
        st.rows += s.rows
    except BaseException:
        sc.interrupted = Interrupted(st.index, getattr(learn, "epoch", 0), getattr(learn, "iter", 0))
        raise
    finally:
        sc.fit_depth -= 1
        sc.session = None
