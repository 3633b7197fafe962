"""fastai_resume: exact, crash-proof, mid-epoch resumable training for fastai.

`import fastai_resume` patches `Learner.save`, `Learner.load`, `Learner.fit` and the fit wrappers
on the installed fastai (`patches`), when fastai's Learner is imported (at once if it is already);
nothing else in the user's code changes, and nothing of fastai is imported that the user's code does
not import itself (the command-line tool imports no fastai at all). Where things live:

    io.py, csrc/      the checkpoint format (pickle-free, verified, atomic)
    paths.py          where a name's file is (fastai's path / model_dir rules)
    checkpoint.py     the Learner's checkpoint tree: schema, validation, commit
    session.py        the script's stages and a fit's resume session (position, capture, skip)
    loaders.py        each DataLoader's iteration state and the skip of k batches
    state.py          RNG, Recorder and callback state
    autosave.py       AutoCheckpoint: when to save, retention, autoresume, preemption
    fsdp.py           fsdp_ctx: training a model sharded with FSDP2 (torchrun, gloo or NCCL)
    sharded.py        a sharded model's checkpoints: one file per rank, a manifest; other world sizes
    dcp.py            torch.distributed.checkpoint (DCP) import and export
    patches.py        the fastai patches
"""

import importlib

from ._hooks import after_import
from .io import EXT, CheckpointError, info, is_checkpoint, load, save

__version__ = "0.2.0"
__all__ = [
    "AutoCheckpoint",
    "PREEMPTED_EXIT_CODE",
    "CheckpointError",
    "EXT",
    "ResumeSession",
    "fsdp_ctx",
    "info",
    "is_checkpoint",
    "load",
    "save",
]

_LAZY = {
    "AutoCheckpoint": "autosave",
    "PREEMPTED_EXIT_CODE": "autosave",
    "ResumeSession": "session",
    "fsdp_ctx": "fsdp",
}
_SUBMODULES = {
    "autosave",
    "checkpoint",
    "dcp",
    "dist",
    "fsdp",
    "loaders",
    "patches",
    "paths",
    "session",
    "sharded",
    "state",
}


def __getattr__(name):  # fastai's classes are needed only once the user's code uses them
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fastai_resume' has no attribute {name!r}")


after_import("fastai.learner", lambda: importlib.import_module(".patches", __name__))
after_import("fastai.callback.schedule", lambda: importlib.import_module(".patches", __name__)._patch_schedule())
