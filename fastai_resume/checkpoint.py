"""The checkpoint a Learner saves: its tree (the one home of its layout), its read and its load into the learner.

    {"fastai_resume": STATE_VERSION,
     "model": state dict (of a model fine-tuned with frozen parameters: what training can change),
     "frozen": fingerprints of the frozen parameters left out of "model" (`frozen`; absent when none),
     "opt": optimizer state dict (with_opt),
     "train": None (saved outside a fit) | the training state (`trainstate`),
     "end": the state a stage ended with (a stage's end file only, `between`)}

The keys are this module's: others read a tree through its accessors (`position`, `kind`, `slot`,
`tensor_slots`, `training`, `end_state`). Where a tree goes on disk (one file, a sharded model's folder) is `store`'s.

Loading validates the whole tree before anything is changed: the model's keys, types, dtypes and
shapes against the learner's, the frozen tensors it references against the learner's by fingerprint,
the optimizer state's shape, and every field of the training state
(`trainstate.validate`), so a wrong or hostile file gets a `CheckpointError` naming the field, never a
half-loaded learner or an error later in `fit`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import dist, frozen, io, trainstate
from .io import CheckpointError
from .script import session_of
from .state import opt_state_for, plain

__all__ = [
    "STATE_VERSION",
    "build_tree",
    "training",
    "end_state",
    "position",
    "kind",
    "slot",
    "tensor_slots",
    "read",
    "check",
    "load_tree",
    "model_mismatch",
]

STATE_VERSION = trainstate.VERSION


def model_tree(learn, with_opt: bool, full: bool = False) -> dict:
    """The model (what training can change, the frozen rest by fingerprint unless `full`) and the optimizer."""
    from fastai.torch_core import get_model

    held, refs = frozen.split(learn, get_model(learn.model).state_dict(), full)
    tree = {"fastai_resume": STATE_VERSION, "model": held}
    if refs:
        tree["frozen"] = refs
    opt = getattr(learn, "opt", None)
    if with_opt and opt is not None:
        tree["opt"] = opt.state_dict()
    return plain(tree)


def build_tree(learn, with_opt=True, with_iter=False, full=False) -> dict | None:
    """What a save stores: the model, the optimizer and, `with_iter`, the training position and state.
    Under torch.distributed, `with_iter` is collective (every rank's RNG, loader and Recorder state go
    to rank 0) and ranks other than 0 get None: they have nothing to write. A sharded model's ranks each
    get their own tree (DTensors in it), with nothing gathered (`store.save` writes it)."""
    with dist.one_answer():
        return _build_tree(learn, with_opt, with_iter, full)


def _build_tree(learn, with_opt, with_iter, full) -> dict | None:
    train = None
    if with_iter:
        if getattr(learn, "opt", None) is None:
            raise ValueError("save(with_iter=True): the learner has no optimizer yet (call fit or create_opt first)")
        s = session_of(learn)
        train = trainstate.capture(s) if s is not None else None
    if dist.rank() != 0 and not dist.sharded(learn.model):
        return None
    tree = model_tree(learn, with_opt, full)
    if with_iter:
        tree["train"] = train
    return tree


def cloned(tree):
    "`tree` with every tensor and array copied (what a live object may change in place stays apart)."
    return io.map_tree(
        tree, lambda v: v.clone() if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v
    )


def training(tree) -> dict | None:
    "A checkpoint's training state (`trainstate`; None: saved outside a fit)."
    train = tree.get("train") if isinstance(tree, dict) else None
    return train if isinstance(train, dict) else None


def end_state(tree) -> dict | None:
    "The state a stage ended with, in a stage's end file (`between`; None in any other)."
    end = tree.get("end") if isinstance(tree, dict) else None
    return end if isinstance(end, dict) else None


def position(tree) -> dict | None:
    "The training position a checkpoint was saved at (None: saved outside a fit, or not a checkpoint)."
    train = training(tree)
    return dict(train["position"]) if train is not None and isinstance(train.get("position"), dict) else None


def kind(tree) -> str:
    "'end' (a stage's end state), 'checkpoint' (a position to resume), 'model' (model and optimizer) or 'other'."
    if not isinstance(tree, dict):
        return "other"
    return "end" if "end" in tree else "checkpoint" if training(tree) is not None else "model"


def slot(path) -> tuple | None:
    """What the tensor at `path` (a tuple of keys) of a tree is of the learner: ("model", name) an entry of the
    model's state dict, ("opt", i) part of parameter i's optimizer state, ("grad", i) parameter i's pending
    gradient; None for anything else."""
    if len(path) == 2 and path[0] == "model":
        return "model", path[1]
    if len(path) >= 4 and path[0] == "opt" and path[1] == "state" and isinstance(path[2], int):
        return "opt", path[2]
    if len(path) == 3 and path[0] == "train" and path[1] == "grads" and isinstance(path[2], int):
        return "grad", path[2]
    return None


def tensor_slots(tree):
    "Every (path, value) of `tree` in a slot (`slot`): the model's entries, the optimizer's states, the gradients."
    for name, v in list((tree.get("model") or {}).items()):
        yield ("model", name), v
    states = (tree.get("opt") or {}).get("state")
    items = states.items() if isinstance(states, dict) else enumerate(states or [])
    for i, st in list(items):
        if isinstance(st, dict):
            for k, v in list(st.items()):
                yield ("opt", "state", i, k), v
    for i, g in enumerate((training(tree) or {}).get("grads") or []):
        yield ("train", "grads", i), g


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
    frozen.validate(tree, path)
    if "opt" in tree and not isinstance(tree["opt"], dict):
        raise CheckpointError(f"{path}: 'opt' is a {type(tree['opt']).__name__}, expected a dict")
    train = tree.get("train")
    if train is not None:
        if v < trainstate.RESUMES_FROM:
            raise CheckpointError(
                f"{path}: its training position was saved by an older fastai_resume (schema {v}) "
                "and cannot be resumed exactly by this one; load(..., resume=False) loads its "
                "model and optimizer"
            )
        try:
            trainstate.validate(train)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None


def load_tree(learn, path, tree, device, with_opt, strict, defer_frozen=False, apply=True, known=None) -> dict | None:
    """Model and optimizer from a validated tree; nothing is changed unless everything fits (the frozen
    tensors it references included, unless `defer_frozen`: a resume checks them as its fit starts), and
    nothing at all unless `apply` (validated only: a resume's fit puts them in); `known`: fingerprints of
    the frozen parameters nothing changed since (`frozen.check`). Returns the frozen tensors it
    references (None for a self-contained tree)."""
    from fastai.torch_core import get_model, to_device

    model = get_model(learn.model)
    model_mismatch_or_raise(model, tree, path, strict)
    checked = frozen.check(model, tree, path, defer=defer_frozen, known=known)
    bad = strict and trainstate.grads_mismatch(tree.get("train") or {}, len(list(learn.model.parameters())))
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
            learn.opt.load_state_dict(opt_state_for(learn.opt, opt_sd))
        except (AssertionError, KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:
            learn.opt.load_state_dict(prev_opt)
            raise CheckpointError(
                f"{path}: its optimizer state does not fit this learner's optimizer "
                f"(different parameter groups?): {e!r}"
            ) from None
        if not apply:
            learn.opt.load_state_dict(prev_opt)
            prev_opt = None
    if not apply:
        return checked
    try:  # (the frozen tensors a delta tree references are the learner's: checked above, or at the resumed fit)
        model.load_state_dict(tree["model"], strict=strict and not frozen.is_delta(tree))
    except RuntimeError as e:  # checked above; kept for what torch checks beyond keys, dtypes and shapes
        if prev_opt is not None:
            learn.opt.load_state_dict(prev_opt)
        raise CheckpointError(f"{path} does not fit this learner's model: {e}") from None
    return checked


def model_mismatch_or_raise(model, tree, path, strict) -> None:
    "Raise `CheckpointError` when the tree's model (held tensors and referenced ones) does not fit `model`."
    bad = model_mismatch(model.state_dict(), {**tree["model"], **frozen.stand_ins(tree.get("frozen") or {})}, strict)
    if bad:
        raise CheckpointError(f"{path} does not fit this learner's model: {bad}")


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
