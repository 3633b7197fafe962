"""Where checkpoint files are: the one place that turns a learner and a name into a path.

fastai resolves `file` against `learn.path / learn.model_dir`, either of which may be relative (to the
current directory, as `Path('.')`, fastai's default, is) or absolute, str or `Path`. Everything here
(saving, loading, `AutoCheckpoint`'s listing and retention) resolves through `model_folder` and
`resolve`, which also expand `~` and return absolute paths: an absolute path handed back to
`learn.load` is never joined onto the folder a second time.
"""

from __future__ import annotations

import os
from pathlib import Path

from .io import EXT

__all__ = ["model_folder", "resolve", "is_path", "load_candidates", "MANIFEST"]

MANIFEST = "manifest.frk"  # what makes a folder a (sharded) checkpoint: `fastai_resume.sharded`


def is_path(file) -> bool:
    "A name or path (what fastai joins onto the model folder), as opposed to a buffer."
    return isinstance(file, (str, os.PathLike))


def model_folder(learn) -> Path:
    "`learn.path / learn.model_dir`, absolute, `~` expanded."
    return (Path(learn.path).expanduser() / Path(learn.model_dir).expanduser()).absolute()


def resolve(learn, file) -> Path:
    "The absolute path `file` means for `learn`, as fastai joins it (an absolute `file` stays itself)."
    return model_folder(learn) / Path(file).expanduser()


def with_ext(path: Path) -> Path:
    "The `.frk` file a resumable save of `path` writes."
    return path if path.suffix == EXT else path.with_name(path.name + EXT)


def load_candidates(learn, file) -> list:
    """The files `learn.load(file)` may mean: `file.frk`, fastai's `file.pth` (and `file` itself if it
    has either extension), or a folder `file.frk` (a sharded checkpoint), those that exist, newest
    first. The format of each is told later by its magic bytes."""
    base = resolve(learn, file)
    cands = [base.with_name(base.name + EXT), base.with_name(base.name + ".pth")]
    if base.suffix in (EXT, ".pth"):
        cands.append(base)
    found = []
    for c in dict.fromkeys(cands):
        if c.is_file():
            found.append((c.stat().st_mtime_ns, c))
        elif c.is_dir() and c.suffix == EXT:  # a sharded checkpoint (an unfinished one too: loading says so)
            m = c / MANIFEST  # (a folder's own time changes as files come and go: its manifest's)
            found.append(((m if m.is_file() else c).stat().st_mtime_ns, c))
    return [c for _, c in sorted(found, key=lambda x: x[0], reverse=True)]
