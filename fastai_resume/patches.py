"""The patches of fastai, and nothing else: `import fastai_resume` applies them, once.

Each replaced function is kept by fastcore's `@patch` as `Learner._orig_<name>` (set on the first patch
only, so applying this module again is harmless), and each body below names what it replaces. Tested on
the fastai releases `compat` names; a newer fastai that changes one of these loops is caught by the
source-hash test.

- `Learner.save(file, with_iter=False)`: `with_iter=True` writes the `.frk` checkpoint (atomic).
- `Learner.load(file, resume=True, fast_forward=False)`: reads either format (told by magic bytes),
  validates before touching the learner, arms the resume of a checkpoint saved mid-fit.
- `Learner.fit(..., start_iter=None, resume=True)` and the wrappers `fit_one_cycle`, `fit_flat_cos`,
  `fit_sgdr`, `fine_tune` (patched when `fastai.callback.schedule` is first imported, so importing
  fastai_resume imports nothing the user did not): each top-level call is a stage of the script.
- `Learner._call_one` (fastai 2.8: `for cb in self.cbs.sorted('order'): cb(event_name)`), `_do_fit`
  (the epoch loop) and `all_batches` (the batch loop): the same loops, with the resume session's hooks.
- `Learner.export`: the fit's resume session (a C object) is never pickled.
"""

from __future__ import annotations

import inspect

from fastai.callback.core import CancelEpochException, event
from fastai.learner import Learner, load_model, save_model
from fastai.torch_core import rank_distrib
from fastcore.basics import patch, patch_to
from fastcore.foundation import L
from fastcore.meta import delegates

from . import _core, check, checkpoint, dist, io, loaders, paths, state
from ._hooks import imported
from .io import CheckpointError
from .session import Armed, FitPlan, ResumeSession, script, session_of, stage_call

__all__ = ["apply"]

_WRAPPERS = ("fit_one_cycle", "fit_flat_cos", "fit_sgdr", "fine_tune")


def _is_lr_find(cbs) -> bool:
    return any(type(c).__name__ == "LRFinder" for c in L(cbs))


def _check_same_fit(learn, pos, n_epoch):
    "A resumed fit must be the fit that was saved, or the result silently changes."
    ws_saved, ws = pos["world_size"], dist.world()
    if ws_saved != ws:
        raise ValueError(
            f"this checkpoint was saved by a fit of {ws_saved} process(es) and this fit runs {ws}: each rank's "
            f"position, RNG state and share of the data belong to {ws_saved}. Launch {ws_saved} processes to "
            f"resume exactly; or pass start_epoch (and start_iter) to continue anyway from the checkpoint's "
            f"model and optimizer, re-sharded for {ws} (not the uninterrupted run's result); or resume=False "
            "to start over."
        )
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


def _run_fit(learn, sc, st, n_epoch, lr, wd, cbs, reset_opt, start_epoch, start_iter, resume):
    "One fit of stage `st`: skipped, resumed or run, with its `ResumeSession`."
    fit_index = st.fits
    st.fits += 1
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
    target = _core.skip_plan(
        saved is not None,
        pos["epoch"] if saved else 0,
        pos["iter"] if saved else 0,
        start_epoch if start_epoch else -1,
        -1 if start_iter is None else start_iter,
    )
    if saved is not None and not explicit:
        _check_same_fit(learn, pos, n_epoch)  # raises: still armed
    sc.armed = None  # consumed by this fit
    if explicit and saved is not None and (target != (pos["epoch"], pos["iter"]) or pos["world_size"] != dist.world()):
        saved = None  # another position or sharding: the model and optimizer, not the saved state
    s = ResumeSession(
        FitPlan(
            st,
            fit_index,
            saved,
            target,
            a.path if a is not None else None,
            a.opt if saved is not None else None,
            a.fast_forward if a is not None else False,
        )
    )
    sc.session = s
    sc.fit_depth += 1
    try:
        probe = check.probe_for(learn)  # only under `fastai-resume check`
        learn._orig_fit(n_epoch, lr=lr, wd=wd, cbs=L(s) + L(cbs) + L(probe), reset_opt=reset_opt, start_epoch=0)
    except BaseException:
        from .session import Interrupted

        sc.interrupted = Interrupted(st.index, getattr(learn, "epoch", 0), getattr(learn, "iter", 0))
        raise
    finally:
        sc.fit_depth -= 1
        sc.session = None


# ---- the patches --------------------------------------------------------------------------------


@patch
def _call_one(self: Learner, event_name):
    "fastai's `_call_one`; inside a resumable fit, through the session (so a save can complete the event)."
    if event_name in ("before_fit", "before_validate") and dist.active():
        dist.patch_distributed_dl()
    s = session_of(self)
    if s is None:
        return self._orig__call_one(event_name)
    if not hasattr(event, event_name):
        raise Exception(f"missing {event_name}")
    s.run_event(self, event_name)


@patch
def _do_fit(self: Learner):
    "fastai's epoch loop; epochs finished before the checkpoint run nothing."
    s = session_of(self)
    if s is None:
        return self._orig__do_fit()
    for epoch in range(self.n_epoch):
        self.epoch = epoch
        if s.skips(epoch):
            continue
        self._with_events(self._do_epoch, "epoch", CancelEpochException)
        s.skip.after_epoch(epoch)
    s.end_of_epochs()


@patch
def all_batches(self: Learner):
    "fastai's batch loop; a resumed epoch counts from its first kept batch."
    s = session_of(self)
    if s is None or not self.training or not s.first_iter:
        return self._orig_all_batches()
    self.n_iter = len(self.dl)
    it = iter(self.dl)
    if s.fast_forwarding:
        n, s.fast_forwarding = s.fast_forwarding, 0
        for i in range(n):  # a stream without state: read and discard what was trained before the save
            if next(it, None) is None:
                break
            if (i + 1) % max(1, n // 10) == 0 or i + 1 == n:
                print(f"fastai_resume: fast-forward {i + 1}/{n} batches")
        s._restore_saved_rng()
    for i, b in enumerate(it, s.first_iter):
        s.batch_fetched()
        self.one_batch(i, b)


@patch
@delegates(save_model)
def save(self: Learner, file, with_iter=False, **kwargs):
    """Save model and optimizer state (if `with_opt`) to `self.path/self.model_dir/file`.
    `with_iter=True` also saves the exact training position and everything needed to continue
    from it (fastai_resume format, extension `.frk`, written atomically); callable from a callback mid-fit."""
    with_opt = kwargs.pop("with_opt", True)
    if with_iter and not with_opt:
        raise ValueError("save(with_iter=True) needs the optimizer state: drop with_opt=False")
    if not with_iter:
        return self._orig_save(file, with_opt=with_opt, **kwargs)
    if not paths.is_path(file):
        raise TypeError("save(with_iter=True) writes a file atomically: give a name or a path, not a buffer")
    if rank_distrib() and not dist.active():
        return  # only rank 0 writes, as fastai does
    path = paths.with_ext(paths.resolve(self, file))
    checkpoint.commit(lambda: checkpoint.build_tree(self, with_opt, with_iter), path)  # under DDP: collective
    return path


def _load_tree(learn, path, tree, device, with_opt, strict):
    "Model and optimizer from a validated tree; nothing is changed unless everything fits."
    from fastai.torch_core import get_model, to_device

    model = get_model(learn.model)
    bad = checkpoint.model_mismatch(model.state_dict(), tree["model"], strict)
    if bad:
        raise CheckpointError(f"{path} does not fit this learner's model: {bad}")
    bad = strict and checkpoint.grads_mismatch(tree.get("train") or {}, len(list(learn.model.parameters())))
    if bad:  # (strict=False: checked when a resume restores them)
        raise CheckpointError(f"{path}: malformed training state: {bad}")
    prev_opt = None
    if with_opt and "opt" in tree:
        bad = checkpoint.opt_mismatch(learn.opt, tree["opt"])
        if bad:
            raise CheckpointError(f"{path}: its optimizer state does not fit this learner's optimizer: {bad}")
        opt_sd = to_device(tree["opt"], device) if device is not None and str(device) != "cpu" else tree["opt"]
        prev_opt = learn.opt.state_dict()
        try:
            learn.opt.load_state_dict(opt_sd)
        except (AssertionError, KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:
            learn.opt.load_state_dict(prev_opt)
            raise CheckpointError(
                f"{path}: its optimizer state does not fit this learner's optimizer "
                f"(different parameter groups?): {e!r}"
            ) from None
    try:
        model.load_state_dict(tree["model"], strict=strict)
    except RuntimeError as e:  # checked above; kept for what torch checks beyond keys, dtypes and shapes
        if prev_opt is not None:
            learn.opt.load_state_dict(prev_opt)
        raise CheckpointError(f"{path} does not fit this learner's model: {e}") from None


@patch
@delegates(load_model)
def load(self: Learner, file, device=None, resume=True, fast_forward=False, **kwargs):
    """Load model and optimizer state (if `with_opt`) from `self.path/self.model_dir/file` (or a buffer).
    A fastai_resume checkpoint saved mid-fit also arms the resume: the next training call of the same
    stage continues at the saved position (`resume=False` loads the weights only). The format is told
    by the file's magic bytes, never its name; vanilla fastai files load as fastai loads them.
    `fast_forward=True`: a stream without state_dict/load_state_dict is resumed by reading and
    discarding the batches trained before the save."""
    if not paths.is_path(file):
        return self._orig_load(file, device=device, **kwargs)  # a buffer: fastai's
    sc = script(self)
    inside = sc.fit_depth > 0  # a callback's load during a fit (LRFinder's _tmp, SaveModelCallback's best)
    cands = paths.load_candidates(self, file)
    path = cands[0] if cands else None
    if path is None or not io.is_checkpoint(path):
        if not inside and sc.armed is not None:
            sc.disarm(f"learn.load({str(file)!r}) loads another file")
        if path is None:
            return self._orig_load(file, device=device, **kwargs)  # fastai's own error
        with open(path, "rb") as f:  # the file found, whatever its name (fastai would append '.pth')
            return self._orig_load(f, device=device, **kwargs)
    with_opt, strict = kwargs.get("with_opt", True), kwargs.get("strict", True)
    if device is None and hasattr(self.dls, "device"):
        device = self.dls.device
    if self.opt is None:
        self.create_opt()
    tree = checkpoint.read(path)
    _load_tree(self, path, tree, device, with_opt, strict)
    train = tree.get("train")
    if inside:
        return self
    if resume and train is not None:
        if sc.armed is not None and sc.armed.path != path:
            print(f"fastai_resume: {path} replaces the armed {sc.armed.path}")
        # the optimizer now uses the tree's tensors in place: the resume keeps its own copy (lr_find, or any
        # training before the resumed stage, must not change what the resume restores)
        sc.armed = Armed(train, path, checkpoint.cloned(tree.get("opt")), fast_forward)
    elif sc.armed is not None:
        sc.disarm(
            f"learn.load({str(file)!r}) loads "
            + ("without resuming" if train is not None else "a file saved outside a fit")
        )
    return self


@patch
def fit(
    self: Learner, n_epoch, lr=None, wd=None, cbs=None, reset_opt=False, start_epoch=0, start_iter=None, resume=True
):
    """fastai's `fit`, resumable: after `learn.load` of a checkpoint saved mid-fit, the same stage of the
    script continues at the saved epoch and iteration. `start_epoch` / `start_iter` override the saved
    position; `resume=False` ignores it."""
    sc = script(self)
    if sc.fit_depth or _is_lr_find(cbs):  # a fit inside a fit, or lr_find: fastai's own, no stage
        sc.fit_depth += 1
        try:
            return self._orig_fit(n_epoch, lr=lr, wd=wd, cbs=cbs, reset_opt=reset_opt, start_epoch=start_epoch)
        finally:
            sc.fit_depth -= 1
    bound = _FIT_SIG.bind(self, n_epoch, lr, wd, cbs, reset_opt, start_epoch)
    with stage_call(self, "fit", bound, start_epoch, start_iter, resume, cbs=L(cbs)) as st:
        return _run_fit(self, sc, st, n_epoch, lr, wd, cbs, reset_opt, start_epoch, start_iter, resume)


_FIT_SIG = inspect.signature(Learner._orig_fit)


@patch
def export(self: Learner, fname="export.pkl", **kwargs):
    "fastai's `export`, without the fit's resume session (never part of a model for inference)."
    sessions = [cb for cb in self.cbs if isinstance(cb, ResumeSession)]
    if not sessions:
        return self._orig_export(fname, **kwargs)
    with self.removed_cbs(sessions):
        return self._orig_export(fname, **kwargs)


def _wrap_fit_method(name):
    "Makes a fit wrapper a stage of the script, with `start_iter` and `resume` (and `start_epoch` passed on)."
    orig = getattr(Learner, "_orig_" + name, None) or getattr(Learner, name)
    sig = inspect.signature(orig)

    def wrapper(self, *args, start_iter=None, resume=True, **kwargs):
        sc = script(self)
        if sc.stage is not None or sc.fit_depth:
            return orig(self, *args, **kwargs)  # fine_tune -> fit_one_cycle
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        start_epoch = bound.arguments.get("start_epoch") or (bound.arguments.get("kwargs") or {}).get("start_epoch", 0)
        cbs = bound.arguments.get("cbs") or (bound.arguments.get("kwargs") or {}).get("cbs")
        with stage_call(self, name, bound, start_epoch, start_iter, resume, cbs=L(cbs)):
            return orig(self, *args, **kwargs)

    wrapper.__doc__ = orig.__doc__
    params = list(sig.parameters.values())
    extra = [
        inspect.Parameter("start_iter", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=True),
    ]
    var_kw = [p for p in params if p.kind == p.VAR_KEYWORD]
    params = [p for p in params if p.kind != p.VAR_KEYWORD] + extra + var_kw
    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__name__ = name
    patch_to(Learner, nm=name)(wrapper)


def _patch_schedule() -> None:
    for name in _WRAPPERS:
        _wrap_fit_method(name)


def apply() -> None:
    "Once per process: the lazy Recorder losses, and the fit wrappers as soon as fastai defines them."
    from .compat import check_fastai_version

    check_fastai_version()
    state.install_lazy_losses()
    if imported("fastai.callback.schedule"):
        _patch_schedule()  # else `fastai_resume/__init__`'s hook does it


apply()
