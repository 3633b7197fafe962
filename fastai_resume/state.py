"""Pieces of the training state that decide what the next step computes, as plain trees, and back:
RNG states, the Recorder, the hidden state of recurrent models, the gradients. (Loaders' state is in
`loaders`, callbacks' in `callbacks`; `trainstate` assembles the checkpoint's training tree.)
"""

from __future__ import annotations

import gc
import operator
import random
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from fastcore.foundation import L

from .fastai_classes import is_a
from .io import CheckpointError, map_tree

__all__ = [
    "plain",
    "rng_state",
    "set_rng_state",
    "recorder_state",
    "set_recorder_state",
    "module_states",
    "set_module_states",
    "held",
    "RecorderLosses",
    "set_grads",
    "opt_state_for",
    "print_row",
]


def plain(v: Any) -> Any:
    "`v` with fastai/NumPy containers and scalars turned into the storable base types."
    return map_tree(v, _plain_leaf)


def _plain_leaf(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if type(v).__name__ == "L":  # fastcore's list
        return [plain(x) for x in v]
    return v


def _py_rng(s) -> Any:
    return (s[0], tuple(s[1]), s[2])


def rng_state() -> dict:
    "The global RNG states: Python, NumPy, torch CPU and every CUDA device."
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    st = {
        "python": _py_rng(random.getstate()),
        "numpy": (kind, keys, int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = list(torch.cuda.get_rng_state_all())
    return st


def set_rng_state(st: dict) -> None:
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    kind, keys, pos, has_gauss, gauss = st["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(st["torch"].clone())
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in st["cuda"]])


def _unbind(t: torch.Tensor) -> list:
    "`t` as a list of 0-dim tensors, as fast as torch allows (no autograd, no GC pass midway)."
    was = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            return list(t.unbind())
    finally:
        if was:
            gc.enable()


class RecorderLosses:
    """`Recorder.losses`, with the part restored from a checkpoint kept as one tensor until the list
    is first read. A resumed fit thus starts training without building k 0-dim tensors first; the
    first read (fastai's own `after_batch` of the first trained batch, or any user code) rebuilds
    the full plain list of tensors, the same objects an uninterrupted run holds. Stored where
    fastai keeps it (`__dict__['losses']`, left out of pickles by `Recorder._stateattrs`, as before);
    the pending tensor lives in `_state`, which fastcore's `Stateful` never pickles either."""

    def __get__(self, rec, owner=None):
        if rec is None:
            return self
        d = rec.__dict__
        if "losses" not in d:
            raise AttributeError("losses")
        base = d.get("_state", {}).pop("frk_losses", None)
        if base is not None:
            items = _unbind(base)
            d["losses"][:0] = items
            _HISTORY.setdefault(rec, {})["losses"] = (items, base)  # the next save stacks only what follows
        return d["losses"]

    def __set__(self, rec, v):
        rec.__dict__["losses"] = v
        rec.__dict__.get("_state", {}).pop("frk_losses", None)


# Per Recorder and history list: the entries taken at its last save and the tensor made of them.
_HISTORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as_tensor(rec, name: str, items: list, convert: Callable[[list], Any]) -> Any:
    """The history list `items` (`Recorder.lrs`, `Recorder.losses`: one entry per trained batch) as
    one tensor, `convert(items)`, where `convert` takes a list and returns a 1-dim tensor or None
    (not convertible: the list itself is then returned).

    Converting the whole list at every save would make each save's stall grow with the run (a run of
    days has hundreds of thousands of entries and saves thousands of times). Only the entries appended
    since the Recorder's last save are converted, the previous tensor extended with them (a copy at
    memory speed), once the list is checked to begin with the very objects converted then (identity,
    at C speed: a replaced, removed or inserted entry, or a new list, converts it all again). Floats are
    immutable; fastai's loss entries are new tensors per batch, never changed afterwards (a loss
    tensor changed in place after a save keeps, in later saves, the value it had then: the README's
    Limits say so)."""
    seen, done = _HISTORY.setdefault(rec, {}).get(name, ((), None))
    n = len(seen)
    if done is None or len(items) < n or not all(map(operator.is_, items, seen)):
        n, done = 0, None
    tail = items[n:]
    if tail:
        new = convert(tail)
        if new is None:
            _HISTORY[rec].pop(name, None)
            return items
        done = new if done is None else torch.cat([done, new.to(done.device)])
    if done is None:  # an empty list (a new fit's): nothing kept from the last one
        _HISTORY[rec].pop(name, None)
        return items
    _HISTORY[rec][name] = (list(items), done)
    return done


def _stack_losses(items: list) -> torch.Tensor | None:
    if not all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in items):
        return None
    try:
        return torch.stack(items)
    except RuntimeError:  # on several devices (restored on the CPU, then trained on a GPU)
        return torch.stack([x.cpu() for x in items])


def _float_tensor(items: list) -> torch.Tensor | None:
    return torch.tensor(items, dtype=torch.float64) if set(map(type, items)) == {float} else None


def recorder_state(rec) -> dict:
    sm = rec.smooth_loss
    base = rec.__dict__.get("_state", {}).get("frk_losses")
    if base is not None:  # still pending: save it and the new tail without rebuilding the list
        tail = rec.__dict__["losses"]
        losses = torch.cat([base, torch.stack(tail)]) if tail else base
    else:
        losses = _as_tensor(rec, "losses", rec.losses, _stack_losses)  # one blob, not one per batch
    lrs = _as_tensor(rec, "lrs", rec.lrs, _float_tensor)
    return {
        "lrs": lrs if isinstance(lrs, torch.Tensor) else plain(lrs),
        "iters": plain(rec.iters),
        "losses": losses,
        "values": plain(rec.values),
        "smooth_count": sm.count,
        "smooth_val": sm.val,
        "train_metrics": [_metric_state(m) for m in _train_metrics(rec)],
    }


_METRIC_FIELDS = ("total", "count", "val", "targs", "preds")


def _train_metrics(rec) -> list:
    "The accumulators `Recorder` feeds during training beyond the smooth loss (`train_metrics=True`)."
    return list(rec.metrics) if getattr(rec, "train_metrics", False) else []


def _metric_state(m) -> dict:
    "A metric's running accumulators (fastai's AvgMetric/AvgLoss/AccumMetric keep these)."

    def snap(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, list):
            return [snap(x) for x in v]
        return v

    return {k: snap(m.__dict__[k]) for k in _METRIC_FIELDS if k in m.__dict__}


def set_recorder_state(learn, st: dict) -> None:
    rec = learn.recorder
    losses = st["losses"]
    lrs = st["lrs"]  # a float64 tensor since schema 3, a list before
    rec.lrs, rec.iters = lrs.tolist() if isinstance(lrs, torch.Tensor) else list(lrs), list(st["iters"])
    if isinstance(losses, torch.Tensor) and losses.dim() == 1 and len(losses):
        rec.losses = []
        if isinstance(getattr(type(rec), "losses", None), RecorderLosses):
            rec.__dict__.setdefault("_state", {})["frk_losses"] = losses  # rebuilt on first read
        else:
            rec.losses = _unbind(losses)  # a Recorder subclass that defines its own `losses`
    else:
        rec.losses = list(losses)
    rec.values = [L(v) for v in st["values"]]
    rec.smooth_loss.count, rec.smooth_loss.val = st["smooth_count"], st["smooth_val"]
    if rec.smooth_loss.count:
        learn.smooth_loss = rec.smooth_loss.value
    if rec.values:
        learn.final_record = rec.values[-1].copy()


def held(v) -> bool:
    """Whether `v` is what a model may keep between batches and a checkpoint holds: a tensor with no
    autograd history that is not a parameter (a detached hidden state), or a list or tuple of them."""
    if isinstance(v, torch.Tensor):
        return not isinstance(v, torch.nn.Parameter) and v.grad_fn is None and not v.requires_grad
    return isinstance(v, (list, tuple)) and bool(v) and all(held(x) for x in v)


def _storage(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own here (a DTensor's shard)
        return None


def _storages(v) -> set:
    if isinstance(v, torch.Tensor):
        return {_storage(v)} - {None}
    return set().union(*(_storages(x) for x in v)) if isinstance(v, (list, tuple)) else set()


def _public(name: str) -> bool:
    "An attribute a checkpoint may hold or set: not torch's own (`_...`, `training`)."
    return not name.startswith("_") and name != "training"


def _attrs(m, own: set) -> dict:
    """A module's plain attributes that hold tensors between batches (the fastai book's `self.h` of its RNNs):
    public names only (torch keeps its own as `_...`), never one that shares memory with a parameter or
    buffer (a `.data` alias must stay one)."""
    return {k: v for k, v in m.__dict__.items() if _public(k) and held(v) and not (_storages(v) & own)}


def module_states(model) -> dict:
    """Tensors a model keeps between batches outside its state dict, by module name: the hidden state of
    fastai's `AWD_LSTM` (`hidden` and `bs`), and any module's plain attributes that hold detached tensors
    (`attrs`: the recurrent models a user writes, as the fastai book's chapter 12 does)."""
    own = {_storage(t) for t in (*model.parameters(), *model.buffers())} - {None}
    out: dict = {}
    for name, m in model.named_modules():
        hid = m.__dict__.get("hidden")
        if isinstance(hid, list) and hid and isinstance(m.__dict__.get("bs"), int):
            out[name] = {"hidden": plain(hid), "bs": m.bs}
        elif attrs := _attrs(m, own):
            out[name] = {"attrs": plain(attrs)}
    return out


def _device(m, model):
    return next((t.device for t in (*m.parameters(), *m.buffers(), *model.parameters())), torch.device("cpu"))


def set_module_states(model, states: dict) -> None:
    mods = dict(model.named_modules())
    for name, st in states.items():
        m = mods.get(name)
        if "attrs" in st:
            for k, v in st["attrs"].items():
                if m is None or not _public(k) or k not in m.__dict__:
                    raise CheckpointError(
                        f"model state {name!r}.{k}: this model has no such attribute (was it built the same way?)"
                    )
                if isinstance(m.__dict__[k], (torch.nn.Parameter, torch.nn.Module)):
                    raise CheckpointError(f"model state {name!r}.{k}: a parameter or module in this model")
                setattr(m, k, _hidden_to(v, _device(m, model), name))
            continue
        if m is None or not isinstance(m.__dict__.get("hidden"), list):
            raise CheckpointError(f"model state {name!r}: this model has no such recurrent module")
        dev = next(m.parameters()).device
        m.hidden, m.bs = [_hidden_to(h, dev, name) for h in st["hidden"]], int(st["bs"])


def _hidden_to(v, dev, name):
    "A saved hidden state (tensors in lists and tuples) copied onto `dev`."
    if isinstance(v, torch.Tensor):
        return v.to(dev, copy=True)
    if isinstance(v, (list, tuple)):
        return type(v)(_hidden_to(x, dev, name) for x in v)
    raise CheckpointError(f"model state {name!r}: {type(v).__name__} in its hidden state")


def set_train_metrics(learn, st: dict) -> None:
    """The running train-metric accumulators of a resumed epoch (after the Recorder's `before_train`
    has reset them for the epoch)."""
    for m, ms in zip(_train_metrics(learn.recorder), st.get("train_metrics", [])):
        for k, v in ms.items():
            if k in _METRIC_FIELDS:
                m.__dict__[k] = list(v) if isinstance(v, (list, tuple)) else v


def opt_state_for(opt, sd: dict) -> dict:
    """An optimizer state dict read from a checkpoint as the optimizer's own `state_dict()` has it:
    fastai's `Optimizer` keeps its hyper-parameters in an `L` (what a later `learn.save` pickles)."""
    if isinstance(sd, dict) and isinstance(sd.get("hypers"), list) and isinstance(getattr(opt, "hypers", None), L):
        return {**sd, "hypers": L(sd["hypers"])}
    return sd


def set_grads(model, had, pending) -> None:
    """Each parameter's gradient as the uninterrupted run had it: `pending` (those of an accumulation in
    progress) if given, else a zero gradient where `had` says one existed and none where it did not.
    fastai's optimizer steps every parameter that has a gradient, a frozen one with a zero gradient too
    (its Adam moments and weight decay go on), so whether a gradient exists is state."""
    for i, p in enumerate(model.parameters()):
        has = had[i] if had is not None else p.grad is not None  # (older files: what the process has)
        if pending is not None:
            p.grad = None if pending[i] is None else pending[i].to(p.device, copy=True)
        elif not has:
            p.grad = None
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.detach_()
            p.grad.zero_()


def print_row(learn, row) -> None:
    "Show a finished epoch's row as fastai would, but write it to no CSV file (the file has it already)."
    logger = learn.logger
    while is_a(getattr(logger, "__self__", None), "fastai.callback.progress", "CSVLogger"):
        logger = logger.__self__.old_logger
    logger(row)
