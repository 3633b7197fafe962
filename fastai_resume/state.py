"""Pieces of the training state that decide what the next step computes, as plain trees, and back:
RNG states, the Recorder, the hidden state of recurrent models, the gradients, the hyper-parameters, the
learner's counters; and what a file's copy of each must be (`check_*`, with `fields`). (Loaders' state is
in `loaders`, callbacks' in `callbacks`; `pieces` makes them the table of pieces `trainstate` walks.)
"""

from __future__ import annotations

import functools
import gc
import operator
import random
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from fastcore.foundation import L

from . import dist
from .fastai_classes import is_a
from .fields import a_dict, a_list, a_number, a_tensor, an_int, need
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
    "hyper_kind",
    "pending_grads",
    "learner_counters",
    "set_learner_counters",
    "check_hypers",
    "check_py_rng",
    "check_rng",
    "check_recorder",
    "check_modules",
    "recorder_numbers",
    "set_recorder_numbers",
]


def plain(v: Any) -> Any:
    "`v` with fastai/NumPy containers and scalars turned into the storable base types."
    return map_tree(v, _plain_leaf, scalars=True, seqs=_fastcore_lists())


def _fastcore_lists() -> tuple:
    "fastcore's `L`, where it is imported (nothing else makes one): walked as a list."
    mod = sys.modules.get("fastcore.foundation")
    return (mod.L,) if mod is not None else ()


def _plain_leaf(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


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


def _attrs(m, own: Callable[[], set]) -> dict:
    """A module's plain attributes that hold tensors between batches (the fastai book's `self.h` of its RNNs):
    public names only (torch keeps its own as `_...`), never one that shares memory with a parameter or
    buffer (a `.data` alias must stay one). `own()`: the storages of the model's parameters and buffers."""
    d = m.__dict__
    if not any(map(_holder, set(map(type, d.values())))):
        return {}  # (the common case, told by the few kinds of its values: an LLM's every-step save walks hundreds)
    found = {k: v for k, v in d.items() if isinstance(v, _HOLDERS) and _public(k) and held(v)}
    return {k: v for k, v in found.items() if not (_storages(v) & own())} if found else found


_HOLDERS = (torch.Tensor, list, tuple)  # what `held` can be true of
_holder = functools.cache(lambda t: issubclass(t, _HOLDERS))  # (by type: a module's few kinds of values)


def module_states(model) -> dict:
    """Tensors a model keeps between batches outside its state dict, by module name: the hidden state of
    fastai's `AWD_LSTM` (`hidden` and `bs`), and any module's plain attributes that hold detached tensors
    (`attrs`: the recurrent models a user writes, as the fastai book's chapter 12 does)."""

    @functools.cache
    def own() -> set:  # (walked only where a module holds a tensor: a save at every step of an LLM pays no walk)
        return {_storage(t) for t in (*model.parameters(), *model.buffers())} - {None}

    out: dict = {}
    for name, m in dist.named_modules(model):
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


# ---- the optimizer's hyper-parameters, pending gradients, the learner's counters (`pieces`) ---------------


def hyper_kind(v) -> str:
    "What a hyper-parameter's value is, for comparing a saved one with the optimizer's own."
    if v is None or isinstance(v, (bool, str)):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, (list, tuple)):
        return f"sequence of {len(v)}"
    return type(v).__name__


def pending_grads(params: list):
    """The gradients of `params` (a model's parameters, in order) if any is non-zero (accumulation in
    progress), else None. A sharded gradient (a DTensor) is judged by this rank's part: its `any()` would be
    a collective, and each rank saves its own."""
    grads = [p.grad for p in params]
    if not any(g is not None and bool((g.to_local() if hasattr(g, "to_local") else g).any()) for g in grads):
        return None
    return [None if g is None else g.detach() for g in grads]


def check_hypers(v, where) -> None:
    "The optimizer's hyper-parameters, per parameter group: numbers (or lists of them) and flags."
    for i, h in enumerate(a_list(v, where)):
        for k, x in a_dict(h, f"{where}[{i}]").items():
            at = f"{where}[{i}][{k!r}]"
            need(isinstance(k, str), at, "expected a str key")
            if isinstance(x, (list, tuple)):
                for y in x:
                    a_number(y, at)
            else:  # numbers, and the flags torch's optimizers keep (foreach=None, maximize=False, ...)
                need(
                    x is None or isinstance(x, (bool, int, float, str)),
                    at,
                    f"expected a number, a flag or None, got {type(x).__name__}",
                )


def learner_counters(learn) -> dict:
    "The learner's own counters and last numbers, as fastai leaves them after a fit (a stage's end keeps them)."
    out: dict = {}
    for k in ("epoch", "n_epoch", "iter", "n_iter", "train_iter"):
        v = learn.__dict__.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
    if isinstance(learn.__dict__.get("pct_train"), (int, float)):
        out["pct_train"] = float(learn.pct_train)
    fr = learn.__dict__.get("final_record")
    if fr is not None:
        out["final_record"] = plain(list(fr))
    sl = learn.__dict__.get("smooth_loss")
    if isinstance(sl, torch.Tensor):
        out["smooth_loss"] = sl.detach().clone()
    return out


_COUNTERS = {"epoch": int, "n_epoch": int, "iter": int, "n_iter": int, "train_iter": int, "pct_train": float}


def set_learner_counters(learn, counters: dict) -> None:
    "Only what has the expected kind is set (a file's other keys are ignored, never set on the learner)."
    for k, v in counters.items():
        if k == "final_record" and isinstance(v, list):
            learn.final_record = L(v)
        elif k == "smooth_loss" and isinstance(v, torch.Tensor) and v.dim() == 0:
            learn.smooth_loss = v
        elif isinstance(v, _COUNTERS.get(k, ())) and not isinstance(v, bool):
            setattr(learn, k, v)


# ---- what a file's copy of them must be (`pieces` checks it before anything is restored) ----------------


def check_py_rng(v, where) -> None:
    "Python's RNG state (`random.getstate()`, as a list)."
    v = a_list(v, where)
    need(
        len(v) == 3
        and isinstance(v[0], int)
        and isinstance(v[1], (list, tuple))
        and len(v[1]) == 625
        and all(isinstance(x, int) and 0 <= x < 1 << 32 for x in v[1][:624])
        and (v[2] is None or isinstance(v[2], float)),
        where,
        "not a Python RNG state",
    )


def check_rng(v, where) -> None:
    "An RNG state (`state.rng_state`): Python's, NumPy's, torch's and each CUDA device's."
    v = a_dict(v, where, ("python", "numpy", "torch"))
    check_py_rng(v["python"], f"{where}.python")
    n = a_list(v["numpy"], f"{where}.numpy")
    need(
        len(n) == 5
        and n[0] == "MT19937"
        and isinstance(n[1], np.ndarray)
        and n[1].dtype == np.uint32
        and n[1].shape == (624,)
        and isinstance(n[2], int)
        and 0 <= n[2] <= 624
        and isinstance(n[3], int)
        and isinstance(n[4], float),
        f"{where}.numpy",
        "not a NumPy RNG state",
    )
    a_tensor(v["torch"], f"{where}.torch", torch.uint8, 1)
    for i, t in enumerate(a_list(v.get("cuda", []), f"{where}.cuda")):
        a_tensor(t, f"{where}.cuda[{i}]", torch.uint8, 1)


def _a_float_or_scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) or isinstance(x, torch.Tensor) and x.dim() == 0


def check_recorder(v, where) -> None:
    "The Recorder's state (`state.recorder_state`), or None (a learner without one)."
    if v is None:
        return
    v = a_dict(v, where, ("lrs", "iters", "losses", "values", "smooth_count", "smooth_val"))
    if isinstance(v["lrs"], torch.Tensor):  # schema 3
        a_tensor(v["lrs"], f"{where}.lrs", torch.float64, 1)
    else:
        for x in a_list(v["lrs"], f"{where}.lrs"):
            a_number(x, f"{where}.lrs[]")
    for x in a_list(v["iters"], f"{where}.iters"):
        an_int(x, f"{where}.iters[]")
    losses = v["losses"]
    if isinstance(losses, torch.Tensor):
        need(losses.dim() == 1 and losses.is_floating_point(), f"{where}.losses", "expected a 1-dim float tensor")
    else:
        for x in a_list(losses, f"{where}.losses"):
            need(
                isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.dim() == 0),
                f"{where}.losses[]",
                "expected a number",
            )
    for row in a_list(v["values"], f"{where}.values"):
        for x in a_list(row, f"{where}.values[]"):
            need(x is None or _a_float_or_scalar(x), f"{where}.values[]", "expected a number")
    an_int(v["smooth_count"], f"{where}.smooth_count")
    sv = v["smooth_val"]
    need(
        isinstance(sv, float) or isinstance(sv, torch.Tensor) and sv.dim() == 0 and sv.is_floating_point(),
        f"{where}.smooth_val",
        "expected a float",
    )
    for m in a_list(v.get("train_metrics", []), f"{where}.train_metrics"):
        a_dict(m, f"{where}.train_metrics[]")


def check_modules(v, where) -> None:
    "The tensors a model keeps between batches outside its state dict (`state.module_states`), by module."
    for name, m in a_dict(v, where).items():
        at = f"{where}[{name!r}]"
        if isinstance(m, dict) and "attrs" in m:  # a module's plain attributes: tensors, or lists of them
            for k, x in a_dict(m["attrs"], f"{at}.attrs").items():
                need(isinstance(k, str) and held(x), f"{at}.attrs", f"{k!r}: expected tensors, got {x!r:.60}")
            continue
        m = a_dict(m, at, ("hidden", "bs"))
        an_int(m["bs"], f"{at}.bs")
        a_list(m["hidden"], f"{at}.hidden")


def recorder_numbers(rec) -> dict:
    "The Recorder's per-epoch numbers (small): what a rerun has of a stage whose end state was not kept."
    return {
        "values": plain([list(v) for v in rec.values]),
        "metric_names": [str(n) for n in getattr(rec, "metric_names", [])],
    }


def set_recorder_numbers(learn, v) -> None:
    rec = getattr(learn, "recorder", None)
    if rec is None or not isinstance(v, dict):
        return
    vals = v.get("values")
    if not (isinstance(vals, list) and all(isinstance(r, list) for r in vals)):
        raise CheckpointError("malformed training state: train.script.log[].result.values: expected a list of lists")
    rec.values = [L(r) for r in vals]
    rec.metric_names = L(v.get("metric_names") or [])
    if rec.values:
        learn.final_record = rec.values[-1].copy()
