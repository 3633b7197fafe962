"""What a checkpoint holds of a model: what training can change, and fingerprints for the frozen rest.

Fine-tuning (LoRA adapters on a `transformers` model, fastai's `freeze()`d body) trains a small part of
a model. A checkpoint's `model` holds every tensor training can change: each parameter with
`requires_grad` (fastai's `train_bn` norms inside a frozen body among them, which a filter by name
misses), every buffer, anything else in the state dict, and a frozen parameter whose bytes are not the
ones its stage began with (merge code, an EMA written into the base, a callback writing `.data`,
fastai's optimizer stepping a once-trained frozen parameter that still has a zero gradient). Each other
frozen parameter is recorded in the tree's `frozen` by fingerprint, not written:

    "frozen": {name: {"crc": CRC32C of its bytes, "shape": [...], "dtype": "float32"}}

"The bytes the stage started with" are the base: the fingerprint of every parameter, taken as each stage
of the script begins (`stage_began`, before a resume loads anything). Each save fingerprints the frozen
parameters again (one CRC32C pass over them, the hardware instruction on every core: `bench/llm.py`
measures it) and writes in full any that differ from the base; a rerun reaches that stage's start with
the same state (the script's promise, `between`), so it finds the others as they were.

A load checks each fingerprint against the learner before anything changes (`check`): another base, a
missing or extra tensor, another shape or dtype is refused, naming the first tensor that differs. A
load that arms a resume leaves the tensors that do not match yet to its fit's start (the script may load
them in between, as `load_encoder` does); the resumed fit checks those, and any loaded into since
(`recheck`), before it trains, and that the same parameters are frozen as when the checkpoint was saved
(`trainstate`). `full=True` saves every tensor; `checkpoint.make_full` writes a delta file's
self-contained twin from the learner it is checked against. A sharded (FSDP2) model's checkpoints hold
every tensor: each rank writes only its part already.
"""

from __future__ import annotations

import os

import torch

from . import dist, io
from .io import CheckpointError
from .script import script

__all__ = [
    "fingerprints",
    "stage_began",
    "base",
    "split",
    "validate",
    "stand_ins",
    "check",
    "recheck",
    "versions",
    "is_delta",
]

_THREADS = min(8, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else 1


def _bytes(t: torch.Tensor):
    "A tensor's bytes, in order, as a NumPy array (a copy only for a non-contiguous or device tensor)."
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def fingerprints(tensors: dict) -> dict:
    "`{name: {crc, shape, dtype}}` of `{name: tensor}`, the CRCs on every core at once."
    names = list(tensors)
    crcs = io.crc32c_many([_bytes(tensors[k]) for k in names], _THREADS)
    return {k: _fingerprint(tensors[k], c) for k, c in zip(names, crcs)}


def _fingerprint(t: torch.Tensor, crc: int) -> dict:
    return {"crc": crc, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _params(model) -> dict:
    "The model's parameters by their state-dict name (a tied parameter under each of its names)."
    return dict(model.named_parameters(remove_duplicate=False))


def stage_began(learn) -> None:
    """A stage of the script begins: the fingerprints of every parameter now are the base its saves compare
    the frozen ones against (before a resume's load: AutoCheckpoint's is a hook of the stage's start)."""
    from fastai.torch_core import get_model

    model = get_model(learn.model)
    script(learn).base = {} if dist.sharded(model) else fingerprints(_params(model))


def base(learn) -> dict:
    "The fingerprints the current stage began with (taken now for a save before any stage)."
    sc = script(learn)
    if sc.base is None:
        stage_began(learn)
    return sc.base or {}


def split(learn, sd: dict, full: bool = False) -> tuple[dict, dict | None]:
    """The state dict `sd` of the learner's model as a checkpoint holds it: `(held, frozen)`, `frozen`
    the fingerprints of the frozen parameters left out (None when every tensor is held)."""
    from fastai.torch_core import get_model

    model = get_model(learn.model)
    if full or dist.sharded(model):
        return sd, None
    params = _params(model)
    frozen = {k: sd[k] for k, p in params.items() if k in sd and not p.requires_grad and _same(sd[k], p)}
    if not frozen:
        return sd, None
    ref = base(learn)
    now = fingerprints(frozen)
    refs = {k: f for k, f in now.items() if ref.get(k) == f}  # changed since the base: held in full
    if not refs:
        return sd, None
    return {k: v for k, v in sd.items() if k not in refs}, refs


def _same(v, p) -> bool:
    "Whether the state dict's entry is the parameter's own tensor (a module may put something else there)."
    return isinstance(v, torch.Tensor) and v.shape == p.shape and v.data_ptr() == p.data_ptr()


def is_delta(tree) -> bool:
    "Whether a checkpoint tree leaves frozen tensors out (they must come from the learner)."
    return isinstance(tree, dict) and bool(tree.get("frozen"))


_DTYPES = {str(d).removeprefix("torch.") for d in io.TORCH_CODE}  # (those this torch has)


def validate(tree, path) -> None:
    "Raise `CheckpointError` when a tree's `frozen` field is malformed (before the learner is looked at)."
    refs = tree.get("frozen")
    if refs is None:
        return
    if not isinstance(refs, dict):
        raise CheckpointError(f"{path}: 'frozen' is a {type(refs).__name__}, expected a dict")
    for k, f in refs.items():
        where = f"{path}: frozen[{k!r}]"
        if not isinstance(k, str) or not isinstance(f, dict) or set(f) != {"crc", "shape", "dtype"}:
            raise CheckpointError(f"{where}: expected a name and {{crc, shape, dtype}}")
        crc, shape, dtype = f["crc"], f["shape"], f["dtype"]
        if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 1 << 32:
            raise CheckpointError(f"{where}.crc: expected a 32-bit checksum, got {crc!r:.40}")
        if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise CheckpointError(f"{where}.shape: expected a list of sizes, got {shape!r:.60}")
        if dtype not in _DTYPES:
            raise CheckpointError(f"{where}.dtype: {dtype!r:.40} is not a torch dtype")
        if k in tree["model"]:
            raise CheckpointError(f"{where}: also held in 'model' (a tensor is either held or referenced)")


def stand_ins(refs: dict) -> dict:
    "The referenced tensors as meta tensors of their shape and dtype (no memory): for the key and shape checks."
    return {k: torch.empty(f["shape"], dtype=getattr(torch, f["dtype"]), device="meta") for k, f in refs.items()}


def check(model, tree, path, defer: bool = False) -> dict | None:
    """Check the frozen tensors `tree` references against `model`'s (its names, shapes and dtypes were
    checked with the rest of the state dict): raise `CheckpointError` naming the first that differs, or,
    `defer`, say so and leave them to `recheck` at the resumed fit's start (a script may load them
    between its top and that fit, as `load_encoder` loads a classifier's encoder). Returns what `recheck`
    needs then (None for a self-contained tree)."""
    refs = tree.get("frozen")
    if not refs:
        return None
    sd = model.state_dict()
    now = fingerprints({k: sd[k] for k in refs})
    pending = [k for k, want in refs.items() if now[k] != want]
    if pending and not defer:
        raise CheckpointError(_differs(path, pending[0], refs[pending[0]], now[pending[0]]))
    if pending:
        print(
            f"fastai_resume: {len(pending)} of the frozen tensors {path} references are not this learner's yet "
            f"(the first: {pending[0]}); the resumed fit checks them as it starts"
        )
    return {"refs": refs, "seen": versions(sd, refs), "pending": pending}


def versions(sd: dict, names) -> dict:
    """Where each tensor's memory is and how often it was changed in place through autograd's view of it
    (`load_state_dict`, `copy_` under `no_grad`): what changes neither was not loaded into since."""
    return {k: (sd[k].data_ptr(), sd[k]._version) for k in names}


def recheck(model, checked: dict | None, source) -> None:
    """At a resumed fit's start: the referenced tensors that did not match at the load or were loaded into
    or replaced since (a between-stage `load`, a stage's end restored) are fingerprinted again; any that
    differs is refused, before the fit trains."""
    if not checked:
        return
    sd = model.state_dict()
    missing = [k for k in checked["refs"] if k not in sd]
    if missing:
        raise CheckpointError(
            f"{source}: this learner's model has no {missing[0]} (a frozen tensor the checkpoint references)"
        )
    now_at = versions(sd, checked["refs"])
    moved = {k: sd[k] for k, v in now_at.items() if v != checked["seen"][k] or k in checked["pending"]}
    if not moved:
        return
    for k, f in fingerprints(moved).items():
        if f != checked["refs"][k]:
            raise CheckpointError(_differs(source, k, checked["refs"][k], f) + " (checked as the resumed fit starts)")


def _differs(path, name, want, got) -> str:
    what = (
        f"shape {want['shape']} in the file, {got['shape']} here"
        if want["shape"] != got["shape"]
        else f"dtype {want['dtype']} in the file, {got['dtype']} here"
        if want["dtype"] != got["dtype"]
        else f"CRC32C {want['crc']:08x} in the file, {got['crc']:08x} here"
    )
    return (
        f"{path}: the frozen tensor {name} is not the one this checkpoint was saved with ({what}): the learner "
        "was built on another base model, or with other frozen weights. Build it on the base the run trained "
        "on; a checkpoint saved with full=True holds every tensor."
    )
