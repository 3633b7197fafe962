"""Run code once a module has been imported, without importing it (a post-import hook).

`import fastai_resume` must not import anything of fastai that the user's code does not import itself
(fastai's modules change its defaults when imported: `fastai.callback.progress` adds a progress bar
to every Learner). So the patches of `fastai.learner` and of the fit wrappers that
`fastai.callback.schedule` defines are applied when those modules are imported, or at once if they
already are.
"""

from __future__ import annotations

import importlib.abc
import sys

__all__ = ["after_import", "imported"]


class _AfterImport(importlib.abc.MetaPathFinder):
    "Finds `name` with the other finders, and wraps its loader to call `then()` after executing it."

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if type(finder).__name__ == "_AfterImport" or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        inner, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                then()

        spec.loader = Loader()
        return spec


def imported(name: str) -> bool:
    "Is module `name` imported and done executing (not in the middle of its own import)?"
    mod = sys.modules.get(name)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


def after_import(name: str, then) -> None:
    """Call `then()` now if module `name` is imported, else right after its import (once; idempotent per
    name). A module in the middle of its import gets it from a hook installed before its import began."""
    if imported(name):
        then()
    elif name in sys.modules:
        return
    elif not any(type(f).__name__ == "_AfterImport" and getattr(f, "name", None) == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))
