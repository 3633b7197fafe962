"""The checkpoint tree a Learner saves: its schema (versioned), its validation, its commit.

    {"fastai_resume": STATE_VERSION,
     "model": state dict, "opt": optimizer state dict (with_opt),
     "train": None (saved outside a fit) | the training state (`session.ResumeSession.capture`)}

Loading validates the whole tree before anything is changed: the model's keys, types, dtypes and
shapes against the learner's, the optimizer state's shape, and every field of the training state
(`validate_train`), so a wrong or hostile file gets a `CheckpointError` naming the field, never a
half-loaded learner or an error later in `fit`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

from . import dist, io
from .io import CheckpointError

__all__ = [
    "STATE_VERSION",
    "build_tree",
    "commit",
    "read",
    "check",
    "validate_train",
    "grads_mismatch",
    "model_mismatch",
    "remove_dead_temps",
]

STATE_VERSION = 3  # 3: the Recorder's lrs as one float64 tensor; 2: stages, loader states, validation-time RNG
RESUMES_FROM = 2  # training positions saved by older schemas are refused with a message (1: no stages)


def model_tree(learn, with_opt: bool) -> dict:
    from fastai.torch_core import get_model

    from .state import plain

    tree = {"fastai_resume": STATE_VERSION, "model": plain(get_model(learn.model).state_dict())}
    opt = getattr(learn, "opt", None)
    if with_opt and opt is not None:
        tree["opt"] = plain(opt.state_dict())
    return tree


def build_tree(learn, with_opt=True, with_iter=False) -> dict | None:
    """What a save stores: the model, the optimizer and, `with_iter`, the training position and state.
    Under torch.distributed, `with_iter` is collective (every rank's RNG, loader and Recorder state go
    to rank 0) and ranks other than 0 get None: they have nothing to write. A sharded model's ranks each
    get their own tree (DTensors in it), with nothing gathered (`sharded.commit` writes it)."""
    train = None
    if with_iter:
        if getattr(learn, "opt", None) is None:
            raise ValueError("save(with_iter=True): the learner has no optimizer yet (call fit or create_opt first)")
        from .session import session_of

        s = session_of(learn)
        train = s.capture() if s is not None else None
    if dist.rank() != 0 and not dist.sharded(learn.model):
        return None
    tree = model_tree(learn, with_opt)
    if with_iter:
        tree["train"] = train
    return tree


def cloned(tree):
    "`tree` with every tensor and array copied (what a live object may change in place stays apart)."
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {k: cloned(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [cloned(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(cloned(v) for v in tree)
    return tree


# A commit's temporary file (csrc/commit.c): `.<name>.tmp.<pid>.<16 random hex digits>` (older writers: `.<n>`, a count)
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>\d+)\.[0-9a-f]+$")


def is_temp(name: str) -> bool:
    "Is `name` a commit's temporary file (a save in progress, or one whose writer died)?"
    return _TEMP.match(name) is not None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_temps(folder: Path, names=None) -> int:
    """Remove temporary files of saves whose writing process is gone (killed mid-save), for the final
    names `names` accepts (a callable; all when None). A live writer's file is never touched."""
    n = 0
    if not folder.is_dir():
        return 0
    for p in folder.iterdir():
        m = _TEMP.match(p.name)
        if m is None or (names is not None and not names(m["name"])):
            continue
        if int(m["pid"]) == os.getpid() or _alive(int(m["pid"])):
            continue
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def commit(build, path: Path, model=None) -> None:
    """Write the tree `build()` returns to `path` atomically, on rank 0 only. Under
    torch.distributed every rank calls it (`build` may be collective) and returns once the file is
    committed, or raises if rank 0 could not build or write it. A sharded `model`: every rank writes its
    own file into the folder `path`, and a manifest is committed last (`sharded.commit`)."""
    if dist.sharded(model):
        from . import sharded

        return sharded.commit(build, path, model)
    exc = None
    try:
        tree = build()
        if dist.rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_dead_temps(path.parent, lambda name: name == path.name)
            io.save(tree, path)
    except Exception as e:  # under DDP every rank must hear of it, or the others wait forever
        if not dist.active():
            raise
        exc = e
    if not dist.active():
        return
    if not dist.agree_any(1 if exc is not None else 0):
        return  # committed, and every rank knows
    why = dist.broadcast(f"{type(exc).__name__}: {exc}" if exc is not None else "it failed on another rank")
    if exc is not None:
        raise exc
    raise CheckpointError(f"the checkpoint {path} was not saved (rank 0: {why}); the previous files are intact")


# ---- validation ---------------------------------------------------------------------------------


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
    for name, m in _dict(v.get("modules", {}), f"{where}.modules").items():
        m = _dict(m, f"{where}.modules[{name!r}]", ("hidden", "bs"))
        _int(m["bs"], f"{where}.modules[{name!r}].bs")
        _seq(m["hidden"], f"{where}.modules[{name!r}].hidden")


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


def validate_train(train) -> None:
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
        gs = t.get("grad_set")
        _need(
            gs is None or (isinstance(gs, (list, tuple)) and all(isinstance(b, bool) for b in gs)),
            "train.grad_set",
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


def read(path: Path) -> dict:
    "The checkpoint tree at `path`, with every part a Learner uses validated."
    tree = io.load(path)
    check(tree, path)
    return tree


def check(tree, path) -> None:
    """Raise `CheckpointError` naming `path` and what is wrong when `tree` is not a well-formed Learner
    checkpoint (what `learn.load` refuses before it looks at the learner). The command-line tool
    checks `info()` trees with it, their tensors replaced by stand-ins (`io.stand_ins`)."""
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict):
        raise CheckpointError(f"{path}: a fastai_resume file, but not a Learner checkpoint (no 'model' dict)")
    v = tree.get("fastai_resume")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise CheckpointError(f"{path}: no valid 'fastai_resume' schema version ({v!r:.20})")
    if v > STATE_VERSION:
        raise CheckpointError(
            f"{path}: written by a newer fastai_resume (schema {v}; this one reads up to "
            f"{STATE_VERSION}): upgrade fastai_resume to load it"
        )
    if "opt" in tree and not isinstance(tree["opt"], dict):
        raise CheckpointError(f"{path}: 'opt' is a {type(tree['opt']).__name__}, expected a dict")
    train = tree.get("train")
    if train is not None:
        if v < RESUMES_FROM:
            raise CheckpointError(
                f"{path}: its training position was saved by an older fastai_resume (schema {v}) "
                "and cannot be resumed exactly by this one; load(..., resume=False) loads its "
                "model and optimizer"
            )
        try:
            validate_train(train)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None


def load_tree(learn, path, tree, device, with_opt, strict):
    "Model and optimizer from a validated tree; nothing is changed unless everything fits."
    from fastai.torch_core import get_model, to_device

    model = get_model(learn.model)
    bad = model_mismatch(model.state_dict(), tree["model"], strict)
    if bad:
        raise CheckpointError(f"{path} does not fit this learner's model: {bad}")
    bad = strict and grads_mismatch(tree.get("train") or {}, len(list(learn.model.parameters())))
    if bad:  # (strict=False: checked when a resume restores them)
        raise CheckpointError(f"{path}: malformed training state: {bad}")
    prev_opt = None
    if with_opt and "opt" in tree:
        bad = opt_mismatch(learn.opt, tree["opt"])
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


def grads_mismatch(train: dict, n_params: int) -> str:
    "What is wrong with a training state's gradient lists for a model of `n_params` parameters ('' if nothing)."
    for key in ("grad_set", "grads"):
        saved = train.get(key)
        if saved is not None and len(saved) != n_params:
            return f"train.{key} has {len(saved)} entries, the model has {n_params} parameters"
    return ""


def model_mismatch(current: dict, saved: dict, strict: bool) -> str:
    "What keeps `saved` from loading into a model whose state dict is `current` ('' if nothing)."
    out = []
    if strict:
        missing, unexpected = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
        if missing:
            out.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            out.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for k in current.keys() & saved.keys():
        a, b = current[k], saved[k]
        if not isinstance(a, torch.Tensor):
            continue
        if not isinstance(b, torch.Tensor):
            out.append(f"{k}: a {type(b).__name__} in the file, a tensor in the model")
        elif a.shape != b.shape:
            out.append(f"{k}: shape {tuple(b.shape)} in the file, {tuple(a.shape)} in the model")
        elif a.dtype != b.dtype and not (a.is_floating_point() and b.is_floating_point()):
            out.append(f"{k}: dtype {b.dtype} in the file, {a.dtype} in the model")
    return "; ".join(sorted(out)[:8])


def opt_mismatch(opt, saved: dict) -> str:
    "What keeps an optimizer state dict from fitting `opt`'s parameters ('' if nothing)."
    params = [
        p
        for pg in getattr(opt, "param_lists", getattr(opt, "param_groups", []))
        for p in (pg["params"] if isinstance(pg, dict) else pg)
    ]
    states = saved.get("state")
    if isinstance(states, list) and params:  # fastai's Optimizer: one state dict per parameter
        if len(states) != len(params):
            return f"{len(states)} parameter states in the file, {len(params)} parameters"
        for i, (p, st) in enumerate(zip(params, states)):
            if not isinstance(st, dict):
                return f"state[{i}] is a {type(st).__name__}"
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.numel() > 1 and v.shape != p.shape:
                    return f"state[{i}][{k!r}]: shape {tuple(v.shape)}, parameter {tuple(p.shape)}"
                if not isinstance(v, (torch.Tensor, int, float, bool, type(None))):
                    return f"state[{i}][{k!r}] is a {type(v).__name__}"
    return ""


def rank_view(saved: dict) -> dict:
    """The saved training state as this rank sees it: its own RNG, loader and Recorder state from
    `ranks` (`fit` uses no saved state at all when the world size differs)."""
    ranks = saved.get("ranks")
    if not ranks or dist.rank() >= len(ranks):
        return saved
    mine = ranks[dist.rank()]
    return saved if mine is None else {**saved, **mine}
