"""fastai's classes, looked up without importing them.

`import fastai_resume` must not import a fastai module the user's code does not import (fastai's modules
change its defaults when imported), so "is this object fastai's X?" is answered from the modules already
imported: an object can be an instance of a fastai class only once its module is.
"""

from __future__ import annotations

import sys

__all__ = ["fastai_class", "is_a"]


def fastai_class(module: str, name: str):
    "fastai's class `module.name`, or None if its module is not imported (then nothing can be one)."
    mod = sys.modules.get(module)
    return None if mod is None else getattr(mod, name, None)


def is_a(obj, module: str, name: str) -> bool:
    "Is `obj` an instance of fastai's `module.name` (or of a subclass)?"
    cls = fastai_class(module, name)
    return cls is not None and isinstance(obj, cls)
