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

import functools
import inspect
from pathlib import Path
from typing import Any

import torch
import torch.distributed as D
from fastai.callback.core import CancelEpochException, event
from fastai.learner import Learner, Recorder, load_model, save_model
from fastai.torch_core import rank_distrib
from fastcore.basics import patch, patch_to
from fastcore.foundation import L
from fastcore.meta import delegates

from . import between, checkpoint, dist, frozen, io, objstore, paths, state, store
from ._hooks import imported
from .compat import check_fastai_version
from .fastai_classes import fastai_class, is_a
from .io import CheckpointError
from .script import Armed, script, session_of
from .session import ResumeSession, run_fit
from .stages import stage_call

__all__ = ["apply"]

_WRAPPERS = ("fit_one_cycle", "fit_flat_cos", "fit_sgdr", "fine_tune")


def _is_lr_find(cbs) -> bool:
    return any(is_a(c, "fastai.callback.schedule", "LRFinder") for c in L(cbs))


# ---- the patches --------------------------------------------------------------------------------


@patch
def _call_one(self: Learner, event_name):
    "fastai's `_call_one`; inside a resumable fit, through the session (so a save can complete the event)."
    s = session_of(self)
    if s is None:
        return self._orig__call_one(event_name)
    if not hasattr(event, event_name):
        raise Exception(f"missing {event_name}")
    s.frames.run(self, event_name)


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
        for i in range(n):  # a stream's replay: read and discard what was trained before the save
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
def save(self: Learner, file, with_iter=False, full=False, **kwargs):
    """Save model and optimizer state (if `with_opt`) to `self.path/self.model_dir/file`.
    `with_iter=True` also saves the exact training position and everything needed to continue
    from it (fastai_resume format, extension `.frk`, written atomically); callable from a callback mid-fit.
    Such a file holds what training can change, the frozen parameters by fingerprint (checked against the
    learner on load); `full=True` holds every tensor."""
    with_opt = kwargs.pop("with_opt", True)
    if with_iter and not with_opt:
        raise ValueError("save(with_iter=True) needs the optimizer state: drop with_opt=False")
    if not with_iter and paths.is_path(file) and dist.sharded(self.model):  # fastai's would pickle rank 0's part
        path = paths.with_ext(paths.resolve(self, file))  # a sharded checkpoint of the model, no position
        store.save(self, path, lambda: checkpoint.model_tree(self, with_opt, full))
        return path
    if not with_iter:
        if not paths.is_path(file):
            return self._orig_save(file, with_opt=with_opt, **kwargs)
        target = paths.resolve(self, file)
        target = target.with_name(target.name + ".pth")  # fastai's join_path_file appends it
        return between.write_or_keep(
            self,
            "save",
            target,
            lambda: self._orig_save(file, with_opt=with_opt, **kwargs),
            f"learn.save({str(file)!r})",
        )
    if not paths.is_path(file):
        raise TypeError("save(with_iter=True) writes a file atomically: give a name or a path, not a buffer")
    _SAVES_WITH_ITER[0] += 1
    path = paths.with_ext(paths.resolve(self, file))
    sc = script(self)
    if sc.stage is not None and sc.session is not None:
        sc.stage.saved_in(path.parent, path.name[: -len(io.EXT)])
    if sc.session is not None:
        sc.session.saving(path)
    if rank_distrib() and not dist.active():
        return  # only rank 0 writes, as fastai does
    build = functools.partial(checkpoint.build_tree, self, with_opt, with_iter, full)
    commit = functools.partial(store.save, self, path, build)  # (DDP, sharded: collective)
    if sc.session is None and not sc.fit_depth and not dist.active():
        # between stages (no position): a file like a named `.pth`, kept where the uninterrupted run wrote it,
        # never written again by a rerun from a state that is not that run's (`between`)
        between.write_or_keep(self, "save", path, commit, f"learn.save({str(file)!r}, with_iter=True)")
    else:
        commit()
    return path


_SAVES_WITH_ITER = [0]  # resumable saves made by `Learner.save`: a subclass's `save` that drops `with_iter` is caught


def _found_checkpoint(learn, file):
    "The file `learn.load(file)` reads, and whether it is ours: `(path or None, is ours)`."
    if objstore.is_url(file):  # s3://..., file://...: downloaded into the model folder first (`objstore.fetch`)
        path = objstore.fetch(learn, file)
        return path, io.is_checkpoint(path)
    if not paths.is_path(file):
        return None, False
    cands = paths.load_candidates(learn, file)
    path = cands[0] if cands else None
    return path, path is not None and (path.is_dir() or io.is_checkpoint(path))  # a folder: a sharded checkpoint


def _load_ours(learn, path, file, device, resume, fast_forward, with_opt, strict):
    "Our checkpoint at `path` into `learn` (validated first), arming the resume of one saved mid-fit."
    sc = script(learn)
    inside = sc.fit_depth > 0  # a callback's load during a fit (LRFinder's _tmp, SaveModelCallback's best)
    if device is None and hasattr(learn.dls, "device"):
        device = learn.dls.device
    if learn.opt is None:
        learn.create_opt()
    tree = store.read(path, learn)  # (a file, or a sharded checkpoint's folder; as this model is sharded)
    train = checkpoint.training(tree)
    arms = resume and train is not None and not inside
    later = _not_now(learn, sc, tree) if arms else None
    checked = checkpoint.load_tree(learn, path, tree, device, with_opt, strict, defer_frozen=arms, apply=later is None)
    if inside:
        return learn
    if arms:
        if sc.armed is not None and sc.armed.path != path:
            print(f"fastai_resume: {path} replaces the armed {sc.armed.path}")
        # The resumed fit puts the checkpoint's model and optimizer back, whatever the script did to the
        # learner between here and that fit (stage ends restored, a named model loaded, load_encoder, its own
        # code), from the tree the load read (the optimizer's copied: a fit before it must not change them).
        sc.armed = Armed(train, path, checkpoint.cloned(tree.get("opt")), fast_forward, tree["model"])
        sc.armed.frozen = checked
        if later is not None:  # the learner is the script's own: what the uninterrupted run had at this line
            sc.armed.divergent = None
            print(f"fastai_resume: {path} armed; the learner takes its state as its fit resumes ({later})")
    else:
        _between_load(
            learn, file, path, "loads " + ("without resuming" if train is not None else "a file saved outside a fit")
        )
    return learn


def _not_now(learn, sc, tree) -> str | None:
    """Why a load that arms a resume leaves the learner as it is (the resumed fit puts the checkpoint's
    model and optimizer in as it starts, whatever ran before it), or None: it loads them now, as fastai's
    load does. Left as it is: for stages to pass first (each is to end in its own end state, whose frozen
    tensors are referenced, on the learner the script built), where the learner does not hold every frozen
    tensor the file references yet (another base, or one the script loads before the fit: load_encoder;
    the fit refuses unless it then does), or where the file holds frozen tensors its stage changed (the
    stage is to begin with the script's own, as the uninterrupted run's did)."""
    from fastai.torch_core import get_model

    if checkpoint.position(tree)["stage"] > len(sc.signatures):  # type: ignore[index]
        return "stages come first"
    model = get_model(learn.model)
    # (inside a stage's beginning, AutoCheckpoint's load: the stage's fingerprints were just taken)
    pending = frozen.not_yet(model, tree, known=sc.base if sc.stage is not None else None)
    if pending:
        return f"{len(pending)} of the frozen tensors it references are not this learner's yet, the first {pending[0]}"
    held = frozen.held_frozen(model, tree)
    if held:
        return f"it holds frozen tensors its stage changed, the first {held[0]}"
    return None


def _between_load(learn, file, path, why, op="load") -> None:
    """A load between stages of a file that is not a checkpoint to resume: part of the script when the
    uninterrupted run made it here too (`between.loaded`), else a new intent that cancels an armed resume."""
    sc = script(learn)
    if sc.fit_depth:
        return
    same = path is not None and between.loaded(learn, op, path)
    if sc.armed is not None and not same:
        sc.disarm(f"learn.{op}({str(file)!r}) {why}")


def _load_theirs(learn, file, path, load):
    "A file that is not ours: fastai's (or a subclass's) own `load`, given the file found whatever its name."
    _between_load(learn, file, path, "loads another file")
    if path is None:
        return load(file)  # fastai's own error, or a buffer
    with open(path, "rb") as f:  # fastai would append '.pth' to a name that has another extension
        return load(f)


@patch
@delegates(load_model)
def load(self: Learner, file, device=None, resume=True, fast_forward=False, **kwargs):
    """Load model and optimizer state (if `with_opt`) from `self.path/self.model_dir/file` (or a buffer, or a
    URL such as `s3://bucket/run/NAME.frk`, downloaded into the model folder first).
    A fastai_resume checkpoint saved mid-fit also arms the resume: the next training call of the same
    stage continues at the saved position (`resume=False` loads the weights only). The format is told
    by the file's magic bytes, never its name; vanilla fastai files load as fastai loads them.
    `fast_forward=True`: a stream without state_dict/load_state_dict is resumed by reading and
    discarding the batches trained before the save."""
    path, ours = _found_checkpoint(self, file)
    if not ours:
        return _load_theirs(self, file, path, lambda f: self._orig_load(f, device=device, **kwargs))
    resume, fast_forward = _LOAD_DEFAULTS.get((resume, fast_forward))
    return _load_ours(
        self, path, file, device, resume, fast_forward, kwargs.get("with_opt", True), kwargs.get("strict", True)
    )


class _LoadDefaults:
    """`resume`/`fast_forward` given to a subclass's `load` that reaches `Learner.load` through `super()`
    without passing them on (its signature may not have them)."""

    def __init__(self):
        self.stack: list = []

    def get(self, given):
        return self.stack[-1] if self.stack and given == (True, False) else given


_LOAD_DEFAULTS = _LoadDefaults()


@patch
def fit(
    self: Learner, n_epoch, lr=None, wd=None, cbs=None, reset_opt=False, start_epoch=0, start_iter=None, resume=True
):
    """fastai's `fit`, resumable: after `learn.load` of a checkpoint saved mid-fit, the same stage of the
    script continues at the saved epoch and iteration. `start_epoch` / `start_iter` override the saved
    position; `resume=False` ignores it."""
    sc = script(self)
    if sc.fit_depth or _is_lr_find(cbs):  # a fit inside a fit, or lr_find: fastai's own, no stage

        def run():
            sc.fit_depth += 1
            try:
                return self._orig_fit(n_epoch, lr=lr, wd=wd, cbs=cbs, reset_opt=reset_opt, start_epoch=start_epoch)
            finally:
                sc.fit_depth -= 1

        return run() if sc.fit_depth or sc.stage is not None else between.lr_find_fit(self, run)
    bound = _FIT_SIG.bind(self, n_epoch, lr, wd, cbs, reset_opt, start_epoch)
    with stage_call(self, "fit", bound, start_epoch, start_iter, resume, cbs=L(cbs)) as st:
        return run_fit(self, sc, st, n_epoch, lr, wd, cbs, reset_opt, start_epoch, start_iter, resume)


_FIT_SIG = inspect.signature(Learner._orig_fit)


@patch
def export(self: Learner, fname="export.pkl", **kwargs):
    "fastai's `export`, without the fit's resume session (never part of a model for inference)."
    sessions = [cb for cb in self.cbs if isinstance(cb, ResumeSession)]

    def write():
        if not sessions:
            return self._orig_export(fname, **kwargs)
        with self.removed_cbs(sessions):
            return self._orig_export(fname, **kwargs)

    if not paths.is_path(fname) or rank_distrib():
        return write()
    return between.write_or_keep(self, "export", Path(self.path) / fname, write, f"learn.export({str(fname)!r})")


@patch
def validate(self: Learner, ds_idx=1, dl=None, cbs=None):
    "fastai's `validate`; between the stages of a rerun, the uninterrupted run's result (`between`)."
    run = lambda: self._orig_validate(ds_idx=ds_idx, dl=dl, cbs=cbs)  # noqa: E731
    if script(self).fit_depth or dl is not None or ds_idx != 1:
        return run()
    return between.validated(self, run, "learn.validate()")


@patch
def get_preds(self: Learner, *args, **kwargs):
    "fastai's `get_preds`; of a dataset between the stages of a rerun, as the uninterrupted run's (`between`)."
    run = lambda: self._orig_get_preds(*args, **kwargs)  # noqa: E731
    if script(self).fit_depth or kwargs.get("dl") is not None or (len(args) > 1 and args[1] is not None):
        return run()
    return between.predicted(self, run, "learn.get_preds()")


Learner.get_preds.__signature__ = inspect.signature(Learner._orig_get_preds)


# ---- Learner subclasses with their own load or save ---------------------------------------------

# Subclasses whose own `load` does, for a file of ours, nothing beyond what `Learner.load` does:
# fastai's TextLearner (its load reads `.pth` files with `torch.load` and cleans AWD-LSTM's raw weights).
_KNOWN_LOADS = {"fastai.text.learner.TextLearner"}


def _calls_super(f) -> bool:
    "Does `f` (a method) call `super()` or `Learner.<something>` (so it reaches the patched `Learner`)?"
    code = getattr(f, "__code__", None)
    return code is not None and ("super" in code.co_names or "Learner" in code.co_names)


def _with_keywords(f, extra):
    "`f`'s signature with keyword-only parameters `extra` added (before its `**kwargs`)."
    sig = inspect.signature(f)
    params = [p for p in sig.parameters.values() if p.name not in {e.name for e in extra}]
    var_kw = [p for p in params if p.kind == p.VAR_KEYWORD]
    return sig.replace(parameters=[p for p in params if p.kind != p.VAR_KEYWORD] + extra + var_kw)


def _warn_bypassed(cls, name, path):
    import warnings

    warnings.warn(
        f"{cls.__qualname__}.{name} is its own and does not call Learner.{name}: fastai_resume {name}ed "
        f"{path} itself, without the rest of {cls.__qualname__}.{name}. If that method does more than "
        f"fastai's (reads or writes other files), call super().{name}(...) in it for fastai_resume checkpoints.",
        stacklevel=3,
    )


def _cover_load(cls, f):
    "`cls.load` (its own): our checkpoints are loaded by fastai_resume, never handed to a pickle load."
    known = f"{cls.__module__}.{cls.__qualname__}" in _KNOWN_LOADS
    via_super = _calls_super(f) and not known
    sig = inspect.signature(f)

    def load(self, file, *args, resume=True, fast_forward=False, **kwargs):
        path, ours = _found_checkpoint(self, file)
        if not ours:  # (a subclass of the user's gets the name it was given, as it expects)
            return _load_theirs(self, file, path, lambda g: f(self, g if known else file, *args, **kwargs))
        if via_super:  # it reaches `Learner.load`, perhaps without these two
            _LOAD_DEFAULTS.stack.append((resume, fast_forward))
            try:
                return f(self, file, *args, **kwargs)
            finally:
                _LOAD_DEFAULTS.stack.pop()
        if not known:
            _warn_bypassed(cls, "load", path)
        given = sig.bind_partial(self, file, *args, **kwargs).arguments
        extra = given.get("kwargs", {})
        with_opt = given.get("with_opt", extra.get("with_opt"))
        return _load_ours(
            self,
            path,
            file,
            given.get("device", extra.get("device")),
            resume,
            fast_forward,
            True if with_opt is None else with_opt,
            given.get("strict", extra.get("strict", True)),
        )

    load.__signature__ = _with_keywords(
        f,
        [
            inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=True),
            inspect.Parameter("fast_forward", inspect.Parameter.KEYWORD_ONLY, default=False),
        ],
    )
    return load


def _cover_save(cls, f):
    "`cls.save` (its own): a resumable save is written by `Learner.save`, or refused loudly."
    via_super = _calls_super(f)

    def save(self, file, *args, with_iter=False, **kwargs):
        if not with_iter:
            return f(self, file, *args, **kwargs)
        if not via_super:
            _warn_bypassed(cls, "save", paths.resolve(self, file))
            return Learner.save(self, file, *args, with_iter=True, **kwargs)
        before = _SAVES_WITH_ITER[0]
        out = f(self, file, *args, with_iter=True, **kwargs)
        if _SAVES_WITH_ITER[0] == before and rank_distrib() == 0:
            raise CheckpointError(
                f"{cls.__qualname__}.save did not pass with_iter=True on to Learner.save: no resumable "
                f"checkpoint of {file!r} was written. Pass it on (super().save(file, **kwargs))."
            )
        return out

    save.__signature__ = _with_keywords(
        f, [inspect.Parameter("with_iter", inspect.Parameter.KEYWORD_ONLY, default=False)]
    )
    return save


def _cover_encoder(cls, f, op):
    "TextLearner's `save_encoder` / `load_encoder`: between stages, part of the script (`between`)."

    def path_of(self, file):
        return paths.resolve(self, file).with_name(Path(file).name + ".pth")

    if op == "save_encoder":

        def method(self, file, *args, **kwargs):
            if rank_distrib() or not paths.is_path(file):
                return f(self, file, *args, **kwargs)
            return between.write_or_keep(
                self, op, path_of(self, file), lambda: f(self, file, *args, **kwargs), f"learn.{op}({str(file)!r})"
            )

    else:

        def method(self, file, *args, **kwargs):
            if paths.is_path(file):
                _between_load(self, file, path_of(self, file), "loads an encoder", op)
            return f(self, file, *args, **kwargs)

    method.__signature__ = inspect.signature(f)
    return method


_ENCODERS = {"save_encoder", "load_encoder"}


def cover_subclass(cls) -> None:
    "Put fastai_resume in front of the `load` and `save` that a Learner subclass defines itself (once)."
    known = f"{cls.__module__}.{cls.__qualname__}" in _KNOWN_LOADS
    for name in ("load", "save", *(sorted(_ENCODERS) if known else ())):
        f = cls.__dict__.get(name)
        if f is None or getattr(f, "_frk_cover", False) or not callable(f):
            continue
        g: Any = (
            _cover_load(cls, f)
            if name == "load"
            else _cover_save(cls, f)
            if name == "save"
            else _cover_encoder(cls, f, name)
        )
        g.__name__, g.__qualname__, g.__doc__ = name, f"{cls.__qualname__}.{name}", f.__doc__
        g._frk_cover = True
        g.__wrapped_original__ = f
        setattr(cls, name, g)


def _cover_subclasses() -> None:
    "Every Learner subclass there is, and every one defined later (`__init_subclass__`)."
    todo = list(Learner.__subclasses__())
    while todo:
        c = todo.pop()
        cover_subclass(c)
        todo += c.__subclasses__()
    if "__init_subclass__" not in Learner.__dict__:

        def __init_subclass__(cls, **kwargs):
            super(Learner, cls).__init_subclass__(**kwargs)
            cover_subclass(cls)

        Learner.__init_subclass__ = classmethod(__init_subclass__)


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


# ---- elsewhere in fastai ----------------------------------------------------------------------


def _broadcast_idxs(self, t, src):
    "`DistributedDL._broadcast` that keeps the tensor on the CPU unless the backend is NCCL (one process: as is)."
    if not dist.active():
        return list(t)
    dev = torch.device("cuda", torch.cuda.current_device()) if D.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(t, dtype=torch.long, device=dev)
    D.broadcast(t, src)
    return t.cpu().tolist()


_DDL_ORIG: dict = {}  # DistributedDL's own methods, for loaders over an index list


def _ddl_len(self):
    "`DistributedDL.__len__`; over a stream, the rank's own loader's (each rank reads its own split)."
    return len(self.dl) if not self.dl.indexed else _DDL_ORIG["__len__"](self)


def _ddl_get_idxs(self):
    """`DistributedDL.get_idxs`; over a stream (a list of `None`s, nothing to broadcast or cut) the rank's
    own loader's: each rank reads its own split of the stream (`split_dataset_by_node`), `n` items an epoch."""
    if self.dl.indexed:
        return _DDL_ORIG["get_idxs"](self)
    idxs = self.dl.get_idxs()
    self.n = self.dl.n
    return idxs


def patch_distributed_dl() -> None:
    """Once `fastai.distributed` is imported: fastai's `DistributedDL` broadcasts each epoch's index list as a
    CUDA tensor, which needs a GPU; on a non-NCCL process group (or none) it stays on the CPU. Over a stream
    it broadcasts a list of `None`s (a TypeError): each rank reads its own split instead."""
    ddl = fastai_class("fastai.distributed", "DistributedDL")
    if ddl is not None and getattr(ddl._broadcast, "__name__", "") != "_broadcast_idxs":
        ddl._broadcast = _broadcast_idxs
        _DDL_ORIG.update(__len__=ddl.__len__, get_idxs=ddl.get_idxs)
        ddl.__len__, ddl.get_idxs = _ddl_len, _ddl_get_idxs


def _install_lazy_losses() -> None:
    "`Recorder.losses` restored from a checkpoint is rebuilt on its first read (`state.RecorderLosses`)."
    if not isinstance(Recorder.__dict__.get("losses"), state.RecorderLosses):
        Recorder.losses = state.RecorderLosses()


def apply() -> None:
    "Once per process: the lazy Recorder losses; the fit wrappers and `DistributedDL` as soon as fastai defines them."
    check_fastai_version()
    _install_lazy_losses()
    _cover_subclasses()
    if imported("fastai.callback.schedule"):
        _patch_schedule()  # else `fastai_resume/__init__`'s hook does it
    if imported("fastai.distributed"):
        patch_distributed_dl()  # (the same)


apply()
