"""The state of the callbacks that change what the rest of a fit computes or what a script reads from
them afterwards, as plain trees, and back.

Each kind of callback has a handler `(predicate, get, put)`: `get(cb)` is its state when a checkpoint
is taken (a tree, or None), `put(cb, tree)` restores it when a resumed fit starts, after the callbacks'
own `before_fit`. fastai's own kinds are here (`HANDLERS`: the trackers' best value and patience,
`GradientAccumulation`'s count, `MixedPrecision`'s grad scaler, `ParamScheduler`'s record,
`CSVLogger`'s file, `ActivationStats`' recorded batches); experiment trackers have theirs in
`trackers.HANDLERS`; a callback of the user's joins in by defining `resume_state(self) -> tree` and
`load_resume_state(self, tree)`.

Only known fields of known types are ever set from a file: never a path, a name or anything that
decides what is loaded.
"""

from __future__ import annotations

from typing import Any

import torch
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


_STATS_FLOATS = ("mean", "std", "near_zero")


def _layer_entries(stats):
    "Every layer's dict in ActivationStats' batches (a layer with several outputs has a list of them)."
    for b in stats:
        for m in b:
            yield from (x for x in (m if isinstance(m, list) else [m]) if isinstance(x, dict))


def _activation_stats(cb) -> dict | None:
    """Every recorded batch: the floats as they are, the histograms stacked into one tensor where they
    can be (a long fit records tens of thousands; as many small tensors they would slow every save)."""
    if not hasattr(cb, "stats"):
        return None
    stats = plain(cb.stats)  # new dicts and lists: the callback's own are not changed below
    hists = [m["hist"] for m in _layer_entries(stats) if isinstance(m.get("hist"), torch.Tensor)]
    kinds = {(h.shape, h.dtype, h.device) for h in hists}
    if len(hists) < 2 or len(kinds) != 1:
        return {"stats": stats}
    for m in _layer_entries(stats):
        if "hist" in m:
            m["hist"] = True  # the next row of "hists"
    return {"stats": stats, "hists": torch.stack(hists)}


def _module_stats(v, packed: bool):
    "One layer's entry of a batch as `ActivationStats.hook` makes it: a dict, a list of them (several outputs), None."
    if v is None:
        return None
    if isinstance(v, list):
        return [_module_stats(x, packed) for x in v]
    if (
        not isinstance(v, dict)
        or not set(_STATS_FLOATS) <= set(v) <= {*_STATS_FLOATS, "hist"}
        or not all(isinstance(v[k], float) for k in _STATS_FLOATS)
        or not ("hist" not in v or isinstance(v["hist"], torch.Tensor) or (packed and v["hist"] is True))
    ):
        raise CheckpointError(
            "callback state ActivationStats.stats: expected each layer's entry to be a dict of mean, std, "
            f"near_zero (floats) and hist (a tensor), got {v!r:.200}"
        )
    return dict(v)


def _put_activation_stats(cb, st) -> None:
    stats, hists = st.get("stats"), st.get("hists")
    if not isinstance(stats, list) or not all(isinstance(b, list) for b in stats):
        raise CheckpointError("callback state ActivationStats.stats: expected a list of batches, each a list of layers")
    if hists is not None and not isinstance(hists, torch.Tensor):
        raise CheckpointError(f"callback state ActivationStats.hists: {type(hists).__name__}, expected a tensor")
    stats = L(L(_module_stats(m, hists is not None) for m in b) for b in stats)  # as fastai keeps them
    if hists is not None:
        packed = [m for m in _layer_entries(stats) if m.get("hist") is True]
        if hists.dim() < 1 or len(packed) != hists.shape[0]:
            raise CheckpointError(
                f"callback state ActivationStats: {len(packed)} histograms in its batches, {tuple(hists.shape)} stored"
            )
        for m, h in zip(packed, hists):
            m["hist"] = h
    cb.stats = stats


_TRACKER = (
    lambda cb: is_a(cb, "fastai.callback.tracker", "TrackerCallback"),
    _tracker,
    lambda cb, st: _typed(cb, st, _TRACKER_FIELDS),
)

# fastai's ActivationStats keeps each recorded batch's statistics in the callback (the book plots them
# after a fit): all of them, in every checkpoint and at every stage's end.
_ACTIVATION_STATS = (
    lambda cb: is_a(cb, "fastai.callback.hook", "ActivationStats"),
    _activation_stats,
    _put_activation_stats,
)

HANDLERS: list = [
    _TRACKER,
    _ACTIVATION_STATS,
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
# What callbacks keep from one fit to the next, as a stage ends: fastai's trackers' best value and patience,
# and what ActivationStats recorded (read after the fit; the next fit starts it anew); fastai's other
# callbacks start every fit anew (the scheduler, the grad scaler, the accumulation count; the loggers'
# files are closed). Beside them, a user's callback's `resume_state`.
BETWEEN_STAGES: list = [_TRACKER, _ACTIVATION_STATS]


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
