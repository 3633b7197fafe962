"""The fastai side: `Learner.save(with_iter=True)`, `Learner.load` and a `fit` that resumes at the
exact iteration.

`import fastai_resume` applies these patches (fastcore's `@patch`, once). Every fit gets a
`ResumeCallback`, which records where training is (so a save from any callback knows its position)
and, when a resume is armed, restores the saved state and skips the finished work. The decisions
of what to skip are made by the C state machine `_core.SkipToIter`.
"""
from __future__ import annotations

import inspect
import os
import time
from functools import wraps
from pathlib import Path

from fastai.learner import Learner, load_model, save_model
import fastai.callback.schedule  # noqa: F401  (defines the fit wrappers patched below)
from fastai.callback.core import Callback, CancelEpochException
from fastai.torch_core import rank_distrib
from fastcore.basics import patch
from fastcore.foundation import L
from fastcore.meta import delegates

from . import _core, dist, io, state
from .io import CheckpointError

__all__ = ["ResumeCallback", "STATE_VERSION"]

STATE_VERSION = 1  # the layout of the training-state tree inside a checkpoint
_SKIP, _RESUME = 1, 2
_RNG_SAVED = 1  # frk_rng_action: restore the saved state now (2: the epoch-start state now)
_TRAIN_BATCH_EVENTS = {"before_batch", "after_pred", "after_loss", "before_backward", "after_backward",
                       "before_step", "after_step", "after_cancel_step", "after_cancel_backward",
                       "after_cancel_batch"}

_orig = {}  # fastai's own methods, as they were before the first patch


class _SkippedIdxs(list):
    "The index list of a resumed epoch, minus the batches already trained."
    def __init__(self, items, on_first_iter):
        super().__init__(items)
        self._hook, self._pid = on_first_iter, os.getpid()

    def __iter__(self):
        if self._hook is not None and os.getpid() == self._pid:
            hook, self._hook = self._hook, None
            hook()
        return super().__iter__()

    def __reduce__(self): return (list, (list(self),))  # workers get a plain list


class ResumeCallback(Callback):
    """Added to every fit. Tracks the training position for `save(with_iter=True)`; when a resume
    is armed, restores the saved training state and delegates the skipping to `_core.SkipToIter`.
    Runs after every other callback (so it restores what their `before_fit` reset)."""
    order = 200

    def __init__(self, saved=None, target=None, fit_index=0, source=None, opt_state=None):
        self.saved, self.target, self.fit_index, self.source = saved, target, fit_index, source
        self.opt_state = opt_state
        self.skip = _core.SkipToIter()
        self.rows = []  # the printed row of every finished epoch
        self.rng_epoch = self.dl_epoch = None

    # -- resuming ---------------------------------------------------------------------------
    def before_fit(self):
        self.t0 = time.perf_counter()
        self.learn._frk_ctl = self
        if self.target is None: return
        epoch, it = self.target
        self.skip.arm(epoch, it, self.n_epoch, len(self.dls.train))
        if self.saved is None: return  # a bare start_epoch / start_iter: skip, restore nothing
        sv = self.saved = _rank_view(self.saved)
        if self.opt_state is not None:  # again: a wrapper may have cleared it (fine_tune's freeze)
            self.opt.load_state_dict(self.opt_state)
        if sv.get("grads") is not None:  # gradients accumulated over batches not yet stepped
            for p, g in zip(self.model.parameters(), sv["grads"]):
                p.grad = None if g is None else g.to(p.device, copy=True)
        # fit() has just reset the learning rate and weight decay: put the saved ones back
        for k in (sv["hypers"][0] if sv["hypers"] else {}):
            self.opt.set_hyper(k, [h[k] for h in sv["hypers"]])
        if sv["recorder"] is not None: state.set_recorder_state(self.learn, sv["recorder"])
        state.set_callback_states(self.learn, sv["callbacks"])
        self.rows = [list(r) for r in sv["rows"]]

    def skips(self, epoch) -> bool:
        "Called by `Learner._do_fit` before each epoch: True if the epoch is already done."
        action, self.rng_action, self.first_iter = self.skip.before_epoch(epoch)
        if action == _SKIP:
            mbar = getattr(getattr(self.learn, "progress", None), "mbar", None)
            if mbar is not None: mbar.update(epoch)  # fastprogress wants every epoch counted
            if epoch < len(self.rows): self.learn.logger(self.rows[epoch])
            return True
        self.resuming = action == _RESUME
        return False

    def before_train(self):
        if getattr(self, "resuming", False):
            self.resuming = False
            self._start_resumed_epoch()
        self.rng_epoch, self.dl_epoch = state.rng_state(), state.dl_states(self.dls)

    def _start_resumed_epoch(self):
        sv, k, learn = self.saved, self.first_iter, self.learn
        n_iter, n_epoch = len(self.dls.train), self.n_epoch
        if sv is not None:
            if self.rng_action == _RNG_SAVED:
                state.set_rng_state(sv["rng"])
                state.set_dl_states(self.dls, sv["dl_now"])
            else:
                state.set_rng_state(sv["rng_epoch"])
                state.set_dl_states(self.dls, sv["dl_epoch"])
            learn.train_iter, learn.pct_train = sv["position"]["train_iter"], sv["position"]["pct_train"]
        else:
            learn.train_iter = self.epoch * n_iter + k
            learn.pct_train = (self.epoch * n_iter + k) / (n_iter * n_epoch)
        learn._frk_first_iter = k
        dl = self.dls.train
        if k:
            get_idxs = dl.get_idxs
            bs = dl.bs or 1

            def skipped_idxs():
                del dl.get_idxs  # one epoch only: back to the class's method
                if dist.is_distributed_dl(dl): dl.i = k * bs  # its count of this rank's items
                return _SkippedIdxs(get_idxs()[k * bs:], self._restore_saved_rng)
            dl.get_idxs = skipped_idxs
        pbar = getattr(getattr(learn, "progress", None), "pbar", None)
        if pbar is not None and k: pbar.update(k)
        where = f"{self.source} " if self.source else ""
        print(f"fastai_resume: resuming {where}at epoch {self.epoch}, iteration {k}/{n_iter} "
              f"(skip took {time.perf_counter() - self.t0:.3f}s)")

    def _restore_saved_rng(self):
        if self.skip.take_rng() and self.saved is not None: state.set_rng_state(self.saved["rng"])

    def batch_fetched(self):
        "Called by `all_batches` once a batch is in hand (the worker-process case)."
        if self.skip.pending: self._restore_saved_rng()

    def after_train(self):
        self.learn._frk_first_iter = 0
        if self.skip.pending: self._restore_saved_rng()  # nothing was left to train

    def after_epoch(self):
        rec = getattr(self.learn, "recorder", None)
        if rec is not None and len(self.rows) <= self.epoch and hasattr(rec, "log"):
            self.rows.append(state.plain(list(rec.log)))

    def after_fit(self):
        self.learn._frk_ctl = None
        self.learn._frk_first_iter = 0

    # -- saving -----------------------------------------------------------------------------
    def position(self):
        "Where training is now, as `(epoch, iter)` with iter = training batches done, or None."
        learn, ev = self.learn, getattr(self.learn, "_frk_event", None)
        n_iter = len(self.dls.train)
        if ev in (None, "before_fit", "after_fit", "after_cancel_fit"): return None
        if ev == "before_epoch": return self.epoch, 0
        if ev in ("after_epoch", "after_cancel_epoch"):
            rec = getattr(learn, "recorder", None)
            if rec is not None and len(rec.values) <= self.epoch:  # saved before Recorder logged
                return self.epoch, n_iter
            return self.epoch + 1, 0
        if learn.training and ev in _TRAIN_BATCH_EVENTS: return self.epoch, learn.iter
        if learn.training and ev == "after_batch": return self.epoch, learn.iter + 1
        if ev == "before_train": return self.epoch, getattr(learn, "_frk_first_iter", 0)
        return self.epoch, n_iter  # training done; validation reruns on resume

    def capture(self) -> dict:
        learn = self.learn
        pos = self.position()
        if pos is None: return None
        epoch, it = pos
        rec = getattr(learn, "recorder", None)
        rows = list(self.rows)
        if rec is not None and len(rows) == self.epoch and len(rec.values) > self.epoch and epoch > self.epoch:
            rows.append(state.plain(list(rec.log)))  # this epoch's row, logged by the Recorder already
        boundary = it == 0
        mine = {  # what differs between the ranks of a data-parallel fit
            "rng": state.rng_state(),
            "rng_epoch": self.rng_epoch if self.rng_epoch is not None and not boundary else state.rng_state(),
            "dl_now": state.dl_states(self.dls),
            "dl_epoch": self.dl_epoch if self.dl_epoch is not None and not boundary else state.dl_states(self.dls),
            "recorder": state.recorder_state(rec) if rec is not None else None,
        }
        ranks = dist.gather(mine) if dist.active() else None  # collective: on every rank
        if dist.rank() != 0: return None  # rank 0 writes
        return {
            "position": {"epoch": epoch, "iter": it, "n_epoch": self.n_epoch, "n_iter": len(self.dls.train),
                         "bs": self.dls.train.bs, "fit_index": self.fit_index,
                         "train_iter": learn.train_iter, "pct_train": float(learn.pct_train),
                         "world_size": dist.world(), "n_iter_all": len(dist.unwrap_dl(self.dls.train))},
            **mine,
            "ranks": None if ranks is None else [None] + ranks[1:],  # rank 0's are the fields above
            "hypers": state.plain([dict(h) for h in learn.opt.hypers]),
            "grads": _pending_grads(learn.model),
            "rows": rows,
            "callbacks": state.callback_states(learn),
        }


def _rank_view(saved: dict) -> dict:
    """The saved training state as this rank sees it: its own RNG, loader and Recorder state from
    `ranks` (`fit` uses no saved state at all when the world size differs)."""
    ranks = saved.get("ranks")
    if not ranks or dist.rank() >= len(ranks): return saved
    mine = ranks[dist.rank()]
    return saved if mine is None else {**saved, **mine}


def _pending_grads(model):
    "The parameters' gradients if any is non-zero (accumulation in progress), else None."
    grads = [p.grad for p in model.parameters()]
    if not any(g is not None and bool(g.any()) for g in grads): return None
    return [None if g is None else g.detach() for g in grads]


# ---- path resolution ------------------------------------------------------------------------

def _resolve(learn, file, for_load: bool):
    """The file a name means, relative to `learn.path/learn.model_dir` as in fastai. Saving with
    `with_iter` appends `.frk`; loading looks for `name.frk` and fastai's `name.pth` (and `name`
    itself if it has either extension) and takes the newest. None if nothing is there."""
    base = Path(learn.path) / learn.model_dir / Path(file)
    if not for_load: return base if base.suffix == io.EXT else base.with_name(base.name + io.EXT)
    cands = [base.with_name(base.name + io.EXT), base.with_name(base.name + ".pth")]
    if base.suffix in (io.EXT, ".pth"): cands.insert(0, base)
    found = [c for c in cands if c.is_file()]
    return max(found, key=lambda c: c.stat().st_mtime_ns) if found else None


def _model_tree(learn, with_opt: bool) -> dict:
    from fastai.torch_core import get_model
    tree = {"fastai_resume": STATE_VERSION, "model": state.plain(get_model(learn.model).state_dict())}
    opt = getattr(learn, "opt", None)
    if with_opt and opt is not None: tree["opt"] = state.plain(opt.state_dict())
    return tree


def commit(build, path) -> None:
    """Write the tree `build()` returns to `path` atomically, on rank 0 only. Under
    torch.distributed every rank calls it (`build` may be collective) and returns once the file is
    committed, or raises if rank 0 could not build or write it."""
    exc = None
    try:
        tree = build()
        if dist.rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            io.save(tree, path)
    except Exception as e:  # under DDP every rank must hear of it, or the others wait forever
        if not dist.active(): raise
        exc = e
    if not dist.active(): return
    if not dist.agree_any(1 if exc is not None else 0): return  # committed, and every rank knows
    why = dist.broadcast(f"{type(exc).__name__}: {exc}" if exc is not None else "it failed on another rank")
    if exc is not None: raise exc
    raise CheckpointError(f"the checkpoint {path} was not saved (rank 0: {why}); the previous files are intact")


def checkpoint_tree(learn, with_opt=True, with_iter=False) -> dict | None:
    """What `save` stores: the model, the optimizer and, `with_iter`, the training position and
    state. Under torch.distributed, `with_iter` is collective (every rank's RNG, loader and
    Recorder state go to rank 0) and ranks other than 0 get None: they have nothing to write."""
    train = None
    if with_iter:
        if getattr(learn, "opt", None) is None:
            raise ValueError("save(with_iter=True): the learner has no optimizer yet (call fit or create_opt first)")
        ctl = getattr(learn, "_frk_ctl", None)
        train = ctl.capture() if ctl is not None else None
    if dist.rank() != 0: return None
    tree = _model_tree(learn, with_opt)
    if with_iter: tree["train"] = train
    return tree


# ---- the patches ----------------------------------------------------------------------------

def _patch():
    if _orig: return
    _orig.update(save=Learner.save, load=Learner.load, fit=Learner.fit, _do_fit=Learner._do_fit,
                 all_batches=Learner.all_batches, _call_one=Learner._call_one)
    state.install_lazy_losses()

    @patch
    def _call_one(self: Learner, event_name):
        self._frk_event = event_name
        if event_name in ("before_fit", "before_validate") and dist.active(): dist.patch_distributed_dl()
        _orig["_call_one"](self, event_name)

    @patch
    def _do_fit(self: Learner):
        ctl = getattr(self, "_frk_ctl", None)
        for epoch in range(self.n_epoch):
            self.epoch = epoch
            if ctl is not None and ctl.skips(epoch): continue
            self._with_events(self._do_epoch, "epoch", CancelEpochException)
            if ctl is not None: ctl.skip.after_epoch(epoch)

    @patch
    def all_batches(self: Learner):
        self.n_iter = len(self.dl)
        ctl = getattr(self, "_frk_ctl", None)
        start = getattr(self, "_frk_first_iter", 0) if self.training and ctl is not None else 0
        for i, b in enumerate(self.dl, start):
            if start and ctl is not None: ctl.batch_fetched()
            self.one_batch(i, b)

    @patch
    @delegates(save_model)
    def save(self: Learner, file, with_iter=False, **kwargs):
        """Save model and optimizer state (if `with_opt`) to `self.path/self.model_dir/file`.
        `with_iter=True` also saves the exact training position and everything needed to continue
        from it (fastai_resume format, extension `.frk`); callable from a callback mid-fit."""
        with_opt = kwargs.pop("with_opt", True)
        fmt = kwargs.pop("format", None)
        if with_iter and not with_opt:
            raise ValueError("save(with_iter=True) needs the optimizer state: drop with_opt=False")
        if not with_iter and fmt != "frk":
            return _orig["save"](self, file, with_opt=with_opt, **kwargs)
        if rank_distrib() and not dist.active(): return  # only rank 0 writes, as fastai does
        path = _resolve(self, file, for_load=False)
        commit(lambda: checkpoint_tree(self, with_opt, with_iter), path)  # under DDP: collective
        return path

    @patch
    @delegates(load_model)
    def load(self: Learner, file, device=None, resume=True, **kwargs):
        """Load model and optimizer state (if `with_opt`) from `self.path/self.model_dir/file`.
        A fastai_resume checkpoint saved mid-fit also arms the resume: the next fit continues at
        the saved position (`resume=False` loads the weights only). The format is told by the
        file's magic bytes, never its name; vanilla fastai `.pth` files load as fastai loads them."""
        path = _resolve(self, file, for_load=True)
        if path is None or not io.is_checkpoint(path):
            self._frk_pending = None
            # fastai appends '.pth' itself: hand it the absolute name without the extension
            name = file if path is None else path.absolute().with_name(path.stem)
            return _orig["load"](self, name, device=device, **kwargs)
        with_opt, strict = kwargs.get("with_opt", True), kwargs.get("strict", True)
        if device is None and hasattr(self.dls, "device"): device = self.dls.device
        if self.opt is None: self.create_opt()
        tree = io.load(path)
        if not isinstance(tree, dict) or "model" not in tree:
            raise CheckpointError(f"{path}: a fastai_resume file, but not a Learner checkpoint (no 'model')")
        from fastai.torch_core import get_model, to_device
        model = get_model(self.model)
        bad = _model_mismatch(model.state_dict(), tree["model"], strict)  # before anything is changed
        if bad: raise CheckpointError(f"{path} does not fit this learner's model: {bad}")
        prev_opt = None
        if with_opt and "opt" in tree:  # the optimizer first: a mismatch leaves the learner untouched
            opt_sd = to_device(tree["opt"], device) if device is not None and str(device) != "cpu" else tree["opt"]
            prev_opt = self.opt.state_dict()
            try:
                self.opt.load_state_dict(opt_sd)
            except (AssertionError, KeyError, ValueError) as e:
                raise CheckpointError(f"{path}: its optimizer state does not fit this learner's optimizer "
                                      f"(different parameter groups?): {e!r}") from None
        try:
            model.load_state_dict(tree["model"], strict=strict)
        except RuntimeError as e:  # checked above; kept for what torch checks beyond keys and shapes
            if prev_opt is not None: self.opt.load_state_dict(prev_opt)
            raise CheckpointError(f"{path} does not fit this learner's model: {e}") from None
        train = tree.get("train")
        self._frk_pending = (train, path, tree.get("opt")) if resume and train is not None else None
        return self

    @patch
    def fit(self: Learner, n_epoch, lr=None, wd=None, cbs=None, reset_opt=False, start_epoch=0,
            start_iter=None, resume=True):
        """fastai's `fit`, resumable: after `learn.load` of a checkpoint saved mid-fit, it continues at
        the saved epoch and iteration. `start_epoch` / `start_iter` override the saved position;
        `resume=False` ignores it."""
        opts = getattr(self, "_frk_wrap", None) or {}
        if any(type(c).__name__ == "LRFinder" for c in L(cbs)):  # lr_find: no resume, keep it armed
            return _orig["fit"](self, n_epoch, lr=lr, wd=wd, cbs=cbs, reset_opt=reset_opt, start_epoch=start_epoch)
        if start_epoch == 0: start_epoch = opts.get("start_epoch", 0)
        if start_iter is None: start_iter = opts.get("start_iter")
        resume = resume and opts.get("resume", True)
        fit_index = opts.get("fit_index", 0)
        if opts: opts["fit_index"] = fit_index + 1
        explicit = bool(start_epoch) or start_iter is not None
        if resume and not explicit and self._frk_pending is None and fit_index == 0:
            for c in list(self.cbs) + list(L(cbs)):
                if hasattr(c, "arm_resume"):  # AutoCheckpoint(resume=True)
                    c.learn = self
                    c.arm_resume()
        pending = self._frk_pending if resume else None
        if not resume: self._frk_pending = None  # ignored, and no longer armed
        saved, source, opt_state = (pending if pending else (None, None, None))
        pos = saved["position"] if saved else None
        if pos is not None and not explicit and pos["fit_index"] != fit_index:
            if fit_index < pos["fit_index"]:
                print(f"fastai_resume: skipping fit {fit_index} of {pos['fit_index']} (finished before the save)")
                return  # still armed, for the wrapper's next fit
            saved = None
        target = _core.skip_plan(saved is not None, pos["epoch"] if saved else 0, pos["iter"] if saved else 0,
                                 start_epoch if start_epoch else -1, -1 if start_iter is None else start_iter)
        if saved is not None and not explicit: _check_same_fit(self, pos, n_epoch)  # raises: still armed
        self._frk_pending = None
        if explicit and saved is not None and (target != (pos["epoch"], pos["iter"])
                                               or pos.get("world_size", 1) != dist.world()):
            saved = None  # another position or sharding: the model and optimizer, not the saved state
        cb = ResumeCallback(saved, target, fit_index, source, opt_state if saved is not None else None)
        _orig["fit"](self, n_epoch, lr=lr, wd=wd, cbs=L(cb) + L(cbs), reset_opt=reset_opt, start_epoch=0)

    for name in ("fit_one_cycle", "fit_flat_cos", "fit_sgdr", "fine_tune"):
        _wrap_fit_method(name)


def _wrap_fit_method(name):
    "Gives a fit wrapper `start_iter` and `resume`, and makes it pass `start_epoch` on (fit_flat_cos did not)."
    orig = getattr(Learner, name)
    _orig[name] = orig
    sig = inspect.signature(orig)

    @wraps(orig)
    def wrapper(self, *args, start_iter=None, resume=True, **kwargs):
        outer = getattr(self, "_frk_wrap", None)
        if outer is not None: return orig(self, *args, **kwargs)  # fine_tune -> fit_one_cycle
        bound = sig.bind(self, *args, **kwargs)
        start_epoch = bound.arguments.get("start_epoch", 0)
        if name == "fine_tune": start_epoch = bound.arguments.get("kwargs", {}).get("start_epoch", 0)
        self._frk_wrap = {"start_epoch": start_epoch, "start_iter": start_iter, "resume": resume, "fit_index": 0}
        try: return orig(self, *args, **kwargs)
        finally: self._frk_wrap = None
    params = list(sig.parameters.values())
    extra = [inspect.Parameter("start_iter", inspect.Parameter.KEYWORD_ONLY, default=None),
             inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=True)]
    var_kw = [p for p in params if p.kind == p.VAR_KEYWORD]
    params = [p for p in params if p.kind != p.VAR_KEYWORD] + extra + var_kw
    wrapper.__signature__ = sig.replace(parameters=params)
    setattr(Learner, name, wrapper)


def _model_mismatch(current: dict, saved: dict, strict: bool) -> str:
    "What keeps `saved` from loading into a model whose state dict is `current` ('' if nothing)."
    import torch
    out = []
    if strict:
        missing, unexpected = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
        if missing: out.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected: out.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for k in current.keys() & saved.keys():
        a, b = current[k], saved[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
            out.append(f"{k}: shape {tuple(b.shape)} in the file, {tuple(a.shape)} in the model")
    return "; ".join(sorted(out)[:8])


def _check_same_fit(learn, pos, n_epoch):
    "A resumed fit must be the fit that was saved, or the result silently changes."
    ws_saved, ws = pos.get("world_size", 1), dist.world()
    if ws_saved != ws:
        raise ValueError(
            f"this checkpoint was saved by a fit of {ws_saved} process(es) and this fit runs {ws}: each rank's "
            f"position, RNG state and share of the data belong to {ws_saved}. Launch {ws_saved} processes to "
            f"resume exactly; or pass start_epoch (and start_iter) to continue anyway from the checkpoint's "
            f"model and optimizer, re-sharded for {ws} (not the uninterrupted run's result); or resume=False "
            "to start over.")
    diffs = []
    if pos["n_epoch"] != n_epoch: diffs.append(f"n_epoch {pos['n_epoch']} -> {n_epoch}")
    n_all, now = pos.get("n_iter_all", pos["n_iter"]), len(dist.unwrap_dl(learn.dls.train))
    if n_all != now: diffs.append(f"batches per epoch {n_all} -> {now}")
    if pos["bs"] != learn.dls.train.bs: diffs.append(f"batch size {pos['bs']} -> {learn.dls.train.bs}")
    if diffs:
        raise ValueError("this fit differs from the one that was saved (" + ", ".join(diffs) + "), so resuming "
                         "it would not give the result of the uninterrupted run. Fit as before, or pass "
                         "start_epoch/start_iter to resume anyway, or resume=False to start over.")


Learner._frk_pending = None
_patch()
