"""fastai_resume: exact, crash-proof, mid-epoch resumable training for fastai.

`import fastai_resume` patches `Learner.save`, `Learner.load`, `Learner.fit` and the fit wrappers
on the installed fastai (`patches`), when fastai's Learner is imported (at once if it is already);
nothing else in the user's code changes, and nothing of fastai is imported that the user's code does
not import itself (the command-line tool imports no fastai at all). Where things live, bottom up:
each module imports only those listed before it (`tests/test_layering.py` checks it, function-level
imports too), and only io imports the C core.

    _core (csrc/), io.py   the checkpoint format (pickle-free, verified, atomic); the walk of a value tree
    fields.py              the validation kit: checks of a file's values that name the field they refuse
    pages.py               the kernel's word on this process's pages (PAGEMAP_SCAN, userfaultfd's write protection)
    provenance.py          which tensors' bytes are a file's, unwritten; the CRC32Cs of file regions read
    unwritten.py           which tensors' bytes nothing wrote since they were read (userfaultfd's write protection)
    pth.py                 a torch.save file (a vanilla fastai .pth) read without running code from it
    _hooks.py              code run when a module is imported (the patches wait for fastai's)
    paths.py               where a name's file is
    stored.py              a checkpoint on disk, a file or a folder: exists, size, removal; temporary files
    fastai_classes.py      "is this fastai's X?", without importing fastai
    dist.py                torch.distributed plumbing
    streams.py             what each stream library's state is worth (Hugging Face datasets, torchdata)
    state.py, loaders.py,  pieces of the training state: RNG, Recorder, hidden state, gradients;
    trackers.py,           each DataLoader's iteration state and the skip of k batches; the
    callbacks.py           callbacks' state (TensorBoard's and W&B's, fastai's, the user's hooks)
    datalog.py             what a stream fed each batch since the newest save: the evidence a rerun is checked against
    pieces.py              the training state as a table of pieces, each captured, checked, restored
    trainstate.py          a checkpoint's training state and a stage's end, built by walking the tables
    script.py              what is known about one learner's script (and the hooks that act on it)
    frozen.py              what a checkpoint holds of a model: what trains, the frozen rest by fingerprint
    checkpoint.py          the Learner checkpoint: its tree (the one home of its layout), read, load into the learner
    check.py               `fastai-resume check` (imported only where it runs a script; it acts by `script`'s hooks)
    snapshot.py            background saves (a copy at the batch boundary, written by a thread)
    shardfiles.py          a sharded checkpoint's files (a manifest, a file per rank): validated, read
                           without a model, described; any part of a saved tensor from its chunks
    sharded.py, dcp.py     a sharded (FSDP2) model's DTensors: a rank's file of local tensors, a folder read into
                           the model at any world size; torch.distributed.checkpoint (DCP) import and export
    store.py               one door to storage: a checkpoint saved (one file, or a sharded model's folder; now or
                           in the background), read and verified; every layout of a checkpoint on disk is here
    between.py, stages.py  the script's stages, their end states and what it does between them
    session.py             one fit's resume: its callback, position (at another world size too), skip, restore
    objstore.py            object storage (fsspec): checked transfers, markers; `learn.load(url)`
    lease.py               one run's lease on its remote folder: which process may write there
    remote.py              one run's checkpoints mirrored to object storage, resumed from it elsewhere
    runfolder.py,          AutoCheckpoint: a run's files (names, lock, retention); when to save,
    autosave.py            autoresume, preemption, the remote mirror
    compat.py              the fastai releases the patches are tested with
    patches.py             every patch of fastai
    fsdp.py                fsdp_ctx: training a model sharded with FSDP2 (torchrun, gloo or NCCL)
    __main__.py            the command-line tool (`fastai-resume`), its remote commands too
    __init__.py            this: the public names, each module imported on first use
    demo.py                `python -m fastai_resume.demo`: a user's script, killed and resumed
"""

import importlib
import os

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
    "make_full",
    "save",
]

_LAZY = {
    "AutoCheckpoint": "autosave",
    "PREEMPTED_EXIT_CODE": "autosave",
    "ResumeSession": "session",
    "fsdp_ctx": "fsdp",
    "make_full": "store",
}
_SUBMODULES = {
    "autosave",
    "between",
    "callbacks",
    "check",
    "checkpoint",
    "datalog",
    "dcp",
    "dist",
    "fields",
    "fsdp",
    "frozen",
    "lease",
    "loaders",
    "objstore",
    "patches",
    "paths",
    "pieces",
    "pth",
    "remote",
    "runfolder",
    "script",
    "session",
    "sharded",
    "shardfiles",
    "stages",
    "state",
    "store",
    "stored",
    "streams",
    "trainstate",
}


def __getattr__(name):  # fastai's classes are needed only once the user's code uses them
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fastai_resume' has no attribute {name!r}")


def _learner_imported() -> None:
    "fastai's Learner exists: the patches; in a process `fastai-resume check` runs, the check's hooks (`script`)."
    importlib.import_module(".patches", __name__)
    if os.environ.get("FASTAI_RESUME_CHECK"):
        importlib.import_module(".check", __name__)


after_import("fastai.learner", _learner_imported)  # (one hook per module: `after_import` keeps the first)
after_import("fastai.callback.schedule", lambda: importlib.import_module(".patches", __name__)._patch_schedule())
after_import("fastai.distributed", lambda: importlib.import_module(".patches", __name__).patch_distributed_dl())
