"""fastai_resume: exact, crash-proof, mid-epoch resumable training for fastai.

`import fastai_resume` patches `Learner.save`, `Learner.load` and `Learner.fit` (and the fit
wrappers) on the installed fastai; nothing else in the user's code changes.
"""
from .io import CheckpointError, EXT, info, is_checkpoint, load, save
from .learner import ResumeCallback
from .autosave import AutoCheckpoint, PREEMPTED_EXIT_CODE

__version__ = "0.1.0"
__all__ = ["AutoCheckpoint", "PREEMPTED_EXIT_CODE", "CheckpointError", "EXT", "ResumeCallback", "info", "is_checkpoint", "load", "save"]
