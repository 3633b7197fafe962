"""A torch.save file (a vanilla fastai .pth, as fastai's `learn.save` writes it) read without running code
from it: what `fastai-resume convert` turns into a fastai_resume checkpoint. Anything a file holds beyond
tensors, containers and what fastai's own optimizer state needs is refused, before torch unpickles it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .io import CheckpointError

__all__ = ["ZIP", "allowed_globals", "read"]

ZIP = b"PK\x03\x04"  # torch.save's format (since torch 1.6), so every vanilla fastai .pth


def _torch_says(e: Exception, path) -> str:
    "What torch's error says, in its own words (its unpickler's after its preamble), without the path."
    msg = str(e)
    if "WeightsUnpickler error:" in msg:
        msg = msg.split("WeightsUnpickler error:", 1)[1]
    msg = next((line.strip() for line in msg.splitlines() if line.strip()), type(e).__name__)
    for lead in (f"{path}: ", f"{path} "):
        if msg.startswith(lead):
            return msg[len(lead) :]
    return msg


def allowed_globals() -> list:
    """What fastai's own .pth files hold besides tensors and containers: NumPy scalars (an
    Optimizer's hyper-parameters), their dtypes, and fastcore's `L`. Nothing else is unpickled."""
    import numpy as np
    from fastcore.foundation import L

    scalar = np.float64(0).__reduce__()[0]  # NumPy's scalar reconstructor, found by the public pickle protocol
    # files written under NumPy 2 name it numpy._core..., under NumPy 1 numpy.core...
    return [
        (scalar, "numpy._core.multiarray.scalar"),
        (scalar, "numpy.core.multiarray.scalar"),
        np.dtype,
        L,
        *(getattr(np.dtypes, d) for d in np.dtypes.__all__),
    ]  # the classes of the dtypes unpickled


def read(src: Path, head: bytes) -> tuple:
    """The state dict(s) in a torch.save file (`head`: its first bytes): the model's, and the optimizer's or None,
    loaded without running code from it (only `allowed_globals` are unpickled)."""
    import torch

    allowed = allowed_globals()
    if head.startswith(ZIP):
        names = {n for x in allowed for n in ([x[1]] if isinstance(x, tuple) else [f"{x.__module__}.{x.__qualname__}"])}
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(src)
        except Exception as e:  # a damaged zip: torch raises what its parser meets
            raise CheckpointError(f"{src}: a damaged torch.save file ({_torch_says(e, src)})") from None
        other = sorted(set(found) - names)
        if other:
            raise CheckpointError(
                f"{src}: holds {', '.join(other)}, not only tensors and fastai's optimizer state; "
                "not loaded (convert never runs code from a file)"
            )
    try:  # (torch warns about pickle protocols it may not read: the error, if any, says what matters)
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            st = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # whatever torch's unpickler meets in a file that is not one of its own
        if not head.startswith(ZIP):
            raise CheckpointError(
                f"{src}: neither a fastai_resume checkpoint (no magic bytes) nor a torch.save file"
            ) from None
        raise CheckpointError(
            f"{src}: a torch.save file that torch.load cannot read safely ({_torch_says(e, src)})"
        ) from None
    model, opt = (st["model"], st["opt"]) if isinstance(st, dict) and set(st) == {"model", "opt"} else (st, None)
    if not (
        isinstance(model, dict)
        and model
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())
    ):
        raise CheckpointError(
            f"{src}: a torch.save file, but not a fastai model: expected a state dict, "
            "or {'model': state dict, 'opt': ...} as learn.save writes"
        )
    return model, opt
