"""Which fastai releases this package is tested with, and a loud warning outside them.

The patches replace fastai internals (`Learner._do_fit`, `all_batches`, `_call_one`, the fit
wrappers) with copies that add the resume; a fastai release that changes those bodies can break a
resume silently. `make compat` runs the exactness tests on every release in `TESTED_FASTAI`, and
`REPLACED_SOURCES` records a hash of the source of each fastai function the package replaces or
relies on, the same in all of them: `tests/test_compat.py` fails when the installed fastai's differ.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import warnings

__all__ = [
    "TESTED_FASTAI",
    "REPLACED_SOURCES",
    "FastaiVersionWarning",
    "check_fastai_version",
    "fastai_sources",
    "source_hash",
    "changed_sources",
]

TESTED_FASTAI = ("2.8.9", "2.8.10", "2.8.11", "2.8.12")  # what `make compat` tests; keep pyproject.toml in step

# fastai file, then qualified name -> sha256 of its source text (first 16 hex digits), the same
# in every release of TESTED_FASTAI. `@patch`ed functions are found by name at module level.
REPLACED_SOURCES = {
    "learner.py": {
        "Learner._do_fit": "66298c9485be8d37",
        "Learner.all_batches": "1fba83b3b27aabb0",
        "Learner._call_one": "0fb7c5cd318df33c",
        "Learner.fit": "ea3d749b5657df47",
        "save": "9ea1f1e98c7370da",  # Learner.save and Learner.load are @patch'ed in at module level
        "load": "a45066302eeaeb72",
        "save_model": "46aa0a8e7347814b",
        "load_model": "a7aa2330993d26b8",
        "Learner._do_epoch": "20d8e12aaa646c16",
        "Learner._with_events": "b49008d1621cbaab",
        "Learner.one_batch": "71d20535da7aa979",
        "Recorder.before_fit": "bdaadb6cae4e9dd4",
        "Recorder.after_batch": "8e9f292da52732a8",
        "Recorder._stateattrs": "4d89c560c4760477",
        "AvgSmoothLoss": "b355619e83d54f3d",
    },
    "callback/schedule.py": {
        "fit_one_cycle": "d1445b15d5371219",
        "fit_flat_cos": "9473af35847c1d9b",
        "fit_sgdr": "bab56b68cf36d99e",
        "fine_tune": "13b633020bff7475",
        "ParamScheduler": "b94b2df176a48f8a",
    },
    # callbacks whose state is saved and restored by attribute name (state.py, trackers.py)
    "callback/tracker.py": {"TrackerCallback": "73b35ca9ba4b1174"},
    "callback/fp16.py": {"MixedPrecision": "70c92982ffe6a05a"},
    "callback/training.py": {"GradientAccumulation": "26f6ca3fc35fe416"},
    "callback/tensorboard.py": {
        "TensorBoardCallback": "1ed7c31b875461ee",
        "TensorBoardBaseCallback": "617eb28c398bcaea",
    },
    "callback/wandb.py": {
        "before_fit": "331e4be113bb7b69",
        "after_batch": "2864e157338e5d41",
        "after_epoch": "362b27f88ac26286",
    },  # WandbCallback's, @patch'ed
    "data/load.py": {
        "DataLoader.__iter__": "a8c7ec0cb5ed8b2b",
        "DataLoader.get_idxs": "e49f2fddb1206c3c",
    },
}


class FastaiVersionWarning(UserWarning):
    "The installed fastai is not one this package was tested with."


def _key(v: str) -> tuple:
    from packaging.version import Version

    return Version(v).release


def check_fastai_version(version: str | None = None) -> bool:
    """Warn (`FastaiVersionWarning`) if fastai `version` (the installed one by default) is outside
    the tested range. Returns True when it is inside."""
    if version is None:
        import fastai

        version = fastai.__version__
    lo, hi = TESTED_FASTAI[0], TESTED_FASTAI[-1]
    if _key(lo) <= _key(version) <= _key(hi):
        return True
    warnings.warn(
        f"fastai_resume is tested with fastai {lo} to {hi}, and fastai {version} is installed. It replaces "
        "fastai's training loop internals (Learner._do_fit, all_batches, _call_one, fit and the fit_one_cycle/"
        "fit_flat_cos/fit_sgdr/fine_tune wrappers, save/load) and restores Recorder and callback state by "
        "their attribute names: with another fastai a resumed run may differ from the uninterrupted one or "
        f"fail. Install fastai>={lo},<={hi} (`pip install 'fastai>={lo},<={hi}'`).",
        FastaiVersionWarning,
        stacklevel=2,
    )
    return False


def _fastai_dir() -> str:
    spec = importlib.util.find_spec("fastai")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fastai is not installed")
    return list(spec.submodule_search_locations)[0]


def _find(tree: ast.Module, qualname: str):
    "The node of `qualname` ('Class.method', 'Class.attr', 'Class' or a module-level function)."
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                and n.name == part
                or isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == part for t in n.targets)
            ),
            None,
        )
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def fastai_sources(root: str | None = None) -> dict:
    """{qualified name: source text} of every function in `REPLACED_SOURCES`, read from the fastai
    package at `root` (the installed one by default) without importing it, so that patched
    functions read as fastai wrote them. A name that is gone maps to None."""
    root = root or _fastai_dir()
    out = {}
    for rel, names in REPLACED_SOURCES.items():
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
        for name in names:
            node = _find(tree, name)
            out[name] = None if node is None else ast.get_source_segment(text, node)
    return out


def source_hash(src: str | None) -> str | None:
    return None if src is None else hashlib.sha256(src.encode()).hexdigest()[:16]


def changed_sources(root: str | None = None) -> list:
    "The names in `REPLACED_SOURCES` whose source in the fastai at `root` differs from the recorded one."
    recorded = {n: h for names in REPLACED_SOURCES.values() for n, h in names.items()}
    return sorted(n for n, src in fastai_sources(root).items() if source_hash(src) != recorded[n])
