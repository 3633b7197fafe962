"""What a script does between its stages, the same on a rerun as in the uninterrupted run.

A rerun of an unchanged script skips the stages that finished before its checkpoint. Between them the
script goes on: it reads the Recorder, validates, saves a model under a name and loads it back, runs
`lr_find`, exports. Two things make each of those lines see what the uninterrupted run saw there:

- **Stage ends.** At the end of a stage in which resumable checkpoints were saved (by `AutoCheckpoint`
  or `save(with_iter=True)`), the learner's state is written next to them as
  `<stem>-s<stage>-end.frk`: model, optimizer, Recorder, RNG, loaders, the callbacks' resume state, the
  learner's counters and the stage's printed rows. Every later checkpoint names it (with a token, so
  a file another run wrote under that name is never taken for it). A rerun that skips the stage
  restores that state as the skipped call returns: one load per stage passed.
- **The log.** Each between-stage call (`save`, `load`, `save_encoder`, `load_encoder`, `export`,
  `lr_find`, `validate`) is recorded, with the digest of the file it wrote or read, or what it returned;
  every later checkpoint carries the log. Before the stage it resumes, a rerun replays it: a file the
  uninterrupted run wrote that is still intact is kept, not written again; a `load` the uninterrupted
  run also made is part of the script (it does not cancel the resume); `lr_find` gives the
  uninterrupted run's suggestion and plot data without training; `validate` its numbers.

While the learner does not hold the uninterrupted run's state (before a stage whose end state was not
saved, or after `learn.load` of a checkpoint at the top of the script, before the stages it skips),
a call whose result depends on it and that the log cannot answer raises `ReplayError` before anything
is written.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from fastcore.foundation import L

from . import checkpoint, datalog, dist, io, paths, state, store, trainstate
from .fastai_classes import is_a
from .io import CheckpointError
from .script import BETWEEN_HOOKS, checking, script

__all__ = [
    "ReplayError",
    "file_crc",
    "stage_ended",
    "note",
    "loaded",
    "validated",
    "predicted",
    "lr_find_fit",
    "write_or_keep",
]


class ReplayError(RuntimeError):
    "A rerun asked, before the stage it resumes, for something that depends on state it does not hold."


def file_crc(path) -> int:
    "CRC32C of a file's bytes (read in pieces: a file that changes meanwhile cannot fault the process)."
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = io.crc32c(chunk, crc)
    return crc


def _rel(learn, path) -> str:
    "`path` as the log keeps it: relative to the model folder (the run may be moved or rerun elsewhere)."
    return os.path.relpath(os.path.abspath(path), paths.model_folder(learn))


def _abs(learn, rel: str) -> Path:
    return paths.model_folder(learn) / rel


def _at(sc) -> int:
    "Where the script is: the number of its stages finished (or skipped) so far."
    return len(sc.signatures)


# ---- the log ----------------------------------------------------------------------------------


# What `export` writes is not the same twice: it pickles the learner, the Recorder's clock among it.
_UNREPRODUCIBLE = {"export"}


def _emit(learn, ev: dict) -> None:
    "Every between-stage call, live or replayed, goes into `fastai-resume check`'s trace."
    if checking():
        res = ev.get("result")
        digest = ev["crc"] if ev["file"] is not None else (None if res is None else datalog.fingerprint(res))
        for hook in BETWEEN_HOOKS:
            hook(ev["at"], ev["op"], ev["file"], None if ev["op"] in _UNREPRODUCIBLE else digest)


def _event(learn, op: str, path=None, result=None) -> dict:
    ev: dict = {"at": _at(script(learn)), "op": op, "file": None, "crc": None}
    if path is not None and Path(path).is_file():
        ev["file"], ev["crc"] = _rel(learn, path), file_crc(path)
    if result is not None:
        ev["result"] = result
    return ev


def note(learn, op: str, path=None, result=None) -> None:
    """Record a between-stage call (`path`: the file it wrote or read; `result`: what it returned) in the
    script's log. During a rerun's replay the log is the checkpoint's, and nothing is added."""
    sc = script(learn)
    if sc.fit_depth:
        return
    ev = _event(learn, op, path, result)
    _emit(learn, ev)
    if sc.armed is None:
        sc.log.append(ev)


def _expected(learn, op: str, path=None) -> dict | None:
    """The next event of the armed checkpoint's log at this point of the script for `op` (and file), taken
    (it is not matched twice), or None (none, or no replay in progress)."""
    sc = script(learn)
    a = sc.armed
    if sc.fit_depth or a is None:
        return None
    rel = None if path is None else _rel(learn, path)
    for i, ev in enumerate(a.log):
        if i in a.used or ev["at"] != _at(sc) or ev["op"] != op or (rel is not None and ev["file"] != rel):
            continue
        a.used.add(i)
        return ev
    return None


def _not_exact(learn) -> str | None:
    "Why the learner does not hold the uninterrupted run's state at this line (None if it does)."
    sc = script(learn)
    return None if sc.fit_depth or sc.armed is None else sc.armed.divergent


def _refuse_if_not_exact(learn, op: str, what: str) -> None:
    "Raise `ReplayError`: the uninterrupted run made this call here, on a state this learner does not hold."
    why = _not_exact(learn)
    if why is not None:
        raise ReplayError(
            f"{what}: the uninterrupted run made this call here, but before the stage it resumes this rerun's "
            f"learner {why}, so {op} would not give that run's result; nothing was written. Bring back what the "
            "uninterrupted run wrote here, or learn.load(..., resume=False) to start over."
        )


def write_or_keep(learn, op: str, path, write, what: str):
    """A between-stage write of `path` by `write()`. During a rerun's replay: a file the uninterrupted run
    wrote here that is still intact is kept (not written again); otherwise it is written only from the
    uninterrupted run's state, and checked against what that run wrote. A call the uninterrupted run did
    not make here is the script's own new line: done as asked."""
    path = Path(path)
    ev = _expected(learn, op, path)
    if ev is not None:
        if ev["crc"] is not None and path.is_file() and file_crc(path) == ev["crc"]:
            print(f"fastai_resume: {what}: {path} is the uninterrupted run's file, kept as it is")
            _emit(learn, ev)
            return path
        _refuse_if_not_exact(learn, op, what)
    out = write()
    if (
        ev is not None
        and ev["crc"] is not None
        and op not in _UNREPRODUCIBLE
        and path.is_file()
        and file_crc(path) != ev["crc"]
    ):
        warnings.warn(
            f"fastai_resume: {what} wrote {path}, which differs from what the uninterrupted run wrote there",
            stacklevel=3,
        )
    note(learn, op, path)
    return out


def loaded(learn, op: str, path) -> bool:
    """A between-stage load of `path` (not a resumable checkpoint): True if the uninterrupted run made the
    same load at this point of the script (so it does not cancel an armed resume)."""
    ev = _expected(learn, op, path)
    if ev is None:
        note(learn, op, path)
        return False
    _emit(learn, _event(learn, op, path))
    if ev["crc"] is not None and Path(path).is_file() and file_crc(path) != ev["crc"]:
        print(
            f"fastai_resume: {op} of {path}: the file differs from the one the uninterrupted run loaded here "
            "(the resumed stage restores its own state from the checkpoint)"
        )
    return True


def validated(learn, run, what: str):
    """`learn.validate()` between stages: before the stage a rerun resumes, the uninterrupted run's numbers
    where the learner does not hold its state; else run (and logged)."""
    ev = _expected(learn, "validate")
    if ev is not None and _not_exact(learn) is not None and isinstance(ev.get("result"), list):
        print(f"fastai_resume: {what}: the uninterrupted run's result at this point, from the checkpoint")
        _emit(learn, ev)
        return L(ev["result"])
    out = run()
    res = None if out is None else state.plain([float(x) if isinstance(x, torch.Tensor) else x for x in out])
    if ev is not None and ev.get("result") != res:
        warnings.warn(f"fastai_resume: {what} gave {res}, the uninterrupted run {ev.get('result')}", stacklevel=3)
    note(learn, "validate", result=res)
    return out


def predicted(learn, run, what: str):
    """`learn.get_preds()` of a dataset between stages: refused before the stage a rerun resumes where the
    learner does not hold the uninterrupted run's state (the predictions are not kept, only their digest),
    else run, logged, and compared with that run's."""
    ev = _expected(learn, "get_preds")
    if ev is not None:
        _refuse_if_not_exact(learn, "get_preds", what)
    out = run()
    digest = datalog.fingerprint(list(out) if isinstance(out, tuple) else out)
    if ev is not None and ev.get("result") != digest:
        warnings.warn(f"fastai_resume: {what} differs from the uninterrupted run's predictions here", stacklevel=3)
    note(learn, "get_preds", result=digest)
    return out


def lr_find_fit(learn, run):
    """The fit of `lr_find` between stages: during a rerun's replay, the uninterrupted run's (its Recorder,
    from which fastai computes the same suggestion and plot, and the RNG after it) without training;
    else run, and logged."""
    ev = _expected(learn, "lr_find")
    if ev is not None and isinstance(ev.get("result"), dict):
        res = ev["result"]
        try:
            trainstate.validate_recorder(res.get("recorder"), "lr_find.recorder")
            trainstate.validate_rng(res.get("rng"), "lr_find.rng")
        except CheckpointError as e:
            raise CheckpointError(f"{script(learn).armed.path}: {e}") from None
        state.set_recorder_state(learn, res["recorder"])
        state.set_rng_state(res["rng"])
        _emit(learn, ev)
        print("fastai_resume: lr_find: the uninterrupted run's, from the checkpoint (not run again)")
        return None
    out = run()
    rec = getattr(learn, "recorder", None)
    if rec is not None and hasattr(rec, "lrs"):
        note(learn, "lr_find", result={"recorder": state.recorder_state(rec), "rng": state.rng_state()})
    return out


# ---- stage ends -------------------------------------------------------------------------------

_END = "-s{:03d}-end" + io.EXT


def end_path(folder: Path, stem: str, stage: int) -> Path:
    return Path(folder) / (stem + _END.format(stage))


def stage_ended(learn, sc, st) -> None:
    "At the end of stage `st`: restore its end state (a rerun that skipped it) or write it (if it is needed)."
    if st.skip_all:
        _restore(learn, sc, st)
        return
    rec = getattr(learn, "recorder", None)
    if rec is not None and hasattr(rec, "values"):  # the stage's numbers travel in every later checkpoint
        note(learn, "stage", result=trainstate.recorder_numbers(rec))
    stem = st.end_stem()
    if stem is None:
        sc.ends.append(None)
        return
    folder, name = stem
    path = end_path(folder, name, st.index)
    box: dict = {}

    def build():
        end = trainstate.end_tree(learn, st)  # collective under DDP
        if end is None:
            return None
        box["token"] = end["token"]
        return {**checkpoint.model_tree(learn, with_opt=True), "end": end}

    try:
        store.save(learn, path, build)
    except (OSError, CheckpointError) as e:  # training goes on; a rerun that skips this stage says so
        warnings.warn(
            f"fastai_resume: the end state of stage {st.index} could not be saved ({e}); a rerun that skips "
            "this stage will not have it (it says so, and refuses what would need it)",
            stacklevel=4,
        )
        sc.ends.append(None)
        return
    token = dist.exchange(f"stage {st.index}'s end state: its token", box.get("token"))[0]
    sc.ends.append({"file": _rel(learn, path), "token": int(token)})


def _restore(learn, sc, st) -> None:
    """A rerun has skipped stage `st`: the learner becomes what it was when the uninterrupted run ended
    it, or, where that state was not saved, is marked as not holding it (said now, loudly)."""
    a = sc.armed
    ref = a.ends[st.index] if st.index < len(a.ends) else None
    why = None
    if ref is None:
        why = (
            f"holds the script's own state (the resume of {a.path.name} is armed), not stage {st.index}'s end: no "
            "resumable checkpoint was saved in that stage, so its end state was not kept"
        )
    else:
        path = _abs(learn, ref["file"])
        # node-local folders: the rank that wrote the file sends it (a sharded end state's folder: each reads its own)
        with dist.fetch_missing(f"stage {st.index}'s end state on every rank", path) as got:
            try:
                tree = store.read(got, learn)
                end = checkpoint.end_state(tree)
                if end is None or end.get("token") != ref["token"]:
                    raise CheckpointError(f"{path} is not the end state this checkpoint names (another run wrote it)")
                trainstate.validate_end(end, path, learn)
                # (nothing changed the frozen parameters since the skipped stage began and took their fingerprints)
                dev = getattr(learn.dls, "device", None)
                checkpoint.load_tree(learn, path, tree, dev, True, True, known=sc.base)
                trainstate.restore_end(learn, end)
                _print_rows(learn, end)
            except (CheckpointError, OSError) as e:
                why = f"holds the script's own state ({a.path.name} is armed), not stage {st.index}'s end: {e}"
    sc.ends.append(ref if why is None else None)
    numbers = _expected(learn, "stage")
    if numbers is not None:
        _emit(learn, numbers)
        if why is not None:  # at least the Recorder's numbers of the stage are the uninterrupted run's
            trainstate.set_recorder_numbers(learn, numbers.get("result"))
    if ref is not None and why is None:
        a.divergent = None
        print(f"fastai_resume: stage {st.index} ({st.method}) restored as it ended, from {Path(ref['file']).name}")
        return
    a.divergent = why
    warnings.warn(
        f"fastai_resume: after skipping stage {st.index} ({st.method}) this learner {why}. Until the resumed "
        "stage starts, a between-stage call the uninterrupted run made here and whose result is not known "
        "from the checkpoint (a save of a file that is gone or changed, get_preds) is refused.",
        stacklevel=4,
    )


def _print_rows(learn, end) -> None:
    "The skipped stage's table, as the uninterrupted run printed it (the header where a progress bar wrote one)."
    rec = end.get("recorder")
    names = rec.get("metric_names") if isinstance(rec, dict) else None
    if end["rows"] and names and any(is_a(c, "fastai.callback.progress", "ProgressCallback") for c in learn.cbs):
        state.print_row(learn, list(names))
    for row in end["rows"]:
        state.print_row(learn, row)
