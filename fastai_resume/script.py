"""What fastai_resume knows about one Learner's training script, kept outside the Learner.

`Script` lives in a weak table here, never on the Learner (an exported or pickled Learner carries none
of it): the stages finished so far, the one in progress, the fit in progress (its `ResumeSession`), a
resume armed by `learn.load` (`Armed`), the end states of finished stages and the log of what the
script did between them (`between`).
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Script",
    "Armed",
    "Interrupted",
    "script",
    "session_of",
    "say",
    "checking",
    "CHECK_ENV",
    "STAGE_BEGIN_HOOKS",
    "DISARM_HOOKS",
    "BETWEEN_HOOKS",
    "FIT_HOOKS",
]

# Those who act on the script register here, rather than being looked up by it (the runtime never imports
# `check`: the package imports it in the processes `fastai-resume check` runs, and it registers its hooks):
STAGE_BEGIN_HOOKS: list = []  # `hook(learn, stage)` as a stage begins: `fastai-resume check`, AutoCheckpoint
DISARM_HOOKS: list = []  # `hook(why)` when an armed resume is cancelled: `fastai-resume check`
BETWEEN_HOOKS: list = []  # `hook(at, op, file, digest)` per between-stage call, under `fastai-resume check`
FIT_HOOKS: list = []  # `hook(learn)`: a callback for each resumable fit, or None: `fastai-resume check`'s probe

CHECK_ENV = "FASTAI_RESUME_CHECK"  # set in the processes `fastai-resume check` runs


def checking() -> bool:
    "Does this process run under `fastai-resume check` (where AutoCheckpoint neither saves nor resumes)?"
    return bool(os.environ.get(CHECK_ENV))


def say(msg: str, stacklevel: int = 2) -> None:
    """What the operator must hear even where warnings are filtered out: a warning and a printed line.
    `stacklevel` counts as `warnings.warn` would from the caller (2: the warning points at the caller's caller)."""
    warnings.warn(msg, stacklevel=stacklevel + 1)
    print(msg, flush=True)


class Armed:
    """A resume armed by `learn.load` of a checkpoint saved mid-fit; the next matching fit consumes it.
    Until then the script replays what the uninterrupted run did before that fit (`between`): `ends`,
    the end states of the stages it skips; `log`, its between-stage calls (`used`: those replayed);
    `divergent`, why the learner does not hold the uninterrupted run's state at this line (None when it
    does: where the load left the learner as it was, until a stage is passed without its end state).
    `model` and `opt` are the checkpoint's model and optimizer state: the resumed fit puts them in,
    so nothing the script does before it (a stage end restored, a named model loaded, its own code) can
    change where it continues. `model` is the tree the load read (no copy; the peak memory is the
    load's), held until that fit starts. `frozen`: the frozen tensors the file references
    (`frozen.recheck` checks them as that fit starts)."""

    def __init__(self, train: dict, path: Path, opt: dict | None, fast_forward: bool = False, model=None):
        self.train, self.path, self.opt, self.fast_forward = train, path, opt, fast_forward
        script = train.get("script") or {}
        self.ends: list = list(script.get("ends", []))
        self.log: list = list(script.get("log", []))
        self.used: set = set()
        self.divergent: str | None = (
            f"holds the state of {path.name} (saved in stage {self.position['stage']}, epoch "
            f"{self.position['epoch']}, iteration {self.position['iter']})"
        )
        self.model = model
        self.frozen: dict | None = None  # the frozen tensors the file references (`frozen.recheck` at the fit)

    @property
    def position(self) -> dict:
        return self.train["position"]


@dataclass
class Interrupted:
    stage: int
    epoch: int
    iter: int


class Script:
    "What fastai_resume knows about one Learner's training script (kept outside the Learner)."

    def __init__(self):
        self.armed: Armed | None = None
        self.signatures: list = []  # of the stages finished in this process
        self.stage = None  # the `stages.Stage` in progress: the top-level call
        self.session = None  # the `session.ResumeSession` of the fit in progress  # the fit in progress
        self.fit_depth = 0  # fits in progress (a resumable one, and any fit run inside it or by lr_find)
        self.interrupted: Interrupted | None = None
        self.ends: list = []  # per finished stage: its end state's file {file, token}, or None (`between`)
        self.log: list = []  # the between-stage calls of the script (`between.note`)
        self.base: dict | None = None  # the frozen parameters' fingerprints as the stage began (`frozen`)
        self.script_base: dict | None = None  # ... as the script's first stage began (`frozen`)
        # AutoCheckpoint runs of this script, by (folder, fname, run id): shared by every instance of
        # one run (a new AutoCheckpoint passed to each fit call is the same run, its files named alike).
        self.autosave_runs: dict = {}

    def disarm(self, why: str | None = None) -> None:
        if self.armed is not None and why:
            msg = (
                f"fastai_resume: {why}: the resume armed from {self.armed.path} is cancelled; the next training "
                "call starts from the learner's current weights, not where the checkpoint was saved"
            )
            say(msg, stacklevel=3)
            for hook in DISARM_HOOKS:
                hook(why)
        self.armed = None


_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def script(learn) -> Script:
    s = _scripts.get(learn)
    if s is None:
        s = _scripts[learn] = Script()
    return s


def session_of(learn):
    s = _scripts.get(learn)
    return None if s is None else s.session
