"""The training state a checkpoint holds, and the state a stage leaves when it ends (`between`), each
built by walking its table of pieces (`pieces.CHECKPOINT`, `pieces.STAGE_END`): its schema version, its
capture from a fit (or a stage's end), its validation when a file is read, its restore into the next fit
(or into the learner as a skipped stage ended). A new piece of training state is an entry of a table in
`pieces` (and its test), not a change here.

Validation raises `CheckpointError` naming the first malformed field, so a wrong or hostile file is
refused before anything is changed, never with an error later in `fit`.
"""

from __future__ import annotations

import torch

from . import dist, state
from .fields import a_dict, a_list, refused
from .io import CheckpointError
from .pieces import CHECKPOINT, STAGE_END, Now, grads_mismatch, saved_rng, script_part
from .state import check_recorder, check_rng, recorder_numbers, set_recorder_numbers

__all__ = [
    "VERSION",
    "RESUMES_FROM",
    "capture",
    "validate",
    "validate_end",
    "rank_view",
    "training_device",
    "restore_fit",
    "restore_epoch",
    "end_tree",
    "restore_end",
    "script_part",
    "recorder_numbers",
    "set_recorder_numbers",
    "grads_mismatch",
    "saved_rng",
]

# 4: frozen parameters by fingerprint (`frozen`), the trainable map; 3: the Recorder's lrs as one float64 tensor;
# 2: stages, loader states, validation-time RNG
VERSION = 4
RESUMES_FROM = 2  # training positions saved by older schemas are refused with a message (1: no stages)


# ---- a layout from its table --------------------------------------------------------------------------


def _capture(table, now: Now, what: str) -> dict | None:
    """The layout of `table`, captured now, its keys in the table's order. Collective under DDP: every
    rank's per-rank pieces go to rank 0, which writes them under `ranks` (right after its own); ranks other
    than 0 get None. A sharded model: every rank writes its own file (`sharded`), nothing is gathered."""
    per_rank = dist.sharded(now.learn.model)
    mine = {k: v for p in table if p.per_rank for k, v in p.capture(now).items()}
    ranks = dist.gather(what, mine) if dist.active() and not per_rank else None  # a step
    if dist.rank() != 0 and not per_rank:
        return None  # rank 0 writes
    last = max(i for i, p in enumerate(table) if p.per_rank)
    tree: dict = {}
    for i, p in enumerate(table):
        tree.update({k: mine[k] for k in p.keys} if p.per_rank else p.capture(now))
        if i == last:
            tree["ranks"] = None if ranks is None else [None] + ranks[1:]  # rank 0's are the fields above
    return tree


def _check(tree, where: str, table) -> None:
    """Raise `Bad` naming the first malformed field of the layout `tree` of `table`: every required key
    first, then each piece in the table's order (a later piece may rely on an earlier one: the stages on
    the position), then each other rank's part."""
    t = a_dict(tree, where, [k for p in table for k in p.required])
    for p in table:
        if p.check is not None:
            p.check(t, where)
    if t.get("ranks") is None:
        return
    per_rank = [p for p in table if p.per_rank]
    for i, r in enumerate(a_list(t["ranks"], f"{where}.ranks")):
        if r is not None:
            at = f"{where}.ranks[{i}]"
            a_dict(r, at, [k for p in per_rank for k in p.required])
            for p in per_rank:
                p.check(r, at)


def _disagreement(table, learn, tree) -> str:
    "What makes `tree` unfit for this learner: the first piece's that says ('' if none)."
    for p in table:
        bad = p.agree(learn, tree) if p.agree is not None else ""
        if bad:
            return bad
    return ""


def rank_view(saved: dict) -> dict:
    """The saved training state (or end state) as this rank sees it: its own per-rank pieces from `ranks`
    (`fit` uses no saved state at all when the world size differs)."""
    ranks = saved.get("ranks")
    if not ranks or dist.rank() >= len(ranks):
        return saved
    mine = ranks[dist.rank()]
    return saved if mine is None else {**saved, **mine}


# ---- a checkpoint's training state ----------------------------------------------------------------


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
    n_iter = len(learn.dls.train)
    now = Now(
        learn,
        s.stage,
        s=s,
        epoch=epoch,
        it=it,
        n_iter=n_iter,
        validating=s.rng_valid is not None and epoch == s.epoch and it == n_iter,
        boundary=it == 0,
        # saved after the training loop ended (after_train, validation): the loader had read all of the
        # epoch, the partial batch drop_last discards included; from after_batch of the last batch it had not
        loader_done=epoch == s.epoch and it == n_iter and not (learn.training and s.frames.event == "after_batch"),
    )
    return _capture(CHECKPOINT, now, "the ranks' training state")


def validate(train) -> None:
    "Raise `CheckpointError` naming the first field of a training-state tree that is malformed."
    with refused("malformed training state: "):
        _check(train, "train", CHECKPOINT)


def _part_validator(check):
    "A validator of one part, raising `CheckpointError` (`between` checks what it replays of lr_find)."

    def validate(v, where: str) -> None:
        with refused("malformed training state: "):
            check(v, where)

    return validate


validate_rng, validate_recorder = _part_validator(check_rng), _part_validator(check_recorder)


def training_device(learn) -> torch.device:
    "The device the fit trains on: the loaders' (as fastai's `load` and `TrainEvalCallback` use), else the parameters'."
    dev = getattr(learn.dls, "device", None)
    if dev is None:
        dev = next(iter(learn.model.parameters()), torch.empty(0)).device
    return torch.device(dev)


def _on_training_device(learn, tree):
    """`tree` (an optimizer state kept on the CPU since `learn.load`) on the device the fit trains on
    (`training_device`). On the CPU a CUDA fit's first step failed: Adam's moments on the CPU, the
    gradients on the GPU."""
    from fastai.torch_core import to_device

    dev = training_device(learn)
    return tree if dev.type == "cpu" else to_device(tree, dev)


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
    does), then each piece restored at the fit's start (`Piece.at_fit`: the gradients, the
    hyper-parameters fit() has just reset, the Recorder, the callbacks), once every piece agrees with the
    learner: before anything changes (the same parameters frozen as at the save), or as the checkpoint's
    optimizer state made it (its groups and hyper-parameters are the file's). Returns the printed rows of
    the finished epochs."""
    for loaded in (False, True):  # what does not read the optimizer's state before anything changes
        if loaded:
            put_state(learn, model_state, opt_state)
        bad = _disagreement([p for p in CHECKPOINT if p.agree_loaded == loaded], learn, sv)
        if bad:
            raise CheckpointError(f"{source}: {bad}")
    for p in CHECKPOINT:
        if p.at_fit is not None:
            p.at_fit(learn, sv)
    return [list(r) for r in sv["rows"]]


def restore_epoch(learn, sv: dict, at_save: bool, k: int) -> None:
    """At the start of the resumed epoch, `k` batches into it, each piece restored there
    (`Piece.at_epoch`): the schedule's position, the RNG and loaders (as at the save when `at_save`, else as
    at the epoch's start), and mid-epoch the models' hidden state and the train metrics."""
    for p in CHECKPOINT:
        if p.at_epoch is not None:
            p.at_epoch(learn, sv, at_save, k)


# ---- the state a stage ends with ---------------------------------------------------------------


def end_tree(learn, st) -> dict | None:
    """The state stage `st` ends with, beside the model and optimizer (collective under DDP: every rank's
    RNG, loaders and Recorder); ranks other than 0 get None."""
    return _capture(STAGE_END, Now(learn, st, ending=True), "the ranks' end states")


def validate_end(end, path, learn) -> None:
    """Raise `CheckpointError` naming `path` and the first malformed field of a stage's end state, or what
    does not fit `learn` (its model's parameter count)."""
    with refused(f"{path}: malformed stage end: "):
        _check(end, "end", STAGE_END)
    bad = _disagreement(STAGE_END, learn, end)
    if bad:
        raise CheckpointError(f"{path}: malformed stage end: {bad}")


def restore_end(learn, end: dict) -> None:
    """The learner as the stage ended (its model and optimizer already loaded), each piece restored
    (`Piece.at_end`): RNG, loaders, the tensors the model keeps between batches, Recorder, callbacks,
    gradients, the model's mode, the learner's counters."""
    end = rank_view(end)
    for p in STAGE_END:
        if p.at_end is not None:
            p.at_end(learn, end)
