"""The state of the callbacks that change what the rest of a fit computes, as plain trees, and back.

Each kind of callback has a handler `(predicate, get, put)`: `get(cb)` is its state when a checkpoint
is taken (a tree, or None), `put(cb, tree)` restores it when a resumed fit starts, after the callbacks'
own `before_fit`. fastai's own kinds are here (`HANDLERS`: the trackers' best value and patience,
`GradientAccumulation`'s count, `MixedPrecision`'s grad scaler, `ParamScheduler`'s record,
`CSVLogger`'s file); experiment trackers have theirs in `trackers.HANDLERS`; a callback of the user's
joins in by defining `resume_state(self) -> tree` and `load_resume_state(self, tree)`.

Only known fields of known types are ever set from a file: never a path, a name or anything that
decides what is loaded.
"""

from __future__ import annotations

from typing import Any

from fastcore.foundation import L

from . import trackers
from .fastai_classes import is_a
from .io import CheckpointError
from .state import plain

__all__ = [
    "HANDLERS",
    "cb_key",
    "mark_csv_start",
    "callback_states",
    "set_callback_states",
    "BETWEEN_STAGES",
]

_TRACKER_FIELDS = {"best": (float, int), "wait": (int,), "new_best": (bool,)}


def cb_key(cbs, cb) -> str:
    "A name for `cb` that stays the same when the learner is built the same way again."
    same = [c for c in cbs if type(c) is type(cb)]
    return cb.name if len(same) == 1 else f"{cb.name}_{same.index(cb)}"


def _typed(cb, st: dict, fields: dict) -> None:
    for k, types in fields.items():
        if k not in st:
            continue
        v = st[k]
        if not isinstance(v, types) or (bool in types) != isinstance(v, bool):
            raise CheckpointError(
                f"callback state {type(cb).__name__}.{k}: {type(v).__name__} in the file, "
                f"expected {'/'.join(t.__name__ for t in types)}"
            )
        setattr(cb, k, v)


def _tracker(cb) -> dict:
    return {k: plain(getattr(cb, k)) for k in _TRACKER_FIELDS if hasattr(cb, k)}


def _mixed_precision(cb) -> dict | None:
    if not hasattr(cb.learn, "scaler"):
        return None
    return {"scaler": plain(cb.learn.scaler.state_dict()), "scales": plain(getattr(cb, "scales", []))}


def _put_mixed_precision(cb, st) -> None:
    if not isinstance(st.get("scaler"), dict) or not isinstance(st.get("scales"), (list, tuple)):
        raise CheckpointError("callback state MixedPrecision: expected scaler (dict) and scales (list)")
    cb.learn.scaler.load_state_dict(st["scaler"])
    cb.scales = L(st["scales"])


def _put_schedule(cb, st) -> None:
    hps = st["hps"]
    if not isinstance(hps, dict) or not all(
        isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v)
        for k, v in hps.items()
    ):
        raise CheckpointError("callback state ParamScheduler.hps: expected a dict of str: list of numbers")
    cb.hps = {k: list(v) for k, v in hps.items()}


def _csv(cb) -> dict | None:
    if getattr(cb, "file", None) is None or cb.file.closed:
        return None
    cb.file.flush()
    with open(cb.path / cb.fname, "rb") as f:  # what it wrote in this fit (its header and rows)
        f.seek(cb.resume_file_start)
        tail = f.read()
    return {"csv_size": cb.file.tell(), "csv_tail": tail}


def _continue_csv(cb, st) -> None:
    """Make the CSVLogger's file what it was at the save: the bytes before this fit as they are on disk
    (other fits' rows, with `append=True`), then this fit's header and rows from the checkpoint. The
    finished epochs' rows are therefore never written twice."""
    size, tail = st["csv_size"], st["csv_tail"]
    if not isinstance(size, int) or not isinstance(tail, bytes) or size < len(tail):
        raise CheckpointError("callback state CSVLogger: csv_size/csv_tail malformed")
    cb.file.flush()
    path = cb.path / cb.fname
    keep = min(size - len(tail), cb.resume_file_start)
    with open(path, "r+b") as f:
        f.truncate(keep)
        f.seek(keep)
        f.write(tail)
    cb.file.seek(0, 2)


_TRACKER = (
    lambda cb: is_a(cb, "fastai.callback.tracker", "TrackerCallback"),
    _tracker,
    lambda cb, st: _typed(cb, st, _TRACKER_FIELDS),
)

HANDLERS: list = [
    _TRACKER,
    (
        lambda cb: is_a(cb, "fastai.callback.training", "GradientAccumulation"),
        lambda cb: {"count": getattr(cb, "count", 0)},
        lambda cb, st: _typed(cb, st, {"count": (int,)}),
    ),
    (lambda cb: is_a(cb, "fastai.callback.fp16", "MixedPrecision"), _mixed_precision, _put_mixed_precision),
    (
        lambda cb: is_a(cb, "fastai.callback.schedule", "ParamScheduler"),
        lambda cb: {"hps": plain(cb.hps)} if hasattr(cb, "hps") else None,
        _put_schedule,
    ),
    (lambda cb: is_a(cb, "fastai.callback.progress", "CSVLogger"), _csv, _continue_csv),
]
# What callbacks keep from one fit to the next, as a stage ends: fastai's trackers' best value and patience
# (fastai's other callbacks start every fit anew: the scheduler, the grad scaler, the accumulation count;
# the loggers' files are closed), beside a user's callback's `resume_state`.
BETWEEN_STAGES: list = [_TRACKER]


def _handler(cb, handlers):
    return next((h for h in handlers if h[0](cb)), None)


def mark_csv_start(learn) -> None:
    "At a fit's start: where each CSVLogger's file begins this fit (its header just written), for `_csv`."
    for cb in learn.cbs:
        if is_a(cb, "fastai.callback.progress", "CSVLogger") and getattr(cb, "file", None) is not None:
            header = (",".join(cb.recorder.metric_names) + "\n").encode()
            cb.file.flush()
            cb.resume_file_start = cb.file.tell() - len(header)


def callback_states(learn, between_stages: bool = False) -> dict:
    """State of the callbacks that change the result: the user's `resume_state`, else their handler's
    (`between_stages`: what they keep from one fit to the next only, `BETWEEN_STAGES`)."""
    handlers = BETWEEN_STAGES if between_stages else (*trackers.HANDLERS, *HANDLERS)  # (tests clear the trackers')
    out = {}
    for cb in learn.cbs:
        if hasattr(cb, "resume_state"):
            st: Any = cb.resume_state()
        else:
            h = _handler(cb, handlers)
            st = h[1](cb) if h else None
        if st is not None:
            out[cb_key(learn.cbs, cb)] = plain(st)
    return out


def set_callback_states(learn, states: dict, between_stages: bool = False) -> None:
    handlers = BETWEEN_STAGES if between_stages else (*trackers.HANDLERS, *HANDLERS)
    for cb in learn.cbs:
        key = cb_key(learn.cbs, cb)
        st = states.get(key)
        if st is None:
            continue
        if hasattr(cb, "load_resume_state"):
            cb.load_resume_state(st)
            continue
        if not isinstance(st, dict):
            raise CheckpointError(f"callback state {key}: {type(st).__name__}, expected a dict")
        h = _handler(cb, handlers)
        if h is None:
            continue
        try:
            h[2](cb, st)
        except CheckpointError:
            raise
        except (TypeError, KeyError, ValueError, AttributeError, IndexError, RuntimeError) as e:
            raise CheckpointError(f"callback state {key} is malformed: {e!r}") from None
