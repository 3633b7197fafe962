"""fastai_resume: exact, crash-proof, mid-epoch resumable training for fastai.

`import fastai_resume` patches `Learner.save`, `Learner.load`, `Learner.fit` and the fit wrappers
on the installed fastai (`patches`); nothing else in the user's code changes, and nothing of fastai
is imported that the user's code does not import itself. Where things live:

    io.py, csrc/      the checkpoint format (pickle-free, verified, atomic)
    paths.py          where a name's file is (fastai's path / model_dir rules)
    checkpoint.py     the Learner's checkpoint tree: schema, validation, commit
    session.py        the script's stages and a fit's resume session (position, capture, skip)
    loaders.py        each DataLoader's iteration state and the skip of k batches
    state.py          RNG, Recorder and callback state
    autosave.py       AutoCheckpoint: when to save, retention, autoresume, preemption
    patches.py        the fastai patches
"""
from .io import EXT, CheckpointError, info, is_checkpoint, load, save
from . import patches  # noqa: F401  (applies the patches)
from .autosave import PREEMPTED_EXIT_CODE, AutoCheckpoint
from .session import ResumeSession

__version__ = "0.2.0"
__all__ = ["AutoCheckpoint", "PREEMPTED_EXIT_CODE", "CheckpointError", "EXT", "ResumeSession", "info",
           "is_checkpoint", "load", "save"]
