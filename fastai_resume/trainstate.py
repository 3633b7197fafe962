"""The training state a checkpoint holds, in one place: its schema version, its capture from a fit,
its validation when a file is read, and its restore into the next fit; and the same for the state a
stage leaves when it ends (`between`). A new piece of training state is added here: captured in
`capture` (or `end_tree`), checked in `validate` (or `validate_end`), restored in `restore_fit`,
`restore_epoch` or `restore_end`.

    train = {"position": {epoch, iter, n_epoch, n_iter, bs, fit_index, stage, train_iter, pct_train,
                          world_size, loader_done, n_iter_all},
             "stages": [each stage's signature so far], "rng_stage": RNG when the stage began,
             "rng", "rng_valid", "rng_epoch", "loaders_now", "loaders_epoch", "recorder", "modules":
                 this rank's (under DDP "ranks" holds every other rank's),
             "hypers", "grads", "grad_set", "rows", "callbacks",
             "script": {"ends": the stage ends before this stage, "log": the between-stage calls}}

Validation raises `CheckpointError` naming the first malformed field, so a wrong or hostile file is
refused before anything is changed, never with an error later in `fit`.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
from fastcore.foundation import L

from . import callbacks, dist, loaders, state
from .io import CheckpointError

__all__ = [
    "VERSION",
    "RESUMES_FROM",
    "capture",
    "validate",
    "validate_end",
    "rank_view",
    "restore_fit",
    "restore_epoch",
    "end_tree",
    "restore_end",
    "script_part",
    "recorder_numbers",
    "set_recorder_numbers",
    "grads_mismatch",
]

# 4: frozen parameters by fingerprint (`frozen`), the trainable map; 3: the Recorder's lrs as one float64 tensor;
# 2: stages, loader states, validation-time RNG
VERSION = 4
RESUMES_FROM = 2  # training positions saved by older schemas are refused with a message (1: no stages)


# ---- capture ----------------------------------------------------------------------------------


def capture(s) -> dict | None:
    """The training state of the fit that `s` (its `ResumeSession`) runs, now. Collective under DDP
    (every rank's RNG, loader and Recorder state go to rank 0); ranks other than 0 get None."""
    learn = s.learn
    pos = s.position()  # before completing the event: a save from inside a batch is refused first
    if pos is not None and s.frames.deferred is None:
        s.frames.deferred = s.frames.complete()
    pos = s.position()
    if pos is None:
        return None
    epoch, it = pos
    rec = getattr(learn, "recorder", None)
    rows = list(s.rows)
    if rec is not None and len(rows) == s.epoch and len(rec.values) > s.epoch and epoch > s.epoch:
        rows.append(state.plain(list(rec.log)))  # this epoch's row, logged by the Recorder already
    boundary = it == 0
    n_iter = len(learn.dls.train)
    validating = s.rng_valid is not None and epoch == s.epoch and it == n_iter
    # saved after the training loop ended (after_train, validation): the loader had read all of the
    # epoch, the partial batch drop_last discards included; from after_batch of the last batch it had not
    loader_done = epoch == s.epoch and it == n_iter and not (learn.training and s.frames.event == "after_batch")
    now_loaders = [loaders.capture(dl) for dl in learn.dls.loaders]
    mine = {  # what differs between the ranks of a data-parallel fit
        "rng": state.rng_state(),
        "rng_valid": s.rng_valid if validating else None,
        "rng_epoch": s.rng_epoch if s.rng_epoch is not None and not boundary else state.rng_state(),
        "loaders_now": s.loaders_valid if validating else now_loaders,
        "loaders_epoch": s.loaders_epoch if s.loaders_epoch is not None and not boundary else now_loaders,
        "recorder": state.recorder_state(rec) if rec is not None else None,
        "modules": state.module_states(learn.model),
    }
    per_rank = dist.sharded(learn.model)  # a sharded model: every rank writes its own file (`sharded`)
    ranks = dist.gather("the ranks' training state", mine) if dist.active() and not per_rank else None  # a step
    if dist.rank() != 0 and not per_rank:
        return None  # rank 0 writes
    st = s.stage
    return {
        "position": {
            "epoch": epoch,
            "iter": it,
            "n_epoch": s.n_epoch,
            "n_iter": n_iter,
            "bs": loaders.batch_size(learn.dls.train),
            "fit_index": s.fit_index,
            "stage": st.index,
            "train_iter": learn.train_iter,
            "pct_train": float(learn.pct_train),
            "world_size": dist.world(),
            "loader_done": loader_done,
            "n_iter_all": len(dist.unwrap_dl(learn.dls.train)),
        },
        "stages": list(s.script.signatures[: st.index]) + [st.signature],
        "rng_stage": st.rng_start,
        **mine,
        "ranks": None if ranks is None else [None] + ranks[1:],  # rank 0's are the fields above
        "hypers": state.plain([dict(h) for h in learn.opt.hypers]),
        "grads": _pending_grads(learn.model),
        "grad_set": [p.grad is not None for p in learn.model.parameters()],
        "trainable": [p.requires_grad for p in learn.model.parameters()],
        "rows": rows,
        "callbacks": callbacks.callback_states(learn),
        "script": script_part(s.script, st),
    }


def _pending_grads(model):
    """The parameters' gradients if any is non-zero (accumulation in progress), else None. A sharded
    gradient (a DTensor) is judged by this rank's part: its `any()` would be a collective, and each rank
    saves its own."""
    grads = [p.grad for p in model.parameters()]
    if not any(g is not None and bool((g.to_local() if hasattr(g, "to_local") else g).any()) for g in grads):
        return None
    return [None if g is None else g.detach() for g in grads]


def script_part(sc, st) -> dict:
    "What a checkpoint saved in stage `st` carries of the script: the stage ends before it, and the log."
    return {"ends": list(sc.ends[: st.index]), "log": list(sc.log)}


# ---- validation -------------------------------------------------------------------------------


class _Bad(Exception):
    pass


def _need(ok, where: str, what: str):
    if not ok:
        raise _Bad(f"{where}: {what}")


def _int(v, where, lo=0):
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, where, f"expected an int >= {lo}, got {v!r:.40}")
    return v


def _num(v, where):
    _need(isinstance(v, (int, float)) and not isinstance(v, bool), where, f"expected a number, got {type(v).__name__}")


def _dict(v, where, keys=()):
    _need(isinstance(v, dict), where, f"expected a dict, got {type(v).__name__}")
    for k in keys:
        _need(k in v, where, f"missing {k!r}")
    return v


def _seq(v, where):
    _need(isinstance(v, (list, tuple)), where, f"expected a list, got {type(v).__name__}")
    return v


def _tensor(v, where, dtype=None, dim=None):
    _need(isinstance(v, torch.Tensor), where, f"expected a tensor, got {type(v).__name__}")
    if dtype is not None:
        _need(v.dtype == dtype, where, f"dtype {v.dtype}, expected {dtype}")
    if dim is not None:
        _need(v.dim() == dim, where, f"{v.dim()} dimensions, expected {dim}")


def _py_rng(v, where):
    v = _seq(v, where)
    _need(
        len(v) == 3
        and isinstance(v[0], int)
        and isinstance(v[1], (list, tuple))
        and len(v[1]) == 625
        and all(isinstance(x, int) and 0 <= x < 1 << 32 for x in v[1][:624])
        and (v[2] is None or isinstance(v[2], float)),
        where,
        "not a Python RNG state",
    )


def _rng(v, where):
    v = _dict(v, where, ("python", "numpy", "torch"))
    _py_rng(v["python"], f"{where}.python")
    n = _seq(v["numpy"], f"{where}.numpy")
    _need(
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
    _tensor(v["torch"], f"{where}.torch", torch.uint8, 1)
    for i, t in enumerate(_seq(v.get("cuda", []), f"{where}.cuda")):
        _tensor(t, f"{where}.cuda[{i}]", torch.uint8, 1)


def _loader(v, where):
    v = _dict(v, where, ("kind",))
    _need(v["kind"] in ("fastai", "torch", "other"), where, f"unknown loader kind {v['kind']!r:.20}")
    if "rng" in v:
        _py_rng(v["rng"], f"{where}.rng")
    if "order" in v:
        order = _seq(v["order"], f"{where}.order")
        _need(
            all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(order) for i in order)
            and len(set(order)) == len(order),
            f"{where}.order",
            "not a permutation",
        )
    for i, g in enumerate(_seq(v.get("generators", []), f"{where}.generators")):
        _tensor(g, f"{where}.generators[{i}]", torch.uint8, 1)


def _recorder(v, where):
    if v is None:
        return
    v = _dict(v, where, ("lrs", "iters", "losses", "values", "smooth_count", "smooth_val"))
    if isinstance(v["lrs"], torch.Tensor):  # schema 3
        _tensor(v["lrs"], f"{where}.lrs", torch.float64, 1)
    else:
        for x in _seq(v["lrs"], f"{where}.lrs"):
            _num(x, f"{where}.lrs[]")
    for x in _seq(v["iters"], f"{where}.iters"):
        _int(x, f"{where}.iters[]")
    losses = v["losses"]
    if isinstance(losses, torch.Tensor):
        _need(losses.dim() == 1 and losses.is_floating_point(), f"{where}.losses", "expected a 1-dim float tensor")
    else:
        for x in _seq(losses, f"{where}.losses"):
            _need(
                isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.dim() == 0),
                f"{where}.losses[]",
                "expected a number",
            )
    for row in _seq(v["values"], f"{where}.values"):
        for x in _seq(row, f"{where}.values[]"):
            _need(
                x is None
                or isinstance(x, (int, float))
                and not isinstance(x, bool)
                or isinstance(x, torch.Tensor)
                and x.dim() == 0,
                f"{where}.values[]",
                "expected a number",
            )
    _int(v["smooth_count"], f"{where}.smooth_count")
    sv = v["smooth_val"]
    _need(
        isinstance(sv, float) or isinstance(sv, torch.Tensor) and sv.dim() == 0 and sv.is_floating_point(),
        f"{where}.smooth_val",
        "expected a float",
    )
    for m in _seq(v.get("train_metrics", []), f"{where}.train_metrics"):
        _dict(m, f"{where}.train_metrics[]")


def _rank_part(v, where):
    v = _dict(v, where, ("rng", "rng_epoch", "loaders_now", "loaders_epoch"))
    for k in ("rng", "rng_epoch"):
        _rng(v[k], f"{where}.{k}")
    if v.get("rng_valid") is not None:
        _rng(v["rng_valid"], f"{where}.rng_valid")
    for k in ("loaders_now", "loaders_epoch"):
        for i, ld in enumerate(_seq(v[k], f"{where}.{k}")):
            _loader(ld, f"{where}.{k}[{i}]")
    _recorder(v.get("recorder"), f"{where}.recorder")
    validate_modules(v.get("modules", {}), f"{where}.modules")


def validate_modules(v, where) -> None:
    "The tensors a model keeps between batches outside its state dict (`state.module_states`), by module."
    for name, m in _dict(v, where).items():
        at = f"{where}[{name!r}]"
        if isinstance(m, dict) and "attrs" in m:  # a module's plain attributes: tensors, or lists of them
            for k, x in _dict(m["attrs"], f"{at}.attrs").items():
                _need(isinstance(k, str) and state.held(x), f"{at}.attrs", f"{k!r}: expected tensors, got {x!r:.60}")
            continue
        m = _dict(m, at, ("hidden", "bs"))
        _int(m["bs"], f"{at}.bs")
        _seq(m["hidden"], f"{at}.hidden")


def _script(v, where):
    "What a checkpoint carries of its script (`between.script_tree`): the stage ends before it and the log."
    v = _dict(v, where, ("ends", "log"))
    for i, e in enumerate(_seq(v["ends"], f"{where}.ends")):
        if e is not None:
            e = _dict(e, f"{where}.ends[{i}]", ("file", "token"))
            _need(isinstance(e["file"], str), f"{where}.ends[{i}].file", "expected a str")
            _int(e["token"], f"{where}.ends[{i}].token")
    for i, ev in enumerate(_seq(v["log"], f"{where}.log")):
        ev = _dict(ev, f"{where}.log[{i}]", ("at", "op", "file", "crc"))
        _int(ev["at"], f"{where}.log[{i}].at")
        _need(isinstance(ev["op"], str), f"{where}.log[{i}].op", "expected a str")
        _need(ev["file"] is None or isinstance(ev["file"], str), f"{where}.log[{i}].file", "expected a str or None")
        _need(ev["crc"] is None or isinstance(ev["crc"], int), f"{where}.log[{i}].crc", "expected an int or None")


def _public(check):
    "A validator of one part, raising `CheckpointError` (used by the stage ends' validation)."

    def validate(v, where: str) -> None:
        try:
            check(v, where)
        except _Bad as e:
            raise CheckpointError(f"malformed training state: {e}") from None

    return validate


validate_rng, validate_loader, validate_recorder = _public(_rng), _public(_loader), _public(_recorder)
validate_script = _public(_script)


_POSITION_INTS = ("epoch", "iter", "n_epoch", "n_iter", "fit_index", "stage", "train_iter", "world_size", "n_iter_all")


def validate(train) -> None:
    "Raise `CheckpointError` naming the first field of a training-state tree that is malformed."
    try:
        t = _dict(train, "train", ("position", "stages", "hypers", "grads", "rows", "callbacks", "rng_stage"))
        pos = _dict(t["position"], "train.position", _POSITION_INTS + ("bs", "pct_train"))
        for k in _POSITION_INTS:
            _int(pos[k], f"train.position.{k}", lo=1 if k == "world_size" else 0)
        _need(pos["bs"] is None or isinstance(pos["bs"], int), "train.position.bs", "expected an int or None")
        _num(pos["pct_train"], "train.position.pct_train")
        _need(isinstance(pos.get("loader_done", False), bool), "train.position.loader_done", "expected a bool")
        _need(
            pos["epoch"] <= pos["n_epoch"] and pos["iter"] <= pos["n_iter"],
            "train.position",
            f"epoch {pos['epoch']}/{pos['n_epoch']}, iteration {pos['iter']}/{pos['n_iter']} is outside the fit",
        )
        stages = _seq(t["stages"], "train.stages")
        _need(len(stages) == pos["stage"] + 1, "train.stages", f"{len(stages)} stages for stage {pos['stage']}")
        for i, s in enumerate(stages):
            s = _dict(s, f"train.stages[{i}]", ("method", "args", "trainable"))
            for k in ("method", "trainable"):
                _need(isinstance(s[k], str), f"train.stages[{i}].{k}", "expected a str")
            for k, v in _dict(s["args"], f"train.stages[{i}].args").items():
                _need(isinstance(k, str) and isinstance(v, str), f"train.stages[{i}].args", "expected str: str")
        _rank_part(t, "train")
        _rng(t["rng_stage"], "train.rng_stage")
        ranks = t.get("ranks")
        if ranks is not None:
            for i, r in enumerate(_seq(ranks, "train.ranks")):
                if r is not None:
                    _rank_part(r, f"train.ranks[{i}]")
        for i, h in enumerate(_seq(t["hypers"], "train.hypers")):
            for k, x in _dict(h, f"train.hypers[{i}]").items():
                where = f"train.hypers[{i}][{k!r}]"
                _need(isinstance(k, str), where, "expected a str key")
                if isinstance(x, (list, tuple)):
                    for y in x:
                        _num(y, where)
                else:  # numbers, and the flags torch's optimizers keep (foreach=None, maximize=False, ...)
                    _need(
                        x is None or isinstance(x, (bool, int, float, str)),
                        where,
                        f"expected a number, a flag or None, got {type(x).__name__}",
                    )
        for k in ("grad_set", "trainable"):
            gs = t.get(k)
            _need(
                gs is None or (isinstance(gs, (list, tuple)) and all(isinstance(b, bool) for b in gs)),
                f"train.{k}",
                "expected a list of bools",
            )
        if t["grads"] is not None:
            for i, g in enumerate(_seq(t["grads"], "train.grads")):
                if g is not None:
                    _tensor(g, f"train.grads[{i}]")
        for row in _seq(t["rows"], "train.rows"):
            _seq(row, "train.rows[]")
        _dict(t["callbacks"], "train.callbacks")
    except _Bad as e:
        raise CheckpointError(f"malformed training state: {e}") from None
    if t.get("script") is not None:
        validate_script(t["script"], "train.script")


# ---- restore ----------------------------------------------------------------------------------


def rank_view(saved: dict) -> dict:
    """The saved training state as this rank sees it: its own RNG, loader and Recorder state from
    `ranks` (`fit` uses no saved state at all when the world size differs)."""
    ranks = saved.get("ranks")
    if not ranks or dist.rank() >= len(ranks):
        return saved
    mine = ranks[dist.rank()]
    return saved if mine is None else {**saved, **mine}


def saved_rng(sv: dict) -> dict:
    "The RNG state the uninterrupted run continued with: at the save, or at the start of the validation it was in."
    return sv["rng"] if sv["rng_valid"] is None else sv["rng_valid"]


def _kind(v) -> str:
    "What a hyper-parameter's value is, for comparing a saved one with the optimizer's own."
    if v is None or isinstance(v, (bool, str)):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, (list, tuple)):
        return f"sequence of {len(v)}"
    return type(v).__name__


def _on_training_device(learn, tree):
    """`tree` (an optimizer state kept on the CPU since `learn.load`) on the device the fit trains on:
    the loaders' device, as fastai's `load` and `TrainEvalCallback` use, else the parameters'. On the
    CPU a CUDA fit's first step failed: Adam's moments on the CPU, the gradients on the GPU."""
    from fastai.torch_core import to_device

    dev = getattr(learn.dls, "device", None)
    if dev is None:
        dev = next(iter(learn.model.parameters()), torch.empty(0)).device
    return tree if torch.device(dev).type == "cpu" else to_device(tree, dev)


def put_state(learn, model_state=None, opt_state=None) -> None:
    """An armed checkpoint's model and optimizer state into the learner (validated at its load; a delta
    file's frozen tensors are the learner's already)."""
    if model_state is not None:
        from fastai.torch_core import get_model

        # the keys the load validated (with its `strict`; a `strict=False` load may have fewer)
        get_model(learn.model).load_state_dict(model_state, strict=False)
    if opt_state is not None:
        learn.opt.load_state_dict(state.opt_state_for(learn.opt, _on_training_device(learn, opt_state)))


def restore_fit(learn, sv: dict, source, model_state=None, opt_state=None) -> list:
    """At a resumed fit's start (after the callbacks' own `before_fit`): the model when stages passed
    before replaced it, the optimizer (again: a wrapper may have cleared it, as fine_tune's freeze
    does), the gradients, the hyper-parameters (fit() has just reset the learning rate and weight
    decay), the Recorder and the callbacks. Returns the printed rows of the finished epochs."""
    _check_trainable(learn, sv.get("trainable"), source)
    put_state(learn, model_state, opt_state)
    bad = grads_mismatch(sv, len(list(learn.model.parameters())))
    if bad:
        raise CheckpointError(f"{source}: malformed training state: {bad}")
    # a rerun that skipped the stages that made the gradients has none; in the process itself, an
    # interrupt between `backward` and `zero_grad` left gradients that the next `backward` would add to
    state.set_grads(learn.model, sv.get("grad_set"), sv.get("grads"))
    hypers = sv["hypers"]
    if hypers and len(hypers) != len(learn.opt.hypers):
        raise CheckpointError(
            f"{source}: {len(hypers)} parameter groups saved, the optimizer has {len(learn.opt.hypers)}"
        )
    for i, (live, saved) in enumerate(zip(learn.opt.hypers, hypers)):
        for k, v in saved.items():
            if k not in live or _kind(live[k]) != _kind(v):
                raise CheckpointError(
                    f"{source}: train.hypers[{i}][{k!r}] is a {type(v).__name__} in the file, "
                    f"{type(live.get(k)).__name__ if k in live else 'not a hyper-parameter'} in the optimizer"
                )
    for k in hypers[0] if hypers else {}:
        learn.opt.set_hyper(k, [h[k] for h in hypers])
    if sv["recorder"] is not None:
        state.set_recorder_state(learn, sv["recorder"])
    callbacks.set_callback_states(learn, sv["callbacks"])
    return [list(r) for r in sv["rows"]]


def _check_trainable(learn, saved, source) -> None:
    """The same parameters are frozen as when the checkpoint was saved (the same stage of the same script
    freezes the same ones): else the resumed fit would train another set, and is refused."""
    if saved is None:  # (older files)
        return
    named = list(learn.model.named_parameters())
    if len(saved) != len(named):
        raise CheckpointError(f"{source}: {len(saved)} parameters saved, this model has {len(named)}")
    for (name, p), was in zip(named, saved):
        if p.requires_grad != was:
            raise CheckpointError(
                f"{source}: {name} was {'trainable' if was else 'frozen'} when the checkpoint was saved and is "
                f"{'trainable' if p.requires_grad else 'frozen'} here: the resumed fit would train another set of "
                "parameters. Freeze and unfreeze as the run did before this fit (the same script, unchanged)."
            )


def restore_epoch(learn, sv: dict, at_save: bool, k: int) -> None:
    """At the start of the resumed epoch, `k` batches into it: the RNG and loaders (as at the save when
    `at_save`, else as at the epoch's start, the skip then drawing what the epoch's start drew), the
    schedule's position, and mid-epoch the recurrent models' hidden state and the train metrics."""
    if at_save:
        state.set_rng_state(saved_rng(sv))
        _restore_loaders(learn, sv["loaders_now"])
    else:
        state.set_rng_state(sv["rng_epoch"])
        _restore_loaders(learn, sv["loaders_epoch"], with_stream_state=False)
    learn.train_iter, learn.pct_train = sv["position"]["train_iter"], sv["position"]["pct_train"]
    if k and sv.get("modules"):
        state.set_module_states(learn.model, sv["modules"])
    if k and sv["recorder"] is not None:
        state.set_train_metrics(learn, sv["recorder"])
    if k and loaders.is_stream(learn.dls.train) and loaders.has_state(learn.dls.train):
        loaders.restore(learn.dls.train, sv["loaders_now"][0])  # the stream continues from where it was


def _restore_loaders(learn, states, with_stream_state=True):
    for dl, st in zip(learn.dls.loaders, states):
        loaders.restore(dl, st, with_stream_state)


# ---- the state a stage ends with ---------------------------------------------------------------


def _learner_counters(learn) -> dict:
    out: dict = {}
    for k in ("epoch", "n_epoch", "iter", "n_iter", "train_iter"):
        v = learn.__dict__.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
    if isinstance(learn.__dict__.get("pct_train"), (int, float)):
        out["pct_train"] = float(learn.pct_train)
    fr = learn.__dict__.get("final_record")
    if fr is not None:
        out["final_record"] = state.plain(list(fr))
    sl = learn.__dict__.get("smooth_loss")
    if isinstance(sl, torch.Tensor):
        out["smooth_loss"] = sl.detach().clone()
    return out


def recorder_numbers(rec) -> dict:
    "The Recorder's per-epoch numbers (small): what a rerun has of a stage whose end state was not kept."
    return {
        "values": state.plain([list(v) for v in rec.values]),
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


def end_tree(learn, st) -> dict | None:
    """The state stage `st` ends with, beside the model and optimizer (collective under DDP: every rank's
    RNG, loaders and Recorder); ranks other than 0 get None."""
    rec = getattr(learn, "recorder", None)
    mine = {
        "rng": state.rng_state(),
        "loaders": [loaders.capture(dl) for dl in learn.dls.loaders],
        "modules": state.module_states(learn.model),
        "recorder": None
        if rec is None or not hasattr(rec, "values")
        else {**state.recorder_state(rec), **recorder_numbers(rec), "log": state.plain(list(getattr(rec, "log", [])))},
    }
    per_rank = dist.sharded(learn.model)  # a sharded model: every rank writes its own part (`sharded`)
    ranks = dist.gather("the ranks' end states", mine) if dist.active() and not per_rank else None
    token = secrets.randbits(62)
    if per_rank:
        token = dist.all_gather_ints("an end state's token", [token])[0][0]
    if dist.rank() != 0 and not per_rank:
        return None
    return {
        "stage": st.index,
        "token": token,
        "signature": st.signature,
        **mine,
        "ranks": None if ranks is None else [None] + ranks[1:],
        "callbacks": callbacks.callback_states(learn, between_stages=True),
        "grad_set": [p.grad is not None for p in learn.model.parameters()],
        "trainable": [p.requires_grad for p in learn.model.parameters()],
        "training": bool(learn.model.training),
        "learner": _learner_counters(learn),
        "rows": [state.plain(list(r)) for r in st.rows],
    }


def validate_end(end, path, n_params: int) -> None:
    """Raise `CheckpointError` naming `path` and the first malformed field of a stage's end state, or
    one that does not fit a model of `n_params` parameters."""

    def need(ok, what):
        if not ok:
            raise CheckpointError(f"{path}: malformed stage end: {what}")

    need(isinstance(end, dict), "expected a dict")
    for k in ("rng", "loaders", "callbacks", "grad_set", "learner", "rows"):
        need(k in end, f"missing {k!r}")
    try:
        validate_rng(end["rng"], "end.rng")
        for i, ld in enumerate(_seq_or_raise(end["loaders"], "end.loaders")):
            validate_loader(ld, f"end.loaders[{i}]")
        validate_recorder(end.get("recorder"), "end.recorder")
        validate_modules(end.get("modules", {}), "end.modules")
        for i, r in enumerate(end.get("ranks") or []):
            if isinstance(r, dict):
                validate_modules(r.get("modules", {}), f"end.ranks[{i}].modules")
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    need(isinstance(end["callbacks"], dict), "callbacks: expected a dict")
    need(isinstance(end["grad_set"], list) and all(isinstance(b, bool) for b in end["grad_set"]), "grad_set")
    need(
        len(end["grad_set"]) == n_params, f"{len(end['grad_set'])} gradient flags, the model has {n_params} parameters"
    )
    need(isinstance(end["learner"], dict), "learner: expected a dict")
    need(isinstance(end["rows"], list) and all(isinstance(r, list) for r in end["rows"]), "rows")


def _seq_or_raise(v, where):
    if not isinstance(v, (list, tuple)):
        raise CheckpointError(f"malformed training state: {where}: expected a list")
    return v


_COUNTERS = {"epoch": int, "n_epoch": int, "iter": int, "n_iter": int, "train_iter": int, "pct_train": float}


def restore_end(learn, end: dict) -> None:
    """The learner as the stage ended (its model and optimizer already loaded): RNG, loaders, Recorder,
    callbacks, the tensors the model keeps between batches, gradients, the model's mode, the learner's
    counters."""
    end = rank_view(end)
    state.set_rng_state(end["rng"])
    for dl, ld in zip(learn.dls.loaders, end["loaders"]):
        loaders.restore(dl, ld)
    rec = end.get("recorder")
    if rec is not None and getattr(learn, "recorder", None) is not None:
        state.set_recorder_state(learn, rec)
        set_recorder_numbers(learn, rec)
        learn.recorder.log = L(rec.get("log") or [])
    callbacks.set_callback_states(learn, end["callbacks"], between_stages=True)
    state.set_module_states(learn.model, end.get("modules") or {})
    state.set_grads(learn.model, end["grad_set"], None)
    learn.model.train(bool(end.get("training", False)))
    for k, v in end["learner"].items():
        if k == "final_record" and isinstance(v, list):
            learn.final_record = L(v)
        elif k == "smooth_loss" and isinstance(v, torch.Tensor) and v.dim() == 0:
            learn.smooth_loss = v
        elif isinstance(v, _COUNTERS.get(k, ())) and not isinstance(v, bool):
            setattr(learn, k, v)


def grads_mismatch(train: dict, n_params: int) -> str:
    "What is wrong with a training state's gradient lists for a model of `n_params` parameters ('' if nothing)."
    for key in ("grad_set", "grads"):
        saved = train.get(key)
        if saved is not None and len(saved) != n_params:
            return f"train.{key} has {len(saved)} entries, the model has {n_params} parameters"
    return ""
