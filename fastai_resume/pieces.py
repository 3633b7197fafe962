"""The training state as a table of pieces. Each `Piece` (the RNG, the loaders, the Recorder, the models'
hidden state, the hyper-parameters, the gradients, the callbacks, ...) declares once the keys it writes,
how it is captured, how a file's copy of it is checked, and how it is restored; `CHECKPOINT` is the layout
of a checkpoint's `train`, `STAGE_END` that of a stage's end state (`between`), each built by walking its
table in order (`trainstate`). A piece both layouts hold alike (the modules' hidden state, the callbacks)
is one entry in both. Adding a piece of training state is adding it to a table, and its test.

    train = {"position": {epoch, iter, n_epoch, n_iter, bs, fit_index, stage, train_iter, pct_train,
                          world_size, loader_done, n_iter_all},
             "stages": [each stage's signature so far], "rng_stage": RNG when the stage began,
             "rng", "rng_valid", "rng_epoch", "loaders_now", "loaders_epoch", "recorder", "modules":
                 this rank's (under DDP "ranks" holds every other rank's),
             "hypers", "grads", "grad_set", "trainable", "rows", "callbacks",
             "script": {"ends": the stage ends before this stage, "log": the between-stage calls}}
    end = {"stage", "token", "signature", "rng", "loaders", "modules", "recorder", "ranks", "callbacks",
           "grad_set", "trainable", "training", "learner", "rows"}

A check raises `fields.Bad` naming the field (`train.position.epoch: ...`); `trainstate` turns the first
into a `CheckpointError`, so a wrong or hostile file is refused before anything is changed.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastcore.foundation import L

from . import callbacks, dist, loaders, state
from .fields import a_dict, a_list, a_number, a_tensor, an_int, need
from .loaders import check_loader
from .state import check_modules, check_recorder, check_rng, recorder_numbers, set_recorder_numbers

__all__ = ["Now", "Piece", "CHECKPOINT", "STAGE_END", "check_script", "script_part", "saved_rng", "grads_mismatch"]


@dataclass
class Now:
    """What a capture sees: the learner, and for a checkpoint the fit's session `s` and where the fit is;
    for a stage's end the stage `st` (`ending`)."""

    learn: Any
    st: Any
    s: Any = None
    ending: bool = False
    epoch: int = 0
    it: int = 0
    n_iter: int = 0
    validating: bool = False  # saved during the validation that ends the epoch
    boundary: bool = False  # saved at the epoch's start
    loader_done: bool = False

    @functools.cached_property
    def params(self) -> list:
        "The model's parameters, in order (walked once per capture: several pieces read them)."
        return [p for _, p in dist.named_parameters(self.learn.model)]


@dataclass(frozen=True)
class Piece:
    """One part of the training state. `keys`: what it writes in its layout, in order (each required when a
    file is read, but those in `optional`, which older files may lack). `per_rank`: it differs
    between the ranks of a data-parallel fit (rank 0's at the top, every other rank's under `ranks`).
    `capture(now) -> {key: value}`; `check(tree, where)` raises `Bad` naming a malformed field of `tree`
    (the layout's dict, or a rank's part; `where` its path). `agree(learn, tree) -> str`: what makes it
    unfit for this learner ('' if nothing), judged before anything is changed (`agree_loaded`: once the
    checkpoint's optimizer state is in, which it reads), before any piece is restored. The restores, each where
    its layout is restored: `at_fit(learn, tree)` as a resumed fit starts, `at_epoch(learn, tree, at_save,
    k)` as its epoch starts `k` batches in, `at_end(learn, end)` as a skipped stage's end is restored."""

    keys: tuple
    capture: Callable
    check: Callable | None = None
    optional: tuple = ()
    per_rank: bool = False
    agree: Callable | None = None
    agree_loaded: bool = False
    at_fit: Callable | None = None
    at_epoch: Callable | None = None
    at_end: Callable | None = None

    @property
    def required(self) -> tuple:
        return tuple(k for k in self.keys if k not in self.optional)


# ---- checks of the lists a layout holds ------------------------------------------------------------------


def _loader_list(v, where) -> None:
    for i, ld in enumerate(a_list(v, where)):
        check_loader(ld, f"{where}[{i}]")


def check_script(v, where) -> None:
    "What a checkpoint carries of its script (`script_part`): the stage ends before it and the log."
    v = a_dict(v, where, ("ends", "log"))
    for i, e in enumerate(a_list(v["ends"], f"{where}.ends")):
        if e is not None:
            e = a_dict(e, f"{where}.ends[{i}]", ("file", "token"))
            need(isinstance(e["file"], str), f"{where}.ends[{i}].file", "expected a str")
            an_int(e["token"], f"{where}.ends[{i}].token")
    for i, ev in enumerate(a_list(v["log"], f"{where}.log")):
        ev = a_dict(ev, f"{where}.log[{i}]", ("at", "op", "file", "crc"))
        an_int(ev["at"], f"{where}.log[{i}].at")
        need(isinstance(ev["op"], str), f"{where}.log[{i}].op", "expected a str")
        need(ev["file"] is None or isinstance(ev["file"], str), f"{where}.log[{i}].file", "expected a str or None")
        need(ev["crc"] is None or isinstance(ev["crc"], int), f"{where}.log[{i}].crc", "expected an int or None")


def _bools(v, where) -> None:
    need(isinstance(v, (list, tuple)) and all(isinstance(b, bool) for b in v), where, "expected a list of bools")


def _check_rows(v, where) -> None:
    "The printed rows of the finished epochs: a list of lists."
    for row in a_list(v, where):
        a_list(row, f"{where}[]")


# ---- the checkpoint's pieces: where the fit is -----------------------------------------------------

_POSITION_INTS = ("epoch", "iter", "n_epoch", "n_iter", "fit_index", "stage", "train_iter", "world_size", "n_iter_all")


def _position(now: Now) -> dict:
    learn = now.learn
    return {
        "position": {
            "epoch": now.epoch,
            "iter": now.it,
            "n_epoch": now.s.n_epoch,
            "n_iter": now.n_iter,
            "bs": loaders.batch_size(learn.dls.train),
            "fit_index": now.s.fit_index,
            "stage": now.st.index,
            "train_iter": learn.train_iter,
            "pct_train": float(learn.pct_train),
            "world_size": dist.world(),
            "loader_done": now.loader_done,
            "n_iter_all": len(dist.unwrap_dl(learn.dls.train)),
        }
    }


def _check_position(t, where) -> None:
    where = f"{where}.position"
    pos = a_dict(t["position"], where, _POSITION_INTS + ("bs", "pct_train"))
    for k in _POSITION_INTS:
        an_int(pos[k], f"{where}.{k}", lo=1 if k == "world_size" else 0)
    need(pos["bs"] is None or isinstance(pos["bs"], int), f"{where}.bs", "expected an int or None")
    a_number(pos["pct_train"], f"{where}.pct_train")
    need(isinstance(pos.get("loader_done", False), bool), f"{where}.loader_done", "expected a bool")
    need(
        pos["epoch"] <= pos["n_epoch"] and pos["iter"] <= pos["n_iter"],
        where,
        f"epoch {pos['epoch']}/{pos['n_epoch']}, iteration {pos['iter']}/{pos['n_iter']} is outside the fit",
    )


def _restore_schedule(learn, sv, at_save, k) -> None:
    "The schedule's position: the one-cycle (or any) schedule continues where the save left it."
    learn.train_iter, learn.pct_train = sv["position"]["train_iter"], sv["position"]["pct_train"]


POSITION = Piece(("position",), _position, _check_position, at_epoch=_restore_schedule)


def _stages(now: Now) -> dict:
    st = now.st
    return {"stages": list(now.s.script.signatures[: st.index]) + [st.signature], "rng_stage": st.rng_start}


def _check_stages(t, where) -> None:
    "Each stage's signature so far (`stages`); the RNG as this stage began (`stages` restores it on a rerun)."
    stages = a_list(t["stages"], f"{where}.stages")
    n = t["position"]["stage"] + 1
    need(len(stages) == n, f"{where}.stages", f"{len(stages)} stages for stage {n - 1}")
    for i, s in enumerate(stages):
        s = a_dict(s, f"{where}.stages[{i}]", ("method", "args", "trainable"))
        for k in ("method", "trainable"):
            need(isinstance(s[k], str), f"{where}.stages[{i}].{k}", "expected a str")
        for k, v in a_dict(s["args"], f"{where}.stages[{i}].args").items():
            need(isinstance(k, str) and isinstance(v, str), f"{where}.stages[{i}].args", "expected str: str")
    check_rng(t["rng_stage"], f"{where}.rng_stage")


STAGES = Piece(("stages", "rng_stage"), _stages, _check_stages)


# ---- ... what differs between the ranks of a data-parallel fit ----------------------------------------


def _rngs(now: Now) -> dict:
    s = now.s
    return {
        "rng": state.rng_state(),
        "rng_valid": s.rng_valid if now.validating else None,
        "rng_epoch": s.rng_epoch if s.rng_epoch is not None and not now.boundary else state.rng_state(),
    }


def _check_rngs(t, where) -> None:
    for k in ("rng", "rng_epoch"):
        check_rng(t[k], f"{where}.{k}")
    if t.get("rng_valid") is not None:
        check_rng(t["rng_valid"], f"{where}.rng_valid")


def saved_rng(sv: dict) -> dict:
    "The RNG state the uninterrupted run continued with: at the save, or at the start of the validation it was in."
    return sv["rng"] if sv["rng_valid"] is None else sv["rng_valid"]


def _restore_rngs(learn, sv, at_save, k) -> None:
    "As at the save; else as at the epoch's start, the skip then drawing what the epoch's start drew."
    state.set_rng_state(saved_rng(sv) if at_save else sv["rng_epoch"])


RNGS = Piece(
    ("rng", "rng_valid", "rng_epoch"),
    _rngs,
    _check_rngs,
    optional=("rng_valid",),
    per_rank=True,
    at_epoch=_restore_rngs,
)


def _loaders(now: Now) -> dict:
    s, now_loaders = now.s, [loaders.capture(dl) for dl in now.learn.dls.loaders]
    return {
        "loaders_now": s.loaders_valid if now.validating else now_loaders,
        "loaders_epoch": s.loaders_epoch if s.loaders_epoch is not None and not now.boundary else now_loaders,
    }


def _check_loaders(t, where) -> None:
    for k in ("loaders_now", "loaders_epoch"):
        _loader_list(t[k], f"{where}.{k}")


def _restore_loaders(learn, sv, at_save, k) -> None:
    """As at the save, or as at the epoch's start (without a stream's position: the skip reads to it); a
    stream resumed mid-epoch from its state then continues from where it was (`loaders.stream_way`)."""
    states, train = (sv["loaders_now"] if at_save else sv["loaders_epoch"]), learn.dls.train
    for dl, st in zip(learn.dls.loaders, states):  # a stream's state: its position at an epoch's end, if it keeps one
        loaders.restore(dl, st, at_save and not (k and dl is train) and loaders.keeps_position(dl))
    ended = k >= len(train) or bool(sv["position"].get("loader_done"))  # saved at its epoch's end
    if k and loaders.is_stream(train) and loaders.stream_way(train)[0] == "state":
        if not (ended and not loaders.keeps_position(train)):  # (an ended pass: the next one starts anew)
            loaders.restore(train, sv["loaders_now"][0])


LOADERS = Piece(("loaders_now", "loaders_epoch"), _loaders, _check_loaders, per_rank=True, at_epoch=_restore_loaders)


def _recorder(now: Now) -> dict:
    rec = getattr(now.learn, "recorder", None)
    return {"recorder": state.recorder_state(rec) if rec is not None else None}


def _check_recorder(t, where) -> None:
    check_recorder(t.get("recorder"), f"{where}.recorder")


def _restore_recorder(learn, sv) -> None:
    if sv["recorder"] is not None:
        state.set_recorder_state(learn, sv["recorder"])


def _restore_train_metrics(learn, sv, at_save, k) -> None:
    "Mid-epoch, the train metrics' running sums (the epoch's row averages them over all of its batches)."
    if k and sv["recorder"] is not None:
        state.set_train_metrics(learn, sv["recorder"])


RECORDER = Piece(
    ("recorder",),
    _recorder,
    _check_recorder,
    optional=("recorder",),
    per_rank=True,
    at_fit=_restore_recorder,
    at_epoch=_restore_train_metrics,
)


def _modules(now: Now) -> dict:
    return {"modules": state.module_states(now.learn.model)}


def _check_modules(t, where) -> None:
    check_modules(t.get("modules", {}), f"{where}.modules")


def _restore_hidden(learn, sv, at_save, k) -> None:
    "Mid-epoch, a recurrent model's hidden state (at an epoch's start fastai's own reset clears it)."
    if k and sv.get("modules"):
        state.set_module_states(learn.model, sv["modules"])


MODULES = Piece(
    ("modules",),
    _modules,
    _check_modules,
    optional=("modules",),
    per_rank=True,
    at_epoch=_restore_hidden,
    at_end=lambda learn, end: state.set_module_states(learn.model, end.get("modules") or {}),
)


# ---- ... the same on every rank -------------------------------------------------------------------


def _hypers(now: Now) -> dict:
    return {"hypers": state.plain([dict(h) for h in now.learn.opt.hypers])}


def _hypers_agree(learn, sv) -> str:
    "The optimizer has the saved parameter groups, and each saved hyper-parameter of the same kind."
    hypers = sv["hypers"]
    if hypers and len(hypers) != len(learn.opt.hypers):
        return f"{len(hypers)} parameter groups saved, the optimizer has {len(learn.opt.hypers)}"
    for i, (live, saved) in enumerate(zip(learn.opt.hypers, hypers)):
        for k, v in saved.items():
            if k not in live or state.hyper_kind(live[k]) != state.hyper_kind(v):
                return (
                    f"train.hypers[{i}][{k!r}] is a {type(v).__name__} in the file, "
                    f"{type(live.get(k)).__name__ if k in live else 'not a hyper-parameter'} in the optimizer"
                )
    return ""


def _restore_hypers(learn, sv) -> None:
    "After the optimizer's state: fit() has just reset the learning rate and weight decay."
    hypers = sv["hypers"]
    for k in hypers[0] if hypers else {}:
        learn.opt.set_hyper(k, [h[k] for h in hypers])


HYPERS = Piece(
    ("hypers",),
    _hypers,
    lambda t, where: state.check_hypers(t["hypers"], f"{where}.hypers"),
    agree=_hypers_agree,
    agree_loaded=True,
    at_fit=_restore_hypers,
)


def _grad_set(now: Now) -> dict:
    return {"grad_set": [p.grad is not None for p in now.params]}


def _grads(now: Now) -> dict:
    return {"grads": state.pending_grads(now.params), **_grad_set(now)}


def _check_grads(t, where) -> None:
    gs = t.get("grad_set")
    need(
        gs is None or isinstance(gs, (list, tuple)) and all(isinstance(b, bool) for b in gs),
        f"{where}.grad_set",
        "expected a list of bools",
    )
    if t["grads"] is not None:
        for i, g in enumerate(a_list(t["grads"], f"{where}.grads")):
            if g is not None:
                a_tensor(g, f"{where}.grads[{i}]")


def grads_mismatch(train: dict, n_params: int) -> str:
    "What is wrong with a training state's gradient lists for a model of `n_params` parameters ('' if nothing)."
    for key in ("grad_set", "grads"):
        saved = train.get(key)
        if saved is not None and len(saved) != n_params:
            return f"train.{key} has {len(saved)} entries, the model has {n_params} parameters"
    return ""


def _grads_agree(learn, sv) -> str:
    bad = grads_mismatch(sv, len(list(learn.model.parameters())))
    return f"malformed training state: {bad}" if bad else ""


def _restore_grads(learn, sv) -> None:
    """A rerun that skipped the stages that made the gradients has none; in the process itself, an interrupt
    between `backward` and `zero_grad` left gradients that the next `backward` would add to."""
    state.set_grads(learn.model, sv.get("grad_set"), sv.get("grads"))


GRADS = Piece(
    ("grads", "grad_set"), _grads, _check_grads, optional=("grad_set",), agree=_grads_agree, at_fit=_restore_grads
)


def _trainable(now: Now) -> dict:
    return {"trainable": [p.requires_grad for p in now.params]}


def _check_trainable(t, where) -> None:
    if t.get("trainable") is not None:
        _bools(t["trainable"], f"{where}.trainable")


def _trainable_agrees(learn, sv) -> str:
    """The same parameters are frozen as when the checkpoint was saved (the same stage of the same script
    freezes the same ones): else the resumed fit would train another set, and is refused."""
    saved = sv.get("trainable")
    if saved is None:  # (older files)
        return ""
    named = list(learn.model.named_parameters())
    if len(saved) != len(named):
        return f"{len(saved)} parameters saved, this model has {len(named)}"
    for (name, p), was in zip(named, saved):
        if p.requires_grad != was:
            return (
                f"{name} was {'trainable' if was else 'frozen'} when the checkpoint was saved and is "
                f"{'trainable' if p.requires_grad else 'frozen'} here: the resumed fit would train another set of "
                "parameters. Freeze and unfreeze as the run did before this fit (the same script, unchanged)."
            )
    return ""


TRAINABLE = Piece(("trainable",), _trainable, _check_trainable, optional=("trainable",), agree=_trainable_agrees)


def _rows(now: Now) -> dict:
    "The printed rows of the finished epochs (the resumed fit prints them again); this epoch's if it is logged."
    s, rec, rows = now.s, getattr(now.learn, "recorder", None), list(now.s.rows)
    if rec is not None and len(rows) == s.epoch and len(rec.values) > s.epoch and now.epoch > s.epoch:
        rows.append(state.plain(list(rec.log)))  # this epoch's row, logged by the Recorder already
    return {"rows": rows}


ROWS = Piece(("rows",), _rows, lambda t, where: _check_rows(t["rows"], f"{where}.rows"))


def _callbacks(now: Now) -> dict:
    return {"callbacks": callbacks.callback_states(now.learn, between_stages=now.ending)}


CALLBACKS = Piece(
    ("callbacks",),
    _callbacks,
    lambda t, where: a_dict(t["callbacks"], f"{where}.callbacks"),
    at_fit=lambda learn, sv: callbacks.set_callback_states(learn, sv["callbacks"]),
    at_end=lambda learn, end: callbacks.set_callback_states(learn, end["callbacks"], between_stages=True),
)


def script_part(sc, st) -> dict:
    "What a checkpoint saved in stage `st` carries of the script: the stage ends before it, and the log."
    return {"ends": list(sc.ends[: st.index]), "log": list(sc.log)}


def _check_script_part(t, where) -> None:
    if t.get("script") is not None:
        check_script(t["script"], f"{where}.script")


SCRIPT = Piece(
    ("script",), lambda now: {"script": script_part(now.s.script, now.st)}, _check_script_part, optional=("script",)
)


CHECKPOINT = (POSITION, STAGES, RNGS, LOADERS, RECORDER, MODULES, HYPERS, GRADS, TRAINABLE, ROWS, CALLBACKS, SCRIPT)


# ---- the state a stage ends with --------------------------------------------------------------------


def _stage_id(now: Now) -> dict:
    """The stage, and a token the checkpoints that name this end state hold (a file another run wrote under
    the same name is not theirs). A sharded model's ranks write their parts with one token: a collective."""
    token = secrets.randbits(62)
    if dist.sharded(now.learn.model):
        token = dist.all_gather_ints("an end state's token", [token])[0][0]
    return {"stage": now.st.index, "token": token, "signature": now.st.signature}


STAGE_ID = Piece(("stage", "token", "signature"), _stage_id, optional=("stage", "token", "signature"))


def _end_rng(now: Now) -> dict:
    return {"rng": state.rng_state()}


END_RNG = Piece(
    ("rng",),
    _end_rng,
    lambda t, where: check_rng(t["rng"], f"{where}.rng"),
    per_rank=True,
    at_end=lambda learn, end: state.set_rng_state(end["rng"]),
)


def _end_loaders(now: Now) -> dict:
    return {"loaders": [loaders.capture(dl) for dl in now.learn.dls.loaders]}


def _restore_end_loaders(learn, end) -> None:
    for dl, ld in zip(learn.dls.loaders, end["loaders"]):  # (a stream that restarts each pass: no position)
        loaders.restore(dl, ld, loaders.keeps_position(dl))


END_LOADERS = Piece(
    ("loaders",),
    _end_loaders,
    lambda t, where: _loader_list(t["loaders"], f"{where}.loaders"),
    per_rank=True,
    at_end=_restore_end_loaders,
)


def _end_recorder(now: Now) -> dict:
    "The Recorder whole: its state, its per-epoch numbers and the names of its columns."
    rec = getattr(now.learn, "recorder", None)
    if rec is None or not hasattr(rec, "values"):
        return {"recorder": None}
    log = state.plain(list(getattr(rec, "log", [])))
    return {"recorder": {**state.recorder_state(rec), **recorder_numbers(rec), "log": log}}


def _restore_end_recorder(learn, end) -> None:
    rec = end.get("recorder")
    if rec is not None and getattr(learn, "recorder", None) is not None:
        state.set_recorder_state(learn, rec)
        set_recorder_numbers(learn, rec)
        learn.recorder.log = L(rec.get("log") or [])


END_RECORDER = Piece(
    ("recorder",), _end_recorder, _check_recorder, optional=("recorder",), per_rank=True, at_end=_restore_end_recorder
)


def _end_grads_agree(learn, end) -> str:
    n = len(list(learn.model.parameters()))
    return "" if len(end["grad_set"]) == n else f"{len(end['grad_set'])} gradient flags, the model has {n} parameters"


END_GRAD_SET = Piece(
    ("grad_set",),
    _grad_set,
    lambda t, where: _bools(t["grad_set"], f"{where}.grad_set"),
    agree=_end_grads_agree,
    at_end=lambda learn, end: state.set_grads(learn.model, end["grad_set"], None),
)

END_TRAINABLE = Piece(("trainable",), _trainable, optional=("trainable",))  # (recorded; nothing restores it)

END_TRAINING = Piece(
    ("training",),
    lambda now: {"training": bool(now.learn.model.training)},
    optional=("training",),
    at_end=lambda learn, end: learn.model.train(bool(end.get("training", False))),
)


END_LEARNER = Piece(
    ("learner",),
    lambda now: {"learner": state.learner_counters(now.learn)},
    lambda t, where: a_dict(t["learner"], f"{where}.learner"),
    at_end=lambda learn, end: state.set_learner_counters(learn, end["learner"]),
)

# (`between` prints the stage's rows again as it restores the end)
END_ROWS = Piece(
    ("rows",),
    lambda now: {"rows": [state.plain(list(r)) for r in now.st.rows]},
    lambda t, where: _check_rows(t["rows"], f"{where}.rows"),
)


STAGE_END = (
    STAGE_ID,
    END_RNG,
    END_LOADERS,
    MODULES,
    END_RECORDER,
    CALLBACKS,
    END_GRAD_SET,
    END_TRAINABLE,
    END_TRAINING,
    END_LEARNER,
    END_ROWS,
)
